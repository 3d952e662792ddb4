//! Multi-rank LL tests: ranks are threads of this process sharing one CPU buffer; every result
//! is compared bit for bit with `reference::ll`, and identity experts with DeepEP's tolerance.

use super::*;
use crate::backend::{Backend, CreateArgs};
use crate::config::low_latency_rdma_size_hint;
use crate::reference::ll::{calc_diff, ll_combine, ll_dispatch, LlDispatchRef, LlSpec};

fn tr<T>(v: &mut [T], dtype: DType, sizes: &[usize]) -> TensorRef {
    let sizes: Vec<i64> = sizes.iter().map(|&s| s as i64).collect();
    let t = TensorRef::meta(dtype, Device::Cpu, &sizes);
    TensorRef::new(v.as_mut_ptr() as *mut u8, dtype, Device::Cpu, &sizes, t.strides())
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[derive(Clone, Copy, Default)]
struct Case {
    r: usize,
    e: usize,
    h: usize,
    t: usize,
    k: usize,
    fp8: bool,
    round_scale: bool,
    ue8m0: bool,
    logfmt: bool,
    zero_copy: bool,
    idx_i32: bool,
    /// Expert g multiplies by `1 + g/16` instead of being the identity.
    scaled: bool,
    /// Every fourth token lists its first expert twice.
    dup: bool,
    /// Two dispatches in flight (send A, send B, recv B, recv A), then two combines.
    split: bool,
    rounds: usize,
    seed: u64,
}

impl Case {
    fn spec(&self) -> LlSpec {
        LlSpec { num_ranks: self.r, num_experts: self.e, hidden: self.h, num_max_tokens: self.t, num_topk: self.k }
    }
    fn geo(&self) -> LlGeometry {
        LlGeometry { num_max_dispatch_tokens_per_rank: self.t, hidden: self.h, num_experts: self.e }
    }
    fn opts(&self) -> LlDispatchOptions {
        LlDispatchOptions { use_fp8: self.fp8, round_scale: self.round_scale, use_ue8m0: self.ue8m0, use_nvfp4: false }
    }
}

/// One rank's inputs of one round.
#[derive(Clone)]
struct Input {
    x: Vec<u16>,
    idx: Vec<i64>,
    w: Vec<f32>,
}

fn gen_inputs(c: &Case, round: usize) -> Vec<Input> {
    let mut rng = Rng(c.seed * 1000 + round as u64 + 1);
    (0..c.r)
        .map(|rank| {
            let n = match (round, rank) {
                (0, 0) => 0,
                (0, 1) => 1,
                _ => 1 + rng.below(if c.dup { c.t / 2 } else { c.t }),
            };
            let mut idx = Vec::with_capacity(n * c.k);
            for tok in 0..n {
                let mut experts: Vec<i64> = (0..c.e as i64).collect();
                for j in 0..c.k {
                    let p = j + rng.below(c.e - j);
                    experts.swap(j, p);
                    idx.push(if rng.below(8) == 0 { -1 } else { experts[j] });
                }
                if c.dup && tok % 4 == 0 {
                    idx[tok * c.k + 1] = idx[tok * c.k];
                }
            }
            let x = (0..n * c.h)
                .map(|i| {
                    // Amplitude per (token, 1024 channels), varied per 128-channel group:
                    // small rows exercise LogFMT casts, large ones the raw fallback.
                    let (tok, ch) = (i / c.h, i % c.h);
                    let amp = [0.02, 0.3, 0.9, 4.0, 100.0][(tok * 7 + ch / 1024 + round) % 5] * (1 + ch / 128 % 3) as f32 / 3.0;
                    bf16::from_f32((rng.unit() - 0.5) * 2.0 * amp)
                })
                .collect();
            let w = (0..n * c.k).map(|_| rng.unit() + 0.05).collect();
            Input { x, idx, w }
        })
        .collect()
}

/// A dispatch's output tensors on one rank.
struct Disp {
    x16: Vec<u16>,
    x8: Vec<u8>,
    sf: Vec<f32>,
    su: Vec<i32>,
    count: Vec<i32>,
    src: Vec<i32>,
    range: Vec<i64>,
    state: Vec<i64>,
}

impl Disp {
    fn new(c: &Case) -> Disp {
        let (el, rt, s) = (c.e / c.r, c.r * c.t, c.h / 128);
        Disp {
            x16: vec![0x7fc0; if c.fp8 { 0 } else { el * rt * c.h }],
            x8: vec![0x7f; if c.fp8 { el * rt * c.h } else { 0 }],
            sf: vec![f32::NAN; if c.fp8 && !c.ue8m0 { el * rt * s } else { 0 }],
            su: vec![-1; if c.ue8m0 { el * rt * s / 4 } else { 0 }],
            count: vec![-1; el],
            src: vec![-1; el * rt],
            range: vec![-1; el * c.r],
            state: vec![0; LL_STATE_LEN],
        }
    }

    /// Scales are allocated `[E_l, S, R*T]` and viewed transposed, as DeepEP does.
    fn outputs(&mut self, c: &Case) -> LlDispatchOutputs {
        let (el, rt) = ((c.e / c.r) as i64, (c.r * c.t) as i64);
        let scales = if c.ue8m0 {
            let s4 = (c.h / 512) as i64;
            Some(TensorRef::new(self.su.as_mut_ptr() as *mut u8, DType::Int32, Device::Cpu, &[el, rt, s4], &[s4 * rt, 1, rt]))
        } else if c.fp8 {
            let s = (c.h / 128) as i64;
            Some(TensorRef::new(self.sf.as_mut_ptr() as *mut u8, DType::Float32, Device::Cpu, &[el, rt, s], &[s * rt, 1, rt]))
        } else {
            None
        };
        let sizes = [el as usize, rt as usize, c.h];
        LlDispatchOutputs {
            recv_x: if c.fp8 { tr(&mut self.x8, DType::Float8E4m3, &sizes) } else { tr(&mut self.x16, DType::BFloat16, &sizes) },
            recv_x_scales: scales,
            recv_count: tr(&mut self.count, DType::Int32, &[el as usize]),
            src_info: tr(&mut self.src, DType::Int32, &[el as usize, rt as usize]),
            layout_range: tr(&mut self.range, DType::Int64, &[el as usize, c.r]),
            recv_state: Some(tr(&mut self.state, DType::Int64, &[LL_STATE_LEN])),
        }
    }

    /// Dequantised f32 of received row `row` of local expert `l`.
    fn row_f32(&self, c: &Case, l: usize, row: usize) -> Vec<f32> {
        let (rt, h) = (c.r * c.t, c.h);
        let at = (l * rt + row) * h;
        (0..h)
            .map(|i| {
                if !c.fp8 {
                    return bf16::to_f32(self.x16[at + i]);
                }
                let g = i / 128;
                let si = if c.ue8m0 {
                    let s4 = c.h / 512;
                    fp8::ue8m0_to_f32(self.su[l * s4 * rt + (g / 4) * rt + row].to_le_bytes()[g % 4])
                } else {
                    self.sf[l * (h / 128) * rt + g * rt + row]
                };
                fp8::dequant(self.x8[at + i], si)
            })
            .collect()
    }
}

/// The simulated expert: identity (cast back to bf16), or a per-expert scaling.
fn expert(c: &Case, gexp: usize, v: &[f32]) -> Vec<u16> {
    let f = if c.scaled { 1.0 + gexp as f32 / 16.0 } else { 1.0 };
    v.iter().map(|&a| bf16::from_f32(a * f)).collect()
}

fn ref_expert_out(c: &Case, d: &[LlDispatchRef]) -> Vec<Vec<Vec<u16>>> {
    let (el, h, s) = (c.e / c.r, c.h, c.h / 128);
    d.iter()
        .enumerate()
        .map(|(rank, dr)| {
            dr.experts
                .iter()
                .enumerate()
                .map(|(l, ex)| {
                    let rows: Vec<Vec<u16>> = (0..ex.rows.len())
                        .map(|row| {
                            let v: Vec<f32> = if c.fp8 {
                                (0..h).map(|i| fp8::dequant(ex.fp8[row * h + i], ex.scale_inv[row * s + i / 128])).collect()
                            } else {
                                ex.bf16[row * h..(row + 1) * h].iter().map(|&b| bf16::to_f32(b)).collect()
                            };
                            expert(c, rank * el + l, &v)
                        })
                        .collect();
                    rows.concat()
                })
                .collect()
        })
        .collect()
}

/// Per round on one rank: the dispatch outputs and the combined `[N, H]`.
struct RankRound {
    disp: Disp,
    combined: Vec<u16>,
}

fn run_rank(c: Case, id: Vec<u8>, rank: usize, inputs: Vec<Input>) -> Vec<RankRound> {
    let args = CreateArgs {
        unique_id: &id,
        rank,
        num_ranks: c.r,
        device: Device::Cpu,
        num_nvl_bytes: 0,
        num_rdma_bytes: low_latency_rdma_size_hint(c.t, c.h, c.r, c.e),
        low_latency_mode: true,
    };
    let mut b = CpuBackend::create(&args).unwrap();
    b.timeout = Duration::from_secs(60);
    let (g, o, el, rt, h) = (c.geo(), c.opts(), c.e / c.r, c.r * c.t, c.h);
    let mut cum = vec![0i32; el];
    let mut wait = vec![0i64; c.r];
    let null = std::ptr::null_mut();
    // Per round: x, topk_idx (int32 and int64 copies), weights; the tensors point into these.
    let mut bufs: Vec<Input> = inputs.clone();
    let mut idx32: Vec<Vec<i32>> = inputs.iter().map(|i| i.idx.iter().map(|&v| v as i32).collect()).collect();
    let idx_t: Vec<TensorRef> = (0..inputs.len())
        .map(|i| {
            let n = inputs[i].idx.len() / c.k;
            if c.idx_i32 {
                tr(&mut idx32[i], DType::Int32, &[n, c.k])
            } else {
                tr(&mut bufs[i].idx, DType::Int64, &[n, c.k])
            }
        })
        .collect();
    let mut disps: Vec<Disp> = inputs.iter().map(|_| Disp::new(&c)).collect();
    let mut results = Vec::new();
    // Rounds run one after another, or (split) all dispatches in flight at once.
    let groups: Vec<Vec<usize>> = if c.split { vec![(0..inputs.len()).collect()] } else { (0..inputs.len()).map(|i| vec![i]).collect() };
    let mut combined: Vec<Vec<u16>> = inputs.iter().map(|i| vec![0xffff; i.idx.len() / c.k * h]).collect();
    // Rounds run as whole ops (no recv_state: the backend's own), the others as split calls.
    let whole = |i: usize| !c.split && i % 2 == 1;
    for grp in groups {
        if grp == [2] {
            // Cleaning mid-sequence resets halves and sequence numbers on every rank.
            b.clean_low_latency_buffer(&g, null).unwrap();
        }
        for &i in &grp {
            let n = inputs[i].idx.len() / c.k;
            let x = tr(&mut bufs[i].x, DType::BFloat16, &[n, h]);
            let send = LlDispatchSendArgs { x, topk_idx: idx_t[i], topk_weights: None, x_global_scale: None };
            if grp == [1] {
                // DeepEP's test dispatches twice in some rounds, so dispatch and combine both
                // visit both halves; the extra result is dropped.
                let mut extra = Disp::new(&c);
                b.ll_dispatch_send(&g, &o, &send, &extra.outputs(&c), null).unwrap();
                let none = LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: None };
                b.ll_dispatch_recv(&g, &o, &extra.outputs(&c), &none, null).unwrap();
            }
            if whole(i) {
                // A whole dispatch given no recv_state: the backend's own carries send to receive.
                let stats = LlStats {
                    cumulative_local_expert_recv_stats: Some(tr(&mut cum, DType::Int32, &[el])),
                    wait_recv_cost_stats: Some(tr(&mut wait, DType::Int64, &[c.r])),
                };
                b.ll_dispatch(&g, &o, &send, &LlDispatchOutputs { recv_state: None, ..disps[i].outputs(&c) }, &stats, null).unwrap();
                disps[i].state.copy_from_slice(&b.own_state[0]); // for the (half, call) check below
                continue;
            }
            b.ll_dispatch_send(&g, &o, &send, &disps[i].outputs(&c), null).unwrap();
        }
        for &i in grp.iter().rev().filter(|&&i| !whole(i)) {
            let stats = LlStats {
                cumulative_local_expert_recv_stats: Some(tr(&mut cum, DType::Int32, &[el])),
                wait_recv_cost_stats: Some(tr(&mut wait, DType::Int64, &[c.r])),
            };
            b.ll_dispatch_recv(&g, &o, &disps[i].outputs(&c), &stats, null).unwrap();
        }
        if c.split {
            // Everyone has consumed both halves before combines reuse them.
            b.barrier("test", "split dispatches received").unwrap();
        }
        let mut states = Vec::new();
        for &i in &grp {
            let d = &mut disps[i];
            let mut xe = vec![0x7fc0u16; el * rt * h]; // NaN rows that must never be read
            for l in 0..el {
                for row in 0..d.count[l] as usize {
                    let y = expert(&c, rank * el + l, &d.row_f32(&c, l, row));
                    xe[(l * rt + row) * h..(l * rt + row + 1) * h].copy_from_slice(&y);
                }
            }
            if c.zero_copy {
                let view = b.next_low_latency_combine_buffer(&g).unwrap();
                let m = (h + h / 64) as i64;
                assert_eq!((view.sizes(), view.strides()), (&[el as i64, rt as i64, h as i64][..], &[rt as i64 * m, m, 1][..]));
                let reg = b.ll_region(rank);
                let base = view.data_ptr() as usize - reg.ptr_at(0) as usize;
                for l in 0..el {
                    for row in 0..rt {
                        let at = base + 2 * (l * view.strides()[0] as usize + row * view.strides()[1] as usize);
                        reg.write::<u16>(at, &xe[(l * rt + row) * h..(l * rt + row + 1) * h]);
                    }
                }
                xe.fill(0x7fc0);
            }
            let mut state = vec![0i64; LL_STATE_LEN];
            let args = LlCombineSendArgs {
                x: tr(&mut xe, DType::BFloat16, &[el, rt, h]),
                src_info: tr(&mut d.src, DType::Int32, &[el, rt]),
                layout_range: tr(&mut d.range, DType::Int64, &[el, c.r]),
                use_logfmt: c.logfmt,
                zero_copy: c.zero_copy,
                recv_state: Some(tr(&mut state, DType::Int64, &[LL_STATE_LEN])),
                signal: None,
            };
            if whole(i) {
                // A whole combine given no recv_state (the backend's own).
                let n = inputs[i].idx.len() / c.k;
                let recv = LlCombineRecvArgs {
                    topk_idx: idx_t[i],
                    topk_weights: tr(&mut bufs[i].w, DType::Float32, &[n, c.k]),
                    recv_state: None,
                    out: tr(&mut combined[i], DType::BFloat16, &[n, h]),
                };
                let stats =
                    LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: Some(tr(&mut wait, DType::Int64, &[c.r])) };
                b.ll_combine(&g, &LlCombineSendArgs { recv_state: None, ..args }, &recv, &stats, null).unwrap();
                continue;
            }
            b.ll_combine_send(&g, &args, null).unwrap();
            states.push((i, state));
        }
        for (i, mut state) in states.into_iter().rev() {
            let n = inputs[i].idx.len() / c.k;
            let args = LlCombineRecvArgs {
                topk_idx: idx_t[i],
                topk_weights: tr(&mut bufs[i].w, DType::Float32, &[n, c.k]),
                recv_state: Some(tr(&mut state, DType::Int64, &[LL_STATE_LEN])),
                out: tr(&mut combined[i], DType::BFloat16, &[n, h]),
            };
            let stats =
                LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: Some(tr(&mut wait, DType::Int64, &[c.r])) };
            b.ll_combine_recv(&g, &args, &stats, null).unwrap();
        }
    }
    if c.split && inputs.len() > 1 {
        // The first dispatch's half has been reused since: its receive must be refused.
        let e = b.ll_dispatch_recv(
            &g,
            &o,
            &disps[0].outputs(&c),
            &LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: None },
            null,
        );
        assert!(e.unwrap_err().to_string().contains("reused"));
    }
    if !c.split && disps.len() >= 3 {
        // (half, call) per round: calls are numbered across both halves (round 0: dispatch 1,
        // combine 2; round 1: dispatches 3 and 4, the extra one on half 1); the clean before
        // round 2 restarted at half 0, call 1.
        let hs: Vec<(i64, i64)> = disps.iter().take(3).map(|d| (d.state[0], d.state[1])).collect();
        assert_eq!(hs, vec![(0, 1), (1, 4), (0, 1)]);
    }
    let total: Vec<i32> = (0..el).map(|l| disps.iter().map(|d| d.count[l]).sum()).collect();
    assert_eq!(cum, total, "cumulative_local_expert_recv_stats");
    assert!(wait.iter().all(|&v| v >= 0));
    b.clean_low_latency_buffer(&g, null).unwrap();
    b.destroy().unwrap();
    for (d, comb) in disps.into_iter().zip(combined) {
        results.push(RankRound { disp: d, combined: comb });
    }
    results
}

