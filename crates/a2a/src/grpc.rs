//! A2A's gRPC binding (`lf.a2a.v1.A2AService`, a2a-pb's tonic types) on
//! both sides of the gateway: served at `grpc_listen` (ingress) and
//! `egress_grpc_listen` (egress: the peer is the request's `tenant`, which
//! the served peer card names), and spoken to an agent that serves only
//! gRPC (`upstream_binding`). Requests are transcoded to the ProtoJSON
//! types the JSON-RPC side uses (same messages, same field numbers), so
//! one code path admits, delegates and follows tasks whatever the binding.

use std::collections::HashMap;
use std::sync::Arc;

use a2a_pb::proto;
use a2a_pb::protojson;
use prost::Message as _;
use serde_json::Value;
use tonic_types::{ErrorDetails, StatusExt as _};

use super::client::CallError;
use super::ext::{DOMAIN, Refused, code};
use super::gateway::OwnedTicket;
use super::metrics::Side;
use super::{Gateway, Rpc, egress, ingress, traced_call, unserved};

/// The same message as another generated type (both are the normative
/// a2a.proto's): encode one, decode the other.
pub fn transcode<A: prost::Message, B: prost::Message + Default>(a: &A) -> Result<B, Refused> {
    B::decode(a.encode_to_vec().as_slice()).map_err(|e| {
        Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            format!("transcoding an A2A message: {e}"),
        )
    })
}

/// A refusal as a gRPC status: the same message, and the same ErrorInfo
/// as the JSON-RPC error carries.
pub fn status_of(refused: &Refused) -> tonic::Status {
    let grpc_code = match (refused.code, refused.reason.as_str()) {
        (_, "UNAVAILABLE") => tonic::Code::Unavailable,
        (_, "TOKEN_REFUSED") => tonic::Code::FailedPrecondition,
        (code::INVALID_PARAMS | code::INVALID_REQUEST | code::PARSE_ERROR, _) => {
            tonic::Code::InvalidArgument
        }
        (code::EXTENSION_REQUIRED | code::TASK_NOT_CANCELABLE, _) => {
            tonic::Code::FailedPrecondition
        }
        (code::TASK_NOT_FOUND, _) => tonic::Code::NotFound,
        (code::UNSUPPORTED_OPERATION | code::PUSH_NOT_SUPPORTED | code::METHOD_NOT_FOUND, _) => {
            tonic::Code::Unimplemented
        }
        _ => tonic::Code::Internal,
    };
    let metadata: HashMap<String, String> = refused.metadata.clone().into_iter().collect();
    tonic::Status::with_error_details(
        grpc_code,
        refused.message.clone(),
        ErrorDetails::with_error_info(refused.reason.clone(), DOMAIN, metadata),
    )
}

/// An error the agent or a peer answered over JSON-RPC, for a gRPC caller.
fn remote_status(error: &Value) -> tonic::Status {
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the agent answered an error")
        .to_owned();
    let reason = error
        .pointer("/data/0/reason")
        .and_then(Value::as_str)
        .unwrap_or("AGENT_ERROR")
        .to_owned();
    let code = error
        .get("code")
        .and_then(Value::as_i64)
        .unwrap_or(code::INTERNAL as i64);
    let mut refused = Refused::new(code as i32, &reason, message);
    if let Some(metadata) = error.pointer("/data/0/metadata").and_then(Value::as_object) {
        for (key, value) in metadata {
            if let Some(value) = value.as_str() {
                refused = refused.with(key, value);
            }
        }
    }
    status_of(&refused)
}

/// A status the agent answered over gRPC, relayed as a JSON-RPC error.
pub fn remote_error(status: &tonic::Status) -> Value {
    let code = match status.code() {
        tonic::Code::NotFound => code::TASK_NOT_FOUND,
        tonic::Code::InvalidArgument => code::INVALID_PARAMS,
        tonic::Code::Unimplemented => code::UNSUPPORTED_OPERATION,
        tonic::Code::FailedPrecondition => code::TASK_NOT_CANCELABLE,
        _ => code::INTERNAL,
    };
    let mut error = serde_json::json!({"code": code, "message": status.message()});
    if let Some(info) = status.get_details_error_info() {
        error["data"] = serde_json::json!([{
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": info.reason,
            "domain": info.domain,
            "metadata": info.metadata,
        }]);
    }
    error
}

/// Which side a service is, and how it handles one call.
#[derive(Clone, Copy)]
enum Role {
    Ingress,
    Egress,
}

pub struct A2aGrpc {
    gateway: Arc<Gateway>,
    role: Role,
}

