//! Bindings of the internode normal-mode kernels (`kernels/internode_*.cu`; protocol and window
//! layout in `kernels/deep_ep_kernels.h`, "Internode normal mode"). One argument struct serves
//! every step; [`launch`] runs one step asynchronously on a stream (CUDA-graph capturable).
//! The struct carries raw device pointers that the backend fills only from live tensors validated
//! by `crate::ops` and from the buffer's own window.

use super::intranode::Ctx;
use super::kernels::check;
use super::transport::LsaDesc;
use crate::error::Result;
use std::ffi::{c_int, c_void};

/// Internode control area of every window (`DEEP_EP_IN_CTRL_OFF`, `DEEP_EP_IN_CTRL_BYTES`).
pub const CTRL_OFF: usize = super::intranode::CONTROL_BYTES + (256 << 10);
pub const CTRL_BYTES: usize = 128 << 10;
/// Offset and size of the seam signal table of the LSA emulation (`internode.cuh`).
pub const SIGNAL_OFF: u64 = CTRL_OFF as u64;
pub const NUM_SIGNALS: i32 = 32;
/// Where a normal-mode buffer over GIN keeps its `GinNet` descriptor, and the bytes reserved for
/// it (`DEEP_EP_IN_NET_OFF`, `DEEP_EP_IN_NET_BYTES`: the free end of the internode control area).
pub const NET_OFF: usize = CTRL_OFF + (80 << 10);
pub const NET_BYTES: usize = 16 << 10;
/// Seam signals the kernels use from [`InArgs::sig_base`] (`DEEP_EP_IN_SEAM_SIGNALS`): global
/// barriers at [`SIG_BAR`] + source node, seam steps at [`SIG_STEP`] + source node (`kSigBar`,
/// `kSigStep` of `internode.cuh`; at most 8 nodes), all on context 0.
pub const SEAM_SIGNALS: usize = 16;
pub const SIG_BAR: usize = 0;
pub const SIG_STEP: usize = 8;
/// Most nodes (NVLink domains) of an internode normal-mode buffer (`kMaxNodes`).
pub const MAX_NODES: usize = 8;
/// [`InArgs::net_kind`]: the LSA emulation over [`InArgs::lsa`] (`DEEP_EP_IN_NET_LSA`).
pub const NET_LSA: i32 = 1;
/// [`InArgs::net_kind`]: NCCL GIN over the `GinNet` at [`InArgs::net`] (`DEEP_EP_IN_NET_GIN`).
pub const NET_GIN: i32 = 2;

/// Steps of [`launch`] (`DEEP_EP_IN_*`).
pub mod step {
    pub const SEND_SIDE: i32 = 0;
    pub const NOTIFY: i32 = 1;
    pub const RDMA_SEND: i32 = 2;
    pub const STEP: i32 = 3;
    pub const NVL_RECV: i32 = 4;
    pub const C_BEGIN: i32 = 5;
    pub const C_STAGE: i32 = 6;
    pub const C_NODEBAR: i32 = 7;
    pub const C_FORWARD: i32 = 8;
    pub const C_FINAL: i32 = 9;
}

/// Op kinds (`DEEP_EP_IN_KIND_*`).
pub mod kind {
    pub const DISPATCH: i32 = 1;
    pub const CACHED: i32 = 2;
    pub const COMBINE: i32 = 3;
}

