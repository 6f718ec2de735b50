//! The embedded store: SQLite in WAL mode, every answer fsynced.
//!
//! All writes go through one writer task that owns the only write
//! connection and commits in groups: it takes every command queued while
//! the previous batch was being written (up to `max_batch`), applies them
//! in order inside one transaction — each seeing the effects of the ones
//! before it — and commits. Most batches reach SQLite as a single script,
//! BEGIN to COMMIT (see `apply_batch`). Reads use a separate pool of
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

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prost::Message;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot};

use std::collections::HashMap;

use sqlx::{QueryBuilder, Sqlite};

use super::batch::{self, Command, Known, KnownMap, Plan, PriorRequest, RequestKey, Speculation};
use super::lifecycle::JudgeInputs;
use super::recent::RecentRequests;
use super::{
    Answer, AuditFacts, ContractRecord, Event, IssuingParent, Outcome, RunFacts, Store, StoreError,
    TreeMutations,
};
use crate::clock::Clock;
use crate::command::{Action, CompleteArgs, LifecycleCommand};
use crate::command::{NewChild, NewRoot, RequestMeta};
use crate::core::{AgentKey, Id, Ledger, Liability, ParentView, Policy, Predicate, Scope, Status};
use crate::pb;
use crate::stamp::Stamper;

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

/// Runs on a judge thread before it judges (see `prejudge`); blocking
/// holds the thread and its permit. Lets tests see how many judge at once.
#[derive(Clone)]
pub struct BeforeJudge(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for BeforeJudge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeJudge(..)")
    }
}

type Reply = oneshot::Sender<Result<Answer, StoreError>>;

/// Contracts' status and ledger as the writer last planned them. The writer
/// owns every write, so it is authoritative for the writer; callers read it
/// only to stamp speculatively (see `batch::Speculation`).
type KnownCache = Arc<Mutex<KnownMap>>;

/// SQLite-backed `Store`.
#[derive(Clone)]
pub struct SqliteStore {
    /// Queue to the single writer task; it exits when every clone is gone.
    commands: mpsc::Sender<(Command, Reply)>,
    /// Read-only connections for queries.
    reader: SqlitePool,
    known: KnownCache,
    /// Signs speculative stamps on the caller's task, in parallel.
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    /// Which commits are durable; every read waits on it.
    durability: Durability,
    /// Which trees got events recently (the writer's, shared).
    trees: super::TreeChanges,
    /// The threads that judge completions, `MAX_CONCURRENT_JUDGMENTS` of
    /// them with deep stacks (CEL recurses); they stop when every clone of
    /// the store is gone.
    judges: crate::pool::WorkPool,
    /// `SqliteOptions::judgment_deadline_ms`.
    judgment_deadline: Duration,
    /// Completions being judged, one per contract (a second one waits for
    /// the first to be answered).
    judging_contracts: Arc<crate::slots::Slots<Id>>,
    /// Completions being judged per signing key: one delegate cannot take
    /// every judge.
    judging_signers: Arc<crate::slots::Slots<AgentKey>>,
    /// `SqliteOptions::before_judge`.
    before_judge: Option<BeforeJudge>,
    /// `SqliteOptions::max_audit_rows`.
    max_audit_rows: i64,
    /// `SqliteOptions::max_audit_bytes`.
    max_audit_bytes: usize,
}

/// Commit numbers: the writer takes the next one just before each COMMIT,
/// the syncer publishes the last one whose WAL frames are on disk.
#[derive(Clone)]
struct Durability {
    /// Taken before COMMIT starts, so a reader that saw a commit's rows
    /// also sees its number here (or a later one).
    committed: Arc<AtomicU64>,
    /// Published by the syncer after each fsync; closed if it stopped.
    durable: tokio::sync::watch::Receiver<u64>,
}

impl Durability {
    /// Waits until everything a query that has just finished could have
    /// seen is durable: reads never show what a crash could still undo.
    async fn settle(&self) -> Result<(), StoreError> {
        let seen = self.committed.load(Ordering::SeqCst);
        let mut durable = self.durable.clone();
        durable
            .wait_for(|d| *d >= seen)
            .await
            .map(|_| ())
            .map_err(|_| StoreError::Closed)
    }
}

fn backend(e: sqlx::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) the database, migrates it and starts the
    /// writer task.
    pub async fn open(
        options: SqliteOptions,
        stamper: Arc<Stamper>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        let connect = SqliteConnectOptions::new()
            .filename(&options.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Commits do not wait for the disk; the syncer fsyncs the WAL
            // before any answer leaves (see the module docs).
            .synchronous(SqliteSynchronous::Normal)
            // 16 MiB of page cache: the recent (hot) end of every index
            // stays in memory. Not more: while the database is under 1 GiB,
            // SQLite scans the whole cache at the end of every write
            // transaction (B-tree balancing briefly files a page under the
            // lock page's number, 1 GiB / page size, and the commit then
            // drops cached pages past the database's end by a full scan),
            // so a bigger cache costs every commit (measured: 3% of all CPU
            // at 64 MiB, ~100 µs per commit at 16 MiB). Readers' caches
            // are flushed whenever the WAL changed anyway.
            .pragma("cache_size", "-16384")
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
            .busy_timeout(Duration::from_secs(10));
        let (commands, queue) = mpsc::channel(options.queue_depth.max(1));
        let max_batch = options.max_batch.max(1);
        let known = KnownCache::default();
        // The writer gets a thread and runtime of its own: its many short
        // waits on SQLite must not queue behind request handlers busy with
        // signature work, or every batch's round trips stretch out.
        let (durable_tx, durable) = tokio::sync::watch::channel(0u64);
        let committed = Arc::new(AtomicU64::new(0));
        let (synced, sync_queue) = mpsc::channel(MAX_UNSYNCED_BATCHES);
        let wal_path = wal_path_of(&options.path);
        let before_wal_sync = options.before_wal_sync.clone();
        let syncer_metrics = options.metrics.clone();
        std::thread::Builder::new()
            .name("store-syncer".into())
            .spawn(move || {
                syncer(
                    &wal_path,
                    sync_queue,
                    durable_tx,
                    before_wal_sync,
                    syncer_metrics,
                )
            })
            .map_err(|e| StoreError::Backend(format!("syncer thread: {e}")))?;
        let writer_committed = committed.clone();
        let writer_metrics = options.metrics.clone();
        let finish_checkpoint = Arc::new(AtomicBool::new(false));
        let writer_finish = finish_checkpoint.clone();
        let retention_ms = options.request_log_retention_ms;
        let timestamp_window_ms = options.timestamp_window_ms;
        let (ready, writer_ready) = oneshot::channel();
        let trees = super::TreeChanges::default();
        let writer_trees = trees.clone();
        let (writer_known, writer_stamper, writer_clock, writer_connect) = (
            known.clone(),
            stamper.clone(),
            clock.clone(),
            connect.clone(),
        );
        std::thread::Builder::new()
            .name("store-writer".into())
            // The writer never judges (see `prejudge`), but it stamps and
            // checks what clients sent; a deep stack keeps any recursion in
            // those far from the limit.
            .stack_size(WRITER_STACK_BYTES)
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ =
                            ready.send(Err(StoreError::Backend(format!("writer runtime: {e}"))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let (mut writer, next_seq) = match open_writer(&writer_connect).await {
                        Ok(opened) => opened,
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    let recent =
                        load_recent(&mut writer, timestamp_window_ms, writer_clock.now_ms()).await;
                    let _ = ready.send(Ok(()));
                    let state = WriterState {
                        known: writer_known,
                        trees: writer_trees,
                        next_seq,
                        committed: writer_committed,
                        synced,
                        recent,
                        retention_ms,
                        next_prune: std::time::Instant::now(),
                        finish_checkpoint: writer_finish,
                        metrics: writer_metrics,
                    };
                    writer_loop(
                        &mut writer,
                        queue,
                        state,
                        writer_stamper,
                        writer_clock,
                        max_batch,
                    )
                    .await;
                    if let Err(e) = writer.close().await {
                        tracing::warn!(error = %e, "closing the writer connection");
                    }
                });
            })
            .map_err(|e| StoreError::Backend(format!("writer thread: {e}")))?;
        writer_ready.await.map_err(|_| StoreError::Closed)??;
        let checkpoints = SqliteConnection::connect_with(&connect)
            .await
            .map_err(backend)?;
        tokio::spawn(checkpointer(
            checkpoints,
            commands.downgrade(),
            finish_checkpoint,
            options.wal_restart_bytes,
        ));
        let reader = SqlitePoolOptions::new()
            .max_connections(options.read_connections.max(1))
            // SQLite's default 2 MiB: a reader's cache is emptied at the
            // start of every read after a commit, so more would only hold
            // memory.
            .connect_with(connect.read_only(true).pragma("cache_size", "-2048"))
            .await
            .map_err(backend)?;
        Ok(Self {
            commands,
            reader,
            known,
            trees,
            stamper,
            clock,
            durability: Durability { committed, durable },
            judges: crate::pool::WorkPool::start(
                "store-judge",
                MAX_CONCURRENT_JUDGMENTS,
                WRITER_STACK_BYTES,
            )
            .map_err(|e| StoreError::Backend(format!("judge threads: {e}")))?,
            judgment_deadline: Duration::from_millis(options.judgment_deadline_ms.max(1)),
            judging_contracts: crate::slots::Slots::new(
                usize::MAX,
                "judgments",
                1,
                "JUDGMENT_IN_PROGRESS",
            ),
            judging_signers: crate::slots::Slots::new(
                usize::MAX,
                "judgments",
                MAX_JUDGMENTS_PER_SIGNER,
                "MAX_JUDGMENTS_PER_SIGNER",
            ),
            before_judge: options.before_judge.clone(),
            max_audit_rows: options.max_audit_rows.max(1),
            max_audit_bytes: options.max_audit_bytes.max(1),
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

    /// Contracts open or accepted now (one count over the status index).
    pub async fn open_contracts(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar("SELECT COUNT(*) FROM contracts WHERE status IN ($1, $2)")
            .bind(Status::Open as i64)
            .bind(Status::Accepted as i64)
            .fetch_one(&self.reader)
            .await
            .map_err(backend)
    }

    /// Commands waiting for the writer now (the write queue's depth).
    pub fn queue_depth(&self) -> usize {
        self.commands.max_capacity() - self.commands.capacity()
    }

    /// Stamps a child from the cached parent, so the signing happens here
    /// rather than on the single writer. `None` when the parent is not
    /// cached or the check (against possibly stale state) refuses.
    fn speculate(&self, child: &NewChild) -> Option<Box<Speculation>> {
        let view = {
            let known = self.known.lock().ok()?;
            known.get(&child.parent_id)?.view.clone()
        };
        let now_ms = self.clock.now_ms();
        let terms = crate::core::check_delegation(&view, &child.ask, now_ms).ok()?;
        let stamped = self
            .stamper
            .child(&view.intent_lineage_hash, child, &terms, now_ms);
        Some(Box::new(Speculation { terms, stamped }))
    }

    /// Judges a completion before it reaches the writer, on one of the
    /// judge threads, at most `MAX_CONCURRENT_JUDGMENTS` at a time (the
    /// pool's permit stays with the job, so a caller that goes away does
    /// not free it early). The writer never judges: it takes this judgment
    /// if the contract's observations are what it saw, and sends the
    /// completion back otherwise. Only the contract's delegate gets a
    /// judgment (see `JudgeInputs::load`); anyone else is refused by the
    /// writer before a judgment is needed. Waiting is bounded: past
    /// `judgment_deadline` the caller is answered UNAVAILABLE (nothing was
    /// written, so a retry with the same nonce is safe).
    async fn prejudge(
        &self,
        contract_id: &Id,
        signer: Option<&AgentKey>,
        mut args: Box<CompleteArgs>,
        slots: &mut Option<JudgingSlots>,
    ) -> Result<Box<CompleteArgs>, StoreError> {
        let received_at_ms = *args.received_at_ms.get_or_insert(self.clock.now_ms());
        args.prejudged = None;
        let Some(signer) = signer else {
            return Ok(args);
        };
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        let inputs = JudgeInputs::load(&mut conn, contract_id, signer, received_at_ms)
            .await
            .map_err(backend)?;
        drop(conn);
        let Some(inputs) = inputs else {
            return Ok(args);
        };
        // One judgment per contract, and a few per signer, at a time: a
        // delegate (and a host it controls) cannot keep every judge busy.
        // Taken only now that the signer is the contract's delegate, so a
        // stranger's requests never hold them.
        if slots.is_none() {
            let contract = self.judging_contracts.take(*contract_id).map_err(|_| {
                StoreError::Unavailable {
                    reason: "JUDGMENT_IN_PROGRESS",
                    detail: "another completion of this contract is being judged; retry with the same nonce once it is answered".into(),
                }
            })?;
            let signer = self
                .judging_signers
                .take(*signer)
                .map_err(StoreError::Overloaded)?;
            *slots = Some((contract, signer));
        }
        let hook = self.before_judge.clone();
        let job_args = args.clone();
        let judged = self
            .judges
            .run(self.judgment_deadline, move || {
                if let Some(hook) = hook {
                    (hook.0)();
                }
                inputs.judge(&job_args)
            })
            .await
            .map_err(|e| match e {
                crate::pool::PoolError::TimedOut(ms) => StoreError::Unavailable {
                    reason: "JUDGES_BUSY",
                    detail: format!(
                        "the completion could not be judged within {ms} ms (every judge is busy); nothing was recorded: retry with the same nonce"
                    ),
                },
                crate::pool::PoolError::Panicked => {
                    StoreError::Corrupt("a judgment panicked".into())
                }
                crate::pool::PoolError::Stopped => StoreError::Closed,
            })?;
        args.prejudged = Some(judged);
        Ok(args)
    }

    async fn submit(&self, command: Command) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .try_send((command, reply))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => StoreError::Busy,
                mpsc::error::TrySendError::Closed(_) => StoreError::Closed,
            })?;
        answer.await.map_err(|_| StoreError::Closed)?
    }
}

