//! Backends: one trait, one implementation per transport, chosen at buffer creation from the
//! device and `DEEP_EP_BACKEND`. A backend that is not compiled in answers with
//! [`Error::NotCompiled`]; a feature a backend lacks answers with [`Error::NotImplemented`].
//!
//! Argument structs are validated by `crate::ops` before a backend sees them: shapes, dtypes and
//! devices are already consistent, so backends only check what depends on their own state
//! (capacity, handle/buffer agreement).

pub mod cpu;
pub mod internode;
#[cfg(feature = "nccl")]
pub mod peer;

use crate::config::{low_latency_rdma_size_hint, Config, LowLatencyLayout};
use crate::error::{Error, Result};
use crate::tensor::{Device, TensorRef};

/// Which transport a buffer uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Host shared memory between processes of one machine (development, CI, reference).
    Cpu,
    /// NCCL device API (LSA over NVLink, GIN over RDMA). Default on CUDA devices.
    Nccl,
    /// NVSHMEM symmetric memory (intranode: peer pointers from `nvshmem_ptr`), running the
    /// same kernels as `Nccl` (cargo feature `nvshmem`).
    Nvshmem,
    /// CUDA-IPC memory (`cudaMalloc` + `cudaIpcOpenMemHandle`, no NCCL), running the same kernels
    /// as `Nccl`; several ranks may share one GPU (cargo feature `ipc`).
    Ipc,
}

impl BackendKind {
    /// Name used in `DEEP_EP_BACKEND` and messages.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Nccl => "nccl",
            BackendKind::Nvshmem => "nvshmem",
            BackendKind::Ipc => "ipc",
        }
    }

    /// Chooses the backend: an explicit non-empty `requested` name wins, then the
    /// `DEEP_EP_BACKEND` environment variable, then the device's default (CPU tensors: `cpu`,
    /// CUDA tensors: `nccl`). A CPU device always uses the CPU backend.
    pub fn select(op: &'static str, requested: &str, device: Device) -> Result<BackendKind> {
        Self::select_from(op, requested, &std::env::var("DEEP_EP_BACKEND").unwrap_or_default(), device)
    }

    /// [`Self::select`] with the value of `DEEP_EP_BACKEND` given (`""` = unset).
    pub fn select_from(op: &'static str, requested: &str, env: &str, device: Device) -> Result<BackendKind> {
        let name = if !requested.is_empty() { requested } else { env };
        let kind = match name {
            "" => match device {
                Device::Cpu => BackendKind::Cpu,
                Device::Cuda(_) => BackendKind::Nccl,
            },
            "cpu" => BackendKind::Cpu,
            "nccl" => BackendKind::Nccl,
            "nvshmem" => BackendKind::Nvshmem,
            "ipc" => BackendKind::Ipc,
            other => return Err(Error::invalid(op, format!("unknown backend '{other}' (expected cpu, nccl, nvshmem or ipc)"))),
        };
        match (kind, device) {
            (BackendKind::Cpu, _) | (_, Device::Cuda(_)) => Ok(kind),
            // An explicit request that cannot be honoured is an error; the environment
            // variable only sets a preference for GPU buffers.
            (_, Device::Cpu) if !requested.is_empty() => {
                Err(Error::invalid(op, format!("backend '{}' needs a CUDA device; CPU buffers use the cpu backend", kind.name())))
            }
            (_, Device::Cpu) => Ok(BackendKind::Cpu),
        }
    }
}

/// Static facts about a buffer, fixed at creation.
#[derive(Clone, Debug)]
pub struct BufferInfo {
    pub rank: usize,
    pub num_ranks: usize,
    pub device: Device,
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    pub backend: BackendKind,
    /// Ranks per NVLink domain (`DEEP_EP_NVL_DOMAIN_SIZE` at creation, default 8).
    pub nvl_domain_size: usize,
}

