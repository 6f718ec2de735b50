//! This replica's writers: each takes the queued commands in a group and
//! writes issuances (roots and delegations) as one transaction, then each
//! lifecycle command as a transaction of its own (a lifecycle command
//! locks a target's parent before the target: in one transaction with a
//! batch's parents, that order could not hold). A transaction that loses
//! a race with another replica is redone whole (`MAX_TX_ATTEMPTS`).

use super::*;
use crate::core::limits::MAX_TX_ATTEMPTS;
use crate::store::limits::PRUNE_INTERVAL;
use crate::store::limits::postgres::{
    GROUP_SIBLINGS, GROUP_TARGET, MAX_GROUP_WAIT, MAX_PRUNED_PER_PASS, RETRY_BASE_MS, RETRY_CAP_MS,
};
use sqlx::pool::PoolConnection;

/// Numbers `nextval('seqs')` reserved for one transaction, in increasing
/// order, taken after the rows they depend on are locked (so the children
/// of one parent are numbered in commit order, a child after its parent).
#[derive(Default)]
pub(crate) struct Reserved {
    left: std::collections::VecDeque<i64>,
    /// Every number handed out: the events this transaction writes.
    pub(super) taken: Vec<i64>,
}

/// The statement of `Reserved::reserve`: `$1` numbers.
pub(super) const RESERVE: &str = "SELECT nextval('seqs') FROM generate_series(1, $1)";

/// The drains of a batch's trees and its numbers, in one round trip after
/// the parents' statement: `$1` the parents' root seqs, `$2` how many
/// numbers. Drain rows have a root; number rows a NULL one. Not folded
/// into the parents' statement: in READ COMMITTED a statement's snapshot
/// is taken before its lock waits, so a drain committed while that
/// statement waited for a parent's lock would be missed; this statement's
/// snapshot is taken after every parent is locked. The numbers are taken
/// after the locks too (see `Reserved`).
pub(super) const DRAINS_AND_NUMBERS: &str = "SELECT root_seq, target_seq AS seq FROM draining WHERE root_seq = ANY($1) \
     UNION ALL SELECT NULL, nextval('seqs') FROM generate_series(1, $2)";

impl Reserved {
    /// Reads the drains of `roots` (root seq, draining contract's seq) and
    /// reserves `count` numbers (`DRAINS_AND_NUMBERS`).
    pub(super) async fn drains_and_reserve(
        &mut self,
        conn: &mut PgConnection,
        roots: &[i64],
        count: usize,
    ) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        let rows: Vec<(Option<i64>, i64)> = sqlx::query_as(DRAINS_AND_NUMBERS)
            .bind(roots)
            .bind(i64::try_from(count).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn)
            .await?;
        let mut drains = Vec::new();
        let mut seqs = Vec::with_capacity(count);
        for (root, seq) in rows {
            match root {
                Some(root) => drains.push((root, seq)),
                None => seqs.push(seq),
            }
        }
        seqs.sort_unstable();
        self.left.extend(seqs);
        Ok(drains)
    }

    pub(super) async fn reserve(
        &mut self,
        conn: &mut PgConnection,
        count: usize,
    ) -> Result<(), sqlx::Error> {
        if count == 0 {
            return Ok(());
        }
        let mut seqs: Vec<i64> = sqlx::query_scalar(RESERVE)
            .bind(i64::try_from(count).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn)
            .await?;
        seqs.sort_unstable();
        self.left.extend(seqs);
        Ok(())
    }
}

impl batch::SeqSource for Reserved {
    fn take(&mut self) -> i64 {
        // Callers reserve exactly what they take (one number per issuance
        // command, one per receipt of a decision). Should that ever fail,
        // a number no row has is handed out: the insert of a second one
        // fails the transaction, nothing is written twice.
        let seq = self.left.pop_front().unwrap_or_else(|| {
            tracing::error!("a transaction took more numbers than it reserved");
            i64::MIN + i64::try_from(self.taken.len()).unwrap_or(0)
        });
        self.taken.push(seq);
        seq
    }
}

/// The group size a writer waits for (up to `MAX_GROUP_WAIT`) after a
/// group of `last_group`: none under light load.
fn wait_target(last_group: usize, max_batch: usize) -> usize {
    if last_group >= GROUP_SIBLINGS {
        GROUP_TARGET.min(max_batch)
    } else {
        0
    }
}

