//! Argument and output types of the normal-mode (high-throughput) backend calls: dispatch,
//! cached dispatch and combine, and the handle tensors between them.

use crate::config::Config;
use crate::tensor::{Stream, TensorRef};

pub use crate::op_io::{CombineOutputs, DispatchOutputs, DispatchPlan, Handle};

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

/// Dispatch that reuses a handle: no layout, no host sync; rows = `recv_src_idx.len()` (for the
/// internode handle, `recv_src_meta.size(0)`).
pub struct CachedDispatchArgs<H = Handle> {
    pub x: TensorRef,
    pub x_scales: Option<TensorRef>,
    pub handle: H,
    pub config: Config,
    pub stream: Stream,
}

/// Normal-mode combine: `x` rows in dispatch receive order are sent back and summed.
pub struct CombineArgs<H = Handle> {
    /// `[rows, H]` bf16.
    pub x: TensorRef,
    /// `[rows, K]` float32, summed back like `x` (not applied).
    pub topk_weights: Option<TensorRef>,
    /// `[N, H]` bf16, added first (fp32).
    pub bias_0: Option<TensorRef>,
    pub bias_1: Option<TensorRef>,
    pub handle: H,
    pub config: Config,
    pub stream: Stream,
}
