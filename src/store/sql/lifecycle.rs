//! Lifecycle transitions after issuance, applied by the store's writer
//! inside a transaction (shared by the backends, see `store::sql`): who may act (core rules), the contract
//! subtree loaded into the core's `lifecycle::Tree` so ending, cascading
//! and settlement use the very same arithmetic the property tests check,
//! the completion judged by `core::judge`, and one signed receipt per
//! transition.

use std::collections::HashMap;

use prost::Message;
use sqlx::{AssertSqlSafe, QueryBuilder, Row};

use super::{Db, DbConn, DbRow, LOCK_ROWS, Seqs, reserve_seqs};
use crate::store::batch::SeqSource;

use super::audit::observations_of;
use super::backend;
use super::plan::ROWS_PER_STATEMENT;
use super::rows::{
    CONTRACT_COLUMNS, StoredContract, contract_columns, id_column, select_contracts,
};
use crate::command::{Action, CompleteArgs, LifecycleCommand, PreJudged};
use crate::core::judge::{self, Verdict};
use crate::core::lifecycle::{
    self, CompleteFacts, Decision, Ending, Facts, Refused, Subtree, TargetWrite,
};
use crate::core::{AgentKey, Id, Scope, Status};
use crate::pb;
use crate::stamp::Stamper;
use crate::store::batch::{OUTCOME_RECEIPT, PriorRequest, RequestKey};
use crate::store::{Answer, Outcome, StoreError};

/// Everything judging a completion of one contract reads from the store,
/// loaded on a read connection.
pub struct JudgeInputs {
    /// The tree's tenant (its root's opener): whose share of the judges
    /// the judgment takes.
    pub tenant: AgentKey,
    observations: i64,
    effective_predicate: String,
    write_scope: Scope,
    result_schema_json: String,
    observed: judge::Observed,
}

impl JudgeInputs {
    /// Loads the inputs for judging `signer`'s completion of `id`, received
    /// at `received_at_ms`; `None` unless the contract exists, is accepted, is
    /// not overdue and `signer` is its delegate — anything else the writer
    /// refuses without judging, so nobody else can make the broker judge.
    pub async fn load(
        conn: &mut DbConn,
        id: &Id,
        signer: &AgentKey,
        received_at_ms: i64,
    ) -> Result<Option<Self>, StoreError> {
        let Some(target) = load(conn, id).await.map_err(backend)? else {
            return Ok(None);
        };
        if !lifecycle::judgment_due(&target.facts(None), signer, received_at_ms) {
            return Ok(None);
        }
        let observed = observed(conn, &target, received_at_ms).await?;
        let tenant = match target.parent_seq {
            None => target.delegate_key,
            Some(_) => {
                let row = sqlx::query("SELECT delegate_key FROM contracts WHERE seq = $1")
                    .bind(target.root_seq)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(backend)?;
                id_column(&row, "delegate_key")?
            }
        };
        Ok(Some(Self {
            tenant,
            observations: target.observations,
            effective_predicate: target.effective_predicate,
            write_scope: target.write_scope,
            result_schema_json: target.contract.result_schema_json,
            observed,
        }))
    }

    /// Judges `args` (CPU only: run it off the async workers).
    pub fn judge(&self, args: &CompleteArgs) -> PreJudged {
        PreJudged {
            observations: self.observations,
            judgment: judge_completion(
                &self.effective_predicate,
                &self.write_scope,
                &self.result_schema_json,
                args,
                &self.observed,
            ),
        }
    }
}

/// The one place a completion is judged, before or on the writer.
fn judge_completion(
    effective_predicate: &str,
    write_scope: &Scope,
    result_schema_json: &str,
    args: &CompleteArgs,
    observed: &judge::Observed,
) -> judge::Judgment {
    // The schema compiled at issuance; one that no longer parses cannot
    // vouch for the output (the judge reports it as not valid).
    let schema: Option<serde_json::Value> = if result_schema_json.is_empty() {
        None
    } else {
        serde_json::from_str(result_schema_json).ok()
    };
    let completion = judge::Completion {
        output: args.output.clone(),
        claim: args.claim.clone(),
        reported_consumed: args.reported_consumed,
        has_report: args.has_report,
        schema: schema.as_ref(),
    };
    judge::judge(effective_predicate, write_scope, &completion, observed)
}

