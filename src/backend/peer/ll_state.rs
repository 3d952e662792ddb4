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
    /// Per half: the combine send that used it last, as (address of its `recv_state`, whether it
    /// sent LogFMT); a receive given that `recv_state` launches the LogFMT receive instantiation (a hint:
    /// the kernel reads the format from `recv_state`, `dek_ll_combine_recv`).
    pub(super) combine_sent: [Option<(usize, bool)>; 2],
}

impl LlState {
    /// Records a launched combine send on `half` (one record per `recv_state` address: an
    /// address the allocator reused leaves the other half's record).
    pub(super) fn combine_sent(&mut self, half: usize, recv_state: usize, logfmt: bool) {
        let other = &mut self.combine_sent[half ^ 1];
        *other = other.filter(|&(addr, _)| addr != recv_state);
        self.combine_sent[half] = Some((recv_state, logfmt));
    }

    /// Whether the latest combine send with this `recv_state` sent LogFMT.
    pub(super) fn combine_sent_logfmt(&self, recv_state: usize) -> bool {
        self.combine_sent.iter().flatten().any(|&(addr, logfmt)| addr == recv_state && logfmt)
    }
}

/// Bytes the window needs beyond `num_nvl_bytes` for LL mode (`num_rdma_bytes`, plus alignment).
pub fn extra_window_bytes(num_nvl_bytes: usize, num_rdma_bytes: usize, low_latency_mode: bool) -> usize {
    if low_latency_mode {
        num_nvl_bytes.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT - num_nvl_bytes + num_rdma_bytes
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::LlState;

    #[test]
    fn combine_sent_hint_follows_the_latest_send_of_an_address() {
        let mut s = LlState::default();
        assert!(!s.combine_sent_logfmt(0x1000));
        s.combine_sent(0, 0x1000, true);
        assert!(s.combine_sent_logfmt(0x1000));
        assert!(!s.combine_sent_logfmt(0x2000));
        // Two sends in flight (hook mode): one record per half.
        s.combine_sent(1, 0x2000, false);
        assert!(s.combine_sent_logfmt(0x1000) && !s.combine_sent_logfmt(0x2000));
        // The allocator reused 0x1000 for a BF16 send on half 1: half 0's LogFMT record is dropped.
        s.combine_sent(1, 0x1000, false);
        assert!(!s.combine_sent_logfmt(0x1000));
        // A whole combine's own state (one address every call) follows its latest format.
        s.combine_sent(0, 0x3000, true);
        s.combine_sent(1, 0x3000, false);
        assert!(!s.combine_sent_logfmt(0x3000));
        s.combine_sent(0, 0x3000, true);
        assert!(s.combine_sent_logfmt(0x3000));
    }
}
