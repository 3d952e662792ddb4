"""Rank masking on 4 GPUs (nccl backend): the mask ops keep their state in the buffer's
host-mapped mask block (query into a CUDA tensor, update, clean, shrink flag); then rank 2 is dead
(never calls an LL op) and the survivors run LL dispatch -> expert -> combine and must match the
reference with rank 2's experts dropped (tests/python/_mask_check.py, shared with the CPU test,
which checks the same scenarios on the CPU backend): recv_count, layout_range, the received rows
and the combined output bitwise.
- explicit: the survivors mask rank 2 by hand first; no call waits for it.
- shrink: `enable_shrink=True` and DEEP_EP_TIMEOUT_MS=1000; nobody masks rank 2 by hand. The first
  dispatch's receive waits out one deadline for it, masks it (DeepEP's shrink mode) and goes on;
  the mask query then shows rank 2 masked and later calls do not wait.
"""
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))

import _mask_check as mc  # noqa: E402
import _spawn  # noqa: E402

WORLD, DEAD = 4, 2


def mask_worker(rank, world, explicit):
    import deep_ep_rs

    e = mc.EXPERTS_PER_RANK * world
    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(mc.T, mc.H, world, e) // 128) * 128
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device=_spawn.device(rank), backend=_spawn.gpu_backend(),
                            explicitly_destroy=True, enable_shrink=not explicit)
    try:
        st = torch.full((world,), 9, dtype=torch.int32, device=buf.device)
        buf.low_latency_query_mask_buffer(st)
        assert st.cpu().tolist() == [0] * world
        buf.low_latency_update_mask_buffer(1, True)
        buf.low_latency_update_mask_buffer(3, True)
        buf.low_latency_update_mask_buffer(3, False)
        buf.low_latency_query_mask_buffer(st)
        assert st.cpu().tolist() == [int(r == 1) for r in range(world)]
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(st)
        assert st.cpu().tolist() == [0] * world
        if rank == DEAD:
            return -1
        t0 = time.monotonic()
        rows = mc.run_masked_ll(buf, rank, world, DEAD, seed=9, explicit=explicit)
        return rows, time.monotonic() - t0
    finally:
        dist.barrier()  # the dead rank stays out of LL ops but destroys with the others
        buf.destroy()


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "shrink"])
def test_masked_rank_on_four_gpus(explicit):
    res = _spawn.run(mask_worker, WORLD, explicit, env=None if explicit else {"DEEP_EP_TIMEOUT_MS": "1000"})
    for r, o in enumerate(res):
        if r == DEAD:
            assert o["ok"] == -1
            continue
        rows, took = o["ok"]
        assert rows > 0
        if explicit:
            assert took < 10, f"rank {r}: masked LL calls must not wait for the dead rank ({took:.1f} s)"
        else:
            # One deadline (1 s) for the first dispatch, then no more waiting.
            assert 0.9 < took < 10, f"rank {r}: {took:.1f} s"
