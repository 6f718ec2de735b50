//! Read authorization: who may read a tree, and learn from a refusal that
//! a contract exists. A reader the operator configured reads every tree;
//! a party — the delegate or the host of one of its contracts — reads its
//! own; anyone else gets what an unknown id gets, so a stranger cannot
//! tell a real id from a random one.

/// A caller's standing toward a contract's tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// A reader the operator configured (`[readers]`).
    Reader,
    /// The delegate or the host of a contract of the tree.
    Party,
    /// Neither.
    Stranger,
    /// There is no such contract.
    Unknown,
}

impl Standing {
    /// A caller that is not a configured reader, from the store's answer
    /// (`None`: no such contract). A reader needs no store answer.
    pub fn of_party(party: Option<bool>) -> Self {
        match party {
            None => Self::Unknown,
            Some(false) => Self::Stranger,
            Some(true) => Self::Party,
        }
    }
}

/// Whether a caller of this standing may read the tree, and may be told
/// that the contract exists. Everyone else is answered NOT_FOUND, the
/// answer to an id that names nothing.
pub fn may_read(standing: Standing) -> bool {
    match standing {
        Standing::Reader | Standing::Party => true,
        Standing::Stranger | Standing::Unknown => false,
    }
}

/// Whether `caller` is named by a contract itself, as its delegate or its
/// host: then it is a party of the contract's tree, with no look at the
/// rest of the tree.
pub fn names_party(
    delegate: &[u8],
    host: Option<&crate::AgentKey>,
    caller: &crate::AgentKey,
) -> bool {
    delegate == caller.as_slice() || host == Some(caller)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contract_names_its_delegate_and_its_host_and_no_one_else() {
        let (delegate, host, other) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        assert!(names_party(&delegate, Some(&host), &delegate));
        assert!(names_party(&delegate, Some(&host), &host));
        assert!(!names_party(&delegate, Some(&host), &other));
        assert!(!names_party(&delegate, None, &other));
        // A delegate key of the wrong length names no one.
        assert!(!names_party(&delegate[..31], None, &[1u8; 32]));
    }

    #[test]
    fn only_readers_and_parties_read_and_a_stranger_is_told_what_an_unknown_id_is() {
        assert!(may_read(Standing::Reader));
        assert!(may_read(Standing::of_party(Some(true))));
        assert_eq!(
            may_read(Standing::of_party(Some(false))),
            may_read(Standing::of_party(None))
        );
        assert!(!may_read(Standing::of_party(None)));
    }
}
