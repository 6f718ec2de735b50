//! Group-commit planning, shared by every backend: given a batch of
//! commands, the requests already answered and the contracts they touch,
//! decide every command in order — each seeing the effects of the ones
//! before it — and produce the rows to write. No SQL here: a backend loads
//! what `needs` names, calls `plan`, writes the rows and commits.

use std::collections::HashMap;

use prost::Message;

pub use super::known::{KNOWN_ENTRY_OVERHEAD_BYTES, Known, KnownMap, RowVersion};
use super::{Answer, Outcome, StoreError};
use broker_domain::{
    self, AgentKey, Id, Ledger, Liability, ParentView, Policy, Predicate, Scope, Status,
};
use broker_wire::command::{NewChild, NewRoot, RequestMeta};
use broker_wire::pb;
use broker_wire::stamp::{StampedContract, Stamper};

/// Outcome codes of the `requests` table.
pub const OUTCOME_ISSUED: i64 = 1;
/// The request was answered by a signed receipt: a refusal at Delegate or
/// a lifecycle transition.
pub const OUTCOME_RECEIPT: i64 = 2;

/// Where a batch's contract and receipt numbers come from: SQLite's
/// single writer counts (`i64`), PostgreSQL writers take numbers the
/// database reserved for their transaction.
pub trait SeqSource {
    /// The next unused number.
    fn take(&mut self) -> i64;
}

impl SeqSource for i64 {
    fn take(&mut self) -> i64 {
        let seq = *self;
        *self += 1;
        seq
    }
}

/// A child stamped speculatively, off the writer, from the parent as it
/// was last committed. The writer uses it only when its own authoritative
/// check yields the same terms.
pub struct Speculation {
    pub terms: broker_domain::ChildTerms,
    pub stamped: StampedContract,
}

impl Speculation {
    /// Checks and stamps `child` against `parent` as it was last seen,
    /// through the same check the writer runs (`delegate`); `None` when
    /// that check refuses.
    pub fn new(
        parent: &ParentView,
        child: &NewChild,
        stamper: &Stamper,
        now_ms: i64,
    ) -> Option<Box<Self>> {
        let terms = broker_domain::check_delegation(parent, &child.ask, now_ms).ok()?;
        let stamped = stamper.child(&parent.intent_lineage_hash, child, &terms, now_ms);
        Some(Box::new(Self { terms, stamped }))
    }
}

/// A mutating command.
pub enum Command {
    /// A root and its stamp: a root depends on no stored state, so the
    /// caller signs it and the writer only assigns its sequence number.
    OpenRoot(Box<NewRoot>, Box<StampedContract>),
    Delegate(Box<NewChild>, Option<Box<Speculation>>),
    /// Applied after the batch's issuances (see `super::lifecycle`): within
    /// one batch, commands were concurrent, so any order is a valid one.
    Lifecycle(Box<broker_wire::command::LifecycleCommand>),
}

impl Command {
    pub fn request(&self) -> Option<&RequestMeta> {
        match self {
            Command::OpenRoot(r, _) => Some(&r.request),
            Command::Delegate(c, _) => Some(&c.request),
            Command::Lifecycle(l) => l.request.as_ref(),
        }
    }
}

/// An earlier answered request, as loaded for idempotent replay.
#[derive(Clone, Debug)]
pub struct PriorRequest {
    pub digest: [u8; 32],
    pub outcome: i64,
    pub ref_id: Id,
    pub envelope: pb::Sealed,
}

pub type RequestKey = (AgentKey, Vec<u8>);

/// Rows of a new contract.
pub struct ContractRow {
    pub seq: i64,
    pub id: Id,
    pub parent: Option<(i64, Id)>,
    pub root_seq: i64,
    pub root_id: Id,
    pub depth: u32,
    pub delegate_key: AgentKey,
    pub liability: Liability,
    pub intent_lineage_hash: [u8; 32],
    pub cumulative_trust_ppm: u32,
    pub effective_predicate: String,
    pub deadline_ms: i64,
    /// JSON array of the normalized prefixes.
    pub write_scope_json: String,
    pub policy: Policy,
    pub envelope: Vec<u8>,
    pub issued_at_ms: i64,
    /// The host named at delegation, if any.
    pub host_key: Option<AgentKey>,
    /// The issuing call's trace context, if it was traced.
    pub trace: Option<broker_wire::command::TraceContext>,
    /// The run's labels as a JSON object.
    pub labels_json: String,
    /// A root's labels, one `run_labels` row each, so AggregateAudits finds
    /// runs by label through an index; empty for children (a run is found
    /// by its root).
    pub run_labels: Vec<(String, String)>,
    /// Status and ledger as of the end of the batch (a contract may become
    /// a parent within the batch that creates it).
    pub status: Status,
    pub ledger: Ledger,
}

