//! Normal-mode (high-throughput) ops on the CPU backend.

use super::CpuBackend;
use crate::backend::{CachedDispatchArgs, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan};
use crate::error::{Error, Result};
use crate::tensor::TensorRef;

fn todo(op: &'static str) -> Error {
    Error::NotImplemented { op, backend: "cpu", feature: "normal mode" }
}

impl CpuBackend {
    pub(super) fn ht_dispatch_prepare(&mut self, _a: &DispatchArgs) -> Result<DispatchPlan> {
        Err(todo("deep_ep::dispatch"))
    }
    pub(super) fn ht_dispatch_finish(&mut self, _a: &DispatchArgs, _p: &DispatchPlan, _o: &DispatchOutputs) -> Result<()> {
        Err(todo("deep_ep::dispatch"))
    }
    pub(super) fn ht_cached_dispatch(&mut self, _a: &CachedDispatchArgs, _x: &TensorRef, _s: Option<&TensorRef>) -> Result<()> {
        Err(todo("deep_ep::cached_dispatch"))
    }
    pub(super) fn ht_combine(&mut self, _a: &CombineArgs, _o: &CombineOutputs) -> Result<()> {
        Err(todo("deep_ep::combine"))
    }
}
