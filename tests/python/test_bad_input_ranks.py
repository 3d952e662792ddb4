"""Bad input on 2 ranks that disagree: an error found on one rank (or a disagreement between
ranks) must be raised on every rank, and the ranks must stay in step for the next call."""
import re
import time

import pytest
import torch

import _reference as ref
from test_bad_input import CFG, E, assert_works, dispatch, good_inputs, handle_of, layout, timeout_ms

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


