//! Lifecycle transitions after issuance, applied by the store's writer
//! inside its batch transaction: who may act (core rules), the contract
//! subtree loaded into the core's `lifecycle::Tree` so ending, cascading
//! and settlement use the very same arithmetic the property tests check,
//! the completion judged by `core::judge`, and one signed receipt per
//! transition.

use std::collections::HashMap;

use prost::Message;
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, QueryBuilder, Row, Sqlite};

use super::batch::{OUTCOME_REFUSED, PriorRequest, RequestKey};
use super::{Answer, Outcome, StoreError};
use crate::core::judge::{self, Verdict};
use crate::core::lifecycle::{
    self, Consumption, Ended, Event, HostChoice, LifecycleError, Node, Tree,
};
use crate::core::limits::{MAX_BUDGET_UNITS, MAX_OBSERVATIONS_PER_CONTRACT};
use crate::core::{AgentKey, Id, Ledger, Scope, Status};
use crate::crypto;
use crate::pb;
use crate::stamp::{RequestMeta, Stamper};

/// A lifecycle request, validated by the service.
#[derive(Clone, Debug)]
pub struct LifecycleCommand {
    /// The signed request; `None` for the broker's own expiry sweep.
    pub request: Option<RequestMeta>,
    pub contract_id: Id,
    pub action: Action,
}

#[derive(Clone, Debug)]
pub enum Action {
    Accept { host: Option<AgentKey> },
    Decline { reason: String },
    Complete(Box<CompleteArgs>),
    Adjudicate { verdict: Verdict, reason: String },
    Escalate { reason: String },
    Revoke { reason: String },
    Record { observations: Vec<ObservationIn> },
    Expire,
}

#[derive(Clone, Debug)]
pub struct CompleteArgs {
    /// The output exactly as sent (its digest is receipted).
    pub output_json: String,
    pub output: serde_json::Value,
    pub has_report: bool,
    pub claim: String,
    pub reported_consumed: i64,
    /// When the broker received the completion: `result.elapsed_ms` is
    /// measured to here, wherever and whenever it is judged (queueing in
    /// the broker does not count against the delegate). `None`: when the
    /// writer handles it.
    pub received_at_ms: Option<i64>,
    /// Judged before the command reached the writer (see `JudgeInputs`);
    /// `None` and the writer judges.
    pub prejudged: Option<PreJudged>,
}

/// A completion judged outside the writer, so that schema validation and
/// CEL evaluation never hold up everyone's writes.
#[derive(Clone, Debug)]
pub struct PreJudged {
    /// The contract's observation count the judgment saw. Observations are
    /// the only input of a judgment that changes after issuance (the
    /// predicate, scope and schema are sealed in the contract, and elapsed
    /// time is measured to `CompleteArgs::received_at_ms`), so the writer
    /// uses the judgment only if the count is still this.
    pub observations: i64,
    pub judgment: judge::Judgment,
}

/// Everything judging a completion of one contract reads from the store,
/// loaded on a read connection.
pub struct JudgeInputs {
    observations: i64,
    effective_predicate: String,
    write_scope: Scope,
    result_schema_json: String,
    observed: judge::Observed,
}

