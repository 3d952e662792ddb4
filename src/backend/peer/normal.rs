//! Normal-mode (high-throughput) ops of the NCCL backend, intranode. Same results as
//! `backend/cpu/ht.rs`, bit for bit.
//!
//! Every (cached) dispatch is four launches on the caller's stream (the pull model; with
//! `DEEP_EP_INTRANODE_DISPATCH=push`, dispatch uses the push model below; combine: see below):
//! - K0 `sync` (start barrier): every peer finished reading this rank's previously staged data;
//! - K1 `stage`: this rank's inputs into its own window (plus, for dispatch, its send side:
//!   `send_head` and `channel_prefix_matrix`), with a layout header peers read;
//! - K2 `sync` (data barrier): gathers every peer's layout and checks that all ranks run the same
//!   op; for dispatch it also notifies (rank_prefix_matrix, receiver channel starts, receive
//!   counts into host-mapped memory);
//! - K3 `pull`: this rank reads what it receives from the peers' windows.
//!
//! A (not cached) pull dispatch splits K1 so that the host, which waits for the receive counts,
//! does not wait for the copy of every row: K1 stages the counts and send side only (`META`), K2
//! notifies, then K1' stages the rows (`ROWS`, nothing if K2 cancelled the op) and a plain data
//! barrier K2' precedes K3 (six launches; the host reads the counts while K1' copies).
//!
//! Push model of (cached) dispatch: K1 stages only the small send side (no copy of x), and K3 is
//! `dispatch_push`: every rank reads its rows of x once and stores them (with scales, top-k ids
//! rewritten to the receiver's local ids, weights, source index) at their final output rows into
//! the receivers' windows (receive area after the staged sections; its rows are the output rows),
//! or straight into its own outputs, and raises a flag per finished channel; in the same kernel a
//! few warps per block copy each (source, channel) range of the own receive area into the outputs
//! as soon as its flag is up (local copies overlapping the NVLink stores), and write the padding
//! and handle outputs. Same rows, same bits.
//!
//! Combine (fused, the default; `kernels/intranode_combine.cu`) is two launches: K0 `sync` that
//! also publishes this rank's layout and gathers every peer's (the op check the data barrier did;
//! headers sit in two slots picked by the barrier epoch's parity, so publishing before the barrier
//! that reads them cannot race a slow peer's previous read) and zeroes the kernel's counters, then
//! `combine_fused`: push warps store the rows this rank holds straight into the windows of the
//! ranks they came from (remote stores; offsets from the handle's rank_prefix_matrix, which every
//! rank has in full), channel by channel, and raise flag (rank, channel) in the destination's
//! window when all its rows of that channel are there; reduce warps of every rank reduce a channel
//! from their own window as soon as every peer's flag for it is up. So the SM-bound reduce runs
//! under the NVLink-bound push instead of after a data barrier. With
//! `DEEP_EP_INTRANODE_COMBINE=split`, combine keeps the four launches: K1 push, K2 data barrier
//! (gather, op check), K3 reduce from the own window only. Same rows, same order, same bits.
//!
//! Only a dispatch without `num_worst_tokens` waits on the host (for the receive counts between
//! K2 and K3, `dispatch_prepare` → `dispatch_finish`); everything else is CUDA-graph capturable.
//!
//! Input checks (`DEEP_EP_CHECK_INPUTS`, on by default): a small kernel
//! (`kernels/intranode_check.cu`) compares the routing inputs with each other on the device, the
//! content checks the cpu backend makes on the host (expert ids in range, layout tensors that
//! agree with `topk_idx`, handles that agree with themselves and with this rank's row count), and
//! writes its result into this rank's header slot of the barrier that gathers the op's layouts:
//! between K1 and K2 for (cached) dispatch and the split combine, before K0 for the fused combine
//! (which has no data barrier; K0 publishes the layout beside the result). That barrier raises a
//! failure of any rank on every rank and cancels the op's data kernels.
//!
//! Errors found by kernels (a peer missing at a barrier, mismatching ops, worst-case overflow,
//! input checks) are recorded in the host-mapped status block and raised by the next host-side
//! call of the buffer (or by the dispatch wait). A capacity error is raised before anything is launched, by the
//! rank whose staged data does not fit: its peers then time out at the next barrier (known
//! limitation: unlike the CPU backend, such an error is not raised on every rank at once). For
//! combine the host checks its own rows; the exact need of every window depends on the routing
//! (device data), so the (fused) push kernel checks it on every rank (all find the same), skips
//! the op everywhere and records the error for the next call.

