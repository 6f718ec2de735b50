//! `open-root`: a run's root contract, signed by its orchestrator.

use clap::Args;

use super::{Answer, WriteArgs, deadline_in, run};
use crate::pb;

/// A root's deadline unless `--ttl-ms` says otherwise: an hour.
pub const DEFAULT_ROOT_TTL_MS: u64 = 3_600_000;
/// Policy defaults: deep enough for a few hops, wide enough for a team.
pub const DEFAULT_MAX_DEPTH: u32 = 4;
pub const DEFAULT_MAX_CHILDREN: u32 = 64;
/// Lowest cumulative trust below this root unless said otherwise: none
/// (trust is then stamped and reported, not required).
pub const DEFAULT_MIN_TRUST_PPM: u32 = 0;

#[derive(Args, Debug, Clone)]
pub struct OpenRootArgs {
    /// The run's intent: every contract below carries its SHA-256 lineage.
    #[arg(long)]
    pub intent: String,
    /// The root's own task text.
    #[arg(long, default_value = "")]
    pub task: String,
    /// The run's whole budget, in the deployment's unit.
    #[arg(long)]
    pub budget: i64,
    /// Milliseconds from now to the root's deadline.
    #[arg(long, default_value_t = DEFAULT_ROOT_TTL_MS,
          value_parser = clap::value_parser!(u64).range(1..=crate::core::limits::MAX_HORIZON_MS as u64))]
    pub ttl_ms: u64,
    /// Deepest contract allowed (the root is depth 0).
    #[arg(long, default_value_t = DEFAULT_MAX_DEPTH)]
    pub max_depth: u32,
    /// Lowest cumulative trust a contract may carry, in ppm (1,000,000 = 1).
    #[arg(long, default_value_t = DEFAULT_MIN_TRUST_PPM)]
    pub min_trust_ppm: u32,
    /// Most open children per contract.
    #[arg(long, default_value_t = DEFAULT_MAX_CHILDREN)]
    pub max_children: u32,
    /// Turn off invariant 13 (retry headroom) for this tree.
    #[arg(long)]
    pub no_retry_headroom: bool,
    /// Every delegation must name its host (`delegate --host`).
    #[arg(long)]
    pub require_host: bool,
    /// The acceptance predicate (CEL) every completion below must meet.
    #[arg(long, default_value = "")]
    pub predicate: String,
    /// A path the run may write below; repeat for more (none: no writes).
    #[arg(long = "write-scope", value_name = "PATH")]
    pub write_scope: Vec<String>,
    /// A label KEY=VALUE for audits (`audit --group-by KEY`); repeat.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub write: WriteArgs,
}

/// `open-root`: opens a run; prints the root contract.
pub fn open_root(args: OpenRootArgs) -> anyhow::Result<()> {
    let body = pb::OpenRootBody {
        header: None,
        intent: args.intent,
        task: args.task,
        budget: args.budget,
        deadline_ms: deadline_in(args.ttl_ms),
        policy: Some(pb::Policy {
            max_depth: args.max_depth,
            min_cumulative_trust_ppm: args.min_trust_ppm,
            max_children: args.max_children,
            disable_retry_headroom: args.no_retry_headroom,
            require_host: args.require_host,
        }),
        predicate: args.predicate,
        write_scope: args.write_scope,
        labels: args.labels.into_iter().collect(),
    };
    run(&args.write, move |link| async move {
        let answer = link.call(body, None).await?;
        let issued = answer
            .issued
            .ok_or_else(|| anyhow::anyhow!("OpenRoot answered without a contract"))?;
        Ok(Answer::Issued(issued))
    })
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}
