//! `delegation-broker mcp gateway`: an MCP server in front of an agent's
//! own tool servers that is the host of its contract.
//! It serves the union of their tools and, for every call: refuses it as a
//! tool error, before it reaches a tool server, when the contract has
//! ended or expired, when its metered units exceed the residual, or when
//! it mutates a path outside the write scope (or lets that through and
//! records it, in record mode); else forwards it, and records what it saw
//! — the call, its units, the paths it read and mutated — as host
//! observations (RecordReceipts, batched, signed with the host key)
//! *before* answering, so a call the model saw answered is in the broker
//! whatever happens to the gateway afterwards. The broker judges the
//! delegate's completion on these observations, not on its claim.

mod bearer;
pub mod config;
pub mod recorder;
pub mod resolve;
pub mod rules;
mod upstream;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};

use self::config::{GatewayConfig, OutOfScope, ToolRule};
use self::recorder::Recorder;
use self::rules::ContractView;
use self::upstream::Upstream;
use broker_client::trace::{traced, valid_traceparent};
use broker_client::{BrokerError, Link};
use broker_wire::clock::Clock as _;
use broker_wire::pb;

/// The `_meta` key a call may name its contract with (64 hex), when the
/// gateway hosts several.
pub const CONTRACT_META_KEY: &str = "delegation-broker/contract_id";

/// One served tool: where it goes and what its calls record.
struct Route {
    server: usize,
    /// The tool's name on its server.
    upstream: String,
    /// `"<server>.<tool>"`: the name receipts record and rules are keyed by.
    qualified: String,
    rule: ToolRule,
}

struct Inner {
    link: Link,
    recorder: Recorder,
    mode: OutOfScope,
    pinned: Option<[u8; 32]>,
    /// Resolved-path mode's root, canonical (`config.resolve_root`).
    resolve_root: Option<std::path::PathBuf>,
    /// The contract found by its host key, kept while it stays open.
    found: std::sync::Mutex<Option<[u8; 32]>>,
    servers: Vec<Upstream>,
    routes: HashMap<String, Route>,
    tools: Vec<Tool>,
    call_timeout: Duration,
}

/// The MCP server. A clone is one more MCP session of the same gateway
/// (the streamable HTTP transport makes one per session): it shares the
/// tool servers, the broker link and the recorder, and has its own pin.
pub struct Gateway {
    inner: Arc<Inner>,
    /// The contract this session named first and was admitted for: every
    /// later call of the session is for it, so an agent cannot switch to
    /// another contract the gateway hosts (a sibling's) mid-session.
    session_pin: std::sync::Mutex<Option<[u8; 32]>>,
}

impl Clone for Gateway {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            session_pin: std::sync::Mutex::new(None),
        }
    }
}

/// Serves the gateway of `config` over streamable HTTP at `/mcp` on
/// `listener` until `shutdown` resolves (the CLI binds `--listen` and
/// passes `broker_runtime::shutdown::signal()`), then lets the calls in
/// flight finish. Its tool servers are started first; `mcp on
/// http://ADDR/mcp` is printed on stdout once it serves.
pub async fn run(
    listener: tokio::net::TcpListener,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let gateway = Gateway::connect(config).await?;
    crate::serve::http(gateway, listener, shutdown).await
}

/// Serves the gateway of `config` on stdin/stdout until the client closes
/// them or `shutdown` resolves.
pub async fn run_stdio(
    config: GatewayConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let gateway = Gateway::connect(config).await?;
    crate::serve::stdio(gateway, shutdown).await
}

impl Gateway {
    /// `start` with a channel to the config's broker.
    async fn connect(config: GatewayConfig) -> anyhow::Result<Self> {
        let tls = tokio::task::spawn_blocking(crate::broker_tls).await??;
        let channel = crate::broker_channel(&config.broker, &tls)?;
        let gateway = Self::start(config, channel).await?;
        tracing::info!(host = %gateway.host(), "MCP gateway ready");
        Ok(gateway)
    }

