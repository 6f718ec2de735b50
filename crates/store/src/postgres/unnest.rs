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
//! replicas split the load into small groups (BENCHMARKS.md).
//! A connection keeps its plan, made again every second
//! (`writer::WRITER_SETTINGS`).
//!
//! The parts touch disjoint rows (new contracts, their envelopes, labels,
//! receipts and request-log keys; earlier contracts this transaction
//! already locked, or, optimistic, locks as it updates them — `Guard`),
//! so their order within the statement does not matter; `done` counts
//! them all before the guard, the clock and the reserved numbers.

use std::collections::HashMap;

use sqlx::{Postgres, QueryBuilder};

use crate::batch::Plan;

/// What an optimistic issuance's statement checks (`writer`): it was
/// planned from cached parents, not from rows it locked and read.
pub(super) struct Guard {
    /// Every parent the plan read, by seq, as cached: a parent the plan
    /// updates is updated only if its row still is so, one it only read
    /// (a refusal) is counted only if so; either way a parent changed
    /// since leaves the rows counted short and `issuance_guard` aborts
    /// the statement (BR001).
    pub parents: HashMap<i64, Cached>,
    /// The trees (root seqs) that must have no drain (BR002).
    pub roots: Vec<i64>,
}

/// A parent's row as cached: its version, and what the plan decided on
/// (its status and ledger). The values are compared too: were a
/// transaction id ever handed out twice (commits lost in a crash with
/// `synchronous_commit = off`, or in a failover to an asynchronous
/// standby), a matching `xmin` alone could name another row version.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cached {
    pub xmin: u32,
    pub status: i64,
    pub reserved: i64,
    pub spent: i64,
    pub open_children: i64,
}

/// The condition a parent's row (`contracts`) meets while it is as cached
/// (`u`: `xmin`, `was_status`, `was_reserved`, `was_spent`, `was_open`);
/// a macro for `concat!`.
macro_rules! as_cached {
    () => {
        "contracts.xmin::text::int8 = u.xmin AND contracts.status = u.was_status \
         AND contracts.reserved = u.was_reserved AND contracts.spent = u.was_spent \
         AND contracts.open_children = u.was_open"
    };
}

/// Binds the five cached columns of `seqs` (NULL for a seq without one,
/// which is then not checked).
fn cached_columns(query: &mut QueryBuilder<Postgres>, seqs: &[i64], guard: Option<&Guard>) {
    let cached = |f: &dyn Fn(&Cached) -> i64| -> Vec<Option<i64>> {
        seqs.iter()
            .map(|seq| guard.and_then(|g| g.parents.get(seq)).map(f))
            .collect()
    };
    column(query, cached(&|c| i64::from(c.xmin)), false);
    column(query, cached(&|c| c.status), false);
    column(query, cached(&|c| c.reserved), false);
    column(query, cached(&|c| c.spent), false);
    column(query, cached(&|c| c.open_children), false);
}

/// One row of the writes statement's answer: `kind` `PLACED` (`n` an
/// event's position, with its root), `NUMBER` (`n` a number reserved for
/// the writer's next transaction) or `XID` (`n` the transaction's id).
pub(super) type WrittenRow = (i64, i64, Option<Vec<u8>>);
pub(super) const PLACED: i64 = 0;
pub(super) const NUMBER: i64 = 1;
pub(super) const XID: i64 = 2;

/// The plan's writes as one statement (see `WrittenRow` for what it
/// returns), reserving `numbers` numbers after its locks, and checking
/// `guard` when given; `None` when it writes nothing.
pub(super) fn writes(
    plan: &Plan,
    guard: Option<&Guard>,
    numbers: usize,
) -> Option<QueryBuilder<Postgres>> {
    let mut parts = Parts {
        query: QueryBuilder::new("WITH "),
        count: 0,
        rows: 0,
    };
    insert_contracts(&mut parts, plan);
    insert_run_labels(&mut parts, plan);
    update_states(&mut parts, plan, guard);
    check_unwritten(&mut parts, plan, guard);
    insert_receipts(&mut parts, plan);
    insert_requests(&mut parts, plan);
    if parts.count == 0 {
        return None;
    }
    events(&mut parts, plan, guard);
    let query = &mut parts.query;
    query.push(", placed AS (");
    query.push(place_insert!());
    // Numbers and the id from `done`: after every part's locks, and read
    // (so the guard runs) even when no event was placed.
    query.push(format_args!(
        ") SELECT {PLACED}::int8, pos, root_id FROM placed \
         UNION ALL SELECT {NUMBER}, nextval('seqs'), NULL FROM done, generate_series(1, "
    ));
    query.push_bind(i64::try_from(numbers).unwrap_or(i64::MAX));
    query.push(format_args!(
        ") UNION ALL SELECT {XID}, pg_current_xact_id()::text::int8 % 4294967296, NULL FROM done"
    ));
    Some(parts.query)
}

