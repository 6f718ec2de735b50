//! The writer's batch statements and reads, run on the writer's own
//! thread.
//!
//! Through sqlx every statement's result crosses from SQLite's worker
//! thread as a message of its own, each a wake-up of the writer: a batch's
//! script (BEGIN, its inserts and updates, COMMIT) cost the writer 6.5
//! thread switches, and the batch waited each time for both threads to be
//! scheduled (BENCHMARKS.md); a lifecycle command's reads woke sqlx's
//! thread about nine times more. Here the writer takes the connection
//! from the worker (`lock_handle`), keeps it for every batch but a
//! drain's step (`apply::apply_held`), and steps its own prepared
//! statements, binding the plan's values in place and copying the rows
//! of its reads out (`held::RawRow`).
//!
//! All `unsafe` of the store is in this file and in `gather` (the VFS
//! its COMMITs write the WAL through). What keeps this file's sound:
//! - the handle is only used while sqlx's `LockedSqliteHandle` is held,
//!   so sqlx's worker never uses the connection at the same time;
//! - bound values are `SQLITE_STATIC` (not copied): each statement is
//!   reset and its bindings cleared before `run` or `rows` returns, while
//!   the borrowed values are still alive; a read's cells are copied out
//!   before its next step;
//! - every statement prepared here is finalized (`finalize_all`) before
//!   the connection is closed: sqlx closes it with `sqlite3_close`, which
//!   refuses (and sqlx then panics) while a statement is open.

use std::collections::HashMap;
use std::ffi::{CStr, c_int};
use std::ptr::NonNull;
use std::sync::Arc;

use libsqlite3_sys as ffi;
use sqlx::SqliteConnection;
use sqlx::error::ErrorKind;
use sqlx::sqlite::LockedSqliteHandle;

pub(super) use super::held::{HeldSource, RawRow, RawValue};
use crate::limits::sqlite::{HANDLE_TRIES, HANDLE_WAIT, STATEMENT_CACHE_CAPACITY};
use crate::sql::CodedError;
use crate::sql::plan::{Arg, Sql};

/// Takes SQLite's handle from sqlx's worker thread (`lock_handle`), with
/// a bound: sqlx 0.9's `lock_handle` now and then never returns (the
/// worker has let the connection go and waits to take it back; the
/// writer is never woken). Seen in `store-probe --hand-over`, a take
/// right after a checkpoint through sqlx: 1–7 takes in 60,000 in every
/// run, each for good. Abandoning the take and asking again got the
/// handle at once every time (BENCHMARKS.md). So a
/// take not done in `HANDLE_WAIT` is asked again, up to `HANDLE_TRIES`
/// times; then the caller gets an error (its batch fails loudly) instead
/// of every write stopping without a word. Abandoning is harmless: the
/// worker lets the connection go and takes it back once more.
pub(super) async fn take_handle<'c>(
    conn: &'c mut SqliteConnection,
    retakes: Option<&prometheus::IntCounter>,
) -> Result<LockedSqliteHandle<'c>, sqlx::Error> {
    let conn: *mut SqliteConnection = conn;
    // SAFETY: `bounded` drops each attempt (and the borrow in it) before
    // it starts the next, so at most one `&mut` made here is ever alive,
    // and the one returned is the caller's borrow.
    let attempt = || unsafe { &mut *conn }.lock_handle();
    match bounded(attempt, HANDLE_WAIT, HANDLE_TRIES).await {
        Ok((taken, 0)) => taken,
        Ok((taken, abandoned)) => {
            if let Some(retakes) = retakes {
                retakes.inc_by(u64::from(abandoned));
            }
            static RETAKEN: broker_wire::throttle::Throttle =
                broker_wire::throttle::Throttle::new();
            if let Some(held) = RETAKEN.allow() {
                tracing::warn!(
                    abandoned,
                    held,
                    "sqlx's worker did not hand over the writer's connection; asked again"
                );
            }
            taken
        }
        Err(abandoned) => {
            if let Some(retakes) = retakes {
                retakes.inc_by(u64::from(abandoned));
            }
            Err(sqlx::Error::Protocol(format!(
                "sqlx's worker did not hand over the writer's connection in {abandoned} tries of {} ms",
                HANDLE_WAIT.as_millis()
            )))
        }
    }
}

