//! The delegation extension for A2A (proto/delegation/broker/v1/
//! a2a-extension.md) as pure functions: where the chain rides in a message,
//! the terms a calling agent may set, the output a task's artifacts give,
//! which broker call a task state asks for, and what a returned task says
//! of its contract. No I/O, no clock: the gateway's shell calls these.

use std::collections::BTreeMap;

use a2a_pb::protojson::{self as a2a, TaskState};
use base64::Engine as _;
use prost::Message as _;
use serde_json::{Map, Value, json};

use broker_domain::Id;
// A Decline or Escalate reason taken from a status message, and the
// `output_json` of a completion, are cut or refused at the broker's own
// limits on them.
use broker_domain::limits::{MAX_REASON_BYTES, MAX_RESULT_BYTES};
use broker_wire::pb;

/// The extension's URI: the key of its metadata and its entry in
/// `Message.extensions` and the agent card.
pub const URI: &str = "urn:delegation-broker:a2a:delegation:v1";
/// The `google.rpc.ErrorInfo` domain of every error the gateway returns
/// (the broker's, errors.proto).
pub const DOMAIN: &str = "delegation.broker.v1";
/// Longest task text taken from a message's first text part when neither
/// the message's terms nor the route name one. The gateway's own bound,
/// under the broker's `MAX_TEXT_BYTES`: the whole message still goes to
/// the peer, while the contract (which every descendant's chain carries)
/// keeps only this much of it as its task.
pub const MAX_TASK_TEXT_BYTES: usize = 4096;
/// Most parts in one message or artifact, and most artifacts in a task:
/// the gateway's own bound on the work of reading one message.
pub const MAX_PARTS: usize = 256;
/// Largest extension metadata object (its JSON text) a message may carry:
/// the gateway's own bound, read before the chain in it is decoded; a
/// chain of `MAX_CHAIN_CONTRACTS` contracts in base64 fits.
pub const MAX_EXTENSION_BYTES: usize = 512 * 1024;
/// Bytes of a contract id (a SHA-256), as the broker names contracts.
const ID_BYTES: usize = std::mem::size_of::<Id>();
/// Whole numbers below this are exact as doubles (2^53 is about 9.007e15),
/// so a ProtoJSON double under it converts to the integer it spells.
const MAX_EXACT_WHOLE_DOUBLE: f64 = 9.0e15;
/// Longest name quoted back in an error when it is not one the gateway
/// knows (a JSON-RPC method, a JSON key): the gateway's own bound; names
/// are identifiers, and 64 bytes show any real one whole.
pub const MAX_ECHOED_NAME_BYTES: usize = 64;

/// A refusal in A2A terms: the JSON-RPC code, the ErrorInfo reason, a
/// message that says everything (clients may drop the details) and the
/// ErrorInfo metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub code: i32,
    pub reason: String,
    pub message: String,
    pub metadata: BTreeMap<String, String>,
}

/// JSON-RPC codes (A2A v1 and JSON-RPC 2.0).
pub mod code {
    pub const TASK_NOT_FOUND: i32 = -32001;
    pub const TASK_NOT_CANCELABLE: i32 = -32002;
    pub const PUSH_NOT_SUPPORTED: i32 = -32003;
    pub const UNSUPPORTED_OPERATION: i32 = -32004;
    pub const EXTENSION_REQUIRED: i32 = -32008;
    pub const INVALID_REQUEST: i32 = -32600;
    pub const METHOD_NOT_FOUND: i32 = -32601;
    pub const INVALID_PARAMS: i32 = -32602;
    pub const INTERNAL: i32 = -32603;
    pub const PARSE_ERROR: i32 = -32700;
}

/// A caller's input quoted back in an error: at most the broker's own
/// bound on echoed input (`MAX_ECHOED_INPUT_BYTES`), so a huge bad value
/// does not make a huge error.
pub fn echoed(text: &str) -> String {
    broker_client::names::cut(text, broker_domain::limits::MAX_ECHOED_INPUT_BYTES)
}

impl Refused {
    pub fn new(code: i32, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
            metadata: BTreeMap::new(),
        }
    }

    pub fn with(mut self, key: &str, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// The JSON-RPC error object, ErrorInfo in `data` as A2A's SDKs read it.
    pub fn to_jsonrpc(&self) -> Value {
        json!({
            "code": self.code,
            "message": self.message,
            "data": [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": self.reason,
                "domain": DOMAIN,
                "metadata": self.metadata,
            }],
        })
    }
}

