//! Tenants: who shares the broker's bounded resources fairly — judges,
//! converters, audits, the Watch reserve, drains. A tree belongs to the
//! tenant of the key that opened its root. Keys alone cannot be told
//! apart (anyone can make a thousand), so only the operator makes
//! tenants: a `[tenants.NAME]` section names each tenant's keys, and every
//! key listed in `[orchestrators]` without one is a tenant of its own.
//! Every other key that may open roots (an open configuration) belongs to
//! one shared tenant, `OPEN_TENANT`: a thousand free keys share one turn.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::AgentKey;
use super::limits::{MAX_KEYS_PER_TENANT, MAX_TENANT_NAME_BYTES, MAX_TENANTS};

/// A tenant's identity wherever shares are counted (32 bytes, like a key:
/// a listed orchestrator's tenant is its key).
pub type TenantId = [u8; 32];

/// The name of the tenant every undeclared opener shares.
pub const OPEN_TENANT: &str = "open";

/// How the name of a listed orchestrator's own tenant begins (then its
/// key's first 8 bytes in hex): stable across restarts, and reserved, so a
/// declared tenant never shares a name with one (clients count shares by
/// name).
pub const ORCHESTRATOR_TENANT_PREFIX: &str = "orchestrator-";

/// The operator's tenants, by key.
#[derive(Clone, Debug, Default)]
pub struct Tenants {
    /// Declared keys (`[tenants]`, and `[orchestrators]` keys outside it)
    /// → their tenant.
    by_key: HashMap<AgentKey, TenantId>,
    /// Tenant → its name, for logs and metrics labels.
    names: HashMap<TenantId, String>,
}

/// Why a tenant declaration is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    #[error("a tenant name is 1 ..= {MAX_TENANT_NAME_BYTES} bytes of [A-Za-z0-9_.-]")]
    BadName,
    #[error("\"{OPEN_TENANT}\" names the shared tenant of undeclared keys; choose another name")]
    Reserved,
    #[error(
        "names beginning {ORCHESTRATOR_TENANT_PREFIX:?} are those of listed orchestrators' own tenants; choose another name"
    )]
    ReservedPrefix,
    #[error("at most {MAX_TENANTS} tenants")]
    TooManyTenants,
    #[error("at most {MAX_KEYS_PER_TENANT} keys a tenant")]
    TooManyKeys,
    #[error("this key is already a key of tenant {0:?}: a key belongs to one tenant")]
    KeyTwice(String),
}

/// The id of a declared tenant: a hash of its name, so it never equals a
/// key (a listed orchestrator's tenant id) or the open tenant's.
fn declared_id(name: &str) -> TenantId {
    let mut hash = Sha256::new();
    hash.update(b"delegation-broker tenant\0");
    hash.update(name.as_bytes());
    hash.finalize().into()
}

/// The shared tenant of every undeclared opener (hashed once: it is
/// looked up on every issuance and judgment).
pub fn open_tenant() -> TenantId {
    static OPEN: std::sync::LazyLock<TenantId> =
        std::sync::LazyLock::new(|| declared_id(OPEN_TENANT));
    *OPEN
}

impl Tenants {
    /// Declares `name` with `keys`; refused as `TenantError` says.
    pub fn declare(&mut self, name: &str, keys: &[AgentKey]) -> Result<(), TenantError> {
        let valid = !name.is_empty()
            && name.len() <= MAX_TENANT_NAME_BYTES
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !valid {
            return Err(TenantError::BadName);
        }
        if name == OPEN_TENANT {
            return Err(TenantError::Reserved);
        }
        if name.starts_with(ORCHESTRATOR_TENANT_PREFIX) {
            return Err(TenantError::ReservedPrefix);
        }
        if self.names.len() >= MAX_TENANTS {
            return Err(TenantError::TooManyTenants);
        }
        if keys.len() > MAX_KEYS_PER_TENANT {
            return Err(TenantError::TooManyKeys);
        }
        let id = declared_id(name);
        for key in keys {
            if let Some(other) = self.by_key.get(key).filter(|&&other| other != id) {
                let other = self.names.get(other).cloned().unwrap_or_default();
                return Err(TenantError::KeyTwice(other));
            }
        }
        for key in keys {
            self.by_key.insert(*key, id);
        }
        self.names.insert(id, name.to_owned());
        Ok(())
    }

