//! Shared memory of the ranks of one machine, below every user of it (the CPU backend's
//! buffers, the ipc window provider's host rendezvous): mappings ([`Segment`], bounds-checked
//! [`Region`]s), bounded host waits ([`wait_until`]) and, in [`rendezvous`], how ranks find
//! one buffer's memory (unique ids, rank 0's memfd over a Unix socket, or named files). This
//! module and `rendezvous.rs` hold all of that `unsafe`: mapping, descriptor passing, raw
//! copies and atomics at offsets. Everything above uses bounds-checked [`Region`]s.

pub mod rendezvous;

use crate::error::{Error, Result};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use crate::tensor_host::Pod;

/// A mapping of a buffer's shared memory. Unmapped on drop. Named files (`DEEP_EP_SHM_DIR`)
/// are unlinked as soon as every rank has mapped them; anonymous memory has no name at all.
pub struct Segment {
    /// The buffer's first byte (past the file header of a named file).
    ptr: *mut u8,
    /// The buffer's bytes.
    len: usize,
    /// Bytes mapped before `ptr`: [`FILE_HEADER`] for a named file, else 0.
    head: usize,
    /// The file's path (named files only).
    path: Option<String>,
}

/// First bytes of every named shared-memory file the library makes: what tells its own files
/// from anyone else's when stale ones are removed (`rendezvous::remove_stale_files`).
const FILE_MAGIC: &[u8; 16] = b"deep_ep shm v1\n\0";
/// Bytes before the buffer in a named file: the magic, in a page of its own so that the buffer
/// stays page-aligned.
const FILE_HEADER: usize = 4096;

/// Whether `path` is a regular file (not followed through a link) that starts with the
/// library's magic. Never blocks (a FIFO is opened non-blocking) and never errs: false instead.
pub fn is_own_file(path: &std::path::Path) -> bool {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut f) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path) else {
        return false;
    };
    let mut head = [0u8; FILE_MAGIC.len()];
    f.metadata().is_ok_and(|m| m.is_file()) && f.read_exact(&mut head).is_ok() && &head == FILE_MAGIC
}

/// Maps `len` bytes of the shared-memory descriptor `fd` (`what` names it in errors).
pub fn map_fd(op: &'static str, fd: &std::os::fd::OwnedFd, len: usize, what: &str) -> Result<Segment> {
    use std::os::fd::AsRawFd;
    crate::ensure!(len > 0, op, "internal: {what} of 0 bytes");
    // SAFETY: valid descriptor; the result is checked.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if ptr == libc::MAP_FAILED {
        return Err(os_err(op, format!("mmap {len} bytes of {what}")));
    }
    Ok(Segment { ptr: ptr as *mut u8, len, head: 0, path: None })
}

// The mapping is process-wide memory; access is coordinated by the backend's protocol.
unsafe impl Send for Segment {}

/// What to say when the shared-memory folder cannot hold a buffer.
fn shm_full_message(path: &str, len: usize) -> String {
    let dir = std::path::Path::new(path).parent().map_or_else(|| ".".to_string(), |d| d.display().to_string());
    format!(
        "cannot reserve {len} bytes ({:.1} MiB) for the buffer in the shared-memory folder {dir} (file {path}); free space \
         there, make it larger (docker run --shm-size=...) or set DEEP_EP_SHM_DIR to a folder with room",
        len as f64 / (1u64 << 20) as f64
    )
}

fn os_err(op: &'static str, what: String) -> Error {
    Error::Os { op, what, source: std::io::Error::last_os_error() }
}

