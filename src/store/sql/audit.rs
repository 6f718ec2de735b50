//! Audit queries: the stored facts of contracts and runs, read within a
//! row and byte budget.

use super::*;

pub(super) const AUDIT_SELECT_BY_ID: &str = select_contracts!("WHERE id = $1");

pub(super) const AUDIT_SELECT_TREE: &str =
    select_contracts!("WHERE root_seq = $1 AND parent_seq IS NOT NULL ORDER BY seq LIMIT $2");

/// Most rows (contracts, observations, refusals and escalations) one
/// audit read loads: a tree has no size limit, and AggregateAudits reads
/// up to MAX_AGGREGATE_RUNS of them (rows are typically ~100 bytes to a
/// few KiB).
pub const MAX_AUDIT_ROWS: i64 = 1_000_000;

/// Most bytes of envelopes and observed paths one audit read loads: with
/// `MAX_AUDIT_ROWS` alone, a million rows of 1 KiB paths were a gigabyte
/// (16 audits at once took 1.8 GB).
pub const MAX_AUDIT_BYTES: usize = 128 * 1024 * 1024;

/// What is left of one audit read's budget, in rows and in bytes.
pub(super) struct AuditRows {
    pub(super) left: i64,
    pub(super) bytes_left: usize,
}

impl AuditRows {
    pub(super) fn new(rows: i64, bytes: usize) -> Self {
        Self {
            left: rows,
            bytes_left: bytes,
        }
    }

    /// A LIMIT one past the budget, so going over is seen, not hidden.
    pub(super) fn query_limit(&self) -> i64 {
        self.left.saturating_add(1)
    }

    /// Runs `query` with this budget's LIMIT bound as its last parameter,
    /// pulling rows one at a time and charging each its row and the bytes
    /// of its large columns (`envelope`, `path`): the read stops as soon as
    /// either budget is spent, before the rest is loaded.
    pub(super) async fn fetch<'q>(
        &mut self,
        conn: &mut DbConn,
        query: sqlx::query::Query<'q, Db, <Db as sqlx::Database>::Arguments>,
    ) -> Result<Vec<DbRow>, StoreError> {
        use tokio_stream::StreamExt;
        let mut stream = query.bind(self.query_limit()).fetch(&mut *conn);
        let mut rows = Vec::new();
        while let Some(row) = stream.next().await {
            let row = row.map_err(backend)?;
            let bytes = row
                .try_get::<&[u8], _>("envelope")
                .map_or(0, <[u8]>::len)
                .saturating_add(row.try_get::<&str, _>("path").map_or(0, str::len));
            self.take(1, bytes)?;
            rows.push(row);
        }
        Ok(rows)
    }

    pub(super) fn take(&mut self, rows: usize, bytes: usize) -> Result<(), StoreError> {
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
pub(super) fn audit_row(row: &DbRow) -> Result<(AuditFacts, i64, i64), StoreError> {
    let row = StoredContract::from_row(row)?;
    Ok((row.audit_facts(), row.seq, row.root_seq))
}

pub(super) async fn observations_of(
    conn: &mut DbConn,
    seq: i64,
) -> Result<Vec<(i32, String)>, StoreError> {
    let rows =
        sqlx::query("SELECT kind, path FROM observations WHERE contract_seq = $1 ORDER BY seq")
            .bind(seq)
            .fetch_all(&mut *conn)
            .await
            .map_err(backend)?;
    rows.iter().map(observation_from_row).collect()
}

/// Every observation of a tree's contracts as (contract seq, kind, path),
/// in recording order.
pub(super) async fn tree_observations(
    conn: &mut DbConn,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(i64, i32, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query(
                "SELECT o.contract_seq, o.kind, o.path FROM observations o \
                 JOIN contracts c ON c.seq = o.contract_seq WHERE c.root_seq = $1 ORDER BY o.seq LIMIT $2",
            )
            .bind(root_seq),
        )
        .await?;
    rows.iter()
        .map(|row| {
            let (kind, path) = observation_from_row(row)?;
            Ok((row.try_get("contract_seq").map_err(backend)?, kind, path))
        })
        .collect()
}

/// Every (contract id, mutated path) of a tree.
pub(super) async fn tree_mutations(
    conn: &mut DbConn,
    root_seq: i64,
    budget: &mut AuditRows,
) -> Result<Vec<(Id, String)>, StoreError> {
    let rows = budget
        .fetch(
            conn,
            sqlx::query(
                "SELECT c.id, o.path FROM observations o JOIN contracts c ON c.seq = o.contract_seq \
                 WHERE c.root_seq = $1 AND o.kind = $2 ORDER BY o.seq LIMIT $3",
            )
            .bind(root_seq)
            .bind(pb::ObservationKind::Mutation as i64),
        )
        .await?;
    rows.iter()
        .map(|r| Ok((id_column(r, "id")?, r.try_get("path").map_err(backend)?)))
        .collect()
}

/// One run's facts: its contracts with their observations, its tree's
/// mutations, its escalations and refusal codes, read within `budget`.
async fn run_facts(
    conn: &mut DbConn,
    root: &DbRow,
    selector: &std::collections::BTreeMap<String, String>,
    budget: &mut AuditRows,
) -> Result<(RunFacts, TreeMutations), StoreError> {
    let labels_json: String = root.try_get("labels").map_err(backend)?;
    let labels: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&labels_json).map_err(|_| StoreError::Corrupt("labels".into()))?;
    // The index and the root's own labels must agree.
    if !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
        return Err(StoreError::Corrupt(
            "run_labels disagrees with the root's labels".into(),
        ));
    }
    let root_seq: i64 = root.try_get("seq").map_err(backend)?;
    let rows = budget
        .fetch(conn, sqlx::query(AUDIT_SELECT_TREE).bind(root_seq))
        .await?;
    let root_id = id_column(root, "id")?;
    let mut contracts = Vec::with_capacity(rows.len());
    let mut ids = HashMap::with_capacity(rows.len() + 1);
    ids.insert(root_seq, root_id);
    for row in &rows {
        let (facts, seq, _) = audit_row(row)?;
        ids.insert(seq, facts.id);
        contracts.push((seq, facts));
    }
    // One observation query per tree, not one per contract; the
    // tree's mutations (for conflicts) come from the same rows.
    let mut observed: HashMap<i64, Vec<(i32, String)>> = HashMap::new();
    let mut mutations = Vec::new();
    for (seq, kind, path) in tree_observations(conn, root_seq, budget).await? {
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
            sqlx::query(
                "SELECT kind, envelope FROM receipts WHERE root_id = $1 AND kind IN ($2, $3) LIMIT $4",
            )
            .bind(root_id.as_slice())
            .bind(pb::ReceiptKind::Refused as i64)
            .bind(pb::ReceiptKind::Escalated as i64),
        )
        .await?;
    let (mut escalations, mut refusal_codes) = (0, Vec::new());
    for receipt in &receipts {
        let kind: i64 = receipt.try_get("kind").map_err(backend)?;
        if kind == pb::ReceiptKind::Escalated as i64 {
            escalations += 1;
        } else {
            let envelope = decode_envelope(receipt, "envelope")?;
            let body = pb::Receipt::decode(envelope.payload.as_slice())
                .map_err(|_| StoreError::Corrupt("receipt payload".into()))?;
            refusal_codes.push(body.primary);
        }
    }
    Ok((
        RunFacts {
            root_id,
            labels,
            budget: root.try_get("budget").map_err(backend)?,
            spent: root.try_get("spent").map_err(backend)?,
            contracts,
            escalations,
            refusal_codes,
        },
        mutations,
    ))
}

