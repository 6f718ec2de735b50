//! `--ca-file`, `--client-cert`, `--client-key`: how every command that
//! calls the broker reaches an `https://` address (`--addr`).

use std::path::PathBuf;

use broker_client::channel::Tls;
use clap::Args;

#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// A PEM file of the CA the broker's certificate must chain to, for
    /// an https:// address (the system's roots when absent).
    #[arg(long, env = "BROKER_CA_FILE", value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// A PEM client certificate, for a broker that asks for one.
    #[arg(
        long,
        env = "BROKER_CLIENT_CERT",
        value_name = "FILE",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,
    /// The PEM private key of `--client-cert`.
    #[arg(
        long,
        env = "BROKER_CLIENT_KEY",
        value_name = "FILE",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The files read, off the async workers.
    pub async fn load(&self) -> anyhow::Result<Tls> {
        let args = self.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            Tls::load(
                args.ca_file.as_deref(),
                args.client_cert.as_deref(),
                args.client_key.as_deref(),
            )
        });
        Ok(loaded.await??)
    }
}
