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
}
