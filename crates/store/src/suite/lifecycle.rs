//! Lifecycle behaviours every backend must show: who may act, each
//! transition and its ledger, cascades, expiry, replays and limits.

use prost::Message;

use super::{
    accept_hosted_by, act, acted, complete_action, delegated, every_event, issued, meta,
    observation, opened, reason, receipt, refused, stored, test_child,
};
use crate::{Store, StoreError};
use broker_domain::Id;
use broker_domain::judge::Verdict;
use broker_wire::command::{Action, LifecycleCommand};
use broker_wire::pb;

/// The orchestrator of every test tree, and the host accepted children get.
const ORCHESTRATOR: u8 = 9;
const HOST: u8 = 30;

/// A root (100 units) opened by `ORCHESTRATOR` and a child of 10 for
/// `delegate`, judged by `predicate`.
async fn root_and_child<S: Store>(store: &S, delegate: u8, predicate: &str) -> (Id, Id) {
    let root = opened(store, ORCHESTRATOR, 1).await;
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
    acted(store, delegate, 3, child, accept_hosted_by(HOST)).await;
    (root, child)
}

async fn ledger<S: Store>(store: &S, id: Id) -> (broker_domain::Status, broker_domain::Ledger) {
    let c = stored(store, id).await;
    (c.status, c.ledger)
}

/// Accept, then complete: the child is charged its report and returns
/// the rest to its parent; the receipt carries the verdict and numbers.
pub async fn a_completion_settles_into_the_parent<S: Store>(store: &S) {
    let (root, child) = accepted_child(store, 8).await;
    let done = acted(store, 8, 4, child, complete_action(4)).await;
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
        assert_eq!(refused(store, agent, nonce, child, action).await, want);
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
    let escalate = Action::Escalate { reason: "x".into() };
    assert_eq!(refused(store, 8, 3, child, escalate).await, "WRONG_STATE");
    let complete = complete_action(1);
    assert_eq!(refused(store, 8, 4, child, complete).await, "WRONG_STATE");
    acted(store, 8, 5, child, Action::Accept { host: None }).await;
    let accept = Action::Accept { host: None };
    assert_eq!(refused(store, 8, 6, child, accept).await, "WRONG_STATE");
}

/// Declining returns the whole reservation to the parent.
pub async fn a_decline_returns_the_reservation<S: Store>(store: &S) {
    let (root, child) = root_and_child(store, 8, "true").await;
    let busy = Action::Decline {
        reason: "busy".into(),
    };
    let declined = acted(store, 8, 3, child, busy).await;
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
    let ambiguous = Action::Escalate {
        reason: "ambiguous".into(),
    };
    let up = acted(store, 8, 4, child, ambiguous).await;
    assert_eq!(up.kind, pb::ReceiptKind::Escalated as i32);
    let notice = up.escalation.expect("notice");
    assert_eq!(notice.principal_residual, 100);
    assert!(notice.retry_feasible);
    acted(store, ORCHESTRATOR, 5, root, Action::Accept { host: None }).await;
    let escalate = Action::Escalate { reason: "x".into() };
    assert_eq!(
        refused(store, ORCHESTRATOR, 6, root, escalate).await,
        "ROOT"
    );
}

/// Revoking a contract ends every open descendant, deepest first, with a
/// receipt each; every reservation returns up the chain.
pub async fn a_revocation_cascades_with_a_receipt_each<S: Store>(store: &S) {
    let (root, child) = root_and_child(store, 8, "true").await;
    let mut small = test_child(8, 3, child, 7, "true");
    small.ask.budget = 4;
    let grandchild = issued(store.delegate(small).await);
    let stop = Action::Revoke {
        reason: "stop".into(),
    };
    let revoked = acted(store, ORCHESTRATOR, 4, child, stop).await;
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
    let events = every_event(store, grandchild, 100).await;
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
    let record = Action::Record {
        observations: vec![
            observation(pb::ObservationKind::ToolCall, "", 3),
            observation(pb::ObservationKind::Mutation, "src/a.rs", 0),
        ],
    };
    let recorded = acted(store, HOST, 4, child, record).await;
    assert_eq!(
        (recorded.kind, recorded.observations),
        (pb::ReceiptKind::Observed as i32, 2)
    );
    assert_eq!(ledger(store, child).await.1.spent, 3);
    let done = acted(store, 8, 5, child, complete_action(9)).await;
    assert_eq!(done.completion.expect("completion").returned, 7);
    let (_, parent) = ledger(store, root).await;
    assert_eq!(parent.spent, 3);
}

