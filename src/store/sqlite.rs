//! The embedded store: SQLite in WAL mode with `synchronous=FULL`.
//!
//! All writes go through one writer task that owns the only write
//! connection and commits in groups: it takes every command queued while
//! the previous commit was syncing (up to `max_batch`), applies them in
//! order inside one transaction — each seeing the effects of the ones
//! before it — and answers them all after the single fsync. Durability is
//! not traded: no answer leaves before its commit. Reads use a separate
//! pool of read-only connections (WAL readers never block the writer).
//!
//! The SQL is portable (positional `$n` parameters, no SQLite-only syntax)
//! so the PostgreSQL backend can share it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot};

use super::{Answer, ContractRecord, Outcome, Store, StoreError};
use crate::clock::Clock;
use crate::core::{self, Id, Ledger, Liability, ParentView, Policy, Predicate, Scope, Status};
use crate::pb;
use crate::stamp::{NewChild, NewRoot, RequestMeta, Stamper};

/// Outcome codes of the `requests` table.
const OUTCOME_ISSUED: i64 = 1;
const OUTCOME_REFUSED: i64 = 2;
/// Receipt kinds, as in the proto.
const RECEIPT_REFUSED: i64 = pb::ReceiptKind::Refused as i64;

/// Tunables of the embedded store.
#[derive(Clone, Debug)]
pub struct SqliteOptions {
    /// The database file; created on first start.
    pub path: PathBuf,
    /// Commands that may wait for the writer; beyond it callers get
    /// RESOURCE_EXHAUSTED instead of unbounded memory growth.
    pub queue_depth: usize,
    /// Most commands committed together.
    pub max_batch: usize,
    /// Read-only connections for queries.
    pub read_connections: u32,
}

type Reply = oneshot::Sender<Result<Answer, StoreError>>;

enum Command {
    OpenRoot(Box<NewRoot>, Reply),
    Delegate(Box<NewChild>, Reply),
}

/// SQLite-backed `Store`.
#[derive(Clone)]
pub struct SqliteStore {
    /// Queue to the single writer task; it exits when every clone is gone.
    commands: mpsc::Sender<Command>,
    /// Read-only connections for queries.
    reader: SqlitePool,
}

fn backend(e: sqlx::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) the database, migrates it and starts the
    /// writer task.
    pub async fn open(
        options: SqliteOptions,
        stamper: Arc<Stamper>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        let connect = SqliteConnectOptions::new()
            .filename(&options.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10));
        let mut writer = SqliteConnection::connect_with(&connect).await.map_err(backend)?;
        sqlx::migrate!("./migrations/sqlite")
            .run_direct(None, &mut writer, false)
            .await
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        let reader = SqlitePoolOptions::new()
            .max_connections(options.read_connections.max(1))
            .connect_with(connect.read_only(true))
            .await
            .map_err(backend)?;
        let (commands, queue) = mpsc::channel(options.queue_depth.max(1));
        let max_batch = options.max_batch.max(1);
        tokio::spawn(writer_loop(writer, queue, stamper, clock, max_batch));
        Ok(Self { commands, reader })
    }

    async fn submit(&self, make: impl FnOnce(Reply) -> Command) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.commands.try_send(make(reply)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => StoreError::Overloaded("writer queue is full"),
            mpsc::error::TrySendError::Closed(_) => StoreError::Closed,
        })?;
        answer.await.map_err(|_| StoreError::Closed)?
    }
}

impl Store for SqliteStore {
    async fn open_root(&self, root: NewRoot) -> Result<Answer, StoreError> {
        self.submit(|reply| Command::OpenRoot(Box::new(root), reply)).await
    }

    async fn delegate(&self, child: NewChild) -> Result<Answer, StoreError> {
        self.submit(|reply| Command::Delegate(Box::new(child), reply)).await
    }

    async fn contract(&self, id: Id) -> Result<Option<ContractRecord>, StoreError> {
        let row = sqlx::query(SELECT_RECORD_BY_ID)
            .bind(id.as_slice())
            .fetch_optional(&self.reader)
            .await
            .map_err(backend)?;
        row.map(|r| record_from_row(&r)).transpose()
    }

