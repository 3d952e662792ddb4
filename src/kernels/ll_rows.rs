//! Binding of `kernels/ll_rows.cu`: the real token count of a low-latency call as a device
//! scalar (`dek_ll_mask_rows` of `kernels/deep_ep_kernels.h`).

use crate::error::Result;
use crate::kernels::layout::check;
use crate::sys::kernels::*;
use crate::tensor::{DType, Stream, TensorRef};
use std::ffi::{c_int, c_void};

/// Launches the row mask of an LL call's `num_tokens` on `stream` (no host sync, capturable):
/// rows of `topk_idx` below the device scalar `num_tokens` copied to `out`, the rest −1. Validated
/// by `crate::ops`: `[N, K]` contiguous CUDA tensors of one dtype
/// (int32 or int64) and an int32 scalar, all on the current device.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced here
pub fn mask_rows(op: &'static str, topk_idx: &TensorRef, num_tokens: &TensorRef, out: &TensorRef, stream: Stream) -> Result<()> {
    let (n, k) = (topk_idx.size(0), topk_idx.size(1));
    // SAFETY: the pointers are live device allocations of the validated shapes (the caller keeps
    // the tensors alive for the call); the launch is asynchronous and reads/writes only those.
    let status = unsafe {
        dek_ll_mask_rows(
            topk_idx.data_ptr() as *const c_void,
            (topk_idx.dtype == DType::Int64) as c_int,
            n as i64,
            k as c_int,
            num_tokens.data_ptr() as *const i32,
            out.data_ptr() as *mut c_void,
            stream,
        )
    };
    check(status, op, "the num_tokens row mask kernel (kernels/ll_rows.cu)")
}
