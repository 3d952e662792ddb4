"""Low-latency dispatch -> expert -> combine through deep_ep_rs.Buffer (multi-process), with
DeepEP test_low_latency.py's checks plus exact comparisons with the pure-torch LL reference.

Skips (pytest.skip) while the CPU backend answers "not implemented yet"; the checks themselves
are validated now against an in-process reference buffer (test_ll_checks_accept_reference and
test_ll_checks_reject_wrong_results), so they are ready when LL lands.

Order-independent where DeepEP leaves the order free (rows of one source inside an expert are
compared as sets of source tokens); counts, layout ranges, stats and combine results are exact.
"""
import pytest
import torch

import _reference as ref
from conftest import is_not_implemented

T, H = 8, 512

MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-round": (True, True, False),
         "fp8-ue8m0": (True, True, True)}


def _case(**kw):
    c = dict(seed=0, tokens=None, topk=4, experts_per_rank=4, mode="bf16", x_kind="rank", dispatch_hook=False, repeat=1,
             combine="fused", idx_dtype="int64", stats=True, masked=3, after_normal=False, dispatch_weights=False)
    c.update(kw)
    return c


def ll_cases(world):
    R = world
    cs = [
        _case(name="bf16-full", tokens=[T] * R),
        _case(name="bf16-hook-twice-zero-copy", tokens=[T, 5, 7, 1][:R], dispatch_hook=True, repeat=2, combine="zero_copy"),
        _case(name="bf16-random-x-exact", tokens=[6] * R, x_kind="random", combine="out"),
        _case(name="bf16-random-x-logfmt", tokens=[T] * R, x_kind="random", combine="logfmt"),
        _case(name="bf16-combine-hook", tokens=[3, T, 0, 2][:R], combine="hook", idx_dtype="int32"),
        _case(name="fp8", tokens=[T] * R, mode="fp8", topk=3),
        _case(name="fp8-round", tokens=[7, 2, T, 4][:R], mode="fp8-round", combine="hook"),
        _case(name="fp8-ue8m0", tokens=[T] * R, mode="fp8-ue8m0", dispatch_hook=True, repeat=2),
        _case(name="fp8-logfmt-rank-valued", tokens=[5] * R, mode="fp8", combine="logfmt"),
        _case(name="zero-tokens-everywhere", tokens=[0] * R, stats=True),
        _case(name="one-token-topk1", tokens=[1] * R, topk=1, masked=0),
        _case(name="all-masked-rank0", tokens=[4] * R, masked=4 * 4),
        _case(name="topk9-many-experts", tokens=[T] * R, topk=9, experts_per_rank=10, masked=5),
        _case(name="after-normal-mode", tokens=[T] * R, after_normal=True),
        _case(name="no-stats", tokens=[T] * R, stats=False, combine="zero_copy"),
        # topk_weights given to the dispatch: the combine sends one partial sum per (token, rank)
        _case(name="partial-bf16-random", tokens=[T, 6, 0, 3][:R], x_kind="random", dispatch_weights=True),
        _case(name="partial-fp8-zero-copy-hook", tokens=[T] * R, mode="fp8-round", x_kind="random", dispatch_weights=True,
              combine="zero_copy", dispatch_hook=True, repeat=2),
        _case(name="partial-rank-valued-out", tokens=[5] * R, topk=9, experts_per_rank=10, dispatch_weights=True, combine="out"),
        _case(name="partial-logfmt-falls-back", tokens=[T] * R, x_kind="random", dispatch_weights=True, combine="logfmt"),
    ]
    for i, c in enumerate(cs):
        c["seed"] = 3 * world + 101 * i
    return cs


def max_experts(world):
    return world * max(c["experts_per_rank"] for c in ll_cases(world))


