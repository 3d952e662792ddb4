"""Lifecycle of nvshmem buffers (2 GPUs): NVSHMEM is one instance per process.

In one process per rank, each step recorded separately (so one run shows every outcome):
- create an nvshmem buffer; `memory_report()` says nvshmem; a dispatch/combine round trip is
  right (closed-form checks of _spawn.ht_check);
- a second nvshmem buffer while the first is alive raises the one-buffer-per-process error;
- an nccl buffer lives beside it and both keep working;
- after destroying both, a buffer over a 1-rank subgroup (another rank and rank count) raises the
  error that NVSHMEM keeps its first bootstrap;
- new nvshmem buffers over the same group work (twice): with DEEP_EP_NVSHMEM_FINALIZE=1 (NVSHMEM
  finalized at destroy and initialised again) and with DEEP_EP_NVSHMEM_FINALIZE=0 (NVSHMEM kept
  initialised, the next buffer allocated from it).
Progress lines go to stdout as each step ends, so a hang still shows how far the ranks got.
"""
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import _spawn

WORLD = 2
SHAPE = dict(n=256, hidden=2048, experts=8, topk=2)
STEPS = ["create", "second-refused", "beside-nccl", "destroy", "other-geometry-refused", "recreate"]


def _buffer(group, rank, nvl, backend="nvshmem"):
    import deep_ep_rs

    return deep_ep_rs.Buffer(group, nvl, device=torch.device("cuda", rank), backend=backend, explicitly_destroy=True)


def _check(buf, rank, world, salt):
    gen = torch.Generator(device=buf.device).manual_seed(100 * salt + rank)
    return _spawn.ht_check(buf, rank, world, gen=gen, salt=salt, **SHAPE)


def _refused(fn, pattern):
    try:
        fn()
    except RuntimeError as e:
        assert pattern in str(e), f"wrong error: {e}"
        return pattern
    raise AssertionError(f"no error (expected {pattern!r})")


def lifecycle_worker(rank, world, finalize):
    os.environ["DEEP_EP_NVSHMEM_FINALIZE"] = finalize
    group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each
    steps, bufs = {}, {}

    def step(name, fn):
        try:
            steps[name] = ["ok", fn()]
        except BaseException:  # noqa: BLE001 - recorded, reported by the parent
            steps[name] = ["error", traceback.format_exc()[-1500:]]
        print(f"[nvshmem lifecycle finalize={finalize} rank {rank}] {name}: {steps[name][0]} {str(steps[name][1])[-300:]}", flush=True)
        return steps[name][0] == "ok"

    def create():
        bufs["a"] = _buffer(group, rank, 64 << 20)
        backend = bufs["a"].memory_report()["backend"]
        assert backend == "nvshmem", backend
        return _check(bufs["a"], rank, world, 1)

    def beside_nccl():
        bufs["n"] = _buffer(group, rank, 64 << 20, backend="nccl")
        return [_check(bufs["n"], rank, world, 2), _check(bufs["a"], rank, world, 3)]

    def destroy():
        bufs.pop("n").destroy()
        bufs.pop("a").destroy()
        torch.cuda.synchronize()
        return "destroyed"

    def recreate():
        b = _buffer(group, rank, 128 << 20)
        got = [_check(b, rank, world, 4 + i) for i in range(2)]
        b.destroy()
        b = _buffer(group, rank, 64 << 20)
        got.append(_check(b, rank, world, 7))
        b.destroy()
        return got

    if step("create", create):
        step("second-refused", lambda: _refused(lambda: _buffer(group, rank, 64 << 20), "already holds a live nvshmem buffer"))
        if step("beside-nccl", beside_nccl) and step("destroy", destroy):
            step("other-geometry-refused", lambda: _refused(lambda: _buffer(singles[rank], rank, 64 << 20), "keeps that bootstrap"))
            dist.barrier()
            step("recreate", recreate)
    return steps


@pytest.mark.parametrize("finalize", ["1", "0"])
def test_nvshmem_buffer_lifecycle(finalize):
    out = _spawn.run(lifecycle_worker, WORLD, finalize)
    report = []
    for r, o in enumerate(out):
        assert o is not None, f"rank {r} did not report"
        steps = o["ok"]
        for name in STEPS:
            status, detail = steps.get(name, ["missing", ""])
            report.append(f"rank {r} {name}: {status} {detail}")
    print("\n".join(report))
    bad = [line for line in report if not line.split(": ", 1)[1].startswith("ok")]
    assert not bad, "\n".join(bad)
