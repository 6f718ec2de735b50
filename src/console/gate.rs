//! The console's front door: every request to the console listener passes
//! here first. It serves the page, hands a session of the configured
//! reader to whoever shows the access token, and lets through to gRPC-Web
//! only the read RPCs, only with the token, only from allowed origins.
//! Everything else is answered here and never reaches the broker.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};

use super::assets;
use crate::clock::Clock;
use crate::core::AgentKey;
use crate::service::session::Sessions;

/// The header that carries the access token, on the session request and
/// on every gRPC-Web call.
pub const TOKEN_HEADER: &str = "x-console-token";
/// Where the page asks for a session.
pub const SESSION_PATH: &str = "/console/session";
/// The broker's service, as gRPC paths name it.
const SERVICE_PREFIX: &str = "/delegation.broker.v1.Broker/";
/// The RPCs the console serves: reads only. Anything else is refused
/// PERMISSION_DENIED (gRPC status 7) before it reaches the broker.
pub const READ_METHODS: &[&str] = &[
    "GetContract",
    "GetChain",
    "ListChildren",
    "ListRoots",
    "GetReceipt",
    "GetBrokerKeys",
    "Watch",
    "GetAudit",
    "AggregateAudits",
];
/// Request headers a page from an allowed extra origin may send.
const ALLOWED_HEADERS: &str =
    "content-type, x-grpc-web, x-user-agent, grpc-timeout, x-console-token, x-broker-session-bin";
/// Response headers such a page may read (gRPC-Web's status).
const EXPOSED_HEADERS: &str = "grpc-status, grpc-message, grpc-status-details-bin";

/// What every request is checked against.
pub struct GateState {
    /// SHA-256 of the access token: compared digest to digest, so the
    /// comparison's time says nothing about the token.
    token_digest: [u8; 32],
    /// Origins whose pages may call the console; the first is its own.
    origins: Vec<String>,
    reader: AgentKey,
    /// Signs the reader's sessions (the broker's key, as OpenSession).
    sessions: Sessions,
    clock: Arc<dyn Clock>,
    /// The address book as a JSON object (hex key → name), built once.
    names_json: serde_json::Value,
    /// The page's files.
    assets: Vec<assets::Asset>,
}

impl GateState {
    pub fn new(
        token: &str,
        origins: Vec<String>,
        reader: AgentKey,
        sessions: Sessions,
        clock: Arc<dyn Clock>,
        names: &std::collections::BTreeMap<[u8; 32], String>,
        assets: Vec<assets::Asset>,
    ) -> Self {
        let names_json = names
            .iter()
            .map(|(key, name)| (hex::encode(key), serde_json::Value::from(name.as_str())))
            .collect::<serde_json::Map<_, _>>()
            .into();
        Self {
            token_digest: crate::crypto::sha256(token.as_bytes()),
            origins: origins.iter().map(|o| normalize_origin(o)).collect(),
            reader,
            sessions,
            clock,
            names_json,
            assets,
        }
    }

    fn token_ok(&self, headers: &http::HeaderMap) -> bool {
        headers
            .get(TOKEN_HEADER)
            .is_some_and(|t| crate::crypto::sha256(t.as_bytes()) == self.token_digest)
    }
}

broker_runtime::state_layer! {
    /// The tower layer around the gRPC-Web service.
    pub struct GateLayer(Arc<GateState>) => Gate { state }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the gate does with one request.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// A page from an origin that may not call the console.
    ForeignOrigin,
    /// A CORS preflight from an allowed extra origin.
    Preflight,
    /// The page's file at this index of `GateState::assets`.
    Asset(usize),
    Session,
    /// A read RPC: to the broker, if the token is right.
    Read,
    /// Any other gRPC-Web call (a mutating RPC, health, reflection).
    NotRead,
    NotFound,
}

fn route(state: &GateState, method: &Method, path: &str, headers: &http::HeaderMap) -> Route {
    let origin = headers.get(header::ORIGIN).map(HeaderValue::as_bytes);
    if let Some(origin) = origin
        && !std::str::from_utf8(origin).is_ok_and(|o| state.origins.contains(&normalize_origin(o)))
    {
        return Route::ForeignOrigin;
    }
    if *method == Method::OPTIONS && origin.is_some() {
        return Route::Preflight;
    }
    if *method == Method::GET
        && let Some(at) = state.assets.iter().position(|a| a.path == path)
    {
        return Route::Asset(at);
    }
    if *method == Method::POST && path == SESSION_PATH {
        return Route::Session;
    }
    // gRPC-Web only: native gRPC (HTTP/2, `application/grpc`) belongs to
    // the main listener, with its TLS.
    let grpc = headers
        .get(header::CONTENT_TYPE)
        .map(HeaderValue::as_bytes)
        .filter(|c| c.starts_with(b"application/grpc"));
    match grpc {
        Some(c) if *method == Method::POST && c.starts_with(b"application/grpc-web") => {
            match path.strip_prefix(SERVICE_PREFIX) {
                Some(name) if READ_METHODS.contains(&name) => Route::Read,
                _ => Route::NotRead,
            }
        }
        Some(_) => Route::NotRead,
        None => Route::NotFound,
    }
}