fn check(c: Case) {
    let inputs: Vec<Vec<Input>> = (0..c.rounds).map(|round| gen_inputs(&c, round)).collect();
    let id = CpuBackend::unique_id();
    let handles: Vec<_> = (0..c.r)
        .map(|rank| {
            let (id, mine) = (id.clone(), inputs.iter().map(|ri| ri[rank].clone()).collect());
            std::thread::spawn(move || run_rank(c, id, rank, mine))
        })
        .collect();
    let got: Vec<Vec<RankRound>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (spec, el, rt, h, s) = (c.spec(), c.e / c.r, c.r * c.t, c.h, c.h / 128);
    for (round, inp) in inputs.iter().enumerate() {
        let xs: Vec<Vec<u16>> = inp.iter().map(|i| i.x.clone()).collect();
        let idx: Vec<Vec<i64>> = inp.iter().map(|i| i.idx.clone()).collect();
        let ws: Vec<Vec<f32>> = inp.iter().map(|i| i.w.clone()).collect();
        let want = ll_dispatch(&spec, &xs, &idx, c.fp8, c.round_scale);
        for (rank, wr) in want.iter().enumerate() {
            let d = &got[rank][round].disp;
            assert_eq!(d.range, wr.layout_range, "layout_range rank {rank} round {round}");
            for l in 0..el {
                let ex = &wr.experts[l];
                assert_eq!(d.count[l] as usize, wr.recv_count[l], "recv_count rank {rank} expert {l}");
                for (row, info) in ex.rows.iter().enumerate() {
                    let at = (l * rt + row) * h;
                    assert_eq!(d.src[l * rt + row] as usize, info.src_token);
                    if !c.fp8 {
                        assert_eq!(&d.x16[at..at + h], &ex.bf16[row * h..(row + 1) * h], "rank {rank} expert {l} row {row}");
                        continue;
                    }
                    assert_eq!(&d.x8[at..at + h], &ex.fp8[row * h..(row + 1) * h], "rank {rank} expert {l} row {row}");
                    for g in 0..s {
                        let si = ex.scale_inv[row * s + g];
                        if c.ue8m0 {
                            let p = d.su[l * (s / 4) * rt + (g / 4) * rt + row];
                            assert_eq!(p.to_le_bytes()[g % 4], fp8::ue8m0(si));
                        } else {
                            assert_eq!(d.sf[l * s * rt + g * rt + row].to_bits(), si.to_bits());
                        }
                    }
                }
            }
        }
        let comb = ll_combine(&spec, &idx, &ws, &ref_expert_out(&c, &want), c.logfmt);
        if c.logfmt && round > 0 {
            // The data must really exercise the 10-bit casts, not only the raw fallback.
            assert_ne!(comb, ll_combine(&spec, &idx, &ws, &ref_expert_out(&c, &want), false), "no LogFMT cast happened");
        }
        for rank in 0..c.r {
            assert_eq!(got[rank][round].combined, comb[rank], "combine rank {rank} round {round}");
            if c.scaled || c.round_scale || comb[rank].is_empty() {
                continue;
            }
            // DeepEP's check: identity experts give x · Σ_k w_k.
            let (n, k) = (idx[rank].len() / c.k, c.k);
            let mut expect = Vec::with_capacity(n * h);
            for t in 0..n {
                let sw: f64 = (0..k).filter(|&j| idx[rank][t * k + j] >= 0).map(|j| ws[rank][t * k + j] as f64).sum();
                expect.extend(xs[rank][t * h..(t + 1) * h].iter().map(|&b| bf16::to_f32(b) as f64 * sw));
            }
            let gotv: Vec<f64> = comb[rank].iter().map(|&b| bf16::to_f32(b) as f64).collect();
            let diff = calc_diff(&expect, &gotv);
            assert!(diff < if c.fp8 { 9e-4 } else { 1e-5 }, "calc_diff {diff} rank {rank} round {round}");
        }
    }
}

