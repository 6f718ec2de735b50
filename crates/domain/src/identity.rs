//! Workload identities as pure rules: what a token from a trusted issuer
//! (a SPIFFE JWT-SVID, a Kubernetes service-account token, a cloud OIDC
//! token) must say for an agent to bind its broker key to the identity it
//! names. The caller verifies the token's signature with the issuer's JWKS;
//! everything else is decided here: the `alg` allow-list, the time claims,
//! `aud`, `iss`, the subject (a SPIFFE ID, or an OIDC `sub`), an RFC 7800
//! `cnf` binding to the agent's key, and the identity patterns policy is
//! written in.
//!
//! Identities are strings of two disjoint shapes:
//! - a SPIFFE ID (`spiffe://prod.example/agents/a`), exactly the token's
//!   `sub`, which never holds a `#`;
//! - `issuer#subject` for OIDC (`https://issuer.example#system:sa:a`): a
//!   `sub` is unique only within its issuer, and an issuer never holds a
//!   `#` (RFC 8414 forbids fragments; `IssuerPolicy::check` refuses one),
//!   so the first `#` splits it unambiguously, and no OIDC identity is a
//!   SPIFFE ID or begins like one (an OIDC issuer may not begin `spiffe:`).

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::error::echo;
use crate::limits::{
    MAX_ECHOED_ALGORITHM_CHARS, MAX_IDENTITY_BYTES, MAX_IDENTITY_TOKEN_LIFETIME_S,
    MAX_ISSUER_NAME_BYTES, MAX_TRUST_DOMAIN_BYTES,
};
// The same allowance as for a holder's assertion: issuers' clocks differ
// from the broker's by as much as agents' do.
use crate::token::CLOCK_SKEW_S;

/// How every SPIFFE ID begins. Written lowercase only: the standard calls
/// the scheme case-insensitive, but one identity must have one spelling
/// for policy to match it.
pub const SPIFFE_SCHEME: &str = "spiffe://";

/// Why an identity token is refused. Each message names the claim at
/// fault; `reason` gives a stable code per kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The JOSE `alg` is not on the allow-list.
    #[error("{0}")]
    Algorithm(String),
    /// `exp` is missing, not whole seconds, or too far ahead: the token's
    /// lifetime is unbounded or longer than a binding may last.
    #[error("{0}")]
    Lifetime(String),
    /// `exp` has passed.
    #[error("{0}")]
    Expired(String),
    /// `nbf` or `iat` is in the future (or not whole seconds).
    #[error("{0}")]
    NotYetValid(String),
    /// No `aud` is one of the issuer's configured audiences.
    #[error("{0}")]
    Audience(String),
    /// `iss` is not the configured issuer.
    #[error("{0}")]
    Issuer(String),
    /// The SPIFFE ID is of another trust domain than the issuer's.
    #[error("{0}")]
    TrustDomain(String),
    /// `sub` is missing or not an identity (a SPIFFE ID, an OIDC subject).
    #[error("{0}")]
    Subject(String),
    /// `cnf` binds the token to another key than the agent's.
    #[error("{0}")]
    KeyBinding(String),
}

impl IdentityError {
    /// A stable code per kind, for clients and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Algorithm(_) => "IDENTITY_ALGORITHM",
            Self::Lifetime(_) => "IDENTITY_LIFETIME",
            Self::Expired(_) => "IDENTITY_EXPIRED",
            Self::NotYetValid(_) => "IDENTITY_NOT_YET_VALID",
            Self::Audience(_) => "IDENTITY_AUDIENCE",
            Self::Issuer(_) => "IDENTITY_ISSUER",
            Self::TrustDomain(_) => "IDENTITY_TRUST_DOMAIN",
            Self::Subject(_) => "IDENTITY_SUBJECT",
            Self::KeyBinding(_) => "IDENTITY_KEY_BINDING",
        }
    }
}

/// Why a trusted issuer or an identity pattern in the configuration is
/// refused (at startup: no client ever sees it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityConfigError {
    #[error("issuer {name}: {why}")]
    Issuer { name: String, why: String },
    #[error("identity pattern {pattern}: {why}")]
    Pattern { pattern: String, why: String },
}

/// A signature algorithm an identity token may use: asymmetric only
/// (RFC 7518 §3.3-3.5, and RFC 8037's EdDSA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    EdDsa,
    Es256,
    Es384,
    Rs256,
    Rs384,
    Rs512,
    Ps256,
    Ps384,
    Ps512,
}

impl Algorithm {
    /// The allow-list, in the order error messages name it.
    pub const ALL: [Self; 9] = [
        Self::EdDsa,
        Self::Es256,
        Self::Es384,
        Self::Rs256,
        Self::Rs384,
        Self::Rs512,
        Self::Ps256,
        Self::Ps384,
        Self::Ps512,
    ];

    /// Its JOSE `alg` name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EdDsa => "EdDSA",
            Self::Es256 => "ES256",
            Self::Es384 => "ES384",
            Self::Rs256 => "RS256",
            Self::Rs384 => "RS384",
            Self::Rs512 => "RS512",
            Self::Ps256 => "PS256",
            Self::Ps384 => "PS384",
            Self::Ps512 => "PS512",
        }
    }
}

/// The token's `alg` (its JOSE header) on the allow-list, matched exactly
/// (JOSE names are case-sensitive). `none` and the HMAC algorithms are
/// refused with why, in any case (`None`, `hs256`: the spellings attacks
/// try): an issuer's public key is no secret, so an HMAC "signature"
/// under it proves nothing.
pub fn check_algorithm(alg: &str) -> Result<Algorithm, IdentityError> {
    if let Some(known) = Algorithm::ALL.into_iter().find(|a| a.as_str() == alg) {
        return Ok(known);
    }
    let why = if alg.eq_ignore_ascii_case("none") {
        "unsigned tokens (alg none) are never accepted".to_owned()
    } else if ["HS256", "HS384", "HS512"]
        .iter()
        .any(|h| alg.eq_ignore_ascii_case(h))
    {
        format!(
            "HMAC algorithms ({}) are never accepted: an issuer's public key is not a secret",
            alg.to_ascii_uppercase()
        )
    } else {
        let named: String = alg.chars().take(MAX_ECHOED_ALGORITHM_CHARS).collect();
        let accepted: Vec<&str> = Algorithm::ALL.iter().map(|a| a.as_str()).collect();
        format!(
            "alg {named:?} is not accepted (accepted: {})",
            accepted.join(", ")
        )
    };
    Err(IdentityError::Algorithm(why))
}

