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
//! - Cast group (fixed-point parameters, units of 2^-23, so that both ends use one grid):
//!   `lmin_q = rne(log_amin · 2^23)`, `lmax_q = rne(log_amax · 2^23)` (i32),
//!   `step_q = (lmax_q - lmin_q + 255) / 510` (integer division, rounded to nearest). A group may
//!   be cast only if also `log_amin >= -125` (every decoded value is then a normal f32; groups of
//!   magnitudes below 2^-93 travel raw) and `step_q >= 32` (a range of 0.002 octaves: distinct
//!   bf16 magnitudes lie at least 0.0056 apart).
//! - Encode, in integers: a magnitude's fixed-point log2 (biased by 127·2^23) is
//!   `a_q = (E << 23) + LOG2_Q[m]` for its bf16 exponent bits `E` and 7 mantissa bits `m`, with
//!   `LOG2_Q[m] = rne(log2_det(1 + m/128) · 2^23)` (for subnormals and zero the same formula, whose
//!   code is 0 in every cast group: their log2 lies more than 1 below `log_amin >= -125`). Per
//!   group `M = rne(2^36 / f32(step_q))` (an f32 division; `step_q >= 32` keeps it below 2^32),
//!   `R_q = f32(fma(-ln2/8, step_q · 2^-23, 1.5)) · 2^36` (an integer), `c = R_q - (lmin_q +
//!   127·2^23) · M` (i64); `code_i = clamp((a_q · M + c) >> 36, 0, 511)` (9 bits: the code of
//!   `(log2 a - log_amin) / step + R`) plus the sign bit: 10 bits. The rounding offset `R` makes
//!   the code round to nearest *in linear space*: the midpoint of `2^y` and `2^(y + s)` is
//!   `2^(y + L(s))` with `L(s) = log2((1 + 2^s) / 2) = s/2 + (ln2/8)·s² + O(s⁴)`, and the code
//!   counts from 1 at `log_amin`, so `R = 2 - L(s)/s = 1.5 - (ln2/8)·s`; at `s <= 32/510` the dropped
//!   terms move a boundary by under 10^-6 of a code, `M`'s rounding by under 10^-4.
//! - Decode: `v = 0` if `code == 0`; else `y = lmin_q + (code - 1) · step_q` (i32, the log2 in
//!   units of 2^-23), `v = P(m) · 2^(y >> 23)` with `m = 1 + (y mod 2^23) · 2^-23 ∈ [1, 2)` and
//!   `P(m) = fma(fma(fma(P3, m, P2), m, P1), m, P0)` (f32; a minimax fit of `2^(m-1)`, relative
//!   error below 7.5e-5 on every f32 of `[1, 2)`), the power of two applied by adding `y`'s upper
//!   bits to `P(m)`'s exponent (exact); negated by the sign bit; raw groups decode to `f32(bf16)`.
//!   Against `2^y` exactly the decode adds at most [`DECODE_REL_ERROR`] relative error, a 26th of
//!   the half-ulp to which the combine's bf16 output is rounded anyway. This is where this crate's
//!   LogFMT differs from DeepEP's, whose decode is `ex2.approx` of a float `y`: it takes a handful
//!   of integer and `fma` instructions per value instead of an exp2 (bench/NOTES.md session 50).
//! - Combine accumulates `acc = fma(v, w, acc)` per selection ([`decode_accumulate`]).
//!
//! DeepEP evaluates log2/exp2 with the `lg2.approx`/`ex2.approx` instructions, which no CPU can
//! reproduce; [`log2_det`] is instead a fixed sequence of IEEE f32 operations (exponent split, one
//! division, an `fma` Horner polynomial with the constants given as bits), accurate to ~1 ulp, and
//! the decode above is integer and `fma` work, so a CUDA port using `__fmaf_rn`/`__fdiv_rn` gets
//! identical bits. The `min(511, ..)` clamp guards against a rounding overflow DeepEP leaves
//! unchecked.
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
/// Fraction bits of the fixed-point log2 parameters (`lmin_q`, `step_q`).
pub const FIX_BITS: u32 = 23;
/// The least `log_amin` of a cast group: every decoded value is then a normal f32.
pub const LOG_AMIN_FLOOR: f32 = -125.0;
/// `ln2 / 8` (f32 bits): the encoder's second-order rounding term (module docs).
const ROUND_C: u32 = 0x3db1_7218;
// P(m) ≈ 2^(m-1) on [1, 2): minimax for relative error, coefficients as f32 bits (P0..P3).
const P: [u32; 4] = [0x3ee7_7e21, 0x3ef4_9e86, 0xbc03_277d, 0x3d9f_cb10];
/// Fraction bits of the encoder's code arithmetic (`M`, `R_q`).
const CODE_BITS: u32 = 36;
/// The least `step_q` of a cast group (keeps `M` below 2^32).
const MIN_STEP_Q: i32 = 32;
/// Most relative error of a decoded magnitude against `2^y` (checked on every f32 `m` of `[1, 2)`).
pub const DECODE_REL_ERROR: f64 = 7.5e-5;