fn base(r: usize) -> Case {
    Case { r, e: 3 * r, h: 256, t: 12, k: 4, rounds: 3, seed: r as u64, ..Default::default() }
}

#[test]
fn bf16_dispatch_combine_matches_reference_on_2_3_4_ranks() {
    for r in [2, 3, 4] {
        check(Case { idx_i32: r == 3, ..base(r) });
    }
}

#[test]
fn fp8_dispatch_with_float_and_ue8m0_scales() {
    check(Case { fp8: true, h: 512, ..base(3) });
    check(Case { fp8: true, round_scale: true, h: 512, idx_i32: true, ..base(2) });
    check(Case { fp8: true, round_scale: true, ue8m0: true, h: 1024, e: 8, ..base(4) });
}

#[test]
fn logfmt_and_zero_copy_combine() {
    check(Case { logfmt: true, h: 1024, ..base(2) });
    check(Case { logfmt: true, fp8: true, h: 512, scaled: true, ..base(3) });
    check(Case { zero_copy: true, ..base(4) });
    check(Case { zero_copy: true, fp8: true, h: 512, scaled: true, ..base(2) });
}

#[test]
fn split_calls_two_in_flight_duplicates_and_hidden_128() {
    check(Case { split: true, rounds: 2, fp8: true, h: 512, ..base(3) });
    check(Case { split: true, rounds: 2, logfmt: true, scaled: true, ..base(2) });
    check(Case { dup: true, scaled: true, h: 128, t: 16, k: 3, idx_i32: true, ..base(3) });
}

