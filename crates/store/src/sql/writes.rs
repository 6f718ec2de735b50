//! A lifecycle decision's writes as owned statements, made by the shared
//! SQL and run by each backend's writer where it pays: PostgreSQL at
//! once, through sqlx (`Writes::run`); SQLite's writer keeps them and
//! runs them on its own thread with the batch's next statements or its
//! COMMIT (`Writes::script`, `sqlite::raw`), so a transition costs the
//! writer its reads and one hand-over instead of a round trip to sqlx's
//! worker per statement.

use sqlx::AssertSqlSafe;

use super::plan::{Arg, Sql};
use super::{Dialect, QueryExt};

/// A value a write binds, owned (the receipts it signs are made here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Value {
    Int(i64),
    Blob(Vec<u8>),
    /// A blob column that may be NULL (typed, for PostgreSQL).
    MaybeBlob(Option<Vec<u8>>),
    Text(String),
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}

impl From<Vec<u8>> for Value {
    fn from(v: Vec<u8>) -> Self {
        Value::Blob(v)
    }
}

impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Self {
        Value::Blob(v.to_vec())
    }
}

impl From<Option<Vec<u8>>> for Value {
    fn from(v: Option<Vec<u8>>) -> Self {
        Value::MaybeBlob(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_owned())
    }
}

/// One statement: text with `$1`, `$2`, … in order, and its values.
#[derive(Debug)]
struct Write {
    text: String,
    values: Vec<Value>,
}

/// Writes in the order they must run.
#[derive(Debug, Default)]
#[must_use = "writes that are not run are lost"]
pub(crate) struct Writes {
    list: Vec<Write>,
}

impl Writes {
    /// Appends a statement whose placeholders are `$1`…`$n` in order.
    pub(crate) fn push(&mut self, text: impl Into<String>, values: Vec<Value>) {
        self.list.push(Write {
            text: text.into(),
            values,
        });
    }

    /// Appends `head` and ` VALUES (…), (…)`: `row` gives each row's values
    /// (each row the same count).
    pub(crate) fn insert_rows<T>(
        &mut self,
        head: &str,
        rows: impl IntoIterator<Item = T>,
        mut row: impl FnMut(T) -> Vec<Value>,
    ) {
        let mut text = format!("{head} VALUES ");
        let mut values = Vec::new();
        for (i, item) in rows.into_iter().enumerate() {
            text.push_str(if i == 0 { "(" } else { ", (" });
            for (j, value) in row(item).into_iter().enumerate() {
                if j > 0 {
                    text.push_str(", ");
                }
                values.push(value);
                text.push('$');
                text.push_str(&values.len().to_string());
            }
            text.push(')');
        }
        if !values.is_empty() {
            self.push(text, values);
        }
    }

    /// Appends `other`'s writes after these.
    pub(crate) fn append(&mut self, mut other: Writes) {
        self.list.append(&mut other.list);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Runs every write now, in order, through sqlx.
    pub(crate) async fn run<D: Dialect>(
        &self,
        conn: &mut D::Connection,
    ) -> Result<(), sqlx::Error> {
        for write in &self.list {
            // The texts are the shared SQL's own constants and placeholders:
            // nothing client-supplied is interpolated.
            let mut query = sqlx::query::<D>(AssertSqlSafe(write.text.as_str()));
            for value in &write.values {
                query = match value {
                    Value::Int(v) => query.arg(*v),
                    Value::Blob(v) => query.arg(v.as_slice()),
                    Value::MaybeBlob(v) => query.arg(v.as_deref()),
                    Value::Text(v) => query.arg(v.as_str()),
                };
            }
            query.run(&mut *conn).await?;
        }
        Ok(())
    }

    /// Appends every write to `script`, its values borrowed (SQLite takes
    /// `$n` placeholders in order as it takes `?`).
    pub(crate) fn script<'a>(&'a self, script: &mut Sql<'a>) {
        for write in &self.list {
            script.bound(
                &write.text,
                write.values.iter().map(|value| match value {
                    Value::Int(v) => Arg::Int(*v),
                    Value::Blob(v) => Arg::Blob(v),
                    Value::MaybeBlob(v) => v.as_deref().map_or(Arg::Null, Arg::Blob),
                    Value::Text(v) => Arg::Text(v),
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_numbered_in_order_and_scripted_with_their_values() {
        let mut writes = Writes::default();
        writes.insert_rows("INSERT INTO t (a, b)", [1i64, 2], |n| {
            vec![Value::Int(n), Value::MaybeBlob((n == 2).then(|| vec![7]))]
        });
        writes.insert_rows("INSERT INTO t (a, b)", Vec::<i64>::new(), |n| {
            vec![Value::Int(n)]
        });
        assert_eq!(writes.list.len(), 1, "no statement for no rows");
        assert_eq!(
            writes.list[0].text,
            "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4)"
        );
        let mut script = Sql::default();
        writes.script(&mut script);
        assert_eq!(
            script.statements()[0].args,
            vec![Arg::Int(1), Arg::Null, Arg::Int(2), Arg::Blob(&[7])]
        );
    }
}
