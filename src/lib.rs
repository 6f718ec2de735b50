//! The delegation broker: a gRPC service every agent-to-agent delegation
//! passes through. See ARCHITECTURE.md for the map of this crate.

/// The pure domain (`crates/domain`), under the name its callers know.
pub use broker_domain as core;

pub use broker_wire::{chain, clock, command, crypto, jwt, names, pb, stamp};

/// The store (`crates/store`) and the concurrency pieces it shares with
/// the service.
pub use broker_store::{self as store, pool, slots};

/// Logs, traces, listeners and stopping, shared with the gateways
/// (`crates/runtime`).
pub use broker_runtime::telemetry;

pub mod cli;
pub mod config;
pub mod console;
pub mod identity;
pub mod keystore;
pub mod metrics;
pub mod server;
pub mod service;
pub mod tokens;

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
