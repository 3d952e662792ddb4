//! The values an op hands between layers unchanged: the tensor groups of the op schemas (routing
//! handles, outputs, statistics) and the output sizes the first half of a dispatch learns. The C
//! surface (`api`) and `host` fill them, `ops` checks them, backends read and write them. Argument
//! structs that carry checked scalars (`Config`, geometry, options, the stream) are backend types
//! that `ops` alone builds (`backend::normal`, `backend::low_latency`, `backend::internode`).

use crate::tensor::TensorRef;

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

/// Combine outputs: `combined_x [N, H]` bf16, `combined_topk_weights [N, K]` float32.
pub struct CombineOutputs {
    pub combined_x: TensorRef,
    pub combined_topk_weights: Option<TensorRef>,
}

/// DeepEP's 10-tensor internode handle (all int32 unless noted, all on the buffer's device).
pub struct InternodeHandle {
    /// `[N, R]` bool: the dispatch's input.
    pub is_token_in_rank: TensorRef,
    /// `[Rr, C]` sender side: inclusive prefix over channels of this rank's tokens that go to
    /// ≥ 1 rank of domain j.
    pub rdma_channel_prefix_matrix: TensorRef,
    /// `[R, C]` sender side: inclusive prefix over channels of this rank's tokens to rank d.
    pub gbl_channel_prefix_matrix: TensorRef,
    /// `[Rr, C]` RDMA receiver: inclusive prefix over channels of the tokens the rail rank of
    /// domain i sends to this rank's domain (its `rdma_channel_prefix_matrix[my domain]`).
    pub recv_rdma_channel_prefix_matrix: TensorRef,
    /// `[Rr]`: inclusive prefix over source domains of the RDMA-leg tokens (total = rdma rows).
    pub recv_rdma_rank_prefix_sum: TensorRef,
    /// `[R, C]` receiver: first output row of the tokens from rank s in channel c (absolute:
    /// `recv_gbl_rank_prefix_sum[s-1]` + the channels before c).
    pub recv_gbl_channel_prefix_matrix: TensorRef,
    /// `[R]`: inclusive prefix over source ranks of the tokens this rank receives.
    pub recv_gbl_rank_prefix_sum: TensorRef,
    /// `[rows, 8]` uint8: per received row, `SourceMeta{src_rdma_rank, is_token_in_nvl_rank_bits}`
    /// (little-endian int32 pair; the bits name the ranks of this domain the token went to).
    pub recv_src_meta: TensorRef,
    /// `[N, Rr]`: per (token, domain j) the token's slot in the (channel, j) RDMA queue (a
    /// counter from 0 per channel), −1 if it does not go to domain j.
    pub send_rdma_head: TensorRef,
    /// `[rdma_rows, 8]`: per RDMA-leg token and local rank l, its slot in the (channel, source
    /// domain, l) NVLink queue (a counter from 0 per channel and source domain), −1 if the token
    /// does not go to l.
    pub send_nvl_head: TensorRef,
}

/// What the first half of an internode dispatch learned.
#[derive(Clone, Debug, Default)]
pub struct InternodePlan {
    /// Output rows of `recv_x` and the token counts per local expert, as in intranode.
    pub plan: DispatchPlan,
    /// Real RDMA-leg tokens.
    pub num_rdma_recv_tokens: usize,
    /// Rows of `send_nvl_head`: the real count, or `num_worst_tokens` when > 0.
    pub num_rdma_rows: usize,
}

/// Outputs of a non-cached internode dispatch (allocated from the [`InternodePlan`]).
pub struct InternodeDispatchOutputs {
    /// `[rows, H]`, dtype of `x`.
    pub recv_x: TensorRef,
    /// `[rows, S]` contiguous, dtype of `x_scales`.
    pub recv_x_scales: Option<TensorRef>,
    /// `[rows, K]`, dtype of `topk_idx`: rank-local expert ids or −1.
    pub recv_topk_idx: Option<TensorRef>,
    /// `[rows, K]` float32 (0 where the id is −1).
    pub recv_topk_weights: Option<TensorRef>,
    /// The handle being made: every tensor but `is_token_in_rank` (the dispatch's input, not
    /// written) is an output.
    pub handle: InternodeHandle,
}

/// Low-latency dispatch outputs (static shapes; E_l = E / R). Allocated by the send op,
/// filled by the recv op.
#[derive(Clone, Copy)]
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
    /// `[LL_STATE_LEN]` (4) int64, written by send, read by recv. `None` only in a whole
    /// dispatch: the backend's own (`LowLatencyMode::ll_own_state`) where it needs one.
    pub recv_state: Option<TensorRef>,
}

/// Monitoring tensors the LL recv phases add to (mutated in place).
pub struct LlStats {
    /// `[E_l]` int32: += received tokens per local expert (dispatch only).
    pub cumulative_local_expert_recv_stats: Option<TensorRef>,
    /// `[R]` int64: += time waited per source rank (ns on CPU, cycles on GPU).
    pub wait_recv_cost_stats: Option<TensorRef>,
}
