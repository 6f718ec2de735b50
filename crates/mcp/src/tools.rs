//! The tools: each parses what the model sent (a clear tool error for
//! anything wrong, nothing sent), signs one request as the agent, and turns
//! the broker's answer into structured content. Refusals and errors are
//! tool results with `isError`, which the model reads; only a tool name
//! that does not exist is a protocol error (rmcp's router answers it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use prost::Message as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ServerCapabilities, ServerConfig};
use rmcp::schemars::JsonSchema;
use rmcp::{ServerHandler, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};

use broker_client::names::{code_name, cut, status_name};
use broker_client::{Agent, SessionClient};
use broker_client::{BrokerError, Link, Sendable};
use broker_wire::crypto::payload_type;
use broker_wire::pb;

/// Longest text field a tool takes (tasks, reasons, claims, intents); the
/// broker has its own, smaller limits for each and names them.
const MAX_TEXT_BYTES: usize = 64 * 1024;
/// Largest `output` a completion carries, serialized.
const MAX_OUTPUT_BYTES: usize = 256 * 1024;
/// Most contracts the `tree` tool reads, and most bytes of its text: a
/// model's context is small.
const MAX_TREE_CONTRACTS: u32 = 200;
const MAX_TREE_TEXT_BYTES: usize = 64 * 1024;
/// Most write-scope prefixes and labels a tool takes (the broker has its
/// own limits; these bound what is built before asking it).
const MAX_LIST_ITEMS: usize = 64;
/// Most held contracts `whoami` lists (the newest).
const MAX_HELD_LISTED: u32 = 50;
/// Most bytes of each held contract's task `whoami` shows (get_contract
/// has all of it).
const MAX_HELD_TASK_BYTES: usize = 512;

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

