"""Per-kernel device time of each deep_ep op, from torch.profiler, beside the op's own time.

    torchrun --nproc-per-node 4 bench/profile.py --out profile.json

For every op (HT cached dispatch BF16/FP8, HT combine, LL dispatch FP8/BF16, LL combine) it runs
`--iters` calls under the profiler on every rank and reports, for rank 0 and for the slowest rank,
each CUDA kernel's mean duration and count per call, the sum of kernel time per call and the
op's event-timed wall per call. The gap between the two is launch, host work and waits between
kernels; the kernel list shows where the device time goes (bench/NOTES.md uses it for the
µs accounting).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import deep_ep_rs
from intranode import per_token_cast_to_fp8, short_name


def kernel_table(fn, iters, graph=False):
    """Runs fn `iters` times (or one CUDA graph of fn replayed `iters` times) under the profiler:
    ({kernel: (µs per call, launches per call)}, wall µs per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s.record()
        for _ in range(iters):
            run()
        e.record()
        torch.cuda.synchronize()
    table = {}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = ev.cuda_time_total
        if dev_us <= 0 or ev.key.startswith("cuda"):
            continue
        name = short_name(ev.key)
        us, cnt = table.get(name, (0.0, 0.0))
        table[name] = (us + dev_us / iters, cnt + ev.count / iters)
    return table, s.elapsed_time(e) * 1e3 / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sms", type=int, default=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(1000 + rank)
    h, n = args.hidden, args.tokens
    results = {}

    buf = deep_ep_rs.Buffer(dist.new_group(list(range(world))), 2_000_000_000, 0, explicitly_destroy=True)
    x = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    idx = (torch.randn(n, 256, device="cuda").abs() + 1).topk(8, dim=-1, sorted=False).indices
    w = torch.rand(n, 8, device="cuda")
    cfg = deep_ep_rs.Config(args.sms, 6, 256, 6, 128)
    ccfg = deep_ep_rs.Config(args.sms, 9, 256, 6, 128)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 256)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, config=cfg)
    x8 = per_token_cast_to_fp8(x)
    x8 = (x8[0], x8[1].T.contiguous().T)  # scales column-major, as bench/intranode.py passes them
    results["ht_dispatch_bf16"] = kernel_table(lambda: buf.dispatch(x, handle=handle, config=cfg), args.iters)
    results["ht_dispatch_fp8"] = kernel_table(lambda: buf.dispatch(x8, handle=handle, config=cfg), args.iters)
    results["ht_combine_bf16"] = kernel_table(lambda: buf.combine(recv_x, handle, config=ccfg), args.iters)
    buf.destroy()

    m, e = args.ll_tokens, 288
    hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(m, h, world, e)
    buf = deep_ep_rs.Buffer(dist.new_group(list(range(world))), 0, hint, low_latency_mode=True, explicitly_destroy=True)
    lx = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    lidx = (torch.randn(m, e, device="cuda").abs() + 1).topk(8, dim=-1).indices
    lw = torch.rand(m, 8, device="cuda")
    # With topk_weights (as bench/low_latency.py) combine sends one partial sum per (token, rank);
    # without them one row per (token, expert): both combine formats are profiled.
    recv, _, _, _, _ = buf.low_latency_dispatch(lx, lidx, m, e, use_fp8=False, topk_weights=lw)
    _, _, rows_handle, _, _ = buf.low_latency_dispatch(lx, lidx, m, e, use_fp8=False)
    y = recv.clone()
    out = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")
    for graph in (False, True):
        tag = "_graph" if graph else ""
        results["ll_dispatch_fp8" + tag] = kernel_table(lambda: buf.low_latency_dispatch(lx, lidx, m, e, use_fp8=True, topk_weights=lw), args.iters, graph)
        results["ll_dispatch_bf16" + tag] = kernel_table(lambda: buf.low_latency_dispatch(lx, lidx, m, e, use_fp8=False, topk_weights=lw), args.iters, graph)
        # Partial sums need the messages of the dispatch that made the handle (the latest one of
        # its buffer half), so this entry times a BF16 dispatch + combine pair; its table lists
        # both ops' kernels (each op's send and receive halves are launches of one kernel, ll::dispatch / ll::combine).
        def pair():
            _, _, h2, _, _ = buf.low_latency_dispatch(lx, lidx, m, e, use_fp8=False, topk_weights=lw)
            buf.low_latency_combine(y, lidx, lw, h2, out=out)
        results["ll_dispatch_combine_partial" + tag] = kernel_table(pair, args.iters, graph)
        results["ll_combine_rows" + tag] = kernel_table(lambda: buf.low_latency_combine(y, lidx, lw, rows_handle, out=out), args.iters, graph)
    buf.destroy()

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        for op in results:
            walls = [g[op][1] for g in gathered]
            slow = max(range(world), key=lambda r: walls[r])
            print(f"== {op}: wall/call rank0 {walls[0]:.1f} µs, slowest rank {slow} {walls[slow]:.1f} µs")
            for r in sorted({0, slow}):
                table, wall = gathered[r][op]
                total = sum(us for us, _ in table.values())
                print(f"   rank {r}: kernels {total:.1f} µs/call of {wall:.1f}")
                for k, (us, cnt) in sorted(table.items(), key=lambda kv: -kv[1][0]):
                    print(f"     {us:8.1f} µs  x{cnt:4.1f}  {k}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "tokens": n, "ll_tokens": m, "hidden": h, "sms": args.sms,
                           "iters": args.iters, "per_rank": gathered}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
