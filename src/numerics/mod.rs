//! Bit-exact numeric conversions shared by the CPU backend, the reference and the tests:
//! bf16 (round to nearest even), FP8 E4M3 with per-128-channel scales (incl. UE8M0), LogFMT, NVFP4.

pub mod bf16;
pub mod fp8;
pub mod logfmt;
pub mod nvfp4;
