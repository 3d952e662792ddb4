"""Diagnostics: `python -m deep_ep_rs.diagnose`, `deep_ep::build_info`, `Buffer.memory_report`
and the DEEP_EP_LOG logger (stderr lines of a subprocess whose two ranks are threads)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch



def _env(**extra):
    env = dict(os.environ)
    env.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    return env


def test_diagnose_runs_and_self_test_passes():
    # GPUs hidden: the CPU tier must not depend on the GPU backend (test_diagnose_gpu covers it)
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--timeout", "90"], capture_output=True, text=True,
                       timeout=180, env=_env(DEEP_EP_TEST_MARKER="seen", CUDA_VISIBLE_DEVICES=""))
    out = p.stdout
    assert p.returncode == 0, f"exit code {p.returncode}\nstdout:\n{out}\nstderr:\n{p.stderr}"
    lines = out.splitlines()
    lib = next(line for line in lines if line.startswith("library: "))
    assert os.path.samefile(lib.split(": ", 1)[1], os.environ["DEEP_EP_LIBRARY"])
    assert f"torch: {torch.__version__}" in out
    assert "CUDA available: False" in out
    assert any(line.startswith("backends compiled: cpu") for line in lines)
    assert any(line.startswith("NCCL: torch loaded ") for line in lines)
    assert any(line.startswith("driver: ") for line in lines) and any(line.startswith("NVLink topology: ") for line in lines)
    # environment variables that change behaviour are listed (DEEP_EP_* here), others are not
    assert "  DEEP_EP_TEST_MARKER=seen" in lines and "  DEEP_EP_LIBRARY=" + os.environ["DEEP_EP_LIBRARY"] in lines
    assert not any(line.startswith("  PATH=") for line in lines)
    st = next(line for line in lines if line.startswith("self-test cpu (2 ranks): "))
    assert st.startswith("self-test cpu (2 ranks): OK: normal ok (") and "low-latency ok (" in st, st
    assert "self-test gpu: skipped (no CUDA device)" in lines
    assert lines[-1] == "result: OK"


@pytest.mark.gpu
def test_diagnose_gpu():
    """With GPUs visible: peer access and the GPU self-test line (OK, or a mode the nccl backend
    does not implement yet); exit code 0."""
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--timeout", "180"], capture_output=True, text=True,
                       timeout=400, env=_env(DEEP_EP_BACKEND=None))
    lines = p.stdout.splitlines()
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert f"CUDA available: True, {torch.cuda.device_count()} visible GPU(s)" in p.stdout
    gpu = next(line for line in lines if line.startswith("self-test gpu ("))
    assert ": OK: " in gpu or "not implemented on this backend yet" in gpu, gpu


def test_diagnose_reports_a_missing_library():
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--no-self-test"], capture_output=True, text=True, timeout=120,
                       env=_env(DEEP_EP_LIBRARY="/nonexistent/libdeep_ep.so"))
    assert p.returncode != 0
    assert "Could not load this library: /nonexistent/libdeep_ep.so" in p.stderr, p.stderr


def test_build_info_is_json_describing_this_build(ops):
    info = json.loads(ops.build_info())
    assert info["crate_version"] == "0.1.0"
    assert info["backends"][0] == "cpu" and set(info["backends"]) <= {"cpu", "nccl", "nvshmem", "ipc"}
    assert ("nccl" in info["backends"]) == ("nccl" in info["features"])
    if "nccl" in info["features"]:
        code = info["nccl_header_version_code"]
        assert info["nccl_header_version"] == f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    if "cuda" in info["features"]:
        assert info["cuda_archs"] and all(a[:2].isdigit() for a in info["cuda_archs"])
    assert info["profile"] in ("release", "debug")
    # The NVSHMEM device transport exists only in builds with feature nvshmem (and its headers).
    assert isinstance(info["nvshmem_device_transport"], bool)
    assert not info["nvshmem_device_transport"] or "nvshmem" in info["features"]


# ---------------------------------------------------------------------------------------------
# memory_report


def memory_report_worker(rank, world):
    import deep_ep_rs
    import torch.distributed as dist

    hint = deep_ep_rs.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(4096 * 2, world)
    buf = deep_ep_rs.Buffer(dist.group.WORLD, 1 << 24, 1 << 20, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    try:
        plain = buf.memory_report()
        full = buf.memory_report(hidden=4096, num_max_dispatch_tokens_per_rank=8, num_experts=4 * world)
        small = buf.memory_report(hidden=128)
    finally:
        buf.destroy()
    # An LL-only buffer sized by the LL hint (DeepEP's decode buffers): the normal-mode hints do
    # not apply to it.
    ll_hint = deep_ep_rs.Buffer.get_low_latency_rdma_size_hint(8, 4096, world, 4 * world)
    ll_only = deep_ep_rs.Buffer(dist.group.WORLD, 0, ll_hint, low_latency_mode=True, device="cpu", explicitly_destroy=True)
    try:
        assert ll_only.memory_report(hidden=4096, num_max_dispatch_tokens_per_rank=8, num_experts=4 * world)["meets_size_hints"] is True
    finally:
        ll_only.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.memory_report()
    return plain, full, small, hint


def test_memory_report(rank_pool):
    import deep_ep_rs  # noqa: F401  (registers torch.ops.deep_ep in this process too)

    results = rank_pool(2).run(memory_report_worker)
    for rank, (plain, full, small, hint) in enumerate(results):
        assert plain == {"rank": rank, "num_ranks": 2, "device": "cpu", "backend": "cpu", "num_nvl_bytes": 1 << 24,
                         "num_rdma_bytes": 1 << 20, "low_latency_mode": True}
        assert "size_hints" not in plain
        hints = full["size_hints"]
        assert hints["dispatch_nvl_bytes"] == hint > 1 << 24 and full["meets_size_hints"] is False
        assert hints["combine_nvl_bytes"] > 0 and hints["dispatch_rdma_bytes"] == 0 == hints["combine_rdma_bytes"]
        assert hints["low_latency_rdma_bytes"] == torch.ops.deep_ep.low_latency_rdma_size_hint(8, 4096, 2, 8)
        assert full["hidden"] == 4096 and {k: full[k] for k in plain} == plain
        assert small["meets_size_hints"] is True and "low_latency_rdma_bytes" not in small["size_hints"]


# ---------------------------------------------------------------------------------------------
# DEEP_EP_LOG

LOG_SCRIPT = textwrap.dedent("""
    import threading, torch, deep_ep_rs
    ops, cpu = torch.ops.deep_ep, torch.device("cpu")
    uid = ops.get_unique_id("cpu", cpu)
    hs = {}
    def make(r):
        hs[r] = ops.create_buffer(uid, r, 2, cpu, 1 << 20, 0, False, "cpu")
    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    x = torch.zeros((4, 64), dtype=torch.bfloat16)
    idx = torch.tensor([[0], [1], [2], [3]])
    ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(idx, 4, 2)
    args = (x, None, idx, torch.ones((4, 1)), ntpr, in_rank, ntpe, 1, 0, [4, 6, 256, 6, 128])
    for _ in range(2):  # rank 1 never joins: a timeout, then a refusal of the poisoned buffer
        try:
            ops.dispatch(hs[0], *args)
        except RuntimeError as e:
            print("raised:", str(e).split(": ", 1)[1])
    ops.destroy_buffer(hs[0])
    ops.destroy_buffer(hs[1])
    print("handles", hs[0], hs[1])
