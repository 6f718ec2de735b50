//! Operating the broker binary: stopping cleanly on SIGTERM, starting
//! only once it can serve, keys of replicas, the reading CLI.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use broker_client::Agent;
use delegation_broker::pb;
use tokio_stream::StreamExt;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::crash::Killed;
use crate::harness::*;

/// `delegation-broker serve` on port 0 with `extra` arguments; the process
/// and its address, once it printed "listening on".
pub fn spawn_serve(data_dir: &std::path::Path, extra: &[&str]) -> (Killed, String) {
    spawn_logged(data_dir, extra, Stdio::inherit())
}

/// `spawn_logged` with `--metrics` too: the process, its gRPC address
/// and its metrics port's.
fn spawn_with_metrics(
    data_dir: &std::path::Path,
    extra: &[&str],
    log: Stdio,
) -> (Killed, String, std::net::SocketAddr) {
    let (process, seen) = Killed::announcing_all(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .env("BROKER_LOG", "warn")
            .stderr(log),
        &["listening", "metrics"],
    );
    let metrics = seen["metrics"]
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .parse()
        .expect("the metrics address");
    (process, format!("http://{}", seen["listening"]), metrics)
}

/// `spawn_serve` with its log (stderr) sent to `log`.
fn spawn_logged(data_dir: &std::path::Path, extra: &[&str], log: Stdio) -> (Killed, String) {
    Killed::announcing(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env("BROKER_LOG", "warn")
            .stderr(log),
        "listening",
    )
}

fn signal(child: &std::process::Child, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits for the process to exit, at most `bound`; its exit status.
fn exit_within(child: &mut std::process::Child, bound: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the broker did not exit within {bound:?} of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stopping a broker whose clients are connected but idle ends its store
/// and returns at once, not when the drain's bound runs out: nothing but
/// the requests in flight may hold the stop (a handle on the service kept
/// past the transport's drain once held the store open for the whole
/// bound, on every stop).
#[tokio::test]
async fn an_idle_broker_stops_without_waiting_out_the_drain() {
    // A drain far longer than any clean stop, so waiting it out shows.
    const DRAIN_MS: u64 = 60_000;
    let mut broker = Broker::start_with(|config| config.limits.shutdown_drain_ms = DRAIN_MS).await;
    let orchestrator = Agent::generate();
    let root = broker.open_root(&orchestrator, RootSpec::default()).await;
    assert_eq!(
        broker.ledger(&root.id).await.residual,
        RootSpec::default().budget
    );
    let began = Instant::now();
    broker.stop().await;
    let took = began.elapsed();
    assert!(
        took < Duration::from_millis(DRAIN_MS / 3),
        "an idle broker took {took:?} to stop (the drain is {DRAIN_MS} ms): something held the store past the transport's drain"
    );
}

/// Acceptance (a): with a health Watch and a broker Watch open, SIGTERM
/// turns health NOT_SERVING on the stream first, refuses new calls, ends
/// both streams and exits within the drain bound; everything acknowledged
/// before the signal is there after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_open_watches_exits_within_the_drain() {
    let dir = tempfile::tempdir().unwrap();
    let database = database_of_this_run().await;
    let config = dir.path().join("broker.toml");
    // Far below the test's own bound, far above what a clean stop takes.
    const DRAIN_MS: u64 = 4_000;
    std::fs::write(
        &config,
        format!("[limits]\nshutdown_drain_ms = {DRAIN_MS}\n"),
    )
    .unwrap();
    let data = dir.path().join("data");
    let mut extra = vec!["--config", config.to_str().unwrap()];
    if let Some(database) = &database {
        extra.extend(["--database-url", database.url.as_str()]);
    }
    let (mut process, addr) = spawn_serve(&data, &extra);

    let orchestrator = Agent::generate();
    let mut client = connect_as(&addr, &orchestrator).await;
    let spec = RootSpec::default();
    let root = open_root_on(&mut client, &orchestrator, &spec).await;
    let lineage = spec.lineage();
    let mut acknowledged = vec![root.contract_id.clone()];
    for _ in 0..20 {
        let answer = client
            .delegate(orchestrator.delegate(child(
                &root.contract_id,
                &lineage,
                &Agent::generate(),
                5,
            )))
            .await
            .unwrap()
            .into_inner();
        let Some(pb::delegate_response::Outcome::Issued(issued)) = answer.outcome else {
            panic!("issued");
        };
        acknowledged.push(issued.contract_id);
    }

    let channel = channel(&addr).await;
    let mut health = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = health.next().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let mut events = client
        .watch(watch_request(&root.contract_id))
        .await
        .unwrap()
        .into_inner();
    // Every stored event arrives; the stream then waits for more.
    let mut seen = 0;
    while seen < acknowledged.len() {
        let event = events.next().await.unwrap().unwrap();
        if matches!(event.event, Some(pb::watch_response::Event::Contract(_))) {
            seen += 1;
        }
    }

    signal(&process.0, "TERM");
    let asked = Instant::now();
    // The health stream says NOT_SERVING, then ends.
    let said = tokio::time::timeout(Duration::from_secs(10), health.next())
        .await
        .expect("health answers at once")
        .expect("a status before the end")
        .expect("not an error");
    assert_eq!(said.status, ServingStatus::NotServing as i32);
    let end = tokio::time::timeout(Duration::from_secs(10), health.next())
        .await
        .expect("the health stream ends");
    assert!(
        matches!(end, None | Some(Err(_))),
        "nothing after NOT_SERVING: {end:?}"
    );
    // The broker's Watch ends: UNAVAILABLE (resume elsewhere) or the end.
    let end = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("the Watch stream ends");
    match end {
        None => {}
        Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}"),
        Some(Ok(event)) => panic!("an event after the stop: {event:?}"),
    }
    let status = exit_within(&mut process.0, Duration::from_millis(DRAIN_MS + 6_000));
    assert!(status.success(), "a clean stop exits 0: {status:?}");
    eprintln!("stopped {:?} after SIGTERM", asked.elapsed());

    let (_process, addr) = spawn_serve(&data, &extra);
    let mut client = connect_as(&addr, &orchestrator).await;
    assert_stored(&mut client, &acknowledged).await;
}

