"""`ElasticBuffer` and `EPHandle`: DeepEP V2's expert-parallel API over this package's V1 machinery.

DeepEP V2 (`deep_ep.ElasticBuffer`) needs NCCL Gin and an RDMA NIC. This module offers the same
class, method names, argument names and defaults on every backend of `deep_ep_rs.Buffer` (CPU,
one or several NVLink GPUs, several ranks on one GPU). It is a thin layer (docs/V2.md):

- communication is the V1 normal-mode ops: `get_dispatch_layout` + `dispatch` (with
  `num_worst_tokens = num_ranks * num_max_tokens_per_rank` when `do_cpu_sync=False`, so every
  output has a static worst-case size and no host sync happens), `cached_dispatch` (a dispatch
  with a handle) and `combine`, on a `deep_ep_rs.Buffer` created by the constructor;
- V2's layout extras are plain torch tensor ops on the device, without host syncs on the
  `do_cpu_sync=False` path: per-expert counts and their prefix sums, the expanding layout (one
  row per (token, local expert), grouped by expert, each expert's block padded to
  `expert_alignment`), its reduction back to one row per token before combine, the
  cumulative receive statistics and the TMA-aligned scale layout.

Autograd: every step is differentiable (the V1 ops have registered autograd), so gradients flow
through `dispatch` and `combine` as they are; frameworks that wrap them in their own autograd
functions (combine as dispatch's backward, a cached dispatch as combine's backward) get the
adjoint pairs they expect, in both layouts.

Differences from DeepEP V2 are listed in README.md ("DeepEP V2") and docs/V2.md.
"""
import contextlib
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _lib
from ._autograd import cached_dispatch_rows_f32
from .buffer import Buffer, _nvl_domain_size
from .utils import EventHandle, EventOverlap

_lib.load()
ops = torch.ops.deep_ep

#: DeepEP V2 sizes buffers in multiples of 2 MiB.
_BUFFER_ALIGNMENT = 2 << 20
#: Slack of the size hint for the window's section alignment, headers, per-expert counts and
#: channel matrices (experts are not an argument of the hint).
_HINT_SLACK = 1 << 20
#: Combine sends bf16 rows.
_COMBINE_ELEMENT_SIZE = 2

TensorOrPair = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def _value_or(value, default):
    return default if value is None else value


