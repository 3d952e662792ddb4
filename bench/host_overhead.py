"""Host time of one call of every op, from Python, on a warm buffer: the CPU clock around the call,
with the GPU idle before it (synchronised) and without waiting for the GPU after it.

    torchrun --nproc-per-node 1 bench/host_overhead.py [--baseline deepep_v1] --out bench/results/DATE-host-1gpu.json
    torchrun --nproc-per-node 4 bench/host_overhead.py --baseline deepep_v1 --out ...

Rows (`"mode": "host"`): `us_median` / `us_p10` / `us_p90` of `--samples` calls per op, slowest rank's
median. The host's speed drifts by up to 2x between runs (bench/NOTES-2026-11-27.md, session 15), so every
(op, impl) is timed in `--rounds` rounds taking turns with the others, all buffers alive at once:
a slow spell then hits both libraries alike. `ratio_vs_v1` (this library / DeepEP, < 1 is better)
is the median over rounds of the per-round ratio. `impl`: `deep_ep` (the `Buffer` methods, what frameworks call), `deep_ep_raw` (the
`torch.ops.deep_ep.*` op alone, from the same prepared arguments, below autograd as the `Buffer`
methods call it: the Python wrapper's share is the difference; `buffer_info`: the crossing into
the library for one int argument), `deepep_v1` (DeepEP V1's `Buffer`, same inputs; its normal mode needs >= 2
ranks), `torch` (reference points: an empty CUDA tensor, one elementwise kernel, one bare kernel
launch through pybind: `cuda_launch`).
`dispatch` (not cached) waits on the host for the receive counts in both libraries (DeepEP's
design), so its host time includes GPU time; every other op returns without waiting.
Shapes: LL 128 tokens x 7168, top-8 of 288 experts (FP8 dispatch, BF16 combine); normal mode
4096 tokens x 7168, top-8 of 256 at 20 SMs. Without a GPU (CPU backend, tiny shapes) the script
checks itself: the CPU backend's ops do their copies on the host, so those times are not host
overhead.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from intranode import ht_first_dispatch, ht_inputs, per_token_cast_to_fp8, write_record  # noqa: E402

ops = torch.ops.deep_ep


def host_samples(fn, samples, sync):
    """Sorted µs of host time of `samples` calls of `fn` (GPU idle before each call)."""
    ts = []
    for _ in range(samples):
        sync()
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    sync()
    ts.sort()
    return ts


def slowest(vals, dev):
    t = torch.tensor(vals, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def setup_ll(add, teardown, args, dev, group, world, cuda, sync):
    """The low-latency rows (a function of its own: each section's lambdas keep their own inputs)."""
    h = args.hidden
    t, e, k = args.ll_tokens, 288, 8
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
    idx = (torch.randn(t, e, device=dev).abs() + 1).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev)
    size = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
    ll = deep_ep_rs.Buffer(group, 0, size, low_latency_mode=True, explicitly_destroy=True, device=dev)
    recv, count, hd, _, _ = ll.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    y = recv.clone()
    out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    sync()
    add("low_latency_dispatch", "deep_ep", lambda: ll.low_latency_dispatch(x, idx, t, e, use_fp8=True), tokens=t)
    add("low_latency_dispatch", "deep_ep_raw", lambda: ops.low_latency_dispatch(ll.handle, x, idx, None, None, None, t, e, True, False,
                                                                                False), tokens=t)
    hd = ll.low_latency_dispatch(x, idx, t, e, use_fp8=True)[2]
    add("low_latency_combine", "deep_ep", lambda: ll.low_latency_combine(y, idx, w, hd, out=out), tokens=t)
    src_info, layout_range = hd[0], hd[1]
    add("low_latency_combine", "deep_ep_raw", lambda: ops.low_latency_combine(ll.handle, y, idx, w, src_info, layout_range, out, None, t,
                                                                              e, False, False, None), tokens=t)
    add("low_latency_step", "deep_ep", lambda: ll.low_latency_combine(y, idx, w, ll.low_latency_dispatch(x, idx, t, e)[2], out=out),
        tokens=t)
    # Without `out` (callers that let the combine allocate its output): this library's Python layer
    # allocates it, DeepEP's C++ does.
    add("low_latency_combine_alloc", "deep_ep", lambda: ll.low_latency_combine(y, idx, w, hd), tokens=t)
    teardown.append(ll.destroy)
    if "deepep_v1" in args.baseline and cuda:
        from deepep_v1 import LL
        v1 = LL(group, t, h, e)
        y1 = v1.dispatch(x, idx, use_fp8=False)[0].clone()
        sync()
        add("low_latency_dispatch", "deepep_v1", lambda: v1.dispatch(x, idx), tokens=t)
        hd1 = v1.dispatch(x, idx)[2]
        add("low_latency_combine", "deepep_v1", lambda: v1.combine(y1, idx, w, hd1, out=out), tokens=t)
        add("low_latency_combine_alloc", "deepep_v1", lambda: v1.combine(y1, idx, w, hd1), tokens=t)
        add("low_latency_step", "deepep_v1", lambda: v1.combine(y1, idx, w, v1.dispatch(x, idx)[2], out=out), tokens=t)
        teardown.append(v1.destroy)


