"""torch.library.opcheck on every deep_ep op that takes tensors, on CPU, with 1-rank buffers.

All four default checks (test_schema, test_autograd_registration, test_faketensor,
test_aot_dispatch_dynamic) run on every normal-mode op, including the data-dependent
non-cached dispatch (its fake kernel allocates an unbacked row count). FP8 inputs need one
test-side shim (`fp8_allclose`): torch's schema check compares inputs with torch.allclose, which
CPU torch lacks for float8_e4m3fn.

The split low-latency receive ops (`*_recv`) run three of the four: test_aot_dispatch_dynamic
calls the op eagerly and then again compiled with the *same* arguments, i.e. it would run one
receive phase twice on one recv_state. A receive phase consumes the state of its send phase (in
DeepEP it is the `hook()`, which may be called once), so a second call is not a meaningful
operation on any backend. Each LL check gets a fresh buffer, because opcheck calls the op several
times and LL calls must form a valid sequence per buffer.
"""
import pytest
import torch

from conftest import ll_or_skip, make_buffer1

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# The LL send ops return recv_state = (buffer half, call sequence number, ...): two calls differ
# by design, and test_aot_dispatch_dynamic compares an eager call's outputs with a second
# (traced) call's. Shapes and dtypes of that output are still checked by test_faketensor.
SEND_UTILS = ALL_UTILS[:3]
CFG = [20, 6, 256, 6, 128]


def check(op, args, utils=ALL_UTILS):
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert result == {u: "SUCCESS" for u in utils}, result


@pytest.fixture
def fp8_allclose(monkeypatch):
    """torch's SchemaCheckMode (opcheck's test_schema) compares inputs before/after the call with
    torch.allclose, which CPU torch does not implement for float8_e4m3fn. Compare float8 tensors
    bitwise instead (stricter than allclose); everything else is unchanged."""
    orig = torch.allclose

    def allclose(a, b, *args, **kwargs):
        if a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return orig(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)


def routing(n, k, e, seed, dtype=torch.int64, mask_prob=0.25):
    g = torch.Generator().manual_seed(seed)
    idx = torch.topk(torch.rand((n, e), generator=g), k, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < mask_prob, torch.full_like(idx, -1), idx)
    return idx.to(dtype).contiguous(), torch.rand((n, k), generator=g)


