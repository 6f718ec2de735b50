//! `delegation-broker tree`: the seed 001 tree,
//! read from a real broker and drawn, against a golden file. Ids and
//! deadlines vary between runs; they are replaced by stable marks before
//! comparing. `UPDATE_GOLDEN=1` rewrites the file.

use std::collections::BTreeMap;

use delegation_broker::cli::tree;
use delegation_broker::pb;

use crate::harness::*;

const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/golden/tree-seed-001.txt"
);

#[tokio::test]
async fn tree_prints_the_seed_001_tree() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let [planner, executor, host] = agents();
    // seed 001: the planner (25, 12 to retry) asks for an executor of 20
    // (refused NO_RETRY_HEADROOM), then of 13.
    let predicate = "result.schema_valid && result.within_scope";
    let (_, executor_id) = seed_001_delegations(
        &mut broker,
        &root,
        [&orchestrator, &planner, &executor],
        predicate,
    )
    .await;
    // The executor mutates outside its scope and claims success: REJECTED
    // on within_scope, on what the host observed.
    broker
        .accept(&executor, &executor_id, Some(&host))
        .await
        .unwrap();
    broker
        .observe(&host, &executor_id, mutation("etc/passwd", 0))
        .await;
    let completion = broker
        .completion(
            &executor,
            complete_body(
                &executor_id,
                "{}",
                "fixed the token refresh, all in src/auth",
                4,
            ),
        )
        .await;
    assert_eq!(completion.verdict, pb::Verdict::Rejected as i32);

    let data = tree::fetch(&mut broker.client, &root.id, tree::DEFAULT_TREE_CONTRACTS)
        .await
        .expect("the tree reads");
    let names: BTreeMap<[u8; 32], String> = [
        (orchestrator.public_key(), "orchestrator"),
        (planner.public_key(), "planner"),
        (executor.public_key(), "executor"),
        (host.public_key(), "host"),
    ]
    .into_iter()
    .map(|(k, n)| (k, n.to_owned()))
    .collect();
    let mut text = tree::render(&data, &names);
    // Stable marks for what varies: contract ids in order of appearance,
    // deadlines.
    for (n, state) in data.contracts.iter().enumerate() {
        text = text.replace(&hex::encode(&state.contract_id[..4]), &format!("#{n}"));
        let contract: pb::Contract =
            prost::Message::decode(state.contract.as_ref().unwrap().payload.as_slice()).unwrap();
        text = text.replace(&tree::rfc3339(contract.deadline_ms), "<deadline>");
    }
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(GOLDEN, &text).unwrap();
        panic!("rewrote {GOLDEN}; run again without UPDATE_GOLDEN to check it");
    }
    let golden = std::fs::read_to_string(GOLDEN).expect("tests/golden/tree-seed-001.txt");
    assert_eq!(text, golden, "the tree's drawing changed:\n{text}");

    // The same tree as `tree --json` prints it, from the binary.
    let dir = tempfile::tempdir().expect("a folder");
    let key_file = dir.path().join("reader.key");
    write_key_file(&key_file, &broker.reader.seed());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args([
            "tree",
            &hex::encode(&root.id),
            "--json",
            "--addr",
            &broker.addr,
        ])
        .arg("--key-file")
        .arg(&key_file)
        .output()
        .await
        .expect("the CLI runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let contracts = json["contracts"].as_array().expect("contracts");
    let depths: Vec<_> = contracts.iter().map(|c| c["depth"].as_u64()).collect();
    assert_eq!(depths, [Some(0), Some(1), Some(2)]);
    let planner_receipts = contracts[1]["receipts"].as_array().expect("receipts");
    assert!(
        planner_receipts
            .iter()
            .any(|r| r["kind"] == "REFUSED" && r["primary"] == "NO_RETRY_HEADROOM"),
        "{planner_receipts:?}"
    );
    assert_eq!(contracts[2]["status"], "COMPLETED");
    assert_eq!(contracts[2]["ledger"]["spent"].as_i64(), Some(4));
    broker.stop().await;
}
