//! Drains: a revoke (or any ending) of a subtree larger than one step
//! (`limits.cascade_step_rows`) ends its descendants in bounded steps, one
//! transaction each, through the writer's queue (`drainer`), while the
//! subtree is frozen (`core::lifecycle::Ending`). Each step's rules are
//! the core's (`lifecycle::drain_step`); this module loads and writes.

use std::collections::HashMap;

use sqlx::AssertSqlSafe;

use super::lifecycle::{
    Applied, Loaded, Writing, load_locked, row_from, write_receipts, write_state,
};
use super::plan::Arg;
use super::rows::{CONTRACT_COLUMNS, key_cell};
use super::source::{CellOf, Source, Sqlx, listed, padded};
use super::writes::Writes;
use super::{Cell, Dialect, QueryExt};
use crate::limits::{
    DRAIN_POLL_MS, DRAIN_STEP_MS, DRAINS_PER_PASS, INITIAL_DRAIN_ROW_COST_NS, MAX_DRAINS_LISTED,
    MIN_DRAIN_STEP_ROWS, ROWS_PER_STATEMENT,
};
use broker_domain::lifecycle::{self, Ending, Facts};
use broker_domain::{AgentKey, Id, Status};
use broker_wire::command::{Action, LifecycleCommand};

/// How many rows a drain step ends: as many as fit `DRAIN_STEP_MS` at
/// what a row cost in the last steps (read, decided, written, receipted),
/// between `MIN_DRAIN_STEP_ROWS` and `limits.cascade_step_rows`. A step
/// thus holds the writer about as long on any machine and any backend,
/// and other writes wait behind one step, never a thousand rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DrainPace {
    row_cost_ns: u64,
}

impl Default for DrainPace {
    fn default() -> Self {
        Self {
            row_cost_ns: INITIAL_DRAIN_ROW_COST_NS,
        }
    }
}

impl DrainPace {
    /// Rows for the next step, at most `step_rows`.
    pub(crate) fn rows(&self, step_rows: usize) -> usize {
        let fit = (DRAIN_STEP_MS * 1_000_000) / self.row_cost_ns.max(1);
        usize::try_from(fit)
            .unwrap_or(usize::MAX)
            .clamp(MIN_DRAIN_STEP_ROWS.min(step_rows.max(1)), step_rows.max(1))
    }

    /// A step ended `rows` rows in `elapsed`: the estimate moves a quarter
    /// of the way to it (one slow step, a page fault or a checkpoint, does
    /// not shrink the next ones to nothing).
    pub(crate) fn observe(&mut self, elapsed: std::time::Duration, rows: usize) {
        let Ok(rows) = u64::try_from(rows) else {
            return;
        };
        if rows == 0 {
            return;
        }
        let elapsed_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let cost = (elapsed_ns / rows).max(1);
        self.row_cost_ns = (self.row_cost_ns.saturating_mul(3) / 4)
            .saturating_add(cost / 4)
            .max(1);
    }
}
use crate::{Answer, Outcome, StoreError};

/// The drains in a tree: (draining contract's seq, the status its
/// descendants end with). Almost always none: one indexed read of a table
/// that holds only drains in progress.
pub(crate) async fn drains_of<D: Dialect, S: Source<D>>(
    src: &mut S,
    root_seq: i64,
) -> Result<Vec<(i64, Status)>, sqlx::Error> {
    let rows = src
        .rows(
            "SELECT target_seq, status FROM draining WHERE root_seq = $1",
            &[Arg::Int(root_seq)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.cell_of("target_seq")?,
                draining_status(r.cell_of("status")?)?,
            ))
        })
        .collect()
}

/// A drain's stored status; another value is corrupt data.
fn draining_status(stored: i64) -> Result<Status, sqlx::Error> {
    i32::try_from(stored)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| sqlx::Error::Protocol(format!("draining status {stored}")))
}