/// Whether redoing the whole transaction may succeed: a serialization
/// failure or deadlock (40001, 40P01), or a request key another replica
/// committed meanwhile (23505 on the request log: the redo replays it).
pub(super) fn retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("40001" | "40P01" | "23505"))
        }
        _ => false,
    }
}

/// Whether the database could not be reached (or went away mid-way):
/// nothing, or an unknown outcome that the request log settles on retry.
pub(super) fn unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        // admin_shutdown, crash_shutdown, cannot_connect_now, and the
        // connection-exception class.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            matches!(c.as_ref(), "57P01" | "57P02" | "57P03") || c.starts_with("08")
        }),
        _ => false,
    }
}

/// The answer to callers of a transaction that failed for good.
fn failed(e: &sqlx::Error, attempts: u32) -> StoreError {
    if retryable(e) {
        StoreError::Unavailable {
            reason: pb::ErrorReason::Contention,
            detail: format!(
                "{attempts} attempts lost to concurrent writers (the last: {e}); nothing was recorded: retry with the same nonce"
            ),
        }
    } else if unreachable(e) {
        StoreError::Unavailable {
            reason: pb::ErrorReason::Unavailable,
            detail: "the database cannot be reached; retry with the same nonce (a request that was recorded after all gets its answer)".into(),
        }
    } else {
        backend_ref(e)
    }
}

/// Sleeps before attempt `attempt` (1-based redo count), exponentially
/// longer with full jitter so replicas that collided do not collide again.
async fn backoff(attempt: u32) {
    let cap = RETRY_BASE_MS
        .saturating_mul(1u64 << attempt.min(16))
        .min(RETRY_CAP_MS);
    let mut bytes = [0u8; 8];
    let jitter = match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes) % cap.max(1),
        Err(_) => cap / 2,
    };
    tokio::time::sleep(Duration::from_millis(jitter.max(1))).await;
}

pub(super) struct Writer {
    pub(super) pool: PgPool,
    /// Shared by this replica's writers: one takes a group at a time.
    pub(super) queue: Arc<tokio::sync::Mutex<mpsc::Receiver<(Command, Reply)>>>,
    pub(super) stamper: Arc<Stamper>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) known: KnownCache,
    pub(super) max_batch: usize,
    /// This database's cursor tag, the Watch hint and signal: a writer
    /// announces the events it placed before it answers.
    pub(super) tag: i64,
    pub(super) trees: crate::store::TreeChanges,
    pub(super) commits: Arc<tokio::sync::watch::Sender<u64>>,
    /// Health: whether the last transaction reached the database.
    pub(super) reachable: tokio::sync::watch::Sender<bool>,
    /// `Some(retention_ms)` on the writer that prunes the request log.
    pub(super) prune: Option<i64>,
    /// `PostgresOptions::metrics`.
    pub(super) metrics: Option<crate::metrics::StoreMetrics>,
    /// `PostgresOptions::cascade_step_rows`.
    pub(super) cascade_step_rows: usize,
    /// The connection the last transaction committed on, and when: kept
    /// for the next while fresh (`HELD_CONNECTION_FRESH`), as one taken
    /// from the pool is pinged first (a round trip per transaction).
    /// Back to the pool after a failure.
    pub(super) held: Option<(PoolConnection<Postgres>, std::time::Instant)>,
    /// When the writer last dropped its connection's plans
    /// (`PLAN_REFRESH`).
    pub(super) replanned_at: Option<std::time::Instant>,
}

