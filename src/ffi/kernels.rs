//! Bindings to the C launch API of `kernels/*.cu` (placeholder until the build lands).

use crate::error::{Error, Result};
use crate::tensor::TensorRef;
use std::ffi::c_void;

/// `get_dispatch_layout` on the GPU.
#[allow(clippy::too_many_arguments)]
pub fn dispatch_layout(_topk_idx: &TensorRef, _e: usize, _r: usize, _ntpr: &TensorRef, _ntprr: Option<&TensorRef>, _ntpe: &TensorRef, _in_rank: &TensorRef, _stream: *mut c_void) -> Result<()> {
    Err(Error::NotImplemented { op: "deep_ep::get_dispatch_layout", backend: "cuda", feature: "the layout kernel" })
}
