"""GPU twin of tests/python/test_kernel_names.py: the kernel names torch.profiler reports for a
normal-mode layout + dispatch + combine and a low-latency dispatch + combine, at 1 and 4 ranks
(the ipc backend shares one GPU when there are fewer). Every kernel of the library is reported as
`[void ]deep_ep::<namespace>::<name>...` (never `__nv_static_...`), and the kernels of these ops
are the ones docs/OPS.md lists for them."""
import re
import sys
from pathlib import Path

import pytest
import torch

import _spawn

# After tests/gpu: tests/python has its own test_low_latency.py, which must not shadow ours when
# pytest collects both files in one run (spawned workers look their module up by name).
sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))

EXPECTED = ["deep_ep::layout::dispatch_layout", "deep_ep::ic::check_sync", "deep_ep::ic::stage_inputs", "deep_ep::ic::pull_dispatch",
            "deep_ep::ic::fused_combine", "deep_ep::ll::dispatch", "deep_ep::ll::combine"]


def _names(rank, world):
    import torch.distributed as dist

    import deep_ep_rs

    t, h, e, n = 32, 2048, 8 * world, 24
    cfg = deep_ep_rs.Buffer.get_dispatch_config(world)
    nvl = max(cfg.get_nvl_buffer_size_hint(h * 2, world), deep_ep_rs.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(h * 2, world))
    buf = deep_ep_rs.Buffer(dist.group.WORLD, nvl, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True,
                            explicitly_destroy=True)
    gen = torch.Generator(device=buf.device).manual_seed(rank)
    _spawn.ht_check(buf, rank, world, n, h, e, 4, gen, 1)  # warm-up
    buf.clean_low_latency_buffer(t, h, e)
    x = torch.randn((n, h), dtype=torch.bfloat16, device=buf.device)
    idx = torch.stack([torch.randperm(e, device=buf.device)[:4] for _ in range(n)])
    w = torch.rand((n, 4), dtype=torch.float32, device=buf.device)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _spawn.ht_check(buf, rank, world, n, h, e, 4, gen, 2)
        buf.clean_low_latency_buffer(t, h, e)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        buf.low_latency_combine(recv, idx, w, handle)
        torch.cuda.synchronize()
    keys = sorted({evt.key for evt in prof.key_averages() if evt.device_type == torch.autograd.DeviceType.CUDA})
    buf.destroy()
    return keys


@pytest.mark.parametrize("world", [1, 4])
def test_profiler_names_are_deep_eps(world):
    out = _spawn.run(_names, world, env={"DEEP_EP_BACKEND": _spawn.gpu_backend(world)})
    for rank, r in enumerate(out):
        keys = r["ok"]
        ours = [k for k in keys if "deep_ep" in k]
        bad = [k for k in ours if "__nv_static" in k or not re.match(r"(void )?deep_ep::", k)]
        assert not bad, f"rank {rank}: kernels not named deep_ep::...: {bad}"
        qualified = {re.match(r"(?:void )?([^<(]*)", k).group(1) for k in ours}
        missing = [k for k in EXPECTED if k not in qualified]
        assert not missing, f"rank {rank}: {missing} not among the profiled kernels {sorted(qualified)}"
