//! Stochastic rounding of f32 values to a half-precision format: each value becomes one of its
//! two neighbours in the format, the upper one with probability equal to the value's distance
//! from the lower one in units of their spacing, so that the rounded value is the value in
//! expectation. Updates far below a weight's spacing then still move it on average, where
//! rounding to the nearest would drop every one of them.
//!
//! The arithmetic is in f32 and exact: the spacing is a power of two read from the value's
//! exponent bits, so scaling by it, taking the floor and scaling back round nothing, and the
//! result is representable in the format.

/// A half-precision float format, by what rounding to it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfFormat {
    /// bfloat16: f32's exponent, 7 mantissa bits.
    Bf16,
    /// IEEE binary16: 5 exponent bits, 10 mantissa bits (largest finite 65504).
    F16,
}

impl HalfFormat {
    /// Mantissa bits after the leading one: a value in `[2^e, 2^(e+1))` has spacing
    /// `2^(e − mantissa_bits)`.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Self::Bf16 => 7,
            Self::F16 => 10,
        }
    }

    /// The f32 biased exponent below which the spacing stops shrinking. For f16 its smallest
    /// normal exponent (`2^−14`: below it the subnormals keep the spacing `2^−24`). For bf16,
    /// whose normals reach f32's, the exponent at which the spacing would leave f32's normals
    /// (`2^−119`): below it values round on the coarser grid `2^−126`, still without bias.
    pub const fn exponent_floor(self) -> u32 {
        match self {
            Self::Bf16 => 8,
            Self::F16 => 127 - 14,
        }
    }
}

/// `x` rounded to `format`, up when `u` (uniform in `[0, 1)`) falls below `x`'s distance above
/// its lower neighbour in units of their spacing, down otherwise. The result is representable
/// in `format` (beyond f16's range it is a power of two that becomes infinity when cast); a
/// value that is not finite is returned as it is.
pub fn round_stochastically(x: f32, format: HalfFormat, u: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let magnitude = x.abs();
    let exponent = (magnitude.to_bits() >> 23).max(format.exponent_floor());
    let spacing = f32::from_bits((exponent - format.mantissa_bits()) << 23);
    let steps = magnitude / spacing;
    let lower = steps.floor();
    let up = if u < steps - lower { 1.0 } else { 0.0 };
    ((lower + up) * spacing).copysign(x)
}

#[cfg(feature = "cube")]
#[allow(missing_docs)] // `#[cube]` adds an undocumented expansion module beside each function.
pub mod cube {
    //! The rounding on a device.

    use cubecl::prelude::*;

    /// [`super::round_stochastically`], with the format's
    /// [`super::HalfFormat::mantissa_bits`] and [`super::HalfFormat::exponent_floor`].
    #[cube]
    pub fn round_stochastically(x: f32, mantissa_bits: u32, exponent_floor: u32, u: f32) -> f32 {
        let magnitude = f32::abs(x);
        let exponent_bits = u32::reinterpret(magnitude) >> 23;
        let exponent = select(
            exponent_bits > exponent_floor,
            exponent_bits,
            exponent_floor,
        );
        let spacing = f32::reinterpret((exponent - mantissa_bits) << 23);
        let steps = magnitude / spacing;
        let lower = f32::floor(steps);
        let up = select(u < steps - lower, 1.0f32, 0.0f32);
        let rounded = (lower + up) * spacing;
        // Infinity and NaN have every exponent bit set: they stay.
        let finite = exponent_bits < 255;
        select(finite, select(x < 0.0f32, -rounded, rounded), x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two neighbours of `x` (positive) in the format, from the `half` crate: the value its
    /// conversion rounds to, and the one next to it on the far side of `x`.
    fn neighbours(x: f32, format: HalfFormat) -> (f32, f32) {
        let (bits, value): (u16, fn(u16) -> f32) = match format {
            HalfFormat::Bf16 => (half::bf16::from_f32(x).to_bits(), |b| {
                half::bf16::from_bits(b).to_f32()
            }),
            HalfFormat::F16 => (half::f16::from_f32(x).to_bits(), |b| {
                half::f16::from_bits(b).to_f32()
            }),
        };
        match value(bits) <= x {
            true => (value(bits), value(bits + 1)),
            false => (value(bits - 1), value(bits)),
        }
    }

    #[test]
    fn results_are_a_neighbour_and_representable() {
        let mut x = 0.3f32;
        for i in 0..2000u32 {
            x = x * -1.37 + 1e-3 * i as f32;
            for format in [HalfFormat::Bf16, HalfFormat::F16] {
                if format == HalfFormat::F16 && x.abs() > 65504.0 {
                    continue;
                }
                for u in [0.0, 0.25, 0.5, 0.999] {
                    let r = round_stochastically(x, format, u);
                    let (lower, upper) = neighbours(x.abs(), format);
                    assert!(
                        r.abs() == lower || r.abs() == upper,
                        "{x} → {r} ({format:?}, u {u}), neighbours {lower}, {upper}"
                    );
                    assert_eq!(r.signum(), x.signum(), "{x} → {r}");
                }
            }
            if x.abs() > 1e30 {
                x = 0.7;
            }
        }
    }

    /// Over uniform `u`, the mean of the rounded value is the value; the nearest neighbour
    /// (what a cast gives) is off by the distance to it.
    #[test]
    fn the_rounding_is_unbiased_and_rounding_to_nearest_is_not() {
        // Three tenths, a third and seven tenths of the way between two neighbours.
        for (format, x) in [
            (HalfFormat::Bf16, 1.0 + 0.3 / 128.0),
            (HalfFormat::Bf16, -(2f32.powi(-15) * (1.0 + 0.7 / 128.0))),
            (HalfFormat::F16, 1000.0 + 0.3 * 0.5),
            (HalfFormat::F16, 2f32.powi(-24) * 5.33), // an f16 subnormal
        ] {
            let draws = 4096;
            let mean = (0..draws)
                .map(|i| round_stochastically(x, format, (i as f32 + 0.5) / draws as f32) as f64)
                .sum::<f64>()
                / draws as f64;
            let (lower, upper) = neighbours(x.abs(), format);
            let spacing = (upper - lower) as f64;
            assert!(
                (mean - x as f64).abs() <= spacing / draws as f64,
                "{format:?}: mean {mean} vs {x}"
            );
            let nearest = match (x.abs() - lower) < (upper - x.abs()) {
                true => lower,
                false => upper,
            }
            .copysign(x) as f64;
            assert!(
                (nearest - x as f64).abs() >= 0.2 * spacing,
                "{format:?}: the case must tell rounding to nearest apart"
            );
        }
    }

    #[test]
    fn what_is_not_finite_stays_and_f16_overflows_to_a_power_of_two() {
        for format in [HalfFormat::Bf16, HalfFormat::F16] {
            assert!(round_stochastically(f32::NAN, format, 0.5).is_nan());
            assert_eq!(
                round_stochastically(f32::INFINITY, format, 0.5),
                f32::INFINITY
            );
            assert_eq!(round_stochastically(0.0, format, 0.5), 0.0);
        }
        assert_eq!(round_stochastically(65519.0, HalfFormat::F16, 0.0), 65536.0);
        assert_eq!(round_stochastically(65504.0, HalfFormat::F16, 0.0), 65504.0);
    }
}
