//! Low-latency ops of the NCCL backend (DeepEP's LL protocol over NVLink peer pointers). Same
//! results as `backend/cpu/ll.rs`, bit for bit: per (local expert, source rank) rows in increasing
//! token index, sources ascending; combine sums `fma(y_k, w_k, acc)` over `k` in order.
//!
//! # LL area
//! In low-latency mode the window holds `num_rdma_bytes` more after the normal-mode data
//! (`ll_off` = control area + `num_nvl_bytes` rounded up to 128, identical on every rank), laid
//! out like the CPU backend's LL area (`[signal 0][signal 1][send 0][send 1][recv 0][recv 1]`,
//! sizes from [`LowLatencyLayout`]). Normal-mode ops that overflow `num_nvl_bytes` may write
//! into it: switching modes needs `clean_low_latency_buffer`, as in DeepEP.
//!
//! # Dispatch wire format (deduplicated)
//! One message per (token, destination rank) instead of one per (token, expert): the payload (BF16,
//! or FP8 cast once per token) travels once to each rank, with the list of that rank's local
//! experts the token selected (and its top-k weights when `topk_weights` was given); the sender
//! also writes the index entry `[l][s][slot]` of every selection and the receiver copies each
//! expert row from the message it names. The receive region of a half holds the index table and
//! `R·T` messages (`deep_ep_kernels.h`), which must fit DeepEP's buffer size (it does except
//! for very few experts per rank with a small hidden; such a call is refused). The outputs are the CPU backend's, bit for bit. Combine moves one
//! row per (token, expert), unless the
//! handle's dispatch carried `topk_weights`: then each expert rank sends ONE row per (token, source
//! rank), `bf16(Σ fma(y_k, w_k, acc))` over its experts in top-k order with the dispatch's
//! weights, and the source sums those rows over ranks ascending in fp32 (one more BF16 rounding
//! than the per-expert sum; the CPU backend does the same, bit for bit). A combine finds its
//! dispatch by the address of `src_info` among the last dispatch of each half. With `use_logfmt`
//! the per-expert rows travel as LogFMT-10 (`numerics::logfmt` values, `kernels/logfmt.cuh`
//! layout) and no partial sums are sent, as on the CPU backend.
//!
//! # Calls, halves, tags
//! Each send takes the half `next_half` (host, DeepEP's buffer index) and the next call number
//! (device: the send kernel reads and advances it, so a replayed CUDA graph gets fresh tags); the
//! send kernel writes `[half, seq, flags, kind]` into `recv_state` and the receive kernel works
//! from that alone. Signal words always hold some call's tag (or zero), so consecutive calls need
//! no cleaning. The window is zeroed at creation, so the first LL call needs no reset; a call with
//! another `(T, H, E)` than the previous one meets at a barrier, zeroes its signal words and meets
//! again (as the CPU backend; the barrier waits for masked ranks too).
//!
//! # Errors
//! Kernels record timeouts (with the rank waited for), overflows and mismatches in the host-mapped
//! status block; the next host-side call of the buffer raises them (`check_ll_pending`). A timeout
//! leaves the buffer unusable (every later kernel returns at once).

#[cfg(test)]
use super::ll_state::extra_window_bytes;
use super::ll_state::LlState;
use super::{ll_seam, PeerBackend};
use crate::backend::{
    LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlRowsArgs, LlStats,
    LowLatencyMode, Stream,
};
use crate::config::BUFFER_ALIGNMENT;
use crate::error::{Error, Result};
use crate::kernels::host_mask::SHRINK_WORD;
use crate::kernels::intranode::{self, err, site, CONTROL_BYTES};
use crate::kernels::low_latency::{self as k, LlArgs, FLAG_LOGFMT, FLAG_PARTIAL, LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS, LOGFMT_SPREAD_FROM};
use crate::op_names::{
    CLEAN_LOW_LATENCY_BUFFER as OP_CLEAN, GET_NEXT_LOW_LATENCY_COMBINE_BUFFER as OP_NEXT, LOW_LATENCY_COMBINE as OP_COMBINE,
    LOW_LATENCY_DISPATCH as OP_DISPATCH,
};
use crate::tensor::{DType, TensorRef};

