//! TLS: with `[tls]` configured the broker speaks gRPC over TLS only, and a
//! client that trusts the certificate gets the same API.

use std::sync::Arc;

use delegation_broker::clock::SystemClock;
use delegation_broker::config::{Config, TlsIdentity};
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// A broker serving TLS with a fresh self-signed certificate for
/// "localhost", on 127.0.0.1:0; `adjust` may change its configuration.
struct TlsBroker {
    port: u16,
    cert_pem: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), delegation_broker::server::ServerError>>,
    _dir: tempfile::TempDir,
}

impl TlsBroker {
    async fn start(adjust: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let issued =
            rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
        let cert_pem = issued.cert.pem();
        let mut config = Config::load(dir.path().to_owned(), None).expect("default config");
        config.tls = Some(TlsIdentity {
            cert_pem: cert_pem.clone().into_bytes(),
            key_pem: issued.signing_key.serialize_pem().into_bytes(),
        });
        adjust(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(delegation_broker::server::run_with_clock(
            listener,
            config,
            Arc::new(SystemClock),
            async {
                let _ = stopped.await;
            },
        ));
        Self {
            port,
            cert_pem,
            stop,
            server,
            _dir: dir,
        }
    }

    /// A client that trusts the certificate.
    async fn client(&self) -> BrokerClient<tonic::transport::Channel> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.cert_pem))
            .domain_name("localhost");
        let channel = Endpoint::from_shared(format!("https://127.0.0.1:{}", self.port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .expect("TLS handshake");
        BrokerClient::new(channel)
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.server.await.expect("server task").expect("server ran");
    }
}

#[tokio::test]
async fn a_tls_broker_answers_tls_clients_and_refuses_plaintext() {
    let broker = TlsBroker::start(|_| {}).await;
    let port = broker.port;
    let keys = broker
        .client()
        .await
        .get_broker_keys(pb::GetBrokerKeysRequest::default())
        .await
        .expect("GetBrokerKeys over TLS")
        .into_inner()
        .keys;
    assert_eq!(keys.iter().filter(|k| k.current).count(), 1);

    // The same port without TLS gets no answer.
    let plaintext = match Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
    {
        Ok(channel) => BrokerClient::new(channel)
            .get_broker_keys(pb::GetBrokerKeysRequest::default())
            .await
            .map(drop),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(
        plaintext.is_err(),
        "a plaintext call must fail: {plaintext:?}"
    );
    broker.stop().await;
}

#[test]
fn a_missing_certificate_fails_the_start_naming_the_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.toml");
    std::fs::write(
        &path,
        "[tls]\ncert = \"/nonexistent/cert.pem\"\nkey = \"/nonexistent/key.pem\"\n",
    )
    .unwrap();
    match Config::load(dir.path().to_owned(), Some(&path)) {
        Err(delegation_broker::config::ConfigError::Invalid { field, .. }) => {
            assert_eq!(field, "tls.cert");
        }
        other => panic!("expected an invalid tls.cert: {other:?}"),
    }
}

/// Certificate files are bounded and must be PEM; each refusal names the
/// field.
#[test]
fn oversized_or_non_pem_tls_files_fail_naming_the_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let good = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, good.cert.pem()).unwrap();
    std::fs::write(&key, good.signing_key.serialize_pem()).unwrap();
    let huge = dir.path().join("huge.pem");
    let mut text = b"-----BEGIN CERTIFICATE-----\n".to_vec();
    text.resize(1024 * 1024 + 1, b'A');
    std::fs::write(&huge, text).unwrap();
    let der = dir.path().join("key.der");
    std::fs::write(&der, [0x30u8, 0x82, 0x01, 0x00]).unwrap();
    let config = dir.path().join("broker.toml");
    let load = |cert: &std::path::Path, key: &std::path::Path| {
        std::fs::write(
            &config,
            format!("[tls]\ncert = {:?}\nkey = {:?}\n", cert, key),
        )
        .unwrap();
        Config::load(dir.path().to_owned(), Some(&config))
    };
    let field_of = |result: Result<Config, delegation_broker::config::ConfigError>| match result {
        Err(delegation_broker::config::ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected an invalid TLS file: {other:?}"),
    };
    assert!(load(&cert, &key).expect("valid PEM files").tls.is_some());
    assert_eq!(field_of(load(&huge, &key)), "tls.cert");
    assert_eq!(field_of(load(&cert, &der)), "tls.key");
}

