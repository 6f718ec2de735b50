//! Malformed input is INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) naming the
//! field or the limit — never a refusal, never a crash.

use broker_client::Agent;
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

/// A change to a request and the error it must get: code, metadata key,
/// metadata value.
type Case<T> = (
    &'static str,
    Box<dyn Fn(&mut T)>,
    Code,
    &'static str,
    &'static str,
);

/// Sends each case's edit of a fresh `base()` through `send`, expecting
/// the error the case names.
async fn assert_each_refused<T, R: std::fmt::Debug>(
    cases: Vec<Case<T>>,
    base: impl Fn() -> T,
    mut send: impl AsyncFnMut(T) -> Result<R, tonic::Status>,
) {
    for (what, edit, code, key, value) in cases {
        let mut input = base();
        edit(&mut input);
        let err = send(input).await.expect_err(what);
        assert_names(&err, code, key, value);
    }
}

fn case<T>(
    what: &'static str,
    edit: impl Fn(&mut T) + 'static,
    code: Code,
    key: &'static str,
    value: &'static str,
) -> Case<T> {
    (what, Box::new(edit), code, key, value)
}

#[tokio::test]
async fn malformed_requests_name_the_field_and_the_server_keeps_serving() {
    use Code::{InvalidArgument as Invalid, ResourceExhausted as Exhausted};
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    let body = || root.child(&delegate, 10);
    let attested: Vec<pb::Envelope> = [f64::NAN, 2.0, 0.0, -1.0]
        .into_iter()
        .map(|factor| {
            broker
                .attestor
                .attest(delegate.public_key(), factor, now_ms() + HOUR_MS, "x")
        })
        .collect();
    let attestation = |i: usize| {
        let envelope = attested[i].clone();
        move |b: &mut pb::DelegateBody| b.delegate_attestation = Some(envelope.clone())
    };

    // Delegate bodies, each one field wrong.
    let delegate_cases: Vec<Case<pb::DelegateBody>> = vec![
        case(
            "no parent",
            |b: &mut pb::DelegateBody| b.parent_id.clear(),
            Invalid,
            "field",
            "body.parent_id",
        ),
        case(
            "no liability",
            |b: &mut pb::DelegateBody| b.liability = 0,
            Invalid,
            "field",
            "body.liability",
        ),
        case(
            "budget 0",
            |b: &mut pb::DelegateBody| b.budget = 0,
            Invalid,
            "field",
            "body.budget",
        ),
        case(
            "budget -5",
            |b: &mut pb::DelegateBody| b.budget = -5,
            Invalid,
            "field",
            "body.budget",
        ),
        case(
            "factor NaN",
            attestation(0),
            Invalid,
            "field",
            "body.delegate_attestation.factor",
        ),
        case(
            "factor 2",
            attestation(1),
            Invalid,
            "field",
            "body.delegate_attestation.factor",
        ),
        case(
            "factor 0",
            attestation(2),
            Invalid,
            "field",
            "body.delegate_attestation.factor",
        ),
        case(
            "factor -1",
            attestation(3),
            Invalid,
            "field",
            "body.delegate_attestation.factor",
        ),
        case(
            "predicate that does not parse",
            |b: &mut pb::DelegateBody| b.predicate = "result.schema_valid && (".into(),
            Invalid,
            "field",
            "body.predicate",
        ),
        case(
            "garbage attestation",
            |b: &mut pb::DelegateBody| {
                b.delegate_attestation = Some(pb::Envelope {
                    payload_type: payload_type::ATTESTATION.into(),
                    payload: vec![0xff; 64],
                    signatures: vec![],
                })
            },
            Invalid,
            "field",
            "body.delegate_attestation.payload",
        ),
        case(
            "the host is the delegate",
            |b: &mut pb::DelegateBody| b.host_public_key = b.delegate_public_key.clone(),
            Invalid,
            "field",
            "body.host_public_key",
        ),
        case(
            "task of 20,000 bytes",
            |b: &mut pb::DelegateBody| b.task = "x".repeat(20_000),
            Invalid,
            "field",
            "body.task",
        ),
        case(
            "a 10 MiB request",
            |b: &mut pb::DelegateBody| b.task = "x".repeat(10 * 1024 * 1024),
            Exhausted,
            "limit",
            "limits.max_request_bytes",
        ),
    ];
    let send = async |b| broker.send_delegate(orchestrator.delegate(b)).await;
    assert_each_refused(delegate_cases, body, send).await;

    // OpenRoot bodies.
    let root_cases: Vec<Case<pb::OpenRootBody>> = vec![
        case(
            "no policy",
            |r: &mut pb::OpenRootBody| r.policy = None,
            Invalid,
            "field",
            "body.policy",
        ),
        case(
            "an upper-case label key",
            |r: &mut pb::OpenRootBody| r.labels = [("Arm".to_owned(), "flat".to_owned())].into(),
            Invalid,
            "field",
            "body.labels",
        ),
        case(
            "17 labels",
            |r: &mut pb::OpenRootBody| {
                r.labels = (0..17).map(|i| (format!("k{i}"), "v".to_owned())).collect()
            },
            Invalid,
            "field",
            "body.labels",
        ),
    ];
    let send = async |r| broker.send_open_root(orchestrator.open_root(r)).await;
    assert_each_refused(root_cases, || RootSpec::default().body(), send).await;

    // Signed envelopes: missing, garbage payload, another RPC's payload type.
    let envelope_cases: Vec<Case<pb::DelegateRequest>> = vec![
        case(
            "no envelope",
            |r: &mut pb::DelegateRequest| r.signed = None,
            Invalid,
            "field",
            "signed",
        ),
        case(
            "garbage payload",
            |r: &mut pb::DelegateRequest| {
                r.signed.as_mut().expect("signed").payload = vec![0xff; 64]
            },
            Invalid,
            "field",
            "signed.payload",
        ),
        case(
            "an OpenRoot signature replayed as a Delegate",
            |r: &mut pb::DelegateRequest| {
                r.signed.as_mut().expect("signed").payload_type = payload_type::OPEN_ROOT.into()
            },
            Invalid,
            "field",
            "signed.payload_type",
        ),
    ];
    let signed = || orchestrator.delegate(body());
    let send = async |request| broker.send_delegate(request).await;
    assert_each_refused(envelope_cases, signed, send).await;

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
    assert_names(&err, Code::NotFound, "what", "contract");
    let err = broker
        .send_delegate(orchestrator.delegate(pb::DelegateBody {
            parent_id: vec![9; 32],
            ..body()
        }))
        .await
        .unwrap_err();
    assert_names(&err, Code::NotFound, "what", "parent contract");

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
    broker.issue(&orchestrator, body()).await;
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
    let channel = channel(addr).await;
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
            RootSpec::with(|s| (s.budget, s.max_depth) = (1_000_000, 30)),
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
