//! Audit queries: the stored facts of contracts and runs, read within a
//! row and byte budget.

use std::collections::HashMap;

use prost::Message;
use sqlx::QueryBuilder;

use super::rows::{
    StoredContract, decode_envelope, id_column, key_cell, observation_from_row, select_contracts,
};
use super::{Backend, Cell, Dialect, PushArg, QueryExt};
use crate::{AuditFacts, RunFacts, StoreError, TreeMutations, backend};
use broker_domain::{AgentKey, Id};
use broker_wire::pb;

pub(crate) const AUDIT_SELECT_BY_ID: &str = select_contracts!("WHERE id = $1");

/// A root's envelope (`$1` its seq; `$2` the budget's LIMIT).
const ROOT_ENVELOPE: &str = "SELECT envelope FROM contracts_with_envelope WHERE seq = $1 LIMIT $2";

pub(crate) const AUDIT_SELECT_TREE: &str =
    select_contracts!("WHERE root_seq = $1 AND parent_seq IS NOT NULL ORDER BY seq LIMIT $2");

/// What is left of one audit read's budget, in rows and in bytes.
pub(crate) struct AuditRows {
    pub(crate) left: i64,
    pub(crate) bytes_left: usize,
}

impl AuditRows {
    pub(crate) fn new(rows: i64, bytes: usize) -> Self {
        Self {
            left: rows,
            bytes_left: bytes,
        }
    }

    /// A LIMIT one past the budget, so going over is seen, not hidden.
    pub(crate) fn query_limit(&self) -> i64 {
        self.left.saturating_add(1)
    }

    /// Runs `query` with this budget's LIMIT bound as its last parameter,
    /// pulling rows one at a time and charging each its row and the bytes
    /// of its large columns (`envelope`, `path`): the read stops as soon as
    /// either budget is spent, before the rest is loaded.
    pub(crate) async fn fetch<'q, D: Dialect>(
        &mut self,
        conn: &mut D::Connection,
        query: sqlx::query::Query<'q, D, D::Arguments>,
    ) -> Result<Vec<D::Row>, StoreError> {
        use tokio_stream::StreamExt;
        let mut stream = query.arg(self.query_limit()).rows(&mut *conn);
        let mut rows = Vec::new();
        while let Some(row) = stream.next().await {
            let row = row.map_err(backend)?;
            self.take(1, D::large_columns_len(&row))?;
            rows.push(row);
        }
        Ok(rows)
    }

    pub(crate) fn take(&mut self, rows: usize, bytes: usize) -> Result<(), StoreError> {
        self.left -= i64::try_from(rows).unwrap_or(i64::MAX);
        if self.left < 0 {
            return Err(StoreError::Overloaded("MAX_AUDIT_ROWS"));
        }
        self.bytes_left = self
            .bytes_left
            .checked_sub(bytes)
            .ok_or(StoreError::Overloaded("MAX_AUDIT_BYTES"))?;
        Ok(())
    }
}

/// A contract's audit facts with its seq and its root's seq.
pub(crate) fn audit_row<D: Dialect>(row: &D::Row) -> Result<(AuditFacts, i64, i64), StoreError> {
    let row = StoredContract::from_row::<D>(row)?;
    Ok((row.audit_facts(), row.seq, row.root_seq))
}

pub(crate) async fn observations_of<D: Dialect>(
    conn: &mut D::Connection,
    seq: i64,
) -> Result<Vec<(i32, String)>, StoreError> {
    let rows = sqlx::query::<D>(
        "SELECT kind, path FROM observations WHERE contract_seq = $1 ORDER BY seq",
    )
    .arg(seq)
    .all(&mut *conn)
    .await
    .map_err(backend)?;
    rows.iter().map(observation_from_row::<D>).collect()
}

/// Every observation of a tree's contracts as (contract seq, kind, path),
/// in recording order.
pub(crate) async fn tree_observations<D: Dialect>(
    conn: &mut D::Connection,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(i64, i32, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query::<D>(
                "SELECT o.contract_seq, o.kind, o.path FROM observations o \
                 JOIN contracts c ON c.seq = o.contract_seq WHERE c.root_seq = $1 ORDER BY o.seq LIMIT $2",
            )
            .arg(root_seq),
        )
        .await?;
    rows.iter()
        .map(|row| {
            let (kind, path) = observation_from_row::<D>(row)?;
            Ok((row.cell("contract_seq").map_err(backend)?, kind, path))
        })
        .collect()
}

