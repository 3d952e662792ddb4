//! Window providers: what gives a buffer of this backend its symmetric memory and the peers'
//! addresses of it. The kernels (`kernels/intranode_*.cu`, `kernels/low_latency.cu`) and every
//! host-side op only use [`Ctx`] (peer base pointers, control area, status block), so one
//! backend runs on any provider:
//! - `nccl`: an NCCL communicator with one symmetric window (`window::nccl`), peer pointers
//!   from `ncclGetPeerPointer` (LSA).
//! - `nvshmem` (cargo feature `nvshmem`): one `nvshmem_malloc` allocation (`window::nvshmem`),
//!   peer pointers from `nvshmem_ptr`.
//! - `ipc` (cargo feature `ipc`): one `cudaMalloc` allocation per rank (`window::ipc`), peer
//!   pointers from `cudaIpcOpenMemHandle`; no NCCL, several ranks per GPU.

#[cfg(feature = "nccl")]
pub mod gin_comms;
#[cfg(feature = "ipc")]
pub mod ipc;
#[cfg(feature = "nccl")]
pub mod lsa_team;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nvshmem")]
pub mod nvshmem;

use crate::error::Result;
use crate::kernels::intranode::{Ctx, HostStatus, MAX_RANKS};

/// The symmetric memory of one buffer, as kernels and host code address it. Created
/// collectively by the provider; [`PeerWindow::close`] is collective; dropping an unclosed window
/// releases what can be released without the peers.
pub trait PeerWindow: Send {
    /// Peer base pointers, rank, sizes and status pointer, passed to every kernel. For an
    /// internode buffer of the `nccl` provider, `peer_base` holds the own NVLink domain only.
    fn ctx(&self) -> &Ctx;
    /// Window base of every rank this GPU can address, by world rank (NULL elsewhere): what the
    /// LSA emulation of the RDMA leg puts through. Defaults to the ctx's pointers.
    fn lsa_bases(&self) -> [*mut std::ffi::c_void; MAX_RANKS] {
        self.ctx().peer_base
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

/// `impl PeerWindow` for a provider's `Window` whose inherent methods of the same names do the
/// work: the four every provider has, then the optional ones it overrides.
macro_rules! forward_peer_window {
    ($t:ty $(, $opt:ident($($arg:ident: $aty:ty),*) -> $ret:ty)*) => {
        impl PeerWindow for $t {
            fn ctx(&self) -> &Ctx {
                self.ctx()
            }
            fn status(&self) -> &HostStatus {
                self.status()
            }
            fn bytes(&self) -> usize {
                self.bytes()
            }
            fn close(&mut self, timeout_ms: u64) -> Result<()> {
                self.close(timeout_ms)
            }
            $(forward_peer_window!(@opt $opt($($arg: $aty),*) -> $ret);)*
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

forward_peer_window!(
    nccl::Window,
    keep_memory() -> (),
    lsa_bases() -> [*mut std::ffi::c_void; MAX_RANKS],
    gin() -> Option<(&[u64], *mut std::ffi::c_void)>,
    gin_all() -> Vec<(&[u64], *mut std::ffi::c_void)>
);
#[cfg(feature = "nvshmem")]
forward_peer_window!(nvshmem::Window);
#[cfg(feature = "ipc")]
forward_peer_window!(ipc::Window, keep_memory() -> (), lsa_bases() -> [*mut std::ffi::c_void; MAX_RANKS], ranks_on_gpu() -> usize);
