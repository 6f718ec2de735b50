//! This replica's writers: each takes the queued commands in a group and
//! writes issuances (roots and delegations) as one transaction, then each
//! lifecycle command as a transaction of its own (a lifecycle command
//! locks a target's parent before the target: in one transaction with a
//! batch's parents, that order could not hold). A transaction that loses
//! a race with another replica is redone whole (`MAX_TX_ATTEMPTS`).
//!
//! An issuance whose parents this replica's writers wrote (or locked and
//! read) last — cached with their row versions — is first tried
//! optimistically: planned from the cache and written as one statement
//! outside a transaction block, one round trip instead of five (`BEGIN`,
//! the parents' locking read, the drains and numbers, the writes,
//! `COMMIT`), the hops that bound one replica (BENCHMARKS.md).
//! The statement updates each parent only if its row is still as cached
//! (`xmin`, status and ledger; a parent only read, its child refused, is
//! checked by a read counted with the writes) and then calls
//! `issuance_guard`, which aborts it if a parent had changed or a tree is
//! draining (read with a snapshot taken after the statement's locks); the
//! group is then redone the usual way, parents locked and read. Its numbers were reserved by an earlier
//! issuance statement after that one's locks (`Prefetched`), and each is
//! above its parents' `RowVersion::after`: taken after the cached parent
//! was locked, while the compare-and-set keeps any other child from being
//! committed under it since — a child is still numbered above its parent
//! and after its siblings.

pub(super) use super::failure::{backoff, failed, lost_optimism, retryable, unreachable};
#[cfg(test)]
pub(super) use super::seqs::{DRAINS_AND_NUMBERS, RESERVE};
pub(super) use super::seqs::{Prefetched, Reserved};
use super::unnest::{Cached, Guard, Written, WrittenRow};
use super::*;
use crate::batch::RowVersion;
use crate::limits::PRUNE_INTERVAL;
use crate::limits::postgres::{
    GROUP_SIBLINGS, GROUP_TARGET, MAX_CONTENDED_PARENTS, MAX_DRAINING_ROOTS, MAX_GROUP_WAIT,
    MAX_PRUNED_PER_PASS, MAX_VERSION_AGE_MS, MIN_PREFETCHED_NUMBERS,
};
use broker_domain::limits::MAX_TX_ATTEMPTS;
use sqlx::Row as _;
use sqlx::pool::PoolConnection;

/// The group size a writer waits for (up to `MAX_GROUP_WAIT`) after a
/// group of `last_group`: none under light load.
fn wait_target(last_group: usize, max_batch: usize) -> usize {
    if last_group >= GROUP_SIBLINGS {
        GROUP_TARGET.min(max_batch)
    } else {
        0
    }
}

pub(super) struct Writer {
    /// The writers' pool: connections with `WRITER_SETTINGS`.
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
    pub(super) trees: crate::TreeChanges,
    pub(super) commits: Arc<tokio::sync::watch::Sender<u64>>,
    /// Health: whether the last transaction reached the database.
    pub(super) reachable: tokio::sync::watch::Sender<bool>,
    /// `Some(retention_ms)` on the writer that prunes the request log.
    pub(super) prune: Option<i64>,
    /// `PostgresOptions::metrics`.
    pub(super) metrics: Option<crate::metrics::StoreMetrics>,
    /// `PostgresOptions::cascade_step_rows`.
    pub(super) cascade_step_rows: usize,
    /// How many rows this writer's drain steps end (`DrainPace`).
    pub(super) drain_pace: std::sync::Mutex<crate::sql::drain::DrainPace>,
    /// The connection the last transaction committed on, and when: kept
    /// for the next while fresh (`HELD_CONNECTION_FRESH`), with no trip
    /// through the pool (one idle there over `PING_IDLE_AFTER` is pinged
    /// first, and every one is checked as it goes back). Back to the pool
    /// after a failure.
    pub(super) held: Option<(PoolConnection<Postgres>, std::time::Instant)>,
    /// When the writer last dropped its connection's plans
    /// (`PLAN_REFRESH`).
    pub(super) replanned_at: Option<std::time::Instant>,
    /// Numbers for optimistic issuances, shared by the replica's writers.
    pub(super) numbers: Arc<std::sync::Mutex<Prefetched>>,
    /// Trees the last locked issuance found draining: an optimistic one
    /// in them would be aborted, so they take the locked path.
    pub(super) draining_roots: std::collections::HashSet<i64>,
    /// The largest issuance group since the last `PLAN_REFRESH`
    /// (`prefetch`).
    pub(super) peak_group: usize,
    /// Parents of optimistic issuances found stale since the last
    /// `PLAN_REFRESH`: another replica writes under them, so they take
    /// the locked path (a stale attempt costs a plan and a statement).
    pub(super) contended: std::collections::HashSet<Id>,
}

