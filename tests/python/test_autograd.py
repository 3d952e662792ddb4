"""Autograd of the normal-mode ops (python/deep_ep_rs/_autograd.py): dispatch, cached_dispatch,
combine and their internode forms.

- A small MoE layer (router -> get_dispatch_layout -> dispatch -> per-expert linear on recv rows
  weighted by recv_topk_weights -> combine) is trained one step: its output and the gradients of
  x, the router and the expert weights must match the same layer written in plain fp32 torch on
  the full (gathered) problem, to bf16 accuracy (relative error < 1e-2). 1 rank in-process and 2
  ranks in the rank pool, data-dependent and worst-case dispatch.
- Bit-exact: backward(dispatch) == combine of the same gradient (x and topk_weights), and
  backward(combine) == cached_dispatch of the gradient (x and topk_weights).
- torch.library.opcheck (all four checks, test_autograd_registration included) with inputs that
  require grad.
- Through `Buffer` at 2 and 4 ranks, intranode and internode (DEEP_EP_NVL_DOMAIN_SIZE=1 at 2 ranks,
  2 at 4 ranks): a MoE layer with a cached dispatch of a second input (dispatch, cached dispatch,
  combine: the internode ops when the ranks span several domains) against plain torch, and the
  bit-exact adjoints of the three, worst-case padding included; no "autograd kernel was not
  registered" warning may appear. GPU twin: tests/gpu/test_autograd_gpu.py.
"""
import pytest
import torch

import deep_ep_rs  # noqa: F401  (registers ops, fake kernels and autograd)
from deep_ep_rs._autograd import cached_dispatch_rows_f32

HIDDEN, NUM_TOPK, EXPERTS_PER_RANK = 64, 2, 2
CFG = [4, 6, 256, 6, 128]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
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

    all_gather, all_reduce = gloo_collectives(world)

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


# ---------------------------------------------------------------------------------------------
# cached dispatch and the internode ops (issue 34): every differentiable op has autograd, through
# the Buffer API too (which takes the internode path when the ranks span several NVLink domains)

NOT_REGISTERED = "autograd kernel was not registered"


def grad_warnings(caught):
    """The messages of torch's warning for an op without an autograd kernel that a backward ran through."""
    return [str(w.message) for w in caught if NOT_REGISTERED in str(w.message)]


def real_rows(handle):
    """[rows, 1] bool: the received rows of a Buffer handle (False: worst-case padding). Intranode:
    recv_src_idx >= 0; internode: a non-zero recv_src_meta (a real row names its receiving rank)."""
    if len(handle) == 10:
        return handle[7].ne(0).any(dim=1, keepdim=True)
    return (handle[3] >= 0).unsqueeze(1)


def layer_buffer(buf, world, x, z, router, w_local, worst):
    """The MoE layer through deep_ep_rs.Buffer: dispatch x (with top-k weights), then a cached
    dispatch of a second input z with the handle; experts on recv_x + recv_z, gated by
    recv_topk_weights; combine. `dispatch` / `combine` take the internode ops when the ranks span
    several NVLink domains (DEEP_EP_NVL_DOMAIN_SIZE)."""
    scores = torch.softmax(x.float() @ router, dim=-1)
    topk_w, topk_idx = torch.topk(scores, NUM_TOPK, dim=-1)
    ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS_PER_RANK * world)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
        topk_idx=topk_idx, topk_weights=topk_w, num_worst_tokens=worst)
    recv_z, *_ = buf.dispatch(z, handle=handle)
    h = recv_x.float() + recv_z.float()
    out = torch.zeros((recv_x.shape[0], HIDDEN), dtype=torch.float32, device=recv_x.device)
    for e in range(EXPERTS_PER_RANK):
        gate = torch.where(recv_idx == e, recv_w, torch.zeros_like(recv_w)).sum(dim=-1, keepdim=True)
        out = out + gate * (h @ w_local[e].float())
    combined, _, _ = buf.combine(out.to(torch.bfloat16), handle)
    return combined, handle


def layer_reference_xz(xs, zs, router, w_all):
    """Plain fp32 torch: routing on x, experts on x + z (the layer of layer_buffer on the full problem)."""
    outs = []
    for x, z in zip(xs, zs):
        scores = torch.softmax(x @ router, dim=-1)
        topk_w, topk_idx = torch.topk(scores, NUM_TOPK, dim=-1)
        y = torch.einsum("nh,nkhj->nkj", x + z, w_all[topk_idx])
        outs.append((topk_w.unsqueeze(-1) * y).sum(dim=1))
    return outs


