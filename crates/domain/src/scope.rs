//! Write scopes: sets of path prefixes. A child's scope must lie within its
//! parent's (attenuation), and a host-observed write outside the scope is a
//! claim violation (docs/design.md, seed 000).

use super::error::InputError;
use super::limits::{MAX_SCOPE_PREFIX_BYTES, MAX_SCOPE_PREFIXES};

/// A validated, normalized list of path prefixes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    /// Normalized prefixes: no trailing '/', no empty, "." or ".."
    /// components; "/" alone means every absolute path.
    prefixes: Vec<String>,
}

impl Scope {
    /// Validates and normalizes client-supplied prefixes. `field` names the
    /// request field in the error.
    pub fn parse(raw: &[String], field: &'static str) -> Result<Self, InputError> {
        if raw.len() > MAX_SCOPE_PREFIXES {
            return Err(InputError::new(
                field,
                format!(
                    "{} prefixes, at most {MAX_SCOPE_PREFIXES} allowed",
                    raw.len()
                ),
            ));
        }
        let mut prefixes = Vec::with_capacity(raw.len());
        for (i, p) in raw.iter().enumerate() {
            prefixes.push(normalize(p).map_err(|why| {
                InputError::new(
                    field,
                    format!("prefix {i} ({}): {why}", super::error::echo(p)),
                )
            })?);
        }
        prefixes.sort();
        prefixes.dedup();
        Ok(Self { prefixes })
    }

    /// Prefixes as stored and signed.
    pub fn prefixes(&self) -> &[String] {
        &self.prefixes
    }

    /// Builds a scope from prefixes that were validated before (read back
    /// from the store or a signed contract).
    pub fn from_trusted(prefixes: Vec<String>) -> Self {
        Self { prefixes }
    }

    /// True when `path` is equal to or below one of the prefixes.
    pub fn covers(&self, path: &str) -> bool {
        self.prefixes.iter().any(|p| is_under(path, p))
    }

    /// True when a host-observed `path` lies within the scope. The path is
    /// normalized first ("./", "//" and a trailing "/" are dropped); a path
    /// with a ".." component or a control character is never covered, so
    /// "src/exec/../../etc" cannot pass as being under "src/exec".
    pub fn covers_observed(&self, path: &str) -> bool {
        normalize_observed(path).is_some_and(|p| self.covers(&p))
    }

    /// The prefixes of `self` that no prefix of `parent` covers.
    pub fn widening_over<'a>(&'a self, parent: &Scope) -> Vec<&'a str> {
        self.prefixes
            .iter()
            .filter(|p| !parent.covers(p))
            .map(String::as_str)
            .collect()
    }
}

fn normalize(raw: &str) -> Result<String, &'static str> {
    if raw.is_empty() {
        return Err("empty prefix");
    }
    if raw.len() > MAX_SCOPE_PREFIX_BYTES {
        return Err("longer than 1024 bytes");
    }
    if raw.chars().any(|c| c.is_control()) {
        return Err("control character");
    }
    // Observed paths treat '\\' as a separator (see `normalize_observed`); a
    // prefix must say what it means with '/'.
    if raw.contains('\\') {
        return Err("backslash: use '/' as the separator");
    }
    if raw == "/" {
        return Ok("/".to_owned());
    }
    let trimmed = raw.trim_end_matches('/');
    let body = trimmed.strip_prefix('/').unwrap_or(trimmed);
    for component in body.split('/') {
        match component {
            "" => return Err("empty path component"),
            "." | ".." => return Err("'.' and '..' components are not allowed"),
            _ => {}
        }
    }
    Ok(trimmed.to_owned())
}

/// Lexical normalization of an observed path; `None` when it escapes
/// upwards or is not a path at all. Both '/' and '\\' separate components:
/// a host on Windows reports `src\\exec\\..\\..\\etc`, which must not pass
/// as one component under `src/exec`.
fn normalize_observed(raw: &str) -> Option<String> {
    if raw.is_empty() || raw.chars().any(|c| c.is_control()) {
        return None;
    }
    let absolute = raw.starts_with(['/', '\\']);
    let mut parts = Vec::new();
    for component in raw.split(['/', '\\']) {
        match component {
            "" | "." => {}
            ".." => return None,
            c => parts.push(c),
        }
    }
    let joined = parts.join("/");
    match (absolute, joined.is_empty()) {
        (true, _) => Some(format!("/{joined}")),
        (false, true) => None,
        (false, false) => Some(joined),
    }
}

/// Component-wise prefix test: "src/auth" is under "src", "srcx" is not.
pub fn is_under(path: &str, prefix: &str) -> bool {
    if prefix == "/" {
        return path.starts_with('/');
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(p: &[&str]) -> Scope {
        Scope::parse(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "s").unwrap()
    }

    #[test]
    fn prefixes_match_whole_components_only() {
        assert!(is_under("src/auth/token.rs", "src/auth"));
        assert!(is_under("src/auth", "src/auth"));
        assert!(!is_under("src/authx", "src/auth"));
        assert!(is_under("/etc/x", "/"));
        assert!(!is_under("etc/x", "/"));
    }

    #[test]
    fn narrowing_is_allowed_and_widening_reported() {
        let parent = scope(&["src/", "docs"]);
        assert!(
            scope(&["src/auth", "docs/a.md"])
                .widening_over(&parent)
                .is_empty()
        );
        assert_eq!(
            scope(&["src/auth", "tests"]).widening_over(&parent),
            vec!["tests"]
        );
        assert!(Scope::default().widening_over(&parent).is_empty());
    }

    #[test]
    fn observed_paths_are_normalized_and_never_escape() {
        let s = scope(&["src/exec", "/tmp/out"]);
        for inside in [
            "src/exec/a.rs",
            "./src/exec/a.rs",
            "src//exec/",
            "/tmp/out/x",
            "src\\exec\\a.rs",
        ] {
            assert!(s.covers_observed(inside), "{inside}");
        }
        for outside in [
            "docs/x.md",
            "src/exec/../../etc/passwd",
            "src/exec/..",
            "src/execx",
            "",
            ".",
            "/",
            "tmp/out/x",
            "src/exec/a\nb",
            // Backslashes separate components too.
            "src/exec/..\\..\\etc\\passwd",
            "src\\exec\\..\\..\\etc",
            "src/exec\\..",
        ] {
            assert!(!s.covers_observed(outside), "{outside:?}");
        }
        assert!(!Scope::default().covers_observed("src/exec/a.rs"));
    }

    #[test]
    fn malformed_prefixes_name_the_field() {
        for bad in ["", "a/../b", "./a", "a//b", "src\\exec"] {
            let err = Scope::parse(&[bad.to_string()], "write_scope").unwrap_err();
            assert_eq!(err.field, "write_scope");
        }
    }
}