    async fn children(&self, parent: Id, after_seq: i64, limit: u32) -> Result<Vec<ContractRecord>, StoreError> {
        let rows = sqlx::query(SELECT_CHILDREN)
            .bind(parent.as_slice())
            .bind(after_seq)
            .bind(i64::from(limit))
            .fetch_all(&self.reader)
            .await
            .map_err(backend)?;
        rows.iter().map(record_from_row).collect()
    }

    async fn receipt(&self, id: Id) -> Result<Option<pb::Envelope>, StoreError> {
        let row = sqlx::query("SELECT envelope FROM receipts WHERE id = $1")
            .bind(id.as_slice())
            .fetch_optional(&self.reader)
            .await
            .map_err(backend)?;
        row.map(|r| decode_envelope(&r, "envelope")).transpose()
    }
}

const SELECT_RECORD_BY_ID: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, envelope FROM contracts WHERE id = $1";
const SELECT_CHILDREN: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, envelope FROM contracts WHERE parent_id = $1 AND seq > $2 \
     ORDER BY seq LIMIT $3";

fn id_column(row: &SqliteRow, column: &str) -> Result<Id, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{column} is not 32 bytes")))
}

fn decode_envelope(row: &SqliteRow, column: &str) -> Result<pb::Envelope, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    pb::Envelope::decode(bytes.as_slice()).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

fn status_from(value: i64) -> Result<Status, StoreError> {
    i32::try_from(value)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {value}")))
}

fn ledger_from_row(row: &SqliteRow) -> Result<Ledger, StoreError> {
    let open_children: i64 = row.try_get("open_children").map_err(backend)?;
    Ok(Ledger {
        budget: row.try_get("budget").map_err(backend)?,
        reserved: row.try_get("reserved").map_err(backend)?,
        spent: row.try_get("spent").map_err(backend)?,
        open_children: u32::try_from(open_children)
            .map_err(|_| StoreError::Corrupt(format!("open_children {open_children}")))?,
    })
}

fn record_from_row(row: &SqliteRow) -> Result<ContractRecord, StoreError> {
    let parent: Option<Vec<u8>> = row.try_get("parent_id").map_err(backend)?;
    let parent_id = parent
        .map(|p| p.try_into().map_err(|_| StoreError::Corrupt("parent_id is not 32 bytes".into())))
        .transpose()?;
    Ok(ContractRecord {
        id: id_column(row, "id")?,
        parent_id,
        root_id: id_column(row, "root_id")?,
        envelope: decode_envelope(row, "envelope")?,
        status: status_from(row.try_get("status").map_err(backend)?)?,
        ledger: ledger_from_row(row)?,
        seq: row.try_get("seq").map_err(backend)?,
    })
}

