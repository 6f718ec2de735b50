//! The ingress: in front of the fronted agent. A task starts only with a
//! chain that verifies offline, names this agent as the leaf's delegate
//! and whose contract is open and not bound to another task; nothing else
//! reaches the agent (`admit`). The gateway then follows the task
//! (by the agent's stream when it streams, else polling it with a bound),
//! moves the contract as the task moves (ext::step), cancels the task when
//! the contract is revoked or expires, and shows the broker's verdict to
//! the caller (ext::decorate), in answers and in streamed events: `follow`.

mod admit;
mod follow;

use std::sync::Arc;
use std::time::{Duration, Instant};

use a2a_pb::protojson::{self as a2a, TaskState};
use serde_json::Value;

use crate::client::CallError;
use crate::ext::{self, Refused, code};
use crate::stream::Events;
use crate::{Gateway, Rpc, Slot, params, passed_headers};
use broker_client::names::status_name;
use broker_wire::pb;

use admit::Admission;
pub(crate) use admit::{admit_chain, bind, check_size, ended, tenant_of};
pub(crate) use follow::recover;
use follow::{follow, new_slot, observe, settled, slot_of};

pub(crate) async fn handle(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    match rpc.method.as_str() {
        "SendMessage" => send(gateway, rpc).await,
        "GetTask" => get(gateway, rpc).await,
        "CancelTask" => cancel(gateway, rpc).await,
        other => Err(Refused::new(
            code::METHOD_NOT_FOUND,
            "INVALID_FIELD",
            format!("{other}: not served"),
        )
        .into()),
    }
}

fn to_value<T: serde::Serialize>(value: &T) -> Result<Value, CallError> {
    serde_json::to_value(value).map_err(|e| {
        Refused::new(
            code::INTERNAL,
            "INTERNAL",
            format!("encoding the answer: {e}"),
        )
        .into()
    })
}

/// What a message to the agent came to: a task (followed from here on),
/// or the agent's direct answer.
enum Answered {
    Task {
        slot: Arc<Slot>,
        task: a2a::Task,
        /// Subscribed to the task's events before its follower started.
        events: tokio::sync::broadcast::Receiver<Arc<a2a::StreamResponse>>,
    },
    Message(a2a::Message),
}

/// A SendMessage: a message in a task already admitted goes on under its
/// contract; a task-starting one is admitted, forwarded, and its task
/// followed.
async fn send(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let (answered, wait) = deliver(gateway, rpc).await?;
    match answered {
        Answered::Task { slot, task, .. } => answer_task(gateway, &slot, task, wait).await,
        Answered::Message(reply) => to_value(&a2a::SendMessageResponse {
            payload: Some(a2a::send_message_response::Payload::Message(reply)),
        }),
    }
}

