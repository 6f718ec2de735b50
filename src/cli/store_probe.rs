//! `store-probe`: the store's own floor under `bench`'s workload — the
//! CPU SQLite and the kernel take to commit its rows durably with this
//! schema, with no RPC, signature or rule (`store::sqlite::probe`). Read
//! beside `bench --floor`: a broker's CPU per delegation is at least the
//! two together, which bounds its share of the floor.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::store::sqlite::probe::{self, StoreProbeOptions};

#[derive(Args, Debug)]
pub struct StoreProbeArgs {
    /// Directory on the disk to probe (the broker's data directory): a
    /// scratch database is written there and removed afterwards.
    #[arg(long, env = "BROKER_DATA_DIR", default_value = "broker-data")]
    pub dir: PathBuf,
    /// Chains in flight (as `bench --concurrency`).
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Delegations per chain (as `bench --depth`).
    #[arg(long, default_value_t = 8)]
    pub depth: u32,
    /// Contracts per commit and fsync: `bench`'s commands per WAL fsync
    /// (it prints both; about 13 in a closed loop of 64 on two cores).
    #[arg(long, default_value_t = 16)]
    pub group: usize,
    /// Contracts to write, roots included (as many as the `bench` run
    /// being compared committed: the B-trees' size sets their cost).
    #[arg(long, default_value_t = 60_000)]
    pub contracts: u64,
    /// Drop this index first, to price it (repeatable).
    #[arg(long = "drop-index")]
    pub drop_indexes: Vec<String>,
    /// Leave the request log out, to price its random-keyed B-tree.
    #[arg(long)]
    pub no_request_log: bool,
}

pub fn run(args: StoreProbeArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let path = args
        .dir
        .join(format!("store-probe-{}.sqlite3", std::process::id()));
    let options = StoreProbeOptions {
        path: path.clone(),
        workers: args.workers,
        depth: args.depth,
        group: args.group,
        contracts: args.contracts,
        drop_indexes: args.drop_indexes.clone(),
        no_request_log: args.no_request_log,
    };
    let report = probe::run(&options);
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.clone().into_os_string();
        name.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(name));
    }
    let report = report?;
    let delegations = report.contracts - report.roots;
    let per = |total: f64| total / delegations.max(1) as f64;
    println!(
        "store probe: {} contracts ({} roots) in {} commits of up to {} over {:.1}s in {}{}{}",
        report.contracts,
        report.roots,
        report.commits,
        args.group,
        report.wall.as_secs_f64(),
        args.dir.display(),
        if args.drop_indexes.is_empty() {
            String::new()
        } else {
            format!(", without {}", args.drop_indexes.join(", "))
        },
        if args.no_request_log {
            ", no request log"
        } else {
            ""
        },
    );
    println!(
        "store floor: {:.1} µs of CPU per delegation (roots counted in, as `bench` counts its CPU); \
         {:.0} delegations/s on one thread",
        per(report.cpu.as_secs_f64() * 1e6),
        delegations as f64 / report.wall.as_secs_f64().max(1e-9),
    );
    println!(
        "WAL: {:.2} frames ({:.1} KiB) per delegation",
        per(report.wal_frames as f64),
        per((report.wal_frames * (report.page_bytes + WAL_FRAME_HEADER_BYTES)) as f64) / 1024.0,
    );
    super::disk_probe::print_percentiles("commit ms:  ", &report.commit_us);
    super::disk_probe::print_percentiles("fsync ms:   ", &report.fsync_us);
    Ok(())
}

/// Bytes SQLite writes before each page in the WAL.
const WAL_FRAME_HEADER_BYTES: u64 = 24;