impl Segment {
    /// Opens (creating if needed) the file `path` and maps `len` bytes of it, all reserved now,
    /// after a header that marks the file as the library's ([`is_own_file`]). Every rank calls
    /// this with the same `len`.
    pub fn open(op: &'static str, path: &str, len: usize) -> Result<Segment> {
        let cpath = CString::new(path).map_err(|_| Error::invalid(op, "shared-memory path contains NUL"))?;
        let total = len + FILE_HEADER;
        // SAFETY: plain libc calls on a NUL-terminated path; every result is checked.
        unsafe {
            let fd = libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600);
            if fd < 0 {
                return Err(os_err(op, format!("open {path}")));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                libc::close(fd);
                return Err(os_err(op, format!("fstat {path}")));
            }
            // Grow only: a concurrent rank may have sized it already (same len by contract).
            if (st.st_size as usize) < total && libc::ftruncate(fd, total as libc::off_t) != 0 {
                let e = os_err(op, format!("ftruncate {path} to {total} bytes"));
                libc::close(fd);
                libc::unlink(cpath.as_ptr()); // the buffer cannot be made: leave no file behind
                return Err(e);
            }
            // Reserve every page now: a sparse file on a filesystem too small for it (Docker's
            // 64 MB /dev/shm) would otherwise raise SIGBUS in every rank at the first large op.
            let rc = libc::posix_fallocate(fd, 0, total as libc::off_t);
            if rc != 0 {
                libc::close(fd);
                libc::unlink(cpath.as_ptr());
                return Err(Error::Os { op, what: shm_full_message(path, len), source: std::io::Error::from_raw_os_error(rc) });
            }
            // Every rank writes the same bytes: which one comes first does not matter.
            let wrote = libc::pwrite(fd, FILE_MAGIC.as_ptr() as *const libc::c_void, FILE_MAGIC.len(), 0);
            if wrote != FILE_MAGIC.len() as isize {
                let e = os_err(op, format!("write the header of {path}"));
                libc::close(fd);
                libc::unlink(cpath.as_ptr());
                return Err(e);
            }
            let ptr = libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            if ptr == libc::MAP_FAILED {
                let e = os_err(op, format!("mmap {total} bytes of {path}"));
                libc::unlink(cpath.as_ptr()); // the buffer cannot be made: leave no file behind
                return Err(e);
            }
            Ok(Segment { ptr: (ptr as *mut u8).add(FILE_HEADER), len, head: FILE_HEADER, path: Some(path.to_string()) })
        }
    }

    /// Keeps this mapping for the rest of the process instead of unmapping it: torch tensors
    /// that alias it (the zero-copy combine view) may outlive their buffer, and reading them
    /// must not fault. The file name is gone already, so nothing is left behind at exit.
    pub fn keep_mapped_until_exit(self) {
        std::mem::forget(self);
    }

    /// Removes the file name, if any (the mapping stays valid for every process that has it).
    pub fn unlink(&self) {
        if let Some(c) = self.path.as_deref().and_then(|p| CString::new(p).ok()) {
            // SAFETY: NUL-terminated path; failure (already unlinked) is harmless.
            unsafe { libc::unlink(c.as_ptr()) };
        }
    }

    /// Total mapped bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a created buffer).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A bounds-checked window `[offset, offset + len)` of the mapping.
    pub fn region(&self, offset: usize, len: usize) -> Region {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "region {offset}+{len} outside segment of {}", self.len);
        // SAFETY: in bounds of the live mapping (checked above).
        Region { ptr: unsafe { self.ptr.add(offset) }, len }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: ptr - head and len + head are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr.sub(self.head) as *mut libc::c_void, self.len + self.head) };
    }
}