impl JudgeInputs {
    /// Loads the inputs for judging `signer`'s completion of `id`, received
    /// at `received_at_ms`; `None` unless the contract exists, is open, is
    /// not overdue and `signer` is its delegate — anything else the writer
    /// refuses without judging, so nobody else can make the broker judge.
    pub async fn load(
        conn: &mut SqliteConnection,
        id: &Id,
        signer: &AgentKey,
        received_at_ms: i64,
    ) -> Result<Option<Self>, sqlx::Error> {
        let Some(target) = load(conn, id).await? else {
            return Ok(None);
        };
        if !target.status.is_open()
            || target.delegate_key != *signer
            || received_at_ms >= target.deadline_ms
        {
            return Ok(None);
        }
        let observed = observed(conn, &target, received_at_ms).await?;
        Ok(Some(Self {
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

/// One validated host observation.
#[derive(Clone, Debug)]
pub struct ObservationIn {
    pub kind: pb::ObservationKind,
    pub path: String,
    pub tool: String,
    pub units: i64,
    pub at_ms: i64,
}

/// A contract row as lifecycle needs it.
#[derive(Clone, Debug)]
struct Loaded {
    seq: i64,
    id: Id,
    parent_seq: Option<i64>,
    status: Status,
    ledger: Ledger,
    deadline_ms: i64,
    issued_at_ms: i64,
    delegate_key: AgentKey,
    host_key: Option<AgentKey>,
    verdict: i32,
    observations: i64,
    observed_units: i64,
    metered: bool,
    /// Metered units recorded but not charged (see `metering_charge`).
    metered_uncharged: i64,
    effective_predicate: String,
    write_scope: Scope,
    root_id: Id,
    contract: pb::Contract,
}

const COLUMNS: &str = "seq, id, root_id, parent_seq, status, budget, reserved, spent, open_children, \
     deadline_ms, issued_at_ms, delegate_key, host_key, verdict, observations, observed_units, \
     metered, metered_uncharged, effective_predicate, write_scope, envelope";

fn corrupt(what: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!("corrupt contract row: {what}"))
}

fn key(bytes: Vec<u8>, what: &str) -> Result<[u8; 32], sqlx::Error> {
    bytes.try_into().map_err(|_| corrupt(what))
}

fn row_from(row: &SqliteRow) -> Result<Loaded, sqlx::Error> {
    let status: i64 = row.try_get("status")?;
    let open_children: i64 = row.try_get("open_children")?;
    let host: Option<Vec<u8>> = row.try_get("host_key")?;
    let scope: String = row.try_get("write_scope")?;
    let envelope: Vec<u8> = row.try_get("envelope")?;
    let envelope = pb::Sealed::decode(envelope.as_slice()).map_err(|_| corrupt("envelope"))?;
    let contract =
        pb::Contract::decode(envelope.payload.as_slice()).map_err(|_| corrupt("payload"))?;
    let metered: i64 = row.try_get("metered")?;
    Ok(Loaded {
        seq: row.try_get("seq")?,
        id: key(row.try_get("id")?, "id")?,
        root_id: key(row.try_get("root_id")?, "root_id")?,
        parent_seq: row.try_get("parent_seq")?,
        status: i32::try_from(status)
            .ok()
            .and_then(Status::from_i32)
            .ok_or_else(|| corrupt("status"))?,
        ledger: Ledger {
            budget: row.try_get("budget")?,
            reserved: row.try_get("reserved")?,
            spent: row.try_get("spent")?,
            open_children: u32::try_from(open_children).map_err(|_| corrupt("open_children"))?,
        },
        deadline_ms: row.try_get("deadline_ms")?,
        issued_at_ms: row.try_get("issued_at_ms")?,
        delegate_key: key(row.try_get("delegate_key")?, "delegate_key")?,
        host_key: host.map(|h| key(h, "host_key")).transpose()?,
        verdict: i32::try_from(row.try_get::<i64, _>("verdict")?)
            .map_err(|_| corrupt("verdict"))?,
        observations: row.try_get("observations")?,
        observed_units: row.try_get("observed_units")?,
        metered: metered != 0,
        metered_uncharged: row.try_get("metered_uncharged")?,
        effective_predicate: row.try_get("effective_predicate")?,
        write_scope: Scope::from_trusted(
            serde_json::from_str(&scope).map_err(|_| corrupt("write_scope"))?,
        ),
        contract,
    })
}

async fn load(conn: &mut SqliteConnection, id: &Id) -> Result<Option<Loaded>, sqlx::Error> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM contracts_with_envelope WHERE id = $1"
    )))
    .bind(id.as_slice())
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(row_from).transpose()
}

async fn load_seq(conn: &mut SqliteConnection, seq: i64) -> Result<Loaded, sqlx::Error> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM contracts_with_envelope WHERE seq = $1"
    )))
    .bind(seq)
    .fetch_one(&mut *conn)
    .await?;
    row_from(&row)
}