/// Observations on one contract are capped.
pub async fn observations_per_contract_are_capped<S: Store>(store: &S) {
    let (_, child) = accepted_child(store, 8).await;
    let max = usize::try_from(broker_domain::limits::MAX_OBSERVATIONS_PER_CONTRACT).expect("fits");
    let calls = |n: usize| Action::Record {
        observations: (0..n)
            .map(|_| observation(pb::ObservationKind::ToolCall, "", 0))
            .collect(),
    };
    let chunk = 256;
    let mut nonce = 10u8;
    let mut sent = 0;
    while sent + chunk <= max {
        acted(store, HOST, nonce, child, calls(chunk)).await;
        sent += chunk;
        nonce = nonce.wrapping_add(1);
    }
    let rest = max - sent;
    let err = act(store, HOST, nonce, child, calls(rest + 1))
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
    acted(store, 8, 3, child, Action::Accept { host: None }).await;
    let adjudicate = |verdict| Action::Adjudicate {
        verdict,
        reason: "checked".into(),
    };
    let early = adjudicate(Verdict::Accepted);
    assert_eq!(
        refused(store, ORCHESTRATOR, 4, child, early).await,
        "NOT_PENDING"
    );
    let done = acted(store, 8, 5, child, complete_action(1)).await;
    assert_eq!(
        done.completion.expect("completion").verdict,
        Verdict::PendingPrincipal.as_i32()
    );
    let verdict = acted(store, ORCHESTRATOR, 6, child, adjudicate(Verdict::Rejected)).await;
    assert_eq!(verdict.kind, pb::ReceiptKind::Adjudicated as i32);
    let again = adjudicate(Verdict::Accepted);
    assert_eq!(
        refused(store, ORCHESTRATOR, 7, child, again).await,
        "NOT_PENDING"
    );
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
    let root = opened(store, ORCHESTRATOR, 1).await;
    let soon = |nonce: u8, delegate: u8| {
        let mut c = test_child(ORCHESTRATOR, nonce, root, delegate, "true");
        c.ask.deadline_ms = Some(broker_wire::clock::SystemClock.now_ms() + 300);
        c
    };
    use broker_wire::clock::Clock;
    let accessed = issued(store.delegate(soon(2, 8)).await);
    let swept = issued(store.delegate(soon(3, 7)).await);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let accept = Action::Accept { host: None };
    assert_eq!(refused(store, 8, 4, accessed, accept).await, "LATE");
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
    let root = opened(store, ORCHESTRATOR, 1).await;
    let mut hosted = test_child(ORCHESTRATOR, 2, root, 8, "true");
    hosted.host = Some([HOST; 32]);
    let child = issued(store.delegate(hosted).await);
    assert_eq!(
        refused(store, 8, 3, child, accept_hosted_by(31)).await,
        "HOST_MISMATCH"
    );
    let plain = delegated(store, ORCHESTRATOR, 4, root, 7).await;
    let err = act(store, 7, 5, plain, accept_hosted_by(7))
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
        page: crate::PageBounds {
            before_seq,
            limit,
            max_bytes: usize::MAX,
        },
    };
    let page = async |key: u8, role: crate::HeldRole, before_seq: i64, limit: u32| {
        let query = held(key, role, before_seq, limit);
        store.held(&query).await.expect("held")
    };
    let ids = |page: &crate::ContractsPage| page.contracts.iter().map(|c| c.id).collect::<Vec<_>>();
    use crate::HeldRole::{Delegate, Host};
    let root = opened(store, ORCHESTRATOR, 1).await;
    let a = delegated(store, ORCHESTRATOR, 2, root, 8).await;
    let b = delegated(store, ORCHESTRATOR, 3, root, 8).await;
    let c = delegated(store, ORCHESTRATOR, 4, root, 8).await;
    let other = delegated(store, ORCHESTRATOR, 5, root, 7).await;
    // The root is held by its orchestrator.
    assert_eq!(ids(&page(ORCHESTRATOR, Delegate, 0, 10).await), [root]);
    let all = page(8, Delegate, 0, 10).await;
    assert_eq!(ids(&all), [c, b, a]);
    assert_eq!(all.next_before, None);
    // Pages of two.
    let first = page(8, Delegate, 0, 2).await;
    assert_eq!(ids(&first), [c, b]);
    let cursor = first.next_before.expect("a full page with more continues");
    let second = page(8, Delegate, cursor, 2).await;
    assert_eq!((ids(&second), second.next_before), (vec![a], None));
    // An exactly full last page says there is no more.
    let exact = page(8, Delegate, 0, 3).await;
    assert_eq!((exact.contracts.len(), exact.next_before), (3, None));
    // A byte budget cuts after the first contract and continues there.
    let mut tight = held(8, Delegate, 0, 10);
    tight.page.max_bytes = 1;
    let cut = store.held(&tight).await.expect("held");
    assert_eq!(ids(&cut), [c]);
    assert_eq!(cut.next_before, Some(cut.contracts[0].seq));
    // Hosts: named at Accept; accepted contracts stay listed.
    acted(store, 8, 6, a, accept_hosted_by(HOST)).await;
    acted(store, 8, 7, b, accept_hosted_by(HOST)).await;
    let hosted = page(HOST, Host, 0, 10).await;
    assert_eq!(ids(&hosted), [b, a]);
    assert!(
        hosted
            .contracts
            .iter()
            .all(|c| c.status == broker_domain::Status::Accepted)
    );
    // A host holds nothing as delegate, a delegate hosts nothing.
    assert!(page(HOST, Delegate, 0, 10).await.contracts.is_empty());
    assert!(page(8, Host, 0, 10).await.contracts.is_empty());
    // Ending contracts takes them off both lists.
    acted(store, 8, 8, a, complete_action(1)).await;
    let revoke = Action::Revoke { reason: "x".into() };
    acted(store, ORCHESTRATOR, 9, c, revoke).await;
    assert_eq!(ids(&page(8, Delegate, 0, 10).await), [b]);
    assert_eq!(ids(&page(HOST, Host, 0, 10).await), [b]);
    assert_eq!(ids(&page(7, Delegate, 0, 10).await), [other]);
    assert!(page(5, Delegate, 0, 10).await.contracts.is_empty());
}
