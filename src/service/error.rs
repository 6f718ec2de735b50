//! The service layer's error and its one exhaustive mapping to a gRPC
//! status with a `google.rpc.ErrorInfo` (stable `reason`, metadata naming
//! the field or limit) — the only place an error becomes a status.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::core::InputError;
pub use crate::core::limits::MAX_STATUS_MESSAGE_BYTES;
use crate::pb;
use crate::store::{Entity, StoreError};

pub use crate::names::reason_name;

/// `ErrorInfo.domain` of every error this broker returns.
pub const ERROR_DOMAIN: &str = "delegation.broker.v1";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Malformed input, naming the field.
    #[error(transparent)]
    Invalid(#[from] InputError),
    /// The request's signature or timestamp does not hold.
    #[error("{detail}")]
    Unauthenticated {
        reason: pb::ErrorReason,
        detail: String,
    },
    #[error("{} {id} not found", what.as_str())]
    NotFound { what: Entity, id: String },
    /// The signer may not act on this contract.
    #[error("{detail}")]
    PermissionDenied {
        reason: pb::ErrorReason,
        detail: String,
    },
    /// A listed orchestrator asked for a root above its allowance.
    #[error("body.budget {requested} exceeds this orchestrator's allowance of {allowed} per root")]
    OverAllowance { requested: i64, allowed: i64 },
    /// The contract's state does not allow it (ended, late, …).
    #[error("{detail}")]
    FailedPrecondition {
        reason: pb::ErrorReason,
        detail: String,
    },
    /// The nonce was used before with a different body.
    #[error("nonce already used by this agent for a different request")]
    NonceReused,
    /// A per-caller or per-contract limit was reached: its config key
    /// (`config::keys`) or, for a fixed limit, the constant's name.
    #[error("limit reached: {0}")]
    Overloaded(&'static str),
    /// The answer would not fit the response size limit.
    #[error(
        "the response would be {size} bytes, over the limit of {limit} (limits.max_request_bytes x 4); {hint}"
    )]
    ResponseTooLarge {
        size: usize,
        limit: usize,
        hint: &'static str,
    },
    /// The write queue is full; retry later with the same nonce.
    #[error("busy: the write queue is full; retry with the same nonce")]
    Busy,
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Temporarily unable to answer (a named reason); retry with the same
    /// nonce.
    #[error("{detail}")]
    Retry {
        reason: pb::ErrorReason,
        detail: String,
    },
    #[error("internal error: {0}")]
    Internal(String),
    /// SIGTERM or SIGINT: new calls are refused while in-flight ones
    /// finish.
    #[error(
        "the broker is shutting down; retry with the same nonce against another replica or after its restart"
    )]
    ShuttingDown,
    /// A workload token that proves no identity (BindIdentity): `check`
    /// names which rule (`IDENTITY_*`).
    #[error("{detail}")]
    IdentityRefused { check: &'static str, detail: String },
    /// A health check named a service this broker does not serve.
    #[error("health: no service named {0:?} (\"\" or delegation.broker.v1.Broker)")]
    UnknownHealthService(String),
}

