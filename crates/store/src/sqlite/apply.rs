//! Applying one batch: the fast path (planned from the writer's cache,
//! written on the held SQLite handle with the writer's own statements)
//! and the careful one (parents, request log and lifecycle subtrees read,
//! written with the writer's statements between the reads), each as one
//! transaction; the trees it touched told to their watchers. A careful
//! batch runs on the held handle too (`ViaHeld`: its reads as well), or
//! through sqlx's connection (`ViaSqlx`) when it must: a drain's step,
//! or a batch redone after a conflict.

use super::raw::Statements;
use super::*;
use crate::batch::Slot;
use crate::sql::plan::Arg;
use crate::sql::rows::select_contracts;
use crate::sql::source::{Source, listed, padded};
use crate::sql::writes::Writes;
use broker_wire::command::Action;
use sqlx::sqlite::LockedSqliteHandle;

/// How far the held stretch got with a batch it left to `apply_batch`.
pub(super) enum Pending {
    /// Not started.
    Fresh,
    /// It failed on the held handle (and may have stopped inside its
    /// transaction).
    Failed(sqlx::Error),
}

/// What `apply_held` did with a batch.
pub(super) enum Held {
    /// Written and committed: its answers.
    Answered(Vec<Result<Answer, StoreError>>),
    /// It needs sqlx's connection: `apply_batch` takes it from here.
    Pending(Pending),
}

/// Plans, writes and commits a batch; an error aborts the whole batch
/// (nothing is committed).
///
/// Most batches take the fast path: issuance only, and none of their
/// request keys committed recently (`RecentRequests`). Those are planned
/// as if no request were a retry and their statements, with their BEGIN
/// and COMMIT, run on the writer's own thread (`raw`). If a request was a
/// retry after all, its request-log row already exists, the script fails,
/// and the batch is redone the careful way, which reads the request log
/// first. Either way a request is answered once. Batches come here from
/// a held stretch (`apply_held`) when it could not finish them: a drain's
/// step, a failure, a handle that could not be taken.
pub(super) async fn apply_batch(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
    pending: Pending,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let first = match pending {
        Pending::Fresh if fast_path(commands, state) => {
            apply_fast(conn, commands, state, stamper, now_ms).await
        }
        Pending::Fresh => {
            let mut via = ViaSqlx(&mut *conn);
            apply_careful(&mut via, commands, state, stamper, now_ms, Lookups::IfSeen).await
        }
        Pending::Failed(e) => Err(e),
    };
    let answers = match first {
        Ok(answers) => answers,
        Err(e) => {
            abandon(conn, state).await;
            // Only a request-log key conflict (a retry the writer did
            // not remember) is worth redoing; anything else is the
            // batch's error.
            let retry_found = matches!(&e, sqlx::Error::Database(db)
                if db.kind() == sqlx::error::ErrorKind::UniqueViolation);
            if !retry_found {
                return Err(e);
            }
            tracing::debug!(error = %e, "batch redone with request-log lookups");
            let mut via = ViaSqlx(&mut *conn);
            match apply_careful(&mut via, commands, state, stamper, now_ms, Lookups::First).await {
                Ok(answers) => answers,
                Err(e) => {
                    abandon(conn, state).await;
                    return Err(e);
                }
            }
        }
    };
    remember_requests(commands, state, now_ms);
    Ok(answers)
}

/// Undoes a failed batch: its transaction (which may have stopped
/// anywhere) and what its plan changed in the cache.
async fn abandon(conn: &mut SqliteConnection, state: &WriterState) {
    if let Err(rollback) = sqlx::query("ROLLBACK").execute(&mut *conn).await
        && !rollback.to_string().contains("no transaction is active")
    {
        tracing::warn!(error = %rollback, "rolling back a failed batch");
    }
    lock(&state.known).clear();
    // Its touches will never commit: the trees' versions may settle.
    state.trees.committed();
}

/// Whether a batch may take the fast path: issuance only, and none of its
/// request keys possibly committed before.
fn fast_path(commands: &[Command], state: &WriterState) -> bool {
    commands.iter().all(|c| !matches!(c, Command::Lifecycle(_))) && !seen_lately(commands, state)
}

