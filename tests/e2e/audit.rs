//! Audits over gRPC: conflicts between siblings, false
//! completion vs prose, and two orchestration arms aggregated exactly —
//! also through the `audit` CLI and its JSON export.

use std::collections::HashMap;

use broker_client::Agent;
use delegation_broker::cli::audit::GroupRow;
use delegation_broker::pb;

use crate::harness::*;

/// One delegate of a run: what its host observes and how it ends.
struct Work {
    task: &'static str,
    reads: &'static [&'static str],
    mutations: &'static [&'static str],
    report: bool,
}

struct Run {
    orchestrator: Agent,
    children: Vec<Vec<u8>>,
}

async fn run(
    broker: &mut Broker,
    labels: &[(&str, &str)],
    work: &[Work],
    refused_extra: bool,
) -> Run {
    let orchestrator = Agent::generate();
    let spec = RootSpec {
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>(),
        budget: 100,
        scope: vec!["src".into()],
        ..RootSpec::default()
    };
    let root = broker.open_root(&orchestrator, spec).await;
    let mut children = Vec::new();
    for w in work {
        let [delegate, host] = agents();
        let mut body = root.child(&delegate, 20);
        body.task = w.task.into();
        body.predicate = "result.within_scope".into();
        body.host_public_key = host.public_key().to_vec();
        let id = broker.issue(&orchestrator, body).await;
        broker.accept(&delegate, &id, None).await.unwrap();
        let mut observations: Vec<pb::Observation> = w
            .reads
            .iter()
            .map(|p| pb::Observation {
                kind: pb::ObservationKind::Read as i32,
                path: p.to_string(),
                tool: String::new(),
                units: 0,
                at_ms: now_ms(),
                ..Default::default()
            })
            .collect();
        observations.extend(w.mutations.iter().map(|p| mutation(p, 0)));
        broker.record(&host, &id, observations).await.unwrap();
        let report = w.report.then(|| pb::TypedReport {
            status: "done".into(),
            summary: "all good".into(),
        });
        broker
            .complete(
                &delegate,
                pb::CompleteBody {
                    header: None,
                    contract_id: id.clone(),
                    output_json: "{}".into(),
                    report,
                    claim: "success".into(),
                    consumed: 10,
                },
            )
            .await
            .unwrap();
        children.push(id);
    }
    if refused_extra {
        broker
            .refuse(&orchestrator, root.child(&Agent::generate(), 1_000))
            .await;
    }
    Run {
        orchestrator,
        children,
    }
}

