"""The gain of single-batch overlap (issue 33 item 5, SGLang's SBO): the LL combine ordered after
the down GEMM's *start*, its send waiting on the device for each block's signal, against the same
combine ordered after the whole GEMM, in the same run.

    torchrun --nproc-per-node 4 bench/ll_overlap.py --tokens 128 --out bench/results/DATE-ll-overlap-ep4.json

The "GEMM" is a stand-in with a GEMM's shape of completion: a persistent Triton kernel of
--gemm-ctas programs takes the (local expert, block of --block-m rows) tiles in order, spends
--work multiply-adds per element on each (compute the combine does not need to wait for), writes
the tile's rows y = 2 * recv_x (bf16) and raises the tile's signal (atomic add with release
order, threshold 1), so blocks finish progressively as DeepGEMM's do. Rows:
- `serial`: GEMM then combine on one stream (the combine without overlap arguments);
- `overlap`: the combine on a second stream after the GEMM's start event, with `overlap=True`,
  `comp_signal`, `block_m`, `threshold=1`, `num_sms=--comm-sms`;
- `gemm` and `combine` alone, for the floor max(gemm, combine).
Eager calls, CUDA events around the whole step, the slowest rank's median of --iters. Both
combines are checked equal (bit for bit) once. Needs CUDA and Triton; `TRITON_INTERPRET=1 python
bench/ll_overlap.py --self-check` checks the stand-in's tiles and signals on the CPU.
NOT run on a GPU yet (written 2026-11-28, session 17).
"""
import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _gemm_stand_in(x, y, sig, count, n_tiles, tiles_per_expert, rows_per_expert, hidden, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                   ITERS: tl.constexpr, H_ITERS: tl.constexpr, WORK: tl.constexpr, MASKED: tl.constexpr):
    """Tile t = (expert t // tiles_per_expert, block t % tiles_per_expert), taken by program
    t % nprog in order: y rows = 2 * x rows after WORK dependent multiply-adds, then sig[t] += 1.
    MASKED (DeepGEMM's masked grouped GEMM): only rows below count[e] are computed, a tile past
    them only raises its signal. Loop bounds are constants (the CPU interpreter runs them too)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    for i in range(0, ITERS):
        t = pid + i * nprog
        if t < n_tiles:
            e = t // tiles_per_expert
            b = t % tiles_per_expert
            r = b * BLOCK_M + rows
            n_rows = rows_per_expert
            if MASKED:
                n_rows = tl.minimum(tl.load(count + e), rows_per_expert)
            for hi in range(0, H_ITERS if b * BLOCK_M < n_rows else 0):
                h0 = hi * BLOCK_H
                off = (e * rows_per_expert + r)[:, None].to(tl.int64) * hidden + (h0 + cols)[None, :]
                mask = (r < n_rows)[:, None] & ((h0 + cols) < hidden)[None, :]
                v = tl.load(x + off, mask=mask, other=0.0).to(tl.float32)
                acc = v
                for _ in range(0, WORK):
                    acc = acc * 1.0 + 0.0 * v  # dependent, exact: the result stays v
                tl.store(y + off, (acc * 2.0).to(tl.bfloat16), mask=mask)
            tl.atomic_add(sig + t, 1, sem="release")


def gemm(x, y, sig, block_m, ctas, work, count=None):
    """x, y: [E_l, R*T, H] bf16; sig: int32 [E_l * ceil(R*T / block_m)], raised by 1 per tile;
    count: int32 [E_l] rows per expert (masked), None: every row."""
    el, rt, h = x.shape
    tiles_per_expert = -(-rt // block_m)
    n_tiles = el * tiles_per_expert
    iters = -(-n_tiles // ctas)
    _gemm_stand_in[(ctas,)](x, y, sig, sig if count is None else count, n_tiles, tiles_per_expert, rt, h, BLOCK_M=block_m, BLOCK_H=128,
                            ITERS=iters, H_ITERS=-(-h // 128), WORK=work, MASKED=count is not None)


def self_check():
    """The tiles and signals on the CPU interpreter: every row doubled, every tile's signal 1."""
    x = torch.randn(3, 10, 256).to(torch.bfloat16)
    y = torch.zeros_like(x)
    sig = torch.zeros(3 * 3, dtype=torch.int32)
    gemm(x, y, sig, 4, 2, 2)
    assert torch.equal(y, (x.float() * 2).to(torch.bfloat16)), "rows"
    assert sig.tolist() == [1] * 9, sig.tolist()
    y.zero_()
    sig.zero_()
    gemm(x, y, sig, 4, 2, 2, count=torch.tensor([10, 5, 0], dtype=torch.int32))
    want = (x.float() * 2).to(torch.bfloat16)
    want[1, 5:] = 0
    want[2] = 0
    assert torch.equal(y, want), "masked rows"
    assert sig.tolist() == [1] * 9, sig.tolist()
    print("ll_overlap self-check: ok")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--gemm-ctas", type=int, default=100, help="the GEMM's programs (SGLang: compute_num_sms)")
    p.add_argument("--comm-sms", type=int, default=32, help="num_sms of the overlapped combine (SGLang: communicate_num_sms)")
    p.add_argument("--work", type=int, default=64, help="multiply-adds per element in a tile (the GEMM's compute)")
    p.add_argument("--masked", action="store_true", help="the GEMM computes only the received rows (DeepGEMM's masked layout)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="")
    p.add_argument("--self-check", action="store_true")
    args = p.parse_args()
    if args.self_check:
        return self_check()
    import torch.distributed as dist

    import deep_ep_rs
    from intranode import write_record
    from low_latency import slowest

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    el = e // world
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    torch.manual_seed(rank)
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    idx = (torch.randn(t, e, device=dev).abs() + 1).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    per = -(-world * t // args.block_m)
    y = torch.empty_like(recv)
    sig = torch.zeros(el * per, dtype=torch.int32, device=dev)
    alt = torch.cuda.Stream(device=dev)
    mcount = count if args.masked else None

    def step(mode):
        """(µs of the whole step, combined output, µs from the start to the GEMM's end, to the combine's end)."""
        if mode in ("serial", "overlap", "gemm"):
            sig.zero_()  # before the GEMM's start, as SGLang's signals
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # start, gemm end, combine end, end
        start, gemm_end, comb_end, end = ev
        start.record()
        out = None
        if mode == "combine":
            out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        elif mode == "gemm":
            gemm(recv, y, sig, args.block_m, args.gemm_ctas, args.work, mcount)
        elif mode == "serial":
            gemm(recv, y, sig, args.block_m, args.gemm_ctas, args.work, mcount)
            gemm_end.record()
            out, _, _ = buf.low_latency_combine(y, idx, w, handle)
            comb_end.record()
        else:
            alt.wait_event(start)
            gemm(recv, y, sig, args.block_m, args.gemm_ctas, args.work, mcount)
            gemm_end.record()
            with torch.cuda.stream(alt):
                out, _, _ = buf.low_latency_combine(y, idx, w, handle, overlap=True, packed_recv_count=count, comp_signal=sig,
                                                    block_m=args.block_m, threshold=1, num_sms=args.comm_sms)
                comb_end.record()
            torch.cuda.current_stream().wait_stream(alt)
        end.record()
        torch.cuda.synchronize()
        split = (start.elapsed_time(gemm_end) * 1e3, start.elapsed_time(comb_end) * 1e3) if mode in ("serial", "overlap") else (0.0, 0.0)
        return start.elapsed_time(end) * 1e3, out, *split

    a, b = step("serial")[1], step("overlap")[1]
    assert torch.equal(a, b), "the overlapped combine differs from the serial one"
    rows = []
    for mode in ("gemm", "combine", "serial", "overlap"):
        times, ge, ce = [], [], []
        for _ in range(args.iters):
            dist.barrier()
            tt, _, g_us, c_us = step(mode)
            times.append(tt)
            ge.append(g_us)
            ce.append(c_us)
        us = slowest(statistics.median(times))
        # The combine's tail: how long after the GEMM's end (on this rank's clock) it finished.
        tail = slowest(statistics.median(c - g for c, g in zip(ce, ge)))
        rows.append({"op": f"gemm+combine:{mode}", "mode": "low-latency", "impl": "deep_ep", "dtype": "bf16", "ranks": world,
                     "tokens": t, "hidden": h, "topk": k, "experts": e, "sms": args.comm_sms if mode == "overlap" else None,
                     "graph": False, "timing": "synced", "us_median": us, "block_m": args.block_m, "gemm_ctas": args.gemm_ctas,
                     "work": args.work, "masked": args.masked, **({"combine_tail_us": tail} if mode in ("serial", "overlap") else {})})
        if rank == 0:
            extra = f"   combine ends {tail:7.1f} us after the GEMM" if mode in ("serial", "overlap") else ""
            print(f"{mode:>8}: {us:9.1f} us{extra}", flush=True)
    if rank == 0:
        by = {r["op"].split(":")[1]: r["us_median"] for r in rows}
        print(f"overlap / serial = {by['overlap'] / by['serial']:.3f}; floor max(gemm, combine) = "
              f"{max(by['gemm'], by['combine']):.1f} us", flush=True)
        if args.out:
            write_record(args.out, "bench/ll_overlap.py", world, rows)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
