//! Bindings to the intranode normal-mode kernels (`kernels/intranode_*.cu`) and the CUDA runtime
//! helpers the NCCL backend needs (`kernels/runtime.cu`); the protocol is in
//! `kernels/deep_ep_kernels.h`, whose declarations `crate::sys::kernels` generates
//! ([`check_struct_sizes`] still compares the struct sizes with the kernels' at buffer creation).
//!
//! Every launch is asynchronous on the stream it is given and CUDA-graph capturable. The structs
//! carry raw device pointers: the backend fills them only from live tensors handed over by
//! `api::buffer` (validated by `crate::ops`) and from the buffer's own window, which is what makes
//! the safe launch wrappers sound.

use crate::error::Result;
use crate::kernels::layout::check;
use crate::sys::kernels::{self as sys, *};
use std::ffi::{c_int, c_void};

/// Most ranks of one intranode buffer (`DEK_IC_MAX_RANKS`).
pub const MAX_RANKS: usize = sys::DEK_IC_MAX_RANKS as usize;
/// Most channels (`config.num_sms / 2`).
pub const MAX_CHANNELS: usize = sys::DEK_IC_MAX_CHANNELS as usize;
/// Most local experts a notify reports.
pub const MAX_LOCAL_EXPERTS: usize = sys::DEK_IC_MAX_LOCAL_EXPERTS as usize;
/// Control area at the start of every window.
pub const CONTROL_BYTES: usize = sys::DEK_IC_CONTROL_BYTES as usize;
/// Staged sections of a [`Layout`].
pub const NUM_SECTIONS: usize = sys::DEK_IC_NUM_SECTIONS as usize;

/// Section indices of [`Layout::off`] (`DEEP_EP_IC_SEC_*`).
pub mod sec {
    crate::kernels::c_consts! { usize;
        COUNTS_RANK = DEK_IC_SEC_COUNTS_RANK, COUNTS_EXPERT = DEK_IC_SEC_COUNTS_EXPERT, SEND_HEAD = DEK_IC_SEC_SEND_HEAD,
        CPM = DEK_IC_SEC_CPM, X = DEK_IC_SEC_X, SCALES = DEK_IC_SEC_SCALES, TOPK = DEK_IC_SEC_TOPK, WEIGHTS = DEK_IC_SEC_WEIGHTS,
    }
}

/// Op kinds of a [`Layout`] (`DEEP_EP_IC_KIND_*`).
pub mod kind {
    crate::kernels::c_consts! { i64;
        DISPATCH = DEK_IC_KIND_DISPATCH, CACHED = DEK_IC_KIND_CACHED, COMBINE = DEK_IC_KIND_COMBINE,
    }
}

/// Parts of a staging ([`StageArgs`]`::parts`; 0 stages everything).
pub mod stage_parts {
    crate::kernels::c_consts! { i32; META = DEK_IC_STAGE_META, ROWS = DEK_IC_STAGE_ROWS, }
}

/// Barrier sites (`DEEP_EP_IC_SITE_*`), for messages.
pub mod site {
    crate::kernels::c_consts! { i32;
        DISPATCH_START = DEK_IC_SITE_DISPATCH_START, DISPATCH_NOTIFY = DEK_IC_SITE_DISPATCH_NOTIFY,
        CACHED_START = DEK_IC_SITE_CACHED_START, CACHED_DATA = DEK_IC_SITE_CACHED_DATA,
        COMBINE_START = DEK_IC_SITE_COMBINE_START, COMBINE_DATA = DEK_IC_SITE_COMBINE_DATA, CREATE = DEK_IC_SITE_CREATE,
        DESTROY = DEK_IC_SITE_DESTROY, DISPATCH_RECV = DEK_IC_SITE_DISPATCH_RECV, DISPATCH_PUSH = DEK_IC_SITE_DISPATCH_PUSH,
        LL_GEOMETRY = DEK_IC_SITE_LL_GEOMETRY, LL_DISPATCH = DEK_IC_SITE_LL_DISPATCH, LL_COMBINE = DEK_IC_SITE_LL_COMBINE,
        COMBINE_RECV = DEK_IC_SITE_COMBINE_RECV, IN_DISPATCH = DEK_IC_SITE_IN_DISPATCH,
        IN_DISPATCH_DATA = DEK_IC_SITE_IN_DISPATCH_DATA, IN_COMBINE = DEK_IC_SITE_IN_COMBINE,
        IN_COMBINE_DATA = DEK_IC_SITE_IN_COMBINE_DATA, LL_SIGNAL = DEK_IC_SITE_LL_SIGNAL, DISPATCH_DATA = DEK_IC_SITE_DISPATCH_DATA,
    }