impl ServiceError {
    /// `what` with id `id` (any byte string, shown in hex) does not exist,
    /// or is answered as if it did not.
    pub fn not_found(what: Entity, id: impl AsRef<[u8]>) -> Self {
        Self::NotFound {
            what,
            id: hex::encode(id),
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        let class = match &e {
            StoreError::NotFound { .. } => "NotFound",
            StoreError::NonceReused => "NonceReused",
            StoreError::PermissionDenied { .. } => "PermissionDenied",
            StoreError::FailedPrecondition { .. } => "FailedPrecondition",
            StoreError::Overloaded(_) => "Overloaded",
            StoreError::Busy => "Busy",
            StoreError::Invalid(_) => "Invalid",
            StoreError::Closed => "Closed",
            StoreError::Unavailable { .. } => "Unavailable",
            StoreError::StaleJudgment => "StaleJudgment",
            StoreError::Corrupt(_) => "Corrupt",
            StoreError::Backend(_) => "Backend",
        };
        crate::metrics::STORE_ERRORS
            .with_label_values(&[class])
            .inc();
        match e {
            StoreError::NotFound { what, id } => Self::NotFound { what, id },
            StoreError::NonceReused => Self::NonceReused,
            StoreError::PermissionDenied { reason, detail } => {
                Self::PermissionDenied { reason, detail }
            }
            StoreError::FailedPrecondition { reason, detail } => {
                Self::FailedPrecondition { reason, detail }
            }
            StoreError::Overloaded(what) => Self::Overloaded(what),
            StoreError::Busy => Self::Busy,
            StoreError::Invalid(input) => Self::Invalid(input),
            StoreError::Closed => Self::Unavailable(
                "the store is stopped (shutting down, or after a storage failure: see the log)"
                    .into(),
            ),
            StoreError::Unavailable { reason, detail } => Self::Retry { reason, detail },
            StoreError::StaleJudgment => Self::Retry {
                reason: pb::ErrorReason::ObservationsChanging,
                detail: "the completion's judgment went stale; retry with the same nonce".into(),
            },
            StoreError::Corrupt(what) => Self::Internal(format!("corrupt store: {what}")),
            StoreError::Backend(what) => Self::Unavailable(format!("store: {what}")),
        }
    }
}

/// What every UNAVAILABLE answer tells its caller.
pub const RETRY_HINT: &str = "retry with the same nonce";

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Self {
        // Server-written details may quote stored or client text: bounded
        // like input reasons, so every error fits the 8 KiB trailers.
        let message = crate::core::error::bounded(e.to_string(), MAX_STATUS_MESSAGE_BYTES);
        let (code, reason, metadata) = classify(&e);
        // Every UNAVAILABLE says what the caller may do: nothing it asked
        // was recorded twice, and a retry of the same signed bytes gets
        // the recorded answer if it was recorded after all.
        let message = if code == Code::Unavailable && !message.contains(RETRY_HINT) {
            format!("{message}; {RETRY_HINT}")
        } else {
            message
        };
        // Expected while stopping: not an error of the broker's.
        let expected = matches!(e, ServiceError::ShuttingDown);
        if (code == Code::Internal || code == Code::Unavailable) && !expected {
            // A failing store fails every request: one line a second.
            static FAILED: crate::telemetry::Throttle = crate::telemetry::Throttle::new();
            if let Some(held) = FAILED.allow() {
                tracing::error!(error = %message, held, "request failed");
            }
        }
        let metadata: HashMap<String, String> = metadata
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        let mut details =
            ErrorDetails::with_error_info(reason_name(reason), ERROR_DOMAIN, metadata);
        if let ServiceError::Invalid(input) = &e {
            details.add_bad_request_violation(input.field, input.reason.clone());
        }
        Status::with_error_details(code, message, details)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::lifecycle::LifecycleError;

    fn info(status: &Status) -> (String, HashMap<String, String>) {
        let info = status
            .get_details_error_info()
            .expect("every error has an ErrorInfo");
        assert_eq!(info.domain, ERROR_DOMAIN);
        (info.reason, info.metadata)
    }

    /// The whole mapping, store error → service error → gRPC status: code,
    /// reason and metadata keys, one row per error the broker can answer.
    #[test]
    fn every_error_maps_to_its_documented_status() {
        use pb::ErrorReason as R;
        let denied = |reason| StoreError::PermissionDenied {
            reason,
            detail: "d".into(),
        };
        let precondition = |reason| StoreError::FailedPrecondition {
            reason,
            detail: "d".into(),
        };
        let mut store_cases: Vec<(StoreError, Code, R, &[&str])> = vec![
            (
                StoreError::NotFound {
                    what: Entity::Contract,
                    id: "ab".into(),
                },
                Code::NotFound,
                R::NotFound,
                &["what", "id"],
            ),
            (
                StoreError::NonceReused,
                Code::AlreadyExists,
                R::NonceReused,
                &["field"],
            ),
            (
                StoreError::Invalid(InputError::new("body.host_public_key", "x")),
                Code::InvalidArgument,
                R::InvalidField,
                &["field"],
            ),
            (
                StoreError::Overloaded("MAX_OBSERVATIONS_PER_CONTRACT"),
                Code::ResourceExhausted,
                R::Overloaded,
                &["limit"],
            ),
            // A full write queue: UNAVAILABLE, which standard retry
            // policies retry, naming the config key.
            (
                StoreError::Busy,
                Code::Unavailable,
                R::Overloaded,
                &["limit"],
            ),
            (StoreError::Closed, Code::Unavailable, R::Unavailable, &[]),
            (
                StoreError::Unavailable {
                    reason: R::JudgesBusy,
                    detail: "d".into(),
                },
                Code::Unavailable,
                R::JudgesBusy,
                &[],
            ),
            (
                StoreError::StaleJudgment,
                Code::Unavailable,
                R::ObservationsChanging,
                &[],
            ),
            // Data that does not decode is INTERNAL: retrying cannot help.
            (
                StoreError::Corrupt("row".into()),
                Code::Internal,
                R::Internal,
                &[],
            ),
            (
                StoreError::Backend("io".into()),
                Code::Unavailable,
                R::Unavailable,
                &[],
            ),
        ];
        for reason in [R::NotDelegate, R::NotHost, R::NotAncestor, R::NotPrincipal] {
            store_cases.push((denied(reason), Code::PermissionDenied, reason, &[]));
        }
        for reason in [
            R::WrongState,
            R::Late,
            R::Ended,
            R::Root,
            R::NotPending,
            R::HostMismatch,
            R::MeteredLimit,
        ] {
            store_cases.push((precondition(reason), Code::FailedPrecondition, reason, &[]));
        }
        let service_cases: Vec<(ServiceError, Code, R, &[&str])> = vec![
            (
                ServiceError::Unauthenticated {
                    reason: R::BadSignature,
                    detail: "d".into(),
                },
                Code::Unauthenticated,
                R::BadSignature,
                &[],
            ),
            (
                ServiceError::OverAllowance {
                    requested: 2,
                    allowed: 1,
                },
                Code::PermissionDenied,
                R::RootBudgetOverAllowance,
                &["field", "requested", "allowed"],
            ),
            (
                ServiceError::ResponseTooLarge {
                    size: 9,
                    limit: 8,
                    hint: "page",
                },
                Code::ResourceExhausted,
                R::ResponseTooLarge,
                &["limit", "size", "allowed"],
            ),
            (
                ServiceError::Retry {
                    reason: R::ConvertersBusy,
                    detail: "d".into(),
                },
                Code::Unavailable,
                R::ConvertersBusy,
                &[],
            ),
            (
                ServiceError::Internal("x".into()),
                Code::Internal,
                R::Internal,
                &[],
            ),
            (
                ServiceError::ShuttingDown,
                Code::Unavailable,
                R::Unavailable,
                &[],
            ),
            (
                ServiceError::UnknownHealthService("x".into()),
                Code::NotFound,
                R::NotFound,
                &["what"],
            ),
        ];
        let all = store_cases
            .into_iter()
            .map(|(e, c, r, m)| (ServiceError::from(e), c, r, m))
            .chain(service_cases);
        for (error, code, reason, keys) in all {
            let shown = format!("{error:?}");
            let status = Status::from(error);
            assert_eq!(status.code(), code, "{shown}");
            let (wire, metadata) = info(&status);
            assert_eq!(wire, reason_name(reason), "{shown}");
            let mut got: Vec<&str> = metadata.keys().map(String::as_str).collect();
            got.sort_unstable();
            let mut want = keys.to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "{shown}");
            if code == Code::Unavailable {
                assert!(
                    status.message().contains(RETRY_HINT),
                    "{shown}: {}",
                    status.message()
                );
            }
        }
        let busy = Status::from(ServiceError::from(StoreError::Busy));
        assert_eq!(
            info(&busy).1["limit"],
            crate::config::keys::writer_queue_depth
        );
    }

