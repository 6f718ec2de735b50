//! Request decoding, authentication and conversion, as the service runs
//! them on every signed request: `auth::authenticate::<T>` (envelope
//! checks, protobuf decoding of the body, key, nonce, DSSE signature,
//! freshness) and then the body's converter (`new_root`, `new_child` and
//! the effective-predicate check, the lifecycle converters), with every
//! error mapped to the gRPC status a client would get.
//!
//! Three ways in: arbitrary bytes as an `Envelope` (signatures will not
//! verify, but nothing may panic on the way to saying so); arbitrary bytes
//! as the payload of each body kind, signed by a fixed agent key so the
//! decoding and conversion run; and structured bodies whose fields are
//! drawn from broker-shaped values (valid keys, attestations signed by a
//! trusted attestor, CEL, schemas, paths), signed the same way.
//!
//! Asserts: nothing panics or overflows the stack the broker gives the
//! work; a correctly signed body with a header and a 16..=64-byte nonce
//! authenticates, as the same body, the same signer and digest, `fresh`
//! exactly within the window; a flipped signature bit is UNAUTHENTICATED
//! and another body kind's payload type is INVALID_ARGUMENT; every error
//! names a field under `signed` or `body` with a bounded reason and maps to
//! a bounded status message; converted values are within their documented
//! bounds (a child's requester is the signer, its factor is 0 unless an
//! attestation by a trusted attestor or the static table vouches, its
//! schema compiles).

use std::sync::OnceLock;

use crate::{
    DEEP_STACK_BYTES, WORKER_STACK_BYTES, cel, json, note, on_stack, path, paths, schema, word,
};
use arbitrary::{Arbitrary, Unstructured};
use delegation_broker::command::Action;
use delegation_broker::config::{Limits, TrustConfig};
use delegation_broker::core::error::MAX_ERROR_REASON_BYTES;
use delegation_broker::core::judge;
use delegation_broker::core::limits::{
    MAX_BUDGET_UNITS, MAX_HORIZON_MS, MAX_NONCE_BYTES, MIN_NONCE_BYTES, PPM_ONE,
};
use delegation_broker::core::{InputError, Liability, Predicate};
use delegation_broker::crypto::{self, payload_type};
use delegation_broker::pb;
use delegation_broker::service::auth::{Authenticated, SignedBody, authenticate};
use delegation_broker::service::convert::{self, VerifiedAttestations};
use delegation_broker::service::error::{MAX_STATUS_MESSAGE_BYTES, ServiceError};
use ed25519_dalek::SigningKey;
use prost::Message;

/// The broker's clock during the run.
const NOW_MS: i64 = 1_800_000_000_000;
const WINDOW_MS: i64 = 300_000;

pub struct Keys {
    agent: SigningKey,
    attestor: SigningKey,
    stranger: SigningKey,
    /// Delegate and host keys the structured bodies pick from.
    others: Vec<[u8; 32]>,
    trust: TrustConfig,
    verified: VerifiedAttestations,
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let key = |b: u8| SigningKey::from_bytes(&[b; 32]);
        let others: Vec<[u8; 32]> = (3..6).map(|b| key(b).verifying_key().to_bytes()).collect();
        let mut trust = TrustConfig {
            attestors: vec![key(2).verifying_key()],
            ..TrustConfig::default()
        };
        trust.static_factors_ppm.insert(others[1], 600_000);
        Keys {
            agent: key(1),
            attestor: key(2),
            stranger: key(9),
            others,
            trust,
            verified: VerifiedAttestations::default(),
        }
    })
}

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    OpenRoot,
    Delegate,
    Accept,
    Decline,
    Complete,
    Adjudicate,
    Escalate,
    Revoke,
    Record,
    OpenSession,
}

const KINDS: [Kind; 10] = [
    Kind::OpenRoot,
    Kind::Delegate,
    Kind::Accept,
    Kind::Decline,
    Kind::Complete,
    Kind::Adjudicate,
    Kind::Escalate,
    Kind::Revoke,
    Kind::Record,
    Kind::OpenSession,
];

