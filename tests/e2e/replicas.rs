//! A replicated broker: several broker replicas over one PostgreSQL
//! database. Every test here runs on PostgreSQL
//! whatever the run's backend, on a database of its own.

use std::sync::Arc;
use std::time::Duration;

use broker_client::Agent;
use delegation_broker::pb;
use delegation_broker::pb::InvariantCode as Code;
use tokio_stream::StreamExt;

use crate::harness::*;
use delegation_broker::crypto::payload_type;

/// Three replicas on one fresh database.
async fn three() -> (Broker, Broker, Broker) {
    let a = Broker::start_replicated().await;
    let b = Broker::start_replica(&a).await;
    let c = Broker::start_replica(&a).await;
    (a, b, c)
}

async fn stop_all(a: Broker, b: Broker, c: Broker) {
    // The first owns the database: it goes last.
    c.stop().await;
    b.stop().await;
    a.stop().await;
}

/// (a, g) 64 concurrent siblings of 10 from a parent whose residual is
/// 300, round-robin over three replicas: exactly 30 issued and 34 signed
/// BUDGET_EXCEEDS_PARENT refusals, no other answer (no raw database
/// error), and every ledger of the tree balances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_racing_through_three_replicas_never_overspend() {
    let (mut a, b, c) = three().await;
    let addrs = [a.addr.clone(), b.addr.clone(), c.addr.clone()];
    assert_siblings_never_overspend(&mut a, &addrs).await;
    stop_all(a, b, c).await;
}

/// (b) A request answered by replica A and retried with the same nonce on
/// B gets the original answer, reserved once; the same nonce with another
/// body on C is ALREADY_EXISTS. The contract A issued verifies with the
/// keys B publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_another_replica_is_replayed_and_reserves_once() {
    let (mut a, mut b, mut c) = three().await;
    let [orchestrator, worker] = agents();
    let root = a.open_root(&orchestrator, RootSpec::default()).await;
    let mut body = root.child(&worker, 10);
    body.header = Some(orchestrator.header());
    let request = orchestrator.delegate(body.clone());
    let first = a.send_delegate(request.clone()).await.unwrap();
    assert!(!first.replayed);
    let again = b.send_delegate(request.clone()).await.unwrap();
    assert!(again.replayed, "answered from the request log");
    assert_eq!(again.outcome, first.outcome);
    assert_eq!(b.ledger(&root.id).await.reserved, 10, "reserved once");
    // The same nonce, another body.
    let mut other = body;
    other.budget = 20;
    let status = c
        .send_delegate(orchestrator.delegate(other))
        .await
        .expect_err("a reused nonce");
    assert_status(&status, tonic::Code::AlreadyExists, "NONCE_REUSED");
    assert_eq!(c.ledger(&root.id).await.reserved, 10, "still reserved once");
    // Issued through A, verified with B's published keys.
    let Some(pb::delegate_response::Outcome::Issued(issued)) = first.outcome else {
        panic!("issued");
    };
    let keys_b = b.keys().await;
    let sealed = issued.contract.as_ref().unwrap();
    verify_with_keys(
        sealed,
        payload_type::CONTRACT,
        &keys_b,
        &decode_contract(sealed).broker_key_id,
    );
    assert_eq!(
        keys_b.iter().filter(|k| k.current).count(),
        3,
        "every replica's key is published: {keys_b:?}"
    );
    stop_all(a, b, c).await;
}

/// (c) A revocation through A is seen at once by B and C: a Delegate from
/// inside the revoked subtree through B is refused PARENT_NOT_ACTIVE, an
/// Accept through C is FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_through_one_replica_holds_on_the_others() {
    let (mut a, mut b, mut c) = three().await;
    let [orchestrator, mid, leaf] = agents();
    let root = a.open_root(&orchestrator, RootSpec::default()).await;
    let mid_id = a.issue(&orchestrator, root.child(&mid, 50)).await;
    let leaf_id = a
        .issue(&mid, child(&mid_id, &root.lineage, &leaf, 20))
        .await;
    a.revoke(&orchestrator, &mid_id).await.expect("revoked");
    let receipt = b
        .refuse(&leaf, child(&leaf_id, &root.lineage, &Agent::generate(), 5))
        .await;
    assert_eq!(codes(&receipt), vec![Code::ParentNotActive]);
    let status = c
        .accept(&leaf, &leaf_id, None)
        .await
        .expect_err("an ended contract");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    a.assert_ledgers_balance(&root.id).await;
    stop_all(a, b, c).await;
}

