//! Internode normal mode on the CPU backend: the bit-exact reference of DeepEP's
//! `internode_dispatch` / `internode_combine` for GPU kernels to be tested against.
//!
//! Every rank of a CPU buffer sees every other rank's HT area, so tokens are pulled straight
//! from their source (as in `ht.rs`); what makes the ops "internode" is the geometry — `D` ranks
//! per NVLink domain (`BufferInfo::nvl_domain_size`) — which fixes the 10-tensor handle (computed
//! here as DeepEP's notify and forwarding kernels would fill it, see
//! [`crate::backend::internode::InternodeHandle`]) and the two-level rounding of the combine.

use super::ht::{
    cached_rows_words, check_combine_format, check_row_format, combine_words, sections, stage_combine_payload, Header, Kind, RecvData,
};
use super::CpuBackend;
use crate::backend::internode::{
    InternodeCachedDispatchArgs, InternodeCombineArgs, InternodeDispatchArgs, InternodeDispatchOutputs, InternodeHandle, InternodePlan,
    NVL_HEAD_COLUMNS,
};
use crate::backend::{CombineOutputs, DispatchArgs, InternodeMode};
use crate::error::{Error, Result};
use crate::layout;
use crate::numerics::bf16;
use crate::tensor::TensorRef;

/// The domain geometry of a buffer: `D` ranks per domain, `Rr` domains.
#[derive(Clone, Copy)]
struct Geo {
    d: usize,
    rr: usize,
}

/// Is token `t` of a rank with `in_rank [n, R]` routed to ≥ 1 rank of domain `j`?
fn in_domain(in_rank: &[u8], nr: usize, d: usize, t: usize, j: usize) -> bool {
    in_rank[t * nr + j * d..t * nr + (j + 1) * d].iter().any(|&b| b != 0)
}

/// The channel of each token when `n` tokens are split into `c` channels.
fn channels_of(n: usize, c: usize) -> Vec<usize> {
    let mut out = vec![0; n];
    for ch in 0..c {
        let (s, e) = layout::channel_range(n, c, ch);
        out[s..e].iter_mut().for_each(|v| *v = ch);
    }
    out
}

/// Sender side of the handle from this rank's `in_rank [n, R]`: `rdma_channel_prefix_matrix
/// [Rr, C]` and `send_rdma_head [n, Rr]`.
fn rdma_send_side(in_rank: &[u8], n: usize, nr: usize, g: Geo, c: usize) -> (Vec<i32>, Vec<i32>) {
    let mut prefix = vec![0i32; g.rr * c];
    let mut head = vec![-1i32; n * g.rr];
    let chan = channels_of(n, c);
    for j in 0..g.rr {
        let mut slot = vec![0i32; c];
        for t in 0..n {
            if in_domain(in_rank, nr, g.d, t, j) {
                head[t * g.rr + j] = slot[chan[t]];
                slot[chan[t]] += 1;
            }
        }
        let mut acc = 0;
        for ch in 0..c {
            acc += slot[ch];
            prefix[j * c + ch] = acc;
        }
    }
    (prefix, head)
}

/// Receive side of the RDMA leg of rank `r`: per source domain i, the tokens of its rail rank
/// `i·D + r%D` that go to `r`'s domain. Returns `recv_rdma_channel_prefix_matrix [Rr, C]`,
/// `recv_rdma_rank_prefix_sum [Rr]` and `send_nvl_head` rows (`[rdma_rows, 8]`, real rows only).
fn rdma_recv_side(ins: &[(usize, Vec<u8>)], r: usize, nr: usize, g: Geo, c: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let (node, local) = (r / g.d, r % g.d);
    let mut rcpm = vec![0i32; g.rr * c];
    let mut prefix = vec![0i32; g.rr];
    let mut nvl_head = Vec::new();
    let mut total = 0;
    for i in 0..g.rr {
        let (n_s, in_rank) = &ins[i * g.d + local];
        let chan = channels_of(*n_s, c);
        let mut per_chan = vec![0i32; c];
        // Slot counters per (channel, destination local rank), restarted for each source domain.
        let mut slot = vec![0i32; c * g.d];
        for t in (0..*n_s).filter(|&t| in_domain(in_rank, nr, g.d, t, node)) {
            let ch = chan[t];
            per_chan[ch] += 1;
            let mut row = [-1i32; NVL_HEAD_COLUMNS];
            for (l, v) in row.iter_mut().enumerate().take(g.d) {
                if in_rank[t * nr + node * g.d + l] != 0 {
                    *v = slot[ch * g.d + l];
                    slot[ch * g.d + l] += 1;
                }
            }
            nvl_head.extend_from_slice(&row);
        }
        let mut acc = 0;
        for ch in 0..c {
            acc += per_chan[ch];
            rcpm[i * c + ch] = acc;
        }
        total += acc;
        prefix[i] = total;
    }
    (rcpm, prefix, nvl_head)
}

