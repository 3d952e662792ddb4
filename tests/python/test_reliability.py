"""Reliability faults of the CPU backend that must end in a clear error, never in a crash, a
silent wrong result or a file left behind (more in test_bad_input*.py, test_leaks.py)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

SMALL_SHM = textwrap.dedent("""
    import torch, deep_ep_rs
    ops = torch.ops.deep_ep
    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    try:
        ops.create_buffer(uid, 0, 1, torch.device("cpu"), 64 << 20, 0, False, "cpu")
        print("CREATED")
    except RuntimeError as e:
        print("ERR", e)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a small private tmpfs")
def test_shared_memory_folder_too_small_is_a_clear_error_not_sigbus(tmp_path):
    """A 64 MiB buffer in an 8 MiB tmpfs (Docker's /dev/shm is 64 MB): creation reserves every page,
    so it fails at once with the size, the folder and DEEP_EP_SHM_DIR, and leaves no file."""
    d = tmp_path / "shm"
    d.mkdir()
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    sh = f"mount -t tmpfs -o size=8m none {d} && {sys.executable} {script}; echo LEFT=$(ls -A {d} | wc -l)"
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", sh], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DEEP_EP_SHM_DIR=str(d)))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "ERR deep_ep::create_buffer: cannot reserve 67" in out and str(d) in out and "DEEP_EP_SHM_DIR" in out, out + p.stderr
    assert "LEFT=0" in out, out


# The start of a rank process (argv: rank, uid file): rank 0 makes the CPU unique id and publishes
# it in the file, the others wait for it.
UID_EXCHANGE = """
    import os, sys, time, torch, deep_ep_rs
    ops = torch.ops.deep_ep
    rank, uid_file = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        uid = ops.get_unique_id("cpu", torch.device("cpu"))
        with open(uid_file + ".tmp", "wb") as f:
            f.write(bytes(uid.tolist()))
        os.rename(uid_file + ".tmp", uid_file)
    else:
        while not os.path.exists(uid_file):
            time.sleep(0.02)
        uid = torch.tensor(list(open(uid_file, "rb").read()), dtype=torch.uint8)
"""

ANON_RANK = textwrap.dedent(UID_EXCHANGE + """
    mib = int(sys.argv[3])
    try:
        h = ops.create_buffer(uid, rank, 2, torch.device("cpu"), mib << 20, 0, False, "cpu")
        x = torch.full((64, 1 << 18), float(rank + 1), dtype=torch.bfloat16)  # 32 MiB of rows: touches the memory
        idx = torch.tensor([[1 - rank, rank]] * 64)
        ntr, _, ntpe, itr = ops.get_dispatch_layout(idx, 2, 2)
        out = ops.dispatch(h, x, None, None, None, ntr, itr, ntpe, 1, 0, [20, 6, 256, 6, 128])
        got = out[0].float().sum(dim=1) / (1 << 18)
        # One write per line: both ranks share the pipe, and an unbuffered print() writes its
        # pieces separately, so the two lines could interleave.
        os.write(1, f"CREATED {int(out[0].shape[0])} {sorted(set(got.tolist()))}\\n".encode())
        ops.destroy_buffer(h)
    except RuntimeError as e:
        os.write(1, f"ERR {e}\\n".encode())
""")


