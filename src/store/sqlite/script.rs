//! The SQL script builder: a planned batch's statements joined into one
//! script (BEGIN to COMMIT in one round trip to SQLite's worker thread).

use super::*;

/// Statements joined into one SQL script (separated by `;`), with their
/// bind parameters in order.
#[derive(Default)]
pub(super) struct Script {
    pub(super) query: QueryBuilder<Sqlite>,
    pub(super) statements: usize,
}

impl Script {
    /// Starts the next statement with `sql`.
    pub(super) fn statement(&mut self, sql: &str) -> &mut QueryBuilder<Sqlite> {
        if self.statements > 0 {
            self.query.push("; ");
        }
        self.statements += 1;
        self.query.push(sql)
    }
}
