//! Lifecycle behaviours every backend must show: who may act, each
//! transition and its ledger, cascades, expiry, replays and limits.

use prost::Message;

use super::{issued, meta, receipt, test_child, test_root};
use crate::{Answer, Store, StoreError};
use broker_domain::Id;
use broker_domain::judge::Verdict;
use broker_wire::command::{Action, CompleteArgs, LifecycleCommand, ObservationIn};
use broker_wire::pb;

/// The orchestrator of every test tree, and the host accepted children get.
const ORCHESTRATOR: u8 = 9;
const HOST: u8 = 30;

pub async fn act<S: Store>(
    store: &S,
    agent: u8,
    nonce: u8,
    contract_id: Id,
    action: Action,
) -> Result<Answer, StoreError> {
    store
        .transition(LifecycleCommand {
            request: Some(meta(agent, nonce)),
            contract_id,
            action,
        })
        .await
}

pub fn complete_action(reported_consumed: i64) -> Action {
    Action::Complete(Box::new(CompleteArgs {
        output_digest: broker_wire::crypto::sha256("{}".as_bytes()),
        output: serde_json::json!({}),
        has_report: true,
        claim: "done".into(),
        reported_consumed,
        received_at_ms: None,
        prejudged: None,
    }))
}

pub fn observation(kind: pb::ObservationKind, path: &str, units: i64) -> ObservationIn {
    ObservationIn {
        kind,
        path: path.into(),
        tool: "tool".into(),
        units,
        at_ms: 1,
        // Tool calls carry what a gateway says of them, so every backend
        // stores both columns.
        arguments_sha256: (kind == pb::ObservationKind::ToolCall).then_some([1; 32]),
        outcome: if kind == pb::ObservationKind::ToolCall {
            pb::ToolOutcome::Failed
        } else {
            pb::ToolOutcome::Unspecified
        },
    }
}

/// A root (100 units) opened by `ORCHESTRATOR` and a child of 10 for
/// `delegate`, judged by `predicate`.
async fn root_and_child<S: Store>(store: &S, delegate: u8, predicate: &str) -> (Id, Id) {
    let root = issued(store.open_root(test_root(meta(ORCHESTRATOR, 1))).await);
    let child = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 2, root, delegate, predicate))
            .await,
    );
    (root, child)
}

/// `root_and_child`, the child accepted with `HOST` as its host.
async fn accepted_child<S: Store>(store: &S, delegate: u8) -> (Id, Id) {
    let (root, child) = root_and_child(store, delegate, "true").await;
    receipt(
        act(
            store,
            delegate,
            3,
            child,
            Action::Accept {
                host: Some([HOST; 32]),
            },
        )
        .await,
    );
    (root, child)
}

async fn ledger<S: Store>(store: &S, id: Id) -> (broker_domain::Status, broker_domain::Ledger) {
    let c = store.contract(id).await.expect("read").expect("contract");
    (c.status, c.ledger)
}

/// The wire name of a refusal's reason.
pub fn reason(e: &StoreError) -> &'static str {
    match e {
        StoreError::PermissionDenied { reason, .. }
        | StoreError::FailedPrecondition { reason, .. }
        | StoreError::Unavailable { reason, .. } => broker_wire::names::reason_name(*reason),
        other => panic!("not a reasoned refusal: {other:?}"),
    }
}

/// Accept, then complete: the child is charged its report and returns
/// the rest to its parent; the receipt carries the verdict and numbers.
pub async fn a_completion_settles_into_the_parent<S: Store>(store: &S) {
    let (root, child) = accepted_child(store, 8).await;
    let done = receipt(act(store, 8, 4, child, complete_action(4)).await);
    assert_eq!(done.kind, pb::ReceiptKind::Completed as i32);
    let c = done.completion.expect("completion");
    assert_eq!((c.consumed, c.returned), (4, 6));
    assert_eq!(c.verdict, Verdict::Accepted.as_i32());
    let (status, l) = ledger(store, child).await;
    assert_eq!((status, l.spent), (broker_domain::Status::Completed, 4));
    let (_, parent) = ledger(store, root).await;
    assert_eq!(
        (parent.reserved, parent.spent, parent.open_children),
        (0, 4, 0)
    );
}

