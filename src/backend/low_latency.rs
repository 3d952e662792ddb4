//! Types of the low-latency backend calls: the call geometry, the deduplicated wire layout shared
//! by both backends, and the send / receive arguments and outputs.

use super::info::BufferInfo;
use crate::config::{low_latency_rdma_size_hint, LowLatencyLayout};
use crate::error::Result;
use crate::tensor::TensorRef;

pub use crate::op_io::{LlDispatchOutputs, LlStats};

/// Static geometry shared by the low-latency ops of one call.
#[derive(Copy, Clone, Debug)]
pub struct LlGeometry {
    /// T: most tokens any rank dispatches in one call.
    pub num_max_dispatch_tokens_per_rank: usize,
    pub hidden: usize,
    pub num_experts: usize,
}

/// Length of the `recv_state` int64 tensor that carries a split LL call from its send op to its
/// recv op (buffer half, sequence number, two reserved words).
pub const LL_STATE_LEN: usize = 4;

/// Most tokens per rank in one low-latency call, on every backend: receive counts travel as
/// `count + 1` in 16 bits, below `0xffff`, the count field of an abandoned call's tag
/// (`DEK_LL_MAX_TOKENS` of the kernels).
pub const LL_MAX_TOKENS: usize = 0xfffd;

/// What a receive says when rank `src` dispatched with payload format `theirs` and this rank
/// `receives` ("receives" as it finds it, "received" when a kernel found it) with `mine`, on every
/// backend. Formats: the bits the CPU backend's messages and the kernels' `fmt_dispatch` carry,
/// 1 FP8, 2 round_scale, 4 use_ue8m0, 8 NVFP4.
pub fn dispatch_format_mismatch(src: impl std::fmt::Display, theirs: i32, mine: i32, receives: &str) -> String {
    let name = |code: i32| {
        if code & 8 != 0 {
            "use_nvfp4=True (NVFP4)".to_string()
        } else if code & 1 == 0 {
            "use_fp8=False (BF16)".to_string()
        } else {
            format!("use_fp8=True, round_scale={}, use_ue8m0={}", code & 2 != 0, code & 4 != 0)
        }
    };
    format!(
        "rank {src} dispatched with {}, this rank {receives} with {}: every rank must pass the same use_fp8, round_scale, use_ue8m0 and use_nvfp4",
        name(theirs),
        name(mine)
    )
}

/// The error of a low-latency receive that found call `seq` (its low 16 bits) of rank `src` given
/// up by its sender (a wait of `src` timed out: it raised, or masked a peer in shrink mode), on
/// every backend: `what` names this rank's call ("a dispatch", "a combine"). It poisons the buffer
/// ([`crate::error::Error::OutOfStep`]): the peer's buffer timed out (or masked this rank), so no
/// later call, the collective destroy included, would find it.
pub fn abandoned_error(op: &'static str, me: usize, src: usize, seq: u32, what: &str) -> crate::error::Error {
    crate::error::Error::OutOfStep {
        op,
        msg: format!(
            "rank {src} gave up its low-latency call {seq} (it timed out waiting for a peer and raised, or masked that peer in \
             shrink mode), and this rank's call {seq} ({what}) pairs with it: the ranks' low-latency calls are out of step, so \
             rank {me} refuses the tokens of a call their sender abandoned (recreate the buffer)"
        ),
    }
}

