"""Reliability faults of the host side, round 2: the user's files, interpreter exit with a thread
inside an op, Ctrl-C during creation, the Python wrapper's ownership of its buffer, the FP8 tuple
given to an LL combine, a rank out of file descriptors, and diagnose reporting the environment."""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

CPU = torch.device("cpu")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "DEEP_EP_SHM_DIR"}
    env.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    return env


def _two_thread_buffer(ops, **kw):
    """Handles of both ranks of a 2-rank CPU buffer created by two threads of this process."""
    uid = ops.get_unique_id("cpu", CPU)
    hs = [None, None]
    args = kw.get("args", (1 << 22, 0, False))
    ts = [threading.Thread(target=lambda r=r: hs.__setitem__(r, int(ops.create_buffer(uid, r, 2, CPU, *args, "cpu")))) for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return hs


def _destroy_both(ops, hs):
    ts = [threading.Thread(target=ops.destroy_buffer, args=(h,)) for h in hs]
    [t.start() for t in ts]
    [t.join() for t in ts]


# ---- 4: DEEP_EP_SHM_DIR: only the library's own stale files are removed -------------------------
def test_creating_a_buffer_keeps_the_users_files_in_the_shm_dir(ops, tmp_path, monkeypatch):
    """Files named like the library's but not made by it (another name, or the exact name pattern
    with other content), however old, survive a creation in DEEP_EP_SHM_DIR."""
    user = {
        "deep_ep_notes.txt": b"my notes",
        "deep_ep_results.csv": b"a,b\n1,2\n",
        "deep_ep_cpu_" + "0123456789abcdef" * 2: b"not a buffer: the user's data under the library's name pattern",
        "deep_ep_ipc_" + "f" * 32: b"",
    }
    old = time.time() - 7200  # far past 2 x the deadline
    for name, data in user.items():
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (old, old))
    monkeypatch.setenv("DEEP_EP_SHM_DIR", str(tmp_path))
    ops.destroy_buffer(ops.create_buffer(ops.get_unique_id("cpu", CPU), 0, 1, CPU, 1 << 20, 0, False, "cpu"))
    assert sorted(os.listdir(tmp_path)) == sorted(user)
    for name, data in user.items():
        assert (tmp_path / name).read_bytes() == data


# ---- 5: interpreter exit while a daemon thread waits inside an op --------------------------------
DAEMON_AT_EXIT = textwrap.dedent("""
    import sys, threading, time, torch, deep_ep_rs
    ops, cpu = torch.ops.deep_ep, torch.device("cpu")
    mode = sys.argv[1]
    uid = ops.get_unique_id("cpu", cpu)
    ll = mode == "ll"
    size = (0, ops.low_latency_rdma_size_hint(8, 128, 2, 4), True) if ll else (1 << 22, 0, False)
    hs = [None, None]
    ts = [threading.Thread(target=lambda r=r: hs.__setitem__(r, int(ops.create_buffer(uid, r, 2, cpu, *size, "cpu"))))
          for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    idx = torch.tensor([[0], [1], [2], [3]] * 2)

    def waits_for_rank_1():  # rank 1 never joins: this thread stays inside the op
        if ll:
            ops.low_latency_dispatch(hs[0], torch.ones(8, 128).bfloat16(), idx, None, None, None, 8, 4, False, False, False, None)
        else:
            ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 2)
            ops.dispatch(hs[0], torch.ones(8, 64).bfloat16(), None, idx, torch.ones(8, 1), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])

    threading.Thread(target=waits_for_rank_1, daemon=True).start()
    time.sleep(0.5)
    print("EXITING", flush=True)
""")


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_interpreter_exit_with_a_daemon_thread_inside_an_op_does_not_abort(tmp_path, mode):
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON_AT_EXIT)
    for _ in range(3):  # the abort depended on where the thread was when the interpreter ended
        p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120,
                           env=_env(DEEP_EP_TIMEOUT_MS="60000"))
        assert "EXITING" in p.stdout, p.stdout + p.stderr
        assert p.returncode == 0 and "FATAL" not in p.stderr, f"exit {p.returncode} (SIGABRT is -6)\n{p.stderr}"


