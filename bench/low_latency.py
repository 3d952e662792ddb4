"""Low-latency benchmark: deep_ep low_latency_dispatch / low_latency_combine beside the naive
torch.distributed.all_to_all_single baseline, measured in the same run.

    torchrun --nproc-per-node 4 bench/low_latency.py --tokens 128 --out bench/results/DATE-low-latency-ep4.json
    torchrun --nproc-per-node 4 bench/low_latency.py --tokens 1 2 4 ... 512 --plot sweep.png --out ...

For each token count N (num_max_dispatch_tokens_per_rank = N; DeepEP's shape: 128, hidden 7168,
top-8 of 288 experts, FP8 dispatch, BF16 combine):
- `graph: true` rows: two calls (alternating buffer halves, as consecutive calls in a model)
  captured in one CUDA graph, replayed back to back; time per call = elapsed / (2 * replays);
  `dispatch+combine` is one whole step (dispatch -> combine) per replay: this library's with the
  partial combine (dispatch with weights) and with rows (without: DeepEP's callers' step).
- eager rows: CUDA events around each call, median; with `send_us` / `recv_us` from the hook
  split (send op timed, all ranks synchronised, then the receive hook timed: data already there).
- `torch_all_to_all`: the naive baseline (counts exchange + all_to_all_single of deduplicated
  tokens, host sync), BF16 payload both ways, median per call.
With `--hook`, `combine: rows+hook` is the rows step in hook mode (the send ops, then their receive
hooks, in one graph): the two-launch kernels, for both libraries. With `--logfmt`, `dtype: logfmt`
is the rows combine with LogFMT-encoded rows (`use_logfmt=True`), for both libraries: on the randn
outputs (groups over 1 travel raw) and, `dtype: logfmt-cast`, on the outputs scaled by 2^-6 (cast).
`combine: partial` rows answer a dispatch that carried `topk_weights` (one partial sum per
(token, expert rank) on the wire); `rows` answer one without (DeepEP's one row per (token,
expert)). Every combine uses the handle of the latest dispatch (a combine whose dispatch half was
overwritten by later dispatches falls back to rows, which is what the combine rows of this bench
measured before 2026-11-21, session 6). Times are the slowest rank's. Logical GB/s counts every received (token, expert) pair × its bytes
(FP8: H + H/128*4, BF16: 2H), DeepEP's LL convention.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deep_ep_rs  # noqa: E402
from intranode import baseline, timed, write_record  # noqa: E402


def slowest(v):
    t = torch.tensor([float(v)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def capture(fn, warm=5):
    """`fn` run once eagerly, then captured in a CUDA graph that is replayed `warm` times; every rank
    synchronised after. Returns the graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    return g


def graph_time(fn, calls, replays):
    """Captures `fn` (which issues `calls` ops) once, replays it back to back; us per op."""
    g = capture(fn)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    us = s.elapsed_time(e) * 1e3 / (replays * calls)
    del g
    return slowest(us)