// log2(m) = t·(A1 + s·(A3 + s·(A5 + ...))), t = (m-1)/(m+1), s = t², A_k = 2/(k·ln 2).
const A1: u32 = 0x4038_aa3b;
const A3: u32 = 0x3f76_384f;
const A5: u32 = 0x3f13_bb63;
const A7: u32 = 0x3ed3_0bb1;
const A9: u32 = 0x3ea4_258a;
const A11: u32 = 0x3e86_4d42;
const SQRT2: u32 = 0x3fb5_04f3;

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

/// The decoded magnitude of the fixed-point log2 `y` (units of 2^-23): `P(m) · 2^(y >> 23)`, `m`
/// the fraction of `y` as a mantissa in `[1, 2)` (module docs). For `y >= -125 · 2^23` (every code
/// of a cast group) the result is a normal f32.
pub fn pow2_q(y: i32) -> f32 {
    let m = f32::from_bits(0x3f80_0000 | (y as u32 & 0x7f_ffff));
    let p = c(P[3]).mul_add(m, c(P[2])).mul_add(m, c(P[1])).mul_add(m, c(P[0]));
    f32::from_bits(p.to_bits().wrapping_add(y as u32 & 0xff80_0000))
}

/// Per-group quantisation parameters, computed identically by encoder and decoder from the
/// bf16 meta.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GroupParams {
    /// `log2_det(amax)`.
    pub log_amax: f32,
    /// `max(log2_det(amin), log_amax - 32)` (`log_amax - 32` when `amin == 0`).
    pub log_amin: f32,
    /// `rne(log_amin · 2^23)` (0 unless castable).
    pub lmin_q: i32,
    /// `(lmax_q - lmin_q + 255) / 510` (0 unless castable).
    pub step_q: i32,
    /// The group's own cast condition (the chunk decision ANDs these).
    pub castable: bool,
}

/// `rne(v · 2^23)` of a finite `v` with `|v| < 256`.
fn fix(v: f32) -> i32 {
    (v * (1u32 << FIX_BITS) as f32).round_ties_even() as i32
}

/// The encoder's log2 table: `LOG2_Q[m] = rne(log2_det(1 + m/128) · 2^23)`, `m` in `0..128`.
fn log2_q_table() -> &'static [u32; 128] {
    static T: std::sync::OnceLock<[u32; 128]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|m| fix(log2_det(1.0 + m as f32 / 128.0)) as u32))
}

/// The encoder's fixed-point log2 of a bf16 magnitude (15 bits), biased by 127·2^23:
/// `(E << 23) + LOG2_Q[m]`.
pub fn log2_q_biased(b: u16) -> u32 {
    ((b as u32 & 0x7f80) << 16) + log2_q_table()[(b & 0x7f) as usize]
}

/// A cast group's encoder constants ([`GroupParams::encoder`]; the kernels' `Encoder`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Encoder {
    /// `rne(2^36 / f32(step_q))`.
    pub m: u32,
    /// `R_q - (lmin_q + 127·2^23) · M`.
    pub c: i64,
}

impl Encoder {
    /// 9-bit magnitude code of the bf16 magnitude `b` (15 bits): `clamp((a_q · M + c) >> 36, 0, 511)`.
    pub fn code(&self, b: u16) -> u32 {
        let v = (log2_q_biased(b) as u64 * self.m as u64) as i64 + self.c;
        (v >> CODE_BITS).clamp(0, (NUM_VALUES - 1) as i64) as u32
    }
}

