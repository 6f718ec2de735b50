//! A2A streams (`SendStreamingMessage`, `SubscribeToTask`): the events a
//! stream carries, read from an agent's or a peer's Server-Sent Events
//! (`SseReader`), folded into the task they update (`fold`), and relayed
//! with the broker's word on them (`relayed`).

use std::pin::Pin;

use a2a_pb::protojson::stream_response::Payload;
use a2a_pb::protojson::{self as a2a, TaskState};
use serde_json::Value;

use crate::client::CallError;
use crate::ext::{self, Refused, code};

/// A stream of A2A events; an error ends it.
pub(crate) type Events =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<a2a::StreamResponse, CallError>> + Send>>;

/// Most events a follower may publish before a slow caller's stream
/// misses some (it then gets the latest task whole, then goes on).
pub(crate) const EVENTS_BUFFER: usize = 256;

/// Methods that answer with a stream.
pub(crate) fn is_streaming(method: &str) -> bool {
    matches!(method, "SendStreamingMessage" | "SubscribeToTask")
}

/// One Server-Sent Event: its `event:` name and its `data:` lines joined.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SseEvent {
    pub event: String,
    pub data: String,
}

/// Reads Server-Sent Events (the W3C format) from a body's chunks:
/// lines ended by CRLF, LF or CR, `:` comments skipped, `data:` lines
/// joined with `\n`, a blank line ending an event. No event and no line
/// may pass `max_bytes`.
pub(crate) struct SseReader {
    max_bytes: usize,
    line: Vec<u8>,
    /// The last byte read was a CR: an LF right after it ends nothing.
    after_cr: bool,
    event: SseEvent,
}

impl SseReader {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            line: Vec::new(),
            after_cr: false,
            event: SseEvent::default(),
        }
    }

    /// The events `chunk` completes.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, Refused> {
        let mut events = Vec::new();
        for &byte in chunk {
            let after_cr = std::mem::replace(&mut self.after_cr, byte == b'\r');
            match byte {
                b'\n' if after_cr => {}
                b'\r' | b'\n' => {
                    if let Some(event) = self.end_line()? {
                        events.push(event);
                    }
                }
                _ => {
                    if self.line.len() + self.event.data.len() >= self.max_bytes {
                        return Err(too_large(self.max_bytes));
                    }
                    self.line.push(byte);
                }
            }
        }
        Ok(events)
    }

    fn end_line(&mut self) -> Result<Option<SseEvent>, Refused> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.event.data.is_empty() && self.event.event.is_empty() {
                return Ok(None);
            }
            return Ok(Some(std::mem::take(&mut self.event)));
        }
        if line.starts_with(b":") {
            return Ok(None);
        }
        let line = String::from_utf8(line).map_err(|_| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                "an event stream line is not UTF-8",
            )
        })?;
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_str(), ""),
        };
        match field {
            "data" => {
                if !self.event.data.is_empty() {
                    self.event.data.push('\n');
                }
                self.event.data.push_str(value);
                if self.event.data.len() > self.max_bytes {
                    return Err(too_large(self.max_bytes));
                }
            }
            "event" => self.event.event = value.to_owned(),
            _ => {} // id, retry: nothing the gateway uses.
        }
        Ok(None)
    }
}

fn too_large(max_bytes: usize) -> Refused {
    Refused::new(
        code::INTERNAL,
        "RESPONSE_TOO_LARGE",
        format!("an event of the stream is over {max_bytes} bytes"),
    )
}

/// An SSE event of an A2A JSON-RPC stream: a whole JSON-RPC response,
/// whose result is a StreamResponse (or whose error ends the stream).
pub(crate) fn event_of(sse: &SseEvent, url: &str) -> Result<a2a::StreamResponse, CallError> {
    let answer: Value = serde_json::from_str(&sse.data).map_err(|_| {
        Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            format!("{url} streamed an event that is not JSON-RPC"),
        )
    })?;
    crate::client::result_of(answer, &format!("{url}: a streamed event"))
}

/// The task `event` leaves `task` as: a Task replaces it, a status update
/// sets its status, an artifact update adds its artifact or (`append`)
/// extends the parts of the one with the same id. A message changes
/// nothing. Artifacts and parts stay within `ext::MAX_PARTS`.
pub(crate) fn fold(task: &mut a2a::Task, event: &a2a::StreamResponse) {
    match &event.payload {
        Some(Payload::Task(whole)) => *task = whole.clone(),
        Some(Payload::StatusUpdate(update)) => {
            fill_ids(task, &update.task_id, &update.context_id);
            task.status = update.status.clone();
        }
        Some(Payload::ArtifactUpdate(update)) => {
            fill_ids(task, &update.task_id, &update.context_id);
            let Some(artifact) = &update.artifact else {
                return;
            };
            let room_for_one = task.artifacts.len() < ext::MAX_PARTS;
            let same = task
                .artifacts
                .iter_mut()
                .find(|a| a.artifact_id == artifact.artifact_id);
            match same {
                Some(known) if update.append => {
                    let room = ext::MAX_PARTS.saturating_sub(known.parts.len());
                    known
                        .parts
                        .extend(artifact.parts.iter().take(room).cloned());
                }
                Some(known) => *known = artifact.clone(),
                None if room_for_one => task.artifacts.push(artifact.clone()),
                None => {}
            }
        }
        Some(Payload::Message(_)) | None => {}
    }
}

