//! Internode normal-mode ops (DeepEP's `internode_dispatch` / `internode_combine`): validation
//! and backend calls. Shapes and the handle: [`crate::backend::internode`].

use super::normal::{
    cached_args, check_cached_dispatch, check_combine, check_dispatch_args, check_is_token_in_rank, combine_args, CombineInputs,
    DispatchRequest, RoutingHandle,
};
use crate::backend::internode::{InternodeDispatchArgs, NVL_HEAD_COLUMNS, SOURCE_META_BYTES};
use crate::backend::BufferInfo;
use crate::buffer;
use crate::config::Config;
use crate::error::Result;
use crate::op_io::{CombineOutputs, InternodeDispatchOutputs, InternodeHandle, InternodePlan};
use crate::tensor::{DType, Stream, TensorRef};

const DISPATCH: &str = crate::op_names::INTERNODE_DISPATCH;
const CACHED: &str = crate::op_names::INTERNODE_CACHED_DISPATCH;
const COMBINE: &str = crate::op_names::INTERNODE_COMBINE;

/// Number of NVLink domains of `info`'s buffer; errors unless its ranks span more than one.
pub fn num_rdma_ranks(op: &'static str, info: &BufferInfo) -> Result<usize> {
    let (r, d) = (info.num_ranks, info.nvl_domain_size);
    crate::ensure!(
        r > d && r % d == 0,
        op,
        "internode ops need ranks spanning several NVLink domains: num_ranks={r} with DEEP_EP_NVL_DOMAIN_SIZE={d} is one domain (use dispatch/combine, which choose the intranode path)"
    );
    Ok(r / d)
}

/// Checks the 10 handle tensors; returns (N tokens, rows, rdma rows).
fn check_handle(op: &'static str, h: &InternodeHandle, info: &BufferInfo, c: usize) -> Result<(usize, usize, usize)> {
    super::normal::check_normal_memory(op, info)?;
    let (r, dev) = (info.num_ranks, info.device);
    let rr = num_rdma_ranks(op, info)?;
    let i32s = &[DType::Int32];
    let n = check_is_token_in_rank(op, &h.is_token_in_rank, info)?;
    let chan = "(config.num_sms / 2 must equal the dispatch's)";
    for (t, name, rows) in [
        (&h.rdma_channel_prefix_matrix, "rdma_channel_prefix_matrix", rr),
        (&h.gbl_channel_prefix_matrix, "gbl_channel_prefix_matrix", r),
        (&h.recv_rdma_channel_prefix_matrix, "recv_rdma_channel_prefix_matrix", rr),
        (&h.recv_gbl_channel_prefix_matrix, "recv_gbl_channel_prefix_matrix", r),
    ] {
        t.check(op, name).on(i32s, dev)?.done()?;
        crate::ensure!(t.sizes() == [rows as i64, c as i64], op, "{name} must have shape [{rows}, {c}] {chan}, got {:?}", t.sizes());
        t.check(op, name).contiguous()?;
    }
    h.recv_rdma_rank_prefix_sum
        .check(op, "recv_rdma_rank_prefix_sum")
        .on(i32s, dev)?
        .shape(&[("num_rdma_ranks", Some(rr))])?
        .contiguous()?;
    h.recv_gbl_rank_prefix_sum.check(op, "recv_gbl_rank_prefix_sum").on(i32s, dev)?.shape(&[("num_ranks", Some(r))])?.contiguous()?;
    h.recv_src_meta
        .check(op, "recv_src_meta")
        .on(&[DType::UInt8], dev)?
        .shape(&[("num_recv_tokens", None), ("source_meta_bytes", Some(SOURCE_META_BYTES))])?
        .contiguous()?;
    h.send_rdma_head
        .check(op, "send_rdma_head")
        .on(i32s, dev)?
        .shape(&[("num_tokens", Some(n)), ("num_rdma_ranks", Some(rr))])?
        .contiguous()?;
    h.send_nvl_head
        .check(op, "send_nvl_head")
        .on(i32s, dev)?
        .shape(&[("num_rdma_recv_tokens", None), ("nvl_peers", Some(NVL_HEAD_COLUMNS))])?
        .contiguous()?;
    Ok((n, h.recv_src_meta.size(0), h.send_nvl_head.size(0)))
}

