//! A broker-minted token on the egress's calls to a peer (`token_header`
//! and `token_resource` in `[routes.<peer>]`, `tokens_url` at the top):
//! the fronted agent mints, from the broker's token endpoint, a JWT for
//! the contract the call is made under — the one it delegated the peer's
//! task from — so whatever stands in front of the peer (its gateway's
//! proxy, an API gateway) checks who calls, and under which delegation,
//! with any JWT library. Tokens are kept per contract until shortly
//! before they end (`broker_client::token::Minter`).

use std::collections::HashMap;

use broker_client::token::{Minter, TokenError, header_value};
use broker_domain::Id;
use http::{HeaderName, HeaderValue};

use crate::config::A2aConfig;
use crate::ext::{Refused, code};

/// One peer's token settings and minted tokens.
pub(crate) struct PeerToken {
    header: HeaderName,
    minter: Minter,
}

/// The token settings of every route that has them, by peer name.
pub(crate) fn peer_tokens(config: &A2aConfig) -> anyhow::Result<HashMap<String, PeerToken>> {
    let mut tokens = HashMap::new();
    for (peer, route) in &config.routes {
        let (Some(header), Some(resource), Some(url)) = (
            &route.token_header,
            &route.token_resource,
            &config.tokens_url,
        ) else {
            continue;
        };
        let header = HeaderName::try_from(header.as_str())
            .map_err(|e| anyhow::anyhow!("routes.{peer}.token_header {header:?}: {e}"))?;
        let minter =
            Minter::new(url, resource).map_err(|e| anyhow::anyhow!("tokens_url {url:?}: {e}"))?;
        tokens.insert(peer.clone(), PeerToken { header, minter });
    }
    Ok(tokens)
}

impl PeerToken {
    /// The header a call to the peer made under `contract` carries, signed
    /// for by `agent` (its holder).
    pub(crate) async fn header(
        &self,
        agent: &broker_client::Agent,
        contract: &Id,
    ) -> Result<(HeaderName, HeaderValue), Refused> {
        let refused = |e: TokenError| {
            // Unreachable, busy or garbled is worth a retry; a refusal
            // (RFC 6749's 400 or 401) is not.
            let reason = match e {
                TokenError::Refused { status, .. } if status < 500 => "TOKEN_REFUSED",
                _ => "UNAVAILABLE",
            };
            Refused::new(
                code::INTERNAL,
                reason,
                format!(
                    "no token for {} from the broker's token endpoint: {e}",
                    self.minter.resource()
                ),
            )
        };
        let token = self.minter.token(agent, contract).await.map_err(refused)?;
        let value = header_value(&self.header, &token).map_err(refused)?;
        Ok((self.header.clone(), value))
    }
}