/// What kind of issuer vouches for identities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IssuerKind {
    /// Any OIDC issuer (Kubernetes service accounts, clouds, CI): the
    /// identity is `iss#sub`.
    Oidc,
    /// A SPIFFE trust domain's JWT-SVIDs: the identity is the SPIFFE ID in
    /// `sub`, which must be of this trust domain.
    Spiffe { trust_domain: String },
}

/// A trusted issuer, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IssuerPolicy {
    /// The configuration's name for it: what a `Workload` names as its
    /// issuer.
    pub name: String,
    pub kind: IssuerKind,
    /// The `iss` its tokens carry: required for OIDC; optional for SPIFFE,
    /// whose JWT-SVIDs may omit `iss` (checked when set).
    pub issuer: Option<String>,
    /// The `aud` values that mean "this broker": a token must name one.
    pub audiences: Vec<String>,
}

impl IssuerPolicy {
    /// Checks the policy when the configuration is loaded: a name of
    /// 1..=`MAX_ISSUER_NAME_BYTES` bytes of `[A-Za-z0-9_.-]`, at least one
    /// non-empty audience, a valid trust domain for SPIFFE, and for OIDC
    /// an issuer with no `#` that does not begin `spiffe:` (so identities
    /// of the two kinds never look alike, see the module's doc).
    pub fn check(&self) -> Result<(), IdentityConfigError> {
        let refuse = |why: String| IdentityConfigError::Issuer {
            name: echo(&self.name),
            why,
        };
        let name_ok = (1..=MAX_ISSUER_NAME_BYTES).contains(&self.name.len())
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !name_ok {
            return Err(refuse(format!(
                "a name is 1..={MAX_ISSUER_NAME_BYTES} bytes of [A-Za-z0-9_.-]"
            )));
        }
        if self.audiences.is_empty() || self.audiences.iter().any(String::is_empty) {
            return Err(refuse(
                "list the audiences (aud) that name this broker, none empty".into(),
            ));
        }
        if let Some(issuer) = &self.issuer
            && (issuer.is_empty()
                || issuer.len() > MAX_IDENTITY_BYTES
                || issuer.chars().any(char::is_control))
        {
            return Err(refuse(format!(
                "an issuer (iss) is 1..={MAX_IDENTITY_BYTES} bytes, no control characters"
            )));
        }
        match (&self.kind, self.issuer.as_deref()) {
            (IssuerKind::Spiffe { trust_domain }, _) => {
                check_trust_domain(trust_domain).map_err(refuse)
            }
            (IssuerKind::Oidc, None) => Err(refuse("an OIDC issuer needs its iss".into())),
            (IssuerKind::Oidc, Some(issuer)) => oidc_issuer_shape(issuer).map_err(refuse),
        }
    }
}

/// An identity an agent proved with a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// The SPIFFE ID, or `issuer#subject` for OIDC.
    pub identity: String,
    /// The name of the issuer that vouched for it (`IssuerPolicy::name`).
    pub issuer: String,
    /// The token's `exp`, in ms: the binding ends then, never later.
    pub expires_at_ms: i64,
}

/// Checks a verified token's claims against the issuer's policy (checked
/// by `IssuerPolicy::check`) at `now_ms`; the identity it proves, or why
/// none. `exp`, `nbf` and `iat` are whole seconds since the epoch
/// (RFC 7519 allows fractions: one is refused rather than rounded, so a
/// binding ends at the token's `exp` exactly). A token up to
/// `CLOCK_SKEW_S` past its `exp` is still accepted (its issuer's clock may
/// be behind ours), but its `Workload` expires at that `exp`, already
/// past: the caller's `expires_at_ms > now` check then ends it at once.
pub fn check_claims(
    claims: &Map<String, Value>,
    policy: &IssuerPolicy,
    now_ms: i64,
) -> Result<Workload, IdentityError> {
    let exp_s = check_times(claims, now_ms)?;
    check_audience(claims, policy)?;
    let iss = check_issuer(claims, policy)?;
    let identity = match (&policy.kind, iss) {
        (IssuerKind::Spiffe { trust_domain }, _) => spiffe_identity(claims, trust_domain, policy)?,
        (IssuerKind::Oidc, Some(iss)) => oidc_identity(claims, iss)?,
        // `check_issuer` refuses an OIDC token without the policy's `iss`.
        (IssuerKind::Oidc, None) => {
            return Err(IdentityError::Issuer("the token has no iss".into()));
        }
    };
    Ok(Workload {
        identity,
        issuer: policy.name.clone(),
        expires_at_ms: exp_s.saturating_mul(1000),
    })
}

/// `exp` ahead (by at most the lifetime bound), `nbf` and `iat` if present
/// not ahead, each within `CLOCK_SKEW_S`; the token's `exp`.
fn check_times(claims: &Map<String, Value>, now_ms: i64) -> Result<i64, IdentityError> {
    let now_s = now_ms.div_euclid(1000);
    let exp_s = claims.get("exp").and_then(Value::as_i64).ok_or_else(|| {
        IdentityError::Lifetime(
            "the token has no exp (whole seconds since the epoch): its lifetime must be bounded"
                .into(),
        )
    })?;
    if exp_s.saturating_add(CLOCK_SKEW_S) <= now_s {
        return Err(IdentityError::Expired(format!(
            "the token expired at {exp_s} (now {now_s}): present a fresh one"
        )));
    }
    if exp_s > now_s.saturating_add(MAX_IDENTITY_TOKEN_LIFETIME_S + CLOCK_SKEW_S) {
        return Err(IdentityError::Lifetime(format!(
            "the token's exp {exp_s} is more than {MAX_IDENTITY_TOKEN_LIFETIME_S} s away \
             (now {now_s}): a binding lasts no longer than its token"
        )));
    }
    for name in ["nbf", "iat"] {
        let Some(value) = claims.get(name) else {
            continue;
        };
        match value.as_i64() {
            Some(at_s) if at_s <= now_s.saturating_add(CLOCK_SKEW_S) => {}
            Some(at_s) => {
                return Err(IdentityError::NotYetValid(format!(
                    "the token's {name} {at_s} is in the future (now {now_s})"
                )));
            }
            None => {
                return Err(IdentityError::NotYetValid(format!(
                    "the token's {name} is not whole seconds since the epoch"
                )));
            }
        }
    }
    Ok(exp_s)
}