// ---- Inputs ----

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct OpenRootInput {
    /// The run's intent, verbatim: every contract of the tree commits to it.
    pub intent: String,
    /// Budget units the root carries.
    pub budget: i64,
    /// Time to live, in milliseconds from now (default one hour).
    pub ttl_ms: Option<i64>,
    /// Most hops below the root (default 4).
    pub max_depth: Option<u32>,
    /// Most children of one contract (default 64).
    pub max_children: Option<u32>,
    /// Lowest cumulative trust, in parts per million (default 0).
    pub min_cumulative_trust_ppm: Option<u32>,
    /// Refuse children that would leave their parent unable to retry once
    /// (default true).
    pub retry_headroom: Option<bool>,
    /// Path prefixes the run may write (default: none).
    pub write_scope: Option<Vec<String>>,
    /// CEL acceptance predicate over `result` (default: none).
    pub predicate: Option<String>,
    /// Labels of the run, e.g. {"arm": "flat"}.
    pub labels: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct DelegateInput {
    /// The contract to delegate from (64 hex characters); you must hold it.
    pub parent_id: String,
    /// Who receives it: a name from the address book or a 64-hex public key.
    pub delegate: String,
    /// The child's own task text.
    pub task: String,
    /// Budget units to reserve from the parent's residual.
    pub budget: i64,
    /// Time to live in milliseconds from now (default: the parent's deadline).
    pub ttl_ms: Option<i64>,
    /// Path prefixes the child may write, each under one of the parent's
    /// (default: none, nothing writable).
    pub write_scope: Option<Vec<String>>,
    /// CEL predicate the child's completion must also satisfy.
    pub predicate: Option<String>,
    /// "principal" (you keep liability, default) or "delegate".
    pub liability: Option<String>,
    /// What one retry of this work costs, in units.
    pub min_retry_cost: Option<i64>,
    /// How long one retry takes, in milliseconds.
    pub min_retry_latency_ms: Option<i64>,
    /// Where the delegate escalates (required with liability "delegate"
    /// and no predicate).
    pub escalation_channel: Option<String>,
    /// The host whose observations count: a name or a hex key.
    pub host: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ContractInput {
    /// The contract (64 hex characters).
    pub contract_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct AcceptInput {
    /// The contract you hold as its delegate (64 hex characters).
    pub contract_id: String,
    /// Your host, if Delegate did not name one: a name or a hex key.
    pub host: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ReasonInput {
    /// The contract (64 hex characters).
    pub contract_id: String,
    /// Why, in a sentence: it goes into the signed receipt.
    pub reason: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct CompleteInput {
    /// The contract you hold as its delegate (64 hex characters).
    pub contract_id: String,
    /// Your output, any JSON value (judged against the contract's schema).
    pub output: Value,
    /// What you claim you did.
    pub claim: String,
    /// Budget units you consumed (host metering, when there is any, wins).
    pub consumed: i64,
}

// ---- Parsing ----

fn id(text: &str, field: &str) -> Result<Vec<u8>, BrokerError> {
    hex::decode(text.trim())
        .ok()
        .filter(|b| b.len() == 32)
        .ok_or_else(|| BrokerError::input(field, "must be 64 hex characters (a 32-byte id)"))
}

fn text(value: &str, field: &str) -> Result<String, BrokerError> {
    if value.len() > MAX_TEXT_BYTES {
        return Err(BrokerError::input(
            field,
            format!("is {} bytes, at most {MAX_TEXT_BYTES}", value.len()),
        ));
    }
    Ok(value.to_owned())
}

fn deadline(ttl_ms: Option<i64>, field: &str) -> Result<i64, BrokerError> {
    match ttl_ms {
        None => Ok(0),
        Some(ttl) if ttl > 0 && ttl <= broker_domain::limits::MAX_HORIZON_MS => {
            Ok(broker_wire::clock::SystemClock.now_ms().saturating_add(ttl))
        }
        Some(ttl) => Err(BrokerError::input(
            field,
            format!(
                "{ttl} ms: must be 1 ..= {} ms",
                broker_domain::limits::MAX_HORIZON_MS
            ),
        )),
    }
}

fn ledger(ledger: Option<&pb::Ledger>) -> Value {
    ledger.map_or(Value::Null, |l| {
        json!({
            "budget": l.budget, "reserved": l.reserved, "spent": l.spent,
            "residual": l.residual, "open_children": l.open_children,
        })
    })
}

use broker_wire::clock::Clock as _;

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

    fn who(&self, key: &[u8]) -> String {
        <[u8; 32]>::try_from(key)
            .ok()
            .and_then(|k| self.names.get(&k).cloned())
            .unwrap_or_else(|| hex::encode(key))
    }

    async fn contract(&self, contract_id: &[u8]) -> Result<pb::ContractState, BrokerError> {
        let request = pb::GetContractRequest {
            contract_id: contract_id.to_vec(),
        };
        self.link
            .read(|mut client| {
                let request = request.clone();
                async move { client.get_contract(request).await }
            })
            .await?
            .into_inner()
            .contract
            .ok_or_else(|| BrokerError {
                details: Default::default(),
                reason: "INTERNAL".into(),
                field: None,
                message: "the broker answered without the contract".into(),
            })
    }

    /// A lifecycle receipt as the model reads it.
    fn receipt(contract_id: &[u8], sealed: Option<pb::Sealed>) -> Result<Value, BrokerError> {
        let sealed = sealed.ok_or_else(|| BrokerError {
            details: Default::default(),
            reason: "INTERNAL".into(),
            field: None,
            message: "the broker answered without a receipt".into(),
        })?;
        let receipt_id = broker_wire::crypto::sha256(&sealed.payload);
        let receipt = pb::Receipt::decode(sealed.payload.as_slice()).map_err(|e| BrokerError {
            details: Default::default(),
            reason: "INTERNAL".into(),
            field: None,
            message: format!("undecodable receipt: {e}"),
        })?;
        let kind = pb::ReceiptKind::try_from(receipt.kind).unwrap_or(pb::ReceiptKind::Unspecified);
        // The contract's status after it, as get_contract shows it.
        let status = match kind {
            pb::ReceiptKind::Escalated => "UNRESOLVABLE".to_owned(),
            other => other
                .as_str_name()
                .trim_start_matches("RECEIPT_KIND_")
                .to_owned(),
        };
        let mut out = json!({
            "contract_id": hex::encode(contract_id),
            "status": status,
            "receipt_kind": kind.as_str_name().trim_start_matches("RECEIPT_KIND_"),
            "receipt_id": hex::encode(receipt_id),
        });
        if let Some(c) = &receipt.completion {
            let verdict = pb::Verdict::try_from(c.verdict)
                .map(|v| v.as_str_name().trim_start_matches("VERDICT_").to_owned())
                .unwrap_or_default();
            out["verdict"] = json!(verdict);
            out["refused_criteria"] = json!(
                c.refused_criteria
                    .iter()
                    .map(|r| r.criterion.clone())
                    .collect::<Vec<_>>()
            );
            out["consumed"] = json!(c.consumed);
            out["returned"] = json!(c.returned);
            out["claimed_excess"] = json!(c.claimed_excess);
            out["within_scope"] = json!(c.within_scope);
            out["schema_valid"] = json!(c.schema_valid);
            out["out_of_scope_paths"] = json!(c.out_of_scope_paths);
        }
        if let Some(e) = &receipt.escalation {
            out["escalation"] = json!({
                "principal_residual": e.principal_residual,
                "retry_feasible": e.retry_feasible,
            });
        }
        Ok(out)
    }

    /// A refusal receipt as a tool error the model can act on.
    fn refusal(refused: pb::Refusal) -> CallToolResult {
        let Some(sealed) = refused.receipt else {
            return crate::tool_result(BrokerError::new(
                "INTERNAL",
                "a refusal without its receipt",
            ));
        };
        let receipt = pb::Receipt::decode(sealed.payload.as_slice()).unwrap_or_default();
        let violations: Vec<Value> = receipt
            .violations
            .iter()
            .map(|v| {
                json!({
                    "code": code_name(v.code),
                    "requested": v.requested,
                    "allowed": v.allowed,
                    "detail": v.detail,
                })
            })
            .collect();
        let listed = broker_client::names::listed_violations(&receipt);
        let hint = "The broker refused this delegation and reserved nothing. Change the named terms to within what is allowed (or ask for less) and call delegate again.";
        let value = json!({
            "refused": true,
            "receipt_id": hex::encode(broker_wire::crypto::sha256(&sealed.payload)),
            "primary": code_name(receipt.primary),
            "violations": violations,
            "hint": hint,
        });
        let mut result = CallToolResult::structured_error(value);
        result.content = vec![rmcp::model::ContentBlock::text(format!(
            "Refused: {}. {hint}",
            listed.join("; ")
        ))];
        result
    }

    /// A lifecycle call whose body is a contract and a reason.
    async fn with_reason<B: Lifecycle>(
        &self,
        input: ReasonInput,
        body: impl FnOnce(Option<pb::RequestHeader>, Vec<u8>, String) -> B,
    ) -> Result<Value, BrokerError> {
        let contract_id = id(&input.contract_id, "contract_id")?;
        let reason = text(&input.reason, "reason")?;
        let body = body(Some(self.link.agent.header()), contract_id.clone(), reason);
        self.lifecycle(&contract_id, body).await
    }

    async fn lifecycle<B: Lifecycle>(
        &self,
        contract_id: &[u8],
        body: B,
    ) -> Result<Value, BrokerError> {
        let request = B::request(self.link.signed(B::PAYLOAD_TYPE, &body));
        let receipt = self.link.send(request, B::call).await.map(B::receipt)?;
        Self::receipt(contract_id, receipt)
    }
}

/// A lifecycle body: its request, its call and its receipt.
trait Lifecycle: prost::Message + Sized {
    const PAYLOAD_TYPE: &'static str;
    type Request: Sendable;
    fn request(signed: Option<pb::Envelope>) -> Self::Request;
    fn call(
        client: SessionClient,
        request: Self::Request,
    ) -> impl std::future::Future<
        Output = Result<tonic::Response<<Self::Request as Sendable>::Response>, tonic::Status>,
    >;
    fn receipt(response: <Self::Request as Sendable>::Response) -> Option<pb::Sealed>;
}

macro_rules! lifecycle {
    ($($body:ident => $request:ident, $method:ident, $payload:ident;)*) => {$(
        impl Lifecycle for pb::$body {
            const PAYLOAD_TYPE: &'static str = payload_type::$payload;
            type Request = pb::$request;
            fn request(signed: Option<pb::Envelope>) -> Self::Request {
                pb::$request { signed }
            }
            async fn call(
                mut client: SessionClient,
                request: Self::Request,
            ) -> Result<tonic::Response<<Self::Request as Sendable>::Response>, tonic::Status> {
                client.$method(request).await
            }
            fn receipt(response: <Self::Request as Sendable>::Response) -> Option<pb::Sealed> {
                response.receipt
            }
        }
    )*};
}

lifecycle! {
    AcceptBody => AcceptRequest, accept, ACCEPT;
    DeclineBody => DeclineRequest, decline, DECLINE;
    CompleteBody => CompleteRequest, complete, COMPLETE;
    EscalateBody => EscalateRequest, escalate, ESCALATE;
    RevokeBody => RevokeRequest, revoke, REVOKE;
}

#[tool_router(router = tool_router)]
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
            let held: Vec<Value> = page
                .contracts
                .iter()
                .map(|state| self.held(state))
                .collect();
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
            Ok(Err(refused)) => Ok(Self::refusal(refused)),
            Err(error) => answer(Err(error)),
        }
    }

    #[tool(
        description = "Accept a contract delegated to you, optionally naming the host whose observations count."
    )]
    async fn accept(&self, Parameters(input): Parameters<AcceptInput>) -> Answer {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let host = input
                .host
                .as_deref()
                .map(|h| self.key(h, "host").map(|k| k.to_vec()))
                .transpose()?
                .unwrap_or_default();
            let body = pb::AcceptBody {
                header: Some(self.link.agent.header()),
                contract_id: contract_id.clone(),
                host_public_key: host,
            };
            self.lifecycle(&contract_id, body).await
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
            if output_json.len() > MAX_OUTPUT_BYTES {
                return Err(BrokerError::input(
                    "output",
                    format!(
                        "is {} bytes serialized, at most {MAX_OUTPUT_BYTES}",
                        output_json.len()
                    ),
                ));
            }
            if input.consumed < 0 {
                return Err(BrokerError::input("consumed", "must be 0 or more"));
            }
            let body = pb::CompleteBody {
                header: Some(self.link.agent.header()),
                contract_id: contract_id.clone(),
                output_json,
                report: None,
                claim: text(&input.claim, "claim")?,
                consumed: input.consumed,
            };
            self.lifecycle(&contract_id, body).await
        };
        answer(run.await)
    }

    #[tool(
        description = "Decline a contract delegated to you (before accepting it); its reservation returns to the principal."
    )]
    async fn decline(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        answer(
            self.with_reason(input, |header, contract_id, reason| pb::DeclineBody {
                header,
                contract_id,
                reason,
            })
            .await,
        )
    }

    #[tool(
        description = "Escalate a contract you accepted as unresolvable: its reservation returns and the principal learns what is left."
    )]
    async fn escalate(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        answer(
            self.with_reason(input, |header, contract_id, reason| pb::EscalateBody {
                header,
                contract_id,
                reason,
            })
            .await,
        )
    }

    #[tool(
        description = "Revoke a contract below one you hold (and every open contract below it)."
    )]
    async fn revoke(&self, Parameters(input): Parameters<ReasonInput>) -> Answer {
        answer(
            self.with_reason(input, |header, contract_id, reason| pb::RevokeBody {
                header,
                contract_id,
                reason,
            })
            .await,
        )
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
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let mut client = self.link.reader().await?;
            let data = broker_client::tree::fetch(&mut client, &contract_id, MAX_TREE_CONTRACTS)
                .await
                .map_err(|e| match e.downcast::<tonic::Status>() {
                    Ok(status) => BrokerError::from(status),
                    Err(e) => BrokerError {
                        details: Default::default(),
                        reason: "UNAVAILABLE".into(),
                        field: None,
                        message: e.to_string(),
                    },
                })?;
            let mut text = broker_client::tree::render(&data, &self.names);
            // A model's context is small: cut long drawings, and say so.
            if text.len() > MAX_TREE_TEXT_BYTES {
                text = cut(&text, MAX_TREE_TEXT_BYTES);
                text.push_str("\n… cut: call tree on a contract further down to see the rest\n");
            }
            Ok::<_, BrokerError>(text)
        };
        Ok(match run.await {
            Ok(text) => CallToolResult::success(vec![rmcp::model::ContentBlock::text(text)]),
            Err(error) => crate::tool_result(error),
        })
    }

    #[tool(
        description = "Verify a contract's chain here, offline, against the broker's published keys (signature, hash links, every hop's terms)."
    )]
    async fn verify_chain(&self, Parameters(input): Parameters<ContractInput>) -> Answer {
        let run = async {
            let contract_id = id(&input.contract_id, "contract_id")?;
            let mut client = self.link.reader().await?;
            let keys = client
                .get_broker_keys(pb::GetBrokerKeysRequest {})
                .await?
                .into_inner()
                .keys;
            let chain = client
                .get_chain(pb::GetChainRequest {
                    contract_id: contract_id.clone(),
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
            let hops =
                broker_wire::chain::verify_chain(&sealed, &verified, Some(&leaf)).map_err(|e| {
                    BrokerError {
                        details: Default::default(),
                        reason: "CHAIN_INVALID".into(),
                        field: None,
                        message: e.to_string(),
                    }
                })?;
            Ok(json!({
                "verified": true,
                "verified_locally": "the signature, hash links and terms were checked in this process against GetBrokerKeys",
                "contracts": hops.len(),
                "key_ids": keys.iter().map(|k| k.key_id.clone()).collect::<Vec<_>>(),
                "effective_predicate": hops.last().map(|h| h.effective_predicate.clone()),
            }))
        };
        answer(run.await)
    }
}

impl Tools {
    async fn open_root_inner(&self, input: OpenRootInput) -> Result<Value, BrokerError> {
        let deadline_ms = deadline(Some(input.ttl_ms.unwrap_or(3_600_000)), "ttl_ms")?;
        let write_scope = input.write_scope.unwrap_or_default();
        let labels = input.labels.unwrap_or_default();
        if write_scope.len() > MAX_LIST_ITEMS {
            return Err(BrokerError::input(
                "write_scope",
                format!("at most {MAX_LIST_ITEMS} prefixes"),
            ));
        }
        if labels.len() > MAX_LIST_ITEMS {
            return Err(BrokerError::input(
                "labels",
                format!("at most {MAX_LIST_ITEMS} labels"),
            ));
        }
        let body = pb::OpenRootBody {
            header: Some(self.link.agent.header()),
            intent: text(&input.intent, "intent")?,
            task: String::new(),
            budget: input.budget,
            deadline_ms,
            policy: Some(pb::Policy {
                max_depth: input.max_depth.unwrap_or(4),
                min_cumulative_trust_ppm: input.min_cumulative_trust_ppm.unwrap_or(0),
                max_children: input.max_children.unwrap_or(64),
                disable_retry_headroom: !input.retry_headroom.unwrap_or(true),
                require_host: false,
            }),
            predicate: text(input.predicate.as_deref().unwrap_or(""), "predicate")?,
            write_scope,
            labels: labels.into_iter().collect(),
        };
        let request = pb::OpenRootRequest {
            signed: self.link.signed(payload_type::OPEN_ROOT, &body),
        };
        let response = self
            .link
            .send(request, |mut c, r| async move { c.open_root(r).await })
            .await?;
        match response.issued {
            Some(issued) => Ok(self.issued(&issued)),
            None => Err(BrokerError {
                details: Default::default(),
                reason: "INTERNAL".into(),
                field: None,
                message: "OpenRoot answered without a contract".into(),
            }),
        }
    }

    /// A contract as `get_contract` and the `contract://` resource show it.
    async fn contract_json(&self, contract_id: &[u8]) -> Result<Value, BrokerError> {
        let state = self.contract(contract_id).await?;
        let contract = state
            .contract
            .as_ref()
            .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
            .unwrap_or_default();
        Ok(json!({
            "contract_id": hex::encode(contract_id),
            "status": status_name(state.status),
            "depth": contract.depth,
            "delegate": self.who(&contract.delegate_public_key),
            "budget": contract.budget,
            "ledger": ledger(state.ledger.as_ref()),
            "deadline_ms": contract.deadline_ms,
            "deadline": broker_client::tree::rfc3339(contract.deadline_ms),
            "effective_predicate": state.effective_predicate,
            "write_scope": contract.write_scope,
            "task": contract.task,
            "cumulative_trust_ppm": contract.cumulative_trust_ppm,
        }))
    }

    /// One contract of `whoami`'s list.
    fn held(&self, state: &pb::ContractState) -> Value {
        let contract = state
            .contract
            .as_ref()
            .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
            .unwrap_or_default();
        json!({
            "contract_id": hex::encode(&state.contract_id),
            "status": status_name(state.status),
            "depth": contract.depth,
            "ledger": ledger(state.ledger.as_ref()),
            "deadline": broker_client::tree::rfc3339(contract.deadline_ms),
            "task": cut(&contract.task, MAX_HELD_TASK_BYTES),
        })
    }

    fn issued(&self, issued: &pb::IssuedContract) -> Value {
        let contract = issued
            .contract
            .as_ref()
            .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
            .unwrap_or_default();
        json!({
            "contract_id": hex::encode(&issued.contract_id),
            "depth": contract.depth,
            "delegate": self.who(&contract.delegate_public_key),
            "budget": contract.budget,
            "deadline_ms": contract.deadline_ms,
            "cumulative_trust_ppm": contract.cumulative_trust_ppm,
        })
    }

    /// Issued, or refused (a receipt), or an error.
    async fn delegate_inner(
        &self,
        input: DelegateInput,
    ) -> Result<Result<Value, pb::Refusal>, BrokerError> {
        let parent_id = id(&input.parent_id, "parent_id")?;
        let delegate = self.key(&input.delegate, "delegate")?;
        let host = input
            .host
            .as_deref()
            .map(|h| self.key(h, "host").map(|k| k.to_vec()))
            .transpose()?
            .unwrap_or_default();
        let liability = match input.liability.as_deref() {
            None | Some("principal") => pb::Liability::Principal,
            Some("delegate") => pb::Liability::Delegate,
            Some(other) => {
                return Err(BrokerError::input(
                    "liability",
                    format!("{other:?}: \"principal\" or \"delegate\""),
                ));
            }
        };
        let deadline_ms = deadline(input.ttl_ms, "ttl_ms")?;
        let task = text(&input.task, "task")?;
        let predicate = text(input.predicate.as_deref().unwrap_or(""), "predicate")?;
        let escalation_channel = text(
            input.escalation_channel.as_deref().unwrap_or(""),
            "escalation_channel",
        )?;
        let write_scope = input.write_scope.unwrap_or_default();
        if write_scope.len() > MAX_LIST_ITEMS {
            return Err(BrokerError::input(
                "write_scope",
                format!("at most {MAX_LIST_ITEMS} prefixes"),
            ));
        }
        // The lineage hash is the parent's (every contract of a tree has the
        // root's); a read, so a stranger's parent is NOT_FOUND here.
        let parent = self.contract(&parent_id).await?;
        let parent_contract = parent
            .contract
            .as_ref()
            .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
            .ok_or_else(|| BrokerError {
                details: Default::default(),
                reason: "INTERNAL".into(),
                field: None,
                message: "the broker sent a parent contract that does not decode".into(),
            })?;
        let body = pb::DelegateBody {
            header: Some(self.link.agent.header()),
            parent_id,
            intent_lineage_hash: parent_contract.intent_lineage_hash.clone(),
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
        let request = pb::DelegateRequest {
            signed: self.link.signed(payload_type::DELEGATE, &body),
        };
        let response = self
            .link
            .send(request, |mut c, r| async move { c.delegate(r).await })
            .await?;
        Ok(match response.outcome {
            Some(pb::delegate_response::Outcome::Issued(issued)) => Ok(self.issued(&issued)),
            Some(pb::delegate_response::Outcome::Refused(refused)) => Err(refused),
            None => {
                return Err(BrokerError {
                    details: Default::default(),
                    reason: "INTERNAL".into(),
                    field: None,
                    message: "Delegate answered neither issued nor refused".into(),
                });
            }
        })
    }
}

/// Checks a call's arguments against the tool's published input schema
/// first, so a wrong type, a missing or an unknown argument is a tool error
/// naming the argument (what the model must fix), before any parsing.
pub struct ArgumentCheck(HashMap<String, jsonschema::Validator>);

impl ArgumentCheck {
    fn new(tools: &[rmcp::model::Tool]) -> anyhow::Result<Self> {
        tools
            .iter()
            .map(|tool| {
                let schema = Value::Object((*tool.input_schema).clone());
                let validator = jsonschema::validator_for(&schema).map_err(|e| {
                    anyhow::anyhow!(
                        "the input schema of tool {} does not compile: {e}",
                        tool.name
                    )
                })?;
                Ok((tool.name.to_string(), validator))
            })
            .collect::<anyhow::Result<_>>()
            .map(Self)
    }

    fn check(
        &self,
        tool: &str,
        arguments: &serde_json::Map<String, Value>,
    ) -> Result<(), BrokerError> {
        let Some(validator) = self.0.get(tool) else {
            return Ok(());
        };
        let instance = Value::Object(arguments.clone());
        let Some(error) = validator.iter_errors(&instance).next() else {
            return Ok(());
        };
        use jsonschema::error::ValidationErrorKind as Kind;
        let pointer = error.instance_path().as_str().to_owned();
        let field = match error.kind() {
            Kind::Required { property } => property.as_str().unwrap_or_default().to_owned(),
            Kind::AdditionalProperties { unexpected } => unexpected.join(", "),
            _ => pointer
                .trim_start_matches('/')
                .split('/')
                .next()
                .unwrap_or_default()
                .to_owned(),
        };
        let message: String = error.to_string().chars().take(512).collect();
        Err(BrokerError::input(&field, message))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        let arguments = request.arguments.clone().unwrap_or_default();
        if let Err(error) = self.arguments.check(&request.name, &arguments) {
            return Ok(crate::tool_result(error).into());
        }
        let call = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        self.tool_router.call(call).await
    }

    async fn list_resource_templates(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListResourceTemplatesResult, rmcp::ErrorData> {
        Ok(rmcp::model::ListResourceTemplatesResult::with_all_items(
            super::resources::templates(),
        ))
    }

    async fn read_resource(
        &self,
        request: rmcp::model::ReadResourceRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ReadResourceResponse, rmcp::ErrorData> {
        let contract_id = super::resources::parse(&request.uri)?;
        let value = self.contract_json(&contract_id).await.map_err(|e| {
            rmcp::ErrorData::resource_not_found(format!("{}: {}", e.reason, e.message), None)
        })?;
        Ok(rmcp::model::ReadResourceResult::new(vec![
            rmcp::model::ResourceContents::text(value.to_string(), request.uri)
                .with_mime_type("application/json"),
        ])
        .into())
    }

    #[allow(deprecated)]
    async fn subscribe(
        &self,
        request: rmcp::model::SubscribeRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        let contract_id = super::resources::parse(&request.uri)?;
        let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        subscriptions.retain(|_, task| !task.is_finished());
        if subscriptions.contains_key(&request.uri) {
            return Ok(());
        }
        if subscriptions.len() >= super::resources::MAX_SUBSCRIPTIONS {
            return Err(rmcp::ErrorData::invalid_request(
                format!(
                    "at most {} contracts are followed at once: unsubscribe one first",
                    super::resources::MAX_SUBSCRIPTIONS
                ),
                None,
            ));
        }
        let uri = request.uri.clone();
        let peer = context.peer;
        let task = tokio::spawn(super::resources::follow(
            self.link.clone(),
            contract_id,
            move || {
                let (peer, uri) = (peer.clone(), uri.clone());
                async move {
                    peer.notify_resource_updated(
                        rmcp::model::ResourceUpdatedNotificationParam::new(uri),
                    )
                    .await
                    .is_ok()
                }
            },
        ));
        subscriptions.insert(request.uri, task.abort_handle());
        Ok(())
    }

    #[allow(deprecated)]
    async fn unsubscribe(
        &self,
        request: rmcp::model::UnsubscribeRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(task) = subscriptions.remove(&request.uri) {
            task.abort();
        }
        Ok(())
    }

    fn accepted_subscription_filter(
        &self,
        requested: &rmcp::model::SubscriptionFilter,
    ) -> Option<rmcp::model::SubscriptionFilter> {
        let mut accepted = rmcp::model::SubscriptionFilter::default();
        accepted.resource_subscriptions = requested.resource_subscriptions.as_ref().map(|uris| {
            uris.iter()
                .filter(|uri| super::resources::parse(uri).is_ok())
                .take(super::resources::MAX_SUBSCRIPTIONS)
                .cloned()
                .collect()
        });
        Some(accepted)
    }

    async fn listen(
        &self,
        context: rmcp::service::SubscriptionContext,
    ) -> Result<(), rmcp::ErrorData> {
        let uris = context
            .accepted()
            .resource_subscriptions
            .clone()
            .unwrap_or_default();
        let mut follows = tokio::task::JoinSet::new();
        for uri in uris {
            let Ok(contract_id) = super::resources::parse(&uri) else {
                continue;
            };
            let sink = context.sink().clone();
            follows.spawn(super::resources::follow(
                self.link.clone(),
                contract_id,
                move || {
                    let (sink, uri) = (sink.clone(), uri.clone());
                    async move { sink.notify_resource_updated(uri).await.is_ok() }
                },
            ));
        }
        context.cancelled().await;
        follows.abort_all();
        Ok(())
    }

    fn get_info(&self) -> ServerConfig {
        let mut config = ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .enable_resources_subscribe()
                .build(),
        )
            .with_instructions(
                "Delegation through the broker: open_root or hold a contract, delegate parts of it, accept/complete what is delegated to you. Refusals list each violated invariant with requested and allowed values.",
            );
        config.server_info =
            rmcp::model::Implementation::new("delegation-broker", env!("CARGO_PKG_VERSION"));
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(check: &ArgumentCheck, tool: &str, args: Value) -> Option<String> {
        let args = args.as_object().expect("an object").clone();
        check.check(tool, &args).err().and_then(|e| e.field)
    }

    #[test]
    fn every_schema_compiles_and_a_bad_argument_is_named() {
        let tools = Tools::tool_router().list_all();
        let check = ArgumentCheck::new(&tools).expect("every schema compiles");
        assert_eq!(check.0.len(), tools.len());
        let ok = json!({"parent_id": "00", "delegate": "x", "task": "t", "budget": 5});
        assert_eq!(field(&check, "delegate", ok), None);
        let wrong_type = json!({"parent_id": "00", "delegate": "x", "task": "t", "budget": "ten"});
        assert_eq!(
            field(&check, "delegate", wrong_type).as_deref(),
            Some("budget")
        );
        let missing = json!({"parent_id": "00", "delegate": "x", "task": "t"});
        assert_eq!(
            field(&check, "delegate", missing).as_deref(),
            Some("budget")
        );
        let unknown = json!({"contract_id": "00", "bogus": 1});
        assert_eq!(
            field(&check, "get_contract", unknown).as_deref(),
            Some("bogus")
        );
        let null_optional = json!({"contract_id": "00", "host": null});
        assert_eq!(field(&check, "accept", null_optional), None);
    }

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
