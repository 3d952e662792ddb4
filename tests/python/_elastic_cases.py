"""Rank workers of the ElasticBuffer (DeepEP V2 API) checks, shared by the CPU suite
(tests/python/test_elastic.py, gloo rank pools, cpu backend) and the GPU suite
(tests/gpu/test_elastic_gpu.py, one process per rank on `dev`).

Every worker takes (rank, world, dev) and returns a dict of what it checked; a failed check raises
AssertionError naming the configuration. Data are exact in bf16 and FP8 (small integers, weights
that are powers of two, experts that scale by 0.5, 1 or 1.5), so every sum is exact whatever its
order and results are compared bit for bit against the plain-torch reference (_reference_v2.py).
"""
import itertools
import random

import torch
import torch.distributed as dist

import _reference_v2 as ref

HIDDEN = 128
VALS = [0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 8.0]


def make_inputs(rank, n, k, num_experts, seed, minus_one=0.2, idx_dtype=torch.int64):
    """x [n, HIDDEN] bf16 of small integers (x[t, 0] = rank, x[t, 1] = t // 8, x[t, 2] = t % 8: exact
    in e4m3 too), topk_idx [n, k] distinct
    experts with about `minus_one` of the entries -1, topk_weights [n, k] in {0.25, 0.5, 1}."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    vals = torch.tensor(VALS)
    x = vals[torch.randint(0, len(VALS), (n, HIDDEN), generator=g)]
    t = torch.arange(n, dtype=torch.float32)
    x[:, 0], x[:, 1], x[:, 2] = float(rank), t // 8, t % 8
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]) if n else torch.zeros((0, k), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < minus_one] = -1
    w = torch.tensor([0.25, 0.5, 1.0])[torch.randint(0, 3, (n, k), generator=g)]
    return x.to(torch.bfloat16), idx.to(idx_dtype), w


def expert_scale(e):
    """The test experts: expert e (global id) multiplies its rows by 0.5, 1 or 1.5."""
    return 0.5 * (e % 3 + 1)


def fp8_pair(x):
    """(x as e4m3 [n, H], scales [n, H/128] f32 = 1): exact for the small integers of make_inputs."""
    return x.float().to(torch.float8_e4m3fn), torch.ones((x.shape[0], HIDDEN // 128), dtype=torch.float32, device=x.device)


def dequant(q, s):
    return (q.float() * s.float().repeat_interleave(128, dim=1)).to(torch.bfloat16)


def expected_combine(x, idx, w, num_experts, world, bias, weighted=True):
    """refs.combine of the test experts' outputs (each (token, k) row scaled by its expert and,
    when `weighted`, by its weight)."""
    n, k = idx.shape
    y = torch.zeros((n, k, x.shape[1]), dtype=torch.float32)
    for t, j in itertools.product(range(n), range(k)):
        e = int(idx[t, j])
        if e >= 0:
            y[t, j] = x[t].float() * expert_scale(e) * (float(w[t, j]) if weighted else 1.0)
    return ref.combine(y.to(torch.bfloat16), idx.long(), num_experts, world, bias)


def _eq(name, got, want):
    got = got.cpu() if got is not None else None
    if want is None:
        assert got is None, f"{name}: expected None"
        return
    assert got is not None, f"{name}: got None"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want.to(got.dtype)), f"{name}: values differ"


def _configs(world):
    out = []
    for i, (expand, alignment, sync, fp8) in enumerate(itertools.product((False, True), (1, 128), (True, False), (False, True))):
        rng = random.Random(1000 * world + i)
        el = rng.choice([2, 3])
        out.append(dict(index=i, expand=expand, alignment=alignment, sync=sync, fp8=fp8, k=min(rng.choice([1, 2, 3]), el * world),
                        el=el, t_max=24, ns=[rng.choice([0, 1, 7, 19, 24]) for _ in range(world)],
                        bias=["none", "one", "two"][i % 3], idx64=i % 2 == 0, tma=fp8 and i % 4 == 1, zero_padding=i % 3 == 0))
    out[0]["ns"] = [0] * world  # nobody sends anything
    return out


def dispatch_combine(rank, world, dev, deterministic=False, async_mode=False):
    """Every layout/sync/FP8/alignment combination: dispatch, handle fields, cumulative stats,
    cached dispatch with new data and weights, combine with bias and weights, against the reference.
    `async_mode`: every call waits on a captured event, runs asynchronously on the communication
    stream (allocating there) and is waited for through the returned event (CPU: no events)."""
    import deep_ep_rs

    def ev_kw():
        return dict(previous_event=buf.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True) if async_mode else {}

    dev = torch.device(dev)
    group = dist.group.WORLD
    buf = deep_ep_rs.ElasticBuffer(group, num_max_tokens_per_rank=24, hidden=HIDDEN, num_topk=3, deterministic=deterministic,
                                   explicitly_destroy=True)
    done = []
    for c in _configs(world):
        tag = f"config {c}"
        num_experts = c["el"] * world
        el = c["el"]
        ins = [make_inputs(s, c["ns"][s], c["k"], num_experts, seed=c["index"], idx_dtype=torch.int64 if c["idx64"] else torch.int32)
               for s in range(world)]
        xs, idxs, ws = [i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins]
        x, idx, w = (t.to(dev) for t in ins[rank])
        xin = fp8_pair(x) if c["fp8"] else x
        want = ref.dispatch([fp8_pair(t)[0] for t in xs] if c["fp8"] else xs, idxs, ws, rank, num_experts, c["t_max"],
                            sfs=[fp8_pair(t)[1] for t in xs] if c["fp8"] else None)
        stats = torch.zeros(el, dtype=torch.int32, device=dev)
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
            xin, topk_idx=idx, topk_weights=w, cumulative_local_expert_recv_stats=stats, num_experts=num_experts,
            num_max_tokens_per_rank=c["t_max"], expert_alignment=c["alignment"], do_cpu_sync=c["sync"], do_expand=c["expand"],
            do_zero_padding=c["zero_padding"], use_tma_aligned_col_major_sf=c["tma"], **ev_kw())  # padding is zero either way
        event.current_stream_wait()
        _check_dispatch(tag, c, world, el, recv_x, recv_idx, recv_w, handle, want, stats)

        # cached dispatch: other data along the same routes, with the weights
        ins2 = [make_inputs(s, c["ns"][s], c["k"], num_experts, seed=c["index"] + 500) for s in range(world)]
        want2 = ref.dispatch([fp8_pair(i[0])[0] if c["fp8"] else i[0] for i in ins2], idxs, ws, rank, num_experts, c["t_max"],
                             sfs=[fp8_pair(i[0])[1] for i in ins2] if c["fp8"] else None)
        x2 = ins2[rank][0].to(dev)
        rx2, ri2, rw2, h2, ev2 = buf.dispatch(fp8_pair(x2) if c["fp8"] else x2, topk_weights=w, handle=handle,
                                              cumulative_local_expert_recv_stats=stats, use_tma_aligned_col_major_sf=c["tma"],
                                              **ev_kw())
        ev2.current_stream_wait()
        assert h2 is handle, f"{tag}: a cached dispatch returns its handle"
        _check_dispatch(tag + " (cached)", c, world, el, rx2, ri2, rw2, handle, want2, stats, cached=True)

        # expert outputs (scaled and weighted per (token, expert) row), then combine with bias
        rows_bf16 = dequant(*recv_x) if c["fp8"] else recv_x
        y = _expert_rows(c, rows_bf16, recv_idx, recv_w, handle, rank, el)
        n = x.shape[0]
        bias = None
        if c["bias"] == "one":
            bias = torch.full((n, HIDDEN), 2.0, dtype=torch.bfloat16, device=dev)
        elif c["bias"] == "two":
            bias = (torch.full((n, HIDDEN), -1.0, dtype=torch.bfloat16, device=dev),
                    torch.full((n, HIDDEN), 0.5, dtype=torch.bfloat16, device=dev))
        combined, combined_w, event = buf.combine(y, handle, topk_weights=recv_w, bias=bias, **ev_kw())
        event.current_stream_wait()
        cpu_bias = tuple(b.cpu() for b in bias) if isinstance(bias, tuple) else (bias.cpu() if bias is not None else None)
        _eq(f"{tag}: combined_x", combined, expected_combine(xs[rank], idxs[rank], ws[rank], num_experts, world, cpu_bias))
        _eq(f"{tag}: combined_topk_weights", combined_w, torch.where(idxs[rank] >= 0, ws[rank], torch.zeros_like(ws[rank])))
        done.append(c["index"])
    buf.destroy()
    return {"configs": done}


def _check_dispatch(tag, c, world, el, recv_x, recv_idx, recv_w, handle, want, stats, cached=False):
    t_max, a = c["t_max"], c["alignment"]
    m = want["num_recv_tokens"]
    worst = world * t_max
    counts = want["counts"]
    aligned = [ref.align(v, a) for v in counts]
    x_got, sf_got = recv_x if c["fp8"] else (recv_x, None)
    assert isinstance(recv_x, tuple) == c["fp8"], f"{tag}: recv_x is a tuple iff x was"
    if c["expand"]:
        e = ref.expand(want, el, a)
        rows = e["num_rows"] if c["sync"] else worst * min(c["k"], el) + el * (a - 1)
        assert recv_idx is None, f"{tag}: the expanding layout returns no recv_topk_idx"
        pad = rows - e["num_rows"]
        _eq(f"{tag}: recv_x", x_got, torch.cat([e["recv_x"], e["recv_x"].new_zeros((pad, HIDDEN))]))
        if c["fp8"]:
            _eq(f"{tag}: recv_sf", sf_got, torch.cat([e["recv_sf"], e["recv_sf"].new_zeros((pad, e["recv_sf"].shape[1]))]))
        _eq(f"{tag}: recv_topk_weights", recv_w, torch.cat([e["recv_topk_weights"], torch.zeros(pad)]))
        assert handle.num_expanded_tokens == rows, f"{tag}: num_expanded_tokens"
    else:
        rows = m if c["sync"] else worst
        pad = rows - m
        _eq(f"{tag}: recv_x", x_got, torch.cat([want["recv_x"], want["recv_x"].new_zeros((pad, HIDDEN))]))
        if c["fp8"]:
            _eq(f"{tag}: recv_sf", sf_got, torch.cat([want["recv_sf"], want["recv_sf"].new_zeros((pad, want["recv_sf"].shape[1]))]))
        _eq(f"{tag}: recv_topk_idx", recv_idx.long(),
            torch.cat([want["recv_topk_idx"], torch.full((pad, c["k"]), -1, dtype=torch.int64)]))
        _eq(f"{tag}: recv_topk_weights", recv_w, torch.cat([ref.masked_weights(want), torch.zeros((pad, c["k"]))]))
    if c["fp8"] and c["tma"] and sf_got.shape[0] > 0:
        assert sf_got.stride(0) == 1 and sf_got.stride(1) == ref.align(sf_got.shape[0], 4), \
            f"{tag}: TMA-aligned column-major scales, strides {sf_got.stride()}"
    assert handle.do_expand == c["expand"] and handle.expert_alignment == a and handle.num_max_tokens_per_rank == t_max
    assert handle.num_recv_tokens == (m if c["sync"] else worst), f"{tag}: num_recv_tokens {handle.num_recv_tokens}"
    assert handle.num_recv_tokens_per_expert_list == (aligned if c["sync"] else []), \
        f"{tag}: num_recv_tokens_per_expert_list {handle.num_recv_tokens_per_expert_list} != {aligned}"
    _eq(f"{tag}: psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert,
        torch.tensor(ref.psum_per_expert(counts, a, c["expand"]), dtype=torch.int32))
    _eq(f"{tag}: num_unaligned_recv_tokens_per_expert", handle.num_unaligned_recv_tokens_per_expert,
        torch.tensor(counts, dtype=torch.int32))
    _eq(f"{tag}: psum_num_recv_tokens_per_scaleup_rank", handle.psum_num_recv_tokens_per_scaleup_rank,
        torch.tensor(want["psum_per_rank"], dtype=torch.int32))
    _eq(f"{tag}: cumulative_local_expert_recv_stats", stats, torch.tensor(counts, dtype=torch.int32) * (2 if cached else 1))


def _expert_rows(c, rows, recv_idx, recv_w, handle, rank, el):
    """Each received row through the test experts, weighted: expanding layout: row m belongs to
    the expert whose block holds it (from the device-side psum, no host sync); normal layout:
    sum over the row's local experts."""
    if c["expand"]:
        m = torch.arange(rows.shape[0], device=rows.device)
        psum = handle.psum_num_recv_tokens_per_expert.long()
        a = handle.expert_alignment
        start = torch.cat([psum.new_zeros(1), (psum[:-1] + a - 1) // a * a])
        scale = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
        for e in range(el):
            inside = (m >= start[e]) & (m < psum[e])
            scale = scale + inside.float() * expert_scale(rank * el + e)
        return (rows.float() * (scale * recv_w).unsqueeze(1)).to(torch.bfloat16)
    gate = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
    for e in range(el):
        gate = gate + torch.where(recv_idx == e, recv_w, torch.zeros_like(recv_w)).sum(dim=1) * expert_scale(rank * el + e)
    return (rows.float() * gate.unsqueeze(1)).to(torch.bfloat16)


# ---- a MoE layer on ElasticBuffer: autograd and torch.compile ------------------------------------
AG_HIDDEN, AG_TOPK, AG_EXPERTS_PER_RANK, AG_T = 64, 2, 2, 24


def moe_params(world, seed=0):
    """(router [H, E] f32, every expert's weight [E, H, H] bf16), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    e = AG_EXPERTS_PER_RANK * world
    router = torch.randn((AG_HIDDEN, e), generator=g) / 8
    w_all = (torch.randn((e, AG_HIDDEN, AG_HIDDEN), generator=g) / 8).to(torch.bfloat16)
    return router, w_all


class TitanDispatch(torch.autograd.Function):
    """torchtitan's wiring (torchtitan/distributed/deepep/deepep.py, V2): the forward dispatches,
    the backward is a combine of the gradients with the handle (grad of the weights through the
    combine's topk_weights)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, buf, num_experts, expand, sync):
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                                                           num_max_tokens_per_rank=AG_T, do_expand=expand, do_cpu_sync=sync)
        ctx.buf, ctx.handle, ctx.dtype = buf, handle, x.dtype
        if recv_idx is not None:
            ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_w, grad_handle):
        grad_x, grad_w, _ = ctx.buf.combine(grad_recv_x.to(torch.bfloat16).contiguous(), handle=ctx.handle,
                                            topk_weights=grad_recv_w.float().contiguous() if grad_recv_w is not None else None)
        return grad_x.to(ctx.dtype), None, grad_w, None, None, None, None


class TitanCombine(torch.autograd.Function):
    """torchtitan's wiring: the backward is a dispatch of the gradient with the cached handle
    (do_cpu_sync=False, num_sms from the handle)."""

    @staticmethod
    def forward(ctx, y, buf, handle):
        combined, _, event = buf.combine(y, handle=handle, topk_weights=None, async_with_compute_stream=True)
        event.current_stream_wait()
        ctx.buf, ctx.handle = buf, handle
        return combined

    @staticmethod
    def backward(ctx, grad):
        grad_y, _, _, _, _ = ctx.buf.dispatch(grad.contiguous(), handle=ctx.handle, num_sms=ctx.handle.num_sms, do_cpu_sync=False)
        return grad_y, None, None


def moe_forward(buf, world, rank, x, router, w_local, expand, sync, wrap):
    """router -> dispatch -> experts (weighted per row) -> combine, on this rank's experts."""
    el = AG_EXPERTS_PER_RANK
    scores = torch.softmax(x.float() @ router, dim=-1)
    topk_w, topk_idx = torch.topk(scores, AG_TOPK, dim=-1)
    if wrap:
        recv_x, recv_idx, recv_w, handle = TitanDispatch.apply(x, topk_idx, topk_w, buf, el * world, expand, sync)
    else:
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_w, num_experts=el * world,
                                                           num_max_tokens_per_rank=AG_T, do_expand=expand, do_cpu_sync=sync)
    out = torch.zeros((recv_x.shape[0], AG_HIDDEN), dtype=torch.float32, device=x.device)
    if expand:  # row m belongs to expert e when start_e <= m < psum_e (device-side, no host sync)
        m = torch.arange(recv_x.shape[0], device=x.device)
        psum = handle.psum_num_recv_tokens_per_expert.long()
        start = torch.cat([psum.new_zeros(1), psum[:-1]])  # alignment 1
        for e in range(el):
            inside = ((m >= start[e]) & (m < psum[e])).float().unsqueeze(1)
            out = out + inside * (recv_x @ w_local[e]).float()
        out = out * recv_w.unsqueeze(1)
    else:
        for e in range(el):
            gate = torch.where(recv_idx == e, recv_w, torch.zeros_like(recv_w)).sum(dim=-1, keepdim=True)
            out = out + gate * (recv_x @ w_local[e]).float()
    y = out.to(torch.bfloat16)
    if wrap:
        return TitanCombine.apply(y, buf, handle)
    return buf.combine(y, handle)[0]


