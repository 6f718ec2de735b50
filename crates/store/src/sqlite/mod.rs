//! The embedded store: SQLite in WAL mode, every answer fsynced.
//!
//! All writes go through one writer task that owns the only write
//! connection and commits in groups: it takes every command queued while
//! the previous batch was being written (up to `max_batch`), applies them
//! in order inside one transaction — each seeing the effects of the ones
//! before it — and commits. The writer runs a batch's statements, BEGIN to
//! COMMIT, and its reads on its own thread with the connection taken from
//! sqlx's worker and kept across every batch but a drain's step (`raw`,
//! `held`; see `writer_loop` and `apply_held`). Reads use a separate pool of
//! read-only connections (WAL readers never block the writer).
//!
//! Durability is pipelined, not traded. SQLite runs with
//! `synchronous=NORMAL`, so a commit writes its WAL frames without waiting
//! for the disk; a second thread, the syncer, then fsyncs the WAL file and
//! only after that sends the batch's answers, while the writer is already
//! writing the next batch. One fsync covers every batch committed before
//! it. Nothing leaves the store before it is on disk: answers wait for the
//! syncer, Watch is woken by it, and every read waits, after its query,
//! until the last commit it could have seen is durable (`Durability`).
//! (SQLite itself still syncs the WAL before each checkpoint and the
//! database after it, and the WAL header when the WAL is reused.) If an
//! fsync fails the store stops: after a failed fsync the kernel may have
//! dropped the dirty pages, so only a restart (recovery from the disk)
//! knows what is durable.
//!
//! The SQL is portable (positional `$n` parameters, no SQLite-only syntax)
//! so the PostgreSQL backend can share it.

mod apply;
mod checkpoint;
mod durability;
mod gather;
mod health;
mod held;
mod migrate;
mod pcache;
pub mod probe;
mod raw;
#[cfg(test)]
mod tests;
mod writer;

use self::apply::*;
use self::checkpoint::*;
use self::durability::*;
use self::migrate::*;
use self::writer::*;
pub use super::sql::BeforeJudge;
use super::sql::drain;
use super::sql::lifecycle::{self, Writing};
use super::sql::plan::Sql;
use super::sql::plan::plan_statements;
use super::sql::requests::load_prior_requests;
use super::sql::rows::StoredContract;
use super::sql::source::Sqlx;
use super::sql::{Backend, KnownCache, Shared, SharedOptions, lock};
pub use crate::limits::sqlite::CHECKPOINT_INTERVAL;
pub use broker_domain::limits::{MAX_AUDIT_BYTES, MAX_AUDIT_ROWS};
pub use checkpoint::WAL_RESTART_BYTES;
pub use durability::{SLOW_WAL_SYNC_US, WAL_SYNCS, WalSyncSnapshot, WalSyncStats};

use std::os::unix::fs::MetadataExt;

use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::Arc;

use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};

use sqlx::{Connection, Row};

use tokio::sync::{mpsc, oneshot};

use std::collections::HashMap;

use sqlx::Sqlite;

use super::batch::{self, Command, KnownMap, Plan, PriorRequest, RequestKey, Speculation};

use super::recent::RecentRequests;

use super::{
    Answer, AuditFacts, ContractRecord, Event, IssuingParent, Outcome, RunFacts, Store, StoreError,
    TreeMutations, backend, backend_ref,
};

use broker_wire::clock::Clock;

use broker_wire::command::LifecycleCommand;

use broker_wire::command::{NewChild, NewRoot, RequestMeta};

use broker_domain::{AgentKey, Id, Status};

use broker_wire::pb;

use super::limits::ROWS_PER_STATEMENT;
use super::limits::sqlite::{MAX_UNSYNCED_BATCHES, STATEMENT_CACHE_CAPACITY};
use broker_wire::stamp::Stamper;

/// SQLite as the shared SQL's dialect.
impl super::sql::Dialect for Sqlite {
    /// SQLite has one writer at a time and no row locks: the writer's
    /// transaction already excludes every other.
    const LOCK_ROWS: &'static str = "";
    /// The single writer numbers contracts and receipts itself.
    type Seqs = i64;

    /// Nothing to reserve: the writer's counter is authoritative.
    async fn reserve_seqs(
        _: &mut SqliteConnection,
        _: &mut i64,
        _: usize,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }
}

