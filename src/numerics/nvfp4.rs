//! NVFP4 (E2M1 values, one E4M3 scale per 16 values, a global f32 scale) as the low-latency
//! dispatch's `use_nvfp4=True` format (docs/NVFP4.md), bit-exact between the backends.
//!
//! Per block of 16 consecutive bf16 values `x` of a token, with `S` = `x_global_scale`:
//! - `amax = max |x_i|` (NaN skipped, as `fmaxf`);
//! - the block scale byte `sf = e4m3(S * (amax / 6))` (IEEE f32 division and product, then
//!   [`fp8::f32_to_e4m3`]: round to nearest even, saturating at 448);
//! - `out = S / f32(sf)` (IEEE division; 0 when `sf` decodes to 0);
//! - each value `q_i = e2m1(x_i * out)` ([`f32_to_e2m1`]: round to nearest even, saturating at
//!   ±6, sign kept, NaN → +0).
//!
//! DeepEP's forks compute `out` with approximate reciprocals (`rcp.approx.ftz`) and round with
//! Blackwell's `cvt.rn.satfinite.e2m1x2.f32`; this library uses IEEE divisions so that the CPU
//! backend and any GPU give the same bytes. The two can differ by one E2M1 step where
//! `x_i * out` lies within an ulp of a rounding boundary. The receiver recovers
//! `x ≈ e2m1(q) * f32(sf) / S`.
//!
//! Bytes: value `2k` in the low nibble of byte `k`, value `2k + 1` in the high nibble (as
//! `torch.float4_e2m1fn_x2`). Scales in the 128x4 swizzle of [`scale_offset`].

use super::{bf16, fp8};

/// Values per scale block.
pub const BLOCK: usize = 16;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// f32 → E2M1 code (4 bits: sign in bit 3): round to nearest even over
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6; NaN → 0.
pub fn f32_to_e2m1(v: f32) -> u8 {
    if v.is_nan() {
        return 0;
    }
    let a = v.abs();
    // Midpoints between neighbours; a tie goes to the even code (0, 1.0, 2.0, 4.0).
    let mag = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    mag | if v.is_sign_negative() { 8 } else { 0 }
}

/// E2M1 code → f32 (exact).
pub fn e2m1_to_f32(c: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[(c & 7) as usize];
    if c & 8 != 0 {
        -m
    } else {
        m
    }
}

/// One block: 16 bf16 values → (scale byte, 8 packed bytes).
pub fn cast_block(x: &[u16], global_scale: f32) -> (u8, [u8; BLOCK / 2]) {
    let amax = x.iter().fold(0.0f32, |m, &b| m.max(bf16::to_f32(b).abs()));
    let sf = fp8::f32_to_e4m3(global_scale * (amax / E2M1_MAX));
    let sfv = fp8::e4m3_to_f32(sf);
    let out = if sfv != 0.0 { global_scale / sfv } else { 0.0 };
    let mut packed = [0u8; BLOCK / 2];
    for (k, p) in packed.iter_mut().enumerate() {
        let lo = f32_to_e2m1(bf16::to_f32(x[2 * k]) * out);
        let hi = f32_to_e2m1(bf16::to_f32(x[2 * k + 1]) * out);
        *p = lo | hi << 4;
    }
    (sf, packed)
}

/// One token of `H` bf16 values (`H % 16 == 0`) → `H / 2` packed bytes and `H / 16` scale
/// bytes in hidden order (the wire format).
pub fn cast_token(x: &[u16], global_scale: f32, packed: &mut [u8], scales: &mut [u8]) {
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let (sf, p) = cast_block(xb, global_scale);
        scales[b] = sf;
        packed[b * BLOCK / 2..(b + 1) * BLOCK / 2].copy_from_slice(&p);
    }
}

/// Scale tiles of the swizzled layout: `(rm, rk)` = (128-row tiles, 4-column tiles) for `rows`
/// received rows of an expert and `hidden` values per row.
pub fn scale_tiles(rows: usize, hidden: usize) -> (usize, usize) {
    (rows.div_ceil(128), (hidden / BLOCK).div_ceil(4))
}