impl GroupParams {
    /// From the meta pair (bf16 bits of `max|x|` and `min|x|`).
    pub fn new(amax: u16, amin: u16) -> Self {
        let log_amax = log2_det(bf16::to_f32(amax));
        let amin = bf16::to_f32(amin);
        let log_amin = if amin == 0.0 { log_amax - MIN_CLIP } else { log2_det(amin).max(log_amax - MIN_CLIP) };
        let mut p = GroupParams { log_amax, log_amin, lmin_q: 0, step_q: 0, castable: false };
        if log_amax < LOG_THRESHOLD && log_amin < log_amax && log_amin >= LOG_AMIN_FLOOR {
            p.lmin_q = fix(log_amin);
            p.step_q = (fix(log_amax) - p.lmin_q + 255) / (NUM_VALUES - 2) as i32;
            p.castable = p.step_q >= MIN_STEP_Q;
        }
        p
    }

    /// `step_q · 2^-23` (exact).
    pub fn step(&self) -> f32 {
        self.step_q as f32 / (1u32 << FIX_BITS) as f32
    }

    /// The encoder's per-group constants `M` and `c` (module docs). Castable groups only.
    pub fn encoder(&self) -> Encoder {
        let m = ((1u64 << CODE_BITS) as f32 / self.step_q as f32).round_ties_even() as u32;
        let r = (-c(ROUND_C)).mul_add(self.step(), 1.5) * (1u64 << CODE_BITS) as f32;
        Encoder { m, c: r as i64 - (self.lmin_q as i64 + (127 << FIX_BITS)) * m as i64 }
    }

