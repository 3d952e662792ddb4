//! The `extern "C"` functions declared in `csrc/deep_ep_capi.h`. Each one converts its raw
//! arguments into plain values ([`TensorRef`]s, the tensor groups of `crate::op_io`, integers),
//! calls `crate::ops` (which alone checks them, builds the backends' argument structs and calls
//! the backend), and turns every error and every panic into a nonzero status plus a
//! thread-local message, so nothing unwinds into C++.

use crate::config::UNIQUE_ID_BYTES;
use crate::error::{Error, Result};
use crate::ops;
use crate::tensor::{DType, Device, TensorRef, MAX_DIMS};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// `deep_ep_tensor_t`.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct RawTensor {
    pub(crate) data: *mut c_void,
    pub(crate) dtype: i32,
    pub(crate) device: i32,
    pub(crate) ndim: i32,
    pub(crate) reserved: i32,
    pub(crate) sizes: [i64; MAX_DIMS],
    pub(crate) strides: [i64; MAX_DIMS],
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, mapping errors and panics to a status code (0 ok, 1 error, 2 internal panic).
pub(crate) fn guard(f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_error(e.to_string());
            1
        }
        Err(p) => {
            let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            set_error(format!("deep_ep: internal error (please report): {what}"));
            2
        }
    }
}

/// Message of the last failed call on this thread.
#[no_mangle]
pub extern "C" fn deep_ep_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Reads an optional descriptor: NULL or `ndim == -1` is absent.
///
/// # Safety
/// `p` is NULL or points to a descriptor built by the shim from a live tensor.
pub(crate) unsafe fn opt_tensor(op: &'static str, name: &str, p: *const RawTensor) -> Result<Option<TensorRef>> {
    if p.is_null() || (*p).ndim < 0 {
        return Ok(None);
    }
    let r = &*p;
    let dtype = DType::from_raw(r.dtype).ok_or_else(|| Error::invalid(op, format!("{name} has an unknown dtype code {}", r.dtype)))?;
    let nd = r.ndim as usize;
    if nd > MAX_DIMS {
        return Err(Error::invalid(op, format!("{name} has {nd} dimensions, more than any op accepts")));
    }
    if r.sizes[..nd].iter().any(|&s| s < 0) {
        return Err(Error::invalid(op, format!("{name} has a negative size")));
    }
    Ok(Some(TensorRef::new(r.data as *mut u8, dtype, Device::from_raw(r.device), &r.sizes[..nd], &r.strides[..nd])))
}

/// Reads a required descriptor.
///
/// # Safety
/// As [`opt_tensor`].
pub(crate) unsafe fn tensor(op: &'static str, name: &str, p: *const RawTensor) -> Result<TensorRef> {
    opt_tensor(op, name, p)?.ok_or_else(|| Error::invalid(op, format!("{name} is required")))
}

pub(crate) fn check_size(op: &'static str, got: u32, want: usize) -> Result<()> {
    if got as usize != want {
        return Err(Error::invalid(
            op,
            format!("argument struct size {got} != {want}: the shim and the library were built from different headers"),
        ));
    }
    Ok(())
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn str_arg(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// See `deep_ep_build_info` in the header: a JSON object valid for the life of the process.
#[no_mangle]
pub extern "C" fn deep_ep_build_info() -> *const c_char {
    static INFO: std::sync::OnceLock<CString> = std::sync::OnceLock::new();
    INFO.get_or_init(|| CString::new(crate::build_info::json()).unwrap_or_default()).as_ptr()
}

/// See `deep_ep_get_unique_id` in the header.
///
/// # Safety
/// `out` points to `DEEP_EP_UNIQUE_ID_BYTES` writable bytes; `backend` is NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_get_unique_id(backend: *const c_char, device: i32, out: *mut u8) -> c_int {
    guard(|| {
        let id = ops::get_unique_id(&str_arg(backend), Device::from_raw(device))?;
        std::ptr::copy_nonoverlapping(id.as_ptr(), out, UNIQUE_ID_BYTES.min(id.len()));
        Ok(())
    })
}

/// See `deep_ep_create_buffer` in the header.
///
/// # Safety
/// `unique_id` points to `unique_id_len` bytes; `handle` is writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn deep_ep_create_buffer(
    unique_id: *const u8,
    unique_id_len: i64,
    rank: i64,
    num_ranks: i64,
    device: i32,
    num_nvl_bytes: i64,
    num_rdma_bytes: i64,
    low_latency_mode: i32,
    backend: *const c_char,
    handle: *mut i64,
) -> c_int {
    guard(|| {
        crate::ensure!(unique_id_len >= 0, crate::op_names::CREATE_BUFFER, "unique_id length must be >= 0");
        let id = std::slice::from_raw_parts(unique_id, unique_id_len as usize);
        let ll = low_latency_mode != 0;
        *handle = ops::create_buffer(id, rank, num_ranks, Device::from_raw(device), num_nvl_bytes, num_rdma_bytes, ll, &str_arg(backend))?;
        Ok(())
    })
}

