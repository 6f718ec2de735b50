//! The JSON Schema a contract names for its completion output: what makes
//! one acceptable at issuance, and what validating an output against it may
//! cost at judgment. Owns the schema's pattern bounds (regex size limits, at
//! most `MAX_SCHEMA_PATTERNS`), its `Profile` (found at issuance, refused
//! past `MAX_SCHEMA_EXPANSION`), the work estimate that gates validation
//! (`MAX_SCHEMA_WORK`), and the process-wide memo of compiled schemas.
//!
//! Why. `jsonschema` validates by walking the schema over the output:
//! `allOf`, `anyOf`, `oneOf`, `not`, `if` and `$ref` apply several schemas
//! to the same output node, so a chain of them multiplies (a 3.9 KB chain of
//! two-way `anyOf`s doubles per level), and a short `pattern` can compile to
//! megabytes of automaton (`[\p{L}\p{N}]{50}N`).
//!
//! The profile. Schema nodes (objects and booleans, told apart by address)
//! are linked by *in-place* applicators, which apply to the same output
//! node (`allOf`/`anyOf`/`oneOf` items, `not`, `if`/`then`/`else`, `$ref`,
//! `$dynamicRef` and `$recursiveRef` resolved in the document,
//! `dependentSchemas`, schema-valued `dependencies`), and *descending* ones,
//! which apply to a member (`properties`, `patternProperties`,
//! `additionalProperties`, `propertyNames`, `unevaluatedProperties`) or an
//! element (`items`, `prefixItems`, `additionalItems`, `contains`,
//! `unevaluatedItems`). `paths[d]` bounds how many schema nodes apply to any
//! one output node at depth d: in-place children add up (only one of `then`
//! and `else`); a member gets at most one `properties` entry and an element
//! one `prefixItems` (or tuple `items`) entry, plus everything else that
//! descends; an output node is an object or an array, never both, so the
//! larger side counts. It is computed depth by depth over the schema
//! nodes, children first, in O(nodes × depths) whatever the sharing,
//! iteratively (no recursion). A `$ref` cycle that never descends is
//! refused, and so is a schema whose `Σ paths[d]` exceeds
//! `MAX_SCHEMA_EXPANSION`. `unevaluatedProperties`/`unevaluatedItems`
//! re-validate their node's in-place subschemas to learn what those
//! evaluated, once more per level of in-place nesting: their node's
//! in-place edges count 2 + that nesting depth times (its `contains`
//! twice).
//!
//! The work model, an upper bound up to a constant factor. Each schema
//! node applies at most `paths[d]` times to an output node at depth d, and
//! each application does work linear in the node's *weight* times the
//! output node's *cost*. A node's weight is 1 + its keywords + what it
//! scans per output node: the entries of `properties`, `patternProperties`
//! and `dependent*`, the JSON size of `enum`, `const` and `required`, and
//! for each pattern the automaton positions it can keep alive
//! (bounded repetitions counted out), since the regex engine, once its
//! small lazy DFA gives up, steps every live position at every byte
//! (`[ab]*a[ab]{904}c`, within the size limit, costs ~40 µs per byte in a
//! debug build). An output node costs 1 + its string's bytes + its members
//! or elements + its keys' bytes (and a member its key's bytes again, for
//! `propertyNames`). `Profile::work` is Σ_d weight[d] × cost(d), plus, for
//! `uniqueItems`, `UNIQUE_ITEMS_FACTOR` × the subtrees it compares.
//! Collecting error details re-checks every `anyOf`/`oneOf` branch before
//! descending into it, so `Profile::error_work` counts each node once more
//! per such applicator above it.
//!
//! Here: the work estimate and the memo of compiled schemas. `graph` finds
//! the profile, `patterns` weighs patterns and checks the `regex` format,
//! `clock` stops a validation at its deadline.

mod clock;
mod graph;
mod patterns;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::limits::{
    MAX_COMPILED_SCHEMA_BYTES, MAX_COMPILED_SCHEMAS, MAX_RESULT_DEPTH, MAX_SCHEMA_PATTERNS,
    REGEX_DFA_SIZE_LIMIT_BYTES, REGEX_SIZE_LIMIT_BYTES,
};
use clock::{CLOCK_KEYWORD, Clock, clocked};
use graph::{Scan, profile_scanned};
use patterns::regex_format;

pub use clock::within;
pub use graph::profile;

/// Output depths a profile covers: the root (0) to `MAX_RESULT_DEPTH`.
const DEPTHS: usize = MAX_RESULT_DEPTH + 1;

