//! The registry of every operator-tunable limit: one table (name, type,
//! default, range, doc) from which `Limits`, its defaults, its range checks
//! and their error messages, the config keys that errors name
//! (`keys::…`) and docs/operating.md's `[limits]` block are all generated, so
//! none of them can drift from another. Every limit has an upper bound.
//! Rules that tie two limits together live in `Config::validate`.

use serde::Deserialize;

use crate::core::limits::{MAX_CHILDREN_CEILING, MAX_DEPTH_CEILING};

/// Ceiling on `limits.max_connections` (the tokio semaphore's own limit is
/// far above; this keeps a typo from meaning "unbounded").
pub const MAX_CONNECTIONS_CEILING: usize = 1_000_000;
/// Ceiling on `limits.tls_handshake_timeout_ms`: a minute is already
/// generous for a handshake.
pub const MAX_TLS_HANDSHAKE_TIMEOUT_MS: u64 = 60_000;
/// Longest a read session may be accepted: a day.
const MAX_SESSION_TTL_MS: i64 = 86_400_000;
/// Most audit calls at once, whatever the configuration: each may hold a
/// tree's rows in memory.
const MAX_CONCURRENT_AUDITS_CEILING: usize = 64;
/// Ceiling on any count of concurrent streams or requests.
const MAX_CONCURRENCY_CEILING: usize = 65_536;
/// Longest any configurable wait or interval may be: an hour.
const MAX_INTERVAL_MS: u64 = 3_600_000;
/// Longest the request log may be kept: a year.
const MAX_RETENTION_MS: i64 = 366 * 24 * 3_600_000;

/// One limit as the registry describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitSpec {
    /// The TOML key under `[limits]`.
    pub name: &'static str,
    pub default: i128,
    pub min: i128,
    pub max: i128,
    /// One line for docs/operating.md and the error messages.
    pub doc: &'static str,
}

