//! `tree`: one delegation tree in the terminal, for people on a server
//! without a browser: each contract with its delegate, status, depth,
//! trust, deadline and ledger; the refusals beside the parent they were
//! asked of, with every violated code and its requested and allowed
//! values; completion verdicts with the refused criteria and the claim.
//! Reading only: contracts by ListChildren, receipts by Watch.

use std::collections::BTreeMap;

use clap::Args;

pub use broker_client::tree::*;

#[derive(Args, Debug, Clone)]
pub struct TreeArgs {
    /// The contract whose subtree to print (a root for the whole tree):
    /// 64 hex digits, or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    #[command(flatten)]
    pub read: super::read::ReadArgs,
    /// An address book: a TOML file of `"<hex public key>" = "name"` lines
    /// (the format of the broker configuration's [console.names]); names
    /// replace short keys.
    #[arg(long)]
    pub names: Option<std::path::PathBuf>,
    /// Most contracts printed; the rest are counted.
    #[arg(long, default_value_t = DEFAULT_TREE_CONTRACTS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_TREE_CONTRACTS)))]
    pub max_contracts: u32,
    /// One JSON object instead of the drawing: every contract read
    /// (parents before children) with its status, ledger and receipts.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: TreeArgs) -> anyhow::Result<()> {
    let names = match &args.names {
        Some(path) => read_names(path)?,
        None => BTreeMap::new(),
    };
    let id = super::read::parse_id(&args.contract_id, "CONTRACT_ID")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let data = runtime.block_on(async {
        let mut client = super::audit::reader(&args.read).await?;
        fetch(&mut client, &id, args.max_contracts).await
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&tree_json(&data))?);
    } else {
        print!("{}", render(&data, &names));
    }
    Ok(())
}

/// The tree as `--json` prints it: `contracts` (each `get --json`'s
/// terms, `status`, `ledger`, `effective_predicate` and its `receipts`),
/// and what was left out.
fn tree_json(data: &TreeData) -> serde_json::Value {
    use super::read::{ledger_json, receipt_json, terms_json};
    let contracts: Vec<serde_json::Value> = data
        .contracts
        .iter()
        .map(|state| {
            let terms = broker_client::terms(state.contract.as_ref()).unwrap_or_default();
            let mut map = terms_json(&state.contract_id, &terms);
            let status = broker_client::names::status_name(state.status);
            map.insert("status".into(), status.into());
            map.insert("ledger".into(), ledger_json(state.ledger.as_ref()));
            let predicate = state.effective_predicate.clone();
            map.insert("effective_predicate".into(), predicate.into());
            let receipts = data.receipts.get(&state.contract_id).into_iter().flatten();
            let receipts = receipts.map(|(id, r)| serde_json::Value::Object(receipt_json(id, r)));
            map.insert("receipts".into(), receipts.collect::<Vec<_>>().into());
            serde_json::Value::Object(map)
        })
        .collect();
    serde_json::json!({
        "contracts": contracts,
        "contracts_left_out": data.left_out,
        "receipts_left_out": data.receipts_left_out,
        "receipts_incomplete": data.receipts_incomplete,
    })
}
