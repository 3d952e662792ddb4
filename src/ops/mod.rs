//! Op entry points below the C seam: validate every argument against the op's contract and the
//! buffer, then call the buffer's backend. Backends may assume what is checked here.

mod internode;
pub(crate) mod low_latency;
mod normal;

pub use internode::*;
pub use low_latency::*;
pub use normal::*;

use crate::backend::{self, BackendKind, CreateArgs, UNIQUE_ID_BYTES};
use crate::buffer;
use crate::error::Result;
use crate::layout;
use crate::tensor::{DType, Device, TensorRef};

/// `deep_ep::get_unique_id`: a rendezvous id for `backend` ("" = `DEEP_EP_BACKEND` or cpu).
pub fn get_unique_id(backend_name: &str, device: Device) -> Result<Vec<u8>> {
    let kind = BackendKind::select(crate::op_names::GET_UNIQUE_ID, backend_name, device)?;
    backend::registry::unique_id(kind)
}

/// `deep_ep::create_buffer` (collective).
pub fn create_buffer(args: &CreateArgs, backend_name: &str) -> Result<i64> {
    const OP: &str = crate::op_names::CREATE_BUFFER;
    crate::ensure!(
        args.unique_id.len() == UNIQUE_ID_BYTES,
        OP,
        "unique_id must have {UNIQUE_ID_BYTES} bytes, got {}",
        args.unique_id.len()
    );
    crate::ensure!(args.num_ranks >= 1, OP, "num_ranks must be >= 1, got {}", args.num_ranks);
    crate::ensure!(args.rank < args.num_ranks, OP, "rank {} out of range for num_ranks {}", args.rank, args.num_ranks);
    crate::ensure!(
        args.num_nvl_bytes % 128 == 0 && args.num_rdma_bytes % 128 == 0,
        OP,
        "num_nvl_bytes ({}) and num_rdma_bytes ({}) must be multiples of 128",
        args.num_nvl_bytes,
        args.num_rdma_bytes
    );
    // DeepEP's topology rules (DEEP_EP_NVL_DOMAIN_SIZE): every domain full; an internode
    // buffer's RDMA area sized for its mode.
    let t = crate::topology::Topology::new(OP, args.rank, args.num_ranks, crate::topology::nvl_domain_size()?)?;
    if t.path() == crate::topology::Path::Internode {
        crate::topology::check_buffer_sizes(&t, args.num_nvl_bytes, args.num_rdma_bytes, args.low_latency_mode)?;
    }
    let kind = BackendKind::select(OP, backend_name, args.device)?;
    buffer::create(kind, args)
}

/// `deep_ep::destroy_buffer` (collective).
pub fn destroy_buffer(handle: i64) -> Result<()> {
    buffer::destroy(crate::op_names::DESTROY_BUFFER, handle)
}

/// `deep_ep::bind_buffer_slot` (local): slot handle `-(slot + 1)` names this buffer from now on.
pub fn bind_buffer_slot(handle: i64, slot: i64) -> Result<()> {
    buffer::bind_slot(crate::op_names::BIND_BUFFER_SLOT, handle, slot)
}

/// `deep_ep::buffer_info`: `[rank, num_ranks, device, num_nvl_bytes, num_rdma_bytes,
/// low_latency_mode, backend (0 cpu, 1 nccl, 2 nvshmem)]`.
/// `op` names the calling op in errors.
pub fn buffer_info(handle: i64, op: &'static str) -> Result<[i64; 7]> {
    let i = buffer::info(op, handle)?;
    Ok([
        i.rank as i64,
        i.num_ranks as i64,
        i.device.to_raw() as i64,
        i.num_nvl_bytes as i64,
        i.num_rdma_bytes as i64,
        i.low_latency_mode as i64,
        i.backend as i64,
    ])
}

/// Outputs of `get_dispatch_layout`, caller-allocated: `[R]`, `[R/8]` (absent when R ≤ 8),
/// `[E]` int32 and `[N, R]` bool, on the device of `topk_idx`.
pub struct LayoutOutputs {
    pub num_tokens_per_rank: TensorRef,
    pub num_tokens_per_rdma_rank: Option<TensorRef>,
    pub num_tokens_per_expert: TensorRef,
    pub is_token_in_rank: TensorRef,
}