/// Runs `attempt()` for up to `wait`, dropping it and starting it again
/// up to `tries` times in all: its output and how many were abandoned, or
/// (all abandoned) how many.
async fn bounded<F: std::future::Future>(
    mut attempt: impl FnMut() -> F,
    wait: std::time::Duration,
    tries: u32,
) -> Result<(F::Output, u32), u32> {
    for abandoned in 0..tries {
        if let Ok(output) = tokio::time::timeout(wait, attempt()).await {
            return Ok((output, abandoned));
        }
    }
    Err(tries)
}

/// Turns on SQLite's query planner stability guarantee for `conn`: plans
/// no longer look at bound values. Without it, a statement whose plan
/// read a bound value (every `LIMIT $n`: `computeLimitRegisters`) is
/// thrown away whenever that parameter is bound again and prepared anew
/// at its next step: every run of every paged read (measured: 4.5% of the
/// broker's CPU under the A2A gateways' calls, all in `sqlite3Reprepare`).
/// No plan here needs a value: there are no statistics, no LIKE, and no
/// partial index is reached through a bound value.
pub(super) async fn plan_stably(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    let mut now_on: c_int = 0;
    // SAFETY: the locked handle gives this thread the connection alone;
    // the call sets a flag and writes its new value to `now_on`.
    let rc = unsafe {
        ffi::sqlite3_db_config(
            db,
            ffi::SQLITE_DBCONFIG_ENABLE_QPSG,
            1 as c_int,
            &mut now_on as *mut c_int,
        )
    };
    if rc != ffi::SQLITE_OK || now_on != 1 {
        return Err(sqlx::Error::Protocol(format!(
            "SQLite did not take the query planner stability guarantee (code {rc})"
        )));
    }
    Ok(())
}

/// Whether `conn` plans stably (see `plan_stably`).
#[cfg(test)]
pub(super) async fn plans_stably(conn: &mut SqliteConnection) -> bool {
    let mut handle = conn.lock_handle().await.expect("the handle");
    let db = handle.as_raw_handle().as_ptr();
    let mut on: c_int = -1;
    // SAFETY: as in `plan_stably`; -1 only reads the flag.
    let rc = unsafe {
        ffi::sqlite3_db_config(
            db,
            ffi::SQLITE_DBCONFIG_ENABLE_QPSG,
            -1 as c_int,
            &mut on as *mut c_int,
        )
    };
    rc == ffi::SQLITE_OK && on == 1
}

/// Rows the connection's last statement changed (`sqlite3_changes64`).
pub(super) fn changes(handle: &mut LockedSqliteHandle<'_>) -> u64 {
    // SAFETY: the locked handle gives this thread the connection alone.
    let changed = unsafe { ffi::sqlite3_changes64(handle.as_raw_handle().as_ptr()) };
    u64::try_from(changed).unwrap_or(0)
}

/// The writer's prepared statements, by text.
#[derive(Default)]
pub(super) struct Statements {
    prepared: HashMap<String, NonNull<ffi::sqlite3_stmt>>,
    /// The result columns of those that were read (`rows`), named once.
    columns: HashMap<NonNull<ffi::sqlite3_stmt>, Arc<[String]>>,
    /// The connection they were prepared on (set by the first): a handle
    /// of another connection is refused, not stepped.
    db: Option<NonNull<ffi::sqlite3>>,
}

impl Statements {
    /// Runs every statement of `sql`, in order, to completion; stops at
    /// the first error (what a failed statement leaves of a transaction
    /// is the caller's: `OR ROLLBACK` statements roll it back).
    pub(super) fn run(
        &mut self,
        handle: &mut LockedSqliteHandle<'_>,
        sql: &Sql<'_>,
    ) -> Result<(), sqlx::Error> {
        let db = self.connection(handle)?;
        for statement in sql.statements() {
            let stmt = self.prepare(handle, &statement.text)?;
            // SAFETY: `stmt` was prepared on `db`, which the locked handle
            // gives this thread alone; the arguments outlive the call,
            // which resets the statement before returning.
            let step = || unsafe { step(db, stmt, &statement.args, None) };
            if statement.text == "COMMIT" {
                // Its WAL frames written with one call (`gather`).
                super::gather::during(step)?;
            } else {
                step()?;
            }
        }
        Ok(())
    }

