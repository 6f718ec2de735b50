//! Row decoders and column lists of the `contracts` table for the reads
//! and the writer's parent cache: the one decoder of each table.

use std::sync::Arc;

use prost::Message;

use super::source::Cells;
use super::{Cell, Dialect};
use crate::batch::Known;
use crate::{AuditFacts, ContractRecord, StoreError, backend};
use broker_domain::{
    AgentKey, Id, Ledger, Liability, ParentView, Policy, Predicate, Scope, Status,
};
use broker_wire::pb;

/// Every column of a contract any reader takes, from the view that joins
/// its envelope: the one column list of the `contracts` table (a macro so
/// `select_contracts!` can build constant queries from it). Readers decode
/// it with `StoredContract::from_row` and take the view they need.
macro_rules! contract_columns {
    () => {
        "seq, id, parent_seq, parent_id, root_seq, root_id, depth, status, delegate_key, \
         host_key, liability, intent_lineage_hash, cumulative_trust_ppm, effective_predicate, \
         deadline_ms, issued_at_ms, write_scope, max_depth, min_cumulative_trust_ppm, \
         max_children, retry_headroom, require_host, budget, reserved, spent, open_children, \
         verdict, has_report, downgrades, claim, observations, stale_judgments, observed_units, metered, \
         metered_uncharged, envelope"
    };
}

pub(crate) const CONTRACT_COLUMNS: &str = contract_columns!();

/// `SELECT` of every contract column from the view with its envelope,
/// then `$where` (a literal: nothing client-supplied is interpolated).
macro_rules! select_contracts {
    ($where:literal) => {
        concat!(
            "SELECT ",
            $crate::sql::rows::contract_columns!(),
            " FROM contracts_with_envelope ",
            $where
        )
    };
}
pub(crate) use {contract_columns, select_contracts};

pub(crate) const SELECT_RECORD_BY_ID: &str = select_contracts!("WHERE id = $1");

pub(crate) const SELECT_CHILDREN: &str = select_contracts!(
    "WHERE parent_seq = (SELECT seq FROM contracts WHERE id = $1) AND seq > $2 ORDER BY seq LIMIT $3"
);

/// One stored contract, every column decoded once (the envelope and its
/// payload too).
#[derive(Clone, Debug)]
pub(crate) struct StoredContract {
    pub(crate) seq: i64,
    pub(crate) id: Id,
    pub(crate) parent_seq: Option<i64>,
    pub(crate) parent_id: Option<Id>,
    pub(crate) root_seq: i64,
    pub(crate) root_id: Id,
    pub(crate) depth: u32,
    pub(crate) status: Status,
    pub(crate) ledger: Ledger,
    pub(crate) delegate_key: AgentKey,
    pub(crate) host_key: Option<AgentKey>,
    pub(crate) liability: Liability,
    pub(crate) intent_lineage_hash: [u8; 32],
    pub(crate) cumulative_trust_ppm: u32,
    pub(crate) effective_predicate: String,
    pub(crate) deadline_ms: i64,
    pub(crate) issued_at_ms: i64,
    pub(crate) write_scope: Scope,
    pub(crate) policy: Policy,
    /// Wire value of the verdict (0 before completion).
    pub(crate) verdict: i32,
    pub(crate) has_report: Option<bool>,
    pub(crate) downgrades: u32,
    pub(crate) claim: String,
    pub(crate) observations: i64,
    pub(crate) stale_judgments: i64,
    pub(crate) observed_units: i64,
    pub(crate) metered: bool,
    /// Metered units recorded but not charged (see `metering_charge`).
    pub(crate) metered_uncharged: i64,
    pub(crate) envelope: pb::Sealed,
    pub(crate) contract: pb::Contract,
}

impl StoredContract {
    /// The one decoder of a `CONTRACT_COLUMNS` row of a `Dialect`.
    pub(crate) fn from_row<D: Dialect>(row: &D::Row) -> Result<Self, StoreError> {
        Self::from_cells(row)
    }

