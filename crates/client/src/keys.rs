//! Key files: a 32-byte secret seed in hex, readable by its owner alone
//! (what `keygen` writes and every client, gateway and broker reads).

use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::agent::Agent;

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// A secret key file others can read.
    #[error(
        "{path} is readable by others (mode {mode:o}): a signing key must be the owner's alone; fix it with `chmod 600 {path}`"
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} does not hold a 32-byte hex seed ({reason}); make one with `delegation-broker keygen`"
    )]
    Malformed { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KeyFileError + '_ {
    move |source| KeyFileError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes `contents` readable by the owner only, atomically (temp + rename)
/// so a crash never leaves half a key.
pub fn write_secret(path: &Path, contents: &str) -> Result<(), KeyFileError> {
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

/// Refuses a key file that its group or others may read: a leaked seed
/// signs as the broker (or the agent) for good.
pub fn check_private(path: &Path) -> Result<(), KeyFileError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(io(path))?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyFileError::Exposed {
                path: path.to_owned(),
                mode,
            });
        }
    }
    Ok(())
}

/// The 32-byte seed in the key file at `path`, refused when others may
/// read the file.
pub fn read_seed(path: &Path) -> Result<[u8; 32], KeyFileError> {
    check_private(path)?;
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let malformed = |reason: String| KeyFileError::Malformed {
        path: path.to_owned(),
        reason,
    };
    let bytes = hex::decode(text.trim()).map_err(|e| malformed(e.to_string()))?;
    bytes
        .try_into()
        .map_err(|_| malformed("the seed must be 32 bytes".into()))
}

/// The agent whose secret seed is in the key file at `path`.
pub fn agent_from_key_file(path: &Path) -> Result<Agent, KeyFileError> {
    Ok(Agent::from_seed(read_seed(path)?))
}
