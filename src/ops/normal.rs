//! Normal-mode (high-throughput) ops: validation and backend calls.

use crate::backend::{BufferInfo, CachedDispatchArgs, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, Handle};
use crate::buffer;
use crate::config::Config;
use crate::error::Result;
use crate::tensor::{DType, TensorRef};

const DISPATCH: &str = crate::op_names::DISPATCH;
const CACHED: &str = crate::op_names::CACHED_DISPATCH;
const COMBINE: &str = crate::op_names::COMBINE;

/// Most top-k entries per token the kernels support (DeepEP's device assert).
pub const MAX_TOPK: usize = 32;
/// Largest `expert_alignment`: aligned per-expert counts must stay far inside int32.
pub const MAX_EXPERT_ALIGNMENT: usize = 1 << 20;
/// Most experts per rank (DeepEP's `NUM_MAX_LOCAL_EXPERTS`).
pub const MAX_LOCAL_EXPERTS: usize = 1024;

/// Checks `x` (and its FP8 scales) for a normal-mode dispatch on `info`'s device.
pub(super) fn check_x(op: &'static str, x: &TensorRef, scales: &Option<TensorRef>, info: &BufferInfo) -> Result<()> {
    let dev = info.device;
    x.check(op, "x").on(&[DType::BFloat16, DType::Float8E4m3], dev)?.shape(&[("num_tokens", None), ("hidden", None)])?.contiguous()?;
    crate::ensure!(
        (x.size(1) * x.dtype.size()) % 16 == 0,
        op,
        "x rows must be a multiple of 16 bytes, got hidden={} of {}",
        x.size(1),
        x.dtype
    );
    match (x.dtype, scales) {
        (DType::Float8E4m3, None) => crate::ensure!(false, op, "x is float8_e4m3fn: pass (x, x_scales) with per-token scales"),
        (DType::BFloat16, Some(_)) => crate::ensure!(false, op, "x_scales given but x is bfloat16 (scales only go with float8_e4m3fn x)"),
        (_, Some(s)) => {
            s.check(op, "x_scales")
                .on(&[DType::Float32, DType::Int32], dev)?
                .shape(&[("num_tokens", Some(x.size(0))), ("num_scales", None)])?;
        }
        _ => {}
    }
    Ok(())
}

/// Normal-mode ops need the buffer's NVLink area (a buffer made for low-latency only has none).
pub(super) fn check_normal_memory(op: &'static str, info: &BufferInfo) -> Result<()> {
    crate::ensure!(
        info.num_nvl_bytes > 0,
        op,
        "this buffer has no normal-mode memory (num_nvl_bytes = 0): create it with num_nvl_bytes of at least \
         Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) to use dispatch and combine"
    );
    Ok(())
}

/// Checks a handle's `is_token_in_rank` `[N, R]` bool against the buffer; N.
pub(super) fn check_is_token_in_rank(op: &'static str, t: &TensorRef, info: &BufferInfo) -> Result<usize> {
    t.check(op, "is_token_in_rank")
        .on(&[DType::Bool], info.device)?
        .shape(&[("num_tokens", None), ("num_ranks", Some(info.num_ranks))])?
        .contiguous()?;
    Ok(t.size(0))
}

