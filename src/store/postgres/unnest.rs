//! A planned batch's writes on PostgreSQL as one statement: a
//! data-modifying `WITH` part per table, each column bound as one array and
//! expanded with `UNNEST`.
//!
//! Why not the multi-row `VALUES` statements SQLite uses (`sql::plan`):
//! their text changes with the row count, so every replica's every
//! connection parses a new statement for most batches and keeps each
//! variant in its statement cache. Here the text is fixed (two shapes:
//! with and without a root's labels), one bind parameter per column, not
//! per cell, and one round trip instead of one per table: a transaction's
//! fixed cost is most of the database's CPU per delegation once several
//! replicas split the load into small groups (BENCHMARKS.md, issue 27).
//! A connection plans it once (`writer::ISSUANCE_BEGIN`).
//!
//! The parts touch disjoint rows (new contracts, their envelopes, labels,
//! receipts and request-log keys; earlier contracts this transaction
//! already locked), so their order within the statement does not matter.

use sqlx::{Postgres, QueryBuilder};

use crate::store::batch::Plan;

/// The plan's writes as one statement; `None` when it writes nothing.
pub(super) fn writes(plan: &Plan) -> Option<QueryBuilder<Postgres>> {
    let mut parts = Parts {
        query: QueryBuilder::new("WITH "),
        count: 0,
    };
    insert_contracts(&mut parts, plan);
    insert_run_labels(&mut parts, plan);
    update_states(&mut parts, plan);
    insert_receipts(&mut parts, plan);
    insert_requests(&mut parts, plan);
    if parts.count == 0 {
        return None;
    }
    parts.query.push(" SELECT 1");
    Some(parts.query)
}

/// The `WITH` parts of the one statement.
struct Parts {
    query: QueryBuilder<Postgres>,
    count: usize,
}

impl Parts {
    /// Starts the next part with `sql`; the caller closes it with `)`.
    fn start(&mut self, sql: &str) -> &mut QueryBuilder<Postgres> {
        if self.count > 0 {
            self.query.push(", ");
        }
        self.count += 1;
        self.query.push(format_args!("w{} AS (", self.count));
        self.query.push(sql)
    }
}

/// Binds one column: `values` as an array.
fn column<'t, T>(query: &mut QueryBuilder<Postgres>, values: Vec<T>, first: bool)
where
    Vec<T>: sqlx::Encode<'t, Postgres> + sqlx::Type<Postgres>,
{
    if !first {
        query.push(", ");
    }
    query.push_bind(values);
}

fn insert_contracts(parts: &mut Parts, plan: &Plan) {
    let rows = &plan.contracts;
    if rows.is_empty() {
        return;
    }
    let query = parts.start(
        "INSERT INTO contracts (seq, id, parent_seq, parent_id, root_seq, root_id, depth, \
         delegate_key, liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
         deadline_ms, write_scope, max_depth, min_cumulative_trust_ppm, max_children, \
         retry_headroom, require_host, issued_at_ms, status, budget, reserved, spent, \
         open_children, host_key, labels) SELECT * FROM UNNEST(",
    );
    let ints = |f: &dyn Fn(&crate::store::batch::ContractRow) -> i64| -> Vec<i64> {
        rows.iter().map(f).collect()
    };
    column(query, ints(&|r| r.seq), true);
    column(query, rows.iter().map(|r| r.id.as_slice()).collect(), false);
    column(
        query,
        rows.iter()
            .map(|r| r.parent.map(|(seq, _)| seq))
            .collect::<Vec<Option<i64>>>(),
        false,
    );
    column(
        query,
        rows.iter()
            .map(|r| r.parent.as_ref().map(|(_, id)| id.as_slice()))
            .collect::<Vec<Option<&[u8]>>>(),
        false,
    );
    column(query, ints(&|r| r.root_seq), false);
    column(
        query,
        rows.iter().map(|r| r.root_id.as_slice()).collect(),
        false,
    );
    column(query, ints(&|r| i64::from(r.depth)), false);
    column(
        query,
        rows.iter().map(|r| r.delegate_key.as_slice()).collect(),
        false,
    );
    column(query, ints(&|r| i64::from(r.liability.as_i32())), false);
    column(
        query,
        rows.iter()
            .map(|r| r.intent_lineage_hash.as_slice())
            .collect(),
        false,
    );
    column(query, ints(&|r| i64::from(r.cumulative_trust_ppm)), false);
    column(
        query,
        rows.iter()
            .map(|r| r.effective_predicate.as_str())
            .collect(),
        false,
    );
    column(query, ints(&|r| r.deadline_ms), false);
    column(
        query,
        rows.iter().map(|r| r.write_scope_json.as_str()).collect(),
        false,
    );
    column(query, ints(&|r| i64::from(r.policy.max_depth)), false);
    column(
        query,
        ints(&|r| i64::from(r.policy.min_cumulative_trust_ppm)),
        false,
    );
    column(query, ints(&|r| i64::from(r.policy.max_children)), false);
    column(query, ints(&|r| i64::from(r.policy.retry_headroom)), false);
    column(query, ints(&|r| i64::from(r.policy.require_host)), false);
    column(query, ints(&|r| r.issued_at_ms), false);
    column(query, ints(&|r| i64::from(r.status.as_i32())), false);
    column(query, ints(&|r| r.ledger.budget), false);
    column(query, ints(&|r| r.ledger.reserved), false);
    column(query, ints(&|r| r.ledger.spent), false);
    column(query, ints(&|r| i64::from(r.ledger.open_children)), false);
    column(
        query,
        rows.iter()
            .map(|r| r.host_key.as_ref().map(|h| h.as_slice()))
            .collect::<Vec<Option<&[u8]>>>(),
        false,
    );
    column(
        query,
        rows.iter().map(|r| r.labels_json.as_str()).collect(),
        false,
    );
    query.push("))");

    let query = parts.start(
        "INSERT INTO contract_envelopes (seq, envelope, trace_context) SELECT * FROM UNNEST(",
    );
    column(query, ints(&|r| r.seq), true);
    column(
        query,
        rows.iter().map(|r| r.envelope.as_slice()).collect(),
        false,
    );
    column(
        query,
        rows.iter()
            .map(|r| r.trace.as_ref().map(|t| t.as_slice()))
            .collect::<Vec<Option<&[u8]>>>(),
        false,
    );
    query.push("))");
}