impl RoutingHandle for InternodeHandle {
    const OPS: (&'static str, &'static str) = (CACHED, COMBINE);
    fn check(&self, op: &'static str, info: &BufferInfo, config: &Config) -> Result<(usize, usize)> {
        let (n, rows, _) = check_handle(op, self, info, config.num_channels())?;
        Ok((n, rows))
    }
    /// DeepEP's extra asserts: `nvl_recv % num_rdma_ranks == 0`, `nvl_send <= nvl_recv / num_rdma_ranks`.
    fn check_combine_config(&self, op: &'static str, info: &BufferInfo, config: &Config) -> Result<()> {
        let rr = info.num_ranks / info.nvl_domain_size;
        let (send, recv) = (config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens);
        crate::ensure!(recv % rr == 0 && send <= recv / rr, op,
            "config: num_max_nvl_chunked_recv_tokens ({recv}) must be a multiple of the {rr} NVLink domains and num_max_nvl_chunked_send_tokens ({send}) at most {}", recv / rr);
        Ok(())
    }
}

/// The backend's arguments of an internode dispatch: the intranode ones plus
/// `num_tokens_per_rdma_rank [Rr]` int32.
fn dispatch_args(r: &DispatchRequest, num_tokens_per_rdma_rank: TensorRef) -> Result<InternodeDispatchArgs> {
    Ok(InternodeDispatchArgs { base: r.args(DISPATCH)?, num_tokens_per_rdma_rank })
}

/// Validates an internode dispatch and runs its first half (collective; host sync unless
/// `num_worst_tokens > 0`).
pub fn internode_dispatch_prepare(handle: i64, r: &DispatchRequest, num_tokens_per_rdma_rank: TensorRef) -> Result<InternodePlan> {
    let a = dispatch_args(r, num_tokens_per_rdma_rank)?;
    buffer::with(DISPATCH, handle, |b| {
        let info = b.info().clone();
        let rr = num_rdma_ranks(DISPATCH, &info)?;
        check_dispatch_args(DISPATCH, &a.base, &info)?;
        a.num_tokens_per_rdma_rank
            .check(DISPATCH, "num_tokens_per_rdma_rank")
            .on(&[DType::Int32], info.device)?
            .shape(&[("num_rdma_ranks", Some(rr))])?
            .contiguous()?;
        b.internode_dispatch_prepare(&a)
    })
}

/// Second half of an internode dispatch into outputs allocated from `plan` (collective; the
/// per-expert counts of `plan` are not read).
pub fn internode_dispatch_finish(
    handle: i64,
    r: &DispatchRequest,
    num_tokens_per_rdma_rank: TensorRef,
    plan: &InternodePlan,
    o: &InternodeDispatchOutputs,
) -> Result<()> {
    let a = dispatch_args(r, num_tokens_per_rdma_rank)?;
    buffer::with(DISPATCH, handle, |b| b.internode_dispatch_finish(&a, plan, o))
}

/// Internode dispatch reusing a handle (collective, no host sync on GPUs) into `recv`; `recv`
/// absent: only the checks (made before the outputs are allocated).
pub fn internode_cached_dispatch(
    handle: i64,
    x: TensorRef,
    x_scales: Option<TensorRef>,
    h: InternodeHandle,
    config: &[i64],
    stream: Stream,
    recv: Option<(TensorRef, Option<TensorRef>)>,
) -> Result<()> {
    let a = cached_args(CACHED, x, x_scales, h, config, stream)?;
    check_cached_dispatch(handle, &a)?;
    let Some((recv_x, recv_x_scales)) = recv else { return Ok(()) };
    buffer::with(CACHED, handle, |b| b.internode_cached_dispatch(&a, &recv_x, recv_x_scales.as_ref()))
}

/// Internode combine (collective) into `out`; `out` absent: only the checks.
pub fn internode_combine(
    handle: i64,
    inputs: CombineInputs,
    h: InternodeHandle,
    config: &[i64],
    stream: Stream,
    out: Option<&CombineOutputs>,
) -> Result<()> {
    let a = combine_args(COMBINE, inputs, h, config, stream)?;
    check_combine(handle, &a)?;
    let Some(o) = out else { return Ok(()) };
    buffer::with(COMBINE, handle, |b| b.internode_combine(&a, o))
}
