//! One decision per action asked of the target: the checks each action
//! makes before the model applies it, and the receipt it answers with.

use super::cascade::{cascades, ended_ids, ending, updates};
use super::{
    Action, CompleteFacts, CompletedFacts, Decision, PlannedReceipt, ReceiptBody, Refused, Subtree,
    TargetWrite, check_host,
};
use crate::judge::{Judgment, Verdict};
use crate::lifecycle::{Consumption, Event, HostChoice, transition};
use crate::limits::{MAX_BUDGET_UNITS, MAX_OBSERVATIONS_PER_CONTRACT, MAX_STALE_JUDGMENTS};
use crate::{AgentKey, Status};

pub(super) fn accept(subtree: &Subtree, host: Option<AgentKey>, now_ms: i64) -> Decision {
    let target = subtree.target();
    let host_key = match (target.host_key, host) {
        (Some(named), Some(asked)) if named != asked => {
            return Decision::refused(Refused::HostMismatch);
        }
        (named, asked) => named.or(asked),
    };
    if let Some(host) = &host_key
        && let Err(e) = check_host(&target.delegate_key, host)
    {
        return Decision::refused(Refused::Invalid(e));
    }
    ending(subtree, |tree, t| {
        tree.accept(t, now_ms).map(|()| Vec::new())
    })
    .finish(TargetWrite::Host(host_key), |_, _| ReceiptBody::Accepted)
}

/// Decline (before accepting) or escalate (after): the contract goes back
/// to its principal; an escalation tells the principal what it has left.
pub(super) fn give_back(subtree: &Subtree, escalate: bool, reason: &str, now_ms: i64) -> Decision {
    let target = subtree.target();
    let reason = reason.to_owned();
    let step = ending(subtree, |tree, t| {
        if escalate {
            tree.escalate(t, now_ms)
        } else {
            tree.decline(t, now_ms)
        }
    });
    step.finish(TargetWrite::None, |tree, ended| {
        if !escalate {
            return ReceiptBody::Declined { reason, ended };
        }
        // The principal (the parent, row 0) after settlement.
        let principal = &tree.nodes()[0];
        let notice = principal.ledger.escalation_notice(
            principal.deadline_ms,
            now_ms,
            target.min_retry_cost,
            target.min_retry_latency_ms,
        );
        ReceiptBody::Escalated {
            reason,
            ended,
            notice,
        }
    })
}

pub(super) fn revoke(subtree: &Subtree, reason: &str, now_ms: i64) -> Decision {
    let reason = reason.to_owned();
    ending(subtree, |tree, t| tree.revoke(t, now_ms)).finish(TargetWrite::None, |_, ended| {
        ReceiptBody::Revoked { reason, ended }
    })
}

pub(super) fn adjudicate(subtree: &Subtree, verdict: Verdict, reason: &str) -> Decision {
    let target = subtree.target();
    if target.status != Status::Completed || target.verdict != Some(Verdict::PendingPrincipal) {
        return Decision::refused(Refused::NotPending);
    }
    Decision {
        updates: Vec::new(),
        write: TargetWrite::Verdict(verdict),
        receipts: vec![PlannedReceipt {
            row: subtree.target,
            answers_request: true,
            body: ReceiptBody::Adjudicated {
                verdict,
                reason: reason.to_owned(),
            },
        }],
        answer: Ok(0),
    }
}

pub(super) fn expire_on_access(subtree: &Subtree, action: &Action<'_>, now_ms: i64) -> Decision {
    let target = subtree.target();
    let step = ending(subtree, |tree, t| tree.expire(t, now_ms));
    let mut decision = match step.outcome {
        // The stored target is open and overdue: expiring cannot fail but
        // on rows that break the model's rules.
        Err(e) => return Decision::refused(Refused::Corrupt(e.to_string())),
        Ok(ended) => {
            let ids = ended_ids(subtree, &ended);
            let mut receipts = cascades(subtree, &ended);
            receipts.push(PlannedReceipt {
                row: subtree.target,
                answers_request: false,
                body: ReceiptBody::Expired { ended: ids },
            });
            Decision {
                updates: updates(subtree, &step.tree),
                write: TargetWrite::None,
                answer: Ok(receipts.len() - 1),
                receipts,
            }
        }
    };
    if !matches!(action, Action::Expire) {
        decision.answer = Err(Refused::Expired {
            deadline_ms: target.deadline_ms,
        });
    }
    decision
}