/// Whether one of the batch's request keys may have been committed before.
fn seen_lately(commands: &[Command], state: &WriterState) -> bool {
    commands
        .iter()
        .filter_map(Command::request)
        .any(|r| state.recent.may_contain(&r.agent, &r.nonce, r.timestamp_ms))
}

/// Adds the batch's request keys to the recent-request set.
fn remember_requests(commands: &[Command], state: &mut WriterState, now_ms: i64) {
    for request in commands.iter().filter_map(Command::request) {
        state.recent.insert(&request.agent, &request.nonce, now_ms);
    }
}

/// A batch with SQLite's handle already held, its reads on the handle
/// too (`raw::HeldSource`): issuance the fast way when it may (every
/// parent cached, no drain in progress, no request seen lately), anything
/// else the careful way. Only a drain's step, which writes as it goes
/// through sqlx, is left `Pending` for `apply_batch`.
pub(super) async fn apply_held(
    handle: &mut LockedSqliteHandle<'_>,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Held {
    if has_drain_step(commands) {
        return Held::Pending(Pending::Fresh);
    }
    let fast = !state.draining
        && fast_path(commands, state)
        && missing_parents(commands, &state.known).1.is_empty();
    let answered = if fast {
        held_fast(handle, commands, state, stamper, now_ms).await
    } else {
        let mut via = ViaHeld(handle);
        apply_careful(&mut via, commands, state, stamper, now_ms, Lookups::IfSeen).await
    };
    match answered {
        Ok(answers) => {
            remember_requests(commands, state, now_ms);
            Held::Answered(answers)
        }
        Err(e) => Held::Pending(Pending::Failed(e)),
    }
}

/// The fast path on the held handle.
async fn held_fast(
    handle: &mut LockedSqliteHandle<'_>,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let mut plan = plan_fast(commands, state, stamper, now_ms);
    // A command answered with an error (unknown parent, over-long
    // predicate) writes no request-log row, so no insert would catch a
    // retry among them: those few keys are looked up here. Their errors
    // changed nothing, so a replayed answer simply replaces them.
    let unlogged = batch::unlogged(commands, &plan.answers);
    if !unlogged.is_empty() {
        let mut src = super::raw::HeldSource {
            handle: &mut *handle,
            statements: &mut state.statements,
        };
        let earlier = load_prior_requests::<Sqlite, _>(&mut src, &unlogged).await?;
        batch::replay_unlogged(commands, &mut plan.answers, &earlier);
    }
    write_fast(handle, plan, state)
}

/// Whether a batch holds a drain's step.
fn has_drain_step(commands: &[Command]) -> bool {
    commands.iter().any(|c| match c {
        Command::Lifecycle(l) => matches!(l.action, Action::Drain),
        _ => false,
    })
}

/// How a careful batch reaches its connection.
pub(super) trait Via {
    /// Where its reads go (`raw::HeldSource` runs them with the writer's
    /// statements).
    fn source<'s>(&'s mut self, statements: &'s mut Statements) -> impl Source<Sqlite> + 's;
    /// Runs `script` with the writer's statements on SQLite's handle.
    async fn run(
        &mut self,
        statements: &mut Statements,
        retakes: Option<&prometheus::IntCounter>,
        script: &Sql<'_>,
    ) -> Result<(), sqlx::Error>;
}

/// Through sqlx's connection: reads by sqlx's worker; each script takes
/// the handle from it (`raw::take_handle`).
pub(super) struct ViaSqlx<'c>(pub(super) &'c mut SqliteConnection);

impl Via for ViaSqlx<'_> {
    fn source<'s>(&'s mut self, _: &'s mut Statements) -> impl Source<Sqlite> + 's {
        Sqlx::<Sqlite>(&mut *self.0)
    }

    async fn run(
        &mut self,
        statements: &mut Statements,
        retakes: Option<&prometheus::IntCounter>,
        script: &Sql<'_>,
    ) -> Result<(), sqlx::Error> {
        let mut handle = super::raw::take_handle(self.0, retakes).await?;
        statements.run(&mut handle, script)
    }
}

