"""Spawns one process per GPU for the GPU tests of this directory (torch.multiprocessing spawn,
gloo for torch.distributed) and collects one JSON result per rank.

`run(fn, world, *args, env=...)` runs `fn(rank, world, *args)` on ranks 0..world-1 (each on
cuda:rank) and returns a list with, per rank, `{"ok": value}`, `{"skip": reason}`,
`{"error": traceback}`, or None for a rank that exited without reporting (a rank may end itself
on purpose, e.g. with os._exit). `fn` must be a module-level function of an importable module.
`ht_check(...)` is a closed-form check of one normal-mode dispatch/combine round trip.
`gpu_backend()` is the backend the GPU buffers of the tests use: DEEP_EP_TEST_BACKEND, else
DEEP_EP_BACKEND when it names a GPU backend (nccl, nvshmem, ipc), else ipc when the test has more
ranks than visible GPUs (`need_gpus`), else nccl.

Several ranks per GPU (the ipc backend): rank r runs on `device(r)` = cuda:(r % GPUs), so a
test of any rank count runs on one GPU. `need_gpus(world)` skips a test only when the backend
under test cannot share a GPU. `DEEP_EP_TEST_MPS=1` runs the ranks under CUDA MPS (`mps()`),
started by the harness when the machine has `nvidia-cuda-mps-control`.

`run(..., dry=True)` runs the ranks on the CPU (no GPU needed, `fn` must then use CPU devices and
the cpu backend): the dry-run modes of the tests check their harness with it.
"""
import json
import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Skip(Exception):
    """Raised by a rank to skip the test with a reason."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GPU_BACKENDS = ("nccl", "nvshmem", "ipc")


def gpu_backend(world: int = 0) -> str:
    """The GPU backend under test (see the module docstring) for `world` ranks; 0: the rank count
    need_gpus recorded (children inherit it). A parent that builds a run's env before calling
    `run` passes `world`: the recorded count is still the previous test's then."""
    for var in ("DEEP_EP_TEST_BACKEND", "DEEP_EP_BACKEND"):
        name = os.environ.get(var, "")
        if name in GPU_BACKENDS:
            return name
        if name and var == "DEEP_EP_TEST_BACKEND":
            raise ValueError(f"DEEP_EP_TEST_BACKEND must be one of {GPU_BACKENDS}, got {name!r}")
    world = world or int(os.environ.get("DEEP_EP_TEST_WORLD", "1"))
    return "ipc" if 0 < torch.cuda.device_count() < world else "nccl"


def device(rank: int) -> torch.device:
    """The GPU of `rank`: its own one while there are enough, else shared (ipc backend)."""
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def need_gpus(world: int):
    """Called by the parent before spawning `world` ranks: records the rank count (children
    inherit it, `gpu_backend`) and skips when there are too few GPUs for a backend that needs one
    GPU per rank. Starts MPS when DEEP_EP_TEST_MPS=1 (low-latency suites included: their waiting
    receive grids leave room for the peers' send kernels, docs/BACKENDS.md "Several ranks on one
    GPU")."""
    os.environ["DEEP_EP_TEST_WORLD"] = str(world)
    n = torch.cuda.device_count()
    if n < world and gpu_backend() != "ipc":
        pytest.skip(f"needs {world} GPUs for the {gpu_backend()} backend, found {n} (the ipc backend shares one)")
    if n < world and os.environ.get("DEEP_EP_TEST_MPS", "") == "1":
        mps()


_MPS_DIR = "/tmp/deep_ep_mps"


def mps():
    """Starts the CUDA MPS daemon once (pipe and log folders under /tmp/deep_ep_mps), so the
    ranks' kernels share the GPU instead of time-slicing; the environment is set for children.
    Stopped at exit of the test process."""
    import atexit
    import shutil
    import subprocess

    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("DEEP_EP_TEST_MPS=1 but nvidia-cuda-mps-control is not on PATH")
    pipe, logs = f"{_MPS_DIR}/pipe", f"{_MPS_DIR}/log"
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    os.environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    atexit.register(lambda: subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=env))


def set_gpu_env():
    """The environment every multi-GPU test runs under (NVLink multicast off), unless already set."""
    for k, v in GPU_ENV.items():
        os.environ.setdefault(k, v)


