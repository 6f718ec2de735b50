//! A silent socket costs nothing: the broker binary, flooded with
//! connections that never send a request (nothing at all, or only HTTP/2's
//! client preface and SETTINGS) on its gRPC port and its console, keeps
//! answering honest callers on fresh connections, and closes the silent
//! ones once `limits.first_request_timeout_ms` passes.

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use broker_client::Agent;
use delegation_broker::pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::crash::Killed;
use crate::harness::*;

/// Connections that send nothing, to the gRPC port.
const SILENT: usize = 5_000;
/// Connections that send only the HTTP/2 preface and an empty SETTINGS.
const PREFACE_ONLY: usize = 5_000;
/// Connections that send nothing, to the console.
const CONSOLE_SILENT: usize = 1_000;
/// The broker's first-request bound in this test.
const FIRST_REQUEST_TIMEOUT_MS: u64 = 2_000;
/// Longest an honest call may take, attack or not.
const HONEST_BOUND: Duration = Duration::from_secs(1);
/// Time after the bound by which every silent connection must be closed.
const CLOSE_SLACK: Duration = Duration::from_secs(3);
/// Connects in flight at once while opening the flood.
const CONNECTS_AT_ONCE: usize = 256;
/// Longest one attacking connect may take (a full listen backlog drops
/// SYNs; such a connect is refused, which is fine).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between two honest calls.
const HONEST_EVERY: Duration = Duration::from_millis(100);

/// HTTP/2's client connection preface, then an empty SETTINGS frame.
const PREFACE_AND_SETTINGS: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// `serve` with a console and metrics; its gRPC, console and metrics
/// addresses.
fn spawn(dir: &std::path::Path) -> (Killed, SocketAddr, SocketAddr, SocketAddr) {
    let config = dir.join("broker.toml");
    std::fs::write(
        &config,
        format!(
            "[console]\nreader = \"{}\"\n[limits]\nfirst_request_timeout_ms = {FIRST_REQUEST_TIMEOUT_MS}\n",
            hex::encode(Agent::generate().public_key())
        ),
    )
    .unwrap();
    let (process, seen) = Killed::announcing_all(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.join("data"))
            .arg("--config")
            .arg(&config)
            .args(["--console", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
            .env("BROKER_LOG", "warn")
            .stderr(Stdio::inherit()),
        &["listening", "metrics", "console"],
    );
    // Each printed as a URL, perhaps with a path.
    let addr = |what: &str| -> SocketAddr {
        let host = seen[what].trim_start_matches("http://");
        let end = host.find('/').unwrap_or(host.len());
        host[..end].parse().expect("an address")
    };
    (process, addr("listening"), addr("console"), addr("metrics"))
}

/// Opens `count` connections from `from` to `to`, each sending `send`
/// first; the ones that connected.
pub(crate) async fn flood(
    from: IpAddr,
    to: SocketAddr,
    count: usize,
    send: &'static [u8],
) -> Vec<tokio::net::TcpStream> {
    let mut open = Vec::with_capacity(count);
    let mut connecting = tokio::task::JoinSet::new();
    for i in 0..count {
        connecting.spawn(async move {
            let socket = tokio::net::TcpSocket::new_v4().ok()?;
            socket.bind(SocketAddr::new(from, 0)).ok()?;
            let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(to))
                .await
                .ok()?
                .ok()?;
            if !send.is_empty() {
                // The broker may have closed it already (over the share).
                let _ = stream.write_all(send).await;
            }
            Some(stream)
        });
        if connecting.len() >= CONNECTS_AT_ONCE || i + 1 == count {
            while let Some(done) = connecting.join_next().await {
                open.extend(done.unwrap());
                if connecting.len() < CONNECTS_AT_ONCE / 2 && i + 1 < count {
                    break;
                }
            }
        }
    }
    open
}

/// One honest GetBrokerKeys on a fresh connection, and one honest console
/// page load; the slower of the two.
async fn honest(grpc: &str, console: SocketAddr) -> Duration {
    let started = Instant::now();
    let call = async {
        let mut client = connect(grpc).await;
        let keys = client
            .get_broker_keys(pb::GetBrokerKeysRequest::default())
            .await
            .expect("GetBrokerKeys answers");
        assert!(!keys.into_inner().keys.is_empty());
    };
    tokio::time::timeout(HONEST_BOUND, call)
        .await
        .unwrap_or_else(|_| panic!("an honest GetBrokerKeys took over {HONEST_BOUND:?}"));
    let grpc_took = started.elapsed();
    let started = Instant::now();
    let page = async {
        let mut stream = tokio::net::TcpStream::connect(console).await.unwrap();
        let request = format!("GET / HTTP/1.1\r\nhost: {console}\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 200"),
            "the console's page: {:?}",
            String::from_utf8_lossy(&answer[..answer.len().min(64)])
        );
    };
    tokio::time::timeout(HONEST_BOUND, page)
        .await
        .unwrap_or_else(|_| panic!("an honest console request took over {HONEST_BOUND:?}"));
    grpc_took.max(started.elapsed())
}

