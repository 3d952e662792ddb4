//! The [`PeerWindow`] trait every provider implements, and what the providers share: the window
//! size, a fresh context, the status block and zeroing of a new window, and the forwarding `impl`
//! macro.

use super::gin_comms::GinSetup;
use crate::error::Result;
use crate::kernels::intranode::{self, Ctx, HostStatus, Stream};

/// What a provider's `Window::create` needs (every provider takes the same; each uses what applies
/// to it: `nvl_domain` and `gin` are the nccl provider's, `nvl_domain` also the ipc provider's).
pub struct WindowArgs<'a> {
    pub unique_id: &'a [u8; 128],
    pub rank: usize,
    pub num_ranks: usize,
    /// Ranks per NVLink domain (`DEEP_EP_NVL_DOMAIN_SIZE`), or `num_ranks` for an intranode
    /// buffer. Below `num_ranks` (an internode buffer) the kernels get the windows of the own
    /// domain only (`window::lsa_team::PeerMap`).
    pub nvl_domain: usize,
    pub device: i32,
    /// Bytes for staged data; the window adds the control area and rounds up to 2 MiB.
    pub data_bytes: usize,
    pub timeout_ns: u64,
    /// Run the LSA transport self-test during creation with this rail stride
    /// (`DEEP_EP_TRANSPORT_SELFTEST`, `backend::peer::gin::self_test_stride`).
    pub transport_self_test: Option<usize>,
    /// Create a GIN device comm on the communicator (internode buffers over NCCL GIN).
    pub gin: Option<GinSetup<'a>>,
}

/// The symmetric memory of one buffer, as kernels and host code address it. Created
/// collectively by the provider; [`PeerWindow::close`] is collective; dropping an unclosed window
/// releases what can be released without the peers.
pub trait PeerWindow: Send {
    /// Peer base pointers, rank, sizes and status pointer, passed to every kernel. For an
    /// internode buffer of the `nccl` provider, `peer_base` holds the own NVLink domain only.
    fn ctx(&self) -> &Ctx;
    /// Window base of every rank of the buffer this GPU can address, by world rank (NULL
    /// elsewhere; `num_ranks` entries): what the LSA emulation of the RDMA leg puts through.
    /// Defaults to the ctx's pointers.
    fn lsa_bases(&self) -> Vec<*mut std::ffi::c_void> {
        let c = self.ctx();
        (0..c.num_ranks as usize).map(|p| c.base_of(p)).collect()
    }
    /// The host-mapped status block kernels report errors and receive counts in.
    fn status(&self) -> &HostStatus;
    /// Bytes of the window, control area included.
    fn bytes(&self) -> usize;
    /// Collective release (barrier with timeout, then the provider's teardown).
    fn close(&mut self, timeout_ms: u64) -> Result<()>;
    /// Ranks of this buffer on this rank's GPU, this one included (more than one only on the
    /// ipc provider); `Ctx::num_sms` is already this rank's share of the SMs.
    fn ranks_on_gpu(&self) -> usize {
        1
    }
    /// Keep the window memory mapped until the process exits, whatever releases the window: a
    /// tensor aliasing it (the zero-copy combine view) may outlive the buffer, and reading it must
    /// not fault. A provider that cannot keep it (nvshmem: its heap goes at finalize) ignores this.
    fn keep_memory(&mut self) {}
    /// This rank's window as its own allocation maps it: what a tensor that may outlive the
    /// buffer points into (with [`PeerWindow::keep_memory`]). Defaults to `ctx().own_base()`; the
    /// nccl provider's kernels reach the window through an LSA mapping the release unmaps, so it
    /// returns the `ncclMemAlloc` pointer instead (same bytes, a mapping that is kept).
    fn own_memory(&self) -> *mut std::ffi::c_void {
        self.ctx().own_base()
    }
    /// The GIN device comm (byte copy of `ncclDevComm`) and the `ncclWindow_t` of this window on
    /// its communicator, when the provider created one (NCCL windows of internode buffers over GIN).
    fn gin(&self) -> Option<(&[u64], *mut std::ffi::c_void)> {
        None
    }
    /// [`PeerWindow::gin`] of every GIN communicator of the buffer (`DEEP_EP_GIN_COMMS`), the
    /// window's own first; empty without GIN.
    fn gin_all(&self) -> Vec<(&[u64], *mut std::ffi::c_void)> {
        self.gin().into_iter().collect()
    }
}

