//! The gateway's A2A client over the JSON-RPC binding: the agent's card and
//! calls to the fronted agent (ingress) and to peers' gateways (egress),
//! every answer bounded in bytes and time.

use std::time::Duration;

use a2a_pb::protojson as a2a;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::ext::{Refused, code};
use super::gateway::CONNECT_TIMEOUT;

/// Where an agent's card is, under its base URL (A2A v1).
pub const CARD_PATH: &str = "/.well-known/agent-card.json";
/// The A2A protocol version the gateway speaks and asks for.
pub const PROTOCOL_VERSION: &str = "1.0";

/// A call that failed: the other side's JSON-RPC error (relayed as is), or
/// the gateway's own.
#[derive(Debug)]
pub enum CallError {
    Remote(Value),
    Local(Refused),
}

impl From<Refused> for CallError {
    fn from(refused: Refused) -> Self {
        Self::Local(refused)
    }
}

/// Longest silence a stream from an agent or a peer may keep between two
/// chunks (the A2A SDK's servers send a comment every 15 s); the stream
/// as a whole is bounded by its task's contract, not by a call timeout.
pub const STREAM_IDLE: Duration = Duration::from_secs(60);
/// Events read from a stream ahead of its reader.
const STREAM_READ_AHEAD: usize = 16;

#[derive(Clone)]
pub struct A2aClient {
    http: reqwest::Client,
    /// The same, without the per-call timeout, for streams.
    streams: reqwest::Client,
    max_bytes: usize,
    metrics: std::sync::Arc<super::metrics::GatewayMetrics>,
}

impl A2aClient {
    /// `reuse`: keep connections open between calls. Off for the fronted
    /// agent: the official Python SDK's server (uvicorn) answers a second
    /// request on a kept-alive connection about 40 ms late (measured: 6 ms
    /// on a fresh connection, 45–50 ms on a reused one), while a loopback
    /// or LAN connect costs well under a millisecond.
    pub fn new(
        timeout_ms: u64,
        max_bytes: usize,
        reuse: bool,
        metrics: std::sync::Arc<super::metrics::GatewayMetrics>,
    ) -> anyhow::Result<Self> {
        // No redirect is followed: one would carry a message's chain, or a
        // route's token header, to a host the config never named.
        let builder = || {
            let builder = reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .redirect(reqwest::redirect::Policy::none());
            if reuse {
                builder
            } else {
                builder.pool_max_idle_per_host(0)
            }
        };
        let http = builder()
            .timeout(Duration::from_millis(timeout_ms))
            .build()?;
        let streams = builder().read_timeout(STREAM_IDLE).build()?;
        Ok(Self {
            http,
            streams,
            max_bytes,
            metrics,
        })
    }

    /// Reads a body up to the byte limit.
    async fn body(&self, mut response: reqwest::Response, what: &str) -> Result<Vec<u8>, Refused> {
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| unreachable_peer(what, &e))?
        {
            if body.len() + chunk.len() > self.max_bytes {
                return Err(Refused::new(
                    code::INTERNAL,
                    "RESPONSE_TOO_LARGE",
                    format!("{what} answered more than {} bytes", self.max_bytes),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// An agent's card, from its base URL.
    pub async fn card(&self, base: &str) -> Result<a2a::AgentCard, Refused> {
        let url = format!("{}{CARD_PATH}", base.trim_end_matches('/'));
        let response = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| unreachable_peer(&url, &e))?;
        if !response.status().is_success() {
            return Err(Refused::new(
                code::INTERNAL,
                "UNAVAILABLE",
                format!("{url} answered HTTP {}", response.status()),
            ));
        }
        let body = self.body(response, &url).await?;
        serde_json::from_slice(&body).map_err(|e| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("{url}: not an A2A v1 agent card ({e})"),
            )
        })
    }

    /// A JSON-RPC request's builder: the body, the protocol version and
    /// `headers` passed on (trace context, a route's token).
    fn post<P: Serialize>(
        http: &reqwest::Client,
        url: &str,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> reqwest::RequestBuilder {
        let request = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let mut builder = http
            .post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("A2A-Version", PROTOCOL_VERSION);
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        builder.body(request.to_string())
    }

    /// One JSON-RPC call; `headers` are passed on (trace context).
    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        url: &str,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<R, CallError> {
        let started = std::time::Instant::now();
        let response = Self::post(&self.http, url, method, params, headers)
            .send()
            .await
            .map_err(|e| unreachable_peer(url, &e))?;
        self.metrics
            .upstream(method, started.elapsed().as_secs_f64());
        self.answer(response, url, method).await
    }

    /// A JSON-RPC answer's result as `R`, or its error.
    async fn answer<R: DeserializeOwned>(
        &self,
        response: reqwest::Response,
        url: &str,
        method: &str,
    ) -> Result<R, CallError> {
        let status = response.status();
        let body = self.body(response, url).await?;
        let answer: Value = serde_json::from_slice(&body).map_err(|_| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("{url} answered HTTP {status} without a JSON-RPC body"),
            )
        })?;
        result_of(answer, &format!("{url}: {method}"))
    }
}