impl Writer {
    pub(super) async fn run(mut self) {
        let mut next_prune = std::time::Instant::now() + PRUNE_INTERVAL;
        let mut last_group = 0;
        loop {
            let Some(group) = self.take_group(last_group).await else {
                tracing::debug!("a PostgreSQL writer stopped");
                return;
            };
            last_group = group.len();
            let (issuances, lifecycle): (Vec<_>, Vec<_>) = group
                .into_iter()
                .partition(|(c, _)| !matches!(c, Command::Lifecycle(_)));
            let mut answered = Vec::with_capacity(self.max_batch);
            if !issuances.is_empty() {
                let (commands, replies): (Vec<_>, Vec<_>) = issuances.into_iter().unzip();
                let answers = self.issue(&commands).await;
                answered.extend(replies.into_iter().zip(answers));
            }
            for (command, reply) in lifecycle {
                let Command::Lifecycle(command) = command else {
                    continue;
                };
                answered.push((reply, self.transition(&command).await));
            }
            for (reply, answer) in answered {
                reply.send(answer);
            }
            if let Some(retention_ms) = self.prune
                && std::time::Instant::now() >= next_prune
            {
                next_prune = std::time::Instant::now() + PRUNE_INTERVAL;
                let cutoff_ms = self.clock.now_ms().saturating_sub(retention_ms);
                if let Err(e) = self.prune(cutoff_ms).await {
                    static PRUNE_FAILED: crate::telemetry::Throttle =
                        crate::telemetry::Throttle::new();
                    if let Some(held) = PRUNE_FAILED.allow() {
                        tracing::warn!(error = %e, held, "pruning the request log failed; will retry");
                    }
                }
            }
        }
    }

    /// The next group of queued commands; `None` once every sender is gone.
    ///
    /// Under load — the last group had `GROUP_SIBLINGS` commands or more —
    /// a small group waits up to `MAX_GROUP_WAIT` for more, until it has
    /// `GROUP_TARGET` (PostgreSQL's own `commit_delay` and
    /// `commit_siblings`, for whole transactions): several replicas split
    /// the load into groups a third the size, and a transaction's fixed
    /// cost is most of the database's CPU (BENCHMARKS.md, issue 27). Under
    /// light load groups are small and nothing waits.
    async fn take_group(&self, last_group: usize) -> Option<Vec<(Command, Reply)>> {
        let mut queue = self.queue.lock().await;
        let first = queue.recv().await?;
        let mut group = vec![first];
        let target = wait_target(last_group, self.max_batch);
        let until = tokio::time::Instant::now() + MAX_GROUP_WAIT;
        loop {
            while group.len() < self.max_batch {
                match queue.try_recv() {
                    Ok(next) => group.push(next),
                    Err(_) => break,
                }
            }
            if group.len() >= target {
                break;
            }
            tokio::select! {
                next = queue.recv() => match next {
                    Some(next) => group.push(next),
                    None => break,
                },
                () = tokio::time::sleep_until(until) => break,
            }
        }
        if let Some(metrics) = &self.metrics {
            metrics.batch_commands.observe(group.len() as f64);
        }
        Some(group)
    }

    /// Records the outcome of a transaction for health.
    fn reached(&self, result: &Result<(), &sqlx::Error>) {
        let reachable = !matches!(result, Err(e) if unreachable(e));
        self.reachable
            .send_if_modified(|now| std::mem::replace(now, reachable) != reachable);
    }

    /// Roots and delegations in one transaction, redone on contention.
    /// The first attempt does not read the request log (most requests are
    /// new): a retry among the batch meets its request-log row when the
    /// batch inserts its own, the transaction fails (23505) and is redone
    /// reading the log first, so the retry is answered from it.
    async fn issue(&mut self, commands: &[Command]) -> Vec<Result<Answer, StoreError>> {
        let mut attempt = 1;
        loop {
            let careful = attempt > 1;
            let result = self.try_issue(commands, careful).await;
            self.reached(&result.as_ref().map(|_| ()));
            match result {
                Ok(answers) => return answers,
                Err(e) if retryable(&e) && attempt < MAX_TX_ATTEMPTS => {
                    tracing::debug!(error = %e, attempt, "issuance redone");
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(e) => {
                    // A database away fails every batch: one line a second.
                    static ISSUANCE_FAILED: crate::telemetry::Throttle =
                        crate::telemetry::Throttle::new();
                    if let Some(held) = ISSUANCE_FAILED.allow() {
                        tracing::warn!(error = %e, attempt, size = commands.len(), held, "issuance failed");
                    }
                    return commands.iter().map(|_| Err(failed(&e, attempt))).collect();
                }
            }
        }
    }

    /// The held connection while it is fresh, else one from the pool
    /// (pinged: a database restarted or a network gone while the writer
    /// was idle is found there, not by a caller's transaction).
    async fn connection(&mut self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        match self.held.take() {
            Some((conn, at)) if at.elapsed() < HELD_CONNECTION_FRESH => Ok(conn),
            _ => self.pool.acquire().await,
        }
    }

    /// Keeps `conn` for the next transaction when `result` is a success;
    /// after a failure it goes back to the pool, whose ping finds it if
    /// it is broken. A failure the database reported is rolled back
    /// first: one of `ISSUANCE_BEGIN`'s settings failing after its `BEGIN`
    /// ran would leave the connection in an aborted transaction sqlx does
    /// not know of (it queues no rollback) and a ping would not notice
    /// (otherwise the rollback is a warning: no transaction is open).
    async fn keep<T>(
        &mut self,
        mut conn: PoolConnection<Postgres>,
        result: Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        match &result {
            Ok(_) => self.held = Some((conn, std::time::Instant::now())),
            Err(e) if !unreachable(e) => {
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
            }
            Err(_) => {}
        }
        result
    }

    async fn prune(&mut self, cutoff_ms: i64) -> Result<u64, sqlx::Error> {
        let mut conn = self.connection().await?;
        let result = prune_requests(&mut conn, cutoff_ms).await;
        self.keep(conn, result).await
    }

    async fn try_issue(
        &mut self,
        commands: &[Command],
        careful: bool,
    ) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
        let mut conn = self.connection().await?;
        let begin = if self
            .replanned_at
            .is_none_or(|at| at.elapsed() >= PLAN_REFRESH)
        {
            self.replanned_at = Some(std::time::Instant::now());
            ISSUANCE_BEGIN_REPLANNED
        } else {
            ISSUANCE_BEGIN
        };
        let result = self.issue_on(&mut conn, begin, commands, careful).await;
        self.keep(conn, result).await
    }

