//! The pure domain: contracts, the issuance invariants, the lifecycle and
//! its ledger arithmetic, judgment of completions, trust arithmetic,
//! predicate composition and write scopes. No tonic, no sqlx,
//! no tokio, no I/O: everything here is tested without a runtime.

#[macro_use]
mod wire_enum;

pub mod access;
pub mod audit;
pub mod error;
pub mod identity;
pub mod invariants;
pub mod judge;
pub mod ledger;
pub mod lifecycle;
pub mod limits;
pub mod predicate;
pub mod schema;
pub mod scope;
pub mod tenant;
pub mod token;
pub mod trust;

#[cfg(test)]
mod tests;

pub use error::InputError;
pub use invariants::{
    ChildAsk, ChildTerms, InvariantCode, ParentView, Refusal, Violation, check_delegation,
};
pub use judge::{Completion, Judgment, Observed, RefusedCriterion, Verdict, judge};
pub use ledger::{EscalationNotice, Ledger, LedgerError, Overspend, Settlement};
pub use lifecycle::{Event, LifecycleError, may_revoke, transition};
pub use predicate::Predicate;
pub use scope::Scope;

/// An agent's ed25519 public key.
pub type AgentKey = [u8; 32];
/// A contract or receipt id: SHA-256 of its signed payload.
pub type Id = [u8; 32];

wire_enum! {
    /// Who answers for a contract's outcome (docs/design.md, seed 001).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Liability: i32 {
        /// Liability stays with the principal.
        Principal = 1 => "PRINCIPAL",
        /// Liability moves to the delegate.
        Delegate = 2 => "DELEGATE",
    }
}

wire_enum! {
    /// Lifecycle state of a contract (docs/design.md §Lifecycle).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Status: i32 {
        /// Issued; the delegate has not accepted yet.
        Open = 1 => "OPEN",
        /// The delegate accepted and works on it.
        Accepted = 2 => "ACCEPTED",
        /// The delegate completed it; the verdict is recorded beside.
        Completed = 3 => "COMPLETED",
        /// The delegate escalated it as unresolvable (docs/design.md, seed 001).
        Unresolvable = 4 => "UNRESOLVABLE",
        /// Its deadline passed while it was open.
        Expired = 5 => "EXPIRED",
        /// Its principal or an ancestor's holder revoked it.
        Revoked = 6 => "REVOKED",
        /// The delegate declined it before accepting.
        Declined = 7 => "DECLINED",
    }
}

impl Status {
    /// Open or accepted: it may delegate, holds its reservation at its
    /// parent and can still end.
    pub fn is_open(self) -> bool {
        matches!(self, Self::Open | Self::Accepted)
    }

    /// Terminal: no transition leaves it, and it holds no reservation.
    pub fn is_ended(self) -> bool {
        !self.is_open()
    }
}

/// The tree-wide policy set at OpenRoot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Deepest contract allowed (root = 0).
    pub max_depth: u32,
    /// Lowest cumulative trust a contract may carry, in ppm.
    pub min_cumulative_trust_ppm: u32,
    /// Most open children per contract.
    pub max_children: u32,
    /// Invariant 13 on (true) or off.
    pub retry_headroom: bool,
    /// Every delegation must name its host: the principal, not the
    /// delegate, picks whose observations judge the child.
    pub require_host: bool,
}

impl Policy {
    /// Validates a client policy against the hard ceilings and the
    /// operator's configured maxima.
    pub fn new(
        max_depth: u32,
        min_cumulative_trust_ppm: u32,
        max_children: u32,
        retry_headroom: bool,
        require_host: bool,
        config_max_depth: u32,
        config_max_children: u32,
    ) -> Result<Self, InputError> {
        let depth_cap = config_max_depth.min(limits::MAX_DEPTH_CEILING);
        if max_depth == 0 || max_depth > depth_cap {
            return Err(InputError::new(
                "body.policy.max_depth",
                format!("{max_depth} is outside 1..={depth_cap}"),
            ));
        }
        if min_cumulative_trust_ppm > limits::PPM_ONE {
            return Err(InputError::new(
                "body.policy.min_cumulative_trust_ppm",
                format!("{min_cumulative_trust_ppm} is above 1000000"),
            ));
        }
        let children_cap = config_max_children.min(limits::MAX_CHILDREN_CEILING);
        if max_children == 0 || max_children > children_cap {
            return Err(InputError::new(
                "body.policy.max_children",
                format!("{max_children} is outside 1..={children_cap}"),
            ));
        }
        Ok(Self {
            max_depth,
            min_cumulative_trust_ppm,
            max_children,
            retry_headroom,
            require_host,
        })
    }
}

/// Validates an amount of budget units for `field`.
pub fn budget_units(value: i64, field: &'static str) -> Result<i64, InputError> {
    if value <= 0 || value > limits::MAX_BUDGET_UNITS {
        return Err(InputError::new(
            field,
            format!("{value} is outside 1..={}", limits::MAX_BUDGET_UNITS),
        ));
    }
    Ok(value)
}

/// Validates a non-negative cost or latency for `field`.
pub fn non_negative(value: i64, max: i64, field: &'static str) -> Result<i64, InputError> {
    if !(0..=max).contains(&value) {
        return Err(InputError::new(
            field,
            format!("{value} is outside 0..={max}"),
        ));
    }
    Ok(value)
}

/// Validates a text field's length (and, when required, its presence).
pub fn text(
    value: &str,
    max_bytes: usize,
    required: bool,
    field: &'static str,
) -> Result<(), InputError> {
    if required && value.trim().is_empty() {
        return Err(InputError::new(field, "is required"));
    }
    if value.len() > max_bytes {
        return Err(InputError::new(
            field,
            format!("{} bytes, at most {max_bytes}", value.len()),
        ));
    }
    Ok(())
}

pub use crate::limits::MAX_LABEL_KEY_BYTES;
pub use crate::limits::MAX_LABEL_VALUE_BYTES;
pub use crate::limits::MAX_LABELS;

/// The label-key rule, for labels and for the keys audits group by:
/// 1..=`MAX_LABEL_KEY_BYTES` bytes of `[a-z0-9_.-]`.
pub fn check_label_key(key: &str, field: &'static str) -> Result<(), InputError> {
    let ok = !key.is_empty()
        && key.len() <= MAX_LABEL_KEY_BYTES
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b));
    if !ok {
        return Err(InputError::new(
            field,
            format!(
                "key {} must be 1..={MAX_LABEL_KEY_BYTES} bytes of [a-z0-9_.-]",
                error::echo(key)
            ),
        ));
    }
    Ok(())
}

/// Validates run labels: at most `MAX_LABELS`, keys of `[a-z0-9_.-]`.
pub fn labels(
    raw: &std::collections::HashMap<String, String>,
    field: &'static str,
) -> Result<std::collections::BTreeMap<String, String>, InputError> {
    if raw.len() > MAX_LABELS {
        return Err(InputError::new(
            field,
            format!("{} labels, at most {MAX_LABELS}", raw.len()),
        ));
    }
    let mut out = std::collections::BTreeMap::new();
    for (key, value) in raw {
        check_label_key(key, field)?;
        if value.len() > MAX_LABEL_VALUE_BYTES || value.chars().any(char::is_control) {
            return Err(InputError::new(
                field,
                format!("value of {key:?} must be at most 256 bytes, no control characters"),
            ));
        }
        out.insert(key.clone(), value.clone());
    }
    Ok(out)
}
