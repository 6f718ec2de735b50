//! The ingress: in front of the fronted agent. A task starts only with a
//! chain that verifies offline, names this agent as the leaf's delegate
//! and whose contract is open and not bound to another task; nothing else
//! reaches the agent. The gateway then follows the task (polling the agent
//! with a bound), moves the contract as the task moves (ext::step), cancels
//! the task when the contract is revoked or expires, and shows the
//! broker's verdict to the caller (ext::decorate).

use std::sync::Arc;
use std::time::Duration;

use a2a_pb::protojson::{self as a2a, TaskState};
use prost::Message as _;
use serde_json::Value;

use super::client::CallError;
use super::ext::{self, Refused, code};
use super::{Gateway, Rpc, Slot, broker, broker_error, now_ms, params, passed_headers};
use broker_domain::Id;
use broker_wire::chain::{BrokerKeys, ChainError, Hop, verify_chain};
use broker_wire::pb;

/// After a restart: the agent's tasks read for recovery, at most this many
/// pages of `RECOVERY_PAGE_SIZE`.
const MAX_RECOVERY_PAGES: usize = 64;
const RECOVERY_PAGE_SIZE: i32 = 100;
/// Most held contracts read for recovery (the broker's largest page).
const MAX_RECOVERY_HELD: u32 = 1000;

/// How long a task canceled for its contract (revoked, expired) is read
/// again until the agent reports it settled.
const CANCEL_GRACE_MS: u64 = 10_000;

pub(super) async fn handle(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    match rpc.method.as_str() {
        "SendMessage" => send(gateway, rpc).await,
        "GetTask" => get(gateway, rpc).await,
        "CancelTask" => cancel(gateway, rpc).await,
        other => Err(Refused::new(
            code::METHOD_NOT_FOUND,
            "INVALID_FIELD",
            format!("{other}: not served"),
        )
        .into()),
    }
}

fn to_value<T: serde::Serialize>(value: &T) -> Result<Value, CallError> {
    serde_json::to_value(value).map_err(|e| {
        Refused::new(
            code::INTERNAL,
            "INTERNAL",
            format!("encoding the answer: {e}"),
        )
        .into()
    })
}

/// An admitted task's slot; after a restart, rebuilt from the agent's own
/// record of the task (the contract its first message was marked with)
/// and the broker's state of that contract.
async fn slot_of(gateway: &Arc<Gateway>, task_id: &str) -> Result<Arc<Slot>, Refused> {
    let known = {
        let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted.tasks.get(task_id).cloned()
    };
    if let Some(slot) = known {
        return Ok(slot);
    }
    let not_found = || {
        Refused::new(
            code::TASK_NOT_FOUND,
            "NOT_FOUND",
            format!(
                "task {:?}: no task admitted under a contract by this gateway",
                ext_cut(task_id)
            ),
        )
    };
    let get = a2a::GetTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    let task: a2a::Task = gateway
        .upstream_call("GetTask", &get, &[])
        .await
        .map_err(|_| not_found())?;
    let contract_id: Id = ext::marked(&task)
        .and_then(|id| id.try_into().ok())
        .ok_or_else(not_found)?;
    let state = gateway.contract(&contract_id).await?;
    let contract = state
        .contract
        .as_ref()
        .and_then(|s| pb::Contract::decode(s.payload.as_slice()).ok())
        .ok_or_else(not_found)?;
    if contract.delegate_public_key != gateway.agent_key {
        return Err(not_found());
    }
    let status =
        pb::ContractStatus::try_from(state.status).unwrap_or(pb::ContractStatus::Unspecified);
    let progress = ext::Progress {
        accepted: status != pb::ContractStatus::Open,
        ended: !matches!(
            status,
            pb::ContractStatus::Open | pb::ContractStatus::Accepted
        ),
    };
    let slot = new_slot(
        contract_id,
        tenant_of(&state),
        contract.deadline_ms,
        progress,
        None,
    );
    let slot = {
        let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        // Another call may have rebuilt it meanwhile: keep the first.
        let slot = match admitted.tasks.get(task_id) {
            Some(first) => first.clone(),
            None => {
                admitted.follow(task_id.to_owned(), slot.clone());
                slot
            }
        };
        admitted
            .contracts
            .insert(contract_id, Some(task_id.to_owned()));
        slot
    };
    gateway.remember_context(&task.context_id, contract_id);
    tracing::info!(task = %ext_cut(task_id), contract = %hex::encode(contract_id), "task found again after a restart");
    if !progress.ended {
        tokio::spawn(follow(gateway.clone(), slot.clone(), task_id.to_owned()));
    }
    Ok(slot)
}

