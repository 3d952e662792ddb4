//! LogFMT-10: DeepEP's optional 10-bit logarithmic transport for LL combine
//! (`internode_ll.cu` `logfmt_encode` / `logfmt_check_amaxmin` / `decode_and_accumulate`).
//!
//! # Values (what a GPU kernel must reproduce bit for bit)
//! Per 128-channel group of one bf16 row, with `a_i = |x_i|` (sign bit cleared):
//! - meta: `amax = max a_i`, `amin = min a_i` as bf16 (exact; ordered by their bits).
//! - `log_amax = log2_det(amax)`; `log_amin = log_amax - 32` if `amin == 0`, else
//!   `max(log2_det(amin), log_amax - 32)`; the group *may* be cast iff
//!   `log_amax < 0 && log_amin < log_amax`.
//! - Groups are decided together per chunk of [`chunk_channels`] channels (DeepEP decides per
//!   warp of 32 lanes × `kNumSendUnrolls` int4: 1024 channels if `H % 1024 == 0`, else 512): a
//!   chunk is cast iff every group in it may be; otherwise all its groups travel as raw bf16.
//! - Cast group: `step = (log_amax - log_amin) / 510`, `step_inv = 1 / step`,
//!   `rounding = fma(-log2_det((1 + exp2_det(step)) * 0.5), step_inv, 2)`,
//!   `fused = fma(-log_amin, step_inv, rounding)`,
//!   `code_i = min(511, floor(max(fma(log2_det(a_i), step_inv, fused), 0)))` (9 bits) plus the
//!   sign bit: 10 bits. The rounding offset makes the code round to nearest *in linear space*.
//! - Decode: `v = 0` if `code == 0`, else `exp2_det(fma(code - 1, step, log_amin))`, negated
//!   by the sign bit; raw groups decode to `f32(bf16)`.
//! - Combine accumulates `acc = fma(v, w, acc)` per selection ([`decode_accumulate`]).
//!
//! DeepEP evaluates log2/exp2 with the `lg2.approx`/`ex2.approx` instructions, which no CPU can
//! reproduce; [`log2_det`] and [`exp2_det`] are instead fixed sequences of IEEE f32 operations
//! (exponent split, one division, `fma` Horner polynomials with the constants given as bits),
//! accurate to ~1 ulp, so a CUDA port using `__fmaf_rn`/`__fdiv_rn` gets identical bits. The
//! `min(511, ..)` clamp guards against a rounding overflow DeepEP leaves unchecked.
//!
//! # Slot layout (internal to this crate; DeepEP packs cast chunks densely instead)
//! `slot_bytes(H) = 4·S + 2·H`, `S = H / 128`: `[0, 4S)` meta, per group `u16 amax, u16 amin`
//! (little-endian bf16 bits); group `g`'s payload at `4S + 256·g`: raw = 128 bf16, cast =
//! 128 ten-bit values `sign << 9 | code` packed LSB-first into 160 bytes (the rest zero).

use super::bf16;

/// Channels per group (one meta pair).
pub const GROUP: usize = 128;
/// Magnitude codes: 9 bits.
pub const NUM_VALUES: u32 = 1 << 9;
/// Bytes of one cast group's packed codes (128 × 10 bits).
pub const CAST_GROUP_BYTES: usize = GROUP * 10 / 8;
const RAW_GROUP_BYTES: usize = GROUP * 2;
const LOG_THRESHOLD: f32 = 0.0;
const MIN_CLIP: f32 = 32.0;

// log2(m) = t·(A1 + s·(A3 + s·(A5 + ...))), t = (m-1)/(m+1), s = t², A_k = 2/(k·ln 2).
const A1: u32 = 0x4038_aa3b;
const A3: u32 = 0x3f76_384f;
const A5: u32 = 0x3f13_bb63;
const A7: u32 = 0x3ed3_0bb1;
const A9: u32 = 0x3ea4_258a;
const A11: u32 = 0x3e86_4d42;
const SQRT2: u32 = 0x3fb5_04f3;
// 2^f = Σ_k B_k f^k, B_k = ln(2)^k / k!, k = 0..=7.
const B: [u32; 8] = [0x3f80_0000, 0x3f31_7218, 0x3e75_fdf0, 0x3d63_5847, 0x3c1d_955b, 0x3aae_c3ff, 0x3921_8489, 0x377f_e5fe];

