//! Normal-mode (high-throughput) ops on the CPU backend.
//!
//! Protocol of every op: each rank checks what it can alone, then *publishes* a header (status,
//! op kind, sizes, an error message if its checks failed) and its data into its own HT area;
//! all ranks meet at a barrier; every rank reads every header, so an error on any rank is raised
//! on all ranks and they stay in step; then each rank *pulls* what it receives from the peers'
//! areas; a final barrier keeps areas stable until every peer has read them.

use super::CpuBackend;
use crate::backend::{CachedDispatchArgs, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, Handle, NormalMode};
use crate::error::{Error, Result};
use crate::layout;
use crate::numerics::bf16;
use crate::shm::Region;
use crate::tensor::TensorRef;

pub(super) const HEADER_BYTES: usize = 4096;
const MSG_OFF: usize = 256;
const MAX_MSG: usize = HEADER_BYTES - MSG_OFF;

// Header words (u64).
const W_STATUS: usize = 0;
const W_KIND: usize = 1;
const W_MSG_LEN: usize = 2;
pub(super) const W_ROWS: usize = 3;
pub(super) const W_ROW_BYTES: usize = 4;
pub(super) const W_SCALE_BYTES: usize = 5;
pub(super) const W_TOPK: usize = 6;
pub(super) const W_EXPERTS: usize = 7;
pub(super) const W_WORST: usize = 8;
pub(super) const W_FLAGS: usize = 9;
pub(super) const NUM_WORDS: usize = 10;

const FLAG_SCALES: u64 = 1;
const FLAG_TOPK: u64 = 2;

/// The op a rank is in; peers in another op raise an error instead of reading garbage.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    Dispatch = 1,
    CachedDispatch = 2,
    Combine = 3,
    InternodeDispatch = 4,
    InternodeCachedDispatch = 5,
    InternodeCombine = 6,
    /// `clean_low_latency_buffer`, and an LL op's signal reset for a new geometry: they meet
    /// the other ranks in barriers too, so they say so in the header (an HT op of a peer paired
    /// with them would otherwise read the peer's header of an earlier call as its own).
    LlClean = 7,
    LlGeometry = 8,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::Dispatch,
        Kind::CachedDispatch,
        Kind::Combine,
        Kind::InternodeDispatch,
        Kind::InternodeCachedDispatch,
        Kind::InternodeCombine,
        Kind::LlClean,
        Kind::LlGeometry,
    ];

    pub(super) fn op(self) -> &'static str {
        match self {
            Kind::Dispatch => crate::op_names::DISPATCH,
            Kind::CachedDispatch => crate::op_names::CACHED_DISPATCH,
            Kind::Combine => crate::op_names::COMBINE,
            Kind::InternodeDispatch => crate::op_names::INTERNODE_DISPATCH,
            Kind::InternodeCachedDispatch => crate::op_names::INTERNODE_CACHED_DISPATCH,
            Kind::InternodeCombine => crate::op_names::INTERNODE_COMBINE,
            Kind::LlClean => crate::op_names::CLEAN_LOW_LATENCY_BUFFER,
            Kind::LlGeometry => "a low-latency op with a new geometry (its signal reset)",
        }
    }
}

/// The header words of a cached dispatch (its rows and their row and scale bytes), which
/// [`check_row_format`] compares across ranks.
pub(super) fn cached_rows_words(rows: usize, row_bytes: usize, scale_bytes: usize) -> [u64; NUM_WORDS] {
    let mut words = [0u64; NUM_WORDS];
    words[W_ROWS] = rows as u64;
    words[W_ROW_BYTES] = row_bytes as u64;
    words[W_SCALE_BYTES] = scale_bytes as u64;
    words
}

/// A cached dispatch's rows must have the same size and scale size on every rank.
pub(super) fn check_row_format(op: &'static str, headers: &[Header], words: &[u64; NUM_WORDS]) -> Result<()> {
    match headers.iter().position(|h| h.0[W_ROW_BYTES] != words[W_ROW_BYTES] || h.0[W_SCALE_BYTES] != words[W_SCALE_BYTES]) {
        Some(p) => Err(Error::invalid(op, format!("rank {p} dispatches rows of another size or dtype than this rank"))),
        None => Ok(()),
    }
}