/// See `deep_ep_destroy_buffer` in the header.
#[no_mangle]
pub extern "C" fn deep_ep_destroy_buffer(handle: i64) -> c_int {
    guard(|| ops::destroy_buffer(handle))
}

/// See `deep_ep_bind_buffer_slot` in the header.
#[no_mangle]
pub extern "C" fn deep_ep_bind_buffer_slot(handle: i64, slot: i64) -> c_int {
    guard(|| ops::bind_buffer_slot(handle, slot))
}

/// See `deep_ep_buffer_info` in the header.
///
/// # Safety
/// `out` points to 7 writable int64; `op` is NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_buffer_info(handle: i64, op: *const c_char, out: *mut i64) -> c_int {
    guard(|| {
        let v = ops::buffer_info(handle, op_name(&str_arg(op)))?;
        std::ptr::copy_nonoverlapping(v.as_ptr(), out, v.len());
        Ok(())
    })
}

/// See `deep_ep_ll_whole_hooks` in the header.
///
/// # Safety
/// `out` points to one writable int32; `op` is NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_whole_hooks(handle: i64, op: *const c_char, out: *mut i32) -> c_int {
    guard(|| {
        *out = ops::low_latency_whole_hooks(handle, op_name(&str_arg(op)))? as i32;
        Ok(())
    })
}

/// See `deep_ep_get_local_buffer` in the header.
///
/// # Safety
/// `data`, `numel` and `device` are writable; `dtype_name` is NULL or a C string.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn deep_ep_get_local_buffer(
    handle: i64,
    use_rdma_buffer: i32,
    offset: i64,
    element_bytes: i64,
    dtype_name: *const c_char,
    data: *mut *mut c_void,
    numel: *mut i64,
    device: *mut i32,
) -> c_int {
    guard(|| {
        let v = ops::get_local_buffer(handle, use_rdma_buffer != 0, offset, element_bytes, &str_arg(dtype_name))?;
        *data = v.ptr as *mut c_void;
        *numel = v.numel;
        *device = v.device.to_raw();
        Ok(())
    })
}

/// Maps a caller-supplied op name onto the static names errors carry.
fn op_name(name: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        crate::op_names::DISPATCH,
        crate::op_names::CACHED_DISPATCH,
        crate::op_names::COMBINE,
        crate::op_names::LOW_LATENCY_DISPATCH,
        crate::op_names::LOW_LATENCY_DISPATCH_SEND,
        crate::op_names::LOW_LATENCY_DISPATCH_RECV,
        crate::op_names::LOW_LATENCY_COMBINE,
        crate::op_names::LOW_LATENCY_COMBINE_SEND,
        crate::op_names::LOW_LATENCY_COMBINE_RECV,
        crate::op_names::CLEAN_LOW_LATENCY_BUFFER,
        crate::op_names::GET_NEXT_LOW_LATENCY_COMBINE_BUFFER,
        crate::op_names::GET_LOCAL_BUFFER_TENSOR,
        crate::op_names::LOW_LATENCY_QUERY_MASK_BUFFER,
        crate::op_names::WAIT_STATS,
        crate::op_names::INTERNODE_DISPATCH,
        crate::op_names::INTERNODE_CACHED_DISPATCH,
        crate::op_names::INTERNODE_COMBINE,
    ];
    KNOWN.iter().find(|k| **k == name).copied().unwrap_or(crate::op_names::BUFFER_INFO)
}

/// See `deep_ep_buffer_size_hint` in the header.
///
/// # Safety
/// `cfg` points to `len` int64; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_buffer_size_hint(
    cfg: *const i64,
    len: i64,
    hidden_bytes: i64,
    num_ranks: i64,
    which: i32,
    out: *mut i64,
) -> c_int {
    guard(|| {
        *out = ops::buffer_size_hint(std::slice::from_raw_parts(cfg, len.max(0) as usize), hidden_bytes, num_ranks, which != 0)?;
        Ok(())
    })
}

/// See `deep_ep_low_latency_rdma_size_hint` in the header.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_low_latency_rdma_size_hint(t: i64, hidden: i64, num_ranks: i64, num_experts: i64, out: *mut i64) -> c_int {
    guard(|| {
        *out = ops::low_latency_rdma_size_hint(t, hidden, num_ranks, num_experts)?;
        Ok(())
    })
}

