//! The store suite (`store::suite`) against PostgreSQL, each test on a
//! database of its own.

use super::*;
use crate::postgres::testing::TestDatabase;
use crate::suite::{TunedOptions, test_stamper};
use broker_wire::clock::{Clock, SystemClock};

pub(super) fn test_options(url: &str) -> PostgresOptions {
    let mut options = PostgresOptions::new(url);
    options.read_connections = 2;
    options.writers = 2;
    options.queue_depth = 256;
    options.max_batch = 16;
    options.request_log_retention_ms = i64::MAX;
    options
}

/// A replica with `options` and the test key, on `clock`.
async fn open_with(options: PostgresOptions, clock: Arc<dyn Clock>) -> PostgresStore {
    PostgresStore::open(options, test_stamper(), clock)
        .await
        .expect("open")
}

/// A replica on `url` with the test options.
async fn open_store(url: &str) -> PostgresStore {
    open_with(test_options(url), Arc::new(SystemClock)).await
}

async fn open_suite_store() -> (PostgresStore, TestDatabase) {
    let database = TestDatabase::migrated().await;
    let store = open_store(&database.url).await;
    (store, database)
}

crate::suite::store_suite!(suite, super::open_suite_store);

crate::suite::tuned_options!(PostgresOptions);

/// A store with the tuned options set, for `tuned_suite!`.
async fn open_tuned_store(tuned: crate::suite::Tuned) -> (PostgresStore, TestDatabase) {
    let database = TestDatabase::migrated().await;
    let options = test_options(&database.url).tuned(tuned);
    let store = open_with(options, Arc::new(SystemClock)).await;
    (store, database)
}

crate::suite::tuned_suite!(tuned, super::open_tuned_store);

/// `suite::drains::a_drain_is_frozen_stepped_and_resumed` on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_is_frozen_stepped_and_resumed() {
    let database = TestDatabase::migrated().await;
    let clock = Arc::new(broker_wire::clock::OffsetClock::default());
    let open = |tuned| open_with(test_options(&database.url).tuned(tuned), clock.clone());
    crate::suite::drains::a_drain_is_frozen_stepped_and_resumed(clock.clone(), open).await;
}

/// The statements a cascade walks its open descendants with, as
/// PostgreSQL plans them (`EXPLAIN`) over a database of 20,031 open
/// contracts with statistics: a level's children are found down
/// `contracts_by_parent` and loaded by key, never by scanning the table,
/// so ending a subtree costs what the subtree holds, whatever else is
/// open. (The recursive query before it hash-joined a scan of the whole
/// table at every level.)
#[tokio::test]
async fn the_descendants_walk_goes_down_the_parent_index() {
    let (store, database) = open_suite_store().await;
    drop(store);
    let mut conn = sqlx::PgConnection::connect(&database.url)
        .await
        .expect("connect");
    many_open_contracts(&mut conn).await;
    let children = explain(&mut conn, format!("{}(2)", lifecycle::CHILDREN_OF)).await;
    assert!(children.contains("contracts_by_parent"), "{children}");
    assert!(!children.contains("Seq Scan"), "{children}");
    let rows = explain(
        &mut conn,
        format!(
            "{}(40, 41, 42) ORDER BY id FOR UPDATE",
            lifecycle::LOAD_BY_SEQ
        ),
    )
    .await;
    assert!(rows.contains("contracts_pkey"), "{rows}");
    assert!(!rows.contains("Seq Scan on contracts"), "{rows}");
}