/// Bytes of a window holding `data_bytes`: the control area added, rounded up to 2 MiB (the
/// granularity of NCCL's and CUDA's allocations; every provider sizes alike, so offsets agree).
pub fn window_bytes(data_bytes: usize) -> usize {
    const ALLOC_ALIGN: usize = 2 << 20;
    (data_bytes + crate::kernels::intranode::CONTROL_BYTES).div_ceil(ALLOC_ALIGN) * ALLOC_ALIGN
}

/// The ctx of a window of `bytes` before any peer pointer is known (no peers, no status block,
/// every NVLink rank in one domain).
pub fn new_ctx(rank: usize, num_ranks: usize, bytes: usize, timeout_ns: u64, num_sms: i32) -> Ctx {
    Ctx { rank: rank as i32, num_ranks: num_ranks as i32, window_bytes: bytes as u64, timeout_ns, num_sms, ..Ctx::default() }
}

/// The last local steps of every provider's own window before its first barrier: the host-mapped
/// status block the kernels report into (`ctx.host_status` points at it), then the whole window
/// zeroed on `stream`, synchronously: control area, transport self-test signals and LL tags (a new
/// allocation may hold a destroyed buffer's tags), so no peer signals into memory that is not
/// zeroed yet.
///
/// # Safety
/// `ctx.own_base()` is this rank's live window of `ctx.window_bytes` bytes.
pub unsafe fn attach_status_and_zero(op: &'static str, ctx: &mut Ctx, stream: &Stream) -> Result<HostStatus> {
    let status = HostStatus::new(op)?;
    ctx.host_status = status.device_ptr().cast();
    // SAFETY: launch contract (the caller's obligation): the memset covers this rank's own window.
    unsafe { intranode::zero_window(op, ctx, stream.raw()) }?;
    stream.synchronize(op)?;
    Ok(status)
}

/// `impl PeerWindow` for a provider's `Window`: the context, status block and size from its
/// fields `ctx`, `status`, `bytes` (and `lsa_base`), the rest from its inherent methods of the
/// same names, for the optional methods it overrides.
macro_rules! forward_peer_window {
    ($t:ty $(, $opt:ident($($arg:ident: $aty:ty),*) -> $ret:ty)*) => {
        impl $crate::window::peer_window::PeerWindow for $t {
            fn ctx(&self) -> &$crate::kernels::intranode::Ctx {
                &self.ctx
            }
            fn status(&self) -> &$crate::kernels::intranode::HostStatus {
                self.status.as_ref().expect("status block exists after create")
            }
            fn bytes(&self) -> usize {
                self.bytes
            }
            fn close(&mut self, timeout_ms: u64) -> $crate::error::Result<()> {
                self.close(timeout_ms)
            }
            $($crate::window::peer_window::forward_peer_window!(@opt $opt($($arg: $aty),*) -> $ret);)*
        }
    };
    (@opt lsa_bases() -> $ret:ty) => {
        fn lsa_bases(&self) -> $ret {
            self.lsa_base.clone()
        }
    };
    (@opt keep_memory() -> $ret:ty) => {
        fn keep_memory(&mut self) {
            self.keep_memory()
        }
    };
    (@opt $opt:ident() -> $ret:ty) => {
        fn $opt(&self) -> $ret {
            self.$opt()
        }
    };
}
pub(crate) use forward_peer_window;
