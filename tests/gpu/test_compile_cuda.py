"""torch.compile, opcheck, CUDA graphs and autograd on CUDA tensors (1-rank NCCL buffers on cuda:0),
plus the C++ example on 2 GPUs.

- opcheck (all four checks) for every normal-mode op and the low-latency pair on CUDA tensors;
- examples/moe_layer.py: prefill compiled with fullgraph=True equals eager; the LL decode step
  compiled with mode="reduce-overhead" (inductor CUDA graphs) equals eager on replays;
- prefill's gradients match the same layer in plain fp32 torch on one GPU.
Low-latency cases xfail (with the library's message) only while the op answers "not implemented"
on this backend, so they start running as soon as the GPU low-latency kernels exist.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deep_ep_rs  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from moe_layer import MoELayer, make_params, reference  # noqa: E402

ops = torch.ops.deep_ep
DEV = torch.device("cuda", 0)
CFG = [20, 6, 256, 6, 128]
H, EL, K, T = 256, 4, 2, 16
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NOT_IMPLEMENTED = re.compile(r"not implemented", re.IGNORECASE)


def ll(fn, *args, **kwargs):
    """Runs a low-latency call; xfails (not fails) only on the library's "not implemented"."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as e:
        if NOT_IMPLEMENTED.search(str(e)):
            pytest.xfail(f"low-latency mode not implemented on the GPU backend yet: {e}")
        raise


