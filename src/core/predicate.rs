//! Acceptance predicates (CEL) and their composition along a chain. Parsed
//! at issuance so a predicate that cannot parse never reaches a delegate;
//! composed by conjunction so no hop can drop an ancestor's predicate
//! (seeds/001, condition 1).

use super::error::InputError;
use super::limits::{
    MAX_EFFECTIVE_PREDICATE_BYTES, MAX_PARSED_PREDICATE_BYTES, MAX_PREDICATE_BYTES,
    MAX_PREDICATE_NESTING, MAX_PREDICATE_OPERATORS,
};

/// A CEL expression that parsed. Empty text means "no predicate".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Predicate(String);

impl Predicate {
    /// Parses client text; an empty (or all-blank) text is the empty
    /// predicate.
    pub fn parse(text: &str, field: &'static str) -> Result<Self, InputError> {
        if text.len() > MAX_PREDICATE_BYTES {
            return Err(InputError::new(
                field,
                format!("{} bytes, at most {MAX_PREDICATE_BYTES}", text.len()),
            ));
        }
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self::default());
        }
        let parsed = PARSED.get_or_init(Default::default);
        if lock_parsed(parsed).texts.contains(text) {
            return Ok(Self(text.to_owned()));
        }
        check_shape(text).map_err(|why| InputError::new(field, why))?;
        cel::Program::compile(text)
            .map_err(|e| InputError::new(field, format!("does not parse as CEL: {e}")))?;
        lock_parsed(parsed).remember(text, MAX_PARSED_PREDICATE_BYTES);
        Ok(Self(text.to_owned()))
    }

    /// Wraps a predicate read back from the store or a signed contract.
    pub fn from_trusted(text: String) -> Self {
        Self(text)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The effective predicate after this hop: `inherited && (own)`. Every
    /// part is parenthesized, so the result is always a flat conjunction
    /// `(p1) && (p2) && ...` whatever operators the parts use. `None` when the
    /// result would exceed the effective-predicate limit.
    pub fn conjoin(inherited: &Predicate, own: &Predicate) -> Option<Predicate> {
        let text = match (inherited.is_empty(), own.is_empty()) {
            (_, true) => inherited.0.clone(),
            (true, false) => format!("({})", own.0),
            (false, false) => format!("{} && ({})", inherited.0, own.0),
        };
        (text.len() <= MAX_EFFECTIVE_PREDICATE_BYTES).then_some(Predicate(text))
    }
}

/// Texts that passed `check_shape` and compiled: parsing one costs ~9 µs
/// per request, and agents forward the same predicates again and again.
/// A memo of a pure check: a hit answers exactly what parsing would.
static PARSED: std::sync::OnceLock<std::sync::Mutex<ParsedTexts>> = std::sync::OnceLock::new();

#[derive(Default)]
struct ParsedTexts {
    texts: std::collections::HashSet<String>,
    /// What the texts cost in memory, each its length plus
    /// `ENTRY_OVERHEAD_BYTES`: the memo's bound.
    bytes: usize,
}

/// A `String` and its hash-table slot, beyond the text itself.
const ENTRY_OVERHEAD_BYTES: usize = 64;

impl ParsedTexts {
    /// Adds a text, forgetting everything first if it would pass
    /// `capacity_bytes` (refilling costs one parse per text, as with no
    /// memo at all — so flooding it costs no more than not having it).
    fn remember(&mut self, text: &str, capacity_bytes: usize) {
        let cost = text.len() + ENTRY_OVERHEAD_BYTES;
        if self.bytes + cost > capacity_bytes {
            self.texts.clear();
            self.bytes = 0;
        }
        if self.texts.insert(text.to_owned()) {
            self.bytes += cost;
        }
    }
}

fn lock_parsed(parsed: &std::sync::Mutex<ParsedTexts>) -> std::sync::MutexGuard<'_, ParsedTexts> {
    // Inserts are single calls: a poisoned memo is still a correct one.
    parsed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Bounds what the recursive CEL parser will face before it runs:
