//! Low-latency ops on the CPU backend: DeepEP's LL protocol on shared memory. Senders *push*
//! messages into the receiver's LL area and then raise signal words; receivers wait for the
//! words of this call and copy or reduce. No barrier between ranks in any LL call.
//!
//! # LL area of one rank (`num_rdma_bytes`, sizes from [`LowLatencyLayout`])
//! `[signal 0][signal 1][send 0][send 1][recv 0][recv 1]` (DeepEP's byte order), so the area
//! DeepEP's `get_low_latency_rdma_size_hint` sizes is always enough. Per half `h`:
//! - signal: `E` 32-bit words (two per 64-bit atomic), shared by the dispatch and the combine
//!   that use this half (one at a time). Dispatch: word `l·R + s` = count from source rank `s`
//!   for local expert `l`. Combine: word `g = s·E_l + l` = source rank `s` has written all rows
//!   of its local expert `l`. Value `(seq mod 2^16) << 16 | (count + 1)` (combine: count 0).
//! - send: the zero-copy combine buffer, `[E_l][R·T]` rows of `M = H + H/128·2` bf16.
//! - recv: dispatch messages `[E_l][R][T]` of `dispatch_msg_bytes` (16-byte header
//!   `[src token, H, T, E]` i32, checked by the receiver so that ranks calling with different
//!   geometries get an error instead of garbage, then `H` bf16, or `H` E4M3 bytes + `H/128` f32 `scale_inv`), or
//!   combine slots `[E][T]` of `combine_slot_bytes` keyed by (global expert, source token):
//!   `H` bf16, or a [`logfmt`] slot.
//!
//! # Halves and sequence numbers
//! Every LL send (dispatch or combine) takes the half `LlState::next_half` and flips it, like
//! DeepEP's buffer index, and takes the next call number (one counter for both halves). All ranks issue the same LL
//! call sequence, so halves and numbers agree. Every call writes all `E` words of its half on
//! every rank, so a word always holds this call's tag, the previous call's tag or zero: no
//! cleaning between calls. The send op writes `[half, seq, flags, kind]` into `recv_state`
//! and the recv op works from that alone, so split calls may interleave (at most two in
//! flight, DeepEP's rule); a recv whose half was reused by a later send is an error.
//! Data is written with plain copies before the signal's release store; waits load with
//! acquire.
//!
//! # Abandoned calls
//! A call a rank gave up (its receive timed out) is never delivered to a late peer: `ll_tags.rs`.
//!
//! # Geometry changes
//! Where the signal words lie depends on `(T, H, E)`. When a send uses another geometry than
//! the previous LL call, a fast peer's new signals could land on words a slow peer still waits
//! on, and the new words may hold old payload bytes. So at such a send (all ranks reach the
//! same one) the ranks meet, zero their signal words of the new geometry, and meet again: the
//! only barriers of LL mode besides `clean_low_latency_buffer`. (A receive still in flight
//! across a geometry change is not supported.)

use super::ht::Kind;
use super::ll_payload::{format_code, nvfp4_bytes, nvfp4_cast, nvfp4_place};
use super::ll_state::{write_state, LlState};
use super::ll_tags::{abandoned, arrived, sig_load, sig_store, tag, KIND_COMBINE, KIND_DISPATCH};
use super::CpuBackend;
use crate::backend::{
    low_latency::{abandoned_error, dispatch_format_mismatch},
    LlCombineRecvArgs, LlCombineSendArgs, LlDispatchOptions, LlDispatchOutputs, LlDispatchSendArgs, LlGeometry, LlRowsArgs, LlStats,
    LlWire, LowLatencyMode, Stream, LL_MSG_META, LL_STATE_LEN, LL_WIRE_MAX_TOPK,
};
use crate::config::LowLatencyLayout;
use crate::error::{Error, Result};
use crate::numerics::{bf16, fp8, logfmt};
use crate::shm::{self, Region};
use crate::tensor::{DType, Device, TensorRef};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::op_names::{
    CLEAN_LOW_LATENCY_BUFFER as OP_CLEAN, GET_NEXT_LOW_LATENCY_COMBINE_BUFFER as OP_NEXT, LOW_LATENCY_COMBINE as OP_COMBINE,
    LOW_LATENCY_DISPATCH as OP_DISPATCH,
};
/// Combine's `recv_state` flag (dispatch's are `LlDispatchOptions::flags`).
const FLAG_LOGFMT: i64 = 8;
/// `recv_state` flag: the dispatch used the deduplicated wire format / the combine sent one
/// partial sum per (token, expert rank).
const FLAG_DEDUP: i64 = 16;
const FLAG_PARTIAL: i64 = 32;
const HEADER: usize = 16;

/// Byte geometry of one LL call.
struct Geo {
    r: usize,
    el: usize,
    e: usize,
    t: usize,
    h: usize,
    s: usize,
    /// Zero-copy row length in bf16 elements.
    m: usize,
    lay: LowLatencyLayout,
}

