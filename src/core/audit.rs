//! Audit of delegations (DESIGN.md §Audit, seeds/000): which paths a
//! parent's task text named, what the host then observed its child do, which
//! paths two contracts of one tree both mutated, and how runs aggregate into
//! groups. Owns the named-path rule, per-contract classification, conflict
//! detection and aggregation. Counts come from host observations only, never
//! from the delegate's claim; rates are ratios of integer sums over a group,
//! never averages of per-run rates, which would weigh a child that read two
//! files like one that read forty.
//!
//! # The named-path rule
//!
//! [`named_paths`] reads the task text a parent wrote for its child:
//!
//! 1. **Tokens.** The text is split on whitespace and on `,` `;` `|`. In a
//!    token holding `](` (a Markdown link) only what follows it is kept. A
//!    token holding `://` is a URL, never a path.
//! 2. **Trimming.** Leading `` ` `` `"` `'` `(` `[` `{` `<` `*` are dropped,
//!    then trailing `` ` `` `"` `'` `)` `]` `}` `>` `*` and sentence
//!    punctuation `.` `,` `;` `:` `!` `?`, in any mix, except that a token
//!    whose last component is `..` (`src/..`) is dropped, not trimmed to
//!    `src/`. Then up to [`MAX_LINE_REFERENCE_PARTS`] line references `:N`
//!    (N digits) are dropped: `token.rs:42:7` names `token.rs`.
//! 3. **Shape.** What remains is at most [`MAX_NAMED_PATH_BYTES`] bytes of
//!    `[A-Za-z0-9._/-]` only, holds an ASCII letter, and does not start with
//!    `-`. So `~/x`, Windows paths (`src\auth`), non-ASCII names, flags
//!    (`--release`) and dates (`12/05/2024`) are not paths.
//! 4. **Normalization.** Leading `./` are dropped; a trailing `/` marks a
//!    directory and is dropped; a leading `/` (absolute path) is kept. Every
//!    remaining component must be non-empty and neither `.` nor `..`.
//! 5. **Kind.** With a trailing `/` it is a directory (a scope hint).
//!    Otherwise, when its last component is a file name it is a file. A file
//!    name has an extension — the part after its last `.`, 1 to
//!    [`MAX_EXTENSION_CHARS`] ASCII letters and digits starting with a letter
//!    (`token.rs`, `.env`; not `1.5`, `v1.2.3`) — or is one of
//!    [`EXTENSIONLESS_FILES`] (`Makefile`, `Dockerfile`, …; exact case).
//!    Otherwise, when the token held a `/` it is a directory (`src/auth`).
//!    Otherwise it is a plain word, not a path.
//! 6. **Prose.** Not paths either: a token without `/` whose `.`-separated
//!    parts are all one character (`e.g`, `i.e`, `a.k.a`), and the
//!    [`PROSE_SLASH_WORDS`] (`and/or`, `I/O`, …; any case).
//! 7. **Result.** Directories and files are each deduplicated, in
//!    first-seen order, stored without a trailing `/`; at most
//!    [`MAX_NAMED_PATHS`] are kept in all, the first ones named.
//!
//! The rule errs towards naming: a spurious name (`Node.js`, `example.com`,
//! a bare `.github`, a scheme-less `github.com/org/repo`) matches no
//! evidence and only inflates `parent_named_files` or `parent_scope_hints`,
//! while a missed name would wrongly inflate discovery.

use std::collections::{BTreeMap, BTreeSet};

use super::error::InputError;
use super::scope::Scope;

pub use crate::core::limits::MAX_EXTENSION_CHARS;
pub use crate::core::limits::MAX_GROUP_BY_KEYS;
pub use crate::core::limits::MAX_LINE_REFERENCE_PARTS;
pub use crate::core::limits::MAX_NAMED_PATH_BYTES;
pub use crate::core::limits::MAX_NAMED_PATHS;

/// Extensionless names read as files (compared with exact case).
pub const EXTENSIONLESS_FILES: &[&str] = &[
    "Makefile",
    "GNUmakefile",
    "Dockerfile",
    "Containerfile",
    "Justfile",
    "Rakefile",
    "Gemfile",
    "Procfile",
    "Vagrantfile",
    "Jenkinsfile",
    "LICENSE",
    "README",
    "CHANGELOG",
    "CODEOWNERS",
];

/// Slash-joined words of prose, not paths (compared ignoring ASCII case).
pub const PROSE_SLASH_WORDS: &[&str] = &[
    "and/or",
    "either/or",
    "i/o",
    "n/a",
    "w/o",
    "read/write",
    "yes/no",
    "on/off",
    "true/false",
    "input/output",
    "client/server",
    "tcp/ip",
];

/// Characters that separate tokens besides whitespace.
const SEPARATORS: [char; 3] = [',', ';', '|'];
/// Wrappers dropped from the front of a token.
const OPENERS: [char; 8] = ['`', '"', '\'', '(', '[', '{', '<', '*'];
/// Wrappers and sentence punctuation dropped from the end of a token.
const CLOSERS: [char; 14] = [
    '`', '"', '\'', ')', ']', '}', '>', '*', '.', ',', ';', ':', '!', '?',
];

/// The paths a delegation text names (see the module doc for the rule).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamedPaths {
    /// Directories the text narrowed the search to, without trailing `/`.
    pub scope_hints: Vec<String>,
    /// Specific files the text handed over.
    pub files: Vec<String>,
}

