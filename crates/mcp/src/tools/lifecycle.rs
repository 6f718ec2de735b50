//! The tools that sign: each request goes through `Link::call` (header
//! filled in, signed as the agent, sent again with the same bytes while
//! the broker is unavailable).

use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router};
use serde_json::Value;

use broker_client::{BrokerError, Receipted as _};
use broker_domain::limits;
use broker_wire::pb;

use super::answers::{receipt, refusal};
use super::inputs::{
    AcceptInput, CompleteInput, DEFAULT_MAX_CHILDREN, DEFAULT_MAX_DEPTH, DEFAULT_ROOT_TTL_MS,
    DelegateInput, OpenRootInput, ReasonInput, deadline, id, labels, liability, text, write_scope,
};
use super::{Answer, Tools, answer};

#[tool_router(router = lifecycle_tools, vis = "pub(super)")]
impl Tools {
    #[tool(
        description = "Open a root contract (a run): the intent, budget, deadline and policy every delegation below it is checked against. Returns the root's contract_id."
    )]
    async fn open_root(&self, Parameters(input): Parameters<OpenRootInput>) -> Answer {
        answer(self.open_root_inner(input).await)
    }

    #[tool(
        description = "Delegate part of a contract you hold to another agent. The broker checks every invariant (budget, depth, trust, deadline, scope, retry headroom, liability); a refusal is an error listing each violated invariant with the requested and allowed values: adjust and call again."
    )]
    async fn delegate(&self, Parameters(input): Parameters<DelegateInput>) -> Answer {
        match self.delegate_inner(input).await {
            Ok(Ok(value)) => answer(Ok(value)),
            Ok(Err(refused)) => Ok(refusal(refused)),
            Err(error) => answer(Err(error)),
        }
    }

    #[tool(
        description = "Accept a contract delegated to you, optionally naming the host whose observations count."
    )]
    async fn accept(&self, Parameters(input): Parameters<AcceptInput>) -> Answer {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let body = pb::AcceptBody {
                header: None,
                contract_id: contract_id.clone(),
                host_public_key: self.key_or_none(input.host.as_deref(), "host")?,
            };
            receipt(&contract_id, self.link.call(body, None).await?.receipt)
        };
        answer(run.await)
    }

    #[tool(
        description = "Complete a contract you accepted: your output (JSON), your claim and what you consumed. The broker judges it on what the host observed and answers with the verdict and any refused criteria."
    )]
    async fn complete(&self, Parameters(input): Parameters<CompleteInput>) -> Answer {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let output_json = input.output.to_string();
            if output_json.len() > limits::MAX_RESULT_BYTES {
                return Err(BrokerError::input(
                    "output",
                    format!(
                        "is {} bytes serialized, at most {}",
                        output_json.len(),
                        limits::MAX_RESULT_BYTES
                    ),
                ));
            }
            if input.consumed < 0 {
                return Err(BrokerError::input("consumed", "must be 0 or more"));
            }
            let body = pb::CompleteBody {
                header: None,
                contract_id: contract_id.clone(),
                output_json,
                report: None,
                claim: text(&input.claim, "claim")?,
                consumed: input.consumed,
            };
            receipt(&contract_id, self.link.call(body, None).await?.receipt)
        };
        answer(run.await)
    }

    #[tool(
        description = "Decline a contract delegated to you (before accepting it); its reservation returns to the principal."
    )]
    async fn decline(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        self.with_reason::<pb::DeclineBody>(&input).await
    }

    #[tool(
        description = "Escalate a contract you accepted as unresolvable: its reservation returns and the principal learns what is left."
    )]
    async fn escalate(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        self.with_reason::<pb::EscalateBody>(&input).await
    }

    #[tool(
        description = "Revoke a contract below one you hold (and every open contract below it)."
    )]
    async fn revoke(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        self.with_reason::<pb::RevokeBody>(&input).await
    }
}

