//! The host-side low-latency state a CPU buffer keeps between calls (used by `ll.rs`).

/// Host-side low-latency state of one buffer.
#[derive(Default, Debug)]
pub struct LlState {
    /// Half the next LL send uses (DeepEP's `low_latency_buffer_idx`).
    pub(super) next_half: usize,
    /// Sequence number of the latest send on each half.
    pub(super) seq: [u32; 2],
    /// Sends issued since creation or the last clean, both halves together. One counter for
    /// both halves keeps every call's tag unique: a word left behind by the other half, or
    /// by a call with another geometry (signal offsets move with E), can never carry the
    /// tag a waiter expects, so no rank can see a stale word as an arrival.
    pub(super) calls: u32,
    /// `(T, H, E)` of the last send or clean; `None` while the signal area is untouched.
    pub(super) geometry: Option<(usize, usize, usize)>,
    /// Per half: the dispatch that used it last, as (address of its `src_info` output, whether
    /// it sent top-k weights in the deduplicated format, its number); a combine given that
    /// `src_info` finds the latest dispatch with it and sends partial sums if that one carried
    /// weights (see `LlGeometry::wire`; an older dispatch whose freed `src_info` address was
    /// reused never matches first).
    pub(super) dispatch: [crate::backend::LlDispatchRecord; 2],
    /// Per half: whether the recorded dispatch's receive ran (a combine of a dispatch whose
    /// receive hook was never called raises instead of reading an unwritten handle).
    pub(super) received: [bool; 2],
    /// Dispatches recorded so far (orders `dispatch`: the latest match wins).
    pub(super) dispatches: u64,
    /// The routing of the latest dispatches, as (address of their `src_info` output, fingerprint
    /// of their `topk_idx`); a combine send finds its dispatch's by `src_info`.
    /// With the fingerprint of the top-k weights the dispatch carried (for partial sums), if any.
    pub(super) routed: Vec<(usize, u64, Option<u64>)>,
    /// Per half: the routing fingerprint of the combine sent on it, which its receive checks
    /// against the `topk_idx` it is given (another one would silently sum nothing).
    /// With the weights' fingerprint when the combine sends partial sums (made with the weights
    /// the dispatch carried: other weights at the combine would silently not be used).
    pub(super) combine_routing: [Option<(u64, Option<u64>)>; 2],
    /// The receive in progress, for a timeout that gives its call up: (kind, offset of its half's
    /// signal words, call number).
    pub(super) receiving: Option<(i64, usize, u32)>,
}

impl LlState {
    /// Records the routing of a dispatch whose `src_info` output is at `src_addr`: its `topk_idx`
    /// (`k` per token) and the top-k weights it carried, if any (the latest 8 dispatches).
    pub(super) fn record_routing(&mut self, src_addr: usize, idx: &[i64], k: usize, weights: Option<&[f32]>) {
        self.routed.retain(|&(p, _, _)| p != src_addr);
        self.routed.push((src_addr, routing_fingerprint(idx, k), weights.map(weights_fingerprint)));
        if self.routed.len() > 8 {
            self.routed.remove(0);
        }
    }

    /// The combine sent on `half` answers the dispatch of `src_info` at `src_ptr` (if recorded);
    /// with `partial` sums its weights are checked too.
    pub(super) fn route_combine(&mut self, half: usize, src_ptr: usize, partial: bool) {
        self.combine_routing[half] =
            self.routed.iter().rev().find(|&&(p, _, _)| p == src_ptr).map(|&(_, fp, fw)| (fp, fw.filter(|_| partial)));
    }

    /// Fails when the combine received on `half` is given another `topk_idx` (or, with partial
    /// sums, other weights `w`) than its dispatch's.
    pub(super) fn check_combine_routing(
        &self,
        op: &'static str,
        half: usize,
        idx: &[i64],
        k: usize,
        w: &[f32],
    ) -> crate::error::Result<()> {
        let Some((fp, fw)) = self.combine_routing[half] else { return Ok(()) };
        crate::ensure!(
            fp == routing_fingerprint(idx, k),
            op,
            "topk_idx differs from the one the dispatch of this handle routed with: pass the same topk_idx (and \
             num_tokens) to low_latency_dispatch and low_latency_combine"
        );
        crate::ensure!(
            fw.map_or(true, |fw| fw == weights_fingerprint(w)),
            op,
            "topk_weights differ from the ones the dispatch of this handle carried: its expert ranks summed with those \
             (partial sums), so pass the same topk_weights to low_latency_dispatch and low_latency_combine (or none to the dispatch)"
        );
        Ok(())
    }
}

/// FNV-1a over the little-endian bytes of `values`.
fn fnv1a(values: impl IntoIterator<Item = i64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Fingerprint of a `topk_idx` (`n` rows of `k`): FNV-1a over the shape and the ids.
fn routing_fingerprint(idx: &[i64], k: usize) -> u64 {
    fnv1a([idx.len() as i64, k as i64].into_iter().chain(idx.iter().copied()))
}

/// A fingerprint of top-k weights (their bits, in order), hashed in place (no copy per call).
fn weights_fingerprint(w: &[f32]) -> u64 {
    fnv1a([w.len() as i64, 1].into_iter().chain(w.iter().map(|v| v.to_bits() as i64))) ^ 0x5bd1_e995
}

/// Writes a send's `[half, seq, flags, kind]` into its `recv_state` (a whole op passes the
/// backend's own to its send: never absent here).
pub(super) fn write_state(t: &Option<crate::tensor::TensorRef>, half: usize, seq: u32, flags: i64, kind: i64) {
    if let Some(t) = t {
        t.cpu_slice_mut::<i64>()[..crate::backend::LL_STATE_LEN].copy_from_slice(&[half as i64, seq as i64, flags, kind]);
    }
}