/// `aud`, a string or an array, names one of the policy's audiences.
fn check_audience(claims: &Map<String, Value>, policy: &IssuerPolicy) -> Result<(), IdentityError> {
    let ours = |aud: &Value| {
        aud.as_str()
            .is_some_and(|aud| policy.audiences.iter().any(|a| a == aud))
    };
    let named = match claims.get("aud") {
        Some(Value::Array(auds)) => auds.iter().any(ours),
        Some(aud) => ours(aud),
        None => false,
    };
    if named {
        return Ok(());
    }
    let given = claims.get("aud").map_or_else(
        || "no aud".to_owned(),
        |aud| format!("aud {}", echo(&aud.to_string())),
    );
    Err(IdentityError::Audience(format!(
        "the token's {given} names none of issuer {:?}'s audiences {:?}",
        policy.name, policy.audiences
    )))
}

/// `iss` is the policy's: always for OIDC, when configured for SPIFFE.
/// The `iss` checked, if one was.
fn check_issuer<'a>(
    claims: &'a Map<String, Value>,
    policy: &IssuerPolicy,
) -> Result<Option<&'a str>, IdentityError> {
    let expected = match (&policy.kind, policy.issuer.as_deref()) {
        (_, Some(expected)) => expected,
        (IssuerKind::Spiffe { .. }, None) => return Ok(None),
        (IssuerKind::Oidc, None) => {
            return Err(IdentityError::Issuer(format!(
                "issuer {:?} is configured with no iss: it vouches for no one",
                policy.name
            )));
        }
    };
    match claims.get("iss").and_then(Value::as_str) {
        Some(iss) if iss == expected => Ok(Some(iss)),
        Some(iss) => Err(IdentityError::Issuer(format!(
            "the token's iss {} is not {expected:?} (issuer {:?})",
            echo(iss),
            policy.name
        ))),
        None => Err(IdentityError::Issuer(format!(
            "the token has no iss; issuer {:?} is {expected:?}",
            policy.name
        ))),
    }
}

/// The workload's SPIFFE ID from `sub`, of the policy's trust domain.
fn spiffe_identity(
    claims: &Map<String, Value>,
    trust_domain: &str,
    policy: &IssuerPolicy,
) -> Result<String, IdentityError> {
    let sub = claims.get("sub").and_then(Value::as_str).ok_or_else(|| {
        IdentityError::Subject("the token has no sub (the workload's SPIFFE ID)".into())
    })?;
    let id = parse_spiffe_id(sub).map_err(|why| {
        IdentityError::Subject(format!(
            "the token's sub {} is not a SPIFFE ID: {why}",
            echo(sub)
        ))
    })?;
    if id.trust_domain != trust_domain {
        return Err(IdentityError::TrustDomain(format!(
            "the token's SPIFFE ID is of trust domain {:?}; issuer {:?} vouches only for {trust_domain:?}",
            id.trust_domain, policy.name
        )));
    }
    // Valid as a SPIFFE ID, but it names the trust domain itself (its
    // signing authority, SPIFFE-ID §3.1), never a workload.
    if id.path.is_empty() {
        return Err(IdentityError::Subject(format!(
            "the token's sub {} names the trust domain itself, not a workload",
            echo(sub)
        )));
    }
    Ok(sub.to_owned())
}

/// `iss#sub`: the `sub` is unique only within its issuer.
fn oidc_identity(claims: &Map<String, Value>, iss: &str) -> Result<String, IdentityError> {
    // `iss` is the policy's, which `IssuerPolicy::check` checked; checked
    // again because the identity's unambiguity rests on it.
    oidc_issuer_shape(iss).map_err(IdentityError::Issuer)?;
    let sub = claims
        .get("sub")
        .and_then(Value::as_str)
        .ok_or_else(|| IdentityError::Subject("the token has no sub".into()))?;
    if sub.is_empty() || sub.chars().any(char::is_control) {
        return Err(IdentityError::Subject(format!(
            "the token's sub {} must be non-empty, with no control characters",
            echo(sub)
        )));
    }
    let identity = format!("{iss}#{sub}");
    if identity.len() > MAX_IDENTITY_BYTES {
        return Err(IdentityError::Subject(format!(
            "the token's sub is {} bytes: with its issuer ({iss}#sub) an identity is at most {MAX_IDENTITY_BYTES}",
            sub.len()
        )));
    }
    Ok(identity)
}

/// An OIDC issuer that keeps `iss#sub` unambiguous and apart from SPIFFE
/// IDs.
fn oidc_issuer_shape(issuer: &str) -> Result<(), String> {
    if issuer.contains('#') {
        return Err(format!(
            "the OIDC issuer {} holds a '#' (an issuer has no fragment)",
            echo(issuer)
        ));
    }
    if spiffe_like(issuer) {
        return Err(format!(
            "the OIDC issuer {} is a SPIFFE ID: configure a SPIFFE issuer",
            echo(issuer)
        ));
    }
    Ok(())
}

/// Whether `text` begins with the `spiffe` scheme, in any case.
fn spiffe_like(text: &str) -> bool {
    text.get(..SPIFFE_SCHEME.len() - "//".len())
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("spiffe:"))
}

/// A SPIFFE ID's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpiffeId<'a> {
    pub trust_domain: &'a str,
    /// Empty (the trust domain itself) or `/`-separated segments, each
    /// beginning with its `/`.
    pub path: &'a str,
}

