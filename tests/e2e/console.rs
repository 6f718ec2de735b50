//! The browser console's listener (`serve --console`) from outside, over
//! plain HTTP/1.1 as a browser speaks it: the page without a token, a
//! session only with it, gRPC-Web for the read RPCs only, no foreign
//! origin, and the reader's rights; ListRoots
//! over gRPC (acceptance f).

use broker_client::Agent;
use delegation_broker::pb;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// One HTTP/1.1 exchange's answer.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request on a fresh connection and reads the whole answer.
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stream.read_to_end(&mut raw),
    )
    .await
    .expect("the console answers")
    .expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let head = String::from_utf8(raw[..split].to_vec()).expect("ASCII headers");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size = usize::from_str_radix(std::str::from_utf8(&data[..line]).unwrap().trim(), 16)
            .expect("hex size");
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[line + 2..line + 2 + size]);
        data = &data[line + 2 + size + 2..];
    }
}

/// A gRPC-Web call's outcome: its messages and its grpc-status.
struct WebCall {
    messages: Vec<Vec<u8>>,
    status: u32,
    message: String,
}

async fn grpc_web(
    console: &(std::net::SocketAddr, String),
    token: Option<&str>,
    session: Option<&str>,
    method: &str,
    request: &impl Message,
) -> WebCall {
    let payload = request.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    let origin = format!("http://{}", console.0);
    let mut headers = vec![
        ("content-type", "application/grpc-web+proto"),
        ("x-grpc-web", "1"),
        ("origin", origin.as_str()),
    ];
    if let Some(token) = token {
        headers.push(("x-console-token", token));
    }
    if let Some(session) = session {
        headers.push(("x-broker-session-bin", session));
    }
    let path = format!("/delegation.broker.v1.Broker/{method}");
    let reply = http(console.0, "POST", &path, &headers, &frame).await;
    assert_eq!(reply.status, 200, "gRPC-Web answers over HTTP 200");
    let mut status = reply.header("grpc-status").map(|s| s.parse().unwrap());
    let mut message = reply.header("grpc-message").unwrap_or_default().to_owned();
    let mut messages = Vec::new();
    let mut body = reply.body.as_slice();
    while body.len() >= 5 {
        let flag = body[0];
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        let content = &body[5..5 + len];
        if flag & 0x80 != 0 {
            for line in String::from_utf8_lossy(content).split("\r\n") {
                if let Some((k, v)) = line.split_once(':') {
                    match k.trim() {
                        "grpc-status" => status = Some(v.trim().parse().unwrap()),
                        "grpc-message" => message = v.trim().to_owned(),
                        _ => {}
                    }
                }
            }
        } else {
            messages.push(content.to_vec());
        }
        body = &body[5 + len..];
    }
    WebCall {
        messages,
        status: status.expect("a grpc-status"),
        message,
    }
}

/// The session the console hands out, base64 (as the page attaches it).
async fn console_session(console: &(std::net::SocketAddr, String)) -> String {
    let reply = http(
        console.0,
        "POST",
        "/console/session",
        &[("x-console-token", console.1.as_str())],
        b"",
    )
    .await;
    assert_eq!(reply.status, 200);
    let json: serde_json::Value = serde_json::from_slice(&reply.body).expect("JSON");
    json["session"].as_str().expect("a session").to_owned()
}

/// A broker whose console reads as `reader` (not a configured reader).
async fn console_broker(reader: &Agent) -> (Broker, (std::net::SocketAddr, String)) {
    let key = reader.public_key();
    let broker = Broker::start_with_console(|config| {
        config.console.reader = Some(key);
        config.console.names.insert(key, "the console".into());
    })
    .await;
    let console = broker.console.clone().expect("a console");
    (broker, console)
}

