//! The shell examples of the README (its first delegation), of
//! docs/seeds.md and of docs/tokens.md, run as written: their shell blocks in a fresh folder
//! with the binary on `PATH`, and their output blocks matched line by line
//! in order (ids and keys shortened to `…` there match any hex), so the
//! docs and the binary cannot drift apart.

use std::time::Duration;

/// Longest the whole block may take (it starts a broker and makes a
/// handful of calls; this only keeps a hung run from hanging the suite).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// The first fenced block of `kind` after `heading` in `text`.
fn block<'a>(text: &'a str, heading: &str, kind: &str) -> &'a str {
    let from = text.find(heading).expect("the README has the section");
    let fence = format!("```{kind}\n");
    let start = from
        + text[from..]
            .find(&fence)
            .expect("the section has the block")
        + fence.len();
    let end = start + text[start..].find("\n```").expect("the block is closed");
    &text[start..end]
}

/// Every fenced block of `kind` in `text`, in order.
fn blocks<'a>(text: &'a str, kind: &str) -> Vec<&'a str> {
    let fence = format!("```{kind}\n");
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(&fence) {
        let body = &rest[start + fence.len()..];
        let end = body.find("\n```").expect("the block is closed");
        found.push(&body[..end]);
        rest = &body[end..];
    }
    found
}

/// Whether `line` is the README's output line `wanted`: the same text,
/// but hex shortened with `…` there stands for a whole 64-digit id.
fn matches(wanted: &str, line: &str) -> bool {
    let mut parts = vec![String::new()];
    for c in wanted.chars() {
        let literal = parts.last_mut().expect("a part");
        if c == '…' {
            while literal.ends_with(|c: char| c.is_ascii_hexdigit()) {
                literal.pop();
            }
            parts.push(String::new());
        } else {
            literal.push(c);
        }
    }
    let mut rest = line;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            match rest.get(..64) {
                Some(id) if id.bytes().all(|b| b.is_ascii_hexdigit()) => rest = &rest[64..],
                _ => return false,
            }
        }
        match rest.strip_prefix(part.as_str()) {
            Some(after) => rest = after,
            None => return false,
        }
    }
    rest.is_empty()
}

#[test]
fn shortened_ids_match_whole_ones() {
    let id = "ab".repeat(32);
    assert!(matches("contract: 1f0c…", &format!("contract: {id}")));
    assert!(!matches("contract: 1f0c…", "contract: 1f0c"));
    assert!(!matches("depth: 1", "depth: 12"));
    assert!(matches(
        "ok chain of 2 contracts",
        "ok chain of 2 contracts"
    ));
}

#[tokio::test]
async fn the_readme_first_delegation_runs_as_written() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let script = block(&readme, "## A first delegation", "sh");
    let expected = block(&readme, "## A first delegation", "text");
    let stderr = runs_as_written(script, expected).await;
    assert!(
        stderr.contains("refused by the broker (receipt "),
        "the refusal is said on stderr too: {stderr}"
    );
}

#[tokio::test]
async fn the_seed_scenarios_run_as_written() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/seeds.md"))
        .expect("docs/seeds.md");
    let script = blocks(&page, "sh").join("\n");
    let expected = blocks(&page, "text").join("\n");
    runs_as_written(&script, &expected).await;
}

#[tokio::test]
async fn the_token_walkthrough_runs_as_written() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/tokens.md"))
        .expect("docs/tokens.md");
    // The page's fixed token port, moved to a free one.
    let port = free_port();
    let script = blocks(&page, "sh")
        .join("\n")
        .replace(TOKENS_ADDRESS, &format!("127.0.0.1:{port}"));
    let expected = blocks(&page, "text").join("\n");
    let stderr = runs_as_written(&script, &expected).await;
    assert!(
        stderr.contains("refused: invalid_grant: the contract is REVOKED"),
        "the refusal is said on stderr: {stderr}"
    );
}

/// The token endpoint's address docs/tokens.md uses.
const TOKENS_ADDRESS: &str = "127.0.0.1:8443";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Runs `script` with bash in a fresh folder, the binary on `PATH` and a
/// free port for the broker it starts (stopped after it), and checks its
/// stdout prints `expected`'s lines in order; its stderr.
async fn runs_as_written(script: &str, expected: &str) -> String {
    let folder = tempfile::tempdir().expect("a folder");
    let bin = folder.path().join("bin");
    std::fs::create_dir(&bin).expect("bin");
    std::os::unix::fs::symlink(
        env!("CARGO_BIN_EXE_delegation-broker"),
        bin.join("delegation-broker"),
    )
    .expect("the binary on PATH");
    let port = free_port();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(format!("{script}\nkill %1; wait"))
        .current_dir(folder.path())
        .env("PATH", path)
        .env("BROKER_LISTEN", format!("127.0.0.1:{port}"))
        .env("BROKER_ADDR", format!("http://127.0.0.1:{port}"))
        .env_remove("BROKER_KEY_FILE")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(RUN_LIMIT, run)
        .await
        .expect("the blocks finish")
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let mut lines = stdout.lines();
    for wanted in expected.lines() {
        assert!(
            lines.any(|line| matches(wanted, line)),
            "the documented output line {wanted:?} is not printed (in order);\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
    stderr
}