/// Only a contract's delegate may accept, complete, decline or escalate
/// it; only its host may record; only an ancestor's holder may revoke.
pub async fn only_the_entitled_key_may_act<S: Store>(store: &S) {
    let (_, child) = root_and_child(store, 8, "true").await;
    let cases: Vec<(u8, Action, &str)> = vec![
        (7, Action::Accept { host: None }, "NOT_DELEGATE"),
        (
            ORCHESTRATOR,
            Action::Decline { reason: "x".into() },
            "NOT_DELEGATE",
        ),
        (7, complete_action(1), "NOT_DELEGATE"),
        (8, Action::Revoke { reason: "x".into() }, "NOT_ANCESTOR"),
        (
            8,
            Action::Record {
                observations: vec![observation(pb::ObservationKind::ToolCall, "", 0)],
            },
            "NOT_HOST",
        ),
        (
            8,
            Action::Adjudicate {
                verdict: Verdict::Accepted,
                reason: String::new(),
            },
            "NOT_PRINCIPAL",
        ),
    ];
    for (nonce, (agent, action, want)) in (10u8..).zip(cases) {
        let err = act(store, agent, nonce, child, action).await.unwrap_err();
        assert_eq!(reason(&err), want);
    }
    let (status, _) = ledger(store, child).await;
    assert_eq!(
        status,
        broker_domain::Status::Open,
        "refusals change nothing"
    );
}

/// A transition the contract's status does not allow is refused with
/// WRONG_STATE and changes nothing.
pub async fn a_transition_from_the_wrong_state_is_refused<S: Store>(store: &S) {
    let (_, child) = root_and_child(store, 8, "true").await;
    // Escalate and Complete need ACCEPTED.
    let err = act(store, 8, 3, child, Action::Escalate { reason: "x".into() })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "WRONG_STATE");
    let err = act(store, 8, 4, child, complete_action(1))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "WRONG_STATE");
    receipt(act(store, 8, 5, child, Action::Accept { host: None }).await);
    let err = act(store, 8, 6, child, Action::Accept { host: None })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "WRONG_STATE");
}

/// Declining returns the whole reservation to the parent.
pub async fn a_decline_returns_the_reservation<S: Store>(store: &S) {
    let (root, child) = root_and_child(store, 8, "true").await;
    let declined = receipt(
        act(
            store,
            8,
            3,
            child,
            Action::Decline {
                reason: "busy".into(),
            },
        )
        .await,
    );
    assert_eq!(declined.kind, pb::ReceiptKind::Declined as i32);
    assert_eq!(declined.reason, "busy");
    let (_, parent) = ledger(store, root).await;
    assert_eq!(
        (parent.reserved, parent.spent, parent.residual()),
        (0, 0, 100)
    );
}

/// Escalation returns the contract to its principal with a notice saying
/// what the principal has left and whether a retry fits; a root cannot
/// escalate.
pub async fn an_escalation_tells_the_principal_what_is_left<S: Store>(store: &S) {
    let (root, child) = accepted_child(store, 8).await;
    let up = receipt(
        act(
            store,
            8,
            4,
            child,
            Action::Escalate {
                reason: "ambiguous".into(),
            },
        )
        .await,
    );
    assert_eq!(up.kind, pb::ReceiptKind::Escalated as i32);
    let notice = up.escalation.expect("notice");
    assert_eq!(notice.principal_residual, 100);
    assert!(notice.retry_feasible);
    receipt(act(store, ORCHESTRATOR, 5, root, Action::Accept { host: None }).await);
    let err = act(
        store,
        ORCHESTRATOR,
        6,
        root,
        Action::Escalate { reason: "x".into() },
    )
    .await
    .unwrap_err();
    assert_eq!(reason(&err), "ROOT");
}

