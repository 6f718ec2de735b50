//! `audit`: compares orchestration arms. Asks a broker for AggregateAudits
//! and prints the groups as a terminal table, or exports JSON or CSV for
//! notebooks. Rates are the broker's ratios of sums.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::pb;

#[derive(Args, Debug, Clone)]
pub struct AuditArgs {
    /// Only runs with this label, as key=value (repeatable).
    #[arg(long = "select", value_parser = parse_pair)]
    pub select: Vec<(String, String)>,
    /// Label keys to group runs by (repeatable), e.g. --group-by arm;
    /// `@identity` groups by who opened each run (its workload identity,
    /// else its key id).
    #[arg(long = "group-by")]
    pub group_by: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Where to read and as whom: a reader key listed under [readers]
    /// sees every run, any other key the runs whose root it opened.
    #[command(flatten)]
    pub read: super::read::ReadArgs,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
    Csv,
}

fn parse_pair(raw: &str) -> Result<(String, String), String> {
    raw.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{raw:?} is not key=value"))
}

/// One group as exported: every count and rate of `pb::AuditGroup`, with
/// plain types so JSON and CSV round-trip.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupRow {
    pub key: BTreeMap<String, String>,
    pub runs: u64,
    pub contracts: u64,
    pub discovered_paths: u64,
    pub evidence_paths: u64,
    pub discovery_rate: Option<f64>,
    pub with_report: u64,
    pub false_completions: u64,
    pub false_completion_rate: Option<f64>,
    pub claim_violations: u64,
    pub mutations: u64,
    pub claim_violations_per_mutation: Option<f64>,
    pub conflicts: u64,
    pub escalations: u64,
    pub refusals_by_code: BTreeMap<String, u64>,
    pub budget_spent: i64,
    pub budget_granted: i64,
    pub spent_over_granted: Option<f64>,
}

impl From<pb::AuditGroup> for GroupRow {
    fn from(g: pb::AuditGroup) -> Self {
        Self {
            key: g.key.into_iter().collect(),
            runs: g.runs,
            contracts: g.contracts,
            discovered_paths: g.discovered_paths,
            evidence_paths: g.evidence_paths,
            discovery_rate: g.discovery_rate,
            with_report: g.with_report,
            false_completions: g.false_completions,
            false_completion_rate: g.false_completion_rate,
            claim_violations: g.claim_violations,
            mutations: g.mutations,
            claim_violations_per_mutation: g.claim_violations_per_mutation,
            conflicts: g.conflicts,
            escalations: g.escalations,
            refusals_by_code: g.refusals_by_code.into_iter().collect(),
            budget_spent: g.budget_spent,
            budget_granted: g.budget_granted,
            spent_over_granted: g.spent_over_granted,
        }
    }
}

pub fn run(args: AuditArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let groups = runtime.block_on(fetch(&args))?;
    print!("{}", render(&groups, &args.group_by, args.format)?);
    Ok(())
}

pub use broker_client::keys::agent_from_key_file;

/// A client of the broker at `addr` whose reads carry a session of the key
/// in `key_file` (the reading commands: `audit`, `tree`).
pub async fn reader(args: &super::read::ReadArgs) -> anyhow::Result<broker_client::SessionClient> {
    let (addr, tls) = (&args.addr, &args.tls);
    let agent = agent_from_key_file(&args.key_file)?;
    let timeout = std::time::Duration::from_millis(super::read::CONNECT_TIMEOUT_MS);
    let tls = tls.load().await?;
    let channel = broker_client::channel::connect(addr, timeout, &tls).await?;
    let attacher = broker_client::SessionAttacher::default();
    let mut client = attacher.client(channel);
    attacher.open(&mut client, &agent).await?;
    Ok(client)
}

async fn fetch(args: &AuditArgs) -> anyhow::Result<Vec<GroupRow>> {
    let mut client = reader(&args.read).await?;
    let selector: HashMap<String, String> = args.select.iter().cloned().collect();
    let response = client
        .aggregate_audits(pb::AggregateAuditsRequest {
            selector,
            group_by: args.group_by.clone(),
        })
        .await?
        .into_inner();
    Ok(response.groups.into_iter().map(GroupRow::from).collect())
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |r| format!("{r:.3}"))
}