def _no_shm_dir_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "DEEP_EP_SHM_DIR"}
    env.update(extra)
    return env


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a small private tmpfs")
def test_default_memory_does_not_need_dev_shm(tmp_path):
    """The default (no DEEP_EP_SHM_DIR) is anonymous memory handed out by rank 0: a 2-rank buffer
    of 2 x 80 MiB works with an 8 MiB /dev/shm (Docker's default is 64 MB), and leaves nothing."""
    script = tmp_path / "anon_rank.py"
    script.write_text(ANON_RANK)
    uid = tmp_path / "uid"
    run = f"{sys.executable} {script} {{}} {uid} 80"
    sh = (f"mount -t tmpfs -o size=8m none /dev/shm && ({run.format(0)} & {run.format(1)}; wait); "
          "echo LEFT=$(ls -A /dev/shm | grep -c deep_ep_)")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", sh], capture_output=True, text=True, timeout=180,
                       env=_no_shm_dir_env(DEEP_EP_TIMEOUT_MS="60000"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("CREATED 128 [1.0, 2.0]") == 2 and "LEFT=0" in p.stdout, p.stdout + p.stderr


def test_memory_that_cannot_be_reserved_is_a_clear_error(tmp_path):
    """Anonymous memory that cannot be reserved (here: a 1 MiB file-size limit) fails creation at
    once, naming the size, instead of SIGBUS at the first large op."""
    code = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); exec(open(%r).read())" % str(tmp_path / "small.py"))
    (tmp_path / "small.py").write_text(SMALL_SHM)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_no_shm_dir_env())
    assert "ERR deep_ep::create_buffer: cannot reserve 67" in p.stdout and "anonymous memory" in p.stdout, p.stdout + p.stderr


def _maps_anonymous_buffer(pid):
    """Whether process `pid` has mapped a CPU buffer's anonymous memory."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("memfd:deep_ep_cpu_" in line for line in f)
    except OSError:
        return False


def _rendezvous_socket(uid_file):
    """The abstract socket name of the CPU buffer whose unique id is in `uid_file`."""
    return "@deep_ep/cpu_" + open(uid_file, "rb").read().split(b":")[-1].rstrip(b"\0").decode()


def _deep_ep_sockets():
    """Abstract sockets of buffers being created (anonymous memory's rendezvous)."""
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if "@deep_ep/" in line]


# ---- invalid environment values are errors that name the variable -----------------------------
@pytest.mark.parametrize("value", ["3000ms", "abc", "-1", "0", "1e3"])
def test_invalid_timeout_env_is_an_error_naming_it(ops, value, monkeypatch):
    monkeypatch.setenv("DEEP_EP_TIMEOUT_MS", value)
    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=rf"deep_ep::create_buffer: DEEP_EP_TIMEOUT_MS=\"{value}\" is not a whole number of milliseconds"):
        ops.create_buffer(uid, 0, 1, torch.device("cpu"), 1 << 20, 0, False, "cpu")


# ---- a forked child cannot use its parent's buffer -----------------------------------------------
FORK = textwrap.dedent("""
    import os, torch, deep_ep_rs
    ops = torch.ops.deep_ep
    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    h = int(ops.create_buffer(uid, 0, 1, torch.device("cpu"), 1 << 22, 1 << 22, True, "cpu"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ops.clean_low_latency_buffer(h, 8, 256, 2)
            msg = "NO ERROR"
        except RuntimeError as e:
            msg = str(e)
        os.write(w, msg.encode()); os._exit(0)
    os.waitpid(pid, 0)
    print("CHILD:", os.read(r, 4096).decode())
    ops.clean_low_latency_buffer(h, 8, 256, 2)   # the parent's buffer still works
    ops.destroy_buffer(h)
    print("PARENT OK")
""")


def test_forked_child_using_parents_buffer_raises():
    p = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "CHILD: deep_ep::clean_low_latency_buffer: buffer 1 belongs to process" in p.stdout and "forked child" in p.stdout, p.stdout
    assert "PARENT OK" in p.stdout


