//! `store-probe`: the store's own floor under `bench`'s workload — the
//! CPU SQLite and the kernel take to commit its rows durably with this
//! schema, with no RPC, signature or rule (`store::sqlite::probe`). Read
//! beside `bench --floor`: a broker's CPU per delegation is at least the
//! two together, which bounds its share of the floor.

use crate::seeded::SplitMix64;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use broker_domain::{AgentKey, Id, Ledger, Liability, Policy, Status};
use broker_store::batch::{ContractRow, OUTCOME_ISSUED, Plan, RequestRow};
use broker_store::sqlite::probe::{self, StoreProbeOptions};

/// Most workers (chains in flight): each holds its agents' keys.
const MAX_WORKERS: usize = 4_096;
/// Deepest chain (as `bench --depth`).
const MAX_DEPTH: u32 = 64;

#[derive(Args, Debug)]
pub struct StoreProbeArgs {
    /// Directory on the disk to probe (the broker's data directory): a
    /// scratch database is written there and removed afterwards.
    #[arg(long, env = "BROKER_DATA_DIR", default_value = "broker-data")]
    pub dir: PathBuf,
    /// Chains in flight (as `bench --concurrency`).
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Delegations per chain (as `bench --depth`).
    #[arg(long, default_value_t = 8)]
    pub depth: u32,
    /// Contracts per commit and fsync: `bench`'s commands per WAL fsync
    /// (it prints both; about 13 in a closed loop of 64 on two cores).
    #[arg(long, default_value_t = 16)]
    pub group: usize,
    /// Open loop: contracts arriving per second, each commit taking all
    /// that have arrived (up to --workers), each one's latency counted to
    /// the end of its fsync (as `disk-probe --rate`). 0: fixed groups of
    /// --group, as fast as the writer goes (the CPU floor).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Contracts to write, roots included (as many as the `bench` run
    /// being compared committed: the B-trees' size sets their cost).
    #[arg(long, default_value_t = 60_000)]
    pub contracts: u64,
    /// Drop this index first, to price it (repeatable).
    #[arg(long = "drop-index")]
    pub drop_indexes: Vec<String>,
    /// The WAL's restart size, MiB (the broker's `limits.wal_restart_mib`).
    #[arg(long, default_value_t = broker_store::sqlite::WAL_RESTART_BYTES / (1024 * 1024))]
    pub wal_restart_mib: u64,
    /// Leave the request log out, to price its random-keyed B-tree.
    #[arg(long)]
    pub no_request_log: bool,
    /// After every commit hand the connection back to sqlx's worker and
    /// take it again, the WAL's finish through sqlx when due (as the
    /// writer takes it back after each batch that goes through sqlx):
    /// prices the hand-over, and counts the takes sqlx did not answer in
    /// 50 ms and that were asked again (sqlx 0.9 loses one now and then
    /// right after a finish through it: 1–7 in 60,000 commits of one).
    #[arg(long)]
    pub hand_over: bool,
}

pub fn run(args: StoreProbeArgs) -> anyhow::Result<()> {
    let report = probe_store(&args)?;
    print_report(&args, &report);
    Ok(())
}

/// `store-probe --rate` beside one caller (`bench --latency`): `bench`'s
/// contracts arriving at `rate_per_s` for `duration_s` in `dir`, each
/// one's latency from its arrival to the end of its commit's fsync, µs,
/// sorted. What a durable Delegate's write costs on this store alone —
/// the writer's wake, its statements, the syncer's fsync — with no RPC,
/// signature or rule.
pub fn request_floor(
    dir: &std::path::Path,
    rate_per_s: u64,
    duration_s: u64,
) -> anyhow::Result<Vec<u32>> {
    let args = StoreProbeArgs {
        dir: dir.to_owned(),
        workers: 64,
        depth: 8,
        group: 16,
        rate: rate_per_s.max(1),
        contracts: rate_per_s.max(1).saturating_mul(duration_s.max(1)),
        drop_indexes: Vec::new(),
        wal_restart_mib: broker_store::sqlite::WAL_RESTART_BYTES / (1024 * 1024),
        no_request_log: false,
        hand_over: false,
    };
    Ok(probe_store(&args)?.latency_us)
}

