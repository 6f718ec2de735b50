//! Ending the target: its open descendants end with it (or in bounded
//! drain steps), each with a cascade receipt, and the model's changes
//! become the decision's row updates.

use super::{
    Decision, Ending, Facts, PlannedReceipt, ReceiptBody, Refused, RowUpdate, Subtree, TargetWrite,
};
use crate::lifecycle::{Consumption, Ended, Tree, TreeError};
use crate::{Id, Status};

/// One bounded step of a drain: `rows` are contracts of the draining
/// subtree (each with its parent among them, but for the first, the
/// draining contract), `order` the ones to end now, every child before its
/// parent and each with no open child left outside `order`. Each ends
/// with `status` and settles into its parent with the ledger's rules, and
/// gets the `Cascaded` receipt naming `cause` that ending it at once would
/// have given it.
pub fn drain_step(rows: &[Facts], order: &[usize], cause: Id, status: Status) -> Decision {
    let subtree = Subtree {
        rows: rows.to_vec(),
        target: 0,
        lineage: Vec::new(),
        ending: Ending::Draining,
    };
    let mut tree = subtree.model();
    let mut receipts = Vec::with_capacity(order.len());
    for &row in order {
        if row == 0 || !rows[row].status.is_open() {
            return Decision::refused(Refused::Corrupt(format!(
                "a drain step cannot end row {row}"
            )));
        }
        if let Err(e) = tree.settle(row, status, Consumption::Metered) {
            return Decision::refused(e.into());
        }
        receipts.push(PlannedReceipt {
            row,
            answers_request: false,
            body: ReceiptBody::Cascaded {
                id: rows[row].id,
                status,
                cause,
            },
        });
    }
    Decision {
        updates: updates(&subtree, &tree),
        write: TargetWrite::None,
        answer: if receipts.is_empty() {
            Err(Refused::NotOverdue)
        } else {
            Ok(0)
        },
        receipts,
    }
}

/// A model operation on the target, before its receipt is known.
pub(super) struct Step<'a> {
    subtree: &'a Subtree,
    pub(super) tree: Tree,
    pub(super) outcome: Result<Vec<Ended>, TreeError>,
}

pub(super) fn ending<'a>(
    subtree: &'a Subtree,
    op: impl FnOnce(&mut Tree, usize) -> Result<Vec<Ended>, TreeError>,
) -> Step<'a> {
    let mut tree = subtree.model();
    let outcome = op(&mut tree, subtree.target);
    Step {
        subtree,
        tree,
        outcome,
    }
}

impl Step<'_> {
    /// The decision: the descendants' cascade receipts, then the target's
    /// receipt built by `body` from the settled model and the ended ids
    /// (the target first, each before its descendants).
    pub(super) fn finish(
        self,
        write: TargetWrite,
        body: impl FnOnce(&Tree, Vec<Id>) -> ReceiptBody,
    ) -> Decision {
        let ended = match self.outcome {
            Ok(ended) => ended,
            Err(e) => return Decision::refused(e.into()),
        };
        let mut receipts = cascades(self.subtree, &ended);
        receipts.push(PlannedReceipt {
            row: self.subtree.target,
            answers_request: true,
            body: body(&self.tree, ended_ids(self.subtree, &ended)),
        });
        Decision {
            updates: updates(self.subtree, &self.tree),
            write,
            answer: Ok(receipts.len() - 1),
            receipts,
        }
    }
}

/// A receipt for every open descendant that ended with the target,
/// deepest first (a receipt per transition: Watch streams of those
/// subtrees see it).
pub(super) fn cascades(subtree: &Subtree, ended: &[Ended]) -> Vec<PlannedReceipt> {
    let cause = subtree.target().id;
    ended
        .iter()
        .filter(|e| e.id != subtree.target)
        .map(|e| PlannedReceipt {
            row: e.id,
            answers_request: false,
            body: ReceiptBody::Cascaded {
                id: subtree.rows[e.id].id,
                status: e.status,
                cause,
            },
        })
        .collect()
}

/// Contracts a transition ended: the target first, then the open
/// descendants it ended (`Tree::end` reports them deepest first; reversed,
/// every contract comes before its descendants).
pub(super) fn ended_ids(subtree: &Subtree, ended: &[Ended]) -> Vec<Id> {
    let mut ids: Vec<Id> = ended.iter().rev().map(|e| subtree.rows[e.id].id).collect();
    ids.dedup();
    ids
}

pub(super) fn updates(subtree: &Subtree, tree: &Tree) -> Vec<RowUpdate> {
    subtree
        .rows
        .iter()
        .zip(tree.nodes())
        .enumerate()
        .filter(|(_, (row, node))| row.status != node.status || row.ledger != node.ledger)
        .map(|(i, (_, node))| RowUpdate {
            row: i,
            status: node.status,
            ledger: node.ledger,
        })
        .collect()
}
