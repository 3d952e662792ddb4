//! Bindings to the low-latency kernels (`kernels/ll_dispatch.cu`, `kernels/low_latency.cu`); protocol and struct in
//! `kernels/deep_ep_kernels.h` ("Low-latency mode"). Every launch is asynchronous on the given
//! stream and CUDA-graph capturable (no host sync, the call number lives on the device).

use crate::error::Result;
use crate::sys::kernels::*;

/// Offset of the device copy of the LL rank mask in every window (`DEK_LL_MASK_OFF`):
/// `int32 [MAX_RANKS]` in the control area.
pub const LL_MASK_OFF: usize = DEK_LL_MASK_OFF as usize;
/// Offset in this rank's control area of the int64 `[2][4]` recv_states of whole LL ops given none
/// (`Backend::ll_own_state`; written and read by this rank's kernels only).
pub const OWN_STATE_OFF: usize = DEK_LL_OWN_STATE_OFF as usize;

/// `net_kind` of [`LlArgs`]: the LSA emulation of the RDMA leg (`DEK_LL_NET_LSA`).
pub const NET_LSA: i32 = DEK_LL_NET_LSA as i32;
/// `net_kind` of [`LlArgs`]: NCCL GIN (`DEK_LL_NET_GIN`).
pub const NET_GIN: i32 = DEK_LL_NET_GIN as i32;

/// Kind words of `recv_state` (`DEEP_EP_LL_KIND_*`).
pub const KIND_DISPATCH: i32 = DEK_LL_KIND_DISPATCH as i32;
pub const KIND_COMBINE: i32 = DEK_LL_KIND_COMBINE as i32;
/// Most tokens per rank the LL kernels take: a tag's count field holds count + 1 below `0xffff`,
/// the mark of an abandoned call.
pub const MAX_TOKENS: usize = DEK_LL_MAX_TOKENS as usize;
/// Combine `recv_state` flag: partial sums were sent (`DEK_LL_FLAG_PARTIAL`).
pub const FLAG_PARTIAL: i32 = DEK_LL_FLAG_PARTIAL as i32;
/// Combine `recv_state` flag: rows travel as LogFMT-10 (`DEK_LL_FLAG_LOGFMT`; the CPU backend's
/// `FLAG_LOGFMT`).
pub const FLAG_LOGFMT: i32 = DEK_LL_FLAG_LOGFMT as i32;
/// Selections (N·K of the handle's dispatch) from which the LogFMT combine send spreads its rows
/// over every warp of the grid (`DEK_LL_LOGFMT_SPREAD_FROM`, the kernels' `kLogfmtSpreadFrom`).
pub const LOGFMT_SPREAD_FROM: i64 = DEK_LL_LOGFMT_SPREAD_FROM as i64;
/// Most experts of the one-launch spread LogFMT combine (`DEK_LL_LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS`,
/// the kernels' `kOneLaunchSpreadItems`: its scan's items in static shared memory).
pub const LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS: usize = DEK_LL_LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS as usize;

/// `dek_ll_args_t`: one struct for the five LL launches (unused fields null / 0).
pub type LlArgs = dek_ll_args_t;

/// Compares the generated struct's size with the C one the kernels were built with (stale build).
pub fn check_struct_size(op: &'static str) -> Result<()> {
    // SAFETY: pure size query.
    super::check_struct_size::<LlArgs>(op, "dek_ll_args_t", unsafe { dek_ll_args_bytes() })
}

// Every launcher here is an `unsafe fn` under the launch contract of `kernels::intranode`; the C
// side also checks the LL area offsets against the window size (cudaErrorInvalidValue).

crate::kernels::intranode::launchers! {
    /// Send phase of an LL dispatch.
    dispatch_send(a: &LlArgs) => dek_ll_dispatch_send, "low-latency dispatch send kernel launch";
    /// Receive phase of an LL dispatch.
    dispatch_recv(a: &LlArgs) => dek_ll_dispatch_recv, "low-latency dispatch receive kernel launch";
    /// Both phases of an LL dispatch in one launch of `a.num_blocks` blocks, all of which must be
    /// resident at once (no `recv_state`).
    dispatch(a: &LlArgs) => dek_ll_dispatch, "low-latency dispatch kernel launch";
    /// `dispatch` at one rank (`num_ranks == 1`, no seam): the send writes recv_x, the scales,
    /// src_info, layout_range, recv_count and the stats itself; no signal, no receive.
    dispatch_local(a: &LlArgs) => dek_ll_dispatch_local, "low-latency one-rank dispatch kernel launch";
    /// Send phase of an LL combine.
    combine_send(a: &LlArgs) => dek_ll_combine_send, "low-latency combine send kernel launch";
    /// Receive phase of an LL combine.
    combine_recv(a: &LlArgs) => dek_ll_combine_recv, "low-latency combine receive kernel launch";
    /// Both phases of an LL combine in one launch (BF16 rows or partial sums, no signal, no seam),
    /// every block resident at once (no `recv_state`).
    combine(a: &LlArgs) => dek_ll_combine, "low-latency combine kernel launch";
    /// `combine` at one rank (`num_ranks == 1`): every output row summed straight from the expert
    /// outputs (or the zero-copy slots), no signal and no receive area; with LogFMT each row
    /// encoded and decoded on the way (the peer path's values, bit for bit).
    combine_local(a: &LlArgs) => dek_ll_combine_local, "low-latency one-rank combine kernel launch";
    /// Zeroes this rank's LL signal words of both halves (2 * signal_bytes of its own window at
    /// ll_off, checked on the C side).
    zero_signals(a: &LlArgs) => dek_ll_zero_signals, "low-latency signal reset kernel launch";
}
