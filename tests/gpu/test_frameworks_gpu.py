"""GPU twin of tests/python/test_frameworks.py: the Megatron-Core, SGLang and vLLM call sequences
(tests/python/_frameworks.py) at one rank on one GPU (the nccl backend), under DeepEP's harness
defaults with `torch.set_default_device('cuda')`; `deep_ep` aliasing; the profiler's kernel table
of one low-latency dispatch + combine has exactly one kernel whose name contains `dispatch` and one
containing `combine` (as DeepEP's, whose halves are launches of one kernel), each launched once, with
a hook too (at one rank a hook-mode call runs the whole op)."""
import sys
from pathlib import Path

import pytest
import torch

import _spawn

sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
import _frameworks  # noqa: E402


def _entry(rank, world, name):
    dev = f"cuda:{rank}"
    return _frameworks.WORKERS[name](rank, world, dev, "cuda")


@pytest.mark.parametrize("name", sorted(_frameworks.WORKERS))
def test_framework_call_path_one_gpu(name):
    out = _spawn.run(_entry, 1, name, env={"DEEP_EP_BACKEND": _spawn.gpu_backend(1)})
    assert out[0] and out[0]["ok"], out


def _kernel_names(rank, world):
    import torch.distributed as dist

    import deep_ep_rs

    t, h, e = 64, 7168, 8
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    x = torch.randn((t, h), dtype=torch.bfloat16, device="cuda")
    idx = torch.stack([torch.randperm(e, device="cuda")[:4] for _ in range(t)])
    w = torch.rand((t, 4), dtype=torch.float32, device="cuda")
    names = {}
    for hook in (False, True):
        recv, _, handle, _, hk = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True, return_recv_hook=hook)
        if hk:
            hk()
        y = (recv[0].float() * recv[1].repeat_interleave(128, dim=2)).to(torch.bfloat16)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            recv, _, handle, _, hk = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True, return_recv_hook=hook)
            if hk:
                hk()
            _, _, hk = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
            if hk:
                hk()
            torch.cuda.synchronize()
        names[f"hook={hook}"] = {evt.key: evt.count for evt in prof.key_averages() if evt.device_type == torch.autograd.DeviceType.CUDA}
    buf.destroy()
    return names


def test_profiler_finds_one_dispatch_and_one_combine_kernel():
    out = _spawn.run(_kernel_names, 1, env={"DEEP_EP_BACKEND": _spawn.gpu_backend(1)})
    for mode, counts in out[0]["ok"].items():
        for word in ("dispatch", "combine"):
            hits = [k for k in counts if word in k]
            assert len(hits) == 1, f"{mode}: kernels naming {word!r}: {hits} (all: {counts})"
            # One launch per op, with a hook too: at one rank a hook-mode call runs the whole op.
            assert counts[hits[0]] == 1, f"{mode}: {counts[hits[0]]} launches of {hits[0]} (all: {counts})"
