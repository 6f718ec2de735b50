//! The Rust client of the broker, and the one layer the CLI, both gateways
//! and the end-to-end tests call it through: an agent's key and key file,
//! signed requests, read sessions, a request sent again with the same
//! bytes, the one `BrokerError`, the names of codes and statuses, and the
//! tree as text. It knows the public API (`broker-wire`) and nothing of
//! the server.

pub mod agent;
pub mod channel;
pub mod error;
pub mod keys;
pub mod link;
pub mod names;
pub mod token;
pub mod trace;
pub mod tree;
pub mod watch;

pub use agent::{Agent, SessionAttacher, SessionClient};

use broker_wire::pb;
use prost::Message as _;

/// The terms a contract's sealed envelope carries; `None` when there is
/// none or it does not decode (the caller says what that means to it).
pub fn terms(sealed: Option<&pb::Sealed>) -> Option<pb::Contract> {
    pb::Contract::decode(sealed?.payload.as_slice()).ok()
}
pub use error::BrokerError;
pub use link::{Body, Ending, Link, Receipted, Sendable};
