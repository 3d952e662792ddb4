//! Single-process reference of low-latency dispatch and combine over all ranks at once, in the
//! CPU backend's deterministic order. DeepEP's own row order within an expert is
//! nondeterministic; everything else (counts, per-row data, scales, combine values) is what
//! DeepEP produces, with the numerics of [`crate::numerics::fp8`] and
//! [`crate::numerics::logfmt`].
//!
//! Row order of local expert `l` on rank `d`: source ranks ascending; within a source, its
//! (token, k) selections in token order, then k order. Every selection is one row, so a token
//! that lists the same expert twice yields two rows.

use crate::numerics::{bf16, fp8, logfmt};

/// Problem geometry. `E % R == 0`, `H % 128 == 0`, every rank has `N_r ≤ T` tokens.
#[derive(Copy, Clone, Debug)]
pub struct LlSpec {
    /// R.
    pub num_ranks: usize,
    /// E (global experts).
    pub num_experts: usize,
    /// H.
    pub hidden: usize,
    /// T: `num_max_dispatch_tokens_per_rank`.
    pub num_max_tokens: usize,
    /// K.
    pub num_topk: usize,
}

impl LlSpec {
    /// E_l = E / R.
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }
}

/// Where one received row came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LlRow {
    /// Rank that dispatched the token.
    pub src_rank: usize,
    /// Token index in the source rank's `x` (the row's `src_info`).
    pub src_token: usize,
    /// Which top-k slot of that token selected this expert.
    pub k: usize,
}

/// `routes[d][l]`: the rows local expert `l` of rank `d` receives, in order. `topk_idx[r]` is
/// rank r's `[N_r, K]` global expert ids (−1 = none).
pub fn ll_routes(spec: &LlSpec, topk_idx: &[Vec<i64>]) -> Vec<Vec<Vec<LlRow>>> {
    let (el, k) = (spec.local_experts(), spec.num_topk);
    let mut routes = vec![vec![Vec::new(); el]; spec.num_ranks];
    for (r, idx) in topk_idx.iter().enumerate() {
        for (i, &e) in idx.iter().enumerate() {
            if e >= 0 {
                let e = e as usize;
                routes[e / el][e % el].push(LlRow { src_rank: r, src_token: i / k, k: i % k });
            }
        }
    }
    routes
}

/// What local expert `l` of one rank receives.
#[derive(Clone, Debug, Default)]
pub struct LlExpertRows {
    /// Origin of each row, in receive order.
    pub rows: Vec<LlRow>,
    /// `[rows, H]` bf16 bits (BF16 dispatch).
    pub bf16: Vec<u16>,
    /// `[rows, H]` E4M3 bytes (FP8 dispatch).
    pub fp8: Vec<u8>,
    /// `[rows, H/128]` f32 `scale_inv` (FP8 dispatch; UE8M0 stores `fp8::ue8m0` of these).
    pub scale_inv: Vec<f32>,
}

/// One rank's LL dispatch result.
#[derive(Clone, Debug, Default)]
pub struct LlDispatchRef {
    /// `[E_l]`.
    pub experts: Vec<LlExpertRows>,
    /// `[E_l]` valid rows per local expert.
    pub recv_count: Vec<usize>,
    /// `[E_l, R]`: `(begin << 32) | count` per source rank.
    pub layout_range: Vec<i64>,
}

/// LL dispatch of every rank: `x[r]` is `[N_r, H]` bf16 bits. FP8 casts each token with
/// [`fp8::ll_cast_token`]; BF16 copies it.
pub fn ll_dispatch(spec: &LlSpec, x: &[Vec<u16>], topk_idx: &[Vec<i64>], use_fp8: bool, round_scale: bool) -> Vec<LlDispatchRef> {
    let (h, r_n, el) = (spec.hidden, spec.num_ranks, spec.local_experts());
    let s = h / fp8::GROUP;
    ll_routes(spec, topk_idx)
        .into_iter()
        .map(|per_l| {
            let mut out = LlDispatchRef { layout_range: vec![0; el * r_n], ..Default::default() };
            for (l, rows) in per_l.into_iter().enumerate() {
                let mut ex = LlExpertRows::default();
                let mut begin = 0usize;
                for src in 0..r_n {
                    let count = rows.iter().filter(|row| row.src_rank == src).count();
                    out.layout_range[l * r_n + src] = ((begin as i64) << 32) | count as i64;
                    begin += count;
                }
                for row in &rows {
                    let tok = &x[row.src_rank][row.src_token * h..(row.src_token + 1) * h];
                    if use_fp8 {
                        let (mut q, mut si) = (vec![0u8; h], vec![0f32; s]);
                        fp8::ll_cast_token(tok, round_scale, &mut q, &mut si);
                        ex.fp8.extend(q);
                        ex.scale_inv.extend(si);
                    } else {
                        ex.bf16.extend_from_slice(tok);
                    }
                }
                out.recv_count.push(rows.len());
                ex.rows = rows;
                out.experts.push(ex);
            }
            out
        })
        .collect()
}