/// Byte offset of the scale of row `t`, column `j` (= hidden index / 16) inside one expert's
/// swizzled scales (physical `[rm, rk, 32, 4, 4]`, DeepEP's and cutlass's 128x4 layout).
pub fn scale_offset(t: usize, j: usize, rk: usize) -> usize {
    (t / 128) * rk * 512 + (j / 4) * 512 + (t % 32) * 16 + ((t % 128) / 32) * 4 + j % 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.0, 0),
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (0.74, 1),
            (1.25, 2),
            (1.26, 3),
            (1.75, 4),
            (2.5, 4),
            (2.6, 5),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (1e30, 7),
            (f32::INFINITY, 7),
            (-0.0, 8),
            (-0.1, 8),
            (-3.0, 13),
            (-7.0, 15),
        ];
        for (v, c) in cases {
            assert_eq!(f32_to_e2m1(v), c, "{v}");
        }
        assert_eq!(f32_to_e2m1(f32::NAN), 0);
        for c in 0..16u8 {
            if c != 8 {
                assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c, "code {c} round trip");
            }
        }
    }

    #[test]
    fn block_scale_and_nibble_order() {
        // amax 6 with S = 1: scale e4m3(1.0) = 0x38, out = 1; values land on their own codes.
        let vals = [6.0f32, -0.5, 1.0, 0.0, 3.0, -6.0, 2.0, 1.5, 0.5, 4.0, -1.0, -2.0, -3.0, -4.0, -1.5, 0.0];
        let x: Vec<u16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        let (sf, p) = cast_block(&x, 1.0);
        assert_eq!(sf, fp8::f32_to_e4m3(1.0));
        for (i, &v) in vals.iter().enumerate() {
            let nib = (p[i / 2] >> (4 * (i % 2))) & 15;
            assert_eq!(e2m1_to_f32(nib), v, "value {i}");
        }
        // An all-zero block: scale 0 and zero codes.
        assert_eq!(cast_block(&[0u16; 16], 3.0), (0, [0; 8]));
    }

    #[test]
    fn dequantised_block_is_close() {
        let x: Vec<u16> = (0..16).map(|i| bf16::from_f32((i as f32 - 7.3) * 0.37)).collect();
        let amax = x.iter().fold(0.0f32, |m, &b| m.max(bf16::to_f32(b).abs()));
        let s = 448.0 * 6.0 / amax;
        let (sf, p) = cast_block(&x, s);
        let scale = fp8::e4m3_to_f32(sf) / s;
        for i in 0..16 {
            let q = e2m1_to_f32((p[i / 2] >> (4 * (i % 2))) & 15) * scale;
            let v = bf16::to_f32(x[i]);
            // half the widest E2M1 gap (4 -> 6) of a block scaled to 6, plus the scale's E4M3 rounding
            assert!((q - v).abs() <= amax / 6.0 + amax / 16.0, "{i}: {q} vs {v}");
        }
    }

    #[test]
    fn swizzle_matches_the_reference_unswizzle() {
        // DeepEP's test inverts the layout with reshape(rm, rk, 32, 4, 4).permute(0, 3, 2, 1, 4)
        // .reshape(rm * 128, rk * 4) (its `recover_swizzled_scales` without the expert dim): the
        // element at (t, j) of that matrix is at physical (t/128, j/4, t%32, (t%128)/32, j%4).
        let (rm, rk) = scale_tiles(300, 7168);
        assert_eq!((rm, rk), (3, 112));
        let mut seen = vec![false; rm * rk * 512];
        for t in 0..rm * 128 {
            for j in 0..rk * 4 {
                let phys = (((t / 128 * rk + j / 4) * 32 + t % 32) * 4 + (t % 128) / 32) * 4 + j % 4;
                assert_eq!(scale_offset(t, j, rk), phys);
                assert!(!seen[phys]);
                seen[phys] = true;
            }
        }
    }
}
