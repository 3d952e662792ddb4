//! Bindings to the low-latency kernels (`kernels/ll_dispatch.cu`, `kernels/low_latency.cu`); protocol and struct in
//! `kernels/deep_ep_kernels.h` ("Low-latency mode"). Every launch is asynchronous on the given
//! stream and CUDA-graph capturable (no host sync, the call number lives on the device).

use super::intranode::Ctx;
use super::kernels::check;
use crate::error::Result;
use std::ffi::c_void;

/// Offset of the device copy of the LL rank mask in every window (`DEEP_EP_LL_MASK_OFF`):
/// `int32 [MAX_RANKS]` in the control area.
pub const LL_MASK_OFF: usize = super::intranode::CONTROL_BYTES - 1024 + 64;

/// `net_kind` of [`LlArgs`]: the LSA emulation of the RDMA leg (`DEEP_EP_LL_NET_LSA`).
pub const NET_LSA: i32 = 1;
/// `net_kind` of [`LlArgs`]: NCCL GIN (`DEEP_EP_LL_NET_GIN`).
pub const NET_GIN: i32 = 2;

/// Kind words of `recv_state` (`DEEP_EP_LL_KIND_*`).
pub const KIND_DISPATCH: i32 = 1;
pub const KIND_COMBINE: i32 = 2;

/// `deep_ep_ll_args_t`: one struct for the five LL launches (unused fields null / 0).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct LlArgs {
    pub ll_off: u64,
    pub signal_bytes: u64,
    pub send_bytes: u64,
    pub recv_bytes: u64,
    pub msg_bytes: u64,
    pub idx_off: u64,
    pub msgs_off: u64,
    pub partial_off: u64,
    pub num_max_tokens: i32,
    pub hidden: i32,
    pub num_experts: i32,
    pub half: i32,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    pub flags: i32,
    pub zero_copy: i32,
    pub num_tokens: i32,
    pub num_topk: i32,
    pub topk_is_int64: i32,
    pub x: *const c_void,
    pub topk_idx: *const c_void,
    pub topk_weights: *const f32,
    pub recv_state: *mut i64,
    pub recv_x: *mut c_void,
    pub recv_scales: *mut c_void,
    pub scale_stride: [i64; 3],
    pub recv_count: *mut i32,
    pub src_info: *mut i32,
    pub layout_range: *mut i64,
    pub cumulative: *mut i32,
    pub wait_stats: *mut i64,
    pub out: *mut u16,
    pub mask: *const i32,
    pub shrink_mask: *mut i32,
    pub num_blocks: i32,
    pub partial: i32,
    pub dispatch_half: i32,
    pub reserved: i32,
    /// Seam descriptor in this rank's window, or null (every peer over NVLink pointers).
    pub net: *const c_void,
    /// Window offset of the sender's shadows of the remote seam signals (`u64 [4 E]`).
    pub shadow_off: u64,
    /// Dispatch staging in a send half (`backend::nccl::ll_seam::Staging`).
    pub stage_meta_off: u64,
    pub stage_idx_off: u64,
    pub stage_cnt_off: u64,
    /// Ranks per NVLink domain (peers outside the caller's are remote).
    pub nvl_domain: i32,
    /// [`NET_LSA`] or [`NET_GIN`].
    pub net_kind: i32,
}