/// Byte offsets of consecutive sections after the header, each 64-byte aligned.
pub(super) fn sections(sizes: &[usize]) -> (Vec<usize>, usize) {
    let mut offs = Vec::with_capacity(sizes.len());
    let mut at = HEADER_BYTES;
    for s in sizes {
        offs.push(at);
        at += s.div_ceil(64) * 64;
    }
    (offs, at)
}

/// Sizes of the dispatch sections: counts per rank, counts per expert, is_token_in_rank,
/// x, scales, topk_idx (i64), topk_weights (f32).
pub(super) fn dispatch_sections(r: usize, e: usize, n: usize, row_bytes: usize, scale_bytes: usize, k: usize) -> (Vec<usize>, usize) {
    sections(&[r * 4, e * 4, n * r, n * row_bytes, n * scale_bytes, n * k * 8, n * k * 4])
}

/// Data outputs of a dispatch (shared by the intranode and internode finish halves).
pub(super) struct RecvData<'a> {
    pub recv_x: &'a TensorRef,
    pub recv_x_scales: Option<&'a TensorRef>,
    pub recv_topk_idx: Option<&'a TensorRef>,
    pub recv_topk_weights: Option<&'a TensorRef>,
}

/// A peer's published header.
pub(super) struct Header(pub(super) [u64; NUM_WORDS]);

impl Header {
    pub(super) fn read(region: &Region) -> Header {
        let mut w = [0u64; NUM_WORDS];
        region.read(0, &mut w);
        Header(w)
    }
    pub(super) fn rows(&self) -> usize {
        self.0[W_ROWS] as usize
    }
}

impl CpuBackend {
    /// Publishes this rank's header (and, on failure, its message) into its HT area.
    fn publish_header(&self, kind: Kind, words: [u64; NUM_WORDS], err: Option<&Error>) {
        let me = self.ht_region(self.info.rank);
        let mut w = words;
        w[W_KIND] = kind as u64;
        if let Some(e) = err {
            let msg = e.to_string();
            let bytes = &msg.as_bytes()[..msg.len().min(MAX_MSG)];
            me.write(MSG_OFF, bytes);
            w[W_STATUS] = 1;
            w[W_MSG_LEN] = bytes.len() as u64;
        }
        me.write(0, &w);
    }

    /// After the first barrier: raises the same error on every rank if any rank failed its
    /// own checks or is in another op.
    fn check_peers(&self, kind: Kind, own: Option<Error>) -> Result<Vec<Header>> {
        self.check_peers_among(kind, kind.op(), own, false)
    }

    /// [`Self::check_peers`] over the ranks a barrier waited for (`masked_skip`: not the masked).
    fn check_peers_among(&self, kind: Kind, op: &'static str, own: Option<Error>, masked_skip: bool) -> Result<Vec<Header>> {
        let headers: Vec<Header> = (0..self.info.num_ranks).map(|p| Header::read(&self.ht_region(p))).collect();
        if let Some(e) = own {
            return Err(e);
        }
        for (p, h) in headers.iter().enumerate() {
            if masked_skip && self.mask[p] {
                continue;
            }
            if h.0[W_KIND] != kind as u64 {
                let theirs = Kind::ALL.into_iter().find(|k| *k as u64 == h.0[W_KIND]);
                return Err(Error::invalid(
                    op,
                    format!(
                        "rank {p} is in {} while this rank is in {op}: all ranks must call the same ops in the same order",
                        theirs.map_or("an unknown op", |k| k.op())
                    ),
                ));
            }
            if h.0[W_STATUS] != 0 {
                let mut msg = vec![0u8; h.0[W_MSG_LEN] as usize];
                self.ht_region(p).read(MSG_OFF, &mut msg);
                return Err(Error::invalid(op, format!("rank {p} failed: {}", String::from_utf8_lossy(&msg))));
            }
        }
        Ok(headers)
    }

    /// Publish header + barrier + peer check: the common first step of every op.
    pub(super) fn rendezvous(&mut self, kind: Kind, words: [u64; NUM_WORDS], own: Option<Error>) -> Result<Vec<Header>> {
        self.publish_header(kind, words, own.as_ref());
        self.barrier(kind.op(), "all ranks published their inputs")?;
        let checked = self.check_peers(kind, own);
        self.together(kind, checked)
    }