    async fn issue_on(
        &self,
        conn: &mut PgConnection,
        begin: &'static str,
        commands: &[Command],
        careful: bool,
    ) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
        let mut tx = conn.begin_with(begin).await?;
        let (request_keys, parent_ids) = batch::needs(commands, &KnownMap::default());
        let mut prior = if careful {
            load_prior_requests::<Postgres>(&mut tx, &request_keys).await?
        } else {
            HashMap::new()
        };
        let mut known = KnownMap::default();
        load_parents_locked(&mut tx, &parent_ids, &mut known).await?;
        let mut seqs = Reserved::default();
        let roots = drain::roots_of(&known, &parent_ids);
        let drains = seqs
            .drains_and_reserve(&mut tx, &roots, commands.len())
            .await?;
        drain::mark_ending_with::<Postgres>(&mut tx, &mut known, &parent_ids, &drains).await?;
        let now_ms = self.clock.now_ms();
        let mut plan = batch::plan(
            commands,
            &mut prior,
            &mut known,
            &mut seqs,
            &self.stamper,
            now_ms,
        );
        let mut answers = std::mem::take(&mut plan.answers);
        if !careful {
            // Requests answered with an error wrote no request-log row a
            // retry could meet: those few keys are looked up.
            let unlogged = batch::unlogged(commands, &answers);
            if !unlogged.is_empty() {
                let earlier = load_prior_requests::<Postgres>(&mut tx, &unlogged).await?;
                batch::replay_unlogged(commands, &mut answers, &earlier);
            }
        }
        // The writes and their events, in one statement.
        let placed: Vec<(i64, Vec<u8>)> = match super::unnest::writes(&plan) {
            Some(mut writes) => writes.build_query_as().fetch_all(&mut *tx).await?,
            None => Vec::new(),
        };
        tx.commit().await?;
        events::announce_own(self.tag, &self.trees, &self.commits, &placed);
        // The parents and the new contracts: the next Delegate from one of
        // them finds its terms here (`issuing_parent`).
        self.remember(&known);
        Ok(batch::answers(answers))
    }

    /// One lifecycle command in its own transaction, redone on contention.
    async fn transition(&mut self, command: &LifecycleCommand) -> Result<Answer, StoreError> {
        let mut attempt = 1;
        loop {
            let result = self.try_transition(command).await;
            self.reached(&result.as_ref().map(|_| ()));
            match result {
                Ok(answer) => return answer,
                Err(e) if retryable(&e) && attempt < MAX_TX_ATTEMPTS => {
                    tracing::debug!(error = %e, attempt, "transition redone");
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(e) => {
                    static TRANSITION_FAILED: crate::telemetry::Throttle =
                        crate::telemetry::Throttle::new();
                    if let Some(held) = TRANSITION_FAILED.allow() {
                        tracing::warn!(error = %e, attempt, held, "transition failed");
                    }
                    return Err(failed(&e, attempt));
                }
            }
        }
    }

    async fn try_transition(
        &mut self,
        command: &LifecycleCommand,
    ) -> Result<Result<Answer, StoreError>, sqlx::Error> {
        let mut conn = self.connection().await?;
        let result = self.transition_on(&mut conn, command).await;
        self.keep(conn, result).await
    }

    async fn transition_on(
        &self,
        conn: &mut PgConnection,
        command: &LifecycleCommand,
    ) -> Result<Result<Answer, StoreError>, sqlx::Error> {
        let mut tx = conn.begin().await?;
        let keys: Vec<RequestKey> = command
            .request
            .iter()
            .map(|r| (r.agent, r.nonce.clone()))
            .collect();
        let prior = load_prior_requests::<Postgres>(&mut tx, &keys).await?;
        let mut seqs = Reserved::default();
        let mut writing = lifecycle::Writing {
            stamper: &self.stamper,
            seqs: &mut seqs,
            now_ms: self.clock.now_ms(),
            step_rows: self.cascade_step_rows,
        };
        // The events' trees reach Watch through the sequencer (positions).
        let applied = lifecycle::apply::<Postgres>(&mut tx, command, &prior, &mut writing).await?;
        let placed = events::place_own(&mut tx, &seqs.taken).await?;
        tx.commit().await?;
        events::announce_own(self.tag, &self.trees, &self.commits, &placed);
        Ok(applied.answer)
    }

    /// Keeps the loaded parents' immutable terms for `issuing_parent`.
    fn remember(&self, loaded: &KnownMap) {
        let mut cache = lock(&self.known);
        cache.turn_if_full();
        for (id, known) in loaded.iter() {
            cache.insert(*id, known.clone());
        }
    }
}

