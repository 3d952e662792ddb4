//! Binding of `kernels/ll_rows.cu`: the real token count of a low-latency call as a device
//! scalar (declared in `kernels/deep_ep_kernels.h`; keep both in step).

use super::kernels::check;
use crate::backend::{LlRowsArgs, Stream};
use crate::error::Result;
use crate::tensor::DType;
use std::ffi::{c_int, c_void};

extern "C" {
    fn deep_ep_launch_ll_mask_rows(
        topk_idx: *const c_void, // device [N, K] int32 or int64, row-major
        topk_idx_is_int64: c_int,
        num_rows: i64,          // N >= 0
        num_topk: c_int,        // K > 0
        num_tokens: *const i32, // device int32 scalar n (clamped to 0..=N on the device)
        out: *mut c_void,       // device [N, K], dtype of topk_idx, written
        stream: *mut c_void,    // cudaStream_t
    ) -> c_int;
}

/// Launches the row mask of [`crate::backend::Backend::ll_mask_rows`] on `stream` (no host sync,
/// capturable). `a` was validated by `crate::ops`: `[N, K]` contiguous CUDA tensors of one dtype
/// (int32 or int64) and an int32 scalar, all on the current device.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced here
pub fn mask_rows(op: &'static str, a: &LlRowsArgs, stream: Stream) -> Result<()> {
    let (n, k) = (a.topk_idx.size(0), a.topk_idx.size(1));
    // SAFETY: the pointers are live device allocations of the validated shapes (the caller keeps
    // the tensors alive for the call); the launch is asynchronous and reads/writes only those.
    let status = unsafe {
        deep_ep_launch_ll_mask_rows(
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
