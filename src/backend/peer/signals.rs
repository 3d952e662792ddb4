//! The signal-id map of the transport seam, in one place: which signal (on a GIN context, or in
//! an LSA emulation table) each kind of op raises and waits on. A buffer's table, in order:
//! - `[0, LL_SIGNALS)`: low-latency counts ([`ll`]), in low-latency buffers only;
//! - from [`ht_base`]: the normal-mode kernels' ids ([`ht`]: `kSigBar` / `kSigStep` of
//!   `kernels/internode.cuh` + source node; `crate::kernels::internode::SEAM_SIGNALS` of them);
//! - the last [`BARRIER_SIGNALS`] (GIN plans): the global barrier's ([`barrier_base`]).
//!
//! Ids never depend on the contexts NCCL grants, so fewer contexts never make two senders share one.

/// Most experts of an LL call on the nccl backend (`DEK_LL_MAX_EXPERTS`).
pub const LL_MAX_EXPERTS: usize = 2048;
/// Seam signals per rank (`DEK_LL_SEAM_SIGNALS`): one per (dispatch or combine, half, local
/// expert, rank), at most `4 * LL_MAX_EXPERTS` whatever the geometry.
pub const LL_SIGNALS: usize = 4 * LL_MAX_EXPERTS;
/// Seam signal of `(combine, half, local expert, rank)` for `num_ranks` ranks of
/// `num_local_experts` experts each: on a receiver `rank` is the sender; in a sender's shadow
/// table it is the receiver (`seam_signal` in `kernels/low_latency.cuh`).
pub fn ll(combine: bool, half: usize, local_expert: usize, rank: usize, num_local_experts: usize, num_ranks: usize) -> usize {
    ((usize::from(combine) * 2 + half) * num_local_experts + local_expert) * num_ranks + rank
}

/// Kinds of the seam signals of the normal-mode kernels (`internode.cuh`). Each is raised on a
/// rank by its rail peer of the source node, by one per event, and never reset: the receiver
/// waits for the count of its own device epoch counter (zeroed with the window), so the signal
/// must start at 0 (a fresh GIN device comm's signals do; the LL kernels count on the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HtSignal {
    /// Global barriers: a put of the barrier payload with the add (`kSigBar`).
    Barrier,
    /// Seam steps: the exchange blocks' puts, or a bare add after the token records / partials
    /// (`kSigStep`).
    Step,
}

/// First seam signal of the normal-mode kernels in a buffer (`InArgs::sig_base`): after the LL
/// seam's ids in a low-latency buffer (which may run normal-mode ops too, and whose LL kernels
/// reset `[0, LL_SIGNALS)` at a geometry change), 0 otherwise.
pub fn ht_base(low_latency_mode: bool) -> usize {
    if low_latency_mode {
        LL_SIGNALS
    } else {
        0
    }
}

/// Signal id the normal-mode kernels use for `kind` from source node `node` (< `MAX_NODES`), with the
/// buffer's `base` ([`ht_base`]); on context 0.
pub fn ht(base: usize, kind: HtSignal, node: usize) -> usize {
    use crate::kernels::internode::{SIG_BAR, SIG_STEP};
    base + node + if kind == HtSignal::Barrier { SIG_BAR } else { SIG_STEP }
}

/// Signals a buffer's GIN plan adds at the end of its table for the buffer's global barrier
/// (`kernels::global_barrier`: destroy and the LL signal reset; one id per source NVLink domain).
pub const BARRIER_SIGNALS: usize = crate::kernels::global_barrier::SIGNALS;

/// First signal id of the global barrier in a table of `total_signals` (a GIN plan's): its last
/// [`BARRIER_SIGNALS`] ids, above every id its ops use (`ll_signal`, `ring_signal`, the normal-mode
/// kernels' ids), so the barrier never adds to an op's signal and an LL reset never resets one of
/// the barrier's.
pub fn barrier_base(total_signals: usize) -> usize {
    total_signals - BARRIER_SIGNALS
}
