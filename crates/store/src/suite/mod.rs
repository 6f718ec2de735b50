//! The store test suite: behaviour every `Store` backend must show, written
//! against the trait alone, plus request and contract builders. Each
//! backend runs all of it with one line, `store_suite!(name, open)`, where
//! `open` is an async fn returning the store and whatever keeps its data
//! alive (Quickwit's metastore suite is the model): a PostgreSQL backend
//! adds its line and inherits every test.

use prost::Message;

pub(crate) mod budgets;
pub(crate) mod drains;
pub(crate) mod judging;
pub(crate) mod lifecycle;
mod reads;

pub use drains::{a_large_revoke_does_not_stall_other_tenants, a_large_revoke_ends_in_steps};
pub use lifecycle::*;
pub use reads::*;

use super::{Answer, Event, Outcome, Store, StoreError};
use broker_domain::{Id, Liability, Policy, Predicate, Scope};
use broker_wire::command::{
    Action, CompleteArgs, LifecycleCommand, NewChild, NewRoot, ObservationIn, RequestMeta,
};
use broker_wire::pb;

/// The key every test store signs with.
pub fn test_stamper() -> std::sync::Arc<broker_wire::stamp::Stamper> {
    std::sync::Arc::new(broker_wire::stamp::Stamper::new(
        ed25519_dalek::SigningKey::from_bytes(&[1u8; 32]),
    ))
}

pub fn test_root(request: RequestMeta) -> NewRoot {
    NewRoot {
        identity: None,
        request,
        intent: "answer once".into(),
        task: String::new(),
        budget: 100,
        deadline_ms: i64::MAX / 2,
        policy: Policy {
            max_depth: 4,
            min_cumulative_trust_ppm: 0,
            max_children: 8,
            retry_headroom: true,
            require_host: false,
        },
        predicate: Predicate::default(),
        write_scope: Scope::parse(&["src".to_owned()], "scope").expect("scope"),
        labels: Default::default(),
        trace: None,
    }
}

/// Header timestamp of the test requests: far ahead, so that with the
/// test stores' timestamp window of 0 the writer's recent-request set
/// vouches for every key it has not seen — even for retries of requests
/// committed before a restart, which a real window would send the careful
/// way. That is how the tests reach the fast path's key-conflict fallback.
pub const TEST_TIMESTAMP_MS: i64 = i64::MAX / 4;

pub fn meta(agent: u8, nonce: u8) -> RequestMeta {
    RequestMeta {
        agent: [agent; 32],
        nonce: vec![nonce; 16],
        digest: [nonce; 32],
        timestamp_ms: TEST_TIMESTAMP_MS,
    }
}

/// A child of `parent` for delegate `[delegate; 32]`, asked by agent
/// `[asker; 32]`, that must keep to `src/` and is judged by `predicate`.
pub fn test_child(asker: u8, nonce: u8, parent_id: Id, delegate: u8, predicate: &str) -> NewChild {
    NewChild {
        identity: None,
        request: meta(asker, nonce),
        parent_id,
        ask: broker_domain::ChildAsk {
            requester: [asker; 32],
            intent_lineage_hash: broker_wire::crypto::sha256(b"answer once"),
            budget: 10,
            deadline_ms: None,
            liability: Liability::Principal,
            predicate: Predicate::parse(predicate, "predicate").expect("predicate"),
            escalation_channel: String::new(),
            min_retry_cost: 0,
            min_retry_latency_ms: 0,
            write_scope: Scope::parse(&["src".to_owned()], "scope").expect("scope"),
            factor_ppm: 1_000_000,
            factor_note: String::new(),
        },
        task: String::new(),
        delegate_key: [delegate; 32],
        trust: broker_wire::command::HopTrust {
            source: pb::TrustSource::StaticTable,
            attestation_digest: None,
            risk_class: String::new(),
        },
        host: None,
        result_schema_json: String::new(),
        trace: None,
    }
}

pub fn issued(answer: Result<Answer, StoreError>) -> Id {
    match answer.expect("answered").outcome {
        Outcome::Issued { id, .. } => id,
        Outcome::Receipt { envelope, .. } => panic!(
            "refused: {:?}",
            pb::Receipt::decode(envelope.payload.as_slice())
        ),
    }
}

