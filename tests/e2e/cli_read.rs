//! The reading commands: `session`,
//! `get`, `children`, `watch` and `receipt` run as the binary against a
//! real broker, reading as its reader key. Text is compared whole against
//! golden text once what varies between runs (ids, keys, digests, times,
//! cursors) is replaced by marks; JSON is parsed and checked field by
//! field.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use base64::Engine as _;
use broker_client::Agent;
use delegation_broker::cli::tree::rfc3339;
use delegation_broker::crypto;
use delegation_broker::pb;
use prost::Message as _;
use serde_json::Value;
use tokio::io::AsyncBufReadExt as _;

use crate::harness::*;

/// Longest a CLI run may take before the test fails (none should come
/// near it: this only keeps a hung run from hanging the suite).
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// A tree with something of everything: a root (labels, policy); A, a
/// liable child with an attested delegate, a named host and a predicate,
/// accepted, observed and completed; a refused Delegate; B, revoked.
struct Scene {
    broker: Broker,
    key_file: PathBuf,
    _key_dir: tempfile::TempDir,
    root: Root,
    a_id: Vec<u8>,
    a: pb::Contract,
    b_id: Vec<u8>,
    refused: (Vec<u8>, pb::Receipt),
    revoked: (Vec<u8>, pb::Receipt),
    completed: (Vec<u8>, pb::Receipt),
    /// Every run-specific value and the mark that replaces it.
    marks: Vec<(String, String)>,
}

fn receipt_of(sealed: &pb::Sealed) -> (Vec<u8>, pb::Receipt) {
    (
        crypto::sha256(&sealed.payload).to_vec(),
        decode_receipt(sealed),
    )
}

/// `rfc3339 (ms ms)`, as the text prints a time.
fn when(ms: i64) -> String {
    format!("{} ({ms} ms)", rfc3339(ms))
}