/// A folded task's size, bounded as a GetTask answer is (`max_bytes`,
/// `max_message_bytes`): appends could otherwise grow it to `MAX_PARTS`
/// artifacts of `MAX_PARTS` parts of a whole event each. It keeps an upper
/// bound (each event grows the task by at most its own size) and measures
/// the task only when that bound passes `max_bytes` by an eighth, so the
/// measuring costs O(1) per byte received, however small the events.
pub(crate) struct FoldBound {
    max_bytes: usize,
    upper_bytes: usize,
}

impl FoldBound {
    pub(crate) fn new(max_bytes: usize, task: &a2a::Task) -> Self {
        use prost::Message as _;
        Self {
            max_bytes,
            upper_bytes: task.encoded_len(),
        }
    }

    /// After `event` was folded into `task`: refused when the task is now
    /// larger than a GetTask answer may be.
    pub(crate) fn check(
        &mut self,
        task: &a2a::Task,
        event: &a2a::StreamResponse,
    ) -> Result<(), Refused> {
        use prost::Message as _;
        self.upper_bytes = match &event.payload {
            Some(Payload::Task(_)) => task.encoded_len(),
            _ => self.upper_bytes.saturating_add(event.encoded_len()),
        };
        if self.upper_bytes > self.max_bytes.saturating_add(self.max_bytes / 8) {
            self.upper_bytes = task.encoded_len();
            if self.upper_bytes > self.max_bytes {
                return Err(Refused::new(
                    code::INTERNAL,
                    "RESPONSE_TOO_LARGE",
                    format!(
                        "the task the agent streamed grew past {} bytes (max_message_bytes)",
                        self.max_bytes
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn fill_ids(task: &mut a2a::Task, task_id: &str, context_id: &str) {
    if task.id.is_empty() {
        task.id = task_id.to_owned();
    }
    if task.context_id.is_empty() {
        task.context_id = context_id.to_owned();
    }
}

/// `event` as the caller sees it once the gateway has moved the contract
/// (`decorated` is the task after it, with the broker's word): a Task is
/// the decorated task, a status update carries the decorated status (a
/// rejected completion shows FAILED, as GetTask does) and the extension's
/// metadata; artifact updates and messages go on as sent.
pub(crate) fn relayed(event: a2a::StreamResponse, decorated: &a2a::Task) -> a2a::StreamResponse {
    let payload = match event.payload {
        Some(Payload::Task(_)) => Some(Payload::Task(decorated.clone())),
        Some(Payload::StatusUpdate(mut update)) => {
            update.status = decorated.status.clone();
            update.metadata = decorated.metadata.clone();
            Some(Payload::StatusUpdate(update))
        }
        other => other,
    };
    a2a::StreamResponse { payload }
}

/// A decorated task as a stream's event.
pub(crate) fn task_event(task: a2a::Task) -> a2a::StreamResponse {
    a2a::StreamResponse {
        payload: Some(Payload::Task(task)),
    }
}

/// The state an event leaves its task in, when it says one.
pub(crate) fn state_of(event: &a2a::StreamResponse) -> Option<TaskState> {
    let status = match &event.payload {
        Some(Payload::Task(task)) => task.status.as_ref(),
        Some(Payload::StatusUpdate(update)) => update.status.as_ref(),
        _ => None,
    }?;
    TaskState::try_from(status.state).ok()
}

/// The task an event names.
pub(crate) fn task_id_of(event: &a2a::StreamResponse) -> Option<&str> {
    let id = match &event.payload {
        Some(Payload::Task(task)) => &task.id,
        Some(Payload::StatusUpdate(update)) => &update.task_id,
        Some(Payload::ArtifactUpdate(update)) => &update.task_id,
        Some(Payload::Message(message)) => &message.task_id,
        None => return None,
    };
    (!id.is_empty()).then_some(id.as_str())
}

/// Whether a caller's stream ends after `event`: its task settled (a
/// final or interrupted state), or the agent answered with a message.
pub(crate) fn ends(event: &a2a::StreamResponse) -> bool {
    matches!(event.payload, Some(Payload::Message(_)))
        || state_of(event).is_some_and(ext::is_settled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(chunks: &[&str]) -> Vec<SseEvent> {
        let mut reader = SseReader::new(1024);
        chunks
            .iter()
            .flat_map(|c| reader.feed(c.as_bytes()).unwrap())
            .collect()
    }

    #[test]
    fn events_are_read_across_chunks_and_line_endings() {
        let events = read(&[
            ": ping\r\n\r\ndata: {\"a\":1}\r",
            "\n\r\nevent: error\ndata: x\ndata:y\n\n",
            "data: z\r\rid: 7\n\n",
        ]);
        assert_eq!(
            events,
            vec![
                SseEvent {
                    event: String::new(),
                    data: "{\"a\":1}".into()
                },
                SseEvent {
                    event: "error".into(),
                    data: "x\ny".into()
                },
                SseEvent {
                    event: String::new(),
                    data: "z".into()
                },
            ]
        );
    }

    #[test]
    fn an_event_past_the_bound_is_refused() {
        let mut reader = SseReader::new(16);
        let refused = reader
            .feed(b"data: 0123456789\ndata: 0123456789\n\n")
            .unwrap_err();
        assert_eq!(refused.reason, "RESPONSE_TOO_LARGE");
        let mut reader = SseReader::new(16);
        assert!(reader.feed(&[b'x'; 64]).is_err(), "a line without end");
    }

    #[test]
    fn an_error_event_ends_the_stream_as_the_remote_error() {
        let sse = SseEvent {
            event: "error".into(),
            data: r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32001,"message":"no task"}}"#.into(),
        };
        match event_of(&sse, "http://agent") {
            Err(CallError::Remote(error)) => assert_eq!(error["code"], -32001),
            other => panic!("{other:?}"),
        }
        let sse = SseEvent {
            event: String::new(),
            data: r#"{"jsonrpc":"2.0","id":1,"result":{"statusUpdate":{"taskId":"t","contextId":"c","status":{"state":"TASK_STATE_WORKING"}}}}"#.into(),
        };
        let event = event_of(&sse, "http://agent").unwrap();
        assert_eq!(state_of(&event), Some(TaskState::Working));
        assert_eq!(task_id_of(&event), Some("t"));
        assert!(!ends(&event));
    }

    fn artifact(id: &str, text: &str) -> a2a::Artifact {
        a2a::Artifact {
            artifact_id: id.into(),
            parts: vec![a2a::Part {
                content: Some(a2a::part::Content::Text(text.into())),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn update(artifact: a2a::Artifact, append: bool) -> a2a::StreamResponse {
        a2a::StreamResponse {
            payload: Some(Payload::ArtifactUpdate(a2a::TaskArtifactUpdateEvent {
                task_id: "t".into(),
                context_id: "c".into(),
                artifact: Some(artifact),
                append,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_task_grown_by_appends_is_bounded_as_an_answer_is() {
        use prost::Message as _;
        const MAX_BYTES: usize = 4_096;
        let mut task = a2a::Task::default();
        let mut bound = FoldBound::new(MAX_BYTES, &task);
        let mut measured_over = None;
        for i in 0..200 {
            let event = update(artifact("a", &"x".repeat(100)), i > 0);
            fold(&mut task, &event);
            if bound.check(&task, &event).is_err() {
                measured_over = Some(task.encoded_len());
                break;
            }
            assert!(task.encoded_len() <= MAX_BYTES + MAX_BYTES / 8 + event.encoded_len());
        }
        let over = measured_over.expect("refused once past the bound");
        assert!(over > MAX_BYTES, "refused only past it: {over}");
        // A task replaced whole starts the count again.
        let small = a2a::StreamResponse {
            payload: Some(Payload::Task(a2a::Task::default())),
        };
        fold(&mut task, &small);
        assert!(bound.check(&task, &small).is_ok());
    }

    #[test]
    fn updates_fold_into_the_task_as_the_sdk_merges_them() {
        let mut task = a2a::Task::default();
        fold(&mut task, &update(artifact("a", "1"), false));
        fold(&mut task, &update(artifact("a", "2"), true));
        fold(&mut task, &update(artifact("b", "x"), false));
        fold(&mut task, &update(artifact("b", "y"), false));
        assert_eq!((task.id.as_str(), task.context_id.as_str()), ("t", "c"));
        assert_eq!(task.artifacts.len(), 2);
        assert_eq!(task.artifacts[0].parts.len(), 2, "appended");
        assert_eq!(task.artifacts[1], artifact("b", "y"), "replaced");
        let done = a2a::StreamResponse {
            payload: Some(Payload::StatusUpdate(a2a::TaskStatusUpdateEvent {
                task_id: "t".into(),
                status: Some(a2a::TaskStatus {
                    state: TaskState::Completed as i32,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        };
        fold(&mut task, &done);
        assert!(ext::is_settled(TaskState::Completed));
        assert!(ends(&done));
        let mut decorated = task.clone();
        ext::decorate(
            &mut decorated,
            &ext::Judged {
                contract_id: vec![7; 32],
                verdict: Some("REJECTED"),
                ..Default::default()
            },
        );
        // The caller sees the broker's word on the final status.
        match relayed(done, &decorated).payload {
            Some(Payload::StatusUpdate(update)) => {
                assert_eq!(
                    update.status.map(|s| s.state),
                    Some(TaskState::Failed as i32)
                );
                let metadata = serde_json::to_value(&update.metadata).unwrap();
                assert_eq!(metadata[ext::URI]["verdict"], "REJECTED");
            }
            other => panic!("{other:?}"),
        }
    }
}