/// Tokens rank `r` receives from every rank (`[R]`), from the published `in_rank`s.
fn recv_counts(ins: &[(usize, Vec<u8>)], r: usize, nr: usize) -> Vec<i32> {
    ins.iter().map(|(n_s, in_rank)| (0..*n_s).filter(|&t| in_rank[t * nr + r] != 0).count() as i32).collect()
}

/// `SourceMeta` bytes of token `t` of source rank `s` as received by a rank of domain `node`.
fn source_meta(in_rank: &[u8], t: usize, s: usize, nr: usize, g: Geo, node: usize) -> [u8; 8] {
    let mut bits = 0i32;
    for l in 0..g.d {
        if in_rank[t * nr + node * g.d + l] != 0 {
            bits |= 1 << l;
        }
    }
    let mut m = [0u8; 8];
    m[..4].copy_from_slice(&((s / g.d) as i32).to_le_bytes());
    m[4..].copy_from_slice(&bits.to_le_bytes());
    m
}

impl CpuBackend {
    fn geo(&self) -> Geo {
        let d = self.info.nvl_domain_size;
        Geo { d, rr: self.info.num_ranks / d }
    }

    /// Every rank's published `(n, is_token_in_rank)` of the running dispatch.
    fn all_in_rank(&self, a: &DispatchArgs) -> Vec<(usize, Vec<u8>)> {
        (0..self.info.num_ranks).map(|s| self.published_in_rank(a, s)).collect()
    }

    /// Own checks of a handle: `is_token_in_rank` fits `n` tokens and the rows cover the
    /// receive count the handle claims.
    fn check_internode_handle(&self, op: &'static str, h: &InternodeHandle, n: usize, rows: usize) -> Option<Error> {
        let nr = self.info.num_ranks;
        let len = h.is_token_in_rank.numel();
        if len != n * nr {
            return Some(Error::invalid(op, format!("stale handle: is_token_in_rank has {len} entries for {n} tokens and {nr} ranks")));
        }
        let recv = h.recv_gbl_rank_prefix_sum.cpu_slice::<i32>()[nr - 1];
        (recv < 0 || rows < recv as usize).then(|| {
            Error::invalid(op, format!("stale handle: {rows} rows but recv_gbl_rank_prefix_sum says this rank receives {recv} tokens"))
        })
    }

    /// After the rendezvous of a handle-based op: every rank's published `recv_gbl_rank_prefix_sum`
    /// must match the routing every rank published (same verdict on all ranks).
    fn check_published_handles(
        &self,
        op: &'static str,
        headers: &[Header],
        offs_of: impl Fn(usize) -> Vec<usize>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        let nr = self.info.num_ranks;
        let ins: Vec<(usize, Vec<u8>)> = (0..nr)
            .map(|s| (headers[s].rows(), self.ht_region(s).slice::<u8>(offs_of(headers[s].rows())[1], headers[s].rows() * nr).to_vec()))
            .collect();
        for (d, header) in headers.iter().enumerate().take(nr) {
            let counts = recv_counts(&ins, d, nr);
            let theirs = self.ht_region(d).slice::<i32>(offs_of(header.rows())[0], nr).to_vec();
            let mut acc = 0;
            for s in 0..nr {
                acc += counts[s];
                if theirs[s] != acc {
                    return Err(Error::invalid(op, format!("stale handle: rank {d}'s recv_gbl_rank_prefix_sum[{s}] is {} but the ranks' is_token_in_rank route {acc} tokens there; all ranks must pass handles of the same dispatch", theirs[s])));
                }
            }
        }
        Ok(ins)
    }
}

