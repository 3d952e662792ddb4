"""The optional `num_tokens` of the low-latency ops (the real batch as a device tensor, so that one
captured CUDA graph with static shapes serves any batch n <= N), on the CPU backend.

The graph-free equivalent of a replay: the same static x [T, H] / topk_idx [T, K] tensors and one
num_tokens tensor changed in place between calls must give, bit for bit, what a call with x[:n],
topk_idx[:n] gives: the same recv_count, layout_range, stats and received rows, and combine rows
< n equal to the combine of x[:n], rows >= n zero. Rows past n hold garbage (NaN activations,
expert ids out of range, NaN weights) to show they are never read as routing. Also: opcheck with
the new argument, and the errors for a bad num_tokens.
"""
import pytest
import torch

from conftest import make_buffer1
from test_opcheck import ALL_UTILS, SEND_UTILS, check

T, H, K = 16, 256, 3


def _routing(seed, n, e, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, H), generator=g)).to(torch.bfloat16)
    idx = torch.topk(torch.rand((n, e), generator=g), K, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, torch.full_like(idx, -1), idx)
    w = torch.rand((n, K), generator=g)
    return x, idx.to(dtype).contiguous(), w


def _with_garbage(x, idx, w, n, e):
    """Static [T, ...] copies whose rows >= n must never be read as real."""
    xs, idxs, ws = x.clone(), idx.clone(), w.clone()
    xs[n:] = float("nan")
    idxs[n:] = e + 1000  # out of range: dispatch/combine would refuse it if it were routed
    ws[n:] = float("nan")
    return xs, idxs, ws


def _expert(recv_x, scales, use_fp8):
    """A stand-in expert: dequantise (fp8) and scale per local expert."""
    if use_fp8:
        el, rows, h = recv_x.shape
        xf = recv_x.float().view(el, rows, h // 128, 128) * scales.float().view(el, rows, h // 128, 1)
        xf = xf.view(el, rows, h)
    else:
        xf = recv_x.float()
    return (xf * (1.0 + torch.arange(xf.shape[0]).view(-1, 1, 1) / 4)).to(torch.bfloat16)


def _round(buf, x, idx, w, e, n_t, use_fp8, hook, combine):
    """One dispatch -> expert -> combine; n_t None = plain call on x as given."""
    el = e // buf.group_size
    stats = torch.zeros((el,), dtype=torch.int32)
    recv, count, handle, _, dhook = buf.low_latency_dispatch(x, idx, T, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                                                            return_recv_hook=hook, num_tokens=n_t)
    if dhook:
        dhook()
    recv_x, scales = recv if use_fp8 else (recv, None)
    y = _expert(recv_x, scales, use_fp8)
    out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16)
    if combine == "zero_copy":
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
    res, _, chook = buf.low_latency_combine(y, idx, w, handle, zero_copy=combine == "zero_copy", return_recv_hook=combine == "hook",
                                            out=out, num_tokens=n_t)
    if chook:
        chook()
    return recv_x, scales, count, handle, stats, res


CASES = [  # (idx dtype, fp8, dispatch hook, combine style)
    (torch.int64, False, False, "fused"),
    (torch.int32, True, True, "hook"),
    (torch.int64, False, False, "zero_copy"),
]


def num_tokens_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    e = 4 * world
    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, e) // 128) * 128
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    checked = 0
    try:
        for ci, (dtype, use_fp8, hook, combine) in enumerate(CASES):
            x, idx, w = _routing(1000 * ci + rank, T, e, dtype)
            n_t = torch.zeros((), dtype=torch.int32) if ci % 2 else torch.zeros((1,), dtype=torch.int32)
            g = torch.Generator().manual_seed(7 * ci)  # the same sequence on every rank, offset per rank below
            ns = [0, T, 1] + [int(v) for v in torch.randint(0, T + 1, (5,), generator=g)]
            for step, n in enumerate(ns):
                n = (n + 3 * rank * step) % (T + 1)  # ranks disagree on n (each rank's own batch)
                xs, idxs, ws = _with_garbage(x, idx, w, n, e)
                n_t.fill_(n)  # in place, as a graph replay would see it
                a = _round(buf, xs, idxs, ws, e, n_t, use_fp8, hook, combine)
                b = _round(buf, x[:n].contiguous(), idx[:n].contiguous(), w[:n].contiguous(), e, None, use_fp8, hook, combine)
                ctx = f"case {ci} step {step} n={n}"
                assert torch.equal(a[2], b[2]), f"{ctx}: recv_count {a[2]} vs {b[2]}"
                # CPU outputs past recv_count are zero-filled, so whole tensors compare bit for bit
                assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), f"{ctx}: recv_x"
                if use_fp8:
                    assert torch.equal(a[1], b[1]), f"{ctx}: scales"
                assert torch.equal(a[3][0], b[3][0]), f"{ctx}: src_info"
                assert torch.equal(a[3][1], b[3][1]), f"{ctx}: layout_range"
                assert torch.equal(a[4], b[4]), f"{ctx}: cumulative stats"
                assert torch.equal(a[5][:n].view(torch.int16), b[5].view(torch.int16)), f"{ctx}: combined rows < n"
                assert not a[5][n:].view(torch.int16).any(), f"{ctx}: combined rows >= n must be zero"
                checked += 1
        return checked
    finally:
        buf.destroy()


@pytest.mark.lowlatency
@pytest.mark.parametrize("world", [2, 4])
def test_num_tokens_equals_sliced_call(rank_pool, world):
    assert rank_pool(world).run(num_tokens_worker) == [8 * len(CASES)] * world


