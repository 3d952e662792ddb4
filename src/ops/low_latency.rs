//! Low-latency ops: validation, the backend's argument structs built from the plain values the
//! C surface hands over ([`LlParams`], tensors), and the backend calls. Shapes are static: T
//! tokens per rank at most, E experts, R ranks, E_l = E / R local experts, H hidden.

use crate::backend::{BufferInfo, LlCombineSendArgs, LlDispatchOptions, LlGeometry, LlRowsArgs, LlSignal, LL_STATE_LEN};
pub use crate::backend::{LlCombineRecvArgs, LlDispatchSendArgs};
use crate::buffer;
use crate::error::Result;
use crate::op_io::{LlDispatchOutputs, LlStats};
use crate::tensor::{DType, Stream, TensorRef};

/// Op names, shared with the backends' error messages.
pub(crate) const DISPATCH: &str = crate::op_names::LOW_LATENCY_DISPATCH;
pub(crate) const COMBINE: &str = crate::op_names::LOW_LATENCY_COMBINE;
pub(crate) const CLEAN: &str = crate::op_names::CLEAN_LOW_LATENCY_BUFFER;
pub(crate) const NEXT: &str = crate::op_names::GET_NEXT_LOW_LATENCY_COMBINE_BUFFER;

/// Most top-k entries per token in low-latency mode.
pub const MAX_LL_TOPK: usize = 32;

/// The scalars of a low-latency call (`deep_ep_ll_params_t`) as plain values, unchecked: the
/// geometry, the format flags and the stream. Ops checks them and builds the backend's
/// [`LlGeometry`] and [`LlDispatchOptions`].
#[derive(Copy, Clone)]
pub struct LlParams {
    /// T: most tokens any rank dispatches in one call.
    pub num_max_dispatch_tokens_per_rank: i64,
    pub hidden: i64,
    pub num_experts: i64,
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
    /// NVFP4 dispatch payload (docs/NVFP4.md); needs `x_global_scale` and `use_fp8 = false`.
    pub use_nvfp4: bool,
    pub use_logfmt: bool,
    pub zero_copy: bool,
    pub stream: Stream,
}

impl LlParams {
    /// The call geometry (op `op`): every size positive.
    fn geometry(&self, op: &'static str) -> Result<LlGeometry> {
        crate::ensure!(
            self.num_max_dispatch_tokens_per_rank > 0 && self.hidden > 0 && self.num_experts > 0,
            op,
            "num_max_dispatch_tokens_per_rank ({}), hidden ({}) and num_experts ({}) must be positive",
            self.num_max_dispatch_tokens_per_rank,
            self.hidden,
            self.num_experts
        );
        Ok(LlGeometry {
            num_max_dispatch_tokens_per_rank: self.num_max_dispatch_tokens_per_rank as usize,
            hidden: self.hidden as usize,
            num_experts: self.num_experts as usize,
        })
    }

    fn options(&self) -> LlDispatchOptions {
        LlDispatchOptions { use_fp8: self.use_fp8, round_scale: self.round_scale, use_ue8m0: self.use_ue8m0, use_nvfp4: self.use_nvfp4 }
    }
}

fn check_geometry(op: &'static str, g: &LlGeometry, info: &BufferInfo) -> Result<()> {
    crate::ensure!(info.low_latency_mode, op, "the buffer was created with low_latency_mode=False");
    let r = info.num_ranks;
    let t_max = crate::backend::low_latency::LL_MAX_TOKENS;
    crate::ensure!(
        (1..=t_max).contains(&g.num_max_dispatch_tokens_per_rank),
        op,
        "num_max_dispatch_tokens_per_rank ({}) must be in 1..={t_max}",
        g.num_max_dispatch_tokens_per_rank
    );
    crate::ensure!(
        g.num_experts >= 1 && g.num_experts % r == 0,
        op,
        "num_experts ({}) must be a positive multiple of num_ranks ({r})",
        g.num_experts
    );
    crate::ensure!(g.hidden >= 128 && g.hidden % 128 == 0, op, "hidden must be a positive multiple of 128, got {}", g.hidden);
    let need = crate::config::low_latency_rdma_size_hint(g.num_max_dispatch_tokens_per_rank, g.hidden, r, g.num_experts);
    crate::ensure!(
        info.num_rdma_bytes >= need,
        op,
        "the buffer's num_rdma_bytes ({}) is smaller than get_low_latency_rdma_size_hint({}, {}, {r}, {}) = {need}",
        info.num_rdma_bytes,
        g.num_max_dispatch_tokens_per_rank,
        g.hidden,
        g.num_experts
    );
    Ok(())
}