# ---- two threads in one buffer at once: the second raises --------------------------------------
def test_second_thread_in_a_busy_buffer_raises(ops):
    import threading

    cpu = torch.device("cpu")
    uid = ops.get_unique_id("cpu", cpu)
    hs = [None, None]
    ts = [threading.Thread(target=lambda r=r: hs.__setitem__(r, int(ops.create_buffer(uid, r, 2, cpu, 1 << 22, 0, False, "cpu"))))
          for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    x = torch.ones((4, 128), dtype=torch.bfloat16)
    idx = torch.tensor([[0], [1], [2], [3]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 2)
    args = (x, None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])
    out = {}

    def rank0():  # waits inside the op until rank 1 arrives
        out["rank0"] = ops.dispatch(hs[0], *args)[0].shape[0]

    t = threading.Thread(target=rank0)
    t.start()
    import time

    # Give the other thread time to enter its dispatch (it then waits there for rank 1). Polling
    # with another op of the buffer could itself make that thread's entry fail.
    time.sleep(2.0)
    with pytest.raises(RuntimeError, match=rf"buffer {hs[0]} is in use by another thread of this process"):
        ops.dispatch(hs[0], *args)
    assert ops.buffer_info(hs[0])[:2] == [0, 2]  # facts are answered meanwhile
    out["rank1"] = ops.dispatch(hs[1], *args)[0].shape[0]
    t.join()
    assert out == {"rank0": 4, "rank1": 4}
    ts = [threading.Thread(target=ops.destroy_buffer, args=(h,)) for h in hs]
    [t.start() for t in ts]
    [t.join() for t in ts]


# ---- content of routing inputs ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-2, 8, 1 << 40])
def test_layout_rejects_out_of_range_expert_ids(ops, bad):
    idx = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(RuntimeError, match=rf"deep_ep::get_dispatch_layout: topk_idx\[1, 1\] = {bad} is not an expert id: ids must be in \[-1, 8\)"):
        ops.get_dispatch_layout(idx, 8, 2)


@pytest.mark.parametrize("bad", [-2, -100, 8])
def test_low_latency_dispatch_rejects_out_of_range_expert_ids(ops, bad):
    uid = ops.get_unique_id("cpu", torch.device("cpu"))
    h = int(ops.create_buffer(uid, 0, 1, torch.device("cpu"), 0, ops.low_latency_rdma_size_hint(4, 256, 1, 8), True, "cpu"))
    try:
        x = torch.zeros((2, 256), dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [bad, 3]])
        with pytest.raises(RuntimeError, match=rf"deep_ep::low_latency_dispatch: topk_idx\[1, 0\] = {bad} is not an expert id"):
            ops.low_latency_dispatch(h, x, idx, None, None, None, 4, 8, False, False, False)
    finally:
        ops.destroy_buffer(h)


# ---- size hints never wrap ---------------------------------------------------------------------
def test_size_hints_refuse_arguments_that_would_overflow(ops):
    with pytest.raises(RuntimeError, match="low_latency_rdma_size_hint: arguments too large"):
        ops.low_latency_rdma_size_hint(1 << 40, 1 << 20, 8, 1 << 20)
    with pytest.raises(RuntimeError, match="nvl_buffer_size_hint: arguments too large"):
        ops.nvl_buffer_size_hint([20, 6, 256, 6, 128], 1 << 60, 8)
    with pytest.raises(RuntimeError, match="rdma_buffer_size_hint: arguments too large"):
        ops.rdma_buffer_size_hint([20, 6, 256, 6, 128], 1 << 60, 16)
    assert ops.low_latency_rdma_size_hint(128, 7168, 8, 288) == 2_146_961_792  # DeepEP's worked example still holds


# ---- a zero-copy view outlives its buffer -------------------------------------------------------
VIEW = textwrap.dedent("""
    import gc, torch, torch.distributed as dist, deep_ep_rs
    ops = torch.ops.deep_ep
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    T, H, E = 4, 256, 2
    for how in ("destroy", "gc"):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                                low_latency_mode=True, explicitly_destroy=(how == "destroy"))
        x = torch.ones((3, H), dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1], [0, -1]])
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        view = buf.get_next_low_latency_combine_buffer(handle)
        view.fill_(2.0)
        if how == "destroy":
            buf.destroy()
        del buf, recv, handle
        gc.collect()
        view.add_(1.0)                       # the memory is still mapped: no SIGSEGV
        print(how, float(view.float().mean()))
    dist.destroy_process_group()
""")


