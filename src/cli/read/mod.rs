//! `session`, `get`, `children`, `watch`, `receipt`: reading the broker
//! from a terminal, as `zed` or `fga` do beside SpiceDB or OpenFGA. Each
//! reads as one key (`--key-file`, through a session it opens) and prints
//! text for people or, with `--json`, objects for scripts (one per line
//! where the output streams). This module owns the commands' arguments,
//! the parsing of ids (hex or base64), the bounds of every read and the
//! two renderings; `tree` (tree.rs) draws a whole subtree and lends its
//! helpers for dates, trust and terminal-safe text.

mod children;
mod contract;
mod receipt;
mod watch;

pub use children::*;
pub use contract::*;
pub use receipt::*;
pub use watch::*;

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
use broker_client::names::{
    code_name, liability_name, receipt_kind_name, status_name, verdict_name,
};

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
    #[command(flatten)]
    pub tls: super::tls::TlsArgs,
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
    /// Also write the contract's chain, root first, to FILE: a serialized
    /// `delegation.broker.v1.GetChainResponse`, what `verify --chain` reads.
    #[arg(long, value_name = "FILE")]
    pub chain_out: Option<std::path::PathBuf>,
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

/// The current-thread runtime each terminal command runs on.
pub(in crate::cli) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Connects, asks for the broker's keys and opens a session for the key
/// in `--key-file`, attached to every later call.
async fn open(args: &ReadArgs) -> anyhow::Result<Reader> {
    let agent = super::audit::agent_from_key_file(&args.key_file)?;
    let timeout = Duration::from_millis(CONNECT_TIMEOUT_MS);
    let tls = args.tls.load().await?;
    let channel = broker_client::channel::connect(&args.addr, timeout, &tls).await?;
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

/// The keys the broker at `addr` publishes (GetBrokerKeys needs no
/// session).
pub async fn broker_keys(
    addr: &str,
    tls: &super::tls::TlsArgs,
) -> anyhow::Result<Vec<pb::BrokerKey>> {
    let timeout = Duration::from_millis(CONNECT_TIMEOUT_MS);
    let tls = tls.load().await?;
    let channel = broker_client::channel::connect(addr, timeout, &tls).await?;
    let mut client = pb::broker_client::BrokerClient::new(channel);
    let answer = call(
        "GetBrokerKeys",
        client.get_broker_keys(pb::GetBrokerKeysRequest {}),
    );
    Ok(answer.await?.keys)
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