def gen_ll_input(case, s, world) -> ref.RankInput:
    g = torch.Generator().manual_seed(case["seed"] * 13 + s)
    n, k, e = case["tokens"][s], case["topk"], case["experts_per_rank"] * world
    if case["x_kind"] == "rank":  # DeepEP's pattern: rank - 128 everywhere, the last 128 columns = token index
        x = torch.ones((n, H), dtype=torch.bfloat16) * (s - 128)
        x[:, -128:] = torch.arange(n, dtype=torch.bfloat16).view(-1, 1)
    else:
        # small values: LogFMT encodes chunks whose amax < 1 (larger ones travel as raw BF16)
        x = (torch.randn((n, H), generator=g) * 0.1).to(torch.bfloat16)
    idx = torch.topk(torch.rand((n, e), generator=g) + 1, k, dim=-1, sorted=True).indices if n else torch.zeros((0, k), dtype=torch.int64)
    if case["name"].startswith("all-masked") and s == 0:
        idx[:] = -1
    elif n and case["masked"]:
        for _ in range(case["masked"]):
            idx[int(torch.randint(0, n, (1,), generator=g)), int(torch.randint(0, k, (1,), generator=g))] = -1
    w = torch.randn((n, k), generator=g).abs()
    idx = idx.to(torch.int32 if case["idx_dtype"] == "int32" else torch.int64).contiguous()
    return ref.RankInput(x=x, topk_idx=idx, topk_weights=w)


def expert_fn(g, rows):
    """Expert g's output for its input rows (bf16): a per-expert scaling, so routing errors show."""
    return (rows.float() * (1.0 + g / 8.0)).to(torch.bfloat16)


