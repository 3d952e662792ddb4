"""The fake kernels (python/deep_ep_rs/_fake.py) give the same shapes, dtypes, strides and devices
as real calls, under FakeTensorMode with a ShapeEnv (as torch.compile runs them).

The non-cached dispatch receive count is data-dependent: its fake size must be an unbacked
symbol (and every output of that size must use the same symbol); it is compared with the real
count by substitution. Everything else must be static and equal.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.utils._pytree import tree_map_only

from conftest import ll_or_skip, make_buffer1

CFG = [20, 6, 256, 6, 128]


def fake_call(op, args, dynamic_inputs=False):
    """Runs op on fake copies of args; with dynamic_inputs every input size is a (backed) symbol,
    as under torch.compile(dynamic=True)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=not dynamic_inputs)
    fargs = tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        out = op(*fargs)
    out = out if isinstance(out, tuple) else (out,)
    for t in out:
        t._deep_ep_shape_env = mode.shape_env
    return out


def as_int(v, subs, shape_env=None):
    if isinstance(v, torch.SymInt):
        expr = v.node.expr
        if shape_env is not None and not free_unbacked_symbols(expr):
            hints = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
            return int(expr.xreplace(hints))  # an input size: its hint is the real value
        syms = free_unbacked_symbols(expr)
        assert syms, f"symbolic size {expr} must be unbacked (data-dependent), not a guarded input size"
        return int(expr.xreplace(subs))
    return int(v)


def compare(real, fake, rows=None, dynamic_inputs=False):
    """Compares real and fake outputs; `rows` = the real data-dependent row count (if any)."""
    real = real if isinstance(real, tuple) else (real,)
    assert len(real) == len(fake)
    unbacked = set()
    for t in fake:
        for s in t.shape:
            if isinstance(s, torch.SymInt):
                unbacked |= free_unbacked_symbols(s.node.expr)
    assert len(unbacked) <= 1, f"one data-dependent size at most, got {unbacked}"
    if unbacked:
        assert rows is not None, "unexpected data-dependent size"
    subs = {next(iter(unbacked)): rows} if unbacked else {}
    for i, (r, f) in enumerate(zip(real, fake)):
        env = getattr(f, "_deep_ep_shape_env", None) if dynamic_inputs else None
        assert f.dtype == r.dtype, f"output {i}: fake dtype {f.dtype} != real {r.dtype}"
        assert f.device == r.device, f"output {i}: fake device {f.device} != real {r.device}"
        assert [as_int(s, subs, env) for s in f.shape] == list(r.shape), f"output {i}: fake shape {f.shape} != real {r.shape}"
        if r.numel() > 1:
            assert [as_int(s, subs, env) for s in f.stride()] == list(r.stride()), \
                f"output {i}: fake strides {f.stride()} != real {r.stride()}"
    return bool(unbacked)


