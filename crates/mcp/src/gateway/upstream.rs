//! The agent's own tool servers, as the gateway's MCP client: started (a
//! command on stdio) or reached (streamable HTTP), their tools listed with
//! a bound on count and bytes, and calls forwarded with a time bound. A
//! tool server is as untrusted as the model: whatever it sends is capped.

use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, PaginatedRequestParams, Tool};
use rmcp::service::{RoleClient, RunningService, ServiceExt as _};

use super::config::ServerConfig;
use broker_client::BrokerError;

/// Most tools taken from one server; the rest are dropped (and logged).
pub const MAX_TOOLS_PER_SERVER: usize = 256;
/// Most pages of a server's tool list read.
const MAX_TOOL_PAGES: usize = 16;
/// Most bytes of tool definitions taken from one server.
const MAX_TOOL_LIST_BYTES: usize = 4 * 1024 * 1024;
/// Largest message taken from a stdio server: a longer line is dropped by
/// the transport (that call then times out).
const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Largest result handed back to the model, serialized.
pub const MAX_RESULT_BYTES: usize = 1024 * 1024;
/// Most bytes of a server's error quoted in the tool error the model
/// reads: enough to say what failed, while a tool server (as untrusted as
/// the model) cannot fill the model's context with it.
const MAX_UPSTREAM_ERROR_BYTES: usize = 1024;
/// Longest wait for a server to start and answer `initialize` and its
/// tool list.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One connected tool server.
pub struct Upstream {
    pub name: String,
    pub tools: Vec<Tool>,
    service: RunningService<RoleClient, ()>,
    /// The token its calls carry (`token_header`), if any.
    pub bearer: Option<super::bearer::Bearer>,
    /// The server's process (stdio), killed when the gateway drops it.
    _child: Option<tokio::process::Child>,
}

impl Upstream {
    /// Starts or reaches the server, then lists its tools.
    pub async fn connect(config: &ServerConfig, tokens_url: Option<&str>) -> anyhow::Result<Self> {
        tokio::time::timeout(START_TIMEOUT, Self::connect_unbounded(config, tokens_url))
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "server {:?} did not start and list its tools within {} s",
                    config.name,
                    START_TIMEOUT.as_secs()
                )
            })?
    }

    async fn connect_unbounded(
        config: &ServerConfig,
        tokens_url: Option<&str>,
    ) -> anyhow::Result<Self> {
        let name = config.name.clone();
        let bearer = match (&config.token_header, &config.token_resource, tokens_url) {
            (Some(header), Some(resource), Some(url)) => Some(super::bearer::Bearer::new(
                header,
                resource,
                url,
                config.keep_alive,
            )?),
            _ => None,
        };
        let (service, child) = match (&config.command, &config.url) {
            (Some(command), _) => {
                let mut child = tokio::process::Command::new(command)
                    .args(&config.args)
                    .envs(&config.env)
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    // Its log goes where the gateway's goes.
                    .stderr(std::process::Stdio::inherit())
                    .kill_on_drop(true)
                    .spawn()
                    .map_err(|e| anyhow::anyhow!("server {name:?}: cannot run {command:?}: {e}"))?;
                let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
                    anyhow::bail!("server {name:?}: no stdio pipes");
                };
                let transport =
                    rmcp::transport::async_rw::AsyncRwTransport::new_client(stdout, stdin)
                        .with_max_line_length(MAX_MESSAGE_BYTES);
                let service = ().serve(transport).await.map_err(|e| {
                    anyhow::anyhow!("server {name:?}: MCP initialization failed: {e}")
                })?;
                (service, Some(child))
            }
            (None, Some(url)) => {
                let service = match &bearer {
                    None => {
                        let http = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url.as_str());
                        let transport = rmcp::transport::StreamableHttpClientTransport::with_client(
                            http_client(config.keep_alive, false)?,
                            http,
                        );
                        ().serve(transport).await
                    }
                    Some(bearer) => {
                        let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url.as_str());
                        let transport = rmcp::transport::StreamableHttpClientTransport::with_client(
                            bearer.client(),
                            config,
                        );
                        ().serve(transport).await
                    }
                };
                let service = service.map_err(|e| {
                    anyhow::anyhow!("server {name:?} at {url}: MCP initialization failed: {e}")
                })?;
                (service, None)
            }
            (None, None) => anyhow::bail!("server {name:?}: neither command nor url"),
        };
        let tools = list_tools(&name, &service).await?;
        Ok(Self {
            name,
            tools,
            service,
            bearer,
            _child: child,
        })
    }

    /// `call` for `contract`: a server that checks tokens gets the
    /// contract's, minted first (a refused mint stops the call unrun, so
    /// there is nothing to record), during its turn at the server.
    pub async fn call_for(
        &self,
        host: &broker_client::Agent,
        contract: &[u8; 32],
        request: CallToolRequestParams,
        timeout: Duration,
    ) -> Result<CallToolResult, BrokerError> {
        let _turn = match &self.bearer {
            Some(bearer) => Some(bearer.turn(host, contract).await?),
            None => None,
        };
        self.call(request, timeout).await
    }

    /// Forwards one call, bounded by `timeout`; an answer too large for the
    /// model is an error (the call ran).
    pub async fn call(
        &self,
        request: CallToolRequestParams,
        timeout: Duration,
    ) -> Result<CallToolResult, BrokerError> {
        let tool = request.name.to_string();
        let result = match tokio::time::timeout(timeout, self.service.call_tool(request)).await {
            Err(_) => {
                return Err(BrokerError::new(
                    "UPSTREAM_TIMEOUT",
                    format!(
                        "server {:?} did not answer {tool} within {} ms; the call may have run",
                        self.name,
                        timeout.as_millis()
                    ),
                ));
            }
            Ok(Err(error)) => {
                let message =
                    broker_client::names::cut(&error.to_string(), MAX_UPSTREAM_ERROR_BYTES);
                return Err(BrokerError::new(
                    "UPSTREAM_FAILED",
                    format!("server {:?} failed {tool}: {message}", self.name),
                ));
            }
            // The gateway may speak a newer protocol to its client than
            // the server spoke to it: a result is complete (rmcp drops the
            // field again for clients of older versions).
            Ok(Ok(mut result)) => {
                result.result_type = Some(rmcp::model::ResultType::COMPLETE);
                result
            }
        };
        let size = serde_json::to_vec(&result).map_or(usize::MAX, |b| b.len());
        if size > MAX_RESULT_BYTES {
            return Err(BrokerError::new(
                "RESULT_TOO_LARGE",
                format!(
                    "server {:?} answered {tool} with {size} bytes, at most {MAX_RESULT_BYTES}; the call ran and its result is withheld",
                    self.name
                ),
            )
            .with("requested", size)
            .with("allowed", MAX_RESULT_BYTES));
        }
        Ok(result)
    }
}