    /// Reads the host key, starts every tool server and lists their tools.
    pub async fn start(
        config: GatewayConfig,
        channel: tonic::transport::Channel,
    ) -> anyhow::Result<Self> {
        // reqwest (HTTP upstreams) takes the process's rustls provider; one
        // already installed is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let agent = broker_client::keys::agent_from_key_file(&config.key_file)?;
        let link = Link::new(agent, channel);
        let mut servers = Vec::new();
        for server in &config.servers {
            servers.push(Upstream::connect(server, config.tokens_url.as_deref()).await?);
        }
        let (routes, tools) = route(&servers, &config);
        for (name, route) in &routes {
            tracing::info!(tool = %name, upstream = %route.qualified, "serving");
        }
        let pinned = config
            .contract
            .as_deref()
            .and_then(|c| hex::decode(c).ok())
            .and_then(|b| <[u8; 32]>::try_from(b).ok());
        Ok(Self::with_inner(Arc::new(Inner {
            recorder: Recorder::start(link.clone()),
            link,
            mode: config.out_of_scope,
            pinned,
            resolve_root: config.resolve_root.clone(),
            found: std::sync::Mutex::new(None),
            servers,
            routes,
            tools,
            call_timeout: Duration::from_millis(config.call_timeout_ms),
        })))
    }

    fn with_inner(inner: Arc<Inner>) -> Self {
        Self {
            inner,
            session_pin: std::sync::Mutex::new(None),
        }
    }

    /// Pins the session to `id`, the contract a call named and was
    /// admitted for; refused when the session (or the configuration) is
    /// pinned to another. Checked before the broker is asked and again
    /// after admission, so two concurrent first calls cannot pin two.
    fn pin(&self, id: [u8; 32], set: bool) -> Result<(), BrokerError> {
        let mut pin = self.session_pin.lock().unwrap_or_else(|p| p.into_inner());
        let held = pin.or(self.inner.pinned);
        if let Some(held) = held
            && held != id
        {
            return Err(BrokerError::new(
                "CONTRACT_PINNED",
                format!(
                    "this session acts for contract {}; a call naming {} is refused (one contract a session); nothing was forwarded",
                    hex::encode(held),
                    hex::encode(id)
                ),
            )
            .with("contract_id", hex::encode(held)));
        }
        if set {
            *pin = Some(id);
        }
        Ok(())
    }

    /// The host key's public key, hex.
    pub fn host(&self) -> String {
        hex::encode(self.inner.link.agent.public_key())
    }

    /// One call, in a span of its own when spans are exported: a child of
    /// the call's `_meta.traceparent`, and the parent of what the gateway
    /// asks the broker and the tool server for it.
    async fn call(&self, request: CallToolRequestParams) -> Result<CallToolResult, BrokerError> {
        let sent = request
            .meta
            .as_ref()
            .and_then(|m| m.0.0.get("traceparent"))
            .and_then(|v| v.as_str())
            .filter(|v| valid_traceparent(v))
            .map(str::to_owned);
        let mut span =
            broker_runtime::telemetry::StepSpan::start("mcp.gateway/tools/call", sent.as_deref());
        let trace = span.as_ref().map(|s| s.traceparent()).or(sent);
        let result = self.call_traced(request, trace).await;
        if let Some(span) = &mut span {
            let outcome = match &result {
                Ok(r) if r.is_error == Some(true) => "tool_error".to_owned(),
                Ok(_) => "ok".to_owned(),
                Err(e) => e.reason.clone(),
            };
            span.attribute("mcp.outcome", outcome);
        }
        if let Some(span) = span {
            span.end();
        }
        result
    }