impl InternodeMode for CpuBackend {
    fn internode_dispatch_prepare(&mut self, a: &InternodeDispatchArgs) -> Result<InternodePlan> {
        let op = Kind::InternodeDispatch.op();
        let (nr, g) = (self.info.num_ranks, self.geo());
        let n = a.base.x.size(0);
        let in_rank = a.base.is_token_in_rank.cpu_slice::<u8>();
        let per_rdma = a.num_tokens_per_rdma_rank.cpu_slice::<i32>();
        let own = (0..g.rr).find_map(|j| {
            let cnt = (0..n).filter(|&t| in_domain(in_rank, nr, g.d, t, j)).count() as i32;
            (cnt != per_rdma[j]).then(|| {
                Error::invalid(
                    op,
                    format!(
                        "num_tokens_per_rdma_rank[{j}] = {} but is_token_in_rank selects {cnt} tokens for NVLink domain {j}",
                        per_rdma[j]
                    ),
                )
            })
        });
        let plan = self.dispatch_prepare_as(Kind::InternodeDispatch, &a.base, own)?;
        // RDMA-leg sizes of every rank, so a worst-case overflow anywhere is raised everywhere.
        let ins = self.all_in_rank(&a.base);
        let worst = a.base.num_worst_tokens;
        let mut mine = 0;
        let mut verdict = Ok(());
        for d in 0..nr {
            let (_, prefix, _) = rdma_recv_side(&ins, d, nr, g, 1);
            let cnt = *prefix.last().unwrap_or(&0) as usize;
            let their_worst = Header::read(&self.ht_region(d)).0[super::ht::W_WORST] as usize;
            if their_worst > 0 && cnt > their_worst && verdict.is_ok() {
                verdict = Err(Error::invalid(
                    op,
                    format!("tokens over capacity: rank {d} forwards {cnt} tokens of its rail but its num_worst_tokens is {their_worst}"),
                ));
            }
            if d == self.info.rank {
                mine = cnt;
            }
        }
        self.together(Kind::InternodeDispatch, verdict)?;
        Ok(InternodePlan { plan, num_rdma_recv_tokens: mine, num_rdma_rows: if worst > 0 { worst } else { mine } })
    }

    fn internode_dispatch_finish(&mut self, a: &InternodeDispatchArgs, p: &InternodePlan, o: &InternodeDispatchOutputs) -> Result<()> {
        let op = Kind::InternodeDispatch.op();
        let (r, nr, g) = (self.info.rank, self.info.num_ranks, self.geo());
        let c = a.base.config.num_channels();
        let data = RecvData {
            recv_x: &o.recv_x,
            recv_x_scales: o.recv_x_scales.as_ref(),
            recv_topk_idx: o.recv_topk_idx.as_ref(),
            recv_topk_weights: o.recv_topk_weights.as_ref(),
        };
        let rows = self.pull_dispatch(&a.base, &p.plan, &data);
        let ins = self.all_in_rank(&a.base);
        let n = a.base.x.size(0);
        let own = a.base.is_token_in_rank.cpu_slice::<u8>();

        // Sender side.
        let own_bool: Vec<bool> = own.iter().map(|&b| b != 0).collect();
        let (gbl_cpm, _) = layout::send_side(&own_bool, n, nr, c);
        o.handle.gbl_channel_prefix_matrix.cpu_slice_mut::<i32>().copy_from_slice(&gbl_cpm);
        let (rdma_cpm, rdma_head) = rdma_send_side(own, n, nr, g, c);
        o.handle.rdma_channel_prefix_matrix.cpu_slice_mut::<i32>().copy_from_slice(&rdma_cpm);
        o.handle.send_rdma_head.cpu_slice_mut::<i32>().copy_from_slice(&rdma_head);

        // RDMA-leg receive side.
        let (rcpm, rprefix, nvl_head) = rdma_recv_side(&ins, r, nr, g, c);
        o.handle.recv_rdma_channel_prefix_matrix.cpu_slice_mut::<i32>().copy_from_slice(&rcpm);
        o.handle.recv_rdma_rank_prefix_sum.cpu_slice_mut::<i32>().copy_from_slice(&rprefix);
        let out_head = o.handle.send_nvl_head.cpu_slice_mut::<i32>();
        out_head.fill(-1);
        out_head[..nvl_head.len()].copy_from_slice(&nvl_head);

        // NVLink receive side: absolute row starts per (source, channel).
        let counts = recv_counts(&ins, r, nr);
        let gprefix: Vec<i32> = counts
            .iter()
            .scan(0, |acc, &v| {
                *acc += v;
                Some(*acc)
            })
            .collect();
        let gcpm = o.handle.recv_gbl_channel_prefix_matrix.cpu_slice_mut::<i32>();
        for (s, (n_s, in_rank)) in ins.iter().enumerate() {
            let base = if s > 0 { gprefix[s - 1] } else { 0 };
            let starts = layout::recv_channel_starts(|t| in_rank[t * nr + r] != 0, *n_s, c);
            for ch in 0..c {
                gcpm[s * c + ch] = base + starts[ch];
            }
        }
        o.handle.recv_gbl_rank_prefix_sum.cpu_slice_mut::<i32>().copy_from_slice(&gprefix);
        let meta = o.handle.recv_src_meta.cpu_slice_mut::<u8>();
        meta.fill(0);
        for (row, &(s, t)) in rows.iter().enumerate() {
            meta[row * 8..(row + 1) * 8].copy_from_slice(&source_meta(&ins[s].1, t, s, nr, g, r / g.d));
        }
        self.barrier(op, "all ranks received their tokens")
    }