/// A struct's fields as JSON (pbjson's Struct serializes as an object).
fn to_json(metadata: &Option<pbjson_types::Struct>) -> Map<String, Value> {
    match metadata.as_ref().map(serde_json::to_value) {
        Some(Ok(Value::Object(map))) => map,
        _ => Map::new(),
    }
}

fn from_json(map: Map<String, Value>) -> Option<pbjson_types::Struct> {
    if map.is_empty() {
        return None;
    }
    serde_json::from_value(Value::Object(map)).ok()
}

/// Removes the extension's object from a message (its metadata and its
/// entry in `extensions`) and returns it; `None` when it was not there.
pub fn take(message: &mut a2a::Message) -> Result<Option<Map<String, Value>>, Refused> {
    let mut metadata = to_json(&message.metadata);
    let Some(ext) = metadata.remove(URI) else {
        return Ok(None);
    };
    message.metadata = from_json(metadata);
    message.extensions.retain(|uri| uri != URI);
    let size = ext.to_string().len();
    if size > MAX_EXTENSION_BYTES {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "MESSAGE_TOO_LARGE",
            format!("message.metadata[{URI}] is {size} bytes, at most {MAX_EXTENSION_BYTES}"),
        ));
    }
    match ext {
        Value::Object(map) => Ok(Some(map)),
        _ => Err(Refused::new(
            code::INVALID_PARAMS,
            "INVALID_FIELD",
            format!("message.metadata[{URI}] must be an object"),
        )
        .with("field", format!("message.metadata[{URI}]"))),
    }
}

/// Puts a chain in a message, listing the extension.
pub fn attach_chain(message: &mut a2a::Message, chain: &pb::GetChainResponse) {
    let mut metadata = to_json(&message.metadata);
    let encoded = base64::engine::general_purpose::STANDARD.encode(chain.encode_to_vec());
    metadata.insert(URI.into(), json!({ "chain": encoded }));
    message.metadata = from_json(metadata);
    if !message.extensions.iter().any(|uri| uri == URI) {
        message.extensions.push(URI.into());
    }
}

/// Marks a forwarded message with its contract's id: the agent's own task
/// history then records the contract, and a restarted gateway finds it
/// there (`marked`).
pub fn mark(message: &mut a2a::Message, contract_id: &[u8]) {
    let mut metadata = to_json(&message.metadata);
    metadata.insert(
        URI.into(),
        json!({ "contractId": hex::encode(contract_id) }),
    );
    message.metadata = from_json(metadata);
}

/// The contract a task's first marked message names.
pub fn marked(task: &a2a::Task) -> Option<Vec<u8>> {
    task.history.iter().find_map(|message| {
        let metadata = to_json(&message.metadata);
        let id = metadata.get(URI)?.get("contractId")?.as_str()?;
        hex::decode(id).ok().filter(|id| id.len() == ID_BYTES)
    })
}

/// The contract a task was started under, from the agent's own record of
/// its first message: the contract id the ingress marked it with, or the
/// leaf of the chain it carried through a proxy (checked then by
/// `Authorization/Check`, before the agent saw it). Later messages do not
/// count: a caller may put any chain in a message of a running task.
pub fn started_under(task: &a2a::Task) -> Option<Vec<u8>> {
    let first = task.history.first()?;
    let metadata = to_json(&first.metadata);
    let ext = metadata.get(URI)?.as_object()?;
    if let Some(id) = ext.get("contractId") {
        return hex::decode(id.as_str()?)
            .ok()
            .filter(|id| id.len() == ID_BYTES);
    }
    let chain = chain_of(Some(ext)).ok()?;
    let leaf = chain.chain.last()?.contract.as_ref()?;
    Some(broker_wire::crypto::sha256(&leaf.payload).to_vec())
}