impl BufferInfo {
    /// The facts `create_buffer` fixes, for a buffer on `backend`.
    pub fn from_args(a: &CreateArgs, backend: BackendKind) -> Self {
        BufferInfo {
            rank: a.rank,
            num_ranks: a.num_ranks,
            device: a.device,
            num_nvl_bytes: a.num_nvl_bytes,
            num_rdma_bytes: a.num_rdma_bytes,
            low_latency_mode: a.low_latency_mode,
            backend,
            nvl_domain_size: crate::topology::nvl_domain_size().unwrap_or(crate::topology::DEFAULT_NVL_DOMAIN_SIZE),
        }
    }
}

/// Arguments of `create_buffer` (collective over `num_ranks` processes).
pub struct CreateArgs<'a> {
    /// Rendezvous id produced by one rank's `get_unique_id` and shared by the caller.
    pub unique_id: &'a [u8],
    pub rank: usize,
    pub num_ranks: usize,
    pub device: Device,
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
}

pub use crate::tensor::Stream;

/// Normal-mode dispatch inputs (non-cached). Shapes: N tokens, H hidden, S scales, K top-k,
/// R ranks, E experts.
pub struct DispatchArgs {
    /// `[N, H]` bf16, or float8_e4m3fn with `x_scales`.
    pub x: TensorRef,
    /// `[N, S]` float32 or int32 (packed UE8M0), any strides; only with FP8 `x`.
    pub x_scales: Option<TensorRef>,
    /// `[N, K]` int32 or int64, global expert ids, −1 = none.
    pub topk_idx: Option<TensorRef>,
    /// `[N, K]` float32; present iff `topk_idx` is.
    pub topk_weights: Option<TensorRef>,
    /// `[R]` int32 from `get_dispatch_layout`.
    pub num_tokens_per_rank: TensorRef,
    /// `[N, R]` bool.
    pub is_token_in_rank: TensorRef,
    /// `[E]` int32.
    pub num_tokens_per_expert: TensorRef,
    pub num_experts: usize,
    pub expert_alignment: usize,
    /// 0: exact receive count (host sync); > 0: this many output rows, no host sync.
    pub num_worst_tokens: usize,
    pub config: Config,
    pub stream: Stream,
}

/// What the first (notify) half of a dispatch learned: the output sizes.
#[derive(Clone, Debug, Default)]
pub struct DispatchPlan {
    /// Real number of received tokens (rows of `recv_x` before worst-case padding).
    pub num_recv_tokens: usize,
    /// Rows to allocate: `num_recv_tokens`, or `num_worst_tokens` in worst-case mode.
    pub num_rows: usize,
    /// Per local expert, received (token, expert) selections rounded up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<i32>,
}

/// Dispatch outputs, allocated by the caller from the [`DispatchPlan`]. Rows = `plan.num_rows`,
/// C = `config.num_sms / 2` channels.
pub struct DispatchOutputs {
    /// `[rows, H]`, dtype of `x`.
    pub recv_x: TensorRef,
    /// `[rows, S]` contiguous, dtype of `x_scales`.
    pub recv_x_scales: Option<TensorRef>,
    /// `[rows, K]`, dtype of `topk_idx`: rank-local expert ids or −1.
    pub recv_topk_idx: Option<TensorRef>,
    /// `[rows, K]` float32 (0 where the id is −1).
    pub recv_topk_weights: Option<TensorRef>,
    /// `[R, R]` int32: `m[s][d]` = Σ_{s' ≤ s} tokens rank s' sends to rank d (every column valid).
    pub rank_prefix_matrix: TensorRef,
    /// `[R, C]` int32, sender side: inclusive prefix over channels of tokens sent to rank d.
    pub channel_prefix_matrix: TensorRef,
    /// `[R, C]` int32, receiver side: start of channel c inside the block received from s.
    pub recv_channel_prefix_matrix: TensorRef,
    /// `[rows]` int32: index of each received token in its source rank's `x` (−1 in padding).
    pub recv_src_idx: TensorRef,
    /// `[N, R]` int32: slot of token n in the (channel, rank d) queue, −1 if not sent to d.
    pub send_head: TensorRef,
}