def setup_ht(add, teardown, args, dev, group, world, cuda, sync):
    """The normal-mode rows."""
    h = args.hidden
    n, e, k = args.ht_tokens, 256, 8
    x, idx, w = ht_inputs(n, h, e, k, dev)
    x8 = per_token_cast_to_fp8(x)
    x8 = (x8[0], x8[1].T.contiguous().T)
    nvl = min(2_000_000_000, 1 << 30) if not cuda else 2_000_000_000
    ht = deep_ep_rs.Buffer(group, nvl, 0, explicitly_destroy=True, device=dev)
    cfg, ccfg, kw, recv_x, handle = ht_first_dispatch(ht, deep_ep_rs.Config, x, idx, w, e, args.sms)
    sync()
    add("get_dispatch_layout", "deep_ep", lambda: ht.get_dispatch_layout(idx, e), tokens=n)
    add("dispatch", "deep_ep", lambda: ht.dispatch(x, topk_idx=idx, topk_weights=w, **kw), tokens=n, waits_for_gpu=True)
    add("cached_dispatch_bf16", "deep_ep", lambda: ht.dispatch(x, handle=handle, config=cfg), tokens=n)
    add("cached_dispatch_fp8", "deep_ep", lambda: ht.dispatch(x8, handle=handle, config=cfg), tokens=n)
    add("combine", "deep_ep", lambda: ht.combine(recv_x, handle, config=ccfg), tokens=n)
    c = cfg.to_list()
    below = torch._C._AutoDispatchBelowAutograd  # as the Buffer methods call them (no Python autograd kernel)

    def raw_dispatch():
        with below():
            ops.cached_dispatch(ht.handle, x, None, *handle, c)

    def raw_combine():
        with below():
            ops.combine(ht.handle, recv_x, None, None, None, *handle, c)

    add("cached_dispatch_bf16", "deep_ep_raw", raw_dispatch, tokens=n)
    add("combine", "deep_ep_raw", raw_combine, tokens=n)
    teardown.append(ht.destroy)
    if "deepep_v1" in args.baseline and cuda and world >= 2:
        from deepep_v1 import HT
        v1 = HT(group, 2_000_000_000)
        dcfg, dccfg, kw1, rx1, h1 = ht_first_dispatch(v1.buf, v1.dep.Config, x, idx, w, e, args.sms)
        sync()
        add("get_dispatch_layout", "deepep_v1", lambda: v1.buf.get_dispatch_layout(idx, e), tokens=n)
        add("dispatch", "deepep_v1", lambda: v1.buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw1), tokens=n, waits_for_gpu=True)
        add("cached_dispatch_bf16", "deepep_v1", lambda: v1.buf.dispatch(x, handle=h1, config=dcfg), tokens=n)
        add("cached_dispatch_fp8", "deepep_v1", lambda: v1.buf.dispatch(x8, handle=h1, config=dcfg), tokens=n)
        add("combine", "deepep_v1", lambda: v1.buf.combine(rx1, h1, config=dccfg), tokens=n)
        teardown.append(v1.destroy)


