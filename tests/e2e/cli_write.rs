//! The writing commands (`open-root`, `delegate`, `accept`, `decline`,
//! `complete`, `escalate`, `revoke`, `record`) and `health`, `keys show`
//! run as the binary against a real broker: each signs as its
//! `--key-file`, prints what the broker answered, and says a refusal by
//! its exit status.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use broker_client::Agent;
use serde_json::Value;

use crate::harness::*;

/// Longest one CLI run may take (only keeps a hung run from hanging).
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// `write::REFUSED_EXIT_STATUS`.
const REFUSED: i32 = 3;

/// One party of the scene: its key and its key file.
struct Party {
    agent: Agent,
    key_file: PathBuf,
}

impl Party {
    fn new(dir: &Path, name: &str) -> Self {
        let agent = Agent::generate();
        let key_file = dir.join(format!("{name}.key"));
        write_key_file(&key_file, &agent.seed());
        Self { agent, key_file }
    }

    fn key(&self) -> String {
        hex::encode(self.agent.public_key())
    }

    /// Runs `args` as this party against `addr`.
    async fn run(&self, addr: &str, args: &[&str]) -> Output {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"));
        command
            .args(args)
            .arg("--key-file")
            .arg(&self.key_file)
            .args(["--addr", addr])
            .env("BROKER_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        tokio::time::timeout(RUN_LIMIT, command.output())
            .await
            .expect("the CLI ends")
            .expect("the CLI runs")
    }

    /// Runs `args` and `extra`, which must succeed; its stdout.
    async fn ok(&self, addr: &str, args: &[&str], extra: &str) -> String {
        let out = self.run(addr, &[args, &[extra]].concat()).await;
        assert!(
            out.status.success(),
            "{args:?} failed: {}",
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// Runs `args` with `--json`; the object printed.
    async fn json(&self, addr: &str, args: &[&str]) -> Value {
        let out = self.ok(addr, args, "--json").await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
    }

    /// Runs `args` with `-q`; the id printed.
    async fn id(&self, addr: &str, args: &[&str]) -> String {
        let id = self.ok(addr, args, "-q").await.trim().to_owned();
        assert!(
            id.len() == 64 && hex::decode(&id).is_ok(),
            "not an id: {id:?}"
        );
        id
    }
}

/// The command failed with exit status 1 (an error, not a refusal) and
/// said `says` on stderr.
fn assert_fails(out: &Output, says: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(says), "{stderr}");
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn every_write_command_signs_and_prints_what_the_broker_answered() {
    let broker = Broker::start().await;
    let addr = broker.addr.as_str();
    let dir = tempfile::tempdir().expect("a folder");
    let orchestrator = Party::new(dir.path(), "orchestrator");
    let planner = Party::new(dir.path(), "planner");
    let host = Party::new(dir.path(), "host");

    let root = orchestrator
        .json(
            addr,
            &[
                "open-root",
                "--intent",
                "fix the login bug",
                "--budget",
                "100",
            ],
        )
        .await;
    assert_eq!(root["outcome"], "issued");
    assert_eq!(
        (root["depth"].as_u64(), root["budget"].as_i64()),
        (Some(0), Some(100))
    );
    let root_id = root["contract_id"].as_str().expect("an id").to_owned();
    let planner_key = planner.key();
    let delegate = |budget: &'static str| {
        let (root_id, planner_key) = (root_id.clone(), planner_key.clone());
        move |host: Option<String>| {
            let mut args = vec!["delegate".to_owned(), root_id, "--to".into(), planner_key];
            args.extend([
                "--budget".into(),
                budget.into(),
                "--task".into(),
                "plan".into(),
            ]);
            args.extend(host.into_iter().flat_map(|h| ["--host".to_owned(), h]));
            args
        }
    };

    // A refusal: printed whole, exit status 3.
    let refused_args = delegate("500")(None);
    let refused_args: Vec<&str> = refused_args.iter().map(String::as_str).collect();
    let out = orchestrator
        .run(addr, &[refused_args.as_slice(), &["--json"]].concat())
        .await;
    assert_eq!(out.status.code(), Some(REFUSED), "{}", text(&out.stderr));
    let refusal: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(refusal["outcome"], "refused");
    assert_eq!(refusal["primary"], "BUDGET_EXCEEDS_PARENT");
    let violation = &refusal["violations"][0];
    assert_eq!(
        (
            violation["requested"].as_str(),
            violation["allowed"].as_str()
        ),
        (Some("500"), Some("100"))
    );

    // Issued, accepted, observed by its host, completed.
    let child_args = delegate("40")(Some(host.key()));
    let child_args: Vec<&str> = child_args.iter().map(String::as_str).collect();
    let child = orchestrator.id(addr, &child_args).await;
    let accepted = planner.json(addr, &["accept", &child]).await;
    assert_eq!(
        (
            accepted["outcome"].as_str(),
            accepted["contract_id"].as_str()
        ),
        (Some("accepted"), Some(child.as_str()))
    );
    let observed = host
        .json(
            addr,
            &[
                "record",
                &child,
                "--tool-call",
                "edit:3",
                "--mutation",
                "src/auth/login.rs",
            ],
        )
        .await;
    assert_eq!(
        (
            observed["outcome"].as_str(),
            observed["observations"].as_u64()
        ),
        (Some("observed"), Some(2))
    );
    let completed = planner
        .json(
            addr,
            &[
                "complete",
                &child,
                "--output",
                "{\"ok\": true}",
                "--claim",
                "done",
                "--consumed",
                "3",
                "--report-status",
                "done",
            ],
        )
        .await;
    assert_eq!(completed["outcome"], "completed");
    assert_eq!(completed["completion"]["consumed"].as_i64(), Some(3));
    assert_eq!(completed["completion"]["has_report"], true);

    // Declined, escalated and revoked children; each receipt names its kind.
    for (ending, by) in [
        ("decline", &planner),
        ("escalate", &planner),
        ("revoke", &orchestrator),
    ] {
        let other = orchestrator.id(addr, &child_args).await;
        if ending == "escalate" {
            planner.json(addr, &["accept", &other]).await;
        }
        let receipt = by
            .json(addr, &[ending, &other, "--reason", "changed plans"])
            .await;
        let kind = receipt["kind"].as_str().expect("a kind").to_lowercase();
        assert_eq!(receipt["outcome"].as_str(), Some(kind.as_str()));
        assert!(
            kind.starts_with(&ending[..ending.len() - 1]),
            "{ending}: {kind}"
        );
        assert_eq!(receipt["reason"], "changed plans");
    }

    // An error is not a refusal: exit status 1, the broker's reason said.
    let unknown = "00".repeat(32);
    let out = planner.run(addr, &["accept", &unknown]).await;
    assert_fails(&out, "NOT_FOUND");
    // A bad argument names itself before anything is sent.
    let out = orchestrator
        .run(
            addr,
            &[
                "delegate",
                &root_id,
                "--to",
                "not-a-key",
                "--budget",
                "1",
                "--task",
                "t",
            ],
        )
        .await;
    assert_fails(&out, "--to must be a 32-byte id");
}

#[tokio::test]
async fn health_and_keys_show_read_a_broker_without_a_key() {
    let broker = Broker::start().await;
    let binary = env!("CARGO_BIN_EXE_delegation-broker");
    let run = |args: Vec<String>| async move {
        let mut command = tokio::process::Command::new(binary);
        command
            .args(args)
            .env("BROKER_LOG", "warn")
            .kill_on_drop(true);
        tokio::time::timeout(RUN_LIMIT, command.output())
            .await
            .expect("the CLI ends")
            .expect("the CLI runs")
    };
    let addr = broker.addr.clone();
    let out = run(vec!["health".into(), "--addr".into(), addr.clone()]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "serving\n");

    let shown = run(vec![
        "keys".into(),
        "show".into(),
        "--addr".into(),
        addr.clone(),
        "--json".into(),
    ])
    .await;
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    let key: Value = serde_json::from_slice(&shown.stdout).expect("JSON");
    assert_eq!(key["current"], true);
    let quiet = run(vec![
        "keys".into(),
        "show".into(),
        "--addr".into(),
        addr,
        "-q".into(),
    ])
    .await;
    assert_eq!(
        text(&quiet.stdout).trim(),
        key["public_key_hex"].as_str().expect("hex")
    );

    // The base64 form verifies a chain as well as the hex one.
    let dir = tempfile::tempdir().expect("a folder");
    let orchestrator = Party::new(dir.path(), "orchestrator");
    let open = ["open-root", "--intent", "check", "--budget", "5"];
    let root = orchestrator.id(&broker.addr, &open).await;
    let chain = dir.path().join("chain.bin");
    let chain = chain.to_str().expect("a path");
    let get = ["get", root.as_str(), "--chain-out", chain];
    orchestrator.ok(&broker.addr, &get, "--json").await;
    let base64_key = key["public_key_base64"].as_str().expect("base64");
    let verified = run(vec![
        "verify".into(),
        "--public-key".into(),
        base64_key.into(),
        "--chain".into(),
        chain.into(),
        "--contract-id".into(),
        root.clone(),
    ])
    .await;
    assert!(verified.status.success(), "{}", text(&verified.stderr));
    assert!(text(&verified.stdout).contains("ok chain of 1 contracts"));

    // Nothing listens there: not serving, and said so.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a port");
    let out = run(vec![
        "health".into(),
        "--addr".into(),
        format!("http://{closed}"),
    ])
    .await;
    assert_fails(&out, "cannot connect");
}

/// `completions SHELL` prints a script that knows the commands.
#[tokio::test]
async fn completions_know_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["completions", shell])
            .output()
            .await
            .expect("the CLI runs");
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        for command in ["open-root", "delegate", "health", "verify"] {
            assert!(
                script.contains(command),
                "{shell} completions lack {command}"
            );
        }
    }
}
