//! Low-latency ops on the CPU backend (placeholder until the LL implementation lands).

use super::CpuBackend;
use crate::backend::{LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlStats};
use crate::error::{Error, Result};
use crate::tensor::TensorRef;

/// Host-side low-latency state of one buffer.
#[derive(Default, Debug)]
pub struct LlState {}

fn todo(op: &'static str) -> Error {
    Error::NotImplemented { op, backend: "cpu", feature: "low-latency mode" }
}

impl CpuBackend {
    pub(super) fn ll_dispatch_send_impl(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _a: &LlDispatchSendArgs, _out: &LlDispatchOutputs) -> Result<()> {
        Err(todo("deep_ep::low_latency_dispatch"))
    }
    pub(super) fn ll_dispatch_recv_impl(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _out: &LlDispatchOutputs, _s: &LlStats) -> Result<()> {
        Err(todo("deep_ep::low_latency_dispatch"))
    }
    pub(super) fn ll_combine_send_impl(&mut self, _g: &LlGeometry, _a: &LlCombineSendArgs) -> Result<()> {
        Err(todo("deep_ep::low_latency_combine"))
    }
    pub(super) fn ll_combine_recv_impl(&mut self, _g: &LlGeometry, _a: &LlCombineRecvArgs, _s: &LlStats) -> Result<()> {
        Err(todo("deep_ep::low_latency_combine"))
    }
    pub(super) fn ll_clean_impl(&mut self, _g: &LlGeometry) -> Result<()> {
        Err(todo("deep_ep::clean_low_latency_buffer"))
    }
    pub(super) fn ll_next_combine_buffer_impl(&mut self, _g: &LlGeometry) -> Result<TensorRef> {
        Err(todo("deep_ep::get_next_low_latency_combine_buffer"))
    }
}