/// Opens a tree through `broker` for `churn`: its root and holder.
async fn open_tree(broker: &mut Broker) -> (Agent, Root) {
    let orchestrator = Agent::generate();
    let root = broker
        .open_root(&orchestrator, RootSpec::for_bursts())
        .await;
    (orchestrator, root)
}

/// Events issued and ended through `broker` in the tree of `root`:
/// `children` children, each accepted, then all revoked with the root.
async fn churn(broker: &mut Broker, orchestrator: &Agent, root: &Root, children: usize) {
    for _ in 0..children {
        let worker = Agent::generate();
        let id = broker.issue(orchestrator, root.child(&worker, 10)).await;
        broker.accept(&worker, &id, None).await.expect("accepted");
    }
    broker
        .revoke(orchestrator, &root.id)
        .await
        .expect("root revoked");
}

/// One event as a test reads it: its cursor, the contract it is (or is
/// about), and for a contract its parent id (empty for a root).
type Seen = (u64, Vec<u8>, Option<Vec<u8>>);

/// Reads `want` events from `stream` (within a deadline).
async fn read_events(stream: &mut tonic::Streaming<pb::WatchResponse>, want: usize) -> Vec<Seen> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < want {
        let next = tokio::time::timeout_at(deadline, stream.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {want} events arrived", seen.len()))
            .expect("the stream stays open")
            .expect("an event");
        let (id, parent) = match next.event.expect("an event") {
            pb::watch_response::Event::Contract(sealed) => {
                let contract = decode_contract(&sealed);
                let id = delegation_broker::crypto::sha256(&sealed.payload).to_vec();
                (id, Some(contract.parent_id))
            }
            pb::watch_response::Event::Receipt(sealed) => {
                (decode_receipt(&sealed).contract_id, None)
            }
        };
        seen.push((next.cursor, id, parent));
    }
    seen
}

/// (e) Watch on A while B and C issue and end contracts concurrently
/// (over 1,000 events in several trees): each stream holds every event of
/// its tree exactly once, a child after its parent, in increasing cursor
/// order; resuming from any cursor on another replica continues with no
/// gap and no duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_on_one_replica_sees_every_replicas_events_once() {
    let (mut a, mut b, mut c) = three().await;
    // Each tree: its root, 60 children and their acceptances, and 61
    // revocations (the root's cascade).
    const CHILDREN: usize = 60;
    const TREES_EACH: usize = 3;
    const PER_TREE: usize = 1 + CHILDREN * 2 + CHILDREN + 1;
    const _: () = assert!(2 * TREES_EACH * PER_TREE >= 1_000);
    let mut trees = Vec::new();
    for (broker, writer) in [(&mut b, 0), (&mut c, 1)] {
        for _ in 0..TREES_EACH {
            trees.push((writer, open_tree(broker).await));
        }
    }
    // A watches every tree from its beginning while B and C write.
    let mut streams = Vec::new();
    for (_, (_, root)) in &trees {
        streams.push(a.watch(&root.id).await);
    }
    let (mut on_b, mut on_c): (Vec<_>, Vec<_>) = trees.into_iter().partition(|(w, _)| *w == 0);
    let write_b = tokio::spawn(async move {
        for (_, (orchestrator, root)) in &on_b {
            churn(&mut b, orchestrator, root, CHILDREN).await;
        }
        on_b.clear();
        b
    });
    let write_c = tokio::spawn(async move {
        for (_, (orchestrator, root)) in &on_c {
            churn(&mut c, orchestrator, root, CHILDREN).await;
        }
        on_c.clear();
        c
    });
    let mut seen = Vec::new();
    for stream in &mut streams {
        seen.push(read_events(stream, PER_TREE).await);
    }
    let mut b = write_b.await.unwrap();
    let c = write_c.await.unwrap();
    for events in &seen {
        let cursors: Vec<u64> = events.iter().map(|e| e.0).collect();
        assert!(
            cursors.windows(2).all(|w| w[0] < w[1]),
            "increasing, no duplicate"
        );
        let mut issued = std::collections::HashSet::new();
        for (_, id, parent) in events {
            if let Some(parent) = parent {
                assert!(
                    parent.is_empty() || issued.contains(parent),
                    "a child before its parent"
                );
                issued.insert(id.clone());
            }
        }
        assert_eq!(issued.len(), 1 + CHILDREN, "every contract of the tree");
        // Resume on another replica from several cursors: the rest, exactly.
        let root = events[0].1.clone();
        for from in [1, PER_TREE / 3, PER_TREE - 1] {
            let mut resumed = b.watch_from(&root, events[from - 1].0).await;
            let rest = read_events(&mut resumed, PER_TREE - from).await;
            assert_eq!(rest, events[from..].to_vec(), "no gap, no duplicate");
        }
    }
    // Nothing more arrives on a caught-up stream: every event was once.
    let extra = tokio::time::timeout(Duration::from_millis(300), streams[0].next()).await;
    assert!(extra.is_err(), "an event beyond the tree's: {extra:?}");
    stop_all(a, b, c).await;
}

