//! The store's own floor (`store-probe`): what SQLite and the kernel
//! charge to hold `bench`'s workload durably with this schema, and nothing
//! else. The rows a closed-loop `bench` commits (chains of depth 8 from 64
//! workers, each delegation a contract, its envelope, its request log
//! entry and its parent's ledger; a root's run label) are generated here
//! with the same sizes and key distributions — random 32-byte ids as
//! SHA-256 gives, one set of agents per worker reused chain after chain —
//! without a client, a signature or a rule. They are committed in groups
//! on one thread through the writer's own statements (`plan_statements`
//! run by `raw`, BEGIN IMMEDIATE to COMMIT), each commit's WAL fdatasynced
//! and the WAL checkpointed every `CHECKPOINT_INTERVAL`, as the broker
//! does. No broker on this store can spend less CPU per delegation than
//! this probe: `bench --floor` plus it bounds what share of the floor a
//! broker can reach (BENCHMARKS.md, issue 27).

use super::checkpoint::checkpoint;
use super::raw::Statements;
use super::*;
use crate::clock::SystemClock;
use crate::core::{Ledger, Liability, Policy};
use crate::store::batch::{ContractRow, RequestRow};

/// Most workers (chains in flight): each holds its agents' keys.
pub const MAX_PROBE_WORKERS: usize = 4_096;
/// Most contracts one probe writes: a sample of 4 bytes each per commit
/// phase, and a database of a few hundred bytes each.
pub const MAX_PROBE_CONTRACTS: u64 = 10_000_000;
/// Deepest chain (as `bench --depth`).
pub const MAX_PROBE_DEPTH: u32 = 64;

/// Bytes of a depth-8 chain's signed envelope in `bench` (measured from
/// its database: 381 on average).
const ENVELOPE_BYTES: usize = 381;
/// `bench`'s effective predicate at every depth (45 bytes).
const PREDICATE: &str = "(result.schema_valid && result.within_scope\n)";
/// `bench`'s write scope and a root's labels.
const WRITE_SCOPE_JSON: &str = "[\"src\"]";
const ROOT_LABELS_JSON: &str = "{\"tool\":\"bench\"}";
const CHILD_LABELS_JSON: &str = "{}";
/// A root's budget: halved at every level, so depth 64 still has units.
const ROOT_BUDGET: i64 = 1 << 40;
/// A contract's deadline after its issuance (an hour).
const DEADLINE_AFTER_MS: i64 = 3_600_000;

/// What to write.
#[derive(Clone, Debug)]
pub struct StoreProbeOptions {
    /// The database file: must not exist (the probe starts empty, as
    /// `bench`'s in-process broker does).
    pub path: PathBuf,
    /// Chains in flight (`bench --concurrency`).
    pub workers: usize,
    /// Delegations per chain after its root (`bench --depth`).
    pub depth: u32,
    /// Contracts (roots included) per commit: a closed loop's group.
    pub group: usize,
    /// Contracts (roots included) to write in all.
    pub contracts: u64,
    /// Indexes to drop before writing, to price each (never a table's
    /// key or a UNIQUE constraint's: those are not indexes one can drop).
    pub drop_indexes: Vec<String>,
    /// Leave the request log out: its random-keyed B-tree's price.
    pub no_request_log: bool,
}

/// What a probe measured.
#[derive(Debug)]
pub struct StoreProbeReport {
    /// Contracts written, roots included.
    pub contracts: u64,
    /// Of them, roots.
    pub roots: u64,
    pub commits: u64,
    /// Wall time of the writes (from the first BEGIN to the last
    /// checkpoint).
    pub wall: Duration,
    /// The whole process's CPU over the same span (SQLite's statements,
    /// the kernel's writes, fsyncs and checkpoints, and the generation of
    /// the rows, which is small).
    pub cpu: Duration,
    /// WAL frames written (each a page plus a 24-byte header).
    pub wal_frames: u64,
    pub page_bytes: u64,
    /// Each commit's statements, BEGIN to COMMIT, µs, sorted.
    pub commit_us: Vec<u32>,
    /// Each WAL fdatasync, µs, sorted.
    pub fsync_us: Vec<u32>,
}

/// Runs the probe on the calling thread (blocking: not from inside an
/// async runtime). The database is left behind for the caller to read
/// or remove.
pub fn run(options: &StoreProbeOptions) -> Result<StoreProbeReport, StoreError> {
    let bad = |what: String| Err(StoreError::Backend(what));
    if !(1..=MAX_PROBE_WORKERS).contains(&options.workers) {
        return bad(format!("workers must be 1..={MAX_PROBE_WORKERS}"));
    }
    if !(1..=MAX_PROBE_DEPTH).contains(&options.depth) {
        return bad(format!("depth must be 1..={MAX_PROBE_DEPTH}"));
    }
    // Each worker has one request in flight in a closed loop, so a group
    // never holds two steps of one chain (a parent and its child).
    if !(1..=options.workers).contains(&options.group) {
        return bad("group must be 1..=workers".into());
    }
    if !(1..=MAX_PROBE_CONTRACTS).contains(&options.contracts) {
        return bad(format!("contracts must be 1..={MAX_PROBE_CONTRACTS}"));
    }
    if options.path.exists() {
        return bad(format!(
            "{} exists; the probe starts empty",
            options.path.display()
        ));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| StoreError::Backend(format!("probe runtime: {e}")))?;
    runtime.block_on(probe(options))
}

