//! Rank geometry of an expert-parallel group that spans several NVLink domains ("nodes"), as
//! DeepEP defines it: rank `r` is GPU `nvl_rank = r % D` of node `rdma_rank = r / D`, where `D` is
//! the NVLink domain size (8 on an HGX node). Internode normal mode moves tokens over RDMA between
//! ranks with the same `nvl_rank` (a *rail*) and over NVLink inside a node.
//!
//! `D` is configurable (`DEEP_EP_NVL_DOMAIN_SIZE`, default [`DEFAULT_NVL_DOMAIN_SIZE`]) so a single
//! machine can play several nodes: with `D = 2` a 4-GPU machine is 2 nodes x 2 GPUs, and the RDMA
//! leg runs over the LSA emulation of the transport (`kernels/transport.cuh`).
//!
//! Pure host math: no device, no collective.

use crate::config::MAX_NVL_PEERS;
use crate::error::{Error, Result};

/// DeepEP's `NUM_MAX_NVL_PEERS`: ranks per node when nothing says otherwise.
pub const DEFAULT_NVL_DOMAIN_SIZE: usize = MAX_NVL_PEERS;

/// Environment variable that sets the NVLink domain size.
pub const NVL_DOMAIN_ENV: &str = "DEEP_EP_NVL_DOMAIN_SIZE";

/// Where a rank sits in a multi-node group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Global rank in `[0, num_ranks)`.
    pub rank: usize,
    /// Ranks of the group.
    pub num_ranks: usize,
    /// Ranks per NVLink domain (`D`), `1..=8`.
    pub nvl_domain_size: usize,
}

/// How a buffer reaches its peers, decided as DeepEP's `Buffer` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// All ranks in one NVLink domain: NVLink only (`num_rdma_ranks == 1`).
    Intranode,
    /// Several NVLink domains: normal mode forwards over RDMA then NVLink; LL puts directly.
    Internode,
}

impl Topology {
    /// Checks DeepEP's constraints: `num_ranks <= D` or `num_ranks % D == 0` (every node full),
    /// `1 <= D <= 8`, `rank < num_ranks`. `op` names the caller in the error.
    pub fn new(op: &'static str, rank: usize, num_ranks: usize, nvl_domain_size: usize) -> Result<Self> {
        crate::ensure!(
            (1..=MAX_NVL_PEERS).contains(&nvl_domain_size),
            op,
            "the NVLink domain size must be in 1..={MAX_NVL_PEERS}, got {nvl_domain_size}"
        );
        crate::ensure!(num_ranks >= 1 && rank < num_ranks, op, "rank {rank} out of range for {num_ranks} ranks");
        crate::ensure!(
            num_ranks <= nvl_domain_size || num_ranks % nvl_domain_size == 0,
            op,
            "{num_ranks} ranks do not fill NVLink domains of {nvl_domain_size} ranks (num_ranks must be <= or a multiple of the domain size)"
        );
        Ok(Topology { rank, num_ranks, nvl_domain_size })
    }

    /// Ranks in this rank's NVLink domain: `min(num_ranks, D)`.
    pub fn num_nvl_ranks(&self) -> usize {
        self.num_ranks.min(self.nvl_domain_size)
    }

    /// Nodes: `max(1, num_ranks / D)`.
    pub fn num_rdma_ranks(&self) -> usize {
        (self.num_ranks / self.nvl_domain_size).max(1)
    }

    /// This rank's node.
    pub fn rdma_rank(&self) -> usize {
        self.rank / self.num_nvl_ranks()
    }

    /// This rank's index inside its node.
    pub fn nvl_rank(&self) -> usize {
        self.rank % self.num_nvl_ranks()
    }

    /// Global rank of GPU `nvl_rank` of node `rdma_rank`.
    pub fn global_rank(&self, rdma_rank: usize, nvl_rank: usize) -> usize {
        rdma_rank * self.num_nvl_ranks() + nvl_rank
    }

    /// Global ranks of this rank's node, ascending (own included).
    pub fn nvl_peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_nvl_ranks()).map(move |l| self.global_rank(self.rdma_rank(), l))
    }

    /// Global ranks with this rank's `nvl_rank`, one per node, ascending (own included): the
    /// RDMA peers of normal mode.
    pub fn rail_peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_rdma_ranks()).map(move |n| self.global_rank(n, self.nvl_rank()))
    }

    /// Node of global rank `r`.
    pub fn node_of(&self, r: usize) -> usize {
        r / self.num_nvl_ranks()
    }

    /// Intranode when one NVLink domain holds every rank.
    pub fn path(&self) -> Path {
        if self.num_rdma_ranks() > 1 {
            Path::Internode
        } else {
            Path::Intranode
        }
    }
}

