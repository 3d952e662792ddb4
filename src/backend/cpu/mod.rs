//! The CPU backend: the exact semantics of every op on host memory shared by the N processes
//! (or threads) of one machine. It is the reference the GPU kernels are tested against and what
//! runs where there is no GPU.
//!
//! Segment layout (one shared mapping per buffer, `crate::shm::rendezvous::segment`):
//! `[control: barrier slots | create records][rank 0: HT area | LL area][rank 1: ...]...`
//! Normal-mode ops *publish* into the caller's own HT area, meet at a barrier, then *pull* from
//! peers (`ht.rs`). Low-latency ops *push* into the receiver's LL area and raise epoch-tagged
//! flags (`ll.rs`).

pub(crate) mod ht;
pub(crate) mod internode;
pub(crate) mod ll;
mod ll_payload;
mod ll_state;
mod ll_tags;

use super::{Backend, BackendKind, BufferInfo, CreateArgs};
use crate::error::{Error, Result, WaitEnd};
use crate::shm::{self, rendezvous, Region, Segment};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Most ranks one CPU buffer supports.
pub const MAX_RANKS: usize = 256;
const SLOT: usize = 64;
const BARRIER_OFF: usize = 0;
const RECORD_OFF: usize = MAX_RANKS * SLOT;
const CONTROL_BYTES: usize = 2 * MAX_RANKS * SLOT;
const ALIGN: usize = 4096;

fn align_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// A buffer on host shared memory.
pub struct CpuBackend {
    pub(crate) info: BufferInfo,
    /// None only while being dropped (see `Drop`).
    seg: Option<Segment>,
    /// A zero-copy combine view of this buffer was handed out: its memory must outlive the buffer.
    pub(crate) views_out: bool,
    ht_bytes: usize,
    ll_bytes: usize,
    region_bytes: usize,
    /// Barriers this rank has passed (the value it publishes in its barrier slot).
    epoch: u64,
    pub(crate) timeout: Duration,
    pub(crate) ll: ll_state::LlState,
    /// LL rank mask (`true` = masked); local to this rank, survives `clean_low_latency_buffer`.
    pub(crate) mask: Vec<bool>,
    /// Shrink mode: an LL wait that times out masks the missing ranks instead of raising.
    pub(crate) shrink: bool,
    /// Per peer: `[waits, ns]` spent in host waits until that peer arrived (`wait_stats`).
    pub(crate) waits: Vec<[i64; 2]>,
    /// `ll_own_state`: the recv_state of a whole LL dispatch `[0]` and combine `[1]` given none.
    pub(crate) own_state: Box<[[i64; crate::backend::LL_STATE_LEN]; 2]>,
}

impl Drop for CpuBackend {
    /// Destroyed or poisoned alike: a buffer that handed out a zero-copy combine view keeps its
    /// mapping until the process exits (the view may outlive the buffer; torch's stable ABI
    /// before 2.11 has no tensor deleter to tell us when it dies). Others unmap at once.
    fn drop(&mut self) {
        if let (true, Some(seg)) = (self.views_out, self.seg.take()) {
            seg.keep_mapped_until_exit();
        }
    }
}

impl CpuBackend {
    /// A fresh rendezvous id: prefix + random name, zero-padded to [`crate::config::UNIQUE_ID_BYTES`].
    pub fn unique_id() -> Vec<u8> {
        rendezvous::make_unique_id("cpu")
    }

    /// Collective: every rank maps the same shared memory (`crate::shm::rendezvous::segment`) and
    /// checks that all ranks asked for the same buffer; a named file loses its name once every
    /// rank has it. Every wait is bounded by `DEEP_EP_TIMEOUT_MS`.
    pub fn create(a: &CreateArgs) -> Result<CpuBackend> {
        Self::create_with_timeout(a, crate::settings::timeout(crate::op_names::CREATE_BUFFER)?)
    }