impl Store for SqliteStore {
    async fn open_root(&self, root: NewRoot) -> Result<Answer, StoreError> {
        let stamped = self.stamper.root(&root, self.clock.now_ms());
        self.submit(Command::OpenRoot(Box::new(root), Box::new(stamped)))
            .await
    }

    async fn delegate(&self, child: NewChild) -> Result<Answer, StoreError> {
        let speculation = self.speculate(&child);
        self.submit(Command::Delegate(Box::new(child), speculation))
            .await
    }

    async fn transition(&self, command: LifecycleCommand) -> Result<Answer, StoreError> {
        let LifecycleCommand {
            request,
            contract_id,
            action,
        } = command;
        let Action::Complete(mut args) = action else {
            return self
                .submit(Command::Lifecycle(Box::new(LifecycleCommand {
                    request,
                    contract_id,
                    action,
                })))
                .await;
        };
        // The writer sends a completion back when host observations
        // arrived after its judgment; it is judged again here, off the
        // writer, a bounded number of times.
        let signer = request.as_ref().map(|r| r.agent);
        // Slots held while this completion is judged (taken in `prejudge`,
        // once the signer is known to be the delegate of an open contract).
        let mut slots = None;
        for _ in 0..MAX_JUDGMENT_ATTEMPTS {
            let judged = self
                .prejudge(&contract_id, signer.as_ref(), args, &mut slots)
                .await?;
            args = judged.clone();
            let command = LifecycleCommand {
                request: request.clone(),
                contract_id,
                action: Action::Complete(judged),
            };
            match self.submit(Command::Lifecycle(Box::new(command))).await {
                Err(StoreError::StaleJudgment) => continue,
                answer => return answer,
            }
        }
        Err(StoreError::Unavailable {
            reason: "OBSERVATIONS_CHANGING",
            detail: format!(
                "the host recorded observations during each of {MAX_JUDGMENT_ATTEMPTS} judgments of this completion; nothing was recorded: retry with the same nonce"
            ),
        })
    }

    async fn events(
        &self,
        contract: Id,
        cursor: i64,
        limit: u32,
        max_bytes: usize,
    ) -> Result<Vec<Event>, StoreError> {
        use tokio_stream::StreamExt;
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        let mut rows = sqlx::query(
            "WITH RECURSIVE sub(seq) AS (\
                 SELECT seq FROM contracts WHERE id = $1 \
                 UNION ALL SELECT c.seq FROM contracts c JOIN sub ON c.parent_seq = sub.seq) \
             SELECT seq, 1 AS kind, envelope FROM contract_envelopes \
                 WHERE seq > $2 AND seq IN (SELECT seq FROM sub) \
             UNION ALL \
             SELECT seq, 2 AS kind, envelope FROM receipts \
                 WHERE seq > $2 AND contract_seq IN (SELECT seq FROM sub) \
             ORDER BY seq LIMIT $3",
        )
        .bind(contract.as_slice())
        .bind(cursor)
        .bind(i64::from(limit))
        .fetch(&mut *conn);
        // Rows are pulled one at a time and the page ends at its byte
        // budget: a page never holds more than about `max_bytes`.
        let mut events = Vec::new();
        let mut bytes = 0usize;
        while let Some(row) = rows.next().await {
            let row = row.map_err(backend)?;
            let cursor: i64 = row.try_get("seq").map_err(backend)?;
            let kind: i64 = row.try_get("kind").map_err(backend)?;
            let envelope = decode_envelope(&row, "envelope")?;
            bytes = bytes.saturating_add(envelope.encoded_len());
            events.push(if kind == 1 {
                Event::Contract { cursor, envelope }
            } else {
                Event::Receipt { cursor, envelope }
            });
            if bytes >= max_bytes {
                break;
            }
        }
        drop(rows);
        drop(conn);
        self.durability.settle().await?;
        Ok(events)
    }

    async fn audit_facts(
        &self,
        id: Id,
    ) -> Result<Option<(AuditFacts, Vec<(Id, String)>)>, StoreError> {
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        let Some(row) = sqlx::query(AUDIT_SELECT_BY_ID)
            .bind(id.as_slice())
            .fetch_optional(&mut *conn)
            .await
            .map_err(backend)?
        else {
            return Ok(None);
        };
        let (facts, seq, root_seq) = audit_row(&row)?;
        let mut facts = facts;
        let mut budget = AuditRows::new(self.max_audit_rows, self.max_audit_bytes);
        facts.observations = observations_of(&mut conn, seq).await?;
        let mutations = tree_mutations(&mut conn, root_seq, &mut budget).await?;
        drop(conn);
        self.durability.settle().await?;
        Ok(Some((facts, mutations)))
    }

    async fn is_party(&self, contract: Id, agent: AgentKey) -> Result<Option<bool>, StoreError> {
        let row = sqlx::query(
            "SELECT EXISTS(SELECT 1 FROM contracts d WHERE d.root_seq = c.root_seq AND d.delegate_key = $2) \
                 OR EXISTS(SELECT 1 FROM contracts h WHERE h.root_seq = c.root_seq AND h.host_key = $2) AS party \
             FROM contracts c WHERE c.id = $1",
        )
        .bind(contract.as_slice())
        .bind(agent.as_slice())
        .fetch_optional(&self.reader)
        .await
        .map_err(backend)?;
        // Not settled: a party stays a party, and the read that follows
        // settles before it answers.
        row.map(|r| r.try_get::<bool, _>("party").map_err(backend))
            .transpose()
    }

    async fn runs(
        &self,
        orchestrator: Option<AgentKey>,
        selector: &std::collections::BTreeMap<String, String>,
        limit: u32,
    ) -> Result<Vec<(RunFacts, TreeMutations)>, StoreError> {
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        // The roots carrying every selected label, through the run_labels
        // index; at most limit + 1 rows are read, whatever the store holds.
        let mut query =
            QueryBuilder::<Sqlite>::new("SELECT seq, id, labels, budget, spent FROM contracts ");
        query.push("WHERE parent_seq IS NULL");
        if let Some(orchestrator) = orchestrator {
            query
                .push(" AND delegate_key = ")
                .push_bind(orchestrator.to_vec());
        }
        if !selector.is_empty() {
            query.push(" AND seq IN (");
            for (i, (key, value)) in selector.iter().enumerate() {
                if i > 0 {
                    query.push(" INTERSECT ");
                }
                query
                    .push("SELECT root_seq FROM run_labels WHERE label_key = ")
                    .push_bind(key.as_str())
                    .push(" AND label_value = ")
                    .push_bind(value.as_str());
            }
            query.push(")");
        }
        query
            .push(" ORDER BY seq LIMIT ")
            .push_bind(i64::from(limit) + 1);
        let roots = query.build().fetch_all(&mut *conn).await.map_err(backend)?;
        if roots.len() > limit as usize {
            return Err(StoreError::Overloaded(
                "more runs match than MAX_AGGREGATE_RUNS",
            ));
        }
        let mut runs = Vec::with_capacity(roots.len());
        let mut budget = AuditRows::new(self.max_audit_rows, self.max_audit_bytes);
        for root in roots {
            let labels_json: String = root.try_get("labels").map_err(backend)?;
            let labels: std::collections::BTreeMap<String, String> =
                serde_json::from_str(&labels_json)
                    .map_err(|_| StoreError::Corrupt("labels".into()))?;
            // The index and the root's own labels must agree.
            if !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
                return Err(StoreError::Corrupt(
                    "run_labels disagrees with the root's labels".into(),
                ));
            }
            let root_seq: i64 = root.try_get("seq").map_err(backend)?;
            let rows = budget
                .fetch(&mut conn, sqlx::query(AUDIT_SELECT_TREE).bind(root_seq))
                .await?;
            let root_id = id_column(&root, "id")?;
            let mut contracts = Vec::with_capacity(rows.len());
            let mut ids = HashMap::with_capacity(rows.len() + 1);
            ids.insert(root_seq, root_id);
            for row in &rows {
                let (facts, seq, _) = audit_row(row)?;
                ids.insert(seq, facts.id);
                contracts.push((seq, facts));
            }
            // One observation query per tree, not one per contract; the
            // tree's mutations (for conflicts) come from the same rows.
            let mut observed: HashMap<i64, Vec<(i32, String)>> = HashMap::new();
            let mut mutations = Vec::new();
            for (seq, kind, path) in tree_observations(&mut conn, root_seq, &mut budget).await? {
                if kind == pb::ObservationKind::Mutation as i32 {
                    let id = ids.get(&seq).ok_or_else(|| {
                        StoreError::Corrupt("an observation outside its tree".into())
                    })?;
                    mutations.push((*id, path.clone()));
                }
                observed.entry(seq).or_default().push((kind, path));
            }
            let contracts: Vec<AuditFacts> = contracts
                .into_iter()
                .map(|(seq, mut facts)| {
                    facts.observations = observed.remove(&seq).unwrap_or_default();
                    facts
                })
                .collect();
            let receipts = budget
                .fetch(
                    &mut conn,
                    sqlx::query(
                        "SELECT kind, envelope FROM receipts WHERE root_id = $1 AND kind IN ($2, $3) LIMIT $4",
                    )
                    .bind(root_id.as_slice())
                    .bind(pb::ReceiptKind::Refused as i64)
                    .bind(pb::ReceiptKind::Escalated as i64),
                )
                .await?;
            let (mut escalations, mut refusal_codes) = (0, Vec::new());
            for receipt in &receipts {
                let kind: i64 = receipt.try_get("kind").map_err(backend)?;
                if kind == pb::ReceiptKind::Escalated as i64 {
                    escalations += 1;
                } else {
                    let envelope = decode_envelope(receipt, "envelope")?;
                    let body = pb::Receipt::decode(envelope.payload.as_slice())
                        .map_err(|_| StoreError::Corrupt("receipt payload".into()))?;
                    refusal_codes.push(body.primary);
                }
            }
            runs.push((
                RunFacts {
                    root_id,
                    labels,
                    budget: root.try_get("budget").map_err(backend)?,
                    spent: root.try_get("spent").map_err(backend)?,
                    contracts,
                    escalations,
                    refusal_codes,
                },
                mutations,
            ));
        }
        drop(conn);
        self.durability.settle().await?;
        Ok(runs)
    }

    fn commits(&self) -> tokio::sync::watch::Receiver<u64> {
        self.durability.durable.clone()
    }

    fn tree_changes(&self) -> super::TreeChanges {
        self.trees.clone()
    }

    async fn overdue(&self, now_ms: i64, limit: u32) -> Result<Vec<Id>, StoreError> {
        let rows = sqlx::query(
            "SELECT id FROM contracts WHERE status IN ($1, $2) AND deadline_ms <= $3 ORDER BY deadline_ms LIMIT $4",
        )
        .bind(i64::from(Status::Open.as_i32()))
        .bind(i64::from(Status::Accepted.as_i32()))
        .bind(now_ms)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await
        .map_err(backend)?;
        self.durability.settle().await?;
        rows.iter().map(|r| id_column(r, "id")).collect()
    }

    async fn replay(&self, request: &RequestMeta) -> Result<Option<Answer>, StoreError> {
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        let key = (request.agent, request.nonce.clone());
        let mut prior = load_prior_requests(&mut conn, std::slice::from_ref(&key))
            .await
            .map_err(backend)?;
        drop(conn);
        self.durability.settle().await?;
        prior
            .remove(&key)
            .map(|p| batch::replayed(&p, request))
            .transpose()
    }

    async fn issuing_parent(&self, parent: Id) -> Result<Option<IssuingParent>, StoreError> {
        if let Some(known) = lock(&self.known).get(&parent) {
            return Ok(Some(IssuingParent {
                delegate_key: known.view.delegate_key,
                effective_predicate: known.view.effective_predicate.clone(),
                root_id: known.root_id,
                depth: known.view.depth,
            }));
        }
        // Not settled: what it reads never changes once written, and it is
        // only used to refuse or to go on to the writer, which reads again.
        let row = sqlx::query(
            "SELECT delegate_key, effective_predicate, root_id, depth FROM contracts WHERE id = $1",
        )
        .bind(parent.as_slice())
        .fetch_optional(&self.reader)
        .await
        .map_err(backend)?;
        row.map(|r| {
            Ok(IssuingParent {
                delegate_key: id_column(&r, "delegate_key")?,
                effective_predicate: Predicate::from_trusted(
                    r.try_get("effective_predicate").map_err(backend)?,
                ),
                root_id: id_column(&r, "root_id")?,
                depth: u32::try_from(r.try_get::<i64, _>("depth").map_err(backend)?)
                    .map_err(|_| StoreError::Corrupt("depth".into()))?,
            })
        })
        .transpose()
    }

    async fn issuance_trace(
        &self,
        id: Id,
    ) -> Result<Option<crate::telemetry::TraceContext>, StoreError> {
        let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
            "SELECT e.trace_context FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq \
             WHERE c.id = $1",
        )
        .bind(id.as_slice())
        .fetch_optional(&self.reader)
        .await
        .map_err(backend)?;
        // Written once with the contract; a wrong length is not ours.
        Ok(stored.flatten().and_then(|t| t.try_into().ok()))
    }

    async fn contract(&self, id: Id) -> Result<Option<ContractRecord>, StoreError> {
        let row = sqlx::query(SELECT_RECORD_BY_ID)
            .bind(id.as_slice())
            .fetch_optional(&self.reader)
            .await
            .map_err(backend)?;
        self.durability.settle().await?;
        row.map(|r| record_from_row(&r)).transpose()
    }

    async fn children(
        &self,
        parent: Id,
        after_seq: i64,
        limit: u32,
        max_bytes: usize,
    ) -> Result<Vec<ContractRecord>, StoreError> {
        use tokio_stream::StreamExt;
        let mut conn = self.reader.acquire().await.map_err(backend)?;
        let mut rows = sqlx::query(SELECT_CHILDREN)
            .bind(parent.as_slice())
            .bind(after_seq)
            .bind(i64::from(limit))
            .fetch(&mut *conn);
        // Pulled one at a time, up to the byte budget (see `events`).
        let mut records = Vec::new();
        let mut bytes = 0usize;
        while let Some(row) = rows.next().await {
            let record = record_from_row(&row.map_err(backend)?)?;
            bytes = bytes.saturating_add(record.envelope.encoded_len());
            records.push(record);
            if bytes >= max_bytes {
                break;
            }
        }
        drop(rows);
        drop(conn);
        self.durability.settle().await?;
        Ok(records)
    }

    async fn receipt(&self, id: Id) -> Result<Option<pb::Sealed>, StoreError> {
        let row = sqlx::query("SELECT envelope FROM receipts WHERE id = $1")
            .bind(id.as_slice())
            .fetch_optional(&self.reader)
            .await
            .map_err(backend)?;
        self.durability.settle().await?;
        row.map(|r| decode_envelope(&r, "envelope")).transpose()
    }
}