/// One `run_labels` row per label of each new root.
fn insert_run_labels(parts: &mut Parts, plan: &Plan) {
    let labels = plan.run_labels();
    if labels.is_empty() {
        return;
    }
    let query = parts
        .start("INSERT INTO run_labels (label_key, label_value, root_seq) SELECT * FROM UNNEST(");
    column(query, labels.iter().map(|l| l.1).collect(), true);
    column(query, labels.iter().map(|l| l.2).collect(), false);
    column(query, labels.iter().map(|l| l.0).collect(), false);
    query.push("))");
}

/// Status and ledger of every earlier contract the batch changed (each
/// already locked by this transaction).
/// The update of earlier contracts' states, around its five arrays (seq,
/// status, reserved, spent, open_children).
pub(super) const UPDATE_STATES: (&str, &str) = (
    "UPDATE contracts SET status = u.status, reserved = u.reserved, spent = u.spent, \
     open_children = u.open_children FROM UNNEST(",
    ") AS u(seq, status, reserved, spent, open_children) WHERE contracts.seq = u.seq",
);

fn update_states(parts: &mut Parts, plan: &Plan) {
    let states = &plan.states;
    if states.is_empty() {
        return;
    }
    let query = parts.start(UPDATE_STATES.0);
    column(query, states.iter().map(|s| s.0).collect(), true);
    column(
        query,
        states.iter().map(|s| i64::from(s.1.as_i32())).collect(),
        false,
    );
    column(query, states.iter().map(|s| s.2.reserved).collect(), false);
    column(query, states.iter().map(|s| s.2.spent).collect(), false);
    column(
        query,
        states
            .iter()
            .map(|s| i64::from(s.2.open_children))
            .collect(),
        false,
    );
    query.push(UPDATE_STATES.1);
    query.push(")");
}

/// The batch's receipts (refusals).
fn insert_receipts(parts: &mut Parts, plan: &Plan) {
    let rows = &plan.receipts;
    if rows.is_empty() {
        return;
    }
    let query = parts.start(
        "INSERT INTO receipts (seq, id, kind, contract_seq, contract_id, root_id, envelope, at_ms) \
         SELECT * FROM UNNEST(",
    );
    column(query, rows.iter().map(|r| r.seq).collect(), true);
    column(query, rows.iter().map(|r| r.id.as_slice()).collect(), false);
    column(query, rows.iter().map(|r| r.kind).collect(), false);
    column(query, rows.iter().map(|r| r.contract_seq).collect(), false);
    column(
        query,
        rows.iter().map(|r| r.contract_id.as_slice()).collect(),
        false,
    );
    column(
        query,
        rows.iter().map(|r| r.root_id.as_slice()).collect(),
        false,
    );
    column(
        query,
        rows.iter().map(|r| r.envelope.as_slice()).collect(),
        false,
    );
    column(query, rows.iter().map(|r| r.at_ms).collect(), false);
    query.push("))");
}

/// The request log entries of the batch's answers.
fn insert_requests(parts: &mut Parts, plan: &Plan) {
    let rows = &plan.requests;
    if rows.is_empty() {
        return;
    }
    let query = parts.start(
        "INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) \
         SELECT * FROM UNNEST(",
    );
    column(
        query,
        rows.iter().map(|r| r.agent.as_slice()).collect(),
        true,
    );
    column(
        query,
        rows.iter().map(|r| r.nonce.as_slice()).collect(),
        false,
    );
    column(
        query,
        rows.iter().map(|r| r.digest.as_slice()).collect(),
        false,
    );
    column(query, rows.iter().map(|r| r.outcome).collect(), false);
    column(
        query,
        rows.iter().map(|r| r.ref_id.as_slice()).collect(),
        false,
    );
    column(query, rows.iter().map(|r| r.at_ms).collect(), false);
    query.push("))");
}
