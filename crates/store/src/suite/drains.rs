//! Ending a subtree larger than one writer step (`Ending`, drains): the
//! request starts a drain and is answered DESCENDANTS_ENDING, the subtree
//! is frozen at once, its descendants end in bounded steps with the
//! receipts ending them at once would have given, and the retried request
//! then goes through. Run on every backend (`drain_suite`).

use prost::Message;

use super::{every_event, issued, reason, receipt, stored, test_child, test_root};
use crate::{Answer, Event, Store};
use broker_domain::{Id, Status};
use broker_wire::command::{Action, LifecycleCommand, NewChild, RequestMeta};
use broker_wire::pb;

/// The orchestrator that opens every tree here.
const OPENER: u8 = 1;
/// The delegate of the middle contracts, and of the leaves.
const MIDDLE: u8 = 2;
const LEAF: u8 = 3;

/// Fresh request metadata: nonces never repeat within a test.
pub struct Requests(u64);

impl Requests {
    pub fn new() -> Self {
        Self(0)
    }

    pub fn next(&mut self, agent: u8) -> RequestMeta {
        self.0 += 1;
        let nonce = self.0.to_le_bytes().to_vec();
        RequestMeta {
            agent: [agent; 32],
            digest: broker_wire::crypto::sha256(&nonce),
            nonce,
            timestamp_ms: super::TEST_TIMESTAMP_MS,
        }
    }

    /// A test child of `parent` for `[delegate; 32]`, asked by `[asker; 32]`.
    pub fn child(&mut self, asker: u8, parent: Id, delegate: u8) -> NewChild {
        NewChild {
            request: self.next(asker),
            ..test_child(asker, 0, parent, delegate, "true")
        }
    }

    /// `action` on `contract_id`, asked by `[agent; 32]`.
    pub fn command(&mut self, agent: u8, contract_id: Id, action: Action) -> LifecycleCommand {
        LifecycleCommand {
            request: Some(self.next(agent)),
            contract_id,
            action,
        }
    }
}

/// Why `command` is refused.
async fn refusal<S: Store>(store: &S, command: LifecycleCommand) -> &'static str {
    reason(&store.transition(command).await.unwrap_err())
}

/// The revocation every drain here starts with.
fn stop() -> Action {
    Action::Revoke {
        reason: "stop".into(),
    }
}

/// A tree: a root, `middles` children of it, each with `leaves` children
/// of 1 unit; ends within `deadline_ms` (absolute).
pub struct Tree {
    pub root: Id,
    pub middles: Vec<Id>,
    pub leaves: Vec<Id>,
}

pub async fn build<S: Store + Clone>(
    store: &S,
    requests: &mut Requests,
    middles: usize,
    leaves: usize,
    deadline_ms: i64,
) -> Tree {
    let mut root = test_root(requests.next(OPENER));
    root.budget = 10_000_000;
    root.deadline_ms = deadline_ms;
    root.policy.max_children = 1_024;
    let root = issued(store.open_root(root).await);
    let mut tree = Tree {
        root,
        middles: Vec::new(),
        leaves: Vec::new(),
    };
    for _ in 0..middles {
        let mut child = requests.child(OPENER, root, MIDDLE);
        child.ask.budget = 5_000;
        tree.middles.push(issued(store.delegate(child).await));
    }
    // Concurrently, as agents would: the writer groups them.
    for middle in tree.middles.clone() {
        let mut pending = Vec::new();
        for i in 0..leaves {
            let mut child = requests.child(MIDDLE, middle, LEAF);
            child.ask.budget = 1;
            let store = store.clone();
            pending.push(tokio::spawn(async move { store.delegate(child).await }));
            // Within the test stores' write queue.
            if pending.len() == 128 || i + 1 == leaves {
                for p in pending.drain(..) {
                    tree.leaves.push(issued(p.await.expect("task")));
                }
            }
        }
    }
    tree
}

