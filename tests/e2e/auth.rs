//! Signed requests: idempotent retries, nonce reuse, stale timestamps,
//! non-holders and bad signatures — and that none of them reserves budget.

use broker_client::Agent;
use delegation_broker::pb;
use tonic::Code as Status;
use tonic_types::StatusExt;

use crate::harness::*;

#[tokio::test]
async fn retries_are_idempotent_and_forgeries_reserve_nothing() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();

    // Same nonce, same body, twice: one contract, reserved once.
    let mut body = root.child(&delegate, 10);
    body.header = Some(orchestrator.header());
    let request = orchestrator.delegate(body.clone());
    let first = broker.send_delegate(request.clone()).await.unwrap();
    let again = broker.send_delegate(request).await.unwrap();
    assert!(!first.replayed && again.replayed);
    assert_eq!(first.outcome, again.outcome);
    assert_eq!(broker.ledger(&root.id).await.reserved, 10);

    // A retry re-signed with the same nonce and body is the same request.
    let resigned = broker
        .send_delegate(orchestrator.delegate(body.clone()))
        .await
        .unwrap();
    assert!(resigned.replayed);
    assert_eq!(resigned.outcome, first.outcome);

    // Same nonce, another body: refused, nothing reserved.
    let mut other = body.clone();
    other.budget = 11;
    let err = broker
        .send_delegate(orchestrator.delegate(other))
        .await
        .unwrap_err();
    assert_status(&err, Status::AlreadyExists, "NONCE_REUSED");

    // A stale timestamp.
    let mut stale = root.child(&delegate, 10);
    stale.header = Some(header_at(&orchestrator, now_ms() - 3_600_000));
    let err = broker
        .send_delegate(orchestrator.delegate(stale))
        .await
        .unwrap_err();
    assert_status(&err, Status::Unauthenticated, "STALE_TIMESTAMP");

    // Signed by a key that does not hold the parent: denied, nothing stored;
    // a stranger to the tree is told what an unknown
    // parent gets.
    let intruder = Agent::generate();
    let err = broker
        .delegate(&intruder, root.child(&delegate, 10))
        .await
        .unwrap_err();
    assert_status(&err, Status::NotFound, "NOT_FOUND");

    // A header claiming the holder's key, signed by another key.
    let mut forged = root.child(&delegate, 10);
    forged.header = Some(orchestrator.header());
    let mut request = intruder.delegate(forged);
    let err = broker.send_delegate(request.clone()).await.unwrap_err();
    assert_status(&err, Status::Unauthenticated, "BAD_SIGNATURE");

    // A flipped signature bit.
    let mut genuine = orchestrator.delegate(root.child(&delegate, 10));
    genuine.signed.as_mut().unwrap().signatures[0].sig[7] ^= 0x20;
    let err = broker.send_delegate(genuine).await.unwrap_err();
    assert_eq!(err.code(), Status::Unauthenticated);

    // A body altered after signing.
    request = orchestrator.delegate(root.child(&delegate, 10));
    let signed = request.signed.as_mut().unwrap();
    let last = signed.payload.len() - 1;
    signed.payload[last] ^= 1;
    let err = broker.send_delegate(request).await.unwrap_err();
    assert!(
        matches!(
            err.code(),
            Status::Unauthenticated | Status::InvalidArgument
        ),
        "{err:?}"
    );

    let ledger = broker.ledger(&root.id).await;
    assert_eq!(
        (ledger.reserved, ledger.open_children),
        (10, 1),
        "only the first request reserved"
    );
    assert_eq!(
        broker
            .client
            .list_children(pb::ListChildrenRequest {
                contract_id: root.id.clone(),
                page_size: 0,
                page_token: vec![]
            })
            .await
            .unwrap()
            .into_inner()
            .children
            .len(),
        1
    );
    broker.stop().await;
}