def test_zero_copy_view_outlives_its_buffer():
    from _harness import free_port

    p = subprocess.run([sys.executable, "-c", VIEW % free_port()], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit {p.returncode} (SIGSEGV is -11)\n{p.stderr}"
    assert "destroy 3.0" in p.stdout and "gc 3.0" in p.stdout, p.stdout


# ---- a buffer without normal-mode memory ------------------------------------------------------------
def test_normal_ops_on_a_buffer_without_nvl_bytes_say_so(ops):
    cpu = torch.device("cpu")
    h = int(ops.create_buffer(ops.get_unique_id("cpu", cpu), 0, 1, cpu, 0, 0, False, "cpu"))
    try:
        x = torch.ones((4, 128), dtype=torch.bfloat16)
        idx = torch.tensor([[0], [1], [0], [1]])
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 2, 1)
        with pytest.raises(RuntimeError, match=r"deep_ep::dispatch: this buffer has no normal-mode memory \(num_nvl_bytes = 0\)"):
            ops.dispatch(h, x, None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])
    finally:
        ops.destroy_buffer(h)


def test_an_output_too_large_to_allocate_names_the_op_and_shape(ops, buffer1):
    x = torch.ones((4, 128), dtype=torch.bfloat16)
    idx = torch.tensor([[0], [1], [0], [1]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 2, 1)
    rows = (1 << 31) - 1  # the most rows int32 indices allow: 512 GiB of bf16 rows
    with pytest.raises(RuntimeError, match=rf"deep_ep::dispatch: cannot allocate an output of shape \[{rows}, 128\] \(torch\.bfloat16"):
        ops.dispatch(buffer1, x, None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, rows, [4, 6, 256, 6, 128])
    with pytest.raises(RuntimeError, match=r"deep_ep::dispatch: num_worst_tokens must be at most 2147483647 \(rows are indexed by int32\), got 1125899906842624"):
        ops.dispatch(buffer1, x, None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, 1 << 50, [4, 6, 256, 6, 128])


# ---- low-latency format flags must agree across ranks ---------------------------------------------
def _ll_format_worker(rank, world, flags):
    import torch.distributed as dist

    import deep_ep_rs

    t, h, e = 8, 512, 2 * world
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    x = torch.ones((4, h), dtype=torch.bfloat16)
    idx = torch.tensor([[0, e - 1]] * 4)  # every rank sends to rank 0 and to the last rank
    use_fp8, round_scale, use_ue8m0 = flags[rank]
    try:
        buf.low_latency_dispatch(x, idx, t, e, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        out = "no error"
    except RuntimeError as ex:
        out = str(ex)
    buf.destroy()
    return out


@pytest.mark.parametrize("flags", [[(True, False, False), (False, False, False)], [(True, False, False), (True, True, True)]],
                         ids=["fp8-vs-bf16", "scale-flags"])
def test_low_latency_format_flags_differing_across_ranks_raise(rank_pool, flags):
    out = rank_pool(2).run(_ll_format_worker, flags)
    for r, msg in enumerate(out):
        assert "every rank must pass the same use_fp8, round_scale, use_ue8m0 and use_nvfp4" in msg, (r, msg)


def test_low_latency_combine_with_another_topk_idx_raises(ops):
    cpu = torch.device("cpu")
    t, h, e = 4, 256, 4
    hb = int(ops.create_buffer(ops.get_unique_id("cpu", cpu), 0, 1, cpu, 0, ops.low_latency_rdma_size_hint(t, h, 1, e), True, "cpu"))
    try:
        x = torch.ones((3, h), dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [2, -1], [3, 0]])
        w = torch.ones((3, 2))
        recv, _, _, src_info, layout_range = ops.low_latency_dispatch(hb, x, idx, None, None, None, t, e, False, False, False)
        out = torch.empty((3, h), dtype=torch.bfloat16)
        other = torch.tensor([[1, 0], [2, -1], [3, 0]])
        with pytest.raises(RuntimeError, match="deep_ep::low_latency_combine: topk_idx differs from the one the dispatch of this handle routed with"):
            ops.low_latency_combine(hb, recv, other, w, src_info, layout_range, out, None, t, e, False, False)
        recv, _, _, src_info, layout_range = ops.low_latency_dispatch(hb, x, idx, None, None, None, t, e, False, False, False)
        ops.low_latency_combine(hb, recv, idx, w, src_info, layout_range, out, None, t, e, False, False)  # the same one works
        assert torch.equal(out[1], x[1]) and torch.equal(out[0], (2 * x[0].float()).to(torch.bfloat16))
    finally:
        ops.destroy_buffer(hb)


# ---- ranks killed during creation ---------------------------------------------------------------
CREATE_RANK = textwrap.dedent(UID_EXCHANGE + """
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    try:
        ops.create_buffer(uid, rank, world, torch.device("cpu"), 1 << 20, 0, False, "cpu")
        print("CREATED")
    except RuntimeError as e:
        print("ERR", e)
""")


def _start_rank(tmp_path, rank, anon=False, world=2, **env):
    """A rank process creating a 2-rank buffer: named files in tmp_path/shm, or (anon) the default
    anonymous memory."""
    import time

    script = tmp_path / "create_rank.py"
    script.write_text(CREATE_RANK)
    env = _no_shm_dir_env(**env) if anon else dict(os.environ, DEEP_EP_SHM_DIR=str(tmp_path / "shm"), **env)
    return subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "uid"), str(world)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env), time.monotonic()


