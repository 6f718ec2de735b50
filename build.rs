//! The binary's build information (`build::COMMIT`, `build::DATE`); the
//! generated API types are `crates/wire`'s.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_info();
}

/// `delegation-broker version`'s commit and date: `BROKER_BUILD_COMMIT`
/// and `BROKER_BUILD_DATE` when the builder sets them (a Docker build has
/// no `.git`), else git's HEAD and its commit date (reproducible: the
/// same commit builds the same text), else "unknown".
fn build_info() {
    println!("cargo:rerun-if-env-changed=BROKER_BUILD_COMMIT");
    println!("cargo:rerun-if-env-changed=BROKER_BUILD_DATE");
    // HEAD names the branch; the branch's ref file moves with each commit.
    // Named only when present: a missing path would rerun this script on
    // every build (a Docker build has no .git).
    if std::path::Path::new(".git/HEAD").exists() {
        println!("cargo:rerun-if-changed=.git/HEAD");
    }
    if let Ok(head) = std::fs::read_to_string(".git/HEAD")
        && let Some(reference) = head.trim().strip_prefix("ref: ")
    {
        let path = format!(".git/{reference}");
        // A packed ref has no file of its own: then HEAD's commit shows
        // from the next change of HEAD or of build inputs.
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .env("TZ", "UTC")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .map(|text| text.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let commit = std::env::var("BROKER_BUILD_COMMIT")
        .ok()
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    let date = std::env::var("BROKER_BUILD_DATE")
        .ok()
        .or_else(|| git(&["log", "-1", "--format=%cd", "--date=iso-strict-local"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=BROKER_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=BROKER_BUILD_DATE={date}");
}