/// The routing state of a dispatch (DeepEP's intranode handle), as tensors.
pub struct Handle {
    pub rank_prefix_matrix: TensorRef,
    pub channel_prefix_matrix: TensorRef,
    pub recv_channel_prefix_matrix: TensorRef,
    pub recv_src_idx: TensorRef,
    pub is_token_in_rank: TensorRef,
    pub send_head: TensorRef,
}

/// Dispatch that reuses a handle: no layout, no host sync; rows = `recv_src_idx.len()`.
pub struct CachedDispatchArgs {
    pub x: TensorRef,
    pub x_scales: Option<TensorRef>,
    pub handle: Handle,
    pub config: Config,
    pub stream: Stream,
}

/// Normal-mode combine: `x` rows in dispatch receive order are sent back and summed.
pub struct CombineArgs {
    /// `[rows, H]` bf16.
    pub x: TensorRef,
    /// `[rows, K]` float32, summed back like `x` (not applied).
    pub topk_weights: Option<TensorRef>,
    /// `[N, H]` bf16, added first (fp32).
    pub bias_0: Option<TensorRef>,
    pub bias_1: Option<TensorRef>,
    pub handle: Handle,
    pub config: Config,
    pub stream: Stream,
}

/// Combine outputs: `combined_x [N, H]` bf16, `combined_topk_weights [N, K]` float32.
pub struct CombineOutputs {
    pub combined_x: TensorRef,
    pub combined_topk_weights: Option<TensorRef>,
}

/// Static geometry shared by the low-latency ops of one call.
#[derive(Copy, Clone, Debug)]
pub struct LlGeometry {
    /// T: most tokens any rank dispatches in one call.
    pub num_max_dispatch_tokens_per_rank: usize,
    pub hidden: usize,
    pub num_experts: usize,
}

/// Length of the `recv_state` int64 tensor that carries a split LL call from its send op to its
/// recv op (buffer half, sequence number, two reserved words).
pub const LL_STATE_LEN: usize = 4;

/// Most tokens per rank in one low-latency call, on every backend: receive counts travel as
/// `count + 1` in 16 bits.
pub const LL_MAX_TOKENS: usize = 0xfffe;

impl LlGeometry {
    /// The checks every backend makes before it touches its low-latency area: LL mode, experts a
    /// multiple of the rank count, hidden a multiple of 128, T within [`LL_MAX_TOKENS`], and the
    /// area (both halves) within `num_rdma_bytes`. Returns the area's layout.
    pub fn check_buffer(&self, op: &'static str, info: &BufferInfo) -> Result<LowLatencyLayout> {
        let (r, e, t, h) = (info.num_ranks, self.num_experts, self.num_max_dispatch_tokens_per_rank, self.hidden);
        crate::ensure!(info.low_latency_mode, op, "the buffer was not created with low_latency_mode=True");
        crate::ensure!(e > 0 && e % r == 0, op, "num_experts ({e}) must be a positive multiple of num_ranks ({r})");
        crate::ensure!(h > 0 && h % 128 == 0, op, "hidden ({h}) must be a positive multiple of 128");
        crate::ensure!((1..=LL_MAX_TOKENS).contains(&t), op, "num_max_dispatch_tokens_per_rank ({t}) must be in 1..={LL_MAX_TOKENS}");
        let lay = LowLatencyLayout::new(t, h, e);
        let need = lay.total_bytes();
        crate::ensure!(
            info.num_rdma_bytes >= need,
            op,
            "num_rdma_bytes = {} is too small for num_max_dispatch_tokens_per_rank={t}, hidden={h}, num_experts={e}: the low-latency buffer needs {need} bytes (get_low_latency_rdma_size_hint gives {})",
            info.num_rdma_bytes,
            low_latency_rdma_size_hint(t, h, r, e)
        );
        Ok(lay)
    }
}

/// Bytes of a deduplicated dispatch message before its payload (`DEK_LL_MSG_META`): header
/// `[src token, H, T, E]` i32, `[entries, has weights, 0, 0]` i32, [`LL_WIRE_MAX_TOPK`] u32
/// entries `local expert << 16 | expert slot` (top-k order) and as many f32 weights.
pub const LL_MSG_META: usize = 160;
/// Most top-k entries of a deduplicated message (`DEK_LL_MAX_TOPK`).
pub const LL_WIRE_MAX_TOPK: usize = 16;

