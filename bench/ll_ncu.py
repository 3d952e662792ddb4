"""The low-latency kernels of rank 0 under Nsight Compute (issue 21's and issue 30's per-instruction account).

    bench/ll_ncu.sh OUT_DIR [PYTHON] [RANKS] [-- ARGS]   # on the device: ncu over rank 0, reports into OUT_DIR

One process per rank (torchrun: RANK / WORLD_SIZE / LOCAL_RANK; without them one rank over a file
store), DeepEP's decode shape (hidden 7168, top-8 of 288 experts). `--impl ours` profiles this
library, `--impl deep_ep` DeepEP V1 on the same inputs (PYTHONPATH must give the real deep_ep). For
each token count in --tokens, --warmup calls of FP8 dispatch and BF16 combine (rows; ours also
partial sums), then the profiled region (torch.cuda.profiler start/stop, so `ncu
--profile-from-start off` sees only it): one FP8 dispatch and the combines, each in an NVTX range
naming the case (`ll/<op>/<tokens>`). `--logfmt`: the combine is one LogFMT rows combine instead
(`--scale 0.015625`: on its cast path). The other ranks run the same calls unprofiled: rank 0's
kernels are serialised by ncu, so its peers' messages have arrived when its receive runs, and the
profile is rank 0's own path (its sends, its signals, its copies).
"""
import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "deep_ep"], default="ours")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--logfmt", action="store_true",
                   help="each step: one FP8 dispatch and one LogFMT rows combine (use_logfmt=True) only")
    p.add_argument("--scale", type=float, default=1.0,
                   help="expert outputs times this before the combine (2**-6: every LogFMT group's amax < 1, the cast path;"
                        " 1: randn outputs, LogFMT's raw fallback)")
    p.add_argument("--num-max", type=int, default=0,
                   help="num_max_dispatch_tokens_per_rank (default: the largest --tokens; DeepEP needs ranks * it % 4 == 0)")
    args = p.parse_args()
    # Without a GPU the same calls run on the cpu backend (a check of this script, nothing profiled).
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if dev_type == "cuda" else "gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if dev_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    h, k, e, tmax = args.hidden, args.topk, args.experts, max(args.num_max, max(args.tokens))
    group = dist.new_group(list(range(world)))
    if args.impl == "deep_ep":
        from deepep_v1 import LL
        v1 = LL(group, tmax, h, e)
        buf, destroy = v1.buf, v1.destroy
    else:
        import deep_ep_rs
        buf = deep_ep_rs.Buffer(group, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(tmax, h, world, e),
                                low_latency_mode=True, explicitly_destroy=True, device=dev)
        destroy = buf.destroy
    cases = []
    for n in args.tokens:
        g = torch.Generator(device=dev).manual_seed(1000 * n + rank)
        x = torch.randn(n, h, dtype=torch.bfloat16, device=dev, generator=g)
        idx = (torch.randn(n, e, device=dev, generator=g).abs() + 1).topk(k, dim=-1).indices
        w = torch.rand(n, k, device=dev, generator=g)
        out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        cases.append((n, x, idx, w, out))

    def step(n, x, idx, w, out, mark):
        def rng(name):
            return torch.cuda.nvtx.range(f"ll/{name}/{n}") if mark and dev.type == "cuda" else contextlib.nullcontext()
        with rng("dispatch_fp8"):
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tmax, e, use_fp8=True)
        y = recv[0].float().to(torch.bfloat16) if isinstance(recv, tuple) else recv
        if args.scale != 1.0:
            # The dequantized rows (~ randn, as bench/low_latency.py's BF16 outputs) times the scale:
            # FP8 codes alone reach 448, whose groups never cast.
            if isinstance(recv, tuple):
                y = (recv[0].float().unflatten(-1, (-1, 128)) * recv[1].unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
            y = y * args.scale  # exact (a power of two): the cast path of bench/low_latency.py's logfmt-cast rows
        if args.logfmt:
            with rng("combine_logfmt"):
                buf.low_latency_combine(y, idx, w, handle, use_logfmt=True, out=out)
            return
        with rng("combine_rows"):
            buf.low_latency_combine(y, idx, w, handle, out=out)
        if args.impl == "ours":
            _, _, handle_w, _, _ = buf.low_latency_dispatch(x, idx, tmax, e, use_fp8=False, topk_weights=w)
            with rng("combine_partial"):
                buf.low_latency_combine(y, idx, w, handle_w, out=out)

    for _ in range(args.warmup):
        for c in cases:
            step(*c, mark=False)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.profiler.start()
    for c in cases:
        step(*c, mark=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    dist.barrier()
    destroy()
    dist.destroy_process_group()
    if rank == 0:
        print(f"ll_ncu: {args.impl} profiled", [c[0] for c in cases], f"tokens at {world} ranks")


if __name__ == "__main__":
    main()
