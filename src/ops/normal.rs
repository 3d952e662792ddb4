//! Normal-mode (high-throughput) ops: validation, the backend's argument structs built from
//! the plain values the C surface and `host` hand over, and the backend calls.

use crate::backend::{BufferInfo, CachedDispatchArgs, CombineArgs, DispatchArgs};
use crate::buffer;
use crate::config::Config;
use crate::error::Result;
use crate::op_io::{CombineOutputs, DispatchOutputs, DispatchPlan, Handle};
use crate::tensor::{DType, Stream, TensorRef};

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

/// The inputs of a non-cached dispatch (`deep_ep_dispatch_args_t`) as plain values, unchecked:
/// what the C surface and `host` hand over. Ops checks them and builds the backend's
/// [`DispatchArgs`].
#[derive(Copy, Clone)]
pub struct DispatchRequest {
    /// `[N, H]` bf16, or float8_e4m3fn with `x_scales`.
    pub x: TensorRef,
    /// `[N, S]` float32 or int32; only with FP8 `x`.
    pub x_scales: Option<TensorRef>,
    /// `[N, K]` int32 or int64 expert ids (−1 = none); given with `topk_weights`.
    pub topk_idx: Option<TensorRef>,
    /// `[N, K]` float32.
    pub topk_weights: Option<TensorRef>,
    /// `[R]` int32, `[N, R]` bool and `[E]` int32 from `get_dispatch_layout`.
    pub num_tokens_per_rank: TensorRef,
    pub is_token_in_rank: TensorRef,
    pub num_tokens_per_expert: TensorRef,
    /// Per-expert counts rounded up to this (1..=[`MAX_EXPERT_ALIGNMENT`]).
    pub expert_alignment: i64,
    /// 0: exact receive count (host sync); > 0: this many output rows, no host sync.
    pub num_worst_tokens: i64,
    /// `[num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv]` (DeepEP's `Config`).
    pub config: [i64; 5],
    pub stream: Stream,
}

impl DispatchRequest {
    /// The backend's arguments, after the checks that need no buffer (op `op`).
    pub(super) fn args(&self, op: &'static str) -> Result<DispatchArgs> {
        crate::ensure!(
            (1..=MAX_EXPERT_ALIGNMENT as i64).contains(&self.expert_alignment),
            op,
            "expert_alignment must be in 1..={MAX_EXPERT_ALIGNMENT} (aligned counts are int32), got {}",
            self.expert_alignment
        );
        crate::ensure!(self.num_worst_tokens >= 0, op, "num_worst_tokens must be >= 0, got {}", self.num_worst_tokens);
        let ntpe = self.num_tokens_per_expert;
        Ok(DispatchArgs {
            x: self.x,
            x_scales: self.x_scales,
            topk_idx: self.topk_idx,
            topk_weights: self.topk_weights,
            num_tokens_per_rank: self.num_tokens_per_rank,
            is_token_in_rank: self.is_token_in_rank,
            num_experts: if ntpe.ndim() == 1 { ntpe.size(0) } else { 0 },
            num_tokens_per_expert: ntpe,
            expert_alignment: self.expert_alignment as usize,
            num_worst_tokens: self.num_worst_tokens as usize,
            config: Config::from_slice(op, &self.config)?,
            stream: self.stream,
        })
    }
}

