"""Rank-masking scenario shared by the CPU test (tests/python/test_rank_mask.py) and the GPU test
(tests/gpu/test_rank_mask_gpu.py): one rank is dead (never calls an LL op), the survivors mask it
(explicitly, or through shrink mode after a timeout), run LL dispatch -> expert -> combine and
must produce the reference results with the dead rank's experts dropped.
"""
import torch

import _reference as ref

T, H = 8, 256
EXPERTS_PER_RANK = 3
TOPK = 4


def masked_inputs(world, dead, seed, dev):
    """Every rank's inputs (the same on every rank), and the reference view of them: the dead
    rank sends nothing and selections of experts it owns become -1."""
    e = EXPERTS_PER_RANK * world
    inputs, views = [], []
    for s in range(world):
        g = torch.Generator().manual_seed(seed * 31 + s)
        n = T - (s % 3)
        x = torch.randn((n, H), generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, generator=g)[:TOPK] for _ in range(n)])
        idx[0, 1] = -1
        w = torch.rand((n, TOPK), generator=g)
        inputs.append((x.to(dev), idx.to(dev), w.to(dev)))
        kept = torch.where(idx // EXPERTS_PER_RANK == dead, torch.full_like(idx, -1), idx)
        views.append(ref.RankInput(x=x if s != dead else x[:0], topk_idx=kept if s != dead else kept[:0], topk_weights=w))
    return inputs, views, e


def expert_fn(g, rows):
    return (rows.float() * (1.0 + g / 8.0)).to(torch.bfloat16)


def run_masked_ll(buf, rank, world, dead, seed, explicit=True, iters=3):
    """Survivor side: LL dispatch/combine `iters` times with `dead` masked; returns the number of
    checked rows. Raises AssertionError on a wrong result."""
    dev = buf.device
    if explicit:
        buf.low_latency_update_mask_buffer(dead, True)
    checked = 0
    el = EXPERTS_PER_RANK
    for it in range(iters):
        inputs, views, e = masked_inputs(world, dead, seed + it, dev)
        x, idx, w = inputs[rank]
        want = ref.ll_dispatch(views, rank, e, False, False)
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, e, use_fp8=False, return_recv_hook=(it % 2 == 1))
        if hook is not None:
            hook()
        assert count.cpu().tolist() == want.count.tolist(), f"recv_count {count.cpu().tolist()} != {want.count.tolist()}"
        lr = handle[1].cpu()
        assert torch.equal(lr & 0xffffffff, want.layout_range & 0xffffffff), "layout_range counts differ"
        assert int((lr[:, dead] & 0xffffffff).sum()) == 0, "rows from the masked rank"
        rx = recv_x.cpu()
        y = torch.zeros_like(rx)
        for l in range(el):
            c = int(count[l])
            rows = rx[l, :c]
            got = sorted(map(tuple, rows.float().tolist()))
            assert got == sorted(map(tuple, want.rows[l].float().tolist())), f"local expert {l}: wrong rows"
            y[l, :c] = expert_fn(rank * el + l, rows)
            checked += c
        out, _, hook = buf.low_latency_combine(y.to(dev), idx, w, handle, return_recv_hook=(it % 2 == 0))
        if hook is not None:
            hook()
        kept = views[rank].topk_idx
        want_out = ref.ll_combine(x.cpu(), kept, w.cpu(), expert_fn)
        assert torch.equal(out.cpu(), want_out), f"combine differs by {(out.cpu().float() - want_out.float()).abs().max()}"
    status = torch.zeros(world, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(status)
    assert status.cpu().tolist() == [int(r == dead) for r in range(world)], status.cpu().tolist()
    return checked
