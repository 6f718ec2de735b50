//! `contract://{id}` resources of `mcp tools`: a contract as JSON (what
//! `get_contract` returns), and subscriptions to it fed by the broker's
//! Watch of its subtree — a client told "updated" reads it again. Both the
//! 2025-11-25 `resources/subscribe` and the 2026-07-28
//! `subscriptions/listen` end up in `follow`.

use std::future::Future;
use std::time::Duration;

use rmcp::ErrorData;
use rmcp::model::ResourceTemplate;
use tokio_stream::StreamExt as _;

use broker_client::Link;
use broker_wire::pb;

/// The scheme of contract resources.
pub const SCHEME: &str = "contract://";
/// Most contracts one server follows at once (subscriptions).
pub const MAX_SUBSCRIPTIONS: usize = 16;
/// Most bytes of a URI that is not a contract's quoted back in the error:
/// enough to recognise it, while a huge one does not make a huge error.
const MAX_QUOTED_URI_BYTES: usize = 200;
/// Events closer together than this make one notification: a client reads
/// the contract once for a burst.
const COALESCE: Duration = Duration::from_millis(100);
/// Pause before watching again after the stream broke; doubled up to
/// `MAX_BACKOFF`.
const BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

pub fn templates() -> Vec<ResourceTemplate> {
    vec![
        ResourceTemplate::new(format!("{SCHEME}{{contract_id}}"), "contract")
            .with_title("A delegation contract")
            .with_description(
                "A contract's terms and state as JSON (status, ledger, deadline, effective predicate, write scope, task); subscribe to hear when it or a contract below it changes.",
            )
            .with_mime_type("application/json"),
    ]
}

/// The contract id a `contract://` URI names.
pub fn parse(uri: &str) -> Result<Vec<u8>, ErrorData> {
    uri.strip_prefix(SCHEME)
        .and_then(|hex_id| hex::decode(hex_id).ok())
        .filter(|id| id.len() == 32)
        .ok_or_else(|| {
            ErrorData::invalid_params(
                format!(
                    "{:?} is not a contract resource: {SCHEME}<64 hex contract id>",
                    broker_client::names::cut(uri, MAX_QUOTED_URI_BYTES)
                ),
                None,
            )
        })
}

/// Watches the contract's subtree and calls `updated` after each burst of
/// events, until `updated` fails (the client is gone) or the task is
/// aborted. A broken stream is watched again from the last cursor.
pub async fn follow<F, Fut>(link: Link, contract_id: Vec<u8>, updated: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let mut cursor = 0u64;
    let mut backoff = BACKOFF;
    loop {
        let request = pb::WatchRequest {
            contract_id: contract_id.clone(),
            cursor,
        };
        let stream = match link.reader().await {
            Ok(mut client) => client.watch(request).await.map(tonic::Response::into_inner),
            Err(error) => {
                tracing::debug!(reason = %error.reason, "no read session to follow a contract");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        match stream {
            Ok(mut events) => {
                backoff = BACKOFF;
                while let Some(event) = events.next().await {
                    let Ok(event) = event else { break };
                    cursor = cursor.max(event.cursor);
                    // The rest of the burst joins this notification.
                    while let Ok(Some(Ok(more))) =
                        tokio::time::timeout(COALESCE, events.next()).await
                    {
                        cursor = cursor.max(more.cursor);
                    }
                    if !updated().await {
                        return;
                    }
                }
            }
            Err(status)
                if status.code() == tonic::Code::NotFound
                    || status.code() == tonic::Code::PermissionDenied =>
            {
                tracing::info!(code = ?status.code(), "a followed contract cannot be watched: subscription ended");
                return;
            }
            Err(status) => tracing::debug!(
                message = status.message(),
                "watching a followed contract failed"
            ),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_contract_uris_parse() {
        let id = "ab".repeat(32);
        assert_eq!(
            parse(&format!("contract://{id}")).expect("valid"),
            vec![0xab; 32]
        );
        for bad in [
            "contract://ab",
            "file:///etc/passwd",
            "contract://",
            &format!("contract://{id}00"),
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
