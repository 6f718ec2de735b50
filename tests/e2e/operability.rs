//! What operators and tools see from outside: reflection in both versions.

use tonic_reflection::pb::{v1, v1alpha};

use crate::harness::{Broker, agents, complete_body};

/// The services a reflection client of `$version` (the generated module
/// `v1` or `v1alpha`: the same messages, distinct types) lists over
/// `$channel`.
macro_rules! listed_services {
    ($version:ident, $channel:expr) => {{
        use $version::server_reflection_request::MessageRequest;
        use $version::server_reflection_response::MessageResponse;
        let mut client = $version::server_reflection_client::ServerReflectionClient::new($channel);
        let request = $version::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .expect(concat!(stringify!($version), " is served"))
            .into_inner();
        let answer = answers.message().await.unwrap().expect("an answer");
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("not a service list: {answer:?}");
        };
        list.service
            .into_iter()
            .map(|s| s.name)
            .collect::<Vec<String>>()
    }};
}

/// The services a reflection client lists.
#[tokio::test]
async fn reflection_lists_the_services_in_v1_and_v1alpha() {
    let broker = Broker::start().await;
    let channel = crate::harness::channel(&broker.addr).await;

    let alpha_names = listed_services!(v1alpha, channel.clone());
    let v1_names = listed_services!(v1, channel);
    for names in [&alpha_names, &v1_names] {
        for service in ["delegation.broker.v1.Broker", "grpc.health.v1.Health"] {
            assert!(names.iter().any(|n| n == service), "{service} in {names:?}");
        }
    }
    broker.stop().await;
}

/// Health tells the truth: a broker whose store can no longer make writes
/// durable answers NOT_SERVING, for the broker's service and overall.
#[tokio::test]
async fn sqlite_a_failed_fsync_turns_health_not_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let mut broker = Broker::start().await;
    let channel = crate::harness::channel(&broker.addr).await;
    let mut health = HealthClient::new(channel);
    let status = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    for service in ["", "delegation.broker.v1.Broker"] {
        let answer = health.check(status(service)).await.unwrap().into_inner();
        assert_eq!(answer.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let orchestrator = broker_client::Agent::generate();
    broker
        .open_root(&orchestrator, crate::harness::RootSpec::default())
        .await;
    // The fault, from outside: the write-ahead log's path disappears, so
    // the next fsync of it fails (the store stops for good, by design).
    std::fs::remove_file(broker.data_dir().join("broker.sqlite3-wal")).unwrap();
    let failed = broker
        .client
        .open_root(orchestrator.open_root(crate::harness::RootSpec::default().body()))
        .await;
    assert!(
        failed.is_err(),
        "a write after the fault is not durable: {failed:?}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    for service in ["", "delegation.broker.v1.Broker"] {
        loop {
            let answer = health.check(status(service)).await.unwrap().into_inner();
            if answer.status == ServingStatus::NotServing as i32 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{service:?} still serving"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    broker.stop().await;
}

/// GET /metrics over plain HTTP/1.1: the body, after checking the status
/// and the content type.
pub(crate) async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a full response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_owned()
}

/// The value of the sample `metric` whose labels include `labels`, 0 when
/// there is none.
pub(crate) fn value(
    scrape: &prometheus_parse::Scrape,
    metric: &str,
    labels: &[(&str, &str)],
) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            other => panic!("{metric} is not a number: {other:?}"),
        })
        .sum()
}

