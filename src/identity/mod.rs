//! Workload identities in: the issuers `[identity]` trusts, their keys
//! (read from a file or fetched, and read again every `refresh_s`), and
//! the verification of a workload token an agent presents to BindIdentity
//! — the token's issuer chosen by its claims, its signature checked under
//! that issuer's keys only. Every other rule is
//! `broker_domain::identity`'s.

pub mod jwks;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::Value;

use crate::config::{IdentityConfig, IssuerConfig, KeySource};
use crate::core::identity::{self as rules, IdentityError, IssuerKind, Workload};

/// Longest a key fetch may take, and the most it may read.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a token does not prove an identity: `check` is the stable code
/// (`IDENTITY_*`, errors.proto's IDENTITY_REFUSED metadata).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct Refused {
    pub check: &'static str,
    pub detail: String,
}

impl From<IdentityError> for Refused {
    fn from(error: IdentityError) -> Self {
        Self {
            check: error.reason(),
            detail: error.to_string(),
        }
    }
}

fn refused(check: &'static str, detail: impl Into<String>) -> Refused {
    Refused {
        check,
        detail: detail.into(),
    }
}

/// One trusted issuer and its current keys.
struct Issuer {
    config: IssuerConfig,
    /// Replaced whole on each successful read; kept when a read fails.
    keys: RwLock<Arc<Vec<jwks::Jwk>>>,
}

/// Every issuer `[identity]` trusts.
pub struct Issuers {
    issuers: Vec<Issuer>,
    http: reqwest::Client,
}

