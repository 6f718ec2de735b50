//! A planned batch's writes as multi-row statements: SQL text with `?`
//! placeholders and the values they bind, borrowed from the plan (`Sql`).
//! SQLite's writer runs them on its own thread (`store::sqlite::raw`).
//! PostgreSQL writes the same plan through its own `UNNEST` statement
//! (`store::postgres::unnest`): fixed text, one round trip.

use crate::batch::Plan;
use crate::limits::ROWS_PER_STATEMENT;
use broker_domain::Ledger;

/// A value bound to one `?`, borrowed from the plan: nothing is copied
/// on its way to the database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg<'a> {
    Null,
    Int(i64),
    Blob(&'a [u8]),
    Text(&'a str),
}

impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::Int(v)
    }
}

impl<'a> From<&'a [u8]> for Arg<'a> {
    fn from(v: &'a [u8]) -> Self {
        Arg::Blob(v)
    }
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(v: &'a str) -> Self {
        Arg::Text(v)
    }
}

impl<'a, T: Into<Arg<'a>>> From<Option<T>> for Arg<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Arg::Null, Into::into)
    }
}

/// One statement: its text and its values, in placeholder order.
#[derive(Debug, Default)]
pub(crate) struct Statement<'a> {
    pub(crate) text: String,
    pub(crate) args: Vec<Arg<'a>>,
}

/// Statements to run in order, built by the planner.
#[derive(Debug, Default)]
pub(crate) struct Sql<'a> {
    statements: Vec<Statement<'a>>,
    /// See `Sql::whole_transaction`.
    or_rollback: bool,
}

impl<'a> Sql<'a> {
    /// Statements that carry their own BEGIN and COMMIT: any failed
    /// statement rolls the whole transaction back (`OR ROLLBACK`). Inside
    /// a transaction SQLite otherwise copies every page a multi-row
    /// statement touches into a statement journal, to undo just that
    /// statement — a page copy and its allocations per page per statement
    /// that the fast path never needs, since it redoes the whole batch on
    /// any conflict. (Not for statements inside a sqlx transaction: sqlx
    /// would not know its transaction had ended.)
    pub(crate) fn whole_transaction() -> Self {
        Self {
            or_rollback: true,
            ..Self::default()
        }
    }

    /// Starts the next statement with `sql`.
    pub(crate) fn statement(&mut self, sql: &str) -> &mut Self {
        self.statements.push(Statement {
            text: sql.to_owned(),
            args: Vec::new(),
        });
        self
    }

    /// A whole statement, its placeholders already in its text.
    pub(crate) fn bound(
        &mut self,
        sql: &str,
        args: impl IntoIterator<Item = Arg<'a>>,
    ) -> &mut Self {
        self.statements.push(Statement {
            text: sql.to_owned(),
            args: args.into_iter().collect(),
        });
        self
    }

    /// Appends `sql` to the statement last started (starting the first
    /// if there is none, so nothing pushed is ever dropped).
    pub(crate) fn push(&mut self, sql: &str) -> &mut Self {
        self.last().text.push_str(sql);
        self
    }

    /// Appends a placeholder and the value it binds.
    pub(crate) fn arg(&mut self, value: impl Into<Arg<'a>>) -> &mut Self {
        let last = self.last();
        last.text.push('?');
        last.args.push(value.into());
        self
    }

    fn last(&mut self) -> &mut Statement<'a> {
        if self.statements.is_empty() {
            self.statements.push(Statement::default());
        }
        let last = self.statements.len() - 1;
        &mut self.statements[last]
    }

    /// ` VALUES (…), (…)`: one parenthesized row per item, its values
    /// pushed by `row` (separated for it).
    pub(crate) fn values<T>(
        &mut self,
        rows: impl IntoIterator<Item = T>,
        mut row: impl FnMut(&mut Row<'_, 'a>, T),
    ) -> &mut Self {
        self.push(" VALUES ");
        for (i, item) in rows.into_iter().enumerate() {
            self.push(if i == 0 { "(" } else { ", (" });
            row(
                &mut Row {
                    sql: self,
                    first: true,
                },
                item,
            );
            self.push(")");
        }
        self
    }

    pub(crate) fn statements(&self) -> &[Statement<'a>] {
        &self.statements
    }

    /// The conflict clause after each `INSERT` and `UPDATE` verb (with
    /// its leading space), or "" for the database's default (undo the
    /// one statement).
    fn on_conflict(&self) -> &'static str {
        if self.or_rollback { " OR ROLLBACK" } else { "" }
    }
}

/// One row of `Sql::values`: its values separated by commas.
pub(crate) struct Row<'s, 'a> {
    sql: &'s mut Sql<'a>,
    first: bool,
}

