//! The four endpoints and their one error mapping: metadata, keys, token
//! exchange and introspection. Each loads and signs; the decisions are
//! `broker_domain::token`'s.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use prost::Message as _;
use serde_json::{Value, json};

use super::memory::KnownToken;
use super::replay::Taken;
use super::{
    ADMISSION_WAIT, INTROSPECT_PATH, JWKS_PATH, MAX_FORM_BYTES, METADATA_PATH, REQUEST_TIMEOUT,
    TOKEN_PATH, TokenService,
};
use crate::core::token::{self, Hop, TokenError};
use crate::core::{AgentKey, Id};
use crate::store::Store;
use crate::{crypto, pb};

/// Most parameters in one form: the exchange has seven at most.
const MAX_FORM_FIELDS: usize = 16;
/// RFC 8693's access-token type, also accepted as `requested_token_type`.
const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";

/// Why an endpoint answered with an error: a refusal (RFC 6749 §5.2, 400
/// or 401), or a passing failure worth retrying (503).
#[derive(Debug)]
enum EndpointError {
    Refused(TokenError),
    Unavailable(String),
}

impl From<TokenError> for EndpointError {
    fn from(error: TokenError) -> Self {
        Self::Refused(error)
    }
}

impl IntoResponse for EndpointError {
    fn into_response(self) -> Response {
        let (status, code, description) = match &self {
            Self::Refused(error @ TokenError::InvalidClient(_)) => {
                (StatusCode::UNAUTHORIZED, error.code(), error.to_string())
            }
            Self::Refused(error) => (StatusCode::BAD_REQUEST, error.code(), error.to_string()),
            Self::Unavailable(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily_unavailable",
                why.clone(),
            ),
        };
        let mut response = answer(
            status,
            json!({"error": code, "error_description": description}),
        );
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"introspection\""),
            );
        }
        response
    }
}