async fn scene() -> Scene {
    let mut broker = Broker::start().await;
    let [orchestrator, a_agent, b_agent, host] = agents();
    let spec = RootSpec {
        labels: [("arm".to_owned(), "flat".to_owned())].into(),
        ..RootSpec::default()
    };
    let root = broker.open_root(&orchestrator, spec).await;
    let attestation = broker.attest(&a_agent, 0.9);
    let mut to_a = root.liable_child(&a_agent, 25, "result.schema_valid && result.within_scope");
    to_a.min_retry_cost = 12;
    to_a.host_public_key = host.public_key().to_vec();
    to_a.delegate_attestation = Some(attestation.clone());
    let (a_id, a) = broker.delegate(&orchestrator, to_a).await.unwrap().issued();
    let (refusal_id, refusal_sealed, _) = broker
        .delegate(&orchestrator, root.child(&b_agent, 1_000))
        .await
        .unwrap()
        .refused();
    let refused = receipt_of(&refusal_sealed);
    assert_eq!(refused.0, refusal_id);
    let (b_id, b) = broker
        .delegate(&orchestrator, root.child(&b_agent, 10))
        .await
        .unwrap()
        .issued();
    let revoked = receipt_of(
        &send_lifecycle(
            &mut broker.client,
            &orchestrator,
            pb::RevokeBody {
                header: None,
                contract_id: b_id.clone(),
                reason: "no longer needed".into(),
            },
        )
        .await
        .unwrap(),
    );
    let accepted = receipt_of(
        &send_lifecycle(
            &mut broker.client,
            &a_agent,
            pb::AcceptBody {
                header: None,
                contract_id: a_id.clone(),
                host_public_key: Vec::new(),
            },
        )
        .await
        .unwrap(),
    );
    let observed = receipt_of(
        &send_lifecycle(
            &mut broker.client,
            &host,
            pb::RecordReceiptsBody {
                header: None,
                contract_id: a_id.clone(),
                observations: vec![mutation("src/auth/token.rs", 4)],
            },
        )
        .await
        .unwrap(),
    );
    let completed = receipt_of(
        &send_lifecycle(
            &mut broker.client,
            &a_agent,
            complete_body(&a_id, "{}", "done", 0),
        )
        .await
        .unwrap(),
    );

    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("reader.key");
    // As `keygen` writes it.
    write_key_file(&key_file, &broker.reader.seed());

    let mut marks: Vec<(String, String)> = Vec::new();
    let mut mark = |value: String, name: &str| marks.push((value, format!("<{name}>")));
    for (key, who) in [
        (orchestrator.public_key(), "orchestrator"),
        (a_agent.public_key(), "a"),
        (b_agent.public_key(), "b"),
        (host.public_key(), "host"),
    ] {
        mark(hex::encode(key), who);
        mark(hex::encode(&key[..4]), &format!("{who} short"));
    }
    for (id, name) in [
        (&root.id, "root"),
        (&a_id, "A"),
        (&b_id, "B"),
        (&refused.0, "refused"),
        (&revoked.0, "revoked"),
        (&accepted.0, "accepted"),
        (&observed.0, "observed"),
        (&completed.0, "completed"),
    ] {
        mark(hex::encode(id), name);
    }
    mark(hex::encode(&root.lineage), "lineage");
    mark(
        hex::encode(crypto::sha256(&attestation.payload)),
        "attestation",
    );
    // Children asked for no deadline get their parent's; two times may
    // fall in one millisecond, so times are marked by what they are (the
    // JSON checks them exactly).
    assert_eq!(
        (a.deadline_ms, b.deadline_ms),
        (root.contract.deadline_ms, root.contract.deadline_ms)
    );
    mark(when(root.contract.deadline_ms), "deadline");
    for (contract, name) in [(&root.contract, "root"), (&a, "A"), (&b, "B")] {
        mark(
            hex::encode(&contract.request_digest),
            &format!("{name} request"),
        );
        mark(when(contract.issued_at_ms), "issued");
    }
    for (receipt, name) in [
        (&refused.1, "refused"),
        (&revoked.1, "revoked"),
        (&accepted.1, "accepted"),
        (&observed.1, "observed"),
        (&completed.1, "completed"),
    ] {
        mark(
            hex::encode(&receipt.request_digest),
            &format!("{name} request"),
        );
        mark(when(receipt.at_ms), "at");
    }
    let elapsed = completed.1.completion.as_ref().unwrap().elapsed_ms;
    marks.push((
        format!("{:16}{elapsed} ms\n", "elapsed:"),
        format!("{:16}<elapsed> ms\n", "elapsed:"),
    ));
    marks.push((
        root.contract.broker_key_id.clone(),
        "<broker key>".to_owned(),
    ));
    // Longest first: a short key is the start of its full hex.
    marks.sort_by_key(|(value, _)| std::cmp::Reverse(value.len()));
    Scene {
        broker,
        key_file,
        _key_dir: key_dir,
        root,
        a_id,
        a,
        b_id,
        refused,
        revoked,
        completed,
        marks,
    }
}

impl Scene {
    fn redact(&self, text: &str) -> String {
        self.marks
            .iter()
            .fold(text.to_owned(), |text, (value, mark)| {
                text.replace(value, mark)
            })
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        command(&self.broker.addr, &self.key_file, args)
    }

    /// Runs the CLI to its end; its output.
    async fn run(&self, args: &[&str]) -> Output {
        run(self.command(args)).await
    }

