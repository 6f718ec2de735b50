//! End-to-end tests: a real broker on 127.0.0.1:0, driven over gRPC.

mod a2a_authz;
mod a2a_ingress;
mod audit;
mod auth;
mod bad_input;
mod bench;
mod cli_read;
mod cli_write;
mod concurrency;
mod console;
mod crash;
mod drains;
mod fairness;
mod hardening;
mod harness;
mod invariants;
mod lifecycle;
mod offline;
mod operability;
mod operations;
mod readme;
mod replicas;
mod seeds;
mod sockets;
mod tls;
mod tree;