/// Work of `uniqueItems` per unit of the arrays it checks: up to 15 items
/// are compared pairwise (each with 14 others), more are hashed.
const UNIQUE_ITEMS_FACTOR: u64 = 16;

/// Memory charged per byte of schema text for its compiled validator
/// (~27 measured for a schema of plain properties).
const VALIDATOR_BYTES_PER_SCHEMA_BYTE: usize = 32;

/// A memo slot and its key, beyond the validator.
const ENTRY_OVERHEAD_BYTES: usize = 1_024;

/// How many schema nodes apply to the output at each depth, and what they
/// weigh (see the module doc). Computed once per schema, at issuance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// `paths[d]`: most schema nodes applied to one output node at depth d.
    paths: Vec<u64>,
    /// Their weights, summed.
    weight: Vec<u64>,
    /// How many of them check `uniqueItems`.
    unique: Vec<u64>,
    /// `weight`, each node counted once more per `anyOf`/`oneOf` above it.
    error_weight: Vec<u64>,
    /// `unique`, counted the same way.
    error_unique: Vec<u64>,
}

impl Profile {
    /// `paths[d]` for d in 0..=`MAX_RESULT_DEPTH`.
    pub fn paths(&self) -> &[u64] {
        &self.paths
    }

    /// `Σ paths[d]`, the bound `MAX_SCHEMA_EXPANSION` applies to.
    pub fn expansion(&self) -> u64 {
        self.paths.iter().fold(0, |a, p| a.saturating_add(*p))
    }

    /// Upper bound (in work units) of deciding whether `instance` is valid;
    /// `u64::MAX` if it is deeper than the profile covers.
    pub fn work(&self, instance: &Value) -> u64 {
        self.estimate(instance, &self.weight, &self.unique)
    }

    /// Upper bound of collecting `instance`'s validation errors.
    pub fn error_work(&self, instance: &Value) -> u64 {
        self.estimate(instance, &self.error_weight, &self.error_unique)
    }

    fn estimate(&self, instance: &Value, weight: &[u64], unique: &[u64]) -> u64 {
        let Some(cost) = instance_cost(instance) else {
            return u64::MAX;
        };
        // Deepest first, so `below` is what every node at depth d holds.
        let mut below = 0u64;
        let mut work = 0u64;
        for d in (0..DEPTHS).rev() {
            below = below.saturating_add(cost[d]);
            work = work
                .saturating_add(weight[d].saturating_mul(cost[d]))
                .saturating_add(
                    unique[d]
                        .saturating_mul(UNIQUE_ITEMS_FACTOR)
                        .saturating_mul(below),
                );
        }
        work
    }
}

/// Cost of the output's nodes at each depth (module doc), without
/// recursion; `None` if it is deeper than `MAX_RESULT_DEPTH`.
fn instance_cost(instance: &Value) -> Option<[u64; DEPTHS]> {
    let mut cost = [0u64; DEPTHS];
    let mut stack = vec![(instance, 0usize, 0usize)];
    while let Some((value, depth, key_bytes)) = stack.pop() {
        let slot = cost.get_mut(depth)?;
        let own = match value {
            Value::String(s) => s.len(),
            Value::Array(items) => {
                stack.extend(items.iter().map(|v| (v, depth + 1, 0)));
                items.len()
            }
            Value::Object(map) => {
                stack.extend(map.iter().map(|(k, v)| (v, depth + 1, k.len())));
                map.len() + map.keys().map(String::len).sum::<usize>()
            }
            _ => 0,
        };
        let own = u64::try_from(1 + key_bytes + own).unwrap_or(u64::MAX);
        *slot = slot.saturating_add(own);
    }
    Some(cost)
}

/// A schema compiled for validation, with its profile.
pub struct Compiled {
    validator: jsonschema::Validator,
    profile: Profile,
    /// What it is charged in the memo, in bytes (an over-estimate).
    charge: usize,
}

impl Compiled {
    pub fn validator(&self) -> &jsonschema::Validator {
        &self.validator
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }
}

/// Compiles and profiles a schema, or says why it cannot be used: more
/// than `MAX_SCHEMA_PATTERNS` patterns, one that does not compile within
/// the regex limits, remote references (never fetched), or a profile
/// refusal. Remembered by the SHA-256 of the schema's text, so a contract's
/// schema is compiled once, not at every judgment; a hit answers what
/// compiling would.
pub fn compile(schema: &Value) -> Result<Arc<Compiled>, String> {
    let (key, bytes) = fingerprint(schema);
    let memo = COMPILED.get_or_init(Default::default);
    if let Some(hit) = lock(memo).entries.get(&key) {
        return Ok(Arc::clone(hit));
    }
    let compiled = Arc::new(compile_uncached(schema, bytes)?);
    lock(memo).remember(
        key,
        Arc::clone(&compiled),
        MAX_COMPILED_SCHEMAS,
        MAX_COMPILED_SCHEMA_BYTES,
    );
    Ok(compiled)
}

