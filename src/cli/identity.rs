//! `bind-identity`: binds the key file's key to the workload identity a
//! token proves (a SPIFFE JWT-SVID, a Kubernetes service-account token, a
//! cloud OIDC token from an issuer the broker's `[identity]` trusts).
//! Contracts issued to the key then carry the identity, and policy naming
//! it (`[orchestrators]`, `[readers] identities`) applies to the key.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;

use super::read::{CONNECT_TIMEOUT_MS, runtime, when};
use crate::pb;

/// Longest token file read, in bytes: a token the broker takes is at
/// most `core::limits::MAX_IDENTITY_TOKEN_BYTES`, plus a line end.
const MAX_TOKEN_FILE_BYTES: u64 = crate::core::limits::MAX_IDENTITY_TOKEN_BYTES as u64 + 2;

#[derive(Args, Debug, Clone)]
pub struct BindIdentityArgs {
    /// A file holding the workload token (a compact JWT; `-` for standard
    /// input), e.g. the JWT-SVID `spire-agent api fetch jwt` wrote, or a
    /// projected service-account token.
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
    /// Broker address, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// The key to bind: a file holding its secret seed in hex, as `keygen`
    /// writes it.
    #[arg(long, env = "BROKER_KEY_FILE")]
    pub key_file: PathBuf,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub tls: super::tls::TlsArgs,
}

pub fn run(args: BindIdentityArgs) -> anyhow::Result<()> {
    let token = read_token(&args.token_file)?;
    let bound = runtime()?.block_on(async {
        let agent = broker_client::keys::agent_from_key_file(&args.key_file)?;
        let timeout = std::time::Duration::from_millis(CONNECT_TIMEOUT_MS);
        let tls = args.tls.load().await?;
        let channel = broker_client::channel::connect(&args.addr, timeout, &tls).await?;
        let link = broker_client::Link::new(agent, channel);
        let body = pb::BindIdentityBody {
            header: None,
            token,
        };
        anyhow::Ok(link.call(body, None).await?)
    })?;
    if args.json {
        let answer = serde_json::json!({
            "identity": bound.identity,
            "issuer": bound.issuer,
            "expires_at_ms": bound.expires_at_ms,
        });
        println!("{answer}");
    } else {
        println!("identity: {}", bound.identity);
        println!("issuer:   {}", bound.issuer);
        println!("until:    {}", when(bound.expires_at_ms));
    }
    Ok(())
}

fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    let named = || format!("--token-file {}", path.display());
    if path.as_os_str() == "-" {
        std::io::stdin()
            .take(MAX_TOKEN_FILE_BYTES)
            .read_to_string(&mut text)
            .with_context(named)?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_TOKEN_FILE_BYTES).read_to_string(&mut text))
            .with_context(named)?;
    }
    Ok(text.trim().to_owned())
}
