//! `bench --latency`: what one caller pays per RPC. A single caller runs
//! a contract's whole life against the in-process broker, again and
//! again — OpenRoot, Delegate (naming a host), Accept, RecordReceipts
//! (the host's observation), GetContract, GetBrokerKeys (no store: the
//! RPC's own price), Complete, then a second Delegate and its Revoke —
//! timing each call. Just before, with the
//! broker idle, the floor under any durable answer is measured: on SQLite
//! `disk-probe` in the broker's own data directory at a low rate; on
//! PostgreSQL (`--database`) one caller's one-row commits on the same
//! server. Each RPC's p50 and p99 are printed with their margin over that
//! floor, measured in the same run. On SQLite the store's own floor is
//! measured too (`store-probe` at the same rate: `bench`'s rows through
//! the writer's statements and a syncer on a scratch database, no RPC),
//! and with the RPC's price (GetBrokerKeys) it gives the least a
//! Delegate could take on this machine and store.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use broker_client::{Agent, BrokerError, Link};
use broker_wire::clock::{Clock, SystemClock};
use broker_wire::pb;

use super::{BenchArgs, Servers, bench_root, delegate_body, percentile_ms};

/// The probes' arrival rate beside one caller (`disk-probe`, then
/// `store-probe`): a rate of its order, low enough that each fsync
/// serves about one request.
const PROBE_RATE_PER_S: u64 = 400;
/// Each probe's seconds.
const PROBE_DURATION_S: u64 = 3;

/// The store's phases (`store::phases`) over one kind of call.
type Phases = [broker_store::phases::PhaseSnapshot; 5];

/// Each RPC's latencies, µs, by name, and the in-process store's phases
/// over its calls: one caller runs one call at a time, so the phases
/// recorded while a call was in flight are that call's.
#[derive(Default)]
struct Samples {
    us: BTreeMap<&'static str, Vec<u32>>,
    store: BTreeMap<&'static str, Phases>,
}

/// The agents of one contract's life: the orchestrator, the delegate and
/// its host, each with its own link to the broker.
struct Parties {
    orchestrator: Link,
    delegate: Link,
    host: Link,
    attestor: Agent,
}

/// Times `call`, recording it under `name` when `record`.
async fn timed<T>(
    samples: &mut Samples,
    name: &'static str,
    record: bool,
    call: impl std::future::Future<Output = Result<T, BrokerError>>,
) -> anyhow::Result<T> {
    let before = record.then(super::store_phases);
    let began = Instant::now();
    let answer = call.await.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let took = began.elapsed();
    if let Some(before) = before {
        let us = u32::try_from(took.as_micros()).unwrap_or(u32::MAX);
        samples.us.entry(name).or_default().push(us);
        let after = super::store_phases();
        let total = samples.store.entry(name).or_default();
        *total = std::array::from_fn(|i| total[i].plus(&after[i].minus(&before[i])));
    }
    Ok(answer)
}

