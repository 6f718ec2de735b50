//! The SQLite backend's own behaviours: migrations, the writer and its
//! group commit, durability, judging limits, checkpoints, audit budgets.

use super::*;
use crate::batch::KnownMap;
use crate::limits::sqlite::MAX_PRUNED_PER_PASS;
use crate::suite::{
    TEST_TIMESTAMP_MS, TunedOptions, issued, meta, test_child, test_root, test_stamper,
};
use broker_wire::clock::{Clock, SystemClock};
use sqlx::Row;
use std::sync::Mutex;

/// A store with `options` and the test key, on `clock`.
async fn open_with(options: SqliteOptions, clock: Arc<dyn Clock>) -> SqliteStore {
    SqliteStore::open(options, test_stamper(), clock)
        .await
        .expect("open")
}

/// A store on `path` with the test options and the system clock.
async fn open_test_store(path: PathBuf) -> SqliteStore {
    open_with(test_options(path), Arc::new(SystemClock)).await
}

/// A connection of the test's own to the database at `path`, created
/// (in WAL mode) if missing.
async fn raw_connection(path: &std::path::Path) -> SqliteConnection {
    crate::sqlite::before_sqlite();
    let connect = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    SqliteConnection::connect_with(&connect)
        .await
        .expect("connect")
}

/// Runs `sql` with `binds` as its parameters, in order.
async fn execute_with(conn: &mut SqliteConnection, sql: &'static str, binds: &[&[u8]]) {
    let mut query = sqlx::query(sql);
    for bind in binds {
        query = query.bind(*bind);
    }
    query.execute(conn).await.expect(sql);
}

/// How many contracts the store holds, read without waiting for syncs.
async fn contracts_stored(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
        .fetch_one(&store.sql.reader)
        .await
        .expect("count")
}

/// A gate WAL syncs wait at while it is shut; open at first.
#[derive(Clone)]
struct SyncGate(Arc<(Mutex<bool>, std::sync::Condvar)>);

impl SyncGate {
    fn new() -> Self {
        Self(Arc::new((Mutex::new(true), std::sync::Condvar::new())))
    }

    fn set(&self, open: bool) {
        let (state, changed) = &*self.0;
        *state.lock().expect("gate") = open;
        changed.notify_all();
    }

    /// Waits until the gate is open, calling `shut` first if it is not.
    fn pass(&self, shut: impl FnOnce()) {
        let (state, changed) = &*self.0;
        let mut open = state.lock().expect("gate");
        if !*open {
            shut();
        }
        while !*open {
            open = changed.wait(open).expect("gate");
        }
    }
}

/// The store suite (`store::suite`) against SQLite.
async fn open_suite_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open_test_store(dir.path().join("broker.sqlite3")).await;
    (store, dir)
}

crate::suite::tuned_options!(SqliteOptions);

/// A store with the tuned options set, for `tuned_suite!`.
async fn open_tuned_store(tuned: crate::suite::Tuned) -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let options = test_options(path).tuned(tuned);
    (open_with(options, Arc::new(SystemClock)).await, dir)
}

crate::suite::tuned_suite!(tuned, super::open_tuned_store);

/// `suite::drains::a_drain_is_frozen_stepped_and_resumed` on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_is_frozen_stepped_and_resumed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let clock = Arc::new(broker_wire::clock::OffsetClock::default());
    let open = |tuned| open_with(test_options(path.clone()).tuned(tuned), clock.clone());
    crate::suite::drains::a_drain_is_frozen_stepped_and_resumed(clock.clone(), open).await;
}

crate::suite::store_suite!(suite, super::open_suite_store);

/// A database written by schema 1 (envelopes inside contract rows, the
/// request log as a rowid table) migrates through every schema change
/// with nothing lost — the contract keeps its envelope, its labels are
/// indexed, the request log keeps its answer — and is then refused with
/// a clear error rather than served: its contracts are signed in the
/// format before linear chains (migration 10), which cannot be
/// converted.
#[tokio::test]
async fn a_schema_1_database_migrates_without_losing_rows_then_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let (id, agent, nonce, digest) = ([7u8; 32], [9u8; 32], vec![5u8; 16], [3u8; 32]);
    let envelope = b"an old-format signed contract".to_vec();
    {
        let mut conn = raw_connection(&path).await;
        sqlx::migrate!("./migrations/sqlite")
            .run_to(1, &mut conn)
            .await
            .expect("schema 1");
        execute_with(
            &mut conn,
            "INSERT INTO contracts (seq, id, root_seq, root_id, depth, delegate_key, liability, \
             intent_lineage_hash, cumulative_trust_ppm, effective_predicate, deadline_ms, \
             write_scope, max_depth, min_cumulative_trust_ppm, max_children, retry_headroom, \
             envelope, issued_at_ms, status, budget, reserved, spent, open_children, labels) \
             VALUES (1, $1, 1, $1, 0, $2, 1, $1, 1000000, 'true', 1, '[]', 4, 0, 8, 0, $3, 1, \
             1, 100, 0, 0, 0, '{\"arm\":\"a\",\"note\":\"say \\\"hi\\\" \\\\ é\"}')",
            &[&id, &agent, &envelope],
        )
        .await;
        execute_with(
            &mut conn,
            "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
             VALUES ($1, $2, $3, 1, $4, 1)",
            &[&agent, &nonce, &digest, &id],
        )
        .await;
        sqlx::migrate!("./migrations/sqlite")
            .run_to(LINEAR_FORMAT_MIGRATION - 1, &mut conn)
            .await
            .expect("schema 9");
        let (kept, budget): (Vec<u8>, i64) =
            sqlx::query_as("SELECT envelope, budget FROM contracts_with_envelope WHERE id = $1")
                .bind(id.as_slice())
                .fetch_one(&mut conn)
                .await
                .expect("the contract");
        assert_eq!((kept, budget), (envelope.clone(), 100));
        // Its labels were indexed by migration 5.
        let labels: Vec<(String, String)> =
            sqlx::query_as("SELECT label_key, label_value FROM run_labels ORDER BY label_key")
                .fetch_all(&mut conn)
                .await
                .expect("labels");
        assert_eq!(
            labels,
            [
                ("arm".to_owned(), "a".to_owned()),
                ("note".to_owned(), "say \"hi\" \\ é".to_owned())
            ]
        );
        let logged: (Vec<u8>, i64, Vec<u8>) = sqlx::query_as(
            "SELECT body_digest, outcome, ref_id FROM requests WHERE agent_key = $1 AND nonce = $2",
        )
        .bind(agent.as_slice())
        .bind(nonce.as_slice())
        .fetch_one(&mut conn)
        .await
        .expect("the request log");
        assert_eq!(logged, (digest.to_vec(), 1, id.to_vec()));
        conn.close().await.expect("close");
    }
    let refused = SqliteStore::open(test_options(path), test_stamper(), Arc::new(SystemClock))
        .await
        .err()
        .expect("an old-format database is refused");
    assert!(
        matches!(&refused, StoreError::Backend(m) if m.contains("1 contracts signed in the format used before linear chains")),
        "{refused}"
    );
}

