//! The store's engine bounds, in one place: what both backends share,
//! then what each engine needs of its own (`sqlite`, `postgres`). Bounds a
//! client meets are in `core::limits`; tunable ones in the config
//! registry (`config::limits`).

use std::time::Duration;

/// Most contracts a writer's cache (`KnownCache`) holds, by count and by
/// bytes (`KnownMap::bytes`): half of either fills a generation, and the
/// one before it is freed (`KnownMap::turn_if_full`); what is missed is
/// reloaded on demand.
pub const MAX_CACHED_CONTRACTS: usize = 65_536;

pub const MAX_CACHED_CONTRACT_BYTES: usize = 128 * 1024 * 1024;

/// Stack of a writer or judge thread: judging recurses through CEL and
/// JSON Schema (each bounded in depth), deeper than a default stack.
pub const JUDGE_STACK_BYTES: usize = 64 * 1024 * 1024;

/// Rows per multi-row statement, under the backend's bind-parameter limit at
/// the widest row (a contract).
pub const ROWS_PER_STATEMENT: usize = 1_000;

/// Completions judged at once off the writer: judging is CPU-bound, so
/// more than a few only queue for the same cores; the rest wait for a
/// permit (each request still has its deadline).
pub const MAX_CONCURRENT_JUDGMENTS: usize = 4;

/// Completions one signing key may have judged at once.
pub const MAX_JUDGMENTS_PER_SIGNER: usize = 2;

/// Drains stepped per pass of the drainer (one per tenant).
pub const DRAINS_PER_PASS: usize = 16;

/// Drains the drainer reads per pass, oldest first, to pick each
/// tenant's oldest from: a tenant whose oldest drain is past this many
/// others waits for some of them to end (4,096 drains of more than
/// `cascade_step_rows` contracts each are millions of open contracts).
pub const MAX_DRAINS_LISTED: i64 = 4_096;

/// About how long one drain step holds the writer: other writes wait
/// behind at most one step, so this is what a drain adds to their latency.
/// Steps end as many rows as fit (`drain::DrainPace`).
pub const DRAIN_STEP_MS: u64 = 5;

/// Fewest rows a drain step ends, however slow rows are: a drain always
/// moves.
pub const MIN_DRAIN_STEP_ROWS: usize = 8;

/// A row's cost before any step was timed (about a debug build's).
pub const INITIAL_DRAIN_ROW_COST_NS: u64 = 100_000;

/// How often the drainer looks for drains when there are none.
pub const DRAIN_POLL_MS: u64 = 200;

/// Trees `TreeChanges` remembers before it starts over.
pub const MAX_TRACKED_TREES: usize = 65_536;

/// How often the writer looks for request-log entries past retention.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(1);

/// Smallest and largest filter: bounds memory to two of the largest
/// (64 MiB) for the longest windows, where the rate degrades instead.
pub const MIN_FILTER_BITS: usize = 1 << 16;

pub const MAX_FILTER_BITS: usize = 1 << 28;

/// Shortest generation.
pub const MIN_SPAN_MS: i64 = 10_000;

/// SQLite's own bounds.
pub mod sqlite {
    use std::time::Duration;

    /// SQLite's bind parameters per statement (`SQLITE_MAX_VARIABLE_NUMBER`,
    /// the default since 3.32).
    pub const MAX_BIND_PARAMETERS: usize = 32_766;
    const _: () = assert!(crate::sql::plan::PARAMETERS_PER_STATEMENT <= MAX_BIND_PARAMETERS);

    /// Most request-log entries deleted in one pass: bounds the writer's pause
    /// (each is a random page write, and on a log larger than the page cache
    /// a read too). A backlog is worked off one pass after every batch.
    pub const MAX_PRUNED_PER_PASS: u64 = 128;