/// The seed 001 chain (its executor completing), then 64 siblings racing
/// for a residual of 300 at 10 each: the scrape, parsed by a Prometheus
/// text parser, counts exactly what happened — issuances, refusals by
/// code, transitions, budget, every call by method and code — and every
/// histogram is well-formed.
#[tokio::test]
async fn metrics_count_a_scripted_run_exactly() {
    use crate::harness::{RootSpec, child, seed_001_delegations};
    use broker_client::Agent;

    let mut broker = Broker::start_with_metrics().await;
    let metrics_addr = broker.metrics_addr.unwrap();
    // seed 001: the planner's liable child, a refused executor (no retry
    // headroom), then the executor it can afford.
    let [orchestrator, planner, executor] = agents();
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    let (planner_id, executor_id) = seed_001_delegations(
        &mut broker,
        &root,
        [&orchestrator, &planner, &executor],
        "result.schema_valid",
    )
    .await;
    // The executor accepts and completes, reporting 4 units (no host).
    broker.accept(&executor, &executor_id, None).await.unwrap();
    let completed = broker
        .complete(&executor, complete_body(&executor_id, "{}", "success", 4))
        .await
        .unwrap();
    let completion = completed.completion.unwrap();
    assert_eq!((completion.consumed, completion.returned), (4, 9));
    // A stranger's Delegate: NOT_FOUND (as for an unknown parent), never
    // a refusal.
    let stranger = Agent::generate();
    let denied = broker
        .delegate(&stranger, child(&planner_id, &root.lineage, &stranger, 1))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::NotFound);

    // The race: 64 siblings of 10 from a residual of 300.
    let racer = Agent::generate();
    let race_root = broker
        .open_root(&racer, RootSpec::with(|s| s.budget = 300))
        .await;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let mut client = broker.client.clone();
        let request = racer.delegate(race_root.child(&Agent::generate(), 10));
        calls.spawn(async move { client.delegate(request).await.unwrap().into_inner() });
    }
    let mut issued = 0;
    while let Some(answer) = calls.join_next().await {
        if matches!(
            answer.unwrap().outcome,
            Some(delegation_broker::pb::delegate_response::Outcome::Issued(_))
        ) {
            issued += 1;
        }
    }
    assert_eq!(issued, 30);

    let text = scrape(metrics_addr).await;
    let parsed =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    let delegate = [("grpc_method", "Delegate")];
    assert_eq!(value(&parsed, "broker_delegations_issued_total", &[]), 32.0);
    assert_eq!(
        value(
            &parsed,
            "broker_delegations_refused_total",
            &[("code", "BUDGET_EXCEEDS_PARENT")]
        ),
        34.0
    );
    assert_eq!(
        value(
            &parsed,
            "broker_delegations_refused_total",
            &[("code", "NO_RETRY_HEADROOM")]
        ),
        1.0
    );
    assert_eq!(
        value(&parsed, "broker_delegations_refused_total", &[]),
        35.0
    );
    assert_eq!(
        value(&parsed, "broker_budget_reserved_units_total", &[]),
        25.0 + 13.0 + 300.0
    );
    assert_eq!(value(&parsed, "broker_budget_spent_units_total", &[]), 4.0);
    assert_eq!(
        value(&parsed, "broker_budget_returned_units_total", &[]),
        9.0
    );
    for (kind, verdict) in [
        ("RECEIPT_KIND_ACCEPTED", ""),
        ("RECEIPT_KIND_COMPLETED", "VERDICT_ACCEPTED"),
    ] {
        assert_eq!(
            value(
                &parsed,
                "broker_lifecycle_transitions_total",
                &[("kind", kind), ("verdict", verdict)]
            ),
            1.0,
            "{kind}"
        );
    }
    // The store's side: every answer above waited for a group commit and
    // an fsync; nothing is queued or watched now; the harness's client
    // holds a connection.
    assert!(value(&parsed, "broker_group_commit_commands_count", &[]) >= 1.0);
    // SQLite's own fsyncs (PostgreSQL's are its own to report).
    if !crate::harness::on_postgres() {
        assert!(value(&parsed, "broker_wal_fsync_seconds_count", &[]) >= 1.0);
    }
    assert_eq!(value(&parsed, "broker_write_queue_depth", &[]), 0.0);
    assert_eq!(value(&parsed, "broker_watch_streams", &[]), 0.0);
    assert!(value(&parsed, "broker_connections_open", &[]) >= 1.0);
    // Counted in the background: the two roots, the planner (never
    // accepted) and the 30 racers are open; the executor completed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let text = scrape(metrics_addr).await;
        let now = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .expect("parses");
        if value(&now, "broker_open_contracts", &[]) == 33.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "open contracts: {}",
            value(&now, "broker_open_contracts", &[])
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Every call, by method and code: refusals are answers (OK).
    for (method, code, count) in [
        ("Delegate", "OK", 67.0),
        ("Delegate", "NotFound", 1.0),
        ("OpenRoot", "OK", 2.0),
        ("Accept", "OK", 1.0),
        ("Complete", "OK", 1.0),
    ] {
        assert_eq!(
            value(
                &parsed,
                "grpc_server_handled_total",
                &[
                    ("grpc_service", "delegation.broker.v1.Broker"),
                    ("grpc_method", method),
                    ("grpc_code", code),
                    ("grpc_type", "unary"),
                ]
            ),
            count,
            "{method} {code}"
        );
    }
    assert_eq!(value(&parsed, "grpc_server_started_total", &delegate), 68.0);
    // Every started call was handled (the scrape itself is not gRPC).
    assert_eq!(
        value(&parsed, "grpc_server_started_total", &[]),
        value(&parsed, "grpc_server_handled_total", &[])
    );
    // Histograms: cumulative buckets ending at +Inf = _count.
    let mut histograms = 0;
    for sample in &parsed.samples {
        let prometheus_parse::Value::Histogram(buckets) = &sample.value else {
            continue;
        };
        histograms += 1;
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].less_than < w[1].less_than && w[0].count <= w[1].count)
        );
        let last = buckets.last().expect("buckets");
        assert!(last.less_than.is_infinite(), "{:?}", sample.labels);
        let labels: Vec<(&str, &str)> = sample
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            value(&parsed, &format!("{}_count", sample.metric), &labels),
            last.count
        );
    }
    assert!(histograms >= 2, "one per method called");
    assert_eq!(
        value(
            &parsed,
            "grpc_server_handling_seconds_count",
            &[("grpc_method", "Delegate")]
        ),
        68.0
    );
    broker.stop().await;
}

