//! Acceptance predicates (CEL) and their composition along a chain. Parsed
//! at issuance so a predicate that cannot parse never reaches a delegate;
//! composed by conjunction so no hop can drop an ancestor's predicate
//! (docs/design.md, seed 001, condition 1).

use super::error::InputError;
use super::limits::{
    MAX_EFFECTIVE_PREDICATE_BYTES, MAX_PARSED_PREDICATE_BYTES, MAX_PREDICATE_AST_DEPTH,
    MAX_PREDICATE_BYTES, MAX_PREDICATE_NESTING, MAX_PREDICATE_OPERATORS, MAX_PREDICATE_SELECTS,
    MAX_SHAPE_MEMO_BYTES,
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
        if lock_memo(parsed).texts.contains_key(text) {
            return Ok(Self(text.to_owned()));
        }
        check_shape(text).map_err(|why| InputError::new(field, why))?;
        cel::Program::compile(text)
            .map_err(|e| InputError::new(field, format!("does not parse as CEL: {e}")))?;
        lock_memo(parsed).remember(text, (), MAX_PARSED_PREDICATE_BYTES);
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
    /// part is parenthesized and ends its line before its closing
    /// parenthesis, so the result is always a flat conjunction
    /// `(p1⏎) && (p2⏎) && ...` whatever the parts contain: a part's trailing
    /// `//` comment ends at that newline and cannot swallow what follows
    /// (each part parses on its own, so nothing else of it is left open).
    /// `None` when the result would exceed the effective-predicate limit.
    /// Cheap string work; `check_effective` is the parse that vouches for it.
    pub fn conjoin(inherited: &Predicate, own: &Predicate) -> Option<Predicate> {
        let text = match (inherited.is_empty(), own.is_empty()) {
            (_, true) => inherited.0.clone(),
            (true, false) => format!("({}\n)", own.0),
            (false, false) => format!("{} && ({}\n)", inherited.0, own.0),
        };
        (text.len() <= MAX_EFFECTIVE_PREDICATE_BYTES).then_some(Predicate(text))
    }

    /// True when `check_effective(inherited, &parse(own)?)` would parse
    /// nothing: `own` and the composition with its parts are all in the
    /// memos, so the check costs a few hash lookups. Issuance then runs a
    /// Delegate's conversion inline instead of handing it to a converter
    /// thread. False whenever in doubt (the full check then decides).
    pub fn checked_before(inherited: &Predicate, own: &str) -> bool {
        if own.len() > MAX_PREDICATE_BYTES {
            return false;
        }
        let own = own.trim();
        if !own.is_empty()
            && !PARSED
                .get()
                .is_some_and(|parsed| lock_memo(parsed).texts.contains_key(own))
        {
            return false;
        }
        let own = Predicate(own.to_owned());
        let Some(composed) = Self::conjoin(inherited, &own) else {
            return false;
        };
        if composed.is_empty() {
            return true;
        }
        let Some(shapes) = SHAPES.get() else {
            return false;
        };
        let shapes = lock_memo(shapes);
        [&composed, inherited, &own]
            .into_iter()
            .filter(|p| !p.is_empty())
            .all(|p| shapes.texts.contains_key(p.as_str()))
    }

    /// The effective predicate a child would be issued with, checked so it
    /// can always be judged: it fits `MAX_EFFECTIVE_PREDICATE_BYTES`, parses
    /// as CEL, its syntax tree is no deeper than the judge evaluates, and it
    /// has exactly the top-level conjuncts of its parts (so no part can
    /// absorb another). Parsing costs up to milliseconds for a long chain:
    /// callers run it off the writer, before the request is queued.
    pub fn check_effective(
        inherited: &Predicate,
        own: &Predicate,
        field: &'static str,
    ) -> Result<Predicate, InputError> {
        let composed = Self::conjoin(inherited, own).ok_or_else(|| {
            InputError::new(
                field,
                format!(
                    "the effective predicate (the ancestors' conjunction and this one) would exceed {MAX_EFFECTIVE_PREDICATE_BYTES} bytes"
                ),
            )
        })?;
        if composed.is_empty() {
            return Ok(composed);
        }
        let shape = |text: &str| remembered_shape(text);
        let whole = shape(&composed.0).map_err(|why| {
            InputError::new(
                field,
                format!("the effective predicate cannot be judged: {why}"),
            )
        })?;
        if whole.depth > MAX_PREDICATE_AST_DEPTH {
            return Err(InputError::new(
                field,
                format!(
                    "the effective predicate would nest {} levels deep, deeper than the judge evaluates ({MAX_PREDICATE_AST_DEPTH})",
                    whole.depth
                ),
            ));
        }
        let parts = [inherited, own]
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| shape(&p.0).map(|s| s.conjuncts))
            .sum::<Result<usize, String>>()
            .map_err(|why| InputError::new(field, format!("a part does not parse: {why}")))?;
        if whole.conjuncts != parts {
            return Err(InputError::new(
                field,
                format!(
                    "composing it would merge conjuncts ({} parts, {} after composition)",
                    parts, whole.conjuncts
                ),
            ));
        }
        Ok(composed)
    }
}

