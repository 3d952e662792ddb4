//! Which backend a buffer gets: construction of each compiled-in backend by kind, and fresh
//! unique ids. The only place that names the implementations, so the trait module does not
//! depend on them.

use super::{Backend, BackendKind, CreateArgs};
#[allow(unused_imports)] // Error: the arms of backends that are not compiled in
use crate::error::{Error, Result};

/// Creates the backend `kind` for `args`.
pub fn create(kind: BackendKind, args: &CreateArgs) -> Result<Box<dyn Backend>> {
    #[allow(dead_code)] // used by the arms of backends that are not compiled in
    const OP: &str = crate::op_names::CREATE_BUFFER;
    match kind {
        BackendKind::Cpu => Ok(Box::new(super::cpu::CpuBackend::create(args)?)),
        #[cfg(feature = "nccl")]
        BackendKind::Nccl => Ok(Box::new(super::peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "nccl"))]
        BackendKind::Nccl => Err(Error::NotCompiled { op: OP, backend: "nccl".into(), feature: "nccl" }),
        #[cfg(feature = "nvshmem")]
        BackendKind::Nvshmem => Ok(Box::new(super::peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "nvshmem"))]
        BackendKind::Nvshmem => Err(Error::NotCompiled { op: OP, backend: "nvshmem".into(), feature: "nvshmem" }),
        #[cfg(feature = "ipc")]
        BackendKind::Ipc => Ok(Box::new(super::peer::PeerBackend::create(args, kind)?)),
        #[cfg(not(feature = "ipc"))]
        BackendKind::Ipc => Err(Error::NotCompiled { op: OP, backend: "ipc".into(), feature: "ipc" }),
    }
}

/// A fresh rendezvous id for `kind` (called on one rank, shared by the caller).
pub fn unique_id(kind: BackendKind) -> Result<Vec<u8>> {
    match kind {
        BackendKind::Cpu => Ok(super::cpu::CpuBackend::unique_id()),
        #[cfg(feature = "nccl")]
        BackendKind::Nccl => super::peer::PeerBackend::unique_id(kind),
        #[cfg(not(feature = "nccl"))]
        BackendKind::Nccl => Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "nccl".into(), feature: "nccl" }),
        #[cfg(feature = "nvshmem")]
        BackendKind::Nvshmem => super::peer::PeerBackend::unique_id(kind),
        #[cfg(not(feature = "nvshmem"))]
        BackendKind::Nvshmem => {
            Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "nvshmem".into(), feature: "nvshmem" })
        }
        #[cfg(feature = "ipc")]
        BackendKind::Ipc => Ok(crate::window::ipc::unique_id()),
        #[cfg(not(feature = "ipc"))]
        BackendKind::Ipc => Err(Error::NotCompiled { op: crate::op_names::GET_UNIQUE_ID, backend: "ipc".into(), feature: "ipc" }),
    }
}