/// `BROKER_LOG_FORMAT=json`: every line the broker writes is one JSON
/// object, and every line written during a call carries that call's trace
/// id — the one its `traceparent` sent, or a fresh one — with the
/// broker's facts about it.
#[tokio::test]
async fn json_logs_carry_each_calls_trace_id() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    use broker_client::Agent;
    use delegation_broker::pb;

    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("broker.log");
    let mut process = crate::crash::Killed(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .env("BROKER_LOG_FORMAT", "json")
            .env("BROKER_LOG", "info,delegation_broker=debug")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("broker binary starts"),
    );
    let mut line = String::new();
    BufReader::new(process.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = format!(
        "http://{}",
        line.trim().strip_prefix("listening on ").expect("address")
    );
    let mut client = pb::broker_client::BrokerClient::connect(addr)
        .await
        .unwrap();
    fn traced<T>(body: T, trace_id: &str) -> tonic::Request<T> {
        let mut request = tonic::Request::new(body);
        request.metadata_mut().insert(
            "traceparent",
            format!("00-{trace_id}-00f067aa0ba902b7-01")
                .parse()
                .unwrap(),
        );
        request
    }
    let (t_root, t_delegate) = (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "0af7651916cd43dd8448eb211c80319c",
    );
    let orchestrator = Agent::generate();
    let spec = crate::harness::RootSpec::default();
    let root = client
        .open_root(traced(orchestrator.open_root(spec.body()), t_root))
        .await
        .unwrap()
        .into_inner()
        .issued
        .unwrap();
    let root_contract =
        <pb::Contract as prost::Message>::decode(root.contract.unwrap().payload.as_slice())
            .unwrap();
    let worker = Agent::generate();
    let body = crate::harness::child(
        &root.contract_id,
        &root_contract.intent_lineage_hash,
        &worker,
        10,
    );
    let issued = client
        .delegate(traced(orchestrator.delegate(body), t_delegate))
        .await
        .unwrap()
        .into_inner();
    let Some(pb::delegate_response::Outcome::Issued(child)) = issued.outcome else {
        panic!("issued");
    };
    // No trace context at all: the call still gets a trace id of its own.
    client
        .get_broker_keys(pb::GetBrokerKeysRequest {})
        .await
        .unwrap();
    // Let the last lines reach the file, then stop the broker.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    process.0.kill().unwrap();
    process.0.wait().unwrap();

    let log = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty());
    let answered = |method: &str| {
        lines
            .iter()
            .find(|l| l["message"] == "call answered" && l["span"]["rpc.method"] == method)
            .unwrap_or_else(|| panic!("no line for {method}: {log}"))
            .clone()
    };
    let open = answered("OpenRoot");
    assert_eq!(open["span"]["trace_id"], t_root);
    assert_eq!(
        open["span"]["broker.contract_id"],
        hex::encode(&root.contract_id)
    );
    assert_eq!(open["span"]["broker.outcome"], "issued");
    assert_eq!(
        open["span"]["broker.agent_key_id"],
        delegation_broker::crypto::key_id(&orchestrator.public_key())
    );
    let delegate = answered("Delegate");
    assert_eq!(delegate["span"]["trace_id"], t_delegate);
    assert_eq!(
        delegate["span"]["broker.contract_id"],
        hex::encode(&child.contract_id)
    );
    assert_eq!(
        delegate["span"]["broker.parent_id"],
        hex::encode(&root.contract_id)
    );
    assert_eq!(
        delegate["span"]["broker.root_id"],
        hex::encode(&root.contract_id)
    );
    assert_eq!(delegate["span"]["broker.depth"], 1);
    let keys = answered("GetBrokerKeys");
    let fresh = keys["span"]["trace_id"].as_str().unwrap();
    assert_eq!(fresh.len(), 32);
    assert!(fresh != t_root && fresh != t_delegate);
    // Every line written inside a call carries a trace id.
    for line in lines.iter().filter(|l| l.get("span").is_some()) {
        assert_eq!(
            line["span"]["trace_id"].as_str().map(str::len),
            Some(32),
            "{line}"
        );
    }
}