pub fn receipt(answer: Result<Answer, StoreError>) -> pb::Receipt {
    match answer.expect("answered").outcome {
        Outcome::Receipt { envelope, .. } => {
            pb::Receipt::decode(envelope.payload.as_slice()).expect("receipt")
        }
        Outcome::Issued { .. } => panic!("a lifecycle call answers with a receipt"),
    }
}

/// A root of the test terms opened by `[agent; 32]`.
pub async fn opened<S: Store>(store: &S, agent: u8, nonce: u8) -> Id {
    issued(store.open_root(test_root(meta(agent, nonce))).await)
}

/// A child of `parent` on the test terms (judged by `true`) for
/// `[delegate; 32]`, asked by `[asker; 32]`.
pub async fn delegated<S: Store>(store: &S, asker: u8, nonce: u8, parent: Id, delegate: u8) -> Id {
    issued(
        store
            .delegate(test_child(asker, nonce, parent, delegate, "true"))
            .await,
    )
}

/// The stored contract `id`, which must exist.
pub async fn stored<S: Store>(store: &S, id: Id) -> super::ContractRecord {
    store.contract(id).await.expect("read").expect("stored")
}

/// `action` on `contract_id`, asked by `[agent; 32]`.
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

/// `act`, answered with a receipt.
pub async fn acted<S: Store>(
    store: &S,
    agent: u8,
    nonce: u8,
    contract_id: Id,
    action: Action,
) -> pb::Receipt {
    receipt(act(store, agent, nonce, contract_id, action).await)
}

/// `act`, refused: the refusal's reason.
pub async fn refused<S: Store>(
    store: &S,
    agent: u8,
    nonce: u8,
    contract_id: Id,
    action: Action,
) -> &'static str {
    reason(
        &act(store, agent, nonce, contract_id, action)
            .await
            .unwrap_err(),
    )
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

/// Accept, naming `[host; 32]` as the host.
pub fn accept_hosted_by(host: u8) -> Action {
    Action::Accept {
        host: Some([host; 32]),
    }
}

/// A completion of the empty output, claimed done, with a report of
/// `reported_consumed`.
pub fn complete_args(reported_consumed: i64) -> CompleteArgs {
    CompleteArgs {
        output_digest: broker_wire::crypto::sha256("{}".as_bytes()),
        output: serde_json::json!({}),
        has_report: true,
        claim: "done".into(),
        reported_consumed,
        received_at_ms: None,
        prejudged: None,
    }
}