#[tokio::test]
async fn without_the_token_the_console_serves_only_the_page() {
    let (broker, console) = console_broker(&Agent::generate()).await;
    let addr = console.0;
    let page = http(addr, "GET", "/", &[], b"").await;
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    assert!(
        page.header("content-security-policy")
            .unwrap()
            .contains("frame-ancestors 'none'")
    );
    for asset in ["/console.js", "/console.css", "/index.html"] {
        assert_eq!(
            http(addr, "GET", asset, &[], b"").await.status,
            200,
            "{asset}"
        );
    }
    assert_eq!(http(addr, "GET", "/metrics", &[], b"").await.status, 404);
    // No session without the token, or with a wrong one.
    let none = http(addr, "POST", "/console/session", &[], b"").await;
    assert_eq!(none.status, 401);
    assert!(!String::from_utf8_lossy(&none.body).contains("session\""));
    let wrong = http(
        addr,
        "POST",
        "/console/session",
        &[("x-console-token", "00")],
        b"",
    )
    .await;
    assert_eq!(wrong.status, 401);
    // No read without it either, even with a valid session.
    let session = console_session(&console).await;
    let call = grpc_web(
        &console,
        None,
        Some(&session),
        "GetBrokerKeys",
        &pb::GetBrokerKeysRequest {},
    )
    .await;
    assert_eq!(call.status, 16, "UNAUTHENTICATED: {}", call.message);
    assert!(call.messages.is_empty());
    // Another origin gets nothing at all, token or not.
    let evil = [
        ("origin", "http://evil.example"),
        ("x-console-token", console.1.as_str()),
    ];
    assert_eq!(http(addr, "GET", "/", &evil, b"").await.status, 403);
    assert_eq!(
        http(addr, "POST", "/console/session", &evil, b"")
            .await
            .status,
        403
    );
    // The console's own origin, spelled "localhost" on loopback, may.
    let localhost = format!("http://localhost:{}", addr.port());
    let ok = [
        ("origin", localhost.as_str()),
        ("x-console-token", console.1.as_str()),
    ];
    let reply = http(addr, "POST", "/console/session", &ok, b"").await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("access-control-allow-origin"),
        Some(localhost.as_str())
    );
    broker.stop().await;
}

#[tokio::test]
async fn the_console_serves_reads_only_with_its_readers_rights() {
    let console_reader = Agent::generate();
    let (mut broker, console) = console_broker(&console_reader).await;
    let orchestrator = Agent::generate();
    // One tree the console's reader is a party of (a delegate), one not.
    let (visible, _) = broker
        .root_and_child(&orchestrator, &console_reader, 10)
        .await;
    let hidden = broker
        .open_root(&Agent::generate(), RootSpec::default())
        .await;
    let token = Some(console.1.as_str());
    let session_text = console_session(&console).await;
    let session = Some(session_text.as_str());

    // Reads pass and answer as the broker does.
    let keys = grpc_web(
        &console,
        token,
        session,
        "GetBrokerKeys",
        &pb::GetBrokerKeysRequest {},
    )
    .await;
    assert_eq!(keys.status, 0, "{}", keys.message);
    let keys = pb::GetBrokerKeysResponse::decode(keys.messages[0].as_slice()).unwrap();
    assert!(keys.keys.iter().any(|k| k.current));
    let roots = grpc_web(
        &console,
        token,
        session,
        "ListRoots",
        &pb::ListRootsRequest::default(),
    )
    .await;
    assert_eq!(roots.status, 0, "{}", roots.message);
    let roots = pb::ListRootsResponse::decode(roots.messages[0].as_slice()).unwrap();
    let ids: Vec<_> = roots.roots.iter().map(|r| r.contract_id.clone()).collect();
    assert_eq!(
        ids,
        std::slice::from_ref(&visible.id),
        "only the tree its reader is a party of"
    );
    let other = grpc_web(
        &console,
        token,
        session,
        "GetContract",
        &contract_request(&hidden.id),
    )
    .await;
    assert_eq!(
        other.status, 5,
        "NOT_FOUND, as for an unknown id: {}",
        other.message
    );
    // Watch streams over gRPC-Web too: the stored events arrive (the
    // stream never ends by itself, so read with a deadline and a cap).
    let watch = watch_a_few(&console, &session_text, &visible.id).await;
    assert!(watch >= 2, "the root and its child: {watch} events");

    // A correctly signed mutating call is refused at the door: nothing
    // reaches the broker.
    let delegate = orchestrator.delegate(visible.child(&Agent::generate(), 5));
    let refused = grpc_web(&console, token, session, "Delegate", &delegate).await;
    assert_eq!(refused.status, 7, "PERMISSION_DENIED: {}", refused.message);
    assert_eq!(refused.message, "the console serves the read RPCs only");
    let open_root = orchestrator.open_root(RootSpec::default().body());
    assert_eq!(
        grpc_web(&console, token, session, "OpenRoot", &open_root)
            .await
            .status,
        7
    );
    let revoke = pb::RevokeRequest::default();
    assert_eq!(
        grpc_web(&console, token, session, "Revoke", &revoke)
            .await
            .status,
        7
    );
    assert_eq!(
        broker.ledger(&visible.id).await.open_children,
        1,
        "the refused Delegate issued nothing"
    );
    // Nor do the health and reflection services pass.
    let path = "/grpc.health.v1.Health/Check";
    let reply = http(
        console.0,
        "POST",
        path,
        &[
            ("content-type", "application/grpc-web+proto"),
            ("x-console-token", &console.1),
        ],
        &[0, 0, 0, 0, 0],
    )
    .await;
    assert_eq!(reply.header("grpc-status"), Some("7"));
    broker.stop().await;
}

