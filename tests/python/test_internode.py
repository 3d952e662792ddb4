"""Internode normal mode on the CPU backend (DEEPEP_BEHAVIOUR.md §1.9): ranks emulate several
NVLink domains with DEEP_EP_NVL_DOMAIN_SIZE (2 x 2, 2 x 4, 4 x 2). Every configuration is checked
against the pure-Python reference below (written from the spec, not from the library):

- receive order: by global source rank, then source token index (DeepEP's NVL receivers place
  rows at recv_gbl_rank_prefix_sum[src-1] + channel offset, channels being contiguous token
  ranges); the RDMA leg (send_nvl_head rows): by source domain, then token;
- the 10-tensor handle, shapes, dtypes and values;
- combine: bf16((f32 bias_0 + f32 bias_1) + Σ_{domain j reached, asc} f32(bf16(Σ_{local rank asc} f32 row)));
  plus the closed form (identity expert on integer rows: x times the ranks the token reached).

DEEP_EP_INTERNODE_CASES sets the number of random configurations per layout (default 40; three
layouts, so 120 in CI).
"""
import os

import pytest
import torch
import torch.distributed as dist

import _reference as ref
from _harness import env_var

NVL_BYTES = 16 << 20
RDMA_BYTES = 1 << 20
CASES = int(os.environ.get("DEEP_EP_INTERNODE_CASES", "40"))
LAYOUTS = [(4, 2), (8, 4), (8, 2), (4, 1)]  # (world, ranks per NVLink domain)
BF16 = torch.bfloat16


