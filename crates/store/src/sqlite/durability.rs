//! Group commit's durability half: the syncer thread fsyncs the WAL once
//! for every batch committed so far and only then answers them, publishing
//! the last durable commit number that reads wait for (`Durability`).
//! Together with the writer's commit numbering this is the whole barrier:
//! nothing leaves the store before it is on disk.

use super::*;

/// Commit numbers: the writer takes the next one just before each COMMIT,
/// the syncer publishes the last one whose WAL frames are on disk.
#[derive(Clone)]
pub(super) struct Durability {
    /// Taken before COMMIT starts, so a reader that saw a commit's rows
    /// also sees its number here (or a later one).
    pub(super) committed: Arc<AtomicU64>,
    /// Published by the syncer after each fsync; closed if it stopped.
    pub(super) durable: tokio::sync::watch::Receiver<u64>,
}

impl Durability {
    /// Waits until everything a query that has just finished could have
    /// seen is durable: reads never show what a crash could still undo.
    pub(super) async fn settle(&self) -> Result<(), StoreError> {
        let seen = self.committed.load(Ordering::SeqCst);
        let mut durable = self.durable.clone();
        durable
            .wait_for(|d| *d >= seen)
            .await
            .map(|_| ())
            .map_err(|_| StoreError::Closed)
    }
}

/// The WAL file SQLite keeps beside the database.
pub(super) fn wal_path_of(database: &Path) -> PathBuf {
    let mut name = database.as_os_str().to_owned();
    name.push("-wal");
    PathBuf::from(name)
}

/// Reserves the WAL's blocks up to `bytes` (the size it restarts at) when
/// the WAL is absent or empty: a new database, or one closed cleanly (the
/// last checkpoint truncates it). A WAL that has not yet reached its
/// restart size grows with every commit, and each fsync then also wrote
/// the blocks it allocated: the tail of a broker's first minutes of load
/// (with a reserved WAL, open loop at 2,600/s, five pairs: p999 8–14 ms
/// against 11–72, max 14–21 against 18–78; BENCHMARKS.md). `disk-probe`, the tail's
/// yardstick, writes into a file it filled first. Reserved blocks read
/// as zeros: SQLite finds no valid header and starts the WAL from its
/// beginning, as after any restart. Best effort: where the filesystem
/// cannot reserve, the WAL grows as before (said in the log).
pub(super) fn reserve_wal(database: &Path, bytes: u64) {
    let path = wal_path_of(database);
    let reserved = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .and_then(|file| {
            if file.metadata()?.len() > 0 {
                // Frames a crash left, or an earlier reservation: SQLite's.
                return Ok(false);
            }
            reserve(&file, bytes)?;
            file.sync_all()?;
            Ok(true)
        });
    match reserved {
        Ok(true) => tracing::debug!(path = %path.display(), bytes, "WAL reserved"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, path = %path.display(), bytes,
            "could not reserve the WAL's blocks; it grows with the load instead"),
    }
}