    /// Runs the CLI, which must succeed; its stdout.
    async fn stdout(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

fn command(addr: &str, key_file: &Path, args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"));
    command
        .args(args)
        .arg("--key-file")
        .arg(key_file)
        .args(["--addr", addr])
        .env("BROKER_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// The CLI is another process: awaiting it leaves this runtime free to
/// serve it.
async fn run(mut command: tokio::process::Command) -> Output {
    tokio::time::timeout(RUN_LIMIT, command.output())
        .await
        .expect("the CLI ends")
        .expect("the CLI runs")
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

const GET_A: &str = "\
contract:            <A>
parent:              <root>
depth:               1
status:              COMPLETED
delegate:            <a>
principal:           <orchestrator>
host:                <host>
task:                work on src/auth/token.rs
budget:              25
ledger:              budget 25 = residual 21 + reserved 0 + spent 4; 0 open children
deadline:            <deadline>
issued:              <issued>
trust:               0.900 (900000 ppm), this hop 0.900 from ATTESTATION, risk class test, attestation <attestation>
liability:           DELEGATE
escalation channel:  broker://escalate
retry:               min cost 12, min latency 0 ms
write scope:         src
predicate:           result.schema_valid && result.within_scope
effective predicate: (result.schema_valid && result.within_scope
                     )
result schema:       -
lineage hash:        <lineage>
request digest:      <A request>
signature:           verified (<broker key>)
";

const GET_ROOT: &str = "\
contract:            <root>
parent:              - (a root)
depth:               0
status:              OPEN
delegate:            <orchestrator>
principal:           <orchestrator>
host:                -
intent:              Fix the token refresh bug in src/auth/ and document it
task:                Fix the token refresh bug in src/auth/ and document it
budget:              100
ledger:              budget 100 = residual 96 + reserved 0 + spent 4; 0 open children
deadline:            <deadline>
issued:              <issued>
trust:               1.000 (1000000 ppm), this hop 1.000 from ROOT
liability:           DELEGATE
escalation channel:  -
retry:               min cost 0, min latency 0 ms
write scope:         docs, src
predicate:           -
effective predicate: -
result schema:       -
policy:              max depth 4, min trust 0.000, max children 64, retry headroom on, host required no
labels:              arm=flat
lineage hash:        <lineage>
request digest:      <root request>
signature:           verified (<broker key>)
";

/// `get`: the golden text of a child and of a root, the same from a
/// base64 id, and the JSON object field by field.
#[tokio::test]
async fn get_prints_a_contract_verified() {
    let mut s = scene().await;
    let a_hex = hex::encode(&s.a_id);
    let text = s.stdout(&["get", &a_hex]).await;
    assert_eq!(s.redact(&text), GET_A, "get A:\n{text}");
    let root_text = s.stdout(&["get", &hex::encode(&s.root.id)]).await;
    assert_eq!(s.redact(&root_text), GET_ROOT, "get root:\n{root_text}");
    // grpcurl prints bytes as standard base64; URL-safe, unpadded works too.
    for engine in [
        &base64::engine::general_purpose::STANDARD,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        assert_eq!(s.stdout(&["get", &engine.encode(&s.a_id)]).await, text);
    }

    let got = json(&s.stdout(&["get", &a_hex, "--json"]).await);
    assert_eq!(got["contract_id"], a_hex);
    assert_eq!(got["parent_id"], hex::encode(&s.root.id));
    assert_eq!(got["depth"], 1);
    assert_eq!(got["status"], "COMPLETED");
    assert_eq!(
        got["delegate_public_key"],
        hex::encode(&s.a.delegate_public_key)
    );
    assert_eq!(
        got["principal_public_key"],
        hex::encode(&s.root.contract.delegate_public_key)
    );
    assert_eq!(got["host_public_key"], hex::encode(&s.a.host_public_key));
    assert_eq!(got["budget"], 25);
    assert_eq!(got["deadline_ms"], s.a.deadline_ms);
    assert_eq!(got["deadline"], rfc3339(s.a.deadline_ms));
    assert_eq!(got["issued_at_ms"], s.a.issued_at_ms);
    assert_eq!(got["liability"], "DELEGATE");
    assert_eq!(got["trust_source"], "ATTESTATION");
    assert_eq!(got["factor_ppm"], 900_000);
    assert_eq!(got["cumulative_trust_ppm"], 900_000);
    assert_eq!(got["risk_class"], "test");
    assert_eq!(got["min_retry_cost"], 12);
    assert_eq!(got["write_scope"], serde_json::json!(["src"]));
    assert_eq!(got["predicate"], s.a.predicate);
    assert_eq!(
        got["effective_predicate"],
        s.broker.effective_predicate(&s.a_id).await
    );
    assert_eq!(got["intent_lineage_hash"], hex::encode(&s.root.lineage));
    assert_eq!(got["policy"], Value::Null);
    let ledger = &got["ledger"];
    assert_eq!(
        (
            &ledger["budget"],
            &ledger["residual"],
            &ledger["reserved"],
            &ledger["spent"],
            &ledger["open_children"]
        ),
        (&25.into(), &21.into(), &0.into(), &4.into(), &0.into())
    );
    assert_eq!(got["verified"], true);
    assert_eq!(got["verified_by"], s.a.broker_key_id);

    let root = json(&s.stdout(&["get", &hex::encode(&s.root.id), "--json"]).await);
    assert_eq!(root["parent_id"], "");
    assert_eq!(root["intent"], s.root.contract.intent);
    assert_eq!(root["labels"], serde_json::json!({"arm": "flat"}));
    assert_eq!(root["policy"]["max_depth"], 4);
    assert_eq!(root["policy"]["max_children"], 64);
    assert_eq!(root["policy"]["require_host"], false);
    assert_eq!(root["trust_source"], "ROOT");
    assert_eq!(root["status"], "OPEN");
    assert_eq!(root["ledger"]["spent"], 4);
    s.broker.stop().await;
}

/// Ids that are not 32 bytes, keys that may not read, brokers that are
/// not there: a non-zero exit and an error naming what is wrong.
#[tokio::test]
async fn reading_errors_name_their_cause() {
    let s = scene().await;
    let out = s.run(&["get", "abc"]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("CONTRACT_ID must be a 32-byte id"),
        "{stderr}"
    );
    let out = s.run(&["receipt", &hex::encode([1u8; 33])]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("RECEIPT_ID"),
        "{stderr}"
    );
    // An id that does not exist, and one a stranger may not read, are one
    // answer (NOT_FOUND).
    let out = s.run(&["get", &hex::encode([7u8; 32])]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("NotFound"),
        "{stderr}"
    );
    let stranger_dir = tempfile::tempdir().unwrap();
    let stranger = stranger_dir.path().join("stranger.key");
    write_key_file(&stranger, &Agent::generate().seed());
    let out = run(command(
        &s.broker.addr,
        &stranger,
        &["get", &hex::encode(&s.root.id)],
    ))
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("NotFound"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    s.broker.stop().await;
}

/// `children`: one line per child in issuance order, `--max` with a note
/// on stderr, and one JSON object per line.
#[tokio::test]
async fn children_lists_a_contracts_children() {
    let s = scene().await;
    let root = hex::encode(&s.root.id);
    let text = s.stdout(&["children", &root]).await;
    assert_eq!(
        s.redact(&text),
        "<A> COMPLETED    depth 1 budget 25 delegate <a short>\n\
         <B> REVOKED      depth 1 budget 10 delegate <b short>\n",
        "{text}"
    );
    let out = s.run(&["children", &root, "--max", "1"]).await;
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        text.lines().next().unwrap().to_owned() + "\n"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max"), "{stderr}");
    // A leaf has none.
    assert_eq!(s.stdout(&["children", &hex::encode(&s.b_id)]).await, "");

    let lines: Vec<Value> = s
        .stdout(&["children", &root, "--json"])
        .await
        .lines()
        .map(json)
        .collect();
    assert_eq!(lines.len(), 2);
    let (a, b) = (&lines[0], &lines[1]);
    assert_eq!(a["contract_id"], hex::encode(&s.a_id));
    assert_eq!(a["parent_id"], root);
    assert_eq!(a["status"], "COMPLETED");
    assert_eq!(a["depth"], 1);
    assert_eq!(a["budget"], 25);
    assert_eq!(
        a["delegate_public_key"],
        hex::encode(&s.a.delegate_public_key)
    );
    assert_eq!(a["ledger"]["spent"], 4);
    assert_eq!(b["contract_id"], hex::encode(&s.b_id));
    assert_eq!(b["status"], "REVOKED");
    assert_eq!(b["liability"], "PRINCIPAL");
    assert_eq!(b["ledger"]["budget"], 10);
    s.broker.stop().await;
}

const COMPLETED: &str = "\
receipt:        <completed>
kind:           COMPLETED
contract:       <A>
root:           <root>
at:             <at>
requester:      <a>
request digest: <completed request>
verdict:        ACCEPTED
schema valid:   true
within scope:   true
claim:          done
typed report:   false
consumed:       4, returned 21, overspend 0, claimed excess 0
result digest:  44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a
elapsed:        <elapsed> ms
attribution:    <a> at depth 1
signature:      verified (<broker key>)
";

const REFUSED: &str = "\
receipt:        <refused>
kind:           REFUSED
contract:       <root>
root:           <root>
at:             <at>
requester:      <orchestrator>
request digest: <refused request>
primary:        BUDGET_EXCEEDS_PARENT
violation:      BUDGET_EXCEEDS_PARENT requested 1000, allowed 75: <detail>
signature:      verified (<broker key>)
";

const REVOKED: &str = "\
receipt:        <revoked>
kind:           REVOKED
contract:       <B>
root:           <root>
at:             <at>
requester:      <orchestrator>
request digest: <revoked request>
reason:         no longer needed
ended:          <B>
signature:      verified (<broker key>)
";

/// `receipt`: a completion's checks, a refusal's violations and a
/// revocation, each verified, as golden text; and as JSON.
#[tokio::test]
async fn receipt_prints_a_verified_receipt() {
    let s = scene().await;
    let text = s.stdout(&["receipt", &hex::encode(&s.completed.0)]).await;
    assert_eq!(s.redact(&text), COMPLETED, "{text}");
    let text = s.stdout(&["receipt", &hex::encode(&s.refused.0)]).await;
    let detail = &s.refused.1.violations[0].detail;
    assert_eq!(
        s.redact(&text),
        REFUSED.replace("<detail>", detail),
        "{text}"
    );
    let text = s.stdout(&["receipt", &hex::encode(&s.revoked.0)]).await;
    assert_eq!(s.redact(&text), REVOKED, "{text}");

    let refused = json(
        &s.stdout(&["receipt", &hex::encode(&s.refused.0), "--json"])
            .await,
    );
    assert_eq!(refused["receipt_id"], hex::encode(&s.refused.0));
    assert_eq!(refused["kind"], "REFUSED");
    assert_eq!(refused["contract_id"], hex::encode(&s.root.id));
    assert_eq!(refused["at_ms"], s.refused.1.at_ms);
    assert_eq!(refused["primary"], "BUDGET_EXCEEDS_PARENT");
    let violations = refused["violations"].as_array().unwrap();
    assert_eq!(violations.len(), 1);
    assert_eq!(violations[0]["code"], "BUDGET_EXCEEDS_PARENT");
    assert_eq!(violations[0]["requested"], "1000");
    assert_eq!(violations[0]["allowed"], "75");
    assert_eq!(violations[0]["detail"], *detail);
    assert_eq!(refused["completion"], Value::Null);
    assert_eq!(refused["verified"], true);

    let completed = json(
        &s.stdout(&["receipt", &hex::encode(&s.completed.0), "--json"])
            .await,
    );
    assert_eq!(completed["kind"], "COMPLETED");
    assert_eq!(completed["contract_id"], hex::encode(&s.a_id));
    assert_eq!(
        completed["requester_public_key"],
        hex::encode(&s.a.delegate_public_key)
    );
    let c = &completed["completion"];
    assert_eq!(c["verdict"], "ACCEPTED");
    assert_eq!(c["schema_valid"], true);
    assert_eq!(c["within_scope"], true);
    assert_eq!(c["refused_criteria"], serde_json::json!([]));
    assert_eq!(c["consumed"], 4);
    assert_eq!(c["returned"], 21);
    assert_eq!(c["claim"], "done");
    assert_eq!(
        c["attribution"]["chain"],
        serde_json::json!([hex::encode(&s.root.id), hex::encode(&s.a_id)])
    );
    assert_eq!(completed["verified"], true);
    assert_eq!(completed["verified_by"], s.completed.1.broker_key_id);
    s.broker.stop().await;
}

/// `session`: one line on stdout that, sent as grpcurl sends it (the
/// base64 value decoded into binary metadata), reads through a plain
/// client; without it the same read is refused.
#[tokio::test]
async fn session_prints_a_header_that_reads() {
    let s = scene().await;
    let out = s.run(&["session"]).await;
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("expires"), "{stderr}");
    let value = stdout
        .strip_prefix("x-broker-session-bin: ")
        .and_then(|v| v.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("one header line: {stdout:?}"));
    assert!(!value.contains('\n'));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value)
        .unwrap();
    let sealed = pb::Sealed::decode(bytes.as_slice()).unwrap();
    let session = pb::Session::decode(sealed.payload.as_slice()).unwrap();
    assert_eq!(session.agent_public_key, s.broker.reader.public_key());

    let mut plain = connect(&s.broker.addr).await;
    let read = |with: bool| {
        let mut request = tonic::Request::new(contract_request(&s.root.id));
        if with {
            request.metadata_mut().insert_bin(
                "x-broker-session-bin",
                tonic::metadata::BinaryMetadataValue::from_bytes(&bytes),
            );
        }
        request
    };
    let state = plain
        .get_contract(read(true))
        .await
        .expect("the printed session reads")
        .into_inner()
        .contract
        .unwrap();
    assert_eq!(state.contract_id, s.root.id);
    let refused = plain.get_contract(read(false)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    s.broker.stop().await;
}

const WATCH_ROOT: &str = "\
<c1> contract <root> parent - depth 0 budget 100 delegate <orchestrator short>
<c2> contract <A> parent <root> depth 1 budget 25 delegate <a short>
<c3> receipt REFUSED <root> id <refused> primary BUDGET_EXCEEDS_PARENT
<c4> contract <B> parent <root> depth 1 budget 10 delegate <b short>
<c5> receipt REVOKED <B> id <revoked>
<c6> receipt ACCEPTED <A> id <accepted>
<c7> receipt OBSERVED <A> id <observed>
<c8> receipt COMPLETED <A> id <completed> verdict ACCEPTED
";

/// Replaces each line's cursor by `<cN>`, checking they increase.
fn cursors(text: &str) -> (String, Vec<u64>) {
    let mut seen = Vec::new();
    let mut out = String::new();
    for line in text.lines() {
        let (cursor, rest) = line.split_once(' ').expect("a cursor first");
        let cursor: u64 = cursor.parse().expect("a decimal cursor");
        assert!(seen.last().is_none_or(|last| *last < cursor), "{text}");
        seen.push(cursor);
        out.push_str(&format!("<c{}> {rest}\n", seen.len()));
    }
    (out, seen)
}

/// `watch`: the tree's events in commit order up to `--max-events`,
/// resumed after a cursor as JSON, and a stream printed as it comes that
/// ends cleanly (exit 0) when the broker shuts down.
#[tokio::test]
async fn watch_prints_events_as_lines() {
    let s = scene().await;
    let root = hex::encode(&s.root.id);
    let text = s.stdout(&["watch", &root, "--max-events", "8"]).await;
    let (shown, seen) = cursors(&s.redact(&text));
    assert_eq!(shown, WATCH_ROOT, "{text}");

    let resumed: Vec<Value> = s
        .stdout(&[
            "watch",
            &root,
            "--json",
            "--cursor",
            &seen[2].to_string(),
            "--max-events",
            "2",
        ])
        .await
        .lines()
        .map(json)
        .collect();
    assert_eq!(resumed.len(), 2);
    assert_eq!(resumed[0]["cursor"], seen[3].to_string());
    assert_eq!(resumed[0]["event"], "contract");
    assert_eq!(resumed[0]["contract_id"], hex::encode(&s.b_id));
    assert_eq!(resumed[0]["parent_id"], root);
    assert_eq!(resumed[1]["cursor"], seen[4].to_string());
    assert_eq!(resumed[1]["event"], "receipt");
    assert_eq!(resumed[1]["kind"], "REVOKED");
    assert_eq!(resumed[1]["receipt_id"], hex::encode(&s.revoked.0));
    assert_eq!(resumed[1]["contract_id"], hex::encode(&s.b_id));
    assert_eq!(
        resumed[1]["revoked_ids"],
        serde_json::json!([hex::encode(&s.b_id)])
    );

    // Without a bound it streams: A's four events arrive while it runs.
    // The broker's shutdown ends the stream UNAVAILABLE (service/watch.rs):
    // a non-zero exit, saying why and where to resume.
    let mut watching = s.command(&["watch", &hex::encode(&s.a_id), "--json"]);
    watching
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = watching.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut kinds = Vec::new();
    for _ in 0..4 {
        let line = tokio::time::timeout(RUN_LIMIT, lines.next_line())
            .await
            .expect("an event line")
            .unwrap()
            .expect("the stream is still open");
        let event = json(&line);
        kinds.push(format!(
            "{} {}",
            event["event"].as_str().unwrap(),
            event["kind"].as_str().unwrap_or("")
        ));
    }
    assert_eq!(
        kinds,
        [
            "contract ",
            "receipt ACCEPTED",
            "receipt OBSERVED",
            "receipt COMPLETED"
        ]
    );
    s.broker.stop().await;
    let out = tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
        .await
        .expect("watch ends with the broker")
        .unwrap();
    assert!(!out.status.success(), "{}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Unavailable") && stderr.contains(&format!("--cursor {}", seen[7])),
        "{stderr}"
    );
    assert_eq!(lines.next_line().await.unwrap(), None);
}