    fn internode_cached_dispatch(
        &mut self,
        a: &InternodeCachedDispatchArgs,
        recv_x: &TensorRef,
        recv_scales: Option<&TensorRef>,
    ) -> Result<()> {
        let kind = Kind::InternodeCachedDispatch;
        let op = kind.op();
        let nr = self.info.num_ranks;
        let n = a.x.size(0);
        let row_bytes = a.x.size(1) * a.x.dtype.size();
        let scale_bytes = a.x_scales.as_ref().map_or(0, |s| s.size(1) * 4);
        let secs = |m: usize| sections(&[nr * 4, m * nr, m * row_bytes, m * scale_bytes]).0;
        let (offs, end) = sections(&[nr * 4, n * nr, n * row_bytes, n * scale_bytes]);
        let rows = recv_x.size(0);
        let own = self.capacity_error(op, end).or_else(|| self.check_internode_handle(op, &a.handle, n, rows));
        if own.is_none() {
            self.stage_cached_rows(
                &offs,
                a.handle.recv_gbl_rank_prefix_sum.cpu_slice::<i32>(),
                &a.handle.is_token_in_rank,
                &a.x,
                a.x_scales.as_ref(),
            );
        }
        let words = cached_rows_words(n, row_bytes, scale_bytes);
        let headers = self.rendezvous(kind, words, own)?;
        let checked = self.check_published_handles(op, &headers, secs).and_then(|_| check_row_format(op, &headers, &words));
        self.together(kind, checked)?;
        self.gather_cached_rows(op, &headers, secs, recv_x, recv_scales)
    }

