"""deep_ep_rs: DeepEP-compatible expert-parallel dispatch/combine on torch.ops.deep_ep.

Importing loads libdeep_ep.so (which registers the ops) and the fake kernels. `Buffer`,
`Config`, `EventOverlap` and `topk_idx_t` mirror DeepEP V1; `install_as_deep_ep()` makes
`import deep_ep` resolve to this package, for frameworks written against DeepEP.
"""
import sys

import torch

from . import _lib

_lib.load()

from . import _fake  # noqa: E402,F401
from . import _autograd  # noqa: E402,F401  (dispatch <-> combine backward)
from .buffer import Buffer  # noqa: E402
from .utils import Config, EventHandle, EventOverlap  # noqa: E402

__version__ = "0.1.0"

#: dtype of topk_idx that DeepEP uses by default; int32 is accepted too.
topk_idx_t = torch.int64


def install_as_deep_ep() -> None:
    """Makes `import deep_ep` (and `deep_ep.Buffer`, ...) resolve to this package."""
    sys.modules["deep_ep"] = sys.modules[__name__]


def library_path() -> str:
    """Path of the loaded libdeep_ep.so."""
    return _lib.load()


__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "install_as_deep_ep", "library_path"]
