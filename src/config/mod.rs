//! Operator configuration: where state lives, whom to trust, and every
//! tunable limit. Read from an optional TOML file; command-line flags
//! (with environment overrides) set the data directory and address.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ed25519_dalek::VerifyingKey;
use serde::Deserialize;

use crate::core::trust;

mod identity;
mod limits;
mod tokens;

pub use identity::{IdentityConfig, IssuerConfig, KeySource};
pub use limits::{LIMITS, LimitSpec, Limits, keys};
pub use tokens::TokensConfig;

/// Everything the server needs besides its listener.
#[derive(Clone, Debug)]
pub struct Config {
    /// Holds the broker's signing key and the SQLite database.
    pub data_dir: PathBuf,
    pub trust: TrustConfig,
    /// Who may open roots, and with how much budget.
    pub orchestrators: Orchestrators,
    /// Who shares the broker's bounded resources fairly (`[tenants]`,
    /// and each `[orchestrators]` key outside them).
    pub tenants: crate::core::tenant::Tenants,
    /// The server's TLS identity; `None` serves plaintext gRPC.
    pub tls: Option<TlsIdentity>,
    /// Keys that may read every tree (operators' dashboards, auditors);
    /// everyone else reads only the trees they are a party of.
    pub readers: std::collections::HashSet<[u8; 32]>,
    /// Workload identities that read every tree, as `readers` do
    /// (`[readers] identities`), once their keys are bound.
    pub reader_identities: Vec<crate::core::identity::IdentityPattern>,
    /// The issuers whose tokens bind keys to identities (`[identity]`).
    pub identity: IdentityConfig,
    /// The browser console's settings (`[console]`; used with
    /// `serve --console`).
    pub console: ConsoleConfig,
    /// The token endpoint's settings (`[tokens]`; used with
    /// `serve --tokens`).
    pub tokens: TokensConfig,
    pub limits: Limits,
}

/// `[console]`: whose rights the browser console reads with, which other
/// origins may call it, and the names it shows for keys.
#[derive(Clone, Debug, Default)]
pub struct ConsoleConfig {
    /// The key whose sessions the console hands to the browser (a key in
    /// `[readers]` sees every tree; any other key, its own trees). No
    /// private key is involved: the broker signs the sessions. Required
    /// by `serve --console`.
    pub reader: Option<[u8; 32]>,
    /// Origins besides the console's own (`http://ADDR`, and
    /// `http://localhost:PORT` on loopback) whose pages may call it.
    pub allowed_origins: Vec<String>,
    /// The address book: names shown instead of short keys.
    pub names: std::collections::BTreeMap<[u8; 32], String>,
    /// Serve the page from this folder (read at start) instead of the copy
    /// built into the binary: for work on the console itself.
    pub assets_dir: Option<PathBuf>,
}

