//! The A2A gateway's configuration file (TOML): the broker, the fronted
//! agent's key and endpoint, the listeners, the address book and each
//! peer's default Delegate terms. Every value is checked at start, with
//! its key named.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use broker_domain::AgentKey;
use serde::Deserialize;

/// Most peers in one address book.
pub const MAX_PEERS: usize = 256;
/// Longest peer name: a URL path segment (`/peers/<name>`) the agent's
/// client is configured with, short enough to quote whole in an error.
pub const MAX_PEER_NAME_BYTES: usize = 64;
/// `poll_ms` bounds: how often a followed task is read from the agent.
pub const MIN_POLL_MS: u64 = 10;
pub const MAX_POLL_MS: u64 = 60_000;
pub const DEFAULT_POLL_MS: u64 = 250;
/// Longest one call to the agent or a peer may take, at most.
pub const MAX_CALL_TIMEOUT_MS: u64 = 600_000;
pub const DEFAULT_CALL_TIMEOUT_MS: u64 = 120_000;
/// How long the gateway waits at start for its agent's card (the agent
/// may start after it), at most; 0 does not wait.
pub const MAX_UPSTREAM_WAIT_MS: u64 = 3_600_000;
pub const DEFAULT_UPSTREAM_WAIT_MS: u64 = 60_000;
/// `max_message_bytes`, the largest A2A request or response body taken:
/// its least, default and most. Below the least, ordinary A2A requests
/// would be refused (a task-starting message carries its chain).
pub const MIN_MESSAGE_BYTES: usize = 1024;
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// Requests in progress at once, per caller (IP address) and in all.
pub const DEFAULT_MAX_IN_FLIGHT_PER_CALLER: usize = 64;
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;
pub const MAX_IN_FLIGHT: usize = 65_536;
/// Most tasks followed at once (each holds a poller); more are refused.
pub const DEFAULT_MAX_TASKS: usize = 1024;
pub const MAX_TASKS: usize = 65_536;
/// Most of those one broker tenant's contracts may hold (the tenant its
/// tree is in, ContractState.tenant): by default this share of max_tasks,
/// so a flood of free keys (all one tenant, `open`) leaves the rest to
/// the others.
pub const DEFAULT_TASKS_SHARE_DIVISOR: usize = 4;
pub const MAX_TASKS_PER_TENANT: usize = MAX_TASKS;
/// Most JSON-RPC paths `Authorization/Check` lets a POST through on.
pub const MAX_AUTHZ_PATHS: usize = 16;
/// The JSON-RPC path allowed through the proxy by default.
pub const DEFAULT_AUTHZ_PATH: &str = "/";

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct A2aConfig {
    /// The broker's gRPC address, e.g. http://127.0.0.1:50051.
    pub broker: String,
    /// The fronted agent's key (a hex seed, as `keygen` writes it): every
    /// lifecycle call and Delegate is signed with it, here only. Relative
    /// to the config file.
    pub key_file: PathBuf,
    /// The agent's A2A base URL; its card is read from
    /// `/.well-known/agent-card.json` there.
    /// Required with `listen`.
    pub upstream: Option<String>,
    /// Ingress address (the agent's public face); without it the gateway
    /// serves only `authz_listen` (a proxy in front of the agent).
    pub listen: Option<String>,
    /// Envoy's external authorization (`Authorization/Check`, gRPC) for a
    /// proxy in front of the agent. With `upstream` set, a message in a
    /// task already started is checked against the contract the task was
    /// started under (read from the agent); without it, refused.
    pub authz_listen: Option<String>,
    /// The agent's JSON-RPC path(s): `Authorization/Check` allows a POST
    /// on these (and a GET of the card), nothing else.
    #[serde(default = "default_authz_paths")]
    pub authz_jsonrpc_paths: Vec<String>,
    /// Egress address, for the fronted agent's outbound client only.
    pub egress_listen: Option<String>,
    /// The ingress over A2A's gRPC binding (beside `listen`'s JSON-RPC).
    pub grpc_listen: Option<String>,
    /// The egress over gRPC: a peer is named by the request's `tenant`.
    pub egress_grpc_listen: Option<String>,
    /// How the agent is called (default: JSON-RPC when its card lists
    /// it, else gRPC).
    pub upstream_binding: Option<Binding>,
    /// Keep connections to the agent open between calls (default off: see
    /// `A2aClient::new`).
    #[serde(default)]
    pub upstream_keep_alive: bool,
    /// Where `GET /metrics` is served (Prometheus).
    pub metrics_listen: Option<String>,
    /// The ingress URL put in the served card (default: http://<listen>).
    pub public_url: Option<String>,
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
    #[serde(default = "default_call_timeout_ms")]
    pub call_timeout_ms: u64,
    /// How long to wait at start for the agent to answer its card,
    /// asking again with backoff.
    #[serde(default = "default_upstream_wait_ms")]
    pub upstream_wait_ms: u64,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    #[serde(default = "default_max_tasks")]
    pub max_tasks: usize,
    /// Most tasks followed at once for one broker tenant (default:
    /// max_tasks / DEFAULT_TASKS_SHARE_DIVISOR, at least 1); see
    /// `tasks_per_tenant`.
    pub max_tasks_per_tenant: Option<usize>,
    #[serde(default = "default_max_in_flight_per_caller")]
    pub max_in_flight_per_caller: usize,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// The address book.
    #[serde(default)]
    pub peers: Vec<Peer>,
    /// The broker's token endpoint (`serve --tokens`), e.g.
    /// http://127.0.0.1:8443: where the tokens of routes with
    /// `token_header` are minted.
    pub tokens_url: Option<String>,
    /// Default Delegate terms per peer name.
    #[serde(default)]
    pub routes: BTreeMap<String, Route>,
}

