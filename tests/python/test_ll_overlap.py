"""`Buffer.low_latency_combine`'s single-batch-overlap arguments (SGLang's SBO; DeepEP's overlap
combine) at one CPU rank: the names and defaults, what is checked, the op's own checks (torch ops
called directly). The call sequence at 2 and 4 ranks: `sglang_sbo` in tests/python/_frameworks.py
(test_frameworks.py); the device-side waits: tests/gpu/test_ll_overlap_gpu.py."""
import inspect

import pytest
import torch


T, H, E = 8, 256, 8  # also the size of conftest.py's one-rank `ll` buffer


def test_names_and_defaults_are_deepeps(deep_ep):
    params = inspect.signature(deep_ep.Buffer.low_latency_combine).parameters
    want = dict(overlap=False, packed_recv_count=None, comp_signal=None, block_m=64, threshold=0, num_sms=0, src_signals=None,
                src_signal_expect_value=0)
    assert {k: params[k].default for k in want} == want


def _dispatched(ll):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 5, (5, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    w = torch.full((5, 2), 0.5)
    recv, count, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    return x, idx, w, recv, count, handle


def _signals(count, per_expert, block_m, value):
    sig = torch.zeros(E * per_expert, dtype=torch.int32)
    for l, r in enumerate(count.tolist()):
        sig[l * per_expert:l * per_expert + -(-r // block_m)] = value
    return sig


@pytest.mark.parametrize("block_m", [1, 3, 64])
def test_overlap_gives_the_plain_combine(ll, block_m):
    x, idx, w, recv, count, handle = _dispatched(ll)
    plain, _, _ = ll.low_latency_combine(recv, idx, w, handle)
    per_expert = -(-T // block_m)
    for kwargs in (dict(packed_recv_count=count, comp_signal=_signals(count, per_expert, block_m, 2), block_m=block_m, threshold=2,
                        num_sms=3),
                   dict(src_signals=torch.full((E,), 7, dtype=torch.uint32), src_signal_expect_value=7)):
        got, _, _ = ll.low_latency_combine(recv, idx, w, handle, overlap=True, **kwargs)
        assert torch.equal(got, plain) and torch.equal(plain, x), kwargs


BAD = [
    ("no-signals", ValueError, r"needs comp_signal .* or src_signals", lambda c, per: dict()),
    ("count-int64", AssertionError, r"needs packed_recv_count, int32 \[8\]",
     lambda c, per: dict(packed_recv_count=c.long(), comp_signal=_signals(c, per, 64, 1), threshold=1)),
    ("count-not-the-dispatch's", AssertionError, r"is not the recv_count .* of the dispatch of this handle",
     lambda c, per: dict(packed_recv_count=c + 1, comp_signal=_signals(c, per, 64, 1), threshold=1)),
    ("comp-signal-short", AssertionError, r"comp_signal must be int32 with num_local_experts \* ceil\(num_ranks \* T / block_m\) = 8",
     lambda c, per: dict(packed_recv_count=c, comp_signal=torch.ones(7, dtype=torch.int32), threshold=1)),
    ("block-m-zero", AssertionError, r"block_m must be positive, got 0",
     lambda c, per: dict(packed_recv_count=c, comp_signal=_signals(c, per, 64, 1), block_m=0, threshold=1)),
    ("comp-signal-not-raised", RuntimeError, r"overlap signal of local expert \d+, block 0 .* is 1 < threshold = 2: .* will never come",
     lambda c, per: dict(packed_recv_count=c, comp_signal=_signals(c, per, 64, 1), threshold=2)),
    ("src-signals-short", AssertionError, r"src_signals must hold one word per local expert \(8\)",
     lambda c, per: dict(src_signals=torch.ones(3, dtype=torch.uint32), src_signal_expect_value=1)),
    ("src-signals-not-raised", RuntimeError, r"overlap signal of local expert \d+, block 0 .* is 0 < threshold = 1: .* will never come",
     lambda c, per: dict(src_signals=torch.zeros(E, dtype=torch.uint32), src_signal_expect_value=1)),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_overlap_arguments_then_the_buffer_goes_on(ll, case):
    _, exc, regex, make = case
    x, idx, w, recv, count, handle = _dispatched(ll)
    with pytest.raises(exc, match=regex):
        ll.low_latency_combine(recv, idx, w, handle, overlap=True, **make(count, -(-T // 64)))
    got, _, _ = ll.low_latency_combine(recv, idx, w, handle, overlap=False, comp_signal=torch.zeros(1, dtype=torch.int32), threshold=9)
    assert torch.equal(got, x), "overlap=False ignores the overlap arguments, as DeepEP"


OP_BAD = [
    ("block-m-zero", r"block_m must be in 1..=num_ranks \* num_max_dispatch_tokens_per_rank \(8\), got 0", dict(block_m=0)),
    ("block-m-over-rows", r"block_m must be in 1..=.* got 9", dict(block_m=9)),
    ("signal-short", r"comp_signal must hold num_local_experts \* ceil\(num_ranks \* T / block_m\) = 16 int32 signals, got 15",
     dict(block_m=4, sig=torch.ones(15, dtype=torch.int32))),
    ("signal-int64", r"comp_signal must be torch.int32 on cpu, got torch.int64", dict(sig=torch.ones(64, dtype=torch.int64))),
    ("num-sms-negative", r"num_sms must be >= 0, got -1", dict(num_sms=-1)),
    ("threshold-over-int32", r"threshold must fit int32, got 4294967296", dict(threshold=1 << 32)),
]


@pytest.mark.parametrize("case", OP_BAD, ids=[c[0] for c in OP_BAD])
def test_the_ops_check_the_overlap_arguments(ll, case):
    """The torch ops (what TorchScript / AOTI artifacts call) check what the Python layer does not."""
    _, regex, kw = case
    ops = torch.ops.deep_ep
    x, idx, w, recv, count, handle = _dispatched(ll)
    src_info, layout_range, t, _, e = handle
    sig = kw.get("sig", torch.full((E * T,), 1, dtype=torch.int32))
    args = (sig, kw.get("block_m", 1), kw.get("threshold", 1), kw.get("num_sms", 0))
    with pytest.raises(RuntimeError, match=regex):
        ops.low_latency_combine_send(ll.handle, recv, src_info, layout_range, t, e, False, False, *args)
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match=regex):
        ops.low_latency_combine(ll.handle, recv, idx, w, src_info, layout_range, out, None, t, e, False, False, None, *args)
    got, _, _ = ll.low_latency_combine(recv, idx, w, handle)
    assert torch.equal(got, x), "the buffer goes on"
    # Raised signals: the op combines as without them (num_sms of any size: a cap, saturating).
    ops.low_latency_combine(ll.handle, recv, idx, w, src_info, layout_range, out, None, t, e, False, False, None,
                            torch.full((E * T,), 1, dtype=torch.int32), 1, 1, 1 << 62)
    assert torch.equal(out, x)
