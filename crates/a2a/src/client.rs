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

#[derive(Clone)]
pub struct A2aClient {
    http: reqwest::Client,
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
        let mut builder = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(Duration::from_millis(timeout_ms))
            .redirect(reqwest::redirect::Policy::none());
        if !reuse {
            builder = builder.pool_max_idle_per_host(0);
        }
        let http = builder.build()?;
        Ok(Self {
            http,
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

    /// One JSON-RPC call; `headers` are passed on (trace context).
    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        url: &str,
        method: &str,
        params: &P,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<R, CallError> {
        let request = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let mut builder = self
            .http
            .post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("A2A-Version", PROTOCOL_VERSION);
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        let started = std::time::Instant::now();
        let response = builder
            .body(request.to_string())
            .send()
            .await
            .map_err(|e| unreachable_peer(url, &e))?;
        self.metrics
            .upstream(method, started.elapsed().as_secs_f64());
        let status = response.status();
        let body = self.body(response, url).await?;
        let mut answer: Value = serde_json::from_slice(&body).map_err(|_| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("{url} answered HTTP {status} without a JSON-RPC body"),
            )
        })?;
        if let Some(error) = answer.get_mut("error").map(Value::take) {
            return Err(CallError::Remote(error));
        }
        let result = answer.get_mut("result").map(Value::take).ok_or_else(|| {
            Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("{url} answered neither a result nor an error"),
            )
        })?;
        serde_json::from_value(result).map_err(|e| {
            CallError::Local(Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                format!("{url}: {method} answered something that is not its A2A result ({e})"),
            ))
        })
    }
}

fn unreachable_peer(url: &str, error: &reqwest::Error) -> Refused {
    let why = if error.is_timeout() {
        "did not answer in time"
    } else {
        "could not be reached"
    };
    Refused::new(code::INTERNAL, "UNAVAILABLE", format!("{url} {why}"))
}
