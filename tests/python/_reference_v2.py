"""Plain-torch reference of DeepEP V2's dispatch and combine (`deep_ep.ElasticBuffer`), written
from the semantics of DeepEP V2's own reference (`deep_ep/utils/refs.py`) and the EPHandle field
definitions of `deep_ep/buffers/elastic.py`, for one receiving rank given every rank's inputs
(no communication: every rank rebuilds every rank's inputs from seeds).

- `dispatch`: the rows a rank receives are the tokens with at least one expert on it, sorted by
  `src_token_global_idx = src_rank * num_max_tokens_per_rank + token` (V2's deterministic order);
  top-k ids become local ids, -1 for experts of other ranks; top-k weights travel unmasked (as
  refs.py; `masked_weights` gives them with 0 at -1 ids, which is what deep_ep_rs returns).
- `expand`: the expanding layout of those rows: one row per (received token, local expert), expert
  blocks in expert order, rows in receive order inside a block, each block padded to
  `expert_alignment` rows; psum[i] = start of block i + its real count (V2's EPHandle).
- `combine`: refs.py's combine in V2's default single-domain mode (reduce_in_local): per token, the
  rows of each rank summed in fp32 (in top-k order) and rounded to bf16, then bias_0 + bias_1 +
  those partials in fp32, rounded to bf16.
"""
from typing import List, Optional, Sequence

import torch


def align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def dispatch(xs: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor], ws: Sequence[Optional[torch.Tensor]], rank: int,
             num_experts: int, num_max_tokens_per_rank: int, sfs: Optional[Sequence[torch.Tensor]] = None) -> dict:
    """xs[s], idxs[s], ws[s] (, sfs[s]): rank s's x [n_s, H], topk_idx [n_s, K], topk_weights [n_s, K]
    (or None), scales [n_s, S]. Returns the receiving rank's rows (dict of CPU tensors and lists)."""
    world = len(xs)
    el = num_experts // world
    lo, hi = rank * el, (rank + 1) * el
    rows, src = [], []
    for s in range(world):
        idx = idxs[s].long()
        for t in range(idx.shape[0]):
            if bool(((idx[t] >= lo) & (idx[t] < hi)).any()):
                rows.append((s, t))
                src.append(s * num_max_tokens_per_rank + t)
    k = idxs[0].shape[1]
    h = xs[0].shape[1]
    recv_x = torch.stack([xs[s][t] for s, t in rows]) if rows else xs[0].new_zeros((0, h))
    recv_sf = None
    if sfs is not None:
        recv_sf = torch.stack([sfs[s][t] for s, t in rows]) if rows else sfs[0].new_zeros((0, sfs[0].shape[1]))
    raw_idx = torch.stack([idxs[s][t].long() for s, t in rows]) if rows else torch.zeros((0, k), dtype=torch.int64)
    local = torch.where((raw_idx >= lo) & (raw_idx < hi), raw_idx - lo, torch.full_like(raw_idx, -1))
    recv_w = None
    if ws[0] is not None:
        recv_w = torch.stack([ws[s][t] for s, t in rows]) if rows else torch.zeros((0, k), dtype=torch.float32)
    per_rank = [sum(1 for s2, _ in rows if s2 == s) for s in range(world)]
    counts = [int((local == e).sum()) for e in range(el)]
    return dict(rows=rows, src_token_global_idx=src, recv_x=recv_x, recv_sf=recv_sf, recv_topk_idx=local, recv_topk_weights=recv_w,
                num_recv_tokens=len(rows), psum_per_rank=torch.tensor(per_rank, dtype=torch.int64).cumsum(0).tolist(),
                counts=counts)


def masked_weights(ref: dict) -> Optional[torch.Tensor]:
    w = ref["recv_topk_weights"]
    return None if w is None else torch.where(ref["recv_topk_idx"] >= 0, w, torch.zeros_like(w))


def psum_per_expert(counts: List[int], alignment: int, expand: bool) -> List[int]:
    """EPHandle.psum_num_recv_tokens_per_expert: inclusive prefix sum of the aligned counts; in the
    expanding layout, block start + real count."""
    out, at = [], 0
    for c in counts:
        out.append(at + c if expand else at + align(c, alignment))
        at += align(c, alignment)
    return out


def expand(ref: dict, num_local_experts: int, alignment: int) -> dict:
    """The expanding layout of a `dispatch` result: x rows, scales, 1-D weights (0 on padding),
    `pairs` (received row, k) per row (None on padding), `num_rows`."""
    local, x = ref["recv_topk_idx"], ref["recv_x"]
    w = masked_weights(ref)
    pairs = []
    for e in range(num_local_experts):
        block = [(r, int(k)) for r in range(local.shape[0]) for k in (local[r] == e).nonzero().flatten().tolist()]
        pairs += block + [None] * (align(len(block), alignment) - len(block))
    h = x.shape[1]
    out_x = torch.stack([x[p[0]] if p is not None else x.new_zeros(h) for p in pairs]) if pairs else x.new_zeros((0, h))
    out_sf = None
    if ref["recv_sf"] is not None:
        sf = ref["recv_sf"]
        out_sf = (torch.stack([sf[p[0]] if p is not None else sf.new_zeros(sf.shape[1]) for p in pairs])
                  if pairs else sf.new_zeros((0, sf.shape[1])))
    out_w = None
    if w is not None:
        out_w = torch.tensor([float(w[p[0], p[1]]) if p is not None else 0.0 for p in pairs], dtype=torch.float32)
    return dict(recv_x=out_x, recv_sf=out_sf, recv_topk_weights=out_w, pairs=pairs, num_rows=len(pairs))


def combine(y: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, world: int, bias=None) -> torch.Tensor:
    """refs.combine with reduce_in_local=True: y [N, K, H] is the expert output of every (token, k)
    on this (source) rank, topk_idx [N, K] global ids (-1: none, contributes nothing)."""
    n, k, h = y.shape
    el = num_experts // world
    owner = torch.where(topk_idx >= 0, topk_idx.long() // el, torch.full_like(topk_idx.long(), -1))
    if isinstance(bias, tuple):
        acc = bias[0].float() + bias[1].float()
    elif bias is not None:
        acc = bias.float().clone()
    else:
        acc = torch.zeros((n, h), dtype=torch.float32)
    acc = acc.clone()
    for t in range(n):
        done = set()
        for j in range(k):  # partials in the order of each rank's last top-k slot (refs.py's order)
            r = int(owner[t, j])
            if r < 0 or r in done:
                continue
            last = max(jj for jj in range(k) if int(owner[t, jj]) == r)
            if last != j:
                continue
            part = torch.zeros(h, dtype=torch.float32)
            for jj in range(k):
                if int(owner[t, jj]) == r:
                    part += y[t, jj].float()
            acc[t] += part.to(torch.bfloat16).float()
            done.add(r)
    return acc.to(torch.bfloat16)
