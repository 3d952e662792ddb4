"""The low-latency kernels of one rank under Nsight Compute (issue 21's per-instruction account).

    bench/ll_ncu.sh OUT_DIR            # on the device: ncu over this script, reports into OUT_DIR

One process, one rank (torch.distributed over a file store), DeepEP's decode shape (hidden 7168,
top-8 of 288 experts): for each token count in --tokens, --warmup calls of FP8 dispatch and BF16
combine (rows and partial sums), then the profiled region (torch.cuda.profiler start/stop, so
`ncu --profile-from-start off` sees only it): one dispatch send + recv, one combine with rows and
one with partial sums, each preceded by an NVTX range naming the case (`ll/<op>/<tokens>`).
"""
import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist

import deep_ep_rs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    # Without a GPU the same calls run on the cpu backend (a check of this script, nothing profiled).
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    h, k, e, tmax = args.hidden, args.topk, args.experts, max(args.tokens)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(tmax, h, 1, e),
                            low_latency_mode=True, explicitly_destroy=True, device=dev)
    cases = []
    for n in args.tokens:
        g = torch.Generator(device=dev).manual_seed(n)
        x = torch.randn(n, h, dtype=torch.bfloat16, device=dev, generator=g)
        idx = (torch.randn(n, e, device=dev, generator=g).abs() + 1).topk(k, dim=-1).indices
        w = torch.rand(n, k, device=dev, generator=g)
        out = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        cases.append((n, x, idx, w, out))

    def step(n, x, idx, w, out, mark):
        def rng(name):
            return torch.cuda.nvtx.range(f"ll/{name}/{n}") if mark and dev.type == "cuda" else contextlib.nullcontext()
        with rng("dispatch_fp8"):
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=True)
        y = recv[0].float().to(torch.bfloat16) if isinstance(recv, tuple) else recv
        with rng("combine_rows"):
            buf.low_latency_combine(y, idx, w, handle, out=out)
        _, _, handle_w, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=False, topk_weights=w)
        with rng("combine_partial"):
            buf.low_latency_combine(y, idx, w, handle_w, out=out)

    for _ in range(args.warmup):
        for c in cases:
            step(*c, mark=False)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for c in cases:
        step(*c, mark=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    buf.destroy()
    dist.destroy_process_group()
    print("ll_ncu: profiled", [c[0] for c in cases], "tokens")


if __name__ == "__main__":
    main()