/// The broker tenant a contract's tree is in; a broker that does not name
/// it (older than ContractState.tenant) is counted as the shared `open`
/// one, so a share still bounds it.
pub(super) fn tenant_of(state: &pb::ContractState) -> String {
    if state.tenant.is_empty() {
        broker_domain::tenant::OPEN_TENANT.to_owned()
    } else {
        state.tenant.clone()
    }
}

fn new_slot(
    contract_id: Id,
    tenant: String,
    deadline_ms: i64,
    progress: ext::Progress,
    trace: Option<String>,
) -> Arc<Slot> {
    Arc::new(Slot {
        contract_id,
        tenant,
        deadline_ms,
        trace,
        progress: tokio::sync::Mutex::new((
            progress,
            ext::Judged {
                contract_id: contract_id.to_vec(),
                ..Default::default()
            },
        )),
        latest: tokio::sync::watch::Sender::new(None),
        finished: std::sync::atomic::AtomicBool::new(false),
    })
}

fn ext_cut(text: &str) -> String {
    broker_client::names::cut(text, 128)
}

pub(super) fn check_size(message: &a2a::Message) -> Result<(), Refused> {
    if message.parts.len() > ext::MAX_PARTS {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "MESSAGE_TOO_LARGE",
            format!(
                "message.parts: {} parts, at most {}",
                message.parts.len(),
                ext::MAX_PARTS
            ),
        )
        .with("field", "message.parts"));
    }
    Ok(())
}

/// The gateway's chain check: the binary's one verifier, the CLI's
/// (`verify_chain`: a key retired before the leaf was issued does not
/// vouch for it).
fn check_chain(sealed: &[pb::Sealed], keys: &BrokerKeys) -> Result<Vec<Hop>, ChainError> {
    verify_chain(sealed, keys, None)
}

/// Verifies a chain offline and returns its leaf, refusing what does not
/// name this agent or has passed its deadline.
pub(super) async fn admit_chain(
    gateway: &Gateway,
    chain: &pb::GetChainResponse,
) -> Result<(Id, i64), Refused> {
    let field = format!("message.metadata[{}].chain", ext::URI);
    let sealed: Vec<pb::Sealed> = chain
        .chain
        .iter()
        .map(|state| state.contract.clone().unwrap_or_default())
        .collect();
    let mut verified = check_chain(&sealed, &gateway.keys(false).await?);
    if matches!(verified, Err(ChainError::UnknownKey { .. })) {
        // A key published since the gateway last read them (a rotation).
        verified = check_chain(&sealed, &gateway.keys(true).await?);
    }
    let hops = verified.map_err(|e| {
        let reason = match e {
            ChainError::Empty | ChainError::TooLong(_) | ChainError::Undecodable { .. } => {
                "UNDECODABLE_MESSAGE"
            }
            _ => "BAD_SIGNATURE",
        };
        Refused::new(
            code::INVALID_PARAMS,
            reason,
            format!("{field} does not verify against the broker's keys: {e}"),
        )
        .with("field", field.clone())
    })?;
    let leaf = hops.last().ok_or_else(|| {
        Refused::new(
            code::INVALID_PARAMS,
            "UNDECODABLE_MESSAGE",
            format!("{field} is empty"),
        )
    })?;
    if leaf.contract.delegate_public_key != gateway.agent_key {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_DELEGATE",
            format!(
                "contract {} is for agent {}, not for this one ({}): ask the broker for a contract naming this agent",
                hex::encode(leaf.id),
                hex::encode(&leaf.contract.delegate_public_key),
                hex::encode(gateway.agent_key)
            ),
        )
        .with("contractId", hex::encode(leaf.id)));
    }
    if leaf.contract.deadline_ms <= now_ms() {
        return Err(Refused::new(
            code::INVALID_PARAMS,
            "LATE",
            format!(
                "contract {} passed its deadline ({} ms since the Unix epoch)",
                hex::encode(leaf.id),
                leaf.contract.deadline_ms
            ),
        )
        .with("contractId", hex::encode(leaf.id)));
    }
    Ok((leaf.id, leaf.contract.deadline_ms))
}