/// Migration 7 puts an open contract's own metered units into its
/// spent once, even where the old late-Accept bug had already written
/// them in: spent is recomputed (own metered + ended children's spent).
#[tokio::test]
async fn migration_7_charges_metered_units_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let mut conn = raw_connection(&dir.path().join("broker.sqlite3")).await;
        sqlx::migrate!("./migrations/sqlite")
            .run_to(6, &mut conn)
            .await
            .expect("schema 6");
        // (seq, parent, status, budget, reserved, spent, open children,
        // metered units): root → A (accepted, metered 2, one ended
        // child C that spent 7) → B (accepted, metered 4, whose spent
        // the old bug already set to 4 when A accepted late).
        type Row = (i64, Option<i64>, i64, i64, i64, i64, i64, i64);
        let rows: [Row; 4] = [
            (1, None, 2, 100, 60, 0, 1, 0),
            (2, Some(1), 2, 60, 30, 7, 1, 2),
            (3, Some(2), 2, 30, 0, 4, 0, 4),
            (4, Some(2), 3, 10, 0, 7, 0, 0),
        ];
        for (seq, parent, status, budget, reserved, spent, open, units) in rows {
            sqlx::query(
                "INSERT INTO contracts (seq, id, parent_seq, root_seq, root_id, depth, delegate_key, \
                 liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
                 deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
                 retry_headroom, issued_at_ms, status, budget, reserved, spent, open_children, \
                 observed_units, metered) \
                 VALUES ($1, $2, $3, 1, $2, 0, $2, 1, $2, 1000000, '', 1, '[]', 4, 0, 8, 0, 1, \
                 $4, $5, $6, $7, $8, $9, $10)",
            )
            .bind(seq)
            .bind(vec![u8::try_from(seq).expect("small"); 32])
            .bind(parent)
            .bind(status)
            .bind(budget)
            .bind(reserved)
            .bind(spent)
            .bind(open)
            .bind(units)
            .bind(i64::from(units > 0))
            .execute(&mut conn)
            .await
            .expect("schema-6 contract");
        }
        sqlx::migrate!("./migrations/sqlite")
            .run(&mut conn)
            .await
            .expect("migrated");
        let spent: Vec<(i64, i64)> =
            sqlx::query_as("SELECT seq, spent FROM contracts ORDER BY seq")
                .fetch_all(&mut conn)
                .await
                .expect("read");
        // B: 4 once (not 8); A: its own 2 plus C's 7; C ended: as it was.
        assert_eq!(spent, [(1, 0), (2, 9), (3, 4), (4, 7)]);
    }
}

fn test_options(path: PathBuf) -> SqliteOptions {
    SqliteOptions {
        path,
        queue_depth: 256,
        max_batch: 16,
        read_connections: 1,
        wal_restart_bytes: WAL_RESTART_BYTES,
        checkpoint_interval: crate::sqlite::CHECKPOINT_INTERVAL,
        request_log_retention_ms: i64::MAX,
        // See `suite::TEST_TIMESTAMP_MS`.
        timestamp_window_ms: 0,
        max_audit_rows: MAX_AUDIT_ROWS,
        max_audit_bytes: MAX_AUDIT_BYTES,
        before_wal_sync: None,
        before_judge: None,
        judgment_deadline_ms: broker_domain::limits::JUDGMENT_DEADLINE_MS,
        cascade_step_rows: crate::limits::DEFAULT_CASCADE_STEP_ROWS,
        drainer: true,
        tenants: Default::default(),
        metrics: None,
    }
}

/// A batch the writer cannot vouch for (its requests' timestamps are older
/// than the recent-request set covers) takes the careful path: it reads
/// the request log first, and its rows go through the writer's own
/// statements (`raw`) in one transaction. They must be committed with it: the child needs the root's row, the retry finds the
/// root's log entry, and a reuse of the key is refused.
#[tokio::test]
async fn the_careful_path_commits_its_rows_through_the_writers_statements() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open_test_store(dir.path().join("broker.sqlite3")).await;
    let old = RequestMeta {
        timestamp_ms: 0,
        ..meta(9, 3)
    };
    let first = store.open_root(test_root(old.clone())).await.expect("root");
    assert!(!first.replayed);
    let Outcome::Issued { id: root, .. } = first.outcome else {
        panic!("a root is issued");
    };
    let child = NewChild {
        request: RequestMeta {
            timestamp_ms: 0,
            ..meta(9, 4)
        },
        ..test_child(9, 4, root, 8, "true")
    };
    issued(store.delegate(child).await);
    let again = store
        .open_root(test_root(old.clone()))
        .await
        .expect("retry");
    assert!(again.replayed, "answered from the request log");
    assert!(matches!(again.outcome, Outcome::Issued { id, .. } if id == root));
    let reused = RequestMeta {
        digest: [0xAB; 32],
        ..old
    };
    assert!(matches!(
        store.open_root(test_root(reused)).await,
        Err(StoreError::NonceReused)
    ));
}

