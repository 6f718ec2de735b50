//! `decide`: one lifecycle command judged against the subtree it touches —
//! who may act, the statuses and ledgers that change, the cascade, the
//! receipts to sign and the answer — with no store. A backend loads a
//! `Subtree`, calls `decide` and writes the `Decision` as it is; property
//! tests run the same function over whole trees in memory.
//!
//! Here: what a decision reads and writes, who may act, and the dispatch.
//! `actions` decides each action; `cascade` ends the target with its open
//! descendants (and drains them in steps) and turns the model's changes
//! into updates and receipts.

mod actions;
mod cascade;

use super::{Event, LifecycleError, Node, Tree, TreeError, may_revoke};
use crate::error::InputError;
use crate::judge::{Judgment, Verdict};
use crate::ledger::{EscalationNotice, Ledger};
use crate::limits::{MAX_BUDGET_UNITS, MAX_OBSERVATIONS_PER_CONTRACT, MAX_STALE_JUDGMENTS};
use crate::{AgentKey, Id, Status};
use actions::{accept, adjudicate, complete, expire_on_access, give_back, record, revoke};

pub use cascade::drain_step;

/// One contract as a decision reads it: its stored row, nothing derived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    pub id: Id,
    /// Index of its parent in `Subtree::rows`; `None` for the first row.
    pub parent: Option<usize>,
    pub status: Status,
    pub ledger: Ledger,
    pub deadline_ms: i64,
    pub issued_at_ms: i64,
    pub delegate_key: AgentKey,
    /// The key that records observations, once named.
    pub host_key: Option<AgentKey>,
    /// The principal named the host at Delegate (its metering is then
    /// charged in full); otherwise the delegate named it at Accept.
    pub host_named_at_delegate: bool,
    /// `None` before completion.
    pub verdict: Option<Verdict>,
    /// Observations recorded so far (a judgment is valid for this count).
    pub observations: i64,
    /// Judgments of its completions made stale by observations recorded
    /// meanwhile (`MAX_STALE_JUDGMENTS`).
    pub stale_judgments: i64,
    /// Metered units recorded so far, charged or not.
    pub observed_units: i64,
    /// A host metered units: its metering, not the report, is consumption.
    pub metered: bool,
    /// Metered units recorded but not charged (see `metering_charge`).
    pub metered_uncharged: i64,
    pub depth: u32,
    pub min_retry_cost: i64,
    pub min_retry_latency_ms: i64,
}

/// What a decision reads: the target, its parent (when it has one: a
/// target without a parent row is a root) and, when
/// `Action::needs_descendants`, its open descendants.
#[derive(Clone, Debug)]
pub struct Subtree {
    /// The parent first when there is one, then the target, then the
    /// target's open descendants in any order.
    pub rows: Vec<Facts>,
    pub target: usize,
    /// `(id, delegate key)` of the target's ancestors root first, then of
    /// the target; loaded only when `Action::needs_lineage`.
    pub lineage: Vec<(Id, AgentKey)>,
    /// Whether the target or an ancestor is draining (see `Ending`).
    pub ending: Ending,
}

/// A subtree whose open descendants are being ended in bounded steps
/// (`drain_step`), after a request to end its top (the *draining*
/// contract) found more of them than one step may end. From the instant
/// the drain starts, its open descendants are frozen: every request about
/// them is refused as about an ended contract (the broker's own expiry
/// still ends them), and every request about the draining contract waits
/// until its descendants have ended (it issues, records and accepts
/// nothing meanwhile); then the request that ends it goes through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ending {
    /// Neither the target nor an ancestor is draining.
    #[default]
    None,
    /// The target itself is draining.
    Draining,
    /// An ancestor, `cause`, is draining: the target ends with `status`.
    Frozen { cause: Id, status: Status },
}

impl Subtree {
    fn target(&self) -> &Facts {
        &self.rows[self.target]
    }

    fn is_root(&self) -> bool {
        self.target().parent.is_none()
    }