fn check_topk(op: &'static str, idx: &TensorRef, weights: Option<&TensorRef>, g: &LlGeometry, info: &BufferInfo) -> Result<usize> {
    let dev = info.device;
    idx.check(op, "topk_idx").on(&[DType::Int32, DType::Int64], dev)?.shape(&[("num_tokens", None), ("num_topk", None)])?.contiguous()?;
    let (n, k) = (idx.size(0), idx.size(1));
    crate::ensure!(
        n <= g.num_max_dispatch_tokens_per_rank,
        op,
        "tokens over capacity: {n} tokens but num_max_dispatch_tokens_per_rank is {}",
        g.num_max_dispatch_tokens_per_rank
    );
    crate::ensure!((1..=MAX_LL_TOPK).contains(&k), op, "num_topk must be in 1..={MAX_LL_TOPK}, got {k}");
    if let Some(w) = weights {
        w.check(op, "topk_weights").on(&[DType::Float32], dev)?.shape(&[("num_tokens", Some(n)), ("num_topk", Some(k))])?.contiguous()?;
    }
    Ok(n)
}

fn check_stats(op: &'static str, s: &LlStats, info: &BufferInfo, num_local_experts: usize) -> Result<()> {
    if let Some(t) = &s.cumulative_local_expert_recv_stats {
        t.check(op, "cumulative_local_expert_recv_stats")
            .on(&[DType::Int32], info.device)?
            .shape(&[("num_local_experts", Some(num_local_experts))])?
            .contiguous()?;
    }
    if let Some(t) = &s.wait_recv_cost_stats {
        // named as in the op schemas
        let name = if op == DISPATCH { "dispatch_wait_recv_cost_stats" } else { "combine_wait_recv_cost_stats" };
        t.check(op, name).on(&[DType::Int64], info.device)?.shape(&[("num_ranks", Some(info.num_ranks))])?.contiguous()?;
    }
    Ok(())
}

/// Validates a low-latency dispatch (call before allocating the static outputs).
fn check_low_latency_dispatch(handle: i64, g: &LlGeometry, o: &LlDispatchOptions, a: &LlDispatchSendArgs, stats: &LlStats) -> Result<()> {
    buffer::with(DISPATCH, handle, |b| {
        let info = b.info().clone();
        check_geometry(DISPATCH, g, &info)?;
        a.x.check(DISPATCH, "x")
            .on(&[DType::BFloat16], info.device)?
            .shape(&[("num_tokens", None), ("hidden", Some(g.hidden))])?
            .contiguous()?;
        let n = check_topk(DISPATCH, &a.topk_idx, a.topk_weights.as_ref(), g, &info)?;
        crate::ensure!(a.x.size(0) == n, DISPATCH, "x has {} tokens but topk_idx has {n}", a.x.size(0));
        crate::ensure!(!o.use_ue8m0 || o.round_scale, DISPATCH, "use_ue8m0=True requires round_scale=True");
        crate::ensure!(
            !o.use_ue8m0 || g.hidden % 512 == 0,
            DISPATCH,
            "use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {}",
            g.hidden
        );
        crate::ensure!(o.use_fp8 || (!o.round_scale && !o.use_ue8m0), DISPATCH, "round_scale/use_ue8m0 only apply with use_fp8=True");
        check_nvfp4(o, a.x_global_scale.as_ref(), &info)?;
        check_stats(DISPATCH, stats, &info, g.num_experts / info.num_ranks)
    })
}