/// (a) on a real contract, (c) and (d).
#[tokio::test]
async fn contract_audits_count_host_facts_conflicts_and_false_completions() {
    let mut broker = Broker::start().await;
    let r = run(
        &mut broker,
        &[("arm", "x")],
        &[
            Work {
                task: "Fix the refresh in `src/auth/token.rs`; the module is src/auth/.",
                reads: &["src/auth/token.rs", "src/auth/session.rs", "docs/auth.md"],
                mutations: &["src/shared.rs", "docs/auth.md"],
                report: true,
            },
            Work {
                task: "Tidy src/shared.rs",
                reads: &[],
                mutations: &["src/shared.rs"],
                report: false,
            },
        ],
        false,
    )
    .await;
    let first = audit(&mut broker, &r.children[0]).await;
    assert_eq!((first.parent_scope_hints, first.parent_named_files), (1, 1));
    assert_eq!(first.named_files, vec!["src/auth/token.rs".to_owned()]);
    // Evidence: token.rs, session.rs, docs/auth.md, src/shared.rs.
    assert_eq!((first.evidence_paths, first.discovered_paths), (4, 3));
    assert_eq!((first.mutations, first.claim_violations), (2, 1));
    assert!(first.completed && first.has_report);
    assert_eq!(first.downgrades, 1, "within_scope was refused");
    assert!(first.false_completion);
    assert_eq!(first.claim, "success");
    assert_eq!(first.verdict, pb::Verdict::Rejected as i32);
    assert_eq!(first.conflicts.len(), 1);
    assert_eq!(first.conflicts[0].path, "src/shared.rs");
    assert_eq!(
        first.conflicts[0].other_contract_ids,
        vec![r.children[1].clone()]
    );

    let second = audit(&mut broker, &r.children[1]).await;
    assert!(second.completed && !second.has_report, "ended in prose");
    assert!(!second.false_completion);
    assert_eq!(
        second.conflicts[0].other_contract_ids,
        vec![r.children[0].clone()]
    );

    let groups = broker
        .client
        .aggregate_audits(pb::AggregateAuditsRequest {
            selector: [("arm".to_owned(), "x".to_owned())].into(),
            group_by: vec![],
        })
        .await
        .unwrap()
        .into_inner()
        .groups;
    assert_eq!(groups.len(), 1);
    assert_eq!(
        groups[0].conflicts, 1,
        "one path mutated by two contracts: one conflict"
    );
    // By who opened the run: its key id, as no identity is bound; and
    // the delegate of an unbound contract has none in its audit.
    let by_opener = broker
        .client
        .aggregate_audits(pb::AggregateAuditsRequest {
            selector: [("arm".to_owned(), "x".to_owned())].into(),
            group_by: vec!["@identity".into()],
        })
        .await
        .unwrap()
        .into_inner()
        .groups;
    let opener = delegation_broker::crypto::key_id(&r.orchestrator.public_key());
    assert_eq!(by_opener.len(), 1);
    assert_eq!(by_opener[0].key["@identity"], opener);
    assert_eq!(by_opener[0].runs, 1);
    assert_eq!(first.delegate_identity, "");
    // Reading audits changed nothing.
    assert_eq!(audit(&mut broker, &r.children[0]).await, first);
    broker.stop().await;
}