enum Named {
    Directory(String),
    File(String),
}

/// Extracts the directories and files `text` names (module doc, "The
/// named-path rule").
pub fn named_paths(text: &str) -> NamedPaths {
    let mut out = NamedPaths::default();
    for token in text.split(|c: char| c.is_whitespace() || SEPARATORS.contains(&c)) {
        if out.scope_hints.len() + out.files.len() >= MAX_NAMED_PATHS {
            break;
        }
        let (list, path) = match parse_token(token) {
            Some(Named::Directory(p)) => (&mut out.scope_hints, p),
            Some(Named::File(p)) => (&mut out.files, p),
            None => continue,
        };
        // Linear dedup: lists are bounded by MAX_NAMED_PATHS.
        if !list.contains(&path) {
            list.push(path);
        }
    }
    out
}

fn parse_token(token: &str) -> Option<Named> {
    let token = token.find("](").map_or(token, |i| &token[i + 2..]);
    if token.contains("://") {
        return None;
    }
    let opened = token.trim_start_matches(OPENERS);
    let trimmed = opened.trim_end_matches(CLOSERS);
    // "src/.." must not become "src/" ("src/." and "src/..." may).
    let tail = &opened[trimmed.len()..];
    if trimmed.ends_with('/') && tail.len() - tail.trim_start_matches('.').len() == 2 {
        return None;
    }
    let body = strip_line_reference(trimmed);
    if body.is_empty()
        || body.len() > MAX_NAMED_PATH_BYTES
        || body.starts_with('-')
        || !body.bytes().all(is_path_byte)
        || !body.bytes().any(|b| b.is_ascii_alphabetic())
    {
        return None;
    }
    let has_slash = body.contains('/');
    let mut path = body;
    while let Some(rest) = path.strip_prefix("./") {
        path = rest;
    }
    if path.len() != body.len() && path.starts_with('/') {
        return None; // ".//x": an empty component, not an absolute path.
    }
    let directory_marked = path.ends_with('/');
    let path = path.trim_end_matches('/');
    let relative = path.strip_prefix('/').unwrap_or(path);
    if relative.is_empty()
        || relative
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
        || PROSE_SLASH_WORDS
            .iter()
            .any(|w| w.eq_ignore_ascii_case(path))
    {
        return None;
    }
    let last = relative.rsplit('/').next().unwrap_or(relative);
    if directory_marked {
        Some(Named::Directory(path.to_owned()))
    } else if is_file_name(last) {
        if !has_slash && path.split('.').all(|part| part.len() == 1) {
            return None; // "e.g", "i.e": abbreviations.
        }
        Some(Named::File(path.to_owned()))
    } else if has_slash {
        Some(Named::Directory(path.to_owned()))
    } else {
        None
    }
}

fn strip_line_reference(mut s: &str) -> &str {
    for _ in 0..MAX_LINE_REFERENCE_PARTS {
        match s.rsplit_once(':') {
            Some((head, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => s = head,
            _ => break,
        }
    }
    s
}

fn is_path_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-')
}

fn is_file_name(name: &str) -> bool {
    EXTENSIONLESS_FILES.contains(&name)
        || name.rsplit_once('.').is_some_and(|(_, ext)| {
            (1..=MAX_EXTENSION_CHARS).contains(&ext.len())
                && ext.starts_with(|c: char| c.is_ascii_alphabetic())
                && ext.bytes().all(|b| b.is_ascii_alphanumeric())
        })
}

/// The form an observed path is counted and compared in: the lexical
/// normalization of `Scope::covers_observed` ("./", "//" and a trailing "/"
/// dropped). A path that cannot be normalized (a ".." component, a control
/// character, ".") is kept verbatim: it is still a receipt, but never under
/// a named file nor in a scope. The empty path names nothing: `None`.
fn path_key(raw: &str) -> Option<String> {
    if raw.is_empty() {
        return None;
    }
    if raw.chars().any(char::is_control) {
        return Some(raw.to_owned());
    }
    let mut parts = Vec::new();
    for component in raw.split('/') {
        match component {
            "" | "." => {}
            ".." => return Some(raw.to_owned()),
            c => parts.push(c),
        }
    }
    let joined = parts.join("/");
    Some(match (raw.starts_with('/'), joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => raw.to_owned(),
        (false, false) => joined,
    })
}

/// Kind of one host-observed fact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FactKind {
    ToolCall,
    Read,
    Mutation,
}

/// One host-observed fact about a contract's execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedFact {
    pub kind: FactKind,
    /// Path read or mutated; may be empty for tool calls.
    pub path: String,
}

/// What one contract's audit is computed from.
#[derive(Clone, Copy, Debug)]
pub struct AuditInput<'a> {
    /// Hops from the root.
    pub depth: u32,
    /// What the parent's task text for this contract named.
    pub named: &'a NamedPaths,
    pub write_scope: &'a Scope,
    pub observations: &'a [ObservedFact],
    /// `None` until completed; then whether a typed report came with it.
    pub has_report: Option<bool>,
    /// Criteria the broker's verdict refused.
    pub downgrades: u32,
}