const SELECT_RECORD_BY_ID: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, effective_predicate, envelope FROM contracts_with_envelope WHERE id = $1";
const SELECT_CHILDREN: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, effective_predicate, envelope FROM contracts_with_envelope \
     WHERE parent_seq = (SELECT seq FROM contracts WHERE id = $1) AND seq > $2 \
     ORDER BY seq LIMIT $3";

const AUDIT_SELECT_BY_ID: &str = "SELECT seq, id, root_seq, depth, write_scope, status, has_report, \
     downgrades, verdict, claim, envelope FROM contracts_with_envelope WHERE id = $1";
const AUDIT_SELECT_TREE: &str = "SELECT seq, id, root_seq, depth, write_scope, status, has_report, \
     downgrades, verdict, claim, envelope FROM contracts_with_envelope WHERE root_seq = $1 AND parent_seq IS NOT NULL \
     ORDER BY seq LIMIT $2";

/// Most rows (contracts, observations, refusals and escalations) one
/// audit read loads: a tree has no size limit, and AggregateAudits reads
/// up to MAX_AGGREGATE_RUNS of them (rows are typically ~100 bytes to a
/// few KiB).
pub const MAX_AUDIT_ROWS: i64 = 1_000_000;

/// Most bytes of envelopes and observed paths one audit read loads: with
/// `MAX_AUDIT_ROWS` alone, a million rows of 1 KiB paths were a gigabyte
/// (16 audits at once took 1.8 GB).
pub const MAX_AUDIT_BYTES: usize = 128 * 1024 * 1024;

/// What is left of one audit read's budget, in rows and in bytes.
struct AuditRows {
    left: i64,
    bytes_left: usize,
}

impl AuditRows {
    fn new(rows: i64, bytes: usize) -> Self {
        Self {
            left: rows,
            bytes_left: bytes,
        }
    }

    /// A LIMIT one past the budget, so going over is seen, not hidden.
    fn query_limit(&self) -> i64 {
        self.left.saturating_add(1)
    }

    /// Runs `query` with this budget's LIMIT bound as its last parameter,
    /// pulling rows one at a time and charging each its row and the bytes
    /// of its large columns (`envelope`, `path`): the read stops as soon as
    /// either budget is spent, before the rest is loaded.
    async fn fetch<'q>(
        &mut self,
        conn: &mut SqliteConnection,
        query: sqlx::query::Query<'q, Sqlite, <Sqlite as sqlx::Database>::Arguments>,
    ) -> Result<Vec<SqliteRow>, StoreError> {
        use tokio_stream::StreamExt;
        let mut stream = query.bind(self.query_limit()).fetch(&mut *conn);
        let mut rows = Vec::new();
        while let Some(row) = stream.next().await {
            let row = row.map_err(backend)?;
            let bytes = row
                .try_get::<&[u8], _>("envelope")
                .map_or(0, <[u8]>::len)
                .saturating_add(row.try_get::<&str, _>("path").map_or(0, str::len));
            self.take(1, bytes)?;
            rows.push(row);
        }
        Ok(rows)
    }

    fn take(&mut self, rows: usize, bytes: usize) -> Result<(), StoreError> {
        self.left -= i64::try_from(rows).unwrap_or(i64::MAX);
        if self.left < 0 {
            return Err(StoreError::Overloaded(
                "the audit would read more than MAX_AUDIT_ROWS rows (contracts, observations, receipts)",
            ));
        }
        self.bytes_left = self
            .bytes_left
            .checked_sub(bytes)
            .ok_or(StoreError::Overloaded(
                "the audit would read more than MAX_AUDIT_BYTES of envelopes and paths",
            ))?;
        Ok(())
    }
}

/// An audit row: the facts (observations still to load), its seq and its
/// root's seq.
fn audit_row(row: &SqliteRow) -> Result<(AuditFacts, i64, i64), StoreError> {
    let envelope = decode_envelope(row, "envelope")?;
    let contract = pb::Contract::decode(envelope.payload.as_slice())
        .map_err(|_| StoreError::Corrupt("contract payload".into()))?;
    let scope: String = row.try_get("write_scope").map_err(backend)?;
    let status = status_from(row.try_get("status").map_err(backend)?)?;
    let has_report: Option<i64> = row.try_get("has_report").map_err(backend)?;
    let downgrades: i64 = row.try_get("downgrades").map_err(backend)?;
    let verdict: i64 = row.try_get("verdict").map_err(backend)?;
    let depth: i64 = row.try_get("depth").map_err(backend)?;
    Ok((
        AuditFacts {
            id: id_column(row, "id")?,
            depth: u32::try_from(depth).map_err(|_| StoreError::Corrupt("depth".into()))?,
            task: contract.task,
            write_scope: serde_json::from_str(&scope)
                .map_err(|_| StoreError::Corrupt("write_scope".into()))?,
            completed: status == Status::Completed,
            has_report: has_report.map(|h| h != 0),
            downgrades: u32::try_from(downgrades).unwrap_or(u32::MAX),
            verdict: i32::try_from(verdict).unwrap_or_default(),
            claim: row.try_get("claim").map_err(backend)?,
            observations: Vec::new(),
        },
        row.try_get("seq").map_err(backend)?,
        row.try_get("root_seq").map_err(backend)?,
    ))
}

async fn observations_of(
    conn: &mut SqliteConnection,
    seq: i64,
) -> Result<Vec<(i32, String)>, StoreError> {
    let rows =
        sqlx::query("SELECT kind, path FROM observations WHERE contract_seq = $1 ORDER BY seq")
            .bind(seq)
            .fetch_all(&mut *conn)
            .await
            .map_err(backend)?;
    rows.iter()
        .map(|r| {
            let kind: i64 = r.try_get("kind").map_err(backend)?;
            Ok((
                i32::try_from(kind).unwrap_or_default(),
                r.try_get("path").map_err(backend)?,
            ))
        })
        .collect()
}

/// Every observation of a tree's contracts as (contract seq, kind, path),
/// in recording order.
async fn tree_observations(
    conn: &mut SqliteConnection,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(i64, i32, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query(
                "SELECT o.contract_seq, o.kind, o.path FROM observations o \
                 JOIN contracts c ON c.seq = o.contract_seq WHERE c.root_seq = $1 ORDER BY o.seq LIMIT $2",
            )
            .bind(root_seq),
        )
        .await?;
    rows.iter()
        .map(|row| {
            let kind: i64 = row.try_get("kind").map_err(backend)?;
            Ok((
                row.try_get("contract_seq").map_err(backend)?,
                i32::try_from(kind).unwrap_or_default(),
                row.try_get("path").map_err(backend)?,
            ))
        })
        .collect()
}

/// Every (contract id, mutated path) of a tree.
async fn tree_mutations(
    conn: &mut SqliteConnection,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(Id, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query(
                "SELECT c.id, o.path FROM observations o JOIN contracts c ON c.seq = o.contract_seq \
                 WHERE c.root_seq = $1 AND o.kind = $2 ORDER BY o.seq LIMIT $3",
            )
            .bind(root_seq)
            .bind(pb::ObservationKind::Mutation as i64),
        )
        .await?;
    rows.iter()
        .map(|r| Ok((id_column(r, "id")?, r.try_get("path").map_err(backend)?)))
        .collect()
}

fn id_column(row: &SqliteRow, column: &str) -> Result<Id, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{column} is not 32 bytes")))
}

fn decode_envelope(row: &SqliteRow, column: &str) -> Result<pb::Sealed, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    pb::Sealed::decode(bytes.as_slice()).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

fn status_from(value: i64) -> Result<Status, StoreError> {
    i32::try_from(value)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {value}")))
}

fn ledger_from_row(row: &SqliteRow) -> Result<Ledger, StoreError> {
    let open_children: i64 = row.try_get("open_children").map_err(backend)?;
    Ok(Ledger {
        budget: row.try_get("budget").map_err(backend)?,
        reserved: row.try_get("reserved").map_err(backend)?,
        spent: row.try_get("spent").map_err(backend)?,
        open_children: u32::try_from(open_children)
            .map_err(|_| StoreError::Corrupt(format!("open_children {open_children}")))?,
    })
}

fn record_from_row(row: &SqliteRow) -> Result<ContractRecord, StoreError> {
    let parent: Option<Vec<u8>> = row.try_get("parent_id").map_err(backend)?;
    let parent_id = parent
        .map(|p| {
            p.try_into()
                .map_err(|_| StoreError::Corrupt("parent_id is not 32 bytes".into()))
        })
        .transpose()?;
    Ok(ContractRecord {
        id: id_column(row, "id")?,
        parent_id,
        root_id: id_column(row, "root_id")?,
        envelope: decode_envelope(row, "envelope")?,
        effective_predicate: row.try_get("effective_predicate").map_err(backend)?,
        status: status_from(row.try_get("status").map_err(backend)?)?,
        ledger: ledger_from_row(row)?,
        seq: row.try_get("seq").map_err(backend)?,
    })
}

/// Stack of the writer thread (see where it is spawned).
const WRITER_STACK_BYTES: usize = 64 * 1024 * 1024;
/// Completions judged at once off the writer: judging is CPU-bound, so
/// more than a few only queue for the same cores; the rest wait for a
/// permit (each request still has its deadline).
const MAX_CONCURRENT_JUDGMENTS: usize = 4;
/// What a completion being judged holds (see `prejudge`).
type JudgingSlots = (crate::slots::Slot<Id>, crate::slots::Slot<AgentKey>);

/// Completions one signing key may have judged at once.
const MAX_JUDGMENTS_PER_SIGNER: usize = 2;
/// Judgments of one completion before giving up when host observations
/// keep arriving while it is judged (each makes the last one stale).
const MAX_JUDGMENT_ATTEMPTS: usize = 3;

/// Most contracts the writer keeps in memory between batches, by count and
/// by bytes (`KnownMap::bytes`); beyond either the cache is dropped and
/// reloaded on demand.
const MAX_CACHED_CONTRACTS: usize = 65_536;
const MAX_CACHED_CONTRACT_BYTES: usize = 128 * 1024 * 1024;
/// Committed batches that may wait for the syncer; beyond it the writer
/// waits (back-pressure instead of unbounded memory).
const MAX_UNSYNCED_BATCHES: usize = 64;
/// Rows per multi-row statement, under SQLite's bind-parameter limit
/// (32_766) at up to 26 parameters a row (a contract).
const ROWS_PER_STATEMENT: usize = 1_000;

/// Prepared statements kept per connection (see where it is set).
const STATEMENT_CACHE_CAPACITY: usize = 1_024;

/// How often the WAL is copied back into the database file.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(250);
/// Default WAL size beyond which the writer finishes a checkpoint (so the WAL
/// restarts from its beginning): bounds the WAL to about this plus one
/// `CHECKPOINT_INTERVAL` of writes.
pub const WAL_RESTART_BYTES: u64 = 32 * 1024 * 1024;

