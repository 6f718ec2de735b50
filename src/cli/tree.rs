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
    /// The contract (hex id) whose subtree to print; a root for the whole
    /// tree.
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
}

pub fn run(args: TreeArgs) -> anyhow::Result<()> {
    let names = match &args.names {
        Some(path) => read_names(path)?,
        None => BTreeMap::new(),
    };
    let id = hex::decode(args.contract_id.trim())
        .ok()
        .filter(|id| id.len() == 32)
        .ok_or_else(|| anyhow::anyhow!("CONTRACT_ID must be 64 hex characters (a 32-byte id)"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let data = runtime.block_on(async {
        let mut client = super::audit::reader(&args.read).await?;
        fetch(&mut client, &id, args.max_contracts).await
    })?;
    print!("{}", render(&data, &names));
    Ok(())
}
