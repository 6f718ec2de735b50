//! Names of the API's codes, written once for every caller: logs,
//! metrics, gateways and the CLI print the same words.

use crate::pb;

/// `ErrorInfo.reason` of an error reason: its proto name without the
/// `ERROR_REASON_` prefix (`NOT_FOUND`, `OVERLOADED`).
pub fn reason_name(reason: pb::ErrorReason) -> &'static str {
    let name = reason.as_str_name();
    name.strip_prefix("ERROR_REASON_").unwrap_or(name)
}
