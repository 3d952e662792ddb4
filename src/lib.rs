//! # deep_ep
//!
//! DeepEP-compatible expert-parallel **dispatch** (send each token to the ranks hosting its
//! top-k experts) and **combine** (bring expert outputs back and reduce them), as a Rust crate
//! whose `libdeep_ep.so` registers `torch.ops.deep_ep.*` when loaded.
//!
//! Layers, dependencies pointing down (see `docs/DESIGN.md`):
//! - [`api`]: the `extern "C"` surface that `torch_ops/` (the only torch-aware code) calls; it
//!   hands plain values to `ops`.
//! - [`ops`]: validation of every op's arguments, the backends' argument structs built from
//!   them, then a call into the buffer's backend; [`buffer`]: the registry that maps the integer
//!   handles seen by torch to backends.
//! - [`backend`]: the [`backend::Backend`] trait; `cpu` (shared memory, the reference semantics)
//!   and `peer` (the NVLink peer-window backend behind backends `nccl`, `nvshmem` and `ipc`).
//! - `window`: where a peer-window buffer's memory comes from (NCCL, NVSHMEM, CUDA IPC).
//! - [`shm`]: host memory shared by the ranks of one machine and their rendezvous (the CPU
//!   backend's buffers, the ipc provider's host side).
//! - `kernels`: the host side of `kernels/*.cu` (launchers, the window context).
//! - [`sys`]: generated declarations of the kernels' C API and of NCCL.
//! - [`tensor`], [`op_io`], [`config`], [`layout`], [`numerics`], [`topology`], [`op_names`]: torch-free
//!   types and math; [`reference`]: a single-process reference of every op, for tests; [`host`]:
//!   owned CPU tensors and safe normal-mode op wrappers for Rust programs without torch.
//!
//! | cargo feature | what it adds | default |
//! |---|---|---|
//! | `cuda` | nvcc-built kernels, static cudart | yes |
//! | `nccl` | NCCL bindings (bindgen, dlopen'ed at run time) and the NCCL backend | yes |
//! | `torch` | the libtorch operator shim linked into the cdylib | yes |
//! | `nvshmem` | NVSHMEM window provider of the NVLink backend (`DEEP_EP_BACKEND=nvshmem`; NVSHMEM dlopen'ed at run time, nothing needed at build time) | yes |
//! | `ipc` | CUDA-IPC window provider (`DEEP_EP_BACKEND=ipc`: no NCCL, several ranks per GPU) | yes |

pub mod api;
pub mod backend;
pub mod buffer;
pub mod build_info;
pub mod config;
pub mod error;
pub mod host;
pub mod interrupt;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod layout;
pub mod log;
pub mod numerics;
pub mod op_io;
pub mod op_names;
pub mod ops;
pub mod reference;
pub mod settings;
pub mod shm;
pub mod sys;
pub mod tensor;
pub mod tensor_host;
pub mod topology;
#[cfg(feature = "nccl")]
pub mod window;

pub use error::{Error, Result};
