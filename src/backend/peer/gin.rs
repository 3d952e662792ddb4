//! Host-side setup of the RDMA leg for internode buffers: which transport carries it (NCCL GIN on
//! a real cluster, the LSA emulation on one NVLink node), how many GIN contexts and communicators
//! (QPs per peer) and signals a buffer asks NCCL for, how `NCCL_GIN_TYPE` is honoured, and the
//! error raised when NCCL grants no GIN (no GPUDirect-RDMA NIC).
//!
//! Device side: `kernels/transport.cuh`. Pure logic here (no device, no NCCL call); the
//! `ncclDevCommCreate` call is `kernels::transport::gin_devcomm_create`, whose result [`granted`]
//! turns into a [`GinDevComm`] or a clear error.
//!
//! Environment (README "Environment"; docs/INTERNODE.md):
//! - `DEEP_EP_RDMA_TRANSPORT` = `gin` | `lsa` (emulation over NVLink; all ranks must share one
//!   NVLink domain, with `DEEP_EP_NVL_DOMAIN_SIZE` smaller than the group). Unset: the LSA
//!   emulation for internode buffers, normal and LL (`ll_seam::select`, `internode.rs`). `gin`:
//!   the buffer creates a GIN device comm ([`buffer_plan`], [`granted`]); LL and normal-mode
//!   kernels run over it (`ll_seam.rs`, `internode.rs`).
//! - `DEEP_EP_GIN_CONTEXTS` = GIN contexts per communicator, 1..=4 (default: as many as the
//!   buffer has independent senders, at most 4).
//! - `DEEP_EP_GIN_COMMS` = communicators per buffer, 1..=8 (default 1); QPs per peer =
//!   contexts x communicators (DeepEP's `num_qps_per_rank`). The buffer's own communicator is the
//!   first; the others are split from it (same ranks, same order), each with its own GIN device
//!   comm (the same [`GinPlan::requirements`], granted and checked per communicator) and its own
//!   registration of the buffer's memory (`window::gin_comms`). A sender's routing unit picks the
//!   (communicator, context) pair ([`route`]): contexts = the fewest any communicator was granted.
//! - `NCCL_GIN_TYPE` is read by NCCL itself; deep_ep validates it (2 = proxy, 3 = GDAKI, NCCL's
//!   `ncclNetDeviceType`) and checks that the granted type matches.

use super::signals::{ht_base, BARRIER_SIGNALS};
use crate::error::{Error, Result};
use crate::kernels::transport::{GinInfo, GinReqs, MAX_GIN_CONTEXTS};

const OP: &str = crate::op_names::CREATE_BUFFER;

/// Most communicators one buffer opens for more QPs (`DEK_TP_MAX_GIN_COMMS`, the capacity of
/// the device descriptor `GinNet`).
pub const MAX_GIN_COMMS: usize = 8;

/// The (communicator, context) that routing unit `unit` (a sender: rank, channel or local expert)
/// uses among `comms` communicators of `contexts` contexts each: `g = unit % (comms * contexts)`,
/// communicator `g / contexts`, context `g % contexts`. The device computes the same
/// (`gin_route` in `kernels/transport.cuh`, with `contexts` = the fewest contexts any of the
/// buffer's communicators was granted), so a receiver that routes the sender's unit reads the
/// signal table the sender raised. Pure; `comms` and `contexts` >= 1.
pub fn route(unit: usize, comms: usize, contexts: usize) -> (usize, usize) {
    let g = unit % (comms * contexts);
    (g / contexts, g % contexts)
}

/// What carries the RDMA leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaTransport {
    /// NCCL GIN puts and signals over the NIC.
    Gin,
    /// The same puts and signals as NVLink stores (one node emulating several).
    Lsa,
}

/// NCCL's GIN implementation (`ncclNetDeviceType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GinType {
    /// A CPU proxy thread posts the RDMA work requests (`NCCL_NET_DEVICE_GIN_PROXY` = 2).
    Proxy,
    /// The GPU rings the NIC's doorbell itself (DOCA GPUNetIO, `NCCL_NET_DEVICE_GIN_GDAKI` = 3).
    Gdaki,
}

impl GinType {
    /// From the `ncclNetDeviceType` value NCCL reports.
    pub fn from_code(code: i32) -> Option<GinType> {
        match code {
            2 => Some(GinType::Proxy),
            3 => Some(GinType::Gdaki),
            _ => None,
        }
    }

    /// The `ncclNetDeviceType` value.
    pub fn code(self) -> i32 {
        match self {
            GinType::Proxy => 2,
            GinType::Gdaki => 3,
        }
    }
}

