//! Hostile callers of the token listener: oversized forms and tokens are
//! refused by name; a thousand assertions from one key fill only that
//! key's share of the replay memory, and a stranger's fill none; silent
//! and slow connections cost honest callers nothing and are closed within
//! the listener's bounds.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use broker_client::Agent;
use broker_client::token::TokenEndpoint;
use delegation_broker::tokens::{
    MAX_FORM_BYTES, MAX_TOKEN_CONNECTIONS_PER_ADDRESS, REQUEST_TIMEOUT, TOKEN_IDLE,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::Broker;
use crate::sockets::{closed_by, flood};
use crate::tokens::{RESOURCE, SECRET, broker, chain_of_three, exchange, id32, now_s};

/// Longest an honest call may take while the listener is under attack.
const HONEST_BOUND: Duration = Duration::from_secs(2);
/// Time past a bound by which the broker must have acted on it.
const SLACK: Duration = Duration::from_secs(3);
/// Assertions sent at once while filling the replay memory.
const AT_ONCE: usize = 32;

/// Posts `body` as a form; the status and JSON answer.
async fn post(url: &str, body: String) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .expect("the token listener answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON"))
}

fn refused_naming((status, body): &(u16, Value), want: (u16, &str), naming: &str) {
    assert_eq!(
        (*status, body["error"].as_str()),
        (want.0, Some(want.1)),
        "{body}"
    );
    let description = body["error_description"].as_str().unwrap_or_default();
    assert!(
        description.contains(naming),
        "{description:?} lacks {naming:?}"
    );
}

#[tokio::test]
async fn oversized_forms_and_tokens_are_refused_by_name() {
    let mut broker = broker().await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let metadata = endpoint.metadata().await.unwrap();
    let token_endpoint = metadata.token_endpoint;

    let past_the_bound = format!("grant_type=x&pad={}", "a".repeat(MAX_FORM_BYTES));
    refused_naming(
        &post(&token_endpoint, past_the_bound).await,
        (400, "invalid_request"),
        &format!("at most {MAX_FORM_BYTES} bytes"),
    );
    let many: Vec<String> = (0..100).map(|i| format!("p{i}=v")).collect();
    refused_naming(
        &post(&token_endpoint, many.join("&")).await,
        (400, "invalid_request"),
        "more than 16 parameters",
    );
    // A subject token past the JWT bound, inside the form's.
    let long = format!(
        "{}.{}.{}",
        "e".repeat(64),
        "b".repeat(20_000),
        "s".repeat(86)
    );
    refused_naming(
        &exchange(&token_endpoint, &long, RESOURCE).await,
        (400, "invalid_grant"),
        &format!(
            "longer than {} bytes",
            delegation_broker::jwt::MAX_TOKEN_BYTES
        ),
    );
    // Introspecting one is an answer, not an error: nothing stands behind it.
    let answer = endpoint.introspect(("rs", SECRET), &long).await.unwrap();
    assert_eq!(answer, serde_json::json!({"active": false}));

    // The listener still mints for the holder.
    let minted = endpoint.mint(&agents[3], &id32(&ids[3]), RESOURCE).await;
    assert!(minted.is_ok(), "{minted:?}");
}

