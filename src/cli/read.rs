//! `session`, `get`, `children`, `watch`, `receipt`: reading the broker
//! from a terminal, as `zed` or `fga` do beside SpiceDB or OpenFGA. Each
//! reads as one key (`--key-file`, through a session it opens) and prints
//! text for people or, with `--json`, objects for scripts (one per line
//! where the output streams). This module owns the commands' arguments,
//! the parsing of ids (hex or base64), the bounds of every read and the
//! two renderings; `tree` (tree.rs) draws a whole subtree and lends its
//! helpers for dates, trust and terminal-safe text.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use base64::Engine as _;
use clap::Args;
use prost::Message;
use serde_json::{Map, Value, json};

use super::tree::{ppm, rfc3339, safe, short};
use crate::crypto::{self, payload_type};
use crate::pb;

/// Where to read and as whom: what every reading command takes.
#[derive(Args, Debug, Clone)]
pub struct ReadArgs {
    /// Broker address, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// The key to read as: a file holding its secret seed in hex, as
    /// `keygen` writes it. A reader key listed under [readers] in the
    /// broker's configuration reads every tree, any other key the trees it
    /// is a party of.
    #[arg(long, env = "BROKER_KEY_FILE")]
    pub key_file: std::path::PathBuf,
}

#[derive(Args, Debug, Clone)]
#[command(after_help = SESSION_HELP)]
pub struct SessionArgs {
    #[command(flatten)]
    pub read: ReadArgs,
}

const SESSION_HELP: &str = "\
Prints one line, `x-broker-session-bin: <base64>`, the header every read
needs (grpcurl base64-decodes the values of `-bin` headers), e.g.:

  grpcurl -plaintext -H \"$(delegation-broker session --key-file reader.key)\" \\
    -d '{\"contract_id\": \"<base64 id>\"}' \\
    127.0.0.1:50051 delegation.broker.v1.Broker/GetContract

Its expiry goes to stderr; open a new one before then.";

#[derive(Args, Debug, Clone)]
pub struct GetArgs {
    /// The contract's id: 64 hex digits, or base64 (standard or URL-safe,
    /// padded or not, as grpcurl prints bytes). URL-safe base64 may begin
    /// with `-`: read as the id, not as an option.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// One JSON object instead of text (snake_case fields, bytes as hex).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub read: ReadArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ChildrenArgs {
    /// The parent's id: 64 hex digits, or base64 (may begin with `-`).
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// Most children printed (in issuance order); a note on stderr says
    /// when there are more.
    #[arg(long, default_value_t = DEFAULT_CHILDREN_LISTED,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_CHILDREN_LISTED)))]
    pub max: u32,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub read: ReadArgs,
}

#[derive(Args, Debug, Clone)]
pub struct WatchArgs {
    /// The contract whose subtree to watch (a root for its whole tree): 64
    /// hex digits, or base64 (may begin with `-`).
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// Only events after this cursor (the first number of the last line
    /// seen), to resume; 0 for every stored event.
    #[arg(long, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=i64::MAX as u64))]
    pub cursor: u64,
    /// Stop after this many events (exit 0); without it, run until
    /// interrupted or the broker ends the stream.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_events: Option<u64>,
    /// One JSON object per line instead of text (the cursor as a decimal
    /// string, as ProtoJSON has it: cursors may pass 2^53).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub read: ReadArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ReceiptArgs {
    /// The receipt's id (SHA-256 of its payload): 64 hex digits, or base64.
    pub receipt_id: String,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub read: ReadArgs,
}

/// Longest wait for the connection to the broker.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Longest wait for one call's answer (a Watch: for the stream to open;
/// its events then come as long as it runs).
pub const CALL_TIMEOUT_MS: u64 = 30_000;
/// Largest answer decoded: a ListChildren page is about 1 MiB, a contract
/// at most a few hundred KiB.
pub const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// Children `children` prints unless `--max` says otherwise.
pub const DEFAULT_CHILDREN_LISTED: u32 = 1_000;
/// Most children `--max` may ask for.
pub const MAX_CHILDREN_LISTED: u32 = 100_000;
/// Children asked per ListChildren page (the broker's largest page).
const CHILDREN_PAGE: u32 = 1_000;

