//! The buffer registry: torch sees a buffer as a plain `int` handle; this maps it to its
//! backend. Handles are never reused, so a stale handle is reported as destroyed rather than
//! silently reaching another buffer.
//!
//! Two rules keep results right, and both are checked here, for every backend:
//! - One op at a time per buffer. Ops of one buffer pair up across ranks by their order, so two
//!   threads calling into the same buffer at once could take each other's rows: the second
//!   caller raises instead of waiting (serialise calls per buffer; separate buffers may run in
//!   parallel threads, as ranks-as-threads do).
//! - A buffer belongs to the process that created it. A forked child shares its parent's
//!   mappings but is not a rank of the buffer: every op there raises (create buffers after fork).

use crate::backend::{self, Backend, BackendKind, BufferInfo, CreateArgs};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

struct Entry {
    backend: Arc<Mutex<Box<dyn Backend>>>,
    /// The creating process (a forked child must not use the buffer).
    pid: u32,
    /// Fixed at creation: answered without taking the backend (another thread may be in an op).
    info: BufferInfo,
    /// Set when a collective failed half-way (timeout): ranks are out of step.
    poisoned: Arc<Mutex<Option<String>>>,
}

#[derive(Default)]
struct Registry {
    next: i64,
    live: HashMap<i64, Entry>,
    destroyed: Vec<i64>,
    /// Slot → handle ([`bind_slot`]).
    slots: HashMap<i64, i64>,
}

/// Largest slot number (slot handles are `-1 ..= -(MAX_SLOT + 1)`).
pub const MAX_SLOT: i64 = (1 << 20) - 1;

/// The handle that names slot `slot`: `-(slot + 1)`. Models scripted, exported or compiled with
/// it run in any process that bound one of its buffers to that slot ([`bind_slot`]).
pub fn slot_handle(slot: i64) -> i64 {
    -(slot + 1)
}

/// Binds `slot` of this process to buffer `handle` (local; replaces an earlier binding). Ops given
/// the slot handle `-(slot + 1)` then reach this buffer: a serialized model (TorchScript,
/// torch.export, AOTInductor) bakes in the slot handle, never a process-specific handle.
pub fn bind_slot(op: &'static str, handle: i64, slot: i64) -> Result<()> {
    crate::ensure!((0..=MAX_SLOT).contains(&slot), op, "slot must be in 0..={MAX_SLOT}, got {slot}");
    let mut r = lock(registry());
    let h = resolve(op, handle, &r)?;
    if !r.live.contains_key(&h) {
        return Err(missing(op, h, &r));
    }
    r.slots.insert(slot, h);
    Ok(())
}

/// A slot handle (negative) resolved to the buffer handle bound to it; other handles unchanged.
fn resolve(op: &'static str, handle: i64, r: &Registry) -> Result<i64> {
    if handle >= 0 {
        return Ok(handle);
    }
    let slot = -(handle + 1);
    r.slots.get(&slot).copied().ok_or_else(|| Error::BadHandle {
        op,
        msg: format!(
            "handle {handle} names slot {slot}, and no buffer of this process is bound to it: create the buffer, then \
             Buffer.bind_slot({slot}) (deep_ep::bind_buffer_slot) before running a model that uses the slot"
        ),
    })
}

/// This process's id without a system call per op (glibc no longer caches getpid, and a syscall
/// costs microseconds in some sandboxes): read once, and re-read in a forked child through an
/// atfork handler, so the owning-process check of every op stays exact.
fn current_pid() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static PID: AtomicU32 = AtomicU32::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    extern "C" fn forked_child() {
        PID.store(0, Ordering::Relaxed);
    }
    HOOK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry { next: 1, ..Default::default() }))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic inside a backend is caught at the FFI edge; the data stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates a buffer (collective) and returns its handle.
pub fn create(kind: BackendKind, args: &CreateArgs) -> Result<i64> {
    let b = backend::registry::create(kind, args).inspect_err(|e| {
        if e.poisons_buffer() {
            crate::log_warn!(Some(args.rank), "{e}");
        }
    })?;
    let mut r = lock(registry());
    let h = r.next;
    r.next += 1;
    let info = b.info().clone();
    r.live.insert(h, Entry { backend: Arc::new(Mutex::new(b)), pid: current_pid(), info, poisoned: Arc::new(Mutex::new(None)) });
    crate::log_info!(
        Some(args.rank),
        "created buffer {h}: backend {}, device {}, {} ranks, num_nvl_bytes {}, num_rdma_bytes {}, low_latency_mode {}",
        kind.name(),
        args.device,
        args.num_ranks,
        args.num_nvl_bytes,
        args.num_rdma_bytes,
        args.low_latency_mode
    );
    Ok(h)
}