#[derive(Debug)]
pub enum Input {
    /// Bytes as a whole envelope, authenticated as every body kind.
    Envelope(Vec<u8>),
    /// Bytes as the signed payload of one body kind; with `patch`, a
    /// header field naming the agent key (and, for odd values, a nonce) is
    /// appended, which protobuf merges into the header the bytes carry.
    Payload(Kind, u8, Vec<u8>),
    /// A body built from broker-shaped values, encoded.
    Body(Kind, Vec<u8>),
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let mode = u.int_in_range(0..=7)?;
        let kind = *u.choose(&KINDS)?;
        Ok(match mode {
            0 => Input::Envelope(u.arbitrary()?),
            1 | 2 => Input::Payload(kind, u.arbitrary()?, u.arbitrary()?),
            _ => Input::Body(kind, body(u, kind)?),
        })
    }
}

/// One input (the fuzz target's entry).
pub fn fuzz(input: Input) {
    on_stack(WORKER_STACK_BYTES, move || run(input));
}

fn run(input: Input) {
    match input {
        Input::Envelope(bytes) => {
            let Ok(envelope) = pb::Envelope::decode(bytes.as_slice()) else {
                return;
            };
            for kind in KINDS {
                // Nobody holds the agent key but us: nothing authenticates.
                if let Err(e) = authenticate_as(kind, &envelope) {
                    checked_error(e);
                } else {
                    panic!("an unsigned envelope authenticated as {kind:?}");
                }
            }
        }
        Input::Payload(kind, patch, mut payload) => {
            if patch != 0 {
                let header = pb::RequestHeader {
                    agent_public_key: keys().agent.verifying_key().to_bytes().to_vec(),
                    timestamp_ms: 0,
                    nonce: if patch % 2 == 1 {
                        vec![1; MIN_NONCE_BYTES]
                    } else {
                        Vec::new()
                    },
                };
                // Field 1, length-delimited: the header.
                payload.push(0x0a);
                header
                    .encode_length_delimited(&mut payload)
                    .expect("a Vec grows");
            }
            signed(kind, payload)
        }
        Input::Body(kind, payload) => signed(kind, payload),
    }
}

/// Signs `payload` as `kind` with the agent key, authenticates it,
/// converts it.
fn signed(kind: Kind, payload: Vec<u8>) {
    let k = keys();
    let envelope = crypto::sign_envelope(&k.agent, type_of(kind), payload.clone());
    match kind {
        Kind::OpenRoot => flow::<pb::OpenRootBody>(kind, &envelope, |a| {
            let root = convert::new_root(a.body, a.request, NOW_MS, &Limits::default())?;
            assert_eq!(root.request.agent, k.agent.verifying_key().to_bytes());
            assert!((1..=MAX_BUDGET_UNITS).contains(&root.budget));
            assert!(root.deadline_ms > NOW_MS && root.deadline_ms <= NOW_MS + MAX_HORIZON_MS);
            assert!(!root.task.trim().is_empty());
            Ok(())
        }),
        Kind::Delegate => flow::<pb::DelegateBody>(kind, &envelope, |a| {
            let attestation = a.body.delegate_attestation.clone();
            // As the service runs it: on a conversion thread.
            on_stack(DEEP_STACK_BYTES, || delegate(a, attestation))
        }),
        Kind::Accept => lifecycle(kind, &envelope, convert::lifecycle::accept),
        Kind::Decline => lifecycle(kind, &envelope, convert::lifecycle::decline),
        Kind::Complete => lifecycle(kind, &envelope, convert::lifecycle::complete),
        Kind::Adjudicate => lifecycle(kind, &envelope, convert::lifecycle::adjudicate),
        Kind::Escalate => lifecycle(kind, &envelope, convert::lifecycle::escalate),
        Kind::Revoke => lifecycle(kind, &envelope, convert::lifecycle::revoke),
        Kind::Record => lifecycle(kind, &envelope, convert::lifecycle::record),
        Kind::OpenSession => flow::<pb::OpenSessionBody>(kind, &envelope, |_| Ok(())),
    }
}

