//! Names of the API's codes, written once for every caller: logs,
//! metrics, gateways and the CLI print the same words.

use crate::pb;

/// `ErrorInfo.reason` of an error reason: its proto name without the
/// `ERROR_REASON_` prefix (`NOT_FOUND`, `OVERLOADED`).
pub fn reason_name(reason: pb::ErrorReason) -> &'static str {
    let name = reason.as_str_name();
    name.strip_prefix("ERROR_REASON_").unwrap_or(name)
}

/// The gRPC metadata key a read carries its session in (binary: the
/// `Sealed` session OpenSession returned, serialized).
pub const SESSION_METADATA: &str = "x-broker-session-bin";

/// The methods the broker serves, by gRPC path, with their kind: any other
/// path is counted as service and method "unknown", so a client cannot
/// grow the label set.
pub const METHODS: &[(&str, &str)] = &[
    ("/delegation.broker.v1.Broker/OpenRoot", "unary"),
    ("/delegation.broker.v1.Broker/Delegate", "unary"),
    ("/delegation.broker.v1.Broker/GetContract", "unary"),
    ("/delegation.broker.v1.Broker/GetChain", "unary"),
    ("/delegation.broker.v1.Broker/ListChildren", "unary"),
    ("/delegation.broker.v1.Broker/ListRoots", "unary"),
    ("/delegation.broker.v1.Broker/ListHeld", "unary"),
    ("/delegation.broker.v1.Broker/GetReceipt", "unary"),
    ("/delegation.broker.v1.Broker/GetBrokerKeys", "unary"),
    ("/delegation.broker.v1.Broker/OpenSession", "unary"),
    ("/delegation.broker.v1.Broker/Accept", "unary"),
    ("/delegation.broker.v1.Broker/Decline", "unary"),
    ("/delegation.broker.v1.Broker/Complete", "unary"),
    ("/delegation.broker.v1.Broker/Adjudicate", "unary"),
    ("/delegation.broker.v1.Broker/Escalate", "unary"),
    ("/delegation.broker.v1.Broker/Revoke", "unary"),
    ("/delegation.broker.v1.Broker/RecordReceipts", "unary"),
    ("/delegation.broker.v1.Broker/Watch", "server_stream"),
    ("/delegation.broker.v1.Broker/WatchContracts", "bidi_stream"),
    ("/delegation.broker.v1.Broker/BindIdentity", "unary"),
    ("/delegation.broker.v1.Broker/GetAudit", "unary"),
    ("/delegation.broker.v1.Broker/AggregateAudits", "unary"),
    ("/grpc.health.v1.Health/Check", "unary"),
    ("/grpc.health.v1.Health/Watch", "server_stream"),
    (
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "bidi_stream",
    ),
    (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "bidi_stream",
    ),
];

/// The full method name (`package.Service/Method`) of a request path, the
/// name of its span; "unknown" for a path the broker does not serve.
pub fn method_name(path: &str) -> &'static str {
    METHODS
        .iter()
        .find(|(known, _)| *known == path)
        .map_or("unknown", |(known, _)| &known[1..])
}

/// (type, service, method) label values of a request path.
pub fn method_labels(path: &str) -> [&'static str; 3] {
    let Some((path, kind)) = METHODS.iter().find(|(known, _)| *known == path).copied() else {
        return ["unary", "unknown", "unknown"];
    };
    let (service, method) = path[1..].split_once('/').unwrap_or(("unknown", "unknown"));
    [kind, service, method]
}
