//! The NVLink peer-pointer backend (`nccl`, and `nvshmem` with that cargo feature). Intranode normal mode (dispatch, cached dispatch, combine) runs
//! on one NCCL symmetric window per buffer with a pull model (`normal.rs`, kernels in
//! `kernels/intranode_*.cu`); low-latency mode pushes over the same window's peer pointers
//! (`low_latency.rs`, `kernels/low_latency.cu`), and reaches peers outside the caller's NVLink
//! domain through the transport seam when the ranks span several domains (`ll_seam.rs`: LSA
//! emulation, or NCCL GIN with `DEEP_EP_RDMA_TRANSPORT=gin`); internode normal mode (ranks spanning several NVLink domains of
//! `DEEP_EP_NVL_DOMAIN_SIZE`) forwards over the transport seam (`internode.rs`,
//! `kernels/internode_*.cu`; LSA emulation, or NCCL GIN with `DEEP_EP_RDMA_TRANSPORT=gin`). The kernels of an internode
//! buffer get the windows of their own NVLink domain only (`Ctx::nvl_ranks`, the others NULL,
//! as on a cluster where NCCL's LSA team is the node), and its barriers of all ranks (destroy,
//! the LL signal reset) are the global barrier of `kernels::global_barrier`, set up at creation.
//!
//! The window comes from a provider ([`window::PeerWindow`]): an NCCL symmetric window (backend
//! `nccl`) or an NVSHMEM symmetric allocation (backend `nvshmem`); kernels and host code only see
//! its peer base pointers, control area and status block, so both run the same code.
//!
//! Every rank stages its inputs into its own window, the ranks meet at a flag barrier in the
//! window's control area, and each rank pulls what it receives from its peers' windows over
//! NVLink. Waits are bounded by `DEEP_EP_TIMEOUT_MS` on the GPU (the kernel records which rank did
//! not arrive in a host-mapped status word and returns) and on the host.
//!
//! Ordering rule: all ops of one buffer must be ordered on the GPU (one stream, or streams joined
//! by events), as with DeepEP's comm stream: barrier epochs live on the device.
//!
//! Rank masking (LL): the mask and the shrink flag live in a host-mapped `int32_t` block
//! ([`HostMask`], layout in `kernels::host_mask`): a word per rank (1 = masked), then the
//! shrink-mode word.
//! LL kernels read a device copy of the mask words ([`PeerBackend::ll_mask_device_ptr`], in the
//! window's control area) that every mask update rewrites (reading host-mapped memory from every
//! block crossed PCIe: 10-50x slower LL ops, measured); graph replays read it too, so mask updates
//! need no re-capture. The kernels apply the
//! mask as the CPU backend (no sends to a masked rank, no waits for it, its experts dropped). In
//! shrink mode (`SHRINK_WORD`, passed to the kernels as `shrink_mask`) an LL receive wait that reaches
//! its deadline masks the peer in both copies and goes on without it, as DeepEP and the CPU
//! backend do; the next LL call logs the newly masked ranks. Without shrink mode the wait
//! raises the timeout (naming the rank) and the buffer becomes unusable.

pub mod gin;
mod internode;
pub mod ll_seam;
mod ll_state;
mod low_latency;
mod normal;
pub mod signals;

