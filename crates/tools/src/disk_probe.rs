//! `disk-probe`: the latency floor the disk alone puts under durable
//! answers. It replays the broker's group commit with no broker around it:
//! requests "arrive" at a fixed rate; a loop like the store's syncer takes
//! every request that has arrived, appends the bytes they would add to the
//! write-ahead log, `fdatasync`s, and counts each request's latency from
//! its arrival to the end of that fsync. A broker on the same disk cannot
//! answer durably faster than this; run it beside `bench` to tell the
//! disk's share of a latency tail from the broker's.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

/// Bytes a delegation adds to the WAL, measured at 4,000/s (BENCHMARKS.md:
/// about 4.7 frames of 4 KiB each).
pub const DEFAULT_BYTES_PER_REQUEST: u64 = 19_456;
/// The probe file wraps around at this size, as the WAL restarts from its
/// beginning at `WAL_RESTART_BYTES`: overwrites, not ever-growing appends.
const PROBE_FILE_BYTES: u64 = broker_store::sqlite::WAL_RESTART_BYTES;
/// Upper bounds on the flags (each keeps the probe's memory and disk use
/// bounded: one latency sample of 4 bytes per request).
const MAX_RATE_PER_S: u64 = 100_000;
const MAX_DURATION_S: u64 = 600;
const MAX_BYTES_PER_REQUEST: u64 = 1024 * 1024;
/// Most requests in one run (`rate` × `duration_s`): 40 MB of samples.
const MAX_REQUESTS: u64 = 10_000_000;

#[derive(Args, Debug)]
pub struct DiskProbeArgs {
    /// Directory on the disk to probe (the broker's data directory). A
    /// scratch file of 128 MiB (the WAL's restart size) is written there, unlinked from the start.
    #[arg(long, env = "BROKER_DATA_DIR", default_value = "broker-data")]
    pub dir: PathBuf,
    /// Requests per second arriving (as `bench --rate`).
    #[arg(long, env = "DISK_PROBE_RATE", default_value_t = 4000)]
    pub rate: u64,
    /// Bytes each request adds to the log before the fsync.
    #[arg(long, env = "DISK_PROBE_BYTES_PER_REQUEST", default_value_t = DEFAULT_BYTES_PER_REQUEST)]
    pub bytes_per_request: u64,
    /// Seconds to run.
    #[arg(long, env = "DISK_PROBE_DURATION_S", default_value_t = 30)]
    pub duration_s: u64,
    /// Latency that counts as a stall, in milliseconds (the target's p99).
    #[arg(long, env = "DISK_PROBE_STALL_MS", default_value_t = 5)]
    pub stall_ms: u64,
}

/// What one probe run measured.
#[derive(Debug)]
pub struct ProbeReport {
    /// Each request's latency (arrival to the end of its fsync), sorted, µs.
    pub latencies_us: Vec<u32>,
    /// Each fsync's own duration, sorted, µs.
    pub fsyncs_us: Vec<u32>,
    /// Wall time spent inside fsyncs longer than the stall threshold.
    pub stalled: Duration,
    /// The run's wall time.
    pub wall: Duration,
}

pub fn run(args: DiskProbeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_RATE_PER_S).contains(&args.rate),
        "--rate must be 1..={MAX_RATE_PER_S}"
    );
    anyhow::ensure!(
        (1..=MAX_DURATION_S).contains(&args.duration_s),
        "--duration-s must be 1..={MAX_DURATION_S}"
    );
    anyhow::ensure!(
        args.rate.saturating_mul(args.duration_s) <= MAX_REQUESTS,
        "--rate × --duration-s must be at most {MAX_REQUESTS} requests"
    );
    anyhow::ensure!(
        (1..=MAX_BYTES_PER_REQUEST).contains(&args.bytes_per_request),
        "--bytes-per-request must be 1..={MAX_BYTES_PER_REQUEST}"
    );
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let path = args
        .dir
        .join(format!("disk-probe-{}.tmp", std::process::id()));
    let stall = Duration::from_millis(args.stall_ms);
    let report = probe(&path, &args, stall)?;
    let requests = report.latencies_us.len();
    println!(
        "disk probe: {requests} requests at {}/s, {} B each, {} fsyncs over {:.1}s in {}",
        args.rate,
        args.bytes_per_request,
        report.fsyncs_us.len(),
        report.wall.as_secs_f64(),
        args.dir.display()
    );
    print_percentiles("fsync ms:          ", &report.fsyncs_us);
    print_percentiles("request floor ms:  ", &report.latencies_us);
    let over = report
        .latencies_us
        .iter()
        .filter(|&&us| u128::from(us) > stall.as_micros())
        .count();
    println!(
        "stalls: {:.2}% of wall time inside fsyncs over {} ms; {:.2}% of requests over {} ms",
        100.0 * report.stalled.as_secs_f64() / report.wall.as_secs_f64().max(1e-9),
        args.stall_ms,
        100.0 * over as f64 / requests.max(1) as f64,
        args.stall_ms,
    );
    Ok(())
}

