//! Assertions already used: each `(signer, jti)` is taken once, and
//! remembered until its `exp` (at most `MAX_ASSERTION_LIFETIME_S` away),
//! so a captured assertion cannot be exchanged again. Per process: the
//! replicas of a PostgreSQL broker each keep their own.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::core::AgentKey;

/// Most assertions remembered at once (about 200 bytes each). Full of
/// unexpired ones, new assertions are refused until some expire — never
/// forgotten early, which would open a replay.
pub const MAX_REMEMBERED_ASSERTIONS: usize = 100_000;

#[derive(Default)]
pub(super) struct Replay(Mutex<HashMap<(AgentKey, String), i64>>);

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    Fresh,
    Replayed,
    Full,
}

impl Replay {
    /// Takes `jti` of `signer`, remembered until `exp_s`.
    pub(super) fn take(&self, signer: AgentKey, jti: &str, exp_s: i64, now_s: i64) -> Taken {
        let mut seen = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (signer, jti.to_owned());
        if seen.get(&key).is_some_and(|&exp| exp >= now_s) {
            return Taken::Replayed;
        }
        if seen.len() >= MAX_REMEMBERED_ASSERTIONS {
            // Remembered past its exp plus the skew: the claims check
            // refuses it by then anyway.
            seen.retain(|_, exp| *exp + crate::core::token::CLOCK_SKEW_S >= now_s);
            if seen.len() >= MAX_REMEMBERED_ASSERTIONS {
                return Taken::Full;
            }
        }
        seen.insert(key, exp_s + crate::core::token::CLOCK_SKEW_S);
        Taken::Fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assertion_is_taken_once_until_it_expires() {
        let replay = Replay::default();
        assert_eq!(replay.take([1; 32], "a", 100, 50), Taken::Fresh);
        assert_eq!(replay.take([1; 32], "a", 100, 60), Taken::Replayed);
        // Another signer's same jti is its own.
        assert_eq!(replay.take([2; 32], "a", 100, 60), Taken::Fresh);
        // Past exp and skew, the claims check refuses it; the cache may
        // forget it.
        assert_eq!(replay.take([1; 32], "a", 200, 200), Taken::Fresh);
    }
}
