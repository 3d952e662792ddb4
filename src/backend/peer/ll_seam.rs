//! Internode low-latency mode of the nccl backend (docs/INTERNODE.md, "Internode LL"): when a
//! buffer's ranks span several NVLink domains (`DEEP_EP_NVL_DOMAIN_SIZE`), the LL kernels reach
//! peers outside the caller's domain through the transport seam (`kernels/transport.cuh`) and keep
//! NVLink stores inside it. Same wire format and results as intranode (and as the CPU backend).
//!
//! This module is the host-side logic of that path, pure (no device, no collective): which peers
//! are remote, which transport a buffer uses, where the seam's state lives in the window, where a
//! dispatch stages what it puts (GIN sends only from registered memory, so a remote message is
//! assembled in the sender's own window first) and the seam signal ids (those of
//! [`super::gin::GinPlan::ll_signal`]).

use super::gin::RdmaTransport;
use super::signals::LL_SIGNALS;
use crate::config::BUFFER_ALIGNMENT;
use crate::error::Result;
use crate::topology::Topology;

/// Contexts of the LSA emulation (GIN grants at most 4). Two, so that the emulated runs see senders
/// on different signal tables, as on GIN.
pub const LSA_CONTEXTS: usize = 2;
/// Bytes reserved for the seam descriptor (`LsaNet` / `GinNet` of `kernels/low_latency.cuh`).
pub const DESC_BYTES: usize = 4096;
/// Bytes of a dispatch message before its payload (`DEK_LL_MSG_META`).
pub const MSG_META: usize = 160;
/// `net_kind` of the LSA emulation (`DEK_LL_NET_LSA`).
pub const NET_LSA: i32 = crate::kernels::low_latency::NET_LSA;
/// `net_kind` of NCCL GIN (`DEK_LL_NET_GIN`).
pub const NET_GIN: i32 = crate::kernels::low_latency::NET_GIN;

fn align(v: usize) -> usize {
    v.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
}

/// Whether `peer` lies outside `rank`'s NVLink domain of `nvl_domain` ranks (reached through
/// the seam).
pub fn is_remote(rank: usize, peer: usize, nvl_domain: usize) -> bool {
    rank / nvl_domain != peer / nvl_domain
}

/// Where the seam's state lives in every window: after the LL area (`num_rdma_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeamLayout {
    /// The seam descriptor (this rank's, read by its own kernels).
    pub desc_off: usize,
    /// `u64 [LL_SIGNALS]`: the value this rank last gave each remote peer's seam signal, indexed by
    /// [`super::signals::ll`] with the receiver as `rank` (a signal add of `tag - shadow` makes the remote
    /// value exactly the tag an NVLink word would hold, so no signal is reset between calls).
    pub shadow_off: usize,
    /// The LSA emulation's signal tables, `u64 [LSA_CONTEXTS][LL_SIGNALS]` (GIN keeps its own).
    pub signal_off: usize,
    /// End of the seam area.
    pub end: usize,
}

impl SeamLayout {
    /// Bytes of the seam area.
    pub const BYTES: usize = DESC_BYTES + 8 * LL_SIGNALS + 8 * LSA_CONTEXTS * LL_SIGNALS;

    /// The seam area of a window whose control area has `control_bytes`, behind `num_nvl_bytes`
    /// and an LL area of `num_rdma_bytes` (each region starts 128-byte aligned).
    pub fn new(control_bytes: usize, num_nvl_bytes: usize, num_rdma_bytes: usize) -> SeamLayout {
        let desc_off = control_bytes + align(num_nvl_bytes) + align(num_rdma_bytes);
        let shadow_off = desc_off + DESC_BYTES;
        let signal_off = shadow_off + 8 * LL_SIGNALS;
        SeamLayout { desc_off, shadow_off, signal_off, end: signal_off + 8 * LSA_CONTEXTS * LL_SIGNALS }
    }

    /// Window bytes the seam adds after an LL area of `num_rdma_bytes` (its alignment included).
    pub fn extra_bytes(num_rdma_bytes: usize) -> usize {
        align(num_rdma_bytes) - num_rdma_bytes + Self::BYTES
    }
}

/// Where a dispatch stages its messages to remote peers, in the send half of its call (offsets
/// from the half's start; the half is the zero-copy combine buffer, which a dispatch may reuse as
/// DeepEP's does): payload of token `tok` at `tok * (msg_bytes - MSG_META)` (once for all remote
/// destinations), meta of the message to rank `d` in slot `m` at `meta_off + (d * T + m) *
/// MSG_META`, index row of global expert `e` at `idx_off + e * T * 4`, message count for rank `d`
/// at `cnt_off + 4 * d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staging {
    pub meta_off: usize,
    pub idx_off: usize,
    pub cnt_off: usize,
    /// Bytes used.
    pub end: usize,
}

