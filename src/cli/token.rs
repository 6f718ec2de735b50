//! `token`: a JWT for a resource server, from the broker's token endpoint
//! (`serve --tokens`): the key file's agent proves it holds the contract
//! and gets a token for one resource, verifiable with the endpoint's JWKS
//! by any JOSE library. Exit status: 0 minted, 3 refused (the RFC 6749
//! error is printed), 1 any other error.

use std::path::PathBuf;

use clap::Args;

use broker_client::token::{TokenEndpoint, TokenError};

#[derive(Args, Debug, Clone)]
pub struct TokenArgs {
    /// The contract the signer holds (is the delegate of): 64 hex digits,
    /// or base64.
    #[arg(allow_hyphen_values = true)]
    pub contract_id: String,
    /// The resource (audience) the token is for: one of the broker's
    /// `[tokens] resources`.
    #[arg(long)]
    pub resource: String,
    /// The token endpoint's issuer URL, as `serve --tokens` printed it.
    #[arg(
        long,
        env = "BROKER_TOKENS_URL",
        default_value = "http://127.0.0.1:8443"
    )]
    pub tokens_url: String,
    /// The holder's key file (its secret seed in hex, as `keygen` writes
    /// it).
    #[arg(long, env = "BROKER_KEY_FILE")]
    pub key_file: PathBuf,
    /// The endpoint's whole answer as JSON instead of the bare token.
    #[arg(long)]
    pub json: bool,
}

/// Refused by the token endpoint; already printed.
#[derive(Debug, thiserror::Error)]
#[error("refused by the token endpoint")]
pub struct TokenRefused;

pub fn run(args: TokenArgs) -> anyhow::Result<()> {
    let contract = super::read::parse_id(&args.contract_id, "CONTRACT_ID")?;
    let agent = broker_client::keys::agent_from_key_file(&args.key_file)?;
    let endpoint =
        TokenEndpoint::new(&args.tokens_url).map_err(|e| anyhow::anyhow!("--tokens-url: {e}"))?;
    let minted = super::read::runtime()?
        .block_on(async { endpoint.mint(&agent, &contract, &args.resource).await });
    match minted {
        Ok(minted) if args.json => {
            let answer = serde_json::json!({
                "access_token": minted.access_token,
                "token_type": "Bearer",
                "expires_in": minted.expires_in,
            });
            println!("{answer}");
            Ok(())
        }
        Ok(minted) => {
            println!("{}", minted.access_token);
            Ok(())
        }
        Err(TokenError::Refused {
            error, description, ..
        }) => {
            eprintln!("refused: {error}: {description}");
            Err(TokenRefused.into())
        }
        Err(e) => Err(anyhow::anyhow!("{}: {e}", args.tokens_url)),
    }
}
