//! Following an admitted task: its slot (rebuilt after a restart from
//! the agent's record and the broker's state), the broker calls its
//! states ask for, the agent followed by its stream (or polled) until the
//! task settles, the callers' streams of it, the task
//! canceled when its contract is revoked or expires, and the tasks of a
//! previous run followed again at start.

use std::sync::Arc;
use std::time::Duration;

use a2a_pb::protojson::{self as a2a, TaskState};

use super::tenant_of;
use crate::client::CallError;
use crate::ext::{self, Refused, code};
use crate::{Gateway, Slot, broker, broker_error, now_ms};
use broker_domain::Id;
use broker_wire::pb;

/// After a restart: the agent's tasks read for recovery, at most this many
/// pages of `RECOVERY_PAGE_SIZE` (bounds the work of a start).
const MAX_RECOVERY_PAGES: usize = 64;
/// A2A's largest ListTasks page (a2a.proto: at most 100).
const RECOVERY_PAGE_SIZE: i32 = 100;
/// Most held contracts read for recovery: the broker's largest page.
const MAX_RECOVERY_HELD: u32 = broker_domain::limits::MAX_PAGE_SIZE;

/// How long a task canceled for its contract (revoked, expired) is read
/// again until the agent reports it settled.
const CANCEL_GRACE_MS: u64 = 10_000;
/// Events a caller's stream holds ready ahead of its reader.
const STREAM_AHEAD: usize = 16;

/// An admitted task's slot; after a restart, rebuilt from the agent's own
/// record of the task (the contract its first message was marked with)
/// and the broker's state of that contract.
pub(super) async fn slot_of(gateway: &Arc<Gateway>, task_id: &str) -> Result<Arc<Slot>, Refused> {
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
                ext::echoed(task_id)
            ),
        )
    };
    let task = gateway.upstream_task(task_id).await.ok_or_else(not_found)?;
    let contract_id: Id = ext::marked(&task)
        .and_then(|id| id.try_into().ok())
        .ok_or_else(not_found)?;
    let state = gateway.contract(&contract_id).await?;
    let contract = broker_client::terms(state.contract.as_ref()).ok_or_else(not_found)?;
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
        gateway,
        contract_id,
        tenant_of(&state),
        contract.deadline_ms,
        progress,
        None,
    );
    if progress.ended {
        // Nobody follows it: a caller's stream of it must not wait for
        // events that never come. Marked before any caller can see it.
        slot.finished
            .store(true, std::sync::atomic::Ordering::Release);
    }
    let (slot, rebuilt) = {
        let mut admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        // Another call may have rebuilt it meanwhile: keep the first, and
        // its follower (a second one would end the first's watch early).
        let kept = match admitted.tasks.get(task_id) {
            Some(first) => (first.clone(), false),
            None => {
                admitted.follow(task_id.to_owned(), slot.clone());
                (slot, true)
            }
        };
        admitted
            .contracts
            .insert(contract_id, Some(task_id.to_owned()));
        kept
    };
    // Whichever rebuild's caller gets here first: its task's context
    // names the contract before it answers.
    gateway.remember_context(&task.context_id, contract_id);
    if !rebuilt {
        return Ok(slot);
    }
    tracing::info!(task = %ext::echoed(task_id), contract = %hex::encode(contract_id), "task found again after a restart");
    if !progress.ended {
        tokio::spawn(follow(
            gateway.clone(),
            slot.clone(),
            task_id.to_owned(),
            None,
            None,
        ));
    }
    Ok(slot)
}

pub(super) fn new_slot(
    gateway: &Gateway,
    contract_id: Id,
    tenant: String,
    deadline_ms: i64,
    progress: ext::Progress,
    trace: Option<String>,
) -> Arc<Slot> {
    // Only a streaming agent's events are relayed: the others' slots keep
    // no ring of them.
    let events_buffer = if gateway.streams_upstream() {
        crate::stream::EVENTS_BUFFER
    } else {
        1
    };
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
        events: tokio::sync::broadcast::Sender::new(events_buffer),
        status: tokio::sync::watch::Sender::new(None),
        watched: std::sync::atomic::AtomicBool::new(false),
    })
}