fn delegate(
    a: Authenticated<pb::DelegateBody>,
    attestation: Option<pb::Envelope>,
) -> Result<(), InputError> {
    let k = keys();
    let signer = a.agent;
    let child = convert::new_child(a.body, a.request, NOW_MS, &k.trust, &k.verified)?;
    let ask = &child.ask;
    assert_eq!(ask.requester, signer);
    assert!((1..=MAX_BUDGET_UNITS).contains(&ask.budget));
    assert!(
        ask.deadline_ms
            .is_none_or(|d| d > 0 && d <= NOW_MS + MAX_HORIZON_MS)
    );
    assert!((0..=MAX_BUDGET_UNITS).contains(&ask.min_retry_cost));
    assert!((0..=MAX_HORIZON_MS).contains(&ask.min_retry_latency_ms));
    assert!(ask.factor_ppm <= PPM_ONE);
    assert_ne!(child.host, Some(child.delegate_key));
    match (&attestation, child.trust.source) {
        (_, pb::TrustSource::None) => assert_eq!(ask.factor_ppm, 0),
        (None, pb::TrustSource::StaticTable) => {
            assert_eq!(
                Some(&ask.factor_ppm),
                k.trust.static_factors_ppm.get(&child.delegate_key)
            );
        }
        (Some(envelope), pb::TrustSource::Attestation) => {
            assert!(ask.factor_ppm > 0);
            let statement = pb::Attestation::decode(envelope.payload.as_slice()).unwrap();
            assert_eq!(statement.agent_public_key, child.delegate_key);
            assert!(statement.expires_at_ms > NOW_MS && statement.not_before_ms <= NOW_MS);
            assert!(
                k.trust.attestors.iter().any(|key| {
                    crypto::verify_envelope(envelope, payload_type::ATTESTATION, key).is_ok()
                }),
                "trusted an attestation no attestor signed"
            );
            assert_eq!(
                child.trust.attestation_digest,
                Some(crypto::sha256(&envelope.payload))
            );
        }
        (a, source) => panic!("trust source {source:?} with attestation {a:?}"),
    }
    if !child.result_schema_json.is_empty() {
        let value = serde_json::from_str(&child.result_schema_json).expect("kept schema is JSON");
        judge::compile_schema(&value, "again").expect("kept schema compiles");
    }
    // The effective predicate, as the service composes it before queueing.
    let inherited = match ask.liability {
        Liability::Delegate => Predicate::parse("result.schema_valid && result.within_scope", "p")
            .expect("fixed predicate parses"),
        Liability::Principal => Predicate::default(),
    };
    let effective = Predicate::check_effective(&inherited, &ask.predicate, "body.predicate")?;
    assert!(effective.as_str().starts_with(inherited.as_str()));
    Ok(())
}

/// A lifecycle body's converter: the contract it names and its action.
type Converter<T> = fn(T) -> Result<([u8; 32], Action), InputError>;

fn lifecycle<T: SignedBody + Clone + PartialEq>(
    kind: Kind,
    envelope: &pb::Envelope,
    convert: Converter<T>,
) {
    flow::<T>(kind, envelope, |a| {
        let (id, action) = convert(a.body)?;
        assert_eq!(id.len(), 32);
        match action {
            Action::Complete(args) => {
                judge::check_output(&args.output, "again").expect("converted output in bounds");
            }
            Action::Record { observations } => {
                assert!((1..=256).contains(&observations.len()));
            }
            _ => {}
        }
        Ok(())
    })
}