def routing(n, k, e, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.topk(torch.rand((n, e), generator=g), k, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, torch.full_like(idx, -1), idx)
    return idx.to(dtype).contiguous(), torch.rand((n, k), generator=g)


@pytest.mark.parametrize("num_ranks", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_get_dispatch_layout(ops, num_ranks, dtype):
    idx, _ = routing(19, 3, 32, seed=1, dtype=dtype)
    args = (idx, 32, num_ranks)
    assert not compare(ops.get_dispatch_layout(*args), fake_call(ops.get_dispatch_layout.default, args))


CASES = {
    "bf16-topk": dict(),
    "bf16-no-topk": dict(with_topk=False),
    "int32-topk": dict(idx_dtype=torch.int32),
    "fp8-f32-colmajor": dict(fp8="f32"),
    "fp8-ue8m0": dict(fp8="i32"),
    "worst": dict(worst=64),
    "worst-fp8": dict(worst=40, fp8="f32"),
    "zero-tokens": dict(n=0),
    "zero-tokens-worst": dict(n=0, worst=5),
    "num_sms-2": dict(cfg=[2, 6, 256, 6, 128]),
}


def dispatch_args(ops, buf, n=21, h=256, k=4, e=12, with_topk=True, idx_dtype=torch.int64, fp8=None, worst=0, cfg=CFG):
    idx, w = routing(n, k, e, seed=3, dtype=idx_dtype)
    g = torch.Generator().manual_seed(4)
    x, s = torch.randn((n, h), generator=g).to(torch.bfloat16), None
    if fp8:
        x = x.to(torch.float8_e4m3fn)
        s = torch.rand((h // 128, n), generator=g).T if fp8 == "f32" else torch.randint(0, 99, (n, 1), dtype=torch.int32)
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, e, 1)
    return (buf, x, s, idx if with_topk else None, w if with_topk else None, ntpr, in_rank, ntpe, 1, worst, cfg)


@pytest.mark.parametrize("dynamic_inputs", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_cached_dispatch_combine(ops, buffer1, case, dynamic_inputs):
    kw = CASES[case]
    dyn = dict(dynamic_inputs=dynamic_inputs)
    args = dispatch_args(ops, buffer1, **kw)
    real = ops.dispatch.default(*args)
    n_real = int(args[6].sum())
    dynamic = compare(real, fake_call(ops.dispatch.default, args, **dyn), rows=n_real, **dyn)
    assert dynamic == (not kw.get("worst")), "row count is data-dependent exactly when num_worst_tokens == 0"
    # the per-expert counts live on the CPU (the host learns them), empty in worst-case mode
    assert real[4].device.type == "cpu" and real[4].shape == ((0,) if kw.get("worst") else (12,))
    cfg = args[10]
    rpm, cpm, rcpm, src_idx, send_head = real[5:10]
    cargs = (buffer1, args[1], args[2], rpm, cpm, rcpm, src_idx, args[6], send_head, cfg)
    assert not compare(ops.cached_dispatch.default(*cargs), fake_call(ops.cached_dispatch.default, cargs, **dyn), **dyn)
    n, h = args[1].shape
    y = torch.randn((real[0].shape[0], h)).to(torch.bfloat16)
    for w, b0, b1 in [(None, None, None), (real[3] if args[4] is not None else None, torch.ones((n, h), dtype=torch.bfloat16), None),
                      (None, torch.ones((n, h), dtype=torch.bfloat16), torch.ones((n, h), dtype=torch.bfloat16))]:
        cargs = (buffer1, y, w, b0, b1, rpm, cpm, rcpm, src_idx, args[6], send_head, cfg)
        assert not compare(ops.combine.default(*cargs), fake_call(ops.combine.default, cargs, **dyn), **dyn)


# ---------------------------------------------------------------------------------------------
# low-latency: the fake kernels must give DeepEP's layouts (checked now, without the real op),
# and match the real op (checked once LL is implemented on the CPU).

T, H = 8, 1024


@pytest.fixture
def ll_buf(ops):
    """A 1-rank low-latency buffer (the fake kernels read its rank count through buffer_info;
    multi-rank LL geometry is checked in test_roundtrip.py)."""
    e = 8
    nbytes = -(-int(ops.low_latency_rdma_size_hint(T, H, 1, e)) // 128) * 128
    h = make_buffer1(ops, num_nvl_bytes=0, num_rdma_bytes=nbytes, low_latency_mode=True)
    yield h, 1, e
    ops.destroy_buffer(h)


def _ll_expected(num_ranks, e, use_fp8, ue8m0):
    el, rows = e // num_ranks, num_ranks * T
    exp = [((el, rows, H), (rows * H, H, 1), torch.float8_e4m3fn if use_fp8 else torch.bfloat16)]
    if use_fp8:
        cols = H // 512 if ue8m0 else H // 128
        exp.append(((el, rows, cols), (rows * cols, 1, rows), torch.int32 if ue8m0 else torch.float32))  # column-major
    else:
        exp.append(((0,), (1,), torch.float32))
    exp += [((el,), (1,), torch.int32), ((el, rows), (rows, 1), torch.int32), ((el, num_ranks), (num_ranks, 1), torch.int64)]
    return exp


LL_MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-ue8m0": (True, True, True)}


@pytest.mark.lowlatency
@pytest.mark.parametrize("mode", list(LL_MODES))
def test_low_latency_fake_layouts(ops, ll_buf, mode):
    buf, num_ranks, e = ll_buf
    use_fp8, round_scale, ue8m0 = LL_MODES[mode]
    x = torch.randn((5, H)).to(torch.bfloat16)
    idx, w = routing(5, 3, e, seed=9)
    fake = fake_call(ops.low_latency_dispatch.default, (buf, x, idx, w, None, None, T, e, use_fp8, round_scale, ue8m0))
    fake_send = fake_call(ops.low_latency_dispatch_send.default, (buf, x, idx, w, T, e, use_fp8, round_scale, ue8m0))
    for outs in (fake, fake_send[:5]):
        for i, (t, (shape, stride, dtype)) in enumerate(zip(outs, _ll_expected(num_ranks, e, use_fp8, ue8m0))):
            assert tuple(t.shape) == shape and t.dtype == dtype, f"output {i}: {tuple(t.shape)} {t.dtype}, want {shape} {dtype}"
            if t.numel() > 1:
                assert tuple(t.stride()) == stride, f"output {i}: strides {t.stride()}, want {stride}"
    assert tuple(fake_send[5].shape) == (4,) and fake_send[5].dtype == torch.int64
    y = torch.randn((e // num_ranks, num_ranks * T, H)).to(torch.bfloat16)
    src_info = torch.zeros((e // num_ranks, num_ranks * T), dtype=torch.int32)
    layout_range = torch.zeros((e // num_ranks, num_ranks), dtype=torch.int64)
    (state,) = fake_call(ops.low_latency_combine_send.default, (buf, y, src_info, layout_range, T, e, False, False))
    assert tuple(state.shape) == (4,) and state.dtype == torch.int64
    view = fake_call(ops.get_next_low_latency_combine_buffer.default, (buf, T, H, e))[0]
    m = H + H // 128 * 2
    assert tuple(view.shape) == (e // num_ranks, num_ranks * T, H) and tuple(view.stride()) == (num_ranks * T * m, m, 1)
    assert view.dtype == torch.bfloat16


@pytest.mark.lowlatency
@pytest.mark.parametrize("mode", list(LL_MODES))
def test_low_latency_fake_matches_real(ops, ll_buf, mode):
    buf, num_ranks, e = ll_buf
    use_fp8, round_scale, ue8m0 = LL_MODES[mode]
    x = torch.randn((5, H)).to(torch.bfloat16)
    idx, w = routing(5, 3, e, seed=9)
    args = (buf, x, idx, w, None, None, T, e, use_fp8, round_scale, ue8m0)
    real = ll_or_skip(ops.low_latency_dispatch.default, *args)
    assert not compare(real, fake_call(ops.low_latency_dispatch.default, args))
    sargs = (buf, x, idx, w, T, e, use_fp8, round_scale, ue8m0)
    real_s = ops.low_latency_dispatch_send.default(*sargs)
    ops.low_latency_dispatch_recv.default(buf, real_s[5], *real_s[:5], None, None, T, e, use_fp8, round_scale, ue8m0)
    assert not compare(real_s, fake_call(ops.low_latency_dispatch_send.default, sargs))
    view = ops.get_next_low_latency_combine_buffer.default(buf, T, H, e)
    assert not compare(view, fake_call(ops.get_next_low_latency_combine_buffer.default, (buf, T, H, e)))