/// A session open on the broker, and what opening it learned.
struct Reader {
    client: broker_client::SessionClient,
    /// GetBrokerKeys' answer: what `get` and `receipt` verify against.
    keys: Vec<pb::BrokerKey>,
    session: pb::OpenSessionResponse,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Connects, asks for the broker's keys and opens a session for the key
/// in `--key-file`, attached to every later call.
async fn open(args: &ReadArgs) -> anyhow::Result<Reader> {
    let agent = super::audit::agent_from_key_file(&args.key_file)?;
    let endpoint = tonic::transport::Endpoint::from_shared(args.addr.clone())
        .map_err(|_| {
            anyhow::anyhow!(
                "--addr {:?} is not a URI such as http://127.0.0.1:50051",
                args.addr
            )
        })?
        .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS));
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to --addr {}", args.addr))?;
    let attacher = broker_client::SessionAttacher::default();
    let mut client = attacher
        .client(channel)
        .max_decoding_message_size(MAX_RESPONSE_BYTES);
    let keys = call(
        "GetBrokerKeys",
        client.get_broker_keys(pb::GetBrokerKeysRequest {}),
    )
    .await?
    .keys;
    let current = keys
        .iter()
        .find(|k| k.current)
        .ok_or_else(|| anyhow::anyhow!("GetBrokerKeys: the broker published no current key"))?;
    let session = call(
        "OpenSession",
        client.open_session(agent.open_session(&current.key_id)),
    )
    .await?;
    let sealed = session
        .session
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("OpenSession: the broker answered without a session"))?;
    attacher.set(sealed);
    Ok(Reader {
        client,
        keys,
        session,
    })
}

/// One call, bounded by `CALL_TIMEOUT_MS`; its error names the call.
async fn call<T>(
    what: &str,
    answer: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(Duration::from_millis(CALL_TIMEOUT_MS), answer).await {
        Err(_) => anyhow::bail!("{what}: no answer within {CALL_TIMEOUT_MS} ms"),
        Ok(Err(status)) => Err(status_error(what, &status)),
        Ok(Ok(response)) => Ok(response.into_inner()),
    }
}

fn status_error(what: &str, status: &tonic::Status) -> anyhow::Error {
    // NOT_FOUND is also the answer to a key that may not read the tree.
    let hint = match status.code() {
        tonic::Code::NotFound => {
            " (no such id, or the key may not read its tree: only its parties and [readers] keys may)"
        }
        _ => "",
    };
    anyhow::anyhow!(
        "{what}: {:?}: {}{hint}",
        status.code(),
        safe(status.message())
    )
}

/// A 32-byte id given as 64 hex digits or as base64 (standard or URL-safe,
/// padded or not); `argument` names it in the error.
pub fn parse_id(text: &str, argument: &str) -> anyhow::Result<[u8; 32]> {
    let text = text.trim();
    let engines = [
        &base64::engine::general_purpose::STANDARD,
        &base64::engine::general_purpose::URL_SAFE,
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ];
    // 64 hex digits are never 32 bytes of base64 (that is 43 or 44
    // characters), so the two readings cannot disagree.
    let bytes = if text.len() == 64 {
        hex::decode(text).ok()
    } else {
        engines.iter().find_map(|e| e.decode(text).ok())
    };
    bytes
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{argument} must be a 32-byte id: 64 hex digits, or 43-44 characters of base64; got {:?}",
                text.chars().take(100).collect::<String>()
            )
        })
}

/// Writes to stdout; `false` once the reader has gone (a closed pipe, as
/// with `| head`), which ends the command quietly.
fn emit(text: &str) -> anyhow::Result<bool> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

// ---------------------------------------------------------------- session

/// `session`: opens a session and prints it as a grpcurl header.
pub fn session(args: SessionArgs) -> anyhow::Result<()> {
    let reader = runtime()?.block_on(open(&args.read))?;
    let sealed = reader.session.session.unwrap_or_default();
    let expires = reader.session.expires_at_ms;
    let left_min = (expires - crate::clock::Clock::now_ms(&crate::clock::SystemClock)) / 60_000;
    eprintln!(
        "session expires at {} ({expires} ms, in {left_min} min)",
        rfc3339(expires)
    );
    emit(&format!("{}\n", session_header(&sealed)))?;
    Ok(())
}

/// The header line grpcurl's `-H` takes: the metadata key and the
/// protobuf-encoded session in standard base64.
pub fn session_header(session: &pb::Sealed) -> String {
    format!(
        "{}: {}",
        crate::service::session::SESSION_METADATA,
        base64::engine::general_purpose::STANDARD.encode(session.encode_to_vec())
    )
}

// ---------------------------------------------------------------- get

