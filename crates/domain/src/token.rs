//! Tokens for resource servers, as pure rules: what a holder's assertion
//! must say (RFC 7523-style, EdDSA, checked here except its signature),
//! whether a chain still stands (every contract from the root down open
//! and before its deadline), and the claims of a minted token — RFC 8693's
//! nested `act` for the delegators, RFC 9068's `client_id`, and the
//! Transaction Tokens draft's `txn` (the tree) and `tctx` (the hop's
//! terms). The token endpoint loads, verifies signatures and signs; every
//! decision is made here.

use serde_json::{Map, Value, json};

use crate::limits::{MAX_ASSERTION_LIFETIME_S, MAX_JTI_BYTES, MAX_RESOURCE_BYTES, MIN_JTI_BYTES};
use crate::{AgentKey, Id, Status};

/// RFC 8693's grant type: the only one the endpoint serves.
pub const GRANT_TYPE: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// RFC 8693's type of a JWT: the subject token (the holder's assertion)
/// and the issued token.
pub const JWT_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:jwt";
/// The JOSE `typ` of a minted token (RFC 9068: a JWT access token).
pub const ACCESS_TOKEN_TYP: &str = "at+jwt";
/// Clock difference allowed between a holder and the broker on `iat`
/// and `exp`.
pub const CLOCK_SKEW_S: i64 = 30;

/// Why a token request or assertion is refused: RFC 6749 §5.2's error
/// codes (plus RFC 8707's `invalid_target`), each with a description
/// naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    InvalidClient(String),
    #[error("{0}")]
    InvalidGrant(String),
    #[error("{0}")]
    UnsupportedGrantType(String),
    #[error("{0}")]
    InvalidTarget(String),
}

impl TokenError {
    /// The `error` member of the JSON answer.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => "invalid_request",
            Self::InvalidClient(_) => "invalid_client",
            Self::InvalidGrant(_) => "invalid_grant",
            Self::UnsupportedGrantType(_) => "unsupported_grant_type",
            Self::InvalidTarget(_) => "invalid_target",
        }
    }
}

/// What a holder's assertion claims, once its shape is checked. Its
/// signature is checked next, under `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assertion {
    /// The signer: `iss` (= `sub`), the holder's public key in hex.
    pub key: AgentKey,
    /// `contract_id` (hex): the contract the token is for.
    pub contract: Id,
    pub jti: String,
    /// `exp`, in seconds since the epoch: the replay cache keeps the
    /// `jti` until then.
    pub exp_s: i64,
}

/// Checks an assertion's claims: `iss` = `sub` = a 64-hex public key,
/// `aud` the token endpoint (a string or an array holding it), `exp`
/// in the future and at most `MAX_ASSERTION_LIFETIME_S` away, `iat` not
/// in the future, a `jti` of `MIN_JTI_BYTES..=MAX_JTI_BYTES`, and the
/// `contract_id`.
pub fn read_assertion(
    claims: &Map<String, Value>,
    token_endpoint: &str,
    now_ms: i64,
) -> Result<Assertion, TokenError> {
    let grant = TokenError::InvalidGrant;
    let text = |name: &str| claims.get(name).and_then(Value::as_str);
    let iss = text("iss").ok_or_else(|| grant("the assertion has no iss".into()))?;
    if text("sub") != Some(iss) {
        return Err(grant(
            "the assertion's sub is not its iss (the holder's public key)".into(),
        ));
    }
    let key = hex32(iss).ok_or_else(|| {
        grant("the assertion's iss is not a public key (64 hex characters)".into())
    })?;
    let audience_matches = match claims.get("aud") {
        Some(Value::String(aud)) => aud == token_endpoint,
        Some(Value::Array(auds)) => auds.iter().any(|a| a.as_str() == Some(token_endpoint)),
        _ => false,
    };
    if !audience_matches {
        return Err(grant(format!(
            "the assertion's aud is not the token endpoint {token_endpoint:?}"
        )));
    }
    let now_s = now_ms.div_euclid(1000);
    let exp_s = claims
        .get("exp")
        .and_then(Value::as_i64)
        .ok_or_else(|| grant("the assertion has no exp (seconds since the epoch)".into()))?;
    if exp_s + CLOCK_SKEW_S <= now_s {
        return Err(grant(format!(
            "the assertion expired at {exp_s} (now {now_s})"
        )));
    }
    if exp_s > now_s + MAX_ASSERTION_LIFETIME_S + CLOCK_SKEW_S {
        return Err(grant(format!(
            "the assertion's exp is more than {MAX_ASSERTION_LIFETIME_S} s away"
        )));
    }
    if let Some(iat) = claims.get("iat") {
        match iat.as_i64() {
            Some(iat) if iat <= now_s + CLOCK_SKEW_S => {}
            _ => return Err(grant("the assertion's iat is in the future".into())),
        }
    }
    let jti = text("jti").ok_or_else(|| grant("the assertion has no jti".into()))?;
    if !(MIN_JTI_BYTES..=MAX_JTI_BYTES).contains(&jti.len()) {
        return Err(grant(format!(
            "the assertion's jti must be {MIN_JTI_BYTES}..={MAX_JTI_BYTES} bytes"
        )));
    }
    let contract = text("contract_id").and_then(hex32).ok_or_else(|| {
        grant("the assertion's contract_id is not a contract id (64 hex characters)".into())
    })?;
    Ok(Assertion {
        key,
        contract,
        jti: jti.to_owned(),
        exp_s,
    })
}

