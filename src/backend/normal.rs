//! Argument and output types of the normal-mode (high-throughput) backend calls: dispatch,
//! cached dispatch and combine, and the handle tensors between them.

use crate::config::Config;
use crate::tensor::{Stream, TensorRef};

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

/// Combine outputs: `combined_x [N, H]` bf16, `combined_topk_weights [N, K]` float32.
pub struct CombineOutputs {
    pub combined_x: TensorRef,
    pub combined_topk_weights: Option<TensorRef>,
}
