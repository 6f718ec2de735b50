//! The architecture invariants of ARCHITECTURE.md, checked on the sources
//! (the way rust-analyzer's tidy test does): a rule that only lives in a
//! document drifts; this test fails the build the day it is broken.

use std::path::{Path, PathBuf};

/// A layer, the names its code may not mention, and why.
struct Rule {
    /// Files under `src/` this rule covers (a folder or one file).
    scope: &'static str,
    forbidden: &'static [&'static str],
    why: &'static str,
}

const RULES: &[Rule] = &[
    Rule {
        scope: "crates/domain/src",
        forbidden: &[
            "tonic",
            "sqlx",
            "tokio",
            "prost",
            "hyper",
            "crate::pb",
            "crate::store",
            "crate::service",
            "crate::stamp",
            "std::fs",
            "std::net",
            "std::thread",
        ],
        why: "the core is pure: every rule is tested without a runtime, a database or the wire format",
    },
    Rule {
        scope: "crates/wire/src/crypto.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "signing and verification need no storage and no transport",
    },
    Rule {
        scope: "crates/wire/src/chain.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "chains are verified offline, by anyone, with the broker's public keys alone",
    },
    Rule {
        scope: "crates/wire/src/stamp.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "stamping turns the core's decisions into signed payloads; it knows no storage and no transport",
    },
    Rule {
        scope: "crates/wire/src/command.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "validated commands are plain data shared by the service and every backend",
    },
];

/// Only the store may name its database driver.
const ONLY_IN_STORE: &[&str] = &["sqlx"];

/// The repository: the root package and the workspace's crates.
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every production source folder: `src/` and each crate's `src/`.
fn source_roots() -> Vec<PathBuf> {
    let mut roots = vec![repo().join("src")];
    let mut crates: Vec<PathBuf> = std::fs::read_dir(repo().join("crates"))
        .expect("crates/")
        .map(|e| e.expect("directory entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    crates.sort();
    roots.extend(crates);
    roots
}

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_owned());
        }
        return;
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for entry in entries {
        rust_files(&entry, out);
    }
}

/// Whether a file holds only tests (`tests.rs`, `*_tests.rs`, anything
/// under a `tests/` folder, the store suite).
fn is_test_file(path: &Path) -> bool {
    let rel = path.strip_prefix(repo()).unwrap_or(path);
    rel.components()
        .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "suite")
        || path
            .file_stem()
            .and_then(|s| s.to_str())
            .is_some_and(|s| s == "tests" || s.ends_with("_tests"))
}

/// The file's production code with comments removed (prose may name
/// anything) and without its inline test module (`#[cfg(test)]` then
/// `mod … {`, by convention at the end: tests may use threads and
/// runtimes). A `#[cfg(test)] mod tests;` line only declares a test file
/// (skipped as a whole by `is_test_file`).
fn code(path: &Path) -> Vec<(usize, String)> {
    let lines = raw_code(path);
    expand_groups(&lines)
}

/// `use crate::{pb, store::X}` (on one line or many) also as the paths it
/// names (`crate::pb`, `crate::store::X`), on the line where its group
/// opened, so a rule against `crate::pb` sees it.
fn expand_groups(lines: &[(usize, String)]) -> Vec<(usize, String)> {
    let mut out = lines.to_vec();
    let text: String = lines
        .iter()
        .map(|(_, code)| code.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let line_at = |offset: usize| {
        let index = text[..offset].matches('\n').count();
        lines[index].0
    };
    for (at, _) in text.match_indices("crate::{") {
        let open = at + "crate::{".len();
        let mut depth = 1;
        let mut close = open;
        for (i, c) in text[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                close = open + i;
                break;
            }
        }
        for path in group_paths("crate", &text[open..close]) {
            out.push((line_at(at), path));
        }
    }
    out
}

/// The full paths a `prefix::{…}` group names (nested groups too).
fn group_paths(prefix: &str, group: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&group[start..]);
    let mut paths = Vec::new();
    for part in parts {
        let part: String = part.split_whitespace().collect::<Vec<_>>().join("");
        if part.is_empty() {
            continue;
        }
        match part.split_once("::{") {
            Some((head, rest)) => {
                let inner = rest.strip_suffix('}').unwrap_or(rest);
                paths.extend(group_paths(&format!("{prefix}::{head}"), inner));
            }
            None => paths.push(format!("{prefix}::{part}")),
        }
    }
    paths
}

