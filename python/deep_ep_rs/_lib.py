"""Locates and loads libdeep_ep.so, which registers torch.ops.deep_ep.* when loaded."""
import os
from pathlib import Path

import torch

_LOADED = None


def library_path() -> str:
    """Path of the library: $DEEP_EP_LIBRARY, the copy shipped in this package, or a cargo build
    of the source tree this package lives in (development checkouts)."""
    env = os.environ.get("DEEP_EP_LIBRARY")
    if env:
        return env
    here = Path(__file__).resolve().parent
    candidates = [here / "libdeep_ep.so"]
    root = here.parent.parent
    candidates += [root / "target" / "release" / "libdeep_ep.so", root / "target" / "debug" / "libdeep_ep.so"]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise ImportError(
        "deep_ep_rs: libdeep_ep.so not found (looked at $DEEP_EP_LIBRARY and "
        + ", ".join(str(c) for c in candidates)
        + "); build it with `cargo build --release` or install the package with `pip install .`"
    )


def load() -> str:
    """Loads the library once per process and returns its path."""
    global _LOADED
    if _LOADED is None:
        path = library_path()
        torch.ops.load_library(path)
        _LOADED = path
    return _LOADED