fn state_of(task: &a2a::Task) -> TaskState {
    task.status
        .as_ref()
        .and_then(|s| TaskState::try_from(s.state).ok())
        .unwrap_or(TaskState::Unspecified)
}

pub(super) fn settled(task: &a2a::Task) -> bool {
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
pub(super) async fn observe(
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
            ext::Step::Escalate { reason } | ext::Step::Decline { reason } => {
                let ending = match step {
                    ext::Step::Escalate { .. } => broker::Ending::Escalate,
                    _ => broker::Ending::Decline,
                };
                let trace = slot.trace.as_deref();
                broker::end(gateway, trace, ending, &id, reason.clone()).await
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
/// by its first read (`first_read`, a task started by a unary SendMessage)
/// when that finds it settled, else by the agent's own stream of the task
/// when it streams (`upstream`, the stream the task was started with, else
/// SubscribeToTask), else (or when that stream fails) by reading the task
/// every poll_ms; either way the task is canceled when the contract is
/// revoked or expires, or its deadline passes.
pub(super) async fn follow(
    gateway: Arc<Gateway>,
    slot: Arc<Slot>,
    task_id: String,
    upstream: Option<crate::stream::Events>,
    first_read: Option<FirstRead>,
) {
    gateway.metrics.followed.inc();
    let mut canceled_at = None;
    let streams = upstream.is_some() || gateway.streams_upstream();
    let read_first = first_read.is_some();
    let first_settled = match first_read {
        Some(first) => read_settled(&gateway, &slot, &task_id, first).await,
        // Settled in the agent's answer, its contract moved already.
        None => moved_settled(&slot).await,
    };
    // A task settled by its first read (a quick agent's) needs no word of
    // its contract: watched only from here on, so it costs the broker no
    // read at the add and none at the scans after its commits. A
    // revocation meanwhile is not missed: an add is answered with the
    // contract's state of that moment.
    if !first_settled {
        watch(&gateway, &slot);
    }
    let done = first_settled
        || (streams && by_stream(&gateway, &slot, &task_id, upstream, &mut canceled_at).await);
    if !done {
        // After a stream tried since the first read, that read is old: a
        // quick agent refuses a stream of a task it finished meanwhile,
        // so the task is read again at once, not a poll_ms later.
        let read_just_now = read_first && !streams;
        following(&gateway, &slot, &task_id, &mut canceled_at, read_just_now).await;
    }
    // Whether or not this follower added it: a stream opened again
    // meanwhile watches every unfinished task's contract
    // (`watcher::Followers::followed`), and a Remove of a contract the
    // stream never sent costs nothing (`broker_client::watch`).
    gateway.watch(broker_client::watch::Change::Remove(slot.contract_id));
    gateway.metrics.followed.dec();
    // Callers still waiting for the task are answered with what is known.
    slot.finished
        .store(true, std::sync::atomic::Ordering::Release);
    slot.latest.send_modify(|_| {});
}

/// Starts watching the slot's contract on the gateway's WatchContracts
/// stream (when the add cannot be queued, the follower reads the contract
/// instead).
fn watch(gateway: &Gateway, slot: &Slot) {
    // Marked before the add is sent: the watcher's "not watched" (past its
    // bound) must be the last word, or the follower would wait for states
    // that never come.
    slot.watched
        .store(true, std::sync::atomic::Ordering::Release);
    let queued = gateway.watch(broker_client::watch::Change::Add(slot.contract_id));
    if queued {
        gateway.metrics.watched.inc();
    } else {
        slot.watched
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// What a look at the contract decided.
enum Look {
    /// The task settled and its contract moved, or a cancel went
    /// unanswered too long: the follower stops.
    Stop,
    /// The task was canceled for its contract just now.
    Canceled,
    /// Go on reading the task.
    Read,
}

/// Stops once the task settled and its contract moved; cancels the task
/// once its contract is revoked or expired (as the gateway's contract
/// stream says, else read from the broker) or its deadline passed, then
/// reads it for at most CANCEL_GRACE_MS.
async fn look(
    gateway: &Gateway,
    slot: &Slot,
    task_id: &str,
    canceled_at: &mut Option<tokio::time::Instant>,
) -> Look {
    if moved_settled(slot).await {
        return Look::Stop;
    }
    if let Some(at) = canceled_at {
        if at.elapsed() > Duration::from_millis(CANCEL_GRACE_MS) {
            tracing::warn!(task = %task_id, "the agent's task did not settle after its cancel");
            return Look::Stop;
        }
        return Look::Read;
    }
    let expired = now_ms() >= slot.deadline_ms;
    let revoked = match gateway.broker_status(slot).await {
        Ok(None) => false,
        Ok(Some(status)) => matches!(
            pb::ContractStatus::try_from(status),
            Ok(pb::ContractStatus::Revoked | pb::ContractStatus::Expired)
        ),
        Err(_) => false,
    };
    if !(expired || revoked) {
        return Look::Read;
    }
    let why = if revoked {
        "revoked"
    } else {
        "past its deadline"
    };
    tracing::info!(task = %task_id, contract = %hex::encode(slot.contract_id), why, "canceling the agent's task");
    cancel_at_agent(gateway, task_id, canceled_at).await;
    Look::Canceled
}

/// Asks the agent to cancel its task and notes when (the follower then
/// reads it for at most CANCEL_GRACE_MS).
async fn cancel_at_agent(
    gateway: &Gateway,
    task_id: &str,
    canceled_at: &mut Option<tokio::time::Instant>,
) {
    let cancel = a2a::CancelTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    let canceled: Result<a2a::Task, _> = gateway.upstream_call("CancelTask", &cancel, &[]).await;
    if let Err(CallError::Remote(error)) = &canceled {
        tracing::warn!(task = %task_id, %error, "the agent refused to cancel its task");
    }
    *canceled_at = Some(tokio::time::Instant::now());
}

/// A task the agent grew past max_message_bytes could not be read,
/// relayed or completed with its output (polling it would fail on every
/// read): it ends as a failed task, its artifacts dropped and the reason
/// in its status (the contract moves as for any failed task), and it is
/// canceled at the agent. True once the contract has moved.
async fn over_bound(
    gateway: &Arc<Gateway>,
    slot: &Arc<Slot>,
    task: &a2a::Task,
    why: &str,
    canceled_at: &mut Option<tokio::time::Instant>,
) -> bool {
    tracing::warn!(task = %task.id, error = %why, "the agent's task is too large: failed, and canceled at the agent");
    let failed = a2a::Task {
        id: task.id.clone(),
        context_id: task.context_id.clone(),
        status: Some(a2a::TaskStatus {
            state: TaskState::Failed as i32,
            message: Some(a2a::Message {
                message_id: format!("gateway-too-large-{}", hex::encode(slot.contract_id)),
                context_id: task.context_id.clone(),
                task_id: task.id.clone(),
                role: a2a::Role::Agent as i32,
                parts: vec![a2a::Part {
                    content: Some(a2a::part::Content::Text(why.to_owned())),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    moved(gateway, slot, failed).await;
    cancel_at_agent(gateway, &task.id, canceled_at).await;
    moved_settled(slot).await
}

/// Polls the agent's task every poll_ms (see `follow`).
async fn following(
    gateway: &Arc<Gateway>,
    slot: &Arc<Slot>,
    task_id: &str,
    canceled_at: &mut Option<tokio::time::Instant>,
    read_just_now: bool,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(gateway.config.poll_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if read_just_now {
        // The first read has just been made: the next is a period away.
        tick.reset();
    }
    let get = a2a::GetTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    let mut status = slot.status.subscribe();
    loop {
        // A status the contract stream brings is looked at at once.
        tokio::select! {
            _ = tick.tick() => {}
            _ = status.changed() => {}
        }
        match look(gateway, slot, task_id, canceled_at).await {
            Look::Stop => return,
            Look::Canceled => continue,
            Look::Read => {}
        }
        match gateway.upstream_call("GetTask", &get, &[]).await {
            Ok(task) => moved(gateway, slot, task).await,
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

/// The first read of a task started by a unary SendMessage, sent as soon
/// as the agent answered: a quick agent has finished the task by then
/// (and refuses a stream of a finished task), and the read travels while
/// the first state moves the contract (Accept).
pub(super) type FirstRead = tokio::task::JoinHandle<Result<a2a::Task, CallError>>;

/// Sends the first read of `task_id` (see `FirstRead`).
pub(super) fn first_read(gateway: &Arc<Gateway>, task_id: &str) -> FirstRead {
    let gateway = gateway.clone();
    let get = a2a::GetTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    tokio::spawn(async move { gateway.upstream_call("GetTask", &get, &[]).await })
}

/// Moves the contract with the task the first read brought; true when
/// that settled it.
async fn read_settled(
    gateway: &Arc<Gateway>,
    slot: &Arc<Slot>,
    task_id: &str,
    first: FirstRead,
) -> bool {
    match first.await {
        Ok(Ok(task)) => moved(gateway, slot, task).await,
        Ok(Err(e)) => {
            tracing::debug!(task = %task_id, error = ?e, "the first read of the agent's task failed; following it");
            return false;
        }
        Err(e) => {
            tracing::warn!(task = %task_id, error = %e, "the first read of the agent's task stopped; following it");
            return false;
        }
    }
    moved_settled(slot).await
}

/// The task has settled and its contract has moved with it.
async fn moved_settled(slot: &Slot) -> bool {
    let ended = slot.progress.lock().await.0.ended;
    ended && slot.latest.borrow().as_ref().is_some_and(settled)
}

/// Moves the contract with a task the agent sent; callers' streams (an
/// agent whose stream failed) get the task whenever its state moves. A
/// failed move is logged: the next read tries again.
async fn moved(gateway: &Arc<Gateway>, slot: &Arc<Slot>, task: a2a::Task) {
    let task_id = task.id.clone();
    let before = slot.latest.borrow().as_ref().map(state_of);
    match observe(gateway, slot, task).await {
        Ok(task) if before != Some(state_of(&task)) => {
            let _ = slot.events.send(Arc::new(crate::stream::task_event(task)));
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(task = %task_id, error = %e.message, "moving the contract failed; trying again");
        }
    }
}

/// Follows a streaming agent's task by its SubscribeToTask stream: each
/// event moves the contract (observe) and reaches the callers' streams
/// with the broker's word; the agent is never polled, and the contract is
/// looked at every poll_ms. False when the stream could not be opened or
/// ended before the task settled: the caller polls from there.
async fn by_stream(
    gateway: &Arc<Gateway>,
    slot: &Arc<Slot>,
    task_id: &str,
    upstream: Option<crate::stream::Events>,
    canceled_at: &mut Option<tokio::time::Instant>,
) -> bool {
    use tokio_stream::StreamExt as _;
    let subscribe = a2a::SubscribeToTaskRequest {
        id: task_id.to_owned(),
        ..Default::default()
    };
    let opened = match upstream {
        Some(events) => Ok(events),
        None => {
            gateway
                .upstream_stream("SubscribeToTask", &subscribe, &[])
                .await
        }
    };
    let mut events = match opened {
        Ok(events) => events,
        Err(e) => {
            tracing::info!(task = %task_id, error = ?e, "the agent's task stream could not be opened; polling it");
            return false;
        }
    };
    let mut task = slot.latest.borrow().clone().unwrap_or_default();
    let mut bound = crate::stream::FoldBound::new(gateway.config.max_message_bytes, &task);
    let mut tick = tokio::time::interval(Duration::from_millis(gateway.config.poll_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut status = slot.status.subscribe();
    loop {
        tokio::select! {
            _ = status.changed() => {
                if let Look::Stop = look(gateway, slot, task_id, canceled_at).await {
                    return true;
                }
            }
            event = events.next() => match event {
                Some(Ok(event)) => {
                    crate::stream::fold(&mut task, &event);
                    if let Err(e) = bound.check(&task, &event) {
                        return over_bound(gateway, slot, &task, &e.message, canceled_at).await;
                    }
                    match observe(gateway, slot, task.clone()).await {
                        Ok(decorated) => {
                            let _ = slot.events.send(Arc::new(crate::stream::relayed(event, &decorated)));
                        }
                        Err(e) => {
                            tracing::warn!(task = %task_id, error = %e.message, "moving the contract failed; trying again");
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(task = %task_id, error = ?e, "the agent's task stream failed; polling it");
                    return false;
                }
                None => return moved_settled(slot).await,
            },
            _ = tick.tick() => {
                if let Look::Stop = look(gateway, slot, task_id, canceled_at).await {
                    return true;
                }
            }
        }
    }
}

/// A caller's stream of an admitted task: `first`, the task as it was when
/// `events` subscribed (with the broker's word), then each event the
/// follower relays from that moment, until one leaves
/// the task settled or the follower stops (then the task as last seen).
/// A caller too slow for `stream::EVENTS_BUFFER` events gets the task
/// whole and goes on.
pub(super) fn events_of(
    slot: Arc<Slot>,
    first: Option<a2a::Task>,
    mut events: tokio::sync::broadcast::Receiver<Arc<a2a::StreamResponse>>,
) -> crate::stream::Events {
    use crate::stream::{ends, task_event};
    use tokio::sync::broadcast::error::RecvError;
    let mut latest = slot.latest.subscribe();
    latest.mark_unchanged();
    let (tx, rx) = tokio::sync::mpsc::channel(STREAM_AHEAD);
    tokio::spawn(async move {
        let finished = || slot.finished.load(std::sync::atomic::Ordering::Acquire);
        if let Some(task) = first {
            let event = task_event(task);
            let end = ends(&event) && slot.progress.lock().await.0.ended;
            if tx.send(Ok(event)).await.is_err() || end {
                return;
            }
        }
        if finished() {
            // Its follower had stopped already: nothing more will come.
            return;
        }
        loop {
            tokio::select! {
                event = events.recv() => {
                    let event = match event {
                        Ok(event) => Arc::unwrap_or_clone(event),
                        Err(RecvError::Lagged(_)) => {
                            // Behind: from now on, after the task whole.
                            events = slot.events.subscribe();
                            let task = latest.borrow_and_update().clone();
                            match task {
                                Some(task) => task_event(task),
                                None => continue,
                            }
                        }
                        Err(RecvError::Closed) => return,
                    };
                    let end = ends(&event);
                    if tx.send(Ok(event)).await.is_err() || end {
                        return;
                    }
                }
                changed = latest.changed() => {
                    if changed.is_err() || finished() {
                        // The follower stopped: what is known, and the end.
                        let task = latest.borrow_and_update().clone();
                        if let Some(task) = task {
                            let _ = tx.send(Ok(task_event(task))).await;
                        }
                        return;
                    }
                }
                () = tx.closed() => return,
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// At start: follows again the tasks of contracts this agent holds
/// ACCEPTED (a previous run admitted them), found in the agent's own task
/// list by the contract each task's first message was marked with. Tasks
/// nobody asks about still reach their Complete.
pub(crate) async fn recover(gateway: Arc<Gateway>) {
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
