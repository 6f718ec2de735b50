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

/// File in the data directory that whoever writes the directory holds
/// locked (`DataDirLock`); it names the holder's pid.
pub const LOCK_FILE: &str = "LOCK";

#[derive(Debug, thiserror::Error)]
pub enum KeystoreError {
    /// Another process writes this data directory.
    #[error(
        "{path} is in use by process {holder} (it holds {LOCK_FILE}): stop it first; two writers of one data directory would issue from each other's stale ledgers"
    )]
    Locked { path: PathBuf, holder: String },
    /// A data directory that must exist (rotate-key) does not.
    #[error("{path}: no such data directory (rotate-key rotates the key of an existing one)")]
    NoDataDir { path: PathBuf },
    /// A key file others can read, or that holds no key.
    #[error(transparent)]
    KeyFile(#[from] broker_client::keys::KeyFileError),
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

pub use broker_client::keys::{check_private, write_secret};

fn read_seed(path: &Path) -> Result<SigningKey, KeystoreError> {
    Ok(SigningKey::from_bytes(&broker_client::keys::read_seed(
        path,
    )?))
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

/// The data directory's lock, held while its holder writes the directory
/// (`serve` on SQLite, `rotate-key`); released when dropped or when the
/// process dies (an advisory `flock`, which the kernel drops with the
/// process: a crash never leaves it stale).
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
}

impl DataDirLock {
    /// Locks `data_dir` (which must exist) or refuses at once, naming the
    /// holder's pid. Nothing else in the directory is touched either way.
    pub fn acquire(data_dir: &Path) -> Result<Self, KeystoreError> {
        use std::io::{Read as _, Seek as _};
        let path = data_dir.join(LOCK_FILE);
        let mut options = std::fs::OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&path).map_err(io(&path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                // Bounded: a pid is a few bytes.
                let _ = (&mut file)
                    .take(MAX_LOCK_FILE_BYTES)
                    .read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(KeystoreError::Locked {
                    path: data_dir.to_owned(),
                    holder: if holder.is_empty() {
                        "(unknown pid)".into()
                    } else {
                        holder.into()
                    },
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&path)(e)),
        }
        file.set_len(0).map_err(io(&path))?;
        file.rewind().map_err(io(&path))?;
        writeln!(file, "{}", std::process::id()).map_err(io(&path))?;
        Ok(Self { _file: file })
    }
}

/// Most bytes of the lock file read to name its holder.
const MAX_LOCK_FILE_BYTES: u64 = 64;

/// Retires the current key and creates a new one, holding the data
/// directory's lock (so never beside a running broker); signatures by the
/// retired key stay verifiable.
pub fn rotate(data_dir: &Path) -> Result<VerifyingKey, KeystoreError> {
    if !data_dir.is_dir() {
        return Err(KeystoreError::NoDataDir {
            path: data_dir.to_owned(),
        });
    }
    let _lock = DataDirLock::acquire(data_dir)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_directory_has_one_writer_and_the_second_learns_its_pid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let held = DataDirLock::acquire(dir.path()).expect("first");
        let lock_file = std::fs::read_to_string(dir.path().join(LOCK_FILE)).expect("read");
        assert_eq!(lock_file.trim(), std::process::id().to_string());
        // flock is per open file: a second open in this process is refused
        // as another process's would be.
        let Err(KeystoreError::Locked { holder, .. }) = DataDirLock::acquire(dir.path()) else {
            panic!("a second lock was granted");
        };
        assert_eq!(holder, std::process::id().to_string());
        let Err(KeystoreError::Locked { .. }) = rotate(dir.path()) else {
            panic!("rotate-key ran beside the holder");
        };
        assert!(
            !dir.path().join(CURRENT_KEY_FILE).exists(),
            "the refused rotation wrote a key"
        );
        drop(held);
        rotate(dir.path()).expect("rotation once the lock is free");
        assert!(dir.path().join(CURRENT_KEY_FILE).exists());
    }

    #[test]
    fn rotate_refuses_a_missing_directory_and_creates_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nonexistent");
        assert!(matches!(
            rotate(&missing),
            Err(KeystoreError::NoDataDir { .. })
        ));
        assert!(!missing.exists());
    }

    #[test]
    fn keys_are_written_for_the_owner_and_exposed_ones_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key");
        write_secret(&path, &hex::encode([7u8; 32])).expect("write");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        read_seed(&path).expect("an owner-only key is read");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        let error = read_seed(&path).expect_err("a group-readable key");
        assert!(error.to_string().contains("chmod 600"), "{error}");
    }
}
