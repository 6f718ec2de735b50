//! Where a writer's reads go: a sqlx connection of any `Dialect`, or
//! SQLite's writer's own held handle (`sqlite::raw::Held`), which reads
//! without handing the connection back to sqlx's worker thread. The
//! lifecycle's reads (the subtree, the lineage, the drains, the request
//! log) are written once against `Source`, and rows decode through
//! `Cells` whichever reads them.

use super::plan::Arg;
use super::{BoxFuture, Dialect, Gets, QueryExt};

/// A row whose column decodes as `T`: sqlx's rows (through `Gets`) and
/// the held handle's (`sqlite::raw::RawRow`).
pub(crate) trait CellOf<T> {
    fn cell_of(&self, column: &str) -> Result<T, sqlx::Error>;
}

impl<R: sqlx::Row, T> CellOf<T> for R
where
    R::Database: Gets<T>,
{
    fn cell_of(&self, column: &str) -> Result<T, sqlx::Error> {
        <R::Database as Gets<T>>::get(self, column)
    }
}

/// Every column type the shared decoders take.
pub(crate) trait Cells:
    CellOf<i64>
    + CellOf<Option<i64>>
    + CellOf<String>
    + CellOf<Vec<u8>>
    + CellOf<Option<Vec<u8>>>
    + Send
    + Sync
{
}

impl<R> Cells for R where
    R: CellOf<i64>
        + CellOf<Option<i64>>
        + CellOf<String>
        + CellOf<Vec<u8>>
        + CellOf<Option<Vec<u8>>>
        + Send
        + Sync
{
}

/// Reads of a writer's transaction. Statement texts number their
/// placeholders `$1`, `$2`, … in order (both backends read them so).
pub(crate) trait Source<D: Dialect> {
    type Row: Cells;
    /// Every row `text` returns with `args` bound in order.
    fn rows<'a>(
        &'a mut self,
        text: &'a str,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<Vec<Self::Row>, sqlx::Error>>;
    /// `Dialect::reserve_seqs` on this source's connection.
    fn reserve_seqs<'a>(
        &'a mut self,
        seqs: &'a mut D::Seqs,
        count: usize,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// sqlx's connection, where the source has one: a drain's step
    /// writes as it goes through it. `None` on a held handle, which the
    /// writer never gives a drain step.
    fn connection(&mut self) -> Option<&mut D::Connection>;
}

/// A sqlx connection as a `Source`.
pub(crate) struct Sqlx<'c, D: Dialect>(pub(crate) &'c mut D::Connection);

impl<D: Dialect> Source<D> for Sqlx<'_, D> {
    type Row = D::Row;

    fn rows<'a>(
        &'a mut self,
        text: &'a str,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<Vec<D::Row>, sqlx::Error>> {
        // Texts are the store's constants and placeholder lists
        // (`listed`): nothing client-supplied is interpolated.
        let mut query = sqlx::query::<D>(sqlx::AssertSqlSafe(text.to_owned()));
        for arg in args {
            query = match *arg {
                Arg::Null => query.arg(None::<i64>),
                Arg::Int(v) => query.arg(v),
                Arg::Blob(b) => query.arg(b),
                Arg::Text(t) => query.arg(t),
            };
        }
        query.all(&mut *self.0)
    }

    fn reserve_seqs<'a>(
        &'a mut self,
        seqs: &'a mut D::Seqs,
        count: usize,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(D::reserve_seqs(&mut *self.0, seqs, count))
    }

    fn connection(&mut self) -> Option<&mut D::Connection> {
        Some(&mut *self.0)
    }
}

/// `head` followed by `(…)` with a placeholder per value (numbered from
/// `first`), then `tail`: an `IN` list's text.
pub(crate) fn listed(head: &str, first: usize, count: usize, tail: &str) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(head.len() + tail.len() + count * 5 + 2);
    text.push_str(head);
    text.push('(');
    for i in 0..count {
        if i > 0 {
            text.push_str(", ");
        }
        let _ = write!(text, "${}", first + i);
    }
    text.push(')');
    text.push_str(tail);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_numbers_its_placeholders_from_the_first() {
        assert_eq!(
            listed("SELECT x FROM t WHERE k IN ", 1, 3, " LIMIT $4"),
            "SELECT x FROM t WHERE k IN ($1, $2, $3) LIMIT $4"
        );
        assert_eq!(listed("a IN ", 2, 1, ""), "a IN ($2)");
    }
}