# ---------------------------------------------------------------------------------------------
# layout


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_ranks", [1, 2, 16])
def test_get_dispatch_layout(ops, dtype, num_ranks):
    idx, _ = routing(33, 4, 32, seed=num_ranks, dtype=dtype)
    check(ops.get_dispatch_layout.default, (idx, 32, num_ranks))
    out = ops.get_dispatch_layout(idx, 32, num_ranks)
    assert out[1].shape == ((num_ranks // 8,) if num_ranks > 8 else (0,))
    assert int(out[2].sum()) == int((idx >= 0).sum())


# ---------------------------------------------------------------------------------------------
# normal mode


def dispatch_args(ops, buf, kind, n=24, h=256, k=4, e=8):
    idx, w = routing(n, k, e, seed=sum(map(ord, kind)), dtype=torch.int32 if kind == "int32-topk" else torch.int64)
    g = torch.Generator().manual_seed(5)
    x, scales = torch.randn((n, h), generator=g).to(torch.bfloat16), None
    if kind.startswith("fp8"):
        x = (torch.randn((n, h), generator=g) * 4).to(torch.float8_e4m3fn)
        if kind == "fp8-f32":
            scales = torch.rand((h // 128, n), generator=g).T  # column-major, any strides are accepted
        else:
            scales = torch.randint(0, 2 ** 30, (n, h // 512 or 1), generator=g, dtype=torch.int32)
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    with_topk = kind != "no-topk"
    worst = 2 * n if kind == "worst" else 0
    align = 4 if kind == "align" else 1
    return (buf, x, scales, idx if with_topk else None, w if with_topk else None, ntpr, in_rank, ntpe, align, worst, CFG)


DISPATCH_KINDS = ["topk", "no-topk", "int32-topk", "fp8-f32", "fp8-ue8m0", "worst", "align"]


@pytest.mark.parametrize("kind", DISPATCH_KINDS)
def test_dispatch(ops, buffer1, kind, fp8_allclose):
    args = dispatch_args(ops, buffer1, kind)
    check(ops.dispatch.default, args)
    out = ops.dispatch.default(*args)
    n_recv = int((args[6][:, 0]).sum())
    assert out[0].shape[0] == (2 * args[1].shape[0] if kind == "worst" else n_recv)


@pytest.mark.parametrize("kind", ["topk", "fp8-f32", "worst"])
def test_cached_dispatch(ops, buffer1, kind, fp8_allclose):
    args = dispatch_args(ops, buffer1, kind)
    out = ops.dispatch.default(*args)
    handle = out[5:10]
    rpm, cpm, rcpm, src_idx, send_head = handle
    cargs = (buffer1, args[1], args[2], rpm, cpm, rcpm, src_idx, args[6], send_head, CFG)
    check(ops.cached_dispatch.default, cargs)
    recv, _ = ops.cached_dispatch.default(*cargs)
    n = int(args[6][:, 0].sum())
    assert torch.equal(recv[:n].view(torch.uint8), out[0][:n].view(torch.uint8))


@pytest.mark.parametrize("kind", ["plain", "weights", "bias", "bias2-weights", "worst-bias2-weights"])
def test_combine(ops, buffer1, kind):
    args = dispatch_args(ops, buffer1, "worst" if kind.startswith("worst") else "topk")
    out = ops.dispatch.default(*args)
    rows = out[0].shape[0]
    n, h = args[1].shape
    g = torch.Generator().manual_seed(11)
    y = torch.randn((rows, h), generator=g).to(torch.bfloat16)
    w = out[3] if "weights" in kind else None
    b0 = torch.randn((n, h), generator=g).to(torch.bfloat16) if "bias" in kind else None
    b1 = torch.randn((n, h), generator=g).to(torch.bfloat16) if "bias2" in kind else None
    rpm, cpm, rcpm, src_idx, send_head = out[5:10]
    cargs = (buffer1, y, w, b0, b1, rpm, cpm, rcpm, src_idx, args[6], send_head, CFG)
    check(ops.combine.default, cargs)
    cx, cw = ops.combine.default(*cargs)
    assert cx.shape == (n, h) and cx.dtype == torch.bfloat16
    assert (cw.shape == (n, w.shape[1])) if w is not None else (cw.numel() == 0)


# ---------------------------------------------------------------------------------------------
# low-latency mode (skip while the backend answers "not implemented yet")

T, H, E = 8, 512, 8


@pytest.fixture
def ll_buffer(ops):
    bufs = []

    def make():
        nbytes = int(ops.low_latency_rdma_size_hint(T, H, 1, E))
        nbytes = -(-nbytes // 128) * 128
        bufs.append(make_buffer1(ops, num_nvl_bytes=0, num_rdma_bytes=nbytes, low_latency_mode=True))
        return bufs[-1]

    yield make
    for b in bufs:
        ops.destroy_buffer(b)


def ll_inputs(n=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, H), generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand((n, E), generator=g), k, dim=1).indices
    idx[0, 0] = -1
    w = torch.rand((n, k), generator=g)
    return x, idx.contiguous(), w


LL_MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-round": (True, True, False),
            "fp8-ue8m0": (True, True, True)}


@pytest.mark.lowlatency
@pytest.mark.parametrize("mode", list(LL_MODES))
def test_low_latency_dispatch(ops, ll_buffer, mode):
    use_fp8, round_scale, ue8m0 = LL_MODES[mode]
    x, idx, w = ll_inputs()
    for util in ALL_UTILS:
        buf = ll_buffer()
        stats = torch.zeros((E,), dtype=torch.int32)
        wait = torch.zeros((1,), dtype=torch.int64)
        args = (buf, x, idx, w, stats, wait, T, E, use_fp8, round_scale, ue8m0)
        ll_or_skip(ops.low_latency_dispatch.default, *args)
        check(ops.low_latency_dispatch.default, args, (util,))


@pytest.mark.lowlatency
def test_low_latency_dispatch_nvfp4(ops, ll_buffer):
    """use_nvfp4 (docs/NVFP4.md): uint8 values and float8 swizzled scales, through every util."""
    x, idx, w = ll_inputs(seed=3)
    scale = torch.tensor(448.0 * 6.0) / x.float().abs().max()
    for util in ALL_UTILS:
        buf = ll_buffer()
        args = (buf, x, idx, w, torch.zeros((E,), dtype=torch.int32), None, T, E, False, False, False, None, True, scale)
        ll_or_skip(ops.low_latency_dispatch.default, *args)
        check(ops.low_latency_dispatch.default, args, (util,))
    for util in SEND_UTILS:
        buf = ll_buffer()
        send_args = (buf, x, idx, w, T, E, False, False, False, None, True, scale)
        out = ll_or_skip(ops.low_latency_dispatch_send.default, *send_args)
        ops.low_latency_dispatch_recv.default(buf, out[5], *out[:5], None, None, T, E, False, False, False, True)
        check(ops.low_latency_dispatch_send.default, send_args, (util,))


@pytest.mark.lowlatency
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_low_latency_dispatch_send_recv(ops, ll_buffer, mode):
    use_fp8, round_scale, ue8m0 = LL_MODES[mode]
    x, idx, w = ll_inputs(seed=1)
    for util in SEND_UTILS:
        buf = ll_buffer()
        send_args = (buf, x, idx, w, T, E, use_fp8, round_scale, ue8m0)
        out = ll_or_skip(ops.low_latency_dispatch_send.default, *send_args)
        ops.low_latency_dispatch_recv.default(buf, out[5], *out[:5], None, None, T, E, use_fp8, round_scale, ue8m0)
        check(ops.low_latency_dispatch_send.default, send_args, (util,))
    # torch's test_schema compares mutated arguments arithmetically, which CPU float8 tensors do
    # not support ("mul_cpu_reduced_float" not implemented): skip only that check for FP8 recv_x.
    recv_utils = ALL_UTILS[1:3] if use_fp8 else ALL_UTILS[:3]
    for util in recv_utils:  # see the module docstring: a receive phase runs once per send phase
        buf = ll_buffer()
        out = ll_or_skip(ops.low_latency_dispatch_send.default, buf, x, idx, w, T, E, use_fp8, round_scale, ue8m0)
        recv_args = (buf, out[5], *out[:5], torch.zeros((E,), dtype=torch.int32), None, T, E, use_fp8, round_scale, ue8m0)
        check(ops.low_latency_dispatch_recv.default, recv_args, (util,))


def _ll_dispatched(ops, buf, seed=2):
    x, idx, w = ll_inputs(seed=seed)
    recv_x, _, count, src_info, layout_range = ll_or_skip(ops.low_latency_dispatch.default, buf, x, idx, w, None, None, T, E,
                                                          False, False, False)
    return x, idx, w, recv_x, src_info, layout_range


@pytest.mark.lowlatency
@pytest.mark.parametrize("logfmt", [False, True])
def test_low_latency_combine(ops, ll_buffer, logfmt):
    for util in ALL_UTILS:
        buf = ll_buffer()
        x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf)
        out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
        args = (buf, recv_x, idx, w, src_info, layout_range, out, torch.zeros((1,), dtype=torch.int64), T, E, logfmt, False)
        check(ops.low_latency_combine.default, args, (util,))


@pytest.mark.lowlatency
def test_low_latency_combine_alloc(ops, ll_buffer):
    """The combine that allocates its output: opcheck, and the same bits as low_latency_combine into
    a given out."""
    for util in ALL_UTILS:
        buf = ll_buffer()
        x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf)
        args = (buf, recv_x, idx, w, src_info, layout_range, torch.zeros((1,), dtype=torch.int64), T, E, False, False)
        check(ops.low_latency_combine_alloc.default, args, (util,))
    buf = ll_buffer()
    x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf, seed=3)
    got = ops.low_latency_combine_alloc.default(buf, recv_x, idx, w, src_info, layout_range, None, T, E, False, False)
    assert got.shape == (x.shape[0], H) and got.dtype == torch.bfloat16
    buf = ll_buffer()
    x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf, seed=3)
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
    ops.low_latency_combine.default(buf, recv_x, idx, w, src_info, layout_range, out, None, T, E, False, False)
    assert torch.equal(got, out)


@pytest.mark.lowlatency
def test_low_latency_combine_send_recv(ops, ll_buffer):
    for util in SEND_UTILS:
        buf = ll_buffer()
        x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf)
        send_args = (buf, recv_x, src_info, layout_range, T, E, False, False)
        check(ops.low_latency_combine_send.default, send_args, (util,))
        # Single-batch overlap: the producer's signals, all raised (a CPU buffer's producer is done).
        buf = ll_buffer()
        x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf)
        sig = torch.ones(recv_x.shape[0] * recv_x.shape[1], dtype=torch.int32)
        check(ops.low_latency_combine_send.default, send_args[:1] + (recv_x, src_info, layout_range) + send_args[4:] + (sig, 1, 1, 0),
              (util,))
    for util in ALL_UTILS[:3]:  # see the module docstring
        buf = ll_buffer()
        x, idx, w, recv_x, src_info, layout_range = _ll_dispatched(ops, buf)
        state = ops.low_latency_combine_send.default(buf, recv_x, src_info, layout_range, T, E, False, False)
        out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
        check(ops.low_latency_combine_recv.default, (buf, state, idx, w, out, None, T, H, E), (util,))


@pytest.mark.lowlatency
def test_get_next_low_latency_combine_buffer(ops, ll_buffer):
    buf = ll_buffer()
    _ll_dispatched(ops, buf)
    view = ll_or_skip(ops.get_next_low_latency_combine_buffer.default, buf, T, H, E)
    m = H + H // 128 * 2
    assert view.shape == (E, T, H) and view.stride() == (T * m, m, 1) and view.dtype == torch.bfloat16
    check(ops.get_next_low_latency_combine_buffer.default, (buf, T, H, E), ("test_schema", "test_faketensor"))