/// The chain a task-starting message carries, decoded (not yet verified).
pub fn chain_of(ext: Option<&Map<String, Value>>) -> Result<pb::GetChainResponse, Refused> {
    let field = format!("message.metadata[{URI}].chain");
    let missing = || {
        Refused::new(
            code::EXTENSION_REQUIRED,
            "INVALID_FIELD",
            format!(
                "this agent takes a task only under a delegation-broker contract: put its GetChain answer (base64) in {field} and list {URI} in message.extensions"
            ),
        )
        .with("field", field.clone())
    };
    let text = ext
        .ok_or_else(missing)?
        .get("chain")
        .ok_or_else(missing)?
        .as_str()
        .ok_or_else(|| {
            Refused::new(
                code::INVALID_PARAMS,
                "INVALID_FIELD",
                format!("{field} must be a string"),
            )
            .with("field", field.clone())
        })?;
    let undecodable = |why: String| {
        Refused::new(
            code::INVALID_PARAMS,
            "UNDECODABLE_MESSAGE",
            format!("{field}: {why}"),
        )
        .with("field", field.clone())
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| undecodable(format!("not standard base64 ({e})")))?;
    pb::GetChainResponse::decode(bytes.as_slice())
        .map_err(|e| undecodable(format!("not a GetChainResponse ({e})")))
}

/// Delegate terms a calling agent set (`terms`), every key optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Terms {
    pub budget: Option<i64>,
    pub ttl_ms: Option<i64>,
    pub task: Option<String>,
    pub predicate: Option<String>,
    pub result_schema_json: Option<String>,
    pub write_scope: Option<Vec<String>>,
    pub min_retry_cost: Option<i64>,
    pub min_retry_latency_ms: Option<i64>,
}

/// What a calling agent asked of its gateway for one outbound message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outbound {
    /// The parent contract, when the agent named it.
    pub contract_id: Option<Vec<u8>>,
    pub terms: Terms,
}

/// Reads an outbound message's extension object (`contractId`, `terms`).
pub fn outbound(ext: Option<Map<String, Value>>) -> Result<Outbound, Refused> {
    let Some(mut ext) = ext else {
        return Ok(Outbound::default());
    };
    let bad = |key: &str, why: String| {
        let field = format!("message.metadata[{URI}].{key}");
        Refused::new(
            code::INVALID_PARAMS,
            "INVALID_FIELD",
            format!("{field}: {why}"),
        )
        .with("field", field)
    };
    let contract_id = match ext.remove("contractId") {
        None | Some(Value::Null) => None,
        Some(Value::String(hex_id)) => Some(
            hex::decode(&hex_id)
                .ok()
                .filter(|id| id.len() == ID_BYTES)
                .ok_or_else(|| bad("contractId", format!("must be {} hex digits", 2 * ID_BYTES)))?,
        ),
        Some(_) => return Err(bad("contractId", "must be a string".into())),
    };
    let terms = match ext.remove("terms") {
        None | Some(Value::Null) => Terms::default(),
        Some(value) => serde_json::from_value(numbers_as_integers(value))
            .map_err(|e| bad("terms", e.to_string()))?,
    };
    Ok(Outbound { contract_id, terms })
}

/// ProtoJSON numbers are doubles: `30.0` for 30. Whole numbers become
/// integers so the terms' integer fields take them.
fn numbers_as_integers(value: Value) -> Value {
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < MAX_EXACT_WHOLE_DOUBLE => {
                json!(f as i64)
            }
            _ => Value::Number(n),
        },
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, numbers_as_integers(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(numbers_as_integers).collect()),
        other => other,
    }
}

/// The first text part of a message, cut to `max` bytes.
pub fn first_text(parts: &[a2a::Part], max: usize) -> Option<String> {
    parts.iter().find_map(|part| match &part.content {
        Some(a2a::part::Content::Text(text)) if !text.trim().is_empty() => {
            Some(broker_client::names::cut(text, max))
        }
        _ => None,
    })
}

fn part_json(part: &a2a::Part) -> Value {
    match &part.content {
        Some(a2a::part::Content::Data(value)) => {
            numbers_as_integers(serde_json::to_value(value).unwrap_or(Value::Null))
        }
        Some(a2a::part::Content::Text(text)) => Value::String(text.clone()),
        _ => Value::Null,
    }
}

/// `output_json` of a completion: one array per artifact of its parts'
/// values; one artifact of one part gives that value alone.
pub fn output_json(artifacts: &[a2a::Artifact]) -> Result<String, Refused> {
    let value = match artifacts {
        [only] if only.parts.len() == 1 => part_json(&only.parts[0]),
        _ => Value::Array(
            artifacts
                .iter()
                .take(MAX_PARTS)
                .map(|a| Value::Array(a.parts.iter().take(MAX_PARTS).map(part_json).collect()))
                .collect(),
        ),
    };
    let text = value.to_string();
    if text.len() > MAX_RESULT_BYTES {
        return Err(Refused::new(
            code::INTERNAL,
            "MESSAGE_TOO_LARGE",
            format!(
                "the task's artifacts are {} bytes as JSON, the broker takes at most {MAX_RESULT_BYTES}",
                text.len()
            ),
        ));
    }
    Ok(text)
}