/// The plan PostgreSQL would run `query` with, as text.
/// A root (seq 1), 30 children, 20,000 grandchildren: all open, with
/// envelopes, analyzed.
async fn many_open_contracts(conn: &mut sqlx::PgConnection) {
    sqlx::query(
        "INSERT INTO contracts (seq, id, parent_seq, root_seq, root_id, depth, delegate_key, \
         liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
         deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
         retry_headroom, issued_at_ms, status, budget, reserved, spent, open_children) \
         SELECT s, sha256(int8send(s)), \
                CASE WHEN s = 1 THEN NULL WHEN s <= 31 THEN 1 ELSE 2 + (s - 32) % 30 END, \
                1, sha256(int8send(1)), CASE WHEN s = 1 THEN 0 WHEN s <= 31 THEN 1 ELSE 2 END, \
                sha256(int8send(s)), 1, sha256(int8send(s)), 1000000, 'true', 1, '[]', 4, 0, \
                1000, 0, 1, 1, 1, 0, 0, 0 \
         FROM generate_series(1, 20031) AS s",
    )
    .execute(&mut *conn)
    .await
    .expect("contracts");
    sqlx::query(
        "INSERT INTO contract_envelopes (seq, envelope) SELECT seq, '\\x00' FROM contracts",
    )
    .execute(&mut *conn)
    .await
    .expect("envelopes");
    sqlx::query("ANALYZE")
        .execute(&mut *conn)
        .await
        .expect("analyze");
}

async fn explain(conn: &mut sqlx::PgConnection, query: String) -> String {
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
        .fetch_all(conn)
        .await
        .expect("plan");
    plan.join("\n")
}

/// An event an earlier version left unplaced (its sequencer placed every
/// event after commit; writers now place their own) is placed when a
/// replica starts, and Watch then reads it: the one reason the sequencer
/// once placed leftovers every second.
#[tokio::test]
async fn events_left_unplaced_are_placed_at_start() {
    use crate::suite::{meta, test_root};
    let (store, database) = open_suite_store().await;
    let root = match store
        .open_root(test_root(meta(1, 1)))
        .await
        .expect("root")
        .outcome
    {
        crate::Outcome::Issued { id, .. } => id,
        other => panic!("not issued: {other:?}"),
    };
    // As the earlier version wrote it: committed, no position. Written
    // once the first store is gone: its sequencer places leftovers when
    // it starts, which may be after this test's first statements; its
    // last connection closes once that pass is done and it has seen the
    // store dropped.
    drop(store);
    let mut conn = PgConnection::connect(&database.url).await.expect("connect");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut conn)
        .await
        .expect("connections");
        if others == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first store's {others} connections stayed open"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let unplaced = sqlx::query("UPDATE events SET pos = NULL")
        .execute(&mut conn)
        .await
        .expect("unplace");
    assert_eq!(unplaced.rows_affected(), 1, "the root's one event");
    let store = open_store(&database.url).await;
    // Placed by the sequencer as it starts (off `open`: a lost race for
    // the clock never keeps a replica from starting).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let events = loop {
        let events = store.events(root, 0, 16, usize::MAX).await.expect("events");
        if !events.is_empty() || std::time::Instant::now() > deadline {
            break events;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(events.len(), 1, "the root's event is placed: {events:?}");
    let unplaced: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE pos IS NULL")
        .fetch_one(&store.sql.reader)
        .await
        .expect("count");
    assert_eq!(unplaced, 0);
}

