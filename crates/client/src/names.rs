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

/// One function per enum: its name without the prefix, or the number.
macro_rules! bare_names {
    ($($(#[$doc:meta])* $name:ident: $enum:ident, $prefix:literal;)*) => {$(
        $(#[$doc])*
        pub fn $name(value: i32) -> String {
            let name = pb::$enum::try_from(value).ok();
            bare(name.map(|n| n.as_str_name()), $prefix, value)
        }
    )*};
}

bare_names! {
    /// A contract status as its name without the prefix, e.g. ACCEPTED.
    status_name: ContractStatus, "CONTRACT_STATUS_";
    /// A liability as its name without the prefix, e.g. DELEGATE.
    liability_name: Liability, "LIABILITY_";
    /// A receipt kind as its name without the prefix, e.g. REFUSED.
    receipt_kind_name: ReceiptKind, "RECEIPT_KIND_";
    /// A verdict as its name without the prefix, e.g. ACCEPTED.
    verdict_name: Verdict, "VERDICT_";
    /// An invariant code as its name without the prefix, e.g. DEPTH_EXCEEDED.
    code_name: InvariantCode, "INVARIANT_CODE_";
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