/// Runs the probe on a scratch database in `args.dir`, removed afterwards.
fn probe_store(args: &StoreProbeArgs) -> anyhow::Result<probe::StoreProbeReport> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let path = args
        .dir
        .join(format!("store-probe-{}.sqlite3", std::process::id()));
    anyhow::ensure!(
        (1..=MAX_WORKERS).contains(&args.workers),
        "--workers must be 1..={MAX_WORKERS}"
    );
    anyhow::ensure!(
        (1..=MAX_DEPTH).contains(&args.depth),
        "--depth must be 1..={MAX_DEPTH}"
    );
    // Each worker has one request in flight in a closed loop, so a group
    // never holds two steps of one chain (a parent and its child).
    anyhow::ensure!(
        (1..=args.workers).contains(&args.group),
        "--group must be 1..=--workers"
    );
    let options = StoreProbeOptions {
        path: path.clone(),
        group: args.group,
        max_group: args.workers,
        rate_per_s: (args.rate > 0).then_some(args.rate),
        contracts: args.contracts,
        drop_indexes: args.drop_indexes.clone(),
        wal_restart_bytes: args.wal_restart_mib.saturating_mul(1024 * 1024),
        hand_over: args.hand_over,
    };
    let mut workload = Workload::new(args);
    let report = probe::run(&options, &mut |n, now_ms| workload.group(n, now_ms));
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.clone().into_os_string();
        name.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(name));
    }
    Ok(report?)
}

/// What the probe measured, as `bench` prints its own.
fn print_report(args: &StoreProbeArgs, report: &probe::StoreProbeReport) {
    let delegations = report.contracts - report.roots;
    let per = |total: f64| total / delegations.max(1) as f64;
    let shape = if args.rate > 0 {
        format!("arriving at {}/s", args.rate)
    } else {
        format!("in groups of {}", args.group)
    };
    println!(
        "store probe: {} contracts ({} roots) {shape}, {} commits over {:.1}s in {}{}{}{}",
        report.contracts,
        report.roots,
        report.commits,
        report.wall.as_secs_f64(),
        args.dir.display(),
        if args.drop_indexes.is_empty() {
            String::new()
        } else {
            format!(", without {}", args.drop_indexes.join(", "))
        },
        if args.no_request_log {
            ", no request log"
        } else {
            ""
        },
        if args.hand_over {
            ", the connection handed over between commits"
        } else {
            ""
        },
    );
    let pace = if args.rate > 0 {
        "paced by the arrivals"
    } else {
        "as fast as one writer goes"
    };
    println!(
        "store floor: {:.1} µs of CPU per delegation (roots counted in, as `bench` counts its CPU); \
         {:.0} delegations/s, {pace}",
        per(report.cpu.as_secs_f64() * 1e6),
        delegations as f64 / report.wall.as_secs_f64().max(1e-9),
    );
    println!(
        "WAL: {:.2} frames ({:.1} KiB) per delegation",
        per(report.wal_frames as f64),
        per((report.wal_frames * (report.page_bytes + WAL_FRAME_HEADER_BYTES)) as f64) / 1024.0,
    );
    crate::disk_probe::print_percentiles("commit ms:  ", &report.commit_us);
    crate::disk_probe::print_percentiles("fsync ms:   ", &report.fsync_us);
    if !report.latency_us.is_empty() {
        crate::disk_probe::print_percentiles("queued ms:  ", &report.queued_us);
        crate::disk_probe::print_percentiles("request floor ms:", &report.latency_us);
    }
    println!(
        "{} fsyncs; the writer finished {} checkpoints (its stalls), ms: {}",
        report.fsync_us.len(),
        report.finish_us.len(),
        report
            .finish_us
            .iter()
            .map(|us| format!("{:.1}", f64::from(*us) / 1000.0))
            .collect::<Vec<_>>()
            .join(" "),
    );
    if args.hand_over {
        println!(
            "takes of the connection abandoned after {} ms and asked again: {}",
            broker_store::limits::sqlite::HANDLE_WAIT.as_millis(),
            report.retakes
        );
    }
}

/// Bytes SQLite writes before each page in the WAL.
const WAL_FRAME_HEADER_BYTES: u64 = 24;