/// The file's production code with comments removed, line by line.
fn raw_code(path: &Path) -> Vec<(usize, String)> {
    if is_test_file(path) {
        return Vec::new();
    }
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim() == "#[cfg(test)]"
                && lines[i + 1..]
                    .iter()
                    .find(|l| !l.trim_start().starts_with("#["))
                    .is_some_and(|l| {
                        let l = l.trim();
                        (l.starts_with("mod ") || l.starts_with("pub mod ")) && l.ends_with('{')
                    })
        })
        .unwrap_or(lines.len());
    lines[..end]
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let code = match line.find("//") {
                Some(at) => &line[..at],
                None => line,
            };
            (i + 1, code.to_owned())
        })
        .filter(|(_, code)| !code.trim().is_empty())
        .collect()
}

/// Whether `code` names `name` as a path or identifier (not as part of a
/// longer identifier).
fn names(code: &str, name: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(name).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + name.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

fn violations() -> Vec<String> {
    let root = repo();
    let mut found = Vec::new();
    for rule in RULES {
        let mut files = Vec::new();
        rust_files(&root.join(rule.scope), &mut files);
        assert!(!files.is_empty(), "rule scope {} is empty", rule.scope);
        for file in files {
            for (line, code) in code(&file) {
                for name in rule.forbidden {
                    if names(&code, name) {
                        found.push(format!(
                            "{}:{line}: names `{name}`: {}",
                            file.strip_prefix(&root).unwrap_or(&file).display(),
                            rule.why
                        ));
                    }
                }
            }
        }
    }
    let mut files = Vec::new();
    for source in source_roots() {
        rust_files(&source, &mut files);
    }
    for file in files
        .iter()
        .filter(|f| !f.starts_with(root.join("crates/store")))
    {
        for (line, code) in code(file) {
            for name in ONLY_IN_STORE {
                if names(&code, name) {
                    found.push(format!(
                        "{}:{line}: names `{name}`: only crates/store knows the database driver",
                        file.strip_prefix(&root).unwrap_or(file).display()
                    ));
                }
            }
        }
    }
    found
}

#[test]
fn layers_import_only_what_the_architecture_allows() {
    let found = violations();
    assert!(
        found.is_empty(),
        "architecture invariants broken (see ARCHITECTURE.md):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_checker_sees_a_forbidden_name() {
    assert!(names("use tokio::sync;", "tokio"));
    assert!(names(
        "let x = crate::pb::Contract::default();",
        "crate::pb"
    ));
    assert!(!names("let tokio_like = 1;", "tokio"));
    assert!(!names("mytonic::x", "tonic"));
    let text = "let a = 1; // tokio is named only in a comment";
    let stripped = match text.find("//") {
        Some(at) => &text[..at],
        None => text,
    };
    assert!(!names(stripped, "tokio"));
    // Grouped imports name their members.
    let grouped = expand_groups(&[
        (1, "use crate::{".into()),
        (2, "    clock::Clock,".into()),
        (3, "    pb, store::{Answer, Store},".into()),
        (4, "};".into()),
    ]);
    let paths: Vec<&str> = grouped.iter().map(|(_, p)| p.as_str()).collect();
    for path in ["crate::pb", "crate::store::Answer", "crate::clock::Clock"] {
        assert!(paths.contains(&path), "{path} not in {paths:?}");
    }
    assert!(
        grouped
            .iter()
            .any(|(line, p)| *line == 1 && names(p, "crate::pb"))
    );
}

/// Every production `.rs` file, with its path relative to the repository.
fn all_files() -> Vec<(String, PathBuf)> {
    let root = repo();
    let mut files = Vec::new();
    for source in source_roots() {
        rust_files(&source, &mut files);
    }
    files
        .into_iter()
        .map(|f| {
            let rel = f
                .strip_prefix(&root)
                .unwrap_or(&f)
                .to_string_lossy()
                .replace('\\', "/");
            (rel, f)
        })
        .collect()
}

/// Files (relative to `src/`, a folder ending in `/`) a name may appear in.
fn allowed(rel: &str, places: &[&str]) -> bool {
    places.iter().any(|p| {
        if p.ends_with('/') {
            rel.starts_with(p)
        } else {
            rel == *p
        }
    })
}

/// Every code line of the production files whose relative path `pick`
/// accepts: the file, the line's number, its code.
fn code_lines(pick: impl Fn(&str) -> bool) -> Vec<(String, usize, String)> {
    all_files()
        .into_iter()
        .filter(|(rel, _)| pick(rel))
        .flat_map(|(rel, file)| {
            code(&file)
                .into_iter()
                .map(move |(line, code)| (rel.clone(), line, code))
        })
        .collect()
}

/// `code` without a leading `pub`, `pub(crate)` or `pub(super)`.
fn without_visibility(code: &str) -> &str {
    code.strip_prefix("pub(crate) ")
        .or_else(|| code.strip_prefix("pub(super) "))
        .or_else(|| code.strip_prefix("pub "))
        .unwrap_or(code)
}

/// `name` appears only in `places`: one violation per other mention.
fn only_in(name: &str, places: &[&str], why: &str) -> Vec<String> {
    code_lines(|rel| !allowed(rel, places))
        .into_iter()
        .filter(|(_, _, code)| names(code, name))
        .map(|(rel, line, _)| format!("{rel}:{line}: names `{name}`: {why}"))
        .collect()
}

fn assert_none(found: Vec<String>) {
    assert!(
        found.is_empty(),
        "architecture invariants broken (see ARCHITECTURE.md):\n{}",
        found.join("\n")
    );
}

/// Only `service/` knows tonic, plus what wires it (`server.rs`, the
/// generated code's include in `lib.rs`), the transport layers of
/// `metrics.rs` and `telemetry/`, and the client side (`client.rs`,
/// `cli/bench.rs`, `cli/audit.rs`).
fn tonic_violations() -> Vec<String> {
    only_in(
        "tonic",
        &[
            "src/service/",
            "src/server/",
            "src/console/",
            "crates/wire/src/lib.rs",
            "crates/runtime/src/",
            "src/metrics.rs",
            "crates/runtime/src/telemetry/",
            "crates/client/src/",
            "src/cli/bench.rs",
            "crates/tools/src/",
            "src/cli/audit.rs",
            "src/cli/tree.rs",
            "src/cli/read/",
            "crates/mcp/src/",
            "crates/a2a/src/",
        ],
        "only the service (and what wires it) knows tonic",
    )
}

/// A2A and Envoy's ext_authz are the A2A gateway's (a client of the
/// public API): the broker's core, store and service never learn them.
#[test]
fn only_the_a2a_gateway_knows_a2a() {
    let mut found = only_in(
        "a2a_pb",
        &["crates/a2a/src/"],
        "only the A2A gateway knows A2A's types",
    );
    found.extend(only_in(
        "envoy_types",
        &["crates/a2a/src/"],
        "only the A2A gateway knows Envoy's types",
    ));
    assert_none(found);
}

#[test]
fn only_the_service_and_its_wiring_know_tonic() {
    assert_none(tonic_violations());
}

/// A `Status` is built only by the one mapping (`service/error.rs`) and
/// by the rewrite of tonic's own errors (`service/transport.rs`); anyone
/// else converts a `ServiceError` (`Status::from`).
fn status_violations() -> Vec<String> {
    let mut found = Vec::new();
    // The client side (`client.rs`) makes its own local errors; the A2A
    // gateway answers A2A's gRPC binding with its own statuses
    // (a2a/grpc.rs), not the broker's errors.
    let makers = [
        "src/service/error.rs",
        "src/service/transport.rs",
        "crates/client/src/",
        "crates/a2a/src/grpc.rs",
    ];
    for (rel, line, code) in code_lines(|rel| !allowed(rel, &makers)) {
        for (at, _) in code.match_indices("Status::") {
            let rest = &code[at + "Status::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let called = rest[name.len()..].trim_start().starts_with('(');
            let before = code[..at].chars().next_back();
            let is_status_type = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
            if is_status_type && called && TONIC_STATUS_CONSTRUCTORS.contains(&name.as_str()) {
                found.push(format!(
                    "{rel}:{line}: builds a Status (`Status::{name}`): every error becomes a status in service/error.rs"
                ));
            }
        }
    }
    found
}

/// tonic's `Status` constructors (OpenTelemetry's `Status::error` is
/// another type).
const TONIC_STATUS_CONSTRUCTORS: &[&str] = &[
    "new",
    "with_details",
    "with_metadata",
    "with_details_and_metadata",
    "with_error_details",
    "with_error_details_vec",
    "from_error",
    "ok",
    "cancelled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
];

#[test]
fn one_place_builds_a_status() {
    assert_none(status_violations());
}

/// The core's rules are called from one place each, and the backends
/// (`store/sqlite/`, `store/postgres/`) call none of them: they load,
/// call the shared code, write. A backend that decided would name a rule
/// or build a refusal.
fn decision_violations() -> Vec<String> {
    let mut found = Vec::new();
    for (name, places) in [
        (
            "check_delegation",
            &["crates/domain/src/", "crates/store/src/batch.rs"][..],
        ),
        (
            "lifecycle::decide",
            &["crates/domain/src/", "crates/store/src/sql/lifecycle.rs"][..],
        ),
        (
            "drain_step",
            &["crates/domain/src/", "crates/store/src/sql/drain.rs"][..],
        ),
        (
            "judge::judge",
            &["crates/domain/src/", "crates/store/src/sql/judge.rs"][..],
        ),
    ] {
        found.extend(only_in(
            name,
            places,
            "a core rule is called from one place",
        ));
    }
    let backends = ["crates/store/src/sqlite/", "crates/store/src/postgres/"];
    for (rel, line, code) in code_lines(|rel| allowed(rel, &backends)) {
        for name in ["Refused", "Refusal", "Decision", "Ledger"] {
            if names(&code, name) {
                found.push(format!(
                    "{rel}:{line}: names `{name}`: a backend loads and writes; the core decides"
                ));
            }
        }
    }
    found
}

#[test]
fn the_backends_never_decide() {
    assert_none(decision_violations());
}

/// Bounds (`const MAX_…`, `const MIN_…`) of the store, the service, the
/// pools and the signing code live in a limits module: `core/limits.rs`
/// (what a client meets), `store/limits.rs`, `service/limits.rs`; tunable
/// ones in the registry (`config/limits.rs`).
fn bound_violations() -> Vec<String> {
    let mut found = Vec::new();
    let covered = |rel: &str| {
        allowed(
            rel,
            &[
                "crates/store/src/",
                "src/service/",
                "crates/store/src/pool.rs",
                "crates/store/src/slots.rs",
                "crates/wire/src/crypto.rs",
                "crates/wire/src/chain.rs",
                "crates/wire/src/stamp.rs",
                "crates/wire/src/command.rs",
                "crates/domain/src/",
            ],
        ) && !rel.ends_with("limits.rs")
            && !rel.starts_with("crates/store/src/suite/")
    };
    for (rel, line, code) in code_lines(covered) {
        let code = without_visibility(code.trim_start());
        if let Some(rest) = code.strip_prefix("const ")
            && (rest.starts_with("MAX_") || rest.starts_with("MIN_"))
        {
            found.push(format!(
                "{rel}:{line}: defines a bound outside a limits module: {}",
                rest.split(':').next().unwrap_or(rest)
            ));
        }
    }
    found
}

#[test]
fn bounds_live_in_the_limits_modules() {
    assert_none(bound_violations());
}

/// Process-wide state, each item with why it may be: memos of pure
/// functions, hints and counters. Nothing a request's outcome depends on.
const STATICS: &[(&str, &str, &str)] = &[
    (
        "crates/store/src/sqlite/pcache.rs",
        "INNER_CACHE",
        "SQLite's default page cache the store's wraps, read once",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "INNER",
        "the default SQLite VFS the store's wraps, found once",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "REGISTERED",
        "whether the store's VFS registered (a memo)",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "GATHERING",
        "whether this thread is inside a COMMIT whose WAL writes are gathered",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "HOLDER",
        "the file holding this thread's gathered WAL bytes",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "METHODS",
        "the VFS's file methods, a constant SQLite points to",
    ),
    (
        "crates/store/src/sqlite/gather.rs",
        "PLAIN_METHODS",
        "the VFS's file methods without shared memory, a constant",
    ),
    (
        "crates/wire/src/crypto.rs",
        "KEY_CACHE",
        "decoded public keys (a memo)",
    ),
    (
        "crates/domain/src/predicate.rs",
        "PARSED",
        "predicate texts that parsed (a memo)",
    ),
    (
        "crates/domain/src/predicate.rs",
        "SHAPES",
        "shapes of effective predicates (a memo)",
    ),
    (
        "crates/domain/src/judge/evaluate.rs",
        "STDLIB",
        "CEL's standard environment, built once (a memo of a constant)",
    ),
    (
        "crates/domain/src/schema/mod.rs",
        "COMPILED",
        "compiled schemas (a memo)",
    ),
    (
        "crates/domain/src/tenant.rs",
        "OPEN",
        "the open tenant's id, a hash of a constant (a memo)",
    ),
    (
        "crates/domain/src/schema/clock.rs",
        "DEADLINE",
        "this thread's validation deadline",
    ),
    (
        "crates/domain/src/schema/clock.rs",
        "OUT_OF_TIME",
        "this thread's validation ran out of time",
    ),
    (
        "crates/store/src/sqlite/durability.rs",
        "WAL_SYNCS",
        "WAL fsync counters",
    ),
    (
        "crates/store/src/phases.rs",
        "SUBMITTED",
        "store phase histograms (counters)",
    ),
    (
        "crates/store/src/phases.rs",
        "QUEUED",
        "store phase histograms (counters)",
    ),
    (
        "crates/store/src/phases.rs",
        "BATCH",
        "store phase histograms (counters)",
    ),
    (
        "crates/store/src/phases.rs",
        "SYNC_WAIT",
        "store phase histograms (counters)",
    ),
    (
        "crates/store/src/phases.rs",
        "FSYNC",
        "store phase histograms (counters)",
    ),
    (
        "src/metrics.rs",
        "STORE_ERRORS",
        "store errors by class (a counter)",
    ),
    (
        "crates/runtime/src/telemetry/mod.rs",
        "EXPORT",
        "the span exporter, set once at start",
    ),
    (
        "crates/runtime/src/telemetry/mod.rs",
        "SPANS",
        "span counters",
    ),
    (
        "crates/runtime/src/telemetry/calls.rs",
        "CALL",
        "the call's facts (task-local)",
    ),
    (
        "crates/runtime/src/telemetry/calls.rs",
        "CALL_SPANS_AT_INFO",
        "log level of call spans, set at start",
    ),
    (
        "crates/wire/src/throttle.rs",
        "EPOCH",
        "the log throttles' clock",
    ),
    // Log throttles (`telemetry::Throttle`): when a repeated line was last
    // written, nothing else.
    ("src/service/error.rs", "FAILED", "a log throttle"),
    (
        "crates/store/src/sqlite/checkpoint.rs",
        "FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/sqlite/writer.rs",
        "ROLLED_BACK",
        "a log throttle",
    ),
    (
        "crates/store/src/sqlite/writer.rs",
        "PROBE_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/sqlite/writer.rs",
        "FINISH_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/sqlite/writer.rs",
        "PRUNE_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/sqlite/raw.rs",
        "RETAKEN",
        "a log throttle",
    ),
    (
        "crates/runtime/src/telemetry/mod.rs",
        "EXPORT_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/postgres/writer.rs",
        "ISSUANCE_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/postgres/writer.rs",
        "TRANSITION_FAILED",
        "a log throttle",
    ),
    (
        "crates/store/src/postgres/writer.rs",
        "PRUNE_FAILED",
        "a log throttle",
    ),
];

fn static_violations() -> Vec<String> {
    let mut found = Vec::new();
    let mut seen = Vec::new();
    for (rel, line, code) in code_lines(|_| true) {
        let item = without_visibility(code.trim_start());
        let Some(rest) = item.strip_prefix("static ") else {
            continue;
        };
        let rest = rest.strip_prefix("mut ").unwrap_or(rest);
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !STATICS.iter().any(|(f, n, _)| *f == rel && *n == name) {
            found.push(format!(
                "{rel}:{line}: process-wide `{name}` is not a listed memo, hint or counter"
            ));
        }
        seen.push((rel.clone(), name));
    }
    for (file, name, _) in STATICS {
        if !seen.iter().any(|(f, n)| f == file && n == name) {
            found.push(format!(
                "{file}: the listed `{name}` is gone: update STATICS"
            ));
        }
    }
    found
}

#[test]
fn process_wide_state_is_the_listed_memos_and_counters() {
    assert_none(static_violations());
}

/// What PostgreSQL-wire distributed engines lack: advisory locks,
/// LISTEN/NOTIFY, `FOR SHARE`, more than one DDL statement per migration.
fn portability_violations() -> Vec<String> {
    let mut found = Vec::new();
    let postgres = ["crates/store/src/postgres/", "crates/store/src/sql/"];
    for (rel, line, code) in code_lines(|rel| allowed(rel, &postgres)) {
        let upper = code.to_uppercase();
        for construct in ["PG_ADVISORY", "LISTEN ", "NOTIFY", "FOR SHARE"] {
            if upper.contains(construct) {
                found.push(format!(
                    "{rel}:{line}: uses {construct:?}, which distributed PostgreSQL-wire engines lack"
                ));
            }
        }
    }
    let migrations = repo().join("crates/store/migrations/postgres");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&migrations)
        .expect("migrations/postgres")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no PostgreSQL migrations found");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("migration");
        // A function's `$$`-quoted body is part of its one statement.
        let statements = text
            .lines()
            .map(|l| l.split("--").next().unwrap_or(""))
            .collect::<String>()
            .split("$$")
            .step_by(2)
            .map(|outside| outside.matches(';').count())
            .sum::<usize>();
        if statements != 1 {
            found.push(format!(
                "{}: {statements} statements: one DDL statement per migration",
                file.display()
            ));
        }
    }
    found
}

#[test]
fn postgres_stays_portable() {
    assert_none(portability_violations());
}

/// The folders and files `is_test_file` skips (`tests`, `suite`) are
/// compiled for tests only: each is declared under `#[cfg(test)]`, so no
/// production code can hide from the rules there.
fn test_module_violations() -> Vec<String> {
    let mut found = Vec::new();
    for (rel, file) in all_files() {
        let text = std::fs::read_to_string(&file).expect("source");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let declared = line
                .trim()
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ");
            if declared != "mod tests;" && declared != "mod suite;" {
                continue;
            }
            let test_only = lines[..i]
                .iter()
                .rev()
                .take_while(|l| l.trim_start().starts_with("#["))
                .any(|l| l.trim() == "#[cfg(test)]");
            if !test_only {
                found.push(format!(
                    "{rel}:{}: `{declared}` is not under #[cfg(test)]: the rules skip it",
                    i + 1
                ));
            }
        }
    }
    found
}