/// A contract as `get` shows it: verified, with its principal.
pub struct ContractView {
    pub state: pb::ContractState,
    pub contract: pb::Contract,
    /// Who issued it: the parent's delegate (a root's own delegate).
    pub principal: Vec<u8>,
    /// The key whose signature was checked.
    pub verified_by: String,
}

/// `get`: one contract's terms, status, ledger and effective predicate.
pub fn get(args: GetArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    let view = runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        read_contract(&mut reader, &id).await
    })?;
    let text = if args.json {
        format!("{}\n", serde_json::to_string(&contract_json(&view))?)
    } else {
        contract_text(&view)
    };
    emit(&text)?;
    Ok(())
}

/// Reads `id`, checks it is what the broker signed, and reads its parent
/// for the principal.
async fn read_contract(reader: &mut Reader, id: &[u8; 32]) -> anyhow::Result<ContractView> {
    let state = contract_state(reader, id).await?;
    let sealed = state.contract.clone().unwrap_or_default();
    let contract = pb::Contract::decode(sealed.payload.as_slice())
        .context("GetContract: the contract does not decode")?;
    let verified_by = verify(
        &reader.keys,
        &sealed,
        payload_type::CONTRACT,
        &contract.broker_key_id,
        contract.issued_at_ms,
        "the contract",
    )?;
    let principal = if contract.parent_id.is_empty() {
        contract.delegate_public_key.clone()
    } else {
        let parent_id = <[u8; 32]>::try_from(contract.parent_id.as_slice())
            .map_err(|_| anyhow::anyhow!("the contract's parent_id is not 32 bytes"))?;
        let parent = contract_state(reader, &parent_id).await?;
        pb::Contract::decode(parent.contract.unwrap_or_default().payload.as_slice())
            .context("GetContract: the parent does not decode")?
            .delegate_public_key
    };
    Ok(ContractView {
        state,
        contract,
        principal,
        verified_by,
    })
}

/// GetContract, with the answer's id checked against what it carries.
async fn contract_state(reader: &mut Reader, id: &[u8; 32]) -> anyhow::Result<pb::ContractState> {
    let state = call(
        "GetContract",
        reader.client.get_contract(pb::GetContractRequest {
            contract_id: id.to_vec(),
        }),
    )
    .await?
    .contract
    .ok_or_else(|| anyhow::anyhow!("GetContract: the broker answered without the contract"))?;
    let payload = state.contract.as_ref().map(|s| s.payload.as_slice());
    anyhow::ensure!(
        payload.is_some_and(|p| crypto::sha256(p) == *id),
        "GetContract: the contract answered for {} is not the one asked for",
        hex::encode(id)
    );
    Ok(state)
}

/// Checks a broker signature against the published keys: the key the
/// payload names, valid for its id, and not retired before `at_ms`.
/// Returns the key's id.
fn verify(
    published: &[pb::BrokerKey],
    sealed: &pb::Sealed,
    type_: &str,
    key_id: &str,
    at_ms: i64,
    what: &str,
) -> anyhow::Result<String> {
    let keys = crate::chain::BrokerKeys::from_published(published);
    let shown: String = key_id.chars().take(80).collect();
    let key = keys.get(0, key_id).map_err(|_| {
        anyhow::anyhow!("{what} is signed by {shown:?}, which GetBrokerKeys does not publish")
    })?;
    crypto::verify_sealed(sealed, type_, key)
        .map_err(|_| anyhow::anyhow!("{what}'s signature does not verify under {shown}"))?;
    // A retired key vouches only for what it signed before it retired:
    // the chain verifier's rule, the one every verifier here applies.
    if let Err(crate::chain::ChainError::Retired { retired_at_ms, .. }) =
        keys.check_dated(0, key_id, at_ms)
    {
        anyhow::bail!(
            "{what} is dated {at_ms} ms, after its key {shown} retired ({retired_at_ms} ms)"
        );
    }
    Ok(key_id.to_owned())
}

/// An enum value's name without its prefix; an unknown value as a number.
fn name<E>(known: Result<&'static str, E>, prefix: &str, raw: i32) -> String {
    known
        .map(|n| n.trim_start_matches(prefix).to_owned())
        .unwrap_or_else(|_| format!("UNKNOWN({raw})"))
}

fn status_name(status: i32) -> String {
    name(
        pb::ContractStatus::try_from(status).map(|s| s.as_str_name()),
        "CONTRACT_STATUS_",
        status,
    )
}