// The kernels refuse what the backends' one check lets through otherwise.
const _: () = assert!(crate::backend::low_latency::LL_MAX_TOKENS == k::MAX_TOKENS);
/// Whether a LogFMT combine of `selections` (N·K of the handle's dispatch) over `num_experts` takes
/// the one-launch form (`dek_ll_combine`), where the call allows one (no overlap signal, seam or
/// zero-copy; one rank per GPU): below [`LOGFMT_SPREAD_FROM`] its send takes an item per half block;
/// from there it spreads the rows over the grid's warps, where the kernel's scan holds every expert
/// ([`LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS`]; more: two launches, as the per-item send's heaviest item
/// set the cast encode's time there, bench/NOTES.md session 46). Until session 49 512 selections
/// and more took two launches: one launch at 64 / 128 tokens x top-8 was 1.4-2.0 µs faster (one rank,
/// bench/NOTES.md session 49).
fn logfmt_one_launch(selections: i64, num_experts: usize) -> bool {
    selections < LOGFMT_SPREAD_FROM || num_experts <= LOGFMT_ONE_LAUNCH_SPREAD_EXPERTS
}
/// Most experts of a dispatch send on this backend (`DEK_LL_MAX_EXPERTS`).
const MAX_EXPERTS: usize = super::signals::LL_MAX_EXPERTS;

/// Block counts of the LL grids, per SM of this rank's share of the GPU (`Ctx::num_sms`: 132 on
/// an H100/H200 that the rank has to itself, which gives the counts bench/NOTES.md measured).
/// Results do not depend on them. Ranks sharing a GPU under MPS run side by side, and a receive
/// grid spins until the peers' send kernels ran: it must leave room beside it for them, so it
/// takes 2 blocks per SM of the share there instead of 4 (with 4 per SM the waiting grids of the
/// other ranks filled every SM and a send kernel was never scheduled: the MPS timeouts of
/// bench/RESULTS.md). Time-slicing needs none of this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LlGrid {
    /// Dispatch receive (128 threads each; the kernel adds blocks up to one per local expert).
    recv: i32,
    /// Most blocks of the dispatch send (256 threads each; one or a few tokens per block).
    send: i32,
    /// Partial combine send (128 threads each), over the source ranks. 4 per SM measured the same
    /// as 2 (bench/NOTES.md, session 6).
    partial: i32,
    /// Combine receive (512 threads each, at most one per token).
    reduce: i32,
}

impl LlGrid {
    fn new(num_sms: i32, ranks_on_gpu: usize) -> LlGrid {
        let sms = num_sms.max(1);
        LlGrid { recv: if ranks_on_gpu > 1 { 2 * sms } else { 4 * sms }, send: 2 * sms, partial: 2 * sms, reduce: sms }
    }
}

fn ptr<T>(t: &TensorRef) -> *mut T {
    t.data_ptr() as *mut T
}
fn opt_ptr<T>(t: Option<&TensorRef>) -> *mut T {
    t.map_or(std::ptr::null_mut(), ptr)
}
fn aligned(op: &'static str, name: &str, t: &TensorRef) -> Result<()> {
    crate::ensure!(
        t.data_ptr() as usize % 16 == 0,
        op,
        "{name} must start at a 16-byte aligned address on the nccl backend (got a view at {:p})",
        t.data_ptr()
    );
    Ok(())
}

/// A dispatch's format flags.
fn ll_format(a: &mut LlArgs, o: &LlDispatchOptions) {
    a.use_fp8 = o.use_fp8 as i32;
    a.round_scale = o.round_scale as i32;
    a.use_ue8m0 = o.use_ue8m0 as i32;
    a.use_nvfp4 = o.use_nvfp4 as i32;
    a.flags = o.flags() as i32;
}

/// A dispatch receive's outputs and stats.
fn ll_recv_outputs(a: &mut LlArgs, o: &LlDispatchOptions, out: &LlDispatchOutputs, st: &LlStats) -> Result<()> {
    aligned(OP_DISPATCH, "recv_x", &out.recv_x)?;
    a.recv_x = ptr(&out.recv_x);
    if let Some(sc) = out.recv_x_scales.as_ref().filter(|_| o.use_fp8) {
        a.recv_scales = ptr(sc);
        a.scale_stride = [sc.strides()[0], sc.strides()[1], sc.strides()[2]];
    }
    if let Some(sc) = out.recv_x_scales.as_ref().filter(|_| o.use_nvfp4) {
        a.recv_scales = ptr(sc); // contiguous [E_l, rm, rk, 512] bytes (checked by crate::ops)
    }
    a.recv_count = ptr(&out.recv_count);
    a.src_info = ptr(&out.src_info);
    a.layout_range = ptr(&out.layout_range);
    a.cumulative = opt_ptr(st.cumulative_local_expert_recv_stats.as_ref());
    a.wait_stats = opt_ptr(st.wait_recv_cost_stats.as_ref());
    Ok(())
}