/// One contract's life (see the module docs), each call timed.
async fn round(parties: &Parties, samples: &mut Samples, record: bool) -> anyhow::Result<()> {
    let intent = "benchmark: one caller's latency".to_owned();
    let lineage = broker_wire::crypto::sha256(intent.as_bytes()).to_vec();
    let open = parties.orchestrator.call(bench_root(&intent, 2, 16), None);
    let root = match timed(samples, "OpenRoot", record, open).await?.issued {
        Some(issued) => issued.contract_id,
        None => anyhow::bail!("OpenRoot: the bench root was refused"),
    };
    let expires_at_ms = SystemClock.now_ms() + 3_600_000;
    let issue = async |delegate: &Agent, host: Option<&Agent>, samples: &mut Samples| {
        let attestation =
            parties
                .attestor
                .attest(delegate.public_key(), 0.99, expires_at_ms, "bench");
        let mut body = delegate_body(
            &root,
            &lineage,
            "part of src/".into(),
            delegate,
            &attestation,
            10,
        );
        body.host_public_key = host.map(|h| h.public_key().to_vec()).unwrap_or_default();
        let sent = parties.orchestrator.call(body, None);
        match timed(samples, "Delegate", record, sent).await?.outcome {
            Some(pb::delegate_response::Outcome::Issued(issued)) => Ok(issued.contract_id),
            other => anyhow::bail!("Delegate: not issued: {other:?}"),
        }
    };
    let child = issue(&parties.delegate.agent, Some(&parties.host.agent), samples).await?;
    let accept = pb::AcceptBody {
        header: None,
        contract_id: child.clone(),
        host_public_key: Vec::new(),
    };
    timed(
        samples,
        "Accept",
        record,
        parties.delegate.call(accept, None),
    )
    .await?;
    let observed = pb::RecordReceiptsBody {
        header: None,
        contract_id: child.clone(),
        observations: vec![pb::Observation {
            kind: pb::ObservationKind::ToolCall as i32,
            path: String::new(),
            tool: "read_file".into(),
            units: 1,
            at_ms: SystemClock.now_ms(),
            ..Default::default()
        }],
    };
    let record_call = parties.host.call(observed, None);
    timed(samples, "RecordReceipts", record, record_call).await?;
    let read = parties.orchestrator.contract(&child);
    timed(samples, "GetContract", record, read).await?;
    // A read the store has no part in: the RPC's own price.
    let keys = parties.orchestrator.read(|mut client| async move {
        client.get_broker_keys(pb::GetBrokerKeysRequest {}).await
    });
    timed(samples, "GetBrokerKeys", record, keys).await?;
    let complete = pb::CompleteBody {
        header: None,
        contract_id: child,
        output_json: "{}".into(),
        report: None,
        claim: "done".into(),
        consumed: 1,
    };
    timed(
        samples,
        "Complete",
        record,
        parties.delegate.call(complete, None),
    )
    .await?;
    let other = issue(&Agent::generate(), None, samples).await?;
    let revoke = pb::RevokeBody {
        header: None,
        contract_id: other,
        reason: "bench: revoked".into(),
    };
    timed(
        samples,
        "Revoke",
        record,
        parties.orchestrator.call(revoke, None),
    )
    .await?;
    Ok(())
}

/// Per RPC, the in-process store's share of its time at the median: the
/// whole store command and, on SQLite, its batch (plan, script, commit)
/// and its wait for the WAL's fsync.
/// The rest of a call's time is outside the store: RPC, signatures,
/// reads, hand-offs between threads.
fn report_store_share(store: &BTreeMap<&'static str, Phases>) {
    if store.values().all(|p| p[0].count() == 0) {
        return;
    }
    println!("store's share at the median, ms (bucket bounds, at most 1/8 over):");
    for (name, [submitted, _, batch, sync, _]) in store {
        let p50 = |p: &broker_store::phases::PhaseSnapshot| {
            p.quantile_us(0.5).unwrap_or(0) as f64 / 1000.0
        };
        if submitted.count() == 0 {
            continue;
        }
        // PostgreSQL's writers keep no batch or fsync phases.
        let phases = if batch.count() == 0 {
            String::new()
        } else {
            format!("  batch {:.2}  fsync wait {:.2}", p50(batch), p50(sync))
        };
        println!("  {name:<15} store {:.2}{phases}", p50(submitted));
    }
}

/// `store-probe` in `dir` at the probes' rate: each contract's latency,
/// sorted, µs.
async fn store_floor(dir: &std::path::Path) -> anyhow::Result<Vec<u32>> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        crate::store_probe::request_floor(&dir, PROBE_RATE_PER_S, PROBE_DURATION_S)
    })
    .await?
}

/// `disk-probe` in `dir`: each request's latency, sorted, µs.
async fn disk_floor(dir: &std::path::Path) -> anyhow::Result<Vec<u32>> {
    let probe_args = crate::disk_probe::DiskProbeArgs {
        dir: dir.to_owned(),
        rate: PROBE_RATE_PER_S,
        bytes_per_request: crate::disk_probe::DEFAULT_BYTES_PER_REQUEST,
        duration_s: PROBE_DURATION_S,
        stall_ms: 5,
    };
    let path = dir.join(format!("latency-probe-{}.tmp", std::process::id()));
    let report = tokio::task::spawn_blocking(move || {
        crate::disk_probe::probe(&path, &probe_args, Duration::from_millis(5))
    })
    .await??;
    Ok(report.latencies_us)
}