def moe_reference(xs, routers, w_all):
    """The layer in plain fp32 torch on the full problem (one router copy per rank)."""
    outs = []
    for x, router in zip(xs, routers):
        scores = torch.softmax(x.float() @ router, dim=-1)
        topk_w, topk_idx = torch.topk(scores, AG_TOPK, dim=-1)
        y = torch.einsum("nh,nkhj->nkj", x.float(), w_all.float()[topk_idx])
        outs.append((topk_w.unsqueeze(-1) * y).sum(dim=1))
    return outs


def _inputs(rank, n, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn((n, AG_HIDDEN), generator=g).to(torch.bfloat16), torch.randn((n, AG_HIDDEN), generator=g)


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def moe_autograd(rank, world, dev):
    """One training step of the layer in every layout / sync mode, wired as torchtitan does and
    through ElasticBuffer's own autograd: output and gradients of x, router and expert weights
    against plain fp32 torch on the gathered problem (bf16 accuracy)."""
    import deep_ep_rs

    dev = torch.device(dev)
    buf = deep_ep_rs.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=AG_T, hidden=AG_HIDDEN, num_topk=AG_TOPK,
                                   explicitly_destroy=True)
    ns = [(17 + 5 * s) % 20 + 4 for s in range(world)]
    router0, w_all0 = moe_params(world)
    lo = rank * AG_EXPERTS_PER_RANK
    ins = [_inputs(s, ns[s], 1) for s in range(world)]
    xr = [i[0].float().requires_grad_() for i in ins]
    rr = [router0.clone().requires_grad_() for _ in range(world)]
    wr = w_all0.float().requires_grad_()
    ref_out = moe_reference(xr, rr, wr)
    sum((o * i[1]).sum() for o, i in zip(ref_out, ins)).backward()
    errs = {}
    for expand, sync, wrap in itertools.product((False, True), (True, False), (True, False)):
        name = f"expand={expand} sync={sync} {'torchtitan' if wrap else 'native'}"
        x = ins[rank][0].to(dev).clone().requires_grad_()  # clone: .to() of a CPU tensor to the CPU is the tensor itself
        router = router0.to(dev).clone().requires_grad_()
        w_local = w_all0[lo:lo + AG_EXPERTS_PER_RANK].to(dev).clone().requires_grad_()
        out = moe_forward(buf, world, rank, x, router, w_local, expand, sync, wrap)
        (out.float() * ins[rank][1].to(dev)).sum().backward()
        e = {"out": rel_err(out, ref_out[rank]), "x": rel_err(x.grad, xr[rank].grad), "router": rel_err(router.grad, rr[rank].grad),
             "w": rel_err(w_local.grad, wr.grad[lo:lo + AG_EXPERTS_PER_RANK])}
        errs[name] = e
    buf.destroy()
    # checked after every collective ran, so a failing rank does not leave its peers waiting
    bad = {k: v for k, v in errs.items() if not all(x < 1e-2 for x in v.values())}
    assert not bad, f"relative errors over 1e-2: {bad}"
    return errs


