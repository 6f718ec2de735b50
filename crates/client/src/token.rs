//! The broker's token endpoint (`serve --tokens`) from the holder's side:
//! discover it (RFC 8414 metadata), exchange a contract for a JWT a
//! resource server checks (RFC 8693), and introspect one (RFC 7662).

use std::time::Duration;

use serde_json::Value;

use crate::Agent;

/// RFC 8414's metadata path under the issuer.
pub const METADATA_PATH: &str = "/.well-known/oauth-authorization-server";
/// Bounds on one HTTP call.
pub const TIMEOUT: Duration = Duration::from_secs(10);
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest answer read, in bytes.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// How long an assertion lives: enough for one exchange.
pub const ASSERTION_LIFETIME_S: i64 = 60;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The endpoint refused, with RFC 6749's error code.
    #[error("{error}: {description} (HTTP {status})")]
    Refused {
        status: u16,
        error: String,
        description: String,
    },
    #[error("{0}")]
    Http(String),
    #[error("the token endpoint's answer: {0}")]
    Answer(String),
}

/// Where the endpoints are (the metadata's members this client uses).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub issuer: String,
    pub token_endpoint: String,
    pub jwks_uri: String,
    pub introspection_endpoint: String,
}

/// A minted token.
#[derive(Debug, Clone)]
pub struct Minted {
    pub access_token: String,
    pub expires_in: i64,
}

/// A client of one broker's token endpoint.
#[derive(Clone)]
pub struct TokenEndpoint {
    http: reqwest::Client,
    /// The issuer URL, without a trailing slash.
    base: String,
    /// The metadata once read: the endpoints do not move while the
    /// broker serves, and a mint should not cost two round trips.
    endpoints: std::sync::Arc<tokio::sync::OnceCell<Endpoints>>,
}