/// Whether the broker closed `stream` (EOF or reset) before `deadline`;
/// whatever it sent first (its SETTINGS) is read past.
pub(crate) async fn closed_by(
    mut stream: tokio::net::TcpStream,
    deadline: tokio::time::Instant,
) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Acceptance: 5,000 silent and 5,000 preface-only connections on the
/// gRPC port and 1,000 silent ones on the console (each flood from one
/// address, as one attacker without a token has) leave honest callers on
/// fresh connections answered within a second throughout; every silent
/// connection is closed by the first-request bound (plus slack), the ones
/// past their address's share at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_cost_honest_callers_nothing() {
    if on_postgres() {
        // The listeners do not depend on the store: the SQLite pass
        // covers them.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_broker, grpc, console, metrics) = spawn(dir.path());
    let grpc_url = format!("http://{grpc}");
    honest(&grpc_url, console).await;

    // Honest callers, on fresh connections, throughout.
    let (done, mut finished) = tokio::sync::watch::channel(false);
    let prober = tokio::spawn({
        let grpc_url = grpc_url.clone();
        async move {
            let mut calls = 0u32;
            let mut slowest = Duration::ZERO;
            loop {
                slowest = slowest.max(honest(&grpc_url, console).await);
                calls += 1;
                if *finished.borrow() {
                    return (calls, slowest);
                }
                let _ = tokio::time::timeout(HONEST_EVERY, finished.changed()).await;
            }
        }
    });

    // Three attackers, each from an address of its own on loopback.
    let silent_from: IpAddr = "127.0.0.2".parse().unwrap();
    let preface_from: IpAddr = "127.0.0.3".parse().unwrap();
    let console_from: IpAddr = "127.0.0.4".parse().unwrap();
    let silent = flood(silent_from, grpc, SILENT, b"").await;
    let preface = flood(preface_from, grpc, PREFACE_ONLY, PREFACE_AND_SETTINGS).await;
    let console_silent = flood(console_from, console, CONSOLE_SILENT, b"").await;
    let opened = Instant::now();
    assert!(
        silent.len() + preface.len() + console_silent.len() > 0,
        "no attacking connection opened at all"
    );

    // By the bound plus slack (from the last one opened), every one of
    // them is closed.
    let deadline = tokio::time::Instant::from_std(opened)
        + Duration::from_millis(FIRST_REQUEST_TIMEOUT_MS)
        + CLOSE_SLACK;
    let mut checks = tokio::task::JoinSet::new();
    let total = silent.len() + preface.len() + console_silent.len();
    for stream in silent.into_iter().chain(preface).chain(console_silent) {
        checks.spawn(closed_by(stream, deadline));
    }
    let mut still_open = 0;
    while let Some(closed) = checks.join_next().await {
        if !closed.unwrap() {
            still_open += 1;
        }
    }
    let _ = done.send(true);
    let (calls, slowest) = prober.await.expect("every honest call within the bound");
    assert_eq!(
        still_open, 0,
        "{still_open} of {total} silent connections still open {FIRST_REQUEST_TIMEOUT_MS} ms + {CLOSE_SLACK:?} after the flood"
    );
    assert!(calls >= 2, "honest calls during the flood: {calls}");
    eprintln!("{total} silent connections closed; {calls} honest rounds, slowest {slowest:?}");

    // Closed for their silence, not only for their address's share.
    let scrape = reqwest_like_get(metrics, "/metrics").await;
    for listener in ["grpc", "console"] {
        let series = format!(
            "broker_connections_closed_total{{listener=\"{listener}\",reason=\"silent\"}} "
        );
        let line = scrape
            .lines()
            .find(|l| l.starts_with(&series))
            .unwrap_or_else(|| panic!("{series} in /metrics"));
        let count: u64 = line[series.len()..].trim().parse().unwrap();
        assert!(count > 0, "{line}");
    }
}

/// The body of a plain HTTP/1.1 GET.
async fn reqwest_like_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}
