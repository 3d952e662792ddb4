"""The CPU bad-input cases (tests/python/test_bad_input.py, CASES) on a 1-rank nccl buffer with
CUDA tensors, plus GPU-only cases (mixed devices, calls after destroy, rank counts the nccl
backend refuses, NaN/Inf payloads). Each malformed call raises a RuntimeError that starts with
the op and names the argument; after each one a correct dispatch -> combine on the same buffer is
checked in closed form, so the library stays usable.

The cases are shared: this module imports them and swaps in CUDA inputs (the cases' own tensors are
created under `with torch.device("cuda:0")`). Content checks of the routing inputs (routing tensors
that disagree with topk_idx, ids out of range, handles of another dispatch) are made on the GPU by
a small kernel before the barrier that gathers the op's header (the data barrier; the fused
combine's start barrier) (kernels/intranode_check.cu, DEVICE_CHECKS):
a dispatch raises them in the call (its host wait sees the error); a cached dispatch or a combine
does not wait on the host, so the buffer's next call raises them. A worst-case overflow is found by
a kernel and raised by the call or by the buffer's next call (KERNEL_CHECKS). A 4-GPU case checks
that one rank's bad input is raised on every rank, naming that rank, and that all keep working
(with the fused and with the split combine).

DEEP_EP_GPU_DRY=1 runs the module without a GPU (cpu device and backend; the GPU-only cases skip),
to check the harness itself.
"""
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

PY = Path(__file__).resolve().parents[1] / "python"
sys.path.append(str(PY))


