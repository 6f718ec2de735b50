//! `verify`: a chain, a receipt or a signed envelope checked offline,
//! with public keys alone.

use super::read;

/// Most bytes of a file `verify` reads (a depth-64 chain is tens of KiB).
const MAX_VERIFY_FILE_BYTES: u64 = 64 * 1024 * 1024;

fn read_bounded(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_VERIFY_FILE_BYTES + 1).read_to_end(&mut bytes))
        .with_context(|| format!("cannot read {}", path.display()))?;
    anyhow::ensure!(
        bytes.len() as u64 <= MAX_VERIFY_FILE_BYTES,
        "{} is larger than {MAX_VERIFY_FILE_BYTES} bytes",
        path.display()
    );
    Ok(bytes)
}

/// An agent-signed request or an attestation (DSSE, type carried).
pub fn verify_envelope(public_key: &str, envelope: &std::path::Path) -> anyhow::Result<()> {
    use prost::Message;
    let key = public_key_arg(public_key)?;
    let envelope = crate::pb::Envelope::decode(read_bounded(envelope)?.as_slice())?;
    let known = [
        crate::crypto::payload_type::ATTESTATION,
        crate::crypto::payload_type::OPEN_ROOT,
        crate::crypto::payload_type::DELEGATE,
        crate::crypto::payload_type::ACCEPT,
        crate::crypto::payload_type::DECLINE,
        crate::crypto::payload_type::COMPLETE,
        crate::crypto::payload_type::ADJUDICATE,
        crate::crypto::payload_type::ESCALATE,
        crate::crypto::payload_type::REVOKE,
        crate::crypto::payload_type::RECORD_RECEIPTS,
        crate::crypto::payload_type::OPEN_SESSION,
    ];
    let payload_type = known
        .into_iter()
        .find(|t| *t == envelope.payload_type)
        .ok_or_else(|| anyhow::anyhow!("unknown payload type {:?}", envelope.payload_type))?;
    crate::crypto::verify_envelope(&envelope, payload_type, &key)?;
    println!(
        "ok {payload_type} {}",
        crate::crypto::key_id(&key.to_bytes())
    );
    Ok(())
}

/// A `--public-key` as 64 hex digits or base64 (as `keys show` prints
/// both).
fn public_key_arg(text: &str) -> anyhow::Result<ed25519_dalek::VerifyingKey> {
    match crate::config::parse_public_key(text, "--public-key") {
        Ok(key) => Ok(key),
        Err(hex_error) => {
            let Ok(bytes) = read::parse_id(text, "--public-key") else {
                return Err(hex_error.into());
            };
            ed25519_dalek::VerifyingKey::from_bytes(&bytes)
                .map_err(|e| anyhow::anyhow!("--public-key is not an ed25519 public key: {e}"))
        }
    }
}

/// One `--public-key`: HEX, or HEX:RETIRED_AT_MS for a key retired then
/// (GetBrokerKeys' `retired_at_ms`), as the chain check takes it.
fn broker_key(arg: &str) -> anyhow::Result<crate::pb::BrokerKey> {
    let (hex_key, retired) = match arg.split_once(':') {
        Some((hex_key, ms)) => (hex_key, Some(ms)),
        None => (arg, None),
    };
    let key = public_key_arg(hex_key)?;
    let retired_at_ms = match retired {
        None => 0,
        Some(ms) => ms.parse::<i64>().ok().filter(|ms| *ms > 0).ok_or_else(|| {
            anyhow::anyhow!(
                "--public-key HEX:RETIRED_AT_MS: {:?} is not a positive number of Unix ms",
                ms.chars().take(32).collect::<String>()
            )
        })?,
    };
    Ok(crate::pb::BrokerKey {
        key_id: crate::crypto::key_id(&key.to_bytes()),
        public_key: key.to_bytes().to_vec(),
        current: retired_at_ms == 0,
        retired_at_ms,
    })
}

