//! The store's own floor (`store-probe`): what SQLite, the kernel and
//! the disk charge to hold a workload durably with this schema, and
//! nothing else. The caller makes the plans (`broker_tools::store_probe` makes
//! `bench`'s rows, without a client, a signature or a rule); here they go
//! through the broker's own pipeline: the
//! writer's statements (`plan_statements` run by `raw`, BEGIN IMMEDIATE to
//! COMMIT) on this thread, a syncer thread that fdatasyncs the WAL once
//! for every commit so far, and the background `checkpointer` on its own
//! connection and thread, whose finish the writer runs between commits.
//!
//! Two modes. Groups (no rate): every commit holds `group` contracts, as
//! fast as the writer goes; the process's CPU per delegation is the least
//! any broker on this store spends, so `bench --floor` plus it bounds a
//! broker's share of the floor. Open loop (`rate_per_s`): contracts
//! "arrive" at the rate and each commit takes all that have arrived (up
//! to `max_group`), as the broker's writer does; each one's latency runs
//! from its arrival to the end of the fsync that covers it — the least a
//! durable answer on this store can wait, to set beside `disk-probe`'s
//! (BENCHMARKS.md).

use std::sync::mpsc as std_mpsc;

use super::checkpoint::checkpointer;
use super::raw::Statements;
use super::*;
use crate::limits::sqlite::{MAX_PROBE_CONTRACTS, MAX_PROBE_GROUP, MAX_PROBE_RATE_PER_S};
use broker_wire::clock::SystemClock;

/// The WAL restart sizes the probe takes (`limits.wal_restart_mib`'s).
pub const PROBE_WAL_RESTART_BYTES: std::ops::RangeInclusive<u64> = (16 << 20)..=(16_384 << 20);

/// What to write.
#[derive(Clone, Debug)]
pub struct StoreProbeOptions {
    /// The database file: must not exist (the probe starts empty, as
    /// `bench`'s in-process broker does).
    pub path: PathBuf,
    /// Without a rate: contracts (roots included) per commit.
    pub group: usize,
    /// In the open loop: the most contracts one commit takes (`bench`'s
    /// workers: a closed loop never has more requests in flight).
    pub max_group: usize,
    /// Contracts "arriving" per second; `None` for fixed groups as fast
    /// as the writer goes.
    pub rate_per_s: Option<u64>,
    /// Contracts (roots included) to write in all.
    pub contracts: u64,
    /// Indexes to drop before writing, to price each (never a table's
    /// key or a UNIQUE constraint's: those are not indexes one can drop).
    pub drop_indexes: Vec<String>,
    /// WAL size past which the writer finishes a checkpoint
    /// (`SqliteOptions::wal_restart_bytes`; also what is reserved).
    pub wal_restart_bytes: u64,
    /// Hand the connection back to sqlx's worker after every commit and
    /// take it again (`raw::take_handle`), the finish through sqlx when
    /// due: prices a hand-over, and counts the takes abandoned. This is
    /// the pattern in which sqlx 0.9 loses a take now and then (a take
    /// right after a finish through sqlx); the writer no longer runs it.
    pub hand_over: bool,
}

/// What a probe measured.
#[derive(Debug)]
pub struct StoreProbeReport {
    /// Contracts written, roots included.
    pub contracts: u64,
    /// Of them, roots.
    pub roots: u64,
    pub commits: u64,
    /// From the first BEGIN to the last contract's fsync.
    pub wall: Duration,
    /// The whole process's CPU over the same span (the writer's
    /// statements, the syncer's fsyncs, the checkpoints, the kernel's
    /// writes, and the rows' generation, which is small).
    pub cpu: Duration,
    /// WAL frames the commits wrote (each a page plus a 24-byte header),
    /// as SQLite counts them.
    pub wal_frames: u64,
    pub page_bytes: u64,
    /// Each commit's statements, BEGIN to COMMIT, µs, sorted.
    pub commit_us: Vec<u32>,
    /// Each WAL fdatasync, µs, sorted.
    pub fsync_us: Vec<u32>,
    /// Open loop only: each contract's arrival to the end of its fsync,
    /// µs, sorted.
    pub latency_us: Vec<u32>,
    /// Open loop only: each contract's arrival to its commit's BEGIN (the
    /// wait for the writer), µs, sorted.
    pub queued_us: Vec<u32>,
    /// Each checkpoint the writer finished between commits so the WAL
    /// restarts (the writer's stalls), µs, sorted.
    pub finish_us: Vec<u32>,
    /// Takes of the handle abandoned after `HANDLE_WAIT` and asked again.
    pub retakes: u64,
}

