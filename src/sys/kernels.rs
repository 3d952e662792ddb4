//! The C launch API of `kernels/*.cu`, generated from `kernels/deep_ep_kernels.h` (which includes
//! `kernels/transport_api.h`). Every launcher returns a `cudaError_t` as `int` and takes the
//! stream as a raw `cudaStream_t` (`void*`, null = the legacy default stream); launches are
//! asynchronous. The safe wrappers live in `crate::ffi` (to become `crate::kernels`).

#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, clippy::all, rustdoc::all, missing_docs)]

include!(concat!(env!("OUT_DIR"), "/kernels_sys.rs"));