/// The token rows (`rows`, named `name`: x or out) and top-k of a dispatch send or combine receive
/// into `a`, after this backend's bounds on them.
fn ll_tokens(a: &mut LlArgs, op: &'static str, g: &LlGeometry, name: &str, rows: &TensorRef, topk_idx: &TensorRef) -> Result<()> {
    let n = rows.size(0);
    let k = if topk_idx.ndim() == 2 { topk_idx.size(1) } else { 0 };
    crate::ensure!(
        n <= g.num_max_dispatch_tokens_per_rank,
        op,
        "{name} has {n} tokens, more than num_max_dispatch_tokens_per_rank ({})",
        g.num_max_dispatch_tokens_per_rank
    );
    crate::ensure!(k <= 16, op, "num_topk must be <= 16 on the nccl backend, got {k}");
    aligned(op, name, rows)?;
    a.num_tokens = n as i32;
    a.num_topk = k as i32;
    a.topk_is_int64 = (topk_idx.dtype == DType::Int64) as i32;
    a.topk_idx = ptr(topk_idx);
    Ok(())
}

/// A combine receive's arguments.
fn ll_combine_recv_args(a: &mut LlArgs, g: &LlGeometry, r: &LlCombineRecvArgs, st: &LlStats) -> Result<()> {
    ll_tokens(a, OP_COMBINE, g, "out", &r.out, &r.topk_idx)?;
    a.topk_weights = ptr(&r.topk_weights);
    a.out = ptr(&r.out);
    a.wait_stats = opt_ptr(st.wait_recv_cost_stats.as_ref());
    Ok(())
}

/// The message of a format mismatch a receive kernel found (`err::LL_FORMAT`): another rank sent
/// with other flags or another geometry. Found after the data moved, so raised at the next call.
fn ll_format_error(op: &'static str, e: crate::kernels::intranode::KernelError) -> Error {
    let (src, theirs, mine) = (e.rank, e.value, e.limit);
    let what = if e.site == site::LL_DISPATCH { "dispatch" } else { "combine" };
    let text = match (e.extra, e.site == site::LL_DISPATCH) {
        (0, true) => crate::backend::low_latency::dispatch_format_mismatch(src, theirs & 0xff, mine & 0xff, "received"),
        (0, false) => {
            let name = |f: i32| format!("use_logfmt={}, partial sums={}", f & 1 != 0, f & 2 != 0);
            format!(
                "rank {src} combined with {}, this rank received with {}: every rank must pass the same use_logfmt (and combine mode)",
                name(theirs),
                name(mine)
            )
        }
        (i, _) => {
            let field = ["", "hidden", "num_max_dispatch_tokens_per_rank", "num_experts"].get(i as usize).copied().unwrap_or("?");
            format!("rank {src} sent a low-latency {what} with {field} = {theirs}, this rank received with {mine}: every rank must pass the same values")
        }
    };
    Error::invalid(op, format!("the previous low-latency {what} was wrong: {text}"))
}

impl PeerBackend {
    /// Whether a one-launch LL op takes its one-rank form (`DEEP_EP_LL_LOCAL`): one rank, no peer.
    fn ll_local_form(&self) -> bool {
        self.info.num_ranks == 1 && crate::settings::ll_local()
    }

    fn ll_grid(&self) -> LlGrid {
        LlGrid::new(self.window.ctx().num_sms, self.window.ranks_on_gpu())
    }