/// Acceptance (e): reflection serves google/rpc/*.proto, so grpcurl and
/// `buf curl` decode ErrorInfo and BadRequest with no local files.
#[tokio::test]
async fn reflection_finds_google_rpc_error_info() {
    use prost::Message as _;
    use tonic_reflection::pb::v1;

    let broker = Broker::start().await;
    let channel = channel(&broker.addr).await;
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
    for symbol in ["google.rpc.ErrorInfo", "google.rpc.BadRequest"] {
        let request = v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1::server_reflection_request::MessageRequest::FileContainingSymbol(
                    symbol.to_owned(),
                ),
            ),
        };
        let answer = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .unwrap()
            .into_inner()
            .message()
            .await
            .unwrap()
            .expect("an answer");
        let Some(v1::server_reflection_response::MessageResponse::FileDescriptorResponse(files)) =
            answer.message_response
        else {
            panic!("{symbol} not found: {answer:?}");
        };
        let (package, name) = symbol.rsplit_once('.').unwrap();
        let found = files.file_descriptor_proto.iter().any(|bytes| {
            let file = prost_types::FileDescriptorProto::decode(bytes.as_slice()).unwrap();
            file.package() == package && file.message_type.iter().any(|m| m.name() == name)
        });
        assert!(found, "{symbol} in the files reflection returned");
    }
    broker.stop().await;
}