def dequantized(recv_x, scales, mode):
    if not MODES[mode][0]:
        return recv_x
    el, rows, h = recv_x.shape
    s = ref.ue8m0_unpack(scales) if MODES[mode][2] else scales
    return (recv_x.float().view(el, rows, h // 128, 128) * s.float().view(el, rows, h // 128, 1)).view(el, rows, h).to(torch.bfloat16)


def check_ll_case(buf, case, rank, world, normal_fn=None):
    """Runs one case on `buf` (a deep_ep_rs.Buffer or a compatible object) and checks it."""
    R, E_l = world, case["experts_per_rank"]
    E = E_l * R
    use_fp8, round_scale, ue8m0 = MODES[case["mode"]]
    inputs = [gen_ll_input(case, s, R) for s in range(R)]
    me = inputs[rank]
    rf = ref.ll_dispatch(inputs, rank, E, use_fp8, round_scale)
    tag = f"[{case['name']} rank {rank}]"
    if case["after_normal"] and normal_fn is not None:
        normal_fn()
        buf.clean_low_latency_buffer(T, H, E)
    stats = torch.zeros((E_l,), dtype=torch.int32) if case["stats"] else None
    wait = torch.zeros((R,), dtype=torch.int64) if case["stats"] else None
    for _ in range(case["repeat"]):
        recv, count, handle, event, hook = buf.low_latency_dispatch(
            me.x, me.topk_idx, T, E, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=case["dispatch_hook"],
            topk_weights=me.topk_weights if case["dispatch_weights"] else None)
        assert (hook is not None) == case["dispatch_hook"]
        if hook is not None:
            hook()
    rows = R * T
    if use_fp8:
        recv_x, scales = recv
        assert recv_x.dtype == torch.float8_e4m3fn and recv_x.shape == (E_l, rows, H)
        cols, dt = (H // 512, torch.int32) if ue8m0 else (H // 128, torch.float32)
        assert scales.dtype == dt and scales.shape == (E_l, rows, cols), f"{tag} scales {scales.dtype} {tuple(scales.shape)}"
        want_strides = (rows * cols, 1, rows)
        assert all(st == w or sz == 1 for st, w, sz in zip(scales.stride(), want_strides, scales.shape)), \
            f"{tag} scales must be column-major (strides {want_strides}), got {scales.stride()}"
    else:
        recv_x, scales = recv, None
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (E_l, rows, H)
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (T, H, E), f"{tag} handle tail {handle[2:]}"
    assert src_info.dtype == torch.int32 and src_info.shape == (E_l, rows)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (E_l, R)
    assert count.dtype == torch.int32 and count.shape == (E_l,)
    assert torch.equal(count, rf.count), f"{tag} recv_count {count.tolist()} != {rf.count.tolist()}"
    if stats is not None:
        assert torch.equal(stats, rf.count * case["repeat"]), f"{tag} cumulative stats {stats.tolist()}"
        assert bool((wait >= 0).all())
    cnt, begin = layout_range & 0xFFFFFFFF, layout_range >> 32
    assert torch.equal(cnt, rf.layout_range & 0xFFFFFFFF), f"{tag} per-source counts {cnt.tolist()}"
    deq = dequantized(recv_x, scales, case["mode"])
    exact = case["mode"] in ("bf16", "fp8")  # rank-valued FP8 without rounding is exact (DeepEP checks it exactly too)
    for e in range(E_l):
        c = int(count[e])
        assert int(cnt[e].sum()) == c
        spans = sorted((int(begin[e, s]), int(cnt[e, s]), s) for s in range(R) if int(cnt[e, s]) > 0)
        at = 0
        for b, n_s, s in spans:  # the chunks tile [0, count) without gaps or overlaps
            assert b == at, f"{tag} expert {e}: chunk of source {s} starts at {b}, expected {at}"
            at += n_s
            toks = src_info[e, b:b + n_s]
            assert sorted(toks.tolist()) == sorted(rf.src_info[e][s]), f"{tag} expert {e} source {s}: tokens {toks.tolist()}"
            src_deq = deq[e, b:b + n_s]
            want = inputs[s].x[toks.long()]
            if use_fp8:
                q, si = ref.ll_quantize(want, round_scale)
                want_deq = ref.ll_dequantize(q, si)
                if ue8m0:
                    assert torch.equal(scales[e, b:b + n_s], ref.ue8m0_pack(si)), f"{tag} UE8M0 scales"
                elif round_scale:
                    sc = scales[e, b:b + n_s]
                    assert torch.equal(sc, torch.pow(2.0, torch.round(torch.log2(sc)))), f"{tag} round_scale scales must be powers of 2"
            else:
                want_deq = want
            if exact:
                assert torch.equal(src_deq, want), f"{tag} expert {e} source {s}: rows differ"
            else:
                assert torch.equal(src_deq, want_deq) or ref.calc_diff(src_deq, want) < 7e-3, f"{tag} expert {e} source {s}: rows differ"
            if case["x_kind"] == "rank" and exact:  # DeepEP's own pattern checks
                assert bool((src_deq[:, :-128] == s - 128).all())
                assert torch.equal(src_deq[:, -128:].float(), toks.float().view(-1, 1).expand(-1, 128))
        assert at == c

    # experts and combine
    y = torch.stack([expert_fn(rank * E_l + e, deq[e]) for e in range(E_l)]) if E_l else deq
    x_deq = me.x
    if use_fp8 and me.x.shape[0]:
        x_deq = ref.ll_dequantize(*ref.ll_quantize(me.x, round_scale))
    want = ref.ll_combine(x_deq, me.topk_idx, me.topk_weights, expert_fn)
    cwait = torch.zeros((R,), dtype=torch.int64) if case["stats"] else None
    kind = case["combine"]
    out_arg = torch.empty((me.x.shape[0], H), dtype=torch.bfloat16) if kind == "out" else None
    if kind == "zero_copy":
        view = buf.get_next_low_latency_combine_buffer(handle)
        m = H + H // 128 * 2
        assert view.shape == (E_l, rows, H) and view.stride() == (rows * m, m, 1) and view.dtype == torch.bfloat16
        view[:, :, :] = y
    out, event, chook = buf.low_latency_combine(y, me.topk_idx, me.topk_weights, handle, use_logfmt=kind == "logfmt",
                                                zero_copy=kind == "zero_copy", return_recv_hook=kind == "hook", out=out_arg,
                                                combine_wait_recv_cost_stats=cwait)
    assert (chook is not None) == (kind == "hook")
    if chook is not None:
        chook()
    if out_arg is not None:
        assert out.data_ptr() == out_arg.data_ptr(), f"{tag} combine must write into out="
    assert out.shape == (me.x.shape[0], H) and out.dtype == torch.bfloat16
    assert not bool(out.isnan().any())
    if case["dispatch_weights"] and kind != "logfmt":
        # Partial sums: exact against their reference, and within DeepEP's combine tolerance
        # (calc_diff < 1e-5) of the float reference despite the extra BF16 rounding of each
        # rank's partial sum (measured here up to ~5e-6, per-expert sums ~3e-6).
        partial = ref.ll_combine_partial(x_deq, me.topk_idx, me.topk_weights, expert_fn, E_l, R)
        assert torch.equal(out, partial), f"{tag} partial combine differs by {(out.float() - partial.float()).abs().max()}"
        f64 = ref.ll_combine_f64(x_deq, me.topk_idx, me.topk_weights, expert_fn)
        assert me.x.shape[0] == 0 or ref.calc_diff(out, f64) < 1e-5, f"{tag} partial combine vs the float reference: diff {ref.calc_diff(out, f64)}"
    elif kind == "logfmt" and case["x_kind"] == "random":
        assert ref.calc_diff(out, want) < 1e-3, f"{tag} LogFMT combine diff {ref.calc_diff(out, want)}"
    elif exact:
        assert torch.equal(out, want), f"{tag} combined_x differs from the reference (fp32 sum over k ascending)"
    else:
        assert ref.calc_diff(out, want) < 9e-4, f"{tag} combined diff {ref.calc_diff(out, want)}"
    if cwait is not None:
        assert bool((cwait >= 0).all())
    return int(count.sum())


def _normal_roundtrip(buf, rank, world):
    """A small normal-mode dispatch/combine on the same buffer (DeepEP's LL-compatibility scenario)."""
    import deep_ep_rs

    g = torch.Generator().manual_seed(rank)
    x = torch.randn((5, 64), generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand((5, 2 * world), generator=g), 2, dim=-1).indices
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 2 * world)
    cfg = deep_ep_rs.Config(4, 6, 256, 6, 128)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                              config=cfg)
    out, _, _ = buf.combine(recv_x, handle, config=cfg)
    want = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
    assert torch.equal(out, want)


def ll_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    E = max_experts(world)
    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, E) // 128) * 128
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, nbytes, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    try:
        total = 0
        for case in ll_cases(world):
            try:
                total += check_ll_case(buf, case, rank, world, normal_fn=lambda: _normal_roundtrip(buf, rank, world))
            except RuntimeError as e:
                if is_not_implemented(e):
                    pytest.skip(f"low-latency mode not implemented on this backend yet: {e}")
                raise
        return total
    finally:
        buf.destroy()


