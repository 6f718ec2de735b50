//! Reads on the writer's held handle (`HeldSource`): the rows a statement of
//! `raw::Statements` returned, copied out of SQLite (`RawRow`), and
//! decoded by column name as sqlx's rows are (`CellOf`), so the shared
//! decoders (`sql::rows`) take either.

use std::sync::Arc;

use sqlx::sqlite::LockedSqliteHandle;
use sqlx::{Sqlite, SqliteConnection};

use super::raw::Statements;
use crate::sql::BoxFuture;
use crate::sql::plan::Arg;
use crate::sql::source::{CellOf, Source};

/// One row a read on the held handle returned, its cells copied out;
/// decoded by column name (`CellOf`) as sqlx's rows are.
#[derive(Debug)]
pub(crate) struct RawRow {
    pub(super) columns: Arc<[String]>,
    pub(super) values: Vec<RawValue>,
}

/// One cell, by SQLite's storage class.
#[derive(Debug)]
pub(super) enum RawValue {
    Null,
    Int(i64),
    /// Read by no decoder: its value is not copied.
    Real,
    Text(String),
    Blob(Vec<u8>),
}

impl RawRow {
    fn value(&self, column: &str) -> Result<&RawValue, sqlx::Error> {
        self.columns
            .iter()
            .position(|c| c == column)
            .and_then(|i| self.values.get(i))
            .ok_or_else(|| sqlx::Error::ColumnNotFound(column.to_owned()))
    }

    fn mismatch(column: &str, value: &RawValue, wanted: &str) -> sqlx::Error {
        let found = match value {
            RawValue::Null => "NULL",
            RawValue::Int(_) => "an integer",
            RawValue::Real => "a real",
            RawValue::Text(_) => "text",
            RawValue::Blob(_) => "a blob",
        };
        sqlx::Error::ColumnDecode {
            index: column.to_owned(),
            source: format!("{found} where {wanted} was expected").into(),
        }
    }
}

impl CellOf<Option<i64>> for RawRow {
    fn cell_of(&self, column: &str) -> Result<Option<i64>, sqlx::Error> {
        match self.value(column)? {
            RawValue::Null => Ok(None),
            RawValue::Int(v) => Ok(Some(*v)),
            other => Err(Self::mismatch(column, other, "an integer")),
        }
    }
}

impl CellOf<i64> for RawRow {
    fn cell_of(&self, column: &str) -> Result<i64, sqlx::Error> {
        match self.value(column)? {
            RawValue::Int(v) => Ok(*v),
            other => Err(Self::mismatch(column, other, "an integer")),
        }
    }
}

impl CellOf<String> for RawRow {
    fn cell_of(&self, column: &str) -> Result<String, sqlx::Error> {
        match self.value(column)? {
            RawValue::Text(v) => Ok(v.clone()),
            other => Err(Self::mismatch(column, other, "text")),
        }
    }
}

/// Bytes from a blob or, as sqlx decodes them, from text.
impl CellOf<Option<Vec<u8>>> for RawRow {
    fn cell_of(&self, column: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        match self.value(column)? {
            RawValue::Null => Ok(None),
            RawValue::Blob(v) => Ok(Some(v.clone())),
            RawValue::Text(v) => Ok(Some(v.as_bytes().to_vec())),
            other => Err(Self::mismatch(column, other, "a blob")),
        }
    }
}

impl CellOf<Vec<u8>> for RawRow {
    fn cell_of(&self, column: &str) -> Result<Vec<u8>, sqlx::Error> {
        match self.value(column)? {
            RawValue::Blob(v) => Ok(v.clone()),
            RawValue::Text(v) => Ok(v.as_bytes().to_vec()),
            other => Err(Self::mismatch(column, other, "a blob")),
        }
    }
}

/// The held handle as the writer's `Source` of reads: each read runs
/// right here, on the writer's thread, with the writer's statements.
pub(super) struct HeldSource<'a, 'h> {
    pub(super) handle: &'a mut LockedSqliteHandle<'h>,
    pub(super) statements: &'a mut Statements,
}

impl Source<Sqlite> for HeldSource<'_, '_> {
    type Row = RawRow;

