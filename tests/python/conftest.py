"""Shared fixtures of the CPU test tier.

- The library: `deep_ep_rs` is imported from python/ (added to sys.path) and loads
  $DEEP_EP_LIBRARY, defaulting to target/release/libdeep_ep.so of this checkout; with
  DEEP_EP_TEST_INSTALLED=1 the installed package and the library inside it instead.
- `rank_pool(n)`: a session-wide pool of n spawned ranks in one gloo group (see _harness.py);
  `pool.run(fn, *args)` runs fn(rank, world_size, *args) on each rank and returns the results, or
  raises the failing ranks' tracebacks. Pools are started lazily and reused by every test.
- `buffer1`: a 1-rank CPU buffer (create_buffer with num_ranks=1 is a valid collective of one).
- `ll_or_skip(fn)`: low-latency tests skip while the CPU backend answers "not implemented yet".
"""
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: DEEP_EP_TEST_INSTALLED=1: test the installed package (a wheel in site-packages) and its bundled
#: library, never this checkout's python/ or target/ (`make wheel-test`).
INSTALLED = os.environ.get("DEEP_EP_TEST_INSTALLED") == "1"
if INSTALLED:
    import importlib.util

    _spec = importlib.util.find_spec("deep_ep_rs")
    _bundled = str(Path(_spec.origin).resolve().parent / "libdeep_ep.so") if _spec and _spec.origin else None
    # Worker processes re-import this file with DEEP_EP_LIBRARY already set to the bundled copy.
    if os.environ.get("PYTHONPATH") or os.environ.get("DEEP_EP_LIBRARY", _bundled) != _bundled:
        raise RuntimeError("DEEP_EP_TEST_INSTALLED=1 tests the installed wheel: unset DEEP_EP_LIBRARY and PYTHONPATH")
    import deep_ep_rs as _installed

    _pkg = Path(_installed.__file__).resolve().parent
    if _pkg == ROOT / "python" / "deep_ep_rs" or "site-packages" not in _pkg.parts or Path(_installed.library_path()).resolve().parent != _pkg:
        raise RuntimeError(f"DEEP_EP_TEST_INSTALLED=1 but deep_ep_rs comes from {_pkg} with {_installed.library_path()}")
    # Tests that start their own processes hand them the same library.
    os.environ["DEEP_EP_LIBRARY"] = _installed.library_path()
else:
    if str(ROOT / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "python"))
    if not os.environ.get("DEEP_EP_LIBRARY"):
        _lib = ROOT / "target" / "release" / "libdeep_ep.so"
        if _lib.is_file():
            os.environ["DEEP_EP_LIBRARY"] = str(_lib)
    # Spawned workers import deep_ep_rs from python/ too.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("DEEP_EP_TIMEOUT_MS", "20000")
os.environ.setdefault("DEEP_EP_BACKEND", "cpu")

from _harness import RankPool, free_port  # noqa: E402

NOT_IMPLEMENTED = re.compile(r"not implemented.*yet", re.S)


def is_not_implemented(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, NotImplementedError)) and bool(NOT_IMPLEMENTED.search(str(exc)))


def ll_or_skip(fn, *args, **kwargs):
    """Calls a low-latency op/method; skips the test while LL is not implemented on the CPU."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as e:
        if is_not_implemented(e):
            pytest.skip(f"low-latency mode not implemented on this backend yet: {e}")
        raise


@pytest.fixture(scope="session")
def deep_ep():
    import deep_ep_rs

    return deep_ep_rs


@pytest.fixture(scope="session")
def ops(deep_ep):
    import torch

    return torch.ops.deep_ep


_POOLS = {}


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo process group (the Buffer constructors need one), started once per module
    unless the test process already has a default group."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def rank_pool():
    def get(world_size: int) -> RankPool:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            pool = _POOLS[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def make_buffer1(ops, num_nvl_bytes=1 << 24, num_rdma_bytes=0, low_latency_mode=False):
    import torch

    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    return int(ops.create_buffer(uid, 0, 1, torch.device("cpu"), num_nvl_bytes, num_rdma_bytes, low_latency_mode, "cpu"))


@pytest.fixture(scope="module")
def ll(deep_ep, group, request):
    """A one-rank low-latency `Buffer` sized for the requesting module's constants T (tokens per
    rank), H (hidden) and E (experts), destroyed after the module."""
    m = request.module
    b = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(m.T, m.H, 1, m.E), low_latency_mode=True,
                       explicitly_destroy=True)
    yield b
    b.destroy()


@pytest.fixture
def buffer1(ops):
    h = make_buffer1(ops)
    yield h
    ops.destroy_buffer(h)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (gpu tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