@pytest.mark.lowlatency
@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_roundtrip(rank_pool, world):
    totals = rank_pool(world).run(ll_worker)
    assert all(t > 0 for t in totals)


# ---------------------------------------------------------------------------------------------
# the checks above, validated against an in-process reference buffer (1 rank)


class ReferenceLLBuffer:
    """A 1-rank stand-in for Buffer's LL methods built on _reference (order: token ascending)."""

    def __init__(self, corrupt=None):
        self.corrupt = corrupt
        self._zero_copy = None

    def clean_low_latency_buffer(self, *a):
        pass

    def low_latency_dispatch(self, x, topk_idx, t, e, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False,
                             topk_weights=None):
        self._fma = topk_weights is not None  # one rank: the partial sum is the fma chain over k
        inp = ref.RankInput(x=x, topk_idx=topk_idx, topk_weights=torch.zeros(topk_idx.shape))
        rf = ref.ll_dispatch([inp], 0, e, use_fp8, round_scale)
        el, rows, h = e, t, x.shape[1]
        recv = torch.zeros((el, rows, h), dtype=torch.bfloat16)
        src_info = torch.full((el, rows), -1, dtype=torch.int32)
        for i in range(el):
            toks = rf.src_info[i][0]
            recv[i, :len(toks)] = x[toks] if toks else x[:0]
            src_info[i, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        count = rf.count.clone()
        if self.corrupt == "count":
            count[0] += 1
        if self.corrupt == "row" and int(count[0]) > 0:
            recv[0, 0] = recv[0, 0] + 1
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += count
        if use_fp8:
            flat = recv.view(-1, h)
            q, s = ref.ll_quantize(flat, round_scale)
            s = s.view(el, rows, -1)
            scales = (ref.ue8m0_pack(s.view(-1, s.shape[-1])).view(el, rows, -1) if use_ue8m0 else s)
            scales = scales.transpose(1, 2).contiguous().transpose(1, 2)  # column-major as DeepEP
            out = (q.view(el, rows, h), scales)
        else:
            out = recv
        handle = (src_info, rf.layout_range.clone(), t, h, e)
        hook = (lambda: None) if return_recv_hook else None
        return out, count, handle, None, hook

    def get_next_low_latency_combine_buffer(self, handle):
        src_info, layout_range, t, h, e = handle
        m = h + h // 128 * 2
        self._zero_copy = torch.zeros((e * t * m,), dtype=torch.bfloat16).as_strided((e, t, h), (t * m, m, 1))
        return self._zero_copy

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
                            return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        src_info, layout_range, t, h, e = handle
        y = self._zero_copy if zero_copy else x
        res = torch.zeros((topk_idx.shape[0], h), dtype=torch.float32)
        for k in range(topk_idx.shape[1]):
            for n in range(topk_idx.shape[0]):
                g = int(topk_idx[n, k])
                if g >= 0:
                    row = int((src_info[g] == n).nonzero()[0])
                    if self._fma:
                        res[n] = (y[g, row].double() * float(topk_weights[n, k]) + res[n].double()).float()
                    else:
                        res[n] = res[n] + topk_weights[n, k] * y[g, row].float()
        res = res.to(torch.bfloat16)
        if out is not None:
            out.copy_(res)
            res = out
        return res, None, ((lambda: None) if return_recv_hook else None)


def test_ll_checks_accept_reference():
    total = 0
    for case in ll_cases(1):
        if case["after_normal"]:
            continue
        total += check_ll_case(ReferenceLLBuffer(), case, 0, 1)
    assert total > 0


@pytest.mark.parametrize("corrupt", ["count", "row"])
def test_ll_checks_reject_wrong_results(corrupt):
    case = ll_cases(1)[0]
    with pytest.raises(AssertionError):
        check_ll_case(ReferenceLLBuffer(corrupt=corrupt), case, 0, 1)


def geometry_change_worker(rank, world):
    """Regression: rank 0 is slow to receive a combine while rank 1 already dispatches with more
    experts, whose signal words (at other offsets) used to overwrite the combine flags rank 0
    waited on (a timeout). A geometry change now makes the ranks meet first."""
    import time

    import deep_ep_rs
    import torch.distributed as dist

    nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, 40 * world) // 128) * 128
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    try:
        x = torch.ones((T, H), dtype=torch.bfloat16) * (rank + 1)
        for e in (4 * world, 40 * world, 4 * world):
            idx = torch.arange(T * 2).view(T, 2) % e
            w = torch.ones((T, 2))
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, e, use_fp8=False)
            out, _, hook = buf.low_latency_combine(recv, idx, w, handle, return_recv_hook=True)
            if rank == 0:
                time.sleep(0.5)  # the peer moves on to the next geometry meanwhile
            hook()
            assert torch.equal(out, x * 2), f"combine with {e} experts"
    finally:
        buf.destroy()


