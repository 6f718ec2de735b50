//! Lifecycle transitions after issuance, applied by the store's writer
//! inside a transaction: who may act (core rules), the contract subtree
//! loaded into the core's `lifecycle::Subtree` so ending, cascading and
//! settlement use the very same arithmetic the property tests check, and
//! one signed receipt per transition. Drains of large subtrees are
//! `drain`'s; judging a completion is `judge`'s.

use std::collections::HashMap;

use prost::Message;

use super::Dialect;
use super::drain;
use super::plan::Arg;
use super::requests::load_prior_requests;
use super::rows::{CONTRACT_COLUMNS, StoredContract, key_of, select_contracts};
use super::source::{CellOf, Cells, Source, listed, padded};
use super::writes::Writes;
use crate::batch::{OUTCOME_RECEIPT, PriorRequest, RequestKey, SeqSource};
use crate::limits::ROWS_PER_STATEMENT;
use crate::{Answer, Decided, Outcome, StoreError};
use broker_domain::judge::Verdict;
use broker_domain::lifecycle::{
    self, CompleteFacts, Decision, Ending, Facts, Refused, Subtree, TargetWrite,
};
use broker_domain::{AgentKey, Id, Status};
use broker_wire::command::{Action, LifecycleCommand};
use broker_wire::stamp::Stamper;

/// A contract row as lifecycle reads it: the table's one decoder.
pub(crate) type Loaded = StoredContract;

/// Decodes a contract row; a row that does not decode aborts the batch as
/// corrupt data (see `backend_ref`).
pub(crate) fn row_from<R: Cells>(row: &R) -> Result<Loaded, sqlx::Error> {
    StoredContract::from_cells(row).map_err(|e| sqlx::Error::Protocol(e.to_string()))
}

