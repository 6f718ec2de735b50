//! Assertions already used: each `(signer, jti)` is taken once, and
//! remembered until its `exp` (at most `MAX_ASSERTION_LIFETIME_S` away),
//! so a captured assertion cannot be exchanged again. Per process: the
//! replicas of a PostgreSQL broker each keep their own.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::core::AgentKey;

/// Most assertions remembered at once (about 250 bytes each). Full of
/// unexpired ones, new assertions are refused until some expire — never
/// forgotten early, which would open a replay.
pub const MAX_REMEMBERED_ASSERTIONS: usize = 100_000;
/// Most unexpired assertions of one signer: far above one holder's needs
/// (a token lives minutes), so one holder cannot fill the memory alone.
pub const MAX_ASSERTIONS_PER_SIGNER: usize = 1_000;

/// Each signer's used `jti`s, with when each may be forgotten.
#[derive(Default)]
pub(super) struct Replay(Mutex<Remembered>);

#[derive(Default)]
struct Remembered {
    by_signer: HashMap<AgentKey, HashMap<String, i64>>,
    total: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    Fresh,
    Replayed,
    /// This signer has `MAX_ASSERTIONS_PER_SIGNER` in use.
    SignerFull,
    Full,
}

impl Remembered {
    /// Forgets what expired: remembered past its exp plus the skew, the
    /// claims check refuses it by then anyway.
    fn forget_expired(&mut self, now_s: i64) {
        self.by_signer.retain(|_, jtis| {
            jtis.retain(|_, until| *until >= now_s);
            !jtis.is_empty()
        });
        self.total = self.by_signer.values().map(HashMap::len).sum();
    }
}

impl Replay {
    /// Takes `jti` of `signer`, remembered until `exp_s` plus the skew.
    pub(super) fn take(&self, signer: AgentKey, jti: &str, exp_s: i64, now_s: i64) -> Taken {
        let mut memory = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let used = memory
            .by_signer
            .get(&signer)
            .and_then(|jtis| jtis.get(jti))
            .is_some_and(|&until| until >= now_s);
        if used {
            return Taken::Replayed;
        }
        let mine = memory.by_signer.get(&signer).map_or(0, HashMap::len);
        if mine >= MAX_ASSERTIONS_PER_SIGNER || memory.total >= MAX_REMEMBERED_ASSERTIONS {
            memory.forget_expired(now_s);
            if memory.by_signer.get(&signer).map_or(0, HashMap::len) >= MAX_ASSERTIONS_PER_SIGNER {
                return Taken::SignerFull;
            }
            if memory.total >= MAX_REMEMBERED_ASSERTIONS {
                return Taken::Full;
            }
        }
        let until = exp_s + crate::core::token::CLOCK_SKEW_S;
        if memory
            .by_signer
            .entry(signer)
            .or_default()
            .insert(jti.to_owned(), until)
            .is_none()
        {
            memory.total += 1;
        }
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

    #[test]
    fn one_signer_cannot_fill_the_memory() {
        let replay = Replay::default();
        for n in 0..MAX_ASSERTIONS_PER_SIGNER {
            assert_eq!(replay.take([1; 32], &n.to_string(), 100, 50), Taken::Fresh);
        }
        assert_eq!(replay.take([1; 32], "one more", 100, 50), Taken::SignerFull);
        assert_eq!(replay.take([2; 32], "another's", 100, 50), Taken::Fresh);
        // Once its assertions expire, the signer takes new ones.
        assert_eq!(replay.take([1; 32], "later", 300, 200), Taken::Fresh);
    }
}
