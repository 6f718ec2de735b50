//! An issuer's keys (a JWKS document, or a SPIFFE bundle: the same JSON
//! with `use` "jwt-svid") and signature verification under them, for the
//! algorithms `broker_domain::identity::Algorithm` admits.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{self as ring_signature, UnparsedPublicKey};
use serde_json::Value;

use crate::core::identity::Algorithm;

/// Most keys read from one document: issuers publish a few (current and
/// next); a token without `kid` is tried against each.
pub const MAX_JWKS_KEYS: usize = 64;
/// Largest document read, in bytes.
pub const MAX_JWKS_BYTES: usize = 256 * 1024;

/// One public key of an issuer.
#[derive(Clone, Debug)]
pub struct Jwk {
    pub kid: Option<String>,
    key: PublicKey,
}

#[derive(Clone, Debug)]
enum PublicKey {
    Ed25519(ed25519_dalek::VerifyingKey),
    /// Modulus and exponent, big-endian.
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// Uncompressed points (0x04 ‖ x ‖ y).
    P256(Vec<u8>),
    P384(Vec<u8>),
}

/// Reads a JWKS document: signing keys of the kinds verified here; keys
/// for encryption and kinds not verified here are passed over (an issuer
/// may publish them), a malformed one of a verified kind is an error.
pub fn parse(document: &[u8]) -> Result<Vec<Jwk>, String> {
    if document.len() > MAX_JWKS_BYTES {
        return Err(format!("larger than {MAX_JWKS_BYTES} bytes"));
    }
    let json: Value = serde_json::from_slice(document).map_err(|e| format!("not JSON: {e}"))?;
    let keys = json
        .get("keys")
        .and_then(Value::as_array)
        .ok_or("no \"keys\" array (a JWKS or a SPIFFE bundle)")?;
    let mut read = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let usage = key.get("use").and_then(Value::as_str);
        if !matches!(usage, None | Some("sig") | Some("jwt-svid")) {
            continue;
        }
        let Some(parsed) = public_key(key).map_err(|e| format!("keys[{i}]: {e}"))? else {
            continue;
        };
        if read.len() == MAX_JWKS_KEYS {
            return Err(format!("more than {MAX_JWKS_KEYS} signing keys"));
        }
        read.push(Jwk {
            kid: key.get("kid").and_then(Value::as_str).map(str::to_owned),
            key: parsed,
        });
    }
    Ok(read)
}

fn member(key: &Value, name: &str) -> Result<Vec<u8>, String> {
    let text = key
        .get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("no {name}"))?;
    URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|_| format!("{name} is not base64url"))
}

fn public_key(key: &Value) -> Result<Option<PublicKey>, String> {
    let curve = key.get("crv").and_then(Value::as_str);
    Ok(Some(
        match (key.get("kty").and_then(Value::as_str), curve) {
            (Some("OKP"), Some("Ed25519")) => {
                let x = member(key, "x")?;
                PublicKey::Ed25519(crate::crypto::public_key(&x).map_err(|e| e.to_string())?)
            }
            (Some("RSA"), _) => PublicKey::Rsa {
                n: member(key, "n")?,
                e: member(key, "e")?,
            },
            (Some("EC"), Some(curve @ ("P-256" | "P-384"))) => {
                let (x, y) = (member(key, "x")?, member(key, "y")?);
                let width = if curve == "P-256" { 32 } else { 48 };
                if x.len() != width || y.len() != width {
                    return Err(format!("{curve} coordinates are {width} bytes each"));
                }
                let point = [&[4u8][..], &x, &y].concat();
                if curve == "P-256" {
                    PublicKey::P256(point)
                } else {
                    PublicKey::P384(point)
                }
            }
            _ => return Ok(None),
        },
    ))
}

impl Jwk {
    /// Whether `signature` over `message` verifies under this key by
    /// `alg`; a key of another kind than `alg` needs never verifies.
    pub fn verifies(&self, alg: Algorithm, message: &[u8], signature: &[u8]) -> bool {
        use Algorithm as A;
        match (&self.key, alg) {
            (PublicKey::Ed25519(key), A::EdDsa) => ed25519_dalek::Signature::from_slice(signature)
                .is_ok_and(|s| key.verify_strict(message, &s).is_ok()),
            (PublicKey::Rsa { n, e }, _) => {
                let params: &ring_signature::RsaParameters = match alg {
                    A::Rs256 => &ring_signature::RSA_PKCS1_2048_8192_SHA256,
                    A::Rs384 => &ring_signature::RSA_PKCS1_2048_8192_SHA384,
                    A::Rs512 => &ring_signature::RSA_PKCS1_2048_8192_SHA512,
                    A::Ps256 => &ring_signature::RSA_PSS_2048_8192_SHA256,
                    A::Ps384 => &ring_signature::RSA_PSS_2048_8192_SHA384,
                    A::Ps512 => &ring_signature::RSA_PSS_2048_8192_SHA512,
                    _ => return false,
                };
                ring_signature::RsaPublicKeyComponents { n, e }
                    .verify(params, message, signature)
                    .is_ok()
            }
            (PublicKey::P256(point), A::Es256) => {
                UnparsedPublicKey::new(&ring_signature::ECDSA_P256_SHA256_FIXED, point)
                    .verify(message, signature)
                    .is_ok()
            }
            (PublicKey::P384(point), A::Es384) => {
                UnparsedPublicKey::new(&ring_signature::ECDSA_P384_SHA384_FIXED, point)
                    .verify(message, signature)
                    .is_ok()
            }
            _ => false,
        }
    }
}