/// Authenticates `envelope` as `T`, checks what authentication promises,
/// tries the tampered variants, then runs `convert` on the result.
fn flow<T: SignedBody + Clone + PartialEq>(
    kind: Kind,
    envelope: &pb::Envelope,
    convert: impl FnOnce(Authenticated<T>) -> Result<(), InputError>,
) {
    let k = keys();
    let decoded = T::decode(envelope.payload.as_slice()).ok();
    let nonce_ok =
        |h: &pb::RequestHeader| (MIN_NONCE_BYTES..=MAX_NONCE_BYTES).contains(&h.nonce.len());
    let agent = k.agent.verifying_key().to_bytes();
    let expected_ok = decoded
        .as_ref()
        .and_then(|b| b.header().cloned())
        .is_some_and(|h| h.agent_public_key == agent && nonce_ok(&h));
    let result = authenticate::<T>(Some(envelope), NOW_MS, WINDOW_MS);
    // Another kind's payload type is refused before anything is decoded.
    let other = if matches!(kind, Kind::Accept) {
        Kind::Revoke
    } else {
        Kind::Accept
    };
    match authenticate_as(other, envelope) {
        Err(ServiceError::Invalid(e)) => assert_eq!(e.field, "signed.payload_type"),
        other => panic!(
            "a {kind:?} payload as another kind: {:?}",
            other.map(|_| ())
        ),
    }
    let a = match result {
        Err(e) => {
            assert!(!expected_ok, "{kind:?} signed correctly, refused: {e:?}");
            checked_error(e);
            return;
        }
        Ok(a) => a,
    };
    assert!(expected_ok, "{kind:?} authenticated without a valid header");
    let body = decoded.expect("decoded above");
    let header = body.header().expect("checked above");
    assert!(a.body == body, "authentication changed the body");
    assert_eq!(a.agent, agent);
    assert_eq!(a.request.agent, agent);
    assert_eq!(a.request.nonce, header.nonce);
    assert_eq!(a.request.timestamp_ms, header.timestamp_ms);
    assert_eq!(
        a.request.digest,
        crypto::sha256(&crypto::pae(&envelope.payload_type, &envelope.payload))
    );
    let skew = (i128::from(NOW_MS) - i128::from(header.timestamp_ms)).abs();
    assert_eq!(a.fresh, skew <= i128::from(WINDOW_MS));

    // One flipped bit of the signature, or a stranger's signature: refused.
    let mut tampered = envelope.clone();
    tampered.signatures[0].sig[7] ^= 0x20;
    match authenticate::<T>(Some(&tampered), NOW_MS, WINDOW_MS) {
        Err(ServiceError::Unauthenticated { reason, .. }) => {
            assert_eq!(reason, pb::ErrorReason::BadSignature)
        }
        other => panic!("a tampered signature: {:?}", other.map(|_| ())),
    }
    let forged = crypto::sign_envelope(&k.stranger, T::PAYLOAD_TYPE, envelope.payload.clone());
    assert!(authenticate::<T>(Some(&forged), NOW_MS, WINDOW_MS).is_err());

    note(kind_name(kind));
    match convert(a) {
        Ok(()) => note(converted_name(kind)),
        Err(e) => {
            note(e.field);
            checked_error(ServiceError::Invalid(e));
        }
    }
}

fn authenticate_as(kind: Kind, envelope: &pb::Envelope) -> Result<(), ServiceError> {
    let e = Some(envelope);
    match kind {
        Kind::OpenRoot => authenticate::<pb::OpenRootBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Delegate => authenticate::<pb::DelegateBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Accept => authenticate::<pb::AcceptBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Decline => authenticate::<pb::DeclineBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Complete => authenticate::<pb::CompleteBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Adjudicate => authenticate::<pb::AdjudicateBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Escalate => authenticate::<pb::EscalateBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Revoke => authenticate::<pb::RevokeBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::Record => authenticate::<pb::RecordReceiptsBody>(e, NOW_MS, WINDOW_MS).map(drop),
        Kind::OpenSession => authenticate::<pb::OpenSessionBody>(e, NOW_MS, WINDOW_MS).map(drop),
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::OpenRoot => "authenticated OpenRoot",
        Kind::Delegate => "authenticated Delegate",
        Kind::Accept => "authenticated Accept",
        Kind::Decline => "authenticated Decline",
        Kind::Complete => "authenticated Complete",
        Kind::Adjudicate => "authenticated Adjudicate",
        Kind::Escalate => "authenticated Escalate",
        Kind::Revoke => "authenticated Revoke",
        Kind::Record => "authenticated RecordReceipts",
        Kind::OpenSession => "authenticated OpenSession",
    }
}

fn converted_name(kind: Kind) -> &'static str {
    match kind {
        Kind::OpenRoot => "converted OpenRoot",
        Kind::Delegate => "converted Delegate",
        Kind::Complete => "converted Complete",
        Kind::Record => "converted RecordReceipts",
        _ => "converted (other)",
    }
}

fn type_of(kind: Kind) -> &'static str {
    match kind {
        Kind::OpenRoot => payload_type::OPEN_ROOT,
        Kind::Delegate => payload_type::DELEGATE,
        Kind::Accept => payload_type::ACCEPT,
        Kind::Decline => payload_type::DECLINE,
        Kind::Complete => payload_type::COMPLETE,
        Kind::Adjudicate => payload_type::ADJUDICATE,
        Kind::Escalate => payload_type::ESCALATE,
        Kind::Revoke => payload_type::REVOKE,
        Kind::Record => payload_type::RECORD_RECEIPTS,
        Kind::OpenSession => payload_type::OPEN_SESSION,
    }
}