    /// WAL bytes one COMMIT gathers at most before it writes them
    /// (`sqlite::gather`): a commit's frames are its dirty pages, which
    /// the writer's 4 MiB page cache holds (more spill before COMMIT), so
    /// a commit rarely reaches it.
    pub const MAX_GATHERED_BYTES: usize = 8 * 1024 * 1024;
    /// The gathering buffer kept between COMMITs: a usual commit's frames
    /// (tens of 4 KiB frames) fit; a larger one's buffer is let go.
    pub const KEPT_GATHER_BYTES: usize = 1024 * 1024;
    const _: () = assert!(KEPT_GATHER_BYTES <= MAX_GATHERED_BYTES);
    /// The most one call to the default VFS writes: SQLite's unix VFS
    /// masks a write's length to its low 17 bits (`seekAndWriteFd`), since
    /// SQLite itself never writes more than a frame, so a longer write would
    /// be cut short and reported as a full disk.
    pub const MAX_WRITE_BYTES: usize = 0x1_F000;
    const _: () = assert!(MAX_WRITE_BYTES < 0x2_0000);
    /// Prepared statements kept per connection (see where it is set).
    pub const STATEMENT_CACHE_CAPACITY: usize = 1_024;

    /// Committed batches that may wait for the syncer; beyond it the writer
    /// waits (back-pressure instead of unbounded memory).
    pub const MAX_UNSYNCED_BATCHES: usize = 64;

    /// How often the WAL is copied back into the database file. Each
    /// checkpoint ends with an fsync of the database file that the WAL's
    /// fsyncs queue behind: four a second were a quarter of the slow
    /// batches at half load; once a second halved the open-loop p99
    /// (BENCHMARKS.md). A hot page is copied once per round,
    /// so fewer rounds also copy less.
    pub const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(1_000);

    /// Back-to-back checkpoints at most before the writer is asked to finish.
    pub const MAX_DRAIN_ROUNDS: usize = 8;

    /// How long the writer waits for sqlx's worker to hand over its
    /// connection before asking again (`raw::take_handle`): a take is
    /// 10–100 µs, and one abandoned costs only another hand-over, while
    /// every write waits on it.
    pub const HANDLE_WAIT: Duration = Duration::from_millis(50);
    // `broker_sqlite_handle_retakes_total`'s help and docs/operating.md say 50 ms.
    const _: () = assert!(HANDLE_WAIT.as_millis() == 50);

    /// Takes asked before the writer's batch fails instead (2 s in all).
    pub const HANDLE_TRIES: u32 = 40;

    // `store-probe` (`store::sqlite::probe`).
    /// Most contracts one commit takes (a closed loop's workers).
    pub const MAX_PROBE_GROUP: usize = 4_096;
    /// Most contracts one probe writes: a latency sample of 4 bytes each,
    /// and a database of about a kilobyte each.
    pub const MAX_PROBE_CONTRACTS: u64 = 10_000_000;
    /// Highest arrival rate (as `disk-probe`'s).
    pub const MAX_PROBE_RATE_PER_S: u64 = 100_000;
}

/// PostgreSQL's own bounds.
pub mod postgres {
    use std::time::Duration;

    /// PostgreSQL's bind parameters per statement (a 16-bit count).
    pub const MAX_BIND_PARAMETERS: usize = 65_535;
    const _: () = assert!(crate::sql::plan::PARAMETERS_PER_STATEMENT <= MAX_BIND_PARAMETERS);

    /// Longest a writer under load waits for a group to fill
    /// (`Writer::take_group`): with three replicas, 2 ms made groups of ~8
    /// instead of 5.5 and took the database's CPU per delegation from
    /// 136–150 to 115–129 µs (BENCHMARKS.md); 4 ms made no
    /// larger groups, and a group's answers wait for it, so not more.
    pub const MAX_GROUP_WAIT: Duration = Duration::from_millis(2);

    /// The group size a writer under load waits for (up to
    /// `MAX_GROUP_WAIT`): one replica alone gathers ~19 a commit at full
    /// load, so it does not wait.
    pub const GROUP_TARGET: usize = 16;

    /// A writer waits only after a group of at least this many: under
    /// light load (groups of one to three) answers go at once.
    pub const GROUP_SIBLINGS: usize = 4;