impl Geo {
    fn sig(&self, half: usize) -> usize {
        half * self.lay.signal_bytes
    }
    fn send(&self, half: usize) -> usize {
        2 * self.lay.signal_bytes + half * self.lay.send_bytes
    }
    fn recv(&self, half: usize) -> usize {
        2 * (self.lay.signal_bytes + self.lay.send_bytes) + half * self.lay.recv_bytes
    }
    /// Dispatch message of (local expert, source rank, slot).
    fn msg(&self, half: usize, l: usize, src: usize, slot: usize) -> usize {
        self.recv(half) + ((l * self.r + src) * self.t + slot) * self.lay.dispatch_msg_bytes
    }
    /// Combine slot of (global expert, source token).
    fn slot(&self, half: usize, e: usize, tok: usize) -> usize {
        self.recv(half) + (e * self.t + tok) * self.lay.combine_slot_bytes
    }
    /// Deduplicated message `m` of source rank `src`.
    fn dmsg(&self, w: &LlWire, half: usize, src: usize, m: usize) -> usize {
        self.recv(half) + w.msgs_off + (src * self.t + m) * w.msg_bytes
    }
    /// Index entry `[l][src][slot]`.
    fn idx(&self, w: &LlWire, half: usize, l: usize, src: usize, slot: usize) -> usize {
        self.recv(half) + w.idx_off + 4 * ((l * self.r + src) * self.t + slot)
    }
    /// Partial combine row of (expert rank, source token).
    fn partial(&self, w: &LlWire, half: usize, d: usize, tok: usize) -> usize {
        self.recv(half) + w.partial_off + (d * self.t + tok) * 2 * self.h
    }
}

/// The meta of a deduplicated message: source token and its `(local expert, slot, weight)`
/// entries in top-k order.
fn read_meta(reg: &Region, off: usize) -> (i32, [i32; 4], Vec<(usize, usize, f32)>) {
    let mut hdr = [0i32; 8];
    reg.read::<i32>(off, &mut hdr);
    let n = (hdr[4].max(0) as usize).min(LL_WIRE_MAX_TOPK);
    let (mut ent, mut w) = (vec![0u32; n], vec![0f32; n]);
    reg.read::<u32>(off + 32, &mut ent);
    reg.read::<f32>(off + 32 + 4 * LL_WIRE_MAX_TOPK, &mut w);
    let entries = ent.iter().zip(&w).map(|(&v, &wt)| ((v >> 16) as usize, (v & 0xffff) as usize, wt)).collect();
    (hdr[0], [hdr[0], hdr[1], hdr[2], hdr[3]], entries)
}

impl CpuBackend {
    /// Geometry of an LL call, checking what depends on this buffer: LL mode and capacity.
    fn ll_geo(&self, op: &'static str, g: &LlGeometry) -> Result<Geo> {
        let (r, e, t, h) = (self.info.num_ranks, g.num_experts, g.num_max_dispatch_tokens_per_rank, g.hidden);
        let lay = g.check_buffer(op, &self.info)?;
        Ok(Geo { r, el: e / r, e, t, h, s: h / fp8::GROUP, m: h + h / fp8::GROUP * 2, lay })
    }

    /// Zeroes this rank's signal words of both halves of `geo`.
    fn ll_zero_signals(&self, geo: &Geo) {
        let mine = self.ll_region(self.info.rank);
        for half in 0..2 {
            for off in (0..geo.lay.signal_bytes).step_by(8) {
                mine.atomic_u64(geo.sig(half) + off).store(0, Ordering::Relaxed);
            }
        }
    }

    /// Before a send: if the geometry differs from the last LL call's, all ranks meet, zero
    /// their signal words of the new geometry and meet again (see "Geometry changes" above).
    fn ll_enter_geometry(&mut self, op: &'static str, geo: &Geo) -> Result<()> {
        let key = (geo.t, geo.h, geo.e);
        match self.ll.geometry {
            Some(k) if k == key => return Ok(()),
            None => {
                self.ll.geometry = Some(key); // a fresh LL area is all zeros
                return Ok(());
            }
            Some(_) => {}
        }
        self.ll_rendezvous(op, Kind::LlGeometry, "every rank finished the calls of the previous low-latency geometry")?;
        self.ll_zero_signals(geo);
        self.ll.geometry = Some(key);
        self.barrier_among(op, "every rank zeroed its signals for the new low-latency geometry", true)
    }

    /// Takes the half for a new send: flips `next_half`, bumps its sequence number.
    fn ll_begin_send(&mut self) -> (usize, u32) {
        let half = self.ll.next_half;
        self.ll.next_half ^= 1;
        // Tags keep 16 bits of the counter; 0 is skipped so a zeroed word never matches.
        self.ll.calls = self.ll.calls.wrapping_add(1);
        if self.ll.calls & 0xffff == 0 {
            self.ll.calls = self.ll.calls.wrapping_add(1);
        }
        self.ll.seq[half] = self.ll.calls;
        (half, self.ll.seq[half])
    }

    /// `(half, seq, flags)` from a send op's `recv_state`, checked against this buffer.
    fn ll_read_state(&self, op: &'static str, st: &Option<TensorRef>, kind: i64) -> Result<(usize, u32, i64)> {
        let v = st.as_ref().ok_or_else(|| Error::invalid(op, "internal: a receive without recv_state"))?.cpu_slice::<i64>();
        crate::ensure!(v.len() >= LL_STATE_LEN, op, "recv_state must hold {LL_STATE_LEN} int64, got {}", v.len());
        let what = if kind == KIND_DISPATCH { "low_latency_dispatch_send" } else { "low_latency_combine_send" };
        crate::ensure!(
            v[3] == kind && (0..2).contains(&v[0]) && v[1] > 0,
            op,
            "recv_state {:?} was not produced by {what}",
            &v[..LL_STATE_LEN]
        );
        let (half, seq) = (v[0] as usize, v[1] as u32);
        crate::ensure!(
            self.ll.seq[half] == seq,
            op,
            "the buffer half of this receive was reused by a later low-latency send (at most two low-latency calls may be in flight), or the buffer was cleaned"
        );
        Ok((half, seq, v[2]))
    }