/// After a restart the writer's recent-request set is empty, so a
/// retry takes the fast path, meets its own request-log row and must be
/// redone the careful way: answered from the log, nothing issued twice.
/// A reused nonce is refused as such even where the fast plan alone
/// would have answered "unknown parent". (Each key below is the first
/// the reopened writer sees, so each takes the fast path.)
#[tokio::test]
async fn requests_the_writer_forgot_are_still_answered_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let request = RequestMeta {
        agent: [9u8; 32],
        nonce: vec![5u8; 16],
        digest: [3u8; 32],
        timestamp_ms: TEST_TIMESTAMP_MS,
    };
    let other = RequestMeta {
        nonce: vec![6u8; 16],
        ..request.clone()
    };
    let first = {
        let store = open_test_store(path.clone()).await;
        store
            .open_root(test_root(other.clone()))
            .await
            .expect("root");
        let first = store
            .open_root(test_root(request.clone()))
            .await
            .expect("root");
        let Outcome::Issued { id: root, .. } = first.outcome else {
            panic!("a root is issued");
        };
        issued(store.delegate(test_child(9, 7, root, 8, "true")).await);
        first
    };
    assert!(!first.replayed);
    let Outcome::Issued { id, .. } = first.outcome else {
        panic!("a root is issued");
    };
    let store = open_test_store(path.clone()).await;
    let reused = RequestMeta {
        digest: [4u8; 32],
        ..request.clone()
    };
    // The fast plan answers this one "unknown parent" and writes no log
    // row, so only the lookup of its key finds the reuse.
    let orphan = NewChild {
        request: RequestMeta {
            digest: [4u8; 32],
            ..other.clone()
        },
        ..test_child(9, 6, [0xEE; 32], 8, "true")
    };
    assert!(matches!(
        store.delegate(orphan).await,
        Err(StoreError::NonceReused)
    ));
    let again = store
        .open_root(test_root(request.clone()))
        .await
        .expect("retry");
    assert!(again.replayed, "answered from the request log");
    assert!(matches!(again.outcome, Outcome::Issued { id: same, .. } if same == id));
    assert!(matches!(
        store.open_root(test_root(reused.clone())).await,
        Err(StoreError::NonceReused)
    ));
    // A forgotten Delegate retry: the fast plan reserved budget in the
    // writer's cache before its insert failed; that must not stick.
    let child_again = store
        .delegate(test_child(9, 7, id, 8, "true"))
        .await
        .expect("retry");
    assert!(child_again.replayed);
    issued(store.delegate(test_child(9, 8, id, 8, "true")).await);
    let root = crate::suite::stored(&store, id).await;
    assert_eq!(
        (root.ledger.reserved, root.ledger.open_children),
        (20, 2),
        "two children of 10, the retry reserved nothing"
    );
    assert_eq!(
        contracts_stored(&store).await,
        4,
        "the retries issued nothing"
    );
}

/// After a restart the writer's recent-request set is empty, so a
/// lifecycle retry is decided without reading the request log first
/// (`Lookups::IfSeen`). A retry the decision refuses (the Accept: already
/// accepted) is looked up before it is answered; one the decision would
/// carry out again (the record) meets its own log row and the batch is
/// redone reading the log first. Both are answered from the log, and the
/// units are charged once.
#[tokio::test]
async fn lifecycle_retries_the_writer_forgot_are_still_answered_once() {
    const HOST: u8 = 30;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let record = || broker_wire::command::Action::Record {
        observations: vec![crate::suite::observation(
            pb::ObservationKind::ToolCall,
            "",
            3,
        )],
    };
    let receipt_id = |answer: &Answer| match &answer.outcome {
        Outcome::Receipt { receipt_id, .. } => *receipt_id,
        Outcome::Issued { .. } => panic!("a receipt"),
    };
    let (child, accepted, recorded) = {
        let store = open_test_store(path.clone()).await;
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let child = issued(store.delegate(test_child(9, 2, root, 8, "true")).await);
        let accept = crate::suite::accept_hosted_by(HOST);
        let accepted = crate::suite::act(&store, 8, 3, child, accept)
            .await
            .expect("accepted");
        let recorded = crate::suite::act(&store, HOST, 4, child, record())
            .await
            .expect("recorded");
        (child, receipt_id(&accepted), receipt_id(&recorded))
    };
    let store = open_test_store(path).await;
    let accept = crate::suite::accept_hosted_by(HOST);
    let again = crate::suite::act(&store, 8, 3, child, accept)
        .await
        .expect("the Accept's retry");
    assert!(again.replayed, "answered from the request log");
    assert_eq!(receipt_id(&again), accepted);
    let again = crate::suite::act(&store, HOST, 4, child, record())
        .await
        .expect("the record's retry");
    assert!(again.replayed, "answered from the request log");
    assert_eq!(receipt_id(&again), recorded);
    assert_eq!(
        crate::suite::stored(&store, child).await.ledger.spent,
        3,
        "the retry charged nothing"
    );
    crate::suite::act(&store, HOST, 5, child, record())
        .await
        .expect("a new record");
    assert_eq!(crate::suite::stored(&store, child).await.ledger.spent, 6);
}

/// A batch planned while the writer holds SQLite's handle whose plan
/// answers a command with an error (it writes no request-log row) must
/// still look that command's key up before it is written
/// (`apply::held_fast`): a nonce the log holds with another body
/// is refused as reused, not answered with the plan's error.
#[tokio::test]
async fn a_held_batch_looks_up_the_keys_its_plan_answered_with_an_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let logged = meta(9, 5);
    let root = {
        let store = open_test_store(path.clone()).await;
        let mut hosted_only = test_root(meta(9, 1));
        hosted_only.policy.require_host = true;
        let root = issued(store.open_root(hosted_only).await);
        issued(store.open_root(test_root(logged.clone())).await);
        root
    };
    let store = open_test_store(path).await;
    // The reopened writer's cache is empty: this batch reads the root
    // through sqlx, and leaves it cached.
    let hosted = NewChild {
        host: Some([7u8; 32]),
        ..test_child(9, 2, root, 8, "true")
    };
    issued(store.delegate(hosted).await);
    // Planned with the handle held: no host named, so the plan answers
    // "invalid"; the log holds its key with another body.
    let reuse = NewChild {
        request: RequestMeta {
            digest: [4u8; 32],
            ..logged
        },
        ..test_child(9, 5, root, 8, "true")
    };
    assert!(matches!(
        store.delegate(reuse).await,
        Err(StoreError::NonceReused)
    ));
    // Without the reuse the plan's own answer stands.
    let unhosted = test_child(9, 6, root, 8, "true");
    assert!(matches!(
        store.delegate(unhosted).await,
        Err(StoreError::Invalid(_))
    ));
}

