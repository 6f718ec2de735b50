//! What the gateway decides about one tool call, before it is forwarded
//! (its arguments' size and depth, the contract's state, budget and write
//! scope) and after (the observations it records). Pure: no I/O, so every
//! rule is unit-tested here.

use rmcp::model::JsonObject;
use serde_json::Value;

use super::config::{OutOfScope, ToolRule};
use broker_client::BrokerError;
use broker_client::names::status_name;
use broker_domain::limits;
use broker_domain::scope::Scope;
use broker_wire::pb;

/// Largest arguments of one call, serialized: a model's call is small; a
/// bigger one is refused before anything else is done with it.
pub const MAX_ARGUMENT_BYTES: usize = 64 * 1024;
/// Deepest JSON nesting of arguments: a model's arguments are shallow; a
/// deeper one is refused before anything walks it.
pub const MAX_ARGUMENT_DEPTH: usize = 32;
/// Most paths one argument may list: the gateway's own bound, so one
/// argument cannot take a whole call's share (`MAX_PATHS_PER_CALL`).
pub const MAX_PATHS_PER_ARGUMENT: usize = 64;
/// Most paths one call may name in all: with the call itself, one
/// RecordReceipts request's worth of observations.
pub const MAX_PATHS_PER_CALL: usize = limits::MAX_OBSERVATIONS_PER_REQUEST - 1;
/// Longest path recorded (the broker's limit on an observation's path).
pub const MAX_PATH_BYTES: usize = limits::MAX_OBSERVED_PATH_BYTES;
/// Longest tool name recorded (the broker's limit on an observation's tool).
pub const MAX_TOOL_NAME_BYTES: usize = limits::MAX_TOOL_NAME_BYTES;

/// Refuses arguments too large or too deep, before anything else.
pub fn check_arguments(arguments: Option<&JsonObject>) -> Result<(), BrokerError> {
    let Some(arguments) = arguments else {
        return Ok(());
    };
    let size = serde_json::to_vec(arguments).map_or(usize::MAX, |b| b.len());
    if size > MAX_ARGUMENT_BYTES {
        return Err(BrokerError::new(
            "ARGUMENTS_TOO_LARGE",
            format!("the arguments are {size} bytes serialized, at most {MAX_ARGUMENT_BYTES}; nothing was forwarded"),
        )
        .with("requested", size)
        .with("allowed", MAX_ARGUMENT_BYTES));
    }
    // Iterative, so no input can exhaust the stack.
    let mut stack: Vec<(&Value, usize)> = arguments.values().map(|v| (v, 2)).collect();
    while let Some((value, depth)) = stack.pop() {
        if depth > MAX_ARGUMENT_DEPTH {
            return Err(BrokerError::new(
                "ARGUMENTS_TOO_DEEP",
                format!("the arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels; nothing was forwarded"),
            )
            .with("allowed", MAX_ARGUMENT_DEPTH));
        }
        match value {
            Value::Array(items) => stack.extend(items.iter().map(|v| (v, depth + 1))),
            Value::Object(fields) => stack.extend(fields.values().map(|v| (v, depth + 1))),
            _ => {}
        }
    }
    Ok(())
}

/// The paths a call reads and mutates, from the arguments its rule names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paths {
    pub reads: Vec<String>,
    /// (argument name, path).
    pub mutates: Vec<(String, String)>,
}

