//! The shared store: PostgreSQL, for several stateless broker replicas
//! over one database. Only what differs from SQLite lives here; the SQL
//! both backends run (reads, audits, lifecycle, judging, a batch's writes)
//! is `store::sql`, compiled here against PostgreSQL's types.
//!
//! No replica holds authoritative state. Each replica's writers take
//! queued commands in groups, like SQLite's single writer, but every group
//! is one PostgreSQL transaction that loads what it decides on under row
//! locks (`SELECT … FOR UPDATE`, always in (depth, id) order, so replicas
//! never wait for each other in a cycle), plans with the same
//! backend-neutral planner and core, writes and commits. A transaction
//! that meets a serialization failure, a deadlock or a concurrent insert
//! of the same request key is redone whole, a bounded number of times with
//! jitter (`writer`); past that the caller gets UNAVAILABLE naming the
//! contention. A retry after an ambiguous commit is answered from the
//! request log, never reserved twice.
//!
//! Watch reads an outbox (`events`) whose positions each transaction
//! gives its own events in commit order, under one row lock held for its
//! commit (`events.rs`). Commits are durable when
//! PostgreSQL acknowledges them (`synchronous_commit = on`, its default),
//! so reads need no durability barrier.
//!
//! Portable to PostgreSQL-wire distributed engines: no advisory locks, no
//! LISTEN/NOTIFY, no `FOR SHARE`, one DDL statement per migration, and no
//! correctness resting on sequence order (see ARCHITECTURE.md).

mod events;
mod failure;
mod identities;
pub mod migrate;
pub mod probe;
#[doc(hidden)]
pub mod testing;

mod seqs;
#[cfg(test)]
mod tests;
mod unnest;
mod writer;

use self::writer::*;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres};
use tokio::sync::mpsc;

use super::batch::{self, Command, KnownMap, RequestKey};
use super::{
    Answer, AuditFacts, ContractRecord, Event, IssuingParent, RunFacts, Store, StoreError,
    TreeMutations, backend, backend_ref,
};
use broker_domain::{AgentKey, Id, Status};
use broker_wire::clock::Clock;
use broker_wire::command::{LifecycleCommand, NewChild, NewRoot, RequestMeta};
use broker_wire::pb;
use broker_wire::stamp::Stamper;

pub use super::sql::BeforeJudge;
use super::sql::drain;
use super::sql::lifecycle;
use super::sql::requests::load_prior_requests;
use super::sql::rows::StoredContract;
use super::sql::source::Sqlx;
use super::sql::{Backend, KnownCache, Shared, SharedOptions, lock};
pub use broker_domain::limits::{MAX_AUDIT_BYTES, MAX_AUDIT_ROWS};

/// PostgreSQL as the shared SQL's dialect.
impl super::sql::Dialect for Postgres {
    /// Every contract a transaction decides on is locked until it commits;
    /// the shared queries lock in (depth, id) order.
    const LOCK_ROWS: &'static str = " FOR UPDATE";
    /// Numbers the database reserved for one transaction.
    type Seqs = Reserved;

    /// Reserves `count` more numbers for `seqs` (see `Reserved`).
    async fn reserve_seqs(
        conn: &mut PgConnection,
        seqs: &mut Reserved,
        count: usize,
    ) -> Result<(), sqlx::Error> {
        seqs.reserve(conn, count).await
    }
}

use super::Reply;
use super::limits::postgres::{PING_IDLE_AFTER, STATEMENT_CACHE_CAPACITY};

/// Tunables of the shared store.
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    /// `postgres://user@host:port/database`.
    pub url: String,
    /// Apply pending migrations at start (off when a deployment runs
    /// `delegation-broker migrate` once, as a job).
    pub migrate: bool,
    /// Connections for reads (the writers have their own).
    pub read_connections: u32,
    /// Concurrent write transactions of this replica: while one commits
    /// (waiting for PostgreSQL's WAL flush) the next is being written.
    pub writers: usize,
    /// Commands that may wait for a writer; beyond it callers get
    /// UNAVAILABLE (`limits.writer_queue_depth`).
    pub queue_depth: usize,
    /// Most commands one transaction carries (`limits.max_batch`).
    pub max_batch: usize,
    /// Request-log entries older than this (ms) are deleted.
    pub request_log_retention_ms: i64,
    pub max_audit_rows: i64,
    pub max_audit_bytes: usize,
    /// Test hook run on a judge thread before each judgment.
    pub before_judge: Option<BeforeJudge>,
    /// Longest a completion waits for its judgment.
    pub judgment_deadline_ms: u64,
    /// Most descendants one writer transaction ends: a request that would
    /// end more starts a drain (`limits.cascade_step_rows`).
    pub cascade_step_rows: usize,
    /// Runs the drainer, which ends drains in steps (always, but in tests
    /// that step drains by hand).
    pub drainer: bool,
    /// Longest a writer or reader waits for a connection before the
    /// caller is answered UNAVAILABLE (the database is unreachable).
    pub connect_timeout_ms: u64,
    /// Who shares the judges fairly: a tree's tenant is its opener's
    /// (`core::tenant`); empty, every tree shares the open tenant.
    pub tenants: Arc<broker_domain::tenant::Tenants>,
    /// Where the writers report their group sizes (the server's
    /// `/metrics`); `None` reports nowhere.
    pub metrics: Option<crate::metrics::StoreMetrics>,
}