/// Requests at once after a restart — retries the writer forgot, new
/// requests, and duplicates among the new ones — share batches (the
/// fast path's failure then redoes several commands at once); each is
/// answered once and the parent's ledger counts each child once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_and_new_requests_are_each_answered_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let (root, earlier) = {
        let store = open_test_store(path.clone()).await;
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let mut earlier = Vec::new();
        for nonce in 10..14 {
            earlier.push(issued(
                store.delegate(test_child(9, nonce, root, 8, "true")).await,
            ));
        }
        (root, earlier)
    };
    let store = open_test_store(path).await;
    // Retries of 10..14, new 20..24, and 20 and 21 twice.
    let nonces: Vec<u8> = (10..14).chain(20..24).chain(20..22).collect();
    let calls: Vec<_> = nonces
        .iter()
        .map(|&nonce| {
            let store = store.clone();
            tokio::spawn(async move {
                let answer = store
                    .delegate(test_child(9, nonce, root, 8, "true"))
                    .await
                    .expect("answered");
                match answer.outcome {
                    Outcome::Issued { id, .. } => (nonce, id, answer.replayed),
                    Outcome::Receipt { .. } => panic!("nonce {nonce} refused"),
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("call"));
    }
    for (i, id) in earlier.iter().enumerate() {
        let (_, answered, replayed) = answers[i];
        assert_eq!((answered, replayed), (*id, true), "retry {i}");
    }
    for twin in [20u8, 21] {
        let pair: Vec<_> = answers.iter().filter(|(n, _, _)| *n == twin).collect();
        assert_eq!(pair.len(), 2);
        assert_eq!(pair[0].1, pair[1].1, "one contract for nonce {twin}");
        assert_eq!(
            pair.iter().filter(|(_, _, replayed)| !*replayed).count(),
            1,
            "issued once, replayed once"
        );
    }
    let ledger = crate::suite::stored(&store, root).await.ledger;
    assert_eq!((ledger.reserved, ledger.open_children), (80, 8));
    assert_eq!(contracts_stored(&store).await, 9);
}

/// After a restart the writer's recent-request set is filled from the
/// request log (the last two windows), so it vouches for new keys at
/// once and never for a key it committed before.
#[tokio::test]
async fn the_recent_set_is_reloaded_from_the_request_log() {
    let (store, dir) = open_suite_store().await;
    issued(store.open_root(test_root(meta(9, 1))).await);
    drop(store);
    let mut conn = SqliteConnection::connect_with(
        &SqliteConnectOptions::new().filename(dir.path().join("broker.sqlite3")),
    )
    .await
    .expect("connect");
    const WINDOW_MS: i64 = 300_000;
    let now_ms = SystemClock.now_ms();
    let recent = load_recent(&mut conn, WINDOW_MS, now_ms).await;
    assert!(
        recent.may_contain(&[9u8; 32], &[1u8; 16], now_ms),
        "committed before"
    );
    assert!(
        !recent.may_contain(&[9u8; 32], &[2u8; 16], now_ms),
        "never seen"
    );
    assert_eq!(recent.covered_since_ms(), now_ms - 2 * WINDOW_MS);
}

/// A store whose WAL fsyncs pass through `hook`.
async fn open_hooked_store(
    dir: &tempfile::TempDir,
    hook: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
) -> SqliteStore {
    open_hooked_store_with(test_options(dir.path().join("broker.sqlite3")), hook).await
}

/// `open_hooked_store` with these options.
async fn open_hooked_store_with(
    mut options: SqliteOptions,
    hook: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
) -> SqliteStore {
    options.before_wal_sync = Some(BeforeWalSync(Arc::new(hook)));
    open_with(options, Arc::new(SystemClock)).await
}

/// A failed fsync fails every answer waiting on it and stops the store
/// for good (after one the kernel may have dropped the pages; only a
/// restart knows what is on disk); a restart recovers what was durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fsync_fails_the_waiting_answers_and_stops_the_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let failing = Arc::new(AtomicBool::new(false));
    let hook = failing.clone();
    let store = open_hooked_store(&dir, move || {
        if hook.load(Ordering::SeqCst) {
            Err(std::io::Error::other("injected fsync failure"))
        } else {
            Ok(())
        }
    })
    .await;
    let durable_root = issued(store.open_root(test_root(meta(9, 1))).await);
    // The writer's first request-log prune follows that batch and is
    // synced on its own; let it be durable first, so that the next
    // fsync is the one of the next batch.
    let mut durable = store.durability.durable.clone();
    durable
        .wait_for(|d| *d >= 2)
        .await
        .expect("batch and prune synced");
    failing.store(true, Ordering::SeqCst);
    match store.open_root(test_root(meta(9, 2))).await {
        Err(StoreError::Backend(e)) => assert!(e.contains("fsync"), "{e}"),
        other => panic!("the answer must carry the fsync failure: {other:?}"),
    }
    assert!(
        store.open_root(test_root(meta(9, 3))).await.is_err(),
        "a store whose fsync failed takes no more writes"
    );
    drop(store);
    let store = open_test_store(dir.path().join("broker.sqlite3")).await;
    assert!(store.contract(durable_root).await.expect("read").is_some());
}

/// Nothing a crash could undo is shown: while the syncer is held, a
/// read that would see a committed but unsynced child waits, and the
/// child's own answer waits too; both come once the fsync is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_wait_for_the_fsync_of_what_they_would_show() {
    let dir = tempfile::tempdir().expect("temp dir");
    let gate = SyncGate::new();
    let held = gate.clone();
    let store = open_hooked_store(&dir, move || {
        held.pass(|| {});
        Ok(())
    })
    .await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    gate.set(false);
    let before = store.durability.committed.load(Ordering::SeqCst);
    let writer = {
        let store = store.clone();
        tokio::spawn(async move { store.delegate(test_child(9, 2, root, 8, "true")).await })
    };
    // Wait until the child is committed: its number is taken and its
    // row is visible to a raw read (one that does not wait).
    loop {
        let rows = contracts_stored(&store).await;
        if rows == 2 && store.durability.committed.load(Ordering::SeqCst) > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let reader = {
        let store = store.clone();
        tokio::spawn(async move { store.children(root, 0, 10, usize::MAX).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!reader.is_finished(), "a read returned unsynced state");
    assert!(!writer.is_finished(), "an answer left before its fsync");
    gate.set(true);
    let child = issued(writer.await.expect("writer"));
    let children = reader.await.expect("reader").expect("children");
    assert_eq!(children.iter().map(|c| c.id).collect::<Vec<_>>(), [child]);
}

/// A stuck disk bounds memory instead of growing it: while the syncer
/// is held, the writer commits at most `MAX_UNSYNCED_BATCHES` (plus
/// the group the syncer holds and the one it is handing over) and
/// then waits; commands queue up to `queue_depth`, and the next one is
/// refused as overloaded. Once the disk is back, every queued command
/// is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_fsync_stops_the_writer_after_the_unsynced_limit() {
    const QUEUE_DEPTH: usize = 8;
    let dir = tempfile::tempdir().expect("temp dir");
    let gate = SyncGate::new();
    let held = gate.clone();
    // Set once the syncer waits at the closed gate.
    let blocked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let blocking = blocked.clone();
    let mut options = test_options(dir.path().join("broker.sqlite3"));
    options.queue_depth = QUEUE_DEPTH;
    let store = open_hooked_store_with(options, move || {
        held.pass(|| blocking.store(true, Ordering::SeqCst));
        Ok(())
    })
    .await;
    issued(store.open_root(test_root(meta(1, 0))).await);
    gate.set(false);
    let before = store.durability.committed.load(Ordering::SeqCst);
    // One command at a time, so that each is a batch of its own; stop
    // when the writer no longer commits.
    let mut pending = Vec::new();
    let mut nonce = 0u16;
    let mut next_meta = || {
        nonce += 1;
        let [agent, n] = nonce.to_be_bytes();
        meta(agent.wrapping_add(2), n)
    };
    let limit = MAX_UNSYNCED_BATCHES + 3;
    let stalled = loop {
        // Read before the command goes in, so a quick commit is seen.
        let seen = store.durability.committed.load(Ordering::SeqCst);
        let store_for_task = store.clone();
        let request = next_meta();
        pending.push(tokio::spawn(async move {
            store_for_task.open_root(test_root(request)).await
        }));
        // Generous: only the last wait (the stalled writer) runs out.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while store.durability.committed.load(Ordering::SeqCst) == seen
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let committed = store.durability.committed.load(Ordering::SeqCst) - before;
        if committed == seen - before {
            break committed;
        }
        // The syncer must block holding the first batch alone: woken late,
        // it would take several at once, and the limit below counts one.
        if pending.len() == 1 {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while !blocked.load(Ordering::SeqCst) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert!(
                blocked.load(Ordering::SeqCst),
                "the syncer never reached the gate"
            );
        }
        assert!(
            committed <= u64::try_from(limit).expect("small"),
            "the writer went on committing past the unsynced limit: {committed}"
        );
    };
    assert!(
        stalled >= u64::try_from(MAX_UNSYNCED_BATCHES).expect("small"),
        "the writer stopped early, after {stalled} batches"
    );
    // The command that found the writer waiting sits in the queue;
    // the rest of the queue fills up, and then a command is refused.
    assert_eq!(store.sql.commands.capacity(), QUEUE_DEPTH - 1);
    for queued in 1..QUEUE_DEPTH {
        let store_for_task = store.clone();
        let request = next_meta();
        pending.push(tokio::spawn(async move {
            store_for_task.open_root(test_root(request)).await
        }));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store.sql.commands.capacity() > QUEUE_DEPTH - 1 - queued {
            assert!(
                tokio::time::Instant::now() < deadline,
                "command {queued} never reached the queue"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    match store.open_root(test_root(next_meta())).await {
        // Busy: UNAVAILABLE for the client, which standard retry
        // policies retry (with the same nonce, safely).
        Err(StoreError::Busy) => {}
        other => panic!("a full writer queue must refuse, not grow: {other:?}"),
    }
    gate.set(true);
    for task in pending {
        issued(task.await.expect("task"));
    }
}

/// A prune pass deletes at most `MAX_PRUNED_PER_PASS` entries, oldest
/// first and only those past the cutoff, so the writer's pause stays
/// bounded; a backlog is worked off pass by pass.
#[tokio::test]
async fn a_prune_pass_is_bounded_and_takes_the_oldest_first() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut conn = raw_connection(&dir.path().join("broker.sqlite3")).await;
    sqlx::migrate!("./migrations/sqlite")
        .run(&mut conn)
        .await
        .expect("schema");
    let old = i64::try_from(MAX_PRUNED_PER_PASS).expect("small") * 2 + 10;
    // `old` entries before the cutoff (at 1..=old ms), 5 after it.
    for at_ms in 1..=old + 5 {
        sqlx::query(
            "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
             VALUES ($1, $2, $3, 1, $3, $4)",
        )
        .bind([7u8; 32].as_slice())
        .bind(at_ms.to_be_bytes().as_slice())
        .bind([1u8; 32].as_slice())
        .bind(at_ms)
        .execute(&mut conn)
        .await
        .expect("insert");
    }
    let cutoff_ms = old + 1;
    let mut statements = crate::sqlite::raw::Statements::default();
    let mut handle = conn.lock_handle().await.expect("handle");
    let first = prune_requests(&mut handle, &mut statements, cutoff_ms).expect("prune");
    drop(handle);
    assert_eq!(first, MAX_PRUNED_PER_PASS);
    let oldest: i64 = sqlx::query_scalar("SELECT MIN(at_ms) FROM requests")
        .fetch_one(&mut conn)
        .await
        .expect("min");
    assert_eq!(
        oldest,
        i64::try_from(MAX_PRUNED_PER_PASS).expect("small") + 1,
        "the oldest go first"
    );
    let mut passes = 1;
    let mut handle = conn.lock_handle().await.expect("handle");
    while prune_requests(&mut handle, &mut statements, cutoff_ms).expect("prune") > 0 {
        passes += 1;
    }
    statements.finalize_all(&mut handle);
    drop(handle);
    assert_eq!(passes, 3, "a backlog of {old} takes three passes");
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM requests")
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(left, 5, "entries after the cutoff stay");
}

/// The writer's cache charges each contract its encoded size, keeps
/// the sum right through replacement and removal, and is bounded by it.
#[tokio::test]
async fn the_contract_cache_is_charged_by_size() {
    use prost::Message;
    let (store, _dir) = open_suite_store().await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let child = issued(store.delegate(test_child(9, 2, root, 8, "true")).await);
    let (root_known, child_known) = {
        let cache = lock(&store.sql.known);
        let cost = |id: &Id| {
            cache.get(id).expect("cached").contract.encoded_len()
                + batch::KNOWN_ENTRY_OVERHEAD_BYTES
        };
        assert_eq!(cache.bytes(), cost(&root) + cost(&child));
        (
            cache.get(&root).expect("cached").clone(),
            cache.get(&child).expect("cached").clone(),
        )
    };
    let (root_cost, child_cost) = (
        root_known.contract.encoded_len() + batch::KNOWN_ENTRY_OVERHEAD_BYTES,
        child_known.contract.encoded_len() + batch::KNOWN_ENTRY_OVERHEAD_BYTES,
    );
    assert!(child_cost > root_cost, "a child carries one more hop proof");
    let mut map = KnownMap::default();
    map.insert([1; 32], root_known.clone());
    map.insert([2; 32], child_known.clone());
    assert_eq!(map.bytes(), root_cost + child_cost);
    map.insert([1; 32], child_known);
    assert_eq!(map.bytes(), 2 * child_cost, "a replaced entry is uncharged");
    assert!(map.remove(&[2; 32]).is_some());
    assert!(map.remove(&[2; 32]).is_none());
    assert_eq!((map.len(), map.bytes()), (1, child_cost));
    map.clear();
    assert_eq!((map.len(), map.bytes()), (0, 0));
}

#[test]
fn wal_sync_stats_count_slow_fsyncs_apart() {
    let stats = WalSyncStats {
        syncs: AtomicU64::new(0),
        total_us: AtomicU64::new(0),
        slow: AtomicU64::new(0),
        slow_us: AtomicU64::new(0),
        max_us: AtomicU64::new(0),
    };
    let before = stats.snapshot();
    for took_us in [100, SLOW_WAL_SYNC_US - 1, SLOW_WAL_SYNC_US, 90_000, 300] {
        stats.record(took_us);
    }
    let after = stats.snapshot();
    assert_eq!(after.syncs - before.syncs, 5);
    assert_eq!(after.slow - before.slow, 2);
    assert_eq!(after.slow_us - before.slow_us, SLOW_WAL_SYNC_US + 90_000);
    assert_eq!(
        after.total_us,
        100 + SLOW_WAL_SYNC_US - 1 + SLOW_WAL_SYNC_US + 90_000 + 300
    );
    assert_eq!(after.max_us, 90_000);
}

/// The syncer must never fsync a file SQLite no longer writes: a
/// missing WAL is an error (the store stops), a replaced one is
/// reopened.
#[test]
fn the_wal_is_synced_by_path_and_reopened_when_replaced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = wal_path_of(&dir.path().join("broker.sqlite3"));
    assert!(path.to_string_lossy().ends_with("broker.sqlite3-wal"));
    let mut wal = None;
    assert!(sync_wal(&path, &mut wal).is_err());
    assert!(wal.is_none());
    std::fs::write(&path, b"first").expect("write");
    sync_wal(&path, &mut wal).expect("sync");
    let first = wal.as_ref().map(|(_, inode)| *inode);
    assert_eq!(first, Some(std::fs::metadata(&path).expect("stat").ino()));
    // Replace it: a new file (kept alive) has a new inode.
    let aside = dir.path().join("old-wal");
    std::fs::rename(&path, &aside).expect("rename");
    std::fs::write(&path, b"second").expect("write");
    sync_wal(&path, &mut wal).expect("sync");
    let second = wal.as_ref().map(|(_, inode)| *inode);
    assert_ne!(first, second);
    assert_eq!(second, Some(std::fs::metadata(&path).expect("stat").ino()));
}

/// A new WAL's blocks are reserved up to its restart size, so its first
/// commits overwrite instead of growing the file; a WAL with anything in it
/// (frames a crash left) is left to SQLite. (Linux: elsewhere nothing is
/// reserved.)
#[cfg(target_os = "linux")]
#[test]
fn a_new_wal_is_reserved_and_a_used_one_left_alone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let database = dir.path().join("broker.sqlite3");
    let wal = wal_path_of(&database);
    reserve_wal(&database, 1 << 20);
    let reserved = std::fs::metadata(&wal).expect("reserved");
    assert_eq!(reserved.len(), 1 << 20);
    // Blocks, not a hole: 512-byte units.
    assert!(
        reserved.blocks() * 512 >= 1 << 20,
        "{} blocks",
        reserved.blocks()
    );
    let used = dir.path().join("used.sqlite3");
    std::fs::write(wal_path_of(&used), b"frames").expect("write");
    reserve_wal(&used, 1 << 20);
    assert_eq!(
        std::fs::read(wal_path_of(&used)).expect("read"),
        b"frames".to_vec()
    );
}

/// Under continuous writes a background checkpoint never catches up,
/// so without the writer finishing it the WAL never restarts and grows
/// with every commit. With a small restart size it stays bounded: a
/// fraction of what was written, however fast this machine writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(target_os = "linux")]
async fn the_wal_stays_bounded_under_continuous_writes() {
    const RESTART_BYTES: u64 = 256 * 1024;
    /// Shorter than production's: more restarts in a short test.
    const INTERVAL: Duration = Duration::from_millis(250);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let wal = wal_path_of(&path);
    let store = open_with(
        SqliteOptions {
            queue_depth: 1024,
            max_batch: 64,
            wal_restart_bytes: RESTART_BYTES,
            checkpoint_interval: INTERVAL,
            ..test_options(path)
        },
        Arc::new(SystemClock),
    )
    .await;
    let written_before = bytes_written_by_this_process();
    // Twelve checkpoint intervals: each may restart the WAL once.
    let stop_at = std::time::Instant::now() + 12 * INTERVAL;
    let mut writers = Vec::new();
    for task in 0u8..16 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while std::time::Instant::now() < stop_at {
                let mut nonce = vec![task; 8];
                nonce.extend_from_slice(&n.to_be_bytes());
                // Distinct digests: two roots with the same content in
                // the same millisecond would have the same id.
                let root = test_root(RequestMeta {
                    agent: [task; 32],
                    digest: broker_wire::crypto::sha256(&nonce),
                    nonce,
                    timestamp_ms: TEST_TIMESTAMP_MS,
                });
                store.open_root(root).await.expect("root");
                n += 1;
            }
            n
        }));
    }
    // Each restart writes a new salt into the WAL header (bytes 16..24).
    let (mut largest_wal_bytes, mut salts) = (0, std::collections::HashSet::new());
    while std::time::Instant::now() < stop_at {
        if let Ok(mut file) = std::fs::File::open(&wal) {
            use std::io::Read;
            let size = file.metadata().map_or(0, |m| m.len());
            largest_wal_bytes = largest_wal_bytes.max(size);
            let mut header = [0u8; 24];
            // A reserved WAL reads as zeros until SQLite writes its header.
            if file.read_exact(&mut header).is_ok() && header[..4] != [0; 4] {
                salts.insert(header[16..24].to_vec());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut roots = 0;
    for writer in writers {
        roots += writer.await.expect("writer");
    }
    // Restarted again and again (about once per checkpoint interval)...
    assert!(
        salts.len() >= 4,
        "the WAL restarted {} times ({roots} roots, largest {largest_wal_bytes} bytes)",
        salts.len().saturating_sub(1)
    );
    // ...so it holds about the restart size plus an interval or two of
    // writes, never everything written. The bound is relative: a fast
    // disk writes 50 MB of WAL in one interval here. The process wrote
    // every WAL frame once and copied at most as many into the database,
    // so the WAL took at least half of its writes.
    let written = bytes_written_by_this_process() - written_before;
    assert!(
        largest_wal_bytes < written / 4,
        "WAL reached {largest_wal_bytes} bytes of {written} written ({roots} roots)"
    );
}

/// Bytes this process has written through `write` calls, `pwrite`
/// included (Linux's `/proc/self/io` `wchar`; nextest runs each test in a
/// process of its own).
#[cfg(target_os = "linux")]
fn bytes_written_by_this_process() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|line| line.strip_prefix("wchar: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("wchar in /proc/self/io")
}

/// A migrated store in a directory of its own, and a connection of the
/// test's to its database (to read plans); both live while they are held.
async fn store_and_connection() -> (tempfile::TempDir, SqliteStore, SqliteConnection) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.sqlite3");
    let store = open_test_store(path.clone()).await;
    let mut conn = SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(&path))
        .await
        .expect("connect");
    // Planned as the store's own connections plan.
    super::raw::plan_stably(&mut conn)
        .await
        .expect("stable plans");
    (dir, store, conn)
}