def _wait_for(path, seconds=60):
    import time

    t0 = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t0 < seconds, f"{path} never appeared"
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0 is now waiting in the rendezvous


@pytest.mark.parametrize("anon", [False, True], ids=["named-file", "anonymous"])
def test_creating_rank_killed_during_creation_fails_the_peer_and_leaves_no_file(tmp_path, anon):
    import signal

    (tmp_path / "shm").mkdir()
    shm_before = sorted(f for f in os.listdir("/dev/shm") if f.startswith("deep_ep_")) if os.path.isdir("/dev/shm") else []
    r0, _ = _start_rank(tmp_path, 0, anon, DEEP_EP_TIMEOUT_MS="60000")
    _wait_for(tmp_path / "uid")
    r0.send_signal(signal.SIGKILL)
    r0.wait(30)
    r1, _ = _start_rank(tmp_path, 1, anon, DEEP_EP_TIMEOUT_MS="3000")
    out, err = r1.communicate(timeout=120)
    assert "ERR deep_ep::create_buffer: timed out after 3000 ms on rank 1 waiting for rank(s) [0]" in out, out + err
    if anon:  # rank 0 died before handing out the memory: its socket died with it
        assert "receiving the buffer memory from rank 0" in out, out
        assert _rendezvous_socket(tmp_path / "uid") not in _deep_ep_sockets()
    else:
        # Killed while waiting in the rendezvous (the usual case: 1 s after it wrote the id) it
        # never confirms; killed before it arrived, the rendezvous itself names it.
        assert "confirmed the new buffer" in out or "rendezvous of all ranks" in out, out
    assert os.listdir(tmp_path / "shm") == []
    if os.path.isdir("/dev/shm"):
        assert sorted(f for f in os.listdir("/dev/shm") if f.startswith("deep_ep_")) == shm_before


