//! Applying one batch: the fast path (planned from the writer's cache,
//! written on the held SQLite handle with the writer's own statements)
//! and the careful one (parents loaded, planned, written through sqlx),
//! each as one transaction; the trees it touched told to their watchers.

use super::*;
use crate::batch::Slot;
use sqlx::sqlite::LockedSqliteHandle;

/// How far the held stretch got with a batch it left to `apply_batch`.
pub(super) enum Pending {
    /// Not started.
    Fresh,
    /// Planned the fast way, but some commands were answered with an
    /// error: the request log must be read for them before it is written.
    Planned {
        plan: Plan,
        unlogged: Vec<RequestKey>,
    },
    /// Its fast script failed (and may have stopped inside its
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
/// and COMMIT, run on the writer's own thread (`raw`), most of them in a
/// held stretch (`apply_held`). If a request was a retry after all, its
/// request-log row already exists, the script fails, and the batch is
/// redone the careful way, which reads the request log first. Either way
/// a request is answered once.
pub(super) async fn apply_batch(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
    pending: Pending,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let fast = match pending {
        Pending::Fresh if fast_path(commands, state) => {
            apply_fast(conn, commands, state, stamper, now_ms).await
        }
        Pending::Fresh => Ok(apply_careful(conn, commands, state, stamper, now_ms).await?),
        Pending::Planned { mut plan, unlogged } => {
            // A command answered with an error (unknown parent, over-long
            // predicate) writes no request-log row, so no insert would
            // catch a retry among them: those few keys are looked up here.
            // Their errors changed nothing, so a replayed answer simply
            // replaces them.
            match load_prior_requests::<Sqlite>(conn, &unlogged).await {
                Ok(earlier) => {
                    batch::replay_unlogged(commands, &mut plan.answers, &earlier);
                    match super::raw::take_handle(conn, retakes(state)).await {
                        Ok(mut handle) => write_fast(&mut handle, plan, state),
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            }
        }
        Pending::Failed(e) => Err(e),
    };
    let answers = match fast {
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
    };
    remember_requests(commands, state, now_ms);
    Ok(answers)
}

/// Whether a batch may take the fast path: issuance only, and none of its
/// request keys possibly committed before.
fn fast_path(commands: &[Command], state: &WriterState) -> bool {
    commands.iter().all(|c| !matches!(c, Command::Lifecycle(_)))
        && !commands
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

/// The fast path with SQLite's handle already held: plans and writes a
/// batch that needs nothing read through sqlx (every parent cached, no
/// drain in progress, no error answer to look up); anything else is left
/// `Pending` for `apply_batch`.
pub(super) fn apply_held(
    handle: &mut LockedSqliteHandle<'_>,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Held {
    if state.draining || !fast_path(commands, state) {
        return Held::Pending(Pending::Fresh);
    }
    let (_, parent_ids) = missing_parents(commands, &state.known);
    if !parent_ids.is_empty() {
        return Held::Pending(Pending::Fresh);
    }
    let plan = plan_fast(commands, state, stamper, now_ms);
    let unlogged = batch::unlogged(commands, &plan.answers);
    if !unlogged.is_empty() {
        return Held::Pending(Pending::Planned { plan, unlogged });
    }
    match write_fast(handle, plan, state) {
        Ok(answers) => {
            remember_requests(commands, state, now_ms);
            Held::Answered(answers)
        }
        Err(e) => Held::Pending(Pending::Failed(e)),
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
    load_parents(conn, &parent_ids, &state.known).await?;
    mark_ending(conn, commands, state).await?;
    let mut plan = plan_fast(commands, state, stamper, now_ms);
    // See `Pending::Planned`.
    let unlogged = batch::unlogged(commands, &plan.answers);
    if !unlogged.is_empty() {
        let earlier = load_prior_requests::<Sqlite>(conn, &unlogged).await?;
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
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &WriterState,
) -> Result<(), sqlx::Error> {
    if !state.draining {
        return Ok(());
    }
    let parents: Vec<Id> = commands
        .iter()
        .filter_map(|c| match c {
            Command::Delegate(child, _) => Some(child.parent_id),
            _ => None,
        })
        .collect();
    let mut known = std::mem::take(&mut *lock(&state.known));
    let marked = drain::mark_ending::<Sqlite>(conn, &mut known, &parents).await;
    *lock(&state.known) = known;
    marked
}

/// Loads the named parents into the cache.
pub(super) async fn load_parents(
    conn: &mut SqliteConnection,
    parent_ids: &[Id],
    known: &KnownCache,
) -> Result<(), sqlx::Error> {
    let mut corrupt = Vec::new();
    for chunk in parent_ids.chunks(ROWS_PER_STATEMENT) {
        let mut query = QueryBuilder::<Sqlite>::new(format!(
            "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope WHERE id IN ("
        ));
        let mut list = query.separated(", ");
        for id in chunk {
            list.push_bind(id.as_slice());
        }
        query.push(")");
        let rows = query.build().fetch_all(&mut *conn).await?;
        let mut cache = lock(known);
        for row in rows {
            match StoredContract::from_row::<Sqlite>(&row).map(StoredContract::known) {
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
pub(super) async fn apply_careful(
    conn: &mut SqliteConnection,
    commands: &[Command],
    state: &mut WriterState,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let (request_keys, parent_ids) = missing_parents(commands, &state.known);
    let mut prior = load_prior_requests::<Sqlite>(&mut tx, &request_keys).await?;
    load_parents(&mut tx, &parent_ids, &state.known).await?;
    mark_ending(&mut tx, commands, state).await?;
    let t0 = std::time::Instant::now();
    let mut plan = batch::plan(
        commands,
        &mut prior,
        &mut lock(&state.known),
        &mut state.next_seq,
        stamper,
        now_ms,
    );
    let t1 = std::time::Instant::now();
    touch_trees(&state.trees, &plan);
    let mut script = Sql::default();
    if plan_statements(&mut script, &plan) > 0 {
        let mut handle = super::raw::take_handle(&mut tx, retakes(state)).await?;
        state.statements.run(&mut handle, &script)?;
    }
    drop(script);
    let mut answers = std::mem::take(&mut plan.answers);
    let mut drains_changed = false;
    for (i, command) in commands.iter().enumerate() {
        if let Command::Lifecycle(lifecycle) = command {
            let mut writing = Writing {
                stamper,
                seqs: &mut state.next_seq,
                now_ms,
                step_rows: state.cascade_step_rows,
                pace: &mut state.drain_pace,
            };
            let applied =
                lifecycle::apply::<Sqlite>(&mut tx, lifecycle, &prior, &mut writing).await?;
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
    }
    if drains_changed {
        state.draining = drain::any_drain::<Sqlite>(&mut tx).await?;
    }
    let t2 = std::time::Instant::now();
    // Numbered before it starts: see `Durability::committed`.
    state.committed.fetch_add(1, Ordering::SeqCst);
    tx.commit().await?;
    state.trees.committed();
    tracing::trace!(
        plan_us = (t1 - t0).as_micros() as u64,
        write_us = (t2 - t1).as_micros() as u64,
        commit_us = t2.elapsed().as_micros() as u64,
        "batch phases"
    );
    Ok(batch::answers(answers))
}
