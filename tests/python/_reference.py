"""Independent pure-torch reference of DeepEP V1 normal-mode semantics (never calls deep_ep).

Sources: DEEPEP_BEHAVIOUR.md §1.6-1.8, §3.7, §4.2 and docs/OPS.md ("Semantics we fix"):
- layout: per-selection expert counts, per-token rank membership (deduplicated), -1 ignored;
- dispatch on rank r: rows from source ranks ascending, within a source ascending token index, of
  the tokens with >= 1 expert on r; topk ids made rank-local (or -1, weight zeroed);
- handle: rank_prefix_matrix [R, R] inclusive prefix over sources (every column), sender-side
  channel_prefix_matrix [R, C] (inclusive over channels), recv_channel_prefix_matrix [R, C]
  (exclusive start of each channel inside a source's block), recv_src_idx, send_head [N, R]
  (slot within the (channel, destination) queue, or -1); C channels are contiguous token chunks
  of ceil(N / C);
- combine: bf16(fp32(bias0) + fp32(bias1) + sum over destination ranks ascending of fp32(row)),
  weights summed the same way in fp32.
"""
from dataclasses import dataclass, field
from typing import List, Optional

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's tests/utils.py calc_diff."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    sim = 2 * (x * y).sum() / denominator
    return (1 - sim).item()