/// An A2A protocol binding the gateway speaks to the agent.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Binding {
    Jsonrpc,
    Grpc,
}

/// One agent the fronted agent may call.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    pub name: String,
    /// Its ed25519 public key (64 hex): the delegate of its contracts.
    pub public_key: String,
    /// Its gateway's ingress base URL.
    pub url: String,
}

/// Default terms of a Delegate to one peer (a message's `terms` win).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Units carved from the parent.
    pub budget: Option<i64>,
    /// Share of the parent's residual, 0 < share <= 1, when `budget` is
    /// not set.
    pub budget_share: Option<f64>,
    /// Child deadline = now + ttl_ms.
    pub ttl_ms: Option<i64>,
    /// Child deadline = the parent's deadline - deadline_margin_ms, when
    /// `ttl_ms` is not set.
    pub deadline_margin_ms: Option<i64>,
    pub task: Option<String>,
    pub predicate: Option<String>,
    pub result_schema_json: Option<String>,
    pub write_scope: Option<Vec<String>>,
    /// A header in which each call to this peer (SendMessage, GetTask,
    /// CancelTask) carries a broker-minted token for `token_resource` (one
    /// of the broker's `[tokens] resources`), minted by the fronted agent
    /// for the contract it delegates the peer's task from.
    /// `Authorization` gets `Bearer <token>`, any other header the token.
    pub token_header: Option<String>,
    pub token_resource: Option<String>,
}

/// Headers the gateway sets on its own calls: a token cannot go in them.
const OWN_HEADERS: [&str; 6] = [
    "content-type",
    "content-length",
    "host",
    "a2a-version",
    "traceparent",
    "tracestate",
];

fn default_authz_paths() -> Vec<String> {
    vec![DEFAULT_AUTHZ_PATH.to_owned()]
}
/// serde's `default = "…"` takes a function: one per constant.
macro_rules! defaults {
    ($($name:ident: $ty:ty = $value:expr;)*) => {$(
        fn $name() -> $ty {
            $value
        }
    )*};
}