    /// Magnitude of a 9-bit code. Castable groups only.
    pub fn decode(&self, code: u32) -> f32 {
        if code == 0 {
            0.0
        } else {
            pow2_q(self.lmin_q + (code as i32 - 1) * self.step_q)
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
        let e = p.encoder();
        let (mut acc, mut nbits, mut pos) = (0u64, 0u32, 0usize);
        for &b in xg {
            let v = ((b as u64 >> 15) << 9) | e.code(b & 0x7fff) as u64;
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
    fn log2_is_accurate_and_exact_on_powers_of_two() {
        for e in -149..128 {
            assert_eq!(log2_det(2f64.powi(e) as f32), e as f32, "log2(2^{e})");
        }
        assert_eq!(log2_det(0.0), f32::NEG_INFINITY);
        assert!(log2_det(-1.0).is_nan());
        let mut seed = 7;
        for _ in 0..200_000 {
            let x = (lcg(&mut seed) * 80.0 - 60.0).exp2() as f32;
            let l = log2_det(x);
            let want = (x as f64).log2();
            assert!((l as f64 - want).abs() <= 2.5e-7 * want.abs().max(0.5), "log2({x}) = {l}, want {want}");
        }
    }

    #[test]
    fn pow2_q_is_within_its_bound_on_every_fraction_and_exact_in_the_exponent() {
        let one = 1i64 << FIX_BITS;
        let mut worst = 0f64;
        for f in 0..one {
            let got = pow2_q((-one + f) as i32) as f64; // y in [-1, 0): 2^(y) = 2^(f/2^23 - 1)
            let want = (f as f64 / one as f64 - 1.0).exp2();
            worst = worst.max((got / want - 1.0).abs());
        }
        assert!(worst <= DECODE_REL_ERROR, "worst relative error {worst:e}");
        assert!(worst > DECODE_REL_ERROR / 2.0, "the bound is loose: {worst:e}");
        // Every exponent a cast group reaches scales exactly: 2^n · (the value at n = -1) · 2.
        let mut seed = 3;
        for _ in 0..2000 {
            let f = (lcg(&mut seed) * one as f64) as i64;
            let base = pow2_q((-one + f) as i32);
            for n in -125i64..=0 {
                let y = n * one + f;
                let want = base * 2f32.powi(n as i32 + 1);
                assert_eq!(pow2_q(y as i32).to_bits(), want.to_bits(), "y {y}");
                assert!(pow2_q(y as i32).is_normal());
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
                    let bound = ((p.step() as f64).exp2() - 1.0) / 2.0 + DECODE_REL_ERROR + 1e-6;
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
        assert!(y[5] == 0.0 || y[5] == p.decode(1));
        // A group whose log_amin is below -125 (amax about 2^-100 and a zero, so log_amin about -132)
        // makes its chunk raw.
        let mut x = row(1024, &mut seed, |g| if g == 2 { 2f64.powi(-100) } else { 0.5 });
        x[300] = 0;
        assert!(!GroupParams::new(x[256..384].iter().map(|b| b & 0x7fff).max().unwrap(), 0).castable);
        assert!(round_trip(&x).iter().zip(&x).all(|(a, &b)| *a == bf16::to_f32(b)));
        // NaN / inf force raw and survive.
        let mut x = row(512, &mut seed, |_| 0.5);
        x[0] = 0x7fc0;
        x[1] = 0xff80;
        let y = round_trip(&x);
        assert!(y[0].is_nan() && y[1] == f32::NEG_INFINITY && y[2] == bf16::to_f32(x[2]));
    }

    #[test]
    fn distinct_bf16_magnitudes_never_meet_the_step_floor() {
        // The least log range of a group with amin < amax is between adjacent bf16 magnitudes (or
        // the 32-octave clip with a zero): its step_q stays far above MIN_STEP_Q, which only
        // guards the encoder's M < 2^32.
        let mut least = i32::MAX;
        for amax in 1u16..0x3f80 {
            for amin in [amax - 1, 0] {
                let p = GroupParams::new(amax, amin);
                if p.log_amax < 0.0 && p.log_amin < p.log_amax && p.log_amin >= LOG_AMIN_FLOOR {
                    least = least.min(p.step_q);
                }
            }
        }
        assert!(least >= 2 * MIN_STEP_Q, "least step_q {least}");
    }

    /// DeepEP's LogFMT round trip of one castable group in exact arithmetic (its `lg2.approx` and
    /// `ex2.approx` taken as exact, which flatters it): the values `internode_ll.cu` decodes.
    fn deepep_ideal_group(xg: &[u16]) -> Vec<f64> {
        let a: Vec<f64> = xg.iter().map(|&b| bf16::to_f32(b & 0x7fff) as f64).collect();
        let (amax, amin) = (a.iter().cloned().fold(0.0, f64::max), a.iter().cloned().fold(f64::INFINITY, f64::min));
        let lmax = amax.log2();
        let lmin = if amin == 0.0 { lmax - 32.0 } else { amin.log2().max(lmax - 32.0) };
        let step = (lmax - lmin) / 510.0;
        let rounding = 2.0 - ((1.0 + step.exp2()) * 0.5).log2() / step - lmin / step;
        a.iter()
            .zip(xg)
            .map(|(&v, &b)| {
                let code = (v.log2() / step + rounding).max(0.0).floor().min(511.0);
                let d = if code == 0.0 { 0.0 } else { ((code - 1.0) * step + lmin).exp2() };
                if b & 0x8000 != 0 {
                    -d
                } else {
                    d
                }
            })
            .collect()
    }

    #[test]
    fn round_trip_error_is_deepeps_plus_at_most_the_decode_bound() {
        let mut seed = 23;
        let (mut ours, mut theirs) = ((0f64, 0f64), (0f64, 0f64)); // (max, sum) of relative errors
        let mut n = 0usize;
        for round in 0..400 {
            // Groups spanning 1 to 30 octaves (amin clipped at 32), scales down to 2^-60.
            let span = 2f64.powf(-(1.0 + (round % 30) as f64));
            let x: Vec<u16> = (0..1024)
                .map(|i| {
                    let u = lcg(&mut seed);
                    let v = 0.9 * 2f64.powi(-((i / GROUP + round) as i32 % 60)) * span.powf(u);
                    bf16::from_f32(if lcg(&mut seed) < 0.5 { -v } else { v } as f32)
                })
                .collect();
            let y = round_trip(&x);
            for (g, xg) in x.chunks_exact(GROUP).enumerate() {
                let d = deepep_ideal_group(xg);
                for (i, &b) in xg.iter().enumerate() {
                    let v = bf16::to_f32(b) as f64;
                    let (eo, et) = ((y[g * GROUP + i] as f64 - v).abs() / v.abs(), (d[i] - v).abs() / v.abs());
                    ours = (ours.0.max(eo), ours.1 + eo);
                    theirs = (theirs.0.max(et), theirs.1 + et);
                    n += 1;
                }
            }
        }
        let (mo, mt) = (ours.1 / n as f64, theirs.1 / n as f64);
        eprintln!(
            "LogFMT relative error over {n} values: ours max {:.3e} mean {mo:.3e}, DeepEP (exact math) max {:.3e} mean {mt:.3e}",
            ours.0, theirs.0
        );
        assert!(ours.0 <= theirs.0 + DECODE_REL_ERROR + 1e-6, "max {} against {}", ours.0, theirs.0);
        assert!(mo <= mt + DECODE_REL_ERROR, "mean {mo} against {mt}");
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
