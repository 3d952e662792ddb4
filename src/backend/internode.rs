//! Types of the internode normal-mode ops (DeepEP's `internode_dispatch` / `internode_combine`):
//! ranks span several NVLink domains of `D` ranks (`DEEP_EP_NVL_DOMAIN_SIZE`); a token travels
//! once per destination domain to the rank of the same local index there (the "RDMA" leg), which
//! forwards it to the local ranks that need it (the NVLink leg).
//!
//! Shapes: N tokens on this rank, R ranks, Rr = R / D domains ("RDMA ranks"), C = `num_sms / 2`
//! channels (token n is in channel `c` of [`crate::layout::channel_range`]), rows = tokens this
//! rank receives, rdma_rows = tokens this rank receives on the RDMA leg (from the ranks of its
//! rail, one per domain, for any rank of its domain).
//!
//! Receive order (deterministic, as DeepEP's NVL receivers place rows): by global source rank,
//! then source token index (channels are contiguous token ranges, so "then channel, then token"
//! is the same order). The RDMA-leg order: by source domain, then source token index.

use super::normal::{CachedDispatchArgs, CombineArgs, DispatchArgs, DispatchPlan};
use crate::tensor::TensorRef;

/// Columns of `send_nvl_head` and bits of `SourceMeta::is_token_in_nvl_rank_bits`: DeepEP's
/// `NUM_MAX_NVL_PEERS`, whatever the NVLink-domain size (columns at or past `D` hold −1).
pub const NVL_HEAD_COLUMNS: usize = crate::config::MAX_NVL_PEERS;
/// Bytes of one `SourceMeta {int32 src_rdma_rank; int32 is_token_in_nvl_rank_bits}` row.
pub const SOURCE_META_BYTES: usize = 8;

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

/// An internode dispatch reusing a handle: rows = `recv_src_meta.size(0)`, no host sync.
pub type InternodeCachedDispatchArgs = CachedDispatchArgs<InternodeHandle>;

/// Internode combine: `x [rows, H]` bf16 in dispatch receive order goes back to the tokens'
/// sources. Result per token n: `bf16(f32(bias_0[n]) + f32(bias_1[n]) + Σ_{domain j ascending}
/// f32(P_j))` with `P_j = bf16(Σ_{local rank l ascending} f32(x_{j·D+l}[row of n]))` (DeepEP's
/// forwarder reduces a domain's rows in fp32 and sends one bf16 partial per domain); top-k
/// weights are summed the same way in fp32 without the bf16 rounding.
pub type InternodeCombineArgs = CombineArgs<InternodeHandle>;

/// The arguments of a non-cached internode dispatch: the intranode ones plus
/// `num_tokens_per_rdma_rank [Rr]` int32.
pub struct InternodeDispatchArgs {
    pub base: DispatchArgs,
    pub num_tokens_per_rdma_rank: TensorRef,
}
