//! The wire: what a verifier or a client needs and nothing a server does —
//! the types generated from `proto/`, signing and verification (`crypto`),
//! the sealed contract format (`stamp`), EdDSA JWTs (`jwt`), the commands a request becomes
//! (`command`), offline chain verification (`chain`) and the clock.

pub mod chain;
pub mod clock;
pub mod command;
pub mod crypto;
pub mod jwt;
pub mod names;
pub mod stamp;
pub mod throttle;

/// Types generated from `proto/delegation/broker/v1/*.proto`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("delegation.broker.v1");

    /// The encoded descriptor set of the public API, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/broker_descriptor.bin"));
}