/// bracket nesting and binary operators (a rough count outside string
/// literals is enough for a bound).
fn check_shape(text: &str) -> Result<(), String> {
    let (mut depth, mut deepest, mut operators) = (0usize, 0usize, 0usize);
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut previous = ' ';
    for c in text.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
            }
            None => match c {
                '"' | '\'' => quote = Some(c),
                '(' | '[' | '{' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                ')' | ']' | '}' => depth = depth.saturating_sub(1),
                '+' | '-' | '*' | '/' | '%' | '<' | '>' | '?' => operators += 1,
                '&' | '|' | '=' if previous != c => operators += 1,
                _ => {}
            },
        }
        previous = c;
    }
    if deepest > MAX_PREDICATE_NESTING {
        return Err(format!(
            "nests {deepest} levels deep, at most {MAX_PREDICATE_NESTING}"
        ));
    }
    if operators > MAX_PREDICATE_OPERATORS {
        return Err(format!(
            "has {operators} operators, at most {MAX_PREDICATE_OPERATORS}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parse_memo_answers_as_parsing_does_and_stays_bounded() {
        let text = "result.memo_test == 1";
        assert_eq!(Predicate::parse(text, "p").unwrap().as_str(), text);
        assert_eq!(Predicate::parse(text, "p").unwrap().as_str(), text, "a hit");
        // A failure is not remembered: it fails again, naming its field.
        for field in ["a", "b"] {
            assert_eq!(
                Predicate::parse("result. &&", field).unwrap_err().field,
                field
            );
        }
        let mut memo = ParsedTexts::default();
        let capacity = 2 * (4 + ENTRY_OVERHEAD_BYTES);
        for text in ["aaaa", "bbbb", "cccc", "bbbb"] {
            memo.remember(text, capacity);
            assert!(memo.bytes <= capacity && memo.texts.contains(text));
        }
        let charged: usize = memo
            .texts
            .iter()
            .map(|t| t.len() + ENTRY_OVERHEAD_BYTES)
            .sum();
        assert_eq!(memo.bytes, charged);
    }

    #[test]
    fn seed_001_predicate_parses_and_garbage_does_not() {
        assert!(Predicate::parse("result.schema_valid && result.within_scope", "p").is_ok());
        let err = Predicate::parse("result.schema_valid &&", "body.predicate").unwrap_err();
        assert_eq!(err.field, "body.predicate");
        assert!(Predicate::parse("   ", "p").unwrap().is_empty());
        // Shapes that would drive the recursive parser deep are refused first.
        let deep = format!("{}true{}", "(".repeat(40), ")".repeat(40));
        assert_eq!(Predicate::parse(&deep, "p").unwrap_err().field, "p");
        let long = vec!["1"; 200].join(" + ");
        assert!(Predicate::parse(&format!("{long} > 0"), "p").is_err());
        assert!(
            Predicate::parse(
                "result.output.items.size() > 0 && result.claimed == \"((((\"",
                "p"
            )
            .is_ok()
        );
    }

    #[test]
    fn conjunction_keeps_every_part_and_still_parses() {
        let a = Predicate::parse("result.schema_valid", "p").unwrap();
        let b = Predicate::parse("result.within_scope || result.consumed < 3", "p").unwrap();
        let c = Predicate::parse("result.tool_calls < 10", "p").unwrap();
        let ab = Predicate::conjoin(&Predicate::conjoin(&Predicate::default(), &a).unwrap(), &b)
            .unwrap();
        let abc = Predicate::conjoin(&ab, &c).unwrap();
        assert_eq!(
            abc.as_str(),
            "(result.schema_valid) && (result.within_scope || result.consumed < 3) && (result.tool_calls < 10)"
        );
        assert!(Predicate::parse(abc.as_str(), "p").is_ok());
        let none = Predicate::default();
        assert_eq!(Predicate::conjoin(&ab, &none).unwrap(), ab);
        assert_eq!(
            Predicate::conjoin(&none, &b).unwrap().as_str(),
            "(result.within_scope || result.consumed < 3)"
        );
        assert!(Predicate::conjoin(&none, &none).unwrap().is_empty());
    }
}