impl Default for LlArgs {
    fn default() -> Self {
        LlArgs {
            ll_off: 0,
            signal_bytes: 0,
            send_bytes: 0,
            recv_bytes: 0,
            msg_bytes: 0,
            idx_off: 0,
            msgs_off: 0,
            partial_off: 0,
            num_max_tokens: 0,
            hidden: 0,
            num_experts: 0,
            half: 0,
            use_fp8: 0,
            round_scale: 0,
            use_ue8m0: 0,
            flags: 0,
            zero_copy: 0,
            num_tokens: 0,
            num_topk: 0,
            topk_is_int64: 0,
            x: std::ptr::null(),
            topk_idx: std::ptr::null(),
            topk_weights: std::ptr::null(),
            recv_state: std::ptr::null_mut(),
            recv_x: std::ptr::null_mut(),
            recv_scales: std::ptr::null_mut(),
            scale_stride: [0; 3],
            recv_count: std::ptr::null_mut(),
            src_info: std::ptr::null_mut(),
            layout_range: std::ptr::null_mut(),
            cumulative: std::ptr::null_mut(),
            wait_stats: std::ptr::null_mut(),
            out: std::ptr::null_mut(),
            mask: std::ptr::null(),
            shrink_mask: std::ptr::null_mut(),
            num_blocks: 0,
            partial: 0,
            dispatch_half: 0,
            reserved: 0,
            net: std::ptr::null(),
            shadow_off: 0,
            stage_meta_off: 0,
            stage_idx_off: 0,
            stage_cnt_off: 0,
            nvl_domain: 0,
            net_kind: 0,
        }
    }
}

extern "C" {
    fn deep_ep_llk_dispatch_send(ctx: *const Ctx, args: *const LlArgs, stream: *mut c_void) -> i32;
    fn deep_ep_llk_dispatch_recv(ctx: *const Ctx, args: *const LlArgs, stream: *mut c_void) -> i32;
    fn deep_ep_llk_combine_send(ctx: *const Ctx, args: *const LlArgs, stream: *mut c_void) -> i32;
    fn deep_ep_llk_combine_recv(ctx: *const Ctx, args: *const LlArgs, stream: *mut c_void) -> i32;
    fn deep_ep_llk_zero_signals(ctx: *const Ctx, args: *const LlArgs, stream: *mut c_void) -> i32;
    fn deep_ep_llk_args_bytes() -> usize;
}

/// Compares the Rust mirror's size with the C struct's.
pub fn check_struct_size(op: &'static str) -> Result<()> {
    // SAFETY: pure size query.
    let c = unsafe { deep_ep_llk_args_bytes() };
    crate::ensure!(
        c == std::mem::size_of::<LlArgs>(),
        op,
        "internal: deep_ep_ll_args_t is {c} bytes in C, {} in Rust",
        std::mem::size_of::<LlArgs>()
    );
    Ok(())
}

// The launches below are sound because `Ctx` comes from a live window and every pointer in
// `LlArgs` is null or the data of a live tensor of the shape the kernel reads/writes (checked by
// `crate::ops` and `backend::nccl::low_latency` before the struct is built); the LL area offsets
// are checked against the window size on the C side (cudaErrorInvalidValue otherwise).

/// Send phase of an LL dispatch.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced here
pub fn dispatch_send(op: &'static str, ctx: &Ctx, a: &LlArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: see the comment above; both structs are read by value.
    check(unsafe { deep_ep_llk_dispatch_send(ctx, a, stream) }, op, "low-latency dispatch send kernel launch")
}

/// Receive phase of an LL dispatch.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn dispatch_recv(op: &'static str, ctx: &Ctx, a: &LlArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: see the comment above.
    check(unsafe { deep_ep_llk_dispatch_recv(ctx, a, stream) }, op, "low-latency dispatch receive kernel launch")
}

/// Send phase of an LL combine.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn combine_send(op: &'static str, ctx: &Ctx, a: &LlArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: see the comment above.
    check(unsafe { deep_ep_llk_combine_send(ctx, a, stream) }, op, "low-latency combine send kernel launch")
}

/// Receive phase of an LL combine.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn combine_recv(op: &'static str, ctx: &Ctx, a: &LlArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: see the comment above.
    check(unsafe { deep_ep_llk_combine_recv(ctx, a, stream) }, op, "low-latency combine receive kernel launch")
}

/// Zeroes this rank's LL signal words of both halves.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn zero_signals(op: &'static str, ctx: &Ctx, a: &LlArgs, stream: *mut c_void) -> Result<()> {
    // SAFETY: writes 2 * signal_bytes of this rank's own window at ll_off (checked on the C side).
    check(unsafe { deep_ep_llk_zero_signals(ctx, a, stream) }, op, "low-latency signal reset kernel launch")
}
