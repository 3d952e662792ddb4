"""Where the time of the one-launch LL dispatch goes, from the %globaltimer stamps of an instrument
build (cargo feature `ll-stamps`: `cargo build --release --features ll-stamps`). Every 16th call,
block 0 (at 1 token the block holding the token) and the block that signals print one line each:

    llst rank R block B seq Q t0 T d1 .. d7      (ns after that block's kernel entry t0)

  d1 begin_send done (call number, state checks)   d5 the send returned (receive starts)
  d2 the block's tokens stored (before its ticket)  d6 this block's column saw every count
  d3 the ticket said last (signalling block only)   d7 the block's rows copied (kernel end)
  d4 signals stored (signalling block only)

Run the benchmark with that library and give this script its output:

    DEEP_EP_LIBRARY=<instrument build>/libdeep_ep.so torchrun --nproc-per-node 2 \\
        bench/low_latency.py --tokens 1 > stamps.log 2>&1
    python3 bench/ll_stamps.py stamps.log

Prints per rank the median of each stamp of block 0 and of the signalling block, the start skew
between them, and how long block 0's column waited for the peers' counts after this rank's own
signals were out (all on one GPU's timer; no cross-GPU clock is assumed)."""
import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"llst rank (\d+) block (\d+) seq (\d+) t0 (\d+) d1 (-?\d+) d2 (-?\d+) d3 (-?\d+) d4 (-?\d+) d5 (-?\d+) d6 (-?\d+) d7 (-?\d+)")


def parse(text):
    """{(rank, seq): {"first": stamps of block 0, "sig": stamps of the signalling block}}."""
    calls = defaultdict(dict)
    for m in LINE.finditer(text):
        rank, block, seq, t0, *d = (int(v) for v in m.groups())
        st = {"block": block, "t0": t0, **{f"d{i + 1}": v for i, v in enumerate(d)}}
        if d[2] >= 0:  # d3: this block took the last ticket and signalled
            calls[(rank, seq)]["sig"] = st
        if block == 0:
            calls[(rank, seq)]["first"] = st
    return calls


def summary(calls):
    """Per rank: medians (µs) of block 0's stamps, the signalling block's, the skew and the wait."""
    out = {}
    for rank in sorted({r for r, _ in calls}):
        rows = [v for (r, _), v in calls.items() if r == rank and "first" in v and "sig" in v]
        if not rows:
            continue
        med = lambda f: round(statistics.median(f(v) for v in rows) / 1000, 2)  # noqa: E731
        res = {"calls": len(rows)}
        for k in ("d1", "d2", "d5", "d6", "d7"):
            res[f"block0_{k}"] = med(lambda v, k=k: v["first"][k])
        for k in ("d2", "d3", "d4"):
            res[f"sig_{k}"] = med(lambda v, k=k: v["sig"][k])
        res["sig_start_after_block0"] = med(lambda v: v["sig"]["t0"] - v["first"]["t0"])
        res["signals_out_after_block0_start"] = med(lambda v: v["sig"]["t0"] + v["sig"]["d4"] - v["first"]["t0"])
        res["counts_seen_after_own_signals"] = med(lambda v: v["first"]["d6"] - (v["sig"]["t0"] + v["sig"]["d4"] - v["first"]["t0"]))
        out[rank] = res
    return out


def main():
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    for rank, res in summary(parse(text)).items():
        print(f"rank {rank}: " + ", ".join(f"{k} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