pub struct RequestRow {
    pub agent: AgentKey,
    pub nonce: Vec<u8>,
    pub digest: [u8; 32],
    pub outcome: i64,
    pub ref_id: Id,
    pub at_ms: i64,
}

pub struct ReceiptRow {
    /// From the same writer counter as contract rows (one event order).
    pub seq: i64,
    pub id: Id,
    pub kind: i64,
    pub contract_seq: i64,
    pub contract_id: Id,
    pub root_id: Id,
    pub envelope: Vec<u8>,
    pub at_ms: i64,
}

/// A command's answer as the planner leaves it.
#[derive(Debug)]
pub enum Slot {
    /// Answered by the plan: issued, refused, replayed, or an error.
    Planned(Result<Answer, StoreError>),
    /// A lifecycle command: answered by `store::sql::lifecycle::apply`
    /// once the plan is written (`Slot::Planned` then).
    Lifecycle,
}

/// Everything a batch writes, and the answers to send after commit.
#[derive(Default)]
pub struct Plan {
    /// One per command, in order.
    pub answers: Vec<Slot>,
    pub contracts: Vec<ContractRow>,
    /// The ledger of every earlier contract this batch reserved budget
    /// from, by sequence number, last state only. Planning changes no
    /// earlier contract's status (lifecycle commands write their own), so
    /// the update leaves `status` alone: naming it would make SQLite
    /// rewrite every index on it (`contracts_open_by_deadline`, the
    /// partial `contracts_held_by_*`) for each parent — one random page
    /// of WAL per delegation (BENCHMARKS.md).
    pub states: Vec<(i64, Ledger)>,
    pub requests: Vec<RequestRow>,
    pub receipts: Vec<ReceiptRow>,
}

impl Plan {
    /// Whether the plan writes no row (run labels come with contracts).
    pub fn writes_nothing(&self) -> bool {
        self.contracts.is_empty()
            && self.states.is_empty()
            && self.requests.is_empty()
            && self.receipts.is_empty()
    }

    /// One `(root seq, key, value)` per label of each new root: the
    /// `run_labels` rows (the index audits select runs by).
    pub fn run_labels(&self) -> Vec<(i64, &str, &str)> {
        self.contracts
            .iter()
            .flat_map(|row| {
                row.run_labels
                    .iter()
                    .map(move |(key, value)| (row.seq, key.as_str(), value.as_str()))
            })
            .collect()
    }
}

/// The request keys and parent ids a batch needs loaded.
pub fn needs(commands: &[Command], known: &KnownMap) -> (Vec<RequestKey>, Vec<Id>) {
    let requests = commands
        .iter()
        .filter_map(Command::request)
        .map(|r| (r.agent, r.nonce.clone()))
        .collect();
    let mut parents: Vec<Id> = commands
        .iter()
        .filter_map(|c| match c {
            Command::Delegate(child, _) if !known.contains_key(&child.parent_id) => {
                Some(child.parent_id)
            }
            _ => None,
        })
        .collect();
    parents.sort_unstable();
    parents.dedup();
    (requests, parents)
}

pub fn replayed(prior: &PriorRequest, request: &RequestMeta) -> Result<Answer, StoreError> {
    if prior.digest != request.digest {
        return Err(StoreError::NonceReused);
    }
    let outcome = if prior.outcome == OUTCOME_ISSUED {
        Outcome::Issued {
            id: prior.ref_id,
            envelope: prior.envelope.clone(),
        }
    } else {
        // The store's own stored receipt, read back once to report it.
        let receipt = pb::Receipt::decode(prior.envelope.payload.as_slice()).unwrap_or_default();
        Outcome::Receipt {
            receipt_id: prior.ref_id,
            envelope: prior.envelope.clone(),
            decided: crate::Decided::of(&receipt),
        }
    };
    Ok(Answer {
        outcome,
        replayed: true,
    })
}

