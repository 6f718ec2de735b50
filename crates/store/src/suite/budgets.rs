//! Audit reads' budgets, on every SQL backend (`tuned_suite!`): a read
//! stops at its row or byte budget with an error naming the limit.

use super::{Judged, Tuned, issued, meta, test_child, test_root};
use crate::StoreError;

/// An audit read stops at its row budget with an error naming the
/// limit, instead of loading a tree of any size: a tree exactly at the
/// budget is read, one more contract is refused.
pub async fn an_audit_read_is_bounded_by_its_row_budget<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let (store, _guard) = open(Tuned {
        max_audit_rows: Some(3),
        ..Tuned::default()
    })
    .await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let mut children = Vec::new();
    for i in 0..3 {
        children.push(issued(
            store.delegate(test_child(9, 10 + i, root, 8, "true")).await,
        ));
    }
    let everything = std::collections::BTreeMap::new();
    let runs = store
        .runs(None, &everything, 10)
        .await
        .expect("at the budget");
    assert_eq!(runs[0].0.contracts.len(), 3);
    assert!(
        store
            .audit_facts(children[0])
            .await
            .expect("audit")
            .is_some()
    );
    issued(store.delegate(test_child(9, 20, root, 8, "true")).await);
    match store.runs(None, &everything, 10).await {
        Err(StoreError::Overloaded(limit)) => {
            assert!(limit.contains("MAX_AUDIT_ROWS"), "{limit}")
        }
        other => panic!("a tree past the row budget must be refused: {other:?}"),
    }
}

/// An audit read also stops at its byte budget (envelopes and paths),
/// pulling rows one at a time, whatever its row budget allows.
pub async fn an_audit_read_is_bounded_by_its_byte_budget<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let (store, _guard) = open(Tuned {
        // About four contracts.
        max_audit_bytes: Some(1_500),
        ..Tuned::default()
    })
    .await;
    let root = issued(store.open_root(test_root(meta(9, 1))).await);
    let everything = std::collections::BTreeMap::new();
    issued(store.delegate(test_child(9, 10, root, 8, "true")).await);
    assert!(
        store.runs(None, &everything, 10).await.is_ok(),
        "one child fits"
    );
    // Contracts are a few hundred bytes each (one hop's terms); the
    // tree's fan-out allows eight children.
    for i in 0..7 {
        issued(store.delegate(test_child(9, 11 + i, root, 8, "true")).await);
    }
    match store.runs(None, &everything, 10).await {
        Err(StoreError::Overloaded(limit)) => {
            assert!(limit.contains("MAX_AUDIT_BYTES"), "{limit}")
        }
        other => panic!("a tree past the byte budget must be refused: {other:?}"),
    }
}