/// A client that opens a connection and never starts its TLS handshake is
/// dropped after `limits.tls_handshake_timeout_ms`, not kept forever (each
/// such socket holds a task), and the broker goes on serving.
#[tokio::test]
async fn an_unfinished_tls_handshake_is_dropped_after_the_timeout() {
    use tokio::io::AsyncReadExt;
    let broker = TlsBroker::start(|config| config.limits.tls_handshake_timeout_ms = 300).await;
    let port = broker.port;

    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("TCP connect");
    let began = std::time::Instant::now();
    let mut byte = [0u8; 1];
    // Without the timeout the read would wait forever; 20 s is far beyond
    // the configured 300 ms.
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), silent.read(&mut byte))
        .await
        .expect("the broker must drop a connection that never handshakes");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the connection must be closed, got {read:?}"
    );
    assert!(
        began.elapsed() >= std::time::Duration::from_millis(250),
        "closed before the handshake timeout: {:?}",
        began.elapsed()
    );

    // And a real client is still served.
    broker
        .client()
        .await
        .get_broker_keys(pb::GetBrokerKeysRequest::default())
        .await
        .expect("GetBrokerKeys over TLS");
    broker.stop().await;
}

/// Every command of the binary that calls the broker, against a TLS
/// broker at an `https://` address with `--ca-file`; and a CA the
/// broker's certificate does not chain to, refused with the reason.
#[tokio::test]
async fn the_cli_reaches_a_tls_broker_with_its_ca_and_refuses_another() {
    let broker = TlsBroker::start(|_| {}).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &broker.cert_pem).expect("ca file");
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let wrong_ca = dir.path().join("wrong.pem");
    std::fs::write(&wrong_ca, other.cert.pem()).expect("ca file");
    let addr = format!("https://localhost:{}", broker.port);
    let key_file = |name: &str| {
        let agent = broker_client::Agent::generate();
        let path = dir.path().join(format!("{name}.key"));
        crate::harness::write_key_file(&path, &agent.seed());
        (hex::encode(agent.public_key()), path.display().to_string())
    };
    let (_, orchestrator) = key_file("orchestrator");
    let (planner_key, planner) = key_file("planner");
    let ca_file = ca.display().to_string();
    let cli = |args: Vec<&str>, ca_file: &str| {
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        run_cli(args, addr.clone(), ca_file.to_owned())
    };
    let ok = |(code, stdout, stderr, args): (Option<i32>, String, String, Vec<String>)| {
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        stdout
    };

    assert_eq!(ok(cli(vec!["health"], &ca_file).await), "serving");
    assert_eq!(
        ok(cli(vec!["keys", "show", "-q"], &ca_file).await).len(),
        64
    );
    let root = ok(cli(
        vec![
            "open-root",
            "--key-file",
            &orchestrator,
            "--intent",
            "tls",
            "--budget",
            "10",
            "-q",
        ],
        &ca_file,
    )
    .await);
    let child = ok(cli(
        vec![
            "delegate",
            &root,
            "--key-file",
            &orchestrator,
            "--to",
            &planner_key,
            "--budget",
            "4",
            "--task",
            "t",
            "-q",
        ],
        &ca_file,
    )
    .await);
    let accepted = ok(cli(
        vec!["accept", &child, "--key-file", &planner, "-q"],
        &ca_file,
    )
    .await);
    for args in [
        vec!["get", &child, "--key-file", &planner],
        vec!["children", &root, "--key-file", &orchestrator],
        vec!["tree", &root, "--key-file", &orchestrator],
        vec![
            "watch",
            &root,
            "--key-file",
            &orchestrator,
            "--max-events",
            "1",
        ],
        vec!["receipt", &accepted, "--key-file", &planner],
        vec!["session", "--key-file", &planner],
    ] {
        assert!(!ok(cli(args, &ca_file).await).is_empty());
    }
    ok(cli(
        vec![
            "revoke",
            &child,
            "--key-file",
            &orchestrator,
            "--reason",
            "done",
        ],
        &ca_file,
    )
    .await);

    let wrong = wrong_ca.display().to_string();
    let (code, _, stderr, _) = cli(vec!["health"], &wrong).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot connect to {addr}")) && stderr.contains("certificate"),
        "the error says the certificate was not trusted: {stderr}"
    );
    let (code, _, stderr, _) = cli(vec!["get", &child, "--key-file", &planner], &wrong).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");
    broker.stop().await;
}

/// The binary with `args` at `addr` over TLS trusting `ca_file`: its exit
/// status, stdout (trimmed), stderr and the arguments.
async fn run_cli(
    args: Vec<String>,
    addr: String,
    ca_file: String,
) -> (Option<i32>, String, String, Vec<String>) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"));
    command
        .args(&args)
        .args(["--addr", &addr, "--ca-file", &ca_file])
        .env("BROKER_LOG", "warn")
        .kill_on_drop(true);
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), command.output())
        .await
        .expect("the CLI ends")
        .expect("the CLI runs");
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stdout, stderr, args)
}
