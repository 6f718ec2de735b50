//! The JSON-RPC binding's side of both listeners: a request read within
//! its limits (strict JSON, a place among those in progress), run in a
//! span of its own, and answered with the result or the error as A2A's
//! SDKs read it; a stream as Server-Sent Events.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::client::CallError;
use crate::ext::{Refused, code};
use crate::gateway::OwnedTicket;
use crate::metrics::Side;
use crate::stream::{Events, is_streaming};
use crate::{Gateway, egress, ingress, json};

/// One JSON-RPC request, read within its limits.
pub(crate) struct Rpc {
    pub id: Value,
    pub method: String,
    pub params: Value,
    pub headers: http::HeaderMap,
    /// The `traceparent` of the gateway's span for this call (else the
    /// caller's): every call it makes for it carries this one.
    pub trace: Option<String>,
}

/// The parts of a JSON-RPC 2.0 request.
pub(crate) struct Envelope {
    pub id: Value,
    pub method: String,
    /// `None` when the request has none.
    pub params: Option<Value>,
}

/// Reads a JSON-RPC 2.0 request: strict JSON (json.rs) within
/// `max_bytes`, `jsonrpc: "2.0"` and a method. A refusal comes with the
/// request's id once it was read.
pub(crate) fn envelope(body: &[u8], max_bytes: usize) -> Result<Envelope, (Value, Refused)> {
    let mut request: Value = json::parse_strict(body, max_bytes).map_err(|e| {
        (
            Value::Null,
            Refused::new(
                code::PARSE_ERROR,
                "UNDECODABLE_MESSAGE",
                json::refusal_text(&e),
            ),
        )
    })?;
    let id = request
        .get_mut("id")
        .map(Value::take)
        .unwrap_or(Value::Null);
    let method = match request.get("method").and_then(Value::as_str) {
        Some(method) if request.get("jsonrpc") == Some(&json!("2.0")) => method.to_owned(),
        _ => {
            return Err((
                id,
                Refused::new(
                    code::INVALID_REQUEST,
                    "INVALID_FIELD",
                    "not a JSON-RPC 2.0 request (jsonrpc \"2.0\" and a method)",
                ),
            ));
        }
    };
    let params = request.get_mut("params").map(Value::take);
    Ok(Envelope { id, method, params })
}

/// A place for the request of `caller` and the request read, or the
/// refusal to answer (with the request's id once read): too many in
/// progress, not JSON-RPC, or a method neither side serves.
fn taken(
    gateway: &Arc<Gateway>,
    caller: Option<std::net::IpAddr>,
    headers: http::HeaderMap,
    body: &[u8],
) -> Result<(OwnedTicket, Rpc), (Value, Refused)> {
    let ticket = gateway
        .owned_ticket(caller)
        .map_err(|refused| (Value::Null, refused))?;
    let Envelope { id, method, params } = envelope(body, gateway.config.max_message_bytes)?;
    if let Some(refused) = unserved(&method) {
        return Err((id, refused));
    }
    let rpc = Rpc {
        id,
        method,
        params: params.unwrap_or(json!({})),
        headers,
        trace: None,
    };
    Ok((ticket, rpc))
}

pub(crate) async fn ingress_rpc(
    State(gateway): State<Arc<Gateway>>,
    axum::extract::ConnectInfo(caller): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    let (ticket, rpc) = match taken(&gateway, Some(caller.ip()), headers, &body) {
        Ok(taken) => taken,
        Err((id, refused)) => return answer(&gateway, Side::Ingress, id, Err(refused.into())),
    };
    if is_streaming(&rpc.method) {
        let (id, events) = traced_call("ingress", rpc, async |rpc| {
            let events = ingress::open(&gateway, &rpc).await;
            (rpc, events)
        })
        .await;
        return streamed(&gateway, Side::Ingress, id, events, ticket);
    }
    let (id, result) = traced_call("ingress", rpc, async |rpc| {
        let result = ingress::handle(&gateway, &rpc).await;
        (rpc, result)
    })
    .await;
    answer(&gateway, Side::Ingress, id, result)
}