/// `id` and its parent, ancestors first and locked for the transaction
/// (`LOCK_ROWS`): every writer locks contracts in (depth, id) order —
/// parents of a batch, then a target's parent, the target and its
/// descendants — so concurrent writers (PostgreSQL replicas) never wait
/// for each other in a cycle. `None`: no such contract.
pub(crate) async fn load_locked<D: Dialect, S: Source<D>>(
    src: &mut S,
    id: &Id,
) -> Result<Option<(Option<Loaded>, Loaded)>, sqlx::Error> {
    // CONTRACT_COLUMNS and LOCK_ROWS are constants: nothing
    // client-supplied is interpolated.
    let text = format!(
        "SELECT {CONTRACT_COLUMNS} FROM contracts_with_envelope \
         WHERE id = $1 OR seq = (SELECT parent_seq FROM contracts WHERE id = $1) \
         ORDER BY depth{lock_rows}",
        lock_rows = D::LOCK_ROWS
    );
    let rows = src.rows(&text, &[Arg::Blob(id.as_slice())]).await?;
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
pub(crate) async fn open_descendants<D: Dialect, S: Source<D>>(
    src: &mut S,
    seq: i64,
    max: usize,
) -> Result<Option<Vec<Loaded>>, sqlx::Error> {
    let mut found = Vec::new();
    let mut level = vec![seq];
    while !level.is_empty() {
        let mut children: Vec<(Vec<u8>, i64)> = Vec::new();
        for parents in level.chunks(ROWS_PER_STATEMENT) {
            // At most one past the bound: enough to know it is passed.
            let left = max
                .saturating_sub(found.len())
                .saturating_sub(children.len());
            let mut args = padded(parents.iter().map(|p| Arg::Int(*p)).collect());
            let limit = format!(" LIMIT ${}", args.len() + 1);
            let text = listed(CHILDREN_OF, args.len(), &limit);
            args.push(Arg::Int(
                i64::try_from(left.saturating_add(1)).unwrap_or(i64::MAX),
            ));
            for row in src.rows(&text, &args).await? {
                children.push((row.cell_of("id")?, row.cell_of("seq")?));
            }
            if found.len() + children.len() > max {
                return Ok(None);
            }
        }
        children.sort_unstable();
        level = Vec::with_capacity(children.len());
        for chunk in children.chunks(ROWS_PER_STATEMENT) {
            let args = padded(chunk.iter().map(|(_, seq)| Arg::Int(*seq)).collect());
            // LOCK_ROWS is a constant.
            let order = format!(" ORDER BY id{}", D::LOCK_ROWS);
            let text = listed(LOAD_BY_SEQ, args.len(), &order);
            for row in src.rows(&text, &args).await? {
                let loaded = row_from(&row)?;
                level.push(loaded.seq);
                found.push(loaded);
            }
        }
    }
    Ok(Some(found))
}

/// The head of an observations insert (`Writes::insert_rows`).
const OBSERVATIONS_INSERT: &str = "INSERT INTO observations \
    (contract_seq, kind, path, tool, units, at_ms, arguments_sha256, outcome)";

/// The open children of a level's contracts, found by the parent index:
/// `+status` keeps SQLite from planning it through
/// `contracts_open_by_deadline`. Followed by a list (`listed`).
pub(crate) const CHILDREN_OF: &str =
    "SELECT id, seq FROM contracts WHERE +status IN (1, 2) AND parent_seq IN ";
const _: () = assert!(Status::Open as i32 == 1 && Status::Accepted as i32 == 2);

/// Contract rows by key. Followed by a list (`listed`).
pub(crate) const LOAD_BY_SEQ: &str = select_contracts!("WHERE seq IN ");

/// The statement of `lineage`: `$1` the contract's seq.
pub(crate) const LINEAGE: &str = "WITH RECURSIVE up(seq, parent_seq) AS (\
         SELECT seq, parent_seq FROM contracts WHERE seq = $1 \
         UNION ALL SELECT c.seq, c.parent_seq FROM contracts c JOIN up ON c.seq = up.parent_seq) \
     SELECT c.seq, c.id, c.delegate_key FROM contracts c WHERE c.seq IN (SELECT seq FROM up) ORDER BY c.seq";

/// Ancestors root first, then the contract itself: (seq, id, delegate
/// key). The one lineage read of a command: the core's authorization and
/// the drain state both take it.
pub(crate) async fn lineage<D: Dialect, S: Source<D>>(
    src: &mut S,
    seq: i64,
) -> Result<Vec<(i64, Id, AgentKey)>, sqlx::Error> {
    let rows = src.rows(LINEAGE, &[Arg::Int(seq)]).await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.cell_of("seq")?,
                key_of(r, "id")?,
                key_of(r, "delegate_key")?,
            ))
        })
        .collect()
}

/// What the writer must do after a transition besides writing rows.
pub struct Applied {
    pub answer: Result<Answer, StoreError>,
    /// Contracts whose cached state is now stale (SQLite's writer cache;
    /// PostgreSQL caches only immutable terms).
    pub changed: Vec<Id>,
    /// A drain started or ended: which contracts issue is now different.
    pub draining_changed: bool,
    /// (root id, seq) of every receipt written: the trees that got events
    /// (SQLite's `TreeChanges`; PostgreSQL's sequencer finds them itself).
    pub events: Vec<(Id, i64)>,
    /// What the transition writes, for the writer to run before the
    /// transaction's next read and its commit (see `Writes`).
    pub writes: Writes,
}

impl Applied {
    /// An answer that wrote nothing.
    pub(crate) fn nothing(answer: Result<Answer, StoreError>) -> Self {
        Self {
            answer,
            changed: Vec::new(),
            draining_changed: false,
            events: Vec::new(),
            writes: Writes::default(),
        }
    }
}

