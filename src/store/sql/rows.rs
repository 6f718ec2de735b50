//! Row decoders and column lists of the `contracts` table for the reads
//! and the writer's parent cache.

use super::*;

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

pub(super) const CONTRACT_COLUMNS: &str = contract_columns!();

/// `SELECT` of every contract column from the view with its envelope,
/// then `$where` (a literal: nothing client-supplied is interpolated).
macro_rules! select_contracts {
    ($where:literal) => {
        concat!(
            "SELECT ",
            contract_columns!(),
            " FROM contracts_with_envelope ",
            $where
        )
    };
}
pub(super) use {contract_columns, select_contracts};

pub(super) const SELECT_RECORD_BY_ID: &str = select_contracts!("WHERE id = $1");

pub(super) const SELECT_CHILDREN: &str = select_contracts!(
    "WHERE parent_seq = (SELECT seq FROM contracts WHERE id = $1) AND seq > $2 ORDER BY seq LIMIT $3"
);

/// One stored contract, every column decoded once (the envelope and its
/// payload too).
#[derive(Clone, Debug)]
pub(super) struct StoredContract {
    pub(super) seq: i64,
    pub(super) id: Id,
    pub(super) parent_seq: Option<i64>,
    pub(super) parent_id: Option<Id>,
    pub(super) root_seq: i64,
    pub(super) root_id: Id,
    pub(super) depth: u32,
    pub(super) status: Status,
    pub(super) ledger: Ledger,
    pub(super) delegate_key: AgentKey,
    pub(super) host_key: Option<AgentKey>,
    pub(super) liability: Liability,
    pub(super) intent_lineage_hash: [u8; 32],
    pub(super) cumulative_trust_ppm: u32,
    pub(super) effective_predicate: String,
    pub(super) deadline_ms: i64,
    pub(super) issued_at_ms: i64,
    pub(super) write_scope: Scope,
    pub(super) policy: Policy,
    /// Wire value of the verdict (0 before completion).
    pub(super) verdict: i32,
    pub(super) has_report: Option<bool>,
    pub(super) downgrades: u32,
    pub(super) claim: String,
    pub(super) observations: i64,
    pub(super) stale_judgments: i64,
    pub(super) observed_units: i64,
    pub(super) metered: bool,
    /// Metered units recorded but not charged (see `metering_charge`).
    pub(super) metered_uncharged: i64,
    pub(super) envelope: pb::Sealed,
    pub(super) contract: pb::Contract,
}

impl StoredContract {
    /// The one decoder of a `CONTRACT_COLUMNS` row.
    pub(super) fn from_row(row: &DbRow) -> Result<Self, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("contract row: {what}"));
        let int =
            |column: &str| -> Result<i64, StoreError> { row.try_get(column).map_err(backend) };
        let small = |column: &str| -> Result<u32, StoreError> {
            u32::try_from(int(column)?).map_err(|_| corrupt(column))
        };
        let key = |column: &str| -> Result<Option<[u8; 32]>, StoreError> {
            let bytes: Option<Vec<u8>> = row.try_get(column).map_err(backend)?;
            bytes
                .map(|b| b.try_into().map_err(|_| corrupt(column)))
                .transpose()
        };
        let required = |column: &str| key(column)?.ok_or_else(|| corrupt(column));
        let envelope = decode_envelope(row, "envelope")?;
        let contract =
            pb::Contract::decode(envelope.payload.as_slice()).map_err(|_| corrupt("payload"))?;
        let scope: String = row.try_get("write_scope").map_err(backend)?;
        let has_report: Option<i64> = row.try_get("has_report").map_err(backend)?;
        Ok(Self {
            seq: int("seq")?,
            id: required("id")?,
            parent_seq: row.try_get("parent_seq").map_err(backend)?,
            parent_id: key("parent_id")?,
            root_seq: int("root_seq")?,
            root_id: required("root_id")?,
            depth: small("depth")?,
            status: status_from(int("status")?)?,
            ledger: ledger_from_row(row)?,
            delegate_key: required("delegate_key")?,
            host_key: key("host_key")?,
            liability: i32::try_from(int("liability")?)
                .ok()
                .and_then(Liability::from_i32)
                .ok_or_else(|| corrupt("liability"))?,
            intent_lineage_hash: required("intent_lineage_hash")?,
            cumulative_trust_ppm: small("cumulative_trust_ppm")?,
            effective_predicate: row.try_get("effective_predicate").map_err(backend)?,
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
            claim: row.try_get("claim").map_err(backend)?,
            observations: int("observations")?,
            stale_judgments: int("stale_judgments")?,
            observed_units: int("observed_units")?,
            metered: int("metered")? != 0,
            metered_uncharged: int("metered_uncharged")?,
            envelope,
            contract,
        })
    }

    /// The contract as reads return it.
    pub(super) fn record(self) -> ContractRecord {
        ContractRecord {
            id: self.id,
            parent_id: self.parent_id,
            root_id: self.root_id,
            envelope: self.envelope,
            effective_predicate: self.effective_predicate,
            status: self.status,
            ledger: self.ledger,
            seq: self.seq,
        }
    }

    /// The contract as the writer's parent cache holds it.
    pub(super) fn known(self) -> (Id, Known) {
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
            },
        )
    }

    /// The stored facts its audit is derived from (observations are
    /// added by the caller).
    pub(super) fn audit_facts(&self) -> AuditFacts {
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
        }
    }
}

pub(super) fn id_column(row: &DbRow, column: &str) -> Result<Id, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{column} is not 32 bytes")))
}

pub(super) fn decode_envelope(row: &DbRow, column: &str) -> Result<pb::Sealed, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    pb::Sealed::decode(bytes.as_slice()).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

pub(super) fn status_from(value: i64) -> Result<Status, StoreError> {
    i32::try_from(value)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {value}")))
}

pub(super) fn ledger_from_row(row: &DbRow) -> Result<Ledger, StoreError> {
    let open_children: i64 = row.try_get("open_children").map_err(backend)?;
    Ok(Ledger {
        budget: row.try_get("budget").map_err(backend)?,
        reserved: row.try_get("reserved").map_err(backend)?,
        spent: row.try_get("spent").map_err(backend)?,
        open_children: u32::try_from(open_children)
            .map_err(|_| StoreError::Corrupt(format!("open_children {open_children}")))?,
    })
}

/// One row of the `observations` table as every reader takes it:
/// (ObservationKind wire value, path). The one decoder of that table.
pub(super) fn observation_from_row(row: &DbRow) -> Result<(i32, String), StoreError> {
    let kind: i64 = row.try_get("kind").map_err(backend)?;
    let kind = i32::try_from(kind).map_err(|_| StoreError::Corrupt("observation kind".into()))?;
    Ok((kind, row.try_get("path").map_err(backend)?))
}