/// The NVFP4 arguments: `use_nvfp4` excludes `use_fp8` (as DeepEP's forks assert) and needs the
/// global scale, a contiguous float32 tensor on the buffer's device whose first element is `S`
/// (DeepEP's kernel reads `*x_global_scale`; callers pass a scalar or a per-expert vector of equal
/// values). The value is read where the payload is made, not here: no host sync.
fn check_nvfp4(o: &LlDispatchOptions, scale: Option<&TensorRef>, info: &BufferInfo) -> Result<()> {
    if !o.use_nvfp4 {
        crate::ensure!(scale.is_none(), DISPATCH, "x_global_scale only applies with use_nvfp4=True");
        return Ok(());
    }
    crate::ensure!(!o.use_fp8, DISPATCH, "use_nvfp4=True needs use_fp8=False (one payload format per dispatch)");
    let Some(s) = scale else {
        return Err(crate::error::Error::invalid(DISPATCH, "use_nvfp4=True needs x_global_scale (a float32 scalar tensor)"));
    };
    s.check(DISPATCH, "x_global_scale").on(&[DType::Float32], info.device)?.contiguous()?;
    crate::ensure!(s.numel() >= 1, DISPATCH, "x_global_scale is empty: its first element is the global scale");
    Ok(())
}

fn check_dispatch_outputs(out: &LlDispatchOutputs, g: &LlGeometry, o: &LlDispatchOptions, info: &BufferInfo) -> Result<()> {
    let (r, dev) = (info.num_ranks, info.device);
    let (el, rows) = (g.num_experts / r, r * g.num_max_dispatch_tokens_per_rank);
    let (xdt, cols) = match (o.use_fp8, o.use_nvfp4) {
        (true, _) => (DType::Float8E4m3, g.hidden),
        (false, true) => (DType::UInt8, g.hidden / 2),
        _ => (DType::BFloat16, g.hidden),
    };
    out.recv_x
        .check(DISPATCH, "recv_x")
        .on(&[xdt], dev)?
        .shape(&[("num_local_experts", Some(el)), ("rows", Some(rows)), ("hidden", Some(cols))])?
        .contiguous()?;
    out.recv_count.check(DISPATCH, "recv_count").on(&[DType::Int32], dev)?.shape(&[("num_local_experts", Some(el))])?.contiguous()?;
    out.src_info
        .check(DISPATCH, "src_info")
        .on(&[DType::Int32], dev)?
        .shape(&[("num_local_experts", Some(el)), ("rows", Some(rows))])?
        .contiguous()?;
    out.layout_range
        .check(DISPATCH, "layout_range")
        .on(&[DType::Int64], dev)?
        .shape(&[("num_local_experts", Some(el)), ("num_ranks", Some(r))])?
        .contiguous()?;
    if let Some(s) = &out.recv_state {
        s.check(DISPATCH, "recv_state").on(&[DType::Int64], dev)?.shape(&[("state", Some(LL_STATE_LEN))])?.contiguous()?;
    }
    if o.use_nvfp4 {
        let s = out.recv_x_scales.as_ref();
        crate::ensure!(s.is_some(), DISPATCH, "recv_x_scales is required with use_nvfp4");
        let (rm, rk) = crate::numerics::nvfp4::scale_tiles(rows, g.hidden);
        s.unwrap()
            .check(DISPATCH, "recv_x_scales")
            .on(&[DType::Float8E4m3], dev)?
            .shape(&[("num_local_experts", Some(el)), ("row_tiles", Some(rm)), ("col_tiles", Some(rk)), ("tile_bytes", Some(512))])?
            .contiguous()?;
    }
    if o.use_fp8 {
        let s = out.recv_x_scales.as_ref();
        crate::ensure!(s.is_some(), DISPATCH, "recv_x_scales is required with use_fp8");
        let s = s.unwrap();
        let (dt, cols) = if o.use_ue8m0 { (DType::Int32, g.hidden / 512) } else { (DType::Float32, g.hidden / 128) };
        s.check(DISPATCH, "recv_x_scales").on(&[dt], dev)?.shape(&[
            ("num_local_experts", Some(el)),
            ("rows", Some(rows)),
            ("num_scales", Some(cols)),
        ])?;
        crate::ensure!(
            s.strides() == [(rows * cols) as i64, 1, rows as i64],
            DISPATCH,
            "recv_x_scales must be column-major in its last two dims (strides [{}, 1, {rows}]), got {:?}",
            rows * cols,
            s.strides()
        );
    }
    Ok(())
}

