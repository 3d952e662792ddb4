"""Config and EventOverlap, with DeepEP V1's names, arguments and defaults."""
from typing import Any, Callable, Optional, Tuple

import torch

from . import _lib

_lib.load()


class Config:
    """Normal-mode kernel configuration (DeepEP V1 `Config`).

    Arguments: num_sms (blocks; even; channels = num_sms / 2), num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens.
    Invalid combinations raise RuntimeError from the library (the same checks as DeepEP).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        rdma_recv = int(num_max_rdma_chunked_recv_tokens)
        send = max(self.num_max_rdma_chunked_send_tokens, 1)
        self.num_max_rdma_chunked_recv_tokens = (rdma_recv + send - 1) // send * send  # DeepEP rounds up
        torch.ops.deep_ep.nvl_buffer_size_hint(self.to_list(), 16, 1)  # validates

    def to_list(self) -> list:
        """The `int[5]` config argument of the ops."""
        return [self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens]

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer this config needs for `hidden_bytes` per token: room for the peers
        of one NVLink domain (DEEP_EP_NVL_DOMAIN_SIZE ranks, default 8; read by the library)."""
        return int(torch.ops.deep_ep.nvl_buffer_size_hint(self.to_list(), hidden_bytes, num_ranks))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer this config needs: 0 when `num_ranks` fit in one NVLink domain
        (DEEP_EP_NVL_DOMAIN_SIZE ranks, default 8), else sized for the domains they span."""
        return int(torch.ops.deep_ep.rdma_buffer_size_hint(self.to_list(), hidden_bytes, num_ranks))

    def __repr__(self) -> str:
        return f"Config({', '.join(map(str, self.to_list()))})"


class EventHandle:
    """A CUDA event recorded on the current stream at construction (DeepEP's `EventHandle`).

    Without CUDA (CPU buffers complete every op before returning) it holds no event (`event` is
    None) and waiting is a no-op, so DeepEP code such as `EventOverlap(EventHandle())` runs
    unchanged on the CPU backend (DeepEP itself needs a GPU)."""

    def __init__(self, stream: Optional[torch.cuda.Stream] = None):
        self.event = None
        if stream is not None or torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An optional event plus tensors kept alive until it is waited on (DeepEP V1), with DeepEP
    V2's additions: `current_stream_wait(release_handle=...)`, a hook run after the wait
    (`register_hook_after_wait`) and `with event(release_handle=True):`.

    CPU buffers finish every op before returning, so their events are None.
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Optional[Callable] = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Makes the current stream wait for the event. CPU buffers finish before returning,
        so their event is None and there is nothing to wait for (DeepEP asserts instead;
        accepting it lets DeepEP code run unchanged on the CPU backend). Then runs the hook
        registered with `register_hook_after_wait`, if any; `release_handle` drops the event."""
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        """A callable run once by the next `current_stream_wait` (DeepEP V2)."""
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """`with event(release_handle=True):` (DeepEP V2): the exit waits, then drops the event."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None or self.hook_after_wait is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def check_nvlink_connections(group) -> None:
    """DeepEP V1's check that PCIe GPUs are used in pairs at most (its other GPUs are NVLink
    machines and pass). The NVLink topology itself is reported by `python -m deep_ep_rs.diagnose`."""
    if not torch.cuda.is_available() or "PCIE" not in torch.cuda.get_device_name():
        return
    assert group.size() <= 2, "PCIe GPUs only have pairwise NVLink connections"