/// Longest a connection to a tool server is kept idle: under uvicorn's
/// 5 s (the Python SDK's server), so the gateway drops a connection before
/// the server closes it under a call sent on it.
const IDLE_CONNECTION: Duration = Duration::from_secs(4);
/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 10;

/// The HTTP client of a tool server. With `keep_alive` its connections
/// are kept for the next call, so a call skips the TCP (and TLS)
/// handshake; rmcp's own client keeps none (it saw reused connections
/// stall), and `keep_alive = false` is there for a server that answers a
/// reused connection late. A token server's requests follow no redirect
/// (one must not carry the token to another host); the others, as rmcp's
/// own client, follow same-origin 307 and 308 only (the method and body
/// kept), at most `MAX_REDIRECTS`.
pub(super) fn http_client(keep_alive: bool, token: bool) -> anyhow::Result<reqwest::Client> {
    let redirects = if token {
        reqwest::redirect::Policy::none()
    } else {
        same_origin_redirects()
    };
    let builder = reqwest::Client::builder()
        .redirect(redirects)
        .pool_idle_timeout(IDLE_CONNECTION);
    let builder = if keep_alive {
        builder
    } else {
        builder.pool_max_idle_per_host(0)
    };
    Ok(builder.build()?)
}

fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let keeps_body = matches!(
            attempt.status(),
            reqwest::StatusCode::TEMPORARY_REDIRECT | reqwest::StatusCode::PERMANENT_REDIRECT
        );
        let same_origin = attempt
            .previous()
            .first()
            .is_some_and(|first| first.origin() == attempt.url().origin());
        if !keeps_body || !same_origin {
            attempt.stop()
        } else if attempt.previous().len() > MAX_REDIRECTS {
            attempt.error(format!("more than {MAX_REDIRECTS} redirects"))
        } else {
            attempt.follow()
        }
    })
}