    /// Human name of a site.
    pub fn name(site: i32) -> &'static str {
        match site {
            DISPATCH_START => "the start barrier of dispatch",
            DISPATCH_NOTIFY => "the notify barrier of dispatch",
            DISPATCH_DATA => "the data barrier of dispatch",
            CACHED_START => "the start barrier of cached_dispatch",
            CACHED_DATA => "the data barrier of cached_dispatch",
            COMBINE_START => "the start barrier of combine",
            COMBINE_DATA => "the data barrier of combine",
            CREATE => "the barrier of create_buffer",
            DESTROY => "the barrier of destroy_buffer",
            DISPATCH_RECV => "the receive wait of (cached) dispatch (a sender's channel never arrived)",
            DISPATCH_PUSH => "the push kernel of (cached) dispatch",
            LL_GEOMETRY => "the barrier around a low-latency signal reset",
            LL_DISPATCH => "the receive of low_latency_dispatch",
            LL_COMBINE => "the receive of low_latency_combine",
            COMBINE_RECV => "the receive wait of combine (a peer's channel never arrived)",
            IN_DISPATCH => "the start or notify barrier of internode (cached) dispatch",
            IN_DISPATCH_DATA => "the RDMA-leg wait of internode (cached) dispatch",
            IN_COMBINE => "the start barrier of internode combine",
            IN_COMBINE_DATA => "the node barrier or partials wait of internode combine",
            LL_SIGNAL => "the send of low_latency_combine(overlap=True) waiting for a comp_signal of this rank's producer (never raised)",
            _ => "an unknown barrier",
        }
    }
}

/// Error codes of the host-mapped status block (`DEEP_EP_IC_ERR_*`).
pub mod err {
    crate::kernels::c_consts! { i32;
        TIMEOUT = DEK_IC_ERR_TIMEOUT, MISMATCH = DEK_IC_ERR_MISMATCH, OVERFLOW = DEK_IC_ERR_OVERFLOW,
        CAPACITY = DEK_IC_ERR_CAPACITY,
    }
    // Input checks (`dek_ic_check`), each about the reporting rank's own inputs.
    crate::kernels::c_consts! { i32;
        NTPR = DEK_IC_ERR_NTPR, EXPERT_ID = DEK_IC_ERR_EXPERT_ID, NTPE = DEK_IC_ERR_NTPE, IN_RANK = DEK_IC_ERR_IN_RANK,
        STALE_COUNTS = DEK_IC_ERR_STALE_COUNTS, STALE_ROWS = DEK_IC_ERR_STALE_ROWS, STALE_SEND_HEAD = DEK_IC_ERR_STALE_SEND_HEAD,
        STALE_CPM = DEK_IC_ERR_STALE_CPM,
    }
    /// Internode: num_tokens_per_rdma_rank[extra] = value, is_token_in_rank selects limit.
    pub const NTPRR: i32 = crate::sys::kernels::DEK_IC_ERR_NTPRR as i32;
    /// Internode handle: value (from the routing) != limit (the handle's) at entry extra.
    pub const STALE_INTERNODE: i32 = crate::sys::kernels::DEK_IC_ERR_STALE_INTERNODE as i32;
    /// LL: source `rank` sent with another format word `extra` (0 flags, 1 hidden, 2 T, 3 E):
    /// value theirs, limit this rank's.
    pub const LL_FORMAT: i32 = crate::sys::kernels::DEK_IC_ERR_LL_FORMAT as i32;
    /// LL combine receive: its topk_idx `[value, limit]` is not the one its dispatch routed with.
    pub const LL_ROUTING: i32 = crate::sys::kernels::DEK_IC_ERR_LL_ROUTING as i32;
    /// LL receive: source `rank` gave up call `value` (its low 16 bits), which this receive pairs with.
    pub const LL_ABANDONED: i32 = crate::sys::kernels::DEK_IC_ERR_LL_ABANDONED as i32;
}