    /// Fewest numbers an issuance transaction reserves for its writer's
    /// next one (`Writer::prefetch`): an optimistic issuance needs one a
    /// command, and a group larger than what is left takes the locked
    /// path (which reserves again).
    pub const MIN_PREFETCHED_NUMBERS: usize = 16;

    /// Longest numbers reserved for optimistic issuances are used
    /// (`writer::Prefetched`): under load each issuance reserves anew;
    /// after a pause, numbers taken before other replicas' since would
    /// list a root opened now as older than theirs.
    pub const MAX_PREFETCHED_AGE: Duration = Duration::from_millis(100);

    /// Oldest a cached row version an optimistic issuance trusts, in ms:
    /// PostgreSQL's transaction ids are 32 bits and wrap (after 4 billion
    /// transactions, hours even at a million a second), so an old `xmin`
    /// could match a row rewritten since.
    pub const MAX_VERSION_AGE_MS: i64 = 60_000;

    /// Most trees a writer remembers as draining (its optimistic
    /// issuance skips them: it would be redone); forgotten all at once
    /// beyond it, which costs only redone transactions.
    pub const MAX_DRAINING_ROOTS: usize = 4_096;

    /// Most parents a writer remembers as contended (found stale by an
    /// optimistic issuance, `Writer::contended`) within a second;
    /// forgotten all at once beyond it.
    pub const MAX_CONTENDED_PARENTS: usize = 4_096;

    /// First backoff before a redo; doubled at each attempt, with jitter.
    pub const RETRY_BASE_MS: u64 = 2;

    /// Longest backoff between two attempts.
    pub const RETRY_CAP_MS: u64 = 100;

    /// Most request-log entries one prune pass deletes: the pass runs on a
    /// pool connection beside the writers, so it may take more than SQLite's
    /// writer-blocking pass.
    pub const MAX_PRUNED_PER_PASS: i64 = 1_024;

    /// Events placed per sequencer pass (one statement's worth).
    pub const MAX_PLACED_PER_PASS: i64 = 4_096;

    /// How often a sequencer looks for positions given through other replicas
    /// (and reaches the database, for health).
    pub const SEQUENCER_POLL: Duration = Duration::from_millis(10);

    /// Longest pause between two sequencer passes while the database cannot
    /// be reached.
    pub const MAX_SEQUENCER_PAUSE: Duration = Duration::from_secs(1);

    /// Oldest the sequencer's last complete poll may be for what a reader
    /// remembered of a tree to still count (`TreeChanges::current`):
    /// past it, another replica's events may be unseen.
    pub const MAX_POLL_AGE: Duration = Duration::from_secs(1);

    /// Prepared statements kept per connection: a batch's multi-row
    /// statements differ by row count, and one planned anew per batch costs
    /// PostgreSQL more than running it.
    pub const STATEMENT_CACHE_CAPACITY: usize = 2_048;

    /// A pooled connection idle this long is pinged before use (a server
    /// restart is found then); a busier one is not: the ping was a round
    /// trip on every acquire (BENCHMARKS.md, one caller on PostgreSQL).
    pub const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

    /// Attempts at applying the migrations when replicas start together (no
    /// advisory lock: the loser of a race finds the migration applied on its
    /// next attempt).
    pub const MIGRATE_ATTEMPTS: u32 = 5;

    /// Most keys `keys list` reads: far above any real registry (a key
    /// per replica start at worst), a bound all the same.
    pub const MAX_LISTED_KEYS: i64 = 100_000;
}

/// Contracts one drain step ends at most, unless configured
/// (`limits.cascade_step_rows`): a step holds the writer, so its length
/// is a wait every other write may see.
pub const DEFAULT_CASCADE_STEP_ROWS: usize = 1_024;

/// Most identity bindings a single broker keeps in memory (about 300
/// bytes each); full of live ones, BindIdentity is BUSY until some expire.
pub const MAX_IDENTITY_BINDINGS: usize = 100_000;
/// Most keys bound to one identity at once: a workload runs a few agents,
/// and one workload's token must not bind keys without end.
pub const MAX_KEYS_PER_IDENTITY: usize = 64;