use super::PeerBackend;
use crate::backend::{CachedDispatchArgs, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, NormalMode};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernels::intranode::{
    self, err, kind, sec, site, stage_parts, CheckArgs, CombineArgs as KCombine, DispatchPushArgs, KernelError, Layout, PullArgs, PushArgs,
    StageArgs, SyncArgs, CONTROL_BYTES, MAX_CHANNELS, NUM_SECTIONS,
};
use crate::tensor::{DType, TensorRef};
use std::ffi::c_void;
use std::time::{Duration, Instant};

const DISPATCH: &str = crate::op_names::DISPATCH;
const CACHED: &str = crate::op_names::CACHED_DISPATCH;
const COMBINE: &str = crate::op_names::COMBINE;
/// Alignment of staged sections.
const SECTION_ALIGN: usize = 128;

/// Offsets of consecutive sections after the control area, and the end of the last one.
fn place(sizes: [usize; NUM_SECTIONS]) -> ([u64; NUM_SECTIONS], usize) {
    let mut off = [0u64; NUM_SECTIONS];
    let mut at = CONTROL_BYTES;
    for (o, s) in off.iter_mut().zip(sizes) {
        *o = at as u64;
        at += s.div_ceil(SECTION_ALIGN) * SECTION_ALIGN;
    }
    (off, at)
}

pub(super) fn channels(op: &'static str, config: &Config) -> Result<usize> {
    let c = config.num_channels();
    crate::ensure!(c <= MAX_CHANNELS, op, "config.num_sms = {} is above the nccl backend's limit of {}", config.num_sms, 2 * MAX_CHANNELS);
    Ok(c)
}

pub(super) fn ptr<T>(t: &TensorRef) -> *const T {
    t.data_ptr() as *const T
}
pub(super) fn ptr_mut<T>(t: &TensorRef) -> *mut T {
    t.data_ptr() as *mut T
}
pub(super) fn opt_ptr<T>(t: Option<&TensorRef>) -> *const T {
    t.map_or(std::ptr::null(), ptr)
}
pub(super) fn opt_ptr_mut<T>(t: Option<&TensorRef>) -> *mut T {
    t.map_or(std::ptr::null_mut(), ptr_mut)
}
pub(super) fn is_int64(t: Option<&TensorRef>) -> i32 {
    t.is_some_and(|t| t.dtype == DType::Int64) as i32
}
pub(super) fn i32_of(v: usize) -> i32 {
    v.min(i32::MAX as usize) as i32
}
/// `(pointer, stride0, stride1)` of optional `[N, S]` scales (strides in elements).
pub(super) fn scales_of(t: Option<&TensorRef>) -> (*const c_void, i64, i64) {
    t.map_or((std::ptr::null(), 0, 0), |s| (ptr(s), s.strides()[0], s.strides()[1]))
}

/// The first part of the message of an input-check error (the cpu backend's words).
fn input_error_text(e: &KernelError) -> String {
    let (v, l, x) = (e.value, e.limit, e.extra);
    const LAYOUT: &str = "pass the tensors get_dispatch_layout returned";
    match e.code {
        err::NTPR => format!("num_tokens_per_rank[{x}] = {v} but is_token_in_rank selects {l} tokens for rank {x}"),
        err::EXPERT_ID => format!("topk_idx holds expert id {v}, outside [-1, {l})"),
        err::NTPE => format!("num_tokens_per_expert does not match topk_idx ({LAYOUT})"),
        err::IN_RANK => format!("is_token_in_rank does not match topk_idx at token {v}, rank {x} ({LAYOUT})"),
        err::STALE_COUNTS => format!("stale handle: is_token_in_rank sends {v} tokens to rank {x}, rank_prefix_matrix says {l}"),
        err::STALE_ROWS => format!("stale handle: recv_src_idx has {l} rows but the rank_prefix_matrix gives this rank {v} tokens"),
        err::STALE_SEND_HEAD => format!("stale handle: send_head[{v}, {x}] is not the one is_token_in_rank gives (pass the handle of one dispatch)"),
        err::NTPRR => format!("num_tokens_per_rdma_rank[{x}] = {v} but is_token_in_rank selects {l} tokens for NVLink domain {x}"),
        err::STALE_INTERNODE => match x {
            -1 => format!("stale handle: the routing gives {v} received tokens but the handle has {l} rows"),
            -2 => format!("stale handle: the routing gives {v} RDMA-leg tokens but send_nvl_head has {l} rows"),
            _ => format!("stale handle: recv_gbl_rank_prefix_sum[{x}] is {l} but the ranks' is_token_in_rank route {v} tokens there; all ranks must pass handles of the same dispatch"),
        },
        _ => format!("stale handle: channel_prefix_matrix[{x}, {v}] is not the one is_token_in_rank gives (pass the handle of one dispatch)"),
    }
}

