//! CUDA-IPC memory as the window of an intranode buffer (backend `ipc`): the same [`Ctx`] (peer
//! base pointers, control area, host-mapped status) the NCCL and NVSHMEM windows give the
//! kernels, with no NCCL or NVSHMEM call at all. It works with any NCCL (or none) and lets
//! several processes share one GPU, which NCCL refuses (development and testing on one GPU).
//!
//! Creation (collective): `cudaMalloc` of the window → `cudaIpcGetMemHandle` → host-mapped status
//! block → window zeroed → every rank publishes (handle, pointer, size, process token, verdict) in
//! a small shared-memory file named by the unique id ([`Rendezvous`], the same folder and naming
//! rules as the cpu backend's buffers) → host barrier → every rank removes the file name →
//! `cudaIpcOpenMemHandle` of every peer of another process (a peer thread of this process: its
//! pointer as is) → a second barrier where every rank confirms. A rank that fails any step
//! publishes that, so its peers fail at once naming it instead of waiting for the deadline.
//!
//! [`Window::close`]: the kernel barrier of all ranks (bounded by the timeout), then every rank
//! closes what it opened, meets the others once more on the host, and only then frees its own
//! memory, so no peer still maps memory that is freed. Dropping an unclosed window (a poisoned
//! buffer) closes and frees locally.
//!
//! Several ranks on one GPU: kernels of different processes time-slice unless MPS runs, so a
//! barrier round trip costs milliseconds (docs/BACKENDS.md, "Several ranks on one GPU"); every wait
//! is still bounded by `DEEP_EP_TIMEOUT_MS`.

use super::peer_window::{PeerWindow, WindowArgs};
use crate::error::{Error, Result};
use crate::kernels::intranode::{self, Ctx, DeviceGuard, HostStatus, Stream};
use crate::kernels::layout::check;
use crate::kernels::transport::MAX_LSA_PEERS;
use crate::shm::rendezvous;
use crate::shm::{self, Region, Segment};
use crate::sys::kernels::*;
use crate::window::lsa_team::PeerMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::Duration;

const OP: &str = crate::op_names::CREATE_BUFFER;
const DESTROY: &str = crate::op_names::DESTROY_BUFFER;
/// Window sizes are rounded up to this (as the NCCL window's).
/// `cudaIpcMemHandle_t` bytes (`DEK_IPC_HANDLE_BYTES`).
pub const HANDLE_BYTES: usize = 64;
/// Bytes of one rank's record in the rendezvous file.
const SLOT: usize = 256;

/// Word indices of a rank's record (u64 words; the handle from word 8).
mod word {
    pub const EPOCH: usize = 0;
    pub const TOKEN: usize = 1;
    pub const PTR: usize = 2;
    pub const BYTES: usize = 3;
    pub const VERDICT: usize = 4;
    pub const DEVICE: usize = 5;
    pub const PID: usize = 6;
    pub const GPU: usize = 7;
    pub const HANDLE: usize = 8;
}

/// What a rank publishes as its verdict on a step of creation.
const OK: u64 = 1;
const FAILED: u64 = 2;

/// A fresh unique id: prefix + random name, zero-padded to 128 bytes (host only, no GPU needed).
pub fn unique_id() -> Vec<u8> {
    rendezvous::make_unique_id("ipc")
}

/// A random token of this process: equal tokens = ranks in one process (threads), whose
/// allocations cannot be opened through IPC (and need not be). Pids alone can repeat across
/// containers sharing a GPU.
fn process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| (rendezvous::random_u128() as u64) | 1)
}

fn name_from_id(id: &[u8]) -> Result<String> {
    rendezvous::name_from_id(OP, "ipc", id)
}

/// The host side of the buffer's rendezvous: one record per rank in shared memory
/// (`shm::rendezvous::segment`: anonymous by default) and a barrier over their epoch words, every wait bounded
/// by the timeout and naming the missing ranks.
pub struct Rendezvous {
    seg: Segment,
    rank: usize,
    num_ranks: usize,
    epoch: u64,
    timeout: Duration,
}

