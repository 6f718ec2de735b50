//! Write scopes: prefix parsing and normalisation, `covers_observed` on
//! host-reported paths, and `widening_over` (invariant 14).
//!
//! Asserts:
//! - `parse` accepts exactly the prefix lists an independent model of the
//!   rules accepts, yields a sorted, duplicate-free normal form that parses
//!   to itself, and contains every prefix it was given (normalised);
//! - `covers_observed` is never true for an empty path, a path with a
//!   control character, or one with a ".." component ('/' or '\\'
//!   separated); it agrees with a model of lexical normalisation, and does
//!   not change when '\\' becomes '/', separators are doubled, a "./" is
//!   put before a relative path, or a separator is appended;
//! - `widening_over` names exactly the prefixes the parent does not cover;
//!   it is reflexive and transitive; and attenuation is sound: when a
//!   child's scope lies within its parent's, every observed path the child
//!   may write the parent may write too.

use crate::{note, path, paths};
use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::core::Scope;
use delegation_broker::core::limits::{MAX_SCOPE_PREFIX_BYTES, MAX_SCOPE_PREFIXES};

#[derive(Debug)]
pub struct Input {
    scopes: [Vec<String>; 3],
    observed: Vec<String>,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let mut scopes = [paths(u, 6)?, paths(u, 6)?, paths(u, 6)?];
        // Now and then, one over the count bound.
        if u.ratio(1, 64)? {
            scopes[0] = (0..=MAX_SCOPE_PREFIXES).map(|i| format!("p{i}")).collect();
        }
        let mut observed = paths(u, 8)?;
        // Paths at and just below the prefixes, which the random ones rarely hit.
        for scope in &scopes {
            for prefix in scope.iter().take(2) {
                observed.push(prefix.clone());
                observed.push(format!("{prefix}/{}", path(u)?));
            }
        }
        Ok(Self { scopes, observed })
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    run(input);
}

fn run(input: Input) {
    let parsed: Vec<Option<Scope>> = input.scopes.iter().map(|raw| parsed(raw)).collect();
    for scope in parsed.iter().flatten() {
        for p in &input.observed {
            covers_observed(scope, p);
        }
        assert!(scope.widening_over(scope).is_empty(), "{scope:?}");
    }
    let [Some(a), Some(b), Some(c)] = [&parsed[0], &parsed[1], &parsed[2]] else {
        return;
    };
    for (child, parent) in [(a, b), (b, c), (a, c)] {
        widening(child, parent, &input.observed);
    }
    if a.widening_over(b).is_empty() && b.widening_over(c).is_empty() {
        assert!(
            a.widening_over(c).is_empty(),
            "not transitive: {a:?} {b:?} {c:?}"
        );
    }
}

/// `Scope::parse` against a model of the prefix rules.
fn parsed(raw: &[String]) -> Option<Scope> {
    let expected: Option<Vec<String>> = if raw.len() > MAX_SCOPE_PREFIXES {
        None
    } else {
        raw.iter().map(|p| model_prefix(p)).collect()
    };
    match (Scope::parse(raw, "body.write_scope"), expected) {
        (Ok(scope), Some(mut expected)) => {
            expected.sort();
            expected.dedup();
            assert_eq!(scope.prefixes(), expected.as_slice(), "{raw:?}");
            assert_eq!(
                Scope::parse(scope.prefixes(), "again").as_ref(),
                Ok(&scope),
                "the normal form is not a fixed point"
            );
            Some(scope)
        }
        (Err(e), None) => {
            assert_eq!(e.field, "body.write_scope");
            None
        }
        (got, expected) => panic!("{raw:?}: parse gave {got:?}, the model {expected:?}"),
    }
}

/// A prefix's normal form by the documented rules, or `None` if invalid:
/// non-empty, at most 1 KiB, no control character, no '\\'; "/" alone is
/// every absolute path; otherwise trailing '/'s are dropped and the rest
/// (after one leading '/') has no empty, "." or ".." component.
fn model_prefix(raw: &str) -> Option<String> {
    if raw.is_empty()
        || raw.len() > MAX_SCOPE_PREFIX_BYTES
        || raw.chars().any(char::is_control)
        || raw.contains('\\')
    {
        return None;
    }
    if raw == "/" {
        return Some(raw.to_owned());
    }
    let trimmed = raw.trim_end_matches('/');
    let body = trimmed.strip_prefix('/').unwrap_or(trimmed);
    body.split('/')
        .all(|c| !matches!(c, "" | "." | ".."))
        .then(|| trimmed.to_owned())
}

/// A model of the lexical normalisation of an observed path.
fn model_observed(raw: &str) -> Option<String> {
    if raw.is_empty() || raw.chars().any(char::is_control) {
        return None;
    }
    let parts: Vec<&str> = raw
        .split(['/', '\\'])
        .filter(|c| !matches!(*c, "" | "."))
        .collect();
    if parts.contains(&"..") {
        return None;
    }
    let joined = parts.join("/");
    if raw.starts_with(['/', '\\']) {
        Some(format!("/{joined}"))
    } else if joined.is_empty() {
        None
    } else {
        Some(joined)
    }
}

fn model_under(path: &str, prefix: &str) -> bool {
    if prefix == "/" {
        return path.starts_with('/');
    }
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

fn covers_observed(scope: &Scope, path: &str) {
    let covered = scope.covers_observed(path);
    note(if covered { "covered" } else { "not covered" });
    let escapes = path.is_empty()
        || path.chars().any(char::is_control)
        || path.split(['/', '\\']).any(|c| c == "..");
    if escapes {
        assert!(!covered, "{path:?} escapes, yet {scope:?} covers it");
    }
    let model =
        model_observed(path).is_some_and(|n| scope.prefixes().iter().any(|p| model_under(&n, p)));
    assert_eq!(covered, model, "{path:?} under {scope:?}");
    // Spellings of the same path are judged alike.
    let same = [
        path.replace('\\', "/"),
        path.replace('/', "//"),
        format!("{path}/"),
        format!("{path}\\"),
    ];
    for other in same.iter().filter(|o| !o.is_empty() && !path.is_empty()) {
        assert_eq!(
            scope.covers_observed(other),
            covered,
            "{path:?} vs {other:?} under {scope:?}"
        );
    }
    if !path.is_empty() && !path.starts_with(['/', '\\']) {
        let dotted = format!("./{path}");
        assert_eq!(
            scope.covers_observed(&dotted),
            covered,
            "{path:?} vs {dotted:?}"
        );
    }
}

fn widening(child: &Scope, parent: &Scope, observed: &[String]) {
    let widened = child.widening_over(parent);
    for p in child.prefixes() {
        let outside = !parent.prefixes().iter().any(|q| model_under(p, q));
        assert_eq!(
            widened.contains(&p.as_str()),
            outside,
            "{p:?} against {parent:?}"
        );
    }
    note(if widened.is_empty() {
        "within"
    } else {
        "widened"
    });
    if widened.is_empty() {
        for path in observed {
            if child.covers_observed(path) {
                assert!(
                    parent.covers_observed(path),
                    "{path:?}: the child {child:?} may write it, its parent {parent:?} may not"
                );
            }
        }
    }
}
