//! Stopping: every server of the workspace (the broker, the console, both
//! gateways) stops on SIGINT (Ctrl-C) or SIGTERM (`docker stop`,
//! systemd), then lets the requests in flight finish within its drain.

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is
/// called, not when the future is first polled: a server may answer (and
/// tell systemd it is ready) before it polls its shutdown, and a signal
/// then must drain it, not kill it. Call it within the runtime, before
/// serving.
pub fn signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let handlers = {
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        )
    };
    async move {
        #[cfg(unix)]
        match handlers {
            (Ok(mut interrupt), Ok(mut terminate)) => {
                tokio::select! {
                    _ = interrupt.recv() => {},
                    _ = terminate.recv() => {},
                }
            }
            (interrupt, terminate) => {
                let error = interrupt.err().or(terminate.err());
                tracing::error!(error = ?error, "cannot listen for SIGINT and SIGTERM");
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("shutdown requested; draining");
    }
}
