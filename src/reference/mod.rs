//! Single-process reference implementations of every op over all ranks at once (no shared
//! memory, no torch): what `cargo test` checks the layout math and numerics against, and the
//! model the CPU backend and GPU kernels must agree with.

pub mod ht;
pub mod ll;