pub fn paths(rule: &ToolRule, arguments: Option<&JsonObject>) -> Result<Paths, BrokerError> {
    let mut paths = Paths::default();
    let values = |name: &str| -> Result<Vec<String>, BrokerError> {
        let value = arguments.and_then(|a| a.get(name));
        let list: Vec<&Value> = match value {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(items)) if items.len() <= MAX_PATHS_PER_ARGUMENT => {
                items.iter().collect()
            }
            Some(Value::Array(items)) => {
                return Err(BrokerError::input(
                    name,
                    format!(
                        "lists {} paths, at most {MAX_PATHS_PER_ARGUMENT}",
                        items.len()
                    ),
                ));
            }
            Some(one) => vec![one],
        };
        list.into_iter()
            .map(|v| match v {
                Value::String(path) if path.len() <= MAX_PATH_BYTES => Ok(path.clone()),
                Value::String(path) => Err(BrokerError::input(
                    name,
                    format!("a path of {} bytes, at most {MAX_PATH_BYTES}", path.len()),
                )),
                _ => Err(BrokerError::input(
                    name,
                    "must be a path (a string) or a list of paths",
                )),
            })
            .collect()
    };
    for name in &rule.reads {
        paths.reads.extend(values(name)?);
    }
    for name in &rule.mutates {
        paths
            .mutates
            .extend(values(name)?.into_iter().map(|p| (name.clone(), p)));
    }
    let count = paths.reads.len() + paths.mutates.len();
    if count > MAX_PATHS_PER_CALL {
        return Err(BrokerError::new(
            "INVALID_INPUT",
            format!(
                "the call names {count} paths, at most {MAX_PATHS_PER_CALL}; nothing was forwarded"
            ),
        ));
    }
    Ok(paths)
}

/// What the gateway knows of its contract when a call comes.
#[derive(Clone, Debug)]
pub struct ContractView {
    pub id: [u8; 32],
    /// Its host now (empty when none is named): only a contract this
    /// gateway hosts is acted for.
    pub host_public_key: Vec<u8>,
    pub status: pb::ContractStatus,
    pub deadline_ms: i64,
    pub residual: i64,
    pub write_scope: Vec<String>,
}

/// Whether a call may be forwarded: this gateway (`host`) is the
/// contract's host, the contract is open, its deadline ahead, the call's
/// known units within the residual, and (refuse mode) every mutated path
/// in the write scope.
pub fn admit(
    contract: &ContractView,
    host: &[u8; 32],
    now_ms: i64,
    units: Option<i64>,
    paths: &Paths,
    mode: OutOfScope,
) -> Result<(), BrokerError> {
    // First: a contract this gateway does not host is somebody else's (a
    // root, a sibling); its state says nothing about this agent's rights.
    if contract.host_public_key.as_slice() != host.as_slice() {
        let hosted_by = if contract.host_public_key.is_empty() {
            "no host".to_owned()
        } else {
            format!("host {}", hex::encode(&contract.host_public_key))
        };
        return Err(BrokerError::new(
            "NOT_HOST",
            format!(
                "contract {} names {hosted_by}, not this gateway ({}): a gateway acts only for the contracts it hosts; nothing was forwarded",
                hex::encode(contract.id),
                hex::encode(host)
            ),
        )
        .with("contract_id", hex::encode(contract.id)));
    }
    let open = matches!(
        contract.status,
        pb::ContractStatus::Open | pb::ContractStatus::Accepted
    );
    if !open {
        let status = status_name(contract.status as i32);
        return Err(BrokerError::new(
            "CONTRACT_ENDED",
            format!("the contract is {status}: no tool call is forwarded for it any more"),
        )
        .with("status", status));
    }
    if now_ms >= contract.deadline_ms {
        return Err(BrokerError::new(
            "CONTRACT_ENDED",
            format!(
                "the contract's deadline ({}) has passed: no tool call is forwarded for it any more",
                broker_client::tree::rfc3339(contract.deadline_ms)
            ),
        )
        .with("status", "EXPIRED")
        .with("deadline_ms", contract.deadline_ms));
    }
    if let Some(units) = units
        && units > contract.residual
    {
        return Err(BrokerError::new(
            "OVER_BUDGET",
            format!(
                "this call costs {units} units and the contract has {} left; nothing was forwarded",
                contract.residual.max(0)
            ),
        )
        .with("requested", units)
        .with("allowed", contract.residual.max(0)));
    }
    if mode == OutOfScope::Refuse {
        let scope = Scope::from_trusted(contract.write_scope.clone());
        if let Some((argument, path)) = paths
            .mutates
            .iter()
            .find(|(_, p)| !scope.covers_observed(p))
        {
            return Err(BrokerError {
                field: Some(argument.clone()),
                ..BrokerError::new(
                    "OUT_OF_SCOPE",
                    format!(
                        "{path:?} is outside the contract's write scope {:?}; nothing was forwarded",
                        contract.write_scope
                    ),
                )
            }
            .with("path", path.as_str())
            .with("write_scope", contract.write_scope.clone()));
        }
    }
    Ok(())
}