/// Byte layout of the deduplicated low-latency wire format inside one receive half, the same on
/// both backends: `[message counts: R u32, 128 B][index table [E_l][R][T] u32][messages [R][T]]
/// [partial combine rows [R][T] of H bf16]`. A message goes once per (token, destination rank);
/// index entry `[l][s][slot]` names the message of source `s` that row `slot` of `(l, s)` comes
/// from. The per-expert combine rows (`[E][T]` slots) overlay it all from offset 0, while the
/// partial rows lie after the messages so that a combine can read its dispatch's messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LlWire {
    pub idx_off: usize,
    pub msgs_off: usize,
    pub msg_bytes: usize,
    pub partial_off: usize,
    /// Whether the partial combine rows fit in the half as well.
    pub partial_fits: bool,
}

impl LlWire {
    /// Offset of the message count of source `s`.
    pub fn count_off(s: usize) -> usize {
        4 * s
    }
}

/// A backend's record of the last dispatch of each LL half: (address of its `src_info` output,
/// whether it carried top-k weights in the deduplicated format, its number).
pub type LlDispatchRecord = Option<(usize, bool, u64)>;

/// The half whose dispatch a combine given `src_info` at `ptr` belongs to, when that dispatch
/// carried top-k weights (the combine then sends partial sums): the latest recorded dispatch with
/// this `src_info` address decides, so a freed and reused address of an older one never matches.
pub fn ll_weighted_dispatch_half(records: &[LlDispatchRecord; 2], ptr: usize) -> Option<usize> {
    (0..2).filter_map(|h| records[h].filter(|r| r.0 == ptr).map(|r| (r.2, r.1, h))).max().filter(|r| r.1).map(|r| r.2)
}

/// Bytes of the message counts (`LlWire::count_off`, one u32 per source rank) before the index
/// table: 128 up to 32 ranks (every GPU layout today), then 4 bytes per rank in 128-byte steps
/// (at 64 ranks the counts of ranks 32.. overwrote the index table: found by the 64-rank CPU test).
fn ll_wire_counts_bytes(num_ranks: usize) -> usize {
    (4 * num_ranks).div_ceil(128).max(1) * 128
}

impl LlGeometry {
    /// The deduplicated wire layout for `num_ranks` ranks, or `None` when it does not fit in
    /// DeepEP's receive half (few experts per rank with a small hidden, e.g. one per rank at 128).
    pub fn wire(&self, num_ranks: usize) -> Option<LlWire> {
        let (r, e, t, h) = (num_ranks, self.num_experts, self.num_max_dispatch_tokens_per_rank, self.hidden);
        let lay = LowLatencyLayout::new(t, h, e);
        let align = |v: usize| v.div_ceil(crate::config::BUFFER_ALIGNMENT) * crate::config::BUFFER_ALIGNMENT;
        let msg_bytes = (LL_MSG_META + (2 * h).max(h + h / 128 * 4)).div_ceil(16) * 16;
        let idx_off = ll_wire_counts_bytes(r);
        let msgs_off = idx_off + align(4 * e * t);
        let partial_off = align(msgs_off + r * t * msg_bytes);
        (msgs_off + r * t * msg_bytes <= lay.recv_bytes).then_some(LlWire {
            idx_off,
            msgs_off,
            msg_bytes,
            partial_off,
            partial_fits: partial_off + r * t * 2 * h <= lay.recv_bytes,
        })
    }
}

/// Low-latency dispatch options.
#[derive(Copy, Clone, Debug)]
pub struct LlDispatchOptions {
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
}

impl LlDispatchOptions {
    /// The options as the flag bits a send records in `recv_state` and its receive checks
    /// (fp8 = 1, round_scale = 2, use_ue8m0 = 4).
    pub fn flags(&self) -> i64 {
        self.use_fp8 as i64 | (self.round_scale as i64) << 1 | (self.use_ue8m0 as i64) << 2
    }
}