/// An origin as compared: lower case, without the scheme's default port
/// (browsers send `http://host`, never `http://host:80`).
pub fn normalize_origin(origin: &str) -> String {
    let lower = origin.trim().to_ascii_lowercase();
    for (scheme, port) in [("http://", ":80"), ("https://", ":443")] {
        if lower.starts_with(scheme)
            && let Some(bare) = lower.strip_suffix(port)
        {
            return bare.to_owned();
        }
    }
    lower
}

impl<S, B> tower::Service<Request<B>> for Gate<S>
where
    S: tower::Service<Request<B>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let state = &self.state;
        let route = route(
            state,
            request.method(),
            request.uri().path(),
            request.headers(),
        );
        // CORS headers only for an origin that passed the check.
        let origin = match route {
            Route::ForeignOrigin => None,
            _ => request.headers().get(header::ORIGIN).cloned(),
        };
        let answer = match route {
            Route::ForeignOrigin => plain(
                StatusCode::FORBIDDEN,
                "this origin may not call the console",
            ),
            Route::Preflight => preflight(),
            Route::Asset(at) => asset_response(&state.assets[at]),
            Route::Session => session(state, request.headers()),
            Route::NotRead => grpc_refusal(7, "the console serves the read RPCs only"),
            Route::NotFound => plain(StatusCode::NOT_FOUND, "not found"),
            Route::Read if !state.token_ok(request.headers()) => grpc_refusal(
                16,
                "the console's access token is missing or wrong (header x-console-token)",
            ),
            Route::Read => {
                // The token is the console's, not the broker's metadata.
                request.headers_mut().remove(TOKEN_HEADER);
                let call = self.inner.call(request);
                return Box::pin(async move {
                    let mut response = call.await?;
                    cors(response.headers_mut(), origin);
                    Ok(response)
                });
            }
        };
        let mut response = answer;
        cors(response.headers_mut(), origin);
        Box::pin(std::future::ready(Ok(response)))
    }
}

/// Lets an allowed page read the answer (the origin was checked already;
/// on the console's own origin these headers are harmless).
fn cors(headers: &mut http::HeaderMap, origin: Option<HeaderValue>) {
    if let Some(origin) = origin {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.insert(header::VARY, HeaderValue::from_static("origin"));
        headers.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSED_HEADERS),
        );
    }
}

fn body(bytes: impl Into<Bytes>) -> tonic::body::Body {
    tonic::body::Body::new(http_body_util::Full::new(bytes.into()))
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    content: impl Into<Bytes>,
) -> Response<tonic::body::Body> {
    let mut response = Response::new(body(content));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

fn plain(status: StatusCode, text: &'static str) -> Response<tonic::body::Body> {
    respond(status, "text/plain; charset=utf-8", text)
}

fn preflight() -> Response<tonic::body::Body> {
    let mut response = respond(StatusCode::NO_CONTENT, "text/plain", Bytes::new());
    let headers = response.headers_mut();
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("POST"),
    );
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(ALLOWED_HEADERS),
    );
    headers.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    response
}

fn asset_response(asset: &assets::Asset) -> Response<tonic::body::Body> {
    let mut response = respond(StatusCode::OK, asset.content_type, asset.bytes.clone());
    // The page runs its own script and style only, talks to its own origin
    // only, and is never framed.
    response.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    response
}

/// A gRPC-Web answer with no message: the status in the headers
/// ("trailers-only"), as gRPC-Web clients read it.
fn grpc_refusal(code: u8, message: &'static str) -> Response<tonic::body::Body> {
    let mut response = respond(StatusCode::OK, "application/grpc-web+proto", Bytes::new());
    let headers = response.headers_mut();
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    // Plain ASCII without '%': valid as a percent-encoded grpc-message.
    headers.insert("grpc-message", HeaderValue::from_static(message));
    response
}

