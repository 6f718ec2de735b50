//! What `serve` says when it cannot start: each cause once, naming the
//! flag, the file or the address it concerns.

use std::time::Duration;

/// Longest a failing start may take (it fails before serving anything).
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// `serve` with `args`, which must fail; its stderr.
async fn serve_fails(args: &[&str]) -> String {
    let data = tempfile::tempdir().expect("a folder");
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"));
    command
        .arg("serve")
        .arg("--data-dir")
        .arg(data.path())
        .args(args)
        .env("BROKER_LOG", "error")
        .env_remove("BROKER_DATABASE_URL")
        .kill_on_drop(true);
    let out = tokio::time::timeout(RUN_LIMIT, command.output())
        .await
        .expect("serve ends")
        .expect("serve runs");
    assert_eq!(out.status.code(), Some(1), "{args:?} did not fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn a_start_that_cannot_happen_says_why_once() {
    let missing = serve_fails(&["--config", "/nonexistent/broker.toml"]).await;
    assert_eq!(
        missing.trim(),
        "error: cannot read /nonexistent/broker.toml: No such file or directory (os error 2)"
    );

    let folder = tempfile::tempdir().expect("a folder");
    let bad = folder.path().join("bad.toml");
    std::fs::write(&bad, "bogus = [\n").expect("a file");
    let unparsed = serve_fails(&["--config", bad.to_str().expect("a path")]).await;
    assert!(
        unparsed.starts_with(&format!("error: {}: TOML parse error", bad.display())),
        "{unparsed}"
    );
    assert_eq!(
        unparsed.matches("TOML parse error").count(),
        1,
        "{unparsed}"
    );

    let mysql = serve_fails(&["--database-url", "mysql://broker@db/broker"]).await;
    assert!(
        mysql.contains("the scheme \"mysql\" is not postgres://"),
        "{mysql}"
    );

    let console = serve_fails(&["--listen", "127.0.0.1:0", "--console", "127.0.0.1:0"]).await;
    assert!(
        console.contains(
            "--console needs [console] reader = \"<hex public key>\" in the configuration"
        ),
        "{console}"
    );

    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let address = taken.local_addr().expect("its address").to_string();
    let in_use = serve_fails(&["--listen", &address]).await;
    assert!(
        in_use.contains(&format!(
            "--listen {address}: cannot listen: Address already in use"
        )),
        "{in_use}"
    );
}

/// `verify` names a file it cannot read.
#[tokio::test]
async fn verify_names_a_file_it_cannot_read() {
    let key = "11".repeat(32);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args([
            "verify",
            "--public-key",
            &key,
            "--chain",
            "/nonexistent/chain.bin",
        ])
        .output()
        .await
        .expect("the CLI runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot read /nonexistent/chain.bin: No such file or directory"),
        "{stderr}"
    );
}