# ---- pure-Python reference ----------------------------------------------------------------------
def make_case(seed: int, world: int):
    """Parameters shared by all ranks of one configuration."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    fp8 = ri(0, 2) == 0
    hidden = [128, 256, 208][ri(0, 2)] if fp8 else [128, 200, 256, 72][ri(0, 3)]
    return {
        "seed": seed, "fp8": fp8, "hidden": hidden, "el": ri(1, 4), "topk": ri(1, 9), "int32": ri(0, 1) == 1,
        "num_sms": [2, 4, 6, 24][ri(0, 3)], "align": [1, 1, 4][ri(0, 2)], "bias": ri(0, 2), "weights": ri(0, 3) > 0,
        "tokens": [ri(0, 1) if ri(0, 4) == 0 else ri(2, 48) for _ in range(world)], "ue8m0": ri(0, 1) == 1,
    }


def rank_inputs(case, s: int, world: int):
    """Rank s's inputs of `case` (every rank can rebuild every rank's inputs)."""
    g = torch.Generator().manual_seed(case["seed"] * 1000 + s)
    n, h, k, e = case["tokens"][s], case["hidden"], case["topk"], case["el"] * world
    idx = torch.stack([torch.randperm(e, generator=g)[:k] if k <= e else torch.randint(0, e, (k,), generator=g)
                       for _ in range(n)]) if n else torch.empty((0, k), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    idx = idx.to(torch.int32 if case["int32"] else torch.int64)
    w = torch.rand((n, k), generator=g)
    x_bf = (torch.randn((n, h), generator=g) * 4).to(BF16)
    if case["fp8"]:
        x = torch.randint(0, 256, (n, h), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s_cols = max(1, h // 128)
        scales = torch.randint(100, 140, (n, s_cols), dtype=torch.int32, generator=g) if case["ue8m0"] \
            else torch.rand((n, s_cols), generator=g)
    else:
        x, scales = x_bf, None
    bias = [(torch.randn((n, h), generator=g)).to(BF16) for _ in range(case["bias"])]
    return {"x": x, "scales": scales, "x_bf": x_bf, "idx": idx, "w": w, "bias": bias}


def ref_all(case, world: int, d: int):
    """Reference dispatch of every rank: per rank its rows [(s, t)] and handle values."""
    e = case["el"] * world
    c = case["num_sms"] // 2
    rr = world // d
    ins = [rank_inputs(case, s, world) for s in range(world)]
    in_rank = [ref.layout(i["idx"], e, world)[2] for i in ins]
    chan = [ref.channel_ranges(i["idx"].shape[0], c) for i in ins]

    def per_chan(s, mask):  # inclusive prefix over channels of mask [n_s] bool
        return torch.tensor([int(mask[lo:hi].sum()) for lo, hi in chan[s]], dtype=torch.int32).cumsum(0).to(torch.int32)

    def node_mask(s, j):
        return in_rank[s][:, j * d:(j + 1) * d].any(dim=1)

    def counters(s, mask):  # per-channel slot counter of each selected token, -1 otherwise
        out = torch.full((mask.shape[0],), -1, dtype=torch.int32)
        for lo, hi in chan[s]:
            sel = torch.nonzero(mask[lo:hi]).flatten()
            out[lo + sel] = torch.arange(sel.numel(), dtype=torch.int32)
        return out

    outs = []
    for r in range(world):
        node, local = divmod(r, d)
        rows = [(s, t) for s in range(world) for t in range(ins[s]["idx"].shape[0]) if in_rank[s][t, r]]
        rdma_cpm = torch.stack([per_chan(r, node_mask(r, j)) for j in range(rr)])
        gbl_cpm = torch.stack([per_chan(r, in_rank[r][:, q]) for q in range(world)])
        send_rdma_head = torch.stack([counters(r, node_mask(r, j)) for j in range(rr)], dim=1) if rr else None
        recv_rdma_cpm = torch.stack([per_chan(i * d + local, node_mask(i * d + local, node)) for i in range(rr)])
        recv_rdma_rps = recv_rdma_cpm[:, -1].cumsum(0).to(torch.int32)
        nvl = []
        for i in range(rr):
            s = i * d + local
            m = node_mask(s, node)
            heads = [counters(s, in_rank[s][:, node * d + l]) for l in range(d)]
            for t in torch.nonzero(m).flatten().tolist():
                nvl.append([int(heads[l][t]) for l in range(d)] + [-1] * (8 - d))
        recv_gbl_rps = torch.tensor([int(in_rank[s][:, r].sum()) for s in range(world)], dtype=torch.int32).cumsum(0).to(torch.int32)
        recv_gbl_cpm = torch.zeros((world, c), dtype=torch.int32)
        for s in range(world):
            base = int(recv_gbl_rps[s - 1]) if s else 0
            p = per_chan(s, in_rank[s][:, r])
            recv_gbl_cpm[s] = base + torch.cat([torch.zeros(1, dtype=torch.int32), p[:-1]])
        meta = torch.zeros((len(rows), 8), dtype=torch.uint8)
        for row, (s, t) in enumerate(rows):
            bits = sum(1 << l for l in range(d) if in_rank[s][t, node * d + l])
            meta[row] = torch.tensor([s // d, bits], dtype=torch.int32).view(torch.uint8)
        outs.append({"rows": rows, "rdma_cpm": rdma_cpm, "gbl_cpm": gbl_cpm, "recv_rdma_cpm": recv_rdma_cpm,
                     "recv_rdma_rps": recv_rdma_rps, "recv_gbl_cpm": recv_gbl_cpm, "recv_gbl_rps": recv_gbl_rps,
                     "meta": meta, "send_rdma_head": send_rdma_head,
                     "send_nvl_head": torch.tensor(nvl, dtype=torch.int32).view(-1, 8)})
    return ins, in_rank, outs


def y_of(ins, rows, d_rank: int):
    """Expert output of rank d_rank for its received rows: the source's bf16 row times (1 + d/8)."""
    h = ins[0]["x_bf"].shape[1]
    if not rows:
        return torch.empty((0, h), dtype=BF16)
    return torch.stack([(ins[s]["x_bf"][t].float() * (1 + d_rank / 8)).to(BF16) for s, t in rows])


