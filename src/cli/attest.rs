//! `attest`: an attestor's signed statement of an agent's trust factor,
//! written to a file that `delegate --attestation` sends with the
//! Delegate naming that agent (the broker trusts the attestors its
//! configuration lists under `[trust] attestors`).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use prost::Message as _;

/// Longest an attestation may be valid unless `--ttl-ms` says otherwise:
/// a day.
pub const DEFAULT_ATTESTATION_TTL_MS: u64 = 86_400_000;

#[derive(Args, Debug, Clone)]
pub struct AttestArgs {
    /// The attested agent's public key (64 hex digits, or base64).
    #[arg(long, value_name = "KEY")]
    pub agent: String,
    /// The trust factor of one hop to that agent, in (0, 1].
    #[arg(long)]
    pub factor: f64,
    /// A risk class the contracts issued to the agent carry.
    #[arg(long, default_value = "")]
    pub risk_class: String,
    /// Milliseconds from now until the attestation expires.
    #[arg(long, default_value_t = DEFAULT_ATTESTATION_TTL_MS,
          value_parser = clap::value_parser!(u64).range(1..=crate::core::limits::MAX_HORIZON_MS as u64))]
    pub ttl_ms: u64,
    /// The attestor's key file (its secret seed in hex, as `keygen` writes it).
    #[arg(long, env = "BROKER_ATTESTOR_KEY_FILE")]
    pub key_file: PathBuf,
    /// Where to write the signed attestation (a serialized `Envelope`).
    #[arg(long)]
    pub out: PathBuf,
}

/// `attest`: signs and writes the attestation.
pub fn run(args: AttestArgs) -> anyhow::Result<()> {
    if !(args.factor > 0.0 && args.factor <= 1.0) {
        anyhow::bail!("--factor {} must be in (0, 1]", args.factor);
    }
    let agent = super::read::parse_id(&args.agent, "--agent")?;
    let attestor = broker_client::keys::agent_from_key_file(&args.key_file)?;
    let now_ms = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let expires_at_ms = now_ms.saturating_add(i64::try_from(args.ttl_ms).unwrap_or(i64::MAX));
    let envelope = attestor.attest(agent, args.factor, expires_at_ms, &args.risk_class);
    std::fs::write(&args.out, envelope.encode_to_vec())
        .with_context(|| format!("--out {}: cannot write", args.out.display()))?;
    Ok(())
}