/// An error names its field with a bounded reason, and its status message
/// is bounded.
fn checked_error(e: ServiceError) {
    if let ServiceError::Invalid(input) = &e {
        assert!(
            input.field.starts_with("body") || input.field.starts_with("signed"),
            "{input:?}"
        );
        assert!(
            input.reason.len() <= MAX_ERROR_REASON_BYTES + 64,
            "{input:?}"
        );
    }
    let status = tonic::Status::from(e);
    assert!(
        status.message().len() <= MAX_STATUS_MESSAGE_BYTES + 64,
        "{}",
        status.message().len()
    );
}

// --- structured bodies ----------------------------------------------------

fn body(u: &mut Unstructured<'_>, kind: Kind) -> arbitrary::Result<Vec<u8>> {
    let header = Some(header(u)?);
    let id = |u: &mut Unstructured<'_>| -> arbitrary::Result<Vec<u8>> {
        Ok(if u.ratio(1, 8)? {
            u.arbitrary()?
        } else {
            vec![0xab; 32]
        })
    };
    let reason = |u: &mut Unstructured<'_>| -> arbitrary::Result<String> {
        Ok(if u.ratio(1, 16)? {
            "r".repeat(1_025)
        } else {
            u.arbitrary()?
        })
    };
    // A body of a contract and a reason alone.
    macro_rules! reasoned {
        ($body:ident) => {
            pb::$body {
                header,
                contract_id: id(u)?,
                reason: reason(u)?,
            }
            .encode_to_vec()
        };
    }
    Ok(match kind {
        Kind::OpenRoot => pb::OpenRootBody {
            header,
            intent: text(u)?,
            task: text(u)?,
            budget: int(u, MAX_BUDGET_UNITS)?,
            deadline_ms: NOW_MS.saturating_add(int(u, MAX_HORIZON_MS)?),
            policy: Some(pb::Policy {
                max_depth: u.int_in_range(0..=70)?,
                min_cumulative_trust_ppm: u.int_in_range(0..=1_000_001)?,
                max_children: u.int_in_range(0..=1_030)?,
                disable_retry_headroom: u.arbitrary()?,
                require_host: u.arbitrary()?,
            })
            .filter(|_| !u.ratio(1, 16).unwrap_or(false)),
            predicate: cel(u)?,
            write_scope: paths(u, 3)?,
            labels: (0..u.int_in_range(0..=3)?)
                .map(|_| Ok((word(u, &["arm", "run", "A", "a b", ""])?, text(u)?)))
                .collect::<arbitrary::Result<_>>()?,
        }
        .encode_to_vec(),
        Kind::Delegate => pb::DelegateBody {
            header,
            parent_id: id(u)?,
            intent_lineage_hash: id(u)?,
            task: text(u)?,
            delegate_public_key: agent_key(u)?,
            budget: int(u, MAX_BUDGET_UNITS)?,
            deadline_ms: if u.arbitrary()? {
                0
            } else {
                NOW_MS.saturating_add(int(u, MAX_HORIZON_MS)?)
            },
            liability: u.int_in_range(0..=3)?,
            predicate: cel(u)?,
            escalation_channel: word(u, &["", "esc", " "])?,
            min_retry_cost: int(u, MAX_BUDGET_UNITS)?,
            min_retry_latency_ms: int(u, MAX_HORIZON_MS)?,
            write_scope: paths(u, 3)?,
            delegate_attestation: if u.arbitrary()? {
                Some(attestation(u)?)
            } else {
                None
            },
            host_public_key: host_key(u)?,
            result_schema_json: match u.int_in_range(0..=3)? {
                0 => String::new(),
                1 => u.arbitrary()?,
                _ => schema(u, 4)?.to_string(),
            },
        }
        .encode_to_vec(),
        Kind::Accept => pb::AcceptBody {
            header,
            contract_id: id(u)?,
            host_public_key: host_key(u)?,
        }
        .encode_to_vec(),
        Kind::Decline => reasoned!(DeclineBody),
        Kind::Escalate => reasoned!(EscalateBody),
        Kind::Revoke => reasoned!(RevokeBody),
        Kind::Adjudicate => pb::AdjudicateBody {
            header,
            contract_id: id(u)?,
            verdict: u.int_in_range(-1..=4)?,
            reason: reason(u)?,
        }
        .encode_to_vec(),
        Kind::Complete => pb::CompleteBody {
            header,
            contract_id: id(u)?,
            output_json: match u.int_in_range(0..=3)? {
                0 => u.arbitrary()?,
                1 => format!("{}1{}", "[".repeat(70), "]".repeat(70)),
                _ => json(u, 5)?.to_string(),
            },
            claim: word(u, &["success", "partial", ""])?,
            consumed: int(u, MAX_BUDGET_UNITS)?,
            report: if u.arbitrary()? {
                Some(pb::TypedReport {
                    status: text(u)?,
                    summary: text(u)?,
                })
            } else {
                None
            },
        }
        .encode_to_vec(),
        Kind::Record => pb::RecordReceiptsBody {
            header,
            contract_id: id(u)?,
            observations: (0..u.int_in_range(0..=4)?)
                .map(|_| {
                    Ok(pb::Observation {
                        kind: u.int_in_range(0..=4)?,
                        path: path(u)?,
                        tool: word(u, &["shell", "edit", ""])?,
                        units: int(u, MAX_BUDGET_UNITS)?,
                        at_ms: u.arbitrary()?,
                        arguments_sha256: vec![7; *u.choose(&[0usize, 32, 31])?],
                        outcome: u.int_in_range(0..=3)?,
                    })
                })
                .collect::<arbitrary::Result<_>>()?,
        }
        .encode_to_vec(),
        Kind::OpenSession => pb::OpenSessionBody {
            header,
            ..Default::default()
        }
        .encode_to_vec(),
    })
}

