//! The `extern "C"` surface declared in `csrc/deep_ep_capi.h`, the only thing `torch_ops/` (and
//! C++ callers) call: each function turns raw C arguments into checked Rust values, calls
//! [`crate::ops`], and reports errors through a thread-local message. One file per family, as
//! `torch_ops/impl_*.cpp`: buffers, layout and masks ([`buffer`]), normal and low-latency modes
//! ([`modes`]), internode normal mode ([`internode`]).

pub mod buffer;
pub mod internode;
pub mod modes;
