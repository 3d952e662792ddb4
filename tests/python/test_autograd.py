"""Autograd of deep_ep::dispatch and deep_ep::combine (python/deep_ep_rs/_autograd.py).

- A small MoE layer (router -> get_dispatch_layout -> dispatch -> per-expert linear on recv rows
  weighted by recv_topk_weights -> combine) is trained one step: its output and the gradients of
  x, the router and the expert weights must match the same layer written in plain fp32 torch on
  the full (gathered) problem, to bf16 accuracy (relative error < 1e-2). 1 rank in-process and 2
  ranks in the rank pool, data-dependent and worst-case dispatch.
- Bit-exact: backward(dispatch) == combine of the same gradient (x and topk_weights), and
  backward(combine) == cached_dispatch of the gradient (x and topk_weights).
- torch.library.opcheck (all four checks, test_autograd_registration included) with inputs that
  require grad.
"""
import pytest
import torch

import deep_ep_rs  # noqa: F401  (registers ops, fake kernels and autograd)
from deep_ep_rs._autograd import cached_dispatch_rows_f32

HIDDEN, NUM_TOPK, EXPERTS_PER_RANK = 64, 2, 2
CFG = [4, 6, 256, 6, 128]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def params(num_ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = EXPERTS_PER_RANK * num_ranks
    router = torch.randn((HIDDEN, e), generator=g) / 8
    w_all = (torch.randn((e, HIDDEN, HIDDEN), generator=g) / 8).to(torch.bfloat16)
    return router, w_all


def inputs(rank, n, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    target = torch.randn((n, HIDDEN), generator=g)
    return x, target


def layer_deep_ep(handle, num_ranks, rank, x, router, w_local, worst):
    ops = torch.ops.deep_ep
    scores = torch.softmax(x.float() @ router, dim=-1)
    topk_w, topk_idx = torch.topk(scores, NUM_TOPK, dim=-1)
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(topk_idx, EXPERTS_PER_RANK * num_ranks, num_ranks)
    recv_x, _, recv_idx, recv_w, _, rpm, cpm, rcpm, src_idx, send_head = ops.dispatch(
        handle, x, None, topk_idx, topk_w, ntpr, in_rank, ntpe, 1, worst, CFG)
    out = torch.zeros((recv_x.shape[0], HIDDEN), dtype=torch.float32)
    for e in range(EXPERTS_PER_RANK):
        gate = torch.where(recv_idx == e, recv_w, torch.zeros_like(recv_w)).sum(dim=-1, keepdim=True)
        out = out + gate * (recv_x @ w_local[e]).float()
    y = out.to(torch.bfloat16)
    combined, _ = ops.combine(handle, y, None, None, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, CFG)
    return combined


def layer_reference(xs, router, w_all):
    """Plain fp32 torch on the full problem; xs = every rank's x (routing per rank chunk, same ops
    and shapes as the deep_ep layer so the top-k choice is identical)."""
    outs = []
    for x in xs:
        scores = torch.softmax(x @ router, dim=-1)
        topk_w, topk_idx = torch.topk(scores, NUM_TOPK, dim=-1)
        y = torch.einsum("nh,nkhj->nkj", x, w_all[topk_idx])  # [n, K, H]
        outs.append((topk_w.unsqueeze(-1) * y).sum(dim=1))
    return outs


def moe_step(handle, rank, world, all_gather, all_reduce, worst, n=17, seed=0):
    """One forward/backward of the layer through deep_ep vs the plain-torch reference."""
    router0, w_all0 = params(world, seed)
    lo = rank * EXPERTS_PER_RANK
    router = router0.clone().requires_grad_()
    w_local = w_all0[lo:lo + EXPERTS_PER_RANK].clone().requires_grad_()
    x0, target = inputs(rank, n + rank * 5, seed)
    x = x0.clone().requires_grad_()
    out = layer_deep_ep(handle, world, rank, x, router, w_local, worst)
    (out.float() * target).sum().backward()
    assert float(out.detach().float().abs().sum()) > 0 and float(x.grad.float().abs().sum()) > 0, "vacuous test"

    xs_all = [t.float().requires_grad_() for t in all_gather(x0)]
    targets = all_gather(target)
    r_ref = router0.clone().requires_grad_()
    w_ref = w_all0.float().requires_grad_()
    outs = layer_reference(xs_all, r_ref, w_ref)
    sum((o * t).sum() for o, t in zip(outs, targets)).backward()

    router_grad = all_reduce(router.grad.clone())
    errs = {
        "out": rel_err(out, outs[rank].detach()),
        "grad_x": rel_err(x.grad, xs_all[rank].grad),
        "grad_router": rel_err(router_grad, r_ref.grad),
        "grad_w": rel_err(w_local.grad, w_ref.grad[lo:lo + EXPERTS_PER_RANK]),
    }
    assert x.grad.dtype == torch.bfloat16 and w_local.grad.dtype == torch.bfloat16
    assert all(v < 1e-2 for v in errs.values()), errs
    return errs


def exact_checks(handle, rank, world, worst, n=21, seed=3):
    """backward(dispatch) == combine(grad); backward(combine) == cached_dispatch(grad); bit-exact."""
    ops = torch.ops.deep_ep
    g = torch.Generator().manual_seed(77 + rank + 10 * seed)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    e = EXPERTS_PER_RANK * world
    idx = torch.topk(torch.rand((n, e), generator=g), NUM_TOPK, dim=1).indices
    idx[0] = -1  # a token routed nowhere
    w = torch.rand((n, NUM_TOPK), generator=g).requires_grad_()
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, world)
    recv_x, _, recv_idx, recv_w, _, rpm, cpm, rcpm, src_idx, send_head = ops.dispatch(
        handle, x, None, idx, w, ntpr, in_rank, ntpe, 1, worst, CFG)
    rows = recv_x.shape[0]
    hd = (rpm, cpm, rcpm, src_idx, in_rank, send_head)
    real = (src_idx >= 0).unsqueeze(1)
    gr = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16)
    grw = torch.randn((rows, NUM_TOPK), generator=g)
    gx, gw = torch.autograd.grad((recv_x, recv_w), (x, w), (gr, grw))
    want_x, want_w = ops.combine(handle, gr, torch.where(recv_idx >= 0, grw, torch.zeros_like(grw)), None, None, *hd, CFG)
    assert torch.equal(gx, want_x), "backward(dispatch) x != combine(grad)"
    assert torch.equal(gw, want_w), "backward(dispatch) topk_weights != combine(masked grad)"

    y = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    yw = torch.rand((rows, NUM_TOPK), generator=g).requires_grad_()
    b0 = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    cx, cw = ops.combine(handle, y, yw, b0, None, *hd, CFG)
    gc = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    gcw = torch.randn((n, NUM_TOPK), generator=g)
    gy, gyw, gb0 = torch.autograd.grad((cx, cw), (y, yw, b0), (gc, gcw))
    want_y, _ = ops.cached_dispatch(handle, gc, None, rpm, cpm, rcpm, src_idx, in_rank, send_head, CFG)
    want_y = torch.where(real, want_y, torch.zeros_like(want_y))
    want_yw = cached_dispatch_rows_f32(handle, gcw, rpm, cpm, rcpm, src_idx, in_rank, send_head, CFG)
    want_yw = torch.where(real, want_yw, torch.zeros_like(want_yw))
    assert torch.equal(gy, want_y), "backward(combine) x != cached_dispatch(grad)"
    assert torch.equal(gyw, want_yw), "backward(combine) topk_weights != cached_dispatch(grad)"
    assert torch.equal(gb0, gc)
    # the f32 rows travel bit-exactly: cached_dispatch of x itself reproduces recv_topk_weights' copies
    return rows