    /// Every row `text` returns with `args` bound, its cells copied out.
    pub(super) fn rows(
        &mut self,
        handle: &mut LockedSqliteHandle<'_>,
        text: &str,
        args: &[Arg<'_>],
    ) -> Result<Vec<RawRow>, sqlx::Error> {
        let db = self.connection(handle)?;
        let stmt = self.prepare(handle, text)?;
        let columns = match self.columns.get(&stmt) {
            Some(columns) => columns.clone(),
            None => {
                // SAFETY: `stmt` was prepared on the held `db`.
                let columns = unsafe { column_names(stmt.as_ptr()) }?;
                self.columns.insert(stmt, columns.clone());
                columns
            }
        };
        let mut rows = Vec::new();
        // SAFETY: as in `run`; `columns` are `stmt`'s.
        unsafe { step(db, stmt, args, Some((&mut rows, &columns))) }?;
        Ok(rows)
    }

    /// The locked connection, if it is the one the statements belong to.
    fn connection(
        &mut self,
        handle: &mut LockedSqliteHandle<'_>,
    ) -> Result<NonNull<ffi::sqlite3>, sqlx::Error> {
        let db = handle.as_raw_handle();
        if *self.db.get_or_insert(db) != db {
            return Err(sqlx::Error::Protocol(
                "the writer's statements belong to another connection".into(),
            ));
        }
        Ok(db)
    }

    /// Whether no statement is prepared (none to finalize).
    pub(super) fn is_empty(&self) -> bool {
        self.prepared.is_empty()
    }

    /// The statement for `text`, prepared once (until the cache is full:
    /// then every statement is finalized and the cache starts again).
    fn prepare(
        &mut self,
        handle: &mut LockedSqliteHandle<'_>,
        text: &str,
    ) -> Result<NonNull<ffi::sqlite3_stmt>, sqlx::Error> {
        if let Some(stmt) = self.prepared.get(text) {
            return Ok(*stmt);
        }
        if self.prepared.len() >= STATEMENT_CACHE_CAPACITY {
            self.finalize_all(handle);
        }
        let db = handle.as_raw_handle();
        let length = c_int::try_from(text.len())
            .map_err(|_| sqlx::Error::Protocol("statement text over 2 GiB".into()))?;
        let mut stmt = std::ptr::null_mut();
        let mut tail = std::ptr::null();
        // SAFETY: `text` is valid for `length` bytes (no terminator is
        // needed when the length is given); `db` is locked to this thread.
        let rc = unsafe {
            ffi::sqlite3_prepare_v3(
                db.as_ptr(),
                text.as_ptr().cast(),
                length,
                ffi::SQLITE_PREPARE_PERSISTENT,
                &mut stmt,
                &mut tail,
            )
        };
        if rc != ffi::SQLITE_OK {
            // SAFETY: as above; the error is read before any other call.
            return Err(unsafe { last_error(db) });
        }
        let stmt = NonNull::new(stmt)
            .ok_or_else(|| sqlx::Error::Protocol(format!("no statement in {text:?}")))?;
        // One statement per text: anything after it would not run.
        // SAFETY: `tail` points into `text`, at or before its end.
        let consumed = usize::try_from(unsafe { tail.cast::<u8>().offset_from(text.as_ptr()) });
        let rest = consumed.ok().and_then(|at| text.get(at..));
        if rest.is_none_or(|rest| !rest.trim().is_empty()) {
            // SAFETY: `stmt` was just prepared and is not cached.
            unsafe { ffi::sqlite3_finalize(stmt.as_ptr()) };
            return Err(sqlx::Error::Protocol(format!(
                "more than one statement in {text:?}"
            )));
        }
        // Values bind by position; SQLite numbers `$N` by first
        // appearance, not by N. A text whose placeholders are out of order
        // would bind here what sqlx (which binds by name) would not.
        // SAFETY: `stmt` was just prepared and is not cached.
        if let Err(e) = unsafe { placeholders_in_order(stmt.as_ptr(), text) } {
            // SAFETY: as above.
            unsafe { ffi::sqlite3_finalize(stmt.as_ptr()) };
            return Err(e);
        }
        self.prepared.insert(text.to_owned(), stmt);
        Ok(stmt)
    }

    /// Finalizes every statement (the locked handle is the proof that
    /// nothing else uses the connection); before the connection closes.
    pub(super) fn finalize_all(&mut self, locked: &mut LockedSqliteHandle<'_>) {
        if self.db.is_some_and(|db| db != locked.as_raw_handle()) {
            tracing::error!(
                "finalizing the writer's statements with another connection's handle: refused"
            );
            return;
        }
        self.columns.clear();
        for (_, stmt) in self.prepared.drain() {
            // SAFETY: each was prepared here and is finalized once.
            unsafe { ffi::sqlite3_finalize(stmt.as_ptr()) };
        }
    }
}

/// Pages this connection has written to the WAL since it opened
/// (`SQLITE_DBSTATUS_CACHE_WRITE`): its commits' frames, as SQLite counts
/// them (checkpoints not included). `None` if SQLite does not say.
pub(super) fn wal_pages_written(handle: &mut LockedSqliteHandle<'_>) -> Option<u64> {
    let (mut current, mut highwater): (c_int, c_int) = (0, 0);
    // SAFETY: the locked handle gives this thread the connection; both
    // out-pointers are live locals.
    let rc = unsafe {
        ffi::sqlite3_db_status(
            handle.as_raw_handle().as_ptr(),
            ffi::SQLITE_DBSTATUS_CACHE_WRITE,
            &mut current,
            &mut highwater,
            0,
        )
    };
    (rc == ffi::SQLITE_OK)
        .then(|| u64::try_from(current).ok())
        .flatten()
}

impl Drop for Statements {
    fn drop(&mut self) {
        // Finalizing needs the connection locked, which a drop cannot
        // wait for: the writer finalizes before it stops (`run_writer`).
        if !self.prepared.is_empty() {
            tracing::error!(
                statements = self.prepared.len(),
                "the writer's statements were not finalized; closing its connection will fail"
            );
        }
    }
}

/// Binds `args` to `stmt`, steps it to the end (its rows copied into
/// `rows` when given, with its result `columns`) and resets it.
///
/// # Safety
/// `stmt` was prepared on `db`, the caller holds the connection, and the
/// columns given are `stmt`'s.
unsafe fn step(
    db: NonNull<ffi::sqlite3>,
    stmt: NonNull<ffi::sqlite3_stmt>,
    args: &[Arg<'_>],
    mut rows: Option<(&mut Vec<RawRow>, &Arc<[String]>)>,
) -> Result<(), sqlx::Error> {
    let stmt = stmt.as_ptr();
    // SAFETY (whole body): the caller's; every pointer bound below is
    // valid for its length until the reset at the end.
    unsafe {
        let expected = usize::try_from(ffi::sqlite3_bind_parameter_count(stmt)).unwrap_or(0);
        if expected != args.len() {
            return Err(sqlx::Error::Protocol(format!(
                "a statement takes {expected} values, {} were given",
                args.len()
            )));
        }
        let mut result = Ok(());
        for (i, arg) in args.iter().enumerate() {
            // Placeholders count from 1; `expected` fit in a c_int.
            let index = c_int::try_from(i + 1).unwrap_or(c_int::MAX);
            let rc = match *arg {
                Arg::Null => ffi::sqlite3_bind_null(stmt, index),
                Arg::Int(v) => ffi::sqlite3_bind_int64(stmt, index, v),
                Arg::Blob(bytes) => match c_int::try_from(bytes.len()) {
                    // A Rust slice's pointer is never null, so an empty
                    // blob binds as an empty blob, not as NULL.
                    Ok(n) => ffi::sqlite3_bind_blob(
                        stmt,
                        index,
                        bytes.as_ptr().cast(),
                        n,
                        ffi::SQLITE_STATIC(),
                    ),
                    Err(_) => ffi::SQLITE_TOOBIG,
                },
                Arg::Text(text) => match c_int::try_from(text.len()) {
                    Ok(n) => ffi::sqlite3_bind_text(
                        stmt,
                        index,
                        text.as_ptr().cast(),
                        n,
                        ffi::SQLITE_STATIC(),
                    ),
                    Err(_) => ffi::SQLITE_TOOBIG,
                },
            };
            if rc == ffi::SQLITE_TOOBIG {
                // Refused here (over `c_int`) or by SQLite: say which value.
                result = Err(raw_error(rc, format!("value {index} is too large to bind")));
                break;
            }
            if rc != ffi::SQLITE_OK {
                result = Err(last_error(db));
                break;
            }
        }
        if result.is_ok() {
            loop {
                match ffi::sqlite3_step(stmt) {
                    ffi::SQLITE_DONE => break,
                    // Without `rows` (the batch's writes), any row is
                    // ignored, as sqlx's `execute` ignores them.
                    ffi::SQLITE_ROW => {
                        let Some((rows, columns)) = rows.as_mut() else {
                            continue;
                        };
                        match row_of(stmt, columns) {
                            Ok(row) => rows.push(row),
                            Err(e) => {
                                result = Err(e);
                                break;
                            }
                        }
                    }
                    _ => {
                        result = Err(last_error(db));
                        break;
                    }
                }
            }
        }
        // Ready for its next use, holding no pointer into `args`.
        ffi::sqlite3_reset(stmt);
        ffi::sqlite3_clear_bindings(stmt);
        result
    }
}

/// Refuses a statement whose placeholder `i` is not `?`, `?i` or `$i`.
///
/// # Safety
/// `stmt` is a prepared statement of a connection the caller holds.
unsafe fn placeholders_in_order(
    stmt: *mut ffi::sqlite3_stmt,
    text: &str,
) -> Result<(), sqlx::Error> {
    // SAFETY (whole body): the caller's; a name is a valid C string while
    // the statement lives.
    unsafe {
        for i in 1..=ffi::sqlite3_bind_parameter_count(stmt) {
            let name = ffi::sqlite3_bind_parameter_name(stmt, i);
            if name.is_null() {
                continue;
            }
            let name = CStr::from_ptr(name).to_bytes();
            let number = name.get(1..).and_then(|n| std::str::from_utf8(n).ok());
            if number != Some(i.to_string().as_str()) {
                return Err(sqlx::Error::Protocol(format!(
                    "placeholder {i} of {text:?} is {}: number them in order",
                    String::from_utf8_lossy(name)
                )));
            }
        }
    }
    Ok(())
}

/// The names of `stmt`'s result columns.
///
/// # Safety
/// `stmt` is a prepared statement of a connection the caller holds.
unsafe fn column_names(stmt: *mut ffi::sqlite3_stmt) -> Result<Arc<[String]>, sqlx::Error> {
    // SAFETY (whole body): the caller's; each name is a valid C string
    // until the statement is finalized or prepared again.
    unsafe {
        let count = ffi::sqlite3_column_count(stmt);
        let mut names = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for i in 0..count {
            let name = ffi::sqlite3_column_name(stmt, i);
            if name.is_null() {
                return Err(sqlx::Error::Protocol(format!("column {i} has no name")));
            }
            names.push(CStr::from_ptr(name).to_string_lossy().into_owned());
        }
        Ok(names.into())
    }
}

/// The row `stmt` stands on, its cells copied out.
///
/// # Safety
/// `stmt` is a statement of a connection the caller holds, just stepped
/// to `SQLITE_ROW`, with `columns` its result columns.
unsafe fn row_of(
    stmt: *mut ffi::sqlite3_stmt,
    columns: &Arc<[String]>,
) -> Result<RawRow, sqlx::Error> {
    let mut values = Vec::with_capacity(columns.len());
    for (i, name) in columns.iter().enumerate() {
        let i = c_int::try_from(i).unwrap_or(c_int::MAX);
        // SAFETY (the block): the caller's; a text or blob pointer is
        // valid for the byte count read after it (SQLite's order), until
        // the next step.
        let value = unsafe {
            match ffi::sqlite3_column_type(stmt, i) {
                ffi::SQLITE_INTEGER => RawValue::Int(ffi::sqlite3_column_int64(stmt, i)),
                ffi::SQLITE_FLOAT => RawValue::Real,
                ffi::SQLITE_TEXT => {
                    let text = ffi::sqlite3_column_text(stmt, i);
                    let bytes = bytes_of(text.cast(), ffi::sqlite3_column_bytes(stmt, i), name)?;
                    RawValue::Text(String::from_utf8(bytes).map_err(|_| {
                        sqlx::Error::Protocol(format!("column {name} is not UTF-8"))
                    })?)
                }
                ffi::SQLITE_BLOB => {
                    let blob = ffi::sqlite3_column_blob(stmt, i);
                    let length = ffi::sqlite3_column_bytes(stmt, i);
                    RawValue::Blob(bytes_of(blob.cast(), length, name)?)
                }
                _ => RawValue::Null,
            }
        };
        values.push(value);
    }
    Ok(RawRow {
        columns: columns.clone(),
        values,
    })
}

/// `length` bytes at `at`, copied (none when `length` is 0: SQLite's
/// empty blob may come as a null pointer). A null pointer with bytes is
/// SQLite out of memory: an error, not an empty value.
///
/// # Safety
/// `at` is null or valid for `length` bytes.
unsafe fn bytes_of(at: *const u8, length: c_int, column: &str) -> Result<Vec<u8>, sqlx::Error> {
    let length = usize::try_from(length).unwrap_or(0);
    if length == 0 {
        return Ok(Vec::new());
    }
    if at.is_null() {
        return Err(sqlx::Error::Protocol(format!(
            "SQLite could not copy out column {column}"
        )));
    }
    // SAFETY: the caller's.
    Ok(unsafe { std::slice::from_raw_parts(at, length) }.to_vec())
}

/// The connection's last error, as sqlx reports SQLite's errors (the
/// extended code, its kind), so callers match it the same way.
///
/// # Safety
/// The caller holds the connection.
unsafe fn last_error(db: NonNull<ffi::sqlite3>) -> sqlx::Error {
    // SAFETY: the caller's; `sqlite3_errmsg` returns a valid C string.
    let (code, message) = unsafe {
        let code = ffi::sqlite3_extended_errcode(db.as_ptr());
        let message = CStr::from_ptr(ffi::sqlite3_errmsg(db.as_ptr()))
            .to_string_lossy()
            .into_owned();
        (code, message)
    };
    raw_error(code, message)
}

/// An error SQLite returned to one of the writer's own statements, with
/// the kind sqlx gives the same extended code.
fn raw_error(code: c_int, message: String) -> sqlx::Error {
    let kind = match code {
        ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY => {
            ErrorKind::UniqueViolation
        }
        ffi::SQLITE_CONSTRAINT_FOREIGNKEY => ErrorKind::ForeignKeyViolation,
        ffi::SQLITE_CONSTRAINT_NOTNULL => ErrorKind::NotNullViolation,
        ffi::SQLITE_CONSTRAINT_CHECK => ErrorKind::CheckViolation,
        _ => ErrorKind::Other,
    };
    CodedError::error(code.to_string(), message, kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{Connection, Row, SqliteConnection};

    async fn memory() -> SqliteConnection {
        crate::sqlite::before_sqlite();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE t (k BLOB PRIMARY KEY, n INTEGER, s TEXT, z BLOB)")
            .execute(&mut conn)
            .await
            .unwrap();
        conn
    }

    #[tokio::test]
    async fn values_bind_in_place_and_errors_keep_sqlxs_kind_and_code() {
        let mut conn = memory().await;
        let mut statements = Statements::default();
        let key = vec![1u8];
        let text = String::from("a");
        type Values<'a> = (&'a [u8], Option<i64>, &'a str, Option<&'a [u8]>);
        let rows: Vec<Values<'_>> = vec![(&key, Some(5), &text, None), (&[], None, "", Some(&[]))];
        let mut sql = Sql::default();
        sql.statement("INSERT INTO t (k, n, s, z)")
            .values(&rows, |row, (k, n, s, z)| {
                row.arg(*k).arg(*n).arg(*s).arg(*z);
            });
        let mut handle = conn.lock_handle().await.unwrap();
        statements.run(&mut handle, &sql).unwrap();
        // The same text again: the cached statement, rebound.
        let again = statements.run(&mut handle, &sql).unwrap_err();
        drop(handle);
        match &again {
            sqlx::Error::Database(db) => {
                assert_eq!(db.kind(), ErrorKind::UniqueViolation, "{again}");
                // SQLITE_CONSTRAINT_PRIMARYKEY, as sqlx reports it.
                assert_eq!(db.code().as_deref(), Some("1555"), "{again}");
            }
            other => panic!("not a database error: {other}"),
        }
        let read = sqlx::query("SELECT k, n, s, typeof(z) AS z FROM t ORDER BY k")
            .fetch_all(&mut conn)
            .await
            .unwrap();
        let read: Vec<(Vec<u8>, Option<i64>, String, String)> = read
            .iter()
            .map(|r| (r.get("k"), r.get("n"), r.get("s"), r.get("z")))
            .collect();
        assert_eq!(
            read,
            vec![
                // An empty slice binds an empty blob, not NULL.
                (vec![], None, String::new(), "blob".to_owned()),
                (vec![1], Some(5), "a".to_owned(), "null".to_owned()),
            ]
        );
        let mut locked = conn.lock_handle().await.unwrap();
        statements.finalize_all(&mut locked);
        drop(locked);
        // sqlx's close fails (panics) if a statement were left prepared.
        conn.close().await.unwrap();
    }

    /// A paged read run again with another LIMIT is prepared anew at every
    /// run unless the planner's stability guarantee is on.
    #[tokio::test]
    async fn with_stable_plans_a_rebound_limit_does_not_prepare_its_statement_again() {
        for stable in [false, true] {
            let mut conn = memory().await;
            if stable {
                plan_stably(&mut conn).await.unwrap();
            }
            let mut statements = Statements::default();
            let mut handle = conn.lock_handle().await.unwrap();
            for limit in 1..=4i64 {
                let mut sql = Sql::default();
                sql.statement("SELECT k FROM t LIMIT ").arg(limit);
                statements.run(&mut handle, &sql).unwrap();
            }
            let statement = *statements.prepared.values().next().expect("one statement");
            // SAFETY: the statement is prepared and this test holds its
            // connection.
            let reprepared = unsafe {
                ffi::sqlite3_stmt_status(statement.as_ptr(), ffi::SQLITE_STMTSTATUS_REPREPARE, 0)
            };
            assert_eq!(statements.prepared.len(), 1);
            if stable {
                assert_eq!(reprepared, 0, "prepared again with stable plans");
            } else {
                assert!(reprepared > 0, "never prepared again without them");
            }
            statements.finalize_all(&mut handle);
            drop(handle);
            conn.close().await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_take_that_does_not_finish_is_abandoned_and_asked_again_a_bounded_number_of_times() {
        use std::future::{pending, ready};
        use std::time::Duration;
        let wait = Duration::from_millis(1);
        // The first two attempts never finish (a lost wake-up); the third
        // does at once.
        let mut started = 0u32;
        let attempt = || {
            started += 1;
            let n = started;
            async move {
                if n <= 2 {
                    pending::<()>().await;
                }
                n
            }
        };
        assert_eq!(bounded(attempt, wait, 5).await, Ok((3, 2)));
        // None finishes: the caller is told after exactly `tries`.
        let mut started = 0u32;
        let never = || {
            started += 1;
            pending::<()>()
        };
        assert_eq!(bounded(never, wait, 4).await, Err(4));
        assert_eq!(started, 4);
        // One that finishes at once is not abandoned.
        assert_eq!(bounded(|| ready(7), wait, 1).await, Ok((7, 0)));
    }

    #[tokio::test]
    async fn the_handle_taken_through_the_bound_runs_statements_and_counts_changes() {
        let mut conn = memory().await;
        let mut statements = Statements::default();
        let mut sql = Sql::default();
        sql.statement("INSERT INTO t (k) VALUES (x'01'), (x'02'), (x'03')");
        sql.statement("DELETE FROM t WHERE k > ").arg(&[1u8][..]);
        let retakes = prometheus::IntCounter::new("t", "t").unwrap();
        let mut handle = take_handle(&mut conn, Some(&retakes)).await.unwrap();
        statements.run(&mut handle, &sql).unwrap();
        assert_eq!(
            changes(&mut handle),
            2,
            "the DELETE's rows, not the INSERT's"
        );
        statements.finalize_all(&mut handle);
        drop(handle);
        assert_eq!(retakes.get(), 0);
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(count, 1);
        conn.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_text_of_two_statements_is_refused() {
        let mut conn = memory().await;
        let mut statements = Statements::default();
        let mut sql = Sql::default();
        sql.statement("INSERT INTO t (k) VALUES (x'01'); DELETE FROM t");
        let mut handle = conn.lock_handle().await.unwrap();
        let refused = statements.run(&mut handle, &sql).unwrap_err();
        assert!(
            refused.to_string().contains("more than one statement"),
            "{refused}"
        );
        assert!(statements.prepared.is_empty());
        drop(handle);
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(count, 0, "nothing of it ran");
    }
}
