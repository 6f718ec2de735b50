//! The one error of every call to the broker.

use serde_json::Value;

/// What went wrong with a call to the broker, as every client of this
/// crate reports it: the broker's reason (`ErrorInfo.reason`, or the gRPC
/// code's name when the transport failed), the request field it names,
/// the message, and facts beside them (a refusal's violations with their
/// requested and allowed values, a path). A gateway maps it to its own
/// protocol's error in one function.
#[derive(Debug)]
pub struct BrokerError {
    pub reason: String,
    pub field: Option<String>,
    pub message: String,
    /// More facts for the model (requested and allowed values, a path),
    /// beside the three above in the error object.
    pub details: serde_json::Map<String, Value>,
}

impl BrokerError {
    pub fn new(reason: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            field: None,
            message: message.into(),
            details: serde_json::Map::new(),
        }
    }

    pub fn input(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            ..Self::new("INVALID_INPUT", message)
        }
    }

    /// Adds a fact to the error object.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.details.insert(key.into(), value.into());
        self
    }
}

/// `REASON (field FIELD): message`, as a terminal shows it.
impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.reason)?;
        if let Some(field) = &self.field {
            write!(f, " (field {field})")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for BrokerError {}

/// An error with its causes ("error sending request: … Connection
/// refused"): transport errors' own text is terse and names none.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl From<tonic::Status> for BrokerError {
    fn from(status: tonic::Status) -> Self {
        use tonic_types::StatusExt as _;
        let reason = status
            .get_details_error_info()
            .map(|info| info.reason)
            .unwrap_or_else(|| crate::names::code_name_of(status.code()));
        let field = status
            .get_details_bad_request()
            .and_then(|b| b.field_violations.first().map(|v| v.field.clone()))
            // The broker names a request body's fields `body.x`; callers
            // name them without the prefix.
            .map(|f| f.strip_prefix("body.").map(str::to_owned).unwrap_or(f));
        Self {
            field,
            ..Self::new(&reason, status.message())
        }
    }
}