/// The request keys of the commands the plan answered with an error: such
/// an answer writes no request-log row a retry could meet, so a writer
/// that did not read the log first looks these few up (`replay_unlogged`).
pub fn unlogged(commands: &[Command], answers: &[Slot]) -> Vec<RequestKey> {
    commands
        .iter()
        .zip(answers)
        .filter(|(_, slot)| matches!(slot, Slot::Planned(Err(_))))
        .filter_map(|(command, _)| command.request())
        .map(|r| (r.agent, r.nonce.clone()))
        .collect()
}

/// Answers each error of a request answered before with its earlier
/// answer (the error changed nothing, so the earlier answer simply
/// replaces it).
pub fn replay_unlogged(
    commands: &[Command],
    answers: &mut [Slot],
    earlier: &HashMap<RequestKey, PriorRequest>,
) {
    for (command, slot) in commands.iter().zip(answers.iter_mut()) {
        if let (Slot::Planned(Err(_)), Some(request)) = (&slot, command.request())
            && let Some(prior) = earlier.get(&(request.agent, request.nonce.clone()))
        {
            *slot = Slot::Planned(replayed(prior, request));
        }
    }
}

/// The answers to send, once every lifecycle slot has been answered; one
/// left open is a writer bug, answered as such (INTERNAL), never as a
/// made-up outcome.
pub fn answers(slots: Vec<Slot>) -> Vec<Result<Answer, StoreError>> {
    slots
        .into_iter()
        .map(|slot| match slot {
            Slot::Planned(answer) => answer,
            Slot::Lifecycle => Err(StoreError::Corrupt(
                "a lifecycle command of the batch was not applied".into(),
            )),
        })
        .collect()
}

/// Decides every command in order. `known` must hold every parent the
/// batch names that exists; it is updated in place (new contracts, new
/// ledgers), so on a failed commit the caller must discard it.
pub fn plan(
    commands: &[Command],
    prior: &mut HashMap<RequestKey, PriorRequest>,
    known: &mut KnownMap,
    next_seq: &mut impl SeqSource,
    stamper: &Stamper,
    now_ms: i64,
) -> Plan {
    let mut plan = Plan::default();
    let mut touched: Vec<Id> = Vec::new();
    for command in commands {
        let Some(request) = command
            .request()
            .filter(|_| !matches!(command, Command::Lifecycle(_)))
        else {
            plan.answers.push(Slot::Lifecycle);
            continue;
        };
        let key = (request.agent, request.nonce.clone());
        if let Some(earlier) = prior.get(&key) {
            plan.answers.push(Slot::Planned(replayed(earlier, request)));
            continue;
        }
        let answer = match command {
            Command::OpenRoot(root, stamped) => Ok(open_root(
                root,
                (**stamped).clone(),
                known,
                next_seq,
                &mut plan,
            )),
            // Slotted above (never reached: a lifecycle command has its
            // slot already); a slot still, so answers never shift.
            Command::Lifecycle(_) => {
                plan.answers.push(Slot::Lifecycle);
                continue;
            }
            Command::Delegate(child, speculation) => delegate(
                child,
                speculation.as_deref(),
                known,
                next_seq,
                &mut plan,
                &mut touched,
                stamper,
                now_ms,
            ),
        };
        if let Ok(answer) = &answer {
            let (outcome, ref_id, envelope) = match &answer.outcome {
                Outcome::Issued { id, envelope } => (OUTCOME_ISSUED, *id, envelope.clone()),
                Outcome::Receipt {
                    receipt_id,
                    envelope,
                    ..
                } => (OUTCOME_RECEIPT, *receipt_id, envelope.clone()),
            };
            plan.requests.push(RequestRow {
                agent: request.agent,
                nonce: request.nonce.clone(),
                digest: request.digest,
                outcome,
                ref_id,
                at_ms: now_ms,
            });
            // A duplicate later in this same batch replays this answer.
            prior.insert(
                key,
                PriorRequest {
                    digest: request.digest,
                    outcome,
                    ref_id,
                    envelope,
                },
            );
        }
        plan.answers.push(Slot::Planned(answer));
    }
    // New rows carry their end-of-batch state; earlier contracts get one
    // update each.
    for row in &mut plan.contracts {
        if let Some(k) = known.get(&row.id) {
            row.status = k.view.status;
            row.ledger = k.view.ledger;
        }
    }
    let first_new_seq = plan.contracts.first().map_or(i64::MAX, |r| r.seq);
    touched.sort_unstable();
    touched.dedup();
    for id in touched {
        if let Some(k) = known.get(&id)
            && k.seq < first_new_seq
        {
            plan.states.push((k.seq, k.view.ledger));
        }
    }
    plan
}

