"""The reliability classes of tests/python/test_reliability.py on one GPU (nccl backend, one rank):
a forked child using its parent's buffer, an output too large to allocate, GPU memory exhausted at
buffer creation (the process keeps working), an invalid DEEP_EP_TIMEOUT_MS; and at two ranks (two
GPUs, or one with ipc) the interpreter ending while a daemon thread waits inside `dispatch`
(test_reliability2.py's item 5). Each case must end in a clear error or a clean exit, never a
crash."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import _spawn

ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
PRELUDE = textwrap.dedent("""
    import os, torch, torch.distributed as dist, deep_ep_rs
    from _harness import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ops = torch.ops.deep_ep
    def roundtrip(buf):
        x = torch.ones((8, 256), dtype=torch.bfloat16, device="cuda")
        idx = torch.tensor([[0, 1]] * 8, device="cuda")
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 2)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                topk_idx=idx, topk_weights=torch.ones((8, 2), device="cuda"))
        out, _, _ = buf.combine(recv, handle)
        torch.cuda.synchronize()
        assert torch.equal(out, x), "round trip"
""")


def _run(body, timeout=240, **env):
    tests_python = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True, timeout=timeout,
                       env=dict(ENV, PYTHONPATH=os.pathsep.join(filter(None, [tests_python, os.environ.get("PYTHONPATH")])), **env))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p.stdout


def test_forked_child_using_a_gpu_buffer_raises():
    out = _run("""
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, explicitly_destroy=True)
        roundtrip(buf)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                ops.clean_low_latency_buffer(buf.handle, 8, 256, 2)
                msg = "NO ERROR"
            except RuntimeError as e:
                msg = str(e)
            os.write(w, msg.encode()); os._exit(0)
        os.waitpid(pid, 0)
        print("CHILD:", os.read(r, 4096).decode())
        roundtrip(buf)
        buf.destroy()
        print("PARENT OK")
    """)
    assert "forked child" in out and "PARENT OK" in out, out


def test_output_too_large_names_op_and_shape_on_gpu():
    out = _run("""
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, explicitly_destroy=True)
        x = torch.ones((8, 256), dtype=torch.bfloat16, device="cuda")
        idx = torch.tensor([[0, 1]] * 8, device="cuda")
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 2, 1)
        try:
            ops.dispatch(buf.handle, x, None, idx, torch.ones((8, 2), device="cuda"), ntpr, in_rank, ntpe, 1, (1 << 31) - 1, [20, 6, 256, 6, 128])  # 1 TiB of rows, within int32 (larger is refused before allocating)
        except RuntimeError as e:
            print("ERR", str(e).splitlines()[0][:300])
        roundtrip(buf)
        buf.destroy()
        print("AFTER OK")
    """)
    assert "ERR deep_ep::dispatch: cannot allocate an output of shape [2147483647, 256]" in out and "AFTER OK" in out, out


def test_gpu_memory_exhausted_at_creation_is_an_error_and_the_process_goes_on():
    out = _run("""
        try:
            deep_ep_rs.Buffer(dist.group.WORLD, 1 << 40, explicitly_destroy=True)   # 1 TiB
            print("CREATED?")
        except RuntimeError as e:
            print("ERR", str(e).splitlines()[0][:400])
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, explicitly_destroy=True)
        roundtrip(buf)
        buf.destroy()
        print("AFTER OK")
    """)
    assert "ERR deep_ep::create_buffer: cannot allocate 1099" in out and "GiB) of GPU memory" in out and "AFTER OK" in out, out
    print(out)


@pytest.mark.parametrize("value", ["3000ms", "-1"])
def test_invalid_timeout_env_on_gpu(value):
    out = _run("""
        try:
            deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, explicitly_destroy=True)
            print("CREATED?")
        except RuntimeError as e:
            print("ERR", str(e)[:300])
    """, DEEP_EP_TIMEOUT_MS=value)
    assert "DEEP_EP_TIMEOUT_MS" in out and "not a whole number" in out, out


# Issue 34 item 5 on a GPU buffer: the interpreter of rank 0 ends while a daemon thread of it waits
# inside `dispatch` (on the host, for the receive count its peer never lets the GPU compute). The
# process must exit cleanly (no "FATAL: exception not rethrown", no SIGABRT). Two processes: on two
# GPUs with nccl, or on one GPU with ipc.
EXIT_RANK = textwrap.dedent("""
    import os, sys, threading, time, torch, torch.distributed as dist, deep_ep_rs
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24)
    dist.barrier()
    if rank == 1:  # never dispatches: rank 0's dispatch waits for it
        print("READY", flush=True)
        time.sleep(30)
        sys.exit(0)
    x = torch.ones((8, 256), dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([[0, 1]] * 8, device="cuda")

    def waits_for_rank_1():
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, 2)
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                     topk_idx=idx, topk_weights=torch.ones((8, 2), device="cuda"))

    t = threading.Thread(target=waits_for_rank_1, daemon=True)
    t.start()
    time.sleep(1.0)
    print("EXITING with the thread inside dispatch:", t.is_alive(), flush=True)
""")


def test_interpreter_exit_with_a_daemon_thread_inside_a_gpu_op_does_not_abort(tmp_path):
    script = tmp_path / "exit_rank.py"
    script.write_text(EXIT_RANK)
    _spawn.need_gpus(2)  # records the rank count: gpu_backend() is ipc when both ranks share a GPU
    tests_python = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    env = dict(ENV, DEEP_EP_TIMEOUT_MS="60000", DEEP_EP_BACKEND=_spawn.gpu_backend(),
               PYTHONPATH=os.pathsep.join(filter(None, [tests_python, os.environ.get("PYTHONPATH")])))
    port = _spawn._free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    try:
        out0, err0 = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "EXITING with the thread inside dispatch: True" in out0, out0 + err0[-4000:]
    assert procs[0].returncode == 0 and "FATAL" not in err0, f"rank 0 exit {procs[0].returncode} (SIGABRT is -6)\n{err0[-4000:]}"
