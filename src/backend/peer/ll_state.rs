//! The host-side low-latency state a peer-window buffer keeps between calls (used by
//! `low_latency.rs`), and the window bytes LL mode adds.

use crate::config::BUFFER_ALIGNMENT;

/// Host-side LL state of one buffer.
#[derive(Default, Debug)]
pub struct LlState {
    /// Half the next LL send uses.
    pub(super) next_half: usize,
    /// `(T, H, E)` of the last send or clean; `None` before the first LL call.
    pub(super) geometry: Option<(usize, usize, usize)>,
    /// Per half: the dispatch that used it last, as (address of its `src_info` output, whether
    /// it carried top-k weights, its number); a combine given that `src_info` finds the latest
    /// dispatch with it and sends partial sums if that one carried weights.
    pub(super) dispatch: [crate::backend::LlDispatchRecord; 2],
    /// Per half: whether the recorded dispatch's receive ran (a combine of a dispatch whose
    /// receive hook was never called raises instead of reading an unwritten handle).
    pub(super) received: [bool; 2],
    /// Dispatches recorded so far (orders `dispatch`: the latest match wins).
    pub(super) dispatches: u64,
    /// Per half: (num_tokens, num_topk) of the recorded dispatch, which its combine's send passes
    /// on (the LogFMT send's form, `logfmt_spread` in `kernels/low_latency.cuh`).
    pub(super) selections: [(i32, i32); 2],
}

/// Bytes the window needs beyond `num_nvl_bytes` for LL mode (`num_rdma_bytes`, plus alignment).
pub fn extra_window_bytes(num_nvl_bytes: usize, num_rdma_bytes: usize, low_latency_mode: bool) -> usize {
    if low_latency_mode {
        num_nvl_bytes.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT - num_nvl_bytes + num_rdma_bytes
    } else {
        0
    }
}