impl<'a> Row<'_, 'a> {
    pub(crate) fn arg(&mut self, value: impl Into<Arg<'a>>) -> &mut Self {
        if !self.first {
            self.sql.push(", ");
        }
        self.first = false;
        self.sql.arg(value);
        self
    }
}

/// Bind parameters per row of the `contracts` insert, the widest row.
const CONTRACT_ROW_PARAMETERS: usize = 27;
/// Columns a state `UPDATE` sets (the ledger's).
const STATE_COLUMNS: usize = 3;
/// Rows per state `UPDATE`: each binds its seq and value per column and
/// its seq once more in the `IN` list.
const STATE_ROWS_PER_STATEMENT: usize = ROWS_PER_STATEMENT / 8;
const STATE_ROW_PARAMETERS: usize = STATE_COLUMNS * 2 + 1;

/// Most parameters one planned statement binds (and so any statement
/// chunked by `ROWS_PER_STATEMENT` with fewer binds a row): each backend
/// asserts its database takes that many (`store::limits`).
pub(crate) const PARAMETERS_PER_STATEMENT: usize = max(
    ROWS_PER_STATEMENT * CONTRACT_ROW_PARAMETERS,
    STATE_ROWS_PER_STATEMENT * STATE_ROW_PARAMETERS,
);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// Splits `rows` into runs of power-of-two length, longest first, none
/// longer than `most` (rounded down to a power of two). A statement's
/// text depends on its row count, and the writer keeps one prepared
/// statement per text (`sqlite::raw`): with a statement per exact count,
/// batches of every size would prepare up to `most` of them per kind, the
/// largest about a megabyte each (a 512-row `contracts` insert binds
/// 13,824 values), and evict and re-prepare them as sizes vary. With
/// powers of two there are at most log2(`most`) + 1 texts per kind, at
/// the price of at most that many statements for one kind in a batch.
pub(crate) fn power_chunks<T>(rows: &[T], most: usize) -> impl Iterator<Item = &[T]> {
    let longest = prev_power_of_two(most.max(1));
    let mut rest = rows;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (run, tail) = rest.split_at(prev_power_of_two(rest.len().min(longest)));
        rest = tail;
        Some(run)
    })
}

/// The largest power of two not above `n` (`n` ≥ 1).
const fn prev_power_of_two(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Appends the plan's writes to `script`; returns how many statements.
pub(crate) fn plan_statements<'a>(script: &mut Sql<'a>, plan: &'a Plan) -> usize {
    let before = script.statements().len();
    insert_contracts(script, plan);
    insert_run_labels(script, plan);
    update_states(script, plan);
    insert_receipts(script, plan);
    insert_requests(script, plan);
    script.statements().len() - before
}

/// The batch's new contracts and their envelopes.
fn insert_contracts<'a>(script: &mut Sql<'a>, plan: &'a Plan) {
    for chunk in power_chunks(&plan.contracts, ROWS_PER_STATEMENT) {
        let or = script.on_conflict();
        script.statement("INSERT").push(or).push(
            " INTO contracts (seq, id, parent_seq, parent_id, root_seq, root_id, depth, \
             delegate_key, liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
             deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
             retry_headroom, require_host, issued_at_ms, status, budget, reserved, spent, \
             open_children, host_key, labels) ",
        );
        script.values(chunk, |b, row| {
            b.arg(row.seq)
                .arg(row.id.as_slice())
                .arg(row.parent.map(|(seq, _)| seq))
                .arg(row.parent.as_ref().map(|(_, id)| id.as_slice()))
                .arg(row.root_seq)
                .arg(row.root_id.as_slice())
                .arg(i64::from(row.depth))
                .arg(row.delegate_key.as_slice())
                .arg(i64::from(row.liability.as_i32()))
                .arg(row.intent_lineage_hash.as_slice())
                .arg(i64::from(row.cumulative_trust_ppm))
                .arg(row.effective_predicate.as_str())
                .arg(row.deadline_ms)
                .arg(row.write_scope_json.as_str())
                .arg(i64::from(row.policy.max_depth))
                .arg(i64::from(row.policy.min_cumulative_trust_ppm))
                .arg(i64::from(row.policy.max_children))
                .arg(i64::from(row.policy.retry_headroom))
                .arg(i64::from(row.policy.require_host))
                .arg(row.issued_at_ms)
                .arg(i64::from(row.status.as_i32()))
                .arg(row.ledger.budget)
                .arg(row.ledger.reserved)
                .arg(row.ledger.spent)
                .arg(i64::from(row.ledger.open_children))
                .arg(row.host_key.as_ref().map(|h| h.as_slice()))
                .arg(row.labels_json.as_str());
        });
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO contract_envelopes (seq, envelope, trace_context) ");
        script.values(chunk, |b, row| {
            b.arg(row.seq)
                .arg(row.envelope.as_slice())
                .arg(row.trace.as_ref().map(|t| t.as_slice()));
        });
    }
}