    /// Every reason the broker sends is a value of errors.proto's enum,
    /// and its wire name drops only the prefix.
    #[test]
    fn reasons_are_named_as_errors_proto_says() {
        assert_eq!(reason_name(pb::ErrorReason::NotDelegate), "NOT_DELEGATE");
        assert_eq!(reason_name(pb::ErrorReason::NotAParty), "NOT_A_PARTY");
        // Every core lifecycle refusal reaches the wire with its reason.
        use crate::core::lifecycle::Refused as F;
        use pb::ErrorReason as R;
        let cases = [
            (
                F::NotDelegate("accept it"),
                Code::PermissionDenied,
                R::NotDelegate,
            ),
            (F::NotHost, Code::PermissionDenied, R::NotHost),
            (F::NotAncestor, Code::PermissionDenied, R::NotAncestor),
            (F::NotPrincipal, Code::PermissionDenied, R::NotPrincipal),
            (F::HostMismatch, Code::FailedPrecondition, R::HostMismatch),
            (
                F::Invalid(InputError::new("body.host_public_key", "x")),
                Code::InvalidArgument,
                R::InvalidField,
            ),
            (F::Root, Code::FailedPrecondition, R::Root),
            (
                F::Ended(crate::core::Status::Revoked),
                Code::FailedPrecondition,
                R::Ended,
            ),
            (F::NotPending, Code::FailedPrecondition, R::NotPending),
            (F::MeteredLimit, Code::FailedPrecondition, R::MeteredLimit),
            (
                F::TooManyObservations,
                Code::ResourceExhausted,
                R::Overloaded,
            ),
            (
                F::Expired { deadline_ms: 1 },
                Code::FailedPrecondition,
                R::Late,
            ),
            (F::NotOverdue, Code::FailedPrecondition, R::WrongState),
            (
                F::Lifecycle(LifecycleError::Late {
                    deadline_ms: 1,
                    now_ms: 2,
                }),
                Code::FailedPrecondition,
                R::Late,
            ),
            (
                F::Lifecycle(LifecycleError::NotAllowed {
                    from: crate::core::Status::Open,
                    event: crate::core::Event::Complete,
                }),
                Code::FailedPrecondition,
                R::WrongState,
            ),
            (F::StaleJudgment, Code::Unavailable, R::ObservationsChanging),
            (
                F::DescendantsEnding,
                Code::Unavailable,
                R::DescendantsEnding,
            ),
            (
                F::RecordingClosed,
                Code::FailedPrecondition,
                R::RecordingClosed,
            ),
            (
                F::AncestorEnding { cause: [7; 32] },
                Code::FailedPrecondition,
                R::AncestorEnding,
            ),
            (F::Corrupt("x".into()), Code::Internal, R::Internal),
        ];
        for (refused, code, reason) in cases {
            let shown = format!("{refused:?}");
            let status = Status::from(ServiceError::from(StoreError::from(refused)));
            assert_eq!(status.code(), code, "{shown}");
            assert_eq!(info(&status).0, reason_name(reason), "{shown}");
        }
    }
}