/// `deep_ep_in_args_t` (null pointer = absent).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct InArgs {
    pub lsa: LsaDesc,
    pub kind: i32,
    pub nvl_size: i32,
    pub num_rdma_ranks: i32,
    pub num_channels: i32,
    pub num_local_experts: i32,
    pub num_topk: i32,
    pub num_scales: i32,
    pub topk_is_int64: i32,
    pub expert_alignment: i32,
    pub write_host_counts: i32,
    pub input_checked: i32,
    pub node_barrier: i32,
    pub num_blocks: i32,
    pub signature: i32,
    pub num_tokens: i64,
    pub row_bytes: i64,
    pub num_worst: i64,
    pub num_rows: i64,
    pub num_rdma_rows: i64,
    pub scale_stride0: i64,
    pub scale_stride1: i64,
    pub data_off: u64,
    pub data_end: u64,
    pub block_bytes: u64,
    pub record_bytes: u64,
    pub x: *const c_void,
    pub x_scales: *const c_void,
    pub topk_idx: *const c_void,
    pub topk_weights: *const f32,
    pub num_tokens_per_rdma_rank: *const i32,
    pub num_tokens_per_expert: *const i32,
    pub is_token_in_rank: *const bool,
    pub bias_0: *const u16,
    pub bias_1: *const u16,
    pub h_rdma_cpm: *const i32,
    pub h_recv_rdma_cpm: *const i32,
    pub h_recv_rdma_rps: *const i32,
    pub h_recv_gbl_cpm: *const i32,
    pub h_recv_gbl_rps: *const i32,
    pub h_send_rdma_head: *const i32,
    pub h_send_nvl_head: *const i32,
    pub recv_x: *mut c_void,
    pub recv_scales: *mut c_void,
    pub recv_topk_idx: *mut c_void,
    pub recv_topk_weights: *mut f32,
    pub recv_src_meta: *mut u8,
    pub rdma_cpm: *mut i32,
    pub gbl_cpm: *mut i32,
    pub recv_rdma_cpm: *mut i32,
    pub recv_rdma_rps: *mut i32,
    pub recv_gbl_cpm: *mut i32,
    pub recv_gbl_rps: *mut i32,
    pub send_rdma_head: *mut i32,
    pub send_nvl_head: *mut i32,
    pub combined_x: *mut u16,
    pub combined_w: *mut f32,
    /// The `GinNet` in this rank's window ([`NET_GIN`]); null for [`NET_LSA`].
    pub net: *const c_void,
    pub net_kind: i32,
    /// First seam signal id ([`SEAM_SIGNALS`] from here; 0 with [`NET_LSA`]).
    pub sig_base: i32,
}

impl Default for InArgs {
    fn default() -> Self {
        // SAFETY: every field is an integer, a raw pointer or an array of them, for which all-zero
        // bits are valid (null pointers, zero counts).
        unsafe { std::mem::zeroed() }
    }
}

extern "C" {
    fn deep_ep_in_launch(ctx: *const Ctx, args: *const InArgs, step: c_int, stream: *mut c_void) -> c_int;
    fn deep_ep_in_args_bytes() -> usize;
}

/// Fails when [`InArgs`] and `deep_ep_in_args_t` differ in size (header and this file out of step).
pub fn check_struct_size(op: &'static str) -> Result<()> {
    // SAFETY: pure query of a compile-time constant.
    let c = unsafe { deep_ep_in_args_bytes() };
    crate::ensure!(
        c == std::mem::size_of::<InArgs>(),
        op,
        "internal: deep_ep_in_args_t is {c} bytes in C but {} in Rust",
        std::mem::size_of::<InArgs>()
    );
    Ok(())
}

/// Launches internode step `step` on `stream` (asynchronous). The launcher checks the geometry
/// and, with [`NET_LSA`], the LSA descriptor against `ctx`; with [`NET_GIN`] that `net` is set
/// (cudaErrorInvalidValue otherwise).
#[allow(clippy::not_unsafe_ptr_arg_deref)] // `stream` is an opaque handle, never dereferenced here
pub fn launch(op: &'static str, ctx: &Ctx, args: &InArgs, step: i32, stream: *mut c_void) -> Result<()> {
    // SAFETY: `ctx` describes the buffer's live window; every pointer of `args` is null or points
    // into a live tensor of the op (validated by crate::ops) or the window, all alive until the
    // stream reaches the kernel (the caller's tensors outlive the op on its stream, as with every
    // CUDA op); both structs are read by value.
    check(unsafe { deep_ep_in_launch(ctx, args, step, stream) }, op, "internode kernel launch")
}
