"""The host-path benchmark tools run on the CPU backend (their self-check mode), so they do not rot
between device runs: bench/host_overhead.py, bench/host_profile.py, bench/deepep_v1.py's loader,
bench/nvlink_probe.py's kernel and bench/ll_overlap.py's GEMM stand-in (Triton's CPU interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _env(port):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("DEEP_EP_TEST_INSTALLED") != "1":  # the installed wheel's run keeps its own deep_ep_rs
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH", "")) if p)
    return env


def test_host_overhead_writes_a_row_per_op(tmp_path):
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--samples", "3", "--ops", "low_latency_combine",
                        "cached_dispatch_bf16", "combine", "--out", str(out)], env=_env(29741), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(row["op"], row["impl"]) for row in rows}
    assert got == {("low_latency_combine", "deep_ep"), ("low_latency_combine", "deep_ep_raw"), ("cached_dispatch_bf16", "deep_ep"),
                   ("cached_dispatch_bf16", "deep_ep_raw"), ("combine", "deep_ep"), ("combine", "deep_ep_raw")}
    assert all(row["us_median"] > 0 and row["us_p10"] <= row["us_median"] <= row["us_p90"] for row in rows)
    # The record names the measured library's build (its wheel's BUILD_COMMIT) and the scripts' checkout.
    rec = json.loads(out.read_text())
    if os.environ.get("DEEP_EP_TEST_INSTALLED") == "1":
        import deep_ep_rs
        assert rec["git_commit"] == (Path(deep_ep_rs.__file__).parent / "BUILD_COMMIT").read_text().strip()
    assert rec["git_commit"] and rec["bench_commit"]


def test_record_names_the_build_of_the_library_in_use(tmp_path, monkeypatch):
    """A device run points DEEP_EP_LIBRARY into an unpacked wheel while the Python package comes
    from the checkout: the record's commit is the BUILD_COMMIT beside that library."""
    monkeypatch.syspath_prepend(str(BENCH))
    import intranode

    (tmp_path / "BUILD_COMMIT").write_text("abc1234\n")
    monkeypatch.setenv("DEEP_EP_LIBRARY", str(tmp_path / "libdeep_ep.so"))
    assert intranode.library_commit() == "abc1234"
    monkeypatch.setenv("DEEP_EP_LIBRARY", str(tmp_path / "cargo" / "libdeep_ep.so"))
    assert intranode.library_commit() is None


