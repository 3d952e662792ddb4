//! FP8 E4M3 (`float8_e4m3fn`) conversions and DeepEP's per-token, per-128-channel FP8 casts,
//! bit-exact with CUDA.
//!
//! - [`f32_to_e4m3`] is `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` (and the
//!   `cvt.rn.satfinite.e4m3x2.f32` instruction DeepEP's LL kernel uses): round to nearest
//!   even, finite overflow and ±inf saturate to ±448, NaN → `0x7f`.
//! - [`ll_scales`] is DeepEP's `calculate_fp8_scales` (`csrc/kernels/utils.cuh`). Note that
//!   DeepEP computes `scale_inv = amax * (1/448)` with the f32 constant `1/448` (not an IEEE
//!   division `amax / 448`; the two differ in the last bit for some `amax`), and
//!   `scale = 448 / amax` with an IEEE division.
//! - [`per_token_cast_to_fp8`] is the normal-mode test helper of DeepEP's `tests/utils.py`
//!   (`scale = amax / 448`, a true division there).

use super::bf16;

/// Largest finite E4M3 magnitude.
pub const FP8_MAX: f32 = 448.0;
/// DeepEP's `kFP8Margin`: the per-group amax is clamped to at least this.
pub const FP8_MARGIN: f32 = 1e-4;
/// DeepEP's `kFinfoAmaxInvE4M3 = 1 / 448.0f` (f32 `0x3b124925`).
pub const FP8_MAX_INV: f32 = 1.0 / 448.0;
/// Channels per scale group.
pub const GROUP: usize = 128;
/// The E4M3 NaN byte (`0x7f`; `0xff` is NaN too).
pub const E4M3_NAN: u8 = 0x7f;

/// f32 → E4M3 byte: round to nearest even, saturating (`__NV_SATFINITE`), NaN → `0x7f`.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return E4M3_NAN;
    }
    let a = f32::from_bits(abs);
    // 464 is the midpoint between 448 (0x7e) and the next step (480, which is NaN's code):
    // ties go to the even 0x7e, everything above saturates to it.
    if a >= 464.0 {
        return sign | 0x7e;
    }
    if a < 0.015625 {
        // Subnormal range (< 2^-6): multiples of 2^-9; the scaling by 512 is exact, and a
        // round-up to 8 yields 0x08 = 2^-6, the smallest normal, as it should.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let exp = (abs >> 23) as i32 - 127 + 7; // E4M3 biased exponent, 1..=8 here
    let mant = abs & 0x7f_ffff;
    let mut res = ((exp as u32) << 3) | (mant >> 20);
    let rem = mant & 0xf_ffff;
    if rem > 0x8_0000 || (rem == 0x8_0000 && res & 1 == 1) {
        res += 1; // a mantissa carry moves into the exponent, which is the right result
    }
    sign | res as u8
}

/// E4M3 byte → f32 (exact). `0x7f` / `0xff` → NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let neg = b & 0x80 != 0;
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    let v = if e == 0xf && b & 7 == 7 {
        f32::NAN
    } else if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (8.0 + m) * f32::from_bits(((e - 10 + 127) as u32) << 23)
    };
    if neg {
        -v
    } else {
        v
    }
}

/// `max(FP8_MARGIN, max_i |x_i|)` over bf16 values, in f32 (DeepEP's `fmaxf` chain; NaN
/// inputs are skipped as `fmaxf` does).
pub fn group_amax(x: &[u16]) -> f32 {
    x.iter().fold(FP8_MARGIN, |m, &b| m.max(bf16::to_f32(b).abs()))
}

/// DeepEP's `calculate_fp8_scales(amax)` → `(scale, scale_inv)`: values are sent as
/// `e4m3(x * scale)` and mean `e4m3 * scale_inv`.
/// - `round_scale = false`: `scale = 448 / amax`, `scale_inv = amax * FP8_MAX_INV`.
/// - `round_scale = true`: `scale_inv = 2^ceil(log2(amax * FP8_MAX_INV))`, where the ceiling is
///   taken from the f32 bits (exponent, +1 if any mantissa bit is set), `scale = 1/scale_inv`.
pub fn ll_scales(amax: f32, round_scale: bool) -> (f32, f32) {
    if round_scale {
        let e = log2_ceil(amax * FP8_MAX_INV);
        (pow2(-e), pow2(e))
    } else {
        (FP8_MAX / amax, amax * FP8_MAX_INV)
    }
}