#[cfg(target_os = "linux")]
fn reserve(file: &std::fs::File, bytes: u64) -> std::io::Result<()> {
    rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, bytes)
        .map_err(std::io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn reserve(_file: &std::fs::File, _bytes: u64) -> std::io::Result<()> {
    Ok(())
}

/// Starts the syncer thread (an fsync blocks: never on a runtime).
pub(super) fn start_syncer(
    options: &SqliteOptions,
    queue: mpsc::Receiver<Unsynced>,
    durable: tokio::sync::watch::Sender<u64>,
) -> Result<(), StoreError> {
    let wal_path = wal_path_of(&options.path);
    let before_wal_sync = options.before_wal_sync.clone();
    let metrics = options.metrics.clone();
    std::thread::Builder::new()
        .name("store-syncer".into())
        .spawn(move || syncer(&wal_path, queue, durable, before_wal_sync, metrics))
        .map_err(|e| StoreError::Backend(format!("syncer thread: {e}")))?;
    Ok(())
}

/// Makes committed batches durable and only then answers them: takes every
/// batch committed so far, fsyncs the WAL once for all of them, publishes
/// the last commit number and sends the answers. Runs on its own thread
/// (an fsync blocks). Stops for good if an fsync fails (see module docs).
pub(super) fn syncer(
    wal_path: &Path,
    mut queue: mpsc::Receiver<Unsynced>,
    durable: tokio::sync::watch::Sender<u64>,
    before_sync: Option<BeforeWalSync>,
    metrics: Option<crate::metrics::StoreMetrics>,
) {
    let mut wal: Option<(std::fs::File, u64)> = None;
    let mut group = Vec::new();
    while let Some(first) = queue.blocking_recv() {
        group.push(first);
        while let Ok(next) = queue.try_recv() {
            group.push(next);
        }
        let last = group.iter().map(|b| b.number).max().unwrap_or_default();
        let began = std::time::Instant::now();
        let synced = before_sync
            .as_ref()
            .map_or(Ok(()), |hook| (hook.0)())
            .and_then(|()| sync_wal(wal_path, &mut wal));
        let took_us = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        WAL_SYNCS.record(took_us);
        crate::phases::FSYNC.record(took_us, 1);
        if let Some(metrics) = &metrics {
            metrics.wal_fsync_seconds.observe(took_us as f64 / 1e6);
            if took_us >= SLOW_WAL_SYNC_US {
                metrics.wal_fsync_stalls.inc();
            }
        }
        tracing::trace!(batches = group.len(), took_us, "wal synced");
        if let Err(e) = synced {
            tracing::error!(error = %e, path = %wal_path.display(),
                "fsync of the WAL failed; the store stops (restart the broker)");
            for batch in group.drain(..) {
                for (reply, _) in batch.replies {
                    reply.send(Err(StoreError::Backend(format!(
                        "fsync of the write-ahead log failed ({e}); the broker must be restarted"
                    ))));
                }
            }
            return;
        }
        durable.send_modify(|d| *d = (*d).max(last));
        for batch in group.drain(..) {
            crate::phases::SYNC_WAIT.record(
                crate::phases::micros(batch.committed_at.elapsed()),
                batch.replies.len() as u64,
            );
            for (reply, answer) in batch.replies {
                reply.send(answer);
            }
        }
    }
    tracing::debug!("store syncer stopped");
}

/// WAL fsyncs of every store in this process, for the load generator (and
/// any later metrics endpoint): how much of a run the disk stalled.
pub static WAL_SYNCS: WalSyncStats = WalSyncStats {
    syncs: AtomicU64::new(0),
    total_us: AtomicU64::new(0),
    slow: AtomicU64::new(0),
    slow_us: AtomicU64::new(0),
    max_us: AtomicU64::new(0),
};

/// An fsync at least this long counts as slow (the foundation target's
/// p99 latency).
pub const SLOW_WAL_SYNC_US: u64 = 5_000;

/// Counters only ever grow (`max_us` aside): callers diff two snapshots.
pub struct WalSyncStats {
    pub(super) syncs: AtomicU64,
    pub(super) total_us: AtomicU64,
    pub(super) slow: AtomicU64,
    pub(super) slow_us: AtomicU64,
    pub(super) max_us: AtomicU64,
}

/// The counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalSyncSnapshot {
    pub syncs: u64,
    pub total_us: u64,
    /// Fsyncs of at least `SLOW_WAL_SYNC_US`, and their summed time.
    pub slow: u64,
    pub slow_us: u64,
    /// Longest fsync since the process started.
    pub max_us: u64,
}

impl WalSyncStats {
    pub(super) fn record(&self, took_us: u64) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.total_us.fetch_add(took_us, Ordering::Relaxed);
        if took_us >= SLOW_WAL_SYNC_US {
            self.slow.fetch_add(1, Ordering::Relaxed);
            self.slow_us.fetch_add(took_us, Ordering::Relaxed);
        }
        self.max_us.fetch_max(took_us, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> WalSyncSnapshot {
        WalSyncSnapshot {
            syncs: self.syncs.load(Ordering::Relaxed),
            total_us: self.total_us.load(Ordering::Relaxed),
            slow: self.slow.load(Ordering::Relaxed),
            slow_us: self.slow_us.load(Ordering::Relaxed),
            max_us: self.max_us.load(Ordering::Relaxed),
        }
    }
}

/// fsyncs the WAL. The file is reopened if it is not the one open (SQLite
/// does not replace it while connections are open, but syncing a stale
/// file would silently sync nothing).
pub(super) fn sync_wal(path: &Path, wal: &mut Option<(std::fs::File, u64)>) -> std::io::Result<()> {
    let inode = std::fs::metadata(path)?.ino();
    let file = match wal {
        Some((file, open_inode)) if *open_inode == inode => file,
        _ => &wal.insert((std::fs::File::open(path)?, inode)).0,
    };
    // Data only (fdatasync): the WAL's contents and size are what
    // recovery needs; its timestamps are not worth a journal commit.
    file.sync_data()
}

/// A committed (or rolled-back) batch whose answers wait for the fsync
/// that makes commit `number` durable.
pub(super) struct Unsynced {
    pub(super) number: u64,
    pub(super) replies: Vec<(Reply, Result<Answer, StoreError>)>,
    /// When the writer handed it over: its answers' wait for the fsync
    /// is measured from here (`store::phases::SYNC_WAIT`).
    pub(super) committed_at: std::time::Instant,
}