impl LlGeometry {
    /// The checks every backend makes before it touches its low-latency area: LL mode, experts a
    /// multiple of the rank count, hidden a multiple of 128, T within [`LL_MAX_TOKENS`], and the
    /// area (both halves) within `num_rdma_bytes`. Returns the area's layout.
    pub fn check_buffer(&self, op: &'static str, info: &BufferInfo) -> Result<LowLatencyLayout> {
        let (r, e, t, h) = (info.num_ranks, self.num_experts, self.num_max_dispatch_tokens_per_rank, self.hidden);
        crate::ensure!(info.low_latency_mode, op, "the buffer was not created with low_latency_mode=True");
        crate::ensure!(e > 0 && e % r == 0, op, "num_experts ({e}) must be a positive multiple of num_ranks ({r})");
        crate::ensure!(h > 0 && h % 128 == 0, op, "hidden ({h}) must be a positive multiple of 128");
        crate::ensure!((1..=LL_MAX_TOKENS).contains(&t), op, "num_max_dispatch_tokens_per_rank ({t}) must be in 1..={LL_MAX_TOKENS}");
        let lay = LowLatencyLayout::new(t, h, e);
        let need = lay.total_bytes();
        crate::ensure!(
            info.num_rdma_bytes >= need,
            op,
            "num_rdma_bytes = {} is too small for num_max_dispatch_tokens_per_rank={t}, hidden={h}, num_experts={e}: the low-latency buffer needs {need} bytes (get_low_latency_rdma_size_hint gives {})",
            info.num_rdma_bytes,
            low_latency_rdma_size_hint(t, h, r, e)
        );
        Ok(lay)
    }
}

/// Bytes of a deduplicated dispatch message before its payload (`DEK_LL_MSG_META`): header
/// `[src token, H, T, E]` i32, `[entries, has weights, 0, 0]` i32, [`LL_WIRE_MAX_TOPK`] u32
/// entries `local expert << 16 | expert slot` (top-k order) and as many f32 weights.
pub const LL_MSG_META: usize = 160;
/// Most top-k entries of a deduplicated message (`DEK_LL_MAX_TOPK`).
pub const LL_WIRE_MAX_TOPK: usize = 16;

/// Byte layout of the deduplicated low-latency wire format inside one receive half, the same on
/// both backends: `[message counts: R u32, 128 B][index table [E_l][R][T] u32][messages [R][T]]
/// [partial combine rows [R][T] of H bf16]`. A message goes once per (token, destination rank);
/// index entry `[l][s][slot]` names the message of source `s` that row `slot` of `(l, s)` comes
/// from. The per-expert combine rows (`[E][T]` slots) overlay it all from offset 0, while the
/// partial rows lie after the messages so that a combine can read its dispatch's messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LlWire {
    pub idx_off: usize,
    pub msgs_off: usize,
    pub msg_bytes: usize,
    pub partial_off: usize,
    /// Whether the partial combine rows fit in the half as well.
    pub partial_fits: bool,
}

impl LlWire {
    /// Offset of the message count of source `s`.
    pub fn count_off(s: usize) -> usize {
        4 * s
    }
}

/// A backend's record of the last dispatch of each LL half: (address of its `src_info` output,
/// whether it carried top-k weights in the deduplicated format, its number).
pub type LlDispatchRecord = Option<(usize, bool, u64)>;

/// The half whose dispatch a combine given `src_info` at `ptr` answers: the latest recorded
/// dispatch with this `src_info` address decides, so a freed and reused address of an older one
/// never matches.
pub fn ll_dispatch_half(records: &[LlDispatchRecord; 2], ptr: usize) -> Option<usize> {
    (0..2).filter_map(|h| records[h].filter(|r| r.0 == ptr).map(|r| (r.2, h))).max().map(|r| r.1)
}

/// Records that the dispatch whose `src_info` is at `ptr` has received (its receive ran, hook or
/// not), in `received` by half.
pub fn ll_mark_received(records: &[LlDispatchRecord; 2], received: &mut [bool; 2], ptr: usize) {
    if let Some(h) = ll_dispatch_half(records, ptr) {
        received[h] = true;
    }
}

/// Fails when the dispatch a combine given `src_info` at `ptr` answers has not received yet: its
/// handle's `src_info` and `layout_range` are not written (a receive hook that was never called).
pub fn ll_check_received(op: &'static str, records: &[LlDispatchRecord; 2], received: &[bool; 2], ptr: usize) -> crate::error::Result<()> {
    match ll_dispatch_half(records, ptr) {
        Some(h) if !received[h] => Err(crate::error::Error::invalid(
            op,
            "the low-latency dispatch of this handle has not received yet: call its receive hook (return_recv_hook=True) \
             before low_latency_combine",
        )),
        _ => Ok(()),
    }
}