def buffer_step(buf, rank, world, all_gather, all_reduce, worst, n=17, seed=0):
    """One forward/backward of layer_buffer vs plain torch: output and the gradients of x (dispatch),
    z (cached dispatch), the router (dispatch's topk_weights) and the expert weights (combine).
    The layer runs on the buffer's device; inputs, collectives and the reference on the CPU."""
    dev = buf.device
    router0, w_all0 = params(world, seed)
    lo = rank * EXPERTS_PER_RANK
    router = router0.to(dev, copy=True).requires_grad_()
    w_local = w_all0[lo:lo + EXPERTS_PER_RANK].to(dev, copy=True).requires_grad_()
    x0, target = inputs(rank, n + rank * 5, seed)
    z0, _ = inputs(rank, n + rank * 5, seed + 50)
    x, z = x0.to(dev, copy=True).requires_grad_(), z0.to(dev, copy=True).requires_grad_()
    out, handle = layer_buffer(buf, world, x, z, router, w_local, worst)
    (out.float() * target.to(dev)).sum().backward()
    assert len(handle) == (10 if buf.get_num_rdma_ranks() > 1 else 6)
    for name, t in (("x (dispatch)", x), ("z (cached dispatch)", z), ("router (dispatch topk_weights)", router),
                    ("expert weights (combine)", w_local)):
        assert t.grad is not None, f"no gradient for {name}"
    assert float(out.detach().float().abs().sum()) > 0 and float(z.grad.float().abs().sum()) > 0, "vacuous test"

    xs_all = [t.float().requires_grad_() for t in all_gather(x0)]
    zs_all = [t.float().requires_grad_() for t in all_gather(z0)]
    targets = all_gather(target)
    r_ref = router0.clone().requires_grad_()
    w_ref = w_all0.float().requires_grad_()
    outs = layer_reference_xz(xs_all, zs_all, r_ref, w_ref)
    sum((o * t).sum() for o, t in zip(outs, targets)).backward()

    errs = {
        "out": rel_err(out, outs[rank].detach()),
        "grad_x": rel_err(x.grad, xs_all[rank].grad),
        "grad_z": rel_err(z.grad, zs_all[rank].grad),
        "grad_router": rel_err(all_reduce(router.grad.cpu().clone()), r_ref.grad),
        "grad_w": rel_err(w_local.grad, w_ref.grad[lo:lo + EXPERTS_PER_RANK]),
    }
    assert x.grad.dtype == z.grad.dtype == w_local.grad.dtype == torch.bfloat16
    assert all(v < 1e-2 for v in errs.values()), errs
    return errs


