"""Malformed calls raise RuntimeError whose message starts with the op (`deep_ep::<op>:`) and names
the offending argument; afterwards the same buffer (or at least the process) still works: a
correct dispatch/cached dispatch/combine runs and is checked against the reference.

1 rank in-process (one buffer shared by every case, so failures must leave it healthy), plus a
2-rank run where both ranks pass the same bad inputs (and one-sided content errors, which the CPU
backend raises on all ranks) and then continue correctly.
"""
import os
import re

import pytest
import torch

import _reference as ref
from _harness import env_var
from conftest import is_not_implemented, make_buffer1

CFG = [4, 6, 256, 6, 128]
N, H, K, E = 6, 64, 2, 8


def good_inputs(seed=0, n=N, h=H, k=K, e=E, num_ranks=1, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, h), generator=g, device="cpu").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g, device="cpu")[:k] for _ in range(n)]) if n else torch.zeros((0, k), dtype=torch.int64)
    if n > 1:
        idx[1, :] = -1  # one token goes nowhere
    w = torch.rand((n, k), generator=g, device="cpu")
    return x, idx.to(dtype).contiguous(), w


def layout(idx, e=E, num_ranks=1):
    ntpr, _, ntpe, in_rank = torch.ops.deep_ep.get_dispatch_layout(idx, e, num_ranks)
    return ntpr, in_rank, ntpe


def dispatch(h, x, idx, w, scales=None, align=1, worst=0, cfg=CFG, e=E, num_ranks=1, lay=None):
    ntpr, in_rank, ntpe = lay if lay is not None else layout(idx, e, num_ranks)
    return torch.ops.deep_ep.dispatch(h, x, scales, idx, w, ntpr, in_rank, ntpe, align, worst, cfg)


def handle_of(out, in_rank):
    rpm, cpm, rcpm, src_idx, send_head = out[5:10]
    return [rpm, cpm, rcpm, src_idx, in_rank, send_head]


def timeout_ms(ms):
    """Sets DEEP_EP_TIMEOUT_MS (read at buffer creation) for the block, then restores it."""
    return env_var("DEEP_EP_TIMEOUT_MS", ms)