/// A SendStreamingMessage or SubscribeToTask, served when the agent
/// streams: the task's events as the follower reads them from the agent's
/// stream, each with the broker's word, until the task settles.
pub(crate) async fn open(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Events, CallError> {
    if !gateway.streams_upstream() {
        return Err(Refused::new(
            code::UNSUPPORTED_OPERATION,
            "INVALID_FIELD",
            format!(
                "{}: the agent does not stream (its card says streaming: false); use SendMessage and GetTask",
                rpc.method
            ),
        )
        .with("field", "method")
        .into());
    }
    if rpc.method == "SubscribeToTask" {
        let request: a2a::SubscribeToTaskRequest = params(rpc)?;
        let slot = slot_of(gateway, &request.id).await?;
        let events = slot.events.subscribe();
        let mut first = slot.latest.borrow().clone();
        if first.is_none() {
            // Found again after a restart, not yet read: the agent's word.
            if let Some(task) = gateway.upstream_task(&request.id).await {
                first = Some(observe(gateway, &slot, task).await?);
            }
        }
        let over = slot.progress.lock().await.0.ended
            && slot.latest.borrow().as_ref().is_some_and(settled);
        if over {
            return Err(Refused::new(
                code::UNSUPPORTED_OPERATION,
                "ENDED",
                format!(
                    "task {:?} is in a final state: read it with GetTask",
                    ext::echoed(&request.id)
                ),
            )
            .into());
        }
        return Ok(follow::events_of(slot, first, events));
    }
    match deliver(gateway, rpc).await?.0 {
        Answered::Task { slot, task, events } => Ok(follow::events_of(slot, Some(task), events)),
        Answered::Message(reply) => Ok(Box::pin(tokio_stream::once(Ok(a2a::StreamResponse {
            payload: Some(a2a::stream_response::Payload::Message(reply)),
        })))),
    }
}

/// A message to the agent (SendMessage's params), forwarded as SendMessage
/// answered at once; whether the caller asked to wait for the task to
/// settle.
async fn deliver(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<(Answered, bool), CallError> {
    let mut request: a2a::SendMessageRequest = params(rpc)?;
    let message = request.message.as_mut().ok_or_else(|| {
        Refused::new(code::INVALID_PARAMS, "INVALID_FIELD", "message is required")
            .with("field", "message")
    })?;
    check_size(message)?;
    let extension = ext::take(message)?;
    let wait = !request
        .configuration
        .as_ref()
        .is_some_and(|c| c.return_immediately);
    // The gateway follows the task itself: the agent answers at once.
    request
        .configuration
        .get_or_insert_with(Default::default)
        .return_immediately = true;
    let headers = passed_headers(rpc);
    if !message.task_id.is_empty() {
        return Ok((continue_task(gateway, request, &headers).await?, wait));
    }
    let started = Instant::now();
    let admission =
        admit::admit_message(gateway, extension.as_ref(), &mut request, started).await?;
    let (response, upstream) = if rpc.method == "SendStreamingMessage" {
        // A caller that streams: so does the agent, from its first event.
        if let Some(configuration) = request.configuration.as_mut() {
            configuration.return_immediately = false;
        }
        let (response, events) = first_event(gateway, &request, &headers).await?;
        (response, Some(events))
    } else {
        let response = gateway
            .upstream_call("SendMessage", &request, &headers)
            .await?;
        (response, None)
    };
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: agent answered"
    );
    let answered = start(gateway, rpc, admission, response, upstream, started).await?;
    Ok((answered, wait))
}

/// SendStreamingMessage to the agent: its first event (the task, or its
/// direct answer) as SendMessage's answer, and the rest of the stream.
async fn first_event(
    gateway: &Gateway,
    request: &a2a::SendMessageRequest,
    headers: &[(http::HeaderName, http::HeaderValue)],
) -> Result<(a2a::SendMessageResponse, Events), CallError> {
    use a2a::send_message_response::Payload as Answer;
    use a2a::stream_response::Payload as Event;
    use tokio_stream::StreamExt as _;
    let mut events = gateway
        .upstream_stream("SendStreamingMessage", request, headers)
        .await?;
    let timeout = std::time::Duration::from_millis(gateway.config.call_timeout_ms);
    let first = tokio::time::timeout(timeout, events.next())
        .await
        .map_err(|_| {
            Refused::new(
                code::INTERNAL,
                "UNAVAILABLE",
                "the agent's stream sent nothing within call_timeout_ms",
            )
        })?;
    let payload = match first {
        Some(Ok(first)) => match first.payload {
            Some(Event::Task(task)) => Some(Answer::Task(task)),
            Some(Event::Message(message)) => Some(Answer::Message(message)),
            _ => None,
        },
        Some(Err(error)) => return Err(error),
        None => None,
    };
    let payload = payload.ok_or_else(|| {
        Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            "the agent's stream did not start with its task or a message",
        )
    })?;
    Ok((
        a2a::SendMessageResponse {
            payload: Some(payload),
        },
        events,
    ))
}

/// The agent's answer to a task-starting message: its task followed from
/// here on (or, for a direct answer, the contract completed at once).
async fn start(
    gateway: &Arc<Gateway>,
    rpc: &Rpc,
    admission: Admission<'_>,
    response: a2a::SendMessageResponse,
    upstream: Option<Events>,
    started: Instant,
) -> Result<Answered, CallError> {
    let Admission {
        contract_id,
        deadline_ms,
        tenant,
        mut binding,
    } = admission;
    let slot = new_slot(
        gateway,
        contract_id,
        tenant,
        deadline_ms,
        ext::Progress::default(),
        rpc.trace.clone(),
    );
    let task = match response.payload {
        Some(a2a::send_message_response::Payload::Task(task)) => task,
        Some(a2a::send_message_response::Payload::Message(reply)) => {
            // A direct answer, no task: it completes the contract at once
            // (the binding covers the calls until then; the broker's
            // COMPLETED refuses any replay after).
            let answered = direct(gateway, &slot, reply).await;
            drop(binding);
            return Ok(Answered::Message(answered?));
        }
        None => {
            return Err(Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                "the agent answered SendMessage with neither a task nor a message",
            )
            .into());
        }
    };
    binding.keep(task.id.clone());
    {
        let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted.follow(task.id.clone(), slot.clone());
    }
    gateway.remember_context(&task.context_id, contract_id);
    gateway.metrics.admitted.inc();
    let task_id = task.id.clone();
    // A task already settled in the answer needs no read.
    let first_read =
        (upstream.is_none() && !settled(&task)).then(|| follow::first_read(gateway, &task_id));
    let observed = observe(gateway, &slot, task).await;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: first state moved"
    );
    let events = slot.events.subscribe();
    tokio::spawn(follow(
        gateway.clone(),
        slot.clone(),
        task_id,
        upstream,
        first_read,
    ));
    Ok(Answered::Task {
        slot,
        task: observed?,
        events,
    })
}

