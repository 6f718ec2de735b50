//! Lifecycle and judgment over gRPC: seed 001's failure replayed
//! on host-observed facts, revocation cascades, expiry, resumable watch,
//! and refusals that change nothing.

use std::time::Duration;

use broker_client::Agent;
use delegation_broker::pb;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_types::StatusExt;

use crate::harness::*;

const SEED_001_PREDICATE: &str = "result.schema_valid && result.within_scope";
const PATCH_SCHEMA: &str =
    r#"{"type":"object","required":["patch"],"properties":{"patch":{"type":"string"}}}"#;

/// orchestrator (root 28) → planner (25, liable, seed 001's predicate) →
/// executor (20, liable, no predicate of its own, a host, a schema). Retry
/// headroom is off so seed 001's original chain can be issued at all.
struct Chain {
    broker: Broker,
    orchestrator: Agent,
    planner: Agent,
    executor: Agent,
    executor_host: Agent,
    root: Root,
    planner_id: Vec<u8>,
    executor_id: Vec<u8>,
}

async fn seed_001_chain() -> Chain {
    let mut broker = Broker::start_with(|c| c.limits.expiry_sweep_interval_ms = 50).await;
    let [orchestrator, planner, executor, executor_host] = agents();
    let root = broker
        .open_root(
            &orchestrator,
            RootSpec::with(|s| (s.budget, s.retry_headroom) = (28, false)),
        )
        .await;
    let mut to_planner = root.liable_child(&planner, 25, SEED_001_PREDICATE);
    to_planner.min_retry_cost = 12;
    let planner_id = broker.issue(&orchestrator, to_planner).await;
    broker.accept(&planner, &planner_id, None).await.unwrap();
    let mut to_executor = liable_child(&planner_id, &root.lineage, &executor, 20, "");
    to_executor.min_retry_cost = 12;
    to_executor.write_scope = vec!["src/auth".into()];
    to_executor.host_public_key = executor_host.public_key().to_vec();
    to_executor.result_schema_json = PATCH_SCHEMA.into();
    let executor_id = broker.issue(&planner, to_executor).await;
    assert_eq!(
        broker.effective_predicate(&executor_id).await,
        format!("({SEED_001_PREDICATE}\n)")
    );
    let accepted = broker.accept(&executor, &executor_id, None).await.unwrap();
    assert_eq!(accepted.kind, pb::ReceiptKind::Accepted as i32);
    Chain {
        broker,
        orchestrator,
        planner,
        executor,
        executor_host,
        root,
        planner_id,
        executor_id,
    }
}

impl Chain {
    /// The executor's host records `observations`.
    async fn observe(
        &mut self,
        observations: Vec<pb::Observation>,
    ) -> Result<pb::Receipt, tonic::Status> {
        self.broker
            .record(&self.executor_host, &self.executor_id, observations)
            .await
    }

    /// Checks every ledger of the tree balances, then stops the broker.
    async fn stop_balanced(mut self) {
        self.broker.assert_ledgers_balance(&self.root.id).await;
        self.broker.stop().await;
    }

    /// The executor completes with seed 001's output and claim.
    async fn complete_executor(&mut self) -> Result<pb::Receipt, tonic::Status> {
        self.broker
            .complete(&self.executor, completion(&self.executor_id))
            .await
    }
}

fn completion(contract: &[u8]) -> pb::CompleteBody {
    pb::CompleteBody {
        header: None,
        contract_id: contract.to_vec(),
        output_json: r#"{"patch":"--- a/src/auth/token.rs"}"#.into(),
        report: Some(pb::TypedReport {
            status: "done".into(),
            summary: "fixed the refresh".into(),
        }),
        claim: "success".into(),
        consumed: 18,
    }
}

async fn next_receipt(
    stream: &mut tonic::Streaming<pb::WatchResponse>,
    kind: pb::ReceiptKind,
) -> pb::Receipt {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("an event in time")
            .expect("the stream stays open")
            .expect("no stream error");
        if let Some(pb::watch_response::Event::Receipt(envelope)) = event.event {
            let receipt = decode_receipt(&envelope);
            if receipt.kind == kind as i32 {
                return receipt;
            }
        }
    }
}