/// The server's tools: at most `MAX_TOOLS_PER_SERVER`, `MAX_TOOL_PAGES`
/// pages and `MAX_TOOL_LIST_BYTES` of definitions.
async fn list_tools(
    name: &str,
    service: &RunningService<RoleClient, ()>,
) -> anyhow::Result<Vec<Tool>> {
    let mut tools = Vec::new();
    let mut bytes = 0usize;
    let mut cursor = None;
    for _ in 0..MAX_TOOL_PAGES {
        let page = service
            .list_tools(Some(
                PaginatedRequestParams::default().with_cursor(cursor.take()),
            ))
            .await
            .map_err(|e| anyhow::anyhow!("server {name:?}: tools/list failed: {e}"))?;
        for tool in page.tools {
            bytes = bytes.saturating_add(serde_json::to_vec(&tool).map_or(usize::MAX, |b| b.len()));
            if tools.len() == MAX_TOOLS_PER_SERVER || bytes > MAX_TOOL_LIST_BYTES {
                tracing::warn!(
                    server = name,
                    kept = tools.len(),
                    "the server lists more tools than the gateway takes ({MAX_TOOLS_PER_SERVER} tools, {MAX_TOOL_LIST_BYTES} bytes): the rest are not served"
                );
                return Ok(tools);
            }
            tools.push(tool);
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(tools),
        }
    }
    tracing::warn!(
        server = name,
        kept = tools.len(),
        "the server's tool list has more than {MAX_TOOL_PAGES} pages: the rest are not served"
    );
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A tool server with one tool that answers at once.
    #[derive(Clone)]
    struct Echo;

    impl rmcp::ServerHandler for Echo {
        fn get_info(&self) -> rmcp::model::ServerConfig {
            rmcp::model::ServerConfig::new(
                rmcp::model::ServerCapabilities::builder()
                    .enable_tools()
                    .build(),
            )
        }

        async fn list_tools(
            &self,
            _request: Option<PaginatedRequestParams>,
            _context: rmcp::service::RequestContext<rmcp::service::RoleServer>,
        ) -> Result<rmcp::model::ListToolsResult, rmcp::ErrorData> {
            let mut schema = serde_json::Map::new();
            schema.insert("type".into(), "object".into());
            Ok(rmcp::model::ListToolsResult::with_all_items(vec![
                Tool::new("echo", "answers ok", schema),
            ]))
        }

        async fn call_tool(
            &self,
            _request: CallToolRequestParams,
            _context: rmcp::service::RequestContext<rmcp::service::RoleServer>,
        ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
            Ok(CallToolResult::success(vec![rmcp::model::ContentBlock::text("ok")]).into())
        }
    }

    /// Calls to an HTTP tool server go over the connections already open
    /// (`keep_alive`, the default), else one each: a proxy in front of it
    /// counts the connections the gateway opens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_to_an_http_server_reuse_its_connections_unless_told_not_to() {
        // Kept alive: a few (the first, one for a call sent while the last
        // one's answer was still read to its end, the session's stream);
        // rmcp's own client opens one a call.
        let kept = calls_opened(true).await;
        assert!(kept < CALLS / 4, "{kept} connections for {CALLS} calls");
        let fresh = calls_opened(false).await;
        assert!(fresh >= CALLS, "{fresh} connections for {CALLS} calls");
    }

    /// A server's same-origin 307 is followed, with its body; one to
    /// another origin is not, nor any redirect of a token server's.
    #[tokio::test]
    async fn only_same_origin_redirects_that_keep_the_body_are_followed() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("an address");
        let moved = |to: String| {
            move || async move {
                (
                    http::StatusCode::TEMPORARY_REDIRECT,
                    [(http::header::LOCATION, to)],
                )
            }
        };
        let router = axum::Router::new()
            .route("/here", axum::routing::post(moved("/mcp".into())))
            .route(
                "/away",
                axum::routing::post(moved("http://localhost:1/mcp".into())),
            )
            .route(
                "/mcp",
                axum::routing::post(|body: String| async move { body }),
            );
        tokio::spawn(async move { axum::serve(listener, router).await });
        let post = |client: reqwest::Client, path: &'static str| async move {
            let answer = client
                .post(format!("http://{addr}{path}"))
                .body("the message")
                .send()
                .await
                .expect("an answer");
            (answer.status(), answer.text().await.expect("a body"))
        };
        let plain = http_client(true, false).expect("a client");
        let (status, body) = post(plain.clone(), "/here").await;
        assert_eq!((status.as_u16(), body.as_str()), (200, "the message"));
        let (status, _) = post(plain, "/away").await;
        assert_eq!(status.as_u16(), 307, "another origin is not followed");
        let token = http_client(true, true).expect("a client");
        let (status, _) = post(token, "/here").await;
        assert_eq!(
            status.as_u16(),
            307,
            "a token server's redirect is not followed"
        );
    }

    /// Calls made in each case.
    const CALLS: usize = 20;

    /// The connections `CALLS` calls opened to a server reached with
    /// `keep_alive`.
    async fn calls_opened(keep_alive: bool) -> usize {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let server = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let server_addr = server.local_addr().expect("an address");
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(crate::serve::http(
            Echo,
            server,
            stop.clone().cancelled_owned(),
        ));
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let proxy_addr = proxy.local_addr().expect("an address");
        let opened = Arc::new(AtomicUsize::new(0));
        let counted = opened.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = proxy.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(server_addr).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        let config = ServerConfig {
            name: "echo".into(),
            command: None,
            args: Vec::new(),
            env: Default::default(),
            url: Some(format!("http://{proxy_addr}/mcp")),
            token_header: None,
            token_resource: None,
            keep_alive,
        };
        let upstream = Upstream::connect(&config, None).await.expect("connected");
        let before = opened.load(Ordering::SeqCst);
        for _ in 0..CALLS {
            let result = upstream
                .call(CallToolRequestParams::new("echo"), Duration::from_secs(10))
                .await
                .expect("answered");
            assert_eq!(result.is_error, Some(false));
        }
        stop.cancel();
        opened.load(Ordering::SeqCst) - before
    }
}