    /// The rendezvous of an LL-side step that meets the other ranks in barriers (`Kind::LlClean`,
    /// `Kind::LlGeometry`): over the unmasked ranks, and only where the buffer has the
    /// normal-mode area that holds headers (without it no normal-mode op can run to be confused).
    pub(super) fn ll_rendezvous(&mut self, op: &'static str, kind: Kind, what: &str) -> Result<()> {
        if self.ht_bytes < HEADER_BYTES {
            return self.barrier_among(op, what, true);
        }
        self.publish_header(kind, [0; NUM_WORDS], None);
        self.barrier_among(op, what, true)?;
        let checked = self.check_peers_among(kind, op, None, true).map(|_| ());
        if checked.is_err() {
            self.barrier_among(op, "all ranks saw the error", true)?;
        }
        checked
    }

    /// Every rank reaches the same verdict after a rendezvous. On failure all ranks meet once
    /// more before raising: a rank that raised at once would start its next call and overwrite
    /// its area while a peer was still reading the failed call's header.
    pub(super) fn together<T>(&mut self, kind: Kind, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.barrier(kind.op(), "all ranks saw the error")?;
        }
        r
    }

    pub(super) fn capacity_error(&self, op: &'static str, need: usize) -> Option<Error> {
        (need > self.info.num_nvl_bytes).then(|| {
            Error::invalid(
                op,
                format!(
                    "tokens over capacity: this call needs {need} bytes of the buffer's NVLink area, num_nvl_bytes is {}",
                    self.info.num_nvl_bytes
                ),
            )
        })
    }

    /// The notify half of a dispatch as op `kind`; `extra` is a further own error to publish.
    /// Leaves every rank's inputs published in its HT area (read by the finish half).
    pub(super) fn dispatch_prepare_as(&mut self, kind: Kind, a: &DispatchArgs, extra: Option<Error>) -> Result<DispatchPlan> {
        let op = kind.op();
        let (r, nr, e) = (self.info.rank, self.info.num_ranks, a.num_experts);
        let n = a.x.size(0);
        let row_bytes = a.x.size(1) * a.x.dtype.size();
        let scale_bytes = a.x_scales.as_ref().map_or(0, |s| s.size(1) * 4);
        let k = a.topk_idx.as_ref().map_or(0, |t| t.size(1));
        let (offs, end) = dispatch_sections(nr, e, n, row_bytes, scale_bytes, k);

        let in_rank = a.is_token_in_rank.cpu_slice::<u8>();
        let ntpr = a.num_tokens_per_rank.cpu_slice::<i32>();
        let ntpe = a.num_tokens_per_expert.cpu_slice::<i32>();
        let topk = a.topk_idx.as_ref().map(|t| t.cpu_indices_i64());
        let own =
            self.capacity_error(op, end).or_else(|| check_layout_inputs(op, in_rank, ntpr, ntpe, topk.as_deref(), n, k, nr, e)).or(extra);

        if own.is_none() {
            let me = self.ht_region(r);
            me.write(offs[0], ntpr);
            me.write(offs[1], ntpe);
            me.write(offs[2], in_rank);
            me.write(offs[3], a.x.cpu_bytes());
            if let Some(s) = &a.x_scales {
                me.write(offs[4], &s.cpu_copy_2d_contiguous());
            }
            if let (Some(t), Some(w)) = (&topk, &a.topk_weights) {
                me.write(offs[5], t);
                me.write(offs[6], w.cpu_slice::<f32>());
            }
        }
        let flags = if a.x_scales.is_some() { FLAG_SCALES } else { 0 } | if k > 0 { FLAG_TOPK } else { 0 };
        let mut words = [0u64; NUM_WORDS];
        words[W_ROWS] = n as u64;
        words[W_ROW_BYTES] = row_bytes as u64;
        words[W_SCALE_BYTES] = scale_bytes as u64;
        words[W_TOPK] = k as u64;
        words[W_EXPERTS] = e as u64;
        words[W_WORST] = a.num_worst_tokens as u64;
        words[W_FLAGS] = flags;
        let headers = self.rendezvous(kind, words, own)?;
        let plan = self.plan_dispatch(op, a, &headers, &words, &offs);
        self.together(kind, plan)
    }

    /// Global checks and output sizes of a dispatch, from every rank's published header.
    fn plan_dispatch(
        &self,
        op: &'static str,
        a: &DispatchArgs,
        headers: &[Header],
        words: &[u64; NUM_WORDS],
        offs: &[usize],
    ) -> Result<DispatchPlan> {
        let (r, nr, e) = (self.info.rank, self.info.num_ranks, a.num_experts);
        for (p, h) in headers.iter().enumerate() {
            for w in [W_ROW_BYTES, W_SCALE_BYTES, W_TOPK, W_EXPERTS, W_FLAGS] {
                if h.0[w] != words[w] {
                    return Err(Error::invalid(op, format!(
                        "rank {p} dispatches (row bytes, scale bytes, topk, experts, flags) = {:?}, this rank {:?}: every rank must use the same hidden size, dtype, top-k and expert count",
                        [h.0[W_ROW_BYTES], h.0[W_SCALE_BYTES], h.0[W_TOPK], h.0[W_EXPERTS], h.0[W_FLAGS]],
                        [words[W_ROW_BYTES], words[W_SCALE_BYTES], words[W_TOPK], words[W_EXPERTS], words[W_FLAGS]]
                    )));
                }
            }
        }
        // Received counts of every rank, so a worst-case overflow anywhere is raised everywhere.
        let counts: Vec<Vec<i32>> = (0..nr).map(|p| self.ht_region(p).slice::<i32>(offs[0], nr).to_vec()).collect();
        for d in 0..nr {
            let recv: i64 = counts.iter().map(|c| c[d] as i64).sum();
            let worst = headers[d].0[W_WORST] as i64;
            if worst > 0 && recv > worst {
                return Err(Error::invalid(
                    op,
                    format!("tokens over capacity: rank {d} receives {recv} tokens but its num_worst_tokens is {worst}"),
                ));
            }
        }
        let num_recv = counts.iter().map(|c| c[r] as usize).sum::<usize>();
        let el = e / nr;
        let align = a.expert_alignment.max(1) as i64;
        let per_expert = (0..el)
            .map(|i| {
                let s: i64 = (0..nr).map(|p| self.ht_region(p).slice::<i32>(offs[1], e)[r * el + i] as i64).sum();
                ((s + align - 1) / align * align) as i32
            })
            .collect();
        let num_rows = if a.num_worst_tokens > 0 { a.num_worst_tokens } else { num_recv };
        Ok(DispatchPlan { num_recv_tokens: num_recv, num_rows, num_recv_tokens_per_expert: per_expert })
    }

    /// Rank `s`'s published token count and `is_token_in_rank [n_s, R]` (u8) of the dispatch
    /// whose notify half ran last.
    pub(super) fn published_in_rank(&self, a: &DispatchArgs, s: usize) -> (usize, Vec<u8>) {
        let nr = self.info.num_ranks;
        let src = self.ht_region(s);
        let n_s = Header::read(&src).rows();
        let (offs, _) = dispatch_sections(nr, a.num_experts, n_s, 0, 0, 0);
        (n_s, src.slice::<u8>(offs[2], n_s * nr).to_vec())
    }

    /// Copies every received token (rows, scales, local top-k ids and weights) into `o` in
    /// receive order (source rank, then token) and returns (source rank, token) per row.
    /// Padding rows (worst-case mode) are zero, with top-k ids −1. No barrier.
    pub(super) fn pull_dispatch(&self, a: &DispatchArgs, plan: &DispatchPlan, o: &RecvData) -> Vec<(usize, usize)> {
        let (r, nr, e) = (self.info.rank, self.info.num_ranks, a.num_experts);
        let row_bytes = a.x.size(1) * a.x.dtype.size();
        let scale_bytes = a.x_scales.as_ref().map_or(0, |s| s.size(1) * 4);
        let k = a.topk_idx.as_ref().map_or(0, |t| t.size(1));
        let el = e / nr;

        let recv_x = o.recv_x.cpu_bytes_mut();
        let mut recv_scales = o.recv_x_scales.map(|t| t.cpu_bytes_mut());
        let mut recv_idx = vec![-1i64; plan.num_rows * k];
        let mut recv_w = o.recv_topk_weights.map(|t| t.cpu_slice_mut::<f32>());
        let mut rows = Vec::with_capacity(plan.num_recv_tokens);
        recv_x.fill(0);
        if let Some(w) = recv_w.as_deref_mut() {
            w.fill(0.0);
        }
        if let Some(s) = recv_scales.as_deref_mut() {
            s.fill(0);
        }

        let mut row = 0usize;
        for s in 0..nr {
            let src = self.ht_region(s);
            let n_s = Header::read(&src).rows();
            let (offs, _) = dispatch_sections(nr, e, n_s, row_bytes, scale_bytes, k);
            let in_rank = src.slice::<u8>(offs[2], n_s * nr);
            let x = src.slice::<u8>(offs[3], n_s * row_bytes);
            for t in (0..n_s).filter(|&t| in_rank[t * nr + r] != 0) {
                recv_x[row * row_bytes..(row + 1) * row_bytes].copy_from_slice(&x[t * row_bytes..(t + 1) * row_bytes]);
                rows.push((s, t));
                if let Some(dst) = recv_scales.as_deref_mut() {
                    let sc = src.slice::<u8>(offs[4], n_s * scale_bytes);
                    dst[row * scale_bytes..(row + 1) * scale_bytes].copy_from_slice(&sc[t * scale_bytes..(t + 1) * scale_bytes]);
                }
                if k > 0 {
                    let idx = src.slice::<i64>(offs[5], n_s * k);
                    let w = src.slice::<f32>(offs[6], n_s * k);
                    for j in 0..k {
                        let local = layout::to_local_expert(idx[t * k + j], r, el);
                        recv_idx[row * k + j] = local;
                        if let Some(rw) = recv_w.as_deref_mut() {
                            rw[row * k + j] = if local >= 0 { w[t * k + j] } else { 0.0 };
                        }
                    }
                }
                row += 1;
            }
        }
        debug_assert_eq!(row, plan.num_recv_tokens);
        if let Some(t) = o.recv_topk_idx {
            t.cpu_store_indices(&recv_idx);
        }
        rows
    }

    /// Checks a handle against this rank's own view; returns the error to publish.
    fn check_handle(&self, op: &'static str, h: &Handle, num_tokens: usize) -> Option<Error> {
        let (r, nr) = (self.info.rank, self.info.num_ranks);
        let m = h.rank_prefix_matrix.cpu_slice::<i32>();
        let in_rank = h.is_token_in_rank.cpu_slice::<u8>();
        if in_rank.len() != num_tokens * nr {
            return Some(Error::invalid(
                op,
                format!("stale handle: is_token_in_rank has {} entries for {num_tokens} tokens and {nr} ranks", in_rank.len()),
            ));
        }
        for d in 0..nr {
            let sent = (0..num_tokens).filter(|&t| in_rank[t * nr + d] != 0).count() as i32;
            let expected = m[r * nr + d] - if r > 0 { m[(r - 1) * nr + d] } else { 0 };
            if sent != expected {
                return Some(Error::invalid(
                    op,
                    format!("stale handle: is_token_in_rank sends {sent} tokens to rank {d}, rank_prefix_matrix says {expected}"),
                ));
            }
        }
        let recv = m[(nr - 1) * nr + r] as usize;
        let rows = h.recv_src_idx.numel();
        (rows < recv)
            .then(|| Error::invalid(op, format!("stale handle: recv_src_idx has {rows} rows but this rank receives {recv} tokens")))
    }

    /// Every rank's handle must describe the same dispatch.
    fn check_same_handles(&self, op: &'static str, m_off: usize, mine: &[i32]) -> Result<()> {
        for p in 0..self.info.num_ranks {
            if self.ht_region(p).slice::<i32>(m_off, mine.len()) != mine {
                return Err(Error::invalid(op, format!("stale handle: rank {p}'s rank_prefix_matrix differs from this rank's; all ranks must pass handles of the same dispatch")));
            }
        }
        Ok(())
    }

    /// Stages a cached dispatch's inputs in this rank's region, intranode or internode, at the
    /// four sections `offs`: the handle's prefix (`prefix`, what the peers check the handles
    /// against), `is_token_in_rank`, the rows of `x` and the scales (2-D contiguous).
    pub(super) fn stage_cached_rows(
        &self,
        offs: &[usize],
        prefix: &[i32],
        in_rank: &TensorRef,
        x: &TensorRef,
        x_scales: Option<&TensorRef>,
    ) {
        let me = self.ht_region(self.info.rank);
        me.write(offs[0], prefix);
        me.write(offs[1], in_rank.cpu_slice::<u8>());
        me.write(offs[2], x.cpu_bytes());
        if let Some(s) = x_scales {
            me.write(offs[3], &s.cpu_copy_2d_contiguous());
        }
    }

    /// The copy of a cached dispatch, intranode or internode (the same rows in the same order):
    /// zeroes the outputs, then, source by source, appends in token order the staged rows (and
    /// scales) whose `is_token_in_rank` entry for this rank is set — sections 1, 2 and 3 of
    /// `offs_of(source's rows)` in the source's region — and meets the other ranks at the end.
    pub(super) fn gather_cached_rows(
        &mut self,
        op: &'static str,
        headers: &[Header],
        offs_of: impl Fn(usize) -> Vec<usize>,
        recv_x: &TensorRef,
        recv_scales: Option<&TensorRef>,
    ) -> Result<()> {
        let (r, nr) = (self.info.rank, self.info.num_ranks);
        let (row_bytes, scale_bytes) = (headers[r].0[W_ROW_BYTES] as usize, headers[r].0[W_SCALE_BYTES] as usize);
        let out = recv_x.cpu_bytes_mut();
        let mut out_s = recv_scales.map(|t| t.cpu_bytes_mut());
        out.fill(0);
        if let Some(s) = out_s.as_deref_mut() {
            s.fill(0);
        }
        let mut row = 0;
        for (s, h) in headers.iter().enumerate() {
            let src = self.ht_region(s);
            let n_s = h.rows();
            let o = offs_of(n_s);
            let in_rank = src.slice::<u8>(o[1], n_s * nr);
            let x = src.slice::<u8>(o[2], n_s * row_bytes);
            let sc = src.slice::<u8>(o[3], n_s * scale_bytes);
            for t in (0..n_s).filter(|&t| in_rank[t * nr + r] != 0) {
                out[row * row_bytes..(row + 1) * row_bytes].copy_from_slice(&x[t * row_bytes..(t + 1) * row_bytes]);
                if let Some(d) = out_s.as_deref_mut() {
                    d[row * scale_bytes..(row + 1) * scale_bytes].copy_from_slice(&sc[t * scale_bytes..(t + 1) * scale_bytes]);
                }
                row += 1;
            }
        }
        self.barrier(op, "all ranks received their tokens")
    }
}