def _import_cases():
    """tests/python/test_bad_input.py imports tests/python/conftest.py as `conftest`; that name is
    this directory's conftest under pytest, so load the CPU one for the import only, and keep the
    environment it would change."""
    saved_mod, saved_env = sys.modules.get("conftest"), dict(os.environ)
    spec = importlib.util.spec_from_file_location("conftest", PY / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["conftest"] = mod
    try:
        import test_bad_input
    finally:
        if saved_mod is not None:
            sys.modules["conftest"] = saved_mod
        os.environ.clear()
        os.environ.update(saved_env)
    return test_bad_input


tb = _import_cases()
import _spawn  # noqa: E402
import deep_ep_rs  # noqa: E402,F401  (loads the library: registers torch.ops.deep_ep)

SUPPORTS_DRY = True
DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
DEV = torch.device("cpu") if DRY else torch.device("cuda", 0)
BACKEND = "cpu" if DRY else "nccl"
_cpu_good_inputs = tb.good_inputs

# Content checks the nccl backend makes on the device: raised by the call ("call") or, without a host
# wait in the op, by the buffer's next call ("next"); the cpu backend (dry run) raises all in the call.
DEVICE_CHECKS = {"dispatch-expert-id-too-large": "call", "dispatch-expert-id-below-minus-one": "call", "dispatch-ntpr-inconsistent": "call",
                 "dispatch-ntpe-inconsistent": "call", "dispatch-in-rank-inconsistent": "call",
                 "cached-stale-handle-other-dispatch": "next", "combine-stale-handle": "next"}
# Found by a kernel (no host sync in worst-case mode): raised by the call or by the buffer's next call.
KERNEL_CHECKS = {"dispatch-worst-too-small"}
# Same error, other words on CUDA inputs.
GPU_REGEX = {} if DRY else {"invalid-unique-id": r"unique_id must be a 1-D uint8 CPU tensor"}


def _cuda_good_inputs(*a, **kw):
    return tuple(t.to(DEV) for t in _cpu_good_inputs(*a, **kw))


def sync():
    if not DRY:
        torch.cuda.synchronize()


def new_buffer(nvl):
    ops = torch.ops.deep_ep
    return int(ops.create_buffer(ops.get_unique_id(BACKEND, DEV), 0, 1, DEV, nvl, 0, False, BACKEND))


@pytest.fixture(scope="module")
def gpu_buffer():
    if not DRY and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    if not DRY:
        torch.cuda.set_device(DEV)
    ops = torch.ops.deep_ep
    h = new_buffer(1 << 24)
    tb.good_inputs = _cuda_good_inputs
    try:
        assert gpu_works(h) > 0
        yield h
    finally:
        tb.good_inputs = _cpu_good_inputs
        ops.destroy_buffer(h)


def gpu_works(h, seed=123):
    """A correct dispatch -> cached dispatch -> combine on the 1-rank buffer h, checked in closed
    form: every token with a valid expert arrives once, in order; combine returns it."""
    x, idx, w = _cuda_good_inputs(seed)
    ntpr, in_rank, ntpe = tb.layout(idx)
    out = tb.dispatch(h, x, idx, w, lay=(ntpr, in_rank, ntpe))
    sel = in_rank[:, 0]
    assert torch.equal(out[0], x[sel]), "dispatch after an error returned wrong rows"
    hd = tb.handle_of(out, in_rank)
    cx, _ = torch.ops.deep_ep.cached_dispatch(h, x, None, *hd, tb.CFG)
    assert torch.equal(cx, x[sel])
    got, _ = torch.ops.deep_ep.combine(h, out[0], None, None, None, *hd, tb.CFG)
    assert torch.equal(got, torch.where(sel.view(-1, 1), x, torch.zeros_like(x))), "combine after an error returned wrong values"
    sync()
    return int(sel.sum())


@pytest.mark.parametrize("case", tb.CASES, ids=[c[0] for c in tb.CASES])
def test_shared_bad_call_on_gpu_then_still_usable(gpu_buffer, case):
    name, op, regex, fn = case
    ctx = tb.Ctx(gpu_buffer)
    if name in KERNEL_CHECKS:
        with pytest.raises(RuntimeError) as ei:
            with torch.device(DEV):
                fn(ctx)
            sync()
            gpu_works(gpu_buffer)
        assert str(ei.value).startswith("deep_ep::dispatch: ") and re.search(regex, str(ei.value)), str(ei.value)
    elif name in DEVICE_CHECKS:
        with pytest.raises(RuntimeError) as ei:
            with torch.device(DEV):
                fn(ctx)
            assert DEVICE_CHECKS[name] == "next", "the call should have raised"
            sync()
            gpu_works(gpu_buffer)  # its dispatch raises the error the earlier call's kernel found
        msg = str(ei.value)
        first = op if DRY or DEVICE_CHECKS[name] == "call" else "dispatch"
        assert msg.startswith(f"deep_ep::{first}: ") and re.search(regex, msg), msg
        if not DRY:
            assert "rank 0's inputs, checked on the GPU" in msg, msg
    else:
        with torch.device(DEV):
            tb.expect_error(op, GPU_REGEX.get(name, regex), fn, ctx)
    assert gpu_works(gpu_buffer, seed=len(name)) > 0


GPU_CASES = [
    ("mixed-x-on-cpu", "dispatch", r"\bx must .*cuda:0.*got .*cpu", lambda c: c.d(x=c.x.cpu())),
    ("mixed-topk-on-cpu", "dispatch", r"topk_idx must .*cuda:0", lambda c: c.d(idx=c.idx.cpu())),
    ("mixed-weights-on-cpu", "dispatch", r"topk_weights must .*cuda:0", lambda c: c.d(w=c.w.cpu())),
    ("mixed-layout-on-cpu", "dispatch", r"num_tokens_per_rank must .*cuda:0", lambda c: c.d(ntpr=c.ntpr.cpu())),
    ("mixed-cached-x-on-cpu", "cached_dispatch", r"\bx must .*cuda:0", lambda c: c.cached(x=c.x.cpu())),
    ("mixed-combine-x-on-cpu", "combine", r"\bx must .*cuda:0", lambda c: c.combine(y=c.y.cpu())),
    ("mixed-bias-on-cpu", "combine", r"bias_0 must .*cuda:0", lambda c: c.combine(b0=torch.zeros((tb.N, tb.H), dtype=torch.bfloat16))),
    ("nccl-on-cpu-device", "create_buffer", r"needs a CUDA device",
     lambda c: torch.ops.deep_ep.create_buffer(torch.zeros(128, dtype=torch.uint8), 0, 2, torch.device("cpu"), 1 << 20, 0, False, "nccl")),
    # Buffers that fill NVLink domains and carry an RDMA area pass the topology rules, so the
    # backend's own limits answer, before NCCL's init would wait for absent ranks: 264 ranks is
    # past every limit (LL mode: normal mode stops at 20 domains first), 64 past the LSA
    # emulation's reach (DEEP_EP_RDMA_TRANSPORT unset).
    ("nccl-too-many-ranks", "create_buffer", r"264 ranks: a buffer has at most 256",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("nccl", DEV), 0, 264, DEV, 1 << 20, 1 << 20, True, "nccl")),
    ("nccl-past-the-emulation", "create_buffer", r"64 ranks: the LSA emulation .* at most 32 ranks.*DEEP_EP_RDMA_TRANSPORT=gin",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("nccl", DEV), 0, 64, DEV, 1 << 20, 1 << 20, False, "nccl")),
    ("mask-rank-out-of-range", "low_latency_update_mask_buffer", r"rank_to_mask must be in \[0, 1\)",
     lambda c: torch.ops.deep_ep.low_latency_update_mask_buffer(c.h, 4, True)),
    ("mask-status-wrong-length", "low_latency_query_mask_buffer", r"mask_status must be a 1-D int32",
     lambda c: torch.ops.deep_ep.low_latency_query_mask_buffer(c.h, torch.zeros(3, dtype=torch.int32, device=DEV))),
    ("wait-stats-on-gpu-buffer", "wait_stats", r"not implemented on the nccl backend", lambda c: torch.ops.deep_ep.wait_stats(c.h)),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_only_bad_call_then_still_usable(gpu_buffer, case):
    name, op, regex, fn = case
    if DRY and (name.startswith("mixed-") or name.startswith("nccl-") or name == "wait-stats-on-gpu-buffer"):
        pytest.skip("needs a CUDA device")
    tb.expect_error(op, regex, fn, tb.Ctx(gpu_buffer))
    assert gpu_works(gpu_buffer) > 0


