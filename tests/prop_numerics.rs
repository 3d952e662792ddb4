//! Property tests of the numeric conversions (`deep_ep::numerics`) against slow references:
//! bf16 round-to-nearest-even, FP8 E4M3 monotonicity, saturation and nearest-value rounding,
//! and the error bound of DeepEP's per-128-channel LL cast.

use deep_ep::numerics::{bf16, fp8};
use proptest::prelude::*;

/// Slow bf16 RNE: the two bf16 neighbours of `x` (truncation and one ulp further from zero),
/// compared in f64; ties go to the even code; beyond the largest finite value the next
/// neighbour is infinity, whose rounding position is 2^128 (IEEE overflow rule).
fn bf16_slow(x: f32) -> u16 {
    let lo = (x.to_bits() >> 16) as u16;
    let hi = lo + 1; // one step away from zero in magnitude (same sign bit)
    let val = |b: u16| -> f64 {
        if b & 0x7fff == 0x7f80 {
            (if b & 0x8000 != 0 { -1.0 } else { 1.0 }) * 2f64.powi(128)
        } else {
            bf16::to_f32(b) as f64
        }
    };
    let (dl, dh) = ((x as f64 - val(lo)).abs(), (val(hi) - x as f64).abs());
    if dl < dh || (dl == dh && lo & 1 == 0) {
        lo
    } else {
        hi
    }
}

/// Nearest finite E4M3 code by exhaustive search (ties to the even code), saturating.
fn e4m3_slow(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    let mut best = 0u8;
    for c in 1..=0x7eu8 {
        let (d, db) = ((fp8::e4m3_to_f32(c) as f64 - a).abs(), (fp8::e4m3_to_f32(best) as f64 - a).abs());
        if d < db || (d == db && c & 1 == 0) {
            best = c;
        }
    }
    sign | best
}

/// Finite f32s spread over every exponent (bit patterns), plus ordinary magnitudes.
fn finite_f32() -> impl Strategy<Value = f32> {
    prop_oneof![any::<u32>().prop_map(f32::from_bits).prop_filter("finite", |x| x.is_finite()), -600.0f32..600.0, -1.0f32..1.0,]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn bf16_rounds_to_nearest_even(x in finite_f32()) {
        prop_assert_eq!(bf16::from_f32(x), bf16_slow(x), "x = {} ({:#x})", x, x.to_bits());
    }

    #[test]
    fn bf16_values_round_trip(b in any::<u16>()) {
        let x = bf16::to_f32(b);
        if x.is_nan() {
            prop_assert!(bf16::to_f32(bf16::from_f32(x)).is_nan());
        } else {
            prop_assert_eq!(bf16::from_f32(x), b);
        }
    }

    #[test]
    fn e4m3_is_monotonic(a in finite_f32(), b in finite_f32()) {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        let (ql, qh) = (fp8::e4m3_to_f32(fp8::f32_to_e4m3(lo)), fp8::e4m3_to_f32(fp8::f32_to_e4m3(hi)));
        prop_assert!(ql <= qh, "{} <= {} but e4m3 gives {} > {}", lo, hi, ql, qh);
    }

    #[test]
    fn e4m3_saturates_and_rounds_to_nearest(x in finite_f32()) {
        let q = fp8::f32_to_e4m3(x);
        prop_assert!(q & 0x7f != 0x7f, "finite input {} became NaN", x);
        let v = fp8::e4m3_to_f32(q);
        prop_assert!(v.abs() <= fp8::FP8_MAX);
        if x.abs() >= fp8::FP8_MAX {
            prop_assert_eq!(v, fp8::FP8_MAX.copysign(x));
        }
        prop_assert_eq!(q, e4m3_slow(x), "x = {}", x);
    }

    #[test]
    fn ll_cast_error_is_bounded_by_e4m3_precision(
        // |x| < 2^100: with round_scale, a group amax near f32::MAX gets scale_inv 2^120 and
        // 448 · 2^120 overflows f32 on dequantisation (as on the GPU): not a rounding question.
        row in prop::collection::vec((any::<bool>(), 0u16..=226, 0u16..128).prop_map(|(s, e, m)| (s as u16) << 15 | e << 7 | m), 256),
        round_scale in any::<bool>(),
    ) {
        let (mut q, mut si) = (vec![0u8; 256], vec![0f32; 2]);
        fp8::ll_cast_token(&row, round_scale, &mut q, &mut si);
        for (g, chunk) in row.chunks(128).enumerate() {
            let amax = fp8::group_amax(chunk);
            prop_assert!(si[g] > 0.0 && si[g].is_finite());
            for (i, &b) in chunk.iter().enumerate() {
                let x = bf16::to_f32(b);
                let d = fp8::dequant(q[g * 128 + i], si[g]);
                // 3 mantissa bits: relative error 2^-4 for normals, absolute 2^-10 · scale_inv
                // in the subnormal range; a little slack for the f32 scale products.
                let bound = x.abs() / 16.0 + si[g] / 1024.0 + amax * 1e-6;
                prop_assert!((d - x).abs() <= bound * 1.001, "group {} x {} -> {} (scale_inv {})", g, x, d, si[g]);
            }
        }
    }
}

#[test]
fn non_finite_inputs() {
    assert_eq!(fp8::f32_to_e4m3(f32::INFINITY), 0x7e);
    assert_eq!(fp8::f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
    assert!(fp8::e4m3_to_f32(fp8::f32_to_e4m3(f32::NAN)).is_nan());
    assert_eq!(bf16::to_f32(bf16::from_f32(f32::INFINITY)), f32::INFINITY);
    assert_eq!(bf16::to_f32(bf16::from_f32(f32::NEG_INFINITY)), f32::NEG_INFINITY);
    assert!(bf16::to_f32(bf16::from_f32(f32::NAN)).is_nan());
    // f32::MAX is beyond bf16's largest finite value plus half an ulp: rounds to infinity
    assert_eq!(bf16::to_f32(bf16::from_f32(f32::MAX)), f32::INFINITY);
}