/// Parses `DEEP_EP_NVL_DOMAIN_SIZE` for op `op`: unset or empty = [`DEFAULT_NVL_DOMAIN_SIZE`],
/// else exactly the decimal digits of a size in `1..=8`. The library's one parser of it (the
/// Python package asks `deep_ep::nvl_domain_size`): anything else (`+1`, ` 2`, `abc`, `0`,
/// `08`) is an error naming the variable, never a silent default, so every layer sees one value.
pub fn parse_nvl_domain_size(op: &'static str, value: Option<&str>) -> Result<usize> {
    let Some(v) = value.filter(|v| !v.is_empty()) else {
        return Ok(DEFAULT_NVL_DOMAIN_SIZE);
    };
    let digits = v.bytes().all(|b| b.is_ascii_digit()) && !v.starts_with('0');
    match v.parse::<usize>() {
        Ok(d) if digits && (1..=MAX_NVL_PEERS).contains(&d) => Ok(d),
        _ => Err(Error::invalid(
            op,
            format!(
                "{NVL_DOMAIN_ENV}={v:?} is not a whole number in 1..={MAX_NVL_PEERS} (digits only, e.g. 4); unset it for the \
                 default {DEFAULT_NVL_DOMAIN_SIZE}"
            ),
        )),
    }
}

/// `DEEP_EP_NVL_DOMAIN_SIZE` of the environment, validated ([`parse_nvl_domain_size`]); errors
/// name `op`.
pub fn nvl_domain_size(op: &'static str) -> Result<usize> {
    parse_nvl_domain_size(op, std::env::var(NVL_DOMAIN_ENV).ok().as_deref())
}