@dataclass
class RankInput:
    """What one rank passes to dispatch (topk_idx may be given or not to the op, but routing
    always comes from it)."""
    x: torch.Tensor                        # [N, H] bf16 or float8_e4m3fn
    topk_idx: torch.Tensor                 # [N, K] int32/int64 global expert ids or -1
    topk_weights: torch.Tensor             # [N, K] f32
    x_scales: Optional[torch.Tensor] = None  # [N, S] f32/i32 (fp8 only)


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32, is_token_in_rank [N, R] bool)."""
    idx = topk_idx.long()
    n = idx.shape[0]
    el = num_experts // num_ranks
    valid = idx >= 0
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    in_rank = torch.zeros((n, num_ranks), dtype=torch.bool)
    for rk in range(num_ranks):
        in_rank[:, rk] = ((idx >= rk * el) & (idx < (rk + 1) * el)).any(dim=1)
    per_rank = in_rank.sum(dim=0).to(torch.int32)
    return per_rank, per_expert, in_rank


def channel_ranges(num_tokens: int, num_channels: int):
    per = -(-num_tokens // num_channels)
    out = []
    for c in range(num_channels):
        start = min(per * c, num_tokens)
        out.append((start, min(start + per, num_tokens)))
    return out


@dataclass
class DispatchRef:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert_list: List[int]
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    send_head: torch.Tensor
    is_token_in_rank: torch.Tensor
    recv_src_rank: torch.Tensor = field(default=None)  # not a library output: source rank of each row

    @property
    def num_recv(self) -> int:
        return self.recv_x.shape[0]


def dispatch(inputs: List[RankInput], rank: int, num_experts: int, num_channels: int, expert_alignment: int = 1) -> DispatchRef:
    """The intranode dispatch result on `rank` given every rank's inputs."""
    nr = len(inputs)
    el = num_experts // nr
    lo, hi = rank * el, (rank + 1) * el
    lays = [layout(i.topk_idx, num_experts, nr) for i in inputs]
    xs, scs, idxs, ws, srcs, src_ranks, rcpm = [], [], [], [], [], [], []
    for s, inp in enumerate(inputs):
        in_rank = lays[s][2]
        sel = torch.nonzero(in_rank[:, rank]).flatten()
        xs.append(inp.x[sel])
        if inp.x_scales is not None:
            scs.append(inp.x_scales[sel])
        gid = inp.topk_idx[sel].long()
        mine = (gid >= lo) & (gid < hi)
        idxs.append(torch.where(mine, gid - lo, torch.full_like(gid, -1)).to(inp.topk_idx.dtype))
        ws.append(torch.where(mine, inp.topk_weights[sel], torch.zeros_like(inp.topk_weights[sel])))
        srcs.append(sel.to(torch.int32))
        src_ranks.append(torch.full((sel.numel(),), s, dtype=torch.int32))
        starts, total = [], 0
        for (a, b) in channel_ranges(inp.x.shape[0], num_channels):
            starts.append(total)
            total += int(in_rank[a:b, rank].sum())
        rcpm.append(starts)
    per_expert = sum(lays[s][1].long() for s in range(nr))[lo:hi]
    aligned = [int(-(-int(c) // expert_alignment) * expert_alignment) for c in per_expert]
    counts = torch.stack([lays[s][0] for s in range(nr)]).long()  # [src, dst]
    rpm = torch.cumsum(counts, dim=0).to(torch.int32)
    # sender side (this rank's own tokens)
    own_in_rank = lays[rank][2]
    n = inputs[rank].x.shape[0]
    cpm = torch.zeros((nr, num_channels), dtype=torch.int32)
    send_head = torch.full((n, nr), -1, dtype=torch.int32)
    for d in range(nr):
        total = 0
        for c, (a, b) in enumerate(channel_ranges(n, num_channels)):
            slot = 0
            for t in range(a, b):
                if own_in_rank[t, d]:
                    send_head[t, d] = slot
                    slot += 1
            total += slot
            cpm[d, c] = total
    k = inputs[rank].topk_idx.shape[1]
    return DispatchRef(
        recv_x=torch.cat(xs) if xs else inputs[rank].x[:0],
        recv_x_scales=torch.cat(scs).contiguous() if scs else None,
        recv_topk_idx=torch.cat(idxs).reshape(-1, k),
        recv_topk_weights=torch.cat(ws).reshape(-1, k),
        num_recv_tokens_per_expert_list=aligned,
        rank_prefix_matrix=rpm,
        channel_prefix_matrix=cpm,
        recv_channel_prefix_matrix=torch.tensor(rcpm, dtype=torch.int32).reshape(nr, num_channels),
        recv_src_idx=torch.cat(srcs),
        send_head=send_head,
        is_token_in_rank=own_in_rank,
        recv_src_rank=torch.cat(src_ranks),
    )


def combine(refs: List[DispatchRef], ys: List[torch.Tensor], rank: int, num_tokens: int,
            weights: Optional[List[torch.Tensor]] = None, bias_0: Optional[torch.Tensor] = None,
            bias_1: Optional[torch.Tensor] = None):
    """The combine result on `rank`: refs[d] / ys[d] / weights[d] are destination d's dispatch
    result and the rows (and weights) d passes to combine. Returns (combined_x bf16, weights f32 or None)."""
    hidden = ys[rank].shape[1]
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    for b in (bias_0, bias_1):
        if b is not None:
            acc = acc + b.float()
    acc_w = None
    if weights is not None:
        acc_w = torch.zeros((num_tokens, weights[rank].shape[1]), dtype=torch.float32)
    for d, ref in enumerate(refs):
        rows = torch.nonzero(ref.recv_src_rank == rank).flatten()
        tok = ref.recv_src_idx[rows].long()
        # tokens are unique within one destination: plain indexed add, one addend per token
        acc[tok] = acc[tok] + ys[d][rows].float()
        if acc_w is not None:
            acc_w[tok] = acc_w[tok] + weights[d][rows]
    return acc.to(torch.bfloat16), acc_w


def per_token_cast_to_fp8(x: torch.Tensor):
    """DeepEP tests/utils.py: per token, per 128 channels: fp8 = x * 448 / amax, scale = amax / 448."""
    m, n = x.shape
    assert n % 128 == 0
    xv = x.float().view(m, -1, 128)
    amax = xv.abs().amax(dim=2).view(m, -1).clamp(1e-4)
    fp8 = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    return fp8, (amax / 448.0).view(m, -1)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """DeepEP tests/utils.py: float scales, or int32-packed UE8M0 exponent bytes."""
    if x_scales.dtype == torch.int:
        x_scales = x_scales.view(dtype=torch.uint8).to(torch.int) << 23
        x_scales = x_scales.view(dtype=torch.float)
    x_fp32 = x_fp8.to(torch.float32).view(x_fp8.size(0), -1, 128)
    x_scales = x_scales.view(x_fp8.size(0), -1, 1)
    return (x_fp32 * x_scales).view_as(x_fp8).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# low-latency mode (DEEPEP_BEHAVIOUR.md §1.11-1.13, §3.3-3.4; receive order on the CPU backend:
# sources ascending, then token order - docs/OPS.md; DeepEP's order is nondeterministic, so
# checks that must hold on every backend compare order-independently)


def ll_quantize(x: torch.Tensor, round_scale: bool):
    """Per token and 128 channels: (fp8 [N, H], scale_inv f32 [N, H/128]) as DeepEP's LL kernel."""
    n, h = x.shape
    xv = x.float().view(n, h // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
        scale = 1.0 / scale_inv
    else:
        scale = 448.0 / amax
        scale_inv = amax / 448.0
    q = (xv * scale.unsqueeze(2)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, h)
    return q, scale_inv


def ll_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, h = q.shape
    return (q.float().view(n, h // 128, 128) * scale_inv.unsqueeze(2)).view(n, h).to(torch.bfloat16)


def ue8m0_pack(scale_inv: torch.Tensor) -> torch.Tensor:
    """[N, S] power-of-two float32 -> [N, S/4] int32 of exponent bytes (byte j of pack p = group 4p+j)."""
    e = (scale_inv.contiguous().view(torch.int32) >> 23) & 0xFF
    e = e.view(e.shape[0], -1, 4)
    return (e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)).to(torch.int32)


def ue8m0_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., S/4] int32 -> [..., S] float32 powers of two."""
    b = packed.clone(memory_format=torch.contiguous_format).view(torch.uint8).to(torch.int32)  # little-endian bytes
    return (b << 23).view(torch.float32)


@dataclass
class LLDispatchRef:
    count: torch.Tensor          # [E_l] i32
    layout_range: torch.Tensor   # [E_l, R] i64 (begin << 32) | count, CPU order
    src_info: List[List[List[int]]]  # [E_l][R] -> token indices (CPU order: ascending)
    rows: List[torch.Tensor]     # [E_l] -> [count, H] bf16 dequantized rows the expert receives (CPU order)


def ll_dispatch(inputs: List[RankInput], rank: int, num_experts: int, use_fp8: bool, round_scale: bool) -> LLDispatchRef:
    nr = len(inputs)
    el = num_experts // nr
    count = torch.zeros((el,), dtype=torch.int32)
    layout_range = torch.zeros((el, nr), dtype=torch.int64)
    src_info, rows = [], []
    deq = []
    for inp in inputs:
        if use_fp8 and inp.x.shape[0]:
            q, s = ll_quantize(inp.x, round_scale)
            deq.append(ll_dequantize(q, s))
        else:
            deq.append(inp.x)
    for e in range(el):
        g = rank * el + e
        begin, per_src, rws = 0, [], []
        for s, inp in enumerate(inputs):
            sel = (inp.topk_idx.long() == g)
            toks = [t for t in range(sel.shape[0]) for _ in range(int(sel[t].sum()))]
            layout_range[e, s] = (begin << 32) | len(toks)
            per_src.append(toks)
            rws.append(deq[s][toks] if toks else deq[s][:0])
            begin += len(toks)
        count[e] = begin
        src_info.append(per_src)
        rows.append(torch.cat(rws))
    return LLDispatchRef(count=count, layout_range=layout_range, src_info=src_info, rows=rows)


def ll_combine(x_deq: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_fn) -> torch.Tensor:
    """out[n] = bf16(sum over valid k, ascending, in fp32 of w[n,k] * fp32(y_k)), y_k = expert_fn(g, rows)
    the bf16 output of expert g for token n's (dequantized) row."""
    n, h = x_deq.shape
    acc = torch.zeros((n, h), dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        for t in range(n):
            g = int(topk_idx[t, k])
            if g >= 0:
                acc[t] = acc[t] + topk_weights[t, k] * expert_fn(g, x_deq[t:t + 1])[0].float()
    return acc.to(torch.bfloat16)


def ll_combine_partial(x_deq: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_fn, experts_per_rank: int,
                       num_ranks: int) -> torch.Tensor:
    """The combine when the dispatch carried topk_weights: every expert rank d sends
    p_d[n] = bf16(sum over k ascending with topk_idx[n,k] on d of fma(w[n,k], fp32(y_k), acc)),
    and out[n] = bf16(sum over d ascending of fp32(p_d[n])) (one more BF16 rounding than
    ll_combine). fma is emulated in float64 (f32 x bf16 products are exact there)."""
    n, h = x_deq.shape
    out = torch.zeros((n, h), dtype=torch.float32)
    for t in range(n):
        for d in range(num_ranks):
            acc, any_k = torch.zeros(h, dtype=torch.float32), False
            for k in range(topk_idx.shape[1]):
                g = int(topk_idx[t, k])
                if g >= 0 and g // experts_per_rank == d:
                    y = expert_fn(g, x_deq[t:t + 1])[0].float()
                    acc = (y.double() * float(topk_weights[t, k]) + acc.double()).float()
                    any_k = True
            if any_k:
                out[t] = out[t] + acc.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def ll_combine_f64(x_deq: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_fn) -> torch.Tensor:
    """The float reference DeepEP's test compares a combine with: sum over valid k of w * y_k in
    float64, not rounded."""
    out = torch.zeros(x_deq.shape, dtype=torch.float64)
    for k in range(topk_idx.shape[1]):
        for t in range(x_deq.shape[0]):
            g = int(topk_idx[t, k])
            if g >= 0:
                out[t] += float(topk_weights[t, k]) * expert_fn(g, x_deq[t:t + 1])[0].double()
    return out


# ---- NVFP4 low-latency dispatch (docs/NVFP4.md, "this library") ----------------------------------
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """f32 -> E2M1 codes (uint8): round to nearest even, saturate at 6, sign in bit 3, NaN -> 0."""
    a = v.abs()
    bounds = [(0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True)]
    mag = torch.zeros_like(v, dtype=torch.uint8)
    for b, tie_down in bounds:  # a tie at an even code's boundary stays below it
        mag += (a > b if tie_down else a >= b).to(torch.uint8)
    code = mag | (torch.signbit(v).to(torch.uint8) << 3)
    return torch.where(torch.isnan(v), torch.zeros_like(code), code)


def nvfp4_quantize(x: torch.Tensor, global_scale: float):
    """x [N, H] bf16 -> (packed uint8 [N, H/2], scales uint8 [N, H/16]) with IEEE f32 maths:
    sf = e4m3(S * (amax / 6)), out = S / f32(sf), q = e2m1(x * out). S * amax / 6 must stay <= 448
    (torch's e4m3 conversion does not saturate)."""
    n, h = x.shape
    xf = x.float().view(n, h // 16, 16)
    s = torch.tensor(global_scale, dtype=torch.float32, device=x.device)
    amax = xf.abs().amax(dim=-1)
    sf = (s * (amax / 6.0)).to(torch.float8_e4m3fn)
    sfv = sf.float()
    out = torch.where(sfv != 0, s / sfv, torch.zeros_like(sfv))
    codes = e2m1_codes(xf * out.unsqueeze(-1)).view(n, h)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sf.view(torch.uint8)


def nvfp4_unswizzle(scales: torch.Tensor) -> torch.Tensor:
    """DeepEP's scales view (32, 4, rm, 4, rk, L) -> [L, rm*128, rk*4] row-major (its test's
    recover_swizzled_scales, per expert)."""
    _, _, rm, _, rk, el = scales.shape
    phys = scales.permute(5, 2, 4, 0, 1, 3)  # (L, rm, rk, 32, 4, 4)
    return phys.permute(0, 1, 4, 3, 2, 5).reshape(el, rm * 128, rk * 4)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """packed [rows, H/2] uint8 and scales [rows, H/16] (e4m3 bytes) -> f32 [rows, H]."""
    lo, hi = (packed & 15).long(), (packed >> 4).long()
    vals = torch.stack([E2M1_VALUES[lo], E2M1_VALUES[hi]], dim=-1).reshape(packed.shape[0], -1)
    sf = scales.view(torch.float8_e4m3fn).float() / global_scale
    return vals * sf.repeat_interleave(16, dim=1)
