//! The command line: `serve`, `migrate`, `keygen`, `rotate-key`, `bench`,
//! `disk-probe`, `audit`, `verify`, `keys`, `version`; reading as a key: `session`, `get`,
//! `children`, `watch`, `receipt`. Every flag has an environment override.

pub mod attest;
pub mod audit;
pub mod bench;
pub mod health;
pub mod identity;
pub mod keys;
pub mod migrate;
pub mod read;
pub mod tls;
pub mod token;
pub mod tree;
pub mod verify;
pub mod write;

use broker_tools::{disk_probe, store_probe};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
        /// Serve Prometheus metrics at http://ADDR/metrics (off when
        /// absent), e.g. 127.0.0.1:9464.
        #[arg(long, env = "BROKER_METRICS")]
        metrics: Option<String>,
        /// Serve the read-only browser console at http://ADDR/ (off when
        /// absent), e.g. 127.0.0.1:8080. Needs `[console] reader` in the
        /// configuration; prints the URL with a fresh access token.
        #[arg(long, env = "BROKER_CONSOLE")]
        console: Option<String>,
        /// Serve the token endpoint at http://ADDR/ (off when absent), e.g.
        /// 127.0.0.1:8443: JWTs for resource servers (OAuth token exchange,
        /// JWKS, introspection). Configure `[tokens]`: the resources tokens
        /// are minted for.
        #[arg(long, env = "BROKER_TOKENS")]
        tokens: Option<String>,
        /// Export each call's span over OTLP to this collector, e.g.
        /// http://127.0.0.1:4317 (off when absent). The standard
        /// variables work too: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (wins,
        /// used as given), OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL = grpc
        /// (default) or http/protobuf (then /v1/traces is appended to this
        /// endpoint), OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
        /// OTEL_SDK_DISABLED.
        #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
        otlp_endpoint: Option<String>,
        /// The share of calls whose spans are exported, 0 to 1 (by trace
        /// id). The broker's own decision: a caller's unsampled
        /// `traceparent` does not switch it off (the span then starts a
        /// trace of its own, linked to the caller's). When absent,
        /// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG decide
        /// (always_on by default; parentbased_* export every call that
        /// continues a sampled caller's trace).
        #[arg(long, env = "BROKER_TRACE_SAMPLE_RATIO", value_parser = parse_sample_ratio)]
        trace_sample_ratio: Option<f64>,
        /// A file holding the signing key's secret seed (hex, as `keygen`
        /// writes it), e.g. mounted from a secret: read, never created,
        /// so every replica (or every restart of an ephemeral one) signs
        /// with the key the deployment gave it. The data directory's key
        /// (created on first start) when absent.
        #[arg(long, env = "BROKER_SIGNING_KEY_FILE")]
        signing_key_file: Option<PathBuf>,
        /// Listen beyond loopback although no tenant is declared: every
        /// caller then shares one tenant, so no caller is protected from
        /// another's load (docs/operating.md, "Tenants and fair shares").
        #[arg(long, env = "BROKER_ALLOW_OPEN_TENANT")]
        allow_open_tenant: bool,
        #[command(flatten)]
        logging: LoggingArgs,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Applies the PostgreSQL schema's pending migrations and exits: for
    /// deployments that migrate once, as a job, and start every replica
    /// with `serve --no-migrate`.
    Migrate {
        /// The shared database, e.g. postgres://broker@db:5432/broker.
        #[arg(long, env = "BROKER_DATABASE_URL")]
        database_url: String,
        /// Print the schema's current and latest version and what is
        /// pending, changing nothing: exit status 0 when the schema is
        /// up to date, 3 when migrations are pending.
        #[arg(long)]
        status: bool,
        /// With --status: one JSON object (database, current, latest,
        /// pending) instead of text.
        #[arg(long, requires = "status")]
        json: bool,
    },
    /// The broker's signing keys: `keys show` (the published ones, in hex
    /// and base64, as `verify --public-key` takes them); for a replicated
    /// broker (PostgreSQL) `keys list` and `keys retire KEY_ID`.
    Keys(keys::KeysArgs),
    /// Prints the version, the commit and its date.
    Version,
    /// Prints a completion script for SHELL, e.g.
    /// `delegation-broker completions bash > ~/.local/share/bash-completion/completions/delegation-broker`,
    /// `completions zsh > "${fpath[1]}/_delegation-broker"`,
    /// `completions fish > ~/.config/fish/completions/delegation-broker.fish`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Whether a broker serves: exit status 0 serving, 1 otherwise
    /// (`--wait-ms` waits for it, e.g. right after `serve &`).
    Health(health::HealthArgs),
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
    Bench(broker_tools::bench::BenchArgs),
    /// The disk's latency floor under durable answers: replays group
    /// commit (append, fdatasync) at a rate with no broker, to tell the
    /// disk's share of a latency tail from the broker's.
    DiskProbe(disk_probe::DiskProbeArgs),
    /// The store's CPU floor under `bench`'s workload: commits its rows
    /// (same sizes, same keys, same groups, fsynced and checkpointed) with
    /// no RPC, signature or rule, to bound a broker's share of the floor.
    StoreProbe(store_probe::StoreProbeArgs),
    /// Compares orchestration arms: aggregated audits as a table, JSON or
    /// CSV.
    Audit(audit::AuditArgs),
    /// Prints one delegation tree as indented text: each contract's
    /// delegate, status, depth, trust, deadline and ledger, the refusals
    /// beside the parent asked, and completion verdicts.
    Tree(tree::TreeArgs),
    /// Opens a read session and prints it as a header for grpcurl's `-H`.
    Session(read::SessionArgs),
    /// Prints one contract: its terms, status, ledger and effective predicate.
    Get(read::GetArgs),
    /// Prints a contract's children, one line each, in issuance order.
    Children(read::ChildrenArgs),
    /// Prints a subtree's events (contracts, receipts) as they happen.
    Watch(read::WatchArgs),
    /// Prints one receipt, verified against the broker's published keys.
    Receipt(read::ReceiptArgs),
    /// Opens a run: a root contract (intent, budget, deadline, policy)
    /// signed by its orchestrator; prints it.
    OpenRoot(write::OpenRootArgs),
    /// Delegates part of a contract the signer holds; prints the child,
    /// or the refusal with every violated invariant (exit status 3).
    Delegate(write::DelegateArgs),
    /// Accepts a contract delegated to the signer.
    Accept(write::AcceptArgs),
    /// Declines a contract delegated to the signer, before accepting it.
    Decline(write::EndingArgs),
    /// Completes an accepted contract; the receipt carries the verdict.
    Complete(write::CompleteArgs),
    /// Gives an accepted contract back as unresolvable.
    Escalate(write::EndingArgs),
    /// Revokes a contract below one the signer holds, with its subtree.
    Revoke(write::EndingArgs),
    /// Records what the host observed of a contract's work.
    Record(write::RecordArgs),
    /// Signs, as an attestor, an agent's trust factor into a file for
    /// `delegate --attestation`.
    Attest(attest::AttestArgs),
    /// Binds the key file's key to the workload identity a token proves
    /// (a SPIFFE JWT-SVID, an OIDC token of an `[identity]` issuer).
    BindIdentity(identity::BindIdentityArgs),
    /// Mints a JWT for a resource server from the token endpoint
    /// (`serve --tokens`), proving the signer holds the contract.
    Token(token::TokenArgs),
    /// The broker for MCP clients: `mcp tools` serves its calls as tools
    /// for a model, on stdio, signing as one agent.
    #[cfg(feature = "mcp")]
    Mcp(broker_mcp::McpArgs),
    /// The mandatory hop for an A2A agent: admits its tasks only under a
    /// broker contract naming it, and turns its outbound A2A calls into
    /// Delegates (docs/a2a.md).
    #[cfg(feature = "a2a")]
    A2aGateway(broker_a2a::A2aArgs),
    /// Verifies offline, with public keys alone: a whole chain (every
    /// contract's terms, as types.proto's "Verifying a chain" says), one
    /// receipt, or an agent's or attestor's DSSE envelope. Exit status 0
    /// when it verifies.
    Verify {
        /// Hex-encoded 32-byte ed25519 broker public key (GetBrokerKeys);
        /// repeat for retired keys. A retired key as HEX:RETIRED_AT_MS
        /// (its GetBrokerKeys `retired_at_ms`) vouches only for what it
        /// signed before then, as the A2A gateway's check says.
        #[arg(long = "public-key", required = true)]
        public_keys: Vec<String>,
        /// File holding a serialized `delegation.broker.v1.GetChainResponse`
        /// (what GetChain returns: root first).
        #[arg(long, conflicts_with_all = ["receipt", "envelope"], required_unless_present_any = ["receipt", "envelope"])]
        chain: Option<PathBuf>,
        /// Hex id the chain's last contract must have.
        #[arg(long, requires = "chain")]
        contract_id: Option<String>,
        /// Also batch-verify every contract's own signature (not needed to
        /// trust the chain: the leaf's covers it).
        #[arg(long, requires = "chain")]
        all_signatures: bool,
        /// File holding a serialized `delegation.broker.v1.Sealed` Receipt.
        #[arg(long, conflicts_with = "envelope")]
        receipt: Option<PathBuf>,
        /// File holding a serialized `delegation.broker.v1.Envelope` (a
        /// signed request or an attestation), checked against the first
        /// --public-key.
        #[arg(long)]
        envelope: Option<PathBuf>,
    },
}

