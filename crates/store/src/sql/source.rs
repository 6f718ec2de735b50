//! Where a writer's reads go: a sqlx connection of any `Dialect`, or
//! SQLite's writer's own held handle (`sqlite::raw::HeldSource`), which reads
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
                // Typed as an integer: no read binds NULL today, and one
                // compared with a blob column would fail on PostgreSQL.
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

/// `head` followed by `($1, $2, …)`, a placeholder per value, then
/// `tail`: an `IN` list's text.
pub(crate) fn listed(head: &str, count: usize, tail: &str) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(head.len() + tail.len() + count * 5 + 2);
    text.push_str(head);
    text.push('(');
    for i in 1..=count {
        if i > 1 {
            text.push_str(", ");
        }
        let _ = write!(text, "${i}");
    }
    text.push(')');
    text.push_str(tail);
    text
}

/// `values` padded to a power-of-two count by repeating the last (an
/// `IN` list is a set): the texts of `listed` are then few, whatever the
/// counts read, and stay prepared.
pub(crate) fn padded<T: Clone>(mut values: Vec<T>) -> Vec<T> {
    if let Some(last) = values.last().cloned() {
        values.resize(values.len().next_power_of_two(), last);
    }
    values
}

// A padded chunk of request-log keys (two values a key) stays under
// SQLite's bind limit.
const _: () = assert!(crate::limits::ROWS_PER_STATEMENT.next_power_of_two() * 2 <= 32_766);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_numbers_its_placeholders_in_order() {
        assert_eq!(
            listed("SELECT x FROM t WHERE k IN ", 3, " LIMIT $4"),
            "SELECT x FROM t WHERE k IN ($1, $2, $3) LIMIT $4"
        );
        assert_eq!(listed("a IN ", 1, ""), "a IN ($1)");
    }

    #[test]
    fn a_list_is_padded_to_a_power_of_two_with_its_last_value() {
        assert_eq!(padded(vec![1, 2, 3]), vec![1, 2, 3, 3]);
        assert_eq!(padded(vec![1, 2, 3, 4, 5]), vec![1, 2, 3, 4, 5, 5, 5, 5]);
        assert_eq!(padded(vec![7]), vec![7]);
        assert!(padded(Vec::<i64>::new()).is_empty());
    }
}
