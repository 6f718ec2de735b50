//! The single writer: takes queued commands in groups, plans them with
//! the backend-neutral planner (`store::batch`) and the core's lifecycle
//! decisions, writes each group in one transaction and hands it to the
//! syncer; prunes the request log between batches.

use super::*;
use crate::limits::PRUNE_INTERVAL;
use crate::limits::sqlite::MAX_PRUNED_PER_PASS;
use sqlx::sqlite::LockedSqliteHandle;

/// The writer's recent-request set, filled from the request log with every
/// key committed in the last two timestamp windows (what a fresh retry can
/// reach back to), so that right after a restart batches can already skip
/// the request-log read. If reading fails, the set starts empty and
/// vouches only for requests newer than now (batches read the log until
/// then).
pub(super) async fn load_recent(
    conn: &mut SqliteConnection,
    window_ms: i64,
    now_ms: i64,
) -> RecentRequests {
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

/// What the writer thread is started with.
pub(super) struct WriterStart {
    pub(super) connect: SqliteConnectOptions,
    pub(super) queue: mpsc::Receiver<(Command, Reply)>,
    pub(super) known: KnownCache,
    pub(super) trees: crate::TreeChanges,
    pub(super) committed: Arc<AtomicU64>,
    pub(super) synced: mpsc::Sender<Unsynced>,
    pub(super) finish_checkpoint: Arc<AtomicBool>,
    pub(super) stamper: Arc<Stamper>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) options: SqliteOptions,
    pub(super) writable: tokio::sync::watch::Sender<bool>,
}

/// Starts the writer on a thread and runtime of its own: its many short
/// waits on SQLite must not queue behind request handlers busy with
/// signature work, or every batch's round trips stretch out. The receiver
/// answers once the schema is migrated and the writer serves (or why not).
pub(super) fn start_writer(
    start: WriterStart,
) -> Result<oneshot::Receiver<Result<(), StoreError>>, StoreError> {
    let (ready, writer_ready) = oneshot::channel();
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
                    let _ = ready.send(Err(StoreError::Backend(format!("writer runtime: {e}"))));
                    return;
                }
            };
            runtime.block_on(run_writer(start, ready));
        })
        .map_err(|e| StoreError::Backend(format!("writer thread: {e}")))?;
    Ok(writer_ready)
}