/// A message in a task already admitted: forwarded while its contract is
/// open.
async fn continue_task(
    gateway: &Arc<Gateway>,
    request: a2a::SendMessageRequest,
    headers: &[(http::HeaderName, http::HeaderValue)],
) -> Result<Answered, CallError> {
    let task_id = request
        .message
        .as_ref()
        .map(|m| m.task_id.clone())
        .unwrap_or_default();
    let slot = slot_of(gateway, &task_id).await?;
    if slot.progress.lock().await.0.ended {
        return Err(ended(&slot.contract_id, "the task's contract has ended".into()).into());
    }
    let state = gateway.contract(&slot.contract_id).await?;
    if !matches!(
        pb::ContractStatus::try_from(state.status),
        Ok(pb::ContractStatus::Open | pb::ContractStatus::Accepted)
    ) {
        return Err(ended(
            &slot.contract_id,
            format!("it is {}", status_name(state.status)),
        )
        .into());
    }
    let response: a2a::SendMessageResponse = gateway
        .upstream_call("SendMessage", &request, headers)
        .await?;
    match response.payload {
        Some(a2a::send_message_response::Payload::Task(task)) => {
            let events = slot.events.subscribe();
            let task = observe(gateway, &slot, task).await?;
            Ok(Answered::Task { slot, task, events })
        }
        Some(a2a::send_message_response::Payload::Message(reply)) => Ok(Answered::Message(reply)),
        None => Err(Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            "the agent answered SendMessage with neither a task nor a message",
        )
        .into()),
    }
}

/// An agent that answered with a message and no task: Accept and Complete
/// with the message's parts as the output.
async fn direct(
    gateway: &Gateway,
    slot: &Slot,
    mut reply: a2a::Message,
) -> Result<a2a::Message, CallError> {
    let artifact = a2a::Artifact {
        parts: reply.parts.clone(),
        ..Default::default()
    };
    let task = a2a::Task {
        status: Some(a2a::TaskStatus {
            state: TaskState::Completed as i32,
            ..Default::default()
        }),
        artifacts: vec![artifact],
        ..Default::default()
    };
    let judged = observe(gateway, slot, task).await?;
    let mut metadata = serde_json::to_value(&reply.metadata)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    if let Some(ext) = serde_json::to_value(&judged.metadata)
        .ok()
        .and_then(|v| v.get(ext::URI).cloned())
    {
        metadata.insert(ext::URI.into(), ext);
    }
    reply.metadata = serde_json::from_value(Value::Object(metadata)).ok();
    Ok(reply)
}

/// Answers a SendMessage: at once, or once the task settles when the
/// caller did not ask for `returnImmediately` (bounded by call_timeout_ms).
async fn answer_task(
    gateway: &Gateway,
    slot: &Slot,
    task: a2a::Task,
    wait: bool,
) -> Result<Value, CallError> {
    let mut task = task;
    if wait && !settled(&task) {
        let mut latest = slot.latest.subscribe();
        let timeout = Duration::from_millis(gateway.config.call_timeout_ms);
        let finished = || slot.finished.load(std::sync::atomic::Ordering::Acquire);
        let waited = tokio::time::timeout(
            timeout,
            latest.wait_for(|t| t.as_ref().is_some_and(settled) || finished()),
        )
        .await;
        if let Ok(Ok(seen)) = waited
            && let Some(seen) = seen.clone()
        {
            task = seen;
        } else if let Some(seen) = slot.latest.borrow().clone() {
            task = seen;
        }
    }
    to_value(&a2a::SendMessageResponse {
        payload: Some(a2a::send_message_response::Payload::Task(task)),
    })
}

async fn get(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let request: a2a::GetTaskRequest = params(rpc)?;
    let slot = slot_of(gateway, &request.id).await?;
    let task: a2a::Task = gateway
        .upstream_call("GetTask", &request, &passed_headers(rpc))
        .await?;
    let task = observe(gateway, &slot, task).await?;
    to_value(&task)
}

async fn cancel(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let request: a2a::CancelTaskRequest = params(rpc)?;
    let slot = slot_of(gateway, &request.id).await?;
    // Only the principal cancels, by its signed Revoke: an anonymous
    // CancelTask is taken once the contract has ended.
    let state = gateway.contract(&slot.contract_id).await?;
    if matches!(
        pb::ContractStatus::try_from(state.status),
        Ok(pb::ContractStatus::Open | pb::ContractStatus::Accepted)
    ) {
        return Err(Refused::new(
            code::TASK_NOT_CANCELABLE,
            "NOT_PRINCIPAL",
            format!(
                "task {:?} runs under contract {}, which is open: its principal cancels it by revoking the contract (this gateway then cancels the task)",
                ext::echoed(&request.id),
                hex::encode(slot.contract_id)
            ),
        )
        .into());
    }
    let task: a2a::Task = gateway
        .upstream_call("CancelTask", &request, &passed_headers(rpc))
        .await?;
    let task = observe(gateway, &slot, task).await?;
    to_value(&task)
}