/// `PLACE`'s text, as a literal: `events::PLACE_OWN` ends with it too.
/// The issuance statement puts its insert in a part (`place_insert`).
macro_rules! place {
    () => {
        concat!(
            $crate::postgres::unnest::place_locks!(),
            " ",
            $crate::postgres::unnest::place_insert!()
        )
    };
}
pub(super) use place;

/// `PLACE`'s clock lock and first position.
macro_rules! place_locks {
    () => {
        "clock AS (\
             SELECT 1 AS locked FROM event_clock, done \
             WHERE event_clock.id = 1 AND EXISTS (SELECT 1 FROM ev) \
             FOR UPDATE OF event_clock), \
         taken AS (SELECT min(nextval('event_positions')) AS first FROM ev CROSS JOIN clock)"
    };
}
pub(super) use place_locks;

/// `PLACE`'s insert of the events.
macro_rules! place_insert {
    () => {
        "INSERT INTO events (seq, kind, contract_seq, root_id, pos) \
         SELECT ev.seq, ev.kind, ev.contract_seq, ev.root_id, \
             taken.first - 1 + row_number() OVER (ORDER BY ev.seq) \
         FROM ev CROSS JOIN taken \
         RETURNING pos, root_id"
    };
}
pub(super) use place_insert;

/// The clock's lock, the positions and the events' insert, after `ev`
/// (the events) and `done` (every part's rows, counted). The clock's row
/// is locked, not
/// updated: positions come from the `event_positions` sequence, which
/// only holders of that lock use, so a transaction's are consecutive
/// (the first of its `nextval`s, then one more per event in `seq`
/// order). An update of the row per commit made a new row version that
/// every transaction waiting for the lock re-checked: the database's CPU
/// per delegation with three replicas 171–204 against 123–145 µs (migration
/// 39, BENCHMARKS.md). A group with no events (writes but no contract or
/// receipt) leaves the clock alone.
#[cfg(test)]
pub(super) const PLACE: &str = place!();

/// The events of the plan's contracts and receipts, at the next positions
/// in `seq` order, as the statement's main part (`events::place_own` does
/// the same for a lifecycle transaction, reading its rows back). The
/// event rows come from the plan (a statement does not see its own
/// parts' rows), and the clock's row lock is the statement's last (see
/// `events::place_own`): it is held from there to the commit.
fn events(parts: &mut Parts, plan: &Plan, guard: Option<&Guard>) {
    let count = parts.count;
    let query = &mut parts.query;
    // Contracts' events, then receipts': one value of each per column.
    let (contracts, receipts) = (&plan.contracts, &plan.receipts);
    let both = |c: &dyn Fn(&crate::batch::ContractRow) -> i64,
                r: &dyn Fn(&crate::batch::ReceiptRow) -> i64|
     -> Vec<i64> {
        contracts
            .iter()
            .map(c)
            .chain(receipts.iter().map(r))
            .collect()
    };
    query.push(", ev AS (SELECT * FROM UNNEST(");
    column(query, both(&|c| c.seq, &|r| r.seq), true);
    column(query, both(&|_| 1, &|_| 2), false);
    column(query, both(&|c| c.seq, &|r| r.contract_seq), false);
    let root_ids = contracts.iter().map(|c| c.root_id.as_slice());
    let root_ids = root_ids.chain(receipts.iter().map(|r| r.root_id.as_slice()));
    column(query, root_ids.collect::<Vec<&[u8]>>(), false);
    query.push(") AS e(seq, kind, contract_seq, root_id)), ");
    // Every part's rows, counted: the clock's lock reads `done`, so every
    // part has run (and waited for any lock it met) before the clock is
    // locked, and before the guard (when there is one) is checked.
    query.push("done AS (SELECT rows FROM (SELECT count(*) AS rows FROM (");
    for part in 1..=count {
        if part > 1 {
            query.push(" UNION ALL ");
        }
        query.push(format_args!("SELECT 1 FROM w{part}"));
    }
    query.push(") every) counted");
    if let Some(guard) = guard {
        query.push(" WHERE issuance_guard(rows = ");
        query.push_bind(i64::try_from(parts.rows).unwrap_or(i64::MAX));
        query.push(", ");
        query.push_bind(guard.roots.clone());
        query.push(")");
    }
    query.push("), ");
    query.push(place_locks!());
}

/// The `WITH` parts of the one statement.
struct Parts {
    query: QueryBuilder<Postgres>,
    count: usize,
    /// The rows the parts return in all (each writing part's
    /// `RETURNING 1`, the check of parents only read its matches).
    rows: usize,
}

