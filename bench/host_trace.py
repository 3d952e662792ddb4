"""Which CUDA runtime/driver calls an op makes on the host, and how long they take: torch.profiler
(CUPTI) traces `--calls` calls of each op at one rank, then, for every call, the CUDA API events
inside the op's span (`deep_ep::<op>` as the dispatcher records it) are summed by name, and so
are the aten ops it calls (output allocations, views; nested aten ops are counted in each).

    torchrun --nproc-per-node 1 bench/host_trace.py [--out trace.json]

The op span is the time inside torch's dispatcher (C++ shim + library + CUDA calls); the rest of
an op's host time (bench/host_overhead.py) is Python and the Python-to-dispatcher crossing.
"""
import argparse
import collections
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from intranode import ht_first_dispatch, ht_inputs, init_cuda_ranks, per_token_cast_to_fp8  # noqa: E402


def trace(name, fn, calls):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    spans, api = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if ev.name.startswith("deep_ep::"):
            spans.append(ev)
        elif ev.name.startswith(("cuda", "cu", "aten::")) and not ev.name.startswith("cudaDeviceSynchronize"):
            api.append(ev)
    top = [s for s in spans if not any(o is not s and o.time_range.start <= s.time_range.start and s.time_range.end <= o.time_range.end
                                       for o in spans)]
    per_name = collections.defaultdict(lambda: [0.0, 0])
    span_us = sum(s.time_range.elapsed_us() for s in top)
    for a in api:
        if any(s.time_range.start <= a.time_range.start <= s.time_range.end for s in top):
            per_name[a.name][0] += a.time_range.elapsed_us()
            per_name[a.name][1] += 1
    n = calls
    row = {"op": name, "calls": calls, "spans": sorted({s.name for s in top}), "span_us_per_call": span_us / n,
           "cuda_api_us_per_call": sum(v[0] for k, v in per_name.items() if not k.startswith("aten::")) / n,
           "cuda_api": {k: {"us_per_call": v[0] / n, "count_per_call": v[1] / n} for k, v in sorted(per_name.items(), key=lambda kv: -kv[1][0])}}
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world, dev, group = init_cuda_ranks()
    h, t, e, k = 7168, 128, 288, 8
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    idx = (torch.randn(t, e, device=dev).abs() + 1).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev)
    ll = deep_ep_rs.Buffer(group, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True,
                           explicitly_destroy=True)
    y = ll.low_latency_dispatch(x, idx, t, e, use_fp8=False)[0].clone()
    out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    rows = [trace("low_latency_dispatch", lambda: ll.low_latency_dispatch(x, idx, t, e), args.calls)]
    hd = ll.low_latency_dispatch(x, idx, t, e)[2]
    rows.append(trace("low_latency_combine", lambda: ll.low_latency_combine(y, idx, w, hd, out=out), args.calls))
    ll.destroy()
    n, e = 4096, 256
    x, idx, w = ht_inputs(n, h, e, k, dev)
    x8 = per_token_cast_to_fp8(x)
    x8 = (x8[0], x8[1].T.contiguous().T)
    ht = deep_ep_rs.Buffer(group, 2_000_000_000, 0, explicitly_destroy=True)
    cfg, ccfg, _, recv_x, handle = ht_first_dispatch(ht, deep_ep_rs.Config, x, idx, w, e, 20)
    rows.append(trace("get_dispatch_layout", lambda: ht.get_dispatch_layout(idx, e), args.calls))
    rows.append(trace("cached_dispatch_bf16", lambda: ht.dispatch(x, handle=handle, config=cfg), args.calls))
    rows.append(trace("combine", lambda: ht.combine(recv_x, handle, config=ccfg), args.calls))
    ht.destroy()
    if rank == 0:
        for r in rows:
            print(f"== {r['op']}: op span {r['span_us_per_call']:.1f} us/call, CUDA API {r['cuda_api_us_per_call']:.1f} us/call ({r['spans']})")
            for name, v in list(r["cuda_api"].items())[:12]:
                print(f"   {v['us_per_call']:7.2f} us  x{v['count_per_call']:.1f}  {name}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