    async fn call_traced(
        &self,
        request: CallToolRequestParams,
        trace: Option<String>,
    ) -> Result<CallToolResult, BrokerError> {
        let gateway = &self.inner;
        let started = std::time::Instant::now();
        let Some(route) = gateway.routes.get(request.name.as_ref()) else {
            // Quoted back no longer than a tool name the broker records.
            let name = broker_client::names::cut(&request.name, rules::MAX_TOOL_NAME_BYTES);
            return Err(BrokerError::new(
                "UNKNOWN_TOOL",
                format!("no tool {name:?} here: tools/list names the tools served"),
            ));
        };
        // Cheap checks first: the arguments' size and depth, their paths.
        rules::check_arguments(request.arguments.as_ref())?;
        let mut paths = rules::paths(&route.rule, request.arguments.as_ref())?;
        if let Some(root) = &gateway.resolve_root {
            paths = resolved(root.clone(), paths).await?;
        }
        let named = request
            .meta
            .as_ref()
            .and_then(|m| m.0.0.get(CONTRACT_META_KEY))
            .map(|v| {
                v.as_str()
                    .and_then(|s| hex::decode(s).ok())
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .ok_or_else(|| {
                        BrokerError::input(
                            CONTRACT_META_KEY,
                            "_meta names a contract that is not 64 hex",
                        )
                    })
            })
            .transpose()?;
        if let Some(id) = named {
            self.pin(id, false)?;
        }
        let (contract, view) = self.contract(named, trace.as_deref()).await?;
        let checked = started.elapsed();
        let now_ms = broker_wire::clock::SystemClock.now_ms();
        let host = gateway.link.agent.public_key();
        rules::admit(&view, &host, now_ms, route.rule.units, &paths, gateway.mode)?;
        if named.is_some() {
            self.pin(contract, true)?;
        }
        // Forwarded as the model sent it, under the tool's own name; of
        // `_meta` only the trace context goes on.
        let mut forward = CallToolRequestParams::new(route.upstream.clone());
        forward.arguments = request.arguments.clone();
        forward.meta = trace.as_deref().map(trace_meta);
        let upstream = &gateway.servers[route.server];
        let (host, timeout) = (&gateway.link.agent, gateway.call_timeout);
        let answered = upstream.call_for(host, &contract, forward, timeout).await;
        let forwarded = started.elapsed();
        let result = match answered {
            Ok(result) => Ok(result),
            // It ran and answered, too much to hand back: recorded.
            Err(error) if error.reason == "RESULT_TOO_LARGE" => Err(error),
            // No answer: whether it ran is unknown, nothing is recorded.
            Err(error) => return Err(error),
        };
        let observations = observed(
            route,
            request.arguments.as_ref(),
            result.as_ref().ok(),
            paths,
            now_ms,
        );
        gateway
            .recorder
            .record(contract, observations, trace)
            .await?;
        // Each step's time, for the bench (`BROKER_LOG=broker_mcp=debug`):
        // the checks (arguments, paths, the contract's read), the tool
        // server (with a token server, the token and the wait for its
        // turn too), the record.
        tracing::debug!(
            check_us = checked.as_micros() as u64,
            upstream_us = (forwarded - checked).as_micros() as u64,
            record_us = (started.elapsed() - forwarded).as_micros() as u64,
            "tools/call steps"
        );
        result
    }

    /// The contract a call is for, and its state now: the one the call's
    /// `_meta` names, else the configured one, else the one open contract
    /// whose host is this gateway's key.
    async fn contract(
        &self,
        named: Option<[u8; 32]>,
        trace: Option<&str>,
    ) -> Result<([u8; 32], ContractView), BrokerError> {
        let gateway = &self.inner;
        let session = *self.session_pin.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = named.or(session).or(gateway.pinned) {
            return Ok((id, self.view(id, trace).await?));
        }
        // The lock is never held across a call to the broker: concurrent
        // tool calls read the contract concurrently.
        let cached = *gateway.found.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = cached {
            let view = self.view(id, trace).await?;
            if matches!(
                view.status,
                pb::ContractStatus::Open | pb::ContractStatus::Accepted
            ) {
                return Ok((id, view));
            }
            // Ended: a new contract for this host, if there is one; else
            // this one's state, which is refused as ended.
            return match self.hosted().await? {
                Some(next) if next != id => {
                    *gateway.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(next);
                    Ok((next, self.view(next, trace).await?))
                }
                _ => Ok((id, view)),
            };
        }
        let id = self.hosted().await?.ok_or_else(|| {
            BrokerError::new(
                "NO_CONTRACT",
                format!(
                    "no open contract names this gateway's key ({}) as its host: the principal names it at Delegate, or the delegate at Accept",
                    broker_wire::crypto::key_id(&gateway.link.agent.public_key())
                ),
            )
        })?;
        *gateway.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
        Ok((id, self.view(id, trace).await?))
    }