/// Copies committed WAL frames into the database file in the background,
/// without blocking the writer (PASSIVE), so commits never pay for it.
///
/// The WAL only restarts from its beginning when a write transaction
/// starts with every frame copied, which a background checkpoint never
/// achieves against a busy writer. So once the WAL holds `restart_bytes`,
/// this drains it (checkpoints back to back until one had little left to
/// copy) and then asks the writer to copy the rest between two batches
/// (`finish`, see `writer_loop`): the writer stalls only for the frames
/// of the last round (measured: 9–25 ms stalls twice a second when the
/// writer was asked after a single 250 ms round). Stops when the store is
/// dropped.
async fn checkpointer(
    mut conn: SqliteConnection,
    alive: mpsc::WeakSender<(Command, Reply)>,
    finish: Arc<AtomicBool>,
    restart_bytes: u64,
) {
    let page_bytes = match sqlx::query_scalar::<_, i64>("PRAGMA page_size")
        .fetch_one(&mut conn)
        .await
    {
        Ok(bytes) => u64::try_from(bytes).unwrap_or(DEFAULT_PAGE_BYTES),
        Err(e) => {
            tracing::warn!(error = %e, "reading the page size; assuming the default");
            DEFAULT_PAGE_BYTES
        }
    };
    let mut tick = tokio::time::interval(CHECKPOINT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if alive.upgrade().is_none() {
            break;
        }
        let Some(mut done) = checkpoint(&mut conn).await else {
            continue;
        };
        // Frame counts, not the file's size: SQLite rewrites the WAL from
        // its start without shrinking the file.
        if done.wal_frames.saturating_mul(page_bytes) < restart_bytes {
            continue;
        }
        // Asked after the drain, or after MAX_DRAIN_ROUNDS if the writer
        // outpaces every round (a bounded WAL is worth one longer stall);
        // not if a round failed or was busy: the next tick tries again.
        let mut ask = true;
        for _ in 0..MAX_DRAIN_ROUNDS {
            if alive.upgrade().is_none() {
                ask = false;
                break;
            }
            let copied_before = done.copied_frames;
            let Some(next) = checkpoint(&mut conn).await else {
                ask = false;
                break;
            };
            done = next;
            if done.wal_frames.saturating_sub(copied_before) <= DRAINED_FRAMES {
                break;
            }
        }
        if ask {
            finish.store(true, Ordering::Release);
        }
    }
    // A final full checkpoint leaves a compact database behind.
    let _ = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
}

/// SQLite's default page size; only used if asking for it fails.
const DEFAULT_PAGE_BYTES: u64 = 4096;
/// Back-to-back checkpoints at most before the writer is asked to finish.
const MAX_DRAIN_ROUNDS: usize = 8;
/// A round that had at most this many frames to copy leaves the writer
/// little to do (about a millisecond of writes at full load).
const DRAINED_FRAMES: u64 = 256;

/// What one checkpoint saw, in WAL frames.
struct Checkpointed {
    /// Frames in the WAL since it last restarted.
    wal_frames: u64,
    /// Of those, frames now copied into the database file.
    copied_frames: u64,
}

/// One PASSIVE checkpoint; `None` (logged) if it failed or says nothing.
async fn checkpoint(conn: &mut SqliteConnection) -> Option<Checkpointed> {
    // Returns (busy, frames in the WAL, frames copied).
    let r = sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(conn)
        .await;
    match r {
        // Busy (another checkpoint ran) or not in WAL mode: no counts.
        Ok((busy, wal_frames, copied_frames))
            if busy != 0 || wal_frames < 0 || copied_frames < 0 =>
        {
            tracing::debug!(busy, wal_frames, copied_frames, "WAL checkpoint skipped");
            None
        }
        Ok((_, wal_frames, copied_frames)) => Some(Checkpointed {
            wal_frames: u64::try_from(wal_frames).unwrap_or(0),
            copied_frames: u64::try_from(copied_frames).unwrap_or(0),
        }),
        Err(e) => {
            tracing::warn!(error = %e, "WAL checkpoint failed; will retry");
            None
        }
    }
}

/// The migration that records the linear contract format (issue 15).
const LINEAR_FORMAT_MIGRATION: i64 = 10;

/// Refuses a database holding contracts signed in the format before
/// `LINEAR_FORMAT_MIGRATION`: they cannot be converted (ids are hashes of
/// the signed bytes) and must not be served as if they were the new one.
async fn refuse_old_format(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    let has = |table: &'static str| {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = $1",
        )
        .bind(table)
    };
    if has("contracts")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?
        == 0
    {
        return Ok(());
    }
    let linear: i64 = if has("_sqlx_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?
        == 0
    {
        0
    } else {
        sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE version = $1")
            .bind(LINEAR_FORMAT_MIGRATION)
            .fetch_one(&mut *conn)
            .await
            .map_err(backend)?
    };
    let contracts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?;
    if linear == 0 && contracts > 0 {
        return Err(StoreError::Backend(format!(
            "this data directory holds {contracts} contracts signed in the format used before \
             linear chains (issue 15), which cannot be converted (a contract's id is the hash \
             of its signed bytes); keep it for reading with an older broker and start this \
             one with an empty --data-dir"
        )));
    }
    Ok(())
}

/// Opens the single write connection and brings the schema up to date.
/// Returns it with the next free issuance sequence number.
async fn open_writer(
    connect: &SqliteConnectOptions,
) -> Result<(SqliteConnection, i64), StoreError> {
    let mut writer = SqliteConnection::connect_with(connect)
        .await
        .map_err(backend)?;
    refuse_old_format(&mut writer).await?;
    sqlx::migrate!("./migrations/sqlite")
        .run_direct(None, &mut writer, false)
        .await
        .map_err(|e| StoreError::Backend(e.to_string()))?;
    // Contracts and receipts share one sequence (the event order).
    let mut last = 0i64;
    for query in [
        "SELECT COALESCE(MAX(seq), 0) FROM contracts",
        "SELECT COALESCE(MAX(seq), 0) FROM receipts",
    ] {
        let max: i64 = sqlx::query_scalar(query)
            .fetch_one(&mut writer)
            .await
            .map_err(backend)?;
        last = last.max(max);
    }
    Ok((writer, last + 1))
}

/// The writer's recent-request set, filled from the request log with every
/// key committed in the last two timestamp windows (what a fresh retry can
/// reach back to), so that right after a restart batches can already skip
/// the request-log read. If reading fails, the set starts empty and
/// vouches only for requests newer than now (batches read the log until
/// then).
async fn load_recent(conn: &mut SqliteConnection, window_ms: i64, now_ms: i64) -> RecentRequests {
    let since_ms = now_ms.saturating_sub(window_ms.saturating_mul(2));
    let mut recent = RecentRequests::new(window_ms, since_ms);
    let mut rows = sqlx::query(
        "SELECT agent_key, nonce, at_ms FROM requests WHERE at_ms >= $1 ORDER BY at_ms",
    )
    .bind(since_ms)
    .fetch(&mut *conn);
    let mut loaded: u64 = 0;
    let failed = loop {
        use tokio_stream::StreamExt;
        let row = match rows.next().await {
            None => break None,
            Some(Ok(row)) => row,
            Some(Err(e)) => break Some(e.to_string()),
        };
        let decoded = (|| -> Result<([u8; 32], Vec<u8>, i64), String> {
            let agent: Vec<u8> = row.try_get("agent_key").map_err(|e| e.to_string())?;
            let agent = <[u8; 32]>::try_from(agent).map_err(|_| "a corrupt agent key")?;
            let nonce: Vec<u8> = row.try_get("nonce").map_err(|e| e.to_string())?;
            let at_ms: i64 = row.try_get("at_ms").map_err(|e| e.to_string())?;
            Ok((agent, nonce, at_ms))
        })();
        match decoded {
            Ok((agent, nonce, at_ms)) => {
                recent.insert(&agent, &nonce, at_ms);
                loaded += 1;
            }
            Err(e) => break Some(e),
        }
    };
    drop(rows);
    match failed {
        None => {
            tracing::debug!(loaded, "recent request keys loaded");
            recent
        }
        Some(e) => {
            tracing::warn!(error = %e, "loading recent request keys; batches read the request log for a while");
            RecentRequests::new(window_ms, now_ms)
        }
    }
}

/// What the writer knows beyond the database: both are authoritative
/// because the writer is the only one that writes.
struct WriterState {
    known: KnownCache,
    /// Which trees got events (see `TreeChanges`), shared with readers.
    trees: super::TreeChanges,
    /// The next contract's (or receipt's) sequence number.
    next_seq: i64,
    /// The commit counter (see `Durability`).
    committed: Arc<AtomicU64>,
    /// Committed batches, to the syncer: their answers wait for its fsync.
    synced: mpsc::Sender<Unsynced>,
    /// Request keys committed recently: lets most batches skip reading
    /// the request log (see `apply_batch`).
    recent: RecentRequests,
    /// `SqliteOptions::request_log_retention_ms`.
    retention_ms: i64,
    /// When the writer next prunes the request log (see `prune_requests`).
    next_prune: std::time::Instant,
    /// Set by the background checkpointer when the WAL has grown past
    /// `SqliteOptions::wal_restart_bytes`: the writer then finishes it.
    finish_checkpoint: Arc<AtomicBool>,
    /// `SqliteOptions::metrics`.
    metrics: Option<crate::metrics::StoreMetrics>,
}

/// A committed (or rolled-back) batch whose answers wait for the fsync
/// that makes commit `number` durable.
struct Unsynced {
    number: u64,
    replies: Vec<(Reply, Result<Answer, StoreError>)>,
}

async fn writer_loop(
    conn: &mut SqliteConnection,
    mut queue: mpsc::Receiver<(Command, Reply)>,
    mut state: WriterState,
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    max_batch: usize,
) {
    let mut commands = Vec::with_capacity(max_batch);
    let mut replies = Vec::with_capacity(max_batch);
    while let Some((first, reply)) = queue.recv().await {
        commands.push(first);
        replies.push(reply);
        while commands.len() < max_batch {
            match queue.try_recv() {
                Ok((next, reply)) => {
                    commands.push(next);
                    replies.push(reply);
                }
                Err(_) => break,
            }
        }
        if let Some(metrics) = &state.metrics {
            metrics.batch_commands.observe(commands.len() as f64);
        }
        let began = std::time::Instant::now();
        let applied = apply_batch(conn, &commands, &mut state, &stamper, clock.now_ms()).await;
        let replies: Vec<_> = match applied {
            Ok(answers) => {
                tracing::trace!(
                    size = commands.len(),
                    took_us = began.elapsed().as_micros() as u64,
                    "batch committed"
                );
                replies.drain(..).zip(answers).collect()
            }
            Err(e) => {
                tracing::error!(error = %e, size = commands.len(), "batch rolled back");
                // The plan already changed the cache; the database did not.
                lock(&state.known).clear();
                // next_seq is not rolled back: if the commit did reach the
                // disk, reusing numbers would fail every later batch; gaps
                // are harmless (cursors are only compared).
                replies
                    .drain(..)
                    .map(|reply| (reply, Err(StoreError::Backend(e.to_string()))))
                    .collect()
            }
        };
        commands.clear();
        // Even a failed batch goes through the syncer: its commit number
        // may have been taken, and readers wait for it to be published.
        let number = state.committed.load(Ordering::SeqCst);
        if state
            .synced
            .send(Unsynced { number, replies })
            .await
            .is_err()
        {
            tracing::error!("the syncer stopped; the store writer stops");
            break;
        }
        // The WAL only restarts from its beginning once every frame is
        // copied, and a background checkpoint never catches up with a busy
        // writer: the WAL would grow without bound (measured: 300 MB in 4
        // s). So once it is big and drained (see `checkpointer`), the
        // writer, between batches, copies the few frames written since; its
        // next commit then restarts the WAL.
        if state.finish_checkpoint.swap(false, Ordering::AcqRel)
            && let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                .execute(&mut *conn)
                .await
        {
            tracing::warn!(error = %e, "finishing the WAL checkpoint failed; will retry");
        }
        let now = std::time::Instant::now();
        if now >= state.next_prune {
            let cutoff_ms = clock.now_ms().saturating_sub(state.retention_ms);
            // A commit like any other (see `Durability`): readers that see
            // the deletion wait for its fsync, which the syncer does even
            // if no batch follows.
            state.committed.fetch_add(1, Ordering::SeqCst);
            let pruned = prune_requests(conn, cutoff_ms).await;
            let number = state.committed.load(Ordering::SeqCst);
            if state
                .synced
                .send(Unsynced {
                    number,
                    replies: Vec::new(),
                })
                .await
                .is_err()
            {
                tracing::error!("the syncer stopped; the store writer stops");
                break;
            }
            state.next_prune = match pruned {
                // A full pass: more are due; go on after the next batch.
                Ok(deleted) if deleted >= MAX_PRUNED_PER_PASS => now,
                Ok(_) => now + PRUNE_INTERVAL,
                Err(e) => {
                    tracing::warn!(error = %e, "pruning the request log failed; will retry");
                    now + PRUNE_INTERVAL
                }
            };
        }
    }
    tracing::debug!("store writer stopped");
}