    fn model(&self) -> Tree {
        let mut nodes: Vec<Node> = self
            .rows
            .iter()
            .map(|r| Node {
                parent: r.parent,
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
        Tree::from_nodes(nodes)
    }
}

/// A completion as the writer receives it, judged beforehand.
#[derive(Clone, Debug)]
pub struct CompleteFacts<'a> {
    /// The judgment and the observation count it saw; `None`: not judged.
    pub judgment: Option<(&'a Judgment, i64)>,
    /// When the broker received it (`elapsed_ms` is measured to here).
    pub received_at_ms: i64,
    pub claim: &'a str,
    pub has_report: bool,
    /// SHA-256 of the output exactly as sent.
    pub result_digest: [u8; 32],
}

/// What is asked of the target.
#[derive(Clone, Debug)]
pub enum Action<'a> {
    Accept {
        host: Option<AgentKey>,
    },
    Decline {
        reason: &'a str,
    },
    Escalate {
        reason: &'a str,
    },
    Revoke {
        reason: &'a str,
    },
    Record {
        count: usize,
        /// Metered units of the request in all (each was validated).
        units: i64,
    },
    Complete(CompleteFacts<'a>),
    Adjudicate {
        verdict: Verdict,
        reason: &'a str,
    },
    /// The broker's own expiry sweep.
    Expire,
}

impl Action<'_> {
    /// Whether the decision reads `Subtree::lineage`.
    pub fn needs_lineage(&self) -> bool {
        matches!(self, Self::Revoke { .. } | Self::Complete(_))
    }
}

/// A row whose status or ledger the decision changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowUpdate {
    pub row: usize,
    pub status: Status,
    pub ledger: Ledger,
}

/// The target's columns a decision sets besides status and ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetWrite {
    None,
    /// Accept: the host that records observations from now on.
    Host(Option<AgentKey>),
    /// Record: the request's observations are stored, and these counters.
    Observations {
        total: i64,
        observed_units: i64,
        metered: bool,
        metered_uncharged: i64,
    },
    /// Complete: the judgment's stored facts.
    Judged {
        verdict: Verdict,
        has_report: bool,
        downgrades: u32,
        claim: String,
    },
    /// Adjudicate: the principal's verdict.
    Verdict(Verdict),
    /// Complete with a stale judgment: one more (`Facts::stale_judgments`).
    StaleJudgment,
}

/// The facts of a completion receipt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletedFacts {
    pub judgment: Judgment,
    /// Descendants the completion ended, each before its descendants.
    pub ended: Vec<Id>,
    pub claim: String,
    pub has_report: bool,
    pub result_digest: [u8; 32],
    /// Units charged for the contract's own consumption.
    pub consumed: i64,
    /// Reported or metered units recorded but not charged.
    pub claimed_excess: i64,
    pub overspend: i64,
    /// Units returned to the parent.
    pub returned: i64,
    pub delegate_key: AgentKey,
    pub depth: u32,
    /// Ids root first, then the contract's.
    pub chain: Vec<Id>,
    pub elapsed_ms: i64,
}

/// What one receipt says (the store adds ids, time and the signature).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiptBody {
    /// The target expired; `ended` is it, then what ended with it.
    Expired {
        ended: Vec<Id>,
    },
    /// Open descendant `id` ended because `cause` did.
    Cascaded {
        id: Id,
        status: Status,
        cause: Id,
    },
    Accepted,
    Declined {
        reason: String,
        ended: Vec<Id>,
    },
    Escalated {
        reason: String,
        ended: Vec<Id>,
        notice: EscalationNotice,
    },
    Revoked {
        reason: String,
        ended: Vec<Id>,
    },
    Observed {
        count: u32,
    },
    Completed(Box<CompletedFacts>),
    Adjudicated {
        verdict: Verdict,
        reason: String,
    },
}

impl ReceiptBody {
    /// The status this receipt ends its contract with, if it ends one.
    pub fn ends(&self) -> Option<Status> {
        match self {
            Self::Expired { .. } => Some(Status::Expired),
            Self::Cascaded { status, .. } => Some(*status),
            Self::Declined { .. } => Some(Status::Declined),
            Self::Escalated { .. } => Some(Status::Unresolvable),
            Self::Revoked { .. } => Some(Status::Revoked),
            Self::Completed(_) => Some(Status::Completed),
            Self::Accepted | Self::Observed { .. } | Self::Adjudicated { .. } => None,
        }
    }
}

/// One receipt to sign, about `rows[row]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedReceipt {
    pub row: usize,
    /// It answers the command's signed request, which is logged with it.
    pub answers_request: bool,
    pub body: ReceiptBody,
}

