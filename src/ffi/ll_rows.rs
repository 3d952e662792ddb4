//! Binding of `kernels/ll_rows.cu`: the real token count of a low-latency call as a device
//! scalar (declared in `kernels/deep_ep_kernels.h`; keep both in step).

use super::kernels::check;
use crate::backend::{LlRowsArgs, Stream};
use crate::error::Result;
use crate::sys::kernels::*;
use crate::tensor::DType;
use std::ffi::{c_int, c_void};

/// Launches the row mask of [`crate::backend::Backend::ll_mask_rows`] on `stream` (no host sync,
/// capturable). `a` was validated by `crate::ops`: `[N, K]` contiguous CUDA tensors of one dtype
/// (int32 or int64) and an int32 scalar, all on the current device.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced here
pub fn mask_rows(op: &'static str, a: &LlRowsArgs, stream: Stream) -> Result<()> {
    let (n, k) = (a.topk_idx.size(0), a.topk_idx.size(1));
    // SAFETY: the pointers are live device allocations of the validated shapes (the caller keeps
    // the tensors alive for the call); the launch is asynchronous and reads/writes only those.
    let status = unsafe {
        dek_ll_mask_rows(
            a.topk_idx.data_ptr() as *const c_void,
            (a.topk_idx.dtype == DType::Int64) as c_int,
            n as i64,
            k as c_int,
            a.num_tokens.data_ptr() as *const i32,
            a.out.data_ptr() as *mut c_void,
            stream,
        )
    };
    check(status, op, "the num_tokens row mask kernel (kernels/ll_rows.cu)")
}