/// One contract's audit (seeds/000 `DelegationAudit`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Audit {
    pub depth: u32,
    pub tool_calls: u64,
    pub mutations: u64,
    /// Distinct mutated paths (normalized), sorted.
    pub mutation_paths: Vec<String>,
    /// Mutations outside the write scope, one per mutation.
    pub claim_violations: u64,
    /// `None` until completed; then whether a typed report came with it.
    pub has_report: Option<bool>,
    pub downgrades: u32,
    /// Directories the parent's text named.
    pub parent_scope_hints: u32,
    /// Files the parent's text named.
    pub parent_named_files: u32,
    /// Distinct paths read or mutated.
    pub evidence_paths: u64,
    /// Evidence paths not equal to or below a named file.
    pub discovered_paths: u64,
    /// A typed report the verdict refused criteria of.
    pub false_completion: bool,
}

impl Audit {
    pub fn completed(&self) -> bool {
        self.has_report.is_some()
    }
}

/// Classifies one contract (seeds/000 `ClassifyEvidenceOrigin` and
/// `FalseCompletion`). Discovery is judged against named files only: a
/// child sent to a directory still had to work out which file mattered.
pub fn classify(input: AuditInput<'_>) -> Audit {
    let named_files = Scope::from_trusted(input.named.files.clone());
    let mut tool_calls = 0u64;
    let mut mutations = 0u64;
    let mut claim_violations = 0u64;
    let mut mutation_paths = BTreeSet::new();
    let mut evidence = BTreeSet::new();
    for fact in input.observations {
        match fact.kind {
            FactKind::ToolCall => tool_calls += 1,
            FactKind::Read => evidence.extend(path_key(&fact.path)),
            FactKind::Mutation => {
                mutations += 1;
                // The same test as the judge's `within_scope`.
                if !input.write_scope.covers_observed(&fact.path) {
                    claim_violations += 1;
                }
                if let Some(key) = path_key(&fact.path) {
                    mutation_paths.insert(key.clone());
                    evidence.insert(key);
                }
            }
        }
    }
    let discovered = evidence
        .iter()
        .filter(|p| !named_files.covers_observed(p))
        .count();
    let has_report = input.has_report;
    Audit {
        depth: input.depth,
        tool_calls,
        mutations,
        mutation_paths: mutation_paths.into_iter().collect(),
        claim_violations,
        has_report,
        downgrades: input.downgrades,
        parent_scope_hints: count32(input.named.scope_hints.len()),
        parent_named_files: count32(input.named.files.len()),
        evidence_paths: evidence.len() as u64,
        discovered_paths: discovered as u64,
        false_completion: has_report == Some(true) && input.downgrades > 0,
    }
}

fn count32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A path mutated by two or more contracts of one tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict<K> {
    /// Normalized path.
    pub path: String,
    /// The distinct contracts that mutated it, ascending.
    pub contracts: Vec<K>,
}

/// Conflicts within one tree, from each contract's mutated paths (keys may
/// repeat; paths are normalized as in `classify`). Ascending by path.
pub fn conflicts<K: Ord + Clone>(mutations_by_contract: &[(K, Vec<String>)]) -> Vec<Conflict<K>> {
    let mut by_path: BTreeMap<String, BTreeSet<&K>> = BTreeMap::new();
    for (key, paths) in mutations_by_contract {
        for path in paths.iter().filter_map(|p| path_key(p)) {
            by_path.entry(path).or_default().insert(key);
        }
    }
    by_path
        .into_iter()
        .filter(|(_, keys)| keys.len() >= 2)
        .map(|(path, keys)| Conflict {
            path,
            contracts: keys.into_iter().cloned().collect(),
        })
        .collect()
}

/// One run (a root and its tree): its labels and sums over its contracts.
/// Sums saturate rather than wrap.
/// The counters audits sum, per run and per group of runs: the one list
/// of them, added in one place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sums {
    /// Contracts audited.
    pub contracts: u64,
    pub discovered: u64,
    pub evidence: u64,
    /// Contracts that completed with a typed report.
    pub contracts_with_report: u64,
    pub false_completions: u64,
    pub claim_violations: u64,
    pub mutations: u64,
    /// Paths mutated by two or more contracts (`conflicts(..).len()`).
    pub conflicts: u64,
    pub escalations: u64,
    /// Refusals by their primary invariant code.
    pub refusals_by_code: BTreeMap<String, u64>,
}

impl Sums {
    /// One contract's audit as counters.
    pub fn of_audit(audit: &Audit) -> Self {
        Self {
            contracts: 1,
            discovered: audit.discovered_paths,
            evidence: audit.evidence_paths,
            contracts_with_report: u64::from(audit.has_report == Some(true)),
            false_completions: u64::from(audit.false_completion),
            claim_violations: audit.claim_violations,
            mutations: audit.mutations,
            ..Self::default()
        }
    }

    pub fn add(&mut self, other: &Sums) {
        let Sums {
            contracts,
            discovered,
            evidence,
            contracts_with_report,
            false_completions,
            claim_violations,
            mutations,
            conflicts,
            escalations,
            refusals_by_code,
        } = other;
        self.contracts = self.contracts.saturating_add(*contracts);
        self.discovered = self.discovered.saturating_add(*discovered);
        self.evidence = self.evidence.saturating_add(*evidence);
        self.contracts_with_report = self
            .contracts_with_report
            .saturating_add(*contracts_with_report);
        self.false_completions = self.false_completions.saturating_add(*false_completions);
        self.claim_violations = self.claim_violations.saturating_add(*claim_violations);
        self.mutations = self.mutations.saturating_add(*mutations);
        self.conflicts = self.conflicts.saturating_add(*conflicts);
        self.escalations = self.escalations.saturating_add(*escalations);
        for (code, n) in refusals_by_code {
            let sum = self.refusals_by_code.entry(code.clone()).or_default();
            *sum = sum.saturating_add(*n);
        }
    }
}