/// Runs `$attempt` (given its number, from 1) until it commits, redone
/// after a backoff on contention up to `MAX_TX_ATTEMPTS` times; else the
/// last error and how many attempts were made. A macro, not a method taking
/// an async closure: the writer's future must stay `Send`.
macro_rules! redone {
    ($writer:expr, $what:literal, |$made:ident| $attempt:expr) => {{
        let mut $made: u32 = 1;
        loop {
            let result = $attempt;
            $writer.reached(&result.as_ref().map(|_| ()));
            match result {
                Ok(done) => break Ok(done),
                Err(e) if retryable(&e) && $made < MAX_TX_ATTEMPTS => {
                    tracing::debug!(error = %e, attempt = $made, concat!($what, " redone"));
                    backoff($made).await;
                    $made += 1;
                }
                Err(e) => break Err((e, $made)),
            }
        }
    }};
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
                    static PRUNE_FAILED: broker_wire::throttle::Throttle =
                        broker_wire::throttle::Throttle::new();
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
    /// cost is most of the database's CPU (BENCHMARKS.md). Under
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
        let issued = redone!(self, "issuance", |attempt| self
            .try_issue(commands, attempt > 1)
            .await);
        issued.unwrap_or_else(|(e, attempt)| {
            // A database away fails every batch: one line a second.
            static ISSUANCE_FAILED: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = ISSUANCE_FAILED.allow() {
                tracing::warn!(error = %e, attempt, size = commands.len(), held, "issuance failed");
            }
            commands.iter().map(|_| Err(failed(&e, attempt))).collect()
        })
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
    /// first: one of `CUSTOM_PLANS_BEGIN`'s settings failing after its `BEGIN`
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
        if self
            .replanned_at
            .is_none_or(|at| at.elapsed() >= PLAN_REFRESH)
        {
            // The prepared statements stay; their next use plans again.
            if let Err(e) = sqlx::raw_sql("DISCARD PLANS").execute(&mut *conn).await {
                return self.keep(conn, Err(e)).await;
            }
            self.replanned_at = Some(std::time::Instant::now());
            self.peak_group = 0;
            self.contended.clear();
        }
        self.peak_group = self.peak_group.max(commands.len());
        if !careful {
            match self.issue_optimistic(&mut conn, commands).await {
                Ok(Some(answers)) => return self.keep(conn, Ok(answers)).await,
                Ok(None) => {}
                Err(e) => return self.keep(conn, Err(e)).await,
            }
        }
        let result = self.issue_on(&mut conn, commands, careful).await;
        self.keep(conn, result).await
    }

    /// The group planned from the cached parents and written in one
    /// statement (see the module docs). `None` when it cannot be (a
    /// parent not cached with a fresh version, or found stale within the
    /// last second, a tree known to drain, too few numbers left) or was
    /// aborted by `issuance_guard`: the caller takes the locked path.
    async fn issue_optimistic(
        &mut self,
        conn: &mut PgConnection,
        commands: &[Command],
    ) -> Result<Option<Vec<Result<Answer, StoreError>>>, sqlx::Error> {
        let now_ms = self.clock.now_ms();
        let (_, parent_ids) = batch::needs(commands, &KnownMap::default());
        let Some((mut known, cached_parents, above)) = self.cached_parents(&parent_ids, now_ms)
        else {
            return Ok(None);
        };
        let roots = drain::roots_of(&known, &parent_ids);
        if roots.iter().any(|root| self.draining_roots.contains(root)) {
            tracing::debug!("not optimistic: a tree drains");
            return Ok(None);
        }
        // No tree of theirs drains: `issuance_guard` checks it.
        for id in &parent_ids {
            known.set_ending(id, false);
        }
        let Some(numbers) = self.prefetched().take(commands.len(), above) else {
            tracing::debug!("not optimistic: too few numbers");
            return Ok(None);
        };
        let mut seqs = Reserved::default();
        seqs.left.extend(numbers);
        let mut prior = HashMap::new();
        let stamper = &self.stamper;
        let mut plan = batch::plan(commands, &mut prior, &mut known, &mut seqs, stamper, now_ms);
        // Every ledger the plan updates must be checked; a parent made in
        // this group is not cached, so none is unchecked (but be sure).
        if plan
            .states
            .iter()
            .any(|(seq, _)| !cached_parents.contains_key(seq))
        {
            tracing::warn!("not optimistic: the plan updates a contract not cached");
            return Ok(None);
        }
        // Locked in the one order (depth, id) as the update reaches them.
        let order: HashMap<i64, (u32, Id)> = parent_ids
            .iter()
            .filter_map(|id| known.get(id).map(|k| (k.seq, (k.view.depth, *id))))
            .collect();
        plan.states.sort_by_key(|(seq, _)| order.get(seq).copied());
        let mut answers = std::mem::take(&mut plan.answers);
        let unlogged = batch::unlogged(commands, &answers);
        if !unlogged.is_empty() {
            // Request-log rows never change: read outside a transaction.
            let earlier =
                load_prior_requests::<Postgres, _>(&mut Sqlx::<Postgres>(&mut *conn), &unlogged)
                    .await?;
            batch::replay_unlogged(commands, &mut answers, &earlier);
        }
        let guard = Guard {
            parents: cached_parents,
            roots,
        };
        let Some(mut writes) = super::unnest::writes(&plan, Some(&guard), self.prefetch()) else {
            return Ok(Some(batch::answers(answers)));
        };
        let rows: Vec<WrittenRow> = match writes.build_query_as().fetch_all(&mut *conn).await {
            Ok(rows) => rows,
            Err(e) => {
                let Some(outcome) = lost_optimism(&e) else {
                    return Err(e);
                };
                self.lost_the_race(outcome, &guard, &parent_ids);
                return Ok(None);
            }
        };
        let written = Written::from_rows(rows)?;
        self.count_optimistic("written");
        // Its own numbers came from `Prefetched` (already handed out); its
        // reserved ones were taken after its locks.
        let after = written.numbers.first().map(|n| n - 1);
        self.finish(&written, &plan, &mut known, now_ms, after, 0);
        Ok(Some(batch::answers(answers)))
    }

    /// The parents of an optimistic issuance as cached, with the row
    /// versions the statement checks and the number every new one must be
    /// above (taken after each parent's version was locked); `None` when
    /// one is not cached, its version is old, or it was contended lately.
    fn cached_parents(
        &self,
        parent_ids: &[Id],
        now_ms: i64,
    ) -> Option<(KnownMap, HashMap<i64, Cached>, i64)> {
        let mut known = KnownMap::default();
        let mut cached_parents = HashMap::with_capacity(parent_ids.len());
        let mut above = 0;
        let cache = lock(&self.known);
        for id in parent_ids {
            if self.contended.contains(id) {
                tracing::debug!("not optimistic: a parent was stale lately");
                return None;
            }
            let Some(cached) = cache.get(id) else {
                tracing::debug!("not optimistic: a parent is not cached");
                return None;
            };
            let Some(version) = cached
                .version
                .filter(|v| now_ms.saturating_sub(v.at_ms) < MAX_VERSION_AGE_MS)
            else {
                tracing::debug!(version = ?cached.version, "not optimistic: a parent's version");
                return None;
            };
            cached_parents.insert(
                cached.seq,
                Cached {
                    xmin: version.xid,
                    status: i64::from(cached.view.status.as_i32()),
                    reserved: cached.view.ledger.reserved,
                    spent: cached.view.ledger.spent,
                    open_children: i64::from(cached.view.ledger.open_children),
                },
            );
            above = above.max(version.after);
            known.insert(*id, cached.clone());
        }
        Some((known, cached_parents, above))
    }

    /// An optimistic issuance `issuance_guard` aborted: a draining tree is
    /// remembered; parents another replica writes under take the locked
    /// path until the next replan.
    fn lost_the_race(&mut self, outcome: &'static str, guard: &Guard, parent_ids: &[Id]) {
        tracing::debug!(
            outcome,
            "optimistic issuance redone with its parents locked"
        );
        if outcome == "draining" {
            self.remember_draining(&guard.roots, &guard.roots);
        } else {
            if self.contended.len() + parent_ids.len() > MAX_CONTENDED_PARENTS {
                self.contended.clear();
            }
            self.contended.extend(parent_ids.iter().copied());
        }
        self.count_optimistic(outcome);
    }

    /// How many numbers an issuance statement reserves for the writer's
    /// next one: the largest group of the last `PLAN_REFRESH` (a slow
    /// transaction is followed by a larger group) and
    /// `MIN_PREFETCHED_NUMBERS` more, at most a full group (`max_batch`).
    /// Each costs a `nextval` and a row of the answer.
    fn prefetch(&self) -> usize {
        self.peak_group
            .saturating_add(MIN_PREFETCHED_NUMBERS)
            .min(self.max_batch.max(MIN_PREFETCHED_NUMBERS))
    }

    fn prefetched(&self) -> std::sync::MutexGuard<'_, Prefetched> {
        // Its state is whole after every call: a panic elsewhere cannot
        // leave it half-changed.
        self.numbers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count_optimistic(&self, outcome: &str) {
        if let Some(metrics) = &self.metrics {
            metrics
                .optimistic_issuances
                .with_label_values(&[outcome])
                .inc();
        }
    }

    /// Of the trees `read` (their drains read after the locks), those in
    /// `draining` have a drain.
    fn remember_draining(&mut self, read: &[i64], draining: &[i64]) {
        for root in read {
            self.draining_roots.remove(root);
        }
        if self.draining_roots.len() + draining.len() > MAX_DRAINING_ROOTS {
            self.draining_roots.clear();
        }
        self.draining_roots.extend(draining.iter().copied());
    }

    /// After an issuance committed, having used numbers up to `used_max`:
    /// the numbers its statement reserved go to `Prefetched`, the rows it
    /// wrote get its transaction's id as their version (numbers above
    /// `after` were taken after its locks), the events are announced and
    /// the contracts cached.
    fn finish(
        &mut self,
        written: &Written,
        plan: &batch::Plan,
        known: &mut KnownMap,
        now_ms: i64,
        after: Option<i64>,
        used_max: i64,
    ) {
        self.prefetched().refill(&written.numbers, used_max);
        if let (Some(xid), Some(after)) = (written.xid, after) {
            let version = RowVersion {
                xid,
                after,
                at_ms: now_ms,
            };
            let rows: std::collections::HashSet<i64> = plan
                .states
                .iter()
                .map(|(seq, _)| *seq)
                .chain(plan.contracts.iter().map(|c| c.seq))
                .collect();
            let ids: Vec<Id> = known
                .iter()
                .filter(|(_, k)| rows.contains(&k.seq))
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                if let Some(k) = known.get_mut(&id) {
                    k.version = Some(version);
                }
            }
        }
        events::announce_own(self.tag, &self.trees, &self.commits, &written.placed);
        // The parents and the new contracts: the next Delegate from one of
        // them finds its terms here (`issuing_parent`).
        self.remember(known);
    }

    /// The group in one transaction, its parents locked and read.
    async fn issue_on(
        &mut self,
        conn: &mut PgConnection,
        commands: &[Command],
        careful: bool,
    ) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
        let mut tx = conn.begin().await?;
        let (request_keys, parent_ids) = batch::needs(commands, &KnownMap::default());
        let mut prior = if careful {
            load_prior_requests::<Postgres, _>(&mut Sqlx::<Postgres>(&mut tx), &request_keys)
                .await?
        } else {
            HashMap::new()
        };
        let mut known = KnownMap::default();
        let now_ms = self.clock.now_ms();
        let xmins = load_parents_locked(&mut tx, &parent_ids, &mut known).await?;
        let mut seqs = Reserved::default();
        let roots = drain::roots_of(&known, &parent_ids);
        let drains = seqs
            .drains_and_reserve(&mut tx, &roots, commands.len())
            .await?;
        // The parents as locked: numbers from here on come after.
        let after = seqs.left.front().map(|n| n - 1);
        if let Some(after) = after {
            for (id, xid) in xmins {
                if let Some(k) = known.get_mut(&id) {
                    k.version = Some(RowVersion {
                        xid,
                        after,
                        at_ms: now_ms,
                    });
                }
            }
        }
        let draining: Vec<i64> = drains.iter().map(|(root, _)| *root).collect();
        drain::mark_ending_with::<Postgres, _>(
            &mut Sqlx::<Postgres>(&mut tx),
            &mut known,
            &parent_ids,
            &drains,
        )
        .await?;
        let stamper = &self.stamper;
        let mut plan = batch::plan(commands, &mut prior, &mut known, &mut seqs, stamper, now_ms);
        let mut answers = std::mem::take(&mut plan.answers);
        if !careful {
            // Requests answered with an error wrote no request-log row a
            // retry could meet: those few keys are looked up.
            let unlogged = batch::unlogged(commands, &answers);
            if !unlogged.is_empty() {
                let earlier =
                    load_prior_requests::<Postgres, _>(&mut Sqlx::<Postgres>(&mut tx), &unlogged)
                        .await?;
                batch::replay_unlogged(commands, &mut answers, &earlier);
            }
        }
        // The writes and their events, in one statement.
        let written = match super::unnest::writes(&plan, None, self.prefetch()) {
            Some(mut writes) => {
                Written::from_rows(writes.build_query_as().fetch_all(&mut *tx).await?)?
            }
            None => Written {
                placed: Vec::new(),
                numbers: Vec::new(),
                xid: None,
            },
        };
        tx.commit().await?;
        self.remember_draining(&roots, &draining);
        let used_max = seqs.taken.iter().copied().max().unwrap_or(0);
        self.finish(&written, &plan, &mut known, now_ms, after, used_max);
        Ok(batch::answers(answers))
    }

    /// One lifecycle command in its own transaction, redone on contention.
    async fn transition(&mut self, command: &LifecycleCommand) -> Result<Answer, StoreError> {
        let done = redone!(self, "transition", |_attempt| self
            .try_transition(command)
            .await);
        done.unwrap_or_else(|(e, attempt)| {
            static TRANSITION_FAILED: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = TRANSITION_FAILED.allow() {
                tracing::warn!(error = %e, attempt, held, "transition failed");
            }
            Err(failed(&e, attempt))
        })
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
        let mut tx = conn.begin_with(CUSTOM_PLANS_BEGIN).await?;
        let keys: Vec<RequestKey> = command
            .request
            .iter()
            .map(|r| (r.agent, r.nonce.clone()))
            .collect();
        let prior =
            load_prior_requests::<Postgres, _>(&mut Sqlx::<Postgres>(&mut tx), &keys).await?;
        let mut seqs = Reserved::default();
        // Writers in flight share the pace (a copy here, kept after).
        let mut pace = *self
            .drain_pace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut writing = lifecycle::Writing {
            stamper: &self.stamper,
            seqs: &mut seqs,
            now_ms: self.clock.now_ms(),
            step_rows: self.cascade_step_rows,
            pace: &mut pace,
            prior_read: true,
            // Another replica may have started one.
            no_drains: false,
        };
        // The events' trees reach Watch through the sequencer (positions).
        let applied = lifecycle::apply::<Postgres, _>(
            &mut Sqlx::<Postgres>(&mut tx),
            command,
            &prior,
            &mut writing,
        )
        .await?;
        applied.writes.run::<Postgres>(&mut tx).await?;
        *self
            .drain_pace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = pace;
        let placed = events::place_own(&mut tx, &seqs.taken).await?;
        tx.commit().await?;
        // Its numbers (receipts') need not bound `Prefetched`: no read
        // pages receipts by number, and it makes no contract.
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

/// The settings of the writers' connections (their pool's): an issuance's
/// statements are all keyed lookups and inserts, so they keep one plan
/// per connection (planning them at every call was a fifth of their
/// time): a generic plan, made without seeing the parameters. While it
/// is made, sequential scans, hash and merge joins are off (each reads a
/// whole input), leaving lookups down an index and nested loops of them.
/// A plan made while a table was tiny may still read a whole index (at a
/// row or two every path costs the same), so the plans are made again
/// every `PLAN_REFRESH` (`DISCARD PLANS`): such a plan lives a
/// second, over a table that grew for a second at most. Session settings,
/// not a transaction's: an optimistic issuance is one statement outside
/// a transaction block. Lifecycle transactions and the prune go back to
/// the other connections' settings (`CUSTOM_PLANS_BEGIN`).
/// (`the_issuance_statements_seek_with_generic_plans` checks the plans.)
pub(super) const WRITER_SETTINGS: [(&str, &str); 5] = [
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
    ("jit", "off"),
];

/// How a writer's transaction other than an issuance begins: with the
/// settings of the store's other connections (`connect_options`), whose
/// statements (cascades, descendants, the prune) read ranges a custom
/// plan sizes for their parameters.
pub(super) const CUSTOM_PLANS_BEGIN: &str = "BEGIN; SET LOCAL plan_cache_mode = force_custom_plan; \
     SET LOCAL enable_seqscan = on; SET LOCAL enable_hashjoin = on; \
     SET LOCAL enable_mergejoin = on";

/// How often a writer's connection makes its generic plans again.
const PLAN_REFRESH: Duration = Duration::from_secs(1);

/// Loads and locks the named parents, in (depth, id) order (see the
/// module docs of `store::postgres`); returns each one's `xmin` (locked:
/// no other transaction changes it before this one ends).
async fn load_parents_locked(
    conn: &mut PgConnection,
    parent_ids: &[Id],
    known: &mut KnownMap,
) -> Result<Vec<(Id, u32)>, sqlx::Error> {
    let mut xmins = Vec::with_capacity(parent_ids.len());
    if parent_ids.is_empty() {
        return Ok(xmins);
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
        let xmin: i64 = row.try_get("row_xmin")?;
        let (id, k) = StoredContract::from_row::<Postgres>(&row)
            .map_err(|e| sqlx::Error::Protocol(format!("corrupt contract row: {e}")))?
            .known();
        if let Ok(xmin) = u32::try_from(xmin) {
            xmins.push((id, xmin));
        }
        known.insert(id, k);
    }
    Ok(xmins)
}

/// The statement of `load_parents_locked`: `$1` the parents' ids.
pub(super) fn parents_locked_sql() -> String {
    format!(
        "SELECT {columns}, row_xmin FROM (\
             SELECT c.*, c.xmin::text::int8 AS row_xmin, e.envelope \
             FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq \
             WHERE c.id = ANY($1) ORDER BY c.depth, c.id FOR UPDATE OF c) locked",
        columns = crate::sql::rows::CONTRACT_COLUMNS
    )
}

/// Deletes up to `MAX_PRUNED_PER_PASS` request-log entries older than
/// `cutoff_ms`. Replicas may prune at once: a row two of them pick is
/// deleted once, the other deletes nothing.
async fn prune_requests(conn: &mut PgConnection, cutoff_ms: i64) -> Result<u64, sqlx::Error> {
    let mut tx = conn.begin_with(CUSTOM_PLANS_BEGIN).await?;
    let done = sqlx::query(
        "DELETE FROM requests WHERE (agent_key, nonce) IN \
         (SELECT agent_key, nonce FROM requests WHERE at_ms < $1 ORDER BY at_ms LIMIT $2)",
    )
    .bind(cutoff_ms)
    .bind(MAX_PRUNED_PER_PASS)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::postgres::MAX_PREFETCHED_AGE;

    /// A database error with a given SQLSTATE, as PostgreSQL would send.
    fn database(code: &'static str) -> sqlx::Error {
        crate::sql::CodedError::error(code.into(), "error".into(), sqlx::error::ErrorKind::Other)
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

    /// Prefetched numbers go out in increasing order, each above every
    /// number handed out or used before and above what the caller names;
    /// an older statement's numbers never replace a newer's.
    #[test]
    fn prefetched_numbers_only_rise() {
        let mut numbers = Prefetched::default();
        assert_eq!(numbers.take(1, 0), None, "none reserved yet");
        numbers.refill(&[10, 11, 12, 13, 14], 0);
        assert_eq!(numbers.take(2, 0), Some(vec![10, 11]));
        assert_eq!(numbers.take(1, 12), Some(vec![13]), "above a parent's");
        // A statement that ran earlier (its numbers lower) finishes late.
        numbers.refill(&[5, 6, 7], 0);
        assert_eq!(numbers.take(1, 0), Some(vec![14]));
        // A locked issuance used 30: nothing at or below it goes out.
        numbers.refill(&[20, 40, 41], 30);
        assert_eq!(numbers.take(2, 0), Some(vec![40, 41]));
        assert_eq!(numbers.take(1, 0), None, "used up");
        numbers.refill(&[50, 51], 0);
        assert_eq!(numbers.take(3, 0), None, "too few");
        assert_eq!(numbers.take(2, 0), Some(vec![50, 51]));
    }

    /// Numbers left unused for `MAX_PREFETCHED_AGE` are not handed out.
    #[test]
    fn prefetched_numbers_expire() {
        let mut numbers = Prefetched::default();
        numbers.refill(&[10, 11], 0);
        std::thread::sleep(MAX_PREFETCHED_AGE);
        assert_eq!(numbers.take(1, 0), None);
        numbers.refill(&[12], 0);
        assert_eq!(numbers.take(1, 0), Some(vec![12]));
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
