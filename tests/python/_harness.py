"""Multi-process harness of the CPU test tier.

`RankPool(world_size)` spawns `world_size` worker processes once (torch.multiprocessing, spawn
start method), each joins a gloo process group over `tcp://127.0.0.1:<free port>` and imports
deep_ep_rs; `pool.run(fn, *args)` then runs `fn(rank, world_size, *args)` on every rank and
returns the per-rank results, or raises `RankFailure` carrying every failing rank's traceback.
Starting a worker costs a torch import (seconds on this machine), so one pool per rank count
serves a whole session (see the `rank_pool` fixture in conftest.py) and each test runs many
configurations inside one call.

`fn` must be a module-level function of an importable module (test modules are importable in
the workers: spawn hands them the parent's sys.path).
"""
import contextlib
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

#: Deadline of every deep_ep wait inside the workers (the library's DEEP_EP_TIMEOUT_MS).
WORKER_TIMEOUT_MS = "20000"
#: Default wall-clock limit of one pool.run call.
DEFAULT_RUN_TIMEOUT_S = 240.0
#: Once a rank failed, how long its peers get to report (they may be stuck in a collective the
#: failed rank never joined: deep_ep waits time out after WORKER_TIMEOUT_MS, gloo's much later).
FAILURE_GRACE_S = 30.0


class RankFailure(RuntimeError):
    """One or more ranks raised; `errors` maps rank -> formatted traceback."""

    def __init__(self, errors):
        self.errors = dict(sorted(errors.items()))
        first = next(iter(self.errors))
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in self.errors.items()]
        super().__init__(f"rank {first} failed (of ranks {list(self.errors)}):\n" + "\n".join(parts))


@contextlib.contextmanager
def env_var(name: str, value):
    """Sets environment variable `name` to `value` for the block, then restores it (for settings
    the library reads when a buffer is created; usable inside worker processes)."""
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank, world_size, port, task_q, result_q, env):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        import deep_ep_rs  # noqa: F401  (loads the library in every worker)
    except BaseException:  # noqa: BLE001
        result_q.put((rank, -1, "error", traceback.format_exc()))
        return
    result_q.put((rank, -1, "ready", None))
    while True:
        task = task_q.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            out = fn(rank, world_size, *args, **kwargs)
            result_q.put((rank, task_id, "ok", out))
        except pytest.skip.Exception as e:
            result_q.put((rank, task_id, "skip", str(e.msg)))
        except BaseException as e:  # noqa: BLE001
            result_q.put((rank, task_id, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """`world_size` persistent worker processes in one gloo group."""

    def __init__(self, world_size: int, start_timeout_s: float = 180.0):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        env = {
            "DEEP_EP_TIMEOUT_MS": WORKER_TIMEOUT_MS,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "DEEP_EP_BACKEND": "cpu",
        }
        port = free_port()
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker_main, args=(r, world_size, port, self._task_qs[r], self._result_q, env),
                                   daemon=True, name=f"deep_ep_rank{r}") for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._next_task = 0
        self.alive = True
        ready, errors = set(), {}
        deadline = time.monotonic() + start_timeout_s
        while len(ready) + len(errors) < world_size:
            rank, _, status, payload = self._get(deadline, "start")
            if status == "ready":
                ready.add(rank)
            else:
                errors[rank] = payload
        if errors:
            self.close()
            raise RankFailure(errors)

    def _get(self, deadline, what):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                raise TimeoutError(f"RankPool({self.world_size}): {what} did not finish in time; workers killed")
            try:
                return self._result_q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    codes = [p.exitcode for p in self._procs]
                    self.close(kill=True)
                    raise RuntimeError(f"RankPool({self.world_size}): worker(s) {dead} died during {what} (exit codes {codes})")

    def run(self, fn, *args, timeout: float = DEFAULT_RUN_TIMEOUT_S, **kwargs):
        """Runs fn(rank, world_size, *args, **kwargs) on every rank; returns [result of rank 0, ...].
        Raises RankFailure if any rank raised, and pytest.skip if any rank skipped."""
        assert self.alive, "the pool was closed"
        task_id = self._next_task
        self._next_task += 1
        for q in self._task_qs:
            q.put((task_id, fn, args, kwargs))
        results, errors, skips = {}, {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) + len(skips) < self.world_size:
            if errors:
                deadline = min(deadline, first_error_at + FAILURE_GRACE_S)
            try:
                rank, tid, status, payload = self._get(deadline, f"{getattr(fn, '__name__', fn)}")
            except TimeoutError:
                if not errors:
                    raise
                silent = [r for r in range(self.world_size) if r not in results and r not in errors and r not in skips]
                errors.update({r: f"(no answer within {FAILURE_GRACE_S:.0f} s after rank {min(errors)} failed; killed)" for r in silent})
                break
            if status == "error" and not errors:
                first_error_at = time.monotonic()
            if tid != task_id:
                continue  # a late answer of an earlier task cannot happen (each waits for all ranks), but be safe
            {"ok": results, "error": errors, "skip": skips}[status][rank] = payload
        if errors:
            # Peers of a failed rank may be out of step (a collective half done): start afresh next time.
            self.close(kill=True)
            raise RankFailure(errors)
        if skips:
            pytest.skip(next(iter(skips.values())))
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False):
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._task_qs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()  # only the workers this pool started, by their own handle
                p.join(timeout=5)


def run_on_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_RUN_TIMEOUT_S, **kwargs):
    """One-shot: start `world_size` ranks, run fn on them, stop them."""
    pool = RankPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()
