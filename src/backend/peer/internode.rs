//! Internode normal mode of the NCCL backend (DeepEP's `internode_dispatch` /
//! `internode_combine`): two-level forwarding, bit-exact with `backend/cpu/internode.rs`.
//! Kernels: `kernels/internode_*.cu`; protocol, steps and window layout: `kernels/deep_ep_kernels.h`
//! ("Internode normal mode") and `kernels/internode.cuh`.
//!
//! A token travels once per destination node over the transport seam (`kernels/transport.cuh`) to
//! the rank of the same local index there (its forwarder); the ranks of that node read it from the
//! forwarder's window over NVLink. Combine reverses it: each rank stages its rows, the forwarder
//! sums one bf16 partial per token over its node's ranks and puts the partials back over the seam,
//! and the source adds the nodes' partials in ascending order in fp32 on top of the biases.
//! Barriers and count exchanges between nodes use seam puts and signals too (node phases use the
//! NVLink peers only), so the kernels need nothing across nodes but the seam.
//!
//! The seam the kernels run on is fixed at buffer creation ([`ht_net`]): the LSA emulation
//! (`DEEP_EP_RDMA_TRANSPORT` unset or `lsa`: all ranks in one NVLink domain emulate several nodes
//! of `DEEP_EP_NVL_DOMAIN_SIZE`; the descriptor travels by value in `InArgs::lsa`), or NCCL GIN
//! when the buffer holds a GIN device comm (`DEEP_EP_RDMA_TRANSPORT=gin`; a machine without GIN
//! fails at creation, with the reason): then `InArgs::net` points at a `GinNet` in the own window
//! ([`write_gin_net`] at creation; an LL-mode buffer passes its LL seam's) and the kernels' GIN
//! instantiation runs, every put and signal on context 0 with the signal ids of
//! [`super::gin::ht_signal`] (never reset: they must start at 0, as a fresh GIN device comm's do).
//! Only the ranks of the own NVLink domain are touched by pointer (node barriers, the NVLink
//! leg); other nodes only through the seam, as a real cluster requires.
//!
//! Host syncs: only a dispatch without `num_worst_tokens` waits for the notify's counts (between
//! prepare and finish); cached dispatch and combine never wait. Errors the kernels find (input
//! checks, worst-case overflow, capacity, stale handles, mismatching ops) are agreed by a global
//! barrier, reported on every rank and raised by the next host-side call (or the dispatch's wait).
//! A capacity error the host finds before launching is raised on that rank alone (its peers then
//! time out), as with intranode.

use super::normal::{channels, check_blocks, i32_of, is_int64, opt_ptr, opt_ptr_mut, ptr, ptr_mut, scales_of};
use super::signals::ht_base;
use super::PeerBackend;
use crate::backend::internode::{
    InternodeCachedDispatchArgs, InternodeCombineArgs, InternodeDispatchArgs, InternodeDispatchOutputs, InternodeHandle, InternodePlan,
};
use crate::backend::{CombineOutputs, DispatchPlan, InternodeMode};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernels::internode::{self as k, kind, step, InArgs};
use crate::kernels::internode::{NET_GIN, NET_LSA, NET_OFF};
use crate::kernels::intranode::{CheckArgs, CONTROL_BYTES, MAX_LOCAL_EXPERTS};
use crate::kernels::transport::{LsaDesc, MAX_LSA_PEERS};
use crate::tensor::TensorRef;
use std::ffi::c_void;

const DISPATCH: &str = crate::op_names::INTERNODE_DISPATCH;
const CACHED: &str = crate::op_names::INTERNODE_CACHED_DISPATCH;
const COMBINE: &str = crate::op_names::INTERNODE_COMBINE;

fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Bytes of one RDMA-leg token record (`internode.cuh`, `record`) of a buffer over `rr` nodes:
/// row, scales, int64 top-k ids, weights, then the source token (i32) and a routing byte per node,
/// each part 16-aligned.
pub fn record_bytes(row_bytes: usize, scales: usize, topk: usize, rr: usize) -> usize {
    align(row_bytes, 16) + align(4 * scales, 16) + align(8 * topk, 16) + align(4 * topk, 16) + align(4 + rr, 16)
}

