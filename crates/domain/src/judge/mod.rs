//! Judgment of a completion (docs/design.md §Lifecycle, Complete): the broker
//! evaluates the contract's effective acceptance predicate over a `result`
//! it builds from facts it checked or observed itself, never over the
//! delegate's claim alone. Owns the completion input bounds (result size;
//! the schema's own bounds are `core::schema`'s), the `result` value, the
//! split of the predicate into its top-level conjuncts and their bounded
//! evaluation, including `matches` (see `Meter::matches`).
//!
//! `result` has: `schema_valid` (the output against the contract's JSON
//! Schema; true without one), `within_scope` (no host-observed mutation
//! outside the write scope), `output` (the delegate's JSON), `claimed`,
//! `has_report`, and the ints `consumed`, `elapsed_ms`, `tool_calls`,
//! `mutations`.
//!
//! Each top-level conjunct (found through `&&` and parentheses) is evaluated
//! on its own; one that is false, not a bool, or fails (missing field, type
//! error) is one refused criterion.
//!
//! Here: the judgment's types, the input bounds and the verdict. `result`
//! builds the `result` value, `conjuncts` splits the predicate, `evaluate`
//! runs each conjunct under its cost meter.

mod conjuncts;
mod evaluate;
mod result;

use serde_json::Value as Json;

use super::error::InputError;
use super::limits::{
    MAX_CLAIM_BYTES, MAX_OUT_OF_SCOPE_PATHS_REPORTED, MAX_RESULT_BYTES, MAX_RESULT_DEPTH,
    MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH,
};
use super::scope::Scope;
use evaluate::evaluate;
use result::{result_value, validate_output};

pub(crate) use conjuncts::{Shape, conjunct_shape};

/// What the host observed of the contract's execution (signed receipts).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub tool_calls: i64,
    /// Paths the host saw mutated, as reported.
    pub mutation_paths: Vec<String>,
    /// Budget units the host metered, when it metered any; it overrides
    /// the delegate's report.
    pub consumed_by_host: Option<i64>,
    pub elapsed_ms: i64,
}

/// What the delegate sends with `Complete`.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion<'a> {
    /// The structured result.
    pub output: Json,
    /// The delegate's claim, e.g. "success".
    pub claim: String,
    /// Units the delegate says it consumed.
    pub reported_consumed: i64,
    /// A typed report came with the result.
    pub has_report: bool,
    /// The JSON Schema the contract named for the output, if any.
    pub schema: Option<&'a Json>,
}

wire_enum! {
    /// The broker's verdict on a completion.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Verdict: i32 {
        /// Every conjunct of the effective predicate held.
        Accepted = 1 => "ACCEPTED",
        /// At least one conjunct was refused.
        Rejected = 2 => "REJECTED",
        /// No predicate: liability stayed with the principal, who adjudicates.
        PendingPrincipal = 3 => "PENDING_PRINCIPAL",
    }
}

/// One top-level conjunct that did not hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedCriterion {
    /// The conjunct's source text, without enclosing parentheses, e.g.
    /// `result.within_scope`.
    pub text: String,
    /// "evaluated to false", or why it could not be evaluated.
    pub reason: String,
}

/// The broker's judgment, recorded beside the delegate's claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judgment {
    pub verdict: Verdict,
    /// Refused conjuncts in source order; empty unless `Rejected`.
    pub refused: Vec<RefusedCriterion>,
    pub schema_valid: bool,
    /// Why the output failed its schema (at most
    /// `MAX_SCHEMA_ERRORS_REPORTED` messages).
    pub schema_errors: Vec<String>,
    pub within_scope: bool,
    /// Observed mutations outside the write scope (claim violations):
    /// distinct, sorted, at most `MAX_OUT_OF_SCOPE_PATHS_REPORTED`.
    pub out_of_scope_paths: Vec<String>,
    /// How many distinct paths were outside the scope in all.
    pub out_of_scope_path_count: u32,
    /// Units to charge: the host's metering when present, else the report.
    pub consumed: i64,
    /// Units the delegate said it consumed, metered or not: what it
    /// claims beyond the charge is shown to its principal
    /// (`CompletedFacts::claimed_excess`), never charged.
    pub reported_consumed: i64,
}

/// Validates a completion's output against the size and depth bounds.
pub fn check_output(output: &Json, field: &'static str) -> Result<(), InputError> {
    check_json(output, MAX_RESULT_BYTES, MAX_RESULT_DEPTH, field)
}

