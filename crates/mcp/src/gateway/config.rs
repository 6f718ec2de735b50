//! The gateway's configuration file (TOML): the broker, the host key, the
//! upstream tool servers and, per tool, what a call reads, mutates and
//! costs. Every value is checked at start, with the key named.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Most upstream servers one gateway fronts.
pub const MAX_SERVERS: usize = 16;
/// Most argument names a tool's `reads` or `mutates` lists.
pub const MAX_PATH_ARGUMENTS: usize = 8;
/// Longest a call to an upstream tool may take, at most (the config's
/// `call_timeout_ms` is at most this).
pub const MAX_CALL_TIMEOUT_MS: u64 = 600_000;
/// `call_timeout_ms` when the config does not say.
pub const DEFAULT_CALL_TIMEOUT_MS: u64 = 30_000;
/// Largest metered units per call (the broker's per-observation cap).
pub const MAX_UNITS: i64 = broker_domain::limits::MAX_BUDGET_UNITS;
/// Longest server name, in bytes: a server's name prefixes its tools'
/// names (`<server>.<tool>`) in the receipts, whose tool names the broker
/// bounds (`limits::MAX_TOOL_NAME_BYTES`); a short prefix leaves the room
/// to the tool's own name.
pub const MAX_SERVER_NAME_BYTES: usize = 64;

/// What happens to a mutation outside the contract's write scope.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OutOfScope {
    /// Refused before it reaches the tool server (a tool error).
    #[default]
    Refuse,
    /// Let through and recorded: the judgment then says
    /// `within_scope = false`.
    Record,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// The broker's address, e.g. http://127.0.0.1:50051.
    pub broker: String,
    /// The host key (a hex seed, as `keygen` writes it): it signs the
    /// receipts. Relative to the config file.
    pub key_file: PathBuf,
    #[serde(default)]
    pub out_of_scope: OutOfScope,
    /// The contract (64 hex) this gateway hosts; without it, the one open
    /// contract whose host is the key.
    pub contract: Option<String>,
    #[serde(default = "default_call_timeout_ms")]
    pub call_timeout_ms: u64,
    /// Resolved-path mode: the folder the tool servers' paths are in
    /// (relative to the config file). Each path a call names is resolved
    /// under it as the file system would (symlinks followed); one that
    /// lands outside is refused, and the write scope is checked on where
    /// it lands. Without it, on the path's text.
    pub resolve_root: Option<PathBuf>,
    /// The broker's token endpoint (`serve --tokens`), for servers with
    /// `token_header`: e.g. http://127.0.0.1:8443.
    pub tokens_url: Option<String>,
    #[serde(default)]
    pub servers: Vec<ServerConfig>,
    /// Per tool, keyed `"<server>.<tool>"`.
    #[serde(default)]
    pub tools: BTreeMap<String, ToolRule>,
}

fn default_call_timeout_ms() -> u64 {
    DEFAULT_CALL_TIMEOUT_MS
}

/// One upstream MCP server: a command run with stdio, or a streamable
/// HTTP URL.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub name: String,
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub url: Option<String>,
    /// A url server only: each tool call carries a token minted for the
    /// call's contract in this header (`Authorization` as `Bearer …`),
    /// for the resource `token_resource` (one of the broker's `[tokens]
    /// resources`).
    pub token_header: Option<String>,
    pub token_resource: Option<String>,
    /// A url server only: keep its connections open for the next call
    /// (default). Off opens one a call, for a server that answers a
    /// reused connection late (one that writes without `TCP_NODELAY`
    /// waits for the gateway's delayed ACK, ~40 ms).
    #[serde(default = "default_keep_alive")]
    pub keep_alive: bool,
}

fn default_keep_alive() -> bool {
    true
}

/// What one tool's calls read, mutate and cost.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ToolRule {
    /// Argument names whose values (a string, or a list of strings) are
    /// paths the call mutates.
    #[serde(default)]
    pub mutates: Vec<String>,
    /// Argument names whose values are paths the call reads.
    #[serde(default)]
    pub reads: Vec<String>,
    /// Metered units of every call.
    pub units: Option<i64>,
    /// Or: the units are the number at this key of the result's
    /// structured content.
    pub units_from: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    path: String,
    message: String,
}

