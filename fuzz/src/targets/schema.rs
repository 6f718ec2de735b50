//! Result schemas: `compile_schema` (the issuance check, with its size,
//! depth and cost bounds) and the validation of an arbitrary output
//! against a schema that compiled, through `judge` as the broker judges a
//! completion.
//!
//! Asserts:
//! - errors name the field and carry a bounded reason;
//! - a schema that compiled is within `MAX_SCHEMA_BYTES`/`MAX_SCHEMA_DEPTH`
//!   and still compiles at judgment (never "the schema does not compile");
//! - `schema_valid` is true exactly when no schema error is reported, at
//!   most `MAX_SCHEMA_ERRORS_REPORTED` are, and the verdict on
//!   `result.schema_valid` follows it (REJECTED when the output itself is
//!   out of bounds);
//! - `true` and `{}` accept every output, `false` none;
//! - judging is deterministic (the same judgment twice in a row).

use crate::{DEEP_STACK_BYTES, json, note, on_stack, schema};
use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::core::Scope;
use delegation_broker::core::error::MAX_ERROR_REASON_BYTES;
use delegation_broker::core::judge::{self, Completion, Judgment, Observed, Verdict};
use delegation_broker::core::limits::{MAX_SCHEMA_BYTES, MAX_SCHEMA_ERRORS_REPORTED};
use serde_json::Value as Json;

#[derive(Debug)]
pub enum Input {
    /// Client text, as `body.result_schema_json` and `body.output_json`.
    Text { schema: String, output: String },
    /// Built from every draft's keywords.
    Built { schema: Json, output: Json },
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(if u.ratio(1, 4)? {
            Input::Text {
                schema: u.arbitrary()?,
                output: u.arbitrary()?,
            }
        } else {
            Input::Built {
                schema: schema(u, 5)?,
                output: json(u, 6)?,
            }
        })
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    on_stack(DEEP_STACK_BYTES, move || run(input));
}

const FIELD: &str = "body.result_schema_json";

fn run(input: Input) {
    let (schema, output) = match input {
        Input::Text { schema, output } => {
            // As the Delegate conversion reads the schema text.
            if schema.trim().is_empty() || schema.len() > MAX_SCHEMA_BYTES {
                return;
            }
            let Ok(schema) = serde_json::from_str::<Json>(&schema) else {
                return;
            };
            let output = serde_json::from_str(&output).unwrap_or(Json::String(output));
            (schema, output)
        }
        Input::Built { schema, output } => (schema, output),
    };
    if let Err(e) = judge::compile_schema(&schema, FIELD) {
        note("refused");
        assert_eq!(e.field, FIELD);
        assert!(e.reason.len() <= MAX_ERROR_REASON_BYTES + 64, "{e:?}");
        return;
    }
    let text = serde_json::to_string(&schema).expect("a JSON value serializes");
    assert!(
        text.len() <= MAX_SCHEMA_BYTES,
        "compiled a {}-byte schema",
        text.len()
    );

    let judgment = judged(&schema, &output);
    note(if judgment.schema_valid {
        "compiled, output valid"
    } else {
        "compiled, output invalid"
    });
    assert_eq!(judgment, judged(&schema, &output), "not deterministic");
    assert_eq!(
        judgment.schema_valid,
        judgment.schema_errors.is_empty(),
        "{judgment:?}"
    );
    assert!(judgment.schema_errors.len() <= MAX_SCHEMA_ERRORS_REPORTED);
    for e in &judgment.schema_errors {
        assert!(
            !e.contains("does not compile"),
            "compiled at issuance, not at judgment: {e}"
        );
    }
    match &schema {
        Json::Bool(b) => assert_eq!(judgment.schema_valid, *b),
        Json::Object(map) if map.is_empty() => assert!(judgment.schema_valid),
        _ => {}
    }
    let output_ok = judge::check_output(&output, "result.output").is_ok();
    let accepted = judgment.verdict == Verdict::Accepted;
    assert_eq!(accepted, output_ok && judgment.schema_valid, "{judgment:?}");
}

fn judged(schema: &Json, output: &Json) -> Judgment {
    let completion = Completion {
        output: output.clone(),
        claim: "success".into(),
        reported_consumed: 1,
        has_report: false,
        schema: Some(schema),
    };
    judge::judge(
        "result.schema_valid",
        &Scope::default(),
        &completion,
        &Observed::default(),
    )
}
