//! Malformed input is INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) naming the
//! field or the limit — never a refusal, never a crash.

use delegation_broker::client::Agent;
use delegation_broker::crypto::payload_type;
use delegation_broker::pb;
use tonic::Code;
use tonic_types::StatusExt;

use crate::harness::*;

#[track_caller]
fn assert_names(status: &tonic::Status, code: Code, key: &str, value: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    let info = status.get_details_error_info().expect("ErrorInfo attached");
    assert_eq!(info.domain, "delegation.broker.v1");
    assert_eq!(
        info.metadata.get(key).map(String::as_str),
        Some(value),
        "{status:?}"
    );
}

#[tokio::test]
async fn malformed_requests_name_the_field_and_the_server_keeps_serving() {
    let mut broker = Broker::start().await;
    let (orchestrator, delegate) = (Agent::generate(), Agent::generate());
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    let body = || child(&root.id, &root.lineage, &delegate, 10);

    // Missing envelope.
    let err = broker
        .client
        .delegate(pb::DelegateRequest { signed: None })
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "signed");

    // Missing fields.
    let mut b = body();
    b.parent_id.clear();
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.parent_id");
    let mut b = body();
    b.liability = 0;
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.liability");
    let mut r = RootSpec::default().body();
    r.policy = None;
    let err = broker
        .client
        .open_root(orchestrator.open_root(r))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.policy");

    // Budget 0 and negative.
    for budget in [0, -5] {
        let err = broker
            .client
            .delegate(orchestrator.delegate(pb::DelegateBody { budget, ..body() }))
            .await
            .unwrap_err();
        assert_names(&err, Code::InvalidArgument, "field", "body.budget");
    }

    // Attested factor NaN or 2.0.
    for factor in [f64::NAN, 2.0, 0.0, -1.0] {
        let mut b = body();
        b.delegate_attestation = Some(broker.attestor.attest(
            delegate.public_key(),
            factor,
            now_ms() + HOUR_MS,
            "x",
        ));
        let err = broker
            .client
            .delegate(orchestrator.delegate(b))
            .await
            .unwrap_err();
        assert_names(
            &err,
            Code::InvalidArgument,
            "field",
            "body.delegate_attestation.factor",
        );
    }

    // Labels outside their bounds.
    let mut r = RootSpec::default().body();
    r.labels = [("Arm".to_owned(), "flat".to_owned())].into();
    let err = broker
        .client
        .open_root(orchestrator.open_root(r))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.labels");
    let mut r = RootSpec::default().body();
    r.labels = (0..17).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    let err = broker
        .client
        .open_root(orchestrator.open_root(r))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.labels");

    // A predicate that does not parse.
    let mut b = body();
    b.predicate = "result.schema_valid && (".into();
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.predicate");

    // Garbage bytes as the signed payload, and as the attestation.
    let mut request = orchestrator.delegate(body());
    request.signed.as_mut().unwrap().payload = vec![0xff; 64];
    let err = broker.client.delegate(request).await.unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "signed.payload");
    let mut b = body();
    b.delegate_attestation = Some(pb::Envelope {
        payload_type: payload_type::ATTESTATION.into(),
        payload: vec![0xff; 64],
        signatures: vec![],
    });
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(
        &err,
        Code::InvalidArgument,
        "field",
        "body.delegate_attestation.payload",
    );

    // Wrong payload type (an OpenRoot signature replayed as a Delegate).
    let mut request = orchestrator.delegate(body());
    request.signed.as_mut().unwrap().payload_type = payload_type::OPEN_ROOT.into();
    let err = broker.client.delegate(request).await.unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "signed.payload_type");

    // Bad ids on reads.
    let err = broker
        .client
        .get_contract(pb::GetContractRequest {
            contract_id: vec![1, 2, 3],
        })
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "contract_id");
    let err = broker
        .client
        .get_contract(pb::GetContractRequest {
            contract_id: vec![0; 32],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = broker
        .client
        .delegate(orchestrator.delegate(pb::DelegateBody {
            parent_id: vec![9; 32],
            ..body()
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // A 10 MiB request.
    let mut b = body();
    b.task = "x".repeat(10 * 1024 * 1024);
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(
        &err,
        Code::ResourceExhausted,
        "limit",
        "limits.max_request_bytes",
    );

    // Oversized fields under the message limit name the field.
    let mut b = body();
    b.task = "x".repeat(20_000);
    let err = broker
        .client
        .delegate(orchestrator.delegate(b))
        .await
        .unwrap_err();
    assert_names(&err, Code::InvalidArgument, "field", "body.task");

    // Raw garbage as the whole message, through a codec that sends bytes.
    let err = raw_unary(
        &broker.addr,
        "/delegation.broker.v1.Broker/Delegate",
        vec![0xff; 32],
    )
    .await;
    assert_names(&err, Code::InvalidArgument, "field", "request");

    // Still serving, nothing reserved by any of it.
    let ledger = broker.ledger(&root.id).await;
    assert_eq!((ledger.reserved, ledger.open_children), (0, 0));
    broker
        .delegate(&orchestrator, body())
        .await
        .unwrap()
        .issued();
    broker.stop().await;
}

/// Sends `bytes` as the raw request message of `path`.
async fn raw_unary(addr: &str, path: &'static str, bytes: Vec<u8>) -> tonic::Status {
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Default, Clone)]
    struct Raw;
    impl Encoder for Raw {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            use bytes::BufMut;
            dst.put_slice(&item);
            Ok(())
        }
    }
    impl Decoder for Raw {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
            use bytes::Buf;
            let mut out = vec![0; src.remaining()];
            src.copy_to_slice(&mut out);
            Ok(Some(out))
        }
    }
    impl Codec for Raw {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = Raw;
        type Decoder = Raw;
        fn encoder(&mut self) -> Raw {
            Raw
        }
        fn decoder(&mut self) -> Raw {
            Raw
        }
    }
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(bytes),
        http::uri::PathAndQuery::from_static(path),
        Raw,
    )
    .await
    .unwrap_err()
}

/// A chain of liable hops whose forwarded predicates together outgrow the
/// effective-predicate bound is refused as malformed input naming the
/// predicate — not mistaken for a missing predicate.
#[tokio::test]
async fn an_overlong_effective_predicate_names_the_predicate() {
    let mut broker = Broker::start().await;
    let agents: Vec<Agent> = (0..20).map(|_| Agent::generate()).collect();
    let root = broker
        .open_root(
            &agents[0],
            RootSpec {
                budget: 1_000_000,
                max_depth: 30,
                ..RootSpec::default()
            },
        )
        .await;
    let predicate = format!("result.claimed != \"{}\"", "x".repeat(4_000));
    let mut parent = root.id.clone();
    for hop in 1..agents.len() {
        let body = liable_child(
            &parent,
            &root.lineage,
            &agents[hop],
            1_000_000 >> hop,
            &predicate,
        );
        match broker.delegate(&agents[hop - 1], body).await {
            Ok(outcome) => parent = outcome.issued().0,
            Err(err) => {
                assert_names(&err, Code::InvalidArgument, "field", "body.predicate");
                assert!(
                    hop > 10,
                    "refused only once the conjunction is long: hop {hop}"
                );
                assert_eq!(
                    broker.ledger(&parent).await.open_children,
                    0,
                    "nothing reserved"
                );
                broker.stop().await;
                return;
            }
        }
    }
    panic!("the conjunction never hit its bound");
}
