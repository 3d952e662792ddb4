"""`python -m deep_ep_rs.diagnose`: what this machine and this build of deep_ep look like, and
whether a tiny dispatch/combine works.

Prints the library path and build (crate version, features, backends, CUDA archs, the NCCL and
torch it was built against), torch and CUDA versions and whether they match the build (torch
version, CUDA major version, a driver new enough for the library's CUDA runtime), the driver and
NVLink topology
(nvidia-smi, if present), peer access between GPUs, the NCCL torch loaded against the one the
library was built for, the environment variables that change behaviour and whether a Buffer
would accept them (an invalid setting fails the report), then runs a self-test
(normal and low-latency dispatch/combine, checked exactly) on 2 CPU ranks and, when GPUs are
present, across the local GPUs (a backend that does not implement it yet is reported, not
failed). Exit code 0 when the settings are valid and every self-test that ran passed.
"""
import argparse
import json
import os
import queue as queue_mod
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta

ENV_PREFIXES = ("DEEP_EP_", "NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def _run(cmd, timeout=20.0):
    """stdout of `cmd`, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(code: int) -> str:
    """NCCL_VERSION_CODE (22809) -> '2.28.9'."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _major_minor(v):
    """(major, minor) of a version string such as "13.0" or "2.11.0+cu130", or None."""
    try:
        parts = str(v).split("+")[0].split(".")
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None


def _torch_verdict(built: str, running: str) -> str:
    """build_info's torch ("torch X of `python`") against the running torch: " (match)", or why not."""
    if not built.startswith("torch "):
        return ", library built without a torch shim"
    want = built.split()[1]
    if want == running:
        return ", library built against it (match)"
    w, r = _major_minor(want.split("+")[0]), _major_minor(running.split("+")[0])
    if w and r and r >= w:  # the ops use libtorch's stable ABI, which later releases keep
        return f", library built against torch {want} (compatible: stable ABI, this torch is newer)"
    return f" (MISMATCH: the library was built against torch {want}, newer than this one; rebuild it for this torch)"


def _cuda_verdict(runtime, torch_cuda, driver) -> str:
    """The library's CUDA runtime against torch's CUDA and the driver's supported CUDA version."""
    rt, tc, dv = _major_minor(runtime), _major_minor(torch_cuda), _major_minor(driver)
    notes = []
    if rt and tc and rt[0] != tc[0]:
        notes.append(f"MISMATCH: library CUDA {runtime} and torch CUDA {torch_cuda} have different major versions")
    if rt and dv and dv < rt:
        notes.append(f"DRIVER TOO OLD: it supports CUDA {driver}, the library needs {runtime}")
    if notes:
        return " (" + "; ".join(notes) + ")"
    return " (match)" if rt and tc else ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# self-test (runs in spawned rank processes)


def _selftest_ranks(rank: int, world: int, device: str):
    """Normal and low-latency dispatch/combine on `world` ranks; returns (status, summary).
    Every value is a small integer, so every result is checked exactly. A mode the backend does
    not implement yet is noted and skipped (status 'not-implemented' when no mode ran)."""
    import torch
    import torch.distributed as dist

    import deep_ep_rs

    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    backend = "cpu" if device == "cpu" else "nccl"  # explicit: DEEP_EP_BACKEND must not redirect the test
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    n, hidden, topk, experts = 16, 256, 2, 4 * world
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(-8, 8, (n, hidden), generator=g, device="cpu").to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(experts, generator=g, device="cpu")[:topk] for _ in range(n)]).to(dev)
    idx[0] = -1  # a token that goes nowhere
    w = torch.ones((n, topk), dtype=torch.float32, device=dev)

    def normal():
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, 0, device=dev, explicitly_destroy=True, backend=backend)
        try:
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            total = ntpr.to("cpu", copy=True)  # all_reduce works in place
            dist.all_reduce(total)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
            assert recv_x.shape[0] == int(total[rank]), f"received {recv_x.shape[0]} rows, expected {int(total[rank])}"
            out, _, _ = buf.combine(recv_x, handle)
            want = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
            assert torch.equal(out, want), "normal combine of the dispatched rows differs from x * (ranks reached)"
            return f"{recv_x.shape[0]} rows"
        finally:
            buf.destroy()

    def low_latency():
        nbytes = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(n, hidden, world, experts)
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device=dev, explicitly_destroy=True,
                                backend=backend)
        try:
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False)
            out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
            want = (x.float() * (idx >= 0).sum(1, keepdim=True).float()).to(torch.bfloat16)
            assert torch.equal(out, want), "low-latency combine of the dispatched rows differs from x * (valid top-k)"
            return f"{int(count.sum())} rows"
        finally:
            buf.destroy()

    parts, ran = [], 0
    for name, fn in (("normal", normal), ("low-latency", low_latency)):
        try:
            parts.append(f"{name} ok ({fn()})")
            ran += 1
        except (RuntimeError, NotImplementedError) as e:
            if "not implemented" not in str(e):
                raise
            parts.append(f"{name} not implemented yet ({str(e).splitlines()[0]})")
    return ("ok" if ran else "not-implemented"), ", ".join(parts)