/// The units a call costs: the rule's constant, or the number at
/// `units_from` in the result's structured content (`None` when the
/// result has no such non-negative integer: the call is recorded unmetered).
pub fn units_of(rule: &ToolRule, structured: Option<&Value>) -> Option<i64> {
    match (&rule.units, &rule.units_from) {
        (Some(units), _) => Some(*units),
        (None, Some(key)) => structured
            .and_then(|s| s.get(key))
            .and_then(Value::as_i64)
            .filter(|u| (0..=limits::MAX_BUDGET_UNITS).contains(u)),
        (None, None) => Some(0),
    }
}

/// The observations one answered call is recorded as: the call, then each
/// read and mutation.
/// What the host says of the call itself beside its name.
#[derive(Clone, Copy, Debug)]
pub struct CallFacts {
    pub units: i64,
    pub arguments_sha256: [u8; 32],
    pub outcome: pb::ToolOutcome,
    pub at_ms: i64,
}

/// SHA-256 of a call's arguments: their JSON, object keys sorted, no
/// whitespace (no arguments: `{}`).
pub fn arguments_sha256(arguments: Option<&JsonObject>) -> [u8; 32] {
    let json = arguments.map_or_else(
        || b"{}".to_vec(),
        |a| serde_json::to_vec(a).unwrap_or_default(),
    );
    broker_wire::crypto::sha256(&json)
}

pub fn observations(tool: &str, call: CallFacts, paths: &Paths) -> Vec<pb::Observation> {
    let CallFacts { units, at_ms, .. } = call;
    let tool = broker_client::names::cut(tool, MAX_TOOL_NAME_BYTES);
    let mut out = vec![pb::Observation {
        kind: pb::ObservationKind::ToolCall as i32,
        tool: tool.clone(),
        units,
        at_ms,
        arguments_sha256: call.arguments_sha256.to_vec(),
        outcome: call.outcome as i32,
        ..Default::default()
    }];
    let path_observation = |kind: pb::ObservationKind, path: &String| pb::Observation {
        kind: kind as i32,
        path: path.clone(),
        tool: tool.clone(),
        at_ms,
        ..Default::default()
    };
    let reads = paths.reads.iter();
    let mutates = paths.mutates.iter().map(|(_, path)| path);
    let paths = reads.map(|path| path_observation(pb::ObservationKind::Read, path));
    let paths =
        paths.chain(mutates.map(|path| path_observation(pb::ObservationKind::Mutation, path)));
    out.extend(paths);
    out
}

