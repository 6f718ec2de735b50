//! The egress: the fronted agent's outbound A2A client points here, one
//! base URL per peer (`/peers/<name>`). A task-starting message becomes a
//! broker Delegate from the contract the agent holds for the message's
//! context; a refusal is an A2A error listing every violated invariant,
//! and nothing reaches the peer. An issued contract's chain rides in the
//! forwarded message (ext::attach_chain). Canceling a task sent this way
//! revokes its contract first: the peer's gateway cancels the task on it.

use std::sync::Arc;

use a2a_pb::protojson as a2a;
use serde_json::Value;

use crate::card::gateway_card;
use crate::client::CallError;
use crate::config::{self, Peer};
use crate::ext::{self, Refused, code, echoed};
use crate::gateway::MAX_CONTRACTS_PER_CONTEXT;
use crate::stream::Events;
use crate::{Gateway, Rpc, Sent, broker, broker_error, now_ms, params, passed_headers};
use broker_domain::Id;
use broker_wire::pb;

/// Most contracts listed when the parent is ambiguous: the gateway's own
/// bound, enough for the agent (or a person) to pick one from an error.
const MAX_HELD_LISTED: u32 = 10;
/// Events of a peer's stream read ahead of the agent reading them.
const EGRESS_STREAM_AHEAD: usize = 16;
/// Most tasks remembered as sent (for GetTask and CancelTask): the
/// gateway's own bound on that memory.
const MAX_SENT: usize = 65_536;

fn peer<'a>(gateway: &'a Gateway, name: &str) -> Result<&'a Peer, Refused> {
    gateway.config.peer(name).ok_or_else(|| {
        Refused::new(
            code::TASK_NOT_FOUND,
            "NOT_FOUND",
            format!(
                "no agent named {:?} in this gateway's address book",
                broker_client::names::cut(name, config::MAX_PEER_NAME_BYTES)
            ),
        )
    })
}

/// A peer's card as the agent sees it: served from this egress.
pub(super) async fn card(gateway: &Gateway, name: &str) -> Result<a2a::AgentCard, Refused> {
    let peer = peer(gateway, name)?;
    let card = gateway.http.card(&peer.url).await?;
    let url = format!("{}/peers/{name}/", gateway.addresses.egress_url);
    let grpc = gateway
        .addresses
        .egress_grpc_url
        .as_deref()
        .map(|url| (url, name));
    Ok(gateway_card(
        card,
        &url,
        grpc,
        &peer.public_key().unwrap_or_default(),
    ))
}

pub(super) async fn handle(
    gateway: &Arc<Gateway>,
    name: &str,
    rpc: &Rpc,
) -> Result<Value, CallError> {
    let peer = peer(gateway, name)?;
    let headers = passed_headers(rpc);
    match rpc.method.as_str() {
        "SendMessage" => send(gateway, peer, rpc, headers).await,
        "GetTask" => {
            let mut request: a2a::GetTaskRequest = params(rpc)?;
            // The tenant named the peer here; it means nothing there.
            request.tenant.clear();
            let sent = sent_to(gateway, peer, &request.id)?;
            let headers = with_token(gateway, peer, &sent.parent_id, headers).await?;
            gateway
                .http
                .call(&peer.url, "GetTask", &request, &headers)
                .await
        }
        "CancelTask" => {
            let mut request: a2a::CancelTaskRequest = params(rpc)?;
            request.tenant.clear();
            let sent = sent_to(gateway, peer, &request.id)?;
            // The principal's signed Revoke is what cancels: the peer's
            // gateway cancels the task when it sees the contract revoked.
            match broker::end(
                gateway,
                rpc.trace.as_deref(),
                broker::Ending::Revoke,
                &sent.contract_id,
                "canceled by the principal over A2A".into(),
            )
            .await
            {
                Ok(_) => {}
                Err(e) if matches!(e.reason.as_str(), "ENDED" | "WRONG_STATE") => {}
                Err(e) => return Err(broker_error(e).into()),
            }
            // Only the peer's call needs the token: the revocation above
            // never waits on the token endpoint.
            let headers = with_token(gateway, peer, &sent.parent_id, headers).await?;
            gateway
                .http
                .call(&peer.url, "CancelTask", &request, &headers)
                .await
        }
        other => Err(Refused::new(
            code::METHOD_NOT_FOUND,
            "INVALID_FIELD",
            format!("{other}: not served"),
        )
        .into()),
    }
}

