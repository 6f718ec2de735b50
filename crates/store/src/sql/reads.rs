//! Reads: contracts, children, receipts, parties,
//! replays and the writer-cache-backed parent lookup. Every read waits for
//! the durability of what it could have seen (`Durability::settle`).

use prost::Message;
use sqlx::QueryBuilder;

use super::requests::load_prior_requests;
use super::rows::{
    SELECT_CHILDREN, SELECT_RECORD_BY_ID, StoredContract, decode_envelope, id_column,
};
use super::source::Sqlx;
use super::{Backend, Cell, Dialect, PushArg, QueryExt, lock};
use crate::batch;
use crate::{Answer, ContractRecord, Event, IssuingParent, StoreError, backend};
use broker_domain::{AgentKey, Id, Predicate, Status};
use broker_wire::command::RequestMeta;
use broker_wire::pb;

/// Pushes "`agent` is a party of the tree whose root's sequence is the
/// column `root_seq`": the delegate or the host of one of its contracts
/// (index seeks). The one definition every read that asks it uses.
fn push_party<D: Dialect>(query: &mut QueryBuilder<D>, root_seq: &str, agent: &AgentKey) {
    query
        .push("(EXISTS(SELECT 1 FROM contracts d WHERE d.root_seq = ")
        .push(root_seq)
        .push(" AND d.delegate_key = ")
        .push_arg(agent.to_vec())
        .push(") OR EXISTS(SELECT 1 FROM contracts h WHERE h.root_seq = ")
        .push(root_seq)
        .push(" AND h.host_key = ")
        .push_arg(agent.to_vec())
        .push("))");
}

pub(crate) async fn is_party<B: Backend>(
    store: &B,
    contract: Id,
    agent: AgentKey,
) -> Result<Option<bool>, StoreError> {
    let mut query = QueryBuilder::<B::Db>::new("SELECT ");
    push_party(&mut query, "c.root_seq", &agent);
    query
        .push(" AS party FROM contracts c WHERE c.id = ")
        .push_arg(contract.to_vec());
    let row = query
        .build()
        .optional(&mut *store.sql().read().await?)
        .await
        .map_err(backend)?;
    // Settled: a caller made a party by a commit a crash could still undo
    // is not let read (the contract may have been read before this).
    store.settle().await?;
    row.map(|r| r.cell::<bool>("party").map_err(backend))
        .transpose()
}
pub(crate) async fn overdue<B: Backend>(
    store: &B,
    now_ms: i64,
    limit: u32,
) -> Result<Vec<Id>, StoreError> {
    let rows = sqlx::query::<B::Db>(
        "SELECT id FROM contracts WHERE status IN ($1, $2) AND deadline_ms <= $3 ORDER BY deadline_ms LIMIT $4",
    )
    .arg(i64::from(Status::Open.as_i32()))
    .arg(i64::from(Status::Accepted.as_i32()))
    .arg(now_ms)
    .arg(i64::from(limit))
    .all(&mut *store.sql().read().await?)
    .await
    .map_err(backend)?;
    store.settle().await?;
    rows.iter().map(|r| id_column::<B::Db>(r, "id")).collect()
}
pub(crate) async fn replay<B: Backend>(
    store: &B,
    request: &RequestMeta,
) -> Result<Option<Answer>, StoreError> {
    let mut conn = store.sql().read().await?;
    let key = (request.agent, request.nonce.clone());
    let mut prior =
        load_prior_requests::<B::Db, _>(&mut Sqlx::<B::Db>(&mut conn), std::slice::from_ref(&key))
            .await
            .map_err(backend)?;
    drop(conn);
    store.settle().await?;
    prior
        .remove(&key)
        .map(|p| batch::replayed(&p, request))
        .transpose()
}
pub(crate) async fn issuing_parent<B: Backend>(
    store: &B,
    parent: Id,
) -> Result<Option<IssuingParent>, StoreError> {
    // One lock for the parent and its root (the writer holds it while it
    // plans a batch: a second acquisition is a second wait).
    let cached = {
        let known = lock(&store.sql().known);
        known.get(&parent).map(|k| {
            let tenant = known.get(&k.root_id).map(|root| root.view.delegate_key);
            let parent = IssuingParent {
                delegate_key: k.view.delegate_key,
                effective_predicate: k.view.effective_predicate.clone(),
                root_id: k.root_id,
                depth: k.view.depth,
                tenant: tenant.unwrap_or(k.view.delegate_key),
            };
            (parent, k.root_seq, tenant.is_some() || k.view.depth == 0)
        })
    };
    let tenants = &store.sql().tenants;
    if let Some((mut parent, _, true)) = cached {
        parent.tenant = tenants.of(&parent.tenant);
        return Ok(Some(parent));
    }
    let cached = cached.map(|(parent, root_seq, _)| (parent, root_seq));
    let (mut found, root_seq) = match cached {
        Some(cached) => cached,
        None => {
            // Not settled: what it reads never changes once written, and it
            // is only used to refuse or to go on to the writer, which reads
            // again.
            let row = sqlx::query::<B::Db>(SELECT_RECORD_BY_ID)
                .arg(parent.as_slice())
                .optional(&mut *store.sql().read().await?)
                .await
                .map_err(backend)?;
            let Some(row) = row else {
                return Ok(None);
            };
            let c = StoredContract::from_row::<B::Db>(&row)?;
            let parent = IssuingParent {
                delegate_key: c.delegate_key,
                effective_predicate: Predicate::from_trusted(c.effective_predicate),
                root_id: c.root_id,
                depth: c.depth,
                tenant: c.delegate_key,
            };
            (parent, c.root_seq)
        }
    };
    if found.depth > 0 {
        found.tenant = tenant(store, found.root_id, root_seq).await?;
    }
    // The opener's tenant, as the operator declared it.
    found.tenant = tenants.of(&found.tenant);
    Ok(Some(found))
}