impl TokenEndpoint {
    pub fn new(url: &str) -> Result<Self, TokenError> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(TokenError::Http(format!(
                "{url:?} is not an http:// or https:// URL"
            )));
        }
        // reqwest takes the process's rustls provider; one install wins.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .map_err(|e| TokenError::Http(e.to_string()))?;
        Ok(Self {
            http,
            base: url.trim_end_matches('/').to_owned(),
            endpoints: std::sync::Arc::default(),
        })
    }

    /// The endpoints, read from the metadata the first time (a failed read
    /// is tried again next time).
    pub async fn metadata(&self) -> Result<Endpoints, TokenError> {
        self.endpoints
            .get_or_try_init(|| self.read_metadata())
            .await
            .cloned()
    }

    async fn read_metadata(&self) -> Result<Endpoints, TokenError> {
        let url = format!("{}{METADATA_PATH}", self.base);
        let answer = self.answer(self.http.get(&url)).await?;
        let member = |name: &str| {
            answer
                .get(name)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| TokenError::Answer(format!("the metadata has no {name}")))
        };
        let issuer = member("issuer")?;
        // RFC 8414 §3.3: metadata naming another issuer is not this one's
        // (and its endpoints must not get our assertion or secret).
        if issuer.trim_end_matches('/') != self.base {
            return Err(TokenError::Answer(format!(
                "the metadata names issuer {issuer:?}, not {:?}",
                self.base
            )));
        }
        Ok(Endpoints {
            issuer,
            token_endpoint: member("token_endpoint")?,
            jwks_uri: member("jwks_uri")?,
            introspection_endpoint: member("introspection_endpoint")?,
        })
    }

    /// A token for `resource`, proving with `agent`'s key that it holds
    /// `contract_id`.
    pub async fn mint(
        &self,
        agent: &Agent,
        contract_id: &[u8; 32],
        resource: &str,
    ) -> Result<Minted, TokenError> {
        let endpoints = self.metadata().await?;
        let now_s = broker_wire::clock::Clock::now_ms(&broker_wire::clock::SystemClock) / 1000;
        let assertion = agent.token_assertion(
            &endpoints.token_endpoint,
            contract_id,
            now_s,
            ASSERTION_LIFETIME_S,
        );
        let form = form_body(&[
            (
                "grant_type",
                "urn:ietf:params:oauth:grant-type:token-exchange",
            ),
            ("subject_token", &assertion),
            ("subject_token_type", "urn:ietf:params:oauth:token-type:jwt"),
            ("resource", resource),
        ]);
        let answer = self
            .answer(self.form(&endpoints.token_endpoint, form))
            .await?;
        Ok(Minted {
            access_token: answer
                .get("access_token")
                .and_then(Value::as_str)
                .ok_or_else(|| TokenError::Answer("no access_token".into()))?
                .to_owned(),
            expires_in: answer
                .get("expires_in")
                .and_then(Value::as_i64)
                .unwrap_or(0),
        })
    }

    /// Introspection as the resource server `client_id` (HTTP Basic).
    pub async fn introspect(
        &self,
        (client_id, secret): (&str, &str),
        token: &str,
    ) -> Result<Value, TokenError> {
        let endpoints = self.metadata().await?;
        let request = self
            .form(
                &endpoints.introspection_endpoint,
                form_body(&[("token", token)]),
            )
            .basic_auth(client_id, Some(secret));
        self.answer(request).await
    }

    fn form(&self, url: &str, body: String) -> reqwest::RequestBuilder {
        self.http
            .post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
    }

    /// Sends `request`; a JSON object on 200, the RFC 6749 error
    /// otherwise.
    async fn answer(&self, request: reqwest::RequestBuilder) -> Result<Value, TokenError> {
        let mut response = request
            .send()
            .await
            .map_err(|e| TokenError::Http(crate::error::with_causes(&e)))?;
        let status = response.status().as_u16();
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| TokenError::Http(e.to_string()))?
        {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(TokenError::Answer(format!(
                    "longer than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        let json: Value = serde_json::from_slice(&body)
            .map_err(|_| TokenError::Answer(format!("HTTP {status}, not JSON")))?;
        if status == 200 {
            return Ok(json);
        }
        let text = |name: &str| {
            json.get(name)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        Err(TokenError::Refused {
            status,
            error: text("error"),
            description: text("error_description"),
        })
    }
}

fn form_body(pairs: &[(&str, &str)]) -> String {
    let mut form = form_urlencoded::Serializer::new(String::new());
    for (name, value) in pairs {
        form.append_pair(name, value);
    }
    form.finish()
}

/// A token is minted again when it has less than this left.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30);
/// Most contracts whose tokens one `Minter` keeps (forgotten all at once
/// when full: each costs one mint to refill).
pub const MAX_CACHED_TOKENS: usize = 1_024;

/// Tokens for one resource, minted on demand and kept until
/// `RENEW_BEFORE` of their end: what a gateway attaching a token to each
/// call needs, without a mint per call.
pub struct Minter {
    endpoint: TokenEndpoint,
    resource: String,
    cache: std::sync::Mutex<std::collections::HashMap<[u8; 32], (String, std::time::Instant)>>,
}

impl Minter {
    pub fn new(tokens_url: &str, resource: &str) -> Result<Self, TokenError> {
        Ok(Self {
            endpoint: TokenEndpoint::new(tokens_url)?,
            resource: resource.to_owned(),
            cache: std::sync::Mutex::default(),
        })
    }

    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// A token for `contract`, which `agent` holds or hosts: the kept one
    /// while it has `RENEW_BEFORE` left, else a new one.
    pub async fn token(&self, agent: &Agent, contract: &[u8; 32]) -> Result<String, TokenError> {
        let now = std::time::Instant::now();
        let cached = self
            .lock_cache()
            .get(contract)
            .filter(|(_, until)| until.saturating_duration_since(now) > RENEW_BEFORE)
            .map(|(token, _)| token.clone());
        if let Some(token) = cached {
            return Ok(token);
        }
        let minted = self.endpoint.mint(agent, contract, &self.resource).await?;
        let lifetime = Duration::from_secs(u64::try_from(minted.expires_in).unwrap_or(0));
        let mut cache = self.lock_cache();
        if cache.len() >= MAX_CACHED_TOKENS {
            cache.clear();
        }
        cache.insert(*contract, (minted.access_token.clone(), now + lifetime));
        Ok(minted.access_token)
    }

    fn lock_cache(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<[u8; 32], (String, std::time::Instant)>>
    {
        // Entries are inserted whole: a poisoned cache is still a good one.
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A token as the value of `header`: `Bearer <token>` in `Authorization`
/// (RFC 6750), the bare token in any other header.
pub fn header_value(
    header: &reqwest::header::HeaderName,
    token: &str,
) -> Result<reqwest::header::HeaderValue, TokenError> {
    let value = if header == reqwest::header::AUTHORIZATION {
        format!("Bearer {token}")
    } else {
        token.to_owned()
    };
    reqwest::header::HeaderValue::try_from(value)
        .map_err(|e| TokenError::Answer(format!("the minted token is not a header value: {e}")))
}
