"""What one GPU can put on NVLink with a given number of CTAs, by access pattern (issue 29: both HT
movers of this library stay at ~240 GB/s per GPU whatever their SMs or warps; bench/NOTES.md,
session 16). Plain copies, no protocol: every rank at once moves --mb MB out of (or into) its
peers through torch's symmetric memory, with a Triton kernel of --warps warps per CTA:

- `store-rr`:  stores; chunk c goes to peer c % (R-1) (every CTA writes to every peer, as the
  fused combine's push does);
- `store-one`: stores; CTA p writes only to peer p % (R-1) (DeepEP's senders: one destination per
  warp group);
- `load-rr`:   loads from peer c % (R-1) into local memory (the pull dispatch);
- `ce-copy`:   no SMs: one cudaMemcpyAsync per peer (torch `copy_` into the peer's mapped memory,
  a stream per peer), the copy engines' rate for the same bytes (--ctas does not apply; run once).

`--spread` places consecutive chunks of one peer --spread-mb MB apart (a 2 GB window's spread)
instead of back to back. Reports GB/s out (stores) or in (loads) per GPU, the slowest rank's
median. DEVICE.md's figures to compare: SM stores to one peer 349-369 GB/s (24-132 CTAs), NCCL's
all-to-all write 353-356 GB/s.

    torchrun --nproc-per-node 4 bench/nvlink_probe.py --ctas 8 16 20 24 32 64 --out probe.json

Needs CUDA and Triton; `TRITON_INTERPRET=1 python bench/nvlink_probe.py --self-check` checks the
kernel's addressing on the CPU (no GPU, no peers).
"""
import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

MODES = {"store-rr": 0, "store-one": 1, "load-rr": 2}
CE = "ce-copy"


@triton.jit
def _store_to(p0, p1, p2, d, off, x):
    """x into peer d's buffer (p0, p1 or p2) at off."""
    if d == 0:
        tl.store(p0 + off, x)
    elif d == 1:
        tl.store(p1 + off, x)
    else:
        tl.store(p2 + off, x)