/// Acceptance (f): what a Prometheus user expects on a fresh broker:
/// process metrics, build info, the serving gauge, the replica, every
/// method's and every refusal code's series at 0; SQLite's series only on
/// SQLite, the pool's only on PostgreSQL.
#[tokio::test]
async fn metrics_a_prometheus_user_expects() {
    let broker = Broker::start_with_metrics().await;
    let text = crate::operability::scrape(broker.metrics_addr.unwrap()).await;
    let parsed =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    let has = |name: &str, labels: &[(&str, &str)]| {
        parsed.samples.iter().any(|s| {
            s.metric == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(k).is_some_and(|have| have == *v))
        })
    };
    let value =
        |name: &str, labels: &[(&str, &str)]| crate::operability::value(&parsed, name, labels);
    for family in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(has(family, &[]), "{family} in:\n{text}");
    }
    assert!(
        has(
            "broker_build_info",
            &[("version", delegation_broker::build::VERSION)]
        ),
        "{text}"
    );
    assert_eq!(value("broker_serving", &[]), 1.0);
    let backend = if on_postgres() { "postgres" } else { "sqlite" };
    assert!(
        has("broker_replica_info", &[("backend", backend)]),
        "{text}"
    );
    // Zeros, not "no data": every refusal code, every method and code.
    for code in delegation_broker::core::InvariantCode::ALL {
        assert!(
            has(
                "broker_delegations_refused_total",
                &[("code", code.as_str())]
            ),
            "{} pre-initialised",
            code.as_str()
        );
    }
    assert_eq!(value("broker_delegations_refused_total", &[]), 0.0);
    for (method, code) in [
        ("Delegate", "OK"),
        ("Delegate", "Unavailable"),
        ("Watch", "OK"),
    ] {
        assert!(
            has(
                "grpc_server_handled_total",
                &[("grpc_method", method), ("grpc_code", code)]
            ),
            "{method} {code}"
        );
    }
    let sqlite_only = text.contains("broker_wal_fsync_seconds");
    let pools = text.contains("broker_db_pool_connections");
    if on_postgres() {
        assert!(!sqlite_only, "no SQLite series on PostgreSQL:\n{text}");
        assert!(pools, "pool metrics on PostgreSQL");
        assert!(
            has(
                "broker_db_pool_connections",
                &[("pool", "read"), ("state", "max")]
            ),
            "{text}"
        );
        assert!(text.contains("broker_db_pool_acquire_seconds"), "{text}");
    } else {
        assert!(sqlite_only && !pools, "{text}");
    }
    broker.stop().await;
}

/// Acceptance (4): a database that cannot be reached fails the start
/// with its host and the cause, prints no "listening" and creates
/// nothing (no data directory, no key).
#[tokio::test]
async fn a_failed_start_names_the_database_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Nothing listens on port 1.
    let out = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .args([
            "--database-url",
            "postgres://broker@127.0.0.1:1/brokerdb?connect_timeout=2",
        ])
        .env("BROKER_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(
        stderr.contains("broker@127.0.0.1:1/brokerdb"),
        "names the database: {stderr}"
    );
    assert!(
        stderr.to_lowercase().contains("refused"),
        "says why: {stderr}"
    );
    assert!(!data.exists(), "a failed start created {}", data.display());
    // `version` says which build this is.
    let out = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .arg("version")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with(&format!(
            "delegation-broker {} (commit ",
            delegation_broker::build::VERSION
        )),
        "{said}"
    );
}

/// Unmounts (lazily) when dropped, also when the test panics.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

