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

/// `name` without its enum's `prefix`, or the number when this build does
/// not know the value (a newer broker's).
fn bare(name: Option<&'static str>, prefix: &str, value: i32) -> String {
    name.map(|n| n.trim_start_matches(prefix).to_owned())
        .unwrap_or_else(|| value.to_string())
}

/// A contract status as its name without the prefix, e.g. ACCEPTED.
pub fn status_name(status: i32) -> String {
    let name = pb::ContractStatus::try_from(status).ok();
    bare(name.map(|s| s.as_str_name()), "CONTRACT_STATUS_", status)
}

/// A liability as its name without the prefix, e.g. DELEGATE.
pub fn liability_name(liability: i32) -> String {
    let name = pb::Liability::try_from(liability).ok();
    bare(name.map(|l| l.as_str_name()), "LIABILITY_", liability)
}

/// A receipt kind as its name without the prefix, e.g. REFUSED.
pub fn receipt_kind_name(kind: i32) -> String {
    let name = pb::ReceiptKind::try_from(kind).ok();
    bare(name.map(|k| k.as_str_name()), "RECEIPT_KIND_", kind)
}

/// A verdict as its name without the prefix, e.g. ACCEPTED.
pub fn verdict_name(verdict: i32) -> String {
    let name = pb::Verdict::try_from(verdict).ok();
    bare(name.map(|v| v.as_str_name()), "VERDICT_", verdict)
}

/// An invariant code as its name without the prefix, e.g. DEPTH_EXCEEDED.
pub fn code_name(code: i32) -> String {
    let name = pb::InvariantCode::try_from(code).ok();
    bare(name.map(|c| c.as_str_name()), "INVARIANT_CODE_", code)
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