/// Validates a dispatch and runs its first half (collective; host sync unless worst-case).
pub fn dispatch_prepare(handle: i64, r: &DispatchRequest) -> Result<DispatchPlan> {
    let a = r.args(DISPATCH)?;
    buffer::with(DISPATCH, handle, |b| {
        let info = b.info().clone();
        check_dispatch_args(DISPATCH, &a, &info)?;
        b.dispatch_prepare(&a)
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

/// Second half of a dispatch into outputs allocated from `plan` (collective; only
/// `num_recv_tokens` and `num_rows` of `plan` are read).
pub fn dispatch_finish(handle: i64, r: &DispatchRequest, plan: &DispatchPlan, o: &DispatchOutputs) -> Result<()> {
    let a = r.args(DISPATCH)?;
    buffer::with(DISPATCH, handle, |b| b.dispatch_finish(&a, plan, o))
}

/// The arguments of a cached dispatch with routing handle `h` (op `op`).
pub(super) fn cached_args<H>(
    op: &'static str,
    x: TensorRef,
    x_scales: Option<TensorRef>,
    h: H,
    config: &[i64],
    stream: Stream,
) -> Result<CachedDispatchArgs<H>> {
    Ok(CachedDispatchArgs { x, x_scales, handle: h, config: Config::from_slice(op, config)?, stream })
}

/// Validates a cached dispatch, intranode or internode (call before allocating `[rows, H]`
/// outputs).
pub(super) fn check_cached_dispatch<H: RoutingHandle>(handle: i64, a: &CachedDispatchArgs<H>) -> Result<()> {
    let op = H::OPS.0;
    buffer::with(op, handle, |b| {
        let info = b.info().clone();
        check_x(op, &a.x, &a.x_scales, &info)?;
        let (n, _) = a.handle.check(op, &info, &a.config)?;
        crate::ensure!(a.x.size(0) == n, op, "x has {} tokens but the handle was made for {n}", a.x.size(0));
        Ok(())
    })
}

/// Dispatch reusing a handle (collective, no host sync on GPUs) into `recv = (recv_x [rows, H],
/// recv_x_scales [rows, S])`; `recv` absent: only the checks (made before the outputs are
/// allocated).
pub fn cached_dispatch(
    handle: i64,
    x: TensorRef,
    x_scales: Option<TensorRef>,
    h: Handle,
    config: &[i64],
    stream: Stream,
    recv: Option<(TensorRef, Option<TensorRef>)>,
) -> Result<()> {
    let a = cached_args(CACHED, x, x_scales, h, config, stream)?;
    check_cached_dispatch(handle, &a)?;
    let Some((recv_x, recv_x_scales)) = recv else { return Ok(()) };
    buffer::with(CACHED, handle, |b| b.cached_dispatch(&a, &recv_x, recv_x_scales.as_ref()))
}

/// The arguments of a combine with routing handle `h` (op `op`): `inputs` = `x`,
/// `topk_weights`, `bias_0`, `bias_1` (`x` required).
pub(super) fn combine_args<H>(op: &'static str, inputs: CombineInputs, h: H, config: &[i64], stream: Stream) -> Result<CombineArgs<H>> {
    Ok(CombineArgs {
        x: inputs.x,
        topk_weights: inputs.topk_weights,
        bias_0: inputs.bias_0,
        bias_1: inputs.bias_1,
        handle: h,
        config: Config::from_slice(op, config)?,
        stream,
    })
}

/// The data inputs of a combine (normal or internode).
#[derive(Copy, Clone)]
pub struct CombineInputs {
    /// `[rows, H]` bf16 in dispatch receive order.
    pub x: TensorRef,
    /// `[rows, K]` float32, summed back like `x`.
    pub topk_weights: Option<TensorRef>,
    /// `[N, H]` bf16, added first.
    pub bias_0: Option<TensorRef>,
    pub bias_1: Option<TensorRef>,
}

/// Validates a combine, intranode or internode (call before allocating `[N, H]` outputs).
pub(super) fn check_combine<H: RoutingHandle>(handle: i64, a: &CombineArgs<H>) -> Result<()> {
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

/// Normal-mode combine (collective) into `out`; `out` absent: only the checks (made before
/// the outputs are allocated).
pub fn combine(handle: i64, inputs: CombineInputs, h: Handle, config: &[i64], stream: Stream, out: Option<&CombineOutputs>) -> Result<()> {
    let a = combine_args(COMBINE, inputs, h, config, stream)?;
    check_combine(handle, &a)?;
    let Some(o) = out else { return Ok(()) };
    buffer::with(COMBINE, handle, |b| b.combine(&a, o))
}