/// (a) The executor writes outside its scope and claims success: REJECTED
/// on `within_scope` alone, claim kept beside the verdict, 2 units back to
/// the planner; the stranded planner escalates and the orchestrator's
/// watch shows "retry not feasible".
#[tokio::test]
async fn seed_001_failure_is_rejected_on_observed_facts_and_escalation_reaches_the_orchestrator() {
    let mut c = seed_001_chain().await;
    let mut watch = c.broker.watch(&c.root.id).await;
    let observed = c
        .observe(vec![
            tool_call("edit", 6),
            mutation("src/auth/token.rs", 6),
            mutation("docs/auth.md", 6),
        ])
        .await
        .unwrap();
    assert_eq!(
        (observed.kind, observed.observations),
        (pb::ReceiptKind::Observed as i32, 3)
    );

    let receipt = c.complete_executor().await.unwrap();
    let done = receipt.completion.unwrap();
    assert_eq!(done.verdict, pb::Verdict::Rejected as i32);
    let refused: Vec<&str> = done
        .refused_criteria
        .iter()
        .map(|r| r.criterion.as_str())
        .collect();
    assert_eq!(refused, vec!["result.within_scope"]);
    assert_eq!(
        done.claim, "success",
        "the claim is stored beside the verdict"
    );
    assert!(done.has_report && done.schema_valid && !done.within_scope);
    assert_eq!(done.out_of_scope_paths, vec!["docs/auth.md".to_owned()]);
    assert_eq!(done.out_of_scope_path_count, 1);
    assert_eq!((done.consumed, done.returned, done.overspend), (18, 2, 0));

    let planner = c.broker.ledger(&c.planner_id).await;
    assert_eq!(
        (planner.reserved, planner.spent, planner.residual),
        (0, 18, 7)
    );
    assert_eq!(
        c.broker.state(&c.executor_id).await.status,
        pb::ContractStatus::Completed as i32
    );

    let escalation = c
        .broker
        .escalate(
            &c.planner,
            &c.planner_id,
            "executor out of scope; cannot retry",
        )
        .await
        .unwrap();
    let seen = next_receipt(&mut watch, pb::ReceiptKind::Escalated).await;
    assert_eq!(seen, escalation);
    let notice = seen.escalation.unwrap();
    assert!(!notice.retry_feasible, "{notice:?}");
    assert_eq!(
        notice.principal_residual, 10,
        "28 - 18 spent by the planner's subtree"
    );
    let root = c.broker.ledger(&c.root.id).await;
    assert_eq!((root.reserved, root.spent, root.residual), (0, 18, 10));
    c.stop_balanced().await;
}

/// (b) The same chain with an in-scope mutation is ACCEPTED, attributed to
/// the executor through root → planner → executor.
#[tokio::test]
async fn in_scope_work_is_accepted_and_attributed_to_the_producing_hop() {
    let mut c = seed_001_chain().await;
    c.observe(vec![mutation("src/auth/token.rs", 18)])
        .await
        .unwrap();
    let receipt = c.complete_executor().await.unwrap();
    let done = receipt.completion.unwrap();
    assert_eq!(done.verdict, pb::Verdict::Accepted as i32);
    assert!(done.refused_criteria.is_empty());
    let attribution = done.attribution.unwrap();
    assert_eq!(
        attribution.agent_public_key,
        c.executor.public_key().to_vec()
    );
    assert_eq!(attribution.depth, 2);
    assert_eq!(
        attribution.chain,
        vec![
            c.root.id.clone(),
            c.planner_id.clone(),
            c.executor_id.clone()
        ]
    );
    assert_eq!(
        done.result_digest,
        delegation_broker::crypto::sha256(completion(&c.executor_id).output_json.as_bytes())
            .to_vec()
    );
    c.broker.stop().await;
}