/// A 32-byte id or key from its 64 hex digits.
pub fn hex32(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

/// Refuses a resource outside the configured allow-list (RFC 8707's
/// `invalid_target`).
pub fn check_resource(resource: &str, allowed: &[String]) -> Result<(), TokenError> {
    if resource.is_empty() {
        return Err(TokenError::InvalidRequest(
            "name the resource the token is for (resource or audience)".into(),
        ));
    }
    if resource.len() > MAX_RESOURCE_BYTES || !allowed.iter().any(|a| a == resource) {
        return Err(TokenError::InvalidTarget(format!(
            "{:?} is not a resource this broker mints tokens for",
            resource.chars().take(128).collect::<String>()
        )));
    }
    Ok(())
}

/// One contract of a chain, as the token endpoint loaded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    pub id: Id,
    pub delegate: AgentKey,
    /// How tokens name its delegate: its workload identity when bound,
    /// else its key id.
    pub subject: String,
    pub status: Status,
    pub deadline_ms: i64,
    pub depth: u32,
    pub lineage_hash: [u8; 32],
    pub trust_ppm: u32,
    /// Budget - reserved - spent, now.
    pub residual: i64,
    pub write_scope: Vec<String>,
    /// The host that executes the delegate's calls, once named, with how
    /// tokens name it (its key id): it may mint for the contract too
    /// (the MCP gateway attaching a token to the tool calls it forwards).
    pub host: Option<(AgentKey, String)>,
}

/// Whether a chain (root first) still stands at `now_ms`: every contract
/// open and before its deadline. The refusal names the first that is not.
pub fn still_stands(chain: &[Hop], now_ms: i64) -> Result<(), String> {
    let Some(last) = chain.last() else {
        return Err("no such contract".into());
    };
    for hop in chain {
        let which = if hop.id == last.id {
            "the contract".to_owned()
        } else {
            format!("its ancestor {} (depth {})", hex::encode(hop.id), hop.depth)
        };
        if !hop.status.is_open() {
            return Err(format!("{which} is {}", hop.status.as_str()));
        }
        if hop.deadline_ms <= now_ms {
            return Err(format!("{which} is past its deadline"));
        }
    }
    Ok(())
}

/// What a minted token is for and how long it may live.
#[derive(Debug, Clone)]
pub struct Grant<'a> {
    /// The key that proved possession (the assertion's signer).
    pub holder: AgentKey,
    pub resource: &'a str,
    /// `iss`: the broker's issuer URL.
    pub issuer: &'a str,
    pub now_ms: i64,
    pub lifetime_s: i64,
    /// A fresh random id for the token's `jti`.
    pub jti: String,
}

