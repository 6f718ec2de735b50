//! WatchContracts: one stream of the states of many contracts of many
//! trees, each sent when added and again when its status changes
//! (an ancestor's revocation included), nothing while nothing changes,
//! and only for contracts the session's key may read.

use std::time::Duration;

use delegation_broker::pb;
use tokio_stream::StreamExt as _;

use crate::harness::*;

/// Longest wait for a state the stream owes (the broker looks at most
/// 100 ms after a commit).
const OWED: Duration = Duration::from_secs(10);
/// How long a quiet stream is watched for a state it must not send.
const QUIET: Duration = Duration::from_millis(600);

/// Reads states until the stream ends, which must be with a status: how
/// many states, and the status.
async fn read_to_the_end(
    states: &mut tonic::Streaming<pb::WatchContractsResponse>,
) -> (usize, tonic::Status) {
    let mut read = 0;
    loop {
        match tokio::time::timeout(OWED, states.next())
            .await
            .expect("an answer in time")
            .expect("the stream ends with a status, not silently")
        {
            Ok(_) => read += 1,
            Err(status) => return (read, status),
        }
    }
}

fn add(ids: &[&[u8]]) -> pb::WatchContractsRequest {
    pb::WatchContractsRequest {
        add_contract_ids: ids.iter().map(|id| id.to_vec()).collect(),
        remove_contract_ids: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watched_contracts_report_each_status_change_and_nothing_else() {
    let mut broker = Broker::start().await;
    let [orchestrator, worker, other] = agents();
    // Two trees; the worker holds a child in each, one a grandchild's
    // parent.
    let (first, a) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let (_, b) = broker.root_and_child(&other, &worker, 10).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut client = connect_as(&broker.addr, &worker).await;
    let mut states = client
        .watch_contracts(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens")
        .into_inner();
    let mut next = async || {
        let state = tokio::time::timeout(OWED, states.next())
            .await
            .expect("a state in time")
            .expect("the stream goes on")
            .expect("a state, not an error")
            .contract
            .expect("a contract");
        (state.contract_id, state.status)
    };
    tx.send(add(&[&a, &b])).await.unwrap();
    let open = pb::ContractStatus::Open as i32;
    let mut first_states = vec![next().await, next().await];
    first_states.sort();
    let mut expected = vec![(a.clone(), open), (b.clone(), open)];
    expected.sort();
    assert_eq!(
        first_states, expected,
        "each added contract's state at once"
    );

    // A change elsewhere in a's tree that leaves a as it is: nothing.
    broker.issue(&orchestrator, first.child(&other, 5)).await;
    // a accepted by its delegate: its new status.
    broker.accept(&worker, &a, None).await.unwrap();
    assert_eq!(
        next().await,
        (a.clone(), pb::ContractStatus::Accepted as i32)
    );
    // a's root revoked by the orchestrator: a is revoked with it.
    broker.revoke(&orchestrator, &first.id).await.unwrap();
    assert_eq!(
        next().await,
        (a.clone(), pb::ContractStatus::Revoked as i32)
    );
    // b removed: its revocation is not sent.
    tx.send(pb::WatchContractsRequest {
        add_contract_ids: Vec::new(),
        remove_contract_ids: vec![b.clone()],
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    broker.revoke(&other, &b).await.unwrap();
    let quiet = tokio::time::timeout(QUIET, states.next()).await;
    assert!(
        quiet.is_err(),
        "nothing after the change of a removed contract: {quiet:?}"
    );
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contract_the_key_may_not_read_ends_the_stream_not_found() {
    let mut broker = Broker::start().await;
    let [orchestrator, worker, stranger] = agents();
    let (_, a) = broker.root_and_child(&orchestrator, &worker, 10).await;
    let addr = broker.addr.clone();
    let open = async |ids: Vec<pb::WatchContractsRequest>| {
        let mut client = connect_as(&addr, &stranger).await;
        let mut states = client
            .watch_contracts(tokio_stream::iter(ids))
            .await
            .expect("the stream opens")
            .into_inner();
        tokio::time::timeout(OWED, states.next())
            .await
            .expect("an answer in time")
            .expect("an item")
            .expect_err("the stream ends with a status")
    };
    let status = open(vec![add(&[&a])]).await;
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let many: Vec<Vec<u8>> = (0..1_025u32)
        .map(|i| [i.to_be_bytes().to_vec(), vec![0; 28]].concat())
        .collect();
    let status = open(vec![pb::WatchContractsRequest {
        add_contract_ids: many,
        remove_contract_ids: Vec::new(),
    }])
    .await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    broker.stop().await;
}

/// One stream watches at most 4,096 contracts (`MAX_WATCHED_CONTRACTS`,
/// its memory and each scan's work): an add past it ends the stream
/// RESOURCE_EXHAUSTED, and a new stream watches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_watches_at_most_its_bound_of_contracts() {
    use delegation_broker::core::limits::{MAX_WATCH_CONTRACTS_PER_MESSAGE, MAX_WATCHED_CONTRACTS};
    /// Roots opened at once.
    const OPENERS: usize = 16;
    let broker = Broker::start().await;
    let [orchestrator] = agents();
    // One more root than a stream watches, each readable by its opener.
    let mut openers = tokio::task::JoinSet::new();
    for opener in 0..OPENERS {
        let (addr, orchestrator) = (
            broker.addr.clone(),
            broker_client::Agent::from_seed(orchestrator.seed()),
        );
        openers.spawn(async move {
            let mut client = connect_as(&addr, &orchestrator).await;
            let mut ids = Vec::new();
            for _ in (opener..=MAX_WATCHED_CONTRACTS).step_by(OPENERS) {
                let issued = open_root_on(&mut client, &orchestrator, &RootSpec::default()).await;
                ids.push(issued.contract_id);
            }
            ids
        });
    }
    let ids: Vec<Vec<u8>> = openers.join_all().await.concat();
    assert_eq!(ids.len(), MAX_WATCHED_CONTRACTS + 1);
    let (watched, over) = ids.split_at(MAX_WATCHED_CONTRACTS);
    let mut messages: Vec<pb::WatchContractsRequest> = watched
        .chunks(MAX_WATCH_CONTRACTS_PER_MESSAGE)
        .map(|chunk| pb::WatchContractsRequest {
            add_contract_ids: chunk.to_vec(),
            remove_contract_ids: Vec::new(),
        })
        .collect();
    messages.push(add(&[&over[0]]));
    let mut client = connect_as(&broker.addr, &orchestrator).await;
    let mut states = client
        .watch_contracts(tokio_stream::iter(messages))
        .await
        .expect("the stream opens")
        .into_inner();
    let (sent, ended) = read_to_the_end(&mut states).await;
    assert_eq!(
        sent, MAX_WATCHED_CONTRACTS,
        "every contract within the bound"
    );
    assert_eq!(ended.code(), tonic::Code::ResourceExhausted, "{ended:?}");
    // Another stream takes the last one.
    let mut states = client
        .watch_contracts(tokio_stream::iter(vec![add(&[&over[0]])]))
        .await
        .expect("the stream opens")
        .into_inner();
    let state = tokio::time::timeout(OWED, states.next())
        .await
        .expect("a state in time")
        .expect("an item")
        .expect("a state");
    assert_eq!(state.contract.expect("a contract").contract_id, over[0]);
    broker.stop().await;
}

/// A client that stops reading cannot hold its stream: once what it has
/// not read fills the broker's buffer and the connection's window, the
/// broker waits `limits.watch_send_timeout_ms` and ends the stream
/// RESOURCE_EXHAUSTED (OVERLOADED, `limit` naming it) after what was
/// buffered. Without the bound it waits for the client for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stops_reading_ends() {
    use tonic_types::StatusExt;
    /// The bound in this test.
    const SEND_TIMEOUT_MS: u64 = 300;
    /// Roots watched, each with a ~64 KiB envelope (a full write scope).
    const ROOTS: usize = 8;
    /// Each cycle adds and removes every root: a state per root and
    /// cycle, 20 MiB in all, far past any window.
    const CYCLES: usize = 40;
    /// How long the client does not read: the broker fills what it may
    /// send and gives up long before.
    const NOT_READING: Duration = Duration::from_secs(5);
    let broker =
        Broker::start_with(|config| config.limits.watch_send_timeout_ms = SEND_TIMEOUT_MS).await;
    let [orchestrator] = agents();
    let mut client = connect_as(&broker.addr, &orchestrator).await;
    let spec = RootSpec {
        scope: (0..64)
            .map(|i| format!("d{i:02}/{}", "a".repeat(1_000)))
            .collect(),
        ..RootSpec::default()
    };
    let mut ids = Vec::new();
    for _ in 0..ROOTS {
        ids.push(
            open_root_on(&mut client, &orchestrator, &spec)
                .await
                .contract_id,
        );
    }
    let mut messages = Vec::new();
    for _ in 0..CYCLES {
        messages.push(pb::WatchContractsRequest {
            add_contract_ids: ids.clone(),
            remove_contract_ids: Vec::new(),
        });
        messages.push(pb::WatchContractsRequest {
            add_contract_ids: Vec::new(),
            remove_contract_ids: ids.clone(),
        });
    }
    let mut states = client
        .watch_contracts(tokio_stream::iter(messages))
        .await
        .expect("the stream opens")
        .into_inner();
    tokio::time::sleep(NOT_READING).await;
    let (read, ended) = read_to_the_end(&mut states).await;
    assert!(
        read > 0 && read < ROOTS * CYCLES,
        "what was buffered, not every state: {read}"
    );
    assert_status(&ended, tonic::Code::ResourceExhausted, "OVERLOADED");
    let limit = ended
        .get_details_error_info()
        .and_then(|info| info.metadata.get("limit").cloned());
    assert_eq!(limit.as_deref(), Some("limits.watch_send_timeout_ms"));
    broker.stop().await;
}
