//! Bindings to the host entry points of `kernels/logfmt.cu`: LogFMT-10 computed by the functions
//! of `kernels/logfmt.cuh`, the code the low-latency combine kernels run on the device. They need
//! no GPU; the tests below compare them with [`crate::numerics::logfmt`] (the specification), bit
//! for bit, which is how the crate knows that the kernels' LogFMT matches the CPU backend's.

use crate::numerics::logfmt::slot_bytes;
use crate::sys::kernels::*;
use std::ffi::c_int;

/// Largest row the host entry points take (channels).
pub const MAX_HIDDEN: usize = 131_072;

fn check_hidden(h: usize) {
    assert!(h >= 128 && h % 128 == 0 && h <= MAX_HIDDEN, "logfmt host: hidden must be a multiple of 128 in [128, {MAX_HIDDEN}], got {h}");
}

/// Encodes one row `x [H]` (bf16 bits) with the kernels' code into the crate's slot layout
/// (`slot_bytes(H)` bytes, unused bytes zero), like [`crate::numerics::logfmt::encode`]. Host only.
/// Panics when `H` is not a multiple of 128 in `[128, MAX_HIDDEN]`.
pub fn encode_row(x: &[u16]) -> Vec<u8> {
    check_hidden(x.len());
    let mut slot = vec![0u8; slot_bytes(x.len())];
    // SAFETY: `x` holds H values and `slot` slot_bytes(H) bytes, what the function reads / writes.
    let rc = unsafe { dek_logfmt_encode_row_host(x.as_ptr(), x.len() as c_int, slot.as_mut_ptr()) };
    assert_eq!(rc, 0, "dek_logfmt_encode_row_host refused hidden {}", x.len());
    slot
}

/// `acc[i] = fma(decoded_i, weight, acc[i])` over a slot (`acc [H]`) with the kernels' code, like
/// [`crate::numerics::logfmt::decode_accumulate`]. Host only. Panics on a bad `H` or a short slot.
pub fn decode_accumulate(slot: &[u8], weight: f32, acc: &mut [f32]) {
    check_hidden(acc.len());
    assert!(slot.len() >= slot_bytes(acc.len()), "logfmt host: slot of {} bytes for hidden {}", slot.len(), acc.len());
    // SAFETY: `slot` holds slot_bytes(H) bytes and `acc` H floats, what the function reads / writes.
    let rc = unsafe { dek_logfmt_decode_accumulate_host(slot.as_ptr(), acc.len() as c_int, weight, acc.as_mut_ptr()) };
    assert_eq!(rc, 0, "dek_logfmt_decode_accumulate_host refused hidden {}", acc.len());
}

/// `acc[i] = fma(value_i, weight, acc[i])` over the row `x [H]` encoded and decoded in place, as
/// the one-rank LogFMT combine kernel (`combine_local_logfmt`) computes it, with the kernels' code:
/// the values of [`encode_row`] then [`decode_accumulate`]. Host only. Panics on a bad `H` or
/// `acc` of another length.
pub fn roundtrip_accumulate(x: &[u16], weight: f32, acc: &mut [f32]) {
    check_hidden(x.len());
    assert_eq!(x.len(), acc.len(), "logfmt host: a row of {} channels into {} sums", x.len(), acc.len());
    // SAFETY: `x` and `acc` hold H values each, what the function reads / writes.
    let rc = unsafe { dek_logfmt_roundtrip_accumulate_host(x.as_ptr(), x.len() as c_int, weight, acc.as_mut_ptr()) };
    assert_eq!(rc, 0, "dek_logfmt_roundtrip_accumulate_host refused hidden {}", x.len());
}

fn math(func: c_int, x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    // SAFETY: `x` and `out` hold n floats each.
    let rc = unsafe { dek_logfmt_math_host(func, x.as_ptr(), out.as_mut_ptr(), x.len() as i64) };
    assert_eq!(rc, 0);
    out
}

/// The kernels' `log2_det` of every value (host).
pub fn log2_det(x: &[f32]) -> Vec<f32> {
    math(0, x)
}