/// The text of a task status's message (for a Decline or Escalate reason).
pub fn status_text(status: Option<&a2a::TaskStatus>, fallback: &str) -> String {
    status
        .and_then(|s| s.message.as_ref())
        .and_then(|m| first_text(&m.parts, MAX_REASON_BYTES))
        .unwrap_or_else(|| fallback.to_owned())
}

/// The broker call a task state asks of the delegate's gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing yet (the task is not started, or already handled).
    Wait,
    Accept,
    Complete {
        claim: &'static str,
    },
    Escalate {
        reason: String,
    },
    Decline {
        reason: String,
    },
}

/// Where a task's contract stands, as the gateway has moved it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub accepted: bool,
    /// Completed, escalated or declined: nothing more to call.
    pub ended: bool,
}

/// The next broker call for a task in `state`: `Accept` first for any
/// state but REJECTED and CANCELED, then the call that ends the contract.
pub fn step(state: TaskState, status: Option<&a2a::TaskStatus>, progress: Progress) -> Step {
    if progress.ended {
        return Step::Wait;
    }
    match state {
        TaskState::Unspecified => Step::Wait,
        TaskState::Rejected if !progress.accepted => Step::Decline {
            reason: status_text(status, "the agent rejected the task"),
        },
        TaskState::Canceled if !progress.accepted => Step::Decline {
            reason: status_text(status, "the agent canceled the task"),
        },
        _ if !progress.accepted => Step::Accept,
        TaskState::Submitted | TaskState::Working => Step::Wait,
        TaskState::Completed => Step::Complete { claim: "completed" },
        TaskState::Failed => Step::Complete { claim: "failed" },
        TaskState::InputRequired => Step::Escalate {
            reason: status_text(status, "the agent needs input"),
        },
        TaskState::AuthRequired => Step::Escalate {
            reason: status_text(status, "the agent needs authorization"),
        },
        // Decline takes an OPEN contract only: once accepted, a task the
        // agent gives up ends as a failed completion (a root, which has
        // no principal to escalate to, included), judged like any other.
        TaskState::Rejected => Step::Complete { claim: "rejected" },
        TaskState::Canceled => Step::Complete { claim: "canceled" },
    }
}

/// Whether a state is one the task does not leave by itself.
pub fn is_settled(state: TaskState) -> bool {
    !matches!(
        state,
        TaskState::Unspecified | TaskState::Submitted | TaskState::Working
    )
}

/// The broker's word on a task, shown to the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Judged {
    pub contract_id: Vec<u8>,
    /// `ACCEPTED` or `REJECTED`, once judged.
    pub verdict: Option<&'static str>,
    pub failed_checks: Vec<String>,
    pub receipt_id: Option<Vec<u8>>,
}

impl Judged {
    /// Reads a COMPLETED receipt's verdict.
    pub fn completed(&mut self, receipt: &pb::Receipt) {
        let Some(completion) = &receipt.completion else {
            return;
        };
        self.verdict = match pb::Verdict::try_from(completion.verdict) {
            Ok(pb::Verdict::Accepted) => Some("ACCEPTED"),
            Ok(pb::Verdict::Rejected) => Some("REJECTED"),
            Ok(pb::Verdict::PendingPrincipal) => Some("PENDING_PRINCIPAL"),
            _ => None,
        };
        self.failed_checks = completion
            .refused_criteria
            .iter()
            .map(|c| format!("{}: {}", c.criterion, c.reason))
            .collect();
    }
}