/// One run (root): its labels, its sums and its budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunTotals {
    pub labels: BTreeMap<String, String>,
    pub sums: Sums,
    /// Units the root spent and was granted.
    pub budget_spent: i64,
    pub budget_granted: i64,
}

impl RunTotals {
    /// Adds one contract's audit to the sums.
    pub fn add_audit(&mut self, audit: &Audit) {
        self.sums.add(&Sums::of_audit(audit));
    }
}

/// One group of runs: sums, and rates computed from the sums.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GroupRow {
    /// The group's value of each group-by label ("" when a run lacks it).
    pub key: BTreeMap<String, String>,
    pub runs: u64,
    pub sums: Sums,
    /// Wider than a run's sums: many roots of up to 10^15 units each.
    pub budget_spent: i128,
    pub budget_granted: i128,
    /// Σ discovered / Σ evidence.
    pub discovery_rate: Option<f64>,
    /// Σ false completions / Σ contracts with report.
    pub false_completion_rate: Option<f64>,
    /// Σ claim violations / Σ mutations.
    pub claim_violations_per_mutation: Option<f64>,
    /// Σ spent / Σ granted; `None` unless something was granted.
    pub spent_over_granted: Option<f64>,
}

impl GroupRow {
    fn add(&mut self, run: &RunTotals) {
        self.runs = self.runs.saturating_add(1);
        self.sums.add(&run.sums);
        self.budget_spent += i128::from(run.budget_spent);
        self.budget_granted += i128::from(run.budget_granted);
    }

    fn with_rates(mut self) -> Self {
        let s = &self.sums;
        self.discovery_rate = ratio(s.discovered, s.evidence);
        self.false_completion_rate = ratio(s.false_completions, s.contracts_with_report);
        self.claim_violations_per_mutation = ratio(s.claim_violations, s.mutations);
        self.spent_over_granted = (self.budget_granted > 0)
            .then(|| self.budget_spent as f64 / self.budget_granted as f64);
        self
    }
}

/// `num / den` from integer sums, rounded once; `None` when `den` is 0.
pub fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// Groups runs by the values of the `group_by` labels (a run without a label
/// groups under "" for it) and sums each group. Groups come in ascending
/// order of their key, compared as the list of (label, value) pairs sorted
/// by label; no runs, no groups. An empty `group_by` makes one group.
pub fn aggregate(runs: &[RunTotals], group_by: &[String]) -> Vec<GroupRow> {
    let mut groups: BTreeMap<BTreeMap<String, String>, GroupRow> = BTreeMap::new();
    for run in runs {
        let key: BTreeMap<String, String> = group_by
            .iter()
            .map(|k| (k.clone(), run.labels.get(k).cloned().unwrap_or_default()))
            .collect();
        groups
            .entry(key)
            .or_insert_with_key(|key| GroupRow {
                key: key.clone(),
                ..GroupRow::default()
            })
            .add(run);
    }
    groups.into_values().map(GroupRow::with_rates).collect()
}