#[test]
fn test_modules_are_compiled_for_tests_only() {
    assert_none(test_module_violations());
}

/// The workspace's crates and what each may not depend on, directly or
/// through another crate (normal dependencies, as `cargo metadata`
/// resolves them; dev- and build-dependencies do not ship).
const CRATE_RULES: &[(&str, &[&str], &str)] = &[
    (
        "broker-domain",
        &[
            "tokio",
            "mio",
            "sqlx",
            "libsqlite3-sys",
            "tonic",
            "hyper",
            "axum",
            "reqwest",
            "prost",
            "socket2",
            "rustix",
            "broker-wire",
            "broker-store",
            "broker-runtime",
        ],
        "the domain is pure: every rule is tested without a runtime, a database or the wire",
    ),
    (
        "broker-wire",
        &[
            "sqlx",
            "libsqlite3-sys",
            "broker-store",
            "broker-runtime",
            "delegation-broker",
        ],
        "a verifier or client needs the wire and nothing a server needs",
    ),
    (
        "broker-store",
        &[
            "broker-runtime",
            "broker-client",
            "delegation-broker",
            "broker-a2a",
            "broker-mcp",
        ],
        "the store knows the domain and the wire, not the service or the clients",
    ),
    (
        "broker-client",
        &[
            "broker-store",
            "delegation-broker",
            "sqlx",
            "libsqlite3-sys",
            "rmcp",
            "a2a-lf",
        ],
        "the client knows the public API only",
    ),
    (
        "broker-runtime",
        &[
            "broker-store",
            "delegation-broker",
            "broker-client",
            "sqlx",
            "libsqlite3-sys",
        ],
        "what every server shares knows no service, store or client",
    ),
    (
        "broker-a2a",
        &[
            "broker-store",
            "delegation-broker",
            "broker-mcp",
            "sqlx",
            "libsqlite3-sys",
        ],
        "a gateway is a client of the broker's public API, never of its internals",
    ),
    (
        "broker-mcp",
        &[
            "broker-store",
            "delegation-broker",
            "broker-a2a",
            "sqlx",
            "libsqlite3-sys",
        ],
        "a gateway is a client of the broker's public API, never of its internals",
    ),
    (
        "broker-tools",
        &["delegation-broker", "broker-a2a", "broker-mcp"],
        "the tools measure the server from outside: it hands them what they start",
    ),
];