fn scope_json(scope: &Scope) -> String {
    serde_json::to_string(scope.prefixes()).unwrap_or_else(|_| "[]".into())
}

fn open_root(
    root: &NewRoot,
    stamped: StampedContract,
    known: &mut KnownMap,
    next_seq: &mut impl SeqSource,
    plan: &mut Plan,
) -> Answer {
    let seq = next_seq.take();
    let lineage = broker_wire::crypto::sha256(root.intent.as_bytes());
    let effective = Predicate::conjoin(&Predicate::default(), &root.predicate).unwrap_or_default();
    let view = ParentView {
        ending: false,
        status: Status::Open,
        delegate_key: root.request.agent,
        depth: 0,
        intent_lineage_hash: lineage,
        cumulative_trust_ppm: broker_domain::limits::PPM_ONE,
        liability: Liability::Delegate,
        effective_predicate: effective.clone(),
        deadline_ms: root.deadline_ms,
        write_scope: root.write_scope.clone(),
        policy: root.policy,
        ledger: Ledger::new(root.budget),
    };
    plan.contracts.push(ContractRow {
        seq,
        id: stamped.stamped.id,
        parent: None,
        root_seq: seq,
        root_id: stamped.stamped.id,
        depth: 0,
        delegate_key: root.request.agent,
        liability: Liability::Delegate,
        intent_lineage_hash: lineage,
        cumulative_trust_ppm: broker_domain::limits::PPM_ONE,
        effective_predicate: effective.as_str().to_owned(),
        deadline_ms: root.deadline_ms,
        write_scope_json: scope_json(&root.write_scope),
        policy: root.policy,
        envelope: stamped.encoded,
        issued_at_ms: stamped.contract.issued_at_ms,
        host_key: None,
        trace: root.trace,
        labels_json: serde_json::to_string(&root.labels).unwrap_or_else(|_| "{}".into()),
        run_labels: root
            .labels
            .iter()
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect(),
        status: view.status,
        ledger: view.ledger,
    });
    let id = stamped.stamped.id;
    known.insert(
        id,
        Known {
            seq,
            view,
            root_id: id,
            root_seq: seq,
            contract: stamped.contract,
            version: None,
        },
    );
    Answer {
        outcome: Outcome::Issued {
            id,
            envelope: stamped.stamped.envelope,
        },
        replayed: false,
    }
}