fn liability_name(liability: i32) -> String {
    name(
        pb::Liability::try_from(liability).map(|l| l.as_str_name()),
        "LIABILITY_",
        liability,
    )
}

fn kind_name(kind: i32) -> String {
    name(
        pb::ReceiptKind::try_from(kind).map(|k| k.as_str_name()),
        "RECEIPT_KIND_",
        kind,
    )
}

fn verdict_name(verdict: i32) -> String {
    name(
        pb::Verdict::try_from(verdict).map(|v| v.as_str_name()),
        "VERDICT_",
        verdict,
    )
}

fn code_name(code: i32) -> String {
    name(
        pb::InvariantCode::try_from(code).map(|c| c.as_str_name()),
        "INVARIANT_CODE_",
        code,
    )
}

/// `key: value` lines with the values aligned; a value's own lines are
/// continued under it. Every value is made safe for a terminal.
#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl Fields {
    fn add(&mut self, key: &str, value: impl Into<String>) {
        self.0.push((key.to_owned(), value.into()));
    }

    fn render(&self) -> String {
        let width = self.0.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
        let mut out = String::new();
        for (key, value) in &self.0 {
            let mut label = format!("{key}:");
            for line in value.split('\n') {
                let _ = writeln!(out, "{label:width$} {}", safe(line));
                label.clear();
            }
        }
        out
    }
}

/// Bytes as hex, `-` when empty.
fn hex_or_dash(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        "-".to_owned()
    } else {
        hex::encode(bytes)
    }
}

fn text_or_dash(text: &str) -> String {
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.to_owned()
    }
}

fn when(ms: i64) -> String {
    format!("{} ({ms} ms)", rfc3339(ms))
}

/// What `get` prints.
pub fn contract_text(view: &ContractView) -> String {
    let (c, state) = (&view.contract, &view.state);
    let mut f = Fields::default();
    f.add("contract", hex::encode(&state.contract_id));
    f.add(
        "parent",
        if c.parent_id.is_empty() {
            "- (a root)".to_owned()
        } else {
            hex::encode(&c.parent_id)
        },
    );
    f.add("depth", c.depth.to_string());
    f.add("status", status_name(state.status));
    f.add("delegate", hex::encode(&c.delegate_public_key));
    f.add("principal", hex::encode(&view.principal));
    f.add("host", hex_or_dash(&c.host_public_key));
    if !c.intent.is_empty() {
        f.add("intent", c.intent.clone());
    }
    f.add("task", text_or_dash(&c.task));
    f.add("budget", c.budget.to_string());
    if let Some(l) = &state.ledger {
        f.add(
            "ledger",
            format!(
                "budget {} = residual {} + reserved {} + spent {}; {} open children",
                l.budget, l.residual, l.reserved, l.spent, l.open_children
            ),
        );
    }
    f.add("deadline", when(c.deadline_ms));
    f.add("issued", when(c.issued_at_ms));
    let source = name(
        pb::TrustSource::try_from(c.trust_source).map(|s| s.as_str_name()),
        "TRUST_SOURCE_",
        c.trust_source,
    );
    let mut trust = format!(
        "{} ({} ppm), this hop {} from {source}",
        ppm(c.cumulative_trust_ppm),
        c.cumulative_trust_ppm,
        ppm(c.factor_ppm)
    );
    if !c.risk_class.is_empty() {
        let _ = write!(trust, ", risk class {}", c.risk_class);
    }
    if !c.attestation_digest.is_empty() {
        let _ = write!(
            trust,
            ", attestation {}",
            hex::encode(&c.attestation_digest)
        );
    }
    f.add("trust", trust);
    f.add("liability", liability_name(c.liability));
    f.add("escalation channel", text_or_dash(&c.escalation_channel));
    f.add(
        "retry",
        format!(
            "min cost {}, min latency {} ms",
            c.min_retry_cost, c.min_retry_latency_ms
        ),
    );
    f.add(
        "write scope",
        if c.write_scope.is_empty() {
            "- (nothing writable)".to_owned()
        } else {
            c.write_scope.join(", ")
        },
    );
    f.add("predicate", text_or_dash(&c.predicate));
    f.add(
        "effective predicate",
        text_or_dash(&state.effective_predicate),
    );
    f.add("result schema", text_or_dash(&c.result_schema_json));
    if let Some(p) = &c.policy {
        f.add(
            "policy",
            format!(
                "max depth {}, min trust {}, max children {}, retry headroom {}, host required {}",
                p.max_depth,
                ppm(p.min_cumulative_trust_ppm),
                p.max_children,
                if p.disable_retry_headroom {
                    "off"
                } else {
                    "on"
                },
                if p.require_host { "yes" } else { "no" }
            ),
        );
    }
    if !c.labels.is_empty() {
        let mut labels: Vec<String> = c.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        f.add("labels", labels.join(", "));
    }
    f.add("lineage hash", hex::encode(&c.intent_lineage_hash));
    f.add("request digest", hex_or_dash(&c.request_digest));
    f.add("signature", format!("verified ({})", view.verified_by));
    f.render()
}

