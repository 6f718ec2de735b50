//! Resolved-path mode (`resolve_root` in the config): a path a call names
//! is taken as the file system will take it — joined to the root,
//! symlinks followed — and the scope is checked on where it lands, so
//! `out/link -> ../secret` cannot write `secret` through an in-scope name.
//! Without it the gateway checks the path's text only.
//!
//! What is left: a symlink created after the check and before the tool
//! server opens the path (the agent would need another way to write the
//! tree meanwhile). A tool server that shares the tree with nobody else
//! closes that gap.

use std::path::{Component, Path, PathBuf};

use broker_client::BrokerError;

/// Resolves `path` (relative to `root`, or absolute) against the file
/// system: its longest existing prefix canonicalized (symlinks followed,
/// `..` applied where it exists), the rest appended as plain names. The
/// answer is relative to `root` with `/` separators; a path that lands
/// outside `root`, a dangling symlink, or a `..` below the existing
/// prefix is refused, naming `argument`. `root` must be canonical.
/// Blocking file system calls: run it off the async threads.
pub fn resolve(root: &Path, argument: &str, path: &str) -> Result<String, BrokerError> {
    let refuse = |why: String| {
        BrokerError::new(
            "OUT_OF_ROOT",
            format!("argument {argument:?}: {path:?} {why}; nothing was forwarded"),
        )
        .with("argument", argument)
        .with("path", path)
    };
    let joined = root.join(path);
    let mut tail: Vec<&std::ffi::OsStr> = Vec::new();
    let mut existing: &Path = &joined;
    let canonical = loop {
        match std::fs::canonicalize(existing) {
            Ok(canonical) => break canonical,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Missing, or a symlink whose target is missing: writing
                // through a dangling link creates its target, wherever.
                if std::fs::symlink_metadata(existing).is_ok() {
                    return Err(refuse("is or passes through a dangling symlink".into()));
                }
            }
            Err(e) => return Err(refuse(format!("cannot be resolved ({e})"))),
        }
        match existing.components().next_back() {
            Some(Component::Normal(name)) => tail.push(name),
            Some(Component::CurDir) => {}
            _ => {
                return Err(refuse(
                    "names `..` below a folder that does not exist".into(),
                ));
            }
        }
        existing = match existing.parent() {
            Some(parent) => parent,
            None => return Err(refuse("does not exist under the root".into())),
        };
    };
    let mut resolved: PathBuf = canonical;
    resolved.extend(tail.iter().rev());
    let inside = resolved.strip_prefix(root).map_err(|_| {
        refuse(format!(
            "resolves to {} outside the gateway's root",
            resolved.display()
        ))
    })?;
    let parts: Option<Vec<&str>> = inside
        .components()
        .map(|c| c.as_os_str().to_str())
        .collect();
    let parts = parts.ok_or_else(|| refuse("is not UTF-8 once resolved".into()))?;
    if parts.is_empty() {
        return Ok(".".to_owned());
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(r: Result<String, BrokerError>) -> String {
        match r {
            Ok(p) => p,
            Err(e) => e.reason,
        }
    }

    #[test]
    fn symlinks_are_followed_and_escapes_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(root.join("out/sub")).expect("mkdir");
        std::fs::create_dir_all(root.join("secret")).expect("mkdir");
        std::os::unix::fs::symlink(root.join("secret"), root.join("out/link")).expect("link");
        std::os::unix::fs::symlink("../secret/x", root.join("out/rel")).expect("link");
        std::os::unix::fs::symlink("/nonexistent/y", root.join("out/dangling")).expect("link");
        std::os::unix::fs::symlink("/etc", root.join("out/etc")).expect("link");
        let r = |p: &str| reason(resolve(&root, "path", p));
        assert_eq!(r("out/a.txt"), "out/a.txt");
        assert_eq!(r("out/sub/new/deeper.txt"), "out/sub/new/deeper.txt");
        assert_eq!(r("./out/./a.txt"), "out/a.txt");
        // Through a symlink: where it lands, not what it says.
        assert_eq!(r("out/link/a.txt"), "secret/a.txt");
        assert_eq!(r("out/sub/../link"), "secret");
        assert_eq!(r(&format!("{}/out/a", root.display())), "out/a");
        // Dangling (its target would be created outside), escapes.
        assert_eq!(r("out/rel"), "OUT_OF_ROOT");
        assert_eq!(r("out/dangling"), "OUT_OF_ROOT");
        assert_eq!(r("out/etc/passwd"), "OUT_OF_ROOT");
        assert_eq!(r("../outside"), "OUT_OF_ROOT");
        assert_eq!(r("/etc/passwd"), "OUT_OF_ROOT");
        assert_eq!(r("out/missing/../../x"), "OUT_OF_ROOT");
    }
}