/// Bytes of one exchange block (`internode.cuh`): header, per-node counts and, for dispatch, the
/// destination node's channel prefixes and expert counts.
pub fn block_bytes(rr: usize, d: usize, c: usize, el: usize, dispatch: bool) -> usize {
    let ints = 4 + rr + if dispatch { c + d * c + d * el } else { 0 };
    align(4 * ints, 16)
}

/// FNV-1a of the op's shape: every rank of one op must compute the same value.
fn signature(words: &[u64]) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
    }
    h as i32
}

/// How a buffer's normal-mode kernels reach other nodes (`InArgs::net_kind`, `net`, `sig_base`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HtNet {
    /// `NET_LSA` or `NET_GIN`.
    pub kind: i32,
    /// GIN: offset of the `GinNet` in this rank's window.
    pub desc_off: usize,
    /// First seam signal id ([`super::gin::ht_signal`]).
    pub sig_base: usize,
}

/// The seam of a buffer's normal-mode ops: the LSA emulation unless the buffer holds a GIN device
/// comm (`gin`); with one, the `GinNet` at `NET_OFF` (normal-mode buffers, [`write_gin_net`]) or
/// the LL seam's at `ll_gin_desc` (low-latency buffers, which may run normal-mode ops too) and the
/// signals from [`ht_base`]. Pure.
pub(super) fn ht_net(op: &'static str, gin: bool, low_latency_mode: bool, ll_gin_desc: Option<usize>) -> Result<HtNet> {
    if !gin {
        return Ok(HtNet { kind: NET_LSA, desc_off: 0, sig_base: 0 });
    }
    let desc_off = if low_latency_mode {
        ll_gin_desc.ok_or_else(|| Error::invalid(op, "internal: a low-latency GIN buffer without its GIN seam descriptor"))?
    } else {
        NET_OFF
    };
    Ok(HtNet { kind: NET_GIN, desc_off, sig_base: ht_base(low_latency_mode) })
}

/// Geometry and window areas of one op.
struct Geo {
    d: usize,
    rr: usize,
    c: usize,
    data_off: usize,
    data_end: usize,
}

impl Geo {
    /// End of the two exchange regions (start of the op's areas), 128-aligned.
    fn ex_end(&self, blk: usize) -> usize {
        align(self.data_off + 2 * self.rr * blk, 128)
    }
}

impl PeerBackend {
    fn in_geo(&self, op: &'static str, config: &Config) -> Result<Geo> {
        let (nr, d) = (self.info.num_ranks, self.info.nvl_domain_size);
        // crate::ops checked that the ranks span several domains of d.
        let rr = nr / d;
        let c = channels(op, config)?;
        crate::ensure!(nr <= MAX_LSA_PEERS, op, "internal: {nr} ranks for the LSA emulation");
        let data_off = k::CTRL_OFF + k::CTRL_BYTES;
        let data_end = if self.info.low_latency_mode { CONTROL_BYTES + self.info.num_nvl_bytes } else { self.window.bytes() };
        crate::ensure!(
            data_end > data_off + (1 << 20),
            op,
            "the buffer's window ({} bytes) leaves no room for internode data: raise num_nvl_bytes / num_rdma_bytes",
            self.window.bytes()
        );
        Ok(Geo { d, rr, c, data_off, data_end })
    }

    /// The seam of this buffer's normal-mode ops ([`ht_net`]).
    fn ht_net(&self, op: &'static str) -> Result<HtNet> {
        let ll_gin = self.seam.filter(|s| s.kind == super::ll_seam::NET_GIN).map(|s| s.layout.desc_off);
        ht_net(op, self.window.gin().is_some(), self.info.low_latency_mode, ll_gin)
    }

    /// The arguments every step shares.
    fn in_args(&self, op: &'static str, g: &Geo, kind: i32, config: &Config) -> Result<InArgs> {
        let ctx = self.window.ctx();
        let nr = self.info.num_ranks;
        let net = self.ht_net(op)?;
        // GIN: the descriptor in this rank's own window (written, and checked to fit, at creation).
        let net_ptr = if net.kind == NET_GIN { (ctx.own_base() as *const u8).wrapping_add(net.desc_off).cast() } else { std::ptr::null() };
        let mut lsa = LsaDesc {
            peer_base: [std::ptr::null_mut(); MAX_LSA_PEERS],
            rank: ctx.rank,
            num_ranks: ctx.num_ranks,
            num_contexts: 1,
            num_signals: k::NUM_SIGNALS,
            signal_off: k::SIGNAL_OFF,
            window_bytes: ctx.window_bytes,
        };
        // Every rank's window (the emulation's reach), not the ctx's own NVLink domain only.
        lsa.peer_base[..nr].copy_from_slice(&self.window.lsa_bases()[..nr]);
        Ok(InArgs {
            lsa,
            kind,
            nvl_size: g.d as i32,
            num_rdma_ranks: g.rr as i32,
            num_channels: g.c as i32,
            num_blocks: i32_of(config.num_sms.max(1)),
            data_off: g.data_off as u64,
            data_end: g.data_end as u64,
            net: net_ptr,
            net_kind: net.kind,
            sig_base: net.sig_base as i32,
            ..Default::default()
        })
    }