/// Parses a SPIFFE ID per the SPIFFE ID standard (§2): `spiffe://`, a
/// trust domain of `[a-z0-9._-]` (no userinfo, port, percent-encoding or
/// uppercase), then a path of non-empty segments of `[A-Za-z0-9._-]`, none
/// `.` or `..`, no trailing `/`, no query or fragment; at most
/// `MAX_IDENTITY_BYTES` in all. An empty path is valid (the trust domain's
/// own ID); `check_claims` refuses it as a workload's identity.
pub fn parse_spiffe_id(id: &str) -> Result<SpiffeId<'_>, String> {
    if id.len() > MAX_IDENTITY_BYTES {
        return Err(format!("{} bytes, at most {MAX_IDENTITY_BYTES}", id.len()));
    }
    let Some(rest) = id.strip_prefix(SPIFFE_SCHEME) else {
        let lowered = id.get(..SPIFFE_SCHEME.len()).map(str::to_ascii_lowercase);
        return Err(if lowered.as_deref() == Some(SPIFFE_SCHEME) {
            format!("the scheme is written {SPIFFE_SCHEME} (lowercase)")
        } else {
            format!("it does not begin {SPIFFE_SCHEME}")
        });
    };
    if rest.contains(['?', '#']) {
        return Err("a SPIFFE ID has no query or fragment".into());
    }
    if rest.contains('%') {
        return Err("a SPIFFE ID has no percent-encoded characters".into());
    }
    let (trust_domain, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    check_trust_domain(trust_domain)?;
    if path.is_empty() {
        return Ok(SpiffeId { trust_domain, path });
    }
    if path.ends_with('/') {
        return Err("the path has a trailing '/'".into());
    }
    for segment in path[1..].split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return Err(format!(
                "the path has an empty, '.' or '..' segment ({:?})",
                segment
            ));
        }
        if !segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(format!(
                "the path segment {} holds a character other than [A-Za-z0-9._-]",
                echo(segment)
            ));
        }
    }
    Ok(SpiffeId { trust_domain, path })
}

/// A trust domain name: 1..=`MAX_TRUST_DOMAIN_BYTES` of `[a-z0-9._-]`.
fn check_trust_domain(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the trust domain is empty".into());
    }
    if name.contains('@') {
        return Err("a trust domain has no userinfo ('@')".into());
    }
    if name.contains(':') {
        return Err("a trust domain has no port (':')".into());
    }
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(format!("the trust domain {} must be lowercase", echo(name)));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
    {
        return Err(format!(
            "the trust domain {} holds a character other than [a-z0-9._-]",
            echo(name)
        ));
    }
    if name.len() > MAX_TRUST_DOMAIN_BYTES {
        return Err(format!(
            "the trust domain is {} bytes, at most {MAX_TRUST_DOMAIN_BYTES}",
            name.len()
        ));
    }
    Ok(())
}

/// If the token carries RFC 7800's `cnf`, it must bind the token to this
/// agent's ed25519 key: every member of `cnf` is `jwk` (the key as an OKP
/// JWK, RFC 8037) or `jkt` (its RFC 7638 thumbprint), naming this key. A
/// token without `cnf` is a bearer token and binds any key that presents
/// it (the caller's signed request proves that key).
pub fn check_key_binding(
    claims: &Map<String, Value>,
    agent_key: &[u8; 32],
) -> Result<(), IdentityError> {
    let Some(cnf) = claims.get("cnf") else {
        return Ok(());
    };
    let another = |why: &str| {
        Err(IdentityError::KeyBinding(format!(
            "the token is bound to another key ({why})"
        )))
    };
    let Some(methods) = cnf.as_object().filter(|m| !m.is_empty()) else {
        return another("its cnf names no key");
    };
    let x = base64url(agent_key);
    for (method, value) in methods {
        let ours = match method.as_str() {
            "jwk" => value.as_object().is_some_and(|jwk| {
                jwk.get("kty").and_then(Value::as_str) == Some("OKP")
                    && jwk.get("crv").and_then(Value::as_str) == Some("Ed25519")
                    && jwk.get("x").and_then(Value::as_str) == Some(x.as_str())
            }),
            "jkt" => value.as_str() == Some(jwk_thumbprint(agent_key).as_str()),
            _ => return another(&format!("cnf.{} is not this agent's key", echo(method))),
        };
        if !ours {
            return another(&format!("cnf.{method} is not this agent's ed25519 key"));
        }
    }
    Ok(())
}

/// The RFC 7638 thumbprint of an ed25519 public key's JWK (RFC 8037
/// §2): base64url of the SHA-256 of its required members in lexicographic
/// order, without whitespace.
pub fn jwk_thumbprint(key: &[u8; 32]) -> String {
    let canonical = format!(
        r#"{{"crv":"Ed25519","kty":"OKP","x":"{}"}}"#,
        base64url(key)
    );
    base64url(&Sha256::digest(canonical.as_bytes()))
}

/// Base64url without padding (RFC 4648 §5), as JOSE writes bytes.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let group = chunk.iter().enumerate().fold(0u32, |group, (i, b)| {
            group | (u32::from(*b) << (16 - 8 * i))
        });
        // 3 bytes make 4 characters, 2 make 3, 1 makes 2.
        for i in 0..=chunk.len() {
            let sextet = (group >> (18 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[sextet as usize]));
        }
    }
    out
}

/// An identity or a set of them, as policy names it: exact, or ending in
/// `/*` for any identity under that path (`spiffe://prod.example/agents/*`
/// matches `spiffe://prod.example/agents/a` and `.../agents/a/b`, not
/// `.../agents` nor `.../agentsX`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityPattern {
    /// The configuration's text.
    text: String,
    /// For `.../*`: the text without its `*` (ending in `/`).
    under: Option<String>,
}

impl IdentityPattern {
    /// Parses a pattern: at most `MAX_IDENTITY_BYTES`, no control
    /// characters, `*` only as the last segment. Its identity (or the
    /// path before `/*`) must be one an issuer can vouch for: a SPIFFE ID
    /// (`spiffe://td/*` is the whole trust domain), or an OIDC identity
    /// `issuer#subject` naming its issuer whole, so one pattern never
    /// spans issuers.
    pub fn parse(text: &str) -> Result<Self, IdentityConfigError> {
        let refuse = |why: String| IdentityConfigError::Pattern {
            pattern: echo(text),
            why,
        };
        if text.is_empty() || text.len() > MAX_IDENTITY_BYTES || text.chars().any(char::is_control)
        {
            return Err(refuse(format!(
                "a pattern is 1..={MAX_IDENTITY_BYTES} bytes, no control characters"
            )));
        }
        let (base, under) = match text.strip_suffix("/*") {
            Some(base) => (base, true),
            None => (text, false),
        };
        if base.contains('*') {
            return Err(refuse(
                "'*' may only end a pattern, after a '/' (spiffe://td/agents/* is any \
                 identity under spiffe://td/agents)"
                    .into(),
            ));
        }
        if spiffe_like(base) {
            let id =
                parse_spiffe_id(base).map_err(|why| refuse(format!("not a SPIFFE ID: {why}")))?;
            if !under && id.path.is_empty() {
                return Err(refuse(
                    "names a trust domain, never a workload (spiffe://td/* is all of its workloads)"
                        .into(),
                ));
            }
        } else if base
            .split_once('#')
            .is_none_or(|(issuer, _)| issuer.is_empty())
        {
            return Err(refuse(
                "names neither a SPIFFE ID (spiffe://td/path) nor an OIDC identity (issuer#subject)"
                    .into(),
            ));
        }
        Ok(Self {
            text: text.to_owned(),
            under: under.then(|| format!("{base}/")),
        })
    }

