"""Where the host time of an op goes outside its body (bench/NOTES.md, session 22): the same raw
`torch.ops.deep_ep.*` call timed in variants that each take one suspect away, and a CPU-only
torch.profiler table of the raw calls (every aten op the library's body calls shows up under it).

    torchrun --nproc-per-node 2 bench/host_split.py [--out split.json]

Variants of each op (µs, median of --samples calls, GPU idle before each call, slowest rank):
`raw` the OpOverloadPacket call as bench/host_overhead.py makes it; `default` the `.default`
overload; `nobelow` without the below-autograd guard (HT ops only); `keep` the outputs kept alive
(their free happens outside the clock); `empty_out` torch.empty of the same outputs alone.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from intranode import ht_first_dispatch, ht_inputs, init_cuda_ranks  # noqa: E402

ops = torch.ops.deep_ep


def med(fn, samples):
    ts = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world, dev, group = init_cuda_ranks()
    torch.manual_seed(rank)
    n, h, e, k = 4096, 7168, 256, 8
    x, idx, w = ht_inputs(n, h, e, k, dev)
    ht = deep_ep_rs.Buffer(group, 2_000_000_000, 0, explicitly_destroy=True)
    cfg, ccfg, _, recv_x, handle = ht_first_dispatch(ht, deep_ep_rs.Config, x, idx, w, e, 20)
    c, cc = cfg.to_list(), ccfg.to_list()
    below = torch._C._AutoDispatchBelowAutograd
    keep = []

    def kept(out):
        keep.append(out)
        if len(keep) > 16:
            keep.clear()

    t, le = 128, 288
    ll = deep_ep_rs.Buffer(group, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, le), low_latency_mode=True,
                           explicitly_destroy=True)
    xl = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    il = (torch.randn(t, le, device=dev).abs() + 1).topk(k, dim=-1).indices
    ll.low_latency_dispatch(xl, il, t, le, use_fp8=True)
    rows = recv_x.size(0)

    def cd(op):
        return lambda: op(ht.handle, x, None, *handle, c)

    def cb(op):
        return lambda: op(ht.handle, recv_x, None, None, None, *handle, cc)

    def ld(op):
        return lambda: op(ll.handle, xl, il, None, None, None, t, le, True, False, False)

    def under(fn):
        def f():
            with below():
                return fn()
        return f

    cases = {
        "cached_dispatch": {
            "raw": under(cd(ops.cached_dispatch)), "default": under(cd(ops.cached_dispatch.default)),
            "nobelow": cd(ops.cached_dispatch.default),
            "keep": lambda: kept(under(cd(ops.cached_dispatch.default))()),
            "empty_out": lambda: (torch.empty(rows, h, dtype=torch.bfloat16, device=dev), torch.empty(0, device=dev)),
        },
        "combine": {
            "raw": under(cb(ops.combine)), "default": under(cb(ops.combine.default)), "nobelow": cb(ops.combine.default),
            "keep": lambda: kept(under(cb(ops.combine.default))()),
            "empty_out": lambda: (torch.empty(n, h, dtype=torch.bfloat16, device=dev), torch.empty(0, device=dev)),
        },
        "low_latency_dispatch": {
            "raw": ld(ops.low_latency_dispatch), "default": ld(ops.low_latency_dispatch.default),
            "keep": lambda: kept(ld(ops.low_latency_dispatch.default)()),
        },
    }
    rows_out = []
    for _ in range(3):  # rounds taking turns
        for op, vs in cases.items():
            for v, fn in vs.items():
                for _ in range(10):
                    fn()
                keep.clear()
                rows_out.append((op, v, med(fn, args.samples // 3)))
                keep.clear()
    per = {}
    for op, v, us in rows_out:
        per.setdefault((op, v), []).append(us)
    res = []
    for (op, v), us in per.items():
        t_ = torch.tensor(sorted(us), dtype=torch.float64, device=dev)
        dist.all_reduce(t_, op=dist.ReduceOp.MAX)
        res.append({"op": op, "variant": v, "us_round_medians": t_.tolist()})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            for op in cases:
                cases[op]["default"]()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    if rank == 0:
        for r in res:
            print(f"{r['op']:>22} {r['variant']:>10} " + " ".join(f"{u:7.1f}" for u in r["us_round_medians"]))
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world": world, "rows": res, "profile": table}, f, indent=1)
    ll.destroy()
    ht.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