pub fn complete_action(reported_consumed: i64) -> Action {
    Action::Complete(Box::new(complete_args(reported_consumed)))
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

/// An event's cursor.
pub fn cursor(e: &Event) -> i64 {
    match e {
        Event::Contract { cursor, .. } | Event::Receipt { cursor, .. } => *cursor,
    }
}

/// Every event of `id`'s tree, read `page` at a time after each page's
/// last cursor.
pub async fn every_event<S: Store>(store: &S, id: Id, page: u32) -> Vec<Event> {
    let mut all = Vec::new();
    loop {
        let after = all.last().map_or(0, cursor);
        let events = store
            .events(id, after, page, usize::MAX)
            .await
            .expect("events");
        if events.is_empty() {
            return all;
        }
        all.extend(events);
    }
}

/// Sends `child` twice: answered once, then replayed.
pub async fn delegated_twice<S: Store>(store: &S, child: &NewChild) -> (Answer, Answer) {
    let first = store.delegate(child.clone()).await.expect("first");
    let again = store.delegate(child.clone()).await.expect("again");
    assert!(!first.replayed && again.replayed);
    (first, again)
}

/// Labels from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// `opened`, with `pairs` as the root's labels.
pub async fn opened_with_labels<S: Store>(
    store: &S,
    agent: u8,
    nonce: u8,
    pairs: &[(&str, &str)],
) -> Id {
    let mut root = test_root(meta(agent, nonce));
    root.labels = labels(pairs);
    issued(store.open_root(root).await)
}

/// Runs are found by every selected label, in issuance order; children
/// (which carry their root's labels) are not runs; more matches than the
/// limit is an error rather than a silent cut.
pub async fn runs_are_selected_by_labels<S: Store>(store: &S) {
    // A value with quotes, a backslash and non-ASCII text, stored as is.
    let odd = "say \"hi\" \\ é";
    let a1 = opened_with_labels(store, 9, 1, &[("arm", "a"), ("exp", "1"), ("note", odd)]).await;
    let b1 = opened_with_labels(store, 9, 2, &[("arm", "b"), ("exp", "1")]).await;
    let a2 = opened_with_labels(store, 9, 3, &[("arm", "a"), ("exp", "2")]).await;
    delegated(store, 9, 4, a1, 8).await;
    let runs = async |opener: Option<u8>, selected: &[(&str, &str)], limit: u32| {
        let opener = opener.map(|agent| [agent; 32]);
        store.runs(opener, &labels(selected), limit).await
    };
    let found = async |opener: Option<u8>, selected: &[(&str, &str)], limit: u32| -> Vec<Id> {
        let found = runs(opener, selected, limit).await.expect("runs");
        found.into_iter().map(|(run, _)| run.root_id).collect()
    };
    let arm_a = runs(None, &[("arm", "a")], 10).await.expect("runs");
    assert_eq!(arm_a[0].0.contracts.len(), 1, "the child is in its run");
    assert_eq!(found(None, &[("arm", "a")], 10).await, [a1, a2]);
    assert_eq!(found(None, &[("arm", "a"), ("exp", "1")], 10).await, [a1]);
    assert_eq!(found(None, &[("exp", "1")], 10).await, [a1, b1]);
    assert_eq!(found(None, &[], 10).await, [a1, b1, a2]);
    assert_eq!(found(None, &[("note", odd)], 10).await, [a1]);
    assert!(found(None, &[("arm", "c")], 10).await.is_empty());
    assert!(matches!(
        runs(None, &[("arm", "a")], 1).await,
        Err(StoreError::Overloaded(_))
    ));
    // Exactly the limit.
    assert_eq!(found(None, &[("arm", "a"), ("exp", "2")], 1).await, [a2]);
    // Only the runs an orchestrator opened, when one is named.
    assert_eq!(found(Some(9), &[("arm", "a")], 10).await, [a1, a2]);
    assert!(found(Some(5), &[], 10).await.is_empty());
}

/// Roots are listed newest first, a page at a time: every root for a
/// reader (`viewer: None`), only the trees it is a party of for anyone
/// else (a stranger sees nothing), filtered by labels; a window of `scan`
/// roots bounds each call, and its page may be short yet continue.
pub async fn roots_are_paged_newest_first<S: Store>(store: &S) {
    // Opened by 9 (flat, tree, flat) and 6 (flat); 8 is a delegate in the
    // first, 30 a host in the last of 9's.
    let r1 = opened_with_labels(store, 9, 1, &[("arm", "flat")]).await;
    let r2 = opened_with_labels(store, 9, 2, &[("arm", "tree")]).await;
    let r3 = opened_with_labels(store, 6, 3, &[("arm", "flat")]).await;
    let r4 = opened_with_labels(store, 9, 4, &[("arm", "flat")]).await;
    delegated(store, 9, 5, r1, 8).await;
    let mut hosted = test_child(9, 6, r4, 7, "true");
    hosted.host = Some([30; 32]);
    issued(store.delegate(hosted).await);
    let page = |viewer: Option<u8>, arm: Option<&str>, before_seq: i64, limit: u32, scan: u32| {
        super::RootsQuery {
            viewer: viewer.map(|v| [v; 32]),
            labels: arm
                .map(|a| ("arm".to_owned(), a.to_owned()))
                .into_iter()
                .collect(),
            scan,
            page: super::PageBounds {
                before_seq,
                limit,
                max_bytes: usize::MAX,
            },
        }
    };
    let roots = async |query: &super::RootsQuery| store.roots(query).await.expect("roots");
    let ids = |page: &super::ContractsPage| page.contracts.iter().map(|r| r.id).collect::<Vec<_>>();
    // Every page `page(viewer, arm, …, scan)` leads to, walked from the
    // newest: the roots shown and how many calls it took.
    let walk = async |viewer: Option<u8>, arm: Option<&str>, scan: u32| {
        let (mut before, mut seen, mut calls) = (0, Vec::new(), 0);
        loop {
            let got = roots(&page(viewer, arm, before, 10, scan)).await;
            calls += 1;
            seen.extend(ids(&got));
            match got.next_before {
                Some(next) => before = next,
                None => return (seen, calls),
            }
            assert!(calls < 10, "the walk ends");
        }
    };
    // A reader: every root, newest first; children are not roots.
    let all = roots(&page(None, None, 0, 10, 100)).await;
    assert_eq!(ids(&all), [r4, r3, r2, r1]);
    assert_eq!(all.next_before, None);
    assert!(all.contracts.iter().all(|r| r.parent_id.is_none()));
    // Pages of two, the second from the first's cursor.
    let first = roots(&page(None, None, 0, 2, 100)).await;
    assert_eq!(ids(&first), [r4, r3]);
    let cursor = first.next_before.expect("a full page continues");
    let second = roots(&page(None, None, cursor, 2, 100)).await;
    assert_eq!(ids(&second), [r2, r1]);
    assert_eq!(second.next_before, None, "no older root remains");
    // Labels.
    let flat = roots(&page(None, Some("flat"), 0, 10, 100)).await;
    assert_eq!(ids(&flat), [r4, r3, r1]);
    let none = roots(&page(None, Some("other"), 0, 10, 100)).await;
    assert!(none.contracts.is_empty() && none.next_before.is_none());
    // Parties: the opener, a delegate, a host; a stranger sees nothing.
    for (viewer, expected) in [
        (9, vec![r4, r2, r1]),
        (6, vec![r3]),
        (8, vec![r1]),
        (30, vec![r4]),
        (7, vec![r4]),
        (5, vec![]),
    ] {
        let seen = roots(&page(Some(viewer), None, 0, 10, 100)).await;
        assert_eq!(ids(&seen), expected, "viewer {viewer}");
        assert_eq!(seen.next_before, None, "viewer {viewer}");
    }
    let flat_of_9 = roots(&page(Some(9), Some("flat"), 0, 10, 100)).await;
    assert_eq!(ids(&flat_of_9), [r4, r1]);
    // A window of two roots: 8's only tree is the oldest, so the first
    // two calls show nothing yet continue, and the walk ends on it.
    let (seen, calls) = walk(Some(8), None, 2).await;
    assert_eq!(seen, [r1]);
    assert_eq!(
        calls, 2,
        "4 roots in windows of 2, the last one knowing it is"
    );
    // A byte budget cuts a page after its first root and continues there.
    let mut tight = page(None, None, 0, 10, 100);
    tight.page.max_bytes = 1;
    let cut = roots(&tight).await;
    assert_eq!(ids(&cut), [r4]);
    let rest = roots(&page(None, None, cut.next_before.expect("cut"), 10, 100)).await;
    assert_eq!(ids(&rest), [r3, r2, r1]);
    // Two labels: every one must match, also through a window.
    let r5 = opened_with_labels(store, 9, 7, &[("arm", "flat"), ("run", "2")]).await;
    let r6 = opened_with_labels(store, 6, 8, &[("arm", "tree"), ("run", "2")]).await;
    let mut both = page(None, Some("flat"), 0, 10, 100);
    both.labels.insert("run".into(), "2".into());
    assert_eq!(ids(&roots(&both).await), [r5]);
    both.viewer = Some([6; 32]);
    assert!(roots(&both).await.contracts.is_empty());
    let mut run = page(None, None, 0, 10, 100);
    run.labels.insert("run".into(), "2".into());
    assert_eq!(ids(&roots(&run).await), [r6, r5]);
    // arm=flat in windows of one: r5, r4, r3 (opened by 6), r1; the
    // window counts roots looked at, shown or not.
    let (seen, _) = walk(Some(9), Some("flat"), 1).await;
    assert_eq!(seen, [r5, r4, r1]);
}

/// A tree's parties are the key that opened its root and every key that is
/// or was a delegate or host in it; nobody else, and no other tree's.
pub async fn parties_are_the_trees_own<S: Store>(store: &S) {
    let root = opened(store, 9, 1).await;
    let mut hosted = test_child(9, 2, root, 8, "true");
    hosted.host = Some([30; 32]);
    let child = issued(store.delegate(hosted).await);
    let grandchild = delegated(store, 8, 3, child, 7).await;
    for (agent, party) in [(9, true), (8, true), (7, true), (30, true), (5, false)] {
        for contract in [root, child, grandchild] {
            assert_eq!(
                store.is_party(contract, [agent; 32]).await.expect("read"),
                Some(party),
                "agent {agent}"
            );
        }
    }
    let other = opened(store, 6, 4).await;
    assert_eq!(
        store.is_party(other, [8; 32]).await.expect("read"),
        Some(false)
    );
    assert_eq!(
        store.is_party(other, [6; 32]).await.expect("read"),
        Some(true)
    );
    assert_eq!(store.is_party([0; 32], [9; 32]).await.expect("read"), None);
}

/// A root's children are issued with their budget reserved in the parent,
/// and listed in issuance order.
pub async fn issues_reserves_and_lists_children<S: Store>(store: &S) {
    let root = opened(store, 9, 1).await;
    let first = delegated(store, 9, 2, root, 8).await;
    let second = delegated(store, 9, 3, root, 7).await;
    let parent = stored(store, root).await;
    assert_eq!(
        (parent.ledger.reserved, parent.ledger.open_children),
        (20, 2)
    );
    let child = stored(store, first).await;
    assert_eq!((child.parent_id, child.root_id), (Some(root), root));
    let listed: Vec<Id> = store
        .children(root, 0, 10, usize::MAX)
        .await
        .expect("children")
        .iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(listed, [first, second]);
    let after_first = store
        .children(root, child.seq, 10, usize::MAX)
        .await
        .expect("next page");
    assert_eq!(
        after_first.iter().map(|c| c.id).collect::<Vec<_>>(),
        [second]
    );
    // A page ends at its byte budget, but always holds the next child.
    let small = store.children(root, 0, 10, 1).await.expect("children");
    assert_eq!(small.iter().map(|c| c.id).collect::<Vec<_>>(), [first]);
}

/// The trace context a contract was issued with is kept beside it, for
/// later calls on it to link to; untraced contracts and unknown ids have
/// none.
pub async fn the_issuing_calls_trace_is_kept<S: Store>(store: &S) {
    let traced: broker_wire::command::TraceContext = std::array::from_fn(|i| i as u8 + 1);
    let mut root = test_root(meta(9, 1));
    root.trace = Some(traced);
    let root = issued(store.open_root(root).await);
    let mut child = test_child(9, 2, root, 8, "true");
    child.trace = Some(traced.map(|b| b ^ 0xff));
    let child = issued(store.delegate(child).await);
    let plain = delegated(store, 9, 3, root, 7).await;
    assert_eq!(
        store.issuance_trace(root).await.expect("read"),
        Some(traced)
    );
    assert_eq!(
        store.issuance_trace(child).await.expect("read"),
        Some(traced.map(|b| b ^ 0xff))
    );
    assert_eq!(store.issuance_trace(plain).await.expect("read"), None);
    assert_eq!(store.issuance_trace([0x5a; 32]).await.expect("read"), None);
}

/// A binding is found until its expiry, replaced by a later one, and the
/// identity stamped into the contracts issued to the bound key.
pub async fn identity_bindings_last_until_they_expire<S: Store>(store: &S) {
    let now_ms = 1_000_000;
    let binding = |identity: &str, expires_at_ms| super::IdentityBinding {
        key: [7; 32],
        identity: identity.into(),
        issuer: "spire".into(),
        expires_at_ms,
    };
    assert_eq!(
        store.identity_of([7; 32], now_ms).await.expect("read"),
        None
    );
    store
        .bind_identity(binding("spiffe://a.test/x", now_ms + 60_000), now_ms)
        .await
        .expect("bind");
    let found = store.identity_of([7; 32], now_ms).await.expect("read");
    assert_eq!(found, Some(binding("spiffe://a.test/x", now_ms + 60_000)));
    assert_eq!(
        store.identity_of([8; 32], now_ms).await.expect("read"),
        None
    );
    assert_eq!(
        store
            .identity_of([7; 32], now_ms + 60_000)
            .await
            .expect("read"),
        None,
        "a binding ends at its token's expiry"
    );
    store
        .bind_identity(binding("spiffe://a.test/y", now_ms + 120_000), now_ms)
        .await
        .expect("bind again");
    let renewed = store
        .identity_of([7; 32], now_ms + 60_000)
        .await
        .expect("read");
    assert_eq!(
        renewed.map(|b| b.identity).as_deref(),
        Some("spiffe://a.test/y")
    );
    // One identity holds a bounded number of keys: the one that expires
    // first makes room for the next.
    let cap = crate::limits::MAX_KEYS_PER_IDENTITY;
    for n in 0..=cap {
        let binding = super::IdentityBinding {
            key: [100u8.wrapping_add(n as u8); 32],
            identity: "spiffe://a.test/many".into(),
            issuer: "spire".into(),
            expires_at_ms: now_ms + 10_000 + n as i64,
        };
        store.bind_identity(binding, now_ms).await.expect("bind");
    }
    assert_eq!(
        store.identity_of([100; 32], now_ms).await.expect("read"),
        None
    );
    let last = [100u8.wrapping_add(cap as u8); 32];
    assert!(
        store
            .identity_of(last, now_ms)
            .await
            .expect("read")
            .is_some()
    );
    assert!(
        store
            .identity_of([101; 32], now_ms)
            .await
            .expect("read")
            .is_some()
    );
    let mut root = test_root(meta(7, 1));
    root.identity = Some("spiffe://a.test/y".into());
    let root = issued(store.open_root(root).await);
    let mut child = test_child(7, 2, root, 8, "true");
    child.identity = Some("spiffe://a.test/z".into());
    let child = issued(store.delegate(child).await);
    let identity = |record: super::ContractRecord| {
        broker_wire::pb::Contract::decode(record.envelope.payload.as_slice())
            .expect("a contract")
            .delegate_identity
    };
    assert_eq!(identity(stored(store, root).await), "spiffe://a.test/y");
    assert_eq!(identity(stored(store, child).await), "spiffe://a.test/z");
}

/// The same request twice is one contract, reserved once; the same nonce
/// with another body is refused, through the write path and the read path.
pub async fn a_retry_is_replayed_and_reserves_once<S: Store>(store: &S) {
    let root = opened(store, 9, 1).await;
    let request = test_child(9, 2, root, 8, "true");
    let (first, again) = delegated_twice(store, &request).await;
    assert_eq!(issued(Ok(first)), issued(Ok(again)));
    let parent = stored(store, root).await;
    assert_eq!(parent.ledger.reserved, 10);
    let logged = store.replay(&request.request).await.expect("read");
    assert!(logged.is_some_and(|answer| answer.replayed));
    let reused = NewChild {
        request: RequestMeta {
            digest: [0xAB; 32],
            ..request.request.clone()
        },
        ..request
    };
    assert!(matches!(
        store.replay(&reused.request).await,
        Err(StoreError::NonceReused)
    ));
    assert!(matches!(
        store.delegate(reused).await,
        Err(StoreError::NonceReused)
    ));
}

/// A refused hop reserves nothing and leaves a signed receipt that can be
/// fetched again by its id.
pub async fn a_refusal_is_a_stored_receipt<S: Store>(store: &S) {
    let root = opened(store, 9, 1).await;
    let mut greedy = test_child(9, 2, root, 8, "true");
    greedy.ask.budget = 1_000;
    let answer = store.delegate(greedy).await.expect("answered");
    let Outcome::Receipt {
        receipt_id,
        envelope,
        ..
    } = answer.outcome
    else {
        panic!("a budget above the parent's is refused");
    };
    let refusal = pb::Receipt::decode(envelope.payload.as_slice()).expect("receipt");
    assert_eq!(refusal.kind, pb::ReceiptKind::Refused as i32);
    assert_eq!(
        store.receipt(receipt_id).await.expect("read"),
        Some(envelope)
    );
    let parent = stored(store, root).await;
    assert_eq!(parent.ledger.reserved, 0);
}

/// A tree's events (contracts, receipts) come in commit order, and a cursor
/// skips what was seen.
pub async fn events_come_in_commit_order_after_a_cursor<S: Store>(store: &S) {
    let root = opened(store, 9, 1).await;
    delegated(store, 9, 2, root, 8).await;
    let mut greedy = test_child(9, 3, root, 7, "true");
    greedy.ask.budget = 1_000;
    store.delegate(greedy).await.expect("refused");
    let events = store.events(root, 0, 10, usize::MAX).await.expect("events");
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| match e {
            Event::Contract { .. } => "contract",
            Event::Receipt { .. } => "receipt",
        })
        .collect();
    assert_eq!(kinds, ["contract", "contract", "receipt"]);
    let cursors: Vec<i64> = events
        .iter()
        .map(|e| match e {
            Event::Contract { cursor, .. } | Event::Receipt { cursor, .. } => *cursor,
        })
        .collect();
    assert!(cursors.windows(2).all(|w| w[0] < w[1]), "{cursors:?}");
    let rest = store
        .events(root, cursors[0], 10, usize::MAX)
        .await
        .expect("events");
    assert_eq!(rest.len(), 2);
    // A page ends at its byte budget, but always holds the next event.
    let one = store.events(root, 0, 10, 1).await.expect("events");
    assert_eq!(one.len(), 1);
    // The tree-change hint knows this tree's last event, and no other.
    let changes = store.tree_changes();
    let last = *cursors.last().expect("events");
    assert!(changes.changed_since(&root, last - 1));
    assert!(!changes.changed_since(&root, last));
    assert!(
        changes.changed_since(&[0; 32], i64::MAX),
        "unknown: changed"
    );
}