/// A contract row as lifecycle reads it: the table's one decoder.
type Loaded = StoredContract;

/// Decodes a contract row; a row that does not decode aborts the batch as
/// corrupt data (see `backend_ref`).
fn row_from(row: &DbRow) -> Result<Loaded, sqlx::Error> {
    StoredContract::from_row(row).map_err(|e| sqlx::Error::Protocol(e.to_string()))
}

async fn load(conn: &mut DbConn, id: &Id) -> Result<Option<Loaded>, sqlx::Error> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope WHERE id = $1"
    )))
    .bind(id.as_slice())
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(row_from).transpose()
}

/// `id` and its parent, ancestors first and locked for the transaction
/// (`LOCK_ROWS`): every writer locks contracts in (depth, id) order —
/// parents of a batch, then a target's parent, the target and its
/// descendants — so concurrent writers (PostgreSQL replicas) never wait
/// for each other in a cycle. `None`: no such contract.
async fn load_locked(
    conn: &mut DbConn,
    id: &Id,
) -> Result<Option<(Option<Loaded>, Loaded)>, sqlx::Error> {
    // CONTRACT_COLUMNS and LOCK_ROWS are constants: nothing
    // client-supplied is interpolated.
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope \
         WHERE id = $1 OR seq = (SELECT parent_seq FROM contracts WHERE id = $1) \
         ORDER BY depth{LOCK_ROWS}"
    )))
    .bind(id.as_slice())
    .fetch_all(&mut *conn)
    .await?;
    let mut loaded = rows.iter().map(row_from).collect::<Result<Vec<_>, _>>()?;
    let Some(target) = loaded.pop() else {
        return Ok(None);
    };
    if target.id != *id || loaded.len() > 1 {
        return Err(sqlx::Error::Protocol(
            "a contract and its parent loaded out of order".into(),
        ));
    }
    Ok(Some((loaded.pop(), target)))
}

/// Open strict descendants of `seq` (ended contracts have no open
/// descendants: ending cascades), locked (`LOCK_ROWS`) in (depth, id)
/// order; `None` when there are more than `max` (then nothing is locked
/// but what was read to count them). Walked one level at a time down
/// `contracts_by_parent`, each level found by its parents' seqs
/// (`CHILDREN_OF`) and then loaded by key in id order: the cost is what
/// the subtree holds, whatever else is open. A recursive query was planned
/// through `contracts_open_by_deadline` by SQLite (every open contract of
/// the database scanned per descendant: a revoke of 30,000 held the writer
/// 80 s) and through a scan of the whole table per level by PostgreSQL;
/// the plan tests of both backends hold the two statements here to their
/// indexes. Locking each level before reading the next also means a child
/// committed under a locked contract meanwhile is seen (PostgreSQL reads
/// each statement afresh).
async fn open_descendants(
    conn: &mut DbConn,
    seq: i64,
    max: usize,
) -> Result<Option<Vec<Loaded>>, sqlx::Error> {
    let mut found = Vec::new();
    let mut level = vec![seq];
    while !level.is_empty() {
        let mut children: Vec<(Vec<u8>, i64)> = Vec::new();
        for parents in level.chunks(ROWS_PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(CHILDREN_OF);
            in_list(&mut query, parents);
            // At most one past the bound: enough to know it is passed.
            let left = max
                .saturating_sub(found.len())
                .saturating_sub(children.len());
            query.push(" LIMIT ");
            query.push_bind(i64::try_from(left.saturating_add(1)).unwrap_or(i64::MAX));
            for row in query.build().fetch_all(&mut *conn).await? {
                children.push((row.try_get("id")?, row.try_get("seq")?));
            }
            if found.len() + children.len() > max {
                return Ok(None);
            }
        }
        children.sort_unstable();
        level = Vec::with_capacity(children.len());
        for chunk in children.chunks(ROWS_PER_STATEMENT) {
            let seqs: Vec<i64> = chunk.iter().map(|(_, seq)| *seq).collect();
            let mut query = QueryBuilder::<Db>::new(LOAD_BY_SEQ);
            in_list(&mut query, &seqs);
            // LOCK_ROWS is a constant.
            query.push(" ORDER BY id");
            query.push(LOCK_ROWS);
            for row in query.build().fetch_all(&mut *conn).await? {
                let loaded = row_from(&row)?;
                level.push(loaded.seq);
                found.push(loaded);
            }
        }
    }
    Ok(Some(found))
}

