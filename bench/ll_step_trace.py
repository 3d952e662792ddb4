"""Where the time of a low-latency step goes inside CUDA graph replays: the GPU start and end of
every kernel of every replay (torch.profiler, CUPTI), for graphs of two dispatches, two combines
and one dispatch -> combine step, this library's and DeepEP V1's.

    torchrun --nproc-per-node 2 bench/ll_step_trace.py --tokens 1 8 128 [--baseline deepep_v1] --out X.json

Shapes as bench/low_latency.py (hidden 7168, top-8 of 288 experts, FP8 dispatch, BF16 combine).
Graphs per token count: `dispatch x2` (FP8 with weights; `bf16 x2`, and `fp8+bf16`: two kernels
taking turns against each alone), `combine x2` (partial and rows answering
the latest dispatch), `step partial` (FP8 dispatch with weights -> partial combine) and `step rows`
(FP8 dispatch without weights -> rows combine: what DeepEP's callers run), `step rows+hook` (the
same in hook mode: four kernels); DeepEP V1: the three dispatch pairs, `combine x2` (rows), `step
rows` and `step rows+hook`. With `--logfmt`, `combine x2 logfmt` (and `logfmt-cast`: outputs scaled by 2^-6, cast) for both (ours: two launches per
combine, the encoding send and the decoding receive apart). Per graph and rank: the replay period, each kernel's
duration and the gaps (kernel i's end to kernel i+1's start; `boundary`: the last kernel's end to
the next replay's first start), medians over the replays. The profiler's own cost inflates gaps
alike for both libraries: compare within a run, and use bench/low_latency.py for the times.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from intranode import short_name, write_record  # noqa: E402
from low_latency import capture, hook_step, ll_inputs, ll_setup, v1_hook_step  # noqa: E402


def kernels_of(prof):
    """[(start_ns, end_ns, name)] of the GPU kernels the profiler saw, by start."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.name().startswith(("Memcpy", "Memset")):
            continue
        out.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    return sorted(out)


def summarise(ks, per):
    """Medians over replays of `per` kernels each: period, durations, gaps, boundary (µs)."""
    n = len(ks) // per
    reps = [ks[i * per:(i + 1) * per] for i in range(n)]
    med = lambda v: round(statistics.median(v) / 1e3, 3) if v else None  # noqa: E731
    return {
        "kernels": [short_name(k[2]) for k in reps[0]] if reps else [],
        "replays": n,
        "period_us": med([reps[i + 1][0][0] - reps[i][0][0] for i in range(n - 1)]),
        "dur_us": [med([r[j][1] - r[j][0] for r in reps]) for j in range(per)],
        "gap_us": [med([r[j + 1][0] - r[j][1] for r in reps]) for j in range(per - 1)],
        "boundary_us": med([reps[i + 1][0][0] - reps[i][-1][1] for i in range(n - 1)]),
    }


