//! What every backend is told at creation and keeps: its kind, the static facts of its buffer
//! and the creation arguments.

use crate::error::{Error, Result};
use crate::tensor::Device;

/// Which transport a buffer uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Host shared memory between processes of one machine (development, CI, reference).
    Cpu,
    /// NCCL device API (LSA over NVLink, GIN over RDMA). Default on CUDA devices.
    Nccl,
    /// NVSHMEM symmetric memory (intranode: peer pointers from `nvshmem_ptr`), running the
    /// same kernels as `Nccl` (cargo feature `nvshmem`).
    Nvshmem,
    /// CUDA-IPC memory (`cudaMalloc` + `cudaIpcOpenMemHandle`, no NCCL), running the same kernels
    /// as `Nccl`; several ranks may share one GPU (cargo feature `ipc`).
    Ipc,
}

impl BackendKind {
    /// Name used in `DEEP_EP_BACKEND` and messages.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Nccl => "nccl",
            BackendKind::Nvshmem => "nvshmem",
            BackendKind::Ipc => "ipc",
        }
    }

    /// Chooses the backend: an explicit non-empty `requested` name wins, then the
    /// `DEEP_EP_BACKEND` environment variable, then the device's default (CPU tensors: `cpu`,
    /// CUDA tensors: `nccl`). A CPU device always uses the CPU backend.
    pub fn select(op: &'static str, requested: &str, device: Device) -> Result<BackendKind> {
        Self::select_from(op, requested, &std::env::var("DEEP_EP_BACKEND").unwrap_or_default(), device)
    }

    /// [`Self::select`] with the value of `DEEP_EP_BACKEND` given (`""` = unset).
    pub fn select_from(op: &'static str, requested: &str, env: &str, device: Device) -> Result<BackendKind> {
        let name = if !requested.is_empty() { requested } else { env };
        let kind = match name {
            "" => match device {
                Device::Cpu => BackendKind::Cpu,
                Device::Cuda(_) => BackendKind::Nccl,
            },
            "cpu" => BackendKind::Cpu,
            "nccl" => BackendKind::Nccl,
            "nvshmem" => BackendKind::Nvshmem,
            "ipc" => BackendKind::Ipc,
            other => {
                let from = if requested.is_empty() { " (from DEEP_EP_BACKEND)" } else { "" };
                return Err(Error::invalid(op, format!("unknown backend '{other}'{from} (expected cpu, nccl, nvshmem or ipc)")));
            }
        };
        match (kind, device) {
            (BackendKind::Cpu, _) | (_, Device::Cuda(_)) => Ok(kind),
            // An explicit request that cannot be honoured is an error; the environment
            // variable only sets a preference for GPU buffers.
            (_, Device::Cpu) if !requested.is_empty() => {
                Err(Error::invalid(op, format!("backend '{}' needs a CUDA device; CPU buffers use the cpu backend", kind.name())))
            }
            (_, Device::Cpu) => Ok(BackendKind::Cpu),
        }
    }
}

/// Static facts about a buffer, fixed at creation.
#[derive(Clone, Debug)]
pub struct BufferInfo {
    pub rank: usize,
    pub num_ranks: usize,
    pub device: Device,
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    pub backend: BackendKind,
    /// Ranks per NVLink domain (`DEEP_EP_NVL_DOMAIN_SIZE` at creation, default 8).
    pub nvl_domain_size: usize,
}

impl BufferInfo {
    /// The facts `create_buffer` fixes, for a buffer on `backend`.
    pub fn from_args(a: &CreateArgs, backend: BackendKind) -> Self {
        BufferInfo {
            rank: a.rank,
            num_ranks: a.num_ranks,
            device: a.device,
            num_nvl_bytes: a.num_nvl_bytes,
            num_rdma_bytes: a.num_rdma_bytes,
            low_latency_mode: a.low_latency_mode,
            backend,
            nvl_domain_size: crate::topology::nvl_domain_size(crate::op_names::CREATE_BUFFER)
                .unwrap_or(crate::topology::DEFAULT_NVL_DOMAIN_SIZE),
        }
    }

    /// Whether a hook-mode low-latency call on this buffer runs the whole op in the call, its
    /// receive hook having nothing left to do: one rank on a GPU backend, where the receive has no
    /// peer to wait for and the whole op takes its one-rank form (one launch writing the outputs),
    /// unless `DEEP_EP_LL_LAUNCH=two` asks for the send and receive launches apart. The Python
    /// `Buffer` reads it (`deep_ep::buffer_info`); the ops themselves do not change.
    pub fn ll_whole_hooks(&self) -> bool {
        self.num_ranks == 1 && self.backend != BackendKind::Cpu && crate::settings::ll_one_launch()
    }
}

/// Arguments of `create_buffer` (collective over `num_ranks` processes).
pub struct CreateArgs<'a> {
    /// Rendezvous id produced by one rank's `get_unique_id` and shared by the caller.
    pub unique_id: &'a [u8],
    pub rank: usize,
    pub num_ranks: usize,
    pub device: Device,
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
}