# ---- 6: Ctrl-C during create_buffer's rendezvous ------------------------------------------------
CREATE_ALONE = textwrap.dedent("""
    import signal, sys, time, torch, deep_ep_rs
    # Python's own handler, whatever this process inherited: a test run started with SIGINT ignored
    # (under nohup, or as a background job of a shell without job control) passes the ignore on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ops, cpu = torch.ops.deep_ep, torch.device("cpu")
    rank, uid_file = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        uid = ops.get_unique_id("cpu", cpu)
        open(uid_file, "wb").write(bytes(uid.tolist()))
    else:
        uid = torch.tensor(list(open(uid_file, "rb").read()), dtype=torch.uint8)
    print("CREATING", flush=True)
    t0 = time.monotonic()
    try:
        try:
            ops.create_buffer(uid, rank, 2, cpu, 1 << 20, 0, False, "cpu")  # the other rank never comes
            print("CREATED", flush=True)
        except RuntimeError as e:
            print("RuntimeError", e, flush=True)
        time.sleep(10)  # the KeyboardInterrupt comes before this ends
        print("no KeyboardInterrupt", flush=True)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - t0:.1f} s", flush=True)
""")


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0-serving", "rank1-receiving"])
def test_ctrl_c_during_the_creation_rendezvous_interrupts_at_once(ops, tmp_path, rank):
    uid_file = tmp_path / "uid"
    if rank == 1:  # an id whose rank 0 never comes
        uid_file.write_bytes(bytes(ops.get_unique_id("cpu", CPU).tolist()))
    script = tmp_path / "create.py"
    script.write_text(CREATE_ALONE)
    p = subprocess.Popen([sys.executable, str(script), str(rank), str(uid_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(DEEP_EP_TIMEOUT_MS="60000"))
    try:
        assert p.stdout.readline().strip() == "CREATING"
        time.sleep(1.5)  # in the rendezvous now
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=40)
    finally:
        p.kill()
        p.wait()
    # The op's error (raised, or logged as the creation is given up), then KeyboardInterrupt at once.
    assert f"deep_ep::create_buffer: interrupted (SIGINT) on rank {rank} while waiting for rank(s) [{1 - rank}]" in out + err, out + err
    got = [line for line in out.splitlines() if line.startswith("KeyboardInterrupt after")]
    assert got and float(got[0].split()[2]) < 10, out + err


# ---- 7, 8: the wrapper owns its handle ------------------------------------------------------------
def _wrapper_of(deep_ep, handle, explicitly_destroy=True):
    """A Buffer object around an existing handle (the constructor needs a process group)."""
    buf = deep_ep.Buffer.__new__(deep_ep.Buffer)
    buf._handle, buf.runtime, buf.explicitly_destroy = handle, handle, explicitly_destroy
    return buf


def test_destroy_refused_while_busy_keeps_the_handle(ops, deep_ep):
    hs = _two_thread_buffer(ops)
    buf = _wrapper_of(deep_ep, hs[0])
    idx = torch.tensor([[0], [1], [2], [3]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 2)
    args = (torch.ones((4, 128), dtype=torch.bfloat16), None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])
    t = threading.Thread(target=lambda: ops.dispatch(hs[0], *args))
    t.start()
    time.sleep(1.0)  # the thread waits inside rank 0's dispatch for rank 1
    try:
        with pytest.raises(RuntimeError, match="is in use by another thread"):
            buf.destroy()
        assert buf.is_available() and buf.handle == hs[0]
    finally:
        ops.dispatch(hs[1], *args)
        t.join()
    buf.explicitly_destroy = False  # the two ranks are destroyed together below
    buf._handle = None
    _destroy_both(ops, hs)


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copying_a_buffer_is_refused(ops, deep_ep, how):
    h = int(ops.create_buffer(ops.get_unique_id("cpu", CPU), 0, 1, CPU, 1 << 20, 0, False, "cpu"))
    buf = _wrapper_of(deep_ep, h)
    try:
        with pytest.raises(TypeError, match="deep_ep_rs.Buffer cannot be copied"):
            how(buf)
        assert ops.buffer_info(h)[1] == 1  # the original still works
    finally:
        buf.destroy()


# ---- 9: the FP8 tuple of an LL dispatch given to the LL combine ----------------------------------
def test_low_latency_combine_of_the_fp8_tuple_raises_the_dtype_error(ops, deep_ep):
    t, h, e = 4, 256, 2
    hb = int(ops.create_buffer(ops.get_unique_id("cpu", CPU), 0, 1, CPU, 0, ops.low_latency_rdma_size_hint(t, h, 1, e), True, "cpu"))
    buf = _wrapper_of(deep_ep, hb)
    try:
        x = torch.ones((3, h), dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1], [0, -1]])
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
        assert isinstance(recv, tuple)
        with pytest.raises(RuntimeError, match=r"deep_ep::low_latency_combine: x must be torch.bfloat16 on cpu, got torch.float8_e4m3fn"):
            buf.low_latency_combine(recv, idx, torch.ones((3, 2)), handle)
    finally:
        buf.destroy()


# ---- 10: a receiving rank out of file descriptors -----------------------------------------------
FD_RANK = textwrap.dedent("""
    import os, resource, sys, time, torch, deep_ep_rs
    ops, cpu = torch.ops.deep_ep, torch.device("cpu")
    rank, uid_file = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        uid = ops.get_unique_id("cpu", cpu)
        open(uid_file + ".tmp", "wb").write(bytes(uid.tolist()))
        os.rename(uid_file + ".tmp", uid_file)
    else:
        while not os.path.exists(uid_file):
            time.sleep(0.02)
        uid = torch.tensor(list(open(uid_file, "rb").read()), dtype=torch.uint8)
        # Room for exactly one more descriptor (the rendezvous socket), none for the memory's.
        free = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
        os.close(free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (free + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    t0 = time.monotonic()
    try:
        ops.create_buffer(uid, rank, 2, cpu, 1 << 20, 0, False, "cpu")
        print("CREATED", flush=True)
    except RuntimeError as e:
        print(f"ERR after {time.monotonic() - t0:.1f} s:", e, flush=True)
""")