""")


def _log_run(level):
    p = subprocess.run([sys.executable, "-c", LOG_SCRIPT], capture_output=True, text=True, timeout=120,
                       env=_env(DEEP_EP_LOG=level, DEEP_EP_TIMEOUT_MS="300"))
    assert p.returncode == 0, p.stderr
    h0, h1 = (int(v) for v in p.stdout.split("handles")[1].split())
    assert "raised: timed out after 300 ms on rank 0 waiting for rank(s) [1] (barrier" in p.stdout
    assert "raised: buffer" in p.stdout and "unusable" in p.stdout
    return [line for line in p.stderr.splitlines() if line.startswith("[deep_ep")], h0, h1


@pytest.mark.parametrize("level", ["debug", "info", "warn", None, "off", "bogus"])
def test_deep_ep_log_levels(level):
    lines, h0, h1 = _log_run(level)
    text = "\n".join(lines)
    warn = [f"[deep_ep rank 0] warn: deep_ep::dispatch: timed out after 300 ms on rank 0 waiting for rank(s) [1] (barrier: "
            f"all ranks published their inputs); buffer {h0} is now unusable (destroy it and create a new one)",
            f"[deep_ep rank 0] warn: deep_ep::dispatch: buffer {h0} is unusable after an earlier failure"]
    info = [f"[deep_ep rank 0] info: created buffer {h0}: backend cpu, device cpu, 2 ranks, num_nvl_bytes 1048576, "
            "num_rdma_bytes 0, low_latency_mode false",
            f"[deep_ep rank 1] info: created buffer {h1}: backend cpu",
            f"[deep_ep rank 0] info: destroyed buffer {h0} (poisoned: released locally)",
            f"[deep_ep rank 1] info: destroyed buffer {h1}"]
    debug = [f"[deep_ep rank 0] debug: deep_ep::dispatch on buffer {h0}"]
    want = {"debug": warn + info + debug, "info": warn + info, "warn": warn, None: warn, "bogus": warn, "off": []}[level]
    for w in want:
        assert any(line.startswith(w) for line in lines), f"missing {w!r} in:\n{text}"
    if level in ("warn", None, "bogus", "off"):
        assert " info: " not in text and " debug: " not in text, text
    if level != "debug":
        assert " debug: " not in text, text
    if level == "off":
        assert lines == []
    if level == "bogus":
        assert '[deep_ep] warn: DEEP_EP_LOG="bogus" is not one of off, warn, info, debug; using warn' in lines
    # one line per event: exactly one timeout line and one refusal line
    if level != "off":
        assert sum("is now unusable" in line for line in lines) == 1 and sum("unusable after" in line for line in lines) == 1


def test_diagnose_version_verdicts():
    """The torch and CUDA lines say whether the running versions match the build."""
    from deep_ep_rs import diagnose

    assert diagnose._torch_verdict(f"torch {torch.__version__} of `python`", torch.__version__).endswith("(match)")
    assert "compatible" in diagnose._torch_verdict("torch 2.9.0+cu128 of `python`", "2.11.0+cu130")
    assert "MISMATCH" in diagnose._torch_verdict("torch 2.11.0+cu130 of `python`", "2.10.0+cu128")
    assert "without a torch shim" in diagnose._torch_verdict("", torch.__version__)
    assert diagnose._cuda_verdict("13.0", "13.0", "13.0") == " (match)"
    assert "MISMATCH" in diagnose._cuda_verdict("13.0", "12.8", "13.0")
    assert "DRIVER TOO OLD" in diagnose._cuda_verdict("13.0", "13.0", "12.4")
    assert diagnose._cuda_verdict(None, None, None) == ""
    build = json.loads(torch.ops.deep_ep.build_info())
    assert "cuda_runtime" in build and "cuda_driver" in build
    if "cuda" in build["features"]:
        assert diagnose._major_minor(build["cuda_runtime"]) is not None, build
    p = subprocess.run([sys.executable, "-m", "deep_ep_rs.diagnose", "--no-self-test"], capture_output=True, text=True, timeout=120,
                       env=_env(CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    torch_line = next(line for line in lines if line.startswith("torch: "))
    assert torch_line.endswith("(match)") or "(compatible: stable ABI" in torch_line, torch_line
    assert any(line.startswith("CUDA: library runtime ") for line in lines), p.stdout
