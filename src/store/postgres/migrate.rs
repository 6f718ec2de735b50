//! The schema (`migrations/postgres`, one DDL statement per migration) and
//! the registry of the replicas' public signing keys.

use super::*;
use crate::store::limits::postgres::MIGRATE_ATTEMPTS;

/// Wait between two attempts.
const MIGRATE_RETRY: Duration = Duration::from_millis(500);

/// The format version `contract_format` must hold (see SQLite's migration
/// 10): a database in another format is refused, not served.
const CONTRACT_FORMAT: i64 = 2;

pub(super) fn migrator() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("./migrations/postgres");
    // Session advisory locks are not portable (CockroachDB): concurrent
    // starters are retried instead (`MIGRATE_ATTEMPTS`).
    migrator.set_locking(false);
    migrator
}

/// Applies every pending migration (`serve`, unless `--no-migrate`, and
/// `delegation-broker migrate`).
pub async fn run(connect: &PgConnectOptions) -> Result<(), StoreError> {
    let mut attempt = 1;
    loop {
        let result = async {
            let mut conn = PgConnection::connect_with(connect)
                .await
                .map_err(|e| e.to_string())?;
            let applied = migrator()
                .run_direct(None, &mut conn, false)
                .await
                .map_err(|e| e.to_string());
            let _ = sqlx::Connection::close(conn).await;
            applied
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(e) if attempt < MIGRATE_ATTEMPTS => {
                tracing::info!(error = %e, attempt, "migrating the database; retrying");
                tokio::time::sleep(MIGRATE_RETRY).await;
                attempt += 1;
            }
            Err(e) => {
                return Err(StoreError::Backend(format!("migrating the database: {e}")));
            }
        }
    }
}

/// Refuses a database whose schema is behind this broker's (run
/// `delegation-broker migrate`) or in another contract format.
pub(super) async fn check(pool: &PgPool) -> Result<(), StoreError> {
    let latest = migrator().iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Option<i64> =
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(pool)
            .await
            .map_err(|e| {
                StoreError::Backend(format!(
                    "the database has no broker schema ({e}): run `delegation-broker migrate --database-url …` or start without --no-migrate"
                ))
            })?;
    let applied = applied.unwrap_or(0);
    if applied < latest {
        return Err(StoreError::Backend(format!(
            "the database schema is at migration {applied}, this broker needs {latest}: run `delegation-broker migrate --database-url …`"
        )));
    }
    let format: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM contract_format")
        .fetch_one(pool)
        .await
        .map_err(backend)?;
    if format != Some(CONTRACT_FORMAT) {
        return Err(StoreError::Backend(format!(
            "the database holds contracts in format {format:?}, this broker signs format {CONTRACT_FORMAT}"
        )));
    }
    Ok(())
}

/// Registers `current` (and marks it current again if it was retired
/// and is back) and `retired` (with their retirement time, once).
pub(super) async fn register_keys(
    pool: &PgPool,
    current: &[u8; 32],
    retired: &[[u8; 32]],
    now_ms: i64,
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.map_err(backend)?;
    sqlx::query(
        "INSERT INTO broker_keys (key_id, public_key, registered_at_ms, retired_at_ms) \
         VALUES ($1, $2, $3, NULL) \
         ON CONFLICT (key_id) DO UPDATE SET retired_at_ms = NULL",
    )
    .bind(crate::crypto::key_id(current))
    .bind(current.as_slice())
    .bind(now_ms)
    .execute(&mut *tx)
    .await
    .map_err(backend)?;
    for key in retired {
        sqlx::query(
            "INSERT INTO broker_keys (key_id, public_key, registered_at_ms, retired_at_ms) \
             VALUES ($1, $2, $3, $3) \
             ON CONFLICT (key_id) DO UPDATE SET retired_at_ms = \
                 COALESCE(broker_keys.retired_at_ms, EXCLUDED.retired_at_ms)",
        )
        .bind(crate::crypto::key_id(key))
        .bind(key.as_slice())
        .bind(now_ms)
        .execute(&mut *tx)
        .await
        .map_err(backend)?;
    }
    tx.commit().await.map_err(backend)
}

/// Every registered key, current ones first, then by registration.
pub(super) async fn broker_keys(pool: &PgPool) -> Result<Vec<pb::BrokerKey>, StoreError> {
    let rows: Vec<(String, Vec<u8>, Option<i64>)> = sqlx::query_as(
        "SELECT key_id, public_key, retired_at_ms FROM broker_keys \
         ORDER BY (retired_at_ms IS NOT NULL), registered_at_ms, key_id",
    )
    .fetch_all(pool)
    .await
    .map_err(backend)?;
    Ok(rows
        .into_iter()
        .map(|(key_id, public_key, retired_at_ms)| pb::BrokerKey {
            key_id,
            public_key,
            current: retired_at_ms.is_none(),
            retired_at_ms: retired_at_ms.unwrap_or(0),
        })
        .collect())
}
