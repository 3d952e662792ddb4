"""Builds the Rust library with cargo and ships libdeep_ep.so inside the deep_ep_rs package.

`make wheel` (= `pip wheel --no-build-isolation --no-deps -w dist .` in the project's venv) builds
against the torch, nvcc, NCCL and libclang already installed there. A plain `pip wheel .` /
`pip install .` also works: pyproject.toml names the same pinned packages as build requirements,
so pip fetches them into its isolated build environment (several GB, a few minutes).

The wheel is tagged `py3-none-linux_x86_64`: libdeep_ep.so uses no Python C API, only libtorch's
stable ABI, so one file serves every CPython >= 3.10 with torch >= 2.10 (README, "One binary").
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70 ships bdist_wheel; older ones use the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


class BuildWithCargo(build_py):
    def run(self):
        try:
            import torch  # noqa: F401  (build.rs asks this interpreter where torch is)
        except ImportError as e:
            raise SystemExit(
                f"deep_ep_rs: building needs torch importable by {sys.executable} ({e}). Use `make wheel`, "
                "or `pip wheel .` with build isolation (pyproject.toml lists what to fetch), or install "
                "torch, cuda-toolkit[nvcc,nvvm,crt,cccl,cudart], nvidia-nccl-cu13 and libclang first and "
                "pass --no-build-isolation."
            )
        env = dict(os.environ, DEEP_EP_PYTHON=sys.executable)
        features = os.environ.get("DEEP_EP_CARGO_FEATURES")
        cmd = ["cargo", "build", "--release"]
        if features is not None:
            cmd += ["--no-default-features", "--features", features]
        subprocess.check_call(cmd, cwd=ROOT, env=env)
        super().run()
        dst = Path(self.build_lib) / "deep_ep_rs"
        dst.mkdir(parents=True, exist_ok=True)
        # Where cargo put it: CARGO_TARGET_DIR (relative to the checkout) when set, else target/.
        target = ROOT / os.environ.get("CARGO_TARGET_DIR", "target")
        shutil.copy2(target / "release" / "libdeep_ep.so", dst / "libdeep_ep.so")
        (dst / "BUILD_COMMIT").write_text(build_commit() + "\n")


def build_commit():
    """The checkout's short commit the library is built from, "+dirty" when tracked files differ
    from it, "unknown" outside a git checkout: what bench records name as the measured build."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class NativeDistribution(Distribution):
    """Carries a native library: installed to platlib, as a platform wheel."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """A platform wheel that any CPython 3 can install (the library uses no Python C API)."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    name="deep_ep_rs",
    version="0.1.0",
    description="DeepEP-compatible expert-parallel dispatch/combine (torch.ops.deep_ep) with an NCCL backend, in Rust",
    package_dir={"": "python"},
    packages=["deep_ep_rs"],
    python_requires=">=3.10",
    install_requires=["torch>=2.10"],
    cmdclass={"build_py": BuildWithCargo, "bdist_wheel": PlatformWheel},
    distclass=NativeDistribution,
    zip_safe=False,
)