/// The environment knobs of the RDMA leg, parsed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GinKnobs {
    /// `DEEP_EP_RDMA_TRANSPORT` (None = default, GIN).
    pub transport: Option<RdmaTransport>,
    /// `DEEP_EP_GIN_CONTEXTS`.
    pub contexts: Option<usize>,
    /// `DEEP_EP_GIN_COMMS`.
    pub comms: Option<usize>,
    /// `NCCL_GIN_TYPE`.
    pub gin_type: Option<GinType>,
}

fn parse_count(name: &str, v: &str, max: usize) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(Error::invalid(OP, format!("{name} must be an integer in 1..={max}, got {v:?}"))),
    }
}

impl GinKnobs {
    /// Parses the knobs through `get` (the environment in production, a map in tests); blank
    /// values count as unset.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<GinKnobs> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let transport = match get("DEEP_EP_RDMA_TRANSPORT").map(|v| v.trim().to_ascii_lowercase()) {
            None => None,
            Some(v) if v == "gin" => Some(RdmaTransport::Gin),
            Some(v) if v == "lsa" => Some(RdmaTransport::Lsa),
            Some(v) => return Err(Error::invalid(OP, format!("DEEP_EP_RDMA_TRANSPORT must be gin or lsa, got {v:?}"))),
        };
        let contexts = get("DEEP_EP_GIN_CONTEXTS").map(|v| parse_count("DEEP_EP_GIN_CONTEXTS", &v, MAX_GIN_CONTEXTS)).transpose()?;
        let comms = get("DEEP_EP_GIN_COMMS").map(|v| parse_count("DEEP_EP_GIN_COMMS", &v, MAX_GIN_COMMS)).transpose()?;
        let gin_type = match get("NCCL_GIN_TYPE") {
            None => None,
            Some(v) => match v.trim().parse::<i32>().ok().and_then(GinType::from_code) {
                Some(t) => Some(t),
                None => {
                    return Err(Error::invalid(
                        OP,
                        format!("NCCL_GIN_TYPE must be 2 (proxy) or 3 (GDAKI), got {v:?}; unset it to let NCCL choose"),
                    ))
                }
            },
        };
        Ok(GinKnobs { transport, contexts, comms, gin_type })
    }

    /// The knobs of this process's environment.
    pub fn from_env() -> Result<GinKnobs> {
        GinKnobs::parse(|k| std::env::var(k).ok())
    }
}

/// What a buffer moves over the RDMA leg, which fixes its signal table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Normal (HT) mode over `num_rdma_ranks` nodes: the kernels of `kernels/internode_*.cu` put
    /// everything on context 0 and count with two signals per source node ([`super::signals::ht`]).
    Normal { num_rdma_ranks: usize },
    /// Low-latency mode: a count signal per (local expert, source rank), for dispatch and combine,
    /// in each of the two buffer halves.
    LowLatency { num_local_experts: usize, num_ranks: usize },
}

/// Resources one buffer asks NCCL for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GinPlan {
    pub workload: Workload,
    /// Communicators (each with its own QPs).
    pub num_comms: usize,
    /// Contexts asked for per communicator (a hint: NCCL may grant fewer).
    pub contexts_per_comm: usize,
    /// Signals per context. Signal ids do not depend on the granted context count, so a grant
    /// of fewer contexts (more senders per context) never makes two senders share a signal.
    pub signals: usize,
}

impl GinPlan {
    /// QPs per peer (DeepEP's `num_qps_per_rank`).
    pub fn qps_per_peer(&self) -> usize {
        self.num_comms * self.contexts_per_comm
    }

    /// Requirements for `ncclDevCommCreate` of each communicator (`gin_force_enable` so that a
    /// missing NIC is an error instead of a device comm without GIN).
    pub fn requirements(&self) -> GinReqs {
        GinReqs {
            gin_context_count: self.contexts_per_comm as i32,
            gin_signal_count: self.signals as i32,
            gin_counter_count: 0,
            lsa_barrier_count: 1,
            gin_force_enable: 1,
        }
    }

    /// (communicator, context) that sender `unit` (an LL local expert or rank; normal mode has one
    /// sender) uses when every communicator is granted the contexts asked ([`route`]).
    pub fn route(&self, unit: usize) -> (usize, usize) {
        route(unit, self.num_comms, self.contexts_per_comm)
    }

    /// The same with the contexts NCCL granted on each communicator (`granted[i]` for communicator
    /// `i`): the device uses the fewest (at most the asked count), as `GinNet::at` does.
    pub fn granted_route(&self, unit: usize, granted: &[usize]) -> (usize, usize) {
        let contexts = granted.iter().copied().min().unwrap_or(1).clamp(1, self.contexts_per_comm);
        route(unit, self.num_comms, contexts)
    }

    /// Signal id of a low-latency count: `combine` phase or dispatch, buffer half, local expert,
    /// source rank.
    pub fn ll_signal(&self, combine: bool, half: usize, local_expert: usize, src_rank: usize) -> usize {
        let Workload::LowLatency { num_local_experts, num_ranks } = self.workload else { unreachable!("ll_signal on an HT plan") };
        super::signals::ll(combine, half, local_expert, src_rank, num_local_experts, num_ranks)
    }
}