async fn writer_loop(
    mut conn: SqliteConnection,
    mut queue: mpsc::Receiver<Command>,
    stamper: Arc<Stamper>,
    clock: Arc<dyn Clock>,
    max_batch: usize,
) {
    let mut batch = Vec::with_capacity(max_batch);
    while let Some(first) = queue.recv().await {
        batch.push(first);
        while batch.len() < max_batch {
            match queue.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let answers = apply_batch(&mut conn, &batch, &stamper, clock.as_ref()).await;
        match answers {
            Ok(answers) => {
                for (command, answer) in batch.drain(..).zip(answers) {
                    let reply = match command {
                        Command::OpenRoot(_, r) | Command::Delegate(_, r) => r,
                    };
                    // The caller may have gone away; its work is committed
                    // and a retry with the same nonce will find it.
                    let _ = reply.send(answer);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, size = batch.len(), "batch rolled back");
                for command in batch.drain(..) {
                    let reply = match command {
                        Command::OpenRoot(_, r) | Command::Delegate(_, r) => r,
                    };
                    let _ = reply.send(Err(backend_clone(&e)));
                }
            }
        }
    }
    tracing::debug!("store writer stopped");
}

fn backend_clone(e: &sqlx::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// Applies a batch in one transaction. The outer error aborts the whole
/// batch (nothing is committed); the inner results are per command.
async fn apply_batch(
    conn: &mut SqliteConnection,
    batch: &[Command],
    stamper: &Stamper,
    clock: &dyn Clock,
) -> Result<Vec<Result<Answer, StoreError>>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let mut answers = Vec::with_capacity(batch.len());
    for command in batch {
        let answer = match command {
            Command::OpenRoot(root, _) => apply_root(&mut *tx, root, stamper, clock.now_ms()).await?,
            Command::Delegate(child, _) => apply_child(&mut *tx, child, stamper, clock.now_ms()).await?,
        };
        answers.push(answer);
    }
    tx.commit().await?;
    Ok(answers)
}

/// Looks up an earlier request with the same agent and nonce: its stored
/// answer when the body matches, `NonceReused` when it does not.
async fn replay(conn: &mut SqliteConnection, request: &RequestMeta) -> Result<Option<Result<Answer, StoreError>>, sqlx::Error> {
    let Some(row) = sqlx::query("SELECT body_digest, outcome, ref_id FROM requests WHERE agent_key = $1 AND nonce = $2")
        .bind(request.agent.as_slice())
        .bind(request.nonce.as_slice())
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    let digest: Vec<u8> = row.try_get("body_digest")?;
    if digest != request.digest {
        return Ok(Some(Err(StoreError::NonceReused)));
    }
    let outcome: i64 = row.try_get("outcome")?;
    let ref_id: Vec<u8> = row.try_get("ref_id")?;
    let row = sqlx::query(if outcome == OUTCOME_ISSUED {
        "SELECT envelope FROM contracts WHERE id = $1"
    } else {
        "SELECT envelope FROM receipts WHERE id = $1"
    })
    .bind(ref_id.as_slice())
    .fetch_one(&mut *conn)
    .await?;
    let answer = (|| {
        let envelope = decode_envelope(&row, "envelope")?;
        let id: Id = ref_id
            .try_into()
            .map_err(|_| StoreError::Corrupt("requests.ref_id is not 32 bytes".into()))?;
        let outcome = if outcome == OUTCOME_ISSUED {
            Outcome::Issued { id, envelope }
        } else {
            Outcome::Refused { receipt_id: id, envelope }
        };
        Ok(Answer { outcome, replayed: true })
    })();
    Ok(Some(answer))
}

async fn record_request(
    conn: &mut SqliteConnection,
    request: &RequestMeta,
    outcome: i64,
    ref_id: &Id,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO requests (agent_key, nonce, body_digest, outcome, ref_id, at_ms) VALUES ($1, $2, $3, $4, $5, $6)")
        .bind(request.agent.as_slice())
        .bind(request.nonce.as_slice())
        .bind(request.digest.as_slice())
        .bind(outcome)
        .bind(ref_id.as_slice())
        .bind(now_ms)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Every column of a contract row, in insertion order.
struct ContractRow<'a> {
    id: &'a Id,
    parent_id: Option<&'a Id>,
    root_id: &'a Id,
    depth: u32,
    delegate_key: &'a [u8; 32],
    liability: Liability,
    intent_lineage_hash: &'a [u8],
    cumulative_trust_ppm: u32,
    effective_predicate: &'a str,
    deadline_ms: i64,
    write_scope: &'a Scope,
    policy: &'a Policy,
    budget: i64,
    envelope: &'a pb::Envelope,
    issued_at_ms: i64,
}

async fn insert_contract(conn: &mut SqliteConnection, row: ContractRow<'_>) -> Result<(), sqlx::Error> {
    let scope = serde_json::to_string(row.write_scope.prefixes()).unwrap_or_else(|_| "[]".into());
    sqlx::query(
        "INSERT INTO contracts (id, parent_id, root_id, depth, status, delegate_key, liability, \
         intent_lineage_hash, cumulative_trust_ppm, effective_predicate, deadline_ms, write_scope, \
         max_depth, min_cumulative_trust_ppm, max_children, retry_headroom, budget, reserved, spent, \
         open_children, envelope, issued_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, 0, 0, 0, $18, $19)",
    )
    .bind(row.id.as_slice())
    .bind(row.parent_id.map(|p| p.as_slice()))
    .bind(row.root_id.as_slice())
    .bind(i64::from(row.depth))
    .bind(i64::from(Status::Open.as_i32()))
    .bind(row.delegate_key.as_slice())
    .bind(i64::from(row.liability.as_i32()))
    .bind(row.intent_lineage_hash)
    .bind(i64::from(row.cumulative_trust_ppm))
    .bind(row.effective_predicate)
    .bind(row.deadline_ms)
    .bind(scope)
    .bind(i64::from(row.policy.max_depth))
    .bind(i64::from(row.policy.min_cumulative_trust_ppm))
    .bind(i64::from(row.policy.max_children))
    .bind(i64::from(row.policy.retry_headroom))
    .bind(row.budget)
    .bind(row.envelope.encode_to_vec())
    .bind(row.issued_at_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn apply_root(
    conn: &mut SqliteConnection,
    root: &NewRoot,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Result<Answer, StoreError>, sqlx::Error> {
    if let Some(answer) = replay(conn, &root.request).await? {
        return Ok(answer);
    }
    let stamped = stamper.root(root, now_ms);
    let lineage = crate::crypto::sha256(root.intent.as_bytes());
    let effective = Predicate::conjoin(&Predicate::default(), &root.predicate).unwrap_or_default();
    insert_contract(
        conn,
        ContractRow {
            id: &stamped.id,
            parent_id: None,
            root_id: &stamped.id,
            depth: 0,
            delegate_key: &root.request.agent,
            liability: Liability::Delegate,
            intent_lineage_hash: &lineage,
            cumulative_trust_ppm: core::limits::PPM_ONE,
            effective_predicate: effective.as_str(),
            deadline_ms: root.deadline_ms,
            write_scope: &root.write_scope,
            policy: &root.policy,
            budget: root.budget,
            envelope: &stamped.envelope,
            issued_at_ms: now_ms,
        },
    )
    .await?;
    record_request(conn, &root.request, OUTCOME_ISSUED, &stamped.id, now_ms).await?;
    Ok(Ok(Answer {
        outcome: Outcome::Issued {
            id: stamped.id,
            envelope: stamped.envelope,
        },
        replayed: false,
    }))
}

/// The parent as the invariant check needs it, plus what stamping needs.
struct LoadedParent {
    view: ParentView,
    root_id: Id,
    contract: pb::Contract,
}

async fn load_parent(conn: &mut SqliteConnection, id: &Id) -> Result<Option<Result<LoadedParent, StoreError>>, sqlx::Error> {
    let Some(row) = sqlx::query(
        "SELECT root_id, depth, status, delegate_key, liability, intent_lineage_hash, \
         cumulative_trust_ppm, effective_predicate, deadline_ms, write_scope, max_depth, \
         min_cumulative_trust_ppm, max_children, retry_headroom, budget, reserved, spent, \
         open_children, envelope FROM contracts WHERE id = $1",
    )
    .bind(id.as_slice())
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    Ok(Some(parent_from_row(&row)))
}

fn parent_from_row(row: &SqliteRow) -> Result<LoadedParent, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(what.to_owned());
    let get_u32 = |column: &str| -> Result<u32, StoreError> {
        let v: i64 = row.try_get(column).map_err(backend)?;
        u32::try_from(v).map_err(|_| corrupt(column))
    };
    let scope_json: String = row.try_get("write_scope").map_err(backend)?;
    let prefixes: Vec<String> = serde_json::from_str(&scope_json).map_err(|_| corrupt("write_scope"))?;
    let liability: i64 = row.try_get("liability").map_err(backend)?;
    let envelope = decode_envelope(row, "envelope")?;
    let contract = pb::Contract::decode(envelope.payload.as_slice()).map_err(|_| corrupt("contract payload"))?;
    let retry_headroom: i64 = row.try_get("retry_headroom").map_err(backend)?;
    Ok(LoadedParent {
        view: ParentView {
            status: status_from(row.try_get("status").map_err(backend)?)?,
            delegate_key: id_column(row, "delegate_key")?,
            depth: get_u32("depth")?,
            intent_lineage_hash: id_column(row, "intent_lineage_hash")?,
            cumulative_trust_ppm: get_u32("cumulative_trust_ppm")?,
            liability: i32::try_from(liability)
                .ok()
                .and_then(Liability::from_i32)
                .ok_or_else(|| corrupt("liability"))?,
            effective_predicate: Predicate::from_trusted(row.try_get("effective_predicate").map_err(backend)?),
            deadline_ms: row.try_get("deadline_ms").map_err(backend)?,
            write_scope: Scope::from_trusted(prefixes),
            policy: Policy {
                max_depth: get_u32("max_depth")?,
                min_cumulative_trust_ppm: get_u32("min_cumulative_trust_ppm")?,
                max_children: get_u32("max_children")?,
                retry_headroom: retry_headroom != 0,
            },
            ledger: ledger_from_row(row)?,
        },
        root_id: id_column(row, "root_id")?,
        contract,
    })
}

async fn apply_child(
    conn: &mut SqliteConnection,
    child: &NewChild,
    stamper: &Stamper,
    now_ms: i64,
) -> Result<Result<Answer, StoreError>, sqlx::Error> {
    if let Some(answer) = replay(conn, &child.request).await? {
        return Ok(answer);
    }
    let parent = match load_parent(conn, &child.parent_id).await? {
        None => {
            return Ok(Err(StoreError::NotFound {
                what: "parent contract",
                id: hex::encode(child.parent_id),
            }));
        }
        Some(Err(e)) => return Ok(Err(e)),
        Some(Ok(parent)) => parent,
    };
    match core::check_delegation(&parent.view, &child.ask, now_ms) {
        Ok(terms) => {
            let mut ledger = parent.view.ledger;
            if let Err(e) = ledger.reserve(child.ask.budget) {
                // The check guarantees the reservation; reaching this is a bug.
                return Ok(Err(StoreError::Corrupt(format!("ledger after a passed check: {e}"))));
            }
            let stamped = stamper.child(&parent.contract, &parent.root_id, child, &terms, now_ms);
            insert_contract(
                conn,
                ContractRow {
                    id: &stamped.id,
                    parent_id: Some(&child.parent_id),
                    root_id: &parent.root_id,
                    depth: terms.depth,
                    delegate_key: &child.delegate_key,
                    liability: child.ask.liability,
                    intent_lineage_hash: &parent.view.intent_lineage_hash,
                    cumulative_trust_ppm: terms.cumulative_trust_ppm,
                    effective_predicate: terms.effective_predicate.as_str(),
                    deadline_ms: terms.deadline_ms,
                    write_scope: &child.ask.write_scope,
                    policy: &parent.view.policy,
                    budget: child.ask.budget,
                    envelope: &stamped.envelope,
                    issued_at_ms: now_ms,
                },
            )
            .await?;
            sqlx::query("UPDATE contracts SET reserved = $1, open_children = $2 WHERE id = $3")
                .bind(ledger.reserved)
                .bind(i64::from(ledger.open_children))
                .bind(child.parent_id.as_slice())
                .execute(&mut *conn)
                .await?;
            record_request(conn, &child.request, OUTCOME_ISSUED, &stamped.id, now_ms).await?;
            Ok(Ok(Answer {
                outcome: Outcome::Issued {
                    id: stamped.id,
                    envelope: stamped.envelope,
                },
                replayed: false,
            }))
        }
        Err(refusal) => {
            let stamped = stamper.refusal(&child.parent_id, &parent.root_id, &child.request, &refusal, now_ms);
            sqlx::query("INSERT INTO receipts (id, kind, contract_id, root_id, envelope, at_ms) VALUES ($1, $2, $3, $4, $5, $6)")
                .bind(stamped.id.as_slice())
                .bind(RECEIPT_REFUSED)
                .bind(child.parent_id.as_slice())
                .bind(parent.root_id.as_slice())
                .bind(stamped.envelope.encode_to_vec())
                .bind(now_ms)
                .execute(&mut *conn)
                .await?;
            record_request(conn, &child.request, OUTCOME_REFUSED, &stamped.id, now_ms).await?;
            Ok(Ok(Answer {
                outcome: Outcome::Refused {
                    receipt_id: stamped.id,
                    envelope: stamped.envelope,
                },
                replayed: false,
            }))
        }
    }
}
