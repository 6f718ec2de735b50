//! The SQL script builder: a planned batch's statements joined into one
//! script (BEGIN to COMMIT in one round trip to SQLite's worker thread).

use sqlx::{QueryBuilder, Sqlite};

/// Statements joined into one SQL script (separated by `;`), with their
/// bind parameters in order.
#[derive(Default)]
pub(super) struct Script {
    query: QueryBuilder<Sqlite>,
    statements: usize,
    /// See `Script::whole_transaction`.
    or_rollback: bool,
}

impl Script {
    /// A script that carries its own BEGIN and COMMIT: any failed
    /// statement rolls the whole transaction back (`OR ROLLBACK`). Inside
    /// a transaction SQLite otherwise copies every page a multi-row
    /// statement touches into a statement journal, to undo just that
    /// statement — a page copy and its allocations per page per statement
    /// that the fast path never needs, since it redoes the whole batch on
    /// any conflict. (Not for statements inside a sqlx transaction: sqlx
    /// would not know its transaction had ended.)
    pub(super) fn whole_transaction() -> Self {
        Self {
            or_rollback: true,
            ..Self::default()
        }
    }
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

    fn on_conflict(&self) -> &'static str {
        if self.or_rollback { " OR ROLLBACK" } else { "" }
    }
}
