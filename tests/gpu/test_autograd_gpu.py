"""GPU twin of the cached-dispatch and internode autograd tests of tests/python/test_autograd.py
(`test_moe_grad_buffer_paths`, `test_exact_grad_buffer_paths`): at 2 and 4 ranks, intranode (one
NVLink domain) and internode (DEEP_EP_NVL_DOMAIN_SIZE=1 at 2 ranks, 2 at 4 ranks; the inter-node
leg over the transport seam's LSA emulation, DEEP_EP_RDMA_TRANSPORT=lsa, as
test_internode_gpu.py):

- a MoE layer through `Buffer` (dispatch, cached dispatch of a second input with the handle,
  experts, combine; the internode ops when the ranks span several domains) trained one step on
  the GPU: output and the gradients of both inputs, the router and the expert weights against the
  same layer in plain fp32 torch (CPU), to bf16 accuracy;
- bit-exact adjoints on the GPU: backward(dispatch) == combine(grad), backward(cached dispatch) ==
  combine(grad), backward(combine) == cached dispatch(grad), worst-case padding included, and a
  dispatch config whose NVLink chunk sizes internode combine refuses;
- no "autograd kernel was not registered" warning on any rank.

One process per GPU, or all ranks on one GPU with the ipc backend (`_spawn`). DEEP_EP_GPU_DRY=1
runs the same ranks on the CPU backend (no GPU), which checks the harness.
"""
import os
import sys
from pathlib import Path

import pytest

import _spawn

sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
import test_autograd as cpu_tests  # noqa: E402

DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True
#: MiB of each buffer area (the layer's rows are 64 bf16 wide and at most a few hundred per rank).
MIB = 64


def _env(world, d):
    env = {"DEEP_EP_NVL_DOMAIN_SIZE": str(d), "DEEP_EP_TIMEOUT_MS": os.environ.get("DEEP_EP_TIMEOUT_MS", "30000")}
    if DRY:
        env["DEEP_EP_BACKEND"] = "cpu"
    else:
        env["DEEP_EP_BACKEND"] = _spawn.gpu_backend(world)
    if world > d:
        env["DEEP_EP_RDMA_TRANSPORT"] = "lsa"
    return env


def _worker(rank, world, d, what):
    import torch.distributed as dist

    import deep_ep_rs

    internode = world > d
    dev = "cpu" if DRY else _spawn.device(rank)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, MIB << 20, (MIB << 20) if internode else 0, device=dev, explicitly_destroy=True)
    try:
        assert buf.get_num_rdma_ranks() == (world // d if internode else 1)
        out, warned = cpu_tests.run_paths(buf, rank, world, what)
        return {"results": out, "warned": warned, "device": str(buf.device)}
    finally:
        buf.destroy()


@pytest.mark.parametrize("world,d", cpu_tests.PATHS, ids=cpu_tests.PATH_IDS)
def test_moe_grad_buffer_paths_gpu(world, d):
    out = _spawn.run(_worker, world, d, "moe", env=_env(world, d), dry=DRY)
    for o in out:
        assert o and len(o["ok"]["results"]) == 4, out
        assert o["ok"]["warned"] == [], o["ok"]["warned"]
        assert DRY or o["ok"]["device"].startswith("cuda"), o


@pytest.mark.parametrize("world,d", cpu_tests.PATHS, ids=cpu_tests.PATH_IDS)
def test_exact_grad_buffer_paths_gpu(world, d):
    out = _spawn.run(_worker, world, d, "exact", env=_env(world, d), dry=DRY)
    for o in out:
        assert o and len(o["ok"]["results"]) == 4, out
        assert o["ok"]["warned"] == [], o["ok"]["warned"]
        assert all(r[0] == 128 for r in o["ok"]["results"][2:])  # worst-case rows
    assert sum(r[1] for o in out for r in o["ok"]["results"]) > 0, "tokens must really move"