impl Staging {
    /// The staging of `num_ranks` ranks, `num_experts` experts, `t` tokens per rank and messages of
    /// `msg_bytes` (the wire format's, `crate::backend::LlWire::msg_bytes`).
    pub fn new(num_ranks: usize, num_experts: usize, t: usize, msg_bytes: usize) -> Staging {
        let meta_off = align(t * (msg_bytes - MSG_META));
        let idx_off = align(meta_off + num_ranks * t * MSG_META);
        let cnt_off = align(idx_off + 4 * num_experts * t);
        Staging { meta_off, idx_off, cnt_off, end: cnt_off + 4 * num_ranks }
    }

    /// Fails (naming the sizes) when the staging does not fit in a send half of `send_bytes`:
    /// only for very few experts per rank with a small hidden size.
    pub fn check(&self, op: &'static str, send_bytes: usize) -> Result<()> {
        crate::ensure!(
            self.end <= send_bytes,
            op,
            "an internode low-latency dispatch stages its messages to other NVLink domains in the send region ({} bytes needed, {send_bytes} available per half for this geometry): use more experts per rank or a larger hidden",
            self.end
        );
        Ok(())
    }
}

/// Bytes a per-expert combine stages in its send half for peers outside the NVLink domain: `E·T`
/// rows of `2·H + 4·H/128` bytes (DeepEP's combine slot). BF16 rows lie at their zero-copy slot;
/// LogFMT rows as payloads `[E_l][R·T]` of `2·H` bytes from the half's start, then meta words
/// `[E_l][R·T][H/128]` u32 (`ll_combine_send_logfmt` in `kernels/low_latency.cu`, which the
/// launcher checks against `send_bytes` too). The send region of `LowLatencyLayout` always holds
/// them.
pub fn combine_stage_bytes(num_experts: usize, t: usize, hidden: usize) -> usize {
    num_experts * t * (2 * hidden + 4 * (hidden / 128))
}

/// The seam of an LL buffer whose ranks span several NVLink domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seam {
    pub layout: SeamLayout,
    /// Ranks per NVLink domain.
    pub nvl_domain: usize,
    /// `net_kind` of the kernels' arguments.
    pub kind: i32,
}

/// How a buffer of `topo` reaches peers outside its NVLink domain, as DeepEP decides: only LL
/// buffers whose ranks span several domains use the seam (LL works with any number of domains;
/// internode normal mode has its own ops). `transport` is `DEEP_EP_RDMA_TRANSPORT`: unset or
/// `lsa` → the LSA emulation (every rank must be NVLink-reachable, which window creation and the
/// descriptor's writer check: the descriptor takes the window's LSA pointers, not the kernels'
/// `Ctx`, which holds the own NVLink domain only);
/// `gin` → NCCL GIN (the buffer creates a GIN device comm and writes its descriptor, `GinNet`).
pub fn select(transport: Option<RdmaTransport>, topo: &Topology, low_latency_mode: bool) -> Option<i32> {
    if !low_latency_mode || topo.num_rdma_ranks() < 2 {
        return None;
    }
    match transport {
        None | Some(RdmaTransport::Lsa) => Some(NET_LSA),
        Some(RdmaTransport::Gin) => Some(NET_GIN),
    }
}

