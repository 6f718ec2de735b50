//! A planned batch's writes as multi-row statements, for any `Dialect`;
//! each backend's `Script` decides how the statements reach the database
//! (SQLite: one script, BEGIN to COMMIT, in one round trip). PostgreSQL
//! writes the same plan through its own `UNNEST` statement
//! (`store::postgres::unnest`): fixed text, one round trip.

use sqlx::QueryBuilder;

use super::{Dialect, PushArg};
use crate::core::{Ledger, Status};
use crate::store::batch::Plan;
use crate::store::limits::ROWS_PER_STATEMENT;

/// Where a planned batch's statements go: each backend decides how they
/// reach its database.
pub(crate) trait Script<D: Dialect> {
    /// Starts the next statement with `sql`; returns it to be continued.
    fn statement(&mut self, sql: &str) -> &mut QueryBuilder<D>;
    /// The statement `statement` last started.
    fn query(&mut self) -> &mut QueryBuilder<D>;
    /// Statements started so far.
    fn statements(&self) -> usize;
    /// The conflict clause after each `INSERT` and `UPDATE` verb (with
    /// its leading space), or "" for the database's default (undo the
    /// one statement).
    fn on_conflict(&self) -> &'static str {
        ""
    }
}

/// Bind parameters per row of the `contracts` insert, the widest row.
const CONTRACT_ROW_PARAMETERS: usize = 27;
/// Rows per state `UPDATE`: each binds its seq twice per column (4) and
/// once in the `IN` list.
const STATE_ROWS_PER_STATEMENT: usize = ROWS_PER_STATEMENT / 8;
const STATE_ROW_PARAMETERS: usize = 4 * 2 + 1;

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

/// Appends the plan's writes to `script`; returns how many statements.
/// One script per batch: one hand-off to sqlx's worker thread instead of
/// one per statement.
pub(crate) fn plan_statements<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) -> usize {
    let before = script.statements();
    insert_contracts(script, plan);
    insert_run_labels(script, plan);
    update_states(script, plan);
    insert_receipts(script, plan);
    insert_requests(script, plan);
    script.statements() - before
}

/// The batch's new contracts and their envelopes.
fn insert_contracts<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) {
    for chunk in plan.contracts.chunks(ROWS_PER_STATEMENT) {
        let or = script.on_conflict();
        script.statement("INSERT").push(or).push(
            " INTO contracts (seq, id, parent_seq, parent_id, root_seq, root_id, depth, \
             delegate_key, liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
             deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
             retry_headroom, require_host, issued_at_ms, status, budget, reserved, spent, \
             open_children, host_key, labels) ",
        );
        script.query().push_values(chunk, |mut b, row| {
            b.push_arg(row.seq)
                .push_arg(row.id.as_slice())
                .push_arg(row.parent.map(|(seq, _)| seq))
                .push_arg(row.parent.as_ref().map(|(_, id)| id.as_slice()))
                .push_arg(row.root_seq)
                .push_arg(row.root_id.as_slice())
                .push_arg(i64::from(row.depth))
                .push_arg(row.delegate_key.as_slice())
                .push_arg(i64::from(row.liability.as_i32()))
                .push_arg(row.intent_lineage_hash.as_slice())
                .push_arg(i64::from(row.cumulative_trust_ppm))
                .push_arg(row.effective_predicate.as_str())
                .push_arg(row.deadline_ms)
                .push_arg(row.write_scope_json.as_str())
                .push_arg(i64::from(row.policy.max_depth))
                .push_arg(i64::from(row.policy.min_cumulative_trust_ppm))
                .push_arg(i64::from(row.policy.max_children))
                .push_arg(i64::from(row.policy.retry_headroom))
                .push_arg(i64::from(row.policy.require_host))
                .push_arg(row.issued_at_ms)
                .push_arg(i64::from(row.status.as_i32()))
                .push_arg(row.ledger.budget)
                .push_arg(row.ledger.reserved)
                .push_arg(row.ledger.spent)
                .push_arg(i64::from(row.ledger.open_children))
                .push_arg(row.host_key.map(|h| h.to_vec()))
                .push_arg(row.labels_json.as_str());
        });
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO contract_envelopes (seq, envelope, trace_context) ");
        script.query().push_values(chunk, |mut b, row| {
            b.push_arg(row.seq)
                .push_arg(row.envelope.as_slice())
                .push_arg(row.trace.map(|t| t.to_vec()));
        });
    }
}

/// One `run_labels` row per label of each new root (the index audits
/// select runs by).
fn insert_run_labels<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) {
    let labels = plan.run_labels();
    let or = script.on_conflict();
    for chunk in labels.chunks(ROWS_PER_STATEMENT) {
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO run_labels (label_key, label_value, root_seq) ");
        script
            .query()
            .push_values(chunk, |mut b, (seq, key, value)| {
                b.push_arg(*key).push_arg(*value).push_arg(*seq);
            });
    }
}

/// Status and ledger of every earlier contract the batch changed.
fn update_states<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) {
    // One UPDATE for every changed earlier contract: a CASE per column.
    let or = script.on_conflict();
    for chunk in plan.states.chunks(STATE_ROWS_PER_STATEMENT) {
        script.statement("UPDATE").push(or).push(" contracts SET ");
        type Column = fn(&(i64, Status, Ledger)) -> i64;
        let columns: [(&str, Column); 4] = [
            ("status", |(_, s, _)| i64::from(s.as_i32())),
            ("reserved", |(_, _, l)| l.reserved),
            ("spent", |(_, _, l)| l.spent),
            ("open_children", |(_, _, l)| i64::from(l.open_children)),
        ];
        for (i, (name, value)) in columns.iter().enumerate() {
            if i > 0 {
                script.query().push(", ");
            }
            script.query().push(*name).push(" = CASE seq");
            for state in chunk {
                script
                    .query()
                    .push(" WHEN ")
                    .push_arg(state.0)
                    .push(" THEN ")
                    .push_arg(value(state));
            }
            script.query().push(" END");
        }
        script.query().push(" WHERE seq IN (");
        let mut list = script.query().separated(", ");
        for state in chunk {
            list.push_arg(state.0);
        }
        script.query().push(")");
    }
}

/// The batch's receipts (refusals).
fn insert_receipts<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) {
    let or = script.on_conflict();
    for chunk in plan.receipts.chunks(ROWS_PER_STATEMENT) {
        script.statement("INSERT").push(or).push(
            " INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) ",
        );
        script.query().push_values(chunk, |mut b, row| {
            b.push_arg(row.seq)
                .push_arg(row.id.as_slice())
                .push_arg(row.kind)
                .push_arg(row.contract_seq)
                .push_arg(row.contract_id.as_slice())
                .push_arg(row.root_id.as_slice())
                .push_arg(row.envelope.as_slice())
                .push_arg(row.at_ms);
        });
    }
}

/// The request log entries of the batch's answers.
fn insert_requests<D: Dialect>(script: &mut impl Script<D>, plan: &Plan) {
    let or = script.on_conflict();
    for chunk in plan.requests.chunks(ROWS_PER_STATEMENT) {
        script
            .statement("INSERT")
            .push(or)
            .push(" INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) ");
        script.query().push_values(chunk, |mut b, row| {
            b.push_arg(row.agent.as_slice())
                .push_arg(row.nonce.as_slice())
                .push_arg(row.digest.as_slice())
                .push_arg(row.outcome)
                .push_arg(row.ref_id.as_slice())
                .push_arg(row.at_ms);
        });
    }
}
