//! C API of the internode normal-mode ops (see `csrc/deep_ep_capi.h`, "internode").

use crate::api::buffer::{check_size, guard, opt_tensor, tensor, RawTensor};
use crate::api::modes::{dispatch_args_as, RawDispatchArgs};
use crate::error::Result;
use crate::op_io::{CombineOutputs, DispatchPlan, InternodeDispatchOutputs, InternodeHandle, InternodePlan};
use crate::ops::{self, CombineInputs, DispatchRequest};
use crate::tensor::TensorRef;
use std::ffi::{c_int, c_void};

const DISPATCH: &str = crate::op_names::INTERNODE_DISPATCH;
const CACHED: &str = crate::op_names::INTERNODE_CACHED_DISPATCH;
const COMBINE: &str = crate::op_names::INTERNODE_COMBINE;

/// `deep_ep_internode_handle_t`: the 10 tensors in DeepEP's order.
#[repr(C)]
pub struct RawInternodeHandle {
    t: [RawTensor; 10],
}

/// `deep_ep_internode_plan_t`.
#[repr(C)]
pub struct RawInternodePlan {
    size: u32,
    num_recv_tokens: i64,
    num_rows: i64,
    num_rdma_recv_tokens: i64,
    num_rdma_rows: i64,
}

const NAMES: [&str; 10] = [
    "is_token_in_rank",
    "rdma_channel_prefix_matrix",
    "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix",
    "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix",
    "recv_gbl_rank_prefix_sum",
    "recv_src_meta",
    "send_rdma_head",
    "send_nvl_head",
];

unsafe fn handle_of(op: &'static str, h: &RawInternodeHandle) -> Result<InternodeHandle> {
    let t = |i: usize| tensor(op, NAMES[i], &h.t[i]);
    Ok(InternodeHandle {
        is_token_in_rank: t(0)?,
        rdma_channel_prefix_matrix: t(1)?,
        gbl_channel_prefix_matrix: t(2)?,
        recv_rdma_channel_prefix_matrix: t(3)?,
        recv_rdma_rank_prefix_sum: t(4)?,
        recv_gbl_channel_prefix_matrix: t(5)?,
        recv_gbl_rank_prefix_sum: t(6)?,
        recv_src_meta: t(7)?,
        send_rdma_head: t(8)?,
        send_nvl_head: t(9)?,
    })
}

unsafe fn args_of(args: *const RawDispatchArgs, per_rdma: *const RawTensor) -> Result<(DispatchRequest, TensorRef)> {
    Ok((dispatch_args_as(DISPATCH, args)?, tensor(DISPATCH, "num_tokens_per_rdma_rank", per_rdma)?))
}

/// See `deep_ep_internode_dispatch_prepare` in the header.
///
/// # Safety
/// Pointers from the shim: args/plan valid, `per_expert` has `per_expert_len` writable int32.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_internode_dispatch_prepare(
    handle: i64,
    args: *const RawDispatchArgs,
    num_tokens_per_rdma_rank: *const RawTensor,
    plan: *mut RawInternodePlan,
    per_expert: *mut i32,
    per_expert_len: i64,
) -> c_int {
    guard(|| {
        let (a, per_rdma) = args_of(args, num_tokens_per_rdma_rank)?;
        let p = ops::internode_dispatch_prepare(handle, &a, per_rdma)?;
        let pe = std::slice::from_raw_parts_mut(per_expert, per_expert_len.max(0) as usize);
        crate::ensure!(
            pe.len() == p.plan.num_recv_tokens_per_expert.len(),
            DISPATCH,
            "internal: per-expert buffer of {} for {} local experts",
            pe.len(),
            p.plan.num_recv_tokens_per_expert.len()
        );
        pe.copy_from_slice(&p.plan.num_recv_tokens_per_expert);
        *plan = RawInternodePlan {
            size: std::mem::size_of::<RawInternodePlan>() as u32,
            num_recv_tokens: p.plan.num_recv_tokens as i64,
            num_rows: p.plan.num_rows as i64,
            num_rdma_recv_tokens: p.num_rdma_recv_tokens as i64,
            num_rdma_rows: p.num_rdma_rows as i64,
        };
        Ok(())
    })
}

