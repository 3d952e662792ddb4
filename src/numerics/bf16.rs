//! bfloat16 ⇄ float32, as CUDA's `__float2bfloat16` (round to nearest even, NaN kept quiet).

/// bf16 bits → f32 (exact).
#[inline]
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even; NaN stays NaN.
#[inline]
pub fn from_f32(f: f32) -> u16 {
    let bits = f.to_bits();
    if f.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding_bias = 0x7fff + ((bits >> 16) & 1);
    ((bits.wrapping_add(rounding_bias)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_ties_to_even() {
        for v in [0.0f32, 1.0, -2.5, 3.140625, 65280.0] {
            assert_eq!(to_f32(from_f32(v)), v);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(to_f32(from_f32(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(to_f32(from_f32(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        assert_eq!(to_f32(from_f32(f32::INFINITY)), f32::INFINITY);
    }
}
