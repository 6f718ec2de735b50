//! What every server of the workspace shares — the broker, its console,
//! the A2A and MCP gateways: logs and traces (`telemetry`), listeners that
//! bound connections and drop silent sockets (`listen`), and stopping on
//! SIGINT or SIGTERM (`shutdown`). It knows the public API's names
//! (`broker-wire`) and nothing of the broker's service or store.

pub mod listen;
pub mod shutdown;
pub mod telemetry;