/// Every receipt of the tree, by the contract it is about.
pub async fn receipts_by_contract<S: Store>(
    store: &S,
    root: Id,
) -> std::collections::HashMap<Vec<u8>, Vec<pb::Receipt>> {
    let mut by_contract: std::collections::HashMap<Vec<u8>, Vec<pb::Receipt>> =
        std::collections::HashMap::new();
    for event in every_event(store, root, 1_000).await {
        if let Event::Receipt { envelope, .. } = event {
            let receipt = pb::Receipt::decode(envelope.payload.as_slice()).expect("receipt");
            // A refused Delegate's receipt is about its parent: not a
            // transition of it.
            if receipt.kind == pb::ReceiptKind::Refused as i32 {
                continue;
            }
            by_contract
                .entry(receipt.contract_id.clone())
                .or_default()
                .push(receipt);
        }
    }
    by_contract
}

/// Waits until the drain of `id` is over (it has no open child left).
pub async fn drained<S: Store>(store: &S, id: Id) {
    for _ in 0..1_200 {
        let c = stored(store, id).await;
        if c.ledger.open_children == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the drain of {} did not end within 60 s", hex::encode(id));
}

/// After a drain: every descendant ended with `status` by exactly one
/// receipt naming the drained contract, holds nothing, and the drained
/// contract holds no reservation, so the ledger equation settles to the
/// top.
pub async fn check_drained<S: Store>(store: &S, tree: &Tree, status: Status) {
    let receipts = receipts_by_contract(store, tree.root).await;
    let kind = if status == Status::Expired {
        pb::ReceiptKind::Expired
    } else {
        pb::ReceiptKind::Revoked
    };
    let cause = format!("ended with its ancestor {}", hex::encode(tree.root));
    for id in tree.middles.iter().chain(&tree.leaves) {
        let c = stored(store, *id).await;
        assert_eq!(c.status, status, "{}", hex::encode(id));
        assert_eq!((c.ledger.reserved, c.ledger.open_children), (0, 0));
        let mine = receipts.get(id.as_slice()).map_or(&[][..], Vec::as_slice);
        assert_eq!(mine.len(), 1, "one receipt each: {}", hex::encode(id));
        assert_eq!(mine[0].kind, kind as i32);
        assert_eq!(mine[0].reason, cause);
        assert_eq!(mine[0].revoked_ids, vec![id.to_vec()]);
    }
    let root = stored(store, tree.root).await;
    assert_eq!((root.ledger.reserved, root.ledger.open_children), (0, 0));
    assert_eq!(root.ledger.spent, 0, "nothing was consumed");
}

/// A revoke of a root with more open descendants than one step ends
/// them in steps: answered DESCENDANTS_ENDING, the subtree issues
/// nothing from then on, the drainer ends every descendant once, and the
/// retried revoke then goes through with a receipt of its own.
pub async fn a_large_revoke_ends_in_steps<S: Store + Clone>(store: &S) {
    let mut requests = Requests::new();
    let step = crate::limits::DEFAULT_CASCADE_STEP_ROWS;
    let per_middle = step / 2 + 10;
    let tree = build(store, &mut requests, 2, per_middle, i64::MAX / 2).await;
    let command = requests.command(OPENER, tree.root, stop());
    let err = store.transition(command.clone()).await.unwrap_err();
    assert_eq!(reason(&err), "DESCENDANTS_ENDING", "{err:?}");
    // Frozen (or already revoked by the drain): nothing more is issued
    // under it, with a signed refusal.
    let child = requests.child(LEAF, tree.leaves[tree.leaves.len() - 1], 4);
    let refused = receipt(store.delegate(child).await);
    assert_eq!(refused.kind, pb::ReceiptKind::Refused as i32);
    assert_eq!(refused.primary, pb::InvariantCode::ParentNotActive as i32);
    drained(store, tree.root).await;
    check_drained(store, &tree, Status::Revoked).await;
    // The retry goes through now, and ends the root alone.
    let revoked = receipt(store.transition(command.clone()).await);
    assert_eq!(revoked.kind, pb::ReceiptKind::Revoked as i32);
    assert_eq!(revoked.revoked_ids, vec![tree.root.to_vec()]);
    let replayed: Answer = store.transition(command).await.expect("replayed");
    assert!(replayed.replayed);
}

/// The step size the backends' drain tests open their stores with.
pub const TEST_STEP_ROWS: usize = 8;

/// A drain driven step by step (a store opened with `drainer` off and
/// `TEST_STEP_ROWS`), stopped half-way as a crash would stop it (each step
/// is one transaction: a crash inside one rolls it back), and resumed by
/// the drainer of the store reopened on the same database: while it lasts
/// the subtree is frozen, each step ends at most a step of it, and in the
/// end every descendant was ended exactly once. `open(tuned)` opens the
/// store on the test's database; `clock` is the stores' clock. Then the
/// same for an expiry: the descendants expire.
pub async fn a_drain_is_frozen_stepped_and_resumed<S, F, Fut>(
    clock: std::sync::Arc<broker_wire::clock::OffsetClock>,
    open: F,
) where
    S: Store + Clone,
    F: Fn(super::Tuned) -> Fut,
    Fut: std::future::Future<Output = S>,
{
    use broker_wire::clock::Clock as _;
    // Steps of `TEST_STEP_ROWS`, by the drainer when `drainer`.
    let stepped = |drainer: bool| super::Tuned {
        cascade_step_rows: Some(TEST_STEP_ROWS),
        drainer: Some(drainer),
        ..super::Tuned::default()
    };
    let store = open(stepped(false)).await;
    let mut requests = Requests::new();
    let tree = build(&store, &mut requests, 4, 30, i64::MAX / 2).await;
    let revoke = requests.command(OPENER, tree.root, stop());
    assert_eq!(refusal(&store, revoke.clone()).await, "DESCENDANTS_ENDING");
    // Frozen: its holders can do nothing more with it.
    let leaf = tree.leaves[0];
    let accept = requests.command(LEAF, leaf, Action::Accept { host: None });
    assert_eq!(refusal(&store, accept).await, "ANCESTOR_ENDING");
    let me_too = Action::Revoke {
        reason: "me too".into(),
    };
    let middle_revoke = requests.command(OPENER, tree.middles[0], me_too);
    assert_eq!(refusal(&store, middle_revoke).await, "ANCESTOR_ENDING");
    let refused = receipt(store.delegate(requests.child(LEAF, leaf, 4)).await);
    assert_eq!(refused.primary, pb::InvariantCode::ParentNotActive as i32);
    assert_eq!(refused.violations[0].allowed, "ENDING");
    let refused = receipt(store.delegate(requests.child(OPENER, tree.root, 4)).await);
    assert_eq!(refused.primary, pb::InvariantCode::ParentNotActive as i32);
    // A retry while it drains: still waiting; nothing else happens to it.
    assert_eq!(refusal(&store, revoke.clone()).await, "DESCENDANTS_ENDING");
    let accept = requests.command(OPENER, tree.root, Action::Accept { host: None });
    assert_eq!(refusal(&store, accept).await, "DESCENDANTS_ENDING");
    // Three steps by hand, each ending at most a step.
    let step = LifecycleCommand {
        request: None,
        contract_id: tree.root,
        action: Action::Drain,
    };
    let mut ended = 0;
    for _ in 0..3 {
        store.transition(step.clone()).await.expect("a step");
        let now = receipts_by_contract(&store, tree.root)
            .await
            .values()
            .map(Vec::len)
            .sum::<usize>();
        assert!(
            now > ended && now - ended <= TEST_STEP_ROWS,
            "{ended} then {now}"
        );
        ended = now;
    }
    drop(store);
    // Reopened with its drainer: the drain resumes and ends.
    let store = open(stepped(true)).await;
    drained(&store, tree.root).await;
    check_drained(&store, &tree, Status::Revoked).await;
    let revoked = receipt(store.transition(revoke).await);
    assert_eq!(revoked.revoked_ids, vec![tree.root.to_vec()]);

    // Expiry: the sweeper's request starts a drain whose descendants
    // expire.
    let deadline_ms = clock.now_ms() + 60_000;
    let tree = build(&store, &mut requests, 3, 20, deadline_ms).await;
    clock.advance_ms(120_000);
    let expire = LifecycleCommand {
        request: None,
        contract_id: tree.root,
        action: Action::Expire,
    };
    assert_eq!(refusal(&store, expire.clone()).await, "DESCENDANTS_ENDING");
    drained(&store, tree.root).await;
    check_drained(&store, &tree, Status::Expired).await;
    let expired = receipt(store.transition(expire).await);
    assert_eq!(expired.kind, pb::ReceiptKind::Expired as i32);
    assert_eq!(expired.revoked_ids, vec![tree.root.to_vec()]);
}

/// A tree of 8,000 open contracts (eight drain steps at the default
/// step size, and many more as pacing shortens them) is revoked at its
/// root while another tenant delegates, accepts and completes. The revoke
/// is answered at once; the other tenant's calls never wait behind the
/// whole cascade (each at most behind a step: when one transaction ended
/// a whole 30,000-contract tree, everyone else waited for it, 20 s in a
/// debug build, CANCELLED at 30 s in a release one); every descendant ends
/// exactly once and the ledgers settle. No time is asserted (a loaded CI
/// machine stretches any bound): the other tenant finishing a round while
/// the tree still has open children is what one transaction for the whole
/// cascade could never allow.
pub async fn a_large_revoke_does_not_stall_other_tenants<S: Store + Clone>(store: &S) {
    let mut requests = Requests::new();
    let tree = build(store, &mut requests, 8, 1_000, i64::MAX / 2).await;
    // The other tenant: its own root (another opener).
    let other = 7u8;
    let mut root = test_root(requests.next(other));
    root.policy.max_children = 1_024;
    root.budget = 1_000_000;
    let other_root = issued(store.open_root(root).await);
    let revoke = requests.command(OPENER, tree.root, stop());
    let err = store.transition(revoke.clone()).await.unwrap_err();
    assert_eq!(reason(&err), "DESCENDANTS_ENDING");
    let mut slowest = std::time::Duration::ZERO;
    let mut rounds = 0;
    /// Far more than the drain's steps (8,000 contracts): a drain that
    /// stopped making progress.
    const MAX_ROUNDS: u32 = 100_000;
    loop {
        let drained_now = stored(store, tree.root).await.ledger.open_children == 0;
        // A delegation, an accept and a completion of the other tenant.
        let began = std::time::Instant::now();
        let child = issued(store.delegate(requests.child(other, other_root, 8)).await);
        let accept = requests.command(8, child, Action::Accept { host: None });
        receipt(store.transition(accept).await);
        let complete = requests.command(8, child, super::complete_action(1));
        let done = receipt(store.transition(complete).await);
        assert_eq!(done.kind, pb::ReceiptKind::Completed as i32);
        slowest = slowest.max(began.elapsed());
        rounds += 1;
        if drained_now {
            break;
        }
        assert!(
            rounds < MAX_ROUNDS,
            "the drain did not end in {MAX_ROUNDS} rounds"
        );
    }
    assert!(
        rounds > 1,
        "the drain ended before the other tenant's first call"
    );
    eprintln!("the other tenant's slowest round during the drain: {slowest:?} ({rounds} rounds)");
    check_drained(store, &tree, Status::Revoked).await;
    let revoked = receipt(store.transition(revoke).await);
    assert_eq!(revoked.revoked_ids, vec![tree.root.to_vec()]);
}