    /// Makes `key` (a listed orchestrator) a tenant of its own unless a
    /// declared tenant lists it.
    pub fn orchestrator(&mut self, key: AgentKey) {
        if let std::collections::hash_map::Entry::Vacant(entry) = self.by_key.entry(key) {
            entry.insert(key);
            self.names.insert(
                key,
                format!("{ORCHESTRATOR_TENANT_PREFIX}{}", hex::encode(&key[..8])),
            );
        }
    }

    /// The tenant of a tree whose root `opener` opened.
    pub fn of(&self, opener: &AgentKey) -> TenantId {
        self.by_key.get(opener).copied().unwrap_or_else(open_tenant)
    }

    /// Whether the operator declared any tenant: without one every tree
    /// shares the open tenant, and fairness between callers is gone.
    pub fn any_declared(&self) -> bool {
        !self.by_key.is_empty()
    }

    /// The tenant a request takes its turn with at admission, before
    /// anything is read: a declared key's own; else, when the memo knows
    /// the contract the request names and the signer is its delegate or
    /// principal, that contract's tree's tenant; else the open tenant. A
    /// stranger naming another tenant's contract takes the open tenant's
    /// turn, never that tenant's.
    pub fn admitting(&self, signer: &AgentKey, named: Option<&Known>) -> TenantId {
        if let Some(tenant) = self.by_key.get(signer) {
            return *tenant;
        }
        match named {
            Some(known) if known.delegate == *signer || known.principal == *signer => known.tenant,
            _ => open_tenant(),
        }
    }

    /// A tenant's name (`OPEN_TENANT` for the shared one).
    pub fn name(&self, tenant: &TenantId) -> &str {
        self.names.get(tenant).map_or(OPEN_TENANT, String::as_str)
    }

    /// The name of the tenant of a tree whose root `opener` opened, as
    /// reads show it (ContractState.tenant).
    pub fn name_of(&self, opener: &AgentKey) -> &str {
        self.name(&self.of(opener))
    }
}

/// What admission remembers of a contract, so that its parties' requests
/// take their tree's tenant's turn without a read: the tenant, and the two
/// keys that act on it most (its delegate, and the principal that issued
/// it; a root's principal is its delegate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Known {
    pub tenant: TenantId,
    pub delegate: AgentKey,
    pub principal: AgentKey,
}