/// Content checks of the layout inputs that only the CPU can afford: counts must agree with
/// `is_token_in_rank` and `topk_idx`, and expert ids must be in range.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_layout_inputs(
    op: &'static str,
    in_rank: &[u8],
    ntpr: &[i32],
    ntpe: &[i32],
    topk: Option<&[i64]>,
    n: usize,
    k: usize,
    nr: usize,
    e: usize,
) -> Option<Error> {
    for d in 0..nr {
        let c = (0..n).filter(|&t| in_rank[t * nr + d] != 0).count() as i32;
        if c != ntpr[d] {
            return Some(Error::invalid(
                op,
                format!("num_tokens_per_rank[{d}] = {} but is_token_in_rank selects {c} tokens for rank {d}", ntpr[d]),
            ));
        }
    }
    if let Some(idx) = topk {
        if let Some(&bad) = idx.iter().find(|&&v| v < -1 || v >= e as i64) {
            return Some(Error::invalid(op, format!("topk_idx holds expert id {bad}, outside [-1, {e})")));
        }
        let l = layout::dispatch_layout(idx, n, k, e, nr);
        if l.num_tokens_per_expert != ntpe {
            return Some(Error::invalid(
                op,
                "num_tokens_per_expert does not match topk_idx (pass the tensors get_dispatch_layout returned)",
            ));
        }
        let derived: Vec<u8> = l.is_token_in_rank.iter().map(|&b| b as u8).collect();
        if derived != in_rank {
            return Some(Error::invalid(op, "is_token_in_rank does not match topk_idx (pass the tensors get_dispatch_layout returned)"));
        }
    }
    None
}

