//! The low-latency rank mask of one CUDA buffer, in host-mapped pinned memory
//! (`cudaHostAllocMapped`): the host writes it between launches, LL kernels read it through
//! the device pointer at every launch or graph replay (so a mask change needs no re-capture),
//! and in shrink mode a kernel that times out waiting for a peer may set the peer's word.
//!
//! Layout (`int32_t[MASK_WORDS]`, zero at creation):
//! - words `0..MASK_RANKS`: 1 = rank masked (dead), 0 = alive;
//! - word `SHRINK_WORD`: 1 = shrink mode (a timed-out wait masks the peer instead of failing);
//! - the rest: reserved, zero.
//!
//! Kernels must read the words with `ld.volatile` (or `ld.acquire.sys`) since the host may
//! change them at any time; writes from the host are followed by a SeqCst fence.

use crate::error::Result;
use crate::sys::kernels::*;
use std::ffi::c_void;

/// Ranks the mask has a word for: every rank of the largest buffer the window layout is sized
/// for (`DEK_IN_MAX_RANKS`, as the device copy at `DEK_LL_MASK_OFF`).
pub const MASK_RANKS: usize = DEK_IN_MAX_RANKS as usize;
/// Index of the shrink-mode word.
pub const SHRINK_WORD: usize = MASK_RANKS;
/// int32 words of the block (the mask, the shrink word, reserved words to a multiple of 16).
pub const MASK_WORDS: usize = MASK_RANKS + 16;

/// A set of ranks below [`MASK_RANKS`] (the masked ones, the ones already reported), by bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankSet([u64; MASK_RANKS / 64]);

impl RankSet {
    /// Adds rank `r` (< [`MASK_RANKS`]).
    pub fn insert(&mut self, r: usize) {
        self.0[r / 64] |= 1 << (r % 64);
    }

    /// Whether rank `r` is in the set (false for any `r` >= [`MASK_RANKS`]).
    pub fn contains(&self, r: usize) -> bool {
        r < MASK_RANKS && self.0[r / 64] >> (r % 64) & 1 != 0
    }

    /// The ranks of `self` that are not in `other`.
    pub fn minus(&self, other: &RankSet) -> RankSet {
        RankSet(std::array::from_fn(|i| self.0[i] & !other.0[i]))
    }

    /// The ranks, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        (0..MASK_RANKS).filter(|&r| self.contains(r)).collect()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }
}

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
    /// The masked ranks among `0..num_ranks` (<= [`MASK_RANKS`]).
    pub fn masked(&self, num_ranks: usize) -> RankSet {
        let mut set = RankSet::default();
        (0..num_ranks).filter(|&r| self.get(r) != 0).for_each(|r| set.insert(r));
        set
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_has_a_word_per_rank_of_the_largest_buffer_then_the_shrink_word() {
        const { assert!(SHRINK_WORD >= crate::kernels::internode::MAX_RANKS && SHRINK_WORD < MASK_WORDS && MASK_WORDS % 16 == 0) };
        // The device copy (MASK_RANKS words at DEK_LL_MASK_OFF) fits the control area's rank tables.
        const { assert!(DEK_LL_MASK_OFF as usize + 4 * MASK_RANKS <= DEK_IC_CHECK_COUNTS_OFF as usize) };
    }

    #[test]
    fn rank_sets_hold_every_rank_up_to_the_limit() {
        let mut a = RankSet::default();
        assert!(a.is_empty() && a.ranks().is_empty());
        for r in [0, 31, 32, 63, 64, 200, MASK_RANKS - 1] {
            a.insert(r);
        }
        assert_eq!(a.ranks(), vec![0, 31, 32, 63, 64, 200, MASK_RANKS - 1]);
        assert!(!a.contains(1) && !a.contains(MASK_RANKS) && a.contains(200));
        let mut seen = RankSet::default();
        seen.insert(31);
        seen.insert(200);
        seen.insert(5);
        assert_eq!(a.minus(&seen).ranks(), vec![0, 32, 63, 64, MASK_RANKS - 1]);
        assert!(seen.minus(&a).ranks() == vec![5] && a.minus(&a).is_empty());
    }
}
