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

use super::normal::{CachedDispatchArgs, CombineArgs, DispatchArgs};
use crate::tensor::TensorRef;

pub use crate::op_io::{InternodeDispatchOutputs, InternodeHandle, InternodePlan};

/// Columns of `send_nvl_head` and bits of `SourceMeta::is_token_in_nvl_rank_bits`: DeepEP's
/// `NUM_MAX_NVL_PEERS`, whatever the NVLink-domain size (columns at or past `D` hold −1).
pub const NVL_HEAD_COLUMNS: usize = crate::config::MAX_NVL_PEERS;
/// Bytes of one `SourceMeta {int32 src_rdma_rank; int32 is_token_in_nvl_rank_bits}` row.
pub const SOURCE_META_BYTES: usize = 8;

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