/// Each package of the resolved graph (by name) with the names of its
/// normal dependencies, from `cargo metadata`.
fn dependency_graph() -> std::collections::HashMap<String, Vec<String>> {
    // This machine's platform only: the rest of the lock file's packages
    // (Android's, Windows') are not downloaded.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names the host");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host])
        .current_dir(repo())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let name_of: std::collections::HashMap<&str, &str> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().expect("id"),
                p["name"].as_str().expect("name"),
            )
        })
        .collect();
    metadata["resolve"]["nodes"]
        .as_array()
        .expect("resolve.nodes")
        .iter()
        .map(|node| {
            let normal = node["deps"]
                .as_array()
                .expect("deps")
                .iter()
                .filter(|dep| {
                    dep["dep_kinds"]
                        .as_array()
                        .is_some_and(|kinds| kinds.iter().any(|k| k["kind"].is_null()))
                })
                .map(|dep| name_of[dep["pkg"].as_str().expect("pkg")].to_owned())
                .collect();
            (name_of[node["id"].as_str().expect("id")].to_owned(), normal)
        })
        .collect()
}

/// For each crate rule, the forbidden packages it reaches, with the path.
fn crate_violations(graph: &std::collections::HashMap<String, Vec<String>>) -> Vec<String> {
    let mut found = Vec::new();
    for (krate, forbidden, why) in CRATE_RULES {
        assert!(
            graph.contains_key(*krate),
            "{krate} is not in the workspace"
        );
        // Breadth first, remembering how each package was reached.
        let mut via: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        let mut queue = std::collections::VecDeque::from([*krate]);
        while let Some(package) = queue.pop_front() {
            for dep in graph.get(package).into_iter().flatten() {
                if dep != krate && !via.contains_key(dep.as_str()) {
                    via.insert(dep, package);
                    queue.push_back(dep);
                }
            }
        }
        for name in *forbidden {
            if via.contains_key(name) {
                let mut path = vec![*name];
                while let Some(from) = via.get(path[path.len() - 1]) {
                    path.push(from);
                    if *from == *krate {
                        break;
                    }
                }
                path.reverse();
                found.push(format!(
                    "{krate} depends on {name} ({}): {why}",
                    path.join(" -> ")
                ));
            }
        }
    }
    found
}