/// LL dispatch send phase into caller-allocated outputs (not yet valid until the recv phase);
/// `out` absent: only the checks of the whole dispatch (`stats` included), made before the
/// outputs are allocated.
pub fn low_latency_dispatch_send(
    handle: i64,
    p: &LlParams,
    a: LlDispatchSendArgs,
    stats: &LlStats,
    out: Option<&LlDispatchOutputs>,
) -> Result<()> {
    let (g, o) = (p.geometry(DISPATCH)?, p.options());
    let Some(out) = out else { return check_low_latency_dispatch(handle, &g, &o, &a, stats) };
    check_low_latency_dispatch(handle, &g, &o, &a, &LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: None })?;
    buffer::with(DISPATCH, handle, |b| {
        check_dispatch_outputs(out, &g, &o, &b.info().clone())?;
        b.ll_dispatch_send(&g, &o, &a, out, p.stream)
    })
}

/// A whole LL dispatch (no hook): validates once, then the backend's send and receive (one launch
/// where it can); `out.recv_state` may be left unwritten, or absent (the backend's own).
pub fn low_latency_dispatch(handle: i64, p: &LlParams, a: LlDispatchSendArgs, stats: &LlStats, out: &LlDispatchOutputs) -> Result<()> {
    let (g, o) = (p.geometry(DISPATCH)?, p.options());
    check_low_latency_dispatch(handle, &g, &o, &a, stats)?;
    buffer::with(DISPATCH, handle, |b| {
        check_dispatch_outputs(out, &g, &o, &b.info().clone())?;
        b.ll_dispatch(&g, &o, &a, out, stats, p.stream)
    })
}

/// LL dispatch recv phase: waits for all sources and fills `out`.
pub fn low_latency_dispatch_recv(handle: i64, p: &LlParams, out: &LlDispatchOutputs, stats: &LlStats) -> Result<()> {
    let (g, o) = (p.geometry(DISPATCH)?, p.options());
    buffer::with(DISPATCH, handle, |b| {
        let info = b.info().clone();
        check_geometry(DISPATCH, &g, &info)?;
        check_dispatch_outputs(out, &g, &o, &info)?;
        check_stats(DISPATCH, stats, &info, g.num_experts / info.num_ranks)?;
        b.ll_dispatch_recv(&g, &o, out, stats, p.stream)
    })
}

fn check_combine_layout(
    x: Option<&TensorRef>,
    src_info: &TensorRef,
    layout_range: &TensorRef,
    g: &LlGeometry,
    info: &BufferInfo,
) -> Result<()> {
    let (r, dev) = (info.num_ranks, info.device);
    let (el, rows) = (g.num_experts / r, r * g.num_max_dispatch_tokens_per_rank);
    if let Some(x) = x {
        x.check(COMBINE, "x")
            .on(&[DType::BFloat16], dev)?
            .shape(&[("num_local_experts", Some(el)), ("rows", Some(rows)), ("hidden", Some(g.hidden))])?
            .contiguous()?;
    }
    src_info
        .check(COMBINE, "src_info")
        .on(&[DType::Int32], dev)?
        .shape(&[("num_local_experts", Some(el)), ("rows", Some(rows))])?
        .contiguous()?;
    layout_range
        .check(COMBINE, "layout_range")
        .on(&[DType::Int64], dev)?
        .shape(&[("num_local_experts", Some(el)), ("num_ranks", Some(r))])?
        .contiguous()?
        .done()
}

/// The overlap arguments of an LL combine send as plain values, unchecked (`deep_ep_ll_overlap_t`):
/// SGLang's single-batch overlap. `threshold <= 0` asks for no wait (the call is a plain combine).
pub struct LlOverlap {
    /// int32 `[E_l * ceil(R*T / block_m)]` (or more) on the buffer's device: the producer's signals.
    pub signal: TensorRef,
    /// Rows per signal, `1..=R*T`.
    pub block_m: i64,
    /// A row is ready once its signal is `>= threshold`.
    pub threshold: i64,
    /// SMs the send may spin on while it waits (0: no cap): four 128-thread blocks per SM.
    pub num_sms: i64,
}