fn compile_uncached(schema: &Value, bytes: usize) -> Result<Compiled, String> {
    let scan = Scan::of(schema);
    if scan.patterns.len() > MAX_SCHEMA_PATTERNS {
        return Err(format!(
            "has {} distinct patterns, at most MAX_SCHEMA_PATTERNS ({MAX_SCHEMA_PATTERNS})",
            scan.patterns.len()
        ));
    }
    // The profile first: it refuses what the validator library must not
    // even compile (a schema it would leak, one that would never end).
    let profile = profile_scanned(schema, &scan)?;
    let validator = build(&clocked(schema)).map_err(|e| {
        let regex = matches!(e.kind(), jsonschema::error::ValidationErrorKind::Format { format } if format == "regex");
        if regex {
            format!(
                "does not compile as a JSON Schema: {e} (patterns must be ECMA-262 without look-around or backreferences, and compile within REGEX_SIZE_LIMIT_BYTES ({REGEX_SIZE_LIMIT_BYTES}))"
            )
        } else {
            format!("does not compile as a JSON Schema: {e}")
        }
    })?;
    let patterns = scan.patterns.len();
    let charge = ENTRY_OVERHEAD_BYTES
        .saturating_add(bytes.saturating_mul(VALIDATOR_BYTES_PER_SCHEMA_BYTE))
        .saturating_add(
            patterns.saturating_mul(REGEX_SIZE_LIMIT_BYTES + REGEX_DFA_SIZE_LIMIT_BYTES),
        );
    Ok(Compiled {
        validator,
        profile,
        charge,
    })
}

/// The validator, offline (remote references fail) and with small regex
/// limits: a pattern whose automaton would pass `REGEX_SIZE_LIMIT_BYTES`
/// fails at once instead of taking seconds to build.
fn build(schema: &Value) -> Result<jsonschema::Validator, jsonschema::ValidationError<'static>> {
    jsonschema::options()
        .offline()
        .with_keyword(CLOCK_KEYWORD, |_, _, _| Ok(Box::new(Clock)))
        .with_format("regex", regex_format)
        .with_pattern_options(
            jsonschema::PatternOptions::regex()
                .size_limit(REGEX_SIZE_LIMIT_BYTES)
                .dfa_size_limit(REGEX_DFA_SIZE_LIMIT_BYTES),
        )
        .build(schema)
}

/// SHA-256 of the schema's text (as serialized: equal texts are equal
/// values) and its length.
fn fingerprint(schema: &Value) -> ([u8; 32], usize) {
    struct Hasher(Sha256, usize);
    impl std::io::Write for Hasher {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            self.1 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut hasher = Hasher(Sha256::new(), 0);
    // Writing to a hasher cannot fail, nor can serializing a `Value`.
    let _ = serde_json::to_writer(&mut hasher, schema);
    (hasher.0.finalize().into(), hasher.1)
}

/// Schemas that compiled and profiled, by `fingerprint`: compiling one
/// costs up to ~0.1 s, and a contract's completion is judged once or twice
/// more. A memo of a pure function holding only successes.
static COMPILED: OnceLock<Mutex<Memo>> = OnceLock::new();

#[derive(Default)]
struct Memo {
    entries: HashMap<[u8; 32], Arc<Compiled>>,
    /// Their charges, summed: the memo's bound.
    bytes: usize,
}

impl Memo {
    /// Adds an entry, forgetting everything first if it would pass either
    /// bound (refilling costs one compile per schema, as with no memo at
    /// all — so flooding it costs no more than not having it).
    fn remember(
        &mut self,
        key: [u8; 32],
        compiled: Arc<Compiled>,
        capacity: usize,
        capacity_bytes: usize,
    ) {
        let charge = compiled.charge;
        if charge > capacity_bytes || self.entries.contains_key(&key) {
            return;
        }
        if self.entries.len() >= capacity || self.bytes.saturating_add(charge) > capacity_bytes {
            self.entries.clear();
            self.bytes = 0;
        }
        self.entries.insert(key, compiled);
        self.bytes += charge;
    }
}

fn lock(memo: &Mutex<Memo>) -> MutexGuard<'_, Memo> {
    // Inserts are single calls: a poisoned memo is still a correct one.
    memo.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