use super::{Backend, BackendKind, BufferInfo, CreateArgs, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use crate::kernels::host_mask::{HostMask, RankSet};
use crate::kernels::intranode::MAX_RANKS;
use crate::sys::nccl;
use crate::tensor::Device;
use crate::window::gin_comms::GinSetup;
use crate::window::nccl::Window;
use crate::window::WindowArgs;
use std::time::Duration;

/// A buffer on NVLink: NCCL device-API window or NVSHMEM symmetric allocation (`info.backend`).
pub struct PeerBackend {
    info: BufferInfo,
    window: Box<dyn crate::window::PeerWindow>,
    timeout: Duration,
    /// Low-latency host state (half of the next send, geometry of the signals).
    ll: ll_state::LlState,
    /// LL rank mask + shrink flag, host-mapped so LL kernels read it (see the module doc).
    mask: HostMask,
    /// Mask bits the host knows of (set by the mask ops or already reported): a bit beyond them
    /// is a rank that shrink mode masked in a kernel, logged once at the next LL call.
    mask_seen: std::cell::Cell<RankSet>,
    /// Internode LL: how the kernels reach peers outside this rank's NVLink domain.
    seam: Option<ll_seam::Seam>,
}

fn ni(kind: BackendKind, op: &'static str, feature: &'static str) -> Error {
    Error::NotImplemented { op, backend: kind.name(), feature }
}

/// An internode buffer whose kernels address the windows of their own NVLink domain only: checks
/// that (every other rank's pointer NULL, so a kernel that still addresses one faults) and sets up
/// the global barrier (destroy, LL signal reset) over the buffer's seam: GIN with signal ids after
/// the plan's, or the LSA emulation through the window's LSA pointers. Local.
fn split_setup(
    op: &'static str,
    window: &dyn crate::window::PeerWindow,
    topo: &crate::topology::Topology,
    gin_plan: Option<&gin::GinPlan>,
) -> Result<()> {
    use crate::kernels::global_barrier;
    let ctx = window.ctx();
    let own = ctx.addressed_ranks();
    let domain: Vec<usize> = topo.nvl_peers().collect();
    crate::ensure!(
        own == domain && ctx.nvl_ranks as usize == topo.num_nvl_ranks(),
        op,
        "internal: the kernels address the windows of ranks {own:?}, not exactly this NVLink domain {domain:?}"
    );
    let how = match (gin_plan, window.gin()) {
        (Some(p), Some(_)) => {
            // SAFETY: launch contract: the ctx of this live window; the descriptor goes into its own control area.
            unsafe { global_barrier::setup_gin(op, ctx, &window.gin_all(), signals::barrier_base(p.signals)) }?;
            "NCCL GIN"
        }
        (None, None) => {
            // SAFETY: launch contract: the ctx of this live window; the descriptor goes into its own control area.
            unsafe { global_barrier::setup_lsa(op, ctx, &window.lsa_bases()) }?;
            "the LSA emulation"
        }
        _ => return Err(Error::invalid(op, "internal: a GIN plan without a GIN device comm, or the reverse")),
    };
    crate::log_info!(Some(topo.rank), "{op}: kernels address the windows of ranks {own:?} only (NVLink domain {} of {}); ranks {:?} are reached through the transport seam, and barriers of all ranks go over {how}", topo.rdma_rank(), topo.num_rdma_ranks(), ll_seam::remote_peers(topo));
    Ok(())
}

/// Loads NCCL and refuses a runtime whose version differs from the build's headers.
fn checked_library() -> Result<&'static nccl::NcclLib> {
    let lib = nccl::library()?;
    nccl::check_version(lib)?;
    Ok(lib)
}

