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

/// `deep_ep::create_buffer` (collective): a buffer of `num_ranks` ranks on `device` with
/// `num_nvl_bytes` of normal-mode and `num_rdma_bytes` of RDMA / low-latency memory, from the
/// `unique_id` one rank's [`get_unique_id`] made; returns its handle. `backend_name` "" =
/// `DEEP_EP_BACKEND` or the device's default.
#[allow(clippy::too_many_arguments)]
pub fn create_buffer(
    unique_id: &[u8],
    rank: i64,
    num_ranks: i64,
    device: Device,
    num_nvl_bytes: i64,
    num_rdma_bytes: i64,
    low_latency_mode: bool,
    backend_name: &str,
) -> Result<i64> {
    const OP: &str = crate::op_names::CREATE_BUFFER;
    crate::ensure!(rank >= 0 && num_ranks >= 1, OP, "rank ({rank}) must be >= 0 and num_ranks ({num_ranks}) >= 1");
    crate::ensure!(num_nvl_bytes >= 0 && num_rdma_bytes >= 0, OP, "buffer sizes must be >= 0, got {num_nvl_bytes} and {num_rdma_bytes}");
    crate::ensure!(unique_id.len() == UNIQUE_ID_BYTES, OP, "unique_id must have {UNIQUE_ID_BYTES} bytes, got {}", unique_id.len());
    let args = CreateArgs {
        unique_id,
        rank: rank as usize,
        num_ranks: num_ranks as usize,
        device,
        num_nvl_bytes: num_nvl_bytes as usize,
        num_rdma_bytes: num_rdma_bytes as usize,
        low_latency_mode,
    };
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
    let t = crate::topology::Topology::new(OP, args.rank, args.num_ranks, crate::topology::nvl_domain_size(OP)?)?;
    if t.path() == crate::topology::Path::Internode {
        crate::topology::check_buffer_sizes(&t, args.num_nvl_bytes, args.num_rdma_bytes, args.low_latency_mode)?;
    }
    let kind = BackendKind::select(OP, backend_name, args.device)?;
    buffer::create(kind, &args)
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

/// Whether the buffer's hook-mode low-latency calls run whole ([`crate::backend::BufferInfo::ll_whole_hooks`]);
/// local, a fact of the buffer (answered while its ops run, as `buffer_info`).
pub fn low_latency_whole_hooks(handle: i64, op: &'static str) -> Result<bool> {
    Ok(buffer::info(op, handle)?.ll_whole_hooks())
}

/// A view of this rank's part of a buffer ([`get_local_buffer`]): `numel` elements at `ptr`.
#[derive(Copy, Clone, Debug)]
pub struct LocalBufferView {
    pub ptr: *mut u8,
    pub numel: i64,
    pub device: Device,
}

/// `deep_ep::get_local_buffer_tensor` (local): this rank's normal-mode (NVLink) part of the buffer
/// (`num_nvl_bytes`) or, with `use_rdma_buffer`, its RDMA / low-latency part (`num_rdma_bytes`),
/// from byte `offset` on, as `(size - offset) / element_bytes` elements of `element_bytes`
/// (`dtype` names them in errors). `offset` must lie in `[0, size]` and be a multiple of the
/// element size. The memory stays the buffer's (valid until it is destroyed).
pub fn get_local_buffer(handle: i64, use_rdma_buffer: bool, offset: i64, element_bytes: i64, dtype: &str) -> Result<LocalBufferView> {
    const OP: &str = crate::op_names::GET_LOCAL_BUFFER_TENSOR;
    crate::ensure!(
        matches!(element_bytes, 1 | 2 | 4 | 8 | 16),
        OP,
        "dtype {dtype} has an element size of {element_bytes} bytes (expected 1, 2, 4, 8 or 16)"
    );
    let part = if use_rdma_buffer { "RDMA part (num_rdma_bytes)" } else { "NVLink part (num_nvl_bytes)" };
    let region = buffer::with(OP, handle, |b| b.local_region(use_rdma_buffer))?;
    let size = region.bytes as i64;
    crate::ensure!((0..=size).contains(&offset), OP, "offset ({offset}) must be in [0, {size}], the bytes of this rank's {part}");
    crate::ensure!(
        offset % element_bytes == 0,
        OP,
        "offset ({offset}) must be a multiple of {element_bytes} bytes, the element size of {dtype} (offset counts bytes, as in DeepEP)"
    );
    Ok(LocalBufferView { ptr: region.ptr.wrapping_add(offset as usize), numel: (size - offset) / element_bytes, device: region.device })
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
    let d = crate::topology::nvl_domain_size(OP)? as i64;
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
            let d = crate::topology::nvl_domain_size(crate::op_names::GET_DISPATCH_LAYOUT)?;
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
        Device::Cuda(_) => {
            let d = crate::topology::nvl_domain_size(crate::op_names::GET_DISPATCH_LAYOUT)?;
            cuda_dispatch_layout(topk_idx, num_experts, num_ranks, d, out, stream)
        }
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
    let d = crate::topology::nvl_domain_size(crate::op_names::GET_DISPATCH_LAYOUT)?;
    Ok(if num_ranks > d { num_ranks / d } else { 0 })
}

/// `deep_ep::nvl_domain_size`: ranks per NVLink domain, `DEEP_EP_NVL_DOMAIN_SIZE` through the
/// library's one parser (the Python package asks here instead of parsing it again).
pub fn nvl_domain_size() -> Result<usize> {
    crate::topology::nvl_domain_size(crate::op_names::NVL_DOMAIN_SIZE)
}

/// `deep_ep::check_environment`: the settings a buffer created now on `device` would read
/// (`DEEP_EP_BACKEND`, `DEEP_EP_TIMEOUT_MS`, `DEEP_EP_NVL_DOMAIN_SIZE`, `DEEP_EP_SHM_DIR`),
/// checked by the code `create_buffer` runs, so the error is the one a buffer would raise;
/// on success a one-line summary of what they select.
pub fn check_environment(device: Device) -> Result<String> {
    const OP: &str = crate::op_names::CREATE_BUFFER;
    let kind = BackendKind::select(OP, "", device)?;
    let timeout = crate::settings::timeout(OP)?;
    let d = crate::topology::nvl_domain_size(OP)?;
    // Only the backends on host shared memory read DEEP_EP_SHM_DIR.
    let shm = match kind {
        BackendKind::Cpu | BackendKind::Ipc => match crate::settings::shm_dir_checked(OP)? {
            Some(dir) => format!("named files in {dir}"),
            None => "anonymous".to_string(),
        },
        _ => "not used".to_string(),
    };
    Ok(format!("backend {}, NVLink domain {d}, timeout {} ms, shared memory {shm}", kind.name(), timeout.as_millis()))
}

/// `deep_ep::nvl_buffer_size_hint` (`rdma: false`) and `deep_ep::rdma_buffer_size_hint`: DeepEP's
/// `Config.get_*_buffer_size_hint` for ranks in NVLink domains of `DEEP_EP_NVL_DOMAIN_SIZE`.
pub fn buffer_size_hint(config: &[i64], hidden_bytes: i64, num_ranks: i64, rdma: bool) -> Result<i64> {
    let op = if rdma { crate::op_names::RDMA_BUFFER_SIZE_HINT } else { crate::op_names::NVL_BUFFER_SIZE_HINT };
    let c = crate::config::Config::from_slice(op, config)?;
    crate::ensure!(hidden_bytes > 0 && num_ranks > 0, op, "hidden_bytes ({hidden_bytes}) and num_ranks ({num_ranks}) must be positive");
    let (h, r, d) = (hidden_bytes as usize, num_ranks as usize, crate::topology::nvl_domain_size(op)?);
    crate::ensure!(
        r <= d || r % d == 0,
        op,
        "num_ranks must be <= {d} or a multiple of {d}, got {r} (NVLink domains of DEEP_EP_NVL_DOMAIN_SIZE={d} ranks)"
    );
    // An upper bound of either formula in f64, so that no size wraps around in usize or i64.
    let (ch, t) = (c.num_channels() as f64, c.num_max_nvl_chunked_recv_tokens.max(c.num_max_rdma_chunked_recv_tokens) as f64);
    let bound = ch * r as f64 * (t * (2.0 * h as f64 + 4096.0) + 64.0);
    ensure_hint_fits(op, bound, &format!("hidden_bytes {h}, num_ranks {r}, config {c:?}"))?;
    Ok(if rdma { c.rdma_buffer_size_hint(h, r, d) } else { c.nvl_buffer_size_hint(h, r, d) } as i64)
}

/// `deep_ep::low_latency_rdma_size_hint`: DeepEP's `get_low_latency_rdma_size_hint`.
pub fn low_latency_rdma_size_hint(t: i64, hidden: i64, num_ranks: i64, num_experts: i64) -> Result<i64> {
    const OP: &str = crate::op_names::LOW_LATENCY_RDMA_SIZE_HINT;
    crate::ensure!(
        t > 0 && hidden > 0 && num_ranks > 0 && num_experts > 0,
        OP,
        "all arguments must be positive, got ({t}, {hidden}, {num_ranks}, {num_experts})"
    );
    let bound = 8.0 * num_experts as f64 * t as f64 * (3.0 * hidden as f64 + 32.0) + 8.0 * num_experts as f64 + 512.0;
    ensure_hint_fits(OP, bound, &format!("num_max_dispatch_tokens_per_rank {t}, hidden {hidden}, num_experts {num_experts}"))?;
    Ok(crate::config::low_latency_rdma_size_hint(t as usize, hidden as usize, num_ranks as usize, num_experts as usize) as i64)
}

/// Size hints are computed in `usize` and returned as `i64`: arguments whose hint could exceed
/// 2^62 bytes (4 EiB, far beyond any machine) are refused instead of wrapping to a small or
/// negative number.
fn ensure_hint_fits(op: &'static str, bound: f64, args: &str) -> Result<()> {
    if bound.is_finite() && bound < (1u64 << 62) as f64 {
        return Ok(());
    }
    Err(crate::error::Error::invalid(op, format!("arguments too large: the size hint would exceed 2^62 bytes ({args})")))
}
