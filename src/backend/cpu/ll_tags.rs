//! The LL signal words of the CPU backend: call tags, the abandoned tag of a call given up by its
//! sender, and their 32-bit loads and stores (see `ll.rs`, "Halves and sequence numbers").
//!
//! # Abandoned calls
//! A rank whose receive times out gives its call up (it raises, or in shrink mode masks the
//! missing ranks and goes on). Its messages of that call may already lie in a late peer's area,
//! with the tag the peer's same-numbered call expects. So before it raises or masks, it rewrites
//! every word it set in that call, at the ranks it gives up on (shrink) or at every peer (raise),
//! to the call's *abandoned* tag (count field `0xffff`). A receive that finds it raises, naming
//! the rank and the call, whatever the mask: tokens of a call their sender gave up are never
//! delivered. A receive that finished before the rewrite got a whole call: that is not lost data.

use super::CpuBackend;
use crate::shm::{self, Region};
use std::sync::atomic::Ordering;

/// `recv_state[3]` of a dispatch send (the kind of call a receive works from).
pub(super) const KIND_DISPATCH: i64 = 1;
/// `recv_state[3]` of a combine send.
pub(super) const KIND_COMBINE: i64 = 2;

/// The tag of call `seq` carrying `count` (dispatch: tokens for the word's expert; combine: 0).
pub(super) fn tag(seq: u32, count: usize) -> u32 {
    ((seq & 0xffff) << 16) | (count as u32 + 1)
}

/// Count field of the tag of a call its sender gave up (see "Abandoned calls").
const ABANDONED: u32 = 0xffff;

/// The count a word carries if it holds call `seq`'s tag.
pub(super) fn arrived(v: u32, seq: u32) -> Option<usize> {
    (v >> 16 == seq & 0xffff && v & 0xffff != 0 && v & 0xffff != ABANDONED).then(|| (v & 0xffff) as usize - 1)
}

/// The tag of call `seq` given up by its sender.
fn abandoned_tag(seq: u32) -> u32 {
    ((seq & 0xffff) << 16) | ABANDONED
}

/// Whether a word holds the tag of call `seq` given up by its sender.
pub(super) fn abandoned(v: u32, seq: u32) -> bool {
    v == abandoned_tag(seq)
}

/// Release-stores 32-bit signal word `w` of the array at `base` (an RMW of its 64-bit word,
/// so two senders sharing it never clobber each other).
pub(super) fn sig_store(reg: &Region, base: usize, w: usize, v: u32) {
    let shift = 32 * (w % 2);
    let a = reg.atomic_u64(base + 8 * (w / 2));
    let _ = a.fetch_update(Ordering::Release, Ordering::Relaxed, |old| Some((old & !(0xffff_ffffu64 << shift)) | ((v as u64) << shift)));
}

pub(super) fn sig_load(reg: &Region, base: usize, w: usize) -> u32 {
    (shm::load_acquire(reg.atomic_u64(base + 8 * (w / 2))) >> (32 * (w % 2))) as u32
}

impl CpuBackend {
    /// Rewrites the signal words this rank set in the receive's call at `peers` to the call's
    /// abandoned tag (see "Abandoned calls"). Dispatch: word `l·R + me` of each local expert `l`;
    /// combine: words `me·E_l + l` (per-expert rows, or word `me·E_l` for partial sums).
    pub(super) fn ll_abandon(&self, peers: &[usize]) {
        let Some((kind, sig, seq)) = self.ll.receiving else { return };
        let Some((_, _, e)) = self.ll.geometry else { return };
        let (r, me) = (self.info.num_ranks, self.info.rank);
        let el = e / r;
        let tag = abandoned_tag(seq);
        for &d in peers.iter().filter(|&&d| d != me && d < r) {
            let region = self.ll_region(d);
            for l in 0..el {
                let w = if kind == KIND_DISPATCH { l * r + me } else { me * el + l };
                sig_store(&region, sig, w, tag);
            }
        }
    }
}