/// `dek_ic_ctx_t`: the buffer as kernels see it. `peer_base` holds the window base of every
/// rank of this rank's NVLink domain, world rank `r` at slot `r % MAX_RANKS` (a domain's at most
/// [`MAX_RANKS`] consecutive ranks take distinct slots; an intranode buffer's rank `r` is at `[r]`),
/// NULL in the other slots;
/// `num_sms` is this rank's share of the GPU's SMs (0 = unknown: the launcher asks CUDA);
/// `nvl_ranks` 0 = `peer_base` holds every rank (`nvl_first` 0), `D` = an internode buffer over
/// NVLink domains of `D` consecutive ranks (`nvl_first` = rank / D * D).
pub type Ctx = dek_ic_ctx_t;

impl Ctx {
    /// This rank's own window base.
    pub fn own_base(&self) -> *mut c_void {
        self.peer_base[self.rank as usize % MAX_RANKS]
    }

    /// The window base of world rank `p` when this GPU addresses it (NULL otherwise).
    pub fn base_of(&self, p: usize) -> *mut c_void {
        match p.checked_sub(self.nvl_first as usize) {
            Some(i) if i < MAX_RANKS => self.peer_base[p % MAX_RANKS],
            _ => std::ptr::null_mut(),
        }
    }

    /// The world ranks whose windows the kernels address (the own NVLink domain), ascending.
    pub fn addressed_ranks(&self) -> Vec<usize> {
        (0..self.num_ranks as usize).filter(|&p| !self.base_of(p).is_null()).collect()
    }

    /// Whether this is the ctx of a buffer whose other NVLink domains have no window pointer
    /// (`nvl_ranks` > 0): barriers of all ranks go through [`crate::kernels::global_barrier`].
    pub fn split(&self) -> bool {
        self.nvl_ranks > 0 && self.nvl_ranks < self.num_ranks
    }
}

/// `dek_ic_layout_t`: what one rank stages, read by its peers.
pub type Layout = dek_ic_layout_t;
/// `dek_ic_sync_args_t`: K0/K2 barrier, gather and notify.
pub type SyncArgs = dek_ic_sync_args_t;
/// `dek_ic_stage_args_t` (null pointer = absent input).
pub type StageArgs = dek_ic_stage_args_t;
/// `dek_ic_push_args_t` (combine K1, and the fused combine's push half).
pub type PushArgs = dek_ic_push_args_t;
/// `dek_ic_pull_args_t` (null pointer = absent output / use notify's input).
pub type PullArgs = dek_ic_pull_args_t;
/// `dek_ic_dispatch_push_args_t` (null pointer = absent input or output).
pub type DispatchPushArgs = dek_ic_dispatch_push_args_t;
/// `dek_ic_check_args_t`: the routing inputs the check kernel compares (null = absent).
pub type CheckArgs = dek_ic_check_args_t;
/// `dek_ic_combine_args_t`.
pub type CombineArgs = dek_ic_combine_args_t;
type HostStatusRaw = dek_ic_host_status_t;

/// Compares the generated struct sizes with the C ones the kernels were compiled with (a
/// mismatch means a stale build: kernels would read garbage).
pub fn check_struct_sizes(op: &'static str) -> Result<()> {
    let mut c = [0usize; 10];
    // SAFETY: writes exactly 10 sizes.
    unsafe { dek_ic_struct_sizes(c.as_mut_ptr()) };
    let rust = [
        std::mem::size_of::<Ctx>(),
        std::mem::size_of::<Layout>(),
        std::mem::size_of::<SyncArgs>(),
        std::mem::size_of::<StageArgs>(),
        std::mem::size_of::<PullArgs>(),
        std::mem::size_of::<CombineArgs>(),
        std::mem::size_of::<PushArgs>(),
        std::mem::size_of::<HostStatusRaw>(),
        std::mem::size_of::<DispatchPushArgs>(),
        std::mem::size_of::<CheckArgs>(),
    ];
    crate::ensure!(c == rust, op, "internal: intranode struct sizes differ between C {c:?} and Rust {rust:?}");
    Ok(())
}