/// Low-latency dispatch send-phase inputs.
pub struct LlDispatchSendArgs {
    /// `[N, H]` bf16, N ≤ T.
    pub x: TensorRef,
    /// `[N, K]` int32 or int64, global expert ids, −1 = none.
    pub topk_idx: TensorRef,
    /// `[N, K]` float32, optional (lets a backend reduce combine traffic; not required).
    pub topk_weights: Option<TensorRef>,
}

/// Low-latency dispatch outputs (static shapes; E_l = E / R). Allocated by the send op,
/// filled by the recv op.
pub struct LlDispatchOutputs {
    /// `[E_l, R*T, H]` bf16, or float8_e4m3fn with scales.
    pub recv_x: TensorRef,
    /// float32 `[E_l, R*T, H/128]` or int32 `[E_l, R*T, H/512]` (UE8M0), column-major in the
    /// last two dims (token stride 1).
    pub recv_x_scales: Option<TensorRef>,
    /// `[E_l]` int32 valid rows per local expert.
    pub recv_count: TensorRef,
    /// `[E_l, R*T]` int32: source token index of each row.
    pub src_info: TensorRef,
    /// `[E_l, R]` int64: `(begin << 32) | count` per source rank.
    pub layout_range: TensorRef,
    /// `[LL_STATE_LEN]` int64, written by send, read by recv.
    pub recv_state: TensorRef,
}

/// Monitoring tensors the LL recv phases add to (mutated in place).
pub struct LlStats {
    /// `[E_l]` int32: += received tokens per local expert (dispatch only).
    pub cumulative_local_expert_recv_stats: Option<TensorRef>,
    /// `[R]` int64: += time waited per source rank (ns on CPU, cycles on GPU).
    pub wait_recv_cost_stats: Option<TensorRef>,
}

/// Low-latency combine send-phase inputs.
pub struct LlCombineSendArgs {
    /// `[E_l, R*T, H]` bf16 expert outputs in dispatch layout (ignored with `zero_copy`).
    pub x: TensorRef,
    pub src_info: TensorRef,
    pub layout_range: TensorRef,
    pub use_logfmt: bool,
    /// The caller already wrote `x` into `next_low_latency_combine_buffer`.
    pub zero_copy: bool,
    /// `[LL_STATE_LEN]` int64, written here.
    pub recv_state: TensorRef,
}

/// Inputs of [`Backend::ll_mask_rows`]: the real token count of an LL call as a device scalar.
pub struct LlRowsArgs {
    /// `[N, K]` int32 or int64 global expert ids (the caller's, read only).
    pub topk_idx: TensorRef,
    /// int32 `[]` or `[1]` on the buffer's device: the number `n` of real rows, `0 ≤ n ≤ N`.
    pub num_tokens: TensorRef,
    /// `[N, K]`, dtype of `topk_idx`, written: rows `< n` copied, rows `≥ n` all −1.
    pub out: TensorRef,
}

/// Low-latency combine recv-phase inputs; `out [N, H]` bf16 is written.
pub struct LlCombineRecvArgs {
    /// `[N, K]` int32 or int64: this rank's original global expert ids.
    pub topk_idx: TensorRef,
    /// `[N, K]` float32.
    pub topk_weights: TensorRef,
    pub recv_state: TensorRef,
    pub out: TensorRef,
}

/// A transport for one buffer. Every method is collective unless noted: all ranks of the buffer
/// call it in the same order. CUDA backends launch on `stream` and return without host sync
/// unless noted; the CPU backend completes before returning.
pub trait Backend: Send {
    /// Static facts of this buffer.
    fn info(&self) -> &BufferInfo;

    /// First half of a dispatch: exchange counts, learn output sizes (host sync unless
    /// `num_worst_tokens > 0`).
    fn dispatch_prepare(&mut self, args: &DispatchArgs) -> Result<DispatchPlan>;

    /// Second half: move tokens into the caller-allocated outputs.
    fn dispatch_finish(&mut self, args: &DispatchArgs, plan: &DispatchPlan, out: &DispatchOutputs) -> Result<()>;

