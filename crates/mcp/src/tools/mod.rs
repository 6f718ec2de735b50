//! The tools: each parses what the model sent (a clear tool error for
//! anything wrong, nothing sent), signs one request as the agent, and turns
//! the broker's answer into structured content. Refusals and errors are
//! tool results with `isError`, which the model reads; only a tool name
//! that does not exist is a protocol error (rmcp's router answers it).
//!
//! `server`: the MCP server (arguments checked before a tool runs,
//! resources, subscriptions); `lifecycle`: the tools that sign
//! (`Link::call`); `reading`: the tools that read; `inputs`: what the model
//! sends and how it is checked; `answers`: the broker's answers as the
//! model reads them.

mod answers;
mod inputs;
mod lifecycle;
mod reading;
mod server;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::CallToolResult;
use serde_json::Value;

use broker_client::{Agent, BrokerError, Link};
use broker_wire::pb;

use self::inputs::ArgumentCheck;

/// The MCP server: one agent's key, one broker.
#[derive(Clone)]
pub struct Tools {
    link: Link,
    /// The `contract://` resources followed for `resources/subscribe`, by
    /// URI (at most `resources::MAX_SUBSCRIPTIONS`).
    subscriptions: Arc<std::sync::Mutex<HashMap<String, tokio::task::AbortHandle>>>,
    names: Arc<BTreeMap<[u8; 32], String>>,
    by_name: Arc<HashMap<String, [u8; 32]>>,
    arguments: Arc<ArgumentCheck>,
    tool_router: ToolRouter<Self>,
}

type Answer = Result<CallToolResult, rmcp::ErrorData>;

fn answer(result: Result<Value, BrokerError>) -> Answer {
    Ok(match result {
        Ok(value) => CallToolResult::structured(value),
        Err(error) => crate::tool_result(error),
    })
}

impl Tools {
    pub fn new(
        agent: Agent,
        channel: tonic::transport::Channel,
        names: BTreeMap<[u8; 32], String>,
    ) -> anyhow::Result<Self> {
        // A name must mean one key, and never look like a key itself.
        let mut by_name = HashMap::new();
        for (key, name) in &names {
            if hex::decode(name).is_ok_and(|b| b.len() == 32) {
                anyhow::bail!("--names: the name {name:?} is itself a 64-hex key");
            }
            if by_name.insert(name.clone(), *key).is_some() {
                anyhow::bail!("--names: the name {name:?} is given to two keys");
            }
        }
        let tool_router = Self::tool_router();
        let arguments = Arc::new(ArgumentCheck::new(&tool_router.list_all())?);
        Ok(Self {
            link: Link::new(agent, channel),
            subscriptions: Arc::default(),
            names: Arc::new(names),
            by_name: Arc::new(by_name),
            arguments,
            tool_router,
        })
    }

    /// Every tool: those that sign and those that read.
    fn tool_router() -> ToolRouter<Self> {
        Self::lifecycle_tools() + Self::reading_tools()
    }

    /// A name or a hex key, as a key.
    fn key(&self, who: &str, field: &str) -> Result<[u8; 32], BrokerError> {
        if let Some(key) = self.by_name.get(who) {
            return Ok(*key);
        }
        hex::decode(who.trim())
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                BrokerError::input(
                    field,
                    format!(
                        "{who:?} is neither a name in the address book nor a 64-hex public key"
                    ),
                )
            })
    }

    /// An optional name or hex key, as key bytes (empty when not given).
    fn key_or_none(&self, who: Option<&str>, field: &str) -> Result<Vec<u8>, BrokerError> {
        Ok(who
            .map(|h| self.key(h, field).map(|k| k.to_vec()))
            .transpose()?
            .unwrap_or_default())
    }

    /// A key as its name in the address book, else in hex.
    fn who(&self, key: &[u8]) -> String {
        <[u8; 32]>::try_from(key)
            .ok()
            .and_then(|k| self.names.get(&k).cloned())
            .unwrap_or_else(|| hex::encode(key))
    }

    /// A contract's state now (GetContract, a read).
    async fn contract(&self, contract_id: &[u8]) -> Result<pb::ContractState, BrokerError> {
        self.link.contract(contract_id).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn grpc_codes_read_as_their_canonical_names() {
        assert_eq!(
            broker_client::names::code_name_of(tonic::Code::NotFound),
            "NOT_FOUND"
        );
        assert_eq!(
            broker_client::names::code_name_of(tonic::Code::Unavailable),
            "UNAVAILABLE"
        );
        assert_eq!(
            broker_client::names::code_name_of(tonic::Code::FailedPrecondition),
            "FAILED_PRECONDITION"
        );
    }
}