def trace(fn, replays):
    """Captures fn once and traces `replays` back-to-back replays: the kernel list and kernels per replay."""
    g = capture(fn, warm=10)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ks = kernels_of(prof)
    del g
    return ks, max(1, len(ks) // replays)


def cases(buf, v1, n, args):
    """{(impl, graph): factory} for token count n (inputs as bench/low_latency.py); factory() -> fn."""
    h, e = args.hidden, args.experts
    x, idx, w = ll_inputs(n, args, dist.get_rank())
    out = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
    t = max(n, 1)

    def disp(weights=True, fp8=True):
        return buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8, topk_weights=w if weights else None)

    y = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)[0].clone()

    y_cast = y * 2.0**-6  # every group's amax below 1: LogFMT casts (the randn outputs travel raw)

    def comb(hd, logfmt=False, ys=None):
        return buf.low_latency_combine(y if ys is None else ys, idx, w, hd, out=out, use_logfmt=logfmt)

    def fresh(weights):
        hd = disp(weights)[2]
        torch.cuda.synchronize()
        return hd

    def twice(weights, logfmt=False, ys=None):
        """Two combines answering a dispatch issued now (the latest one: partial with weights)."""
        hd = fresh(weights)
        return lambda: (comb(hd, logfmt, ys), comb(hd, logfmt, ys))

    # Factories: each is called right before its capture (a combine answers the latest dispatch).
    c = {
        ("deep_ep", "dispatch x2"): lambda: lambda: (disp(), disp()),
        # Two instantiations taking turns against each alone (code the SMs must fetch again per call).
        ("deep_ep", "dispatch bf16 x2"): lambda: lambda: (disp(fp8=False), disp(fp8=False)),
        ("deep_ep", "dispatch fp8+bf16"): lambda: lambda: (disp(), disp(fp8=False)),
        ("deep_ep", "combine x2 partial"): lambda: twice(True),
        ("deep_ep", "combine x2 rows"): lambda: twice(False),
        ("deep_ep", "step partial"): lambda: lambda: comb(disp(True)[2]),
        ("deep_ep", "step rows"): lambda: lambda: comb(disp(False)[2]),
        # Hook mode (SGLang's two-batch overlap): send op, its receive hook, for both ops.
        ("deep_ep", "step rows+hook"): lambda: lambda: hook_step(buf, x, idx, t, e, y, w, out),
    }
    if args.logfmt:
        # LogFMT rows (two launches each: the send's encode and the receive's decode apart).
        c[("deep_ep", "combine x2 logfmt")] = lambda: twice(False, logfmt=True)
        c[("deep_ep", "combine x2 logfmt-cast")] = lambda: twice(False, logfmt=True, ys=y_cast)
    if v1 is not None:
        yv = v1.dispatch(x, idx, use_fp8=False)[0].clone()
        outv = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")

        def v1_twice(logfmt=False, ys=None):
            hv = v1.dispatch(x, idx)[2]
            torch.cuda.synchronize()
            yy = yv if ys is None else ys
            return lambda: (v1.combine(yy, idx, w, hv, out=outv, logfmt=logfmt), v1.combine(yy, idx, w, hv, out=outv, logfmt=logfmt))

        c[("deepep_v1", "dispatch x2")] = lambda: lambda: (v1.dispatch(x, idx), v1.dispatch(x, idx))
        c[("deepep_v1", "dispatch bf16 x2")] = lambda: lambda: (v1.dispatch(x, idx, use_fp8=False), v1.dispatch(x, idx, use_fp8=False))
        c[("deepep_v1", "dispatch fp8+bf16")] = lambda: lambda: (v1.dispatch(x, idx), v1.dispatch(x, idx, use_fp8=False))
        c[("deepep_v1", "combine x2 rows")] = v1_twice
        c[("deepep_v1", "step rows")] = lambda: lambda: v1.combine(yv, idx, w, v1.dispatch(x, idx)[2], out=outv)
        c[("deepep_v1", "step rows+hook")] = lambda: lambda: v1_hook_step(v1, x, idx, yv, w, outv)
        if args.logfmt:
            c[("deepep_v1", "combine x2 logfmt")] = lambda: v1_twice(logfmt=True)
            c[("deepep_v1", "combine x2 logfmt-cast")] = lambda: v1_twice(logfmt=True, ys=yv * 2.0**-6)
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--baseline", choices=["deepep_v1"], nargs="*", default=[])
    p.add_argument("--logfmt", action="store_true", help="also two LogFMT rows combines per replay (both libraries)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rank, world, buf, v1 = ll_setup(args)
    rows = []
    for n in args.tokens:
        for (impl, graph), make in cases(buf, v1, n, args).items():
            ks, per = trace(make(), args.replays)
            s = summarise(ks, per)
            every = [None] * world
            dist.all_gather_object(every, s)
            rows.append({"op": graph, "mode": "low-latency", "impl": impl, "tokens": n, "ranks": world, "per_rank": every})
            if rank == 0:
                for r, v in enumerate(every):
                    print(f"{impl:>10} {graph:>19} {n:>4} rank {r}: period {v['period_us']} dur {v['dur_us']} gap {v['gap_us']} "
                          f"boundary {v['boundary_us']} {v['kernels']}", flush=True)
    buf.destroy()
    if v1 is not None:
        v1.destroy()
    if rank == 0 and args.out:
        write_record(args.out, "bench/ll_step_trace.py", world, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
