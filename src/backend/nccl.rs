//! The NCCL device-API backend (skeleton).

use super::{Backend, BackendKind, BufferInfo, CachedDispatchArgs, CombineArgs, CombineOutputs, CreateArgs, DispatchArgs, DispatchOutputs, DispatchPlan, LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlStats, Stream};
use crate::error::{Error, Result};
use crate::tensor::TensorRef;

/// A buffer on NVLink/RDMA through the NCCL device API.
pub struct NcclBackend {
    info: BufferInfo,
}

fn ni(op: &'static str, feature: &'static str) -> Error {
    Error::NotImplemented { op, backend: "nccl", feature }
}

impl NcclBackend {
    /// Creates the buffer (collective).
    pub fn create(a: &CreateArgs) -> Result<Self> {
        let info = BufferInfo { rank: a.rank, num_ranks: a.num_ranks, device: a.device, num_nvl_bytes: a.num_nvl_bytes, num_rdma_bytes: a.num_rdma_bytes, low_latency_mode: a.low_latency_mode, backend: BackendKind::Nccl };
        Ok(NcclBackend { info })
    }
    /// A fresh `ncclUniqueId`.
    pub fn unique_id() -> Result<Vec<u8>> {
        Err(ni("deep_ep::get_unique_id", "NCCL communicator setup"))
    }
}

impl Backend for NcclBackend {
    fn info(&self) -> &BufferInfo { &self.info }
    fn dispatch_prepare(&mut self, _a: &DispatchArgs) -> Result<DispatchPlan> { Err(ni("deep_ep::dispatch", "intranode dispatch over NVLink")) }
    fn dispatch_finish(&mut self, _a: &DispatchArgs, _p: &DispatchPlan, _o: &DispatchOutputs) -> Result<()> { Err(ni("deep_ep::dispatch", "intranode dispatch over NVLink")) }
    fn cached_dispatch(&mut self, _a: &CachedDispatchArgs, _x: &TensorRef, _s: Option<&TensorRef>) -> Result<()> { Err(ni("deep_ep::cached_dispatch", "intranode dispatch over NVLink")) }
    fn combine(&mut self, _a: &CombineArgs, _o: &CombineOutputs) -> Result<()> { Err(ni("deep_ep::combine", "intranode combine over NVLink")) }
    fn ll_dispatch_send(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _a: &LlDispatchSendArgs, _out: &LlDispatchOutputs, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_dispatch", "low-latency dispatch")) }
    fn ll_dispatch_recv(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _out: &LlDispatchOutputs, _st: &LlStats, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_dispatch", "low-latency dispatch")) }
    fn ll_combine_send(&mut self, _g: &LlGeometry, _a: &LlCombineSendArgs, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_combine", "low-latency combine")) }
    fn ll_combine_recv(&mut self, _g: &LlGeometry, _a: &LlCombineRecvArgs, _st: &LlStats, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_combine", "low-latency combine")) }
    fn clean_low_latency_buffer(&mut self, _g: &LlGeometry, _s: Stream) -> Result<()> { Err(ni("deep_ep::clean_low_latency_buffer", "low-latency mode")) }
    fn next_low_latency_combine_buffer(&mut self, _g: &LlGeometry) -> Result<TensorRef> { Err(ni("deep_ep::get_next_low_latency_combine_buffer", "low-latency mode")) }
    fn destroy(&mut self) -> Result<()> { Ok(()) }
}