/// The checked [`LlSignal`] of `o` (None when there is nothing to wait for).
fn overlap_signal(o: Option<LlOverlap>, g: &LlGeometry, info: &BufferInfo) -> Result<Option<LlSignal>> {
    let Some(o) = o else { return Ok(None) };
    let rt = info.num_ranks * g.num_max_dispatch_tokens_per_rank;
    crate::ensure!(
        o.block_m >= 1 && o.block_m as usize <= rt,
        COMBINE,
        "block_m must be in 1..=num_ranks * num_max_dispatch_tokens_per_rank ({rt}), got {}",
        o.block_m
    );
    crate::ensure!(o.num_sms >= 0, COMBINE, "num_sms must be >= 0, got {}", o.num_sms);
    crate::ensure!(o.threshold <= i32::MAX as i64, COMBINE, "threshold must fit int32, got {}", o.threshold);
    let s = LlSignal {
        signal: o.signal,
        block_m: o.block_m as usize,
        threshold: o.threshold as i32,
        max_blocks: (o.num_sms as usize).saturating_mul(4),
    };
    let need = g.num_experts / info.num_ranks * s.blocks(g, info.num_ranks);
    s.signal.check(COMBINE, "comp_signal").on(&[DType::Int32], info.device)?.contiguous()?;
    let n = s.signal.numel();
    crate::ensure!(
        n >= need,
        COMBINE,
        "comp_signal must hold num_local_experts * ceil(num_ranks * T / block_m) = {need} int32 signals, got {n}"
    );
    Ok((o.threshold > 0).then_some(s))
}

/// LL combine send phase (collective in sequence with the recv phase): `x [E_l, R*T, H]` bf16
/// expert outputs in the dispatch's layout (`src_info`, `layout_range`); writes `recv_state`.
/// `overlap`: rows are sent as the producer's signals say they are written ([`LlOverlap`]).
/// `send.recv_state` is required here.
pub fn low_latency_combine_send(handle: i64, p: &LlParams, send: LlCombineInputs, overlap: Option<LlOverlap>) -> Result<()> {
    crate::ensure!(send.recv_state.is_some(), COMBINE, "recv_state is required");
    let g = p.geometry(COMBINE)?;
    buffer::with(COMBINE, handle, |b| {
        let info = b.info().clone();
        check_geometry(COMBINE, &g, &info)?;
        let a = combine_send_args(p, &g, &info, send, overlap)?;
        b.ll_combine_send(&g, &a, p.stream)
    })
}

/// The tensors of an LL combine's send phase (unchecked).
pub struct LlCombineInputs {
    /// `[E_l, R*T, H]` bf16 expert outputs (ignored with `zero_copy`).
    pub x: TensorRef,
    /// `[E_l, R*T]` int32, from the dispatch.
    pub src_info: TensorRef,
    /// `[E_l, R]` int64, from the dispatch.
    pub layout_range: TensorRef,
    /// `[LL_STATE_LEN]` int64, written by the send (left unwritten by a one-launch combine); `None`
    /// only in a whole combine (the backend's own where it needs one).
    pub recv_state: Option<TensorRef>,
}

/// The send's arguments, checked (the geometry already is).
fn combine_send_args(
    p: &LlParams,
    g: &LlGeometry,
    info: &BufferInfo,
    t: LlCombineInputs,
    overlap: Option<LlOverlap>,
) -> Result<LlCombineSendArgs> {
    let signal = overlap_signal(overlap, g, info)?;
    let LlCombineInputs { x, src_info, layout_range, recv_state } = t;
    let a = LlCombineSendArgs { x, src_info, layout_range, use_logfmt: p.use_logfmt, zero_copy: p.zero_copy, recv_state, signal };
    crate::ensure!(!(a.zero_copy && a.use_logfmt), COMBINE, "zero_copy and use_logfmt cannot be combined");
    check_combine_layout(Some(&a.x), &a.src_info, &a.layout_range, g, info)?;
    check_state(&a.recv_state, info)?;
    Ok(a)
}