    /// Waits until `ready()` and returns the time waited; on expiry names `peers()` (the ranks
    /// that have not arrived), or in shrink mode masks them and returns `None`.
    fn ll_wait(
        &mut self,
        op: &'static str,
        what: impl Fn() -> String,
        mut ready: impl FnMut() -> bool,
        peers: impl Fn() -> Vec<usize>,
    ) -> Result<Option<Duration>> {
        let end = match shm::wait_until(self.timeout, &mut ready) {
            Ok(d) => return Ok(Some(d)),
            Err(end) => end,
        };
        let missing = peers();
        // Shrink mode goes on without the missing ranks: only they must not take this call's
        // messages; a raise (timeout or Ctrl-C) gives the call up towards everyone.
        let all: Vec<usize> = (0..self.info.num_ranks).filter(|&p| p != self.info.rank).collect();
        let masks = self.shrink && end == crate::error::WaitEnd::TimedOut;
        self.ll_abandon(if masks { &missing } else { &all });
        if self.shrink && end == crate::error::WaitEnd::TimedOut {
            crate::log_warn!(
                Some(self.info.rank),
                "{op}: ranks {missing:?} did not arrive within {} ms ({}); shrink mode masks them",
                self.timeout.as_millis(),
                what()
            );
            missing.iter().for_each(|&p| self.mask[p] = true);
            return Ok(None);
        }
        Err(Error::wait_ended(end, op, self.info.rank, missing, self.timeout.as_millis() as u64, what()))
    }
}