/// Open strict descendants of `seq` (ended contracts have no open
/// descendants: ending cascades).
async fn open_descendants(
    conn: &mut SqliteConnection,
    seq: i64,
) -> Result<Vec<Loaded>, sqlx::Error> {
    // COLUMNS is a constant: nothing client-supplied is interpolated.
    let rows = sqlx::query(AssertSqlSafe(format!(
        "WITH RECURSIVE sub(seq) AS (\
             SELECT seq FROM contracts WHERE parent_seq = $1 AND status IN ($2, $3) \
             UNION ALL SELECT c.seq FROM contracts c JOIN sub ON c.parent_seq = sub.seq \
             WHERE c.status IN ($2, $3)) \
         SELECT {COLUMNS} FROM contracts_with_envelope WHERE seq IN (SELECT seq FROM sub)"
    )))
    .bind(seq)
    .bind(i64::from(Status::Open.as_i32()))
    .bind(i64::from(Status::Accepted.as_i32()))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(row_from).collect()
}

/// Ancestors root first, then the contract itself: (id, delegate key).
async fn lineage(
    conn: &mut SqliteConnection,
    seq: i64,
) -> Result<Vec<(Id, AgentKey)>, sqlx::Error> {
    let rows = sqlx::query(
        "WITH RECURSIVE up(seq, parent_seq) AS (\
             SELECT seq, parent_seq FROM contracts WHERE seq = $1 \
             UNION ALL SELECT c.seq, c.parent_seq FROM contracts c JOIN up ON c.seq = up.parent_seq) \
         SELECT c.id, c.delegate_key FROM contracts c WHERE c.seq IN (SELECT seq FROM up) ORDER BY c.seq",
    )
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok((
                key(r.try_get("id")?, "id")?,
                key(r.try_get("delegate_key")?, "delegate_key")?,
            ))
        })
        .collect()
}

fn denied(reason: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::PermissionDenied {
        reason,
        detail: detail.into(),
    }
}

fn precondition(reason: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::FailedPrecondition {
        reason,
        detail: detail.into(),
    }
}

fn lifecycle_error(e: &LifecycleError) -> StoreError {
    match e {
        LifecycleError::Late { .. } => precondition("LATE", e.to_string()),
        LifecycleError::NotAllowed { .. } | LifecycleError::NotDue { .. } => {
            precondition("WRONG_STATE", e.to_string())
        }
    }
}

/// What the writer must do after a transition besides writing rows.
pub struct Applied {
    pub answer: Result<Answer, StoreError>,
    /// Contracts whose cached state is now stale.
    pub changed: Vec<Id>,
}

/// The subtree of one transition in the core's model, with the map back
/// to rows.
struct Model {
    tree: Tree,
    rows: Vec<Loaded>,
    target: usize,
}

/// Loads `target`'s parent, itself and its open descendants into the
/// core's model. Metered units are already in every `spent` (charged as
/// they were recorded), so loading charges nothing.
async fn model(conn: &mut SqliteConnection, target: Loaded) -> Result<Model, sqlx::Error> {
    let mut rows = Vec::new();
    if let Some(parent_seq) = target.parent_seq {
        rows.push(load_seq(conn, parent_seq).await?);
    }
    let target_seq = target.seq;
    rows.push(target);
    rows.extend(open_descendants(conn, target_seq).await?);
    let index: HashMap<i64, usize> = rows.iter().enumerate().map(|(i, r)| (r.seq, i)).collect();
    let mut nodes: Vec<Node> = rows
        .iter()
        .map(|r| Node {
            parent: r.parent_seq.and_then(|p| index.get(&p).copied()),
            children: Vec::new(),
            status: r.status,
            deadline_ms: r.deadline_ms,
            ledger: r.ledger,
        })
        .collect();
    for i in 0..nodes.len() {
        if let Some(p) = nodes[i].parent {
            nodes[p].children.push(i);
        }
    }
    let target = index[&target_seq];
    Ok(Model {
        tree: Tree::from_nodes(nodes),
        rows,
        target,
    })
}