defaults! {
    default_poll_ms: u64 = DEFAULT_POLL_MS;
    default_call_timeout_ms: u64 = DEFAULT_CALL_TIMEOUT_MS;
    default_upstream_wait_ms: u64 = DEFAULT_UPSTREAM_WAIT_MS;
    default_max_message_bytes: usize = DEFAULT_MAX_MESSAGE_BYTES;
    default_max_tasks: usize = DEFAULT_MAX_TASKS;
    default_max_in_flight_per_caller: usize = DEFAULT_MAX_IN_FLIGHT_PER_CALLER;
    default_max_in_flight: usize = DEFAULT_MAX_IN_FLIGHT;
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

impl A2aConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut config = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                source,
            },
            other => other,
        })?;
        if config.key_file.is_relative() {
            let base = path.parent().unwrap_or(Path::new("."));
            config.key_file = base.join(&config.key_file);
        }
        Ok(config)
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: String::new(),
            source: Box::new(source),
        })?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), ConfigError> {
        self.check_endpoints()?;
        self.check_bounds()?;
        let names = self.check_peers()?;
        self.check_routes(&names)
    }

    /// URLs, listeners and the paths the authz lets through.
    fn check_endpoints(&self) -> Result<(), ConfigError> {
        for (key, url) in [
            ("broker", Some(&self.broker)),
            ("upstream", self.upstream.as_ref()),
            ("tokens_url", self.tokens_url.as_ref()),
        ] {
            if let Some(url) = url
                && !(url.starts_with("http://") || url.starts_with("https://"))
            {
                return Err(invalid(key, format!("{url:?} is not an http(s) URL")));
            }
        }
        if self.listen.is_some() && self.upstream.is_none() {
            return Err(invalid(
                "upstream",
                "required with listen: the agent the ingress fronts",
            ));
        }
        if self.authz_jsonrpc_paths.is_empty() || self.authz_jsonrpc_paths.len() > MAX_AUTHZ_PATHS {
            return Err(invalid(
                "authz_jsonrpc_paths",
                format!("1 to {MAX_AUTHZ_PATHS} paths"),
            ));
        }
        if let Some(path) = self
            .authz_jsonrpc_paths
            .iter()
            .find(|p| !p.starts_with('/') || p.contains(['?', '#']))
        {
            return Err(invalid(
                "authz_jsonrpc_paths",
                format!("{path:?}: a path begins with / and has no query or fragment"),
            ));
        }
        if self.grpc_listen.is_some() && self.listen.is_none() {
            return Err(invalid(
                "grpc_listen",
                "needs listen (the card is served there)",
            ));
        }
        if self.egress_grpc_listen.is_some() && self.egress_listen.is_none() {
            return Err(invalid(
                "egress_grpc_listen",
                "needs egress_listen (peer cards are served there)",
            ));
        }
        if self.listen.is_none() && self.egress_listen.is_none() && self.authz_listen.is_none() {
            return Err(invalid(
                "listen",
                "nothing to serve: set listen (the ingress), egress_listen or authz_listen",
            ));
        }
        Ok(())
    }

    /// Each bound within its range.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        if !(MIN_POLL_MS..=MAX_POLL_MS).contains(&self.poll_ms) {
            return Err(invalid(
                "poll_ms",
                format!("{} not in {MIN_POLL_MS}..={MAX_POLL_MS}", self.poll_ms),
            ));
        }
        if self.call_timeout_ms == 0 || self.call_timeout_ms > MAX_CALL_TIMEOUT_MS {
            return Err(invalid(
                "call_timeout_ms",
                format!("{} not in 1..={MAX_CALL_TIMEOUT_MS}", self.call_timeout_ms),
            ));
        }
        if self.upstream_wait_ms > MAX_UPSTREAM_WAIT_MS {
            return Err(invalid(
                "upstream_wait_ms",
                format!(
                    "{} not in 0..={MAX_UPSTREAM_WAIT_MS}",
                    self.upstream_wait_ms
                ),
            ));
        }
        if !(MIN_MESSAGE_BYTES..=MAX_MESSAGE_BYTES).contains(&self.max_message_bytes) {
            return Err(invalid(
                "max_message_bytes",
                format!(
                    "{} not in {MIN_MESSAGE_BYTES}..={MAX_MESSAGE_BYTES}",
                    self.max_message_bytes
                ),
            ));
        }
        if self.max_tasks == 0 || self.max_tasks > MAX_TASKS {
            return Err(invalid(
                "max_tasks",
                format!("{} not in 1..={MAX_TASKS}", self.max_tasks),
            ));
        }
        if let Some(share) = self.max_tasks_per_tenant
            && (share == 0 || share > self.max_tasks.min(MAX_TASKS_PER_TENANT))
        {
            return Err(invalid(
                "max_tasks_per_tenant",
                format!(
                    "{share} not in 1..={} (max_tasks)",
                    self.max_tasks.min(MAX_TASKS_PER_TENANT)
                ),
            ));
        }
        for (key, value) in [
            ("max_in_flight_per_caller", self.max_in_flight_per_caller),
            ("max_in_flight", self.max_in_flight),
        ] {
            if value == 0 || value > MAX_IN_FLIGHT {
                return Err(invalid(key, format!("{value} not in 1..={MAX_IN_FLIGHT}")));
            }
        }
        Ok(())
    }

    /// The address book; returns its names.
    fn check_peers(&self) -> Result<HashSet<&str>, ConfigError> {
        if self.peers.len() > MAX_PEERS {
            return Err(invalid("peers", format!("at most {MAX_PEERS}")));
        }
        let mut names = HashSet::new();
        for (i, peer) in self.peers.iter().enumerate() {
            let key = format!("peers[{i}]");
            let plain = !peer.name.is_empty()
                && peer.name.len() <= MAX_PEER_NAME_BYTES
                && peer
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            if !plain {
                return Err(invalid(
                    format!("{key}.name"),
                    format!(
                        "1 to {MAX_PEER_NAME_BYTES} of [A-Za-z0-9._-] (it is a URL path segment)"
                    ),
                ));
            }
            if !names.insert(peer.name.as_str()) {
                return Err(invalid(
                    format!("{key}.name"),
                    format!("{:?} twice", peer.name),
                ));
            }
            if peer.public_key().is_none() {
                return Err(invalid(
                    format!("{key}.public_key"),
                    format!("must be {} hex digits", 2 * size_of::<AgentKey>()),
                ));
            }
            if !(peer.url.starts_with("http://") || peer.url.starts_with("https://")) {
                return Err(invalid(format!("{key}.url"), "not an http(s) URL"));
            }
        }
        Ok(names)
    }

    /// Each route names a peer of the address book, with terms in range.
    fn check_routes(&self, names: &HashSet<&str>) -> Result<(), ConfigError> {
        for (name, route) in &self.routes {
            let key = format!("routes.{name}");
            if !names.contains(name.as_str()) {
                return Err(invalid(&key, "names no peer of the address book"));
            }
            if let Some(share) = route.budget_share
                && !(share > 0.0 && share <= 1.0)
            {
                return Err(invalid(format!("{key}.budget_share"), "must be in (0, 1]"));
            }
            for (field, value) in [
                ("budget", route.budget),
                ("ttl_ms", route.ttl_ms),
                ("deadline_margin_ms", route.deadline_margin_ms),
            ] {
                if value.is_some_and(|v| v < 0) {
                    return Err(invalid(format!("{key}.{field}"), "must not be negative"));
                }
            }
            self.check_token(&key, route)?;
        }
        Ok(())
    }

    /// A route's token settings: both or neither, a header name the
    /// gateway does not set itself, and the endpoint to mint at.
    fn check_token(&self, key: &str, route: &Route) -> Result<(), ConfigError> {
        let header = match (&route.token_header, &route.token_resource) {
            (None, None) => return Ok(()),
            (Some(_), Some(resource)) if resource.is_empty() => {
                return Err(invalid(
                    format!("{key}.token_resource"),
                    "empty: name one of the broker's [tokens] resources",
                ));
            }
            (Some(header), Some(_)) => header,
            _ => {
                return Err(invalid(key, "token_header and token_resource go together"));
            }
        };
        let field = format!("{key}.token_header");
        let name = http::HeaderName::try_from(header.as_str())
            .map_err(|_| invalid(&field, format!("{header:?} is not a header name")))?;
        if OWN_HEADERS.contains(&name.as_str()) {
            return Err(invalid(&field, format!("the gateway sets {name} itself")));
        }
        if self.tokens_url.is_none() {
            return Err(invalid(
                &field,
                "name the broker's token endpoint (tokens_url)",
            ));
        }
        Ok(())
    }

    /// Most tasks followed at once whose contracts are in one broker
    /// tenant's trees.
    pub fn tasks_per_tenant(&self) -> usize {
        self.max_tasks_per_tenant
            .unwrap_or((self.max_tasks / DEFAULT_TASKS_SHARE_DIVISOR).max(1))
    }

    pub fn peer(&self, name: &str) -> Option<&Peer> {
        self.peers.iter().find(|p| p.name == name)
    }
}