/// Whether the contract `target_seq` or an ancestor is draining, from its
/// tree's `drains` and its `lineage` (root first: the topmost draining
/// ancestor is the cause).
pub(crate) fn ending_of(
    drains: &[(i64, Status)],
    lineage: &[(i64, Id, AgentKey)],
    target_seq: i64,
) -> Ending {
    if drains.is_empty() {
        return Ending::None;
    }
    for (seq, id, _) in lineage {
        if *seq == target_seq {
            continue;
        }
        if let Some((_, status)) = drains.iter().find(|(s, _)| s == seq) {
            return Ending::Frozen {
                cause: *id,
                status: *status,
            };
        }
    }
    if drains.iter().any(|(s, _)| *s == target_seq) {
        Ending::Draining
    } else {
        Ending::None
    }
}

/// The drains of some trees: (root seq, draining contract's seq). Followed
/// by a list (`listed`); PostgreSQL's writer reads them with its numbers instead
/// (`writer::DRAINS_AND_NUMBERS`). By root, through `draining_by_root`: a
/// tenant that starts many drains makes only its own trees' issuance read
/// them, never every batch of every tree.
pub(crate) const DRAINS_OF_ROOTS: &str =
    "SELECT root_seq, target_seq FROM draining WHERE root_seq IN ";

/// The distinct trees (root seqs) of the issuing parents `ids` loaded in
/// `known`.
pub(crate) fn roots_of(known: &crate::batch::KnownMap, ids: &[Id]) -> Vec<i64> {
    let mut roots: Vec<i64> = ids
        .iter()
        .filter_map(|id| known.get(id).map(|k| k.root_seq))
        .collect();
    roots.sort_unstable();
    roots.dedup();
    roots
}

/// Marks the issuing parents `ids` (loaded in `known`) that are draining
/// or frozen as ending (`ParentView::ending`): they issue nothing more.
/// Reads the drains of the parents' trees once per batch; the lineage of
/// a parent only when its tree has a drain.
pub(crate) async fn mark_ending<D: Dialect, S: Source<D>>(
    src: &mut S,
    known: &mut crate::batch::KnownMap,
    ids: &[Id],
) -> Result<(), sqlx::Error> {
    let roots = roots_of(known, ids);
    let mut drains = Vec::new();
    for chunk in roots.chunks(ROWS_PER_STATEMENT) {
        let args = padded(chunk.iter().map(|r| Arg::Int(*r)).collect());
        let text = listed(DRAINS_OF_ROOTS, args.len(), "");
        for row in src.rows(&text, &args).await? {
            drains.push((
                CellOf::<i64>::cell_of(&row, "root_seq")?,
                CellOf::<i64>::cell_of(&row, "target_seq")?,
            ));
        }
    }
    mark_ending_with::<D, S>(src, known, ids, &drains).await
}

/// `mark_ending` with the parents' trees' drains already read: (root seq,
/// draining contract's seq).
pub(crate) async fn mark_ending_with<D: Dialect, S: Source<D>>(
    src: &mut S,
    known: &mut crate::batch::KnownMap,
    ids: &[Id],
    drains: &[(i64, i64)],
) -> Result<(), sqlx::Error> {
    for id in ids {
        let Some((seq, root_seq)) = known.get(id).map(|k| (k.seq, k.root_seq)) else {
            continue;
        };
        let ending = if drains.iter().any(|(root, _)| *root == root_seq) {
            super::lifecycle::lineage::<D, S>(src, seq)
                .await?
                .iter()
                .any(|(s, _, _)| drains.iter().any(|(_, target)| target == s))
        } else {
            false
        };
        known.set_ending(id, ending);
    }
    Ok(())
}

/// Whether any drain is in progress (SQLite's writer keeps this as a flag;
/// PostgreSQL's writers read their parents' trees' drains every batch, as
/// other replicas start drains).
pub(crate) async fn any_drain<D: Dialect, S: Source<D>>(src: &mut S) -> Result<bool, sqlx::Error> {
    let any = src
        .rows("SELECT target_seq FROM draining LIMIT 1", &[])
        .await?;
    Ok(!any.is_empty())
}

