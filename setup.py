"""Builds the Rust library with cargo and ships libdeep_ep.so inside the deep_ep_rs package.

Install with `pip install --no-build-isolation .` into an environment that already has torch
(build.rs asks this interpreter where torch's headers and libraries are).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithCargo(build_py):
    def run(self):
        env = dict(os.environ, DEEP_EP_PYTHON=sys.executable)
        features = os.environ.get("DEEP_EP_CARGO_FEATURES")
        cmd = ["cargo", "build", "--release"]
        if features is not None:
            cmd += ["--no-default-features", "--features", features]
        subprocess.check_call(cmd, cwd=ROOT, env=env)
        super().run()
        dst = Path(self.build_lib) / "deep_ep_rs"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "target" / "release" / "libdeep_ep.so", dst / "libdeep_ep.so")


setup(
    name="deep_ep_rs",
    version="0.1.0",
    description="DeepEP-compatible expert-parallel dispatch/combine (torch.ops.deep_ep) with an NCCL backend, in Rust",
    package_dir={"": "python"},
    packages=["deep_ep_rs"],
    python_requires=">=3.10",
    cmdclass={"build_py": BuildWithCargo},
    zip_safe=False,
)