fn c(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// Bytes of one combine slot: meta + bf16-sized payload (DeepEP's `num_bytes_per_combine_msg`).
pub fn slot_bytes(hidden: usize) -> usize {
    hidden / GROUP * 4 + hidden * 2
}

/// Channels decided together (cast or raw): 1024 if `hidden % 1024 == 0`, else 512.
pub fn chunk_channels(hidden: usize) -> usize {
    if hidden % 1024 == 0 {
        1024
    } else {
        512
    }
}

/// Deterministic log2 of an f32 (≈1 ulp): `0 → -inf`, negative or NaN → NaN, `inf → inf`.
/// `x = m·2^e` with `m ∈ [√½, √2]`, then `e + t·q(t²)` with `t = (m-1)/(m+1)` (one IEEE
/// division) and `q` an fma Horner polynomial; powers of two give exact integers.
pub fn log2_det(x: f32) -> f32 {
    if x.is_nan() || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x.is_infinite() {
        return f32::INFINITY;
    }
    let (mut bits, mut e) = (x.to_bits(), 0i32);
    if bits < 0x0080_0000 {
        // Subnormal: scale by 2^23 (exact) to normalise.
        bits = (x * 8_388_608.0).to_bits();
        e = -23;
    }
    e += (bits >> 23) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x7f_ffff) | 0x3f80_0000);
    if m > c(SQRT2) {
        m *= 0.5;
        e += 1;
    }
    let t = (m - 1.0) / (m + 1.0);
    let s = t * t;
    let mut q = c(A11);
    for a in [A9, A7, A5, A3, A1] {
        q = q.mul_add(s, c(a));
    }
    t.mul_add(q, e as f32)
}

/// Deterministic 2^y (≈1 ulp relative): `n = round(y)` (half away from zero), `f = y - n`
/// (exact, |f| ≤ ½), degree-7 fma Horner polynomial times `2^n` built from exponent bits
/// (two steps below 2^-126 so subnormal results round once, deterministically).
pub fn exp2_det(y: f32) -> f32 {
    if y.is_nan() {
        return y;
    }
    if y >= 128.0 {
        return f32::INFINITY;
    }
    if y < -152.0 {
        return 0.0;
    }
    let n = y.round();
    let f = y - n;
    let mut p = c(B[7]);
    for k in (0..7).rev() {
        p = p.mul_add(f, c(B[k]));
    }
    let n = n as i32;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    if n > 127 {
        (p * pow2(127)) * pow2(n - 127)
    } else if n >= -126 {
        p * pow2(n)
    } else {
        (p * pow2(n + 64)) * pow2(-64)
    }
}

/// Per-group quantisation parameters, computed identically by encoder and decoder from the
/// bf16 meta.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GroupParams {
    /// `log2_det(amax)`.
    pub log_amax: f32,
    /// `max(log2_det(amin), log_amax - 32)` (`log_amax - 32` when `amin == 0`).
    pub log_amin: f32,
    /// The group's own cast condition (the chunk decision ANDs these).
    pub castable: bool,
}

impl GroupParams {
    /// From the meta pair (bf16 bits of `max|x|` and `min|x|`).
    pub fn new(amax: u16, amin: u16) -> Self {
        let log_amax = log2_det(bf16::to_f32(amax));
        let amin = bf16::to_f32(amin);
        let log_amin = if amin == 0.0 { log_amax - MIN_CLIP } else { log2_det(amin).max(log_amax - MIN_CLIP) };
        GroupParams { log_amax, log_amin, castable: log_amax < LOG_THRESHOLD && log_amin < log_amax }
    }