/// Makes the plan of the next `n` contracts, issued at `now_ms`, numbered
/// on from the last (a fresh database's first is 1).
pub type Workload<'a> = dyn FnMut(usize, i64) -> Plan + 'a;

/// Runs the probe on the calling thread (blocking: not from inside an
/// async runtime). The database is left behind for the caller to read
/// or remove.
pub fn run(
    options: &StoreProbeOptions,
    workload: &mut Workload<'_>,
) -> Result<StoreProbeReport, StoreError> {
    let bad = |what: String| Err(StoreError::Backend(what));
    if !(1..=MAX_PROBE_GROUP).contains(&options.max_group) {
        return bad(format!("the largest group must be 1..={MAX_PROBE_GROUP}"));
    }
    if !(1..=options.max_group).contains(&options.group) {
        return bad("group must be 1..=the largest group".into());
    }
    if let Some(rate) = options.rate_per_s
        && !(1..=MAX_PROBE_RATE_PER_S).contains(&rate)
    {
        return bad(format!("rate must be 1..={MAX_PROBE_RATE_PER_S}"));
    }
    if !(1..=MAX_PROBE_CONTRACTS).contains(&options.contracts) {
        return bad(format!("contracts must be 1..={MAX_PROBE_CONTRACTS}"));
    }
    if !PROBE_WAL_RESTART_BYTES.contains(&options.wal_restart_bytes) {
        return bad("the WAL's restart size must be 16 MiB to 16 GiB".into());
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
    runtime.block_on(probe(options, workload))
}

/// What the writer hands the syncer per commit: when each of its
/// contracts arrived.
type Committed = Vec<std::time::Instant>;

async fn probe(
    options: &StoreProbeOptions,
    workload: &mut Workload<'_>,
) -> Result<StoreProbeReport, StoreError> {
    reserve_wal(&options.path, options.wal_restart_bytes);
    let connect = connect_options(&options.path)?;
    let (mut conn, next_seq) = open_writer(&connect).await?;
    if next_seq != 1 {
        return Err(StoreError::Backend(
            "the probe's database is not empty".into(),
        ));
    }
    for name in &options.drop_indexes {
        drop_index(&mut conn, name).await?;
    }
    let page_bytes: i64 = sqlx::query_scalar("PRAGMA page_size")
        .fetch_one(&mut conn)
        .await
        .map_err(backend)?;
    // The broker's checkpointer, on its own connection and thread; it
    // stops when `alive` is dropped.
    let (alive, alive_rx) = mpsc::channel::<(Command, Reply)>(1);
    let finish = Arc::new(AtomicBool::new(false));
    // Connected here, so a checkpointer that cannot start fails the probe
    // instead of leaving the WAL to grow.
    let checkpoint_conn = SqliteConnection::connect_with(&connect)
        .await
        .map_err(backend)?;
    let checkpoints = {
        let (weak, finish) = (alive.downgrade(), finish.clone());
        let restart_bytes = options.wal_restart_bytes;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend(format!("checkpointer runtime: {e}")))?;
        std::thread::Builder::new()
            .name("probe-checkpointer".into())
            .spawn(move || {
                runtime.block_on(checkpointer(
                    checkpoint_conn,
                    weak,
                    finish,
                    restart_bytes,
                    CHECKPOINT_INTERVAL,
                ));
            })
            .map_err(|e| StoreError::Backend(format!("checkpointer thread: {e}")))?
    };
    let (to_syncer, from_writer) = std_mpsc::sync_channel::<Committed>(MAX_UNSYNCED_BATCHES);
    let wal_path = wal_path_of(&options.path);
    let syncer = std::thread::Builder::new()
        .name("probe-syncer".into())
        .spawn(move || sync_loop(&wal_path, &from_writer))
        .map_err(|e| StoreError::Backend(format!("syncer thread: {e}")))?;

    let mut statements = Statements::default();
    let (mut commit_us, mut queued_us, mut finish_us) = (Vec::new(), Vec::new(), Vec::new());
    let (mut contracts, mut roots) = (0u64, 0u64);
    let cpu_before = process_cpu();
    let began = std::time::Instant::now();
    // Without `hand_over` the handle is held for the whole run, as the
    // writer holds it across a stretch of batches (`apply::apply_held`);
    // the finish runs on it too, as the writer's does (`writer::maintain`).
    const FINISH: &str = "PRAGMA wal_checkpoint(PASSIVE)";
    let mut finish_sql = Sql::default();
    finish_sql.statement(FINISH);
    let retakes = prometheus::IntCounter::new("probe_retakes", "abandoned takes of the handle")
        .map_err(|e| StoreError::Backend(format!("a counter: {e}")))?;
    let (wrote, wal_frames) = async {
        let mut handle = match super::raw::take_handle(&mut conn, Some(&retakes)).await {
            Ok(handle) => handle,
            Err(e) => return (Err(backend(e)), None),
        };
        let wrote = loop {
            if contracts >= options.contracts {
                break Ok(());
            }
            let left = usize::try_from(options.contracts - contracts).unwrap_or(usize::MAX);
            let arrivals = match options.rate_per_s {
                None => vec![std::time::Instant::now(); options.group.min(left)],
                Some(rate) => arrived(began, rate, contracts, options.max_group.min(left)),
            };
            let plan = workload(arrivals.len(), SystemClock.now_ms());
            contracts += plan.contracts.len() as u64;
            roots += plan.contracts.iter().filter(|c| c.parent.is_none()).count() as u64;
            let mut script = Sql::whole_transaction();
            script.statement("BEGIN IMMEDIATE");
            plan_statements(&mut script, &plan);
            script.statement("COMMIT");
            let commit = std::time::Instant::now();
            queued_us.extend(
                arrivals
                    .iter()
                    .map(|&a| micros(commit.saturating_duration_since(a))),
            );
            if let Err(e) = statements.run(&mut handle, &script) {
                break Err(backend(e));
            }
            commit_us.push(micros(commit.elapsed()));
            if to_syncer.send(arrivals).is_err() {
                break Err(StoreError::Backend("the probe's syncer stopped".into()));
            }
            let finishing = finish.swap(false, Ordering::AcqRel);
            if !options.hand_over {
                // As the broker's writer does between batches (`maintain`).
                if finishing {
                    let began = std::time::Instant::now();
                    if let Err(e) = statements.run(&mut handle, &finish_sql) {
                        break Err(backend(e));
                    }
                    finish_us.push(micros(began.elapsed()));
                }
                continue;
            }
            // The connection handed back to sqlx's worker and taken again,
            // the finish through sqlx when due (the writer's pattern
            // before its finish moved onto the held handle).
            drop(handle);
            let mut finished = Ok(());
            if finishing {
                let began = std::time::Instant::now();
                finished = sqlx::query(FINISH).execute(&mut conn).await.map(drop);
                finish_us.push(micros(began.elapsed()));
            }
            // Taken back even after a failed finish: the statements are
            // finalized on it below.
            handle = match super::raw::take_handle(&mut conn, Some(&retakes)).await {
                Ok(handle) => handle,
                Err(e) => return (Err(backend(e)), None),
            };
            if let Err(e) = finished {
                break Err(backend(e));
            }
        };
        let wal_frames = super::raw::wal_pages_written(&mut handle);
        // Statements are finalized before sqlx closes the connection (`raw`).
        statements.finalize_all(&mut handle);
        (wrote, wal_frames)
    }
    .await;
    drop(to_syncer);
    let synced = syncer
        .join()
        .map_err(|_| StoreError::Backend("the probe's syncer panicked".into()))?;
    let wall = began.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_before);
    drop((alive, alive_rx));
    let checkpointed = checkpoints.join();
    if statements.is_empty() {
        let _ = conn.close().await;
    } else {
        // Never handed back: closing with statements prepared would
        // panic (see `raw`), so the connection is left to the exit.
        std::mem::forget(conn);
    }
    wrote?;
    checkpointed.map_err(|_| StoreError::Backend("the probe's checkpointer panicked".into()))?;
    let wal_frames = wal_frames
        .ok_or_else(|| StoreError::Backend("SQLite did not say how many pages it wrote".into()))?;
    let (mut fsync_us, mut latency_us) = synced?;
    commit_us.sort_unstable();
    fsync_us.sort_unstable();
    latency_us.sort_unstable();
    queued_us.sort_unstable();
    finish_us.sort_unstable();
    if options.rate_per_s.is_none() {
        latency_us.clear();
        queued_us.clear();
    }
    Ok(StoreProbeReport {
        contracts,
        roots,
        commits: commit_us.len() as u64,
        wall,
        cpu,
        wal_frames,
        page_bytes: u64::try_from(page_bytes).unwrap_or(0),
        commit_us,
        fsync_us,
        latency_us,
        queued_us,
        finish_us,
        retakes: retakes.get(),
    })
}