/// Writes a combine's payload into this rank's region: `x` rows at `offs[0]`, the top-k weights
/// (when given) at `offs[1]`.
pub(super) fn stage_combine_payload<H>(me: &Region, offs: &[usize], a: &CombineArgs<H>) {
    me.write(offs[0], a.x.cpu_slice::<u16>());
    if let Some(w) = &a.topk_weights {
        me.write(offs[1], w.cpu_slice::<f32>());
    }
}

/// The header words every combine publishes: `rows_word` (rows, or tokens for internode), the
/// row bytes of `hidden` bf16 and the top-k `k` (0 without weights).
pub(super) fn combine_words(rows_word: usize, hidden: usize, k: usize) -> [u64; NUM_WORDS] {
    let mut words = [0u64; NUM_WORDS];
    words[W_ROWS] = rows_word as u64;
    words[W_ROW_BYTES] = (hidden * 2) as u64;
    words[W_TOPK] = k as u64;
    words
}

/// Fails naming the first rank whose combine has another row size or top-k than `words`.
pub(super) fn check_combine_format(op: &'static str, headers: &[Header], words: &[u64; NUM_WORDS]) -> Result<()> {
    match headers.iter().position(|h| h.0[W_ROW_BYTES] != words[W_ROW_BYTES] || h.0[W_TOPK] != words[W_TOPK]) {
        Some(p) => Err(Error::invalid(
            op,
            format!("rank {p} combines another hidden size or top-k (or passes topk_weights where this rank does not)"),
        )),
        None => Ok(()),
    }
}