@triton.jit
def _probe(local, p0, p1, p2, n_chunks, n_peers, spread, ITERS: tl.constexpr, CHUNK: tl.constexpr, MODE: tl.constexpr):
    """Chunk c (of CHUNK int32) of this rank's traffic: peer c % n_peers (MODE 0, 2) or, MODE 1,
    only the chunks of this CTA's peer pid % n_peers; at offset (c // n_peers) * spread there.
    ITERS: the most chunks any CTA takes (a constant: loop bounds the CPU interpreter can run too)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    if MODE == 1:
        d = pid % n_peers
        start = pid // n_peers
        step = (nprog - d + n_peers - 1) // n_peers  # the CTAs that serve peer d
        per_peer = n_chunks // n_peers
        for i in range(0, ITERS):
            j = start + i * step
            if j < per_peer:
                src = local + (j * n_peers + d).to(tl.int64) * CHUNK + offs
                dst_off = j.to(tl.int64) * spread + offs
                _store_to(p0, p1, p2, d, dst_off, tl.load(src))
    else:
        for i in range(0, ITERS):
            c = pid + i * nprog
            if c < n_chunks:
                d = c % n_peers
                peer_off = (c // n_peers).to(tl.int64) * spread + offs
                loc = local + c.to(tl.int64) * CHUNK + offs
                if MODE == 0:
                    _store_to(p0, p1, p2, d, peer_off, tl.load(loc))
                else:
                    if d == 0:
                        x = tl.load(p0 + peer_off)
                    elif d == 1:
                        x = tl.load(p1 + peer_off)
                    else:
                        x = tl.load(p2 + peer_off)
                    tl.store(loc, x)


def launch(local, peers, n_chunks, spread, chunk, mode, ctas, warps):
    n = len(peers)
    assert ctas >= n, "at least one CTA per peer"
    p = list(peers) + [peers[0]] * (3 - n)
    iters = -(-(n_chunks // n) // (ctas // n)) if mode == "store-one" else -(-n_chunks // ctas)
    _probe[(ctas,)](local, p[0], p[1], p[2], n_chunks, n, spread, ITERS=iters, CHUNK=chunk, MODE=MODES[mode], num_warps=warps)


def self_check():
    """The addressing on the CPU interpreter: every chunk lands at its peer's place, once."""
    chunk, n_peers, per = 64, 3, 5
    local = torch.arange(n_peers * per * chunk, dtype=torch.int32)
    for mode in ("store-rr", "store-one"):
        for spread in (chunk, 3 * chunk):
            peers = [torch.full((per * spread,), -1, dtype=torch.int32) for _ in range(n_peers)]
            launch(local, peers, n_peers * per, spread, chunk, mode, 4, 4)
            for d in range(n_peers):
                for j in range(per):
                    c = j * n_peers + d
                    assert torch.equal(peers[d][j * spread:j * spread + chunk], local[c * chunk:(c + 1) * chunk]), (mode, d, j)
    peers = [torch.arange(per * chunk, dtype=torch.int32) + 1000 * d for d in range(n_peers)]
    out = torch.zeros_like(local)
    launch(out, peers, n_peers * per, chunk, chunk, "load-rr", 4, 4)
    for c in range(n_peers * per):
        d, j = c % n_peers, c // n_peers
        assert torch.equal(out[c * chunk:(c + 1) * chunk], peers[d][j * chunk:(j + 1) * chunk]), c
    print("nvlink_probe self-check: ok")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=158.0, help="MB each rank moves (BF16 dispatch at 4096 x 7168, top-8: ~158)")
    p.add_argument("--ctas", type=int, nargs="+", default=[8, 16, 20, 24, 32, 64])
    p.add_argument("--warps", type=int, default=16)
    p.add_argument("--chunk-kb", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=list(MODES) + [CE])
    p.add_argument("--spread-mb", type=float, default=0.0, help="distance of a peer's consecutive chunks (0: back to back)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--self-check", action="store_true")
    args = p.parse_args()
    if args.self_check:
        return self_check()
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert 2 <= world <= 4, "one to three peers"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    chunk = args.chunk_kb * 1024 // 4
    n_peers = world - 1
    n_chunks = int(args.mb * 1e6) // (chunk * 4) // n_peers * n_peers
    per_peer = n_chunks // n_peers
    spread = max(chunk, int(args.spread_mb * 1e6) // 4 // chunk * chunk) if args.spread_mb else chunk
    local = torch.randint(0, 1 << 30, (n_chunks * chunk,), dtype=torch.int32, device=dev)
    # every rank's landing area: one region per source rank (each written by one peer only)
    area = per_peer * spread
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    buf = symm_mem.empty(world * area, dtype=torch.int32, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peers = [r for r in range(world) if r != rank]
    # peer r's region for this rank (stores) / this rank's region at peer r (loads: the same place)
    views = [hdl.get_remote_tensor(r, (world * area,), torch.int32)[rank * area:(rank + 1) * area] for r in peers]
    streams = [torch.cuda.Stream(device=dev) for _ in peers]
    per = per_peer * chunk

    def copy_engines():
        """One copy per peer, each on its own stream, joined back into the current one."""
        cur = torch.cuda.current_stream()
        for i, st in enumerate(streams):
            st.wait_stream(cur)
            with torch.cuda.stream(st):
                views[i][:per].copy_(local[i * per:(i + 1) * per])
        for st in streams:
            cur.wait_stream(st)

    rows = []
    for mode in args.modes:
        for ctas in ([0] if mode == CE else args.ctas):
            run = copy_engines if mode == CE else (lambda: launch(local, views, n_chunks, spread, chunk, mode, ctas, args.warps))
            run()  # warm-up, compile
            torch.cuda.synchronize()
            times = []
            for _ in range(args.iters):
                dist.barrier()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            med = torch.tensor([statistics.median(times)], device=dev)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's median
            us = float(med)
            gbps = n_chunks * chunk * 4 / us / 1e3
            rows.append({"mode": mode, "ctas": ctas, "warps": args.warps, "chunk_kb": args.chunk_kb, "spread_mb": args.spread_mb,
                         "ranks": world, "mb": n_chunks * chunk * 4 / 1e6, "us_median": us, "gbps_per_gpu": gbps})
            if rank == 0:
                print(f"{mode:>10} ctas {ctas:>3} warps {args.warps:>2} spread {args.spread_mb:>6.1f} MB: {us:9.1f} us  {gbps:7.1f} GB/s per GPU",
                      flush=True)
    dist.barrier()
    if rank == 0 and args.out:
        from intranode import write_record

        write_record(args.out, "bench/nvlink_probe.py", world, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