pub(super) use broker_client::names::status_name;

pub(super) fn ended(contract_id: &Id, why: String) -> Refused {
    Refused::new(
        code::INVALID_PARAMS,
        "ENDED",
        format!(
            "contract {}: {why}; a new task needs a new contract",
            hex::encode(contract_id)
        ),
    )
    .with("contractId", hex::encode(contract_id))
}

/// Unbinds a contract whose task never started (a refusal or an error
/// after binding).
pub(super) struct Binding<'a> {
    gateway: &'a Gateway,
    contract_id: Id,
    kept: bool,
}

impl Binding<'_> {
    /// Keeps the contract bound to `task` (a task id, or a label).
    pub(super) fn keep(&mut self, task: String) {
        let mut admitted = self
            .gateway
            .admitted
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        admitted.contracts.insert(self.contract_id, Some(task));
        self.kept = true;
    }
}

impl Drop for Binding<'_> {
    fn drop(&mut self) {
        if !self.kept {
            let mut admitted = self
                .gateway
                .admitted
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            admitted.contracts.remove(&self.contract_id);
        }
    }
}

/// Binds `contract_id` (in a tree of broker tenant `tenant`) to the task
/// about to start, within max_tasks and the tenant's share of it.
pub(super) fn bind<'a>(
    gateway: &'a Gateway,
    contract_id: Id,
    tenant: &str,
) -> Result<Binding<'a>, Refused> {
    let max_tasks = gateway.config.max_tasks;
    let share = gateway.config.tasks_per_tenant();
    let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(task) = admitted.contracts.get(&contract_id) {
        return Err(ended(
            &contract_id,
            match task {
                Some(task) => format!("already bound to task {:?}", ext_cut(task)),
                None => "a task is being started under it".into(),
            },
        ));
    }
    if admitted.tasks.len() >= max_tasks || admitted.of_tenant(tenant) >= share {
        // Forget tasks whose contract has ended; refuse when too few have.
        let done: Vec<String> = admitted
            .tasks
            .iter()
            .filter(|(_, slot)| slot.progress.try_lock().is_ok_and(|p| p.0.ended))
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            // An ended contract is refused by the broker's state from
            // here on: its binding need not be remembered either.
            if let Some(slot) = admitted.forget(&id) {
                admitted.contracts.remove(&slot.contract_id);
            }
        }
        if admitted.tasks.len() >= max_tasks {
            return Err(Refused::new(
                code::INTERNAL,
                "OVERLOADED",
                format!("this gateway follows {max_tasks} tasks already (max_tasks)"),
            )
            .with("limit", "max_tasks"));
        }
        // Many keys are one tenant when the broker says so (free keys all
        // share `open`): they cannot take the others' places.
        if admitted.of_tenant(tenant) >= share {
            return Err(Refused::new(
                code::INTERNAL,
                "OVERLOADED",
                format!(
                    "this gateway follows {share} tasks of tenant {:?} already, its share of max_tasks (max_tasks_per_tenant)",
                    ext_cut(tenant)
                ),
            )
            .with("limit", "max_tasks_per_tenant")
            .with("tenant", ext_cut(tenant)));
        }
    }
    admitted.contracts.insert(contract_id, None);
    Ok(Binding {
        gateway,
        contract_id,
        kept: false,
    })
}