def test_host_phases_reads_what_the_library_writes(tmp_path):
    """DEEP_EP_HOST_PHASES makes the library write its phase table at exit (torch_ops/phases.h);
    bench/host_phases.py turns it into µs per call and the part outside the body."""
    prefix = tmp_path / "ph"
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--samples", "3", "--ops", "low_latency_combine", "--phases",
                        str(prefix), "--out", str(out)], env=_env(29742), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    tables = [json.loads(p.read_text()) for p in tmp_path.glob("ph.*.json")]
    assert len(tables) == 1, list(tmp_path.iterdir())
    names = [name for name, ns, n in tables[0]["low_latency_combine"]]
    assert names == ["num_tokens", "combine", "return"], names
    assert all(n > 0 for _, _, n in tables[0]["low_latency_combine"])
    r = subprocess.run([sys.executable, str(BENCH / "host_phases.py"), str(prefix), "--host", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "== low_latency_combine" in r.stdout and "outside the body" in r.stdout, r.stdout


def test_host_profile_folds_only_the_timed_call(tmp_path):
    raw = tmp_path / "prof.txt"
    inside = "main (host_overhead.py:1);main.<locals>.add (host_overhead.py:92);<lambda> (host_overhead.py:155)"
    raw.write_text(
        f"{inside};Buffer.dispatch (deep_ep_rs/buffer.py:277);owned_entry (buffer.rs:118) 3\n"
        f"{inside};Buffer.dispatch (deep_ep_rs/buffer.py:277);cudaLaunchKernel (libcudart.so.13) 1\n"
        "main (host_overhead.py:1);main.<locals>.add (host_overhead.py:92);synchronize (torch/cuda/__init__.py:1) 50\n"
        "main (host_overhead.py:1);import_module (importlib.py:1) 9\n")
    r = subprocess.run([sys.executable, str(BENCH / "host_profile.py"), str(raw), "--us", "8"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "samples inside the call: 4" in r.stdout
    assert "6.00  library (Rust + launchers)" in r.stdout
    assert "2.00  CUDA runtime/driver" in r.stdout


def test_deepep_v1_baseline_says_how_to_get_deepep():
    sys.path.insert(0, str(BENCH))
    try:
        import deepep_v1
    finally:
        sys.path.remove(str(BENCH))
    try:
        import deep_ep_cpp  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="deepep_v1_build.sh"):
            deepep_v1.load()
    else:
        pytest.skip("the real DeepEP is importable here")


@pytest.mark.parametrize("script", ["nvlink_probe.py", "ll_overlap.py"])
def test_triton_kernels_on_the_cpu_interpreter(script):
    """Under TRITON_INTERPRET=1: bench/nvlink_probe.py's kernel puts every chunk at its peer's place
    (store-rr, store-one, back to back and spread) and its loads read the right ones;
    bench/ll_overlap.py's GEMM stand-in doubles every row of every tile and raises each tile's
    signal once."""
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6"):  # the interpreter's limits differ between releases
        pytest.skip(f"checked with the toolchain's Triton 3.6 (docs/TOOLCHAIN.md), found {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(BENCH / script), "--self-check"], capture_output=True, text=True, env=env,
                       cwd=BENCH, timeout=300)
    assert r.returncode == 0 and "self-check: ok" in r.stdout, r.stdout + r.stderr


def test_ll_stamps_summarises_the_instrument_lines():
    """bench/ll_stamps.py reads the lines of the ll-stamps instrument build (one GPU timer per rank)."""
    sys.path.insert(0, str(BENCH))
    import ll_stamps

    text = "\n".join([
        "noise",
        "llst rank 0 block 0 seq 16 t0 1000000 d1 1000 d2 2000 d3 -1 d4 -1 d5 2500 d6 6000 d7 7000",
        "llst rank 0 block 5 seq 16 t0 1000500 d1 900 d2 1000 d3 2500 d4 3000 d5 3100 d6 5000 d7 5500",
        "llst rank 1 block 0 seq 16 t0 9000000 d1 1000 d2 2000 d3 3000 d4 3500 d5 3600 d6 5000 d7 6000",
    ])
    res = ll_stamps.summary(ll_stamps.parse(text))
    assert res[0]["block0_d6"] == 6.0 and res[0]["sig_d4"] == 3.0
    assert res[0]["sig_start_after_block0"] == 0.5 and res[0]["signals_out_after_block0_start"] == 3.5
    assert res[0]["counts_seen_after_own_signals"] == 2.5
    assert res[1]["counts_seen_after_own_signals"] == 1.5  # block 0 signalled itself
    # The one-rank form: no block signals, block 0 prints its payload stamps.
    one = "llst rank 0 block 0 seq 32 t0 5 d1 300 d2 -1 d3 -1 d4 -1 d5 -1 d6 -1 d7 6000 d8 900 d9 2100 d10 2700 d11 3600 d12 4000 d13 4100 d14 5900"
    res = ll_stamps.summary(ll_stamps.parse(one))
    assert res[0]["calls"] == 1 and res[0]["block0_d13"] == 4.1 and res[0]["block0_d14"] == 5.9 and "sig_d4" not in res[0]
    # With the count block (block 0 holds no token), block 1 prints the first token's stamps.
    two = "\n".join([
        "llst rank 0 block 0 seq 32 t0 1000 d1 300 d2 -1 d3 -1 d4 -1 d5 -1 d6 -1 d7 3000 d8 900 d9 2100 d10 2700 d11 -1 d12 -1 d13 -1 d14 -1",
        "llst rank 0 block 1 seq 32 t0 1200 d1 300 d2 -1 d3 -1 d4 -1 d5 -1 d6 -1 d7 4000 d8 800 d9 900 d10 -1 d11 1500 d12 1900 d13 2500 d14 3500",
    ])
    res = ll_stamps.summary(ll_stamps.parse(two))
    assert res[0]["tok_start_after_block0"] == 0.2 and res[0]["tok_d14"] == 3.5 and res[0]["tok_d7"] == 4.0
    assert "block0_d11" not in res[0] and res[0]["block0_d10"] == 2.7
    last = two + "\nllst rank 0 block 9 seq 32 t0 1300 d1 300 d2 -1 d3 -1 d4 -1 d5 -1 d6 -1 d7 6000 d8 800 d9 3900 d10 -1 d11 4500 d12 4700 d13 5000 d14 5800"
    res = ll_stamps.summary(ll_stamps.parse(last))
    assert res[0]["last_block"] == 9 and res[0]["last_start_after_block0"] == 0.3 and res[0]["last_d9"] == 3.9


def test_ll_step_trace_summarises_replays():
    """bench/ll_step_trace.py: per replay of a graph of two kernels, durations, the gap between them
    and the boundary to the next replay (medians, µs)."""
    sys.path.insert(0, str(BENCH))
    import ll_step_trace

    name = "void deep_ep::ll::dispatch<deep_ep::ll::LsaNet, false, false, false>(Ctx, Args, int)"
    ks = []
    for r in range(3):  # replays 30 µs apart: kernel A 10 µs, 1 µs gap, kernel B 12 µs
        t = r * 30_000
        ks += [(t, t + 10_000, name), (t + 11_000, t + 23_000, "void deep_ep::ll::combine<x>(y)")]
    s = ll_step_trace.summarise(ks, 2)
    assert s["kernels"] == ["ll::dispatch", "ll::combine"] and s["replays"] == 3
    assert s["period_us"] == 30.0 and s["dur_us"] == [10.0, 12.0] and s["gap_us"] == [1.0] and s["boundary_us"] == 7.0