pub(crate) async fn egress_rpc(
    State(gateway): State<Arc<Gateway>>,
    Path(peer): Path<String>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    let (ticket, rpc) = match taken(&gateway, None, headers, &body) {
        Ok(taken) => taken,
        Err((id, refused)) => return answer(&gateway, Side::Egress, id, Err(refused.into())),
    };
    if is_streaming(&rpc.method) {
        let (id, events) = traced_call("egress", rpc, async |rpc| {
            let events = egress::open(&gateway, &peer, &rpc).await;
            (rpc, events)
        })
        .await;
        return streamed(&gateway, Side::Egress, id, events, ticket);
    }
    let (id, result) = traced_call("egress", rpc, async |rpc| {
        let result = egress::handle(&gateway, &peer, &rpc).await;
        (rpc, result)
    })
    .await;
    answer(&gateway, Side::Egress, id, result)
}

fn answer(gateway: &Gateway, side: Side, id: Value, result: Result<Value, CallError>) -> Response {
    axum::Json(response(gateway, side, &id, result)).into_response()
}

/// A JSON-RPC response: the result, or the error (the gateway's own
/// counted as a refusal).
fn response(gateway: &Gateway, side: Side, id: &Value, result: Result<Value, CallError>) -> Value {
    if let Err(CallError::Local(refused)) = &result {
        gateway.metrics.refused(side, &refused.reason);
    }
    match result {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(CallError::Remote(error)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": error})
        }
        Err(CallError::Local(refused)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": refused.to_jsonrpc()})
        }
    }
}

/// A stream's answer: a refusal before it starts is a plain JSON-RPC
/// error (the SDKs read it as the call's error); else Server-Sent Events,
/// each a whole JSON-RPC response whose result is a StreamResponse (an
/// error ends the stream). The stream holds its place among the requests
/// in progress until it ends.
fn streamed(
    gateway: &Arc<Gateway>,
    side: Side,
    id: Value,
    events: Result<Events, CallError>,
    ticket: OwnedTicket,
) -> Response {
    let events = match events {
        Ok(events) => events,
        Err(error) => return answer(gateway, side, id, Err(error)),
    };
    let gateway = gateway.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(SSE_AHEAD);
    // Forwarded on a task of its own, with a comment every SSE_PING so a
    // quiet stream is not taken for a dead one by a reader's idle bound;
    // it ends with the events, at an error, or when the caller leaves.
    tokio::spawn(async move {
        use tokio_stream::StreamExt as _;
        let _held = ticket;
        let mut events = events;
        let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + SSE_PING, SSE_PING);
        loop {
            let bytes = tokio::select! {
                event = events.next() => {
                    let Some(event) = event else { return };
                    let failed = event.is_err();
                    let result = event.and_then(|event| {
                        serde_json::to_value(&event).map_err(|e| {
                            Refused::new(
                                code::INTERNAL,
                                "INTERNAL",
                                format!("encoding an event: {e}"),
                            )
                            .into()
                        })
                    });
                    let data = response(&gateway, side, &id, result);
                    let sent = tx
                        .send(Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))))
                        .await;
                    if sent.is_err() || failed {
                        return;
                    }
                    continue;
                }
                _ = ping.tick() => Bytes::from_static(b": ping\n\n"),
                () = tx.closed() => return,
            };
            if tx.send(Ok(bytes)).await.is_err() {
                return;
            }
        }
    });
    let body = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut response = axum::body::Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    response
}

/// Params of one method, as its A2A type.
pub(crate) fn params<T: serde::de::DeserializeOwned>(rpc: &Rpc) -> Result<T, Refused> {
    serde_json::from_value(rpc.params.clone()).map_err(|e| {
        Refused::new(
            code::INVALID_PARAMS,
            "INVALID_FIELD",
            format!("{}: params are not its A2A v1 request ({e})", rpc.method),
        )
    })
}