/// Writes back every row whose status or ledger the model changed, and
/// signs a receipt for every open descendant the transition ended with its
/// target (a receipt per transition; Watch streams of those subtrees see
/// it).
async fn write_back(
    conn: &mut SqliteConnection,
    model: &Model,
    ended: &[Ended],
    receipting: &mut Receipting<'_>,
    changed: &mut Vec<Id>,
) -> Result<(), sqlx::Error> {
    let cause = model.rows[model.target].id;
    for e in ended.iter().filter(|e| e.id != model.target) {
        let row = &model.rows[e.id];
        let kind = if e.status == Status::Expired {
            pb::ReceiptKind::Expired
        } else {
            pb::ReceiptKind::Revoked
        };
        let receipt = pb::Receipt {
            kind: kind as i32,
            reason: format!("ended with its ancestor {}", hex::encode(cause)),
            revoked_ids: vec![row.id.to_vec()],
            ..Default::default()
        };
        receipting.record(conn, row, None, receipt).await?;
    }
    for (row, node) in model.rows.iter().zip(model.tree.nodes()) {
        if row.status != node.status || row.ledger != node.ledger {
            sqlx::query(
                "UPDATE contracts SET status = $1, reserved = $2, spent = $3, open_children = $4 WHERE seq = $5",
            )
            .bind(i64::from(node.status.as_i32()))
            .bind(node.ledger.reserved)
            .bind(node.ledger.spent)
            .bind(i64::from(node.ledger.open_children))
            .bind(row.seq)
            .execute(&mut *conn)
            .await?;
            changed.push(row.id);
        }
    }
    Ok(())
}

struct Receipting<'a> {
    stamper: &'a Stamper,
    trees: &'a super::TreeChanges,
    next_seq: &'a mut i64,
    now_ms: i64,
}

impl Receipting<'_> {
    /// Signs and stores a receipt about `target`.
    async fn record(
        &mut self,
        conn: &mut SqliteConnection,
        target: &Loaded,
        request: Option<&RequestMeta>,
        mut receipt: pb::Receipt,
    ) -> Result<(Id, pb::Sealed), sqlx::Error> {
        receipt.broker_key_id = self.stamper.key_id().to_owned();
        receipt.contract_id = target.id.to_vec();
        receipt.root_id = root_id(target).to_vec();
        receipt.at_ms = self.now_ms;
        if let Some(request) = request {
            receipt.request_digest = request.digest.to_vec();
            receipt.requester_public_key = request.agent.to_vec();
        }
        let stamped = self.stamper.sign_receipt(&receipt);
        let seq = *self.next_seq;
        *self.next_seq += 1;
        self.trees.touch(root_id(target), seq);
        sqlx::query(
            "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(seq)
        .bind(stamped.id.as_slice())
        .bind(i64::from(receipt.kind))
        .bind(target.seq)
        .bind(target.id.as_slice())
        .bind(receipt.root_id.as_slice())
        .bind(stamped.envelope.encode_to_vec())
        .bind(self.now_ms)
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
            .bind(OUTCOME_REFUSED)
            .bind(stamped.id.as_slice())
            .bind(self.now_ms)
            .execute(&mut *conn)
            .await?;
        }
        Ok((stamped.id, stamped.envelope))
    }
}

fn root_id(row: &Loaded) -> Id {
    // A root's row names itself.
    row.root_id
}

fn answer(id: Id, envelope: pb::Sealed) -> Result<Answer, StoreError> {
    Ok(Answer {
        outcome: Outcome::Receipt {
            receipt_id: id,
            envelope,
        },
        replayed: false,
    })
}

/// Contracts a transition ended: the target first, then the open
/// descendants it ended (`Tree::end` reports them deepest first; reversed,
/// every contract comes before its descendants).
fn ended_ids(model: &Model, ended: &[Ended]) -> Vec<Vec<u8>> {
    let mut ids: Vec<Vec<u8>> = ended
        .iter()
        .rev()
        .map(|e| model.rows[e.id].id.to_vec())
        .collect();
    ids.dedup();
    ids
}

