//! One NVSHMEM symmetric allocation as the window of an intranode buffer: the same [`Ctx`]
//! (peer base pointers, control area, host-mapped status) the NCCL window gives the kernels, with
//! the peer pointers from `nvshmem_ptr` instead of `ncclGetPeerPointer`.
//!
//! Creation (collective): NVSHMEM environment defaults ([`env_defaults`]) → `nvshmemx_hostlib_init_attr`
//! with the buffer's unique id → check `my_pe`/`n_pes` → `nvshmem_malloc` → `nvshmem_ptr` of every
//! rank (null = not reachable by load/store: the backend is intranode only) → host-mapped status
//! block → control area zeroed → `nvshmem_barrier_all` as the host rendezvous.
//! [`Window::close`] meets the peers at the kernel barrier (bounded by the timeout), then
//! `nvshmem_free` and, by default, `nvshmemx_hostlib_finalize`.
//!
//! NVSHMEM is one instance per process, so this module keeps a process-wide [`Session`]: one
//! live window at a time; a later window must use the same rank, rank count and device (NVSHMEM
//! keeps its first bootstrap across finalize and re-init); a window dropped without the
//! collective close (a poisoned buffer) leaves NVSHMEM initialised and blocks new windows in the
//! process, since nothing can be freed or finalized without the peers.
//!
//! Environment: `DEEP_EP_NVSHMEM_FINALIZE` = `1` (default: finalize on close, initialise again at
//! the next create) or `0` (keep NVSHMEM initialised between buffers; the next create of the same
//! geometry allocates from it without initialising again). NVSHMEM's own variables: see
//! [`env_defaults`].

use super::peer_window::{PeerWindow, WindowArgs};
use crate::error::{Error, Result};
use crate::kernels::intranode::{self, Ctx, DeviceGuard, HostStatus, Stream, MAX_RANKS};
use crate::sys::nvshmem::{self, NvshmemLib};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Whether this library's NVSHMEM device state is registered with the initialised NVSHMEM
/// (kernels/nvshmem/transport.cu); cleared when NVSHMEM is finalised.
static DEVICE_STATE: AtomicBool = AtomicBool::new(false);

const OP: &str = crate::op_names::CREATE_BUFFER;
const DESTROY: &str = crate::op_names::DESTROY_BUFFER;
/// Window sizes are rounded up to this (as the NCCL window's).
/// Heap room beyond the window suggested for NVSHMEM's own symmetric objects (team sync arrays).
pub const HEAP_MARGIN: usize = 64 << 20;

/// Who a process's NVSHMEM was initialised for: `(rank, num_ranks, device)`.
pub type Geometry = (usize, usize, i32);

/// The process-wide NVSHMEM state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Session {
    /// Never initialised in this process.
    #[default]
    Fresh,
    /// No live window; NVSHMEM was bootstrapped for `geometry` and is still initialised or not.
    Idle { geometry: Geometry, initialised: bool },
    /// A window is live.
    Live { geometry: Geometry },
    /// A window was released without its collective close: NVSHMEM stays initialised with memory
    /// that only a collective call could free.
    Stuck { geometry: Geometry },
}

impl Session {
    /// Whether a window for `want` may be created now, and whether NVSHMEM must be initialised
    /// for it (`Ok(true)`) or is already (`Ok(false)`).
    pub fn admit(self, want: Geometry) -> Result<bool> {
        let show = |g: Geometry| format!("rank {} of {} on cuda:{}", g.0, g.1, g.2);
        match self {
            Session::Fresh => Ok(true),
            Session::Live { geometry } => Err(Error::invalid(
                OP,
                format!(
                    "this process already holds a live nvshmem buffer ({}); NVSHMEM is one instance per process, so an nvshmem \
                     buffer must be destroyed before the next is created (use backend=\"nccl\" for a second buffer)",
                    show(geometry)
                ),
            )),
            Session::Stuck { geometry } => Err(Error::invalid(
                OP,
                format!(
                    "an earlier nvshmem buffer of this process ({}) was released without meeting its peers (after a timeout or a \
                     failed creation), so NVSHMEM is still initialised and cannot be finalized; start a new process to use the \
                     nvshmem backend again (or use backend=\"nccl\")",
                    show(geometry)
                ),
            )),
            Session::Idle { geometry, initialised } if geometry != want => Err(Error::invalid(
                OP,
                format!(
                    "NVSHMEM was {} in this process for {}, and NVSHMEM keeps that bootstrap for the life of the process; this \
                     buffer asks for {} (use the same ranks and device, a new process, or backend=\"nccl\")",
                    if initialised { "initialised" } else { "first initialised" },
                    show(geometry),
                    show(want)
                ),
            )),
            Session::Idle { initialised, .. } => Ok(!initialised),
        }
    }
}

