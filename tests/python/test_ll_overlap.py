"""`Buffer.low_latency_combine`'s single-batch-overlap arguments (SGLang's SBO; DeepEP's overlap
combine) at one CPU rank: the names and defaults, what is checked, and the GPU guard (called
directly, no GPU needed). The call sequence at 2 and 4 ranks: `sglang_sbo` in
tests/python/_frameworks.py (test_frameworks.py)."""
import inspect

import pytest
import torch


T, H, E = 8, 256, 8


@pytest.fixture(scope="module")
def ll(deep_ep, group):
    b = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True,
                       explicitly_destroy=True)
    yield b
    b.destroy()


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
    ("comp-signal-not-raised", RuntimeError, r"comp_signal of local expert \d+, block 0 .* is 1 < threshold = 2: .* will never come",
     lambda c, per: dict(packed_recv_count=c, comp_signal=_signals(c, per, 64, 1), threshold=2)),
    ("src-signals-short", AssertionError, r"src_signals must hold one word per local expert \(8\)",
     lambda c, per: dict(src_signals=torch.ones(3, dtype=torch.uint32), src_signal_expect_value=1)),
    ("src-signals-not-raised", RuntimeError, r"src_signals\[\d+\] = 0 < src_signal_expect_value = 1 .* will never come",
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


def test_gpu_buffers_refuse_a_signal_wait():
    """Checked without a GPU: the guard is host code before any launch."""
    from deep_ep_rs.buffer import _check_overlap

    handle = (None, None, T, H, E)  # a GPU buffer's check reads no tensor of the handle
    cuda = torch.device("cuda", 0)
    with pytest.raises(NotImplementedError, match=r"overlap=True\) with a signal to wait for .* not implemented on GPU buffers"):
        _check_overlap(cuda, 1, handle, None, torch.zeros(8, dtype=torch.int32), 64, 1, None, 0)
    with pytest.raises(NotImplementedError, match="single-batch overlap"):
        _check_overlap(cuda, 1, handle, None, None, 64, 0, torch.zeros(8, dtype=torch.uint32), 32)
    # Nothing to wait for (threshold / expected value <= 0, DeepEP's "always satisfied"): accepted.
    assert _check_overlap(cuda, 1, handle, None, torch.zeros(8, dtype=torch.int32), 64, 0, None, 0) is None
    assert _check_overlap(cuda, 1, handle, None, None, 64, 5, torch.zeros(8, dtype=torch.uint32), 0) is None
