//! Opening the write connection: schema migrations, and the refusal of
//! data in a format this broker cannot serve.

use super::*;

/// The migration that records the linear contract format.
pub(super) const LINEAR_FORMAT_MIGRATION: i64 = 10;

/// Refuses a database holding contracts signed in the format before
/// `LINEAR_FORMAT_MIGRATION`: they cannot be converted (ids are hashes of
/// the signed bytes) and must not be served as if they were the new one.
pub(super) async fn refuse_old_format(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    let has = |table: &'static str| {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = $1",
        )
        .bind(table)
    };
    if has("contracts")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?
        == 0
    {
        return Ok(());
    }
    let linear: i64 = if has("_sqlx_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?
        == 0
    {
        0
    } else {
        sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE version = $1")
            .bind(LINEAR_FORMAT_MIGRATION)
            .fetch_one(&mut *conn)
            .await
            .map_err(backend)?
    };
    let contracts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM contracts")
        .fetch_one(&mut *conn)
        .await
        .map_err(backend)?;
    if linear == 0 && contracts > 0 {
        return Err(StoreError::Backend(format!(
            "this data directory holds {contracts} contracts signed in the format used before \
             linear chains, which cannot be converted (a contract's id is the hash \
             of its signed bytes); keep it for reading with an older broker and start this \
             one with an empty --data-dir"
        )));
    }
    Ok(())
}

/// Opens the single write connection and brings the schema up to date.
/// Returns it with the next free issuance sequence number.
pub(super) async fn open_writer(
    connect: &SqliteConnectOptions,
) -> Result<(SqliteConnection, i64), StoreError> {
    let mut writer = SqliteConnection::connect_with(connect)
        .await
        .map_err(backend)?;
    super::raw::plan_stably(&mut writer)
        .await
        .map_err(backend)?;
    refuse_old_format(&mut writer).await?;
    sqlx::migrate!("./migrations/sqlite")
        .run_direct(None, &mut writer, false)
        .await
        .map_err(|e| StoreError::Backend(e.to_string()))?;
    // Contracts and receipts share one sequence (the event order).
    let mut last = 0i64;
    for query in [
        "SELECT COALESCE(MAX(seq), 0) FROM contracts",
        "SELECT COALESCE(MAX(seq), 0) FROM receipts",
    ] {
        let max: i64 = sqlx::query_scalar(query)
            .fetch_one(&mut writer)
            .await
            .map_err(backend)?;
        last = last.max(max);
    }
    Ok((writer, last + 1))
}
