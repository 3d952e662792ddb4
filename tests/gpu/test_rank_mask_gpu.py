"""Rank masking on 4 GPUs (nccl backend): the mask ops keep their state in the buffer's
host-mapped mask block (query into a CUDA tensor, update, clean, shrink flag); then rank 2 is dead
(never calls an LL op) and the survivors, having masked it, run LL dispatch -> expert -> combine
and must match the reference with rank 2's experts dropped (tests/python/_mask_check.py, shared
with the CPU test, which checks the same scenario on the CPU backend): recv_count, layout_range,
the received rows and the combined output bitwise.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import _mask_check as mc  # noqa: E402
import _spawn  # noqa: E402

WORLD, DEAD = 4, 2


def mask_worker(rank, world):
    import deep_ep_rs

    e = mc.EXPERTS_PER_RANK * world
    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(mc.T, mc.H, world, e) // 128) * 128
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device=torch.device("cuda", rank),
                            explicitly_destroy=True, enable_shrink=True)
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
        return mc.run_masked_ll(buf, rank, world, DEAD, seed=9)
    finally:
        buf.destroy()


def test_masked_rank_on_four_gpus():
    res = _spawn.run(mask_worker, WORLD)
    for r, o in enumerate(res):
        assert o["ok"] == -1 if r == DEAD else o["ok"] > 0