/// Tunables of the embedded store.
#[derive(Clone, Debug)]
pub struct SqliteOptions {
    /// The database file; created on first start.
    pub path: PathBuf,
    /// Commands that may wait for the writer; beyond it callers get
    /// RESOURCE_EXHAUSTED instead of unbounded memory growth.
    pub queue_depth: usize,
    /// Most commands committed together.
    pub max_batch: usize,
    /// Read-only connections for queries.
    pub read_connections: u32,
    /// WAL size past which the writer finishes a checkpoint so the WAL
    /// restarts (`WAL_RESTART_BYTES` in production; tests lower it).
    pub wal_restart_bytes: u64,
    /// How often the background checkpointer copies the WAL back
    /// (`CHECKPOINT_INTERVAL` in production; tests shorten it).
    pub checkpoint_interval: Duration,
    /// Request-log entries older than this (ms) are deleted by the writer
    /// (see `prune_requests`).
    pub request_log_retention_ms: i64,
    /// The broker's timestamp window (`limits.timestamp_window_ms`): how
    /// far back the writer's recent-request set must reach.
    pub timestamp_window_ms: i64,
    /// Most rows (contracts, observations, receipts) one audit read may load
    /// (`MAX_AUDIT_ROWS` in production; tests lower it).
    pub max_audit_rows: i64,
    /// Most bytes of envelopes and paths one audit read may load
    /// (`MAX_AUDIT_BYTES` in production; tests lower it).
    pub max_audit_bytes: usize,
    /// Fault injection for tests; `None` in production.
    pub before_wal_sync: Option<BeforeWalSync>,
    /// Test hook run on a judge thread before each judgment; `None` in
    /// production.
    pub before_judge: Option<BeforeJudge>,
    /// Longest a completion waits for its judgment, queueing for a judge
    /// included (`JUDGMENT_DEADLINE_MS` in production; tests lower it).
    pub judgment_deadline_ms: u64,
    /// Most descendants one writer transaction ends: a request that would
    /// end more starts a drain (`limits.cascade_step_rows`).
    pub cascade_step_rows: usize,
    /// Runs the drainer, which ends drains in steps (always, but in tests
    /// that step drains by hand).
    pub drainer: bool,
    /// Who shares the judges fairly: a tree's tenant is its opener's
    /// (`core::tenant`); empty, every tree shares the open tenant.
    pub tenants: Arc<broker_domain::tenant::Tenants>,
    /// Where the writer and syncer report batch sizes and fsyncs (the
    /// server's `/metrics`); `None` reports nowhere.
    pub metrics: Option<crate::metrics::StoreMetrics>,
}

/// Runs on the syncer before each WAL fsync; an error counts as a failed
/// fsync, and blocking holds the syncer. Lets tests reach the paths a real
/// disk rarely takes (a failed fsync, a slow one).
#[derive(Clone)]
pub struct BeforeWalSync(pub Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>);

impl std::fmt::Debug for BeforeWalSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeWalSync(..)")
    }
}

use super::Reply;

/// SQLite-backed `Store`.
#[derive(Clone)]
pub struct SqliteStore {
    /// The queue to the single writer task, the stamper, the read pool
    /// (read-only connections), the writer's cache and the judges
    /// (`store::sql::Shared`).
    sql: Arc<Shared<Sqlite>>,
    /// Which commits are durable; every read waits on it.
    durability: Durability,
    /// Which trees got events recently (the writer's, shared).
    trees: super::TreeChanges,
    /// False while the disk refuses writes (see `health`).
    writable: tokio::sync::watch::Receiver<bool>,
    /// Keys bound to workload identities, in memory (`identities`).
    identities: Arc<crate::identities::Bindings>,
}

/// For tests that open SQLite without `connect_options`: the store's page
/// cache can only be installed before anything initializes SQLite, so
/// they register first (`gather::register`, once a process).
#[cfg(test)]
pub(crate) fn before_sqlite() {
    gather::register().expect("the store's VFS and page cache register");
}

