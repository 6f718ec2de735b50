//! Compiles `proto/` with protox (pure Rust, no system `protoc`) and feeds
//! the descriptors to tonic-prost-build. The encoded descriptor set is also
//! written out for gRPC server reflection.

use std::path::PathBuf;

const PROTO_ROOT: &str = "proto";
const PROTO_FILES: &[&str] = &[
    "proto/delegation/broker/v1/types.proto",
    "proto/delegation/broker/v1/errors.proto",
    "proto/delegation/broker/v1/broker.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Cargo only re-runs build scripts for paths we name; name each proto.
    println!("cargo:rerun-if-changed=build.rs");
    // `sqlx::migrate!` embeds the migrations when the crate compiles: a new
    // migration file must recompile it (cargo watches directories' entries).
    println!("cargo:rerun-if-changed=migrations/sqlite");
    println!("cargo:rerun-if-changed=migrations/postgres");
    for file in PROTO_FILES {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(PROTO_FILES, [PROTO_ROOT])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let encoded = prost::Message::encode_to_vec(&fds);
    std::fs::write(out_dir.join("broker_descriptor.bin"), encoded)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