async fn send(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let mut request: a2a::SendMessageRequest = params(rpc)?;
    let message = request.message.as_mut().ok_or_else(|| {
        Refused::new(code::INVALID_PARAMS, "INVALID_FIELD", "message is required")
            .with("field", "message")
    })?;
    check_size(message)?;
    let extension = ext::take(message)?;
    let wait = !request
        .configuration
        .as_ref()
        .is_some_and(|c| c.return_immediately);
    // The gateway follows the task itself: the agent answers at once.
    request
        .configuration
        .get_or_insert_with(Default::default)
        .return_immediately = true;
    let headers = passed_headers(rpc);
    if !message.task_id.is_empty() {
        return continue_task(gateway, request, wait, &headers).await;
    }
    let started = std::time::Instant::now();
    let chain = ext::chain_of(extension.as_ref())?;
    let (contract_id, deadline_ms) = admit_chain(gateway, &chain).await?;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: chain verified"
    );
    // The broker's state first: it names the tenant whose share binds.
    let state = gateway.contract(&contract_id).await?;
    let tenant = tenant_of(&state);
    let mut binding = bind(gateway, contract_id, &tenant)?;
    if let Some(message) = request.message.as_mut() {
        ext::mark(message, &contract_id);
    }
    match pb::ContractStatus::try_from(state.status) {
        Ok(pb::ContractStatus::Open) => {}
        Ok(pb::ContractStatus::Accepted) => {
            return Err(ended(
                &contract_id,
                "already accepted: its task was started".into(),
            )
            .into());
        }
        _ => {
            return Err(ended(&contract_id, format!("it is {}", status_name(state.status))).into());
        }
    }
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: contract read"
    );
    let response: a2a::SendMessageResponse = gateway
        .upstream_call("SendMessage", &request, &headers)
        .await?;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: agent answered"
    );
    let slot = new_slot(
        contract_id,
        tenant,
        deadline_ms,
        ext::Progress::default(),
        rpc.trace.clone(),
    );
    let task = match response.payload {
        Some(a2a::send_message_response::Payload::Task(task)) => task,
        Some(a2a::send_message_response::Payload::Message(reply)) => {
            // A direct answer, no task: it completes the contract at once
            // (the binding covers the calls until then; the broker's
            // COMPLETED refuses any replay after).
            let answered = direct(gateway, &slot, reply).await;
            drop(binding);
            return answered;
        }
        None => {
            return Err(Refused::new(
                code::INTERNAL,
                "UNDECODABLE_MESSAGE",
                "the agent answered SendMessage with neither a task nor a message",
            )
            .into());
        }
    };
    binding.keep(task.id.clone());
    {
        let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted.follow(task.id.clone(), slot.clone());
    }
    gateway.remember_context(&task.context_id, contract_id);
    gateway.metrics.admitted.inc();
    let task_id = task.id.clone();
    let observed = observe(gateway, &slot, task).await;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: first state moved"
    );
    tokio::spawn(follow(gateway.clone(), slot.clone(), task_id));
    let task = observed?;
    let answered = answer_task(gateway, &slot, task, wait).await;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "ingress: answered"
    );
    answered
}