/// Ends the next bounded step of `target`'s drain: up to `step_rows` of
/// its open descendants, each with every open child it has, children
/// first (a depth-first walk down the parent index, each contract's open
/// children read only when its ledger says it has any), each with its
/// `Cascaded` receipt and its settlement into its parent, in one
/// transaction. The last step (nothing left open below the target)
/// deletes the drain: a crash between steps resumes with the next one.
pub(crate) async fn step<D: Dialect>(
    conn: &mut D::Connection,
    target_id: &Id,
    w: &mut Writing<'_, D>,
) -> Result<Applied, sqlx::Error> {
    let gone = || {
        Applied::nothing(Err(StoreError::NotFound {
            what: crate::Entity::Contract,
            id: hex::encode(target_id),
        }))
    };
    let Some((_, target)) = load_locked::<D, _>(&mut Sqlx::<D>(&mut *conn), target_id).await?
    else {
        return Ok(gone());
    };
    let status = sqlx::query::<D>("SELECT status FROM draining WHERE target_seq = $1")
        .arg(target.seq)
        .optional(&mut *conn)
        .await?;
    let Some(status) = status else {
        return Ok(gone());
    };
    let status = draining_status(status.cell("status")?)?;
    let began = std::time::Instant::now();
    let (rows, order) = walk::<D>(conn, target, w.pace.rows(w.step_rows)).await?;
    let mut done = rows[0].ledger.open_children == 0;
    let mut answer = Err(StoreError::NotFound {
        what: crate::Entity::Contract,
        id: hex::encode(target_id),
    });
    let mut changed = Vec::new();
    let mut events = Vec::new();
    let mut writes = Writes::default();
    if !order.is_empty() {
        let index: HashMap<i64, usize> = rows.iter().enumerate().map(|(i, r)| (r.seq, i)).collect();
        let facts: Vec<Facts> = rows
            .iter()
            .map(|r| r.facts(r.parent_seq.and_then(|p| index.get(&p).copied())))
            .collect();
        let decision = lifecycle::drain_step(&facts, &order, rows[0].id, status);
        if let Err(why) = &decision.answer {
            return Err(sqlx::Error::Protocol(format!("a drain step: {why}")));
        }
        let command = LifecycleCommand {
            request: None,
            contract_id: *target_id,
            action: Action::Drain,
        };
        write_state(&mut writes, &decision, &rows[0], &rows, &command)?;
        let signed;
        (signed, events) = write_receipts::<D, _>(
            &mut Sqlx::<D>(&mut *conn),
            &mut writes,
            &decision,
            &rows,
            &command,
            w,
        )
        .await?;
        done = decision
            .updates
            .iter()
            .find(|u| u.row == 0)
            .map_or(done, |u| u.ledger.open_children == 0);
        changed = decision
            .changed(0)
            .into_iter()
            .map(|i| rows[i].id)
            .collect();
        answer = Ok(Answer {
            outcome: Outcome::Receipt {
                receipt_id: signed[0].0.id,
                envelope: signed[0].0.envelope.clone(),
                decided: signed[0].1.clone(),
            },
            replayed: false,
        });
    }
    if done {
        writes.push(
            "DELETE FROM draining WHERE target_seq = $1",
            vec![rows[0].seq.into()],
        );
    }
    // Written here, not left to the writer: the pace prices a step's
    // writes with its reads. (The SQLite writer opens its transaction
    // before a drain step for this.)
    writes.run::<D>(conn).await?;
    w.pace.observe(began.elapsed(), order.len());
    Ok(Applied {
        answer,
        changed,
        draining_changed: done,
        events,
        writes: Writes::default(),
    })
}