/// A comment sent on a quiet stream this often (the A2A SDKs' servers send
/// one every 15 s; readers' idle bounds are longer).
const SSE_PING: std::time::Duration = std::time::Duration::from_secs(15);
/// Events of a stream encoded ahead of the caller reading them.
const SSE_AHEAD: usize = 16;

/// Methods neither side serves, with the reason.
pub(crate) fn unserved(method: &str) -> Option<Refused> {
    let (code, why) = match method {
        "CreateTaskPushNotificationConfig"
        | "GetTaskPushNotificationConfig"
        | "ListTaskPushNotificationConfigs"
        | "DeleteTaskPushNotificationConfig" => (
            code::PUSH_NOT_SUPPORTED,
            "push notifications are not served through the delegation gateway",
        ),
        "ListTasks" | "GetExtendedAgentCard" => (
            code::UNSUPPORTED_OPERATION,
            "not served through the delegation gateway: read each task with GetTask",
        ),
        "SendMessage" | "GetTask" | "CancelTask" | "SendStreamingMessage" | "SubscribeToTask" => {
            return None;
        }
        _ => (code::METHOD_NOT_FOUND, "no such A2A v1 method"),
    };
    Some(Refused::new(code, "INVALID_FIELD", format!("{method}: {why}")).with("field", "method"))
}

/// Headers passed on to the next hop: the W3C trace context (this call's
/// span as the parent, the caller's `tracestate`).
pub(crate) fn passed_headers(rpc: &Rpc) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let mut headers = Vec::new();
    if let Some(value) = rpc.trace.as_deref().and_then(|t| t.parse().ok()) {
        headers.push((http::HeaderName::from_static("traceparent"), value));
        if let Some(state) = rpc.headers.get("tracestate") {
            headers.push((http::HeaderName::from_static("tracestate"), state.clone()));
        }
    }
    headers
}

/// Runs one JSON-RPC call in a span of its own when spans are exported: a
/// child of the caller's `traceparent`, the parent of what the gateway
/// asks the broker, the agent and peers for it.
pub(crate) async fn traced_call<T, F, Fut>(
    side: &'static str,
    mut rpc: Rpc,
    call: F,
) -> (Value, Result<T, CallError>)
where
    F: FnOnce(Rpc) -> Fut,
    Fut: std::future::Future<Output = (Rpc, Result<T, CallError>)>,
{
    let sent = rpc
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|v| broker_client::trace::valid_traceparent(v))
        .map(str::to_owned);
    let name = match (side, rpc.method.as_str()) {
        ("ingress", "SendMessage") => "a2a.gateway/ingress/SendMessage",
        ("ingress", "GetTask") => "a2a.gateway/ingress/GetTask",
        ("ingress", "SendStreamingMessage") => "a2a.gateway/ingress/SendStreamingMessage",
        ("ingress", "SubscribeToTask") => "a2a.gateway/ingress/SubscribeToTask",
        ("ingress", _) => "a2a.gateway/ingress/CancelTask",
        (_, "SendMessage") => "a2a.gateway/egress/SendMessage",
        (_, "GetTask") => "a2a.gateway/egress/GetTask",
        (_, "SendStreamingMessage") => "a2a.gateway/egress/SendStreamingMessage",
        (_, "SubscribeToTask") => "a2a.gateway/egress/SubscribeToTask",
        _ => "a2a.gateway/egress/CancelTask",
    };
    let mut span = broker_runtime::telemetry::StepSpan::start(name, sent.as_deref());
    rpc.trace = span.as_ref().map(|s| s.traceparent()).or(sent);
    let (rpc, result) = call(rpc).await;
    if let Some(mut span) = span.take() {
        let outcome = match &result {
            Ok(_) => "ok".to_owned(),
            Err(CallError::Local(refused)) => refused.reason.clone(),
            Err(CallError::Remote(_)) => "agent_error".to_owned(),
        };
        span.attribute("a2a.outcome", outcome);
        span.end();
    }
    (rpc.id, result)
}