def test_calls_after_destroy_on_gpu(gpu_buffer):
    ops = torch.ops.deep_ep
    h = new_buffer(1 << 22)
    c = tb.Ctx(h)
    ops.destroy_buffer(h)
    calls = [("dispatch", lambda: c.d()), ("cached_dispatch", lambda: c.cached()), ("combine", lambda: c.combine()),
             ("destroy_buffer", lambda: ops.destroy_buffer(h)), ("low_latency_clean_mask_buffer", lambda: ops.low_latency_clean_mask_buffer(h))]
    for op, fn in calls:
        tb.expect_error(op, r"buffer handle \d+ was destroyed", fn)
    assert gpu_works(gpu_buffer) > 0


def test_nan_inf_payloads_travel_unchanged_on_gpu(gpu_buffer):
    x, idx, w = _cuda_good_inputs(11)
    x[0, 0], x[1, 3], x[2, 5] = float("nan"), float("inf"), float("-inf")
    idx[:3] = torch.tensor([0, 1], device=DEV)
    ntpr, in_rank, ntpe = tb.layout(idx)
    out = tb.dispatch(gpu_buffer, x, idx, w, lay=(ntpr, in_rank, ntpe))
    sel = in_rank[:, 0]
    assert torch.equal(out[0].view(torch.int16), x[sel].view(torch.int16)), "NaN/Inf rows must arrive bit for bit"
    got, _ = torch.ops.deep_ep.combine(gpu_buffer, out[0], None, None, None, *tb.handle_of(out, in_rank), tb.CFG)
    assert bool(got[0, 0].isnan()) and bool(got[1, 3].isinf()) and float(got[2, 5]) == float("-inf")
    assert gpu_works(gpu_buffer) > 0


def test_at_least_forty_malformed_calls_on_gpu():
    assert len(tb.CASES) + len(GPU_CASES) + 5 >= 40


def one_rank_bad_worker(rank, world):
    """Rank 1 dispatches with an expert id out of range, then rank 2 combines with a handle mixed
    from two dispatches: every rank raises the error naming that rank (the dispatch in the call,
    the combine at the next call), and all keep working (closed-form round trips)."""
    import torch.distributed as dist

    import deep_ep_rs

    dev = _spawn.device(rank)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 64 << 20, device=dev, backend=_spawn.gpu_backend(), explicitly_destroy=True)
    gen = torch.Generator(device=dev).manual_seed(rank)
    shape = dict(n=96, hidden=1024, experts=16, topk=2)
    rows = _spawn.ht_check(buf, rank, world, gen=gen, salt=0, **shape)
    n, e = 64, 16
    x = _spawn.pattern_x(rank, n, 1024, 1, dev)
    w = torch.ones((n, 2), device=dev)

    def routed(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        idx = torch.rand((n, e), generator=g, device=dev).topk(2, dim=1).indices
        return (idx,) + tuple(buf.get_dispatch_layout(idx, e)[i] for i in (0, 2, 3))

    idx, ntpr, ntpe, in_rank = routed(10 + rank)
    if rank == 1:
        idx[5, 1] = e
    with pytest.raises(RuntimeError, match=r"^deep_ep::dispatch: topk_idx holds expert id 16, outside \[-1, 16\) \(rank 1's inputs"):
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    rows += _spawn.ht_check(buf, rank, world, gen=gen, salt=2, **shape)

    handles = []
    for seed in (20 + rank, 30 + rank):
        idx, ntpr, ntpe, in_rank = routed(seed)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                  topk_idx=idx, topk_weights=w)
        handles.append((recv_x, handle))
    recv_x, h1 = handles[0]
    h2 = handles[1][1]
    stale = tuple(h1[:4]) + (h2[4], h2[5]) + tuple(h1[6:]) if rank == 2 else h1
    buf.combine(recv_x, stale)  # no host wait: rank 2's stale handle is raised by the next call
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"^deep_ep::dispatch: stale handle: .*\(rank 2's inputs, checked on the GPU"):
        _spawn.ht_check(buf, rank, world, gen=gen, salt=3, **shape)
    rows += _spawn.ht_check(buf, rank, world, gen=gen, salt=4, **shape)
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    return rows


@pytest.mark.parametrize("combine_path", ["fused", "split"])
def test_one_rank_bad_input_raises_on_every_rank(combine_path, monkeypatch):
    """Both combine paths (DEEP_EP_INTRANODE_COMBINE, inherited by the workers): the fused one
    raises the check at its start barrier, the split one at its data barrier."""
    monkeypatch.setenv("DEEP_EP_INTRANODE_COMBINE", combine_path)
    if DRY:
        pytest.skip("needs 4 GPUs (the cpu backend's multi-rank cases: tests/python/test_bad_input_ranks.py)")
    res = _spawn.run(one_rank_bad_worker, 4)
    assert all(o["ok"] > 0 for o in res), res