/// (g) Forced contention: 96 siblings on one parent at once, spread over
/// three replicas, with budget for all: every one is issued (writers that
/// lose a race wait for the parent's row lock or redo their transaction),
/// no client sees a database error, and the ledger holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_one_parent_yields_only_issued_contracts() {
    let (mut a, b, c) = three().await;
    let orchestrator = Arc::new(Agent::generate());
    let spec = RootSpec::with(|s| (s.budget, s.max_children) = (10_000, 1_024));
    let root = a.open_root(&orchestrator, spec).await;
    let addrs = [a.addr.clone(), b.addr.clone(), c.addr.clone()];
    for outcome in race_siblings(&addrs, &orchestrator, &root, 96, 10).await {
        match outcome {
            Ok(outcome) => {
                outcome.issued();
            }
            Err(status) => panic!("no error reaches a client: {status:?}"),
        }
    }
    let ledger = a.ledger(&root.id).await;
    assert_eq!((ledger.reserved, ledger.open_children), (960, 96));
    a.assert_ledgers_balance(&root.id).await;
    stop_all(a, b, c).await;
}

/// UNAVAILABLE answers `delegate_until` workers retried (the one test
/// that counts them runs alone in its process under nextest).
static UNAVAILABLE_SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Delegations one `delegate_until` worker makes at most.
const MAX_PER_WORKER: usize = 80;

