"""Timeline of one normal-mode call, host and GPU on one clock: torch.profiler (CUPTI) records
`--calls` calls of each op (host synchronised before each), and for the median call (by host time)
prints every CUDA API call the host made and every kernel the GPU ran, as offsets in µs from the
call's start. The profiler slows the host: its host times are for orientation, bench/host_overhead.py
(with --phases) measures them. It shows what the host of a (not cached) dispatch waits for before the receive
counts come back, for this library and, with `--baseline deepep_v1`, for DeepEP V1 on the same
inputs in the same run.

    torchrun --nproc-per-node 2 bench/ht_timeline.py [--baseline deepep_v1] [--out timeline.json]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from intranode import ht_first_dispatch, ht_inputs, init_cuda_ranks  # noqa: E402


def timeline(name, fn, calls):
    """{op, host_us, events: [(offset µs, duration µs, 'api'|'kernel', name)]} of the median call."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            with record_function("timeline_call"):
                fn()
            torch.cuda.synchronize()
    evs = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    spans = sorted((e for e in evs if e.name == "timeline_call" and e.device_type == cpu), key=lambda e: e.time_range.start)
    gpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
    api = [e for e in evs if e.device_type == cpu and e.name.startswith(("cuda", "cu"))
           and not e.name.startswith(("cudaDeviceSynchronize", "cudaStreamSynchronize"))]
    calls_out = []
    for i, s in enumerate(spans):
        t0 = s.time_range.start
        t1 = spans[i + 1].time_range.start if i + 1 < len(spans) else float("inf")
        rows = [(a.time_range.start - t0, a.time_range.elapsed_us(), "api", a.name) for a in api
                if s.time_range.start <= a.time_range.start <= s.time_range.end]
        rows += [(k.time_range.start - t0, k.time_range.elapsed_us(), "kernel", k.name) for k in gpu if t0 <= k.time_range.start < t1]
        calls_out.append({"host_us": s.time_range.elapsed_us(), "events": sorted(rows)})  # host: the Python call, profiler on
    calls_out.sort(key=lambda c: c["host_us"])
    mid = calls_out[len(calls_out) // 2]
    return {"op": name, "calls": calls, "host_us_median": mid["host_us"], "events": mid["events"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sms", type=int, default=20)
    p.add_argument("--baseline", choices=["deepep_v1"], nargs="*", default=[])
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world, dev, group = init_cuda_ranks()
    torch.manual_seed(rank)
    n, h, e, k = args.tokens, args.hidden, 256, 8
    x, idx, w = ht_inputs(n, h, e, k, dev)
    out = []
    ht = deep_ep_rs.Buffer(group, 2_000_000_000, 0, explicitly_destroy=True)
    cfg, ccfg, kw, recv_x, handle = ht_first_dispatch(ht, deep_ep_rs.Config, x, idx, w, e, args.sms)
    out.append(dict(impl="deep_ep", **timeline("dispatch", lambda: ht.dispatch(x, topk_idx=idx, topk_weights=w, **kw), args.calls)))
    out.append(dict(impl="deep_ep", **timeline("cached_dispatch_bf16", lambda: ht.dispatch(x, handle=handle, config=cfg), args.calls)))
    out.append(dict(impl="deep_ep", **timeline("combine", lambda: ht.combine(recv_x, handle, config=ccfg), args.calls)))
    ht.destroy()
    if "deepep_v1" in args.baseline:
        from deepep_v1 import HT
        v1 = HT(group, 2_000_000_000)
        dcfg, dccfg, kw1, rx1, h1 = ht_first_dispatch(v1.buf, v1.dep.Config, x, idx, w, e, args.sms)
        out.append(dict(impl="deepep_v1", **timeline("dispatch", lambda: v1.buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw1),
                                                     args.calls)))
        out.append(dict(impl="deepep_v1", **timeline("cached_dispatch_bf16", lambda: v1.buf.dispatch(x, handle=h1, config=dcfg),
                                                     args.calls)))
        out.append(dict(impl="deepep_v1", **timeline("combine", lambda: v1.buf.combine(rx1, h1, config=dccfg), args.calls)))
        v1.destroy()
    if rank == 0:
        for r in out:
            print(f"== {r['impl']} {r['op']}: host {r['host_us_median']:.1f} us (median of {r['calls']} calls, rank 0)")
            for off, dur, kind, name in r["events"]:
                print(f"   {off:8.1f} +{dur:7.1f}  {kind:6} {name[:90]}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world": world, "rows": out}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