/// Sizes the GIN resources of a buffer: contexts = independent senders (local experts for LL; one
/// for normal mode, whose kernels put everything on context 0) capped at 4 unless
/// `DEEP_EP_GIN_CONTEXTS` says otherwise, `DEEP_EP_GIN_COMMS` communicators, the
/// `SEAM_SIGNALS` (64) of the normal-mode kernels or one signal per count (LL).
pub fn plan(w: Workload, k: &GinKnobs) -> Result<GinPlan> {
    let (units, signals) = match w {
        Workload::Normal { num_rdma_ranks } => {
            let max = crate::kernels::internode::MAX_NODES;
            crate::ensure!((2..=max).contains(&num_rdma_ranks), OP, "internal: GIN plan for {num_rdma_ranks} nodes (2..={max})");
            (1, crate::kernels::internode::SEAM_SIGNALS)
        }
        Workload::LowLatency { num_local_experts, num_ranks } => {
            crate::ensure!(
                num_local_experts >= 1 && num_ranks >= 2,
                OP,
                "internal: GIN plan for {num_local_experts} local experts, {num_ranks} ranks"
            );
            (num_local_experts, 4 * num_local_experts * num_ranks)
        }
    };
    // NCCL counts signals in an int.
    crate::ensure!(signals <= i32::MAX as usize, OP, "the buffer would need {signals} GIN signals per context");
    let contexts_per_comm = k.contexts.unwrap_or_else(|| units.min(MAX_GIN_CONTEXTS));
    Ok(GinPlan { workload: w, num_comms: k.comms.unwrap_or(1), contexts_per_comm, signals })
}

/// The GIN plan of a buffer at creation, or None when it needs no GIN device comm: only buffers
/// whose ranks span several NVLink domains (`num_rdma_ranks` >= 2) with
/// `DEEP_EP_RDMA_TRANSPORT=gin`. The per-call geometry is unknown at creation, so the plan covers
/// every call the buffer accepts: LL buffers get one signal per seam id
/// (`signals::LL_SIGNALS` = 4 x the most experts), then the normal-mode kernels' signals (an LL
/// buffer may run normal-mode ops; [`super::signals::ht_base`]), and a context per sending rank (the LL
/// kernels put on the context of the sender's rank); normal-mode buffers the signals of
/// [`Workload::Normal`] on one context. `DEEP_EP_GIN_COMMS` communicators, each asking for the same
/// requirements.
pub fn buffer_plan(k: &GinKnobs, num_ranks: usize, num_rdma_ranks: usize, low_latency_mode: bool) -> Result<Option<GinPlan>> {
    if k.transport != Some(RdmaTransport::Gin) || num_rdma_ranks < 2 {
        return Ok(None);
    }
    let mut p = if low_latency_mode {
        let signals = ht_base(true) + crate::kernels::internode::SEAM_SIGNALS;
        let contexts_per_comm = k.contexts.unwrap_or_else(|| num_ranks.min(MAX_GIN_CONTEXTS));
        GinPlan {
            workload: Workload::LowLatency { num_local_experts: (super::signals::LL_MAX_EXPERTS / num_ranks).max(1), num_ranks },
            num_comms: k.comms.unwrap_or(1),
            contexts_per_comm,
            signals,
        }
    } else {
        plan(Workload::Normal { num_rdma_ranks }, k)?
    };
    // The global barrier's signals after every id of the workload (barrier_signal_base).
    p.signals += BARRIER_SIGNALS;
    Ok(Some(p))
}

/// A device comm with GIN, as granted.
#[derive(Clone, Debug)]
pub struct GinDevComm {
    /// Byte copy of `ncclDevComm` (passed to kernels by value).
    pub devcomm: Vec<u64>,
    pub info: GinInfo,
    /// What NCCL granted, checked against the plan.
    pub gin_type: GinType,
}

/// Turns the result of `ncclDevCommCreate` with [`GinPlan::requirements`] on `rank`'s first
/// communicator into a usable device comm, or the error that tells the user what is missing
/// (naming the rank). `nccl_text` renders an NCCL result code (`ncclGetErrorString` in production).
pub fn granted(
    plan: &GinPlan,
    k: &GinKnobs,
    rank: usize,
    result: std::result::Result<(Vec<u64>, GinInfo), i32>,
    nccl_text: impl Fn(i32) -> String,
) -> Result<GinDevComm> {
    granted_on(plan, k, rank, 0, result, nccl_text)
}

