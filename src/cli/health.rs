//! `health`: whether a broker serves, for a supervisor or a script, as
//! grpc_health_probe answers it: exit status 0 serving, 1 otherwise.

use std::time::{Duration, Instant};

use clap::Args;

/// Longest one check may take (connection and answer).
const CHECK_TIMEOUT_MS: u64 = 2_000;
/// Pause between checks while `--wait-ms` lasts.
const RECHECK_MS: u64 = 100;

#[derive(Args, Debug, Clone)]
pub struct HealthArgs {
    /// Broker address, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "BROKER_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// Check again until the broker serves or this many milliseconds
    /// pass (0: check once), e.g. right after starting it.
    #[arg(long, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub wait_ms: u64,
    #[command(flatten)]
    pub tls: super::tls::TlsArgs,
}

/// `health`: prints `serving`, or fails saying why not.
pub fn run(args: HealthArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let until = Instant::now() + Duration::from_millis(args.wait_ms);
        let timeout = Duration::from_millis(CHECK_TIMEOUT_MS);
        let tls = args.tls.load().await?;
        loop {
            let why_not = match broker_client::channel::serving(&args.addr, timeout, &tls).await {
                Ok(true) => {
                    println!("serving");
                    return Ok(());
                }
                Ok(false) => format!("{}: NOT_SERVING", args.addr),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= until {
                anyhow::bail!("{why_not}");
            }
            tokio::time::sleep(Duration::from_millis(RECHECK_MS)).await;
        }
    })
}