/// How `serve` logs (to stderr; colours only on a terminal).
#[derive(clap::Args, Debug)]
pub struct LoggingArgs {
    /// Log filter: a level (error, warn, info, debug, trace) or `tracing`
    /// directives, e.g. `info,delegation_broker::store=debug`.
    #[arg(long, env = "BROKER_LOG", default_value = "info")]
    log_level: String,
    /// Log format: `text`, or `json` (one object per line, with the
    /// call's span: trace id, method, contract).
    #[arg(long, env = "BROKER_LOG_FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    log_format: String,
}

impl LoggingArgs {
    fn logging(&self) -> crate::telemetry::Logging {
        crate::telemetry::Logging {
            format: if self.log_format == "json" {
                crate::telemetry::LogFormat::Json
            } else {
                crate::telemetry::LogFormat::Text
            },
            filter: Some(self.log_level.clone()),
        }
    }
}

/// Where a replicated broker keeps its state.
#[derive(clap::Args, Debug)]
pub struct DatabaseArgs {
    /// A PostgreSQL database shared by every replica, e.g.
    /// postgres://broker@db:5432/broker (SQLite in --data-dir when
    /// absent). The data directory still holds this replica's signing key.
    #[arg(long, env = "BROKER_DATABASE_URL")]
    database_url: Option<String>,
    /// Do not apply pending migrations at start (they were applied by
    /// `delegation-broker migrate`); a database behind this broker's
    /// schema is refused.
    #[arg(long, requires = "database_url")]
    no_migrate: bool,
}