def test_receiving_rank_out_of_file_descriptors_says_so(tmp_path):
    script = tmp_path / "fd_rank.py"
    script.write_text(FD_RANK)
    env = _env(DEEP_EP_TIMEOUT_MS="30000")
    ps = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "uid")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        out1, err1 = ps[1].communicate(timeout=120)
    finally:
        for p in ps:
            p.kill()
            p.wait()
    assert "ERR after" in out1 and "file descriptor" in out1 and "rank 1" in out1, out1 + err1
    assert float(out1.split("ERR after ")[1].split()[0]) < 15, out1  # at once, not at the deadline


# ---- 11: diagnose reports the environment the user's Buffer will see ------------------------------
@pytest.mark.parametrize("var,value", [("DEEP_EP_BACKEND", "foo"), ("DEEP_EP_TIMEOUT_MS", "3000ms"), ("DEEP_EP_NVL_DOMAIN_SIZE", "+1")])
def test_diagnose_fails_on_a_setting_every_buffer_would_refuse(var, value):
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--no-self-test"], capture_output=True, text=True, timeout=180,
                       env=_env(CUDA_VISIBLE_DEVICES="", **{var: value}))
    lines = p.stdout.splitlines()
    assert p.returncode != 0, p.stdout + p.stderr
    bad = [line for line in lines if line.startswith("settings") and "FAILED" in line]
    assert bad and var in bad[0], p.stdout + p.stderr
    assert lines[-1] == "result: FAILED", p.stdout


def test_diagnose_reports_valid_settings():
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--no-self-test"], capture_output=True, text=True, timeout=180,
                       env=_env(CUDA_VISIBLE_DEVICES="", DEEP_EP_BACKEND="cpu", DEEP_EP_NVL_DOMAIN_SIZE="2"))
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(line for line in p.stdout.splitlines() if line.startswith("settings (cpu buffers): "))
    assert "OK" in line and "backend cpu" in line and "NVLink domain 2" in line, line


# ---- 1: a call abandoned by a timed-out rank is never delivered to a late peer ------------------
def abandoned_call_worker(rank, world, shrink, device="cpu"):
    """Both ranks run LL step 0; rank 1 then sleeps past rank 0's deadline, so rank 0's step 1
    times out (raises, or masks rank 1 in shrink mode and completes). Rank 1's next call pairs
    with rank 0's given-up call; it must raise instead of taking rank 0's step-1 tokens.
    On a GPU (`device` cuda:N, tests/gpu/test_abandoned_ll_gpu.py) the kernels' errors surface at
    the buffer's next call, so each rank then synchronises and runs one more step."""
    import deep_ep_rs
    import torch.distributed as dist

    gpu = device != "cpu"
    t, h, e = 4, 128, 2 * world
    old = os.environ.get("DEEP_EP_TIMEOUT_MS")
    os.environ["DEEP_EP_TIMEOUT_MS"] = "1000"  # read at buffer creation
    try:
        size = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink,
                                **({} if gpu else {"device": "cpu"}))
    finally:
        if old is None:
            os.environ.pop("DEEP_EP_TIMEOUT_MS", None)
        else:
            os.environ["DEEP_EP_TIMEOUT_MS"] = old
    g = torch.Generator().manual_seed(rank)

    def step(s):
        x = torch.full((t, h), float(10 * s + rank + 1)).to(torch.bfloat16).to(device)
        idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)]).to(device)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, idx, torch.ones(t, 2, device=device), handle)
        return out

    step(0)
    if gpu:
        torch.cuda.synchronize()
        dist.barrier()
    outcome = "ok"
    try:
        if rank == 1:
            time.sleep(2.5)
            step(2)
        else:
            step(1)
        if gpu:
            torch.cuda.synchronize()
            time.sleep(1.5)  # a combine receive left waiting reaches its deadline too
            step(3)  # reports what the kernels of the steps before found
    except RuntimeError as err:
        outcome = str(err)
    if rank == 1 and not gpu and "gave up its low-latency call" in outcome:
        # The refusal poisons the late rank's buffer: its next call says so (and its destroy is local).
        with pytest.raises(RuntimeError, match="unusable"):
            step(4)
    dist.barrier()
    try:
        buf.destroy()
    except RuntimeError:
        pass
    return outcome


@pytest.mark.lowlatency
@pytest.mark.parametrize("shrink", [False, True], ids=["raise", "shrink"])
def test_a_late_rank_never_receives_a_call_its_peer_gave_up(rank_pool, shrink):
    res = rank_pool(2).run(abandoned_call_worker, shrink)
    # Rank 0 timed out in step 1: it raises, or (shrink) masks rank 1 and completes the step.
    if shrink:
        assert res[0] == "ok", res[0]
    else:
        assert "timed out" in res[0] and "rank 0" in res[0], res[0]
    # Rank 1's third call (step 0 was calls 1 and 2) pairs with rank 0's given-up call 3: refused, naming rank 0 and the call.
    assert "rank 0 gave up its low-latency call 3" in res[1], res[1]
    assert "this rank's call 3 (a dispatch)" in res[1], res[1]
