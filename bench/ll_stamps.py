"""Where the time of the one-launch LL dispatch goes, from the %globaltimer stamps of an instrument
build (cargo feature `ll-stamps`: `cargo build --release --features ll-stamps`). Every 16th call,
block 0 (at 1 token the block holding the token) and the block that signals print one line each:

    llst rank R block B seq Q t0 T d1 .. d18      (ns after that block's kernel entry t0; -1: not reached)

  d8  the mask read (first block barrier)           d1  begin_send done (call number, state checks)
  d9  every selection counted (second barrier)      d10 block 0's message counts stored to the peers
  d18 warp 0 has the token's ids (set-up done)      d15 warp 0 has the token's expert slots
  d16 its destination list                          d17 warp 0's routing done (before the barrier)
  d11 the block's first token routed (warp 0)        d12 its meta written (warp 0)
  d13, d14 unused (were warp 0's first batch cast and stored: warp 0 now routes only)
  d2  the block's tokens stored (before its ticket)
  d3  the ticket said last (signalling block only)  d4  signals stored (signalling block only)
  d5  the send returned (receive starts)            d6  this block's column saw every count
  d7  the block's rows copied (kernel end)

(The order in the kernel: d1, d8, d9, d10, d18, d15, d16, d17, d11, d12, d13, d14, d2, d3, d4, d5,
d6, d7.) The runtime writes a device printf in pieces, so the ranks' outputs interleave on a
shared stdout: give each rank its own file (torchrun --redirects) and this script every file:

    DEEP_EP_LIBRARY=<instrument build>/libdeep_ep.so torchrun --nproc-per-node 2 --log-dir LOGS \
        --redirects 1 bench/low_latency.py --tokens 1
    python3 bench/ll_stamps.py LOGS/*/attempt_0/*/stdout.log

Prints per rank the median of each stamp of block 0 and of the signalling block (at one rank: of
block 0, the count block, block 1, the first token block, and the last token block), the start
skew between them, and how long block 0's column waited for the peers' counts after this rank's
own signals were out (all on one GPU's timer; no cross-GPU clock is assumed)."""
import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"llst rank (\d+) block (\d+) seq (\d+) t0 (\d+)((?: d\d+ -?\d+)+)")


def parse(text):
    """{(rank, seq): {"first": stamps of block 0, "sig": stamps of the signalling block}}."""
    calls = defaultdict(dict)
    for m in LINE.finditer(text):
        rank, block, seq, t0 = (int(v) for v in m.groups()[:4])
        pairs = m.group(5).split()
        st = {"block": block, "t0": t0, **{pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}}
        if st.get("d3", -1) >= 0:  # this block took the last ticket and signalled
            calls[(rank, seq)]["sig"] = st
        if block == 0:
            calls[(rank, seq)]["first"] = st
        elif st.get("d3", -1) < 0:  # the one-rank form's first (block 1) and last token blocks
            calls[(rank, seq)]["tok" if block == 1 else "last"] = st
    return calls


def _us(rows, f):
    """Median over the calls `rows` of f(call), ns -> µs."""
    return round(statistics.median(f(v) for v in rows) / 1000, 2)


def _block_stamps(res, rows, key, prefix, stamps):
    """res[prefix + stamp]: the median of each stamp of block `key` printed and reached in every call."""
    for k in stamps:
        if all(v[key].get(k, -1) >= 0 for v in rows):
            res[f"{prefix}_{k}"] = _us(rows, lambda v, k=k: v[key][k])


def summary(calls):
    """Per rank: medians (µs) of block 0's stamps, the signalling block's, the skew and the wait."""
    out = {}
    for rank in sorted({r for r, _ in calls}):
        signalled = [v for (r, _), v in calls.items() if r == rank and "first" in v and "sig" in v]
        # The one-rank form: no block signals, block 0 alone.
        rows = signalled or [v for (r, _), v in calls.items() if r == rank and "first" in v]
        if not rows:
            continue
        res = {"calls": len(rows)}
        _block_stamps(res, rows, "first", "block0",
                      ("d1", "d8", "d9", "d10", "d18", "d15", "d16", "d17", "d11", "d12", "d13", "d14", "d2", "d5", "d6", "d7"))
        out[rank] = res
        if not signalled:
            # The one-rank form's first and last token blocks (block 0 is the count block), when
            # every call printed them.
            if all("tok" in v for v in rows):
                res["tok_start_after_block0"] = _us(rows, lambda v: v["tok"]["t0"] - v["first"]["t0"])
                _block_stamps(res, rows, "tok", "tok", ("d1", "d8", "d9", "d18", "d15", "d16", "d17", "d11", "d12", "d13", "d14", "d7"))
            if all("last" in v for v in rows):
                res["last_block"] = statistics.median(v["last"]["block"] for v in rows)
                res["last_start_after_block0"] = _us(rows, lambda v: v["last"]["t0"] - v["first"]["t0"])
                _block_stamps(res, rows, "last", "last", ("d8", "d9", "d18", "d15", "d17", "d11", "d13", "d14", "d7"))
            continue
        med = lambda f: _us(rows, f)  # noqa: E731
        for k in ("d2", "d3", "d4"):
            res[f"sig_{k}"] = med(lambda v, k=k: v["sig"][k])
        res["sig_start_after_block0"] = med(lambda v: v["sig"]["t0"] - v["first"]["t0"])
        res["signals_out_after_block0_start"] = med(lambda v: v["sig"]["t0"] + v["sig"]["d4"] - v["first"]["t0"])
        res["counts_seen_after_own_signals"] = med(lambda v: v["first"]["d6"] - (v["sig"]["t0"] + v["sig"]["d4"] - v["first"]["t0"]))
    return out


def main():
    text = "\n".join(open(f).read() for f in sys.argv[1:]) if len(sys.argv) > 1 else sys.stdin.read()
    for rank, res in summary(parse(text)).items():
        print(f"rank {rank}: " + ", ".join(f"{k} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