/// How often the writer looks for request-log entries past retention.
const PRUNE_INTERVAL: Duration = Duration::from_secs(1);
/// Most request-log entries deleted in one pass: bounds the writer's pause
/// (each is a random page write, and on a log larger than the page cache
/// a read too). A backlog is worked off one pass after every batch.
const MAX_PRUNED_PER_PASS: u64 = 128;

/// Deletes up to `MAX_PRUNED_PER_PASS` request-log entries that arrived
/// before `cutoff_ms`, oldest first; returns how many. Runs on the writer,
/// between batches, in its own transaction.
async fn prune_requests(conn: &mut SqliteConnection, cutoff_ms: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM requests WHERE (agent_key, nonce) IN \
         (SELECT agent_key, nonce FROM requests WHERE at_ms < $1 ORDER BY at_ms LIMIT $2)",
    )
    .bind(cutoff_ms)
    .bind(i64::try_from(MAX_PRUNED_PER_PASS).unwrap_or(i64::MAX))
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

/// The WAL file SQLite keeps beside the database.
fn wal_path_of(database: &Path) -> PathBuf {
    let mut name = database.as_os_str().to_owned();
    name.push("-wal");
    PathBuf::from(name)
}

/// Makes committed batches durable and only then answers them: takes every
/// batch committed so far, fsyncs the WAL once for all of them, publishes
/// the last commit number and sends the answers. Runs on its own thread
/// (an fsync blocks). Stops for good if an fsync fails (see module docs).
fn syncer(
    wal_path: &Path,
    mut queue: mpsc::Receiver<Unsynced>,
    durable: tokio::sync::watch::Sender<u64>,
    before_sync: Option<BeforeWalSync>,
    metrics: Option<crate::metrics::StoreMetrics>,
) {
    let mut wal: Option<(std::fs::File, u64)> = None;
    let mut group = Vec::new();
    while let Some(first) = queue.blocking_recv() {
        group.push(first);
        while let Ok(next) = queue.try_recv() {
            group.push(next);
        }
        let last = group.iter().map(|b| b.number).max().unwrap_or_default();
        let began = std::time::Instant::now();
        let synced = before_sync
            .as_ref()
            .map_or(Ok(()), |hook| (hook.0)())
            .and_then(|()| sync_wal(wal_path, &mut wal));
        let took_us = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        WAL_SYNCS.record(took_us);
        if let Some(metrics) = &metrics {
            metrics.wal_fsync_seconds.observe(took_us as f64 / 1e6);
            if took_us >= SLOW_WAL_SYNC_US {
                metrics.wal_fsync_stalls.inc();
            }
        }
        tracing::trace!(batches = group.len(), took_us, "wal synced");
        if let Err(e) = synced {
            tracing::error!(error = %e, path = %wal_path.display(),
                "fsync of the WAL failed; the store stops (restart the broker)");
            for batch in group.drain(..) {
                for (reply, _) in batch.replies {
                    let _ = reply.send(Err(StoreError::Backend(format!(
                        "fsync of the write-ahead log failed ({e}); the broker must be restarted"
                    ))));
                }
            }
            return;
        }
        durable.send_modify(|d| *d = (*d).max(last));
        for batch in group.drain(..) {
            for (reply, answer) in batch.replies {
                // A caller that went away still had its work committed;
                // a retry with the same nonce finds it.
                let _ = reply.send(answer);
            }
        }
    }
    tracing::debug!("store syncer stopped");
}

/// WAL fsyncs of every store in this process, for the load generator (and
/// any later metrics endpoint): how much of a run the disk stalled.
pub static WAL_SYNCS: WalSyncStats = WalSyncStats {
    syncs: AtomicU64::new(0),
    total_us: AtomicU64::new(0),
    slow: AtomicU64::new(0),
    slow_us: AtomicU64::new(0),
    max_us: AtomicU64::new(0),
};

/// An fsync at least this long counts as slow (the foundation target's
/// p99 latency).
pub const SLOW_WAL_SYNC_US: u64 = 5_000;

/// Counters only ever grow (`max_us` aside): callers diff two snapshots.
pub struct WalSyncStats {
    syncs: AtomicU64,
    total_us: AtomicU64,
    slow: AtomicU64,
    slow_us: AtomicU64,
    max_us: AtomicU64,
}

/// The counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalSyncSnapshot {
    pub syncs: u64,
    pub total_us: u64,
    /// Fsyncs of at least `SLOW_WAL_SYNC_US`, and their summed time.
    pub slow: u64,
    pub slow_us: u64,
    /// Longest fsync since the process started.
    pub max_us: u64,
}

impl WalSyncStats {
    fn record(&self, took_us: u64) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.total_us.fetch_add(took_us, Ordering::Relaxed);
        if took_us >= SLOW_WAL_SYNC_US {
            self.slow.fetch_add(1, Ordering::Relaxed);
            self.slow_us.fetch_add(took_us, Ordering::Relaxed);
        }
        self.max_us.fetch_max(took_us, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> WalSyncSnapshot {
        WalSyncSnapshot {
            syncs: self.syncs.load(Ordering::Relaxed),
            total_us: self.total_us.load(Ordering::Relaxed),
            slow: self.slow.load(Ordering::Relaxed),
            slow_us: self.slow_us.load(Ordering::Relaxed),
            max_us: self.max_us.load(Ordering::Relaxed),
        }
    }
}

/// fsyncs the WAL. The file is reopened if it is not the one open (SQLite
/// does not replace it while connections are open, but syncing a stale
/// file would silently sync nothing).
fn sync_wal(path: &Path, wal: &mut Option<(std::fs::File, u64)>) -> std::io::Result<()> {
    let inode = std::fs::metadata(path)?.ino();
    let file = match wal {
        Some((file, open_inode)) if *open_inode == inode => file,
        _ => &wal.insert((std::fs::File::open(path)?, inode)).0,
    };
    // Data only (fdatasync): the WAL's contents and size are what
    // recovery needs; its timestamps are not worth a journal commit.
    file.sync_data()
}

/// Plans, writes and commits a batch; an error aborts the whole batch
/// (nothing is committed).
///
/// Most batches take the fast path: issuance only, and none of their
/// request keys committed recently (`RecentRequests`). Those are planned
/// as if no request were a retry and go to SQLite as one script with
/// their BEGIN and COMMIT: one round trip to SQLite's worker thread
/// instead of four (each a pair of thread wake-ups, the largest per-batch
/// cost measured). If a request was a retry after all, its request-log
/// row already exists, the script fails, and the batch is redone the
/// careful way, which reads the request log first. Either way a request
/// is answered once.
async fn apply_batch(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let fast = commands.iter().all(|c| !matches!(c, Command::Lifecycle(_)))
        && !commands
            .iter()
            .filter_map(Command::request)
            .any(|r| state.recent.may_contain(&r.agent, &r.nonce, r.timestamp_ms));
    let answers = if fast {
        match apply_fast(conn, commands, state, stamper, now_ms).await {
            Ok(answers) => answers,
            Err(e) => {
                // The script may have stopped inside its transaction.
                if let Err(rollback) = sqlx::query("ROLLBACK").execute(&mut *conn).await
                    && !rollback.to_string().contains("no transaction is active")
                {
                    tracing::warn!(error = %rollback, "rolling back a failed batch");
                }
                // The plan changed the cache; the database did not.
                lock(&state.known).clear();
                // Only a request-log key conflict (a retry the writer did
                // not remember) is worth redoing; anything else is the
                // batch's error, as on the careful path.
                let retry_found = matches!(&e, sqlx::Error::Database(db)
                    if db.kind() == sqlx::error::ErrorKind::UniqueViolation);
                if !retry_found {
                    return Err(e);
                }
                tracing::debug!(error = %e, "batch redone with request-log lookups");
                apply_careful(conn, commands, state, stamper, now_ms).await?
            }
        }
    } else {
        apply_careful(conn, commands, state, stamper, now_ms).await?
    };
    for request in commands.iter().filter_map(Command::request) {
        state.recent.insert(&request.agent, &request.nonce, now_ms);
    }
    Ok(answers)
}

/// Parents the batch names that the cache lacks (all of them after the
/// cache was dropped for size).
fn missing_parents(commands: &[Command], known: &KnownCache) -> (Vec<RequestKey>, Vec<Id>) {
    let mut cache = lock(known);
    if cache.len() > MAX_CACHED_CONTRACTS || cache.bytes() > MAX_CACHED_CONTRACT_BYTES {
        cache.clear();
    }
    batch::needs(commands, &cache)
}

/// The fast path of `apply_batch`: no request-log read before planning.
async fn apply_fast(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let (_, parent_ids) = missing_parents(commands, &state.known);
    // Outside a transaction: the writer is the only writer, so nothing
    // changes between this read and the script.
    load_parents(conn, &parent_ids, &state.known).await?;
    let mut prior = HashMap::new();
    let mut plan = batch::plan(
        commands,
        &mut prior,
        &mut lock(&state.known),
        &mut state.next_seq,
        stamper,
        now_ms,
    );
    // A command answered with an error (unknown parent, over-long
    // predicate) writes no request-log row, so no insert would catch a
    // retry among them: those few keys are looked up here. Their errors
    // changed nothing, so a replayed answer simply replaces them.
    let unlogged: Vec<RequestKey> = commands
        .iter()
        .zip(&plan.answers)
        .filter(|(_, answer)| answer.is_err())
        .filter_map(|(command, _)| command.request())
        .map(|r| (r.agent, r.nonce.clone()))
        .collect();
    if !unlogged.is_empty() {
        let earlier = load_prior_requests(conn, &unlogged).await?;
        for (command, answer) in commands.iter().zip(plan.answers.iter_mut()) {
            if let (Err(_), Some(request)) = (&answer, command.request())
                && let Some(prior) = earlier.get(&(request.agent, request.nonce.clone()))
            {
                *answer = batch::replayed(prior, request);
            }
        }
    }
    let mut script = Script::default();
    script.statement("BEGIN IMMEDIATE");
    let writes = plan_statements(&mut script, &plan, &state.trees);
    if writes > 0 {
        script.statement("COMMIT");
        // Numbered before it starts: see `Durability::committed`.
        state.committed.fetch_add(1, Ordering::SeqCst);
        let began = std::time::Instant::now();
        script.query.build().execute(&mut *conn).await?;
        tracing::trace!(
            statements = script.statements,
            took_us = began.elapsed().as_micros() as u64,
            "batch script ran"
        );
    }
    Ok(plan.answers)
}

/// Loads the named parents into the cache.
async fn load_parents(
    conn: &mut SqliteConnection,
    parent_ids: &[Id],
    known: &KnownCache,
) -> Result<(), sqlx::Error> {
    let mut corrupt = Vec::new();
    for chunk in parent_ids.chunks(ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(format!(
            "SELECT {PARENT_COLUMNS} FROM contracts_with_envelope WHERE id IN ("
        ));
        let mut list = query.separated(", ");
        for id in chunk {
            list.push_bind(id.as_slice());
        }
        query.push(")");
        let rows = query.build().fetch_all(&mut *conn).await?;
        let mut cache = lock(known);
        for row in rows {
            match known_from_row(&row) {
                Ok((id, k)) => {
                    cache.insert(id, k);
                }
                Err(e) => corrupt.push(e),
            }
        }
    }
    match corrupt.pop() {
        Some(e) => Err(sqlx::Error::Protocol(format!("corrupt contract row: {e}"))),
        None => Ok(()),
    }
}

/// The careful path of `apply_batch`: reads the request log first and runs
/// lifecycle commands, all in one transaction.
async fn apply_careful(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let (request_keys, parent_ids) = missing_parents(commands, &state.known);
    let mut prior = load_prior_requests(&mut tx, &request_keys).await?;
    load_parents(&mut tx, &parent_ids, &state.known).await?;
    let t0 = std::time::Instant::now();
    let plan = batch::plan(
        commands,
        &mut prior,
        &mut lock(&state.known),
        &mut state.next_seq,
        stamper,
        now_ms,
    );
    let t1 = std::time::Instant::now();
    let mut script = Script::default();
    if plan_statements(&mut script, &plan, &state.trees) > 0 {
        script.query.build().execute(&mut *tx).await?;
    }
    let mut answers = plan.answers;
    for (i, command) in commands.iter().enumerate() {
        if let Command::Lifecycle(lifecycle) = command {
            let applied = super::lifecycle::apply(
                &mut tx,
                lifecycle,
                &prior,
                stamper,
                &state.trees,
                &mut state.next_seq,
                now_ms,
            )
            .await?;
            let mut cache = lock(&state.known);
            for id in &applied.changed {
                cache.remove(id);
            }
            drop(cache);
            // A duplicate later in this batch replays this answer.
            if let (Some(request), Ok(answer)) = (&lifecycle.request, &applied.answer)
                && let Outcome::Receipt {
                    receipt_id,
                    envelope,
                } = &answer.outcome
            {
                prior.insert(
                    (request.agent, request.nonce.clone()),
                    PriorRequest {
                        digest: request.digest,
                        outcome: batch::OUTCOME_RECEIPT,
                        ref_id: *receipt_id,
                        envelope: envelope.clone(),
                    },
                );
            }
            answers[i] = applied.answer;
        }
    }
    let t2 = std::time::Instant::now();
    // Numbered before it starts: see `Durability::committed`.
    state.committed.fetch_add(1, Ordering::SeqCst);
    tx.commit().await?;
    tracing::trace!(
        plan_us = (t1 - t0).as_micros() as u64,
        write_us = (t2 - t1).as_micros() as u64,
        commit_us = t2.elapsed().as_micros() as u64,
        "batch phases"
    );
    Ok(answers)
}

async fn load_prior_requests(
    conn: &mut SqliteConnection,
    keys: &[RequestKey],
) -> Result<HashMap<RequestKey, PriorRequest>, sqlx::Error> {
    let mut prior = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(
            "SELECT r.agent_key, r.nonce, r.body_digest, r.outcome, r.ref_id, \
             COALESCE(c.envelope, x.envelope) AS envelope FROM requests r \
             LEFT JOIN contracts_with_envelope c ON r.outcome = 1 AND c.id = r.ref_id \
             LEFT JOIN receipts x ON r.outcome = 2 AND x.id = r.ref_id WHERE ",
        );
        let mut first = true;
        for (agent, nonce) in chunk {
            if !first {
                query.push(" OR ");
            }
            first = false;
            query.push("(r.agent_key = ");
            query.push_bind(agent.as_slice());
            query.push(" AND r.nonce = ");
            query.push_bind(nonce.as_slice());
            query.push(")");
        }
        for row in query.build().fetch_all(&mut *conn).await? {
            let agent: Vec<u8> = row.try_get("agent_key")?;
            let nonce: Vec<u8> = row.try_get("nonce")?;
            let digest: Vec<u8> = row.try_get("body_digest")?;
            let ref_id: Vec<u8> = row.try_get("ref_id")?;
            let envelope: Vec<u8> = row.try_get("envelope")?;
            let bad = |what: &str| sqlx::Error::Protocol(format!("corrupt requests row: {what}"));
            let agent: AgentKey = agent.try_into().map_err(|_| bad("agent_key"))?;
            prior.insert(
                (agent, nonce),
                PriorRequest {
                    digest: digest.try_into().map_err(|_| bad("body_digest"))?,
                    outcome: row.try_get("outcome")?,
                    ref_id: ref_id.try_into().map_err(|_| bad("ref_id"))?,
                    envelope: pb::Sealed::decode(envelope.as_slice())
                        .map_err(|_| bad("envelope"))?,
                },
            );
        }
    }
    Ok(prior)
}