    /// The LL geometry as kernel arguments (area offsets and sizes), after the checks that
    /// depend on this buffer.
    fn ll_args(&self, op: &'static str, g: &LlGeometry) -> Result<LlArgs> {
        let (e, t, h) = (g.num_experts, g.num_max_dispatch_tokens_per_rank, g.hidden);
        let lay = g.check_buffer(op, &self.info)?;
        // Regions start 16-byte aligned (vector loads and stores) unless E·T·(H/128) is not a
        // multiple of 4 (a combine slot is 4·H/128 + 2·H bytes).
        crate::ensure!((e * t * (h / 128)) % 4 == 0, op, "the nccl backend needs num_experts * num_max_dispatch_tokens_per_rank * hidden / 128 to be a multiple of 4, got {e} * {t} * {}", h / 128);
        crate::ensure!(e <= MAX_EXPERTS, op, "num_experts must be <= {MAX_EXPERTS} on the nccl backend, got {e}");
        // The deduplicated wire format (see the module doc) must fit in the receive half.
        let Some(wire) = g.wire(self.info.num_ranks) else {
            return Err(Error::invalid(op, format!(
                "the nccl backend's deduplicated low-latency messages ({} ranks x {t} tokens of 160 + 2 * hidden bytes, plus a 4 * num_experts * {t}-byte index) do not fit in DeepEP's receive region for num_experts={e}, hidden={h}: use more experts per rank",
                self.info.num_ranks
            )));
        };
        let need = lay.total_bytes();
        let ll_off = CONTROL_BYTES + self.info.num_nvl_bytes.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT;
        crate::ensure!(
            ll_off + need <= self.window.bytes(),
            op,
            "internal: LL area [{ll_off}, +{need}) outside the window of {} bytes",
            self.window.bytes()
        );
        // Internode: peers outside the NVLink domain through the seam (ll_seam.rs).
        let (mut net, mut shadow_off, mut stage, mut nvl_domain, mut net_kind) =
            (std::ptr::null(), 0, ll_seam::Staging { meta_off: 0, idx_off: 0, cnt_off: 0, end: 0 }, 0, 0);
        if let Some(seam) = &self.seam {
            stage = ll_seam::Staging::new(self.info.num_ranks, e, t, wire.msg_bytes);
            stage.check(op, lay.send_bytes)?;
            crate::ensure!(
                ll_seam::combine_stage_bytes(e, t, h) <= lay.send_bytes,
                op,
                "internal: combine staging of {} bytes outside the send region of {} bytes",
                ll_seam::combine_stage_bytes(e, t, h),
                lay.send_bytes
            );
            crate::ensure!(
                seam.layout.end <= self.window.bytes(),
                op,
                "internal: seam area outside the window of {} bytes",
                self.window.bytes()
            );
            net = (self.window.ctx().own_base() as *const u8).wrapping_add(seam.layout.desc_off).cast();
            shadow_off = seam.layout.shadow_off as u64;
            nvl_domain = seam.nvl_domain as i32;
            net_kind = seam.kind;
        }
        Ok(LlArgs {
            net,
            shadow_off,
            stage_meta_off: stage.meta_off as u64,
            stage_idx_off: stage.idx_off as u64,
            stage_cnt_off: stage.cnt_off as u64,
            nvl_domain,
            net_kind,
            ll_off: ll_off as u64,
            signal_bytes: lay.signal_bytes as u64,
            send_bytes: lay.send_bytes as u64,
            recv_bytes: lay.recv_bytes as u64,
            msg_bytes: wire.msg_bytes as u64,
            idx_off: wire.idx_off as u64,
            msgs_off: wire.msgs_off as u64,
            partial_off: wire.partial_off as u64,
            mask: self.ll_mask_device_ptr() as *const i32,
            shrink_mask: if self.mask.get(SHRINK_WORD) != 0 { self.mask.device_ptr().cast() } else { std::ptr::null_mut() },
            num_max_tokens: t as i32,
            hidden: h as i32,
            num_experts: e as i32,
            num_blocks: self.ll_grid().recv,
            ..LlArgs::default()
        })
    }

    /// A dispatch's send arguments after the checks that need this buffer (half not yet taken).
    fn ll_dispatch_args(&self, g: &LlGeometry, o: &LlDispatchOptions, s: &LlDispatchSendArgs, stream: Stream) -> Result<LlArgs> {
        self.check_ll_pending(OP_DISPATCH, stream)?;
        let mut a = self.ll_args(OP_DISPATCH, g)?;
        ll_tokens(&mut a, OP_DISPATCH, g, "x", &s.x, &s.topk_idx)?;
        ll_format(&mut a, o);
        a.x = ptr(&s.x);
        a.topk_weights = opt_ptr(s.topk_weights.as_ref());
        a.x_global_scale = opt_ptr(s.x_global_scale.as_ref());
        a.num_blocks = self.ll_grid().send;
        Ok(a)
    }

