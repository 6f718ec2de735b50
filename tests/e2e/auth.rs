//! Signed requests: idempotent retries, nonce reuse, stale timestamps,
//! non-holders and bad signatures — and that none of them reserves budget.

use delegation_broker::client::Agent;
use delegation_broker::pb::{self, InvariantCode as Code};
use tonic::Code as Status;
use tonic_types::StatusExt;

use crate::harness::*;

fn reason(status: &tonic::Status) -> String {
    status
        .get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

#[tokio::test]
async fn retries_are_idempotent_and_forgeries_reserve_nothing() {
    let mut broker = Broker::start().await;
    let (orchestrator, delegate) = (Agent::generate(), Agent::generate());
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;

    // Same nonce, same body, twice: one contract, reserved once.
    let mut body = child(&root.id, &root.lineage, &delegate, 10);
    body.header = Some(orchestrator.header());
    let request = orchestrator.delegate(body.clone());
    let first = broker
        .client
        .delegate(request.clone())
        .await
        .unwrap()
        .into_inner();
    let again = broker.client.delegate(request).await.unwrap().into_inner();
    assert!(!first.replayed && again.replayed);
    assert_eq!(first.outcome, again.outcome);
    assert_eq!(broker.ledger(&root.id).await.reserved, 10);

    // A retry re-signed with the same nonce and body is the same request.
    let resigned = broker
        .client
        .delegate(orchestrator.delegate(body.clone()))
        .await
        .unwrap()
        .into_inner();
    assert!(resigned.replayed);
    assert_eq!(resigned.outcome, first.outcome);

    // Same nonce, another body: refused, nothing reserved.
    let mut other = body.clone();
    other.budget = 11;
    let err = broker
        .client
        .delegate(orchestrator.delegate(other))
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), reason(&err).as_str()),
        (Status::AlreadyExists, "NONCE_REUSED")
    );

    // A stale timestamp.
    let mut stale = child(&root.id, &root.lineage, &delegate, 10);
    stale.header = Some(header_at(&orchestrator, now_ms() - 3_600_000));
    let err = broker
        .client
        .delegate(orchestrator.delegate(stale))
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), reason(&err).as_str()),
        (Status::Unauthenticated, "STALE_TIMESTAMP")
    );

    // Signed by a key that does not hold the parent: a NOT_HOLDER refusal.
    let intruder = Agent::generate();
    let (id, envelope, _) = broker
        .delegate(&intruder, child(&root.id, &root.lineage, &delegate, 10))
        .await
        .unwrap()
        .refused();
    let receipt = assert_refusal_verifies(&mut broker, &id, &envelope).await;
    assert_eq!(codes(&receipt), vec![Code::NotHolder]);

    // A header claiming the holder's key, signed by another key.
    let mut forged = child(&root.id, &root.lineage, &delegate, 10);
    forged.header = Some(orchestrator.header());
    let mut request = intruder.delegate(forged);
    let err = broker.client.delegate(request.clone()).await.unwrap_err();
    assert_eq!(
        (err.code(), reason(&err).as_str()),
        (Status::Unauthenticated, "BAD_SIGNATURE")
    );

    // A flipped signature bit.
    let mut genuine = orchestrator.delegate(child(&root.id, &root.lineage, &delegate, 10));
    genuine.signed.as_mut().unwrap().signatures[0].sig[7] ^= 0x20;
    let err = broker.client.delegate(genuine).await.unwrap_err();
    assert_eq!(err.code(), Status::Unauthenticated);

    // A body altered after signing.
    request = orchestrator.delegate(child(&root.id, &root.lineage, &delegate, 10));
    let signed = request.signed.as_mut().unwrap();
    let last = signed.payload.len() - 1;
    signed.payload[last] ^= 1;
    let err = broker.client.delegate(request).await.unwrap_err();
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
    let first = broker
        .client
        .open_root(request.clone())
        .await
        .unwrap()
        .into_inner();
    let again = broker.client.open_root(request).await.unwrap().into_inner();
    assert!(again.replayed);
    assert_eq!(first.issued, again.issued);
    broker.stop().await;
}
