//! # deep_ep
//!
//! DeepEP-compatible expert-parallel **dispatch** (send each token to the ranks hosting its
//! top-k experts) and **combine** (bring expert outputs back and reduce them), as a Rust crate
//! whose `libdeep_ep.so` registers `torch.ops.deep_ep.*` when loaded.
//!
//! Layers (see `docs/DESIGN.md`):
//! - `kernels/*.cu`: device code behind a plain C launch API ([`kernels::layout`]).
//! - [`tensor`], [`config`], [`layout`], [`numerics`], [`topology`]: torch-free types and math.
//! - [`ops`]: validation of every op's arguments, then a call into the buffer's backend.
//! - [`backend`]: the [`backend::Backend`] trait; `cpu` (shared memory) and `nccl` (device API; its
//!   window can also come from NVSHMEM: backend `nvshmem`).
//! - [`buffer`]: the registry that maps the integer handles seen by torch to backends.
//! - [`api::buffer`]: the `extern "C"` surface that `torch_ops/` (the only torch-aware code) calls.
//! - [`reference`]: a single-process reference of every op, for tests.
//! - [`host`]: owned CPU tensors and safe normal-mode op wrappers for Rust programs without torch.
//!
//! | cargo feature | what it adds | default |
//! |---|---|---|
//! | `cuda` | nvcc-built kernels, static cudart | yes |
//! | `nccl` | NCCL bindings (bindgen, dlopen'ed at run time) and the NCCL backend | yes |
//! | `torch` | the libtorch operator shim linked into the cdylib | yes |
//! | `nvshmem` | NVSHMEM window provider of the NVLink backend (`DEEP_EP_BACKEND=nvshmem`; NVSHMEM dlopen'ed at run time, nothing needed at build time) | yes |

pub mod api;
pub mod backend;
pub mod buffer;
pub mod build_info;
pub mod config;
pub mod error;
pub mod host;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod layout;
pub mod log;
pub mod numerics;
pub mod op_names;
pub mod ops;
pub mod reference;
pub mod settings;
pub mod sys;
pub mod tensor;
pub mod tensor_host;
pub mod topology;
#[cfg(feature = "nccl")]
pub mod window;

pub use error::{Error, Result};