/// Applies one lifecycle command. The outer error aborts the batch; the
/// inner one refuses only this command.
pub async fn apply(
    conn: &mut SqliteConnection,
    command: &LifecycleCommand,
    prior: &HashMap<RequestKey, PriorRequest>,
    stamper: &Stamper,
    trees: &super::TreeChanges,
    next_seq: &mut i64,
    now_ms: i64,
) -> Result<Applied, sqlx::Error> {
    let mut changed = Vec::new();
    if let Some(request) = &command.request
        && let Some(earlier) = prior.get(&(request.agent, request.nonce.clone()))
    {
        return Ok(Applied {
            answer: super::batch::replayed(earlier, request),
            changed,
        });
    }
    let Some(target) = load(conn, &command.contract_id).await? else {
        return refused(StoreError::NotFound {
            what: "contract",
            id: hex::encode(command.contract_id),
        });
    };
    let mut receipting = Receipting {
        stamper,
        trees,
        next_seq,
        now_ms,
    };
    let request = command.request.as_ref();

    // Expiry on access: an open contract past its deadline expires now
    // (its reservation returns), whatever was asked of it.
    let overdue = target.status.is_open() && now_ms >= target.deadline_ms;
    if overdue && !matches!(command.action, Action::Revoke { .. }) {
        let mut model = model(conn, target.clone()).await?;
        let ended = match model.tree.expire(model.target, now_ms) {
            Ok(ended) => ended,
            Err(e) => {
                return refused(StoreError::Corrupt(e.to_string()));
            }
        };
        write_back(conn, &model, &ended, &mut receipting, &mut changed).await?;
        let revoked_ids = ended_ids(&model, &ended);
        let (id, envelope) = receipting
            .record(
                conn,
                &target,
                None,
                pb::Receipt {
                    kind: pb::ReceiptKind::Expired as i32,
                    revoked_ids,
                    ..Default::default()
                },
            )
            .await?;
        let answer = match command.action {
            Action::Expire => answer(id, envelope),
            _ => Err(precondition(
                "LATE",
                format!(
                    "the contract's deadline {} passed; it has expired",
                    target.deadline_ms
                ),
            )),
        };
        return Ok(Applied { answer, changed });
    }

    let signer = request.map(|r| r.agent);
    let is_delegate = signer == Some(target.delegate_key);
    let answer = match &command.action {
        Action::Expire => {
            // Not (or no longer) due: the sweeper raced with a completion.
            Err(precondition("WRONG_STATE", "the contract is not overdue"))
        }
        Action::Accept { host } => {
            if !is_delegate {
                return refused(denied(
                    "NOT_DELEGATE",
                    "only the contract's delegate may accept it",
                ));
            }
            let host_key = match (target.host_key, host) {
                (Some(named), Some(asked)) if named != *asked => {
                    return refused(precondition(
                        "HOST_MISMATCH",
                        "the contract already names another host",
                    ));
                }
                (named, asked) => named.or(*asked),
            };
            // A delegate that is its own host would judge itself.
            if host_key == Some(target.delegate_key) {
                return refused(precondition(
                    "HOST_IS_DELEGATE",
                    "the host must be a key other than the delegate's",
                ));
            }
            let mut model = model(conn, target.clone()).await?;
            if let Err(e) = model.tree.accept(model.target, now_ms) {
                return refused(tree_error(&e));
            }
            write_back(conn, &model, &[], &mut receipting, &mut changed).await?;
            sqlx::query("UPDATE contracts SET host_key = $1 WHERE seq = $2")
                .bind(host_key.map(|h| h.to_vec()))
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
            let (id, envelope) = receipting
                .record(
                    conn,
                    &target,
                    request,
                    pb::Receipt {
                        kind: pb::ReceiptKind::Accepted as i32,
                        ..Default::default()
                    },
                )
                .await?;
            answer(id, envelope)
        }
        Action::Decline { reason } | Action::Escalate { reason } => {
            let escalate = matches!(command.action, Action::Escalate { .. });
            if !is_delegate {
                return refused(denied(
                    "NOT_DELEGATE",
                    "only the contract's delegate may do this",
                ));
            }
            if target.parent_seq.is_none() {
                return refused(precondition(
                    "ROOT",
                    "a root has no principal to return it to",
                ));
            }
            let mut model = model(conn, target.clone()).await?;
            let result = if escalate {
                model.tree.escalate(model.target, now_ms)
            } else {
                model.tree.decline(model.target, now_ms)
            };
            let ended = match result {
                Ok(ended) => ended,
                Err(e) => {
                    return refused(tree_error(&e));
                }
            };
            write_back(conn, &model, &ended, &mut receipting, &mut changed).await?;
            let mut receipt = pb::Receipt {
                kind: if escalate {
                    pb::ReceiptKind::Escalated
                } else {
                    pb::ReceiptKind::Declined
                } as i32,
                reason: reason.clone(),
                revoked_ids: ended_ids(&model, &ended),
                ..Default::default()
            };
            if escalate {
                // The principal is the parent: model index 0.
                let principal = &model.tree.nodes()[0];
                let notice = principal.ledger.escalation_notice(
                    principal.deadline_ms,
                    now_ms,
                    target.contract.min_retry_cost,
                    target.contract.min_retry_latency_ms,
                );
                receipt.escalation = Some(pb::EscalationNotice {
                    principal_residual: notice.residual,
                    principal_deadline_ms: notice.deadline_ms,
                    retry_feasible: notice.retry_feasible,
                    reason: reason.clone(),
                });
            }
            let (id, envelope) = receipting.record(conn, &target, request, receipt).await?;
            answer(id, envelope)
        }
        Action::Revoke { reason } => {
            let lineage = lineage(conn, target.seq).await?;
            // Principals: the delegates of every strict ancestor; for a root,
            // the orchestrator that opened it.
            let mut principals: Vec<AgentKey> = lineage
                .iter()
                .filter(|(id, _)| *id != target.id)
                .map(|(_, k)| *k)
                .collect();
            if target.parent_seq.is_none() {
                principals.push(target.delegate_key);
            }
            if !signer.is_some_and(|s| lifecycle::may_revoke(&s, principals.iter())) {
                return refused(denied(
                    "NOT_ANCESTOR",
                    "only the holder of an ancestor contract may revoke it",
                ));
            }
            let mut model = model(conn, target.clone()).await?;
            let ended = match model.tree.revoke(model.target, now_ms) {
                Ok(ended) => ended,
                Err(e) => {
                    return refused(tree_error(&e));
                }
            };
            write_back(conn, &model, &ended, &mut receipting, &mut changed).await?;
            let receipt = pb::Receipt {
                kind: pb::ReceiptKind::Revoked as i32,
                reason: reason.clone(),
                revoked_ids: ended_ids(&model, &ended),
                ..Default::default()
            };
            let (id, envelope) = receipting.record(conn, &target, request, receipt).await?;
            answer(id, envelope)
        }
        Action::Record { observations } => {
            if target.host_key.is_none() || signer != target.host_key {
                return refused(denied(
                    "NOT_HOST",
                    "only the contract's host may record observations",
                ));
            }
            if !target.status.is_open() {
                return refused(precondition(
                    "ENDED",
                    format!("the contract is {}", target.status.as_str()),
                ));
            }
            let total = target.observations + observations.len() as i64;
            if total > MAX_OBSERVATIONS_PER_CONTRACT {
                return refused(StoreError::Overloaded("MAX_OBSERVATIONS_PER_CONTRACT"));
            }
            // Each unit count is at most MAX_BUDGET_UNITS (validated); the
            // total per contract is capped too, so ending it can always settle.
            let units = observations
                .iter()
                .fold(0i64, |sum, o| sum.saturating_add(o.units));
            let metered_total = target.observed_units.saturating_add(units);
            if metered_total > MAX_BUDGET_UNITS {
                return refused(precondition(
                    "METERED_LIMIT",
                    format!("metered units would exceed {MAX_BUDGET_UNITS} for one contract"),
                ));
            }
            let metered = target.metered || observations.iter().any(|o| o.units > 0);
            // Metered units leave the residual now (issue 11, item 2); the
            // contract's end charges nothing of them again. A host the
            // delegate chose is charged only up to the residual.
            let host = if target.contract.host_public_key.is_empty() {
                HostChoice::Delegate
            } else {
                HostChoice::Principal
            };
            let (charged, uncharged) = lifecycle::metering_charge(&target.ledger, units, host);
            let mut ledger = target.ledger;
            if let Err(e) = ledger.charge(charged) {
                return refused(StoreError::Corrupt(format!("metering: {e}")));
            }
            let metered_uncharged = target.metered_uncharged.saturating_add(uncharged);
            let mut query = QueryBuilder::<Sqlite>::new(
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
            sqlx::query("UPDATE contracts SET observations = $1, observed_units = $2, metered = $3, spent = $4, metered_uncharged = $5 WHERE seq = $6")
                .bind(total)
                .bind(metered_total)
                .bind(i64::from(metered))
                .bind(ledger.spent)
                .bind(metered_uncharged)
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
            if ledger != target.ledger {
                changed.push(target.id);
            }
            let receipt = pb::Receipt {
                kind: pb::ReceiptKind::Observed as i32,
                observations: u32::try_from(observations.len()).unwrap_or(u32::MAX),
                ..Default::default()
            };
            let (id, envelope) = receipting.record(conn, &target, request, receipt).await?;
            answer(id, envelope)
        }
        Action::Complete(args) => {
            if !is_delegate {
                return refused(denied(
                    "NOT_DELEGATE",
                    "only the contract's delegate may complete it",
                ));
            }
            let mut model = model(conn, target.clone()).await?;
            if let Err(e) =
                lifecycle::transition(target.status, Event::Complete, target.deadline_ms, now_ms)
            {
                return refused(lifecycle_error(&e));
            }
            // The writer never judges (issue 11, item 9): a judgment made
            // before host observations it has not seen goes back to be
            // made again, off the writer.
            let received_at_ms = args.received_at_ms.unwrap_or(now_ms);
            let judgment = match &args.prejudged {
                Some(pre) if pre.observations == target.observations => pre.judgment.clone(),
                _ => return refused(StoreError::StaleJudgment),
            };
            let consumption = if target.metered {
                Consumption::Metered
            } else {
                Consumption::Reported(judgment.consumed)
            };
            let ended = match model.tree.complete(model.target, consumption, now_ms) {
                Ok(ended) => ended,
                Err(e) => {
                    return refused(tree_error(&e));
                }
            };
            write_back(conn, &model, &ended, &mut receipting, &mut changed).await?;
            sqlx::query(
                "UPDATE contracts SET verdict = $1, has_report = $2, downgrades = $3, claim = $4 WHERE seq = $5",
            )
            .bind(i64::from(judgment.verdict.as_i32()))
            .bind(i64::from(args.has_report))
            .bind(i64::try_from(judgment.refused.len()).unwrap_or(i64::MAX))
            .bind(args.claim.as_str())
            .bind(target.seq)
            .execute(&mut *conn)
            .await?;
            let own = ended.iter().find(|e| e.id == model.target);
            let lineage = lineage(conn, target.seq).await?;
            let receipt = pb::Receipt {
                kind: pb::ReceiptKind::Completed as i32,
                revoked_ids: ended_ids(&model, &ended).into_iter().skip(1).collect(),
                completion: Some(pb::Completion {
                    verdict: judgment.verdict.as_i32(),
                    refused_criteria: judgment
                        .refused
                        .iter()
                        .map(|r| pb::RefusedCriterion {
                            criterion: r.text.clone(),
                            reason: r.reason.clone(),
                        })
                        .collect(),
                    claim: args.claim.clone(),
                    has_report: args.has_report,
                    result_digest: crypto::sha256(args.output_json.as_bytes()).to_vec(),
                    consumed: if target.metered {
                        judgment.consumed.saturating_sub(target.metered_uncharged)
                    } else {
                        own.map_or(0, |e| e.charged_at_end)
                    },
                    claimed_excess: if target.metered {
                        target.metered_uncharged
                    } else {
                        own.map_or(0, |e| e.unverified_excess)
                    },
                    overspend: own.and_then(|e| e.overspend).map_or(0, |o| o.excess),
                    returned: own.and_then(|e| e.settlement).map_or(0, |s| s.returned),
                    schema_valid: judgment.schema_valid,
                    within_scope: judgment.within_scope,
                    out_of_scope_paths: judgment.out_of_scope_paths.clone(),
                    out_of_scope_path_count: judgment.out_of_scope_path_count,
                    attribution: Some(pb::Attribution {
                        agent_public_key: target.delegate_key.to_vec(),
                        depth: target.contract.depth,
                        chain: lineage.iter().map(|(id, _)| id.to_vec()).collect(),
                    }),
                    elapsed_ms: received_at_ms.saturating_sub(target.issued_at_ms),
                }),
                ..Default::default()
            };
            let (id, envelope) = receipting.record(conn, &target, request, receipt).await?;
            answer(id, envelope)
        }
        Action::Adjudicate { verdict, reason } => {
            let principal = match target.parent_seq {
                Some(p) => load_seq(conn, p).await?.delegate_key,
                None => target.delegate_key,
            };
            if signer != Some(principal) {
                return refused(denied(
                    "NOT_PRINCIPAL",
                    "only the contract's principal may adjudicate it",
                ));
            }
            if target.status != Status::Completed
                || target.verdict != Verdict::PendingPrincipal.as_i32()
            {
                return refused(precondition(
                    "NOT_PENDING",
                    "only a completed contract awaiting the principal's verdict can be adjudicated",
                ));
            }
            sqlx::query("UPDATE contracts SET verdict = $1 WHERE seq = $2")
                .bind(i64::from(verdict.as_i32()))
                .bind(target.seq)
                .execute(&mut *conn)
                .await?;
            changed.push(target.id);
            let receipt = pb::Receipt {
                kind: pb::ReceiptKind::Adjudicated as i32,
                reason: reason.clone(),
                completion: Some(pb::Completion {
                    verdict: verdict.as_i32(),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let (id, envelope) = receipting.record(conn, &target, request, receipt).await?;
            answer(id, envelope)
        }
    };
    Ok(Applied { answer, changed })
}

/// Refuses the command before it wrote anything.
fn refused(error: StoreError) -> Result<Applied, sqlx::Error> {
    Ok(Applied {
        answer: Err(error),
        changed: Vec::new(),
    })
}

fn tree_error(e: &lifecycle::TreeError) -> StoreError {
    match e {
        lifecycle::TreeError::Lifecycle(l) => lifecycle_error(l),
        other => StoreError::Corrupt(other.to_string()),
    }
}

/// What the host recorded for `target`.
async fn observed(
    conn: &mut SqliteConnection,
    target: &Loaded,
    now_ms: i64,
) -> Result<judge::Observed, sqlx::Error> {
    let rows =
        sqlx::query("SELECT kind, path FROM observations WHERE contract_seq = $1 ORDER BY seq")
            .bind(target.seq)
            .fetch_all(&mut *conn)
            .await?;
    let mut tool_calls = 0;
    let mut mutation_paths = Vec::new();
    for row in rows {
        let kind: i64 = row.try_get("kind")?;
        if kind == pb::ObservationKind::ToolCall as i64 {
            tool_calls += 1;
        } else if kind == pb::ObservationKind::Mutation as i64 {
            mutation_paths.push(row.try_get("path")?);
        }
    }
    Ok(judge::Observed {
        tool_calls,
        mutation_paths,
        consumed_by_host: target.metered.then_some(target.observed_units),
        elapsed_ms: now_ms.saturating_sub(target.issued_at_ms),
    })
}
