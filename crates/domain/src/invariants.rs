//! The fifteen issuance invariants of docs/design.md, checked in one place.
//! `check_delegation` is pure: the store calls it inside the transaction
//! that reserves the budget, with the parent's state as of that transaction.

use super::ledger::Ledger;
use super::predicate::Predicate;
use super::scope::Scope;
use super::trust;
use super::{AgentKey, InputError, Liability, Policy, Status};

wire_enum! {
    /// Stable invariant codes; the discriminant is the wire value and the
    /// precedence (lowest first) of a refusal's primary reason; the text is
    /// the stable code of docs/design.md.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum InvariantCode: u8 {
        ParentNotActive = 1 => "PARENT_NOT_ACTIVE",
        NotHolder = 2 => "NOT_HOLDER",
        DepthExceeded = 3 => "DEPTH_EXCEEDED",
        IntentDiluted = 4 => "INTENT_DILUTED",
        TrustAttenuated = 5 => "TRUST_ATTENUATED",
        LiabilityWithoutPredicate = 6 => "LIABILITY_WITHOUT_PREDICATE",
        LiabilityWithoutEscalation = 7 => "LIABILITY_WITHOUT_ESCALATION",
        LiabilityFromRetainingParent = 8 => "LIABILITY_FROM_RETAINING_PARENT",
        BelowRetryCost = 9 => "BELOW_RETRY_COST",
        BelowRetryLatency = 10 => "BELOW_RETRY_LATENCY",
        BudgetExceedsParent = 11 => "BUDGET_EXCEEDS_PARENT",
        DeadlineExceedsParent = 12 => "DEADLINE_EXCEEDS_PARENT",
        NoRetryHeadroom = 13 => "NO_RETRY_HEADROOM",
        ScopeWidened = 14 => "SCOPE_WIDENED",
        FanoutExceeded = 15 => "FANOUT_EXCEEDED",
    }
}

/// One violated invariant with the values that broke it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub code: InvariantCode,
    /// What the request asked for, in the code's unit.
    pub requested: String,
    /// The bound it broke, in the same unit.
    pub allowed: String,
    /// One sentence saying why.
    pub detail: String,
}

/// A refused hop: every violated invariant, in code order; never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    violations: Vec<Violation>,
}

impl Refusal {
    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// The first violated invariant in docs/design.md's order.
    pub fn primary(&self) -> InvariantCode {
        self.violations[0].code
    }

    pub fn codes(&self) -> Vec<InvariantCode> {
        self.violations.iter().map(|v| v.code).collect()
    }
}

/// What the check needs to know about the parent, as of the transaction.
#[derive(Clone, Debug)]
pub struct ParentView {
    pub status: Status,
    /// The parent or an ancestor is draining (`lifecycle::Ending`): the
    /// parent is ending, so it issues nothing more.
    pub ending: bool,
    /// Only this key may delegate from the parent (invariant 2).
    pub delegate_key: AgentKey,
    pub depth: u32,
    pub intent_lineage_hash: [u8; 32],
    pub cumulative_trust_ppm: u32,
    pub liability: Liability,
    pub effective_predicate: Predicate,
    pub deadline_ms: i64,
    pub write_scope: Scope,
    pub policy: Policy,
    pub ledger: Ledger,
}

/// A validated request for a child contract.
#[derive(Clone, Debug)]
pub struct ChildAsk {
    /// Key that signed the request.
    pub requester: AgentKey,
    /// Lineage hash the requester carries (invariant 4).
    pub intent_lineage_hash: [u8; 32],
    pub budget: i64,
    /// `None`: "as late as the parent allows".
    pub deadline_ms: Option<i64>,
    pub liability: Liability,
    /// The predicate forwarded at this hop (may be empty).
    pub predicate: Predicate,
    /// Empty when none was named.
    pub escalation_channel: String,
    pub min_retry_cost: i64,
    pub min_retry_latency_ms: i64,
    pub write_scope: Scope,
    /// The delegate's trust factor as resolved from its attestation or the
    /// static table; 0 when neither vouches for it.
    pub factor_ppm: u32,
    /// Why the factor is what it is, for the refusal's detail.
    pub factor_note: String,
}

/// The terms a child is issued with, derived by construction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildTerms {
    pub depth: u32,
    /// min(parent, requested).
    pub deadline_ms: i64,
    /// For DELEGATE: parent's effective predicate ∧ own; else own alone.
    pub effective_predicate: Predicate,
    pub cumulative_trust_ppm: u32,
}

