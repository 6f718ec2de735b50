//! Every bound the broker enforces on what a client sends, in one place.
//! Config values that an operator may tune live in `config`; these are the
//! hard ceilings the code relies on (overflow, memory, row sizes).

/// Largest budget, reserve or cost, in units. Far below `i64::MAX` so that
/// sums of a full fan-out can never overflow.
pub const MAX_BUDGET_UNITS: i64 = 1_000_000_000_000_000;
/// Largest intent or task text, in bytes.
pub const MAX_TEXT_BYTES: usize = 16_384;
/// Largest forwarded predicate, in bytes.
pub const MAX_PREDICATE_BYTES: usize = 4_096;
/// Largest effective (composed) predicate, in bytes: bounds what a deep
/// chain of conjunctions can grow to.
pub const MAX_EFFECTIVE_PREDICATE_BYTES: usize = 65_536;
/// Largest escalation channel name, in bytes.
pub const MAX_CHANNEL_BYTES: usize = 1_024;
/// Most write-scope prefixes on one contract.
pub const MAX_SCOPE_PREFIXES: usize = 64;
/// Longest write-scope prefix, in bytes.
pub const MAX_SCOPE_PREFIX_BYTES: usize = 1_024;
/// Longest risk class in an attestation, in bytes.
pub const MAX_RISK_CLASS_BYTES: usize = 64;
/// Hard ceiling for a policy's `max_depth`.
pub const MAX_DEPTH_CEILING: u32 = 64;
/// Hard ceiling for a policy's `max_children`.
pub const MAX_CHILDREN_CEILING: u32 = 1_024;
/// Longest a deadline (or a retry latency) may be from now: 366 days.
pub const MAX_HORIZON_MS: i64 = 366 * 24 * 3600 * 1000;
/// Nonce length bounds, in bytes.
pub const MIN_NONCE_BYTES: usize = 16;
pub const MAX_NONCE_BYTES: usize = 64;
/// Trust is carried in parts per million; this is "full trust".
pub const PPM_ONE: u32 = 1_000_000;
/// Largest page of children returned at once.
pub const MAX_PAGE_SIZE: u32 = 1_000;
/// Page size when the client asks for 0.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