/// The connection settings of every connection to the database.
fn connect_options(path: &Path) -> Result<SqliteConnectOptions, StoreError> {
    gather::register().map_err(StoreError::Backend)?;
    Ok(SqliteConnectOptions::new()
        .filename(path)
        // The default VFS, but a COMMIT on the writer's thread writes its
        // WAL frames with one call instead of two a frame (`gather`).
        .vfs(gather::VFS_NAME)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // Commits do not wait for the disk; the syncer fsyncs the WAL
        // before any answer leaves (see the module docs).
        .synchronous(SqliteSynchronous::Normal)
        // 4 MiB of page cache: the recent (hot) end of every index
        // stays in memory. It was held small because SQLite rescanned
        // the whole cache at most commits while the database is under
        // 1 GiB; the store's page cache (`pcache`) skips that scan now,
        // and 16 MiB showed no clear gain over 4 (docs/benchmarks-history.md).
        // Readers' caches are flushed whenever the WAL changed anyway.
        .pragma("cache_size", "-4096")
        // Checkpoints run on their own connection (see `checkpointer`),
        // not inside the writer's commits.
        .pragma("wal_autocheckpoint", "0")
        // Multi-row statements need a statement journal (to undo a
        // half-applied statement); in memory it costs a copy, on disk a
        // write per page.
        .pragma("temp_store", "MEMORY")
        // Multi-row statements differ by row count: one cached
        // statement per count, or every batch re-parses its SQL.
        .statement_cache_capacity(STATEMENT_CACHE_CAPACITY)
        .busy_timeout(Duration::from_secs(10)))
}

impl SqliteStore {
    /// Opens (creating if needed) the database, migrates it and starts the
    /// writer task.
    pub async fn open(
        options: SqliteOptions,
        stamper: Arc<Stamper>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        // Blocking file work (an fsync): off the runtime's threads.
        let (database, wal_bytes) = (options.path.clone(), options.wal_restart_bytes);
        tokio::task::spawn_blocking(move || reserve_wal(&database, wal_bytes))
            .await
            .map_err(|e| StoreError::Backend(format!("reserving the WAL: {e}")))?;
        let connect = connect_options(&options.path)?;
        let (commands, queue) = mpsc::channel(options.queue_depth.max(1));
        let known = KnownCache::new(std::sync::Mutex::new(KnownMap::preallocated()));
        let trees = super::TreeChanges::default();
        let (durable_tx, durable) = tokio::sync::watch::channel(0u64);
        let committed = Arc::new(AtomicU64::new(0));
        let (synced, sync_queue) = mpsc::channel(MAX_UNSYNCED_BATCHES);
        start_syncer(&options, sync_queue, durable_tx)?;
        let finish_checkpoint = Arc::new(AtomicBool::new(false));
        let (writable_tx, writable) = tokio::sync::watch::channel(true);
        let writer = WriterStart {
            writable: writable_tx,
            connect: connect.clone(),
            queue,
            known: known.clone(),
            trees: trees.clone(),
            committed: committed.clone(),
            synced,
            finish_checkpoint: finish_checkpoint.clone(),
            stamper: stamper.clone(),
            clock: clock.clone(),
            options: options.clone(),
        };
        start_writer(writer)?
            .await
            .map_err(|_| StoreError::Closed)??;
        let checkpoints = SqliteConnection::connect_with(&connect)
            .await
            .map_err(backend)?;
        tokio::spawn(checkpointer(
            checkpoints,
            commands.downgrade(),
            finish_checkpoint,
            options.wal_restart_bytes,
            options.checkpoint_interval,
        ));
        let reader = SqlitePoolOptions::new()
            .max_connections(options.read_connections.max(1))
            // No ping before each read: a file connection has no server
            // to lose it, and the ping is a round trip to the
            // connection's thread on every read.
            .test_before_acquire(false)
            .after_connect(|conn, _| Box::pin(raw::plan_stably(conn)))
            // SQLite's default 2 MiB: a reader's cache is emptied at the
            // start of every read after a commit, so more would only hold
            // memory.
            .connect_with(connect.read_only(true).pragma("cache_size", "-2048"))
            .await
            .map_err(backend)?;
        if options.drainer {
            tokio::spawn(drain::drainer(
                reader.clone(),
                commands.downgrade(),
                options.tenants.clone(),
            ));
        }
        let shared = SharedOptions {
            judgment_deadline_ms: options.judgment_deadline_ms,
            before_judge: options.before_judge.clone(),
            max_audit_rows: options.max_audit_rows,
            max_audit_bytes: options.max_audit_bytes,
            tenants: options.tenants.clone(),
        };
        Ok(Self {
            sql: Arc::new(Shared::new(
                commands, stamper, reader, known, clock, shared,
            )?),
            trees,
            durability: Durability { committed, durable },
            writable,
            identities: Arc::default(),
        })
    }