    /// [`Self::create`] with the deadline of every wait given, not read from the environment
    /// (tests: a process-wide variable would change the deadline of every test running beside).
    pub fn create_with_timeout(a: &CreateArgs, timeout: Duration) -> Result<CpuBackend> {
        const OP: &str = crate::op_names::CREATE_BUFFER;
        crate::ensure!(a.num_ranks >= 1 && a.num_ranks <= MAX_RANKS, OP, "num_ranks must be in 1..={MAX_RANKS}, got {}", a.num_ranks);
        crate::ensure!(a.rank < a.num_ranks, OP, "rank {} out of range for {} ranks", a.rank, a.num_ranks);
        crate::ensure!(
            a.device == crate::tensor::Device::Cpu,
            OP,
            "the cpu backend works on CPU tensors; device {} needs the nccl backend",
            a.device
        );
        let name = rendezvous::name_from_id(OP, "cpu", a.unique_id)?;
        let ht_bytes = align_up(a.num_nvl_bytes, ALIGN);
        let ll_bytes = align_up(a.num_rdma_bytes, ALIGN);
        let region_bytes = ht_bytes + ll_bytes;
        let total = CONTROL_BYTES + a.num_ranks * region_bytes;
        let seg = rendezvous::segment(OP, &name, a.rank, a.num_ranks, total, timeout)?;
        let mut b = CpuBackend {
            info: BufferInfo::from_args(a, BackendKind::Cpu),
            seg: Some(seg),
            views_out: false,
            ht_bytes,
            ll_bytes,
            region_bytes,
            epoch: 0,
            timeout,
            ll: ll_state::LlState::default(),
            mask: vec![false; a.num_ranks],
            shrink: false,
            waits: vec![[0, 0]; a.num_ranks],
            own_state: Box::new([[0; crate::backend::LL_STATE_LEN]; 2]),
        };
        let record = [1u64, a.num_ranks as u64, a.num_nvl_bytes as u64, a.num_rdma_bytes as u64, a.low_latency_mode as u64];
        b.control().write(RECORD_OFF + a.rank * SLOT, &record);
        let barrier = b.barrier(OP, "rendezvous of all ranks");
        // Every rank has mapped the file once the rendezvous passed, so every rank removes the
        // name then (idempotent: the first one wins; a rank killed now leaves nothing behind);
        // after a failed rendezvous too, so a late rank cannot join a failed buffer.
        b.seg().unlink();
        barrier?;
        for peer in 0..a.num_ranks {
            let mut theirs = [0u64; 5];
            b.control().read(RECORD_OFF + peer * SLOT, &mut theirs);
            if theirs != record {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "rank {peer} created the buffer with (num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode) = {:?}, rank {} with {:?}",
                        &theirs[1..],
                        a.rank,
                        &record[1..]
                    ),
                ));
            }
        }
        // A rank that arrived and then died (killed while waiting) never confirms: creation
        // fails naming it, instead of returning a buffer with a dead peer.
        b.barrier(OP, "every rank confirmed the new buffer (a rank that died during creation never does)")?;
        Ok(b)
    }

    fn seg(&self) -> &Segment {
        self.seg.as_ref().expect("the segment lives until the backend is dropped")
    }

    fn control(&self) -> Region {
        self.seg().region(0, CONTROL_BYTES)
    }

    /// Rank `r`'s normal-mode area (`num_nvl_bytes`, page-aligned).
    pub(crate) fn ht_region(&self, r: usize) -> Region {
        self.seg().region(CONTROL_BYTES + r * self.region_bytes, self.ht_bytes)
    }

    /// Rank `r`'s low-latency area (`num_rdma_bytes`, page-aligned).
    pub(crate) fn ll_region(&self, r: usize) -> Region {
        self.seg().region(CONTROL_BYTES + r * self.region_bytes + self.ht_bytes, self.ll_bytes)
    }

    /// All ranks meet. On timeout the error names the ranks that never arrived.
    pub(crate) fn barrier(&mut self, op: &'static str, what: &str) -> Result<()> {
        self.barrier_among(op, what, false)
    }

    /// A barrier of the ranks not in `self.mask` when `masked_skip` (LL mode), else of all
    /// ranks. In shrink mode a masked barrier that times out masks the missing ranks and
    /// returns `Ok`. Each peer's arrival time is added to `wait_stats`.
    pub(crate) fn barrier_among(&mut self, op: &'static str, what: &str, masked_skip: bool) -> Result<()> {
        self.epoch += 1;
        let target = self.epoch;
        let ctrl = self.control();
        ctrl.atomic_u64(BARRIER_OFF + self.info.rank * SLOT).store(target, Ordering::Release);
        let n = self.info.num_ranks;
        let skip: Vec<bool> = (0..n).map(|p| masked_skip && self.mask[p]).collect();
        let me = self.info.rank;
        let arrived = |p: usize| skip[p] || ctrl.atomic_u64(BARRIER_OFF + p * SLOT).load(Ordering::Acquire) >= target;
        let start = std::time::Instant::now();
        let mut seen = vec![false; n];
        let waits = &mut self.waits;
        let res = shm::wait_until(self.timeout, || {
            for p in 0..n {
                if !seen[p] && !skip[p] && p != me && arrived(p) {
                    seen[p] = true;
                    waits[p][0] += 1;
                    waits[p][1] += start.elapsed().as_nanos() as i64;
                }
            }
            (0..n).all(arrived)
        });
        let Err(end) = res else { return Ok(()) };
        let peers: Vec<usize> = (0..n).filter(|&p| !arrived(p)).collect();
        if masked_skip && self.shrink && end == WaitEnd::TimedOut {
            crate::log_warn!(
                Some(self.info.rank),
                "{op}: ranks {peers:?} missed the barrier ({what}) within {} ms; shrink mode masks them",
                self.timeout.as_millis()
            );
            peers.iter().for_each(|&p| self.mask[p] = true);
            return Ok(());
        }
        Err(Error::wait_ended(end, op, self.info.rank, peers, self.timeout.as_millis() as u64, format!("barrier: {what}")))
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> &BufferInfo {
        &self.info
    }

    fn destroy(&mut self) -> Result<()> {
        // Local: unmapping our view leaves the file pages alive for peers still mapping them,
        // so no barrier is needed (and a destructor can never hang waiting for a peer).
        Ok(())
    }

    fn wait_stats(&mut self, reset: bool) -> Result<Vec<[i64; 2]>> {
        let out = self.waits.clone();
        if reset {
            self.waits.fill([0, 0]);
        }
        Ok(out)
    }

    /// This rank's HT area or LL area of the shared mapping (page-aligned; the part's exact
    /// size, not its page-rounded one). Not kept beyond the buffer: unlike a zero-copy combine
    /// view, a view of it must not be used after the buffer is destroyed (the mapping goes).
    fn local_region(&mut self, rdma: bool) -> Result<super::LocalRegion> {
        let me = self.info.rank;
        let (region, bytes) =
            if rdma { (self.ll_region(me), self.info.num_rdma_bytes) } else { (self.ht_region(me), self.info.num_nvl_bytes) };
        Ok(super::LocalRegion { ptr: region.ptr_at(0), bytes, device: self.info.device })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{LlRowsArgs, LowLatencyMode};
    use crate::tensor::{Device, TensorRef};

    fn args(id: &[u8], rank: usize, n: usize, nvl: usize) -> CreateArgs<'_> {
        CreateArgs {
            unique_id: id,
            rank,
            num_ranks: n,
            device: Device::Cpu,
            num_nvl_bytes: nvl,
            num_rdma_bytes: 0,
            low_latency_mode: false,
        }
    }

    #[test]
    fn mask_rows_keeps_rows_below_num_tokens_and_checks_the_range() {
        let id = CpuBackend::unique_id();
        let mut b = CpuBackend::create(&args(&id, 0, 1, 4096)).unwrap();
        let t = |v: &mut Vec<i32>, sizes: &[i64]| {
            let strides: Vec<i64> = if sizes.len() == 2 { vec![sizes[1], 1] } else { vec![1; sizes.len()] };
            TensorRef::new(v.as_mut_ptr() as *mut u8, crate::tensor::DType::Int32, Device::Cpu, sizes, &strides)
        };
        let (mut idx, mut out) = ((0..12).collect::<Vec<i32>>(), vec![7; 12]);
        for (n, want) in [(0, vec![-1; 12]), (2, vec![0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1, -1]), (4, (0..12).collect())] {
            let mut nt = vec![n];
            let a = LlRowsArgs { topk_idx: t(&mut idx, &[4, 3]), num_tokens: t(&mut nt, &[1]), out: t(&mut out, &[4, 3]) };
            b.ll_mask_rows("op", &a, std::ptr::null_mut()).unwrap();
            assert_eq!(out, want, "num_tokens = {n}");
        }
        for n in [-1, 5] {
            let mut nt = vec![n];
            let a = LlRowsArgs { topk_idx: t(&mut idx, &[4, 3]), num_tokens: t(&mut nt, &[]), out: t(&mut out, &[4, 3]) };
            let e = b.ll_mask_rows("op", &a, std::ptr::null_mut()).unwrap_err().to_string();
            assert!(e.contains(&format!("num_tokens must be in 0..=4 (the rows of x / topk_idx), got {n}")), "{e}");
        }
        b.destroy().unwrap();
    }

    #[test]
    fn ranks_as_threads_rendezvous_and_barrier() {
        let id = CpuBackend::unique_id();
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let id = id.clone();
                std::thread::spawn(move || {
                    let mut b = CpuBackend::create(&args(&id, r, 3, 1 << 16)).unwrap();
                    for _ in 0..50 {
                        b.barrier("test", "loop").unwrap();
                    }
                    b.destroy().unwrap();
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
    }

    /// Deadline of waits that must succeed: far beyond any scheduling delay of a loaded machine
    /// (a wait that succeeds returns as soon as the peers arrive, so it costs nothing).
    const NEVER: Duration = Duration::from_secs(120);
    /// Deadline of waits that must time out (only a rank that never comes is missing).
    const SHORT: Duration = Duration::from_millis(300);

    /// The barrier epoch rank `p` has published.
    fn epoch_of(b: &CpuBackend, p: usize) -> u64 {
        b.control().atomic_u64(BARRIER_OFF + p * SLOT).load(Ordering::Acquire)
    }

    #[test]
    fn masked_barriers_skip_a_dead_rank_and_shrink_mode_masks_it() {
        let id = CpuBackend::unique_id();
        let mut all: Vec<CpuBackend> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let id = id.clone();
                    s.spawn(move || CpuBackend::create_with_timeout(&args(&id, r, 3, 4096), NEVER).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let _dead = all.pop().unwrap(); // rank 2 never takes part again
                                        // Rank 1 enters every barrier that must time out first, and rank 0 only once rank 1 has
                                        // arrived: rank 0's short wait then misses rank 2 alone, however late either thread runs.
                                        // Rank 1 may see rank 0 late on a loaded machine, so only rank 0's verdicts are exact.
        type Outcome = (Result<()>, Result<()>, Result<()>, Vec<bool>, Vec<[i64; 2]>);
        let res: Vec<Outcome> = std::thread::scope(|s| {
            let hs: Vec<_> = all
                .iter_mut()
                .map(|b| {
                    s.spawn(move || {
                        let follow = |b: &CpuBackend| {
                            while b.info.rank == 0 && epoch_of(b, 1) <= b.epoch {
                                std::thread::yield_now();
                            }
                        };
                        b.wait_stats(true).unwrap(); // forget the rendezvous
                        b.ll_update_mask(2, true).unwrap();
                        b.timeout = NEVER; // rank 2 is masked: only live ranks are waited for
                        let masked = b.barrier_among("test", "masked", true);
                        b.timeout = SHORT;
                        follow(b);
                        let ht = b.barrier_among("test", "normal mode ignores the mask", false);
                        b.ll_clean_mask().unwrap();
                        b.ll_set_shrink(true).unwrap();
                        follow(b);
                        let shrink = b.barrier_among("test", "shrink", true);
                        (masked, ht, shrink, b.ll_mask(), b.wait_stats(true).unwrap())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (masked, ht, shrink, mask, waits)) in res.into_iter().enumerate() {
            assert!(masked.is_ok(), "{masked:?}");
            let e = ht.unwrap_err().to_string();
            assert!(e.contains(if rank == 0 { "waiting for rank(s) [2]" } else { "2]" }), "{e}");
            assert!(shrink.is_ok(), "{shrink:?}");
            assert!(mask[2], "shrink mode masks the rank that did not arrive: {mask:?}");
            assert!(waits[rank] == [0, 0] && waits[2][0] == 0, "{waits:?}");
            if rank == 0 {
                assert_eq!(mask, vec![false, false, true], "shrink mode masks only the rank that did not arrive");
                assert_eq!(waits[1][0], 3, "{waits:?}");
            }
        }
    }

    #[test]
    fn mismatched_sizes_are_reported_and_missing_rank_times_out() {
        let id = CpuBackend::unique_id();
        let id2 = id.clone();
        let t = std::thread::spawn(move || CpuBackend::create_with_timeout(&args(&id2, 1, 2, 1 << 13), NEVER).err().map(|e| e.to_string()));
        let e0 = CpuBackend::create_with_timeout(&args(&id, 0, 2, 1 << 12), NEVER).err().unwrap().to_string();
        let e1 = t.join().unwrap().unwrap();
        assert!(e0.contains("rank 1 created the buffer"), "{e0}");
        assert!(e1.contains("rank 0 created the buffer"), "{e1}");
        let id = CpuBackend::unique_id();
        let e = CpuBackend::create_with_timeout(&args(&id, 0, 2, 4096), SHORT).err().unwrap().to_string();
        assert!(e.contains("waiting for rank(s) [1]"), "{e}");
        assert!(CpuBackend::create(&args(b"nonsense", 0, 1, 0)).is_err());
    }
}