/// A message in a task already admitted: forwarded while its contract is
/// open.
async fn continue_task(
    gateway: &Arc<Gateway>,
    request: a2a::SendMessageRequest,
    wait: bool,
    headers: &[(http::HeaderName, http::HeaderValue)],
) -> Result<Value, CallError> {
    let task_id = request
        .message
        .as_ref()
        .map(|m| m.task_id.clone())
        .unwrap_or_default();
    let slot = slot_of(gateway, &task_id).await?;
    if slot.progress.lock().await.0.ended {
        return Err(ended(&slot.contract_id, "the task's contract has ended".into()).into());
    }
    let state = gateway.contract(&slot.contract_id).await?;
    if !matches!(
        pb::ContractStatus::try_from(state.status),
        Ok(pb::ContractStatus::Open | pb::ContractStatus::Accepted)
    ) {
        return Err(ended(
            &slot.contract_id,
            format!("it is {}", status_name(state.status)),
        )
        .into());
    }
    let response: a2a::SendMessageResponse = gateway
        .upstream_call("SendMessage", &request, headers)
        .await?;
    match response.payload {
        Some(a2a::send_message_response::Payload::Task(task)) => {
            let task = observe(gateway, &slot, task).await?;
            answer_task(gateway, &slot, task, wait).await
        }
        Some(a2a::send_message_response::Payload::Message(reply)) => {
            to_value(&a2a::SendMessageResponse {
                payload: Some(a2a::send_message_response::Payload::Message(reply)),
            })
        }
        None => Err(Refused::new(
            code::INTERNAL,
            "UNDECODABLE_MESSAGE",
            "the agent answered SendMessage with neither a task nor a message",
        )
        .into()),
    }
}

/// An agent that answered with a message and no task: Accept and Complete
/// with the message's parts as the output.
async fn direct(
    gateway: &Gateway,
    slot: &Slot,
    mut reply: a2a::Message,
) -> Result<Value, CallError> {
    let artifact = a2a::Artifact {
        parts: reply.parts.clone(),
        ..Default::default()
    };
    let task = a2a::Task {
        status: Some(a2a::TaskStatus {
            state: TaskState::Completed as i32,
            ..Default::default()
        }),
        artifacts: vec![artifact],
        ..Default::default()
    };
    let judged = observe(gateway, slot, task).await?;
    let mut metadata = serde_json::to_value(&reply.metadata)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    if let Some(ext) = serde_json::to_value(&judged.metadata)
        .ok()
        .and_then(|v| v.get(ext::URI).cloned())
    {
        metadata.insert(ext::URI.into(), ext);
    }
    reply.metadata = serde_json::from_value(Value::Object(metadata)).ok();
    to_value(&a2a::SendMessageResponse {
        payload: Some(a2a::send_message_response::Payload::Message(reply)),
    })
}

/// Answers a SendMessage: at once, or once the task settles when the
/// caller did not ask for `returnImmediately` (bounded by call_timeout_ms).
async fn answer_task(
    gateway: &Gateway,
    slot: &Slot,
    task: a2a::Task,
    wait: bool,
) -> Result<Value, CallError> {
    let mut task = task;
    if wait && !settled(&task) {
        let mut latest = slot.latest.subscribe();
        let timeout = Duration::from_millis(gateway.config.call_timeout_ms);
        let finished = || slot.finished.load(std::sync::atomic::Ordering::Acquire);
        let waited = tokio::time::timeout(
            timeout,
            latest.wait_for(|t| t.as_ref().is_some_and(settled) || finished()),
        )
        .await;
        if let Ok(Ok(seen)) = waited
            && let Some(seen) = seen.clone()
        {
            task = seen;
        } else if let Some(seen) = slot.latest.borrow().clone() {
            task = seen;
        }
    }
    to_value(&a2a::SendMessageResponse {
        payload: Some(a2a::send_message_response::Payload::Task(task)),
    })
}

fn state_of(task: &a2a::Task) -> TaskState {
    task.status
        .as_ref()
        .and_then(|s| TaskState::try_from(s.state).ok())
        .unwrap_or(TaskState::Unspecified)
}

