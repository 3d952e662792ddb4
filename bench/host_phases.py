"""Per-call host time of each phase of the library's op bodies, from the files that
`bench/host_overhead.py --phases PREFIX` makes the library write (DEEP_EP_HOST_PHASES;
torch_ops/phases.h): mean µs per call and phase, one column per process (rank).

    python bench/host_phases.py PREFIX [--host host.json]

`--host` (the same run's host_overhead JSON) adds each op's measured host time per call
(`deep_ep_raw` rows: the op alone) and the part outside the body: Python, the dispatcher and the
argument boxing. The phase means include the warm-up calls; the host times are medians.
"""
import argparse
import glob
import json

RAW_ROW = {"low_latency_dispatch": "low_latency_dispatch", "low_latency_combine": "low_latency_combine",
           "cached_dispatch": "cached_dispatch_bf16", "combine": "combine", "get_dispatch_layout": "get_dispatch_layout",
           "dispatch": "dispatch"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("prefix")
    p.add_argument("--host", default="")
    args = p.parse_args()
    files = sorted(glob.glob(args.prefix + ".*.json"))
    if not files:
        raise SystemExit(f"no {args.prefix}.<pid>.json files")
    tables = [json.load(open(f)) for f in files]
    host = {}
    if args.host:
        for r in json.load(open(args.host))["rows"]:
            if r["impl"] in ("deep_ep_raw", "deep_ep"):
                host.setdefault(r["op"], {})[r["impl"]] = r["us_median"]
    for op in tables[0]:
        rows = {}
        for t in tables:
            for name, ns, n in t.get(op, []):
                rows.setdefault(name, []).append(ns / 1e3 / max(n, 1))
        if not rows:
            continue
        print(f"== {op} (µs per call, one column per process)")
        total = [0.0] * len(tables)
        for name, us in rows.items():
            print(f"  {name:>16} " + " ".join(f"{u:7.2f}" for u in us))
            total = [a + b for a, b in zip(total, us)]
        print(f"  {'body':>16} " + " ".join(f"{u:7.2f}" for u in total))
        h = host.get(RAW_ROW.get(op, op), {})
        for impl in ("deep_ep_raw", "deep_ep"):
            if impl in h:
                print(f"  {impl + ' call':>16} {h[impl]:7.2f}   outside the body: {h[impl] - max(total):.2f} (slowest rank's median - body)")


if __name__ == "__main__":
    main()
