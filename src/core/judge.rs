//! Judgment of a completion (DESIGN.md §Lifecycle, Complete): the broker
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
//! Bounded evaluation. CEL has no loops or recursion, only comprehensions
//! over finite lists, so work is finite; it is kept *small* by a cost meter
//! woven into the syntax tree before evaluation: every read of `result` (or
//! of a comprehension variable) is charged the size of the value read (one
//! unit per node, plus string and bytes lengths), every comprehension is
//! charged, before it runs, the size of its range plus its length times its
//! body's size, and a `matches` call, which compiles its pattern,
//! `REGEX_CALL_COST` plus `REGEX_BYTE_COST` per pattern character. Every
//! standard CEL operation costs at most linear time in the values it is
//! given, and every value comes from a charged read, a literal, or such an
//! operation, so work and memory stay within a constant factor of the charge.
//! One judgment may charge `MAX_PREDICATE_COST` units; past that, the
//! conjunct being evaluated (and any after it) is refused. The syntax tree's
//! depth is bounded by `MAX_PREDICATE_AST_DEPTH` (the evaluator recurses),
//! its size by the predicate length limits, and the result by
//! `MAX_RESULT_BYTES` / `MAX_RESULT_DEPTH`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedEntryExpr, IdedExpr, ListExpr, LiteralValue,
    MapEntryExpr, MapExpr, SelectExpr, StructExpr, StructFieldExpr, operators,
};
use cel::common::types::{CelBytes, CelInt, CelList, CelMap, CelString};
use cel::common::value::{CowVal, Val};
use cel::objects::{Key, Map};
use cel::{Context, ExecutionError, FunctionContext, Program, Value};
use serde_json::Value as Json;

use super::error::InputError;
use super::limits::{
    MAX_CLAIM_BYTES, MAX_JUDGMENT_MS, MAX_OUT_OF_SCOPE_PATHS_REPORTED, MAX_PATTERNS_PER_JUDGMENT,
    MAX_PREDICATE_AST_DEPTH, MAX_PREDICATE_COST, MAX_REGEX_NFA_BYTES, MAX_RESULT_BYTES,
    MAX_RESULT_DEPTH, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_ERRORS_REPORTED,
    MAX_SCHEMA_VALIDATION_MS, MAX_SCHEMA_WORK, REGEX_BYTE_COST, REGEX_CALL_COST,
    REGEX_DFA_CACHE_BYTES, REGEX_STATES_PER_UNIT,
};
use super::scope::Scope;

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