/// `headers`, and the peer's token for a call made under `contract` when
/// its route asks for one (`bearer`).
async fn with_token(
    gateway: &Gateway,
    peer: &Peer,
    contract: &Id,
    mut headers: Vec<(http::HeaderName, http::HeaderValue)>,
) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, Refused> {
    if let Some(token) = gateway.peer_tokens.get(&peer.name) {
        headers.push(token.header(&gateway.link.agent, contract).await?);
    }
    Ok(headers)
}

fn sent_to(gateway: &Gateway, peer: &Peer, task_id: &str) -> Result<Sent, Refused> {
    let sent = gateway.sent.lock().unwrap_or_else(|e| e.into_inner());
    sent.get(task_id)
        .filter(|s| s.peer == peer.name)
        .cloned()
        .ok_or_else(|| {
            Refused::new(
                code::TASK_NOT_FOUND,
                "NOT_FOUND",
                format!(
                    "task {:?} was not sent to {} through this gateway",
                    echoed(task_id),
                    peer.name
                ),
            )
        })
}

/// The contract a message to a peer is delegated from.
async fn parent_of(
    gateway: &Gateway,
    named: Option<Vec<u8>>,
    context_id: &str,
) -> Result<Id, Refused> {
    if let Some(id) = named {
        return id.try_into().map_err(|_| {
            Refused::new(
                code::INVALID_PARAMS,
                "INVALID_FIELD",
                format!("contractId must be {} bytes", std::mem::size_of::<Id>()),
            )
        });
    }
    let known = {
        let admitted = gateway.admitted.lock().unwrap_or_else(|e| e.into_inner());
        admitted
            .contexts
            .get(context_id)
            .map(|c| (c.contracts.clone(), c.overflowed))
    };
    if let Some((contracts, overflowed)) = known {
        return parent_in_context(gateway, context_id, contracts, overflowed).await;
    }
    let held = gateway
        .link
        .held(pb::HeldRole::Delegate, MAX_HELD_LISTED)
        .await
        .map_err(broker_error)?;
    match held.contracts.as_slice() {
        [only] if held.next_page_token.is_empty() => only
            .contract_id
            .clone()
            .try_into()
            .map_err(|_| Refused::new(code::INTERNAL, "INTERNAL", "ListHeld answered a bad id")),
        [] => Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_FOUND",
            format!(
                "this agent holds no open contract to delegate from (context {:?} is not one of a task it was given)",
                echoed(context_id)
            ),
        )),
        several => Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_FOUND",
            format!(
                "this agent holds several open contracts ({}{}) and context {:?} names none: send the message in the context of the task it works for, or set message.metadata[{}].contractId",
                several
                    .iter()
                    .map(|c| hex::encode(&c.contract_id))
                    .collect::<Vec<_>>()
                    .join(", "),
                if held.next_page_token.is_empty() {
                    ""
                } else {
                    ", …"
                },
                echoed(context_id),
                ext::URI
            ),
        )),
    }
}

