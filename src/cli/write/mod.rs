//! `open-root`, `delegate`, `accept`, `decline`, `escalate`, `revoke`,
//! `complete`, `record`: writing to the broker from a terminal, as `zed`
//! or `fga` do. Each signs as one key (`--key-file`) through the client
//! layer (`broker_client::Link`: header, signature, the same bytes sent
//! again while the broker is unavailable) and prints what the broker
//! answered — the issued contract, the receipt, or the refusal with every
//! violated invariant — as text, as JSON (`--json`) or as the bare id
//! (`--quiet`, for `$(…)`). Exit status: 0 done, 3 refused by an
//! invariant (the refusal is printed), 1 any other error.

mod delegate;
mod ending;
mod record;
mod root;

pub use delegate::*;
pub use ending::*;
pub use record::*;
pub use root::*;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use prost::Message as _;
use serde_json::{Map, Value};

use super::read::{
    CONNECT_TIMEOUT_MS, Fields, hex_or_dash, parse_id, receipt_json, receipt_text, runtime,
    terms_json, when,
};
use super::tree::ppm;
use crate::crypto;
use crate::pb;
use broker_client::Link;

/// The exit status of a command the broker refused (an invariant, with
/// a signed refusal receipt); any other failure exits 1.
pub const REFUSED_EXIT_STATUS: u8 = 3;

/// Where to write and as whom: what every writing command takes.
#[derive(Args, Debug, Clone)]
pub struct WriteArgs {
    /// Broker address, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// The key to sign as: a file holding its secret seed in hex, as
    /// `keygen` writes it.
    #[arg(long, env = "BROKER_KEY_FILE")]
    pub key_file: PathBuf,
    /// One JSON object instead of text (snake_case fields, bytes as hex).
    #[arg(long, conflicts_with = "quiet")]
    pub json: bool,
    /// Only the id: of the issued contract, or of the receipt.
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub tls: super::tls::TlsArgs,
}

/// The broker refused the request with a signed receipt; already printed.
#[derive(Debug, thiserror::Error)]
#[error("refused by the broker (receipt {receipt_id})")]
pub struct Refused {
    pub receipt_id: String,
}

/// What the broker answered a write.
enum Answer {
    Issued(pb::IssuedContract),
    Refused(pb::Refusal),
    Receipt { id: Vec<u8>, sealed: pb::Sealed },
}

/// Runs `write` with a link signing as `--key-file`, then prints its answer.
fn run<F, Fut>(args: &WriteArgs, write: F) -> anyhow::Result<()>
where
    F: FnOnce(Link) -> Fut,
    Fut: Future<Output = anyhow::Result<Answer>>,
{
    let answer = runtime()?.block_on(async {
        let agent = broker_client::keys::agent_from_key_file(&args.key_file)?;
        let timeout = std::time::Duration::from_millis(CONNECT_TIMEOUT_MS);
        let tls = args.tls.load().await?;
        let channel = broker_client::channel::connect(&args.addr, timeout, &tls).await?;
        write(Link::new(agent, channel)).await
    })?;
    print(args, answer)
}

/// Prints the answer as `--json`, `--quiet` or text say; a refusal is
/// then returned as `Refused` (exit status 3).
fn print(args: &WriteArgs, answer: Answer) -> anyhow::Result<()> {
    let (id, text, json, refused) = match &answer {
        Answer::Issued(issued) => {
            let terms = broker_client::terms(issued.contract.as_ref())
                .ok_or_else(|| anyhow::anyhow!("the issued contract does not decode"))?;
            let mut json = terms_json(&issued.contract_id, &terms);
            json.insert("outcome".into(), "issued".into());
            let text = issued_text(&issued.contract_id, &terms);
            (&issued.contract_id, text, json, false)
        }
        Answer::Refused(refusal) => {
            let (text, json) = receipt_views(&refusal.receipt_id, refusal.receipt.as_ref())?;
            (&refusal.receipt_id, text, json, true)
        }
        Answer::Receipt { id, sealed } => {
            let (text, json) = receipt_views(id, Some(sealed))?;
            (id, text, json, false)
        }
    };
    if args.quiet {
        println!("{}", hex::encode(id));
    } else if args.json {
        println!("{}", serde_json::to_string(&Value::Object(json))?);
    } else {
        print!("{text}");
    }
    if refused {
        return Err(Refused {
            receipt_id: hex::encode(id),
        }
        .into());
    }
    Ok(())
}

/// A receipt as text and as JSON (with `outcome`: its kind, lower case).
fn receipt_views(
    id: &[u8],
    sealed: Option<&pb::Sealed>,
) -> anyhow::Result<(String, Map<String, Value>)> {
    let sealed = sealed.ok_or_else(|| anyhow::anyhow!("the broker answered without a receipt"))?;
    let receipt = pb::Receipt::decode(sealed.payload.as_slice())
        .context("the broker's receipt does not decode")?;
    anyhow::ensure!(
        crypto::sha256(&sealed.payload) == id,
        "the receipt answered is not the one its id names"
    );
    let mut json = receipt_json(id, &receipt);
    let kind = broker_client::names::receipt_kind_name(receipt.kind).to_lowercase();
    json.insert("outcome".into(), kind.into());
    // Checked by `receipt ID`, which reads the broker's published keys.
    let text = receipt_text(id, &receipt, None);
    Ok((text, json))
}

/// What a write prints for an issued contract.
fn issued_text(id: &[u8], c: &pb::Contract) -> String {
    let mut f = Fields::default();
    f.add("issued", hex::encode(id));
    f.add("parent", hex_or_dash(&c.parent_id));
    f.add("depth", c.depth.to_string());
    f.add("delegate", hex::encode(&c.delegate_public_key));
    f.add("budget", c.budget.to_string());
    f.add("deadline", when(c.deadline_ms));
    f.add("trust", ppm(c.cumulative_trust_ppm));
    f.add("lineage", hex::encode(&c.intent_lineage_hash));
    f.render()
}

/// A 32-byte key or id given as 64 hex digits or base64.
fn key(text: &str, argument: &str) -> anyhow::Result<Vec<u8>> {
    Ok(parse_id(text, argument)?.to_vec())
}

/// A relative deadline (`--ttl-ms`) as an absolute one.
fn deadline_in(ttl_ms: u64) -> i64 {
    let ttl_ms = i64::try_from(ttl_ms).unwrap_or(i64::MAX);
    crate::clock::Clock::now_ms(&crate::clock::SystemClock).saturating_add(ttl_ms)
}