    /// `(log_amax - log_amin) / 510`.
    pub fn step(&self) -> f32 {
        (self.log_amax - self.log_amin) / (NUM_VALUES - 2) as f32
    }

    /// 9-bit magnitude code of `a = |x|` (see the module docs).
    pub fn encode(&self, a: f32) -> u32 {
        let step_inv = 1.0 / self.step();
        let rounding = (-log2_det((1.0 + exp2_det(self.step())) * 0.5)).mul_add(step_inv, 2.0);
        let fused = (-self.log_amin).mul_add(step_inv, rounding);
        let v = log2_det(a).mul_add(step_inv, fused).max(0.0).floor();
        (v as u32).min(NUM_VALUES - 1)
    }

    /// Magnitude of a 9-bit code.
    pub fn decode(&self, code: u32) -> f32 {
        if code == 0 {
            0.0
        } else {
            exp2_det(((code - 1) as f32).mul_add(self.step(), self.log_amin))
        }
    }
}

fn meta(slot: &[u8], g: usize) -> (u16, u16) {
    let m = &slot[4 * g..4 * g + 4];
    (u16::from_le_bytes([m[0], m[1]]), u16::from_le_bytes([m[2], m[3]]))
}

/// Per group: parameters and the (chunk-wide) cast decision, from a slot's meta.
fn plan(slot: &[u8], hidden: usize) -> Vec<(GroupParams, bool)> {
    let s = hidden / GROUP;
    let per_chunk = chunk_channels(hidden) / GROUP;
    let params: Vec<GroupParams> = (0..s).map(|g| meta(slot, g)).map(|(a, b)| GroupParams::new(a, b)).collect();
    let mut out = Vec::with_capacity(s);
    for chunk in params.chunks(per_chunk) {
        let cast = chunk.iter().all(|p| p.castable);
        out.extend(chunk.iter().map(|&p| (p, cast)));
    }
    out
}

/// Encodes one row `x [H]` (bf16 bits, `H % 128 == 0`) into `out [slot_bytes(H)]`.
pub fn encode(x: &[u16], out: &mut [u8]) {
    let h = x.len();
    assert!(h % GROUP == 0 && out.len() == slot_bytes(h), "logfmt::encode: bad sizes");
    let s = h / GROUP;
    for (g, xg) in x.chunks_exact(GROUP).enumerate() {
        let amax = xg.iter().map(|&b| b & 0x7fff).max().unwrap_or(0);
        let amin = xg.iter().map(|&b| b & 0x7fff).min().unwrap_or(0);
        out[4 * g..4 * g + 2].copy_from_slice(&amax.to_le_bytes());
        out[4 * g + 2..4 * g + 4].copy_from_slice(&amin.to_le_bytes());
    }
    let plan = plan(out, h);
    let (_, payload) = out.split_at_mut(4 * s);
    for ((xg, pg), (p, cast)) in x.chunks_exact(GROUP).zip(payload.chunks_exact_mut(RAW_GROUP_BYTES)).zip(plan) {
        if !cast {
            for (o, &b) in pg.chunks_exact_mut(2).zip(xg) {
                o.copy_from_slice(&b.to_le_bytes());
            }
            continue;
        }
        pg.fill(0);
        let (mut acc, mut nbits, mut pos) = (0u64, 0u32, 0usize);
        for &b in xg {
            let v = ((b as u64 >> 15) << 9) | p.encode(bf16::to_f32(b & 0x7fff)) as u64;
            acc |= v << nbits;
            nbits += 10;
            while nbits >= 8 {
                pg[pos] = acc as u8;
                acc >>= 8;
                nbits -= 8;
                pos += 1;
            }
        }
        debug_assert_eq!((pos, nbits), (CAST_GROUP_BYTES, 0));
    }
}