/// Parses arguments, sets up logging and runs the chosen command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = match crate::telemetry::Logging::from_env() {
        Ok(format) => format,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // `serve`, `bench`, `mcp gateway` and `a2a-gateway` install their own (they may
    // export traces, from their runtime).
    let own = match &cli.command {
        Command::Serve { .. } | Command::Bench(_) => true,
        #[cfg(feature = "a2a")]
        Command::A2aGateway(_) => true,
        #[cfg(feature = "mcp")]
        Command::Mcp(args) => args.installs_telemetry(),
        _ => false,
    };
    if !own && let Err(e) = crate::telemetry::init_logging(&format) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<write::Refused>() || e.is::<token::TokenRefused>() => {
            eprintln!("{e}");
            ExitCode::from(write::REFUSED_EXIT_STATUS)
        }
        Err(e) if e.is::<migrate::Pending>() => {
            eprintln!("{e}");
            ExitCode::from(migrate::MIGRATIONS_PENDING_EXIT_STATUS)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `version`: what this binary is.
fn version() {
    println!(
        "delegation-broker {} (commit {}, {})",
        crate::build::VERSION,
        crate::build::COMMIT,
        crate::build::DATE
    );
}

/// Runs one command.
fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve {
            listen,
            data_dir,
            config,
            metrics,
            console,
            tokens,
            otlp_endpoint,
            trace_sample_ratio,
            signing_key_file,
            allow_open_tenant,
            logging,
            database,
        } => serve(
            (listen, allow_open_tenant),
            (data_dir, signing_key_file),
            config,
            (metrics, console, tokens),
            (otlp_endpoint, trace_sample_ratio),
            database,
            logging.logging(),
        ),
        Command::Migrate {
            database_url,
            status,
            json,
        } => match (status, json) {
            (false, _) => migrate::run(&database_url),
            (true, json) => migrate::status(&database_url, json),
        },
        Command::Keys(args) => keys::run(args),
        Command::Health(args) => health::run(args),
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            let mut command = Cli::command();
            clap_complete::generate(
                shell,
                &mut command,
                "delegation-broker",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Version => {
            version();
            Ok(())
        }
        Command::Keygen { out } => keygen(out),
        Command::RotateKey { data_dir } => crate::keystore::rotate(&data_dir)
            .map(|key| println!("{}", hex::encode(key.to_bytes())))
            .map_err(anyhow::Error::from),
        Command::Bench(args) => broker_tools::bench::run(args, &bench::InProcess),
        Command::DiskProbe(args) => disk_probe::run(args),
        Command::StoreProbe(args) => store_probe::run(args),
        Command::Audit(args) => audit::run(args),
        Command::Tree(args) => tree::run(args),
        Command::Session(args) => read::session(args),
        Command::Get(args) => read::get(args),
        Command::Children(args) => read::children(args),
        Command::Watch(args) => read::watch(args),
        Command::Receipt(args) => read::receipt(args),
        Command::OpenRoot(args) => write::open_root(args),
        Command::Delegate(args) => write::delegate(args),
        Command::Accept(args) => write::accept(args),
        Command::Decline(args) => write::decline(args),
        Command::Complete(args) => write::complete(args),
        Command::Escalate(args) => write::escalate(args),
        Command::Revoke(args) => write::revoke(args),
        Command::Record(args) => write::record(args),
        Command::Attest(args) => attest::run(args),
        Command::Token(args) => token::run(args),
        Command::BindIdentity(args) => identity::run(args),
        #[cfg(feature = "mcp")]
        Command::Mcp(args) => broker_mcp::run(args),
        #[cfg(feature = "a2a")]
        Command::A2aGateway(args) => broker_a2a::run(args),
        Command::Verify {
            public_keys,
            chain,
            contract_id,
            all_signatures,
            receipt,
            envelope,
        } => match envelope {
            Some(path) => verify::verify_envelope(&public_keys[0], &path),
            None => verify::verify(
                &public_keys,
                chain.as_deref(),
                contract_id.as_deref(),
                all_signatures,
                receipt.as_deref(),
            ),
        },
    }
}