@pytest.mark.lowlatency
def test_geometry_change_while_a_peer_still_receives(rank_pool):
    rank_pool(2).run(geometry_change_worker, timeout=60)


@pytest.mark.parametrize("logfmt", [False, True])
def test_a_whole_hook_gives_the_split_hooks_results(deep_ep, group, logfmt):
    """The Python branch a one-rank GPU buffer takes (its hook-mode calls run the whole op, as
    buffer_info's last value says), forced on a one-rank CPU buffer, against the split ops of the
    same calls: the same outputs bit for bit, and a hook that has nothing left to do."""
    t, h, e, k = 8, 512, 8, 4
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(t, h, 1, e), low_latency_mode=True, device="cpu",
                         explicitly_destroy=True)
    try:
        assert buf._ll_whole_hooks is False  # a CPU buffer keeps its hooks apart
        g = torch.Generator().manual_seed(11)
        x = (torch.randn((t, h), generator=g) * 0.1).to(torch.bfloat16)
        idx = torch.topk(torch.rand((t, e), generator=g), k, dim=-1).indices
        w = torch.rand((t, k), generator=g)
        got = {}
        for whole in (False, True):
            buf._ll_whole_hooks = whole
            rx, count, handle, _, hook = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, return_recv_hook=True)
            assert (hook.__name__ == "_received") == whole
            hook()
            out, _, chook = buf.low_latency_combine(rx * 0.5, idx, w, handle, use_logfmt=logfmt, return_recv_hook=True)
            assert (chook.__name__ == "_received") == whole
            chook()
            got[whole] = [rx.clone(), count.clone(), handle[0].clone(), handle[1].clone(), out.clone()]
        for a, b in zip(got[False], got[True]):
            assert torch.equal(a, b)
        assert got[True][-1].abs().sum() > 0
    finally:
        buf.destroy()
