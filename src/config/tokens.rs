//! `[tokens]`: the token endpoint's settings (`serve --tokens ADDR`) —
//! which resources tokens are minted for, how long they live, what they
//! name as their issuer, and which resource servers may introspect.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::core::limits::{MAX_RESOURCE_BYTES, MAX_TOKEN_LIFETIME_MINUTES};
use crate::tokens::replay::MAX_REMEMBERED_ASSERTIONS;

/// Most resources and most introspecting clients listed.
pub const MAX_TOKEN_ENTRIES: usize = 1_000;
/// Longest introspecting client id, in bytes.
pub const MAX_CLIENT_ID_BYTES: usize = 128;
/// A minted token's lifetime when `lifetime_minutes` is not set.
pub const DEFAULT_TOKEN_LIFETIME_MINUTES: u32 = 5;
/// Unexpired assertions one key may have in the replay memory when
/// `max_assertions_per_key` is not set: far above one holder's needs (an
/// assertion lives at most 300 s, a token minutes), so one holder cannot
/// fill the memory alone.
pub const DEFAULT_MAX_ASSERTIONS_PER_KEY: usize = 1_000;

#[derive(Clone, Debug, Default)]
pub struct TokensConfig {
    /// The `iss` of minted tokens and the metadata's `issuer`: the URL
    /// resource servers reach the endpoint at. `None`: `http://ADDR` of
    /// the listener (right only when they reach it directly).
    pub issuer: Option<String>,
    /// The audiences (`resource` or `audience` parameters) tokens may be
    /// minted for; nothing is minted while it is empty.
    pub resources: Vec<String>,
    /// Longest a token lives (it never outlives its contract either).
    pub lifetime_minutes: u32,
    /// Resource servers that may call introspection (HTTP Basic): client
    /// id → SHA-256 of its secret.
    pub introspectors: BTreeMap<String, [u8; 32]>,
    /// Unexpired assertions one key may have in the replay memory; past
    /// it, its next exchange is answered 503 until some expire.
    pub max_assertions_per_key: usize,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct FileTokens {
    issuer: Option<String>,
    resources: Vec<String>,
    lifetime_minutes: Option<u32>,
    /// Client id → hex SHA-256 of its secret (`printf %s "$secret" |
    /// sha256sum`): the secret itself is not kept here.
    introspectors: BTreeMap<String, String>,
    max_assertions_per_key: Option<usize>,
}

pub(super) fn tokens_config(file: &FileTokens) -> Result<TokensConfig, ConfigError> {
    if file.resources.len() > MAX_TOKEN_ENTRIES || file.introspectors.len() > MAX_TOKEN_ENTRIES {
        return Err(invalid(
            "tokens",
            format!("at most {MAX_TOKEN_ENTRIES} resources and {MAX_TOKEN_ENTRIES} introspectors"),
        ));
    }
    if let Some(issuer) = &file.issuer
        && !(issuer.starts_with("https://") || issuer.starts_with("http://"))
    {
        return Err(invalid(
            "tokens.issuer",
            format!("{issuer:?} is not an http(s) URL"),
        ));
    }
    for (i, resource) in file.resources.iter().enumerate() {
        if resource.is_empty()
            || resource.len() > MAX_RESOURCE_BYTES
            || resource.chars().any(char::is_control)
        {
            return Err(invalid(
                format!("tokens.resources[{i}]"),
                format!("a resource is 1 ..= {MAX_RESOURCE_BYTES} bytes, no control characters"),
            ));
        }
    }
    let lifetime_minutes = file
        .lifetime_minutes
        .unwrap_or(DEFAULT_TOKEN_LIFETIME_MINUTES);
    if !(1..=MAX_TOKEN_LIFETIME_MINUTES).contains(&lifetime_minutes) {
        return Err(invalid(
            "tokens.lifetime_minutes",
            format!("must be in 1 ..= {MAX_TOKEN_LIFETIME_MINUTES}"),
        ));
    }
    let max_assertions_per_key = file
        .max_assertions_per_key
        .unwrap_or(DEFAULT_MAX_ASSERTIONS_PER_KEY);
    if !(1..=MAX_REMEMBERED_ASSERTIONS).contains(&max_assertions_per_key) {
        return Err(invalid(
            "tokens.max_assertions_per_key",
            format!("must be in 1 ..= {MAX_REMEMBERED_ASSERTIONS}"),
        ));
    }
    let mut introspectors = BTreeMap::new();
    for (id, digest) in &file.introspectors {
        let field = format!("tokens.introspectors.{id}");
        // HTTP Basic splits the id from the secret at the first colon.
        if id.is_empty()
            || id.len() > MAX_CLIENT_ID_BYTES
            || id.contains(':')
            || id.chars().any(char::is_control)
        {
            return Err(invalid(
                field,
                format!("a client id is 1 ..= {MAX_CLIENT_ID_BYTES} bytes, no colon"),
            ));
        }
        let mut sha256 = [0u8; 32];
        hex::decode_to_slice(digest.trim(), &mut sha256).map_err(|_| {
            invalid(
                &field,
                "not a SHA-256 in hex (printf %s \"$secret\" | sha256sum)",
            )
        })?;
        introspectors.insert(id.clone(), sha256);
    }
    Ok(TokensConfig {
        issuer: file.issuer.clone(),
        resources: file.resources.clone(),
        lifetime_minutes,
        introspectors,
        max_assertions_per_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(file: FileTokens) -> String {
        tokens_config(&file).unwrap_err().to_string()
    }

    #[test]
    fn bounds_take_their_defaults_and_out_of_range_values_are_named() {
        let config = tokens_config(&FileTokens::default()).unwrap();
        assert_eq!(config.lifetime_minutes, DEFAULT_TOKEN_LIFETIME_MINUTES);
        assert_eq!(
            config.max_assertions_per_key,
            DEFAULT_MAX_ASSERTIONS_PER_KEY
        );
        for share in [0, MAX_REMEMBERED_ASSERTIONS + 1] {
            let file = FileTokens {
                max_assertions_per_key: Some(share),
                ..FileTokens::default()
            };
            assert!(refusal(file).contains("tokens.max_assertions_per_key"));
        }
        let file = FileTokens {
            lifetime_minutes: Some(0),
            ..FileTokens::default()
        };
        assert!(refusal(file).contains("tokens.lifetime_minutes"));
    }
}