impl PostgresOptions {
    /// Production defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            migrate: true,
            read_connections: 16,
            writers: DEFAULT_WRITERS,
            queue_depth: 16_384,
            max_batch: 512,
            request_log_retention_ms: 24 * 3_600_000,
            max_audit_rows: MAX_AUDIT_ROWS,
            max_audit_bytes: MAX_AUDIT_BYTES,
            before_judge: None,
            judgment_deadline_ms: broker_domain::limits::JUDGMENT_DEADLINE_MS,
            cascade_step_rows: crate::limits::DEFAULT_CASCADE_STEP_ROWS,
            drainer: true,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            tenants: Arc::default(),
            metrics: None,
        }
    }
}

/// Write transactions in flight per replica by default
/// (`limits.database_writers`): one writer gathers everything queued while
/// its last group committed, and larger groups cost the database less
/// per write (measured: 4 writers made groups of ~3 commands and took
/// twice the database CPU per delegation; see BENCHMARKS.md).
pub const DEFAULT_WRITERS: usize = 1;

/// How long a request waits for a database connection by default.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;

/// PostgreSQL-backed `Store`: one replica's handle on the shared database.
#[derive(Clone)]
pub struct PostgresStore {
    /// The queue to this replica's writers, the stamper, the read pool,
    /// the terms cache and the judges (`store::sql::Shared`).
    sql: Arc<Shared<Postgres>>,
    /// Which trees got events, fed by the sequencer (positions, not seqs).
    trees: super::TreeChanges,
    /// Bumped whenever new event positions became visible.
    commits: tokio::sync::watch::Receiver<u64>,
    /// This database's cursor tag (see `events`).
    tag: i64,
    /// False while the database cannot be reached (health).
    reachable: tokio::sync::watch::Receiver<bool>,
    /// The writers' pool, for its gauges (`pool_stats`).
    write_pool: sqlx::PgPool,
}

/// One connection pool's state, for `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// `write` (this replica's writers and sequencer) or `read`.
    pub pool: &'static str,
    /// Connections open, in use or idle.
    pub open: u32,
    pub idle: u32,
    /// The most the pool opens.
    pub max: u32,
}

/// The pool options every pool of this store shares.
fn pool_options(options: &PostgresOptions, connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(connections.max(1))
        .acquire_timeout(Duration::from_millis(options.connect_timeout_ms.max(1)))
        // A connection PostgreSQL closed (a restart) is found before use
        // when it has sat idle; one in steady use is not pinged (a round
        // trip to the server on every acquire): if the server went away
        // under it, its first query fails (UNAVAILABLE) and it is dropped.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for < PING_IDLE_AFTER {
                    return Ok(true);
                }
                Ok(sqlx::Connection::ping(conn).await.is_ok())
            })
        })
}

/// Connection settings from the URL; a bad URL names itself.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, StoreError> {
    // sqlx would read any scheme as PostgreSQL's and fail later, at the
    // connection, with a message that does not name the cause.
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    if !matches!(scheme, "postgres" | "postgresql") {
        return Err(StoreError::Backend(format!(
            "database URL: the scheme {scheme:?} is not postgres:// or postgresql:// (the only shared database; SQLite needs no URL, only --data-dir)"
        )));
    }
    url.parse::<PgConnectOptions>()
        .map(|options| {
            options
                .statement_cache_capacity(STATEMENT_CACHE_CAPACITY)
                // A generic plan of `id = ANY($1)` does not know how many
                // ids the array holds, and on these tables chose scans
                // that grew with the table (2 ms per batch at 5,000
                // contracts); a custom plan seeks every time. (Issuance
                // transactions keep generic plans made without scans:
                // `writer::WRITER_SETTINGS`.)
                //
                // No JIT: these statements are short, and compiling one
                // costs more than running it (a plan whose estimate passes
                // `jit_above_cost`, like a count over a large table, was
                // compiled at every call).
                .options([("plan_cache_mode", "force_custom_plan"), ("jit", "off")])
        })
        .map_err(|e| StoreError::Backend(format!("database URL: {e}")))
}