/// Validates `get_dispatch_layout` inputs (call before allocating outputs).
pub fn check_dispatch_layout(topk_idx: &TensorRef, num_experts: i64, num_ranks: i64) -> Result<()> {
    const OP: &str = crate::op_names::GET_DISPATCH_LAYOUT;
    crate::ensure!(num_ranks >= 1, OP, "num_ranks must be >= 1, got {num_ranks}");
    // No buffer has more ranks, nor more experts per rank (outputs are [num_ranks] and [num_experts]).
    let max_ranks = crate::backend::cpu::MAX_RANKS as i64;
    crate::ensure!(num_ranks <= max_ranks, OP, "num_ranks must be at most {max_ranks} (the most ranks of a buffer), got {num_ranks}");
    let max_experts = num_ranks * crate::ops::MAX_LOCAL_EXPERTS as i64;
    crate::ensure!(
        num_experts <= max_experts,
        OP,
        "num_experts ({num_experts}) must be at most {max_experts} ({} experts per rank of {num_ranks})",
        crate::ops::MAX_LOCAL_EXPERTS
    );
    crate::ensure!(
        num_experts >= 1 && num_experts % num_ranks == 0,
        OP,
        "num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})"
    );
    let d = crate::topology::nvl_domain_size()? as i64;
    crate::ensure!(
        num_ranks <= d || num_ranks % d == 0,
        OP,
        "num_ranks ({num_ranks}) above {d} must be a multiple of {d} (NVLink domains of DEEP_EP_NVL_DOMAIN_SIZE={d} ranks)"
    );
    topk_idx
        .check(OP, "topk_idx")
        .on(&[DType::Int32, DType::Int64], topk_idx.device)?
        .shape(&[("num_tokens", None), ("num_topk", None)])?
        .contiguous()?
        .done()
}

/// `deep_ep::get_dispatch_layout` (local, not collective). On CUDA it launches on `stream`.
pub fn get_dispatch_layout(
    topk_idx: &TensorRef,
    num_experts: usize,
    num_ranks: usize,
    out: &LayoutOutputs,
    stream: backend::Stream,
) -> Result<()> {
    check_dispatch_layout(topk_idx, num_experts as i64, num_ranks as i64)?;
    match topk_idx.device {
        Device::Cpu => {
            let (n, k) = (topk_idx.size(0), topk_idx.size(1));
            let d = crate::topology::nvl_domain_size()?;
            let ids = topk_idx.cpu_indices_i64();
            crate::layout::check_expert_ids(crate::op_names::GET_DISPATCH_LAYOUT, &ids, k, num_experts)?;
            let l = layout::dispatch_layout_in_domains(&ids, n, k, num_experts, num_ranks, d);
            out.num_tokens_per_rank.cpu_slice_mut::<i32>().copy_from_slice(&l.num_tokens_per_rank);
            if let Some(t) = &out.num_tokens_per_rdma_rank {
                t.cpu_slice_mut::<i32>().copy_from_slice(&l.num_tokens_per_rdma_rank);
            }
            out.num_tokens_per_expert.cpu_slice_mut::<i32>().copy_from_slice(&l.num_tokens_per_expert);
            for (d, s) in out.is_token_in_rank.cpu_slice_mut::<u8>().iter_mut().zip(&l.is_token_in_rank) {
                *d = *s as u8;
            }
            Ok(())
        }
        Device::Cuda(_) => cuda_dispatch_layout(topk_idx, num_experts, num_ranks, crate::topology::nvl_domain_size()?, out, stream),
    }
}

#[cfg(feature = "cuda")]
fn cuda_dispatch_layout(topk_idx: &TensorRef, e: usize, r: usize, d: usize, out: &LayoutOutputs, stream: backend::Stream) -> Result<()> {
    crate::kernels::layout::dispatch_layout(
        topk_idx,
        e,
        r,
        &out.num_tokens_per_rank,
        out.num_tokens_per_rdma_rank.as_ref(),
        &out.num_tokens_per_expert,
        &out.is_token_in_rank,
        d,
        stream,
    )
}

#[cfg(not(feature = "cuda"))]
fn cuda_dispatch_layout(_: &TensorRef, _: usize, _: usize, _: usize, _: &LayoutOutputs, _: backend::Stream) -> Result<()> {
    Err(crate::error::Error::NotCompiled { op: crate::op_names::GET_DISPATCH_LAYOUT, backend: "cuda".into(), feature: "cuda" })
}

/// `deep_ep::wait_stats` (local): per peer `[waits, nanoseconds]` of this rank's host waits
/// (see `Backend::wait_stats`); `reset` zeroes them after reading.
pub fn wait_stats(handle: i64, reset: bool) -> Result<Vec<[i64; 2]>> {
    buffer::with(crate::op_names::WAIT_STATS, handle, |b| b.wait_stats(reset))
}

/// Entries of `num_tokens_per_rdma_rank` for `num_ranks` ranks: `num_ranks / D` when the ranks
/// span several NVLink domains of `D` (`DEEP_EP_NVL_DOMAIN_SIZE`), else 0.
pub fn num_rdma_entries(num_ranks: usize) -> Result<usize> {
    let d = crate::topology::nvl_domain_size()?;
    Ok(if num_ranks > d { num_ranks / d } else { 0 })
}
