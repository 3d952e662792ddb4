//! Which ranks' windows an NCCL window of a buffer can address, and which of them the kernels get
//! in [`Ctx::peer_base`](crate::kernels::intranode::Ctx): pure logic over NCCL's answer (the LSA team, the
//! ranks that share load/store access over NVLink: every GPU of one NVLink machine, the node on a
//! cluster) and the buffer's NVLink domains (`DEEP_EP_NVL_DOMAIN_SIZE`).
//!
//! - Intranode buffer (one domain): the LSA team must be the whole buffer; kernels get every rank.
//! - Internode buffer (ranks over several domains of `D`): kernels get the windows of their own
//!   domain only (`Ctx::nvl_ranks` = D, NULL for the other ranks), whatever NCCL could address,
//!   so a kernel that still touches another domain's window directly faults on the one machine
//!   where it would otherwise work. The LSA team is either the whole buffer (one NVLink machine:
//!   the LSA emulation of the RDMA leg, or GIN there) and its pointers feed the LSA emulation's
//!   descriptor, or exactly the own domain (a cluster, `DEEP_EP_RDMA_TRANSPORT=gin` only) with
//!   `lsa_rank == rank % D`, the ranks of a node consecutive.
//!
//! Sizes: an intranode buffer has at most `MAX_RANKS` (8) ranks; an internode one at most
//! `internode::MAX_RANKS` (256) in at most `internode::MAX_NODES` (32) domains of at most 8. The
//! kernels' `Ctx` holds the 8 windows of the own domain; the LSA team is the whole buffer when the
//! LSA emulation reaches it (`MAX_LSA_PEERS`, 32: one machine, or several ranks per GPU), else
//! exactly the own domain.

use crate::error::{Error, Result};
use std::ffi::c_void;

use crate::kernels::internode::{MAX_NODES, MAX_RANKS as MAX_RANKS_IN};
use crate::kernels::intranode::MAX_RANKS;
use crate::kernels::transport::MAX_LSA_PEERS;

/// Where a window's peers are, checked against the buffer's topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerMap {
    pub rank: usize,
    pub num_ranks: usize,
    /// World rank of LSA rank 0: NCCL's LSA team is the world ranks `[lsa_first, lsa_first +
    /// lsa_size)` (NCCL's teams are consecutive world ranks: `ncclGetPeerPointer`, `ncclTeamRail`).
    pub lsa_first: usize,
    pub lsa_size: usize,
    /// [`Ctx::nvl_ranks`](crate::kernels::intranode::Ctx): 0 = the kernels get every rank's window, `D` =
    /// only those of the own NVLink domain of `D` ranks.
    pub ctx_nvl_ranks: usize,
}

