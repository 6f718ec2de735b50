//! Row decoders and column lists of the `contracts` table for the reads
//! and the writer's parent cache.

use super::*;

pub(super) const SELECT_RECORD_BY_ID: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, effective_predicate, envelope FROM contracts_with_envelope WHERE id = $1";

pub(super) const SELECT_CHILDREN: &str = "SELECT seq, id, parent_id, root_id, status, budget, reserved, \
     spent, open_children, effective_predicate, envelope FROM contracts_with_envelope \
     WHERE parent_seq = (SELECT seq FROM contracts WHERE id = $1) AND seq > $2 \
     ORDER BY seq LIMIT $3";

pub(super) fn id_column(row: &SqliteRow, column: &str) -> Result<Id, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{column} is not 32 bytes")))
}

pub(super) fn decode_envelope(row: &SqliteRow, column: &str) -> Result<pb::Sealed, StoreError> {
    let bytes: Vec<u8> = row.try_get(column).map_err(backend)?;
    pb::Sealed::decode(bytes.as_slice()).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

pub(super) fn status_from(value: i64) -> Result<Status, StoreError> {
    i32::try_from(value)
        .ok()
        .and_then(Status::from_i32)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {value}")))
}

pub(super) fn ledger_from_row(row: &SqliteRow) -> Result<Ledger, StoreError> {
    let open_children: i64 = row.try_get("open_children").map_err(backend)?;
    Ok(Ledger {
        budget: row.try_get("budget").map_err(backend)?,
        reserved: row.try_get("reserved").map_err(backend)?,
        spent: row.try_get("spent").map_err(backend)?,
        open_children: u32::try_from(open_children)
            .map_err(|_| StoreError::Corrupt(format!("open_children {open_children}")))?,
    })
}

pub(super) fn record_from_row(row: &SqliteRow) -> Result<ContractRecord, StoreError> {
    let parent: Option<Vec<u8>> = row.try_get("parent_id").map_err(backend)?;
    let parent_id = parent
        .map(|p| {
            p.try_into()
                .map_err(|_| StoreError::Corrupt("parent_id is not 32 bytes".into()))
        })
        .transpose()?;
    Ok(ContractRecord {
        id: id_column(row, "id")?,
        parent_id,
        root_id: id_column(row, "root_id")?,
        envelope: decode_envelope(row, "envelope")?,
        effective_predicate: row.try_get("effective_predicate").map_err(backend)?,
        status: status_from(row.try_get("status").map_err(backend)?)?,
        ledger: ledger_from_row(row)?,
        seq: row.try_get("seq").map_err(backend)?,
    })
}

pub(super) const PARENT_COLUMNS: &str = "seq, id, root_seq, root_id, depth, status, delegate_key, liability, \
     intent_lineage_hash, cumulative_trust_ppm, effective_predicate, deadline_ms, write_scope, \
     max_depth, min_cumulative_trust_ppm, max_children, retry_headroom, require_host, budget, \
     reserved, spent, \
     open_children, envelope";

pub(super) fn known_from_row(row: &SqliteRow) -> Result<(Id, Known), StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(what.to_owned());
    let get_u32 = |column: &str| -> Result<u32, StoreError> {
        let v: i64 = row.try_get(column).map_err(backend)?;
        u32::try_from(v).map_err(|_| corrupt(column))
    };
    let scope_json: String = row.try_get("write_scope").map_err(backend)?;
    let prefixes: Vec<String> =
        serde_json::from_str(&scope_json).map_err(|_| corrupt("write_scope"))?;
    let liability: i64 = row.try_get("liability").map_err(backend)?;
    let envelope = decode_envelope(row, "envelope")?;
    let contract = pb::Contract::decode(envelope.payload.as_slice())
        .map_err(|_| corrupt("contract payload"))?;
    let retry_headroom: i64 = row.try_get("retry_headroom").map_err(backend)?;
    let require_host: i64 = row.try_get("require_host").map_err(backend)?;
    let view = ParentView {
        status: status_from(row.try_get("status").map_err(backend)?)?,
        delegate_key: id_column(row, "delegate_key")?,
        depth: get_u32("depth")?,
        intent_lineage_hash: id_column(row, "intent_lineage_hash")?,
        cumulative_trust_ppm: get_u32("cumulative_trust_ppm")?,
        liability: i32::try_from(liability)
            .ok()
            .and_then(Liability::from_i32)
            .ok_or_else(|| corrupt("liability"))?,
        effective_predicate: Predicate::from_trusted(
            row.try_get("effective_predicate").map_err(backend)?,
        ),
        deadline_ms: row.try_get("deadline_ms").map_err(backend)?,
        write_scope: Scope::from_trusted(prefixes),
        policy: Policy {
            max_depth: get_u32("max_depth")?,
            min_cumulative_trust_ppm: get_u32("min_cumulative_trust_ppm")?,
            max_children: get_u32("max_children")?,
            retry_headroom: retry_headroom != 0,
            require_host: require_host != 0,
        },
        ledger: ledger_from_row(row)?,
    };
    Ok((
        id_column(row, "id")?,
        Known {
            seq: row.try_get("seq").map_err(backend)?,
            view,
            root_id: id_column(row, "root_id")?,
            root_seq: row.try_get("root_seq").map_err(backend)?,
            contract: Arc::new(contract),
        },
    ))
}

/// One row of the `observations` table as every reader takes it:
/// (ObservationKind wire value, path). The one decoder of that table.
pub(super) fn observation_from_row(row: &SqliteRow) -> Result<(i32, String), StoreError> {
    let kind: i64 = row.try_get("kind").map_err(backend)?;
    let kind = i32::try_from(kind).map_err(|_| StoreError::Corrupt("observation kind".into()))?;
    Ok((kind, row.try_get("path").map_err(backend)?))
}