#[allow(clippy::too_many_arguments)]
fn delegate(
    child: &NewChild,
    speculation: Option<&Speculation>,
    known: &mut KnownMap,
    next_seq: &mut impl SeqSource,
    plan: &mut Plan,
    touched: &mut Vec<Id>,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Answer, StoreError> {
    let parent = known
        .get_mut(&child.parent_id)
        .ok_or_else(|| StoreError::NotFound {
            what: crate::Entity::ParentContract,
            id: hex::encode(child.parent_id),
        })?;
    broker_domain::invariants::check_child_fields(&parent.view, &child.ask, child.host.is_some())
        .map_err(StoreError::Invalid)?;
    match broker_domain::check_delegation(&parent.view, &child.ask, now_ms) {
        Ok(terms) => {
            parent
                .view
                .ledger
                .reserve(child.ask.budget)
                .map_err(|e| StoreError::Corrupt(format!("ledger after a passed check: {e}")))?;
            touched.push(child.parent_id);
            let (root_id, root_seq, parent_seq) = (parent.root_id, parent.root_seq, parent.seq);
            let seq = next_seq.take();
            let stamped = match speculation {
                Some(s) if s.terms == terms => s.stamped.clone(),
                _ => stamper.child(&parent.view.intent_lineage_hash, child, &terms, now_ms),
            };
            let view = ParentView {
                ending: false,
                status: Status::Open,
                delegate_key: child.delegate_key,
                depth: terms.depth,
                intent_lineage_hash: parent.view.intent_lineage_hash,
                cumulative_trust_ppm: terms.cumulative_trust_ppm,
                liability: child.ask.liability,
                effective_predicate: terms.effective_predicate.clone(),
                deadline_ms: terms.deadline_ms,
                write_scope: child.ask.write_scope.clone(),
                policy: parent.view.policy,
                ledger: Ledger::new(child.ask.budget),
            };
            let id = stamped.stamped.id;
            plan.contracts.push(ContractRow {
                seq,
                id,
                parent: Some((parent_seq, child.parent_id)),
                root_seq,
                root_id,
                depth: terms.depth,
                delegate_key: child.delegate_key,
                liability: child.ask.liability,
                intent_lineage_hash: view.intent_lineage_hash,
                cumulative_trust_ppm: terms.cumulative_trust_ppm,
                effective_predicate: terms.effective_predicate.as_str().to_owned(),
                deadline_ms: terms.deadline_ms,
                write_scope_json: scope_json(&child.ask.write_scope),
                policy: view.policy,
                envelope: stamped.encoded,
                issued_at_ms: stamped.contract.issued_at_ms,
                host_key: child.host,
                trace: child.trace,
                // The run's labels are the root's; a child's row has none.
                labels_json: "{}".into(),
                run_labels: Vec::new(),
                status: view.status,
                ledger: view.ledger,
            });
            known.insert(
                id,
                Known {
                    seq,
                    view,
                    root_id,
                    root_seq,
                    contract: stamped.contract,
                    version: None,
                },
            );
            Ok(Answer {
                outcome: Outcome::Issued {
                    id,
                    envelope: stamped.stamped.envelope,
                },
                replayed: false,
            })
        }
        Err(refusal) => {
            let (root_id, parent_seq) = (parent.root_id, parent.seq);
            Ok(plan_refusal(
                child, root_id, parent_seq, &refusal, next_seq, plan, stamper, now_ms,
            ))
        }
    }
}

/// A refused hop: its signed receipt, stored against the parent.
#[allow(clippy::too_many_arguments)]
fn plan_refusal(
    child: &NewChild,
    root_id: Id,
    parent_seq: i64,
    refusal: &broker_domain::Refusal,
    next_seq: &mut impl SeqSource,
    plan: &mut Plan,
    stamper: &Stamper,
    now_ms: i64,
) -> Answer {
    let (stamped, receipt) =
        stamper.refusal(&child.parent_id, &root_id, &child.request, refusal, now_ms);
    let seq = next_seq.take();
    plan.receipts.push(ReceiptRow {
        seq,
        id: stamped.id,
        kind: pb::ReceiptKind::Refused as i64,
        contract_seq: parent_seq,
        contract_id: child.parent_id,
        root_id,
        envelope: stamped.envelope.encode_to_vec(),
        at_ms: now_ms,
    });
    Answer {
        outcome: Outcome::Receipt {
            receipt_id: stamped.id,
            envelope: stamped.envelope,
            decided: crate::Decided::of(&receipt),
        },
        replayed: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lifecycle slot the writer did not fill is answered as a writer
    /// bug, never as an outcome; planned answers keep their order.
    #[test]
    fn an_unfilled_lifecycle_slot_is_an_internal_error() {
        let answers = answers(vec![
            Slot::Planned(Err(StoreError::Busy)),
            Slot::Lifecycle,
            Slot::Planned(Err(StoreError::NonceReused)),
        ]);
        assert!(matches!(answers[0], Err(StoreError::Busy)));
        assert!(
            matches!(&answers[1], Err(StoreError::Corrupt(what)) if what.contains("lifecycle"))
        );
        assert!(matches!(answers[2], Err(StoreError::NonceReused)));
    }
}