/// Every read connection of the store plans stably, as its writer does
/// (`raw::plan_stably`): a paged read is not prepared anew at each run.
#[tokio::test]
async fn the_stores_connections_plan_stably() {
    let (_dir, store, _conn) = store_and_connection().await;
    let mut reader = store.sql.reader.acquire().await.expect("a reader");
    assert!(super::raw::plans_stably(&mut reader).await);
}

/// How SQLite plans `query`: `EXPLAIN QUERY PLAN`'s lines.
async fn query_plan(conn: &mut SqliteConnection, query: &str) -> Vec<String> {
    sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {query}")))
        .fetch_all(conn)
        .await
        .expect("plan")
        .iter()
        .map(|row| row.get::<String, _>("detail"))
        .collect()
}

/// The statements a cascade walks its open descendants with, as SQLite
/// plans them (`EXPLAIN QUERY PLAN`): a level's children are found down
/// `contracts_by_parent`, never through `contracts_open_by_deadline`, and
/// loaded by key. The recursive walk before the fix (kept here) planned
/// its recursive step through the status index, scanning every open
/// contract of the database per descendant (a revoke of 30,000 held the
/// writer 80 s): the check must tell the two apart, or it proves nothing.
#[tokio::test]
async fn the_descendants_walk_goes_down_the_parent_index() {
    const OLD_WALK: &str = "WITH RECURSIVE sub(seq) AS (\
         SELECT seq FROM contracts WHERE parent_seq = 1 AND status IN (1, 2) \
         UNION ALL SELECT c.seq FROM contracts c JOIN sub ON c.parent_seq = sub.seq \
         WHERE c.status IN (1, 2)) SELECT seq FROM sub";
    let (_dir, _store, mut conn) = store_and_connection().await;
    let mut plans = Vec::new();
    for query in [
        format!("{}(1, 2, 3)", lifecycle::CHILDREN_OF),
        format!("{}(1, 2, 3) ORDER BY id", lifecycle::LOAD_BY_SEQ),
        OLD_WALK.to_owned(),
    ] {
        plans.push(query_plan(&mut conn, &query).await);
    }
    // Every read of the contracts table goes by the parent index or by key.
    let by_parent_or_key = |plan: &[String]| {
        let reads: Vec<&String> = plan
            .iter()
            .filter(|line| line.starts_with("SEARCH") || line.starts_with("SCAN"))
            .filter(|line| !line.contains(" sub"))
            .collect();
        !reads.is_empty()
            && reads.iter().all(|line| {
                line.starts_with("SEARCH")
                    && (line.contains("USING INDEX contracts_by_parent (parent_seq=?)")
                        || line.contains("PRIMARY KEY (rowid=?)"))
            })
    };
    assert!(by_parent_or_key(&plans[0]), "children: {:#?}", plans[0]);
    assert!(
        plans[0].iter().any(|l| l.contains("contracts_by_parent")),
        "{:#?}",
        plans[0]
    );
    assert!(by_parent_or_key(&plans[1]), "rows: {:#?}", plans[1]);
    assert!(
        !by_parent_or_key(&plans[2]),
        "the check cannot tell the old walk: {:#?}",
        plans[2]
    );
}

