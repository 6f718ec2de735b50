//! Unit and property tests of `core::judge`.

use super::conjuncts::strip_parens;
use super::evaluate::evaluate_until;
use super::result::json_to_cel;
use super::*;
use crate::limits::MAX_SCHEMA_WORK;
use serde_json::json;

const SEED_001: &str = "(result.schema_valid && result.within_scope)";

fn scope(p: &[&str]) -> Scope {
    Scope::parse(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "s").unwrap()
}

fn schema() -> Json {
    json!({
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": {"type": "string"}}}
    })
}

fn observed(mutation: &str) -> Observed {
    Observed {
        tool_calls: 4,
        mutation_paths: vec![mutation.to_owned()],
        consumed_by_host: None,
        elapsed_ms: 1_200,
    }
}

/// A completion of `output` against `schema`, reporting 18 units.
fn reported(output: Json, schema: &Json) -> Completion<'_> {
    Completion {
        output,
        claim: "success".into(),
        reported_consumed: 18,
        has_report: true,
        schema: Some(schema),
    }
}

fn run(predicate: &str, output: Json, mutation: &str) -> Judgment {
    let schema = schema();
    let completion = reported(output, &schema);
    judge(
        predicate,
        &scope(&["src/exec"]),
        &completion,
        &observed(mutation),
    )
}

/// A completion of `output` with no report and no schema.
fn unreported<'a>(output: Json) -> Completion<'a> {
    Completion {
        output,
        claim: "success".into(),
        reported_consumed: 1,
        has_report: false,
        schema: None,
    }
}

/// `j` found its output invalid, first at `pointer`.
fn assert_invalid_at(j: &Judgment, pointer: &str) {
    assert!(!j.schema_valid);
    assert!(
        j.schema_errors[0].starts_with(pointer),
        "{:?}",
        j.schema_errors
    );
}

fn good() -> Json {
    json!({"items": ["a", "b"], "score": 0.9})
}

fn texts(j: &Judgment) -> Vec<&str> {
    j.refused.iter().map(|r| r.text.as_str()).collect()
}

#[test]
fn seed_001_mutation_outside_the_scope_is_rejected_on_within_scope_alone() {
    let j = run(SEED_001, good(), "docs/x.md");
    assert_eq!(j.verdict, Verdict::Rejected);
    assert_eq!(texts(&j), vec!["result.within_scope"]);
    assert_eq!(j.refused[0].reason, "evaluated to false");
    assert_eq!(j.consumed, 18);
    assert!(j.schema_valid && !j.within_scope);
    assert_eq!(j.out_of_scope_paths, vec!["docs/x.md"]);
}