    fn capacity(&self, op: &'static str, what: &str, need: usize, have: usize) -> Result<()> {
        if need > have {
            return Err(Error::invalid(op, format!(
                "tokens over capacity: {what} needs {} KiB of the buffer's window, which has {} KiB for it (num_nvl_bytes = {}, num_rdma_bytes = {})",
                need >> 10, have >> 10, self.info.num_nvl_bytes, self.info.num_rdma_bytes
            )));
        }
        Ok(())
    }

    fn launch(&self, op: &'static str, a: &InArgs, s: i32, stream: *mut c_void) -> Result<()> {
        // SAFETY: launch contract: the args hold only the op's tensors (validated by crate::ops and above) and this buffer's window.
        unsafe { k::launch(op, self.window.ctx(), a, s, stream) }
    }

    /// Arguments of a dispatch (both halves): inputs, geometry, staging checked against the window.
    fn dispatch_args(&self, a: &InternodeDispatchArgs) -> Result<InArgs> {
        let b = &a.base;
        let g = self.in_geo(DISPATCH, &b.config)?;
        let nr = self.info.num_ranks;
        let (n, rb) = (b.x.size(0), b.x.size(1) * b.x.dtype.size());
        let s = b.x_scales.as_ref().map_or(0, |t| t.size(1));
        let kk = b.topk_idx.as_ref().map_or(0, |t| t.size(1));
        let el = b.num_experts / nr;
        crate::ensure!(
            el <= MAX_LOCAL_EXPERTS,
            DISPATCH,
            "{el} local experts per rank is above the nccl backend's limit of {MAX_LOCAL_EXPERTS}"
        );
        crate::ensure!(b.x.is_contiguous(), DISPATCH, "x must be contiguous on the nccl backend");
        let blk = block_bytes(g.rr, g.d, g.c, el, true);
        let rec = record_bytes(rb, s, kk, g.rr);
        let ex_end = g.ex_end(blk);
        let mid = ex_end + (g.data_end.saturating_sub(ex_end) / 2) / 128 * 128;
        self.capacity(DISPATCH, "staging this rank's tokens", align(ex_end + 4 * n * g.rr, 128) + n * rec, mid)?;
        let mut args = self.in_args(DISPATCH, &g, kind::DISPATCH, &b.config)?;
        let (scales, st0, st1) = scales_of(b.x_scales.as_ref());
        args.num_local_experts = el as i32;
        args.num_topk = kk as i32;
        args.num_scales = s as i32;
        args.topk_is_int64 = is_int64(b.topk_idx.as_ref());
        args.expert_alignment = i32_of(b.expert_alignment.max(1));
        args.signature = signature(&[
            kind::DISPATCH as u64,
            rb as u64,
            s as u64,
            kk as u64,
            b.num_experts as u64,
            g.c as u64,
            g.data_end as u64,
            b.topk_weights.is_some() as u64,
        ]);
        args.num_tokens = n as i64;
        args.row_bytes = rb as i64;
        args.num_worst = b.num_worst_tokens as i64;
        args.scale_stride0 = st0;
        args.scale_stride1 = st1;
        args.block_bytes = blk as u64;
        args.record_bytes = rec as u64;
        args.x = ptr(&b.x);
        args.x_scales = scales;
        args.topk_idx = opt_ptr(b.topk_idx.as_ref());
        args.topk_weights = opt_ptr(b.topk_weights.as_ref());
        args.num_tokens_per_rdma_rank = ptr(&a.num_tokens_per_rdma_rank);
        args.num_tokens_per_expert = ptr(&b.num_tokens_per_expert);
        args.is_token_in_rank = ptr(&b.is_token_in_rank);
        Ok(args)
    }