impl A2aGrpc {
    pub fn ingress(gateway: Arc<Gateway>) -> Self {
        Self {
            gateway,
            role: Role::Ingress,
        }
    }

    pub fn egress(gateway: Arc<Gateway>) -> Self {
        Self {
            gateway,
            role: Role::Egress,
        }
    }

    /// What every call starts with: a place among the requests in
    /// progress (held by the call, or by its stream), the request as the
    /// JSON-RPC side's `Rpc`, and the peer it names (egress: `tenant`).
    fn taken<Q, A>(
        &self,
        method: &'static str,
        request: tonic::Request<Q>,
    ) -> Result<(OwnedTicket, Rpc, String), tonic::Status>
    where
        Q: prost::Message,
        A: prost::Message + Default + serde::Serialize,
    {
        let caller = match self.role {
            Role::Ingress => request.remote_addr().map(|a| a.ip()),
            Role::Egress => None,
        };
        let (metadata, _, message) = request.into_parts();
        let ticket = self
            .gateway
            .owned_ticket(caller)
            .map_err(|r| self.refuse(r))?;
        let json: A = transcode(&message).map_err(|r| self.refuse(r))?;
        let params = serde_json::to_value(&json).map_err(|e| {
            self.refuse(Refused::new(
                code::INTERNAL,
                "INTERNAL",
                format!("encoding the request: {e}"),
            ))
        })?;
        let tenant = params
            .get("tenant")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let rpc = Rpc {
            id: Value::Null,
            method: method.to_owned(),
            params,
            headers: metadata.into_headers(),
            trace: None,
        };
        Ok((ticket, rpc, tenant))
    }

    /// A refusal of the gateway's own, counted, as a status.
    fn refuse(&self, refused: Refused) -> tonic::Status {
        let side = match self.role {
            Role::Ingress => Side::Ingress,
            Role::Egress => Side::Egress,
        };
        self.gateway.metrics.refused(side, &refused.reason);
        status_of(&refused)
    }

    fn side(&self) -> &'static str {
        match self.role {
            Role::Ingress => "ingress",
            Role::Egress => "egress",
        }
    }

    /// One unary call through the JSON-RPC side's handlers.
    async fn call<Q, A, R, B>(
        &self,
        method: &'static str,
        request: tonic::Request<Q>,
    ) -> Result<tonic::Response<R>, tonic::Status>
    where
        Q: prost::Message,
        A: prost::Message + Default + serde::Serialize,
        R: prost::Message + Default,
        B: prost::Message + Default + serde::de::DeserializeOwned,
    {
        let (_ticket, rpc, tenant) = self.taken::<Q, A>(method, request)?;
        let (gateway, role) = (self.gateway.clone(), self.role);
        let (_, result) = traced_call(self.side(), rpc, async |rpc| {
            let result = match role {
                Role::Ingress => ingress::handle(&gateway, &rpc).await,
                Role::Egress if tenant.is_empty() => Err(no_tenant().into()),
                Role::Egress => egress::handle(&gateway, &tenant, &rpc).await,
            };
            (rpc, result)
        })
        .await;
        match result {
            Ok(value) => {
                let answer: B = serde_json::from_value(value).map_err(|e| {
                    self.refuse(Refused::new(
                        code::INTERNAL,
                        "UNDECODABLE_MESSAGE",
                        format!("{method}: the answer is not its A2A type ({e})"),
                    ))
                })?;
                Ok(tonic::Response::new(
                    transcode(&answer).map_err(|r| self.refuse(r))?,
                ))
            }
            Err(CallError::Local(refused)) => Err(self.refuse(refused)),
            Err(CallError::Remote(error)) => Err(remote_status(&error)),
        }
    }

    /// One streaming call (SendStreamingMessage, SubscribeToTask) through
    /// the JSON-RPC side's handlers: a refusal before the stream is the
    /// call's status; each event transcoded; an error ends the stream.
    async fn stream<Q, A>(
        &self,
        method: &'static str,
        request: tonic::Request<Q>,
    ) -> Result<tonic::Response<Stream>, tonic::Status>
    where
        Q: prost::Message,
        A: prost::Message + Default + serde::Serialize,
    {
        let (ticket, rpc, tenant) = self.taken::<Q, A>(method, request)?;
        let (gateway, role) = (self.gateway.clone(), self.role);
        let (_, events) = traced_call(self.side(), rpc, async |rpc| {
            let events = match role {
                Role::Ingress => ingress::open(&gateway, &rpc).await,
                Role::Egress if tenant.is_empty() => Err(no_tenant().into()),
                Role::Egress => egress::open(&gateway, &tenant, &rpc).await,
            };
            (rpc, events)
        })
        .await;
        let events = match events {
            Ok(events) => events,
            Err(CallError::Local(refused)) => return Err(self.refuse(refused)),
            Err(CallError::Remote(error)) => return Err(remote_status(&error)),
        };
        let events = tokio_stream::StreamExt::map(events, move |event| {
            let _held = &ticket;
            match event {
                Ok(event) => {
                    transcode::<_, proto::StreamResponse>(&event).map_err(|r| status_of(&r))
                }
                Err(CallError::Local(refused)) => Err(status_of(&refused)),
                Err(CallError::Remote(error)) => Err(remote_status(&error)),
            }
        });
        Ok(tonic::Response::new(Box::pin(events)))
    }

    fn unserved<T>(&self, method: &str) -> Result<T, tonic::Status> {
        let refused = unserved(method).unwrap_or_else(|| {
            Refused::new(
                code::METHOD_NOT_FOUND,
                "INVALID_FIELD",
                format!("{method}: not served"),
            )
        });
        Err(status_of(&refused))
    }
}