async fn health_is(addr: &str, want: ServingStatus, bound: Duration) {
    let channel = channel(addr).await;
    let mut health = HealthClient::new(channel);
    let deadline = Instant::now() + bound;
    loop {
        let now = health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        if now == want as i32 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "health is not {want:?} within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Acceptance (b), SQLite: on a small tmpfs filled up, writes fail and
/// health turns NOT_SERVING at the first failed write; once space is
/// freed a probe write succeeds and health is SERVING again; nothing
/// acknowledged is lost; the repeated warnings come at most once a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_full_disk_turns_health_not_serving_until_space_returns() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("tmpfs");
    std::fs::create_dir(&mount).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
        .arg(&mount)
        .output();
    if !mounted.as_ref().is_ok_and(|out| out.status.success()) {
        eprintln!("skipped: cannot mount a tmpfs here (needs root): {mounted:?}");
        return;
    }
    let _mounted = Mounted(mount.clone());
    let data = mount.join("data");
    let log_path = dir.path().join("broker.log");
    let log = Stdio::from(std::fs::File::create(&log_path).unwrap());
    let (mut process, addr, metrics) = spawn_with_metrics(&data, &[], log);
    // What a supervisor reads: `health` and /readyz, beside gRPC health.
    let supervisor_sees = async |serving: bool| {
        let (status, _) = crate::operability::http_get(metrics, "/readyz").await;
        let code = if serving { "200" } else { "503" };
        assert!(status.starts_with(&format!("HTTP/1.1 {code}")), "{status}");
        let health = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["health", "--addr", &addr])
            .output()
            .expect("health runs");
        assert_eq!(health.status.success(), serving, "{health:?}");
    };
    supervisor_sees(true).await;
    let orchestrator = Agent::generate();
    let mut client = connect(&addr).await;
    let root = |n: usize| {
        let mut body = RootSpec::default().body();
        body.intent = format!("{n} {}", "x".repeat(2_000));
        orchestrator.open_root(body)
    };
    let mut acknowledged = Vec::new();
    let first = client.open_root(root(0)).await.unwrap().into_inner();
    acknowledged.push(first.issued.unwrap().contract_id);
    // Fill the file system.
    let mut filler = std::fs::File::create(mount.join("filler")).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    while filler.write_all(&chunk).is_ok() {}
    let _ = filler.sync_all();
    drop(filler);
    let mut refused = None;
    for n in 1..5_000 {
        match client.open_root(root(n)).await {
            Ok(answer) => acknowledged.push(answer.into_inner().issued.unwrap().contract_id),
            Err(status) => {
                refused = Some(status);
                break;
            }
        }
    }
    let refused = refused.expect("a write fails on the full disk");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    health_is(&addr, ServingStatus::NotServing, Duration::from_secs(5)).await;
    // Refused again while full (and the warnings repeat, throttled).
    for n in 0..20 {
        assert!(client.open_root(root(10_000 + n)).await.is_err());
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    health_is(&addr, ServingStatus::NotServing, Duration::from_secs(1)).await;
    supervisor_sees(false).await;
    std::fs::remove_file(mount.join("filler")).unwrap();
    health_is(&addr, ServingStatus::Serving, Duration::from_secs(10)).await;
    supervisor_sees(true).await;
    let after = client.open_root(root(20_000)).await.expect("writes again");
    acknowledged.push(after.into_inner().issued.unwrap().contract_id);

    signal(&process.0, "TERM");
    assert!(exit_within(&mut process.0, Duration::from_secs(20)).success());
    let (_process, addr) = spawn_serve(&data, &[]);
    let mut client = connect_as(&addr, &orchestrator).await;
    assert_stored(&mut client, &acknowledged).await;
    // At most one line a second of each repeated warning.
    let log = std::fs::read_to_string(&log_path).unwrap();
    let mut seen = std::collections::HashMap::new();
    for line in log.lines() {
        let Some(second) = line.get(..19) else {
            continue;
        };
        for message in [
            "batch rolled back",
            "request failed",
            "WAL checkpoint failed",
            "the disk still refuses writes",
        ] {
            if line.contains(message) {
                *seen.entry((second.to_owned(), message)).or_insert(0) += 1;
            }
        }
    }
    assert!(
        seen.keys().any(|(_, m)| *m == "request failed"),
        "the failure was logged:\n{log}"
    );
    for ((second, message), count) in &seen {
        assert!(
            *count <= 1,
            "{count} lines of {message:?} at {second}:\n{log}"
        );
    }
}

/// Acceptance (g): the standard OpenTelemetry variables alone turn export
/// on — `OTEL_SERVICE_NAME` and `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, over
/// gRPC and over HTTP/protobuf — and the spans' resource carries the
/// service name, `service.version` and a `service.instance.id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_otel_variables_alone_export_spans() {
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message as _;

    /// The string attributes of each resource a request carries.
    fn resources_of(request: ExportTraceServiceRequest) -> Vec<Vec<(String, String)>> {
        request
            .resource_spans
            .into_iter()
            .map(|spans| {
                spans
                    .resource
                    .map(|r| r.attributes)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|a| match a.value?.value? {
                        Value::StringValue(v) => Some((a.key, v)),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    }

    let (sent, mut requests) = tokio::sync::mpsc::unbounded_channel();
    // OTLP/gRPC.
    let grpc_url = serve_otlp(sent.clone()).await;
    // OTLP/HTTP, protobuf bodies.
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_url = format!("http://{}/v1/traces", http.local_addr().unwrap());
    let http_sent = sent.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sent = http_sent.clone();
            async move {
                if let Ok(request) = ExportTraceServiceRequest::decode(body) {
                    let _ = sent.send(request);
                }
                ExportTraceServiceResponse::default().encode_to_vec()
            }
        }),
    );
    tokio::spawn(async move { axum::serve(http, app).await });

    for (protocol, endpoint, service) in [
        ("grpc", grpc_url, "broker-over-grpc"),
        ("http/protobuf", http_url, "broker-over-http"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (mut process, addr) = Killed::announcing(
            Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
                .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
                .arg(dir.path())
                .env("BROKER_LOG", "warn")
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .env("OTEL_SERVICE_NAME", service)
                .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &endpoint)
                .env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
                .stderr(Stdio::inherit()),
            "listening",
        );
        open_root_on(
            &mut connect(&addr).await,
            &Agent::generate(),
            &RootSpec::default(),
        )
        .await;
        // A clean stop flushes the exporter.
        signal(&process.0, "TERM");
        assert!(exit_within(&mut process.0, Duration::from_secs(20)).success());
        let attributes = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let request = requests.recv().await.unwrap();
                if let Some(attributes) = resources_of(request)
                    .into_iter()
                    .find(|a| a.iter().any(|(k, v)| k == "service.name" && v == service))
                {
                    return attributes;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no span of {service} over {protocol}"));
        let get = |key: &str| {
            attributes
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("{key} in {attributes:?}"))
        };
        assert_eq!(get("service.version"), delegation_broker::build::VERSION);
        let instance = get("service.instance.id");
        assert_eq!(instance.len(), 36, "a UUID: {instance}");
    }
}

