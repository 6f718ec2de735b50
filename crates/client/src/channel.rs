//! The channel to the broker, opened one way by every client in the
//! binary (the CLI, both gateways, the tools): the address checked and
//! named when it is wrong, the connection bounded in time, and TLS for an
//! `https://` address (a CA file or the system's roots, and a client
//! certificate when the broker asks for one).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::BrokerError;

/// The variables a client without flags (a gateway) reads its TLS from;
/// the CLI's `--ca-file`, `--client-cert` and `--client-key` read them too.
pub const CA_FILE_VAR: &str = "BROKER_CA_FILE";
pub const CLIENT_CERT_VAR: &str = "BROKER_CLIENT_CERT";
pub const CLIENT_KEY_VAR: &str = "BROKER_CLIENT_KEY";
/// Largest PEM file read (a certificate chain is a few KiB).
pub const MAX_PEM_FILE_BYTES: u64 = 1024 * 1024;

/// How an `https://` broker is reached: the CA its certificate must chain
/// to (the system's roots when `None`) and this client's certificate and
/// key when the broker asks for one. Read from files once, at start.
#[derive(Clone, Debug, Default)]
pub struct Tls {
    ca_pem: Option<Vec<u8>>,
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl Tls {
    /// Reads the files; an error names the one that cannot be read.
    pub fn load(
        ca_file: Option<&Path>,
        client_cert: Option<&Path>,
        client_key: Option<&Path>,
    ) -> Result<Self, BrokerError> {
        let identity_pem = match (client_cert, client_key) {
            (Some(cert), Some(key)) => Some((pem(cert, "client_cert")?, pem(key, "client_key")?)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(BrokerError::input(
                    "client_key",
                    "is needed with a client certificate",
                ));
            }
            (None, Some(_)) => {
                return Err(BrokerError::input(
                    "client_cert",
                    "is needed with a client key",
                ));
            }
        };
        let ca_pem = ca_file.map(|path| pem(path, "ca_file")).transpose()?;
        Ok(Self {
            ca_pem,
            identity_pem,
        })
    }

    /// From `BROKER_CA_FILE`, `BROKER_CLIENT_CERT` and `BROKER_CLIENT_KEY`
    /// (what the gateways use).
    pub fn from_env() -> Result<Self, BrokerError> {
        let var = |name: &str| std::env::var_os(name).map(PathBuf::from);
        let (ca, cert, key) = (var(CA_FILE_VAR), var(CLIENT_CERT_VAR), var(CLIENT_KEY_VAR));
        Self::load(ca.as_deref(), cert.as_deref(), key.as_deref())
    }

    fn config(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new();
        let config = match &self.ca_pem {
            Some(ca) => config.ca_certificate(Certificate::from_pem(ca)),
            None => config.with_native_roots(),
        };
        match &self.identity_pem {
            Some((cert, key)) => config.identity(Identity::from_pem(cert, key)),
            None => config,
        }
    }
}

/// A PEM file's bytes, bounded; `field` names it in the error.
fn pem(path: &Path, field: &str) -> Result<Vec<u8>, BrokerError> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_PEM_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| BrokerError::input(field, format!("{}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_PEM_FILE_BYTES {
        return Err(BrokerError::input(
            field,
            format!("{}: larger than {MAX_PEM_FILE_BYTES} bytes", path.display()),
        ));
    }
    Ok(bytes)
}

/// `addr` as an endpoint with its connection bounded by `connect_timeout`,
/// over TLS when it is `https://`.
pub fn endpoint(addr: &str, connect_timeout: Duration, tls: &Tls) -> Result<Endpoint, BrokerError> {
    let endpoint = Endpoint::from_shared(addr.to_owned()).map_err(|_| {
        BrokerError::input(
            "addr",
            format!("{addr:?} is not a URI such as http://127.0.0.1:50051"),
        )
    })?;
    let endpoint = endpoint.connect_timeout(connect_timeout);
    if !addr.starts_with("https://") {
        return Ok(endpoint);
    }
    endpoint
        .tls_config(tls.config())
        .map_err(|e| BrokerError::input("addr", format!("{addr}: TLS: {e}")))
}

/// A channel connected now: an unreachable broker, or one whose
/// certificate is not trusted, is an error naming it.
pub async fn connect(
    addr: &str,
    connect_timeout: Duration,
    tls: &Tls,
) -> Result<Channel, BrokerError> {
    endpoint(addr, connect_timeout, tls)?
        .connect()
        .await
        .map_err(|e| {
            // The sources say why (a refused connection, a certificate).
            let why = crate::error::with_causes(&e);
            BrokerError::new("UNAVAILABLE", format!("cannot connect to {addr}: {why}"))
        })
}

/// A channel connected on first use (a gateway may start before the
/// broker), each call bounded by `call_timeout`.
pub fn lazy(
    addr: &str,
    connect_timeout: Duration,
    call_timeout: Duration,
    tls: &Tls,
) -> Result<Channel, BrokerError> {
    Ok(endpoint(addr, connect_timeout, tls)?
        .timeout(call_timeout)
        .connect_lazy())
}

/// Whether the broker at `addr` is serving (gRPC health, the whole
/// server): `Ok(false)` when it answers NOT_SERVING (starting, draining,
/// its store unreachable); an error when it does not answer.
pub async fn serving(addr: &str, timeout: Duration, tls: &Tls) -> Result<bool, BrokerError> {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let channel = connect(addr, timeout, tls).await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = health.check(HealthCheckRequest {
        service: String::new(),
    });
    let answer = tokio::time::timeout(timeout, check).await.map_err(|_| {
        BrokerError::new("DEADLINE_EXCEEDED", format!("{addr}: no health answer"))
    })??;
    Ok(answer.into_inner().status == ServingStatus::Serving as i32)
}