    /// The one decoder of a `CONTRACT_COLUMNS` row, whoever read it.
    pub(crate) fn from_cells<R: Cells>(row: &R) -> Result<Self, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("contract row: {what}"));
        let int =
            |column: &str| -> Result<i64, StoreError> { row.cell_of(column).map_err(backend) };
        let small = |column: &str| -> Result<u32, StoreError> {
            u32::try_from(int(column)?).map_err(|_| corrupt(column))
        };
        let key = |column: &str| -> Result<Option<[u8; 32]>, StoreError> {
            let bytes: Option<Vec<u8>> = row.cell_of(column).map_err(backend)?;
            bytes
                .map(|b| b.try_into().map_err(|_| corrupt(column)))
                .transpose()
        };
        let required = |column: &str| key(column)?.ok_or_else(|| corrupt(column));
        let envelope = envelope_of(row, "envelope")?;
        let contract =
            pb::Contract::decode(envelope.payload.as_slice()).map_err(|_| corrupt("payload"))?;
        let scope: String = row.cell_of("write_scope").map_err(backend)?;
        let has_report: Option<i64> = row.cell_of("has_report").map_err(backend)?;
        Ok(Self {
            seq: int("seq")?,
            id: required("id")?,
            parent_seq: row.cell_of("parent_seq").map_err(backend)?,
            parent_id: key("parent_id")?,
            root_seq: int("root_seq")?,
            root_id: required("root_id")?,
            depth: small("depth")?,
            status: status_from(int("status")?)?,
            ledger: ledger_of(row)?,
            delegate_key: required("delegate_key")?,
            host_key: key("host_key")?,
            liability: i32::try_from(int("liability")?)
                .ok()
                .and_then(Liability::from_i32)
                .ok_or_else(|| corrupt("liability"))?,
            intent_lineage_hash: required("intent_lineage_hash")?,
            cumulative_trust_ppm: small("cumulative_trust_ppm")?,
            effective_predicate: row.cell_of("effective_predicate").map_err(backend)?,
            deadline_ms: int("deadline_ms")?,
            issued_at_ms: int("issued_at_ms")?,
            write_scope: Scope::from_trusted(
                serde_json::from_str(&scope).map_err(|_| corrupt("write_scope"))?,
            ),
            policy: Policy {
                max_depth: small("max_depth")?,
                min_cumulative_trust_ppm: small("min_cumulative_trust_ppm")?,
                max_children: small("max_children")?,
                retry_headroom: int("retry_headroom")? != 0,
                require_host: int("require_host")? != 0,
            },
            verdict: i32::try_from(int("verdict")?).map_err(|_| corrupt("verdict"))?,
            has_report: has_report.map(|h| h != 0),
            downgrades: u32::try_from(int("downgrades")?).unwrap_or(u32::MAX),
            claim: row.cell_of("claim").map_err(backend)?,
            observations: int("observations")?,
            stale_judgments: int("stale_judgments")?,
            observed_units: int("observed_units")?,
            metered: int("metered")? != 0,
            metered_uncharged: int("metered_uncharged")?,
            envelope,
            contract,
        })
    }

    /// The contract as reads return it, in the tree of tenant `tenant`.
    pub(crate) fn record(self, tenant: String) -> ContractRecord {
        ContractRecord {
            tenant,
            id: self.id,
            parent_id: self.parent_id,
            root_id: self.root_id,
            envelope: self.envelope,
            effective_predicate: self.effective_predicate,
            status: self.status,
            ledger: self.ledger,
            host_key: self.host_key,
            seq: self.seq,
        }
    }

    /// The contract as the writer's parent cache holds it.
    pub(crate) fn known(self) -> (Id, Known) {
        let view = ParentView {
            ending: false,
            status: self.status,
            delegate_key: self.delegate_key,
            depth: self.depth,
            intent_lineage_hash: self.intent_lineage_hash,
            cumulative_trust_ppm: self.cumulative_trust_ppm,
            liability: self.liability,
            effective_predicate: Predicate::from_trusted(self.effective_predicate),
            deadline_ms: self.deadline_ms,
            write_scope: self.write_scope,
            policy: self.policy,
            ledger: self.ledger,
        };
        (
            self.id,
            Known {
                seq: self.seq,
                view,
                root_id: self.root_id,
                root_seq: self.root_seq,
                contract: Arc::new(self.contract),
                version: None,
            },
        )
    }

    /// The stored facts its audit is derived from (observations are
    /// added by the caller).
    pub(crate) fn audit_facts(&self) -> AuditFacts {
        AuditFacts {
            id: self.id,
            depth: self.depth,
            task: self.contract.task.clone(),
            write_scope: self.write_scope.prefixes().to_vec(),
            completed: self.status == Status::Completed,
            has_report: self.has_report,
            downgrades: self.downgrades,
            verdict: self.verdict,
            claim: self.claim.clone(),
            observations: Vec::new(),
            delegate_identity: self.contract.delegate_identity.clone(),
        }
    }
}

pub(crate) fn id_column<D: Dialect>(row: &D::Row, column: &str) -> Result<Id, StoreError> {
    key_cell::<D>(row, column).map_err(backend)
}

/// A 32-byte key column (an id or a public key); another length is
/// corrupt data.
pub(crate) fn key_cell<D: Dialect>(row: &D::Row, column: &str) -> Result<[u8; 32], sqlx::Error> {
    key_of(row, column)
}

/// `key_cell`, whoever read the row.
pub(crate) fn key_of<R: Cells>(row: &R, column: &str) -> Result<[u8; 32], sqlx::Error> {
    let bytes: Vec<u8> = row.cell_of(column)?;
    bytes
        .try_into()
        .map_err(|_| sqlx::Error::Protocol(format!("{column} is not 32 bytes")))
}

pub(crate) fn decode_envelope<D: Dialect>(
    row: &D::Row,
    column: &str,
) -> Result<pb::Sealed, StoreError> {
    envelope_of(row, column)
}

/// `decode_envelope`, whoever read the row.
fn envelope_of<R: Cells>(row: &R, column: &str) -> Result<pb::Sealed, StoreError> {
    let bytes: Vec<u8> = row.cell_of(column).map_err(backend)?;
    pb::Sealed::decode(bytes.as_slice()).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

pub(crate) fn status_from(value: i64) -> Result<Status, StoreError> {
    i32::try_from(value)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {value}")))
}

/// The ledger columns of a contract row.
fn ledger_of<R: Cells>(row: &R) -> Result<Ledger, StoreError> {
    let open_children: i64 = row.cell_of("open_children").map_err(backend)?;
    Ok(Ledger {
        budget: row.cell_of("budget").map_err(backend)?,
        reserved: row.cell_of("reserved").map_err(backend)?,
        spent: row.cell_of("spent").map_err(backend)?,
        open_children: u32::try_from(open_children)
            .map_err(|_| StoreError::Corrupt(format!("open_children {open_children}")))?,
    })
}

/// One row of the `observations` table as every reader takes it:
/// (ObservationKind wire value, path). The one decoder of that table.
pub(crate) fn observation_from_row<D: Dialect>(row: &D::Row) -> Result<(i32, String), StoreError> {
    let kind: i64 = row.cell("kind").map_err(backend)?;
    let kind = i32::try_from(kind).map_err(|_| StoreError::Corrupt("observation kind".into()))?;
    Ok((kind, row.cell("path").map_err(backend)?))
}