impl PeerMap {
    /// Checks NCCL's LSA team of `rank` (`lsa_size` ranks, this one at `lsa_rank`) against a
    /// buffer of `num_ranks` ranks in NVLink domains of `nvl_domain` ranks (`>= num_ranks`: an
    /// intranode buffer). `gin`: the RDMA leg of an internode buffer goes over NCCL GIN (else the
    /// LSA emulation, which needs every rank in the team). Errors name what differs.
    pub fn new(
        op: &'static str,
        rank: usize,
        num_ranks: usize,
        nvl_domain: usize,
        lsa_size: usize,
        lsa_rank: usize,
        gin: bool,
    ) -> Result<PeerMap> {
        let internode = nvl_domain < num_ranks;
        let max = if internode { MAX_RANKS_IN } else { MAX_RANKS };
        crate::ensure!(
            (1..=max).contains(&num_ranks) && rank < num_ranks && nvl_domain >= 1,
            op,
            "internal: rank {rank} of {num_ranks}, NVLink domains of {nvl_domain}"
        );
        crate::ensure!(
            !internode || (num_ranks % nvl_domain == 0 && nvl_domain <= MAX_RANKS && num_ranks / nvl_domain <= MAX_NODES),
            op,
            "internal: {num_ranks} ranks in NVLink domains of {nvl_domain}"
        );
        let team = |extra: &str| {
            format!("NCCL's LSA team of rank {rank} (the ranks it reaches over NVLink) has {lsa_size} rank(s) with this one at LSA rank {lsa_rank}{extra}")
        };
        crate::ensure!(
            lsa_size >= 1 && lsa_rank < lsa_size && lsa_rank <= rank && rank - lsa_rank + lsa_size <= num_ranks,
            op,
            "{}, which is not a range of the buffer's {num_ranks} ranks",
            team("")
        );
        let lsa_first = rank - lsa_rank;
        let map = |ctx_nvl_ranks| Ok(PeerMap { rank, num_ranks, lsa_first, lsa_size, ctx_nvl_ranks });
        if internode && lsa_size > MAX_RANKS && lsa_size != nvl_domain && (lsa_size != num_ranks || num_ranks > MAX_LSA_PEERS) {
            // A larger NVLink machine (an NVL72 rack, say) holding part of the buffer: the kernels
            // take the 8 windows of their domain, and the LSA emulation reaches MAX_LSA_PEERS
            // ranks of one team, so the domains must be the nodes of the RDMA leg.
            return Err(Error::invalid(op, format!(
                "{}, more than the {MAX_RANKS} windows an NVLink domain of a buffer may hold, and not the whole buffer of at most {MAX_LSA_PEERS} ranks: set {} to at most {MAX_RANKS} and DEEP_EP_RDMA_TRANSPORT=gin",
                team(""), crate::topology::NVL_DOMAIN_ENV
            )));
        }
        if !internode {
            if lsa_size == num_ranks {
                return map(0);
            }
            return Err(Error::invalid(op, format!(
                "{}, but the buffer's {num_ranks} ranks form one NVLink domain ({} = {nvl_domain}) and need to be in it: set {} to the ranks per node ({lsa_size}) for an internode buffer",
                team(""), crate::topology::NVL_DOMAIN_ENV, crate::topology::NVL_DOMAIN_ENV
            )));
        }
        let node = rank / nvl_domain;
        if lsa_size == num_ranks && num_ranks <= MAX_LSA_PEERS {
            // One NVLink machine playing several nodes: the kernels still see their domain only.
            return map(nvl_domain);
        }
        if lsa_size == nvl_domain && lsa_first == node * nvl_domain {
            if !gin {
                return Err(Error::invalid(op, format!(
                    "{}: the LSA emulation of the RDMA leg (DEEP_EP_RDMA_TRANSPORT unset or lsa) needs all {num_ranks} ranks in it; across machines set DEEP_EP_RDMA_TRANSPORT=gin",
                    team("")
                )));
            }
            return map(nvl_domain);
        }
        let why = if lsa_size != nvl_domain {
            format!("the buffer's NVLink domains have {} = {nvl_domain} ranks: set it to {lsa_size}", crate::topology::NVL_DOMAIN_ENV)
        } else {
            format!("the buffer expects rank {rank} at local index {} of domain {node} (ranks of a node consecutive: rank = node * {nvl_domain} + index); launch the ranks of each node with consecutive ranks", rank % nvl_domain)
        };
        Err(Error::invalid(op, format!("{}: {why}", team(&format!(" (world ranks {lsa_first}..{})", lsa_first + lsa_size - 1)))))
    }

    /// Whether the kernels get world rank `p`'s window in `Ctx::peer_base`.
    pub fn in_ctx(&self, p: usize) -> bool {
        p < self.num_ranks && (self.ctx_nvl_ranks == 0 || p / self.ctx_nvl_ranks == self.rank / self.ctx_nvl_ranks)
    }

    /// The first world rank of the ranks the kernels address ([`Ctx::nvl_first`](crate::kernels::intranode::Ctx)).
    pub fn ctx_first(&self) -> usize {
        self.rank.checked_div(self.ctx_nvl_ranks).map_or(0, |node| node * self.ctx_nvl_ranks)
    }

    /// From the team's window pointers in LSA order (`lsa[i]` of LSA rank `i`): `(ctx, lsa)`,
    /// where `ctx` holds the ranks of [`PeerMap::in_ctx`], world rank `p` at slot `p % MAX_RANKS`
    /// (NULL in the other slots), and `lsa` every rank of the buffer by world rank, NULL outside
    /// the team (for the LSA emulation's descriptor and self-test).
    pub fn spread(&self, lsa: &[*mut c_void]) -> ([*mut c_void; MAX_RANKS], Vec<*mut c_void>) {
        let mut by_world = vec![std::ptr::null_mut(); self.num_ranks];
        for (i, &b) in lsa.iter().take(self.lsa_size).enumerate() {
            by_world[self.lsa_first + i] = b;
        }
        let mut ctx = [std::ptr::null_mut(); MAX_RANKS];
        for (p, &b) in by_world.iter().enumerate() {
            if self.in_ctx(p) {
                ctx[p % MAX_RANKS] = b;
            }
        }
        (ctx, by_world)
    }

    /// Whether the team covers every rank (the LSA emulation and the transport self-test can run).
    pub fn whole_buffer(&self) -> bool {
        self.lsa_size == self.num_ranks
    }
}