/// Renders groups in `format`.
pub fn render(groups: &[GroupRow], group_by: &[String], format: Format) -> anyhow::Result<String> {
    match format {
        Format::Json => Ok(serde_json::to_string_pretty(groups)? + "\n"),
        Format::Csv => render_csv(groups, group_by),
        Format::Table => render_table(groups, group_by),
    }
}

/// One header line, one line per group; cells quoted when needed.
fn render_csv(groups: &[GroupRow], group_by: &[String]) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut header: Vec<String> = group_by.to_vec();
    header.extend(
        [
            "runs",
            "contracts",
            "discovered_paths",
            "evidence_paths",
            "discovery_rate",
            "with_report",
            "false_completions",
            "false_completion_rate",
            "claim_violations",
            "mutations",
            "claim_violations_per_mutation",
            "conflicts",
            "escalations",
            "refusals",
            "budget_spent",
            "budget_granted",
            "spent_over_granted",
        ]
        .map(str::to_owned),
    );
    writeln!(out, "{}", header.join(","))?;
    for g in groups {
        let mut cells: Vec<String> = group_by
            .iter()
            .map(|k| csv_cell(g.key.get(k).map_or("", String::as_str)))
            .collect();
        let opt = |r: Option<f64>| r.map(|r| r.to_string()).unwrap_or_default();
        cells.extend([
            g.runs.to_string(),
            g.contracts.to_string(),
            g.discovered_paths.to_string(),
            g.evidence_paths.to_string(),
            opt(g.discovery_rate),
            g.with_report.to_string(),
            g.false_completions.to_string(),
            opt(g.false_completion_rate),
            g.claim_violations.to_string(),
            g.mutations.to_string(),
            opt(g.claim_violations_per_mutation),
            g.conflicts.to_string(),
            g.escalations.to_string(),
            csv_cell(&refusals(g)),
            g.budget_spent.to_string(),
            g.budget_granted.to_string(),
            opt(g.spent_over_granted),
        ]);
        writeln!(out, "{}", cells.join(","))?;
    }
    Ok(out)
}

/// Aligned columns for a terminal, ratios shown with their sums.
fn render_table(groups: &[GroupRow], group_by: &[String]) -> anyhow::Result<String> {
    let mut rows = vec![vec![
        "group".to_owned(),
        "runs".to_owned(),
        "contracts".to_owned(),
        "discovery".to_owned(),
        "false compl.".to_owned(),
        "violations/mut".to_owned(),
        "conflicts".to_owned(),
        "escalations".to_owned(),
        "refusals".to_owned(),
        "spent/granted".to_owned(),
    ]];
    for g in groups {
        let key = if group_by.is_empty() {
            "(all)".to_owned()
        } else {
            group_by
                .iter()
                .map(|k| format!("{k}={}", g.key.get(k).map_or("", String::as_str)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        rows.push(vec![
            key,
            g.runs.to_string(),
            g.contracts.to_string(),
            format!(
                "{}/{} = {}",
                g.discovered_paths,
                g.evidence_paths,
                rate(g.discovery_rate)
            ),
            format!(
                "{}/{} = {}",
                g.false_completions,
                g.with_report,
                rate(g.false_completion_rate)
            ),
            format!(
                "{}/{} = {}",
                g.claim_violations,
                g.mutations,
                rate(g.claim_violations_per_mutation)
            ),
            g.conflicts.to_string(),
            g.escalations.to_string(),
            refusals(g),
            format!(
                "{}/{} = {}",
                g.budget_spent,
                g.budget_granted,
                rate(g.spent_over_granted)
            ),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        writeln!(out, "{}", line.join("  ").trim_end())?;
        if i == 0 {
            writeln!(
                out,
                "{}",
                widths
                    .iter()
                    .map(|w| "-".repeat(*w))
                    .collect::<Vec<_>>()
                    .join("  ")
            )?;
        }
    }
    Ok(out)
}

fn refusals(g: &GroupRow) -> String {
    if g.refusals_by_code.is_empty() {
        return "-".to_owned();
    }
    g.refusals_by_code
        .iter()
        .map(|(code, n)| format!("{code}:{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn csv_cell(value: &str) -> String {
    if value.contains([',', '"', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_owned()
    }
}