// The launch contract of every `unsafe fn` launcher of the kernels (here, `kernels::low_latency`,
// `kernels::internode`): `ctx` describes this buffer's live window (a window provider made it), and
// every pointer in the argument structs is null or points to live device memory of the size the
// kernel reads or writes (the data of a tensor validated by `crate::ops` and the backend, or the
// window), alive until `stream` has run the kernel; `stream` is a valid CUDA stream (or null) of
// the window's device. The C side refuses inconsistent sizes with cudaErrorInvalidValue.

/// Defines `unsafe fn` launchers over generated C launchers of the shape
/// `int dek_..(const dek_ic_ctx_t*, const args*..., void* stream)`: each takes the op name (for
/// errors), the ctx, its argument structs and the stream, and has the launch contract above as its
/// safety section; `what` names the launch in errors.
macro_rules! launchers {
    ($($(#[doc = $doc:literal])* $name:ident($($arg:ident: $ty:ty),*) => $c:ident, $what:literal;)*) => {$(
        $(#[doc = $doc])*
        ///
        /// # Safety
        /// The launch contract of [`crate::kernels::intranode`]: a live window, argument pointers
        /// null or live and large enough until `stream` ran the kernel.
        pub unsafe fn $name(op: &'static str, ctx: &$crate::kernels::intranode::Ctx, $($arg: $ty,)* stream: *mut ::std::ffi::c_void) -> $crate::error::Result<()> {
            // SAFETY: the caller keeps the launch contract; the structs are read by value.
            $crate::kernels::layout::check(unsafe { $c(ctx, $($arg,)* stream) }, op, $what)
        }
    )*};
}
pub(crate) use launchers;

launchers! {
    /// K0/K2: barrier, optionally gather + notify (one block).
    sync(args: &SyncArgs) => dek_ic_sync, "intranode barrier kernel launch";
    /// K1: stage this rank's inputs into its own window; with `then_sync`, the barrier
    /// `args.sync` after it in the same launch (run by the grid's last block).
    stage(args: &StageArgs) => dek_ic_stage, "intranode stage kernel launch";
    /// K3 of (cached) dispatch.
    pull(args: &PullArgs) => dek_ic_pull, "intranode pull kernel launch";
    /// K3 of push (cached) dispatch: every row of x into its destinations' receive areas, and the
    /// overlapped copy-out of this rank's receive area into the outputs `out`.
    dispatch_push(args: &DispatchPushArgs, out: &PullArgs) => dek_ic_dispatch_push, "intranode dispatch push kernel launch";
    /// K1 of combine: push received rows back into their source ranks' windows.
    combine_push(args: &PushArgs) => dek_ic_combine_push, "intranode combine push kernel launch";
    /// K3 of combine.
    combine(args: &CombineArgs) => dek_ic_combine, "intranode combine kernel launch";
    /// Fused combine (push and reduce in one kernel, after a start barrier with `publish` and
    /// `zero_counters`; no data barrier).
    combine_fused(push: &PushArgs, args: &CombineArgs) => dek_ic_combine_fused, "intranode fused combine kernel launch";
    /// Input checks before the barrier that gathers the op's header (the data barrier; the fused
    /// combine's start barrier), which raises what they find on every rank. The kernel only reads
    /// the inputs and writes this rank's control area.
    check_inputs(args: &CheckArgs) => dek_ic_check, "intranode input-check kernel launch";
    /// The input checks, then the barrier `args` in the check grid's last block (the fused
    /// combine's start barrier in the same launch).
    check_sync(check: &CheckArgs, args: &SyncArgs) => dek_ic_check_sync, "intranode check + barrier kernel launch";
}

/// Zeroes this rank's whole window (`ctx.window_bytes` at its own peer pointer): the control
/// area and the transport self-test signals start at zero, and so do the
/// low-latency signal words, so the first LL call needs no barrier (a re-created
/// buffer may get the memory of a destroyed one, with its old tags). Every window provider calls
/// it at creation, before the first barrier.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: a live window, argument pointers null or live
/// and large enough until `stream` ran the kernel.
pub unsafe fn zero_window(op: &'static str, ctx: &Ctx, stream: *mut c_void) -> Result<()> {
    let local = ctx.own_base();
    crate::ensure!(!local.is_null(), op, "internal: the window's own pointer is not set");
    // SAFETY: this rank's own window: `window_bytes` bytes of device memory; async on `stream`.
    check(unsafe { dek_cuda_memset_async(local, 0, ctx.window_bytes as usize, stream) }, op, "zeroing the window")
}

/// Clears the device copy of a reported error.
///
/// # Safety
/// The launch contract of [`crate::kernels::intranode`]: a live window, argument pointers null or live
/// and large enough until `stream` ran the kernel.
pub unsafe fn clear_error(op: &'static str, ctx: &Ctx, stream: *mut c_void) -> Result<()> {
    // SAFETY: writes one int of this rank's scratch.
    check(unsafe { dek_ic_clear_error(ctx, stream) }, op, "intranode clear-error kernel launch")
}

/// Multiprocessors of CUDA device `device`.
pub fn sm_count(op: &'static str, device: i32) -> Result<i32> {
    let mut sms: c_int = 0;
    // SAFETY: writes one int.
    check(unsafe { dek_cuda_sm_count(device, &mut sms) }, op, "cudaDeviceGetAttribute(MultiProcessorCount)")?;
    Ok(sms)
}

/// `(runtime, driver)`: the CUDA runtime version linked into the library and the CUDA version the
/// driver supports, as `1000 * major + 10 * minor` (0 = unknown, e.g. no driver). Needs no GPU.
pub fn cuda_versions() -> (i32, i32) {
    let (mut rt, mut drv): (c_int, c_int) = (0, 0);
    // SAFETY: writes two ints (zeros on failure).
    unsafe { dek_cuda_versions(&mut rt, &mut drv) };
    (rt, drv)
}

/// Device pointer of the scratch int that create's host rendezvous all-reduces.
pub fn rendezvous_word(ctx: &Ctx) -> *mut c_void {
    // SAFETY: pure address arithmetic on the ctx.
    unsafe { dek_ic_rendezvous_word(ctx) }
}

/// An error a kernel recorded in the host-mapped block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KernelError {
    pub code: i32,
    pub rank: i32,
    pub site: i32,
    pub value: i32,
    pub limit: i32,
    /// A third number of some errors (`error_extra`).
    pub extra: i32,
}

/// The host-mapped status block of one buffer (`cudaHostAllocMapped`): kernels write it, the
/// host polls it with volatile reads. Freed on drop.
pub struct HostStatus {
    host: *mut HostStatusRaw,
    device: *mut c_void,
}

// SAFETY: the block is plain pinned host memory; the backend owning it is used under a mutex.
unsafe impl Send for HostStatus {}

macro_rules! field {
    ($self:ident . $f:ident) => {
        // SAFETY: `host` points to a live, aligned HostStatusRaw for the lifetime of self.
        std::ptr::addr_of_mut!((*$self.host).$f)
    };
}

impl HostStatus {
    /// Allocates the block (error 0, recv_count −1) for the current device.
    pub fn new(op: &'static str) -> Result<HostStatus> {
        let (mut host, mut device) = (std::ptr::null_mut(), std::ptr::null_mut());
        let bytes = std::mem::size_of::<HostStatusRaw>();
        // SAFETY: writes two pointers; the allocation is `bytes` of pinned, mapped memory.
        check(unsafe { dek_cuda_host_alloc_mapped(&mut host, &mut device, bytes) }, op, "cudaHostAlloc(mapped)")?;
        let s = HostStatus { host: host.cast(), device };
        // SAFETY: the block is ours and `bytes` long.
        unsafe { std::ptr::write_bytes(s.host.cast::<u8>(), 0, bytes) };
        s.set_recv_count(-1);
        Ok(s)
    }

    /// Device pointer of the block (for [`Ctx::host_status`]).
    pub fn device_ptr(&self) -> *mut c_void {
        self.device
    }

    /// The recorded error, if any.
    pub fn error(&self) -> Option<KernelError> {
        // SAFETY: volatile reads of the live block (see `field!`).
        unsafe {
            let code = field!(self.error).read_volatile();
            if code == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            Some(KernelError {
                code,
                rank: field!(self.error_rank).read_volatile(),
                site: field!(self.error_site).read_volatile(),
                value: field!(self.error_value).read_volatile(),
                limit: field!(self.error_limit).read_volatile(),
                extra: field!(self.error_extra).read_volatile(),
            })
        }
    }

    /// Forgets the recorded error (the device copy is cleared separately).
    pub fn clear_error(&self) {
        // SAFETY: volatile write into the live block.
        unsafe { field!(self.error).write_volatile(0) }
    }

    /// Sets the receive count the notify kernel overwrites (−1 = not yet).
    pub fn set_recv_count(&self, v: i32) {
        // SAFETY: volatile write into the live block.
        unsafe { field!(self.recv_count).write_volatile(v) }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// RDMA-leg tokens the internode notify kernel wrote (valid once the receive count is).
    pub fn recv_rdma_count(&self) -> i32 {
        // SAFETY: volatile read of the live block.
        unsafe { field!(self.recv_rdma_count).read_volatile() }
    }

    /// The receive count the notify kernel wrote (−1 until then).
    pub fn recv_count(&self) -> i32 {
        // SAFETY: volatile read of the live block.
        unsafe { field!(self.recv_count).read_volatile() }
    }

    /// The first `n` per-local-expert counts (written before the receive count).
    pub fn per_expert(&self, n: usize) -> Vec<i32> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: volatile reads of the live block, n <= MAX_LOCAL_EXPERTS.
        (0..n.min(MAX_LOCAL_EXPERTS)).map(|i| unsafe { field!(self.per_expert).cast::<i32>().add(i).read_volatile() }).collect()
    }
}

impl Drop for HostStatus {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaHostAlloc in `new`, freed once.
        let st = unsafe { dek_cuda_free_host(self.host.cast()) };
        if st != 0 {
            eprintln!("deep_ep: cudaFreeHost of the status block failed: {}", crate::kernels::layout::cuda_error_text(st));
        }
    }
}