impl PeerBackend {
    /// Creates the buffer (collective over `num_ranks` processes, one per GPU of one NVLink
    /// domain) on the window provider of `kind` (`Nccl`: communicator, device comm, symmetric
    /// window; `Nvshmem`: NVSHMEM initialisation and one symmetric allocation) of
    /// `num_nvl_bytes` (plus the LL area) and a 64 KiB control area, rounded up to 2 MiB, and a
    /// host-mapped status block.
    pub fn create(a: &CreateArgs, kind: BackendKind) -> Result<Self> {
        const OP: &str = crate::op_names::CREATE_BUFFER;
        let unique_id: [u8; UNIQUE_ID_BYTES] = a
            .unique_id
            .try_into()
            .map_err(|_| Error::invalid(OP, format!("unique_id must have {UNIQUE_ID_BYTES} bytes, got {}", a.unique_id.len())))?;
        let Device::Cuda(device) = a.device else {
            return Err(Error::invalid(OP, format!("the {} backend needs a CUDA device, got {}", kind.name(), a.device)));
        };
        crate::ensure!(a.num_ranks > 0 && a.rank < a.num_ranks, OP, "rank {} out of range for {} ranks", a.rank, a.num_ranks);
        // More than 8 ranks: an internode buffer (NVLink domains of at most 8), up to 256 ranks in
        // 32 domains (docs/RANKS.md); refused here, before any rank waits in NCCL's init for peers.
        if a.num_ranks > MAX_RANKS {
            if kind == BackendKind::Nvshmem {
                return Err(Error::NotImplemented { op: OP, backend: kind.name(), feature: "buffers of more than 8 ranks (internode)" });
            }
            let max = crate::kernels::internode::MAX_RANKS;
            crate::ensure!(a.num_ranks <= max, OP, "{} ranks: a buffer has at most {max}", a.num_ranks);
            let lsa_max = crate::kernels::transport::MAX_LSA_PEERS;
            let gin = gin::GinKnobs::from_env()?.transport == Some(gin::RdmaTransport::Gin);
            crate::ensure!(
                gin || a.num_ranks <= lsa_max,
                OP,
                "{} ranks: the LSA emulation of the RDMA leg (DEEP_EP_RDMA_TRANSPORT unset or lsa) reaches at most {lsa_max} ranks, \
                 all on one machine; across machines set DEEP_EP_RDMA_TRANSPORT=gin",
                a.num_ranks
            );
        }
        crate::kernels::low_latency::check_struct_size(OP)?;
        let timeout = crate::settings::timeout(OP)?;
        // Internode LL (ranks over several NVLink domains): the seam's area after the LL area.
        let topo = crate::topology::Topology::new(OP, a.rank, a.num_ranks, crate::topology::nvl_domain_size(OP)?)?;
        let knobs = gin::GinKnobs::from_env()?;
        let net_kind = ll_seam::select(knobs.transport, &topo, a.low_latency_mode);
        // Internode over NCCL GIN (LL and normal mode): a GIN device comm on the buffer's
        // communicator, created before its window is registered (nccl_window.rs).
        let gin_plan = gin::buffer_plan(&knobs, a.num_ranks, topo.num_rdma_ranks(), a.low_latency_mode)?;
        let seam_bytes = net_kind.map_or(0, |_| ll_seam::SeamLayout::extra_bytes(a.num_rdma_bytes));
        let mut data_bytes =
            a.num_nvl_bytes + ll_state::extra_window_bytes(a.num_nvl_bytes, a.num_rdma_bytes, a.low_latency_mode) + seam_bytes;
        let d = crate::topology::nvl_domain_size(OP)?;
        if a.num_ranks > d && !a.low_latency_mode {
            // Internode normal mode: its control area (after the transport self-test's) and the
            // RDMA area next to the NVLink one (internode.rs lays out the whole data area).
            data_bytes += crate::kernels::internode::CTRL_OFF + crate::kernels::internode::CTRL_BYTES
                - crate::kernels::intranode::CONTROL_BYTES
                + a.num_rdma_bytes;
        }
        crate::kernels::internode::check_struct_size(OP)?;
        let timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        let transport_self_test = gin::self_test_stride_from_env(a.rank, a.num_ranks)?;
        let judge = |comm: usize, r: crate::kernels::transport::GinGrant| -> Result<()> {
            let Some(p) = &gin_plan else { return Ok(()) };
            let text = |c: i32| nccl::library().map(|l| nccl::error_text(l, c)).unwrap_or_default();
            let g = gin::granted_on(p, &knobs, a.rank, comm, r, text)?;
            crate::log_info!(
                Some(a.rank),
                "{OP}: NCCL granted GIN on communicator {comm} of {} ({:?}, {} of {} contexts, {} signals)",
                p.num_comms,
                g.gin_type,
                g.info.gin_context_count,
                p.contexts_per_comm,
                g.info.gin_signal_count
            );
            Ok(())
        };
        // What every provider gets (the nccl one adds the GIN setup). Internode: the kernels get the
        // windows of their own NVLink domain only (nccl, ipc; nvshmem is one domain).
        let nvl_domain = if topo.num_rdma_ranks() >= 2 { topo.num_nvl_ranks() } else { a.num_ranks };
        let (rank, num_ranks) = (a.rank, a.num_ranks);
        let args = WindowArgs {
            unique_id: &unique_id,
            rank,
            num_ranks,
            nvl_domain,
            device,
            data_bytes,
            timeout_ns,
            transport_self_test,
            gin: None,
        };
        let window: Box<dyn crate::window::PeerWindow> = match kind {
            BackendKind::Nccl => {
                checked_library()?;
                let gin = gin_plan.as_ref().map(|p| GinSetup { reqs: p.requirements(), comms: p.num_comms, judge: &judge });
                Box::new(Window::create(&WindowArgs { gin, ..args })?)
            }
            #[cfg(feature = "nvshmem")]
            BackendKind::Nvshmem if gin_plan.is_some() => {
                return Err(ni(
                    kind,
                    OP,
                    "internode buffers over NCCL GIN (DEEP_EP_RDMA_TRANSPORT=gin) on NVSHMEM windows; use backend nccl",
                ));
            }
            #[cfg(feature = "nvshmem")]
            BackendKind::Nvshmem => Box::new(crate::window::nvshmem::Window::create(&args)?),
            #[cfg(feature = "ipc")]
            BackendKind::Ipc if gin_plan.is_some() => {
                return Err(ni(kind, OP, "internode buffers over NCCL GIN (DEEP_EP_RDMA_TRANSPORT=gin); ipc reaches other NVLink domains through the LSA emulation only"));
            }
            #[cfg(feature = "ipc")]
            BackendKind::Ipc => Box::new(crate::window::ipc::Window::create(&args)?),
            other => return Err(Error::invalid(OP, format!("internal: backend {} has no peer window", other.name()))),
        };
        let seam = match net_kind {
            Some(kind) => {
                let layout = ll_seam::SeamLayout::new(crate::kernels::intranode::CONTROL_BYTES, a.num_nvl_bytes, a.num_rdma_bytes);
                let name = if kind == ll_seam::NET_GIN {
                    let comms = window.gin_all();
                    crate::ensure!(!comms.is_empty(), OP, "internal: a GIN seam without a GIN device comm");
                    // SAFETY: launch contract: the ctx of this live window; the descriptor goes into its own control area.
                    unsafe { crate::kernels::transport::write_gin_desc(OP, window.ctx(), layout.desc_off, ll_seam::DESC_BYTES, &comms) }?;
                    "NCCL GIN"
                } else {
                    let (bases, ctx) = (window.lsa_bases(), window.ctx());
                    let (off, sig) = (layout.desc_off, layout.signal_off);
                    // SAFETY: launch contract: the ctx of this live window; the descriptor goes into its own control area.
                    unsafe {
                        crate::kernels::transport::write_lsa_desc(OP, ctx, &bases, off, sig, ll_seam::LSA_CONTEXTS, signals::LL_SIGNALS)
                    }?;
                    "LSA emulation"
                };
                crate::log_info!(
                    Some(a.rank),
                    "{OP}: low-latency kernels reach ranks {:?} (outside this NVLink domain of {}) through the transport seam ({name})",
                    ll_seam::remote_peers(&topo),
                    topo.num_nvl_ranks()
                );
                Some(ll_seam::Seam { layout, nvl_domain: topo.num_nvl_ranks(), kind })
            }
            None => None,
        };
        // Internode normal mode over GIN: the kernels' GinNet in the internode control area.
        if !a.low_latency_mode && topo.num_rdma_ranks() > 1 && gin::write_gin_net(OP, window.as_ref())? {
            crate::log_info!(
                Some(a.rank),
                "{OP}: normal-mode kernels reach ranks {:?} (outside this NVLink domain of {}) through the transport seam (NCCL GIN)",
                ll_seam::remote_peers(&topo),
                topo.num_nvl_ranks()
            );
        }
        if window.ctx().split() {
            split_setup(OP, window.as_ref(), &topo, gin_plan.as_ref())?;
        }
        let info = BufferInfo::from_args(a, kind);
        let mask = HostMask::new(OP)?;
        Ok(PeerBackend {
            info,
            window,
            timeout,
            ll: ll_state::LlState::default(),
            mask,
            mask_seen: std::cell::Cell::new(RankSet::default()),
            seam,
        })
    }

