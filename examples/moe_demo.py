"""MoE dispatch/combine demo: a small MoE layer on N ranks, checked against a single-process
reference, once in normal (high-throughput) mode and once in low-latency mode.

Runs on GPUs when at least N are visible and the GPU backend supports the op; otherwise on the
CPU shared-memory backend. Prints one table row per rank.

    python examples/moe_demo.py --ranks 4
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def experts_weights(num_experts: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(num_experts, hidden, hidden, generator=g) / hidden ** 0.5


def make_inputs(rank: int, a):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(a.tokens, a.hidden, generator=g).bfloat16()
    scores = torch.rand(a.tokens, a.experts, generator=g)
    w, idx = scores.topk(a.topk, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).float()


def reference(x, idx, w, weights):
    """Σ_k w_k · expert_k(x) in fp32, the layer every mode must reproduce."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        y = torch.einsum("nh,nhj->nj", x.float(), weights[idx[:, k]])
        out += w[:, k:k + 1] * y
    return out


def apply_experts(rows, local_idx, local_w, weights, rank, num_local):
    """Expert side of normal mode: each received row gets Σ over this rank's experts of w·f(x)."""
    out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    for k in range(local_idx.shape[1]):
        sel = local_idx[:, k] >= 0
        if sel.any():
            e = local_idx[sel, k].long() + rank * num_local
            y = torch.einsum("nh,nhj->nj", rows[sel].float(), weights[e].to(rows.device))
            out[sel] += local_w[sel, k:k + 1] * y
    return out.bfloat16()


def run_rank(rank: int, a, port: int, device_kind: str, results):
    import deep_ep_rs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.ranks)
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(a.ranks)))
    weights = experts_weights(a.experts, a.hidden)
    x, idx, w = make_inputs(rank, a)
    ref = reference(x, idx, w, weights)
    num_local = a.experts // a.ranks
    row = {"rank": rank, "device": str(device)}

    buf = deep_ep_rs.Buffer(group, 64 << 20, 0, device=device, explicitly_destroy=True)
    xd, idxd, wd = x.to(device), idx.to(device), w.to(device)
    t0 = time.perf_counter()
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxd, a.experts)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
        xd, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idxd, topk_weights=wd)
    t1 = time.perf_counter()
    y = apply_experts(recv_x, recv_idx, recv_w, weights, rank, num_local)
    t2 = time.perf_counter()
    out, _, _ = buf.combine(y, handle)
    t3 = time.perf_counter()
    err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
    row.update(sent=int(in_rank.sum()), received=recv_x.shape[0], per_expert=per_expert,
               dispatch_ms=(t1 - t0) * 1e3, combine_ms=(t3 - t2) * 1e3, ht_rel_err=err)
    buf.destroy()

    # Low-latency decode step: static shapes, weights applied in the combine.
    hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, a.ranks, a.experts)
    try:
        ll = deep_ep_rs.Buffer(group, 0, hint, low_latency_mode=True, device=device, explicitly_destroy=True)
        recv, count, h, _, _ = ll.low_latency_dispatch(xd, idxd, a.tokens, a.experts, use_fp8=False)
        ys = torch.empty_like(recv)
        for e in range(num_local):
            n = int(count[e])
            ys[e, :n] = (recv[e, :n].float() @ weights[rank * num_local + e].to(device)).bfloat16()
        out_ll, _, _ = ll.low_latency_combine(ys, idxd, wd, h)
        row["ll_rel_err"] = ((out_ll.float().cpu() - ref).norm() / ref.norm()).item()
        ll.destroy()
    except RuntimeError as e:
        row["ll_rel_err"] = f"unavailable: {str(e).splitlines()[0][:60]}"
    results[rank] = row
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a = p.parse_args()
    kind = a.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= a.ranks else "cpu"
    results = mp.Manager().dict()
    try:
        mp.spawn(run_rank, args=(a, free_port(), kind, results), nprocs=a.ranks)
    except Exception as e:  # the GPU backend may not support an op yet: say so, then use the CPU
        if kind != "cuda":
            raise
        print(f"GPU run failed ({str(e).strip().splitlines()[-1][:120]}); running on the CPU backend instead")
        kind = "cpu"
        results = mp.Manager().dict()
        mp.spawn(run_rank, args=(a, free_port(), kind, results), nprocs=a.ranks)
    print(f"\nMoE layer: {a.ranks} ranks, {a.tokens} tokens/rank, hidden {a.hidden}, top-{a.topk} of {a.experts} experts, backend {kind}")
    print(f"{'rank':>4} {'device':>7} {'sent':>5} {'recv':>5} {'dispatch ms':>11} {'combine ms':>10} {'HT rel err':>10} {'LL rel err':>10}")
    ok = True
    for r in range(a.ranks):
        row = results[r]
        ll = row["ll_rel_err"]
        ll_s = f"{ll:10.2e}" if isinstance(ll, float) else ll
        print(f"{r:>4} {row['device']:>7} {row['sent']:>5} {row['received']:>5} {row['dispatch_ms']:>11.2f} {row['combine_ms']:>10.2f} "
              f"{row['ht_rel_err']:>10.2e} {ll_s:>10}")
        ok &= row["ht_rel_err"] < 1e-2 and (not isinstance(ll, float) or ll < 1e-2)
    print("all ranks match the reference" if ok else "MISMATCH against the reference")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "60000")
    main()