/// DeepEP's buffer-size rules that depend on the topology (`Buffer::Buffer` asserts), so a
/// mis-sized buffer fails at creation with a message instead of inside a kernel:
/// - `num_rdma_bytes > 0` needs an internode group or low-latency mode;
/// - internode normal mode needs `num_rdma_bytes > 0` and at most 20 nodes (DeepEP's kernel limit);
/// - both sizes are multiples of 128.
pub fn check_buffer_sizes(t: &Topology, num_nvl_bytes: usize, num_rdma_bytes: usize, low_latency_mode: bool) -> Result<()> {
    const OP: &str = crate::op_names::CREATE_BUFFER;
    crate::ensure!(num_nvl_bytes % 128 == 0, OP, "num_nvl_bytes must be a multiple of 128, got {num_nvl_bytes}");
    crate::ensure!(num_rdma_bytes % 128 == 0, OP, "num_rdma_bytes must be a multiple of 128, got {num_rdma_bytes}");
    let internode = t.path() == Path::Internode;
    crate::ensure!(
        num_rdma_bytes == 0 || internode || low_latency_mode,
        OP,
        "num_rdma_bytes = {num_rdma_bytes} needs more ranks than one NVLink domain ({} > {}) or low_latency_mode",
        t.num_ranks,
        t.nvl_domain_size
    );
    if internode && !low_latency_mode {
        crate::ensure!(
            num_rdma_bytes > 0,
            OP,
            "{} ranks span {} NVLink domains of {}: normal mode needs num_rdma_bytes > 0 (Config.get_rdma_buffer_size_hint)",
            t.num_ranks,
            t.num_rdma_ranks(),
            t.nvl_domain_size
        );
        crate::ensure!(t.num_rdma_ranks() <= 20, OP, "normal mode supports at most 20 NVLink domains, got {}", t.num_rdma_ranks());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rank: usize, n: usize, d: usize) -> Topology {
        Topology::new("test", rank, n, d).unwrap()
    }

    #[test]
    fn deepep_geometry_with_full_nodes() {
        // EP32 on 4 nodes of 8: rank 19 is GPU 3 of node 2.
        let x = t(19, 32, 8);
        assert_eq!((x.rdma_rank(), x.nvl_rank(), x.num_rdma_ranks(), x.num_nvl_ranks()), (2, 3, 4, 8));
        assert_eq!(x.rail_peers().collect::<Vec<_>>(), vec![3, 11, 19, 27]);
        assert_eq!(x.nvl_peers().collect::<Vec<_>>(), (16..24).collect::<Vec<_>>());
        assert_eq!(x.global_rank(x.rdma_rank(), x.nvl_rank()), 19);
        assert_eq!(x.path(), Path::Internode);
    }

    #[test]
    fn emulated_two_nodes_of_two() {
        // The 4-GPU machine as 2 x 2: rails {0,2} and {1,3}.
        let ranks: Vec<Topology> = (0..4).map(|r| t(r, 4, 2)).collect();
        assert!(ranks.iter().all(|x| x.num_rdma_ranks() == 2 && x.num_nvl_ranks() == 2 && x.path() == Path::Internode));
        assert_eq!(ranks[3].rail_peers().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(ranks[2].nvl_peers().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(ranks.iter().map(|x| (x.rdma_rank(), x.nvl_rank())).collect::<Vec<_>>(), vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    }

    #[test]
    fn every_rank_is_on_exactly_one_rail_and_one_node() {
        for (n, d) in [(16, 8), (12, 4), (6, 2), (8, 1), (5, 8), (256, 8)] {
            let mut seen = vec![0u32; n];
            for r in 0..n {
                let x = t(r, n, d);
                assert_eq!(x.node_of(r), x.rdma_rank());
                for p in x.rail_peers() {
                    assert_eq!(t(p, n, d).nvl_rank(), x.nvl_rank(), "{n} {d}");
                }
                // Rails of node 0 partition the ranks.
                if x.rdma_rank() == 0 {
                    x.rail_peers().for_each(|p| seen[p] += 1);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{n} ranks, domain {d}: {seen:?}");
        }
    }

    #[test]
    fn small_groups_are_intranode() {
        let x = t(2, 4, 8);
        assert_eq!((x.num_rdma_ranks(), x.num_nvl_ranks(), x.rdma_rank(), x.nvl_rank(), x.path()), (1, 4, 0, 2, Path::Intranode));
    }

    #[test]
    fn bad_geometry_is_reported() {
        let e = |r, n, d| Topology::new(crate::op_names::CREATE_BUFFER, r, n, d).unwrap_err().to_string();
        assert!(e(0, 12, 8).contains("12 ranks do not fill NVLink domains of 8 ranks"), "{}", e(0, 12, 8));
        assert!(e(0, 4, 0).contains("must be in 1..=8, got 0"));
        assert!(e(0, 4, 9).contains("got 9"));
        assert!(e(4, 4, 2).contains("rank 4 out of range for 4 ranks"));
    }

    #[test]
    fn domain_size_from_the_environment_value() {
        let p = |v| parse_nvl_domain_size("test", v);
        assert_eq!(p(None).unwrap(), 8);
        assert_eq!(p(Some("")).unwrap(), 8);
        assert_eq!(p(Some("2")).unwrap(), 2);
        assert_eq!(p(Some("8")).unwrap(), 8);
        for bad in ["16", "0", "+1", " 2", "2 ", "abc", "-1", "08", "2.0", "0x2", " ", "\u{661}"] {
            let e = p(Some(bad)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("test: DEEP_EP_NVL_DOMAIN_SIZE={bad:?} is not a whole number in 1..=8")), "{e}");
        }
    }

    #[test]
    fn buffer_sizes_follow_deepep() {
        let intra = t(0, 8, 8);
        let inter = t(0, 16, 8);
        assert!(check_buffer_sizes(&intra, 1 << 20, 0, false).is_ok());
        assert!(check_buffer_sizes(&intra, 1 << 20, 1 << 20, true).is_ok());
        assert!(check_buffer_sizes(&inter, 1 << 20, 1 << 20, false).is_ok());
        let e = check_buffer_sizes(&intra, 1 << 20, 1 << 20, false).unwrap_err().to_string();
        assert!(e.contains("needs more ranks than one NVLink domain (8 > 8) or low_latency_mode"), "{e}");
        let e = check_buffer_sizes(&inter, 1 << 20, 0, false).unwrap_err().to_string();
        assert!(e.contains("span 2 NVLink domains of 8: normal mode needs num_rdma_bytes > 0"), "{e}");
        assert!(check_buffer_sizes(&inter, 100, 1 << 20, false).unwrap_err().to_string().contains("multiple of 128, got 100"));
        assert!(check_buffer_sizes(&t(0, 8 * 21, 8), 0, 1 << 20, false).unwrap_err().to_string().contains("at most 20"));
        assert!(check_buffer_sizes(&t(0, 8 * 21, 8), 0, 1 << 20, true).is_ok());
    }
}
