//! A broker-minted token on the calls to a streamable-HTTP tool server
//! (`token_header` and `token_resource` on its `[[servers]]` entry): the
//! gateway, the host of the call's contract, mints a JWT for it from the
//! broker's token endpoint (`tokens_url`) — its `sub` the delegate, its
//! `act` the gateway acting for it — and sends it with the call, so the
//! tool server checks the same delegation with any JWT library. The
//! transport is shared by every session of the gateway, so calls to such a
//! server go one at a time, each with its own contract's token; `initialize`
//! and `tools/list` come before any contract and carry none.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use http::{HeaderName, HeaderValue};
use rmcp::model::ClientJsonRpcMessage;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};
use sse_stream::Sse;

use broker_client::BrokerError;
use broker_client::token::{Minter, TokenError, header_value};

/// What one tool server's calls carry, and the tokens minted for it.
pub struct Bearer {
    header: HeaderName,
    minter: Minter,
    http: reqwest::Client,
    /// The value the next request carries (read by the transport).
    current: Arc<RwLock<Option<HeaderValue>>>,
    /// One call at a time, so each carries its own contract's token.
    turn: tokio::sync::Mutex<()>,
}

impl Bearer {
    pub fn new(
        header: &str,
        resource: &str,
        tokens_url: &str,
        keep_alive: bool,
    ) -> anyhow::Result<Self> {
        let name = HeaderName::try_from(header)
            .map_err(|e| anyhow::anyhow!("token_header {header:?}: {e}"))?;
        Ok(Self {
            header: name,
            minter: Minter::new(tokens_url, resource)
                .map_err(|e| anyhow::anyhow!("tokens_url: {e}"))?,
            http: super::upstream::http_client(keep_alive, true)?,
            current: Arc::default(),
            turn: tokio::sync::Mutex::new(()),
        })
    }

    /// The HTTP client the server's transport uses: reqwest, with this
    /// server's current token added to every request.
    pub fn client(&self) -> TokenClient {
        TokenClient {
            inner: self.http.clone(),
            header: self.header.clone(),
            current: self.current.clone(),
        }
    }

    /// Takes this server's turn with `contract`'s token in place; the
    /// turn, and the token with it, ends when the guard drops.
    pub async fn turn(
        &self,
        agent: &broker_client::Agent,
        contract: &[u8; 32],
    ) -> Result<Turn<'_>, BrokerError> {
        let refused = |e: TokenError| {
            BrokerError::new(
                "TOKEN_REFUSED",
                format!(
                    "no token for {} from the broker: {e}",
                    self.minter.resource()
                ),
            )
        };
        let token = self.minter.token(agent, contract).await.map_err(refused)?;
        let value = header_value(&self.header, &token).map_err(refused)?;
        let turn = self.turn.lock().await;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(value);
        Ok(Turn {
            _turn: turn,
            current: &self.current,
        })
    }
}

/// A call's turn at a server: while it is held, the server's requests
/// carry the call's token; after, none (a later list or the session's
/// end is not that contract's).
pub struct Turn<'a> {
    _turn: tokio::sync::MutexGuard<'a, ()>,
    current: &'a RwLock<Option<HeaderValue>>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// reqwest with a token header: rmcp's client over reqwest, each request
/// given the server's current token, if any.
#[derive(Clone)]
pub struct TokenClient {
    inner: reqwest::Client,
    header: HeaderName,
    current: Arc<RwLock<Option<HeaderValue>>>,
}

impl TokenClient {
    fn with_token(
        &self,
        mut headers: HashMap<HeaderName, HeaderValue>,
    ) -> HashMap<HeaderName, HeaderValue> {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(value) = current {
            headers.insert(self.header.clone(), value);
        }
        headers
    }
}

type Posted = Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>>;
/// `futures::stream::BoxStream<'static, _>`, spelled out.
type SseStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<Sse, SseError>> + Send>>;
type Streamed = Result<SseStream, StreamableHttpError<reqwest::Error>>;

/// The trait's methods, each reqwest's own with the token added to the
/// headers (the parameters before and after `custom_headers` named).
macro_rules! with_token {
    ($($method:ident($($before:ident: $bt:ty),*; $($after:ident: $at:ty),*) -> $out:ty;)*) => {$(
        async fn $method(
            &self,
            $($before: $bt,)*
            custom_headers: HashMap<HeaderName, HeaderValue>,
            $($after: $at),*
        ) -> $out {
            let custom_headers = self.with_token(custom_headers);
            self.inner.$method($($before,)* custom_headers, $($after),*).await
        }
    )*};
}

impl StreamableHttpClient for TokenClient {
    type Error = reqwest::Error;

    with_token! {
        post_message(uri: Arc<str>, message: ClientJsonRpcMessage, session_id: Option<Arc<str>>, auth_header: Option<String>;) -> Posted;
        post_message_with_max_sse_event_size(uri: Arc<str>, message: ClientJsonRpcMessage, session_id: Option<Arc<str>>, auth_header: Option<String>; max_sse_event_size: usize) -> Posted;
        post_message_with_response_limits(uri: Arc<str>, message: ClientJsonRpcMessage, session_id: Option<Arc<str>>, auth_header: Option<String>; limits: StreamableHttpResponseLimits) -> Posted;
        delete_session(uri: Arc<str>, session_id: Arc<str>, auth_header: Option<String>;) -> Result<(), StreamableHttpError<reqwest::Error>>;
        get_stream(uri: Arc<str>, session_id: Option<Arc<str>>, last_event_id: Option<String>, auth_header: Option<String>;) -> Streamed;
        get_stream_with_max_sse_event_size(uri: Arc<str>, session_id: Option<Arc<str>>, last_event_id: Option<String>, auth_header: Option<String>; max_sse_event_size: usize) -> Streamed;
    }
}
