//! Whether the disk takes writes: a write that fails for a reason that
//! will not pass on its own (disk full, read-only file system, I/O error)
//! marks the store not writable (health NOT_SERVING); while so, the writer
//! probes with a one-row write every `PROBE_INTERVAL`, and the first write
//! that commits again (a probe or a batch) marks it writable.

use super::*;

/// How often a store that cannot write tries a probe write.
pub(super) const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// SQLite's primary result codes (the low byte of an extended code) that
/// say the storage failed rather than the statement.
const SQLITE_READONLY: u32 = 8;
const SQLITE_IOERR: u32 = 10;
const SQLITE_CORRUPT: u32 = 11;
const SQLITE_FULL: u32 = 13;
const SQLITE_CANTOPEN: u32 = 14;

/// Whether `e` is the storage failing (retrying at once fails again)
/// rather than a statement's or a request's error.
pub(super) fn storage_failed(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|code| code.parse::<u32>().ok())
            .is_some_and(|code| {
                matches!(
                    code & 0xff,
                    SQLITE_READONLY | SQLITE_IOERR | SQLITE_CORRUPT | SQLITE_FULL | SQLITE_CANTOPEN
                )
            }),
        _ => false,
    }
}

/// What a probe writes: room for a large group commit. A failed write
/// leaves WAL space behind that a small row would fit, so a one-row probe
/// would say SERVING on a disk still full.
pub(super) const PROBE_HEADROOM_BYTES: i64 = 1024 * 1024;

/// The probe: one row rewritten in its own transaction.
pub(super) async fn probe(conn: &mut SqliteConnection, now_ms: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT OR REPLACE INTO health_probe (id, at_ms, headroom) VALUES (1, $1, zeroblob($2))",
    )
    .bind(now_ms)
    .bind(PROBE_HEADROOM_BYTES)
    .execute(conn)
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_disk_is_a_storage_failure_a_bad_statement_is_not() {
        crate::sqlite::before_sqlite();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let bad = sqlx::query("SELECT * FROM nowhere")
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(!storage_failed(&bad), "{bad}");
        // A database capped at its current page count: the next page is
        // SQLITE_FULL, as a full disk is.
        sqlx::query("CREATE TABLE t (x BLOB)")
            .execute(&mut conn)
            .await
            .unwrap();
        sqlx::query("PRAGMA max_page_count = 2")
            .execute(&mut conn)
            .await
            .unwrap();
        let full = sqlx::query("INSERT INTO t VALUES (zeroblob(100000))")
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(storage_failed(&full), "{full}");
    }
}