/// Every rank's window by world rank (`lsa`, of a buffer whose LSA team is the whole buffer) as
/// the pointers of a `Ctx` that addresses them all: what the transport self-test runs on.
pub fn whole_buffer_ctx_bases(op: &'static str, lsa: &[*mut c_void]) -> Result<[*mut c_void; MAX_RANKS]> {
    crate::ensure!(
        lsa.len() <= MAX_RANKS,
        op,
        "DEEP_EP_TRANSPORT_SELFTEST runs on buffers of at most {MAX_RANKS} ranks, not {}: unset it",
        lsa.len()
    );
    let mut bases = [std::ptr::null_mut(); MAX_RANKS];
    bases[..lsa.len()].copy_from_slice(lsa);
    Ok(bases)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: &str = crate::op_names::CREATE_BUFFER;

    fn ptr(v: usize) -> *mut c_void {
        v as *mut c_void
    }

    #[test]
    fn intranode_buffers_need_the_whole_buffer_in_the_team() {
        let m = PeerMap::new(OP, 2, 4, 8, 4, 2, false).unwrap();
        assert_eq!((m.lsa_first, m.ctx_nvl_ranks), (0, 0));
        let (ctx, lsa) = m.spread(&[ptr(10), ptr(11), ptr(12), ptr(13)]);
        assert_eq!(&ctx[..4], &[ptr(10), ptr(11), ptr(12), ptr(13)]);
        assert_eq!(ctx, whole_buffer_ctx_bases(OP, &lsa).unwrap());
        assert!(ctx[4..].iter().all(|p| p.is_null()));
        // 2 machines x 4 GPUs with the default domain size: NCCL's team is the node.
        let e = PeerMap::new(OP, 5, 8, 8, 4, 1, true).unwrap_err().to_string();
        assert!(
            e.contains("LSA team of rank 5")
                && e.contains("has 4 rank(s)")
                && e.contains("set DEEP_EP_NVL_DOMAIN_SIZE to the ranks per node (4)"),
            "{e}"
        );
    }

    #[test]
    fn one_machine_emulating_nodes_gives_kernels_the_own_domain_only() {
        // 2 x 2 on 4 GPUs: every window is addressable, the kernels get ranks 2, 3 on rank 3.
        for gin in [false, true] {
            let m = PeerMap::new(OP, 3, 4, 2, 4, 3, gin).unwrap();
            assert_eq!((m.lsa_first, m.ctx_nvl_ranks), (0, 2));
            assert_eq!((0..4).map(|p| m.in_ctx(p)).collect::<Vec<_>>(), vec![false, false, true, true]);
            let (ctx, lsa) = m.spread(&[ptr(10), ptr(11), ptr(12), ptr(13)]);
            assert_eq!(m.ctx_first(), 2);
            assert_eq!(&ctx[..4], &[ptr(0), ptr(0), ptr(12), ptr(13)]); // world rank p at slot p % 8
            assert_eq!(&lsa[..4], &[ptr(10), ptr(11), ptr(12), ptr(13)]);
            assert!(m.whole_buffer());
        }
        // 4 x 1: only the own window.
        let m = PeerMap::new(OP, 1, 4, 1, 4, 1, false).unwrap();
        let (ctx, _) = m.spread(&[ptr(10), ptr(11), ptr(12), ptr(13)]);
        assert_eq!(m.ctx_first(), 1);
        assert_eq!(&ctx[..4], &[ptr(0), ptr(11), ptr(0), ptr(0)]);
    }

    #[test]
    fn a_cluster_node_as_the_team_maps_lsa_ranks_to_the_domain() {
        // 2 nodes x 4 GPUs over GIN, rank 6 = node 1, local 2: LSA ranks 0..4 are world 4..8.
        let m = PeerMap::new(OP, 6, 8, 4, 4, 2, true).unwrap();
        assert_eq!((m.lsa_first, m.lsa_size, m.ctx_nvl_ranks), (4, 4, 4));
        assert!(!m.whole_buffer());
        let (ctx, lsa) = m.spread(&[ptr(20), ptr(21), ptr(22), ptr(23)]);
        assert_eq!(m.ctx_first(), 4);
        assert_eq!(lsa, vec![ptr(0), ptr(0), ptr(0), ptr(0), ptr(20), ptr(21), ptr(22), ptr(23)]);
        assert_eq!(ctx, [ptr(0), ptr(0), ptr(0), ptr(0), ptr(20), ptr(21), ptr(22), ptr(23)]);
        // The same team without GIN: the emulation cannot reach the other node.
        let e = PeerMap::new(OP, 6, 8, 4, 4, 2, false).unwrap_err().to_string();
        assert!(e.contains("LSA emulation") && e.contains("needs all 8 ranks") && e.contains("DEEP_EP_RDMA_TRANSPORT=gin"), "{e}");
    }

    #[test]
    fn a_team_that_is_not_the_domain_is_refused_naming_the_difference() {
        // Nodes of 4 GPUs, but DEEP_EP_NVL_DOMAIN_SIZE=2.
        let e = PeerMap::new(OP, 6, 8, 2, 4, 2, true).unwrap_err().to_string();
        assert!(e.contains("(world ranks 4..7)") && e.contains("DEEP_EP_NVL_DOMAIN_SIZE = 2 ranks: set it to 4"), "{e}");
        // Right size, but the node's ranks are not the domain (rank 2 at LSA rank 0: team 2..5).
        let e = PeerMap::new(OP, 2, 8, 4, 4, 0, true).unwrap_err().to_string();
        assert!(e.contains("(world ranks 2..5)") && e.contains("local index 2 of domain 0") && e.contains("consecutive"), "{e}");
        // Not a range of the buffer at all.
        let e = PeerMap::new(OP, 1, 4, 2, 2, 3, true).unwrap_err().to_string();
        assert!(e.contains("not a range of the buffer's 4 ranks"), "{e}");
        assert!(PeerMap::new(OP, 3, 4, 2, 2, 0, true).is_err());
    }

    #[test]
    fn internode_buffers_of_up_to_256_ranks_map_the_own_domain_by_slot() {
        // Rank 37 of 64 in domains of 8 over GIN: node 4, local 5; LSA team = world ranks 32..40.
        let m = PeerMap::new(OP, 37, 64, 8, 8, 5, true).unwrap();
        assert_eq!((m.lsa_first, m.ctx_first(), m.ctx_nvl_ranks), (32, 32, 8));
        assert!(m.in_ctx(32) && m.in_ctx(39) && !m.in_ctx(31) && !m.in_ctx(40) && !m.whole_buffer());
        let team: Vec<_> = (0..8).map(|i| ptr(100 + i)).collect();
        let (ctx, lsa) = m.spread(&team);
        assert_eq!(ctx.to_vec(), team);
        assert_eq!(lsa.len(), 64);
        assert!(lsa.iter().enumerate().all(|(p, &b)| b == if (32..40).contains(&p) { ptr(100 + p - 32) } else { ptr(0) }));
        // 256 ranks = 32 domains of 8, the last rank.
        let m = PeerMap::new(OP, 255, 256, 8, 8, 7, true).unwrap();
        assert_eq!((m.ctx_first(), m.spread(&team).1.len()), (248, 256));
        // Domains of 3 (24 ranks over GIN): rank 13's domain 12..14 takes slots 4, 5, 6.
        let m = PeerMap::new(OP, 13, 24, 3, 3, 1, true).unwrap();
        let (ctx, _) = m.spread(&[ptr(1), ptr(2), ptr(3)]);
        assert_eq!(ctx, [ptr(0), ptr(0), ptr(0), ptr(0), ptr(1), ptr(2), ptr(3), ptr(0)]);
        // Past the limits: 264 ranks, 33 domains, domains of 16 (internal: create refuses first).
        assert!(PeerMap::new(OP, 0, 264, 8, 8, 0, true).is_err());
        assert!(PeerMap::new(OP, 0, 132, 4, 4, 0, true).is_err());
        assert!(PeerMap::new(OP, 0, 32, 16, 16, 0, true).is_err());
        // An intranode buffer stays at 8 ranks.
        assert!(PeerMap::new(OP, 0, 16, 16, 16, 0, true).is_err());
    }

    #[test]
    fn a_team_of_more_than_8_is_refused_unless_it_is_the_domain() {
        // An NVLink machine of 16 GPUs holding a 64-rank buffer in domains of 8: the team spans
        // two domains, more than a Ctx holds.
        let e = PeerMap::new(OP, 3, 64, 8, 16, 3, true).unwrap_err().to_string();
        assert!(e.contains("has 16 rank(s)") && e.contains("more than the 8 windows") && e.contains("DEEP_EP_NVL_DOMAIN_SIZE"), "{e}");
        // The whole 16-rank buffer in one LSA team (2 x 8 emulated on one machine or one GPU):
        // the emulation reaches them all, the kernels their own domain.
        let m = PeerMap::new(OP, 9, 16, 8, 16, 9, false).unwrap();
        assert!(m.whole_buffer() && (m.ctx_first(), m.ctx_nvl_ranks) == (8, 8));
        let team: Vec<_> = (0..16).map(|i| ptr(100 + i)).collect();
        let (ctx, lsa) = m.spread(&team);
        assert_eq!((ctx.to_vec(), lsa), (team[8..].to_vec(), team.clone()));
        // 4 x 4 likewise; 64 ranks in one team is past the emulation's reach.
        assert_eq!(PeerMap::new(OP, 5, 16, 4, 16, 5, false).unwrap().ctx_first(), 4);
        assert!(PeerMap::new(OP, 5, 64, 8, 64, 5, false).is_err());
    }
}