/// Writes the broker's word into a task: `metadata[URI]`, and the state
/// FAILED (with a status message naming the failed checks) when the
/// broker rejected a completion the agent reported.
pub fn decorate(task: &mut a2a::Task, judged: &Judged) {
    let mut metadata = to_json(&task.metadata);
    let mut ext = json!({ "contractId": hex::encode(&judged.contract_id) });
    if let Some(verdict) = judged.verdict {
        ext["verdict"] = json!(verdict);
    }
    if !judged.failed_checks.is_empty() {
        ext["failedChecks"] = json!(judged.failed_checks);
    }
    if let Some(receipt_id) = &judged.receipt_id {
        ext["receiptId"] = json!(hex::encode(receipt_id));
    }
    metadata.insert(URI.into(), ext);
    task.metadata = from_json(metadata);
    let reported_completed = task
        .status
        .as_ref()
        .is_some_and(|s| s.state == TaskState::Completed as i32);
    if judged.verdict == Some("REJECTED") && reported_completed {
        let status = task.status.get_or_insert_with(Default::default);
        status.state = TaskState::Failed as i32;
        let text = format!(
            "The broker rejected this completion (contract {}): {}",
            hex::encode(&judged.contract_id),
            if judged.failed_checks.is_empty() {
                "the acceptance predicate did not hold".to_owned()
            } else {
                judged.failed_checks.join("; ")
            }
        );
        status.message = Some(a2a::Message {
            message_id: format!("broker-verdict-{}", hex::encode(&judged.contract_id)),
            context_id: task.context_id.clone(),
            task_id: task.id.clone(),
            role: a2a::Role::Agent as i32,
            parts: vec![a2a::Part {
                content: Some(a2a::part::Content::Text(text)),
                ..Default::default()
            }],
            ..Default::default()
        });
    }
}