/// [`granted`] for communicator `comm` (0 = the buffer's own, 1.. = those split from it): each
/// communicator's grant is checked on its own (GIN, its type, its signals); an error names the
/// rank, and the communicator when the plan has several.
pub fn granted_on(
    plan: &GinPlan,
    k: &GinKnobs,
    rank: usize,
    comm: usize,
    result: std::result::Result<(Vec<u64>, GinInfo), i32>,
    nccl_text: impl Fn(i32) -> String,
) -> Result<GinDevComm> {
    let on = if plan.num_comms > 1 { format!(" (communicator {comm} of {})", plan.num_comms) } else { String::new() };
    let (devcomm, info) = match result {
        Ok(r) => r,
        Err(code) => {
            return Err(unavailable_on(plan, k, rank, &on, &format!("ncclDevCommCreate failed: ncclResult_t {code} {}", nccl_text(code))))
        }
    };
    if info.gin_context_count < 1 {
        return Err(unavailable_on(
            plan,
            k,
            rank,
            &on,
            &format!("ncclDevCommCreate granted 0 GIN contexts ({} asked)", plan.contexts_per_comm),
        ));
    }
    let Some(gin_type) = GinType::from_code(info.gin_type) else {
        return Err(unavailable_on(plan, k, rank, &on, &format!("NCCL reported an unknown GIN type {}", info.gin_type)));
    };
    let what = format!("GIN setup on rank {rank}{on}");
    if let Some(want) = k.gin_type.filter(|&t| t != gin_type) {
        return Err(Error::Device {
            op: OP,
            what,
            detail: format!("NCCL_GIN_TYPE={} ({want:?}) was set but NCCL granted {gin_type:?} ({}); check that the NIC and driver support it (NCCL_DEBUG=INFO)", want.code(), gin_type.code()),
        });
    }
    if (info.gin_signal_count as usize) < plan.signals {
        return Err(Error::Device {
            op: OP,
            what,
            detail: format!(
                "NCCL granted {} GIN signals, the buffer needs {}; raise NCCL_GIN_SIGNAL_POOL_SIZE",
                info.gin_signal_count, plan.signals
            ),
        });
    }
    Ok(GinDevComm { devcomm, info, gin_type })
}

/// The error for "no GIN here" on `rank`, with what to check and the emulation alternative.
pub fn unavailable(plan: &GinPlan, k: &GinKnobs, rank: usize, why: &str) -> Error {
    unavailable_on(plan, k, rank, "", why)
}

/// [`unavailable`] with `on` after the rank (which communicator, or empty).
fn unavailable_on(plan: &GinPlan, k: &GinKnobs, rank: usize, on: &str, why: &str) -> Error {
    let asked = match k.gin_type {
        Some(t) => format!(" (NCCL_GIN_TYPE={} asked for {t:?})", t.code()),
        None => String::new(),
    };
    Error::Device {
        op: OP,
        what: format!("GIN setup on rank {rank}{on}"),
        detail: format!(
            "NCCL GPU-initiated networking is unavailable{asked}: {why}. Internode buffers need a GPUDirect-RDMA capable NIC \
             (InfiniBand or RoCE with nvidia-peermem or DMA-BUF, rdma-core >= 44) and NCCL >= 2.28.7; NCCL_DEBUG=INFO \
             NCCL_DEBUG_SUBSYS=INIT,NET shows why NCCL disabled GIN. The buffer asked for {} QPs per peer ({} communicator(s) x {} \
             contexts) and {} signals. To emulate several nodes on one NVLink machine set DEEP_EP_RDMA_TRANSPORT=lsa and \
             DEEP_EP_NVL_DOMAIN_SIZE",
            plan.qps_per_peer(),
            plan.num_comms,
            plan.contexts_per_comm,
            plan.signals
        ),
    }
}

/// `DEEP_EP_TRANSPORT_SELFTEST`: `1` = every NCCL buffer runs one round of the transport self-test
/// over the LSA emulation while it is created, between the ranks of each emulated node's rail
/// (`DEEP_EP_NVL_DOMAIN_SIZE`), or between all ranks when they form one domain; `N >= 2` = the
/// same with emulated nodes of N ranks for the self-test only (the buffer itself stays intranode:
/// an internode buffer needs internode kernels, which the NCCL backend does not have yet).
/// Returns the rail stride to test with, or None when the knob is off. Pure: the values come
/// from the caller.
pub fn self_test_stride(enabled: Option<&str>, nvl_domain: Option<&str>, rank: usize, num_ranks: usize) -> Result<Option<usize>> {
    let d = match enabled.map(str::trim) {
        None | Some("") | Some("0") => return Ok(None),
        Some("1") => crate::topology::parse_nvl_domain_size(OP, nvl_domain)?,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n >= 2 => n,
            _ => return Err(Error::invalid(OP, format!("DEEP_EP_TRANSPORT_SELFTEST must be 0, 1 or a node size >= 2, got {v:?}"))),
        },
    };
    let t = crate::topology::Topology::new(OP, rank, num_ranks, d)?;
    Ok(Some(if t.num_rdma_ranks() > 1 { t.num_nvl_ranks() } else { 1 }))
}