/// Issuance reads the drains of its parents' trees only, down
/// `draining_by_root` (`drain::DRAINS_OF_ROOTS`): a tenant with many drains
/// in progress does not make every batch of every tree read them all.
/// Checked over 2,000 drains, so the planner has a table to scan.
#[tokio::test]
async fn issuance_reads_only_its_trees_drains() {
    let (_dir, _store, mut conn) = store_and_connection().await;
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000) \
         INSERT INTO draining (target_seq, root_seq, status, started_at_ms) \
         SELECT i, i / 4, 5, 1 FROM n; ANALYZE",
    )
    .execute(&mut conn)
    .await
    .expect("drains");
    let query = format!("{}(7, 9)", crate::sql::drain::DRAINS_OF_ROOTS);
    let plan = query_plan(&mut conn, &query).await;
    assert!(
        !plan.is_empty()
            && plan.iter().all(|line| line.starts_with("SEARCH draining")
                && line.contains("INDEX draining_by_root (root_seq=?)")),
        "{plan:#?}"
    );
    let found: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(query))
        .fetch_all(&mut conn)
        .await
        .expect("drains of two trees");
    let mut targets: Vec<i64> = found.iter().map(|(_, target)| *target).collect();
    targets.sort_unstable();
    assert_eq!(targets, vec![28, 29, 30, 31, 36, 37, 38, 39]);
}

