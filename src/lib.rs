//! The delegation broker: a gRPC service every agent-to-agent delegation
//! passes through. See ARCHITECTURE.md for the map of this crate.

pub mod a2a;
pub mod chain;
pub mod cli;
pub mod client;
pub mod clock;
pub mod command;
pub mod config;
pub mod console;
pub mod core;
pub mod crypto;
pub mod keystore;
pub mod mcp;
pub mod metrics;
pub mod pool;
pub mod server;
pub mod service;
pub mod slots;
pub mod stamp;
pub mod store;
pub mod telemetry;

/// What this binary is: `delegation-broker version`, `broker_build_info`,
/// the spans' `service.version`.
pub mod build {
    /// The crate's version (Cargo.toml).
    pub const VERSION: &str = env!("CARGO_PKG_VERSION");
    /// The commit built (12 hex digits), or "unknown" (see build.rs).
    pub const COMMIT: &str = env!("BROKER_BUILD_COMMIT");
    /// The commit's date (RFC 3339, UTC), or "unknown".
    pub const DATE: &str = env!("BROKER_BUILD_DATE");
}

/// Types generated from `proto/delegation/broker/v1/*.proto`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("delegation.broker.v1");

    /// The encoded descriptor set of the public API, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/broker_descriptor.bin"));
}
