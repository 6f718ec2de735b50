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
    /// The reason is cut at `MAX_ERROR_REASON_BYTES`: reasons quote parser
    /// messages that may repeat the client's whole input, and an error must
    /// fit gRPC's 8 KiB trailers or the client sees RESOURCE_EXHAUSTED
    /// instead of the field it got wrong.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: bounded(reason.into(), MAX_ERROR_REASON_BYTES),
        }
    }
}

pub use crate::limits::MAX_ERROR_REASON_BYTES;

/// `text` cut at `max_bytes` on a character boundary, marked with "…" and
/// its full length when cut.
pub fn bounded(mut text: String, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text;
    }
    let full = text.len();
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str(&format!("… (cut from {full} bytes)"));
    text
}

pub use crate::limits::MAX_ECHOED_INPUT_BYTES;

/// `text` quoted for an error message (as `{:?}` would), cut at
/// `MAX_ECHOED_INPUT_BYTES` on a character boundary with "…" and its full
/// length when longer.
pub fn echo(text: &str) -> String {
    if text.len() <= MAX_ECHOED_INPUT_BYTES {
        return format!("{text:?}");
    }
    let mut end = MAX_ECHOED_INPUT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &text[..end], text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_input_is_quoted_and_bounded() {
        assert_eq!(echo("a\"b"), "\"a\\\"b\"");
        let long = "é".repeat(200);
        let echoed = echo(&long);
        assert!(echoed.len() < MAX_ECHOED_INPUT_BYTES + 32, "{echoed}");
        assert!(echoed.ends_with("… (400 bytes)"), "{echoed}");
        assert!(echoed.starts_with("\"éé"));
    }

    #[test]
    fn reasons_are_bounded_on_a_character_boundary() {
        let e = InputError::new("f", "é".repeat(MAX_ERROR_REASON_BYTES));
        assert!(e.reason.len() < MAX_ERROR_REASON_BYTES + 40, "{}", e.reason);
        assert!(
            e.reason
                .ends_with(&format!("(cut from {} bytes)", 2 * MAX_ERROR_REASON_BYTES))
        );
        assert_eq!(InputError::new("f", "short").reason, "short");
    }
}