/// Bytes of a depth-8 chain's signed envelope in `bench` (measured from
/// its database: 381 on average).
const ENVELOPE_BYTES: usize = 381;
/// `bench`'s effective predicate at every depth (45 bytes).
const PREDICATE: &str = "(result.schema_valid && result.within_scope\n)";
/// `bench`'s write scope and a root's labels.
const WRITE_SCOPE_JSON: &str = "[\"src\"]";
const ROOT_LABELS_JSON: &str = "{\"tool\":\"bench\"}";
const CHILD_LABELS_JSON: &str = "{}";
/// A root's budget: halved at every level (never below one unit).
const ROOT_BUDGET: i64 = 1 << 40;
/// A contract's deadline after its issuance (an hour).
const DEADLINE_AFTER_MS: i64 = 3_600_000;

/// `bench`'s chains, one per worker: a root, then `depth` delegations
/// each from the last, then a new root. Contracts are never ended (as in
/// `bench`), so every one stays in the open-contract indexes.
struct Workload {
    rng: SplitMix64,
    workers: Vec<Chain>,
    depth: u32,
    next_seq: i64,
    /// The worker whose step comes next (round-robin, as a closed loop's
    /// requests arrive).
    turn: usize,
    /// `StoreProbeOptions::no_request_log`.
    no_request_log: bool,
}

struct Chain {
    /// The worker's agents, reused by every chain: the orchestrator, then
    /// one delegate per depth (as `bench`).
    agents: Vec<AgentKey>,
    /// The root and the last contract of the chain now growing, with the
    /// last one's ledger; `None` before the first root and after the
    /// deepest delegation.
    root: Option<(i64, Id)>,
    last: Option<(i64, Id, u32, Ledger)>,
}

impl Workload {
    fn new(args: &StoreProbeArgs) -> Self {
        let mut rng = SplitMix64(0x5eed_0fb4_0ce5);
        let workers = (0..args.workers)
            .map(|_| Chain {
                agents: (0..=args.depth).map(|_| rng.bytes32()).collect(),
                root: None,
                last: None,
            })
            .collect();
        Self {
            rng,
            workers,
            depth: args.depth,
            // A fresh database's first.
            next_seq: 1,
            turn: 0,
            no_request_log: args.no_request_log,
        }
    }