def test_rank_killed_after_getting_anonymous_memory_is_named_and_nothing_is_left(tmp_path):
    """Anonymous memory, 3 ranks: rank 1 gets the memory and waits for rank 2; it is killed
    (SIGKILL) there. When rank 2 comes, ranks 0 and 2 fail the creation naming rank 1 (it arrived,
    then never confirmed), and the memory and the rendezvous socket are gone."""
    import signal
    import time

    r0, _ = _start_rank(tmp_path, 0, True, 3, DEEP_EP_TIMEOUT_MS="30000")
    _wait_for(tmp_path / "uid")
    r1, _ = _start_rank(tmp_path, 1, True, 3, DEEP_EP_TIMEOUT_MS="60000")
    t0 = time.monotonic()
    while not _maps_anonymous_buffer(r1.pid):  # rank 1 has the memory (then waits for rank 2)
        assert r1.poll() is None and time.monotonic() - t0 < 60, "rank 1 never mapped the buffer"
        time.sleep(0.02)
    time.sleep(0.5)
    r1.send_signal(signal.SIGKILL)
    r1.wait(30)
    r2, _ = _start_rank(tmp_path, 2, True, 3, DEEP_EP_TIMEOUT_MS="3000")
    out0, err0 = r0.communicate(timeout=120)
    out2, err2 = r2.communicate(timeout=120)
    import re

    # Rank 0's deadline runs from its own start: on a loaded machine rank 2 may come after it,
    # and rank 0 then names both; rank 1 must be named either way.
    for out, err, named in ((out0, err0, r"\[1(, 2)?\]"), (out2, err2, r"\[1\]")):
        assert "ERR deep_ep::create_buffer: timed out" in out and re.search(r"waiting for rank\(s\) " + named, out), out + err
    assert _rendezvous_socket(tmp_path / "uid") not in _deep_ep_sockets()


def test_file_of_a_rank_killed_in_the_rendezvous_is_removed_by_a_later_creation(tmp_path):
    import signal

    (tmp_path / "shm").mkdir()
    r0, _ = _start_rank(tmp_path, 0, DEEP_EP_TIMEOUT_MS="60000")
    _wait_for(tmp_path / "uid")
    import time

    t0 = time.monotonic()
    while not os.listdir(tmp_path / "shm"):  # rank 0 made its file (a loaded machine may take > 1 s)
        assert r0.poll() is None and time.monotonic() - t0 < 60, "rank 0 never made its file"
        time.sleep(0.02)
    r0.send_signal(signal.SIGTERM)  # Python's default: the process ends at once, no cleanup
    r0.wait(30)
    left = os.listdir(tmp_path / "shm")
    assert len(left) == 1 and left[0].startswith("deep_ep_"), left
    old = os.path.getmtime(tmp_path / "shm" / left[0]) - 3600  # as if abandoned an hour ago
    os.utime(tmp_path / "shm" / left[0], (old, old))
    p = subprocess.run([sys.executable, "-c", "import torch, deep_ep_rs; ops = torch.ops.deep_ep; c = torch.device('cpu'); "
                        "ops.destroy_buffer(ops.create_buffer(ops.get_unique_id('cpu', c), 0, 1, c, 1 << 20, 0, False, 'cpu'))"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, DEEP_EP_SHM_DIR=str(tmp_path / "shm")))
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmp_path / "shm") == []


def _ll_geometry_worker(rank, world):
    import torch.distributed as dist

    import deep_ep_rs

    h, e = 512, 2 * world
    t = 8 if rank == 0 else 16  # num_max_dispatch_tokens_per_rank differs
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(16, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    x = torch.ones((4, h), dtype=torch.bfloat16)
    idx = torch.tensor([[0, e - 1]] * 4)
    try:
        buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        out = "no error"
    except RuntimeError as ex:
        out = str(ex)
    buf.destroy()
    return out


def test_low_latency_geometry_differing_across_ranks_names_the_peer(rank_pool):
    out = rank_pool(2).run(_ll_geometry_worker)
    for r, msg in enumerate(out):
        assert "every rank must pass the same values" in msg and f"rank {1 - r}" in msg and "[0, 0, 0]" not in msg, (r, msg)