#[test]
fn crates_depend_only_on_what_the_architecture_allows() {
    assert_none(crate_violations(&dependency_graph()));
}

#[test]
fn the_crate_checker_sees_a_forbidden_dependency() {
    let mut graph = dependency_graph();
    graph
        .get_mut("broker-domain")
        .expect("broker-domain")
        .push("tokio".into());
    graph
        .get_mut("broker-client")
        .expect("broker-client")
        .push("broker-store".into());
    let found = crate_violations(&graph);
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("broker-domain depends on tokio (broker-domain -> tokio)")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("broker-a2a depends on broker-store")),
        "{found:?}"
    );
}

/// Longest production file, in lines (its inline test module excluded).
const MAX_FILE_LINES: usize = 800;
/// Longest production function, in lines from `fn` to its closing brace.
const MAX_FN_LINES: usize = 100;

/// Files and functions allowed past the limits, each at most as long as
/// written here and with why (ARCHITECTURE.md, "Size"). A `fn` entry is
/// `path::name`. Growing one past its number fails like any other.
const SIZE_EXCEPTIONS: &[(&str, usize, &str)] = &[
    (
        "crates/domain/src/invariants.rs::check_delegation",
        240,
        "the fifteen invariants in docs/design.md's order, one block each: read side by side with the design",
    ),
    (
        "crates/store/src/postgres/unnest.rs::insert_contracts",
        115,
        "one UNNEST statement and its columns",
    ),
    ("crates/store/src/sqlite/probe.rs::probe", 190, "to split"),
    (
        "crates/store/src/sql/reads.rs::roots",
        115,
        "one paged query and its cursor",
    ),
];