def split_time(send, iters):
    """Hook mode: median send-op time and median receive-hook time (data already arrived)."""
    ts, tr = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        hook = send()
        b.record()
        torch.cuda.synchronize()
        dist.barrier()
        b2 = torch.cuda.Event(enable_timing=True)
        b2.record()
        hook()
        c.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b) * 1e3)
            tr.append(b2.elapsed_time(c) * 1e3)
    ts.sort()
    tr.sort()
    return slowest(ts[len(ts) // 2]), slowest(tr[len(tr) // 2])


def hook_step(buf, x, idx, t, e, y, w, out):
    """The rows step in hook mode (SGLang's two-batch overlap captures it so): the FP8 dispatch's
    send op (no weights), its receive hook, the rows combine's send op, its hook."""
    r = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True, return_recv_hook=True)
    r[4]()
    buf.low_latency_combine(y, idx, w, r[2], out=out, return_recv_hook=True)[2]()


def v1_hook_step(v1, x, idx, y, w, out):
    """hook_step on DeepEP V1's buffer (bench/deepep_v1.py's LL)."""
    r = v1.dispatch(x, idx, hook=True)
    r[4]()
    v1.combine(y, idx, w, r[2], hook=True, out=out)[2]()


def ll_inputs(n, args, rank):
    """This rank's inputs for n tokens (seeded by rank): x [n, hidden] BF16, topk_idx [n, topk] of
    distinct experts, topk_weights [n, topk] FP32."""
    torch.manual_seed(1000 + rank)
    x = torch.randn(n, args.hidden, dtype=torch.bfloat16, device="cuda")
    scores = torch.randn(n, args.experts, device="cuda").abs() + 1
    return x, scores.topk(args.topk, dim=-1).indices, torch.rand(n, args.topk, device="cuda")


def ll_setup(args):
    """NCCL process group over torchrun's ranks and the LL buffers for the largest of args.tokens:
    (rank, world, this library's buffer, DeepEP V1's or None without --baseline deepep_v1)."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    size = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(max(args.tokens), args.hidden, world, args.experts)
    buf = deep_ep_rs.Buffer(dist.new_group(list(range(world))), 0, size, low_latency_mode=True, explicitly_destroy=True)
    v1 = None
    if "deepep_v1" in args.baseline:
        from deepep_v1 import LL
        v1 = LL(dist.new_group(list(range(world))), max(max(args.tokens), 1), args.hidden, args.experts)
    return rank, world, buf, v1


def run_case(buf, args, n, rank, world, v1=None):
    h, k, e = args.hidden, args.topk, args.experts
    t = max(n, 1)
    x, idx, w = ll_inputs(n, args, rank)
    rows = []

    def row(op, dtype, us, pairs_bytes, impl="deep_ep", graph=False, **extra):
        r = {"op": op, "mode": "low-latency", "impl": impl, "dtype": dtype, "ranks": world, "tokens": n, "hidden": h, "topk": k,
             "experts": e, "sms": None, "graph": graph, "us_median": us, "us_min": None, "us_max": None,
             "logical_gbps": pairs_bytes / (us * 1e-6) / 1e9 if us > 0 else 0.0}
        r.update(extra)
        rows.append(r)

    def disp(fp8, hook=False, weights=True):
        return buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8, return_recv_hook=hook, topk_weights=w if weights else None)

    recv, count, handle, _, _ = disp(False)
    torch.cuda.synchronize()
    pairs = slowest(int(count.sum()))
    fp8_bytes, bf16_bytes = pairs * (h + h // 128 * 4), pairs * h * 2
    y = recv.clone()
    out = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")

    # Expert outputs scaled by 2^-6 (exact): every 128-channel group's amax below 1, so LogFMT casts
    # them (`logfmt-cast` rows); the randn rows' groups reach ~4 and travel raw (`logfmt` rows).
    y_cast = y * 2.0**-6

    def comb(hd, hook=False, logfmt=False, ys=None):
        return buf.low_latency_combine(y if ys is None else ys, idx, w, hd, out=out, return_recv_hook=hook, use_logfmt=logfmt)

    def two(f):
        return lambda: (f(), f())

    def fresh(weights=True):
        """The handle of a dispatch issued now: a combine answers the latest dispatch of its
        handle (one partial sum per (token, expert rank) when that dispatch carried the weights;
        one row per (token, expert) without them, DeepEP's format)."""
        hd = disp(False, weights=weights)[2]
        torch.cuda.synchronize()
        return hd

    row("dispatch", "fp8", graph_time(two(lambda: disp(True)), 2, args.replays), fp8_bytes, graph=True)
    row("dispatch", "bf16", graph_time(two(lambda: disp(False)), 2, args.replays), bf16_bytes, graph=True)
    hp = fresh()
    row("combine", "bf16", graph_time(two(lambda: comb(hp)), 2, args.replays), bf16_bytes, graph=True, combine="partial")
    hr = fresh(weights=False)
    row("combine", "bf16", graph_time(two(lambda: comb(hr)), 2, args.replays), bf16_bytes, graph=True, combine="rows")
    row("dispatch+combine", "fp8/bf16", graph_time(lambda: comb(disp(True)[2]), 1, args.replays), fp8_bytes + bf16_bytes, graph=True,
        combine="partial")
    # The step DeepEP's callers run (their dispatch carries no weights): FP8 dispatch -> rows combine.
    row("dispatch+combine", "fp8/bf16", graph_time(lambda: comb(disp(True, weights=False)[2]), 1, args.replays), fp8_bytes + bf16_bytes,
        graph=True, combine="rows")
    if args.logfmt:
        # The rows combine with LogFMT-encoded rows (DeepEP's use_logfmt): the two-launch kernels.
        row("combine", "logfmt", graph_time(two(lambda: comb(hr, logfmt=True)), 2, args.replays), bf16_bytes, graph=True, combine="rows")
        row("combine", "logfmt-cast", graph_time(two(lambda: comb(hr, logfmt=True, ys=y_cast)), 2, args.replays), bf16_bytes, graph=True,
            combine="rows")
    if args.hook:
        # The same step in hook mode: the two-launch kernels, which the rows above do not run.
        row("dispatch+combine", "fp8/bf16", graph_time(lambda: hook_step(buf, x, idx, t, e, y, w, out), 1, args.replays), fp8_bytes + bf16_bytes,
            graph=True, combine="rows+hook")
    d_send, d_recv = split_time(lambda: disp(True, True)[4], args.iters)
    row("dispatch", "fp8", timed(lambda: disp(True), args.iters)[0], fp8_bytes, send_us=d_send, recv_us=d_recv)
    hp = fresh()
    c_send, c_recv = split_time(lambda: comb(hp, True)[2], args.iters)
    row("combine", "bf16", timed(lambda: comb(hp), args.iters)[0], bf16_bytes, send_us=c_send, recv_us=c_recv, combine="partial")
    # A whole eager step (dispatch FP8 -> combine), each timed with a host sync before it, so the host
    # work of both calls is on the critical path (what prefill or an uncaptured decode pays).
    row("dispatch+combine", "fp8/bf16", timed(lambda: comb(disp(True)[2]), args.iters)[0], fp8_bytes + bf16_bytes, combine="partial")
    row("dispatch+combine", "fp8/bf16", timed(lambda: comb(disp(True)[2]), args.iters, pipelined=True)[0], fp8_bytes + bf16_bytes,
        combine="partial", timing="pipelined")
    if v1 is not None:
        v1_rows(v1, args, x, idx, w, fp8_bytes, bf16_bytes, row, hook=args.hook, logfmt=args.logfmt)
    in_rank = torch.zeros(n, world, dtype=torch.bool, device="cuda")
    in_rank.scatter_(1, idx // (e // world), True)
    bd, bc, _ = baseline(x, in_rank, world, args.iters)
    row("dispatch", "bf16", bd[0], bf16_bytes, impl="torch_all_to_all")
    row("combine", "bf16", bc[0], bf16_bytes, impl="torch_all_to_all")
    return rows


def v1_rows(v1, args, x, idx, w, fp8_bytes, bf16_bytes, row, hook=False, logfmt=False):
    """DeepEP V1's low-latency dispatch (FP8) and combine (its per-expert rows) on the same inputs:
    graph replays, eager calls and the eager step, as for this library (with `hook`, also the
    step in hook mode; with `logfmt`, also the LogFMT combine). Rows go through `row`; DeepEP's LL buffer is sized for the largest
    --tokens value, as this library's."""
    y = v1.dispatch(x, idx, use_fp8=False)[0].clone()
    out = torch.empty(x.size(0), x.size(1), dtype=torch.bfloat16, device="cuda")

    def disp():
        return v1.dispatch(x, idx)

    y_cast = y * 2.0**-6  # as this library's logfmt-cast rows

    def comb(hd, logfmt=False, ys=None):
        return v1.combine(y if ys is None else ys, idx, w, hd, out=out, logfmt=logfmt)

    def two(f):
        return lambda: (f(), f())

    kw = dict(impl="deepep_v1")
    row("dispatch", "fp8", graph_time(two(disp), 2, args.replays), fp8_bytes, graph=True, **kw)
    hd = disp()[2]
    torch.cuda.synchronize()
    row("combine", "bf16", graph_time(two(lambda: comb(hd)), 2, args.replays), bf16_bytes, graph=True, combine="rows", **kw)
    if logfmt:
        row("combine", "logfmt", graph_time(two(lambda: comb(hd, logfmt=True)), 2, args.replays), bf16_bytes, graph=True, combine="rows", **kw)
        row("combine", "logfmt-cast", graph_time(two(lambda: comb(hd, logfmt=True, ys=y_cast)), 2, args.replays), bf16_bytes, graph=True,
            combine="rows", **kw)
    row("dispatch+combine", "fp8/bf16", graph_time(lambda: comb(disp()[2]), 1, args.replays), fp8_bytes + bf16_bytes, graph=True,
        combine="rows", **kw)
    if hook:
        row("dispatch+combine", "fp8/bf16", graph_time(lambda: v1_hook_step(v1, x, idx, y, w, out), 1, args.replays), fp8_bytes + bf16_bytes,
            graph=True, combine="rows+hook", **kw)
    row("dispatch", "fp8", timed(disp, args.iters)[0], fp8_bytes, **kw)
    hd = disp()[2]
    torch.cuda.synchronize()
    row("combine", "bf16", timed(lambda: comb(hd), args.iters)[0], bf16_bytes, combine="rows", **kw)
    row("dispatch+combine", "fp8/bf16", timed(lambda: comb(disp()[2]), args.iters)[0], fp8_bytes + bf16_bytes, combine="rows", **kw)
    row("dispatch+combine", "fp8/bf16", timed(lambda: comb(disp()[2]), args.iters, pipelined=True)[0], fp8_bytes + bf16_bytes,
        combine="rows", timing="pipelined", **kw)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--tokens", type=int, nargs="+", default=[128])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--baseline", choices=["deepep_v1"], nargs="*", default=[],
                   help="also time DeepEP V1 (PYTHONPATH must give the real deep_ep) on the same inputs")
    p.add_argument("--logfmt", action="store_true",
                   help="also the rows combine with LogFMT rows (graph replays; both libraries)")
    p.add_argument("--hook", action="store_true",
                   help="also the step FP8 dispatch -> rows combine in hook mode (graph replays; both libraries)")
    args = p.parse_args()
    rank, world, buf, v1 = ll_setup(args)
    rows = []
    for n in args.tokens:
        rows += run_case(buf, args, n, rank, world, v1=v1)
    buf.destroy()
    if v1 is not None:
        v1.destroy()
    if rank == 0:
        print(f"{'op':>17} {'impl':>17} {'dtype':>8} {'combine':>8} {'tokens':>6} {'graph':>5} {'timing':>9} {'us':>8} {'send':>6} {'recv':>6} {'GB/s':>7}  vs naive")
        base = {(r["op"], r["tokens"]): r["us_median"] for r in rows if r["impl"] == "torch_all_to_all"}
        for r in rows:
            ref = base.get((r["op"], r["tokens"]))
            ratio = f"{ref / r['us_median']:.1f}x" if ref and r["impl"] != "torch_all_to_all" else ""
            print(f"{r['op']:>17} {r['impl']:>17} {r['dtype']:>8} {r.get('combine', ''):>8} {r['tokens']:>6} {str(r['graph']):>5} {r.get('timing', 'synced'):>9} {r['us_median']:>8.1f} "
                  f"{r.get('send_us', 0):>6.1f} {r.get('recv_us', 0):>6.1f} {r['logical_gbps']:>7.1f}  {ratio}")
        if args.out:
            write_record(args.out, "bench/low_latency.py", world, rows)
        if args.plot:
            plot(rows, args.plot)
    dist.destroy_process_group()


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    def key_of(r):
        return (r["op"], r["impl"], r["dtype"], r.get("combine", ""), r["graph"])

    for key in sorted({key_of(r) for r in rows}):
        pts = sorted((r["tokens"], r["us_median"]) for r in rows if key_of(r) == key)
        if len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]} {key[2]} {key[3]}{' graph' if key[4] else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("us per call")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