pub(super) async fn audit_facts(
    store: &BackendStore,
    id: Id,
) -> Result<Option<(AuditFacts, Vec<(Id, String)>)>, StoreError> {
    let mut conn = store.reader.acquire().await.map_err(backend)?;
    let Some(row) = sqlx::query(AUDIT_SELECT_BY_ID)
        .bind(id.as_slice())
        .fetch_optional(&mut *conn)
        .await
        .map_err(backend)?
    else {
        return Ok(None);
    };
    let (facts, seq, root_seq) = audit_row(&row)?;
    let mut facts = facts;
    let mut budget = AuditRows::new(store.max_audit_rows, store.max_audit_bytes);
    facts.observations = observations_of(&mut conn, seq).await?;
    let mutations = tree_mutations(&mut conn, root_seq, &mut budget).await?;
    drop(conn);
    store.settle().await?;
    Ok(Some((facts, mutations)))
}
pub(super) async fn runs(
    store: &BackendStore,
    orchestrator: Option<AgentKey>,
    selector: &std::collections::BTreeMap<String, String>,
    limit: u32,
) -> Result<Vec<(RunFacts, TreeMutations)>, StoreError> {
    let mut conn = store.reader.acquire().await.map_err(backend)?;
    // The roots carrying every selected label, through the run_labels
    // index; at most limit + 1 rows are read, whatever the store holds.
    let mut query =
        QueryBuilder::<Db>::new("SELECT seq, id, labels, budget, spent FROM contracts ");
    query.push("WHERE parent_seq IS NULL");
    if let Some(orchestrator) = orchestrator {
        query
            .push(" AND delegate_key = ")
            .push_bind(orchestrator.to_vec());
    }
    if !selector.is_empty() {
        query.push(" AND seq IN (");
        for (i, (key, value)) in selector.iter().enumerate() {
            if i > 0 {
                query.push(" INTERSECT ");
            }
            query
                .push("SELECT root_seq FROM run_labels WHERE label_key = ")
                .push_bind(key.as_str())
                .push(" AND label_value = ")
                .push_bind(value.as_str());
        }
        query.push(")");
    }
    query
        .push(" ORDER BY seq LIMIT ")
        .push_bind(i64::from(limit) + 1);
    let roots = query.build().fetch_all(&mut *conn).await.map_err(backend)?;
    if roots.len() > limit as usize {
        return Err(StoreError::Overloaded("MAX_AGGREGATE_RUNS"));
    }
    let mut runs = Vec::with_capacity(roots.len());
    let mut budget = AuditRows::new(store.max_audit_rows, store.max_audit_bytes);
    for root in roots {
        runs.push(run_facts(&mut conn, &root, selector, &mut budget).await?);
    }
    drop(conn);
    store.settle().await?;
    Ok(runs)
}
