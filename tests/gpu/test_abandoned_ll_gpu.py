"""GPU twin of test_reliability2.py's item 1 (an LL call a rank gave up is never delivered to a
late peer), with that test's worker on GPU buffers: two ranks (two GPUs, or one GPU with the ipc
backend: `_spawn`) run LL step 0; rank 1 then sleeps past rank 0's deadline, so rank 0's step-1
receive times out on the device, gives the call up (its signals at rank 1 now hold the call's
abandoned tag) and raises, or in shrink mode masks rank 1 and completes. Rank 1's next call pairs
with the given-up one: its receive must refuse it, naming rank 0 and the call, instead of taking
rank 0's step-1 tokens. GPU errors surface at the buffer's next call, so the worker ends with a
synchronisation and one more step. DEEP_EP_GPU_DRY=1 runs the same ranks on the CPU backend (no
GPU), which checks the harness.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

import _spawn

sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
import test_reliability2 as cpu_tests  # noqa: E402

DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True


def _late_peer(rank, world, shrink):
    return cpu_tests.abandoned_call_worker(rank, world, shrink, "cpu" if DRY else f"cuda:{torch.cuda.current_device()}")


@pytest.mark.parametrize("shrink", [False, True], ids=["raise", "shrink"])
def test_a_late_rank_never_receives_a_call_its_peer_gave_up_gpu(shrink):
    env = {} if DRY else {"DEEP_EP_BACKEND": _spawn.gpu_backend(2)}
    out = [r["ok"] for r in _spawn.run(_late_peer, 2, shrink, env=env, dry=DRY)]
    # Rank 0 timed out in step 1: it raises, or (shrink) masks rank 1 and completes the step (and
    # the one after it, without rank 1).
    if shrink:
        assert out[0] == "ok", out[0]
    else:
        assert "timed out" in out[0] and "rank 0" in out[0], out[0]
    # Rank 1's third call (step 0 was calls 1 and 2) pairs with rank 0's given-up call 3.
    assert "rank 0 gave up its low-latency call 3" in out[1], out[1]
    assert "this rank's call 3 (a dispatch)" in out[1], out[1]
