"""Cases of an adversarial run of the CPU backend (session 10) that found silent wrong results and
unclear errors: meta tensors mixed into a real call, a normal-mode op paired with
clean_low_latency_buffer, an LL combine before its dispatch received, limits of buffer-less ops,
environment values. Each must end in a clear error naming the op (and the argument or variable)."""
import pytest
import torch

CFG = [4, 6, 256, 6, 128]


# ---- a meta tensor sends a call to the shape-only kernel: refused when others are real ----------
def test_meta_tensor_in_an_optional_argument_is_refused(deep_ep, ops, buffer1):
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[0], [1], [2], [3]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 1)
    d = ops.dispatch(buffer1, x, None, idx, torch.ones(4, 1), ntpr, in_rank, ntpe, 1, 0, CFG)
    handle = [d[5], d[6], d[7], d[8], in_rank, d[9]]
    meta_bias = torch.zeros(4, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match=r"^deep_ep::combine: bias_0 is on the meta device but x is on cpu"):
        ops.combine(buffer1, d[0], None, meta_bias, None, *handle, CFG)
    with pytest.raises(RuntimeError, match=r"^deep_ep::cached_dispatch: rank_prefix_matrix is on the meta device but x is on cpu"):
        ops.cached_dispatch(buffer1, x, None, handle[0].to("meta"), *handle[1:], CFG)


def test_only_meta_tensors_is_shape_inference(deep_ep, ops, buffer1):
    idx = torch.zeros(5, 2, dtype=torch.int64, device="meta")
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 1)
    assert ntpr.device.type == "meta" and tuple(in_rank.shape) == (5, 1) and tuple(ntpe.shape) == (4,)


def test_meta_stats_tensor_in_low_latency_dispatch_is_refused(deep_ep, ops):
    from conftest import make_buffer1

    h = make_buffer1(ops, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(4, 128, 1, 4), True)
    try:
        x, idx = torch.randn(4, 128).bfloat16(), torch.tensor([[0], [1], [2], [3]])
        stats = torch.zeros(4, dtype=torch.int32, device="meta")
        with pytest.raises(RuntimeError, match=r"^deep_ep::low_latency_dispatch: cumulative_local_expert_recv_stats is on the meta device"):
            ops.low_latency_dispatch(h, x, idx, None, stats, None, 4, 4, False, False, False, None)
        out = ops.low_latency_dispatch(h, x, idx, None, None, None, 4, 4, False, False, False, None)
        assert out[2].tolist() == [1, 1, 1, 1]  # the buffer still works
    finally:
        ops.destroy_buffer(h)


# ---- a normal-mode op on one rank, clean_low_latency_buffer on the other, in the same slot -------
def _dispatch_vs_clean_worker(rank, world, op):
    import deep_ep_rs
    import torch.distributed as dist

    from test_bad_input import good_inputs, layout, timeout_ms

    t, h, e = 8, 128, 2 * world
    with timeout_ms(5000):
        buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 22, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                                low_latency_mode=True, device="cpu", explicitly_destroy=True)
    ops = torch.ops.deep_ep
    x, idx, w = good_inputs(7 + rank, h=h, e=e, num_ranks=world)
    ntpr, in_rank, ntpe = layout(idx, e, world)
    d = ops.dispatch(buf.handle, x, None, idx, w, ntpr, in_rank, ntpe, 1, 0, CFG)
    handle = [d[5], d[6], d[7], d[8], in_rank, d[9]]
    try:
        if rank == 1:
            ops.clean_low_latency_buffer(buf.handle, t, h, e)
        elif op == "dispatch":
            ops.dispatch(buf.handle, x, None, idx, w, ntpr, in_rank, ntpe, 1, 0, CFG)
        else:
            ops.combine(buf.handle, d[0], None, None, None, *handle, CFG)
        out = "no error"
    except RuntimeError as ex:
        out = str(ex)
    buf.destroy()
    return out


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_normal_op_paired_with_clean_raises_on_both_ranks(rank_pool, op):
    out = rank_pool(2).run(_dispatch_vs_clean_worker, op)
    assert f"rank 1 is in deep_ep::clean_low_latency_buffer while this rank is in deep_ep::{op}" in out[0], out
    assert f"rank 0 is in deep_ep::{op} while this rank is in deep_ep::clean_low_latency_buffer" in out[1], out