/// The key that opened a tree's root (the root's delegate), whose tenant
/// is the tree's, from the writer's cache or one read by key.
pub(crate) async fn tenant<B: Backend>(
    store: &B,
    root_id: Id,
    root_seq: i64,
) -> Result<AgentKey, StoreError> {
    if let Some(root) = lock(&store.sql().known).get(&root_id) {
        return Ok(root.view.delegate_key);
    }
    let row = sqlx::query::<B::Db>("SELECT delegate_key FROM contracts WHERE seq = $1")
        .arg(root_seq)
        .optional(&mut *store.sql().read().await?)
        .await
        .map_err(backend)?
        .ok_or_else(|| {
            StoreError::Corrupt(format!(
                "the root of tree {} is missing",
                hex::encode(root_id)
            ))
        })?;
    id_column::<B::Db>(&row, "delegate_key")
}
pub(crate) async fn issuance_trace<B: Backend>(
    store: &B,
    id: Id,
) -> Result<Option<broker_wire::command::TraceContext>, StoreError> {
    let row = sqlx::query::<B::Db>(
        "SELECT e.trace_context FROM contracts c JOIN contract_envelopes e ON e.seq = c.seq \
         WHERE c.id = $1",
    )
    .arg(id.as_slice())
    .optional(&mut *store.sql().read().await?)
    .await
    .map_err(backend)?;
    let stored: Option<Vec<u8>> = match row {
        Some(row) => row.cell("trace_context").map_err(backend)?,
        None => None,
    };
    // Written once with the contract; a wrong length is not ours.
    Ok(stored.and_then(|t| t.try_into().ok()))
}
pub(crate) async fn contract<B: Backend>(
    store: &B,
    id: Id,
) -> Result<Option<ContractRecord>, StoreError> {
    let row = sqlx::query::<B::Db>(SELECT_RECORD_BY_ID)
        .arg(id.as_slice())
        .optional(&mut *store.sql().read().await?)
        .await
        .map_err(backend)?;
    store.settle().await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let stored = StoredContract::from_row::<B::Db>(&row)?;
    Ok(named(store, vec![stored]).await?.pop())
}
pub(crate) async fn children<B: Backend>(
    store: &B,
    parent: Id,
    after_seq: i64,
    limit: u32,
    max_bytes: usize,
) -> Result<Vec<ContractRecord>, StoreError> {
    use tokio_stream::StreamExt;
    let mut conn = store.sql().read().await?;
    let mut rows = sqlx::query::<B::Db>(SELECT_CHILDREN)
        .arg(parent.as_slice())
        .arg(after_seq)
        .arg(i64::from(limit))
        .rows(&mut *conn);
    // Pulled one at a time, up to the byte budget (see `events`).
    let mut stored = Vec::new();
    let mut bytes = 0usize;
    while let Some(row) = rows.next().await {
        let contract = StoredContract::from_row::<B::Db>(&row.map_err(backend)?)?;
        bytes = bytes.saturating_add(contract.envelope.encoded_len());
        stored.push(contract);
        if bytes >= max_bytes {
            break;
        }
    }
    drop(rows);
    drop(conn);
    store.settle().await?;
    named(store, stored).await
}

