//! The `result` value a predicate is evaluated over, and the check of the
//! output against its schema that gives `result.schema_valid`.

use std::collections::HashMap;
use std::sync::Arc;

use cel::Value;
use cel::objects::{Key, Map};
use serde_json::Value as Json;

use super::{Completion, Facts, Observed};
use crate::limits::{MAX_SCHEMA_ERRORS_REPORTED, MAX_SCHEMA_VALIDATION_MS, MAX_SCHEMA_WORK};

/// The output against its schema: valid, or why not. Never valid unchecked:
/// a schema that does not compile, or an output whose validation would cost
/// more than `MAX_SCHEMA_WORK` (`schema::Profile::work`), is not valid.
pub(super) fn validate_output(schema: &Json, output: &Json) -> (bool, Vec<String>) {
    // A schema is compiled when the contract is issued (and remembered);
    // one that fails here anyway cannot vouch for the output.
    let compiled = match crate::schema::compile(schema) {
        Ok(c) => c,
        Err(e) => return (false, vec![format!("the schema does not compile: {e}")]),
    };
    let work = compiled.profile().work(output);
    if work > MAX_SCHEMA_WORK {
        return (
            false,
            vec![format!(
                "/: not validated: checking this output against the schema would cost more than MAX_SCHEMA_WORK ({MAX_SCHEMA_WORK}) work units (estimated {work})"
            )],
        );
    }
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(MAX_SCHEMA_VALIDATION_MS);
    let out_of_time = || {
        (
            false,
            vec![format!(
                "/: not validated: validation time exceeds the limit of MAX_SCHEMA_VALIDATION_MS ({MAX_SCHEMA_VALIDATION_MS} ms)"
            )],
        )
    };
    match crate::schema::within(deadline, || compiled.validator().is_valid(output)) {
        None => return out_of_time(),
        Some(true) => return (true, Vec::new()),
        Some(false) => {}
    }
    // Collecting details re-checks anyOf/oneOf branches: bounded apart.
    if compiled.profile().error_work(output) > MAX_SCHEMA_WORK {
        return (
            false,
            vec![format!(
                "/: does not match the schema (the details would cost more than MAX_SCHEMA_WORK ({MAX_SCHEMA_WORK}) work units to collect)"
            )],
        );
    }
    let errors = crate::schema::within(deadline, || {
        compiled
            .validator()
            .iter_errors(output)
            .take(MAX_SCHEMA_ERRORS_REPORTED)
            .map(|e| {
                let at = e.instance_path().to_string();
                let message = format!("{}: {e}", if at.is_empty() { "/" } else { &at });
                // Messages quote the output, which may be large.
                crate::error::bounded(message, crate::error::MAX_ERROR_REASON_BYTES)
            })
            .collect::<Vec<String>>()
    });
    let Some(mut errors) = errors else {
        return out_of_time();
    };
    if errors.is_empty() {
        errors.push("/: does not match the schema".to_owned());
    }
    (false, errors)
}

pub(super) fn result_value(
    completion: &Completion<'_>,
    observed: &Observed,
    facts: &Facts,
) -> Value {
    let entries: [(&str, Value); 9] = [
        ("schema_valid", Value::Bool(facts.schema_valid)),
        ("within_scope", Value::Bool(facts.within_scope)),
        ("output", json_to_cel(&completion.output)),
        ("claimed", Value::String(Arc::new(completion.claim.clone()))),
        ("has_report", Value::Bool(completion.has_report)),
        ("consumed", Value::Int(facts.consumed)),
        ("elapsed_ms", Value::Int(observed.elapsed_ms)),
        ("tool_calls", Value::Int(observed.tool_calls)),
        (
            "mutations",
            Value::Int(i64::try_from(facts.mutations).unwrap_or(i64::MAX)),
        ),
    ];
    let map: HashMap<Key, Value> = entries
        .into_iter()
        .map(|(k, v)| (Key::String(Arc::new(k.to_owned())), v))
        .collect();
    Value::Map(Map { map: Arc::new(map) })
}

/// JSON to CEL: integers that fit are `int`, larger ones `uint`, the rest
/// `double`. Depth is bounded by `check_output` beforehand.
pub(super) fn json_to_cel(v: &Json) -> Value {
    match v {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::Int(i),
            (None, Some(u)) => Value::UInt(u),
            _ => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::String(Arc::new(s.clone())),
        Json::Array(items) => Value::List(Arc::new(items.iter().map(json_to_cel).collect())),
        Json::Object(map) => Value::Map(Map {
            map: Arc::new(
                map.iter()
                    .map(|(k, v)| (Key::String(Arc::new(k.clone())), json_to_cel(v)))
                    .collect(),
            ),
        }),
    }
}