/// Why a command is refused. The store maps each to a stable reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The signer is not the delegate; says what it tried.
    #[error("only the contract's delegate may {0}")]
    NotDelegate(&'static str),
    #[error("only the contract's host may record observations")]
    NotHost,
    #[error("only the holder of an ancestor contract may revoke it")]
    NotAncestor,
    #[error("only the contract's principal may adjudicate it")]
    NotPrincipal,
    #[error("the contract already names another host")]
    HostMismatch,
    #[error(transparent)]
    Invalid(InputError),
    #[error("a root has no principal to return it to")]
    Root,
    #[error("the contract is {}", .0.as_str())]
    Ended(Status),
    #[error("only a completed contract awaiting the principal's verdict can be adjudicated")]
    NotPending,
    #[error("metered units would exceed {MAX_BUDGET_UNITS} for one contract")]
    MeteredLimit,
    #[error("the contract would hold more than {MAX_OBSERVATIONS_PER_CONTRACT} observations")]
    TooManyObservations,
    /// The host kept recording while completions were judged.
    #[error(
        "the host recorded while {MAX_STALE_JUDGMENTS} judgments of the contract's completions were made, making each stale: it takes no more observations while ACCEPTED"
    )]
    RecordingClosed,
    /// Asked of an open contract past its deadline: it expired instead.
    #[error("the contract's deadline {deadline_ms} passed; it has expired")]
    Expired { deadline_ms: i64 },
    /// The sweep found it no longer due (a completion raced it).
    #[error("the contract is not overdue")]
    NotOverdue,
    #[error(transparent)]
    Lifecycle(LifecycleError),
    /// Host observations arrived after the judgment: judge again.
    #[error("the completion's judgment is stale")]
    StaleJudgment,
    /// The target has more open descendants than one step may end: they
    /// are being ended in steps (`Ending::Draining`); asked again once they
    /// have, the request goes through.
    #[error(
        "the contract's open descendants are being ended in steps first (more than one step ends); nothing was recorded: retry with the same nonce"
    )]
    DescendantsEnding,
    /// An ancestor is draining: the target is ending with it.
    #[error("the contract is ending: its ancestor {} is ending", hex::encode(.cause))]
    AncestorEnding { cause: Id },
    /// The stored subtree broke the model's rules.
    #[error("{0}")]
    Corrupt(String),
}

impl From<TreeError> for Refused {
    fn from(e: TreeError) -> Self {
        match e {
            TreeError::Lifecycle(l) => Self::Lifecycle(l),
            other => Self::Corrupt(other.to_string()),
        }
    }
}

/// Everything one command does, to be written as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Rows whose status or ledger changed.
    pub updates: Vec<RowUpdate>,
    pub write: TargetWrite,
    /// Receipts in the order they are to be numbered.
    pub receipts: Vec<PlannedReceipt>,
    /// The answer: the receipt (index in `receipts`) or why not. A refusal
    /// may still carry writes: an overdue contract expires on access.
    pub answer: Result<usize, Refused>,
}

impl Decision {
    fn refused(why: Refused) -> Self {
        Self {
            updates: Vec::new(),
            write: TargetWrite::None,
            receipts: Vec::new(),
            answer: Err(why),
        }
    }

    /// Rows whose cached state this decision made stale.
    pub fn changed(&self, target: usize) -> Vec<usize> {
        let mut rows: Vec<usize> = self.updates.iter().map(|u| u.row).collect();
        if matches!(self.write, TargetWrite::Verdict(_)) && !rows.contains(&target) {
            rows.push(target);
        }
        rows
    }
}

/// A completion may be judged (off the writer) only for the delegate of
/// an accepted contract (the only status Complete moves), before its
/// deadline: nobody else can make the broker judge, and anything else is
/// refused without a judgment (so a Complete before Accept takes no judge).
pub fn judgment_due(target: &Facts, signer: &AgentKey, received_at_ms: i64) -> bool {
    target.status == Status::Accepted
        && target.delegate_key == *signer
        && received_at_ms < target.deadline_ms
}

/// A host must be a key other than the delegate's: a delegate that is its
/// own host would observe, and so judge, itself. One rule for Delegate and
/// Accept.
pub fn check_host(delegate: &AgentKey, host: &AgentKey) -> Result<(), InputError> {
    if host == delegate {
        return Err(InputError::new(
            "body.host_public_key",
            "must differ from the delegate's key: a delegate may not observe itself",
        ));
    }
    Ok(())
}

/// Decides `action`, asked by `signer` (`None`: the broker itself), of
/// `subtree`'s target at `now_ms`.
pub fn decide(
    subtree: &Subtree,
    signer: Option<&AgentKey>,
    action: &Action<'_>,
    now_ms: i64,
) -> Decision {
    let target = subtree.target();
    // Expiry on access: an open contract past its deadline expires now
    // (its reservation returns), whatever was asked of it but revocation.
    if target.status.is_open()
        && now_ms >= target.deadline_ms
        && !matches!(action, Action::Revoke { .. })
    {
        return expire_on_access(subtree, action, now_ms);
    }
    if let Err(why) = authorize(subtree, signer, action) {
        return Decision::refused(why);
    }
    match subtree.ending {
        Ending::Frozen { cause, .. } if signer.is_some() => {
            return Decision::refused(Refused::AncestorEnding { cause });
        }
        // Nothing happens to a draining contract but its ending, once its
        // descendants have ended: not charged, not accepted.
        Ending::Draining => return Decision::refused(Refused::DescendantsEnding),
        _ => {}
    }
    match action {
        Action::Expire => Decision::refused(Refused::NotOverdue),
        Action::Accept { host } => accept(subtree, *host, now_ms),
        Action::Decline { reason } => give_back(subtree, false, reason, now_ms),
        Action::Escalate { reason } => give_back(subtree, true, reason, now_ms),
        Action::Revoke { reason } => revoke(subtree, reason, now_ms),
        Action::Record { count, units } => record(subtree, *count, *units),
        Action::Complete(facts) => complete(subtree, facts, now_ms),
        Action::Adjudicate { verdict, reason } => adjudicate(subtree, *verdict, reason),
    }
}