/// A routing handle as the cached dispatch and the combine check it: the intranode [`Handle`] or
/// the internode one (`backend::internode::InternodeHandle`).
pub trait RoutingHandle {
    /// Names of the cached dispatch and the combine that take this handle.
    const OPS: (&'static str, &'static str);
    /// Checks the handle's tensors against the buffer and `config.num_sms`; (N tokens, rows).
    fn check(&self, op: &'static str, info: &BufferInfo, config: &Config) -> Result<(usize, usize)>;
    /// What a combine with this handle asks of `config` beyond the handle.
    fn check_combine_config(&self, _op: &'static str, _info: &BufferInfo, _config: &Config) -> Result<()> {
        Ok(())
    }
}

impl RoutingHandle for Handle {
    const OPS: (&'static str, &'static str) = (CACHED, COMBINE);
    fn check(&self, op: &'static str, info: &BufferInfo, config: &Config) -> Result<(usize, usize)> {
        check_handle(op, self, info, config.num_channels())?;
        Ok((self.is_token_in_rank.size(0), self.recv_src_idx.size(0)))
    }
}

/// Checks a dispatch handle (6 tensors) against the buffer and `config.num_sms`.
fn check_handle(op: &'static str, h: &Handle, info: &BufferInfo, num_channels: usize) -> Result<()> {
    check_normal_memory(op, info)?;
    let (r, dev) = (info.num_ranks, info.device);
    h.rank_prefix_matrix
        .check(op, "rank_prefix_matrix")
        .on(&[DType::Int32], dev)?
        .shape(&[("num_ranks", Some(r)), ("num_ranks", Some(r))])?
        .contiguous()?;
    let chan_msg = "(config.num_sms / 2 must equal the dispatch's)";
    for (t, name) in [(&h.channel_prefix_matrix, "channel_prefix_matrix"), (&h.recv_channel_prefix_matrix, "recv_channel_prefix_matrix")] {
        t.check(op, name).on(&[DType::Int32], dev)?.done()?;
        crate::ensure!(
            t.sizes() == [r as i64, num_channels as i64],
            op,
            "{name} must have shape [{r}, {}] {chan_msg}, got {:?}",
            num_channels,
            t.sizes()
        );
    }
    h.recv_src_idx.check(op, "recv_src_idx").on(&[DType::Int32], dev)?.shape(&[("num_recv_tokens", None)])?.contiguous()?;
    let n = check_is_token_in_rank(op, &h.is_token_in_rank, info)?;
    h.send_head
        .check(op, "send_head")
        .on(&[DType::Int32], dev)?
        .shape(&[("num_tokens", Some(n)), ("num_ranks", Some(r))])?
        .contiguous()?
        .done()
}

/// Validates a dispatch and runs its first half (collective; host sync unless worst-case).
pub fn dispatch_prepare(handle: i64, a: &DispatchArgs) -> Result<DispatchPlan> {
    buffer::with(DISPATCH, handle, |b| {
        let info = b.info().clone();
        check_dispatch_args(DISPATCH, a, &info)?;
        b.dispatch_prepare(a)
    })
}

/// The input checks of a non-cached dispatch (intranode or internode, named by `op`).
pub(super) fn check_dispatch_args(op: &'static str, a: &DispatchArgs, info: &BufferInfo) -> Result<()> {
    check_normal_memory(op, info)?;
    {
        let (dev, r) = (info.device, info.num_ranks);
        check_x(op, &a.x, &a.x_scales, info)?;
        let n = a.x.size(0);
        a.num_tokens_per_rank.check(op, "num_tokens_per_rank").on(&[DType::Int32], dev)?.shape(&[("num_ranks", Some(r))])?.contiguous()?;
        a.is_token_in_rank
            .check(op, "is_token_in_rank")
            .on(&[DType::Bool], dev)?
            .shape(&[("num_tokens", Some(n)), ("num_ranks", Some(r))])?
            .contiguous()?;
        a.num_tokens_per_expert
            .check(op, "num_tokens_per_expert")
            .on(&[DType::Int32], dev)?
            .shape(&[("num_experts", None)])?
            .contiguous()?;
        let e = a.num_tokens_per_expert.size(0);
        crate::ensure!(e == a.num_experts, op, "internal: num_experts {} != num_tokens_per_expert size {e}", a.num_experts);
        crate::ensure!(
            e > 0 && e % r == 0,
            op,
            "num_tokens_per_expert has {e} experts, which is not a positive multiple of num_ranks ({r})"
        );
        crate::ensure!(e / r <= MAX_LOCAL_EXPERTS, op, "{} experts per rank exceeds the limit of {MAX_LOCAL_EXPERTS}", e / r);
        match (&a.topk_idx, &a.topk_weights) {
            (Some(i), Some(w)) => {
                i.check(op, "topk_idx")
                    .on(&[DType::Int32, DType::Int64], dev)?
                    .shape(&[("num_tokens", Some(n)), ("num_topk", None)])?
                    .contiguous()?;
                let k = i.size(1);
                crate::ensure!((1..=MAX_TOPK).contains(&k), op, "num_topk must be in 1..={MAX_TOPK}, got {k}");
                w.check(op, "topk_weights")
                    .on(&[DType::Float32], dev)?
                    .shape(&[("num_tokens", Some(n)), ("num_topk", Some(k))])?
                    .contiguous()?;
            }
            (None, None) => crate::ensure!(a.num_worst_tokens == 0, op, "num_worst_tokens > 0 requires topk_idx and topk_weights"),
            _ => crate::ensure!(false, op, "topk_idx and topk_weights must be given together"),
        }
        crate::ensure!(
            a.num_worst_tokens <= i32::MAX as usize,
            op,
            "num_worst_tokens must be at most {} (rows are indexed by int32), got {}",
            i32::MAX,
            a.num_worst_tokens
        );
        crate::ensure!(
            (1..=MAX_EXPERT_ALIGNMENT).contains(&a.expert_alignment),
            op,
            "expert_alignment must be in 1..={MAX_EXPERT_ALIGNMENT} (aligned counts are int32), got {}",
            a.expert_alignment
        );
        Ok(())
    }
}

/// Second half of a dispatch into outputs allocated from `plan` (collective).
pub fn dispatch_finish(handle: i64, a: &DispatchArgs, plan: &DispatchPlan, o: &DispatchOutputs) -> Result<()> {
    buffer::with(DISPATCH, handle, |b| b.dispatch_finish(a, plan, o))
}

/// Validates a cached dispatch, intranode or internode (call before allocating `[rows, H]`
/// outputs).
pub fn check_cached_dispatch<H: RoutingHandle>(handle: i64, a: &CachedDispatchArgs<H>) -> Result<()> {
    let op = H::OPS.0;
    buffer::with(op, handle, |b| {
        let info = b.info().clone();
        check_x(op, &a.x, &a.x_scales, &info)?;
        let (n, _) = a.handle.check(op, &info, &a.config)?;
        crate::ensure!(a.x.size(0) == n, op, "x has {} tokens but the handle was made for {n}", a.x.size(0));
        Ok(())
    })
}

/// Dispatch reusing a handle (collective, no host sync on GPUs).
pub fn cached_dispatch(handle: i64, a: &CachedDispatchArgs, recv_x: &TensorRef, recv_x_scales: Option<&TensorRef>) -> Result<()> {
    check_cached_dispatch(handle, a)?;
    buffer::with(CACHED, handle, |b| b.cached_dispatch(a, recv_x, recv_x_scales))
}

/// Validates a combine, intranode or internode (call before allocating `[N, H]` outputs).
pub fn check_combine<H: RoutingHandle>(handle: i64, a: &CombineArgs<H>) -> Result<()> {
    let op = H::OPS.1;
    buffer::with(op, handle, |b| {
        let info = b.info().clone();
        let (n, rows) = a.handle.check(op, &info, &a.config)?;
        a.handle.check_combine_config(op, &info, &a.config)?;
        check_combine_payload(op, info.device, rows, n, &a.x, a.topk_weights.as_ref(), [a.bias_0.as_ref(), a.bias_1.as_ref()])
    })
}

/// The data of a combine (normal or internode): `x` [rows, hidden] BF16 in 16-byte rows,
/// optional `topk_weights` [rows, K] f32 with K in 1..=MAX_TOPK, optional biases [n, hidden]
/// BF16; all contiguous on `dev`.
pub(crate) fn check_combine_payload(
    op: &'static str,
    dev: crate::tensor::Device,
    rows: usize,
    n: usize,
    x: &TensorRef,
    topk_weights: Option<&TensorRef>,
    biases: [Option<&TensorRef>; 2],
) -> Result<()> {
    x.check(op, "x").on(&[DType::BFloat16], dev)?.shape(&[("num_recv_tokens", Some(rows)), ("hidden", None)])?.contiguous()?;
    let h = x.size(1);
    crate::ensure!((h * 2) % 16 == 0, op, "x rows must be a multiple of 16 bytes, got hidden={h}");
    if let Some(w) = topk_weights {
        w.check(op, "topk_weights")
            .on(&[DType::Float32], dev)?
            .shape(&[("num_recv_tokens", Some(rows)), ("num_topk", None)])?
            .contiguous()?;
        crate::ensure!((1..=MAX_TOPK).contains(&w.size(1)), op, "num_topk must be in 1..={MAX_TOPK}, got {}", w.size(1));
    }
    for (bias, name) in biases.into_iter().zip(["bias_0", "bias_1"]) {
        if let Some(t) = bias {
            t.check(op, name).on(&[DType::BFloat16], dev)?.shape(&[("num_tokens", Some(n)), ("hidden", Some(h))])?.contiguous()?;
        }
    }
    Ok(())
}

/// Normal-mode combine (collective).
pub fn combine(handle: i64, a: &CombineArgs, o: &CombineOutputs) -> Result<()> {
    check_combine(handle, a)?;
    buffer::with(COMBINE, handle, |b| b.combine(a, o))
}
