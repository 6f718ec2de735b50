//! Audit reads' budgets, on every SQL backend (`tuned_suite!`): a read
//! stops at its row or byte budget with an error naming the limit.

use super::{Judged, Tuned, delegated, opened};
use crate::StoreError;

/// Every run, without a label filter.
async fn all_runs<S: Judged>(
    store: &S,
) -> Result<Vec<(crate::RunFacts, crate::TreeMutations)>, StoreError> {
    store.runs(None, &Default::default(), 10).await
}

/// The limit a refused read of every run names.
async fn refused_runs<S: Judged>(store: &S) -> &'static str {
    match all_runs(store).await {
        Err(StoreError::Overloaded(limit)) => limit,
        other => panic!("a tree past the budget must be refused: {other:?}"),
    }
}

/// The test defaults with an audit read's row budget of `rows`.
fn row_budget(rows: i64) -> Tuned {
    Tuned {
        max_audit_rows: Some(rows),
        ..Tuned::default()
    }
}

/// The test defaults with an audit read's byte budget of `bytes`.
fn byte_budget(bytes: usize) -> Tuned {
    Tuned {
        max_audit_bytes: Some(bytes),
        ..Tuned::default()
    }
}

/// An audit read stops at its row budget with an error naming the
/// limit, instead of loading a tree of any size: a tree exactly at the
/// budget is read, one more contract is refused.
pub async fn an_audit_read_is_bounded_by_its_row_budget<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    // The root's envelope (who opened the run) and its three children.
    let (store, _guard) = open(row_budget(4)).await;
    let root = opened(&store, 9, 1).await;
    let mut children = Vec::new();
    for i in 0..3 {
        children.push(delegated(&store, 9, 10 + i, root, 8).await);
    }
    let runs = all_runs(&store).await.expect("at the budget");
    assert_eq!(runs[0].0.contracts.len(), 3);
    assert!(
        store
            .audit_facts(children[0])
            .await
            .expect("audit")
            .is_some()
    );
    delegated(&store, 9, 20, root, 8).await;
    let limit = refused_runs(&store).await;
    assert!(limit.contains("MAX_AUDIT_ROWS"), "{limit}");
}

/// An audit read also stops at its byte budget (envelopes and paths),
/// pulling rows one at a time, whatever its row budget allows.
pub async fn an_audit_read_is_bounded_by_its_byte_budget<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    // About four contracts.
    let (store, _guard) = open(byte_budget(1_500)).await;
    let root = opened(&store, 9, 1).await;
    delegated(&store, 9, 10, root, 8).await;
    assert!(all_runs(&store).await.is_ok(), "one child fits");
    // Contracts are a few hundred bytes each (one hop's terms); the
    // tree's fan-out allows eight children.
    for i in 0..7 {
        delegated(&store, 9, 11 + i, root, 8).await;
    }
    let limit = refused_runs(&store).await;
    assert!(limit.contains("MAX_AUDIT_BYTES"), "{limit}");
}
