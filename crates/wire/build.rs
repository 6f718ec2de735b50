//! Compiles the repository's `proto/` with protox (pure Rust, no system
//! `protoc`) and feeds the descriptors to tonic-prost-build: clients always,
//! servers only with the `server` feature (a verifier or a gateway needs no
//! service trait). The encoded descriptor set is written out for gRPC
//! server reflection.

use std::path::PathBuf;

const PROTO_ROOT: &str = "../../proto";
const PROTO_FILES: &[&str] = &[
    "../../proto/delegation/broker/v1/types.proto",
    "../../proto/delegation/broker/v1/errors.proto",
    "../../proto/delegation/broker/v1/broker.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Cargo only re-runs build scripts for paths we name; name each proto.
    println!("cargo:rerun-if-changed=build.rs");
    for file in PROTO_FILES {
        println!("cargo:rerun-if-changed={file}");
    }
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    let fds = protox::compile(PROTO_FILES, [PROTO_ROOT])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let encoded = prost::Message::encode_to_vec(&fds);
    std::fs::write(out_dir.join("broker_descriptor.bin"), encoded)?;
    tonic_prost_build::configure()
        .build_server(server)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