static SESSION: Mutex<Session> = Mutex::new(Session::Fresh);

fn session() -> std::sync::MutexGuard<'static, Session> {
    SESSION.lock().unwrap_or_else(|p| p.into_inner())
}

/// NVSHMEM variables set when the user has not set them, as `(name, value)`; `get` reads the
/// current environment:
/// - `NVSHMEM_DISABLE_NVLS=1`: no NVLink multicast objects (not used; unavailable on some systems).
/// - `NVSHMEM_REMOTE_TRANSPORT=none`: no network transport (the backend is intranode only, every
///   peer is reached through `nvshmem_ptr`).
///
/// NVSHMEM reads its options once per process, at the first `nvshmemx_get_uniqueid` (rank 0,
/// before the buffer size is known) or initialisation, so these are applied before both
/// ([`unique_id`], [`Window::create`]) and `NVSHMEM_SYMMETRIC_SIZE` is not derived from the buffer
/// (rank 0 would keep another heap size than its peers): it is the user's value on every rank,
/// else NVSHMEM's default (1 GiB).
pub fn env_defaults(get: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
    [("NVSHMEM_DISABLE_NVLS", "1"), ("NVSHMEM_REMOTE_TRANSPORT", "none")]
        .into_iter()
        .filter(|(k, _)| get(k).map_or(true, |s| s.trim().is_empty()))
        .map(|(k, v)| (k, v.to_string()))
        .collect()
}

fn apply_env_defaults() {
    for (k, v) in env_defaults(|k| std::env::var(k).ok()) {
        std::env::set_var(k, v);
    }
}

/// A fresh NVSHMEM unique id (rank 0 of a buffer; host only), after [`env_defaults`].
pub fn unique_id() -> Result<[u8; 128]> {
    let lib = nvshmem::library()?;
    apply_env_defaults();
    lib.unique_id()
}

/// Whether `DEEP_EP_NVSHMEM_FINALIZE` asks for finalize on close (default yes).
pub fn finalize_on_close(value: Option<&str>) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(Error::invalid(OP, format!("DEEP_EP_NVSHMEM_FINALIZE must be 0 or 1, got {other:?}"))),
    }
}

/// A symmetric NVSHMEM allocation with its control area and status block.
pub struct Window {
    lib: &'static NvshmemLib,
    device: i32,
    geometry: Geometry,
    mem: *mut std::ffi::c_void,
    pub(super) bytes: usize,
    pub(super) ctx: Ctx,
    pub(super) status: Option<HostStatus>,
    finalize: bool,
    /// Closed collectively (or never fully created, see `create`).
    closed: bool,
}

// SAFETY: the pointers are device addresses of NVSHMEM's heap, usable from any thread; a window is
// only used under its buffer's mutex.
unsafe impl Send for Window {}