    /// A fresh unique id ([`UNIQUE_ID_BYTES`] bytes) of `kind`'s provider from one rank
    /// (`ncclGetUniqueId` or `nvshmemx_get_uniqueid`); host only, no GPU needed.
    pub fn unique_id(kind: BackendKind) -> Result<Vec<u8>> {
        match kind {
            BackendKind::Nccl => Ok(nccl::unique_id(checked_library()?)?.to_vec()),
            #[cfg(feature = "nvshmem")]
            BackendKind::Nvshmem => Ok(crate::window::nvshmem::unique_id()?.to_vec()),
            other => Err(Error::invalid(crate::op_names::GET_UNIQUE_ID, format!("internal: backend {} has no peer window", other.name()))),
        }
    }

    /// Device pointer of the LL kernels' copy of the rank mask (`int32_t[MASK_RANKS]`, 1 = masked,
    /// at `LL_MASK_OFF` of this rank's window, zero at creation), for the LL kernels' arguments.
    pub fn ll_mask_device_ptr(&self) -> *mut std::ffi::c_void {
        let base = self.window.ctx().own_base() as *mut u8;
        base.wrapping_add(crate::kernels::low_latency::LL_MASK_OFF).cast()
    }

    /// Rewrites the kernels' device copy of the mask from the host-mapped block (synchronous).
    fn ll_sync_mask(&self, op: &'static str) -> Result<()> {
        self.mask.copy_to_device(op, self.ll_mask_device_ptr(), self.info.num_ranks)
    }

    /// The masked ranks of the buffer.
    fn masked_ranks(&self) -> RankSet {
        self.mask.masked(self.info.num_ranks)
    }

