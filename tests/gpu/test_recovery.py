"""Recovery from a rank that falls out (4 GPUs, nccl backend, DEEP_EP_TIMEOUT_MS=2000).

- skip: rank 3 skips one dispatch. Every other rank's dispatch raises a RuntimeError within the
  deadline naming the op and rank 3; rank 3's next dispatch, issued after that, raises too. All
  ranks destroy their buffers (a poisoned buffer is released locally, so no destroy waits), create
  new ones over the same group and run correct round trips again (closed-form checks of
  _spawn.ht_check).
- exit: rank 3 ends its process after a first round trip. The survivors raise as above, destroy,
  create a buffer over a 3-rank group and keep working.
- ll_skip: the same as skip for a low-latency buffer (without shrink mode): rank 3 skips one LL
  round trip. The other ranks' receive kernels give up at the deadline and their next LL call
  raises a RuntimeError naming rank 3 (GPU waits report through the status block, so the error
  surfaces at the next host-side call); rank 3's late call raises too. All destroy, re-create an
  LL buffer and pass checked LL round trips.
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

    return deep_ep_rs.Buffer(group, NVL, device=_spawn.device(rank), backend=_spawn.gpu_backend(), explicitly_destroy=True)


def _roundtrips(buf, rank, world, seed, count=3):
    gen = torch.Generator(device=buf.device).manual_seed(1000 * seed + rank)
    return sum(_spawn.ht_check(buf, rank, world, gen=gen, salt=seed + i, **SHAPE) for i in range(count))


def _raised(fn):
    """(the message of the RuntimeError `fn` raises, or None; seconds until it returned)."""
    t0 = time.monotonic()
    try:
        fn()
        msg = None
    except RuntimeError as e:
        msg = str(e)
    return msg, time.monotonic() - t0


def _destroy_s(buf) -> float:
    """Seconds `buf.destroy()` took."""
    t0 = time.monotonic()
    buf.destroy()
    return time.monotonic() - t0


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
        out["destroy_s"] = _destroy_s(buf)
    else:
        msg, out["raise_s"] = _raised(lambda: _roundtrips(buf, rank, world, 2, count=1))
        out["error"] = msg
        assert msg is not None, "dispatch with a missing rank must raise"
        assert msg.startswith("deep_ep::dispatch"), msg
        assert re.search(rf"waiting for rank\(s\) \[{FAIL}\]", msg), msg
        assert out["raise_s"] < TIMEOUT_MS / 1000 + 8, out["raise_s"]
        # The poisoned buffer refuses further collectives with a clear message.
        with pytest.raises(RuntimeError, match=r"unusable after an earlier failure"):
            _roundtrips(buf, rank, world, 3, count=1)
        out["destroy_s"] = _destroy_s(buf)
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


LL = dict(T=128, H=2048, E=24, K=4)


def _ll_buffer(rank, world):
    import deep_ep_rs

    hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(LL["T"], LL["H"], world, LL["E"])
    return deep_ep_rs.Buffer(dist.group.WORLD, 0, -(-hint // 128) * 128, low_latency_mode=True,
                             device=_spawn.device(rank), backend=_spawn.gpu_backend(), explicitly_destroy=True)


def _ll_roundtrip(buf, rank, seed, check=True):
    """LL dispatch (BF16) -> identity expert -> combine; checks the combine against the closed form
    x * (sum of the token's valid weights) with DeepEP's calc_diff (< 1e-5 for BF16). Returns the
    number of received rows."""
    dev, (t, h, e, k) = buf.device, (LL["T"], LL["H"], LL["E"], LL["K"])
    gen = torch.Generator(device=dev).manual_seed(1000 * seed + rank)
    x = _spawn.pattern_x(rank, t, h, seed, dev)
    idx = torch.rand((t, e), generator=gen, device=dev).topk(k, dim=1).indices
    idx[torch.rand((t, k), generator=gen, device=dev) < 0.1] = -1
    w = torch.rand((t, k), generator=gen, device=dev)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    if check:
        want = x.float() * (w * (idx >= 0)).sum(dim=1, keepdim=True)
        got = out.float()
        diff = float(1 - 2 * (got * want).sum() / (got * got + want * want).sum().clamp(min=1e-12))
        assert diff < 1e-5, f"LL round trip: calc_diff {diff}"
    return int(count.sum())


def ll_recovery_worker(rank, world):
    buf = _ll_buffer(rank, world)
    out = {"before": sum(_ll_roundtrip(buf, rank, s) for s in (1, 2))}
    torch.cuda.synchronize()
    dist.barrier()
    if rank == FAIL:
        time.sleep(TIMEOUT_MS / 1000 + 1.5)

    def missed_call():
        _ll_roundtrip(buf, rank, 3, check=False)
        torch.cuda.synchronize()  # the receive kernels give up at the deadline
        _ll_roundtrip(buf, rank, 4, check=False)  # the next host-side call raises what they recorded

    msg, out["raise_s"] = _raised(missed_call)
    out["error"] = msg
    assert msg is not None, "an LL call after a missing rank must raise"
    assert msg.startswith("deep_ep::low_latency_"), msg
    if rank != FAIL:
        assert re.search(rf"waiting for rank\(s\) \[{FAIL}\]", msg), msg
        assert out["raise_s"] < TIMEOUT_MS / 1000 + 8, out["raise_s"]
    else:
        # The late rank either times out waiting for its peers, or, where their marks of the
        # call they gave up arrived first, refuses that call (DEK_IC_ERR_LL_ABANDONED).
        assert re.search(r"waiting for rank\(s\) \[[0-2]\]|rank [0-2] gave up its low-latency call", msg), msg
    # Every buffer is unusable now: the survivors' timed out, the late rank's refused a call its
    # peers abandoned (that refusal poisons it too, so its destroy is local, as theirs).
    with pytest.raises(RuntimeError, match=r"unusable"):
        _ll_roundtrip(buf, rank, 5, check=False)
    out["destroy_s"] = _destroy_s(buf)
    torch.cuda.synchronize()
    buf = _ll_buffer(rank, world)
    out["after"] = sum(_ll_roundtrip(buf, rank, s) for s in (6, 7, 8))
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    return out


def test_ll_survivors_raise_then_recover():
    t0 = time.time()
    res = _spawn.run(ll_recovery_worker, WORLD, env={"DEEP_EP_TIMEOUT_MS": str(TIMEOUT_MS)})
    print(f"\n[ll_skip] {time.time() - t0:.1f} s: " + "; ".join(f"rank {r}: {o['ok']}" for r, o in enumerate(res)))
    for o in res:
        v = o["ok"]
        assert v["before"] > 0 and v["after"] > 0
        assert v["destroy_s"] < TIMEOUT_MS / 1000 + 8


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