/// A refused Delegate as an A2A error: every violation in the text.
pub fn refusal(receipt: &pb::Receipt, receipt_id: &[u8]) -> Refused {
    let listed = broker_client::names::listed_violations(receipt);
    let primary = broker_client::names::code_name(receipt.primary);
    Refused::new(
        code::INVALID_PARAMS,
        &primary,
        format!(
            "the delegation broker refused this delegation: {}. Nothing was sent to the agent; change the named terms (message.metadata[{URI}].terms) and send again.",
            listed.join("; ")
        ),
    )
    .with("violations", listed.join("; "))
    .with("receiptId", hex::encode(receipt_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(value: Value) -> a2a::Part {
        a2a::Part {
            content: Some(a2a::part::Content::Data(
                serde_json::from_value(value).unwrap(),
            )),
            ..Default::default()
        }
    }

    fn text(value: &str) -> a2a::Part {
        a2a::Part {
            content: Some(a2a::part::Content::Text(value.into())),
            ..Default::default()
        }
    }

    #[test]
    fn a_chain_rides_in_metadata_and_comes_out_whole() {
        let chain = pb::GetChainResponse {
            chain: vec![pb::ContractState {
                contract_id: vec![7; 32],
                ..Default::default()
            }],
        };
        let mut message = a2a::Message {
            metadata: serde_json::from_value(json!({"other": 1})).unwrap(),
            ..Default::default()
        };
        attach_chain(&mut message, &chain);
        assert_eq!(message.extensions, vec![URI.to_owned()]);
        let ext = take(&mut message).unwrap();
        assert_eq!(chain_of(ext.as_ref()).unwrap(), chain);
        // What is forwarded keeps the agent's own metadata only.
        assert!(message.extensions.is_empty());
        assert_eq!(to_json(&message.metadata)["other"], json!(1.0));
        // Marked with its contract, the task's history names it.
        mark(&mut message, &[9; 32]);
        let task = a2a::Task {
            history: vec![message],
            ..Default::default()
        };
        assert_eq!(marked(&task), Some(vec![9; 32]));
    }

    #[test]
    fn a_missing_or_broken_chain_is_refused_with_its_reason() {
        let missing = chain_of(None).unwrap_err();
        assert_eq!(
            (missing.code, missing.reason.as_str()),
            (code::EXTENSION_REQUIRED, "INVALID_FIELD")
        );
        let ext = json!({"chain": "@@@"}).as_object().unwrap().clone();
        assert_eq!(
            chain_of(Some(&ext)).unwrap_err().reason,
            "UNDECODABLE_MESSAGE"
        );
        let ext = json!({"chain": "AAEC"}).as_object().unwrap().clone();
        assert_eq!(
            chain_of(Some(&ext)).unwrap_err().reason,
            "UNDECODABLE_MESSAGE"
        );
    }

    #[test]
    fn terms_take_protojson_doubles_and_refuse_unknown_keys() {
        let ext = json!({"terms": {"budget": 30.0, "ttlMs": 5000}, "contractId": "ab".repeat(32)});
        let out = outbound(ext.as_object().cloned()).unwrap();
        assert_eq!(out.terms.budget, Some(30));
        assert_eq!(out.terms.ttl_ms, Some(5000));
        assert_eq!(out.contract_id, Some(vec![0xab; 32]));
        let bad = json!({"terms": {"budgett": 1}});
        let refused = outbound(bad.as_object().cloned()).unwrap_err();
        assert!(refused.message.contains("budgett"), "{}", refused.message);
        let bad = json!({"contractId": "abc"});
        assert_eq!(
            outbound(bad.as_object().cloned()).unwrap_err().reason,
            "INVALID_FIELD"
        );
    }

    #[test]
    fn output_is_the_single_part_or_every_part_in_order() {
        let one = a2a::Artifact {
            parts: vec![data(json!({"answer": 42}))],
            ..Default::default()
        };
        assert_eq!(
            output_json(std::slice::from_ref(&one)).unwrap(),
            r#"{"answer":42}"#
        );
        let two = a2a::Artifact {
            parts: vec![text("hi"), data(json!([1.5]))],
            ..Default::default()
        };
        assert_eq!(
            output_json(&[one, two]).unwrap(),
            r#"[[{"answer":42}],["hi",[1.5]]]"#
        );
        assert_eq!(output_json(&[]).unwrap(), "[]");
    }

    #[test]
    fn states_map_to_the_lifecycle() {
        let fresh = Progress::default();
        let accepted = Progress {
            accepted: true,
            ended: false,
        };
        assert_eq!(step(TaskState::Working, None, fresh), Step::Accept);
        assert_eq!(step(TaskState::Completed, None, fresh), Step::Accept);
        assert_eq!(step(TaskState::Working, None, accepted), Step::Wait);
        assert_eq!(
            step(TaskState::Completed, None, accepted),
            Step::Complete { claim: "completed" }
        );
        assert_eq!(
            step(TaskState::Failed, None, accepted),
            Step::Complete { claim: "failed" }
        );
        let asking = a2a::TaskStatus {
            message: Some(a2a::Message {
                parts: vec![text("need the date range")],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            step(TaskState::InputRequired, Some(&asking), accepted),
            Step::Escalate {
                reason: "need the date range".into()
            }
        );
        assert!(matches!(
            step(TaskState::Rejected, None, fresh),
            Step::Decline { .. }
        ));
        let ended = Progress {
            accepted: true,
            ended: true,
        };
        assert_eq!(step(TaskState::Completed, None, ended), Step::Wait);
    }

    #[test]
    fn a_rejected_completion_is_returned_failed_with_the_checks() {
        let mut task = a2a::Task {
            id: "t".into(),
            status: Some(a2a::TaskStatus {
                state: TaskState::Completed as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let judged = Judged {
            contract_id: vec![1; 32],
            verdict: Some("REJECTED"),
            failed_checks: vec!["result.schema_valid: evaluated to false".into()],
            receipt_id: Some(vec![2; 32]),
        };
        decorate(&mut task, &judged);
        let status = task.status.as_ref().unwrap();
        assert_eq!(status.state, TaskState::Failed as i32);
        let said = first_text(&status.message.as_ref().unwrap().parts, 1000).unwrap();
        assert!(said.contains("schema_valid"), "{said}");
        let ext = to_json(&task.metadata)[URI].clone();
        assert_eq!(ext["verdict"], "REJECTED");
        assert_eq!(ext["contractId"], hex::encode([1u8; 32]));
    }

    #[test]
    fn a_refusal_lists_every_violation_in_its_text() {
        let receipt = pb::Receipt {
            primary: pb::InvariantCode::BudgetExceedsParent as i32,
            violations: vec![pb::Violation {
                code: pb::InvariantCode::BudgetExceedsParent as i32,
                requested: "60".into(),
                allowed: "40".into(),
                detail: "more than the parent holds".into(),
            }],
            ..Default::default()
        };
        let refused = refusal(&receipt, &[3; 32]);
        assert_eq!(refused.reason, "BUDGET_EXCEEDS_PARENT");
        assert!(
            refused
                .message
                .contains("BUDGET_EXCEEDS_PARENT (requested 60, allowed 40)"),
            "{}",
            refused.message
        );
        let rpc = refused.to_jsonrpc();
        assert_eq!(rpc["data"][0]["domain"], DOMAIN);
        assert_eq!(rpc["code"], code::INVALID_PARAMS);
    }
}