/// [`self_test_stride`] from the environment.
pub fn self_test_stride_from_env(rank: usize, num_ranks: usize) -> Result<Option<usize>> {
    let var = |k: &str| std::env::var(k).ok();
    self_test_stride(var("DEEP_EP_TRANSPORT_SELFTEST").as_deref(), var(crate::topology::NVL_DOMAIN_ENV).as_deref(), rank, num_ranks)
}

/// At the creation of a normal-mode buffer whose ranks span several NVLink domains: when its
/// window holds a GIN device comm, writes the `GinNet` of the normal-mode kernels (the device comm
/// by value and the window's `ncclWindow_t`, `kernels::transport::write_gin_desc` as for LL buffers)
/// into the free end of its internode control area (`NET_OFF`). Local, synchronous; returns
/// whether it wrote one.
pub(super) fn write_gin_net(op: &'static str, window: &dyn crate::window::PeerWindow) -> Result<bool> {
    let comms = window.gin_all();
    if comms.is_empty() {
        return Ok(false);
    }
    // SAFETY: launch contract: the ctx of this live window; the descriptor goes into its own control area.
    unsafe {
        crate::kernels::transport::write_gin_desc(
            op,
            window.ctx(),
            crate::kernels::internode::NET_OFF,
            crate::kernels::internode::NET_BYTES,
            &comms,
        )
    }?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::peer::signals::{barrier_base, ht, HtSignal};
    use std::collections::{HashMap, HashSet};

    fn knobs(pairs: &[(&str, &str)]) -> Result<GinKnobs> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        GinKnobs::parse(|k| m.get(k).cloned())
    }

    #[test]
    fn knobs_parse_and_reject_with_the_variable_named() {
        assert_eq!(knobs(&[]).unwrap(), GinKnobs::default());
        let k =
            knobs(&[("DEEP_EP_RDMA_TRANSPORT", "LSA"), ("DEEP_EP_GIN_CONTEXTS", "2"), ("DEEP_EP_GIN_COMMS", "3"), ("NCCL_GIN_TYPE", "3")])
                .unwrap();
        assert_eq!(k, GinKnobs { transport: Some(RdmaTransport::Lsa), contexts: Some(2), comms: Some(3), gin_type: Some(GinType::Gdaki) });
        assert_eq!(knobs(&[("NCCL_GIN_TYPE", " ")]).unwrap().gin_type, None);
        let err = |p: &[(&str, &str)]| knobs(p).unwrap_err().to_string();
        assert!(err(&[("DEEP_EP_RDMA_TRANSPORT", "ib")]).contains("DEEP_EP_RDMA_TRANSPORT must be gin or lsa, got \"ib\""));
        assert!(err(&[("DEEP_EP_GIN_CONTEXTS", "5")]).contains("DEEP_EP_GIN_CONTEXTS must be an integer in 1..=4, got \"5\""));
        assert!(err(&[("DEEP_EP_GIN_COMMS", "0")]).contains("DEEP_EP_GIN_COMMS must be an integer in 1..=8"));
        assert!(err(&[("NCCL_GIN_TYPE", "gdaki")]).contains("NCCL_GIN_TYPE must be 2 (proxy) or 3 (GDAKI), got \"gdaki\""));
    }

    #[test]
    fn normal_plan_covers_the_kernels_signal_ids_on_one_context() {
        use crate::kernels::internode::{MAX_NODES, SEAM_SIGNALS};
        // The kernels (internode.cuh) put and signal on context 0 only: one context, 64 signals.
        let p = plan(Workload::Normal { num_rdma_ranks: 4 }, &GinKnobs::default()).unwrap();
        assert_eq!((p.num_comms, p.contexts_per_comm, p.qps_per_peer(), p.signals), (1, 1, 1, 64));
        let r = p.requirements();
        assert_eq!((r.gin_context_count, r.gin_signal_count, r.gin_force_enable, r.lsa_barrier_count), (1, 64, 1, 1));
        // The ids of internode.cuh: kSigBar (0) + source node, kSigStep (32) + source node, for
        // every node count up to DEK_IN_MAX_NODES (32), all distinct and inside the plan.
        let mut ids = HashSet::new();
        for node in 0..MAX_NODES {
            assert_eq!(ht(0, HtSignal::Barrier, node), node);
            assert_eq!(ht(0, HtSignal::Step, node), 32 + node);
            for kind in [HtSignal::Barrier, HtSignal::Step] {
                let s = ht(0, kind, node);
                assert!(s < p.signals && ids.insert(s), "{kind:?} node {node} -> {s}");
            }
        }
        assert_eq!(ids.len(), SEAM_SIGNALS);
        // The same for every node count the kernels take; a context count can still be asked for.
        for rr in 2..=MAX_NODES {
            assert_eq!(plan(Workload::Normal { num_rdma_ranks: rr }, &GinKnobs::default()).unwrap().signals, SEAM_SIGNALS);
        }
        assert_eq!(
            plan(Workload::Normal { num_rdma_ranks: 2 }, &knobs(&[("DEEP_EP_GIN_CONTEXTS", "2")]).unwrap()).unwrap().contexts_per_comm,
            2
        );
        assert!(plan(Workload::Normal { num_rdma_ranks: MAX_NODES + 1 }, &GinKnobs::default()).is_err());
    }

    #[test]
    fn ll_plan_follows_the_local_experts_and_comms_multiply_qps() {
        // EP32, 256 experts: 8 local experts, two communicators for 8 QPs per peer.
        let k = knobs(&[("DEEP_EP_GIN_COMMS", "2")]).unwrap();
        let p = plan(Workload::LowLatency { num_local_experts: 8, num_ranks: 32 }, &k).unwrap();
        assert_eq!((p.num_comms, p.contexts_per_comm, p.qps_per_peer(), p.signals), (2, 4, 8, 4 * 8 * 32));
        assert_eq!(
            (0..9).map(|e| p.route(e)).collect::<Vec<_>>(),
            vec![(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (0, 0)]
        );
        let mut ids = HashSet::new();
        for combine in [false, true] {
            for half in 0..2 {
                for e in 0..8 {
                    for s in 0..32 {
                        assert!(ids.insert(p.ll_signal(combine, half, e, s)));
                    }
                }
            }
        }
        assert_eq!(ids.len(), p.signals);
        assert!(ids.iter().all(|&s| s < p.signals));
        // One local expert (EP256 with 256 experts): one context unless asked.
        let p = plan(Workload::LowLatency { num_local_experts: 1, num_ranks: 256 }, &GinKnobs::default()).unwrap();
        assert_eq!((p.contexts_per_comm, p.signals), (1, 1024));
        let p =
            plan(Workload::LowLatency { num_local_experts: 1, num_ranks: 256 }, &knobs(&[("DEEP_EP_GIN_CONTEXTS", "4")]).unwrap()).unwrap();
        assert_eq!(p.qps_per_peer(), 4);
        assert!(plan(Workload::Normal { num_rdma_ranks: 1 }, &GinKnobs::default()).is_err());
    }

    #[test]
    fn buffer_plan_covers_every_call_of_an_internode_gin_buffer() {
        let gin = knobs(&[("DEEP_EP_RDMA_TRANSPORT", "gin")]).unwrap();
        // No GIN: another transport, or one NVLink domain.
        assert_eq!(buffer_plan(&GinKnobs::default(), 4, 2, true).unwrap(), None);
        assert_eq!(buffer_plan(&knobs(&[("DEEP_EP_RDMA_TRANSPORT", "lsa")]).unwrap(), 4, 2, true).unwrap(), None);
        assert_eq!(buffer_plan(&gin, 4, 1, true).unwrap(), None);
        // LL: every seam signal id, then the normal-mode kernels' ids; a context per sending rank
        // (at most 4).
        use crate::backend::peer::signals::LL_SIGNALS as SIGNALS; // the LL ids come first
        use crate::kernels::internode::{MAX_NODES, SEAM_SIGNALS};
        let p = buffer_plan(&gin, 4, 2, true).unwrap().unwrap();
        assert_eq!((p.num_comms, p.contexts_per_comm, p.signals), (1, 4, SIGNALS + SEAM_SIGNALS + BARRIER_SIGNALS));
        let r = p.requirements();
        assert_eq!((r.gin_context_count, r.gin_signal_count, r.gin_force_enable), (4, 8192 + 64 + 32, 1));
        // Normal-mode ops of an LL buffer: past every LL id (which the LL kernels reset), inside the plan.
        for node in 0..MAX_NODES {
            for kind in [HtSignal::Barrier, HtSignal::Step] {
                let s = ht(ht_base(true), kind, node);
                assert!((SIGNALS..p.signals).contains(&s), "{kind:?} node {node} -> {s}");
            }
        }
        assert_eq!(crate::backend::peer::signals::ll(true, 1, 511, 3, 512, 4), SIGNALS - 1);
        let p = buffer_plan(&gin, 2, 2, true).unwrap().unwrap();
        assert_eq!(p.contexts_per_comm, 2);
        let k = knobs(&[("DEEP_EP_RDMA_TRANSPORT", "gin"), ("DEEP_EP_GIN_CONTEXTS", "1")]).unwrap();
        assert_eq!(buffer_plan(&k, 8, 4, true).unwrap().unwrap().contexts_per_comm, 1);
        // Normal mode: the kernels' signals from 0, on one context.
        let p = buffer_plan(&gin, 4, 2, false).unwrap().unwrap();
        assert_eq!((p.contexts_per_comm, p.signals, ht_base(false)), (1, SEAM_SIGNALS + BARRIER_SIGNALS, 0));
        assert!(ht(0, HtSignal::Step, MAX_NODES - 1) < p.signals);
        assert_eq!(buffer_plan(&gin, 16, 8, false).unwrap().unwrap().signals, SEAM_SIGNALS + BARRIER_SIGNALS);
        // Several communicators, LL and normal mode: the same requirements on each, QPs multiply.
        let k = knobs(&[("DEEP_EP_RDMA_TRANSPORT", "gin"), ("DEEP_EP_GIN_COMMS", "3")]).unwrap();
        let p = buffer_plan(&k, 4, 2, true).unwrap().unwrap();
        assert_eq!((p.num_comms, p.contexts_per_comm, p.qps_per_peer(), p.signals), (3, 4, 12, SIGNALS + SEAM_SIGNALS + BARRIER_SIGNALS));
        assert_eq!(p.requirements(), buffer_plan(&gin, 4, 2, true).unwrap().unwrap().requirements());
        let p = buffer_plan(&k, 4, 2, false).unwrap().unwrap();
        assert_eq!((p.num_comms, p.qps_per_peer()), (3, 3));
        assert_eq!(
            buffer_plan(&knobs(&[("DEEP_EP_RDMA_TRANSPORT", "gin"), ("DEEP_EP_GIN_COMMS", "1")]).unwrap(), 4, 2, true)
                .unwrap()
                .unwrap()
                .num_comms,
            1
        );
        // Without GIN the knob changes nothing.
        assert_eq!(buffer_plan(&knobs(&[("DEEP_EP_GIN_COMMS", "8")]).unwrap(), 4, 2, true).unwrap(), None);
    }

    #[test]
    fn the_barrier_signals_follow_every_op_signal_of_the_plan() {
        let gin = knobs(&[("DEEP_EP_RDMA_TRANSPORT", "gin")]).unwrap();
        use crate::kernels::internode::{MAX_NODES, SEAM_SIGNALS};
        // LL: above every seam id (signals::ll < LL_SIGNALS) and the normal-mode ids after
        // them, inside the table NCCL grants.
        let p = buffer_plan(&gin, 4, 2, true).unwrap().unwrap();
        let base = barrier_base(p.signals);
        assert_eq!(base, crate::backend::peer::signals::LL_SIGNALS + SEAM_SIGNALS);
        assert_eq!(ht(ht_base(true), HtSignal::Step, MAX_NODES - 1) + 1, base);
        assert_eq!(base + BARRIER_SIGNALS, p.requirements().gin_signal_count as usize);
        // A domain id per source node: the most nodes of a buffer (8 ranks of 1 GPU) fit.
        const { assert!(BARRIER_SIGNALS >= crate::kernels::intranode::MAX_RANKS) };
        // Normal mode: above every id of the kernels.
        for rr in [2, 4, 8] {
            let p = buffer_plan(&gin, 8, rr, false).unwrap().unwrap();
            assert_eq!(barrier_base(p.signals), SEAM_SIGNALS);
            assert!(ht(0, HtSignal::Step, rr - 1) < barrier_base(p.signals));
        }
    }

    #[test]
    fn routes_fill_a_communicator_then_the_next_with_the_contexts_granted() {
        let k = knobs(&[("DEEP_EP_GIN_COMMS", "2")]).unwrap();
        let p = plan(Workload::LowLatency { num_local_experts: 8, num_ranks: 32 }, &k).unwrap();
        assert_eq!((0..5).map(|u| route(u, 2, 4)).collect::<Vec<_>>(), (0..5).map(|u| p.route(u)).collect::<Vec<_>>());
        // All granted as asked: the plan's route.
        assert!((0..20).all(|u| p.granted_route(u, &[4, 4]) == p.route(u)));
        // One communicator granted 2 of 4: both use 2, QPs per peer 4.
        assert_eq!((0..5).map(|u| p.granted_route(u, &[4, 2])).collect::<Vec<_>>(), vec![(0, 0), (0, 1), (1, 0), (1, 1), (0, 0)]);
        // Never more than asked, never fewer than one.
        assert_eq!(p.granted_route(5, &[8, 8]), p.route(5));
        assert_eq!(p.granted_route(3, &[0, 0]), (1, 0));
        // A receiver routes the sender's rank: every rank pair agrees on one (comm, context).
        assert_eq!(route(37, 2, 4), route(37 % 8, 2, 4));
    }

    fn info(contexts: i32, ty: i32, signals: i32) -> GinInfo {
        GinInfo {
            rank: 0,
            num_ranks: 16,
            lsa_rank: 0,
            lsa_size: 8,
            gin_context_count: contexts,
            gin_type: ty,
            gin_signal_count: signals,
            gin_counter_count: 0,
        }
    }

    #[test]
    fn grants_are_checked_against_the_plan_and_the_gin_type() {
        // 5 local experts x 2 ranks: 4 contexts, 40 signals.
        let p = plan(Workload::LowLatency { num_local_experts: 5, num_ranks: 2 }, &GinKnobs::default()).unwrap();
        let text = |_| "internal error".to_string();
        let g = granted(&p, &GinKnobs::default(), 0, Ok((vec![0; 4], info(2, 3, 40))), text).unwrap();
        assert_eq!((g.gin_type, g.info.gin_context_count), (GinType::Gdaki, 2));

        let e = granted(&p, &GinKnobs::default(), 0, Ok((vec![], info(0, 0, 0))), text).unwrap_err().to_string();
        assert!(e.starts_with("deep_ep::create_buffer: GIN setup on rank 0 failed: NCCL GPU-initiated networking is unavailable: ncclDevCommCreate granted 0 GIN contexts (4 asked)"), "{e}");
        assert!(
            e.contains("GPUDirect-RDMA capable NIC") && e.contains("DEEP_EP_RDMA_TRANSPORT=lsa") && e.contains("4 QPs per peer"),
            "{e}"
        );

        let k = knobs(&[("NCCL_GIN_TYPE", "3")]).unwrap();
        let e = granted(&p, &k, 0, Err(5), |c| format!("(code {c}: invalid usage)")).unwrap_err().to_string();
        assert!(
            e.contains("unavailable (NCCL_GIN_TYPE=3 asked for Gdaki): ncclDevCommCreate failed: ncclResult_t 5 (code 5: invalid usage)"),
            "{e}"
        );
        let e = granted(&p, &k, 0, Ok((vec![], info(4, 2, 40))), text).unwrap_err().to_string();
        assert!(e.contains("NCCL_GIN_TYPE=3 (Gdaki) was set but NCCL granted Proxy (2)"), "{e}");
        let e = granted(&p, &GinKnobs::default(), 0, Ok((vec![], info(4, 2, 39))), text).unwrap_err().to_string();
        assert!(e.contains("granted 39 GIN signals, the buffer needs 40; raise NCCL_GIN_SIGNAL_POOL_SIZE"), "{e}");
        // Per communicator: each grant is checked, errors name the rank and the communicator.
        let k2 = knobs(&[("DEEP_EP_GIN_COMMS", "2")]).unwrap();
        let p2 = plan(Workload::LowLatency { num_local_experts: 8, num_ranks: 32 }, &k2).unwrap();
        assert!(granted_on(&p2, &k2, 3, 1, Ok((vec![0; 4], info(4, 3, 1024))), text).is_ok());
        let e = granted_on(&p2, &k2, 3, 1, Ok((vec![], info(4, 3, 1023))), text).unwrap_err().to_string();
        assert!(e.contains("GIN setup on rank 3 (communicator 1 of 2) failed: NCCL granted 1023 GIN signals"), "{e}");
        let e = granted_on(&p2, &k2, 3, 0, Err(2), text).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "deep_ep::create_buffer: GIN setup on rank 3 (communicator 0 of 2) failed: NCCL GPU-initiated networking is unavailable"
            ),
            "{e}"
        );
        assert!(e.contains("8 QPs per peer (2 communicator(s) x 4 contexts)"), "{e}");
    }

    #[test]
    fn self_test_knob_picks_the_rails_of_the_emulated_nodes() {
        assert_eq!(self_test_stride(None, Some("2"), 0, 4).unwrap(), None);
        assert_eq!(self_test_stride(Some("0"), None, 0, 4).unwrap(), None);
        // 2 nodes x 2 GPUs: rails {0, 2} and {1, 3}.
        assert_eq!(self_test_stride(Some("1"), Some("2"), 3, 4).unwrap(), Some(2));
        // One domain: everyone pings everyone.
        assert_eq!(self_test_stride(Some("1"), None, 0, 4).unwrap(), Some(1));
        assert!(self_test_stride(Some("yes"), None, 0, 4)
            .unwrap_err()
            .to_string()
            .contains("DEEP_EP_TRANSPORT_SELFTEST must be 0, 1 or a node size >= 2"));
        // A node size for the self-test alone: 2 x 2 rails; 4 = one node.
        assert_eq!(self_test_stride(Some("2"), None, 1, 4).unwrap(), Some(2));
        assert_eq!(self_test_stride(Some("4"), Some("2"), 1, 4).unwrap(), Some(1));
        assert!(self_test_stride(Some("3"), None, 0, 4).unwrap_err().to_string().contains("4 ranks do not fill NVLink domains of 3"));
        assert!(self_test_stride(Some("1"), Some("3"), 0, 4).unwrap_err().to_string().contains("4 ranks do not fill NVLink domains of 3"));
    }
}