/// The cache turns by generations: a full young generation becomes the
/// old one (which still answers), the one before is freed, and an entry
/// changed since (a parent reserved from) survives; nothing is dropped
/// but at a turn, and a turn by bytes works as one by count.
#[tokio::test]
async fn the_contract_cache_turns_generations_and_keeps_what_is_in_use() {
    let (store, _dir) = open_suite_store().await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let known = lock(&store.sql.known).get(&root).expect("cached").clone();
    let cost = {
        use prost::Message;
        known.contract.encoded_len() + batch::KNOWN_ENTRY_OVERHEAD_BYTES
    };
    let (a, b, c, d) = ([1; 32], [2; 32], [3; 32], [4; 32]);

    let mut map = KnownMap::bounded(4, usize::MAX);
    map.insert(a, known.clone());
    map.insert(b, known.clone());
    map.turn_if_full();
    assert!(
        map.get(&a).is_some() && map.get(&b).is_some(),
        "the old generation answers"
    );
    assert!(map.get_mut(&a).is_some(), "a is in use again");
    map.insert(c, known.clone());
    map.insert(d, known.clone());
    assert_eq!(
        map.len(),
        4,
        "no turn before `turn_if_full`, past the young bound too"
    );
    map.turn_if_full();
    assert!(map.get(&b).is_none(), "b was in the generation freed");
    for id in [a, c, d] {
        assert!(map.contains_key(&id), "{id:?} is in the old generation now");
    }
    assert_eq!((map.len(), map.bytes()), (3, 3 * cost));
    map.turn_if_full();
    assert_eq!(map.len(), 3, "an empty young generation does not turn");
    assert!(map.remove(&c).is_some(), "removed from the old generation");
    assert_eq!((map.len(), map.bytes()), (2, 2 * cost));
    map.clear();
    assert_eq!((map.len(), map.bytes()), (0, 0));

    let mut map = KnownMap::bounded(usize::MAX, 4 * cost);
    map.insert(a, known.clone());
    map.turn_if_full();
    assert!(map.contains_key(&a), "half the bytes not reached");
    map.insert(b, known.clone());
    map.turn_if_full();
    map.insert(c, known.clone());
    map.turn_if_full();
    assert_eq!(map.len(), 3, "a and b old, c young");
    map.insert(d, known);
    map.turn_if_full();
    assert!(
        !map.contains_key(&a) && !map.contains_key(&b),
        "turned by bytes"
    );
    assert_eq!((map.len(), map.bytes()), (2, 2 * cost));
}