/// A window of shared memory. Copies in and out are bounds-checked; concurrent access to the
/// same bytes is excluded by the backend's protocol (barriers and flags), not by the type.
#[derive(Copy, Clone)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-window.
    pub fn sub(&self, offset: usize, len: usize) -> Region {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "sub-region {offset}+{len} outside region of {}", self.len);
        // SAFETY: in bounds (checked above).
        Region { ptr: unsafe { self.ptr.add(offset) }, len }
    }

    /// Copies `src` to byte `offset`.
    pub fn write<T: Pod>(&self, offset: usize, src: &[T]) {
        let bytes = std::mem::size_of_val(src);
        assert!(offset.checked_add(bytes).is_some_and(|e| e <= self.len), "write {offset}+{bytes} outside region of {}", self.len);
        // SAFETY: bounds checked; src is a valid slice; T is plain data.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, self.ptr.add(offset), bytes) };
    }

    /// Copies from byte `offset` into `dst`.
    pub fn read<T: Pod>(&self, offset: usize, dst: &mut [T]) {
        let bytes = std::mem::size_of_val(dst);
        assert!(offset.checked_add(bytes).is_some_and(|e| e <= self.len), "read {offset}+{bytes} outside region of {}", self.len);
        // SAFETY: bounds checked; dst is a valid slice; T is plain data.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr() as *mut u8, bytes) };
    }

    /// Views `count` elements of `T` at byte `offset`. Only for data no peer writes until the
    /// next barrier (the protocol guarantees it).
    pub fn slice<T: Pod>(&self, offset: usize, count: usize) -> &[T] {
        let bytes = count * std::mem::size_of::<T>();
        assert!(offset.checked_add(bytes).is_some_and(|e| e <= self.len), "slice {offset}+{bytes} outside region of {}", self.len);
        assert!((self.ptr as usize + offset) % std::mem::align_of::<T>() == 0, "misaligned slice at {offset}");
        // SAFETY: bounds and alignment checked; the protocol keeps writers away meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset) as *const T, count) }
    }

    /// Mutable view of `count` elements of `T` at byte `offset`, for data only this rank writes.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut<T: Pod>(&self, offset: usize, count: usize) -> &mut [T] {
        let bytes = count * std::mem::size_of::<T>();
        assert!(offset.checked_add(bytes).is_some_and(|e| e <= self.len), "slice_mut {offset}+{bytes} outside region of {}", self.len);
        assert!((self.ptr as usize + offset) % std::mem::align_of::<T>() == 0, "misaligned slice at {offset}");
        // SAFETY: bounds and alignment checked; the protocol gives this rank sole access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset) as *mut T, count) }
    }

    /// The 8-byte-aligned atomic word at byte `offset`.
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        assert!(offset + 8 <= self.len && (self.ptr as usize + offset) % 8 == 0, "bad atomic offset {offset}");
        // SAFETY: in bounds, aligned, and shared memory is valid for atomics across processes.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
    }

    /// Raw pointer to byte `offset` (for tensors that view the buffer, e.g. zero-copy combine).
    pub fn ptr_at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len);
        // SAFETY: in bounds.
        unsafe { self.ptr.add(offset) }
    }
}

/// Spins, then yields, then sleeps: ranks may outnumber cores, so a waiter must give the CPU
/// to the rank it waits for.
pub struct Backoff {
    spins: u32,
    start: Instant,
    deadline: Duration,
}

impl Backoff {
    /// A waiter that gives up after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Backoff { spins: 0, start: Instant::now(), deadline: timeout }
    }

    /// Waits a little; returns false once the deadline has passed.
    pub fn snooze(&mut self) -> bool {
        self.spins += 1;
        if self.spins < 64 {
            std::hint::spin_loop();
        } else if self.spins < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        // Checking the clock every call is cheap next to a yield or sleep.
        self.start.elapsed() < self.deadline
    }

    /// Time waited so far.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// Waits until `ready()`, the timeout or Ctrl-C ([`crate::interrupt`]); returns the time waited.
pub fn wait_until(timeout: Duration, mut ready: impl FnMut() -> bool) -> std::result::Result<Duration, crate::error::WaitEnd> {
    let mut b = Backoff::new(timeout);
    let mut checked = Instant::now();
    loop {
        if ready() {
            return Ok(b.elapsed());
        }
        if !b.snooze() {
            return if ready() { Ok(b.elapsed()) } else { Err(crate::error::WaitEnd::TimedOut) };
        }
        if crate::interrupt::requested_during(&mut checked) {
            return Err(crate::error::WaitEnd::Interrupted);
        }
    }
}

/// Loads an atomic with acquire ordering (readability helper for protocol code).
pub fn load_acquire(a: &AtomicU64) -> u64 {
    a.load(Ordering::Acquire)
}