impl A2aClient {
    /// One streaming JSON-RPC call (SendStreamingMessage, SubscribeToTask):
    /// its events as they come (Server-Sent Events, each at most the
    /// message bound, at most `STREAM_IDLE` apart). An answer that is not
    /// an event stream is read as one JSON-RPC answer: its error.
    pub async fn stream<P: Serialize>(
        &self,
        url: &str,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<crate::stream::Events, CallError> {
        let started = std::time::Instant::now();
        let response = Self::post(&self.streams, url, method, params, headers)
            .header(http::header::ACCEPT, "text/event-stream")
            .send()
            .await
            .map_err(|e| unreachable_peer(url, &e))?;
        self.metrics
            .upstream(method, started.elapsed().as_secs_f64());
        let is_stream = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_stream {
            let answer: Result<Value, CallError> = self.answer(response, url, method).await;
            return Err(match answer {
                Err(error) => error,
                Ok(_) => CallError::Local(Refused::new(
                    code::INTERNAL,
                    "UNDECODABLE_MESSAGE",
                    format!("{url}: {method} answered one result, not a stream"),
                )),
            });
        }
        let mut reader = crate::stream::SseReader::new(self.max_bytes);
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_READ_AHEAD);
        let (mut response, url) = (response, url.to_owned());
        // Read on a task of its own, at most STREAM_READ_AHEAD events
        // ahead of the reader; it stops when the reader goes away.
        tokio::spawn(async move {
            loop {
                // A reader that left is noticed while the peer is quiet.
                let chunk = tokio::select! {
                    chunk = response.chunk() => chunk,
                    () = tx.closed() => return,
                };
                let sent = match chunk {
                    Ok(Some(chunk)) => match reader.feed(&chunk) {
                        Ok(events) => {
                            let mut open = true;
                            for sse in events {
                                let event = crate::stream::event_of(&sse, &url);
                                let last = event.is_err();
                                open = tx.send(event).await.is_ok() && !last;
                                if !open {
                                    break;
                                }
                            }
                            open
                        }
                        Err(refused) => {
                            let _ = tx.send(Err(refused.into())).await;
                            false
                        }
                    },
                    Ok(None) => false,
                    Err(e) => {
                        let _ = tx.send(Err(unreachable_peer(&url, &e).into())).await;
                        false
                    }
                };
                if !sent {
                    return;
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

/// A JSON-RPC response's result as `R` (an A2A type), or its error;
/// `what` names the answer in a refusal.
pub(crate) fn result_of<R: DeserializeOwned>(
    mut answer: Value,
    what: &str,
) -> Result<R, CallError> {
    if let Some(error) = answer.get_mut("error").map(Value::take) {
        return Err(CallError::Remote(error));
    }
    let result = answer.get_mut("result").map(Value::take).ok_or_else(|| {
        Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            format!("{what}: neither a result nor an error"),
        )
    })?;
    serde_json::from_value(result).map_err(|e| {
        CallError::Local(Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            format!("{what}: not its A2A result ({e})"),
        ))
    })
}

fn unreachable_peer(url: &str, error: &reqwest::Error) -> Refused {
    let why = if error.is_timeout() {
        "did not answer in time"
    } else {
        "could not be reached"
    };
    Refused::new(code::INTERNAL, "UNAVAILABLE", format!("{url} {why}"))
}