def finish_rank(out_dir, rank, result):
    """Last step of a rank: writes its JSON result for the parent, then leaves the process group."""
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def tally_configs(result, cases, run_one, short_keys, index_of):
    """Runs `run_one(case)` for every case of this rank (it returns a list of errors, or a pair
    (errors, rows received) that also adds to result["rows"]), counting configs, passes and
    failures (index_of(i, case), the case's `short_keys`, the first 6 errors) into `result`. After
    each case the ranks all-reduce whether any rank raised: ranks may then be out of step, so all
    stop there. Returns True when every case ran (no rank raised)."""
    import torch.distributed as dist

    for i, case in enumerate(cases):
        exc = None
        try:
            errs = run_one(case)
            if isinstance(errs, tuple):
                errs, rows = errs
                result["rows"] += rows
        except Exception as e:  # noqa: BLE001 - recorded and reported
            exc = f"{type(e).__name__}: {e}"
            errs = [f"exception: {exc}"]
        result["configs"] += 1
        if errs:
            result["failures"].append(dict(index=index_of(i, case), cfg={k: case[k] for k in short_keys}, errors=errs[:6]))
        else:
            result["passed"] += 1
        flag = torch.tensor([1 if exc else 0])
        dist.all_reduce(flag)
        if int(flag) > 0:
            return False
    return True


def _entry(rank, world, port, out_dir, fn, args, env, dry=False):
    os.environ.update(env)
    import torch.distributed as dist

    if not dry:
        torch.cuda.set_device(device(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {"ok": fn(rank, world, *args)}
    except Skip as e:
        res = {"skip": str(e)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = {"error": traceback.format_exc()}
    finish_rank(out_dir, rank, res)


def run(fn, world, *args, env=None, dry=False):
    if not dry:
        need_gpus(world)
    set_gpu_env()
    out_dir = tempfile.mkdtemp(prefix="deep_ep_gpu_")
    mp.spawn(_entry, args=(world, _free_port(), out_dir, fn, args, dict(env or {}), dry), nprocs=world, join=True)
    out = []
    for r in range(world):
        p = os.path.join(out_dir, f"rank{r}.json")
        out.append(json.load(open(p)) if os.path.exists(p) else None)
    errors = {r: o["error"] for r, o in enumerate(out) if o and "error" in o}
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())
    skips = [o["skip"] for o in out if o and "skip" in o]
    if skips:
        pytest.skip(skips[0])
    return out


def pattern_x(rank, n, hidden, salt, device):
    """x[n, j] = ((7*rank + 3*n + 5*j + salt) % 64 - 32) / 8: exact in bf16, recomputable by any
    receiver from (source rank, token index)."""
    tok = torch.arange(n, device=device).view(-1, 1)
    col = torch.arange(hidden, device=device).view(1, -1)
    return (((7 * rank + 3 * tok + 5 * col + salt) % 64 - 32).float() / 8).to(torch.bfloat16)


def ht_check(buf, rank, world, n, hidden, experts, topk, gen, salt):
    """One dispatch -> identity expert -> combine with random routing from `gen` on buf's device;
    checks every received row against pattern_x of its source and the combine against the closed
    form x * (ranks the token went to). Returns the number of received rows."""
    dev = buf.device
    scores = torch.rand((n, experts), generator=gen, device=dev)
    idx = scores.topk(topk, dim=1).indices
    idx[torch.rand((n, topk), generator=gen, device=dev) < 0.1] = -1
    w = torch.rand((n, topk), generator=gen, device=dev)
    x = pattern_x(rank, n, hidden, salt, dev)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv_x, _, _, per_expert, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    rpm, src_idx = handle[0].cpu(), handle[3].cpu().long()
    rows = recv_x.shape[0]
    assert rows == int(rpm[world - 1, rank]), f"received {rows} rows, rank_prefix_matrix says {int(rpm[world - 1, rank])}"
    begin = 0
    got = recv_x.cpu()
    for s in range(world):
        end = int(rpm[s, rank])
        if end > begin:
            want = pattern_x(s, int(src_idx[begin:end].max()) + 1, hidden, salt, "cpu")[src_idx[begin:end]]
            assert torch.equal(got[begin:end], want), f"rows from rank {s} differ"
        begin = end
    combined, _, _ = buf.combine(recv_x, handle)
    k = in_rank.sum(dim=1, keepdim=True).float()
    want = (x.float() * k).to(torch.bfloat16)
    assert torch.equal(combined, want), f"combine differs by {(combined.float() - want.float()).abs().max()}"
    return rows
