//! The service's own bounds (memos, Watch paging and reserves). Bounds a
//! client meets are in `core::limits`; tunable ones in the config
//! registry (`config::limits`).

/// (contract, agent) pairs remembered as parties; cleared when full.
pub(crate) const MAX_REMEMBERED_PARTIES: usize = 65_536;

/// Most attestation envelopes remembered as verified.
pub(crate) const MAX_VERIFIED_ATTESTATIONS: usize = 16_384;

/// Sessions remembered as verified (by digest), so a session is verified
/// once, not at every read; cleared when full.
pub(crate) const MAX_VERIFIED_SESSIONS: usize = 16_384;

/// Events fetched per Watch query.
pub(crate) const WATCH_PAGE: u32 = 256;

/// Envelope bytes fetched per Watch query: with `WATCH_BUFFER`, what one
/// stream holds in memory however slowly its client reads (unbounded
/// pages of deep contracts held 7 MB per stream).
pub(crate) const WATCH_PAGE_BYTES: usize = 256 * 1024;

/// Events buffered per Watch stream before the reader waits for the client.
pub(crate) const WATCH_BUFFER: usize = 8;

/// Watch streams past `limits.max_watch_streams` kept for tenants holding
/// fewer than `WATCH_SMALL_SHARE`: this fraction of it (an eighth).
pub(crate) const WATCH_RESERVE_DIVISOR: usize = 8;

/// Streams a tenant may hold and still take one from the reserve.
pub(crate) const WATCH_SMALL_SHARE: usize = 2;

/// WatchContracts' bounds are the API's: clients keep within them.
pub(crate) use broker_domain::limits::{MAX_WATCH_CONTRACTS_PER_MESSAGE, MAX_WATCHED_CONTRACTS};

/// A WatchContracts stream looks at its trees' versions at most this long
/// after a commit, so a burst of commits costs it one scan.
pub(crate) const WATCH_SCAN_MS: u64 = 100;

/// Reads one WatchContracts scan runs at once (a subtree revoked at once
/// changes many watched contracts).
pub(crate) const WATCH_READS_AT_ONCE: usize = 8;

/// While a replica's tree versions are not current, a WatchContracts
/// stream reads all its contracts again at most this often.
pub(crate) const WATCH_STALE_RESCAN_MS: u64 = 1_000;

/// Health Watch streams open at once, over every client: each holds a task
/// and a channel. Beyond it: RESOURCE_EXHAUSTED.
pub(crate) const MAX_HEALTH_WATCHES: usize = 16_384;

/// Statuses buffered per health Watch stream (they change rarely).
pub(crate) const HEALTH_WATCH_BUFFER: usize = 4;

/// Contracts admission remembers (tenant, delegate, principal) per
/// generation: two generations, the older dropped when the newer fills,
/// so what is in use stays and memory stays bounded (~100 B an entry).
pub(crate) const ADMISSION_MEMO: usize = 65_536;
