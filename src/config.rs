//! Operator configuration: where state lives, whom to trust, and every
//! tunable limit. Read from an optional TOML file; command-line flags
//! (with environment overrides) set the data directory and address.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ed25519_dalek::VerifyingKey;
use serde::Deserialize;

use crate::core::trust;

/// Everything the server needs besides its listener.
#[derive(Clone, Debug)]
pub struct Config {
    /// Holds the broker's signing key and the SQLite database.
    pub data_dir: PathBuf,
    pub trust: TrustConfig,
    /// Who may open roots, and with how much budget.
    pub orchestrators: Orchestrators,
    /// The server's TLS identity; `None` serves plaintext gRPC.
    pub tls: Option<TlsIdentity>,
    /// Keys that may read every tree (operators' dashboards, auditors);
    /// everyone else reads only the trees they are a party of.
    pub readers: std::collections::HashSet<[u8; 32]>,
    pub limits: Limits,
}

/// A PEM certificate chain and its private key, read at start so a bad
/// path fails the start, not the first handshake.
#[derive(Clone)]
pub struct TlsIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("cert_pem_bytes", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

/// The keys allowed to open roots, each with the largest budget one root
/// may carry. Roots are where budget enters the system: without this list
/// any key could mint any budget. Empty means open to every key (a
/// development setup; the server logs a warning at start).
#[derive(Clone, Debug, Default)]
pub struct Orchestrators {
    /// Public key → most budget units one root may carry.
    pub max_root_budget: HashMap<[u8; 32], i64>,
}

/// Why an orchestrator may not open a root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootDenied {
    /// The key is not on the list.
    NotListed,
    /// The budget exceeds the key's allowance.
    OverAllowance { allowed: i64 },
}

impl Orchestrators {
    /// Whether every key may open roots of any budget.
    pub fn is_open(&self) -> bool {
        self.max_root_budget.is_empty()
    }

    /// May `key` open a root with `budget`?
    pub fn admit(&self, key: &[u8; 32], budget: i64) -> Result<(), RootDenied> {
        if self.is_open() {
            return Ok(());
        }
        match self.max_root_budget.get(key) {
            None => Err(RootDenied::NotListed),
            Some(&allowed) if budget > allowed => Err(RootDenied::OverAllowance { allowed }),
            Some(_) => Ok(()),
        }
    }
}

/// Sources of trust factors for delegates.
#[derive(Clone, Debug, Default)]
pub struct TrustConfig {
    /// Attestors whose signed attestations set a delegate's factor.
    pub attestors: Vec<VerifyingKey>,
    /// Fallback factors (ppm) for agents without an attestation, for
    /// deployments without attestors.
    pub static_factors_ppm: HashMap<[u8; 32], u32>,
}

/// Tunable limits; every one has a safe default.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest gRPC message accepted, in bytes (RESOURCE_EXHAUSTED above).
    pub max_request_bytes: usize,
    /// Largest distance between a request's timestamp and the broker's
    /// clock, in ms; beyond it the request is stale (UNAUTHENTICATED).
    pub timestamp_window_ms: i64,
    /// Ceiling on a policy's max_depth.
    pub max_depth: u32,
    /// Ceiling on a policy's max_children.
    pub max_children: u32,
    /// Writes that may queue for the store's writer before callers are
    /// told RESOURCE_EXHAUSTED.
    pub writer_queue_depth: usize,
    /// Most writes committed in one transaction (group commit).
    pub max_batch: usize,
    /// Read-only SQLite connections.
    pub read_connections: u32,
    /// Client connections open at once; beyond it new ones wait in the
    /// listen backlog until one closes.
    pub max_connections: usize,
    /// Concurrent requests per client connection.
    pub max_concurrent_requests_per_connection: usize,
    /// Longest a request may run, in ms, before DEADLINE_EXCEEDED.
    pub request_timeout_ms: u64,
    /// Longest a TLS handshake may take, in ms: a client that never
    /// finishes one must not hold a task and a socket forever.
    pub tls_handshake_timeout_ms: u64,
    /// Concurrent Watch streams, broker-wide.
    pub max_watch_streams: usize,
    /// How often overdue contracts are expired in the background, in ms
    /// (they also expire on access).
    pub expiry_sweep_interval_ms: u64,
    /// How long answered requests stay in the request log (the nonce and
    /// idempotency record), in ms; older entries are deleted in the
    /// background. At least twice `timestamp_window_ms` plus two minutes,
    /// so a request that is still fresh always finds its earlier answer. A retry older than
    /// this is refused as stale instead of being answered again.
    pub request_log_retention_ms: i64,
    /// How long a read session (OpenSession) is accepted, in ms.
    pub session_ttl_ms: i64,
    /// Concurrent Watch streams one caller (session key) may hold: one
    /// client must not take every stream.
    pub max_watch_streams_per_caller: usize,
    /// Concurrent Watch streams on one client connection.
    pub max_watch_streams_per_connection: usize,
    /// Concurrent Watch streams on one tree, whoever opens them: a party
    /// can make new keys parties (by delegating to them), so per-caller
    /// caps alone do not stop one tree from taking every stream.
    pub max_watch_streams_per_tree: usize,
    /// GetAudit and AggregateAudits calls running at once, broker-wide:
    /// each may read and hold a whole tree.
    pub max_concurrent_audits: usize,
    /// Audit calls one caller may run at once.
    pub max_concurrent_audits_per_caller: usize,
}