/// Revoking a contract ends every open descendant, deepest first, with a
/// receipt each; every reservation returns up the chain.
pub async fn a_revocation_cascades_with_a_receipt_each<S: Store>(store: &S) {
    let (root, child) = root_and_child(store, 8, "true").await;
    let mut small = test_child(8, 3, child, 7, "true");
    small.ask.budget = 4;
    let grandchild = issued(store.delegate(small).await);
    let revoked = receipt(
        act(
            store,
            ORCHESTRATOR,
            4,
            child,
            Action::Revoke {
                reason: "stop".into(),
            },
        )
        .await,
    );
    assert_eq!(revoked.kind, pb::ReceiptKind::Revoked as i32);
    assert_eq!(
        revoked.revoked_ids,
        vec![child.to_vec(), grandchild.to_vec()]
    );
    for id in [child, grandchild] {
        assert_eq!(ledger(store, id).await.0, broker_domain::Status::Revoked);
    }
    let (_, parent) = ledger(store, root).await;
    assert_eq!((parent.reserved, parent.open_children), (0, 0));
    // The grandchild's own receipt is among its tree's events.
    let events = store
        .events(grandchild, 0, 100, usize::MAX)
        .await
        .expect("events");
    let receipts = events
        .iter()
        .filter(|e| matches!(e, crate::Event::Receipt { .. }))
        .count();
    assert_eq!(receipts, 1);
}

/// Metered units are charged when recorded; the completion charges them
/// no second time, whatever the delegate reports.
pub async fn metering_is_charged_once<S: Store>(store: &S) {
    let (root, child) = accepted_child(store, 8).await;
    let recorded = receipt(
        act(
            store,
            HOST,
            4,
            child,
            Action::Record {
                observations: vec![
                    observation(pb::ObservationKind::ToolCall, "", 3),
                    observation(pb::ObservationKind::Mutation, "src/a.rs", 0),
                ],
            },
        )
        .await,
    );
    assert_eq!(
        (recorded.kind, recorded.observations),
        (pb::ReceiptKind::Observed as i32, 2)
    );
    assert_eq!(ledger(store, child).await.1.spent, 3);
    let done = receipt(act(store, 8, 5, child, complete_action(9)).await);
    assert_eq!(done.completion.expect("completion").returned, 7);
    let (_, parent) = ledger(store, root).await;
    assert_eq!(parent.spent, 3);
}

/// Observations on one contract are capped.
pub async fn observations_per_contract_are_capped<S: Store>(store: &S) {
    let (_, child) = accepted_child(store, 8).await;
    let max = usize::try_from(broker_domain::limits::MAX_OBSERVATIONS_PER_CONTRACT).expect("fits");
    let chunk = 256;
    let mut nonce = 10u8;
    let mut sent = 0;
    while sent + chunk <= max {
        let batch = (0..chunk)
            .map(|_| observation(pb::ObservationKind::ToolCall, "", 0))
            .collect();
        receipt(
            act(
                store,
                HOST,
                nonce,
                child,
                Action::Record {
                    observations: batch,
                },
            )
            .await,
        );
        sent += chunk;
        nonce = nonce.wrapping_add(1);
    }
    let rest = max - sent;
    let batch = (0..rest + 1)
        .map(|_| observation(pb::ObservationKind::ToolCall, "", 0))
        .collect();
    let err = act(
        store,
        HOST,
        nonce,
        child,
        Action::Record {
            observations: batch,
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, StoreError::Overloaded("MAX_OBSERVATIONS_PER_CONTRACT")),
        "{err:?}"
    );
}

/// Without a predicate liability stays with the principal, who alone
/// adjudicates, once.
pub async fn only_a_pending_completion_is_adjudicated<S: Store>(store: &S) {
    let (_, child) = root_and_child(store, 8, "").await;
    receipt(act(store, 8, 3, child, Action::Accept { host: None }).await);
    let adjudicate = |verdict| Action::Adjudicate {
        verdict,
        reason: "checked".into(),
    };
    let err = act(store, ORCHESTRATOR, 4, child, adjudicate(Verdict::Accepted))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "NOT_PENDING");
    let done = receipt(act(store, 8, 5, child, complete_action(1)).await);
    assert_eq!(
        done.completion.expect("completion").verdict,
        Verdict::PendingPrincipal.as_i32()
    );
    let verdict = receipt(act(store, ORCHESTRATOR, 6, child, adjudicate(Verdict::Rejected)).await);
    assert_eq!(verdict.kind, pb::ReceiptKind::Adjudicated as i32);
    let err = act(store, ORCHESTRATOR, 7, child, adjudicate(Verdict::Accepted))
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "NOT_PENDING");
}