/// Every (contract id, mutated path) of a tree.
pub(crate) async fn tree_mutations<D: Dialect>(
    conn: &mut D::Connection,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(Id, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query::<D>(
                "SELECT c.id, o.path FROM observations o JOIN contracts c ON c.seq = o.contract_seq \
                 WHERE c.root_seq = $1 AND o.kind = $2 ORDER BY o.seq LIMIT $3",
            )
            .arg(root_seq)
            .arg(pb::ObservationKind::Mutation as i64),
        )
        .await?;
    rows.iter()
        .map(|r| Ok((id_column::<D>(r, "id")?, r.cell("path").map_err(backend)?)))
        .collect()
}

/// One run's facts: its contracts with their observations, its tree's
/// mutations, its escalations and refusal codes, read within `budget`.
async fn run_facts<D: Dialect>(
    conn: &mut D::Connection,
    root: &D::Row,
    selector: &std::collections::BTreeMap<String, String>,
    budget: &mut AuditRows,
) -> Result<(RunFacts, TreeMutations), StoreError> {
    let labels_json: String = root.cell("labels").map_err(backend)?;
    let labels: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&labels_json).map_err(|_| StoreError::Corrupt("labels".into()))?;
    // The index and the root's own labels must agree.
    if !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
        return Err(StoreError::Corrupt(
            "run_labels disagrees with the root's labels".into(),
        ));
    }
    let root_seq: i64 = root.cell("seq").map_err(backend)?;
    let rows = budget
        .fetch(conn, sqlx::query::<D>(AUDIT_SELECT_TREE).arg(root_seq))
        .await?;
    let root_id = id_column::<D>(root, "id")?;
    let mut contracts = Vec::with_capacity(rows.len());
    let mut ids = HashMap::with_capacity(rows.len() + 1);
    ids.insert(root_seq, root_id);
    for row in &rows {
        let (facts, seq, _) = audit_row::<D>(row)?;
        ids.insert(seq, facts.id);
        contracts.push((seq, facts));
    }
    // One observation query per tree, not one per contract; the
    // tree's mutations (for conflicts) come from the same rows.
    let mut observed: HashMap<i64, Vec<(i32, String)>> = HashMap::new();
    let mut mutations = Vec::new();
    for (seq, kind, path) in tree_observations::<D>(conn, root_seq, budget).await? {
        if kind == pb::ObservationKind::Mutation as i32 {
            let id = ids
                .get(&seq)
                .ok_or_else(|| StoreError::Corrupt("an observation outside its tree".into()))?;
            mutations.push((*id, path.clone()));
        }
        observed.entry(seq).or_default().push((kind, path));
    }
    let contracts: Vec<AuditFacts> = contracts
        .into_iter()
        .map(|(seq, mut facts)| {
            facts.observations = observed.remove(&seq).unwrap_or_default();
            facts
        })
        .collect();
    let receipts = budget
        .fetch(
            conn,
            sqlx::query::<D>(
                "SELECT kind, envelope FROM receipts WHERE root_id = $1 AND kind IN ($2, $3) LIMIT $4",
            )
            .arg(root_id.as_slice())
            .arg(pb::ReceiptKind::Refused as i64)
            .arg(pb::ReceiptKind::Escalated as i64),
        )
        .await?;
    let (mut escalations, mut refusal_codes) = (0, Vec::new());
    for receipt in &receipts {
        let kind: i64 = receipt.cell("kind").map_err(backend)?;
        if kind == pb::ReceiptKind::Escalated as i64 {
            escalations += 1;
        } else {
            let envelope = decode_envelope::<D>(receipt, "envelope")?;
            let body = pb::Receipt::decode(envelope.payload.as_slice())
                .map_err(|_| StoreError::Corrupt("receipt payload".into()))?;
            refusal_codes.push(body.primary);
        }
    }
    let orchestrator = opener_of::<D>(conn, root, root_seq, budget).await?;
    Ok((
        RunFacts {
            root_id,
            labels,
            orchestrator,
            budget: root.cell("budget").map_err(backend)?,
            spent: root.cell("spent").map_err(backend)?,
            contracts,
            escalations,
            refusal_codes,
        },
        mutations,
    ))
}

