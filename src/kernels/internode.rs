//! Bindings of the internode normal-mode kernels (`kernels/internode_*.cu`; protocol and window
//! layout in `kernels/deep_ep_kernels.h`, "Internode normal mode"). One argument struct serves
//! every step; [`launch`] runs one step asynchronously on a stream (CUDA-graph capturable).
//! The struct carries raw device pointers that the backend fills only from live tensors validated
//! by `crate::ops` and from the buffer's own window.

use crate::error::Result;
use crate::kernels::intranode::Ctx;
use crate::kernels::layout::check;
use crate::sys::kernels::*;
use std::ffi::c_void;

/// Internode control area of every window (`DEK_IN_CTRL_OFF`, `DEK_IN_CTRL_BYTES`).
pub const CTRL_OFF: usize = DEK_IN_CTRL_OFF as usize;
pub const CTRL_BYTES: usize = DEK_IN_CTRL_BYTES as usize;
/// Offset and size of the seam signal table of the LSA emulation (`internode.cuh`,
/// `DEK_IN_LSA_SIGNALS`).
pub const SIGNAL_OFF: u64 = CTRL_OFF as u64;
pub const NUM_SIGNALS: i32 = DEK_IN_LSA_SIGNALS as i32;
/// Where a normal-mode buffer over GIN keeps its `GinNet` descriptor, and the bytes reserved for
/// it (`DEK_IN_NET_OFF`, `DEK_IN_NET_BYTES`: the free end of the internode control area).
pub const NET_OFF: usize = DEK_IN_NET_OFF as usize;
pub const NET_BYTES: usize = DEK_IN_NET_BYTES as usize;
/// Seam signals the kernels use from [`InArgs::sig_base`] (`DEK_IN_SEAM_SIGNALS`): global
/// barriers at [`SIG_BAR`] + source node, seam steps at [`SIG_STEP`] + source node
/// (`DEK_IN_SIG_BAR`, `DEK_IN_SIG_STEP`; room for [`MAX_NODES`] nodes), all on context 0.
pub const SEAM_SIGNALS: usize = DEK_IN_SEAM_SIGNALS as usize;
pub const SIG_BAR: usize = DEK_IN_SIG_BAR as usize;
pub const SIG_STEP: usize = DEK_IN_SIG_STEP as usize;
/// Most nodes (NVLink domains) of an internode buffer that the window layout and the signal plan
/// are sized for (`DEK_IN_MAX_NODES`).
pub const MAX_NODES: usize = DEK_IN_MAX_NODES as usize;
/// Most ranks of an internode buffer that the window layout is sized for (`DEK_IN_MAX_RANKS`).
pub const MAX_RANKS: usize = DEK_IN_MAX_RANKS as usize;
/// Most nodes the normal-mode kernels take today (`kMaxNodes` of `internode.cuh`; their
/// per-block arrays are lifted to [`MAX_NODES`] by docs/RANKS.md step 4).
pub const KERNEL_MAX_NODES: usize = 8;
/// [`InArgs::net_kind`]: the LSA emulation over [`InArgs::lsa`] (`DEK_IN_NET_LSA`).
pub const NET_LSA: i32 = DEK_IN_NET_LSA as i32;
/// [`InArgs::net_kind`]: NCCL GIN over the `GinNet` at [`InArgs::net`] (`DEK_IN_NET_GIN`).
pub const NET_GIN: i32 = DEK_IN_NET_GIN as i32;

/// Steps of [`launch`] (`DEEP_EP_IN_*`).
pub mod step {
    crate::kernels::c_consts! { i32;
        SEND_SIDE = DEK_IN_SEND_SIDE, NOTIFY = DEK_IN_NOTIFY, RDMA_SEND = DEK_IN_RDMA_SEND, STEP = DEK_IN_STEP,
        NVL_RECV = DEK_IN_NVL_RECV, C_BEGIN = DEK_IN_C_BEGIN, C_STAGE = DEK_IN_C_STAGE, C_NODEBAR = DEK_IN_C_NODEBAR,
        C_FORWARD = DEK_IN_C_FORWARD, C_FINAL = DEK_IN_C_FINAL,
    }
}

/// Op kinds (`DEEP_EP_IN_KIND_*`).
pub mod kind {
    crate::kernels::c_consts! { i32;
        DISPATCH = DEK_IN_KIND_DISPATCH, CACHED = DEK_IN_KIND_CACHED, COMBINE = DEK_IN_KIND_COMBINE,
    }
}

/// `dek_in_args_t` (null pointer = absent): one struct for every step. `net` is the
/// `GinNet` in this rank's window ([`NET_GIN`], null for [`NET_LSA`]); `sig_base` the first seam
/// signal id ([`SEAM_SIGNALS`] from there; 0 with [`NET_LSA`]).
pub type InArgs = dek_in_args_t;

/// Fails when [`InArgs`] and the kernels' `dek_in_args_t` differ in size (a stale build).
pub fn check_struct_size(op: &'static str) -> Result<()> {
    // SAFETY: pure query of a compile-time constant.
    super::check_struct_size::<InArgs>(op, "dek_in_args_t", unsafe { dek_in_args_bytes() })
}

/// Launches internode step `step` on `stream` (asynchronous). The launcher checks the geometry
/// and, with [`NET_LSA`], the LSA descriptor against `ctx`; with [`NET_GIN`] that `net` is set
/// (cudaErrorInvalidValue otherwise).
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: a live window, argument pointers null or live
/// and large enough until `stream` ran the kernel.
pub unsafe fn launch(op: &'static str, ctx: &Ctx, args: &InArgs, step: i32, stream: *mut c_void) -> Result<()> {
    // SAFETY: `ctx` describes the buffer's live window; every pointer of `args` is null or points
    // into a live tensor of the op (validated by crate::ops) or the window, all alive until the
    // stream reaches the kernel (the caller's tensors outlive the op on its stream, as with every
    // CUDA op); both structs are read by value.
    check(unsafe { dek_in_launch(ctx, args, step, stream) }, op, "internode kernel launch")
}