/// Grid of the input-check kernel: one thread per token and one warp per (rank, channel), at
/// most config.num_sms blocks of 8 warps.
pub(super) fn check_blocks(config: &Config, tokens: usize, pairs: usize) -> i32 {
    i32_of(tokens.div_ceil(256).max(pairs.div_ceil(8)).clamp(1, config.num_sms.max(1)))
}

impl PeerBackend {
    /// Launches the input checks (before the barrier that gathers the op's header: the data
    /// barrier, or the fused combine's start barrier; it raises what they find).
    pub(super) fn check_inputs(&self, op: &'static str, args: CheckArgs, stream: *mut c_void) -> Result<()> {
        if !crate::settings::check_inputs() {
            return Ok(());
        }
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::check_inputs(op, self.window.ctx(), &args, stream) }
    }

    /// [`CheckArgs`] of a handle (cached dispatch, combine).
    fn handle_checks(&self, h: &crate::backend::Handle, config: &Config, c: usize) -> CheckArgs {
        let n = h.is_token_in_rank.size(0);
        CheckArgs {
            num_blocks: check_blocks(config, n, self.info.num_ranks * c),
            is_token_in_rank: ptr(&h.is_token_in_rank),
            send_head: ptr(&h.send_head),
            channel_prefix_matrix: ptr(&h.channel_prefix_matrix),
            rank_prefix_matrix: ptr(&h.rank_prefix_matrix),
            num_tokens: n as i64,
            num_channels: c as i64,
            num_rows: h.recv_src_idx.numel() as i64,
            ..Default::default()
        }
    }

    /// Push model: the receive area after the staged sections (which end at `end`, 128-aligned):
    /// `(recv_off, recv_cap)`, the capacity in rows of `row_bytes` plus their side outputs
    /// (`dek_ic_layout_t` in kernels/deep_ep_kernels.h: 5 sub-arrays, each 128-aligned).
    fn recv_area(&self, end: usize, row_bytes: usize, scales: usize, topk: usize) -> (u64, i64) {
        let per = row_bytes + 4 * scales + 12 * topk + 4;
        let avail = self.window.bytes().saturating_sub(end).saturating_sub(5 * SECTION_ALIGN);
        (end as u64, (avail / per).min(i64::MAX as usize) as i64)
    }

    fn check_capacity(&self, op: &'static str, end: usize) -> Result<()> {
        let have = self.window.bytes();
        if end > have {
            return Err(Error::invalid(op, format!(
                "tokens over capacity: this call stages {} bytes into the buffer's NVLink window, which holds {} (num_nvl_bytes = {}, rounded up to 2 MiB)",
                end - CONTROL_BYTES, have - CONTROL_BYTES, self.info.num_nvl_bytes
            )));
        }
        Ok(())
    }

    /// Turns a recorded kernel error into the error raised by `op`; non-fatal ones are cleared
    /// (host block now, device copy on `stream`) so the buffer stays usable.
    pub(super) fn kernel_error(&self, op: &'static str, e: KernelError, stream: *mut c_void) -> Error {
        let where_ = site::name(e.site);
        if e.code != err::TIMEOUT {
            self.window.status().clear_error();
            // SAFETY: launch contract: no pointer argument; it writes this rank's control area.
            if let Err(x) = unsafe { intranode::clear_error(op, self.window.ctx(), stream) } {
                return x;
            }
        }
        match e.code {
            err::TIMEOUT => Error::Timeout {
                op,
                rank: self.info.rank,
                peers: vec![e.rank.max(0) as usize],
                timeout_ms: self.timeout_ms(),
                what: format!("GPU barrier: {where_}; the buffer is unusable now"),
            },
            err::MISMATCH => Error::invalid(op, format!(
                "rank {} ran another op or shape than this rank at {where_} (kind, hidden size, dtype, scales, top-k, experts or config.num_sms differ): all ranks must call the same ops with the same shapes in the same order",
                e.rank
            )),
            err::OVERFLOW => Error::invalid(op, format!(
                "tokens over capacity: rank {} receives {} tokens but its num_worst_tokens is {} (found at {where_}; rows past num_worst_tokens were dropped)",
                e.rank, e.value, e.limit
            )),
            err::CAPACITY => {
                let what = if matches!(e.site, site::COMBINE_START | site::COMBINE_DATA | site::COMBINE_RECV) { "combine" } else { "dispatch" };
                Error::invalid(op, format!(
                    "tokens over capacity: a {what} needed {} KiB of rank {}'s NVLink window, which holds {} KiB (found at {where_}); every rank skipped that {what} (its outputs are invalid)",
                    e.value, e.rank, e.limit
                ))
            }
            c if (err::NTPR..=err::STALE_INTERNODE).contains(&c) => Error::invalid(op, format!(
                "{} (rank {}'s inputs, checked on the GPU; found at {where_}: every rank skipped that op, its outputs are invalid)",
                input_error_text(&e),
                e.rank
            )),
            c => Error::Device { op, what: "intranode kernel".into(), detail: format!("unknown error code {c} at {where_}") },
        }
    }

    /// Raises an error a kernel of an earlier op recorded.
    pub(super) fn check_pending(&self, op: &'static str, stream: *mut c_void) -> Result<()> {
        match self.window.status().error() {
            Some(e) => Err(self.kernel_error(op, e, stream)),
            None => Ok(()),
        }
    }

    /// Host wait of a non-worst-case dispatch: the notify kernel's receive count.
    pub(super) fn wait_recv_count(&self, op: &'static str, stream: *mut c_void) -> Result<usize> {
        let status = self.window.status();
        // The GPU's own barrier deadline comes first, so its diagnosis (which rank) is seen.
        let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
        let mut spins = 0u32;
        let mut checked = Instant::now();
        loop {
            if let Some(e) = status.error() {
                return Err(self.kernel_error(op, e, stream));
            }
            let n = status.recv_count();
            if n >= 0 {
                if let Some(e) = status.error() {
                    return Err(self.kernel_error(op, e, stream));
                }
                return Ok(n as usize);
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    op,
                    rank: self.info.rank,
                    peers: vec![],
                    timeout_ms: self.timeout_ms(),
                    what: "the host waited for the notify kernel's receive counts (is the stream blocked by earlier work?)".into(),
                });
            }
            if crate::interrupt::requested_during(&mut checked) {
                return Err(Error::Interrupted {
                    op,
                    rank: self.info.rank,
                    peers: vec![],
                    what: "the host waited for the notify kernel's receive counts; the kernels still run to their own deadline".into(),
                });
            }
            spins += 1;
            if spins > 1000 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn barrier(&self, op: &'static str, args: SyncArgs, stream: *mut c_void) -> Result<()> {
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::sync(op, self.window.ctx(), &args, stream) }
    }
}