/// The open children of a level's contracts, found by the parent index:
/// `+status` keeps SQLite from planning it through
/// `contracts_open_by_deadline`. Followed by `in_list`.
pub(crate) const CHILDREN_OF: &str =
    "SELECT id, seq FROM contracts WHERE +status IN (1, 2) AND parent_seq IN ";
const _: () = assert!(Status::Open as i32 == 1 && Status::Accepted as i32 == 2);

/// Contract rows by key. Followed by `in_list`.
pub(crate) const LOAD_BY_SEQ: &str = select_contracts!("WHERE seq IN ");

/// Appends `(v1, v2, …)` with each value bound.
fn in_list(query: &mut QueryBuilder<Db>, values: &[i64]) {
    query.push("(");
    let mut list = query.separated(", ");
    for v in values {
        list.push_bind(*v);
    }
    list.push_unseparated(")");
}

/// Ancestors root first, then the contract itself: (id, delegate key).
async fn lineage(conn: &mut DbConn, seq: i64) -> Result<Vec<(Id, AgentKey)>, sqlx::Error> {
    let rows = sqlx::query(
        "WITH RECURSIVE up(seq, parent_seq) AS (\
             SELECT seq, parent_seq FROM contracts WHERE seq = $1 \
             UNION ALL SELECT c.seq, c.parent_seq FROM contracts c JOIN up ON c.seq = up.parent_seq) \
         SELECT c.id, c.delegate_key FROM contracts c WHERE c.seq IN (SELECT seq FROM up) ORDER BY c.seq",
    )
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    let corrupt = |e: StoreError| sqlx::Error::Protocol(e.to_string());
    rows.iter()
        .map(|r| {
            Ok((
                id_column(r, "id").map_err(corrupt)?,
                id_column(r, "delegate_key").map_err(corrupt)?,
            ))
        })
        .collect()
}

/// What the writer must do after a transition besides writing rows.
pub struct Applied {
    pub answer: Result<Answer, StoreError>,
    /// Contracts whose cached state is now stale (SQLite's writer cache;
    /// PostgreSQL caches only immutable terms).
    #[allow(dead_code)]
    pub changed: Vec<Id>,
    /// A drain started or ended: which contracts issue is now different.
    #[allow(dead_code)]
    pub draining_changed: bool,
}

impl Loaded {
    /// The row as the core's decision reads it; `parent` indexes the
    /// loaded subtree.
    fn facts(&self, parent: Option<usize>) -> Facts {
        Facts {
            id: self.id,
            parent,
            status: self.status,
            ledger: self.ledger,
            deadline_ms: self.deadline_ms,
            issued_at_ms: self.issued_at_ms,
            delegate_key: self.delegate_key,
            host_key: self.host_key,
            host_named_at_delegate: !self.contract.host_public_key.is_empty(),
            verdict: Verdict::from_i32(self.verdict),
            observations: self.observations,
            stale_judgments: self.stale_judgments,
            observed_units: self.observed_units,
            metered: self.metered,
            metered_uncharged: self.metered_uncharged,
            depth: self.contract.depth,
            min_retry_cost: self.contract.min_retry_cost,
            min_retry_latency_ms: self.contract.min_retry_latency_ms,
        }
    }
}

/// What `decide` reads: `rows` (the parent when there is one, the target,
/// then any of its open descendants), with the lineage and the drain state
/// loaded once.
fn subtree(
    rows: Vec<Loaded>,
    target_seq: i64,
    lineage: Vec<(Id, AgentKey)>,
    ending: Ending,
) -> (Subtree, Vec<Loaded>) {
    let index: HashMap<i64, usize> = rows.iter().enumerate().map(|(i, r)| (r.seq, i)).collect();
    let facts = rows
        .iter()
        .map(|r| r.facts(r.parent_seq.and_then(|p| index.get(&p).copied())))
        .collect();
    let subtree = Subtree {
        rows: facts,
        target: index[&target_seq],
        lineage,
        ending,
    };
    (subtree, rows)
}