/// Most entries of `[console.names]` and `console.allowed_origins`.
pub const MAX_CONSOLE_ENTRIES: usize = 10_000;
/// Longest name in `[console.names]`, in bytes.
pub const MAX_CONSOLE_NAME_BYTES: usize = 64;
/// Longest origin in `console.allowed_origins`, in bytes.
pub const MAX_ORIGIN_BYTES: usize = 256;

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
    /// Identity pattern → the same, for keys bound to a matching identity
    /// (BindIdentity).
    pub by_identity: Vec<(crate::core::identity::IdentityPattern, i64)>,
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
        self.max_root_budget.is_empty() && self.by_identity.is_empty()
    }

    /// May `key`, bound to `identity` if it is, open a root with
    /// `budget`? A key listed by itself has its own allowance; else the
    /// largest allowance of the patterns its identity matches.
    pub fn admit(
        &self,
        key: &[u8; 32],
        identity: Option<&str>,
        budget: i64,
    ) -> Result<(), RootDenied> {
        if self.is_open() {
            return Ok(());
        }
        let by_identity = || {
            let identity = identity?;
            self.by_identity
                .iter()
                .filter(|(pattern, _)| pattern.matches(identity))
                .map(|(_, allowed)| allowed)
                .max()
        };
        match self.max_root_budget.get(key).or_else(by_identity) {
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

/// Each message says its cause itself (no `source`), so a chain printed
/// with `{:#}` says it once.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {error}")]
    Parse {
        path: PathBuf,
        error: toml::de::Error,
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
    /// Tenant name → its keys.
    tenants: std::collections::BTreeMap<String, FileTenant>,
    tls: Option<FileTls>,
    readers: FileReaders,
    console: FileConsole,
    tokens: tokens::FileTokens,
    identity: identity::FileIdentity,
    limits: Limits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileConsole {
    /// Hex-encoded public key the console reads as.
    reader: Option<String>,
    /// Extra origins, e.g. "https://dashboard.example".
    allowed_origins: Vec<String>,
    /// Hex-encoded public key → display name.
    names: HashMap<String, String>,
    /// A folder with index.html, console.js and console.css.
    assets_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileTenant {
    /// Hex-encoded public keys whose roots are this tenant's trees.
    keys: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct FileReaders {
    /// Hex-encoded public keys that may read every tree.
    keys: Vec<String>,
    /// Identity patterns whose bound keys may read every tree.
    identities: Vec<String>,
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

fn console_config(file: &FileConsole) -> Result<ConsoleConfig, ConfigError> {
    let reader = file
        .reader
        .as_deref()
        .map(|k| parse_public_key(k, "console.reader").map(|k| k.to_bytes()))
        .transpose()?;
    if file.allowed_origins.len() > MAX_CONSOLE_ENTRIES || file.names.len() > MAX_CONSOLE_ENTRIES {
        return Err(invalid(
            "console",
            format!(
                "at most {MAX_CONSOLE_ENTRIES} allowed origins and {MAX_CONSOLE_ENTRIES} names"
            ),
        ));
    }
    for (i, origin) in file.allowed_origins.iter().enumerate() {
        let field = format!("console.allowed_origins[{i}]");
        // An origin is scheme://host[:port], nothing after it: browsers
        // send exactly that in the Origin header.
        let rest = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        match rest {
            Some(host)
                if origin.len() <= MAX_ORIGIN_BYTES
                    && !host.is_empty()
                    && !host.contains(['/', '?', '#', ' ']) => {}
            _ => {
                return Err(invalid(
                    field,
                    format!(
                        "{origin:?} is not an origin (http[s]://host[:port], at most {MAX_ORIGIN_BYTES} bytes)"
                    ),
                ));
            }
        }
    }
    let mut names = std::collections::BTreeMap::new();
    for (key, name) in &file.names {
        let field = format!("console.names.{key}");
        let key = parse_public_key(key, &field)?.to_bytes();
        if name.is_empty()
            || name.len() > MAX_CONSOLE_NAME_BYTES
            || name.chars().any(char::is_control)
        {
            return Err(invalid(
                field,
                format!("a name is 1 ..= {MAX_CONSOLE_NAME_BYTES} bytes, no control characters"),
            ));
        }
        if names.insert(key, name.clone()).is_some() {
            return Err(invalid(
                field,
                "this key is listed twice (spelled differently)",
            ));
        }
    }
    Ok(ConsoleConfig {
        reader,
        allowed_origins: file.allowed_origins.clone(),
        names,
        assets_dir: file.assets_dir.clone(),
    })
}

/// `[orchestrators]`: each entry a key (hex) or an identity pattern (a
/// SPIFFE ID, or issuer#subject), with its per-root allowance.
fn orchestrators(file: &HashMap<String, i64>) -> Result<Orchestrators, ConfigError> {
    let mut max_root_budget = HashMap::new();
    let mut by_identity = Vec::new();
    for (orchestrator, budget) in file {
        let field = format!("orchestrators.{orchestrator}");
        if *budget <= 0 {
            return Err(invalid(
                &field,
                "the root budget allowance must be positive",
            ));
        }
        // An identity (a SPIFFE ID, or issuer#subject), never a key.
        if orchestrator.contains("://") || orchestrator.contains('#') {
            let pattern = crate::core::identity::IdentityPattern::parse(orchestrator)
                .map_err(|e| invalid(&field, e.to_string()))?;
            by_identity.push((pattern, *budget));
            continue;
        }
        let key = parse_public_key(orchestrator, &field)?;
        if max_root_budget.insert(key.to_bytes(), *budget).is_some() {
            return Err(invalid(
                &field,
                "this key is listed twice (spelled differently)",
            ));
        }
    }
    Ok(Orchestrators {
        max_root_budget,
        by_identity,
    })
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
                let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
                    path: path.to_owned(),
                    error,
                })?;
                toml::from_str(&text).map_err(|error| ConfigError::Parse {
                    path: path.to_owned(),
                    error,
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
        let orchestrators = orchestrators(&file.orchestrators)?;
        let mut tenants = crate::core::tenant::Tenants::default();
        for (name, tenant) in &file.tenants {
            let mut keys = Vec::with_capacity(tenant.keys.len());
            for (i, key) in tenant.keys.iter().enumerate() {
                keys.push(parse_public_key(key, &format!("tenants.{name}.keys[{i}]"))?.to_bytes());
            }
            tenants
                .declare(name, &keys)
                .map_err(|e| invalid(format!("tenants.{name}"), e.to_string()))?;
        }
        for key in orchestrators.max_root_budget.keys() {
            tenants.orchestrator(*key);
        }
        let mut readers = std::collections::HashSet::new();
        for (i, reader) in file.readers.keys.iter().enumerate() {
            readers.insert(parse_public_key(reader, &format!("readers.keys[{i}]"))?.to_bytes());
        }
        let console = console_config(&file.console)?;
        let config = Self {
            readers,
            console,
            tokens: tokens::tokens_config(&file.tokens)?,
            data_dir,
            trust: TrustConfig {
                attestors,
                static_factors_ppm,
            },
            orchestrators,
            reader_identities: identity::patterns(&file.readers.identities, "readers.identities")?,
            identity: identity::identity_config(&file.identity)?,
            tenants,
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
        let names_identities =
            !config.orchestrators.by_identity.is_empty() || !config.reader_identities.is_empty();
        if names_identities && config.identity.issuers.is_empty() {
            return Err(invalid(
                "identity.issuers",
                "[orchestrators] or [readers] name identities, but [identity] trusts no issuer: no key could ever be bound to them",
            ));
        }
        Ok(config)
    }

    /// Every limit within its registered range, then the rules that tie
    /// limits to each other.
    fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        l.check_ranges()
            .map_err(|(field, reason)| invalid(field, reason))?;
        let least_retention_ms = l
            .timestamp_window_ms
            .saturating_mul(2)
            .saturating_add(RETENTION_SLACK_MS);
        if l.request_log_retention_ms < least_retention_ms {
            return Err(invalid(
                keys::request_log_retention_ms,
                format!(
                    "must be at least twice {} plus {RETENTION_SLACK_MS} ms ({least_retention_ms} ms)",
                    keys::timestamp_window_ms
                ),
            ));
        }
        for (field, value, most, most_key) in [
            (
                keys::max_watch_streams_per_caller,
                l.max_watch_streams_per_caller,
                l.max_watch_streams,
                keys::max_watch_streams,
            ),
            (
                keys::max_watch_streams_per_connection,
                l.max_watch_streams_per_connection,
                l.max_watch_streams,
                keys::max_watch_streams,
            ),
            (
                keys::max_watch_streams_per_tree,
                l.max_watch_streams_per_tree,
                l.max_watch_streams,
                keys::max_watch_streams,
            ),
            (
                keys::max_concurrent_audits_per_caller,
                l.max_concurrent_audits_per_caller,
                l.max_concurrent_audits,
                keys::max_concurrent_audits,
            ),
        ] {
            if value > most {
                return Err(invalid(
                    field,
                    format!("must be at most {most_key} ({most})"),
                ));
            }
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
    fn tenants_are_declared_by_name_and_orchestrators_are_their_own() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        let key = |k: [u8; 32]| {
            hex::encode(
                ed25519_dalek::SigningKey::from_bytes(&k)
                    .verifying_key()
                    .to_bytes(),
            )
        };
        let public = |k: [u8; 32]| {
            ed25519_dalek::SigningKey::from_bytes(&k)
                .verifying_key()
                .to_bytes()
        };
        let text = format!(
            "[tenants.acme]\nkeys = [\"{}\", \"{}\"]\n\n[orchestrators]\n\"{}\" = 10\n\"{}\" = 10\n",
            key(a),
            key(b),
            key(a),
            key(c)
        );
        let config = load(&text).expect("valid");
        let t = &config.tenants;
        assert!(t.any_declared());
        assert_eq!(t.of(&public(a)), t.of(&public(b)));
        assert_eq!(t.name(&t.of(&public(a))), "acme");
        assert_eq!(
            t.of(&public(c)),
            public(c),
            "a listed orchestrator is a tenant of its own"
        );
        assert_eq!(t.of(&[9; 32]), crate::core::tenant::open_tenant());
        assert!(!load("").expect("empty").tenants.any_declared());
        let twice = format!(
            "[tenants.one]\nkeys = [\"{}\"]\n[tenants.two]\nkeys = [\"{}\"]\n",
            key(a),
            key(a)
        );
        match load(&twice) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "tenants.two");
                assert!(reason.contains("\"one\""), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        match load(&format!("[tenants.open]\nkeys = [\"{}\"]\n", key(a))) {
            Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "tenants.open"),
            other => panic!("{other:?}"),
        }
        match load("[tenants.acme]\nkeys = [\"zz\"]\n") {
            Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "tenants.acme.keys[0]"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn issuers_keys_come_over_https_and_each_vouches_alone() {
        let issuer = |name: &str, domain: &str, keys: &str| {
            format!(
                "[identity.issuers.{name}]\nkind = \"spiffe\"\ntrust_domain = \"{domain}\"\n\
                 audiences = [\"broker\"]\n{keys}\n"
            )
        };
        for url in [
            "https://spire.test/keys",
            "http://127.0.0.1:8081/keys",
            "http://localhost/k",
        ] {
            let text = issuer("a", "p.test", &format!("jwks_url = \"{url}\""));
            assert!(load(&text).is_ok(), "{url}");
        }
        for url in [
            "http://spire.test/keys",
            "http://127.0.0.1.evil.test/k",
            "ftp://x/k",
        ] {
            match load(&issuer("a", "p.test", &format!("jwks_url = \"{url}\""))) {
                Err(ConfigError::Invalid { field, .. }) => {
                    assert_eq!(field, "identity.issuers.a.jwks_url", "{url}");
                }
                other => panic!("{url} must be refused: {other:?}"),
            }
        }
        let file = "jwks_file = \"b.json\"";
        let twice = issuer("a", "p.test", file) + &issuer("b", "p.test", file);
        match load(&twice) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "identity.issuers.b");
                assert!(reason.contains("issuer a"), "{reason}");
            }
            other => panic!("two issuers of one trust domain must be refused: {other:?}"),
        }
        assert!(load(&(issuer("a", "p.test", file) + &issuer("b", "q.test", file))).is_ok());
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
        assert_eq!(config.orchestrators.admit(&listed, None, 500), Ok(()));
        assert_eq!(
            config.orchestrators.admit(&listed, None, 501),
            Err(RootDenied::OverAllowance { allowed: 500 })
        );
        assert_eq!(
            config.orchestrators.admit(&[9u8; 32], None, 1),
            Err(RootDenied::NotListed)
        );
        assert!(load("").expect("empty").orchestrators.is_open());
        // By identity: the largest allowance of the matching patterns; a
        // key listed by itself keeps its own.
        let issuer = "[identity.issuers.spire]\nkind = \"spiffe\"\ntrust_domain = \"p.test\"\n\
                      audiences = [\"broker\"]\njwks_file = \"bundle.json\"\n";
        let by_identity = load(&format!(
            "{issuer}[orchestrators]\n\"{key}\" = 500\n\"spiffe://p.test/o/*\" = 50\n\"spiffe://p.test/o/big\" = 90\n"
        ))
        .expect("valid");
        let admit = |key: &[u8; 32], identity, budget| {
            by_identity.orchestrators.admit(key, identity, budget)
        };
        assert_eq!(admit(&[9; 32], Some("spiffe://p.test/o/a"), 50), Ok(()));
        assert_eq!(
            admit(&[9; 32], Some("spiffe://p.test/o/a"), 51),
            Err(RootDenied::OverAllowance { allowed: 50 })
        );
        assert_eq!(admit(&[9; 32], Some("spiffe://p.test/o/big"), 90), Ok(()));
        assert_eq!(
            admit(&[9; 32], Some("spiffe://p.test/x"), 1),
            Err(RootDenied::NotListed)
        );
        assert_eq!(admit(&[9; 32], None, 1), Err(RootDenied::NotListed));
        assert_eq!(admit(&listed, Some("spiffe://p.test/o/big"), 500), Ok(()));
        match load("[orchestrators]\n\"spiffe://p.test/a\" = 5\n") {
            Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "identity.issuers"),
            other => panic!("identities with no issuer must be refused: {other:?}"),
        }
        match load("[orchestrators]\n\"spiffe://p.test/o*\" = 5\n") {
            Err(ConfigError::Invalid { field, .. }) => {
                assert_eq!(field, "orchestrators.spiffe://p.test/o*")
            }
            other => panic!("a bad pattern must be refused: {other:?}"),
        }
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
        for bad in [0, limits::MAX_CONNECTIONS_CEILING + 1] {
            match load(&format!("[limits]\nmax_connections = {bad}\n")) {
                Err(ConfigError::Invalid { field, .. }) => {
                    assert_eq!(field, "limits.max_connections");
                }
                other => panic!("max_connections = {bad} must be refused: {other:?}"),
            }
        }
        for bad in [0, limits::MAX_TLS_HANDSHAKE_TIMEOUT_MS + 1] {
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