def exact_buffer_checks(buf, rank, world, worst, dispatch_cfg, n=21, seed=3):
    """Bit-exact adjoints through the Buffer API (intranode or internode ops):
    backward(dispatch) == combine(grad), backward(cached dispatch) == combine(grad),
    backward(combine) == cached dispatch(grad). `dispatch_cfg` is used for the dispatches; the
    reference combines use the default combine config (the chunk sizes change no result)."""
    from deep_ep_rs import _autograd

    dev = buf.device
    g = torch.Generator().manual_seed(77 + rank + 10 * seed)
    e = EXPERTS_PER_RANK * world
    ccfg = buf.get_combine_config(world)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).to(dev).requires_grad_()
    idx = torch.topk(torch.rand((n, e), generator=g), NUM_TOPK, dim=1).indices
    idx[0] = -1  # a token routed nowhere
    idx = idx.to(dev)
    w = torch.rand((n, NUM_TOPK), generator=g).to(dev).requires_grad_()
    ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, e)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
        topk_idx=idx, topk_weights=w, num_worst_tokens=worst, config=dispatch_cfg)
    rows = recv_x.shape[0]
    real = real_rows(handle)
    zero = torch.zeros((), dtype=torch.bfloat16, device=dev)

    # dispatch: backward = combine of the gradient (padding rows zeroed), weights masked to recv_topk_idx >= 0
    gr = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
    grw = torch.randn((rows, NUM_TOPK), generator=g).to(dev)
    gx, gw = torch.autograd.grad((recv_x, recv_w), (x, w), (gr, grw))
    with torch.no_grad():
        want_x, want_w, _ = buf.combine(torch.where(real, gr, zero), handle,
                                        topk_weights=torch.where(recv_idx >= 0, grw, torch.zeros_like(grw)), config=ccfg)
    assert torch.equal(gx, want_x), "backward(dispatch) x != combine(grad)"
    assert torch.equal(gw, want_w), "backward(dispatch) topk_weights != combine(masked grad)"

    # cached dispatch: backward = combine of the gradient
    z = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).to(dev).requires_grad_()
    recv_z, *_ = buf.dispatch(z, handle=handle, config=dispatch_cfg)
    with torch.no_grad():
        assert torch.equal(recv_z, buf.dispatch(z, handle=handle, config=dispatch_cfg)[0])
    gz_out = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
    (gz,) = torch.autograd.grad(recv_z, z, gz_out)
    with torch.no_grad():
        want_z, _, _ = buf.combine(torch.where(real, gz_out, zero), handle, config=ccfg)
    assert torch.equal(gz, want_z), "backward(cached dispatch) != combine(grad)"

    # combine: backward = cached dispatch of the gradient (weights bit-exact as f32), biases pass through
    y = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).to(dev).requires_grad_()
    yw = torch.rand((rows, NUM_TOPK), generator=g).to(dev).requires_grad_()
    b0 = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).to(dev).requires_grad_()
    b1 = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).to(dev).requires_grad_()
    cx, cw, _ = buf.combine(y, handle, topk_weights=yw, bias=(b0, b1), config=ccfg)
    gc = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
    gcw = torch.randn((n, NUM_TOPK), generator=g).to(dev)
    gy, gyw, gb0, gb1 = torch.autograd.grad((cx, cw), (y, yw, b0, b1), (gc, gcw))
    with torch.no_grad():
        want_y = buf.dispatch(gc, handle=handle, config=ccfg)[0]
        if len(handle) == 10:
            want_yw = _autograd.internode_cached_dispatch_rows_f32(buf.handle, gcw, handle, ccfg.to_list())
        else:
            want_yw = cached_dispatch_rows_f32(buf.handle, gcw, *handle, ccfg.to_list())
    assert torch.equal(gy, torch.where(real, want_y, zero)), "backward(combine) x != cached dispatch(grad)"
    assert torch.equal(gyw, torch.where(real, want_yw, torch.zeros((), device=dev))), \
        "backward(combine) topk_weights != cached dispatch(grad)"
    assert torch.equal(gb0, gc) and torch.equal(gb1, gc)
    return rows, int(real.sum())


#: (world, ranks per NVLink domain): intranode (one domain of 8), then the internode layouts.
PATHS = [(2, 8), (2, 1), (4, 8), (4, 2)]
PATH_IDS = ["2-intranode", "2-internode-d1", "4-intranode", "4-internode-d2"]


def gloo_collectives(world):
    """all_gather (rows may differ per rank) and all_reduce of CPU tensors over the default group."""
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

    return all_gather, all_reduce