#[test]
fn out_of_scope_paths_are_distinct_sorted_bounded_and_counted() {
    let schema = schema();
    let completion = reported(good(), &schema);
    let distinct = MAX_OUT_OF_SCOPE_PATHS_REPORTED + 36;
    let mut paths: Vec<String> = (0..distinct)
        .rev()
        .map(|i| format!("docs/{i:04}.md"))
        .collect();
    // Each observed twice, and one inside the scope.
    paths.extend(paths.clone());
    paths.push("src/exec/a.rs".to_owned());
    let observed = Observed {
        mutation_paths: paths,
        ..observed("src/exec/b.rs")
    };
    let j = judge(SEED_001, &scope(&["src/exec"]), &completion, &observed);
    assert!(!j.within_scope);
    assert_eq!(j.out_of_scope_path_count as usize, distinct);
    assert_eq!(j.out_of_scope_paths.len(), MAX_OUT_OF_SCOPE_PATHS_REPORTED);
    assert_eq!(j.out_of_scope_paths[0], "docs/0000.md");
    assert!(j.out_of_scope_paths.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn seed_001_mutation_inside_the_scope_is_accepted() {
    let j = run(SEED_001, good(), "src/exec/a.rs");
    assert_eq!(j.verdict, Verdict::Accepted);
    assert!(j.refused.is_empty() && j.within_scope && j.out_of_scope_paths.is_empty());
    // The predicate evaluates exactly as written, unsplit, too.
    let whole = "result.schema_valid && result.within_scope";
    assert_eq!(
        run(whole, good(), "src/exec/a.rs").verdict,
        Verdict::Accepted
    );
}

#[test]
fn a_schema_mismatch_refuses_schema_valid() {
    let j = run(SEED_001, json!({"items": [1]}), "src/exec/a.rs");
    assert_eq!(j.verdict, Verdict::Rejected);
    assert_eq!(texts(&j), vec!["result.schema_valid"]);
    assert_invalid_at(&j, "/items/0");
}

#[test]
fn no_predicate_leaves_the_verdict_to_the_principal() {
    for p in ["", "  "] {
        let j = run(p, json!({"items": [1]}), "docs/x.md");
        assert_eq!(j.verdict, Verdict::PendingPrincipal);
        assert!(j.refused.is_empty());
        // The facts are still recorded for the principal.
        assert!(!j.schema_valid && !j.within_scope);
    }
}

#[test]
fn a_conjunct_that_errors_is_refused_with_the_error() {
    let j = run(
        "(result.schema_valid) && (result.nope > 1) && (result.claimed + 1 == 2)",
        good(),
        "src/exec/a.rs",
    );
    assert_eq!(j.verdict, Verdict::Rejected);
    assert_eq!(
        texts(&j),
        vec!["result.nope > 1", "result.claimed + 1 == 2"]
    );
    assert!(
        j.refused[0].reason.contains("nope"),
        "{}",
        j.refused[0].reason
    );
    let j = run("result.consumed", good(), "src/exec/a.rs");
    assert_eq!(j.refused[0].reason, "evaluated to int, not a bool");
}

#[test]
fn flat_conjunctions_split_through_parentheses() {
    let p = "(result.schema_valid && result.within_scope) && (result.tool_calls < 3)";
    let j = run(p, json!({"items": [7]}), "docs/x.md");
    assert_eq!(
        texts(&j),
        vec![
            "result.schema_valid",
            "result.within_scope",
            "result.tool_calls < 3"
        ]
    );
    // A disjunction is one criterion; nested parentheses and strings
    // with parentheses keep their text.
    let p = "((result.claimed == \")(\" || result.mutations > 5)) && ((result.elapsed_ms < 10))";
    let j = run(p, good(), "src/exec/a.rs");
    assert_eq!(
        texts(&j),
        vec![
            "result.claimed == \")(\" || result.mutations > 5",
            "result.elapsed_ms < 10"
        ]
    );
}

#[test]
fn the_output_is_a_cel_value() {
    for p in [
        "result.output.items.size() > 0",
        "size(result.output.items) == 2 && result.output.items[0] == 'a'",
        "result.output.score > 0.5 && 'score' in result.output",
        "result.output.items.all(i, i.matches('^[a-z]$'))",
        "result.output.items.map(i, i + '!').exists(i, i == 'b!')",
        "has(result.output.items) && !has(result.output.missing)",
        "result.claimed == 'success' && result.has_report",
        "result.consumed == 18 && result.tool_calls == 4 && result.mutations == 1",
        "result.elapsed_ms == 1200",
    ] {
        let j = run(p, good(), "src/exec/a.rs");
        assert_eq!(j.verdict, Verdict::Accepted, "{p}: {:?}", j.refused);
    }
    let j = run("result.output.items.size() > 5", good(), "src/exec/a.rs");
    assert_eq!(j.verdict, Verdict::Rejected);
}

#[test]
fn host_metering_overrides_the_report() {
    let completion = Completion {
        reported_consumed: 3,
        ..unreported(json!({}))
    };
    let mut o = observed("src/exec/a.rs");
    o.consumed_by_host = Some(21);
    let j = judge("result.consumed <= 20", &scope(&["src"]), &completion, &o);
    assert_eq!(j.consumed, 21);
    assert_eq!(j.verdict, Verdict::Rejected);
    assert!(j.schema_valid, "no schema means schema_valid");
}

#[test]
fn evaluation_is_bounded_by_the_cost_meter() {
    let items: Vec<u32> = (0..2_000).collect();
    let output = json!({ "items": items });
    // Quadratic in the output: 2000 x 2000 reads of the list.
    let p = "(result.output.items.all(x, x in result.output.items)) && (result.schema_valid)";
    let completion = unreported(output);
    let o = Observed::default();
    let started = std::time::Instant::now();
    let j = judge(p, &scope(&["src"]), &completion, &o);
    assert_eq!(j.verdict, Verdict::Rejected);
    assert_eq!(j.refused.len(), 2, "{:?}", j.refused);
    assert!(
        j.refused[0].reason.contains("cost"),
        "{}",
        j.refused[0].reason
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // Nested comprehensions are charged per inner iteration.
    let p = "result.output.items.all(x, result.output.items.all(y, x >= 0))";
    let j = judge(p, &scope(&["src"]), &completion, &o);
    assert!(j.refused[0].reason.contains("cost"), "{:?}", j.refused);
    // The same shape on a small output fits.
    let small = Completion {
        output: json!({"items": [1, 2, 3]}),
        ..completion
    };
    assert_eq!(
        judge(p, &scope(&["src"]), &small, &o).verdict,
        Verdict::Accepted
    );
}

/// `matches` with a short counted pattern over a
/// 255 KB output ran 23 s inside the cost budget.
#[test]
fn matches_is_bounded_by_pattern_size_and_charged_for_matching() {
    let completion = |text: String| unreported(json!({ "text": text }));
    let o = Observed::default();
    let big = completion("ab".repeat(127 * 1024));
    let started = std::time::Instant::now();
    for p in [
        "result.output.text.matches('a[ab]{10000}[^ab]')",
        "matches(result.output.text, 'a[ab]{10000}[^ab]')",
        // The root-namespace spelling reaches the same built-in.
        ".matches(result.output.text, 'a[ab]{10000}[^ab]')",
        "[result.output.text].all(t, .matches(t, 'a[ab]{10000}[^ab]'))",
        "result.output.text.matches('a[ab]{500}[^ab]')",
    ] {
        let j = judge(p, &Scope::default(), &big, &o);
        assert_eq!(j.verdict, Verdict::Rejected, "{p}");
        let reason = &j.refused[0].reason;
        assert!(
            reason.contains("does not compile within") || reason.contains("cost"),
            "{p}: {reason}"
        );
    }
    // Refused before matching: far from the 23 s it took (a generous
    // bound, not a benchmark).
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // Honest patterns work, in both spellings, on large text too.
    let text = completion("item-42".into());
    for p in [
        "result.output.text.matches('^item-[0-9]+$')",
        "matches(result.output.text, '[0-9]{2}')",
        "!result.output.text.matches('^x')",
    ] {
        let j = judge(p, &Scope::default(), &text, &o);
        assert_eq!(j.verdict, Verdict::Accepted, "{p}: {:?}", j.refused);
    }
    let j = judge(
        "result.output.text.matches('b$')",
        &Scope::default(),
        &big,
        &o,
    );
    assert_eq!(j.verdict, Verdict::Accepted, "{:?}", j.refused);
    // Past the wall-time cap every conjunct still to evaluate is refused.
    let late = evaluate_until(
        "result.a == 1 && result.b == 2",
        &json_to_cel(&json!({"a": 1, "b": 2})),
        std::time::Instant::now(),
    );
    assert_eq!(late.len(), 2, "{late:?}");
    assert!(late[0].reason.contains("time"), "{late:?}");
    // Distinct patterns per judgment are capped.
    let many = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]\
                .all(i, !result.output.text.matches('x{' + string(i + 1) + '}'))";
    let j = judge(many, &Scope::default(), &text, &o);
    assert_eq!(j.verdict, Verdict::Rejected);
    assert!(
        j.refused[0].reason.contains("distinct patterns"),
        "{:?}",
        j.refused
    );
    // A pattern that is not a regex is a refused criterion, not a panic.
    let j = judge(
        "result.output.text.matches('(')",
        &Scope::default(),
        &text,
        &o,
    );
    assert_eq!(j.verdict, Verdict::Rejected);
}

#[test]
fn linear_predicates_over_a_large_output_fit_the_budget() {
    let items: Vec<Json> = (0..2_000)
        .map(|i| json!({"name": format!("item-{i}"), "score": 0.5 + f64::from(i % 7) / 100.0}))
        .collect();
    let completion = unreported(json!({ "items": items }));
    let p = "(result.output.items.all(i, i.score >= 0.5 && size(i.name) > 4)) \
             && (result.output.items.map(i, i.score).size() == 2000) \
             && (result.output.items.filter(i, i.name.startsWith('item-1')).size() == 1111)";
    let j = judge(p, &Scope::default(), &completion, &Observed::default());
    assert_eq!(j.verdict, Verdict::Accepted, "{:?}", j.refused);
}

#[test]
fn completion_inputs_are_bounded() {
    assert!(check_output(&good(), "o").is_ok());
    let big = json!({ "s": "x".repeat(MAX_RESULT_BYTES) });
    assert_eq!(
        check_output(&big, "body.output").unwrap_err().field,
        "body.output"
    );
    let mut deep = json!(1);
    for _ in 0..MAX_RESULT_DEPTH {
        deep = json!([deep]);
    }
    assert!(check_output(&deep, "o").is_err());
    assert!(check_claim(&"x".repeat(MAX_CLAIM_BYTES + 1), "c").is_err());
    // An oversized output is refused, not evaluated.
    let j = run(SEED_001, big, "src/exec/a.rs");
    assert_eq!(j.verdict, Verdict::Rejected);
}

#[test]
fn schemas_must_compile_offline() {
    assert!(compile_schema(&schema(), "body.schema").is_ok());
    let bad = json!({"type": "no-such-type"});
    assert_eq!(
        compile_schema(&bad, "body.schema").unwrap_err().field,
        "body.schema"
    );
    let remote = json!({"$ref": "https://example.com/s.json"});
    assert!(compile_schema(&remote, "body.schema").is_err());
    let lookaround = json!({"type": "string", "pattern": "a(?=b)"});
    assert!(compile_schema(&lookaround, "body.schema").is_err());
    let huge = json!({"description": "x".repeat(MAX_SCHEMA_BYTES)});
    assert!(compile_schema(&huge, "body.schema").is_err());
    // A pattern that would take seconds to build, a reference
    // cycle, and a chain of anyOf that doubles per level.
    let regex = json!({"type": "string", "pattern": "[\\p{L}\\p{N}]{50}N"});
    let err = compile_schema(&regex, "body.schema").unwrap_err();
    assert!(err.reason.contains("REGEX_SIZE_LIMIT_BYTES"), "{err}");
    let cycle = compile_schema(&json!({"$ref": "#"}), "body.schema").unwrap_err();
    assert!(cycle.reason.contains("cycle"), "{cycle}");
    let mut defs = serde_json::Map::new();
    for i in 0..40 {
        let next = format!("#/$defs/{}", i + 1);
        defs.insert(
            i.to_string(),
            json!({"anyOf": [{"$ref": next}, {"$ref": next}]}),
        );
    }
    defs.insert("40".into(), json!({"type": "string"}));
    let chain = json!({"not": {"$ref": "#/$defs/0"}, "$defs": defs});
    let err = compile_schema(&chain, "body.schema").unwrap_err();
    assert_eq!(err.field, "body.schema");
    assert!(err.reason.contains("MAX_SCHEMA_EXPANSION"), "{err}");
}

fn judged(schema: &Json, output: Json) -> Judgment {
    let completion = Completion {
        schema: Some(schema),
        ..unreported(output)
    };
    judge(
        SEED_001,
        &Scope::default(),
        &completion,
        &Observed::default(),
    )
}

#[test]
fn an_output_past_the_schema_work_budget_is_not_validated_and_not_valid() {
    // 200 schema nodes apply to every element.
    let branches: Vec<Json> = (0..200)
        .map(|i| json!({"type": "string", "minLength": i % 2}))
        .collect();
    let schema = json!({"type": "array", "items": {"allOf": branches}});
    compile_schema(&schema, "s").unwrap();
    let profile = super::super::schema::profile(&schema).unwrap();
    let large = json!(vec!["an ordinary string"; 10_000]);
    assert!(check_output(&large, "o").is_ok());
    assert!(profile.work(&large) > MAX_SCHEMA_WORK);
    let j = judged(&schema, large);
    assert!(!j.schema_valid, "never valid unchecked");
    assert_eq!(j.schema_errors.len(), 1, "{:?}", j.schema_errors);
    assert!(
        j.schema_errors[0].contains("MAX_SCHEMA_WORK"),
        "{:?}",
        j.schema_errors
    );
    assert_eq!(texts(&j), vec!["result.schema_valid"]);
    // Within the budget it is validated, either way.
    let small = json!(vec!["an ordinary string"; 10]);
    assert!(profile.work(&small) <= MAX_SCHEMA_WORK);
    let j = judged(&schema, small);
    assert!(
        j.schema_valid && j.schema_errors.is_empty(),
        "{:?}",
        j.schema_errors
    );
    assert_eq!(j.verdict, Verdict::Accepted);
    assert_invalid_at(&judged(&schema, json!(["a", 7])), "/1");
}

#[test]
fn error_details_are_collected_only_within_the_budget() {
    // Collecting details re-checks each anyOf branch: twice the work.
    let branches: Vec<Json> = (0..50).map(|_| json!({"type": "integer"})).collect();
    let schema = json!({"items": {"anyOf": branches}});
    let profile = super::super::schema::profile(&schema).unwrap();
    let output = |n: usize| json!(vec!["not an integer"; n]);
    // The largest output whose validity is within the budget.
    let (mut lo, mut hi) = (1usize, 100_000usize);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if profile.work(&output(mid)) <= MAX_SCHEMA_WORK {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let output = output(lo);
    assert!(profile.error_work(&output) > MAX_SCHEMA_WORK);
    let j = judged(&schema, output);
    assert!(!j.schema_valid);
    assert_eq!(j.schema_errors.len(), 1, "{:?}", j.schema_errors);
    assert!(
        j.schema_errors[0].contains("does not match")
            && j.schema_errors[0].contains("MAX_SCHEMA_WORK"),
        "{:?}",
        j.schema_errors
    );
    // A small one gets its details.
    assert_invalid_at(&judged(&schema, json!([1, "x"])), "/1");
}

#[test]
fn verdict_wire_values_round_trip() {
    for v in [
        Verdict::Accepted,
        Verdict::Rejected,
        Verdict::PendingPrincipal,
    ] {
        assert_eq!(Verdict::from_i32(v.as_i32()), Some(v));
    }
    assert_eq!(Verdict::from_i32(0), None);
}

#[test]
fn strip_parens_only_removes_what_encloses() {
    assert_eq!(strip_parens(" (a) "), "a");
    assert_eq!(strip_parens("(a"), "a");
    assert_eq!(strip_parens("a)"), "a");
    assert_eq!(strip_parens("((a) || (b))"), "(a) || (b)");
    assert_eq!(strip_parens("(a) || (b)"), "(a) || (b)");
    assert_eq!(strip_parens("f(x)"), "f(x)");
    assert_eq!(strip_parens("(s == ')')"), "s == ')'");
}
