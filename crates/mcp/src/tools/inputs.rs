//! What the model sends: each tool's input (its doc comments are the
//! published schema's descriptions), how its values are parsed, and the
//! check of a call's arguments against that schema before any tool runs.

use std::collections::{BTreeMap, HashMap};

use rmcp::schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use broker_client::BrokerError;
use broker_domain::limits;
use broker_wire::clock::Clock as _;
use broker_wire::pb;

/// Longest text field a tool takes (tasks, reasons, claims, intents): a
/// bound on what is signed and sent; the broker has its own, smaller
/// limits for each and names them.
const MAX_TEXT_BYTES: usize = 64 * 1024;
/// Most labels `open_root` takes: a bound on what is signed and sent; the
/// broker's own, smaller limit (`limits::MAX_LABELS`) refuses past it and
/// names it.
const MAX_LABELS_SENT: usize = 64;
/// `open_root`'s defaults, as `OpenRootInput` documents them: a root open
/// for an hour, 4 hops deep, 64 children a contract.
pub const DEFAULT_ROOT_TTL_MS: i64 = 60 * 60 * 1000;
pub const DEFAULT_MAX_DEPTH: u32 = 4;
pub const DEFAULT_MAX_CHILDREN: u32 = 64;
/// Most characters of a schema error quoted back: it quotes the offending
/// value, and a model's context is small.
const MAX_SCHEMA_ERROR_CHARS: usize = 512;

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct OpenRootInput {
    /// The run's intent, verbatim: every contract of the tree commits to it.
    pub intent: String,
    /// Budget units the root carries.
    pub budget: i64,
    /// Time to live, in milliseconds from now (default one hour).
    pub ttl_ms: Option<i64>,
    /// Most hops below the root (default 4).
    pub max_depth: Option<u32>,
    /// Most children of one contract (default 64).
    pub max_children: Option<u32>,
    /// Lowest cumulative trust, in parts per million (default 0).
    pub min_cumulative_trust_ppm: Option<u32>,
    /// Refuse children that would leave their parent unable to retry once
    /// (default true).
    pub retry_headroom: Option<bool>,
    /// Path prefixes the run may write (default: none).
    pub write_scope: Option<Vec<String>>,
    /// CEL acceptance predicate over `result` (default: none).
    pub predicate: Option<String>,
    /// Labels of the run, e.g. {"arm": "flat"}.
    pub labels: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct DelegateInput {
    /// The contract to delegate from (64 hex characters); you must hold it.
    pub parent_id: String,
    /// Who receives it: a name from the address book or a 64-hex public key.
    pub delegate: String,
    /// The child's own task text.
    pub task: String,
    /// Budget units to reserve from the parent's residual.
    pub budget: i64,
    /// Time to live in milliseconds from now (default: the parent's deadline).
    pub ttl_ms: Option<i64>,
    /// Path prefixes the child may write, each under one of the parent's
    /// (default: none, nothing writable).
    pub write_scope: Option<Vec<String>>,
    /// CEL predicate the child's completion must also satisfy.
    pub predicate: Option<String>,
    /// "principal" (you keep liability, default) or "delegate".
    pub liability: Option<String>,
    /// What one retry of this work costs, in units.
    pub min_retry_cost: Option<i64>,
    /// How long one retry takes, in milliseconds.
    pub min_retry_latency_ms: Option<i64>,
    /// Where the delegate escalates (required with liability "delegate"
    /// and no predicate).
    pub escalation_channel: Option<String>,
    /// The host whose observations count: a name or a hex key.
    pub host: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ContractInput {
    /// The contract (64 hex characters).
    pub contract_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct AcceptInput {
    /// The contract you hold as its delegate (64 hex characters).
    pub contract_id: String,
    /// Your host, if Delegate did not name one: a name or a hex key.
    pub host: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ReasonInput {
    /// The contract (64 hex characters).
    pub contract_id: String,
    /// Why, in a sentence: it goes into the signed receipt.
    pub reason: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct CompleteInput {
    /// The contract you hold as its delegate (64 hex characters).
    pub contract_id: String,
    /// Your output, any JSON value (judged against the contract's schema).
    pub output: Value,
    /// What you claim you did.
    pub claim: String,
    /// Budget units you consumed (host metering, when there is any, wins).
    pub consumed: i64,
}

/// A 32-byte id given as 64 hex characters.
pub fn id(text: &str, field: &str) -> Result<Vec<u8>, BrokerError> {
    hex::decode(text.trim())
        .ok()
        .filter(|b| b.len() == 32)
        .ok_or_else(|| BrokerError::input(field, "must be 64 hex characters (a 32-byte id)"))
}

/// A text field, at most `MAX_TEXT_BYTES`.
pub fn text(value: &str, field: &str) -> Result<String, BrokerError> {
    if value.len() > MAX_TEXT_BYTES {
        return Err(BrokerError::input(
            field,
            format!("is {} bytes, at most {MAX_TEXT_BYTES}", value.len()),
        ));
    }
    Ok(value.to_owned())
}

/// A time to live as a deadline (0, the parent's, when none is given).
pub fn deadline(ttl_ms: Option<i64>, field: &str) -> Result<i64, BrokerError> {
    match ttl_ms {
        None => Ok(0),
        Some(ttl) if ttl > 0 && ttl <= limits::MAX_HORIZON_MS => {
            Ok(broker_wire::clock::SystemClock.now_ms().saturating_add(ttl))
        }
        Some(ttl) => Err(BrokerError::input(
            field,
            format!("{ttl} ms: must be 1 ..= {} ms", limits::MAX_HORIZON_MS),
        )),
    }
}

/// Who keeps liability: "principal" (the default) or "delegate".
pub fn liability(liability: Option<&str>) -> Result<pb::Liability, BrokerError> {
    match liability {
        None | Some("principal") => Ok(pb::Liability::Principal),
        Some("delegate") => Ok(pb::Liability::Delegate),
        Some(other) => Err(BrokerError::input(
            "liability",
            format!("{other:?}: \"principal\" or \"delegate\""),
        )),
    }
}

/// Write-scope prefixes, at most as many as a contract may have.
pub fn write_scope(write_scope: Option<Vec<String>>) -> Result<Vec<String>, BrokerError> {
    let write_scope = write_scope.unwrap_or_default();
    if write_scope.len() > limits::MAX_SCOPE_PREFIXES {
        return Err(BrokerError::input(
            "write_scope",
            format!("at most {} prefixes", limits::MAX_SCOPE_PREFIXES),
        ));
    }
    Ok(write_scope)
}

/// A run's labels, at most `MAX_LABELS_SENT`.
pub fn labels(
    labels: Option<BTreeMap<String, String>>,
) -> Result<BTreeMap<String, String>, BrokerError> {
    let labels = labels.unwrap_or_default();
    if labels.len() > MAX_LABELS_SENT {
        return Err(BrokerError::input(
            "labels",
            format!("at most {MAX_LABELS_SENT} labels"),
        ));
    }
    Ok(labels)
}

/// Checks a call's arguments against the tool's published input schema
/// first, so a wrong type, a missing or an unknown argument is a tool error
/// naming the argument (what the model must fix), before any parsing.
pub struct ArgumentCheck(HashMap<String, jsonschema::Validator>);

impl ArgumentCheck {
    pub fn new(tools: &[rmcp::model::Tool]) -> anyhow::Result<Self> {
        tools
            .iter()
            .map(|tool| {
                let schema = Value::Object((*tool.input_schema).clone());
                let validator = jsonschema::validator_for(&schema).map_err(|e| {
                    anyhow::anyhow!(
                        "the input schema of tool {} does not compile: {e}",
                        tool.name
                    )
                })?;
                Ok((tool.name.to_string(), validator))
            })
            .collect::<anyhow::Result<_>>()
            .map(Self)
    }

    pub fn check(
        &self,
        tool: &str,
        arguments: &serde_json::Map<String, Value>,
    ) -> Result<(), BrokerError> {
        let Some(validator) = self.0.get(tool) else {
            return Ok(());
        };
        let instance = Value::Object(arguments.clone());
        let Some(error) = validator.iter_errors(&instance).next() else {
            return Ok(());
        };
        use jsonschema::error::ValidationErrorKind as Kind;
        let pointer = error.instance_path().as_str().to_owned();
        let field = match error.kind() {
            Kind::Required { property } => property.as_str().unwrap_or_default().to_owned(),
            Kind::AdditionalProperties { unexpected } => unexpected.join(", "),
            _ => pointer
                .trim_start_matches('/')
                .split('/')
                .next()
                .unwrap_or_default()
                .to_owned(),
        };
        let message: String = error
            .to_string()
            .chars()
            .take(MAX_SCHEMA_ERROR_CHARS)
            .collect();
        Err(BrokerError::input(&field, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field(check: &ArgumentCheck, tool: &str, args: Value) -> Option<String> {
        let args = args.as_object().expect("an object").clone();
        check.check(tool, &args).err().and_then(|e| e.field)
    }

    #[test]
    fn every_schema_compiles_and_a_bad_argument_is_named() {
        let tools = super::super::Tools::tool_router().list_all();
        let check = ArgumentCheck::new(&tools).expect("every schema compiles");
        assert_eq!(check.0.len(), tools.len());
        let ok = json!({"parent_id": "00", "delegate": "x", "task": "t", "budget": 5});
        assert_eq!(field(&check, "delegate", ok), None);
        let wrong_type = json!({"parent_id": "00", "delegate": "x", "task": "t", "budget": "ten"});
        assert_eq!(
            field(&check, "delegate", wrong_type).as_deref(),
            Some("budget")
        );
        let missing = json!({"parent_id": "00", "delegate": "x", "task": "t"});
        assert_eq!(
            field(&check, "delegate", missing).as_deref(),
            Some("budget")
        );
        let unknown = json!({"contract_id": "00", "bogus": 1});
        assert_eq!(
            field(&check, "get_contract", unknown).as_deref(),
            Some("bogus")
        );
        let null_optional = json!({"contract_id": "00", "host": null});
        assert_eq!(field(&check, "accept", null_optional), None);
    }
}