/// One plain connection first: a pool that cannot connect says only
/// "pool timed out"; this says why (refused, auth, no such database), and
/// where.
async fn reach(connect: &PgConnectOptions, at: &str, timeout_ms: u64) -> Result<(), StoreError> {
    let probe = tokio::time::timeout(
        Duration::from_millis(timeout_ms.max(1)),
        PgConnection::connect_with(connect),
    )
    .await
    .map_err(|_| {
        StoreError::Backend(format!(
            "PostgreSQL at {at}: no connection within {timeout_ms} ms"
        ))
    })?
    .map_err(|e| StoreError::Backend(format!("PostgreSQL at {at}: {e}")))?;
    let _ = sqlx::Connection::close(probe).await;
    Ok(())
}

/// Where a database is, for error messages: user, host, port, database
/// (never the password).
pub fn describe(connect: &PgConnectOptions) -> String {
    format!(
        "{}@{}:{}/{}",
        connect.get_username(),
        connect.get_host(),
        connect.get_port(),
        connect.get_database().unwrap_or("(default database)")
    )
}

impl PostgresStore {
    /// Connects, migrates when asked, refuses a database in another
    /// format, and starts this replica's writers and sequencer.
    pub async fn open(
        options: PostgresOptions,
        stamper: Arc<Stamper>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        let connect = connect_options(&options.url)?;
        let at = describe(&connect);
        reach(&connect, &at, options.connect_timeout_ms).await?;
        if options.migrate {
            for (version, description) in migrate::run(&connect).await? {
                tracing::info!(version, %description, "applied migration");
            }
        }
        let writers = options.writers.max(1);
        let in_database = |e: sqlx::Error| StoreError::Backend(format!("PostgreSQL at {at}: {e}"));
        // The writers', and one for the sequencer's leftovers pass and for
        // opening its own poll connection (taken out of the pool: it is
        // not counted in the pool's gauges).
        // The writers' settings (`writer::WRITER_SETTINGS`) follow the
        // URL's options, so they win; the sequencer sets its own.
        let write_pool = pool_options(&options, u32::try_from(writers + 1).unwrap_or(u32::MAX))
            .connect_with(connect.clone().options(writer::WRITER_SETTINGS))
            .await
            .map_err(in_database)?;
        migrate::check(&write_pool).await?;
        let reader = pool_options(&options, options.read_connections)
            .connect_with(connect)
            .await
            .map_err(in_database)?;
        let tag = events::tag(&reader).await?;
        let (commands, queue) = mpsc::channel(options.queue_depth.max(1));
        let known = KnownCache::new(std::sync::Mutex::new(KnownMap::preallocated()));
        let trees = super::TreeChanges::polled_by_sequencer();
        let (commits_tx, commits) = tokio::sync::watch::channel(0u64);
        let commits_tx = Arc::new(commits_tx);
        let (reachable_tx, reachable) = tokio::sync::watch::channel(true);
        let queue = Arc::new(tokio::sync::Mutex::new(queue));
        let numbers = Arc::new(std::sync::Mutex::new(writer::Prefetched::default()));
        for number in 0..writers {
            let writer = Writer {
                pool: write_pool.clone(),
                queue: queue.clone(),
                stamper: stamper.clone(),
                clock: clock.clone(),
                known: known.clone(),
                max_batch: options.max_batch.max(1),
                tag,
                trees: trees.clone(),
                commits: commits_tx.clone(),
                reachable: reachable_tx.clone(),
                // One writer per replica prunes; every replica does.
                prune: (number == 0).then_some(options.request_log_retention_ms),
                metrics: options.metrics.clone(),
                cascade_step_rows: options.cascade_step_rows.max(1),
                drain_pace: Default::default(),
                held: None,
                replanned_at: None,
                numbers: numbers.clone(),
                draining_roots: std::collections::HashSet::new(),
                peak_group: 0,
                contended: std::collections::HashSet::new(),
            };
            tokio::spawn(writer.run());
        }
        if options.drainer {
            tokio::spawn(drain::drainer(
                reader.clone(),
                commands.downgrade(),
                options.tenants.clone(),
            ));
        }
        tokio::spawn(events::sequencer(
            write_pool.clone(),
            tag,
            trees.clone(),
            commits_tx,
            commands.downgrade(),
            reachable_tx,
            Duration::from_millis(options.connect_timeout_ms.max(1)),
        ));
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
            commits,
            tag,
            reachable,
            write_pool,
        })
    }

    /// Whether the database answered this replica's last write (health).
    pub fn reachable(&self) -> tokio::sync::watch::Receiver<bool> {
        self.reachable.clone()
    }

    /// Contracts open or accepted now.
    pub async fn open_contracts(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar("SELECT COUNT(*) FROM contracts WHERE status IN ($1, $2)")
            .bind(i64::from(Status::Open.as_i32()))
            .bind(i64::from(Status::Accepted.as_i32()))
            .fetch_one(&self.sql.reader)
            .await
            .map_err(backend)
    }

    /// Both pools' connections now.
    pub fn pool_stats(&self) -> [PoolStats; 2] {
        let stats = |pool: &'static str, p: &sqlx::PgPool| PoolStats {
            pool,
            open: p.size(),
            idle: u32::try_from(p.num_idle()).unwrap_or(u32::MAX),
            max: p.options().get_max_connections(),
        };
        [
            stats("write", &self.write_pool),
            stats("read", &self.sql.reader),
        ]
    }

    /// How long taking a connection from the read pool takes now (a
    /// probe: sqlx keeps no acquire timings); an error when none came
    /// within the pool's timeout.
    pub async fn probe_acquire(&self) -> Result<Duration, StoreError> {
        let started = std::time::Instant::now();
        let conn = self.sql.reader.acquire().await.map_err(backend)?;
        let waited = started.elapsed();
        drop(conn);
        Ok(waited)
    }

    /// Commands waiting for this replica's writers.
    pub fn queue_depth(&self) -> usize {
        self.sql.queue_depth()
    }

    /// Registers this replica's public signing keys (current and retired)
    /// and returns every key registered by any replica, current ones first.
    pub async fn register_keys(
        &self,
        current: &[u8; 32],
        retired: &[[u8; 32]],
    ) -> Result<Vec<pb::BrokerKey>, StoreError> {
        migrate::register_keys(&self.sql.reader, current, retired, self.sql.clock.now_ms()).await?;
        migrate::broker_keys(&self.sql.reader).await
    }

    /// Says this replica is alive and retires the keys of replicas silent
    /// for `ttl_ms` (see `migrate::heartbeat`).
    pub async fn heartbeat(
        &self,
        current: &[u8; 32],
        ttl_ms: i64,
    ) -> Result<(migrate::Heartbeat, Vec<String>), StoreError> {
        migrate::heartbeat(&self.sql.reader, current, ttl_ms).await
    }
}