#[tokio::test]
async fn open_root_is_idempotent_too() {
    let mut broker = Broker::start().await;
    let orchestrator = Agent::generate();
    let mut body = RootSpec::default().body();
    body.header = Some(orchestrator.header());
    let request = orchestrator.open_root(body);
    let first = broker.send_open_root(request.clone()).await.unwrap();
    let again = broker.send_open_root(request).await.unwrap();
    assert!(again.replayed);
    assert_eq!(first.issued, again.issued);
    broker.stop().await;
}

/// With `[orchestrators]` configured, only listed keys open roots, each up
/// to its allowance; nothing else reaches the store.
#[tokio::test]
async fn only_listed_orchestrators_open_roots_within_their_allowance() {
    let [listed, stranger] = agents();
    let listed_key = listed.public_key();
    let mut broker = Broker::start_with(|config| {
        config
            .orchestrators
            .max_root_budget
            .insert(listed_key, 1_000);
    })
    .await;
    let at_allowance = broker
        .open_root(&listed, RootSpec::with(|s| s.budget = 1_000))
        .await;
    assert_eq!(broker.ledger(&at_allowance.id).await.budget, 1_000);

    let over = RootSpec::with(|s| s.budget = 1_001);
    let err = broker
        .send_open_root(listed.open_root(over.body()))
        .await
        .unwrap_err();
    assert_status(&err, Status::PermissionDenied, "ROOT_BUDGET_OVER_ALLOWANCE");
    assert!(
        err.message().contains("body.budget 1001"),
        "{}",
        err.message()
    );
    let info = err.get_details_error_info().expect("ErrorInfo");
    assert_eq!(
        (
            info.metadata["field"].as_str(),
            info.metadata["requested"].as_str(),
            info.metadata["allowed"].as_str()
        ),
        ("body.budget", "1001", "1000")
    );

    let err = broker
        .send_open_root(stranger.open_root(RootSpec::default().body()))
        .await
        .unwrap_err();
    assert_status(&err, Status::PermissionDenied, "NOT_AN_ORCHESTRATOR");
    // The refused roots left nothing behind: the only root is the first.
    let audits = broker
        .client
        .aggregate_audits(pb::AggregateAuditsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let runs: u64 = audits.groups.iter().map(|g| g.runs).sum();
    assert_eq!(runs, 1, "{audits:?}");
}

/// The request log keeps answers for `limits.request_log_retention_ms`: a
/// retry after the timestamp window is still answered from it, one after
/// the retention is refused as stale (the entry was pruned), and the log
/// does not grow forever.
#[tokio::test]
async fn retries_are_answered_until_the_request_log_retention_prunes_them() {
    const WINDOW_MS: i64 = 300_000;
    let mut broker = Broker::start_with(|config| {
        config.limits.timestamp_window_ms = WINDOW_MS;
        config.limits.request_log_retention_ms = 2 * WINDOW_MS + 120_000;
    })
    .await;
    let orchestrator = Agent::generate();
    let original = orchestrator.open_root(RootSpec::default().body());
    let first = broker.send_open_root(original.clone()).await.unwrap();

    // Stale, but within retention: the original answer.
    broker.clock.advance_ms(WINDOW_MS + 1_000);
    let late = broker.send_open_root(original.clone()).await.unwrap();
    assert!(late.replayed);
    assert_eq!(late.issued, first.issued);

    // Past retention: once the writer has pruned (it looks every second,
    // after a batch), the same retry is refused as stale.
    broker.clock.advance_ms(2 * WINDOW_MS + 120_000);
    let started = std::time::Instant::now();
    let refused = loop {
        let mut body = RootSpec::default().body();
        body.header = Some(header_at(
            &orchestrator,
            delegation_broker::clock::Clock::now_ms(&*broker.clock),
        ));
        broker
            .client
            .open_root(orchestrator.open_root(body))
            .await
            .expect("a fresh root, so the writer runs");
        match broker.client.open_root(original.clone()).await {
            Ok(replayed) => assert!(replayed.into_inner().replayed),
            Err(status) => break status,
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the entry was never pruned"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(refused.code(), Status::Unauthenticated, "{refused:?}");
}
