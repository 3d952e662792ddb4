"""Models scripted (TorchScript), exported (torch.export) and AOT-compiled (AOTInductor, CPU) in one
process run in another against
that process's own buffer, bound to the slot the model was made with (tests/python/_serialized_model.py)."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(cmd, d):
    p = subprocess.run([sys.executable, str(HERE / "_serialized_model.py"), cmd, str(d)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ))
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    return p.stdout


def test_scripted_and_exported_models_run_in_another_process(tmp_path):
    assert "MADE" in _run("make", tmp_path)
    out = _run("load", tmp_path)
    assert "UNBOUND: deep_ep::get_dispatch_layout" not in out  # layout takes no buffer
    assert "names slot 0, and no buffer of this process is bound to it" in out, out
    assert "OK torchscript" in out and "OK export" in out and "OK aoti" in out, out
    assert all(f"OK {a} LL hooks" in out for a in ("torchscript", "export", "aoti")), out


def test_slot_binding_rules(ops):
    import pytest
    import torch

    cpu = torch.device("cpu")
    h = int(ops.create_buffer(ops.get_unique_id("cpu", cpu), 0, 1, cpu, 1 << 20, 0, False, "cpu"))
    ops.bind_buffer_slot(h, 5)
    assert list(ops.buffer_info(-6)) == list(ops.buffer_info(h))
    with pytest.raises(RuntimeError, match=r"slot must be in 0..=1048575, got -1"):
        ops.bind_buffer_slot(h, -1)
    ops.destroy_buffer(-6)  # through the slot
    with pytest.raises(RuntimeError, match="names slot 5, and no buffer of this process is bound to it"):
        ops.buffer_info(-6)
