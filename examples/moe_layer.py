"""A reference MoE layer on the deep_ep ops: router -> dispatch -> grouped expert MLP -> combine.

`MoELayer.prefill(x)` uses the normal (high-throughput) ops, `MoELayer.decode(x)` the low-latency
ones. Both compile with `torch.compile(fullgraph=True)`; decode has static shapes and no host
synchronisation, so it also runs under `mode="reduce-overhead"` (CUDA graphs) on GPUs. Prefill is
differentiable (dispatch/combine autograd). `reference()` is the same layer in plain torch on
the full (gathered) problem, for checks. Used by tests/python/test_moe_layer.py (CPU) and
tests/gpu/test_compile_cuda.py (GPU).
"""
from typing import List, Sequence

import torch

import deep_ep_rs  # noqa: F401  (registers torch.ops.deep_ep, fake kernels and autograd)


class MoELayer(torch.nn.Module):
    """Expert-parallel MoE layer of one rank. `handle`: a deep_ep buffer (normal mode needs
    num_nvl_bytes, decode needs a low-latency buffer with room for `max_decode_tokens` tokens).
    Router [H, E] fp32 is replicated; this rank holds experts [rank*E_l, (rank+1)*E_l) as
    bf16 [E_l, H, H] weights. Parameters are created from `seed`, identical on every rank."""

    def __init__(self, handle: int, num_ranks: int, rank: int, hidden: int = 128, experts_per_rank: int = 2, topk: int = 2,
                 max_decode_tokens: int = 8, config: Sequence[int] = (20, 6, 256, 6, 128), seed: int = 0,
                 device: torch.device = torch.device("cpu")):
        super().__init__()
        self.handle, self.num_ranks, self.rank = handle, num_ranks, rank
        self.hidden, self.el, self.topk, self.t = hidden, experts_per_rank, topk, max_decode_tokens
        self.num_experts = experts_per_rank * num_ranks
        self.config = list(config)
        router, w_all = make_params(num_ranks, hidden, experts_per_rank, seed)
        self.router = torch.nn.Parameter(router.to(device))
        lo = rank * experts_per_rank
        self.w = torch.nn.Parameter(w_all[lo:lo + experts_per_rank].to(device))

    def route(self, x: torch.Tensor):
        scores = torch.softmax(x.float() @ self.router, dim=-1)
        return torch.topk(scores, self.topk, dim=-1)  # (weights [N, K] f32, expert ids [N, K] i64)

    def prefill(self, x: torch.Tensor, num_worst_tokens: int = 0) -> torch.Tensor:
        """x [N, H] bf16 -> [N, H] bf16 through dispatch/combine (collective)."""
        ops = torch.ops.deep_ep
        topk_w, topk_idx = self.route(x)
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(topk_idx, self.num_experts, self.num_ranks)
        recv_x, _, recv_idx, recv_w, _, rpm, cpm, rcpm, src_idx, send_head = ops.dispatch(
            self.handle, x, None, topk_idx, topk_w, ntpr, in_rank, ntpe, 1, num_worst_tokens, self.config)
        out = torch.zeros((recv_x.shape[0], self.hidden), dtype=torch.float32, device=x.device)
        for e in range(self.el):  # recv_idx holds local expert ids (-1 = another rank's expert)
            gate = torch.where(recv_idx == e, recv_w, torch.zeros_like(recv_w)).sum(dim=-1, keepdim=True)
            out = out + gate * (recv_x @ self.w[e]).float()
        combined, _ = ops.combine(self.handle, out.to(torch.bfloat16), None, None, None, rpm, cpm, rcpm, src_idx, in_rank,
                                  send_head, self.config)
        return combined

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] bf16 (N <= max_decode_tokens) -> [N, H] bf16 through the low-latency ops
        (collective). Static shapes: [E_l, R*T, H] per local expert, one batched matmul."""
        ops = torch.ops.deep_ep
        topk_w, topk_idx = self.route(x)
        recv_x, _, _, src_info, layout_range = ops.low_latency_dispatch(
            self.handle, x, topk_idx, None, None, None, self.t, self.num_experts, False, False, False)
        y = torch.bmm(recv_x, self.w)  # rows past recv_count are ignored by combine
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.bfloat16, device=x.device)
        ops.low_latency_combine(self.handle, y, topk_idx, topk_w, src_info, layout_range, out, None, self.t, self.num_experts,
                                False, False)
        return out

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        return self.decode(x) if decode else self.prefill(x)


def make_params(num_ranks: int, hidden: int, experts_per_rank: int, seed: int = 0):
    """(router [H, E] f32, every expert's weight [E, H, H] bf16), deterministic in `seed`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e = experts_per_rank * num_ranks
    router = torch.randn((hidden, e), generator=g, dtype=torch.float32, device="cpu") / 8
    w_all = (torch.randn((e, hidden, hidden), generator=g, dtype=torch.float32, device="cpu") / hidden ** 0.5).to(torch.bfloat16)
    return router, w_all


def reference(xs: List[torch.Tensor], router: torch.Tensor, w_all: torch.Tensor, topk: int) -> List[torch.Tensor]:
    """The layer in plain fp32 torch: xs = every rank's input, returns every rank's output."""
    outs = []
    for x in xs:
        scores = torch.softmax(x.float() @ router.float(), dim=-1)
        topk_w, topk_idx = torch.topk(scores, topk, dim=-1)
        y = torch.einsum("nh,nkhj->nkj", x.float(), w_all.float()[topk_idx])
        outs.append((topk_w.unsqueeze(-1) * y).sum(dim=1))
    return outs
