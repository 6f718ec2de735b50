//! The tools that read: who the agent is and what it holds, a contract,
//! its subtree as text, and its chain verified here.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{tool, tool_router};
use serde_json::{Value, json};

use broker_client::BrokerError;
use broker_client::names::cut;
use broker_wire::pb;

use super::answers::held;
use super::inputs::{ContractInput, Empty, id};
use super::{Answer, Tools, answer};

/// Most contracts the `tree` tool reads, and most bytes of its text: a
/// model's context is small.
const MAX_TREE_CONTRACTS: u32 = 200;
const MAX_TREE_TEXT_BYTES: usize = 64 * 1024;
/// Most held contracts `whoami` lists (the newest).
const MAX_HELD_LISTED: u32 = 50;

#[tool_router(router = reading_tools, vis = "pub(super)")]
impl Tools {
    /// Who this server signs as.
    #[tool(
        description = "Your agent identity (public key, key id, address-book name) and the open contracts you hold as delegate, newest first: each with its status, ledger, deadline and task."
    )]
    async fn whoami(&self, Parameters(_): Parameters<Empty>) -> Answer {
        let run = async {
            let key = self.link.agent.public_key();
            let page = self
                .link
                .held(pb::HeldRole::Delegate, MAX_HELD_LISTED)
                .await?;
            let held: Vec<Value> = page.contracts.iter().map(held).collect();
            Ok(json!({
                "public_key": hex::encode(key),
                "key_id": broker_wire::crypto::key_id(&key),
                "name": self.names.get(&key),
                "held": held,
                // The newest are listed; `tree` on a root shows the rest.
                "more_held": !page.next_page_token.is_empty(),
            }))
        };
        answer(run.await)
    }

    #[tool(
        description = "A contract's terms and state: status, ledger (budget = residual + reserved + spent), deadline, effective predicate, write scope, task."
    )]
    async fn get_contract(&self, Parameters(input): Parameters<ContractInput>) -> Answer {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            self.contract_json(&contract_id).await
        };
        answer(run.await)
    }

    #[tool(
        description = "The subtree under a contract as indented text: each contract's delegate, status, ledger, refusals and verdicts."
    )]
    async fn tree(&self, Parameters(input): Parameters<ContractInput>) -> Answer {
        Ok(match self.tree_text(&input).await {
            Ok(text) => CallToolResult::success(vec![rmcp::model::ContentBlock::text(text)]),
            Err(error) => crate::tool_result(error),
        })
    }

    #[tool(
        description = "Verify a contract's chain here, offline, against the broker's published keys (signature, hash links, every hop's terms)."
    )]
    async fn verify_chain(&self, Parameters(input): Parameters<ContractInput>) -> Answer {
        answer(self.verify_chain_inner(&input).await)
    }
}

impl Tools {
    /// A contract as `get_contract` and the `contract://` resource show it.
    pub(super) async fn contract_json(&self, contract_id: &[u8]) -> Result<Value, BrokerError> {
        let state = self.contract(contract_id).await?;
        Ok(self.state_json(contract_id, &state))
    }

    /// The subtree as text, cut to what a model's context takes.
    async fn tree_text(&self, input: &ContractInput) -> Result<String, BrokerError> {
        let contract_id = id(&input.contract_id, "contract_id")?;
        let data =
            broker_client::tree::fetch_linked(&self.link, &contract_id, MAX_TREE_CONTRACTS).await?;
        let mut text = broker_client::tree::render(&data, &self.names);
        // A model's context is small: cut long drawings, and say so.
        if text.len() > MAX_TREE_TEXT_BYTES {
            text = cut(&text, MAX_TREE_TEXT_BYTES);
            text.push_str("\n… cut: call tree on a contract further down to see the rest\n");
        }
        Ok(text)
    }

    async fn verify_chain_inner(&self, input: &ContractInput) -> Result<Value, BrokerError> {
        let contract_id = id(&input.contract_id, "contract_id")?;
        let keys =
            self.link
                .read(|mut client| async move {
                    client.get_broker_keys(pb::GetBrokerKeysRequest {}).await
                })
                .await?
                .into_inner()
                .keys;
        let chain = self
            .link
            .read(|mut client| {
                let contract_id = contract_id.clone();
                async move { client.get_chain(pb::GetChainRequest { contract_id }).await }
            })
            .await?
            .into_inner()
            .chain;
        let sealed: Vec<pb::Sealed> = chain.into_iter().filter_map(|s| s.contract).collect();
        let leaf: [u8; 32] = contract_id
            .as_slice()
            .try_into()
            .map_err(|_| BrokerError::input("contract_id", "must be 32 bytes"))?;
        let verified = broker_wire::chain::BrokerKeys::from_published(&keys);
        let hops = broker_wire::chain::verify_chain(&sealed, &verified, Some(&leaf))
            .map_err(|e| BrokerError::new("CHAIN_INVALID", e.to_string()))?;
        Ok(json!({
            "verified": true,
            "verified_locally": "the signature, hash links and terms were checked in this process against GetBrokerKeys",
            "contracts": hops.len(),
            "key_ids": keys.iter().map(|k| k.key_id.clone()).collect::<Vec<_>>(),
            "effective_predicate": hops.last().map(|h| h.effective_predicate.clone()),
        }))
    }
}
