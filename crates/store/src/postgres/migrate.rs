//! The schema (`migrations/postgres`, one DDL statement per migration) and
//! the registry of the replicas' public signing keys.

use super::*;
use crate::limits::postgres::{MAX_LISTED_KEYS, MIGRATE_ATTEMPTS};

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

/// A migration: its version and its description (the file's name).
pub type Migration = (i64, String);

/// Where a database's schema stands against this broker's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaStatus {
    /// The highest migration applied; 0 for an empty database.
    pub current: i64,
    /// The highest this broker knows.
    pub latest: i64,
    /// This broker's migrations not applied yet, in order.
    pub pending: Vec<Migration>,
}

/// Reads where the schema stands, changing nothing (`migrate --status`).
pub async fn status(connect: &PgConnectOptions) -> Result<SchemaStatus, StoreError> {
    let mut conn = PgConnection::connect_with(connect).await.map_err(backend)?;
    let applied = applied_versions(&mut conn).await;
    let _ = sqlx::Connection::close(conn).await;
    let applied = applied?;
    let migrator = migrator();
    Ok(SchemaStatus {
        current: applied.iter().copied().max().unwrap_or(0),
        latest: migrator.iter().map(|m| m.version).max().unwrap_or(0),
        pending: migrator
            .iter()
            .filter(|m| !applied.contains(&m.version))
            .map(|m| (m.version, m.description.to_string()))
            .collect(),
    })
}

/// The versions applied successfully; none when the schema was never
/// migrated.
async fn applied_versions(conn: &mut PgConnection) -> Result<Vec<i64>, StoreError> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
        .fetch_all(&mut *conn)
        .await
        .map_err(backend)
}

/// Applies every pending migration (`serve`, unless `--no-migrate`, and
/// `delegation-broker migrate`); returns those this call applied.
pub async fn run(connect: &PgConnectOptions) -> Result<Vec<Migration>, StoreError> {
    let before = status(connect).await.map(|s| s.pending).unwrap_or_default();
    apply(connect).await?;
    let after = status(connect).await?;
    Ok(before
        .into_iter()
        .filter(|m| !after.pending.contains(m))
        .collect())
}