    /// Dispatch with a handle from an earlier dispatch: `recv_x [rows, H]`, scales `[rows, S]`.
    fn cached_dispatch(&mut self, args: &CachedDispatchArgs, recv_x: &TensorRef, recv_x_scales: Option<&TensorRef>) -> Result<()>;

    /// Normal-mode combine (unweighted fp32 sum, ascending rank order, bias first).
    fn combine(&mut self, args: &CombineArgs, out: &CombineOutputs) -> Result<()>;

    /// First half of an internode dispatch (ranks span several NVLink domains): output sizes.
    /// Backends without internode normal mode answer `NotImplemented`.
    fn internode_dispatch_prepare(&mut self, _args: &internode::InternodeDispatchArgs) -> Result<internode::InternodePlan> {
        Err(self.no_internode(crate::op_names::INTERNODE_DISPATCH))
    }

    /// Second half of an internode dispatch: tokens and the 10-tensor handle.
    fn internode_dispatch_finish(
        &mut self,
        _args: &internode::InternodeDispatchArgs,
        _plan: &internode::InternodePlan,
        _out: &internode::InternodeDispatchOutputs,
    ) -> Result<()> {
        Err(self.no_internode(crate::op_names::INTERNODE_DISPATCH))
    }

    /// Internode dispatch reusing a handle: `recv_x [rows, H]`, scales `[rows, S]`.
    fn internode_cached_dispatch(
        &mut self,
        _args: &internode::InternodeCachedDispatchArgs,
        _recv_x: &TensorRef,
        _recv_x_scales: Option<&TensorRef>,
    ) -> Result<()> {
        Err(self.no_internode(crate::op_names::INTERNODE_CACHED_DISPATCH))
    }

    /// Internode combine (two-level reduction, see [`internode::InternodeCombineArgs`]).
    fn internode_combine(&mut self, _args: &internode::InternodeCombineArgs, _out: &CombineOutputs) -> Result<()> {
        Err(self.no_internode(crate::op_names::INTERNODE_COMBINE))
    }

    /// The error of a backend that lacks internode normal mode.
    fn no_internode(&self, op: &'static str) -> Error {
        Error::NotImplemented {
            op,
            backend: self.info().backend.name(),
            feature: "internode normal mode (dispatch/combine across NVLink domains)",
        }
    }

    /// LL dispatch, send phase: cast and push tokens; writes `out.recv_state`.
    fn ll_dispatch_send(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        args: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        stream: Stream,
    ) -> Result<()>;

    /// LL dispatch, recv phase: wait for every source and fill `out`.
    fn ll_dispatch_recv(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        out: &LlDispatchOutputs,
        stats: &LlStats,
        stream: Stream,
    ) -> Result<()>;

    /// LL combine, send phase: push expert outputs back to their source ranks.
    fn ll_combine_send(&mut self, g: &LlGeometry, args: &LlCombineSendArgs, stream: Stream) -> Result<()>;

    /// LL combine, recv phase: wait and reduce Σ_k w_k·y_k in fp32 into `out`.
    fn ll_combine_recv(&mut self, g: &LlGeometry, args: &LlCombineRecvArgs, stats: &LlStats, stream: Stream) -> Result<()>;