    fn rows<'a>(
        &'a mut self,
        text: &'a str,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<Vec<RawRow>, sqlx::Error>> {
        // Read now; the future only carries the rows.
        let rows = self.statements.rows(self.handle, text, args);
        Box::pin(std::future::ready(rows))
    }

    /// Nothing to reserve: the writer's counter is authoritative.
    fn reserve_seqs<'a>(
        &'a mut self,
        _: &'a mut i64,
        _: usize,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn connection(&mut self) -> Option<&mut SqliteConnection> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Connection;

    /// Every storage class decodes as its column type asks, and a cell of
    /// another class is an error naming its column, not a guess.
    #[tokio::test]
    async fn cells_decode_by_storage_class_and_a_mismatch_names_its_column() {
        crate::sqlite::before_sqlite();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let mut statements = Statements::default();
        let mut handle = conn.lock_handle().await.unwrap();
        let rows = statements.rows(
            &mut handle,
            "SELECT $1 AS n, NULL AS z, 'text' AS s, x'0102' AS b, x'' AS e, 1.5 AS f",
            &[Arg::Int(-7)],
        );
        statements.finalize_all(&mut handle);
        let rows = rows.expect("read");
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert_eq!(CellOf::<i64>::cell_of(row, "n").unwrap(), -7);
        assert_eq!(CellOf::<Option<i64>>::cell_of(row, "n").unwrap(), Some(-7));
        assert_eq!(CellOf::<Option<i64>>::cell_of(row, "z").unwrap(), None);
        assert_eq!(CellOf::<Option<Vec<u8>>>::cell_of(row, "z").unwrap(), None);
        assert_eq!(CellOf::<String>::cell_of(row, "s").unwrap(), "text");
        // As sqlx reads them: text's bytes as a blob.
        assert_eq!(CellOf::<Vec<u8>>::cell_of(row, "s").unwrap(), b"text");
        assert_eq!(CellOf::<Vec<u8>>::cell_of(row, "b").unwrap(), vec![1, 2]);
        assert_eq!(
            CellOf::<Vec<u8>>::cell_of(row, "e").unwrap(),
            Vec::<u8>::new()
        );
        assert_eq!(
            CellOf::<Option<Vec<u8>>>::cell_of(row, "e").unwrap(),
            Some(Vec::new())
        );
        for (column, error) in [
            ("z", CellOf::<i64>::cell_of(row, "z").unwrap_err()),
            ("n", CellOf::<Vec<u8>>::cell_of(row, "n").unwrap_err()),
            ("b", CellOf::<String>::cell_of(row, "b").unwrap_err()),
            ("f", CellOf::<i64>::cell_of(row, "f").unwrap_err()),
        ] {
            assert!(
                matches!(&error, sqlx::Error::ColumnDecode { index, .. } if index == column),
                "{column}: {error}"
            );
        }
        assert!(matches!(
            CellOf::<i64>::cell_of(row, "missing"),
            Err(sqlx::Error::ColumnNotFound(c)) if c == "missing"
        ));
    }

    /// A read that fails mid-way (a cell SQLite cannot give as UTF-8
    /// text) returns the error, leaves its statement ready for the next
    /// read, and the connection closes cleanly after.
    #[tokio::test]
    async fn a_failed_read_leaves_its_statement_ready_and_the_connection_closable() {
        crate::sqlite::before_sqlite();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let mut statements = Statements::default();
        let mut handle = conn.lock_handle().await.unwrap();
        let text = "SELECT CAST($1 AS TEXT) AS s";
        let bad = statements.rows(&mut handle, text, &[Arg::Blob(&[0xff, 0xfe])]);
        assert!(
            matches!(&bad, Err(sqlx::Error::Protocol(m)) if m.contains("not UTF-8")),
            "{bad:?}"
        );
        let good = statements
            .rows(&mut handle, text, &[Arg::Blob(b"ok")])
            .unwrap();
        assert_eq!(CellOf::<String>::cell_of(&good[0], "s").unwrap(), "ok");
        let short = statements.rows(&mut handle, text, &[]);
        assert!(
            matches!(&short, Err(sqlx::Error::Protocol(m)) if m.contains("takes 1 values")),
            "{short:?}"
        );
        statements.finalize_all(&mut handle);
        drop(handle);
        conn.close().await.expect("closes: nothing left prepared");
    }

    /// Values bind by position, so a text whose placeholders SQLite would
    /// number differently from their digits (`$2` before `$1`) is
    /// refused rather than bound crosswise; in order, it reads.
    #[tokio::test]
    async fn placeholders_out_of_order_are_refused() {
        crate::sqlite::before_sqlite();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let mut statements = Statements::default();
        let mut handle = conn.lock_handle().await.unwrap();
        let crosswise = statements.rows(
            &mut handle,
            "SELECT $2 AS a, $1 AS b",
            &[Arg::Int(1), Arg::Int(2)],
        );
        assert!(
            matches!(&crosswise, Err(sqlx::Error::Protocol(m)) if m.contains("placeholder 1") && m.contains("$2")),
            "{crosswise:?}"
        );
        let rows = statements
            .rows(
                &mut handle,
                "SELECT $1 AS a, $2 AS b, $1 AS c",
                &[Arg::Int(1), Arg::Int(2)],
            )
            .unwrap();
        assert_eq!(CellOf::<i64>::cell_of(&rows[0], "c").unwrap(), 1);
        assert_eq!(CellOf::<i64>::cell_of(&rows[0], "b").unwrap(), 2);
        statements.finalize_all(&mut handle);
    }
}