/// How long a writer's connection is reused without the pool's ping:
/// under load it is never idle this long, so no transaction pays the
/// ping; after a pause the pool checks it first.
const HELD_CONNECTION_FRESH: Duration = Duration::from_secs(1);

/// How an issuance transaction begins (as a macro: `concat!` needs the
/// literal). Its statements are all keyed lookups and inserts, so they
/// keep one plan per connection (planning them at every call was a fifth
/// of their time): a generic plan, made without seeing the parameters.
/// While it is made, sequential scans, hash and merge joins are off (each
/// reads a whole input), leaving lookups down an index and nested loops of
/// them. A plan made while a table was tiny may still read a whole index
/// (at a row or two every path costs the same), so the plans are made
/// again every `PLAN_REFRESH` (`ISSUANCE_BEGIN_REPLANNED`): such a plan
/// lives a second, over a table that grew for a second at most. The
/// connections' default (custom plans, see `connect_options`) is back at
/// the transaction's end.
/// (`the_issuance_statements_seek_with_generic_plans` checks the plans.)
macro_rules! issuance_begin {
    () => {
        "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; \
         SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; \
         SET LOCAL enable_mergejoin = off"
    };
}
pub(super) const ISSUANCE_BEGIN: &str = issuance_begin!();

/// `ISSUANCE_BEGIN`, the kept plans dropped first (in the same round trip;
/// the prepared statements stay).
const ISSUANCE_BEGIN_REPLANNED: &str = concat!("DISCARD PLANS; ", issuance_begin!());

/// How often a writer's connection makes its generic plans again.
const PLAN_REFRESH: Duration = Duration::from_secs(1);

/// Loads and locks the named parents, in (depth, id) order (see the
/// module docs of `store::postgres`).
async fn load_parents_locked(
    conn: &mut PgConnection,
    parent_ids: &[Id],
    known: &mut KnownMap,
) -> Result<(), sqlx::Error> {
    if parent_ids.is_empty() {
        return Ok(());
    }
    let ids: Vec<&[u8]> = parent_ids.iter().map(|id| id.as_slice()).collect();
    // `FOR UPDATE OF c`: the contract rows only. Through the view the
    // envelope rows were locked too, and a row lock is a write (the row's
    // header and a WAL record) on rows nothing ever updates.
    let rows = sqlx::query(sqlx::AssertSqlSafe(parents_locked_sql()))
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?;
    for row in rows {
        let (id, k) = StoredContract::from_row::<Postgres>(&row)
            .map_err(|e| sqlx::Error::Protocol(format!("corrupt contract row: {e}")))?
            .known();
        known.insert(id, k);
    }
    Ok(())
}

