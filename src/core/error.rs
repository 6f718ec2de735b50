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

/// Most bytes of a client's input quoted back in an error: enough to
/// recognise it, while a huge bad value does not make a huge error.
pub const MAX_ECHOED_INPUT_BYTES: usize = 128;

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
}
