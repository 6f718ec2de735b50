//! Bounded evaluation of each conjunct: the cost meter woven into the
//! syntax tree, and the bounded `matches`.
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
    MapEntryExpr, MapExpr, SelectExpr, StructExpr, StructFieldExpr,
};
use cel::common::types::{CelBytes, CelInt, CelList, CelMap, CelString};
use cel::common::value::{CowVal, Val};
use cel::{Context, ExecutionError, FunctionContext, Program, Value};

use super::RefusedCriterion;
use super::conjuncts::{children, conjunct_texts, depth_and_max_id, split_conjuncts};
use crate::limits::{
    MAX_JUDGMENT_MS, MAX_PATTERNS_PER_JUDGMENT, MAX_PREDICATE_AST_DEPTH, MAX_PREDICATE_COST,
    MAX_REGEX_NFA_BYTES, REGEX_BYTE_COST, REGEX_CALL_COST, REGEX_DFA_CACHE_BYTES,
    REGEX_STATES_PER_UNIT,
};

/// CEL's standard functions and types, registered once: registering them
/// (what `Context::default` does) cost more than judging a typical
/// predicate (`cargo bench --bench hot_path`, "judge a completion").
static STDLIB: std::sync::LazyLock<Arc<cel::Env>> =
    std::sync::LazyLock::new(|| Arc::new(cel::Env::stdlib()));

/// Evaluates each top-level conjunct; returns the refused ones in source
/// order.
pub(super) fn evaluate(predicate: &str, result: &Value) -> Vec<RefusedCriterion> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(MAX_JUDGMENT_MS);
    evaluate_until(predicate, result, deadline)
}

/// `evaluate`, refusing whatever is still being evaluated at `deadline`.
pub(super) fn evaluate_until(
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
    let mut ctx = Context::with_env(Arc::clone(&STDLIB));
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
                crate::error::bounded(
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
