//! BindIdentity, and what a bound identity changes elsewhere: the
//! identity stamped into contracts issued to a bound key, orchestrators
//! and readers named by identity. Verification is `crate::identity`.

use super::BrokerService;
use super::error::ServiceError;
use crate::core::AgentKey;
use crate::core::limits::MAX_IDENTITY_TOKEN_BYTES;
use crate::pb;
use crate::store::{IdentityBinding, Store};

impl<S: Store> BrokerService<S> {
    pub(super) async fn bind_identity(
        &self,
        request: pb::BindIdentityRequest,
    ) -> Result<pb::BindIdentityResponse, ServiceError> {
        let now_ms = self.clock.now_ms();
        let signed = self.signed::<pb::BindIdentityBody>(request.signed.as_ref(), now_ms)?;
        signed.require_fresh(now_ms, self.config.limits.timestamp_window_ms)?;
        let Some(issuers) = &self.identities else {
            return Err(ServiceError::FailedPrecondition {
                reason: pb::ErrorReason::IdentityNotConfigured,
                detail: "this broker trusts no identity issuer ([identity.issuers] in its configuration)".into(),
            });
        };
        if signed.body.token.len() > MAX_IDENTITY_TOKEN_BYTES {
            return Err(crate::core::InputError::new(
                "body.token",
                format!("is longer than {MAX_IDENTITY_TOKEN_BYTES} bytes"),
            )
            .into());
        }
        // Its turn first: verification may try an RSA key or several.
        let _turn = self
            .gate
            .admit(&self.config.tenants, &signed.agent, None)
            .await?;
        let workload = issuers
            .verify(&signed.body.token, &signed.agent, now_ms)
            .map_err(|refused| ServiceError::IdentityRefused {
                check: refused.check,
                detail: refused.detail,
            })?;
        if workload.expires_at_ms <= now_ms {
            return Err(ServiceError::IdentityRefused {
                check: "IDENTITY_EXPIRED",
                detail:
                    "the token expires within the clock skew the broker allows: present a fresh one"
                        .into(),
            });
        }
        self.store
            .bind_identity(
                IdentityBinding {
                    key: signed.agent,
                    identity: workload.identity.clone(),
                    issuer: workload.issuer.clone(),
                    expires_at_ms: workload.expires_at_ms,
                },
                now_ms,
            )
            .await?;
        tracing::info!(identity = %workload.identity, issuer = %workload.issuer, "identity bound");
        Ok(pb::BindIdentityResponse {
            identity: workload.identity,
            issuer: workload.issuer,
            expires_at_ms: workload.expires_at_ms,
        })
    }

    /// The identity `key` is bound to now; none, without reading, when no
    /// issuer is configured (nothing can be bound).
    pub(super) async fn bound_identity(
        &self,
        key: &AgentKey,
        now_ms: i64,
    ) -> Result<Option<String>, ServiceError> {
        let Some(issuers) = &self.identities else {
            return Ok(None);
        };
        Ok(self
            .store
            .identity_of(*key, now_ms)
            .await?
            .filter(|binding| issuers.trusts(&binding.issuer))
            .map(|binding| binding.identity))
    }

    /// Whether `caller` reads every tree: a `[readers]` key, or a key
    /// bound to an identity `[readers] identities` names.
    pub(super) async fn reads_everything(&self, caller: &AgentKey) -> Result<bool, ServiceError> {
        Ok(self.config.readers.contains(caller) || self.reader_by_identity(caller).await?)
    }

    /// Whether `caller`'s bound identity is one `[readers] identities`
    /// names (a store read, only when some are named).
    pub(super) async fn reader_by_identity(&self, caller: &AgentKey) -> Result<bool, ServiceError> {
        if self.config.reader_identities.is_empty() {
            return Ok(false);
        }
        let identity = self.bound_identity(caller, self.clock.now_ms()).await?;
        Ok(identity.is_some_and(|identity| {
            self.config
                .reader_identities
                .iter()
                .any(|pattern| pattern.matches(&identity))
        }))
    }
}