impl NormalMode for CpuBackend {
    fn dispatch_prepare(&mut self, a: &DispatchArgs) -> Result<DispatchPlan> {
        self.dispatch_prepare_as(Kind::Dispatch, a, None)
    }

    fn dispatch_finish(&mut self, a: &DispatchArgs, plan: &DispatchPlan, o: &DispatchOutputs) -> Result<()> {
        const OP: &str = crate::op_names::DISPATCH;
        let (nr, c) = (self.info.num_ranks, a.config.num_channels());
        let data = RecvData {
            recv_x: &o.recv_x,
            recv_x_scales: o.recv_x_scales.as_ref(),
            recv_topk_idx: o.recv_topk_idx.as_ref(),
            recv_topk_weights: o.recv_topk_weights.as_ref(),
        };
        let rows = self.pull_dispatch(a, plan, &data);
        let src_idx = o.recv_src_idx.cpu_slice_mut::<i32>();
        src_idx.fill(-1);
        for (row, &(_, t)) in rows.iter().enumerate() {
            src_idx[row] = t as i32;
        }
        let recv_cpm = o.recv_channel_prefix_matrix.cpu_slice_mut::<i32>();
        let mut counts = Vec::with_capacity(nr);
        for s in 0..nr {
            let (n_s, in_rank) = self.published_in_rank(a, s);
            counts.push(self.ht_region(s).slice::<i32>(HEADER_BYTES, nr).to_vec());
            let starts = layout::recv_channel_starts(|t| in_rank[t * nr + self.info.rank] != 0, n_s, c);
            recv_cpm[s * c..(s + 1) * c].copy_from_slice(&starts);
        }
        o.rank_prefix_matrix.cpu_slice_mut::<i32>().copy_from_slice(&layout::rank_prefix_matrix(&counts));
        let own_in_rank: Vec<bool> = a.is_token_in_rank.cpu_slice::<u8>().iter().map(|&b| b != 0).collect();
        let (cpm, send_head) = layout::send_side(&own_in_rank, a.x.size(0), nr, c);
        o.channel_prefix_matrix.cpu_slice_mut::<i32>().copy_from_slice(&cpm);
        o.send_head.cpu_slice_mut::<i32>().copy_from_slice(&send_head);
        self.barrier(OP, "all ranks received their tokens")
    }