/// Reads a Watch over gRPC-Web for a moment; returns the events seen.
async fn watch_a_few(console: &(std::net::SocketAddr, String), session: &str, id: &[u8]) -> usize {
    let request = watch_request(id);
    let payload = request.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    let mut stream = tokio::net::TcpStream::connect(console.0).await.unwrap();
    let head = format!(
        "POST /delegation.broker.v1.Broker/Watch HTTP/1.1\r\nhost: {}\r\ncontent-type: application/grpc-web+proto\r\nx-console-token: {}\r\nx-broker-session-bin: {session}\r\ncontent-length: {}\r\n\r\n",
        console.0,
        console.1,
        frame.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&frame).await.unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    // Until two contracts arrived or the deadline passed.
    loop {
        let read = tokio::time::timeout_at(deadline, stream.read(&mut buf)).await;
        match read {
            Ok(Ok(n)) if n > 0 => raw.extend_from_slice(&buf[..n]),
            _ => break,
        }
        if count_events(&raw) >= 2 {
            break;
        }
    }
    count_events(&raw)
}

/// Data frames (flag 0) in a chunked gRPC-Web body read so far.
fn count_events(raw: &[u8]) -> usize {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return 0;
    };
    // Re-join the chunks seen so far (the last one may be partial).
    let mut data = &raw[split + 4..];
    let mut body = Vec::new();
    while let Some(line) = data.windows(2).position(|w| w == b"\r\n") {
        let Ok(size) =
            usize::from_str_radix(std::str::from_utf8(&data[..line]).unwrap_or("x").trim(), 16)
        else {
            break;
        };
        let end = (line + 2 + size).min(data.len());
        body.extend_from_slice(&data[line + 2..end]);
        if end + 2 > data.len() {
            break;
        }
        data = &data[end + 2..];
    }
    let mut events = 0;
    let mut at = 0;
    while at + 5 <= body.len() {
        let len = u32::from_be_bytes(body[at + 1..at + 5].try_into().unwrap()) as usize;
        if at + 5 + len > body.len() {
            break;
        }
        if body[at] == 0 {
            let event = pb::WatchResponse::decode(&body[at + 5..at + 5 + len]).expect("an event");
            assert!(event.event.is_some());
            events += 1;
        }
        at += 5 + len;
    }
    events
}