/// Concurrent siblings never overspend the parent: exactly as many as
/// its budget allows are issued, the rest refused.
pub async fn concurrent_siblings_never_overspend<S: Store + Clone>(store: &S) {
    let mut root = test_root(meta(9, 1));
    // Room for every sibling, so only the budget (100) limits them.
    root.policy.max_children = 24;
    let root = issued(store.open_root(root).await);
    let calls: Vec<_> = (0..24u8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut sibling = test_child(9, 10 + i, root, 100 + i, "true");
                sibling.ask.budget = 30;
                store.delegate(sibling).await.expect("answered")
            })
        })
        .collect();
    let mut issued_count = 0;
    for call in calls {
        if matches!(call.await.expect("call").outcome, Outcome::Issued { .. }) {
            issued_count += 1;
        }
    }
    let parent = stored(store, root).await;
    assert_eq!(issued_count, 3, "three of 30 fit in 100");
    assert_eq!(
        (parent.ledger.reserved, parent.ledger.open_children),
        (90, 3)
    );
}

/// Runs every suite test against one backend.
macro_rules! store_suite {
    ($backend:ident, $open:path) => {
        $crate::suite::store_suite!(@tests $backend, $open, [
            issues_reserves_and_lists_children,
            a_retry_is_replayed_and_reserves_once,
            a_refusal_is_a_stored_receipt,
            events_come_in_commit_order_after_a_cursor,
            runs_are_selected_by_labels,
            parties_are_the_trees_own,
            roots_are_paged_newest_first,
            held_contracts_are_the_open_ones,
            concurrent_siblings_never_overspend,
            the_issuing_calls_trace_is_kept,
            identity_bindings_last_until_they_expire,
            a_completion_settles_into_the_parent,
            only_the_entitled_key_may_act,
            a_transition_from_the_wrong_state_is_refused,
            a_decline_returns_the_reservation,
            an_escalation_tells_the_principal_what_is_left,
            a_revocation_cascades_with_a_receipt_each,
            metering_is_charged_once,
            observations_per_contract_are_capped,
            only_a_pending_completion_is_adjudicated,
            a_lifecycle_retry_is_replayed,
            an_overdue_contract_expires_once,
            an_unknown_contract_is_not_found,
            the_host_is_fixed_and_never_the_delegate,
            events_are_paged_by_count_and_bytes,
            a_subtrees_events_leave_out_its_siblings,
            commits_and_tree_changes_follow_every_write,
            audit_facts_are_the_stored_facts,
            the_issuing_parent_names_its_holder,
            a_policy_refusal_names_its_invariant,
            a_tree_requiring_hosts_refuses_a_child_without_one,
            unknown_ids_read_as_absent,
            a_refusal_is_replayed_not_redone,
            a_childs_terms_follow_its_parent,
            a_large_revoke_ends_in_steps,
            a_large_revoke_does_not_stall_other_tenants,
        ]);
    };
    // One `#[tokio::test]` per suite function, each on a fresh store.
    (@tests $backend:ident, $open:path, [$($test:ident),* $(,)?]) => {
        mod $backend {
            use crate::suite;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let (store, _keep) = $open().await;
                    suite::$test(&store).await;
                }
            )*
        }
    };
}
pub(crate) use store_suite;

