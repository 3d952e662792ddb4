//! C API of the normal-mode and low-latency ops (continuation of `buffer.rs`): C structs become
//! plain values (`ops::DispatchRequest`, `ops::LlParams`, the tensor groups of `crate::op_io`)
//! that `ops` checks and turns into the backends' arguments.

use crate::api::buffer::{check_size, guard, opt_tensor, tensor, RawTensor};
use crate::error::{Error, Result};
use crate::op_io::{CombineOutputs, DispatchOutputs, DispatchPlan, Handle, LlDispatchOutputs, LlStats};
use crate::ops::{self, CombineInputs, DispatchRequest, LlCombineInputs, LlCombineRecvArgs, LlDispatchSendArgs, LlOverlap, LlParams};
use crate::tensor::TensorRef;
use std::ffi::{c_int, c_void};

/// `deep_ep_dispatch_args_t`.
#[repr(C)]
pub struct RawDispatchArgs {
    size: u32,
    x: RawTensor,
    x_scales: RawTensor,
    topk_idx: RawTensor,
    topk_weights: RawTensor,
    num_tokens_per_rank: RawTensor,
    is_token_in_rank: RawTensor,
    num_tokens_per_expert: RawTensor,
    expert_alignment: i64,
    num_worst_tokens: i64,
    config: [i64; 5],
    stream: *mut c_void,
}

/// `deep_ep_dispatch_plan_t`.
#[repr(C)]
pub struct RawDispatchPlan {
    size: u32,
    num_recv_tokens: i64,
    num_rows: i64,
}

/// `deep_ep_dispatch_outputs_t`.
#[repr(C)]
pub struct RawDispatchOutputs {
    size: u32,
    recv_x: RawTensor,
    recv_x_scales: RawTensor,
    recv_topk_idx: RawTensor,
    recv_topk_weights: RawTensor,
    rank_prefix_matrix: RawTensor,
    channel_prefix_matrix: RawTensor,
    recv_channel_prefix_matrix: RawTensor,
    recv_src_idx: RawTensor,
    send_head: RawTensor,
}

/// `deep_ep_handle_t`.
#[repr(C)]
pub struct RawHandle {
    rank_prefix_matrix: RawTensor,
    channel_prefix_matrix: RawTensor,
    recv_channel_prefix_matrix: RawTensor,
    recv_src_idx: RawTensor,
    is_token_in_rank: RawTensor,
    send_head: RawTensor,
}

/// `deep_ep_cached_dispatch_args_t`.
#[repr(C)]
pub struct RawCachedDispatchArgs {
    size: u32,
    x: RawTensor,
    x_scales: RawTensor,
    handle: RawHandle,
    config: [i64; 5],
    stream: *mut c_void,
}

/// `deep_ep_combine_args_t`.
#[repr(C)]
pub struct RawCombineArgs {
    size: u32,
    x: RawTensor,
    topk_weights: RawTensor,
    bias_0: RawTensor,
    bias_1: RawTensor,
    handle: RawHandle,
    config: [i64; 5],
    stream: *mut c_void,
}

/// `deep_ep_ll_params_t`.
#[repr(C)]
pub struct RawLlParams {
    size: u32,
    num_max_dispatch_tokens_per_rank: i64,
    hidden: i64,
    num_experts: i64,
    use_fp8: i32,
    round_scale: i32,
    use_ue8m0: i32,
    use_nvfp4: i32,
    use_logfmt: i32,
    zero_copy: i32,
    stream: *mut c_void,
}

/// `deep_ep_ll_dispatch_outputs_t`.
#[repr(C)]
pub struct RawLlDispatchOutputs {
    size: u32,
    recv_x: RawTensor,
    recv_x_scales: RawTensor,
    recv_count: RawTensor,
    src_info: RawTensor,
    layout_range: RawTensor,
    recv_state: RawTensor,
}

/// `deep_ep_ll_overlap_t`.
#[repr(C)]
pub struct RawLlOverlap {
    size: u32,
    signal: RawTensor,
    block_m: i64,
    threshold: i64,
    num_sms: i64,
}

unsafe fn handle_of(op: &'static str, h: &RawHandle) -> Result<Handle> {
    Ok(Handle {
        rank_prefix_matrix: tensor(op, "rank_prefix_matrix", &h.rank_prefix_matrix)?,
        channel_prefix_matrix: tensor(op, "channel_prefix_matrix", &h.channel_prefix_matrix)?,
        recv_channel_prefix_matrix: tensor(op, "recv_channel_prefix_matrix", &h.recv_channel_prefix_matrix)?,
        recv_src_idx: tensor(op, "recv_src_idx", &h.recv_src_idx)?,
        is_token_in_rank: tensor(op, "is_token_in_rank", &h.is_token_in_rank)?,
        send_head: tensor(op, "send_head", &h.send_head)?,
    })
}