#[tokio::test]
async fn list_roots_shows_each_caller_its_own_trees() {
    let mut broker = Broker::start().await;
    let [orchestrator, delegate] = agents();
    let mut flat = RootSpec::default();
    flat.labels.insert("arm".into(), "flat".into());
    let first = broker.open_root(&orchestrator, flat).await;
    let mut tree = RootSpec::default();
    tree.labels.insert("arm".into(), "tree".into());
    let second = broker.open_root(&orchestrator, tree).await;
    broker
        .issue(&orchestrator, second.child(&delegate, 5))
        .await;
    let list = |client: &mut broker_client::SessionClient,
                labels: &[(&str, &str)],
                page_size: u32,
                page_token: Vec<u8>| {
        let request = pb::ListRootsRequest {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            page_size,
            page_token,
        };
        let mut client = client.clone();
        async move { client.list_roots(request).await.map(|r| r.into_inner()) }
    };
    let ids = |response: &pb::ListRootsResponse| -> Vec<Vec<u8>> {
        response
            .roots
            .iter()
            .map(|r| r.contract_id.clone())
            .collect()
    };
    // A stranger lists nothing; the opener both, newest first; the
    // delegate its own tree; the configured reader both.
    let mut stranger = connect_as(&broker.addr, &Agent::generate()).await;
    let seen = list(&mut stranger, &[], 0, vec![]).await.unwrap();
    assert!(seen.roots.is_empty() && seen.next_page_token.is_empty());
    let mut opener = connect_as(&broker.addr, &orchestrator).await;
    let seen = list(&mut opener, &[], 0, vec![]).await.unwrap();
    assert_eq!(ids(&seen), [second.id.clone(), first.id.clone()]);
    let mut holder = connect_as(&broker.addr, &delegate).await;
    assert_eq!(
        ids(&list(&mut holder, &[], 0, vec![]).await.unwrap()),
        std::slice::from_ref(&second.id)
    );
    let mut reader = broker.client.clone();
    // Paged, and by label.
    let page = list(&mut reader, &[], 1, vec![]).await.unwrap();
    assert_eq!(ids(&page), std::slice::from_ref(&second.id));
    let rest = list(&mut reader, &[], 1, page.next_page_token.clone())
        .await
        .unwrap();
    assert_eq!(ids(&rest), std::slice::from_ref(&first.id));
    let flat = list(&mut reader, &[("arm", "flat")], 0, vec![])
        .await
        .unwrap();
    assert_eq!(ids(&flat), std::slice::from_ref(&first.id));
    // Bad input names its field.
    let error = list(&mut reader, &[], 1_001, vec![]).await.unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(error.message().contains("page_size"), "{}", error.message());
    let negative = (-5i64).to_be_bytes().to_vec();
    let error = list(&mut reader, &[], 0, negative).await.unwrap_err();
    assert!(
        error.message().contains("page_token"),
        "{}",
        error.message()
    );
    let error = list(&mut reader, &[], 0, vec![1, 2, 3]).await.unwrap_err();
    assert!(
        error.message().contains("page_token"),
        "{}",
        error.message()
    );
    let error = list(&mut reader, &[("Bad Key", "x")], 0, vec![])
        .await
        .unwrap_err();
    assert!(error.message().contains("labels"), "{}", error.message());
    // Without a session: UNAUTHENTICATED.
    let mut anonymous = connect(&broker.addr).await;
    let error = anonymous
        .list_roots(pb::ListRootsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::Unauthenticated);
    broker.stop().await;
}

/// ListHeld: each caller's open contracts as delegate, newest first (a
/// root is its opener's), nothing for a stranger, none once ended; a role
/// left unset names `role`, a bad token `page_token`.
#[tokio::test]
async fn list_held_shows_each_caller_its_open_work() {
    let (mut broker, orchestrator, root) = Broker::start_with_root().await;
    let delegate = Agent::generate();
    let first = broker.issue(&orchestrator, root.child(&delegate, 5)).await;
    let second = broker.issue(&orchestrator, root.child(&delegate, 5)).await;
    let addr = broker.addr.clone();
    let held = |agent, role, token| held(&addr, agent, role, token);
    let stranger = Agent::generate();
    use pb::HeldRole::{Delegate, Host, Unspecified};
    assert_eq!(
        held(&delegate, Delegate, vec![]).await.unwrap(),
        [second.clone(), first.clone()]
    );
    assert_eq!(
        held(&orchestrator, Delegate, vec![]).await.unwrap(),
        std::slice::from_ref(&root.id)
    );
    assert!(held(&delegate, Host, vec![]).await.unwrap().is_empty());
    assert!(held(&stranger, Delegate, vec![]).await.unwrap().is_empty());
    broker.accept(&delegate, &first, None).await.unwrap();
    broker
        .complete(&delegate, complete_body(&first, "{}", "done", 1))
        .await
        .unwrap();
    assert_eq!(
        held(&delegate, Delegate, vec![]).await.unwrap(),
        std::slice::from_ref(&second)
    );
    let error = held(&delegate, Unspecified, vec![]).await.unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(error.message().contains("role"), "{}", error.message());
    let error = held(&delegate, Delegate, vec![1, 2]).await.unwrap_err();
    assert!(
        error.message().contains("page_token"),
        "{}",
        error.message()
    );
}

/// The ids ListHeld gives `agent` for `role`.
async fn held(
    addr: &str,
    agent: &Agent,
    role: pb::HeldRole,
    page_token: Vec<u8>,
) -> Result<Vec<Vec<u8>>, tonic::Status> {
    let mut client = connect_as(addr, agent).await;
    let response = client
        .list_held(pb::ListHeldRequest {
            role: role as i32,
            page_size: 0,
            page_token,
        })
        .await?;
    Ok(response
        .into_inner()
        .contracts
        .into_iter()
        .map(|c| c.contract_id)
        .collect())
}