impl Issuers {
    /// Reads every issuer's keys once. A file that cannot be read fails
    /// the start; a URL that cannot be fetched is said in the log and
    /// fetched again at the next refresh (its tokens are refused until
    /// then, naming why).
    pub async fn load(config: &IdentityConfig) -> Result<Self, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            // A redirect could lead to plain http, or anywhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        let mut issuers = Vec::new();
        for config in &config.issuers {
            let keys = match read_keys(&http, &config.keys).await {
                Ok(keys) => keys,
                Err(e) if matches!(config.keys, KeySource::File(_)) => {
                    return Err(format!(
                        "identity.issuers.{}.jwks_file: {e}",
                        config.policy.name
                    ));
                }
                Err(e) => {
                    tracing::warn!(issuer = %config.policy.name, error = %e, "cannot fetch the issuer's keys; its tokens are refused until a refresh fetches them");
                    Vec::new()
                }
            };
            issuers.push(Issuer {
                config: config.clone(),
                keys: RwLock::new(Arc::new(keys)),
            });
        }
        Ok(Self { issuers, http })
    }

    pub fn is_empty(&self) -> bool {
        self.issuers.is_empty()
    }

    /// Whether the issuer named `name` is still trusted: a binding an
    /// issuer since removed from `[identity]` made counts for nothing.
    pub fn trusts(&self, name: &str) -> bool {
        self.issuers.iter().any(|i| i.config.policy.name == name)
    }

    /// Reads every issuer's keys again every `refresh_s`, until
    /// `stopping` turns true.
    pub fn refresh_until(self: &Arc<Self>, stopping: tokio::sync::watch::Receiver<bool>) {
        for index in 0..self.issuers.len() {
            let (issuers, mut stopping) = (self.clone(), stopping.clone());
            tokio::spawn(async move {
                let issuer = &issuers.issuers[index];
                let every = Duration::from_secs(issuer.config.refresh_s);
                loop {
                    tokio::select! {
                        _ = stopping.wait_for(|stop| *stop) => return,
                        () = tokio::time::sleep(every) => {}
                    }
                    match read_keys(&issuers.http, &issuer.config.keys).await {
                        Ok(keys) => {
                            *issuer
                                .keys
                                .write()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                                Arc::new(keys);
                        }
                        Err(e) => {
                            tracing::warn!(issuer = %issuer.config.policy.name, error = %e, "cannot read the issuer's keys again; keeping the last ones read")
                        }
                    }
                }
            });
        }
    }

    /// The workload `token` proves, bound to `agent_key`, at `now_ms`.
    pub fn verify(
        &self,
        token: &str,
        agent_key: &[u8; 32],
        now_ms: i64,
    ) -> Result<Workload, Refused> {
        let jws = crate::jwt::decode_any(token)
            .map_err(|e| refused("IDENTITY_FORMAT", format!("body.token: {e}")))?;
        let algorithm = rules::check_algorithm(jws.alg().unwrap_or(""))?;
        let issuer = self.issuer_of(&jws.claims)?;
        let keys = issuer
            .keys
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let kid = jws.kid();
        let verified = keys
            .iter()
            .filter(|key| kid.is_none() || key.kid.as_deref() == kid)
            .any(|key| key.verifies(algorithm, jws.signing_input(), jws.signature()));
        if !verified {
            return Err(refused(
                "IDENTITY_SIGNATURE",
                format!(
                    "the token's signature does not verify under the keys of issuer {} ({} keys{})",
                    issuer.config.policy.name,
                    keys.len(),
                    kid.map(|k| format!(
                        ", none with kid {:?}",
                        k.chars().take(64).collect::<String>()
                    ))
                    .unwrap_or_default()
                ),
            ));
        }
        let workload = rules::check_claims(&jws.claims, &issuer.config.policy, now_ms)?;
        rules::check_key_binding(&jws.claims, agent_key)?;
        Ok(workload)
    }

    /// The issuer a token's claims name: an OIDC issuer by `iss`; a SPIFFE
    /// issuer by the trust domain of `sub` (JWT-SVIDs may omit `iss`).
    fn issuer_of(&self, claims: &serde_json::Map<String, Value>) -> Result<&Issuer, Refused> {
        let iss = claims.get("iss").and_then(Value::as_str);
        let sub = claims.get("sub").and_then(Value::as_str).unwrap_or("");
        let trust_domain = rules::parse_spiffe_id(sub).ok().map(|id| id.trust_domain);
        let found = self
            .issuers
            .iter()
            .find(|issuer| match &issuer.config.policy.kind {
                IssuerKind::Oidc => iss.is_some() && iss == issuer.config.policy.issuer.as_deref(),
                IssuerKind::Spiffe { trust_domain: ours } => trust_domain == Some(ours.as_str()),
            });
        if let Some(issuer) = found {
            return Ok(issuer);
        }
        let echo = |text: &str| text.chars().take(256).collect::<String>();
        Err(match trust_domain {
            Some(theirs) => refused(
                "IDENTITY_TRUST_DOMAIN",
                format!(
                    "the token's sub is of trust domain {:?}, which no [identity] issuer trusts",
                    echo(theirs)
                ),
            ),
            None => refused(
                "IDENTITY_ISSUER",
                format!(
                    "the token's iss {:?} is not an issuer of the broker's [identity] configuration",
                    echo(iss.unwrap_or(""))
                ),
            ),
        })
    }
}

/// Reads a key document, bounded in time and bytes.
async fn read_keys(http: &reqwest::Client, source: &KeySource) -> Result<Vec<jwks::Jwk>, String> {
    let bytes = match source {
        KeySource::File(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::Read as _;
                let mut bytes = Vec::new();
                std::fs::File::open(&path)
                    .and_then(|f| {
                        f.take(jwks::MAX_JWKS_BYTES as u64 + 1)
                            .read_to_end(&mut bytes)
                    })
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok::<_, String>(bytes)
            })
            .await
            .map_err(|e| e.to_string())??
        }
        KeySource::Url(url) => {
            let mut response = http
                .get(url)
                .send()
                .await
                .map_err(|e| format!("{url}: {e}"))?
                .error_for_status()
                .map_err(|e| format!("{url}: {e}"))?;
            let mut bytes = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|e| format!("{url}: {e}"))? {
                bytes.extend_from_slice(&chunk);
                if bytes.len() > jwks::MAX_JWKS_BYTES {
                    break;
                }
            }
            bytes
        }
    };
    jwks::parse(&bytes)
}