/// A contract's signed terms as JSON (what `get` and `watch` share).
fn terms_json(id: &[u8], c: &pb::Contract) -> Map<String, Value> {
    let policy = c.policy.as_ref().map(|p| {
        json!({
            "max_depth": p.max_depth,
            "min_cumulative_trust_ppm": p.min_cumulative_trust_ppm,
            "max_children": p.max_children,
            "disable_retry_headroom": p.disable_retry_headroom,
            "require_host": p.require_host,
        })
    });
    let value = json!({
        "contract_id": hex::encode(id),
        "parent_id": hex::encode(&c.parent_id),
        "depth": c.depth,
        "broker_key_id": c.broker_key_id,
        "intent": c.intent,
        "intent_lineage_hash": hex::encode(&c.intent_lineage_hash),
        "task": c.task,
        "delegate_public_key": hex::encode(&c.delegate_public_key),
        "host_public_key": hex::encode(&c.host_public_key),
        "budget": c.budget,
        "deadline_ms": c.deadline_ms,
        "deadline": rfc3339(c.deadline_ms),
        "issued_at_ms": c.issued_at_ms,
        "issued_at": rfc3339(c.issued_at_ms),
        "liability": liability_name(c.liability),
        "predicate": c.predicate,
        "escalation_channel": c.escalation_channel,
        "min_retry_cost": c.min_retry_cost,
        "min_retry_latency_ms": c.min_retry_latency_ms,
        "write_scope": c.write_scope,
        "policy": policy,
        "request_digest": hex::encode(&c.request_digest),
        "result_schema_json": c.result_schema_json,
        "labels": c.labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "factor_ppm": c.factor_ppm,
        "cumulative_trust_ppm": c.cumulative_trust_ppm,
        "trust_source": name(
            pb::TrustSource::try_from(c.trust_source).map(|s| s.as_str_name()),
            "TRUST_SOURCE_",
            c.trust_source,
        ),
        "attestation_digest": hex::encode(&c.attestation_digest),
        "risk_class": c.risk_class,
    });
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn ledger_json(ledger: Option<&pb::Ledger>) -> Value {
    ledger.map_or(Value::Null, |l| {
        json!({
            "budget": l.budget,
            "reserved": l.reserved,
            "spent": l.spent,
            "residual": l.residual,
            "open_children": l.open_children,
        })
    })
}

/// What `get --json` prints: the terms, then the broker's state of them.
pub fn contract_json(view: &ContractView) -> Value {
    let mut map = terms_json(&view.state.contract_id, &view.contract);
    map.insert("status".into(), status_name(view.state.status).into());
    map.insert("ledger".into(), ledger_json(view.state.ledger.as_ref()));
    map.insert(
        "effective_predicate".into(),
        view.state.effective_predicate.clone().into(),
    );
    map.insert(
        "principal_public_key".into(),
        hex::encode(&view.principal).into(),
    );
    map.insert("verified".into(), true.into());
    map.insert("verified_by".into(), view.verified_by.clone().into());
    Value::Object(map)
}

// ---------------------------------------------------------------- children

/// `children`: one line per child, in issuance order, page by page.
pub fn children(args: ChildrenArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let (mut printed, mut page_token) = (0u32, Vec::new());
        loop {
            let left = args.max.saturating_sub(printed);
            let page = call(
                "ListChildren",
                reader.client.list_children(pb::ListChildrenRequest {
                    contract_id: id.to_vec(),
                    page_size: CHILDREN_PAGE.min(left),
                    page_token,
                }),
            )
            .await?;
            // A page longer than asked is cut: `--max` holds whatever the
            // broker sends.
            let cut = page.children.len() > left as usize;
            for state in page.children.iter().take(left as usize) {
                let line = child_line(state, args.json)
                    .with_context(|| format!("ListChildren: child {printed}"))?;
                if !emit(&line)? {
                    return Ok(());
                }
                printed += 1;
            }
            if page.next_page_token.is_empty() && !cut {
                return Ok(());
            }
            if printed >= args.max {
                // A next page may be empty: "may", not "are".
                eprintln!(
                    "… there may be more children: only the first {} are shown (--max)",
                    args.max
                );
                return Ok(());
            }
            page_token = page.next_page_token;
        }
    })
}