def moe_compile(rank, world, dev, backend="aot_eager", expands=(False, True), exact=True):
    """The layer without CPU sync (worst-case outputs, device-side counts) compiled with
    fullgraph=True (a graph break raises) equals eager, in both layouts. `exact=False`: to bf16
    accuracy (inductor's own router softmax and matmul kernels may round differently from eager)."""
    import torch._dynamo

    import deep_ep_rs

    dev = torch.device(dev)
    torch._dynamo.reset()
    buf = deep_ep_rs.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=AG_T, hidden=AG_HIDDEN, num_topk=AG_TOPK,
                                   explicitly_destroy=True)
    router0, w_all0 = moe_params(world)
    lo = rank * AG_EXPERTS_PER_RANK
    router, w_local = router0.to(dev), w_all0[lo:lo + AG_EXPERTS_PER_RANK].to(dev)
    done = {}
    with torch.no_grad():
        for expand in expands:
            def layer(x):
                return moe_forward(buf, world, rank, x, router, w_local, expand, False, False)

            compiled = torch.compile(layer, fullgraph=True, backend=backend)
            for seed in (2, 3):
                x = _inputs(rank, AG_T, seed)[0].to(dev)
                want = layer(x)
                got = compiled(x)
                assert got.shape == want.shape, f"expand={expand} seed={seed}: shape {tuple(got.shape)}"
                if exact:
                    assert torch.equal(got, want), f"expand={expand} seed={seed}: compiled != eager"
                else:
                    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"expand={expand} seed={seed}: {m}")
            done[f"expand={expand}"] = True
    buf.destroy()
    return done


def multi_domain_refused(rank, world, dev):
    """Ranks spanning several NVLink domains (here: domains of one rank) are refused at construction."""
    import deep_ep_rs
    from _harness import env_var

    with env_var("DEEP_EP_NVL_DOMAIN_SIZE", 1):
        try:
            deep_ep_rs.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8, hidden=HIDDEN)
        except NotImplementedError as e:
            return str(e)
    return "no error"
