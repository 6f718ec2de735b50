//! Unit and property tests of `core::schema`.

use super::patterns::pattern_weight;
use super::*;
use crate::limits::{MAX_REGEX_FORMAT_BYTES, MAX_SCHEMA_WORK};
use serde_json::json;

/// `levels` of `anyOf: [{"$ref": next}, {"$ref": next}]` under `not`:
/// validation time doubles per level.
fn doubling_chain(levels: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..levels {
        let next = format!("#/$defs/{}", i + 1);
        defs.insert(
            i.to_string(),
            json!({"anyOf": [{"$ref": next}, {"$ref": next}]}),
        );
    }
    defs.insert(levels.to_string(), json!({"type": "string"}));
    json!({"not": {"$ref": "#/$defs/0"}, "$defs": defs})
}

fn tree() -> Value {
    json!({
        "$defs": {"node": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
            },
            "additionalProperties": false
        }},
        "$ref": "#/$defs/node"
    })
}

fn valid(schema: &Value, instance: &Value) -> bool {
    compile(schema).unwrap().validator().is_valid(instance)
}

#[test]
fn the_anyof_doubling_chain_is_refused_at_compile_saying_why() {
    let attack = doubling_chain(60);
    assert!(serde_json::to_string(&attack).unwrap().len() < 4_000);
    let why = compile(&attack).err().unwrap();
    assert!(why.contains("MAX_SCHEMA_EXPANSION"), "{why}");
    assert!(why.contains("anyOf"), "{why}");
    // It is the doubling that is refused: each level doubles the count,
    // and a short chain passes.
    let counts: Vec<u64> = (1..6)
        .map(|l| profile(&doubling_chain(l)).unwrap().paths()[0])
        .collect();
    assert!(counts.windows(2).all(|w| w[1] >= 2 * w[0]), "{counts:?}");
    assert!(compile(&doubling_chain(5)).is_ok());
}

#[test]
fn a_pattern_past_the_regex_size_limit_is_refused_at_compile() {
    let one = json!({"properties": {"a": {"pattern": "[\\p{L}\\p{N}]{50}N"}}});
    let why = compile(&one).err().unwrap();
    assert!(why.contains("REGEX_SIZE_LIMIT_BYTES"), "{why}");
    // The 58 KB schema of such patterns (distinct, or not, or as
    // patternProperties keys) is refused too, one way or the other.
    for distinct in [usize::MAX, MAX_SCHEMA_PATTERNS, 1] {
        let mut props = serde_json::Map::new();
        for i in 0..1_300 {
            let pattern = format!("[\\p{{L}}\\p{{N}}]{{50}}N{}", i % distinct);
            props.insert(format!("p{i}"), json!({ "pattern": pattern }));
        }
        let schema = json!({ "properties": props });
        assert!(serde_json::to_string(&schema).unwrap().len() > 50_000);
        let why = compile(&schema).err().unwrap();
        assert!(
            why.contains("REGEX_SIZE_LIMIT_BYTES") || why.contains("MAX_SCHEMA_PATTERNS"),
            "{why}"
        );
    }
    let keys = json!({"patternProperties": {"[\\p{L}\\p{N}]{50}N": true}});
    assert!(compile(&keys).is_err());
    // One Unicode-wide class fits, and matches as it should.
    let word = json!({"type": "string", "pattern": "^[\\p{L}\\p{N}_-]+$"});
    assert!(valid(&word, &json!("Grüße_42")));
    assert!(!valid(&word, &json!("two words")));
}