impl Loaded {
    /// The row as the core's decision reads it; `parent` indexes the
    /// loaded subtree.
    pub(crate) fn facts(&self, parent: Option<usize>) -> Facts {
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

/// What a lifecycle write needs besides its command: who signs, where
/// its receipts' seqs come from, the writer's clock reading and the bound
/// of one drain step (`limits.cascade_step_rows`).
pub(crate) struct Writing<'a, D: Dialect> {
    pub(crate) stamper: &'a Stamper,
    pub(crate) seqs: &'a mut D::Seqs,
    pub(crate) now_ms: i64,
    pub(crate) step_rows: usize,
    /// How many rows a drain step ends (the writer's, kept across steps).
    pub(crate) pace: &'a mut super::drain::DrainPace,
    /// Whether `prior` holds every earlier answer to the batch's requests.
    /// When not (SQLite's writer skips the read for requests it has not
    /// seen lately), a command that is refused looks its request up before
    /// it is answered: a refusal writes no request-log row, so no insert
    /// would catch a retry of an earlier success.
    pub(crate) prior_read: bool,
    /// The writer knows no drain is in progress anywhere (SQLite's one
    /// writer does): the tree's drains need not be read.
    pub(crate) no_drains: bool,
}

/// Applies one lifecycle command: loads the subtree, lets the core decide,
/// writes the decision. The outer error aborts the batch; the inner one
/// refuses only this command. A decision that would end more open
/// descendants than one step (`step_rows`) starts a drain instead
/// (`drain`): nothing else is written, and the request is answered
/// `DescendantsEnding` (retry with the same nonce).
/// Nothing is written here: the decision's writes come back in
/// `Applied::writes`.
pub(crate) async fn apply<D: Dialect, S: Source<D>>(
    src: &mut S,
    command: &LifecycleCommand,
    prior: &HashMap<RequestKey, PriorRequest>,
    w: &mut Writing<'_, D>,
) -> Result<Applied, sqlx::Error> {
    if let Some(request) = &command.request
        && let Some(earlier) = prior.get(&(request.agent, request.nonce.clone()))
    {
        return Ok(Applied::nothing(crate::batch::replayed(earlier, request)));
    }
    let applied = decide::<D, S>(src, command, w).await?;
    if applied.answer.is_err()
        && !w.prior_read
        && let Some(request) = &command.request
    {
        let key = (request.agent, request.nonce.clone());
        let earlier = load_prior_requests::<D, S>(src, std::slice::from_ref(&key)).await?;
        if let Some(earlier) = earlier.get(&key) {
            // The decision's writes are dropped with it.
            return Ok(Applied::nothing(crate::batch::replayed(earlier, request)));
        }
    }
    Ok(applied)
}

/// `apply` for a command not answered before.
async fn decide<D: Dialect, S: Source<D>>(
    src: &mut S,
    command: &LifecycleCommand,
    w: &mut Writing<'_, D>,
) -> Result<Applied, sqlx::Error> {
    if matches!(command.action, Action::Drain) {
        // A drain step writes as it goes: SQLite's writer gives it
        // sqlx's connection, never its held handle (`raw::HeldSource`).
        let Some(conn) = src.connection() else {
            return Err(sqlx::Error::Protocol(
                "a drain step was given no sqlx connection".into(),
            ));
        };
        return drain::step::<D>(conn, &command.contract_id, w).await;
    }
    let Some((parent, target)) = load_locked::<D, S>(src, &command.contract_id).await? else {
        return Ok(Applied::nothing(Err(StoreError::NotFound {
            what: crate::Entity::Contract,
            id: hex::encode(command.contract_id),
        })));
    };
    let now_ms = w.now_ms;
    let action = core_action(&command.action, now_ms);
    let signer = command.request.as_ref().map(|r| &r.agent);
    // The lineage is read once, when the core needs it or the tree has a
    // drain (almost never: one indexed read of a table of drains).
    let drains = if w.no_drains {
        Vec::new()
    } else {
        drain::drains_of::<D, S>(src, target.root_seq).await?
    };
    let lineage = if action.needs_lineage() || !drains.is_empty() {
        lineage::<D, S>(src, target.seq).await?
    } else {
        Vec::new()
    };
    let ending = drain::ending_of(&drains, &lineage, target.seq);
    let lineage = lineage.into_iter().map(|(_, id, key)| (id, key)).collect();
    let (target_seq, root_seq) = (target.seq, target.root_seq);
    let mut rows: Vec<Loaded> = parent.into_iter().collect();
    rows.push(target);
    // Loaded without the open descendants first: only a decision that
    // may end the target reads them (`needs_descendants`), so a stranger's
    // request costs the writer the target, its parent and its lineage.
    let (partial, rows) = subtree(rows, target_seq, lineage, ending);
    let (subtree, rows) = if lifecycle::needs_descendants(&partial, signer, &action, now_ms) {
        match open_descendants::<D, S>(src, target_seq, w.step_rows.max(1)).await? {
            Some(descendants) => {
                let mut rows = rows;
                rows.extend(descendants);
                self::subtree(rows, target_seq, partial.lineage, ending)
            }
            None => {
                let status = lifecycle::drain_status(&action);
                let mut writes = Writes::default();
                drain::start(&mut writes, target_seq, root_seq, status, now_ms);
                return Ok(Applied {
                    draining_changed: true,
                    writes,
                    ..Applied::nothing(Err(StoreError::from(Refused::DescendantsEnding)))
                });
            }
        }
    } else {
        (partial, rows)
    };
    let decision = lifecycle::decide(&subtree, signer, &action, now_ms);
    write::<D, S>(src, &decision, subtree.target, &rows, command, w).await
}

/// The decision's rows and the target's columns (and, for a record, its
/// observations). Whatever fails when they run aborts the whole batch:
/// nothing of a half-written decision is committed.
pub(crate) fn write_state(
    writes: &mut Writes,
    decision: &Decision,
    target: &Loaded,
    rows: &[Loaded],
    command: &LifecycleCommand,
) -> Result<(), sqlx::Error> {
    for u in &decision.updates {
        writes.push(
            "UPDATE contracts SET status = $1, reserved = $2, spent = $3, open_children = $4 WHERE seq = $5",
            vec![
                i64::from(u.status.as_i32()).into(),
                u.ledger.reserved.into(),
                u.ledger.spent.into(),
                i64::from(u.ledger.open_children).into(),
                rows[u.row].seq.into(),
            ],
        );
    }
    match &decision.write {
        TargetWrite::None => {}
        TargetWrite::Host(host) => writes.push(
            "UPDATE contracts SET host_key = $1 WHERE seq = $2",
            vec![host.map(|h| h.to_vec()).into(), target.seq.into()],
        ),
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
            // Runs of power-of-two length: few statement texts (see
            // `power_chunks`), whatever the counts recorded.
            for run in super::plan::power_chunks(observations, ROWS_PER_STATEMENT) {
                writes.insert_rows(
                    OBSERVATIONS_INSERT,
                    run,
                    |o| {
                        vec![
                            target.seq.into(),
                            i64::from(o.kind as i32).into(),
                            o.path.as_str().into(),
                            o.tool.as_str().into(),
                            o.units.into(),
                            o.at_ms.into(),
                            o.arguments_sha256.map(|d| d.to_vec()).into(),
                            i64::from(o.outcome as i32).into(),
                        ]
                    },
                );
            }
            writes.push(
                "UPDATE contracts SET observations = $1, observed_units = $2, metered = $3, metered_uncharged = $4 WHERE seq = $5",
                vec![
                    (*total).into(),
                    (*observed_units).into(),
                    i64::from(*metered).into(),
                    (*metered_uncharged).into(),
                    target.seq.into(),
                ],
            );
        }
        TargetWrite::Judged {
            verdict,
            has_report,
            downgrades,
            claim,
        } => writes.push(
            "UPDATE contracts SET verdict = $1, has_report = $2, downgrades = $3, claim = $4 WHERE seq = $5",
            vec![
                i64::from(verdict.as_i32()).into(),
                i64::from(*has_report).into(),
                i64::from(*downgrades).into(),
                claim.as_str().into(),
                target.seq.into(),
            ],
        ),
        TargetWrite::StaleJudgment => writes.push(
            "UPDATE contracts SET stale_judgments = stale_judgments + 1 WHERE seq = $1",
            vec![target.seq.into()],
        ),
        TargetWrite::Verdict(verdict) => writes.push(
            "UPDATE contracts SET verdict = $1 WHERE seq = $2",
            vec![i64::from(verdict.as_i32()).into(), target.seq.into()],
        ),
    }
    Ok(())
}