impl GatewayConfig {
    /// Reads and checks the file; relative paths are taken from its folder.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let error = |message: String| ConfigError {
            path: path.display().to_string(),
            message,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| error(format!("cannot read it: {e}")))?;
        let mut config: GatewayConfig = toml::from_str(&text).map_err(|e| error(e.to_string()))?;
        config.check().map_err(error)?;
        let base = path.parent().unwrap_or(Path::new("."));
        if config.key_file.is_relative() {
            config.key_file = base.join(&config.key_file);
        }
        if let Some(root) = &config.resolve_root {
            // Canonical, so a resolved path is compared with the root
            // the file system reaches, symlinks and all.
            let canonical = std::fs::canonicalize(base.join(root))
                .map_err(|e| error(format!("resolve_root: {}: {e}", root.display())))?;
            config.resolve_root = Some(canonical);
        }
        Ok(config)
    }

    /// Every rule a config must keep, the offending key named.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_CALL_TIMEOUT_MS).contains(&self.call_timeout_ms) {
            return Err(format!(
                "call_timeout_ms: {} is not in 1 ..= {MAX_CALL_TIMEOUT_MS}",
                self.call_timeout_ms
            ));
        }
        if let Some(contract) = &self.contract
            && hex::decode(contract).map_or(true, |b| b.len() != 32)
        {
            return Err(format!(
                "contract: {contract:?} is not a 64-hex contract id"
            ));
        }
        if self.servers.is_empty() || self.servers.len() > MAX_SERVERS {
            return Err(format!(
                "servers: {} given, 1 ..= {MAX_SERVERS} allowed",
                self.servers.len()
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, server) in self.servers.iter().enumerate() {
            let valid = !server.name.is_empty()
                && server.name.len() <= MAX_SERVER_NAME_BYTES
                && server
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(format!(
                    "servers[{i}].name: {:?} must be 1 to {MAX_SERVER_NAME_BYTES} of A-Z a-z 0-9 _ -",
                    server.name
                ));
            }
            if !names.insert(server.name.as_str()) {
                return Err(format!(
                    "servers[{i}].name: {:?} is used twice",
                    server.name
                ));
            }
            check_server(i, server, self.tokens_url.is_some())?;
        }
        for (key, rule) in &self.tools {
            let known = key
                .split_once('.')
                .is_some_and(|(server, tool)| names.contains(server) && !tool.is_empty());
            if !known {
                return Err(format!(
                    "tools.\"{key}\": keys are \"<server>.<tool>\" with a server named under [[servers]]"
                ));
            }
            if rule.mutates.len() > MAX_PATH_ARGUMENTS || rule.reads.len() > MAX_PATH_ARGUMENTS {
                return Err(format!(
                    "tools.\"{key}\": at most {MAX_PATH_ARGUMENTS} argument names in reads and in mutates"
                ));
            }
            match (rule.units, &rule.units_from) {
                (Some(_), Some(_)) => {
                    return Err(format!(
                        "tools.\"{key}\": give units or units_from, not both"
                    ));
                }
                (Some(units), None) if !(0..=MAX_UNITS).contains(&units) => {
                    return Err(format!(
                        "tools.\"{key}\".units: {units} is not in 0 ..= {MAX_UNITS}"
                    ));
                }
                (None, Some(from)) if from.is_empty() => {
                    return Err(format!("tools.\"{key}\".units_from: empty"));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// One `[[servers]]` entry's transport and token settings, `i` its index.
fn check_server(i: usize, server: &ServerConfig, tokens_url: bool) -> Result<(), String> {
    match (&server.command, &server.url) {
        (Some(_), None) if !server.keep_alive => {
            return Err(format!(
                "servers[{i}].keep_alive: a command's stdio has no connections to keep"
            ));
        }
        (Some(_), None) => {}
        (None, Some(url)) if url.starts_with("http://") || url.starts_with("https://") => {
            if !server.args.is_empty() || !server.env.is_empty() {
                return Err(format!(
                    "servers[{i}]: args and env are for a command, not a url"
                ));
            }
        }
        (None, Some(url)) => {
            return Err(format!("servers[{i}].url: {url:?} is not an http(s) URL"));
        }
        _ => return Err(format!("servers[{i}]: give exactly one of command and url")),
    }
    match (&server.token_header, &server.token_resource) {
        (None, None) => {}
        (Some(_), Some(_)) if server.url.is_none() => {
            return Err(format!(
                "servers[{i}].token_header: a token goes with a url server's HTTP requests"
            ));
        }
        (Some(_), Some(_)) if !tokens_url => {
            return Err(format!(
                "servers[{i}].token_header: name the broker's token endpoint (tokens_url)"
            ));
        }
        (Some(_), Some(_)) => {}
        _ => {
            return Err(format!(
                "servers[{i}]: token_header and token_resource go together"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GatewayConfig, String> {
        let config: GatewayConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.check().map(|()| config)
    }

    const BASE: &str = "broker = \"http://127.0.0.1:1\"\nkey_file = \"k\"\n";

    #[test]
    fn a_full_config_parses() {
        let config = parse(&format!(
            "{BASE}out_of_scope = \"record\"\n[[servers]]\nname = \"fs\"\ncommand = \"python3\"\nargs = [\"s.py\"]\n\
             [[servers]]\nname = \"web\"\nurl = \"http://127.0.0.1:9/mcp\"\n\
             [tools.\"fs.write_file\"]\nmutates = [\"path\"]\nunits = 2\n[tools.\"web.get\"]\nunits_from = \"units\"\n"
        ))
        .expect("valid");
        assert_eq!(config.out_of_scope, OutOfScope::Record);
        assert_eq!(config.call_timeout_ms, DEFAULT_CALL_TIMEOUT_MS);
        assert_eq!(config.tools["fs.write_file"].units, Some(2));
        assert!(config.servers[1].keep_alive, "kept by default");
    }

    #[test]
    fn the_readme_example_is_a_valid_config() {
        let config: GatewayConfig =
            toml::from_str(include_str!("../../../../examples/mcp/gateway.toml")).expect("parses");
        config.check().expect("valid");
        assert_eq!(config.servers.len(), 1);
    }

    #[test]
    fn each_mistake_names_its_key() {
        let server = "[[servers]]\nname = \"fs\"\ncommand = \"x\"\n";
        for (text, needle) in [
            (BASE.to_string(), "servers: 0 given"),
            (format!("{BASE}{server}{server}"), "is used twice"),
            (
                format!("{BASE}[[servers]]\nname = \"a b\"\ncommand = \"x\"\n"),
                "servers[0].name",
            ),
            (
                format!("{BASE}[[servers]]\nname = \"a\"\n"),
                "exactly one of command and url",
            ),
            (
                format!("{BASE}[[servers]]\nname = \"a\"\nurl = \"ftp://x\"\n"),
                "servers[0].url",
            ),
            (
                format!("{BASE}{server}keep_alive = false\n"),
                "servers[0].keep_alive",
            ),
            (
                format!("{BASE}{server}[tools.\"other.t\"]\nunits = 1\n"),
                "tools.\"other.t\"",
            ),
            (
                format!("{BASE}{server}[tools.\"fs.t\"]\nunits = -1\n"),
                "units: -1",
            ),
            (
                format!("{BASE}{server}[tools.\"fs.t\"]\nunits = 1\nunits_from = \"u\"\n"),
                "not both",
            ),
            (
                format!("{BASE}call_timeout_ms = 0\n{server}"),
                "call_timeout_ms",
            ),
            (format!("{BASE}contract = \"zz\"\n{server}"), "contract"),
            (
                format!(
                    "{BASE}[[servers]]\nname = \"w\"\nurl = \"http://t/mcp\"\ntoken_header = \"Authorization\"\n"
                ),
                "token_header and token_resource go together",
            ),
            (
                format!(
                    "{BASE}[[servers]]\nname = \"w\"\nurl = \"http://t/mcp\"\ntoken_header = \"Authorization\"\ntoken_resource = \"r\"\n"
                ),
                "tokens_url",
            ),
            (
                format!(
                    "{BASE}tokens_url = \"http://b\"\n[[servers]]\nname = \"w\"\ncommand = \"x\"\ntoken_header = \"A\"\ntoken_resource = \"r\"\n"
                ),
                "a url server",
            ),
            (format!("{BASE}colour = 1\n{server}"), "unknown field"),
        ] {
            let error = parse(&text).expect_err(&text);
            assert!(
                error.contains(needle),
                "{text}\n→ {error}\n(expected {needle:?})"
            );
        }
    }
}
