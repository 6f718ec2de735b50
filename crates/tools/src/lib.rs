//! The load and probe tools: `bench` (a load generator over the public
//! API; the broker and the floor server it may start in its own process
//! are handed to it by the binary, `bench::Servers`), `disk-probe` (the
//! disk's own latency floor) and `store-probe` (the store's CPU floor).
//! Outside the server: they measure it, and are built into the binary as
//! its commands.

pub mod bench;
pub mod disk_probe;
pub mod seeded;
pub mod store_probe;