/// Most observations one call makes: its own, and one per path.
pub const MAX_OBSERVATIONS_PER_CALL: usize = 1 + MAX_PATHS_PER_CALL;
// One call always fits one RecordReceipts, so the recorder never splits it.
const _: () = assert!(MAX_OBSERVATIONS_PER_CALL <= limits::MAX_OBSERVATIONS_PER_REQUEST);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> JsonObject {
        value.as_object().cloned().expect("an object")
    }

    const HOST: [u8; 32] = [4; 32];

    fn open(residual: i64, scope: &[&str]) -> ContractView {
        ContractView {
            id: [9; 32],
            host_public_key: HOST.to_vec(),
            status: pb::ContractStatus::Accepted,
            deadline_ms: 1_000,
            residual,
            write_scope: scope.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn reason(result: Result<(), BrokerError>) -> String {
        result.err().map(|e| e.reason).unwrap_or_default()
    }

    #[test]
    fn arguments_are_bounded_in_size_and_depth() {
        assert!(check_arguments(None).is_ok());
        assert!(check_arguments(Some(&object(json!({"path": "a"})))).is_ok());
        let big = object(json!({"content": "x".repeat(MAX_ARGUMENT_BYTES)}));
        assert_eq!(reason(check_arguments(Some(&big))), "ARGUMENTS_TOO_LARGE");
        let mut deep = json!(1);
        for _ in 0..MAX_ARGUMENT_DEPTH {
            deep = json!([deep]);
        }
        let too_deep = object(json!({ "a": deep }));
        assert_eq!(
            reason(check_arguments(Some(&too_deep))),
            "ARGUMENTS_TOO_DEEP"
        );
        let mut fine = json!(1);
        for _ in 0..MAX_ARGUMENT_DEPTH - 2 {
            fine = json!([fine]);
        }
        assert!(check_arguments(Some(&object(json!({ "a": fine })))).is_ok());
    }

    #[test]
    fn paths_come_from_the_named_arguments() {
        let rule = ToolRule {
            mutates: vec!["path".into(), "also".into()],
            reads: vec!["from".into()],
            ..Default::default()
        };
        let found = paths(
            &rule,
            Some(&object(
                json!({"path": "out/a", "also": ["out/b", "x/c"], "from": "in/d", "other": "e"}),
            )),
        )
        .expect("paths");
        assert_eq!(found.reads, ["in/d"]);
        assert_eq!(
            found.mutates,
            [
                ("path".into(), "out/a".into()),
                ("also".into(), "out/b".into()),
                ("also".into(), "x/c".into())
            ]
        );
        assert_eq!(paths(&rule, None).expect("none"), Paths::default());
        let bad = paths(&rule, Some(&object(json!({"path": 3})))).expect_err("a number");
        assert_eq!(
            (bad.reason.as_str(), bad.field.as_deref()),
            ("INVALID_INPUT", Some("path"))
        );
        let long = paths(
            &rule,
            Some(&object(json!({"path": "a".repeat(MAX_PATH_BYTES + 1)}))),
        );
        assert!(long.is_err());
        // One argument lists at most MAX_PATHS_PER_ARGUMENT, a call at most
        // MAX_PATHS_PER_CALL in all (so it fits one RecordReceipts).
        let list = |n: usize| Value::from((0..n).map(|i| format!("out/{i}")).collect::<Vec<_>>());
        let too_many = paths(
            &rule,
            Some(&object(json!({"also": list(MAX_PATHS_PER_ARGUMENT + 1)}))),
        );
        assert_eq!(
            too_many.expect_err("one argument").field.as_deref(),
            Some("also")
        );
        let wide = ToolRule {
            mutates: (0..5).map(|i| format!("p{i}")).collect(),
            ..Default::default()
        };
        let mut arguments = serde_json::Map::new();
        for i in 0..5 {
            arguments.insert(format!("p{i}"), list(MAX_PATHS_PER_ARGUMENT));
        }
        const { assert!(5 * MAX_PATHS_PER_ARGUMENT > MAX_PATHS_PER_CALL) };
        let error = paths(&wide, Some(&arguments)).expect_err("too many in all");
        assert!(
            error.message.contains(&MAX_PATHS_PER_CALL.to_string()),
            "{}",
            error.message
        );
        arguments.remove("p4");
        arguments.remove("p3");
        assert_eq!(
            paths(&wide, Some(&arguments))
                .expect("three lists fit")
                .mutates
                .len(),
            3 * MAX_PATHS_PER_ARGUMENT
        );
    }

    #[test]
    fn a_call_is_admitted_only_within_the_contract() {
        let inside = Paths {
            mutates: vec![("path".into(), "out/a.txt".into())],
            ..Default::default()
        };
        let outside = Paths {
            mutates: vec![("path".into(), "etc/passwd".into())],
            ..Default::default()
        };
        let escape = Paths {
            mutates: vec![("path".into(), "out/../etc/passwd".into())],
            ..Default::default()
        };
        let c = open(10, &["out"]);
        assert!(admit(&c, &HOST, 0, Some(10), &inside, OutOfScope::Refuse).is_ok());
        assert_eq!(
            reason(admit(&c, &HOST, 0, Some(11), &inside, OutOfScope::Refuse)),
            "OVER_BUDGET"
        );
        assert_eq!(
            reason(admit(&c, &HOST, 0, Some(1), &outside, OutOfScope::Refuse)),
            "OUT_OF_SCOPE"
        );
        assert_eq!(
            reason(admit(&c, &HOST, 0, Some(1), &escape, OutOfScope::Refuse)),
            "OUT_OF_SCOPE"
        );
        assert!(admit(&c, &HOST, 0, Some(1), &outside, OutOfScope::Record).is_ok());
        assert_eq!(
            reason(admit(
                &c,
                &HOST,
                1_000,
                Some(1),
                &inside,
                OutOfScope::Refuse
            )),
            "CONTRACT_ENDED"
        );
        for status in [
            pb::ContractStatus::Revoked,
            pb::ContractStatus::Completed,
            pb::ContractStatus::Expired,
        ] {
            let ended = ContractView {
                status,
                ..open(10, &["out"])
            };
            assert_eq!(
                reason(admit(
                    &ended,
                    &HOST,
                    0,
                    Some(0),
                    &inside,
                    OutOfScope::Record
                )),
                "CONTRACT_ENDED"
            );
        }
        let error = admit(&c, &HOST, 0, Some(11), &inside, OutOfScope::Refuse).expect_err("over");
        assert_eq!(
            (
                error.details["requested"].clone(),
                error.details["allowed"].clone()
            ),
            (json!(11), json!(10))
        );
        // Units known only after the call are not checked before it.
        assert!(
            admit(
                &open(0, &["out"]),
                &HOST,
                0,
                None,
                &inside,
                OutOfScope::Refuse
            )
            .is_ok()
        );
        // Somebody else's contract (a root, a sibling), or one with no
        // host yet: refused before its state is looked at.
        for host in [vec![5; 32], Vec::new()] {
            let theirs = ContractView {
                host_public_key: host,
                ..open(10, &["out"])
            };
            assert_eq!(
                reason(admit(
                    &theirs,
                    &HOST,
                    0,
                    Some(0),
                    &inside,
                    OutOfScope::Record
                )),
                "NOT_HOST"
            );
        }
    }

    #[test]
    fn observations_name_the_call_and_its_paths() {
        let paths = Paths {
            reads: vec!["in/a".into()],
            mutates: vec![("path".into(), "out/b".into())],
        };
        let call = CallFacts {
            units: 2,
            arguments_sha256: arguments_sha256(Some(&object(json!({"b": 1, "a": [2]})))),
            outcome: pb::ToolOutcome::Succeeded,
            at_ms: 7,
        };
        // Keys sorted, no whitespace: the digest of a known text.
        assert_eq!(
            call.arguments_sha256,
            broker_wire::crypto::sha256(br#"{"a":[2],"b":1}"#)
        );
        assert_eq!(arguments_sha256(None), broker_wire::crypto::sha256(b"{}"));
        let made = observations("fs.write_file", call, &paths);
        let kinds: Vec<i32> = made.iter().map(|o| o.kind).collect();
        assert_eq!(
            kinds,
            [
                pb::ObservationKind::ToolCall as i32,
                pb::ObservationKind::Read as i32,
                pb::ObservationKind::Mutation as i32
            ]
        );
        assert_eq!(
            (made[0].units, made[1].units, made[2].path.as_str()),
            (2, 0, "out/b")
        );
        assert!(
            observations(&"é".repeat(200), call, &Paths::default())[0]
                .tool
                .len()
                <= MAX_TOOL_NAME_BYTES
        );
    }

    #[test]
    fn units_come_from_the_rule_or_the_result() {
        let constant = ToolRule {
            units: Some(3),
            ..Default::default()
        };
        let from = ToolRule {
            units_from: Some("units".into()),
            ..Default::default()
        };
        assert_eq!(units_of(&constant, None), Some(3));
        assert_eq!(units_of(&from, Some(&json!({"units": 4}))), Some(4));
        assert_eq!(units_of(&from, Some(&json!({"units": -4}))), None);
        assert_eq!(units_of(&from, Some(&json!({"units": "4"}))), None);
        assert_eq!(units_of(&from, None), None);
        assert_eq!(units_of(&ToolRule::default(), None), Some(0));
    }
}