macro_rules! limits {
    ($(
        $(#[doc = $long:literal])*
        $name:ident : $ty:ty = $default:expr, $min:expr, $max:expr, $doc:literal;
    )*) => {
        /// Tunable limits; every one has a safe default and a range.
        #[derive(Clone, Debug, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct Limits {
            $(
                #[doc = $doc]
                $(#[doc = $long])*
                pub $name: $ty,
            )*
        }

        impl Default for Limits {
            fn default() -> Self {
                Self { $($name: $default,)* }
            }
        }

        /// Every limit, in the order of the `[limits]` section.
        pub const LIMITS: &[LimitSpec] = &[$(
            LimitSpec {
                name: stringify!($name),
                default: ({ const V: $ty = $default; V as i128 }),
                min: ({ const V: $ty = $min; V as i128 }),
                max: ({ const V: $ty = $max; V as i128 }),
                doc: $doc,
            },
        )*];

        /// The config key of each limit, as errors name it.
        pub mod keys {
            $(
                #[allow(non_upper_case_globals, dead_code)]
                pub const $name: &str = concat!("limits.", stringify!($name));
            )*
        }

        impl Limits {
            /// Each limit within its registered range; the error names the
            /// key and says the range.
            pub fn check_ranges(&self) -> Result<(), (String, String)> {
                $(
                    let value = self.$name as i128;
                    if !({ const V: $ty = $min; V as i128 }..={ const V: $ty = $max; V as i128 }).contains(&value) {
                        return Err((
                            concat!("limits.", stringify!($name)).to_owned(),
                            format!("must be in {}..={} (was {value})", { const V: $ty = $min; V }, { const V: $ty = $max; V }),
                        ));
                    }
                )*
                Ok(())
            }
        }

        // Every default within its range, checked by the compiler.
        $(const _: () = assert!(
            { const V: $ty = $min; V as i128 } <= { const V: $ty = $default; V as i128 } && { const V: $ty = $default; V as i128 } <= { const V: $ty = $max; V as i128 }
        );)*
    };
}

limits! {
    max_request_bytes: usize = 1024 * 1024, 4096, 64 * 1024 * 1024,
        "largest gRPC message accepted, in bytes; larger: RESOURCE_EXHAUSTED";
    timestamp_window_ms: i64 = 300_000, 1_000, 3_600_000,
        "request timestamps further off the broker's clock: UNAUTHENTICATED";
    max_depth: u32 = MAX_DEPTH_CEILING, 1, MAX_DEPTH_CEILING,
        "ceiling on a policy's max_depth";
    max_children: u32 = MAX_CHILDREN_CEILING, 1, MAX_CHILDREN_CEILING,
        "ceiling on a policy's max_children";
    writer_queue_depth: usize = 16_384, 1, 1_048_576,
        "writes queued for the store's writer before UNAVAILABLE (OVERLOADED)";
    max_batch: usize = 512, 1, 16_384,
        "writes per group commit";
    read_connections: u32 = 4, 1, 256,
        "read-only database connections";
    /// Each restart pauses the writer for the last frames' copy and an
    /// fsync of the database (1–13 ms measured): at 2,600 delegations a
    /// second the 128 MiB default restarts every ~3 s, and 1 GiB took
    /// ~1 ms off the open-loop p99 (BENCHMARKS.md).
    wal_restart_mib: u64 = crate::store::sqlite::WAL_RESTART_BYTES >> 20, 16, 16_384,
        "SQLite: WAL size (MiB) past which the writer pauses (a few ms) to let it restart from its beginning; larger: rarer pauses, a larger WAL file and a longer recovery after a crash";
    database_writers: usize = 1, 1, 64,
        "with --database-url: write transactions in flight per replica (one makes the largest groups: least database CPU per write; more overlap commits)";
    max_connections: usize = 4_096, 1, MAX_CONNECTIONS_CEILING,
        "open client connections; more wait in the listen backlog";
    /// An eighth of the default cap: one client needs few connections
    /// (each carries max_concurrent_requests_per_connection calls), so one
    /// address cannot hold the cap and honest callers still get in. Raise
    /// it behind a proxy or NAT that brings many clients from one address.
    max_connections_per_address: usize = 512, 1, MAX_CONNECTIONS_CEILING,
        "open client connections from one peer address (an IPv6 /64); more are closed at once; above max_connections it is max_connections";
    /// Long enough for a slow TLS handshake and a first call; short enough
    /// that sockets which never send a request (or only HTTP/2's preface)
    /// cannot hold the cap. Clients that connect ahead of their first call
    /// are closed and reconnect.
    first_request_timeout_ms: u64 = 5_000, 100, MAX_TLS_HANDSHAKE_TIMEOUT_MS,
        "a connection that has not sent a request this long after it was accepted (with [tls], handshake included) is closed";
    max_concurrent_requests_per_connection: usize = 1_024, 1, MAX_CONCURRENCY_CEILING,
        "concurrent requests on one client connection; with max_watch_streams_per_connection, its open streams too (HTTP/2's concurrent streams: past them, the client's next call waits)";
    request_timeout_ms: u64 = 30_000, 1, MAX_INTERVAL_MS,
        "longest a request may run; past it the call is answered CANCELLED";
    tls_handshake_timeout_ms: u64 = 10_000, 1, MAX_TLS_HANDSHAKE_TIMEOUT_MS,
        "with [tls]: unfinished handshakes are dropped after this";
    max_watch_streams: usize = 1_024, 1, MAX_CONCURRENCY_CEILING,
        "concurrent Watch streams, broker-wide";
    max_watch_streams_per_caller: usize = 32, 1, MAX_CONCURRENCY_CEILING,
        "concurrent Watch streams per session key (at most max_watch_streams)";
    max_watch_streams_per_connection: usize = 32, 1, MAX_CONCURRENCY_CEILING,
        "concurrent Watch streams per client connection (at most max_watch_streams)";
    /// A party can make new keys parties (by delegating to them), so
    /// per-caller caps alone do not stop one tree from taking every stream.
    max_watch_streams_per_tree: usize = 64, 1, MAX_CONCURRENCY_CEILING,
        "concurrent Watch streams per tree, whoever opens them (at most max_watch_streams)";
    /// A client that does not read would otherwise hold its stream's task
    /// and places for as long as it stays connected.
    watch_send_timeout_ms: u64 = 30_000, 1, MAX_INTERVAL_MS,
        "longest a WatchContracts stream waits for its client to read once its buffer is full; then the stream ends RESOURCE_EXHAUSTED (OVERLOADED)";
    /// Enough for the writer's largest groups (bench c64 d8 runs 64 at
    /// once); few enough that a flooding tenant's calls in progress keep
    /// another tenant's call waiting milliseconds, not seconds, in the
    /// readers' and the writer's queues.
    max_requests_at_work: usize = 128, 1, MAX_CONCURRENCY_CEILING,
        "requests reading or writing the store at once; more wait their turn, handed out by tenant in turn (then by key)";
    admission_wait_ms: u64 = 10_000, 1, MAX_INTERVAL_MS,
        "longest a request waits for its turn at work; then RESOURCE_EXHAUSTED (OVERLOADED), retry with the same nonce";
    max_concurrent_audits: usize = 4, 1, MAX_CONCURRENT_AUDITS_CEILING,
        "GetAudit/AggregateAudits calls running at once, broker-wide";
    max_concurrent_audits_per_caller: usize = 1, 1, MAX_CONCURRENT_AUDITS_CEILING,
        "audit calls one caller may run at once (at most max_concurrent_audits)";
    audit_wait_ms: u64 = 10_000, 1, MAX_INTERVAL_MS,
        "longest an audit call waits for its turn (audits are shared in turn among tenants); then RESOURCE_EXHAUSTED";
    session_ttl_ms: i64 = 3_600_000, 1_000, MAX_SESSION_TTL_MS,
        "how long a read session (OpenSession) is accepted";
    /// One writer transaction ends at most this many descendants of a
    /// contract, so ending a large subtree never holds the writer for long.
    cascade_step_rows: usize = crate::store::limits::DEFAULT_CASCADE_STEP_ROWS, 1, 65_536,
        "most descendants one writer transaction ends; a request ending more answers DESCENDANTS_ENDING and they end in steps of this size";
    expiry_sweep_interval_ms: u64 = 1_000, 1, MAX_INTERVAL_MS,
        "how often overdue contracts are expired in the background (they also expire on access)";
    /// At least twice `timestamp_window_ms` plus two minutes, so a request
    /// that is still fresh always finds its earlier answer; a retry older
    /// than this is refused as stale instead of being answered again.
    request_log_retention_ms: i64 = 30 * 24 * 3_600_000, 1, MAX_RETENTION_MS,
        "how long answered requests stay in the request log (≥ 2 × timestamp_window_ms + 2 min)";
    /// Kubernetes' default grace period is 30 s: the default leaves room.
    shutdown_drain_ms: u64 = 10_000, 1, MAX_INTERVAL_MS,
        "after SIGTERM/SIGINT, longest in-flight calls may run before the broker exits anyway (health turns NOT_SERVING and new calls are refused at once)";
    /// Long enough that a replica paused by a slow disk or a GC'd VM is
    /// not retired; short enough that a dead replica's key stops opening
    /// sessions within minutes.
    replica_key_ttl_ms: i64 = 300_000, 2_000, 30 * 24 * 3_600_000,
        "with --database-url: a replica's key not refreshed by its heartbeat for this long is retired (its contracts still verify; no new sessions)";
}

impl Limits {
    /// Largest response the server encodes: four times the largest request
    /// (responses carry signed envelopes the requests do not).
    pub fn max_response_bytes(&self) -> usize {
        self.max_request_bytes.saturating_mul(4)
    }

    /// docs/operating.md's `[limits]` block: every limit at its default, with its
    /// line of documentation.
    pub fn readme_block() -> String {
        let mut out = String::from("[limits]\n");
        for l in LIMITS {
            out.push_str(&format!(
                "{} = {}  # {} [{}..={}]\n",
                l.name, l.default, l.doc, l.min, l.max
            ));
        }
        out
    }
}

// Responses are four requests: the largest must still fit a usize.
const _: () = assert!(64 * 1024 * 1024 * 4 < usize::MAX);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_limit_is_checked_against_its_range_by_name() {
        for spec in LIMITS {
            assert!(spec.min <= spec.default && spec.default <= spec.max);
            for bad in [spec.min - 1, spec.max + 1] {
                let toml = format!("{} = {bad}", spec.name);
                let limits: Result<Limits, _> = toml::from_str(&toml);
                // Out of the type's range fails at parsing; otherwise the
                // range check names the key.
                if let Ok(limits) = limits {
                    let (field, reason) = limits.check_ranges().expect_err(&toml);
                    assert_eq!(field, format!("limits.{}", spec.name));
                    assert!(reason.contains(&spec.max.to_string()), "{reason}");
                }
            }
        }
        assert!(Limits::default().check_ranges().is_ok());
    }

    #[test]
    fn the_readme_shows_every_limit_as_the_registry_says() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operating.md"))
                .expect("docs/operating.md");
        let block = Limits::readme_block();
        assert!(
            readme.contains(&block),
            "docs/operating.md's [limits] block drifted from the registry; it must read:\n{block}"
        );
    }
}
