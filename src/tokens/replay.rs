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
/// A full sweep of the memory (every signer's expired assertions) at
/// most this often: while it is full, each exchange would otherwise scan
/// all of it.
const SWEEP_EVERY_S: i64 = 1;

/// Each signer's used `jti`s, with when each may be forgotten.
#[derive(Default)]
pub(super) struct Replay(Mutex<Remembered>);

#[derive(Default)]
struct Remembered {
    by_signer: HashMap<AgentKey, HashMap<String, i64>>,
    total: usize,
    swept_at_s: i64,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    Fresh,
    Replayed,
    /// This signer has its share (`per_signer`) in use.
    SignerFull,
    Full,
}

impl Remembered {
    /// Forgets every signer's expired assertions: remembered past its exp
    /// plus the skew, the claims check refuses it by then anyway. At most
    /// once a `SWEEP_EVERY_S`.
    fn sweep(&mut self, now_s: i64) {
        if now_s - self.swept_at_s < SWEEP_EVERY_S {
            return;
        }
        self.swept_at_s = now_s;
        self.by_signer.retain(|_, jtis| {
            jtis.retain(|_, until| *until >= now_s);
            !jtis.is_empty()
        });
        self.total = self.by_signer.values().map(HashMap::len).sum();
    }

    /// Forgets `signer`'s expired assertions (at most its share): how
    /// many it has left.
    fn forget_expired_of(&mut self, signer: &AgentKey, now_s: i64) -> usize {
        let Some(jtis) = self.by_signer.get_mut(signer) else {
            return 0;
        };
        let before = jtis.len();
        jtis.retain(|_, until| *until >= now_s);
        let left = jtis.len();
        self.total -= before - left;
        left
    }
}

impl Replay {
    /// Takes `jti` of `signer`, remembered until `exp_s` plus the skew;
    /// `signer` may have `per_signer` in use.
    pub(super) fn take(
        &self,
        signer: AgentKey,
        jti: &str,
        (exp_s, now_s): (i64, i64),
        per_signer: usize,
    ) -> Taken {
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
        if mine >= per_signer && memory.forget_expired_of(&signer, now_s) >= per_signer {
            return Taken::SignerFull;
        }
        if memory.total >= MAX_REMEMBERED_ASSERTIONS {
            memory.sweep(now_s);
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

    const SHARE: usize = 1_000;

    #[test]
    fn an_assertion_is_taken_once_until_it_expires() {
        let replay = Replay::default();
        assert_eq!(replay.take([1; 32], "a", (100, 50), SHARE), Taken::Fresh);
        assert_eq!(replay.take([1; 32], "a", (100, 60), SHARE), Taken::Replayed);
        // Another signer's same jti is its own.
        assert_eq!(replay.take([2; 32], "a", (100, 60), SHARE), Taken::Fresh);
        // Past exp and skew, the claims check refuses it; the cache may
        // forget it.
        assert_eq!(replay.take([1; 32], "a", (200, 200), SHARE), Taken::Fresh);
    }

    #[test]
    fn one_signer_cannot_fill_the_memory() {
        let replay = Replay::default();
        for n in 0..SHARE {
            let jti = n.to_string();
            assert_eq!(replay.take([1; 32], &jti, (100, 50), SHARE), Taken::Fresh);
        }
        assert_eq!(
            replay.take([1; 32], "one more", (100, 50), SHARE),
            Taken::SignerFull
        );
        assert_eq!(
            replay.take([2; 32], "another's", (100, 50), SHARE),
            Taken::Fresh
        );
        // Once its assertions expire, the signer takes new ones.
        assert_eq!(
            replay.take([1; 32], "later", (300, 200), SHARE),
            Taken::Fresh
        );
    }

    #[test]
    fn a_full_memory_is_swept_at_most_once_a_second() {
        let replay = Replay::default();
        for n in 0..MAX_REMEMBERED_ASSERTIONS {
            let signer = [(n % 200) as u8; 32];
            let jti = n.to_string();
            assert_eq!(replay.take(signer, &jti, (100, 50), SHARE), Taken::Fresh);
        }
        assert_eq!(replay.take([255; 32], "x", (100, 50), SHARE), Taken::Full);
        // All expired by 200: the sweep frees them.
        assert_eq!(replay.take([255; 32], "y", (300, 200), SHARE), Taken::Fresh);
    }
}