# ---------------------------------------------------------------------------------------------
# one rank: opcheck with the new argument, errors

E1 = 8


@pytest.fixture
def ll_buf(ops):
    bufs = []

    def make():
        nbytes = -(-int(ops.low_latency_rdma_size_hint(T, H, 1, E1)) // 128) * 128
        bufs.append(make_buffer1(ops, num_nvl_bytes=0, num_rdma_bytes=nbytes, low_latency_mode=True))
        return bufs[-1]

    yield make
    for b in bufs:
        ops.destroy_buffer(b)


def _inputs(n_real=5):
    x, idx, w = _routing(3, T, E1, torch.int64)
    return x, idx, w, torch.tensor([n_real], dtype=torch.int32)


@pytest.mark.lowlatency
@pytest.mark.parametrize("shape", [(), (1,)])
def test_opcheck_dispatch_and_combine(ops, ll_buf, shape):
    x, idx, w, nt = _inputs()
    nt = nt.view(shape)
    for util in ALL_UTILS:
        check(ops.low_latency_dispatch.default, (ll_buf(), x, idx, w, None, None, T, E1, False, False, False, nt), (util,))
    for util in SEND_UTILS:
        check(ops.low_latency_dispatch_send.default, (ll_buf(), x, idx, w, T, E1, True, False, False, nt), (util,))
    for util in ALL_UTILS:
        buf = ll_buf()
        recv_x, _, _, src_info, layout_range = ops.low_latency_dispatch.default(buf, x, idx, w, None, None, T, E1, False, False, False, nt)
        out = torch.empty((T, H), dtype=torch.bfloat16)
        check(ops.low_latency_combine.default, (buf, recv_x, idx, w, src_info, layout_range, out, None, T, E1, False, False, nt), (util,))
    for util in ALL_UTILS[:3]:  # a receive phase runs once per send phase (test_opcheck's docstring)
        buf = ll_buf()
        recv_x, _, _, src_info, layout_range = ops.low_latency_dispatch.default(buf, x, idx, w, None, None, T, E1, False, False, False, nt)
        state = ops.low_latency_combine_send.default(buf, recv_x, src_info, layout_range, T, E1, False, False)
        out = torch.empty((T, H), dtype=torch.bfloat16)
        check(ops.low_latency_combine_recv.default, (buf, state, idx, w, out, None, T, H, E1, nt), (util,))


@pytest.mark.lowlatency
def test_one_rank_counts_and_zero_rows(ops, ll_buf):
    """1 rank: recv_count counts only rows < n; combine rows >= n are zero, rows < n match n-row call."""
    buf = ll_buf()
    x, idx, w, nt = _inputs(5)
    _, _, count, _, _ = ops.low_latency_dispatch(buf, x, idx, w, None, None, T, E1, False, False, False, nt)
    want = torch.bincount(idx[:5][idx[:5] >= 0].flatten(), minlength=E1).to(torch.int32)
    assert torch.equal(count, want)


BAD = {
    "negative": (torch.tensor([-1], dtype=torch.int32), r"num_tokens must be in 0\.\.=16 \(the rows of x / topk_idx\), got -1"),
    "too-large": (torch.tensor([T + 1], dtype=torch.int32), r"num_tokens must be in 0\.\.=16 \(the rows of x / topk_idx\), got 17"),
    "int64": (torch.tensor([3], dtype=torch.int64), r"num_tokens must be an int32 tensor of shape \[\] or \[1\] on cpu.*got torch\.int64"),
    "two-values": (torch.tensor([3, 4], dtype=torch.int32), r"num_tokens must be an int32 tensor of shape \[\] or \[1\].*\[2\]"),
    "float": (torch.tensor(3.0), r"num_tokens must be an int32 tensor"),
}


@pytest.mark.lowlatency
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_num_tokens(ops, ll_buf, bad):
    nt, msg = BAD[bad]
    buf = ll_buf()
    x, idx, w, good = _inputs()
    with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_dispatch: " + msg):
        ops.low_latency_dispatch(buf, x, idx, w, None, None, T, E1, False, False, False, nt)
    with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_dispatch: " + msg):
        ops.low_latency_dispatch_send(buf, x, idx, w, T, E1, False, False, False, nt)
    # the buffer stays usable: nothing was sent
    recv_x, _, _, src_info, layout_range = ops.low_latency_dispatch(buf, x, idx, w, None, None, T, E1, False, False, False, good)
    out = torch.empty((T, H), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_combine: " + msg):
        ops.low_latency_combine(buf, recv_x, idx, w, src_info, layout_range, out, None, T, E1, False, False, nt)
    ops.low_latency_combine(buf, recv_x, idx, w, src_info, layout_range, out, None, T, E1, False, False, good)
    state = ops.low_latency_combine_send(buf, recv_x, src_info, layout_range, T, E1, False, False)
    with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_combine: " + msg):
        ops.low_latency_combine_recv(buf, state, idx, w, out, None, T, H, E1, nt)
    ops.low_latency_combine_recv(buf, state, idx, w, out, None, T, H, E1, good)
    assert not out[5:].view(torch.int16).any()


@pytest.mark.lowlatency
def test_num_tokens_with_bad_topk_idx_names_topk_idx(ops, ll_buf):
    buf = ll_buf()
    x, idx, w, nt = _inputs()
    with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_combine: topk_idx must have shape"):
        ops.low_latency_combine_recv(buf, torch.zeros(4, dtype=torch.int64), idx[0], w, torch.empty((T, H), dtype=torch.bfloat16),
                                     None, T, H, E1, nt)
