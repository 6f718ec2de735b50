//! Trust: where a hop's factor comes from (`resolve`), and its arithmetic
//! in parts per million — integers with floor rounding, so every language
//! computes the same cumulative trust bit for bit.

use super::InputError;
use super::limits::{MAX_RISK_CLASS_BYTES, PPM_ONE};

/// What a delegate's attestation states, as decoded from its signed
/// payload (the fields of the proto's `Attestation`).
#[derive(Clone, Copy, Debug)]
pub struct Statement<'a> {
    pub factor: f64,
    pub risk_class: &'a str,
    /// The agent the attestation is about.
    pub agent_key: &'a [u8],
    pub not_before_ms: i64,
    pub expires_at_ms: i64,
}

/// Where a hop's trust factor came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Nothing vouched: factor 0.
    None,
    /// The operator's static table.
    StaticTable,
    /// An attestation signed by a trusted attestor.
    Attestation,
}

/// A delegate's trust factor, why, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub factor_ppm: u32,
    /// Shown with a refusal for trust below the threshold.
    pub note: String,
    pub source: Source,
}

impl Resolved {
    fn none(note: impl Into<String>) -> Self {
        Self {
            factor_ppm: 0,
            note: note.into(),
            source: Source::None,
        }
    }
}

/// The delegate's trust factor: from a valid attestation by a trusted
/// attestor, else from the static table (`static_ppm`, the delegate's
/// entry), else 0. A malformed statement (factor outside (0, 1], a bad
/// risk class or validity start) is an input error naming the field; an
/// attestation for another agent, expired, not yet valid or not signed
/// by a trusted attestor is factor 0 — never the requester's say-so.
/// `signed_by_trusted_attestor` (the signature check, the one expensive
/// step) runs last, only for an otherwise valid statement.
pub fn resolve(
    statement: Option<Statement<'_>>,
    delegate_key: &[u8; 32],
    static_ppm: Option<u32>,
    now_ms: i64,
    signed_by_trusted_attestor: impl FnOnce() -> bool,
) -> Result<Resolved, InputError> {
    let Some(statement) = statement else {
        return Ok(match static_ppm {
            Some(ppm) => Resolved {
                factor_ppm: ppm,
                note: "from the static trust table".into(),
                source: Source::StaticTable,
            },
            None => Resolved::none("no attestation and no static trust entry"),
        });
    };
    let factor_ppm = factor_to_ppm(statement.factor).ok_or_else(|| {
        InputError::new(
            "body.delegate_attestation.factor",
            format!("{} is outside (0, 1]", statement.factor),
        )
    })?;
    super::text(
        statement.risk_class,
        MAX_RISK_CLASS_BYTES,
        false,
        "body.delegate_attestation.risk_class",
    )?;
    if statement.agent_key != delegate_key.as_slice() {
        return Ok(Resolved::none("the attestation is for another agent"));
    }
    if statement.not_before_ms < 0 {
        return Err(InputError::new(
            "body.delegate_attestation.not_before_ms",
            "must be 0 or a unix time in ms",
        ));
    }
    if statement.expires_at_ms <= now_ms {
        return Ok(Resolved::none("the attestation has expired"));
    }
    if statement.not_before_ms > now_ms {
        return Ok(Resolved::none(format!(
            "the attestation is not valid before {}",
            statement.not_before_ms
        )));
    }
    if !signed_by_trusted_attestor() {
        return Ok(Resolved::none(
            "the attestation is not signed by a trusted attestor",
        ));
    }
    Ok(Resolved {
        factor_ppm,
        note: "attested".into(),
        source: Source::Attestation,
    })
}

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

    const AGENT: [u8; 32] = [7; 32];
    const NOW: i64 = 1_000_000;

    fn statement(factor: f64) -> Statement<'static> {
        Statement {
            factor,
            risk_class: "low",
            agent_key: &AGENT,
            not_before_ms: 0,
            expires_at_ms: NOW + 1,
        }
    }

    #[test]
    fn an_attestation_sets_the_factor_only_when_valid_for_this_agent_and_trusted() {
        let attested = resolve(Some(statement(0.9)), &AGENT, Some(1), NOW, || true).unwrap();
        assert_eq!(
            (attested.factor_ppm, attested.source),
            (900_000, Source::Attestation)
        );
        let zero = |s: Statement<'_>, signed: bool| {
            let r = resolve(Some(s), &AGENT, Some(500_000), NOW, || signed).unwrap();
            assert_eq!((r.factor_ppm, r.source), (0, Source::None), "{}", r.note);
            r.note
        };
        // A presented attestation replaces the static entry, even when it
        // does not count: no falling back to the table behind it.
        assert!(zero(statement(0.9), false).contains("trusted attestor"));
        let other = [8; 32];
        assert!(
            zero(
                Statement {
                    agent_key: &other,
                    ..statement(0.9)
                },
                true
            )
            .contains("another agent")
        );
        assert!(
            zero(
                Statement {
                    expires_at_ms: NOW,
                    ..statement(0.9)
                },
                true
            )
            .contains("expired")
        );
        assert!(
            zero(
                Statement {
                    not_before_ms: NOW + 1,
                    ..statement(0.9)
                },
                true
            )
            .contains("not valid before")
        );
    }

    #[test]
    fn without_an_attestation_the_static_table_or_nothing() {
        let r = resolve(None, &AGENT, Some(420_000), NOW, || unreachable!()).unwrap();
        assert_eq!((r.factor_ppm, r.source), (420_000, Source::StaticTable));
        let r = resolve(None, &AGENT, None, NOW, || unreachable!()).unwrap();
        assert_eq!((r.factor_ppm, r.source), (0, Source::None));
    }

    #[test]
    fn a_malformed_statement_names_its_field_before_any_signature_check() {
        let field = |s: Statement<'_>| {
            resolve(Some(s), &AGENT, None, NOW, || panic!("signature checked"))
                .unwrap_err()
                .field
        };
        assert_eq!(field(statement(1.5)), "body.delegate_attestation.factor");
        assert_eq!(
            field(statement(f64::NAN)),
            "body.delegate_attestation.factor"
        );
        let long = "x".repeat(MAX_RISK_CLASS_BYTES + 1);
        assert_eq!(
            field(Statement {
                risk_class: &long,
                ..statement(0.5)
            }),
            "body.delegate_attestation.risk_class"
        );
        assert_eq!(
            field(Statement {
                not_before_ms: -1,
                ..statement(0.5)
            }),
            "body.delegate_attestation.not_before_ms"
        );
    }

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
        /// Trust is never the requester's say-so: without a trusted
        /// signature the factor is the table's or 0, and an attested
        /// factor is exactly the statement's.
        #[test]
        fn only_a_trusted_signature_makes_a_statement_count(
            factor in 0.000_001f64..=1.0,
            not_before_ms in 0i64..2 * NOW,
            expires_at_ms in 0i64..2 * NOW,
            signed: bool,
            for_this_agent: bool,
            table in proptest::option::of(0..=PPM_ONE),
        ) {
            let other = [9; 32];
            let s = Statement {
                factor,
                risk_class: "",
                agent_key: if for_this_agent { &AGENT } else { &other },
                not_before_ms,
                expires_at_ms,
            };
            let r = resolve(Some(s), &AGENT, table, NOW, || signed).unwrap();
            let valid = for_this_agent && not_before_ms <= NOW && NOW < expires_at_ms;
            if signed && valid {
                prop_assert_eq!(r.source, Source::Attestation);
                prop_assert_eq!(Some(r.factor_ppm), factor_to_ppm(factor));
            } else {
                prop_assert_eq!((r.factor_ppm, r.source), (0, Source::None));
            }
        }

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