    /// Logs the ranks a kernel masked in shrink mode since the last look (once each).
    fn report_shrink(&self, op: &'static str) {
        let (now, seen) = (self.masked_ranks(), self.mask_seen.get());
        let new = now.minus(&seen);
        if !new.is_empty() {
            let ranks = new.ranks();
            crate::log_warn!(
                Some(self.info.rank),
                "{op}: rank(s) {ranks:?} did not arrive within {} ms; shrink mode masked them",
                self.timeout_ms()
            );
        }
        self.mask_seen.set(now);
    }

    fn timeout_ms(&self) -> u64 {
        self.timeout.as_millis().min(u64::MAX as u128) as u64
    }
}

impl Backend for PeerBackend {
    fn info(&self) -> &BufferInfo {
        &self.info
    }
    fn destroy(&mut self) -> Result<()> {
        let timeout_ms = self.timeout_ms();
        self.window.close(timeout_ms)
    }
    fn wait_stats(&mut self, _reset: bool) -> Result<Vec<[i64; 2]>> {
        // Peer waits run in kernels (flag barriers); LL kernels report per-source wait time in
        // the dispatch/combine_wait_recv_cost_stats tensors instead.
        Err(ni(
            self.info.backend,
            crate::op_names::WAIT_STATS,
            "per-peer host wait statistics (waits run on the GPU; use the LL *_wait_recv_cost_stats tensors)",
        ))
    }

    /// The parts of this rank's window the ops use for data: the normal-mode data area (from the
    /// end of the control area; on an internode buffer from the end of the internode control
    /// area, see `internode.rs`) and the LL area (`ll_off`, see `low_latency.rs`). An internode
    /// normal-mode buffer's RDMA part is the `num_rdma_bytes` after the NVLink part of its one
    /// data area; an LL buffer over several domains ends its NVLink part where the LL area
    /// starts. Not kept beyond the buffer (no `keep_memory`: a view must not outlive it).
    fn local_region(&mut self, rdma: bool) -> Result<super::LocalRegion> {
        const OP: &str = crate::op_names::GET_LOCAL_BUFFER_TENSOR;
        use crate::config::BUFFER_ALIGNMENT;
        use crate::kernels::intranode::CONTROL_BYTES;
        let (nvl, rdma_bytes) = (self.info.num_nvl_bytes, self.info.num_rdma_bytes);
        let internode = self.info.num_ranks > self.info.nvl_domain_size;
        let ll_off = CONTROL_BYTES + nvl.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT;
        let in_data = crate::kernels::internode::CTRL_OFF + crate::kernels::internode::CTRL_BYTES;
        let (off, bytes) = match (rdma, internode, self.info.low_latency_mode) {
            (false, false, _) => (CONTROL_BYTES, nvl),
            (false, true, false) => (in_data, nvl),
            (false, true, true) => (in_data, (CONTROL_BYTES + nvl).saturating_sub(in_data)),
            (true, _, true) => (ll_off, rdma_bytes),
            (true, true, false) => (in_data + nvl, rdma_bytes),
            (true, false, false) if rdma_bytes == 0 => (CONTROL_BYTES, 0),
            (true, false, false) => {
                return Err(ni(
                    self.info.backend,
                    OP,
                    "the RDMA part of a normal-mode buffer within one NVLink domain (its window holds no num_rdma_bytes: \
                     create it with low_latency_mode=True, or num_rdma_bytes=0)",
                ))
            }
        };
        crate::ensure!(
            off + bytes <= self.window.bytes(),
            OP,
            "internal: the buffer's part [{off}, +{bytes}) lies outside its window of {} bytes",
            self.window.bytes()
        );
        let ptr = (self.window.ctx().own_base() as *mut u8).wrapping_add(off);
        Ok(super::LocalRegion { ptr, bytes, device: self.info.device })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_validates_before_loading_nccl() {
        let args = |id: &'static [u8], device| CreateArgs {
            unique_id: id,
            rank: 0,
            num_ranks: 2,
            device,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
        };
        for kind in [BackendKind::Nccl, BackendKind::Nvshmem, BackendKind::Ipc] {
            let e = PeerBackend::create(&args(&[0u8; 5], Device::Cuda(0)), kind).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("unique_id must have 128 bytes, got 5"), "{e}");
            let e = PeerBackend::create(&args(&[0u8; 128], Device::Cpu), kind).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(&format!("the {} backend needs a CUDA device", kind.name())), "{e}");
        }
    }
}