/// The issuance transaction's statements as PostgreSQL plans them on a
/// writer's connection (`writer::WRITER_SETTINGS`): generic plans, made once per connection (and
/// again every `PLAN_REFRESH`), over 20,031 contracts, receipts,
/// request-log rows and drains. Every read of a table seeks: it goes down
/// an index by a condition on the index's first column. The same for the
/// sequencer's poll on its connection (`events::POLL_SETTINGS`). (On a table of a row
/// or two a generic plan may read a whole index — every path costs the
/// same there — which is why the writers make their plans again.)
#[tokio::test]
async fn the_issuance_statements_seek_with_generic_plans() {
    let (store, database) = open_suite_store().await;
    drop(store);
    let writer_options = super::connect_options(&database.url)
        .expect("url")
        .options(writer::WRITER_SETTINGS);
    let mut conn = sqlx::PgConnection::connect_with(&writer_options)
        .await
        .expect("connect");
    many_open_contracts(&mut conn).await;
    // A receipt and a request-log row per contract too.
    sqlx::raw_sql(
        "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) \
         SELECT seq + 100000, sha256(int8send(seq + 100000)), 1, seq, id, root_id, '\\x00', 1 \
         FROM contracts; \
         INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
         SELECT delegate_key, int8send(seq), id, 1, id, 1 FROM contracts; \
         INSERT INTO draining (target_seq, root_seq, status, started_at_ms) \
         SELECT seq, seq, 5, 1 FROM contracts; ANALYZE",
    )
    .execute(&mut conn)
    .await
    .expect("receipts and requests");
    let leading = leading_columns(&mut conn).await;
    let keys: Vec<RequestKey> = vec![([1u8; 32], vec![1]), ([2u8; 32], vec![2])];
    let prior = crate::sql::requests::prior_requests_text(&keys).0;
    let states = format!(
        "{}$1::int8[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[], \
         $8::int8[], $9::int8[]{}",
        unnest::UPDATE_STATES.0,
        unnest::UPDATE_STATES.1
    );
    let statements = [
        ("parents", writer::parents_locked_sql()),
        ("drains and numbers", writer::DRAINS_AND_NUMBERS.to_string()),
        ("numbers", writer::RESERVE.to_string()),
        ("states", states),
        (
            "unwritten parents",
            format!(
                "{}$1::int8[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[]{}",
                unnest::CHECK_UNWRITTEN.0,
                unnest::CHECK_UNWRITTEN.1
            ),
        ),
        (
            "events",
            format!(
                "WITH ev AS (SELECT 1::int8 AS seq, 1 AS kind, 1::int8 AS contract_seq, \
                 ''::bytea AS root_id), done AS (SELECT 1 AS rows), {}",
                unnest::PLACE
            ),
        ),
        ("prior requests", prior),
        ("lineage", lifecycle::LINEAGE.to_string()),
        // Lifecycle transactions keep custom plans; this checks that its
        // generic plan seeks too.
        (
            "a lifecycle transaction's events",
            events::PLACE_OWN.to_string(),
        ),
    ];
    // The sequencer's poll, planned on a connection of its own settings.
    let mut poller = sqlx::PgConnection::connect(&database.url)
        .await
        .expect("connect");
    sqlx::raw_sql(events::POLL_SETTINGS)
        .execute(&mut poller)
        .await
        .expect("settings");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "PREPARE poll AS {}",
        events::POLL
    )))
    .execute(&mut poller)
    .await
    .expect("prepare");
    let plan = explain(&mut poller, "EXECUTE poll(NULL, NULL)".into()).await;
    assert!(
        scans(&plan, &leading).is_empty() && !plan.contains("Sort"),
        "{plan}"
    );
    // Generic plans, or `EXECUTE s(NULL)` would be planned for its NULLs
    // (folded away: a plan that reads nothing).
    let mode: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(&mut conn)
        .await
        .expect("mode");
    assert_eq!(mode, "force_generic_plan");
    for (number, (name, sql)) in statements.iter().enumerate() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE s{number} AS {sql}")))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let params = (1..=9).filter(|n| sql.contains(&format!("${n}"))).count();
        let nulls = vec!["NULL"; params].join(", ");
        let execute = if params == 0 {
            format!("s{number}")
        } else {
            format!("s{number}({nulls})")
        };
        let plan = explain(&mut conn, format!("EXECUTE {execute}")).await;
        let problems = scans(&plan, &leading);
        assert!(problems.is_empty(), "{name}: {problems:?}\n{plan}");
    }
}

/// Every index's first column, by index name: an index read is a seek
/// only when its condition names that column (a condition on a later
/// column alone still reads the whole index).
async fn leading_columns(conn: &mut sqlx::PgConnection) -> HashMap<String, String> {
    sqlx::query_as::<_, (String, String)>(
        "SELECT c.relname::text, a.attname::text FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'",
    )
    .fetch_all(conn)
    .await
    .expect("index columns")
    .into_iter()
    .collect()
}