/// A lifecycle request sent twice is done once: the retry gets the same
/// receipt; the nonce with another body is refused.
pub async fn a_lifecycle_retry_is_replayed<S: Store>(store: &S) {
    let (root, child) = accepted_child(store, 8).await;
    let first = act(store, 8, 4, child, complete_action(2))
        .await
        .expect("first");
    let again = act(store, 8, 4, child, complete_action(2))
        .await
        .expect("again");
    assert!(!first.replayed && again.replayed);
    assert_eq!(
        format!("{:?}", first.outcome),
        format!("{:?}", again.outcome)
    );
    assert_eq!(ledger(store, root).await.1.spent, 2, "charged once");
    let other = LifecycleCommand {
        request: Some(broker_wire::command::RequestMeta {
            digest: [0xEE; 32],
            ..meta(8, 4)
        }),
        contract_id: child,
        action: complete_action(2),
    };
    assert!(matches!(
        store.transition(other).await,
        Err(StoreError::NonceReused)
    ));
}

/// An open contract past its deadline expires when anything but a
/// revocation is asked of it (LATE), and its reservation returns; the
/// sweep finds overdue contracts and expires each once.
pub async fn an_overdue_contract_expires_once<S: Store>(store: &S) {
    let root = issued(store.open_root(test_root(meta(ORCHESTRATOR, 1))).await);
    let soon = |nonce: u8, delegate: u8| {
        let mut c = test_child(ORCHESTRATOR, nonce, root, delegate, "true");
        c.ask.deadline_ms = Some(broker_wire::clock::SystemClock.now_ms() + 300);
        c
    };
    use broker_wire::clock::Clock;
    let accessed = issued(store.delegate(soon(2, 8)).await);
    let swept = issued(store.delegate(soon(3, 7)).await);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let err = act(store, 8, 4, accessed, Action::Accept { host: None })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "LATE");
    assert_eq!(
        ledger(store, accessed).await.0,
        broker_domain::Status::Expired
    );
    let now = broker_wire::clock::SystemClock.now_ms();
    let overdue = store.overdue(now, 10).await.expect("overdue");
    assert_eq!(overdue, vec![swept]);
    let expire = |id| LifecycleCommand {
        request: None,
        contract_id: id,
        action: Action::Expire,
    };
    let expired = receipt(store.transition(expire(swept)).await);
    assert_eq!(expired.kind, pb::ReceiptKind::Expired as i32);
    // A second sweep of the same contract finds it no longer due.
    let err = store.transition(expire(swept)).await.unwrap_err();
    assert_eq!(reason(&err), "WRONG_STATE");
    assert!(store.overdue(now, 10).await.expect("overdue").is_empty());
    let (_, parent) = ledger(store, root).await;
    assert_eq!((parent.reserved, parent.open_children), (0, 0));
}

/// A transition on an unknown contract is NOT_FOUND.
pub async fn an_unknown_contract_is_not_found<S: Store>(store: &S) {
    let err = act(store, 8, 1, [0x42; 32], Action::Accept { host: None })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err:?}");
    let err = store
        .delegate(test_child(ORCHESTRATOR, 2, [0x43; 32], 8, "true"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err:?}");
}

/// The host named at Accept may not be changed, and may not be the
/// delegate.
pub async fn the_host_is_fixed_and_never_the_delegate<S: Store>(store: &S) {
    let root = issued(store.open_root(test_root(meta(ORCHESTRATOR, 1))).await);
    let mut hosted = test_child(ORCHESTRATOR, 2, root, 8, "true");
    hosted.host = Some([HOST; 32]);
    let child = issued(store.delegate(hosted).await);
    let err = act(
        store,
        8,
        3,
        child,
        Action::Accept {
            host: Some([31; 32]),
        },
    )
    .await
    .unwrap_err();
    assert_eq!(reason(&err), "HOST_MISMATCH");
    let plain = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 4, root, 7, "true"))
            .await,
    );
    let err = act(
        store,
        7,
        5,
        plain,
        Action::Accept {
            host: Some([7; 32]),
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, StoreError::Invalid(e) if e.field == "body.host_public_key"),
        "{err:?}"
    );
    // A receipt decodes as what it says.
    let ok = act(store, 8, 6, child, Action::Accept { host: None })
        .await
        .expect("accepted");
    let crate::Outcome::Receipt { envelope, .. } = ok.outcome else {
        panic!("a receipt");
    };
    let r = pb::Receipt::decode(envelope.payload.as_slice()).expect("receipt");
    assert_eq!(r.requester_public_key, vec![8; 32]);
}