impl LowLatencyMode for CpuBackend {
    fn ll_dispatch_send(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        a: &LlDispatchSendArgs,
        out: &LlDispatchOutputs,
        _s: Stream,
    ) -> Result<()> {
        let geo = self.ll_geo(OP_DISPATCH, g)?;
        let (n, h, t, me) = (a.x.size(0), geo.h, geo.t, self.info.rank);
        crate::ensure!(h < 1 << 24, OP_DISPATCH, "hidden ({h}) must be below 2^24");
        // The message header's hidden word also carries the format, which receivers check.
        let h_word = h as i32 | (format_code(o) << 24);
        let k = if a.topk_idx.ndim() == 2 { a.topk_idx.size(1) } else { 0 };
        crate::ensure!(a.topk_idx.numel() == n * k, OP_DISPATCH, "topk_idx must be [{n}, num_topk], got {:?}", a.topk_idx.sizes());
        crate::ensure!(n <= t, OP_DISPATCH, "x has {n} tokens, more than num_max_dispatch_tokens_per_rank ({t})");
        let x = a.x.cpu_slice::<u16>();
        let idx = a.topk_idx.cpu_indices_i64();
        // Validate before any write so an error leaves the shared state untouched.
        let mut count = vec![0usize; geo.e];
        // The ids as routed (rows at or past `num_tokens` are -1 by now), in [-1, E).
        crate::layout::check_expert_ids(OP_DISPATCH, &idx, k, geo.e)?;
        for &e in idx.iter().filter(|&&e| e >= 0) {
            count[e as usize] += 1;
        }
        if let Some(e) = count.iter().position(|&c| c > t) {
            return Err(Error::invalid(
                OP_DISPATCH,
                format!(
                    "expert {e} is selected {} times, more than num_max_dispatch_tokens_per_rank ({t}) (repeated top-k entries?)",
                    count[e]
                ),
            ));
        }
        self.ll_enter_geometry(OP_DISPATCH, &geo)?;
        let (half, seq) = self.ll_begin_send();
        let regions: Vec<Region> = (0..geo.r).map(|d| self.ll_region(d)).collect();
        // The deduplicated format where it fits (the nccl backend's; outputs are the same).
        let wire = g.wire(geo.r).filter(|_| k <= LL_WIRE_MAX_TOPK);
        let weights = a.topk_weights.as_ref().map(|w| w.cpu_slice::<f32>());
        let mut slot = vec![0usize; geo.e];
        let mut nmsg = vec![0usize; geo.r];
        let mut per: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); geo.r];
        let (mut q, mut si) = (vec![0u8; h], vec![0f32; geo.s]);
        let mut q4 = vec![0u8; if o.use_nvfp4 { nvfp4_bytes(h) } else { 0 }];
        let gscale = a.x_global_scale.as_ref().and_then(|s| s.cpu_slice::<f32>().first().copied()).unwrap_or(1.0);
        for tok in 0..n {
            let sel = &idx[tok * k..(tok + 1) * k];
            if sel.iter().all(|&e| e < 0) {
                continue;
            }
            let row = &x[tok * h..(tok + 1) * h];
            if o.use_fp8 {
                fp8::ll_cast_token(row, o.round_scale, &mut q, &mut si);
            } else if o.use_nvfp4 {
                nvfp4_cast(row, gscale, &mut q4);
            }
            let write_payload = |reg: &Region, off: usize| {
                if o.use_fp8 {
                    reg.write::<u8>(off, &q);
                    reg.write::<f32>(off + h, &si);
                } else if o.use_nvfp4 {
                    reg.write::<u8>(off, &q4);
                } else {
                    reg.write::<u16>(off, row);
                }
            };
            if let Some(w) = &wire {
                // One message per destination rank, its entries in top-k order.
                per.iter_mut().for_each(Vec::clear);
                for (kk, &e) in sel.iter().enumerate().filter(|&(_, &e)| e >= 0 && !self.mask[e as usize / geo.el]) {
                    let e = e as usize;
                    per[e / geo.el].push((e % geo.el, slot[e], weights.map_or(0.0, |wt| wt[tok * k + kk])));
                    slot[e] += 1;
                }
                for (dst, ent) in per.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                    let (m, reg) = (nmsg[dst], &regions[dst]);
                    nmsg[dst] += 1;
                    let off = geo.dmsg(w, half, me, m);
                    reg.write::<i32>(off, &[tok as i32, h_word, t as i32, geo.e as i32, ent.len() as i32, weights.is_some() as i32, 0, 0]);
                    let packed: Vec<u32> = ent.iter().map(|&(l, sl, _)| (l as u32) << 16 | sl as u32).collect();
                    reg.write::<u32>(off + 32, &packed);
                    reg.write::<f32>(off + 32 + 4 * LL_WIRE_MAX_TOPK, &ent.iter().map(|e| e.2).collect::<Vec<f32>>());
                    write_payload(reg, off + LL_MSG_META);
                    for &(l, sl, _) in ent {
                        reg.write::<u32>(geo.idx(w, half, l, me, sl), &[m as u32]);
                    }
                }
                continue;
            }
            // Experts of masked ranks are dropped: nothing is sent to a dead rank.
            for &e in sel.iter().filter(|&&e| e >= 0 && !self.mask[e as usize / geo.el]) {
                let e = e as usize;
                let (dst, l) = (e / geo.el, e % geo.el);
                let off = geo.msg(half, l, me, slot[e]);
                slot[e] += 1;
                let reg = &regions[dst];
                reg.write::<i32>(off, &[tok as i32, h_word, t as i32, geo.e as i32]);
                write_payload(reg, off + HEADER);
            }
        }
        if wire.is_some() {
            for dst in (0..geo.r).filter(|&d| !self.mask[d]) {
                regions[dst].write::<u32>(geo.recv(half) + LlWire::count_off(me), &[nmsg[dst] as u32]);
            }
        }
        // Every (rank, local expert) gets a count, zero included, so receivers need no CPU.
        for (e, &c) in count.iter().enumerate().filter(|(e, _)| !self.mask[e / geo.el]) {
            sig_store(&regions[e / geo.el], geo.sig(half), (e % geo.el) * geo.r + me, tag(seq, c));
        }
        self.ll.dispatches += 1;
        let src_addr = out.src_info.data_ptr() as usize;
        self.ll.dispatch[half] = Some((src_addr, wire.is_some() && weights.is_some(), self.ll.dispatches));
        self.ll.received[half] = false;
        self.ll.record_routing(src_addr, &idx, k, weights);
        write_state(&out.recv_state, half, seq, o.flags() | if wire.is_some() { FLAG_DEDUP } else { 0 }, KIND_DISPATCH);
        Ok(())
    }

    fn ll_dispatch_recv(
        &mut self,
        g: &LlGeometry,
        o: &LlDispatchOptions,
        out: &LlDispatchOutputs,
        stats: &LlStats,
        _s: Stream,
    ) -> Result<()> {
        let geo = self.ll_geo(OP_DISPATCH, g)?;
        let (half, seq, flags) = self.ll_read_state(OP_DISPATCH, &out.recv_state, KIND_DISPATCH)?;
        self.ll.receiving = Some((KIND_DISPATCH, geo.sig(half), seq));
        crate::ensure!(
            flags & !FLAG_DEDUP == o.flags(),
            OP_DISPATCH,
            "the options of the receive ({o:?}) differ from those of the send (flags {flags})"
        );
        let wire = if flags & FLAG_DEDUP != 0 { g.wire(self.info.num_ranks) } else { None };
        let (r, el, t, h, s) = (geo.r, geo.el, geo.t, geo.h, geo.s);
        let rt = r * t;
        crate::ensure!(!o.use_ue8m0 || s % 4 == 0, OP_DISPATCH, "use_ue8m0 needs hidden % 512 == 0, got {h}");
        let mine = self.ll_region(self.info.rank);
        let recv_count = out.recv_count.cpu_slice_mut::<i32>();
        let src_info = out.src_info.cpu_slice_mut::<i32>();
        let layout_range = out.layout_range.cpu_slice_mut::<i64>();
        let (x16, x8) = if o.use_fp8 || o.use_nvfp4 {
            (&mut [][..], out.recv_x.cpu_slice_mut::<u8>())
        } else {
            (out.recv_x.cpu_slice_mut::<u16>(), &mut [][..])
        };
        let sf4 = out.recv_x_scales.as_ref().filter(|_| o.use_nvfp4).map_or(&mut [][..], |s| s.cpu_slice_mut::<u8>());
        let mut sf4_row = vec![0u8; if o.use_nvfp4 { h / crate::numerics::nvfp4::BLOCK } else { 0 }];
        let scales = out.recv_x_scales.as_ref().filter(|_| o.use_fp8);
        let (sf, su, st) = match scales {
            Some(sc) if o.use_ue8m0 => (&mut [][..], sc.cpu_dense_storage_mut::<i32>(), sc.strides().to_vec()),
            Some(sc) => (sc.cpu_dense_storage_mut::<f32>(), &mut [][..], sc.strides().to_vec()),
            None => (&mut [][..], &mut [][..], vec![0; 3]),
        };
        let mut waited = vec![0u64; r];
        let mut si = vec![0f32; s];
        let sig = geo.sig(half);
        for l in 0..el {
            let mut begin = 0usize;
            for src in 0..r {
                let w = l * r + src;
                // A masked source sends nothing: its block is empty (also when shrink mode
                // masks it here after a timeout).
                let d = if self.mask[src] {
                    None
                } else {
                    self.ll_wait(
                        OP_DISPATCH,
                        || {
                            format!(
                                "dispatch count of local expert {l} from rank {src} (half {half}, call {seq}); word holds {:#x}",
                                sig_load(&mine, sig, w)
                            )
                        },
                        || {
                            let v = sig_load(&mine, sig, w);
                            arrived(v, seq).is_some() || abandoned(v, seq)
                        },
                        || vec![src],
                    )?
                };
                if d.is_some() && abandoned(sig_load(&mine, sig, w), seq) {
                    return Err(abandoned_error(OP_DISPATCH, self.info.rank, src, seq, "a dispatch"));
                }
                let Some(d) = d else {
                    layout_range[l * r + src] = (begin as i64) << 32;
                    continue;
                };
                waited[src] += d.as_nanos() as u64;
                self.waits[src][0] += 1;
                self.waits[src][1] += d.as_nanos() as i64;
                let count = arrived(sig_load(&mine, sig, w), seq).unwrap_or(0);
                crate::ensure!(count <= t, OP_DISPATCH, "rank {src} announced {count} tokens for local expert {l}, more than {t}");
                layout_range[l * r + src] = ((begin as i64) << 32) | count as i64;
                for i in 0..count {
                    let (off, row) = (geo.msg(half, l, src, i), l * rt + begin + i);
                    // Deduplicated: the index entry names the message, its payload follows the meta.
                    let (off, payload) = match &wire {
                        Some(w) => {
                            let mut m = [0u32];
                            mine.read::<u32>(geo.idx(w, half, l, src, i), &mut m);
                            crate::ensure!(
                                (m[0] as usize) < t,
                                OP_DISPATCH,
                                "rank {src} wrote index entry {} for local expert {l}, row {i}: not a message",
                                m[0]
                            );
                            let off = geo.dmsg(w, half, src, m[0] as usize);
                            (off, off + LL_MSG_META)
                        }
                        None => (off, off + HEADER),
                    };
                    let mut hdr = [0i32; 4];
                    mine.read::<i32>(off, &mut hdr);
                    let (their_h, their_fmt) = (hdr[1] & 0xff_ffff, (hdr[1] >> 24) & 0xff);
                    if hdr[1..] == [0, 0, 0] {
                        // Nothing where this rank's layout puts the message: the sender laid it out
                        // for another geometry (offsets depend on hidden, T and E).
                        self.ll.geometry = Some((0, 0, 0));
                        return Err(Error::invalid(
                            OP_DISPATCH,
                            format!(
                                "rank {src} announced {count} tokens for local expert {l}, but no message lies where this rank's \
                             (hidden, num_max_dispatch_tokens_per_rank, num_experts) = ({h}, {t}, {}) puts it: rank {src} \
                             dispatched with others; every rank must pass the same values",
                                geo.e
                            ),
                        ));
                    }
                    if [their_h, hdr[2], hdr[3]] != [h as i32, t as i32, geo.e as i32] {
                        self.ll.geometry = Some((0, 0, 0)); // ranks disagree: the next send meets and re-zeroes
                        return Err(Error::invalid(OP_DISPATCH, format!(
                            "a message from rank {src} for local expert {l} carries (hidden, num_max_dispatch_tokens_per_rank, num_experts) = ({their_h}, {}, {}), this rank receives with ({h}, {t}, {}): every rank must pass the same values",
                            hdr[2], hdr[3], geo.e
                        )));
                    }
                    if their_fmt != format_code(o) {
                        self.ll.geometry = Some((0, 0, 0));
                        return Err(Error::invalid(OP_DISPATCH, dispatch_format_mismatch(src, their_fmt, format_code(o), "receives")));
                    }
                    src_info[row] = hdr[0];
                    if o.use_nvfp4 {
                        nvfp4_place(&mine, payload, h, l, begin + i, rt, x8, sf4, &mut sf4_row);
                        continue;
                    }
                    if !o.use_fp8 {
                        mine.read::<u16>(payload, &mut x16[row * h..(row + 1) * h]);
                        continue;
                    }
                    mine.read::<u8>(payload, &mut x8[row * h..(row + 1) * h]);
                    mine.read::<f32>(payload + h, &mut si);
                    let base = l as i64 * st[0] + (begin + i) as i64 * st[1];
                    for (gi, &v) in si.iter().enumerate() {
                        if o.use_ue8m0 && !su.is_empty() {
                            // Byte gi % 4 of int32 pack gi / 4 (little-endian).
                            let p = &mut su[(base + (gi / 4) as i64 * st[2]) as usize];
                            let mut b = p.to_le_bytes();
                            b[gi % 4] = fp8::ue8m0(v);
                            *p = i32::from_le_bytes(b);
                        } else if !sf.is_empty() {
                            sf[(base + gi as i64 * st[2]) as usize] = v;
                        }
                    }
                }
                begin += count;
            }
            recv_count[l] = begin as i32;
        }
        if let Some(c) = &stats.cumulative_local_expert_recv_stats {
            for (a, &b) in c.cpu_slice_mut::<i32>().iter_mut().zip(recv_count.iter()) {
                *a += b;
            }
        }
        if let Some(w) = &stats.wait_recv_cost_stats {
            for (a, &b) in w.cpu_slice_mut::<i64>().iter_mut().zip(&waited) {
                *a += b as i64;
            }
        }
        crate::backend::ll_mark_received(&self.ll.dispatch, &mut self.ll.received, out.src_info.data_ptr() as usize);
        Ok(())
    }

    fn ll_combine_send(&mut self, g: &LlGeometry, a: &LlCombineSendArgs, _s: Stream) -> Result<()> {
        let geo = self.ll_geo(OP_COMBINE, g)?;
        crate::backend::ll_check_received(OP_COMBINE, &self.ll.dispatch, &self.ll.received, a.src_info.data_ptr() as usize)?;
        crate::ensure!(!(a.use_logfmt && a.zero_copy), OP_COMBINE, "zero_copy and use_logfmt cannot be used together");
        let (r, el, t, h, me) = (geo.r, geo.el, geo.t, geo.h, self.info.rank);
        let rt = r * t;
        let layout_range = a.layout_range.cpu_slice::<i64>();
        let src_info = a.src_info.cpu_slice::<i32>();
        crate::ensure!(
            layout_range.len() == el * r && src_info.len() == el * rt,
            OP_COMBINE,
            "handle shapes do not match num_experts={} and num_ranks={r}",
            geo.e
        );
        let range = |l: usize, s: usize| {
            let v = layout_range[l * r + s];
            ((v >> 32) as usize, (v & 0xffff_ffff) as usize)
        };
        for l in 0..el {
            for s in 0..r {
                let (b, c) = range(l, s);
                crate::ensure!(
                    b + c <= rt && c <= t,
                    OP_COMBINE,
                    "layout_range[{l}][{s}] = (begin {b}, count {c}) is outside the {rt} rows of an expert"
                );
                for row in b..b + c {
                    let tok = src_info[l * rt + row];
                    crate::ensure!((0..t as i32).contains(&tok), OP_COMBINE, "src_info[{l}][{row}] = {tok} is not a token index below {t}");
                }
            }
        }
        a.signal.as_ref().map_or(Ok(()), |sig| sig.check_raised(OP_COMBINE, g, r, layout_range))?;
        let x = if a.zero_copy { &[][..] } else { a.x.cpu_slice::<u16>() };
        // Partial sums when this handle's dispatch sent weights in the deduplicated format.
        let src_ptr = a.src_info.data_ptr() as usize;
        let partial = crate::backend::ll_weighted_dispatch_half(&self.ll.dispatch, src_ptr)
            .and_then(|hd| g.wire(r).filter(|w| w.partial_fits && !a.use_logfmt).map(|w| (hd, w)));
        if let Some((hd, _)) = partial {
            // Partial sums read the dispatch's messages back from the receive half. A reset of the
            // LL part between the dispatch and this combine (get_local_buffer_tensor(...).zero_())
            // erased them: every source with rows has at least one message, so raise (on every
            // rank that reset, before anything is sent) instead of sending zeros.
            let mine = self.ll_region(me);
            for s in (0..r).filter(|&s| !self.mask[s]) {
                let rows: usize = (0..el).map(|l| range(l, s).1).sum();
                let mut nm = [0u32];
                mine.read::<u32>(geo.recv(hd) + LlWire::count_off(s), &mut nm);
                crate::ensure!(
                    rows == 0 || nm[0] > 0,
                    OP_COMBINE,
                    "the dispatch of this handle received {rows} rows from rank {s}, but its messages are no longer in the buffer \
                     (was the low-latency part overwritten, e.g. zeroed through get_local_buffer_tensor, between the dispatch and \
                     this combine? reset it only between steps)"
                );
            }
        }
        self.ll_enter_geometry(OP_COMBINE, &geo)?;
        let (half, seq) = self.ll_begin_send();
        self.ll.route_combine(half, src_ptr, partial.is_some());
        let mine = self.ll_region(me);
        let mut row_buf = vec![0u16; h];
        let read_row = |l: usize, row: usize, buf: &mut Vec<u16>| -> Vec<u16> {
            if a.zero_copy {
                mine.read::<u16>(geo.send(half) + (l * rt + row) * geo.m * 2, buf);
                buf.clone()
            } else {
                x[(l * rt + row) * h..(l * rt + row + 1) * h].to_vec()
            }
        };
        if let Some((hd, w)) = partial {
            // One row per (source rank, token): bf16(sum over its entries in top-k order of
            // fma(y, w_k, acc)) in fp32, the weights the dispatch carried.
            let mut acc = vec![0f32; h];
            for s in (0..r).filter(|&s| !self.mask[s]) {
                let dst = self.ll_region(s);
                let mut nm = [0u32];
                mine.read::<u32>(geo.recv(hd) + LlWire::count_off(s), &mut nm);
                crate::ensure!(
                    nm[0] as usize <= t,
                    OP_COMBINE,
                    "the dispatch of this handle left {} messages from rank {s}, more than {t}",
                    nm[0]
                );
                for m in 0..nm[0] as usize {
                    let (tok, _, entries) = read_meta(&mine, geo.dmsg(&w, hd, s, m));
                    crate::ensure!((0..t as i32).contains(&tok), OP_COMBINE, "a dispatch message from rank {s} names token {tok}");
                    acc.fill(0.0);
                    for &(l, sl, wt) in &entries {
                        let (b, c) = range(l, s);
                        crate::ensure!(
                            l < el && sl < c && b + sl < rt,
                            OP_COMBINE,
                            "a dispatch message from rank {s} names row {sl} of local expert {l}, outside layout_range"
                        );
                        for (a, &y) in acc.iter_mut().zip(&read_row(l, b + sl, &mut row_buf)) {
                            *a = bf16::to_f32(y).mul_add(wt, *a);
                        }
                    }
                    let p: Vec<u16> = acc.iter().map(|&v| bf16::from_f32(v)).collect();
                    dst.write::<u16>(geo.partial(&w, half, me, tok as usize), &p);
                }
                sig_store(&dst, geo.sig(half), me * el, tag(seq, 0));
            }
            write_state(&a.recv_state, half, seq, FLAG_PARTIAL, KIND_COMBINE);
            return Ok(());
        }
        let mut slot_buf = vec![0u8; if a.use_logfmt { logfmt::slot_bytes(h) } else { 0 }];
        for s in (0..r).filter(|&s| !self.mask[s]) {
            let dst = self.ll_region(s);
            for l in 0..el {
                let (b, c) = range(l, s);
                for row in b..b + c {
                    let y = read_row(l, row, &mut row_buf);
                    let off = geo.slot(half, me * el + l, src_info[l * rt + row] as usize);
                    if a.use_logfmt {
                        logfmt::encode(&y, &mut slot_buf);
                        dst.write::<u8>(off, &slot_buf);
                    } else {
                        dst.write::<u16>(off, &y);
                    }
                }
            }
            for l in 0..el {
                sig_store(&dst, geo.sig(half), me * el + l, tag(seq, 0));
            }
        }
        write_state(&a.recv_state, half, seq, a.use_logfmt as i64 * FLAG_LOGFMT, KIND_COMBINE);
        Ok(())
    }

    fn ll_combine_recv(&mut self, g: &LlGeometry, a: &LlCombineRecvArgs, stats: &LlStats, _s: Stream) -> Result<()> {
        let geo = self.ll_geo(OP_COMBINE, g)?;
        let (half, seq, flags) = self.ll_read_state(OP_COMBINE, &a.recv_state, KIND_COMBINE)?;
        self.ll.receiving = Some((KIND_COMBINE, geo.sig(half), seq));
        let logfmt = flags & FLAG_LOGFMT != 0;
        let (r, el, t, h) = (geo.r, geo.el, geo.t, geo.h);
        // Partial sums: one word (and one row per token) per expert rank.
        let wire = if flags & FLAG_PARTIAL != 0 { g.wire(r) } else { None };
        let words = if wire.is_some() { 1 } else { el };
        let n = a.out.size(0);
        crate::ensure!(n <= t, OP_COMBINE, "out has {n} tokens, more than num_max_dispatch_tokens_per_rank ({t})");
        let idx = a.topk_idx.cpu_indices_i64();
        let w = a.topk_weights.cpu_slice::<f32>();
        let k = if a.topk_idx.ndim() == 2 { a.topk_idx.size(1) } else { 0 };
        crate::ensure!(
            idx.len() == n * k && w.len() == idx.len(),
            OP_COMBINE,
            "topk_idx and topk_weights must be [{n}, num_topk], got {:?} and {:?}",
            a.topk_idx.sizes(),
            a.topk_weights.sizes()
        );
        crate::layout::check_expert_ids(OP_COMBINE, &idx, k, geo.e)?;
        let mine = self.ll_region(self.info.rank);
        let sig = geo.sig(half);
        let missing = |s: usize| {
            (s * el..s * el + words).any(|w| {
                let v = sig_load(&mine, sig, w);
                arrived(v, seq).is_none() && !abandoned(v, seq)
            })
        };
        let gave_up = |s: usize| (s * el..s * el + words).any(|w| abandoned(sig_load(&mine, sig, w), seq));
        let mut waited = vec![0u64; r];
        for (s, waited_s) in waited.iter_mut().enumerate() {
            if self.mask[s] {
                continue; // a masked rank returns nothing; its experts contribute zero below
            }
            let mask = self.mask.clone();
            let d = self.ll_wait(
                OP_COMBINE,
                || format!("combine flags of rank {s}'s local experts (half {half}, call {seq})"),
                || !missing(s),
                || (0..r).filter(|&p| !mask[p] && missing(p)).collect(),
            )?;
            if d.is_some() && gave_up(s) {
                return Err(abandoned_error(OP_COMBINE, self.info.rank, s, seq, "a combine"));
            }
            if let Some(d) = d {
                *waited_s = d.as_nanos() as u64;
                self.waits[s][0] += 1;
                self.waits[s][1] += d.as_nanos() as i64;
            }
        }
        // After the waits: raising before them would let this rank run calls ahead of its peers.
        self.ll.check_combine_routing(OP_COMBINE, half, &idx, k, w)?;
        let out = a.out.cpu_slice_mut::<u16>();
        let mut acc = vec![0f32; h];
        let mut row = vec![0u16; h];
        let mut slot = vec![0u8; if logfmt { logfmt::slot_bytes(h) } else { 0 }];
        for tok in 0..n {
            acc.fill(0.0);
            if let Some(wr) = &wire {
                // The expert ranks' partial sums, ranks ascending, in fp32 (unmasked ranks the
                // token selected an expert of).
                let sel = &idx[tok * k..(tok + 1) * k];
                for d in (0..r).filter(|&d| !self.mask[d] && sel.iter().any(|&e| e >= 0 && e as usize / el == d)) {
                    mine.read::<u16>(geo.partial(wr, half, d, tok), &mut row);
                    for (a, &y) in acc.iter_mut().zip(&row) {
                        *a += bf16::to_f32(y);
                    }
                }
            }
            for kk in (0..k).filter(|_| wire.is_none()) {
                let e = idx[tok * k + kk];
                if e < 0 || self.mask[e as usize / el] {
                    continue; // no expert, or an expert of a masked rank: dropped
                }
                let (off, wt) = (geo.slot(half, e as usize, tok), w[tok * k + kk]);
                if logfmt {
                    mine.read::<u8>(off, &mut slot);
                    logfmt::decode_accumulate(&slot, wt, &mut acc);
                } else {
                    mine.read::<u16>(off, &mut row);
                    for (a, &y) in acc.iter_mut().zip(&row) {
                        *a = bf16::to_f32(y).mul_add(wt, *a);
                    }
                }
            }
            for (o, &v) in out[tok * h..(tok + 1) * h].iter_mut().zip(&acc) {
                *o = bf16::from_f32(v);
            }
        }
        if let Some(ws) = &stats.wait_recv_cost_stats {
            for (a, &b) in ws.cpu_slice_mut::<i64>().iter_mut().zip(&waited) {
                *a += b as i64;
            }
        }
        Ok(())
    }

    fn clean_low_latency_buffer(&mut self, g: &LlGeometry, _s: Stream) -> Result<()> {
        let geo = self.ll_geo(OP_CLEAN, g)?;
        // Nobody may still be sending into the signals we zero, nor start before we finish.
        self.ll_rendezvous(OP_CLEAN, Kind::LlClean, "before zeroing the low-latency signals")?;
        self.ll_zero_signals(&geo);
        self.ll = LlState { geometry: Some((geo.t, geo.h, geo.e)), ..LlState::default() };
        self.barrier_among(OP_CLEAN, "after zeroing the low-latency signals", true)
    }

    fn next_low_latency_combine_buffer(&mut self, g: &LlGeometry) -> Result<TensorRef> {
        let geo = self.ll_geo(OP_NEXT, g)?;
        self.views_out = true;
        let ptr = self.ll_region(self.info.rank).ptr_at(geo.send(self.ll.next_half));
        let (rt, m) = ((geo.r * geo.t) as i64, geo.m as i64);
        Ok(TensorRef::new(ptr, DType::BFloat16, Device::Cpu, &[geo.el as i64, rt, geo.h as i64], &[rt * m, m, 1]))
    }

    fn ll_own_state(&mut self, combine: bool) -> TensorRef {
        TensorRef::new(self.own_state[combine as usize].as_mut_ptr().cast(), DType::Int64, Device::Cpu, &[LL_STATE_LEN as i64], &[1])
    }

    fn ll_mask_rows(&mut self, op: &'static str, a: &LlRowsArgs, _s: Stream) -> Result<()> {
        let (n, k) = (a.topk_idx.size(0), a.topk_idx.size(1));
        let v = a.num_tokens.cpu_slice::<i32>()[0];
        crate::ensure!(v >= 0 && v as usize <= n, op, "num_tokens must be in 0..={n} (the rows of x / topk_idx), got {v}");
        let mut idx = a.topk_idx.cpu_indices_i64();
        idx[v as usize * k..].fill(-1);
        a.out.cpu_store_indices(&idx);
        Ok(())
    }

    fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.mask[rank] = masked;
        Ok(())
    }

    fn ll_mask(&self) -> Vec<bool> {
        self.mask.clone()
    }

    fn ll_clean_mask(&mut self) -> Result<()> {
        self.mask.fill(false);
        Ok(())
    }

    fn ll_set_shrink(&mut self, enable: bool) -> Result<()> {
        self.shrink = enable;
        Ok(())
    }
}

#[cfg(test)]
#[path = "ll_tests.rs"]
mod tests;