#[test]
fn small_buffer_bad_ids_and_missing_peer_are_reported() {
    let spec = |rdma: usize, id: &[u8], rank: usize, n: usize| {
        CpuBackend::create(&CreateArgs {
            unique_id: id,
            rank,
            num_ranks: n,
            device: Device::Cpu,
            num_nvl_bytes: 0,
            num_rdma_bytes: rdma,
            low_latency_mode: true,
        })
        .unwrap()
    };
    let c = Case { r: 1, e: 2, h: 128, t: 4, k: 1, ..Default::default() };
    let (g, o) = (c.geo(), c.opts());
    let null = std::ptr::null_mut();
    let mut b = spec(4096, &CpuBackend::unique_id(), 0, 1);
    let e = b.next_low_latency_combine_buffer(&g).err().unwrap().to_string();
    let need = LowLatencyLayout::new(4, 128, 2).total_bytes();
    assert!(e.contains(&format!("needs {need} bytes")) && e.contains("num_rdma_bytes = 4096"), "{e}");
    let mut b = spec(low_latency_rdma_size_hint(4, 128, 1, 2), &CpuBackend::unique_id(), 0, 1);
    let (mut x, mut idx, mut d) = (vec![0u16; 128], vec![5i64], Disp::new(&c));
    let send = LlDispatchSendArgs {
        x: tr(&mut x, DType::BFloat16, &[1, 128]),
        topk_idx: tr(&mut idx, DType::Int64, &[1, 1]),
        topk_weights: None,
        x_global_scale: None,
    };
    let e = b.ll_dispatch_send(&g, &o, &send, &d.outputs(&c), null).err().unwrap().to_string();
    assert!(e.contains("topk_idx[0, 0] = 5 is not an expert id"), "{e}");
    // A rank that never sends: the receiver times out naming it.
    let id = CpuBackend::unique_id();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let id1 = id.clone();
    let peer = std::thread::spawn(move || {
        let mut b = spec(1 << 20, &id1, 1, 2);
        rx.recv().unwrap();
        b.destroy().unwrap();
    });
    let c = Case { r: 2, ..c };
    let mut b = spec(1 << 20, &id, 0, 2);
    b.timeout = Duration::from_millis(200);
    let mut d = Disp::new(&c);
    idx[0] = 1;
    let send = LlDispatchSendArgs {
        x: tr(&mut x, DType::BFloat16, &[1, 128]),
        topk_idx: tr(&mut idx, DType::Int64, &[1, 1]),
        topk_weights: None,
        x_global_scale: None,
    };
    b.ll_dispatch_send(&c.geo(), &o, &send, &d.outputs(&c), null).unwrap();
    let stats = LlStats { cumulative_local_expert_recv_stats: None, wait_recv_cost_stats: None };
    match b.ll_dispatch_recv(&c.geo(), &o, &d.outputs(&c), &stats, null) {
        Err(Error::Timeout { peers, rank: 0, .. }) => assert_eq!(peers, vec![1]),
        other => panic!("expected a timeout, got {:?}", other.err()),
    }
    tx.send(()).unwrap();
    b.destroy().unwrap();
    peer.join().unwrap();
}

/// Past one NVLink domain (docs/RANKS.md), ranks as threads: well under a second each on 2 cores,
/// so all run in CI (the 64-rank case found the message counts overflowing into the index table).
fn many_ranks(r: usize) {
    check(Case { e: 2 * r, h: 128, t: 4, k: 4, rounds: 2, ..base(r) });
    check(Case { e: 2 * r, h: 256, t: 4, k: 3, fp8: true, logfmt: true, rounds: 1, ..base(r) });
}

#[test]
fn sixteen_ranks_match_reference() {
    many_ranks(16);
}

#[test]
fn thirty_two_ranks_match_reference() {
    many_ranks(32);
}

#[test]
fn sixty_four_ranks_match_reference() {
    many_ranks(64);
}
