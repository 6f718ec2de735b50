//! Hardening: each attack a hostile agent tried, replayed over
//! real gRPC; each test failed on the main branch before its fix.

use std::time::Duration;

use broker_client::Agent;
use delegation_broker::pb;
use tonic::Code;
use tonic_types::StatusExt;

use crate::harness::*;

/// An ancestor's predicate ending in a `//` comment, and a
/// descendant forwarding `true⏎|| true`, used to compose into
/// `P && (Q || true)`: ACCEPTED although `approved=false`. The forwarded
/// predicate must still be judged.
#[tokio::test]
async fn a_forwarded_predicate_cannot_be_dropped_by_comments_and_newlines() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.retry_headroom = false)).await;
    let [a, b] = agents();
    let to_a = root.liable_child(
        &a,
        60,
        "result.output.approved == true // the reviewer must approve",
    );
    let a_id = broker.issue(&orchestrator, to_a).await;
    broker.accept(&a, &a_id, None).await.unwrap();
    let to_b = liable_child(&a_id, &root.lineage, &b, 30, "true\n|| true");
    let b_id = broker.issue(&a, to_b).await;
    let effective = broker.effective_predicate(&b_id).await;
    assert!(
        effective.contains("result.output.approved"),
        "{effective:?}"
    );
    broker.accept(&b, &b_id, None).await.unwrap();
    let receipt = broker
        .complete(
            &b,
            complete_body(&b_id, r#"{"approved": false}"#, "success", 1),
        )
        .await
        .unwrap();
    let completion = receipt.completion.unwrap();
    assert_eq!(completion.verdict, pb::Verdict::Rejected as i32);
    assert!(
        completion
            .refused_criteria
            .iter()
            .any(|c| c.criterion.contains("result.output.approved")),
        "{:?}",
        completion.refused_criteria
    );
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// A parent whose host metered all 100 of its 100 units had
/// residual 100 and issued a 100-unit child.
#[tokio::test]
async fn metered_units_leave_the_residual_at_once() {
    let mut broker = Broker::start().await;
    let [orchestrator, a, host, c] = agents();
    let (root, a_id) = broker
        .root_and_accepted_child(&orchestrator, &a, 100, Some(&host))
        .await;
    broker.observe(&host, &a_id, tool_call("llm", 100)).await;
    assert_eq!(broker.spent_and_residual(&a_id).await, (100, 0));
    let receipt = broker
        .refuse(&a, child(&a_id, &root.lineage, &c, 100))
        .await;
    assert_eq!(
        codes(&receipt),
        vec![pb::InvariantCode::BudgetExceedsParent]
    );
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// Root 100 → A (60, OPEN) → B (30); B accepts, B's host records 4
/// units, A accepts late, B completes: B was charged 8 and its receipt said
/// consumed 4, returned 22.
#[tokio::test]
async fn a_late_accept_above_metered_work_charges_it_once() {
    let mut broker = Broker::start().await;
    let [orchestrator, a, b, host] = agents();
    let (root, a_id) = broker.root_and_child(&orchestrator, &a, 60).await;
    let b_id = broker.issue(&a, child(&a_id, &root.lineage, &b, 30)).await;
    broker.accept(&b, &b_id, Some(&host)).await.unwrap();
    broker.observe(&host, &b_id, tool_call("llm", 4)).await;
    broker.accept(&a, &a_id, None).await.unwrap();
    let completion = broker
        .completion(&b, complete_body(&b_id, "{}", "success", 4))
        .await;
    assert_eq!(
        (
            completion.consumed,
            completion.returned,
            completion.overspend
        ),
        (4, 26, 0)
    );
    assert_eq!(broker.ledger(&b_id).await.spent, 4);
    assert_eq!(broker.spent_and_residual(&a_id).await, (4, 56));
    // A escalates after the late accept: B's units are not charged again.
    broker.escalate(&a, &a_id, "stuck").await.unwrap();
    assert_eq!(broker.spent_and_residual(&root.id).await, (4, 96));
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// Without host metering a delegate reported 10^15 units on a
/// 10-unit contract and the debt climbed the chain. A report nobody
/// observed is charged at most the contract's residual; the rest is
/// recorded as `claimed_excess`.
#[tokio::test]
async fn a_self_reported_consumption_cannot_put_debt_on_the_chain() {
    let mut broker = Broker::start().await;
    let [orchestrator, a] = agents();
    let (root, a_id) = broker
        .root_and_accepted_child(&orchestrator, &a, 10, None)
        .await;
    let claimed = 1_000_000_000_000_000;
    let completion = broker
        .completion(&a, complete_body(&a_id, "{}", "success", claimed))
        .await;
    assert_eq!(
        (
            completion.consumed,
            completion.claimed_excess,
            completion.overspend,
            completion.returned
        ),
        (10, claimed - 10, 0, 0)
    );
    assert_eq!(broker.spent_and_residual(&root.id).await, (10, 90));
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// A Delegate signed by a key that holds nothing stored a signed
/// NOT_HOLDER refusal under the victim's contract, visible in its Watch
/// and audit. Now: refused (NOT_FOUND, as for an unknown parent), and nothing in anyone's tree.
#[tokio::test]
async fn strangers_cannot_write_into_a_tree() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    for _ in 0..16 {
        let stranger = Agent::generate();
        let err = broker
            .delegate(&stranger, root.child(&delegate, 10))
            .await
            .unwrap_err();
        assert_status(&err, Code::NotFound, "NOT_FOUND");
    }
    // Nothing was stored: the tree's event stream holds only the root.
    let mut stream = broker.watch(&root.id).await;
    let first = stream.message().await.unwrap().unwrap();
    assert!(matches!(
        first.event,
        Some(pb::watch_response::Event::Contract(_))
    ));
    let next = tokio::time::timeout(std::time::Duration::from_millis(300), stream.message()).await;
    assert!(next.is_err(), "an event after the root: {next:?}");
    // A holder's own refusals are still signed receipts.
    let receipt = broker
        .refuse(&orchestrator, root.child(&delegate, 1_000))
        .await;
    assert_eq!(
        codes(&receipt),
        vec![pb::InvariantCode::BudgetExceedsParent]
    );
    broker.stop().await;
}

/// Echoes of a long invalid predicate filled 8.6 KB of trailers,
/// and clients saw RESOURCE_EXHAUSTED instead of the field.
#[tokio::test]
async fn a_long_invalid_predicate_is_named_not_swallowed_by_trailers() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    // 4 KB of quotes and non-ASCII (percent-encoded 3×), that does not parse.
    let predicate = format!("result.x == \"{}", "é\"".repeat(1_300));
    let predicate = &predicate[..predicate.floor_char_boundary(4_000)];
    let body = root.liable_child(&delegate, 10, predicate);
    let err = broker.delegate(&orchestrator, body).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert_eq!(field(&err), "body.predicate");
    broker.stop().await;
}

/// An observed path with backslashes (`src/exec/..\..\etc\passwd`)
/// counted as inside `src/exec`.
#[tokio::test]
async fn backslashes_cannot_smuggle_a_path_into_the_scope() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.retry_headroom = false)).await;
    let [a, host] = agents();
    let mut body = root.liable_child(&a, 10, "result.within_scope");
    body.write_scope = vec!["src/exec".into()];
    let a_id = broker.issue(&orchestrator, body).await;
    broker.accept(&a, &a_id, Some(&host)).await.unwrap();
    broker
        .observe(&host, &a_id, mutation("src/exec/..\\..\\etc\\passwd", 0))
        .await;
    let completion = broker
        .completion(&a, complete_body(&a_id, "{}", "success", 1))
        .await;
    assert!(!completion.within_scope);
    assert_eq!(completion.verdict, pb::Verdict::Rejected as i32);
    // A scope prefix must use '/'.
    let mut body = root.child(&a, 10);
    body.write_scope = vec!["src\\exec".into()];
    let err = broker.delegate(&orchestrator, body).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    broker.stop().await;
}

