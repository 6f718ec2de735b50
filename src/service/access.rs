//! Who is asking and what they may learn: the session of a read, the
//! tenant of a tree, whether a caller is a party (strangers are told what
//! an unknown id gets), and the answer to a correctly signed retry that
//! arrived late.

use tonic::Request;

use super::error::ServiceError;
use super::{BrokerService, auth, convert};

use super::limits::MAX_REMEMBERED_PARTIES;
use crate::core::access::{self, Standing};
use crate::store::{Answer, Store};
use crate::telemetry::{self, Fact};

/// Whether a stored contract names `caller` as its delegate or host, so
/// it is a party without a read of the rest of the tree.
pub(super) fn names(record: &crate::store::ContractRecord, caller: &crate::core::AgentKey) -> bool {
    let delegate = convert::delegate_key_of(&record.envelope);
    access::names_party(&delegate, record.host_key.as_ref(), caller)
}

impl<S: Store> BrokerService<S> {
    /// The reading agent of a request (its session), or UNAUTHENTICATED.
    pub(super) fn caller<T>(
        &self,
        request: &Request<T>,
    ) -> Result<crate::core::AgentKey, ServiceError> {
        let caller = self
            .sessions
            .caller(request.metadata(), self.clock.now_ms())?;
        telemetry::record(Fact::AgentKey(&caller));
        Ok(caller)
    }

    /// The tenant of `contract`'s tree: the key that opened its root.
    pub(super) async fn tenant_of(
        &self,
        contract: crate::core::Id,
    ) -> Result<crate::core::AgentKey, ServiceError> {
        self.store
            .issuing_parent(contract)
            .await?
            .map(|p| p.tenant)
            .ok_or_else(|| ServiceError::not_found(crate::store::Entity::Contract, contract))
    }

    /// `caller`'s standing toward `contract`'s tree (`core::access`): a
    /// reader listed by key asks nothing of the store, nor does a party
    /// seen before.
    async fn standing(
        &self,
        caller: &crate::core::AgentKey,
        contract: crate::core::Id,
    ) -> Result<Standing, ServiceError> {
        if self.config.readers.contains(caller) {
            return Ok(Standing::Reader);
        }
        let remembered = self
            .parties
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&(contract, *caller));
        if remembered {
            return Ok(Standing::Party);
        }
        // A reader by identity costs a read of its binding, when readers
        // are named by identity at all.
        if self.reader_by_identity(caller).await? {
            return Ok(Standing::Reader);
        }
        let standing = Standing::of_party(self.store.is_party(contract, *caller).await?);
        if standing == Standing::Party {
            let mut parties = self
                .parties
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if parties.len() >= MAX_REMEMBERED_PARTIES {
                parties.clear();
            }
            parties.insert((contract, *caller));
        }
        Ok(standing)
    }

    /// Whether `caller` may learn that `contract` exists. Asked only on
    /// refusal paths, so an honest call pays nothing for it.
    pub(super) async fn may_know(
        &self,
        caller: &crate::core::AgentKey,
        contract: crate::core::Id,
    ) -> Result<bool, ServiceError> {
        Ok(access::may_read(self.standing(caller, contract).await?))
    }

    /// Lets `caller` read `contract`'s tree only if `core::access` allows
    /// it; NOT_FOUND otherwise, as for an id that names nothing.
    pub(super) async fn authorize(
        &self,
        caller: &crate::core::AgentKey,
        contract: crate::core::Id,
    ) -> Result<(), ServiceError> {
        if access::may_read(self.standing(caller, contract).await?) {
            return Ok(());
        }
        Err(ServiceError::not_found(
            crate::store::Entity::Contract,
            contract,
        ))
    }

    /// A read of the tree of the contract named by `id` (raw bytes from
    /// the request), by the request's session.
    pub(super) async fn authorize_read<T>(
        &self,
        request: &Request<T>,
        id: &[u8],
        field: &'static str,
    ) -> Result<(crate::core::Id, crate::pool::Turn), ServiceError> {
        let (caller, id, turn) = self.read_turn(request, id, field).await?;
        self.authorize(&caller, id).await?;
        Ok((id, turn))
    }

    /// The caller, the contract id and the caller's turn at work for a
    /// read of that contract, not yet authorized.
    async fn read_turn<T>(
        &self,
        request: &Request<T>,
        id: &[u8],
        field: &'static str,
    ) -> Result<(crate::core::AgentKey, crate::core::Id, crate::pool::Turn), ServiceError> {
        let caller = self.caller(request)?;
        let id = convert::id(id, field)?;
        telemetry::record(Fact::ContractId(&id));
        let turn = self
            .gate
            .admit(&self.config.tenants, &caller, Some(&id))
            .await?;
        Ok((caller, id, turn))
    }

    /// `authorize_read` for a read that loads the contract anyway: it is
    /// loaded first, and a caller it names as its delegate or host needs
    /// no other read to be a party (`access::names_party`).
    pub(super) async fn authorize_record<T>(
        &self,
        request: &Request<T>,
        id: &[u8],
        field: &'static str,
    ) -> Result<(crate::store::ContractRecord, crate::pool::Turn), ServiceError> {
        let (caller, id, turn) = self.read_turn(request, id, field).await?;
        let record = self.store.contract(id).await?;
        if !record.as_ref().is_some_and(|record| names(record, &caller)) {
            self.authorize(&caller, id).await?;
        }
        let record =
            record.ok_or_else(|| ServiceError::not_found(crate::store::Entity::Contract, id))?;
        Ok((record, turn))
    }

    /// A place at work for a read naming no contract (its caller's
    /// tenant's turn).
    pub(super) async fn admit_caller(
        &self,
        caller: &crate::core::AgentKey,
    ) -> Result<crate::pool::Turn, ServiceError> {
        self.gate.admit(&self.config.tenants, caller, None).await
    }

    /// A correctly signed request outside the timestamp window: answered
    /// from the idempotency log if it was answered before, refused otherwise.
    pub(super) async fn late_retry<T: auth::SignedBody>(
        &self,
        signed: &auth::Authenticated<T>,
        now_ms: i64,
    ) -> Result<Answer, ServiceError> {
        if let Some(answer) = self.store.replay(&signed.request).await? {
            return Ok(answer);
        }
        let timestamp_ms = signed.body.header().map_or(0, |h| h.timestamp_ms);
        Err(signed.stale_error(now_ms, self.config.limits.timestamp_window_ms, timestamp_ms))
    }
}