/// Polls `count` until it is at least `at_least` (within 30 s).
async fn wait_for_children(client: &mut broker_client::SessionClient, root: &[u8], at_least: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = count_children(client, root).await;
        if now >= at_least {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{now} of {at_least} children"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Delegations from `root` through `addr`, each retried with the same
/// signed request while the answer is UNAVAILABLE, until `stop` is set or
/// (when `give_up`) the replica is gone; the ids answered.
async fn delegate_until(
    addr: String,
    orchestrator: Arc<Agent>,
    root: (Vec<u8>, Vec<u8>),
    stop: Arc<std::sync::atomic::AtomicBool>,
    give_up: bool,
) -> Vec<Vec<u8>> {
    use std::sync::atomic::Ordering;
    let mut client = connect(&addr).await;
    let mut answered = Vec::new();
    // A root has at most 1,024 children: 12 workers stay under it.
    while !stop.load(Ordering::SeqCst) && answered.len() < MAX_PER_WORKER {
        let request = orchestrator.delegate(child(&root.0, &root.1, &Agent::generate(), 1));
        loop {
            match client.delegate(request.clone()).await {
                Ok(response) => {
                    let (id, _) = Outcome::from(response.into_inner().outcome.unwrap()).issued();
                    answered.push(id);
                    break;
                }
                Err(status) if give_up => {
                    // The replica was killed: its clients stop.
                    let _ = status;
                    return answered;
                }
                Err(status) => {
                    assert_eq!(
                        status.code(),
                        tonic::Code::Unavailable,
                        "only UNAVAILABLE while the database is away: {status:?}"
                    );
                    UNAVAILABLE_SEEN.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    answered
}

/// `count` replica processes on the database at `url`, each on a data
/// directory of its own: the directories (to restart on), the processes
/// and their addresses.
fn spawn_replicas(
    url: &str,
    count: usize,
) -> (
    Vec<tempfile::TempDir>,
    Vec<(crate::crash::Killed, String)>,
    Vec<String>,
) {
    let dirs: Vec<_> = (0..count).map(|_| tempfile::tempdir().unwrap()).collect();
    let processes: Vec<_> = dirs
        .iter()
        .map(|d| crate::crash::spawn_broker(d.path(), Some(url)))
        .collect();
    let addrs = processes.iter().map(|(_, addr)| addr.clone()).collect();
    (dirs, processes, addrs)
}

/// `delegate_until` workers from one root, spread over replicas.
struct Burst {
    orchestrator: Arc<Agent>,
    root: Vec<u8>,
    lineage: Vec<u8>,
    /// Set to stop the workers.
    stop: Arc<std::sync::atomic::AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<Vec<u8>>>>,
}

impl Burst {
    /// A root for bursts opened through `addrs[0]`, and `count` workers
    /// from it, worker `i` on `addrs[i % addrs.len()]`, giving up when its
    /// replica is gone if `give_up(i)`.
    async fn start(addrs: &[String], count: usize, give_up: impl Fn(usize) -> bool) -> Self {
        let orchestrator = Arc::new(Agent::generate());
        let spec = RootSpec::for_bursts();
        let root = open_root_on(&mut connect(&addrs[0]).await, &orchestrator, &spec)
            .await
            .contract_id;
        let lineage = spec.lineage();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers = (0..count)
            .map(|i| {
                tokio::spawn(delegate_until(
                    addrs[i % addrs.len()].clone(),
                    orchestrator.clone(),
                    (root.clone(), lineage.clone()),
                    stop.clone(),
                    give_up(i),
                ))
            })
            .collect();
        Self {
            orchestrator,
            root,
            lineage,
            stop,
            workers,
        }
    }

    /// Stops the workers; every id they were answered, each once.
    async fn finish(self) -> Vec<Vec<u8>> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut answered = Vec::new();
        for worker in self.workers {
            answered.extend(worker.await.unwrap());
        }
        let distinct: std::collections::HashSet<_> = answered.iter().collect();
        assert_eq!(distinct.len(), answered.len(), "an answer twice");
        answered
    }
}

/// (d) SIGKILL one of three replica processes during a burst spread over
/// all three: the other two go on serving, every contract a client got
/// an answer for is stored, the ledger equation holds, and the restarted
/// replica serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_loses_nothing_and_the_others_go_on() {
    let database = delegation_broker::store::postgres::testing::TestDatabase::create().await;
    let (dirs, mut processes, addrs) = spawn_replicas(&database.url, 3);
    // The workers on the replica to be killed stop with it.
    let burst = Burst::start(&addrs, 12, |i| i % 3 == 2).await;
    let (orchestrator, root, lineage) = (
        burst.orchestrator.clone(),
        burst.root.clone(),
        burst.lineage.clone(),
    );
    let mut watcher = connect_as(&addrs[0], &orchestrator).await;
    wait_for_children(&mut watcher, &root, 150).await;
    let (killed, _) = &mut processes[2];
    killed.0.kill().unwrap(); // SIGKILL
    killed.0.wait().unwrap();
    let at_kill = count_children(&mut watcher, &root).await;
    // The other replicas go on serving.
    wait_for_children(&mut watcher, &root, at_kill + 100).await;
    let answered = burst.finish().await;
    assert!(answered.len() > 50, "a burst: {}", answered.len());
    let (restarted, restarted_addr) =
        crate::crash::spawn_broker(dirs[2].path(), Some(&database.url));
    let mut reader = crate::crash::LedgerCheck {
        client: connect_as(&restarted_addr, &orchestrator).await,
    };
    assert_stored(&mut reader.client, &answered).await;
    // Each answer reserved once (the ledgers sum up); the killed replica
    // may have committed requests it never answered.
    assert!(reader.assert_balanced(&root).await > answered.len());
    // The restarted replica serves writes again.
    let mut fresh = connect(&restarted_addr).await;
    fresh
        .delegate(orchestrator.delegate(child(&root, &lineage, &Agent::generate(), 1)))
        .await
        .expect("the restarted replica issues");
    drop((processes, restarted));
    drop(database);
}

/// The open children of `root` (its ledger), read through `client`.
async fn count_children(client: &mut broker_client::SessionClient, root: &[u8]) -> u32 {
    state_via(client, root)
        .await
        .ledger
        .expect("a ledger")
        .open_children
}

/// A PostgreSQL server of a test's own (`scripts/pg.sh`), for a test that
/// restarts it: the test command's shared server must stay up for the
/// others. Stopped and removed when dropped.
struct PrivateServer {
    dir: tempfile::TempDir,
    url: String,
}

impl PrivateServer {
    /// Runs `scripts/pg.sh VERB DIR ARGS`, which must succeed; its stdout.
    fn pg_sh(verb: &str, dir: &std::path::Path, args: &[&str]) -> String {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg.sh");
        stdout_of(
            std::process::Command::new(script)
                .arg(verb)
                .arg(dir)
                .args(args),
        )
    }

    fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("pg")
            .tempdir_in("/tmp")
            .unwrap();
        let line = Self::pg_sh("start", dir.path(), &[]);
        let admin = line
            .trim()
            .strip_prefix("export BROKER_TEST_POSTGRES_URL=")
            .expect("the URL line")
            .to_owned();
        let base = admin.rsplit_once('/').unwrap().0.to_owned();
        Self {
            dir,
            url: format!("{base}/postgres"),
        }
    }

    /// `pg_ctl ARGS` on this server (`scripts/pg.sh ctl`).
    fn ctl(&self, args: &[&str]) {
        Self::pg_sh("ctl", self.dir.path(), args);
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        // Not `pg_sh`: a failed stop must not panic in a drop.
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg.sh");
        let _ = std::process::Command::new(script)
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}

/// (f) The PostgreSQL server stops for 3 s during load: meanwhile the replicas
/// answer UNAVAILABLE (the clients retry with the same nonce), afterwards
/// they reconnect by themselves; nothing acknowledged is lost, nothing is
/// reserved twice, and health says NOT_SERVING while the database is away
/// only as long as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_is_survived_without_loss() {
    use std::sync::atomic::Ordering;
    let server = PrivateServer::start();
    let (_dirs, processes, addrs) = spawn_replicas(&server.url, 2);
    let burst = Burst::start(&addrs, 8, |_| false).await;
    let (orchestrator, root) = (burst.orchestrator.clone(), burst.root.clone());
    // Health, polled through the outage.
    let health_addr = addrs[0].clone();
    let health_stop = burst.stop.clone();
    let health = tokio::spawn(async move {
        use tonic_health::pb::health_client::HealthClient;
        let channel = channel(&health_addr).await;
        let mut client = HealthClient::new(channel);
        let mut statuses = Vec::new();
        while !health_stop.load(Ordering::SeqCst) {
            if let Ok(answer) = client
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                let status = answer.into_inner().status;
                if statuses.last() != Some(&status) {
                    statuses.push(status);
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        statuses
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Down for longer than a replica waits for a connection (2 s), so
    // the outage is seen; then back on the same port.
    server.ctl(&["stop", "-m", "fast", "-w"]);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let log = server.dir.path().join("log");
    server.ctl(&["start", "-w", "-l", log.to_str().unwrap()]);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    burst.stop.store(true, Ordering::SeqCst);
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let statuses = health.await.unwrap();
    assert_eq!(
        statuses,
        vec![serving, not_serving, serving],
        "health follows the database"
    );
    assert!(
        UNAVAILABLE_SEEN.load(Ordering::SeqCst) > 0,
        "the outage was seen (and retried)"
    );
    let answered = burst.finish().await;
    let mut reader = crate::crash::LedgerCheck {
        client: connect_as(&addrs[1], &orchestrator).await,
    };
    assert_stored(&mut reader.client, &answered).await;
    // Retried with the same nonce through the outage: each once.
    assert_eq!(reader.assert_balanced(&root).await, 1 + answered.len());
    drop(processes);
}

/// Background work with three replicas: every replica's expiry sweeper
/// runs, and still each overdue contract expires once, with one receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sweeper_runs_and_each_contract_expires_once() {
    let fast = |config: &mut delegation_broker::config::Config| {
        config.limits.expiry_sweep_interval_ms = 20;
    };
    let mut a = Broker::start_replicated_with(fast).await;
    let b = Broker::start_replica_with(&a, fast).await;
    let c = Broker::start_replica_with(&a, fast).await;
    let orchestrator = Agent::generate();
    let root = a.open_root(&orchestrator, RootSpec::default()).await;
    let mut children = Vec::new();
    for _ in 0..12 {
        let id = a
            .issue(&orchestrator, root.child(&Agent::generate(), 5))
            .await;
        children.push(id);
    }
    // Past every deadline, on every replica's clock.
    for broker in [&a, &b, &c] {
        broker.clock.advance_ms(2 * HOUR_MS);
    }
    let expired = pb::ContractStatus::Expired as i32;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while a.state(&root.id).await.status != expired {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweepers expire the root"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let every sweeper pass again: nothing more may be written.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut stream = a.watch(&root.id).await;
    let events = read_events(&mut stream, 1 + children.len() * 2 + 1).await;
    let mut expiries: std::collections::HashMap<Vec<u8>, usize> = Default::default();
    for (_, id, parent) in &events {
        if parent.is_none() {
            *expiries.entry(id.clone()).or_default() += 1;
        }
    }
    assert_eq!(expiries.len(), 1 + children.len(), "every contract expired");
    assert!(
        expiries.values().all(|n| *n == 1),
        "once each: {expiries:?}"
    );
    let extra = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
    assert!(extra.is_err(), "a second expiry: {extra:?}");
    for id in &children {
        assert_eq!(a.state(id).await.status, expired);
    }
    a.assert_ledgers_balance(&root.id).await;
    stop_all(a, b, c).await;
}

/// `delegation-broker migrate` brings a database up to date for replicas
/// started with `--no-migrate`; a replica started with `--no-migrate` on
/// a database without the schema refuses to start and says what to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_once_then_serve_without_migrating() {
    let database = delegation_broker::store::postgres::testing::TestDatabase::create().await;
    let binary = env!("CARGO_BIN_EXE_delegation-broker");
    let dir = tempfile::tempdir().unwrap();
    let serve = || {
        let mut command = std::process::Command::new(binary);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--no-migrate"])
            .arg("--data-dir")
            .arg(dir.path())
            .args(["--database-url", &database.url]);
        command
    };
    let refused = serve().env("BROKER_LOG", "error").output().unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("delegation-broker migrate"), "{stderr}");
    // A failed start creates nothing: no signing key, no "listening".
    assert!(
        !dir.path().join("broker_signing_key").exists(),
        "a failed start wrote a key"
    );
    assert!(
        !String::from_utf8_lossy(&refused.stdout).contains("listening"),
        "{refused:?}"
    );
    // Exit status 0 when up to date, 3 while migrations are pending.
    let status = |expect: &[&str]| {
        let out = std::process::Command::new(binary)
            .args(["migrate", "--status", "--database-url", &database.url])
            .output()
            .unwrap();
        let pending = expect.iter().any(|line| line.starts_with("pending"));
        assert_eq!(
            out.status.code(),
            Some(if pending { 3 } else { 0 }),
            "{out:?}"
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        for line in expect {
            assert!(text.contains(line), "{line:?} in:\n{text}");
        }
        text
    };
    let before = status(&["current version: 0", "pending: 0001 "]);
    let latest = before
        .lines()
        .find_map(|l| l.strip_prefix("latest version: "))
        .expect("the latest version")
        .to_owned();
    // --status changed nothing.
    status(&["current version: 0", "pending: 0001 "]);
    let json = std::process::Command::new(binary)
        .args([
            "migrate",
            "--status",
            "--json",
            "--database-url",
            &database.url,
        ])
        .output()
        .unwrap();
    assert_eq!(json.status.code(), Some(3), "{json:?}");
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(json["current"], 0);
    assert_eq!(json["latest"].to_string(), latest);
    assert_eq!(json["pending"][0]["version"], 1);
    let migrate = || {
        std::process::Command::new(binary)
            .args(["migrate", "--database-url", &database.url])
            .output()
            .unwrap()
    };
    let migrated = migrate();
    assert!(migrated.status.success(), "{migrated:?}");
    let applied = String::from_utf8_lossy(&migrated.stdout);
    assert!(applied.contains("applied 0001 "), "{applied}");
    assert!(
        applied.contains(&format!("is at version {latest} (latest)")),
        "{applied}"
    );
    status(&[&format!("current version: {latest}"), "up to date"]);
    // Twice is fine: nothing is pending.
    let again = migrate();
    assert!(again.status.success(), "{again:?}");
    let (process, addr) =
        crate::crash::Killed::announcing(serve().env("BROKER_LOG", "warn"), "listening");
    let orchestrator = Agent::generate();
    open_root_on(
        &mut connect(&addr).await,
        &orchestrator,
        &RootSpec::default(),
    )
    .await;
    drop(process);
}

/// Key rotation with replicas running: replica A is stopped, rotates its
/// key and starts again while B serves throughout. B then publishes A's
/// old key as retired (with its retirement time) and A's new one as
/// current: a contract A signed before the rotation and one it signed
/// after both verify with B's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_rotates_its_key_while_the_others_serve() {
    let database = delegation_broker::store::postgres::testing::TestDatabase::create().await;
    let binary = env!("CARGO_BIN_EXE_delegation-broker");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, addr_a) = crate::crash::spawn_broker(dir_a.path(), Some(&database.url));
    let (_b, addr_b) = crate::crash::spawn_broker(dir_b.path(), Some(&database.url));
    let orchestrator = Agent::generate();
    let open = |addr: String| {
        let body = orchestrator.open_root(RootSpec::default().body());
        async move {
            let issued = connect(&addr)
                .await
                .open_root(body)
                .await
                .expect("issued")
                .into_inner()
                .issued
                .unwrap();
            issued.contract.unwrap()
        }
    };
    let before = open(addr_a.clone()).await;
    drop(a); // stopped
    let rotated = std::process::Command::new(binary)
        .args(["rotate-key", "--data-dir"])
        .arg(dir_a.path())
        .output()
        .unwrap();
    assert!(rotated.status.success(), "{rotated:?}");
    let (_a, addr_a) = crate::crash::spawn_broker(dir_a.path(), Some(&database.url));
    let after = open(addr_a).await;
    let old_id = decode_contract(&before).broker_key_id;
    let new_id = decode_contract(&after).broker_key_id;
    assert_ne!(old_id, new_id);
    // B publishes both (its registry copy is at most 100 ms old).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let keys = published_keys(&addr_b).await;
    let old = keys
        .iter()
        .find(|k| k.key_id == old_id)
        .expect("the old key");
    assert!(!old.current && old.retired_at_ms > 0, "{old:?}");
    let new = keys
        .iter()
        .find(|k| k.key_id == new_id)
        .expect("the new key");
    assert!(new.current && new.retired_at_ms == 0, "{new:?}");
    verify_with_keys(&before, payload_type::CONTRACT, &keys, &old_id);
    verify_with_keys(&after, payload_type::CONTRACT, &keys, &new_id);
}

/// Asserts no replica of `addrs` opens a session naming the retired key
/// `key_id`.
async fn assert_no_session(addrs: &[&String], agent: &Agent, key_id: &str) {
    for addr in addrs {
        let refused = connect(addr)
            .await
            .open_session(agent.open_session(key_id))
            .await
            .expect_err("a retired key opens no session");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    }
}

/// Replicas heartbeat their keys. A replica
/// killed and not restarted has its key retired by the others after
/// `limits.replica_key_ttl_ms`: no new session is accepted with it, what
/// it signed still verifies, `keys list` shows it retired by "ttl". Two
/// replicas given one `--signing-key-file` publish one key; `keys retire`
/// retires it for good, and a replica holding it can no longer start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_key_is_retired_and_operators_retire_keys() {
    use broker_client::Agent;
    let database = delegation_broker::store::postgres::testing::TestDatabase::migrated().await;
    let binary = env!("CARGO_BIN_EXE_delegation-broker");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, "[limits]\nreplica_key_ttl_ms = 2000\n").unwrap();
    let shared = Agent::generate();
    let key_file = dir.path().join("shared.key");
    write_key_file(&key_file, &shared.seed());
    let spawn = |name: &str, key_file: Option<&std::path::Path>| {
        let mut extra = vec![
            "--config".to_owned(),
            config.display().to_string(),
            "--database-url".to_owned(),
            database.url.clone(),
        ];
        if let Some(file) = key_file {
            extra.extend(["--signing-key-file".to_owned(), file.display().to_string()]);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        crate::operations::spawn_serve(&dir.path().join(name), &extra)
    };
    let (_a, addr_a) = spawn("a", Some(&key_file));
    let (_b, addr_b) = spawn("b", Some(&key_file));
    let (mut c, addr_c) = spawn("c", None);
    // The shared key is not written to either data directory.
    assert!(!dir.path().join("a/broker_signing_key").exists());
    let shared_id = delegation_broker::crypto::key_id(&shared.public_key());
    let keys_of = |addr: String| async move { published_keys(&addr).await };
    // C's key: the one key that is neither the shared one.
    let mut c_id = String::new();
    for _ in 0..100 {
        let keys = keys_of(addr_a.clone()).await;
        if let Some(k) = keys.iter().find(|k| k.key_id != shared_id && k.current) {
            c_id = k.key_id.clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!c_id.is_empty(), "A publishes C's key");
    let keys = keys_of(addr_b.clone()).await;
    assert_eq!(
        keys.iter().filter(|k| k.key_id == shared_id).count(),
        1,
        "two replicas, one shared key: {keys:?}"
    );

    // C issues a root and a child (signed with its key), then dies.
    let orchestrator = Agent::generate();
    let mut through_c = connect_as(&addr_c, &orchestrator).await;
    let spec = RootSpec::default();
    let root = open_root_on(&mut through_c, &orchestrator, &spec).await;
    c.0.kill().unwrap();
    c.0.wait().unwrap();

    let retired = {
        let mut found = None;
        for _ in 0..200 {
            let keys = keys_of(addr_a.clone()).await;
            if let Some(k) = keys.iter().find(|k| k.key_id == c_id && !k.current) {
                found = Some(k.clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        found.expect("C's key retired within 20 s of a 2 s TTL")
    };
    assert!(retired.retired_at_ms > 0, "{retired:?}");
    // No new session with it, on either live replica (they refresh their
    // published keys every 500 ms).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_no_session(&[&addr_a, &addr_b], &orchestrator, &c_id).await;
    // What C signed still verifies with the keys A publishes.
    let mut through_a = connect_as(&addr_a, &orchestrator).await;
    let chain = through_a
        .get_chain(pb::GetChainRequest {
            contract_id: root.contract_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let sealed: Vec<pb::Sealed> = chain
        .chain
        .iter()
        .map(|state| state.contract.clone().unwrap())
        .collect();
    let published = keys_of(addr_a.clone()).await;
    delegation_broker::chain::verify_chain(
        &sealed,
        &delegation_broker::chain::BrokerKeys::from_published(&published),
        None,
    )
    .expect("a dead replica's contracts verify");

    let keys = |args: &[&str]| {
        let out = std::process::Command::new(binary)
            .arg("keys")
            .args(args)
            .args(["--database-url", &database.url])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, listed, err) = keys(&["list"]);
    assert!(ok, "{err}");
    let line = |id: &str| {
        listed
            .lines()
            .find(|l| l.starts_with(id))
            .unwrap_or_else(|| panic!("{id} in:\n{listed}"))
            .to_owned()
    };
    let c_line = line(&c_id);
    assert!(
        c_line.contains(" retired ") && c_line.contains(" ttl "),
        "{c_line}"
    );
    assert!(line(&shared_id).contains(" current "), "{listed}");

    // An operator retires the shared key: for good.
    let (ok, said, err) = keys(&["retire", &shared_id]);
    assert!(ok && said.contains("retired"), "{said}{err}");
    let (ok, listed, _) = keys(&["list"]);
    assert!(ok);
    let shared_line = listed.lines().find(|l| l.starts_with(&shared_id)).unwrap();
    assert!(shared_line.contains(" operator "), "{listed}");
    // Not even the replicas holding it accept it for new sessions (they
    // re-read the registry every 500 ms).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_no_session(&[&addr_a, &addr_b], &orchestrator, &shared_id).await;
    // A session the shared key sealed before, already used (and so
    // remembered as verified), stops working too.
    let stale = through_a
        .get_contract(contract_request(&root.contract_id))
        .await
        .expect_err("a session of a retired key reads nothing");
    assert_eq!(stale.code(), tonic::Code::Unauthenticated, "{stale:?}");
    let (ok, _, err) = keys(&["retire", "ed25519:00"]);
    assert!(!ok && err.contains("KEY_ID"), "{err}");
    let refused = std::process::Command::new(binary)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("d"))
        .args(["--database-url", &database.url])
        .args(["--signing-key-file", key_file.to_str().unwrap()])
        .env("BROKER_LOG", "error")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("retired by an operator"), "{stderr}");
}