def _rank_main(rank, world, port, device, results):
    os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "20000")
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            results.put((rank, *_selftest_ranks(rank, world, device)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        kind = "not-implemented" if "not implemented" in str(e) else "error"
        results.put((rank, kind, f"{type(e).__name__}: {e}".strip()))


def self_test(world: int, device: str, timeout_s: float):
    """Runs the self-test on `world` spawned ranks. Returns (status, detail), status one of
    'ok', 'not-implemented', 'error'."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, device, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, status, detail = results.get(timeout=1.0)
            got[rank] = (status, detail)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()  # only the rank processes started here
            p.join(timeout=5)
    if len(got) < world:
        missing = [r for r in range(world) if r not in got]
        return "error", f"rank(s) {missing} gave no answer within {timeout_s:.0f} s (exit codes {[p.exitcode for p in procs]})"
    for status in ("error", "not-implemented"):
        bad = {r: d for r, (s, d) in got.items() if s == status}
        if bad:
            return status, "; ".join(f"rank {r}: {d}" for r, d in sorted(bad.items()))
    return "ok", got[0][1]


# ---------------------------------------------------------------------------------------------
# report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deep_ep_rs.diagnose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-self-test", action="store_true", help="only print the environment")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds each self-test may take")
    args = ap.parse_args(argv)
    # (A library that cannot be loaded already fails `import deep_ep_rs`, naming the path.)
    import torch

    import deep_ep_rs

    print("deep_ep_rs diagnose")
    print(f"library: {deep_ep_rs.library_path()}")
    build = json.loads(torch.ops.deep_ep.build_info())
    print(f"build: deep_ep {build['crate_version']} ({build['profile']}), features: {', '.join(build['features']) or 'none'}")
    print(f"backends compiled: {', '.join(build['backends'])}")
    print(f"CUDA archs compiled: {', '.join(build['cuda_archs']) or 'none'} (cudart {build['cudart'] or 'none'})")
    print(f"built against: {build['torch'] or 'no torch shim'}")
    print(f"python: {sys.version.split()[0]}")
    print(f"torch: {torch.__version__} (CUDA build {torch.version.cuda or 'none'})" + _torch_verdict(build.get("torch") or "", torch.__version__))
    rt, drv = build.get("cuda_runtime"), build.get("cuda_driver")
    print(f"CUDA: library runtime {rt or 'none'}, torch built for {torch.version.cuda or 'none'}, driver supports {drv or 'unknown (no driver)'}"
          + _cuda_verdict(rt, torch.version.cuda, drv))
    cuda = torch.cuda.is_available()
    print(f"CUDA available: {cuda}" + (f", {torch.cuda.device_count()} visible GPU(s)" if cuda else ""))
    smi = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"])
    print("driver: " + ("nvidia-smi not found or failed" + (f" (supports CUDA {drv})" if drv else "") if smi is None else ""))
    for line in (smi or "").splitlines():
        print(f"  gpu {line}")
    try:
        loaded = torch.cuda.nccl.version()
        loaded = ".".join(map(str, loaded)) if isinstance(loaded, tuple) else _version(int(loaded))
    except Exception as e:  # noqa: BLE001
        loaded = f"unavailable ({type(e).__name__})"
    built = build["nccl_header_version"]
    verdict = "" if built is None else (" (match)" if loaded == built else " (MISMATCH: the nccl backend needs the NCCL it was built for)")
    print(f"NCCL: torch loaded {loaded}, library built for {built or 'no NCCL (feature nccl off)'}{verdict}")
    if cuda:
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
        n = torch.cuda.device_count()
        if n > 1:
            print("peer access (row can access column):")
            for i in range(n):
                print(f"  {i}: " + " ".join("-" if i == j else ("Y" if torch.cuda.can_device_access_peer(i, j) else "N") for j in range(n)))
    topo = _run(["nvidia-smi", "topo", "-m"])
    print("NVLink topology: " + ("nvidia-smi topo -m not available" if topo is None else ""))
    for line in (topo or "").splitlines():
        print(f"  {line}")
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    print("environment: " + ("none of DEEP_EP_*, NCCL_*, TORCH_SYMM_MEM_*, NVSHMEM_* set" if not env else ""))
    for k, v in env:
        print(f"  {k}={v}")
    # The settings every Buffer reads at creation, checked by the library's own code (the
    # self-test below picks its backend explicitly, so it would pass whatever they say).
    failed = False
    for label, dev in [("cpu buffers", torch.device("cpu"))] + ([("cuda buffers", torch.device("cuda", 0))] if cuda else []):
        try:
            print(f"settings ({label}): OK: {torch.ops.deep_ep.check_environment(dev)}")
        except RuntimeError as e:
            print(f"settings ({label}): FAILED: {str(e).splitlines()[0]}")
            failed = True
    if args.no_self_test:
        if failed:
            print("result: FAILED")
        return 1 if failed else 0

    status, detail = self_test(2, "cpu", args.timeout)
    print(f"self-test cpu (2 ranks): {status.upper() if status != 'ok' else 'OK'}: {detail}")
    failed |= status != "ok"
    if not cuda:
        print("self-test gpu: skipped (no CUDA device)")
    elif "nccl" not in build["backends"]:
        print("self-test gpu: skipped (the nccl backend is not compiled in)")
    else:
        world = torch.cuda.device_count()
        status, detail = self_test(world, "cuda", args.timeout)
        label = {"ok": "OK", "not-implemented": "not implemented on this backend yet", "error": "FAILED"}[status]
        print(f"self-test gpu ({world} rank(s), one per GPU): {label}: {detail}")
        failed |= status == "error"
    print("result: " + ("FAILED" if failed else "OK"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