/// The decoder's `pow2_q` (host) of every fixed-point log2 `y` (units of 2^-23).
pub fn pow2_q(y: &[i32]) -> Vec<f32> {
    let x: Vec<f32> = y.iter().map(|&v| f32::from_bits(v as u32)).collect();
    math(1, &x)
}

/// The send's table `log2_bf16` (host; the group parameters' log2) of the bf16 magnitude in each value's upper 16 bits
/// (`log2_det(|x|)` for a bf16-representable `x`).
pub fn log2_bf16_table(x: &[f32]) -> Vec<f32> {
    math(2, x)
}

/// The send's `log2_bf16_finite` (host): as [`log2_bf16_table`], for finite bf16
/// magnitudes only (the cast encoder's values are all below 1).
pub fn log2_bf16_finite(x: &[f32]) -> Vec<f32> {
    math(3, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::{bf16, logfmt};

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Same bits, or both NaN.
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn host_log2_matches_the_crate_on_every_bf16_and_random_f32() {
        let mut xs: Vec<f32> = (0..=u16::MAX).map(bf16::to_f32).collect();
        let mut seed = 1;
        xs.extend((0..400_000).map(|_| f32::from_bits((lcg(&mut seed) * u32::MAX as f64) as u32)));
        xs.extend((0..200_000).map(|_| (lcg(&mut seed) * 320.0 - 170.0) as f32));
        xs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, 1e-45, 127.5, 128.0, -152.0, -152.5, -126.5]);
        for (&x, &k) in xs.iter().zip(&log2_det(&xs)) {
            let want = logfmt::log2_det(x);
            assert!(same(k, want), "log2_det({x:e} = {:#x}): kernels {k} crate {want}", x.to_bits());
        }
    }

    #[test]
    fn table_log2_is_log2_det_on_every_bf16() {
        let xs: Vec<f32> = (0..=u16::MAX).map(bf16::to_f32).collect();
        for (&x, &k) in xs.iter().zip(&log2_bf16_table(&xs)) {
            let want = logfmt::log2_det(x.abs());
            assert!(same(k, want), "log2 table({x:e} = {:#x}): kernels {k} crate {want}", x.to_bits());
        }
    }

    #[test]
    fn finite_log2_is_the_table_log2_on_every_finite_bf16() {
        // Every finite bf16 (magnitude bits below 0x7f80), both signs, zeros and subnormals included.
        let xs: Vec<f32> = (0..=u16::MAX).filter(|b| b & 0x7fff < 0x7f80).map(bf16::to_f32).collect();
        assert_eq!(xs.len(), 2 * 0x7f80);
        for ((&x, &u), &t) in xs.iter().zip(&log2_bf16_finite(&xs)).zip(&log2_bf16_table(&xs)) {
            assert!(same(u, t), "log2 finite({x:e} = {:#x}): {u}, table {t}", x.to_bits());
        }
    }

    #[test]
    fn host_encode_matches_the_crate_on_every_magnitude_of_cast_groups() {
        // Groups of 127 consecutive bf16 magnitudes plus a fixed amax (0.9, 2^-40, 2^-90) and, for
        // half of them, a zero (amin clipped): every magnitude below each amax is encoded once.
        for amax in [bf16::from_f32(0.9), bf16::from_f32(2f32.powi(-40)), bf16::from_f32(2f32.powi(-90))] {
            let mut x = Vec::new();
            for (i, lo) in (1..amax).step_by(127).enumerate() {
                let mut g: Vec<u16> = (lo..lo + 127).map(|b| b.min(amax)).collect();
                g.push(amax);
                if i % 2 == 0 {
                    g[5] = 0;
                }
                g.iter_mut().step_by(3).for_each(|b| *b |= 0x8000);
                x.extend(g);
            }
            x.resize(x.len().div_ceil(1024) * 1024, 0);
            for (c, chunk) in x.chunks(7168).enumerate() {
                assert_host_encode_is_crate(chunk, &format!("amax {amax:#x} chunk {c}"));
            }
        }
    }

    #[test]
    fn host_encode_matches_the_crate_on_extreme_cast_groups() {
        // Zeros beside every bf16 magnitude below 1 as the amax: the widest cast groups (amin 0,
        // log_amin = log_amax - 32), down to the smallest subnormal amax (such groups travel raw
        // from log_amin < -125).
        let mut x = Vec::new();
        for amax in 1u16..0x3f80 {
            let mut g = [0u16; 128];
            g[amax as usize % 128] = amax;
            g[(amax as usize + 64) % 128] = amax | 0x8000;
            g[(amax as usize + 7) % 128] = amax / 2;
            x.extend_from_slice(&g);
        }
        for (c, chunk) in x.chunks(7168).enumerate() {
            assert_host_encode_is_crate(chunk, &format!("chunk {c}"));
        }
    }

    #[test]
    fn host_pow2_q_matches_the_crate_over_a_cast_groups_range() {
        // Every 997th y from -125 · 2^23 (the least a cast group's code reaches) to 2^23, the ends.
        let mut ys: Vec<i32> = (-125i32 << 23..1 << 23).step_by(997).collect();
        ys.extend([-125 << 23, (-125 << 23) + 1, -1, 0, 1, (1 << 23) - 1, 1 << 23]);
        for (&y, &k) in ys.iter().zip(&pow2_q(&ys)) {
            assert!(same(k, logfmt::pow2_q(y)), "pow2_q({y}): kernels {k} crate {}", logfmt::pow2_q(y));
        }
    }

    /// A bf16 row of `h` channels mixing what LogFMT treats differently: per group a random
    /// scale (most below 1, so groups cast; some ≥ 1, so chunks go raw), random signs, zeros,
    /// subnormals, all-equal groups, single-value groups, NaN / inf.
    fn row(h: usize, seed: &mut u64) -> Vec<u16> {
        let mut x = vec![0u16; h];
        for g in 0..h / 128 {
            let kind = lcg(seed);
            let scale = (2f64).powi(-((lcg(seed) * 30.0) as i32)) * if lcg(seed) < 0.08 { 16.0 } else { 0.9 };
            for xi in &mut x[g * 128..(g + 1) * 128] {
                let u = lcg(seed);
                let v = if kind < 0.05 {
                    0.37 * scale // all equal
                } else if kind < 0.08 || u < 0.03 {
                    0.0 // an all-zero group, or a zero in 3% of places
                } else if u < 0.05 {
                    f64::from(f32::from_bits((lcg(seed) * 0x7f_ffff as f64) as u32))
                // subnormal f32 (bf16: subnormal or 0)
                } else if u < 0.06 {
                    scale * 1e-12 // below the 2^-32 clip
                } else {
                    (lcg(seed) * 0.95 + 0.05) * scale
                };
                let b = bf16::from_f32(v as f32);
                *xi = if lcg(seed) < 0.5 { b | 0x8000 } else { b };
            }
        }
        if lcg(seed) < 0.05 {
            let i = (lcg(seed) * h as f64) as usize;
            x[i] = if lcg(seed) < 0.5 { 0x7fc0 } else { 0xff80 };
        }
        x
    }

    /// The host encode of `x` is the crate's, byte for byte (else a panic naming `what` and the byte).
    fn assert_host_encode_is_crate(x: &[u16], what: &str) {
        let mut want = vec![0u8; logfmt::slot_bytes(x.len())];
        logfmt::encode(x, &mut want);
        let got = encode_row(x);
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!("{what}: slot byte {i} differs (kernels {:#x}, crate {:#x})", got[i], want[i]);
        }
    }

    #[test]
    fn host_encode_matches_the_crate_byte_for_byte() {
        let mut seed = 17;
        let (mut cast, mut raw) = (0usize, 0usize);
        for round in 0..600 {
            let h = [128, 256, 512, 640, 1024, 1536, 2048, 2176, 4096, 5120, 7168][round % 11];
            let x = row(h, &mut seed);
            assert_host_encode_is_crate(&x, &format!("hidden {h} round {round}"));
            let y = logfmt::round_trip(&x);
            cast += y.iter().zip(&x).filter(|(a, &b)| !same(**a, bf16::to_f32(b))).count();
            raw += h;
        }
        // The rows really exercise the cast path (and raw chunks: see the decode test).
        assert!(cast > raw / 10, "only {cast} of {raw} values were quantised");
    }

    /// Sums over several selections in order (as a combine receive makes them) of random rows
    /// (`row`), by the crate's encode and decode and by `kernels(x, slot, weight, acc)` (the
    /// kernels' host code given the row and the crate's slot of it): the same bits, or a panic.
    fn assert_sums_are_crate(mut seed: u64, kernels: impl Fn(&[u16], &[u8], f32, &mut [f32])) {
        for round in 0..300 {
            let h = [128, 512, 640, 1024, 2176, 4096, 7168][round % 7];
            let mut acc_c: Vec<f32> =
                (0..h).map(|_| (lcg(&mut seed) * 2.0 - 1.0) as f32 * if round % 3 == 0 { 0.0 } else { 1.0 }).collect();
            let mut acc_k = acc_c.clone();
            for _ in 0..1 + round % 4 {
                let x = row(h, &mut seed);
                let mut slot = vec![0u8; logfmt::slot_bytes(h)];
                logfmt::encode(&x, &mut slot);
                let w = (lcg(&mut seed) * 4.0 - 2.0) as f32;
                logfmt::decode_accumulate(&slot, w, &mut acc_c);
                kernels(&x, &slot, w, &mut acc_k);
            }
            for i in 0..h {
                assert!(same(acc_k[i], acc_c[i]), "hidden {h} round {round} channel {i}: kernels {} crate {}", acc_k[i], acc_c[i]);
            }
        }
    }

    #[test]
    fn host_decode_accumulate_matches_the_crate_bit_for_bit() {
        assert_sums_are_crate(29, |_, slot, w, acc| decode_accumulate(slot, w, acc));
    }

    #[test]
    fn in_place_round_trip_is_encode_then_decode_bit_for_bit() {
        // The one-rank combine's values (no slot between) against the crate's encode and decode.
        assert_sums_are_crate(41, |x, _, w, acc| roundtrip_accumulate(x, w, acc));
        // Every code of a geometric ramp, and a raw chunk beside cast ones.
        let mut x: Vec<u16> = (0..1536).map(|i| bf16::from_f32((-((i % 1024) as f32) * 32.0 / 1023.0).exp2() * 0.5)).collect();
        x[100] = bf16::from_f32(3.0);
        let mut acc = vec![0f32; 1536];
        roundtrip_accumulate(&x, 1.0, &mut acc);
        assert_eq!(acc, logfmt::round_trip(&x));
    }

    #[test]
    fn host_round_trip_covers_raw_chunks_and_every_code() {
        // Chunk decisions: group 1 >= 1 makes the first 512-channel chunk of a 1536 row raw.
        let mut x: Vec<u16> = (0..1536).map(|i| bf16::from_f32(0.001 + 0.4 * (i % 128) as f32 / 128.0)).collect();
        x[200] = bf16::from_f32(3.0);
        let mut acc = vec![0f32; 1536];
        decode_accumulate(&encode_row(&x), 1.0, &mut acc);
        assert!((0..512).all(|i| acc[i] == bf16::to_f32(x[i])));
        assert!((512..1536).any(|i| acc[i] != bf16::to_f32(x[i])));
        assert_eq!(acc, logfmt::round_trip(&x));
        // A geometric ramp over 2^-32 hits (nearly) every code; all must decode as the crate does.
        let x: Vec<u16> = (0..1024).map(|i| bf16::from_f32((-(i as f32) * 32.0 / 1023.0).exp2() * 0.5)).collect();
        let mut acc = vec![0f32; 1024];
        decode_accumulate(&encode_row(&x), 1.0, &mut acc);
        assert_eq!(acc, logfmt::round_trip(&x));
        let distinct: std::collections::BTreeSet<u32> = acc.iter().map(|v| v.to_bits()).collect();
        assert!(distinct.len() > 400, "{} distinct decoded values", distinct.len());
    }
}
