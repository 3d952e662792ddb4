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
mod peer_window;

pub use peer_window::{new_ctx, window_bytes, PeerWindow, WindowArgs};