/// The parent a context names: its one live contract. Context ids are
/// the callers' to choose, so a second caller may start a task in the
/// first one's context; a context with more than one live contract names
/// none (the message must name its contract), so one caller's contract
/// never becomes the parent of another's sub-tasks.
async fn parent_in_context(
    gateway: &Gateway,
    context_id: &str,
    contracts: Vec<Id>,
    overflowed: bool,
) -> Result<Id, Refused> {
    if let ([only], false) = (contracts.as_slice(), overflowed) {
        // One caller's context: the broker refuses a Delegate from it
        // once it has ended.
        return Ok(*only);
    }
    let mut live = Vec::new();
    if !overflowed {
        for id in contracts {
            let status = gateway.contract(&id).await?.status;
            if matches!(
                pb::ContractStatus::try_from(status),
                Ok(pb::ContractStatus::Open | pb::ContractStatus::Accepted)
            ) {
                live.push(id);
            }
        }
    }
    match live.as_slice() {
        [only] => Ok(*only),
        [] if !overflowed => Err(Refused::new(
            code::INVALID_PARAMS,
            "ENDED",
            format!(
                "every contract of context {:?} has ended: a new task needs a new contract",
                echoed(context_id)
            ),
        )),
        several => Err(Refused::new(
            code::INVALID_PARAMS,
            "NOT_FOUND",
            format!(
                "context {:?} holds tasks of several callers' contracts ({}): set message.metadata[{}].contractId to the contract of the task this message works for",
                echoed(context_id),
                if overflowed {
                    format!("more than {}", MAX_CONTRACTS_PER_CONTEXT)
                } else {
                    several
                        .iter()
                        .map(hex::encode)
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                ext::URI
            ),
        )),
    }
}

fn missing_term(peer: &str, term: &str, route_keys: &str) -> Refused {
    let field = format!("message.metadata[{}].terms.{term}", ext::URI);
    Refused::new(
        code::INVALID_PARAMS,
        "INVALID_FIELD",
        format!("no {term} for a delegation to {peer}: set {field}, or {route_keys} in routes.{peer} of the gateway's config"),
    )
    .with("field", field)
}

/// A message to a peer, ready to go: its request (a task-starting one
/// carrying its new contract's chain), the headers it goes with, and the
/// contract delegated for it with its parent (none for a message in a
/// task already delegated).
struct Prepared {
    request: a2a::SendMessageRequest,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    delegated: Option<(Id, Id)>,
}

/// A SendMessage to a peer: a message in a task already delegated goes on
/// under its contract; a task-starting one is delegated from its parent
/// first, and goes to the peer with the new contract's chain.
async fn send(
    gateway: &Arc<Gateway>,
    peer: &Peer,
    rpc: &Rpc,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
) -> Result<Value, CallError> {
    let started = std::time::Instant::now();
    let prepared = prepare(gateway, peer, rpc, headers).await?;
    let answer: Result<a2a::SendMessageResponse, CallError> = gateway
        .http
        .call(
            &peer.url,
            "SendMessage",
            &prepared.request,
            &prepared.headers,
        )
        .await;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "egress: peer answered"
    );
    let response = match (answer, prepared.delegated) {
        (Err(error), Some((child_id, _))) => {
            unstarted(gateway, rpc.trace.as_deref(), child_id).await;
            return Err(error);
        }
        (answer, delegated) => {
            let response = answer?;
            if let (
                Some((child_id, parent_id)),
                Some(a2a::send_message_response::Payload::Task(task)),
            ) = (delegated, &response.payload)
            {
                remember_sent(gateway, &peer.name, &task.id, child_id, parent_id);
            }
            response
        }
    };
    serde_json::to_value(&response).map_err(|e| {
        Refused::new(
            code::INTERNAL,
            "INTERNAL",
            format!("encoding the answer: {e}"),
        )
        .into()
    })
}

