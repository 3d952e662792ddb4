"""GPU twin of test_reliability2.py's item 1 (an LL call a rank gave up is never delivered to a
late peer): two ranks (two GPUs, or one GPU with the ipc backend: `_spawn`) run LL step 0; rank 1
then sleeps past rank 0's deadline, so rank 0's step-1 receive times out on the device, gives the
call up (its signals at rank 1 now hold the call's abandoned tag) and raises, or in shrink mode
masks rank 1 and completes. Rank 1's next call pairs with the given-up one: its receive must
refuse it, naming rank 0 and the call, instead of taking rank 0's step-1 tokens.

GPU errors surface at the next call on the buffer (the kernels run after the op returns), so each
rank ends with a synchronisation and one more LL call that reports what the kernels found.
DEEP_EP_GPU_DRY=1 runs the same ranks on the CPU backend (no GPU), which checks the harness.
"""
import os
import time

import pytest
import torch

import _spawn

DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True


def _late_peer(rank, world, shrink):
    import torch.distributed as dist

    import deep_ep_rs

    dev = "cpu" if DRY else f"cuda:{torch.cuda.current_device()}"
    t, h, e = 4, 128, 2 * world
    os.environ["DEEP_EP_TIMEOUT_MS"] = "1000"  # read at buffer creation
    size = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
    kw = dict(device="cpu") if DRY else {}
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink, **kw)
    g = torch.Generator().manual_seed(rank)

    def step(s):
        x = torch.full((t, h), float(10 * s + rank + 1)).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)]).to(dev)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, idx, torch.ones(t, 2, device=dev), handle)
        return out

    step(0)
    if not DRY:
        torch.cuda.synchronize()
    dist.barrier()
    outcome = "ok"
    try:
        if rank == 1:
            time.sleep(2.5)
            step(2)
        else:
            step(1)
        if not DRY:
            torch.cuda.synchronize()
            time.sleep(1.5)  # a combine receive left waiting reaches its deadline too
            step(3)  # reports what the kernels of the steps before found
    except RuntimeError as err:
        outcome = str(err)
    dist.barrier()
    try:
        buf.destroy()
    except RuntimeError:
        pass
    return outcome


@pytest.mark.parametrize("shrink", [False, True], ids=["raise", "shrink"])
def test_a_late_rank_never_receives_a_call_its_peer_gave_up_gpu(shrink):
    if not DRY:
        _spawn.need_gpus(2)
    env = {} if DRY else {"DEEP_EP_BACKEND": _spawn.gpu_backend()}
    out = [r["ok"] for r in _spawn.run(_late_peer, 2, shrink, env=env, dry=DRY)]
    if not shrink:
        assert "timed out" in out[0] and "rank 0" in out[0], out[0]
    # Rank 0's step 1 masked rank 1 (shrink) and completed; the step after it runs without rank 1.
    else:
        assert out[0] == "ok", out[0]
    # Rank 1's third call (step 0 was calls 1 and 2) pairs with rank 0's given-up call 3.
    assert "rank 0 gave up its low-latency call 3" in out[1], out[1]
    assert "this rank's call 3 (a dispatch)" in out[1], out[1]
