"""Intranode normal-mode benchmark: deep_ep dispatch/combine beside the naive
torch.distributed.all_to_all_single baseline, measured in the same run.

    torchrun --nproc-per-node 4 bench/intranode.py --out bench/results/DATE-intranode-ep4.json

Times are per call (µs), median over iterations after warm-up, slowest rank's median. Logical
GB/s counts every received token (local ones included) × its bytes, DeepEP's convention.
Two timings per case (row field `timing`): `pipelined` is DeepEP's own benchmark method (events
recorded around each call, calls issued back to back with no host sync in between, so host launch
work overlaps the previous call's kernels, as in a training step); `synced` waits for each call
before issuing the next, so it also counts the host-side launch work of every call.
`dispatch` is timed with a cached handle (DeepEP's tuning convention: no host sync);
`dispatch_sync` is the full non-cached call including the host wait for the receive count.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

import torch
import torch.distributed as dist

import deep_ep_rs


def timed(fn, iters, warmup=5, pipelined=False):
    """[median, min, max] µs per call of the slowest rank; `pipelined`: no host sync between calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
        if not pipelined:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in events)
    t = torch.tensor([times[len(times) // 2], times[0], times[-1]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank
    return t.tolist()


def per_token_cast_to_fp8(x):
    n, h = x.shape
    xv = x.float().view(n, h // 128, 128)
    amax = xv.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
    return (xv * (448.0 / amax)).to(torch.float8_e4m3fn).view(n, h), (amax / 448.0).view(n, h // 128)


def baseline(x, is_in_rank, world, iters):
    """The naive all_to_all_single dispatch/combine of the project's baseline script."""
    tok_idx, dst = is_in_rank.nonzero(as_tuple=True)
    order = torch.argsort(dst, stable=True)
    tok_idx, dst = tok_idx[order], dst[order]

    def dispatch():
        send_counts = torch.bincount(dst, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        send = x.index_select(0, tok_idx)
        recv = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(recv, send, rc, sc)
        return recv, sc, rc

    recv, sc, rc = dispatch()

    def combine():
        back = torch.empty(sum(sc), x.shape[1], dtype=recv.dtype, device=x.device)
        dist.all_to_all_single(back, recv, sc, rc)
        return torch.zeros_like(x).index_add_(0, tok_idx, back)

    return timed(dispatch, iters), timed(combine, iters), recv.shape[0]


def run_case(buf, args, tokens, num_sms, rank, world, v1=None, naive=True):
    torch.manual_seed(1000 + rank)
    h, k, e = args.hidden, args.topk, args.experts
    x = torch.randn(tokens, h, dtype=torch.bfloat16, device="cuda")
    scores = torch.randn(tokens, e, device="cuda").abs() + 1
    topk_idx = scores.topk(k, dim=-1, sorted=False).indices
    topk_w = torch.rand(tokens, k, device="cuda")
    cfg = deep_ep_rs.Config(num_sms, *args.dispatch_cfg)
    ccfg = deep_ep_rs.Config(num_sms, *args.combine_cfg)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)
    kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, config=cfg)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_w, **kw)
    recv_tokens = recv_x.shape[0]
    rows = []

    def row(op, dtype, times, nbytes, impl="deep_ep", sms=num_sms, timing="synced"):
        rows.append({"op": op, "mode": "intranode", "impl": impl, "dtype": dtype, "ranks": world, "tokens": tokens, "hidden": h,
                     "topk": k, "experts": e, "sms": sms, "graph": False, "timing": timing, "us_median": times[0],
                     "us_min": times[1], "us_max": times[2], "logical_gbps": nbytes / (times[0] * 1e-6) / 1e9})

    def both(op, dtype, fn, nbytes):
        for timing in ("pipelined", "synced"):
            row(op, dtype, timed(fn, args.iters, pipelined=timing == "pipelined"), nbytes, timing=timing)

    bf16_bytes = recv_tokens * h * 2
    both("dispatch", "bf16", lambda: buf.dispatch(x, handle=handle, config=cfg), bf16_bytes)
    row("dispatch_sync", "bf16", timed(lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_w, **kw), args.iters), bf16_bytes)
    x8 = per_token_cast_to_fp8(x)
    x8 = (x8[0], x8[1].T.contiguous().T)
    both("dispatch", "fp8", lambda: buf.dispatch(x8, handle=handle, config=cfg), bf16_bytes * (1 + 4 / 128) / 2)
    both("combine", "bf16", lambda: buf.combine(recv_x, handle, config=ccfg), bf16_bytes)
    if v1 is not None:  # DeepEP V1 on the same inputs, each op at its best chunk size (bench/deepep_v1.py)
        for op, dtype, times, chunk in v1.rows(timed, args.iters, x, x8, topk_idx, topk_w, e, num_sms):
            nbytes = bf16_bytes * (1 + 4 / 128) / 2 if dtype == "fp8" else bf16_bytes
            row(op, dtype, times, nbytes, impl="deepep_v1", timing="pipelined")
            rows[-1]["nvl_chunk"] = chunk
    if naive:
        bd, bc, brecv = baseline(x, in_rank, world, args.iters)
        # The baseline waits on the host for its counts inside every call: pipelined == synced.
        row("dispatch", "bf16", bd, brecv * h * 2, impl="torch_all_to_all", sms=None)
        row("combine", "bf16", bc, brecv * h * 2, impl="torch_all_to_all", sms=None)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--sms", type=int, nargs="+", default=[20])
    p.add_argument("--dispatch-cfg", type=int, nargs=4, default=[6, 256, 6, 128])
    p.add_argument("--combine-cfg", type=int, nargs=4, default=[9, 256, 6, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--nvl-bytes", type=int, default=2_000_000_000)
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--baseline", choices=["deepep_v1"], nargs="*", default=[],
                   help="also time DeepEP V1 (PYTHONPATH must give the real deep_ep) on the same inputs")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    buf = deep_ep_rs.Buffer(dist.new_group(list(range(world))), args.nvl_bytes, 0, explicitly_destroy=True)
    backend = buf.memory_report()["backend"]  # DEEP_EP_BACKEND picks the window provider: recorded with the rows
    v1 = None
    if "deepep_v1" in args.baseline:
        from deepep_v1 import HT
        v1 = HT(dist.new_group(list(range(world))), args.nvl_bytes)
    rows = []
    for tokens in args.tokens:
        for i, sms in enumerate(args.sms):
            rows += run_case(buf, args, tokens, sms, rank, world, v1=v1, naive=i == 0)
    buf.destroy()
    if v1 is not None:
        v1.destroy()
    if rank == 0:
        print(f"{'op':>14} {'impl':>17} {'dtype':>5} {'tokens':>6} {'sms':>4} {'timing':>9} {'us':>9} {'GB/s':>7}  vs naive  vs V1 best")
        base = {(r["op"], r["tokens"]): r["us_median"] for r in rows if r["impl"] == "torch_all_to_all"}
        v1_best = {}
        for r in rows:
            if r["impl"] == "deepep_v1":
                k = (r["op"], r["dtype"], r["tokens"])
                v1_best[k] = min(v1_best.get(k, 1e30), r["us_median"])
        for r in rows:
            ref = base.get((r["op"].replace("_sync", ""), r["tokens"]))
            ratio = f"{ref / r['us_median']:.2f}x" if ref and r["impl"] != "torch_all_to_all" else ""
            vb = v1_best.get((r["op"], r["dtype"], r["tokens"]))
            vr = f"{vb / r['us_median']:.2f}x" if vb and r["impl"] == "deep_ep" and r["timing"] == "pipelined" else ""
            print(f"{r['op']:>14} {r['impl']:>17} {r['dtype']:>5} {r['tokens']:>6} {str(r['sms']):>4} {r['timing']:>9} {r['us_median']:>9.1f} "
                  f"{r['logical_gbps']:>7.1f}  {ratio:>8}  {vr:>8}")
        if args.out:
            write_record(args.out, "bench/intranode.py", world, rows, backend=backend)
        if args.plot:
            plot(rows, args.plot)
    dist.destroy_process_group()


def library_commit():
    """The commit the loaded library was built from: the BUILD_COMMIT (written by setup.py) beside
    the libdeep_ep.so in use ($DEEP_EP_LIBRARY pointing into an unpacked wheel, or the package's
    own copy), or None for a library built otherwise (cargo alone). Not the package's: with
    $DEEP_EP_LIBRARY the Python package may come from another tree (session 23's records named the
    checkout's commit for every wheel that way)."""
    from deep_ep_rs import _lib

    f = os.path.join(os.path.dirname(os.path.abspath(_lib.library_path())), "BUILD_COMMIT")
    return open(f).read().strip() if os.path.exists(f) else None


def short_name(key):
    """Our kernels are `[void ]deep_ep::<ns>::<name><template args>(<params>)` (DeepEP's too); keep
    `<ns>::<name>` (bench/profile.py, bench/ll_step_trace.py)."""
    m = re.search(r"deep_ep::((?:\w+::)*\w+)", key)
    return m.group(1) if m else key[:70]


# Environment variables outside DEEP_EP_* that a record names when set.
RECORDED_ENV = ("CUDA_MODULE_LOADING", "CUDA_LAUNCH_BLOCKING", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def write_record(path, script, world, rows, backend=None):
    """Writes the JSON record of a bench run (date, commit, command, device, versions, this library's
    backend when given, the DEEP_EP_* and RECORDED_ENV settings set, rows); rank 0 only. `git_commit` is the measured
    library's build commit where its wheel says it, else the checkout's; `bench_commit` is the
    checkout's (the scripts)."""
    checkout = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    commit = library_commit() or checkout
    env = {"date": datetime.date.today().isoformat(), "git_commit": commit, "bench_commit": checkout,
           "command": "torchrun --nproc-per-node %d %s %s" % (world, script, " ".join(sys.argv[1:])),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "num_gpus": world,
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
           **({"backend": backend} if backend else {}),
           # The library's settings in effect (README "Environment"; unset ones are at their defaults), and
           # the CUDA / NCCL ones a timing depends on (CUDA_MODULE_LOADING moved the 2-rank LL step at 128
           # tokens by about 1 us, bench/NOTES.md session 32).
           "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEEP_EP_") or k in RECORDED_ENV}, "rows": rows}
    with open(path, "w") as f:
        json.dump(env, f, indent=1)


def init_cuda_ranks():
    """NCCL process group over torchrun's ranks: (rank, world, this rank's GPU, a group of all ranks)."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    return rank, world, dev, dist.new_group(list(range(world)))


def ht_inputs(n, h, e, k, dev):
    """The host benches' normal-mode inputs: x [n, h] BF16, topk_idx [n, k] (distinct experts of
    e), topk_weights [n, k] float."""
    x = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    idx = (torch.randn(n, e, device=dev).abs() + 1).topk(k, dim=-1, sorted=False).indices
    return x, idx, torch.rand(n, k, device=dev)


def ht_first_dispatch(buf, config_cls, x, idx, w, e, sms):
    """Dispatch and combine configs (DeepEP's defaults at `sms` SMs, from `config_cls`: this
    library's or DeepEP's `Config`), the layout keywords of a dispatch, and the first dispatch's
    recv_x and handle, on `buf` (either library's `Buffer`: the same API)."""
    cfg, ccfg = config_cls(sms, 6, 256, 6, 128), config_cls(sms, 9, 256, 6, 128)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, e)
    kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, config=cfg)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
    return cfg, ccfg, kw, recv_x, handle


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in rows if r.get("timing", "synced") == "pipelined" or r["impl"] != "deep_ep"]  # one line per op
    for key in sorted({(r["op"], r["impl"], r["dtype"], str(r["sms"])) for r in rows}):
        pts = sorted((r["tokens"], r["logical_gbps"]) for r in rows if (r["op"], r["impl"], r["dtype"], str(r["sms"])) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]} {key[2]} sms={key[3]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("logical GB/s")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