impl Rendezvous {
    fn open(unique_id: &[u8], rank: usize, num_ranks: usize, timeout: Duration) -> Result<Rendezvous> {
        let seg = rendezvous::segment(OP, &name_from_id(unique_id)?, rank, num_ranks, SLOT * MAX_LSA_PEERS, timeout)?;
        Ok(Rendezvous { seg, rank, num_ranks, epoch: 0, timeout })
    }

    fn slot(&self, r: usize) -> Region {
        self.seg.region(r * SLOT, SLOT)
    }

    fn get(&self, r: usize, w: usize) -> u64 {
        self.slot(r).atomic_u64(w * 8).load(Ordering::Acquire)
    }

    fn set(&self, w: usize, v: u64) {
        self.slot(self.rank).atomic_u64(w * 8).store(v, Ordering::Release)
    }

    /// All ranks meet (`what` names the step in a timeout).
    fn barrier(&mut self, op: &'static str, what: &str) -> Result<()> {
        self.epoch += 1;
        let target = self.epoch;
        self.set(word::EPOCH, target);
        let arrived = |p: usize| self.get(p, word::EPOCH) >= target;
        let Err(end) = shm::wait_until(self.timeout, || (0..self.num_ranks).all(arrived)) else { return Ok(()) };
        let peers = (0..self.num_ranks).filter(|&p| !arrived(p)).collect();
        Err(Error::wait_ended(end, op, self.rank, peers, self.timeout.as_millis() as u64, format!("barrier: {what}")))
    }

    /// Publishes this rank's verdict on a step, meets the others, and fails (naming them) when a
    /// rank failed it; `mine` is this rank's own result, raised as is.
    fn agree<T>(&mut self, what: &str, mine: Result<T>) -> Result<T> {
        self.set(word::VERDICT, if mine.is_ok() { OK } else { FAILED });
        let met = self.barrier(OP, what);
        let mine = mine?;
        met?;
        let failed: Vec<usize> = (0..self.num_ranks).filter(|&p| self.get(p, word::VERDICT) != OK).collect();
        crate::ensure!(failed.is_empty(), OP, "rank(s) {failed:?} failed {what} (their own error says why)");
        Ok(mine)
    }
}

/// One rank's window memory, the peers' windows it opened, and the rendezvous kept for the close.
pub struct Window {
    device: i32,
    mem: *mut c_void,
    /// Peer windows opened through IPC (closed at release); peers of this process are not here.
    opened: Vec<*mut c_void>,
    pub(super) bytes: usize,
    pub(super) ctx: Ctx,
    pub(super) lsa_base: Vec<*mut c_void>,
    pub(super) status: Option<HostStatus>,
    rdv: Rendezvous,
    closed: bool,
    /// Never free `mem` (a zero-copy view of it was handed out; `PeerWindow::keep_memory`).
    keep_mem: bool,
    /// Ranks of the buffer on this rank's GPU, this one included.
    ranks_on_gpu: usize,
}

// SAFETY: device pointers and the mapping are process-wide; the backend owning the window is used
// under the buffer's lock.
unsafe impl Send for Window {}