/// The reads in `plan` (`EXPLAIN` text) that are not a seek: a sequential
/// scan, or an index read (`Index Scan`, `Index Only Scan`, `Bitmap Index
/// Scan`) without a condition on the index's first column (`leading`).
fn scans(plan: &str, leading: &HashMap<String, String>) -> Vec<String> {
    let lines: Vec<&str> = plan.lines().collect();
    let mut problems = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        if let Some(table) = line
            .split("Seq Scan on ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
        {
            problems.push(format!("a sequential scan of {table}"));
            continue;
        }
        let index = if line.contains("Bitmap Index Scan on ") {
            line.split("Bitmap Index Scan on ").nth(1)
        } else if line.contains("Index Scan") || line.contains("Index Only Scan") {
            // `Index Scan using`, `Index Scan Backward using`, ….
            line.split(" using ").nth(1)
        } else {
            None
        };
        let Some(index) = index.and_then(|t| t.split_whitespace().next()) else {
            continue;
        };
        let Some(column) = leading.get(index) else {
            problems.push(format!("an index not in the catalog: {index}"));
            continue;
        };
        // The node's details run to the next node.
        let sought = lines[at + 1..]
            .iter()
            .take_while(|l| !l.contains("->"))
            .filter(|l| l.contains("Index Cond"))
            .any(|l| names_column(l, column));
        if !sought {
            problems.push(format!(
                "a whole index read ({index}: no condition on {column}): {}",
                line.trim()
            ));
        }
    }
    problems
}

/// Whether `condition` compares `column` (`column = …`, `t.column > …`,
/// `column IS NULL`). Not understood (so failed, never passed): quoted
/// names and row comparisons, which no statement here uses.
fn names_column(condition: &str, column: &str) -> bool {
    condition.match_indices(column).any(|(at, _)| {
        let before = condition[..at].chars().next_back();
        let after = &condition[at + column.len()..];
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
            && [" = ", " > ", " < ", " >= ", " <= ", " IS "]
                .iter()
                .any(|op| after.starts_with(op))
    })
}

/// The plan checker tells a seek from a whole-index read by a later
/// column, and a qualified column from one that only ends the same.
#[test]
fn the_plan_checker_wants_the_leading_column() {
    let leading: HashMap<String, String> = [("contracts_by_parent", "parent_seq")]
        .into_iter()
        .map(|(index, column)| (index.to_string(), column.to_string()))
        .collect();
    let plan = |cond: &str| {
        format!(
            "Index Scan using contracts_by_parent on contracts c  (cost=0.29..8.30)\n  Index Cond: ({cond})"
        )
    };
    assert!(scans(&plan("c.parent_seq = $1"), &leading).is_empty());
    assert!(scans(&plan("parent_seq = ANY ($1)"), &leading).is_empty());
    assert_eq!(scans(&plan("seq = $1"), &leading).len(), 1);
    assert_eq!(scans(&plan("xparent_seq = $1"), &leading).len(), 1);
    assert_eq!(
        scans("Seq Scan on draining  (cost=0.00..1.01)", &leading).len(),
        1
    );
    assert_eq!(
        scans(
            "Index Scan Backward using contracts_by_parent on contracts\n  Index Cond: (seq > $1)",
            &leading
        )
        .len(),
        1,
        "a backward scan is checked too"
    );
    assert_eq!(
        scans(
            "Index Scan using other on t\n  Index Cond: (a = $1)",
            &leading
        )
        .len(),
        1,
        "an index the catalog lacks"
    );
}