/// One child as a line of text or JSON.
pub fn child_line(state: &pb::ContractState, json: bool) -> anyhow::Result<String> {
    let sealed = state.contract.clone().unwrap_or_default();
    anyhow::ensure!(
        crypto::sha256(&sealed.payload).as_slice() == state.contract_id,
        "its id is not SHA-256 of its contract"
    );
    let c = pb::Contract::decode(sealed.payload.as_slice()).context("it does not decode")?;
    if json {
        let mut map = terms_json(&state.contract_id, &c);
        map.insert("status".into(), status_name(state.status).into());
        map.insert("ledger".into(), ledger_json(state.ledger.as_ref()));
        map.insert(
            "effective_predicate".into(),
            state.effective_predicate.clone().into(),
        );
        return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
    }
    Ok(format!(
        "{} {:<12} depth {} budget {} delegate {}\n",
        hex::encode(&state.contract_id),
        status_name(state.status),
        c.depth,
        c.budget,
        short(&c.delegate_public_key)
    ))
}

// ---------------------------------------------------------------- watch

/// `watch`: the subtree's events as they come, one line each.
pub fn watch(args: WatchArgs) -> anyhow::Result<()> {
    use tokio_stream::StreamExt;
    let id = parse_id(&args.contract_id, "CONTRACT_ID")?;
    runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let mut events = call(
            "Watch",
            reader.client.watch(pb::WatchRequest {
                contract_id: id.to_vec(),
                cursor: args.cursor,
            }),
        )
        .await?;
        let (mut seen, mut last) = (0u64, args.cursor);
        while args.max_events.is_none_or(|max| seen < max) {
            // Live by design: an event may be hours away. Interrupting
            // ends the command; each event is bounded in bytes.
            let event = match events.next().await {
                None => return Ok(()),
                Some(Ok(event)) => event,
                Some(Err(status)) => {
                    return Err(status_error("Watch", &status).context(format!(
                        "the stream ended after cursor {last}: resume with --cursor {last}"
                    )));
                }
            };
            last = event.cursor;
            seen += 1;
            if !emit(&event_line(&event, args.json)?)? {
                return Ok(());
            }
        }
        Ok(())
    })
}

/// One Watch event as a line of text or JSON.
pub fn event_line(event: &pb::WatchResponse, json: bool) -> anyhow::Result<String> {
    let cursor = event.cursor;
    match &event.event {
        Some(pb::watch_response::Event::Contract(sealed)) => {
            let id = crypto::sha256(&sealed.payload);
            let c = pb::Contract::decode(sealed.payload.as_slice()).with_context(|| {
                format!("Watch: the contract at cursor {cursor} does not decode")
            })?;
            if json {
                let mut map = terms_json(&id, &c);
                map.insert("cursor".into(), cursor.to_string().into());
                map.insert("event".into(), "contract".into());
                return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
            }
            Ok(format!(
                "{cursor} contract {} parent {} depth {} budget {} delegate {}\n",
                hex::encode(id),
                hex_or_dash(&c.parent_id),
                c.depth,
                c.budget,
                short(&c.delegate_public_key)
            ))
        }
        Some(pb::watch_response::Event::Receipt(sealed)) => {
            let id = crypto::sha256(&sealed.payload);
            let r = pb::Receipt::decode(sealed.payload.as_slice()).with_context(|| {
                format!("Watch: the receipt at cursor {cursor} does not decode")
            })?;
            if json {
                let mut map = receipt_json(&id, &r);
                map.insert("cursor".into(), cursor.to_string().into());
                map.insert("event".into(), "receipt".into());
                return Ok(format!("{}\n", serde_json::to_string(&Value::Object(map))?));
            }
            let mut line = format!(
                "{cursor} receipt {} {} id {}",
                kind_name(r.kind),
                hex::encode(&r.contract_id),
                hex::encode(id)
            );
            if let Some(completion) = &r.completion {
                let _ = write!(line, " verdict {}", verdict_name(completion.verdict));
            }
            if !r.violations.is_empty() {
                let _ = write!(line, " primary {}", code_name(r.primary));
            }
            Ok(line + "\n")
        }
        None => Ok(if json {
            format!(
                "{}\n",
                json!({"cursor": cursor.to_string(), "event": "unknown"})
            )
        } else {
            format!("{cursor} unknown event\n")
        }),
    }
}