/// The numbers errors.proto and docs/operating.md quote are the constants' (and
/// the registry defaults') values: a bound changed in code and not in the
/// contract fails here.
#[cfg(test)]
mod quoted_limits {
    use crate::core::limits::*;

    /// `1_000_000` as the docs write numbers.
    fn grouped(n: u64) -> String {
        let digits = n.to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push('_');
            }
            out.push(c);
        }
        out
    }

    /// A comment block as one line: wrapped lines joined by single spaces.
    fn prose(text: &str) -> String {
        text.lines()
            .map(|l| l.trim().trim_start_matches("//").trim())
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn secs(ms: u64) -> String {
        assert_eq!(ms % 1_000, 0, "{ms} ms is quoted in whole seconds");
        format!("{} s", ms / 1_000)
    }

    fn u(n: impl TryInto<u64>) -> u64 {
        n.try_into().ok().expect("a non-negative bound")
    }

    #[test]
    fn the_numbers_the_contract_quotes_are_the_constants() {
        let errors = prose(include_str!(
            "../../proto/delegation/broker/v1/errors.proto"
        ));
        let readme = prose(include_str!("../../docs/operating.md"));
        let broker = prose(include_str!(
            "../../proto/delegation/broker/v1/broker.proto"
        ));
        let defaults = crate::config::Limits::default();
        let quotes = [
            (
                &broker,
                format!(
                    "looks at no more than {} roots",
                    grouped(u(MAX_ROOTS_SCANNED)).replace('_', ",")
                ),
            ),
            (
                &errors,
                format!("at most {} bytes", grouped(u(MAX_STATUS_MESSAGE_BYTES))),
            ),
            (
                &errors,
                format!("over {} bytes", grouped(u(MAX_SESSION_BYTES))),
            ),
            (
                &errors,
                format!("above 10^{}", u(MAX_BUDGET_UNITS).to_string().len() - 1),
            ),
            (
                &errors,
                format!(
                    "\"MAX_OBSERVATIONS_PER_CONTRACT\" ({} observations per contract",
                    grouped(u(MAX_OBSERVATIONS_PER_CONTRACT))
                ),
            ),
            (
                &errors,
                format!(
                    "\"MAX_AUDIT_ROWS\" ({} rows read)",
                    grouped(u(MAX_AUDIT_ROWS))
                ),
            ),
            (
                &errors,
                format!("\"MAX_AUDIT_BYTES\" ({} MiB read)", MAX_AUDIT_BYTES >> 20),
            ),
            (
                &errors,
                format!(
                    "\"MAX_AGGREGATE_RUNS\" ({} runs",
                    grouped(u(MAX_AGGREGATE_RUNS))
                ),
            ),
            (
                &errors,
                format!(
                    "predicate composition) within {}",
                    secs(CONVERSION_DEADLINE_MS)
                ),
            ),
            (
                &errors,
                format!("already had {MAX_WAITING_PER_TENANT} Delegates waiting"),
            ),
            (
                &errors,
                format!("could not be judged within {}", secs(JUDGMENT_DEADLINE_MS)),
            ),
            (
                &errors,
                format!("already had {MAX_WAITING_PER_TENANT} completions waiting"),
            ),
            (
                &errors,
                format!("contracts) {MAX_TX_ATTEMPTS} times in a row"),
            ),
            (
                &errors,
                format!(
                    "limits.timestamp_window_ms (default {} ms)",
                    grouped(u(defaults.timestamp_window_ms))
                ),
            ),
            (
                &errors,
                format!(
                    "limits.request_timeout_ms (default {}",
                    secs(defaults.request_timeout_ms)
                ),
            ),
            (&readme, format!("at most {KEYS_MAX_AGE_MS} ms old")),
            (
                &readme,
                format!("at most {MAX_WAITING_PER_TENANT} requests waiting"),
            ),
            (
                &readme,
                format!("ends at the {} deadline", secs(JUDGMENT_DEADLINE_MS)),
            ),
        ];
        for (text, quote) in quotes {
            assert!(text.contains(&quote), "the docs no longer say {quote:?}");
        }
        // The two deadlines docs/operating.md quotes as one.
        assert_eq!(JUDGMENT_DEADLINE_MS, CONVERSION_DEADLINE_MS);
    }
}