/// A live buffer's backend and its poison note (set when a failure left it unusable).
type LiveBuffer = (Arc<Mutex<Box<dyn Backend>>>, Arc<Mutex<Option<String>>>);

/// The live entry `handle` (or the slot handle) names, with its resolved handle; a buffer of
/// another process (this one is a forked child) is refused.
fn owned_entry<'a>(op: &'static str, handle: i64, r: &'a Registry) -> Result<(i64, &'a Entry)> {
    let handle = resolve(op, handle, r)?;
    match r.live.get(&handle) {
        Some(e) if e.pid != current_pid() => Err(forked(op, handle, e.pid)),
        Some(e) => Ok((handle, e)),
        None => Err(missing(op, handle, r)),
    }
}

/// The resolved handle and its live buffer.
fn lookup(op: &'static str, handle: i64) -> Result<(i64, LiveBuffer)> {
    let r = lock(registry());
    let (h, e) = owned_entry(op, handle, &r)?;
    Ok((h, (e.backend.clone(), e.poisoned.clone())))
}

fn forked(op: &'static str, handle: i64, owner: u32) -> Error {
    Error::BadHandle {
        op,
        msg: format!(
            "buffer {handle} belongs to process {owner} and this is a forked child (process {}); a child cannot take part in its \
             parent's collectives: create its own buffers after the fork",
            std::process::id()
        ),
    }
}

fn missing(op: &'static str, handle: i64, r: &Registry) -> Error {
    if r.destroyed.contains(&handle) {
        Error::BadHandle { op, msg: format!("buffer handle {handle} was destroyed; create a new Buffer") }
    } else {
        Error::BadHandle { op, msg: format!("buffer handle {handle} does not exist (never created in this process)") }
    }
}

/// The buffer's backend, or an error when another thread is inside an op of the same buffer.
fn try_lock<'a>(op: &'static str, handle: i64, b: &'a Mutex<Box<dyn Backend>>) -> Result<std::sync::MutexGuard<'a, Box<dyn Backend>>> {
    match b.try_lock() {
        Ok(g) => Ok(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Ok(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => Err(Error::invalid(
            op,
            format!(
                "buffer {handle} is in use by another thread of this process; ops of one buffer pair up across ranks by their \
                 order, so they must not run concurrently: call them from one thread (or under one lock per buffer)"
            ),
        )),
    }
}

/// Runs `f` on the buffer's backend. A buffer whose earlier collective timed out refuses
/// further collectives until it is destroyed and created again.
pub fn with<R>(op: &'static str, handle: i64, f: impl FnOnce(&mut dyn Backend) -> Result<R>) -> Result<R> {
    let (_, (b, poisoned)) = lookup(op, handle)?;
    if let Some(why) = lock(&poisoned).as_ref() {
        let e = Error::BadHandle {
            op,
            msg: format!("buffer {handle} is unusable after an earlier failure ({why}); destroy it and create a new one"),
        };
        crate::log_warn!(b.try_lock().ok().map(|g| g.info().rank), "{e}");
        return Err(e);
    }
    let mut guard = try_lock(op, handle, &b)?;
    let rank = Some(guard.info().rank);
    crate::log_debug!(rank, "{op} on buffer {handle}");
    let res = f(guard.as_mut());
    if let Err(e) = &res {
        if e.poisons_buffer() {
            crate::log_warn!(rank, "{e}; buffer {handle} is now unusable (destroy it and create a new one)");
            *lock(&poisoned) = Some(e.to_string());
        }
    }
    res
}

/// Destroys the buffer (collective for healthy buffers; a poisoned buffer is released locally
/// without waiting for peers).
pub fn destroy(op: &'static str, handle: i64) -> Result<()> {
    let (handle, (b, poisoned)) = lookup(op, handle)?;
    let healthy = lock(&poisoned).is_none();
    let mut guard = try_lock(op, handle, &b)?;
    let rank = Some(guard.info().rank);
    let res = if healthy { guard.destroy() } else { Ok(()) };
    drop(guard);
    crate::log_info!(rank, "destroyed buffer {handle}{}", if healthy { "" } else { " (poisoned: released locally)" });
    let mut r = lock(registry());
    r.live.remove(&handle);
    r.destroyed.push(handle);
    r.slots.retain(|_, h| *h != handle);
    res
}

/// The buffer's fixed facts (local; never waits for an op in another thread).
pub fn info(op: &'static str, handle: i64) -> Result<BufferInfo> {
    owned_entry(op, handle, &lock(registry())).map(|(_, e)| e.info.clone())
}

/// Number of live buffers in this process (diagnostics and leak tests).
pub fn live_count() -> usize {
    lock(registry()).live.len()
}