/// Each stored contract as reads return it, named by its tree's tenant:
/// the opener of each tree (its root's delegate) from the contract itself
/// when it is a root, the writer's cache, or one read for all the trees
/// left. Not settled: a root's delegate never changes once written, and
/// each contract read was settled already (its root was written before
/// it).
async fn named<B: Backend>(
    store: &B,
    stored: Vec<StoredContract>,
) -> Result<Vec<ContractRecord>, StoreError> {
    use std::collections::HashMap;
    let mut openers: HashMap<i64, AgentKey> = stored
        .iter()
        .filter(|c| c.depth == 0)
        .map(|c| (c.seq, c.delegate_key))
        .collect();
    let mut missing: Vec<i64> = Vec::new();
    {
        let known = lock(&store.sql().known);
        for c in &stored {
            if openers.contains_key(&c.root_seq) {
                continue;
            }
            match known.get(&c.root_id) {
                Some(root) => {
                    openers.insert(c.root_seq, root.view.delegate_key);
                }
                None => missing.push(c.root_seq),
            }
        }
    }
    missing.sort_unstable();
    missing.dedup();
    if !missing.is_empty() {
        let mut query =
            QueryBuilder::<B::Db>::new("SELECT seq, delegate_key FROM contracts WHERE seq IN (");
        let mut list = query.separated(", ");
        for seq in &missing {
            list.push_arg(*seq);
        }
        query.push(")");
        let rows = query
            .build()
            .all(&mut *store.sql().read().await?)
            .await
            .map_err(backend)?;
        for row in &rows {
            openers.insert(
                row.cell::<i64>("seq").map_err(backend)?,
                id_column::<B::Db>(row, "delegate_key")?,
            );
        }
    }
    let tenants = &store.sql().tenants;
    stored
        .into_iter()
        .map(|c| {
            let opener = openers.get(&c.root_seq).ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "the root of tree {} is missing",
                    hex::encode(c.root_id)
                ))
            })?;
            let tenant = tenants.name_of(opener).to_owned();
            Ok(c.record(tenant))
        })
        .collect()
}
pub(crate) async fn receipt<B: Backend>(
    store: &B,
    id: Id,
) -> Result<Option<pb::Sealed>, StoreError> {
    let row = sqlx::query::<B::Db>("SELECT envelope FROM receipts WHERE id = $1")
        .arg(id.as_slice())
        .optional(&mut *store.sql().read().await?)
        .await
        .map_err(backend)?;
    store.settle().await?;
    row.map(|r| decode_envelope::<B::Db>(&r, "envelope"))
        .transpose()
}

