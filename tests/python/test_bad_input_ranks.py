"""Bad input on 2 ranks that disagree: an error found on one rank (or a disagreement between
ranks) must be raised on every rank, and the ranks must stay in step for the next call."""
import re
import time

import pytest
import torch

import _reference as ref
from test_bad_input import (CFG, CPU, E, E_LL, H, H_LL, T_LL, TWO_RANK_DISAGREEING, assert_works, dispatch, expect_error, good_inputs, handle_of,
                            layout, timeout_ms)

# ---------------------------------------------------------------------------------------------
# 2 ranks that disagree: one-sided errors (the CPU backend publishes a status word so that an
# error found on one rank is raised on all) and ranks passing different shapes / ops, plus a
# symmetric error found after the rendezvous (worst-case overflow). Each iteration makes the bad
# call, then at once a correct dispatch whose result is checked; the buffer uses a short
# DEEP_EP_TIMEOUT_MS so that a desynchronisation shows up fast. Rank 1 reaches each bad call 20 ms
# after rank 0 and rank 0 wakes late from its waits (timer slack), as a descheduled rank would:
# this makes the race described in RACE reproducible; without the bug every iteration passes.


def _set_timer_slack_ns(ns):
    """prctl(PR_SET_TIMERSLACK): how late the kernel may wake this thread from a sleep (0 = default)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(29, ctypes.c_ulong(ns), 0, 0, 0) == 0


def _disagreement_worker(rank, world, kind, iters, delay_rank1_s=0.0):
    import deep_ep_rs
    import torch.distributed as dist

    with timeout_ms(2000):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    h, e = buf.handle, E * world
    x, idx, w = good_inputs(40 + rank, e=e, num_ranks=world)
    ntpr, in_rank, ntpe = layout(idx, e, world)
    bad_idx = idx.clone()
    bad_idx[0, 0] = e
    prev = good_inputs(50, e=e, num_ranks=world)
    prev_lay = layout(prev[1], e, world)
    prev_handle = handle_of(dispatch(h, *prev, e=e, num_ranks=world, lay=prev_lay), prev_lay[1])

    def d(**kw):
        return torch.ops.deep_ep.dispatch(h, kw.get("x", x), None, kw.get("idx", idx), w, kw.get("ntpr", ntpr), in_rank, ntpe, 1,
                                          kw.get("worst", 0), CFG)

    # every rank must report the first overflowing rank (0) with its true received-token count
    recv0 = sum(int(ref.layout(good_inputs(40 + s, e=e, num_ranks=world)[1], e, world)[0][0]) for s in range(world))
    overflow = rf"^deep_ep::dispatch: tokens over capacity: rank 0 receives {recv0} tokens but its num_worst_tokens is 1$"
    bad = {
        # call, regex of the message on rank 0, on rank 1
        "one-sided-expert-id": (lambda: d(idx=bad_idx if rank == 1 else idx),
                                r"^deep_ep::dispatch: rank 1 failed: .*topk_idx holds expert id 16", r"^deep_ep::dispatch: topk_idx holds expert id 16"),
        "one-sided-counts": (lambda: d(ntpr=ntpr + 1 if rank == 1 else ntpr),
                             r"^deep_ep::dispatch: rank 1 failed: .*num_tokens_per_rank\[0\]", r"^deep_ep::dispatch: num_tokens_per_rank\[0\]"),
        "different-hidden": (lambda: d(x=torch.cat([x, x], 1) if rank == 1 else x),
                             r"^deep_ep::dispatch: rank 1 dispatches \(row bytes", r"^deep_ep::dispatch: rank 0 dispatches \(row bytes"),
        "different-ops": (lambda: d() if rank == 0 else torch.ops.deep_ep.cached_dispatch(h, prev[0], None, *prev_handle, CFG),
                          r"^deep_ep::dispatch: rank 1 is in deep_ep::cached_dispatch", r"^deep_ep::cached_dispatch: rank 0 is in deep_ep::dispatch"),
        "worst-case-overflow": (lambda: d(worst=1), overflow, overflow),
    }[kind]
    call, want = bad[0], bad[1 + rank]
    # the correct call that follows each bad one, prepared up front so that it follows at once
    good = [ref.RankInput(*good_inputs(700 + s, n=12, e=e, num_ranks=world)) for s in range(world)]
    good_lay = layout(good[rank].topk_idx, e, world)
    good_ref = ref.dispatch(good, rank, e, CFG[0] // 2)
    # the race shows as data of the next call: it must differ from this call's (tokens sent to each rank)
    assert not torch.equal(good_lay[0], ntpr), "precondition: the correct call must send other token counts"
    anomalies, messages = [], set()
    if rank == 0 and delay_rank1_s:
        _set_timer_slack_ns(5_000_000)  # rank 0 wakes late from its waits: a slow (descheduled) peer
    for i in range(iters):
        if rank == 1 and delay_rank1_s:
            time.sleep(delay_rank1_s)  # rank 0 reaches the rendezvous first and waits there (sleeping, not spinning)
        try:
            call()
            anomalies.append(f"iteration {i}: the bad call did not raise")
            break
        except RuntimeError as ex:
            messages.add(str(ex))
            if not re.search(want, str(ex)):
                anomalies.append(f"iteration {i}: unexpected error {str(ex)[:300]!r}")
                break
        try:
            out = dispatch(h, good[rank].x, good[rank].topk_idx, good[rank].topk_weights, e=e, num_ranks=world, lay=good_lay)
            assert torch.equal(out[0], good_ref.recv_x), "wrong rows"
        except (RuntimeError, AssertionError) as ex:
            anomalies.append(f"iteration {i}: the correct call after the error failed: {str(ex)[:300]!r}")
            break
    if rank == 0 and delay_rank1_s:
        _set_timer_slack_ns(0)  # back to the default
    if not anomalies:
        assert_works(h, rank, world, seed=999)
    buf.destroy()
    return anomalies, sorted(messages)


def _check_disagreement(rank_pool, kind, iters, delay_rank1_s=0.02):
    results = rank_pool(2).run(_disagreement_worker, kind, iters, delay_rank1_s, timeout=120)
    for rank, (anomalies, messages) in enumerate(results):
        assert not anomalies, f"rank {rank}: {anomalies}"
        # the same bad input every iteration must give the same message every time
        assert len(messages) == 1, f"rank {rank} saw different messages for the same call: {messages}"


# Regression tests for a fixed race (src/backend/cpu/ht.rs): an error raised after the rendezvous
# barrier used to return at once; the failing rank then republished its header for its next call
# before a slower peer had read the failed one, so the peer missed the error or read the next
# call's data. Ranks that fail after a rendezvous now meet once more before raising.


@pytest.mark.parametrize("kind", ["one-sided-counts", "one-sided-expert-id"])
def test_two_ranks_one_sided_error_is_raised_on_both(rank_pool, kind):
    _check_disagreement(rank_pool, kind, 30)


@pytest.mark.parametrize("kind", ["different-hidden", "different-ops"])
def test_two_ranks_disagreeing_calls_are_raised_on_both(rank_pool, kind):
    _check_disagreement(rank_pool, kind, 30)


def test_two_ranks_overflow_message_is_stable(rank_pool):
    _check_disagreement(rank_pool, "worst-case-overflow", 60)


# ---------------------------------------------------------------------------------------------
# 2 ranks: arguments that disagree between ranks (hidden, LL geometry, num_ranks at creation)


def disagreeing_ranks_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    e = E * world
    calls = 0
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    try:
        # normal mode: hidden differs between the ranks; both raise, then a correct round trip
        x, idx, w = good_inputs(80 + rank, h=H * (rank + 1), e=e, num_ranks=world)
        expect_error("dispatch", r"every rank must use the same hidden size", dispatch, buf.handle, x, idx, w, e=e, num_ranks=world)
        assert_works(buf.handle, rank, world, seed=500)
        calls += 1
    finally:
        buf.destroy()
    # low latency: hidden differs between the ranks (each fits the buffer); both raise, then a
    # correct dispatch/combine on the same buffer works
    nbytes = -(-int(torch.ops.deep_ep.low_latency_rdma_size_hint(T_LL, 2 * H_LL, world, E_LL)) // 128) * 128
    ll = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    try:
        idx = torch.tensor([[0, 4], [1, 5], [2, 6]])  # every rank sends to every rank
        xh = torch.ones((3, H_LL * (rank + 1)), dtype=torch.bfloat16)
        expect_error("low_latency_dispatch", r"every rank must pass the same values", ll.low_latency_dispatch, xh, idx, T_LL, E_LL,
                     use_fp8=False)
        x = torch.ones((3, H_LL), dtype=torch.bfloat16) * (rank + 1)
        recv, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T_LL, E_LL, use_fp8=False)
        out, _, _ = ll.low_latency_combine(recv, idx, torch.ones((3, 2)), handle)
        assert torch.equal(out, x * 2)
        calls += 1
    finally:
        ll.destroy()
    # create_buffer: the ranks disagree on num_ranks
    with timeout_ms(1500):
        uid = [torch.ops.deep_ep.get_unique_id("cpu").tolist() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=0)
        uid = torch.tensor(uid[0], dtype=torch.uint8)
        args = (uid, rank, world + rank, CPU, 1 << 20, 0, False, "cpu")  # rank 1 believes in 3 ranks
        regex = r"rank 1 created the buffer with \(num_ranks, .*\) = \[3," if rank == 0 else r"timed out .* waiting for rank\(s\) \[2\]"
        expect_error("create_buffer", regex, torch.ops.deep_ep.create_buffer, *args)
        calls += 1
    dist.barrier()
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    try:
        assert_works(buf.handle, rank, world, seed=501)
    finally:
        buf.destroy()
    return calls


def test_two_ranks_disagreeing_arguments(rank_pool):
    assert rank_pool(2).run(disagreeing_ranks_worker) == [TWO_RANK_DISAGREEING] * 2