/// Appends the plan's writes to `script`; returns how many statements.
/// One script per batch: one hand-off to sqlx's worker thread instead of
/// one per statement.
fn plan_statements(script: &mut Script, plan: &Plan, trees: &super::TreeChanges) -> usize {
    let before = script.statements;
    for row in &plan.contracts {
        trees.touch(row.root_id, row.seq);
    }
    for row in &plan.receipts {
        trees.touch(row.root_id, row.seq);
    }
    for chunk in plan.contracts.chunks(ROWS_PER_STATEMENT) {
        script.statement(
            "INSERT INTO contracts (seq, id, parent_seq, parent_id, root_seq, root_id, depth, \
             delegate_key, liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
             deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
             retry_headroom, require_host, issued_at_ms, status, budget, reserved, spent, \
             open_children, host_key, labels) ",
        );
        script.query.push_values(chunk, |mut b, row| {
            b.push_bind(row.seq)
                .push_bind(row.id.as_slice())
                .push_bind(row.parent.map(|(seq, _)| seq))
                .push_bind(row.parent.as_ref().map(|(_, id)| id.as_slice()))
                .push_bind(row.root_seq)
                .push_bind(row.root_id.as_slice())
                .push_bind(i64::from(row.depth))
                .push_bind(row.delegate_key.as_slice())
                .push_bind(i64::from(row.liability.as_i32()))
                .push_bind(row.intent_lineage_hash.as_slice())
                .push_bind(i64::from(row.cumulative_trust_ppm))
                .push_bind(row.effective_predicate.as_str())
                .push_bind(row.deadline_ms)
                .push_bind(row.write_scope_json.as_str())
                .push_bind(i64::from(row.policy.max_depth))
                .push_bind(i64::from(row.policy.min_cumulative_trust_ppm))
                .push_bind(i64::from(row.policy.max_children))
                .push_bind(i64::from(row.policy.retry_headroom))
                .push_bind(i64::from(row.policy.require_host))
                .push_bind(row.issued_at_ms)
                .push_bind(i64::from(row.status.as_i32()))
                .push_bind(row.ledger.budget)
                .push_bind(row.ledger.reserved)
                .push_bind(row.ledger.spent)
                .push_bind(i64::from(row.ledger.open_children))
                .push_bind(row.host_key.map(|h| h.to_vec()))
                .push_bind(row.labels_json.as_str());
        });
        script.statement("INSERT INTO contract_envelopes (seq, envelope, trace_context) ");
        script.query.push_values(chunk, |mut b, row| {
            b.push_bind(row.seq)
                .push_bind(row.envelope.as_slice())
                .push_bind(row.trace.map(|t| t.to_vec()));
        });
    }
    let labels: Vec<(i64, &str, &str)> = plan
        .contracts
        .iter()
        .flat_map(|row| {
            row.run_labels
                .iter()
                .map(move |(key, value)| (row.seq, key.as_str(), value.as_str()))
        })
        .collect();
    for chunk in labels.chunks(ROWS_PER_STATEMENT) {
        script.statement("INSERT INTO run_labels (label_key, label_value, root_seq) ");
        script.query.push_values(chunk, |mut b, (seq, key, value)| {
            b.push_bind(*key).push_bind(*value).push_bind(*seq);
        });
    }
    // One UPDATE for every changed earlier contract: a CASE per column.
    for chunk in plan.states.chunks(ROWS_PER_STATEMENT / 8) {
        script.statement("UPDATE contracts SET ");
        type Column = fn(&(i64, Status, Ledger)) -> i64;
        let columns: [(&str, Column); 4] = [
            ("status", |(_, s, _)| i64::from(s.as_i32())),
            ("reserved", |(_, _, l)| l.reserved),
            ("spent", |(_, _, l)| l.spent),
            ("open_children", |(_, _, l)| i64::from(l.open_children)),
        ];
        for (i, (name, value)) in columns.iter().enumerate() {
            if i > 0 {
                script.query.push(", ");
            }
            script.query.push(*name).push(" = CASE seq");
            for state in chunk {
                script
                    .query
                    .push(" WHEN ")
                    .push_bind(state.0)
                    .push(" THEN ")
                    .push_bind(value(state));
            }
            script.query.push(" END");
        }
        script.query.push(" WHERE seq IN (");
        let mut list = script.query.separated(", ");
        for state in chunk {
            list.push_bind(state.0);
        }
        script.query.push(")");
    }
    for chunk in plan.receipts.chunks(ROWS_PER_STATEMENT) {
        script.statement(
            "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) ",
        );
        script.query.push_values(chunk, |mut b, row| {
            b.push_bind(row.seq)
                .push_bind(row.id.as_slice())
                .push_bind(row.kind)
                .push_bind(row.contract_seq)
                .push_bind(row.contract_id.as_slice())
                .push_bind(row.root_id.as_slice())
                .push_bind(row.envelope.as_slice())
                .push_bind(row.at_ms);
        });
    }
    for chunk in plan.requests.chunks(ROWS_PER_STATEMENT) {
        script.statement(
            "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) ",
        );
        script.query.push_values(chunk, |mut b, row| {
            b.push_bind(row.agent.as_slice())
                .push_bind(row.nonce.as_slice())
                .push_bind(row.digest.as_slice())
                .push_bind(row.outcome)
                .push_bind(row.ref_id.as_slice())
                .push_bind(row.at_ms);
        });
    }
    script.statements - before
}

/// Statements joined into one SQL script (separated by `;`), with their
/// bind parameters in order.
#[derive(Default)]
struct Script {
    query: QueryBuilder<Sqlite>,
    statements: usize,
}

impl Script {
    /// Starts the next statement with `sql`.
    fn statement(&mut self, sql: &str) -> &mut QueryBuilder<Sqlite> {
        if self.statements > 0 {
            self.query.push("; ");
        }
        self.statements += 1;
        self.query.push(sql)
    }
}

const PARENT_COLUMNS: &str = "seq, id, root_seq, root_id, depth, status, delegate_key, liability, \
     intent_lineage_hash, cumulative_trust_ppm, effective_predicate, deadline_ms, write_scope, \
     max_depth, min_cumulative_trust_ppm, max_children, retry_headroom, require_host, budget, \
     reserved, spent, \
     open_children, envelope";

fn known_from_row(row: &SqliteRow) -> Result<(Id, Known), StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(what.to_owned());
    let get_u32 = |column: &str| -> Result<u32, StoreError> {
        let v: i64 = row.try_get(column).map_err(backend)?;
        u32::try_from(v).map_err(|_| corrupt(column))
    };
    let scope_json: String = row.try_get("write_scope").map_err(backend)?;
    let prefixes: Vec<String> =
        serde_json::from_str(&scope_json).map_err(|_| corrupt("write_scope"))?;
    let liability: i64 = row.try_get("liability").map_err(backend)?;
    let envelope = decode_envelope(row, "envelope")?;
    let contract = pb::Contract::decode(envelope.payload.as_slice())
        .map_err(|_| corrupt("contract payload"))?;
    let retry_headroom: i64 = row.try_get("retry_headroom").map_err(backend)?;
    let require_host: i64 = row.try_get("require_host").map_err(backend)?;
    let view = ParentView {
        status: status_from(row.try_get("status").map_err(backend)?)?,
        delegate_key: id_column(row, "delegate_key")?,
        depth: get_u32("depth")?,
        intent_lineage_hash: id_column(row, "intent_lineage_hash")?,
        cumulative_trust_ppm: get_u32("cumulative_trust_ppm")?,
        liability: i32::try_from(liability)
            .ok()
            .and_then(Liability::from_i32)
            .ok_or_else(|| corrupt("liability"))?,
        effective_predicate: Predicate::from_trusted(
            row.try_get("effective_predicate").map_err(backend)?,
        ),
        deadline_ms: row.try_get("deadline_ms").map_err(backend)?,
        write_scope: Scope::from_trusted(prefixes),
        policy: Policy {
            max_depth: get_u32("max_depth")?,
            min_cumulative_trust_ppm: get_u32("min_cumulative_trust_ppm")?,
            max_children: get_u32("max_children")?,
            retry_headroom: retry_headroom != 0,
            require_host: require_host != 0,
        },
        ledger: ledger_from_row(row)?,
    };
    Ok((
        id_column(row, "id")?,
        Known {
            seq: row.try_get("seq").map_err(backend)?,
            view,
            root_id: id_column(row, "root_id")?,
            root_seq: row.try_get("root_seq").map_err(backend)?,
            contract: Arc::new(contract),
        },
    ))
}

