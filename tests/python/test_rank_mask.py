"""Rank masking in low-latency mode (DeepEP's shrink-mode calls) and per-peer wait statistics on the
CPU backend, multi-process: a dead rank that never calls an LL op, the survivors mask it (by
hand, or shrink mode does after a timeout) and still get the reference results with the dead
rank's experts dropped; mask query/update/clean and their argument errors; wait_stats names a
straggler.
"""
import os
import time

import pytest
import torch

import _mask_check as mc

DEAD = 2


def _ll_buffer(world, shrink=False):
    import deep_ep_rs
    import torch.distributed as dist

    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(mc.T, mc.H, world, mc.EXPERTS_PER_RANK * world) // 128) * 128
    return deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device="cpu", explicitly_destroy=True,
                             enable_shrink=shrink)


def masked_worker(rank, world, explicit, timeout_ms):
    old = os.environ.get("DEEP_EP_TIMEOUT_MS")
    os.environ["DEEP_EP_TIMEOUT_MS"] = str(timeout_ms)  # read at buffer creation
    try:
        buf = _ll_buffer(world, shrink=not explicit)
    finally:
        os.environ["DEEP_EP_TIMEOUT_MS"] = old
    try:
        if rank == DEAD:
            return -1  # never calls an LL op
        t0 = time.monotonic()
        n = mc.run_masked_ll(buf, rank, world, DEAD, seed=5, explicit=explicit)
        took = time.monotonic() - t0
        # Unmasking restores the full mask state (the dead rank is still gone, so no LL call after).
        buf.low_latency_clean_mask_buffer()
        status = torch.ones(world, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
        return n, took
    finally:
        buf.destroy()


@pytest.mark.lowlatency
def test_explicit_mask_survivors_match_reference(rank_pool):
    res = rank_pool(4).run(masked_worker, True, 20000)
    assert res[DEAD] == -1
    for r, v in enumerate(res):
        if r != DEAD:
            assert v[0] > 0
            assert v[1] < 10, f"rank {r}: masked LL calls must not wait for the dead rank ({v[1]:.1f} s)"


@pytest.mark.lowlatency
def test_shrink_mode_masks_the_rank_that_times_out(rank_pool):
    res = rank_pool(4).run(masked_worker, False, 400)
    for r, v in enumerate(res):
        if r != DEAD:
            assert v[0] > 0
            # The first dispatch waits out one deadline (400 ms) before masking; later calls do not wait.
            assert 0.3 < v[1] < 10, v[1]


def test_mask_ops_single_rank(ops, deep_ep):
    from conftest import make_buffer1

    h = make_buffer1(ops, num_rdma_bytes=1 << 20, low_latency_mode=True)
    try:
        st = torch.full((1,), 7, dtype=torch.int32)
        ops.low_latency_query_mask_buffer(h, st)
        assert st.tolist() == [0]
        ops.low_latency_update_mask_buffer(h, 0, True)
        ops.low_latency_query_mask_buffer(h, st)
        assert st.tolist() == [1]
        ops.low_latency_update_mask_buffer(h, 0, False)
        ops.low_latency_query_mask_buffer(h, st)
        assert st.tolist() == [0]
        ops.low_latency_update_mask_buffer(h, 0, True)
        ops.low_latency_clean_mask_buffer(h)
        ops.low_latency_query_mask_buffer(h, st)
        assert st.tolist() == [0]
        with pytest.raises(RuntimeError, match=r"^deep_ep::low_latency_update_mask_buffer: rank_to_mask must be in \[0, 1\), got 1"):
            ops.low_latency_update_mask_buffer(h, 1, True)
        with pytest.raises(RuntimeError, match=r"got -1"):
            ops.low_latency_update_mask_buffer(h, -1, True)
        with pytest.raises(RuntimeError, match=r"^deep_ep::low_latency_query_mask_buffer: mask_status must be a 1-D int32 tensor of num_ranks = 1"):
            ops.low_latency_query_mask_buffer(h, torch.zeros(2, dtype=torch.int32))
        with pytest.raises(RuntimeError, match=r"mask_status must be a 1-D int32"):
            ops.low_latency_query_mask_buffer(h, torch.zeros(1, dtype=torch.int64))
        ops.low_latency_set_shrink(h, True)
        ops.low_latency_set_shrink(h, False)
        ws = ops.wait_stats(h)
        assert ws.shape == (1, 2) and ws.dtype == torch.int64
    finally:
        ops.destroy_buffer(h)
    with pytest.raises(RuntimeError, match=r"^deep_ep::low_latency_clean_mask_buffer: buffer handle \d+ was destroyed"):
        ops.low_latency_clean_mask_buffer(h)
    with pytest.raises(RuntimeError, match=r"^deep_ep::wait_stats: buffer handle \d+ was destroyed"):
        ops.wait_stats(h)


STRAGGLER = 1
DELAY_S = 0.3


def wait_stats_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, device="cpu", explicitly_destroy=True)
    try:
        buf.wait_stats(reset=True)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn((16, 128), generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(4 * world, generator=g)[:2] for _ in range(16)])
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 4 * world)
        for it in range(3):
            if rank == STRAGGLER and it == 1:
                time.sleep(DELAY_S)
            recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=torch.rand((16, 2)))
            buf.combine(recv, handle)
        stats = buf.wait_stats(reset=True)
        after = buf.wait_stats()
        return stats.tolist(), after.tolist()
    finally:
        buf.destroy()


def test_wait_stats_name_the_straggler(rank_pool):
    world = 3
    res = rank_pool(world).run(wait_stats_worker)
    for rank, (stats, after) in enumerate(res):
        assert len(stats) == world and all(len(r) == 2 for r in stats)
        assert after == [[0, 0]] * world, "reset=True must zero the statistics"
        for p in range(world):
            if p != rank:
                assert stats[p][0] >= 6, f"rank {rank}: peer {p} counted in only {stats[p][0]} waits"
        if rank != STRAGGLER:
            waited = [stats[p][1] for p in range(world)]
            assert max(range(world), key=lambda p: waited[p]) == STRAGGLER, f"rank {rank}: {waited}"
            assert waited[STRAGGLER] >= 0.2e9, waited