fn settled(task: &a2a::Task) -> bool {
    ext::is_settled(state_of(task))
}

/// Reasons a lifecycle call cannot succeed later either: the contract is
/// no longer this agent's to move.
fn final_refusal(reason: &str) -> bool {
    // errors.proto: each of these "fails again".
    matches!(
        reason,
        "ENDED"
            | "WRONG_STATE"
            | "LATE"
            | "ROOT"
            | "NOT_PENDING"
            | "NOT_DELEGATE"
            | "NOT_HOLDER"
            | "NOT_FOUND"
            | "ANCESTOR_ENDING"
    )
}

/// Moves the contract as far as the task's state asks (ext::step), then
/// publishes the task, decorated with the broker's word.
async fn observe(
    gateway: &Gateway,
    slot: &Slot,
    mut task: a2a::Task,
) -> Result<a2a::Task, Refused> {
    let mut guard = slot.progress.lock().await;
    let (progress, judged) = &mut *guard;
    loop {
        let state = state_of(&task);
        let step = ext::step(state, task.status.as_ref(), *progress);
        let id = slot.contract_id;
        let outcome = match &step {
            ext::Step::Wait => break,
            ext::Step::Accept => broker::accept(gateway, slot.trace.as_deref(), &id)
                .await
                .map(|r| r.receipt_id),
            ext::Step::Complete { claim } => {
                let output = ext::output_json(&task.artifacts)?;
                broker::complete(gateway, slot.trace.as_deref(), &id, output, claim)
                    .await
                    .map(|r| {
                        if let Some(receipt) = broker::receipt(r.receipt.as_ref()) {
                            judged.completed(&receipt);
                        }
                        r.receipt_id
                    })
            }
            ext::Step::Escalate { reason } => {
                broker::escalate(gateway, slot.trace.as_deref(), &id, reason.clone())
                    .await
                    .map(|r| r.receipt_id)
            }
            ext::Step::Decline { reason } => {
                broker::decline(gateway, slot.trace.as_deref(), &id, reason.clone())
                    .await
                    .map(|r| r.receipt_id)
            }
        };
        match outcome {
            Ok(receipt_id) => {
                judged.receipt_id = Some(receipt_id);
                match step {
                    ext::Step::Accept => progress.accepted = true,
                    _ => progress.ended = true,
                }
            }
            Err(error) if final_refusal(&error.reason) => {
                tracing::info!(contract = %hex::encode(id), reason = %error.reason, "the contract moved without this gateway");
                // Accepted already (a retry after a lost answer) is fine;
                // anything else ended the contract elsewhere.
                match step {
                    ext::Step::Accept => {
                        let status = gateway.contract(&id).await?.status;
                        if status == pb::ContractStatus::Accepted as i32 {
                            progress.accepted = true;
                        } else {
                            progress.accepted = true;
                            progress.ended = true;
                        }
                    }
                    _ => progress.ended = true,
                }
            }
            Err(error) => return Err(broker_error(error)),
        }
    }
    ext::decorate(&mut task, judged);
    slot.latest.send_replace(Some(task.clone()));
    Ok(task)
}

/// Follows an admitted task until it settles and its contract has moved:
/// polls the agent every poll_ms, and cancels the task when the contract
/// is revoked or expires, or its deadline passes.
async fn follow(gateway: Arc<Gateway>, slot: Arc<Slot>, task_id: String) {
    gateway.metrics.followed.inc();
    following(&gateway, &slot, &task_id).await;
    gateway.metrics.followed.dec();
    // Callers still waiting for the task are answered with what is known.
    slot.finished
        .store(true, std::sync::atomic::Ordering::Release);
    slot.latest.send_modify(|_| {});
}

