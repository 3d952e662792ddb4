//! The host side of `kernels/*.cu`: safe and `unsafe` wrappers over the generated launch API
//! ([`crate::sys::kernels`]), one file per kernel family, plus the window context and its byte map
//! ([`intranode`]: `Ctx`, the control area, the status block, streams and device guards), the
//! host-mapped LL rank mask and the transport descriptors. Every launch is asynchronous on the
//! stream it gets and CUDA-graph capturable; the launch contract is in [`intranode`].

pub mod global_barrier;
pub mod host_mask;
pub mod internode;
pub mod intranode;
pub mod layout;
pub mod ll_rows;
pub mod logfmt;
pub mod low_latency;
pub mod transport;