def assert_works(h, rank=0, num_ranks=1, seed=123):
    """A correct dispatch -> cached dispatch -> combine on buffer h, checked exactly (all ranks
    call it together in multi-rank runs)."""
    e = E * num_ranks
    inputs = [ref.RankInput(*good_inputs(seed + s, e=e, num_ranks=num_ranks)) for s in range(num_ranks)]
    me = inputs[rank]
    lay = layout(me.topk_idx, e, num_ranks)
    out = dispatch(h, me.x, me.topk_idx, me.topk_weights, e=e, num_ranks=num_ranks, lay=lay)
    refs = [ref.dispatch(inputs, d, e, CFG[0] // 2) for d in range(num_ranks)]
    rf = refs[rank]
    assert torch.equal(out[0], rf.recv_x), "dispatch after an error returned wrong rows"
    assert torch.equal(out[2], rf.recv_topk_idx) and torch.equal(out[3], rf.recv_topk_weights)
    assert out[4].tolist() == rf.num_recv_tokens_per_expert_list
    hd = handle_of(out, lay[1])
    assert torch.equal(hd[0], rf.rank_prefix_matrix) and torch.equal(hd[5], rf.send_head)
    cx, _ = torch.ops.deep_ep.cached_dispatch(h, me.x, None, hd[0], hd[1], hd[2], hd[3], hd[4], hd[5], CFG)
    assert torch.equal(cx, rf.recv_x), "cached dispatch after an error returned wrong rows"
    ys = [r.recv_x for r in refs]  # identity experts
    want, _ = ref.combine(refs, ys, rank, me.x.shape[0])
    got, _ = torch.ops.deep_ep.combine(h, out[0], None, None, None, *hd, CFG)
    assert torch.equal(got, want), "combine after an error returned wrong values"
    assert rf.num_recv > 0
    return rf.num_recv


# ---------------------------------------------------------------------------------------------
# the cases: (id, op, regex naming the argument, fn(ctx) making the bad call)


class Ctx:
    def __init__(self, h):
        self.h = h
        self.x, self.idx, self.w = good_inputs(7)
        self.ntpr, self.in_rank, self.ntpe = layout(self.idx)
        out = dispatch(h, self.x, self.idx, self.w)
        self.out = out
        self.handle = handle_of(out, self.in_rank)
        self.rows = out[0].shape[0]
        self.y = out[0].clone()

    def d(self, **kw):
        a = dict(x=self.x, scales=None, idx=self.idx, w=self.w, ntpr=self.ntpr, in_rank=self.in_rank, ntpe=self.ntpe, align=1,
                 worst=0, cfg=CFG, h=self.h)
        a.update(kw)
        return torch.ops.deep_ep.dispatch(a["h"], a["x"], a["scales"], a["idx"], a["w"], a["ntpr"], a["in_rank"], a["ntpe"],
                                          a["align"], a["worst"], a["cfg"])

    def cached(self, x=None, scales=None, cfg=CFG, h=None, **repl):
        hd = dict(zip(["rpm", "cpm", "rcpm", "src_idx", "in_rank", "send_head"], self.handle))
        hd.update(repl)
        return torch.ops.deep_ep.cached_dispatch(self.h if h is None else h, self.x if x is None else x, scales, hd["rpm"], hd["cpm"],
                                                 hd["rcpm"], hd["src_idx"], hd["in_rank"], hd["send_head"], cfg)

    def combine(self, y=None, w=None, b0=None, b1=None, cfg=CFG, **repl):
        hd = dict(zip(["rpm", "cpm", "rcpm", "src_idx", "in_rank", "send_head"], self.handle))
        hd.update(repl)
        return torch.ops.deep_ep.combine(self.h, self.y if y is None else y, w, b0, b1, hd["rpm"], hd["cpm"], hd["rcpm"], hd["src_idx"],
                                         hd["in_rank"], hd["send_head"], cfg)


def _other_routing_handle(c, n=N):
    """A handle from another dispatch (different token count and/or routing)."""
    x, idx, w = good_inputs(99, n=n)
    idx[:, :] = torch.where(idx < 4, idx, torch.full_like(idx, -1))
    lay = layout(idx)
    out = dispatch(c.h, x, idx, w, lay=lay)
    return handle_of(out, lay[1]), out


def _fp8(c):
    return c.x.to(torch.float8_e4m3fn)


def _stale_same_n(c):
    other, _ = _other_routing_handle(c)
    # rank_prefix_matrix of this dispatch with is_token_in_rank/send_head of the other one
    return c.combine(in_rank=other[4], send_head=other[5])


def _stale_cached(c):
    other, _ = _other_routing_handle(c)
    return c.cached(in_rank=other[4], send_head=other[5])


def _bad_ids(c, bad):
    idx = c.idx.clone()
    idx[2, 1] = bad
    return c.d(idx=idx)  # layout tensors of the valid ids


CASES = [
    # get_dispatch_layout
    ("layout-float-topk", "get_dispatch_layout", r"topk_idx must be torch\.int32 or torch\.int64", lambda c: torch.ops.deep_ep.get_dispatch_layout(c.idx.float(), E, 1)),
    ("layout-1d-topk", "get_dispatch_layout", r"topk_idx must have shape", lambda c: torch.ops.deep_ep.get_dispatch_layout(c.idx.flatten(), E, 1)),
    ("layout-noncontig-topk", "get_dispatch_layout", r"topk_idx must be contiguous", lambda c: torch.ops.deep_ep.get_dispatch_layout(c.idx.T, E, 1)),
    ("layout-experts-not-divisible", "get_dispatch_layout", r"num_experts \(7\).*num_ranks \(2\)", lambda c: torch.ops.deep_ep.get_dispatch_layout(c.idx, 7, 2)),
    # dispatch: x
    ("dispatch-x-float32", "dispatch", r"\bx must be torch\.bfloat16 or torch\.float8_e4m3fn.*got torch\.float32", lambda c: c.d(x=c.x.float())),
    ("dispatch-x-noncontig", "dispatch", r"\bx must be contiguous", lambda c: c.d(x=torch.cat([c.x, c.x], 1)[:, ::2])),
    ("dispatch-x-3d", "dispatch", r"\bx must have shape \[num_tokens, hidden\]", lambda c: c.d(x=c.x.view(N, 2, H // 2))),
    ("dispatch-x-5d", "dispatch", r"\bx has 5 dimensions", lambda c: c.d(x=c.x.view(N, 1, 1, 1, H))),
    ("dispatch-x-row-bytes", "dispatch", r"\bx rows must be a multiple of 16 bytes", lambda c: c.d(x=c.x[:, :12].contiguous())),
    # dispatch: top-k
    ("dispatch-topk-float", "dispatch", r"topk_idx must be torch\.int32 or torch\.int64", lambda c: c.d(idx=c.idx.float())),
    ("dispatch-expert-id-too-large", "dispatch", r"topk_idx holds expert id 8", lambda c: _bad_ids(c, E)),
    ("dispatch-expert-id-below-minus-one", "dispatch", r"topk_idx holds expert id -2", lambda c: _bad_ids(c, -2)),
    ("dispatch-topk-too-many", "dispatch", r"num_topk must be in 1..=32", lambda c: c.d(idx=torch.zeros((N, 33), dtype=torch.int64), w=torch.zeros((N, 33)))),
    ("dispatch-weights-shape", "dispatch", r"topk_weights must have shape \[num_tokens=6, num_topk=2\]", lambda c: c.d(w=torch.rand((N, K + 1)))),
    ("dispatch-weights-dtype", "dispatch", r"topk_weights must be torch\.float32", lambda c: c.d(w=c.w.double())),
    ("dispatch-weights-without-idx", "dispatch", r"topk_idx and topk_weights must be given together", lambda c: c.d(idx=None)),
    ("dispatch-idx-without-weights", "dispatch", r"topk_idx and topk_weights must be given together", lambda c: c.d(w=None)),
    ("dispatch-idx-rows", "dispatch", r"topk_idx must have shape \[num_tokens=6", lambda c: c.d(idx=c.idx[:4].contiguous(), w=c.w[:4].contiguous())),
    # dispatch: FP8 scales
    ("dispatch-fp8-without-scales", "dispatch", r"x_scales", lambda c: c.d(x=_fp8(c))),
    ("dispatch-scales-with-bf16", "dispatch", r"x_scales given but x is bfloat16", lambda c: c.d(scales=torch.ones((N, 1)))),
    ("dispatch-scales-rows", "dispatch", r"x_scales must have shape \[num_tokens=6", lambda c: c.d(x=_fp8(c), scales=torch.ones((N - 1, 1)))),
    ("dispatch-scales-dtype", "dispatch", r"x_scales must be torch\.float32 or torch\.int32", lambda c: c.d(x=_fp8(c), scales=torch.ones((N, 1), dtype=torch.bfloat16))),
    # dispatch: layout tensors
    ("dispatch-ntpr-dtype", "dispatch", r"num_tokens_per_rank must be torch\.int32", lambda c: c.d(ntpr=c.ntpr.long())),
    ("dispatch-in-rank-rows", "dispatch", r"is_token_in_rank must have shape \[num_tokens=6", lambda c: c.d(in_rank=c.in_rank[:3].contiguous())),
    ("dispatch-in-rank-dtype", "dispatch", r"is_token_in_rank must be torch\.bool", lambda c: c.d(in_rank=c.in_rank.int())),
    ("dispatch-ntpe-2d", "dispatch", r"num_tokens_per_expert must have shape", lambda c: c.d(ntpe=c.ntpe.view(2, 4))),
    ("dispatch-ntpr-inconsistent", "dispatch", r"num_tokens_per_rank\[0\]", lambda c: c.d(ntpr=c.ntpr + 1)),
    ("dispatch-ntpe-inconsistent", "dispatch", r"num_tokens_per_expert does not match topk_idx", lambda c: c.d(ntpe=c.ntpe.flip(0).contiguous())),
    ("dispatch-in-rank-inconsistent", "dispatch", r"is_token_in_rank does not match topk_idx",
     lambda c: c.d(in_rank=torch.ones_like(c.in_rank), ntpr=torch.tensor([N], dtype=torch.int32))),
    # dispatch: scalars and config
    ("dispatch-alignment-zero", "dispatch", r"expert_alignment must be in 1\.\.", lambda c: c.d(align=0)),
    ("dispatch-worst-negative", "dispatch", r"num_worst_tokens must be >= 0", lambda c: c.d(worst=-1)),
    ("dispatch-worst-without-topk", "dispatch", r"num_worst_tokens > 0 requires topk_idx", lambda c: c.d(idx=None, w=None, worst=8)),
    ("dispatch-worst-too-small", "dispatch", r"num_worst_tokens", lambda c: c.d(worst=2)),
    ("dispatch-config-odd-num-sms", "dispatch", r"config\.num_sms must be even", lambda c: c.d(cfg=[3, 6, 256, 6, 128])),
    ("dispatch-config-negative", "dispatch", r"config must be 5 non-negative ints", lambda c: c.d(cfg=[4, -6, 256, 6, 128])),
    ("dispatch-config-chunks", "dispatch", r"num_max_nvl_chunked_send_tokens", lambda c: c.d(cfg=[4, 256, 256, 6, 128])),
    # cached dispatch
    ("cached-stale-handle-token-count", "cached_dispatch", r"x has 4 tokens but the handle was made for 6", lambda c: c.cached(x=c.x[:4].contiguous())),
    ("cached-stale-handle-other-dispatch", "cached_dispatch", r"stale handle", lambda c: _stale_cached(c)),
    ("cached-rpm-shape", "cached_dispatch", r"rank_prefix_matrix must have shape \[num_ranks=1, num_ranks=1\]", lambda c: c.cached(rpm=torch.zeros((2, 2), dtype=torch.int32))),
    ("cached-send-head-shape", "cached_dispatch", r"send_head must have shape", lambda c: c.cached(send_head=c.handle[5][:3].contiguous())),
    ("cached-src-idx-dtype", "cached_dispatch", r"recv_src_idx must be torch\.int32", lambda c: c.cached(src_idx=c.handle[3].long())),
    ("cached-config-other-num-sms", "cached_dispatch", r"channel_prefix_matrix must have shape \[1, 10\]", lambda c: c.cached(cfg=[20, 6, 256, 6, 128])),
    ("cached-fp8-without-scales", "cached_dispatch", r"x_scales", lambda c: c.cached(x=_fp8(c))),
    # combine
    ("combine-x-rows", "combine", r"\bx must have shape \[num_recv_tokens=", lambda c: c.combine(y=c.y[:-1].contiguous())),
    ("combine-x-fp8", "combine", r"\bx must be torch\.bfloat16", lambda c: c.combine(y=c.y.to(torch.float8_e4m3fn))),
    ("combine-x-noncontig", "combine", r"\bx must be contiguous", lambda c: c.combine(y=torch.cat([c.y, c.y], 1)[:, ::2])),
    ("combine-bias-shape", "combine", r"bias_0 must have shape \[num_tokens=6, hidden=64\]", lambda c: c.combine(b0=torch.zeros((N, H + 8), dtype=torch.bfloat16))),
    ("combine-bias1-dtype", "combine", r"bias_1 must be torch\.bfloat16", lambda c: c.combine(b0=torch.zeros((N, H), dtype=torch.bfloat16), b1=torch.zeros((N, H)))),
    ("combine-weights-rows", "combine", r"topk_weights must have shape \[num_recv_tokens=", lambda c: c.combine(w=torch.zeros((c.rows + 1, K)))),
    ("combine-rcpm-shape", "combine", r"recv_channel_prefix_matrix must have shape", lambda c: c.combine(rcpm=torch.zeros((1, 3), dtype=torch.int32))),
    ("combine-stale-handle", "combine", r"stale handle", _stale_same_n),
    ("combine-config-other-num-sms", "combine", r"channel_prefix_matrix.*config\.num_sms", lambda c: c.combine(cfg=[2, 6, 256, 6, 128])),
    # handles, ids, lifecycle
    ("never-created-handle-cached", "cached_dispatch", r"buffer handle 987654321 does not exist", lambda c: c.cached(h=987654321)),
    ("buffer-info-never-created", "buffer_info", r"buffer handle 987654322 does not exist", lambda c: torch.ops.deep_ep.buffer_info(987654322)),
    ("bind-slot-out-of-range", "bind_buffer_slot", r"slot must be in 0..=1048575, got -1", lambda c: torch.ops.deep_ep.bind_buffer_slot(1, -1)),
    ("bind-slot-never-created", "bind_buffer_slot", r"buffer handle 987654324 does not exist",
     lambda c: torch.ops.deep_ep.bind_buffer_slot(987654324, 3)),
    ("unbound-slot-handle", "buffer_info", r"handle -7 names slot 6, and no buffer of this process is bound to it",
     lambda c: torch.ops.deep_ep.buffer_info(-7)),
    ("invalid-unique-id", "create_buffer", r"unique_id was not made by get_unique_id",
     lambda c: torch.ops.deep_ep.create_buffer(torch.zeros(128, dtype=torch.uint8), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")),
    ("unique-id-length", "create_buffer", r"unique_id must have 128 bytes",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu")[:64].clone(), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")),
    ("unique-id-dtype", "create_buffer", r"unique_id must be a 1-D uint8",
     lambda c: torch.ops.deep_ep.create_buffer(torch.zeros(128, dtype=torch.int32), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")),
    ("create-nvl-bytes-unaligned", "create_buffer", r"num_nvl_bytes \(100\)",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu"), 0, 1, torch.device("cpu"), 100, 0, False, "cpu")),
    ("create-rank-out-of-range", "create_buffer", r"rank 1 out of range",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu"), 1, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")),
    ("create-unknown-backend", "create_buffer", r"unknown backend 'bogus'",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu"), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "bogus")),
    ("create-nvshmem-on-cpu", "create_buffer", r"backend 'nvshmem' needs a CUDA device",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu"), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "nvshmem")),
    ("unique-id-nvshmem-on-cpu", "get_unique_id", r"backend 'nvshmem' needs a CUDA device",
     lambda c: torch.ops.deep_ep.get_unique_id("nvshmem", torch.device("cpu"))),
    ("create-ipc-on-cpu", "create_buffer", r"backend 'ipc' needs a CUDA device",
     lambda c: torch.ops.deep_ep.create_buffer(torch.ops.deep_ep.get_unique_id("cpu"), 0, 1, torch.device("cpu"), 1 << 20, 0, False, "ipc")),
    ("unique-id-ipc-on-cpu", "get_unique_id", r"backend 'ipc' needs a CUDA device",
     lambda c: torch.ops.deep_ep.get_unique_id("ipc", torch.device("cpu"))),
    ("ll-dispatch-on-normal-buffer", "low_latency_dispatch", r"low_latency_mode=False",
     lambda c: torch.ops.deep_ep.low_latency_dispatch(c.h, torch.zeros((2, 128), dtype=torch.bfloat16), torch.zeros((2, 1), dtype=torch.int64),
                                                      None, None, None, 4, 8, False, False, False)),
    ("clean-ll-on-normal-buffer", "clean_low_latency_buffer", r"low_latency_mode=False",
     lambda c: torch.ops.deep_ep.clean_low_latency_buffer(c.h, 4, 128, 8)),
]


@pytest.fixture(scope="module")
def shared_buffer(ops):
    h = make_buffer1(ops, num_nvl_bytes=1 << 22)
    assert_works(h)
    yield h
    ops.destroy_buffer(h)


def expect_error(op, arg_regex, fn, *a, **kw):
    with pytest.raises(RuntimeError) as ei:
        fn(*a, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"deep_ep::{op}: "), f"message must start with 'deep_ep::{op}: ', got: {msg!r}"
    assert re.search(arg_regex, msg), f"message must name the argument ({arg_regex!r}), got: {msg!r}"
    assert "internal error" not in msg, msg
    return msg


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_call_then_buffer_still_works(shared_buffer, case):
    name, op, arg_regex, fn = case
    ctx = Ctx(shared_buffer)
    expect_error(op, arg_regex, fn, ctx)
    assert assert_works(shared_buffer, seed=len(name)) > 0


def test_at_least_twenty_cases():
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)


def test_tokens_over_capacity_small_buffer(ops):
    h = make_buffer1(ops, num_nvl_bytes=8192)
    try:
        x, idx, w = good_inputs(5, n=64, h=1024)
        msg = expect_error("dispatch", r"tokens over capacity.*num_nvl_bytes is 8192", dispatch, h, x, idx, w)
        assert msg
        # the small buffer itself keeps working for calls that fit
        assert assert_works(h) > 0
    finally:
        ops.destroy_buffer(h)


def test_use_after_destroy(ops, shared_buffer):
    h = make_buffer1(ops)
    assert_works(h)
    ops.destroy_buffer(h)
    x, idx, w = good_inputs(1)
    lay = layout(idx)
    expect_error("cached_dispatch", rf"buffer handle {h} was destroyed", torch.ops.deep_ep.cached_dispatch, h, x, None,
                 torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int32),
                 torch.zeros((4,), dtype=torch.int32), lay[1], torch.zeros((N, 1), dtype=torch.int32), CFG)
    expect_error("combine", rf"buffer handle {h} was destroyed", torch.ops.deep_ep.combine, h, torch.zeros((4, H), dtype=torch.bfloat16),
                 None, None, None, torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int32),
                 torch.zeros((1, 2), dtype=torch.int32), torch.zeros((4,), dtype=torch.int32), lay[1], torch.zeros((N, 1), dtype=torch.int32), CFG)
    expect_error("destroy_buffer", rf"buffer handle {h} was destroyed", ops.destroy_buffer, h)
    expect_error("buffer_info", rf"buffer handle {h}", ops.buffer_info, h)
    # handles are never reused: a new buffer gets a new handle, and the process still works
    h2 = make_buffer1(ops)
    try:
        assert h2 != h
        assert assert_works(h2) > 0
    finally:
        ops.destroy_buffer(h2)
    assert assert_works(shared_buffer) > 0


@pytest.mark.parametrize("handle", ["destroyed", "never-created"])
def test_dispatch_bad_handle_names_dispatch(ops, shared_buffer, handle):
    if handle == "destroyed":
        h = make_buffer1(ops)
        ops.destroy_buffer(h)
    else:
        h = 987654321
    x, idx, w = good_inputs(1)
    try:
        expect_error("dispatch", rf"buffer handle {h}", dispatch, h, x, idx, w)
    finally:
        assert assert_works(shared_buffer) > 0


def test_dispatch_bad_handle_is_rejected(ops, shared_buffer):
    """What dispatch does today with a bad handle: a RuntimeError naming the handle (see the xfail above for the op name)."""
    x, idx, w = good_inputs(1)
    with pytest.raises(RuntimeError, match=r"^deep_ep::\w+: buffer handle 987654321 does not exist"):
        dispatch(987654321, x, idx, w)
    assert assert_works(shared_buffer) > 0


@pytest.mark.parametrize("cfg", [[4, 6, 256, 6], [4, 6, 256, 6, 128, 1]], ids=["4-ints", "6-ints"])
def test_config_wrong_length_is_rejected(ops, shared_buffer, cfg):
    ctx = Ctx(shared_buffer)
    with pytest.raises(RuntimeError, match=r"config must have 5 ints"):
        ctx.d(cfg=cfg)
    assert assert_works(shared_buffer) > 0


@pytest.mark.parametrize("cfg", [[4, 6, 256, 6], [4, 6, 256, 6, 128, 1]], ids=["4-ints", "6-ints"])
def test_config_wrong_length_names_the_op(ops, shared_buffer, cfg):
    ctx = Ctx(shared_buffer)
    try:
        expect_error("dispatch", r"config", ctx.d, cfg=cfg)
    finally:
        assert assert_works(shared_buffer) > 0


def test_python_config_odd_num_sms_names_an_existing_op(deep_ep):
    expect_error("nvl_buffer_size_hint", r"num_sms", deep_ep.Config, 3)


def test_python_config_odd_num_sms_is_rejected(deep_ep):
    with pytest.raises(RuntimeError, match=r"num_sms must be even"):
        deep_ep.Config(3)
    with pytest.raises(AssertionError, match="even"):
        deep_ep.Buffer.set_num_sms(7)


# ---------------------------------------------------------------------------------------------
# low-latency validation (independent of the LL backend: arguments are checked first)

T_LL, H_LL, E_LL = 4, 256, 8


@pytest.fixture(scope="module")
def ll_buffer(ops):
    nbytes = -(-int(ops.low_latency_rdma_size_hint(T_LL, H_LL, 1, E_LL)) // 128) * 128
    h = make_buffer1(ops, num_nvl_bytes=1 << 20, num_rdma_bytes=nbytes, low_latency_mode=True)
    yield h
    ops.destroy_buffer(h)


def ll_dispatch(h, n=3, hidden=H_LL, t=T_LL, e=E_LL, use_fp8=False, round_scale=False, ue8m0=False, x=None, idx=None, stats=None,
                idx_rows=None):
    g = torch.Generator().manual_seed(3)
    x = torch.randn((n, hidden), generator=g, device="cpu").to(torch.bfloat16) if x is None else x
    idx = torch.topk(torch.rand((idx_rows or n, e), generator=g, device="cpu"), 2, dim=1).indices if idx is None else idx
    return torch.ops.deep_ep.low_latency_dispatch(h, x, idx, None, stats, None, t, e, use_fp8, round_scale, ue8m0)


def ll_still_works(h):
    """After an LL validation error: a correct LL dispatch + combine if LL is implemented (checked
    against the definition), else the buffer must at least still answer buffer_info."""
    info = torch.ops.deep_ep.buffer_info(h)
    assert info[5] == 1
    g = torch.Generator().manual_seed(8)
    x = torch.randn((3, H_LL), generator=g, device="cpu").to(torch.bfloat16)
    idx = torch.topk(torch.rand((3, E_LL), generator=g, device="cpu"), 2, dim=1).indices
    w = torch.rand((3, 2), generator=g, device="cpu")
    try:
        recv_x, _, count, src_info, layout_range = torch.ops.deep_ep.low_latency_dispatch(h, x, idx, w, None, None, T_LL, E_LL,
                                                                                          False, False, False)
    except RuntimeError as e:
        if is_not_implemented(e):
            return False
        raise
    assert count.tolist() == torch.bincount(idx.flatten(), minlength=E_LL).tolist()
    out = torch.empty((3, H_LL), dtype=torch.bfloat16)
    torch.ops.deep_ep.low_latency_combine(h, recv_x, idx, w, src_info, layout_range, out, None, T_LL, E_LL, False, False)
    want = torch.zeros((3, H_LL))
    for k in range(2):
        want = want + w[:, k:k + 1] * x.float()
    assert torch.equal(out, want.to(torch.bfloat16))
    return True


LL_CASES = [
    ("ll-tokens-over-capacity", r"tokens over capacity: 5 tokens but num_max_dispatch_tokens_per_rank is 4", lambda h: ll_dispatch(h, n=5)),
    ("ll-hidden-not-128", r"hidden must be a positive multiple of 128, got 64", lambda h: ll_dispatch(h, hidden=64)),
    ("ll-ue8m0-without-round-scale", r"use_ue8m0=True requires round_scale=True", lambda h: ll_dispatch(h, use_fp8=True, ue8m0=True)),
    ("ll-round-scale-without-fp8", r"round_scale/use_ue8m0 only apply with use_fp8=True", lambda h: ll_dispatch(h, round_scale=True)),
    ("ll-x-float32", r"\bx must be torch\.bfloat16", lambda h: ll_dispatch(h, x=torch.zeros((3, H_LL)))),
    ("ll-topk-rows", r"\bx has 3 tokens but topk_idx has 2", lambda h: ll_dispatch(h, idx_rows=2)),
    ("ll-topk-float", r"topk_idx must be torch\.int32 or torch\.int64", lambda h: ll_dispatch(h, idx=torch.zeros((3, 2)))),
    ("ll-rdma-bytes-too-small", r"num_rdma_bytes", lambda h: ll_dispatch(h, t=64)),
    # count + 1 travels in 16 bits below 0xffff, the count field of an abandoned call's tag
    ("ll-tokens-past-the-tag", r"num_max_dispatch_tokens_per_rank \(65534\) must be in 1\.\.=65533", lambda h: ll_dispatch(h, t=65534)),
    ("ll-stats-dtype", r"cumulative_local_expert_recv_stats must be torch\.int32", lambda h: ll_dispatch(h, stats=torch.zeros((E_LL,), dtype=torch.int64))),
    ("ll-combine-zero-copy-logfmt", r"zero_copy and use_logfmt cannot be combined",
     lambda h: torch.ops.deep_ep.low_latency_combine(h, torch.zeros((E_LL, T_LL, H_LL), dtype=torch.bfloat16), torch.zeros((3, 2), dtype=torch.int64),
                                                     torch.zeros((3, 2)), torch.zeros((E_LL, T_LL), dtype=torch.int32),
                                                     torch.zeros((E_LL, 1), dtype=torch.int64), torch.zeros((3, H_LL), dtype=torch.bfloat16),
                                                     None, T_LL, E_LL, True, True)),
]


@pytest.mark.lowlatency
@pytest.mark.parametrize("case", LL_CASES, ids=[c[0] for c in LL_CASES])
def test_low_latency_bad_call(ops, ll_buffer, shared_buffer, case):
    name, arg_regex, fn = case
    op = "low_latency_combine" if "combine" in name else "low_latency_dispatch"
    expect_error(op, arg_regex, fn, ll_buffer)
    ll_still_works(ll_buffer)
    assert assert_works(shared_buffer) > 0


# ---------------------------------------------------------------------------------------------
# 2 ranks: the same bad input on both ranks, one-sided content errors, then correct calls


def _two_rank_bad_inputs(rank, h):
    """Returns the number of bad calls made; each is followed by a checked correct roundtrip."""
    num_ranks, e = 2, 2 * E
    x, idx, w = good_inputs(40 + rank, e=e, num_ranks=num_ranks)
    ntpr, in_rank, ntpe = layout(idx, e, num_ranks)
    d = lambda **kw: torch.ops.deep_ep.dispatch(h, kw.get("x", x), kw.get("s"), kw.get("idx", idx), kw.get("w", w), kw.get("ntpr", ntpr),  # noqa: E731
                                                kw.get("in_rank", in_rank), kw.get("ntpe", ntpe), 1, kw.get("worst", 0), CFG)
    bad_idx = idx.clone()
    bad_idx[0, 0] = e  # out of range
    calls = [
        ("dispatch", r"\bx must be torch\.bfloat16", lambda: d(x=x.float())),
        ("dispatch", r"num_tokens_per_expert has 15 experts", lambda: d(ntpe=torch.zeros((15,), dtype=torch.int32))),
        ("dispatch", r"topk_weights must have shape", lambda: d(w=w[:, :1].contiguous())),
        ("dispatch", r"x_scales", lambda: d(x=x.to(torch.float8_e4m3fn))),
        ("dispatch", r"topk_idx holds expert id 16", lambda: d(idx=bad_idx)),  # found by the backend's content checks
        ("dispatch", r"config\.num_sms must be even", lambda: torch.ops.deep_ep.dispatch(h, x, None, idx, w, ntpr, in_rank, ntpe, 1, 0, [5, 6, 256, 6, 128])),
        ("get_dispatch_layout", r"num_experts \(15\)", lambda: torch.ops.deep_ep.get_dispatch_layout(idx, 15, 2)),
    ]
    n = 0
    for op, regex, fn in calls:
        expect_error(op, regex, fn)
        assert_works(h, rank, num_ranks, seed=200 + n)
        n += 1
    # a stale handle (another dispatch's) on both ranks, detected before any data moves
    x2, idx2, w2 = good_inputs(60 + rank, n=N - 2, e=e, num_ranks=num_ranks)
    lay2 = layout(idx2, e, num_ranks)
    out2 = dispatch(h, x2, idx2, w2, e=e, num_ranks=num_ranks, lay=lay2)
    hd2 = handle_of(out2, lay2[1])
    expect_error("cached_dispatch", r"x has 6 tokens but the handle was made for 4",
                 lambda: torch.ops.deep_ep.cached_dispatch(h, x, None, *hd2, CFG))
    expect_error("combine", r"\bx must have shape \[num_recv_tokens=", lambda: torch.ops.deep_ep.combine(
        h, torch.zeros((out2[0].shape[0] + 1, H), dtype=torch.bfloat16), None, None, None, *hd2, CFG))
    n += 2
    assert_works(h, rank, num_ranks, seed=999)
    return n


def bad_input_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    try:
        got = assert_works(buf.handle, rank, world)
        return _two_rank_bad_inputs(rank, buf.handle), got
    finally:
        buf.destroy()


def test_two_ranks_same_bad_input_then_continue(rank_pool):
    results = rank_pool(2).run(bad_input_worker)
    assert [r[0] for r in results] == [9, 9]
    assert all(r[1] > 0 for r in results)


def one_sided_validation_worker(rank, world):
    """Argument checks run before the rendezvous, so an argument error on one rank only is raised
    there at once; its peer waits at the rendezvous until DEEP_EP_TIMEOUT_MS and gets a timeout
    naming that rank, which poisons its buffer. A new buffer works."""
    import deep_ep_rs
    import torch.distributed as dist

    with timeout_ms(1500):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    e = E * world
    x, idx, w = good_inputs(70 + rank, e=e, num_ranks=world)
    ntpr, in_rank, ntpe = layout(idx, e, world)
    bad_x = x.float() if rank == 1 else x
    if rank == 1:
        msg = expect_error("dispatch", r"\bx must be torch\.bfloat16", torch.ops.deep_ep.dispatch, buf.handle, bad_x, None, idx, w, ntpr, in_rank,
                           ntpe, 1, 0, CFG)
    else:
        msg = expect_error("dispatch", r"timed out .* waiting for rank\(s\) \[1\]", torch.ops.deep_ep.dispatch, buf.handle, bad_x, None,
                           idx, w, ntpr, in_rank, ntpe, 1, 0, CFG)
        # the timed-out buffer refuses further collectives until it is destroyed
        rpm = torch.zeros((world, world), dtype=torch.int32)
        msg2 = expect_error("combine", r"unusable after an earlier failure", torch.ops.deep_ep.combine, buf.handle,
                            torch.zeros((0, H), dtype=torch.bfloat16), None, None, None, rpm, torch.zeros((world, 2), dtype=torch.int32),
                            torch.zeros((world, 2), dtype=torch.int32), torch.zeros((0,), dtype=torch.int32), in_rank,
                            torch.zeros(in_rank.shape, dtype=torch.int32), CFG)
        assert msg2
    dist.barrier()
    buf.destroy()
    buf2 = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device="cpu", explicitly_destroy=True)
    try:
        return msg, assert_works(buf2.handle, rank, world)
    finally:
        buf2.destroy()


def test_two_ranks_one_sided_argument_error_times_out_peer(rank_pool):
    results = rank_pool(2).run(one_sided_validation_worker)
    assert "timed out" in results[0][0] and "float32" in results[1][0]
    assert all(r[1] > 0 for r in results)


# ---------------------------------------------------------------------------------------------
# more argument edge cases


@pytest.mark.parametrize("num_ranks", [9, 12])
def test_layout_num_ranks_not_multiple_of_8(ops, shared_buffer, num_ranks):
    idx = torch.tensor([[0, num_ranks * 2 - 1], [num_ranks - 1, num_ranks]])
    try:
        expect_error("get_dispatch_layout", r"num_ranks", ops.get_dispatch_layout, idx, num_ranks * 2, num_ranks)
    finally:
        assert assert_works(shared_buffer) > 0  # the caught panic left the process usable


@pytest.mark.parametrize("align", [2 ** 31, 2 ** 40])
def test_expert_alignment_overflow(ops, shared_buffer, align):
    ctx = Ctx(shared_buffer)
    try:
        expect_error("dispatch", r"expert_alignment", ctx.d, align=align)
    finally:
        assert assert_works(shared_buffer) > 0


def test_large_expert_alignment_rounds_up(ops, shared_buffer):
    ctx = Ctx(shared_buffer)
    out = ctx.d(align=1000)
    counts = torch.bincount(ctx.idx[ctx.idx >= 0], minlength=E)
    assert out[4].tolist() == [(-(-int(c) // 1000)) * 1000 for c in counts]
    assert out[0].shape[0] == ctx.rows  # alignment does not pad recv_x (DeepEP V1)


# More malformed calls, covering every op that takes arguments: lifecycle (calls after destroy),
# create_buffer ranks and sizes, size hints, split low-latency ops, LL geometry against the
# buffer's size. Errors of the split LL ops name their family (`deep_ep::low_latency_dispatch`
# for *_send/*_recv): the C seam is shared by the fused and the split ops.

FAMILY = {"low_latency_dispatch_send": "low_latency_dispatch", "low_latency_dispatch_recv": "low_latency_dispatch",
          "low_latency_combine_send": "low_latency_combine", "low_latency_combine_recv": "low_latency_combine",
          "low_latency_combine_alloc": "low_latency_combine",
          # it raises the error create_buffer would raise with these settings
          "check_environment": "create_buffer"}
CPU = torch.device("cpu")


def _with_env(name, value, fn, *args):
    """fn(*args) with environment variable `name` set to `value` (restored afterwards)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@pytest.fixture(scope="module")
def dead_handle(ops):
    h = make_buffer1(ops, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20, low_latency_mode=True)
    ops.destroy_buffer(h)
    return h


class LLCtx:
    """A completed LL dispatch (split send + recv) on the LL buffer, the normal-mode Ctx, and a
    destroyed handle."""

    def __init__(self, ops, ll_h, normal_h, dead):
        self.ops, self.h, self.dead, self.n = ops, ll_h, dead, Ctx(normal_h)
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn((3, H_LL), generator=g, device="cpu").to(torch.bfloat16)
        self.idx = torch.tensor([[0, 1], [2, 3], [4, -1]])
        self.w = torch.ones((3, 2))
        self.rx, self.sc, self.cnt, self.src, self.lr, self.st = self.send()
        self.recv(self.st)
        self.out = torch.empty((3, H_LL), dtype=torch.bfloat16)

    def send(self, h=None, x=None, idx=None, w=None, t=T_LL, e=E_LL, stats=None):
        return self.ops.low_latency_dispatch_send(self.h if h is None else h, self.x if x is None else x, self.idx if idx is None else idx,
                                                  self.w if w is None else w, t, e, False, False, False)

    def recv(self, st, h=None, rx=None):
        self.ops.low_latency_dispatch_recv(self.h if h is None else h, st, self.rx if rx is None else rx, self.sc, self.cnt, self.src,
                                           self.lr, None, None, T_LL, E_LL, False, False, False)

    def fused(self, h=None, x=None, idx=None, w=None, t=T_LL, e=E_LL, wait=None):
        return self.ops.low_latency_dispatch(self.h if h is None else h, self.x if x is None else x, self.idx if idx is None else idx,
                                             self.w if w is None else w, None, wait, t, e, False, False, False)

    def combine(self, h=None, w=None, src=None, out=None, logfmt=False, zero_copy=False):
        self.ops.low_latency_combine(self.h if h is None else h, self.rx, self.idx, self.w if w is None else w,
                                     self.src if src is None else src, self.lr, self.out if out is None else out, None, T_LL, E_LL,
                                     logfmt, zero_copy)

    def combine_alloc(self, h=None, w=None, x=None):
        return self.ops.low_latency_combine_alloc(self.h if h is None else h, self.rx if x is None else x, self.idx, self.w if w is None else w,
                                                  self.src, self.lr, None, T_LL, E_LL, False, False)

    def combine_send(self, h=None, logfmt=False, zero_copy=False):
        return self.ops.low_latency_combine_send(self.h if h is None else h, self.rx, self.src, self.lr, T_LL, E_LL, logfmt, zero_copy)

    def combine_recv(self, st, h=None):
        self.ops.low_latency_combine_recv(self.h if h is None else h, st, self.idx, self.w, self.out, None, T_LL, H_LL, E_LL)

    def create(self, rank=0, num_ranks=1, nvl=1 << 20, device=CPU, backend="cpu"):
        return self.ops.create_buffer(self.ops.get_unique_id("cpu"), rank, num_ranks, device, nvl, 0, False, backend)


def _stale_recv(c):
    states = [c.send()[-1] for _ in range(3)]  # the third send reuses the first one's half
    return c.recv(states[0])


DESTROYED = r"buffer handle \d+ was destroyed"
CFG20 = [20, 6, 256, 6, 128]
INTERNODE_ONE_DOMAIN = r"internode ops need ranks spanning several NVLink domains"


def _internode_like_handle(c):  # the 9 handle tensors after is_token_in_rank, shaped for 1 rank in 1 domain
    z, ch = (lambda *shape: torch.zeros(shape, dtype=torch.int32)), CFG[0] // 2
    return z(1, ch), z(1, ch), z(1, ch), z(1), z(1, ch), z(1), torch.zeros((c.rows, 8), dtype=torch.uint8), z(c.x.shape[0], 1), z(0, 8)


EXTRA_CASES = [
    # calls after destroy, one per op taking a handle (dispatch/cached/combine/destroy/buffer_info: test_use_after_destroy)
    ("destroyed-ll-dispatch", "low_latency_dispatch", DESTROYED, lambda c: c.fused(h=c.dead)),
    ("destroyed-ll-dispatch-send", "low_latency_dispatch_send", DESTROYED, lambda c: c.send(h=c.dead)),
    ("destroyed-ll-dispatch-recv", "low_latency_dispatch_recv", DESTROYED, lambda c: c.recv(c.st, h=c.dead)),
    ("destroyed-ll-combine", "low_latency_combine", DESTROYED, lambda c: c.combine(h=c.dead)),
    ("destroyed-ll-combine-send", "low_latency_combine_send", DESTROYED, lambda c: c.combine_send(h=c.dead)),
    ("destroyed-ll-combine-alloc", "low_latency_combine_alloc", DESTROYED, lambda c: c.combine_alloc(h=c.dead)),
    ("destroyed-ll-combine-recv", "low_latency_combine_recv", DESTROYED, lambda c: c.combine_recv(c.st, h=c.dead)),
    ("destroyed-clean", "clean_low_latency_buffer", DESTROYED, lambda c: c.ops.clean_low_latency_buffer(c.dead, T_LL, H_LL, E_LL)),
    ("destroyed-next-combine-buffer", "get_next_low_latency_combine_buffer", DESTROYED,
     lambda c: c.ops.get_next_low_latency_combine_buffer(c.dead, T_LL, H_LL, E_LL)),
    ("destroyed-local-buffer", "get_local_buffer_tensor", DESTROYED, lambda c: c.ops.get_local_buffer_tensor(c.dead, torch.int8, 0, True)),
    ("local-buffer-offset-misaligned", "get_local_buffer_tensor",
     r"offset \(6\) must be a multiple of 4 bytes, the element size of torch\.float32",
     lambda c: c.ops.get_local_buffer_tensor(c.h, torch.float32, 6, True)),
    ("local-buffer-offset-past-the-part", "get_local_buffer_tensor",
     r"offset \(1099511627776\) must be in \[0, \d+\], the bytes of this rank's RDMA part \(num_rdma_bytes\)",
     lambda c: c.ops.get_local_buffer_tensor(c.h, torch.int8, 1 << 40, True)),
    ("local-buffer-negative-offset", "get_local_buffer_tensor",
     r"offset \(-8\) must be in \[0, 1048576\], the bytes of this rank's NVLink part \(num_nvl_bytes\)",
     lambda c: c.ops.get_local_buffer_tensor(c.h, torch.int64, -8, False)),
    ("mask-rank-out-of-range", "low_latency_update_mask_buffer", r"rank_to_mask must be in \[0, 1\), got 5", lambda c: c.ops.low_latency_update_mask_buffer(c.h, 5, True)),
    ("mask-status-float", "low_latency_query_mask_buffer", r"mask_status must be a 1-D int32", lambda c: c.ops.low_latency_query_mask_buffer(c.h, torch.zeros(1))),
    ("destroyed-clean-mask", "low_latency_clean_mask_buffer", DESTROYED, lambda c: c.ops.low_latency_clean_mask_buffer(c.dead)),
    ("destroyed-set-shrink", "low_latency_set_shrink", DESTROYED, lambda c: c.ops.low_latency_set_shrink(c.dead, True)),
    ("destroyed-wait-stats", "wait_stats", DESTROYED, lambda c: c.ops.wait_stats(c.dead)),
    ("destroy-never-created", "destroy_buffer", r"buffer handle 987654323 does not exist", lambda c: c.ops.destroy_buffer(987654323)),
    # create_buffer: ranks, sizes, device
    ("create-rank-equals-num-ranks", "create_buffer", r"rank 2 out of range for num_ranks 2", lambda c: c.create(rank=2, num_ranks=2)),
    ("create-zero-ranks", "create_buffer", r"num_ranks \(0\) >= 1", lambda c: c.create(num_ranks=0)),
    ("create-negative-rank", "create_buffer", r"rank \(-1\) must be >= 0", lambda c: c.create(rank=-1, num_ranks=2)),
    ("create-negative-bytes", "create_buffer", r"buffer sizes must be >= 0, got -128", lambda c: c.create(nvl=-128)),
    ("create-cpu-backend-on-cuda", "create_buffer", r"cpu backend works on CPU tensors; device cuda:0",
     lambda c: c.create(device=torch.device("cuda", 0))),
    ("unique-id-unknown-backend", "get_unique_id", r"unknown backend 'bogus'", lambda c: c.ops.get_unique_id("bogus")),
    # size hints
    ("nvl-hint-zero-hidden", "nvl_buffer_size_hint", r"hidden_bytes \(0\)", lambda c: c.ops.nvl_buffer_size_hint(CFG20, 0, 1)),
    ("nvl-hint-config-4-ints", "nvl_buffer_size_hint", r"config must be 5", lambda c: c.ops.nvl_buffer_size_hint(CFG20[:4], 1024, 2)),
    ("rdma-hint-12-ranks", "rdma_buffer_size_hint", r"num_ranks must be <= 8 or a multiple of 8, got 12",
     lambda c: c.ops.rdma_buffer_size_hint(CFG20, 1024, 12)),
    ("ll-hint-zero-hidden", "low_latency_rdma_size_hint", r"all arguments must be positive",
     lambda c: c.ops.low_latency_rdma_size_hint(4, 0, 1, 8)),
    # settings
    ("nvl-domain-size-plus-one", "nvl_domain_size", r'DEEP_EP_NVL_DOMAIN_SIZE="\+1" is not a whole number in 1..=8',
     lambda c: _with_env("DEEP_EP_NVL_DOMAIN_SIZE", "+1", c.ops.nvl_domain_size)),
    ("check-environment-unknown-backend", "check_environment", r"unknown backend 'bogus' \(from DEEP_EP_BACKEND\)",
     lambda c: _with_env("DEEP_EP_BACKEND", "bogus", c.ops.check_environment, CPU)),
    # normal mode: shapes, dtypes, contiguity
    ("dispatch-topk-3d", "dispatch", r"topk_idx must have shape", lambda c: c.n.d(idx=c.n.idx.view(N, K, 1))),
    ("dispatch-scales-1d", "dispatch", r"x_scales must have shape", lambda c: c.n.d(x=_fp8(c.n), scales=torch.ones((N,)))),
    ("dispatch-in-rank-noncontig", "dispatch", r"is_token_in_rank must be contiguous",
     lambda c: c.n.d(in_rank=torch.cat([c.n.in_rank, c.n.in_rank], 1)[:, ::2])),
    ("dispatch-topk-noncontig", "dispatch", r"topk_idx must be contiguous", lambda c: c.n.d(idx=torch.cat([c.n.idx, c.n.idx], 1)[:, ::2])),
    ("dispatch-ntpr-length", "dispatch", r"num_tokens_per_rank must have shape", lambda c: c.n.d(ntpr=torch.zeros((2,), dtype=torch.int32))),
    ("dispatch-weights-noncontig", "dispatch", r"topk_weights must be contiguous", lambda c: c.n.d(w=torch.cat([c.n.w, c.n.w], 1)[:, ::2])),
    ("cached-x-float32", "cached_dispatch", r"\bx must be torch\.bfloat16 or torch\.float8_e4m3fn", lambda c: c.n.cached(x=c.n.x.float())),
    ("cached-rcpm-dtype", "cached_dispatch", r"recv_channel_prefix_matrix must be torch\.int32", lambda c: c.n.cached(rcpm=c.n.handle[2].long())),
    ("combine-weights-dtype", "combine", r"topk_weights must be torch\.float32", lambda c: c.n.combine(w=torch.zeros((c.n.rows, K), dtype=torch.float64))),
    ("combine-topk-33", "combine", r"num_topk must be in 1..=32, got 33", lambda c: c.n.combine(w=torch.zeros((c.n.rows, 33)))),
    ("combine-hidden-8-bytes", "combine", r"\bx rows must be a multiple of 16 bytes",
     lambda c: c.n.combine(y=torch.zeros((c.n.rows, 4), dtype=torch.bfloat16))),
    # low latency: geometry against the buffer, ids, shapes, states of the split ops
    ("ll-hidden-larger-than-buffer", "low_latency_dispatch", r"num_rdma_bytes \(\d+\) is smaller than get_low_latency_rdma_size_hint\(4, 1024",
     lambda c: c.fused(x=torch.zeros((3, 1024), dtype=torch.bfloat16))),
    ("ll-zero-experts", "low_latency_dispatch", r"num_experts \(0\) must be positive", lambda c: c.fused(e=0)),
    ("ll-expert-out-of-range", "low_latency_dispatch", r"topk_idx\[\d+, \d+\] = 8 is not an expert id: ids must be in \[-1, 8\)",
     lambda c: c.fused(idx=torch.tensor([[0, 8], [1, 2], [3, 4]]))),
    ("ll-topk-33", "low_latency_dispatch", r"num_topk must be in 1..=32, got 33", lambda c: c.fused(idx=torch.zeros((3, 33), dtype=torch.int64), w=None)),
    ("ll-weights-shape", "low_latency_dispatch", r"topk_weights must have shape \[num_tokens=3, num_topk=2\]", lambda c: c.fused(w=torch.ones((3, 3)))),
    ("ll-x-noncontig", "low_latency_dispatch", r"\bx must be contiguous", lambda c: c.fused(x=torch.cat([c.x, c.x], 1)[:, ::2])),
    ("ll-wait-stats-shape", "low_latency_dispatch", r"dispatch_wait_recv_cost_stats must have shape \[num_ranks=1\]",
     lambda c: c.fused(wait=torch.zeros((2,), dtype=torch.int64))),
    ("ll-send-tokens-over-capacity", "low_latency_dispatch_send", r"tokens over capacity: 5 tokens",
     lambda c: c.send(x=torch.zeros((5, H_LL), dtype=torch.bfloat16), idx=torch.zeros((5, 1), dtype=torch.int64), w=torch.ones((5, 1)))),
    ("ll-recv-zero-state", "low_latency_dispatch_recv", r"recv_state \[0, 0, 0, 0\] was not produced by low_latency_dispatch_send",
     lambda c: c.recv(torch.zeros((4,), dtype=torch.int64))),
    ("ll-recv-stale-state", "low_latency_dispatch_recv", r"reused by a later low-latency send", _stale_recv),
    ("ll-recv-x-dtype", "low_latency_dispatch_recv", r"recv_x must be torch\.bfloat16", lambda c: c.recv(c.send()[-1], rx=c.rx.float())),
    ("ll-combine-out-shape", "low_latency_combine", r"out must have shape \[num_tokens=3, hidden=256\]",
     lambda c: c.combine(out=torch.empty((3, H_LL + 128), dtype=torch.bfloat16))),
    ("ll-combine-weights-dtype", "low_latency_combine", r"topk_weights must be torch\.float32", lambda c: c.combine(w=c.w.double())),
    ("ll-combine-src-info-dtype", "low_latency_combine", r"src_info must be torch\.int32", lambda c: c.combine(src=c.src.long())),
    ("ll-combine-alloc-weights-dtype", "low_latency_combine_alloc", r"topk_weights must be torch\.float32",
     lambda c: c.combine_alloc(w=c.w.double())),
    ("ll-combine-alloc-x-2d", "low_latency_combine_alloc", r"x must have shape \[num_local_experts=8", lambda c: c.combine_alloc(x=c.rx[0])),
    ("ll-combine-send-zero-copy-logfmt", "low_latency_combine_send", r"zero_copy and use_logfmt cannot be combined",
     lambda c: c.combine_send(logfmt=True, zero_copy=True)),
    ("ll-combine-recv-dispatch-state", "low_latency_combine_recv", r"was not produced by low_latency_combine_send",
     lambda c: c.combine_recv(c.send()[-1])),
    ("ll-next-buffer-hidden-100", "get_next_low_latency_combine_buffer", r"hidden must be a positive multiple of 128, got 100",
     lambda c: c.ops.get_next_low_latency_combine_buffer(c.h, T_LL, 100, E_LL)),
    ("ll-clean-zero-tokens", "clean_low_latency_buffer", r"num_max_dispatch_tokens_per_rank \(0\)",
     lambda c: c.ops.clean_low_latency_buffer(c.h, 0, H_LL, E_LL)),
    # internode ops on a buffer inside one NVLink domain (more internode errors: test_internode.py)
    ("internode-dispatch-one-domain", "internode_dispatch", INTERNODE_ONE_DOMAIN,
     lambda c: c.ops.internode_dispatch(c.n.h, c.n.x, None, c.n.idx, c.n.w, c.n.ntpr, torch.zeros(1, dtype=torch.int32), c.n.in_rank,
                                        c.n.ntpe, 1, 0, CFG)),
    ("internode-cached-one-domain", "internode_cached_dispatch", INTERNODE_ONE_DOMAIN,
     lambda c: c.ops.internode_cached_dispatch(c.n.h, c.n.x, None, c.n.in_rank, *_internode_like_handle(c.n), CFG)),
    ("internode-combine-one-domain", "internode_combine", INTERNODE_ONE_DOMAIN,
     lambda c: c.ops.internode_combine(c.n.h, c.n.y, None, None, None, c.n.in_rank, *_internode_like_handle(c.n), CFG)),
]


@pytest.mark.parametrize("case", EXTRA_CASES, ids=[c[0] for c in EXTRA_CASES])
def test_more_bad_calls_then_still_usable(ops, ll_buffer, shared_buffer, dead_handle, case):
    name, op, arg_regex, fn = case
    ctx = LLCtx(ops, ll_buffer, shared_buffer, dead_handle)
    expect_error(FAMILY.get(op, op), arg_regex, fn, ctx)
    ll_still_works(ll_buffer)
    assert assert_works(shared_buffer, seed=len(name)) > 0


# ---------------------------------------------------------------------------------------------
# the count


TWO_RANK_SAME_BAD_INPUT = 12  # test_two_ranks_same_bad_input_then_continue
TWO_RANK_DISAGREEING = 3  # test_bad_input_ranks.py: test_two_ranks_disagreeing_arguments
OTHER_SINGLE_CALLS = ["dispatch-tokens-over-capacity", "destroyed-cached", "destroyed-combine", "destroyed-destroy", "destroyed-buffer-info",
                      "destroyed-dispatch", "config-4-ints", "config-6-ints", "python-config-odd-num-sms"]


def test_at_least_forty_distinct_malformed_calls_across_all_ops(ops):
    ids = [c[0] for c in CASES] + [c[0] for c in LL_CASES] + [c[0] for c in EXTRA_CASES] + OTHER_SINGLE_CALLS
    assert len(ids) == len(set(ids)), "case ids must be distinct"
    total = len(ids) + TWO_RANK_SAME_BAD_INPUT + TWO_RANK_DISAGREEING
    assert total >= 40, total
    covered = {c[1] for c in CASES} | {c[1] for c in EXTRA_CASES} | {"low_latency_dispatch", "low_latency_combine"}
    covered |= {"nvl_buffer_size_hint"}  # test_python_config_odd_num_sms_names_an_existing_op
    every_op = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("deep_ep::")}
    assert every_op - covered == {"build_info"}, f"ops without a malformed-call test: {every_op - covered - {'build_info'}}"