/// The group-commit loop (see module docs). Blocking: it runs on the CLI's
/// own thread, never inside the async runtime.
pub fn probe(path: &Path, args: &DiskProbeArgs, stall: Duration) -> anyhow::Result<ProbeReport> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    // Unlinked at once: the open file lives on until the probe exits, and
    // nothing is left behind even if it is killed.
    std::fs::remove_file(path).with_context(|| format!("unlinking {}", path.display()))?;
    preallocate(&mut file)?;
    let interval = Duration::from_secs_f64(1.0 / args.rate as f64);
    let total = args.rate.saturating_mul(args.duration_s);
    let chunk = vec![0x5a_u8; usize::try_from(args.bytes_per_request)?];
    let mut latencies_us = Vec::with_capacity(usize::try_from(total)?);
    let mut fsyncs_us = Vec::new();
    let mut stalled = Duration::ZERO;
    let mut offset = 0u64;
    let mut arrived = 0u64;
    let start = Instant::now();
    while arrived < total {
        let now = start.elapsed();
        // Every request whose arrival time has passed joins this group.
        let due = total.min(arrivals_by(now, interval) + 1);
        if due <= arrived {
            std::thread::sleep(arrival_time(arrived, interval).saturating_sub(now));
            continue;
        }
        for _ in arrived..due {
            if offset + args.bytes_per_request > PROBE_FILE_BYTES {
                offset = 0;
            }
            file.seek(SeekFrom::Start(offset))?;
            file.write_all(&chunk)?;
            offset += args.bytes_per_request;
        }
        let began = Instant::now();
        file.sync_data()
            .with_context(|| format!("fdatasync of {}", path.display()))?;
        let took = began.elapsed();
        if took > stall {
            stalled += took;
        }
        fsyncs_us.push(micros(took));
        let done = start.elapsed();
        for i in arrived..due {
            latencies_us.push(micros(done.saturating_sub(arrival_time(i, interval))));
        }
        arrived = due;
    }
    let wall = start.elapsed();
    latencies_us.sort_unstable();
    fsyncs_us.sort_unstable();
    Ok(ProbeReport {
        latencies_us,
        fsyncs_us,
        stalled,
        wall,
    })
}

/// Writes the whole file once and syncs it, so the probe's fsyncs are data
/// only, like the WAL's after its first restart.
fn preallocate(file: &mut File) -> anyhow::Result<()> {
    let block = vec![0u8; 1024 * 1024];
    let mut written = 0u64;
    while written < PROBE_FILE_BYTES {
        file.write_all(&block)?;
        written += block.len() as u64;
    }
    file.sync_all()?;
    Ok(())
}

/// The index of the last request that has arrived by `elapsed`.
fn arrivals_by(elapsed: Duration, interval: Duration) -> u64 {
    u64::try_from(elapsed.as_nanos() / interval.as_nanos().max(1)).unwrap_or(u64::MAX)
}

/// When request `i` arrives.
fn arrival_time(i: u64, interval: Duration) -> Duration {
    interval.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX))
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// The `q` quantile of sorted samples (nearest rank).
fn percentile(sorted: &[u32], q: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One line of percentiles of sorted samples in µs, shown in ms.
pub(super) fn print_percentiles(label: &str, sorted_us: &[u32]) {
    println!(
        "{label} p50 {}  p99 {}  p999 {}  max {}",
        ms(percentile(sorted_us, 0.50)),
        ms(percentile(sorted_us, 0.99)),
        ms(percentile(sorted_us, 0.999)),
        ms(sorted_us.last().copied().unwrap_or(0)),
    );
}

fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_is_counted_once_from_its_arrival() {
        let dir = tempfile::tempdir().unwrap();
        let args = DiskProbeArgs {
            dir: dir.path().to_path_buf(),
            rate: 200,
            bytes_per_request: 4096,
            duration_s: 1,
            stall_ms: 5,
        };
        let report = probe(&dir.path().join("p"), &args, Duration::from_millis(5)).unwrap();
        assert!(!dir.path().join("p").exists(), "nothing is left behind");
        assert_eq!(report.latencies_us.len(), 200);
        assert!(!report.fsyncs_us.is_empty() && report.fsyncs_us.len() <= 200);
        // A request waits at least for the fsync that covers it.
        assert!(report.latencies_us[0] >= report.fsyncs_us[0]);
        // Arrivals span the run, so the run lasts at least until the last.
        assert!(report.wall >= Duration::from_millis(995));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&samples, 0.50), 50);
        assert_eq!(percentile(&samples, 0.99), 99);
        assert_eq!(percentile(&samples, 1.0), 100);
        assert_eq!(percentile(&[], 0.99), 0);
    }
}