# ---------------------------------------------------------------------------------------------
# 1 rank in-process


@pytest.mark.parametrize("worst", [0, 64])
def test_moe_grad_one_rank(buffer1, worst):
    ident = lambda t: [t]  # noqa: E731
    errs = moe_step(buffer1, 0, 1, ident, lambda t: t, worst)
    assert errs["out"] < 1e-2


@pytest.mark.parametrize("worst", [0, 64])
def test_exact_one_rank(buffer1, worst):
    rows = exact_checks(buffer1, 0, 1, worst)
    assert rows == (worst or rows)


def test_fp8_x_not_differentiable(ops, buffer1):
    n, e = 8, 4
    x = torch.randn((n, 128)).to(torch.float8_e4m3fn)
    try:
        x.requires_grad_()
    except RuntimeError:
        pytest.skip("this torch does not let a float8 tensor require grad")
    scales = torch.ones((n, 1))
    idx = torch.topk(torch.rand((n, e)), 2, dim=1).indices
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    with pytest.raises(RuntimeError, match="FP8 x .* not differentiable"):
        ops.dispatch(buffer1, x, scales, idx, torch.rand((n, 2)), ntpr, in_rank, ntpe, 1, 0, CFG)


ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("worst", [0, 48])
def test_opcheck_with_grad(ops, buffer1, worst):
    n, e = 20, 4
    g = torch.Generator().manual_seed(9)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.topk(torch.rand((n, e), generator=g), 2, dim=1).indices
    w = torch.rand((n, 2), generator=g).requires_grad_()
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    args = (buffer1, x, None, idx, w, ntpr, in_rank, ntpe, 1, worst, CFG)
    res = torch.library.opcheck(ops.dispatch.default, args, test_utils=ALL_UTILS)
    assert res == {u: "SUCCESS" for u in ALL_UTILS}, res
    out = ops.dispatch.default(*args)
    rows = out[0].shape[0]
    y = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    yw = out[3].detach().clone().requires_grad_()
    b0 = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    cargs = (buffer1, y, yw, b0, None, *out[5:9], in_rank, out[9], CFG)
    res = torch.library.opcheck(ops.combine.default, cargs, test_utils=ALL_UTILS)
    assert res == {u: "SUCCESS" for u in ALL_UTILS}, res