/// The claims of the token minted for `chain`'s last contract (root
/// first), or why none is: the holder is not its delegate, or a contract
/// of the chain no longer stands.
pub fn mint(chain: &[Hop], grant: &Grant<'_>) -> Result<Map<String, Value>, TokenError> {
    let Some(held) = chain.last() else {
        return Err(TokenError::InvalidGrant("no such contract".into()));
    };
    let host = held
        .host
        .as_ref()
        .filter(|(key, _)| *key == grant.holder && held.delegate != grant.holder);
    if held.delegate != grant.holder && host.is_none() {
        return Err(TokenError::InvalidGrant(
            "the assertion's signer does not hold this contract (it is neither its delegate nor its host)".into(),
        ));
    }
    still_stands(chain, grant.now_ms).map_err(TokenError::InvalidGrant)?;
    let now_s = grant.now_ms.div_euclid(1000);
    // Never past the contract's deadline: a token must not outlive what
    // it stands for.
    let exp_s = (now_s + grant.lifetime_s).min(held.deadline_ms.div_euclid(1000));
    if exp_s <= now_s {
        return Err(TokenError::InvalidGrant(
            "the contract's deadline is less than a second away".into(),
        ));
    }
    let mut claims = Map::new();
    claims.insert("iss".into(), grant.issuer.into());
    claims.insert("sub".into(), held.subject.clone().into());
    claims.insert("aud".into(), grant.resource.into());
    claims.insert("iat".into(), now_s.into());
    claims.insert("exp".into(), exp_s.into());
    claims.insert("jti".into(), grant.jti.clone().into());
    // RFC 9068: the client the token went to — the host, when the host
    // minted it for the delegate's calls it executes.
    let client = host.map_or(&held.subject, |(_, name)| name);
    claims.insert("client_id".into(), client.clone().into());
    claims.insert("txn".into(), hex::encode(chain[0].id).into());
    let delegators = actors(&chain[..chain.len() - 1]);
    // RFC 8693: the current actor outermost — the host acting for the
    // delegate, then the delegators.
    let act = match host {
        Some((_, name)) => {
            let mut act = Map::new();
            act.insert("sub".into(), name.clone().into());
            act.insert("host".into(), true.into());
            if let Some(delegators) = delegators {
                act.insert("act".into(), delegators);
            }
            Some(Value::Object(act))
        }
        None => delegators,
    };
    if let Some(act) = act {
        claims.insert("act".into(), act);
    }
    claims.insert(
        "tctx".into(),
        json!({
            "contract_id": hex::encode(held.id),
            "root_id": hex::encode(chain[0].id),
            "depth": held.depth,
            "lineage_hash": hex::encode(held.lineage_hash),
            "trust_ppm": held.trust_ppm,
            "residual": held.residual,
            "deadline_ms": held.deadline_ms,
            "write_scope": held.write_scope,
        }),
    );
    Ok(claims)
}

