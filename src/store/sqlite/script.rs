//! The SQL script builder: a planned batch's statements joined into one
//! script (BEGIN to COMMIT in one round trip to SQLite's worker thread).

use sqlx::{QueryBuilder, Sqlite};

/// Statements joined into one SQL script (separated by `;`), with their
/// bind parameters in order.
#[derive(Default)]
pub(super) struct Script {
    query: QueryBuilder<Sqlite>,
    statements: usize,
}

impl crate::store::sql::plan::Script<Sqlite> for Script {
    fn statement(&mut self, sql: &str) -> &mut QueryBuilder<Sqlite> {
        if self.statements > 0 {
            self.query.push("; ");
        }
        self.statements += 1;
        self.query.push(sql)
    }

    fn query(&mut self) -> &mut QueryBuilder<Sqlite> {
        &mut self.query
    }

    fn statements(&self) -> usize {
        self.statements
    }
}