/// Who opened a run: the workload identity its root's signed terms name,
/// else its delegate's key id. The envelope is read within the audit's
/// byte budget, as the tree's rows are.
async fn opener_of<D: Dialect>(
    conn: &mut D::Connection,
    root: &D::Row,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<String, StoreError> {
    let envelope = budget
        .fetch(conn, sqlx::query::<D>(ROOT_ENVELOPE).arg(root_seq))
        .await?;
    let identity = match envelope.first() {
        Some(row) => {
            pb::Contract::decode(decode_envelope::<D>(row, "envelope")?.payload.as_slice())
                .map_err(|_| StoreError::Corrupt("a root's contract payload".into()))?
                .delegate_identity
        }
        None => String::new(),
    };
    if identity.is_empty() {
        Ok(broker_wire::crypto::key_id(
            &key_cell::<D>(root, "delegate_key").map_err(backend)?,
        ))
    } else {
        Ok(identity)
    }
}

pub(crate) async fn audit_facts<B: Backend>(
    store: &B,
    id: Id,
) -> Result<Option<(AuditFacts, Vec<(Id, String)>)>, StoreError> {
    let sql = store.sql();
    let mut conn = sql.read().await?;
    let Some(row) = sqlx::query::<B::Db>(AUDIT_SELECT_BY_ID)
        .arg(id.as_slice())
        .optional(&mut *conn)
        .await
        .map_err(backend)?
    else {
        return Ok(None);
    };
    let (facts, seq, root_seq) = audit_row::<B::Db>(&row)?;
    let mut facts = facts;
    let mut budget = AuditRows::new(sql.max_audit_rows, sql.max_audit_bytes);
    facts.observations = observations_of::<B::Db>(&mut conn, seq).await?;
    let mutations = tree_mutations::<B::Db>(&mut conn, root_seq, &mut budget).await?;
    drop(conn);
    store.settle().await?;
    Ok(Some((facts, mutations)))
}
pub(crate) async fn runs<B: Backend>(
    store: &B,
    orchestrator: Option<AgentKey>,
    selector: &std::collections::BTreeMap<String, String>,
    limit: u32,
) -> Result<Vec<(RunFacts, TreeMutations)>, StoreError> {
    let sql = store.sql();
    let mut conn = sql.read().await?;
    // The roots carrying every selected label, through the run_labels
    // index; at most limit + 1 rows are read, whatever the store holds.
    let mut query = QueryBuilder::<B::Db>::new(
        "SELECT seq, id, labels, budget, spent, delegate_key FROM contracts ",
    );
    query.push("WHERE parent_seq IS NULL");
    if let Some(orchestrator) = orchestrator {
        query
            .push(" AND delegate_key = ")
            .push_arg(orchestrator.to_vec());
    }
    if !selector.is_empty() {
        query.push(" AND seq IN (");
        for (i, (key, value)) in selector.iter().enumerate() {
            if i > 0 {
                query.push(" INTERSECT ");
            }
            query
                .push("SELECT root_seq FROM run_labels WHERE label_key = ")
                .push_arg(key.as_str())
                .push(" AND label_value = ")
                .push_arg(value.as_str());
        }
        query.push(")");
    }
    query
        .push(" ORDER BY seq LIMIT ")
        .push_arg(i64::from(limit) + 1);
    let roots = query.build().all(&mut *conn).await.map_err(backend)?;
    if roots.len() > limit as usize {
        return Err(StoreError::Overloaded("MAX_AGGREGATE_RUNS"));
    }
    let mut runs = Vec::with_capacity(roots.len());
    let mut budget = AuditRows::new(sql.max_audit_rows, sql.max_audit_bytes);
    for root in roots {
        runs.push(run_facts::<B::Db>(&mut conn, &root, selector, &mut budget).await?);
    }
    drop(conn);
    store.settle().await?;
    Ok(runs)
}