def get_physical_domain_size(group: dist.ProcessGroup) -> Tuple[int, int]:
    """(RDMA ranks, NVLink ranks) of `group`: NVLink domains of D ranks (DEEP_EP_NVL_DOMAIN_SIZE,
    default 8, as `Buffer.get_num_rdma_ranks`)."""
    r, d = group.size(), _nvl_domain_size()
    return (r // d, d) if r > d else (1, r)


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """(scale-out ranks, scale-up ranks): the physical domains in hybrid mode, else one
    scale-up domain of every rank."""
    rdma, nvl = get_physical_domain_size(group)
    return (rdma, nvl) if allow_hybrid_mode else (1, group.size())


def _size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8_dispatch: bool) -> int:
    """Bytes of window the V1 ops stage for V2's worst case: a dispatch of T tokens (rows, FP8
    scales, top-k ids and weights, is_token_in_rank) and a combine of up to R * T received bf16
    rows with their weights; 2 MiB-aligned."""
    r, t, k = num_ranks, max(0, num_max_tokens_per_rank), max(0, num_topk)
    row = hidden * (1 if use_fp8_dispatch else 2)
    scales = 4 * -(-hidden // 128) if use_fp8_dispatch else 0
    dispatch = t * (4 * r + row + scales + 12 * k)
    combine = r * t * (_COMBINE_ELEMENT_SIZE * hidden + 4 * k) + 4 * r * r
    return _align(max(dispatch, combine) + _HINT_SLACK, _BUFFER_ALIGNMENT)


def _not_implemented(name: str):
    raise NotImplementedError(f"deep_ep_rs.ElasticBuffer.{name} is not implemented (DeepEP V2's Engram, PP and "
                              "all-gather/reduce-scatter need its NCCL Gin runtime; only dispatch/combine are offered)")


class EPHandle:
    """Routing state returned by `ElasticBuffer.dispatch`; pass it to `combine`, or back to
    `dispatch(handle=...)` to send other data along the same routes (no layout work, no host
    sync). Made by `dispatch` only.

    V2's fields: `do_expand`, `num_experts`, `expert_alignment`, `num_max_tokens_per_rank`,
    `num_sms`, `topk_idx` (the dispatch's top-k ids, cloned unless `do_handle_copy=False`),
    `num_recv_tokens` (received tokens; with `do_cpu_sync=False` the worst-case row count),
    `num_expanded_tokens` (rows of the expanded layout, likewise), `num_recv_tokens_per_expert_list`
    (host list of per-expert counts padded to `expert_alignment`; empty with `do_cpu_sync=False`),
    `psum_num_recv_tokens_per_scaleup_rank` (int32 [R] on the device: inclusive prefix sum of the
    tokens received from each rank, last = received tokens), `psum_num_recv_tokens_per_expert`
    (int32 [E_l] on the device: inclusive prefix sum of the aligned counts; in the expanding
    layout entry i is expert i's start plus its real count),
    `num_unaligned_recv_tokens_per_expert` (int32 [E_l]). V2's kernel-private fields
    (`recv_src_metadata`, `dst_buffer_slot_idx`, `token_metadata_at_forward`,
    `channel_linked_list`) are None: the V1 handle and the expansion maps (keyword-only fields)
    stand in for them.
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int,
                 topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int, num_recv_tokens_per_expert_list: List[int],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor, recv_src_metadata: Optional[torch.Tensor] = None,
                 dst_buffer_slot_idx: Optional[torch.Tensor] = None, token_metadata_at_forward: Optional[torch.Tensor] = None,
                 channel_linked_list: Optional[torch.Tensor] = None, *, layout: Tuple[torch.Tensor, ...] = (),
                 recv_topk_idx: Optional[torch.Tensor] = None, real_rows: Optional[torch.Tensor] = None,
                 expand_slot: Optional[torch.Tensor] = None, expand_source: Optional[torch.Tensor] = None, num_topk: int = 0):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.cached_recv_src_metadata_before_sort = None
        # The V1 handle (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
        # recv_src_idx, is_token_in_rank, send_head), the local top-k ids of the received rows,
        # the mask of real rows (None when every row is real), and the expansion maps: slot [rows, K]
        # = expanded row of (received row, k) or -1; source [M] = r * K + k of expanded row or -1.
        self.layout = layout
        self.recv_topk_idx = recv_topk_idx
        self.real_rows = real_rows
        self.expand_slot = expand_slot
        self.expand_source = expand_source
        self.num_topk = num_topk

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor], channel_linked_list: Optional[torch.Tensor]) -> None:
        """V2 sorts its received rows by source token when `deterministic=True`; the rows here are
        always in that order (source rank, then token; experts' blocks likewise), so there is
        nothing to do."""

    @property
    def num_local_experts(self) -> int:
        return self.psum_num_recv_tokens_per_expert.shape[0]

    def __repr__(self) -> str:
        return (f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, expert_alignment={self.expert_alignment}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_recv_tokens={self.num_recv_tokens}, "
                f"num_expanded_tokens={self.num_expanded_tokens})")


def _counts(recv_idx: torch.Tensor, num_local_experts: int):
    """(flat bucket of every (row, k) pair [rows * K] i64: its local expert, or E_l for none;
    tokens per bucket [E_l + 1] i64). Device-side, no host sync."""
    idx = recv_idx.reshape(-1).long()
    el = num_local_experts
    key = torch.where((idx >= 0) & (idx < el), idx, torch.full_like(idx, el))
    counts_all = torch.zeros(el + 1, dtype=torch.int64, device=idx.device).scatter_add_(0, key, torch.ones_like(key))
    return key, counts_all


def _expand_maps(key: torch.Tensor, counts_all: torch.Tensor, num_topk: int, alignment: int, num_rows_out: int):
    """Device-side layout of the expanding mode (no host sync; every shape is fixed by the inputs).

    key, counts_all: from `_counts`. Returns (slot [rows, K] i64 = expanded row of (row, k) or -1,
    source [num_rows_out] i64 = row * K + k of each expanded row or -1). Expert e's block starts at
    sum_{j<e} align(counts[j]); inside it rows keep their receive order (source rank, then token),
    which is DeepEP V2's deterministic order."""
    n = key.shape[0]
    el = counts_all.shape[0] - 1
    dev = key.device
    counts = counts_all[:el]
    aligned = (counts + (alignment - 1)) // alignment * alignment
    start = torch.cumsum(aligned, 0) - aligned
    first = torch.cumsum(counts_all, 0) - counts_all  # first sorted position of each bucket
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    ordinal = torch.arange(n, device=dev) - first[sorted_key]
    start_ext = torch.cat([start, start.new_zeros(1)])
    # Pairs without a local expert go to distinct rows past the output (no duplicate writes).
    dst_sorted = torch.where(sorted_key < el, start_ext[sorted_key] + ordinal, num_rows_out + order)
    slot_flat = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, order, dst_sorted)
    slot = torch.where(key < el, slot_flat, torch.full_like(slot_flat, -1)).view(-1, num_topk)
    source = torch.full((num_rows_out + n,), -1, dtype=torch.int64, device=dev).scatter_(0, dst_sorted, order)
    return slot, source[:num_rows_out]


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
             if hasattr(torch, n))