pub(super) fn record(subtree: &Subtree, count: usize, units: i64) -> Decision {
    let target = subtree.target();
    if !target.status.is_open() {
        return Decision::refused(Refused::Ended(target.status));
    }
    if target.status == Status::Accepted && target.stale_judgments >= MAX_STALE_JUDGMENTS {
        return Decision::refused(Refused::RecordingClosed);
    }
    let total = target
        .observations
        .saturating_add(i64::try_from(count).unwrap_or(i64::MAX));
    if total > MAX_OBSERVATIONS_PER_CONTRACT {
        return Decision::refused(Refused::TooManyObservations);
    }
    // Each unit count is at most MAX_BUDGET_UNITS (validated); the total
    // per contract is capped too, so ending it can always settle.
    let observed_units = target.observed_units.saturating_add(units);
    if observed_units > MAX_BUDGET_UNITS {
        return Decision::refused(Refused::MeteredLimit);
    }
    // Metered units leave the residual now; the contract's end charges
    // nothing of them again.
    let host = if target.host_named_at_delegate {
        HostChoice::Principal
    } else {
        HostChoice::Delegate
    };
    let mut tree = subtree.model();
    let uncharged = match tree.meter(subtree.target, units, host) {
        Ok(u) => u,
        Err(e) => return Decision::refused(Refused::Corrupt(format!("metering: {e}"))),
    };
    Decision {
        updates: updates(subtree, &tree),
        write: TargetWrite::Observations {
            total,
            observed_units,
            metered: target.metered || units > 0,
            metered_uncharged: target.metered_uncharged.saturating_add(uncharged),
        },
        receipts: vec![PlannedReceipt {
            row: subtree.target,
            answers_request: true,
            body: ReceiptBody::Observed {
                count: u32::try_from(count).unwrap_or(u32::MAX),
            },
        }],
        answer: Ok(0),
    }
}

/// What a metered contract's reports claim beyond its charge: the host
/// metered `judgment.consumed`, of which `uncharged` was not charged (a
/// host the delegate chose, past the residual), and the delegate reported
/// `judgment.reported_consumed`. The larger report minus the charge: the
/// delegate's unobserved claim stays visible to its principal (seed 000)
/// even though the host's metering, not the claim, is what was charged.
fn metered_claimed_excess(judgment: &Judgment, uncharged: i64) -> i64 {
    let charged = judgment.consumed.saturating_sub(uncharged);
    judgment
        .reported_consumed
        .max(judgment.consumed)
        .saturating_sub(charged)
        .max(0)
}

pub(super) fn complete(subtree: &Subtree, facts: &CompleteFacts<'_>, now_ms: i64) -> Decision {
    let target = subtree.target();
    if let Err(e) = transition(target.status, Event::Complete, target.deadline_ms, now_ms) {
        return Decision::refused(Refused::Lifecycle(e));
    }
    // The writer never judges: a judgment made before host observations
    // it has not seen goes back to be made again, off the writer.
    let judgment = match facts.judgment {
        Some((judgment, seen)) if seen == target.observations => judgment,
        None => return Decision::refused(Refused::StaleJudgment),
        Some(_) => {
            // Counted, so the host cannot keep the judges busy forever:
            // past the bound, recording closes (see `record`).
            let mut stale = Decision::refused(Refused::StaleJudgment);
            stale.write = TargetWrite::StaleJudgment;
            return stale;
        }
    };
    let consumption = if target.metered {
        Consumption::Metered
    } else {
        Consumption::Reported(judgment.consumed)
    };
    let step = ending(subtree, |tree, t| tree.complete(t, consumption, now_ms));
    let own = step
        .outcome
        .as_ref()
        .ok()
        .and_then(|ended| ended.iter().find(|e| e.id == subtree.target).copied());
    let write = TargetWrite::Judged {
        verdict: judgment.verdict,
        has_report: facts.has_report,
        downgrades: u32::try_from(judgment.refused.len()).unwrap_or(u32::MAX),
        claim: facts.claim.to_owned(),
    };
    step.finish(write, |_, ended| {
        ReceiptBody::Completed(Box::new(CompletedFacts {
            judgment: judgment.clone(),
            ended: ended.into_iter().skip(1).collect(),
            claim: facts.claim.to_owned(),
            has_report: facts.has_report,
            result_digest: facts.result_digest,
            consumed: if target.metered {
                judgment.consumed.saturating_sub(target.metered_uncharged)
            } else {
                own.map_or(0, |e| e.charged_at_end)
            },
            claimed_excess: if target.metered {
                metered_claimed_excess(judgment, target.metered_uncharged)
            } else {
                own.map_or(0, |e| e.unverified_excess)
            },
            overspend: own.and_then(|e| e.overspend).map_or(0, |o| o.excess),
            returned: own.and_then(|e| e.settlement).map_or(0, |s| s.returned),
            delegate_key: target.delegate_key,
            depth: target.depth,
            chain: subtree.lineage.iter().map(|(id, _)| *id).collect(),
            elapsed_ms: facts.received_at_ms.saturating_sub(target.issued_at_ms),
        }))
    })
}