/// Signs the decision's receipts in order and writes them, logging the
/// request beside the one that answers it; returns them with their
/// (root id, seq). Reads only to reserve seqs (PostgreSQL).
pub(crate) async fn write_receipts<D: Dialect, S: Source<D>>(
    src: &mut S,
    writes: &mut Writes,
    decision: &Decision,
    rows: &[Loaded],
    command: &LifecycleCommand,
    w: &mut Writing<'_, D>,
) -> Result<(Vec<(broker_wire::stamp::Stamped, Decided)>, Vec<(Id, i64)>), sqlx::Error> {
    src.reserve_seqs(w.seqs, decision.receipts.len()).await?;
    let mut signed = Vec::with_capacity(decision.receipts.len());
    let mut events = Vec::with_capacity(decision.receipts.len());
    for planned in &decision.receipts {
        let row = &rows[planned.row];
        let request = command.request.as_ref().filter(|_| planned.answers_request);
        let mut receipt = broker_wire::stamp::lifecycle_receipt(&planned.body);
        receipt.broker_key_id = w.stamper.key_id().to_owned();
        receipt.contract_id = row.id.to_vec();
        receipt.root_id = row.root_id.to_vec();
        receipt.at_ms = w.now_ms;
        if let Some(request) = request {
            receipt.request_digest = request.digest.to_vec();
            receipt.requester_public_key = request.agent.to_vec();
        }
        let stamped = w.stamper.sign_receipt(&receipt);
        let seq = w.seqs.take();
        events.push((row.root_id, seq));
        writes.push(
            "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            vec![
                seq.into(),
                stamped.id.as_slice().into(),
                i64::from(receipt.kind).into(),
                row.seq.into(),
                row.id.as_slice().into(),
                row.root_id.as_slice().into(),
                stamped.envelope.encode_to_vec().into(),
                w.now_ms.into(),
            ],
        );
        if let Some(request) = request {
            writes.push(
                "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                vec![
                    request.agent.as_slice().into(),
                    request.nonce.as_slice().into(),
                    request.digest.as_slice().into(),
                    OUTCOME_RECEIPT.into(),
                    stamped.id.as_slice().into(),
                    w.now_ms.into(),
                ],
            );
        }
        signed.push((stamped, Decided::of(&receipt)));
    }
    Ok((signed, events))
}

/// Writes `decision` about the contract at `rows[target]`: rows, the
/// target's columns, observations, receipts (with the request's log entry
/// beside the one that answers it).
async fn write<D: Dialect, S: Source<D>>(
    src: &mut S,
    decision: &Decision,
    target: usize,
    rows: &[Loaded],
    command: &LifecycleCommand,
    w: &mut Writing<'_, D>,
) -> Result<Applied, sqlx::Error> {
    let mut writes = Writes::default();
    write_state(&mut writes, decision, &rows[target], rows, command)?;
    let (signed, events) =
        write_receipts::<D, S>(src, &mut writes, decision, rows, command, w).await?;
    let changed = decision
        .changed(target)
        .into_iter()
        .map(|i| rows[i].id)
        .collect();
    let answer = match &decision.answer {
        Ok(i) => Ok(Answer {
            outcome: Outcome::Receipt {
                receipt_id: signed[*i].0.id,
                envelope: signed[*i].0.envelope.clone(),
                decided: signed[*i].1.clone(),
            },
            replayed: false,
        }),
        Err(why) => Err(StoreError::from(why.clone())),
    };
    Ok(Applied {
        answer,
        changed,
        draining_changed: false,
        events,
        writes,
    })
}