fn serve(
    (listen, allow_open_tenant): (String, bool),
    (data_dir, signing_key_file): (PathBuf, Option<PathBuf>),
    config: Option<PathBuf>,
    (metrics, console, tokens): (Option<String>, Option<String>, Option<String>),
    (otlp_endpoint, trace_sample_ratio): (Option<String>, Option<f64>),
    database: DatabaseArgs,
    logging: crate::telemetry::Logging,
) -> anyhow::Result<()> {
    let config = Config::load(data_dir, config.as_deref())?;
    // CEL parsing at issuance recurses: give workers a deep stack.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(crate::core::limits::WORKER_STACK_BYTES)
        .build()?;
    let result = runtime.block_on(async move {
        let telemetry =
            crate::telemetry::init(&logging, otlp_endpoint.as_deref(), trace_sample_ratio)?;
        let listener = bind(&listen, "--listen").await?;
        // Printed on stdout once the store is open and the broker serves:
        // with port 0 it is how callers (tests, scripts) learn the port,
        // and "listening" means calls will be answered.
        let mut announced = vec![format!("listening on {}", listener.local_addr()?)];
        let (ready, serving) = tokio::sync::oneshot::channel();
        let options = crate::server::ServeOptions {
            database: database
                .database_url
                .map(|url| crate::server::DatabaseOptions {
                    url,
                    migrate: !database.no_migrate,
                }),
            signing_key_file,
            ready: Some(ready),
            allow_open_tenant,
        };
        let mut listeners = crate::server::Listeners::from(listener);
        if let Some(address) = metrics {
            let metrics_listener = bind(&address, "--metrics").await?;
            announced.push(format!(
                "metrics on http://{}/metrics",
                metrics_listener.local_addr()?
            ));
            listeners.metrics = Some(metrics_listener);
        }
        if let Some(address) = console {
            let listener = bind(&address, "--console").await?;
            let token = crate::console::new_token();
            // Printed once, on stdout, never through the logger (where
            // stdout is collected, treat it as secret as the log). The
            // fragment stays in the browser, out of request lines and
            // proxies' logs.
            announced.push(format!(
                "console on http://{}/#token={token}",
                listener.local_addr()?
            ));
            listeners.console = Some(crate::console::ConsoleOptions { listener, token });
        }
        if let Some(address) = tokens {
            let listener = bind(&address, "--tokens").await?;
            announced.push(format!("tokens on http://{}", listener.local_addr()?));
            listeners.tokens = Some(listener);
        }
        tokio::spawn(async move {
            if serving.await.is_ok() {
                {
                    use std::io::Write as _;
                    let mut out = std::io::stdout().lock();
                    for line in announced {
                        let _ = writeln!(out, "{line}");
                    }
                    let _ = out.flush();
                }
                broker_runtime::notify::send("READY=1").await;
            }
        });
        // Listening for the signals from now on, before anything answers.
        let signal = broker_runtime::shutdown::signal();
        let shutdown = async {
            signal.await;
            broker_runtime::notify::send("STOPPING=1").await;
        };
        crate::server::run_with_options(
            listeners,
            config,
            std::sync::Arc::new(crate::clock::SystemClock),
            options,
            shutdown,
        )
        .await?;
        telemetry.shutdown().await;
        Ok(())
    });
    // The drain is over (or was cut): tasks still running are dropped,
    // and a blocking task that does not return cannot hold the exit.
    runtime.shutdown_timeout(RUNTIME_STOP);
    result
}

