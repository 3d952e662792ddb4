//! Single-process reference of the low-latency ops over all ranks at once (no shared memory, no
//! torch): what `cargo test` checks the CPU backend's LL mode against. The normal-mode reference
//! is `tests/python/_reference.py` (its layout math is `crate::layout`, shared with every
//! backend), which the CPU and GPU suites compare against.

pub mod ll;