/// The drains in a tree: (draining contract's seq, the status its
/// descendants end with). Almost always none: one indexed read of a table
/// that holds only drains in progress.
async fn drains_of(conn: &mut DbConn, root_seq: i64) -> Result<Vec<(i64, Status)>, sqlx::Error> {
    let rows = sqlx::query("SELECT target_seq, status FROM draining WHERE root_seq = $1")
        .bind(root_seq)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("target_seq")?,
                draining_status(r.try_get("status")?)?,
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

/// `seq` and its ancestors: (seq, id), the contract itself included.
async fn ancestry(conn: &mut DbConn, seq: i64) -> Result<Vec<(i64, Id)>, sqlx::Error> {
    let rows = sqlx::query(
        "WITH RECURSIVE up(seq, parent_seq) AS (\
             SELECT seq, parent_seq FROM contracts WHERE seq = $1 \
             UNION ALL SELECT c.seq, c.parent_seq FROM contracts c JOIN up ON c.seq = up.parent_seq) \
         SELECT c.seq, c.id FROM contracts c WHERE c.seq IN (SELECT seq FROM up)",
    )
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    let corrupt = |e: StoreError| sqlx::Error::Protocol(e.to_string());
    rows.iter()
        .map(|r| Ok((r.try_get("seq")?, id_column(r, "id").map_err(corrupt)?)))
        .collect()
}

/// Whether `target` or an ancestor is draining.
async fn ending_of(conn: &mut DbConn, target: &Loaded) -> Result<Ending, sqlx::Error> {
    let drains = drains_of(conn, target.root_seq).await?;
    if drains.is_empty() {
        return Ok(Ending::None);
    }
    for (seq, id) in ancestry(conn, target.seq).await? {
        if seq == target.seq {
            continue;
        }
        if let Some((_, status)) = drains.iter().find(|(s, _)| *s == seq) {
            return Ok(Ending::Frozen {
                cause: id,
                status: *status,
            });
        }
    }
    Ok(if drains.iter().any(|(s, _)| *s == target.seq) {
        Ending::Draining
    } else {
        Ending::None
    })
}

/// Marks the issuing parents `ids` (loaded in `known`) that are draining
/// or frozen as ending (`ParentView::ending`): they issue nothing more.
/// Reads the draining table once per batch; the lineage of a parent only
/// when its tree has a drain.
pub(super) async fn mark_ending(
    conn: &mut DbConn,
    known: &mut crate::store::batch::KnownMap,
    ids: &[Id],
) -> Result<(), sqlx::Error> {
    let drains: Vec<(i64, i64)> = sqlx::query_as("SELECT root_seq, target_seq FROM draining")
        .fetch_all(&mut *conn)
        .await?;
    for id in ids {
        let Some((seq, root_seq)) = known.get(id).map(|k| (k.seq, k.root_seq)) else {
            continue;
        };
        let ending = if drains.iter().any(|(root, _)| *root == root_seq) {
            ancestry(conn, seq)
                .await?
                .iter()
                .any(|(s, _)| drains.iter().any(|(_, target)| target == s))
        } else {
            false
        };
        known.set_ending(id, ending);
    }
    Ok(())
}

/// Whether any drain is in progress (SQLite's writer keeps this as a flag;
/// PostgreSQL's writers read the table per batch, as other replicas start
/// drains).
#[allow(dead_code)]
pub(super) async fn any_drain(conn: &mut DbConn) -> Result<bool, sqlx::Error> {
    let any: Option<i64> = sqlx::query_scalar("SELECT target_seq FROM draining LIMIT 1")
        .fetch_optional(&mut *conn)
        .await?;
    Ok(any.is_some())
}

/// Ends the next bounded step of `target`'s drain: up to `step_rows` of
/// its open descendants, each with every open child it has, children
/// first (a depth-first walk down the parent index, each contract's open
/// children read only when its ledger says it has any), each with its
/// `Cascaded` receipt and its settlement into its parent, in one
/// transaction. The last step (nothing left open below the target)
/// deletes the drain: a crash between steps resumes with the next one.
#[allow(clippy::too_many_arguments)]
async fn drain(
    conn: &mut DbConn,
    target_id: &Id,
    stamper: &Stamper,
    trees: &crate::store::TreeChanges,
    next_seq: &mut Seqs,
    now_ms: i64,
    step_rows: usize,
) -> Result<Applied, sqlx::Error> {
    let gone = |changed: bool| Applied {
        answer: Err(StoreError::NotFound {
            what: crate::store::Entity::Contract,
            id: hex::encode(target_id),
        }),
        changed: Vec::new(),
        draining_changed: changed,
    };
    let Some((_, target)) = load_locked(conn, target_id).await? else {
        return Ok(gone(false));
    };
    let status = sqlx::query_scalar::<_, i64>("SELECT status FROM draining WHERE target_seq = $1")
        .bind(target.seq)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(status) = status else {
        return Ok(gone(false));
    };
    let status = draining_status(status)?;
    let (rows, order) = drain_walk(conn, target, step_rows.max(1)).await?;
    let mut done = rows[0].ledger.open_children == 0;
    let mut answer = Err(StoreError::NotFound {
        what: crate::store::Entity::Contract,
        id: hex::encode(target_id),
    });
    let mut changed = Vec::new();
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
        write_state(conn, &decision, &rows[0], &rows, &command).await?;
        reserve_seqs(conn, next_seq, decision.receipts.len()).await?;
        let signed = write_receipts(
            conn, &decision, &rows, &command, stamper, trees, next_seq, now_ms,
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
                receipt_id: signed[0].id,
                envelope: signed[0].envelope.clone(),
            },
            replayed: false,
        });
    }
    if done {
        sqlx::query("DELETE FROM draining WHERE target_seq = $1")
            .bind(rows[0].seq)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Applied {
        answer,
        changed,
        draining_changed: done,
    })
}