/// See `deep_ep_nvl_domain_size` in the header.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_nvl_domain_size(out: *mut i64) -> c_int {
    guard(|| {
        *out = ops::nvl_domain_size()? as i64;
        Ok(())
    })
}

/// See `deep_ep_check_environment` in the header.
///
/// # Safety
/// `out` points to `out_len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_check_environment(device: i32, out: *mut c_char, out_len: i64) -> c_int {
    guard(|| {
        let summary = ops::check_environment(Device::from_raw(device))?;
        let n = summary.len().min((out_len.max(1) - 1) as usize);
        std::ptr::copy_nonoverlapping(summary.as_ptr() as *const c_char, out, n);
        *out.add(n) = 0;
        Ok(())
    })
}

/// See `deep_ep_check_dispatch_layout` in the header.
///
/// # Safety
/// Descriptor from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_check_dispatch_layout(topk_idx: *const RawTensor, num_experts: i64, num_ranks: i64) -> c_int {
    guard(|| ops::check_dispatch_layout(&tensor(crate::op_names::GET_DISPATCH_LAYOUT, "topk_idx", topk_idx)?, num_experts, num_ranks))
}

/// See `deep_ep_get_dispatch_layout` in the header.
///
/// # Safety
/// Descriptors from the shim.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_get_dispatch_layout(
    topk_idx: *const RawTensor,
    num_experts: i64,
    num_ranks: i64,
    ntpr: *const RawTensor,
    ntprr: *const RawTensor,
    ntpe: *const RawTensor,
    in_rank: *const RawTensor,
    stream: *mut c_void,
) -> c_int {
    const OP: &str = crate::op_names::GET_DISPATCH_LAYOUT;
    guard(|| {
        let idx = tensor(OP, "topk_idx", topk_idx)?;
        ops::check_dispatch_layout(&idx, num_experts, num_ranks)?;
        let out = ops::LayoutOutputs {
            num_tokens_per_rank: tensor(OP, "num_tokens_per_rank", ntpr)?,
            num_tokens_per_rdma_rank: opt_tensor(OP, "num_tokens_per_rdma_rank", ntprr)?,
            num_tokens_per_expert: tensor(OP, "num_tokens_per_expert", ntpe)?,
            is_token_in_rank: tensor(OP, "is_token_in_rank", in_rank)?,
        };
        ops::get_dispatch_layout(&idx, num_experts as usize, num_ranks as usize, &out, stream)
    })
}

/// See `deep_ep_ll_mask` in the header.
///
/// # Safety
/// `out` points to `out_len` writable int32 (may be NULL unless `action` is 1).
#[no_mangle]
pub unsafe extern "C" fn deep_ep_ll_mask(handle: i64, action: i32, rank: i64, value: i32, out: *mut i32, out_len: i64) -> c_int {
    guard(|| match action {
        0 => ops::low_latency_update_mask(handle, rank, value != 0),
        1 => {
            const OP: &str = crate::op_names::LOW_LATENCY_QUERY_MASK_BUFFER;
            let m = ops::low_latency_query_mask(handle)?;
            crate::ensure!(
                !out.is_null() && out_len as usize == m.len(),
                OP,
                "mask_status must have num_ranks = {} elements, got {out_len}",
                m.len()
            );
            std::ptr::copy_nonoverlapping(m.as_ptr(), out, m.len());
            Ok(())
        }
        2 => ops::low_latency_clean_mask(handle),
        3 => ops::low_latency_set_shrink(handle, value != 0),
        _ => Err(Error::invalid(crate::op_names::LOW_LATENCY_UPDATE_MASK_BUFFER, format!("internal: unknown mask action {action}"))),
    })
}

/// See `deep_ep_wait_stats` in the header.
///
/// # Safety
/// `out` points to `out_len` writable int64.
#[no_mangle]
pub unsafe extern "C" fn deep_ep_wait_stats(handle: i64, reset: i32, out: *mut i64, out_len: i64) -> c_int {
    guard(|| {
        let v = ops::wait_stats(handle, reset != 0)?;
        crate::ensure!(
            !out.is_null() && out_len as usize == 2 * v.len(),
            crate::op_names::WAIT_STATS,
            "internal: output must hold {} int64, got {out_len}",
            2 * v.len()
        );
        for (i, w) in v.iter().enumerate() {
            *out.add(2 * i) = w[0];
            *out.add(2 * i + 1) = w[1];
        }
        Ok(())
    })
}