/// RFC 8693's `act`: the nearest delegator outermost, each earlier one
/// nested inside, the root's holder innermost.
fn actors(delegators: &[Hop]) -> Option<Value> {
    delegators.iter().fold(None, |inner, hop| {
        let mut act = Map::new();
        act.insert("sub".into(), hop.subject.clone().into());
        act.insert("contract_id".into(), hex::encode(hop.id).into());
        if let Some(inner) = inner {
            act.insert("act".into(), inner);
        }
        Some(Value::Object(act))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_MS: i64 = 1_800_000_000_000;
    const ENDPOINT: &str = "http://broker.test/token";

    fn hop(n: u8, status: Status) -> Hop {
        Hop {
            id: [n; 32],
            delegate: [n + 100; 32],
            subject: format!("agent-{n}"),
            status,
            deadline_ms: NOW_MS + 3_600_000,
            depth: u32::from(n),
            lineage_hash: [9; 32],
            trust_ppm: 900_000,
            residual: 40,
            write_scope: vec!["src/".into()],
            host: Some(([n + 200; 32], format!("host-{n}"))),
        }
    }

    fn chain() -> Vec<Hop> {
        (0..4).map(|n| hop(n, Status::Accepted)).collect()
    }

    fn grant<'a>() -> Grant<'a> {
        Grant {
            holder: [103; 32],
            resource: "https://api.test",
            issuer: "http://broker.test",
            now_ms: NOW_MS,
            lifetime_s: 300,
            jti: "j".into(),
        }
    }

    fn assertion() -> Map<String, Value> {
        let key = hex::encode([5u8; 32]);
        let Value::Object(map) = json!({
            "iss": key, "sub": key, "aud": ENDPOINT,
            "exp": NOW_MS / 1000 + 60, "iat": NOW_MS / 1000,
            "jti": "0123456789abcdef", "contract_id": hex::encode([3u8; 32]),
        }) else {
            unreachable!()
        };
        map
    }

    #[test]
    fn the_act_chain_nests_from_the_parent_to_the_root() {
        let claims = mint(&chain(), &grant()).unwrap();
        assert_eq!(claims["sub"], "agent-3");
        assert_eq!(claims["act"]["sub"], "agent-2");
        assert_eq!(claims["act"]["act"]["sub"], "agent-1");
        assert_eq!(claims["act"]["act"]["act"]["sub"], "agent-0");
        assert!(claims["act"]["act"]["act"].get("act").is_none());
        assert_eq!(claims["tctx"]["depth"], 3);
        assert_eq!(claims["tctx"]["residual"], 40);
        assert_eq!(claims["txn"], hex::encode([0u8; 32]));
        assert_eq!(claims["exp"], NOW_MS / 1000 + 300);
        let root = mint(
            &chain()[..1],
            &Grant {
                holder: [100; 32],
                ..grant()
            },
        )
        .unwrap();
        assert!(root.get("act").is_none());
    }

    #[test]
    fn the_host_mints_for_the_delegate_and_acts_outermost() {
        let by_host = mint(
            &chain(),
            &Grant {
                holder: [203; 32],
                ..grant()
            },
        )
        .unwrap();
        assert_eq!(by_host["sub"], "agent-3");
        assert_eq!(by_host["client_id"], "host-3");
        assert_eq!(by_host["act"]["sub"], "host-3");
        assert_eq!(by_host["act"]["host"], true);
        assert_eq!(by_host["act"]["act"]["sub"], "agent-2");
        // Another contract's host holds nothing here.
        let other = mint(
            &chain(),
            &Grant {
                holder: [202; 32],
                ..grant()
            },
        );
        assert!(matches!(other, Err(TokenError::InvalidGrant(_))));
        let mut unhosted = chain();
        unhosted[3].host = None;
        assert!(
            mint(
                &unhosted,
                &Grant {
                    holder: [203; 32],
                    ..grant()
                }
            )
            .is_err()
        );
    }

    #[test]
    fn a_token_never_outlives_its_contract() {
        let mut chain = chain();
        chain[3].deadline_ms = NOW_MS + 42_500;
        assert_eq!(mint(&chain, &grant()).unwrap()["exp"], NOW_MS / 1000 + 42);
        chain[3].deadline_ms = NOW_MS + 900;
        assert!(matches!(
            mint(&chain, &grant()),
            Err(TokenError::InvalidGrant(_))
        ));
    }

    #[test]
    fn only_the_holder_of_a_standing_chain_gets_one() {
        let stranger = Grant {
            holder: [1; 32],
            ..grant()
        };
        assert!(
            matches!(mint(&chain(), &stranger), Err(TokenError::InvalidGrant(m)) if m.contains("does not hold"))
        );
        for status in [
            Status::Revoked,
            Status::Completed,
            Status::Declined,
            Status::Expired,
        ] {
            let mut chain = chain();
            chain[1].status = status;
            let Err(TokenError::InvalidGrant(why)) = mint(&chain, &grant()) else {
                panic!("{status:?} above still minted");
            };
            assert!(
                why.contains("ancestor") && why.contains(status.as_str()),
                "{why}"
            );
        }
        let mut overdue = chain();
        overdue[0].deadline_ms = NOW_MS;
        assert!(
            still_stands(&overdue, NOW_MS)
                .unwrap_err()
                .contains("deadline")
        );
    }

    #[test]
    fn an_assertion_is_read_only_when_every_claim_holds() {
        let read = read_assertion(&assertion(), ENDPOINT, NOW_MS).unwrap();
        assert_eq!(read.key, [5; 32]);
        assert_eq!(read.contract, [3; 32]);
        let broken: [(&str, Value); 8] = [
            ("aud", json!("http://elsewhere/token")),
            ("exp", json!(NOW_MS / 1000 - 31)),
            ("exp", json!(NOW_MS / 1000 + 400)),
            ("iat", json!(NOW_MS / 1000 + 60)),
            ("jti", json!("short")),
            ("sub", json!("someone else")),
            ("iss", json!("not hex")),
            ("contract_id", json!("abc")),
        ];
        for (name, value) in broken {
            let mut claims = assertion();
            claims.insert(name.into(), value.clone());
            assert!(
                matches!(
                    read_assertion(&claims, ENDPOINT, NOW_MS),
                    Err(TokenError::InvalidGrant(_))
                ),
                "{name} = {value}"
            );
        }
        let mut listed = assertion();
        listed.insert("aud".into(), json!(["x", ENDPOINT]));
        assert!(read_assertion(&listed, ENDPOINT, NOW_MS).is_ok());
    }

    #[test]
    fn resources_come_from_the_allow_list() {
        let allowed = vec!["https://api.test".to_owned()];
        assert!(check_resource("https://api.test", &allowed).is_ok());
        assert_eq!(
            check_resource("https://evil.test", &allowed)
                .unwrap_err()
                .code(),
            "invalid_target"
        );
        assert_eq!(
            check_resource("", &allowed).unwrap_err().code(),
            "invalid_request"
        );
    }
}