/// The contracts one drain step reads (`rows[0]` the draining contract,
/// then every contract the walk loaded, each after its parent) and which
/// it ends (`order`: indexes into `rows`, children first, at most
/// `step_rows`). A depth-first walk that ends a contract once all its open
/// children are in `order`, and stops at the bound.
async fn drain_walk(
    conn: &mut DbConn,
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
    let (children, more) = open_children(conn, rows[0].seq, step_rows).await?;
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
                let (children, more) = open_children(conn, seq, step_rows - order.len()).await?;
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
async fn open_children(
    conn: &mut DbConn,
    seq: i64,
    max: usize,
) -> Result<(Vec<Loaded>, bool), sqlx::Error> {
    // CONTRACT_COLUMNS and LOCK_ROWS are constants.
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope \
         WHERE parent_seq = $1 AND +status IN ($2, $3) ORDER BY id LIMIT $4{LOCK_ROWS}"
    )))
    .bind(seq)
    .bind(i64::from(Status::Open.as_i32()))
    .bind(i64::from(Status::Accepted.as_i32()))
    .bind(i64::try_from(max.saturating_add(1)).unwrap_or(i64::MAX))
    .fetch_all(&mut *conn)
    .await?;
    let mut children = rows.iter().map(row_from).collect::<Result<Vec<_>, _>>()?;
    let more = children.len() > max;
    children.truncate(max);
    children.reverse();
    Ok((children, more))
}

/// The contracts being drained, oldest drain first: what the drainer
/// (`drainer`) steps through.
async fn draining_targets(pool: &sqlx::Pool<Db>, limit: i64) -> Result<Vec<Id>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT c.id FROM draining d JOIN contracts c ON c.seq = d.target_seq \
         ORDER BY d.started_at_ms, d.target_seq LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let corrupt = |e: StoreError| sqlx::Error::Protocol(e.to_string());
    rows.iter()
        .map(|r| id_column(r, "id").map_err(corrupt))
        .collect()
}