/// Positions come from `event_positions` under the clock's row lock,
/// which no transaction updates (migration 39): on a database whose clock
/// had given positions up to 41, migration 40 makes them go on at 42; a
/// burst of roots (several per transaction, on two writers) takes 42, 43,
/// … with neither gap nor repeat; the clock's row is never rewritten; the
/// migration run again later does not move positions back. Migration 41
/// drops the retired `last_pos`, so a replica from before 39 fails its
/// writes instead of giving positions that collide.
#[tokio::test]
async fn positions_go_on_after_the_clock_without_rewriting_it() {
    use crate::suite::{meta, test_root};
    let database = TestDatabase::migrated().await;
    let mut conn = PgConnection::connect(&database.url).await.expect("connect");
    let migration_40 =
        include_str!("../../migrations/postgres/0040_event_positions_after_clock.sql");
    let migration_41 =
        include_str!("../../migrations/postgres/0041_event_clock_last_pos_dropped.sql");
    // An earlier version's clock, then migrations 40 and 41 on it.
    let earlier_clock = || async {
        let mut conn = PgConnection::connect(&database.url).await.expect("connect");
        sqlx::raw_sql("ALTER TABLE event_clock ADD COLUMN last_pos BIGINT NOT NULL DEFAULT 41")
            .execute(&mut conn)
            .await
            .expect("an earlier version's clock");
        sqlx::raw_sql(migration_40)
            .execute(&mut conn)
            .await
            .expect("migration 40");
        sqlx::raw_sql(migration_41)
            .execute(&mut conn)
            .await
            .expect("migration 41");
    };
    earlier_clock().await;
    let version = "SELECT xmin::TEXT || ctid::TEXT FROM event_clock WHERE id = 1";
    let before: String = sqlx::query_scalar(version)
        .fetch_one(&mut conn)
        .await
        .expect("the clock row");
    let store = open_store(&database.url).await;
    let roots: u8 = 40;
    let mut opening = tokio::task::JoinSet::new();
    for n in 1..=roots {
        let store = store.clone();
        opening.spawn(async move { store.open_root(test_root(meta(3, n))).await });
    }
    while let Some(opened) = opening.join_next().await {
        opened.expect("joined").expect("opened");
    }
    let mut positions: Vec<i64> = sqlx::query_scalar("SELECT pos FROM events ORDER BY seq")
        .fetch_all(&mut conn)
        .await
        .expect("positions");
    positions.sort_unstable();
    assert_eq!(positions, (42..42 + i64::from(roots)).collect::<Vec<_>>());
    let after: String = sqlx::query_scalar(version)
        .fetch_one(&mut conn)
        .await
        .expect("the clock row");
    assert_eq!(before, after, "the clock's row is locked, never rewritten");
    // A replica migrating late (migration 40 again, the store serving)
    // does not move positions back, its clock's `last_pos` (41) behind.
    earlier_clock().await;
    store
        .open_root(test_root(meta(4, 1)))
        .await
        .expect("one more root");
    let last: i64 = sqlx::query_scalar("SELECT MAX(pos) FROM events")
        .fetch_one(&mut conn)
        .await
        .expect("positions");
    assert_eq!(last, 42 + i64::from(roots), "after every position given");
    // What a replica from before migration 39 does in every write.
    let fenced = sqlx::query("UPDATE event_clock SET last_pos = last_pos + 1 WHERE id = 1")
        .execute(&mut conn)
        .await
        .expect_err("last_pos is gone");
    assert!(
        matches!(&fenced, sqlx::Error::Database(d) if d.code().as_deref() == Some("42703")),
        "{fenced}"
    );
}

/// A drain committed while an issuance waited for its parent's lock is
/// seen by that issuance, on the locked path (the parent not cached by
/// the issuing replica): the drains are read after the parents' locks, in
/// a statement of their own (`writer::DRAINS_AND_NUMBERS`; the parents'
/// statement's snapshot predates its lock waits — read there, the drain
/// is missed and this test fails). The child is refused, never issued
/// under a frozen tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_committed_during_the_parents_lock_wait_is_seen() {
    let outcomes = drain_during_lock_wait(false).await;
    assert_eq!(outcomes, [0, 0, 0], "written, stale, draining");
}