fn check_state(recv_state: &Option<TensorRef>, info: &BufferInfo) -> Result<()> {
    let Some(s) = recv_state else { return Ok(()) };
    s.check(COMBINE, "recv_state").on(&[DType::Int64], info.device)?.shape(&[("state", Some(LL_STATE_LEN))])?.contiguous()?.done()
}

/// The receive's arguments (the geometry already checked).
fn check_combine_recv(g: &LlGeometry, info: &BufferInfo, a: &LlCombineRecvArgs, stats: &LlStats) -> Result<()> {
    let n = check_topk(COMBINE, &a.topk_idx, Some(&a.topk_weights), g, info)?;
    a.out
        .check(COMBINE, "out")
        .on(&[DType::BFloat16], info.device)?
        .shape(&[("num_tokens", Some(n)), ("hidden", Some(g.hidden))])?
        .contiguous()?;
    check_state(&a.recv_state, info)?;
    check_stats(COMBINE, stats, info, g.num_experts / info.num_ranks)
}

/// LL combine recv phase: waits and reduces into `out [N, H]` bf16 with this rank's `topk_idx`
/// and `topk_weights`; `wait` = `combine_wait_recv_cost_stats`.
pub fn low_latency_combine_recv(
    handle: i64,
    p: &LlParams,
    topk_idx: TensorRef,
    topk_weights: TensorRef,
    recv_state: TensorRef,
    out: TensorRef,
    wait: Option<TensorRef>,
) -> Result<()> {
    let g = p.geometry(COMBINE)?;
    let a = LlCombineRecvArgs { topk_idx, topk_weights, recv_state: Some(recv_state), out };
    let stats = LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: wait };
    buffer::with(COMBINE, handle, |b| {
        let info = b.info().clone();
        check_geometry(COMBINE, &g, &info)?;
        check_combine_recv(&g, &info, &a, &stats)?;
        b.ll_combine_recv(&g, &a, &stats, p.stream)
    })
}

/// A whole LL combine (no hook): validates the send's and the receive's arguments, then the
/// backend's send and receive (one launch where it can); `recv_state` may be left unwritten, or
/// absent (the backend's own).
pub fn low_latency_combine(
    handle: i64,
    p: &LlParams,
    send: LlCombineInputs,
    overlap: Option<LlOverlap>,
    recv: LlCombineRecvArgs,
    wait: Option<TensorRef>,
) -> Result<()> {
    let g = p.geometry(COMBINE)?;
    let stats = LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: wait };
    buffer::with(COMBINE, handle, |b| {
        let info = b.info().clone();
        check_geometry(COMBINE, &g, &info)?;
        let a = combine_send_args(p, &g, &info, send, overlap)?;
        check_combine_recv(&g, &info, &recv, &stats)?;
        b.ll_combine(&g, &a, &recv, &stats, p.stream)
    })
}

