//! The NCCL device-API backend. Intranode normal mode (dispatch, cached dispatch, combine) runs
//! on one NCCL symmetric window per buffer with a pull model (`normal.rs`, kernels in
//! `kernels/intranode_*.cu`); low-latency mode and internode buffers answer
//! [`Error::NotImplemented`].
//!
//! Every rank stages its inputs into its own window, the ranks meet at a flag barrier in the
//! window's control area, and each rank pulls what it receives from its peers' windows over
//! NVLink. Waits are bounded by `DEEP_EP_TIMEOUT_MS` on the GPU (the kernel records which rank did
//! not arrive in a host-mapped status word and returns) and on the host.
//!
//! Ordering rule: all ops of one buffer must be ordered on the GPU (one stream, or streams joined
//! by events), as with DeepEP's comm stream: barrier epochs live on the device.

pub mod gin;
mod normal;

use super::{Backend, BackendKind, BufferInfo, CachedDispatchArgs, CombineArgs, CombineOutputs, CreateArgs, DispatchArgs, DispatchOutputs, DispatchPlan, LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlStats, Stream, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use crate::ffi::intranode::MAX_RANKS;
use crate::ffi::nccl::{self, NcclLib};
use crate::ffi::nccl_window::{Window, WindowArgs};
use crate::tensor::{Device, TensorRef};
use std::time::Duration;

/// A buffer on NVLink through the NCCL device API.
pub struct NcclBackend {
    info: BufferInfo,
    /// The NCCL the buffer uses (version already checked against the build's headers).
    #[allow(dead_code)]
    lib: &'static NcclLib,
    /// NCCL's version code, for messages.
    #[allow(dead_code)]
    nccl_version: i32,
    window: Window,
    timeout: Duration,
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
    /// Creates the buffer (collective over `num_ranks` processes, one per GPU of one NVLink
    /// domain): communicator, device comm, symmetric window of `num_nvl_bytes` plus a 64 KiB
    /// control area (rounded up to 2 MiB), host-mapped status block.
    pub fn create(a: &CreateArgs) -> Result<Self> {
        const OP: &str = "deep_ep::create_buffer";
        let unique_id: [u8; UNIQUE_ID_BYTES] = a
            .unique_id
            .try_into()
            .map_err(|_| Error::invalid(OP, format!("unique_id must have {UNIQUE_ID_BYTES} bytes, got {}", a.unique_id.len())))?;
        let Device::Cuda(device) = a.device else {
            return Err(Error::invalid(OP, format!("the nccl backend needs a CUDA device, got {}", a.device)));
        };
        crate::ensure!(a.num_ranks > 0 && a.rank < a.num_ranks, OP, "rank {} out of range for {} ranks", a.rank, a.num_ranks);
        let (lib, nccl_version) = checked_library()?;
        if a.num_ranks > MAX_RANKS {
            return Err(ni(OP, "buffers of more than 8 ranks (internode)"));
        }
        let timeout = crate::settings::timeout();
        let window = Window::create(&WindowArgs {
            unique_id: &unique_id,
            rank: a.rank,
            num_ranks: a.num_ranks,
            device,
            data_bytes: a.num_nvl_bytes,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            transport_self_test: gin::self_test_stride_from_env(a.rank, a.num_ranks)?,
        })?;
        let info = BufferInfo::from_args(a, BackendKind::Nccl);
        Ok(NcclBackend { info, lib, nccl_version, window, timeout })
    }

    /// A fresh `ncclUniqueId` ([`UNIQUE_ID_BYTES`] bytes) from one rank; host only, no GPU needed.
    pub fn unique_id() -> Result<Vec<u8>> {
        let (lib, _) = checked_library()?;
        Ok(nccl::unique_id(lib)?.to_vec())
    }

    fn timeout_ms(&self) -> u64 {
        self.timeout.as_millis().min(u64::MAX as u128) as u64
    }
}

impl Backend for NcclBackend {
    fn info(&self) -> &BufferInfo { &self.info }
    fn dispatch_prepare(&mut self, a: &DispatchArgs) -> Result<DispatchPlan> { self.ht_dispatch_prepare(a) }
    fn dispatch_finish(&mut self, a: &DispatchArgs, p: &DispatchPlan, o: &DispatchOutputs) -> Result<()> { self.ht_dispatch_finish(a, p, o) }
    fn cached_dispatch(&mut self, a: &CachedDispatchArgs, x: &TensorRef, s: Option<&TensorRef>) -> Result<()> { self.ht_cached_dispatch(a, x, s) }
    fn combine(&mut self, a: &CombineArgs, o: &CombineOutputs) -> Result<()> { self.ht_combine(a, o) }
    fn ll_dispatch_send(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _a: &LlDispatchSendArgs, _out: &LlDispatchOutputs, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_dispatch", "low-latency dispatch")) }
    fn ll_dispatch_recv(&mut self, _g: &LlGeometry, _o: &LlDispatchOptions, _out: &LlDispatchOutputs, _st: &LlStats, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_dispatch", "low-latency dispatch")) }
    fn ll_combine_send(&mut self, _g: &LlGeometry, _a: &LlCombineSendArgs, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_combine", "low-latency combine")) }
    fn ll_combine_recv(&mut self, _g: &LlGeometry, _a: &LlCombineRecvArgs, _st: &LlStats, _s: Stream) -> Result<()> { Err(ni("deep_ep::low_latency_combine", "low-latency combine")) }
    fn clean_low_latency_buffer(&mut self, _g: &LlGeometry, _s: Stream) -> Result<()> { Err(ni("deep_ep::clean_low_latency_buffer", "low-latency mode")) }
    fn next_low_latency_combine_buffer(&mut self, _g: &LlGeometry) -> Result<TensorRef> { Err(ni("deep_ep::get_next_low_latency_combine_buffer", "low-latency mode")) }
    fn destroy(&mut self) -> Result<()> {
        let timeout_ms = self.timeout_ms();
        self.window.close(timeout_ms)
    }
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