/// [`ll_dispatch_half`] when that dispatch carried top-k weights (the combine then sends partial
/// sums).
pub fn ll_weighted_dispatch_half(records: &[LlDispatchRecord; 2], ptr: usize) -> Option<usize> {
    ll_dispatch_half(records, ptr).filter(|&h| records[h].is_some_and(|r| r.1))
}

/// Bytes of the message counts (`LlWire::count_off`, one u32 per source rank) before the index
/// table: 128 up to 32 ranks (every GPU layout today), then 4 bytes per rank in 128-byte steps
/// (at 64 ranks the counts of ranks 32.. overwrote the index table: found by the 64-rank CPU test).
fn ll_wire_counts_bytes(num_ranks: usize) -> usize {
    (4 * num_ranks).div_ceil(128).max(1) * 128
}

impl LlGeometry {
    /// The deduplicated wire layout for `num_ranks` ranks, or `None` when it does not fit in
    /// DeepEP's receive half (few experts per rank with a small hidden, e.g. one per rank at 128).
    pub fn wire(&self, num_ranks: usize) -> Option<LlWire> {
        let (r, e, t, h) = (num_ranks, self.num_experts, self.num_max_dispatch_tokens_per_rank, self.hidden);
        let lay = LowLatencyLayout::new(t, h, e);
        let align = |v: usize| v.div_ceil(crate::config::BUFFER_ALIGNMENT) * crate::config::BUFFER_ALIGNMENT;
        let msg_bytes = (LL_MSG_META + (2 * h).max(h + h / 128 * 4)).div_ceil(16) * 16;
        let idx_off = ll_wire_counts_bytes(r);
        let msgs_off = idx_off + align(4 * e * t);
        let partial_off = align(msgs_off + r * t * msg_bytes);
        (msgs_off + r * t * msg_bytes <= lay.recv_bytes).then_some(LlWire {
            idx_off,
            msgs_off,
            msg_bytes,
            partial_off,
            partial_fits: partial_off + r * t * 2 * h <= lay.recv_bytes,
        })
    }
}

/// Low-latency dispatch options.
#[derive(Copy, Clone, Debug)]
pub struct LlDispatchOptions {
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
    /// NVFP4 payload (`crate::numerics::nvfp4`); excludes `use_fp8`.
    pub use_nvfp4: bool,
}

impl LlDispatchOptions {
    /// The options as the flag bits a send records in `recv_state` and its receive checks
    /// (fp8 = 1, round_scale = 2, use_ue8m0 = 4, nvfp4 = 64).
    pub fn flags(&self) -> i64 {
        self.use_fp8 as i64 | (self.round_scale as i64) << 1 | (self.use_ue8m0 as i64) << 2 | (self.use_nvfp4 as i64) << 6
    }
}

/// Low-latency dispatch send-phase inputs.
pub struct LlDispatchSendArgs {
    /// `[N, H]` bf16, N ≤ T.
    pub x: TensorRef,
    /// `[N, K]` int32 or int64, global expert ids, −1 = none.
    pub topk_idx: TensorRef,
    /// `[N, K]` float32, optional (lets a backend reduce combine traffic; not required).
    pub topk_weights: Option<TensorRef>,
    /// float32 on x's device, contiguous, its first element NVFP4's global scale `S` (with
    /// `use_nvfp4` only).
    pub x_global_scale: Option<TensorRef>,
}

