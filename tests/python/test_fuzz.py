"""Hypothesis fuzzing of the CPU backend on 2 and 3 ranks against the independent reference.

Hypothesis (in the parent, derandomized) draws each example: tokens per rank, hidden (a multiple
of 8; of 16 for FP8; rounded up to 128 for low latency), top-k, experts, the density of -1,
int32/int64 ids, BF16/FP8 (normal mode: float or UE8M0-packed scales; low latency: plain,
round_scale, UE8M0), num_sms (channels may outnumber tokens), alignment, worst-case mode,
biases. The example is shipped to the persistent ranks of one pool per rank count; every rank
regenerates every rank's tensors from the example's seed, runs layout -> dispatch -> cached
dispatch -> combine and low-latency dispatch -> combine on buffers it keeps across examples (so
the low-latency geometry changes between calls), and compares bit for bit with _reference.py.

Examples per rank count: DEEP_EP_FUZZ_EXAMPLES (default 200; sized for < 60 s with both pools).
Shrinking is off (each failure restarts the ranks); the falsifying example is printed.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import _reference as ref
from test_roundtrip import check_dispatch, same

EXAMPLES = int(os.environ.get("DEEP_EP_FUZZ_EXAMPLES", "200"))
MAX_TOKENS, MAX_HIDDEN, MAX_LOCAL_EXPERTS = 24, 512, 8
FP8_MAX_INV = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # DeepEP's f32 constant kFinfoAmaxInvE4M3


@st.composite
def fuzz_case(draw, world):
    el = draw(st.integers(1, MAX_LOCAL_EXPERTS))
    experts = world * el
    topk = draw(st.integers(1, min(9, experts)))
    fp8 = draw(st.booleans())
    hidden = draw(st.integers(1, MAX_HIDDEN // 16)) * 16 if fp8 else draw(st.integers(1, MAX_HIDDEN // 8)) * 8
    tokens = draw(st.lists(st.integers(0, MAX_TOKENS), min_size=world, max_size=world))
    ll_mode = draw(st.sampled_from(["bf16", "fp8", "fp8-round", "fp8-ue8m0"]))
    ll_hidden = 512 if ll_mode == "fp8-ue8m0" else -(-hidden // 128) * 128
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), tokens=tokens, hidden=hidden, topk=topk, experts=experts,
        masked=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.9, 1.0])), idx_dtype=draw(st.sampled_from(["int32", "int64"])),
        mode=("fp8_ue8m0" if draw(st.booleans()) else "fp8_f32") if fp8 else "bf16", scales_col_major=draw(st.booleans()),
        with_topk=True, num_sms=draw(st.sampled_from([2, 4, 8, 24, 48])), align=draw(st.integers(1, 4)),
        worst=draw(st.booleans()), bias=draw(st.integers(0, 2)), ll_mode=ll_mode, ll_hidden=ll_hidden,
        ll_tokens=draw(st.integers(max(1, max(tokens)), MAX_TOKENS)),
    )


# ---------------------------------------------------------------------------------------------
# inputs (deterministic per (example, rank))


def gen_input(case, s, world) -> ref.RankInput:
    g = torch.Generator().manual_seed(case["seed"] * 7 + s)
    n, h, k, e = case["tokens"][s], case["hidden"], case["topk"], case["experts"]
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]) if n else torch.zeros((0, k), dtype=torch.int64)
    idx = torch.where(torch.rand(idx.shape, generator=g) < case["masked"], torch.full_like(idx, -1), idx)
    idx = idx.to(torch.int32 if case["idx_dtype"] == "int32" else torch.int64).contiguous()
    w = torch.randn((n, k), generator=g)
    x = torch.randn((n, h), generator=g) * 4
    if case["mode"] == "bf16":
        return ref.RankInput(x=x.to(torch.bfloat16), topk_idx=idx, topk_weights=w)
    cols = -(-h // 512) if case["mode"] == "fp8_ue8m0" else -(-h // 128)
    if case["mode"] == "fp8_ue8m0":
        scales = torch.randint(-2**31, 2**31 - 1, (cols, n) if case["scales_col_major"] else (n, cols), generator=g, dtype=torch.int64)
        scales = scales.to(torch.int32)
    else:
        scales = torch.rand((cols, n) if case["scales_col_major"] else (n, cols), generator=g)
    scales = scales.T if case["scales_col_major"] else scales
    return ref.RankInput(x=x.to(torch.float8_e4m3fn), topk_idx=idx, topk_weights=w, x_scales=scales)


def gen_ll_input(case, s, world) -> ref.RankInput:
    g = torch.Generator().manual_seed(case["seed"] * 11 + s + 5)
    n, k, e, h = case["tokens"][s], case["topk"], case["experts"], case["ll_hidden"]
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]) if n else torch.zeros((0, k), dtype=torch.int64)
    idx = torch.where(torch.rand(idx.shape, generator=g) < case["masked"], torch.full_like(idx, -1), idx)
    idx = idx.to(torch.int32 if case["idx_dtype"] == "int32" else torch.int64).contiguous()
    # powers of two: products with bf16 rows are exact, so FMA and mul+add agree bit for bit
    w = torch.pow(2.0, torch.randint(-3, 4, (n, k), generator=g).float()) * (torch.randint(0, 2, (n, k), generator=g) * 2 - 1)
    amp = torch.pow(10.0, torch.randint(-3, 3, (n, 1), generator=g).float())  # rows of different magnitudes
    return ref.RankInput(x=(torch.randn((n, h), generator=g) * amp).to(torch.bfloat16), topk_idx=idx, topk_weights=w)


# ---------------------------------------------------------------------------------------------
# normal mode


def run_normal(buf, deep_ep, case, rank, world):
    E, C = case["experts"], case["num_sms"] // 2
    cfg = deep_ep.Config(case["num_sms"], 6, 256, 6, 128)
    inputs = [gen_input(case, s, world) for s in range(world)]
    me = inputs[rank]
    refs = [ref.dispatch(inputs, d, E, C, case["align"]) for d in range(world)]
    rf = refs[rank]
    tag = f"[normal {case} rank {rank}]"
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    want = ref.layout(me.topk_idx, E, world)
    same(f"{tag} num_tokens_per_rank", ntpr, want[0])
    same(f"{tag} num_tokens_per_expert", ntpe, want[1])
    same(f"{tag} is_token_in_rank", in_rank, want[2])
    xarg = (me.x, me.x_scales) if me.x_scales is not None else me.x
    kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=me.topk_idx,
              topk_weights=me.topk_weights, expert_alignment=case["align"], config=cfg)
    out = buf.dispatch(xarg, **kw)
    handle = check_dispatch(f"{tag} dispatch", out, rf, case)
    if case["worst"]:
        worst = sum(case["tokens"]) + 1
        wout = buf.dispatch(xarg, num_worst_tokens=worst, **kw)
        check_dispatch(f"{tag} worst-case dispatch", wout, rf, case, rows=worst)
    cout = buf.dispatch(xarg, handle=handle, config=cfg)
    cx = cout[0][0] if me.x_scales is not None else cout[0]
    same(f"{tag} cached recv_x", cx, rf.recv_x)
    # combine: random bf16 rows and weights, optional biases, against the reference sum
    g = torch.Generator().manual_seed(case["seed"] + 1000 * rank)
    ys = []
    for d in range(world):
        gd = torch.Generator().manual_seed(case["seed"] * 3 + d)
        ys.append((torch.randn((refs[d].num_recv, case["hidden"]), generator=gd).to(torch.bfloat16),
                   torch.randn((refs[d].num_recv, case["topk"]), generator=gd)))
    n = me.x.shape[0]
    bs = [torch.randn((n, case["hidden"]), generator=g).to(torch.bfloat16) for _ in range(case["bias"])]
    want_x, want_w = ref.combine(refs, [y for y, _ in ys], rank, n, weights=[w for _, w in ys], bias_0=bs[0] if bs else None,
                                 bias_1=bs[1] if len(bs) > 1 else None)
    bias = None if not bs else (bs[0] if len(bs) == 1 else tuple(bs))
    got_x, got_w, _ = buf.combine(ys[rank][0], handle, topk_weights=ys[rank][1], bias=bias, config=cfg)
    same(f"{tag} combined_x", got_x, want_x)
    same(f"{tag} combined_topk_weights", got_w, want_w)
    return rf.num_recv


# ---------------------------------------------------------------------------------------------
# low-latency mode

LL_MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-round": (True, True, False),
            "fp8-ue8m0": (True, True, True)}


def deepep_ll_quantize(x, round_scale):
    """DeepEP's LL cast (csrc/kernels/utils.cuh calculate_fp8_scales): per token and 128 channels,
    amax >= 1e-4; scale_inv = amax * f32(1/448) (a product, not amax / 448), or with round_scale
    2^ceil(log2(that)) and scale = 1 / scale_inv, else scale = 448 / amax; values x * scale
    (one f32 product) saturated to +-448 and rounded to nearest even. Returns (fp8, scale_inv)."""
    n, h = x.shape
    xv = x.float().view(n, h // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    inv = amax * FP8_MAX_INV
    if round_scale:
        m, e = torch.frexp(inv)
        e = torch.where(m == 0.5, e - 1, e)
        scale_inv, scale = torch.ldexp(torch.ones_like(inv), e), torch.ldexp(torch.ones_like(inv), -e)
    else:  # an IEEE f32 division (torch's `448.0 / t` multiplies by a reciprocal, off by an ulp at times)
        scale_inv, scale = inv, (448.0 / amax.double()).float()
    q = (xv * scale.unsqueeze(2)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, h)
    return q, scale_inv


def dequant_rows(q, scale_inv):
    n, h = q.shape
    return (q.float().view(n, h // 128, 128) * scale_inv.view(n, h // 128, 1)).view(n, h).to(torch.bfloat16)


def expert_fn(g, rows):
    return (rows.float() * (1.0 + g / 8.0)).to(torch.bfloat16)


def run_ll(buf, case, rank, world):
    R, E, T, H = world, case["experts"], case["ll_tokens"], case["ll_hidden"]
    el = E // R
    use_fp8, round_scale, ue8m0 = LL_MODES[case["ll_mode"]]
    inputs = [gen_ll_input(case, s, R) for s in range(R)]
    me = inputs[rank]
    rf = ref.ll_dispatch(inputs, rank, E, False, False)  # routing (counts, sources) from the reference
    tag = f"[ll {case} rank {rank}]"
    recv, count, handle, _, _ = buf.low_latency_dispatch(me.x, me.topk_idx, T, E, use_fp8=use_fp8, round_scale=round_scale,
                                                         use_ue8m0=ue8m0)
    recv_x, scales = recv if use_fp8 else (recv, None)
    src_info, layout_range = handle[0], handle[1]
    same(f"{tag} recv_count", count, rf.count)
    cnt, begin = layout_range & 0xFFFFFFFF, layout_range >> 32
    same(f"{tag} per-source counts", cnt, rf.layout_range & 0xFFFFFFFF)
    if use_fp8:
        s = ref.ue8m0_unpack(scales) if ue8m0 else scales
        deq = (recv_x.float().view(el, R * T, H // 128, 128) * s.float().view(el, R * T, H // 128, 1)).view(el, R * T, H)
        deq = deq.to(torch.bfloat16)
    else:
        deq = recv_x
    for e in range(el):
        spans = sorted((int(begin[e, s]), int(cnt[e, s]), s) for s in range(R) if int(cnt[e, s]) > 0)
        at = 0
        for b, n_s, s in spans:  # the sources' chunks tile [0, count)
            assert b == at, f"{tag} expert {e}: chunk of source {s} starts at {b}, expected {at}"
            at += n_s
            toks = src_info[e, b:b + n_s].long()
            assert sorted(toks.tolist()) == sorted(rf.src_info[e][s]), f"{tag} expert {e} source {s}: tokens {toks.tolist()}"
            rows = inputs[s].x[toks]
            if not use_fp8:
                same(f"{tag} expert {e} rows from {s}", recv_x[e, b:b + n_s], rows)
                continue
            q, si = deepep_ll_quantize(rows, round_scale)
            same(f"{tag} expert {e} fp8 rows from {s}", recv_x[e, b:b + n_s], q)
            if ue8m0:
                same(f"{tag} expert {e} UE8M0 scales from {s}", scales[e, b:b + n_s], ref.ue8m0_pack(si))
            else:
                same(f"{tag} expert {e} scales from {s}", scales[e, b:b + n_s].contiguous(), si)
        assert at == int(count[e])
    # combine: expert g scales its rows; this rank's result is the fp32 sum over k ascending of
    # w * expert(g, the row of token t as dispatched), rounded to bf16 once
    y = torch.stack([expert_fn(rank * el + e, deq[e]) for e in range(el)])
    out, _, _ = buf.low_latency_combine(y, me.topk_idx, me.topk_weights, handle)
    x_deq = dequant_rows(*deepep_ll_quantize(me.x, round_scale)) if use_fp8 and me.x.shape[0] else me.x
    same(f"{tag} combined", out, ref.ll_combine(x_deq, me.topk_idx, me.topk_weights, expert_fn))
    return int(count.sum())


# ---------------------------------------------------------------------------------------------
# ranks

_BUFFERS = {}


def _buffers(world):
    """One normal and one low-latency buffer per rank process, kept across examples."""
    import deep_ep_rs
    import torch.distributed as dist

    if world not in _BUFFERS:
        ll_bytes = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, world, world * MAX_LOCAL_EXPERTS)
        _BUFFERS[world] = (deep_ep_rs.Buffer(dist.group.WORLD, 8 << 20, 0, device="cpu", explicitly_destroy=True),
                           deep_ep_rs.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True, device="cpu", explicitly_destroy=True))
    return _BUFFERS[world]


def fuzz_worker(rank, world, case):
    import deep_ep_rs

    normal, ll = _buffers(world)
    return run_normal(normal, deep_ep_rs, case, rank, world), run_ll(ll, case, rank, world)


def release_worker(rank, world):
    for b in _BUFFERS.pop(world, ()):
        b.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_fuzz_against_reference(rank_pool, world):
    moved = []

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=fuzz_case(world))
    def run(case):
        moved.append(rank_pool(world).run(fuzz_worker, case, timeout=120))

    try:
        run()
    finally:
        pool = rank_pool(world)
        if pool.alive:
            pool.run(release_worker)
    assert len(moved) == EXAMPLES
    # not vacuous: tokens moved in both modes
    assert sum(r[0] for rs in moved for r in rs) > 0 and sum(r[1] for rs in moved for r in rs) > 0