/// Ranks of `topo`'s group outside its NVLink domain, ascending.
pub fn remote_peers(topo: &Topology) -> Vec<usize> {
    (0..topo.num_ranks).filter(|&p| is_remote(topo.rank, p, topo.num_nvl_ranks())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::peer::gin::{plan, GinKnobs, Workload};
    use crate::backend::LlGeometry;
    use crate::config::LowLatencyLayout;

    fn topo(rank: usize, n: usize, d: usize) -> Topology {
        Topology::new("test", rank, n, d).unwrap()
    }

    #[test]
    fn remote_peers_are_the_other_domains() {
        // 2 x 2: ranks 0, 1 | 2, 3.
        assert_eq!(remote_peers(&topo(0, 4, 2)), vec![2, 3]);
        assert_eq!(remote_peers(&topo(3, 4, 2)), vec![0, 1]);
        // 4 x 1: everyone else is remote; 1 x 4: nobody.
        assert_eq!(remote_peers(&topo(1, 4, 1)), vec![0, 2, 3]);
        assert!(remote_peers(&topo(1, 4, 8)).is_empty());
        // The kernels' predicate (d / D != rank / D) agrees.
        for (n, d) in [(4, 2), (8, 4), (8, 2), (16, 8)] {
            for r in 0..n {
                let t = topo(r, n, d);
                for p in 0..n {
                    assert_eq!(is_remote(r, p, d), t.node_of(p) != t.rdma_rank(), "{n} {d} {r} {p}");
                }
            }
        }
    }

    #[test]
    fn signal_ids_are_gin_plan_ids_and_fit() {
        for (el, r) in [(1, 2), (2, 4), (64, 4), (256, 8)] {
            let p = plan(Workload::LowLatency { num_local_experts: el, num_ranks: r }, &GinKnobs::default()).unwrap();
            assert!(p.signals <= LL_SIGNALS || el * r > crate::backend::peer::signals::LL_MAX_EXPERTS);
            let mut seen = std::collections::HashSet::new();
            for combine in [false, true] {
                for half in 0..2 {
                    for l in 0..el {
                        for s in 0..r {
                            let id = crate::backend::peer::signals::ll(combine, half, l, s, el, r);
                            assert_eq!(id, p.ll_signal(combine, half, l, s));
                            assert!(id < 4 * el * r && seen.insert(id));
                        }
                    }
                }
            }
        }
        assert_eq!(crate::backend::peer::signals::ll(true, 1, 511, 3, 512, 4), LL_SIGNALS - 1);
    }

    #[test]
    fn seam_area_follows_the_ll_area() {
        let l = SeamLayout::new(65536, 1000, 4096);
        assert_eq!(l.desc_off, 65536 + 1024 + 4096);
        assert_eq!((l.shadow_off - l.desc_off, l.signal_off - l.shadow_off), (DESC_BYTES, 8 * LL_SIGNALS));
        assert_eq!(l.end - l.desc_off, SeamLayout::BYTES);
        assert!(l.desc_off % 128 == 0 && l.shadow_off % 8 == 0 && l.signal_off % 8 == 0);
        // The window grows by exactly what the seam needs after the LL area of num_rdma_bytes.
        let rdma = 4000;
        let l = SeamLayout::new(65536, 0, rdma);
        assert_eq!(l.end, 65536 + rdma + SeamLayout::extra_bytes(rdma));
    }

    #[test]
    fn staging_is_disjoint_aligned_and_fits_typical_geometries() {
        let s = Staging::new(4, 8, 10, 160 + 4096);
        assert_eq!(s.meta_off, 10 * 4096);
        assert_eq!(s.idx_off, 10 * 4096 + 4 * 10 * 160);
        assert_eq!(s.cnt_off, align(s.idx_off + 4 * 8 * 10));
        assert_eq!(s.end, s.cnt_off + 16);
        assert!([s.meta_off, s.idx_off, s.cnt_off].iter().all(|o| o % 16 == 0));
        // Every geometry of the GPU suite (2 x 2 and more) fits the send half.
        for (r, e, t, h) in
            [(4, 8, 1500, 2048), (4, 8, 1, 2176), (4, 288, 128, 7168), (8, 16, 512, 4096), (16, 32, 128, 2048), (2, 4, 128, 2048)]
        {
            let g = LlGeometry { num_max_dispatch_tokens_per_rank: t, hidden: h, num_experts: e };
            let w = g.wire(r).unwrap();
            let st = Staging::new(r, e, t, w.msg_bytes);
            let lay = LowLatencyLayout::new(t, h, e);
            assert!(st.check("op", lay.send_bytes).is_ok(), "{r} {e} {t} {h}: {} > {}", st.end, lay.send_bytes);
            // A partial row is staged in the payload of its message; per-expert combine rows
            // (BF16 or LogFMT) in the send half.
            assert!(w.msg_bytes - MSG_META >= 2 * h);
            assert!(combine_stage_bytes(e, t, h) <= lay.send_bytes && combine_stage_bytes(e, t, h) == e * t * lay.combine_slot_bytes);
        }
        let e = Staging::new(2, 2, 128, 160 + 256).check(crate::op_names::LOW_LATENCY_DISPATCH, 100).unwrap_err().to_string();
        assert!(e.contains("stages its messages to other NVLink domains") && e.contains("100 available"), "{e}");
    }

    #[test]
    fn only_internode_ll_buffers_use_the_seam() {
        assert_eq!(select(None, &topo(0, 4, 2), true), Some(NET_LSA));
        assert_eq!(select(Some(RdmaTransport::Lsa), &topo(0, 4, 1), true), Some(NET_LSA));
        assert_eq!(select(None, &topo(0, 4, 8), true), None);
        assert_eq!(select(Some(RdmaTransport::Gin), &topo(0, 4, 2), false), None);
        assert_eq!(select(Some(RdmaTransport::Gin), &topo(0, 4, 2), true), Some(NET_GIN));
        assert_eq!(select(Some(RdmaTransport::Gin), &topo(0, 4, 4), true), None);
    }
}