/// The status code, reason and `ErrorInfo` metadata of each error: the
/// one exhaustive mapping.
fn classify(e: &ServiceError) -> (Code, pb::ErrorReason, Vec<(&'static str, String)>) {
    use pb::ErrorReason as R;
    match e {
        ServiceError::Invalid(input) => (
            Code::InvalidArgument,
            R::InvalidField,
            vec![("field", input.field.to_owned())],
        ),
        ServiceError::Unauthenticated { reason, .. } => (Code::Unauthenticated, *reason, vec![]),
        ServiceError::IdentityRefused { check, .. } => (
            Code::Unauthenticated,
            R::IdentityRefused,
            vec![("check", (*check).to_owned())],
        ),
        ServiceError::NotFound { what, id } => (
            Code::NotFound,
            R::NotFound,
            vec![("what", what.as_str().to_owned()), ("id", id.clone())],
        ),
        ServiceError::PermissionDenied { reason, .. } => (Code::PermissionDenied, *reason, vec![]),
        ServiceError::OverAllowance { requested, allowed } => (
            Code::PermissionDenied,
            R::RootBudgetOverAllowance,
            vec![
                ("field", "body.budget".to_owned()),
                ("requested", requested.to_string()),
                ("allowed", allowed.to_string()),
            ],
        ),
        ServiceError::FailedPrecondition { reason, .. } => {
            (Code::FailedPrecondition, *reason, vec![])
        }
        ServiceError::NonceReused => (
            Code::AlreadyExists,
            R::NonceReused,
            vec![("field", "body.header.nonce".into())],
        ),
        ServiceError::Overloaded(what) => (
            Code::ResourceExhausted,
            R::Overloaded,
            vec![("limit", (*what).to_owned())],
        ),
        ServiceError::ResponseTooLarge { size, limit, .. } => (
            Code::ResourceExhausted,
            R::ResponseTooLarge,
            vec![
                ("limit", crate::config::keys::max_request_bytes.to_owned()),
                ("size", size.to_string()),
                ("allowed", limit.to_string()),
            ],
        ),
        // UNAVAILABLE: standard gRPC retry policies retry it, and a
        // retry with the same nonce is safe.
        ServiceError::Busy => (
            Code::Unavailable,
            R::Overloaded,
            vec![("limit", crate::config::keys::writer_queue_depth.to_owned())],
        ),
        ServiceError::Unavailable(_) => (Code::Unavailable, R::Unavailable, vec![]),
        ServiceError::Retry { reason, .. } => (Code::Unavailable, *reason, vec![]),
        ServiceError::Internal(_) => (Code::Internal, R::Internal, vec![]),
        ServiceError::ShuttingDown => (Code::Unavailable, R::Unavailable, vec![]),
        ServiceError::UnknownHealthService(_) => (
            Code::NotFound,
            R::NotFound,
            vec![("what", "service".to_owned())],
        ),
    }
}