/// OTLP: with the broker's telemetry exporting to an in-process receiver
/// (the collector's gRPC TraceService, from the opentelemetry-proto
/// definitions), a Delegate sent with a `traceparent` arrives as a server
/// span of that trace, child of the caller's span, with the broker's
/// attributes; the delegate's later Accept and Complete, sent with no trace
/// context at all, produce spans linked to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegate_span_continues_the_callers_trace_over_otlp() {
    use broker_client::Agent;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use opentelemetry_proto::tonic::trace::v1::Span;

    let (sent, mut requests) = tokio::sync::mpsc::unbounded_channel();
    let endpoint = crate::harness::serve_otlp(sent).await;
    let telemetry = delegation_broker::telemetry::init(
        &delegation_broker::telemetry::Logging {
            format: delegation_broker::telemetry::LogFormat::Text,
            filter: None,
        },
        Some(&endpoint),
        Some(1.0),
    )
    .expect("telemetry");

    let mut broker = Broker::start_with_metrics().await;
    let orchestrator = Agent::generate();
    let root = broker
        .open_root(&orchestrator, crate::harness::RootSpec::default())
        .await;
    let (trace_id, caller_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let worker = Agent::generate();
    let mut request = tonic::Request::new(orchestrator.delegate(root.child(&worker, 10)));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{caller_span}-01").parse().unwrap(),
    );
    let answer = broker.client.delegate(request).await.unwrap().into_inner();
    let Some(delegation_broker::pb::delegate_response::Outcome::Issued(child)) = answer.outcome
    else {
        panic!("issued");
    };
    // The worker never sees the trace context: it accepts and completes
    // with none.
    broker
        .accept(&worker, &child.contract_id, None)
        .await
        .unwrap();
    broker
        .complete(&worker, complete_body(&child.contract_id, "{}", "done", 1))
        .await
        .unwrap();
    tokio::task::spawn_blocking(move || {
        telemetry.flush();
        telemetry
    })
    .await
    .unwrap();

    let mut received = Vec::new();
    let wanted =
        ["Delegate", "Accept", "Complete"].map(|m| format!("delegation.broker.v1.Broker/{m}"));
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !wanted
            .iter()
            .all(|name| received.iter().any(|s: &Span| &s.name == name))
        {
            let request = requests.recv().await.expect("the receiver runs");
            for resource in request.resource_spans {
                for scope in resource.scope_spans {
                    received.extend(scope.spans);
                }
            }
        }
    })
    .await
    .expect("the spans arrive");
    // The exporter's counts, after the flush: every span ended so far was
    // exported (at least this test's four calls), none failed.
    let text = scrape(broker.metrics_addr.unwrap()).await;
    let parsed =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    let ended = value(&parsed, "broker_trace_spans_ended_total", &[]);
    let exported = value(&parsed, "broker_trace_spans_exported_total", &[]);
    assert!(exported >= 4.0, "{exported} spans exported");
    assert!(exported <= ended, "{exported} exported of {ended} ended");
    assert_eq!(value(&parsed, "broker_trace_spans_failed_total", &[]), 0.0);
    let named = |name: &str| {
        received
            .iter()
            .find(|s| s.name == format!("delegation.broker.v1.Broker/{name}"))
            .unwrap()
            .clone()
    };
    let span = named("Delegate");
    assert_eq!(hex::encode(&span.trace_id), trace_id);
    // Later calls on the contract, sent with no context, start traces of
    // their own and link to the call that issued the contract.
    // A completion's span carries the broker's verdict.
    let completed = named("Complete");
    let verdict = completed
        .attributes
        .iter()
        .find(|a| a.key == "broker.verdict")
        .and_then(|a| a.value.as_ref()?.value.clone());
    assert!(
        matches!(&verdict, Some(Value::StringValue(v)) if v.starts_with("VERDICT_")),
        "the Complete span's verdict: {verdict:?}"
    );
    for later in ["Accept", "Complete"] {
        let later = named(later);
        assert_ne!(hex::encode(&later.trace_id), trace_id);
        assert!(
            later
                .links
                .iter()
                .any(|l| l.trace_id == span.trace_id && l.span_id == span.span_id),
            "{} links to the Delegate: {:?}",
            later.name,
            later.links
        );
    }
    assert_eq!(span.name, "delegation.broker.v1.Broker/Delegate");
    assert_eq!(hex::encode(&span.parent_span_id), caller_span);
    assert_eq!(
        span.kind,
        opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32
    );
    let attribute = |key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.as_ref()?.value.clone())
            .map(|v| match v {
                Value::StringValue(s) => s,
                Value::IntValue(i) => i.to_string(),
                other => format!("{other:?}"),
            })
            .unwrap_or_else(|| panic!("no attribute {key}: {:?}", span.attributes))
    };
    assert_eq!(attribute("rpc.system"), "grpc");
    assert_eq!(attribute("rpc.method"), "Delegate");
    assert_eq!(
        attribute("broker.contract_id"),
        hex::encode(&child.contract_id)
    );
    assert_eq!(attribute("broker.parent_id"), hex::encode(&root.id));
    assert_eq!(attribute("broker.root_id"), hex::encode(&root.id));
    assert_eq!(attribute("broker.depth"), "1");
    assert_eq!(attribute("broker.outcome"), "issued");
    assert_eq!(
        attribute("broker.agent_key_id"),
        delegation_broker::crypto::key_id(&orchestrator.public_key())
    );
    assert_eq!(attribute("rpc.grpc.status_code"), "0");
    // The span's own trace id says it; no attribute repeats it.
    assert!(span.attributes.iter().all(|a| a.key != "trace_id"));
    broker.stop().await;
}

/// GET `path` on the metrics port: the status line and the body.
pub(crate) async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a full response");
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, body.to_owned())
}

/// `/healthz` answers while the process does; `/readyz` follows health:
/// 200 while it serves, 503 from the moment a stop is asked.
#[tokio::test]
async fn healthz_and_readyz_follow_the_broker() {
    let broker = Broker::start_with_metrics().await;
    let addr = broker.metrics_addr.expect("metrics");
    assert_eq!(
        http_get(addr, "/healthz").await,
        ("HTTP/1.1 200 OK".into(), "ok\n".into())
    );
    assert_eq!(
        http_get(addr, "/readyz").await,
        ("HTTP/1.1 200 OK".into(), "serving\n".into())
    );
    let (status, body) = http_get(addr, "/nothing").await;
    assert!(
        status.starts_with("HTTP/1.1 404") && body.contains("/readyz"),
        "{status} {body}"
    );
    broker.stop().await;
}