/// Attestation factors rounded to nearest (0.4999995 became
/// 500,000 ppm and passed a 500,000 minimum); and an attestation had no
/// not-before time.
#[tokio::test]
async fn attested_factors_are_floored_and_not_valid_before_their_time() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.min_trust = 500_000)).await;
    let a = Agent::generate();
    let attestor = Agent::from_seed(broker.attestor.seed());
    let attest = |factor: f64, not_before_ms: i64| {
        attestor.sign(
            delegation_broker::crypto::payload_type::ATTESTATION,
            &pb::Attestation {
                agent_public_key: a.public_key().to_vec(),
                factor,
                risk_class: String::new(),
                expires_at_ms: now_ms() + 3_600_000,
                not_before_ms,
            },
        )
    };
    let mut body = root.child(&a, 10);
    body.delegate_attestation = Some(attest(0.499_999_5, 0));
    let receipt = broker.refuse(&orchestrator, body).await;
    assert_eq!(codes(&receipt), vec![pb::InvariantCode::TrustAttenuated]);
    assert_eq!(receipt.violations[0].requested, "499999");
    let mut body = root.child(&a, 10);
    body.delegate_attestation = Some(attest(0.5, now_ms() + 600_000));
    let receipt = broker.refuse(&orchestrator, body).await;
    assert_eq!(codes(&receipt), vec![pb::InvariantCode::TrustAttenuated]);
    assert!(
        receipt.violations[0].detail.contains("not valid before"),
        "{}",
        receipt.violations[0].detail
    );
    let mut body = root.child(&a, 10);
    body.delegate_attestation = Some(attest(0.5, now_ms() - 1_000));
    broker.issue(&orchestrator, body).await;
    broker.stop().await;
}

