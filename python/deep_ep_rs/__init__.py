"""deep_ep_rs: DeepEP-compatible expert-parallel dispatch/combine on torch.ops.deep_ep.

Importing loads libdeep_ep.so (which registers the ops) and the fake kernels. `Buffer`,
`Config`, `EventOverlap`, `EventHandle` and `topk_idx_t` mirror DeepEP V1; `ElasticBuffer`,
`EPHandle`, `get_physical_domain_size` and `get_logical_domain_size` mirror DeepEP V2's API on the
same machinery (elastic.py, docs/V2.md); `install_as_deep_ep()`
makes `import deep_ep` (and every `deep_ep.<submodule>`) resolve to this package, for frameworks
written against DeepEP. Users who want only the ops: `torch.ops.load_library(deep_ep_rs.library_path())`.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import types

import torch

from . import _lib

_lib.load()

from . import _fake  # noqa: E402,F401
from . import _autograd  # noqa: E402,F401  (dispatch <-> combine backward)
from . import utils  # noqa: E402
from .buffer import Buffer, slot_handle  # noqa: E402
from .elastic import ElasticBuffer, EPHandle, get_logical_domain_size, get_physical_domain_size  # noqa: E402
from .utils import Config, EventHandle, EventOverlap  # noqa: E402

__version__ = "0.1.0"

#: dtype of topk_idx that DeepEP uses by default; int32 is accepted too.
topk_idx_t = torch.int64

_ALIAS = "deep_ep"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `deep_ep.X` to the module object `deep_ep_rs.X` itself (never a second copy of
    its file), so class identity and isinstance hold across both names."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real = __name__ + fullname[len(_ALIAS):]
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(__name__ + spec.name[len(_ALIAS):])

    def exec_module(self, module):  # already executed under its own name
        pass


def _cpp_module() -> types.ModuleType:
    """`deep_ep_cpp`, the name of DeepEP's extension module, with the names code imports from it."""
    m = types.ModuleType("deep_ep_cpp", "deep_ep_rs stand-in for DeepEP's C++ extension module")
    m.Config, m.EventHandle, m.topk_idx_t = Config, EventHandle, topk_idx_t
    return m


def install_as_deep_ep() -> None:
    """Makes `import deep_ep`, `from deep_ep import Buffer, Config, EventOverlap`,
    `from deep_ep import ElasticBuffer, EPHandle` (DeepEP V2),
    `from deep_ep.utils import EventHandle, EventOverlap`, `import deep_ep.buffer` (any submodule)
    and `from deep_ep_cpp import Config` resolve to this package's own objects. Idempotent."""
    this = sys.modules[__name__]
    sys.modules[_ALIAS] = this
    for name, mod in list(sys.modules.items()):
        if name.startswith(__name__ + "."):
            sys.modules[_ALIAS + name[len(__name__):]] = mod
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
    sys.modules.setdefault("deep_ep_cpp", _cpp_module())


def library_path() -> str:
    """Path of the loaded libdeep_ep.so (inside this package when installed from a wheel);
    `torch.ops.load_library(deep_ep_rs.library_path())` registers the ops alone."""
    return _lib.load()


__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "install_as_deep_ep", "library_path", "slot_handle",
           "ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size"]