/// The same on the optimistic path (the parent cached by the issuing
/// writer): its statement waits at the parent's update, and
/// `issuance_guard` reads the drains with a snapshot taken after that
/// wait, aborts, and the group is redone with the parent locked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_committed_during_an_optimistic_issuances_wait_is_seen() {
    let outcomes = drain_during_lock_wait(true).await;
    assert_eq!(outcomes[2], 1, "aborted for the drain: {outcomes:?}");
}

/// How many optimistic issuances a store with these test options and
/// one writer wrote, found stale, found draining.
fn optimistic_outcomes(metrics: &crate::metrics::StoreMetrics) -> [u64; 3] {
    ["written", "stale", "draining"].map(|outcome| {
        metrics
            .optimistic_issuances
            .with_label_values(&[outcome])
            .get()
    })
}

/// One writer, counted: whether a group is optimistic is then decided.
async fn counted_store(url: &str) -> (PostgresStore, crate::metrics::StoreMetrics) {
    let metrics = crate::metrics::StoreMetrics::new();
    let mut options = test_options(url);
    options.writers = 1;
    // No drainer: nothing but the tests moves a drain.
    options.drainer = false;
    options.metrics = Some(metrics.clone());
    (open_with(options, Arc::new(SystemClock)).await, metrics)
}

/// A child asked from a parent whose lock another transaction holds,
/// while that transaction starts a drain of the tree and commits: the
/// child is refused. `cached`: the parent was made by the issuing store
/// (its writer tries the optimistic path), else by another replica.
/// Returns the issuing store's optimistic outcomes for that child.
async fn drain_during_lock_wait(cached: bool) -> [u64; 3] {
    use crate::suite::{issued, meta, test_child, test_root};
    use sqlx::Connection as _;
    let database = TestDatabase::migrated().await;
    let (store, metrics) = counted_store(&database.url).await;
    let (maker, _) = counted_store(&database.url).await;
    let made_by = if cached { &store } else { &maker };
    let root = issued(made_by.open_root(test_root(meta(9, 1))).await);
    let parent = issued(made_by.delegate(test_child(9, 2, root, 8, "true")).await);
    let before = optimistic_outcomes(&metrics);
    let mut holder = sqlx::PgConnection::connect(&database.url)
        .await
        .expect("connect");
    let mut held = holder.begin().await.expect("begin");
    let root_seq: i64 =
        sqlx::query_scalar("SELECT root_seq FROM contracts WHERE id = $1 FOR UPDATE")
            .bind(parent.as_slice())
            .fetch_one(&mut *held)
            .await
            .expect("lock the parent");
    let issuing = tokio::spawn({
        let store = store.clone();
        async move { store.delegate(test_child(8, 3, parent, 7, "true")).await }
    });
    // Until the writer's statement waits for the parent's lock.
    let mut watcher = sqlx::PgConnection::connect(&database.url)
        .await
        .expect("connect");
    let mut waited = false;
    for _ in 0..1_000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .fetch_one(&mut watcher)
        .await
        .expect("activity");
        if waiting > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(waited, "the issuance never waited for the parent's lock");
    // The whole tree starts draining, committed while the issuance waits.
    sqlx::query(
        "INSERT INTO draining (target_seq, root_seq, status, started_at_ms) VALUES ($1, $1, $2, 0)",
    )
    .bind(root_seq)
    .bind(i64::from(Status::Revoked.as_i32()))
    .execute(&mut *held)
    .await
    .expect("drain");
    held.commit().await.expect("commit");
    let answer = issuing.await.expect("joined").expect("answered");
    assert!(
        matches!(answer.outcome, crate::Outcome::Receipt { .. }),
        "a child issued under a draining tree: {:?}",
        answer.outcome
    );
    let after = optimistic_outcomes(&metrics);
    [0, 1, 2].map(|i| after[i] - before[i])
}

