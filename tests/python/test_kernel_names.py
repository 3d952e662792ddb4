"""The CUDA kernels of the built library carry the names docs/OPS.md ("Kernel names") lists: read
from the fatbinary with `cuobjdump -symbols` (entry functions, `STO_ENTRY`), demangled with
c++filt, no GPU needed. Every kernel is in the table, its name starts with `deep_ep::` and
contains the table's word for it, and none is a `__nv_static_` (internal-linkage) name; every
table entry is in the library. Skips when the library has no CUDA kernels (a build without the
`cuda` feature) or cuobjdump / c++filt are not found. The GPU twin (names as torch.profiler
reports them, at 1 and 4 ranks): tests/gpu/test_kernel_names_gpu.py."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _cuobjdump():
    """cuobjdump from PATH, $CUDA_HOME/bin, the CUDA wheels beside torch, or triton's copy."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = [os.path.join(os.environ["CUDA_HOME"], "bin")] if os.environ.get("CUDA_HOME") else []
    for site in {os.path.dirname(os.path.dirname(torch.__file__))} | set(sys.path):
        roots += glob.glob(os.path.join(site, "nvidia", "*", "bin")) + [os.path.join(site, "triton", "backends", "nvidia", "bin")]
    for r in roots:
        p = os.path.join(r, "cuobjdump")
        if os.access(p, os.X_OK):
            return p
    return None


def _table():
    """{kernel: word} from docs/OPS.md's "Kernel names" table."""
    text = (ROOT / "docs" / "OPS.md").read_text()
    section = text[text.index("## Kernel names"):]
    section = section[:section.index("\n## ", 3)]
    rows = re.findall(r"^\| `(deep_ep::[\w:]+)` \| `(\w+)` \|", section, re.M)
    assert rows, "no kernel rows in docs/OPS.md"
    return dict(rows)


def _qualified(demangled: str) -> str:
    """`void deep_ep::ll::dispatch<deep_ep::tp::LsaNet>(dek_ic_ctx_t, ...)` -> `deep_ep::ll::dispatch`."""
    name = demangled[len("void "):] if demangled.startswith("void ") else demangled
    return re.match(r"[^<(]*", name).group(0)


@pytest.fixture(scope="module")
def kernels(deep_ep):
    tool = _cuobjdump()
    if tool is None or shutil.which("c++filt") is None:
        pytest.skip("cuobjdump or c++filt not found (CUDA toolkit / binutils)")
    info = json.loads(torch.ops.deep_ep.build_info())
    if "cuda" not in info["features"]:
        pytest.skip("the library was built without the cuda feature: no kernels")
    out = subprocess.run([tool, "-symbols", deep_ep.library_path()], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    mangled = sorted({line.split()[-1] for line in out.stdout.splitlines() if "STO_ENTRY" in line})
    assert mangled, f"no kernels (STO_ENTRY symbols) in {deep_ep.library_path()}"
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True, check=True).stdout.split("\n")
    return {"mangled": mangled, "demangled": [d for d in demangled if d], "features": info["features"]}


def test_every_kernel_is_named_in_deep_ep_and_listed(kernels):
    table = _table()
    assert not [m for m in kernels["mangled"] if "__nv_static" in m], "kernels of internal linkage (profilers show __nv_static_ names)"
    bad = []
    for mangled, d in zip(kernels["mangled"], kernels["demangled"]):
        name = _qualified(d)
        if not name.startswith("deep_ep::"):
            bad.append(f"{d}: not in a deep_ep:: namespace ({mangled})")
        elif name not in table:
            bad.append(f"{d}: {name} is not in docs/OPS.md's kernel table")
        elif table[name] not in name:
            bad.append(f"{d}: {name} does not contain its word {table[name]!r}")
    assert not bad, "\n".join(bad)


def test_every_listed_kernel_is_in_the_library(kernels):
    present = {_qualified(d) for d in kernels["demangled"]}
    optional = {"deep_ep::tp::ping_nvshmem"} if "nvshmem" not in kernels["features"] else set()
    missing = set(_table()) - present - optional
    assert not missing, f"listed in docs/OPS.md but not in the library: {sorted(missing)}"


def test_low_latency_ops_have_one_kernel_each(kernels):
    """As DeepEP: one kernel per LL op (both halves), per seam and variant instantiation (dispatch:
    NVFP4 or not, the one-rank form, and the split peer send of a cast payload; combine: single-batch-overlap waits or not, and the one-launch forms, NVLink
    only: the rows send spread over every warp or not, the rows-only form that reads its own rows in place, rows and
    partial sums each without the other's code, and the one-rank combine, BF16 and LogFMT), all under the op's one name. The one-launch and one-rank forms are NVLink
    only (`NvlNet`: no seam code in them); the two-launch forms serve every seam, and without one are `NvlNet` too (the dispatch's
    are the one-launch form's own kernels; the combine has eight more: with and without overlap waits, the receive of a
    LogFMT send, which the host hints, in its wide and its narrow form, that LogFMT send without a seam or overlap
    waits, in its per-item and its spread form, and the one-launch LogFMT combine, in its per-item and its spread form)."""
    names = [d for d in kernels["demangled"] if _qualified(d).startswith("deep_ep::ll::")]
    want = {
        "dispatch": ["deep_ep::tp::GinNet, false, false, false", "deep_ep::tp::GinNet, true, false, false",
                     "deep_ep::tp::LsaNet, false, false, false", "deep_ep::tp::LsaNet, true, false, false",
                     "deep_ep::tp::NvlNet, false, false, false", "deep_ep::tp::NvlNet, false, false, true",
                     "deep_ep::tp::NvlNet, false, true, false", "deep_ep::tp::NvlNet, true, false, false",
                     "deep_ep::tp::NvlNet, true, false, true", "deep_ep::tp::NvlNet, true, true, false"],
        "combine": ["deep_ep::tp::GinNet, false, false, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::GinNet, true, false, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::LsaNet, false, false, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::LsaNet, false, false, false, false, false, false, false, true, false, false",
                    "deep_ep::tp::LsaNet, false, false, true, false, false, false, false, true, false, false",
                    "deep_ep::tp::LsaNet, false, true, false, false, false, false, false, false, true, false",
                    "deep_ep::tp::LsaNet, false, true, true, false, false, false, false, false, true, false",
                    "deep_ep::tp::LsaNet, true, false, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, false, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, false, false, false, false, false, false, false, true, false",
                    "deep_ep::tp::NvlNet, false, false, false, false, false, false, true, false, false, false",
                    "deep_ep::tp::NvlNet, false, true, false, false, false, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, true, false, false, false, true, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, true, false, false, true, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, true, false, true, false, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, false, true, false, true, false, false, false, false, false, true",
                    "deep_ep::tp::NvlNet, false, true, true, false, false, false, false, false, false, false",
                    "deep_ep::tp::NvlNet, true, false, false, false, false, false, false, false, false, false"],
    }
    for op in ("dispatch", "combine"):
        hits = sorted(d for d in names if _qualified(d) == f"deep_ep::ll::{op}")
        assert [re.search(r"<([^>]*)>", h).group(1) for h in hits] == want[op], hits
        assert all("dispatch" not in h for h in hits) if op == "combine" else all("combine" not in h for h in hits), hits