/// Texts that passed `check_shape` and compiled: parsing one costs ~9 µs
/// per request, and agents forward the same predicates again and again.
/// A memo of a pure check: a hit answers exactly what parsing would.
static PARSED: std::sync::OnceLock<std::sync::Mutex<TextMemo<()>>> = std::sync::OnceLock::new();

/// The shapes (`judge::conjunct_shape`) of effective predicates and their
/// parts that parsed: every hop of a chain composes a longer text whose
/// parse costs tens of µs to milliseconds, and every chain under the same
/// policy composes the same texts. A memo of a pure function; texts that
/// do not parse are not remembered (their error is computed again).
static SHAPES: std::sync::OnceLock<std::sync::Mutex<TextMemo<super::judge::Shape>>> =
    std::sync::OnceLock::new();

/// `judge::conjunct_shape(text)`, from the memo when it was computed before.
fn remembered_shape(text: &str) -> Result<super::judge::Shape, String> {
    let shapes = SHAPES.get_or_init(Default::default);
    if let Some(shape) = lock_memo(shapes).texts.get(text) {
        return Ok(*shape);
    }
    let shape = super::judge::conjunct_shape(text)?;
    lock_memo(shapes).remember(text, shape, MAX_SHAPE_MEMO_BYTES);
    Ok(shape)
}

/// Texts and what a pure function of each answered, bounded in bytes.
struct TextMemo<V> {
    texts: std::collections::HashMap<String, V>,
    /// What the texts cost in memory, each its length plus
    /// `ENTRY_OVERHEAD_BYTES`: the memo's bound.
    bytes: usize,
}

impl<V> Default for TextMemo<V> {
    fn default() -> Self {
        Self {
            texts: std::collections::HashMap::new(),
            bytes: 0,
        }
    }
}

/// A `String`, its value and its hash-table slot, beyond the text itself.
const ENTRY_OVERHEAD_BYTES: usize = 64;

impl<V> TextMemo<V> {
    /// Adds a text, forgetting everything first if it would pass
    /// `capacity_bytes` (refilling costs one parse per text, as with no
    /// memo at all — so flooding it costs no more than not having it).
    fn remember(&mut self, text: &str, value: V, capacity_bytes: usize) {
        let cost = text.len() + ENTRY_OVERHEAD_BYTES;
        if self.bytes + cost > capacity_bytes {
            self.texts.clear();
            self.bytes = 0;
        }
        if self.texts.insert(text.to_owned(), value).is_none() {
            self.bytes += cost;
        }
    }
}

fn lock_memo<V>(memo: &std::sync::Mutex<TextMemo<V>>) -> std::sync::MutexGuard<'_, TextMemo<V>> {
    // Inserts are single calls: a poisoned memo is still a correct one.
    memo.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Bounds what the recursive CEL parser will face before it runs:
/// bracket nesting, binary operators, and member selections and indexes
/// (a rough count of the code outside string literals and comments is
/// enough for a bound; see `code_bytes`).
fn check_shape(text: &str) -> Result<(), String> {
    let (mut depth, mut deepest, mut operators, mut selects) = (0usize, 0usize, 0usize, 0usize);
    let mut previous = b' ';
    for (_, c) in code_bytes(text) {
        match c {
            b'(' | b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
                // `a[0][0]…` recurses like `a.b.c…` and nests no deeper.
                selects += usize::from(c == b'[');
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            b'+' | b'-' | b'*' | b'/' | b'%' | b'<' | b'>' | b'?' => operators += 1,
            b'&' | b'|' | b'=' if previous != c => operators += 1,
            b'.' => selects += 1,
            _ => {}
        }
        previous = c;
    }
    if deepest > MAX_PREDICATE_NESTING {
        return Err(format!(
            "nests {deepest} levels deep, at most {MAX_PREDICATE_NESTING}"
        ));
    }
    if selects > MAX_PREDICATE_SELECTS {
        return Err(format!(
            "has {selects} member selections and indexes ('.', '['), at most {MAX_PREDICATE_SELECTS}"
        ));
    }
    if operators > MAX_PREDICATE_OPERATORS {
        return Err(format!(
            "has {operators} operators, at most {MAX_PREDICATE_OPERATORS}"
        ));
    }
    Ok(())
}

