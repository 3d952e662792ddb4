//! Every `unsafe` boundary of the crate except shared memory (`backend::cpu::shm`): the C API
//! that `torch_ops/` calls, host views of CPU tensors, and the kernel and NCCL bindings.

pub mod capi;
pub mod capi_internode;
pub mod capi_modes;
#[cfg(feature = "nccl")]
pub mod gin_comms;
#[cfg(feature = "cuda")]
pub mod global_barrier;
#[cfg(feature = "cuda")]
pub mod host_mask;
#[cfg(feature = "cuda")]
pub mod internode;
#[cfg(feature = "cuda")]
pub mod intranode;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod ll_rows;
#[cfg(feature = "cuda")]
pub mod logfmt;
#[cfg(feature = "cuda")]
pub mod low_latency;
#[cfg(feature = "nccl")]
pub mod lsa_team;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
pub mod nccl_window;
#[cfg(feature = "nvshmem")]
pub mod nvshmem;
#[cfg(feature = "nvshmem")]
pub mod nvshmem_window;
pub mod tensor;
#[cfg(feature = "cuda")]
pub mod transport;
