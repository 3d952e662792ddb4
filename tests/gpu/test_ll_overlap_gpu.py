"""Single-batch overlap on GPU buffers (issue 33 item 5; SGLang's SBO): the LL combine is ordered
after the down GEMM's *start* only, and its send waits on the device for the GEMM's signals
(`comp_signal`, Hopper; `src_signals`, Blackwell) before it reads each block of rows.

The "GEMM" here writes the expert outputs into a tensor first filled with NaN (on the same stream,
before the event the combine waits for), after a device sleep, then raises the signals; the combine
on another stream must give the bit-exact result of the combine without overlap (its reference, at
the same ranks), with per-expert rows (no weights in the dispatch) and with partial sums (weights),
with per-expert rows as LogFMT (the send's encode waits for the signals too),
with and without the receive hook, with `num_sms` capping the send grid and without. A send that
read rows before their signal would return NaN. Ranks share one GPU through the ipc backend where
there are fewer GPUs. A signal never raised: the send times out (DEEP_EP_TIMEOUT_MS) with an error
naming the wait, in its own process. DEEP_EP_GPU_DRY=1: CPU buffers (a check of the harness; their
op requires raised signals, so the GEMM runs before the call there).
"""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import _spawn

DRY = os.environ.get("DEEP_EP_GPU_DRY", "") == "1"
SUPPORTS_DRY = True
T, H = 16, 512


def _worker(rank, world, seed):
    import deep_ep_rs

    dev = torch.device("cpu") if DRY else _spawn.device(rank)
    experts = 4 * world
    el = experts // world
    nbytes = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, world, experts)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, explicitly_destroy=True,
                            device="cpu" if DRY else dev, backend="cpu" if DRY else _spawn.gpu_backend())
    alt = None if DRY else torch.cuda.Stream(device=dev)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    checked = 0
    try:
        # (weighted, hook, form, num_sms, LogFMT): LogFMT combines rows only (no partial sums).
        for step, (weighted, hook, form, sms, lf) in enumerate([(False, False, "hopper", 0, False), (True, False, "hopper", 4, False),
                                                                (False, True, "blackwell", 0, False), (True, True, "hopper", 2, False),
                                                                (True, False, "blackwell", 1, False), (False, False, "hopper", 1, False),
                                                                (False, False, "hopper", 0, True), (False, True, "blackwell", 2, True)]):
            n = [T, 9, 1, T, 5, 12, T, 7][step]
            x = (torch.randn((n, H), generator=g) * 4).to(torch.bfloat16).to(dev)
            idx = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(n)]).to(dev)
            w = torch.rand((n, 3), generator=g).to(dev)
            recv, count, handle, _, h = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False, return_recv_hook=hook,
                                                                 topk_weights=w if weighted else None)
            if h is not None:
                h()
            # LogFMT casts groups below 1 only: its outputs are scaled by 2^-6 (exact) so its encode runs.
            scale = 2.0 ** -6 if lf else 3.0
            y_ref = recv * scale
            want, _, _ = buf.low_latency_combine(y_ref, idx, w, handle, use_logfmt=lf)
            if lf:  # the groups were cast (LogFMT's values differ from the BF16 combine's), not sent raw
                plain, _, _ = buf.low_latency_combine(y_ref, idx, w, handle)
                assert not torch.equal(want.cpu(), plain.cpu()), f"step {step}: LogFMT sent every group raw"
            block_m = [1, 4, 64][step % 3]
            per = -(-world * T // block_m)
            counts = count.tolist()
            y = torch.full_like(recv, float("nan"))  # unwritten rows: NaN until the GEMM writes them
            # The signals are zeroed before the GEMM starts (as SGLang's are): a tensor allocated
            # after the event would hold stale memory, maybe raised values, when the combine reads it.
            sig = torch.zeros(el * per, dtype=torch.int32, device=dev) if form == "hopper" else torch.zeros(el, dtype=torch.uint32, device=dev)
            start = torch.cuda.Event() if alt is not None else None
            if start is not None:
                start.record()
                torch.cuda._sleep(3_000_000)  # the GEMM is still running when the combine starts
            torch.mul(recv, scale, out=y)
            if form == "hopper":
                for l, r in enumerate(counts):
                    sig[l * per:l * per + -(-r // block_m)] = 5  # DeepGEMM: ceil(N / block_n) tiles per block
                kw = dict(packed_recv_count=count, comp_signal=sig, block_m=block_m, threshold=5, num_sms=sms)
            else:
                sig.fill_(7)
                kw = dict(src_signals=sig, src_signal_expect_value=7)
            ctx = torch.cuda.stream(alt) if alt is not None else contextlib.nullcontext()
            if alt is not None:
                alt.wait_event(start)
            with ctx:
                got, _, rh = buf.low_latency_combine(y, idx, w, handle, overlap=True, return_recv_hook=hook, use_logfmt=lf, **kw)
                if rh is not None:
                    rh()
            if alt is not None:
                torch.cuda.current_stream().wait_stream(alt)
            assert not torch.isnan(got.float()).any(), f"step {step}: the send read rows before their signal"
            assert torch.equal(got.cpu(), want.cpu()), f"step {step} ({form}, weighted={weighted}, hook={hook}, num_sms={sms}, logfmt={lf})"
            checked += n
            dist.barrier()
    finally:
        buf.destroy()
    return checked


@pytest.mark.parametrize("world", [1, 2, 4])
def test_overlap_combine_waits_for_the_gemm_on_the_device(world):
    env = {"DEEP_EP_TIMEOUT_MS": "30000", **({} if DRY else {"DEEP_EP_BACKEND": _spawn.gpu_backend(world)})}
    rows = [r["ok"] for r in _spawn.run(_worker, world, 11, env=env, dry=DRY)]
    assert all(r > 0 for r in rows), rows


def _never_raised(rank, world):
    import deep_ep_rs

    dev = _spawn.device(rank)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, 1, 4), low_latency_mode=True,
                            explicitly_destroy=True, device=dev, backend=_spawn.gpu_backend())
    x = torch.ones((4, H), dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], device=dev)
    w = torch.ones((4, 2), device=dev)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, 4, use_fp8=False)
    sig = torch.zeros(4 * T, dtype=torch.int32, device=dev)  # the GEMM never raises them
    try:
        buf.low_latency_combine(recv, idx, w, handle, overlap=True, packed_recv_count=count, comp_signal=sig, block_m=1,
                                threshold=1)
        torch.cuda.synchronize()
        buf.low_latency_combine(recv, idx, w, handle)  # the next op reports the timed-out wait
    except RuntimeError as e:
        msg = str(e)
        assert "comp_signal" in msg and "never raised" in msg and "rank 0" in msg, msg
        return 1
    raise AssertionError("a signal never raised must time out with an error")


def test_a_signal_never_raised_times_out_with_an_error():
    if DRY:
        pytest.skip("GPU buffers only (CPU buffers raise before sending: tests/python/test_ll_overlap.py)")
    out = _spawn.run(_never_raised, 1, env={"DEEP_EP_BACKEND": _spawn.gpu_backend(1), "DEEP_EP_TIMEOUT_MS": "2000"})
    assert out[0]["ok"] == 1
