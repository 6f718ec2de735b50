//! Compact JWS with EdDSA (RFC 7515, RFC 8037): what the token endpoint
//! signs and what its callers' assertions are. Only `alg: "EdDSA"` over
//! ed25519 is read or written — `none`, HMAC and every other algorithm
//! are refused before a signature is looked at — and verification is
//! strict (no small-order keys, no malleable signatures).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use serde_json::{Map, Value};

use crate::crypto;

/// The one algorithm: ed25519 (RFC 8037's "EdDSA").
pub const ALG: &str = "EdDSA";
/// Longest compact token read, in bytes: a minted token of a depth-64
/// chain is under 8 KiB; more is not a token of ours.
pub const MAX_TOKEN_BYTES: usize = 16_384;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    #[error("longer than {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    #[error("not a compact JWS (three base64url parts separated by dots)")]
    NotCompact,
    #[error("the {0} is not base64url")]
    Base64(&'static str),
    #[error("the {0} is not a JSON object")]
    Json(&'static str),
    #[error("alg {0:?} is not accepted: only \"EdDSA\"")]
    Algorithm(String),
    #[error("the header carries \"crit\", which is not understood")]
    Critical,
    #[error("the signature does not verify")]
    BadSignature,
}

/// A compact JWS read but not yet verified: trust none of it until
/// `verify` passed.
#[derive(Debug, Clone)]
pub struct Unverified {
    pub header: Map<String, Value>,
    pub claims: Map<String, Value>,
    /// `base64url(header) "." base64url(claims)`: what the signature covers.
    signing_input: String,
    signature: Vec<u8>,
}

impl Unverified {
    /// `kid` of the header, if it is a string.
    pub fn kid(&self) -> Option<&str> {
        self.header.get("kid").and_then(Value::as_str)
    }

    /// The header's `alg`, if it is a string.
    pub fn alg(&self) -> Option<&str> {
        self.header.get("alg").and_then(Value::as_str)
    }

    /// What the signature covers.
    pub fn signing_input(&self) -> &[u8] {
        self.signing_input.as_bytes()
    }

    pub fn signature(&self) -> &[u8] {
        &self.signature
    }

    /// Strict ed25519 verification under `key`.
    pub fn verify(&self, key: &VerifyingKey) -> Result<(), JwtError> {
        let signature = ed25519_dalek::Signature::from_slice(&self.signature)
            .map_err(|_| JwtError::BadSignature)?;
        key.verify_strict(self.signing_input.as_bytes(), &signature)
            .map_err(|_| JwtError::BadSignature)
    }
}

/// Reads a compact JWS whose header says `alg: "EdDSA"`; any other
/// algorithm (`none`, `HS256`, `RS256`, …) is refused here, so no key is
/// ever used with an algorithm its issuer did not mean.
pub fn decode(token: &str) -> Result<Unverified, JwtError> {
    let read = decode_any(token)?;
    match read.alg() {
        Some(ALG) => Ok(read),
        other => Err(JwtError::Algorithm(
            other.unwrap_or("").chars().take(32).collect(),
        )),
    }
}

/// Reads a compact JWS whatever its `alg`: for tokens of other issuers
/// (workload identities), whose caller checks `alg` against its own
/// allow-list before it verifies.
pub fn decode_any(token: &str) -> Result<Unverified, JwtError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(JwtError::TooLong);
    }
    let mut parts = token.split('.');
    let (Some(header), Some(claims), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtError::NotCompact);
    };
    let header_json = object(header, "header")?;
    if header_json.contains_key("crit") {
        return Err(JwtError::Critical);
    }
    Ok(Unverified {
        header: header_json,
        claims: object(claims, "payload")?,
        signing_input: format!("{header}.{claims}"),
        signature: URL_SAFE_NO_PAD
            .decode(signature)
            .map_err(|_| JwtError::Base64("signature"))?,
    })
}

fn object(part: &str, name: &'static str) -> Result<Map<String, Value>, JwtError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| JwtError::Base64(name))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(JwtError::Json(name)),
    }
}