/// Watch events from `rows` (columns `position`, `kind` — 1 a contract, 2
/// a receipt — and `envelope`), pulled one at a time until the page
/// holds `max_bytes` of envelopes (always the first one); `cursor_of`
/// turns a stored position into the client's cursor.
pub(crate) async fn collect_events<'r, D: Dialect>(
    rows: &mut (impl tokio_stream::Stream<Item = Result<D::Row, sqlx::Error>> + Unpin + 'r),
    cursor_of: impl Fn(i64) -> i64,
    max_bytes: usize,
) -> Result<Vec<Event>, StoreError> {
    use tokio_stream::StreamExt;
    let mut events = Vec::new();
    let mut bytes = 0usize;
    while let Some(row) = rows.next().await {
        let row = row.map_err(backend)?;
        let position: i64 = row.cell("position").map_err(backend)?;
        let kind: i64 = row.cell("kind").map_err(backend)?;
        let envelope = decode_envelope::<D>(&row, "envelope")?;
        bytes = bytes.saturating_add(envelope.encoded_len());
        let cursor = cursor_of(position);
        events.push(if kind == 1 {
            Event::Contract { cursor, envelope }
        } else {
            Event::Receipt { cursor, envelope }
        });
        if bytes >= max_bytes {
            break;
        }
    }
    Ok(events)
}

/// A page of `Store::roots`.
pub(crate) async fn roots<B: Backend>(
    store: &B,
    query: &crate::RootsQuery,
) -> Result<crate::ContractsPage, StoreError> {
    use tokio_stream::StreamExt;
    let mut conn = store.sql().read().await?;
    // The window: the next `scan` roots older than the cursor, newest
    // first, read in index order (the roots-only index, or run_labels for
    // the first label), each with whether the caller may see it: it
    // carries the other labels and the viewer is a party of its tree
    // (index seeks per row). Every row looked at counts against `scan`,
    // matching or not, so no call walks more than that.
    let mut labels = query.labels.iter();
    let first = labels.next();
    let mut window = QueryBuilder::<B::Db>::new("SELECT w.seq, (TRUE");
    for (key, value) in labels {
        window
            .push(" AND EXISTS(SELECT 1 FROM run_labels l WHERE l.root_seq = w.seq AND l.label_key = ")
            .push_arg(key.as_str())
            .push(" AND l.label_value = ")
            .push_arg(value.as_str())
            .push(")");
    }
    if let Some(viewer) = &query.viewer {
        window.push(" AND ");
        push_party(&mut window, "w.seq", viewer);
    }
    window.push(") AS visible FROM (");
    match first {
        None => {
            window.push("SELECT seq FROM contracts WHERE parent_seq IS NULL");
            if query.page.before_seq > 0 {
                window.push(" AND seq < ").push_arg(query.page.before_seq);
            }
            window.push(" ORDER BY seq DESC");
        }
        Some((key, value)) => {
            window
                .push("SELECT root_seq AS seq FROM run_labels WHERE label_key = ")
                .push_arg(key.as_str())
                .push(" AND label_value = ")
                .push_arg(value.as_str());
            if query.page.before_seq > 0 {
                window
                    .push(" AND root_seq < ")
                    .push_arg(query.page.before_seq);
            }
            window.push(" ORDER BY root_seq DESC");
        }
    }
    window
        // One more than the window: whether any older root remains.
        .push(" LIMIT ")
        .push_arg(i64::from(query.scan) + 1)
        .push(") w ORDER BY w.seq DESC");
    let scanned = window.build().all(&mut *conn).await.map_err(backend)?;
    let window_len = scanned.len().min(query.scan as usize);
    let mut shown = Vec::new();
    // Where the next page starts: after the last root shown when the page
    // is full, after the last root looked at when the window is; none
    // when no older root remains.
    let mut next_before = None;
    for (i, row) in scanned[..window_len].iter().enumerate() {
        let seq: i64 = row.cell("seq").map_err(backend)?;
        if row.cell::<bool>("visible").map_err(backend)? {
            shown.push(seq);
        }
        let more = i + 1 < scanned.len();
        if shown.len() == query.page.limit as usize || i + 1 == window_len {
            next_before = more.then_some(seq);
            break;
        }
    }
    let mut roots = Vec::with_capacity(shown.len());
    if !shown.is_empty() {
        let mut load = QueryBuilder::<B::Db>::new(concat!(
            "SELECT ",
            crate::sql::rows::contract_columns!(),
            " FROM contracts_with_envelope WHERE seq IN ("
        ));
        let mut list = load.separated(", ");
        for seq in &shown {
            list.push_arg(*seq);
        }
        load.push(") ORDER BY seq DESC");
        let built = load.build();
        let mut rows = built.rows(&mut *conn);
        // Pulled one at a time, up to the byte budget (as `children`).
        let mut bytes = 0usize;
        while let Some(row) = rows.next().await {
            let root = StoredContract::from_row::<B::Db>(&row.map_err(backend)?)?;
            bytes = bytes.saturating_add(root.envelope.encoded_len());
            roots.push(root);
            if bytes >= query.page.max_bytes {
                break;
            }
        }
        drop(rows);
        if roots.len() < shown.len()
            && let Some(last) = roots.last()
        {
            next_before = Some(last.seq);
        }
    }
    drop(conn);
    store.settle().await?;
    let roots = named(store, roots).await?;
    Ok(crate::ContractsPage {
        contracts: roots,
        next_before,
    })
}