async fn probe(options: &StoreProbeOptions) -> Result<StoreProbeReport, StoreError> {
    reserve_wal(&options.path, WAL_RESTART_BYTES);
    let (mut conn, next_seq) = open_writer(&connect_options(&options.path)).await?;
    for name in &options.drop_indexes {
        let known: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = $1 \
             AND sql IS NOT NULL",
        )
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .map_err(backend)?;
        if known != 1 {
            return Err(StoreError::Backend(format!(
                "no droppable index named {name:?} (a table's key or a UNIQUE constraint \
                 cannot be dropped)"
            )));
        }
        // The name is one the schema holds (checked above), quoted.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP INDEX \"{}\"",
            name.replace('"', "\"\"")
        )))
        .execute(&mut conn)
        .await
        .map_err(backend)?;
    }
    let page_bytes: i64 = sqlx::query_scalar("PRAGMA page_size")
        .fetch_one(&mut conn)
        .await
        .map_err(backend)?;
    let wal = std::fs::OpenOptions::new()
        .write(true)
        .open(wal_path_of(&options.path))
        .map_err(|e| StoreError::Backend(format!("opening the WAL: {e}")))?;
    let mut workload = Workload::new(options, next_seq);
    let mut statements = Statements::default();
    let mut report = StoreProbeReport {
        contracts: 0,
        roots: 0,
        commits: 0,
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
        wal_frames: 0,
        page_bytes: u64::try_from(page_bytes).unwrap_or(0),
        commit_us: Vec::new(),
        fsync_us: Vec::new(),
    };
    let cpu_before = process_cpu();
    let began = std::time::Instant::now();
    let mut next_checkpoint = began + CHECKPOINT_INTERVAL;
    let written = async {
        while report.contracts < options.contracts {
            let left = options.contracts - report.contracts;
            let plan = workload.group(
                options
                    .group
                    .min(usize::try_from(left).unwrap_or(usize::MAX)),
                SystemClock.now_ms(),
            );
            report.contracts += plan.contracts.len() as u64;
            report.roots += plan.contracts.iter().filter(|c| c.parent.is_none()).count() as u64;
            let mut script = Sql::whole_transaction();
            script.statement("BEGIN IMMEDIATE");
            plan_statements(&mut script, &plan);
            script.statement("COMMIT");
            let mut handle = conn.lock_handle().await.map_err(backend)?;
            let commit = std::time::Instant::now();
            statements.run(&mut handle, &script).map_err(backend)?;
            drop(handle);
            report.commit_us.push(micros(commit.elapsed()));
            report.commits += 1;
            let sync = std::time::Instant::now();
            wal.sync_data()
                .map_err(|e| StoreError::Backend(format!("fsync of the WAL: {e}")))?;
            report.fsync_us.push(micros(sync.elapsed()));
            if std::time::Instant::now() >= next_checkpoint {
                report.wal_frames += checkpointed(&mut conn).await?;
                next_checkpoint += CHECKPOINT_INTERVAL;
            }
        }
        report.wal_frames += checkpointed(&mut conn).await?;
        Ok::<_, StoreError>(())
    }
    .await;
    report.wall = began.elapsed();
    report.cpu = process_cpu().saturating_sub(cpu_before);
    // Statements are finalized before sqlx closes the connection (`raw`).
    if let Ok(mut handle) = conn.lock_handle().await {
        statements.finalize_all(&mut handle);
    }
    let _ = conn.close().await;
    written?;
    report.commit_us.sort_unstable();
    report.fsync_us.sort_unstable();
    Ok(report)
}

/// One PASSIVE checkpoint; the frames the WAL held. The probe is the
/// database's only connection, so every checkpoint copies every frame and
/// the next commit restarts the WAL: the frames are new ones each time.
async fn checkpointed(conn: &mut SqliteConnection) -> Result<u64, StoreError> {
    match checkpoint(conn).await {
        Some(done) if done.copied_frames == done.wal_frames => Ok(done.wal_frames),
        Some(_) | None => Err(StoreError::Backend(
            "a checkpoint of the probe's own database did not finish".into(),
        )),
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// CPU time of the whole process so far (every thread, user and kernel).
fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

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
    fn new(options: &StoreProbeOptions, next_seq: i64) -> Self {
        let mut rng = SplitMix64(0x5eed_0f_b40c_e5);
        let workers = (0..options.workers)
            .map(|_| Chain {
                agents: (0..=options.depth).map(|_| rng.bytes32()).collect(),
                root: None,
                last: None,
            })
            .collect();
        Self {
            rng,
            workers,
            depth: options.depth,
            next_seq,
            turn: 0,
            no_request_log: options.no_request_log,
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
                    let budget = ledger.budget / 2;
                    ledger.reserved += budget;
                    ledger.open_children += 1;
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
            let ledger = Ledger {
                budget,
                reserved: 0,
                spent: 0,
                open_children: 0,
            };
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
                    outcome: crate::store::batch::OUTCOME_ISSUED,
                    ref_id: id,
                    at_ms: now_ms,
                });
            }
        }
        plan
    }
}

/// A fast, seeded generator of the random bytes SHA-256 ids, keys and
/// nonces look like (their distribution, not their secrecy, is what the
/// B-trees see).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }

    fn bytes32(&mut self) -> [u8; 32] {
        let mut bytes = [0u8; 32];
        self.fill(&mut bytes);
        bytes
    }
}