/// One `run_labels` row per label of each new root (the index audits
/// select runs by).
fn insert_run_labels<'a>(script: &mut Sql<'a>, plan: &'a Plan) {
    let labels = plan.run_labels();
    let or = script.on_conflict();
    for chunk in power_chunks(&labels, ROWS_PER_STATEMENT) {
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO run_labels (label_key, label_value, root_seq) ");
        script.values(chunk, |b, &(seq, key, value)| {
            b.arg(key).arg(value).arg(seq);
        });
    }
}

/// The ledger of every earlier contract the batch changed (never its
/// status: see `Plan::states`).
fn update_states<'a>(script: &mut Sql<'a>, plan: &'a Plan) {
    // One UPDATE for every changed earlier contract: a CASE per column.
    let or = script.on_conflict();
    for chunk in power_chunks(&plan.states, STATE_ROWS_PER_STATEMENT) {
        script.statement("UPDATE").push(or).push(" contracts SET ");
        type Column = fn(&(i64, Ledger)) -> i64;
        let columns: [(&str, Column); STATE_COLUMNS] = [
            ("reserved", |(_, l)| l.reserved),
            ("spent", |(_, l)| l.spent),
            ("open_children", |(_, l)| i64::from(l.open_children)),
        ];
        for (i, (name, value)) in columns.iter().enumerate() {
            if i > 0 {
                script.push(", ");
            }
            script.push(name).push(" = CASE seq");
            for state in chunk {
                script
                    .push(" WHEN ")
                    .arg(state.0)
                    .push(" THEN ")
                    .arg(value(state));
            }
            script.push(" END");
        }
        script.push(" WHERE seq IN (");
        for (i, state) in chunk.iter().enumerate() {
            if i > 0 {
                script.push(", ");
            }
            script.arg(state.0);
        }
        script.push(")");
    }
}

/// The batch's receipts (refusals).
fn insert_receipts<'a>(script: &mut Sql<'a>, plan: &'a Plan) {
    let or = script.on_conflict();
    for chunk in power_chunks(&plan.receipts, ROWS_PER_STATEMENT) {
        script.statement("INSERT").push(or).push(
            " INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) ",
        );
        script.values(chunk, |b, row| {
            b.arg(row.seq)
                .arg(row.id.as_slice())
                .arg(row.kind)
                .arg(row.contract_seq)
                .arg(row.contract_id.as_slice())
                .arg(row.root_id.as_slice())
                .arg(row.envelope.as_slice())
                .arg(row.at_ms);
        });
    }
}

/// The request log entries of the batch's answers.
fn insert_requests<'a>(script: &mut Sql<'a>, plan: &'a Plan) {
    let or = script.on_conflict();
    for chunk in power_chunks(&plan.requests, ROWS_PER_STATEMENT) {
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) ");
        script.values(chunk, |b, row| {
            b.arg(row.agent.as_slice())
                .arg(row.nonce.as_slice())
                .arg(row.digest.as_slice())
                .arg(row.outcome)
                .arg(row.ref_id.as_slice())
                .arg(row.at_ms);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_chunks_cover_every_row_in_order_with_few_distinct_lengths() {
        let mut lengths = std::collections::BTreeSet::new();
        for n in 0..=1_100usize {
            let rows: Vec<usize> = (0..n).collect();
            let runs: Vec<&[usize]> = power_chunks(&rows, ROWS_PER_STATEMENT).collect();
            let joined: Vec<usize> = runs.iter().flat_map(|r| r.iter().copied()).collect();
            assert_eq!(joined, rows, "every row once, in order ({n} rows)");
            for run in &runs {
                assert!(
                    run.len().is_power_of_two() && run.len() <= 512,
                    "{n}: {}",
                    run.len()
                );
                lengths.insert(run.len());
            }
            assert!(
                runs.windows(2).all(|w| w[0].len() >= w[1].len()),
                "longest first ({n} rows)"
            );
            if n <= 512 {
                assert_eq!(runs.len(), n.count_ones() as usize, "{n} rows");
            }
        }
        assert_eq!(lengths.len(), 10, "1, 2, 4, … 512: {lengths:?}");
        assert_eq!(
            power_chunks(&[1, 2, 3], 0).count(),
            3,
            "a zero limit still makes progress"
        );
        assert_eq!(prev_power_of_two(1), 1);
        assert_eq!(prev_power_of_two(1_000), 512);
    }

    #[test]
    fn text_pushed_before_any_statement_starts_one() {
        let mut sql = Sql::default();
        sql.push("SELECT ").arg(7i64);
        sql.statement("SELECT 1");
        let texts: Vec<&str> = sql.statements().iter().map(|s| s.text.as_str()).collect();
        assert_eq!(texts, ["SELECT ?", "SELECT 1"]);
        assert_eq!(sql.statements()[0].args, [Arg::Int(7)]);
    }
}