async fn apply(connect: &PgConnectOptions) -> Result<(), StoreError> {
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
                return Err(StoreError::Backend(format!(
                    "migrating the database at {}: {e}",
                    super::describe(connect)
                )));
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

/// Why a key was retired (`broker_keys.retired_by`).
pub mod retired_by {
    /// Its replica rotated it away (`rotate-key`).
    pub const ROTATION: &str = "rotation";
    /// Its replica stopped heartbeating for `limits.replica_key_ttl_ms`;
    /// undone when it heartbeats again.
    pub const TTL: &str = "ttl";
    /// `delegation-broker keys retire`; never undone.
    pub const OPERATOR: &str = "operator";
}

/// The database's clock in ms: heartbeats and their expiry are compared
/// on one clock, whatever the replicas' clocks say.
macro_rules! db_now_ms {
    () => {
        "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
    };
}

/// Registers `current` (current again if it was retired by rotation or
/// TTL: its replica is back) and `retired` (with their retirement time,
/// once). A current key an operator retired is refused: the replica must
/// be given a new key.
pub(super) async fn register_keys(
    pool: &PgPool,
    current: &[u8; 32],
    retired: &[[u8; 32]],
    now_ms: i64,
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.map_err(backend)?;
    let key_id = broker_wire::crypto::key_id(current);
    let by: Option<Option<String>> =
        sqlx::query_scalar("SELECT retired_by FROM broker_keys WHERE key_id = $1 FOR UPDATE")
            .bind(&key_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(backend)?;
    if by.flatten().as_deref() == Some(retired_by::OPERATOR) {
        return Err(StoreError::Backend(format!(
            "this replica's signing key {key_id} was retired by an operator (`delegation-broker keys retire`): give it a new key (`rotate-key`, or another --signing-key-file)"
        )));
    }
    sqlx::query(concat!(
        "INSERT INTO broker_keys (key_id, public_key, registered_at_ms, retired_at_ms, seen_at_ms, retired_by) \
         VALUES ($1, $2, $3, NULL, ", db_now_ms!(), ", NULL) \
         ON CONFLICT (key_id) DO UPDATE SET retired_at_ms = NULL, retired_by = NULL, \
             seen_at_ms = EXCLUDED.seen_at_ms"
    ))
    .bind(&key_id)
    .bind(current.as_slice())
    .bind(now_ms)
    .execute(&mut *tx)
    .await
    .map_err(backend)?;
    for key in retired {
        sqlx::query(
            "INSERT INTO broker_keys (key_id, public_key, registered_at_ms, retired_at_ms, retired_by) \
             VALUES ($1, $2, $3, $3, $4) \
             ON CONFLICT (key_id) DO UPDATE SET retired_at_ms = \
                 COALESCE(broker_keys.retired_at_ms, EXCLUDED.retired_at_ms), \
                 retired_by = COALESCE(broker_keys.retired_by, EXCLUDED.retired_by)",
        )
        .bind(broker_wire::crypto::key_id(key))
        .bind(key.as_slice())
        .bind(now_ms)
        .bind(retired_by::ROTATION)
        .execute(&mut *tx)
        .await
        .map_err(backend)?;
    }
    tx.commit().await.map_err(backend)
}

/// What a heartbeat found about this replica's own key.
#[derive(Debug, PartialEq, Eq)]
pub enum Heartbeat {
    /// Current (again, if the TTL had retired it).
    Current,
    /// An operator retired it: other replicas accept no session it seals.
    RetiredByOperator,
    /// Not in the registry (deleted by hand): registered again.
    Missing,
}

/// Says this replica (signing with `current`) is alive, and retires the
/// keys of replicas not seen for `ttl_ms` (their contracts still verify;
/// no new session is accepted with them). Returns the ids it retired.
pub(super) async fn heartbeat(
    pool: &PgPool,
    current: &[u8; 32],
    ttl_ms: i64,
) -> Result<(Heartbeat, Vec<String>), StoreError> {
    let key_id = broker_wire::crypto::key_id(current);
    let by: Option<Option<String>> = sqlx::query_scalar(concat!(
        "UPDATE broker_keys SET seen_at_ms = ",
        db_now_ms!(),
        ", \
             retired_at_ms = CASE WHEN retired_by = $2 THEN NULL ELSE retired_at_ms END, \
             retired_by = CASE WHEN retired_by = $2 THEN NULL ELSE retired_by END \
         WHERE key_id = $1 RETURNING retired_by"
    ))
    .bind(&key_id)
    .bind(retired_by::TTL)
    .fetch_optional(pool)
    .await
    .map_err(backend)?;
    let own = match by {
        None => Heartbeat::Missing,
        Some(Some(by)) if by == retired_by::OPERATOR => Heartbeat::RetiredByOperator,
        Some(_) => Heartbeat::Current,
    };
    let retired: Vec<String> = sqlx::query_scalar(concat!(
        "UPDATE broker_keys SET retired_by = $1, \
             retired_at_ms = COALESCE(seen_at_ms, registered_at_ms) + $2 \
         WHERE retired_at_ms IS NULL \
           AND COALESCE(seen_at_ms, registered_at_ms) < ",
        db_now_ms!(),
        " - $2 \
         RETURNING key_id"
    ))
    .bind(retired_by::TTL)
    .bind(ttl_ms)
    .fetch_all(pool)
    .await
    .map_err(backend)?;
    Ok((own, retired))
}

/// One key of the registry, as `keys list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub key_id: String,
    pub public_key: Vec<u8>,
    pub registered_at_ms: i64,
    /// Its replica's last heartbeat (the database's clock).
    pub seen_at_ms: Option<i64>,
    pub retired_at_ms: Option<i64>,
    /// `retired_by::*`.
    pub retired_by: Option<String>,
}

/// A `broker_keys` row as `list_keys` reads it.
type KeyRow = (
    String,
    Vec<u8>,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
);

/// Every key in the registry, current first.
pub async fn list_keys(connect: &PgConnectOptions) -> Result<Vec<KeyRecord>, StoreError> {
    let mut conn = PgConnection::connect_with(connect).await.map_err(backend)?;
    let rows: Vec<KeyRow> = sqlx::query_as(
        "SELECT key_id, public_key, registered_at_ms, seen_at_ms, retired_at_ms, retired_by \
             FROM broker_keys ORDER BY (retired_at_ms IS NOT NULL), registered_at_ms, key_id \
             LIMIT $1",
    )
    .bind(MAX_LISTED_KEYS)
    .fetch_all(&mut conn)
    .await
    .map_err(backend)?;
    let _ = sqlx::Connection::close(conn).await;
    Ok(rows
        .into_iter()
        .map(
            |(key_id, public_key, registered_at_ms, seen_at_ms, retired_at_ms, retired_by)| {
                KeyRecord {
                    key_id,
                    public_key,
                    registered_at_ms,
                    seen_at_ms,
                    retired_at_ms,
                    retired_by,
                }
            },
        )
        .collect())
}

/// Retires `key_id` for good (`keys retire`): its signatures stay
/// verifiable, no session sealed with it is accepted, and a replica
/// holding it cannot register it again. False when it already was.
pub async fn retire_key(connect: &PgConnectOptions, key_id: &str) -> Result<bool, StoreError> {
    let mut conn = PgConnection::connect_with(connect).await.map_err(backend)?;
    let changed: Option<String> = sqlx::query_scalar(concat!(
        "UPDATE broker_keys SET retired_by = $2, \
             retired_at_ms = COALESCE(retired_at_ms, ",
        db_now_ms!(),
        ") \
         WHERE key_id = $1 AND retired_by IS DISTINCT FROM $2 RETURNING key_id"
    ))
    .bind(key_id)
    .bind(retired_by::OPERATOR)
    .fetch_optional(&mut conn)
    .await
    .map_err(backend)?;
    let known = match changed {
        Some(_) => true,
        None => {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM broker_keys WHERE key_id = $1")
                .bind(key_id)
                .fetch_one(&mut conn)
                .await
                .map_err(backend)?
                > 0
        }
    };
    let _ = sqlx::Connection::close(conn).await;
    if !known {
        return Err(StoreError::NotFound {
            what: crate::Entity::BrokerKey,
            id: key_id.to_owned(),
        });
    }
    Ok(changed.is_some())
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