    /// The one open contract hosted by this key; an error when several are.
    async fn hosted(&self) -> Result<Option<[u8; 32]>, BrokerError> {
        let page = self.inner.link.held(pb::HeldRole::Host, 2).await?;
        match page.contracts.as_slice() {
            [] => Ok(None),
            [one] => Ok(<[u8; 32]>::try_from(one.contract_id.as_slice()).ok()),
            several => Err(BrokerError::new(
                "NO_CONTRACT",
                format!(
                    "this gateway hosts several open contracts ({} and more): name one in the call's _meta under {CONTRACT_META_KEY:?}, or in the config's `contract`",
                    several
                        .iter()
                        .map(|c| hex::encode(&c.contract_id))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    async fn view(&self, id: [u8; 32], trace: Option<&str>) -> Result<ContractView, BrokerError> {
        let request = pb::GetContractRequest {
            contract_id: id.to_vec(),
        };
        let state = self
            .inner
            .link
            .read(|mut client| {
                let request = traced(request.clone(), trace);
                async move { client.get_contract(request).await }
            })
            .await?
            .into_inner()
            .contract
            .ok_or_else(|| {
                BrokerError::new("INTERNAL", "the broker answered without the contract")
            })?;
        let contract = broker_client::terms(state.contract.as_ref()).ok_or_else(|| {
            BrokerError::new(
                "INTERNAL",
                "the broker sent a contract that does not decode",
            )
        })?;
        Ok(ContractView {
            id,
            host_public_key: state.host_public_key,
            status: pb::ContractStatus::try_from(state.status)
                .unwrap_or(pb::ContractStatus::Unspecified),
            deadline_ms: contract.deadline_ms,
            residual: state.ledger.map_or(0, |l| l.residual),
            write_scope: contract.write_scope,
        })
    }
}

/// What a call that answered (`result`; `None`: answered, but withheld as
/// too large) is recorded as: the call, its units, its paths.
fn observed(
    route: &Route,
    arguments: Option<&rmcp::model::JsonObject>,
    result: Option<&CallToolResult>,
    paths: rules::Paths,
    now_ms: i64,
) -> Vec<pb::Observation> {
    let outcome = match result {
        Some(r) if r.is_error == Some(true) => pb::ToolOutcome::Failed,
        Some(_) => pb::ToolOutcome::Succeeded,
        // Answered, but withheld: how is not looked at.
        None => pb::ToolOutcome::Unspecified,
    };
    let structured = result.and_then(|r| r.structured_content.as_ref());
    let units = rules::units_of(&route.rule, structured).unwrap_or_else(|| {
        tracing::warn!(tool = %route.qualified, "the result carries no units at units_from: recorded unmetered");
        0
    });
    // A failed call is recorded as a call, without the paths it meant to
    // touch.
    let recorded_paths = if outcome == pb::ToolOutcome::Failed {
        rules::Paths::default()
    } else {
        paths
    };
    let call = rules::CallFacts {
        units,
        arguments_sha256: rules::arguments_sha256(arguments),
        outcome,
        at_ms: now_ms,
    };
    rules::observations(&route.qualified, call, &recorded_paths)
}

/// `paths` as the file system resolves them under `root` (resolved-path
/// mode), on the blocking pool: at most `rules::MAX_PATHS_PER_CALL`.
async fn resolved(
    root: std::path::PathBuf,
    paths: rules::Paths,
) -> Result<rules::Paths, BrokerError> {
    tokio::task::spawn_blocking(move || {
        let reads = paths
            .reads
            .iter()
            .map(|p| resolve::resolve(&root, "reads", p))
            .collect::<Result<Vec<_>, _>>()?;
        let mutates = paths
            .mutates
            .iter()
            .map(|(argument, p)| Ok((argument.clone(), resolve::resolve(&root, argument, p)?)))
            .collect::<Result<Vec<_>, BrokerError>>()?;
        Ok(rules::Paths { reads, mutates })
    })
    .await
    .map_err(|e| {
        BrokerError::new(
            "INTERNAL",
            format!("resolving the call's paths failed: {e}"),
        )
    })?
}

/// The served tools: each under its own name, or `<server>.<tool>` when
/// two servers offer the same name.
fn route(servers: &[Upstream], config: &GatewayConfig) -> (HashMap<String, Route>, Vec<Tool>) {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for server in servers {
        for tool in &server.tools {
            *count.entry(tool.name.as_ref()).or_default() += 1;
        }
    }
    let mut routes = HashMap::new();
    let mut tools = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        for tool in &server.tools {
            let qualified = format!("{}.{}", server.name, tool.name);
            let served = if count[tool.name.as_ref()] > 1 {
                qualified.clone()
            } else {
                tool.name.to_string()
            };
            if routes.contains_key(&served) {
                // A server listing one name twice: the first is served.
                continue;
            }
            let mut listed = tool.clone();
            listed.name = served.clone().into();
            tools.push(listed);
            routes.insert(
                served,
                Route {
                    server: i,
                    upstream: tool.name.to_string(),
                    rule: config.tools.get(&qualified).cloned().unwrap_or_default(),
                    qualified,
                },
            );
        }
    }
    (routes, tools)
}

/// The `_meta` a forwarded call carries: the trace context only.
fn trace_meta(traceparent: &str) -> rmcp::model::RequestMetaObject {
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.0.0.insert("traceparent".into(), traceparent.into());
    meta
}

impl rmcp::ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        let mut config = ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Your tools, behind the delegation broker's host: every call is checked against your contract (open, within budget and write scope) and recorded. A refused call is a tool error naming why, with requested and allowed values.",
        );
        config.server_info = rmcp::model::Implementation::new(
            "delegation-broker-gateway",
            env!("CARGO_PKG_VERSION"),
        );
        config
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.inner.tools.clone()))
    }

    async fn call_tool(
        &self,
        mut request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // rmcp moves the request's `_meta` into the context.
        if request.meta.is_none() && !context.meta.0.0.is_empty() {
            request.meta = Some(context.meta);
        }
        let tool = request.name.clone();
        let result = match self.call(request).await {
            Ok(result) => result,
            Err(error) => {
                tracing::info!(tool = %tool, reason = %error.reason, "tool call refused or failed");
                crate::tool_result(error)
            }
        };
        Ok(result.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forwarded_call_carries_the_trace_context_only() {
        let meta = trace_meta("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(meta.0.0.len(), 1);
    }

    /// The library entry: the caller binds, the gateway serves on its
    /// listener, and stops when the caller's future resolves.
    #[tokio::test]
    async fn run_serves_its_listener_until_its_shutdown_resolves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_file = dir.path().join("host.key");
        let seed = broker_client::Agent::generate().seed();
        broker_client::keys::write_secret(&key_file, &hex::encode(seed)).expect("a key file");
        let config = GatewayConfig {
            // Never reached: the channel connects on first use.
            broker: "http://127.0.0.1:1".into(),
            key_file,
            out_of_scope: OutOfScope::Refuse,
            contract: None,
            call_timeout_ms: config::DEFAULT_CALL_TIMEOUT_MS,
            resolve_root: None,
            tokens_url: None,
            servers: Vec::new(),
            tools: Default::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("an address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(run(listener, config, async {
            let _ = stopped.await;
        }));
        let initialize = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"test","version":"0"}}}"#;
        // The test's own HTTP client takes the process's TLS provider too.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut response = reqwest::Client::new()
            .post(format!("http://{addr}/mcp"))
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(initialize)
            .send()
            .await
            .expect("an answer");
        assert!(response.status().is_success(), "{}", response.status());
        let mut body = String::new();
        while !body.contains("delegation-broker-gateway") {
            let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
                .await
                .expect("the initialize result in time")
                .expect("a body");
            let Some(chunk) = chunk else { break };
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(body.contains("delegation-broker-gateway"), "{body}");
        drop(response);
        stop.send(()).expect("still serving");
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("stopped in time")
            .expect("joined")
            .expect("served without error");
    }
}
