//! Trust arithmetic in parts per million. Integers with floor rounding, so
//! every language computes the same cumulative trust bit for bit.

use super::limits::PPM_ONE;

/// Converts a factor in (0, 1] to ppm, rounding to nearest. `None` for NaN,
/// infinities, zero, negatives and values above one: such a factor is
/// malformed input, not a low trust.
pub fn factor_to_ppm(factor: f64) -> Option<u32> {
    if !factor.is_finite() || factor <= 0.0 || factor > 1.0 {
        return None;
    }
    // Floor, as attenuation does: a factor never counts for more than it
    // says (0.4999995 is 499,999 ppm, not 500,000).
    let ppm = snap(factor * f64::from(PPM_ONE)).floor();
    // A positive factor below one ppm floors to zero: keep 1 so a valid
    // attestation is never read as "no attestation".
    Some((ppm as u32).clamp(1, PPM_ONE))
}

/// A product within `PPM_NOISE` of an integer is that integer: `0.9 × 10^6`
/// may come out a hair below 900,000 in binary floating point, and floor
/// must not turn decimal factors a client wrote exactly into one ppm less.
fn snap(scaled: f64) -> f64 {
    let nearest = scaled.round();
    if (scaled - nearest).abs() < PPM_NOISE {
        nearest
    } else {
        scaled
    }
}

/// Far above the float error of a factor in (0, 1] times 10^6 (~10^-10),
/// far below any fraction of a ppm a client means (0.4999995 is 0.5 ppm).
const PPM_NOISE: f64 = 1e-6;

/// Converts a threshold in [0, 1] to ppm, rounding up: a minimum never
/// comes out lower than asked.
pub fn threshold_to_ppm(threshold: f64) -> Option<u32> {
    if !threshold.is_finite() || !(0.0..=1.0).contains(&threshold) {
        return None;
    }
    Some((snap(threshold * f64::from(PPM_ONE)).ceil() as u32).min(PPM_ONE))
}

/// floor(cumulative * factor / 1e6). Both inputs are at most 1e6, so the
/// product fits in u64 and the result is at most 1e6.
pub fn attenuate(cumulative_ppm: u32, factor_ppm: u32) -> u32 {
    debug_assert!(cumulative_ppm <= PPM_ONE && factor_ppm <= PPM_ONE);
    let product = u64::from(cumulative_ppm.min(PPM_ONE)) * u64::from(factor_ppm.min(PPM_ONE));
    (product / u64::from(PPM_ONE)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn seed_002_chain_falls_below_threshold_on_the_third_hop() {
        let f = |x| factor_to_ppm(x).unwrap();
        let after_two = attenuate(attenuate(PPM_ONE, f(0.9)), f(0.8));
        assert_eq!(after_two, 720_000);
        assert_eq!(attenuate(after_two, f(0.5)), 360_000);
        assert!(360_000 < threshold_to_ppm(0.4).unwrap());
    }

    #[test]
    fn malformed_factors_are_rejected() {
        for bad in [f64::NAN, 2.0, 0.0, -0.1, f64::INFINITY, 1.000_001] {
            assert_eq!(factor_to_ppm(bad), None, "{bad}");
        }
        assert_eq!(factor_to_ppm(1.0), Some(PPM_ONE));
        assert_eq!(factor_to_ppm(1e-9), Some(1));
        // Floor, not nearest; exact decimals stay exact.
        assert_eq!(factor_to_ppm(0.499_999_5), Some(499_999));
        for (f, ppm) in [
            (0.9, 900_000),
            (0.7, 700_000),
            (0.1, 100_000),
            (0.000_001, 1),
        ] {
            assert_eq!(factor_to_ppm(f), Some(ppm), "{f}");
        }
        assert_eq!(threshold_to_ppm(0.499_999_5), Some(500_000));
        assert_eq!(threshold_to_ppm(0.4), Some(400_000));
        assert_eq!(threshold_to_ppm(0.0), Some(0));
        assert_eq!(threshold_to_ppm(f64::NAN), None);
    }

    proptest! {
        #[test]
        fn every_ppm_written_as_a_decimal_converts_exactly(ppm in 1..=PPM_ONE) {
            let factor = f64::from(ppm) / 1e6;
            prop_assert_eq!(factor_to_ppm(factor), Some(ppm));
            prop_assert_eq!(threshold_to_ppm(factor), Some(ppm));
        }

        #[test]
        fn attenuation_never_increases_trust(c in 0..=PPM_ONE, f in 0..=PPM_ONE) {
            let out = attenuate(c, f);
            prop_assert!(out <= c);
            prop_assert!(out <= f);
            // Floor rounding: the exact product lies in [out, out + 1).
            let exact = u64::from(c) * u64::from(f);
            prop_assert!(u64::from(out) * 1_000_000 <= exact);
            prop_assert!(exact < (u64::from(out) + 1) * 1_000_000);
        }
    }
}
