//! Read behaviours every backend must show: events and their cursors,
//! commit signals, audit facts, parent lookups, refusals at issuance and
//! unknown ids.

use prost::Message;

use super::{
    accept_hosted_by, acted, complete_action, cursor, delegated, delegated_twice, every_event,
    issued, meta, observation, opened, stored, test_child, test_root,
};
use crate::{Event, Outcome, Store, StoreError};
use broker_wire::command::Action;
use broker_wire::pb;

const ORCHESTRATOR: u8 = 9;

fn envelope_len(e: &Event) -> usize {
    match e {
        Event::Contract { envelope, .. } | Event::Receipt { envelope, .. } => {
            envelope.encoded_len()
        }
    }
}

/// A page of events ends at its count or its byte budget (always holding
/// one event), and paging by cursor yields every event exactly once.
pub async fn events_are_paged_by_count_and_bytes<S: Store>(store: &S) {
    let root = opened(store, ORCHESTRATOR, 1).await;
    for i in 0..5u8 {
        delegated(store, ORCHESTRATOR, 2 + i, root, 20 + i).await;
    }
    let all = store
        .events(root, 0, 100, usize::MAX)
        .await
        .expect("events");
    assert_eq!(all.len(), 6);
    let two = store.events(root, 0, 2, usize::MAX).await.expect("events");
    assert_eq!(two.len(), 2);
    let one = store.events(root, 0, 100, 1).await.expect("events");
    assert_eq!(
        one.len(),
        1,
        "a byte budget below one event still returns one"
    );
    let budget = envelope_len(&all[0]) + envelope_len(&all[1]);
    assert_eq!(
        store
            .events(root, 0, 100, budget)
            .await
            .expect("events")
            .len(),
        2
    );
    let seen: Vec<i64> = every_event(store, root, 2)
        .await
        .iter()
        .map(cursor)
        .collect();
    assert_eq!(seen, all.iter().map(cursor).collect::<Vec<_>>());
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "commit order");
}

/// A contract's events are those of its own subtree: a sibling's
/// contracts and receipts are not among them.
pub async fn a_subtrees_events_leave_out_its_siblings<S: Store>(store: &S) {
    let root = opened(store, ORCHESTRATOR, 1).await;
    let left = delegated(store, ORCHESTRATOR, 2, root, 8).await;
    let right = delegated(store, ORCHESTRATOR, 3, root, 7).await;
    delegated(store, 8, 4, left, 6).await;
    acted(store, 7, 5, right, Action::Accept { host: None }).await;
    let events = every_event(store, left, 100).await;
    assert_eq!(events.len(), 2, "left and its child only");
    assert!(events.iter().all(|e| matches!(e, Event::Contract { .. })));
    let events = every_event(store, right, 100).await;
    assert_eq!(events.len(), 2, "right and its acceptance");
}

/// Every write moves the commit signal, and names the tree it touched.
pub async fn commits_and_tree_changes_follow_every_write<S: Store>(store: &S) {
    let mut commits = store.commits();
    let changes = store.tree_changes();
    let root = opened(store, ORCHESTRATOR, 1).await;
    assert!(
        commits.has_changed().expect("open"),
        "a commit was signalled"
    );
    commits.borrow_and_update();
    let other = opened(store, ORCHESTRATOR, 2).await;
    let seen = every_event(store, other, 100).await;
    let at = cursor(seen.last().expect("the root"));
    delegated(store, ORCHESTRATOR, 3, root, 8).await;
    assert!(commits.has_changed().expect("open"));
    assert!(changes.changed_since(&root, at));
    assert!(
        !changes.changed_since(&other, at),
        "the other tree did not change"
    );
    // A lifecycle receipt changes its tree too (the writer returns the
    // trees its receipts touched).
    let child = delegated(store, ORCHESTRATOR, 4, root, 8).await;
    let seen = every_event(store, root, 100).await;
    let at = cursor(seen.last().expect("the root's events"));
    assert!(
        !changes.changed_since(&root, at),
        "nothing after the last event"
    );
    acted(store, 8, 5, child, accept_hosted_by(30)).await;
    assert!(
        changes.changed_since(&root, at),
        "an accepted contract's tree changed"
    );
}

/// The audit facts of a contract are what was stored: its completion,
/// report, verdict, claim and every host observation; the tree's
/// mutations come with them.
pub async fn audit_facts_are_the_stored_facts<S: Store>(store: &S) {
    let root = opened(store, ORCHESTRATOR, 1).await;
    let child = delegated(store, ORCHESTRATOR, 2, root, 8).await;
    acted(store, 8, 3, child, accept_hosted_by(30)).await;
    let audit_facts = async || {
        store
            .audit_facts(child)
            .await
            .expect("read")
            .expect("facts")
    };
    let (before, _) = audit_facts().await;
    assert!(!before.completed && before.has_report.is_none());
    let record = Action::Record {
        observations: vec![
            observation(pb::ObservationKind::Mutation, "src/lib.rs", 0),
            observation(pb::ObservationKind::ToolCall, "", 0),
        ],
    };
    acted(store, 30, 4, child, record).await;
    acted(store, 8, 5, child, complete_action(1)).await;
    let (facts, mutations) = audit_facts().await;
    assert_eq!((facts.id, facts.depth), (child, 1));
    assert!(facts.completed);
    assert_eq!(facts.has_report, Some(true));
    assert_eq!(facts.claim, "done");
    assert_eq!(facts.verdict, broker_domain::Verdict::Accepted.as_i32());
    assert_eq!(facts.write_scope, vec!["src".to_owned()]);
    assert_eq!(
        facts.observations,
        vec![
            (
                pb::ObservationKind::Mutation as i32,
                "src/lib.rs".to_owned()
            ),
            (pb::ObservationKind::ToolCall as i32, String::new()),
        ]
    );
    assert_eq!(mutations, vec![(child, "src/lib.rs".to_owned())]);
    assert!(store.audit_facts([0x11; 32]).await.expect("read").is_none());
}