def make_buffer(low_latency: bool):
    uid = ops.get_unique_id("", DEV)
    rdma = -(-int(ops.low_latency_rdma_size_hint(T, H, 1, EL)) // 128) * 128 if low_latency else 0
    return int(ops.create_buffer(uid, 0, 1, DEV, 1 << 24, rdma, low_latency, ""))


@pytest.fixture
def ht_buffer():
    h = make_buffer(False)
    yield h
    ops.destroy_buffer(h)


@pytest.fixture
def ll_buffer():
    made = []

    def make():
        made.append(ll(make_buffer, True))
        return made[-1]

    yield make
    for h in made:
        ops.destroy_buffer(h)


def check(op, args, utils=ALL_UTILS):
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert result == {u: "SUCCESS" for u in utils}, result


def routing(n, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.topk(torch.rand((n, e), generator=g), k, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.25, torch.full_like(idx, -1), idx)
    return idx.contiguous().to(DEV), torch.rand((n, k), generator=g).to(DEV)


def layout_and_x(n=24, k=4, e=8, seed=0):
    idx, w = routing(n, k, e, seed)
    x = torch.randn((n, H), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)
    return x, idx, w, ops.get_dispatch_layout(idx, e, 1)


# ---- opcheck on CUDA tensors -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_opcheck_layout(dtype):
    idx, _ = routing(32, 4, 16, 1)
    check(ops.get_dispatch_layout.default, (idx.to(dtype), 16, 2))


@pytest.mark.parametrize("kind", ["plain", "topk", "worst"])
def test_opcheck_dispatch(ht_buffer, kind):
    x, idx, w, (ntpr, _, ntpe, in_rank) = layout_and_x()
    with_topk = kind != "plain"
    check(ops.dispatch.default, (ht_buffer, x, None, idx if with_topk else None, w if with_topk else None, ntpr, in_rank, ntpe, 1,
                                 64 if kind == "worst" else 0, CFG))


def _dispatched(buf):
    x, idx, w, (ntpr, _, ntpe, in_rank) = layout_and_x()
    d = ops.dispatch.default(buf, x, None, idx, w, ntpr, in_rank, ntpe, 1, 0, CFG)
    return x, d, (d[5], d[6], d[7], d[8], in_rank, d[9])


def test_opcheck_cached_dispatch(ht_buffer):
    x, _, handle = _dispatched(ht_buffer)
    check(ops.cached_dispatch.default, (ht_buffer, x, None) + handle + (CFG,))


@pytest.mark.parametrize("with_weights", [False, True])
def test_opcheck_combine(ht_buffer, with_weights):
    _, d, handle = _dispatched(ht_buffer)
    check(ops.combine.default, (ht_buffer, d[0], d[3] if with_weights else None, None, None) + handle + (CFG,))


def test_opcheck_low_latency(ll_buffer):
    # Not test_aot_dispatch_dynamic for dispatch: it compares every output element of an eager and
    # a traced call, but (as in DeepEP) the slots of recv_x / scales / src_info past each expert's
    # recv_count are unspecified on the GPU (torch.empty, not cleared: clearing [E_l, R*T, H] on
    # every decode step would cost more than the dispatch). test_low_latency_dispatch_traced_equals_eager
    # checks the traced call on the specified part.
    for util in ALL_UTILS[:3]:  # fresh buffer per check: LL calls form a sequence per buffer
        buf = ll_buffer()
        idx, w = routing(8, K, EL, 3)
        x = torch.randn((8, H), device=DEV).to(torch.bfloat16)
        args = (buf, x, idx, w, None, None, T, EL, False, False, False)
        ll(check, ops.low_latency_dispatch.default, args, (util,))
    buf = ll_buffer()
    recv_x, _, _, src_info, layout_range = ll(ops.low_latency_dispatch.default, buf, x, idx, w, None, None, T, EL, False, False, False)
    out = torch.empty((8, H), dtype=torch.bfloat16, device=DEV)
    check(ops.low_latency_combine.default, (buf, recv_x, idx, w, src_info, layout_range, out, None, T, EL, False, False), ALL_UTILS[:3])


def _valid_ll_rows(res):
    recv_x, _, count, src_info, layout_range = res
    rows = [recv_x[e, : int(count[e])] for e in range(recv_x.shape[0])]
    info = [src_info[e, : int(count[e])] for e in range(recv_x.shape[0])]
    return rows, info, count, layout_range


def test_low_latency_dispatch_traced_equals_eager(ll_buffer):
    """The AOT-traced (aot_eager, fullgraph) LL dispatch equals the eager one on every specified
    output: the first recv_count rows of every expert, their src_info, counts, layout_range."""
    torch._dynamo.reset()
    buf = ll_buffer()
    idx, w = routing(8, K, EL, 3)
    x = torch.randn((8, H), device=DEV).to(torch.bfloat16)

    def f(x, idx, w):
        return ops.low_latency_dispatch.default(buf, x, idx, w, None, None, T, EL, False, False, False)

    want = ll(f, x, idx, w)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, idx, w)
    torch.cuda.synchronize()
    (wr, wi, wc, wl), (gr, gi, gc, gl) = _valid_ll_rows(want), _valid_ll_rows(got)
    assert int(wc.sum()) > 0
    assert torch.equal(wc, gc) and torch.equal(wl, gl)
    assert all(torch.equal(a, b) for a, b in zip(wr, gr)) and all(torch.equal(a, b) for a, b in zip(wi, gi))


# ---- the reference MoE layer: compile, CUDA graphs, autograd ---------------------------------


def layer_on(buf):
    return MoELayer(buf, 1, 0, hidden=H, experts_per_rank=EL, topk=K, max_decode_tokens=T, config=CFG, device=DEV)


def test_moe_prefill_compiled_fullgraph_equals_eager(ht_buffer):
    torch._dynamo.reset()
    layer = layer_on(ht_buffer)
    compiled = torch.compile(layer.prefill, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (13, 64, 1):
            x = torch.randn((n, H), device=DEV).to(torch.bfloat16)
            want = layer.prefill(x)
            assert float(want.float().abs().sum()) > 0
            # The deep_ep ops are bit-exact under compile (the traced-vs-eager op tests above);
            # the layer's router softmax and expert matmuls are inductor's own kernels, whose
            # rounding may differ from eager in the last bf16 bit (seen at n = 64 on one H200).
            torch.testing.assert_close(compiled(x), want, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"n={n}: {m}")


def test_moe_decode_reduce_overhead_equals_eager(ll_buffer):
    torch._dynamo.reset()
    layer = layer_on(ll_buffer())
    x = torch.randn((T, H), device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        want = ll(layer.decode, x)
        compiled = torch.compile(layer.decode, mode="reduce-overhead", fullgraph=True)
        first = None
        for i in range(4):  # warm-up, recording, then CUDA-graph replays
            got = compiled(x).clone()
            torch.cuda.synchronize()
            # The router's softmax is inductor's kernel under compile, whose f32 rounding may differ
            # from eager's in the last bit (as in the prefill test above), and a top-k weight one ulp
            # off moves a bf16 output by one ulp: eager within bf16 tolerance; the graph replays
            # (what reduce-overhead adds) bit-exact with the first compiled call.
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"call {i}: {m}")
            first = got if first is None else first
            assert torch.equal(got, first), f"call {i}: a CUDA-graph replay differs from the first compiled call"
    router, w_all = make_params(1, H, EL)
    ref = reference([x.cpu()], router, w_all, K)[0]
    assert ((want.float().cpu() - ref).norm() / ref.norm()) < 1e-2


def test_moe_prefill_gradients_match_plain_torch(ht_buffer):
    layer = layer_on(ht_buffer)
    router0, w_all0 = make_params(1, H, EL)
    g = torch.Generator().manual_seed(5)
    x0, target = torch.randn((37, H), generator=g).to(torch.bfloat16), torch.randn((37, H), generator=g)
    x = x0.to(DEV).requires_grad_()
    (layer(x).float() * target.to(DEV)).sum().backward()
    xr, rr, wr = x0.float().to(DEV).requires_grad_(), router0.to(DEV).requires_grad_(), w_all0.float().to(DEV).requires_grad_()
    (reference([xr], rr, wr, K)[0] * target.to(DEV)).sum().backward()

    def err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    errs = {"x": err(x.grad, xr.grad), "router": err(layer.router.grad, rr.grad), "w": err(layer.w.grad, wr.grad)}
    assert all(v < 1e-2 for v in errs.values()), errs


# ---- the C++ example on 2 GPUs -----------------------------------------------------------------


def test_cpp_server_two_gpus():
    exe = ROOT / "build" / "cpp_server" / "cpp_server"
    if not exe.is_file():
        pytest.skip("build/cpp_server/cpp_server not built (make cpp-test builds it)")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    lib = os.environ.get("DEEP_EP_LIBRARY", deep_ep_rs.library_path())
    # The binary may have been built on another machine: resolve libtorch and cudart from this
    # python's torch wheel rather than from the build-time rpath.
    site = Path(torch.__file__).resolve().parents[1]
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [str(site / "torch" / "lib"), str(site / "nvidia" / "cu13" / "lib"), os.environ.get("LD_LIBRARY_PATH", "")]))
    r = subprocess.run([str(exe), "--ranks", "2", "--lib", lib, "--tokens", "128", "--hidden", "1024", "--iters", "20"],
                       capture_output=True, text=True, timeout=300, env=env)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("all checks passed") == 2 and "HT dispatch+combine: ok" in r.stdout