/// The broker's verdict on a completion. The discriminant is the wire value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Verdict {
    /// Every conjunct of the effective predicate held.
    Accepted = 1,
    /// At least one conjunct was refused.
    Rejected = 2,
    /// No predicate: liability stayed with the principal, who adjudicates.
    PendingPrincipal = 3,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "ACCEPTED",
            Self::Rejected => "REJECTED",
            Self::PendingPrincipal => "PENDING_PRINCIPAL",
        }
    }

    pub fn as_i32(self) -> i32 {
        self as i32
    }

    pub fn from_i32(value: i32) -> Option<Self> {
        [Self::Accepted, Self::Rejected, Self::PendingPrincipal]
            .into_iter()
            .find(|v| v.as_i32() == value)
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

/// The output against its schema: valid, or why not. Never valid unchecked:
/// a schema that does not compile, or an output whose validation would cost
/// more than `MAX_SCHEMA_WORK` (`schema::Profile::work`), is not valid.
fn validate_output(schema: &Json, output: &Json) -> (bool, Vec<String>) {
    // A schema is compiled when the contract is issued (and remembered);
    // one that fails here anyway cannot vouch for the output.
    let compiled = match super::schema::compile(schema) {
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
    match super::schema::within(deadline, || compiled.validator().is_valid(output)) {
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
    let errors = super::schema::within(deadline, || {
        compiled
            .validator()
            .iter_errors(output)
            .take(MAX_SCHEMA_ERRORS_REPORTED)
            .map(|e| {
                let at = e.instance_path().to_string();
                let message = format!("{}: {e}", if at.is_empty() { "/" } else { &at });
                // Messages quote the output, which may be large.
                super::error::bounded(message, super::error::MAX_ERROR_REASON_BYTES)
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

fn result_value(completion: &Completion<'_>, observed: &Observed, facts: &Facts) -> Value {
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
fn json_to_cel(v: &Json) -> Value {
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

/// Evaluates each top-level conjunct; returns the refused ones in source
/// order.
fn evaluate(predicate: &str, result: &Value) -> Vec<RefusedCriterion> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(MAX_JUDGMENT_MS);
    evaluate_until(predicate, result, deadline)
}

/// `evaluate`, refusing whatever is still being evaluated at `deadline`.
fn evaluate_until(
    predicate: &str,
    result: &Value,
    deadline: std::time::Instant,
) -> Vec<RefusedCriterion> {
    let whole = |reason: String| {
        vec![RefusedCriterion {
            text: predicate.to_owned(),
            reason,
        }]
    };
    // Effective predicates were parsed at issuance; failing here means the
    // stored text was altered, and nothing can be accepted on it.
    let program = match Program::compile(predicate) {
        Ok(p) => p,
        Err(e) => return whole(format!("does not parse as CEL: {e}")),
    };
    let root = program.expression();
    let (depth, max_id) = depth_and_max_id(root);
    if depth > MAX_PREDICATE_AST_DEPTH {
        return whole(format!(
            "nested deeper than {MAX_PREDICATE_AST_DEPTH} levels"
        ));
    }
    let (conjuncts, and_offsets) = split_conjuncts(root, &program);
    let texts = conjunct_texts(predicate, &and_offsets, conjuncts.len());

    let meter = Arc::new(Meter {
        used: AtomicU64::new(0),
        limit: MAX_PREDICATE_COST,
        deadline,
        out_of_time: std::sync::atomic::AtomicBool::new(false),
        patterns: std::sync::Mutex::new(HashMap::new()),
    });
    let mut ctx = Context::default();
    ctx.add_variable_from_value("result", result.clone());
    let m = Arc::clone(&meter);
    let metered: MeterFn = Box::new(move |ftx: &mut FunctionContext| m.call(ftx));
    if let Err(e) = ctx.add_function::<MeterFn, _>(METER_FN, metered) {
        return whole(format!("cannot set up the evaluation: {e}"));
    }
    let m = Arc::clone(&meter);
    let matches: MeterFn = Box::new(move |ftx: &mut FunctionContext| m.matches(ftx));
    if let Err(e) = ctx.add_function::<MeterFn, _>(MATCHES_FN, matches) {
        return whole(format!("cannot set up the evaluation: {e}"));
    }

    let mut rewriter = Rewriter {
        next_id: max_id + 1,
        bound: vec!["result".to_owned()],
    };
    let mut refused = Vec::new();
    for (conjunct, text) in conjuncts.into_iter().zip(texts) {
        let metered = rewriter.rewrite(conjunct);
        let reason = match Value::resolve(&metered, &ctx) {
            Ok(Value::Bool(true)) => continue,
            Ok(Value::Bool(false)) => "evaluated to false".to_owned(),
            Ok(other) => format!("evaluated to {}, not a bool", other.type_of()),
            Err(_) if meter.out_of_time.load(Ordering::Relaxed) => {
                format!("evaluation time exceeds the limit of {MAX_JUDGMENT_MS} ms")
            }
            Err(_) if meter.exhausted() => {
                format!("evaluation cost exceeds the limit of {MAX_PREDICATE_COST} units")
            }
            Err(e) => e.to_string(),
        };
        refused.push(RefusedCriterion { text, reason });
    }
    refused
}

/// What issuance needs to know of a predicate to vouch that it can be
/// judged: its syntax tree's depth and how many top-level conjuncts the
/// judge will split it into.
pub(crate) struct Shape {
    pub depth: usize,
    pub conjuncts: usize,
}

/// Parses `text` as the judge does and measures it.
pub(crate) fn conjunct_shape(text: &str) -> Result<Shape, String> {
    let program = Program::compile(text).map_err(|e| format!("does not parse as CEL: {e}"))?;
    let root = program.expression();
    let (depth, _) = depth_and_max_id(root);
    let (conjuncts, _) = split_conjuncts(root, &program);
    Ok(Shape {
        depth,
        conjuncts: conjuncts.len(),
    })
}

/// The direct sub-expressions of `e`.
fn children(e: &Expr) -> Vec<&IdedExpr> {
    fn entry_exprs(entries: &[IdedEntryExpr]) -> Vec<&IdedExpr> {
        entries
            .iter()
            .flat_map(|en| match &en.expr {
                EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
                EntryExpr::StructField(f) => vec![&f.value],
            })
            .collect()
    }
    match e {
        Expr::Call(c) => c.target.iter().map(|t| &**t).chain(&c.args).collect(),
        Expr::Comprehension(c) => vec![
            &c.iter_range,
            &c.accu_init,
            &c.loop_cond,
            &c.loop_step,
            &c.result,
        ],
        Expr::List(l) => l.elements.iter().collect(),
        Expr::Map(m) => entry_exprs(&m.entries),
        Expr::Struct(s) => entry_exprs(&s.entries),
        Expr::Select(s) => vec![&*s.operand],
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => Vec::new(),
    }
}

/// Depth of the tree and its largest node id, without recursion.
fn depth_and_max_id(root: &IdedExpr) -> (usize, u64) {
    let (mut depth, mut max_id) = (0, 0);
    let mut stack = vec![(root, 1usize)];
    while let Some((e, d)) = stack.pop() {
        depth = depth.max(d);
        max_id = max_id.max(e.id);
        stack.extend(children(&e.expr).into_iter().map(|c| (c, d + 1)));
    }
    (depth, max_id)
}

fn is_and(e: &Expr) -> Option<&CallExpr> {
    match e {
        Expr::Call(c) if c.func_name == operators::LOGICAL_AND && c.target.is_none() => {
            (c.args.len() == 2).then_some(c)
        }
        _ => None,
    }
}

/// The top-level conjuncts, left to right (parentheses leave no node, so
/// walking `&&` walks through them), and the source offsets of the `&&`
/// operators that join them.
fn split_conjuncts<'e>(root: &'e IdedExpr, program: &Program) -> (Vec<&'e IdedExpr>, Vec<u32>) {
    let (mut conjuncts, mut offsets) = (Vec::new(), Vec::new());
    let mut stack = vec![root];
    while let Some(e) = stack.pop() {
        match is_and(&e.expr) {
            Some(call) => {
                if let Some((start, _)) = program.source_info().offset_for(e.id) {
                    offsets.push(start);
                }
                stack.push(&call.args[1]);
                stack.push(&call.args[0]);
            }
            None => conjuncts.push(e),
        }
    }
    offsets.sort_unstable();
    (conjuncts, offsets)
}

/// Each conjunct's source text: the text between the `&&` operators that
/// separate it from its neighbours, without the parentheses around it.
/// Falls back to a positional name if the offsets do not point at `&&`.
fn conjunct_texts(source: &str, and_offsets: &[u32], count: usize) -> Vec<String> {
    let ops: Option<Vec<usize>> = and_offsets
        .iter()
        .map(|&o| {
            let o = o as usize;
            (source.get(o..o + 2) == Some("&&")).then_some(o)
        })
        .collect();
    match ops {
        Some(ops) if ops.len() + 1 == count => {
            let mut bounds = vec![0];
            for o in &ops {
                bounds.push(*o);
                bounds.push(o + 2);
            }
            bounds.push(source.len());
            bounds
                .chunks(2)
                .map(|b| strip_parens(&source[b[0]..b[1]]).to_owned())
                .collect()
        }
        _ => (1..=count)
            .map(|i| format!("conjunct {i} of {count}"))
            .collect(),
    }
}

/// Removes whitespace, unmatched parentheses at the ends (left over from
/// splitting `(a && b) && c` at its operators) and parentheses that enclose
/// the whole text.
fn strip_parens(text: &str) -> &str {
    let mut s = text.trim();
    loop {
        let pairs = match_parens(s);
        let last = s.len().wrapping_sub(1);
        let next = if s.starts_with('(') && pairs.first_open.is_none_or(|close| close == last) {
            let inner = &s[1..];
            if pairs.first_open == Some(last) {
                &inner[..inner.len() - 1]
            } else {
                inner
            }
        } else if s.ends_with(')') && pairs.last_close_unmatched {
            &s[..last]
        } else {
            return s;
        };
        s = next.trim();
    }
}

struct Parens {
    /// Where the parenthesis opening at byte 0 closes, if it does.
    first_open: Option<usize>,
    /// The final `)` closes nothing within the text.
    last_close_unmatched: bool,
}

/// Matches parentheses outside CEL string literals and comments.
fn match_parens(s: &str) -> Parens {
    let mut stack: Vec<usize> = Vec::new();
    let mut result = Parens {
        first_open: None,
        last_close_unmatched: false,
    };
    for (i, c) in super::predicate::code_bytes(s) {
        match c {
            b'(' => stack.push(i),
            b')' => match stack.pop() {
                Some(0) => result.first_open = Some(i),
                Some(_) => {}
                None => result.last_close_unmatched = i + 1 == s.len(),
            },
            _ => {}
        }
    }
    result
}

/// The metering function's name: `@` cannot start a CEL identifier, so a
/// predicate cannot call it itself.
const METER_FN: &str = "@judge_meter";

type MeterFn = Box<
    dyn for<'c, 'v> Fn(&mut FunctionContext<'c, 'v>) -> Result<CowVal<'c, 'v>, ExecutionError>
        + Send
        + Sync,
>;

/// `matches`, rewritten to this bounded implementation (see
/// `Meter::matches`); `@` keeps predicates from calling it by name.
const MATCHES_FN: &str = "@judge_matches";

/// A compiled `matches` pattern and its NFA's state count.
type Pattern = Arc<(regex_automata::meta::Regex, u64)>;

/// The shared evaluation budget of one judgment.
struct Meter {
    used: AtomicU64,
    limit: u64,
    /// Past this instant every charge fails: a judgment's wall time is
    /// capped whatever its cost accounting says.
    deadline: std::time::Instant,
    out_of_time: std::sync::atomic::AtomicBool,
    /// Patterns compiled during this judgment (each call is still charged).
    patterns: std::sync::Mutex<HashMap<String, Pattern>>,
}

impl Meter {
    fn exhausted(&self) -> bool {
        self.used.load(Ordering::Relaxed) > self.limit
    }

    /// `@judge_meter(value, weight, fixed)`: charges `fixed + size(value) +
    /// len(value) * weight` and hands `value` back untouched.
    fn call<'c, 'v>(
        &self,
        ftx: &mut FunctionContext<'c, 'v>,
    ) -> Result<CowVal<'c, 'v>, ExecutionError> {
        let int = |i: usize| {
            ftx.args
                .get(i)
                .and_then(|w| w.downcast_ref::<CelInt>())
                .map_or(0, |w| (*w.inner()).max(0).unsigned_abs())
        };
        let (weight, fixed) = (int(1), int(2));
        let value = ftx
            .args
            .drain(..)
            .next()
            .ok_or(ExecutionError::MissingArgumentOrTarget)?;
        self.charge(value.as_ref(), weight, fixed)?;
        Ok(value)
    }

    /// `@judge_matches(text, pattern)`: CEL's `matches`, bounded. The
    /// pattern compiles within `MAX_REGEX_NFA_BYTES` (a counted repetition
    /// like `a[ab]{10000}` does not), and the call is charged before it runs
    /// for compiling (`REGEX_CALL_COST` + `REGEX_BYTE_COST` per pattern
    /// byte) and for matching at the engine's worst case, linear in the
    /// text times the NFA's states (`REGEX_STATES_PER_UNIT` states per unit
    /// per byte): a match that could run long is refused, never run.
    fn matches<'c, 'v>(
        &self,
        ftx: &mut FunctionContext<'c, 'v>,
    ) -> Result<CowVal<'c, 'v>, ExecutionError> {
        let string = |i: usize| {
            ftx.args
                .get(i)
                .and_then(|v| v.downcast_ref::<CelString>())
                .map(|s| s.inner().to_owned())
        };
        let (Some(text), Some(pattern)) = (string(0), string(1)) else {
            return Err(ExecutionError::function_error(
                "matches",
                "takes a string and a string pattern",
            ));
        };
        let compile_cost = REGEX_CALL_COST
            .unsigned_abs()
            .saturating_add((pattern.len() as u64).saturating_mul(REGEX_BYTE_COST.unsigned_abs()));
        self.charge_units(compile_cost)?;
        let compiled = self.pattern(&pattern)?;
        let per_byte = (compiled.1 / REGEX_STATES_PER_UNIT).max(1);
        self.charge_units((text.len() as u64 + 1).saturating_mul(per_byte))?;
        let found = compiled.0.is_match(text.as_str());
        Ok(CowVal::owned(cel::common::types::CelBool::from(found)))
    }

    fn pattern(&self, pattern: &str) -> Result<Pattern, ExecutionError> {
        let mut memo = self
            .patterns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = memo.get(pattern) {
            return Ok(p.clone());
        }
        // Each compiled pattern may hold up to MAX_REGEX_NFA_BYTES and its
        // cache: a judgment keeps only a few.
        if memo.len() >= MAX_PATTERNS_PER_JUDGMENT {
            return Err(ExecutionError::function_error(
                "matches",
                format!("more than {MAX_PATTERNS_PER_JUDGMENT} distinct patterns in one judgment"),
            ));
        }
        let too_big = |e: &dyn std::fmt::Display| {
            ExecutionError::function_error(
                "matches",
                super::error::bounded(
                    format!("the pattern does not compile within {MAX_REGEX_NFA_BYTES} bytes: {e}"),
                    256,
                ),
            )
        };
        use regex_automata::nfa::thompson;
        let nfa = thompson::Compiler::new()
            .configure(thompson::Config::new().nfa_size_limit(Some(MAX_REGEX_NFA_BYTES)))
            .build(pattern)
            .map_err(|e| too_big(&e))?;
        let regex = regex_automata::meta::Regex::builder()
            .configure(
                regex_automata::meta::Config::new()
                    .nfa_size_limit(Some(MAX_REGEX_NFA_BYTES))
                    .hybrid_cache_capacity(REGEX_DFA_CACHE_BYTES),
            )
            .build(pattern)
            .map_err(|e| too_big(&e))?;
        let compiled: Pattern = Arc::new((regex, nfa.states().len() as u64));
        memo.insert(pattern.to_owned(), compiled.clone());
        Ok(compiled)
    }

    /// Charges `cost` units with no value to measure.
    fn charge_units(&self, cost: u64) -> Result<(), ExecutionError> {
        self.charge(&cel::common::types::CelNull, 0, cost.saturating_sub(1))
    }

    fn charge(&self, value: &dyn Val, weight: u64, fixed: u64) -> Result<(), ExecutionError> {
        if std::time::Instant::now() >= self.deadline {
            self.out_of_time.store(true, Ordering::Relaxed);
            self.used.store(self.limit + 1, Ordering::Relaxed);
            return Err(ExecutionError::function_error(
                "time",
                "evaluation time exhausted",
            ));
        }
        let used = self.used.load(Ordering::Relaxed);
        let left = self.limit.saturating_sub(used);
        let exhausted = || {
            self.used.store(self.limit + 1, Ordering::Relaxed);
            ExecutionError::function_error("cost", "evaluation budget exhausted")
        };
        let size = deep_size(value, left).ok_or_else(exhausted)?;
        let len = value
            .as_sizer()
            .map_or(1, |s| (*s.size().inner()).max(0).unsigned_abs());
        let cost = size
            .saturating_add(len.saturating_mul(weight))
            .saturating_add(fixed);
        if cost > left {
            return Err(exhausted());
        }
        self.used.store(used + cost, Ordering::Relaxed);
        Ok(())
    }
}

/// Nodes in `value` plus its string and bytes lengths; `None` as soon as
/// that exceeds `cap`, so measuring never costs more than the budget left.
fn deep_size(value: &dyn Val, cap: u64) -> Option<u64> {
    let mut total = 0u64;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        total += 1;
        if let Some(s) = v.downcast_ref::<CelString>() {
            total += s.inner().len() as u64;
        } else if let Some(b) = v.downcast_ref::<CelBytes>() {
            total += b.inner().len() as u64;
        } else if let Some(l) = v.downcast_ref::<CelList>() {
            stack.extend(l.inner().iter().map(|i| &**i));
        } else if let Some(m) = v.downcast_ref::<CelMap>() {
            for (_, item) in m.inner().iter() {
                total += 1;
                stack.push(&**item);
            }
        }
        if total > cap {
            return None;
        }
    }
    Some(total)
}

/// Rewrites a conjunct so that evaluating it charges the meter (see the
/// module docs). Keeps the shapes the evaluator recognises in
/// comprehensions (`@result + [e]`, `@result && e`), so macros keep their
/// semantics and their linear-time evaluation.
struct Rewriter {
    next_id: u64,
    /// Names bound to data: `result` and the comprehension variables in
    /// scope. Accumulators (`@result`) are never charged: they hold a bool
    /// or an int, or are appended to in place.
    bound: Vec<String>,
}

impl Rewriter {
    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn meter(&mut self, e: IdedExpr, weight: i64, fixed: i64) -> IdedExpr {
        let mut int = |v: i64| IdedExpr {
            id: self.fresh(),
            expr: Expr::Literal(LiteralValue::Int(CelInt::from(v))),
        };
        let args = vec![e, int(weight), int(fixed)];
        IdedExpr {
            id: self.fresh(),
            expr: Expr::Call(CallExpr {
                func_name: METER_FN.to_owned(),
                target: None,
                args,
            }),
        }
    }

    /// An identifier bound to data, or field selections on one.
    fn is_bound_path(&self, e: &Expr) -> bool {
        match e {
            Expr::Ident(name) => self.bound.iter().any(|b| b == name),
            Expr::Select(s) if !s.test => self.is_bound_path(&s.operand.expr),
            _ => false,
        }
    }

    fn rewrite(&mut self, e: &IdedExpr) -> IdedExpr {
        if self.is_bound_path(&e.expr) {
            return self.meter(e.clone(), 0, 0);
        }
        let expr = match &e.expr {
            Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => e.expr.clone(),
            // A presence test on a name, or a select on an unbound name
            // (a namespace or an undeclared reference), reads nothing big.
            Expr::Select(s) if is_name(&s.operand.expr) => e.expr.clone(),
            Expr::Select(s) => Expr::Select(SelectExpr {
                operand: Box::new(self.rewrite(&s.operand)),
                field: s.field.clone(),
                test: s.test,
            }),
            Expr::Call(c) => Expr::Call(self.rewrite_call(c)),
            Expr::List(l) => Expr::List(ListExpr {
                elements: l.elements.iter().map(|x| self.rewrite(x)).collect(),
                optional_indices: l.optional_indices.clone(),
            }),
            Expr::Map(m) => Expr::Map(MapExpr {
                entries: self.rewrite_entries(&m.entries),
            }),
            Expr::Struct(s) => Expr::Struct(StructExpr {
                type_name: s.type_name.clone(),
                entries: self.rewrite_entries(&s.entries),
            }),
            Expr::Comprehension(c) => Expr::Comprehension(Box::new(self.rewrite_comprehension(c))),
        };
        IdedExpr { id: e.id, expr }
    }

    fn rewrite_call(&mut self, c: &CallExpr) -> CallExpr {
        // `size` is constant-time: its operand is not read.
        let reads =
            |this: &Self, x: &IdedExpr| c.func_name != "size" || !this.is_bound_path(&x.expr);
        let target = c.target.as_ref().map(|t| {
            // A target that spells an unbound name may be a namespace
            // (`math.greatest(...)`): left as written.
            let keep = (is_name(&t.expr) && !self.is_bound_path(&t.expr)) || !reads(self, t);
            Box::new(if keep { (**t).clone() } else { self.rewrite(t) })
        });
        let args: Vec<IdedExpr> = c
            .args
            .iter()
            .map(|a| {
                if reads(self, a) {
                    self.rewrite(a)
                } else {
                    a.clone()
                }
            })
            .collect();
        // `text.matches(p)` and `matches(text, p)` both become the bounded
        // `@judge_matches(text, p)`, which charges for itself.
        // `.matches(...)` (a leading dot: the root namespace) resolves to
        // the same built-in, unmetered: both spellings are rewritten.
        if c.func_name.trim_start_matches('.') == "matches" {
            let mut all: Vec<IdedExpr> = target.map(|t| *t).into_iter().collect();
            all.extend(args);
            return CallExpr {
                func_name: MATCHES_FN.to_owned(),
                target: None,
                args: all,
            };
        }
        CallExpr {
            func_name: c.func_name.clone(),
            target,
            args,
        }
    }

    fn rewrite_entries(&mut self, entries: &[IdedEntryExpr]) -> Vec<IdedEntryExpr> {
        entries
            .iter()
            .map(|en| IdedEntryExpr {
                id: en.id,
                expr: match &en.expr {
                    EntryExpr::MapEntry(m) => EntryExpr::MapEntry(MapEntryExpr {
                        key: self.rewrite(&m.key),
                        value: self.rewrite(&m.value),
                        optional: m.optional,
                    }),
                    EntryExpr::StructField(f) => EntryExpr::StructField(StructFieldExpr {
                        field: f.field.clone(),
                        value: self.rewrite(&f.value),
                        optional: f.optional,
                    }),
                },
            })
            .collect()
    }

    fn rewrite_comprehension(&mut self, c: &ComprehensionExpr) -> ComprehensionExpr {
        let body = 1 + weight(&c.loop_cond) + weight(&c.loop_step);
        let body = i64::try_from(body).unwrap_or(i64::MAX);
        // One charge covers the range's size and every iteration's body.
        let range = if self.is_bound_path(&c.iter_range.expr) {
            c.iter_range.clone()
        } else {
            self.rewrite(&c.iter_range)
        };
        let iter_range = self.meter(range, body, 0);
        let accu_init = self.rewrite(&c.accu_init);
        let scope = self.bound.len();
        self.bound.push(c.iter_var.clone());
        self.bound.extend(c.iter_var2.iter().cloned());
        let loop_cond = self.rewrite(&c.loop_cond);
        let loop_step = self.rewrite(&c.loop_step);
        let result = self.rewrite(&c.result);
        self.bound.truncate(scope);
        ComprehensionExpr {
            iter_range,
            iter_var: c.iter_var.clone(),
            iter_var2: c.iter_var2.clone(),
            accu_var: c.accu_var.clone(),
            accu_init,
            loop_cond,
            loop_step,
            result,
        }
    }
}

/// An identifier, or field selections on one.
fn is_name(e: &Expr) -> bool {
    match e {
        Expr::Ident(_) => true,
        Expr::Select(s) if !s.test => is_name(&s.operand.expr),
        _ => false,
    }
}

/// Work of evaluating `e` once, apart from the values it reads: its nodes
/// plus the bytes of its string and bytes literals.
fn weight(e: &IdedExpr) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![e];
    while let Some(x) = stack.pop() {
        total += 1;
        match &x.expr {
            Expr::Literal(LiteralValue::String(s)) => total += s.inner().len() as u64,
            Expr::Literal(LiteralValue::Bytes(b)) => total += b.inner().len() as u64,
            other => stack.extend(children(other)),
        }
    }
    total
}

#[cfg(test)]
#[path = "judge_tests.rs"]
mod tests;