    /// A combine's send arguments after the checks that need this buffer (half not yet taken;
    /// partial sums when the handle's dispatch carried weights).
    fn ll_combine_args(&self, g: &LlGeometry, s: &LlCombineSendArgs, stream: Stream) -> Result<LlArgs> {
        self.check_ll_pending(OP_COMBINE, stream)?;
        crate::backend::ll_check_received(OP_COMBINE, &self.ll.dispatch, &self.ll.received, s.src_info.data_ptr() as usize)?;
        let mut a = self.ll_args(OP_COMBINE, g)?;
        a.zero_copy = s.zero_copy as i32;
        if !s.zero_copy {
            aligned(OP_COMBINE, "x", &s.x)?;
            a.x = ptr(&s.x);
        }
        a.src_info = ptr(&s.src_info);
        a.layout_range = ptr(&s.layout_range);
        // LogFMT rows per expert (`kernels/logfmt.cuh`), never partial sums (as the CPU backend).
        if s.use_logfmt {
            a.flags = FLAG_LOGFMT;
        }
        // Partial sums when this handle's dispatch carried top-k weights (as the CPU backend).
        let src_ptr = s.src_info.data_ptr() as usize;
        let fits = !s.use_logfmt && g.wire(self.info.num_ranks).is_some_and(|w| w.partial_fits);
        if let Some(hd) = crate::backend::ll_weighted_dispatch_half(&self.ll.dispatch, src_ptr).filter(|_| fits) {
            a.partial = 1;
            a.dispatch_half = hd as i32;
            a.flags = FLAG_PARTIAL;
            a.num_blocks = self.ll_grid().partial;
        }
        // The dispatch's routing fingerprint goes with the combine; its receive checks topk_idx
        // against it (`DEEP_EP_CHECK_INPUTS=0` skips the check).
        let half = crate::backend::ll_dispatch_half(&self.ll.dispatch, src_ptr);
        a.routing_half = half.filter(|_| crate::settings::check_inputs()).map_or(-1, |h| h as i32);
        // The send's form by the dispatch's N·K (LogFMT: `logfmt_spread`); a receive sets its own.
        (a.num_tokens, a.num_topk) = half.map_or((0, 0), |h| self.ll.selections[h]);
        // Overlap: the send's warps wait on the device for the producer's signals (kernels/low_latency.cu).
        if let Some(sig) = &s.signal {
            a.signal = sig.signal.data_ptr() as *const i32;
            a.signal_block_m = sig.block_m as i32;
            a.signal_blocks = sig.blocks(g, self.info.num_ranks) as i32;
            a.signal_threshold = sig.threshold;
            a.signal_grid = sig.max_blocks.min(i32::MAX as usize) as i32;
        }
        Ok(a)
    }

    /// The send launch of a combine from its arguments (`ll_combine_args`).
    fn ll_combine_send_launch(&mut self, mut a: LlArgs, s: &LlCombineSendArgs, stream: Stream) -> Result<()> {
        a.recv_state = opt_ptr(s.recv_state.as_ref());
        self.ll_begin_send(OP_COMBINE, &mut a, stream)?;
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { k::combine_send(OP_COMBINE, self.window.ctx(), &a, stream) }?;
        self.ll.combine_sent(a.half as usize, a.recv_state as usize, a.flags & FLAG_LOGFMT != 0);
        Ok(())
    }

    /// What a launched dispatch send leaves for the combine of its handle.
    fn ll_dispatch_sent(&mut self, a: &LlArgs, s: &LlDispatchSendArgs, out: &LlDispatchOutputs) {
        self.ll.dispatches += 1;
        self.ll.dispatch[a.half as usize] = Some((out.src_info.data_ptr() as usize, s.topk_weights.is_some(), self.ll.dispatches));
        self.ll.selections[a.half as usize] = (a.num_tokens, a.num_topk);
        self.ll.received[a.half as usize] = false;
    }

    /// Raises an error a kernel recorded earlier; non-timeout errors are cleared so the buffer
    /// stays usable.
    fn check_ll_pending(&self, op: &'static str, stream: Stream) -> Result<()> {
        if self.mask.get(SHRINK_WORD) != 0 {
            self.report_shrink(op);
        }
        let Some(e) = self.window.status().error() else { return Ok(()) };
        let where_ = site::name(e.site);
        // A timeout and a peer's abandoned call leave the buffer unusable: their error stays.
        if e.code != err::TIMEOUT && e.code != err::LL_ABANDONED {
            self.window.status().clear_error();
            // SAFETY: launch contract: no pointer argument; it writes this rank's control area.
            unsafe { intranode::clear_error(op, self.window.ctx(), stream) }?;
        }
        Err(match e.code {
            err::TIMEOUT => Error::Timeout {
                op,
                rank: self.info.rank,
                peers: vec![e.rank.max(0) as usize],
                timeout_ms: self.timeout_ms(),
                what: format!("GPU wait: {where_}; the buffer is unusable now"),
            },
            err::OVERFLOW if e.site == site::LL_DISPATCH => Error::invalid(op, format!(
                "tokens over capacity: an expert of rank {} was selected {} times in one low-latency dispatch, more than num_max_dispatch_tokens_per_rank ({}); the extra selections were dropped",
                e.rank, e.value, e.limit
            )),
            err::LL_FORMAT => ll_format_error(op, e),
            err::LL_ABANDONED => {
                let what = if e.site == site::LL_COMBINE { "a combine" } else { "a dispatch" };
                crate::backend::low_latency::abandoned_error(op, self.info.rank, e.rank.max(0) as usize, e.value as u32, what)
            }
            err::LL_ROUTING if e.extra == 1 => Error::invalid(op, format!(
                "topk_weights differ from the ones the dispatch of this handle carried (found by the receive of the previous \
                 low-latency combine, [{}, {}]; its output is wrong): its expert ranks summed with those (partial sums), so pass \
                 the same topk_weights to low_latency_dispatch and low_latency_combine (or none to the dispatch)",
                e.value, e.limit
            )),
            err::LL_ROUTING => Error::invalid(op, format!(
                "topk_idx differs from the one the dispatch of this handle routed with (found by the receive of the previous \
                 low-latency combine, topk_idx [{}, {}]; its output is wrong): pass the same topk_idx (and num_tokens) to \
                 low_latency_dispatch and low_latency_combine",
                e.value, e.limit
            )),
            err::EXPERT_ID if e.site == site::LL_DISPATCH => Error::invalid(op, format!(
                "topk_idx of the previous low-latency dispatch held expert id {}, outside [-1, {}) (num_experts); those selections were dropped",
                e.value, e.limit
            )),
            err::MISMATCH if e.site == site::LL_DISPATCH || e.site == site::LL_COMBINE => Error::invalid(op, format!(
                "{where_} found data of another call (rank {}, value {}, expected {}): every rank must pass the same hidden, num_max_dispatch_tokens_per_rank and num_experts, and a receive needs the state of the matching send",
                e.rank, e.value, e.limit
            )),
            c => Error::Device { op, what: "low-latency kernel".into(), detail: format!("error code {c} (rank {}) at {where_}", e.rank) },
        })
    }