#[test]
fn honest_schemas_are_accepted_and_validate() {
    let object = json!({
        "type": "object",
        "required": ["items", "status"],
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "status": {"anyOf": [{"const": "ok"}, {"const": "partial"}, {"type": "null"}]},
            "score": {"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 1}]}
        }
    });
    assert!(valid(
        &object,
        &json!({"items": ["a"], "status": "ok", "score": 3})
    ));
    assert!(!valid(&object, &json!({"items": [""], "status": "ok"})));
    assert!(!valid(&object, &json!({"items": ["a"], "status": "bad"})));
    // A member gets one `properties` entry: the largest (status: 1 + 3).
    assert_eq!(profile(&object).unwrap().paths()[..4], [1, 4, 1, 0]);

    let tree = tree();
    assert!(valid(
        &tree,
        &json!({"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]})
    ));
    assert!(!valid(
        &tree,
        &json!({"name": "a", "children": [{"name": "b", "children": [{"nam": "c"}]}]})
    ));
    // The same few schema nodes at every depth of the output.
    let p = profile(&tree).unwrap();
    assert!(p.paths().iter().all(|&n| n <= 3), "{:?}", p.paths());
    assert!(p.expansion() < 200, "{}", p.expansion());

    // Two recursive properties apply to different members: no doubling.
    let binary = json!({"type": "object", "properties": {
        "value": {"type": "integer"},
        "left": {"$ref": "#"},
        "right": {"$ref": "#"}
    }});
    assert!(valid(
        &binary,
        &json!({"value": 1, "left": {"value": 2}, "right": {"left": {}}})
    ));
    assert!(!valid(&binary, &json!({"left": {"right": {"value": "x"}}})));
    assert!(profile(&binary).unwrap().expansion() < 200);

    // Any JSON value: an object and an array are never both.
    let any = json!({"anyOf": [
        {"type": ["string", "number", "boolean", "null"]},
        {"type": "array", "items": {"$ref": "#"}},
        {"type": "object", "additionalProperties": {"$ref": "#"}}
    ]});
    assert!(valid(&any, &json!({"a": [1, {"b": null}]})));
    assert!(profile(&any).unwrap().expansion() < 1_000);
}

#[test]
fn references_resolve_in_the_document_or_are_refused() {
    let defs = json!({
        "$defs": {
            "a/b": {"type": "string"},
            "c~d": {"type": "integer"},
            "e f": {"type": "boolean"},
            "named": {"$anchor": "here", "type": "null"}
        },
        "properties": {
            "slash": {"$ref": "#/$defs/a~1b"},
            "tilde": {"$ref": "#/$defs/c~0d"},
            "space": {"$ref": "#/$defs/e%20f"},
            "anchor": {"$ref": "#here"},
            "tuple": {"prefixItems": [{"type": "string"}, {"$ref": "#/properties/tuple/prefixItems/0"}]}
        }
    });
    assert!(valid(
        &defs,
        &json!({"slash": "s", "tilde": 1, "space": true, "anchor": null, "tuple": ["a", "b"]})
    ));
    assert!(!valid(&defs, &json!({"space": "no"})));
    assert!(!valid(&defs, &json!({"tuple": ["a", 2]})));
    assert!(profile(&defs).is_ok());

    for (schema, why) in [
        (json!({"$ref": "#/$defs/missing"}), "points to nothing"),
        (json!({"$ref": "#nowhere"}), "does not resolve"),
        (json!({"$ref": "#/$defs/a%2"}), "percent"),
        (json!({"$defs": {}, "$ref": "#/$defs/a~2"}), "escape"),
        (json!({"$ref": "other.json#/a"}), "only references inside"),
        (
            json!({"$defs": {"x": {"$anchor": "a"}, "y": {"$anchor": "a"}}, "$ref": "#a"}),
            "more than once",
        ),
        (
            json!({"$defs": {"x": {"$id": "http://e.com/x", "$defs": {"y": {}}}}, "$ref": "#/$defs/x/$defs/y"}),
            "$id",
        ),
    ] {
        let refused = profile(&schema).err().unwrap();
        assert!(refused.contains(why), "{schema}: {refused}");
    }
    // Remote references are never fetched, whatever the profile says.
    assert!(compile(&json!({"$ref": "https://example.com/s.json"})).is_err());
}

#[test]
fn a_reference_cycle_that_never_descends_is_refused() {
    for schema in [
        json!({"$ref": "#"}),
        json!({"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"anyOf": [{"not": {"$ref": "#"}}]}}}),
    ] {
        let why = compile(&schema).err().unwrap();
        assert!(why.contains("cycle"), "{schema}: {why}");
    }
    // Through a descent it is recursion, and fine.
    assert!(compile(&json!({"items": {"$ref": "#"}})).is_ok());
}

#[test]
fn unevaluated_keywords_count_the_re_evaluation_of_what_they_apply_in_place() {
    let base = json!({"allOf": [{"allOf": [{"properties": {"a": true}}]}]});
    let mut strict = base.clone();
    strict["unevaluatedProperties"] = json!(false);
    let plain = profile(&base).unwrap().paths()[0];
    let counted = profile(&strict).unwrap().paths()[0];
    // Two levels of in-place nesting: its children count 2 + 2 times.
    assert_eq!((plain, counted), (3, 1 + 4 * 2));
    assert!(valid(&strict, &json!({"a": 1})));
    assert!(!valid(&strict, &json!({"b": 1})));
}

/// Found by fuzzing under LeakSanitizer: jsonschema leaks the compiled
/// `unevaluated*` validators of a schema that refers back into itself,
/// at every compile. Such schemas are refused before compiling; a
/// recursive schema without `unevaluated*`, and `unevaluated*` without
/// recursion, still compile.
#[test]
fn unevaluated_keywords_in_a_recursive_schema_are_refused_before_compiling() {
    for leaking in [
        json!({"$ref": "#", "type": "null", "unevaluatedProperties": false}),
        json!({"properties": {"child": {"$ref": "#"}}, "unevaluatedProperties": false}),
        json!({"$defs": {"t": {"items": {"$ref": "#/$defs/t"}, "unevaluatedItems": false}},
               "$ref": "#/$defs/t"}),
    ] {
        let why = compile_uncached(&leaking, 64).err().expect("refused");
        assert!(
            why.contains("recursive") || why.contains("cycle"),
            "{leaking}: {why}"
        );
    }
    // The fuzzer's second reproducer is refused too (its reference is
    // not local), before the library sees it.
    let recursive =
        json!({"$recursiveRef": "", "type": "null", "unevaluatedItems": {"type": "null"}});
    assert!(compile_uncached(&recursive, 64).is_err());
    let tree = json!({"properties": {"child": {"$ref": "#"}}});
    assert!(compile_uncached(&tree, 64).is_ok());
    assert!(compile_uncached(&json!({"unevaluatedProperties": false}), 64).is_ok());
}

#[test]
fn work_grows_with_paths_output_size_and_pattern_positions() {
    let items = json!({"items": {"type": "string"}});
    let p = profile(&items).unwrap();
    let small = p.work(&json!(["ab"]));
    let large = p.work(&json!(vec!["ab"; 1_000]));
    assert!(large > 500 * small, "{small} {large}");
    // Each bounded repetition is counted out: matching may step each
    // position at every byte.
    let positions = |pattern: &str| pattern_weight(pattern).unwrap();
    assert!(positions("[ab]*a[ab]{904}c") > 900);
    assert!(positions("^\\d{4}-\\d{2}-\\d{2}$") < 20);
    assert_eq!(positions("^[a-z]{1,64}$"), 1, "counted, not matched");
    let regex = profile(&json!({"items": {"pattern": "[ab]*a[ab]{904}c"}})).unwrap();
    let text = json!(["ab".repeat(10_000)]);
    assert!(regex.work(&text) > 900 * 20_000);
    assert!(regex.work(&text) > MAX_SCHEMA_WORK / 2);
    // `uniqueItems` compares whole subtrees.
    let unique = profile(&json!({"uniqueItems": true})).unwrap();
    let nested = json!([[["x".repeat(1_000)]], [["y".repeat(1_000)]]]);
    assert!(unique.work(&nested) > UNIQUE_ITEMS_FACTOR * 2_000);
    // An output deeper than any allowed cannot be bounded.
    let mut deep = json!(1);
    for _ in 0..DEPTHS {
        deep = json!([deep]);
    }
    assert_eq!(p.work(&deep), u64::MAX);
}

#[test]
fn collecting_errors_counts_anyof_branches_twice() {
    let p = profile(&json!({"anyOf": [{"type": "string"}, {"type": "integer"}]})).unwrap();
    let output = json!("x");
    assert!(p.error_work(&output) > p.work(&output));
    let q = profile(&json!({"allOf": [{"type": "string"}, {"type": "integer"}]})).unwrap();
    assert_eq!(q.error_work(&output), q.work(&output));
}

#[test]
fn the_memo_answers_as_compiling_does_and_stays_bounded() {
    let schema = json!({"type": "object", "properties": {"memo_test": {"const": 1}}});
    let first = compile(&schema).unwrap();
    let again = compile(&schema).unwrap();
    assert!(Arc::ptr_eq(&first, &again), "a hit");
    let fresh = compile_uncached(&schema, 0).unwrap();
    assert_eq!(again.profile(), fresh.profile());
    for output in [json!({"memo_test": 1}), json!({"memo_test": 2}), json!(3)] {
        assert_eq!(
            again.validator().is_valid(&output),
            fresh.validator().is_valid(&output)
        );
    }
    // A failure is not remembered: it fails again.
    for _ in 0..2 {
        assert!(compile(&json!({"$ref": "#"})).is_err());
    }
    // Bounded in entries and in bytes, clearing when full.
    let entry = |i: u8| {
        let c = compile_uncached(&json!({ "minimum": i }), 0).unwrap();
        ([i; 32], Arc::new(c))
    };
    let charge = entry(0).1.charge;
    let mut memo = Memo::default();
    for i in 0..5 {
        let (key, compiled) = entry(i);
        memo.remember(key, compiled, 3, 10 * charge);
        assert!(memo.entries.len() <= 3 && memo.entries.contains_key(&key));
    }
    let mut memo = Memo::default();
    for i in 0..5 {
        let (key, compiled) = entry(i);
        memo.remember(key, compiled, 100, 2 * charge);
        assert!(memo.bytes <= 2 * charge && memo.entries.contains_key(&key));
    }
    assert_eq!(
        memo.bytes,
        memo.entries.values().map(|c| c.charge).sum::<usize>()
    );
    // One entry larger than the memo is not kept.
    let (key, compiled) = entry(9);
    memo.remember(key, compiled, 100, charge - 1);
    assert!(!memo.entries.contains_key(&key));
}

/// `"format": "regex"` is the broker's own check: a pattern, at most
/// `MAX_REGEX_FORMAT_BYTES`, nested at most `MAX_REGEX_FORMAT_NEST` deep;
/// the library's check took 1.8 s on 32,000 nested named groups.
#[test]
fn a_regex_format_is_checked_by_the_broker() {
    let schema = json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "string",
        "format": "regex"
    });
    assert!(valid(&schema, &json!("^a+(?<x>b|c)*$")));
    assert!(!valid(&schema, &json!("(unclosed")));
    let long = "a".repeat(MAX_REGEX_FORMAT_BYTES + 1);
    assert!(!valid(&schema, &json!(long)));
    assert!(valid(&schema, &json!("a".repeat(MAX_REGEX_FORMAT_BYTES))));
    let deep = format!("{}a{}", "(".repeat(100), ")".repeat(100));
    assert!(!valid(&schema, &json!(deep)));
    let nested: String = format!(
        "{}x{}",
        (0..32_000).map(|i| format!("(?<g{i}>")).collect::<String>(),
        ")".repeat(32_000)
    );
    // Refused by its length, before anything parses it.
    assert!(!valid(&schema, &json!(nested)));
}

/// The validation-work estimate against the time validation takes, keyword
/// by keyword: no keyword costs more than `ESTIMATE_SPREAD` times the
/// median nanoseconds per estimated unit. The estimate is an upper bound,
/// so a keyword may cost far less than it is charged (a string's `type`);
/// one charged far less than it costs (as `format` was, and the library's
/// quadratic `regex` format) fails here. Each case is sized to take
/// milliseconds and timed as its fastest of several runs, so a loaded
/// machine slows every case rather than one.
#[test]
fn the_work_estimate_follows_validation_time_across_keywords() {
    const ESTIMATE_SPREAD: f64 = 32.0;
    let draft7 = "http://json-schema.org/draft-07/schema#";
    let strings = |n: usize, s: &str| json!(vec![s; n]);
    let mut cases: Vec<(&str, Value, Value)> = vec![
        (
            "type",
            json!({"items": {"type": "string"}}),
            strings(20_000, "abcdefgh"),
        ),
        (
            "long string",
            json!({"type": "string"}),
            json!("x".repeat(1 << 20)),
        ),
        (
            "pattern",
            json!({"items": {"pattern": "^[a-z]+$"}}),
            strings(5_000, "abcdefghijklmnop"),
        ),
        (
            "enum",
            json!({"items": {"enum": (0..200).map(|i| format!("v{i}")).collect::<Vec<_>>()}}),
            strings(2_000, "v199"),
        ),
        (
            "properties",
            json!({"properties": (0..500).map(|i| (format!("k{i}"), json!({"type": "integer"}))).collect::<serde_json::Map<_, _>>()}),
            Value::Object((0..5_000).map(|i| (format!("k{i}"), json!(i))).collect()),
        ),
        (
            "required",
            json!({"required": (0..300).map(|i| format!("k{i}")).collect::<Vec<_>>()}),
            Value::Object((0..300).map(|i| (format!("k{i}"), json!(i))).collect()),
        ),
        (
            "uniqueItems",
            json!({"uniqueItems": true}),
            json!((0..20_000).collect::<Vec<_>>()),
        ),
        ("anyOf chain", doubling_chain(8), json!(vec![1; 1])),
        ("nested objects", tree(), {
            let mut node = json!({"name": "leaf"});
            for _ in 0..30 {
                node = json!({"name": "n", "children": [node.clone(), {"name": "x"}]});
            }
            node
        }),
    ];
    let regexes = "(?<g>a|b)".repeat(400);
    // (format, strings, each string), under draft 7, which checks formats;
    // each case is named by its format.
    let formats = [
        ("email", 5_000, "someone@example.com"),
        ("date-time", 5_000, "2026-12-01T12:00:00Z"),
        ("hostname", 5_000, "a.very.long.host.example.com"),
        ("uri", 5_000, "https://example.com/a/b?c=d#e"),
        ("regex", 500, regexes.as_str()),
    ];
    for (format, n, s) in formats {
        let schema = json!({"$schema": draft7, "items": {"format": format}});
        cases.push((format, schema, strings(n, s)));
    }
    let mut rates = Vec::new();
    for (name, schema, instance) in &cases {
        let compiled = compile(schema).unwrap_or_else(|e| panic!("{name}: {e}"));
        let work = compiled.profile().work(instance).max(1);
        let mut best = std::time::Duration::MAX;
        for _ in 0..5 {
            let started = std::time::Instant::now();
            let _ = compiled.validator().is_valid(instance);
            best = best.min(started.elapsed());
        }
        let rate = best.as_nanos() as f64 / work as f64;
        rates.push((rate, *name, work, best));
    }
    rates.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (rate, name, work, best) in &rates {
        println!("{name:>18}: {work:>10} units {best:>12?} {rate:8.3} ns/unit");
    }
    let median = rates[rates.len() / 2].0;
    let costliest = rates[rates.len() - 1];
    assert!(
        costliest.0 <= median * ESTIMATE_SPREAD,
        "{} costs {:.3} ns per estimated unit, more than {ESTIMATE_SPREAD} times the median {median:.3}: its estimate is too low",
        costliest.1,
        costliest.0,
    );
}

/// Validation stops at its deadline: the broker's clock keyword sits in
/// every schema object of the compiled copy, and past the deadline every
/// node the validator enters fails, and `within` says it ran out of time.
#[test]
fn validation_stops_at_its_deadline() {
    let schema = json!({
        "$defs": {"leaf": {"type": "string"}},
        "anyOf": [{"$ref": "#/$defs/leaf"}, {"not": {"type": "null"}}],
        "properties": {"a": {"items": [{"type": "integer"}], "additionalItems": false}},
        "items": {"contains": {"const": 1}},
        "dependencies": {"a": ["b"], "c": {"required": ["d"]}}
    });
    let clocked = clocked(&schema);
    let at = |pointer: &str| {
        clocked
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{pointer}"))
            .get(CLOCK_KEYWORD)
            .cloned()
    };
    for pointer in [
        "",
        "/$defs/leaf",
        "/anyOf/0",
        "/anyOf/1",
        "/anyOf/1/not",
        "/properties/a",
        "/properties/a/items/0",
        "/items",
        "/items/contains",
        "/dependencies/c",
    ] {
        assert_eq!(at(pointer), Some(json!(true)), "{pointer}");
    }
    // Not in data: the list of names, the const, the original schema.
    assert_eq!(clocked.pointer("/dependencies/a"), Some(&json!(["b"])));
    assert_eq!(clocked.pointer("/items/contains/const"), Some(&json!(1)));
    assert!(schema.get(CLOCK_KEYWORD).is_none());

    let compiled = compile(&doubling_chain(6)).unwrap();
    let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
    assert_eq!(
        within(later, || compiled.validator().is_valid(&json!(1))),
        Some(true)
    );
    let now = std::time::Instant::now();
    assert_eq!(
        within(now, || compiled.validator().is_valid(&json!(1))),
        None
    );
    // Outside `within` the clock never stops anything.
    assert!(compiled.validator().is_valid(&json!(1)));
}