    /// The handle's input pointers.
    fn handle_ptrs(args: &mut InArgs, h: &InternodeHandle) {
        args.is_token_in_rank = ptr(&h.is_token_in_rank);
        args.h_rdma_cpm = ptr(&h.rdma_channel_prefix_matrix);
        args.h_recv_rdma_cpm = ptr(&h.recv_rdma_channel_prefix_matrix);
        args.h_recv_rdma_rps = ptr(&h.recv_rdma_rank_prefix_sum);
        args.h_recv_gbl_cpm = ptr(&h.recv_gbl_channel_prefix_matrix);
        args.h_recv_gbl_rps = ptr(&h.recv_gbl_rank_prefix_sum);
        args.h_send_rdma_head = ptr(&h.send_rdma_head);
        args.h_send_nvl_head = ptr(&h.send_nvl_head);
        args.num_rows = h.recv_src_meta.size(0) as i64;
        args.num_rdma_rows = h.send_nvl_head.size(0) as i64;
    }
}

impl InternodeMode for PeerBackend {
    fn internode_dispatch_prepare(&mut self, a: &InternodeDispatchArgs) -> Result<InternodePlan> {
        let b = &a.base;
        self.check_pending(DISPATCH, b.stream)?;
        let mut args = self.dispatch_args(a)?;
        let host_counts = b.num_worst_tokens == 0;
        let checked = crate::settings::check_inputs();
        args.write_host_counts = host_counts as i32;
        args.input_checked = checked as i32;
        if host_counts {
            self.window.status().set_recv_count(-1);
        }
        self.launch(DISPATCH, &args, step::SEND_SIDE, b.stream)?;
        if checked {
            let (n, kk) = (b.x.size(0), args.num_topk as usize);
            let c = args.num_channels as usize;
            let checks = CheckArgs {
                topk_idx: opt_ptr(b.topk_idx.as_ref()),
                topk_is_int64: args.topk_is_int64,
                num_blocks: check_blocks(&b.config, n, self.info.num_ranks * c),
                num_tokens_per_rank: ptr(&b.num_tokens_per_rank),
                num_tokens_per_expert: ptr(&b.num_tokens_per_expert),
                is_token_in_rank: ptr(&b.is_token_in_rank),
                num_tokens: n as i64,
                num_topk: kk as i64,
                num_experts: b.num_experts as i64,
                num_channels: c as i64,
                ..Default::default()
            };
            self.check_inputs(DISPATCH, checks, b.stream)?;
        }
        self.launch(DISPATCH, &args, step::NOTIFY, b.stream)?;
        let el = args.num_local_experts as usize;
        if !host_counts {
            let w = b.num_worst_tokens;
            return Ok(InternodePlan {
                plan: DispatchPlan { num_recv_tokens: 0, num_rows: w, num_recv_tokens_per_expert: vec![0; el] },
                num_rdma_recv_tokens: 0,
                num_rdma_rows: w,
            });
        }
        let rows = self.wait_recv_count(DISPATCH, b.stream)?;
        let rdma = self.window.status().recv_rdma_count().max(0) as usize;
        let plan = DispatchPlan { num_recv_tokens: rows, num_rows: rows, num_recv_tokens_per_expert: self.window.status().per_expert(el) };
        Ok(InternodePlan { plan, num_rdma_recv_tokens: rdma, num_rdma_rows: rdma })
    }