impl Parts {
    /// Starts the next part with `sql`, which writes `rows` rows; the
    /// caller closes it with `)`.
    fn start(&mut self, sql: &str, rows: usize) -> &mut QueryBuilder<Postgres> {
        if self.count > 0 {
            self.query.push(", ");
        }
        self.count += 1;
        self.rows += rows;
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
        rows.len(),
    );
    let ints = |f: &dyn Fn(&crate::batch::ContractRow) -> i64| -> Vec<i64> {
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
        rows.len(),
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
    let query = parts.start(
        "INSERT INTO run_labels (label_key, label_value, root_seq) SELECT * FROM UNNEST(",
        labels.len(),
    );
    column(query, labels.iter().map(|l| l.1).collect(), true);
    column(query, labels.iter().map(|l| l.2).collect(), false);
    column(query, labels.iter().map(|l| l.0).collect(), false);
    query.push(") RETURNING 1)");
}

/// The ledger of every earlier contract the batch changed (locked by
/// this transaction's read, or cached: see `Guard`; never its status: see
/// `Plan::states`), around its nine arrays (seq, reserved, spent,
/// open_children, then the row as cached — `xmin` NULL for no check —
/// see `as_cached`).
pub(super) const UPDATE_STATES: (&str, &str) = (
    "UPDATE contracts SET reserved = u.reserved, spent = u.spent, \
     open_children = u.open_children FROM UNNEST(",
    concat!(
        ") AS u(seq, reserved, spent, open_children, xmin, was_status, was_reserved, \
         was_spent, was_open) WHERE contracts.seq = u.seq AND (u.xmin IS NULL OR (",
        as_cached!(),
        "))"
    ),
);

/// The parents an optimistic plan read but does not update (it refused
/// their children), counted if still as cached (`Guard`), around their
/// six arrays (seq, then as in `as_cached`).
pub(super) const CHECK_UNWRITTEN: (&str, &str) = (
    "SELECT 1 FROM UNNEST(",
    concat!(
        ") AS u(seq, xmin, was_status, was_reserved, was_spent, was_open) \
         JOIN contracts ON contracts.seq = u.seq WHERE ",
        as_cached!()
    ),
);

/// `CHECK_UNWRITTEN`'s part, when the plan read parents it does not
/// update. Read with the statement's snapshot: a change committed after
/// it is a concurrent one (the answer is as of the snapshot, as a read
/// is; one under a parent the plan updates is met by the update).
fn check_unwritten(parts: &mut Parts, plan: &Plan, guard: Option<&Guard>) {
    let Some(guard) = guard else {
        return;
    };
    let mut seqs: Vec<i64> = guard
        .parents
        .keys()
        .copied()
        .filter(|seq| !plan.states.iter().any(|(s, _)| s == seq))
        .collect();
    if seqs.is_empty() {
        return;
    }
    seqs.sort_unstable();
    let query = parts.start(CHECK_UNWRITTEN.0, seqs.len());
    column(query, seqs.clone(), true);
    cached_columns(query, &seqs, Some(guard));
    query.push(CHECK_UNWRITTEN.1);
    query.push(")");
}

fn update_states(parts: &mut Parts, plan: &Plan, guard: Option<&Guard>) {
    let states = &plan.states;
    if states.is_empty() {
        return;
    }
    let query = parts.start(UPDATE_STATES.0, states.len());
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
    let seqs: Vec<i64> = states.iter().map(|s| s.0).collect();
    cached_columns(query, &seqs, guard);
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
        rows.len(),
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
        rows.len(),
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

/// What an issuance statement returned (its `WrittenRow`s, sorted out).
pub(super) struct Written {
    /// (position, root) of each event placed.
    pub(super) placed: Vec<(i64, Vec<u8>)>,
    /// Numbers reserved for the writer's next issuance, in order.
    pub(super) numbers: Vec<i64>,
    /// The transaction's id, every written row's `xmin`.
    pub(super) xid: Option<u32>,
}

impl Written {
    pub(super) fn from_rows(rows: Vec<WrittenRow>) -> Result<Self, sqlx::Error> {
        let mut written = Written {
            placed: Vec::new(),
            numbers: Vec::new(),
            xid: None,
        };
        for (kind, n, root) in rows {
            match (kind, root) {
                (PLACED, Some(root)) => written.placed.push((n, root)),
                (NUMBER, None) => written.numbers.push(n),
                (XID, None) => {
                    written.xid = Some(u32::try_from(n).map_err(|_| {
                        sqlx::Error::Protocol(format!("transaction id {n} out of range"))
                    })?);
                }
                (kind, _) => {
                    return Err(sqlx::Error::Protocol(format!(
                        "issuance statement row of kind {kind}"
                    )));
                }
            }
        }
        written.numbers.sort_unstable();
        Ok(written)
    }
}