/// The issuing parent names its holder, depth and root; unknown is None.
pub async fn the_issuing_parent_names_its_holder<S: Store>(store: &S) {
    let root = opened(store, ORCHESTRATOR, 1).await;
    let child = delegated(store, ORCHESTRATOR, 2, root, 8).await;
    let parent = store
        .issuing_parent(child)
        .await
        .expect("read")
        .expect("known");
    assert_eq!(
        (parent.delegate_key, parent.depth, parent.root_id),
        ([8; 32], 1, root)
    );
    let top = store
        .issuing_parent(root)
        .await
        .expect("read")
        .expect("known");
    assert_eq!((top.delegate_key, top.depth), ([ORCHESTRATOR; 32], 0));
    assert!(
        store
            .issuing_parent([0x22; 32])
            .await
            .expect("read")
            .is_none()
    );
}

/// A hop past the policy's fan-out is refused with that invariant's code
/// and the bound, and reserves nothing.
pub async fn a_policy_refusal_names_its_invariant<S: Store>(store: &S) {
    let mut narrow = test_root(meta(ORCHESTRATOR, 1));
    narrow.policy.max_children = 1;
    let root = issued(store.open_root(narrow).await);
    delegated(store, ORCHESTRATOR, 2, root, 8).await;
    let answer = store
        .delegate(test_child(ORCHESTRATOR, 3, root, 7, "true"))
        .await
        .expect("answered");
    let Outcome::Receipt { envelope, .. } = answer.outcome else {
        panic!("the second child is over the fan-out");
    };
    let refusal = pb::Receipt::decode(envelope.payload.as_slice()).expect("receipt");
    let violation = refusal.violations.first().expect("a violation");
    assert_eq!(violation.code, pb::InvariantCode::FanoutExceeded as i32);
    assert_eq!(
        (violation.requested.as_str(), violation.allowed.as_str()),
        ("2", "1")
    );
    let parent = stored(store, root).await;
    assert_eq!(
        (parent.ledger.reserved, parent.ledger.open_children),
        (10, 1)
    );
}

/// A tree whose policy requires hosts refuses a child without one as an
/// invalid field, storing nothing.
pub async fn a_tree_requiring_hosts_refuses_a_child_without_one<S: Store>(store: &S) {
    let mut hosted = test_root(meta(ORCHESTRATOR, 1));
    hosted.policy.require_host = true;
    let root = issued(store.open_root(hosted).await);
    let err = store
        .delegate(test_child(ORCHESTRATOR, 2, root, 8, "true"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Invalid(e) if e.field == "body.host_public_key"),
        "{err:?}"
    );
    let mut named = test_child(ORCHESTRATOR, 3, root, 8, "true");
    named.host = Some([30; 32]);
    issued(store.delegate(named).await);
    assert_eq!(
        store
            .children(root, 0, 10, usize::MAX)
            .await
            .expect("children")
            .len(),
        1
    );
}

/// Unknown ids read as absent, never as an error.
pub async fn unknown_ids_read_as_absent<S: Store>(store: &S) {
    let unknown = [0x33; 32];
    assert!(store.contract(unknown).await.expect("read").is_none());
    assert!(store.receipt(unknown).await.expect("read").is_none());
    let children = store.children(unknown, 0, 10, usize::MAX).await;
    assert!(children.expect("read").is_empty());
    let events = store.events(unknown, 0, 10, usize::MAX).await;
    assert!(events.expect("read").is_empty());
    assert!(store.replay(&meta(1, 1)).await.expect("read").is_none());
}

/// A refused request sent again is answered with the same refusal, not
/// checked again.
pub async fn a_refusal_is_replayed_not_redone<S: Store>(store: &S) {
    let root = opened(store, ORCHESTRATOR, 1).await;
    let mut greedy = test_child(ORCHESTRATOR, 2, root, 8, "true");
    greedy.ask.budget = 1_000;
    let (first, again) = delegated_twice(store, &greedy).await;
    let (Outcome::Receipt { receipt_id: a, .. }, Outcome::Receipt { receipt_id: b, .. }) =
        (&first.outcome, &again.outcome)
    else {
        panic!("both refused");
    };
    assert_eq!(a, b);
    let events = every_event(store, root, 100).await;
    assert_eq!(events.len(), 2, "the root and one refusal");
}

/// A child's stored terms follow its parent: one level deeper, the
/// parent's deadline unless it asked for an earlier one, its parent's id
/// as `parent_id`.
pub async fn a_childs_terms_follow_its_parent<S: Store>(store: &S) {
    let mut root = test_root(meta(ORCHESTRATOR, 1));
    root.deadline_ms = i64::MAX / 8;
    let root = issued(store.open_root(root).await);
    let mut sooner = test_child(ORCHESTRATOR, 2, root, 8, "true");
    sooner.ask.deadline_ms = Some(i64::MAX / 16);
    let child = issued(store.delegate(sooner).await);
    let grandchild = delegated(store, 8, 3, child, 7).await;
    let record = stored(store, grandchild).await;
    let contract = pb::Contract::decode(record.envelope.payload.as_slice()).expect("contract");
    assert_eq!(contract.depth, 2);
    assert_eq!(
        contract.deadline_ms,
        i64::MAX / 16,
        "inherited from its parent"
    );
    assert_eq!(contract.parent_id, child.to_vec());
    assert_eq!((record.parent_id, record.root_id), (Some(child), root));
}
