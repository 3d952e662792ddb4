"""Recovery from a rank that falls out (4 GPUs, nccl backend, DEEP_EP_TIMEOUT_MS=2000).

- skip: rank 3 skips one dispatch. Every other rank's dispatch raises a RuntimeError within the
  deadline naming the op and rank 3; rank 3's next dispatch, issued after that, raises too. All
  ranks destroy their buffers (a poisoned buffer is released locally, so no destroy waits), create
  new ones over the same group and run correct round trips again (closed-form checks of
  _spawn.ht_check).
- exit: rank 3 ends its process after a first round trip. The survivors raise as above, destroy,
  create a buffer over a 3-rank group and keep working.
"""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import _spawn

WORLD, FAIL, TIMEOUT_MS = 4, 3, 2000
NVL = 256 << 20
SHAPE = dict(n=512, hidden=2048, experts=24, topk=4)  # experts divisible by 4 and by the 3 survivors


def _buffer(group, rank):
    import deep_ep_rs

    return deep_ep_rs.Buffer(group, NVL, device=torch.device("cuda", rank), backend="nccl", explicitly_destroy=True)


def _roundtrips(buf, rank, world, seed, count=3):
    gen = torch.Generator(device=buf.device).manual_seed(1000 * seed + rank)
    return sum(_spawn.ht_check(buf, rank, world, gen=gen, salt=seed + i, **SHAPE) for i in range(count))


def recovery_worker(rank, world, variant):
    survivors = [r for r in range(world) if r != FAIL]
    sub = dist.new_group(survivors)  # every rank takes part in creating it, before anyone fails
    buf = _buffer(dist.group.WORLD, rank)
    out = {"before": _roundtrips(buf, rank, world, 1)}
    torch.cuda.synchronize()
    dist.barrier()
    if rank == FAIL:
        if variant == "exit":
            os._exit(0)  # the process disappears with its buffer still alive
        # Skip the dispatch; the peers time out meanwhile. Coming back late, this rank's next
        # dispatch finds them gone and raises too (naming them), so every buffer is poisoned and
        # every destroy is local.
        time.sleep(TIMEOUT_MS / 1000 + 1.5)
        with pytest.raises(RuntimeError, match=r"^deep_ep::dispatch: .*waiting for rank\(s\) \[") as ei:
            _roundtrips(buf, rank, world, 2, count=1)
        out["error"] = str(ei.value)
        t0 = time.monotonic()
        buf.destroy()
        out["destroy_s"] = time.monotonic() - t0
    else:
        t0 = time.monotonic()
        try:
            _roundtrips(buf, rank, world, 2, count=1)
            msg = None
        except RuntimeError as e:
            msg = str(e)
        out["raise_s"] = time.monotonic() - t0
        out["error"] = msg
        assert msg is not None, "dispatch with a missing rank must raise"
        assert msg.startswith("deep_ep::dispatch"), msg
        assert re.search(rf"waiting for rank\(s\) \[{FAIL}\]", msg), msg
        assert out["raise_s"] < TIMEOUT_MS / 1000 + 8, out["raise_s"]
        # The poisoned buffer refuses further collectives with a clear message.
        with pytest.raises(RuntimeError, match=r"unusable after an earlier failure"):
            _roundtrips(buf, rank, world, 3, count=1)
        t0 = time.monotonic()
        buf.destroy()
        out["destroy_s"] = time.monotonic() - t0
    torch.cuda.synchronize()
    if variant == "exit":
        group, world2, rank2 = sub, len(survivors), survivors.index(rank)
    else:
        group, world2, rank2 = dist.group.WORLD, world, rank
    buf = _buffer(group, rank)
    out["after"] = _roundtrips(buf, rank2, world2, 4)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    buf.destroy()
    return out


@pytest.mark.parametrize("variant", ["skip", "exit"])
def test_survivors_raise_then_recover(variant):
    t0 = time.time()
    res = _spawn.run(recovery_worker, WORLD, variant, env={"DEEP_EP_TIMEOUT_MS": str(TIMEOUT_MS)})
    print(f"\n[{variant}] {time.time() - t0:.1f} s: " + "; ".join(f"rank {r}: {o['ok'] if o else 'exited'}" for r, o in enumerate(res)))
    for r, o in enumerate(res):
        if r == FAIL and variant == "exit":
            assert o is None
            continue
        v = o["ok"]
        assert v["before"] > 0 and v["after"] > 0
        assert v["destroy_s"] < TIMEOUT_MS / 1000 + 8