/// A receipt (a `Sealed` file) signed by one of `keys`.
fn verify_receipt(keys: &crate::chain::BrokerKeys, path: &std::path::Path) -> anyhow::Result<()> {
    use prost::Message;
    let sealed = crate::pb::Sealed::decode(read_bounded(path)?.as_slice())?;
    let receipt = crate::pb::Receipt::decode(sealed.payload.as_slice())?;
    let key = keys.get(0, &receipt.broker_key_id).map_err(|_| {
        anyhow::anyhow!(
            "the receipt is signed by {:?}, which no --public-key matches",
            receipt.broker_key_id.chars().take(80).collect::<String>()
        )
    })?;
    crate::crypto::verify_sealed(&sealed, crate::crypto::payload_type::RECEIPT, key)?;
    // A retired key vouches only for what it signed before it retired.
    if let Err(crate::chain::ChainError::Retired { retired_at_ms, .. }) =
        keys.check_dated(0, &receipt.broker_key_id, receipt.at_ms)
    {
        anyhow::bail!(
            "the receipt is dated {} ms, after its key retired ({retired_at_ms} ms)",
            receipt.at_ms
        );
    }
    println!(
        "ok receipt {} kind={} contract={}",
        hex::encode(crate::crypto::sha256(&sealed.payload)),
        crate::pb::ReceiptKind::try_from(receipt.kind)
            .map(|k| k.as_str_name())
            .unwrap_or("unknown"),
        hex::encode(&receipt.contract_id)
    );
    Ok(())
}

/// The signed contracts of a `GetChainResponse` file, root first.
fn read_chain(path: &std::path::Path) -> anyhow::Result<Vec<crate::pb::Sealed>> {
    use prost::Message;
    let response = crate::pb::GetChainResponse::decode(read_bounded(path)?.as_slice())?;
    let sealed: Vec<crate::pb::Sealed> = response
        .chain
        .into_iter()
        .enumerate()
        .map(|(i, state)| {
            let contract = state
                .contract
                .ok_or_else(|| anyhow::anyhow!("chain[{i}] carries no contract"))?;
            // The unsigned id beside it must be the id of what is signed.
            anyhow::ensure!(
                state.contract_id.is_empty()
                    || state.contract_id == crate::crypto::sha256(&contract.payload),
                "chain[{i}].contract_id is not SHA-256 of its contract's payload"
            );
            Ok(contract)
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(sealed)
}

pub fn verify(
    public_keys: &[String],
    chain: Option<&std::path::Path>,
    contract_id: Option<&str>,
    all_signatures: bool,
    receipt: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let published = public_keys
        .iter()
        .map(|arg| broker_key(arg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let keys = crate::chain::BrokerKeys::from_published(&published);
    if let Some(path) = receipt {
        return verify_receipt(&keys, path);
    }
    let path = chain.ok_or_else(|| anyhow::anyhow!("--chain or --receipt is required"))?;
    let sealed = read_chain(path)?;
    let leaf = contract_id
        .map(|hex_id| {
            hex::decode(hex_id)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| anyhow::anyhow!("--contract-id must be 64 hex digits"))
        })
        .transpose()?;
    let hops = crate::chain::verify_chain(&sealed, &keys, leaf.as_ref())?;
    if all_signatures {
        crate::chain::verify_every_signature(&sealed, &keys)?;
    }
    for hop in &hops {
        let c = &hop.contract;
        println!(
            "depth={} id={} delegate={} budget={} deadline_ms={} trust_ppm={} liability={} effective_predicate={:?}",
            c.depth,
            hex::encode(hop.id),
            crate::crypto::key_id(
                &c.delegate_public_key
                    .as_slice()
                    .try_into()
                    .unwrap_or([0u8; 32])
            ),
            c.budget,
            c.deadline_ms,
            c.cumulative_trust_ppm,
            crate::pb::Liability::try_from(c.liability)
                .map(|l| l.as_str_name())
                .unwrap_or("unknown"),
            hop.effective_predicate
        );
    }
    println!(
        "ok chain of {} contracts{}",
        hops.len(),
        if all_signatures {
            ", every signature checked"
        } else {
            ""
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_public_key_may_say_when_it_retired() {
        let hex_key = hex::encode(
            crate::crypto::generate_signing_key()
                .verifying_key()
                .to_bytes(),
        );
        let key = broker_key(&hex_key).unwrap();
        assert!(key.current && key.retired_at_ms == 0);
        let retired = broker_key(&format!("{hex_key}:1700000000000")).unwrap();
        assert!(!retired.current && retired.retired_at_ms == 1_700_000_000_000);
        assert_eq!(retired.key_id, key.key_id);
        for bad in ["0", "-5", "x", ""] {
            assert!(broker_key(&format!("{hex_key}:{bad}")).is_err(), "{bad:?}");
        }
    }
}