/// Longest the runtime waits for its blocking tasks at exit.
const RUNTIME_STOP: std::time::Duration = std::time::Duration::from_secs(1);

/// A listener on `address`; an error names the flag and the address.
async fn bind(address: &str, flag: &str) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context as _;
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("{flag} {address}: cannot listen"))
}

fn keygen(out: PathBuf) -> anyhow::Result<()> {
    if out.exists() {
        anyhow::bail!("{} exists; refusing to overwrite a key", out.display());
    }
    let agent = broker_client::Agent::generate();
    crate::keystore::write_secret(&out, &format!("{}\n", hex::encode(agent.seed())))?;
    println!("{}", hex::encode(agent.public_key()));
    Ok(())
}

/// `--trace-sample-ratio`: a number from 0 to 1.
fn parse_sample_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("{text:?} is not a number from 0 to 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A contract id in URL-safe base64 begins with `-` one time in 64:
    /// the read commands take it as the id, and still know their options
    /// around it.
    #[test]
    fn an_id_that_begins_with_a_hyphen_is_an_id() {
        let id = "-A5bkzJsLFvJ4WI5IhYNRXNQ5VMAAJyII7FrMuaSqVs";
        for command in ["get", "children", "watch"] {
            let cli = Cli::try_parse_from([
                "delegation-broker",
                command,
                "--json",
                id,
                "--key-file",
                "reader.key",
            ])
            .unwrap_or_else(|e| panic!("{command}: {e}"));
            let (parsed, json) = match cli.command {
                Command::Get(args) => (args.contract_id, args.json),
                Command::Children(args) => (args.contract_id, args.json),
                Command::Watch(args) => (args.contract_id, args.json),
                other => panic!("{command}: parsed as {other:?}"),
            };
            assert_eq!((parsed.as_str(), json), (id, true), "{command}");
        }
        let cli = Cli::try_parse_from(["delegation-broker", "get", id, "--key-file", "k"])
            .expect("the id first");
        assert!(matches!(cli.command, Command::Get(args) if args.contract_id == id && !args.json));
    }
}