/// LL combine of every rank. `expert_out[d][l]` is `[rows, H]` bf16: the output of local
/// expert `l` of rank `d` for its received rows, in [`ll_routes`] order. Returns `[N_r, H]`
/// bf16 per rank:
/// `out[n] = bf16(acc)`, `acc = 0; for k ascending with topk_idx[n][k] ≥ 0:
/// acc = fma(y_k, w[n][k], acc)`, where `y_k` is the f32 value of the row expert
/// `topk_idx[n][k]` returned for token n (LogFMT: `logfmt::round_trip` of it). The receive slot
/// is keyed by (expert, token), so when a token lists an expert twice both selections read
/// the row of the *last* of them (the one written last).
pub fn ll_combine(
    spec: &LlSpec,
    topk_idx: &[Vec<i64>],
    weights: &[Vec<f32>],
    expert_out: &[Vec<Vec<u16>>],
    use_logfmt: bool,
) -> Vec<Vec<u16>> {
    let (h, k, el) = (spec.hidden, spec.num_topk, spec.local_experts());
    let routes = ll_routes(spec, topk_idx);
    // slot[(e, r, n)] = row index in routes[e / el][e % el]; later rows overwrite earlier ones.
    let mut slot = std::collections::HashMap::new();
    for (d, per_l) in routes.iter().enumerate() {
        for (l, rows) in per_l.iter().enumerate() {
            for (i, row) in rows.iter().enumerate() {
                slot.insert((d * el + l, row.src_rank, row.src_token), i);
            }
        }
    }
    topk_idx
        .iter()
        .enumerate()
        .map(|(r, idx)| {
            let n_tok = idx.len() / k.max(1);
            let mut out = vec![0u16; n_tok * h];
            for n in 0..n_tok {
                let mut acc = vec![0f32; h];
                for kk in 0..k {
                    let e = idx[n * k + kk];
                    if e < 0 {
                        continue;
                    }
                    let e = e as usize;
                    let row = slot[&(e, r, n)];
                    let y = &expert_out[e / el][e % el][row * h..(row + 1) * h];
                    let w = weights[r][n * k + kk];
                    let vals: Vec<f32> = if use_logfmt { logfmt::round_trip(y) } else { y.iter().map(|&b| bf16::to_f32(b)).collect() };
                    for (a, v) in acc.iter_mut().zip(vals) {
                        *a = v.mul_add(w, *a);
                    }
                }
                for (o, a) in out[n * h..(n + 1) * h].iter_mut().zip(acc) {
                    *o = bf16::from_f32(a);
                }
            }
            out
        })
        .collect()
}

/// DeepEP's test metric `calc_diff(x, y) = 1 − 2·Σ(x+1)(y+1) / Σ((x+1)² + (y+1)²)` in f64.
pub fn calc_diff(x: &[f64], y: &[f64]) -> f64 {
    assert_eq!(x.len(), y.len());
    let (mut xy, mut sq) = (0f64, 0f64);
    for (&a, &b) in x.iter().zip(y) {
        let (a, b) = (a + 1.0, b + 1.0);
        xy += a * b;
        sq += a * a + b * b;
    }
    if sq == 0.0 {
        0.0
    } else {
        1.0 - 2.0 * xy / sq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_order_and_combine_of_identity_experts() {
        // R = 2, E = 4 (E_l = 2), H = 128, T = 4, K = 2.
        let spec = LlSpec { num_ranks: 2, num_experts: 4, hidden: 128, num_max_tokens: 4, num_topk: 2 };
        let idx = vec![vec![3, 0, -1, 3, 1, 1], vec![0, 2]];
        let routes = ll_routes(&spec, &idx);
        let rows = |d: usize, l: usize| routes[d][l].iter().map(|r| (r.src_rank, r.src_token, r.k)).collect::<Vec<_>>();
        assert_eq!(rows(0, 0), vec![(0, 0, 1), (1, 0, 0)]);
        assert_eq!(rows(0, 1), vec![(0, 2, 0), (0, 2, 1)]); // duplicate selection: two rows
        assert_eq!(rows(1, 1), vec![(0, 0, 0), (0, 1, 1)]);
        assert_eq!(rows(1, 0), vec![(1, 0, 1)]);
        let x: Vec<Vec<u16>> = vec![(0..3 * 128).map(|i| bf16::from_f32((i / 128 + 1) as f32)).collect(), vec![bf16::from_f32(-2.0); 128]];
        let d = ll_dispatch(&spec, &x, &idx, false, false);
        assert_eq!(d[0].recv_count, vec![2, 2]);
        assert_eq!(d[0].layout_range, vec![1, 1 << 32 | 1, 2, 2 << 32]);
        assert_eq!(d[1].layout_range, vec![0, 1, 2, 2 << 32]);
        let out: Vec<Vec<Vec<u16>>> = d.iter().map(|r| r.experts.iter().map(|e| e.bf16.clone()).collect()).collect();
        let w = vec![vec![0.5, 0.25, 9.0, 1.0, 2.0, 4.0], vec![1.5, 1.0]];
        let c = ll_combine(&spec, &idx, &w, &out, false);
        let v = |r: usize, n: usize| bf16::to_f32(c[r][n * 128]);
        assert_eq!((v(0, 0), v(0, 1), v(0, 2), v(1, 0)), (0.75, 2.0, 18.0, -5.0));
        let f = fp8::f32_to_e4m3;
        let d8 = ll_dispatch(&spec, &x, &idx, true, false);
        assert_eq!(d8[0].experts[0].fp8[0], f(448.0));
        assert_eq!(d8[0].experts[0].scale_inv[0], 1.0 * fp8::FP8_MAX_INV);
        assert!(calc_diff(&[1.0, 2.0], &[1.0, 2.0]).abs() < 1e-15);
    }
}
