//! Audit of delegations (docs/design.md §Audit, seed 000): which paths a
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

pub use crate::limits::MAX_EXTENSION_CHARS;
pub use crate::limits::MAX_GROUP_BY_KEYS;
pub use crate::limits::MAX_LINE_REFERENCE_PARTS;
pub use crate::limits::MAX_NAMED_PATH_BYTES;
pub use crate::limits::MAX_NAMED_PATHS;

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

/// One contract's audit (docs/design.md, seed 000 `DelegationAudit`).
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

/// Classifies one contract (docs/design.md, seed 000 `ClassifyEvidenceOrigin` and
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
    /// Who opened the run (its workload identity, else its key id): what
    /// `GROUP_BY_IDENTITY` groups by.
    pub orchestrator: String,
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

/// The group-by key that groups runs by who opened them (`RunTotals::
/// orchestrator`) rather than by a label: `@` is never in a label key.
pub const GROUP_BY_IDENTITY: &str = "@identity";

/// Groups runs by the values of the `group_by` labels (a run without a label
/// groups under "" for it; `GROUP_BY_IDENTITY` by who opened it) and sums
/// each group. Groups come in ascending
/// order of their key, compared as the list of (label, value) pairs sorted
/// by label; no runs, no groups. An empty `group_by` makes one group.
pub fn aggregate(runs: &[RunTotals], group_by: &[String]) -> Vec<GroupRow> {
    let mut groups: BTreeMap<BTreeMap<String, String>, GroupRow> = BTreeMap::new();
    for run in runs {
        let key: BTreeMap<String, String> = group_by
            .iter()
            .map(|k| {
                let value = if k == GROUP_BY_IDENTITY {
                    run.orchestrator.clone()
                } else {
                    run.labels.get(k).cloned().unwrap_or_default()
                };
                (k.clone(), value)
            })
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

/// Validates the keys to group by: at most `MAX_GROUP_BY_KEYS`, each a
/// label key (1..=64 bytes of `[a-z0-9_.-]`) or `GROUP_BY_IDENTITY`.
/// Returns them deduplicated, in order.
pub fn check_group_by(raw: &[String], field: &'static str) -> Result<Vec<String>, InputError> {
    if raw.len() > MAX_GROUP_BY_KEYS {
        return Err(InputError::new(
            field,
            format!("{} keys, at most {MAX_GROUP_BY_KEYS}", raw.len()),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(raw.len());
    for key in raw {
        if key != GROUP_BY_IDENTITY {
            super::check_label_key(key, field)?;
        }
        if !out.contains(key) {
            out.push(key.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "audit_tests.rs"]
mod tests;
