//! Acceptance predicates: parsing, composition along a chain
//! (`conjoin`, `check_effective`) and judging a small fixed completion.
//!
//! Asserts, beyond "never panics, never overflows the stack the broker
//! gives it":
//! - `parse` returns the trimmed text, is idempotent, and its errors name
//!   the field with a bounded reason;
//! - `conjoin` keeps every part: the composed text begins with the
//!   inherited predicate and ends with the own one, parenthesized;
//! - `check_effective`, when Ok, is exactly `conjoin`, and a chain of hops
//!   keeps every earlier effective predicate as its prefix;
//! - no forwarded predicate is dropped or weakened: judged on the same
//!   facts, the composition refuses exactly the conjuncts its parts refuse
//!   (as many, and the verdict is ACCEPTED only if both parts are), unless
//!   the shared evaluation cost or time limit was reached.

use crate::{DEEP_STACK_BYTES, cel, note, on_stack};
use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::core::error::MAX_ERROR_REASON_BYTES;
use delegation_broker::core::judge::{self, Completion, Judgment, Observed, Verdict};
use delegation_broker::core::{Predicate, Scope};
use serde_json::json;

#[derive(Debug)]
pub struct Input {
    inherited: String,
    own: String,
    /// Extra hops forwarding `own` again.
    hops: u8,
    /// Which fixed completion is judged.
    facts: u8,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Self {
            inherited: cel(u)?,
            own: cel(u)?,
            hops: u.int_in_range(0..=3)?,
            facts: u.arbitrary()?,
        })
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    on_stack(DEEP_STACK_BYTES, move || run(input));
}

fn run(input: Input) {
    let p = parsed(&input.inherited, "body.predicate");
    let q = parsed(&input.own, "body.predicate");
    let (Some(p), Some(q)) = (p, q) else { return };
    note("both parse");
    let none = Predicate::default();

    // Composition keeps both parts, in order.
    if let Some(c) = Predicate::conjoin(&p, &q) {
        match (p.is_empty(), q.is_empty()) {
            (_, true) => assert_eq!(c, p),
            (true, false) => assert_eq!(c.as_str(), format!("({}\n)", q.as_str())),
            (false, false) => {
                assert!(c.as_str().starts_with(p.as_str()), "{c:?} drops {p:?}");
                assert!(
                    c.as_str().ends_with(&format!("({}\n)", q.as_str())),
                    "{c:?} drops {q:?}"
                );
            }
        }
    }

    // A chain: the first hop forwards p (its effective predicate is p
    // alone), the next ones q.
    let Ok(first) = Predicate::check_effective(&none, &p, "body.predicate") else {
        return;
    };
    assert_eq!(Some(&first), Predicate::conjoin(&none, &p).as_ref());
    let mut effective = first.clone();
    for _ in 0..=input.hops {
        match Predicate::check_effective(&effective, &q, "body.predicate") {
            Ok(next) => {
                assert_eq!(Some(&next), Predicate::conjoin(&effective, &q).as_ref());
                assert!(next.as_str().starts_with(effective.as_str()));
                effective = next;
            }
            Err(e) => {
                assert_eq!(e.field, "body.predicate");
                break;
            }
        }
    }
    let Ok(second) = Predicate::check_effective(&first, &q, "body.predicate") else {
        return;
    };
    note(if second.is_empty() {
        "composed empty"
    } else {
        "composed"
    });

    // Judged on the same facts, the composition refuses what its parts do.
    let judge = |text: &str| judged(text, input.facts);
    let (jp, jq, jc) = (judge(p.as_str()), judge(q.as_str()), judge(second.as_str()));
    for j in [&jp, &jq, &jc] {
        assert_eq!(
            j.verdict == Verdict::Rejected,
            !j.refused.is_empty(),
            "{j:?}"
        );
    }
    if second.is_empty() {
        assert_eq!(jc.verdict, Verdict::PendingPrincipal);
        return;
    }
    let limited = |j: &Judgment| {
        j.refused
            .iter()
            .any(|r| r.reason.contains("exceeds the limit"))
    };
    if [&jp, &jq, &jc].into_iter().any(limited) {
        note("judged at a limit");
        return;
    }
    note(match jc.verdict {
        Verdict::Accepted => "judged accepted",
        _ => "judged rejected",
    });
    assert_eq!(
        jc.refused.len(),
        jp.refused.len() + jq.refused.len(),
        "composition {second:?} refused {:?}; parts refused {:?} and {:?}",
        jc.refused,
        jp.refused,
        jq.refused
    );
    let accepted = |j: &Judgment| j.verdict != Verdict::Rejected;
    assert_eq!(accepted(&jc), accepted(&jp) && accepted(&jq));
}

/// `Predicate::parse`, with the properties every parse must have.
fn parsed(text: &str, field: &'static str) -> Option<Predicate> {
    match Predicate::parse(text, field) {
        Ok(p) => {
            assert_eq!(p.as_str(), text.trim());
            assert_eq!(p.is_empty(), text.trim().is_empty());
            // Idempotent (and the parse memo answers as parsing did).
            assert_eq!(Predicate::parse(p.as_str(), "again").as_ref(), Ok(&p));
            Some(p)
        }
        Err(e) => {
            assert_eq!(e.field, field);
            assert!(e.reason.len() <= MAX_ERROR_REASON_BYTES + 64, "{e:?}");
            None
        }
    }
}

/// Judges `predicate` against one of a few fixed completions.
fn judged(predicate: &str, facts: u8) -> Judgment {
    let schema = json!({ "type": "object", "required": ["items"] });
    let output = match facts % 4 {
        0 => json!({
            "items": [1, 2, 3],
            "approved": true,
            "name": "report.md",
            "score": 0.75,
            "nested": { "a": [{ "b": "c" }] }
        }),
        1 => json!(null),
        2 => json!([1, "two", { "three": 3 }]),
        _ => json!("plain"),
    };
    let completion = Completion {
        output,
        claim: "success".into(),
        reported_consumed: 5,
        has_report: facts & 4 != 0,
        schema: (facts & 8 != 0).then_some(&schema),
    };
    let observed = Observed {
        tool_calls: 3,
        mutation_paths: vec![
            "src/a.rs".into(),
            "docs/x.md".into(),
            "src/exec/../../etc/passwd".into(),
        ],
        consumed_by_host: (facts & 16 != 0).then_some(7),
        elapsed_ms: 1_200,
    };
    let scope = Scope::from_trusted(vec!["/tmp/out".into(), "src".into()]);
    judge::judge(predicate, &scope, &completion, &observed)
}
