//! 16-bit floats for mixed-precision collectives: [`F16`] (`ncclFloat16`) and [`Bf16`]
//! (`ncclBfloat16`), the element types of fp16 and bf16 gradients.
//!
//! Both are plain bits (`#[repr(transparent)]` over `u16`, `bytemuck::Pod`), so a buffer of
//! another crate's half type (the `half` crate's `f16` / `bf16`, which are `Pod` with its
//! `bytemuck` feature) is cast to them with `bytemuck::cast_slice` without a copy, and bits come
//! back from the GPU unchanged. [`F16::from_f32`] and [`Bf16::from_f32`] round to nearest,
//! ties to even, as CUDA's `__float2half_rn` and `__float2bfloat16_rn` do; `to_f32` is exact.

/// An IEEE 754 binary16 value, as its bits: NCCL's `ncclFloat16` (CUDA's `__half`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct F16(pub u16);

/// A bfloat16 value (the upper half of an `f32`), as its bits: NCCL's `ncclBfloat16` (CUDA's
/// `__nv_bfloat16`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl F16 {
    /// The value with these bits.
    pub const fn from_bits(bits: u16) -> Self {
        Self(bits)
    }

    /// Its bits.
    pub const fn to_bits(self) -> u16 {
        self.0
    }

    /// The nearest binary16 value to `value` (ties to even; too large is infinity, NaN stays
    /// NaN).
    pub fn from_f32(value: f32) -> Self {
        let x = value.to_bits();
        let sign = ((x >> 16) & 0x8000) as u16;
        let exp = ((x >> 23) & 0xff) as i32;
        let man = x & 0x007f_ffff;
        if exp == 0xff {
            let nan = if man == 0 {
                0
            } else {
                0x0200 | (man >> 13) as u16
            };
            return Self(sign | 0x7c00 | nan);
        }
        let e = exp - 127 + 15;
        if e >= 0x1f {
            return Self(sign | 0x7c00);
        }
        if e <= 0 {
            // A subnormal (or zero): units of 2^-24.
            if e < -10 {
                return Self(sign);
            }
            let shift = (14 - e) as u32;
            let bits = round_shift(man | 0x0080_0000, shift);
            return Self(sign | bits as u16);
        }
        // A carry out of the mantissa moves into the exponent, up to infinity: still right.
        let bits = ((e as u32) << 10) + round_shift(man, 13);
        Self(sign | bits as u16)
    }

    /// The value as an `f32` (exact).
    pub fn to_f32(self) -> f32 {
        let h = self.0;
        let negative = h & 0x8000 != 0;
        let sign = u32::from(h & 0x8000) << 16;
        let exp = u32::from((h >> 10) & 0x1f);
        let man = u32::from(h & 0x03ff);
        match exp {
            0 => {
                // Zero or subnormal: man × 2^-24, exact in an f32.
                let magnitude = man as f32 * f32::from_bits(0x3380_0000);
                if negative { -magnitude } else { magnitude }
            }
            0x1f => f32::from_bits(sign | 0x7f80_0000 | (man << 13)),
            _ => f32::from_bits(sign | ((exp + 112) << 23) | (man << 13)),
        }
    }
}

impl Bf16 {
    /// The value with these bits.
    pub const fn from_bits(bits: u16) -> Self {
        Self(bits)
    }

    /// Its bits.
    pub const fn to_bits(self) -> u16 {
        self.0
    }

    /// The nearest bfloat16 value to `value` (ties to even; NaN stays NaN).
    pub fn from_f32(value: f32) -> Self {
        let x = value.to_bits();
        if value.is_nan() {
            return Self((x >> 16) as u16 | 0x0040);
        }
        Self((x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16)
    }

    /// The value as an `f32` (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// `value >> shift`, rounded to nearest, ties to even (`shift` ≥ 1).
fn round_shift(value: u32, shift: u32) -> u32 {
    let kept = value >> shift;
    let rest = value & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rest > half || (rest == half && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    }
}

impl From<F16> for f32 {
    fn from(value: F16) -> Self {
        value.to_f32()
    }
}

impl From<Bf16> for f32 {
    fn from(value: Bf16) -> Self {
        value.to_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(0.0, 0x0000)]
    #[case(-0.0, 0x8000)]
    #[case(1.0, 0x3c00)]
    #[case(-2.0, 0xc000)]
    #[case(0.5, 0x3800)]
    #[case(65504.0, 0x7bff)]
    #[case(65520.0, 0x7c00)] // halfway to the next power: rounds to infinity
    #[case(1e6, 0x7c00)]
    #[case(f32::INFINITY, 0x7c00)]
    #[case(f32::NEG_INFINITY, 0xfc00)]
    #[case(6.103_515_6e-5, 0x0400)] // smallest normal
    #[case(5.960_464_5e-8, 0x0001)] // smallest subnormal, 2^-24
    #[case(2.980_232_2e-8, 0x0000)] // 2^-25: a tie, to even (zero)
    #[case(4.470_348_4e-8, 0x0001)] // 1.5 × 2^-25 rounds up
    #[case(1.000_488_3, 0x3c00)] // 1 + 2^-11: a tie, to even (down)
    #[case(1.001_464_8, 0x3c02)] // 1 + 3 × 2^-11: a tie, to even (up)
    #[case(0.1, 0x2e66)]
    fn f16_rounds_to_nearest_even(#[case] value: f32, #[case] bits: u16) {
        assert_eq!(F16::from_f32(value).to_bits(), bits, "{value}");
    }

    #[test]
    fn every_f16_survives_a_round_trip_through_f32() {
        for bits in 0..=u16::MAX {
            let value = F16::from_bits(bits);
            let back = F16::from_f32(value.to_f32());
            if value.to_f32().is_nan() {
                assert!(back.to_f32().is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(back, value, "{bits:#06x} via {}", value.to_f32());
            }
        }
    }

    #[test]
    fn every_bf16_survives_a_round_trip_through_f32() {
        for bits in 0..=u16::MAX {
            let value = Bf16::from_bits(bits);
            let back = Bf16::from_f32(value.to_f32());
            if value.to_f32().is_nan() {
                assert!(back.to_f32().is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(back, value, "{bits:#06x}");
            }
        }
    }

    #[rstest]
    #[case(1.0, 0x3f80)]
    #[case(-1.0, 0xbf80)]
    #[case(1.003_906_3, 0x3f80)] // 1 + 2^-8: a tie, to even (down)
    #[case(1.011_718_8, 0x3f82)] // 1 + 3 × 2^-8: a tie, to even (up)
    #[case(f32::MAX, 0x7f80)]
    #[case(f32::INFINITY, 0x7f80)]
    fn bf16_rounds_to_nearest_even(#[case] value: f32, #[case] bits: u16) {
        assert_eq!(Bf16::from_f32(value).to_bits(), bits, "{value}");
    }

    #[test]
    fn nan_stays_nan() {
        assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        // A NaN whose payload sits only in the low bits must not become infinity.
        let low_nan = f32::from_bits(0x7f80_0001);
        assert!(F16::from_f32(low_nan).to_f32().is_nan());
        assert!(Bf16::from_f32(low_nan).to_f32().is_nan());
    }
}