/// A SendStreamingMessage or SubscribeToTask to a peer: delegated as
/// SendMessage is, then the peer's events relayed as its gateway sent
/// them (with the broker's word on them).
pub(super) async fn open(
    gateway: &Arc<Gateway>,
    name: &str,
    rpc: &Rpc,
) -> Result<Events, CallError> {
    let peer = peer(gateway, name)?;
    let headers = passed_headers(rpc);
    if rpc.method == "SubscribeToTask" {
        let mut request: a2a::SubscribeToTaskRequest = params(rpc)?;
        request.tenant.clear();
        let sent = sent_to(gateway, peer, &request.id)?;
        let headers = with_token(gateway, peer, &sent.parent_id, headers).await?;
        return gateway
            .http
            .stream(&peer.url, "SubscribeToTask", &request, &headers)
            .await;
    }
    let prepared = prepare(gateway, peer, rpc, headers).await?;
    let events = gateway
        .http
        .stream(
            &peer.url,
            "SendStreamingMessage",
            &prepared.request,
            &prepared.headers,
        )
        .await;
    let Some((child_id, parent_id)) = prepared.delegated else {
        return events;
    };
    let events = match events {
        Ok(events) => events,
        Err(error) => {
            unstarted(gateway, rpc.trace.as_deref(), child_id).await;
            return Err(error);
        }
    };
    // The task is remembered from the first event about it, for the
    // agent's GetTask, CancelTask and SubscribeToTask of it; a stream
    // that fails or ends before any (or whose reader leaves first) never
    // started a task, and its contract is released.
    let (gateway, peer_name, trace) = (gateway.clone(), peer.name.clone(), rpc.trace.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(EGRESS_STREAM_AHEAD);
    tokio::spawn(async move {
        use tokio_stream::StreamExt as _;
        let mut events = events;
        let mut remembered = false;
        loop {
            // A reader that left ends the relay at once: a peer sending
            // only comments would otherwise hold it, and its connection.
            let event = tokio::select! {
                () = tx.closed() => break,
                event = events.next() => match event {
                    Some(event) => event,
                    None => break,
                },
            };
            let failed = event.is_err();
            // Nothing follows a final state or a message.
            let ends = event.as_ref().is_ok_and(crate::stream::ends);
            if let Ok(event) = &event
                && !remembered
                && !matches!(
                    event.payload,
                    Some(a2a::stream_response::Payload::Message(_))
                )
                && let Some(task_id) = crate::stream::task_id_of(event)
            {
                remember_sent(&gateway, &peer_name, task_id, child_id, parent_id);
                remembered = true;
            }
            if tx.send(event).await.is_err() || failed || ends {
                break;
            }
        }
        if !remembered {
            unstarted(&gateway, trace.as_deref(), child_id).await;
        }
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// The task never started: releases what its contract reserved.
async fn unstarted(gateway: &Gateway, trace: Option<&str>, child_id: Id) {
    if let Err(e) = broker::end(
        gateway,
        trace,
        broker::Ending::Revoke,
        &child_id,
        "the peer did not take the task".into(),
    )
    .await
    {
        tracing::warn!(contract = %hex::encode(child_id), reason = %e.reason, "revoking an unstarted contract failed");
    }
}

/// A message to a peer made ready (see `Prepared`): a task-starting one is
/// delegated (its token minted first) and carries the new chain.
async fn prepare(
    gateway: &Arc<Gateway>,
    peer: &Peer,
    rpc: &Rpc,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
) -> Result<Prepared, CallError> {
    let mut request: a2a::SendMessageRequest = params(rpc)?;
    request.tenant.clear();
    let message = request.message.as_mut().ok_or_else(|| {
        Refused::new(code::INVALID_PARAMS, "INVALID_FIELD", "message is required")
            .with("field", "message")
    })?;
    crate::ingress::check_size(message)?;
    let outbound = ext::outbound(ext::take(message)?)?;
    if !message.task_id.is_empty() {
        // A message in a task already delegated: its contract goes on.
        let sent = sent_to(gateway, peer, &message.task_id)?;
        let headers = with_token(gateway, peer, &sent.parent_id, headers).await?;
        return Ok(Prepared {
            request,
            headers,
            delegated: None,
        });
    }
    let started = std::time::Instant::now();
    let body = delegate_body(gateway, peer, outbound, message).await?;
    let parent_id: Id = body.parent_id.as_slice().try_into().map_err(|_| {
        Refused::new(
            code::INTERNAL,
            "INTERNAL",
            "a parent id of the wrong length",
        )
    })?;
    // Minted before the Delegate: a token that cannot be had leaves no
    // contract to release.
    let headers = with_token(gateway, peer, &parent_id, headers).await?;
    let (child_id, issued) = delegate(gateway, peer, rpc, body).await?;
    tracing::debug!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "egress: delegated"
    );
    let chain = match gateway.chain_below(&parent_id, issued).await {
        Ok(chain) => chain,
        Err(e) => {
            // Issued but never sent: its reservation goes back now.
            unstarted(gateway, rpc.trace.as_deref(), child_id).await;
            return Err(broker_error(e).into());
        }
    };
    if let Some(message) = request.message.as_mut() {
        ext::attach_chain(message, &chain);
    }
    Ok(Prepared {
        request,
        headers,
        delegated: Some((child_id, parent_id)),
    })
}

/// The Delegate a task-starting message to `peer` asks for: from the
/// parent the message names (or its context does, or the one contract the
/// agent holds), on the message's terms, else the route's, else derived
/// from the parent.
async fn delegate_body(
    gateway: &Gateway,
    peer: &Peer,
    outbound: ext::Outbound,
    message: &a2a::Message,
) -> Result<pb::DelegateBody, Refused> {
    let parent_id = parent_of(gateway, outbound.contract_id, &message.context_id).await?;
    let route = gateway
        .config
        .routes
        .get(&peer.name)
        .cloned()
        .unwrap_or_default();
    let terms = outbound.terms;
    // Only a budget_share needs the parent's residual now; its terms never
    // change, so they are read once (`Gateway::terms_of`).
    let share = match (terms.budget.or(route.budget), route.budget_share) {
        (None, Some(share)) => Some(share),
        _ => None,
    };
    let (parent_contract, residual) = match share {
        Some(_) => {
            let parent = gateway.contract(&parent_id).await?;
            let residual = parent.ledger.as_ref().map_or(0, |l| l.residual);
            (gateway.terms_of(&parent_id, Some(&parent)).await?, residual)
        }
        None => (gateway.terms_of(&parent_id, None).await?, 0),
    };
    let budget = terms
        .budget
        .or(route.budget)
        .or_else(|| share.map(|share| (residual as f64 * share).floor() as i64))
        .ok_or_else(|| missing_term(&peer.name, "budget", "budget or budget_share"))?;
    let deadline_ms = match terms.ttl_ms.or(route.ttl_ms) {
        Some(ttl_ms) => now_ms().saturating_add(ttl_ms),
        None => parent_contract
            .deadline_ms
            .saturating_sub(route.deadline_margin_ms.unwrap_or(0)),
    };
    let task = terms
        .task
        .or(route.task)
        .or_else(|| ext::first_text(&message.parts, ext::MAX_TASK_TEXT_BYTES))
        .unwrap_or_else(|| format!("an A2A task for {}", peer.name));
    Ok(pb::DelegateBody {
        // Link::call signs it with the agent's header.
        header: None,
        parent_id: parent_id.to_vec(),
        intent_lineage_hash: parent_contract.intent_lineage_hash.clone(),
        task,
        delegate_public_key: peer.public_key().unwrap_or_default().to_vec(),
        delegate_attestation: None,
        budget,
        deadline_ms,
        liability: pb::Liability::Principal as i32,
        predicate: terms.predicate.or(route.predicate).unwrap_or_default(),
        escalation_channel: String::new(),
        min_retry_cost: terms.min_retry_cost.unwrap_or(0),
        min_retry_latency_ms: terms.min_retry_latency_ms.unwrap_or(0),
        write_scope: terms.write_scope.or(route.write_scope).unwrap_or_default(),
        host_public_key: Vec::new(),
        result_schema_json: terms
            .result_schema_json
            .or(route.result_schema_json)
            .unwrap_or_default(),
    })
}

/// Asks the broker for the contract; its id and the issued contract, else
/// the refusal listing every violated invariant.
async fn delegate(
    gateway: &Gateway,
    peer: &Peer,
    rpc: &Rpc,
    body: pb::DelegateBody,
) -> Result<(Id, pb::IssuedContract), Refused> {
    let response = broker::delegate(gateway, rpc.trace.as_deref(), body)
        .await
        .map_err(broker_error)?;
    match response.outcome {
        Some(pb::delegate_response::Outcome::Issued(issued)) => {
            let id = issued.contract_id.as_slice().try_into().map_err(|_| {
                Refused::new(
                    code::INTERNAL,
                    "INTERNAL",
                    "Delegate answered a bad contract id",
                )
            })?;
            Ok((id, issued))
        }
        Some(pb::delegate_response::Outcome::Refused(refused)) => {
            let receipt = broker::receipt(refused.receipt.as_ref()).unwrap_or_default();
            tracing::info!(peer = %peer.name, primary = receipt.primary, "delegation refused");
            Err(ext::refusal(&receipt, &refused.receipt_id))
        }
        None => Err(Refused::new(
            code::INTERNAL,
            "INTERNAL",
            "Delegate answered neither issued nor refused",
        )),
    }
}

/// Remembers a task sent to `peer` under `contract_id`, for its GetTask
/// and CancelTask (at most MAX_SENT: past it, an arbitrary one is
/// dropped).
fn remember_sent(gateway: &Gateway, peer: &str, task_id: &str, contract_id: Id, parent_id: Id) {
    let mut sent = gateway.sent.lock().unwrap_or_else(|e| e.into_inner());
    if sent.len() >= MAX_SENT
        && let Some(key) = sent.keys().next().cloned()
    {
        sent.remove(&key);
    }
    sent.insert(
        task_id.to_owned(),
        Sent {
            peer: peer.to_owned(),
            contract_id,
            parent_id,
        },
    );
}
