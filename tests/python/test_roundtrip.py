"""Multi-process dispatch -> combine through deep_ep_rs.Buffer on the CPU backend, compared
bit-exactly with the independent pure-torch reference in _reference.py.

One pool of ranks per rank count (2, 3, 4) runs every configuration in a loop. Every rank
regenerates every rank's inputs from the case seed, so each computes the full reference alone.
"""
import os
import random

import pytest
import torch

import _reference as ref

NVL_BYTES = 32 << 20
NVL_CHUNKS = (6, 256, 6, 128)


# ---------------------------------------------------------------------------------------------
# cases


def _case(**kw):
    c = dict(seed=0, tokens=None, hidden=64, topk=4, experts=8, idx_dtype="int64", mode="bf16", with_topk=True,
             mask_prob=0.0, routing="random", align=1, worst=False, num_sms=20, bias=0, combine_weights=True,
             cached_fp8=False, wide=False)
    c.update(kw)
    return c


def cases_for(world: int):
    """Explicit edge cases plus a deterministic random sweep; identical on every rank."""
    R = world
    cs = [
        _case(name="zero-tokens-everywhere", tokens=[0] * R, worst=True, bias=2),
        _case(name="zero-tokens-on-rank0", tokens=[0] + [9] * (R - 1), worst=True, bias=1),
        _case(name="one-token", tokens=[1] * R, topk=1, experts=R, worst=True),
        _case(name="one-token-rank-last", tokens=[0] * (R - 1) + [1], topk=2, experts=2 * R, bias=2),
        _case(name="all-masked", tokens=[7] * R, routing="allmasked", worst=True, bias=1),
        _case(name="rank0-only-routing", tokens=[13, 5, 0, 22][:R], routing="rank0only", experts=4 * R, worst=True),
        _case(name="masked-30pct-int32", tokens=[20] * R, mask_prob=0.3, idx_dtype="int32", worst=True, bias=2),
        _case(name="no-topk", tokens=[17] * R, with_topk=False, combine_weights=False, bias=1),
        _case(name="no-topk-fp8", tokens=[11] * R, with_topk=False, mode="fp8_f32", hidden=256, combine_weights=False),
        _case(name="hidden8-topk9-64experts", tokens=[31] * R, hidden=8, topk=9, experts=64 - 64 % R, worst=True),
        _case(name="hidden24", tokens=[19, 23, 2, 40][:R], hidden=24, topk=3, experts=6 * R),
        _case(name="hidden136", tokens=[12] * R, hidden=136, topk=5, experts=5 * R, mask_prob=0.2, bias=2),
        _case(name="hidden1000", tokens=[9, 0, 14, 3][:R], hidden=1000, topk=2, experts=2 * R, worst=True),
        _case(name="fp8-f32-scales", tokens=[25] * R, mode="fp8_f32", hidden=384, topk=6, experts=16 * R // 2, worst=True),
        _case(name="fp8-ue8m0-scales", tokens=[21, 8, 30, 1][:R], mode="fp8_ue8m0", hidden=1024, topk=4, worst=True,
              idx_dtype="int32"),
        _case(name="fp8-hidden16", tokens=[10] * R, mode="fp8_f32", hidden=16, topk=2),
        _case(name="align4", tokens=[30] * R, align=4, mask_prob=0.1),
        _case(name="align7-worst", tokens=[30] * R, align=7, worst=True),
        _case(name="align128", tokens=[50] * R, align=128, experts=4 * R),
        _case(name="num_sms2", tokens=[33] * R, num_sms=2, bias=1),
        _case(name="num_sms4-cached-fp8", tokens=[41] * R, num_sms=4, cached_fp8=True),
        _case(name="num_sms48-more-channels-than-tokens", tokens=[5, 70, 1, 9][:R], num_sms=48, worst=True),
        _case(name="num_sms24-uneven", tokens=[100, 3, 57, 0][:R], num_sms=24, topk=8, experts=16 * R // 2, bias=2),
        _case(name="no-combine-weights", tokens=[12] * R, combine_weights=False, bias=2),
        # values spanning 2^-3..2^25: fp32 sums are order-sensitive, so the summation order
        # (bias_0, bias_1, then destination ranks ascending) is observable bit-exactly
        _case(name="wide-values-order", tokens=[48] * R, topk=6, experts=2 * R, bias=2, wide=True, worst=True),
        _case(name="wide-values-order-nobias", tokens=[48] * R, topk=5, experts=3 * R, bias=0, wide=True, mode="fp8_f32",
              hidden=128),
    ]
    rnd = random.Random(1000 + R)
    for i in range(26):
        topk = rnd.randint(1, 9)
        experts = R * rnd.randint(max(1, -(-topk // R)), max(1, 64 // R))
        mode = rnd.choice(["bf16", "bf16", "fp8_f32", "fp8_ue8m0"])
        hidden = rnd.choice([8, 24, 64, 136, 264, 1000]) if mode == "bf16" else rnd.choice([16, 128, 384, 512, 1024])
        cs.append(_case(
            name=f"random-{i}", tokens=[rnd.choice([0, 1, 2, 5, 17, 40, 63, 128]) for _ in range(R)], hidden=hidden, topk=topk,
            experts=experts, idx_dtype=rnd.choice(["int32", "int64"]), mode=mode, with_topk=rnd.random() < 0.85,
            mask_prob=rnd.choice([0.0, 0.0, 0.15, 0.5, 0.9]), routing=rnd.choice(["random"] * 6 + ["rank0only"]),
            align=rnd.choice([1, 1, 2, 3, 16]), worst=rnd.random() < 0.5, num_sms=rnd.choice([2, 4, 8, 20, 24, 34]),
            bias=rnd.randint(0, 2), combine_weights=rnd.random() < 0.8, cached_fp8=rnd.random() < 0.3))
    only = os.environ.get("DEEP_EP_TEST_ONLY")  # debugging aid: run only cases whose name contains it
    for i, c in enumerate(cs):
        c["seed"] = 7919 * world + i
        if not c["with_topk"]:
            c["worst"] = False  # num_worst_tokens requires top-k (as DeepEP)
            c["combine_weights"] = False
        c["experts"] = max(R, c["experts"] // R * R)
        while c["experts"] < c["topk"]:
            c["experts"] += R
        assert c["experts"] % R == 0 and c["experts"] >= c["topk"], c
    return [c for c in cs if only in c["name"]] if only else cs


# ---------------------------------------------------------------------------------------------
# inputs (deterministic per (case, rank))


def gen_input(case, s, world) -> ref.RankInput:
    g = torch.Generator().manual_seed(case["seed"] * 131 + s)
    n, h, k, e = case["tokens"][s], case["hidden"], case["topk"], case["experts"]
    el = e // world
    scores = torch.rand((n, e), generator=g)
    idx = torch.topk(scores, k, dim=1, sorted=False).indices if n else torch.zeros((0, k), dtype=torch.int64)
    if case["routing"] == "allmasked":
        idx = torch.full_like(idx, -1)
    elif case["routing"] == "rank0only":
        idx = torch.where(idx < el, idx, torch.full_like(idx, -1))
    if case["mask_prob"] > 0:
        idx = torch.where(torch.rand(idx.shape, generator=g) < case["mask_prob"], torch.full_like(idx, -1), idx)
    idx = idx.to(torch.int32 if case["idx_dtype"] == "int32" else torch.int64).contiguous()
    weights = torch.randn((n, k), generator=g, dtype=torch.float32)
    if case["mode"] == "bf16":
        return ref.RankInput(x=torch.randn((n, h), generator=g).to(torch.bfloat16), topk_idx=idx, topk_weights=weights)
    x = (torch.randn((n, h), generator=g) * 8).to(torch.float8_e4m3fn)
    if case["mode"] == "fp8_f32":
        scales = torch.rand((-(-h // 128), n), generator=g).T  # column-major, as DeepEP's test
    else:
        scales = torch.randint(-2 ** 31, 2 ** 31 - 1, (-(-h // 512), n), generator=g, dtype=torch.int64).to(torch.int32).T
    return ref.RankInput(x=x, topk_idx=idx, topk_weights=weights, x_scales=scales)


def gen_fp8(case, s, n, salt):
    """An FP8 x with float32 column-major scales (cached dispatch of FP8 through a BF16 handle)."""
    g = torch.Generator().manual_seed(case["seed"] * 977 + s * 13 + salt)
    h = case["hidden"] if case["hidden"] % 16 == 0 else 16
    x = (torch.randn((n, h), generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.rand((-(-h // 128), n), generator=g).T
    return x, scales


def gen_like(case, s, like, salt):
    g = torch.Generator().manual_seed(case["seed"] * 7 + s * 1009 + salt)
    if like.dtype == torch.bfloat16:
        return torch.randn(like.shape, generator=g).to(torch.bfloat16)
    if like.dtype == torch.float32:
        return torch.randn(like.shape, generator=g)
    if like.dtype == torch.float8_e4m3fn:
        return (torch.randn(like.shape, generator=g) * 8).to(torch.float8_e4m3fn)
    raise AssertionError(like.dtype)


def _values(case, shape, g, dtype):
    if not case["wide"]:
        return torch.randn(shape, generator=g).to(dtype)
    exps = torch.tensor([-3.0, 0.0, 12.0, 25.0])[torch.randint(0, 4, shape, generator=g)]
    signs = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (signs * torch.pow(2.0, exps)).to(dtype)


def combine_inputs(case, d, num_recv, world):
    """Destination d's combine x [rows, H] bf16 and weights [rows, K] f32 (deterministic)."""
    g = torch.Generator().manual_seed(case["seed"] * 31 + d * 7 + 3)
    h = case["hidden"] if case["mode"] == "bf16" else max(8, case["hidden"] // 2 // 8 * 8)
    y = _values(case, (num_recv, h), g, torch.bfloat16)
    w = _values(case, (num_recv, case["topk"]), g, torch.float32) if case["combine_weights"] else None
    return y, w


def biases(case, rank, n, h):
    g = torch.Generator().manual_seed(case["seed"] * 17 + rank)
    return [_values(case, (n, h), g, torch.bfloat16) for _ in range(case["bias"])]


# ---------------------------------------------------------------------------------------------
# checks


def same(what, got, want):
    assert got is not None, f"{what}: got None"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: differs at {bad}\n got {got.flatten()[:16].tolist()}\nwant {want.flatten()[:16].tolist()}")


def check_dispatch(tag, out, rf: ref.DispatchRef, case, rows=None):
    recv_x, recv_idx, recv_w, lst, handle, event = out
    fp8 = case["mode"] != "bf16"
    if fp8:
        assert isinstance(recv_x, tuple), f"{tag}: FP8 dispatch must return (recv_x, recv_x_scales)"
        recv_x, recv_s = recv_x
    n_real = rf.num_recv
    rows = n_real if rows is None else rows
    assert recv_x.shape == (rows, rf.recv_x.shape[1]), f"{tag}: recv_x shape {tuple(recv_x.shape)}, want {(rows, rf.recv_x.shape[1])}"
    assert recv_x.is_contiguous()
    same(f"{tag}: recv_x", recv_x[:n_real], rf.recv_x)
    if fp8:
        assert recv_s.dtype == rf.recv_x_scales.dtype and recv_s.shape == (rows, rf.recv_x_scales.shape[1])
        assert recv_s.is_contiguous(), f"{tag}: recv_x_scales must be contiguous, strides {recv_s.stride()}"
        same(f"{tag}: recv_x_scales", recv_s[:n_real], rf.recv_x_scales)
    if case["with_topk"]:
        same(f"{tag}: recv_topk_idx", recv_idx[:n_real], rf.recv_topk_idx)
        same(f"{tag}: recv_topk_weights", recv_w[:n_real], rf.recv_topk_weights)
        assert recv_idx.shape[0] == rows and recv_w.shape[0] == rows
    else:
        assert recv_idx is None and recv_w is None, f"{tag}: top-k outputs without top-k inputs"
    rpm, cpm, rcpm, src_idx, in_rank, send_head = handle
    same(f"{tag}: rank_prefix_matrix", rpm, rf.rank_prefix_matrix)
    same(f"{tag}: channel_prefix_matrix", cpm, rf.channel_prefix_matrix)
    same(f"{tag}: recv_channel_prefix_matrix", rcpm, rf.recv_channel_prefix_matrix)
    same(f"{tag}: recv_src_idx", src_idx[:n_real], rf.recv_src_idx)
    assert src_idx.shape == (rows,)
    same(f"{tag}: is_token_in_rank (handle)", in_rank, rf.is_token_in_rank)
    same(f"{tag}: send_head", send_head, rf.send_head)
    assert event.event is None, "CPU buffers complete every op before returning"
    if rows == n_real:
        assert lst == rf.num_recv_tokens_per_expert_list, f"{tag}: per-expert list {lst} != {rf.num_recv_tokens_per_expert_list}"
    else:  # worst-case mode: no host sync, padding rows marked invalid (docs/OPS.md)
        assert lst == [], f"{tag}: worst-case dispatch must return an empty per-expert list, got {lst}"
        if case["with_topk"]:
            assert bool((recv_idx[n_real:] == -1).all()), f"{tag}: padding rows of recv_topk_idx must be -1"
        assert bool((src_idx[n_real:] == -1).all()), f"{tag}: padding rows of recv_src_idx must be -1"
    return handle


def run_case(buf, deep_ep, case, rank, world):
    E, R = case["experts"], world
    C = case["num_sms"] // 2
    cfg = deep_ep.Config(case["num_sms"], *NVL_CHUNKS)
    inputs = [gen_input(case, s, R) for s in range(R)]
    me = inputs[rank]
    refs = [ref.dispatch(inputs, d, E, C, case["align"]) for d in range(R)]
    rf = refs[rank]
    tag = f"[{case['name']} rank {rank}]"

    # layout
    ntpr, ntpr_rdma, ntpe, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    want = ref.layout(me.topk_idx, E, R)
    same(f"{tag} num_tokens_per_rank", ntpr, want[0])
    assert ntpr_rdma is None, "num_tokens_per_rdma_rank is None within one NVLink domain"
    same(f"{tag} num_tokens_per_expert", ntpe, want[1])
    same(f"{tag} is_token_in_rank", in_rank, want[2])

    xarg = (me.x, me.x_scales) if me.x_scales is not None else me.x
    topk = dict(topk_idx=me.topk_idx, topk_weights=me.topk_weights) if case["with_topk"] else {}
    layout_kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
    out = buf.dispatch(xarg, **layout_kw, **topk, expert_alignment=case["align"], config=cfg)
    handle = check_dispatch(f"{tag} dispatch", out, rf, case)
    recv_x = out[0][0] if isinstance(out[0], tuple) else out[0]

    worst_handle = None
    if case["worst"]:
        worst = sum(case["tokens"]) + 3  # more than any rank can receive
        wout = buf.dispatch(xarg, **layout_kw, **topk, expert_alignment=case["align"], num_worst_tokens=worst, config=cfg)
        worst_handle = check_dispatch(f"{tag} worst-case dispatch", wout, rf, case, rows=worst)
        wx = wout[0][0] if isinstance(wout[0], tuple) else wout[0]
        same(f"{tag} worst-case prefix equals the synced result", wx[:rf.num_recv], recv_x)

    # cached dispatch of a new x through the handle equals the non-cached result for that x
    x2 = gen_like(case, rank, me.x, salt=1)
    inputs2 = [ref.RankInput(x=gen_like(case, s, inputs[s].x, salt=1), topk_idx=inputs[s].topk_idx,
                             topk_weights=inputs[s].topk_weights, x_scales=inputs[s].x_scales) for s in range(R)]
    rf2 = ref.dispatch(inputs2, rank, E, C, case["align"])
    for hname, h in [("handle", handle), ("worst-case handle", worst_handle)]:
        if h is None:
            continue
        cout = buf.dispatch((x2, me.x_scales) if me.x_scales is not None else x2, handle=h, config=cfg)
        assert cout[1:5] == (None, None, None, None), f"{tag} cached dispatch returns (recv_x, None, None, None, None, event)"
        cx = cout[0]
        if me.x_scales is not None:
            cx, cs = cx
            same(f"{tag} cached recv_x_scales ({hname})", cs[:rf.num_recv], rf2.recv_x_scales)
        assert cx.shape[0] == h[3].shape[0]
        same(f"{tag} cached recv_x ({hname})", cx[:rf.num_recv], rf2.recv_x)
    if case["cached_fp8"]:
        fx = [gen_fp8(case, s, case["tokens"][s], salt=2) for s in range(R)]
        inputs3 = [ref.RankInput(x=fx[s][0], topk_idx=inputs[s].topk_idx, topk_weights=inputs[s].topk_weights, x_scales=fx[s][1])
                   for s in range(R)]
        rf3 = ref.dispatch(inputs3, rank, E, C, case["align"])
        (cx, cs), *_ = buf.dispatch(fx[rank], handle=handle, config=cfg)
        same(f"{tag} cached FP8 recv_x through a BF16 handle", cx, rf3.recv_x)
        same(f"{tag} cached FP8 recv_x_scales through a BF16 handle", cs, rf3.recv_x_scales)

    # combine
    ys = [combine_inputs(case, d, refs[d].num_recv, R) for d in range(R)]
    y, w = ys[rank]
    n, hy = me.x.shape[0], y.shape[1]
    bs = biases(case, rank, n, hy)
    bias = None if not bs else (bs[0] if len(bs) == 1 else (bs[0], bs[1]))
    want_x, want_w = ref.combine(refs, [t[0] for t in ys], rank, n, weights=[t[1] for t in ys] if w is not None else None,
                                 bias_0=bs[0] if bs else None, bias_1=bs[1] if len(bs) > 1 else None)
    cx, cw, ev = buf.combine(y, handle, topk_weights=w, bias=bias, config=cfg)
    same(f"{tag} combined_x", cx, want_x)
    if w is not None:
        same(f"{tag} combined_topk_weights", cw, want_w)
    else:
        assert cw is None
    assert ev.event is None
    # combine does not rewrite the handle (docs/OPS.md: the op is functional)
    same(f"{tag} send_head after combine", handle[5], rf.send_head)
    if case["with_topk"] and case["combine_weights"]:
        # recv weights summed back give the original weights of the valid selections, exactly
        cx2, cw2, _ = buf.combine(recv_x if case["mode"] == "bf16" else y, handle, topk_weights=out[2], config=cfg)
        valid = me.topk_idx >= 0
        same(f"{tag} recv_topk_weights combined back", cw2, torch.where(valid, me.topk_weights, torch.zeros_like(me.topk_weights)))
    if worst_handle is not None:
        pad = worst_handle[3].shape[0] - y.shape[0]
        g = torch.Generator().manual_seed(case["seed"] + 99)
        yw = torch.cat([y, torch.randn((pad, hy), generator=g).to(torch.bfloat16)])
        ww = torch.cat([w, torch.randn((pad, w.shape[1]), generator=g)]) if w is not None else None
        wx, wwout, _ = buf.combine(yw, worst_handle, topk_weights=ww, bias=bias, config=cfg)
        same(f"{tag} combined_x through the worst-case handle", wx, want_x)
        if w is not None:
            same(f"{tag} combined_topk_weights through the worst-case handle", wwout, want_w)
    return rf.num_recv


def deepep_style_check(buf, deep_ep, rank, world, num_tokens=96, hidden=256, num_topk=4, num_experts=None):
    """DeepEP test_intranode.py's own checks with rank-valued x and weights (no masking)."""
    E = num_experts or 8 * world
    g = torch.Generator().manual_seed(4242 + rank)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    scores = torch.randn((num_tokens, E), generator=g).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    gbl_ntpr = ntpr.clone()
    torch.distributed.all_reduce(gbl_ntpr)
    gbl_ntpe = ntpe.clone()
    torch.distributed.all_reduce(gbl_ntpe)
    cfg = deep_ep.Config(24, 8, 256)
    recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                                           topk_weights=topk_weights, config=cfg)
    assert recv_x.size(0) == int(gbl_ntpr[rank])
    assert lst == gbl_ntpe.view(world, -1)[rank].tolist()
    assert bool((recv_x.amin(dim=1) == recv_x.amax(dim=1)).all()), "rows of rank-valued x must be constant"
    rpm = handle[0]
    for i in range(world):
        lo = 0 if i == 0 else int(rpm[i - 1][rank])
        assert bool((recv_x[lo:int(rpm[i][rank])] == i).all()), f"rows from rank {i} must equal {i}"
    el = E // world
    assert bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < el))).all())
    for i in range(el):
        assert int((recv_idx == i).sum()) == lst[i]
    w = recv_w.clone()
    w[recv_idx == -1] = w.amax(dim=1, keepdim=True).expand_as(w)[recv_idx == -1]
    for i in range(world):
        lo = 0 if i == 0 else int(rpm[i - 1][rank])
        assert bool((w[lo:int(rpm[i][rank])] == i).all())
    combined_x, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=deep_ep.Config(24, 8, 256))
    check_x = combined_x.float() / in_rank.sum(dim=1).unsqueeze(1).float()
    diff = ref.calc_diff(check_x, x)
    assert diff < 5e-6, f"calc_diff {diff}"
    assert ref.calc_diff(combined_w, topk_weights) < 1e-9
    return int(recv_x.size(0))


def roundtrip_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    buf = deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, 0, device="cpu", explicitly_destroy=True)
    try:
        assert buf.rank == rank and buf.group_size == world
        summary = {"cases": 0, "rows": 0, "names": []}
        for case in cases_for(world):
            summary["rows"] += run_case(buf, deep_ep_rs, case, rank, world)
            summary["cases"] += 1
            summary["names"].append(case["name"])
        summary["deepep_rows"] = deepep_style_check(buf, deep_ep_rs, rank, world)
        return summary
    finally:
        buf.destroy()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_combine_roundtrip(rank_pool, world):
    results = rank_pool(world).run(roundtrip_worker)
    n_cases = len(cases_for(world))
    assert all(r["cases"] == n_cases for r in results)
    assert all(r["names"] == results[0]["names"] for r in results)
    # not vacuous: tokens really moved, and every rank received something somewhere
    if os.environ.get("DEEP_EP_TEST_ONLY"):
        return
    assert sum(r["rows"] for r in results) > 100 * world
    assert all(r["rows"] > 0 for r in results)
    assert all(r["deepep_rows"] > 0 for r in results)