impl Tools {
    /// A decline, an escalation or a revocation: the contract and the
    /// reason checked, the body signed and sent, its receipt answered.
    async fn with_reason<B>(&self, input: &ReasonInput) -> Answer
    where
        B: broker_client::Ending,
        <B::Request as broker_client::Sendable>::Response: broker_client::Receipted,
    {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let reason = text(&input.reason, "reason")?;
            let sent = self.link.call(B::ending(contract_id.clone(), reason), None);
            receipt(&contract_id, sent.await?.receipt())
        };
        answer(run.await)
    }
}

impl Tools {
    async fn open_root_inner(&self, input: OpenRootInput) -> Result<Value, BrokerError> {
        let ttl_ms = input.ttl_ms.unwrap_or(DEFAULT_ROOT_TTL_MS);
        let deadline_ms = deadline(Some(ttl_ms), "ttl_ms")?;
        let write_scope = write_scope(input.write_scope)?;
        let labels = labels(input.labels)?;
        let body = pb::OpenRootBody {
            header: None,
            intent: text(&input.intent, "intent")?,
            task: String::new(),
            budget: input.budget,
            deadline_ms,
            policy: Some(pb::Policy {
                max_depth: input.max_depth.unwrap_or(DEFAULT_MAX_DEPTH),
                min_cumulative_trust_ppm: input.min_cumulative_trust_ppm.unwrap_or(0),
                max_children: input.max_children.unwrap_or(DEFAULT_MAX_CHILDREN),
                disable_retry_headroom: !input.retry_headroom.unwrap_or(true),
                require_host: false,
            }),
            predicate: text(input.predicate.as_deref().unwrap_or(""), "predicate")?,
            write_scope,
            labels: labels.into_iter().collect(),
        };
        match self.link.call(body, None).await?.issued {
            Some(issued) => Ok(self.issued(&issued)),
            None => Err(BrokerError::new(
                "INTERNAL",
                "OpenRoot answered without a contract",
            )),
        }
    }

    /// Issued, or refused (a receipt), or an error.
    async fn delegate_inner(
        &self,
        input: DelegateInput,
    ) -> Result<Result<Value, pb::Refusal>, BrokerError> {
        let parent_id = id(&input.parent_id, "parent_id")?;
        let delegate = self.key(&input.delegate, "delegate")?;
        let host = self.key_or_none(input.host.as_deref(), "host")?;
        let liability = liability(input.liability.as_deref())?;
        let deadline_ms = deadline(input.ttl_ms, "ttl_ms")?;
        let task = text(&input.task, "task")?;
        let predicate = text(input.predicate.as_deref().unwrap_or(""), "predicate")?;
        let escalation_channel = text(
            input.escalation_channel.as_deref().unwrap_or(""),
            "escalation_channel",
        )?;
        let write_scope = write_scope(input.write_scope)?;
        // The lineage hash is the parent's (every contract of a tree has the
        // root's); a read, so a stranger's parent is NOT_FOUND here.
        let parent_contract = self.link.terms_of(&parent_id).await?;
        let body = pb::DelegateBody {
            header: None,
            parent_id,
            intent_lineage_hash: parent_contract.intent_lineage_hash,
            task,
            delegate_public_key: delegate.to_vec(),
            delegate_attestation: None,
            budget: input.budget,
            deadline_ms,
            liability: liability as i32,
            predicate,
            escalation_channel,
            min_retry_cost: input.min_retry_cost.unwrap_or(0),
            min_retry_latency_ms: input.min_retry_latency_ms.unwrap_or(0),
            write_scope,
            host_public_key: host,
            result_schema_json: String::new(),
        };
        match self.link.call(body, None).await?.outcome {
            Some(pb::delegate_response::Outcome::Issued(issued)) => Ok(Ok(self.issued(&issued))),
            Some(pb::delegate_response::Outcome::Refused(refused)) => Ok(Err(refused)),
            None => Err(BrokerError::new(
                "INTERNAL",
                "Delegate answered neither issued nor refused",
            )),
        }
    }
}