impl Window {
    /// Collective over `num_ranks` processes or threads of one machine (see the module doc).
    pub fn create(a: &WindowArgs) -> Result<Window> {
        intranode::check_struct_sizes(OP)?;
        // One machine: as many ranks as the LSA emulation reaches (every window is addressable).
        crate::ensure!(
            a.num_ranks >= 1 && a.num_ranks <= MAX_LSA_PEERS,
            OP,
            "{} ranks: the ipc provider takes at most {MAX_LSA_PEERS}",
            a.num_ranks
        );
        let timeout = Duration::from_nanos(a.timeout_ns);
        let rdv = Rendezvous::open(a.unique_id, a.rank, a.num_ranks, timeout)?;
        let bytes = super::peer_window::window_bytes(a.data_bytes);
        let _guard = DeviceGuard::new(OP, a.device)?;
        let mut w = Window {
            device: a.device,
            mem: std::ptr::null_mut(),
            opened: Vec::new(),
            bytes,
            ctx: super::peer_window::new_ctx(a.rank, a.num_ranks, bytes, a.timeout_ns, 0),
            lsa_base: Vec::new(),
            status: None,
            rdv,
            closed: false,
            keep_mem: false,
            ranks_on_gpu: 1,
        };
        let own = w.make_own(a);
        let handle = w.rdv.agree("to allocate its window", own);
        // Every rank mapped the memory by now (or gave up): a named file's name can go.
        w.rdv.seg.unlink();
        handle?;
        let ptrs = w.open_peers(a);
        let ptrs = w.rdv.agree("to open its peers' windows through CUDA IPC", ptrs)?;
        // Ranks sharing this GPU: kernels whose blocks wait for another rank's blocks must all be
        // resident at once, which under MPS means side by side on the SMs: each rank's grids get
        // its share (the work split does not depend on it, so results stay bit-exact).
        let gpu = w.rdv.get(a.rank, word::GPU);
        let sharing = (0..a.num_ranks).filter(|&p| w.rdv.get(p, word::GPU) == gpu).count();
        w.ctx.num_sms = (w.ctx.num_sms / sharing as i32).max(1);
        w.ranks_on_gpu = sharing;
        let map = PeerMap::new(OP, a.rank, a.num_ranks, a.nvl_domain, a.num_ranks, a.rank, false)?;
        (w.ctx.peer_base, w.lsa_base) = map.spread(&ptrs);
        w.ctx.nvl_ranks = map.ctx_nvl_ranks as i32;
        w.ctx.nvl_first = map.ctx_first() as i32;
        if let Some(stride) = a.transport_self_test {
            let full = Ctx { peer_base: super::lsa_team::whole_buffer_ctx_bases(OP, &w.lsa_base)?, nvl_ranks: 0, nvl_first: 0, ..w.ctx };
            let stream = Stream::new(OP)?;
            // SAFETY: launch contract: the ctx of this live window, zeroed and past the host rendezvous.
            unsafe { crate::kernels::transport::lsa_self_test_run(OP, &full, stride, a.timeout_ns, stream.raw()) }?;
        }
        Ok(w)
    }

    /// Allocates, zeroes and publishes this rank's window (before the first barrier, so no peer
    /// signals into memory that is not zeroed yet).
    fn make_own(&mut self, a: &WindowArgs) -> Result<()> {
        self.ctx.num_sms = intranode::sm_count(OP, a.device)?;
        // SAFETY: writes one pointer; `bytes` of device memory owned by this window from here.
        check(unsafe { dek_cuda_malloc(&mut self.mem, self.bytes) }, OP, "cudaMalloc").map_err(|e| {
            Error::invalid(
                OP,
                format!(
                    "cannot allocate {} bytes ({:.2} GiB) of GPU memory for the buffer's window on cuda:{} ({e}); ask for fewer \
                     num_nvl_bytes / num_rdma_bytes or free GPU memory",
                    self.bytes,
                    self.bytes as f64 / (1u64 << 30) as f64,
                    a.device
                ),
            )
        })?;
        let mut handle = [0u8; HANDLE_BYTES];
        // SAFETY: writes HANDLE_BYTES bytes; `mem` is a live cudaMalloc allocation.
        check(unsafe { dek_cuda_ipc_get_handle(handle.as_mut_ptr().cast(), self.mem) }, OP, "cudaIpcGetMemHandle")?;
        self.ctx.peer_base[a.rank % intranode::MAX_RANKS] = self.mem; // own_base(): slot rank % 8
        let stream = Stream::new(OP)?;
        // SAFETY: `own_base()` is the cudaMalloc allocation just made, of `window_bytes`.
        self.status = Some(unsafe { super::peer_window::attach_status_and_zero(OP, &mut self.ctx, &stream) }?);
        let r = &self.rdv;
        r.set(word::TOKEN, process_token());
        r.set(word::PTR, self.mem as u64);
        r.set(word::BYTES, self.bytes as u64);
        r.set(word::DEVICE, a.device as u64);
        r.set(word::PID, std::process::id() as u64);
        let mut gpu = 0u64;
        // SAFETY: writes one u64.
        check(unsafe { dek_cuda_pci_id(a.device, &mut gpu) }, OP, "cudaDeviceGetAttribute(PCI id)")?;
        r.set(word::GPU, gpu);
        r.slot(a.rank).write(word::HANDLE * 8, &handle);
        Ok(())
    }