// ---------------------------------------------------------------- receipt

/// `receipt`: one receipt, decoded, verified against the broker's keys.
pub fn receipt(args: ReceiptArgs) -> anyhow::Result<()> {
    let id = parse_id(&args.receipt_id, "RECEIPT_ID")?;
    let (receipt, verified_by) = runtime()?.block_on(async {
        let mut reader = open(&args.read).await?;
        let sealed = call(
            "GetReceipt",
            reader.client.get_receipt(pb::GetReceiptRequest {
                receipt_id: id.to_vec(),
            }),
        )
        .await?
        .receipt
        .ok_or_else(|| anyhow::anyhow!("GetReceipt: the broker answered without the receipt"))?;
        anyhow::ensure!(
            crypto::sha256(&sealed.payload) == id,
            "GetReceipt: the receipt answered for {} is not the one asked for",
            hex::encode(id)
        );
        let receipt = pb::Receipt::decode(sealed.payload.as_slice())
            .context("GetReceipt: the receipt does not decode")?;
        let verified_by = verify(
            &reader.keys,
            &sealed,
            payload_type::RECEIPT,
            &receipt.broker_key_id,
            receipt.at_ms,
            "the receipt",
        )?;
        anyhow::Ok((receipt, verified_by))
    })?;
    let text = if args.json {
        let mut map = receipt_json(&id, &receipt);
        map.insert("verified".into(), true.into());
        map.insert("verified_by".into(), verified_by.into());
        format!("{}\n", serde_json::to_string(&Value::Object(map))?)
    } else {
        receipt_text(&id, &receipt, &verified_by)
    };
    emit(&text)?;
    Ok(())
}

/// What `receipt` prints.
pub fn receipt_text(id: &[u8], r: &pb::Receipt, verified_by: &str) -> String {
    let mut f = Fields::default();
    f.add("receipt", hex::encode(id));
    f.add("kind", kind_name(r.kind));
    f.add("contract", hex::encode(&r.contract_id));
    f.add("root", hex::encode(&r.root_id));
    f.add("at", when(r.at_ms));
    f.add("requester", hex_or_dash(&r.requester_public_key));
    f.add("request digest", hex_or_dash(&r.request_digest));
    if !r.violations.is_empty() {
        f.add("primary", code_name(r.primary));
    }
    for v in &r.violations {
        f.add(
            "violation",
            format!(
                "{} requested {}, allowed {}: {}",
                code_name(v.code),
                v.requested,
                v.allowed,
                v.detail
            ),
        );
    }
    if let Some(c) = &r.completion {
        f.add("verdict", verdict_name(c.verdict));
        f.add("schema valid", c.schema_valid.to_string());
        f.add("within scope", c.within_scope.to_string());
        for criterion in &c.refused_criteria {
            f.add(
                "refused",
                format!("{}: {}", criterion.criterion, criterion.reason),
            );
        }
        if c.out_of_scope_path_count > 0 || !c.out_of_scope_paths.is_empty() {
            f.add(
                "out of scope",
                format!(
                    "{} ({} in all)",
                    c.out_of_scope_paths.join(", "),
                    c.out_of_scope_path_count
                ),
            );
        }
        f.add("claim", text_or_dash(&c.claim));
        f.add("typed report", c.has_report.to_string());
        f.add(
            "consumed",
            format!(
                "{}, returned {}, overspend {}, claimed excess {}",
                c.consumed, c.returned, c.overspend, c.claimed_excess
            ),
        );
        f.add("result digest", hex_or_dash(&c.result_digest));
        f.add("elapsed", format!("{} ms", c.elapsed_ms));
        if let Some(a) = &c.attribution {
            f.add(
                "attribution",
                format!("{} at depth {}", hex::encode(&a.agent_public_key), a.depth),
            );
        }
    }
    if let Some(e) = &r.escalation {
        f.add(
            "escalation",
            format!(
                "principal residual {}, principal deadline {}, retry feasible {}",
                e.principal_residual,
                when(e.principal_deadline_ms),
                e.retry_feasible
            ),
        );
        f.add("escalation reason", text_or_dash(&e.reason));
    }
    if !r.reason.is_empty() {
        f.add("reason", r.reason.clone());
    }
    for ended in &r.revoked_ids {
        f.add("ended", hex::encode(ended));
    }
    if r.kind == pb::ReceiptKind::Observed as i32 {
        f.add("observations", r.observations.to_string());
    }
    f.add("signature", format!("verified ({verified_by})"));
    f.render()
}

