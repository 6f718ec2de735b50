//! The command line: `serve`, `keygen`, `rotate-key`, `bench`,
//! `disk-probe`, `audit`, `verify`. Every flag has an environment override.

pub mod audit;
pub mod bench;
pub mod disk_probe;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::config::Config;

#[derive(Parser, Debug)]
#[command(
    name = "delegation-broker",
    version,
    about = "A gRPC delegation broker for AI agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs the broker. On first start it creates its signing key and
    /// database in the data directory; later starts reuse them.
    Serve {
        /// Address to listen on.
        #[arg(long, env = "BROKER_LISTEN", default_value = "127.0.0.1:50051")]
        listen: String,
        /// Directory for the signing key and the SQLite database.
        #[arg(long, env = "BROKER_DATA_DIR", default_value = "broker-data")]
        data_dir: PathBuf,
        /// Optional TOML file: trusted attestors, static trust, limits.
        #[arg(long, env = "BROKER_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Generates an agent key pair; prints the public key and writes the
    /// secret seed (hex) to a file readable only by its owner.
    Keygen {
        /// Where to write the secret seed.
        #[arg(long, env = "BROKER_KEYGEN_OUT")]
        out: PathBuf,
    },
    /// Retires the broker's current signing key and creates a new one. Run
    /// while the broker is stopped.
    RotateKey {
        #[arg(long, env = "BROKER_DATA_DIR", default_value = "broker-data")]
        data_dir: PathBuf,
    },
    /// Load generator: drives OpenRoot + Delegate chains over gRPC.
    Bench(bench::BenchArgs),
    /// The disk's latency floor under durable answers: replays group
    /// commit (append, fdatasync) at a rate with no broker, to tell the
    /// disk's share of a latency tail from the broker's.
    DiskProbe(disk_probe::DiskProbeArgs),
    /// Compares orchestration arms: aggregated audits as a table, JSON or
    /// CSV.
    Audit(audit::AuditArgs),
    /// Verifies a DSSE envelope (binary protobuf `Envelope`) offline against
    /// an ed25519 public key. Exit status 0 when a signature verifies.
    Verify {
        /// Hex-encoded 32-byte ed25519 public key (e.g. from GetBrokerKeys).
        #[arg(long)]
        public_key: String,
        /// File holding the serialized `delegation.broker.v1.Envelope`.
        #[arg(long)]
        envelope: PathBuf,
    },
}

/// Parses arguments, sets up logging and runs the chosen command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("BROKER_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve {
            listen,
            data_dir,
            config,
        } => serve(listen, data_dir, config),
        Command::Keygen { out } => keygen(out),
        Command::RotateKey { data_dir } => crate::keystore::rotate(&data_dir)
            .map(|key| println!("{}", hex::encode(key.to_bytes())))
            .map_err(anyhow::Error::from),
        Command::Bench(args) => bench::run(args),
        Command::DiskProbe(args) => disk_probe::run(args),
        Command::Audit(args) => audit::run(args),
        Command::Verify {
            public_key,
            envelope,
        } => verify(&public_key, &envelope),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(listen: String, data_dir: PathBuf, config: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(data_dir, config.as_deref())?;
    // CEL parsing at issuance recurses: give workers a deep stack.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(crate::core::limits::WORKER_STACK_BYTES)
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        // Print the bound address on stdout: with port 0 it is how callers
        // (tests, scripts) learn the port.
        println!("listening on {}", listener.local_addr()?);
        crate::server::run(listener, config, shutdown_signal()).await?;
        Ok(())
    })
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown requested; draining");
}

fn keygen(out: PathBuf) -> anyhow::Result<()> {
    if out.exists() {
        anyhow::bail!("{} exists; refusing to overwrite a key", out.display());
    }
    let agent = crate::client::Agent::generate();
    crate::keystore::write_secret(&out, &format!("{}\n", hex::encode(agent.seed())))?;
    println!("{}", hex::encode(agent.public_key()));
    Ok(())
}

fn verify(public_key: &str, envelope: &std::path::Path) -> anyhow::Result<()> {
    use prost::Message;
    let key = crate::config::parse_public_key(public_key, "--public-key")?;
    let bytes = std::fs::read(envelope)?;
    let envelope = crate::pb::Envelope::decode(bytes.as_slice())?;
    let known = [
        crate::crypto::payload_type::CONTRACT,
        crate::crypto::payload_type::HOP_PROOF,
        crate::crypto::payload_type::RECEIPT,
        crate::crypto::payload_type::ATTESTATION,
        crate::crypto::payload_type::SESSION,
        crate::crypto::payload_type::OPEN_ROOT,
        crate::crypto::payload_type::DELEGATE,
        crate::crypto::payload_type::OPEN_SESSION,
    ];
    let payload_type = known
        .into_iter()
        .find(|t| *t == envelope.payload_type)
        .ok_or_else(|| anyhow::anyhow!("unknown payload type {:?}", envelope.payload_type))?;
    crate::crypto::verify_envelope(&envelope, payload_type, &key)?;
    println!(
        "ok {payload_type} {}",
        crate::crypto::key_id(&key.to_bytes())
    );
    Ok(())
}