/// The contracts one drain step reads (`rows[0]` the draining contract,
/// then every contract the walk loaded, each after its parent) and which
/// it ends (`order`: indexes into `rows`, children first, at most
/// `step_rows`). A depth-first walk that ends a contract once all its open
/// children are in `order`, and stops at the bound.
async fn walk<D: Dialect>(
    conn: &mut D::Connection,
    target: Loaded,
    step_rows: usize,
) -> Result<(Vec<Loaded>, Vec<usize>), sqlx::Error> {
    /// A contract on the walk's path and its open children not yet walked.
    struct Frame {
        row: usize,
        children: Vec<Loaded>,
        /// It has open children beyond `children` (not loaded).
        more: bool,
    }
    let mut rows = vec![target];
    let mut order = Vec::new();
    let (children, more) = open_children::<D>(conn, rows[0].seq, step_rows).await?;
    let mut stack = vec![Frame {
        row: 0,
        children,
        more,
    }];
    while order.len() < step_rows {
        let Some(frame) = stack.last_mut() else { break };
        if let Some(child) = frame.children.pop() {
            let leaf = child.ledger.open_children == 0;
            let seq = child.seq;
            rows.push(child);
            let row = rows.len() - 1;
            if leaf {
                order.push(row);
            } else {
                let (children, more) =
                    open_children::<D>(conn, seq, step_rows - order.len()).await?;
                stack.push(Frame {
                    row,
                    children,
                    more,
                });
            }
        } else {
            let Some(frame) = stack.pop() else { break };
            if frame.row == 0 || frame.more {
                break;
            }
            order.push(frame.row);
        }
    }
    Ok((rows, order))
}

/// Up to `max` open children of `seq`, locked, in reverse id order (the
/// walk pops them from the end); and whether it has more.
async fn open_children<D: Dialect>(
    conn: &mut D::Connection,
    seq: i64,
    max: usize,
) -> Result<(Vec<Loaded>, bool), sqlx::Error> {
    // CONTRACT_COLUMNS and LOCK_ROWS are constants.
    let rows = sqlx::query::<D>(AssertSqlSafe(format!(
        "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope \
         WHERE parent_seq = $1 AND +status IN ($2, $3) ORDER BY id LIMIT $4{lock_rows}",
        lock_rows = D::LOCK_ROWS
    )))
    .arg(seq)
    .arg(i64::from(Status::Open.as_i32()))
    .arg(i64::from(Status::Accepted.as_i32()))
    .arg(i64::try_from(max.saturating_add(1)).unwrap_or(i64::MAX))
    .all(&mut *conn)
    .await?;
    let mut children = rows.iter().map(row_from).collect::<Result<Vec<_>, _>>()?;
    let more = children.len() > max;
    children.truncate(max);
    children.reverse();
    Ok((children, more))
}

/// The contracts being drained, oldest drain first: what the drainer
/// (`drainer`) steps through.
async fn draining_targets<D: Dialect>(
    pool: &sqlx::Pool<D>,
    limit: i64,
) -> Result<Vec<(AgentKey, Id)>, sqlx::Error> {
    let rows = sqlx::query::<D>(
        "SELECT c.id, r.delegate_key AS opener FROM draining d \
         JOIN contracts c ON c.seq = d.target_seq JOIN contracts r ON r.seq = d.root_seq \
         ORDER BY d.started_at_ms, d.target_seq LIMIT $1",
    )
    .arg(limit)
    .all(&mut *pool.acquire().await?)
    .await?;
    rows.iter()
        .map(|r| Ok((key_cell::<D>(r, "opener")?, key_cell::<D>(r, "id")?)))
        .collect()
}

/// Steps the drains in progress through the writer's queue, tenants in
/// turn (`tenant::in_turn`: each pass one step of each draining tenant's
/// oldest drain, at most `DRAINS_PER_PASS`), each step waiting behind
/// whatever was queued before it: a drain never holds the writer longer
/// than one step, others' requests interleave, and a tenant's drain waits
/// for one step of each other draining tenant a pass, never for their
/// drains to end. Polls the draining table every `DRAIN_POLL_MS` when idle (a
/// drain another replica started, or one left by a crash, is found so).
/// Stops when the store is gone.
pub(crate) async fn drainer<D: Dialect>(
    reader: sqlx::Pool<D>,
    commands: tokio::sync::mpsc::WeakSender<(crate::batch::Command, crate::Reply)>,
    tenants: std::sync::Arc<broker_domain::tenant::Tenants>,
) {
    let mut last = None;
    loop {
        let targets = match draining_targets::<D>(&reader, MAX_DRAINS_LISTED).await {
            Ok(listed) => {
                let waiting: Vec<_> = listed
                    .iter()
                    .map(|(opener, id)| (tenants.of(opener), *id))
                    .collect();
                let (targets, served) =
                    broker_domain::tenant::in_turn(&waiting, last, DRAINS_PER_PASS);
                last = served;
                targets
            }
            Err(e) => {
                tracing::warn!(error = %e, "listing drains failed; will retry");
                Vec::new()
            }
        };
        if targets.is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(DRAIN_POLL_MS)).await;
        }
        for contract_id in targets {
            let Some(queue) = commands.upgrade() else {
                return;
            };
            let step = crate::batch::Command::Lifecycle(Box::new(LifecycleCommand {
                request: None,
                contract_id,
                action: Action::Drain,
            }));
            match crate::submit(&queue, step).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(StoreError::Closed) => return,
                Err(e) => {
                    tracing::warn!(error = %e, contract = %hex::encode(contract_id), "a drain step failed; will retry");
                    tokio::time::sleep(std::time::Duration::from_millis(DRAIN_POLL_MS)).await;
                }
            }
        }
        if commands.upgrade().is_none() {
            return;
        }
    }
}