    /// The next `n` steps (n ≤ workers, so each from a different chain)
    /// as the writer's plan would hold them.
    fn group(&mut self, n: usize, now_ms: i64) -> Plan {
        let mut plan = Plan::default();
        for _ in 0..n {
            let w = self.turn;
            self.turn = (self.turn + 1) % self.workers.len();
            let seq = self.next_seq;
            self.next_seq += 1;
            let id = self.rng.bytes32();
            let mut envelope = vec![0u8; ENVELOPE_BYTES];
            self.rng.fill(&mut envelope);
            let depth_limit = self.depth;
            let chain = &mut self.workers[w];
            let (parent, root, depth, budget, requester) = match chain.last.take() {
                Some((pseq, pid, pdepth, mut ledger)) => {
                    // Half of a childless parent's budget, at least one
                    // unit: within its residual, so the core never refuses.
                    let budget = (ledger.budget / 2).max(1);
                    ledger
                        .reserve(budget)
                        .expect("half of a childless budget fits its residual");
                    plan.states.push((pseq, ledger));
                    let root = chain.root.unwrap_or((seq, id));
                    (
                        Some((pseq, pid)),
                        root,
                        pdepth + 1,
                        budget,
                        chain.agents[pdepth as usize],
                    )
                }
                None => (None, (seq, id), 0, ROOT_BUDGET, chain.agents[0]),
            };
            let ledger = Ledger::new(budget);
            chain.root = Some(root);
            chain.last = (depth < depth_limit).then_some((seq, id, depth, ledger));
            let is_root = parent.is_none();
            plan.contracts.push(ContractRow {
                seq,
                id,
                parent,
                root_seq: root.0,
                root_id: root.1,
                depth,
                delegate_key: chain.agents[depth as usize],
                liability: Liability::Delegate,
                intent_lineage_hash: self.rng.bytes32(),
                cumulative_trust_ppm: 1_000_000,
                effective_predicate: PREDICATE.to_owned(),
                deadline_ms: now_ms + DEADLINE_AFTER_MS,
                write_scope_json: WRITE_SCOPE_JSON.to_owned(),
                policy: Policy {
                    max_depth: depth_limit,
                    min_cumulative_trust_ppm: 500_000,
                    max_children: 16,
                    retry_headroom: true,
                    require_host: false,
                },
                envelope,
                issued_at_ms: now_ms,
                host_key: None,
                trace: None,
                labels_json: if is_root {
                    ROOT_LABELS_JSON
                } else {
                    CHILD_LABELS_JSON
                }
                .to_owned(),
                run_labels: if is_root {
                    vec![("tool".into(), "bench".into())]
                } else {
                    Vec::new()
                },
                status: Status::Open,
                ledger,
            });
            if !self.no_request_log {
                let mut nonce = vec![0u8; 16];
                self.rng.fill(&mut nonce);
                plan.requests.push(RequestRow {
                    agent: requester,
                    nonce,
                    digest: self.rng.bytes32(),
                    outcome: OUTCOME_ISSUED,
                    ref_id: id,
                    at_ms: now_ms,
                });
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_store::StoreError;
    use sqlx::Connection;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

    fn args() -> StoreProbeArgs {
        StoreProbeArgs {
            dir: PathBuf::new(),
            workers: 8,
            depth: 3,
            group: 4,
            rate: 0,
            contracts: 192,
            drop_indexes: vec!["contracts_held_by_delegate".into()],
            no_request_log: false,
            wal_restart_mib: 16,
            hand_over: false,
        }
    }

    fn options(path: PathBuf, rate_per_s: Option<u64>) -> StoreProbeOptions {
        let args = args();
        StoreProbeOptions {
            path,
            group: args.group,
            max_group: args.workers,
            rate_per_s,
            contracts: args.contracts,
            drop_indexes: args.drop_indexes,
            wal_restart_bytes: args.wal_restart_mib << 20,
            hand_over: args.hand_over,
        }
    }

    fn probe(options: &StoreProbeOptions) -> Result<probe::StoreProbeReport, StoreError> {
        let mut workload = Workload::new(&args());
        probe::run(options, &mut |n, now_ms| workload.group(n, now_ms))
    }

    async fn count(conn: &mut SqliteConnection, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(conn)
            .await
            .expect(sql)
    }

    /// The probe writes what `bench` would have the broker write: every
    /// chain a root and `depth` delegations, each with its envelope and
    /// request log entry, every parent's ledger holding its children.
    #[test]
    fn a_probe_writes_bench_shaped_chains_whose_ledgers_add_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Fixed groups, the open loop, and fixed groups with the
        // connection handed to sqlx and taken back between commits.
        for (rate, hand_over) in [(None, false), (Some(2_000), false), (None, true)] {
            let path = dir
                .path()
                .join(format!("probe-{}-{hand_over}.sqlite3", rate.unwrap_or(0)));
            let report = probe(&StoreProbeOptions {
                hand_over,
                ..options(path.clone(), rate)
            })
            .expect("probe");
            // 8 workers in turn, each 24 steps: 6 chains of a root and 3
            // delegations.
            assert_eq!((report.contracts, report.roots), (192, 48), "{rate:?}");
            assert!(report.wal_frames > 0 && report.page_bytes > 0);
            assert!(!report.fsync_us.is_empty() && report.fsync_us.is_sorted());
            match rate {
                None => {
                    assert_eq!(report.commits, 48, "groups of 4");
                    assert!(report.latency_us.is_empty() && report.queued_us.is_empty());
                }
                Some(_) => {
                    assert!((1..=192).contains(&report.commits));
                    assert_eq!(report.latency_us.len(), 192, "one latency per contract");
                    assert_eq!(report.queued_us.len(), 192);
                }
            }
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let mut conn = SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(&path))
                    .await
                    .expect("connect");
                for (sql, want) in [
                    ("SELECT COUNT(*) FROM contracts", 192),
                    ("SELECT COUNT(*) FROM contracts WHERE parent_seq IS NULL", 48),
                    ("SELECT COUNT(*) FROM contract_envelopes", 192),
                    ("SELECT COUNT(*) FROM requests", 192),
                    ("SELECT COUNT(*) FROM run_labels", 48),
                    ("SELECT MAX(depth) FROM contracts", 3),
                    // Each parent reserves exactly its children's budgets,
                    // and counts them.
                    (
                        "SELECT COUNT(*) FROM contracts p WHERE reserved != \
                         (SELECT COALESCE(SUM(budget), 0) FROM contracts c WHERE c.parent_seq = p.seq) \
                         OR open_children != (SELECT COUNT(*) FROM contracts c WHERE c.parent_seq = p.seq) \
                         OR budget < reserved + spent",
                        0,
                    ),
                    // Every request names the contract it issued.
                    (
                        "SELECT COUNT(*) FROM requests r JOIN contracts c ON c.id = r.ref_id",
                        192,
                    ),
                    (
                        "SELECT COUNT(*) FROM sqlite_master WHERE name = 'contracts_held_by_delegate'",
                        0,
                    ),
                ] {
                    assert_eq!(count(&mut conn, sql).await, want, "{rate:?}: {sql}");
                }
            });
        }
    }

    /// At `bench`'s deepest, budgets halve to one unit and stay there:
    /// every reservation still fits its parent's residual.
    #[test]
    fn a_chain_as_deep_as_bench_allows_keeps_its_ledgers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("deep.sqlite3");
        let args = StoreProbeArgs {
            workers: 1,
            depth: MAX_DEPTH,
            group: 1,
            contracts: 2 * (u64::from(MAX_DEPTH) + 1),
            drop_indexes: Vec::new(),
            ..args()
        };
        let options = StoreProbeOptions {
            contracts: args.contracts,
            group: 1,
            max_group: 1,
            drop_indexes: Vec::new(),
            ..options(path.clone(), None)
        };
        let mut workload = Workload::new(&args);
        let report =
            probe::run(&options, &mut |n, now_ms| workload.group(n, now_ms)).expect("probe");
        assert_eq!((report.contracts, report.roots), (args.contracts, 2));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut conn =
                SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(&path))
                    .await
                    .expect("connect");
            for (sql, want) in [
                ("SELECT MAX(depth) FROM contracts", i64::from(MAX_DEPTH)),
                ("SELECT MIN(budget) FROM contracts", 1),
                (
                    "SELECT COUNT(*) FROM contracts p WHERE reserved != \
                     (SELECT COALESCE(SUM(budget), 0) FROM contracts c WHERE c.parent_seq = p.seq) \
                     OR budget < reserved + spent",
                    0,
                ),
            ] {
                assert_eq!(count(&mut conn, sql).await, want, "{sql}");
            }
        });
    }

    #[test]
    fn a_probe_refuses_what_it_cannot_measure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fresh = |name: &str| options(dir.path().join(name), None);
        let refused = |o: StoreProbeOptions| match probe(&o) {
            Err(StoreError::Backend(message)) => message,
            other => panic!("{o:?}: {other:?}"),
        };
        let mut key = fresh("key.sqlite3");
        key.drop_indexes = vec!["sqlite_autoindex_contracts_1".into()];
        assert!(refused(key).contains("sqlite_autoindex_contracts_1"));
        let mut group = fresh("group.sqlite3");
        group.group = 9; // more than the largest
        assert!(refused(group).contains("group"));
        let mut rate = fresh("rate.sqlite3");
        rate.rate_per_s = Some(0);
        assert!(refused(rate).contains("rate"));
        let mut none = fresh("none.sqlite3");
        none.contracts = 0;
        assert!(refused(none).contains("contracts"));
        let mut largest = fresh("largest.sqlite3");
        largest.max_group = 0;
        assert!(refused(largest).contains("largest group"));
        let mut wal = fresh("wal.sqlite3");
        wal.wal_restart_bytes = 1 << 20;
        assert!(refused(wal).contains("restart size"));
        let existing = dir.path().join("existing.sqlite3");
        std::fs::write(&existing, b"").expect("write");
        assert!(refused(options(existing, None)).contains("exists"));
    }
}