impl NormalMode for PeerBackend {
    fn dispatch_prepare(&mut self, a: &DispatchArgs) -> Result<DispatchPlan> {
        self.check_pending(DISPATCH, a.stream)?;
        let nr = self.info.num_ranks;
        let c = channels(DISPATCH, &a.config)?;
        let n = a.x.size(0);
        let rb = a.x.size(1) * a.x.dtype.size();
        let s = a.x_scales.as_ref().map_or(0, |t| t.size(1));
        let k = a.topk_idx.as_ref().map_or(0, |t| t.size(1));
        let e = a.num_experts;
        let el = e / nr;
        let pull = crate::settings::intranode_dispatch_pull();
        let (mut off, end) = if pull {
            place([nr * 4, e * 4, n * nr * 4, nr * c * 4, n * rb, n * s * 4, n * k * 8, n * k * 4])
        } else {
            place([nr * 4, e * 4, n * nr * 4, nr * c * 4, 0, 0, 0, 0])
        };
        self.check_capacity(DISPATCH, end)?;
        let (recv_off, recv_cap) = if pull { (0, 0) } else { self.recv_area(end, rb, s, k) };
        if !pull {
            for i in [sec::X, sec::SCALES, sec::TOPK, sec::WEIGHTS] {
                off[i] = 0; // not staged: the push kernel reads the inputs where they are
            }
        }
        let layout = Layout {
            kind: kind::DISPATCH,
            num_tokens: n as i64,
            row_bytes: rb as i64,
            num_scales: s as i64,
            num_topk: k as i64,
            num_experts: e as i64,
            num_worst: a.num_worst_tokens as i64,
            num_channels: c as i64,
            off,
            recv_off,
            recv_cap,
            recv_limit: if a.num_worst_tokens > 0 { a.num_worst_tokens as i64 } else { -1 },
        };
        let host_counts = a.num_worst_tokens == 0;
        if host_counts {
            self.window.status().set_recv_count(-1);
        }
        let (scales, scale_stride0, scale_stride1) = if pull { scales_of(a.x_scales.as_ref()) } else { (std::ptr::null(), 0, 0) };
        let check = CheckArgs {
            topk_idx: opt_ptr(a.topk_idx.as_ref()),
            topk_is_int64: is_int64(a.topk_idx.as_ref()),
            num_blocks: check_blocks(&a.config, n, nr * c),
            num_tokens_per_rank: ptr(&a.num_tokens_per_rank),
            num_tokens_per_expert: ptr(&a.num_tokens_per_expert),
            is_token_in_rank: ptr(&a.is_token_in_rank),
            num_tokens: n as i64,
            num_topk: k as i64,
            num_experts: e as i64,
            num_channels: c as i64,
            ..Default::default()
        };
        // The input checks run inside the stage kernel (one launch).
        let stage = StageArgs {
            layout,
            x: ptr(&a.x),
            scales,
            scale_stride0,
            scale_stride1,
            topk_idx: if pull { opt_ptr(a.topk_idx.as_ref()) } else { std::ptr::null() },
            topk_is_int64: is_int64(a.topk_idx.as_ref()),
            num_blocks: i32_of(a.config.num_sms),
            topk_weights: if pull { opt_ptr(a.topk_weights.as_ref()) } else { std::ptr::null() },
            num_tokens_per_rank: ptr(&a.num_tokens_per_rank),
            num_tokens_per_expert: ptr(&a.num_tokens_per_expert),
            is_token_in_rank: ptr(&a.is_token_in_rank),
            check,
            run_check: crate::settings::check_inputs() as i32,
            // Pull: the counts first, the rows after the notify barrier, so that the host waits
            // for the receive counts and not for the copy of every row.
            parts: if pull { stage_parts::META } else { 0 },
            // The start barrier at the head of the launch (the first block to arrive runs it) and
            // the notify barrier at its end (the last block): one launch for the three.
            start_site: site::DISPATCH_START,
            then_sync: 1,
            sync: SyncArgs {
                site: site::DISPATCH_NOTIFY,
                op_start: 0,
                gather: 1,
                notify: 1,
                write_host_counts: host_counts as i32,
                expert_alignment: i32_of(a.expert_alignment),
                num_local_experts: i32_of(el),
                ..Default::default()
            },
            ..Default::default()
        };
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::stage(DISPATCH, self.window.ctx(), &stage, a.stream) }?;
        if pull {
            // The rows, then the data barrier in the same launch.
            let sync = SyncArgs { site: site::DISPATCH_DATA, ..Default::default() };
            let rows = StageArgs { parts: stage_parts::ROWS, run_check: 0, start_site: 0, sync, ..stage };
            // SAFETY: as the stage launch above (the same arguments).
            unsafe { intranode::stage(DISPATCH, self.window.ctx(), &rows, a.stream) }?;
        }
        if !host_counts {
            // Receive counts stay on the device (the pull kernel reads them there).
            return Ok(DispatchPlan { num_recv_tokens: 0, num_rows: a.num_worst_tokens, num_recv_tokens_per_expert: vec![0; el] });
        }
        let recv = self.wait_recv_count(DISPATCH, a.stream)?;
        Ok(DispatchPlan { num_recv_tokens: recv, num_rows: recv, num_recv_tokens_per_expert: self.window.status().per_expert(el) })
    }

    fn dispatch_finish(&mut self, a: &DispatchArgs, plan: &DispatchPlan, o: &DispatchOutputs) -> Result<()> {
        let nr = self.info.num_ranks;
        let c = channels(DISPATCH, &a.config)?;
        let rows = plan.num_rows;
        let n = a.x.size(0);
        // The kernel writes exactly these sizes (the shim allocated them from the plan).
        let sized = |t: &TensorRef, len: usize| t.numel() == len && t.is_contiguous();
        let ok = o.recv_x.size(0) == rows
            && sized(&o.recv_src_idx, rows)
            && sized(&o.rank_prefix_matrix, nr * nr)
            && sized(&o.channel_prefix_matrix, nr * c)
            && sized(&o.recv_channel_prefix_matrix, nr * c)
            && sized(&o.send_head, n * nr)
            && o.recv_topk_idx.as_ref().map_or(true, |t| t.size(0) == rows)
            && o.recv_x_scales.as_ref().map_or(true, |t| t.size(0) == rows);
        crate::ensure!(ok, DISPATCH, "internal: dispatch outputs do not match the plan ({rows} rows)");
        let pull = PullArgs {
            recv_x: o.recv_x.data_ptr().cast(),
            recv_scales: opt_ptr_mut(o.recv_x_scales.as_ref()),
            recv_topk_idx: opt_ptr_mut(o.recv_topk_idx.as_ref()),
            recv_topk_weights: opt_ptr_mut(o.recv_topk_weights.as_ref()),
            recv_src_idx: ptr_mut(&o.recv_src_idx),
            rank_prefix_matrix: ptr_mut(&o.rank_prefix_matrix),
            channel_prefix_matrix: ptr_mut(&o.channel_prefix_matrix),
            recv_channel_prefix_matrix: ptr_mut(&o.recv_channel_prefix_matrix),
            send_head: ptr_mut(&o.send_head),
            num_rows: rows as i64,
            topk_is_int64: is_int64(o.recv_topk_idx.as_ref()),
            num_local_experts: i32_of(a.num_experts / nr),
            num_blocks: i32_of(a.config.num_sms),
            unroll: crate::settings::intranode_pull_unroll(),
            threads: crate::settings::intranode_pull_threads(),
            ..Default::default()
        };
        if crate::settings::intranode_dispatch_pull() {
            // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
            return unsafe { intranode::pull(DISPATCH, self.window.ctx(), &pull, a.stream) };
        }
        crate::ensure!(
            o.recv_topk_idx.is_none() || is_int64(o.recv_topk_idx.as_ref()) == is_int64(a.topk_idx.as_ref()),
            DISPATCH,
            "internal: recv_topk_idx dtype differs from topk_idx"
        );
        let (scales, scale_stride0, scale_stride1) = scales_of(a.x_scales.as_ref());
        let push = DispatchPushArgs {
            x: ptr(&a.x),
            scales,
            scale_stride0,
            scale_stride1,
            topk_idx: opt_ptr(a.topk_idx.as_ref()),
            topk_weights: opt_ptr(a.topk_weights.as_ref()),
            recv_x: pull.recv_x,
            recv_scales: pull.recv_scales,
            recv_topk_idx: pull.recv_topk_idx,
            recv_topk_weights: pull.recv_topk_weights,
            recv_src_idx: pull.recv_src_idx,
            num_tokens: n as i64,
            num_rows: rows as i64,
            topk_is_int64: is_int64(a.topk_idx.as_ref()),
            num_local_experts: pull.num_local_experts,
            num_blocks: pull.num_blocks,
            copy_warps: crate::settings::intranode_copy_warps(),
            ..Default::default()
        };
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::dispatch_push(DISPATCH, self.window.ctx(), &push, &pull, a.stream) }
    }

    fn cached_dispatch(&mut self, a: &CachedDispatchArgs, recv_x: &TensorRef, recv_scales: Option<&TensorRef>) -> Result<()> {
        self.check_pending(CACHED, a.stream)?;
        let nr = self.info.num_ranks;
        let c = channels(CACHED, &a.config)?;
        let n = a.x.size(0);
        let rb = a.x.size(1) * a.x.dtype.size();
        let s = a.x_scales.as_ref().map_or(0, |t| t.size(1));
        let rows = a.handle.recv_src_idx.numel();
        crate::ensure!(
            recv_x.size(0) == rows && recv_scales.map_or(true, |t| t.size(0) == rows),
            CACHED,
            "internal: outputs do not have {rows} rows"
        );
        let pull = crate::settings::intranode_dispatch_pull();
        let (mut off, end) = place(if pull { [0, 0, n * nr * 4, 0, n * rb, n * s * 4, 0, 0] } else { [0; NUM_SECTIONS] });
        self.check_capacity(CACHED, end)?;
        let (recv_off, recv_cap) = if pull { (0, 0) } else { self.recv_area(end, rb, s, 0) };
        if !pull {
            off = [0; NUM_SECTIONS]; // nothing staged: the push kernel reads x and the handle
        }
        let layout = Layout {
            kind: kind::CACHED,
            num_tokens: n as i64,
            row_bytes: rb as i64,
            num_scales: s as i64,
            num_channels: c as i64,
            off,
            recv_off,
            recv_cap,
            recv_limit: rows as i64,
            ..Default::default()
        };
        let (scales, scale_stride0, scale_stride1) = scales_of(a.x_scales.as_ref());
        // The handle's checks run inside the stage kernel (one launch).
        let (check, run_check) = (self.handle_checks(&a.handle, &a.config, c), crate::settings::check_inputs() as i32);
        let stage = if pull {
            StageArgs {
                layout,
                x: ptr(&a.x),
                scales,
                scale_stride0,
                scale_stride1,
                num_blocks: i32_of(a.config.num_sms),
                send_head: ptr(&a.handle.send_head),
                check,
                run_check,
                ..Default::default()
            }
        } else {
            // Header only.
            StageArgs { layout, num_blocks: i32_of(a.config.num_sms), check, run_check, ..Default::default() }
        };
        // The start barrier at the head of the launch and the data barrier at its end: the cached
        // dispatch is this launch and the pull (or push), as DeepEP's two.
        let sync = SyncArgs { site: site::CACHED_DATA, gather: 1, ..Default::default() };
        let stage = StageArgs { start_site: site::CACHED_START, then_sync: 1, sync, ..stage };
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::stage(CACHED, self.window.ctx(), &stage, a.stream) }?;
        let pull = PullArgs {
            recv_x: recv_x.data_ptr().cast(),
            recv_scales: opt_ptr_mut(recv_scales),
            rpm_in: ptr(&a.handle.rank_prefix_matrix),
            rcpm_in: ptr(&a.handle.recv_channel_prefix_matrix),
            num_rows: rows as i64,
            num_blocks: i32_of(a.config.num_sms),
            unroll: crate::settings::intranode_pull_unroll(),
            threads: crate::settings::intranode_pull_threads(),
            ..Default::default()
        };
        if crate::settings::intranode_dispatch_pull() {
            // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
            return unsafe { intranode::pull(CACHED, self.window.ctx(), &pull, a.stream) };
        }
        let push = DispatchPushArgs {
            x: ptr(&a.x),
            scales,
            scale_stride0,
            scale_stride1,
            send_head: ptr(&a.handle.send_head),
            channel_prefix_matrix: ptr(&a.handle.channel_prefix_matrix),
            rpm_in: pull.rpm_in,
            recv_x: pull.recv_x,
            recv_scales: pull.recv_scales,
            num_tokens: n as i64,
            num_rows: rows as i64,
            num_blocks: pull.num_blocks,
            copy_warps: crate::settings::intranode_copy_warps(),
            ..Default::default()
        };
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::dispatch_push(CACHED, self.window.ctx(), &push, &pull, a.stream) }
    }

    fn combine(&mut self, a: &CombineArgs, o: &CombineOutputs) -> Result<()> {
        self.check_pending(COMBINE, a.stream)?;
        let c = channels(COMBINE, &a.config)?;
        let rows = a.x.size(0);
        let hidden = a.x.size(1);
        let k = a.topk_weights.as_ref().map_or(0, |w| w.size(1));
        let n = o.combined_x.size(0);
        crate::ensure!(
            o.combined_x.numel() == n * hidden && o.combined_topk_weights.as_ref().map_or(k == 0, |w| w.numel() == n * k),
            COMBINE,
            "internal: combine outputs do not match [{n}, {hidden}] / [{n}, {k}]"
        );
        // This rank's rows (what it pushes) as the host-side estimate; the push kernel checks
        // every window's exact need.
        let (off, end) = place([0, 0, 0, 0, rows * hidden * 2, 0, 0, rows * k * 4]);
        self.check_capacity(COMBINE, end)?;
        let layout = Layout {
            kind: kind::COMBINE,
            num_tokens: rows as i64,
            row_bytes: (hidden * 2) as i64,
            num_topk: k as i64,
            num_channels: c as i64,
            off,
            ..Default::default()
        };
        let (fused, checked) = (crate::settings::intranode_combine_fused(), crate::settings::check_inputs());
        // Fused: the input checks run first and write their result into the header slot of the
        // start barrier (run by the check grid's last block: one launch), which also publishes and
        // gathers the layouts (op check; keep_check leaves the check result in place), raises any
        // rank's failed check on every rank (the fused kernel then returns at once everywhere) and
        // zeroes the kernel's counters. Split: the push kernel writes the header, the checks follow
        // it, the data barrier raises them.
        let start = if fused {
            let keep_check = checked as i32;
            SyncArgs {
                site: site::COMBINE_START,
                op_start: 1,
                gather: 1,
                publish: 1,
                zero_counters: 1,
                keep_check,
                layout,
                ..Default::default()
            }
        } else {
            SyncArgs { site: site::COMBINE_START, op_start: 1, ..Default::default() }
        };
        if fused && checked {
            // One launch: the checks, then the start barrier in the check grid's last block.
            let checks = self.handle_checks(&a.handle, &a.config, c);
            // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
            unsafe { intranode::check_sync(COMBINE, self.window.ctx(), &checks, &start, a.stream) }?;
        } else {
            self.barrier(COMBINE, start, a.stream)?;
        }
        let push = PushArgs {
            layout,
            x: ptr(&a.x),
            topk_weights: opt_ptr(a.topk_weights.as_ref()),
            rank_prefix_matrix: ptr(&a.handle.rank_prefix_matrix),
            recv_channel_prefix_matrix: ptr(&a.handle.recv_channel_prefix_matrix),
            num_rows: rows as i64,
            num_blocks: i32_of(a.config.num_sms),
            reduce_warps: crate::settings::intranode_reduce_warps(),
            push_unroll: crate::settings::intranode_push_unroll(),
            threads: crate::settings::intranode_combine_threads(),
        };
        if !fused {
            // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
            unsafe { intranode::combine_push(COMBINE, self.window.ctx(), &push, a.stream) }?;
            self.check_inputs(COMBINE, self.handle_checks(&a.handle, &a.config, c), a.stream)?;
            self.barrier(COMBINE, SyncArgs { site: site::COMBINE_DATA, gather: 1, ..Default::default() }, a.stream)?;
        }
        let args = KCombine {
            rank_prefix_matrix: ptr(&a.handle.rank_prefix_matrix),
            channel_prefix_matrix: ptr(&a.handle.channel_prefix_matrix),
            is_token_in_rank: ptr(&a.handle.is_token_in_rank),
            send_head: ptr(&a.handle.send_head),
            bias_0: opt_ptr(a.bias_0.as_ref()),
            bias_1: opt_ptr(a.bias_1.as_ref()),
            out: ptr_mut(&o.combined_x),
            out_weights: opt_ptr_mut(o.combined_topk_weights.as_ref()),
            num_tokens: n as i64,
            hidden: i32_of(hidden),
            num_topk: i32_of(k),
            num_channels: i32_of(c),
            num_blocks: i32_of(a.config.num_sms),
        };
        if fused {
            // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
            return unsafe { intranode::combine_fused(COMBINE, self.window.ctx(), &push, &args, a.stream) };
        }
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { intranode::combine(COMBINE, self.window.ctx(), &args, a.stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_aligned_and_follow_the_control_area() {
        let (off, end) = place([8, 0, 130, 1, 0, 0, 0, 256]);
        assert_eq!(off[0] as usize, CONTROL_BYTES);
        assert_eq!(off[1], off[0] + 128);
        assert_eq!(off[2], off[1]);
        assert_eq!(off[3], off[2] + 256);
        assert!(off.iter().all(|o| o % SECTION_ALIGN as u64 == 0));
        assert_eq!(end, off[7] as usize + 256);
    }
}
