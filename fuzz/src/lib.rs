//! Helpers shared by the fuzz targets: running work on the stack size the
//! broker gives it, and generators that draw broker-shaped text (paths,
//! CEL, JSON Schema) from fuzzer bytes, so the targets reach the code
//! behind the cheap checks instead of stopping at the first parse error.

pub mod targets;

#[cfg(test)]
mod replay;

use arbitrary::{Result, Unstructured};
use serde_json::{Map, Value as Json};

pub use delegation_broker::core::limits::{DEEP_STACK_BYTES, WORKER_STACK_BYTES};

/// Runs `f` on a fresh thread with a `bytes` stack, as the broker runs the
/// same work (async workers: `WORKER_STACK_BYTES`; conversion and judge
/// threads: `DEEP_STACK_BYTES`), so a stack overflow found here is one the
/// broker would hit. A panic aborts the process (libfuzzer-sys's panic
/// hook), which libFuzzer reports as a crash with this input.
pub fn on_stack<R: Send>(bytes: usize, f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(bytes)
            .spawn_scoped(scope, f)
            .expect("spawn a fuzz worker thread")
            .join()
            .expect("the fuzzed work panicked")
    })
}

/// Either one of `vocab`, or (one time in four) arbitrary text.
pub fn word(u: &mut Unstructured<'_>, vocab: &[&str]) -> Result<String> {
    if u.ratio(1, 4)? {
        let s: &str = u.arbitrary()?;
        Ok(s.chars().take(32).collect())
    } else {
        Ok((*u.choose(vocab)?).to_owned())
    }
}

/// Up to `max` tokens of `vocab` (or arbitrary text) concatenated.
pub fn tokens(u: &mut Unstructured<'_>, vocab: &[&str], max: usize) -> Result<String> {
    let n = u.int_in_range(0..=max)?;
    let mut out = String::new();
    for _ in 0..n {
        out.push_str(&word(u, vocab)?);
    }
    Ok(out)
}

/// Path components: traversal, separators, empty components, non-ASCII and
/// control characters.
pub const PATH_WORDS: &[&str] = &[
    "src",
    "exec",
    "a.rs",
    "docs",
    "x.md",
    "tmp",
    "out",
    "etc",
    "passwd",
    "..",
    ".",
    "",
    "...",
    ". .",
    "src\\exec",
    "..\\..",
    "é",
    "a b",
    "\u{7f}",
    "\n",
    "\u{85}",
    "\u{202e}",
    "~",
    "C:",
    "%2e%2e",
    "\0",
];

/// A path-like string: components of `PATH_WORDS` joined by '/' or '\\',
/// with an optional leading and trailing separator; or arbitrary text.
pub fn path(u: &mut Unstructured<'_>) -> Result<String> {
    shaped_or_text(u, 8, |u| {
        let mut out = String::new();
        match u.int_in_range(0..=4)? {
            0 => out.push('/'),
            1 => out.push('\\'),
            2 => out.push_str("./"),
            _ => {}
        }
        let n = u.int_in_range(1..=5)?;
        for i in 0..n {
            if i > 0 {
                out.push_str(u.choose(&["/", "/", "/", "\\", "//"])?);
            }
            out.push_str(&word(u, PATH_WORDS)?);
        }
        if u.ratio(1, 4)? {
            out.push_str(u.choose(&["/", "\\", "//"])?);
        }
        Ok(out)
    })
}