unsafe fn dispatch_args(a: *const RawDispatchArgs) -> Result<DispatchRequest> {
    dispatch_args_as(crate::op_names::DISPATCH, a)
}

/// Converts `deep_ep_dispatch_args_t` for op `op`.
pub(crate) unsafe fn dispatch_args_as(op: &'static str, a: *const RawDispatchArgs) -> Result<DispatchRequest> {
    let a = &*a;
    check_size(op, a.size, std::mem::size_of::<RawDispatchArgs>())?;
    Ok(DispatchRequest {
        x: tensor(op, "x", &a.x)?,
        x_scales: opt_tensor(op, "x_scales", &a.x_scales)?,
        topk_idx: opt_tensor(op, "topk_idx", &a.topk_idx)?,
        topk_weights: opt_tensor(op, "topk_weights", &a.topk_weights)?,
        num_tokens_per_rank: tensor(op, "num_tokens_per_rank", &a.num_tokens_per_rank)?,
        is_token_in_rank: tensor(op, "is_token_in_rank", &a.is_token_in_rank)?,
        num_tokens_per_expert: tensor(op, "num_tokens_per_expert", &a.num_tokens_per_expert)?,
        expert_alignment: a.expert_alignment,
        num_worst_tokens: a.num_worst_tokens,
        config: a.config,
        stream: a.stream,
    })
}

/// See `deep_ep_dispatch_prepare` in the header.
///
/// # Safety
/// Pointers from the shim: args/plan valid, `per_expert` has `per_expert_len` writable int32.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_dispatch_prepare(
    handle: i64,
    args: *const RawDispatchArgs,
    plan: *mut RawDispatchPlan,
    per_expert: *mut i32,
    per_expert_len: i64,
) -> c_int {
    guard(|| {
        let a = dispatch_args(args)?;
        let p = ops::dispatch_prepare(handle, &a)?;
        let pe = std::slice::from_raw_parts_mut(per_expert, per_expert_len.max(0) as usize);
        crate::ensure!(
            pe.len() == p.num_recv_tokens_per_expert.len(),
            crate::op_names::DISPATCH,
            "internal: per-expert buffer of {} for {} local experts",
            pe.len(),
            p.num_recv_tokens_per_expert.len()
        );
        pe.copy_from_slice(&p.num_recv_tokens_per_expert);
        *plan = RawDispatchPlan {
            size: std::mem::size_of::<RawDispatchPlan>() as u32,
            num_recv_tokens: p.num_recv_tokens as i64,
            num_rows: p.num_rows as i64,
        };
        Ok(())
    })
}

/// See `deep_ep_dispatch_finish` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_dispatch_finish(
    handle: i64,
    args: *const RawDispatchArgs,
    plan: *const RawDispatchPlan,
    out: *const RawDispatchOutputs,
) -> c_int {
    const OP: &str = crate::op_names::DISPATCH;
    guard(|| {
        let a = dispatch_args(args)?;
        let p = &*plan;
        let o = &*out;
        check_size(OP, o.size, std::mem::size_of::<RawDispatchOutputs>())?;
        let plan =
            DispatchPlan { num_recv_tokens: p.num_recv_tokens as usize, num_rows: p.num_rows as usize, num_recv_tokens_per_expert: vec![] };
        let outs = DispatchOutputs {
            recv_x: tensor(OP, "recv_x", &o.recv_x)?,
            recv_x_scales: opt_tensor(OP, "recv_x_scales", &o.recv_x_scales)?,
            recv_topk_idx: opt_tensor(OP, "recv_topk_idx", &o.recv_topk_idx)?,
            recv_topk_weights: opt_tensor(OP, "recv_topk_weights", &o.recv_topk_weights)?,
            rank_prefix_matrix: tensor(OP, "rank_prefix_matrix", &o.rank_prefix_matrix)?,
            channel_prefix_matrix: tensor(OP, "channel_prefix_matrix", &o.channel_prefix_matrix)?,
            recv_channel_prefix_matrix: tensor(OP, "recv_channel_prefix_matrix", &o.recv_channel_prefix_matrix)?,
            recv_src_idx: tensor(OP, "recv_src_idx", &o.recv_src_idx)?,
            send_head: tensor(OP, "send_head", &o.send_head)?,
        };
        ops::dispatch_finish(handle, &a, &plan, &outs)
    })
}