    /// Whether `identity` is the pattern's, or under its path.
    pub fn matches(&self, identity: &str) -> bool {
        match &self.under {
            None => identity == self.text,
            Some(prefix) => identity.len() > prefix.len() && identity.starts_with(prefix.as_str()),
        }
    }

    /// The configuration's text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const NOW_MS: i64 = 1_800_000_000_000;
    const NOW_S: i64 = NOW_MS / 1000;
    const ISSUER: &str = "https://oidc.example";
    const AGENT: [u8; 32] = [7; 32];

    fn object(value: Value) -> Map<String, Value> {
        let Value::Object(map) = value else {
            unreachable!("an object")
        };
        map
    }

    fn spiffe_policy() -> IssuerPolicy {
        IssuerPolicy {
            name: "spire-prod".into(),
            kind: IssuerKind::Spiffe {
                trust_domain: "prod.example".into(),
            },
            issuer: Some("https://spire.prod.example".into()),
            audiences: vec!["broker".into(), "spiffe://prod.example/broker".into()],
        }
    }

    fn oidc_policy() -> IssuerPolicy {
        IssuerPolicy {
            name: "k8s".into(),
            kind: IssuerKind::Oidc,
            issuer: Some(ISSUER.into()),
            audiences: vec!["broker".into()],
        }
    }

    fn svid() -> Map<String, Value> {
        object(json!({
            "iss": "https://spire.prod.example",
            "sub": "spiffe://prod.example/agents/a",
            "aud": "broker",
            "exp": NOW_S + 300,
            "iat": NOW_S,
            "nbf": NOW_S,
        }))
    }

    fn oidc_token() -> Map<String, Value> {
        object(json!({
            "iss": ISSUER,
            "sub": "system:serviceaccount:agents:a",
            "aud": ["other", "broker"],
            "exp": NOW_S + 300,
            "iat": NOW_S,
        }))
    }

    /// `claims` with `name` set to `value`, or removed when `None`.
    fn with(
        mut claims: Map<String, Value>,
        name: &str,
        value: Option<Value>,
    ) -> Map<String, Value> {
        match value {
            Some(value) => claims.insert(name.into(), value),
            None => claims.remove(name),
        };
        claims
    }

    #[test]
    fn a_jwt_svid_proves_its_spiffe_id_until_its_exp() {
        let workload = check_claims(&svid(), &spiffe_policy(), NOW_MS).unwrap();
        assert_eq!(
            workload,
            Workload {
                identity: "spiffe://prod.example/agents/a".into(),
                issuer: "spire-prod".into(),
                expires_at_ms: (NOW_S + 300) * 1000,
            }
        );
        // JWT-SVIDs may omit iss: checked only when the policy names one.
        let open = IssuerPolicy {
            issuer: None,
            ..spiffe_policy()
        };
        for iss in [None, Some(json!("https://anything.example"))] {
            assert!(check_claims(&with(svid(), "iss", iss), &open, NOW_MS).is_ok());
        }
        // The second audience, in an array.
        let listed = with(svid(), "aud", Some(json!(["spiffe://prod.example/broker"])));
        assert!(check_claims(&listed, &spiffe_policy(), NOW_MS).is_ok());
    }

    #[test]
    fn an_oidc_token_proves_issuer_hash_subject() {
        let workload = check_claims(&oidc_token(), &oidc_policy(), NOW_MS).unwrap();
        assert_eq!(
            workload.identity,
            "https://oidc.example#system:serviceaccount:agents:a"
        );
        assert_eq!(workload.issuer, "k8s");
        assert_eq!(workload.expires_at_ms, (NOW_S + 300) * 1000);
    }

