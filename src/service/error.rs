//! The service layer's error and its one exhaustive mapping to a gRPC
//! status with a `google.rpc.ErrorInfo` (stable `reason`, metadata naming
//! the field or limit) — the only place an error becomes a status.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::core::InputError;
use crate::store::StoreError;

/// `ErrorInfo.domain` of every error this broker returns.
pub const ERROR_DOMAIN: &str = "delegation.broker.v1";

/// Longest status message, in bytes (see `core::error::MAX_ERROR_REASON_BYTES`).
pub const MAX_STATUS_MESSAGE_BYTES: usize = 1_536;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Malformed input, naming the field.
    #[error(transparent)]
    Invalid(#[from] InputError),
    /// The request's signature or timestamp does not hold.
    #[error("{detail}")]
    Unauthenticated {
        reason: &'static str,
        detail: String,
    },
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    /// The signer may not act on this contract.
    #[error("{detail}")]
    PermissionDenied {
        reason: &'static str,
        detail: String,
    },
    /// A listed orchestrator asked for a root above its allowance.
    #[error("body.budget {requested} exceeds this orchestrator's allowance of {allowed} per root")]
    OverAllowance { requested: i64, allowed: i64 },
    /// The contract's state does not allow it (ended, late, …).
    #[error("{detail}")]
    FailedPrecondition {
        reason: &'static str,
        detail: String,
    },
    /// The nonce was used before with a different body.
    #[error("nonce already used by this agent for a different request")]
    NonceReused,
    /// A limit was reached (named).
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
        reason: &'static str,
        detail: String,
    },
    #[error("internal error: {0}")]
    Internal(String),
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
                reason: "OBSERVATIONS_CHANGING",
                detail: "the completion's judgment went stale; retry with the same nonce".into(),
            },
            StoreError::Corrupt(what) => Self::Internal(format!("corrupt store: {what}")),
            StoreError::Backend(what) => Self::Unavailable(format!("store: {what}")),
        }
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Self {
        // Server-written details may quote stored or client text: bounded
        // like input reasons, so every error fits the 8 KiB trailers.
        let message = crate::core::error::bounded(e.to_string(), MAX_STATUS_MESSAGE_BYTES);
        let (code, reason, metadata): (Code, &str, Vec<(&str, String)>) = match &e {
            ServiceError::Invalid(input) => (
                Code::InvalidArgument,
                "INVALID_FIELD",
                vec![("field", input.field.to_owned())],
            ),
            ServiceError::Unauthenticated { reason, .. } => (Code::Unauthenticated, reason, vec![]),
            ServiceError::NotFound { what, id } => (
                Code::NotFound,
                "NOT_FOUND",
                vec![("what", (*what).to_owned()), ("id", id.clone())],
            ),
            ServiceError::PermissionDenied { reason, .. } => {
                (Code::PermissionDenied, reason, vec![])
            }
            ServiceError::OverAllowance { requested, allowed } => (
                Code::PermissionDenied,
                "ROOT_BUDGET_OVER_ALLOWANCE",
                vec![
                    ("field", "body.budget".to_owned()),
                    ("requested", requested.to_string()),
                    ("allowed", allowed.to_string()),
                ],
            ),
            ServiceError::FailedPrecondition { reason, .. } => {
                (Code::FailedPrecondition, reason, vec![])
            }
            ServiceError::NonceReused => (
                Code::AlreadyExists,
                "NONCE_REUSED",
                vec![("field", "body.header.nonce".into())],
            ),
            ServiceError::Overloaded(what) => (
                Code::ResourceExhausted,
                "OVERLOADED",
                vec![("limit", (*what).to_owned())],
            ),
            ServiceError::ResponseTooLarge { size, limit, .. } => (
                Code::ResourceExhausted,
                "RESPONSE_TOO_LARGE",
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
                "OVERLOADED",
                vec![("limit", crate::config::keys::writer_queue_depth.to_owned())],
            ),
            ServiceError::Unavailable(_) => (Code::Unavailable, "UNAVAILABLE", vec![]),
            ServiceError::Retry { reason, .. } => (Code::Unavailable, reason, vec![]),
            ServiceError::Internal(_) => (Code::Internal, "INTERNAL", vec![]),
        };
        if code == Code::Internal || code == Code::Unavailable {
            tracing::error!(error = %message, "request failed");
        }
        let metadata: HashMap<String, String> = metadata
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
        if let ServiceError::Invalid(input) = &e {
            details.add_bad_request_violation(input.field, input.reason.clone());
        }
        Status::with_error_details(code, message, details)
    }
}
