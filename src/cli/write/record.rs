//! `record`: what the host observed of a contract's work (tool calls,
//! reads, mutations): the facts the broker judges completions on.

use clap::Args;

use super::ending::receipt_of;
use super::{WriteArgs, key, run};
use crate::pb;

#[derive(Args, Debug, Clone)]
pub struct RecordArgs {
    /// The contract the signer hosts: 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// A tool call as NAME or NAME:UNITS (metered units charged); repeat.
    #[arg(long = "tool-call", value_name = "NAME[:UNITS]", value_parser = parse_tool_call)]
    pub tool_calls: Vec<(String, i64)>,
    /// A path read; repeat.
    #[arg(long = "read", value_name = "PATH")]
    pub reads: Vec<String>,
    /// A path written; repeat.
    #[arg(long = "mutation", value_name = "PATH")]
    pub mutations: Vec<String>,
    #[command(flatten)]
    pub write: WriteArgs,
}

/// `record`: sends the observations; the receipt counts them.
pub fn record(args: RecordArgs) -> anyhow::Result<()> {
    let contract_id = key(&args.contract_id, "CONTRACT_ID")?;
    let at_ms = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let observed = |kind: pb::ObservationKind, path: String| pb::Observation {
        kind: kind as i32,
        path,
        at_ms,
        ..Default::default()
    };
    let mut observations: Vec<pb::Observation> = args
        .tool_calls
        .into_iter()
        .map(|(tool, units)| pb::Observation {
            kind: pb::ObservationKind::ToolCall as i32,
            tool,
            units,
            at_ms,
            outcome: pb::ToolOutcome::Succeeded as i32,
            ..Default::default()
        })
        .collect();
    let reads = args.reads.into_iter();
    observations.extend(reads.map(|path| observed(pb::ObservationKind::Read, path)));
    let mutations = args.mutations.into_iter();
    observations.extend(mutations.map(|path| observed(pb::ObservationKind::Mutation, path)));
    anyhow::ensure!(
        !observations.is_empty(),
        "nothing to record: give --tool-call, --read or --mutation"
    );
    let body = pb::RecordReceiptsBody {
        header: None,
        contract_id,
        observations,
    };
    run(&args.write, move |link| receipt_of(link, body))
}

fn parse_tool_call(text: &str) -> Result<(String, i64), String> {
    let (name, units) = match text.rsplit_once(':') {
        Some((name, units)) => {
            let units = units
                .parse::<i64>()
                .ok()
                .filter(|u| *u >= 0)
                .ok_or_else(|| format!("{units:?} in {text:?} is not a count of units"))?;
            (name, units)
        }
        None => (text, 0),
    };
    if name.is_empty() {
        return Err(format!("{text:?} names no tool"));
    }
    Ok((name.to_owned(), units))
}