    /// Every rank's window pointer in this process: opened through IPC for ranks of another
    /// process, as published for ranks of this one.
    fn open_peers(&mut self, a: &WindowArgs) -> Result<Vec<*mut c_void>> {
        let mut ptrs = vec![std::ptr::null_mut(); a.num_ranks];
        for (p, out) in ptrs.iter_mut().enumerate() {
            let theirs = self.rdv.get(p, word::BYTES) as usize;
            crate::ensure!(
                theirs == self.bytes,
                OP,
                "rank {p} made a window of {theirs} bytes, rank {} one of {} (every rank must create the buffer with the same sizes and mode)",
                a.rank,
                self.bytes
            );
            if p == a.rank || self.rdv.get(p, word::TOKEN) == process_token() {
                *out = self.rdv.get(p, word::PTR) as *mut c_void;
                continue;
            }
            let mut handle = [0u8; HANDLE_BYTES];
            self.rdv.slot(p).read(word::HANDLE * 8, &mut handle);
            let mut ptr = std::ptr::null_mut();
            // SAFETY: `handle` is a peer's cudaIpcMemHandle_t; writes one pointer.
            let st = unsafe { dek_cuda_ipc_open(&mut ptr, handle.as_ptr().cast()) };
            check(st, OP, &format!("cudaIpcOpenMemHandle of rank {p}'s window (process {} on its cuda:{})", self.rdv.get(p, word::PID), self.rdv.get(p, word::DEVICE)))
                .map_err(|e| Error::invalid(OP, format!("{e}; the ipc backend needs CUDA IPC between the ranks' processes and peer access between their GPUs (same machine, same container or a shared IPC namespace)")))?;
            self.opened.push(ptr);
            *out = ptr;
        }
        Ok(ptrs)
    }

    /// Ranks of the buffer on this rank's GPU, this one included (`ctx().num_sms` is its share).
    pub fn ranks_on_gpu(&self) -> usize {
        self.ranks_on_gpu
    }