    /// Zeroes the signal words of `a`'s geometry on every rank, between two barriers of all ranks
    /// (the global barrier for an internode buffer, whose kernels reach other NVLink domains only
    /// through the seam: `kernels::global_barrier`).
    fn ll_reset_signals(&self, op: &'static str, a: &LlArgs, stream: Stream) -> Result<()> {
        use crate::kernels::global_barrier::all_ranks;
        // SAFETY: launch contract: the ctx of this live window; the barrier passes no other pointer.
        unsafe { all_ranks(op, self.window.ctx(), site::LL_GEOMETRY, stream) }?;
        // SAFETY: launch contract: no tensor; it writes this rank's LL signal words in its window.
        unsafe { k::zero_signals(op, self.window.ctx(), a, stream) }?;
        // SAFETY: launch contract: the ctx of this live window; the barrier passes no other pointer.
        unsafe { all_ranks(op, self.window.ctx(), site::LL_GEOMETRY, stream) }
    }

    /// Before a send: a call with another geometry than the previous LL call resets the signals;
    /// then takes the half. The first LL call needs no reset (the window is zeroed at creation),
    /// so ranks that mask a dead peer never wait for it at a barrier.
    fn ll_begin_send(&mut self, op: &'static str, a: &mut LlArgs, stream: Stream) -> Result<()> {
        let key = (a.num_max_tokens as usize, a.hidden as usize, a.num_experts as usize);
        match self.ll.geometry {
            Some(k) if k == key => {}
            None => self.ll.geometry = Some(key),
            Some(_) => {
                self.ll_reset_signals(op, a, stream)?;
                self.ll.geometry = Some(key);
            }
        }
        a.half = self.ll.next_half as i32;
        self.ll.next_half ^= 1;
        Ok(())
    }
}

// The streams are handed to CUDA, never dereferenced here (an invalid one is CUDA's error).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
impl LowLatencyMode for PeerBackend {
    fn ll_dispatch_send(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        s: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        stream: Stream,
    ) -> Result<()> {
        let mut a = self.ll_dispatch_args(g, o, s, stream)?;
        a.recv_state = opt_ptr(out.recv_state.as_ref());
        self.ll_begin_send(OP_DISPATCH, &mut a, stream)?;
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { k::dispatch_send(OP_DISPATCH, self.window.ctx(), &a, stream) }?;
        self.ll_dispatch_sent(&a, s, out);
        Ok(())
    }

    fn ll_dispatch_recv(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        out: &LlDispatchOutputs,
        st: &LlStats,
        stream: Stream,
    ) -> Result<()> {
        self.check_ll_pending(OP_DISPATCH, stream)?;
        let mut a = self.ll_args(OP_DISPATCH, g)?;
        ll_format(&mut a, o);
        ll_recv_outputs(&mut a, o, out, st)?;
        a.recv_state = opt_ptr(out.recv_state.as_ref());
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { k::dispatch_recv(OP_DISPATCH, self.window.ctx(), &a, stream) }?;
        crate::backend::ll_mark_received(&self.ll.dispatch, &mut self.ll.received, out.src_info.data_ptr() as usize);
        Ok(())
    }

