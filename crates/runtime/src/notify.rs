//! systemd's readiness protocol (`Type=notify`): `READY=1` once a server
//! answers calls, `STOPPING=1` when it starts draining, sent to the
//! datagram socket `NOTIFY_SOCKET` names. Without the variable (not
//! under systemd) nothing is sent.

/// The variable systemd sets for a `Type=notify` service.
pub const NOTIFY_SOCKET_VAR: &str = "NOTIFY_SOCKET";

/// Sends `state` (e.g. `READY=1`) to the service manager, if there is one.
/// A failure is logged, never fatal: the server serves either way.
pub async fn send(state: &str) {
    let Some(path) = std::env::var_os(NOTIFY_SOCKET_VAR) else {
        return;
    };
    if let Err(e) = send_to(&path, state).await {
        tracing::warn!(error = %e, socket = ?path, state, "cannot notify the service manager");
    }
}

async fn send_to(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    let socket = tokio::net::UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path);
    match bytes.strip_prefix(b"@") {
        // An abstract socket (Linux): systemd's usual choice.
        Some(name) => send_abstract(socket, name, state),
        None => socket.send_to(state.as_bytes(), path).await.map(drop),
    }
}

#[cfg(target_os = "linux")]
fn send_abstract(
    socket: tokio::net::UnixDatagram,
    name: &[u8],
    state: &str,
) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt as _;
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    // Non-blocking (tokio made it so): a full queue is an error, not a wait.
    socket
        .into_std()?
        .send_to_addr(state.as_bytes(), &address)
        .map(drop)
}

#[cfg(not(target_os = "linux"))]
fn send_abstract(_: tokio::net::UnixDatagram, _: &[u8], _: &str) -> std::io::Result<()> {
    Err(std::io::Error::other("abstract sockets are Linux's"))
}
