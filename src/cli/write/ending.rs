//! `accept`, `decline`, `escalate`, `revoke`, `complete`: a contract's
//! lifecycle, each answered with the receipt the broker signed.

use clap::Args;

use super::{Answer, WriteArgs, key, run};
use crate::pb;
use broker_client::{Ending, Link, Receipted};

#[derive(Args, Debug, Clone)]
pub struct AcceptArgs {
    /// The contract delegated to the signer: 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// The host whose observations count (its public key), when the
    /// principal did not name one.
    #[arg(long, value_name = "KEY")]
    pub host: Option<String>,
    #[command(flatten)]
    pub write: WriteArgs,
}

#[derive(Args, Debug, Clone)]
pub struct EndingArgs {
    /// The contract: 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// Why, for the principal and the audit.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub write: WriteArgs,
}

#[derive(Args, Debug, Clone)]
pub struct CompleteArgs {
    /// The contract the signer accepted: 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// The output, as JSON (judged against the result schema, if any).
    #[arg(long, default_value = "{}")]
    pub output: String,
    /// What the delegate claims it did.
    #[arg(long, default_value = "")]
    pub claim: String,
    /// What it consumed of its budget, in the deployment's unit.
    #[arg(long, default_value_t = 0)]
    pub consumed: i64,
    /// A typed report's status word (e.g. done, partial): with it the
    /// completion carries a report, which audits hold to the verdict.
    #[arg(long, value_name = "STATUS")]
    pub report_status: Option<String>,
    /// The typed report's summary for the principal.
    #[arg(long, value_name = "TEXT", requires = "report_status")]
    pub report_summary: Option<String>,
    #[command(flatten)]
    pub write: WriteArgs,
}

/// `accept`: takes a contract delegated to the signer.
pub fn accept(args: AcceptArgs) -> anyhow::Result<()> {
    let contract_id = key(&args.contract_id, "CONTRACT_ID")?;
    let host_public_key = match &args.host {
        Some(host) => key(host, "--host")?,
        None => Vec::new(),
    };
    let body = pb::AcceptBody {
        header: None,
        contract_id,
        host_public_key,
    };
    run(&args.write, move |link| receipt_of(link, body))
}

/// `decline`: refuses a contract before accepting it.
pub fn decline(args: EndingArgs) -> anyhow::Result<()> {
    ending::<pb::DeclineBody>(args)
}

/// `escalate`: gives back an accepted contract as unresolvable.
pub fn escalate(args: EndingArgs) -> anyhow::Result<()> {
    ending::<pb::EscalateBody>(args)
}

/// `revoke`: ends a contract below one the signer holds, and its subtree.
pub fn revoke(args: EndingArgs) -> anyhow::Result<()> {
    ending::<pb::RevokeBody>(args)
}

/// `complete`: hands in the output; the receipt carries the verdict.
pub fn complete(args: CompleteArgs) -> anyhow::Result<()> {
    let contract_id = key(&args.contract_id, "CONTRACT_ID")?;
    serde_json::from_str::<serde_json::Value>(&args.output)
        .map_err(|e| anyhow::anyhow!("--output is not JSON: {e}"))?;
    let body = pb::CompleteBody {
        header: None,
        contract_id,
        output_json: args.output,
        report: args.report_status.map(|status| pb::TypedReport {
            status,
            summary: args.report_summary.unwrap_or_default(),
        }),
        claim: args.claim,
        consumed: args.consumed,
    };
    run(&args.write, move |link| receipt_of(link, body))
}

fn ending<B: Ending>(args: EndingArgs) -> anyhow::Result<()>
where
    <B::Request as broker_client::Sendable>::Response: Receipted,
{
    let body = B::ending(key(&args.contract_id, "CONTRACT_ID")?, args.reason);
    run(&args.write, move |link| receipt_of(link, body))
}

/// Sends a lifecycle body; its answer is a receipt.
pub(super) async fn receipt_of<B>(link: Link, body: B) -> anyhow::Result<Answer>
where
    B: broker_client::Body,
    <B::Request as broker_client::Sendable>::Response: Receipted,
{
    let sealed = link
        .call(body, None)
        .await?
        .receipt()
        .ok_or_else(|| anyhow::anyhow!("the broker answered without a receipt"))?;
    let id = crate::crypto::sha256(&sealed.payload).to_vec();
    Ok(Answer::Receipt { id, sealed })
}
