//! The low-latency rank mask of one CUDA buffer, in host-mapped pinned memory
//! (`cudaHostAllocMapped`): the host writes it between launches, LL kernels read it through
//! the device pointer at every launch or graph replay (so a mask change needs no re-capture),
//! and in shrink mode a kernel that times out waiting for a peer may set the peer's word.
//!
//! Layout (`int32_t[MASK_WORDS]`, zero at creation):
//! - words `0..MAX_RANKS`: 1 = rank masked (dead), 0 = alive;
//! - word `SHRINK_WORD`: 1 = shrink mode (a timed-out wait masks the peer instead of failing);
//! - the rest: reserved, zero.
//!
//! Kernels must read the words with `ld.volatile` (or `ld.acquire.sys`) since the host may
//! change them at any time; writes from the host are followed by a SeqCst fence.

use crate::error::Result;
use crate::kernels::intranode::MAX_RANKS;
use crate::sys::kernels::*;
use std::ffi::c_void;

/// int32 words of the block.
pub const MASK_WORDS: usize = 16;
/// Index of the shrink-mode word.
pub const SHRINK_WORD: usize = MAX_RANKS;

/// Host-mapped `int32_t[MASK_WORDS]`; freed on drop.
pub struct HostMask {
    host: *mut i32,
    device: *mut c_void,
}

// SAFETY: plain pinned host memory; the owning backend is used under its buffer's mutex.
unsafe impl Send for HostMask {}

impl HostMask {
    /// Allocates the zeroed block (on the current device's context).
    pub fn new(op: &'static str) -> Result<HostMask> {
        let (mut host, mut device) = (std::ptr::null_mut(), std::ptr::null_mut());
        let bytes = MASK_WORDS * 4;
        // SAFETY: writes two pointers; the allocation is `bytes` of pinned, mapped memory.
        crate::kernels::layout::check(
            unsafe { dek_cuda_host_alloc_mapped(&mut host, &mut device, bytes) },
            op,
            "cudaHostAlloc(mapped) of the rank mask",
        )?;
        let m = HostMask { host: host.cast(), device };
        // SAFETY: the block is ours and `bytes` long.
        unsafe { std::ptr::write_bytes(m.host.cast::<u8>(), 0, bytes) };
        Ok(m)
    }

    /// Device pointer to the `int32_t[MASK_WORDS]` block, for LL kernel arguments.
    pub fn device_ptr(&self) -> *mut c_void {
        self.device
    }

    /// Reads word `i` (< MASK_WORDS).
    pub fn get(&self, i: usize) -> i32 {
        assert!(i < MASK_WORDS);
        // SAFETY: in bounds of the live block; volatile since kernels may write it.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// Writes word `i` (< MASK_WORDS), visible to later kernel launches.
    pub fn set(&self, i: usize, v: i32) {
        assert!(i < MASK_WORDS);
        // SAFETY: in bounds of the live block.
        unsafe { self.host.add(i).write_volatile(v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl HostMask {
    /// Copies words `0..words` (<= MASK_WORDS) to device memory at `dst` (synchronous), so that
    /// kernels read the mask from device memory instead of across PCIe.
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // `dst` is device memory: the host never dereferences it, the copy engine does (a bad pointer is a CUDA error)
    pub fn copy_to_device(&self, op: &'static str, dst: *mut c_void, words: usize) -> Result<()> {
        assert!(words <= MASK_WORDS);
        // SAFETY: `dst` is device memory of at least `words` int32 (the caller's window scratch);
        // the source is our live pinned block.
        crate::kernels::layout::check(
            unsafe { dek_cuda_memcpy_htod(dst, self.host.cast(), words * 4) },
            op,
            "copying the rank mask to the device",
        )
    }
}

impl Drop for HostMask {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaHostAlloc in `new`, freed once.
        let st = unsafe { dek_cuda_free_host(self.host.cast()) };
        if st != 0 {
            eprintln!("deep_ep: cudaFreeHost of the rank mask failed: {}", crate::kernels::layout::cuda_error_text(st));
        }
    }
}