/// Drops index `name` after checking the schema has it (so the quoted
/// name in the DDL is one SQLite wrote, not the caller's text).
async fn drop_index(conn: &mut SqliteConnection, name: &str) -> Result<(), StoreError> {
    let known: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = $1 \
         AND sql IS NOT NULL",
    )
    .bind(name)
    .fetch_one(&mut *conn)
    .await
    .map_err(backend)?;
    if known != 1 {
        return Err(StoreError::Backend(format!(
            "no droppable index named {name:?} (a table's key or a UNIQUE constraint \
             cannot be dropped)"
        )));
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP INDEX \"{}\"",
        name.replace('"', "\"\"")
    )))
    .execute(&mut *conn)
    .await
    .map_err(backend)?;
    Ok(())
}

/// The arrivals (at `rate` a second since `began`) not yet taken: those
/// from the `taken`-th on that are due now, at most `most`; waits for
/// the next one if none is.
fn arrived(began: std::time::Instant, rate: u64, taken: u64, most: usize) -> Committed {
    let at = |i: u64| began + Duration::from_nanos(i.saturating_mul(1_000_000_000) / rate);
    let now = std::time::Instant::now();
    if at(taken) > now {
        std::thread::sleep(at(taken) - now);
    }
    let now = std::time::Instant::now();
    (taken..taken + most as u64)
        .map(at)
        .take_while(|&t| t <= now)
        .collect()
}

/// The syncer: takes every commit handed over so far, fdatasyncs the WAL
/// once for all, and counts each contract's latency to that moment (as
/// `durability::syncer`). Returns the fsyncs' and the latencies' µs.
fn sync_loop(
    wal_path: &Path,
    commits: &std_mpsc::Receiver<Committed>,
) -> Result<(Vec<u32>, Vec<u32>), StoreError> {
    let wal = std::fs::OpenOptions::new()
        .write(true)
        .open(wal_path)
        .map_err(|e| StoreError::Backend(format!("opening the WAL: {e}")))?;
    let (mut fsync_us, mut latency_us) = (Vec::new(), Vec::new());
    while let Ok(first) = commits.recv() {
        let mut arrivals = first;
        while let Ok(more) = commits.try_recv() {
            arrivals.extend(more);
        }
        let began = std::time::Instant::now();
        wal.sync_data()
            .map_err(|e| StoreError::Backend(format!("fsync of the WAL: {e}")))?;
        let done = std::time::Instant::now();
        fsync_us.push(micros(done - began));
        latency_us.extend(
            arrivals
                .iter()
                .map(|&a| micros(done.saturating_duration_since(a))),
        );
    }
    Ok((fsync_us, latency_us))
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