/// On the handle the writer holds: nothing handed to sqlx's worker.
pub(super) struct ViaHeld<'a, 'h>(pub(super) &'a mut LockedSqliteHandle<'h>);

impl Via for ViaHeld<'_, '_> {
    fn source<'s>(&'s mut self, statements: &'s mut Statements) -> impl Source<Sqlite> + 's {
        super::raw::HeldSource {
            handle: &mut *self.0,
            statements,
        }
    }

    async fn run(
        &mut self,
        statements: &mut Statements,
        _: Option<&prometheus::IntCounter>,
        script: &Sql<'_>,
    ) -> Result<(), sqlx::Error> {
        statements.run(self.0, script)
    }
}

/// Parents the batch names that the cache lacks, after the cache turned a
/// generation if it was full (see `KnownMap`).
pub(super) fn missing_parents(
    commands: &[Command],
    known: &KnownCache,
) -> (Vec<RequestKey>, Vec<Id>) {
    let mut cache = lock(known);
    cache.turn_if_full();
    batch::needs(commands, &cache)
}

/// The fast path of `apply_batch`: no request-log read before planning.
pub(super) async fn apply_fast(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let (_, parent_ids) = missing_parents(commands, &state.known);
    // Outside a transaction: the writer is the only writer, so nothing
    // changes between this read and the script.
    let mut src = Sqlx::<Sqlite>(&mut *conn);
    load_parents(&mut src, &parent_ids, &state.known).await?;
    mark_ending(&mut src, commands, state.draining, &state.known).await?;
    let mut plan = plan_fast(commands, state, stamper, now_ms);
    // See `held_fast`.
    let unlogged = batch::unlogged(commands, &plan.answers);
    if !unlogged.is_empty() {
        let earlier =
            load_prior_requests::<Sqlite, _>(&mut Sqlx::<Sqlite>(&mut *conn), &unlogged).await?;
        batch::replay_unlogged(commands, &mut plan.answers, &earlier);
    }
    let mut handle = super::raw::take_handle(conn, retakes(state)).await?;
    write_fast(&mut handle, plan, state)
}