/// See `deep_ep_internode_dispatch_finish` in the header.
///
/// # Safety
/// Pointers from the shim; `out` holds recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights
/// then the handle.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_internode_dispatch_finish(
    handle: i64,
    args: *const RawDispatchArgs,
    num_tokens_per_rdma_rank: *const RawTensor,
    plan: *const RawInternodePlan,
    data: *const RawTensor,
    h: *const RawInternodeHandle,
) -> c_int {
    const OP: &str = DISPATCH;
    guard(|| {
        let (a, per_rdma) = args_of(args, num_tokens_per_rdma_rank)?;
        let p = &*plan;
        check_size(OP, p.size, std::mem::size_of::<RawInternodePlan>())?;
        let plan = InternodePlan {
            plan: DispatchPlan {
                num_recv_tokens: p.num_recv_tokens as usize,
                num_rows: p.num_rows as usize,
                num_recv_tokens_per_expert: vec![],
            },
            num_rdma_recv_tokens: p.num_rdma_recv_tokens as usize,
            num_rdma_rows: p.num_rdma_rows as usize,
        };
        let d = std::slice::from_raw_parts(data, 4);
        let o = InternodeDispatchOutputs {
            recv_x: tensor(OP, "recv_x", &d[0])?,
            recv_x_scales: opt_tensor(OP, "recv_x_scales", &d[1])?,
            recv_topk_idx: opt_tensor(OP, "recv_topk_idx", &d[2])?,
            recv_topk_weights: opt_tensor(OP, "recv_topk_weights", &d[3])?,
            handle: handle_of(OP, &*h)?,
        };
        ops::internode_dispatch_finish(handle, &a, per_rdma, &plan, &o)
    })
}

/// See `deep_ep_internode_cached_dispatch` in the header.
///
/// # Safety
/// Pointers from the shim; `recv_x` NULL means validate only; `config` has 5 int64.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_internode_cached_dispatch(
    handle: i64,
    x: *const RawTensor,
    x_scales: *const RawTensor,
    h: *const RawInternodeHandle,
    config: *const i64,
    stream: *mut c_void,
    recv_x: *const RawTensor,
    recv_x_scales: *const RawTensor,
) -> c_int {
    guard(|| {
        let recv = match opt_tensor(CACHED, "recv_x", recv_x)? {
            None => None,
            Some(rx) => Some((rx, opt_tensor(CACHED, "recv_x_scales", recv_x_scales)?)),
        };
        let (x, x_scales) = (tensor(CACHED, "x", x)?, opt_tensor(CACHED, "x_scales", x_scales)?);
        let config = std::slice::from_raw_parts(config, 5);
        ops::internode_cached_dispatch(handle, x, x_scales, handle_of(CACHED, &*h)?, config, stream, recv)
    })
}

/// See `deep_ep_internode_combine` in the header.
///
/// # Safety
/// Pointers from the shim; `combined_x` NULL means validate only; `config` has 5 int64;
/// `inputs` holds x, topk_weights, bias_0, bias_1.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_internode_combine(
    handle: i64,
    inputs: *const RawTensor,
    h: *const RawInternodeHandle,
    config: *const i64,
    stream: *mut c_void,
    combined_x: *const RawTensor,
    combined_w: *const RawTensor,
) -> c_int {
    guard(|| {
        let i = std::slice::from_raw_parts(inputs, 4);
        let inputs = CombineInputs {
            x: tensor(COMBINE, "x", &i[0])?,
            topk_weights: opt_tensor(COMBINE, "topk_weights", &i[1])?,
            bias_0: opt_tensor(COMBINE, "bias_0", &i[2])?,
            bias_1: opt_tensor(COMBINE, "bias_1", &i[3])?,
        };
        let out = match opt_tensor(COMBINE, "combined_x", combined_x)? {
            None => None,
            Some(cx) => {
                Some(CombineOutputs { combined_x: cx, combined_topk_weights: opt_tensor(COMBINE, "combined_topk_weights", combined_w)? })
            }
        };
        let config = std::slice::from_raw_parts(config, 5);
        ops::internode_combine(handle, inputs, handle_of(COMBINE, &*h)?, config, stream, out.as_ref())
    })
}

/// See `deep_ep_num_rdma_ranks` in the header.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_num_rdma_ranks(num_ranks: i64, out: *mut i64) -> c_int {
    guard(|| {
        *out = ops::num_rdma_entries(num_ranks.max(0) as usize)? as i64;
        Ok(())
    })
}
