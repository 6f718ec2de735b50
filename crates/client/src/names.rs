//! Names of codes and statuses as people and models read them, written
//! once for the CLI and both gateways.

pub use broker_wire::names::reason_name;
use broker_wire::pb;

/// A gRPC code as its canonical name, e.g. NOT_FOUND (for errors
/// without an ErrorInfo).
pub fn code_name_of(code: tonic::Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// At most `max` bytes of `text`, cut at a character boundary.
pub fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// A contract status as its name without the prefix, e.g. ACCEPTED.
pub fn status_name(status: i32) -> String {
    pb::ContractStatus::try_from(status)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("CONTRACT_STATUS_")
                .to_owned()
        })
        .unwrap_or_else(|_| status.to_string())
}

/// A liability as its name without the prefix, e.g. DELEGATE.
pub fn liability_name(liability: i32) -> String {
    pb::Liability::try_from(liability)
        .map(|l| l.as_str_name().trim_start_matches("LIABILITY_").to_owned())
        .unwrap_or_else(|_| liability.to_string())
}

/// A receipt kind as its name without the prefix, e.g. REFUSED.
pub fn receipt_kind_name(kind: i32) -> String {
    pb::ReceiptKind::try_from(kind)
        .map(|k| {
            k.as_str_name()
                .trim_start_matches("RECEIPT_KIND_")
                .to_owned()
        })
        .unwrap_or_else(|_| kind.to_string())
}

/// A verdict as its name without the prefix, e.g. ACCEPTED.
pub fn verdict_name(verdict: i32) -> String {
    pb::Verdict::try_from(verdict)
        .map(|v| v.as_str_name().trim_start_matches("VERDICT_").to_owned())
        .unwrap_or_else(|_| verdict.to_string())
}

/// An invariant code as its name without the prefix, e.g. DEPTH_EXCEEDED.
pub fn code_name(code: i32) -> String {
    pb::InvariantCode::try_from(code)
        .map(|c| {
            c.as_str_name()
                .trim_start_matches("INVARIANT_CODE_")
                .to_owned()
        })
        .unwrap_or_else(|_| code.to_string())
}

/// A refusal's violations as a model or a person reads them:
/// `CODE (requested R, allowed A): detail`.
pub fn listed_violations(receipt: &pb::Receipt) -> Vec<String> {
    receipt
        .violations
        .iter()
        .map(|v| {
            format!(
                "{} (requested {}, allowed {}): {}",
                code_name(v.code),
                v.requested,
                v.allowed,
                v.detail
            )
        })
        .collect()
}