/// A new attestation that costs one signature check is verified on the
/// request's handler, one that could cost more on a converter thread: the
/// verdict is the same either way — only the configured attestor's
/// signature makes the factor count, whichever place checks it and
/// wherever among the signatures it sits.
#[tokio::test]
async fn an_attestation_counts_only_with_the_attestors_signature_on_either_path() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.min_trust = 500_000)).await;
    let a = Agent::generate();
    let attestor = Agent::from_seed(broker.attestor.seed());
    let stranger = Agent::generate();
    let statement = pb::Attestation {
        agent_public_key: a.public_key().to_vec(),
        factor: 0.9,
        risk_class: String::new(),
        expires_at_ms: now_ms() + 3_600_000,
        not_before_ms: 0,
    };
    let by = |signers: &[&Agent]| {
        let mut envelope = signers[0].sign(
            delegation_broker::crypto::payload_type::ATTESTATION,
            &statement,
        );
        for signer in &signers[1..] {
            let other = signer.sign(
                delegation_broker::crypto::payload_type::ATTESTATION,
                &statement,
            );
            envelope.signatures.extend(other.signatures);
        }
        envelope
    };
    // The harness trusts one attestor: one signature is checked on the
    // handler, two could cost two checks and go to a converter.
    assert_eq!(delegation_broker::core::limits::MAX_INLINE_VERIFICATIONS, 1);
    let cases: [(&[&Agent], bool); 5] = [
        // On the handler.
        (&[&stranger], false),
        // On a converter.
        (&[&stranger, &stranger], false),
        (&[&stranger, &attestor], true),
        // On the handler.
        (&[&attestor], true),
        // Remembered now: no check at all.
        (&[&attestor], true),
    ];
    for (signers, counts) in cases {
        let mut body = root.child(&a, 10);
        body.delegate_attestation = Some(by(signers));
        if counts {
            broker.issue(&orchestrator, body).await;
        } else {
            let receipt = broker.refuse(&orchestrator, body).await;
            assert_eq!(codes(&receipt), vec![pb::InvariantCode::TrustAttenuated]);
            assert!(
                receipt.violations[0]
                    .detail
                    .contains("not signed by a trusted attestor"),
                "{}",
                receipt.violations[0].detail
            );
        }
    }
    broker.stop().await;
}

/// Every read was unauthenticated — whoever learned one contract
/// id could watch its whole tree, and AggregateAudits enumerated every run.
/// Reads now need a session, and are answered only to the tree's parties
/// and configured readers.
#[tokio::test]
async fn reads_are_answered_only_to_the_trees_parties() {
    let mut broker = Broker::start().await;
    let [orchestrator, a, host, stranger] = agents();
    let mut spec = RootSpec::default();
    spec.labels.insert("arm".into(), "x".into());
    let root = broker.open_root(&orchestrator, spec).await;
    let mut body = root.child(&a, 10);
    body.host_public_key = host.public_key().to_vec();
    let a_id = broker.issue(&orchestrator, body).await;
    let (refusal_id, _, _) = broker
        .delegate(&orchestrator, root.child(&a, 1_000))
        .await
        .unwrap()
        .refused();

    // No session at all.
    let mut anonymous = connect(&broker.addr).await;
    let err = anonymous
        .get_contract(contract_request(&a_id))
        .await
        .unwrap_err();
    assert_status(&err, Code::Unauthenticated, "NO_SESSION");
    // Public calls stay public.
    anonymous
        .get_broker_keys(pb::GetBrokerKeysRequest {})
        .await
        .unwrap();

    // A stranger with a valid session reads nothing of the tree, and cannot
    // even tell its ids from random ones: the answer for
    // each real id is the answer for a random id, message and all.
    let mut outsider = connect_as(&broker.addr, &stranger).await;
    let random = vec![0x5a; 32];
    let same =
        |real: Result<(), tonic::Status>, fake: Result<(), tonic::Status>, real_id: &[u8]| {
            let real_err = real.as_ref().unwrap_err();
            assert_eq!(reason(real_err), "NOT_FOUND");
            assert_indistinguishable(real, fake, real_id, &random, "a read");
        };
    for real in [&a_id, &root.id] {
        // Every read naming the id, for the real id and then the random one.
        let mut answers = Vec::new();
        for id in [real, &random] {
            let chain = pb::GetChainRequest {
                contract_id: id.clone(),
            };
            let children = pb::ListChildrenRequest {
                contract_id: id.clone(),
                page_size: 0,
                page_token: Vec::new(),
            };
            let audit = pb::GetAuditRequest {
                contract_id: id.clone(),
            };
            answers.push([
                outsider.get_contract(contract_request(id)).await.map(drop),
                outsider.get_chain(chain).await.map(drop),
                outsider.list_children(children).await.map(drop),
                outsider.watch(watch_request(id)).await.map(drop),
                outsider.get_audit(audit).await.map(drop),
            ]);
        }
        let [reals, fakes] = <[_; 2]>::try_from(answers).unwrap();
        for (real_answer, fake_answer) in reals.into_iter().zip(fakes) {
            same(real_answer, fake_answer, real);
        }
    }
    same(
        outsider
            .get_receipt(receipt_request(&refusal_id))
            .await
            .map(drop),
        outsider
            .get_receipt(receipt_request(&random))
            .await
            .map(drop),
        &refusal_id,
    );
    let id = || contract_request(&a_id);
    let groups = |client_groups: pb::AggregateAuditsResponse| client_groups.groups.len();
    let aggregate = pb::AggregateAuditsRequest {
        selector: Default::default(),
        group_by: vec!["arm".into()],
    };
    let seen = outsider
        .aggregate_audits(aggregate.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(groups(seen), 0, "a stranger enumerates no runs");

    // Every party reads: the orchestrator, the delegate, the host.
    for party in [&orchestrator, &a, &host] {
        let mut client = connect_as(&broker.addr, party).await;
        client.get_contract(id()).await.unwrap();
        client
            .get_receipt(receipt_request(&refusal_id))
            .await
            .unwrap();
    }
    let mut own = connect_as(&broker.addr, &orchestrator).await;
    let mine = own
        .aggregate_audits(aggregate.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        groups(mine),
        1,
        "an orchestrator aggregates the runs it opened"
    );
    // The configured reader reads everything.
    broker.client.get_contract(id()).await.unwrap();
    let all = broker
        .client
        .aggregate_audits(aggregate)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(groups(all), 1);
    // A tampered session is refused.
    let key_id = broker.current_key_id().await;
    let mut forged = connect_as(&broker.addr, &stranger).await;
    // A request meant for another broker opens nothing here.
    let err = forged
        .open_session(orchestrator.open_session("another-broker"))
        .await
        .unwrap_err();
    assert_status(&err, Code::Unauthenticated, "WRONG_BROKER");
    let session = forged
        .open_session(orchestrator.open_session(&key_id))
        .await
        .unwrap()
        .into_inner();
    let mut envelope = session.session.unwrap();
    let mut decoded = <pb::Session as prost::Message>::decode(envelope.payload.as_slice()).unwrap();
    decoded.agent_public_key = stranger.public_key().to_vec();
    envelope.payload = prost::Message::encode_to_vec(&decoded);
    let mut request = tonic::Request::new(id());
    request.metadata_mut().insert_bin(
        "x-broker-session-bin",
        tonic::metadata::BinaryMetadataValue::from_bytes(&prost::Message::encode_to_vec(&envelope)),
    );
    let err = anonymous.get_contract(request).await.unwrap_err();
    assert_status(&err, Code::Unauthenticated, "BAD_SESSION");
    broker.stop().await;
}

/// Open streams hold a connection's places, not only calls in progress: a
/// call's place comes back when its answer starts, so a client could park
/// any number of streams (ones it never reads) on one connection. The
/// broker's HTTP/2 concurrent streams are the connection's concurrent
/// requests plus its Watch streams: past them the client's next call
/// waits for a stream to end.
#[tokio::test]
async fn open_streams_count_toward_a_connections_concurrent_requests() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    /// Long enough for a call the broker could take to be answered.
    const WAITING: Duration = Duration::from_millis(500);
    let broker = Broker::start_with(|c| {
        c.limits.max_concurrent_requests_per_connection = 1;
        c.limits.max_watch_streams_per_connection = 1;
    })
    .await;
    let health = HealthClient::new(channel(&broker.addr).await);
    let watch = || {
        let mut health = health.clone();
        async move {
            health
                .watch(HealthCheckRequest::default())
                .await
                .expect("a health stream")
        }
    };
    let (first, _second) = (watch().await, watch().await);
    let mut check = health.clone();
    let third = tokio::spawn(async move { check.check(HealthCheckRequest::default()).await });
    tokio::time::sleep(WAITING).await;
    assert!(
        !third.is_finished(),
        "a third stream opened on a connection holding two of two"
    );
    drop(first);
    let checked = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("answered once a stream ended")
        .expect("joined");
    assert!(checked.is_ok(), "{checked:?}");
    broker.stop().await;
}