/// The optional `num_tokens` argument of `low_latency_dispatch` / `low_latency_combine` (`op`,
/// either op name): writes `out` = `topk_idx` with the rows at or past the int32 device scalar
/// `num_tokens` set to −1, which the op then passes to the backend instead of `topk_idx`, so
/// that one captured CUDA graph serves any real batch. Local (no peer involved), on `stream`,
/// no host sync on CUDA backends (see [`crate::backend::Backend::ll_mask_rows`] for the range
/// check). Call after the op's own validation of `topk_idx`.
pub fn low_latency_mask_rows(
    handle: i64,
    op: &'static str,
    topk_idx: TensorRef,
    num_tokens: TensorRef,
    out: TensorRef,
    stream: Stream,
) -> Result<()> {
    crate::ensure!(op == DISPATCH || op == COMBINE, op, "internal: num_tokens belongs to low_latency_dispatch or low_latency_combine");
    let a = LlRowsArgs { topk_idx, num_tokens, out };
    buffer::with(op, handle, |b| {
        let info = b.info().clone();
        crate::ensure!(info.low_latency_mode, op, "the buffer was created with low_latency_mode=False");
        let dev = info.device;
        a.topk_idx
            .check(op, "topk_idx")
            .on(&[DType::Int32, DType::Int64], dev)?
            .shape(&[("num_tokens", None), ("num_topk", None)])?
            .contiguous()?;
        let (n, k) = (a.topk_idx.size(0), a.topk_idx.size(1));
        let nt = &a.num_tokens;
        crate::ensure!(
            nt.dtype == DType::Int32 && nt.device == dev && nt.numel() == 1 && nt.ndim() <= 1,
            op,
            "num_tokens must be an int32 tensor of shape [] or [1] on {dev} (the real number of rows of x), got {} {:?} on {}",
            nt.dtype,
            nt.sizes(),
            nt.device
        );
        a.out
            .check(op, "internal: effective topk_idx")
            .on(&[a.topk_idx.dtype], dev)?
            .shape(&[("num_tokens", Some(n)), ("num_topk", Some(k))])?
            .contiguous()?;
        crate::ensure!(
            a.out.data_ptr() != a.topk_idx.data_ptr() || n * k == 0,
            op,
            "internal: the effective topk_idx must not alias topk_idx"
        );
        b.ll_mask_rows(op, &a, stream)
    })
}

/// `deep_ep::clean_low_latency_buffer` (collective).
pub fn clean_low_latency_buffer(handle: i64, p: &LlParams) -> Result<()> {
    let g = p.geometry(CLEAN)?;
    buffer::with(CLEAN, handle, |b| {
        check_geometry(CLEAN, &g, &b.info().clone())?;
        b.clean_low_latency_buffer(&g, p.stream)
    })
}

/// `deep_ep::get_next_low_latency_combine_buffer` (local): a bf16 view into the buffer.
pub fn next_low_latency_combine_buffer(handle: i64, p: &LlParams) -> Result<TensorRef> {
    let g = p.geometry(NEXT)?;
    buffer::with(NEXT, handle, |b| {
        check_geometry(NEXT, &g, &b.info().clone())?;
        b.next_low_latency_combine_buffer(&g)
    })
}

const MASK_UPDATE: &str = crate::op_names::LOW_LATENCY_UPDATE_MASK_BUFFER;
const MASK_QUERY: &str = crate::op_names::LOW_LATENCY_QUERY_MASK_BUFFER;
const MASK_CLEAN: &str = crate::op_names::LOW_LATENCY_CLEAN_MASK_BUFFER;
const SHRINK: &str = crate::op_names::LOW_LATENCY_SET_SHRINK;

/// `deep_ep::low_latency_update_mask_buffer` (local): masks (`masked`) or unmasks `rank` for
/// this rank's LL ops.
pub fn low_latency_update_mask(handle: i64, rank: i64, masked: bool) -> Result<()> {
    buffer::with(MASK_UPDATE, handle, |b| {
        let r = b.info().num_ranks;
        crate::ensure!((0..r as i64).contains(&rank), MASK_UPDATE, "rank_to_mask must be in [0, {r}), got {rank}");
        crate::log_info!(Some(b.info().rank), "{MASK_UPDATE}: rank {rank} {}", if masked { "masked" } else { "unmasked" });
        b.ll_update_mask(rank as usize, masked)
    })
}

/// `deep_ep::low_latency_query_mask_buffer` (local): 1 per masked rank, 0 otherwise (`[R]`).
pub fn low_latency_query_mask(handle: i64) -> Result<Vec<i32>> {
    buffer::with(MASK_QUERY, handle, |b| Ok(b.ll_mask().into_iter().map(i32::from).collect()))
}

/// `deep_ep::low_latency_clean_mask_buffer` (local): unmasks every rank.
pub fn low_latency_clean_mask(handle: i64) -> Result<()> {
    buffer::with(MASK_CLEAN, handle, |b| b.ll_clean_mask())
}

/// `deep_ep::low_latency_set_shrink` (local): shrink mode on or off (see `Backend::ll_set_shrink`).
pub fn low_latency_set_shrink(handle: i64, enable: bool) -> Result<()> {
    buffer::with(SHRINK, handle, |b| b.ll_set_shrink(enable))
}