def ref_combine(ys, ws, outs, in_rank_me, bias, me: int, world: int, d: int, n: int, h: int, k: int):
    """Two-level combine of rank `me`'s tokens from every rank's rows `ys[q]` (spec §1.9 + DeepEP's
    forwarder: one bf16 partial per NVLink domain)."""
    # DeepEP's RDMA receiver: values = f32(bias_0) + f32(bias_1), an absent bias being +0 (one
    # addition: two -0 biases stay -0), then += each reached domain's bf16 partial.
    zero = torch.zeros((n, h), dtype=torch.float32)
    acc = (bias[0].float() if bias else zero) + (bias[1].float() if len(bias) > 1 else zero)
    acc_w = torch.zeros((n, k), dtype=torch.float32)
    for j in range(world // d):
        part = torch.zeros((n, h), dtype=torch.float32)
        part_w = torch.zeros((n, k), dtype=torch.float32)
        reached = torch.zeros(n, dtype=torch.bool)
        for q in range(j * d, (j + 1) * d):
            mask = in_rank_me[:, q]
            start = int(outs[q]["recv_gbl_rps"][me - 1]) if me else 0
            toks = torch.nonzero(mask).flatten()
            rows = start + torch.arange(toks.numel())
            part[toks] = part[toks] + ys[q][rows].float()
            if k:
                part_w[toks] = part_w[toks] + ws[q][rows]
            reached |= mask
        acc = torch.where(reached.unsqueeze(1), acc + part.to(BF16).float(), acc)  # unreached: no addition
        acc_w = acc_w + part_w
    return acc.to(BF16), acc_w


def same(what, got, want):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in (torch.float8_e4m3fn, BF16, torch.float32):
        got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert torch.equal(got, want), f"{what} differs"


# ---- one configuration on one rank ----------------------------------------------------------------
def run_case(buf, deep_ep, case, rank: int, world: int, d: int):
    ins, in_rank, outs = ref_all(case, world, d)
    me, o = ins[rank], outs[rank]
    e, k, h, el = case["el"] * world, case["topk"], case["hidden"], case["el"]
    rr = world // d
    ntpr, ntprr, ntpe, ir, _ = buf.get_dispatch_layout(me["idx"], e)
    want_ntpr, want_ntpe, want_ir = ref.layout(me["idx"], e, world)
    same("num_tokens_per_rank", ntpr, want_ntpr)
    same("num_tokens_per_expert", ntpe, want_ntpe)
    same("is_token_in_rank", ir, want_ir)
    same("num_tokens_per_rdma_rank", ntprr, torch.stack([want_ir[:, j * d:(j + 1) * d].any(dim=1).sum() for j in range(rr)]).to(torch.int32))
    cfg = deep_ep.Config(case["num_sms"], 6, 256, 6, 128)
    x_in = (me["x"], me["scales"]) if case["fp8"] else me["x"]
    w_in = me["w"] if case["weights"] else None
    idx_in = me["idx"] if case["weights"] else None
    recv, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
        x_in, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=ir, num_tokens_per_expert=ntpe,
        topk_idx=idx_in, topk_weights=w_in, expert_alignment=case["align"], config=cfg)
    rows = o["rows"]
    recv_x, recv_s = recv if case["fp8"] else (recv, None)
    want_x = torch.stack([ins[s]["x"][t] for s, t in rows]) if rows else me["x"].new_empty((0, h))
    same("recv_x", recv_x, want_x)
    if case["fp8"]:
        same("recv_x_scales", recv_s, torch.stack([ins[s]["scales"][t] for s, t in rows]) if rows else me["scales"].new_empty((0, me["scales"].shape[1])))
    per_expert = torch.zeros(el, dtype=torch.int64)
    for s in range(world):
        idx = ins[s]["idx"].long()
        for i in range(el):
            per_expert[i] += int((idx == rank * el + i).sum())
    a = case["align"]
    assert lst == [int(-(-v // a) * a) for v in per_expert.tolist()], "num_recv_tokens_per_expert_list"
    if case["weights"]:
        gidx = torch.stack([ins[s]["idx"][t] for s, t in rows]).long() if rows else torch.empty((0, k), dtype=torch.long)
        local = torch.where((gidx >= rank * el) & (gidx < (rank + 1) * el), gidx - rank * el, torch.full_like(gidx, -1))
        same("recv_topk_idx", recv_idx, local.to(me["idx"].dtype))
        gw = torch.stack([ins[s]["w"][t] for s, t in rows]) if rows else torch.empty((0, k))
        same("recv_topk_weights", recv_w, torch.where(local >= 0, gw, torch.zeros(())))
    else:
        assert recv_idx is None and recv_w is None
    # the handle: order, shapes, dtypes, values
    assert len(handle) == 10
    names = ["is_token_in_rank", "rdma_cpm", "gbl_cpm", "recv_rdma_cpm", "recv_rdma_rps", "recv_gbl_cpm", "recv_gbl_rps",
             "meta", "send_rdma_head", "send_nvl_head"]
    want_h = [ir] + [o[nm] for nm in names[1:]]
    for nm, got, want in zip(names, handle, want_h):
        same(f"handle.{nm}", got, want)
    # cached dispatch: same rows
    recv2, *_ = buf.dispatch(x_in, handle=handle, config=cfg)
    if case["fp8"]:
        same("cached recv_x", recv2[0], recv_x)
        same("cached recv_x_scales", recv2[1], recv_s)
    else:
        same("cached recv_x", recv2, recv_x)
    # combine of every rank's expert outputs, with bias and weights
    ys = [y_of(ins, outs[q]["rows"], q) for q in range(world)]
    ws = []
    for q in range(world):
        gw = torch.stack([ins[s]["w"][t] for s, t in outs[q]["rows"]]) if outs[q]["rows"] else torch.empty((0, k))
        gi = torch.stack([ins[s]["idx"][t] for s, t in outs[q]["rows"]]).long() if outs[q]["rows"] else torch.empty((0, k), dtype=torch.long)
        ws.append(torch.where((gi >= q * el) & (gi < (q + 1) * el), gw, torch.zeros(())))
    bias = me["bias"]
    b_arg = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    ccfg = deep_ep.Config(case["num_sms"], 4, 256, 6, 128)
    cx, cw, _ = buf.combine(ys[rank], handle, topk_weights=recv_w if case["weights"] else None, bias=b_arg, config=ccfg)
    n = me["idx"].shape[0]
    want_cx, want_cw = ref_combine(ys, ws, outs, in_rank[rank], bias, rank, world, d, n, h, k if case["weights"] else 0)
    same("combined_x", cx, want_cx)
    if case["weights"]:
        same("combined_topk_weights", cw, want_cw)
    else:
        assert cw is None
    return len(rows)


def closed_form(buf, deep_ep, rank: int, world: int, d: int):
    """Identity expert on integer rows: combined = x * (ranks the token reached) + bias, exactly."""
    g = torch.Generator().manual_seed(77 + rank)
    n, h, e = 40, 256, 4 * world
    idx = torch.randint(0, e, (n, 6), generator=g)
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    idx[::5] = -1  # tokens that reach no rank
    x = torch.randint(-8, 9, (n, h), generator=g).to(BF16)
    bias = torch.randint(-4, 5, (n, h), generator=g).to(BF16)
    ntpr, ntprr, ntpe, ir, _ = buf.get_dispatch_layout(idx, e)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=ir,
                                              num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=torch.ones(idx.shape))
    cx, _, _ = buf.combine(recv_x, handle, bias=bias)
    same("closed form", cx, (x.float() * ir.sum(dim=1, keepdim=True).float() + bias.float()).to(BF16))
    # Two -0 biases: DeepEP's RDMA receiver starts from -0 + -0 = -0 and adds only the partials of
    # the domains a token reached, so a token that reached no rank combines to -0 (bits 0x8000).
    nz = torch.full((n, h), -0.0, dtype=BF16)
    cz, _, _ = buf.combine(recv_x, handle, bias=(nz, nz))
    reached = ir.any(dim=1, keepdim=True)
    same("-0 biases", cz, torch.where(reached, x.float() * ir.sum(dim=1, keepdim=True).float(), torch.full((), -0.0)).to(BF16))
    return int(ir.any(dim=1).sum())


def internode_worker(rank, world, d, seeds):
    import deep_ep_rs

    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", d):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, RDMA_BYTES, device="cpu", explicitly_destroy=True)
        try:
            assert buf.get_num_rdma_ranks() == world // d
            rows = sum(run_case(buf, deep_ep_rs, make_case(s, world), rank, world, d) for s in seeds)
            return {"cases": len(seeds), "rows": rows, "closed": closed_form(buf, deep_ep_rs, rank, world, d)}
        finally:
            buf.destroy()


@pytest.mark.parametrize("world,d", LAYOUTS)
def test_internode_random(rank_pool, world, d):
    seeds = [1000 * world + 100 * d + i for i in range(CASES)]
    results = rank_pool(world).run(internode_worker, d, seeds)
    assert all(r["cases"] == CASES for r in results)
    assert sum(r["rows"] for r in results) > 10 * CASES, "tokens must really move"
    assert all(r["closed"] > 0 for r in results)


@pytest.mark.parametrize("world", [16] + [int(w) for w in os.environ.get("DEEP_EP_SCALE_WORLDS", "").split() if w != "16"])
def test_internode_random_full_nodes(rank_pool, world):
    """world ranks as world / 8 domains of 8 against the reference: 16 (2 x 8, DeepEP's smallest real
    internode topology, more ranks than the GPU backends hold today: docs/RANKS.md) in CI; 32 and 64
    (EP32, EP64: DeepSeek-V3-style decode and prefill scales) with make scale-cpu
    (DEEP_EP_SCALE_WORLDS), two cases each: one process per rank, so memory grows with the count."""
    d, cases = 8, max(2, CASES // 8) if world == 16 else 2
    seeds = [1000 * world + 100 * d + i for i in range(cases)]
    results = rank_pool(world).run(internode_worker, d, seeds)
    assert all(r["cases"] == cases for r in results)
    assert sum(r["rows"] for r in results) > 10 * cases, "tokens must really move"
    assert all(r["closed"] > 0 for r in results)


# ---- errors -------------------------------------------------------------------------------------
def errors_worker(rank, world):
    import deep_ep_rs

    out = {}
    # 4 ranks in one domain of 8: internode ops refuse, dispatch stays intranode.
    buf = deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, 0, device="cpu", explicitly_destroy=True)
    try:
        assert buf.get_num_rdma_ranks() == 1
        idx = torch.zeros((4, 1), dtype=torch.int64)
        ntpr, ntprr, ntpe, ir, _ = buf.get_dispatch_layout(idx, 8)
        assert ntprr is None
        with pytest.raises(RuntimeError, match="internode ops need ranks spanning several NVLink domains"):
            buf.internode_dispatch(torch.zeros((4, 128), dtype=BF16), num_tokens_per_rank=ntpr,
                                   num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32), is_token_in_rank=ir,
                                   num_tokens_per_expert=ntpe)
        out["intranode"] = True
    finally:
        buf.destroy()
    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", 2):
        with pytest.raises(RuntimeError, match="normal mode needs num_rdma_bytes > 0"):
            deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, 0, device="cpu")
        buf = deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, RDMA_BYTES, device="cpu", explicitly_destroy=True)
        try:
            g = torch.Generator().manual_seed(rank)
            idx = torch.randint(0, 8, (6, 2), generator=g)
            ntpr, ntprr, ntpe, ir, _ = buf.get_dispatch_layout(idx, 8)
            x = torch.randn((6, 128), generator=g).to(BF16)
            kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=ir, num_tokens_per_expert=ntpe, topk_idx=idx,
                      topk_weights=torch.ones(idx.shape))
            # a wrong per-domain count on one rank fails every rank
            bad = ntprr + (1 if rank == 1 else 0)
            with pytest.raises(RuntimeError, match="num_tokens_per_rdma_rank"):
                buf.dispatch(x, num_tokens_per_rdma_rank=bad, **kw)
            # worst-case rows too small
            with pytest.raises(RuntimeError, match="tokens over capacity"):
                buf.dispatch(x, num_tokens_per_rdma_rank=ntprr, num_worst_tokens=1 if rank == 0 else 100, **kw)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rdma_rank=ntprr, **kw)
            # worst-case mode: same first rows, padding ids -1, send_nvl_head padded with -1
            wx, widx, _, wl, wh, _ = buf.dispatch(x, num_tokens_per_rdma_rank=ntprr, num_worst_tokens=48, **kw)
            assert wl == [] and wx.shape[0] == 48 and wh[9].shape == (48, 8)
            same("worst rows", wx[:recv_x.shape[0]], recv_x)
            assert bool((widx[recv_x.shape[0]:] == -1).all()) and bool((wh[9][handle[9].shape[0]:] == -1).all())
            same("worst send_nvl_head", wh[9][:handle[9].shape[0]], handle[9])
            cw, _, _ = buf.combine(torch.cat([recv_x, torch.zeros((48 - recv_x.shape[0], 128), dtype=BF16)]), wh)
            c0, _, _ = buf.combine(recv_x, handle)
            same("combine through the worst-case handle", cw, c0)
            # an intranode 6-tuple is not an internode handle
            with pytest.raises(AssertionError, match="10-tensor"):
                buf.combine(recv_x, handle[:6])
            # a handle of another routing on one rank: stale, raised on every rank
            idx2 = torch.randint(0, 8, (6, 2), generator=torch.Generator().manual_seed(99 + rank))
            n2, nr2, ne2, ir2, _ = buf.get_dispatch_layout(idx2, 8)
            r2, _, _, _, h2, _ = buf.dispatch(x, num_tokens_per_rank=n2, num_tokens_per_rdma_rank=nr2, is_token_in_rank=ir2,
                                              num_tokens_per_expert=ne2, topk_idx=idx2, topk_weights=torch.ones(idx2.shape))
            mixed = h2 if rank == 0 else handle
            y = r2 if rank == 0 else recv_x
            with pytest.raises(RuntimeError, match="stale handle"):
                buf.combine(y, mixed)
            with pytest.raises(RuntimeError, match="stale handle"):
                buf.dispatch(x, handle=mixed)
            # the buffer still works after the errors
            c1, _, _ = buf.combine(recv_x, handle)
            same("combine after errors", c1, c0)
            out["internode"] = True
        finally:
            buf.destroy()
    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", 3):
        with pytest.raises(RuntimeError, match="do not fill NVLink domains"):
            deep_ep_rs.Buffer(dist.group.WORLD, NVL_BYTES, RDMA_BYTES, device="cpu")
    return out


def test_internode_errors(rank_pool):
    results = rank_pool(4).run(errors_worker)
    assert all(r == {"intranode": True, "internode": True} for r in results)


def test_layout_per_domain(ops):
    """get_dispatch_layout's num_tokens_per_rdma_rank follows DEEP_EP_NVL_DOMAIN_SIZE (local op)."""
    idx = torch.tensor([[0, 5], [-1, 3], [7, -1], [-1, -1]])
    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", 2):
        _, per_rdma, _, _ = ops.get_dispatch_layout(idx, 8, 4)
        assert per_rdma.tolist() == [2, 2]  # experts 0-3 on domain 0 (ranks 0, 1), 4-7 on domain 1
    _, per_rdma, _, _ = ops.get_dispatch_layout(idx, 8, 4)
    assert per_rdma.numel() == 0
    _, per_rdma, _, _ = ops.get_dispatch_layout(idx, 16, 16)
    assert per_rdma.tolist() == [3, 0]  # 16 ranks, D = 8: experts 0-7 on domain 0