/// Who may ask `action` of the target: its delegate (accept, decline,
/// escalate, complete), its host (record), its principal (adjudicate),
/// the holder of an ancestor (revoke), the broker itself (expire). Reads
/// only the target, its parent and its lineage: never the descendants.
pub fn authorize(
    subtree: &Subtree,
    signer: Option<&AgentKey>,
    action: &Action<'_>,
) -> Result<(), Refused> {
    let target = subtree.target();
    let is_delegate = signer == Some(&target.delegate_key);
    match action {
        Action::Expire => Ok(()),
        Action::Accept { .. } if !is_delegate => Err(Refused::NotDelegate("accept it")),
        Action::Complete(_) if !is_delegate => Err(Refused::NotDelegate("complete it")),
        Action::Decline { .. } | Action::Escalate { .. } if !is_delegate => {
            Err(Refused::NotDelegate("do this"))
        }
        Action::Decline { .. } | Action::Escalate { .. } if subtree.is_root() => Err(Refused::Root),
        Action::Accept { .. }
        | Action::Complete(_)
        | Action::Decline { .. }
        | Action::Escalate { .. } => Ok(()),
        Action::Revoke { .. } => {
            // Principals: the delegates of every strict ancestor; for a
            // root, the orchestrator that opened it.
            let mut principals: Vec<&AgentKey> = subtree
                .lineage
                .iter()
                .filter(|(id, _)| *id != target.id)
                .map(|(_, k)| k)
                .collect();
            if subtree.is_root() {
                principals.push(&target.delegate_key);
            }
            if signer.is_some_and(|s| may_revoke(s, principals)) {
                Ok(())
            } else {
                Err(Refused::NotAncestor)
            }
        }
        Action::Record { .. } => {
            if target.host_key.is_some() && signer == target.host_key.as_ref() {
                Ok(())
            } else {
                Err(Refused::NotHost)
            }
        }
        Action::Adjudicate { .. } => {
            let principal = match target.parent {
                Some(p) => subtree.rows[p].delegate_key,
                None => target.delegate_key,
            };
            if signer == Some(&principal) {
                Ok(())
            } else {
                Err(Refused::NotPrincipal)
            }
        }
    }
}

/// Whether deciding `action` reads the target's open descendants, given
/// the subtree loaded without them: only when the decision may end the
/// target (they end with it) — an overdue contract expiring on access, or
/// an authorized decline, escalation, revocation, completion or expiry. A
/// refusal never reads them, so a stranger's request costs the writer no
/// more than the target, its parent and its lineage.
pub fn needs_descendants(
    partial: &Subtree,
    signer: Option<&AgentKey>,
    action: &Action<'_>,
    now_ms: i64,
) -> bool {
    let target = partial.target();
    let expires_on_access = target.status.is_open()
        && now_ms >= target.deadline_ms
        && !matches!(action, Action::Revoke { .. });
    if expires_on_access {
        return true;
    }
    // A request the drain state refuses reads no descendant either.
    let refused_by_ending = match partial.ending {
        Ending::None => false,
        Ending::Draining => true,
        Ending::Frozen { .. } => signer.is_some(),
    };
    ends_target(action) && !refused_by_ending && authorize(partial, signer, action).is_ok()
}

/// Whether `action`, when it succeeds, ends the target.
fn ends_target(action: &Action<'_>) -> bool {
    matches!(
        action,
        Action::Decline { .. }
            | Action::Escalate { .. }
            | Action::Revoke { .. }
            | Action::Complete(_)
            | Action::Expire
    )
}

/// The status a draining contract's descendants end with when `action`
/// (one that ends the target) found too many of them: expired with an
/// expiry, revoked otherwise.
pub fn drain_status(action: &Action<'_>) -> Status {
    match action {
        Action::Expire => Event::Expire.cascade_status(),
        _ => Event::Revoke.cascade_status(),
    }
}

#[cfg(test)]
mod tests;