    fn cached_dispatch(&mut self, a: &CachedDispatchArgs, recv_x: &TensorRef, recv_scales: Option<&TensorRef>) -> Result<()> {
        const OP: &str = crate::op_names::CACHED_DISPATCH;
        let nr = self.info.num_ranks;
        let n = a.x.size(0);
        let row_bytes = a.x.size(1) * a.x.dtype.size();
        let scale_bytes = a.x_scales.as_ref().map_or(0, |s| s.size(1) * 4);
        let m = a.handle.rank_prefix_matrix.cpu_slice::<i32>();
        let (offs, end) = sections(&[nr * nr * 4, n * nr, n * row_bytes, n * scale_bytes]);
        let own = self.capacity_error(OP, end).or_else(|| self.check_handle(OP, &a.handle, n));
        if own.is_none() {
            self.stage_cached_rows(&offs, m, &a.handle.is_token_in_rank, &a.x, a.x_scales.as_ref());
        }
        let words = cached_rows_words(n, row_bytes, scale_bytes);
        let headers = self.rendezvous(Kind::CachedDispatch, words, own)?;
        let same = self.check_same_handles(OP, offs[0], m).and_then(|_| check_row_format(OP, &headers, &words));
        self.together(Kind::CachedDispatch, same)?;
        self.gather_cached_rows(
            OP,
            &headers,
            |m_tok| sections(&[nr * nr * 4, m_tok * nr, m_tok * row_bytes, m_tok * scale_bytes]).0,
            recv_x,
            recv_scales,
        )
    }