/// Signs `claims` as a compact JWS: header `{"alg":"EdDSA","typ":typ}`
/// plus `kid` when given.
pub fn sign(key: &SigningKey, typ: &str, kid: Option<&str>, claims: &Map<String, Value>) -> String {
    let mut header = Map::new();
    header.insert("alg".into(), ALG.into());
    header.insert("typ".into(), typ.into());
    if let Some(kid) = kid {
        header.insert("kid".into(), kid.into());
    }
    let encode = |map: &Map<String, Value>| {
        // A map of JSON values always serializes.
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(map).unwrap_or_default())
    };
    let signing_input = format!("{}.{}", encode(&header), encode(claims));
    let signature = key.sign(signing_input.as_bytes());
    format!(
        "{signing_input}.{}",
        URL_SAFE_NO_PAD.encode(signature.to_bytes())
    )
}

/// One public key as a JWK (RFC 8037: `kty` OKP, `crv` Ed25519), its
/// `kid` the broker's key id.
pub fn jwk(public_key: &[u8; 32]) -> Value {
    serde_json::json!({
        "kty": "OKP",
        "crv": "Ed25519",
        "x": URL_SAFE_NO_PAD.encode(public_key),
        "kid": crypto::key_id(public_key),
        "use": "sig",
        "alg": ALG,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    fn claims() -> Map<String, Value> {
        let Value::Object(map) = serde_json::json!({"sub": "a", "n": 1}) else {
            unreachable!()
        };
        map
    }

    #[test]
    fn a_signed_token_reads_back_and_verifies() {
        let token = sign(&key(), "JWT", Some("k1"), &claims());
        let read = decode(&token).unwrap();
        assert_eq!(read.kid(), Some("k1"));
        assert_eq!(read.claims, claims());
        read.verify(&key().verifying_key()).unwrap();
        let other = SigningKey::from_bytes(&[8; 32]).verifying_key();
        assert_eq!(read.verify(&other), Err(JwtError::BadSignature));
    }

    #[test]
    fn other_algorithms_are_refused_before_any_key() {
        let body = URL_SAFE_NO_PAD.encode(br#"{"sub":"a"}"#);
        for alg in [
            r#"{"alg":"none"}"#,
            r#"{"alg":"HS256"}"#,
            r#"{"typ":"JWT"}"#,
        ] {
            let token = format!("{}.{body}.", URL_SAFE_NO_PAD.encode(alg));
            assert!(
                matches!(decode(&token), Err(JwtError::Algorithm(_))),
                "{alg}"
            );
        }
        let crit = URL_SAFE_NO_PAD.encode(r#"{"alg":"EdDSA","crit":["b64"]}"#);
        assert_eq!(
            decode(&format!("{crit}.{body}.")).unwrap_err(),
            JwtError::Critical
        );
    }

    #[test]
    fn a_changed_payload_or_signature_does_not_verify() {
        let token = sign(&key(), "JWT", None, &claims());
        let parts: Vec<&str> = token.split('.').collect();
        let forged = format!(
            "{}.{}.{}",
            parts[0],
            URL_SAFE_NO_PAD.encode(br#"{"sub":"b","n":1}"#),
            parts[2]
        );
        assert_eq!(
            decode(&forged).unwrap().verify(&key().verifying_key()),
            Err(JwtError::BadSignature)
        );
        for bad in ["a.b", "a.b.c.d", &"x".repeat(MAX_TOKEN_BYTES + 1)] {
            assert!(decode(bad).is_err(), "{bad:.20}");
        }
    }

    #[test]
    fn a_jwk_names_the_key_as_rfc_8037_does() {
        let public = key().verifying_key().to_bytes();
        let jwk = jwk(&public);
        assert_eq!(jwk["kty"], "OKP");
        assert_eq!(jwk["crv"], "Ed25519");
        assert_eq!(
            URL_SAFE_NO_PAD.decode(jwk["x"].as_str().unwrap()).unwrap(),
            public
        );
        assert_eq!(jwk["kid"], crypto::key_id(&public));
    }
}