/// The bytes of `text` that are code, with their offsets, as CEL's lexer
/// reads it: string literals (single, double and triple quoted; raw ones,
/// prefixed `r`/`R` possibly after `b`/`B`, take no escapes) and `//`
/// comments are skipped, each literal standing as one `"` at its opening
/// quote. A quote inside a comment, or a backslash in a raw string, cannot
/// hide code from whoever reads these.
pub(crate) fn code_bytes(text: &str) -> impl Iterator<Item = (usize, u8)> + '_ {
    let bytes = text.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        loop {
            let c = *bytes.get(i)?;
            match c {
                b'/' if bytes.get(i + 1) == Some(&b'/') => {
                    while i < bytes.len() && bytes[i] != b'\n' {
                        i += 1;
                    }
                }
                b'"' | b'\'' => {
                    let start = i;
                    let prefix = |back: usize| i.checked_sub(back).map(|at| bytes[at]);
                    let raw = matches!(prefix(1), Some(b'r' | b'R'))
                        || (matches!(prefix(1), Some(b'b' | b'B'))
                            && matches!(prefix(2), Some(b'r' | b'R')));
                    let triple = bytes.get(i + 1) == Some(&c) && bytes.get(i + 2) == Some(&c);
                    let delim = if triple { 3 } else { 1 };
                    i += delim;
                    while i < bytes.len() {
                        if !raw && bytes[i] == b'\\' {
                            i += 2;
                            continue;
                        }
                        if bytes[i] == c && (!triple || bytes[i..].starts_with(&[c, c, c])) {
                            i += delim;
                            break;
                        }
                        i += 1;
                    }
                    return Some((start, b'"'));
                }
                _ => {
                    i += 1;
                    return Some((i - 1, c));
                }
            }
        }
    })
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
        let mut memo = TextMemo::<()>::default();
        let capacity = 2 * (4 + ENTRY_OVERHEAD_BYTES);
        for text in ["aaaa", "bbbb", "cccc", "bbbb"] {
            memo.remember(text, (), capacity);
            assert!(memo.bytes <= capacity && memo.texts.contains_key(text));
        }
        let charged: usize = memo
            .texts
            .keys()
            .map(|t| t.len() + ENTRY_OVERHEAD_BYTES)
            .sum();
        assert_eq!(memo.bytes, charged);
    }

    #[test]
    fn checked_before_only_after_every_text_was_parsed() {
        let inherited = Predicate::parse("result.checked_before_a", "p").unwrap();
        let own = "result.checked_before_b";
        assert!(!Predicate::checked_before(&inherited, own), "never seen");
        let parsed = Predicate::parse(own, "p").unwrap();
        assert!(
            !Predicate::checked_before(&inherited, own),
            "own parsed, its composition not yet"
        );
        Predicate::check_effective(&inherited, &parsed, "body.predicate").unwrap();
        assert!(Predicate::checked_before(&inherited, own));
        assert!(Predicate::checked_before(&inherited, &format!("  {own}\n")));
        // Another parent's predicate is another composition.
        let other = Predicate::parse("result.checked_before_c", "p").unwrap();
        assert!(!Predicate::checked_before(&other, own));
        // Nothing to parse at all.
        assert!(Predicate::checked_before(&Predicate::default(), " "));
        // Too long is never cheap: the full check names the field.
        assert!(!Predicate::checked_before(
            &Predicate::default(),
            &"x".repeat(MAX_PREDICATE_BYTES + 1)
        ));
    }

    #[test]
    fn the_shape_memo_answers_as_the_check_does() {
        let inherited = Predicate::parse("result.shape_memo_a", "p").unwrap();
        let own = Predicate::parse("result.shape_memo_b || result.shape_memo_c", "p").unwrap();
        let first = Predicate::check_effective(&inherited, &own, "body.predicate").unwrap();
        let again = Predicate::check_effective(&inherited, &own, "body.predicate").unwrap();
        assert_eq!(first, again, "a hit composes the same text");
        let remembered = lock_memo(SHAPES.get().unwrap())
            .texts
            .get(first.as_str())
            .copied()
            .unwrap();
        let parsed = super::super::judge::conjunct_shape(first.as_str()).unwrap();
        assert_eq!(
            (remembered.depth, remembered.conjuncts),
            (parsed.depth, parsed.conjuncts)
        );
        assert_eq!(parsed.conjuncts, 2);
        // A merge is still refused with a hit on both parts: the
        // composition is checked, not the parts alone.
        let opens = Predicate::from_trusted("result.x || (true".into());
        assert!(Predicate::check_effective(&inherited, &opens, "body.predicate").is_err());
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
        // A chain of member selections recurses in the parser too: 2,000
        // of them (4 KB) overflowed a 2 MiB stack and aborted the process.
        let selects = format!("result{}", ".a".repeat(2_000));
        let refused = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || Predicate::parse(&selects, "p").map(drop))
            .unwrap()
            .join()
            .expect("refused before the parser recurses");
        assert!(refused.unwrap_err().reason.contains("member selections"));
        let indexes = format!("result{}", "[0]".repeat(1_300));
        assert!(Predicate::parse(&indexes, "p").is_err());
        // Neither a quote in a comment, a raw string's backslash nor a
        // triple-quoted string hides what follows from the count.
        for hidden in [
            format!("true // '\n&& result{}", ".a".repeat(200)),
            format!(r"r'\' == 'x' && result{}", ".a".repeat(200)),
            format!("'''a'b''' == 'x' && result{}", ".a".repeat(200)),
        ] {
            let err = Predicate::parse(&hidden, "p").unwrap_err();
            assert!(
                err.reason.contains("member selections"),
                "{hidden:?}: {}",
                err.reason
            );
        }
        let lexed: Vec<u8> = code_bytes(
            r"a + 'b+c' // d+e
+ r'\' + '''f'g''' + br'x'",
        )
        .map(|(_, c)| c)
        .collect();
        assert_eq!(lexed, b"a + \" \n+ r\" + \" + br\"".to_vec());
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
            "(result.schema_valid\n) && (result.within_scope || result.consumed < 3\n) && (result.tool_calls < 10\n)"
        );
        assert!(Predicate::parse(abc.as_str(), "p").is_ok());
        let none = Predicate::default();
        assert_eq!(Predicate::conjoin(&ab, &none).unwrap(), ab);
        assert_eq!(
            Predicate::conjoin(&none, &b).unwrap().as_str(),
            "(result.within_scope || result.consumed < 3\n)"
        );
        assert!(Predicate::conjoin(&none, &none).unwrap().is_empty());
    }

    /// An ancestor's trailing `//` comment cannot swallow
    /// the closing parenthesis, and a forwarded `true⏎|| true` cannot turn
    /// the ancestor's conjunct into a disjunction.
    #[test]
    fn comments_and_newlines_cannot_merge_conjuncts() {
        let none = Predicate::default();
        let p = Predicate::parse("result.schema_valid", "p").unwrap();
        let q = Predicate::parse("result.output.approved // must be approved", "p").unwrap();
        let attack = Predicate::parse("true\n|| true", "p").unwrap();
        let pq = Predicate::check_effective(
            &Predicate::check_effective(&none, &p, "p").unwrap(),
            &q,
            "p",
        )
        .unwrap();
        let all = Predicate::check_effective(&pq, &attack, "p").unwrap();
        let shape = crate::judge::conjunct_shape(all.as_str()).unwrap();
        assert_eq!(shape.conjuncts, 3, "{all:?}");
        // An effective predicate in the old, comment-swallowing form is
        // refused, never issued.
        let old = Predicate::from_trusted("(result.schema_valid) && (result.ok // c)".into());
        assert!(Predicate::check_effective(&old, &attack, "body.predicate").is_err());
    }

    #[test]
    fn an_effective_predicate_the_judge_cannot_evaluate_is_refused() {
        // Composition parses on the broker's deep-stack threads.
        std::thread::Builder::new()
            .stack_size(crate::limits::DEEP_STACK_BYTES)
            .spawn(|| {
                // Every shape bound holds, yet operators over a long
                // selection nest deeper than the judge evaluates: such a
                // part parses, but could never be judged, so it is refused
                // at issuance.
                let own = format!(
                    "result{}{} == 1",
                    ".a".repeat(MAX_PREDICATE_SELECTS - 1),
                    " + 1".repeat(MAX_PREDICATE_OPERATORS - 2)
                );
                let own = Predicate::parse(&own, "p").unwrap();
                let mut inherited = Predicate::default();
                let mut refused = None;
                for hop in 0..64 {
                    match Predicate::check_effective(&inherited, &own, "body.predicate") {
                        Ok(next) => inherited = next,
                        Err(e) => {
                            refused = Some((hop, e));
                            break;
                        }
                    }
                }
                let (hop, e) = refused.expect("a deep enough chain is refused");
                assert_eq!(hop, 0);
                assert_eq!(e.field, "body.predicate");
                assert!(e.reason.contains("deeper than the judge"), "{}", e.reason);
                // Sixty-four hops of parts at every parser bound compose.
                let own = format!(
                    "{}result{} == 1{}",
                    "(".repeat(MAX_PREDICATE_NESTING),
                    ".a".repeat(MAX_PREDICATE_SELECTS - 1),
                    ")".repeat(MAX_PREDICATE_NESTING)
                );
                let own = Predicate::parse(&own, "p").unwrap();
                let mut inherited = Predicate::default();
                for _ in 0..64 {
                    inherited = Predicate::check_effective(&inherited, &own, "p").unwrap();
                }
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
