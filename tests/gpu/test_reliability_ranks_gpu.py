"""The reliability classes of tests/python/test_reliability.py that need several ranks, on the GPU
(2 ranks: one GPU each, or both on one GPU with the ipc backend, `_spawn`): low-latency format
flags and geometry differing across ranks, LL expert ids below -1, a zero-copy combine view read
after its buffer was destroyed, and two threads in one buffer. Each case must end in a clear error
on every rank (or work), never a crash or a hang. The LL kernels find a format mismatch or a bad id
after the data moved (no host wait: graph-capturable), so the error comes from the buffer's next
call, as DeepEP's LL errors do; the cpu backend raises in the call itself. An LL combine given
another topk_idx than its dispatch is found by the combine's receive (a fingerprint of topk_idx,
kernels/low_latency.cuh `kLlRouting`) and raised at the next call."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402

T, H = 8, 512


def _buffer(rank, world, t=T, h=H, e=None):
    import torch.distributed as dist

    import deep_ep_rs

    e = e or 2 * world
    return deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True,
                             device=_spawn.device(rank), backend=_spawn.gpu_backend(), explicitly_destroy=True), e


def _try(fn, then=None):
    """The error of `fn`, else of `then` (the next call, where LL kernel-found errors surface)."""
    for f in (fn, then):
        if f is None:
            continue
        try:
            f()
            torch.cuda.synchronize()
        except RuntimeError as ex:
            return str(ex)
    return "no error"


def _format_worker(rank, world, flags):
    buf, e = _buffer(rank, world)
    dev = _spawn.device(rank)
    x = torch.ones((4, H), dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, e - 1]] * 4, device=dev)  # every rank sends to rank 0 and to the last rank
    use_fp8, round_scale, use_ue8m0 = flags[rank]
    out = _try(lambda: buf.low_latency_dispatch(x, idx, T, e, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0),
               lambda: buf.low_latency_dispatch(x, idx, T, e, use_fp8=False))
    buf.destroy()
    return out


@pytest.mark.parametrize("flags", [[(True, False, False), (False, False, False)], [(True, False, False), (True, True, True)]],
                         ids=["fp8-vs-bf16", "scale-flags"])
def test_low_latency_format_flags_differing_across_ranks_raise_on_gpu(flags):
    out = [o["ok"] for o in _spawn.run(_format_worker, 2, flags)]
    for r, msg in enumerate(out):
        assert "every rank must pass the same use_fp8, round_scale, use_ue8m0 and use_nvfp4" in msg and f"rank {1 - r}" in msg, (r, msg)


def _geometry_worker(rank, world):
    buf, e = _buffer(rank, world, t=16)
    dev = _spawn.device(rank)
    t = 8 if rank == 0 else 16  # num_max_dispatch_tokens_per_rank differs
    x = torch.ones((4, H), dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, e - 1]] * 4, device=dev)
    out = _try(lambda: buf.low_latency_dispatch(x, idx, t, e, use_fp8=False), lambda: buf.low_latency_dispatch(x, idx, 16, e, use_fp8=False))
    buf.destroy()
    return out


def test_low_latency_geometry_differing_across_ranks_raises_on_gpu():
    out = [o["ok"] for o in _spawn.run(_geometry_worker, 2)]
    for r, msg in enumerate(out):
        assert "every rank must pass the same" in msg and f"rank {1 - r}" in msg and "num_max_dispatch_tokens_per_rank" in msg, (r, msg)


def _combine_topk_worker(rank, world, many=False):
    """A combine given another topk_idx than its dispatch's must raise and leave the buffer usable.
    many: 128 tokens x top-8 (1024 selections), where the rows combine reads this rank's own rows
    in place (the index the send leaves at each row's place: kernels/low_latency.cu,
    `own_rows`, the `kOwn` instantiation); the other topk_idx makes the receive look up own
    (expert, token) pairs the dispatch never routed, whose stale words must be dropped (never a
    load out of bounds)."""
    dev = _spawn.device(rank)
    if many:
        t, h, e = 128, 512, 8 * world
        buf, _ = _buffer(rank, world, t=t, h=h, e=e)
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.ones((t, h), dtype=torch.bfloat16, device=dev)
        idx = torch.rand(t, e, device=dev, generator=g).topk(8, dim=1).indices
        other = (idx + 1) % e  # still distinct per token, mostly other (expert, token) pairs
    else:
        t = T
        buf, e = _buffer(rank, world)
        x = torch.ones((3, H), dtype=torch.bfloat16, device=dev)
        idx = torch.tensor([[0, 1], [2, -1], [3, 0]], device=dev)
        other = torch.tensor([[1, 0], [2, -1], [3, 0]], device=dev)
    w = torch.ones(idx.shape, device=dev)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    bad = _try(lambda: buf.low_latency_combine(recv, other, w, handle), lambda: buf.low_latency_dispatch(x, idx, t, e, use_fp8=False))
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    good, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize()
    buf.destroy()
    return bad, good.float().sum().item()


def test_low_latency_combine_with_another_topk_idx_raises_on_gpu():
    out = [o["ok"] for o in _spawn.run(_combine_topk_worker, 2)]
    for r, (bad, _) in enumerate(out):
        assert "topk_idx differs from the one the dispatch of this handle routed with" in bad, (r, bad)
    assert all(s == 5 * H for _, s in out), out  # rows 0 and 2 through two experts, row 1 through one, weights 1


def test_low_latency_combine_with_another_topk_idx_at_many_selections_raises_on_gpu():
    out = [o["ok"] for o in _spawn.run(_combine_topk_worker, 2, True)]
    for r, (bad, _) in enumerate(out):
        assert "topk_idx differs from the one the dispatch of this handle routed with" in bad, (r, bad)
    assert all(s == 128 * 8 * 512 for _, s in out), out  # every token through 8 experts, rows of ones, weights 1


def _combine_weights_worker(rank, world):
    """A dispatch that carried top-k weights makes the combine send partial sums (when the format
    fits: hidden 2048, 16 experts a rank); a combine given other weights must raise."""
    import torch.distributed as dist

    import deep_ep_rs

    t, h, e, k = 8, 2048, 16 * world, 2
    dev = _spawn.device(rank)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True,
                            device=dev, backend=_spawn.gpu_backend(), explicitly_destroy=True)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices
    w, w2 = torch.rand(t, k, device=dev, generator=g), torch.rand(t, k, device=dev, generator=g)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, topk_weights=w)
    bad = _try(lambda: buf.low_latency_combine(recv, idx, w2, handle),
               lambda: buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, topk_weights=w))
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, topk_weights=w)
    good, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize()
    buf.destroy()
    return bad, bool(torch.isfinite(good.float()).all())


def test_low_latency_combine_with_other_weights_than_its_partial_sums_raises_on_gpu():
    out = [o["ok"] for o in _spawn.run(_combine_weights_worker, 2)]
    for r, (bad, finite) in enumerate(out):
        assert "topk_weights differ from the ones the dispatch of this handle carried" in bad, (r, bad)
        assert finite, r


def _below_minus_one_worker(rank, world):
    buf, e = _buffer(rank, world)
    dev = _spawn.device(rank)
    x = torch.ones((2, H), dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, -2], [1, -1]], device=dev)
    good = torch.tensor([[0, -1], [1, -1]], device=dev)
    out = _try(lambda: buf.low_latency_dispatch(x, idx, T, e, use_fp8=False), lambda: buf.low_latency_dispatch(x, good, T, e, use_fp8=False))
    buf.destroy()
    return out


def test_low_latency_expert_ids_below_minus_one_raise_on_gpu():
    out = [o["ok"] for o in _spawn.run(_below_minus_one_worker, 2)]
    for r, msg in enumerate(out):
        assert "topk_idx" in msg and "-2" in msg, (r, msg)


def _view_worker(rank, world):
    import gc

    results = []
    for how in ("destroy", "gc"):
        buf, e = _buffer(rank, world)
        dev = _spawn.device(rank)
        if how == "gc":
            buf.explicitly_destroy = False
        x = torch.ones((3, H), dtype=torch.bfloat16, device=dev)
        idx = torch.tensor([[0, 1], [1, -1], [0, -1]], device=dev)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, e, use_fp8=False)
        view = buf.get_next_low_latency_combine_buffer(handle)
        view.fill_(2.0)
        torch.cuda.synchronize()
        if how == "destroy":
            buf.destroy()
        del buf, recv, handle
        gc.collect()
        view.add_(1.0)  # the memory is still mapped: no illegal address
        results.append((how, float(view.float().mean())))
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_zero_copy_view_outlives_its_buffer_on_gpu(world):
    out = [o["ok"] for o in _spawn.run(_view_worker, world)]
    for r, res in enumerate(out):
        assert res == [["destroy", 3.0], ["gc", 3.0]], (r, res)


def _threads_worker(rank, world):
    import threading
    import time

    buf, e = _buffer(rank, world)
    dev = _spawn.device(rank)
    x = torch.ones((2, H), dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, 1], [1, -1]], device=dev)
    seen = {}
    import torch.distributed as dist

    def dispatch_loop():
        torch.cuda.set_device(dev)
        try:
            for _ in range(200):
                buf.low_latency_dispatch(x, idx, T, e, use_fp8=False)
        except RuntimeError as ex:
            seen["busy"] = str(ex)

    # Rank 0 races two threads in its buffer: one of them must be refused (never a mix-up of rows);
    # rank 1 stays out of the ops, so the refused rank's ops cannot pair with a peer's.
    if rank == 0:
        ts = [threading.Thread(target=dispatch_loop) for _ in range(2)]
        [t.start() for t in ts]
        time.sleep(0.5)
        [t.join(timeout=120) for t in ts]
    dist.barrier()
    buf.destroy()
    return seen.get("busy", "")


def test_two_threads_in_one_gpu_buffer_are_refused():
    os.environ["DEEP_EP_TIMEOUT_MS"] = "5000"
    try:
        out = [o["ok"] for o in _spawn.run(_threads_worker, 1)]
    finally:
        del os.environ["DEEP_EP_TIMEOUT_MS"]
    assert "is in use by another thread of this process" in out[0], out