# ---- an LL combine whose dispatch never received (its hook was not called) ----------------------
def _no_hook_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    t, h, e, k = 8, 128, 4, 2
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    recv, _, handle, _, hook = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, return_recv_hook=True)
    try:
        buf.low_latency_combine(torch.zeros_like(recv), idx, w, handle)  # hook() never called
        out = "no error"
    except RuntimeError as ex:
        out = str(ex)
    hook()  # late, but the buffer keeps working
    y, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    buf.destroy()
    return out, bool(torch.isfinite(y.float()).all())


def test_low_latency_combine_before_its_dispatch_received_raises(rank_pool):
    for out, finite in rank_pool(2).run(_no_hook_worker):
        assert out.startswith("deep_ep::low_latency_combine: the low-latency dispatch of this handle has not received yet"), out
        assert finite


# ---- limits of buffer-less ops, before anything is allocated -------------------------------------
@pytest.mark.parametrize("num_experts, num_ranks, msg", [
    (2 ** 41, 2 ** 40, r"num_ranks must be at most 256 \(the most ranks of a buffer\), got 1099511627776"),
    (2 ** 62, 1, r"num_experts \(4611686018427387904\) must be at most 1024 \(1024 experts per rank of 1\)"),
])
def test_layout_limits_name_the_op(ops, num_experts, num_ranks, msg):
    with pytest.raises(RuntimeError, match=r"^deep_ep::get_dispatch_layout: " + msg):
        ops.get_dispatch_layout(torch.zeros(3, 1, dtype=torch.int64), num_experts, num_ranks)


def test_config_num_sms_limit(ops, buffer1):
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[0], [1], [2], [3]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 1)
    with pytest.raises(RuntimeError, match=r"^deep_ep::dispatch: config.num_sms must be at most 1024 \(2 per channel\), got 2199023255552"):
        ops.dispatch(buffer1, x, None, idx, torch.ones(4, 1), ntpr, in_rank, ntpe, 1, 0, [2 ** 41, 6, 256, 6, 128])


# ---- environment values name the variable ------------------------------------------------------
def test_unknown_backend_from_the_environment_names_the_variable(ops, monkeypatch):
    monkeypatch.setenv("DEEP_EP_BACKEND", "CPU")
    with pytest.raises(RuntimeError, match=r"unknown backend 'CPU' \(from DEEP_EP_BACKEND\)"):
        ops.get_unique_id("", torch.device("cuda", 0))


@pytest.mark.parametrize("where", ["file", "missing"])
def test_shm_dir_that_is_not_a_folder_names_the_variable(ops, monkeypatch, tmp_path, where):
    path = tmp_path / "f"
    if where == "file":
        path.write_text("x")
    monkeypatch.setenv("DEEP_EP_SHM_DIR", str(path))
    cpu = torch.device("cpu")
    uid = ops.get_unique_id("cpu", cpu)
    with pytest.raises(RuntimeError, match=r"^deep_ep::create_buffer: DEEP_EP_SHM_DIR=.* is not a folder"):
        ops.create_buffer(uid, 0, 1, cpu, 1 << 20, 0, False, "cpu")