/// What a test of `tuned_suite!` sets on the store it opens (the
/// backend's test defaults where `None`).
#[derive(Clone, Default)]
pub struct Tuned {
    /// Run on a judge thread before each judgment.
    pub before_judge: Option<crate::sql::BeforeJudge>,
    /// The longest a completion waits for its judgment.
    pub judgment_deadline_ms: Option<u64>,
    /// One audit read's row and byte budgets.
    pub max_audit_rows: Option<i64>,
    pub max_audit_bytes: Option<usize>,
    /// The rows a drain step ends, and whether the drainer runs.
    pub cascade_step_rows: Option<usize>,
    pub drainer: Option<bool>,
}

/// A SQL backend's options, which a `Tuned` can set.
pub trait TunedOptions {
    fn tuned(self, tuned: Tuned) -> Self;
}

/// Implements `TunedOptions` for a SQL backend's options: the backends'
/// options share these fields' names, not a type.
macro_rules! tuned_options {
    ($options:ty) => {
        impl $crate::suite::TunedOptions for $options {
            fn tuned(mut self, tuned: $crate::suite::Tuned) -> Self {
                self.before_judge = tuned.before_judge;
                if let Some(ms) = tuned.judgment_deadline_ms {
                    self.judgment_deadline_ms = ms;
                }
                self.max_audit_rows = tuned.max_audit_rows.unwrap_or(self.max_audit_rows);
                self.max_audit_bytes = tuned.max_audit_bytes.unwrap_or(self.max_audit_bytes);
                self.cascade_step_rows = tuned.cascade_step_rows.unwrap_or(self.cascade_step_rows);
                self.drainer = tuned.drainer.unwrap_or(self.drainer);
                self
            }
        }
    };
}
pub(crate) use tuned_options;

