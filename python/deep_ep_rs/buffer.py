"""`Buffer`: DeepEP V1's Python API over torch.ops.deep_ep.

Constructor, method names, argument names, defaults and return tuples follow DeepEP V1
(`deep_ep/buffer.py`). Routing state (handles) are tuples of tensors and ints. On CUDA buffers
normal-mode ops run on the buffer's communication stream with DeepEP's event semantics; CPU
buffers complete every op before returning (events are None).
"""
import contextlib
import os
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _fake  # noqa: F401  (registers fake kernels)
from . import _lib
from .utils import Config, EventHandle, EventOverlap

_lib.load()
ops = torch.ops.deep_ep

_DISPATCH_TABLE = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                   24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                   96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_TABLE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                  24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                  96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _table_entry(table: dict, num_ranks: int) -> tuple:
    """DeepEP's entry for `num_ranks`; other counts (DeepEP asserts) get the entry of the next
    count it lists (4 below 4, 8 up to 8, the largest above 160), so every rank count answers."""
    assert isinstance(num_ranks, int) and num_ranks >= 1, f"Unsupported number of EP ranks: {num_ranks}"
    if num_ranks in table:
        return table[num_ranks]
    if num_ranks <= 8:
        return table[4 if num_ranks < 4 else 8]
    return table[min((k for k in table if k >= num_ranks), default=max(table))]


def _default_device() -> torch.device:
    if os.environ.get("DEEP_EP_BACKEND", "") != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nvl_domain_size() -> int:
    """Ranks per NVLink domain: DEEP_EP_NVL_DOMAIN_SIZE (default 8), parsed by the library (its one
    parser; a malformed value raises, naming the variable)."""
    return int(ops.nvl_domain_size())


class _Inline:
    """The body runs on the current stream; on exit the op's (absent) event goes to `result`."""

    __slots__ = ("result",)

    def __init__(self, result: list):
        self.result = result

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        self.result.append(EventOverlap(None))
        return False


_NULL = contextlib.nullcontext()
_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _direct(name: str):
    """The C++ callable behind op `name`'s default overload: `OpOverload.__call__` only forwards
    to it, so an eager call skips that Python frame (~0.3 µs per call). Under torch.compile the
    methods call the `torch.ops` op itself, which dynamo traces."""
    overload = getattr(ops, name).default
    return getattr(overload, "_op", overload)


_LL_DISPATCH = _direct("low_latency_dispatch")
_LL_COMBINE = _direct("low_latency_combine")
_LL_COMBINE_ALLOC = _direct("low_latency_combine_alloc")
_LAYOUT = _direct("get_dispatch_layout")
_DISPATCH = _direct("dispatch")
_CACHED_DISPATCH = _direct("cached_dispatch")
_COMBINE = _direct("combine")


def _received() -> None:
    """The receive hook of a one-rank low-latency call whose send ran the whole op: nothing to wait for."""


def _no_autograd(*tensors):
    """Skips the op's (Python) autograd kernel when no input needs a gradient, as in inference
    and under no_grad: the op then costs no Python round trip in torch's dispatcher. Under
    torch.compile, or when a gradient is needed, the op goes through autograd as registered.
    (Every call of a normal-mode op pays this check: bound names and a plain loop.)"""
    if _is_compiling():
        return _NULL
    if _grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return _NULL
    return _below_autograd()


def slot_handle(slot: int) -> int:
    """The handle that names slot `slot` in whichever process runs it: `-(slot + 1)`."""
    assert isinstance(slot, int) and 0 <= slot < (1 << 20), f"slot must be in [0, 2^20), got {slot}"
    return -(slot + 1)


def _opt(t: torch.Tensor) -> Optional[torch.Tensor]:
    """Ops return empty tensors for absent optional outputs."""
    return None if t.dim() == 1 and t.numel() == 0 else t