/// DeepEP's `fast_log2_ceil`: `exponent(x) + (mantissa(x) != 0)` from the bits of a positive
/// normal f32.
pub fn log2_ceil(x: f32) -> i32 {
    let bits = x.to_bits();
    ((bits >> 23) & 0xff) as i32 - 127 + ((bits & 0x7f_ffff) != 0) as i32
}

/// `2^e` for `-126 <= e <= 127`, built from the exponent bits (DeepEP's `fast_pow2`).
pub fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e), "pow2({e}) out of the normal range");
    f32::from_bits(((e + 127) as u32) << 23)
}

/// UE8M0 byte of a (power-of-two) scale: its f32 exponent field, `bits >> 23`.
pub fn ue8m0(scale_inv: f32) -> u8 {
    (scale_inv.to_bits() >> 23) as u8
}

/// The power of two a UE8M0 byte stands for: `2^(b - 127)` (`per_token_cast_back`'s `<< 23`).
pub fn ue8m0_to_f32(b: u8) -> f32 {
    f32::from_bits((b as u32) << 23)
}

/// Packs four UE8M0 bytes little-endian into one int32: byte `j` ↔ group `4p + j` of pack `p`.
pub fn pack_ue8m0(bytes: [u8; 4]) -> i32 {
    i32::from_le_bytes(bytes)
}

/// DeepEP's LL dispatch cast of one token: `x` is `[H]` bf16 bits (`H % 128 == 0`); writes
/// `out [H]` E4M3 bytes and `scale_inv [H/128]` f32. Per 128-channel group `g`:
/// `amax = group_amax(x[g])`, `(scale, scale_inv) = ll_scales(amax, round_scale)`,
/// `out[i] = f32_to_e4m3(f32(x[i]) * scale)` (one f32 multiply, then the conversion).
pub fn ll_cast_token(x: &[u16], round_scale: bool, out: &mut [u8], scale_inv: &mut [f32]) {
    assert!(x.len() % GROUP == 0 && out.len() == x.len() && scale_inv.len() == x.len() / GROUP);
    for ((xg, og), si) in x.chunks_exact(GROUP).zip(out.chunks_exact_mut(GROUP)).zip(scale_inv.iter_mut()) {
        let (scale, inv) = ll_scales(group_amax(xg), round_scale);
        *si = inv;
        for (o, &b) in og.iter_mut().zip(xg) {
            *o = f32_to_e4m3(bf16::to_f32(b) * scale);
        }
    }
}

/// Dequantised value of one E4M3 byte under its group's scale: `f32(e4m3) * scale_inv` (the
/// f32 multiply of DeepEP's `per_token_cast_back`).
pub fn dequant(b: u8, scale_inv: f32) -> f32 {
    e4m3_to_f32(b) * scale_inv
}

