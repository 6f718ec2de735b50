//! The core's error for malformed input. Invariant refusals are not errors:
//! they are `Refusal` data (see `invariants`).

/// Malformed input: names the field and says what is wrong with it. The
/// service maps it to INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InputError {
    /// Path of the offending request field, e.g. `body.budget`.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl InputError {
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}