/// A store of the SQL backend under test (what `tuned_suite!` runs on).
pub trait Judged: Store + crate::sql::Backend + Clone {}
impl<S: Store + crate::sql::Backend + Clone> Judged for S {}

/// Runs the tests that open their store with tuned options (the judge
/// pool's, `judging`; audit budgets, `budgets`) against one SQL backend;
/// `$open` is an async fn taking a `Tuned`.
macro_rules! tuned_suite {
    ($backend:ident, $open:path) => {
        $crate::suite::tuned_suite!(@tests $backend, $open, [
            budgets::an_audit_read_is_bounded_by_its_row_budget,
            budgets::an_audit_read_is_bounded_by_its_byte_budget,
            judging::a_judgment_made_before_an_observation_is_made_again,
            judging::at_most_the_judgment_limit_is_judged_at_once,
            judging::the_writer_never_judges_a_completion_made_stale_by_an_observation,
            judging::a_completion_waits_for_a_judge_no_longer_than_its_deadline,
            judging::judgments_are_one_per_contract_and_few_per_signer,
            judging::a_host_recording_during_every_judgment_cannot_loop_the_judges,
        ]);
    };
    (@tests $backend:ident, $open:path, [$($module:ident::$test:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    crate::suite::$module::$test($open).await;
                }
            )*
        }
    };
}
pub(crate) use tuned_suite;