fn header(u: &mut Unstructured<'_>) -> arbitrary::Result<pb::RequestHeader> {
    let k = keys();
    Ok(pb::RequestHeader {
        agent_public_key: if u.ratio(1, 16)? {
            u.arbitrary()?
        } else {
            k.agent.verifying_key().to_bytes().to_vec()
        },
        timestamp_ms: NOW_MS + u.int_in_range(-WINDOW_MS - 2..=WINDOW_MS + 2)?,
        nonce: vec![0x5a; u.int_in_range(MIN_NONCE_BYTES - 1..=MAX_NONCE_BYTES + 1)?],
    })
}

/// No host (half the time), or `agent_key`.
fn host_key(u: &mut Unstructured<'_>) -> arbitrary::Result<Vec<u8>> {
    Ok(if u.arbitrary()? {
        Vec::new()
    } else {
        agent_key(u)?
    })
}

fn agent_key(u: &mut Unstructured<'_>) -> arbitrary::Result<Vec<u8>> {
    Ok(if u.ratio(1, 8)? {
        u.arbitrary()?
    } else {
        u.choose(&keys().others)?.to_vec()
    })
}

/// An attestation for one of the known agents, signed by the trusted
/// attestor (or a stranger), with a factor and validity around the edges.
fn attestation(u: &mut Unstructured<'_>) -> arbitrary::Result<pb::Envelope> {
    let k = keys();
    let statement = pb::Attestation {
        agent_public_key: agent_key(u)?,
        factor: *u.choose(&[
            0.0,
            1e-9,
            0.4999995,
            0.5,
            0.9,
            1.0,
            1.0000001,
            -0.5,
            f64::NAN,
            f64::INFINITY,
        ])?,
        risk_class: word(u, &["low", "", "high"])?,
        expires_at_ms: NOW_MS + u.int_in_range(-2..=2)? * 1_000,
        not_before_ms: NOW_MS + u.int_in_range(-2..=2)? * 1_000
            - if u.arbitrary()? { NOW_MS } else { 0 },
    };
    let signer = if u.ratio(1, 4)? {
        &k.stranger
    } else {
        &k.attestor
    };
    let mut envelope =
        crypto::sign_envelope(signer, payload_type::ATTESTATION, statement.encode_to_vec());
    if u.ratio(1, 16)? {
        envelope.payload_type = payload_type::CONTRACT.into();
    }
    Ok(envelope)
}

fn text(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    Ok(match u.int_in_range(0..=15)? {
        0 => "t".repeat(16_385),
        1 => " ".into(),
        _ => u.arbitrary()?,
    })
}

/// An amount around 0 and `max`, or anywhere.
fn int(u: &mut Unstructured<'_>, max: i64) -> arbitrary::Result<i64> {
    Ok(match u.int_in_range(0..=4)? {
        0 => u.int_in_range(-2..=2)?,
        1 => max + u.int_in_range(-2..=2)?,
        2 => u.arbitrary()?,
        _ => u.int_in_range(1..=max)?,
    })
}
