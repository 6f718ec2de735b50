//! `[identity]`: the issuers whose workload tokens bind agents' keys to
//! identities (BindIdentity), where each issuer's keys come from, and the
//! policy entries that name identities instead of keys.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::core::identity::{IdentityPattern, IssuerKind, IssuerPolicy};

/// Most issuers one configuration trusts.
pub const MAX_IDENTITY_ISSUERS: usize = 16;
/// Most identity patterns in one policy list.
pub const MAX_IDENTITY_PATTERNS: usize = 1_000;
/// How often an issuer's keys are read again (file or URL), by default,
/// and the bounds a configuration may set.
pub const DEFAULT_KEYS_REFRESH_S: u64 = 300;
pub const MIN_KEYS_REFRESH_S: u64 = 10;
pub const MAX_KEYS_REFRESH_S: u64 = 86_400;

/// Where an issuer's keys are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// A JWKS or SPIFFE bundle file (read at start, then every refresh).
    File(PathBuf),
    /// An HTTPS URL serving one (fetched at start, then every refresh).
    Url(String),
}

#[derive(Clone, Debug)]
pub struct IssuerConfig {
    pub policy: IssuerPolicy,
    pub keys: KeySource,
    pub refresh_s: u64,
}

/// `[identity]`: no issuers means BindIdentity is refused.
#[derive(Clone, Debug, Default)]
pub struct IdentityConfig {
    pub issuers: Vec<IssuerConfig>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct FileIdentity {
    issuers: BTreeMap<String, FileIssuer>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileIssuer {
    /// "spiffe" or "oidc".
    kind: String,
    trust_domain: Option<String>,
    issuer: Option<String>,
    #[serde(default)]
    audiences: Vec<String>,
    jwks_file: Option<PathBuf>,
    jwks_url: Option<String>,
    refresh_s: Option<u64>,
}

pub(super) fn identity_config(file: &FileIdentity) -> Result<IdentityConfig, ConfigError> {
    if file.issuers.len() > MAX_IDENTITY_ISSUERS {
        return Err(invalid(
            "identity.issuers",
            format!("at most {MAX_IDENTITY_ISSUERS} issuers"),
        ));
    }
    let mut issuers = Vec::new();
    for (name, issuer) in &file.issuers {
        let field = |key: &str| format!("identity.issuers.{name}.{key}");
        let kind = match (issuer.kind.as_str(), &issuer.trust_domain) {
            ("spiffe", Some(trust_domain)) => IssuerKind::Spiffe {
                trust_domain: trust_domain.clone(),
            },
            ("spiffe", None) => {
                return Err(invalid(
                    field("trust_domain"),
                    "a SPIFFE issuer names its trust domain",
                ));
            }
            ("oidc", None) => IssuerKind::Oidc,
            ("oidc", Some(_)) => {
                return Err(invalid(
                    field("trust_domain"),
                    "only a SPIFFE issuer has a trust domain",
                ));
            }
            (other, _) => {
                return Err(invalid(
                    field("kind"),
                    format!("{other:?} is not \"spiffe\" or \"oidc\""),
                ));
            }
        };
        let policy = IssuerPolicy {
            name: name.clone(),
            kind,
            issuer: issuer.issuer.clone(),
            audiences: issuer.audiences.clone(),
        };
        policy
            .check()
            .map_err(|e| invalid(format!("identity.issuers.{name}"), e.to_string()))?;
        let keys = match (&issuer.jwks_file, &issuer.jwks_url) {
            (Some(path), None) => KeySource::File(path.clone()),
            (None, Some(url)) if url.starts_with("https://") || loopback_http(url) => {
                KeySource::Url(url.clone())
            }
            (None, Some(url)) => {
                return Err(invalid(
                    field("jwks_url"),
                    format!(
                        "{url:?} is not an https:// URL (plain http only on loopback: keys fetched in clear could be replaced)"
                    ),
                ));
            }
            _ => {
                return Err(invalid(
                    format!("identity.issuers.{name}"),
                    "name its keys: jwks_file (a JWKS or SPIFFE bundle file) or jwks_url, one of them",
                ));
            }
        };
        let refresh_s = issuer.refresh_s.unwrap_or(DEFAULT_KEYS_REFRESH_S);
        if !(MIN_KEYS_REFRESH_S..=MAX_KEYS_REFRESH_S).contains(&refresh_s) {
            return Err(invalid(
                field("refresh_s"),
                format!("must be in {MIN_KEYS_REFRESH_S} ..= {MAX_KEYS_REFRESH_S}"),
            ));
        }
        let same =
            issuers.iter().find(
                |other: &&IssuerConfig| match (&other.policy.kind, &policy.kind) {
                    (
                        IssuerKind::Spiffe { trust_domain: a },
                        IssuerKind::Spiffe { trust_domain: b },
                    ) => a == b,
                    (IssuerKind::Oidc, IssuerKind::Oidc) => other.policy.issuer == policy.issuer,
                    _ => false,
                },
            );
        if let Some(other) = same {
            return Err(invalid(
                format!("identity.issuers.{name}"),
                format!(
                    "issuer {} already vouches for the same trust domain or iss: one issuer each",
                    other.policy.name
                ),
            ));
        }
        issuers.push(IssuerConfig {
            policy,
            keys,
            refresh_s,
        });
    }
    Ok(IdentityConfig { issuers })
}

/// `http://` to this machine: 127.0.0.1, [::1] or localhost.
fn loopback_http(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    matches!(host, "127.0.0.1" | "[::1]" | "localhost")
}

/// Parses a list of identity patterns (`[readers] identities`).
pub(super) fn patterns(texts: &[String], field: &str) -> Result<Vec<IdentityPattern>, ConfigError> {
    if texts.len() > MAX_IDENTITY_PATTERNS {
        return Err(invalid(
            field,
            format!("at most {MAX_IDENTITY_PATTERNS} patterns"),
        ));
    }
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            IdentityPattern::parse(text)
                .map_err(|e| invalid(format!("{field}[{i}]"), e.to_string()))
        })
        .collect()
}