impl Backend for PostgresStore {
    type Db = Postgres;

    fn sql(&self) -> &Shared<Postgres> {
        &self.sql
    }

    /// Nothing to wait for: PostgreSQL acknowledges a commit once durable.
    async fn settle(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

impl Store for PostgresStore {
    // The methods both backends answer with the shared SQL (`store::sql`).
    crate::sql_store_methods!();

    async fn delegate(&self, child: NewChild) -> Result<Answer, StoreError> {
        // No speculation: another replica may change the parent at any
        // time, so the child is stamped under the parent's row lock.
        self.sql
            .submit(Command::Delegate(Box::new(child), None))
            .await
    }

    async fn events(
        &self,
        contract: Id,
        cursor: i64,
        limit: u32,
        max_bytes: usize,
    ) -> Result<Vec<Event>, StoreError> {
        events::events(self, contract, cursor, limit, max_bytes).await
    }

    fn commits(&self) -> tokio::sync::watch::Receiver<u64> {
        self.commits.clone()
    }

    fn tree_changes(&self) -> super::TreeChanges {
        self.trees.clone()
    }

    async fn broker_keys(&self) -> Result<Option<Vec<pb::BrokerKey>>, StoreError> {
        migrate::broker_keys(&self.sql.reader).await.map(Some)
    }

    async fn bind_identity(
        &self,
        binding: crate::IdentityBinding,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        identities::bind(&self.sql.reader, &binding, now_ms).await
    }

    async fn identity_of(
        &self,
        key: AgentKey,
        now_ms: i64,
    ) -> Result<Option<crate::IdentityBinding>, StoreError> {
        identities::of(&self.sql.reader, &key, now_ms).await
    }
}