/// An egress call over gRPC names its peer in `tenant`.
fn no_tenant() -> Refused {
    Refused::new(
        code::INVALID_PARAMS,
        "INVALID_FIELD",
        "tenant: name the peer (the egress card's GRPC interface gives it)",
    )
    .with("field", "tenant")
}

type Stream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<proto::StreamResponse, tonic::Status>> + Send>,
>;

/// The A2A service: the served methods call the agent through `call` (as
/// their ProtoJSON types), the streamed ones through `stream`, the others
/// answer that they are not served.
macro_rules! a2a_service {
    (
        served { $($rpc:ident = $name:literal ($request:ident) -> $response:ident as $json_request:ident, $json_response:ident;)* }
        streamed { $($streamed:ident = $streamed_name:literal ($streamed_request:ident);)* }
        unserved { $($other:ident = $other_name:literal ($other_request:ident) -> $other_response:ty;)* }
    ) => {
        #[tonic::async_trait]
        impl proto::a2a_service_server::A2aService for A2aGrpc {
            type SendStreamingMessageStream = Stream;
            type SubscribeToTaskStream = Stream;
            $(
                async fn $rpc(
                    &self,
                    request: tonic::Request<proto::$request>,
                ) -> Result<tonic::Response<proto::$response>, tonic::Status> {
                    self.call::<_, protojson::$json_request, _, protojson::$json_response>(
                        $name,
                        request,
                    )
                    .await
                }
            )*
            $(
                async fn $streamed(
                    &self,
                    request: tonic::Request<proto::$streamed_request>,
                ) -> Result<tonic::Response<Stream>, tonic::Status> {
                    self.stream::<_, protojson::$streamed_request>($streamed_name, request).await
                }
            )*
            $(
                async fn $other(
                    &self,
                    _: tonic::Request<proto::$other_request>,
                ) -> Result<tonic::Response<$other_response>, tonic::Status> {
                    self.unserved($other_name)
                }
            )*
        }
    };
}

a2a_service! {
    served {
        send_message = "SendMessage" (SendMessageRequest) -> SendMessageResponse as SendMessageRequest, SendMessageResponse;
        get_task = "GetTask" (GetTaskRequest) -> Task as GetTaskRequest, Task;
        cancel_task = "CancelTask" (CancelTaskRequest) -> Task as CancelTaskRequest, Task;
    }
    streamed {
        send_streaming_message = "SendStreamingMessage" (SendMessageRequest);
        subscribe_to_task = "SubscribeToTask" (SubscribeToTaskRequest);
    }
    unserved {
        list_tasks = "ListTasks" (ListTasksRequest) -> proto::ListTasksResponse;
        create_task_push_notification_config = "CreateTaskPushNotificationConfig" (TaskPushNotificationConfig) -> proto::TaskPushNotificationConfig;
        get_task_push_notification_config = "GetTaskPushNotificationConfig" (GetTaskPushNotificationConfigRequest) -> proto::TaskPushNotificationConfig;
        list_task_push_notification_configs = "ListTaskPushNotificationConfigs" (ListTaskPushNotificationConfigsRequest) -> proto::ListTaskPushNotificationConfigsResponse;
        get_extended_agent_card = "GetExtendedAgentCard" (GetExtendedAgentCardRequest) -> proto::AgentCard;
        delete_task_push_notification_config = "DeleteTaskPushNotificationConfig" (DeleteTaskPushNotificationConfigRequest) -> ();
    }
}