    /// Local, not collective: writes `args.out` = `args.topk_idx` with the rows at or past the
    /// device scalar `args.num_tokens` set to −1 (not routed), so that one static-shape LL call
    /// (one captured CUDA graph) serves any real batch `n ≤ N`. CUDA backends launch on `stream`
    /// without host sync and clamp `n` to `0..=N` on the device (an out-of-range value cannot be
    /// reported without a sync); the CPU backend reads `n` and raises when it is out of range.
    fn ll_mask_rows(&mut self, op: &'static str, args: &LlRowsArgs, stream: Stream) -> Result<()>;

    /// Zeroes both halves' LL signal areas (barriers before and after).
    fn clean_low_latency_buffer(&mut self, g: &LlGeometry, stream: Stream) -> Result<()>;

    /// The send buffer the next LL combine reads with `zero_copy` (not collective): a bf16
    /// view `[E_l, R*T, H]` with strides `(R*T*M, M, 1)`, `M = H + H/128*2`.
    fn next_low_latency_combine_buffer(&mut self, g: &LlGeometry) -> Result<TensorRef>;

    /// Releases the buffer (collective: barriers so no peer still reads it).
    fn destroy(&mut self) -> Result<()>;

    /// Rank masking of low-latency mode (DeepEP's `low_latency_update_mask_buffer`), local:
    /// marks `rank` (already range-checked) dead (`masked`) or alive. LL ops of this rank then
    /// neither send to nor wait for a masked rank, and the experts it owns are dropped: tokens
    /// routed to them are not sent and contribute zero to the combine. Takes effect at the next
    /// LL op (on CUDA: at the next kernel launch or graph replay, the mask lives in host-mapped
    /// memory). Normal-mode ops ignore the mask.
    fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()>;

    /// The mask of every rank (`true` = masked), local.
    fn ll_mask(&self) -> Vec<bool>;

    /// Unmasks every rank (DeepEP's `low_latency_clean_mask_buffer`), local.
    fn ll_clean_mask(&mut self) -> Result<()>;

    /// Shrink mode (DeepEP's `enable_shrink`), local: when on, an LL wait (or an LL barrier)
    /// that times out masks the ranks that did not arrive and goes on instead of raising.
    fn ll_set_shrink(&mut self, enable: bool) -> Result<()>;

    /// Per-peer host wait statistics since creation or the last reset, local: for each rank
    /// `p`, `[waits, nanoseconds]` = how many host-side waits of this rank included `p` and the
    /// total time spent until `p` arrived (the own row stays zero). Backends whose waits run on the GPU answer
    /// [`Error::NotImplemented`].
    fn wait_stats(&mut self, reset: bool) -> Result<Vec<[i64; 2]>>;
}

/// Creates the backend `kind` for `args`.
pub fn create(kind: BackendKind, args: &CreateArgs) -> Result<Box<dyn Backend>> {
    #[allow(dead_code)] // used by the arms of backends that are not compiled in
    const OP: &str = crate::op_names::CREATE_BUFFER;
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::create(args)?)),
        #[cfg(feature = "nccl")]
        BackendKind::Nccl => Ok(Box::new(peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "nccl"))]
        BackendKind::Nccl => Err(Error::NotCompiled { op: OP, backend: "nccl".into(), feature: "nccl" }),
        #[cfg(feature = "nvshmem")]
        BackendKind::Nvshmem => Ok(Box::new(peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "nvshmem"))]
        BackendKind::Nvshmem => Err(Error::NotCompiled { op: OP, backend: "nvshmem".into(), feature: "nvshmem" }),
        #[cfg(feature = "ipc")]
        BackendKind::Ipc => Ok(Box::new(peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "ipc"))]
        BackendKind::Ipc => Err(Error::NotCompiled { op: OP, backend: "ipc".into(), feature: "ipc" }),
    }
}

/// A fresh rendezvous id for `kind` (called on one rank, shared by the caller).
pub fn unique_id(kind: BackendKind) -> Result<Vec<u8>> {
    match kind {
        BackendKind::Cpu => Ok(cpu::CpuBackend::unique_id()),
        #[cfg(feature = "nccl")]
        BackendKind::Nccl => peer::PeerBackend::unique_id(kind),
        #[cfg(not(feature = "nccl"))]
        BackendKind::Nccl => Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "nccl".into(), feature: "nccl" }),
        #[cfg(feature = "nvshmem")]
        BackendKind::Nvshmem => peer::PeerBackend::unique_id(kind),
        #[cfg(not(feature = "nvshmem"))]
        BackendKind::Nvshmem => {
            Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "nvshmem".into(), feature: "nvshmem" })
        }
        #[cfg(feature = "ipc")]
        BackendKind::Ipc => Ok(crate::window::ipc::unique_id()),
        #[cfg(not(feature = "ipc"))]
        BackendKind::Ipc => Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "ipc".into(), feature: "ipc" }),
    }
}