/// A receipt as JSON (what `receipt` and `watch` share).
fn receipt_json(id: &[u8], r: &pb::Receipt) -> Map<String, Value> {
    let completion = r.completion.as_ref().map(|c| {
        json!({
            "verdict": verdict_name(c.verdict),
            "refused_criteria": c.refused_criteria.iter().map(|rc| json!({
                "criterion": rc.criterion,
                "reason": rc.reason,
            })).collect::<Vec<_>>(),
            "claim": c.claim,
            "has_report": c.has_report,
            "result_digest": hex::encode(&c.result_digest),
            "consumed": c.consumed,
            "overspend": c.overspend,
            "returned": c.returned,
            "claimed_excess": c.claimed_excess,
            "schema_valid": c.schema_valid,
            "within_scope": c.within_scope,
            "out_of_scope_paths": c.out_of_scope_paths,
            "out_of_scope_path_count": c.out_of_scope_path_count,
            "elapsed_ms": c.elapsed_ms,
            "attribution": c.attribution.as_ref().map(|a| json!({
                "agent_public_key": hex::encode(&a.agent_public_key),
                "depth": a.depth,
                "chain": a.chain.iter().map(hex::encode).collect::<Vec<_>>(),
            })),
        })
    });
    let escalation = r.escalation.as_ref().map(|e| {
        json!({
            "principal_residual": e.principal_residual,
            "principal_deadline_ms": e.principal_deadline_ms,
            "retry_feasible": e.retry_feasible,
            "reason": e.reason,
        })
    });
    let value = json!({
        "receipt_id": hex::encode(id),
        "broker_key_id": r.broker_key_id,
        "kind": kind_name(r.kind),
        "contract_id": hex::encode(&r.contract_id),
        "root_id": hex::encode(&r.root_id),
        "request_digest": hex::encode(&r.request_digest),
        "requester_public_key": hex::encode(&r.requester_public_key),
        "at_ms": r.at_ms,
        "at": rfc3339(r.at_ms),
        "primary": if r.violations.is_empty() { String::new() } else { code_name(r.primary) },
        "violations": r.violations.iter().map(|v| json!({
            "code": code_name(v.code),
            "requested": v.requested,
            "allowed": v.allowed,
            "detail": v.detail,
        })).collect::<Vec<_>>(),
        "completion": completion,
        "escalation": escalation,
        "reason": r.reason,
        "revoked_ids": r.revoked_ids.iter().map(hex::encode).collect::<Vec<_>>(),
        "observations": r.observations,
    });
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_read_as_hex_or_any_base64() {
        let id: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(250));
        let hexed = hex::encode(id);
        assert_eq!(parse_id(&hexed, "ID").unwrap(), id);
        assert_eq!(parse_id(&hexed.to_uppercase(), "ID").unwrap(), id);
        for engine in [
            &base64::engine::general_purpose::STANDARD,
            &base64::engine::general_purpose::URL_SAFE,
            &base64::engine::general_purpose::STANDARD_NO_PAD,
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ] {
            let text = engine.encode(id);
            assert_eq!(parse_id(&format!(" {text}\n"), "ID").unwrap(), id, "{text}");
        }
        for bad in [
            "",
            "abc",
            &hexed[..62],
            &format!("{hexed}00"),
            &"z".repeat(64),
        ] {
            let error = parse_id(bad, "RECEIPT_ID").unwrap_err().to_string();
            assert!(
                error.starts_with("RECEIPT_ID must be a 32-byte id"),
                "{error}"
            );
        }
        // 33 bytes of base64 is not an id either.
        let long = base64::engine::general_purpose::STANDARD.encode([7u8; 33]);
        assert!(parse_id(&long, "ID").is_err());
    }

    #[test]
    fn fields_align_and_continue_multiline_values() {
        let mut f = Fields::default();
        f.add("id", "1");
        f.add("effective predicate", "(a\n) && (b\u{1b}[2J\n)");
        assert_eq!(
            f.render(),
            "id:                  1\n\
             effective predicate: (a\n\
             \x20                    ) && (b\\u{1b}[2J\n\
             \x20                    )\n"
        );
    }
}