async fn run_writer(start: WriterStart, ready: oneshot::Sender<Result<(), StoreError>>) {
    let (mut writer, next_seq) = match open_writer(&start.connect).await {
        Ok(opened) => opened,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let recent = load_recent(
        &mut writer,
        start.options.timestamp_window_ms,
        start.clock.now_ms(),
    )
    .await;
    let draining = match drain::any_drain::<Sqlite, _>(&mut Sqlx::<Sqlite>(&mut writer)).await {
        Ok(any) => any,
        Err(e) => {
            let _ = ready.send(Err(StoreError::Backend(format!("reading drains: {e}"))));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut state = WriterState {
        draining,
        cascade_step_rows: start.options.cascade_step_rows.max(1),
        drain_pace: Default::default(),
        known: start.known,
        trees: start.trees,
        next_seq,
        committed: start.committed,
        synced: start.synced,
        recent,
        retention_ms: start.options.request_log_retention_ms,
        next_prune: std::time::Instant::now(),
        finish_checkpoint: start.finish_checkpoint,
        metrics: start.options.metrics.clone(),
        writable: start.writable,
        statements: super::raw::Statements::default(),
    };
    let max_batch = start.options.max_batch.max(1);
    let looped = CatchUnwind(Box::pin(writer_loop(
        &mut writer,
        start.queue,
        &mut state,
        start.stamper,
        start.clock,
        max_batch,
    )))
    .await;
    // sqlx closes the connection with `sqlite3_close`, which refuses (and
    // sqlx panics) while a statement is still prepared: they are finalized
    // first, after a panic of the writer too.
    match super::raw::take_handle(&mut writer, retakes(&state)).await {
        Ok(mut locked) => state.statements.finalize_all(&mut locked),
        Err(e) => tracing::error!(error = %e, "the writer's statements could not be finalized"),
    }
    if state.statements.is_empty() {
        if let Err(e) = writer.close().await {
            tracing::warn!(error = %e, "closing the writer connection");
        }
    } else {
        // Closing would panic; what was committed is in the WAL, so the
        // connection is left for the process's exit instead.
        std::mem::forget(writer);
    }
    if let Err(panic) = looped {
        std::panic::resume_unwind(panic);
    }
}

/// Runs a future and returns its panic, if it panics, instead of
/// unwinding through the caller: the writer's connection must still be
/// tidied (`run_writer`) before the panic goes on.
struct CatchUnwind<F>(std::pin::Pin<Box<F>>);

impl<F: std::future::Future> std::future::Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = self.get_mut().0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

/// What the writer knows beyond the database: both are authoritative
/// because the writer is the only one that writes.
pub(super) struct WriterState {
    pub(super) known: KnownCache,
    /// A drain is in progress (`core::lifecycle::Ending`): batches then
    /// mark their issuing parents that are ending. Kept by the writer,
    /// the only one that starts or ends drains.
    pub(super) draining: bool,
    /// `SqliteOptions::cascade_step_rows`.
    pub(super) cascade_step_rows: usize,
    /// How many rows drain steps end (`DrainPace`).
    pub(super) drain_pace: crate::sql::drain::DrainPace,
    /// Which trees got events (see `TreeChanges`), shared with readers.
    pub(super) trees: crate::TreeChanges,
    /// The next contract's (or receipt's) sequence number.
    pub(super) next_seq: i64,
    /// The commit counter (see `Durability`).
    pub(super) committed: Arc<AtomicU64>,
    /// Committed batches, to the syncer: their answers wait for its fsync.
    pub(super) synced: mpsc::Sender<Unsynced>,
    /// Request keys committed recently: lets most batches skip reading
    /// the request log (see `apply_batch`).
    pub(super) recent: RecentRequests,
    /// `SqliteOptions::request_log_retention_ms`.
    pub(super) retention_ms: i64,
    /// When the writer next prunes the request log (see `prune_requests`).
    pub(super) next_prune: std::time::Instant,
    /// Set by the background checkpointer when the WAL has grown past
    /// `SqliteOptions::wal_restart_bytes`: the writer then finishes it.
    pub(super) finish_checkpoint: Arc<AtomicBool>,
    /// `SqliteOptions::metrics`.
    pub(super) metrics: Option<crate::metrics::StoreMetrics>,
    /// False while the disk refuses writes (see `health`).
    pub(super) writable: tokio::sync::watch::Sender<bool>,
    /// The batches' statements, prepared on the writer's connection and
    /// run on this thread (`raw`); finalized before it closes.
    pub(super) statements: super::raw::Statements,
}

/// The writer's work between batches, on its handle: finishing the
/// WAL's checkpoint when asked, pruning the request log when due. Both
/// run on the held handle rather than through sqlx: no hand-over of the
/// connection (see `raw::take_handle`) between batches. False when the
/// syncer has stopped: the writer stops too.
async fn maintain(
    handle: &mut LockedSqliteHandle<'_>,
    state: &mut WriterState,
    clock: &dyn Clock,
) -> bool {
    // The WAL only restarts from its beginning once every frame is
    // copied, and a background checkpoint never catches up with a busy
    // writer: the WAL would grow without bound (measured: 300 MB in 4 s).
    // So once it is big and drained (see `checkpointer`), the writer,
    // between batches, copies the few frames written since; its next
    // commit then restarts the WAL.
    if state.finish_checkpoint.swap(false, Ordering::AcqRel) {
        let began = std::time::Instant::now();
        let mut finish = Sql::default();
        finish.statement("PRAGMA wal_checkpoint(PASSIVE)");
        let finished = state.statements.run(handle, &finish);
        tracing::trace!(
            took_us = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX),
            "WAL checkpoint finished by the writer"
        );
        if let Err(e) = finished {
            static FINISH_FAILED: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = FINISH_FAILED.allow() {
                tracing::warn!(error = %e, held, "finishing the WAL checkpoint failed; will retry");
            }
        }
    }
    let now = std::time::Instant::now();
    if now >= state.next_prune {
        let cutoff_ms = clock.now_ms().saturating_sub(state.retention_ms);
        // A commit like any other (see `own_commit`).
        state.committed.fetch_add(1, Ordering::SeqCst);
        let pruned = prune_requests(handle, &mut state.statements, cutoff_ms);
        if !to_syncer(state, Vec::new()).await {
            return false;
        }
        state.next_prune = match pruned {
            // A full pass: more are due; go on after the next batch.
            Ok(deleted) if deleted >= MAX_PRUNED_PER_PASS => now,
            Ok(_) => now + PRUNE_INTERVAL,
            Err(e) => {
                static PRUNE_FAILED: broker_wire::throttle::Throttle =
                    broker_wire::throttle::Throttle::new();
                if let Some(held) = PRUNE_FAILED.allow() {
                    tracing::warn!(error = %e, held, "pruning the request log failed; will retry");
                }
                now + PRUNE_INTERVAL
            }
        };
    }
    true
}

/// The writer's counter of abandoned takes of its handle, if metrics are on.
pub(super) fn retakes(state: &WriterState) -> Option<&prometheus::IntCounter> {
    state.metrics.as_ref().map(|m| &m.sqlite_handle_retakes)
}

/// The commands of the batch being written and, in the same order, where
/// each one's answer goes.
struct Group {
    commands: Vec<Command>,
    replies: Vec<Reply>,
}

pub(super) async fn writer_loop(
    conn: &mut SqliteConnection,
    mut queue: mpsc::Receiver<(Command, Reply)>,
    state: &mut WriterState,
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    max_batch: usize,
) {
    let mut group = Group {
        commands: Vec::with_capacity(max_batch),
        replies: Vec::with_capacity(max_batch),
    };
    'serve: loop {
        let Some(first) = next_request(conn, &mut queue, state, clock.as_ref()).await else {
            break;
        };
        gather(first, &mut queue, &mut group, state, max_batch);
        // A held stretch: until a batch holds a drain's step (or fails),
        // the writer keeps SQLite's handle, reads and writes on it, and
        // takes batch after batch without handing the connection back to
        // sqlx's worker thread in between (each hand-off is two wake-ups
        // of that thread, each a wait for a core on a busy machine:
        // measured, the batch a command waits for −13 to −40%;
        // BENCHMARKS.md).
        let mut pending = Pending::Fresh;
        let mut now_ms = clock.now_ms();
        // A batch's time starts here, taking the handle included (and a
        // batch left pending keeps it: its planning counts too).
        let mut began = std::time::Instant::now();
        if *state.writable.borrow() {
            match super::raw::take_handle(conn, retakes(state)).await {
                Ok(mut handle) => loop {
                    match apply_held(&mut handle, &group.commands, state, &stamper, now_ms).await {
                        Held::Pending(p) => {
                            pending = p;
                            break;
                        }
                        Held::Answered(answers) => {
                            let answered = hand_over(
                                state,
                                &mut group.commands,
                                &mut group.replies,
                                Ok(answers),
                                began,
                            );
                            if !answered.await {
                                break 'serve;
                            }
                        }
                    }
                    if !maintain(&mut handle, state, clock.as_ref()).await {
                        break 'serve;
                    }
                    if !*state.writable.borrow() {
                        break;
                    }
                    let Some(first) = queue.recv().await else {
                        break 'serve;
                    };
                    gather(first, &mut queue, &mut group, state, max_batch);
                    now_ms = clock.now_ms();
                    began = std::time::Instant::now();
                },
                // The batch goes on through sqlx, which takes the handle
                // too for its script, and fails loudly if it cannot.
                Err(e) => tracing::error!(error = %e, "the writer could not take its connection"),
            }
        }
        // Whatever the held stretch left: with sqlx's connection.
        if !group.commands.is_empty() {
            let applied =
                apply_batch(conn, &group.commands, state, &stamper, now_ms, pending).await;
            if !hand_over(
                state,
                &mut group.commands,
                &mut group.replies,
                applied,
                began,
            )
            .await
            {
                break;
            }
            if !maintain_if_due(conn, state, clock.as_ref()).await {
                break;
            }
        }
    }
    tracing::debug!("store writer stopped");
}

/// The next request; while the disk refuses writes, the disk is probed
/// between requests. `None` when the queue has closed or the syncer has
/// stopped: the writer stops.
async fn next_request(
    conn: &mut SqliteConnection,
    queue: &mut mpsc::Receiver<(Command, Reply)>,
    state: &mut WriterState,
    clock: &dyn Clock,
) -> Option<(Command, Reply)> {
    loop {
        if *state.writable.borrow() {
            return queue.recv().await;
        }
        match tokio::time::timeout(super::health::PROBE_INTERVAL, queue.recv()).await {
            Ok(next) => return next,
            Err(_) => {
                if !probe_disk(conn, state, clock).await {
                    return None;
                }
            }
        }
    }
}

/// The writer's maintenance after a batch written through sqlx, when it
/// is due; false when the writer stops.
async fn maintain_if_due(
    conn: &mut SqliteConnection,
    state: &mut WriterState,
    clock: &dyn Clock,
) -> bool {
    if !maintenance_due(state) {
        return true;
    }
    match super::raw::take_handle(conn, retakes(state)).await {
        Ok(mut handle) => maintain(&mut handle, state, clock).await,
        Err(e) => {
            tracing::error!(error = %e, "the writer could not take its connection");
            true
        }
    }
}

/// Adds `first` and whatever else is queued (up to `max_batch`) to the
/// batch.
fn gather(
    first: (Command, Reply),
    queue: &mut mpsc::Receiver<(Command, Reply)>,
    group: &mut Group,
    state: &WriterState,
    max_batch: usize,
) {
    let Group { commands, replies } = group;
    commands.push(first.0);
    replies.push(first.1);
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
    for reply in replies.iter() {
        crate::phases::QUEUED.since(reply.queued_at);
    }
}

/// Work between batches (`maintain`): a checkpoint to finish, or the
/// request log's pruning.
fn maintenance_due(state: &WriterState) -> bool {
    state.finish_checkpoint.load(Ordering::Acquire) || std::time::Instant::now() >= state.next_prune
}

/// Hands a written (or failed) batch's answers to the syncer, which sends
/// them once the commit is durable; empties the batch. False when the
/// syncer has stopped: the writer stops too.
async fn hand_over(
    state: &mut WriterState,
    commands: &mut Vec<Command>,
    replies: &mut Vec<Reply>,
    applied: Result<Vec<Result<Answer, StoreError>>, sqlx::Error>,
    began: std::time::Instant,
) -> bool {
    crate::phases::BATCH.record(
        crate::phases::micros(began.elapsed()),
        commands.len() as u64,
    );
    let replies: Vec<_> = match applied {
        Ok(answers) => {
            tracing::trace!(
                size = commands.len(),
                took_us = began.elapsed().as_micros() as u64,
                "batch committed"
            );
            writable(state, true);
            replies.drain(..).zip(answers).collect()
        }
        Err(e) => {
            static ROLLED_BACK: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = ROLLED_BACK.allow() {
                tracing::error!(error = %e, size = commands.len(), held, "batch rolled back");
            }
            if super::health::storage_failed(&e) {
                writable(state, false);
            }
            // The plan already changed the cache; the database did not.
            lock(&state.known).clear();
            // next_seq is not rolled back: if the commit did reach the
            // disk, reusing numbers would fail every later batch; gaps
            // are harmless (cursors are only compared).
            replies
                .drain(..)
                .map(|reply| (reply, Err(backend_ref(&e))))
                .collect()
        }
    };
    commands.clear();
    // Even a failed batch goes through the syncer: its commit number
    // may have been taken, and readers wait for it to be published.
    to_syncer(state, replies).await
}

/// Tells health whether the disk takes writes, saying so once per change.
fn writable(state: &WriterState, now: bool) {
    let changed = state.writable.send_if_modified(|was| {
        let changed = *was != now;
        *was = now;
        changed
    });
    if changed && now {
        tracing::info!("the disk takes writes again: the store serves");
    } else if changed {
        tracing::error!(
            "the disk refuses writes (full, read-only or failing): the store is not serving until a probe write succeeds"
        );
    }
}

/// Runs `write`, a commit of the writer's own (no request waits on it),
/// as a commit like any other (see `Durability`): numbered, then handed to
/// the syncer, so readers that see it wait for its fsync, which the
/// syncer does even if no batch follows. `None` when the syncer has
/// stopped: the writer stops too.
async fn own_commit<T>(
    state: &mut WriterState,
    write: impl std::future::Future<Output = T>,
) -> Option<T> {
    state.committed.fetch_add(1, Ordering::SeqCst);
    let written = write.await;
    to_syncer(state, Vec::new()).await.then_some(written)
}

/// Hands the last commit, numbered before it began, to the syncer with
/// the answers that wait for its fsync (none for the writer's own). False
/// when the syncer has stopped: the writer stops too.
async fn to_syncer(state: &WriterState, replies: Vec<(Reply, Result<Answer, StoreError>)>) -> bool {
    let number = state.committed.load(Ordering::SeqCst);
    if state
        .synced
        .send(Unsynced {
            number,
            replies,
            committed_at: std::time::Instant::now(),
        })
        .await
        .is_err()
    {
        tracing::error!("the syncer stopped; the store writer stops");
        return false;
    }
    true
}

/// One probe write (see `health`), a commit like any other (through the
/// syncer); false when the syncer has stopped: the writer stops too.
async fn probe_disk(
    conn: &mut SqliteConnection,
    state: &mut WriterState,
    clock: &dyn Clock,
) -> bool {
    let Some(probed) = own_commit(state, super::health::probe(conn, clock.now_ms())).await else {
        return false;
    };
    match probed {
        Ok(()) => writable(state, true),
        Err(e) => {
            static PROBE_FAILED: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = PROBE_FAILED.allow() {
                tracing::warn!(error = %e, held, "the disk still refuses writes");
            }
        }
    }
    true
}

/// Deletes up to `MAX_PRUNED_PER_PASS` request-log entries that arrived
/// before `cutoff_ms`, oldest first; returns how many. Runs on the writer,
/// between batches, in its own transaction.
pub(super) fn prune_requests(
    handle: &mut LockedSqliteHandle<'_>,
    statements: &mut super::raw::Statements,
    cutoff_ms: i64,
) -> Result<u64, sqlx::Error> {
    let mut prune = Sql::default();
    prune
        .statement(
            "DELETE FROM requests WHERE (agent_key, nonce) IN \
             (SELECT agent_key, nonce FROM requests WHERE at_ms < ",
        )
        .arg(cutoff_ms)
        .push(" ORDER BY at_ms LIMIT ")
        .arg(i64::try_from(MAX_PRUNED_PER_PASS).unwrap_or(i64::MAX))
        .push(")");
    statements.run(handle, &prune)?;
    Ok(super::raw::changes(handle))
}