async fn following(gateway: &Arc<Gateway>, slot: &Arc<Slot>, task_id: &str) {
    let mut tick = tokio::time::interval(Duration::from_millis(gateway.config.poll_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let get = a2a::GetTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    // Set once the task was canceled for its contract: the task is then
    // read until it settles, for at most CANCEL_GRACE_MS.
    let mut canceled_at: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let ended = slot.progress.lock().await.0.ended;
        if ended && slot.latest.borrow().as_ref().is_some_and(settled) {
            return;
        }
        if let Some(at) = canceled_at {
            if at.elapsed() > Duration::from_millis(CANCEL_GRACE_MS) {
                tracing::warn!(task = %task_id, "the agent's task did not settle after its cancel");
                return;
            }
        } else {
            let expired = now_ms() >= slot.deadline_ms;
            let revoked = match gateway.contract(&slot.contract_id).await {
                Ok(state) => matches!(
                    pb::ContractStatus::try_from(state.status),
                    Ok(pb::ContractStatus::Revoked | pb::ContractStatus::Expired)
                ),
                Err(_) => false,
            };
            if expired || revoked {
                let why = if revoked {
                    "revoked"
                } else {
                    "past its deadline"
                };
                tracing::info!(task = %task_id, contract = %hex::encode(slot.contract_id), why, "canceling the agent's task");
                let cancel = a2a::CancelTaskRequest {
                    id: task_id.to_owned(),
                    ..Default::default()
                };
                let canceled: Result<a2a::Task, _> =
                    gateway.upstream_call("CancelTask", &cancel, &[]).await;
                if let Err(CallError::Remote(error)) = &canceled {
                    tracing::warn!(task = %task_id, %error, "the agent refused to cancel its task");
                }
                canceled_at = Some(tokio::time::Instant::now());
                continue;
            }
        }
        let task: Result<a2a::Task, _> = gateway.upstream_call("GetTask", &get, &[]).await;
        match task {
            Ok(task) => {
                if let Err(e) = observe(gateway, slot, task).await {
                    tracing::warn!(task = %task_id, error = %e.message, "moving the contract failed; trying again");
                }
            }
            Err(CallError::Remote(error)) => {
                tracing::warn!(task = %task_id, %error, "the agent no longer answers for its task");
                return;
            }
            Err(CallError::Local(e)) => {
                tracing::warn!(task = %task_id, error = %e.message, "reading the agent's task failed");
            }
        }
    }
}

async fn get(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let request: a2a::GetTaskRequest = params(rpc)?;
    let slot = slot_of(gateway, &request.id).await?;
    let task: a2a::Task = gateway
        .upstream_call("GetTask", &request, &passed_headers(rpc))
        .await?;
    let task = observe(gateway, &slot, task).await?;
    to_value(&task)
}

async fn cancel(gateway: &Arc<Gateway>, rpc: &Rpc) -> Result<Value, CallError> {
    let request: a2a::CancelTaskRequest = params(rpc)?;
    let slot = slot_of(gateway, &request.id).await?;
    // Only the principal cancels, by its signed Revoke: an anonymous
    // CancelTask is taken once the contract has ended.
    let state = gateway.contract(&slot.contract_id).await?;
    if matches!(
        pb::ContractStatus::try_from(state.status),
        Ok(pb::ContractStatus::Open | pb::ContractStatus::Accepted)
    ) {
        return Err(Refused::new(
            code::TASK_NOT_CANCELABLE,
            "NOT_PRINCIPAL",
            format!(
                "task {:?} runs under contract {}, which is open: its principal cancels it by revoking the contract (this gateway then cancels the task)",
                ext_cut(&request.id),
                hex::encode(slot.contract_id)
            ),
        )
        .into());
    }
    let task: a2a::Task = gateway
        .upstream_call("CancelTask", &request, &passed_headers(rpc))
        .await?;
    let task = observe(gateway, &slot, task).await?;
    to_value(&task)
}

/// At start: follows again the tasks of contracts this agent holds
/// ACCEPTED (a previous run admitted them), found in the agent's own task
/// list by the contract each task's first message was marked with. Tasks
/// nobody asks about still reach their Complete.
pub(super) async fn recover(gateway: Arc<Gateway>) {
    let held = match gateway
        .link
        .held(pb::HeldRole::Delegate, MAX_RECOVERY_HELD)
        .await
    {
        Ok(held) => held,
        Err(e) => {
            tracing::warn!(reason = %e.reason, "recovery: the broker's list of held contracts could not be read");
            return;
        }
    };
    let accepted: std::collections::HashSet<Vec<u8>> = held
        .contracts
        .iter()
        .filter(|c| c.status == pb::ContractStatus::Accepted as i32)
        .map(|c| c.contract_id.clone())
        .collect();
    if accepted.is_empty() {
        return;
    }
    let mut page_token = String::new();
    let mut recovered = 0usize;
    for _ in 0..MAX_RECOVERY_PAGES {
        let request = a2a::ListTasksRequest {
            page_size: Some(RECOVERY_PAGE_SIZE),
            page_token: page_token.clone(),
            ..Default::default()
        };
        let page: a2a::ListTasksResponse = match gateway
            .upstream_call("ListTasks", &request, &[])
            .await
        {
            Ok(page) => page,
            Err(_) => {
                tracing::warn!(
                    "recovery: the agent's task list could not be read; tasks are found again when asked for"
                );
                return;
            }
        };
        for task in &page.tasks {
            let ours = ext::marked(task).is_some_and(|id| accepted.contains(&id));
            if ours && !settled(task) && slot_of(&gateway, &task.id).await.is_ok() {
                recovered += 1;
            }
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    tracing::info!(recovered, "recovery: tasks followed again");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_of_too_many_parts_is_refused_by_name() {
        let part = a2a::Part {
            content: Some(a2a::part::Content::Text("x".into())),
            ..Default::default()
        };
        let mut message = a2a::Message {
            parts: vec![part; ext::MAX_PARTS],
            ..Default::default()
        };
        assert!(check_size(&message).is_ok());
        message.parts.push(message.parts[0].clone());
        let refused = check_size(&message).unwrap_err();
        assert_eq!(refused.reason, "MESSAGE_TOO_LARGE");
        assert_eq!(refused.metadata["field"], "message.parts");
    }

    #[test]
    fn a_chain_signed_after_its_key_retired_is_refused() {
        let key = broker_wire::crypto::generate_signing_key();
        let (chain, _) = broker_wire::chain::fixture::stamped_chain(&key, 1, "true", |_| {
            broker_wire::chain::fixture::Hop {
                budget: 10,
                liability: broker_domain::Liability::Delegate,
                predicate: String::new(),
                factor_ppm: 900_000,
            }
        });
        let issued_at_ms = pb::Contract::decode(chain[1].payload.as_slice())
            .unwrap()
            .issued_at_ms;
        let public = key.verifying_key().to_bytes();
        let keys = |retired_at_ms: i64| {
            BrokerKeys::from_published(&[pb::BrokerKey {
                key_id: broker_wire::crypto::key_id(&public),
                public_key: public.to_vec(),
                current: false,
                retired_at_ms,
            }])
        };
        assert!(check_chain(&chain, &keys(issued_at_ms + 1)).is_ok());
        assert!(matches!(
            check_chain(&chain, &keys(issued_at_ms)),
            Err(ChainError::Retired { index: 1, .. })
        ));
    }

    #[test]
    fn oversized_extension_metadata_is_refused_before_it_is_read() {
        let big = "A".repeat(ext::MAX_EXTENSION_BYTES + 1);
        let mut message = a2a::Message {
            metadata: serde_json::from_value(serde_json::json!({ ext::URI: { "chain": big } }))
                .ok(),
            ..Default::default()
        };
        assert_eq!(
            ext::take(&mut message).unwrap_err().reason,
            "MESSAGE_TOO_LARGE"
        );
    }
}