/// The disk's floor, then rounds for `--duration-s` after `--warmup-s`.
pub async fn drive(args: BenchArgs, servers: &dyn Servers) -> anyhow::Result<()> {
    let attestor = Agent::generate();
    let (addr, _, in_process) = super::start_in_process(&args, &attestor, servers).await?;
    let channel = tonic::transport::Endpoint::from_shared(addr)?
        .connect()
        .await?;
    let parties = Parties {
        orchestrator: Link::new(Agent::generate(), channel.clone()),
        delegate: Link::new(Agent::generate(), channel.clone()),
        host: Link::new(Agent::generate(), channel),
        attestor,
    };
    let dir = in_process.2.clone();
    let (floor, floor_name) = match &args.database {
        Some(url) => (
            broker_store::postgres::probe::one_row_commits(
                url,
                Duration::from_secs(PROBE_DURATION_S),
            )
            .await?,
            "PostgreSQL one-row commit floor (same server, one caller, just before the rounds)"
                .to_owned(),
        ),
        None => (
            disk_floor(&dir).await?,
            format!(
                "disk request floor (disk-probe at {PROBE_RATE_PER_S}/s, same directory, before the rounds)"
            ),
        ),
    };
    let (floor_p50, floor_p99) = (percentile_ms(&floor, 0.50), percentile_ms(&floor, 0.99));
    // Extra information: a probe that fails is said, not fatal.
    let store_floor = match &args.database {
        Some(_) => None,
        None => store_floor(&dir)
            .await
            .inspect_err(|e| println!("store request floor: not measured ({e:#})"))
            .ok(),
    };
    let mut samples = Samples::default();
    let measure_from = Instant::now() + Duration::from_secs(args.warmup_s);
    let stop_at = measure_from + Duration::from_secs(args.duration_s);
    let mut rounds = 0u64;
    while Instant::now() < stop_at {
        let record = Instant::now() >= measure_from;
        round(&parties, &mut samples, record).await?;
        rounds += u64::from(record);
    }
    let store = match &args.database {
        Some(_) => "PostgreSQL".to_owned(),
        None => format!("SQLite in {}", dir.display()),
    };
    println!(
        "one caller, {store}: {rounds} rounds in {}s",
        args.duration_s
    );
    println!("{floor_name}: p50 {floor_p50:.2} ms  p99 {floor_p99:.2} ms");
    for (name, us) in &mut samples.us {
        us.sort_unstable();
        let (p50, p99) = (percentile_ms(us, 0.50), percentile_ms(us, 0.99));
        println!(
            "{name:<15} p50 {p50:.2} ms ({:+.2} over the floor)  p99 {p99:.2} ms ({:+.2})  n={}",
            p50 - floor_p50,
            p99 - floor_p99,
            us.len()
        );
    }
    if let (Some(store_floor), Some(rpc)) = (&store_floor, samples.us.get("GetBrokerKeys")) {
        let (store_p50, rpc_p50) = (percentile_ms(store_floor, 0.50), percentile_ms(rpc, 0.50));
        println!(
            "store request floor (store-probe at {PROBE_RATE_PER_S}/s: bench's rows, a Delegate's and a root's, through the writer's statements and a syncer on a scratch database; no RPC, signature, rule or hand-off): p50 {store_p50:.2} ms  p99 {:.2} ms",
            percentile_ms(store_floor, 0.99)
        );
        println!(
            "least a Delegate could take here (p50 + p50: the RPC's price, GetBrokerKeys, and the store's floor; its signatures not counted): p50 {:.2} ms ({:+.2} over the disk's floor)",
            rpc_p50 + store_p50,
            rpc_p50 + store_p50 - floor_p50
        );
    }
    report_store_share(&samples.store);
    super::stop_in_process(in_process).await
}