/// (e) Two arms of two runs each aggregate to the exact expected table, and
/// the CLI prints it and exports JSON that round-trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_arms_aggregate_to_the_expected_table() {
    let mut broker = Broker::start().await;
    for n in ["1", "2"] {
        let flat_work = if n == "1" {
            Work {
                task: "Fix src/auth/token.rs in src/auth/",
                reads: &["src/auth/token.rs"],
                mutations: &["src/auth/token.rs"],
                report: true,
            }
        } else {
            Work {
                task: "Fix src/auth/token.rs in src/auth/",
                reads: &["src/auth/session.rs"],
                mutations: &["docs/x.md"],
                report: true,
            }
        };
        run(
            &mut broker,
            &[("arm", "flat"), ("run", n)],
            &[flat_work],
            false,
        )
        .await;
        let deep = [
            Work {
                task: "Look into the src/ tree",
                reads: &[],
                mutations: &["src/a.rs"],
                report: false,
            },
            Work {
                task: "Look into the src/ tree",
                reads: &[],
                mutations: &["src/a.rs"],
                report: true,
            },
        ];
        run(&mut broker, &[("arm", "deep"), ("run", n)], &deep, true).await;
    }
    let response = broker
        .client
        .aggregate_audits(pb::AggregateAuditsRequest {
            selector: HashMap::new(),
            group_by: vec!["arm".into()],
        })
        .await
        .unwrap()
        .into_inner();
    let rows: Vec<GroupRow> = response.groups.into_iter().map(GroupRow::from).collect();
    let deep = GroupRow {
        key: [("arm".to_owned(), "deep".to_owned())].into(),
        runs: 2,
        contracts: 4,
        discovered_paths: 4,
        evidence_paths: 4,
        discovery_rate: Some(1.0),
        with_report: 2,
        false_completions: 0,
        false_completion_rate: Some(0.0),
        claim_violations: 0,
        mutations: 4,
        claim_violations_per_mutation: Some(0.0),
        conflicts: 2,
        escalations: 0,
        refusals_by_code: [("BUDGET_EXCEEDS_PARENT".to_owned(), 2)].into(),
        budget_spent: 40,
        budget_granted: 200,
        spent_over_granted: Some(0.2),
    };
    let flat = GroupRow {
        key: [("arm".to_owned(), "flat".to_owned())].into(),
        runs: 2,
        contracts: 2,
        discovered_paths: 2,
        evidence_paths: 3,
        discovery_rate: Some(2.0 / 3.0),
        with_report: 2,
        false_completions: 1,
        false_completion_rate: Some(0.5),
        claim_violations: 1,
        mutations: 2,
        claim_violations_per_mutation: Some(0.5),
        conflicts: 0,
        escalations: 0,
        refusals_by_code: Default::default(),
        budget_spent: 20,
        budget_granted: 200,
        spent_over_granted: Some(0.1),
    };
    assert_eq!(rows, vec![deep, flat]);

    // The CLI, against the same server.
    // The CLI is a separate process: run it off the async workers, which
    // must keep serving it.
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("reader.key");
    write_key_file(&key_file, &broker.reader.seed());
    let cli = |format: &'static str| {
        let addr = broker.addr.clone();
        let key_file = key_file.clone();
        tokio::task::spawn_blocking(move || {
            stdout_of(
                std::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
                    .args([
                        "audit",
                        "--key-file",
                        key_file.to_str().unwrap(),
                        "--addr",
                        &addr,
                        "--group-by",
                        "arm",
                        "--format",
                        format,
                    ])
                    .env("BROKER_LOG", "warn"),
            )
        })
    };
    let exported: Vec<GroupRow> = serde_json::from_str(&cli("json").await.unwrap()).unwrap();
    assert_eq!(exported, rows, "the JSON export round-trips");
    let table = cli("table").await.unwrap();
    assert!(
        table.contains("arm=flat") && table.contains("arm=deep"),
        "{table}"
    );
    assert!(table.contains("2/3 = 0.667"), "{table}");
    let csv = cli("csv").await.unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(csv.starts_with("arm,runs,contracts"), "{csv}");
    broker.stop().await;
}

/// A host may say of each tool call its arguments' digest and how it ended
/// (what the MCP gateway records); anything else in those fields is
/// INVALID_ARGUMENT naming the field, and nothing is recorded.
#[tokio::test]
async fn a_tool_calls_digest_and_outcome_are_checked() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let [delegate, host] = agents();
    let mut body = root.child(&delegate, 20);
    body.host_public_key = host.public_key().to_vec();
    let id = broker.issue(&orchestrator, body).await;
    let said = pb::Observation {
        arguments_sha256: vec![9; 32],
        outcome: pb::ToolOutcome::Failed as i32,
        ..tool_call("write_file", 1)
    };
    let receipt = broker.record(&host, &id, vec![said.clone()]).await.unwrap();
    assert_eq!(receipt.observations, 1);
    for (bad, field) in [
        (
            pb::Observation {
                arguments_sha256: vec![9; 31],
                ..said.clone()
            },
            "body.observations.arguments_sha256",
        ),
        (
            pb::Observation {
                outcome: 7,
                ..said.clone()
            },
            "body.observations.outcome",
        ),
        (
            pb::Observation {
                arguments_sha256: vec![9; 32],
                ..mutation("src/a", 0)
            },
            "body.observations.arguments_sha256",
        ),
        (
            pb::Observation {
                outcome: pb::ToolOutcome::Succeeded as i32,
                ..mutation("src/a", 0)
            },
            "body.observations.outcome",
        ),
    ] {
        let status = broker.record(&host, &id, vec![bad]).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(field) || format!("{status:?}").contains(field),
            "{field}: {status:?}"
        );
    }
    let audit = audit(&mut broker, &id).await;
    assert_eq!(audit.tool_calls, 1, "only the valid call was recorded");
}
