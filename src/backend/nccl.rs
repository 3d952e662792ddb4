//! The NCCL device-API backend. Today: NCCL is loaded and version-checked, unique ids are real
//! `ncclUniqueId`s, and a buffer records its facts; every data op answers
//! [`Error::NotImplemented`] naming the missing feature until the GPU kernels land.

use super::{Backend, BackendKind, BufferInfo, CachedDispatchArgs, CombineArgs, CombineOutputs, CreateArgs, DispatchArgs, DispatchOutputs, DispatchPlan, LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlStats, Stream, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use crate::ffi::nccl::{self, NcclLib};
use crate::tensor::{Device, TensorRef};

/// A buffer on NVLink/RDMA through the NCCL device API.
pub struct NcclBackend {
    info: BufferInfo,
    /// The NCCL the buffer will use (version already checked against the build's headers).
    #[allow(dead_code)]
    lib: &'static NcclLib,
    /// The rendezvous id every rank passed to `create` (the communicator is built from it).
    #[allow(dead_code)]
    unique_id: [u8; UNIQUE_ID_BYTES],
    /// NCCL's version code, for messages.
    #[allow(dead_code)]
    nccl_version: i32,
}

fn ni(op: &'static str, feature: &'static str) -> Error {
    Error::NotImplemented { op, backend: "nccl", feature }
}

/// Loads NCCL and refuses a runtime whose version differs from the build's headers.
fn checked_library() -> Result<(&'static NcclLib, i32)> {
    let lib = nccl::library()?;
    let version = nccl::check_version(lib)?;
    Ok((lib, version))
}

impl NcclBackend {
    /// Creates the buffer (collective over `num_ranks` processes, one per GPU). Loads NCCL,
    /// checks its version and records the buffer's facts; communicator and window setup come
    /// with the kernels.
    pub fn create(a: &CreateArgs) -> Result<Self> {
        const OP: &str = "deep_ep::create_buffer";
        let unique_id: [u8; UNIQUE_ID_BYTES] = a
            .unique_id
            .try_into()
            .map_err(|_| Error::invalid(OP, format!("unique_id must have {UNIQUE_ID_BYTES} bytes, got {}", a.unique_id.len())))?;
        crate::ensure!(matches!(a.device, Device::Cuda(_)), OP, "the nccl backend needs a CUDA device, got {}", a.device);
        crate::ensure!(a.num_ranks > 0 && a.rank < a.num_ranks, OP, "rank {} out of range for {} ranks", a.rank, a.num_ranks);
        let (lib, nccl_version) = checked_library()?;
        let info = BufferInfo {
            rank: a.rank,
            num_ranks: a.num_ranks,
            device: a.device,
            num_nvl_bytes: a.num_nvl_bytes,
            num_rdma_bytes: a.num_rdma_bytes,
            low_latency_mode: a.low_latency_mode,
            backend: BackendKind::Nccl,
        };
        Ok(NcclBackend { info, lib, unique_id, nccl_version })
    }

    /// A fresh `ncclUniqueId` ([`UNIQUE_ID_BYTES`] bytes) from one rank; host only, no GPU needed.
    pub fn unique_id() -> Result<Vec<u8>> {
        let (lib, _) = checked_library()?;
        Ok(nccl::unique_id(lib)?.to_vec())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_validates_before_loading_nccl() {
        let args = |id: &'static [u8], device| CreateArgs { unique_id: id, rank: 0, num_ranks: 2, device, num_nvl_bytes: 0, num_rdma_bytes: 0, low_latency_mode: false };
        let e = NcclBackend::create(&args(&[0u8; 5], Device::Cuda(0))).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("unique_id must have 128 bytes, got 5"), "{e}");
        let e = NcclBackend::create(&args(&[0u8; 128], Device::Cpu)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("needs a CUDA device"), "{e}");
    }
}