impl Limits {
    /// Largest response the server encodes: four times the largest request
    /// (responses carry signed envelopes the requests do not).
    pub fn max_response_bytes(&self) -> usize {
        self.max_request_bytes.saturating_mul(4)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_bytes: 1024 * 1024,
            timestamp_window_ms: 300_000,
            max_depth: crate::core::limits::MAX_DEPTH_CEILING,
            max_children: crate::core::limits::MAX_CHILDREN_CEILING,
            writer_queue_depth: 16_384,
            max_batch: 512,
            read_connections: 4,
            max_connections: 4_096,
            max_concurrent_requests_per_connection: 1_024,
            request_timeout_ms: 30_000,
            tls_handshake_timeout_ms: 10_000,
            max_watch_streams: 1_024,
            expiry_sweep_interval_ms: 1_000,
            request_log_retention_ms: 30 * 24 * 3_600_000,
            session_ttl_ms: 3_600_000,
            max_watch_streams_per_caller: 32,
            max_watch_streams_per_connection: 32,
            max_watch_streams_per_tree: 64,
            max_concurrent_audits: 4,
            max_concurrent_audits_per_caller: 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileConfig {
    trust: FileTrust,
    /// Hex-encoded orchestrator public key → most budget one root may carry.
    orchestrators: HashMap<String, i64>,
    tls: Option<FileTls>,
    readers: FileReaders,
    limits: Limits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileReaders {
    /// Hex-encoded public keys that may read every tree.
    keys: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTls {
    /// PEM certificate chain, server certificate first.
    cert: PathBuf,
    /// PEM private key of that certificate.
    key: PathBuf,
}

/// Retention beyond twice the timestamp window: a fresh retry's original
/// arrived at most two windows before it, and the retry may still wait in
/// the writer's queue (bounded by the request timeout) while the writer
/// prunes, so the log keeps a margin over that.
const RETENTION_SLACK_MS: i64 = 120_000;
/// Ceiling on `limits.tls_handshake_timeout_ms`: a minute is already
/// generous for a handshake.
const MAX_TLS_HANDSHAKE_TIMEOUT_MS: u64 = 60_000;
/// Ceiling on `limits.max_connections` (the tokio semaphore's own limit is
/// far above; this keeps a typo from meaning "unbounded").
const MAX_CONNECTIONS_CEILING: usize = 1_000_000;

/// Most bytes read from a TLS certificate or key file.
const MAX_TLS_FILE_BYTES: u64 = 1024 * 1024;

fn read_tls_file(path: &Path, field: &str) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let unreadable =
        |e: std::io::Error| invalid(field, format!("cannot read {}: {e}", path.display()));
    // Read at most one byte past the limit: the size is checked on what
    // was read, not on metadata that could change in between.
    let mut pem = Vec::new();
    std::fs::File::open(path)
        .map_err(unreadable)?
        .take(MAX_TLS_FILE_BYTES + 1)
        .read_to_end(&mut pem)
        .map_err(unreadable)?;
    if pem.len() as u64 > MAX_TLS_FILE_BYTES {
        return Err(invalid(
            field,
            format!(
                "{} is larger than {MAX_TLS_FILE_BYTES} bytes",
                path.display()
            ),
        ));
    }
    if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(invalid(field, format!("{} is not PEM", path.display())));
    }
    Ok(pem)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileTrust {
    /// Hex-encoded ed25519 public keys of trusted attestors.
    attestors: Vec<String>,
    /// Hex-encoded agent public key → factor in (0, 1].
    #[serde(rename = "static")]
    static_factors: HashMap<String, f64>,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Parses a hex-encoded ed25519 public key.
pub fn parse_public_key(hex_key: &str, field: &str) -> Result<VerifyingKey, ConfigError> {
    let bytes = hex::decode(hex_key.trim()).map_err(|e| invalid(field, format!("not hex: {e}")))?;
    crate::crypto::public_key(&bytes).map_err(|e| invalid(field, e.to_string()))
}

/// Longest a read session may be accepted: a day.
const MAX_SESSION_TTL_MS: i64 = 86_400_000;
/// Most audit calls at once, whatever the configuration: each may hold a
/// tree's rows in memory.
const MAX_CONCURRENT_AUDITS_CEILING: usize = 64;

impl Config {
    /// Defaults for `data_dir`, overridden by the TOML file at `path`.
    pub fn load(data_dir: PathBuf, path: Option<&Path>) -> Result<Self, ConfigError> {
        let file = match path {
            None => FileConfig::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.to_owned(),
                    source,
                })?
            }
        };
        let attestors = file
            .trust
            .attestors
            .iter()
            .enumerate()
            .map(|(i, k)| parse_public_key(k, &format!("trust.attestors[{i}]")))
            .collect::<Result<_, _>>()?;
        let mut static_factors_ppm = HashMap::new();
        for (agent, factor) in &file.trust.static_factors {
            let field = format!("trust.static.{agent}");
            let key = parse_public_key(agent, &field)?;
            let ppm = trust::factor_to_ppm(*factor)
                .ok_or_else(|| invalid(&field, "factor must be in (0, 1]"))?;
            if static_factors_ppm.insert(key.to_bytes(), ppm).is_some() {
                return Err(invalid(
                    &field,
                    "this key is listed twice (spelled differently)",
                ));
            }
        }
        let mut max_root_budget = HashMap::new();
        for (orchestrator, budget) in &file.orchestrators {
            let field = format!("orchestrators.{orchestrator}");
            let key = parse_public_key(orchestrator, &field)?;
            if *budget <= 0 {
                return Err(invalid(
                    &field,
                    "the root budget allowance must be positive",
                ));
            }
            if max_root_budget.insert(key.to_bytes(), *budget).is_some() {
                return Err(invalid(
                    &field,
                    "this key is listed twice (spelled differently)",
                ));
            }
        }
        let mut readers = std::collections::HashSet::new();
        for (i, reader) in file.readers.keys.iter().enumerate() {
            readers.insert(parse_public_key(reader, &format!("readers.keys[{i}]"))?.to_bytes());
        }
        let config = Self {
            readers,
            data_dir,
            trust: TrustConfig {
                attestors,
                static_factors_ppm,
            },
            orchestrators: Orchestrators { max_root_budget },
            tls: file
                .tls
                .map(|files| -> Result<_, ConfigError> {
                    Ok(TlsIdentity {
                        cert_pem: read_tls_file(&files.cert, "tls.cert")?,
                        key_pem: read_tls_file(&files.key, "tls.key")?,
                    })
                })
                .transpose()?,
            limits: file.limits,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        if !(4096..=64 * 1024 * 1024).contains(&l.max_request_bytes) {
            return Err(invalid(
                "limits.max_request_bytes",
                "must be in 4096..=67108864",
            ));
        }
        if !(1_000..=3_600_000).contains(&l.timestamp_window_ms) {
            return Err(invalid(
                "limits.timestamp_window_ms",
                "must be in 1000..=3600000",
            ));
        }
        if l.max_depth == 0 || l.max_depth > crate::core::limits::MAX_DEPTH_CEILING {
            return Err(invalid("limits.max_depth", "must be in 1..=64"));
        }
        if l.max_children == 0 || l.max_children > crate::core::limits::MAX_CHILDREN_CEILING {
            return Err(invalid("limits.max_children", "must be in 1..=1024"));
        }
        if l.writer_queue_depth == 0 || l.max_batch == 0 || l.read_connections == 0 {
            return Err(invalid(
                "limits",
                "queue depth, batch size and connections must be positive",
            ));
        }
        if l.max_watch_streams == 0 || l.expiry_sweep_interval_ms == 0 {
            return Err(invalid(
                "limits",
                "watch streams and the sweep interval must be positive",
            ));
        }
        let least_retention_ms = l
            .timestamp_window_ms
            .saturating_mul(2)
            .saturating_add(RETENTION_SLACK_MS);
        if l.request_log_retention_ms < least_retention_ms {
            return Err(invalid(
                "limits.request_log_retention_ms",
                format!(
                    "must be at least twice limits.timestamp_window_ms plus {RETENTION_SLACK_MS} ms ({least_retention_ms} ms)"
                ),
            ));
        }
        if !(1..=MAX_CONNECTIONS_CEILING).contains(&l.max_connections) {
            return Err(invalid(
                "limits.max_connections",
                format!("must be 1..={MAX_CONNECTIONS_CEILING}"),
            ));
        }
        if !(1..=MAX_TLS_HANDSHAKE_TIMEOUT_MS).contains(&l.tls_handshake_timeout_ms) {
            return Err(invalid(
                "limits.tls_handshake_timeout_ms",
                format!("must be 1..={MAX_TLS_HANDSHAKE_TIMEOUT_MS}"),
            ));
        }
        if !(1_000..=MAX_SESSION_TTL_MS).contains(&l.session_ttl_ms) {
            return Err(invalid(
                "limits.session_ttl_ms",
                format!("must be 1000..={MAX_SESSION_TTL_MS}"),
            ));
        }
        for (field, value, most) in [
            (
                "limits.max_watch_streams_per_caller",
                l.max_watch_streams_per_caller,
                l.max_watch_streams,
            ),
            (
                "limits.max_watch_streams_per_connection",
                l.max_watch_streams_per_connection,
                l.max_watch_streams,
            ),
            (
                "limits.max_concurrent_audits",
                l.max_concurrent_audits,
                MAX_CONCURRENT_AUDITS_CEILING,
            ),
            (
                "limits.max_concurrent_audits_per_caller",
                l.max_concurrent_audits_per_caller,
                l.max_concurrent_audits,
            ),
        ] {
            if !(1..=most).contains(&value) {
                return Err(invalid(field, format!("must be 1..={most}")));
            }
        }
        if l.max_concurrent_requests_per_connection == 0 || l.request_timeout_ms == 0 {
            return Err(invalid(
                "limits",
                "concurrency and timeout must be positive",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("broker.toml");
        std::fs::write(&path, text).expect("write");
        Config::load(dir.path().to_owned(), Some(&path))
    }

    #[test]
    fn orchestrators_are_read_and_checked() {
        let signing = ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]);
        let key = hex::encode(signing.verifying_key().to_bytes());
        let config = load(&format!("[orchestrators]\n\"{key}\" = 500\n")).expect("valid");
        let listed: [u8; 32] = hex::decode(&key)
            .expect("hex")
            .try_into()
            .expect("32 bytes");
        assert_eq!(config.orchestrators.admit(&listed, 500), Ok(()));
        assert_eq!(
            config.orchestrators.admit(&listed, 501),
            Err(RootDenied::OverAllowance { allowed: 500 })
        );
        assert_eq!(
            config.orchestrators.admit(&[9u8; 32], 1),
            Err(RootDenied::NotListed)
        );
        assert!(load("").expect("empty").orchestrators.is_open());
        match load(&format!("[orchestrators]\n\"{key}\" = 0\n")) {
            Err(ConfigError::Invalid { field, .. }) => {
                assert_eq!(field, format!("orchestrators.{key}"));
            }
            other => panic!("a zero allowance must be refused: {other:?}"),
        }
        let upper = key.to_uppercase();
        match load(&format!(
            "[orchestrators]\n\"{key}\" = 5\n\"{upper}\" = 6\n"
        )) {
            Err(ConfigError::Invalid { reason, .. }) => {
                assert!(reason.contains("twice"), "{reason}")
            }
            other => panic!("one key listed twice must be refused: {other:?}"),
        }
        match load("[limits]\nrequest_log_retention_ms = 719999\n") {
            Err(ConfigError::Invalid { field, .. }) => {
                assert_eq!(field, "limits.request_log_retention_ms");
            }
            other => panic!("retention below twice the window must be refused: {other:?}"),
        }
        for bad in [0, MAX_CONNECTIONS_CEILING + 1] {
            match load(&format!("[limits]\nmax_connections = {bad}\n")) {
                Err(ConfigError::Invalid { field, .. }) => {
                    assert_eq!(field, "limits.max_connections");
                }
                other => panic!("max_connections = {bad} must be refused: {other:?}"),
            }
        }
        for bad in [0, MAX_TLS_HANDSHAKE_TIMEOUT_MS + 1] {
            match load(&format!("[limits]\ntls_handshake_timeout_ms = {bad}\n")) {
                Err(ConfigError::Invalid { field, .. }) => {
                    assert_eq!(field, "limits.tls_handshake_timeout_ms");
                }
                other => panic!("a handshake timeout of {bad} ms must be refused: {other:?}"),
            }
        }
        match load("[orchestrators]\n\"not-hex\" = 5\n") {
            Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "orchestrators.not-hex"),
            other => panic!("a bad key must be refused: {other:?}"),
        }
    }
}