/// The statement of `load_parents_locked`: `$1` the parents' ids.
pub(super) fn parents_locked_sql() -> String {
    format!(
        "SELECT {columns} FROM (\
             SELECT c.*, e.envelope FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq \
             WHERE c.id = ANY($1) ORDER BY c.depth, c.id FOR UPDATE OF c) locked",
        columns = crate::store::sql::rows::CONTRACT_COLUMNS
    )
}

/// Deletes up to `MAX_PRUNED_PER_PASS` request-log entries older than
/// `cutoff_ms`. Replicas may prune at once: a row two of them pick is
/// deleted once, the other deletes nothing.
async fn prune_requests(conn: &mut PgConnection, cutoff_ms: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM requests WHERE (agent_key, nonce) IN \
         (SELECT agent_key, nonce FROM requests WHERE at_ms < $1 ORDER BY at_ms LIMIT $2)",
    )
    .bind(cutoff_ms)
    .bind(MAX_PRUNED_PER_PASS)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database error with a given SQLSTATE, as PostgreSQL would send.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl std::fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error with SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Sqlstate {}

    impl sqlx::error::DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            "error"
        }

        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }

        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }

        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }

        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }

        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn database(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Sqlstate(code)))
    }

    fn io() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    }

    #[test]
    fn lost_races_are_redone_and_nothing_else_is() {
        // Serialization failure, deadlock, a request key committed
        // meanwhile by another replica.
        for code in ["40001", "40P01", "23505"] {
            assert!(retryable(&database(code)), "{code}");
            assert!(!unreachable(&database(code)), "{code}");
        }
        // A foreign key, a syntax error, a value too long, a lost
        // connection: redoing the same transaction cannot help.
        for e in [
            database("23503"),
            database("42601"),
            database("22001"),
            io(),
        ] {
            assert!(!retryable(&e), "{e}");
        }
    }

    #[test]
    fn a_database_away_is_unreachable() {
        for e in [
            io(),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
            database("57P01"), // admin_shutdown
            database("57P03"), // cannot_connect_now
            database("08006"), // connection_failure
        ] {
            assert!(unreachable(&e), "{e}");
        }
        for code in ["40001", "23505", "42601", "53100"] {
            assert!(!unreachable(&database(code)), "{code}");
        }
    }

    #[test]
    fn what_callers_are_told_when_a_transaction_fails_for_good() {
        match failed(&database("40001"), MAX_TX_ATTEMPTS) {
            StoreError::Unavailable { reason, detail } => {
                assert_eq!(reason, pb::ErrorReason::Contention);
                assert!(detail.contains(&MAX_TX_ATTEMPTS.to_string()), "{detail}");
                assert!(detail.contains("same nonce"), "{detail}");
            }
            other => panic!("contention: {other:?}"),
        }
        match failed(&database("57P01"), 1) {
            StoreError::Unavailable { reason, detail } => {
                assert_eq!(reason, pb::ErrorReason::Unavailable);
                assert!(detail.contains("same nonce"), "{detail}");
            }
            other => panic!("unreachable: {other:?}"),
        }
        // Anything else is the backend's own failure, never a retry hint.
        assert!(matches!(
            failed(&database("42601"), 1),
            StoreError::Backend(_)
        ));
        assert!(matches!(
            failed(&sqlx::Error::Protocol("garbled".into()), 1),
            StoreError::Corrupt(_)
        ));
    }

    /// Writers wait for a fuller group only after a group showed load,
    /// and never for more than a group may hold.
    #[test]
    fn only_a_writer_under_load_waits_for_a_fuller_group() {
        assert_eq!(wait_target(0, 512), 0, "the first group");
        assert_eq!(wait_target(GROUP_SIBLINGS - 1, 512), 0, "light load");
        assert_eq!(wait_target(GROUP_SIBLINGS, 512), GROUP_TARGET);
        assert_eq!(wait_target(100, 512), GROUP_TARGET);
        assert_eq!(wait_target(100, 8), 8, "at most a full group");
    }
}
