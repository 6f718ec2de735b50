//! `delegate`: a sub-contract of one the signer holds, checked by the
//! broker against every invariant.

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use super::{Answer, WriteArgs, deadline_in, key, run};
use crate::pb;

#[derive(Args, Debug, Clone)]
pub struct DelegateArgs {
    /// The parent contract, held by the signer: 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub parent_id: String,
    /// The delegate's public key (64 hex digits, as `keygen` prints it).
    #[arg(long, value_name = "KEY")]
    pub to: String,
    /// The child's budget, reserved from the parent's residual.
    #[arg(long)]
    pub budget: i64,
    /// What the child is to do (required: the audit compares the paths it
    /// names with what the delegate touched).
    #[arg(long)]
    pub task: String,
    /// Milliseconds from now to the child's deadline (as late as the
    /// parent allows when absent).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=crate::core::limits::MAX_HORIZON_MS as u64))]
    pub ttl_ms: Option<u64>,
    /// Who answers for the outcome.
    #[arg(long, value_enum, default_value_t = Liability::Principal)]
    pub liability: Liability,
    /// The acceptance predicate (CEL) added at this hop.
    #[arg(long, default_value = "")]
    pub predicate: String,
    /// Where the delegate escalates (needed when liability moves to it).
    #[arg(long, default_value = "")]
    pub escalation_channel: String,
    /// A retry's least cost the parent must keep in reserve (invariant 9).
    #[arg(long, default_value_t = 0)]
    pub min_retry_cost: i64,
    /// A retry's least time the parent must keep before its deadline.
    #[arg(long, default_value_t = 0)]
    pub min_retry_latency_ms: i64,
    /// A path the child may write below, within the parent's; repeat.
    #[arg(long = "write-scope", value_name = "PATH")]
    pub write_scope: Vec<String>,
    /// The host whose observations judge the child (its public key).
    #[arg(long, value_name = "KEY")]
    pub host: Option<String>,
    /// A file holding the delegate's attestation: a serialized
    /// `delegation.broker.v1.Envelope` signed by a trusted attestor.
    #[arg(long, value_name = "FILE")]
    pub attestation: Option<std::path::PathBuf>,
    /// A JSON Schema the output must satisfy.
    #[arg(long, default_value = "")]
    pub result_schema: String,
    #[command(flatten)]
    pub write: WriteArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Liability {
    Principal,
    Delegate,
}

/// Most bytes of an attestation file (an envelope is a few hundred).
const MAX_ATTESTATION_FILE_BYTES: u64 = 64 * 1024;

/// `delegate`: asks for a child contract; prints it, or the refusal.
pub fn delegate(args: DelegateArgs) -> anyhow::Result<()> {
    let parent_id = key(&args.parent_id, "PARENT_ID")?;
    let delegate_public_key = key(&args.to, "--to")?;
    let host_public_key = match &args.host {
        Some(host) => key(host, "--host")?,
        None => Vec::new(),
    };
    let delegate_attestation = match &args.attestation {
        Some(path) => Some(attestation(path)?),
        None => None,
    };
    let body = pb::DelegateBody {
        header: None,
        parent_id: parent_id.clone(),
        // Filled in from the parent below.
        intent_lineage_hash: Vec::new(),
        task: args.task,
        delegate_public_key,
        delegate_attestation,
        budget: args.budget,
        deadline_ms: args.ttl_ms.map_or(0, deadline_in),
        liability: match args.liability {
            Liability::Principal => pb::Liability::Principal,
            Liability::Delegate => pb::Liability::Delegate,
        } as i32,
        predicate: args.predicate,
        escalation_channel: args.escalation_channel,
        min_retry_cost: args.min_retry_cost,
        min_retry_latency_ms: args.min_retry_latency_ms,
        write_scope: args.write_scope,
        host_public_key,
        result_schema_json: args.result_schema,
    };
    run(&args.write, move |link| async move {
        let mut body = body;
        // Every contract of a tree carries the root's lineage hash.
        body.intent_lineage_hash = link.terms_of(&parent_id).await?.intent_lineage_hash;
        match link.call(body, None).await?.outcome {
            Some(pb::delegate_response::Outcome::Issued(issued)) => Ok(Answer::Issued(issued)),
            Some(pb::delegate_response::Outcome::Refused(refused)) => Ok(Answer::Refused(refused)),
            None => anyhow::bail!("Delegate answered neither issued nor refused"),
        }
    })
}

fn attestation(path: &std::path::Path) -> anyhow::Result<pb::Envelope> {
    use prost::Message as _;
    use std::io::Read as _;
    let file = std::fs::File::open(path)
        .with_context(|| format!("--attestation {}: cannot open", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_ATTESTATION_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("--attestation {}: cannot read", path.display()))?;
    anyhow::ensure!(
        bytes.len() as u64 <= MAX_ATTESTATION_FILE_BYTES,
        "--attestation {}: larger than {MAX_ATTESTATION_FILE_BYTES} bytes",
        path.display()
    );
    pb::Envelope::decode(bytes.as_slice()).with_context(|| {
        format!(
            "--attestation {}: not a serialized delegation.broker.v1.Envelope",
            path.display()
        )
    })
}
