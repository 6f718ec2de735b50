//! The broker's signing keys on disk, in the data directory: the current
//! key (created on first start, reused afterwards) and retired public keys
//! whose old signatures stay verifiable after a rotation.

use std::io::Write;
use std::path::{Path, PathBuf};

use ed25519_dalek::{SigningKey, VerifyingKey};

use crate::crypto;

/// File holding the current key's 32-byte seed, hex-encoded.
pub const CURRENT_KEY_FILE: &str = "broker_signing_key";
/// File listing retired public keys, one hex key per line.
pub const RETIRED_KEYS_FILE: &str = "broker_retired_keys";

/// The keys a broker signs and has signed with.
pub struct Keyring {
    pub current: SigningKey,
    pub retired: Vec<VerifyingKey>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeystoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Malformed { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KeystoreError + '_ {
    move |source| KeystoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes `contents` readable by the owner only, atomically (temp + rename)
/// so a crash never leaves half a key.
pub fn write_secret(path: &Path, contents: &str) -> Result<(), KeystoreError> {
    let tmp = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&tmp).map_err(io(&tmp))?;
    file.write_all(contents.as_bytes()).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

fn read_seed(path: &Path) -> Result<SigningKey, KeystoreError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let bytes = hex::decode(text.trim()).map_err(|e| KeystoreError::Malformed {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let seed: [u8; 32] = bytes.try_into().map_err(|_| KeystoreError::Malformed {
        path: path.to_owned(),
        reason: "seed must be 32 bytes".into(),
    })?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Loads the keyring from `data_dir`, creating the directory and a fresh
/// current key on first start.
pub fn load_or_create(data_dir: &Path) -> Result<Keyring, KeystoreError> {
    std::fs::create_dir_all(data_dir).map_err(io(data_dir))?;
    let current_path = data_dir.join(CURRENT_KEY_FILE);
    let current = if current_path.exists() {
        read_seed(&current_path)?
    } else {
        let key = crypto::generate_signing_key();
        write_secret(&current_path, &hex::encode(key.to_bytes()))?;
        tracing::info!(key_id = %crypto::key_id(&key.verifying_key().to_bytes()), "created broker signing key");
        key
    };
    let retired_path = data_dir.join(RETIRED_KEYS_FILE);
    let mut retired = Vec::new();
    if retired_path.exists() {
        let text = std::fs::read_to_string(&retired_path).map_err(io(&retired_path))?;
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let key = hex::decode(line)
                .ok()
                .and_then(|b| crypto::public_key(&b).ok())
                .ok_or_else(|| KeystoreError::Malformed {
                    path: retired_path.clone(),
                    reason: format!("not a hex ed25519 public key: {line}"),
                })?;
            retired.push(key);
        }
    }
    Ok(Keyring { current, retired })
}

/// Retires the current key and creates a new one. Run while the broker is
/// stopped; signatures by the retired key stay verifiable.
pub fn rotate(data_dir: &Path) -> Result<VerifyingKey, KeystoreError> {
    let keyring = load_or_create(data_dir)?;
    let retired_path = data_dir.join(RETIRED_KEYS_FILE);
    let mut lines: Vec<String> = keyring
        .retired
        .iter()
        .map(|k| hex::encode(k.to_bytes()))
        .collect();
    lines.push(hex::encode(keyring.current.verifying_key().to_bytes()));
    write_secret(&retired_path, &(lines.join("\n") + "\n"))?;
    let fresh = crypto::generate_signing_key();
    write_secret(
        &data_dir.join(CURRENT_KEY_FILE),
        &hex::encode(fresh.to_bytes()),
    )?;
    Ok(fresh.verifying_key())
}
