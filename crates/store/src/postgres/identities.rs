//! Keys bound to workload identities, in a table every replica shares.

use sqlx::PgPool;

use super::backend;
use crate::limits::MAX_KEYS_PER_IDENTITY;
use crate::{IdentityBinding, StoreError};

/// Expired bindings one bind removes: keeps the table to about the live
/// bindings without a sweeper.
const PRUNED_PER_BIND: i64 = 64;

/// Binds, in one transaction: the key's binding replaced, the identity's
/// keys beyond the `MAX_KEYS_PER_IDENTITY` that expire last unbound, and
/// a few expired bindings pruned.
pub(super) async fn bind(
    pool: &PgPool,
    binding: &IdentityBinding,
    now_ms: i64,
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.map_err(backend)?;
    sqlx::query(
        "INSERT INTO identity_bindings (agent_key, identity, issuer, expires_at_ms) \
         VALUES ($1, $2, $3, $4) \
         ON CONFLICT (agent_key) DO UPDATE SET identity = EXCLUDED.identity, \
             issuer = EXCLUDED.issuer, expires_at_ms = EXCLUDED.expires_at_ms",
    )
    .bind(binding.key.as_slice())
    .bind(&binding.identity)
    .bind(&binding.issuer)
    .bind(binding.expires_at_ms)
    .execute(&mut *tx)
    .await
    .map_err(backend)?;
    sqlx::query(
        "DELETE FROM identity_bindings WHERE agent_key IN \
         (SELECT agent_key FROM identity_bindings WHERE identity = $1 \
          ORDER BY expires_at_ms DESC, agent_key OFFSET $2)",
    )
    .bind(&binding.identity)
    .bind(MAX_KEYS_PER_IDENTITY as i64)
    .execute(&mut *tx)
    .await
    .map_err(backend)?;
    sqlx::query(
        "DELETE FROM identity_bindings WHERE agent_key IN \
         (SELECT agent_key FROM identity_bindings WHERE expires_at_ms <= $1 LIMIT $2)",
    )
    .bind(now_ms)
    .bind(PRUNED_PER_BIND)
    .execute(&mut *tx)
    .await
    .map_err(backend)?;
    tx.commit().await.map_err(backend)
}

pub(super) async fn of(
    pool: &PgPool,
    key: &[u8; 32],
    now_ms: i64,
) -> Result<Option<IdentityBinding>, StoreError> {
    let row: Option<(String, String, i64)> = sqlx::query_as(
        "SELECT identity, issuer, expires_at_ms FROM identity_bindings \
         WHERE agent_key = $1 AND expires_at_ms > $2",
    )
    .bind(key.as_slice())
    .bind(now_ms)
    .fetch_optional(pool)
    .await
    .map_err(backend)?;
    Ok(
        row.map(|(identity, issuer, expires_at_ms)| IdentityBinding {
            key: *key,
            identity,
            issuer,
            expires_at_ms,
        }),
    )
}