/// An optimistic issuance from a parent another replica changed since
/// this writer cached it is aborted by the row-version check and redone
/// with the parent locked and read: the child that no longer fits is
/// refused, never issued from the stale ledger (which had room for it),
/// and the parent's ledger holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_changed_since_it_was_cached_is_read_again() {
    use crate::suite::{issued, meta, test_child, test_root};
    let database = TestDatabase::migrated().await;
    let (a, metrics) = counted_store(&database.url).await;
    let (b, _) = counted_store(&database.url).await;
    // Budget 100; the root is cached by `a`'s writer, which wrote it.
    let root = issued(a.open_root(test_root(meta(9, 1))).await);
    let mut first = test_child(9, 2, root, 8, "true");
    first.ask.budget = 60;
    issued(a.delegate(first).await);
    assert_eq!(
        optimistic_outcomes(&metrics),
        [1, 0, 0],
        "a delegation from the cached root is optimistic"
    );
    // Another replica reserves 30 more: 10 left.
    let mut other = test_child(9, 3, root, 7, "true");
    other.ask.budget = 30;
    issued(b.delegate(other).await);
    // `a`'s cache still says 40 left.
    let mut late = test_child(9, 4, root, 6, "true");
    late.ask.budget = 20;
    let answer = a.delegate(late).await.expect("answered");
    assert!(
        matches!(answer.outcome, crate::Outcome::Receipt { .. }),
        "a child issued from a stale ledger: {:?}",
        answer.outcome
    );
    assert_eq!(optimistic_outcomes(&metrics), [1, 1, 0], "aborted as stale");
    // The root's row as stored: (reserved, spent, budget).
    let row = async || -> (i64, i64, i64) {
        sqlx::query_as("SELECT reserved, spent, budget FROM contracts WHERE id = $1")
            .bind(root.as_slice())
            .fetch_one(&a.sql.reader)
            .await
            .expect("root")
    };
    let (reserved, spent, _) = row().await;
    assert_eq!((reserved, spent), (90, 0));
    // What is left is still given (by either path: the root is marked
    // contended until the writer's next replan).
    let mut fits = test_child(9, 5, root, 5, "true");
    fits.ask.budget = 10;
    issued(a.delegate(fits).await);
    let (reserved, _, budget) = row().await;
    assert_eq!((reserved, budget), (100, 100));
    assert_eq!(optimistic_outcomes(&metrics)[1], 1, "one stale attempt");
}

/// Nor is a refusal decided from a stale cached parent: a root of one
/// child at a time, its child revoked (the root's fan-out freed by a
/// lifecycle transaction, which the cache does not see), then another
/// child asked — issued, not refused for a fan-out no longer full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_not_decided_from_a_stale_cached_parent() {
    use crate::suite::{issued, meta, receipt, test_child, test_root};
    use broker_wire::command::{Action, LifecycleCommand};
    let database = TestDatabase::migrated().await;
    let (store, metrics) = counted_store(&database.url).await;
    let mut root = test_root(meta(9, 1));
    root.policy.max_children = 1;
    let root = issued(store.open_root(root).await);
    let first = issued(store.delegate(test_child(9, 2, root, 8, "true")).await);
    assert_eq!(optimistic_outcomes(&metrics), [1, 0, 0]);
    let revoked = receipt(
        store
            .transition(LifecycleCommand {
                request: Some(meta(9, 3)),
                contract_id: first,
                action: Action::Revoke {
                    reason: "done".into(),
                },
            })
            .await,
    );
    assert_eq!(revoked.kind, pb::ReceiptKind::Revoked as i32);
    issued(store.delegate(test_child(9, 4, root, 7, "true")).await);
    assert_eq!(
        optimistic_outcomes(&metrics),
        [1, 1, 0],
        "aborted as stale, then issued with the root locked"
    );
}
