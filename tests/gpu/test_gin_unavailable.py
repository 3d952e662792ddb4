"""Internode buffers over NCCL GIN on 4 GPUs as 2 emulated nodes (DEEP_EP_NVL_DOMAIN_SIZE=2,
DEEP_EP_RDMA_TRANSPORT=gin), nccl backend.

Buffer creation asks ncclDevCommCreate for GIN (ginForceEnable) on every rank. On a machine
without a GPUDirect-RDMA NIC NCCL grants none, and creating an LL buffer or a normal-mode
internode buffer must raise a RuntimeError that says GIN is unavailable (not "not implemented",
no crash, no hang). Where NCCL does grant GIN, the buffers instead run over GIN: the LL buffer one
dispatch -> identity expert -> combine round trip, the normal-mode buffer three internode
dispatch -> identity expert -> combine round trips (_spawn.ht_check: every received row against
its source, the combine against x * ranks reached; three, so that the seam signals, which are
never reset, count across ops), all checked in closed form. With DEEP_EP_GIN_COMMS=2 (LL) the buffer opens a second GIN communicator split from its own:
the refusal then names the communicator (0 of 2, the first device comm NCCL is asked for), and
where GIN is granted the round trip runs over both communicators.

Every rank arms a watchdog (faulthandler) that ends it after WATCHDOG_S seconds: a hang in NCCL
then shows as a rank that exited without reporting, which fails the test.
"""
import faulthandler
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _spawn  # noqa: E402

WORLD, NVL_DOMAIN = 4, 2
WATCHDOG_S = 180
T, H, EL, TOPK = 32, 2048, 2, 4  # tokens per rank, hidden, experts per rank, top-k
ENV = {"DEEP_EP_NVL_DOMAIN_SIZE": str(NVL_DOMAIN), "DEEP_EP_RDMA_TRANSPORT": "gin", "DEEP_EP_TIMEOUT_MS": "20000"}


def _gin_unavailable(e):
    """Whether `e` is the buffer's "no GIN here" error (not a NotImplemented, not another failure)."""
    text = str(e)
    return "GIN setup on rank" in text and "unavailable" in text and "not implemented" not in text


def ll_round_trip(buf, rank, world):
    """One LL dispatch -> identity expert -> combine in BF16; returns the rows received. x and the
    weights are exact in bf16 and their weighted sums exact in fp32, so the combine must equal
    x * (sum of the token's valid weights) bit for bit."""
    dev = buf.device
    e = EL * world
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    idx = torch.stack([torch.randperm(e, generator=gen)[:TOPK] for _ in range(T)]).to(torch.int64)
    idx[torch.rand((T, TOPK), generator=gen) < 0.1] = -1
    w = (torch.randint(1, 5, (T, TOPK), generator=gen).float() / 4).masked_fill(idx < 0, 0)
    x = _spawn.pattern_x(rank, T, H, 3, "cpu")
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), T, e, use_fp8=False)
    # Expected rows per local expert: every (source, token) that chose it.
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(all_idx, idx)
    rx, cnt = recv_x.cpu(), count.cpu()
    rows = 0
    for l in range(EL):
        want = sorted(tuple(_spawn.pattern_x(s, T, H, 3, "cpu")[t].float().tolist())
                      for s in range(world) for t in range(T) if int(rank * EL + l) in all_idx[s][t].tolist())
        c = int(cnt[l])
        assert c == len(want), f"local expert {l}: {c} rows received, {len(want)} sent"
        assert sorted(map(tuple, rx[l, :c].float().tolist())) == want, f"local expert {l}: wrong rows"
        rows += c
    out, _, _ = buf.low_latency_combine(recv_x, idx.to(dev), w.to(dev), handle)
    want_out = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(out.cpu(), want_out), f"combine differs by {(out.cpu().float() - want_out.float()).abs().max()}"
    return rows


def gin_worker(rank, world, low_latency, comms):
    import deep_ep_rs

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    dev = torch.device("cuda", rank)
    if low_latency:
        nbytes = -(-deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, EL * world) // 128) * 128
        make = lambda: deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, device=dev,  # noqa: E731
                                         backend=_spawn.gpu_backend(), explicitly_destroy=True)
    else:
        make = lambda: deep_ep_rs.Buffer(dist.group.WORLD, 64 << 20, 64 << 20, device=dev,  # noqa: E731
                                         backend=_spawn.gpu_backend(), explicitly_destroy=True)
    try:
        buf = make()
    except RuntimeError as e:
        assert _gin_unavailable(e), f"expected the 'GIN unavailable' error, got: {e}"
        assert f"rank {rank}" in str(e) and "DEEP_EP_RDMA_TRANSPORT=lsa" in str(e), str(e)
        if comms > 1:
            assert f"(communicator 0 of {comms})" in str(e) and f"{comms} communicator(s)" in str(e), str(e)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            print(f"rank 0, {'LL' if low_latency else 'normal-mode'} buffer: {e}", flush=True)
        return "unavailable"
    try:
        if low_latency:
            return ll_round_trip(buf, rank, world)
        # GIN granted: the normal-mode kernels' inter-node leg runs over GIN.
        gen = torch.Generator(device=dev).manual_seed(300 + rank)
        return sum(_spawn.ht_check(buf, rank, world, n=64, hidden=1024, experts=EL * world, topk=TOPK, gen=gen, salt=i)
                   for i in range(3))
    finally:
        dist.barrier()
        buf.destroy()
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("low_latency,comms", [(True, 1), (False, 1), (True, 2)], ids=["ll", "normal", "ll-2comms"])
def test_gin_buffer_is_clear_about_gin(low_latency, comms):
    if _spawn.gpu_backend() != "nccl":
        pytest.skip("GIN buffers are built by the nccl backend")
    res = _spawn.run(gin_worker, WORLD, low_latency, comms, env={**ENV, "DEEP_EP_GIN_COMMS": str(comms)})
    missing = [r for r, o in enumerate(res) if o is None]
    assert not missing, f"ranks {missing} exited without reporting (crash, or the {WATCHDOG_S} s watchdog)"
    outcomes = {o["ok"] if isinstance(o["ok"], str) else "granted" for o in res}
    # Every rank sees the same machine: all refuse, or all run.
    assert len(outcomes) == 1, res
    print(f"GIN {'LL' if low_latency else 'normal-mode'} buffer on this machine: {outcomes.pop()} (rank 0: {str(res[0])[:300]})")