    /// One launch (`DEEP_EP_LL_LAUNCH`) where the send grid is resident at once: this rank alone on
    /// its GPU (ranks sharing one under MPS could fill it with spinning blocks) and no peer behind
    /// the seam. The send grid is 2 blocks per SM of 256 threads, the most 128 registers allow.
    fn ll_dispatch(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        s: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        st: &LlStats,
        stream: Stream,
    ) -> Result<()> {
        if self.window.ranks_on_gpu() > 1 || self.seam.is_some() || !crate::settings::ll_one_launch() {
            return crate::backend::ll_dispatch_in_two(self, g, o, s, out, st, stream);
        }
        let mut a = self.ll_dispatch_args(g, o, s, stream)?;
        ll_recv_outputs(&mut a, o, out, st)?;
        self.ll_begin_send(OP_DISPATCH, &mut a, stream)?;
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe {
            if self.ll_local_form() {
                k::dispatch_local(OP_DISPATCH, self.window.ctx(), &a, stream)
            } else {
                k::dispatch(OP_DISPATCH, self.window.ctx(), &a, stream)
            }
        }?;
        self.ll_dispatch_sent(&a, s, out);
        crate::backend::ll_mark_received(&self.ll.dispatch, &mut self.ll.received, out.src_info.data_ptr() as usize);
        Ok(())
    }

    fn ll_combine_send(&mut self, g: &LlGeometry, s: &LlCombineSendArgs, stream: Stream) -> Result<()> {
        let a = self.ll_combine_args(g, s, stream)?;
        self.ll_combine_send_launch(a, s, stream)
    }

    fn ll_combine_recv(&mut self, g: &LlGeometry, r: &LlCombineRecvArgs, st: &LlStats, stream: Stream) -> Result<()> {
        self.check_ll_pending(OP_COMBINE, stream)?;
        let mut a = self.ll_args(OP_COMBINE, g)?;
        ll_combine_recv_args(&mut a, g, r, st)?;
        a.recv_state = opt_ptr(r.recv_state.as_ref());
        // The send's format as a hint for the receive's kernel and grid (the kernel reads recv_state).
        if self.ll.combine_sent_logfmt(a.recv_state as usize) {
            a.flags = FLAG_LOGFMT;
        }
        a.num_blocks = self.ll_grid().reduce;
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { k::combine_recv(OP_COMBINE, self.window.ctx(), &a, stream) }
    }

    /// One launch (`DEEP_EP_LL_LAUNCH`) as the dispatch's, for BF16 rows or partial sums without
    /// overlap signals, where the send grid is resident at once beside nothing else of this GPU's:
    /// E blocks of 128 threads (rows: at most 3 per SM, what the kernel's 159 registers allow) or
    /// the partial grid (2 per SM, at least one per rank); and for LogFMT rows as
    /// [`logfmt_one_launch`] says (one block of 512 threads per SM, an item per half block, or from
    /// [`LOGFMT_SPREAD_FROM`] the rows spread over every warp); at one rank in the local form
    /// (`DEEP_EP_LL_LOCAL=direct`) BF16 rows and partial sums where resident, and LogFMT rows at
    /// any expert count (`combine_local_logfmt`: no receive area).
    fn ll_combine(&mut self, g: &LlGeometry, s: &LlCombineSendArgs, r: &LlCombineRecvArgs, st: &LlStats, stream: Stream) -> Result<()> {
        let mut a = self.ll_combine_args(g, s, stream)?;
        let sms = self.window.ctx().num_sms.max(1) as usize;
        let resident = if a.partial != 0 { self.info.num_ranks <= a.num_blocks as usize } else { g.num_experts <= 3 * sms };
        let selections = i64::from(a.num_tokens) * i64::from(a.num_topk);
        // LogFMT at one rank in the local form (`combine_local_logfmt`): any expert count.
        let form =
            if s.use_logfmt { !s.zero_copy && (self.ll_local_form() || logfmt_one_launch(selections, g.num_experts)) } else { resident };
        let one = form && s.signal.is_none() && self.window.ranks_on_gpu() == 1 && self.seam.is_none();
        if !one || !crate::settings::ll_one_launch() {
            // Two launches from the send arguments already made (ll_combine_in_two would make them again).
            let state = crate::backend::ll_combine_state(self, s, r);
            self.ll_combine_send_launch(a, &LlCombineSendArgs { recv_state: state, ..*s }, stream)?;
            return self.ll_combine_recv(g, &LlCombineRecvArgs { recv_state: state, ..*r }, st, stream);
        }
        ll_combine_recv_args(&mut a, g, r, st)?;
        self.ll_begin_send(OP_COMBINE, &mut a, stream)?;
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe {
            if self.ll_local_form() {
                k::combine_local(OP_COMBINE, self.window.ctx(), &a, stream)
            } else {
                k::combine(OP_COMBINE, self.window.ctx(), &a, stream)
            }
        }
    }