    /// Resolves when the store can no longer make anything durable: its
    /// syncer stopped, after a failed fsync (the store refuses every write
    /// from then on) or at shutdown. Holds only a watch receiver, so it
    /// does not keep the store alive.
    pub fn durability_lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut durable = self.durability.durable.clone();
        async move { while durable.changed().await.is_ok() {} }
    }

    /// True while the disk takes writes; false from a write that failed
    /// for the storage's sake until a probe write (or a batch) commits.
    pub fn writable(&self) -> tokio::sync::watch::Receiver<bool> {
        self.writable.clone()
    }

    /// Contracts open or accepted now (one count over the status index).
    pub async fn open_contracts(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar("SELECT COUNT(*) FROM contracts WHERE status IN ($1, $2)")
            .bind(Status::Open as i64)
            .bind(Status::Accepted as i64)
            .fetch_one(&self.sql.reader)
            .await
            .map_err(backend)
    }

    /// Commands waiting for the writer now (the write queue's depth).
    pub fn queue_depth(&self) -> usize {
        self.sql.queue_depth()
    }

    /// Stamps a child from the cached parent, so the signing happens here
    /// rather than on the single writer. `None` when the parent is not
    /// cached or the check (against possibly stale state) refuses.
    fn speculate(&self, child: &NewChild) -> Option<Box<Speculation>> {
        let view = {
            let known = self.sql.known.lock().ok()?;
            known.get(&child.parent_id)?.view.clone()
        };
        Speculation::new(&view, child, &self.sql.stamper, self.sql.clock.now_ms())
    }
}

impl Backend for SqliteStore {
    type Db = Sqlite;

    fn sql(&self) -> &Shared<Sqlite> {
        &self.sql
    }

    /// Waits until everything a read could have seen is durable (see
    /// `Durability::settle`).
    async fn settle(&self) -> Result<(), StoreError> {
        self.durability.settle().await
    }
}

impl Store for SqliteStore {
    // The methods both backends answer with the shared SQL (`store::sql`).
    crate::sql_store_methods!();

    async fn delegate(&self, child: NewChild) -> Result<Answer, StoreError> {
        let speculation = self.speculate(&child);
        self.sql
            .submit(Command::Delegate(Box::new(child), speculation))
            .await
    }

    async fn events(
        &self,
        contract: Id,
        cursor: i64,
        limit: u32,
        max_bytes: usize,
    ) -> Result<Vec<Event>, StoreError> {
        events(self, contract, cursor, limit, max_bytes).await
    }

    fn commits(&self) -> tokio::sync::watch::Receiver<u64> {
        self.durability.durable.clone()
    }

    fn tree_changes(&self) -> super::TreeChanges {
        self.trees.clone()
    }

    async fn broker_keys(&self) -> Result<Option<Vec<pb::BrokerKey>>, StoreError> {
        Ok(None)
    }

    async fn bind_identity(
        &self,
        binding: crate::IdentityBinding,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        self.identities.bind(binding, now_ms)
    }

    async fn identity_of(
        &self,
        key: AgentKey,
        now_ms: i64,
    ) -> Result<Option<crate::IdentityBinding>, StoreError> {
        Ok(self.identities.of(&key, now_ms))
    }
}

/// Watch's events: contracts and receipts of the subtree share one
/// counter, so the cursor is the sequence number itself (one writer
/// commits in sequence order).
async fn events(
    store: &SqliteStore,
    contract: Id,
    cursor: i64,
    limit: u32,
    max_bytes: usize,
) -> Result<Vec<Event>, StoreError> {
    let mut conn = store.sql.read().await?;
    let mut rows = sqlx::query(
        "WITH RECURSIVE sub(seq) AS (\
             SELECT seq FROM contracts WHERE id = $1 \
             UNION ALL SELECT c.seq FROM contracts c JOIN sub ON c.parent_seq = sub.seq) \
         SELECT seq AS position, 1 AS kind, envelope FROM contract_envelopes \
             WHERE seq > $2 AND seq IN (SELECT seq FROM sub) \
         UNION ALL \
         SELECT seq, 2 AS kind, envelope FROM receipts \
             WHERE seq > $2 AND contract_seq IN (SELECT seq FROM sub) \
         ORDER BY position LIMIT $3",
    )
    .bind(contract.as_slice())
    .bind(cursor)
    .bind(i64::from(limit))
    .fetch(&mut *conn);
    let events =
        super::sql::reads::collect_events::<Sqlite>(&mut rows, |seq| seq, max_bytes).await?;
    drop(rows);
    drop(conn);
    store.settle().await?;
    Ok(events)
}

/// Stack of the writer thread: it plans and checks with the core, which
/// recurses like a judge does (see `store::sql::JUDGE_STACK_BYTES`).
const WRITER_STACK_BYTES: usize = super::limits::JUDGE_STACK_BYTES;