# ---------------------------------------------------------------------------------------------
# 2 ranks


def two_rank_worker(rank, world):
    import torch.distributed as dist

    def all_gather(t):
        sizes = [torch.zeros((1,), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([t.shape[0]]))
        m = int(max(s.item() for s in sizes))
        pad = torch.cat([t.float(), t.new_zeros((m - t.shape[0],) + tuple(t.shape[1:])).float()])
        outs = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(outs, pad)
        return [o[:int(s.item())].to(t.dtype) for o, s in zip(outs, sizes)]

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    try:
        errs = [moe_step(buf.handle, rank, world, all_gather, all_reduce, worst, seed=s)
                for worst in (0, 64) for s in (0, 1)]
        rows = [exact_checks(buf.handle, rank, world, worst) for worst in (0, 64)]
        return errs, rows
    finally:
        buf.destroy()


def test_moe_grad_two_ranks(rank_pool):
    results = rank_pool(2).run(two_rank_worker, timeout=200)
    assert len(results) == 2
    for errs, rows in results:
        assert len(errs) == 4 and rows[1] == 64


@pytest.mark.slow
def test_compiled_training_step_one_rank(buffer1):
    """torch.compile(fullgraph=True) of the layer, forward and backward (AOTAutograd traces the
    registered backward): output bit-identical to eager, gradients to bf16 accuracy (inductor
    rounds the bf16 intermediates of the expert matmul's backward differently from eager)."""
    import torch._dynamo

    torch._dynamo.reset()
    router0, w_all0 = params(1)
    x0, target = inputs(0, 17, 0)
    grads = []
    for compiled in (False, True):
        router, w = router0.clone().requires_grad_(), w_all0.clone().requires_grad_()
        x = x0.clone().requires_grad_()
        fn = lambda x, r, w: layer_deep_ep(buffer1, 1, 0, x, r, w, 64)  # noqa: E731
        out = (torch.compile(fn, fullgraph=True) if compiled else fn)(x, router, w)
        (out.float() * target).sum().backward()
        grads.append((out.detach(), x.grad, router.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1:], grads[1][1:]):
        assert rel_err(b, a) < 1e-2