    fn clean_low_latency_buffer(&mut self, g: &LlGeometry, stream: Stream) -> Result<()> {
        self.check_ll_pending(OP_CLEAN, stream)?;
        let a = self.ll_args(OP_CLEAN, g)?;
        self.ll_reset_signals(OP_CLEAN, &a, stream)?;
        self.ll = LlState {
            next_half: 0,
            geometry: Some((a.num_max_tokens as usize, a.hidden as usize, a.num_experts as usize)),
            ..LlState::default()
        };
        Ok(())
    }

    fn next_low_latency_combine_buffer(&mut self, g: &LlGeometry) -> Result<TensorRef> {
        let a = self.ll_args(OP_NEXT, g)?;
        let (r, el, t, h) =
            (self.info.num_ranks as i64, (g.num_experts / self.info.num_ranks) as i64, a.num_max_tokens as i64, a.hidden as i64);
        let (rt, m) = (r * t, h + h / 128 * 2);
        let off = a.ll_off + 2 * a.signal_bytes + self.ll.next_half as u64 * a.send_bytes;
        // The view may outlive the buffer (torch's stable ABI gives no deleter to tell us): it
        // points into the window's own mapping, which `keep_memory` keeps.
        self.window.keep_memory();
        let ptr = (self.window.own_memory() as *mut u8).wrapping_add(off as usize);
        Ok(TensorRef::new(ptr, DType::BFloat16, self.info.device, &[el, rt, h], &[rt * m, m, 1]))
    }

    /// In this rank's control area (`DEK_LL_OWN_STATE_OFF`), so that CUDA graphs capture a fixed address.
    fn ll_own_state(&mut self, combine: bool) -> TensorRef {
        let off = k::OWN_STATE_OFF + combine as usize * crate::backend::LL_STATE_LEN * 8;
        let ptr = (self.window.ctx().own_base() as *mut u8).wrapping_add(off);
        TensorRef::new(ptr, DType::Int64, self.info.device, &[crate::backend::LL_STATE_LEN as i64], &[1])
    }

    fn ll_mask_rows(&mut self, op: &'static str, a: &LlRowsArgs, s: Stream) -> Result<()> {
        crate::kernels::ll_rows::mask_rows(op, &a.topk_idx, &a.num_tokens, &a.out, s)
    }

    fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.mask.set(rank, masked as i32);
        self.mask_seen.set(self.masked_ranks());
        self.ll_sync_mask(crate::op_names::LOW_LATENCY_UPDATE_MASK_BUFFER)
    }

    fn ll_mask(&self) -> Vec<bool> {
        (0..self.info.num_ranks).map(|r| self.mask.get(r) != 0).collect()
    }

    fn ll_clean_mask(&mut self) -> Result<()> {
        (0..self.info.num_ranks).for_each(|r| self.mask.set(r, 0));
        self.mask_seen.set(Default::default());
        self.ll_sync_mask(crate::op_names::LOW_LATENCY_CLEAN_MASK_BUFFER)
    }

    fn ll_set_shrink(&mut self, enable: bool) -> Result<()> {
        self.mask.set(SHRINK_WORD, enable as i32);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ll_grids_are_the_measured_ones_on_a_whole_gpu_and_leave_room_when_shared() {
        assert_eq!(LlGrid::new(132, 1), LlGrid { recv: 528, send: 264, partial: 264, reduce: 132 });
        assert_eq!(LlGrid::new(66, 2), LlGrid { recv: 132, send: 132, partial: 132, reduce: 66 });
        assert_eq!(LlGrid::new(0, 4), LlGrid { recv: 2, send: 2, partial: 2, reduce: 1 });
    }

    #[test]
    fn logfmt_one_launch_per_item_below_256_selections_and_spread_within_512_experts() {
        for experts in [8, 256, 288, 512, 513, 2048] {
            assert!(logfmt_one_launch(0, experts) && logfmt_one_launch(255, experts), "{experts} experts, per-item form");
            // The spread one-launch kernel's scan holds 512 items (kOneLaunchSpreadItems): beyond, two launches.
            for selections in [256, 511, 512, 1024, 65533 * 16] {
                assert_eq!(logfmt_one_launch(selections, experts), experts <= 512, "{experts} experts at {selections} selections");
            }
        }
    }

    #[test]
    fn extra_bytes_keep_the_area_aligned() {
        assert_eq!(extra_window_bytes(100, 1000, false), 0);
        assert_eq!(extra_window_bytes(100, 1000, true), 28 + 1000);
        assert_eq!(extra_window_bytes(0, 1000, true), 1000);
    }
}
