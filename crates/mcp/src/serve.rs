//! Serving one MCP server (the tools or the gateway) on stdio, or on
//! streamable HTTP at `/mcp`, until the client goes or `shutdown` resolves
//! (the CLI passes `broker_runtime::shutdown::signal()`: SIGINT or
//! SIGTERM).

use std::future::Future;

use rmcp::ServiceExt as _;
use rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
};

/// Largest MCP message taken from the client: a line beyond it is dropped
/// by the transport (the client gets no answer to it).
const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// Serves `server` on stdin/stdout until the client closes them or
/// `shutdown` resolves.
pub async fn stdio<S>(server: S, shutdown: impl Future<Output = ()>) -> anyhow::Result<()>
where
    S: rmcp::ServerHandler,
{
    let (stdin, stdout) = rmcp::transport::stdio();
    let transport = rmcp::transport::async_rw::AsyncRwTransport::new_server(stdin, stdout)
        .with_max_line_length(MAX_MESSAGE_BYTES);
    let running = server
        .serve(transport)
        .await
        .map_err(|e| anyhow::anyhow!("MCP initialization failed: {e}"))?;
    let stop = running.cancellation_token();
    let waiting = running.waiting();
    tokio::pin!(waiting, shutdown);
    tokio::select! {
        quit = &mut waiting => {
            quit?;
            return Ok(());
        }
        () = &mut shutdown => stop.cancel(),
    }
    waiting.await?;
    Ok(())
}

/// Serves `server` over streamable HTTP at `/mcp` on `listener` until
/// `shutdown` resolves, then lets the requests in flight finish. Once it
/// serves, `mcp on http://ADDR/mcp` is printed on stdout (what the CLI
/// promises: a caller that listens on port 0 learns the port there).
pub async fn http<S>(
    server: S,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()>
where
    S: rmcp::ServerHandler + Clone + Send + Sync + 'static,
{
    let addr = listener.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(stop.child_token())
        .with_max_request_body_bytes(MAX_MESSAGE_BYTES);
    if !addr.ip().is_loopback() {
        // Loopback hosts only by default (against DNS rebinding); a
        // listener on another address takes requests naming it.
        config = config.with_allowed_hosts([addr.to_string(), addr.ip().to_string()]);
    }
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        std::sync::Arc::new(LocalSessionManager::default()),
        config,
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    println!("mcp on http://{addr}/mcp");
    use std::io::Write as _;
    std::io::stdout().flush()?;
    broker_runtime::listen::serve_gateway_http(listener, router, async move {
        shutdown.await;
        stop.cancel();
    })
    .await;
    Ok(())
}