/// One client could take all 1,024 Watch streams. Streams are
/// capped per caller and per connection (and broker-wide), named in the
/// error, and a stream's slot comes back when it ends.
#[tokio::test]
async fn watch_streams_are_capped_per_caller_and_per_connection() {
    let mut broker = Broker::start_with(|c| {
        c.limits.max_watch_streams_per_caller = 2;
        c.limits.max_watch_streams_per_connection = 3;
        c.limits.max_watch_streams_per_tree = 4;
    })
    .await;
    let [orchestrator, d] = agents();
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    // d becomes a party of the tree.
    broker.issue(&orchestrator, root.child(&d, 1)).await;
    let watch = || watch_request(&root.id);
    let limit = |err: tonic::Status| {
        assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
        err.get_details_error_info()
            .and_then(|i| i.metadata.get("limit").cloned())
            .unwrap_or_default()
    };
    let mut first = broker.client.watch(watch()).await.unwrap().into_inner();
    let second = broker.client.watch(watch()).await.unwrap();
    let err = broker.client.watch(watch()).await.unwrap_err();
    assert_eq!(limit(err), "limits.max_watch_streams_per_caller");
    // Another caller on another connection is not held up.
    let mut other = connect_as(&broker.addr, &d).await;
    let third = other.watch(watch()).await.unwrap();
    // The reader's connection holds 2; one more caller on it reaches 3,
    // and the connection's cap stops a fourth.
    let key_id = broker.current_key_id().await;
    let session = other
        .open_session(orchestrator.open_session(&key_id))
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    let as_orchestrator = |r: pb::WatchRequest| {
        let mut request = tonic::Request::new(r);
        request.metadata_mut().insert_bin(
            "x-broker-session-bin",
            tonic::metadata::BinaryMetadataValue::from_bytes(&prost::Message::encode_to_vec(
                &session,
            )),
        );
        request
    };
    let fourth = broker.client.watch(as_orchestrator(watch())).await.unwrap();
    let err = broker
        .client
        .watch(as_orchestrator(watch()))
        .await
        .unwrap_err();
    assert_eq!(limit(err), "limits.max_watch_streams_per_connection");
    // A fifth stream on the tree, from a fresh party on a fresh connection:
    // the tree's cap (new keys made parties cannot take every stream).
    let e = Agent::generate();
    broker.issue(&orchestrator, root.child(&e, 1)).await;
    let mut fresh = connect_as(&broker.addr, &e).await;
    let err = fresh.watch(watch()).await.unwrap_err();
    assert_eq!(limit(err), "limits.max_watch_streams_per_tree");
    // Streams deliver; an ended stream gives its slot back.
    assert!(first.message().await.unwrap().is_some());
    drop(first);
    drop(fourth);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let again = loop {
        match broker.client.watch(watch()).await {
            Ok(stream) => break stream,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = limit(e);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the slot never came back: {e:?}"),
        }
    };
    drop((second, third, again));
    broker.stop().await;
}