/// See `deep_ep_cached_dispatch` in the header.
///
/// # Safety
/// Pointers from the shim; `recv_x` NULL means validate only.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_cached_dispatch(
    handle: i64,
    args: *const RawCachedDispatchArgs,
    recv_x: *const RawTensor,
    recv_x_scales: *const RawTensor,
) -> c_int {
    const OP: &str = crate::op_names::CACHED_DISPATCH;
    guard(|| {
        let r = &*args;
        check_size(OP, r.size, std::mem::size_of::<RawCachedDispatchArgs>())?;
        let recv = match opt_tensor(OP, "recv_x", recv_x)? {
            None => None,
            Some(rx) => Some((rx, opt_tensor(OP, "recv_x_scales", recv_x_scales)?)),
        };
        let (x, x_scales) = (tensor(OP, "x", &r.x)?, opt_tensor(OP, "x_scales", &r.x_scales)?);
        ops::cached_dispatch(handle, x, x_scales, handle_of(OP, &r.handle)?, &r.config, r.stream, recv)
    })
}

/// See `deep_ep_combine` in the header.
///
/// # Safety
/// Pointers from the shim; `combined_x` NULL means validate only.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_combine(
    handle: i64,
    args: *const RawCombineArgs,
    combined_x: *const RawTensor,
    combined_w: *const RawTensor,
) -> c_int {
    const OP: &str = crate::op_names::COMBINE;
    guard(|| {
        let r = &*args;
        check_size(OP, r.size, std::mem::size_of::<RawCombineArgs>())?;
        let inputs = CombineInputs {
            x: tensor(OP, "x", &r.x)?,
            topk_weights: opt_tensor(OP, "topk_weights", &r.topk_weights)?,
            bias_0: opt_tensor(OP, "bias_0", &r.bias_0)?,
            bias_1: opt_tensor(OP, "bias_1", &r.bias_1)?,
        };
        let out = match opt_tensor(OP, "combined_x", combined_x)? {
            None => None,
            Some(cx) => {
                Some(CombineOutputs { combined_x: cx, combined_topk_weights: opt_tensor(OP, "combined_topk_weights", combined_w)? })
            }
        };
        ops::combine(handle, inputs, handle_of(OP, &r.handle)?, &r.config, r.stream, out.as_ref())
    })
}

unsafe fn ll_params(op: &'static str, p: *const RawLlParams) -> Result<LlParams> {
    let p = &*p;
    check_size(op, p.size, std::mem::size_of::<RawLlParams>())?;
    Ok(LlParams {
        num_max_dispatch_tokens_per_rank: p.num_max_dispatch_tokens_per_rank,
        hidden: p.hidden,
        num_experts: p.num_experts,
        use_fp8: p.use_fp8 != 0,
        round_scale: p.round_scale != 0,
        use_ue8m0: p.use_ue8m0 != 0,
        use_nvfp4: p.use_nvfp4 != 0,
        use_logfmt: p.use_logfmt != 0,
        zero_copy: p.zero_copy != 0,
        stream: p.stream,
    })
}

unsafe fn ll_stats(op: &'static str, cumulative: *const RawTensor, wait: *const RawTensor) -> Result<LlStats> {
    Ok(LlStats {
        cumulative_local_expert_recv_stats: opt_tensor(op, "cumulative_local_expert_recv_stats", cumulative)?,
        wait_recv_cost_stats: opt_tensor(op, "wait_recv_cost_stats", wait)?,
    })
}

/// `whole`: a whole dispatch's outputs, whose recv_state may be absent.
unsafe fn ll_outputs(op: &'static str, o: &RawLlDispatchOutputs, whole: bool) -> Result<LlDispatchOutputs> {
    check_size(op, o.size, std::mem::size_of::<RawLlDispatchOutputs>())?;
    Ok(LlDispatchOutputs {
        recv_x: tensor(op, "recv_x", &o.recv_x)?,
        recv_x_scales: opt_tensor(op, "recv_x_scales", &o.recv_x_scales)?,
        recv_count: tensor(op, "recv_count", &o.recv_count)?,
        src_info: tensor(op, "src_info", &o.src_info)?,
        layout_range: tensor(op, "layout_range", &o.layout_range)?,
        recv_state: if whole { opt_tensor(op, "recv_state", &o.recv_state)? } else { Some(tensor(op, "recv_state", &o.recv_state)?) },
    })
}