/// A writer that panicked while holding the cache poisons it: the next
/// lock clears it and the poison, so later batches do not clear it again.
#[tokio::test]
async fn a_poisoned_cache_is_cleared_once() {
    let (store, _dir) = open_suite_store().await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let known = store.sql.known.clone();
    assert!(lock(&known).contains_key(&root));
    let holder = known.clone();
    let panicked = std::thread::spawn(move || {
        let _held = holder.lock();
        panic!("a writer panics holding the cache (expected by this test)");
    })
    .join();
    assert!(panicked.is_err() && known.is_poisoned());
    assert!(lock(&known).is_empty(), "cleared");
    assert!(!known.is_poisoned(), "and no longer poisoned");
}

/// The writer reads on its held handle (`raw::HeldSource`) what sqlx
/// reads: contracts with their parents, lineages, open descendants, a
/// tree's drains and the request log decode the same through the shared
/// decoders, cell for cell (NULL columns, the root's missing parent,
/// empty blobs and a drain row included).
#[tokio::test]
async fn the_held_handle_reads_what_sqlx_reads() {
    let (_dir, store, mut conn) = store_and_connection().await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let child = issued(store.delegate(test_child(9, 2, root, 8, "true")).await);
    let grandchild = issued(store.delegate(test_child(8, 3, child, 7, "true")).await);
    // A drain row of the tree, as a drain in progress leaves one.
    sqlx::query(
        "INSERT INTO draining (target_seq, root_seq, status, started_at_ms) VALUES (2, 1, 6, 1)",
    )
    .execute(&mut conn)
    .await
    .expect("a drain row");
    let keys = vec![
        ([9u8; 32], vec![1u8; 16]),
        ([9u8; 32], vec![2u8; 16]),
        ([8u8; 32], vec![3u8; 16]),
    ];
    let by_sqlx = held_and_sqlx_reads(
        &mut crate::sql::source::Sqlx::<Sqlite>(&mut conn),
        &[root, child, grandchild],
        &keys,
    )
    .await;
    let mut statements = raw::Statements::default();
    let mut handle = conn.lock_handle().await.expect("handle");
    let mut src = raw::HeldSource {
        handle: &mut handle,
        statements: &mut statements,
    };
    let by_held = held_and_sqlx_reads(&mut src, &[root, child, grandchild], &keys).await;
    statements.finalize_all(&mut handle);
    assert!(by_sqlx[0].contains("parent_id: None"), "{}", by_sqlx[0]);
    assert!(
        by_sqlx[1].contains("Ok(Some([StoredContract"),
        "{}",
        by_sqlx[1]
    );
    assert!(by_sqlx[3].contains("Revoked"), "{}", by_sqlx[3]);
    assert_eq!(
        by_sqlx[3].matches("PriorRequest").count(),
        3,
        "{}",
        by_sqlx[3]
    );
    assert_eq!(by_held, by_sqlx);
}

/// What `the_held_handle_reads_what_sqlx_reads` compares: each contract
/// with its parent, its lineage and its open descendants; then the
/// tree's drains, whether any drain runs and the request log's answers.
async fn held_and_sqlx_reads(
    src: &mut impl crate::sql::source::Source<Sqlite>,
    ids: &[Id],
    keys: &[RequestKey],
) -> Vec<String> {
    let mut reads = Vec::new();
    for id in ids {
        let loaded = lifecycle::load_locked::<Sqlite, _>(src, id).await;
        let (_, target) = loaded.as_ref().expect("read").as_ref().expect("found");
        let seq = target.seq;
        let lineage = lifecycle::lineage::<Sqlite, _>(src, seq).await;
        let below = lifecycle::open_descendants::<Sqlite, _>(src, seq, 8).await;
        reads.push(format!("{loaded:?} {lineage:?} {below:?}"));
    }
    let drains = drain::drains_of::<Sqlite, _>(src, 1).await;
    let any = drain::any_drain::<Sqlite, _>(src).await;
    let mut prior: Vec<_> = load_prior_requests::<Sqlite, _>(src, keys)
        .await
        .expect("read")
        .into_iter()
        .collect();
    prior.sort_by(|a, b| a.0.cmp(&b.0));
    reads.push(format!("{drains:?} {any:?} {prior:?}"));
    reads
}

/// A lifecycle batch that fails inside its transaction on the writer's
/// held handle (a trigger refuses its receipt: not a request-log
/// conflict, so not redone) is rolled back whole and answered with the
/// error; the writer takes its handle again and the next batch commits.
#[tokio::test]
async fn a_lifecycle_batch_failing_on_the_held_handle_is_rolled_back_and_the_writer_goes_on() {
    use crate::suite::{act, acted};
    use broker_wire::command::Action;
    let (_dir, store, mut conn) = store_and_connection().await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let child = issued(store.delegate(test_child(9, 2, root, 8, "true")).await);
    sqlx::query(
        "CREATE TRIGGER refuse_receipts BEFORE INSERT ON receipts \
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
    )
    .execute(&mut conn)
    .await
    .expect("trigger");
    let failed = act(&store, 8, 3, child, Action::Accept { host: None }).await;
    assert!(
        format!("{failed:?}").contains("refused by the test"),
        "{failed:?}"
    );
    let record = store.contract(child).await.expect("read").expect("found");
    assert_eq!(
        record.status,
        Status::Open,
        "nothing of the batch committed"
    );
    sqlx::query("DROP TRIGGER refuse_receipts")
        .execute(&mut conn)
        .await
        .expect("drop");
    acted(&store, 8, 4, child, Action::Accept { host: None }).await;
    let record = store.contract(child).await.expect("read").expect("found");
    assert_eq!(record.status, Status::Accepted);
    // Issuance goes on too, on a handle taken again.
    issued(store.delegate(test_child(8, 5, child, 7, "true")).await);
}