def _overlap_args(device: torch.device, num_ranks: int, handle: Tuple, packed_recv_count: Optional[torch.Tensor],
                  comp_signal: Optional[torch.Tensor], block_m: int, threshold: int, num_sms: int, src_signals: Optional[torch.Tensor],
                  expect: int) -> Tuple[Optional[torch.Tensor], int, int, int]:
    """`low_latency_combine(overlap=True)`: the producer of the combine's input (SGLang's down
    GEMM) raises signals as it finishes parts of it, on another stream. Hopper (`comp_signal`):
    int32 `[E_l * ceil(R*T / block_m)]`, entry `l * ceil(R*T / block_m) + b` reaches `threshold` once
    rows `[b * block_m, (b + 1) * block_m)` of local expert `l` are written; the rows of `l` are
    `packed_recv_count[l]` (the dispatch's recv_count). Blackwell (`src_signals`): one word per
    local expert, reaching `src_signal_expect_value` once all of its rows are written (passed on as
    one block of R*T rows per expert). A threshold (expected value) <= 0 asks for no wait (DeepEP:
    always satisfied). Returns the op's (comp_signal, block_m, threshold, num_sms).

    GPU buffers: the combine's send waits on the device, each warp for the block of rows it sends
    next, so rows go out as the GEMM finishes them (kernels/low_latency.cu). CPU buffers: ops on CPU
    tensors run in program order (the GEMM is done), so the op raises for a signal not raised (it
    can never come) instead of combining unwritten rows."""
    _, layout_range, t, _, e = handle
    el = e // num_ranks
    if src_signals is not None:
        assert src_signals.dim() == 1 and src_signals.numel() >= el, \
            f"src_signals must hold one word per local expert ({el}), got shape {tuple(src_signals.shape)}"
        assert src_signals.dtype in (torch.int32, torch.uint32), f"src_signals must be int32 or uint32, got {src_signals.dtype}"
        return src_signals.view(torch.int32), num_ranks * t, int(expect), int(num_sms)
    if comp_signal is None:
        raise ValueError("low_latency_combine(overlap=True) needs comp_signal (Hopper: with packed_recv_count, block_m, threshold) "
                         "or src_signals (Blackwell: with src_signal_expect_value)")
    assert packed_recv_count is not None and packed_recv_count.dtype == torch.int32 and packed_recv_count.shape == (el,), \
        f"overlap=True with comp_signal needs packed_recv_count, int32 [{el}] (the dispatch's recv_count)"
    if device.type == "cpu":  # GPU buffers: no host sync per call
        rows = [int(v) for v in (layout_range.to(torch.int64) & 0xFFFFFFFF).sum(dim=1).tolist()]
        assert packed_recv_count.tolist() == rows, \
            f"packed_recv_count {packed_recv_count.tolist()} is not the recv_count {rows} of the dispatch of this handle"
    assert int(block_m) > 0, f"block_m must be positive, got {block_m}"
    per_expert = -(-num_ranks * t // int(block_m))
    assert comp_signal.dtype == torch.int32 and comp_signal.numel() >= el * per_expert, \
        f"comp_signal must be int32 with num_local_experts * ceil(num_ranks * T / block_m) = {el * per_expert} entries, got " \
        f"{comp_signal.dtype} of shape {tuple(comp_signal.shape)}"
    return comp_signal.reshape(-1), min(int(block_m), num_ranks * t), int(threshold), int(num_sms)


class Buffer:
    """A communication buffer for expert-parallel dispatch and combine (DeepEP V1 API).

    Arguments as DeepEP's: `group` (a ProcessGroup; `comm` is not supported), `num_nvl_bytes`
    (normal-mode buffer), `num_rdma_bytes` (low-latency buffer), `low_latency_mode`,
    `explicitly_destroy`, `enable_shrink` (an LL wait that times out masks the missing rank
    instead of raising; the mask methods work with or without it). `num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`, `allow_mnnvl`,
    `use_fabric` are accepted for compatibility. Extension: `device` (default: the current CUDA
    device, or the CPU when CUDA is absent or DEEP_EP_BACKEND=cpu) and `backend` ("cpu", "nccl", "ipc" or
    "nvshmem"; "" = DEEP_EP_BACKEND, else the device's default).
    """

    num_sms: int = 20

    _ll_whole_hooks = False  # set per buffer in __init__ (a wrapper made without it keeps its hooks apart)

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, device: Optional[Union[str, torch.device]] = None,
                 backend: str = ""):
        if group is None:
            raise ValueError("deep_ep_rs.Buffer: a torch.distributed group is required (mpi4py comm is not supported)")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.num_qps_per_rank = num_qps_per_rank
        self.device = torch.device(device) if device is not None else _default_device()
        self._handle = None
        uid = ops.get_unique_id(backend, self.device).tolist() if self.rank == 0 else None
        ids = [None] * self.group_size
        dist.all_gather_object(ids, uid, group=group)
        self._handle = int(ops.create_buffer(torch.tensor(ids[0], dtype=torch.uint8, device="cpu"), self.rank, self.group_size, self.device,
                                             self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode, backend))
        self.runtime = self._handle
        d = _nvl_domain_size()
        self._num_rdma_ranks = max(1, self.group_size // d) if self.group_size > d else 1
        if self.enable_shrink:
            ops.low_latency_set_shrink(self._handle, True)
        # One rank on a GPU backend (the library's answer, buffer_info's last value): a low-latency
        # receive has nothing to wait for, so a call with return_recv_hook=True runs the whole op (the
        # one-rank form: one launch writing the outputs) and returns a hook with nothing left to do
        # (_received). DeepEP's contract holds: the outputs are valid once the hook has run (here:
        # already when the call returns).
        self._ll_whole_hooks = bool(ops.buffer_info(self._handle)[7])
        self._comm_stream = torch.cuda.Stream(device=self.device, priority=-1) if self.device.type == "cuda" else None

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The integer buffer handle the ops take."""
        if self._handle is None:
            raise RuntimeError("deep_ep_rs.Buffer: the buffer was destroyed")
        return self._handle

    def destroy(self) -> None:
        """Releases the buffer (requires explicitly_destroy=True, as DeepEP)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self._handle is not None:
            # Forgotten only once the library has released it: a refusal (another thread is
            # inside an op of this buffer) leaves the buffer usable and destroyable later.
            ops.destroy_buffer(self._handle)
            self._handle = None

    def __del__(self):
        h = getattr(self, "_handle", None)
        if h is not None:
            if self.explicitly_destroy:
                print("deep_ep_rs.Buffer: explicitly_destroy=True but destroy() was not called; releasing in the destructor")
            try:
                ops.destroy_buffer(h)
            except Exception:  # interpreter shutdown: nothing more to do
                pass

    def __copy__(self):
        raise TypeError("deep_ep_rs.Buffer cannot be copied: a copy would share the buffer's handle, and whichever object "
                        "went first would destroy the buffer under the other; pass the Buffer object itself around")

    def __deepcopy__(self, memo):
        self.__copy__()

    def is_available(self) -> bool:
        return self._handle is not None

    def bind_slot(self, slot: int = 0) -> int:
        """Binds this buffer to `slot` of this process (local) and returns the slot handle
        `-(slot + 1)`. Ops given the slot handle reach this buffer: build models that will be
        scripted, exported or AOT-compiled with `slot_handle(slot)` instead of `buf.handle`, and
        bind the loading process's own buffer to the same slot before running them."""
        ops.bind_buffer_slot(self.handle, int(slot))
        return slot_handle(slot)

    def memory_report(self, hidden: Optional[int] = None, num_max_dispatch_tokens_per_rank: Optional[int] = None,
                      num_experts: Optional[int] = None) -> dict:
        """What this buffer holds (from `buffer_info`): rank, num_ranks, device, backend,
        num_nvl_bytes, num_rdma_bytes, low_latency_mode. With `hidden`, adds `size_hints`: the
        bytes the default dispatch/combine configs ask for BF16 tokens of that size (DeepEP's
        size hints; rank counts without a default config are left out) and `meets_size_hints`
        (the normal-mode hints count only for a buffer with NVL bytes).
        With `num_max_dispatch_tokens_per_rank` and `num_experts` too, adds the low-latency hint."""
        rank, num_ranks, dev, nvl, rdma, ll, backend = (int(v) for v in ops.buffer_info(self.handle)[:7])
        report = {"rank": rank, "num_ranks": num_ranks, "device": "cpu" if dev < 0 else f"cuda:{dev}",
                  "backend": {0: "cpu", 1: "nccl", 2: "nvshmem", 3: "ipc"}.get(backend, str(backend)), "num_nvl_bytes": nvl,
                  "num_rdma_bytes": rdma, "low_latency_mode": bool(ll)}
        if hidden is None:
            return report
        hints = {}
        for name, get in (("dispatch", Buffer.get_dispatch_config), ("combine", Buffer.get_combine_config)):
            try:
                cfg = get(num_ranks)
            except AssertionError:  # no default config for this rank count
                continue
            hints[f"{name}_nvl_bytes"] = cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
            hints[f"{name}_rdma_bytes"] = cfg.get_rdma_buffer_size_hint(hidden * 2, num_ranks)
        # A buffer without NVL bytes runs no normal-mode op (an LL-only buffer, as DeepEP's decode
        # buffers are): the normal-mode hints do not apply to it.
        ok = nvl == 0 or all(nvl >= v for k, v in hints.items() if k.endswith("nvl_bytes"))
        ok = ok and (nvl == 0 or all(rdma >= v for k, v in hints.items() if k.endswith("rdma_bytes")))
        if num_max_dispatch_tokens_per_rank is not None and num_experts is not None:
            hints["low_latency_rdma_bytes"] = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                                                    num_ranks, num_experts)
            ok = ok and rdma >= hints["low_latency_rdma_bytes"]
        report.update(hidden=hidden, size_hints=hints, meets_size_hints=ok)
        return report

    # ---- static helpers ---------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (an empty EventOverlap without CUDA, where every
        op completes before returning)."""
        return EventOverlap(EventHandle() if torch.cuda.is_available() else None)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return int(ops.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended dispatch config (its table: 2..160 ranks); any other count
        answers too (`_table_entry`), where DeepEP asserts."""
        return Config(Buffer.num_sms, *_table_entry(_DISPATCH_TABLE, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended combine config; any rank count answers (`_table_entry`)."""
        return Config(Buffer.num_sms, *_table_entry(_COMBINE_TABLE, num_ranks))

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's part of the buffer as a `dtype` tensor (DeepEP V1): a view, not a copy, of the
        NVLink part (`num_nvl_bytes`) or, with `use_rdma_buffer`, the RDMA / low-latency part
        (`num_rdma_bytes`), from byte `offset` on (a multiple of the element size; DeepEP's offset
        counts bytes too). Without `size`: 1-D, `(part bytes - offset) // element size` elements
        (DeepEP returns `part bytes // element size` from the offset, past the end when the offset
        is not 0); with `size`, its first `size.numel()` elements viewed as `size`.

        The view lives in the buffer's memory: it keeps this Buffer object alive (so garbage
        collection never releases the buffer under it), and `destroy()` invalidates it (do not use
        it afterwards). Writing into it while an op of the buffer is in flight on any rank gives
        undefined results (as in DeepEP). Between steps (every rank's last combine finished, no
        rank's next op started, e.g. a `dist.barrier()` after the reset) zeroing it resets the
        buffer: vLLM's `get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()`; the next
        low-latency and normal-mode calls run as on a new buffer (docs/OPS.md)."""
        t = ops.get_local_buffer_tensor(self.handle, dtype, int(offset), bool(use_rdma_buffer))
        if size is not None:
            size = torch.Size(size if isinstance(size, (tuple, list, torch.Size)) else (size,))
            assert t.numel() >= size.numel(), \
                f"get_local_buffer_tensor: size {tuple(size)} needs {size.numel()} elements, the part holds {t.numel()} from offset {offset}"
            t = t[:size.numel()].view(size)
        t._deep_ep_buffer = self  # the buffer outlives every view of it that is still referenced
        return t

    # ---- stream handling (DeepEP semantics) ---------------------------------------------------
    def _on_comm_stream(self, previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool, result: list):
        """Runs the body on the comm stream after `previous_event` (or the current stream), then
        either makes the current stream wait or returns an event through `result`.

        Without `previous_event` and `async_finish` (the common call), the comm stream would wait
        for the current stream and the current stream for it right after: the same order as
        running on the current stream, which is what happens then (no stream switch, no events:
        the host path stays short)."""
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish, "allocate_on_comm_stream requires previous_event and async_finish"
        if self._comm_stream is None or (previous_event is None and not async_finish):
            return _Inline(result)
        return self._comm_stream_scope(previous_event, async_finish, result)

    @contextlib.contextmanager
    def _comm_stream_scope(self, previous_event: Optional[EventOverlap], async_finish: bool, result: list):
        compute = torch.cuda.current_stream(self.device)
        if previous_event is not None and previous_event.event is not None and previous_event.event.event is not None:
            self._comm_stream.wait_event(previous_event.event.event)
        else:
            self._comm_stream.wait_stream(compute)
        with torch.cuda.stream(self._comm_stream):
            yield
        if async_finish:
            result.append(EventOverlap(EventHandle(self._comm_stream)))
        else:
            compute.wait_stream(self._comm_stream)
            result.append(EventOverlap(None))

    @staticmethod
    def _keep_alive(event: EventOverlap, tensors) -> EventOverlap:
        if event.event is not None:
            event.extra_tensors = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        return event

    # ---- normal mode ----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Returns (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank [R/D] i32 when the ranks span
        several NVLink domains of D ranks (DEEP_EP_NVL_DOMAIN_SIZE, default 8) else None,
        num_tokens_per_expert [E] i32, is_token_in_rank [N, R] bool, event)."""
        ev: list = []
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
            a, b, c, d = (ops.get_dispatch_layout if _is_compiling() else _LAYOUT)(topk_idx, num_experts, self.group_size)
        return a, _opt(b), c, d, self._keep_alive(ev[0], (topk_idx, a, b, c, d))

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Sends each token to the ranks of its experts. Returns (recv_x [or (recv_x, recv_x_scales)],
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event); the
        cached form (`handle` given) returns (recv_x, None, None, None, None, event)."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self._num_rdma_ranks > 1:
            return self.internode_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                           config, previous_event, async_finish, allocate_on_comm_stream)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        ev: list = []
        if handle is not None:
            assert topk_idx is None and topk_weights is None, "cached dispatch takes no topk_idx/topk_weights"
            rpm, cpm, rcpm, src_idx, in_rank, send_head = handle
            with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
                with _no_autograd(x, x_scales):
                    recv_x, recv_s = (ops.cached_dispatch if _is_compiling() else _CACHED_DISPATCH)(
                        self.handle, x, x_scales, rpm, cpm, rcpm, src_idx, in_rank, send_head, config.to_list())
            out_x = (recv_x, recv_s) if x_scales is not None else recv_x
            return out_x, None, None, None, None, self._keep_alive(ev[0], (x, x_scales, recv_x, recv_s) + tuple(handle))
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None, \
            "dispatch needs the layout tensors (get_dispatch_layout) or a handle"
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
            with _no_autograd(x, x_scales, topk_weights):
                op = ops.dispatch if _is_compiling() else _DISPATCH
                (recv_x, recv_s, recv_idx, recv_w, per_expert, rpm, cpm, rcpm, src_idx, send_head) = op(
                    self.handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                    num_tokens_per_expert, expert_alignment, num_worst_tokens, config.to_list())
        new_handle = (rpm, cpm, rcpm, src_idx, is_token_in_rank, send_head)
        out_x = (recv_x, recv_s) if x_scales is not None else recv_x
        per_expert_list = per_expert.tolist() if num_worst_tokens == 0 else []
        event = self._keep_alive(ev[0], (x, x_scales, topk_idx, topk_weights, recv_x, recv_s, recv_idx, recv_w) + new_handle)
        return (out_x, recv_idx if topk_idx is not None else None, recv_w if topk_weights is not None else None,
                per_expert_list, new_handle, event)

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sends expert outputs back and sums them (unweighted, fp32, ascending rank order, bias
        first). Returns (combined_x [N, H], combined_topk_weights [N, K] or None, event)."""
        config = self.get_combine_config(self.group_size) if config is None else config
        if self._num_rdma_ranks > 1:
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        bias_0, bias_1 = (bias if isinstance(bias, tuple) else (bias, None))
        rpm, cpm, rcpm, src_idx, in_rank, send_head = handle
        ev: list = []
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
            with _no_autograd(x, topk_weights, bias_0, bias_1):
                out, out_w = (ops.combine if _is_compiling() else _COMBINE)(
                    self.handle, x, topk_weights, bias_0, bias_1, rpm, cpm, rcpm, src_idx, in_rank, send_head, config.to_list())
        event = self._keep_alive(ev[0], (x, topk_weights, bias_0, bias_1, out, out_w) + tuple(handle))
        return out, (out_w if topk_weights is not None else None), event

    def get_num_rdma_ranks(self) -> int:
        """NVLink domains the buffer's ranks span: `max(1, num_ranks / D)` with D ranks per domain
        (DEEP_EP_NVL_DOMAIN_SIZE, default 8, as DeepEP's NUM_MAX_NVL_PEERS)."""
        return self._num_rdma_ranks

    def internode_dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """Internode dispatch (ranks span several NVLink domains); `dispatch` calls it when
        `get_num_rdma_ranks() > 1`. Same results as `dispatch`, with DeepEP's 10-tensor internode
        handle: (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
        recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
        recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        ev: list = []
        if handle is not None:
            assert topk_idx is None and topk_weights is None, "cached dispatch takes no topk_idx/topk_weights"
            assert len(handle) == 10, "internode_dispatch needs the 10-tensor internode handle"
            with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
                with _no_autograd(x, x_scales):
                    recv_x, recv_s = ops.internode_cached_dispatch(self.handle, x, x_scales, *handle, config.to_list())
            out_x = (recv_x, recv_s) if x_scales is not None else recv_x
            return out_x, None, None, None, None, self._keep_alive(ev[0], (x, x_scales, recv_x, recv_s) + tuple(handle))
        assert num_tokens_per_rank is not None and num_tokens_per_rdma_rank is not None and is_token_in_rank is not None \
            and num_tokens_per_expert is not None, "internode_dispatch needs the layout tensors (get_dispatch_layout) or a handle"
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
            with _no_autograd(x, x_scales, topk_weights):
                (recv_x, recv_s, recv_idx, recv_w, per_expert, *rest) = ops.internode_dispatch(
                    self.handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                    is_token_in_rank, num_tokens_per_expert, expert_alignment, num_worst_tokens, config.to_list())
        new_handle = (is_token_in_rank, *rest)
        out_x = (recv_x, recv_s) if x_scales is not None else recv_x
        per_expert_list = per_expert.tolist() if num_worst_tokens == 0 else []
        event = self._keep_alive(ev[0], (x, x_scales, topk_idx, topk_weights, recv_x, recv_s, recv_idx, recv_w) + new_handle)
        return (out_x, recv_idx if topk_idx is not None else None, recv_w if topk_weights is not None else None,
                per_expert_list, new_handle, event)

    def internode_combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Internode combine: per token, the bf16 of the fp32 sum of the bias, then of one
        bf16-rounded fp32 partial per NVLink domain (domains ascending, local ranks ascending
        inside each). Returns (combined_x [N, H], combined_topk_weights [N, K] or None, event)."""
        config = self.get_combine_config(self.group_size) if config is None else config
        bias_0, bias_1 = (bias if isinstance(bias, tuple) else (bias, None))
        assert len(handle) == 10, "internode_combine needs the 10-tensor internode handle"
        ev: list = []
        with self._on_comm_stream(previous_event, async_finish, allocate_on_comm_stream, ev):
            with _no_autograd(x, topk_weights, bias_0, bias_1):
                out, out_w = ops.internode_combine(self.handle, x, topk_weights, bias_0, bias_1, *handle, config.to_list())
        event = self._keep_alive(ev[0], (x, topk_weights, bias_0, bias_1, out, out_w) + tuple(handle))
        return out, (out_w if topk_weights is not None else None), event

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        ops.clean_low_latency_buffer(self.handle, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, topk_weights: Optional[torch.Tensor] = None,
                             num_tokens: Optional[torch.Tensor] = None, x_global_scale: Optional[torch.Tensor] = None,
                             use_nvfp4: bool = False, use_ue8m0_for_sf: bool = False):
        """Returns (recv_x [or (recv_x, scales)], recv_count, handle, event, hook); handle =
        (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts).

        `use_nvfp4=True` (with `use_fp8=False` and `x_global_scale`, a float32 tensor whose first
        element is the global scale S): the NVFP4 dispatch of DeepEP's forks, which SGLang and vLLM
        call when configured for it (docs/NVFP4.md). recv_x is then the tuple (packed uint8 view
        [R*T, H/2, E_l], two E2M1 values per byte, low nibble first; float8_e4m3fn scales view
        [32, 4, ceil(R*T/128), 4, H/64, E_l] in the 128x4 swizzle), the views DeepEP's forks
        return; x ~ e2m1 * scale / S. The GPU kernels are new (docs/NVFP4.md section 9);
        `use_ue8m0_for_sf=True` raises NotImplementedError.

        `num_tokens` (extension, default None = every row of x is real): int32 tensor of shape []
        or [1] on x's device holding the real batch n; rows of x / topk_idx at or past n are not
        routed (as if topk_idx were -1 there). It is read on the device, so one captured CUDA
        graph with a static x [N, H] serves any n <= N; pass the same tensor to
        low_latency_combine. n outside 0..=N raises on CPU buffers and is clamped on CUDA ones.

        `topk_weights` (optional float32 [N, K], not a DeepEP argument): the weights travel with
        the tokens and the combine of this handle sends one partial sum per (token, expert rank)
        — bf16 of the fp32 sum over that rank's experts in top-k order — which the source sums
        over ranks ascending in fp32 (less traffic; one more BF16 rounding per rank than the
        per-expert sum, within DeepEP's combine tolerance). That combine then uses THESE weights:
        pass the same `topk_weights` to low_latency_combine. Both backends agree bit for bit."""
        if use_ue8m0_for_sf:
            raise NotImplementedError(
                "deep_ep_rs.Buffer.low_latency_dispatch: use_ue8m0_for_sf=True (UE8M0 NVFP4 scales) is not implemented "
                "(docs/NVFP4.md: DeepEP's own output for it is inconsistent); use E4M3 scales (the default)")
        assert not (async_finish and return_recv_hook), "async_finish and return_recv_hook are mutually exclusive"
        t, e = num_max_dispatch_tokens_per_rank, num_experts
        if not use_nvfp4:
            x_global_scale = None  # DeepEP's forks ignore it then; the op refuses a scale without NVFP4
        if return_recv_hook and not self._ll_whole_hooks:
            recv_x, scales, count, src_info, layout_range, state = ops.low_latency_dispatch_send(
                self.handle, x, topk_idx, topk_weights, t, e, use_fp8, round_scale, use_ue8m0, num_tokens, use_nvfp4,
                x_global_scale)

            def hook():
                ops.low_latency_dispatch_recv(self.handle, state, recv_x, scales, count, src_info, layout_range,
                                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, t, e, use_fp8,
                                              round_scale, use_ue8m0, use_nvfp4)
        else:
            hook = _received if return_recv_hook else None
            op = ops.low_latency_dispatch if _is_compiling() else _LL_DISPATCH
            # Trailing arguments at their schema defaults are left out: each costs ~0.15-0.6 µs to cross.
            tail = (num_tokens, use_nvfp4, x_global_scale) if use_nvfp4 else () if num_tokens is None else (num_tokens,)
            recv_x, scales, count, src_info, layout_range = op(
                self.handle, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, t, e,
                use_fp8, round_scale, use_ue8m0, *tail)
        handle = (src_info, layout_range, t, x.size(1), e)
        event = EventOverlap(EventHandle(), (x, topk_idx, recv_x, scales, count, src_info, layout_range, x_global_scale)) \
            if async_finish and x.is_cuda else EventOverlap(None)
        if use_nvfp4:  # DeepEP's views: data (R*T, H/2, E_l), scales (32, 4, rm, 4, rk, E_l)
            el, rm, rk, _ = scales.shape
            return (recv_x.permute(1, 2, 0), scales.view(el, rm, rk, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)), count, handle, event, hook
        return ((recv_x, scales) if use_fp8 else recv_x), count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                            num_tokens: Optional[torch.Tensor] = None, overlap: bool = False,
                            packed_recv_count: Optional[torch.Tensor] = None, comp_signal: Optional[torch.Tensor] = None,
                            block_m: int = 64, threshold: int = 0, num_sms: int = 0,
                            src_signals: Optional[torch.Tensor] = None, src_signal_expect_value: int = 0):
        """Returns (combined_x [N, H] bf16 = Σ_k w_k·y_k, event, hook). `num_tokens`: as in
        low_latency_dispatch (the same tensor); output rows at or past it are zero.

        Single-batch overlap (SGLang's SBO, DeepEP's overlap combine): `overlap`, with Hopper's
        `packed_recv_count`, `comp_signal`, `block_m`, `threshold`, `num_sms` or Blackwell's
        `src_signals`, `src_signal_expect_value`. As DeepEP, the combine sends an expert's rows block
        by block as the down GEMM raises their signals (GPU buffers: waits on the device, see
        `_overlap_args`; CPU buffers: a signal not raised is an error, the GEMM having run). Without
        `overlap` the arguments are ignored, as in DeepEP. `num_sms` > 0 caps the blocks that wait
        (four 128-thread blocks per SM) so that the GEMM keeps the rest."""
        assert not (async_finish and return_recv_hook), "async_finish and return_recv_hook are mutually exclusive"
        if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
            # The (recv_x, scales) pair of an FP8 dispatch: the op names the dtype it refuses.
            x = x[0]
        ov = (None, 64, 0, 0)
        if overlap:
            ov = _overlap_args(self.device, self.group_size, handle, packed_recv_count, comp_signal, block_m, threshold, num_sms,
                               src_signals, src_signal_expect_value)
        src_info, layout_range, t, hidden, e = handle
        # With overlap the send waits for the producer's signals: the hook stays apart there.
        whole_hook = self._ll_whole_hooks and not overlap
        if return_recv_hook and not whole_hook:
            if out is None:
                out = torch.empty((topk_idx.size(0), hidden), dtype=torch.bfloat16, device=x.device)
            state = ops.low_latency_combine_send(self.handle, x, src_info, layout_range, t, e, use_logfmt, zero_copy, *ov)

            def hook():
                ops.low_latency_combine_recv(self.handle, state, topk_idx, topk_weights, out, combine_wait_recv_cost_stats, t,
                                             hidden, e, num_tokens)
        else:
            hook = _received if return_recv_hook else None
            # Trailing arguments at their schema defaults are left out (as in low_latency_dispatch).
            tail = (num_tokens, *ov) if overlap else () if num_tokens is None else (num_tokens,)
            if out is None:
                # The op allocates `out` itself (one allocator call in C++, not a torch.empty from
                # Python: bench/NOTES.md, session 23).
                op = ops.low_latency_combine_alloc if _is_compiling() else _LL_COMBINE_ALLOC
                out = op(self.handle, x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, t, e, use_logfmt,
                         zero_copy, *tail)
            else:
                op = ops.low_latency_combine if _is_compiling() else _LL_COMBINE
                op(self.handle, x, topk_idx, topk_weights, src_info, layout_range, out, combine_wait_recv_cost_stats, t, e, use_logfmt,
                   zero_copy, *tail)
        event = EventOverlap(EventHandle(), (x, topk_idx, topk_weights, src_info, layout_range, out)) \
            if async_finish and x.is_cuda else EventOverlap(None)
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle: Tuple) -> torch.Tensor:
        """The bf16 [E_l, R*T, H] view a zero-copy combine reads."""
        _, _, t, hidden, e = handle
        return ops.get_next_low_latency_combine_buffer(self.handle, t, hidden, e)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (`mask=True`) or unmasks `rank_to_mask` for this rank's LL ops (local). A
        masked rank is neither sent to nor waited for; tokens routed to its experts are
        dropped (no send, zero combine contribution)."""
        ops.low_latency_update_mask_buffer(self.handle, rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask into `mask_status` (int32 `[num_ranks]`, any device): 1 = masked."""
        ops.low_latency_query_mask_buffer(self.handle, mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (local)."""
        ops.low_latency_clean_mask_buffer(self.handle)

    def wait_stats(self, reset: bool = False) -> torch.Tensor:
        """Per-peer host wait statistics of this rank (extension, local): int64 `[num_ranks, 2]`
        on the CPU, row p = [waits that included rank p, nanoseconds until p arrived], summed
        since creation or the last `reset=True` (this rank's own row stays zero). Covers every barrier and LL receive wait of
        the cpu backend; a rank that is always waited for longest is the straggler. The nccl
        backend waits on the GPU and raises (use the LL `*_wait_recv_cost_stats` tensors)."""
        return ops.wait_stats(self.handle, reset)