/// Locks the cache. A panic while holding it (a bug) must not wedge the
/// broker: the cache is only an accelerator, so a poisoned one is cleared.
fn lock(known: &KnownCache) -> MutexGuard<'_, KnownMap> {
    known.lock().unwrap_or_else(|poisoned| {
        let mut guard = poisoned.into_inner();
        guard.clear();
        guard
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::core::limits::JUDGMENT_DEADLINE_MS;
    use crate::store::suite::{TEST_TIMESTAMP_MS, issued, meta, receipt, test_child, test_root};

    fn test_stamper() -> Arc<Stamper> {
        Arc::new(Stamper::new(ed25519_dalek::SigningKey::from_bytes(
            &[1u8; 32],
        )))
    }

    /// A store on `path` with the test options and the system clock.
    async fn open_test_store(path: PathBuf, stamper: Arc<Stamper>) -> SqliteStore {
        SqliteStore::open(test_options(path), stamper, Arc::new(SystemClock))
            .await
            .expect("open")
    }

    /// The store suite (`store::suite`) against SQLite.
    async fn open_suite_store() -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let stamper = test_stamper();
        let store = open_test_store(dir.path().join("broker.sqlite3"), stamper).await;
        (store, dir)
    }

    crate::store::suite::store_suite!(suite, super::open_suite_store);

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
        let connect = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let (id, agent, nonce, digest) = ([7u8; 32], [9u8; 32], vec![5u8; 16], [3u8; 32]);
        let envelope = b"an old-format signed contract".to_vec();
        {
            let mut conn = SqliteConnection::connect_with(&connect)
                .await
                .expect("connect");
            sqlx::migrate!("./migrations/sqlite")
                .run_to(1, &mut conn)
                .await
                .expect("schema 1");
            sqlx::query(
                "INSERT INTO contracts (seq, id, root_seq, root_id, depth, delegate_key, liability, \
                 intent_lineage_hash, cumulative_trust_ppm, effective_predicate, deadline_ms, \
                 write_scope, max_depth, min_cumulative_trust_ppm, max_children, retry_headroom, \
                 envelope, issued_at_ms, status, budget, reserved, spent, open_children, labels) \
                 VALUES (1, $1, 1, $1, 0, $2, 1, $1, 1000000, 'true', 1, '[]', 4, 0, 8, 0, $3, 1, \
                 1, 100, 0, 0, 0, '{\"arm\":\"a\",\"note\":\"say \\\"hi\\\" \\\\ é\"}')",
            )
            .bind(id.as_slice())
            .bind(agent.as_slice())
            .bind(envelope.as_slice())
            .execute(&mut conn)
            .await
            .expect("schema-1 contract");
            sqlx::query(
                "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
                 VALUES ($1, $2, $3, 1, $4, 1)",
            )
            .bind(agent.as_slice())
            .bind(nonce.as_slice())
            .bind(digest.as_slice())
            .bind(id.as_slice())
            .execute(&mut conn)
            .await
            .expect("schema-1 request");
            sqlx::migrate!("./migrations/sqlite")
                .run_to(LINEAR_FORMAT_MIGRATION - 1, &mut conn)
                .await
                .expect("schema 9");
            let (kept, budget): (Vec<u8>, i64) = sqlx::query_as(
                "SELECT envelope, budget FROM contracts_with_envelope WHERE id = $1",
            )
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
        let path = dir.path().join("broker.sqlite3");
        let connect = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        {
            let mut conn = SqliteConnection::connect_with(&connect)
                .await
                .expect("connect");
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
            request_log_retention_ms: i64::MAX,
            // See `suite::TEST_TIMESTAMP_MS`.
            timestamp_window_ms: 0,
            max_audit_rows: MAX_AUDIT_ROWS,
            max_audit_bytes: MAX_AUDIT_BYTES,
            before_wal_sync: None,
            before_judge: None,
            judgment_deadline_ms: crate::core::limits::JUDGMENT_DEADLINE_MS,
            metrics: None,
        }
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
        let stamper = test_stamper();
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
            let store = open_test_store(path.clone(), stamper.clone()).await;
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
        let store = open_test_store(path.clone(), stamper).await;
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
        let root = store.contract(id).await.expect("read").expect("root");
        assert_eq!(
            (root.ledger.reserved, root.ledger.open_children),
            (20, 2),
            "two children of 10, the retry reserved nothing"
        );
        let contracts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
            .fetch_one(&store.reader)
            .await
            .expect("count");
        assert_eq!(contracts, 4, "the retries issued nothing");
    }

    /// Completions are judged before they reach the writer. The writer
    /// trusts such a judgment only while the contract's observations are
    /// the ones it saw: one recorded in between (here a write outside the
    /// scope) makes the writer send it back to be judged again, off the
    /// writer, on what the host reported.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_judgment_made_before_an_observation_is_made_again() {
        let dir = tempfile::tempdir().expect("temp dir");
        let stamper = test_stamper();
        let clock = Arc::new(SystemClock);
        let store = SqliteStore::open(
            test_options(dir.path().join("broker.sqlite3")),
            stamper,
            clock.clone(),
        )
        .await
        .expect("open");
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let (delegate, host) = (20u8, 30u8);
        let mut verdicts = Vec::new();
        // (observe before completing, tamper with the early judgment)
        for (i, (observe_first, tamper)) in [(false, false), (true, false), (false, true)]
            .into_iter()
            .enumerate()
        {
            let i = u8::try_from(i).expect("three cases");
            let child = issued(
                store
                    .delegate(test_child(9, 10 + i, root, delegate, "result.within_scope"))
                    .await,
            );
            let transition = |nonce: u8, agent: u8, action: Action| {
                Command::Lifecycle(Box::new(LifecycleCommand {
                    request: Some(meta(agent, nonce)),
                    contract_id: child,
                    action,
                }))
            };
            let accepted = receipt(
                store
                    .submit(transition(
                        20 + i,
                        delegate,
                        Action::Accept {
                            host: Some([host; 32]),
                        },
                    ))
                    .await,
            );
            assert_eq!(accepted.kind, pb::ReceiptKind::Accepted as i32);
            let mut args = CompleteArgs {
                output_json: "{}".into(),
                output: serde_json::json!({}),
                has_report: false,
                claim: "done".into(),
                reported_consumed: 1,
                received_at_ms: Some(clock.now_ms()),
                prejudged: None,
            };
            let mut conn = store.reader.acquire().await.expect("reader");
            let at_ms = clock.now_ms();
            let stranger = JudgeInputs::load(&mut conn, &child, &[host; 32], at_ms).await;
            assert!(
                matches!(stranger, Ok(None)),
                "only the delegate's completion is judged early"
            );
            let inputs = JudgeInputs::load(&mut conn, &child, &[delegate; 32], at_ms)
                .await
                .expect("inputs")
                .expect("open contract");
            drop(conn);
            let mut before = inputs.judge(&args);
            assert_eq!(
                before.judgment.verdict,
                crate::core::judge::Verdict::Accepted
            );
            if tamper {
                // Shows which judgment the writer used.
                before.judgment.verdict = crate::core::judge::Verdict::Rejected;
            }
            args.prejudged = Some(before);
            if observe_first {
                let observation = crate::command::ObservationIn {
                    kind: pb::ObservationKind::Mutation,
                    path: "etc/passwd".into(),
                    tool: "shell".into(),
                    units: 0,
                    at_ms: clock.now_ms(),
                };
                let recorded = receipt(
                    store
                        .submit(transition(
                            30 + i,
                            host,
                            Action::Record {
                                observations: vec![observation],
                            },
                        ))
                        .await,
                );
                assert_eq!(recorded.kind, pb::ReceiptKind::Observed as i32);
            }
            let completed = if observe_first {
                // The writer does not judge: it sends the stale judgment
                // back, and the store's front door judges again.
                let answer = store
                    .submit(transition(
                        40 + i,
                        delegate,
                        Action::Complete(Box::new(args.clone())),
                    ))
                    .await;
                assert!(
                    matches!(answer, Err(StoreError::StaleJudgment)),
                    "{answer:?}"
                );
                receipt(
                    store
                        .transition(LifecycleCommand {
                            request: Some(meta(delegate, 40 + i)),
                            contract_id: child,
                            action: Action::Complete(Box::new(args)),
                        })
                        .await,
                )
            } else {
                receipt(
                    store
                        .submit(transition(
                            40 + i,
                            delegate,
                            Action::Complete(Box::new(args)),
                        ))
                        .await,
                )
            };
            let completion = completed.completion.expect("completion");
            verdicts.push((completion.verdict, completion.within_scope));
        }
        assert_eq!(
            verdicts,
            [
                (crate::core::judge::Verdict::Accepted.as_i32(), true),
                (crate::core::judge::Verdict::Rejected.as_i32(), false),
                (crate::core::judge::Verdict::Rejected.as_i32(), true),
            ],
            "a new observation: judged again; unchanged observations: the \
             judgment made before is used (the writer does not judge again)"
        );
    }

    /// Requests at once after a restart — retries the writer forgot, new
    /// requests, and duplicates among the new ones — share batches (the
    /// fast path's failure then redoes several commands at once); each is
    /// answered once and the parent's ledger counts each child once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_retries_and_new_requests_are_each_answered_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("broker.sqlite3");
        let stamper = test_stamper();
        let (root, earlier) = {
            let store = open_test_store(path.clone(), stamper.clone()).await;
            let root = issued(store.open_root(test_root(meta(9, 1))).await);
            let mut earlier = Vec::new();
            for nonce in 10..14 {
                earlier.push(issued(
                    store.delegate(test_child(9, nonce, root, 8, "true")).await,
                ));
            }
            (root, earlier)
        };
        let store = open_test_store(path, stamper).await;
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
        let ledger = store
            .contract(root)
            .await
            .expect("read")
            .expect("root")
            .ledger;
        assert_eq!((ledger.reserved, ledger.open_children), (80, 8));
        let contracts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
            .fetch_one(&store.reader)
            .await
            .expect("count");
        assert_eq!(contracts, 9);
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
        let mut options = test_options(dir.path().join("broker.sqlite3"));
        options.before_wal_sync = Some(BeforeWalSync(Arc::new(hook)));
        SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open")
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
        let store = open_test_store(dir.path().join("broker.sqlite3"), test_stamper()).await;
        assert!(store.contract(durable_root).await.expect("read").is_some());
    }

    /// Nothing a crash could undo is shown: while the syncer is held, a
    /// read that would see a committed but unsynced child waits, and the
    /// child's own answer waits too; both come once the fsync is done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_wait_for_the_fsync_of_what_they_would_show() {
        let dir = tempfile::tempdir().expect("temp dir");
        let gate = Arc::new((Mutex::new(true), std::sync::Condvar::new()));
        let held = gate.clone();
        let store = open_hooked_store(&dir, move || {
            let (open, changed) = &*held;
            let mut open = open.lock().expect("gate");
            while !*open {
                open = changed.wait(open).expect("gate");
            }
            Ok(())
        })
        .await;
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let set_gate = |value: bool| {
            let (open, changed) = &*gate;
            *open.lock().expect("gate") = value;
            changed.notify_all();
        };
        set_gate(false);
        let before = store.durability.committed.load(Ordering::SeqCst);
        let writer = {
            let store = store.clone();
            tokio::spawn(async move { store.delegate(test_child(9, 2, root, 8, "true")).await })
        };
        // Wait until the child is committed: its number is taken and its
        // row is visible to a raw read (one that does not wait).
        loop {
            let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
                .fetch_one(&store.reader)
                .await
                .expect("count");
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
        set_gate(true);
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
        let gate = Arc::new((Mutex::new(true), std::sync::Condvar::new()));
        let held = gate.clone();
        let mut options = test_options(dir.path().join("broker.sqlite3"));
        options.queue_depth = QUEUE_DEPTH;
        options.before_wal_sync = Some(BeforeWalSync(Arc::new(move || {
            let (open, changed) = &*held;
            let mut open = open.lock().expect("gate");
            while !*open {
                open = changed.wait(open).expect("gate");
            }
            Ok(())
        })));
        let store = SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open");
        issued(store.open_root(test_root(meta(1, 0))).await);
        let set_gate = |value: bool| {
            let (open, changed) = &*gate;
            *open.lock().expect("gate") = value;
            changed.notify_all();
        };
        set_gate(false);
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
        assert_eq!(store.commands.capacity(), QUEUE_DEPTH - 1);
        for queued in 1..QUEUE_DEPTH {
            let store_for_task = store.clone();
            let request = next_meta();
            pending.push(tokio::spawn(async move {
                store_for_task.open_root(test_root(request)).await
            }));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while store.commands.capacity() > QUEUE_DEPTH - 1 - queued {
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
        set_gate(true);
        for task in pending {
            issued(task.await.expect("task"));
        }
    }

    /// However many completions arrive at once, at most
    /// `MAX_CONCURRENT_JUDGMENTS` are judged at a time (each judge is a
    /// thread with a deep stack); the rest wait for a permit, and all are
    /// answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_the_judgment_limit_is_judged_at_once() {
        // More than the limit, within the test root's fan-out (8).
        const COMPLETIONS: u8 = 7;
        let dir = tempfile::tempdir().expect("temp dir");
        // (open gate, live judges, most live at once)
        type Gate = (Mutex<(bool, usize, usize)>, std::sync::Condvar);
        let gate: Arc<Gate> = Arc::new((Mutex::new((false, 0, 0)), std::sync::Condvar::new()));
        let held = gate.clone();
        let mut options = test_options(dir.path().join("broker.sqlite3"));
        options.before_judge = Some(BeforeJudge(Arc::new(move || {
            let (state, changed) = &*held;
            let mut state = state.lock().expect("gate");
            state.1 += 1;
            state.2 = state.2.max(state.1);
            changed.notify_all();
            while !state.0 {
                state = changed.wait(state).expect("gate");
            }
            state.1 -= 1;
        })));
        let store = SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open");
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let mut completions = Vec::new();
        for i in 0..COMPLETIONS {
            // Each from its own delegate: one signer's judgments are capped
            // lower (MAX_JUDGMENTS_PER_SIGNER).
            let delegate = 20 + i;
            let child = issued(
                store
                    .delegate(test_child(9, 10 + i, root, delegate, "true"))
                    .await,
            );
            let accept = LifecycleCommand {
                request: Some(meta(delegate, 40 + i)),
                contract_id: child,
                action: Action::Accept {
                    host: Some([30; 32]),
                },
            };
            receipt(store.transition(accept).await);
            let store = store.clone();
            completions.push(tokio::spawn(async move {
                let complete = LifecycleCommand {
                    request: Some(meta(delegate, 80 + i)),
                    contract_id: child,
                    action: Action::Complete(Box::new(CompleteArgs {
                        output_json: "{}".into(),
                        output: serde_json::json!({}),
                        has_report: false,
                        claim: "done".into(),
                        reported_consumed: 1,
                        received_at_ms: None,
                        prejudged: None,
                    })),
                };
                store.transition(complete).await
            }));
        }
        // Wait until the limit is reached, then a while longer for any
        // judge beyond it to show up.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while gate.0.lock().expect("gate").1 < MAX_CONCURRENT_JUDGMENTS
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let most = gate.0.lock().expect("gate").2;
        assert_eq!(
            most, MAX_CONCURRENT_JUDGMENTS,
            "judges at once while {COMPLETIONS} completions wait"
        );
        {
            let (state, changed) = &*gate;
            state.lock().expect("gate").0 = true;
            changed.notify_all();
        }
        for completion in completions {
            let answer = receipt(completion.await.expect("task"));
            assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
        }
        assert_eq!(gate.0.lock().expect("gate").2, MAX_CONCURRENT_JUDGMENTS);
    }

    /// Opens a store whose judges run `hook` first, with a child of a root
    /// accepted by delegate 20 with host 30; returns (store, child id).
    async fn judged_store(
        dir: &std::path::Path,
        hook: BeforeJudge,
        judgment_deadline_ms: u64,
        predicate: &str,
    ) -> (SqliteStore, Id) {
        let mut options = test_options(dir.join("broker.sqlite3"));
        options.before_judge = Some(hook);
        options.judgment_deadline_ms = judgment_deadline_ms;
        let store = SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open");
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let child = issued(store.delegate(test_child(9, 2, root, 20, predicate)).await);
        let accept = LifecycleCommand {
            request: Some(meta(20, 3)),
            contract_id: child,
            action: Action::Accept {
                host: Some([30; 32]),
            },
        };
        receipt(store.transition(accept).await);
        (store, child)
    }

    fn complete(contract_id: Id, nonce: u8) -> LifecycleCommand {
        LifecycleCommand {
            request: Some(meta(20, nonce)),
            contract_id,
            action: Action::Complete(Box::new(CompleteArgs {
                output_json: "{}".into(),
                output: serde_json::json!({}),
                has_report: false,
                claim: "done".into(),
                reported_consumed: 1,
                received_at_ms: None,
                prejudged: None,
            })),
        }
    }

    /// Issue 11, item 9: a host observation recorded while a completion is
    /// judged made the writer judge again on its own thread (with an
    /// expensive predicate, every tenant's writes froze). Now the writer
    /// sends the completion back and it is judged again on a judge thread,
    /// on the new observation.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_writer_never_judges_a_completion_made_stale_by_an_observation() {
        let dir = tempfile::tempdir().expect("temp dir");
        let judged = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let (count, held) = (judged.clone(), gate.clone());
        let hook = BeforeJudge(Arc::new(move || {
            // The first judgment waits until the test has recorded an
            // observation; later ones go straight on.
            if count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                let _ = held.lock().expect("gate").recv();
            }
        }));
        let (store, child) = judged_store(
            dir.path(),
            hook,
            JUDGMENT_DEADLINE_MS,
            "result.within_scope",
        )
        .await;
        let completing = {
            let store = store.clone();
            tokio::spawn(async move { store.transition(complete(child, 4)).await })
        };
        while judged.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let record = LifecycleCommand {
            request: Some(meta(30, 5)),
            contract_id: child,
            action: Action::Record {
                observations: vec![crate::command::ObservationIn {
                    kind: pb::ObservationKind::Mutation,
                    path: "/etc/passwd".into(),
                    tool: String::new(),
                    units: 0,
                    at_ms: 0,
                }],
            },
        };
        receipt(store.transition(record).await);
        release.send(()).expect("release");
        let done = receipt(completing.await.expect("task"));
        let completion = done.completion.expect("a completion");
        assert_eq!(
            completion.verdict,
            crate::core::judge::Verdict::Rejected.as_i32(),
            "judged on the observation recorded during the first judgment"
        );
        assert_eq!(judged.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// An accepted child of `root` for delegate `[delegate; 32]` (host 30).
    async fn accepted_child(store: &SqliteStore, root: Id, delegate: u8, nonce: u8) -> Id {
        let child = issued(
            store
                .delegate(test_child(9, nonce, root, delegate, "true"))
                .await,
        );
        let accept = LifecycleCommand {
            request: Some(meta(delegate, nonce)),
            contract_id: child,
            action: Action::Accept {
                host: Some([30; 32]),
            },
        };
        receipt(store.transition(accept).await);
        child
    }

    fn complete_by(delegate: u8, contract_id: Id, nonce: u8) -> LifecycleCommand {
        LifecycleCommand {
            request: Some(meta(delegate, nonce)),
            ..complete(contract_id, nonce)
        }
    }

    /// Issue 11, item 6: a completion never waits for a judge without a
    /// deadline. With every judge held, completions are answered
    /// UNAVAILABLE (JUDGES_BUSY) at the deadline, nothing is recorded, and
    /// other writes go on meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_waits_for_a_judge_no_longer_than_its_deadline() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let held = gate.clone();
        let hook = BeforeJudge(Arc::new(move || {
            let _ = held.lock().expect("gate").recv();
        }));
        let (store, first) = judged_store(dir.path(), hook, 300, "true").await;
        let root = store
            .contract(first)
            .await
            .expect("read")
            .expect("found")
            .root_id;
        let mut children = vec![(20u8, first)];
        for i in 1..=MAX_CONCURRENT_JUDGMENTS {
            let delegate = 20 + u8::try_from(i).expect("few");
            children.push((
                delegate,
                accepted_child(&store, root, delegate, 40 + delegate).await,
            ));
        }
        // Fill every judge, each completion from its own delegate; each
        // waits past its deadline, the one beyond the pool too.
        let mut stuck = Vec::new();
        for (delegate, child) in children.clone() {
            let store = store.clone();
            stuck.push(tokio::spawn(async move {
                store
                    .transition(complete_by(delegate, child, 100 + delegate))
                    .await
            }));
        }
        for task in stuck {
            match task.await.expect("task") {
                Err(StoreError::Unavailable { reason, .. }) => assert_eq!(reason, "JUDGES_BUSY"),
                other => panic!("expected JUDGES_BUSY, got {other:?}"),
            }
        }
        // Other writes were never held up.
        let root_again = issued(store.open_root(test_root(meta(9, 50))).await);
        assert_ne!(root_again, first);
        for (_, child) in children {
            let status = store
                .contract(child)
                .await
                .expect("read")
                .expect("found")
                .status;
            assert_eq!(status, Status::Accepted, "nothing was recorded");
        }
        for _ in 0..MAX_CONCURRENT_JUDGMENTS {
            let _ = release.send(());
        }
    }

    /// Review of issue 11: one delegate (with a host it controls) could keep
    /// every judge busy. One completion of a contract is judged at a time,
    /// and one signer has at most `MAX_JUDGMENTS_PER_SIGNER` judged at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn judgments_are_one_per_contract_and_few_per_signer() {
        let dir = tempfile::tempdir().expect("temp dir");
        let entered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let (count, held) = (entered.clone(), gate.clone());
        let hook = BeforeJudge(Arc::new(move || {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = held.lock().expect("gate").recv();
        }));
        let (store, first) = judged_store(dir.path(), hook, JUDGMENT_DEADLINE_MS, "true").await;
        let root = store
            .contract(first)
            .await
            .expect("read")
            .expect("found")
            .root_id;
        let mut mine = vec![first];
        for i in 0..MAX_JUDGMENTS_PER_SIGNER {
            mine.push(accepted_child(&store, root, 20, 60 + u8::try_from(i).expect("few")).await);
        }
        let mut running = Vec::new();
        for (i, child) in mine.iter().take(MAX_JUDGMENTS_PER_SIGNER).enumerate() {
            let (store, child) = (store.clone(), *child);
            running.push(tokio::spawn(async move {
                store
                    .transition(complete(child, 90 + u8::try_from(i).expect("few")))
                    .await
            }));
        }
        while entered.load(std::sync::atomic::Ordering::SeqCst) < MAX_JUDGMENTS_PER_SIGNER {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A second completion of a contract being judged: not queued.
        match store.transition(complete(first, 99)).await {
            Err(StoreError::Unavailable { reason, .. }) => {
                assert_eq!(reason, "JUDGMENT_IN_PROGRESS")
            }
            other => panic!("expected JUDGMENT_IN_PROGRESS, got {other:?}"),
        }
        // A stranger's completion of that contract holds nothing: it is
        // refused for what it is, not for the judgment in progress.
        match store.transition(complete_by(77, first, 96)).await {
            Err(StoreError::PermissionDenied { reason, .. }) => assert_eq!(reason, "NOT_DELEGATE"),
            other => panic!("expected NOT_DELEGATE, got {other:?}"),
        }
        // The same signer's next contract: over its share.
        let last = *mine.last().expect("children");
        match store.transition(complete(last, 98)).await {
            Err(StoreError::Overloaded(limit)) => assert_eq!(limit, "MAX_JUDGMENTS_PER_SIGNER"),
            other => panic!("expected MAX_JUDGMENTS_PER_SIGNER, got {other:?}"),
        }
        for _ in 0..MAX_JUDGMENTS_PER_SIGNER {
            release.send(()).expect("release");
        }
        for task in running {
            let answer = receipt(task.await.expect("task"));
            assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
        }
        // Once answered, the signer's other contract is judged as usual.
        release.send(()).expect("release");
        let answer = receipt(store.transition(complete(last, 97)).await);
        assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
    }

    /// A prune pass deletes at most `MAX_PRUNED_PER_PASS` entries, oldest
    /// first and only those past the cutoff, so the writer's pause stays
    /// bounded; a backlog is worked off pass by pass.
    #[tokio::test]
    async fn a_prune_pass_is_bounded_and_takes_the_oldest_first() {
        let dir = tempfile::tempdir().expect("temp dir");
        let connect = SqliteConnectOptions::new()
            .filename(dir.path().join("broker.sqlite3"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let mut conn = SqliteConnection::connect_with(&connect)
            .await
            .expect("connect");
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
        let first = prune_requests(&mut conn, cutoff_ms).await.expect("prune");
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
        while prune_requests(&mut conn, cutoff_ms).await.expect("prune") > 0 {
            passes += 1;
        }
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
            let cache = lock(&store.known);
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

    /// An audit read stops at its row budget with an error naming the
    /// limit, instead of loading a tree of any size: a tree exactly at the
    /// budget is read, one more contract is refused.
    #[tokio::test]
    async fn an_audit_read_is_bounded_by_its_row_budget() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut options = test_options(dir.path().join("broker.sqlite3"));
        options.max_audit_rows = 3;
        let store = SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open");
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let mut children = Vec::new();
        for i in 0..3 {
            children.push(issued(
                store.delegate(test_child(9, 10 + i, root, 8, "true")).await,
            ));
        }
        let everything = std::collections::BTreeMap::new();
        let runs = store
            .runs(None, &everything, 10)
            .await
            .expect("at the budget");
        assert_eq!(runs[0].0.contracts.len(), 3);
        assert!(
            store
                .audit_facts(children[0])
                .await
                .expect("audit")
                .is_some()
        );
        issued(store.delegate(test_child(9, 20, root, 8, "true")).await);
        match store.runs(None, &everything, 10).await {
            Err(StoreError::Overloaded(limit)) => {
                assert!(limit.contains("MAX_AUDIT_ROWS"), "{limit}")
            }
            other => panic!("a tree past the row budget must be refused: {other:?}"),
        }
    }

    /// An audit read also stops at its byte budget (envelopes and paths),
    /// pulling rows one at a time, whatever its row budget allows.
    #[tokio::test]
    async fn an_audit_read_is_bounded_by_its_byte_budget() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut options = test_options(dir.path().join("broker.sqlite3"));
        // About four contracts.
        options.max_audit_bytes = 1_500;
        let store = SqliteStore::open(options, test_stamper(), Arc::new(SystemClock))
            .await
            .expect("open");
        let root = issued(store.open_root(test_root(meta(9, 1))).await);
        let everything = std::collections::BTreeMap::new();
        issued(store.delegate(test_child(9, 10, root, 8, "true")).await);
        assert!(
            store.runs(None, &everything, 10).await.is_ok(),
            "one child fits"
        );
        // Contracts are a few hundred bytes each (one hop's terms); the
        // tree's fan-out allows eight children.
        for i in 0..7 {
            issued(store.delegate(test_child(9, 11 + i, root, 8, "true")).await);
        }
        match store.runs(None, &everything, 10).await {
            Err(StoreError::Overloaded(limit)) => {
                assert!(limit.contains("MAX_AUDIT_BYTES"), "{limit}")
            }
            other => panic!("a tree past the byte budget must be refused: {other:?}"),
        }
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

    /// Under continuous writes a background checkpoint never catches up,
    /// so without the writer finishing it the WAL never restarts and grows
    /// with every commit. With a small restart size it stays bounded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_stays_bounded_under_continuous_writes() {
        const RESTART_BYTES: u64 = 256 * 1024;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("broker.sqlite3");
        let wal = wal_path_of(&path);
        let stamper = test_stamper();
        let store = SqliteStore::open(
            SqliteOptions {
                path,
                queue_depth: 1024,
                max_batch: 64,
                read_connections: 1,
                wal_restart_bytes: RESTART_BYTES,
                request_log_retention_ms: i64::MAX,
                timestamp_window_ms: 0,
                max_audit_rows: MAX_AUDIT_ROWS,
                max_audit_bytes: MAX_AUDIT_BYTES,
                before_wal_sync: None,
                before_judge: None,
                judgment_deadline_ms: crate::core::limits::JUDGMENT_DEADLINE_MS,
                metrics: None,
            },
            stamper,
            Arc::new(SystemClock),
        )
        .await
        .expect("open");
        let stop_at = std::time::Instant::now() + Duration::from_secs(3);
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
                        digest: crate::crypto::sha256(&nonce),
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
                if file.read_exact(&mut header).is_ok() {
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
        // ...so it holds about the restart size plus one interval of
        // writes, never everything written (over 100 MB here without it).
        assert!(
            largest_wal_bytes < 64 * 1024 * 1024,
            "WAL reached {largest_wal_bytes} bytes ({roots} roots)"
        );
    }
}