    fn internode_dispatch_finish(&mut self, a: &InternodeDispatchArgs, p: &InternodePlan, o: &InternodeDispatchOutputs) -> Result<()> {
        let (nr, n) = (self.info.num_ranks, a.base.x.size(0));
        let mut args = self.dispatch_args(a)?;
        let (rows, rdma) = (p.plan.num_rows, p.num_rdma_rows);
        let (rr, c) = (args.num_rdma_ranks as usize, args.num_channels as usize);
        let sized = |t: &TensorRef, len: usize| t.numel() == len && t.is_contiguous();
        let ok = o.recv_x.size(0) == rows
            && o.recv_x.is_contiguous()
            && sized(&o.handle.recv_src_meta, rows * 8)
            && sized(&o.handle.send_nvl_head, rdma * 8)
            && sized(&o.handle.send_rdma_head, n * rr)
            && sized(&o.handle.rdma_channel_prefix_matrix, rr * c)
            && sized(&o.handle.recv_rdma_channel_prefix_matrix, rr * c)
            && sized(&o.handle.gbl_channel_prefix_matrix, nr * c)
            && sized(&o.handle.recv_gbl_channel_prefix_matrix, nr * c)
            && sized(&o.handle.recv_rdma_rank_prefix_sum, rr)
            && sized(&o.handle.recv_gbl_rank_prefix_sum, nr)
            && o.recv_topk_idx.as_ref().map_or(true, |t| t.size(0) == rows && t.is_contiguous() && is_int64(Some(t)) == args.topk_is_int64)
            && o.recv_x_scales.as_ref().map_or(true, |t| t.size(0) == rows && t.is_contiguous());
        crate::ensure!(ok, DISPATCH, "internal: internode dispatch outputs do not match the plan ({rows} rows, {rdma} RDMA rows)");
        args.num_rows = rows as i64;
        args.num_rdma_rows = rdma as i64;
        args.node_barrier = 1;
        args.recv_x = o.recv_x.data_ptr().cast();
        args.recv_scales = opt_ptr_mut(o.recv_x_scales.as_ref());
        args.recv_topk_idx = opt_ptr_mut(o.recv_topk_idx.as_ref());
        args.recv_topk_weights = opt_ptr_mut(o.recv_topk_weights.as_ref());
        args.recv_src_meta = ptr_mut(&o.handle.recv_src_meta);
        args.rdma_cpm = ptr_mut(&o.handle.rdma_channel_prefix_matrix);
        args.gbl_cpm = ptr_mut(&o.handle.gbl_channel_prefix_matrix);
        args.recv_rdma_cpm = ptr_mut(&o.handle.recv_rdma_channel_prefix_matrix);
        args.recv_rdma_rps = ptr_mut(&o.handle.recv_rdma_rank_prefix_sum);
        args.recv_gbl_cpm = ptr_mut(&o.handle.recv_gbl_channel_prefix_matrix);
        args.recv_gbl_rps = ptr_mut(&o.handle.recv_gbl_rank_prefix_sum);
        args.send_rdma_head = ptr_mut(&o.handle.send_rdma_head);
        args.send_nvl_head = ptr_mut(&o.handle.send_nvl_head);
        let stream = a.base.stream;
        for s in [step::RDMA_SEND, step::STEP, step::NVL_RECV] {
            self.launch(DISPATCH, &args, s, stream)?;
        }
        Ok(())
    }

    fn internode_cached_dispatch(
        &mut self,
        a: &InternodeCachedDispatchArgs,
        recv_x: &TensorRef,
        recv_scales: Option<&TensorRef>,
    ) -> Result<()> {
        self.check_pending(CACHED, a.stream)?;
        let g = self.in_geo(CACHED, &a.config)?;
        let (n, rb) = (a.x.size(0), a.x.size(1) * a.x.dtype.size());
        let s = a.x_scales.as_ref().map_or(0, |t| t.size(1));
        let rows = a.handle.recv_src_meta.size(0);
        crate::ensure!(a.x.is_contiguous(), CACHED, "x must be contiguous on the nccl backend");
        crate::ensure!(
            recv_x.size(0) == rows && recv_x.is_contiguous() && recv_scales.map_or(true, |t| t.size(0) == rows && t.is_contiguous()),
            CACHED,
            "internal: outputs do not have {rows} rows"
        );
        let blk = block_bytes(g.rr, g.d, g.c, 0, true);
        let rec = record_bytes(rb, s, 0, g.rr);
        let ex_end = g.ex_end(blk);
        let mid = ex_end + (g.data_end.saturating_sub(ex_end) / 2) / 128 * 128;
        self.capacity(CACHED, "staging this rank's tokens", align(ex_end + 4 * n * g.rr, 128) + n * rec, mid)?;
        let mut args = self.in_args(CACHED, &g, kind::CACHED, &a.config)?;
        Self::handle_ptrs(&mut args, &a.handle);
        let (scales, st0, st1) = scales_of(a.x_scales.as_ref());
        args.num_scales = s as i32;
        args.signature = signature(&[kind::CACHED as u64, rb as u64, s as u64, g.c as u64, g.data_end as u64]);
        args.num_tokens = n as i64;
        args.row_bytes = rb as i64;
        args.scale_stride0 = st0;
        args.scale_stride1 = st1;
        args.block_bytes = blk as u64;
        args.record_bytes = rec as u64;
        args.node_barrier = 1;
        args.x = ptr(&a.x);
        args.x_scales = scales;
        args.recv_x = recv_x.data_ptr().cast();
        args.recv_scales = opt_ptr_mut(recv_scales);
        for st in [step::SEND_SIDE, step::NOTIFY, step::RDMA_SEND, step::STEP, step::NVL_RECV] {
            self.launch(CACHED, &args, st, a.stream)?;
        }
        Ok(())
    }