/// Low-latency combine send-phase inputs.
#[derive(Clone, Copy)]
pub struct LlCombineSendArgs {
    /// `[E_l, R*T, H]` bf16 expert outputs in dispatch layout (ignored with `zero_copy`).
    pub x: TensorRef,
    pub src_info: TensorRef,
    pub layout_range: TensorRef,
    pub use_logfmt: bool,
    /// The caller already wrote `x` into `next_low_latency_combine_buffer`.
    pub zero_copy: bool,
    /// `[LL_STATE_LEN]` int64, written here. `None` only in a whole combine: the backend's own
    /// (`LowLatencyMode::ll_own_state`) where it needs one.
    pub recv_state: Option<TensorRef>,
    /// Single-batch overlap: the producer's signals the send waits for (None: no wait).
    pub signal: Option<LlSignal>,
}

/// The signals of an overlapped LL combine (SGLang's single-batch overlap): row `r` of local expert
/// `l` is ready once `signal[l * blocks + r / block_m] >= threshold` (int32, on the buffer's device,
/// raised by the producer of the combine's input, e.g. the down GEMM, as it finishes those rows).
#[derive(Clone, Copy)]
pub struct LlSignal {
    /// int32, at least `E_l * blocks` elements, contiguous.
    pub signal: TensorRef,
    /// Rows per signal, `1..=R*T`; `blocks = ceil(R*T / block_m)`.
    pub block_m: usize,
    /// The value a signal reaches when its rows are written (> 0; a call without a wait has no `LlSignal`).
    pub threshold: i32,
    /// Most blocks the send may use while it waits (0: its usual grid), so that the producer keeps SMs.
    pub max_blocks: usize,
}

impl LlSignal {
    /// Signals per local expert.
    pub fn blocks(&self, g: &LlGeometry, num_ranks: usize) -> usize {
        (num_ranks * g.num_max_dispatch_tokens_per_rank).div_ceil(self.block_m)
    }

    /// On the cpu backend, where ops on CPU tensors run in program order (the producer is done):
    /// an error naming the first signal of a received row that is not raised, since it never
    /// will be. `layout_range` `[E_l, R]` as the dispatch wrote it.
    pub fn check_raised(&self, op: &'static str, g: &LlGeometry, num_ranks: usize, layout_range: &[i64]) -> Result<()> {
        let (sig, blocks) = (self.signal.cpu_slice::<i32>(), self.blocks(g, num_ranks));
        for (l, ranges) in layout_range.chunks(num_ranks).enumerate() {
            let rows: usize = ranges.iter().map(|v| (v & 0xffff_ffff) as usize).sum();
            for b in 0..rows.div_ceil(self.block_m) {
                let v = sig[l * blocks + b];
                crate::ensure!(
                    v >= self.threshold,
                    op,
                    "the overlap signal of local expert {l}, block {b} (rows [{}, {})) is {v} < threshold = {}: on a CPU buffer the \
                     producer has run before the call, so this signal will never come (comp_signal / src_signals)",
                    b * self.block_m,
                    rows.min((b + 1) * self.block_m),
                    self.threshold
                );
            }
        }
        Ok(())
    }
}

/// Inputs of [`Backend::ll_mask_rows`]: the real token count of an LL call as a device scalar.
pub struct LlRowsArgs {
    /// `[N, K]` int32 or int64 global expert ids (the caller's, read only).
    pub topk_idx: TensorRef,
    /// int32 `[]` or `[1]` on the buffer's device: the number `n` of real rows, `0 ≤ n ≤ N`.
    pub num_tokens: TensorRef,
    /// `[N, K]`, dtype of `topk_idx`, written: rows `< n` copied, rows `≥ n` all −1.
    pub out: TensorRef,
}

/// Low-latency combine recv-phase inputs; `out [N, H]` bf16 is written.
#[derive(Clone, Copy)]
pub struct LlCombineRecvArgs {
    /// `[N, K]` int32 or int64: this rank's original global expert ids.
    pub topk_idx: TensorRef,
    /// `[N, K]` float32.
    pub topk_weights: TensorRef,
    /// The send's state (`None` only in a whole combine, as [`LlCombineSendArgs::recv_state`]).
    pub recv_state: Option<TensorRef>,
    pub out: TensorRef,
}