/// (c) Revoking the planner revokes the executor; both reservations return
/// to the root; the executor can no longer complete.
#[tokio::test]
async fn revocation_cascades_and_returns_every_reservation() {
    let mut c = seed_001_chain().await;
    // Work the executor's host metered is charged even though the executor
    // only ends through the cascade.
    c.observe(vec![tool_call("search", 5)]).await.unwrap();
    let receipt = c
        .broker
        .revoke(&c.orchestrator, &c.planner_id)
        .await
        .unwrap();
    assert_eq!(receipt.kind, pb::ReceiptKind::Revoked as i32);
    assert_eq!(
        receipt.revoked_ids,
        vec![c.planner_id.clone(), c.executor_id.clone()]
    );
    for id in [&c.planner_id, &c.executor_id] {
        assert_eq!(
            c.broker.state(id).await.status,
            pb::ContractStatus::Revoked as i32
        );
    }
    let root = c.broker.ledger(&c.root.id).await;
    assert_eq!(
        (root.reserved, root.spent, root.residual, root.open_children),
        (0, 5, 23, 0),
        "the metered 5 units stay charged"
    );
    // The executor's own subtree hears that it was revoked with its parent.
    let mut watch = c.broker.watch(&c.executor_id).await;
    let cascaded = next_receipt(&mut watch, pb::ReceiptKind::Revoked).await;
    assert_eq!(cascaded.contract_id, c.executor_id);
    drop(watch);
    let err = c.complete_executor().await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    // Only an ancestor's holder may revoke: the executor cannot revoke its parent.
    let err = c
        .broker
        .revoke(&c.executor, &c.planner_id)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    c.stop_balanced().await;
}

/// (d) With the broker's clock moved past a deadline, the sweeper expires
/// the contract, its budget is back with the parent, and a late Complete is
/// refused.
#[tokio::test]
async fn overdue_contracts_expire_and_late_completions_are_refused() {
    let mut c = seed_001_chain().await;
    let skip_ms = 2 * HOUR_MS;
    c.broker.clock.advance_ms(skip_ms);
    let mut status = 0;
    for _ in 0..200 {
        status = c.broker.state(&c.executor_id).await.status;
        if status == pb::ContractStatus::Expired as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, pb::ContractStatus::Expired as i32);
    let planner = c.broker.ledger(&c.planner_id).await;
    assert_eq!((planner.reserved, planner.open_children), (0, 0));
    let mut late = completion(&c.executor_id);
    late.header = Some(header_at(&c.executor, now_ms() + skip_ms));
    let err = c.broker.complete(&c.executor, late).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    c.stop_balanced().await;
}

/// (e) A watch dropped after three events and resumed from its cursor gets
/// exactly the events it had not seen.
#[tokio::test]
async fn a_resumed_watch_misses_nothing_and_repeats_nothing() {
    let mut c = seed_001_chain().await;
    let all = collect(&mut c.broker, &c.root.id, 0, 5).await;
    let first = collect(&mut c.broker, &c.root.id, 0, 3).await;
    assert_eq!(first, all[..3]);
    // More happens while the client is away.
    c.observe(vec![mutation("src/auth/a.rs", 1)]).await.unwrap();
    let resumed = collect(&mut c.broker, &c.root.id, first[2].0, 3).await;
    assert_eq!(resumed[..2], all[3..]);
    assert!(
        resumed[2].0 > all[4].0,
        "the new event comes after everything seen"
    );
    let cursors: Vec<u64> = first.iter().chain(&resumed).map(|e| e.0).collect();
    assert!(
        cursors.windows(2).all(|w| w[0] < w[1]),
        "no event twice, in commit order"
    );
    c.broker.stop().await;
}

async fn collect(
    broker: &mut Broker,
    id: &[u8],
    cursor: u64,
    n: usize,
) -> Vec<(u64, pb::watch_response::Event)> {
    let mut stream = broker.watch_from(id, cursor).await;
    let mut out = Vec::new();
    while out.len() < n {
        let event = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        out.push((event.cursor, event.event.unwrap()));
    }
    out
}