/// A stranger's well-signed assertions are refused before they take any
/// place; the holder's take places up to its own share, past which it is
/// answered 503 naming the share, while another holder still mints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_fills_only_its_share_of_the_replay_memory() {
    // A small share, so the test stays short: the rule is the same.
    const MAX_ASSERTIONS_PER_SIGNER: usize = 50;
    let mut broker = Broker::start_with_tokens(|config| {
        crate::tokens::tokens_config(config);
        config.tokens.max_assertions_per_key = MAX_ASSERTIONS_PER_SIGNER;
    })
    .await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let endpoint = TokenEndpoint::new(broker.tokens_url.as_ref().unwrap()).unwrap();
    let token_endpoint = endpoint.metadata().await.unwrap().token_endpoint;
    let held = id32(&ids[3]);

    // Each assertion signed by `signer` for `held`, `count` of them, sent
    // `AT_ONCE` at a time; every answer.
    let send = |signer: &Agent, count: usize| {
        let assertions: Vec<String> = (0..count)
            .map(|_| signer.token_assertion(&token_endpoint, &held, now_s(), 120))
            .collect();
        let token_endpoint = token_endpoint.clone();
        async move {
            let mut answers = Vec::with_capacity(count);
            for batch in assertions.chunks(AT_ONCE) {
                let mut sent = tokio::task::JoinSet::new();
                for assertion in batch {
                    let (token_endpoint, assertion) = (token_endpoint.clone(), assertion.clone());
                    sent.spawn(
                        async move { exchange(&token_endpoint, &assertion, RESOURCE).await },
                    );
                }
                answers.extend(sent.join_all().await);
            }
            answers
        }
    };

    let stranger = send(&agents[2], MAX_ASSERTIONS_PER_SIGNER + 1).await;
    for answer in &stranger {
        refused_naming(answer, (400, "invalid_grant"), "holds no contract");
    }

    // Sent concurrently: which one finds the share full is not fixed.
    let (minted, full): (Vec<_>, Vec<_>) = send(&agents[3], MAX_ASSERTIONS_PER_SIGNER + 1)
        .await
        .into_iter()
        .partition(|(status, _)| *status == 200);
    assert_eq!(minted.len(), MAX_ASSERTIONS_PER_SIGNER);
    assert_eq!(full.len(), 1);
    refused_naming(
        &full[0],
        (503, "temporarily_unavailable"),
        &format!("{MAX_ASSERTIONS_PER_SIGNER} assertions in use"),
    );

    // Another holder (the parent's delegate, for the contract it holds).
    let other = endpoint.mint(&agents[2], &id32(&ids[2]), RESOURCE).await;
    assert!(other.is_ok(), "{other:?}");
}

/// Opens a connection from `from`, sends `head`, then `body_part`, and
/// keeps it open without sending the rest.
async fn stalled(
    from: IpAddr,
    to: SocketAddr,
    head: String,
    body_part: &[u8],
) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let mut stream = socket.connect(to).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body_part).await.unwrap();
    stream
}

/// Silent connections past an address's share, and a form whose body never
/// finishes, leave honest mints and introspections on fresh connections
/// answered promptly; the stalled body is answered 400 once
/// `REQUEST_TIMEOUT` passes, and every silent connection is closed by the
/// idle bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_connections_cost_honest_callers_nothing() {
    let mut broker = broker().await;
    let agents = [(); 4].map(|()| Agent::generate());
    let ids = chain_of_three(&mut broker, &agents).await;
    let url = broker.tokens_url.clone().unwrap();
    let endpoint = TokenEndpoint::new(&url).unwrap();
    let address: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .expect("a socket address");

    let started = Instant::now();
    let silent_from: IpAddr = "127.0.0.2".parse().unwrap();
    let silent = flood(
        silent_from,
        address,
        2 * MAX_TOKEN_CONNECTIONS_PER_ADDRESS,
        b"",
    )
    .await;
    assert!(!silent.is_empty(), "no silent connection opened");
    let slow_from: IpAddr = "127.0.0.3".parse().unwrap();
    let head = format!(
        "POST /token HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/x-www-form-urlencoded\r\ncontent-length: 1000\r\n\r\n"
    );
    let mut slow_body = stalled(slow_from, address, head, b"grant_type=").await;

    for _ in 0..3 {
        let honest = async {
            let minted = endpoint
                .mint(&agents[3], &id32(&ids[3]), RESOURCE)
                .await
                .expect("an honest mint");
            let answer = endpoint
                .introspect(("rs", SECRET), &minted.access_token)
                .await
                .expect("an honest introspection");
            assert_eq!(answer["active"], true);
        };
        tokio::time::timeout(HONEST_BOUND, honest)
            .await
            .unwrap_or_else(|_| {
                panic!("an honest mint and introspection took over {HONEST_BOUND:?}")
            });
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The stalled body: answered by the request bound, naming it.
    let mut answer = Vec::new();
    tokio::time::timeout(REQUEST_TIMEOUT + SLACK, async {
        let mut buf = [0u8; 1024];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") || !answer.ends_with(b"}") {
            match slow_body.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("the stalled body is answered within the request bound");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("did not arrive within"), "{answer}");

    // Every silent connection is closed by the idle bound (the ones past
    // the address's share at once).
    let deadline = tokio::time::Instant::from_std(started) + TOKEN_IDLE + SLACK;
    let mut checks = tokio::task::JoinSet::new();
    for stream in silent {
        checks.spawn(closed_by(stream, deadline));
    }
    let closed = checks.join_all().await;
    assert!(
        closed.iter().all(|c| *c),
        "a silent connection outlived the idle bound"
    );
}