/// Production lines of `text`: up to its inline test module, trailing
/// blank lines dropped.
fn production_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim() == "#[cfg(test)]"
                && lines.get(i + 1).is_some_and(|l| {
                    let l = l.trim();
                    (l.starts_with("mod ") || l.starts_with("pub mod ")) && l.ends_with('{')
                })
        })
        .unwrap_or(lines.len());
    let mut production = lines[..end].to_vec();
    while production.last().is_some_and(|l| l.trim().is_empty()) {
        production.pop();
    }
    production
}

/// Each function of `lines` with its length: from its `fn` line to the
/// first line that closes it at the same indentation.
fn functions<'a>(lines: &[&'a str]) -> Vec<(&'a str, usize)> {
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let mut rest = line.trim_start();
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(signature) = rest.strip_prefix("fn ") else {
            continue;
        };
        if line.trim_end().ends_with(';') {
            continue;
        }
        let name = signature
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()
            .unwrap_or("");
        let close = format!("{}}}", &line[..indent]);
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            found.push((name, end + 2));
        }
    }
    found
}

/// Files and functions longer than allowed (`SIZE_EXCEPTIONS` aside).
fn size_violations(files: &[(String, String)]) -> Vec<String> {
    let allowed = |name: &str, limit: usize| {
        SIZE_EXCEPTIONS
            .iter()
            .find(|(n, _, _)| *n == name)
            .map_or(limit, |(_, most, _)| *most)
    };
    let mut found = Vec::new();
    for (rel, text) in files {
        let lines = production_lines(text);
        if lines.len() > allowed(rel, MAX_FILE_LINES) {
            found.push(format!(
                "{rel}: {} lines, at most {} (split it by concern)",
                lines.len(),
                allowed(rel, MAX_FILE_LINES)
            ));
        }
        for (name, length) in functions(&lines) {
            let key = format!("{rel}::{name}");
            if length > allowed(&key, MAX_FN_LINES) {
                found.push(format!(
                    "{key}: {length} lines, at most {}",
                    allowed(&key, MAX_FN_LINES)
                ));
            }
        }
    }
    found
}