/// The tensors of a combine's send, in the order they are checked; `whole`: a whole combine's,
/// whose recv_state may be absent.
unsafe fn ll_combine_inputs(
    op: &'static str,
    x: *const RawTensor,
    src_info: *const RawTensor,
    layout_range: *const RawTensor,
    recv_state: *const RawTensor,
    whole: bool,
) -> Result<LlCombineInputs> {
    let (x, src_info, layout_range) = (tensor(op, "x", x)?, tensor(op, "src_info", src_info)?, tensor(op, "layout_range", layout_range)?);
    let recv_state = if whole { opt_tensor(op, "recv_state", recv_state)? } else { Some(tensor(op, "recv_state", recv_state)?) };
    Ok(LlCombineInputs { x, src_info, layout_range, recv_state })
}

/// The overlap arguments of a combine send (NULL: none).
unsafe fn ll_overlap(op: &'static str, overlap: *const RawLlOverlap) -> Result<Option<LlOverlap>> {
    let Some(o) = overlap.as_ref() else { return Ok(None) };
    check_size(op, o.size, std::mem::size_of::<RawLlOverlap>())?;
    let signal = tensor(op, "comp_signal", &o.signal)?;
    Ok(Some(LlOverlap { signal, block_m: o.block_m, threshold: o.threshold, num_sms: o.num_sms }))
}

/// The inputs of a dispatch's send.
unsafe fn ll_send_args(
    op: &'static str,
    x: *const RawTensor,
    topk_idx: *const RawTensor,
    topk_weights: *const RawTensor,
    x_global_scale: *const RawTensor,
) -> Result<LlDispatchSendArgs> {
    Ok(LlDispatchSendArgs {
        x: tensor(op, "x", x)?,
        topk_idx: tensor(op, "topk_idx", topk_idx)?,
        topk_weights: opt_tensor(op, "topk_weights", topk_weights)?,
        x_global_scale: opt_tensor(op, "x_global_scale", x_global_scale)?,
    })
}

/// See `deep_ep_ll_dispatch_send` in the header.
///
/// # Safety
/// Pointers from the shim; `out` NULL means validate only.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn deep_ep_ll_dispatch_send(
    handle: i64,
    p: *const RawLlParams,
    x: *const RawTensor,
    topk_idx: *const RawTensor,
    topk_weights: *const RawTensor,
    x_global_scale: *const RawTensor,
    cumulative: *const RawTensor,
    wait: *const RawTensor,
    out: *const RawLlDispatchOutputs,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_DISPATCH;
    guard(|| {
        let p = ll_params(OP, p)?;
        let a = ll_send_args(OP, x, topk_idx, topk_weights, x_global_scale)?;
        let out = if out.is_null() { None } else { Some(ll_outputs(OP, &*out, false)?) };
        ops::low_latency_dispatch_send(handle, &p, a, &ll_stats(OP, cumulative, wait)?, out.as_ref())
    })
}

/// See `deep_ep_ll_dispatch` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn deep_ep_ll_dispatch(
    handle: i64,
    p: *const RawLlParams,
    x: *const RawTensor,
    topk_idx: *const RawTensor,
    topk_weights: *const RawTensor,
    x_global_scale: *const RawTensor,
    cumulative: *const RawTensor,
    wait: *const RawTensor,
    out: *const RawLlDispatchOutputs,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_DISPATCH;
    guard(|| {
        let p = ll_params(OP, p)?;
        let a = ll_send_args(OP, x, topk_idx, topk_weights, x_global_scale)?;
        if out.is_null() {
            return Err(Error::invalid(OP, "outputs are required"));
        }
        ops::low_latency_dispatch(handle, &p, a, &ll_stats(OP, cumulative, wait)?, &ll_outputs(OP, &*out, true)?)
    })
}

/// See `deep_ep_ll_dispatch_recv` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_dispatch_recv(
    handle: i64,
    p: *const RawLlParams,
    out: *const RawLlDispatchOutputs,
    cumulative: *const RawTensor,
    wait: *const RawTensor,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_DISPATCH;
    guard(|| {
        let p = ll_params(OP, p)?;
        if out.is_null() {
            return Err(Error::invalid(OP, "outputs are required"));
        }
        ops::low_latency_dispatch_recv(handle, &p, &ll_outputs(OP, &*out, false)?, &ll_stats(OP, cumulative, wait)?)
    })
}

/// See `deep_ep_ll_combine_send` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_combine_send(
    handle: i64,
    p: *const RawLlParams,
    x: *const RawTensor,
    src_info: *const RawTensor,
    layout_range: *const RawTensor,
    recv_state: *const RawTensor,
    overlap: *const RawLlOverlap,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_COMBINE;
    guard(|| {
        let p = ll_params(OP, p)?;
        let send = ll_combine_inputs(OP, x, src_info, layout_range, recv_state, false)?;
        ops::low_latency_combine_send(handle, &p, send, ll_overlap(OP, overlap)?)
    })
}