pub use crate::config::UNIQUE_ID_BYTES;

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(requested: &str, env: &str, device: Device) -> std::result::Result<&'static str, String> {
        BackendKind::select_from("op", requested, env, device).map(BackendKind::name).map_err(|e| e.to_string())
    }

    #[test]
    fn selection_by_argument_then_environment_then_device() {
        let gpu = Device::Cuda(0);
        assert_eq!(sel("", "", gpu), Ok("nccl"));
        assert_eq!(sel("", "", Device::Cpu), Ok("cpu"));
        assert_eq!(sel("", "nvshmem", gpu), Ok("nvshmem"));
        assert_eq!(sel("nccl", "nvshmem", gpu), Ok("nccl"));
        assert_eq!(sel("nvshmem", "", gpu), Ok("nvshmem"));
        // The variable is only a preference for GPU buffers; an explicit request must be honoured.
        assert_eq!(sel("", "nvshmem", Device::Cpu), Ok("cpu"));
        let e = sel("nvshmem", "", Device::Cpu).unwrap_err();
        assert_eq!(e, "op: backend 'nvshmem' needs a CUDA device; CPU buffers use the cpu backend");
        let e = sel("", "shmem", gpu).unwrap_err();
        assert!(e.contains("unknown backend 'shmem' (expected cpu, nccl, nvshmem or ipc)"), "{e}");
    }

    #[test]
    fn nvshmem_backend_is_compiled_or_says_which_feature() {
        let args = CreateArgs {
            unique_id: &[0u8; 128],
            rank: 0,
            num_ranks: 2,
            device: Device::Cpu,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
        };
        let e = create(BackendKind::Nvshmem, &args).err().map(|e| e.to_string()).unwrap_or_default();
        if cfg!(feature = "nvshmem") {
            assert!(e.contains("the nvshmem backend needs a CUDA device, got cpu"), "{e}");
        } else {
            assert!(e.contains("backend 'nvshmem' is not compiled into this library (cargo feature 'nvshmem')"), "{e}");
        }
    }

    #[test]
    fn the_latest_dispatch_with_an_address_decides_partial_combines() {
        let rec: [LlDispatchRecord; 2] = [Some((0x1000, true, 1)), Some((0x2000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x1000), Some(0));
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x2000), None);
        assert_eq!(ll_weighted_dispatch_half(&rec, 0x3000), None);
        // A freed src_info address reused by a later unweighted dispatch: no partial sums.
        let reused: [LlDispatchRecord; 2] = [Some((0x1000, true, 1)), Some((0x1000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&reused, 0x1000), None);
        let both: [LlDispatchRecord; 2] = [Some((0x1000, true, 3)), Some((0x1000, false, 2))];
        assert_eq!(ll_weighted_dispatch_half(&both, 0x1000), Some(0));
    }

    #[test]
    fn wire_layout_fits_deepeps_receive_half() {
        let g = |t, h, e| LlGeometry { num_max_dispatch_tokens_per_rank: t, hidden: h, num_experts: e };
        // DeepEP's shape: message stride 160 + 2 * 7168 (an FP8 message writes 160 + 7168 + 224
        // of it), partial rows after them.
        let w = g(128, 7168, 288).wire(4).unwrap();
        assert_eq!((w.idx_off, w.msg_bytes), (128, 14_496));
        assert_eq!(w.msgs_off, 128 + 4 * 288 * 128);
        assert!(w.partial_fits && w.partial_off >= w.msgs_off + 4 * 128 * w.msg_bytes && w.partial_off % 128 == 0);
        // Small hidden: one expert per rank leaves no room for the messages, two no room for
        // the partial rows (the combine then sends per-expert rows); at 7168 one expert fits.
        assert!(g(128, 128, 8).wire(8).is_none());
        assert!(!g(128, 128, 16).wire(8).unwrap().partial_fits);
        assert!(!g(128, 7168, 8).wire(8).unwrap().partial_fits);
        assert!(g(128, 7168, 24).wire(8).unwrap().partial_fits);
    }
}