/// Open contracts are listed for their delegate and their host, newest
/// first and a page at a time; an ended one leaves both lists, and a key
/// never sees another's.
pub async fn held_contracts_are_the_open_ones<S: Store>(store: &S) {
    let held = |key: u8, role: crate::HeldRole, before_seq: i64, limit: u32| crate::HeldQuery {
        key: [key; 32],
        role,
        before_seq,
        limit,
        max_bytes: usize::MAX,
    };
    let ids = |page: &crate::HeldPage| page.contracts.iter().map(|c| c.id).collect::<Vec<_>>();
    use crate::HeldRole::{Delegate, Host};
    let root = issued(store.open_root(test_root(meta(ORCHESTRATOR, 1))).await);
    let a = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 2, root, 8, "true"))
            .await,
    );
    let b = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 3, root, 8, "true"))
            .await,
    );
    let c = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 4, root, 8, "true"))
            .await,
    );
    let other = issued(
        store
            .delegate(test_child(ORCHESTRATOR, 5, root, 7, "true"))
            .await,
    );
    // The root is held by its orchestrator.
    let mine = store
        .held(&held(ORCHESTRATOR, Delegate, 0, 10))
        .await
        .expect("held");
    assert_eq!(ids(&mine), [root]);
    let all = store.held(&held(8, Delegate, 0, 10)).await.expect("held");
    assert_eq!(ids(&all), [c, b, a]);
    assert_eq!(all.next_before, None);
    // Pages of two.
    let first = store.held(&held(8, Delegate, 0, 2)).await.expect("held");
    assert_eq!(ids(&first), [c, b]);
    let cursor = first.next_before.expect("a full page with more continues");
    let second = store
        .held(&held(8, Delegate, cursor, 2))
        .await
        .expect("held");
    assert_eq!((ids(&second), second.next_before), (vec![a], None));
    // An exactly full last page says there is no more.
    let exact = store.held(&held(8, Delegate, 0, 3)).await.expect("held");
    assert_eq!((exact.contracts.len(), exact.next_before), (3, None));
    // A byte budget cuts after the first contract and continues there.
    let mut tight = held(8, Delegate, 0, 10);
    tight.max_bytes = 1;
    let cut = store.held(&tight).await.expect("held");
    assert_eq!(ids(&cut), [c]);
    assert_eq!(cut.next_before, Some(cut.contracts[0].seq));
    // Hosts: named at Accept; accepted contracts stay listed.
    receipt(
        act(
            store,
            8,
            6,
            a,
            Action::Accept {
                host: Some([HOST; 32]),
            },
        )
        .await,
    );
    receipt(
        act(
            store,
            8,
            7,
            b,
            Action::Accept {
                host: Some([HOST; 32]),
            },
        )
        .await,
    );
    let hosted = store.held(&held(HOST, Host, 0, 10)).await.expect("held");
    assert_eq!(ids(&hosted), [b, a]);
    assert!(
        hosted
            .contracts
            .iter()
            .all(|c| c.status == broker_domain::Status::Accepted)
    );
    // A host holds nothing as delegate, a delegate hosts nothing.
    assert!(
        store
            .held(&held(HOST, Delegate, 0, 10))
            .await
            .expect("held")
            .contracts
            .is_empty()
    );
    assert!(
        store
            .held(&held(8, Host, 0, 10))
            .await
            .expect("held")
            .contracts
            .is_empty()
    );
    // Ending contracts takes them off both lists.
    receipt(act(store, 8, 8, a, complete_action(1)).await);
    receipt(
        act(
            store,
            ORCHESTRATOR,
            9,
            c,
            Action::Revoke { reason: "x".into() },
        )
        .await,
    );
    assert_eq!(
        ids(&store.held(&held(8, Delegate, 0, 10)).await.expect("held")),
        [b]
    );
    assert_eq!(
        ids(&store.held(&held(HOST, Host, 0, 10)).await.expect("held")),
        [b]
    );
    assert_eq!(
        ids(&store.held(&held(7, Delegate, 0, 10)).await.expect("held")),
        [other]
    );
    assert!(
        store
            .held(&held(5, Delegate, 0, 10))
            .await
            .expect("held")
            .contracts
            .is_empty()
    );
}