def run_paths(buf, rank, world, what):
    """The checks of one layout on `buf` (any device; DEEP_EP_NVL_DOMAIN_SIZE set as when it was
    created): "moe" (buffer_step, data-dependent and worst-case, two seeds) or "exact"
    (exact_buffer_checks with the default dispatch config and with NVLink chunk sizes that
    internode combine refuses: the backward's combine must still run). Returns (results, the
    messages of torch's unregistered-autograd warnings seen)."""
    import warnings

    all_gather, all_reduce = gloo_collectives(world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if what == "moe":
            out = [buffer_step(buf, rank, world, all_gather, all_reduce, worst, seed=s) for worst in (0, 128) for s in (0, 1)]
        else:
            odd = deep_ep_rs.Config(deep_ep_rs.Buffer.num_sms, 200, 256, 6, 128)
            out = [exact_buffer_checks(buf, rank, world, worst, cfg)
                   for worst in (0, 128) for cfg in (buf.get_dispatch_config(world), odd)]
    return out, grad_warnings(caught)


def paths_worker(rank, world, d, what):
    import torch.distributed as dist

    from _harness import env_var

    internode = world > d
    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", d):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, (1 << 22) if internode else 0, device="cpu",
                                explicitly_destroy=True)
        try:
            assert buf.get_num_rdma_ranks() == (world // d if internode else 1)
            return run_paths(buf, rank, world, what)
        finally:
            buf.destroy()


@pytest.mark.parametrize("world,d", PATHS, ids=PATH_IDS)
def test_moe_grad_buffer_paths(rank_pool, world, d):
    """MoE layer through Buffer (dispatch, cached dispatch, combine; internode ops when world > d)
    vs plain torch, and no 'autograd kernel was not registered' warning."""
    results = rank_pool(world).run(paths_worker, d, "moe", timeout=300)
    for errs, warned in results:
        assert len(errs) == 4
        assert warned == [], warned


@pytest.mark.parametrize("world,d", PATHS, ids=PATH_IDS)
def test_exact_grad_buffer_paths(rank_pool, world, d):
    """Bit-exact adjoints of dispatch, cached dispatch and combine through Buffer (internode ops
    when world > d), worst-case padding included, and no unregistered-autograd warning."""
    results = rank_pool(world).run(paths_worker, d, "exact", timeout=300)
    for rows, warned in results:
        assert warned == [], warned
        assert all(r[0] == 128 for r in rows[2:])  # worst-case rows
    assert sum(r[1] for rows, _ in results for r in rows) > 0, "tokens must really move"


@pytest.mark.parametrize("worst", [0, 64])
def test_exact_cached_dispatch_one_rank(ops, buffer1, worst):
    """Raw op, 1 rank: backward(cached_dispatch) == combine(grad) with the same handle, no warning."""
    import warnings

    n, e = 21, EXPERTS_PER_RANK
    g = torch.Generator().manual_seed(4 + worst)
    idx = torch.topk(torch.rand((n, e), generator=g), NUM_TOPK, dim=1).indices
    idx[0] = -1
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    out = ops.dispatch(buffer1, x, None, idx, torch.rand((n, NUM_TOPK), generator=g), ntpr, in_rank, ntpe, 1, worst, CFG)
    rpm, cpm, rcpm, src_idx, send_head = out[5:10]
    hd = (rpm, cpm, rcpm, src_idx, in_rank, send_head)
    z = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recv_z, _ = ops.cached_dispatch(buffer1, z, None, *hd, CFG)
        gr = torch.randn(recv_z.shape, generator=g).to(torch.bfloat16)
        recv_z.backward(gr)
    assert grad_warnings(caught) == []
    assert z.grad is not None, "no gradient through cached_dispatch"
    real = (src_idx >= 0).unsqueeze(1)
    want, _ = ops.combine(buffer1, torch.where(real, gr, torch.zeros_like(gr)), None, None, None, *hd, CFG)
    assert torch.equal(z.grad, want)


def test_fp8_cached_dispatch_not_differentiable(ops, buffer1):
    n, e = 8, 4
    idx = torch.topk(torch.rand((n, e)), 2, dim=1).indices
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    x = torch.randn((n, 128)).to(torch.float8_e4m3fn)
    scales = torch.ones((n, 1))
    out = ops.dispatch(buffer1, x, scales, idx, torch.rand((n, 2)), ntpr, in_rank, ntpe, 1, 0, CFG)
    hd = (*out[5:9], in_rank, out[9])
    # scales that require grad (not differentiable) do not stop the forward
    recv, _ = ops.cached_dispatch(buffer1, x, scales.clone().requires_grad_(), *hd, CFG)
    assert torch.equal(recv.view(torch.uint8), out[0].view(torch.uint8))
    try:
        x.requires_grad_()
    except RuntimeError:
        pytest.skip("this torch does not let a float8 tensor require grad")
    with pytest.raises(RuntimeError, match="FP8 x .* not differentiable"):
        ops.cached_dispatch(buffer1, x, scales, *hd, CFG)


@pytest.mark.parametrize("worst", [0, 48])
def test_opcheck_cached_dispatch_with_grad(ops, buffer1, worst):
    n, e = 20, 4
    g = torch.Generator().manual_seed(19)
    idx = torch.topk(torch.rand((n, e), generator=g), 2, dim=1).indices
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16)
    out = ops.dispatch(buffer1, x, None, idx, torch.rand((n, 2), generator=g), ntpr, in_rank, ntpe, 1, worst, CFG)
    args = (buffer1, x.clone().requires_grad_(), None, *out[5:9], in_rank, out[9], CFG)
    res = torch.library.opcheck(ops.cached_dispatch.default, args, test_utils=ALL_UTILS)
    assert res == {u: "SUCCESS" for u in ALL_UTILS}, res
