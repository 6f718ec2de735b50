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
        scope: "core",
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
        scope: "crypto",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "signing and verification need no storage and no transport",
    },
    Rule {
        scope: "chain.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "chains are verified offline, by anyone, with the broker's public keys alone",
    },
    Rule {
        scope: "stamp.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "stamping turns the core's decisions into signed payloads; it knows no storage and no transport",
    },
    Rule {
        scope: "command.rs",
        forbidden: &["crate::store", "crate::service", "sqlx", "tonic", "tokio"],
        why: "validated commands are plain data shared by the service and every backend",
    },
];

/// Only the store may name its database driver.
const ONLY_IN_STORE: &[&str] = &["sqlx"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
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

/// Whether a file holds only tests (`tests.rs`, `*_tests.rs`).
fn is_test_file(path: &Path) -> bool {
    path.file_stem()
        .and_then(|s| s.to_str())
        .is_some_and(|s| s == "tests" || s.ends_with("_tests"))
}

/// The file's production code with comments removed (prose may name
/// anything) and without its test module (`#[cfg(test)]` then `mod`, by
/// convention at the end: tests may use threads and runtimes).
fn code(path: &Path) -> Vec<(usize, String)> {
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
                    .is_some_and(|l| l.trim_start().starts_with("mod "))
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
    let root = src();
    let mut found = Vec::new();
    for rule in RULES {
        let mut files = Vec::new();
        rust_files(&root.join(rule.scope), &mut files);
        assert!(!files.is_empty(), "rule scope src/{} is empty", rule.scope);
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
    rust_files(&root, &mut files);
    for file in files.iter().filter(|f| !f.starts_with(root.join("store"))) {
        for (line, code) in code(file) {
            for name in ONLY_IN_STORE {
                if names(&code, name) {
                    found.push(format!(
                        "{}:{line}: names `{name}`: only src/store/ knows the database driver",
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
}