/// Steps every drain in progress through the writer's queue, one step of
/// each in turn, each waiting behind whatever was queued before it: a drain
/// never holds the writer longer than one step, and others' requests
/// interleave. Polls the draining table every `DRAIN_POLL_MS` when idle (a
/// drain another replica started, or one left by a crash, is found so).
/// Stops when the store is gone.
pub(super) async fn drainer(
    reader: sqlx::Pool<Db>,
    commands: tokio::sync::mpsc::WeakSender<(crate::store::batch::Command, crate::store::Reply)>,
) {
    loop {
        let targets = match draining_targets(&reader, DRAINS_PER_PASS).await {
            Ok(targets) => targets,
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
            let step = crate::store::batch::Command::Lifecycle(Box::new(LifecycleCommand {
                request: None,
                contract_id,
                action: Action::Drain,
            }));
            match crate::store::submit(&queue, step).await {
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

/// Drains stepped per pass of the drainer.
const DRAINS_PER_PASS: i64 = 16;
/// How often the drainer looks for drains when there are none.
const DRAIN_POLL_MS: u64 = 200;

/// The core's view of a validated command.
fn core_action(action: &Action, now_ms: i64) -> lifecycle::Action<'_> {
    match action {
        Action::Accept { host } => lifecycle::Action::Accept { host: *host },
        Action::Decline { reason } => lifecycle::Action::Decline { reason },
        Action::Escalate { reason } => lifecycle::Action::Escalate { reason },
        Action::Revoke { reason } => lifecycle::Action::Revoke { reason },
        Action::Record { observations } => lifecycle::Action::Record {
            count: observations.len(),
            units: observations
                .iter()
                .fold(0i64, |sum, o| sum.saturating_add(o.units)),
        },
        Action::Complete(args) => lifecycle::Action::Complete(CompleteFacts {
            judgment: args
                .prejudged
                .as_ref()
                .map(|p| (&p.judgment, p.observations)),
            received_at_ms: args.received_at_ms.unwrap_or(now_ms),
            claim: &args.claim,
            has_report: args.has_report,
            result_digest: args.output_digest,
        }),
        Action::Adjudicate { verdict, reason } => lifecycle::Action::Adjudicate {
            verdict: *verdict,
            reason,
        },
        Action::Expire | Action::Drain => lifecycle::Action::Expire,
    }
}

/// Applies one lifecycle command: loads the subtree, lets the core decide,
/// writes the decision. The outer error aborts the batch; the inner one
/// refuses only this command. A decision that would end more open
/// descendants than one step (`step_rows`) starts a drain instead
/// (`drain`): nothing else is written, and the request is answered
/// `DescendantsEnding` (retry with the same nonce).
#[allow(clippy::too_many_arguments)]
pub async fn apply(
    conn: &mut DbConn,
    command: &LifecycleCommand,
    prior: &HashMap<RequestKey, PriorRequest>,
    stamper: &Stamper,
    trees: &crate::store::TreeChanges,
    next_seq: &mut Seqs,
    now_ms: i64,
    step_rows: usize,
) -> Result<Applied, sqlx::Error> {
    if let Some(request) = &command.request
        && let Some(earlier) = prior.get(&(request.agent, request.nonce.clone()))
    {
        return Ok(Applied {
            answer: crate::store::batch::replayed(earlier, request),
            changed: Vec::new(),
            draining_changed: false,
        });
    }
    if matches!(command.action, Action::Drain) {
        return drain(
            conn,
            &command.contract_id,
            stamper,
            trees,
            next_seq,
            now_ms,
            step_rows,
        )
        .await;
    }
    let Some((parent, target)) = load_locked(conn, &command.contract_id).await? else {
        return Ok(Applied {
            answer: Err(StoreError::NotFound {
                what: crate::store::Entity::Contract,
                id: hex::encode(command.contract_id),
            }),
            changed: Vec::new(),
            draining_changed: false,
        });
    };
    let action = core_action(&command.action, now_ms);
    let signer = command.request.as_ref().map(|r| &r.agent);
    let ending = ending_of(conn, &target).await?;
    let lineage = if action.needs_lineage() {
        lineage(conn, target.seq).await?
    } else {
        Vec::new()
    };
    let (target_seq, root_seq) = (target.seq, target.root_seq);
    let mut rows: Vec<Loaded> = parent.into_iter().collect();
    rows.push(target);
    // Loaded without the open descendants first: only a decision that
    // may end the target reads them (`needs_descendants`), so a stranger's
    // request costs the writer the target, its parent and its lineage.
    let (partial, rows) = subtree(rows, target_seq, lineage, ending);
    let (subtree, rows) = if lifecycle::needs_descendants(&partial, signer, &action, now_ms) {
        match open_descendants(conn, target_seq, step_rows.max(1)).await? {
            Some(descendants) => {
                let mut rows = rows;
                rows.extend(descendants);
                self::subtree(rows, target_seq, partial.lineage, ending)
            }
            None => {
                start_drain(
                    conn,
                    target_seq,
                    root_seq,
                    lifecycle::drain_status(&action),
                    now_ms,
                )
                .await?;
                return Ok(Applied {
                    answer: Err(StoreError::from(Refused::DescendantsEnding)),
                    changed: Vec::new(),
                    draining_changed: true,
                });
            }
        }
    } else {
        (partial, rows)
    };
    let decision = lifecycle::decide(&subtree, signer, &action, now_ms);
    write(
        conn, &decision, &subtree, &rows, command, stamper, trees, next_seq, now_ms,
    )
    .await
}

/// Records that `target_seq`'s open descendants are to be ended in steps
/// with `status` (once: a second request finds the drain started).
async fn start_drain(
    conn: &mut DbConn,
    target_seq: i64,
    root_seq: i64,
    status: Status,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO draining (target_seq, root_seq, status, started_at_ms) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (target_seq) DO NOTHING",
    )
    .bind(target_seq)
    .bind(root_seq)
    .bind(i64::from(status.as_i32()))
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes the decision's rows and the target's columns (and, for a
/// record, its observations). Any error aborts the whole batch: nothing
/// of a half-written decision is committed.
async fn write_state(
    conn: &mut DbConn,
    decision: &Decision,
    target: &Loaded,
    rows: &[Loaded],
    command: &LifecycleCommand,
) -> Result<(), sqlx::Error> {
    for u in &decision.updates {
        sqlx::query(
            "UPDATE contracts SET status = $1, reserved = $2, spent = $3, open_children = $4 WHERE seq = $5",
        )
        .bind(i64::from(u.status.as_i32()))
        .bind(u.ledger.reserved)
        .bind(u.ledger.spent)
        .bind(i64::from(u.ledger.open_children))
        .bind(rows[u.row].seq)
        .execute(&mut *conn)
        .await?;
    }
    match &decision.write {
        TargetWrite::None => {}
        TargetWrite::Host(host) => {
            sqlx::query("UPDATE contracts SET host_key = $1 WHERE seq = $2")
                .bind(host.map(|h| h.to_vec()))
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
        }
        TargetWrite::Observations {
            total,
            observed_units,
            metered,
            metered_uncharged,
        } => {
            let Action::Record { observations } = &command.action else {
                // A decision the core cannot make: abort as corrupt.
                return Err(sqlx::Error::Protocol(
                    "a decision to record observations for another command".into(),
                ));
            };
            let mut query = QueryBuilder::<Db>::new(
                "INSERT INTO observations (contract_seq, kind, path, tool, units, at_ms) ",
            );
            query.push_values(observations, |mut b, o| {
                b.push_bind(target.seq)
                    .push_bind(i64::from(o.kind as i32))
                    .push_bind(o.path.as_str())
                    .push_bind(o.tool.as_str())
                    .push_bind(o.units)
                    .push_bind(o.at_ms);
            });
            query.build().execute(&mut *conn).await?;
            sqlx::query("UPDATE contracts SET observations = $1, observed_units = $2, metered = $3, metered_uncharged = $4 WHERE seq = $5")
                .bind(total)
                .bind(observed_units)
                .bind(i64::from(*metered))
                .bind(metered_uncharged)
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
        }
        TargetWrite::Judged {
            verdict,
            has_report,
            downgrades,
            claim,
        } => {
            sqlx::query(
                "UPDATE contracts SET verdict = $1, has_report = $2, downgrades = $3, claim = $4 WHERE seq = $5",
            )
            .bind(i64::from(verdict.as_i32()))
            .bind(i64::from(*has_report))
            .bind(i64::from(*downgrades))
            .bind(claim.as_str())
            .bind(target.seq)
            .execute(&mut *conn)
            .await?;
        }
        TargetWrite::StaleJudgment => {
            sqlx::query(
                "UPDATE contracts SET stale_judgments = stale_judgments + 1 WHERE seq = $1",
            )
            .bind(target.seq)
            .execute(&mut *conn)
            .await?;
        }
        TargetWrite::Verdict(verdict) => {
            sqlx::query("UPDATE contracts SET verdict = $1 WHERE seq = $2")
                .bind(i64::from(verdict.as_i32()))
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

/// Signs and stores the decision's receipts in order, logging the
/// request beside the one that answers it.
#[allow(clippy::too_many_arguments)]
async fn write_receipts(
    conn: &mut DbConn,
    decision: &Decision,
    rows: &[Loaded],
    command: &LifecycleCommand,
    stamper: &Stamper,
    trees: &crate::store::TreeChanges,
    next_seq: &mut Seqs,
    now_ms: i64,
) -> Result<Vec<crate::stamp::Stamped>, sqlx::Error> {
    let mut signed = Vec::with_capacity(decision.receipts.len());
    for planned in &decision.receipts {
        let row = &rows[planned.row];
        let request = command.request.as_ref().filter(|_| planned.answers_request);
        let mut receipt = crate::stamp::lifecycle_receipt(&planned.body);
        receipt.broker_key_id = stamper.key_id().to_owned();
        receipt.contract_id = row.id.to_vec();
        receipt.root_id = row.root_id.to_vec();
        receipt.at_ms = now_ms;
        if let Some(request) = request {
            receipt.request_digest = request.digest.to_vec();
            receipt.requester_public_key = request.agent.to_vec();
        }
        let stamped = stamper.sign_receipt(&receipt);
        let seq = next_seq.take();
        trees.touch(row.root_id, seq);
        sqlx::query(
            "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(seq)
        .bind(stamped.id.as_slice())
        .bind(i64::from(receipt.kind))
        .bind(row.seq)
        .bind(row.id.as_slice())
        .bind(row.root_id.as_slice())
        .bind(stamped.envelope.encode_to_vec())
        .bind(now_ms)
        .execute(&mut *conn)
        .await?;
        if let Some(request) = request {
            sqlx::query(
                "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(request.agent.as_slice())
            .bind(request.nonce.as_slice())
            .bind(request.digest.as_slice())
            .bind(OUTCOME_RECEIPT)
            .bind(stamped.id.as_slice())
            .bind(now_ms)
            .execute(&mut *conn)
            .await?;
        }
        signed.push(stamped);
    }
    Ok(signed)
}

/// Writes `decision`: rows, the target's columns, observations, receipts
/// (with the request's log entry beside the one that answers it).
#[allow(clippy::too_many_arguments)]
async fn write(
    conn: &mut DbConn,
    decision: &Decision,
    subtree: &Subtree,
    rows: &[Loaded],
    command: &LifecycleCommand,
    stamper: &Stamper,
    trees: &crate::store::TreeChanges,
    next_seq: &mut Seqs,
    now_ms: i64,
) -> Result<Applied, sqlx::Error> {
    write_state(conn, decision, &rows[subtree.target], rows, command).await?;
    reserve_seqs(conn, next_seq, decision.receipts.len()).await?;
    let signed = write_receipts(
        conn, decision, rows, command, stamper, trees, next_seq, now_ms,
    )
    .await?;
    let changed = decision
        .changed(subtree.target)
        .into_iter()
        .map(|i| rows[i].id)
        .collect();
    let answer = match &decision.answer {
        Ok(i) => Ok(Answer {
            outcome: Outcome::Receipt {
                receipt_id: signed[*i].id,
                envelope: signed[*i].envelope.clone(),
            },
            replayed: false,
        }),
        Err(why) => Err(StoreError::from(why.clone())),
    };
    Ok(Applied {
        answer,
        changed,
        draining_changed: false,
    })
}

/// What the host recorded for `target`, as the judge reads it.
async fn observed(
    conn: &mut DbConn,
    target: &Loaded,
    now_ms: i64,
) -> Result<judge::Observed, StoreError> {
    let mut tool_calls = 0;
    let mut mutation_paths = Vec::new();
    for (kind, path) in observations_of(conn, target.seq).await? {
        if kind == pb::ObservationKind::ToolCall as i32 {
            tool_calls += 1;
        } else if kind == pb::ObservationKind::Mutation as i32 {
            mutation_paths.push(path);
        }
    }
    Ok(judge::Observed {
        tool_calls,
        mutation_paths,
        consumed_by_host: target.metered.then_some(target.observed_units),
        elapsed_ms: now_ms.saturating_sub(target.issued_at_ms),
    })
}
