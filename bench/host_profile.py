"""Where the host time of one op goes: folds a sampling profile (py-spy `record --native -f raw`)
of `bench/host_overhead.py --loop SECONDS --ops OP:IMPL` into shares per layer and per function.

    py-spy record --native -r 2000 -f raw -o prof.txt -- python bench/host_overhead.py --loop 5 --ops low_latency_dispatch:deep_ep
    python bench/host_profile.py prof.txt [--us 53.2] [--top 40]

Only samples inside the timed call (below host_overhead.py's `add`, excluding the loop's own
synchronisation) count. Layers: Python (frames of .py files), torch dispatcher / autograd / Python
bindings (libtorch*), the op shim (`deep_ep_ops::` in libdeep_ep.so), the library (other
libdeep_ep.so frames: Rust and the C launchers), CUDA runtime/driver (libcudart, libcuda), libc.
`--us` (the measured host time per call) turns shares into µs.
"""
import argparse
import collections
import re


def layer(frame):
    if re.search(r"\.py:\d+\)$", frame) or frame.startswith("<"):
        return "python"
    m = re.search(r"\(([^()]*)\)$", frame)
    lib = m.group(1) if m else ""
    if "deep_ep_ops::" in frame or "torch::stable" in frame or re.search(r"\((impl_\w+\.cpp|common\.h|schema\.cpp|library\.h|tensor_inl\.h|ops\.h):\d+\)$", frame):
        return "op shim (torch_ops)"
    if re.search(r"\.rs:\d+\)$|\.rs\)$", frame) or re.search(r"\(\w+\.(cu|cuh):\d+\)$", frame):
        return "library (Rust + launchers)"
    if "libdeep_ep" in lib or "deep_ep::" in frame:
        return "library (Rust + launchers)"
    if "libcuda" in lib or "libcudart" in lib or lib.startswith("cuda"):
        return "CUDA runtime/driver"
    if "libtorch_python" in lib:
        return "torch Python bindings"
    if "libtorch" in lib or "libc10" in lib or "c10::" in frame or "at::" in frame or "torch::" in frame:
        return "torch C++ (dispatcher, autograd, allocator)"
    if "python" in lib.lower() or lib == "":
        return "CPython"
    return "other: " + lib


def main():
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--us", type=float, default=0.0)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    total = 0
    self_layer = collections.Counter()
    incl = collections.Counter()
    self_fn = collections.Counter()
    for line in open(args.raw):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        start = next((i for i, f in enumerate(frames) if f.startswith(("add (host_overhead.py", "main.<locals>.add (host_overhead.py"))), None)
        if start is None or start + 1 >= len(frames) or re.search(r"synchronize|perf_counter|sync \(", frames[start + 1]):
            continue
        frames = frames[start + 1:]
        n = int(n)
        total += n
        self_layer[layer(frames[-1])] += n
        self_fn[frames[-1][:160]] += n
        for f in set(frames):
            incl[f[:160]] += n
    if not total:
        print("no samples inside the timed call")
        return
    scale = args.us / total if args.us else 100.0 / total
    unit = "us" if args.us else "%"
    print(f"samples inside the call: {total}")
    print(f"\n== self time by layer ({unit}) ==")
    for k, v in self_layer.most_common():
        print(f"{v * scale:8.2f}  {k}")
    print(f"\n== inclusive, top {args.top} frames ({unit}) ==")
    for k, v in incl.most_common(args.top):
        print(f"{v * scale:8.2f}  {k}")
    print(f"\n== self, top {args.top} frames ({unit}) ==")
    for k, v in self_fn.most_common(args.top):
        print(f"{v * scale:8.2f}  {k}")


if __name__ == "__main__":
    main()