/// ListChildren pages went past 4 MiB as an untyped OUT_OF_RANGE,
/// GetChain could not be read, and GetAudit of a contract with 10,000
/// observed paths could not be read at all.
#[tokio::test]
async fn pages_are_bounded_by_bytes_and_oversized_answers_are_typed() {
    // The smallest request limit makes the response limit 16 KiB.
    let mut broker = Broker::start_with(|c| c.limits.max_request_bytes = 4_096).await;
    let [orchestrator, a, host] = agents();
    let root = broker
        .open_root(&orchestrator, RootSpec::with(|s| s.max_depth = 8))
        .await;
    // Children whose envelopes add up past one response.
    let mut ids = Vec::new();
    for i in 0..12 {
        let mut body = root.child(&a, 1);
        body.task = format!("{i} {}", "x".repeat(1_900));
        ids.push(broker.issue(&orchestrator, body).await);
    }
    let mut listed = Vec::new();
    let mut token = Vec::new();
    let mut pages = 0;
    loop {
        let page = broker
            .client
            .list_children(pb::ListChildrenRequest {
                contract_id: root.id.clone(),
                page_size: 1_000,
                page_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        listed.extend(page.children.into_iter().map(|c| c.contract_id));
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(listed, ids, "every child, once, in order");
    assert!(pages > 1, "pages are cut by bytes");
    // A chain deeper than a response holds is a typed RESOURCE_EXHAUSTED.
    let mut parent = root.id.clone();
    let mut holder = orchestrator;
    for _ in 0..6 {
        let next = Agent::generate();
        let mut body = child(&parent, &root.lineage, &next, 1);
        body.task = "y".repeat(3_000);
        parent = broker.issue(&holder, body).await;
        holder = next;
    }
    let err = broker
        .client
        .get_chain(pb::GetChainRequest {
            contract_id: parent.clone(),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::ResourceExhausted, "RESPONSE_TOO_LARGE");
    // An audit names a bounded number of paths and counts them all.
    broker.accept(&a, &ids[0], Some(&host)).await.unwrap();
    // Small batches: this broker takes requests of at most 4 KiB.
    for batch in 0..10 {
        let observations = (0..40)
            .map(|i| mutation(&format!("src/{batch}/{i}"), 0))
            .collect();
        broker.record(&host, &ids[0], observations).await.unwrap();
    }
    let audit = audit(&mut broker, &ids[0]).await;
    assert_eq!(audit.mutation_path_count, 400);
    assert_eq!(audit.mutation_paths.len(), 256);
    assert_eq!(audit.mutations, 400);
    broker.stop().await;
}

/// Over gRPC: `matches` with a short counted pattern over a 255 KB
/// output occupied a judge for 23 s. Now the completion is answered at
/// once, and an unrelated client's reads keep answering meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expensive_matches_is_refused_without_stalling_anyone() {
    let mut broker = Broker::start_with(|c| c.limits.max_request_bytes = 1024 * 1024).await;
    let orchestrator = Agent::generate();
    let root = broker
        .open_root(&orchestrator, RootSpec::with(|s| s.retry_headroom = false))
        .await;
    let pattern = "result.output.text.matches('a[ab]{10000}[^ab]')";
    // Four delegates (one signer's judgments are capped at two at once).
    let delegates: Vec<Agent> = (0..4).map(|_| Agent::generate()).collect();
    let mut completions = Vec::new();
    for d in &delegates {
        let body = root.liable_child(d, 10, pattern);
        let id = broker.issue(&orchestrator, body).await;
        broker.accept(d, &id, None).await.unwrap();
        completions.push((Agent::from_seed(d.seed()), id));
    }
    let text = "ab".repeat(127 * 1024);
    let mut tasks = Vec::new();
    for (d, id) in completions {
        let mut client = connect_as(&broker.addr, &d).await;
        let body = complete_body(&id, &format!("{{\"text\":\"{text}\"}}"), "success", 1);
        tasks.push(tokio::spawn(async move {
            send_lifecycle(&mut client, &d, body).await
        }));
    }
    // Meanwhile, an unrelated read answers within a generous bound.
    for _ in 0..5 {
        let started = std::time::Instant::now();
        broker.state(&root.id).await;
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
    for task in tasks {
        let receipt = decode_receipt(&task.await.unwrap().unwrap());
        let completion = receipt.completion.unwrap();
        assert_eq!(completion.verdict, pb::Verdict::Rejected as i32);
        assert!(
            completion.refused_criteria[0]
                .reason
                .contains("does not compile within")
                || completion.refused_criteria[0].reason.contains("cost"),
            "{:?}",
            completion.refused_criteria
        );
    }
    broker.stop().await;
}

/// A schema of `count` string properties, each with a distinct pattern of
/// a Unicode class repeated 50 times (item 7's attack: 58 KB of them cost
/// 37+ s of CPU to compile).
fn regex_bomb_schema(count: usize) -> String {
    let properties: Vec<String> = (0..count)
        .map(|i| format!(r#""p{i}":{{"type":"string","pattern":"[\\p{{L}}\\p{{N}}]{{50}}N{i}"}}"#))
        .collect();
    format!(
        r#"{{"type":"object","properties":{{{}}}}}"#,
        properties.join(",")
    )
}

/// A schema attack: `anyOf: [$ref next, $ref next]` under `not`, sixty
/// levels deep, doubling validation time per level.
fn doubling_schema(levels: usize) -> String {
    let defs: Vec<String> = (0..levels)
        .map(|i| {
            format!(
                r##""d{i}":{{"not":{{"anyOf":[{{"$ref":"#/$defs/d{n}"}},{{"$ref":"#/$defs/d{n}"}}]}}}}"##,
                n = i + 1
            )
        })
        .chain(std::iter::once(format!(r#""d{levels}":{{"type":"string"}}"#)))
        .collect();
    format!(
        r##"{{"$defs":{{{}}},"$ref":"#/$defs/d0"}}"##,
        defs.join(",")
    )
}

/// Items 6 and 7: expensive schemas are refused at issuance, cheap checks
/// (parent, holder) come before any of them, and an unrelated client's
/// reads keep answering meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expensive_schemas_are_refused_cheaply_and_after_the_cheap_checks() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let [a, stranger] = agents();
    let bomb = regex_bomb_schema(950);
    assert!(bomb.len() > 50_000 && bomb.len() < 65_536, "{}", bomb.len());
    let with_schema = |parent: &[u8], schema: &str| {
        let mut body = child(parent, &root.lineage, &a, 10);
        body.result_schema_json = schema.to_owned();
        body
    };
    let mut attackers = Vec::new();
    for i in 0..4 {
        let mut client = connect(&broker.addr).await;
        let stranger = Agent::from_seed(stranger.seed());
        // A random parent, then the victim's real parent: both refused
        // before the schema is looked at.
        let parent = if i % 2 == 0 {
            vec![7; 32]
        } else {
            root.id.clone()
        };
        let body = with_schema(&parent, &bomb);
        attackers.push(tokio::spawn(async move {
            let started = std::time::Instant::now();
            let err = client.delegate(stranger.delegate(body)).await.unwrap_err();
            (err.code(), started.elapsed())
        }));
    }
    for _ in 0..5 {
        let started = std::time::Instant::now();
        broker.state(&root.id).await;
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
    for (i, attacker) in attackers.into_iter().enumerate() {
        let (code, took) = attacker.await.unwrap();
        // A random parent or one the stranger does not hold: both read
        // as unknown to a stranger.
        let _ = i;
        assert_eq!(code, Code::NotFound);
        assert!(took < std::time::Duration::from_secs(1), "{took:?}");
    }
    // The holder's own expensive schemas: INVALID_ARGUMENT naming the field.
    for schema in [bomb.as_str(), doubling_schema(60).as_str()] {
        let started = std::time::Instant::now();
        let err = broker
            .delegate(&orchestrator, with_schema(&root.id, schema))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert_eq!(field(&err), "body.result_schema_json");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
    // An honest schema is still issued.
    let honest = r#"{"type":"object","required":["patch"],"properties":{"patch":{"type":"string","pattern":"^---"}}}"#;
    broker
        .issue(&orchestrator, with_schema(&root.id, honest))
        .await;
    broker.stop().await;
}

/// Unmetered reports, through a host: without `require_host`, a delegate may name its
/// own second key as host at Accept, and that host's metering was charged
/// in full (10^15 units on a 10-unit contract). A host the delegate chose
/// is charged only up to the residual, the rest recorded; a host the
/// principal named is a fact and may overspend.
#[tokio::test]
async fn a_host_the_delegate_chose_cannot_put_debt_on_the_chain() {
    let mut broker = Broker::start().await;
    let [orchestrator, a, own_host, b, named_host] = agents();
    let (root, a_id) = broker
        .root_and_accepted_child(&orchestrator, &a, 10, Some(&own_host))
        .await;
    let huge = 1_000_000_000_000_000;
    broker
        .observe(&own_host, &a_id, tool_call("llm", huge))
        .await;
    assert_eq!(broker.ledger(&a_id).await.spent, 10);
    let completion = broker
        .completion(&a, complete_body(&a_id, "{}", "success", 1))
        .await;
    assert_eq!(charged(&completion), (10, huge - 10, 0));
    // The principal's own choice of host is trusted in full.
    let mut body = root.child(&b, 10);
    body.host_public_key = named_host.public_key().to_vec();
    let b_id = broker.issue(&orchestrator, body).await;
    broker.accept(&b, &b_id, None).await.unwrap();
    broker
        .observe(&named_host, &b_id, tool_call("llm", 25))
        .await;
    let completion = broker
        .completion(&b, complete_body(&b_id, "{}", "success", 1))
        .await;
    assert_eq!(charged(&completion), (25, 0, 15));
    assert_eq!(broker.spent_and_residual(&root.id).await, (35, 65));
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// A host observation recorded while a completion was being judged
/// made the single writer judge it again on its own thread; with item 8's
/// predicate that froze every tenant's writes for 73 s. Now judging never
/// runs on the writer (and is bounded): an unrelated tenant's writes keep
/// answering while the completion and the observation race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observation_during_judgment_never_makes_the_writer_judge() {
    let (mut broker, orchestrator, root) =
        Broker::start_with_root_of(RootSpec::with(|s| s.retry_headroom = false)).await;
    let [a, host, tenant] = agents();
    let pattern = "result.output.text.matches('a[ab]{10000}[^ab]')";
    let mut body = root.liable_child(&a, 10, pattern);
    body.host_public_key = host.public_key().to_vec();
    let id = broker.issue(&orchestrator, body).await;
    broker.accept(&a, &id, None).await.unwrap();
    let text = "ab".repeat(127 * 1024);
    let mut completer = connect_as(&broker.addr, &a).await;
    let complete = {
        let body = complete_body(&id, &format!("{{\"text\":\"{text}\"}}"), "success", 1);
        tokio::spawn(async move { send_lifecycle(&mut completer, &a, body).await })
    };
    // The host records while the completion is (perhaps) being judged; it
    // may also find the contract already completed.
    let mut recorder = connect_as(&broker.addr, &host).await;
    let record = tokio::spawn(async move {
        let body = pb::RecordReceiptsBody {
            header: None,
            contract_id: id.clone(),
            observations: vec![mutation("src/a.rs", 1)],
        };
        send_lifecycle(&mut recorder, &host, body).await
    });
    // Meanwhile an unrelated tenant's writes answer within a generous bound.
    for _ in 0..5 {
        let started = std::time::Instant::now();
        broker.open_root(&tenant, RootSpec::default()).await;
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "a write took {:?}",
            started.elapsed()
        );
    }
    let receipt = decode_receipt(&complete.await.unwrap().unwrap());
    assert_eq!(
        receipt.completion.unwrap().verdict,
        pb::Verdict::Rejected as i32
    );
    match record.await.unwrap() {
        Ok(_) => {}
        Err(e) => assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}"),
    }
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}

/// Every commit woke every Watch stream and each re-ran a
/// recursive subtree query; with 800 idle watchers an unrelated
/// GetContract's median went from 1 ms to 7.6 s. Now a woken stream
/// queries only when its own tree changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_watchers_of_one_tree_do_not_slow_the_others() {
    const WATCHERS: usize = 800;
    let mut broker = start_for_watchers(WATCHERS).await;
    let [watched_owner, busy_owner, worker] = agents();
    let watched = broker.open_root(&watched_owner, RootSpec::default()).await;
    let busy = broker
        .open_root(
            &busy_owner,
            RootSpec::with(|s| (s.budget, s.max_children) = (1_000, 1_024)),
        )
        .await;
    // Commits in the other tree, each read back at once: 100 rounds.
    async fn rounds(
        broker: &mut Broker,
        owner: &Agent,
        busy: &Root,
        worker: &Agent,
    ) -> (std::time::Duration, std::time::Duration) {
        let mut slowest = std::time::Duration::ZERO;
        let started = std::time::Instant::now();
        for _ in 0..100 {
            let id = broker.issue(owner, busy.child(worker, 1)).await;
            let read = std::time::Instant::now();
            broker.state(&id).await;
            slowest = slowest.max(read.elapsed());
        }
        (started.elapsed(), slowest)
    }
    // The same rounds without watchers first: the comparison is within one
    // run, so a loaded machine slows both alike.
    let (baseline, baseline_slowest) = rounds(&mut broker, &busy_owner, &busy, &worker).await;
    let mut streams = Vec::with_capacity(WATCHERS);
    for _ in 0..WATCHERS {
        let stream = broker.watch(&watched.id).await;
        streams.push(stream);
    }
    let (took, slowest) = rounds(&mut broker, &busy_owner, &busy, &worker).await;
    // When every woken stream queried, the rounds took ~9 times as long
    // (12 s against 1.3 s); with the fix, about as long as without
    // watchers. Four times the baseline (plus a second) tells them apart.
    assert!(
        took < baseline * 4 + std::time::Duration::from_secs(1),
        "100 rounds took {took:?} with {WATCHERS} idle watchers, {baseline:?} without"
    );
    assert!(
        slowest < baseline_slowest * 4 + std::time::Duration::from_millis(500),
        "slowest read {slowest:?} with watchers, {baseline_slowest:?} without"
    );
    drop(streams);
    broker.stop().await;
}

/// Asserts a stranger's answer for a real id is NOT_FOUND and is its
/// answer for the random id `random` (code, reason and message, ids aside).
#[track_caller]
fn assert_indistinguishable<T: std::fmt::Debug>(
    real: Result<T, tonic::Status>,
    fake: Result<T, tonic::Status>,
    real_id: &[u8],
    random: &[u8],
    name: &str,
) {
    let (real, fake) = (real.unwrap_err(), fake.unwrap_err());
    assert_eq!(real.code(), Code::NotFound, "{name}: {real:?}");
    assert_eq!(
        (
            real.code(),
            reason(&real),
            real.message().replace(&hex::encode(real_id), "ID")
        ),
        (
            fake.code(),
            reason(&fake),
            fake.message().replace(&hex::encode(random), "ID")
        ),
        "{name}"
    );
}

/// What a completion charged: consumed, claimed beyond it, overspent.
fn charged(completion: &pb::Completion) -> (i64, i64, i64) {
    (
        completion.consumed,
        completion.claimed_excess,
        completion.overspend,
    )
}

/// A broker that serves `watchers` Watch streams to one caller, on one
/// connection, of one tree.
async fn start_for_watchers(watchers: usize) -> Broker {
    Broker::start_with(|c| {
        c.limits.max_watch_streams_per_caller = watchers;
        c.limits.max_watch_streams_per_connection = watchers;
        c.limits.max_watch_streams_per_tree = watchers;
    })
    .await
}

/// This process's resident memory, in bytes (Linux).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Watch streams that never read pinned whole pages (400 streams:
/// 2.8 GB of RSS). A stream now holds at most a byte-bounded page and a
/// few events, however slowly its client reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_watch_streams_hold_bounded_memory() {
    const WATCHERS: usize = 400;
    let mut broker = start_for_watchers(WATCHERS).await;
    let [owner, worker] = agents();
    let root = broker.open_root(&owner, RootSpec::default()).await;
    // 64 contracts of ~16 KB: about 1 MB of events in the tree.
    for i in 0..64 {
        let mut body = root.child(&worker, 1);
        body.task = format!("{i} {}", "x".repeat(16_000));
        broker.issue(&owner, body).await;
    }
    let before = rss_bytes();
    let mut streams = Vec::with_capacity(WATCHERS);
    for _ in 0..WATCHERS {
        let stream = broker.watch(&root.id).await;
        streams.push(stream);
    }
    // Let every stream fill what it may hold while nobody reads.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let grown = rss_bytes().saturating_sub(before);
    // Measured here: ~120 MB with bounded pages, ~440 MB with the old
    // unbounded pages and deeper buffer. A generous bound, not a benchmark.
    assert!(
        grown < 300 * 1024 * 1024,
        "{WATCHERS} idle streams grew RSS by {} MB",
        grown / (1024 * 1024)
    );
    // Every stream still delivers, from the first event on.
    for stream in streams.iter_mut().take(3) {
        assert!(stream.message().await.unwrap().is_some());
    }
    drop(streams);
    broker.stop().await;
}

/// Every call that names an id answered a stranger
/// NOT_A_PARTY / NOT_HOLDER / NOT_DELEGATE… for a real id and NOT_FOUND for
/// a random one, so anyone could learn which ids exist. Now a stranger's
/// answer for a real id is its answer for a random one (code, reason and
/// message, ids aside), on Delegate and every lifecycle call; a party
/// still learns why it was refused.
#[tokio::test]
async fn a_stranger_cannot_tell_a_real_id_from_a_random_one() {
    let mut broker = Broker::start().await;
    let [orchestrator, a, host, stranger] = agents();
    let (root, a_id) = broker
        .root_and_accepted_child(&orchestrator, &a, 10, Some(&host))
        .await;
    let random = vec![0x5a; 32];
    // Delegate from a contract the stranger does not hold.
    let real = broker.delegate(&stranger, root.child(&a, 1)).await;
    let fake = broker
        .delegate(&stranger, child(&random, &root.lineage, &a, 1))
        .await;
    assert_indistinguishable(real, fake, &root.id, &random, "Delegate");
    for real in [&a_id, &root.id] {
        // Every lifecycle call, for the real id and then the random one.
        let mut answers = Vec::new();
        for id in [real, &random] {
            let decline = pb::DeclineBody {
                header: None,
                contract_id: id.clone(),
                reason: "no".into(),
            };
            let complete = complete_body(id, "{}", "done", 0);
            let adjudicate = pb::AdjudicateBody {
                header: None,
                contract_id: id.clone(),
                verdict: pb::Verdict::Accepted as i32,
                reason: "fine".into(),
            };
            answers.push([
                ("Accept", broker.accept(&stranger, id, None).await),
                ("Decline", broker.act(&stranger, decline).await),
                ("Complete", broker.complete(&stranger, complete).await),
                ("Escalate", broker.escalate(&stranger, id, "stuck").await),
                ("Revoke", broker.revoke(&stranger, id).await),
                (
                    "RecordReceipts",
                    broker.record(&stranger, id, vec![tool_call("t", 0)]).await,
                ),
                ("Adjudicate", broker.act(&stranger, adjudicate).await),
            ]);
        }
        let [reals, fakes] = <[_; 2]>::try_from(answers).unwrap();
        for ((name, real_answer), (_, fake_answer)) in reals.into_iter().zip(fakes) {
            assert_indistinguishable(real_answer, fake_answer, real, &random, name);
        }
    }
    // A party is still told why: the delegate may not revoke its own
    // contract, nor delegate from the root it does not hold.
    let err = broker.revoke(&a, &a_id).await.unwrap_err();
    assert_status(&err, Code::PermissionDenied, "NOT_ANCESTOR");
    let err = broker.delegate(&a, root.child(&host, 1)).await.unwrap_err();
    assert_status(&err, Code::PermissionDenied, "NOT_HOLDER");
    broker.stop().await;
}