/// Records that `target_seq`'s open descendants are to be ended in steps
/// with `status` (once: a second request finds the drain started).
pub(crate) fn start(
    writes: &mut Writes,
    target_seq: i64,
    root_seq: i64,
    status: Status,
    now_ms: i64,
) {
    writes.push(
        "INSERT INTO draining (target_seq, root_seq, status, started_at_ms) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (target_seq) DO NOTHING",
        vec![
            target_seq.into(),
            root_seq.into(),
            i64::from(status.as_i32()).into(),
            now_ms.into(),
        ],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: (i64, Id, AgentKey) = (1, [1; 32], [9; 32]);
    const MIDDLE: (i64, Id, AgentKey) = (5, [5; 32], [9; 32]);
    const TARGET: (i64, Id, AgentKey) = (7, [7; 32], [9; 32]);

    /// The topmost draining ancestor is the cause; a draining target with
    /// no draining ancestor is Draining; the target itself is never its
    /// own cause; no drain in the tree is None.
    /// Rows shrink when rows are slow and grow when they are fast, within
    /// their bounds; an empty step teaches nothing.
    #[test]
    fn a_step_ends_what_fits_its_time() {
        use std::time::Duration;
        let mut pace = DrainPace::default();
        let first = pace.rows(1_024);
        assert_eq!(first, 50, "5 ms at 100 µs a row");
        for _ in 0..32 {
            pace.observe(Duration::from_micros(500), 100); // 5 µs a row
        }
        let fast = pace.rows(1_024);
        assert!((950..=1_000).contains(&fast), "{fast}: ~5 ms at 5 µs a row");
        assert_eq!(pace.rows(300), 300, "never past cascade_step_rows");
        for _ in 0..32 {
            pace.observe(Duration::from_millis(100), 10); // 10 ms a row
        }
        assert_eq!(pace.rows(1_024), MIN_DRAIN_STEP_ROWS);
        assert_eq!(pace.rows(3), 3, "the floor is never past the ceiling");
        let before = pace;
        pace.observe(Duration::from_secs(1), 0);
        assert_eq!(pace, before);
    }

    #[test]
    fn the_ending_follows_the_lineage_root_first() {
        let lineage = [ROOT, MIDDLE, TARGET];
        assert_eq!(ending_of(&[], &lineage, 7), Ending::None);
        assert_eq!(
            ending_of(&[(7, Status::Revoked)], &lineage, 7),
            Ending::Draining
        );
        assert_eq!(
            ending_of(&[(7, Status::Revoked), (5, Status::Declined)], &lineage, 7),
            Ending::Frozen {
                cause: [5; 32],
                status: Status::Declined
            }
        );
        assert_eq!(
            ending_of(&[(5, Status::Declined), (1, Status::Revoked)], &lineage, 7),
            Ending::Frozen {
                cause: [1; 32],
                status: Status::Revoked
            },
            "nested drains: the root-most one"
        );
        assert_eq!(
            ending_of(&[(9, Status::Revoked)], &lineage, 7),
            Ending::None,
            "a drain elsewhere in the tree"
        );
    }
}