/// Validates the label keys to group by: at most `MAX_GROUP_BY_KEYS`, each
/// a label key (1..=64 bytes of `[a-z0-9_.-]`). Returns them deduplicated,
/// in order.
pub fn check_group_by(raw: &[String], field: &'static str) -> Result<Vec<String>, InputError> {
    if raw.len() > MAX_GROUP_BY_KEYS {
        return Err(InputError::new(
            field,
            format!("{} keys, at most {MAX_GROUP_BY_KEYS}", raw.len()),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(raw.len());
    for key in raw {
        super::check_label_key(key, field)?;
        if !out.contains(key) {
            out.push(key.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn named(text: &str) -> (Vec<String>, Vec<String>) {
        let n = named_paths(text);
        (n.scope_hints, n.files)
    }

    fn fact(kind: FactKind, path: &str) -> ObservedFact {
        ObservedFact {
            kind,
            path: path.to_owned(),
        }
    }

    fn scope(p: &[&str]) -> Scope {
        Scope::parse(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "s").unwrap()
    }

    fn input<'a>(
        named: &'a NamedPaths,
        write_scope: &'a Scope,
        observations: &'a [ObservedFact],
    ) -> AuditInput<'a> {
        AuditInput {
            depth: 1,
            named,
            write_scope,
            observations,
            has_report: None,
            downgrades: 0,
        }
    }

    #[test]
    fn markdown_backticks_and_links() {
        let (dirs, files) = named(
            "Fix the expiry check in `src/auth/token.rs` (see [the docs](docs/auth.md)) \
             and **README.md**; run `cargo test`.",
        );
        assert!(dirs.is_empty());
        assert_eq!(files, ["src/auth/token.rs", "docs/auth.md", "README.md"]);
    }

    #[test]
    fn prose_punctuation_is_not_part_of_a_path() {
        let (dirs, files) = named(
            "Look in src/auth/, then fix src/auth/token.rs. Is config.toml right? \
             Also check \"scripts/run.sh\"! And lib/util: done.",
        );
        assert_eq!(dirs, ["src/auth", "lib/util"]);
        assert_eq!(
            files,
            ["src/auth/token.rs", "config.toml", "scripts/run.sh"]
        );
    }

    #[test]
    fn urls_are_ignored() {
        let (dirs, files) = named(
            "Spec at https://example.com/spec/v1/index.html and http://localhost:8080/api; \
             mirror ftp://host/a.tar.gz. Edit api/handler.go.",
        );
        assert!(dirs.is_empty());
        assert_eq!(files, ["api/handler.go"]);
    }

    #[test]
    fn versions_numbers_and_abbreviations_are_not_files() {
        let (dirs, files) = named(
            "Bump to v1.2.3 (was 1.5, i.e. python3.11), e.g. like 0.1.0-rc1; \
             a 1.5x speedup by 12/05/2024, 24/7, a.k.a. fast. Use --release.",
        );
        assert!(dirs.is_empty(), "{dirs:?}");
        assert!(files.is_empty(), "{files:?}");
    }

    #[test]
    fn paths_in_parentheses_brackets_and_quotes() {
        let (dirs, files) =
            named("Two callers (src/a.rs and src/b.rs) [see tests/it.rs] <lib/>, {'x/y.py'}.");
        assert_eq!(dirs, ["lib"]);
        assert_eq!(files, ["src/a.rs", "src/b.rs", "tests/it.rs", "x/y.py"]);
    }

    #[test]
    fn windows_paths_home_paths_and_escapes_are_not_paths() {
        let (dirs, files) = named(
            r"Edit src\auth\token.rs or C:\repo\main.rs, not ~/notes.md, ../secret.key,
              src/../etc/passwd, (src/..) nor ./ alone.",
        );
        assert!(dirs.is_empty(), "{dirs:?}");
        assert!(files.is_empty(), "{files:?}");
    }

    #[test]
    fn directories_by_trailing_slash_or_slash_without_extension() {
        let (dirs, files) = named("Work in src/auth/ and ./src/session, also auth/ and /etc/app/.");
        assert_eq!(dirs, ["src/auth", "src/session", "auth", "/etc/app"]);
        assert!(files.is_empty());
    }

    #[test]
    fn duplicates_keep_first_seen_order() {
        let (dirs, files) = named("b.rs then a.rs then ./b.rs and `a.rs`; src/ then src and src/.");
        assert_eq!(dirs, ["src"]);
        assert_eq!(files, ["b.rs", "a.rs"]);
    }

    #[test]
    fn extensionless_files_dotfiles_and_line_references() {
        let (dirs, files) = named(
            "Update Makefile, docker/Dockerfile, .env, .github/workflows and \
             src/lib.rs:42:7 (line src/main.rs:10). The makefile is fine.",
        );
        assert_eq!(dirs, [".github/workflows"]);
        assert_eq!(
            files,
            [
                "Makefile",
                "docker/Dockerfile",
                ".env",
                "src/lib.rs",
                "src/main.rs"
            ]
        );
    }

    #[test]
    fn prose_slash_words_separators_and_flags() {
        let (dirs, files) = named(
            "Read and/or write (I/O, read/write); files a.rs,b.rs|c.rs; --out=x/y.rs -v -x/y.",
        );
        assert!(dirs.is_empty(), "{dirs:?}");
        assert_eq!(files, ["a.rs", "b.rs", "c.rs"]);
    }

    #[test]
    fn named_paths_are_bounded() {
        let text: String = (0..MAX_NAMED_PATHS + 10)
            .map(|i| format!("f{i}.rs d{i}/ "))
            .collect();
        let n = named_paths(&text);
        assert_eq!(n.scope_hints.len() + n.files.len(), MAX_NAMED_PATHS);
        assert_eq!(n.files[0], "f0.rs");
        let long = format!("{}.rs", "a".repeat(MAX_NAMED_PATH_BYTES));
        assert_eq!(named_paths(&long), NamedPaths::default());
        let fits = format!("{}.rs", "a".repeat(MAX_NAMED_PATH_BYTES - 3));
        assert_eq!(named_paths(&fits).files, [fits]);
    }

    #[test]
    fn acceptance_a_discovery_against_named_files() {
        let named = named_paths("Narrow it down in `src/auth/`: start from src/auth/token.rs.");
        assert_eq!(named.scope_hints, ["src/auth"]);
        assert_eq!(named.files, ["src/auth/token.rs"]);
        let obs = [
            fact(FactKind::Read, "src/auth/token.rs"),
            fact(FactKind::Read, "src/auth/session.rs"),
            fact(FactKind::Read, "./docs/auth.md"),
            fact(FactKind::Read, "src/auth/token.rs"),
            fact(FactKind::ToolCall, ""),
        ];
        let ws = scope(&["src/auth"]);
        let a = classify(input(&named, &ws, &obs));
        assert_eq!(a.parent_scope_hints, 1);
        assert_eq!(a.parent_named_files, 1);
        assert_eq!(a.evidence_paths, 3);
        assert_eq!(a.discovered_paths, 2);
        assert_eq!(a.tool_calls, 1);
    }

    #[test]
    fn a_named_directory_does_not_count_as_discovery_help() {
        // Only files count: a child sent to src/auth/ still discovered.
        let named = named_paths("Look in src/auth/.");
        let obs = [fact(FactKind::Read, "src/auth/token.rs")];
        let a = classify(input(&named, &Scope::default(), &obs));
        assert_eq!((a.evidence_paths, a.discovered_paths), (1, 1));
    }

    #[test]
    fn under_a_named_file_means_equal_or_below_by_component() {
        let named = named_paths("See pkg/mod.rs.");
        let obs = [
            fact(FactKind::Read, "pkg/mod.rs"),
            fact(FactKind::Read, "pkg/mod.rs/inner"),
            fact(FactKind::Read, "pkg/mod.rsx"),
            fact(FactKind::Read, "pkg/mod.rs/../../etc/passwd"),
        ];
        let a = classify(input(&named, &Scope::default(), &obs));
        assert_eq!((a.evidence_paths, a.discovered_paths), (4, 2));
    }

    #[test]
    fn mutations_violations_and_false_completion() {
        let named = NamedPaths::default();
        let ws = scope(&["src"]);
        let obs = [
            fact(FactKind::Mutation, "src/a.rs"),
            fact(FactKind::Mutation, "./src/a.rs"),
            fact(FactKind::Mutation, "docs/x.md"),
            fact(FactKind::Mutation, "docs/x.md"),
            fact(FactKind::Mutation, "src/../etc/passwd"),
            fact(FactKind::Read, "src/b.rs"),
            fact(FactKind::ToolCall, "src/c.rs"),
        ];
        let mut i = input(&named, &ws, &obs);
        i.has_report = Some(true);
        i.downgrades = 2;
        i.depth = 3;
        let a = classify(i);
        assert_eq!(a.depth, 3);
        assert_eq!(a.mutations, 5);
        assert_eq!(a.claim_violations, 3, "counted per mutation");
        assert_eq!(
            a.mutation_paths,
            ["docs/x.md", "src/../etc/passwd", "src/a.rs"]
        );
        assert_eq!(a.evidence_paths, 4, "tool call paths are not evidence");
        assert_eq!(a.tool_calls, 1);
        assert!(a.false_completion && a.completed());

        for (has_report, downgrades, expect) in [
            (None, 2, false),
            (Some(false), 2, false),
            (Some(true), 0, false),
            (Some(true), 1, true),
        ] {
            let mut i = input(&named, &ws, &obs);
            i.has_report = has_report;
            i.downgrades = downgrades;
            assert_eq!(classify(i).false_completion, expect);
        }
    }

    #[test]
    fn conflicts_need_two_distinct_contracts() {
        let by = [
            (
                [1u8; 32],
                vec!["src/a.rs".to_owned(), "src/b.rs".to_owned()],
            ),
            (
                [2u8; 32],
                vec!["./src/a.rs".to_owned(), "src/c.rs".to_owned()],
            ),
            ([1u8; 32], vec!["src/b.rs".to_owned()]),
            (
                [3u8; 32],
                vec!["src/c.rs".to_owned(), "src/a.rs/".to_owned()],
            ),
        ];
        let c = conflicts(&by);
        assert_eq!(
            c,
            [
                Conflict {
                    path: "src/a.rs".into(),
                    contracts: vec![[1u8; 32], [2; 32], [3; 32]],
                },
                Conflict {
                    path: "src/c.rs".into(),
                    contracts: vec![[2u8; 32], [3; 32]],
                },
            ]
        );
        assert!(conflicts::<u8>(&[]).is_empty());
    }

    fn run(labels: &[(&str, &str)], discovered: u64, evidence: u64) -> RunTotals {
        RunTotals {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            sums: Sums {
                discovered,
                evidence,
                ..Sums::default()
            },
            ..RunTotals::default()
        }
    }

    #[test]
    fn acceptance_b_rates_are_ratios_of_sums() {
        let runs = [
            run(&[("arm", "flat")], 1, 2),
            run(&[("arm", "flat")], 4, 40),
        ];
        let rows = aggregate(&runs, &["arm".to_owned()]);
        assert_eq!(rows.len(), 1);
        let rate = rows[0].discovery_rate.unwrap();
        assert_eq!(rate, 5.0 / 42.0);
        let mean_of_rates = (1.0 / 2.0 + 4.0 / 40.0) / 2.0;
        assert!((mean_of_rates - 0.3f64).abs() < 1e-12);
        assert_ne!(rate, mean_of_rates);
        assert_eq!(
            (rows[0].sums.discovered, rows[0].sums.evidence, rows[0].runs),
            (5, 42, 2)
        );
    }

    #[test]
    fn groups_are_keyed_sorted_and_missing_labels_are_empty() {
        let mut a = run(&[("arm", "tree"), ("run", "1")], 1, 1);
        a.sums
            .refusals_by_code
            .insert("NO_RETRY_HEADROOM".into(), 2);
        a.budget_spent = 6;
        a.budget_granted = 10;
        let mut b = run(&[("arm", "flat"), ("run", "2")], 0, 3);
        b.sums
            .refusals_by_code
            .insert("NO_RETRY_HEADROOM".into(), 1);
        let c = run(&[("run", "3")], 0, 0);
        let mut d = run(&[("arm", "tree")], 0, 1);
        d.sums.refusals_by_code.insert("DEPTH".into(), 1);
        d.budget_spent = i64::MAX;
        d.budget_granted = i64::MAX;
        let rows = aggregate(&[a, b, c, d], &["arm".to_owned()]);
        let keys: Vec<&str> = rows.iter().map(|r| r.key["arm"].as_str()).collect();
        assert_eq!(keys, ["", "flat", "tree"]);
        assert_eq!(rows[0].discovery_rate, None);
        assert_eq!(rows[0].spent_over_granted, None);
        assert_eq!(rows[1].discovery_rate, Some(0.0));
        let tree = &rows[2];
        assert_eq!(tree.runs, 2);
        assert_eq!(tree.discovery_rate, Some(0.5));
        assert_eq!(
            tree.sums.refusals_by_code,
            BTreeMap::from([("DEPTH".into(), 1), ("NO_RETRY_HEADROOM".into(), 2)])
        );
        assert_eq!(tree.budget_granted, i128::from(i64::MAX) + 10);
        assert!(tree.spent_over_granted.unwrap() <= 1.0);

        let all = aggregate(&[run(&[("arm", "a")], 1, 2), run(&[], 3, 4)], &[]);
        assert_eq!(all.len(), 1);
        assert!(all[0].key.is_empty());
        assert!(aggregate(&[], &["arm".to_owned()]).is_empty());
    }

    #[test]
    fn run_totals_sum_audits() {
        let mut t = RunTotals::default();
        for (has_report, false_completion) in
            [(Some(true), true), (Some(false), false), (None, false)]
        {
            t.add_audit(&Audit {
                mutations: 2,
                claim_violations: 1,
                evidence_paths: 3,
                discovered_paths: 1,
                has_report,
                false_completion,
                ..Audit::default()
            });
        }
        assert_eq!(
            (
                t.sums.contracts,
                t.sums.contracts_with_report,
                t.sums.false_completions
            ),
            (3, 1, 1)
        );
        assert_eq!(
            (
                t.sums.mutations,
                t.sums.claim_violations,
                t.sums.evidence,
                t.sums.discovered
            ),
            (6, 3, 9, 3)
        );
        let rows = aggregate(&[t], &[]);
        assert_eq!(rows[0].false_completion_rate, Some(1.0));
        assert_eq!(rows[0].claim_violations_per_mutation, Some(0.5));
    }

    #[test]
    fn group_by_keys_are_validated() {
        let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            check_group_by(&keys(&["arm", "run", "arm"]), "g").unwrap(),
            ["arm", "run"]
        );
        assert!(check_group_by(&keys(&["Arm"]), "g").is_err());
        assert!(check_group_by(&keys(&[""]), "g").is_err());
        let many: Vec<String> = (0..=MAX_GROUP_BY_KEYS).map(|i| format!("k{i}")).collect();
        assert_eq!(check_group_by(&many, "g").unwrap_err().field, "g");
    }

    fn path_strategy() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop_oneof![
                Just("src".to_owned()),
                Just("a.rs".to_owned()),
                Just("b.md".to_owned()),
                Just(".".to_owned()),
                Just("..".to_owned()),
                Just(String::new()),
                "[a-z]{1,3}",
            ],
            1..5,
        )
        .prop_flat_map(|parts| (Just(parts.join("/")), any::<bool>(), any::<bool>()))
        .prop_map(|(p, lead, trail)| {
            let p = if lead { format!("/{p}") } else { p };
            if trail { format!("{p}/") } else { p }
        })
    }

    proptest! {
        #[test]
        fn named_paths_never_panic_and_are_well_formed(
            text in prop_oneof!["\\PC{0,200}", "[a-zA-Z0-9./`()\\[\\]:~ *-]{0,120}"]
        ) {
            let n = named_paths(&text);
            prop_assert!(n.scope_hints.len() + n.files.len() <= MAX_NAMED_PATHS);
            for p in n.scope_hints.iter().chain(&n.files) {
                prop_assert!(!p.is_empty() && p.len() <= MAX_NAMED_PATH_BYTES);
                prop_assert!(p.bytes().all(is_path_byte));
                prop_assert!(!p.ends_with('/'));
                let rel = p.strip_prefix('/').unwrap_or(p);
                prop_assert!(rel.split('/').all(|c| !c.is_empty() && c != "." && c != ".."));
            }
        }

        #[test]
        fn named_paths_round_trip(
            words in prop::collection::vec(
                prop_oneof![
                    "[a-z]{1,6}(/[a-z]{1,6}){0,3}\\.(rs|md|toml|go)",
                    "[a-z]{1,6}(/[a-z]{1,6}){0,3}/",
                    "[a-z]{1,6}(/[a-z]{1,6}){1,3}",
                    "[a-z]{1,8}",
                    "v[0-9]\\.[0-9]\\.[0-9]",
                ],
                0..20,
            )
        ) {
            let n = named_paths(&words.join(" "));
            let rendered: Vec<String> = n
                .scope_hints
                .iter()
                .map(|d| format!("`{d}/`"))
                .chain(n.files.iter().map(|f| format!("({f}).")))
                .collect();
            prop_assert_eq!(named_paths(&rendered.join(" ")), n.clone());
            let distinct: BTreeSet<&String> = n.files.iter().collect();
            prop_assert_eq!(distinct.len(), n.files.len());
        }

        #[test]
        fn path_key_agrees_with_scope(path in path_strategy()) {
            if let Some(key) = path_key(&path) {
                // Normalized keys are covered by themselves exactly when the
                // scope test accepts the raw path; verbatim keys never are.
                let covered = Scope::from_trusted(vec![key.clone()]).covers_observed(&path);
                let escapes = path.split('/').any(|c| c == "..");
                let names_nothing = !path.starts_with('/')
                    && path.split('/').all(|c| c.is_empty() || c == ".");
                prop_assert_eq!(covered, !escapes && !names_nothing);
                prop_assert_eq!(path_key(&key), Some(key));
            } else {
                prop_assert!(path.is_empty());
            }
        }

        #[test]
        fn classify_counts_are_consistent(
            observed in prop::collection::vec(
                (prop_oneof![Just(FactKind::ToolCall), Just(FactKind::Read), Just(FactKind::Mutation)],
                 path_strategy()),
                0..30,
            ),
            named_files in prop::collection::vec("[a-z]{1,3}(/[a-z]{1,3})?\\.rs", 0..4),
            has_report in prop::option::of(any::<bool>()),
            downgrades in 0u32..3,
        ) {
            let obs: Vec<ObservedFact> =
                observed.iter().map(|(k, p)| fact(*k, p)).collect();
            let named = NamedPaths { scope_hints: vec![], files: named_files };
            let ws = scope(&["src"]);
            let mut i = input(&named, &ws, &obs);
            i.has_report = has_report;
            i.downgrades = downgrades;
            let a = classify(i);
            let count = |k: FactKind| obs.iter().filter(|f| f.kind == k).count() as u64;
            prop_assert_eq!(a.tool_calls, count(FactKind::ToolCall));
            prop_assert_eq!(a.mutations, count(FactKind::Mutation));
            prop_assert!(a.claim_violations <= a.mutations);
            prop_assert!(a.discovered_paths <= a.evidence_paths);
            prop_assert!(a.mutation_paths.len() as u64 <= a.evidence_paths);
            prop_assert!(a.mutation_paths.windows(2).all(|w| w[0] < w[1]));
            prop_assert_eq!(a.false_completion, has_report == Some(true) && downgrades > 0);
            // Naming every evidence path as a file leaves nothing discovered
            // except paths that cannot be normalized.
            let evidence: BTreeSet<String> = obs
                .iter()
                .filter(|f| f.kind != FactKind::ToolCall)
                .filter_map(|f| path_key(&f.path))
                .collect();
            prop_assert_eq!(a.evidence_paths, evidence.len() as u64);
            let all = NamedPaths { scope_hints: vec![], files: evidence.iter().cloned().collect() };
            let b = classify(input(&all, &ws, &obs));
            let verbatim = evidence
                .iter()
                .filter(|p| !Scope::from_trusted(vec![(*p).clone()]).covers_observed(p))
                .count() as u64;
            prop_assert_eq!(b.discovered_paths, verbatim);
        }

        #[test]
        fn conflicts_are_exact_and_order_free(
            mut by in prop::collection::vec(
                (0u8..5, prop::collection::vec("(src|lib)/[ab]\\.rs", 0..4)),
                0..8,
            )
        ) {
            let c = conflicts(&by);
            for conflict in &c {
                prop_assert!(conflict.contracts.len() >= 2);
                prop_assert!(conflict.contracts.windows(2).all(|w| w[0] < w[1]));
                for k in &conflict.contracts {
                    prop_assert!(by.iter().any(|(key, ps)| key == k && ps.contains(&conflict.path)));
                }
            }
            prop_assert!(c.windows(2).all(|w| w[0].path < w[1].path));
            let mut owners: BTreeMap<&String, BTreeSet<u8>> = BTreeMap::new();
            for (k, ps) in &by {
                for p in ps {
                    owners.entry(p).or_default().insert(*k);
                }
            }
            let expected = owners.values().filter(|o| o.len() >= 2).count();
            prop_assert_eq!(c.len(), expected);
            by.reverse();
            prop_assert_eq!(conflicts(&by), c);
        }

        #[test]
        fn aggregate_rate_is_ratio_of_sums_within_per_run_bounds(
            pairs in prop::collection::vec((0u64..1_000, 0u64..1_000), 1..20),
            arms in prop::collection::vec(0u8..3, 20),
        ) {
            let runs: Vec<RunTotals> = pairs
                .iter()
                .zip(&arms)
                .map(|(&(a, b), arm)| {
                    let (evidence, discovered) = (a.max(b), a.min(b));
                    run(&[("arm", &arm.to_string())], discovered, evidence)
                })
                .collect();
            let rows = aggregate(&runs, &["arm".to_owned()]);
            prop_assert_eq!(rows.iter().map(|r| r.runs).sum::<u64>(), runs.len() as u64);
            prop_assert!(rows.windows(2).all(|w| w[0].key < w[1].key));
            for row in &rows {
                let members: Vec<&RunTotals> =
                    runs.iter().filter(|r| r.labels["arm"] == row.key["arm"]).collect();
                let num: u64 = members.iter().map(|r| r.sums.discovered).sum();
                let den: u64 = members.iter().map(|r| r.sums.evidence).sum();
                prop_assert_eq!(row.discovery_rate, ratio(num, den));
                let per_run: Vec<f64> =
                    members.iter().filter_map(|r| ratio(r.sums.discovered, r.sums.evidence)).collect();
                if let Some(rate) = row.discovery_rate {
                    let lo = per_run.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = per_run.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    prop_assert!(lo <= rate && rate <= hi, "{lo} <= {rate} <= {hi}");
                } else {
                    prop_assert!(per_run.is_empty());
                }
            }
            let mut shuffled = runs.clone();
            shuffled.reverse();
            prop_assert_eq!(aggregate(&shuffled, &["arm".to_owned()]), rows);
        }
    }
}
