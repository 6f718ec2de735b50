//! What a schema's patterns cost: the automaton positions a `pattern`
//! keeps alive (its weight in the profile), and the broker's own bounded
//! check of `"format": "regex"`.

use std::borrow::Cow;

use regex_syntax::hir::{Hir, HirKind};

use super::graph::len;
use crate::error::echo;
use crate::limits::{MAX_REGEX_FORMAT_BYTES, MAX_REGEX_FORMAT_NEST};

/// Automaton positions a pattern can keep alive at once: its atoms, each
/// bounded repetition counted out (`x{50}` is 50), as the engine compiles
/// it (`jsonschema`'s translation and edge collapsing). 1 when `jsonschema`
/// counts characters instead (`^X{m,n}$`).
pub(super) fn pattern_weight(pattern: &str) -> Result<u64, String> {
    let unsupported = || {
        format!(
            "pattern {} is not a regular expression the broker supports (ECMA-262, no look-around or backreferences)",
            echo(pattern)
        )
    };
    let translated = jsonschema_regex::to_rust_regex(pattern).map_err(|()| unsupported())?;
    let engine = match jsonschema_regex::search_form(pattern, &translated) {
        Some(jsonschema_regex::Search::RepeatedClass(_)) => return Ok(1),
        Some(jsonschema_regex::Search::Collapsed(collapsed)) => Cow::Owned(collapsed),
        None => translated,
    };
    let hir = regex_syntax::Parser::new()
        .parse(&engine)
        .map_err(|_| unsupported())?;
    Ok(positions(&hir))
}

/// See `pattern_weight`; without recursion.
fn positions(hir: &Hir) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![(hir, 1u64)];
    while let Some((hir, copies)) = stack.pop() {
        match hir.kind() {
            HirKind::Empty => {}
            HirKind::Literal(literal) => {
                total = total.saturating_add(copies.saturating_mul(len(literal.0.len())));
            }
            HirKind::Class(_) | HirKind::Look(_) => total = total.saturating_add(copies),
            HirKind::Repetition(repetition) => {
                // `x{m,n}` compiles n copies, `x{m,}` m copies and a loop.
                let count = repetition
                    .max
                    .unwrap_or_else(|| repetition.min.saturating_add(1))
                    .max(1);
                stack.push((&repetition.sub, copies.saturating_mul(u64::from(count))));
            }
            HirKind::Capture(capture) => stack.push((&capture.sub, copies)),
            HirKind::Concat(parts) | HirKind::Alternation(parts) => {
                stack.extend(parts.iter().map(|part| (part, copies)));
            }
        }
    }
    total.max(1)
}

/// `"format": "regex"`, checked by the broker: at most
/// `MAX_REGEX_FORMAT_BYTES`, translated as `pattern`s are, and parsed with
/// nesting bounded by `MAX_REGEX_FORMAT_NEST` (no automaton is built):
/// linear in the string, where the library's own check is quadratic in
/// nested groups.
pub(super) fn regex_format(text: &str) -> bool {
    if text.len() > MAX_REGEX_FORMAT_BYTES {
        return false;
    }
    let Ok(translated) = jsonschema_regex::to_rust_regex(text) else {
        return false;
    };
    regex_syntax::ParserBuilder::new()
        .nest_limit(MAX_REGEX_FORMAT_NEST)
        .build()
        .parse(&translated)
        .is_ok()
}