    /// Each refusal: the accepted token with exactly one claim changed.
    #[test]
    fn every_claim_of_a_jwt_svid_is_checked() {
        assert!(check_claims(&svid(), &spiffe_policy(), NOW_MS).is_ok());
        let day_s = MAX_IDENTITY_TOKEN_LIFETIME_S;
        let broken: Vec<(&str, Option<Value>, &str)> = vec![
            ("exp", None, "IDENTITY_LIFETIME"),
            ("exp", Some(json!("soon")), "IDENTITY_LIFETIME"),
            (
                "exp",
                Some(json!(NOW_S as f64 + 300.5)),
                "IDENTITY_LIFETIME",
            ),
            (
                "exp",
                Some(json!(NOW_S + day_s + CLOCK_SKEW_S + 1)),
                "IDENTITY_LIFETIME",
            ),
            ("exp", Some(json!(i64::MAX)), "IDENTITY_LIFETIME"),
            ("exp", Some(json!(NOW_S - CLOCK_SKEW_S)), "IDENTITY_EXPIRED"),
            ("exp", Some(json!(i64::MIN)), "IDENTITY_EXPIRED"),
            (
                "nbf",
                Some(json!(NOW_S + CLOCK_SKEW_S + 1)),
                "IDENTITY_NOT_YET_VALID",
            ),
            (
                "iat",
                Some(json!(NOW_S + CLOCK_SKEW_S + 1)),
                "IDENTITY_NOT_YET_VALID",
            ),
            ("iat", Some(json!("now")), "IDENTITY_NOT_YET_VALID"),
            ("aud", None, "IDENTITY_AUDIENCE"),
            ("aud", Some(json!("other")), "IDENTITY_AUDIENCE"),
            (
                "aud",
                Some(json!(["other", "another"])),
                "IDENTITY_AUDIENCE",
            ),
            ("aud", Some(json!([])), "IDENTITY_AUDIENCE"),
            ("aud", Some(json!(["BROKER"])), "IDENTITY_AUDIENCE"),
            ("aud", Some(json!({"broker": true})), "IDENTITY_AUDIENCE"),
            ("iss", None, "IDENTITY_ISSUER"),
            (
                "iss",
                Some(json!("https://spire.staging.example")),
                "IDENTITY_ISSUER",
            ),
            ("sub", None, "IDENTITY_SUBJECT"),
            ("sub", Some(json!(42)), "IDENTITY_SUBJECT"),
            ("sub", Some(json!("agents/a")), "IDENTITY_SUBJECT"),
            (
                "sub",
                Some(json!("spiffe://prod.example/agents/../a")),
                "IDENTITY_SUBJECT",
            ),
            (
                "sub",
                Some(json!("spiffe://prod.example")),
                "IDENTITY_SUBJECT",
            ),
            (
                "sub",
                Some(json!("spiffe://staging.example/agents/a")),
                "IDENTITY_TRUST_DOMAIN",
            ),
            (
                "sub",
                Some(json!("spiffe://prod.example.evil/agents/a")),
                "IDENTITY_TRUST_DOMAIN",
            ),
        ];
        for (name, value, reason) in broken {
            let claims = with(svid(), name, value.clone());
            let refused = check_claims(&claims, &spiffe_policy(), NOW_MS);
            assert_eq!(
                refused.as_ref().map_err(IdentityError::reason).err(),
                Some(reason),
                "{name} = {value:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn the_clock_skew_and_the_lifetime_bound_are_exact() {
        let at = |name: &str, s: i64| with(svid(), name, Some(json!(s)));
        let ok = |claims: Map<String, Value>| check_claims(&claims, &spiffe_policy(), NOW_MS);
        assert!(ok(at("exp", NOW_S - CLOCK_SKEW_S + 1)).is_ok());
        assert!(ok(at("exp", NOW_S - CLOCK_SKEW_S)).is_err());
        let longest = NOW_S + MAX_IDENTITY_TOKEN_LIFETIME_S + CLOCK_SKEW_S;
        assert!(ok(at("exp", longest)).is_ok());
        assert!(ok(at("exp", longest + 1)).is_err());
        for name in ["nbf", "iat"] {
            assert!(ok(at(name, NOW_S + CLOCK_SKEW_S)).is_ok(), "{name}");
            assert!(ok(at(name, NOW_S + CLOCK_SKEW_S + 1)).is_err(), "{name}");
        }
        // A binding never outlives its token, skew or not.
        let late = ok(at("exp", NOW_S - 10)).unwrap();
        assert_eq!(late.expires_at_ms, (NOW_S - 10) * 1000);
    }

    #[test]
    fn refusals_name_what_was_expected() {
        let other = with(
            svid(),
            "sub",
            Some(json!("spiffe://staging.example/agents/a")),
        );
        let why = check_claims(&other, &spiffe_policy(), NOW_MS)
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("\"staging.example\"") && why.contains("\"prod.example\""),
            "{why}"
        );
        let wrong = with(svid(), "aud", Some(json!("other")));
        let why = check_claims(&wrong, &spiffe_policy(), NOW_MS)
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("\"broker\"") && why.contains("spiffe://prod.example/broker"),
            "{why}"
        );
        let elsewhere = with(svid(), "iss", Some(json!("https://elsewhere")));
        let why = check_claims(&elsewhere, &spiffe_policy(), NOW_MS)
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("https://spire.prod.example") && why.contains("https://elsewhere"),
            "{why}"
        );
    }

    #[test]
    fn every_claim_of_an_oidc_token_is_checked() {
        assert!(check_claims(&oidc_token(), &oidc_policy(), NOW_MS).is_ok());
        let most = MAX_IDENTITY_BYTES - ISSUER.len() - 1;
        let fits = with(oidc_token(), "sub", Some(json!("s".repeat(most))));
        assert_eq!(
            check_claims(&fits, &oidc_policy(), NOW_MS)
                .unwrap()
                .identity
                .len(),
            MAX_IDENTITY_BYTES
        );
        let broken: Vec<(&str, Option<Value>, &str)> = vec![
            ("iss", None, "IDENTITY_ISSUER"),
            (
                "iss",
                Some(json!("https://oidc.example/")),
                "IDENTITY_ISSUER",
            ),
            ("sub", None, "IDENTITY_SUBJECT"),
            ("sub", Some(json!("")), "IDENTITY_SUBJECT"),
            ("sub", Some(json!("a\nb")), "IDENTITY_SUBJECT"),
            ("sub", Some(json!("s".repeat(most + 1))), "IDENTITY_SUBJECT"),
            ("aud", Some(json!(["other"])), "IDENTITY_AUDIENCE"),
            ("exp", Some(json!(NOW_S - 60)), "IDENTITY_EXPIRED"),
        ];
        for (name, value, reason) in broken {
            let claims = with(oidc_token(), name, value.clone());
            let refused = check_claims(&claims, &oidc_policy(), NOW_MS);
            assert_eq!(
                refused.as_ref().map_err(IdentityError::reason).err(),
                Some(reason),
                "{name} = {value:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn an_oidc_policy_without_a_sound_issuer_vouches_for_no_one() {
        let unnamed = IssuerPolicy {
            issuer: None,
            ..oidc_policy()
        };
        let refused = check_claims(&oidc_token(), &unnamed, NOW_MS).unwrap_err();
        assert_eq!(refused.reason(), "IDENTITY_ISSUER");
        // Unchecked policies whose iss would make identities ambiguous.
        for issuer in ["https://oidc.example#x", "spiffe://prod.example/x"] {
            let policy = IssuerPolicy {
                issuer: Some(issuer.into()),
                ..oidc_policy()
            };
            let token = with(oidc_token(), "iss", Some(json!(issuer)));
            let refused = check_claims(&token, &policy, NOW_MS).unwrap_err();
            assert_eq!(refused.reason(), "IDENTITY_ISSUER", "{issuer}");
        }
    }

    #[test]
    fn spiffe_ids_follow_the_standard() {
        let valid = [
            (
                "spiffe://prod.example/agents/a",
                "prod.example",
                "/agents/a",
            ),
            ("spiffe://td/A-Z_a.z/0-9/...", "td", "/A-Z_a.z/0-9/..."),
            ("spiffe://10.0.0.1/x", "10.0.0.1", "/x"),
            ("spiffe://my_td-1/x", "my_td-1", "/x"),
            // The trust domain's own ID: valid, but no workload's.
            ("spiffe://prod.example", "prod.example", ""),
        ];
        for (id, trust_domain, path) in valid {
            assert_eq!(
                parse_spiffe_id(id),
                Ok(SpiffeId { trust_domain, path }),
                "{id}"
            );
        }
        let invalid = [
            ("spiffe://Prod.example/a", "lowercase"),
            ("SPIFFE://prod.example/a", "lowercase"),
            ("https://prod.example/a", "does not begin"),
            ("spiffe:/prod.example/a", "does not begin"),
            ("", "does not begin"),
            ("spiffe:///a", "empty"),
            ("spiffe://", "empty"),
            ("spiffe://td/a/../b", "'..'"),
            ("spiffe://td/./a", "'.'"),
            ("spiffe://td//a", "empty"),
            ("spiffe://td/a/", "trailing"),
            ("spiffe://td/", "trailing"),
            ("spiffe://td/a?x=1", "query"),
            ("spiffe://td?x=1", "query"),
            ("spiffe://td/a#f", "fragment"),
            ("spiffe://td:443/a", "port"),
            ("spiffe://user@td/a", "userinfo"),
            ("spiffe://td/a%2Fb", "percent"),
            ("spiffe://td/a b", "[A-Za-z0-9._-]"),
            ("spiffe://td/é", "[A-Za-z0-9._-]"),
            ("spiffe://td/a\0", "[A-Za-z0-9._-]"),
            ("spiffe://t+d/a", "[a-z0-9._-]"),
            ("spiffe://[::1]/a", "port"),
        ];
        for (id, why) in invalid {
            match parse_spiffe_id(id) {
                Err(message) => assert!(message.contains(why), "{id}: {message}"),
                Ok(parsed) => panic!("{id} parsed as {parsed:?}"),
            }
        }
    }

    #[test]
    fn spiffe_ids_and_trust_domains_are_bounded() {
        let head = "spiffe://td/";
        let longest = format!("{head}{}", "a".repeat(MAX_IDENTITY_BYTES - head.len()));
        assert!(parse_spiffe_id(&longest).is_ok());
        let message = parse_spiffe_id(&format!("{longest}a")).unwrap_err();
        assert!(message.contains("at most 2048"), "{message}");
        let domain = "d".repeat(MAX_TRUST_DOMAIN_BYTES);
        assert!(parse_spiffe_id(&format!("spiffe://{domain}/a")).is_ok());
        let message = parse_spiffe_id(&format!("spiffe://{domain}d/a")).unwrap_err();
        assert!(message.contains("at most 255"), "{message}");
    }

    #[test]
    fn only_asymmetric_algorithms_are_accepted() {
        for alg in Algorithm::ALL {
            assert_eq!(check_algorithm(alg.as_str()), Ok(alg));
        }
        let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(
            names,
            [
                "EdDSA", "ES256", "ES384", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512"
            ]
        );
        let refused = |alg: &str| {
            let error = check_algorithm(alg).unwrap_err();
            assert_eq!(error.reason(), "IDENTITY_ALGORITHM", "{alg}");
            error.to_string()
        };
        for alg in ["none", "None", "NONE"] {
            assert!(refused(alg).contains("unsigned"), "{alg}");
        }
        for alg in ["HS256", "HS384", "HS512", "hs256"] {
            assert!(refused(alg).contains("HMAC"), "{alg}");
        }
        for alg in ["ES512", "eddsa", "rs256", "", "EdDSA "] {
            let message = refused(alg);
            assert!(message.contains(&format!("{alg:?}")), "{message}");
        }
        let long = format!(
            "{}{}",
            "A".repeat(MAX_ECHOED_ALGORITHM_CHARS),
            "B".repeat(100)
        );
        let message = refused(&long);
        assert!(
            message.contains(&"A".repeat(MAX_ECHOED_ALGORITHM_CHARS)),
            "{message}"
        );
        assert!(!message.contains('B'), "{message}");
    }

    fn bound(cnf: Value) -> Map<String, Value> {
        with(svid(), "cnf", Some(cnf))
    }

    fn jwk(key: &[u8; 32]) -> Value {
        json!({"kty": "OKP", "crv": "Ed25519", "x": base64url(key)})
    }

    #[test]
    fn a_cnf_binds_the_token_to_this_agents_key() {
        assert_eq!(check_key_binding(&svid(), &AGENT), Ok(()));
        let mut with_kid = jwk(&AGENT);
        with_kid["kid"] = json!("k1");
        let accepted = [
            json!({ "jwk": jwk(&AGENT) }),
            json!({ "jwk": with_kid }),
            json!({ "jkt": jwk_thumbprint(&AGENT) }),
            json!({ "jwk": jwk(&AGENT), "jkt": jwk_thumbprint(&AGENT) }),
        ];
        for cnf in accepted {
            assert_eq!(
                check_key_binding(&bound(cnf.clone()), &AGENT),
                Ok(()),
                "{cnf}"
            );
        }
        let other = [8u8; 32];
        let mut x25519 = jwk(&AGENT);
        x25519["crv"] = json!("X25519");
        let mut ec = jwk(&AGENT);
        ec["kty"] = json!("EC");
        let mut padded = jwk(&AGENT);
        padded["x"] = json!(format!("{}=", base64url(&AGENT)));
        let refused = [
            json!({ "jwk": jwk(&other) }),
            json!({ "jwk": x25519 }),
            json!({ "jwk": ec }),
            json!({ "jwk": padded }),
            json!({ "jwk": base64url(&AGENT) }),
            json!({ "jkt": jwk_thumbprint(&other) }),
            json!({ "jkt": base64url(&AGENT) }),
            json!({ "jwk": jwk(&AGENT), "jkt": jwk_thumbprint(&other) }),
            json!({ "jwk": jwk(&AGENT), "x5t#S256": "abc" }),
            json!({ "x5t#S256": "abc" }),
            json!({}),
            json!(null),
            json!(base64url(&AGENT)),
        ];
        for cnf in refused {
            let error = check_key_binding(&bound(cnf.clone()), &AGENT).unwrap_err();
            assert_eq!(error.reason(), "IDENTITY_KEY_BINDING", "{cnf}");
            assert!(
                error
                    .to_string()
                    .starts_with("the token is bound to another key"),
                "{error}"
            );
        }
    }

    #[test]
    fn the_thumbprint_is_rfc_7638s_of_rfc_8037s_example_key() {
        // RFC 8037 A.3 (the public key of RFC 8032's first test vector).
        let mut key = [0u8; 32];
        hex::decode_to_slice(
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
            &mut key,
        )
        .unwrap();
        assert_eq!(
            base64url(&key),
            "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
        );
        assert_eq!(
            jwk_thumbprint(&key),
            "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"
        );
        let claims = bound(json!({ "jkt": "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k" }));
        assert_eq!(check_key_binding(&claims, &key), Ok(()));
        assert!(check_key_binding(&claims, &AGENT).is_err());
        let claims = bound(json!({ "jwk": {
            "kty": "OKP", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
        }}));
        assert_eq!(check_key_binding(&claims, &key), Ok(()));
    }

    #[test]
    fn base64url_is_rfc_4648s() {
        // RFC 4648 §10's vectors, unpadded, and the URL alphabet's last two.
        let vectors: [(&[u8], &str); 8] = [
            (b"", ""),
            (b"f", "Zg"),
            (b"fo", "Zm8"),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg"),
            (b"fooba", "Zm9vYmE"),
            (b"foobar", "Zm9vYmFy"),
            (&[0xfb, 0xff, 0xbf], "-_-_"),
        ];
        for (bytes, text) in vectors {
            assert_eq!(base64url(bytes), text, "{bytes:?}");
        }
    }

    #[test]
    fn a_pattern_ending_in_slash_star_matches_what_is_under_its_path() {
        let agents = IdentityPattern::parse("spiffe://prod.example/agents/*").unwrap();
        assert_eq!(agents.as_str(), "spiffe://prod.example/agents/*");
        for identity in [
            "spiffe://prod.example/agents/a",
            "spiffe://prod.example/agents/a/b",
        ] {
            assert!(agents.matches(identity), "{identity}");
        }
        for identity in [
            "spiffe://prod.example/agents",
            "spiffe://prod.example/agentsX",
            "spiffe://prod.example/agentsX/a",
            "spiffe://prod.example/agents/",
            "spiffe://prod.example/other/agents/a",
            "spiffe://staging.example/agents/a",
        ] {
            assert!(!agents.matches(identity), "{identity}");
        }
        let exact = IdentityPattern::parse("spiffe://prod.example/agents/a").unwrap();
        assert!(exact.matches("spiffe://prod.example/agents/a"));
        assert!(!exact.matches("spiffe://prod.example/agents/a/b"));
        assert!(!exact.matches("spiffe://prod.example/agents/ab"));
        let domain = IdentityPattern::parse("spiffe://prod.example/*").unwrap();
        assert!(domain.matches("spiffe://prod.example/x"));
        assert!(!domain.matches("spiffe://prod.example"));
        assert!(!domain.matches("spiffe://prod.example.evil/x"));
        let team = IdentityPattern::parse("https://ci.example#repo:org/*").unwrap();
        assert!(team.matches("https://ci.example#repo:org/app"));
        assert!(!team.matches("https://ci.example#repo:orgX/app"));
        let one = IdentityPattern::parse("https://oidc.example#system:sa:a").unwrap();
        assert!(one.matches("https://oidc.example#system:sa:a"));
        assert!(!one.matches("https://oidc.example#system:sa:ab"));
    }

    #[test]
    fn patterns_are_checked_when_configured() {
        let longest = format!("spiffe://td/{}", "a".repeat(MAX_IDENTITY_BYTES - 12));
        assert!(IdentityPattern::parse(&longest).is_ok());
        let refused = [
            ("spiffe://prod.example/agents*", "'*' may only end"),
            ("spiffe://prod.example/*/a", "'*' may only end"),
            ("spiffe://prod.example/a*/*", "'*' may only end"),
            ("spiffe://prod.example/agents/**", "'*' may only end"),
            ("*", "'*' may only end"),
            ("/*", "neither"),
            ("", "1..=2048"),
            ("spiffe://td/a\n", "1..=2048"),
            (&format!("{longest}a"), "1..=2048"),
            ("spiffe://Prod.example/agents/*", "lowercase"),
            ("spiffe://prod.example/agents/", "trailing"),
            ("spiffe://prod.example", "names a trust domain"),
            ("https://oidc.example/sub", "neither"),
            ("#sub", "neither"),
            ("agents/*", "neither"),
        ];
        for (text, why) in refused {
            match IdentityPattern::parse(text) {
                Err(error) => assert!(error.to_string().contains(why), "{text:?}: {error}"),
                Ok(pattern) => panic!("{text:?} parsed as {pattern:?}"),
            }
        }
    }

    #[test]
    fn issuer_policies_are_checked_when_configured() {
        assert_eq!(spiffe_policy().check(), Ok(()));
        assert_eq!(oidc_policy().check(), Ok(()));
        let without_iss = IssuerPolicy {
            issuer: None,
            ..spiffe_policy()
        };
        assert_eq!(without_iss.check(), Ok(()));
        let refused = [
            IssuerPolicy {
                name: String::new(),
                ..oidc_policy()
            },
            IssuerPolicy {
                name: "k 8s".into(),
                ..oidc_policy()
            },
            IssuerPolicy {
                audiences: vec![],
                ..oidc_policy()
            },
            IssuerPolicy {
                audiences: vec!["broker".into(), String::new()],
                ..oidc_policy()
            },
            IssuerPolicy {
                issuer: None,
                ..oidc_policy()
            },
            IssuerPolicy {
                issuer: Some(String::new()),
                ..oidc_policy()
            },
            IssuerPolicy {
                issuer: Some("https://oidc.example#x".into()),
                ..oidc_policy()
            },
            IssuerPolicy {
                issuer: Some("SPIFFE://prod.example".into()),
                ..oidc_policy()
            },
            IssuerPolicy {
                kind: IssuerKind::Spiffe {
                    trust_domain: "Prod.example".into(),
                },
                ..spiffe_policy()
            },
            IssuerPolicy {
                kind: IssuerKind::Spiffe {
                    trust_domain: String::new(),
                },
                ..spiffe_policy()
            },
        ];
        for policy in refused {
            assert!(
                matches!(policy.check(), Err(IdentityConfigError::Issuer { .. })),
                "{policy:?}"
            );
        }
    }

    #[test]
    fn reasons_are_distinct_upper_snake_codes() {
        let m = String::new;
        let all = [
            IdentityError::Algorithm(m()),
            IdentityError::Lifetime(m()),
            IdentityError::Expired(m()),
            IdentityError::NotYetValid(m()),
            IdentityError::Audience(m()),
            IdentityError::Issuer(m()),
            IdentityError::TrustDomain(m()),
            IdentityError::Subject(m()),
            IdentityError::KeyBinding(m()),
        ];
        let codes: std::collections::BTreeSet<&str> =
            all.iter().map(IdentityError::reason).collect();
        assert_eq!(codes.len(), all.len());
        for code in codes {
            assert!(code.starts_with("IDENTITY_"), "{code}");
            assert!(
                code.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{code}"
            );
        }
    }
}