impl Window {
    /// Collective over `num_ranks` processes (one per GPU, all reachable by load/store).
    pub fn create(a: &WindowArgs) -> Result<Window> {
        intranode::check_struct_sizes(OP)?;
        crate::ensure!(a.num_ranks >= 1 && a.num_ranks <= MAX_RANKS, OP, "internal: {} ranks", a.num_ranks);
        let finalize = finalize_on_close(std::env::var("DEEP_EP_NVSHMEM_FINALIZE").ok().as_deref())?;
        let lib = nvshmem::library()?;
        let geometry = (a.rank, a.num_ranks, a.device);
        let mut state = session();
        let must_init = state.admit(geometry)?;
        let _guard = DeviceGuard::new(OP, a.device)?;
        let bytes = super::peer_window::window_bytes(a.data_bytes);
        // From here until the window is complete a failure leaves NVSHMEM as it is (its
        // collective teardown could hang on peers that went on or failed elsewhere).
        *state = Session::Stuck { geometry };
        if must_init {
            apply_env_defaults();
            lib.init(a.unique_id, a.rank, a.num_ranks)?;
        }
        let mut w = Window {
            lib,
            device: a.device,
            geometry,
            mem: std::ptr::null_mut(),
            bytes,
            ctx: super::peer_window::new_ctx(a.rank, a.num_ranks, bytes, a.timeout_ns, intranode::sm_count(OP, a.device)?),
            status: None,
            finalize,
            closed: true, // Drop has nothing collective to skip until the window is complete
        };
        let (pe, npes) = lib.pe();
        if (pe, npes) != (a.rank as i32, a.num_ranks as i32) {
            return Err(Error::Device {
                op: OP,
                what: "NVSHMEM initialisation".into(),
                detail: format!("NVSHMEM placed rank {} of {} at PE {pe} of {npes}", a.rank, a.num_ranks),
            });
        }
        w.mem = lib.malloc(bytes);
        if w.mem.is_null() {
            return Err(Error::Device {
                op: OP,
                what: format!("nvshmem_malloc of {bytes} bytes"),
                detail: format!(
                    "the symmetric heap is too small (NVSHMEM_SYMMETRIC_SIZE={}); set NVSHMEM_SYMMETRIC_SIZE to at least {} \
                     on every rank before the process's first nvshmem buffer (NVSHMEM reads it once per process)",
                    std::env::var("NVSHMEM_SYMMETRIC_SIZE").unwrap_or_else(|_| "<unset: 1 GiB>".into()),
                    bytes + HEAP_MARGIN
                ),
            });
        }
        for p in 0..a.num_ranks {
            let ptr = lib.peer_ptr(w.mem, p);
            if ptr.is_null() {
                return Err(Error::NotImplemented {
                    op: OP,
                    backend: "nvshmem",
                    feature: "ranks that are not reachable by load/store over NVLink (nvshmem_ptr returned null: internode)",
                });
            }
            w.ctx.peer_base[p] = ptr;
        }
        let stream = Stream::new(OP)?;
        // SAFETY: `peer_base[rank]` is this PE's nvshmem_malloc allocation, of `window_bytes`.
        w.status = Some(unsafe { super::peer_window::attach_status_and_zero(OP, &mut w.ctx, &stream) }?);
        // Host rendezvous: no peer signals into a control area that is not zeroed yet.
        lib.barrier_all();
        w.closed = false;
        *state = Session::Live { geometry };
        drop(state);
        if let Some(stride) = a.transport_self_test {
            // SAFETY: launch contract: the ctx of this live window, zeroed and past the host rendezvous.
            unsafe { crate::kernels::transport::lsa_self_test_run(OP, &w.ctx, stride, a.timeout_ns, stream.raw()) }?;
            if crate::kernels::transport::NVSHMEM_DEVICE_BUILT {
                // The device state is registered on first use only, so a build whose NVSHMEM
                // transport is unused leaves NVSHMEM's initialisation as it was.
                if !DEVICE_STATE.load(Ordering::Acquire) {
                    lib.register_device_state(OP, true)?;
                    DEVICE_STATE.store(true, Ordering::Release);
                }
                // SAFETY: launch contract: the ctx of this live window, zeroed and past the host rendezvous.
                unsafe { crate::kernels::transport::nvshmem_self_test_run(OP, &w.ctx, w.mem, stride, a.timeout_ns, stream.raw()) }?;
            }
        }
        Ok(w)
    }