/// A JSON answer that no cache keeps (RFC 6749 §5.1).
fn answer(status: StatusCode, body: Value) -> Response {
    let mut response = (status, axum::Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

pub(super) fn router<S: Store>(service: Arc<TokenService<S>>) -> axum::Router {
    axum::Router::new()
        .route(METADATA_PATH, get(metadata::<S>))
        .route(JWKS_PATH, get(jwks::<S>))
        .route(TOKEN_PATH, post(exchange::<S>))
        .route(INTROSPECT_PATH, post(introspect::<S>))
        .with_state(service)
}

/// RFC 8414: where everything is and what it speaks.
async fn metadata<S: Store>(State(service): State<Arc<TokenService<S>>>) -> Response {
    let issuer = &service.issuer;
    answer(
        StatusCode::OK,
        json!({
            "issuer": issuer,
            "token_endpoint": format!("{issuer}{TOKEN_PATH}"),
            "jwks_uri": format!("{issuer}{JWKS_PATH}"),
            "introspection_endpoint": format!("{issuer}{INTROSPECT_PATH}"),
            "grant_types_supported": [token::GRANT_TYPE],
            // The subject token (the holder's signed assertion) is the
            // proof: no client authentication at the token endpoint.
            "token_endpoint_auth_methods_supported": ["none"],
            "introspection_endpoint_auth_methods_supported": ["client_secret_basic"],
            "response_types_supported": [],
        }),
    )
}

/// Every key the broker signs with or signed with (retired keys' tokens
/// still verify until they expire).
async fn jwks<S: Store>(State(service): State<Arc<TokenService<S>>>) -> Response {
    let keys = service.keys.refreshed(service.store.as_ref()).await;
    let keys: Vec<Value> = keys
        .iter()
        .filter_map(|key| <[u8; 32]>::try_from(key.public_key.as_slice()).ok())
        .map(|key| crate::jwt::jwk(&key))
        .collect();
    answer(StatusCode::OK, json!({ "keys": keys }))
}

/// RFC 8693 token exchange: the holder's assertion in, a broker-signed
/// token for one resource out.
async fn exchange<S: Store>(
    State(service): State<Arc<TokenService<S>>>,
    body: axum::body::Body,
) -> Response {
    let answered = async {
        let form = read_form(body).await?;
        service.exchange(&form).await
    };
    match answered.await {
        Ok(body) => answer(StatusCode::OK, body),
        Err(error) => error.into_response(),
    }
}

/// RFC 7662: whether a token still stands, to an authenticated resource
/// server.
async fn introspect<S: Store>(
    State(service): State<Arc<TokenService<S>>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let answered = async {
        service.authenticate(&headers)?;
        let form = read_form(body).await?;
        let token = field(&form, "token")
            .ok_or_else(|| TokenError::InvalidRequest("name the token to introspect".into()))?;
        service.introspect(token).await
    };
    match answered.await {
        Ok(Some(known)) => {
            let mut response = Response::new(axum::body::Body::from(known.active.clone()));
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        Ok(None) => answer(StatusCode::OK, json!({"active": false})),
        Err(error) => error.into_response(),
    }
}

/// The form body, within `MAX_FORM_BYTES` and `REQUEST_TIMEOUT`; a
/// parameter given twice is refused (RFC 6749 §3.2).
async fn read_form(body: axum::body::Body) -> Result<HashMap<String, String>, EndpointError> {
    let bytes =
        match tokio::time::timeout(REQUEST_TIMEOUT, axum::body::to_bytes(body, MAX_FORM_BYTES))
            .await
        {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(_)) => {
                return Err(TokenError::InvalidRequest(format!(
                    "the body is not a form of at most {MAX_FORM_BYTES} bytes"
                ))
                .into());
            }
            Err(_) => {
                return Err(TokenError::InvalidRequest(format!(
                    "the body did not arrive within {} s",
                    REQUEST_TIMEOUT.as_secs()
                ))
                .into());
            }
        };
    let mut form = HashMap::new();
    for (name, value) in form_urlencoded::parse(&bytes) {
        if form.len() >= MAX_FORM_FIELDS {
            return Err(TokenError::InvalidRequest(format!(
                "more than {MAX_FORM_FIELDS} parameters"
            ))
            .into());
        }
        if form.insert(name.to_string(), value.into_owned()).is_some() {
            return Err(TokenError::InvalidRequest(format!("{name} is given twice")).into());
        }
    }
    Ok(form)
}

/// A parameter, `None` when absent or empty (RFC 6749 §3.1).
fn field<'a>(form: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    form.get(name).map(String::as_str).filter(|v| !v.is_empty())
}

impl<S: Store> TokenService<S> {
    async fn exchange(&self, form: &HashMap<String, String>) -> Result<Value, EndpointError> {
        let resource = exchange_target(form)?;
        token::check_resource(resource, &self.config.resources)?;
        let assertion = field(form, "subject_token").ok_or_else(|| {
            TokenError::InvalidRequest(
                "subject_token (the holder's signed assertion) is missing".into(),
            )
        })?;
        let jws = crate::jwt::decode(assertion)
            .map_err(|e| TokenError::InvalidGrant(format!("subject_token: {e}")))?;
        let now_ms = self.clock.now_ms();
        let claims = token::read_assertion(&jws.claims, &self.token_endpoint(), now_ms)?;
        let key = crypto::public_key(&claims.key)
            .map_err(|e| TokenError::InvalidGrant(format!("the assertion's iss: {e}")))?;
        jws.verify(&key).map_err(|_| {
            TokenError::InvalidGrant(
                "the assertion's signature does not verify under its iss".into(),
            )
        })?;
        // The holder first: only a contract's holder takes a place in the
        // replay memory, and an assertion answered busy is not used up.
        let chain = self
            .standing_chain(claims.contract, None, Some(claims.key))
            .await?;
        match self.replay.take(
            claims.key,
            &claims.jti,
            (claims.exp_s, now_ms.div_euclid(1000)),
            self.config.max_assertions_per_key,
        ) {
            Taken::Fresh => {}
            Taken::Replayed => {
                return Err(TokenError::InvalidGrant(
                    "this assertion was used already (its jti): sign a new one".into(),
                )
                .into());
            }
            Taken::SignerFull => {
                return Err(EndpointError::Unavailable(format!(
                    "this key has {} assertions in use: retry once some expire",
                    self.config.max_assertions_per_key
                )));
            }
            Taken::Full => {
                return Err(EndpointError::Unavailable(
                    "too many assertions in use: retry in a minute".into(),
                ));
            }
        }
        let mut jti = [0u8; 16];
        getrandom::fill(&mut jti).map_err(|e| EndpointError::Unavailable(e.to_string()))?;
        let minted = token::mint(
            &chain,
            &token::Grant {
                holder: claims.key,
                resource,
                issuer: &self.issuer,
                now_ms,
                lifetime_s: i64::from(self.config.lifetime_minutes) * 60,
                jti: hex::encode(jti),
            },
        )?;
        let expires_in = minted["exp"].as_i64().unwrap_or(0) - minted["iat"].as_i64().unwrap_or(0);
        Ok(json!({
            "access_token": self.stamper.sign_jwt(token::ACCESS_TOKEN_TYP, &minted),
            "issued_token_type": token::JWT_TOKEN_TYPE,
            "token_type": "Bearer",
            "expires_in": expires_in,
        }))
    }

    /// HTTP Basic against `[tokens.introspectors]`.
    fn authenticate(&self, headers: &HeaderMap) -> Result<(), TokenError> {
        let refused = || {
            TokenError::InvalidClient(
                "introspection needs HTTP Basic credentials of a client in [tokens.introspectors]"
                    .into(),
            )
        };
        let credentials = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Basic "))
            .and_then(|v| {
                base64::engine::general_purpose::STANDARD
                    .decode(v.trim())
                    .ok()
            })
            .and_then(|v| String::from_utf8(v).ok())
            .ok_or_else(refused)?;
        let (id, secret) = credentials.split_once(':').ok_or_else(refused)?;
        match self.config.introspectors.get(id) {
            Some(digest) if *digest == crypto::sha256(secret.as_bytes()) => Ok(()),
            _ => Err(refused()),
        }
    }

    /// A token's standing: `Some` (with its active answer) while it and
    /// its whole chain stand. Served from memory while the token is known
    /// and its tree unchanged (`memory`).
    async fn introspect(&self, presented: &str) -> Result<Option<Arc<KnownToken>>, EndpointError> {
        let digest = crypto::sha256(presented.as_bytes());
        let known = match self.memory.token(&digest) {
            Some(known) => known,
            None => match self.verified(presented).await {
                Some(known) => self.memory.remember_token(digest, known),
                None => return Ok(None),
            },
        };
        let now_ms = self.clock.now_ms();
        if known.exp_s <= now_ms.div_euclid(1000) {
            return Ok(None);
        }
        let chain = match self
            .standing_chain(known.contract, Some(known.root), None)
            .await
        {
            Ok(chain) => chain,
            // Signed by this broker, but its contract is not here (another
            // deployment's store): nothing stands behind it.
            Err(EndpointError::Refused(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let stands = chain.first().is_some_and(|root| root.id == known.root)
            && token::still_stands(&chain, now_ms).is_ok();
        Ok(stands.then_some(known))
    }

    /// The chain down to `id` (see `chain`), from memory while its tree is
    /// unchanged; a chain read from the store is kept when its tree had
    /// settled before the read (`root` says which tree, else a root an
    /// earlier read showed).
    async fn standing_chain(
        &self,
        id: Id,
        root: Option<Id>,
        holder: Option<AgentKey>,
    ) -> Result<Arc<Vec<Hop>>, EndpointError> {
        let trees = self.store.tree_changes();
        if let Some(chain) = self.memory.chain(&id, &trees) {
            if let (Some(holder), Some(leaf)) = (holder, chain.last())
                && !holds(leaf, holder)
            {
                return Err(not_held().into());
            }
            return Ok(chain);
        }
        // Taken before the read, so the read shows the tree as of this
        // version or later.
        let root = root.or_else(|| self.memory.root_of(&id));
        let settled = root.and_then(|root| trees.settled_version(&root));
        let chain = Arc::new(self.chain(id, holder).await?);
        let same_root = chain.first().map(|hop| hop.id) == root;
        self.memory
            .remember(id, &chain, settled.filter(|_| same_root));
        Ok(chain)
    }

    /// A presented token this broker signed (one of its keys, its issuer),
    /// with the answer it gets while it stands; `None` for anything else.
    async fn verified(&self, presented: &str) -> Option<KnownToken> {
        let jws = crate::jwt::decode(presented).ok()?;
        let kid = jws.kid()?;
        let keys = self.keys.refreshed(self.store.as_ref()).await;
        let signed = keys.iter().any(|key| {
            key.key_id == kid
                && crypto::public_key(&key.public_key).is_ok_and(|k| jws.verify(&k).is_ok())
        });
        let claims = &jws.claims;
        if !signed || claims.get("iss").and_then(Value::as_str) != Some(self.issuer.as_str()) {
            return None;
        }
        let tctx = claims.get("tctx")?;
        let id = |name: &str| {
            tctx.get(name)
                .and_then(Value::as_str)
                .and_then(token::hex32)
        };
        let mut body = claims.clone();
        body.insert("active".into(), true.into());
        body.insert("token_type".into(), "Bearer".into());
        Some(KnownToken {
            contract: id("contract_id")?,
            root: id("root_id")?,
            exp_s: claims.get("exp").and_then(Value::as_i64)?,
            active: serde_json::to_vec(&Value::Object(body)).ok()?.into(),
        })
    }

    /// The chain from the root down to `id`. With `holder`, the
    /// contract's delegate is checked before any ancestor is read: a
    /// stranger costs one read, and learns nothing of whether the id
    /// exists.
    async fn chain(&self, id: Id, holder: Option<AgentKey>) -> Result<Vec<Hop>, EndpointError> {
        let _at_work = tokio::time::timeout(ADMISSION_WAIT, self.at_work.acquire())
            .await
            .ok()
            .and_then(Result::ok)
            .ok_or_else(|| EndpointError::Unavailable("busy: retry shortly".into()))?;
        let mut chain = Vec::new();
        let mut next = Some(id);
        while let Some(id) = next {
            if chain.len() > crate::core::limits::MAX_DEPTH_CEILING as usize {
                return Err(EndpointError::Unavailable(
                    "a chain deeper than the broker allows: the store is inconsistent".into(),
                ));
            }
            let record = self
                .store
                .contract(id)
                .await
                .map_err(|e| EndpointError::Unavailable(format!("the store: {e}")))?;
            let Some(record) = record else {
                return Err(not_held().into());
            };
            let hop = hop(&record).map_err(EndpointError::Unavailable)?;
            if chain.is_empty() && holder.is_some_and(|holder| !holds(&hop, holder)) {
                return Err(not_held().into());
            }
            next = record.parent_id;
            chain.push(hop);
        }
        chain.reverse();
        Ok(chain)
    }
}

/// Whether `key` holds `hop`'s contract: its delegate or its host.
fn holds(hop: &Hop, key: AgentKey) -> bool {
    key == hop.delegate || hop.host.as_ref().is_some_and(|(host, _)| *host == key)
}

fn not_held() -> TokenError {
    TokenError::InvalidGrant(
        "the assertion's signer holds no contract with this contract_id (as its delegate or host)"
            .into(),
    )
}

/// The token exchange's parameters besides the assertion: the grant and
/// token types this endpoint serves, and the one target (`resource` or
/// `audience`).
fn exchange_target(form: &HashMap<String, String>) -> Result<&str, TokenError> {
    let Some(grant_type) = field(form, "grant_type") else {
        return Err(TokenError::InvalidRequest("grant_type is missing".into()));
    };
    if grant_type != token::GRANT_TYPE {
        return Err(TokenError::UnsupportedGrantType(format!(
            "grant_type must be {:?}",
            token::GRANT_TYPE
        )));
    }
    if field(form, "subject_token_type") != Some(token::JWT_TOKEN_TYPE) {
        return Err(TokenError::InvalidRequest(format!(
            "subject_token_type must be {:?}",
            token::JWT_TOKEN_TYPE
        )));
    }
    if let Some(requested) = field(form, "requested_token_type")
        && requested != token::JWT_TOKEN_TYPE
        && requested != ACCESS_TOKEN_TYPE
    {
        return Err(TokenError::InvalidRequest(format!(
            "requested_token_type {requested:?} is not issued: only a JWT access token"
        )));
    }
    let target = match (field(form, "resource"), field(form, "audience")) {
        (Some(r), Some(a)) if r != a => {
            return Err(TokenError::InvalidRequest(
                "resource and audience name different targets: give one".into(),
            ));
        }
        (Some(target), _) | (None, Some(target)) => target,
        (None, None) => "",
    };
    Ok(target)
}

/// One stored contract as the token rules see it.
fn hop(record: &crate::store::ContractRecord) -> Result<Hop, String> {
    let contract = pb::Contract::decode(record.envelope.payload.as_slice())
        .map_err(|e| format!("a stored contract does not decode: {e}"))?;
    let delegate: [u8; 32] = contract
        .delegate_public_key
        .as_slice()
        .try_into()
        .map_err(|_| "a stored contract's delegate key is not 32 bytes".to_owned())?;
    let lineage_hash = contract
        .intent_lineage_hash
        .as_slice()
        .try_into()
        .map_err(|_| "a stored contract's lineage hash is not 32 bytes".to_owned())?;
    Ok(Hop {
        id: record.id,
        delegate,
        // The workload identity stamped at issuance, else the key id.
        subject: if contract.delegate_identity.is_empty() {
            crypto::key_id(&delegate)
        } else {
            contract.delegate_identity.clone()
        },
        status: record.status,
        deadline_ms: contract.deadline_ms,
        depth: contract.depth,
        lineage_hash,
        trust_ppm: contract.cumulative_trust_ppm,
        residual: record.ledger.residual(),
        write_scope: contract.write_scope,
        host: record.host_key.map(|host| (host, crypto::key_id(&host))),
    })
}
