"""The high-throughput kernels of rank 0 under Nsight Compute (issue 23's profile before any HT
kernel change), with the other ranks running the same calls unprofiled.

    bench/ht_ncu.sh OUT_DIR [PYTHON]     # on the device: torchrun of this script, ncu on rank 0 only

DeepEP's benchmark shape as bench/intranode.py runs it (4096 tokens x hidden 7168 BF16, top-8 of
256 experts, --sms SMs, DeepEP's dispatch/combine configs): --warmup rounds of cached dispatch
BF16, cached dispatch FP8 and combine, then the profiled region (torch.cuda.profiler start/stop, so
`ncu --profile-from-start off` sees only it): one of each, in NVTX ranges `ht/<op>` on every rank.
Ncu replays each of rank 0's kernels, restoring what the kernel wrote: the pull kernels read peer
windows that stay still meanwhile (every peer waits at rank 0's next barrier), so the replays see
the same data; DEEP_EP_TIMEOUT_MS is raised so that the waits outlast ncu's serialisation.
Without a GPU the same calls run on the cpu backend (a check of this script, nothing profiled).
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist

import importlib

from intranode import per_token_cast_to_fp8  # bench/intranode.py's cast, so both profile the same inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sms", type=int, default=20)
    p.add_argument("--dispatch-cfg", type=int, nargs=4, default=[6, 256, 6, 128])
    p.add_argument("--combine-cfg", type=int, nargs=4, default=[9, 256, 6, 128])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nvl-bytes", type=int, default=2_000_000_000)
    p.add_argument("--impl", choices=["deep_ep_rs", "deep_ep"], default="deep_ep_rs",
                   help="deep_ep: DeepEP V1's own Buffer (PYTHONPATH of its build) on the same calls")
    args = p.parse_args()
    lib = importlib.import_module(args.impl)
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    nvl = args.nvl_bytes if cuda else min(args.nvl_bytes, 1 << 30)
    extra = {"device": dev} if args.impl == "deep_ep_rs" else {}  # DeepEP V1 takes the current device
    buf = lib.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True, **extra)
    torch.manual_seed(1000 + rank)
    n, h, k, e = args.tokens, args.hidden, args.topk, args.experts
    x = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    idx = (torch.randn(n, e, device=dev).abs() + 1).topk(k, dim=-1, sorted=False).indices
    w = torch.rand(n, k, device=dev)
    cfg, ccfg = lib.Config(args.sms, *args.dispatch_cfg), lib.Config(args.sms, *args.combine_cfg)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, e)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=ntpe, config=cfg)
    x8 = per_token_cast_to_fp8(x)
    x8 = (x8[0], x8[1].T.contiguous().T)  # scales column-major, as bench/intranode.py passes them

    def rng(name, mark):
        return torch.cuda.nvtx.range(f"ht/{name}") if mark and cuda else contextlib.nullcontext()

    def step(mark):
        with rng("dispatch_bf16", mark):
            buf.dispatch(x, handle=handle, config=cfg)
        with rng("dispatch_fp8", mark):
            buf.dispatch(x8, handle=handle, config=cfg)
        with rng("combine_bf16", mark):
            buf.combine(recv_x, handle, config=ccfg)

    for _ in range(args.warmup):
        step(False)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.profiler.start()
    step(True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()
    if rank == 0:
        print(f"ht_ncu: {args.impl}: profiled dispatch BF16, dispatch FP8, combine at {world} ranks, {n} tokens, {args.sms} SMs ({recv_x.shape[0]} rows received)")


if __name__ == "__main__":
    main()