/// Calls `f(i, v)` for every decoded channel value of a slot.
fn for_each_value(slot: &[u8], hidden: usize, mut f: impl FnMut(usize, f32)) {
    assert!(hidden % GROUP == 0 && slot.len() >= slot_bytes(hidden), "logfmt::decode: bad sizes");
    let s = hidden / GROUP;
    let payload = &slot[4 * s..slot_bytes(hidden)];
    for (g, ((p, cast), pg)) in plan(slot, hidden).into_iter().zip(payload.chunks_exact(RAW_GROUP_BYTES)).enumerate() {
        let base = g * GROUP;
        if !cast {
            for (i, b) in pg.chunks_exact(2).enumerate() {
                f(base + i, bf16::to_f32(u16::from_le_bytes([b[0], b[1]])));
            }
            continue;
        }
        let (mut acc, mut nbits, mut pos) = (0u64, 0u32, 0usize);
        for i in 0..GROUP {
            while nbits < 10 {
                acc |= (pg[pos] as u64) << nbits;
                pos += 1;
                nbits += 8;
            }
            let v = (acc & 0x3ff) as u32;
            acc >>= 10;
            nbits -= 10;
            let mag = p.decode(v & 0x1ff);
            f(base + i, if v >> 9 != 0 { -mag } else { mag });
        }
    }
}

/// Decodes a slot into `out [H]` f32.
pub fn decode(slot: &[u8], out: &mut [f32]) {
    let h = out.len();
    for_each_value(slot, h, |i, v| out[i] = v);
}

/// `acc[i] = fma(decoded_i, weight, acc[i])` over a slot (`acc [H]`), as DeepEP's
/// `decode_and_accumulate` does (nvcc contracts its `acc += v * w`).
pub fn decode_accumulate(slot: &[u8], weight: f32, acc: &mut [f32]) {
    let h = acc.len();
    for_each_value(slot, h, |i, v| acc[i] = v.mul_add(weight, acc[i]));
}