    /// Collective release: kernel barrier of all ranks, close the opened peers, meet on the host,
    /// free the own memory.
    pub fn close(&mut self, timeout_ms: u64) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let _guard = DeviceGuard::new(DESTROY, self.device)?;
        // SAFETY: launch contract: the ctx of this live window; the barrier passes no other pointer.
        unsafe { crate::kernels::global_barrier::destroy_barrier(DESTROY, &self.ctx, self.status(), timeout_ms) }?;
        self.closed = true;
        let closed = self.close_opened();
        let met = self.rdv.barrier(DESTROY, "every rank closed its mappings of the peers' windows");
        let freed = self.free_own();
        closed.and(met).and(freed)
    }

    fn close_opened(&mut self) -> Result<()> {
        let mut first = Ok(());
        for p in self.opened.drain(..) {
            // SAFETY: opened by cudaIpcOpenMemHandle in `open_peers`, closed once.
            let r = check(unsafe { dek_cuda_ipc_close(p) }, DESTROY, "cudaIpcCloseMemHandle");
            first = first.and(r);
        }
        first
    }

    /// See `PeerWindow::keep_memory`.
    pub fn keep_memory(&mut self) {
        self.keep_mem = true;
    }

    fn free_own(&mut self) -> Result<()> {
        let mem = std::mem::replace(&mut self.mem, std::ptr::null_mut());
        if mem.is_null() || self.keep_mem {
            return Ok(());
        }
        // SAFETY: allocated by cudaMalloc in `make_own`, freed once.
        check(unsafe { dek_cuda_free(mem) }, DESTROY, "cudaFree of the window")
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if self.closed || (self.mem.is_null() && self.opened.is_empty()) {
            return;
        }
        let _guard = DeviceGuard::new(DESTROY, self.device).ok();
        if let Err(e) = intranode::device_synchronize(DESTROY) {
            eprintln!("deep_ep: releasing an ipc buffer: {e}");
        }
        if let Err(e) = self.close_opened().and(self.free_own()) {
            eprintln!("deep_ep: releasing an ipc buffer: {e}");
        }
    }
}

super::peer_window::forward_peer_window!(Window, keep_memory() -> (), lsa_bases() -> Vec<*mut std::ffi::c_void>, ranks_on_gpu() -> usize);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_name_distinct_rendezvous() {
        let (a, b) = (unique_id(), unique_id());
        assert_eq!(a.len(), crate::config::UNIQUE_ID_BYTES);
        assert_ne!(a, b);
        let n = name_from_id(&a).unwrap();
        assert!(n.starts_with("ipc_") && n != name_from_id(&b).unwrap(), "{n}");
        let e = name_from_id(&rendezvous::make_unique_id("cpu")).unwrap_err().to_string();
        assert!(e.contains("unique_id was not made by get_unique_id('ipc')"), "{e}");
    }

    #[test]
    fn the_rendezvous_names_the_rank_that_failed_a_step() {
        let id = unique_id();
        let t = Duration::from_secs(120); // never reached: every wait here ends when the peer answers
        let peer = std::thread::spawn({
            let id = id.clone();
            move || {
                let mut r = Rendezvous::open(&id, 1, 2, t).unwrap();
                r.agree("to allocate its window", Ok(())).map_err(|e| e.to_string())
            }
        });
        let mut r0 = Rendezvous::open(&id, 0, 2, t).unwrap();
        let e = r0.agree::<()>("to allocate its window", Err(Error::invalid(OP, "no memory"))).unwrap_err().to_string();
        assert!(e.contains("no memory"), "{e}");
        let e1 = peer.join().unwrap().unwrap_err();
        assert!(e1.contains("rank(s) [0] failed to allocate its window"), "{e1}");
    }

    #[test]
    fn the_rendezvous_names_the_rank_that_never_came() {
        let id = unique_id();
        let t = Duration::from_millis(300);
        let came = std::thread::spawn({
            let id = id.clone();
            move || Rendezvous::open(&id, 1, 3, t).and_then(|mut r| r.barrier(OP, "to allocate its window")).map_err(|e| e.to_string())
        });
        // Rank 2 never comes: rank 0 names it while handing out the memory, rank 1 (served) names
        // it at the first barrier, with rank 0, which gave up. On a loaded machine rank 1 may come
        // after rank 0 gave up: rank 0 then names it too, and rank 1 names rank 0.
        let e0 = Rendezvous::open(&id, 0, 3, t).err().expect("rank 2 never came").to_string();
        assert!((e0.contains("[2]") || e0.contains("[1, 2]")) && e0.contains("handing the buffer memory"), "{e0}");
        let e1 = came.join().unwrap().unwrap_err();
        let served = e1.contains("[0, 2]") && e1.contains("to allocate its window");
        assert!(served || (e1.contains("[0]") && e1.contains("receiving the buffer memory from rank 0")), "{e1}");
    }
}