    fn internode_combine(&mut self, a: &InternodeCombineArgs, o: &CombineOutputs) -> Result<()> {
        self.check_pending(COMBINE, a.stream)?;
        let g = self.in_geo(COMBINE, &a.config)?;
        let nr = self.info.num_ranks;
        let (rows, hidden) = (a.x.size(0), a.x.size(1));
        let kk = a.topk_weights.as_ref().map_or(0, |w| w.size(1));
        let n = o.combined_x.size(0);
        let rdma_rows = a.handle.send_nvl_head.size(0);
        crate::ensure!(
            o.combined_x.numel() == n * hidden
                && o.combined_x.is_contiguous()
                && o.combined_topk_weights.as_ref().map_or(kk == 0, |w| w.numel() == n * kk),
            COMBINE,
            "internal: combine outputs do not match [{n}, {hidden}] / [{n}, {kk}]"
        );
        let contiguous = a.x.is_contiguous()
            && a.topk_weights.as_ref().map_or(true, |t| t.is_contiguous())
            && [&a.bias_0, &a.bias_1].iter().all(|b| b.as_ref().map_or(true, |t| t.is_contiguous()));
        crate::ensure!(contiguous, COMBINE, "x, topk_weights and the biases must be contiguous on the nccl backend");
        let blk = block_bytes(g.rr, g.d, g.c, 0, false);
        let crec = align(hidden * 2, 16) + align(kk * 4, 16);
        let ex_end = g.ex_end(blk);
        let q = (g.data_end.saturating_sub(ex_end) / 3) / 128 * 128;
        self.capacity(COMBINE, "staging this rank's rows", align(4 * nr * g.c, 128) + align(rows * hidden * 2, 128) + rows * kk * 4, q)?;
        self.capacity(COMBINE, "the forwarded partials", rdma_rows * crec, q)?;
        self.capacity(COMBINE, "the partials this rank receives", n * g.rr * crec, q)?;
        let mut args = self.in_args(COMBINE, &g, kind::COMBINE, &a.config)?;
        Self::handle_ptrs(&mut args, &a.handle);
        args.num_rows = rows as i64; // rows of x (>= the handle's received rows, checked on the device)
        args.num_topk = kk as i32;
        args.signature = signature(&[kind::COMBINE as u64, hidden as u64, kk as u64, g.c as u64, g.data_end as u64]);
        args.num_tokens = n as i64;
        args.row_bytes = (hidden * 2) as i64;
        args.block_bytes = blk as u64;
        args.record_bytes = crec as u64;
        args.node_barrier = 1;
        args.x = ptr(&a.x);
        args.topk_weights = opt_ptr(a.topk_weights.as_ref());
        args.bias_0 = opt_ptr(a.bias_0.as_ref());
        args.bias_1 = opt_ptr(a.bias_1.as_ref());
        args.combined_x = ptr_mut(&o.combined_x);
        args.combined_w = opt_ptr_mut(o.combined_topk_weights.as_ref());
        for st in [step::C_BEGIN, step::C_STAGE, step::C_NODEBAR, step::C_FORWARD, step::STEP, step::C_FINAL] {
            self.launch(COMBINE, &args, st, a.stream)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_kernel_layout() {
        // bf16 hidden 200 (400 bytes), no scales, top-9: 400 + 0 + 80 + 48 + 16.
        assert_eq!(record_bytes(400, 0, 9, 2), 400 + 80 + 48 + 16);
        // FP8 hidden 208 with 1 scale, top-1.
        assert_eq!(record_bytes(208, 1, 1, 4), 208 + 16 + 16 + 16 + 16);
        // The meta grows past 12 nodes: 4 + 13 bytes -> 32, and 4 + 32 -> 48.
        assert_eq!(record_bytes(400, 0, 9, 13), 400 + 80 + 48 + 32);
        assert_eq!(record_bytes(400, 0, 9, 32), 400 + 80 + 48 + 48);
        // 2 nodes x 2, 3 channels, 4 local experts: 4 + 2 + 3 + 6 + 8 = 23 ints -> 96 bytes.
        assert_eq!(block_bytes(2, 2, 3, 4, true), 96);
        assert_eq!(block_bytes(2, 2, 3, 0, false), 32);
        let g = Geo { d: 2, rr: 2, c: 3, data_off: 1000, data_end: 1 << 20 };
        assert_eq!(g.ex_end(96), 1408); // 1000 + 2 * 2 * 96, rounded up to 128
    }

    #[test]
    fn args_mirror_the_header_and_the_gin_slot_is_free() {
        // InArgs (with net, net_kind, sig_base at the end) has the size of dek_in_args_t.
        k::check_struct_size("test").expect("dek_in_args_t and InArgs differ");
        assert_eq!(std::mem::size_of::<InArgs>() % 8, 0);
        // The GinNet slot is in the internode control area, after what the kernels use (kCtrlEnd:
        // 16 KiB, then two [R, C] and two [Rr, C] i32 tables sized for the maxima), and the
        // descriptor fits it (as it fits the LL seam's DESC_BYTES).
        use crate::kernels::intranode::MAX_CHANNELS;
        const CTRL_END: usize = k::CTRL_OFF + 16384 + 2 * 4 * (k::MAX_RANKS + k::MAX_NODES) * MAX_CHANNELS;
        const { assert!(NET_OFF >= CTRL_END && NET_OFF + k::NET_BYTES <= k::CTRL_OFF + k::CTRL_BYTES && NET_OFF % 128 == 0) };
        let l = crate::kernels::transport::gin_net_layout();
        assert!(l.bytes > 0 && l.bytes <= k::NET_BYTES.min(super::super::ll_seam::DESC_BYTES) && l.align <= 8, "{l:?}");
    }

    #[test]
    fn the_seam_follows_the_buffer_and_gin_signals_fit_its_plan() {
        use crate::backend::peer::gin::{buffer_plan, GinKnobs};
        use crate::backend::peer::signals::{ht, HtSignal};
        use crate::kernels::internode::MAX_NODES;
        // No GIN device comm: the LSA emulation, ids from 0 in the emulation's table.
        let lsa = ht_net("op", false, false, None).unwrap();
        assert_eq!(lsa, HtNet { kind: NET_LSA, desc_off: 0, sig_base: 0 });
        assert_eq!(ht_net("op", false, true, Some(4096)).unwrap(), lsa);
        assert!(ht(lsa.sig_base, HtSignal::Step, MAX_NODES - 1) < k::NUM_SIGNALS as usize);
        let gin = GinKnobs::parse(|n| (n == "DEEP_EP_RDMA_TRANSPORT").then(|| "gin".to_string())).unwrap();
        for (ll, desc) in [(false, None), (true, Some(1 << 30))] {
            let n = ht_net("op", true, ll, desc).unwrap();
            assert_eq!(n.kind, NET_GIN);
            // Normal-mode buffers: the slot written at creation; LL buffers: their LL seam's.
            assert_eq!(n.desc_off, desc.unwrap_or(NET_OFF));
            // Every id the kernels use (sig_base + kSigBar/kSigStep + node, node < MAX_NODES) lies inside
            // the signals the buffer asks NCCL for; in LL buffers after every LL seam id.
            for rr in 2..=MAX_NODES {
                let plan = buffer_plan(&gin, rr * 2, rr, ll).unwrap().expect("a GIN plan");
                for node in 0..rr {
                    for kind in [HtSignal::Barrier, HtSignal::Step] {
                        let s = ht(n.sig_base, kind, node);
                        assert!(
                            s < plan.signals && (!ll || s >= crate::backend::peer::signals::LL_SIGNALS),
                            "ll {ll} {kind:?} {node} -> {s}"
                        );
                    }
                }
            }
        }
        let e = ht_net(crate::op_names::INTERNODE_DISPATCH, true, true, None).unwrap_err().to_string();
        assert!(e.contains(crate::op_names::INTERNODE_DISPATCH) && e.contains("without its GIN seam descriptor"), "{e}");
    }

    #[test]
    fn signature_separates_shapes() {
        assert_eq!(signature(&[1, 2, 3]), signature(&[1, 2, 3]));
        assert_ne!(signature(&[1, 2, 3]), signature(&[1, 3, 2]));
    }
}