/// Which waiting items go now, tenants in turn: the oldest item of each
/// tenant (`waiting` is oldest first), starting with the first tenant
/// after `last` (the tenant served last, in `TenantId` order, wrapping),
/// at most `most`. Also returns the tenant served last, for the next
/// call. A tenant with a thousand waiting items gets one of them a turn,
/// like a tenant with one.
pub fn in_turn<T: Copy>(
    waiting: &[(TenantId, T)],
    last: Option<TenantId>,
    most: usize,
) -> (Vec<T>, Option<TenantId>) {
    let mut oldest: std::collections::BTreeMap<TenantId, T> = std::collections::BTreeMap::new();
    for (tenant, item) in waiting {
        oldest.entry(*tenant).or_insert(*item);
    }
    let after = last.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
    let chosen: Vec<(TenantId, T)> = oldest
        .range((after, std::ops::Bound::Unbounded))
        .chain(
            oldest
                .range(..=last.unwrap_or([0; 32]))
                .take_while(|_| last.is_some()),
        )
        .take(most)
        .map(|(t, i)| (*t, *i))
        .collect();
    let served = chosen.last().map(|(t, _)| *t).or(last);
    (chosen.into_iter().map(|(_, i)| i).collect(), served)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A declared key is its tenant's whatever it names; a party the memo
    /// knows takes the contract's tenant; a stranger, an unknown contract
    /// or no contract take the open tenant.
    #[test]
    fn admission_finds_the_tenant_without_a_read() {
        let mut tenants = Tenants::default();
        let (declared, delegate, principal, stranger) = ([1; 32], [2; 32], [3; 32], [4; 32]);
        tenants.declare("acme", &[declared]).expect("declared");
        let acme = tenants.of(&declared);
        let other: TenantId = [7; 32];
        let known = Known {
            tenant: other,
            delegate,
            principal,
        };
        assert_eq!(tenants.admitting(&declared, Some(&known)), acme);
        assert_eq!(tenants.admitting(&declared, None), acme);
        assert_eq!(tenants.admitting(&delegate, Some(&known)), other);
        assert_eq!(tenants.admitting(&principal, Some(&known)), other);
        assert_eq!(tenants.admitting(&stranger, Some(&known)), open_tenant());
        assert_eq!(tenants.admitting(&delegate, None), open_tenant());
    }

    #[test]
    fn declarations_are_bounded() {
        let mut tenants = Tenants::default();
        let long = "n".repeat(MAX_TENANT_NAME_BYTES + 1);
        assert_eq!(tenants.declare(&long, &[]), Err(TenantError::BadName));
        let too_many_keys: Vec<AgentKey> = (0..=MAX_KEYS_PER_TENANT)
            .map(|i| {
                let mut k = [0u8; 32];
                k[..8].copy_from_slice(&(i as u64).to_le_bytes());
                k
            })
            .collect();
        assert_eq!(
            tenants.declare("big", &too_many_keys),
            Err(TenantError::TooManyKeys)
        );
        for i in 0..MAX_TENANTS {
            tenants
                .declare(&format!("t{i}"), &[])
                .expect("within the bound");
        }
        assert_eq!(
            tenants.declare("one-more", &[]),
            Err(TenantError::TooManyTenants)
        );
    }

    #[test]
    fn each_opener_is_named_by_its_tenant() {
        let (a, b, free, listed) = ([1u8; 32], [2u8; 32], [3u8; 32], [0xab; 32]);
        let mut tenants = Tenants::default();
        assert_eq!(tenants.name_of(&free), OPEN_TENANT);
        tenants.declare("acme", &[a, b]).unwrap();
        tenants.orchestrator(listed);
        assert_eq!(tenants.name_of(&a), "acme");
        assert_eq!(tenants.name_of(&b), "acme");
        assert_eq!(tenants.name_of(&free), OPEN_TENANT);
        assert_eq!(tenants.name_of(&listed), "orchestrator-abababababababab");
        // Stable: the same configuration names it the same way again.
        let mut again = Tenants::default();
        again.orchestrator(listed);
        assert_eq!(again.name_of(&listed), tenants.name_of(&listed));
    }

    #[test]
    fn tenants_take_turns_whatever_they_have_waiting() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        // a has many old items, b and c one each, newer.
        let waiting = [(a, 1), (a, 2), (a, 3), (b, 10), (a, 4), (c, 20)];
        assert_eq!(in_turn(&waiting, None, 16), (vec![1, 10, 20], Some(c)));
        // Two a pass: the next pass starts after the last served.
        assert_eq!(in_turn(&waiting, None, 2), (vec![1, 10], Some(b)));
        assert_eq!(in_turn(&waiting, Some(b), 2), (vec![20, 1], Some(a)));
        assert_eq!(in_turn(&waiting, Some(a), 2), (vec![10, 20], Some(c)));
        // A tenant gone since: turns go on from where it would be.
        assert_eq!(in_turn(&[(a, 1), (c, 20)], Some(b), 1), (vec![20], Some(c)));
        assert_eq!(in_turn::<u8>(&[], Some(b), 4), (vec![], Some(b)));
        // Nothing twice in a pass, however few tenants.
        assert_eq!(in_turn(&[(a, 1), (a, 2)], Some(a), 4), (vec![1], Some(a)));
    }

    #[test]
    fn undeclared_keys_share_one_tenant_and_declared_ones_their_own() {
        let (a, b, c, listed) = ([1u8; 32], [2u8; 32], [3u8; 32], [4u8; 32]);
        let mut tenants = Tenants::default();
        assert!(!tenants.any_declared());
        assert_eq!(tenants.of(&a), tenants.of(&b), "free keys share a turn");
        tenants.declare("acme", &[a, b]).unwrap();
        tenants.orchestrator(listed);
        tenants.orchestrator(a); // listed in a tenant already: stays there
        assert!(tenants.any_declared());
        assert_eq!(tenants.of(&a), tenants.of(&b));
        assert_ne!(tenants.of(&a), tenants.of(&c));
        assert_eq!(tenants.of(&c), open_tenant());
        assert_eq!(tenants.of(&listed), listed);
        assert_eq!(tenants.name(&tenants.of(&a)), "acme");
        assert_eq!(tenants.name(&tenants.of(&c)), OPEN_TENANT);
        assert_eq!(
            tenants.declare("other", &[b]),
            Err(TenantError::KeyTwice("acme".into()))
        );
        assert_eq!(tenants.declare("open", &[c]), Err(TenantError::Reserved));
        assert_eq!(
            tenants.declare("orchestrator-0404040404040404", &[c]),
            Err(TenantError::ReservedPrefix),
            "a declared tenant cannot take a listed orchestrator's name"
        );
        assert_eq!(tenants.declare("", &[c]), Err(TenantError::BadName));
        assert_eq!(tenants.declare("a b", &[c]), Err(TenantError::BadName));
        assert_eq!(
            tenants.of(&c),
            open_tenant(),
            "a refused declaration declares nothing"
        );
    }
}