/// Makes `device` current for the guard's lifetime and restores the previous one.
pub struct DeviceGuard {
    previous: c_int,
}

impl DeviceGuard {
    pub fn new(op: &'static str, device: i32) -> Result<DeviceGuard> {
        let mut previous: c_int = 0;
        // SAFETY: writes one int.
        check(unsafe { dek_cuda_get_device(&mut previous) }, op, "cudaGetDevice")?;
        // SAFETY: plain runtime call.
        check(unsafe { dek_cuda_set_device(device) }, op, "cudaSetDevice")?;
        Ok(DeviceGuard { previous })
    }
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        // SAFETY: plain runtime call; restores the device that was current before.
        let _ = unsafe { dek_cuda_set_device(self.previous) };
    }
}

/// A private non-blocking stream (create/destroy work), destroyed on drop.
pub struct Stream(*mut c_void);

// SAFETY: a cudaStream_t may be used from any thread; the owner serialises its use.
unsafe impl Send for Stream {}

impl Stream {
    pub fn new(op: &'static str) -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one stream handle.
        check(unsafe { dek_cuda_stream_create(&mut s) }, op, "cudaStreamCreate")?;
        Ok(Stream(s))
    }

    pub fn raw(&self) -> *mut c_void {
        self.0
    }

    pub fn synchronize(&self, op: &'static str) -> Result<()> {
        // SAFETY: the stream is live.
        check(unsafe { dek_cuda_stream_synchronize(self.0) }, op, "cudaStreamSynchronize")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { dek_cuda_stream_destroy(self.0) };
    }
}

/// Waits for all work on the current device.
pub fn device_synchronize(op: &'static str) -> Result<()> {
    // SAFETY: plain runtime call.
    check(unsafe { dek_cuda_device_synchronize() }, op, "cudaDeviceSynchronize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrored_structs_match_the_header() {
        check_struct_sizes("test").expect("struct sizes");
    }
}