fn production_sources() -> Vec<(String, String)> {
    all_files()
        .into_iter()
        .filter(|(_, path)| !is_test_file(path))
        .map(|(rel, path)| {
            let text = std::fs::read_to_string(&path).expect("source");
            (rel, text)
        })
        .collect()
}

#[test]
fn no_file_or_function_outgrows_its_limit() {
    assert_none(size_violations(&production_sources()));
}

#[test]
fn every_size_exception_still_needs_to_be_one() {
    let files = production_sources();
    let mut stale = Vec::new();
    for (name, _, _) in SIZE_EXCEPTIONS {
        let (file, function) = match name.split_once("::") {
            Some((file, function)) => (file, Some(function)),
            None => (*name, None),
        };
        let Some((_, text)) = files.iter().find(|(rel, _)| rel == file) else {
            stale.push(format!("{name}: no such file"));
            continue;
        };
        let lines = production_lines(text);
        let over = match function {
            None => lines.len() > MAX_FILE_LINES,
            Some(function) => functions(&lines)
                .iter()
                .any(|(n, length)| n == &function && *length > MAX_FN_LINES),
        };
        if !over {
            stale.push(format!("{name}: within the limit now; drop the exception"));
        }
    }
    assert_none(stale);
}

#[test]
fn the_size_checker_sees_a_long_file_and_a_long_function() {
    let long_fn = format!(
        "pub fn short() {{\n}}\n\nfn long() {{\n{}}}\n",
        "    let x = 1;\n".repeat(MAX_FN_LINES)
    );
    let long_file = "// a line\n".repeat(MAX_FILE_LINES + 1);
    let found = size_violations(&[
        ("src/long_fn.rs".into(), long_fn),
        ("src/long_file.rs".into(), long_file),
    ]);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("src/long_fn.rs::long: 102 lines"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("src/long_file.rs: 801 lines"),
        "{found:?}"
    );
}