/// Plans a batch as if none of its requests were a retry.
fn plan_fast(
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Plan {
    let mut prior = HashMap::new();
    batch::plan(
        commands,
        &mut prior,
        &mut lock(&state.known),
        &mut state.next_seq,
        stamper,
        now_ms,
    )
}

/// Writes a fast-path plan in one transaction of its own, on this thread.
fn write_fast(
    handle: &mut LockedSqliteHandle<'_>,
    plan: Plan,
    state: &mut WriterState,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    touch_trees(&state.trees, &plan);
    let mut script = Sql::whole_transaction();
    script.statement("BEGIN IMMEDIATE");
    let writes = plan_statements(&mut script, &plan);
    if writes > 0 {
        script.statement("COMMIT");
        // Numbered before it starts: see `Durability::committed`.
        state.committed.fetch_add(1, Ordering::SeqCst);
        let began = std::time::Instant::now();
        state.statements.run(handle, &script)?;
        state.trees.committed();
        tracing::trace!(
            statements = script.statements().len(),
            took_us = began.elapsed().as_micros() as u64,
            "batch script ran"
        );
    }
    drop(script);
    Ok(batch::answers(plan.answers))
}

/// Records the trees the plan's contracts and receipts join (Watch's hint,
/// `TreeChanges`), before the commit (streams wake only once it is durable).
fn touch_trees(trees: &crate::TreeChanges, plan: &Plan) {
    for row in &plan.contracts {
        trees.touch(row.root_id, row.seq);
    }
    for row in &plan.receipts {
        trees.touch(row.root_id, row.seq);
    }
}

/// While a drain is in progress, marks the batch's issuing parents that
/// are ending (`ParentView::ending`); nothing to read otherwise.
async fn mark_ending(
    src: &mut impl Source<Sqlite>,
    commands: &[Command],
    draining: bool,
    known: &KnownCache,
) -> Result<(), sqlx::Error> {
    if !draining {
        return Ok(());
    }
    let parents: Vec<Id> = commands
        .iter()
        .filter_map(|c| match c {
            Command::Delegate(child, _) => Some(child.parent_id),
            _ => None,
        })
        .collect();
    let mut taken = std::mem::take(&mut *lock(known));
    let marked = drain::mark_ending::<Sqlite, _>(src, &mut taken, &parents).await;
    *lock(known) = taken;
    marked
}

/// Loads the named parents into the cache.
pub(super) async fn load_parents(
    src: &mut impl Source<Sqlite>,
    parent_ids: &[Id],
    known: &KnownCache,
) -> Result<(), sqlx::Error> {
    let mut corrupt = Vec::new();
    for chunk in parent_ids.chunks(ROWS_PER_STATEMENT) {
        let args = padded(chunk.iter().map(|id| Arg::Blob(id.as_slice())).collect());
        let text = listed(SELECT_BY_IDS, args.len(), "");
        let rows = src.rows(&text, &args).await?;
        let mut cache = lock(known);
        for row in rows {
            match StoredContract::from_cells(&row).map(StoredContract::known) {
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

/// Contract rows by id. Followed by a list (`listed`).
const SELECT_BY_IDS: &str = select_contracts!("WHERE id IN ");

/// Whether a careful batch reads the request log before it plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lookups {
    /// Every request key first: a batch redone after a conflict.
    First,
    /// Only where it may matter: every key first if one of them may have
    /// been seen lately (`RecentRequests`) or the batch holds more than one
    /// lifecycle command (one read for all, not one per refusal: a flood
    /// of refused commands must not cost the writer a read each);
    /// otherwise just the key of the one command if it is answered with an
    /// error (see `Writing::prior_read`), and a retry that did succeed
    /// before is caught by its request-log insert (the batch is then
    /// redone with `First`).
    IfSeen,
}

/// The careful path: parents and drains read (`via`), lifecycle commands
/// decided one after another, all in one transaction. The writes (the
/// plan's and each transition's) run in as few scripts as the reads
/// allow (through `ViaSqlx`, each a hand-over of the handle): each
/// lifecycle command's reads must see the writes before it, so what is
/// pending runs first (`Deferred`). Reads before the first write run
/// outside the transaction: the writer is the only writer, so nothing
/// changes between them and the BEGIN. On an error the caller rolls back.
pub(super) async fn apply_careful(
    via: &mut impl Via,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
    lookups: Lookups,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let transitions = commands
        .iter()
        .filter(|c| matches!(c, Command::Lifecycle(_)))
        .count();
    let prior_read = lookups == Lookups::First || transitions > 1 || seen_lately(commands, state);
    let (mut plan, mut prior) =
        plan_careful(via, commands, state, stamper, now_ms, prior_read).await?;
    let mut answers = std::mem::take(&mut plan.answers);
    let mut deferred = Deferred {
        plan: (!plan.writes_nothing()).then_some(&plan),
        writes: Writes::default(),
        open: false,
    };
    let mut drains_changed = false;
    for (i, command) in commands.iter().enumerate() {
        let Command::Lifecycle(lifecycle) = command else {
            continue;
        };
        // A drain step writes as it goes (`drain::step`): inside the
        // transaction.
        let steps = matches!(lifecycle.action, Action::Drain);
        if deferred.pending() || (steps && !deferred.open) {
            deferred.flush(via, state, false).await?;
        }
        let mut writing = Writing {
            stamper,
            seqs: &mut state.next_seq,
            now_ms,
            step_rows: state.cascade_step_rows,
            pace: &mut state.drain_pace,
            prior_read,
            no_drains: !state.draining && !drains_changed,
        };
        let mut src = via.source(&mut state.statements);
        let applied =
            lifecycle::apply::<Sqlite, _>(&mut src, lifecycle, &prior, &mut writing).await?;
        drop(src);
        deferred.writes.append(applied.writes);
        for (root, seq) in &applied.events {
            state.trees.touch(*root, *seq);
        }
        let mut cache = lock(&state.known);
        if applied.draining_changed {
            // Which contracts may issue changed: the cache's ending
            // marks are recomputed from the drains.
            cache.clear();
            drains_changed = true;
        }
        for id in &applied.changed {
            cache.remove(id);
        }
        drop(cache);
        // A duplicate later in this batch replays this answer.
        if let (Some(request), Ok(answer)) = (&lifecycle.request, &applied.answer)
            && let Outcome::Receipt {
                receipt_id,
                envelope,
                ..
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
        answers[i] = Slot::Planned(applied.answer);
    }
    let mut draining = state.draining;
    if drains_changed {
        if deferred.pending() {
            deferred.flush(via, state, false).await?;
        }
        draining = drain::any_drain::<Sqlite, _>(&mut via.source(&mut state.statements)).await?;
    }
    if deferred.pending() || deferred.open {
        deferred.flush(via, state, true).await?;
    }
    // Only once committed: lifecycle commands skip the drains read on it.
    state.draining = draining;
    // Also when nothing was written: an attempt before this one (rolled
    // back) may have touched trees.
    state.trees.committed();
    Ok(batch::answers(answers))
}

/// Reads what a careful batch's plan needs (the request log first when
/// `prior_read`; the parents; the ending marks while a drain runs) and
/// plans it; the earlier answers it read.
async fn plan_careful(
    via: &mut impl Via,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
    prior_read: bool,
) -> Result<(Plan, HashMap<RequestKey, PriorRequest>), sqlx::Error> {
    let (request_keys, parent_ids) = missing_parents(commands, &state.known);
    let mut prior = if prior_read {
        load_prior_requests::<Sqlite, _>(&mut via.source(&mut state.statements), &request_keys)
            .await?
    } else {
        HashMap::new()
    };
    let mut src = via.source(&mut state.statements);
    load_parents(&mut src, &parent_ids, &state.known).await?;
    mark_ending(&mut src, commands, state.draining, &state.known).await?;
    drop(src);
    let mut plan = batch::plan(
        commands,
        &mut prior,
        &mut lock(&state.known),
        &mut state.next_seq,
        stamper,
        now_ms,
    );
    if !prior_read {
        // See `held_fast`.
        let unlogged = batch::unlogged(commands, &plan.answers);
        if !unlogged.is_empty() {
            let mut src = via.source(&mut state.statements);
            let earlier = load_prior_requests::<Sqlite, _>(&mut src, &unlogged).await?;
            batch::replay_unlogged(commands, &mut plan.answers, &earlier);
        }
    }
    touch_trees(&state.trees, &plan);
    Ok((plan, prior))
}

/// A careful batch's writes not yet run, and whether its transaction is
/// open (begun by the first flush, committed by the last).
struct Deferred<'p> {
    /// The plan's statements (issuance), run with the first flush.
    plan: Option<&'p Plan>,
    writes: Writes,
    open: bool,
}

impl Deferred<'_> {
    fn pending(&self) -> bool {
        self.plan.is_some() || !self.writes.is_empty()
    }

    /// Runs what is pending on the writer's thread, after BEGIN if the
    /// transaction is not open yet and before COMMIT when `commit`.
    async fn flush(
        &mut self,
        via: &mut impl Via,
        state: &mut WriterState,
        commit: bool,
    ) -> Result<(), sqlx::Error> {
        let writes = std::mem::take(&mut self.writes);
        // A failed statement rolls the whole transaction back: the batch
        // is rolled back (or redone) whole anyway, so SQLite need not
        // journal each statement to undo it alone.
        let mut script = Sql::whole_transaction();
        if !self.open {
            script.statement("BEGIN IMMEDIATE");
            self.open = true;
        }
        if let Some(plan) = self.plan.take() {
            plan_statements(&mut script, plan);
        }
        writes.script(&mut script);
        if commit {
            script.statement("COMMIT");
            self.open = false;
            // Numbered before it starts: see `Durability::committed`.
            state.committed.fetch_add(1, Ordering::SeqCst);
        }
        let retakes = state.metrics.as_ref().map(|m| &m.sqlite_handle_retakes);
        via.run(&mut state.statements, retakes, &script).await
    }
}
