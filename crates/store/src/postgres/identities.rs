//! Keys bound to workload identities, in a table every replica shares.

use sqlx::PgPool;

use super::backend;
use crate::{IdentityBinding, StoreError};

/// Expired bindings one bind removes: keeps the table to about the live
/// bindings without a sweeper.
const PRUNED_PER_BIND: i64 = 64;

pub(super) async fn bind(
    pool: &PgPool,
    binding: &IdentityBinding,
    now_ms: i64,
) -> Result<(), StoreError> {
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
    .execute(pool)
    .await
    .map_err(backend)?;
    sqlx::query(
        "DELETE FROM identity_bindings WHERE agent_key IN \
         (SELECT agent_key FROM identity_bindings WHERE expires_at_ms <= $1 LIMIT $2)",
    )
    .bind(now_ms)
    .bind(PRUNED_PER_BIND)
    .execute(pool)
    .await
    .map_err(backend)?;
    Ok(())
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