/// Validates a delegate's claim text.
pub fn check_claim(claim: &str, field: &'static str) -> Result<(), InputError> {
    super::text(claim, MAX_CLAIM_BYTES, false, field)
}

/// Checks that a JSON Schema is within bounds, compiles and is bounded in
/// what validating against it can cost (`schema::compile`), so a contract
/// never names a schema its completion could not be judged against.
/// External `$ref`s are never fetched (they fail here), `pattern`s must
/// suit the linear-time regex engine within its size limits, and the
/// schema's expansion must stay within `MAX_SCHEMA_EXPANSION`. The compiled
/// schema is remembered for the judgment.
pub fn compile_schema(schema: &Json, field: &'static str) -> Result<(), InputError> {
    check_json(schema, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, field)?;
    super::schema::compile(schema)
        .map(drop)
        .map_err(|why| InputError::new(field, why))
}

/// Judges a completion: builds `result`, then evaluates every top-level
/// conjunct of `effective_predicate` (an empty one means
/// `PendingPrincipal`).
pub fn judge(
    effective_predicate: &str,
    scope: &Scope,
    completion: &Completion<'_>,
    observed: &Observed,
) -> Judgment {
    let (schema_valid, schema_errors) = match completion.schema {
        None => (true, Vec::new()),
        Some(schema) => validate_output(schema, &completion.output),
    };
    let mut out_of_scope_paths: Vec<String> = observed
        .mutation_paths
        .iter()
        .filter(|p| !scope.covers_observed(p))
        .cloned()
        .collect();
    out_of_scope_paths.sort_unstable();
    out_of_scope_paths.dedup();
    let within_scope = out_of_scope_paths.is_empty();
    // The verdict used them all; the receipt names a bounded few (up to
    // MAX_OBSERVATIONS_PER_CONTRACT paths of up to 1 KiB each would not
    // fit a message) and says how many there were.
    let out_of_scope_path_count = u32::try_from(out_of_scope_paths.len()).unwrap_or(u32::MAX);
    out_of_scope_paths.truncate(MAX_OUT_OF_SCOPE_PATHS_REPORTED);
    let consumed = observed
        .consumed_by_host
        .unwrap_or(completion.reported_consumed);
    let mut judgment = Judgment {
        verdict: Verdict::PendingPrincipal,
        refused: Vec::new(),
        schema_valid,
        schema_errors,
        within_scope,
        out_of_scope_paths,
        out_of_scope_path_count,
        consumed,
        reported_consumed: completion.reported_consumed,
    };
    let predicate = effective_predicate.trim();
    if predicate.is_empty() {
        return judgment;
    }
    judgment.refused = match check_output(&completion.output, "result.output") {
        Err(e) => vec![RefusedCriterion {
            text: predicate.to_owned(),
            reason: e.to_string(),
        }],
        Ok(()) => {
            let facts = Facts {
                schema_valid,
                within_scope,
                consumed,
                mutations: observed.mutation_paths.len(),
            };
            evaluate(predicate, &result_value(completion, observed, &facts))
        }
    };
    judgment.verdict = if judgment.refused.is_empty() {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    };
    judgment
}

struct Facts {
    schema_valid: bool,
    within_scope: bool,
    consumed: i64,
    mutations: usize,
}

/// Size (serialized bytes) and depth bound of a JSON value, checked without
/// recursion and without serializing more than `max_bytes` + 1 bytes.
fn check_json(
    value: &Json,
    max_bytes: usize,
    max_depth: usize,
    field: &'static str,
) -> Result<(), InputError> {
    let mut stack = vec![(value, 1usize)];
    while let Some((v, depth)) = stack.pop() {
        if depth > max_depth {
            return Err(InputError::new(
                field,
                format!("nested deeper than {max_depth} levels"),
            ));
        }
        match v {
            Json::Array(items) => stack.extend(items.iter().map(|i| (i, depth + 1))),
            Json::Object(map) => stack.extend(map.values().map(|i| (i, depth + 1))),
            _ => {}
        }
    }
    let mut counter = ByteCounter {
        left: max_bytes + 1,
    };
    if serde_json::to_writer(&mut counter, value).is_err() {
        return Err(InputError::new(
            field,
            format!("larger than {max_bytes} bytes"),
        ));
    }
    Ok(())
}

/// A writer that fails once more than its budget has been written.
struct ByteCounter {
    left: usize,
}

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() >= self.left {
            return Err(std::io::Error::other("too large"));
        }
        self.left -= buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