/// Arbitrary text one time in `one_in`, else what `shaped` draws.
fn shaped_or_text(
    u: &mut Unstructured<'_>,
    one_in: u32,
    shaped: impl FnOnce(&mut Unstructured<'_>) -> Result<String>,
) -> Result<String> {
    if u.ratio(1, one_in)? {
        return Ok(u.arbitrary::<&str>()?.to_owned());
    }
    shaped(u)
}

/// Up to `max` paths.
pub fn paths(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<String>> {
    let n = u.int_in_range(0..=max)?;
    (0..n).map(|_| path(u)).collect()
}

/// CEL tokens over the judge's `result` (its fields, the fixed outputs'
/// members, operators, macros, literals of every type, comments, newlines).
pub const CEL_WORDS: &[&str] = &[
    "result",
    "result.",
    ".",
    "schema_valid",
    "within_scope",
    "output",
    "claimed",
    "has_report",
    "consumed",
    "elapsed_ms",
    "tool_calls",
    "mutations",
    "items",
    "approved",
    "name",
    "score",
    "nested",
    "a",
    "b",
    "x",
    " && ",
    " || ",
    "!",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    " + ",
    " - ",
    "*",
    "/",
    "%",
    " ? ",
    " : ",
    "true",
    "false",
    "null",
    "0",
    "1",
    "-1",
    "3",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615u",
    "1u",
    "2.5",
    "1e308",
    "-0.0",
    "\"\"",
    "\"a\"",
    "'x'",
    "b\"\\xff\"",
    "r\"\\d+\"",
    "\"\\u00e9\"",
    ".size()",
    "size(",
    ".matches(",
    "\"^a+$\"",
    "\"(a+)+$\"",
    "\"a{1000}\"",
    ".exists(x, ",
    ".all(x, ",
    ".map(x, ",
    ".filter(x, ",
    ".exists_one(x, ",
    "has(",
    " in ",
    " ",
    "\n",
    "// c\n",
    "//",
    ",",
    "int(",
    "uint(",
    "double(",
    "string(",
    "bytes(",
    "type(",
    "dyn(",
    "timestamp(",
    "duration(",
    "\"1s\"",
    "\"2023-01-01T00:00:00Z\"",
    ".startsWith(",
    ".endsWith(",
    ".contains(",
    "[1, 2, 3]",
    "{\"k\": 1}",
    "result.output.items",
    "result.claimed == \"success\"",
    "result.consumed < 10",
    "result.schema_valid",
    "result.within_scope",
    "max(",
    "min(",
    "/*",
    "*/",
    "\\",
    "`",
    "@",
    "#",
];

/// A predicate text: CEL tokens, or (one time in six) arbitrary text.
pub fn cel(u: &mut Unstructured<'_>) -> Result<String> {
    shaped_or_text(u, 6, |u| tokens(u, CEL_WORDS, 24))
}

const STRINGS: &[&str] = &[
    "",
    "a",
    "success",
    "src/a.rs",
    "é",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!",
    "2023-01-01",
    "2023-01-01T00:00:00Z",
    "a@example.com",
    "http://example.com/x",
    "::1",
    "127.0.0.1",
    "00000000-0000-0000-0000-000000000000",
    "P1D",
    "/a/b",
    "^a+$",
    "xn--bcher-kva",
    "\u{0}",
    "\u{10ffff}",
    "12:00:00Z",
    "#/a",
    "\\",
    "[",
    "1e400",
];

/// A number at the edges of JSON's and JSON Schema's arithmetic.
fn number(u: &mut Unstructured<'_>) -> Result<Json> {
    Ok(match u.int_in_range(0..=9)? {
        0 => Json::from(u.arbitrary::<i64>()?),
        1 => Json::from(u.arbitrary::<u64>()?),
        2 => serde_json::Number::from_f64(u.arbitrary::<f64>()?).map_or(Json::Null, Json::Number),
        3 => Json::from(*u.choose(&[i64::MIN, i64::MAX, -1, 0, 1, 2, 3, 10, 100])?),
        4 => Json::from(u64::MAX),
        _ => {
            let f = *u.choose(&[
                0.1,
                0.5,
                1.5,
                -0.0,
                1e-300,
                5e-324,
                1e300,
                1.7976931348623157e308,
                0.3,
                1e-10,
                2.5e15,
            ])?;
            serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number)
        }
    })
}

/// An arbitrary JSON value at most `depth` levels deep.
pub fn json(u: &mut Unstructured<'_>, depth: usize) -> Result<Json> {
    let choice = if depth == 0 {
        u.int_in_range(0..=3)?
    } else {
        u.int_in_range(0..=5)?
    };
    Ok(match choice {
        0 => Json::Null,
        1 => Json::Bool(u.arbitrary()?),
        2 => number(u)?,
        3 => Json::String(word(u, STRINGS)?),
        4 => array(u, 4, |u| json(u, depth - 1))?,
        _ => {
            let n = u.int_in_range(0..=4)?;
            let mut map = Map::new();
            for _ in 0..n {
                map.insert(
                    word(u, &["a", "b", "items", "name", "", "x"])?,
                    json(u, depth - 1)?,
                );
            }
            Json::Object(map)
        }
    })
}

const TYPES: &[&str] = &[
    "null", "boolean", "object", "array", "number", "string", "integer", "any", "nope",
];

const PATTERNS: &[&str] = &[
    "^a+$",
    "(a+)+$",
    "(a|aa)*b",
    "a{1000}",
    "a{1000}{1000}",
    "(?i)x",
    "\\p{L}+",
    "[",
    "a{2,1}",
    "\\d{3}-\\d{4}",
    ".*",
    "^(?=a)",
    "(a)\\1",
    "\\",
    "[[:alpha:]]",
    "\\b",
    "^$",
    "x{0,65535}",
    "(((((((((((a)))))))))))",
    "[^\\x00-\\x7f]",
];

const FORMATS: &[&str] = &[
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uri-template",
    "uuid",
    "json-pointer",
    "relative-json-pointer",
    "regex",
    "unknown",
];

const REFS: &[&str] = &[
    "#",
    "#/$defs/a",
    "#/definitions/a",
    "#/properties/a",
    "#a",
    "#/$defs/missing",
    "http://example.com/s.json",
    "s.json",
    "urn:x",
    "#/$defs/a/$defs/a",
    "#/items/0",
    "",
    "file:///etc/passwd",
];

const DRAFTS: &[&str] = &[
    "http://json-schema.org/draft-04/schema#",
    "http://json-schema.org/draft-06/schema#",
    "http://json-schema.org/draft-07/schema#",
    "https://json-schema.org/draft/2019-09/schema",
    "https://json-schema.org/draft/2020-12/schema",
    "http://example.com/unknown-draft",
];

/// A JSON Schema at most `depth` levels of subschemas deep, built from the
/// keywords of every draft (with valid and invalid values).
pub fn schema(u: &mut Unstructured<'_>, depth: usize) -> Result<Json> {
    if depth == 0 || u.ratio(1, 6)? {
        return Ok(match u.int_in_range(0..=3)? {
            0 => Json::Bool(u.arbitrary()?),
            1 => Json::Object(Map::new()),
            2 => serde_json::json!({ "type": *u.choose(TYPES)? }),
            _ => json(u, 2)?,
        });
    }
    let mut map = Map::new();
    let n = u.int_in_range(1..=5)?;
    for _ in 0..n {
        let d = depth - 1;
        let (key, value): (&str, Json) = match u.int_in_range(0..=41)? {
            0 => ("type", Json::from(*u.choose(TYPES)?)),
            1 => ("type", array(u, 3, |u| Ok(Json::from(*u.choose(TYPES)?)))?),
            2 => {
                let mut props = Map::new();
                for _ in 0..u.int_in_range(0..=3)? {
                    props.insert(word(u, &["a", "b", "items", "name", ""])?, schema(u, d)?);
                }
                ("properties", Json::Object(props))
            }
            3 => ("items", schema(u, d)?),
            4 => ("items", array(u, 3, |u| schema(u, d))?),
            5 => ("prefixItems", array(u, 3, |u| schema(u, d))?),
            6 => ("additionalProperties", schema(u, d)?),
            7 => ("additionalItems", schema(u, d)?),
            8 => (
                "required",
                serde_json::json!([word(u, &["a", "b", "items"])?]),
            ),
            9 => ("enum", array(u, 4, |u| json(u, 2))?),
            10 => ("const", json(u, 3)?),
            11 => ("pattern", Json::from(word(u, PATTERNS)?)),
            12 => {
                let mut props = Map::new();
                props.insert(word(u, PATTERNS)?, schema(u, d)?);
                ("patternProperties", Json::Object(props))
            }
            13 => ("minLength", number(u)?),
            14 => ("maxLength", number(u)?),
            15 => ("minimum", number(u)?),
            16 => ("maximum", number(u)?),
            17 => ("exclusiveMinimum", number(u)?),
            18 => ("exclusiveMaximum", number(u)?),
            19 => ("multipleOf", number(u)?),
            20 => ("minItems", number(u)?),
            21 => ("maxItems", number(u)?),
            22 => ("uniqueItems", Json::Bool(u.arbitrary()?)),
            23 => ("minProperties", number(u)?),
            24 => ("maxProperties", number(u)?),
            25 => (
                *u.choose(&["allOf", "anyOf", "oneOf"])?,
                array(u, 4, |u| schema(u, d))?,
            ),
            26 => ("not", schema(u, d)?),
            27 => ("if", schema(u, d)?),
            28 => (*u.choose(&["then", "else"])?, schema(u, d)?),
            29 => ("contains", schema(u, d)?),
            30 => (*u.choose(&["minContains", "maxContains"])?, number(u)?),
            31 => ("propertyNames", schema(u, d)?),
            32 => ("$ref", Json::from(word(u, REFS)?)),
            33 => {
                let mut defs = Map::new();
                defs.insert("a".into(), schema(u, d)?);
                (*u.choose(&["$defs", "definitions"])?, Json::Object(defs))
            }
            34 => ("$schema", Json::from(*u.choose(DRAFTS)?)),
            35 => (
                *u.choose(&[
                    "$id",
                    "id",
                    "$anchor",
                    "$dynamicAnchor",
                    "$dynamicRef",
                    "$recursiveRef",
                    "$recursiveAnchor",
                ])?,
                json_or(u, REFS)?,
            ),
            36 => ("format", Json::from(word(u, FORMATS)?)),
            37 => (
                *u.choose(&["unevaluatedProperties", "unevaluatedItems"])?,
                schema(u, d)?,
            ),
            38 => {
                let mut deps = Map::new();
                deps.insert(word(u, &["a", "b"])?, schema(u, d)?);
                (
                    *u.choose(&["dependentSchemas", "dependencies"])?,
                    Json::Object(deps),
                )
            }
            39 => ("dependentRequired", serde_json::json!({ "a": ["b"] })),
            40 => (
                *u.choose(&["contentEncoding", "contentMediaType"])?,
                Json::from(word(u, &["base64", "application/json", "7bit"])?),
            ),
            _ => (
                u.choose(&["title", "default", "examples", "$comment", "unknownKeyword"])?,
                json(u, 2)?,
            ),
        };
        map.insert(key.to_owned(), value);
    }
    Ok(Json::Object(map))
}

/// An array of up to `max` values drawn by `value`.
fn array(
    u: &mut Unstructured<'_>,
    max: u32,
    mut value: impl FnMut(&mut Unstructured<'_>) -> Result<Json>,
) -> Result<Json> {
    let n = u.int_in_range(0..=max)?;
    Ok(Json::Array(
        (0..n).map(|_| value(u)).collect::<Result<_>>()?,
    ))
}

fn json_or(u: &mut Unstructured<'_>, vocab: &[&str]) -> Result<Json> {
    if u.ratio(1, 5)? {
        json(u, 1)
    } else {
        Ok(Json::from(word(u, vocab)?))
    }
}

/// Counts how often each named outcome was reached, when the environment
/// variable `FUZZ_STATS` is set (printed to stderr every 1,000 notes), so a
/// target's author can see whether inputs get past the cheap checks.
/// Costs one relaxed load otherwise.
pub fn note(what: &'static str) {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU8, Ordering};
    static ON: AtomicU8 = AtomicU8::new(0);
    static COUNTS: Mutex<(u64, BTreeMap<&'static str, u64>)> = Mutex::new((0, BTreeMap::new()));
    let on = match ON.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("FUZZ_STATS").is_some();
            ON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        state => state == 2,
    };
    if !on {
        return;
    }
    let mut counts = COUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    counts.0 += 1;
    *counts.1.entry(what).or_default() += 1;
    if counts.0.is_multiple_of(1_000) {
        eprintln!("FUZZ_STATS {:?}", counts.1);
    }
}