/// See `deep_ep_ll_combine` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn deep_ep_ll_combine(
    handle: i64,
    p: *const RawLlParams,
    x: *const RawTensor,
    src_info: *const RawTensor,
    layout_range: *const RawTensor,
    overlap: *const RawLlOverlap,
    topk_idx: *const RawTensor,
    topk_weights: *const RawTensor,
    recv_state: *const RawTensor,
    out: *const RawTensor,
    wait: *const RawTensor,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_COMBINE;
    guard(|| {
        let p = ll_params(OP, p)?;
        let send = ll_combine_inputs(OP, x, src_info, layout_range, recv_state, true)?;
        let overlap = ll_overlap(OP, overlap)?;
        let (topk_idx, topk_weights, out) =
            (tensor(OP, "topk_idx", topk_idx)?, tensor(OP, "topk_weights", topk_weights)?, tensor(OP, "out", out)?);
        let wait = ll_stats(OP, std::ptr::null(), wait)?.wait_recv_cost_stats;
        let recv = LlCombineRecvArgs { topk_idx, topk_weights, recv_state: send.recv_state, out };
        ops::low_latency_combine(handle, &p, send, overlap, recv, wait)
    })
}

/// See `deep_ep_ll_combine_recv` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_combine_recv(
    handle: i64,
    p: *const RawLlParams,
    topk_idx: *const RawTensor,
    topk_weights: *const RawTensor,
    recv_state: *const RawTensor,
    out: *const RawTensor,
    wait: *const RawTensor,
) -> c_int {
    const OP: &str = crate::op_names::LOW_LATENCY_COMBINE;
    guard(|| {
        let p = ll_params(OP, p)?;
        let (topk_idx, topk_weights) = (tensor(OP, "topk_idx", topk_idx)?, tensor(OP, "topk_weights", topk_weights)?);
        let (recv_state, out) = (tensor(OP, "recv_state", recv_state)?, tensor(OP, "out", out)?);
        let wait = ll_stats(OP, std::ptr::null(), wait)?.wait_recv_cost_stats;
        ops::low_latency_combine_recv(handle, &p, topk_idx, topk_weights, recv_state, out, wait)
    })
}

/// See `deep_ep_ll_mask_rows` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_mask_rows(
    handle: i64,
    which: i32,
    topk_idx: *const RawTensor,
    num_tokens: *const RawTensor,
    out: *const RawTensor,
    stream: *mut c_void,
) -> c_int {
    let op = if which == 0 { crate::op_names::LOW_LATENCY_DISPATCH } else { crate::op_names::LOW_LATENCY_COMBINE };
    guard(|| {
        let (topk_idx, num_tokens, out) =
            (tensor(op, "topk_idx", topk_idx)?, tensor(op, "num_tokens", num_tokens)?, tensor(op, "out", out)?);
        ops::low_latency_mask_rows(handle, op, topk_idx, num_tokens, out, stream)
    })
}

/// See `deep_ep_ll_clean` in the header.
///
/// # Safety
/// Pointers from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_clean(handle: i64, p: *const RawLlParams) -> c_int {
    guard(|| ops::clean_low_latency_buffer(handle, &ll_params(crate::op_names::CLEAN_LOW_LATENCY_BUFFER, p)?))
}

/// See `deep_ep_ll_next_combine_buffer` in the header.
///
/// # Safety
/// Pointers from the shim; `view` writable.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_next_combine_buffer(handle: i64, p: *const RawLlParams, view: *mut RawTensor) -> c_int {
    guard(|| {
        let p = ll_params(crate::op_names::GET_NEXT_LOW_LATENCY_COMBINE_BUFFER, p)?;
        let t: TensorRef = ops::next_low_latency_combine_buffer(handle, &p)?;
        *view = raw_of(&t);
        Ok(())
    })
}

fn raw_of(t: &TensorRef) -> RawTensor {
    let mut sizes = [0i64; crate::tensor::MAX_DIMS];
    let mut strides = [0i64; crate::tensor::MAX_DIMS];
    sizes[..t.ndim()].copy_from_slice(t.sizes());
    strides[..t.ndim()].copy_from_slice(t.strides());
    RawTensor {
        data: t.data_ptr() as *mut c_void,
        dtype: t.dtype as i32,
        device: t.device.to_raw(),
        ndim: t.ndim() as i32,
        reserved: 0,
        sizes,
        strides,
    }
}