/// Every file of a directory with its bytes, to show a refused command
/// changed nothing.
fn snapshot(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_file()
                && !p.to_string_lossy().contains("-wal")
                && !p.to_string_lossy().contains("-shm")
        })
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

/// `rotate-key --data-dir DATA`, run to its end.
fn rotate_key(data: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["rotate-key", "--data-dir"])
        .arg(data)
        .output()
        .unwrap()
}

/// `serve` on `data` and `listen`, for a start that must fail: its output.
fn serve_to_the_end(data: &std::path::Path, listen: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["serve", "--listen", listen, "--data-dir"])
        .arg(data)
        .env("BROKER_LOG", "error")
        .output()
        .unwrap()
}

/// A served SQLite data directory has one writer: a second `serve` and a
/// `rotate-key` refuse at once, naming the serving process's pid, and
/// change nothing in it; `rotate-key` refuses a directory that does not
/// exist and creates none.
#[test]
fn sqlite_a_served_data_directory_refuses_a_second_writer() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (first, _addr) = spawn_serve(&data, &[]);
    let pid = first.0.id().to_string();
    let before = snapshot(&data);
    let second = serve_to_the_end(&data, "127.0.0.1:0");
    assert!(!second.status.success(), "a second serve started");
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(
        said.contains(&format!("in use by process {pid}")),
        "names the holder: {said}"
    );
    assert!(!String::from_utf8_lossy(&second.stdout).contains("listening"));
    let rotate = rotate_key(&data);
    assert!(
        !rotate.status.success(),
        "rotate-key ran beside a serving broker"
    );
    let said = String::from_utf8_lossy(&rotate.stderr);
    assert!(
        said.contains(&format!("in use by process {pid}")),
        "names the holder: {said}"
    );
    assert_eq!(
        snapshot(&data),
        before,
        "a refused command changed the data directory"
    );
    drop(first);
    let missing = dir.path().join("nonexistent");
    let rotate = rotate_key(&missing);
    assert!(!rotate.status.success());
    assert!(
        !missing.exists(),
        "rotate-key created {}",
        missing.display()
    );
    // Once the broker is gone the lock is free.
    let rotate = rotate_key(&data);
    assert!(
        rotate.status.success(),
        "{}",
        String::from_utf8_lossy(&rotate.stderr)
    );
}