    fn combine(&mut self, a: &CombineArgs, o: &CombineOutputs) -> Result<()> {
        const OP: &str = crate::op_names::COMBINE;
        let (r, nr) = (self.info.rank, self.info.num_ranks);
        let rows = a.x.size(0);
        let hidden = a.x.size(1);
        let k = a.topk_weights.as_ref().map_or(0, |w| w.size(1));
        let n = o.combined_x.size(0);
        let m = a.handle.rank_prefix_matrix.cpu_slice::<i32>();
        let (offs, end) = sections(&[nr * nr * 4, rows * hidden * 2, rows * k * 4]);
        let own = self.capacity_error(OP, end).or_else(|| self.check_handle(OP, &a.handle, n));
        if own.is_none() {
            let me = self.ht_region(r);
            me.write(offs[0], m);
            stage_combine_payload(&me, &offs[1..], a);
        }
        let words = combine_words(rows, hidden, k);
        let headers = self.rendezvous(Kind::Combine, words, own)?;
        let same = self.check_same_handles(OP, offs[0], m).and_then(|_| check_combine_format(OP, &headers, &words));
        self.together(Kind::Combine, same)?;

        let in_rank = a.handle.is_token_in_rank.cpu_slice::<u8>();
        let bias: Vec<&[u16]> = [&a.bias_0, &a.bias_1].into_iter().flatten().map(|b| b.cpu_slice::<u16>()).collect();
        let regions: Vec<Region> = (0..nr).map(|d| self.ht_region(d)).collect();
        let srcs: Vec<(&[u16], &[f32])> = headers
            .iter()
            .zip(&regions)
            .map(|(h, reg)| {
                let (o2, _) = sections(&[nr * nr * 4, h.rows() * hidden * 2, h.rows() * k * 4]);
                (reg.slice::<u16>(o2[1], h.rows() * hidden), reg.slice::<f32>(o2[2], h.rows() * k))
            })
            .collect();
        let out = o.combined_x.cpu_slice_mut::<u16>();
        let mut out_w = o.combined_topk_weights.as_ref().map(|t| t.cpu_slice_mut::<f32>());
        let mut next = vec![0usize; nr];
        let mut acc = vec![0f32; hidden];
        let mut acc_w = vec![0f32; k];
        for t in 0..n {
            acc.iter_mut().for_each(|v| *v = 0.0);
            acc_w.iter_mut().for_each(|v| *v = 0.0);
            for b in &bias {
                for (v, &x) in acc.iter_mut().zip(&b[t * hidden..(t + 1) * hidden]) {
                    *v += bf16::to_f32(x);
                }
            }
            for d in (0..nr).filter(|&d| in_rank[t * nr + d] != 0) {
                let row = if r > 0 { m[(r - 1) * nr + d] as usize } else { 0 } + next[d];
                next[d] += 1;
                let (x, w) = srcs[d];
                for (v, &y) in acc.iter_mut().zip(&x[row * hidden..(row + 1) * hidden]) {
                    *v += bf16::to_f32(y);
                }
                for (v, &y) in acc_w.iter_mut().zip(&w[row * k..(row + 1) * k]) {
                    *v += y;
                }
            }
            for (dst, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
                *dst = bf16::from_f32(v);
            }
            if let Some(ow) = out_w.as_deref_mut() {
                ow[t * k..(t + 1) * k].copy_from_slice(&acc_w);
            }
        }
        self.barrier(OP, "all ranks reduced their tokens")
    }
}
