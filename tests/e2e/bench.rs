//! `bench` from outside: the broker and `--floor` issue delegations with
//! no errors, and the floor answers only what it measures; `--tokens` and
//! `--latency` (on SQLite and PostgreSQL) run every phase and print what
//! they measured. No time is asserted (BENCHMARKS.md holds the numbers).

use std::process::Command;

/// Runs `bench` for one measured second, no warm-up, with `flags`; its
/// output, once it exited 0.
async fn bench_output(flags: &[&str]) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args(["bench", "--duration-s", "1", "--warmup-s", "0"])
        .args(flags)
        .env("BROKER_LOG", "warn")
        .output()
        .await
        .expect("bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bench {flags:?} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `bench` for one measured second with `extra` flags; returns the
/// delegations it reports issued and its errors.
fn bench(extra: &[&str]) -> (u64, u64, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
        .args([
            "bench",
            "--duration-s",
            "1",
            "--warmup-s",
            "0",
            "--concurrency",
            "4",
            "--connections",
            "1",
            "--depth",
            "3",
        ])
        .args(extra)
        .env("BROKER_LOG", "warn")
        .output()
        .expect("bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bench {extra:?} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("delegations: "))
        .unwrap_or_else(|| panic!("no delegations line in {stdout}"));
    let number_after = |label: &str| -> u64 {
        let at = line
            .find(label)
            .unwrap_or_else(|| panic!("{label} in {line}"))
            + label.len();
        line[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or_else(|_| panic!("a number after {label} in {line}"))
    };
    (
        number_after("delegations: "),
        number_after("errors "),
        stdout,
    )
}

#[test]
fn the_floor_and_the_broker_issue_the_same_workload() {
    let (floor, floor_errors, floor_out) = bench(&["--floor"]);
    assert!(floor > 0 && floor_errors == 0, "{floor_out}");
    assert!(floor_out.contains("against the floor"), "{floor_out}");
    let (broker, broker_errors, broker_out) = bench(&[]);
    assert!(broker > 0 && broker_errors == 0, "{broker_out}");
    assert!(!broker_out.contains("against the floor"), "{broker_out}");
}

#[test]
fn the_floor_takes_no_other_flag_that_needs_a_broker() {
    for flag in ["--hot-parent", "--telemetry"] {
        let out = Command::new(env!("CARGO_BIN_EXE_delegation-broker"))
            .args(["bench", "--floor", flag])
            .output()
            .expect("bench runs");
        assert!(!out.status.success(), "--floor {flag} must be refused");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("cannot be used with"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `bench --tokens` mints, introspects and delegates with no failure, and
/// its closing check (a revoked leaf's token is inactive at the next
/// introspection) holds: the process exits 0 only then.
#[tokio::test]
async fn the_token_bench_mints_and_introspects_and_sees_a_revocation() {
    let stdout = bench_output(&["--tokens", "--concurrency", "2", "--depth", "2"]).await;
    for phase in ["mint: ", "introspect (active): ", "delegate: "] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(phase))
            .unwrap_or_else(|| panic!("no {phase:?} line in {stdout}"));
        assert!(line.contains("(failed 0)"), "{line}");
        let calls: u64 = line[phase.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or(0);
        assert!(calls > 0, "{line}");
    }
    assert!(
        stdout.contains("the next introspection answers active=false"),
        "{stdout}"
    );
}

/// `bench --latency` times every RPC of a contract's life at one caller
/// and prints each beside the disk's floor and the store's from the same
/// run.
#[tokio::test]
async fn the_latency_bench_times_each_rpc_beside_the_disk() {
    let stdout = bench_output(&["--latency"]).await;
    assert!(stdout.contains("disk request floor"), "{stdout}");
    // The store's own floor, and with the RPC's price the least a
    // Delegate could take: both measured, so both non-zero.
    for floor in ["store request floor", "least a Delegate could take here"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(floor))
            .unwrap_or_else(|| panic!("no {floor} line in {stdout}"));
        assert!(!line.contains("p50 0.00 ms"), "{line}");
    }
    for rpc in [
        "OpenRoot",
        "Delegate",
        "Accept",
        "RecordReceipts",
        "GetContract",
        "GetBrokerKeys",
        "Complete",
        "Revoke",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{rpc} ")))
            .unwrap_or_else(|| panic!("no {rpc} line in {stdout}"));
        assert!(
            line.contains("over the floor") && !line.ends_with("n=0"),
            "{line}"
        );
    }
    // The store's share of each durable call, from its own phases.
    assert!(stdout.contains("store's share at the median"), "{stdout}");
    for durable in [
        "OpenRoot",
        "Delegate",
        "Accept",
        "RecordReceipts",
        "Complete",
        "Revoke",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{durable} ")) && l.contains("batch"))
            .unwrap_or_else(|| panic!("no store share for {durable} in {stdout}"));
        assert!(line.contains("fsync wait"), "{line}");
    }
}

/// `bench --latency --database URL`: the same rounds on PostgreSQL, beside
/// a plain one-row commit on the same server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latency_bench_runs_on_postgresql_beside_a_plain_commit() {
    let database = delegation_broker::store::postgres::testing::TestDatabase::migrated().await;
    let stdout = bench_output(&["--latency", "--database", &database.url]).await;
    assert!(stdout.contains("one caller, PostgreSQL"), "{stdout}");
    assert!(
        stdout.contains("PostgreSQL one-row commit floor"),
        "{stdout}"
    );
    let delegate = stdout
        .lines()
        .find(|l| l.starts_with("Delegate "))
        .unwrap_or_else(|| panic!("no Delegate line in {stdout}"));
    assert!(delegate.contains("over the floor"), "{delegate}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim_start().starts_with("Delegate ") && l.contains("store ")),
        "no store share for Delegate: {stdout}"
    );
}