def timed_rounds(entries, args, sync, dev, world):
    """Rows of every (op, impl), timed in `args.rounds` rounds taking turns."""
    rounds = max(1, args.rounds)
    per = max(1, args.samples // rounds)
    samples = [[] for _ in entries]
    medians = [[] for _ in entries]
    for _ in range(rounds):
        for i, (_, _, fn, _) in enumerate(entries):
            ts = host_samples(fn, per, sync)
            samples[i] += ts
            medians[i].append(ts[len(ts) // 2])
    rows = []
    for i, (op, impl, _, extra) in enumerate(entries):
        ts = sorted(samples[i])
        t = slowest([ts[len(ts) // 2], ts[len(ts) // 10], ts[(len(ts) * 9) // 10]] + medians[i], dev)
        rows.append({"op": op, "mode": "host", "impl": impl, "ranks": world, "us_median": t[0], "us_p10": t[1], "us_p90": t[2],
                     "round_medians": t[3:], "rounds": rounds, "device": str(dev), **extra})
    for r in rows:  # this library / DeepEP per round (same slow spells), median over rounds
        ref = next((q for q in rows if q["impl"] == "deepep_v1" and q["op"] == r["op"]), None)
        if ref and r["impl"] in ("deep_ep", "deep_ep_raw"):
            ratios = sorted(a / b for a, b in zip(r["round_medians"], ref["round_medians"]))
            r["ratio_vs_v1"] = ratios[len(ratios) // 2]
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=200, help="calls timed per (op, impl), over all rounds")
    p.add_argument("--rounds", type=int, default=5, help="rounds taking turns between (op, impl) pairs")
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ht-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sms", type=int, default=20)
    p.add_argument("--baseline", choices=["deepep_v1"], nargs="*", default=[])
    p.add_argument("--ops", nargs="*", default=[], help="only these rows, by op or op:impl (default: all)")
    p.add_argument("--loop", type=float, default=0.0,
                   help="seconds: call each selected op in a loop this long instead of timing it (for a sampling profiler)")
    p.add_argument("--phases", default="", help="PREFIX: the library writes the host time of each phase of its ops' bodies to "
                   "PREFIX.<pid>.json at exit (DEEP_EP_HOST_PHASES; bench/host_phases.py reads them)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.phases:
        os.environ["DEEP_EP_HOST_PHASES"] = args.phases  # read at the first op call
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        sync = torch.cuda.synchronize
    else:
        dev = torch.device("cpu")
        args.hidden, args.ll_tokens, args.ht_tokens = 256, 4, 16

        def sync():
            pass
    group = dist.new_group(list(range(world)))

    entries = []  # (op, impl, fn, extra), timed in rounds after every buffer is set up
    teardown = []

    def add(op, impl, fn, **extra):
        if args.ops and op not in args.ops and f"{op}:{impl}" not in args.ops:
            return
        if args.loop:
            end = time.perf_counter() + args.loop
            while time.perf_counter() < end:
                for _ in range(100):
                    fn()
                sync()
            return
        for _ in range(10):  # warm: allocator blocks, lazy loads
            fn()
        sync()
        entries.append((op, impl, fn, extra))

    torch.manual_seed(rank)
    # ---- reference points: what torch itself costs per call
    a = torch.zeros(1024, device=dev)
    add("torch.empty", "torch", lambda: torch.empty(1024, device=dev))
    add("add_", "torch", lambda: a.add_(1.0))
    if cuda:  # one kernel launch through pybind, no dispatcher: what a launch costs this host
        add("cuda_launch", "torch", lambda: torch._C._cuda_sleep(1))
    # The dispatcher crossing alone: a library op with one int argument and no tensor.
    probe = deep_ep_rs.Buffer(group, 1 << 20, 0, explicitly_destroy=True, device=dev)
    add("buffer_info", "deep_ep_raw", lambda: ops.buffer_info(probe.handle))
    teardown.append(probe.destroy)

    setup_ll(add, teardown, args, dev, group, world, cuda, sync)
    setup_ht(add, teardown, args, dev, group, world, cuda, sync)

    rows = timed_rounds(entries, args, sync, dev, world)
    for f in teardown:
        f()

    if rank == 0:
        print(f"{'op':>22} {'impl':>12} {'median us':>10} {'p10':>7} {'p90':>7}  ours/V1 (per-round median)")
        for r in rows:
            vs = f"{r['ratio_vs_v1']:.2f}" if "ratio_vs_v1" in r else ""
            print(f"{r['op']:>22} {r['impl']:>12} {r['us_median']:>10.1f} {r['us_p10']:>7.1f} {r['us_p90']:>7.1f}  {vs}")
        if args.out:
            write_record(args.out, "bench/host_overhead.py", world, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