/// The request's fields that are malformed only in the light of its
/// parent, checked before the invariants: the tree's policy may demand
/// that the principal names the child's host, and a liability-transferring
/// child's effective predicate (the ancestors' conjunction and its own)
/// must fit `MAX_EFFECTIVE_PREDICATE_BYTES`. Errors name the field.
pub fn check_child_fields(
    parent: &ParentView,
    ask: &ChildAsk,
    host_named: bool,
) -> Result<(), InputError> {
    if parent.policy.require_host && !host_named {
        return Err(InputError::new(
            "body.host_public_key",
            "this tree's policy (require_host) needs the principal to name the child's host",
        ));
    }
    if ask.liability == Liability::Delegate
        && Predicate::conjoin(&parent.effective_predicate, &ask.predicate).is_none()
    {
        return Err(InputError::new(
            "body.predicate",
            format!(
                "the effective predicate (the ancestors' conjunction and this one) would exceed {} bytes",
                super::limits::MAX_EFFECTIVE_PREDICATE_BYTES
            ),
        ));
    }
    Ok(())
}

/// Checks all fifteen invariants. Returns the child's terms, or a refusal
/// listing every violated invariant.
pub fn check_delegation(
    parent: &ParentView,
    ask: &ChildAsk,
    now_ms: i64,
) -> Result<ChildTerms, Refusal> {
    let mut violations = Vec::new();
    let mut refuse = |code: InvariantCode, requested: String, allowed: String, detail: String| {
        violations.push(Violation {
            code,
            requested,
            allowed,
            detail,
        })
    };

    // 1. The parent is open (issued or accepted), not ending, and within
    // its deadline.
    if !parent.status.is_open() {
        refuse(
            InvariantCode::ParentNotActive,
            "OPEN".into(),
            parent.status.as_str().into(),
            format!("the parent contract is {}", parent.status.as_str()),
        );
    } else if parent.ending {
        refuse(
            InvariantCode::ParentNotActive,
            "OPEN".into(),
            "ENDING".into(),
            "the parent contract is ending: it or an ancestor is being ended with its descendants"
                .into(),
        );
    } else if now_ms >= parent.deadline_ms {
        refuse(
            InvariantCode::ParentNotActive,
            now_ms.to_string(),
            parent.deadline_ms.to_string(),
            "the parent contract's deadline has passed".into(),
        );
    }

    // 2. Holder-of-key: only the parent's delegate may sub-delegate.
    if ask.requester != parent.delegate_key {
        refuse(
            InvariantCode::NotHolder,
            hex::encode(ask.requester),
            hex::encode(parent.delegate_key),
            "the request is not signed by the parent contract's delegate key".into(),
        );
    }

    // 3. Depth.
    let depth = parent.depth + 1;
    if depth > parent.policy.max_depth {
        refuse(
            InvariantCode::DepthExceeded,
            depth.to_string(),
            parent.policy.max_depth.to_string(),
            format!(
                "depth {depth} exceeds the policy's max_depth {}",
                parent.policy.max_depth
            ),
        );
    }

    // 4. Intent lineage.
    if ask.intent_lineage_hash != parent.intent_lineage_hash {
        refuse(
            InvariantCode::IntentDiluted,
            hex::encode(ask.intent_lineage_hash),
            hex::encode(parent.intent_lineage_hash),
            "the intent lineage hash differs from the root's".into(),
        );
    }

    // 5. Cumulative trust.
    let cumulative_trust_ppm = trust::attenuate(parent.cumulative_trust_ppm, ask.factor_ppm);
    if cumulative_trust_ppm < parent.policy.min_cumulative_trust_ppm {
        refuse(
            InvariantCode::TrustAttenuated,
            cumulative_trust_ppm.to_string(),
            parent.policy.min_cumulative_trust_ppm.to_string(),
            format!(
                "cumulative trust {} ppm × factor {} ppm ({}) falls below the policy minimum",
                parent.cumulative_trust_ppm, ask.factor_ppm, ask.factor_note
            ),
        );
    }

    // 6–8. Liability transfer needs detection and escalation (docs/design.md, seed 001).
    let effective_predicate = match ask.liability {
        Liability::Delegate => Predicate::conjoin(&parent.effective_predicate, &ask.predicate),
        Liability::Principal => Predicate::conjoin(&Predicate::default(), &ask.predicate),
    };
    // The composition can only fail on its length bound, which the store
    // refuses as malformed input before calling this; should it ever get
    // here, treating it as "no predicate" refuses rather than drops it.
    let effective_predicate = effective_predicate.unwrap_or_default();
    let transfers = ask.liability == Liability::Delegate;
    if transfers && effective_predicate.is_empty() {
        refuse(
            InvariantCode::LiabilityWithoutPredicate,
            "DELEGATE".into(),
            "PRINCIPAL".into(),
            "liability=DELEGATE requires a forwarded acceptance predicate".into(),
        );
    }
    if transfers && ask.escalation_channel.is_empty() {
        refuse(
            InvariantCode::LiabilityWithoutEscalation,
            "DELEGATE".into(),
            "PRINCIPAL".into(),
            "liability=DELEGATE requires an escalation channel".into(),
        );
    }
    if transfers && parent.liability == Liability::Principal {
        refuse(
            InvariantCode::LiabilityFromRetainingParent,
            "DELEGATE".into(),
            "PRINCIPAL".into(),
            "a liability-retaining parent cannot issue a liability-transferring child".into(),
        );
    }

    // 9. Budget covers one retry.
    if ask.budget < ask.min_retry_cost {
        refuse(
            InvariantCode::BelowRetryCost,
            ask.budget.to_string(),
            ask.min_retry_cost.to_string(),
            format!(
                "budget {} is below min_retry_cost {}: the delegate is stranded below its retry floor",
                ask.budget, ask.min_retry_cost
            ),
        );
    }

    // 10. Time left covers one retry (by construction the deadline is
    // min(parent, requested)).
    let deadline_ms = ask
        .deadline_ms
        .map_or(parent.deadline_ms, |d| d.min(parent.deadline_ms));
    let time_left_ms = deadline_ms.saturating_sub(now_ms);
    if time_left_ms < ask.min_retry_latency_ms {
        refuse(
            InvariantCode::BelowRetryLatency,
            time_left_ms.to_string(),
            ask.min_retry_latency_ms.to_string(),
            format!(
                "{time_left_ms} ms left before the deadline, below min_retry_latency_ms {}",
                ask.min_retry_latency_ms
            ),
        );
    }

    // 11. Budget within the parent's residual.
    let residual = parent.ledger.residual();
    if ask.budget > residual {
        refuse(
            InvariantCode::BudgetExceedsParent,
            ask.budget.to_string(),
            residual.max(0).to_string(),
            format!(
                "budget {} exceeds the parent's residual {residual}",
                ask.budget
            ),
        );
    }

    // 12. Deadline within the parent's.
    if let Some(requested) = ask.deadline_ms
        && requested > parent.deadline_ms
    {
        refuse(
            InvariantCode::DeadlineExceedsParent,
            requested.to_string(),
            parent.deadline_ms.to_string(),
            "the requested deadline is later than the parent's".into(),
        );
    }

    // 13. The principal keeps enough to retry a liable child once.
    if transfers && parent.policy.retry_headroom {
        let left = residual.saturating_sub(ask.budget);
        if left < ask.min_retry_cost {
            refuse(
                InvariantCode::NoRetryHeadroom,
                left.to_string(),
                ask.min_retry_cost.to_string(),
                format!(
                    "the parent would keep {left} units, below the child's min_retry_cost {}: it could not retry once",
                    ask.min_retry_cost
                ),
            );
        }
    }

    // 14. Scope attenuation.
    let widened = ask.write_scope.widening_over(&parent.write_scope);
    if !widened.is_empty() {
        refuse(
            InvariantCode::ScopeWidened,
            widened.join(","),
            parent.write_scope.prefixes().join(","),
            "write-scope prefixes outside the parent's scope".into(),
        );
    }

    // 15. Fan-out.
    if parent.ledger.open_children >= parent.policy.max_children {
        refuse(
            InvariantCode::FanoutExceeded,
            (parent.ledger.open_children + 1).to_string(),
            parent.policy.max_children.to_string(),
            format!(
                "the parent already has {} open children",
                parent.ledger.open_children
            ),
        );
    }

    if violations.is_empty() {
        Ok(ChildTerms {
            depth,
            deadline_ms,
            effective_predicate,
            cumulative_trust_ppm,
        })
    } else {
        violations.sort_by_key(|v| v.code);
        Err(Refusal { violations })
    }
}
