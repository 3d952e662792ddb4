"""The CPU bad-input cases (tests/python/test_bad_input.py, CASES) on a 1-rank nccl buffer with
CUDA tensors, plus GPU-only cases (mixed devices, calls after destroy, rank counts the nccl
backend refuses, NaN/Inf payloads). Each malformed call raises a RuntimeError that starts with
the op and names the argument; after each one a correct dispatch -> combine on the same buffer is
checked in closed form, so the library stays usable.

The cases are shared: this module imports them and swaps in CUDA inputs (the cases' own tensors are
created under `with torch.device("cuda:0")`). Content checks that need the data on the host
(routing tensors that disagree with topk_idx, ids out of range, handles of another dispatch) are
made by the cpu backend; on the nccl backend they would need a device sync, so the GPU path does
not raise for them (HOST_CONTENT_CHECKS): those calls must leave the library usable. A worst-case
overflow is found by a kernel and raised by the call or by the buffer's next call (KERNEL_CHECKS).

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
sys.path.insert(0, str(PY))


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
import deep_ep_rs  # noqa: E402,F401  (loads the library: registers torch.ops.deep_ep)

SUPPORTS_DRY = True
DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
DEV = torch.device("cpu") if DRY else torch.device("cuda", 0)
BACKEND = "cpu" if DRY else "nccl"
_cpu_good_inputs = tb.good_inputs

# Data-content checks the cpu backend makes on the host and the nccl backend does not.
HOST_CONTENT_CHECKS = {"dispatch-expert-id-too-large", "dispatch-expert-id-below-minus-one", "dispatch-ntpr-inconsistent",
                       "dispatch-ntpe-inconsistent", "dispatch-in-rank-inconsistent", "cached-stale-handle-other-dispatch",
                       "combine-stale-handle"}
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
    elif name in HOST_CONTENT_CHECKS:
        try:
            with torch.device(DEV):
                fn(ctx)
            sync()
        except RuntimeError as e:
            assert str(e).startswith("deep_ep::"), str(e)
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
    ("nccl-too-many-ranks", "create_buffer", r"more than 8 ranks",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("nccl", DEV), 0, 9, DEV, 1 << 20, 0, False, "nccl")),
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