def _zero_rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """t with the rows where `mask` [rows] holds set to zero. FP8 rows move as uint8 bits (torch
    has no masked_fill/index_select kernels for FP8); other dtypes stay differentiable (a
    `view(dtype)` would cut the graph)."""
    m = mask.view((-1,) + (1,) * (t.dim() - 1))
    if t.dtype in _FP8:
        return t.view(torch.uint8).masked_fill(m, 0).view(t.dtype)
    return t.masked_fill(m, 0)


def _gather_rows(t: torch.Tensor, index: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """t[index] with the rows where `pad` holds set to zero (index entries there are ignored)."""
    if t.shape[0] == 0:
        return t.new_zeros((index.shape[0],) + tuple(t.shape[1:]))
    if t.dtype in _FP8:
        out = t.view(torch.uint8).index_select(0, index.clamp(min=0)).view(t.dtype)
    else:
        out = t.index_select(0, index.clamp(min=0))
    return _zero_rows(out, pad)


def _tma_aligned_col_major(sf: torch.Tensor) -> torch.Tensor:
    """The same values in a column-major layout whose column stride is the row count rounded up
    to 16 bytes (DeepGEMM's TMA-aligned scale factor layout)."""
    m, s = sf.shape
    stride = _align(m, max(1, 16 // sf.element_size()))
    storage = sf.new_zeros((s, stride))
    storage[:, :m] = sf.t()
    return storage[:, :m].t()


class ElasticBuffer:
    """DeepEP V2's `ElasticBuffer` (expert-parallel dispatch and combine) on a `deep_ep_rs.Buffer`.

    Attributes as V2's: `group`, `rank_idx`, `num_ranks`, `allow_hybrid_mode`,
    `allow_multiple_reduction`, `prefer_overlap_with_compute`, `deterministic`, `num_bytes`,
    `num_max_tokens_per_rank`, `num_allocated_qps`, `explicitly_destroy`, `num_scaleout_ranks`,
    `num_scaleup_ranks`, `scaleout_rank_idx`, `scaleup_rank_idx`, `num_rdma_ranks`,
    `num_nvlink_ranks`, `runtime` (here: the `deep_ep_rs.Buffer`, None after `destroy`).

    The backend and device are those of `deep_ep_rs.Buffer` (DEEP_EP_BACKEND; the current CUDA
    device, or the CPU). The ranks must lie in one NVLink domain (DEEP_EP_NVL_DOMAIN_SIZE, default
    8): ranks spanning several raise NotImplementedError (V1's internode `Buffer` serves them).
    """

    def __init__(self,
                 group: dist.ProcessGroup,
                 num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0,
                 hidden: int = 0,
                 num_topk: int = 0,
                 use_fp8_dispatch: bool = False,
                 deterministic: bool = False,
                 allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3,
                 num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        if group is None:
            raise ValueError("deep_ep_rs.ElasticBuffer: a torch.distributed group is required")
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.sl_idx = sl_idx
        self.num_cpu_bytes = num_cpu_bytes
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.num_rdma_ranks, self.num_nvlink_ranks = get_physical_domain_size(group)
        if self.num_rdma_ranks > 1:
            raise NotImplementedError(
                f"deep_ep_rs.ElasticBuffer: {self.num_ranks} ranks span {self.num_rdma_ranks} NVLink domains of "
                f"{self.num_nvlink_ranks} (DEEP_EP_NVL_DOMAIN_SIZE); the V2 API runs within one domain (use deep_ep_rs.Buffer)")
        if num_bytes is None:
            num_bytes = _size_hint(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_bytes = int(num_bytes)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_allocated_qps == 0:
            num_allocated_qps = 65 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self.explicitly_destroy = explicitly_destroy
        self.runtime: Optional[Buffer] = Buffer(group, self.num_bytes, 0, low_latency_mode=False,
                                                explicitly_destroy=explicitly_destroy)
        self.nccl_comm_handle = None
        self._dispatch_config = Buffer.get_dispatch_config(self.num_ranks).to_list()
        self._combine_config = Buffer.get_combine_config(self.num_ranks).to_list()
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks

    # ---- lifecycle and helpers ----------------------------------------------------------------
    def _buffer(self) -> Buffer:
        if self.runtime is None:
            raise RuntimeError("deep_ep_rs.ElasticBuffer: the buffer was destroyed")
        return self.runtime

    def destroy(self) -> None:
        """Releases the buffer (collective). Requires `explicitly_destroy=True`, as V2."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup,
                             num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes a buffer for these MoE settings needs (2 MiB-aligned): what the V1 ops stage for
        a dispatch of `num_max_tokens_per_rank` tokens and the combine of what it received. The
        constructor uses the same number when `num_bytes` is not given."""
        return _size_hint(group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        _not_implemented("get_engram_storage_size_hint")

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        _not_implemented("get_pp_buffer_size_hint")

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup,
                                       shapes: Union[Tuple[int, ...], torch.Size, Sequence[Union[Tuple[int, ...], torch.Size]]],
                                       dtype: torch.dtype) -> int:
        _not_implemented("get_agrs_num_max_session_bytes")

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        _not_implemented("get_agrs_buffer_size_hint")

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank meets here after its earlier work on the stream (the communication stream,
        or the current one) has finished: a stream synchronisation, then a barrier of the group
        (host-side; V2's is a GPU kernel). `with_cpu_sync` also synchronises the device around it."""
        buf = self._buffer()
        if buf.device.type == "cuda":
            if with_cpu_sync:
                torch.cuda.synchronize(buf.device)
            stream = buf.get_comm_stream() if use_comm_stream else torch.cuda.current_stream(buf.device)
            stream.synchronize()
        dist.barrier(group=self.group)
        if with_cpu_sync and buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current CUDA stream (an empty one without CUDA)."""
        return EventHandle()

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The communication stream (None on CPU buffers, whose ops finish before returning)."""
        return self._buffer().get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(RDMA ranks, NVLink ranks): (1, num_ranks) here."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out ranks, scale-up ranks): (1, num_ranks) here."""
        return get_logical_domain_size(self.group, self.allow_hybrid_mode)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """The SM count the dispatch and combine here run with: the V1 config's
        (`deep_ep_rs.Buffer.num_sms`, 20 by default; V2 derives its count from a bandwidth model)."""
        assert num_scaleout_topk == 0
        return Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's QP formula (recorded only: no RDMA here), capped by `num_allocated_qps`."""
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    # ---- Engram, PP, AGRS: not offered ------------------------------------------------------
    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        _not_implemented("engram_write")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False) -> Callable:
        _not_implemented("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        _not_implemented("pp_set_config")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        _not_implemented("pp_send")

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        _not_implemented("pp_recv")

    def create_agrs_session(self) -> None:
        _not_implemented("create_agrs_session")

    def destroy_agrs_session(self) -> None:
        _not_implemented("destroy_agrs_session")

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        if enabled:
            _not_implemented("agrs_new_session")
        yield

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        _not_implemented("agrs_set_config")

    def agrs_get_inplace_tensor(self, shapes: Union[Tuple[int, ...], torch.Size, Sequence[Union[Tuple[int, ...], torch.Size]]],
                                dtype: torch.dtype) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        _not_implemented("agrs_get_inplace_tensor")

    def all_gather(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]):
        _not_implemented("all_gather")

    # ---- streams --------------------------------------------------------------------------------
    def _run(self, fn, previous_event, async_with_compute_stream: bool):
        """Runs fn() with DeepEP's stream semantics and returns (outputs, EventOverlap).

        CPU buffers finish before returning (no event). On CUDA, a call without `previous_event`
        and without `async_with_compute_stream` runs on the current stream (so it is captured into
        CUDA graphs like any other kernel); otherwise on the communication stream after
        `previous_event` (or the current stream), returning an event when asynchronous (the
        current stream waits otherwise). Under torch.compile everything runs on the current
        stream and the event is empty."""
        if torch.compiler.is_compiling() or (previous_event is None and not async_with_compute_stream):
            return fn(), EventOverlap(None)
        comm = self._buffer().get_comm_stream()
        if comm is None:
            return fn(), EventOverlap(None)
        compute = torch.cuda.current_stream(self._buffer().device)
        prev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
        cuda_event = prev if isinstance(prev, torch.cuda.Event) else getattr(prev, "event", None)
        if cuda_event is not None:
            comm.wait_event(cuda_event)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            out = fn()
        if async_with_compute_stream:
            return out, EventOverlap(EventHandle(comm), out[-1])
        compute.wait_stream(comm)
        return out, EventOverlap(None)

    # ---- dispatch -------------------------------------------------------------------------------
    def dispatch(self,
                 x: TensorOrPair,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False,
                 do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) \
            -> Tuple[TensorOrPair, Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        """Sends each token to the ranks of its experts (collective). Returns (recv_x or
        (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event).

        Normal layout: one row per received token in receive order (source rank, then token:
        V2's deterministic order), `recv_topk_idx` [rows, K] local ids (-1: another rank's
        expert) and `recv_topk_weights` [rows, K] (0 there). Expanding layout (`do_expand`): one
        row per (token, local expert), grouped by expert, each block padded to `expert_alignment`
        rows (padding rows are zero), `recv_topk_idx` None, `recv_topk_weights` [rows] 1-D.
        `do_cpu_sync=False`: every output has its worst-case size (normal: R * T rows; expanding:
        R * T * min(K, E_l) + E_l * (alignment - 1)), rows past the received ones are zero (ids -1),
        the counts stay on the device (`handle.psum_*`) and no host sync happens, so the call can
        be captured in a CUDA graph or compiled with fullgraph=True. With `handle`, the handle's
        routes and sizes are reused (`topk_idx` must be None; `topk_weights` may be sent along).
        `num_sms` / `num_qps` are recorded in the handle but do not change the kernels here."""
        x, sf = x if isinstance(x, tuple) else (x, None)
        assert topk_idx is not None or handle is not None, "dispatch needs topk_idx or a handle"
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        if handle is not None:
            assert topk_idx is None, "a cached dispatch (handle=...) takes no topk_idx"
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            num_max_tokens_per_rank = _value_or(num_max_tokens_per_rank, handle.num_max_tokens_per_rank)
            num_experts = _value_or(num_experts, handle.num_experts)
            expert_alignment = _value_or(expert_alignment, handle.expert_alignment)
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == \
                   (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank), \
                "num_experts, expert_alignment and num_max_tokens_per_rank must be the handle's"

            def cached():
                return self._cached_dispatch(x, sf, topk_weights, cumulative_local_expert_recv_stats, handle,
                                             use_tma_aligned_col_major_sf)

            (recv_x, recv_sf, recv_idx, recv_w, keep), event = self._run(cached, previous_event, async_with_compute_stream)
            return (recv_x, recv_sf) if sf is not None else recv_x, recv_idx, recv_w, handle, event

        assert num_experts is not None, "dispatch needs num_experts (or a handle)"
        num_max_tokens_per_rank = _value_or(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
        expert_alignment = _value_or(expert_alignment, 1)
        do_cpu_sync = _value_or(do_cpu_sync, True)
        assert expert_alignment >= 1, f"expert_alignment must be >= 1, got {expert_alignment}"
        assert num_experts % self.num_ranks == 0, f"num_experts ({num_experts}) must be a multiple of the rank count ({self.num_ranks})"
        if not do_cpu_sync and num_max_tokens_per_rank <= 0:
            raise ValueError("deep_ep_rs.ElasticBuffer.dispatch: do_cpu_sync=False sizes outputs by num_max_tokens_per_rank, "
                             "which is 0 (pass it here or to the constructor)")
        if num_max_tokens_per_rank > 0 and x.shape[0] > num_max_tokens_per_rank:
            raise ValueError(f"deep_ep_rs.ElasticBuffer.dispatch: {x.shape[0]} tokens exceed num_max_tokens_per_rank "
                             f"({num_max_tokens_per_rank})")

        def fresh():
            return self._dispatch(x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                  num_max_tokens_per_rank, expert_alignment, num_sms, do_handle_copy, do_cpu_sync, do_expand,
                                  use_tma_aligned_col_major_sf)

        (recv_x, recv_sf, recv_idx, recv_w, new_handle, keep), event = self._run(fresh, previous_event, async_with_compute_stream)
        return (recv_x, recv_sf) if sf is not None else recv_x, recv_idx, recv_w, new_handle, event

    def _dispatch(self, x, sf, topk_idx, topk_weights, stats, num_experts, t_max, alignment, num_sms, do_handle_copy,
                  do_cpu_sync, do_expand, tma_sf):
        r, me = self.num_ranks, self.rank_idx
        el = num_experts // r
        k = topk_idx.shape[1]
        worst = 0 if do_cpu_sync else r * t_max
        ntpr, _, ntpe, in_rank = ops.get_dispatch_layout(topk_idx, num_experts, r)
        # The V1 op takes top-k ids and weights together; V2's weights are optional.
        w_in = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        (recv_x, recv_sf, recv_idx, recv_w, per_expert, rpm, cpm, rcpm, src_idx, send_head) = ops.dispatch(
            self._buffer().handle, x, sf, topk_idx, w_in, ntpr, in_rank, ntpe, 1, worst, self._dispatch_config)
        recv_sf = recv_sf if sf is not None else None
        recv_w = recv_w if topk_weights is not None else None
        real = None
        if worst > 0:  # rows past the received ones: zero (the GPU leaves them unspecified), ids -1
            real = src_idx >= 0
            recv_x = _zero_rows(recv_x, ~real)
            recv_sf = _zero_rows(recv_sf, ~real) if recv_sf is not None else None
            recv_idx = recv_idx.masked_fill(~real.unsqueeze(1), -1)
        if recv_w is not None:
            recv_w = recv_w.masked_fill(recv_idx < 0, 0)
        rows = recv_x.shape[0]
        if do_cpu_sync:
            counts_host = per_expert.tolist()
            aligned_host = [_align(c, alignment) for c in counts_host]
            num_expanded = sum(aligned_host)
        else:
            aligned_host = []
            num_expanded = rows * min(k, el) + el * (alignment - 1)
        key, counts_all = _counts(recv_idx, el)
        counts = counts_all[:el]
        slot, source = _expand_maps(key, counts_all, k, alignment, num_expanded) if do_expand else (None, None)
        aligned = (counts + (alignment - 1)) // alignment * alignment
        if do_expand:
            psum_expert = torch.cumsum(aligned, 0) - aligned + counts
        else:
            psum_expert = torch.cumsum(aligned, 0)
        if stats is not None:
            stats.add_(counts.to(stats.dtype))
        layout = (rpm, cpm, rcpm, src_idx, in_rank, send_head)
        new_handle = EPHandle(
            do_expand, num_experts, alignment, t_max, num_sms, topk_idx.clone() if do_handle_copy else topk_idx, rows,
            num_expanded, aligned_host, rpm[:, me].contiguous(), psum_expert.to(torch.int32), counts.to(torch.int32),
            layout=layout, recv_topk_idx=recv_idx, real_rows=real,
            expand_slot=slot, expand_source=source, num_topk=k)
        if do_expand:
            recv_x, recv_sf, recv_w = self._expand(new_handle, recv_x, recv_sf, recv_w)
            recv_idx = None
        if recv_sf is not None and tma_sf:
            recv_sf = _tma_aligned_col_major(recv_sf)
        keep = (x, sf, topk_idx, topk_weights, recv_x, recv_sf, recv_idx, recv_w) + layout
        return recv_x, recv_sf, recv_idx, recv_w, new_handle, keep

    @staticmethod
    def _expand(handle: EPHandle, recv_x, recv_sf, recv_w):
        """Rows in receive order -> the expanding layout of `handle` (padding rows zero)."""
        source, k = handle.expand_source, handle.num_topk
        pad = source < 0
        row = torch.div(source, k, rounding_mode="floor") if k > 0 else source
        out_x = _gather_rows(recv_x, row, pad)
        out_sf = _gather_rows(recv_sf, row, pad) if recv_sf is not None else None
        out_w = _gather_rows(recv_w.reshape(-1), source, pad) if recv_w is not None else None
        return out_x, out_sf, out_w

    def _cached_dispatch(self, x, sf, topk_weights, stats, handle: EPHandle, tma_sf):
        buf = self._buffer()
        rpm, cpm, rcpm, src_idx, in_rank, send_head = handle.layout
        recv_x, recv_sf = ops.cached_dispatch(buf.handle, x, sf, rpm, cpm, rcpm, src_idx, in_rank, send_head,
                                              self._dispatch_config)
        recv_sf = recv_sf if sf is not None else None
        if handle.real_rows is not None:
            recv_x = _zero_rows(recv_x, ~handle.real_rows)
            recv_sf = _zero_rows(recv_sf, ~handle.real_rows) if recv_sf is not None else None
        recv_w = None
        if topk_weights is not None:
            recv_w = cached_dispatch_rows_f32(buf.handle, topk_weights, rpm, cpm, rcpm, src_idx, in_rank, send_head,
                                              self._dispatch_config)
            recv_w = recv_w.masked_fill(handle.recv_topk_idx < 0, 0).to(topk_weights.dtype)
        if stats is not None:
            stats.add_(handle.num_unaligned_recv_tokens_per_expert.to(stats.dtype))
        recv_idx = handle.recv_topk_idx
        if handle.do_expand:
            recv_x, recv_sf, recv_w = self._expand(handle, recv_x, recv_sf, recv_w)
            recv_idx = None
        if recv_sf is not None and tma_sf:
            recv_sf = _tma_aligned_col_major(recv_sf)
        keep = (x, sf, topk_weights, recv_x, recv_sf, recv_w) + tuple(handle.layout)
        return recv_x, recv_sf, recv_idx, recv_w, keep

    # ---- combine --------------------------------------------------------------------------------
    def combine(self,
                x: torch.Tensor,
                handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                num_sms: int = 0, num_qps: int = 0,
                previous_event: EventHandle = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sends rows back to their tokens' ranks and sums them (collective): combined_x [N, H]
        bf16 = bf16 of the fp32 sum of the biases, then per rank ascending of that rank's rows
        (in the expanding layout first summed per token in fp32 in top-k order and rounded to
        bf16, V2's `allow_multiple_reduction=True`). Not weighted: apply the top-k weights to the
        rows before. `topk_weights` ([rows, K], or [rows] in the expanding layout) are summed the
        same way into combined_topk_weights [N, K] (None without them)."""
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        bias_0, bias_1 = bias if isinstance(bias, tuple) else (bias, None)

        def run():
            return self._combine(x, handle, topk_weights, bias_0, bias_1)

        (out, out_w, keep), event = self._run(run, previous_event, async_with_compute_stream)
        return out, out_w, event

    def _combine(self, x, handle: EPHandle, topk_weights, bias_0, bias_1):
        rpm, cpm, rcpm, src_idx, in_rank, send_head = handle.layout
        rows = src_idx.shape[0]
        if handle.do_expand:
            assert x.shape[0] == handle.expand_source.shape[0], \
                f"combine of the expanding layout takes {handle.expand_source.shape[0]} rows, got {x.shape[0]}"
            slot = handle.expand_slot
            pad = slot < 0
            acc = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
            for j in range(handle.num_topk):  # top-k order, fp32, one rounding per rank
                acc = acc + _gather_rows(x, slot[:, j], pad[:, j]).float()
            x = acc.to(torch.bfloat16)
            if topk_weights is not None:
                assert topk_weights.dim() == 1, "the expanding layout takes 1-D topk_weights"
                topk_weights = _gather_rows(topk_weights, slot.reshape(-1), pad.reshape(-1)).view(rows, handle.num_topk)
        out, out_w = ops.combine(self._buffer().handle, x, topk_weights, bias_0, bias_1, rpm, cpm, rcpm, src_idx, in_rank,
                                 send_head, self._combine_config)
        keep = (x, topk_weights, bias_0, bias_1, out, out_w) + tuple(handle.layout)
        return out, (out_w if topk_weights is not None else None), keep


__all__ = ["ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size"]