/// A session of the console's reader, for a request with the token.
fn session(state: &GateState, headers: &http::HeaderMap) -> Response<tonic::body::Body> {
    use base64::Engine as _;
    use prost::Message as _;
    if !state.token_ok(headers) {
        return respond(
            StatusCode::UNAUTHORIZED,
            "application/json",
            r#"{"error":"the console's access token is missing or wrong (header x-console-token)"}"#,
        );
    }
    let opened = state.sessions.open(state.reader, state.clock.now_ms());
    let sealed = opened.session.unwrap_or_default().encode_to_vec();
    let json = serde_json::json!({
        "session": base64::engine::general_purpose::STANDARD.encode(sealed),
        "expires_at_ms": opened.expires_at_ms,
        "reader_key": hex::encode(state.reader),
        "names": state.names_json,
    });
    respond(StatusCode::OK, "application/json", json.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> GateState {
        let key = ed25519_dalek::SigningKey::from_bytes(&[3; 32]);
        let current = key.verifying_key();
        let stamper = Arc::new(crate::stamp::Stamper::new(key));
        GateState::new(
            "secret",
            vec![
                "http://127.0.0.1:8080".into(),
                "https://extra.example".into(),
            ],
            [9; 32],
            Sessions::new(stamper, current, 60_000),
            Arc::new(crate::clock::SystemClock),
            &Default::default(),
            assets::load(None).expect("embedded"),
        )
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn only_reads_from_allowed_origins_pass() {
        let s = state();
        let grpc = [("content-type", "application/grpc-web+proto")];
        let post = |path: &str, h: &[(&'static str, &'static str)]| {
            route(&s, &Method::POST, path, &headers(h))
        };
        assert_eq!(
            post("/delegation.broker.v1.Broker/GetContract", &grpc),
            Route::Read
        );
        assert_eq!(
            post("/delegation.broker.v1.Broker/Watch", &grpc),
            Route::Read
        );
        for mutating in ["OpenRoot", "Delegate", "Revoke", "Complete", "OpenSession"] {
            let path = format!("{SERVICE_PREFIX}{mutating}");
            assert_eq!(post(&path, &grpc), Route::NotRead, "{mutating}");
        }
        assert_eq!(post("/grpc.health.v1.Health/Check", &grpc), Route::NotRead);
        // Native gRPC is the main listener's, reads included.
        let native = [("content-type", "application/grpc")];
        assert_eq!(
            post("/delegation.broker.v1.Broker/GetContract", &native),
            Route::NotRead
        );
        for odd in [
            "/delegation.broker.v1.Broker//GetContract",
            "/delegation.broker.v1.Broker/getcontract",
            "/delegation.broker.v1.Broker/GetContract/",
            "/delegation.broker.v1.Broker%2FGetContract",
            "//delegation.broker.v1.Broker/GetContract",
        ] {
            assert_eq!(post(odd, &grpc), Route::NotRead, "{odd}");
        }
        let get = route(
            &s,
            &Method::GET,
            "/delegation.broker.v1.Broker/GetContract",
            &headers(&grpc),
        );
        assert_eq!(get, Route::NotRead);
        assert_eq!(
            route(&s, &Method::OPTIONS, "/x", &headers(&[])),
            Route::NotFound
        );
        assert_eq!(
            post(SESSION_PATH, &[("origin", "null")]),
            Route::ForeignOrigin
        );
        // Origins compare case-insensitively, default ports dropped.
        let spelled = [("origin", "HTTPS://Extra.Example:443")];
        assert_eq!(post(SESSION_PATH, &spelled), Route::Session);
        assert_eq!(post("/elsewhere", &[]), Route::NotFound);
        assert_eq!(post(SESSION_PATH, &[]), Route::Session);
        let foreign = [("origin", "http://evil.example")];
        assert_eq!(post(SESSION_PATH, &foreign), Route::ForeignOrigin);
        assert_eq!(
            route(&s, &Method::GET, "/", &headers(&foreign)),
            Route::ForeignOrigin
        );
        let extra = [("origin", "https://extra.example")];
        assert_eq!(
            route(&s, &Method::OPTIONS, "/x", &headers(&extra)),
            Route::Preflight
        );
        assert!(matches!(
            route(
                &s,
                &Method::GET,
                "/",
                &headers(&[("origin", "http://127.0.0.1:8080")])
            ),
            Route::Asset(_)
        ));
        assert_eq!(
            route(&s, &Method::GET, "/secret", &headers(&[])),
            Route::NotFound
        );
    }

    #[test]
    fn a_session_needs_the_token() {
        let s = state();
        assert!(!s.token_ok(&headers(&[])));
        assert!(!s.token_ok(&headers(&[("x-console-token", "secreT")])));
        assert!(s.token_ok(&headers(&[("x-console-token", "secret")])));
        let refused = session(&s, &headers(&[]));
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        let granted = session(&s, &headers(&[("x-console-token", "secret")]));
        assert_eq!(granted.status(), StatusCode::OK);
    }
}
