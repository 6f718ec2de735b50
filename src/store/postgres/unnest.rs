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
//! A connection keeps its plan, made again every second
//! (`writer::ISSUANCE_BEGIN`).
//!
//! The parts touch disjoint rows (new contracts, their envelopes, labels,
//! receipts and request-log keys; earlier contracts this transaction
//! already locked), so their order within the statement does not matter.

use sqlx::{Postgres, QueryBuilder};

use crate::store::batch::Plan;

/// The plan's writes as one statement, which returns the (position,
/// root) of each event it placed (see `events`); `None` when it writes
/// nothing.
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
    events(&mut parts, plan);
    Some(parts.query)
}

/// Every part's rows, counted: the clock's lock reads it, so every part
/// has run (and waited for any lock it met) before the clock is locked.
const DONE: &str = "done AS (SELECT count(*) AS rows FROM (";

/// `PLACE`'s text, as a literal: `events::PLACE_OWN` ends with it too.
macro_rules! place {
    () => {
        "clock AS (\
             SELECT 1 AS locked FROM event_clock, done \
             WHERE event_clock.id = 1 AND EXISTS (SELECT 1 FROM ev) \
             FOR UPDATE OF event_clock), \
         taken AS (SELECT min(nextval('event_positions')) AS first FROM ev CROSS JOIN clock) \
         INSERT INTO events (seq, kind, contract_seq, root_id, pos) \
         SELECT ev.seq, ev.kind, ev.contract_seq, ev.root_id, \
             taken.first - 1 + row_number() OVER (ORDER BY ev.seq) \
         FROM ev CROSS JOIN taken \
         RETURNING pos, root_id"
    };
}
pub(super) use place;

/// The clock's lock, the positions and the events' insert, after `ev`
/// (the events) and `done` (see `DONE`). The clock's row is locked, not
/// updated: positions come from the `event_positions` sequence, which
/// only holders of that lock use, so a transaction's are consecutive
/// (the first of its `nextval`s, then one more per event in `seq`
/// order). An update of the row per commit made a new row version that
/// every transaction waiting for the lock re-checked: the database's CPU
/// per delegation with three replicas 171–204 against 123–145 µs (migration
/// 39, BENCHMARKS.md). A group with no events (writes but no contract or
/// receipt) leaves the clock alone.
pub(super) const PLACE: &str = place!();

/// The events of the plan's contracts and receipts, at the next positions
/// in `seq` order, as the statement's main part (`events::place_own` does
/// the same for a lifecycle transaction, reading its rows back). The
/// event rows come from the plan (a statement does not see its own
/// parts' rows), and the clock's row lock is the statement's last (see
/// `events::place_own`): it is held from there to the commit.
fn events(parts: &mut Parts, plan: &Plan) {
    let count = parts.count;
    let query = &mut parts.query;
    let contracts = plan.contracts.iter();
    let receipts = plan.receipts.iter();
    query.push(", ev AS (SELECT * FROM UNNEST(");
    column(
        query,
        contracts
            .clone()
            .map(|c| c.seq)
            .chain(receipts.clone().map(|r| r.seq))
            .collect::<Vec<i64>>(),
        true,
    );
    column(
        query,
        contracts
            .clone()
            .map(|_| 1i64)
            .chain(receipts.clone().map(|_| 2i64))
            .collect::<Vec<i64>>(),
        false,
    );
    column(
        query,
        contracts
            .clone()
            .map(|c| c.seq)
            .chain(receipts.clone().map(|r| r.contract_seq))
            .collect::<Vec<i64>>(),
        false,
    );
    column(
        query,
        contracts
            .map(|c| c.root_id.as_slice())
            .chain(receipts.map(|r| r.root_id.as_slice()))
            .collect::<Vec<&[u8]>>(),
        false,
    );
    query.push(") AS e(seq, kind, contract_seq, root_id)), ");
    query.push(DONE);
    for part in 1..=count {
        if part > 1 {
            query.push(" UNION ALL ");
        }
        query.push(format_args!("SELECT 1 FROM w{part}"));
    }
    query.push(") every), ");
    query.push(PLACE);
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
    query.push(") RETURNING 1)");

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
    query.push(") RETURNING 1)");
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
    query.push(") RETURNING 1)");
}

/// The ledger of every earlier contract the batch changed (each already
/// locked by this transaction; never its status: see `Plan::states`),
/// around its four arrays (seq, reserved, spent, open_children).
pub(super) const UPDATE_STATES: (&str, &str) = (
    "UPDATE contracts SET reserved = u.reserved, spent = u.spent, \
     open_children = u.open_children FROM UNNEST(",
    ") AS u(seq, reserved, spent, open_children) WHERE contracts.seq = u.seq",
);

fn update_states(parts: &mut Parts, plan: &Plan) {
    let states = &plan.states;
    if states.is_empty() {
        return;
    }
    let query = parts.start(UPDATE_STATES.0);
    column(query, states.iter().map(|s| s.0).collect(), true);
    column(query, states.iter().map(|s| s.1.reserved).collect(), false);
    column(query, states.iter().map(|s| s.1.spent).collect(), false);
    column(
        query,
        states
            .iter()
            .map(|s| i64::from(s.1.open_children))
            .collect(),
        false,
    );
    query.push(UPDATE_STATES.1);
    query.push(" RETURNING 1)");
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
    query.push(") RETURNING 1)");
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
    query.push(") RETURNING 1)");
}
