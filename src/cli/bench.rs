//! The servers `bench` starts in its own process (`broker_tools::bench`
//! knows only the public API): this binary's broker, and the floor
//! server of its service.

use std::sync::Arc;

use broker_tools::bench::{BrokerRun, Servers, Serving};

use crate::clock::SystemClock;
use crate::config::{Config, Limits, TrustConfig};
use crate::pb;

/// This binary's broker and floor server.
pub struct InProcess;

impl Servers for InProcess {
    fn broker(&self, run: BrokerRun) -> anyhow::Result<Serving> {
        let BrokerRun {
            listeners,
            dir,
            attestor,
            stop,
            database,
        } = run;
        let mut config = Config::load(dir, None)?;
        config
            .trust
            .attestors
            .push(crate::crypto::public_key(&attestor)?);
        if listeners.tokens.is_some() {
            config.tokens.resources = vec![broker_tools::bench::TOKENS_RESOURCE.to_owned()];
            let (id, secret) = broker_tools::bench::TOKENS_INTROSPECTOR;
            config
                .tokens
                .introspectors
                .insert(id.to_owned(), crate::crypto::sha256(secret.as_bytes()));
        }
        let mut served = crate::server::Listeners::from(listeners.grpc);
        served.metrics = listeners.metrics;
        served.tokens = listeners.tokens;
        let options = crate::server::ServeOptions {
            database: database.map(|url| crate::server::DatabaseOptions { url, migrate: true }),
            ..Default::default()
        };
        Ok(Box::pin(async move {
            crate::server::run_with_options(served, config, Arc::new(SystemClock), options, async {
                let _ = stop.await;
            })
            .await
            .map_err(anyhow::Error::from)
        }))
    }

    fn floor(
        &self,
        listener: tokio::net::TcpListener,
        attestor: [u8; 32],
    ) -> anyhow::Result<Serving> {
        // The broker's defaults: its timestamp window, request bound and
        // accept loop (Nagle off).
        let limits = Limits::default();
        let trust = TrustConfig {
            attestors: vec![crate::crypto::public_key(&attestor)?],
            static_factors_ppm: Default::default(),
        };
        let floor = crate::service::floor::FloorService::new(
            crate::crypto::generate_signing_key(),
            trust,
            Arc::new(SystemClock),
            limits.timestamp_window_ms,
        );
        let (incoming, first_request) = broker_runtime::listen::incoming(
            listener,
            crate::server::connection_bounds(&limits),
            crate::metrics::Metrics::new().connection_counters("grpc"),
        );
        Ok(Box::pin(async move {
            tonic::transport::Server::builder()
                .layer(first_request.layer())
                .add_service(
                    pb::broker_server::BrokerServer::new(floor)
                        .max_decoding_message_size(limits.max_request_bytes),
                )
                .serve_with_incoming(incoming)
                .await
                .map_err(anyhow::Error::from)
        }))
    }
}
