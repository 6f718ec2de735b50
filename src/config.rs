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
    pub limits: Limits,
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
    /// Concurrent requests per client connection.
    pub max_concurrent_requests_per_connection: usize,
    /// Longest a request may run, in ms, before DEADLINE_EXCEEDED.
    pub request_timeout_ms: u64,
    /// Concurrent Watch streams, broker-wide.
    pub max_watch_streams: usize,
    /// How often overdue contracts are expired in the background, in ms
    /// (they also expire on access).
    pub expiry_sweep_interval_ms: u64,
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
            max_concurrent_requests_per_connection: 1_024,
            request_timeout_ms: 30_000,
            max_watch_streams: 1_024,
            expiry_sweep_interval_ms: 1_000,
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
    limits: Limits,
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
            static_factors_ppm.insert(key.to_bytes(), ppm);
        }
        let config = Self {
            data_dir,
            trust: TrustConfig {
                attestors,
                static_factors_ppm,
            },
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
        if l.max_concurrent_requests_per_connection == 0 || l.request_timeout_ms == 0 {
            return Err(invalid(
                "limits",
                "concurrency and timeout must be positive",
            ));
        }
        Ok(())
    }
}