/// Open contracts (OPEN, ACCEPTED) whose delegate or host is the key,
/// newest first: a walk of a partial index holding open contracts only,
/// so every row read is shown and the work is the page's.
pub(crate) async fn held<B: Backend>(
    store: &B,
    query: &crate::HeldQuery,
) -> Result<crate::ContractsPage, StoreError> {
    use tokio_stream::StreamExt;
    let column = match query.role {
        crate::HeldRole::Delegate => "delegate_key",
        crate::HeldRole::Host => "host_key",
    };
    let mut conn = store.sql().read().await?;
    // The filter repeats the partial indexes' predicate word for word, so
    // both engines use them.
    let mut page = QueryBuilder::<B::Db>::new(concat!(
        "SELECT ",
        crate::sql::rows::contract_columns!(),
        " FROM contracts_with_envelope WHERE seq IN (SELECT seq FROM contracts WHERE "
    ));
    page.push(column)
        .push(" = ")
        .push_arg(query.key.to_vec())
        .push(" AND status IN (1, 2)");
    if query.page.before_seq > 0 {
        page.push(" AND seq < ").push_arg(query.page.before_seq);
    }
    page.push(" ORDER BY seq DESC LIMIT ")
        // One more than the page: whether any older one remains.
        .push_arg(i64::from(query.page.limit) + 1)
        .push(") ORDER BY seq DESC");
    let built = page.build();
    let mut rows = built.rows(&mut *conn);
    let mut contracts = Vec::new();
    let mut bytes = 0usize;
    let mut next_before = None;
    while let Some(row) = rows.next().await {
        let contract = StoredContract::from_row::<B::Db>(&row.map_err(backend)?)?;
        if contracts.len() == query.page.limit as usize || bytes >= query.page.max_bytes {
            // A row past the page: there is more, from the last one shown.
            next_before = contracts.last().map(|c: &StoredContract| c.seq);
            break;
        }
        bytes = bytes.saturating_add(contract.envelope.encoded_len());
        contracts.push(contract);
    }
    drop(rows);
    drop(conn);
    store.settle().await?;
    let contracts = named(store, contracts).await?;
    Ok(crate::ContractsPage {
        contracts,
        next_before,
    })
}