/// (g) Refusals that must change nothing.
#[tokio::test]
async fn bad_lifecycle_requests_are_refused_and_change_nothing() {
    let mut c = seed_001_chain().await;
    let before = c.broker.ledger(&c.planner_id).await;

    // Observations from a key that is not the contract's host (a party:
    // a stranger is told NOT_FOUND, as for an unknown contract).
    let err = c
        .broker
        .record(&c.executor, &c.executor_id, vec![mutation("src/auth/x", 1)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    assert_eq!(err.get_details_error_info().unwrap().reason, "NOT_HOST");

    // An output over the size limit.
    let mut big = completion(&c.executor_id);
    big.output_json = format!(r#"{{"patch":"{}"}}"#, "x".repeat(300 * 1024));
    let err = c.broker.complete(&c.executor, big).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field(&err), "body.output_json");

    // A JSON Schema that does not compile, at delegation.
    let mut bad_schema = child(&c.executor_id, &c.root.lineage, &Agent::generate(), 1);
    bad_schema.write_scope = vec![];
    bad_schema.result_schema_json = r#"{"type": 12}"#.into();
    let err = c
        .broker
        .delegate(&c.executor, bad_schema)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field(&err), "body.result_schema_json");

    // A delegate may not be its own host.
    let mut own_host = child(&c.executor_id, &c.root.lineage, &c.executor, 1);
    own_host.write_scope = vec![];
    own_host.host_public_key = c.executor.public_key().to_vec();
    let err = c.broker.delegate(&c.executor, own_host).await.unwrap_err();
    assert_eq!(field(&err), "body.host_public_key");

    // Metering beyond the per-contract bound.
    let huge = 10_i64.pow(15);
    let err = c
        .observe(vec![tool_call("a", huge), tool_call("b", huge)])
        .await
        .unwrap_err();
    assert_eq!(
        err.get_details_error_info().unwrap().reason,
        "METERED_LIMIT"
    );

    // Someone else completing the executor's contract.
    let err = c
        .broker
        .complete(&c.planner, completion(&c.executor_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    assert_eq!(
        c.broker.ledger(&c.planner_id).await,
        before,
        "nothing changed"
    );
    assert_eq!(
        c.broker.state(&c.executor_id).await.status,
        pb::ContractStatus::Accepted as i32
    );

    // Receipts after completion.
    c.complete_executor().await.unwrap();
    let after = c.broker.ledger(&c.planner_id).await;
    let err = c
        .observe(vec![mutation("src/auth/y", 1)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(c.broker.ledger(&c.planner_id).await, after);

    // A retried Complete replays its receipt instead of settling twice.
    let body = pb::CompleteBody {
        header: Some(c.executor.header()),
        ..completion(&c.executor_id)
    };
    let err = c.broker.complete(&c.executor, body).await.unwrap_err();
    assert_eq!(
        err.code(),
        Code::FailedPrecondition,
        "a new request on a completed contract"
    );
    c.broker.stop().await;
}

/// A retry of the same signed Complete returns the original receipt.
#[tokio::test]
async fn a_retried_completion_settles_once() {
    let mut c = seed_001_chain().await;
    let body = pb::CompleteBody {
        header: Some(c.executor.header()),
        ..completion(&c.executor_id)
    };
    let first = c.broker.complete(&c.executor, body.clone()).await.unwrap();
    let again = c.broker.complete(&c.executor, body).await.unwrap();
    assert_eq!(first, again);
    let planner = c.broker.ledger(&c.planner_id).await;
    assert_eq!((planner.spent, planner.reserved), (18, 0), "settled once");
    c.broker.stop().await;
}

/// The remaining lifecycle limits and refusal reasons, each named.
#[tokio::test]
async fn lifecycle_limits_and_reasons_are_named() {
    let mut broker = Broker::start_with(|c| c.limits.max_watch_streams = 1).await;
    let [orchestrator, delegate, host] = agents();
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;

    // A root has no principal to escalate to.
    broker.accept(&orchestrator, &root.id, None).await.unwrap();
    let err = broker
        .escalate(&orchestrator, &root.id, "stuck")
        .await
        .unwrap_err();
    assert_eq!(err.get_details_error_info().unwrap().reason, "ROOT");

    // A delegate may not name itself as host at Accept either: the same
    // rule, the same answer as at Delegate (the field is invalid).
    let id = broker.issue(&orchestrator, root.child(&delegate, 10)).await;
    let err = broker
        .accept(&delegate, &id, Some(&delegate))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let info = err.get_details_error_info().unwrap();
    assert_eq!(info.reason, "INVALID_FIELD");
    assert_eq!(info.metadata["field"], "body.host_public_key");
    assert_eq!(
        broker.state(&id).await.status,
        pb::ContractStatus::Open as i32
    );

    // Observations per request are bounded.
    broker.accept(&delegate, &id, Some(&host)).await.unwrap();
    let too_many: Vec<pb::Observation> = (0..257).map(|i| tool_call(&format!("t{i}"), 0)).collect();
    let err = broker.record(&host, &id, too_many).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field(&err), "body.observations");

    // Concurrent Watch streams are bounded (here to one).
    let first = broker.client.watch(watch_request(&root.id)).await.unwrap();
    let err = broker
        .client
        .watch(watch_request(&root.id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(
        err.get_details_error_info().unwrap().metadata["limit"],
        "limits.max_watch_streams"
    );
    drop(first);
    broker.stop().await;
}

/// A contract holds at most MAX_OBSERVATIONS_PER_CONTRACT host
/// observations: the request that would pass it is refused whole (none of
/// its observations recorded), and the limit is named.
#[tokio::test]
async fn observations_per_contract_are_bounded() {
    use delegation_broker::core::limits::{
        MAX_OBSERVATIONS_PER_CONTRACT, MAX_OBSERVATIONS_PER_REQUEST,
    };
    let mut broker = Broker::start().await;
    let [orchestrator, delegate, host] = agents();
    let (_root, id) = broker
        .root_and_accepted_child(&orchestrator, &delegate, 10, Some(&host))
        .await;
    let limit = usize::try_from(MAX_OBSERVATIONS_PER_CONTRACT).unwrap();
    let mut recorded = 0;
    while recorded < limit {
        let n = MAX_OBSERVATIONS_PER_REQUEST.min(limit - recorded);
        let batch = (0..n).map(|i| tool_call(&format!("t{i}"), 0)).collect();
        broker.record(&host, &id, batch).await.unwrap();
        recorded += n;
    }
    // Two more: one over the limit, so the whole request is refused.
    let batch = (0..2).map(|i| tool_call(&format!("over{i}"), 0)).collect();
    let err = broker.record(&host, &id, batch).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(
        err.get_details_error_info().unwrap().metadata["limit"],
        "MAX_OBSERVATIONS_PER_CONTRACT"
    );
    // Nothing of the refused request was recorded.
    let audit = audit(&mut broker, &id).await;
    assert_eq!(audit.tool_calls, u64::try_from(limit).unwrap());
    broker.stop().await;
}

/// With `require_host`, the principal names every child's host at
/// Delegate, so a delegate can never pick (and control) the runtime whose
/// observations judge it; the policy reaches the whole tree.
#[tokio::test]
async fn a_tree_requiring_hosts_refuses_a_delegation_without_one() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.require_host = true)).await;
    let [planner, host, stooge] = agents();
    assert!(
        root.contract
            .policy
            .as_ref()
            .is_some_and(|p| p.require_host)
    );

    let hostless = root.child(&planner, 10);
    let err = broker.delegate(&orchestrator, hostless).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field(&err), "body.host_public_key");
    assert_eq!(
        broker.ledger(&root.id).await.reserved,
        0,
        "nothing reserved"
    );

    let mut hosted = root.child(&planner, 10);
    hosted.host_public_key = host.public_key().to_vec();
    let (planner_id, contract) = broker
        .delegate(&orchestrator, hosted)
        .await
        .unwrap()
        .issued();
    // The tree's policy is the root's; a child carries none of its own.
    assert!(contract.policy.is_none());
    assert!(
        root.contract
            .policy
            .as_ref()
            .is_some_and(|p| p.require_host),
        "in the root"
    );
    // The delegate cannot swap in a host of its own at Accept.
    let swapped = broker
        .accept(&planner, &planner_id, Some(&stooge))
        .await
        .unwrap_err();
    assert_eq!(
        (
            swapped.code(),
            swapped.get_details_error_info().unwrap().reason.as_str()
        ),
        (Code::FailedPrecondition, "HOST_MISMATCH")
    );
    let accepted = broker.accept(&planner, &planner_id, None).await.unwrap();
    assert_eq!(accepted.kind, pb::ReceiptKind::Accepted as i32);

    // One hop further down the policy still holds.
    let grandchild = child(&planner_id, &root.lineage, &stooge, 5);
    let err = broker.delegate(&planner, grandchild).await.unwrap_err();
    assert_eq!(field(&err), "body.host_public_key");
}