/// Normal-mode test helper `per_token_cast_to_fp8` (DeepEP `tests/utils.py`) for one token:
/// `amax = max(1e-4, max|x|)` per 128 channels, `out = e4m3(x * (448 / amax))`,
/// `scale[g] = amax / 448` (IEEE division). torch's cast does not saturate, but the scaled
/// values never exceed 448 by more than rounding, so [`f32_to_e4m3`] gives the same bytes.
pub fn per_token_cast_to_fp8(x: &[u16], out: &mut [u8], scale: &mut [f32]) {
    assert!(x.len() % GROUP == 0 && out.len() == x.len() && scale.len() == x.len() / GROUP);
    for ((xg, og), s) in x.chunks_exact(GROUP).zip(out.chunks_exact_mut(GROUP)).zip(scale.iter_mut()) {
        let amax = group_amax(xg);
        let mul = FP8_MAX / amax;
        *s = amax / FP8_MAX;
        for (o, &b) in og.iter_mut().zip(xg) {
            *o = f32_to_e4m3(bf16::to_f32(b) * mul);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest finite E4M3 value by exhaustive search, ties to the even code: the definition
    /// of RNE with saturation to the finite range.
    fn brute(x: f32) -> u8 {
        if x.is_nan() {
            return E4M3_NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let mut best = 0u8;
        for c in 1..=0x7eu8 {
            let (d, db) = ((e4m3_to_f32(c) as f64 - a as f64).abs(), (e4m3_to_f32(best) as f64 - a as f64).abs());
            if d < db || (d == db && c & 1 == 0) {
                best = c;
            }
        }
        sign | best
    }

    #[test]
    fn hand_checked_values() {
        assert_eq!(f32_to_e4m3(0.0), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(448.0), 0x7e);
        assert_eq!(f32_to_e4m3(-448.0), 0xfe);
        assert_eq!(f32_to_e4m3(449.0), 0x7e);
        assert_eq!(f32_to_e4m3(464.0), 0x7e); // tie between 448 and 480: even code
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3(1.0), 0x38);
        assert_eq!(f32_to_e4m3(1.0625), 0x38); // halfway 1 → 1.125: even (1.0)
        assert_eq!(f32_to_e4m3(1.1875), 0x3a); // halfway 1.125 → 1.25: even (1.25)
        assert_eq!(f32_to_e4m3(2.0f32.powi(-9)), 0x01); // smallest subnormal
        assert_eq!(f32_to_e4m3(2.0f32.powi(-10)), 0x00); // tie with 0: even (0)
        assert_eq!(f32_to_e4m3(1.5 * 2.0f32.powi(-10)), 0x01);
        assert_eq!(f32_to_e4m3(3.0 * 2.0f32.powi(-10)), 0x02); // tie 1 → 2 subnormal steps: even
        assert_eq!(f32_to_e4m3(15.5 * 2.0f32.powi(-10)), 0x08); // rounds up into 2^-6
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2.0f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2.0f32.powi(-6));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
    }

    #[test]
    fn every_code_round_trips_and_every_bf16_matches_brute_force() {
        for c in 0..=255u8 {
            if c & 0x7f != 0x7f {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(c)), c, "code {c:#x}");
            }
        }
        for b in 0..=u16::MAX {
            let x = bf16::to_f32(b);
            if !x.is_nan() {
                assert_eq!(f32_to_e4m3(x), brute(x), "bf16 {b:#x} = {x}");
            }
        }
        // Midpoints and their f32 neighbours, where rounding decisions happen.
        for c in 0..0x7eu8 {
            let mid = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0;
            for x in [mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().saturating_sub(1))] {
                assert_eq!(f32_to_e4m3(x), brute(x), "near midpoint {x}");
                assert_eq!(f32_to_e4m3(-x), brute(-x), "near midpoint {}", -x);
            }
        }
    }

    #[test]
    fn ll_scales_follow_deepep() {
        // amax = 448 → scale 1, scale_inv = 448 * fl(1/448), which is not exactly 1.
        let (s, si) = ll_scales(448.0, false);
        assert_eq!(s, 1.0);
        assert_eq!(si, 448.0 * FP8_MAX_INV);
        assert_eq!(FP8_MAX_INV.to_bits(), 0x3b12_4925);
        // round_scale: amax 448 → 2^0; amax 449 → 2^1; amax 1e-4 (margin) → 2^-22.
        assert_eq!(ll_scales(448.0, true), (1.0, 1.0));
        assert_eq!(ll_scales(449.0, true), (0.5, 2.0));
        assert_eq!(ll_scales(FP8_MARGIN, true).1, 2.0f32.powi(-22));
        assert_eq!(ue8m0(2.0f32.powi(-22)), 127 - 22);
        assert_eq!(ue8m0_to_f32(127 - 22), 2.0f32.powi(-22));
        assert_eq!(pack_ue8m0([1, 2, 3, 4]), 0x0403_0201);
        assert_eq!(log2_ceil(1.0), 0);
        assert_eq!(log2_ceil(1.5), 1);
        assert_eq!(log2_ceil(0.25), -2);
    }

    #[test]
    fn token_cast_uses_per_group_amax_and_margin() {
        let mut x = vec![0u16; 256];
        x[3] = bf16::from_f32(-2.0);
        x[7] = bf16::from_f32(1.0);
        // group 1 stays all-zero: amax = margin, all bytes 0.
        let (mut out, mut si) = (vec![0u8; 256], vec![0f32; 2]);
        ll_cast_token(&x, false, &mut out, &mut si);
        assert_eq!(out[3], 0xfe); // -2 * 448/2 = -448
        assert_eq!(out[7], f32_to_e4m3(224.0));
        assert_eq!(si, vec![2.0 * FP8_MAX_INV, FP8_MARGIN * FP8_MAX_INV]);
        assert!(out[128..].iter().all(|&b| b == 0));
        ll_cast_token(&x, true, &mut out, &mut si);
        assert_eq!(si[0], 2.0f32.powi(-7)); // 2/448 = 2^-7.8 → 2^-7
        assert_eq!(out[3], f32_to_e4m3(-256.0));
        assert_eq!(dequant(out[3], si[0]), -2.0);
        let mut sc = vec![0f32; 2];
        per_token_cast_to_fp8(&x, &mut out, &mut sc);
        assert_eq!(sc[0], 2.0 / 448.0);
        assert_eq!(out[3], 0xfe);
    }
}