/// Without a declared tenant every caller shares one, so the broker is
/// for one machine: beyond loopback `serve` refuses, naming the opt-in.
#[test]
fn serve_beyond_loopback_needs_declared_tenants_or_the_opt_in() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = serve_to_the_end(&data, "0.0.0.0:0");
    assert!(
        !out.status.success(),
        "served beyond loopback with no tenant"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("--allow-open-tenant"),
        "names the opt-in: {said}"
    );
    assert!(said.contains("[tenants]"), "names the fix: {said}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"));
}

/// Under systemd (`Type=notify`): `READY=1` reaches the notify socket
/// once the broker answers calls (after it printed "listening"), and
/// `STOPPING=1` when SIGTERM starts the drain.
#[tokio::test]
async fn systemd_hears_ready_then_stopping() {
    let dir = tempfile::tempdir().expect("a folder");
    let socket_path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).expect("a notify socket");
    let (process, addr) = Killed::announcing(
        Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .env("NOTIFY_SOCKET", &socket_path)
            .env("BROKER_LOG", "warn"),
        "listening",
    );
    let mut buf = [0u8; 256];
    let receive = async |buf: &mut [u8]| {
        let n = tokio::time::timeout(Duration::from_secs(30), socket.recv(buf))
            .await
            .expect("a notification")
            .expect("read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert_eq!(receive(&mut buf).await, "READY=1");
    // Ready means answering.
    let channel = tonic::transport::Channel::from_shared(addr).expect("an address");
    let mut health = HealthClient::new(channel.connect().await.expect("connect"));
    let status = health
        .check(HealthCheckRequest::default())
        .await
        .expect("health");
    assert_eq!(status.into_inner().status, ServingStatus::Serving as i32);
    signal(&process.0, "TERM");
    assert_eq!(receive(&mut buf).await, "STOPPING=1");
}

/// While SIGTERM's drain waits for a call in flight (here a request whose
/// body never finishes), a supervisor reads not-ready: `/readyz` 503 and
/// `health` exit 1; the broker exits once the call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_draining_readyz_and_health_say_not_serving() {
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, "[limits]\nshutdown_drain_ms = 20000\n").unwrap();
    let config = config.to_str().expect("a path");
    let data = dir.path().join("data");
    let (mut process, addr, metrics) =
        spawn_with_metrics(&data, &["--config", config], Stdio::inherit());

    // A GetBrokerKeys whose gRPC frame announces 10 bytes and sends none.
    let tcp = tokio::net::TcpStream::connect(addr.trim_start_matches("http://"))
        .await
        .unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let (body, frames) =
        tokio::sync::mpsc::channel::<Result<Frame<bytes::Bytes>, std::convert::Infallible>>(1);
    let request = http::Request::post(format!("{addr}/delegation.broker.v1.Broker/GetBrokerKeys"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(frames),
        ))
        .unwrap();
    let answer = tokio::spawn(sender.send_request(request));
    body.send(Ok(Frame::data(bytes::Bytes::from_static(&[
        0, 0, 0, 0, 10,
    ]))))
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    signal(&process.0, "TERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = crate::operability::http_get(metrics, "/readyz").await;
        if status.starts_with("HTTP/1.1 503") {
            break;
        }
        assert!(Instant::now() < deadline, "/readyz still says {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let health = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["health", "--addr", &addr])
        .output()
        .expect("health runs");
    assert!(!health.status.success(), "{health:?}");
    assert!(
        process.0.try_wait().unwrap().is_none(),
        "the drain holds the process for the call in flight"
    );
    // The call ends; so does the broker.
    drop(body);
    let _ = answer.await;
    assert!(exit_within(&mut process.0, Duration::from_secs(20)).success());
}