impl Peer {
    pub fn public_key(&self) -> Option<AgentKey> {
        hex::decode(&self.public_key).ok()?.try_into().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "broker = \"http://127.0.0.1:1\"\nkey_file = \"k\"\nupstream = \"http://127.0.0.1:2\"\nlisten = \"127.0.0.1:0\"\n";

    #[test]
    fn the_example_in_the_repository_parses() {
        let text = include_str!("../../../examples/a2a/gateway.toml");
        let config = A2aConfig::parse(text).unwrap();
        assert_eq!(config.peers.len(), 1);
        assert_eq!(config.routes["worker-a"].budget, Some(30));
    }

    #[test]
    fn a_minimal_config_takes_the_defaults() {
        let config = A2aConfig::parse(BASE).unwrap();
        assert_eq!(config.poll_ms, DEFAULT_POLL_MS);
        assert!(config.peers.is_empty());
        assert_eq!(
            config.tasks_per_tenant(),
            DEFAULT_MAX_TASKS / DEFAULT_TASKS_SHARE_DIVISOR
        );
        let tiny = A2aConfig::parse(&format!("{BASE}max_tasks = 2\n")).unwrap();
        assert_eq!(tiny.tasks_per_tenant(), 1, "at least one task a tenant");
    }

    #[test]
    fn every_bad_value_is_named() {
        let peer = format!(
            "[[peers]]\nname = \"w\"\npublic_key = \"{}\"\nurl = \"http://x\"\n",
            "ab".repeat(32)
        );
        for (extra, key) in [
            ("poll_ms = 1\n".to_owned(), "poll_ms"),
            (
                "max_tasks_per_tenant = 0\n".to_owned(),
                "max_tasks_per_tenant",
            ),
            (
                "max_tasks = 8\nmax_tasks_per_tenant = 9\n".to_owned(),
                "max_tasks_per_tenant",
            ),
            (
                "[[peers]]\nname = \"a b\"\npublic_key = \"00\"\nurl = \"http://x\"\n".into(),
                "peers[0].name",
            ),
            (
                "[[peers]]\nname = \"w\"\npublic_key = \"00\"\nurl = \"http://x\"\n".into(),
                "peers[0].public_key",
            ),
            (format!("{peer}{peer}"), "peers[1].name"),
            ("[routes.nobody]\nbudget = 1\n".into(), "routes.nobody"),
            (
                format!("{peer}[routes.w]\nbudget_share = 1.5\n"),
                "routes.w.budget_share",
            ),
            (
                format!("{peer}[routes.w]\ntoken_header = \"Authorization\"\n"),
                "routes.w",
            ),
            (
                format!(
                    "{peer}[routes.w]\ntoken_header = \"Authorization\"\ntoken_resource = \"r\"\n"
                ),
                "routes.w.token_header",
            ),
            (
                format!(
                    "tokens_url = \"http://t\"\n{peer}[routes.w]\ntoken_header = \"A2A-Version\"\ntoken_resource = \"r\"\n"
                ),
                "routes.w.token_header",
            ),
            (
                format!(
                    "tokens_url = \"http://t\"\n{peer}[routes.w]\ntoken_header = \"a b\"\ntoken_resource = \"r\"\n"
                ),
                "routes.w.token_header",
            ),
            ("tokens_url = \"ftp://t\"\n".into(), "tokens_url"),
        ] {
            let error = A2aConfig::parse(&format!("{BASE}{extra}"))
                .unwrap_err()
                .to_string();
            assert!(error.starts_with(key), "{key}: {error}");
        }
        assert!(A2aConfig::parse(&format!("{BASE}bogus = 1\n")).is_err());
    }
}