/// `decode(encode(x))`: the values a receiver sees for row `x`.
pub fn round_trip(x: &[u16]) -> Vec<f32> {
    let mut slot = vec![0u8; slot_bytes(x.len())];
    encode(x, &mut slot);
    let mut out = vec![0f32; x.len()];
    decode(&slot, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn log2_and_exp2_are_accurate_and_exact_on_powers_of_two() {
        for e in -149..128 {
            let p = 2f64.powi(e) as f32;
            assert_eq!(log2_det(p), e as f32, "log2(2^{e})");
            assert_eq!(exp2_det(e as f32), p, "exp2({e})");
        }
        assert_eq!(log2_det(0.0), f32::NEG_INFINITY);
        assert!(log2_det(-1.0).is_nan());
        let mut seed = 7;
        for _ in 0..200_000 {
            let x = (lcg(&mut seed) * 80.0 - 60.0).exp2() as f32;
            let l = log2_det(x);
            let want = (x as f64).log2();
            assert!((l as f64 - want).abs() <= 2.5e-7 * want.abs().max(0.5), "log2({x}) = {l}, want {want}");
            let y = (lcg(&mut seed) * 300.0 - 160.0) as f32;
            let p = exp2_det(y) as f64;
            let want = 2f64.powf(y as f64);
            if want > 1.2e-38 && want < 3.0e38 {
                assert!((p - want).abs() <= 2.5e-7 * want, "exp2({y}) = {p}, want {want}");
            }
        }
    }

    /// A row of `h` values: group g has magnitudes in [lo, hi) times `scale[g]`, random signs.
    fn row(h: usize, seed: &mut u64, scale: impl Fn(usize) -> f64) -> Vec<u16> {
        (0..h)
            .map(|i| {
                let v = (lcg(seed) * 0.9 + 0.05) * scale(i / GROUP);
                bf16::from_f32(if lcg(seed) < 0.5 { -v } else { v } as f32)
            })
            .collect()
    }

    #[test]
    fn cast_groups_stay_within_the_log_quantisation_error() {
        let mut seed = 11;
        for h in [128, 512, 1024, 1536] {
            for round in 0..20 {
                let x = row(h, &mut seed, |g| 0.9 * 0.5f64.powi((g + round) as i32 % 12));
                let mut slot = vec![0u8; slot_bytes(h)];
                encode(&x, &mut slot);
                let y = round_trip(&x);
                for g in 0..h / GROUP {
                    let (amax, amin) = meta(&slot, g);
                    let p = GroupParams::new(amax, amin);
                    assert!(p.castable);
                    let bound = (exp2_det(p.step()) as f64 - 1.0) / 2.0 + 1e-6;
                    for i in g * GROUP..(g + 1) * GROUP {
                        let a = bf16::to_f32(x[i]) as f64;
                        assert_eq!(a.signum(), (y[i] as f64).signum());
                        assert!((y[i] as f64 - a).abs() <= bound * a.abs(), "h {h} i {i}: {a} → {}", y[i]);
                    }
                }
                // The packed codes really are 10 bits: the tail of each cast group is unused.
                let s = h / GROUP;
                assert!((0..s).all(|g| slot[4 * s + g * 256 + CAST_GROUP_BYTES..4 * s + (g + 1) * 256].iter().all(|&b| b == 0)));
            }
        }
    }

    #[test]
    fn raw_fallback_zeros_and_clipping() {
        let mut seed = 5;
        // amax >= 1 in group 1 makes the whole 512-channel chunk raw (exact), chunk 2 casts.
        let x = row(1536, &mut seed, |g| if g == 1 { 2.0 } else { 0.5 });
        let y = round_trip(&x);
        for i in 0..512 {
            assert_eq!(y[i], bf16::to_f32(x[i]));
        }
        assert!((512..1536).any(|i| y[i] != bf16::to_f32(x[i])));
        // hidden % 1024 == 0: one chunk of 1024 channels.
        let x = row(1024, &mut seed, |g| if g == 7 { 2.0 } else { 0.5 });
        assert!(round_trip(&x).iter().zip(&x).all(|(a, &b)| *a == bf16::to_f32(b)));
        // All magnitudes equal: log_amin == log_amax → raw.
        let x = [bf16::from_f32(0.25), bf16::from_f32(-0.25)].repeat(256);
        assert!(round_trip(&x).iter().zip(&x).all(|(a, &b)| *a == bf16::to_f32(b)));
        // Zeros decode to zero; values below 2^(log_amax - 32) become 0 or 2^log_amin.
        let mut x = row(512, &mut seed, |_| 0.5);
        x[3] = 0;
        x[4] = 0x8000;
        x[5] = bf16::from_f32(1e-20);
        let y = round_trip(&x);
        assert_eq!((y[3], y[4]), (0.0, 0.0));
        let p = GroupParams::new(x[..128].iter().map(|b| b & 0x7fff).max().unwrap(), 0);
        assert!(y[5] == 0.0 || y[5] == exp2_det(p.log_amin));
        // NaN / inf force raw and survive.
        let mut x = row(512, &mut seed, |_| 0.5);
        x[0] = 0x7fc0;
        x[1] = 0xff80;
        let y = round_trip(&x);
        assert!(y[0].is_nan() && y[1] == f32::NEG_INFINITY && y[2] == bf16::to_f32(x[2]));
    }

    #[test]
    fn accumulate_is_fma_over_decoded_values() {
        let mut seed = 3;
        let x = row(1024, &mut seed, |g| if g == 3 { 4.0 } else { 0.3 });
        let mut slot = vec![0u8; slot_bytes(1024)];
        encode(&x, &mut slot);
        let d = round_trip(&x);
        let mut acc: Vec<f32> = (0..1024).map(|i| i as f32 * 0.01).collect();
        let want: Vec<f32> = acc.iter().zip(&d).map(|(a, v)| v.mul_add(0.37, *a)).collect();
        decode_accumulate(&slot, 0.37, &mut acc);
        assert_eq!(acc, want);
    }
}