    fn internode_combine(&mut self, a: &InternodeCombineArgs, o: &CombineOutputs) -> Result<()> {
        let kind = Kind::InternodeCombine;
        let op = kind.op();
        let (r, nr, g) = (self.info.rank, self.info.num_ranks, self.geo());
        let rows = a.x.size(0);
        let hidden = a.x.size(1);
        let k = a.topk_weights.as_ref().map_or(0, |w| w.size(1));
        let n = o.combined_x.size(0);
        // Sections: recv_gbl_rank_prefix_sum, is_token_in_rank, x, weights.
        let secs = |m_tok: usize, m_rows: usize| sections(&[nr * 4, m_tok * nr, m_rows * hidden * 2, m_rows * k * 4]).0;
        let (offs, end) = sections(&[nr * 4, n * nr, rows * hidden * 2, rows * k * 4]);
        let own = self.capacity_error(op, end).or_else(|| self.check_internode_handle(op, &a.handle, n, rows));
        if own.is_none() {
            let me = self.ht_region(r);
            me.write(offs[0], a.handle.recv_gbl_rank_prefix_sum.cpu_slice::<i32>());
            me.write(offs[1], a.handle.is_token_in_rank.cpu_slice::<u8>());
            stage_combine_payload(&me, &offs[2..], a);
        }
        let mut words = combine_words(n, hidden, k);
        // Rows of x travel in a spare header word (W_ROWS holds the token count here).
        words[super::ht::W_EXPERTS] = rows as u64;
        let headers = self.rendezvous(kind, words, own)?;
        let checked = self.check_published_handles(op, &headers, |m| secs(m, 0)).and_then(|_| check_combine_format(op, &headers, &words));
        self.together(kind, checked)?;

        let in_rank = a.handle.is_token_in_rank.cpu_slice::<u8>();
        let bias: Vec<&[u16]> = [&a.bias_0, &a.bias_1].into_iter().flatten().map(|b| b.cpu_slice::<u16>()).collect();
        let regions: Vec<_> = (0..nr).map(|d| self.ht_region(d)).collect();
        // Per destination d: (its rows, its weights, the first row it received from this rank).
        let srcs: Vec<(&[u16], &[f32], usize)> = headers
            .iter()
            .zip(&regions)
            .map(|(h, reg)| {
                let m_rows = h.0[super::ht::W_EXPERTS] as usize;
                let o2 = secs(h.rows(), m_rows);
                let prefix = reg.slice::<i32>(o2[0], nr);
                let start = if r > 0 { prefix[r - 1] as usize } else { 0 };
                (reg.slice::<u16>(o2[2], m_rows * hidden), reg.slice::<f32>(o2[3], m_rows * k), start)
            })
            .collect();
        let out = o.combined_x.cpu_slice_mut::<u16>();
        let mut out_w = o.combined_topk_weights.as_ref().map(|t| t.cpu_slice_mut::<f32>());
        let mut next = vec![0usize; nr];
        let (mut acc, mut part) = (vec![0f32; hidden], vec![0f32; hidden]);
        let (mut acc_w, mut part_w) = (vec![0f32; k], vec![0f32; k]);
        // DeepEP's RDMA receiver starts from `f32(bias_0) + f32(bias_1)` (an absent bias reads as
        // +0) in one addition, so two −0 biases give −0 (not `0 + b0 + b1` = +0).
        let bias_at = |i: usize, t: usize| bias.get(i).map_or(0.0, |b| bf16::to_f32(b[t]));
        for t in 0..n {
            for (e, v) in acc.iter_mut().enumerate() {
                *v = bias_at(0, t * hidden + e) + bias_at(1, t * hidden + e);
            }
            acc_w.fill(0.0);
            for j in 0..g.rr {
                let dsts: Vec<usize> = (j * g.d..(j + 1) * g.d).filter(|&d| in_rank[t * nr + d] != 0).collect();
                if dsts.is_empty() {
                    continue;
                }
                // The forwarder of domain j: fp32 sum over its local ranks, one bf16 partial.
                part.fill(0.0);
                part_w.fill(0.0);
                for d in dsts {
                    let (x, w, start) = srcs[d];
                    let row = start + next[d];
                    next[d] += 1;
                    for (v, &y) in part.iter_mut().zip(&x[row * hidden..(row + 1) * hidden]) {
                        *v += bf16::to_f32(y);
                    }
                    for (v, &y) in part_w.iter_mut().zip(&w[row * k..(row + 1) * k]) {
                        *v += y;
                    }
                }
                for (v, &p) in acc.iter_mut().zip(&part) {
                    *v += bf16::to_f32(bf16::from_f32(p));
                }
                for (v, &p) in acc_w.iter_mut().zip(&part_w) {
                    *v += p;
                }
            }
            for (dst, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
                *dst = bf16::from_f32(v);
            }
            if let Some(ow) = out_w.as_deref_mut() {
                ow[t * k..(t + 1) * k].copy_from_slice(&acc_w);
            }
        }
        self.barrier(op, "all ranks reduced their tokens")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 ranks as 2 domains x 2: the handle pieces against hand-computed values.
    #[test]
    fn rdma_sides_by_hand() {
        let g = Geo { d: 2, rr: 2 };
        // Rank 0 has 3 tokens: t0 -> ranks {1}, t1 -> {2, 3}, t2 -> {0, 3}. One channel.
        let r0 = vec![0u8, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1];
        let (prefix, head) = rdma_send_side(&r0, 3, 4, g, 1);
        assert_eq!(prefix, vec![2, 2]);
        assert_eq!(head, vec![0, -1, -1, 0, 1, 1]);
        // Rank 3 (domain 1, local 1) receives on the RDMA leg from ranks 1 and 3 (its rail).
        let none = (0usize, vec![]);
        let r1 = (2usize, vec![0u8, 0, 0, 1, 0, 0, 1, 0]);
        let r3 = (1usize, vec![0u8, 0, 1, 1]);
        let ins = vec![none.clone(), r1, none, r3];
        let (rcpm, rprefix, nvl_head) = rdma_recv_side(&ins, 3, 4, g, 1);
        assert_eq!(rcpm, vec![2, 1]);
        assert_eq!(rprefix, vec![2, 3]);
        let row = |a: i32, b: i32| [a, b, -1, -1, -1, -1, -1, -1];
        assert_eq!(nvl_head, [row(-1, 0), row(0, -1), row(0, 0)].concat());
        assert_eq!(source_meta(&ins[1].1, 1, 1, 4, g, 1), [0, 0, 0, 0, 1, 0, 0, 0]);
    }
}