    /// Collective release: waits for the device, meets every peer at the kernel barrier (bounded
    /// by the timeout, so no peer still reads this window), then `nvshmem_free` and (unless
    /// `DEEP_EP_NVSHMEM_FINALIZE=0`) `nvshmemx_hostlib_finalize`. On a barrier timeout nothing
    /// collective runs and the timeout is returned (the process then cannot use NVSHMEM again).
    pub fn close(&mut self, timeout_ms: u64) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let _guard = DeviceGuard::new(DESTROY, self.device)?;
        // SAFETY: launch contract: the ctx of this live window; the barrier passes no other pointer.
        unsafe { crate::kernels::global_barrier::destroy_barrier(DESTROY, &self.ctx, self.status(), timeout_ms) }?;
        let mut state = session();
        // SAFETY: allocated by nvshmem_malloc in `create`, freed once (the pointer is cleared
        // below); the device is idle and every peer passed the barrier above.
        unsafe { self.lib.free(self.mem) };
        self.mem = std::ptr::null_mut();
        let mut unregistered = Ok(());
        if self.finalize {
            if DEVICE_STATE.swap(false, Ordering::AcqRel) {
                unregistered = self.lib.register_device_state(DESTROY, false);
            }
            self.lib.finalize();
        }
        self.closed = true;
        *state = Session::Idle { geometry: self.geometry, initialised: !self.finalize };
        unregistered
    }
}

impl Drop for Window {
    /// Local release (no peer involved): waits for queued kernels; the symmetric memory and
    /// NVSHMEM itself stay (both need the peers), and the process is marked [`Session::Stuck`].
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let _guard = DeviceGuard::new(DESTROY, self.device).ok();
        if let Err(e) = intranode::device_synchronize(DESTROY) {
            eprintln!("deep_ep: releasing an nvshmem buffer: {e}");
        }
        *session() = Session::Stuck { geometry: self.geometry };
    }
}

super::peer_window::forward_peer_window!(Window);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_admits_one_window_of_one_geometry() {
        let g = (1, 4, 1);
        assert!(Session::Fresh.admit(g).unwrap());
        assert!(Session::Idle { geometry: g, initialised: false }.admit(g).unwrap());
        assert!(!Session::Idle { geometry: g, initialised: true }.admit(g).unwrap());
        let e = Session::Live { geometry: g }.admit(g).unwrap_err().to_string();
        assert!(e.contains("already holds a live nvshmem buffer (rank 1 of 4 on cuda:1)") && e.contains("destroyed before"), "{e}");
        let e = Session::Stuck { geometry: g }.admit(g).unwrap_err().to_string();
        assert!(e.contains("released without meeting its peers") && e.contains("new process"), "{e}");
        let e = Session::Idle { geometry: g, initialised: false }.admit((0, 2, 0)).unwrap_err().to_string();
        assert!(e.contains("for rank 1 of 4 on cuda:1") && e.contains("asks for rank 0 of 2 on cuda:0"), "{e}");
    }

    #[test]
    fn env_defaults_fill_only_what_is_unset() {
        let d = env_defaults(|_| None);
        assert_eq!(d, vec![("NVSHMEM_DISABLE_NVLS", "1".to_string()), ("NVSHMEM_REMOTE_TRANSPORT", "none".to_string())]);
        let set = |k: &str| (k != "NVSHMEM_REMOTE_TRANSPORT").then(|| "0".to_string());
        assert_eq!(env_defaults(set), vec![("NVSHMEM_REMOTE_TRANSPORT", "none".to_string())]);
        // An empty value counts as unset.
        assert_eq!(env_defaults(|_| Some(" ".to_string())).len(), 2);
    }

    #[test]
    fn finalize_knob_parses() {
        assert!(finalize_on_close(None).unwrap());
        assert!(finalize_on_close(Some(" 1")).unwrap());
        assert!(!finalize_on_close(Some("0")).unwrap());
        let e = finalize_on_close(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("DEEP_EP_NVSHMEM_FINALIZE must be 0 or 1, got \"yes\""), "{e}");
    }
}