/// A request to the agent over gRPC: the protocol version and `headers`
/// (trace context) as metadata.
fn agent_request<T>(
    message: T,
    headers: &[(http::HeaderName, http::HeaderValue)],
) -> tonic::Request<T> {
    use tonic::metadata::{MetadataKey, MetadataValue};
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert(
        "a2a-version",
        MetadataValue::from_static(super::client::PROTOCOL_VERSION),
    );
    for (name, value) in headers {
        if let (Ok(key), Some(value)) = (
            MetadataKey::from_bytes(name.as_str().as_bytes()),
            value
                .to_str()
                .ok()
                .and_then(|v| MetadataValue::try_from(v).ok()),
        ) {
            metadata.insert(key, value);
        }
    }
    request
}

/// A streaming call to the fronted agent over gRPC (SendStreamingMessage,
/// SubscribeToTask): its events as ProtoJSON types.
pub async fn stream_agent<P: prost::Message>(
    client: &proto::a2a_service_client::A2aServiceClient<tonic::transport::Channel>,
    method: &str,
    params: &P,
    headers: &[(http::HeaderName, http::HeaderValue)],
    metrics: &super::metrics::GatewayMetrics,
) -> Result<super::stream::Events, CallError> {
    use tokio_stream::StreamExt as _;
    let mut client = client.clone();
    let started = std::time::Instant::now();
    let answer = match method {
        "SendStreamingMessage" => {
            let request = transcode::<_, proto::SendMessageRequest>(params)?;
            client
                .send_streaming_message(agent_request(request, headers))
                .await
        }
        "SubscribeToTask" => {
            let request = transcode::<_, proto::SubscribeToTaskRequest>(params)?;
            client
                .subscribe_to_task(agent_request(request, headers))
                .await
        }
        other => {
            return Err(Refused::new(
                code::METHOD_NOT_FOUND,
                "INVALID_FIELD",
                format!("{other}: not streamed over gRPC"),
            )
            .into());
        }
    };
    metrics.upstream(method, started.elapsed().as_secs_f64());
    let events = answer.map_err(|status| agent_error(method, &status))?;
    let method = method.to_owned();
    Ok(Box::pin(events.into_inner().map(
        move |event| match event {
            Ok(event) => transcode::<_, protojson::StreamResponse>(&event).map_err(CallError::from),
            Err(status) => Err(agent_error(&method, &status)),
        },
    )))
}

/// A status the agent answered: unreachable as the gateway's own
/// UNAVAILABLE, else relayed as the agent's error.
fn agent_error(method: &str, status: &tonic::Status) -> CallError {
    if status.get_details_error_info().is_none() && status.code() == tonic::Code::Unavailable {
        return Refused::new(
            code::INTERNAL,
            "UNAVAILABLE",
            format!(
                "the agent could not be reached over gRPC ({method}: {})",
                status.message()
            ),
        )
        .into();
    }
    CallError::Remote(remote_error(status))
}

/// Calls the fronted agent over gRPC: `method` with ProtoJSON-typed
/// params and answer (transcoded both ways).
pub async fn call_agent<P, R>(
    client: &proto::a2a_service_client::A2aServiceClient<tonic::transport::Channel>,
    method: &str,
    params: &P,
    headers: &[(http::HeaderName, http::HeaderValue)],
    metrics: &super::metrics::GatewayMetrics,
) -> Result<R, CallError>
where
    P: prost::Message,
    R: prost::Message + Default,
{
    let mut client = client.clone();
    let started = std::time::Instant::now();
    // One upstream RPC: its request transcoded from the JSON params, its
    // answer re-encoded for the caller's decoding.
    macro_rules! call {
        ($rpc:ident, $request:ty) => {
            client
                .$rpc(agent_request(transcode::<_, $request>(params)?, headers))
                .await
                .map(|r| r.into_inner().encode_to_vec())
        };
    }
    let answer: Result<Vec<u8>, tonic::Status> = match method {
        "SendMessage" => call!(send_message, proto::SendMessageRequest),
        "GetTask" => call!(get_task, proto::GetTaskRequest),
        "CancelTask" => call!(cancel_task, proto::CancelTaskRequest),
        other => {
            return Err(Refused::new(
                code::METHOD_NOT_FOUND,
                "INVALID_FIELD",
                format!("{other}: not called over gRPC"),
            )
            .into());
        }
    };
    metrics.upstream(method, started.elapsed().as_secs_f64());
    match answer {
        Ok(bytes) => R::decode(bytes.as_slice()).map_err(|e| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("the agent's {method} answer: {e}"),
            )
            .into()
        }),
        Err(status) => Err(agent_error(method, &status)),
    }
}
