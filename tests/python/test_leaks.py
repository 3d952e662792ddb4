"""Create/destroy cycles of CPU buffers leak nothing: no file left in DEEP_EP_SHM_DIR (pointed at
a fresh directory), no growth in open file descriptors (/proc/self/fd) or in mappings of
deep_ep_ files (/proc/self/maps), and every destroyed handle raises in buffer_info.

1 rank in-process (raw ops), 2 ranks as threads of this process (raw ops), 2 ranks as processes
through deep_ep_rs.Buffer (normal and low-latency buffers, some used for a dispatch), and the error
paths: creates that time out waiting for a missing rank, and ops that raise on bad input before
their buffer is destroyed.
"""
import os
import threading

import pytest
import torch
from _harness import env_var

CYCLES = 100
CPU = torch.device("cpu")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def deep_ep_maps() -> list:
    """Mappings of the CPU backend's shared-memory files, named deep_ep_<id>: the file name is
    matched, not the path (a checkout, a temporary folder or site-packages/deep_ep_rs may hold
    deep_ep_ in their names)."""
    with open("/proc/self/maps") as f:
        lines = [line.strip() for line in f]
    return [line for line in lines if line.removesuffix(" (deleted)").rsplit("/", 1)[-1].startswith("deep_ep_")]


def shm_dir(path):
    """Points DEEP_EP_SHM_DIR (read at every create_buffer) at `path` for the duration."""
    return env_var("DEEP_EP_SHM_DIR", path)


def assert_destroyed(ops, handles):
    for h in handles:
        with pytest.raises(RuntimeError, match=rf"^deep_ep::buffer_info: buffer handle {h} was destroyed"):
            ops.buffer_info(h)


def check_cycles(ops, path, cycle, n=CYCLES, sync=lambda: None):
    """Runs `cycle()` (returns the handles it destroyed) once to warm up, then n times, and
    checks fds, mappings, the shm directory and the destroyed handles. `sync()` waits for the
    peer processes (rank 0 removes a file only once every rank has mapped it)."""
    with shm_dir(path):
        cycle()
        fds, maps = open_fds(), deep_ep_maps()
        handles = []
        for _ in range(n):
            handles += cycle()
    sync()
    assert os.listdir(path) == [], f"files left in DEEP_EP_SHM_DIR: {os.listdir(path)}"
    # The baseline may hold mappings of earlier tests' buffers whose zero-copy views keep them
    # (by design, until the process exits); the cycles must add none.
    assert deep_ep_maps() == maps, f"deep_ep_ mappings left: {sorted(set(deep_ep_maps()) - set(maps))}"
    assert open_fds() == fds, f"open file descriptors grew from {fds} to {open_fds()}"
    assert len(set(handles)) == len(handles), "a handle was reused"
    assert_destroyed(ops, handles)
    return handles


def test_one_rank_in_process(ops, tmp_path):
    def cycle():
        uid = ops.get_unique_id("cpu", CPU)
        h = int(ops.create_buffer(uid, 0, 1, CPU, 1 << 22, 1 << 20, True, "cpu"))
        assert list(ops.buffer_info(h))[:2] == [0, 1]
        ops.destroy_buffer(h)
        return [h]

    assert len(check_cycles(ops, tmp_path, cycle)) == CYCLES


def test_two_ranks_as_threads(ops, tmp_path):
    def cycle():
        uid = ops.get_unique_id("cpu", CPU)
        hs, errs = [None, None], []

        def rank(r):
            try:
                hs[r] = int(ops.create_buffer(uid, r, 2, CPU, 1 << 20, 0, False, "cpu"))
                assert int(ops.buffer_info(hs[r])[0]) == r
                ops.destroy_buffer(hs[r])
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errs, errs
        return hs

    assert len(check_cycles(ops, tmp_path, cycle)) == 2 * CYCLES


def test_failed_creates_and_failing_ops_leak_nothing(ops, tmp_path):
    def cycle():
        with env_var("DEEP_EP_TIMEOUT_MS", "100"):
            for rank in (0, 1):  # the creator of the file, then a joiner whose creator never comes
                with pytest.raises(RuntimeError, match=r"^deep_ep::create_buffer: timed out .* waiting for rank\(s\) \[\d\]"):
                    ops.create_buffer(ops.get_unique_id("cpu", CPU), rank, 2, CPU, 1 << 20, 0, False, "cpu")
        h = int(ops.create_buffer(ops.get_unique_id("cpu", CPU), 0, 1, CPU, 1 << 20, 0, False, "cpu"))
        idx = torch.tensor([[0, 9], [1, -1]])
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(torch.tensor([[0, 3], [1, -1]]), 4, 1)
        with pytest.raises(RuntimeError, match=r"^deep_ep::dispatch: topk_idx holds expert id 9"):
            ops.dispatch(h, torch.ones((2, 64), dtype=torch.bfloat16), None, idx, torch.ones((2, 2)), ntpr, in_rank, ntpe, 1, 0,
                         [4, 6, 256, 6, 128])
        ops.destroy_buffer(h)
        return [h]

    assert len(check_cycles(ops, tmp_path, cycle, n=20)) == 20


def leak_worker(rank, world, path):
    import deep_ep_rs
    import torch.distributed as dist

    ops = torch.ops.deep_ep
    state = {"i": 0}

    def cycle():
        i = state["i"] = state["i"] + 1
        ll = i % 2 == 0
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, (1 << 22) if ll else 0, low_latency_mode=ll, device="cpu",
                                explicitly_destroy=True)
        h = buf.handle
        if i % 10 == 0:  # touch the pages: a dispatch/combine round trip
            idx = torch.tensor([[0, 3], [1, -1], [2, 0]])
            x = torch.ones((3, 64), dtype=torch.bfloat16)
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 4)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
            out, _, _ = buf.combine(recv_x, handle)
            assert torch.equal(out, x * in_rank.sum(1, keepdim=True).to(torch.bfloat16))
        buf.destroy()
        return [h]

    return len(check_cycles(ops, path, cycle, sync=dist.barrier))


def test_two_ranks_through_buffer(rank_pool, tmp_path):
    results = rank_pool(2).run(leak_worker, str(tmp_path))
    assert results == [CYCLES, CYCLES]
    assert os.listdir(tmp_path) == []