# ---- Ctrl-C during a wait for a peer ---------------------------------------------------------------
SIGINT_RANK = """
import os, signal, sys, time, torch, deep_ep_rs
# Python's own handler, whatever this process inherited: a test run started with SIGINT ignored
# (under nohup, or as a background job of a shell without job control) passes the ignore on.
signal.signal(signal.SIGINT, signal.default_int_handler)
ops, cpu = torch.ops.deep_ep, torch.device("cpu")
rank, uid_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 0:
    uid = ops.get_unique_id("cpu", cpu)
    torch.save(uid, uid_file + ".tmp")
    os.rename(uid_file + ".tmp", uid_file)
else:
    while not os.path.exists(uid_file):
        time.sleep(0.02)
    uid = torch.load(uid_file)
ll = mode == "ll"
hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 4)
h = int(ops.create_buffer(uid, rank, 2, cpu, 0 if ll else 1 << 22, hint if ll else 0, ll, "cpu"))
print("created", flush=True)
if rank == 1:
    time.sleep(60)  # never joins the op: rank 0 waits for it
    sys.exit(0)
idx = torch.tensor([[0], [1], [2], [3]] * 2)
t0 = time.monotonic()
try:
    try:
        if ll:
            ops.low_latency_dispatch(h, torch.ones(8, 128).bfloat16(), idx, None, None, None, 8, 4, False, False, False, None)
        else:
            ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 2)
            ops.dispatch(h, torch.ones(8, 64).bfloat16(), None, idx, torch.ones(8, 1), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])
    except RuntimeError as e:
        print("RuntimeError", e, flush=True)
    time.sleep(5)  # the KeyboardInterrupt comes before this ends
    print("no KeyboardInterrupt", flush=True)
except KeyboardInterrupt:
    print(f"KeyboardInterrupt after {time.monotonic() - t0:.1f} s", flush=True)
"""


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_ctrl_c_during_a_wait_for_a_peer_interrupts_at_once(tmp_path, mode):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "rank.py"
    script.write_text(SIGINT_RANK)
    env = dict(os.environ, DEEP_EP_TIMEOUT_MS="60000")
    ps = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "uid"), mode], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        assert ps[0].stdout.readline().strip() == "created"
        time.sleep(1.0)  # rank 0 is in the op's wait now
        ps[0].send_signal(signal.SIGINT)
        out, err = ps[0].communicate(timeout=30)
    finally:
        for p in ps:
            p.kill()
            p.wait()
    op = "low_latency_dispatch" if mode == "ll" else "dispatch"
    # The op's error (logged as the buffer is given up), then Python's KeyboardInterrupt at once.
    assert f"deep_ep::{op}: interrupted (SIGINT) on rank 0 while waiting for rank(s) [1]" in out + err, out + err
    got = [line for line in out.splitlines() if line.startswith("KeyboardInterrupt after")]
    assert got and float(got[0].split()[2]) < 10, out + err


# ---- an LL combine answering a dispatch that carried top-k weights, given other weights ----------
def _other_weights_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    import _reference as ref

    t, h, e, k = 8, 2048, 32, 2  # the partial-sum format fits: the experts' ranks sum with the dispatch's weights
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 0, deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(t, h, world, e),
                            low_latency_mode=True, explicitly_destroy=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w, w2 = torch.rand(t, k, generator=g), torch.rand(t, k, generator=g)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, topk_weights=w)
    try:
        buf.low_latency_combine(recv, idx, w2, handle)
        out = "no error"
    except RuntimeError as ex:
        out = str(ex)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, topk_weights=w)
    y, _, _ = buf.low_latency_combine(recv, idx, w, handle)  # the same weights: partial sums, as the reference
    diff = ref.calc_diff(y, ref.ll_combine(x, idx, w, lambda g, rows: rows))
    buf.destroy()
    return out, diff


def test_low_latency_combine_with_other_weights_than_its_partial_sums_raises(rank_pool):
    for out, diff in rank_pool(2).run(_other_weights_worker):
        assert out.startswith("deep_ep::low_latency_combine: topk_weights differ from the ones the dispatch of this handle carried"), out
        assert diff < 1e-5, diff


# ---- low-latency ops have no backward: their outputs do not pretend to carry gradients -----------
def test_low_latency_outputs_do_not_require_grad(deep_ep, ops):
    from conftest import make_buffer1

    h = make_buffer1(ops, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 128, 1, 4), True)
    try:
        x = torch.randn(8, 128).bfloat16().requires_grad_()
        recv = ops.low_latency_dispatch(h, x, torch.randint(0, 4, (8, 1)), None, None, None, 8, 4, False, False, False, None)[0]
        assert not recv.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            recv.float().sum().backward()
    finally:
        ops.destroy_buffer(h)
