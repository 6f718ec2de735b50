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
    let loaded = load(data_dir, None)?;
    loaded.save()?;
    Ok(loaded.keyring)
}

/// A keyring as read, with a fresh current key not yet on disk: `serve`
/// saves it only once the store opened, so a failed start creates nothing.
pub struct Loaded {
    pub keyring: Keyring,
    /// Where the fresh current key goes; `None` when it was read.
    unsaved: Option<PathBuf>,
}

impl Loaded {
    /// True when the current key was made now (first start).
    pub fn is_fresh(&self) -> bool {
        self.unsaved.is_some()
    }

    /// The same keys (`save` runs on a blocking thread with its copy).
    pub fn clone_unsaved(&self) -> Self {
        Self {
            keyring: Keyring {
                current: self.keyring.current.clone(),
                retired: self.keyring.retired.clone(),
            },
            unsaved: self.unsaved.clone(),
        }
    }

    /// Writes a fresh current key (and its directory); nothing otherwise.
    pub fn save(&self) -> Result<(), KeystoreError> {
        let Some(path) = &self.unsaved else {
            return Ok(());
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        write_secret(path, &hex::encode(self.keyring.current.to_bytes()))?;
        tracing::info!(key_id = %crypto::key_id(&self.keyring.current.verifying_key().to_bytes()), path = %path.display(), "created broker signing key");
        Ok(())
    }
}

/// Reads the keyring without writing anything: the current key from
/// `key_file` when given (`serve --signing-key-file`: a deployment's
/// secret; never created), else from `data_dir` (made fresh, unsaved, when
/// absent); retired keys from `data_dir` when it lists any.
pub fn load(data_dir: &Path, key_file: Option<&Path>) -> Result<Loaded, KeystoreError> {
    let current_path = data_dir.join(CURRENT_KEY_FILE);
    let (current, unsaved) = match key_file {
        Some(path) => (read_seed(path)?, None),
        None if current_path.exists() => (read_seed(&current_path)?, None),
        None => (crypto::generate_signing_key(), Some(current_path)),
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
    Ok(Loaded {
        keyring: Keyring { current, retired },
        unsaved,
    })
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
