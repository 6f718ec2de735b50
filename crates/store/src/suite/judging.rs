//! The judge pool's behaviours, on every SQL backend (`judging_suite!`):
//! judgments made off the writer, made again when stale, bounded in
//! number and in waiting. Each test opens its store through `open`, with
//! the judge hook and deadline it needs (`Tuned`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{
    Judged, Tuned, accept_hosted_by, acted, complete_args, issued, meta, observation, opened,
    reason, receipt, stored, test_child,
};
use crate::StoreError;
use crate::batch::Command;
use crate::limits::{MAX_CONCURRENT_JUDGMENTS, MAX_JUDGMENTS_PER_SIGNER};
use crate::sql::BeforeJudge;
use crate::sql::judge::JudgeInputs;
use broker_domain::limits::JUDGMENT_DEADLINE_MS;
use broker_domain::limits::MAX_JUDGMENT_ATTEMPTS;
use broker_domain::{Id, Status};
use broker_wire::clock::{Clock, SystemClock};
use broker_wire::command::{Action, CompleteArgs, LifecycleCommand, ObservationIn, RequestMeta};
use broker_wire::pb;

/// Completions are judged before they reach the writer. The writer
/// trusts such a judgment only while the contract's observations are
/// the ones it saw: one recorded in between (here a write outside the
/// scope) makes the writer send it back to be judged again, off the
/// writer, on what the host reported.
pub async fn a_judgment_made_before_an_observation_is_made_again<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let clock = SystemClock;
    let (store, _guard) = open(Tuned::default()).await;
    let root = opened(&store, 9, 1).await;
    let (delegate, host) = (20u8, 30u8);
    let mut verdicts = Vec::new();
    // (observe before completing, tamper with the early judgment)
    for (i, (observe_first, tamper)) in [(false, false), (true, false), (false, true)]
        .into_iter()
        .enumerate()
    {
        let i = u8::try_from(i).expect("three cases");
        let child = issued(
            store
                .delegate(test_child(9, 10 + i, root, delegate, "result.within_scope"))
                .await,
        );
        let transition = |nonce: u8, agent: u8, action: Action| {
            Command::Lifecycle(Box::new(LifecycleCommand {
                request: Some(meta(agent, nonce)),
                contract_id: child,
                action,
            }))
        };
        let submit = async |nonce: u8, agent: u8, action: Action| {
            store.sql().submit(transition(nonce, agent, action)).await
        };
        let accepted = receipt(submit(20 + i, delegate, accept_hosted_by(host)).await);
        assert_eq!(accepted.kind, pb::ReceiptKind::Accepted as i32);
        let mut args = CompleteArgs {
            received_at_ms: Some(clock.now_ms()),
            ..unreported_completion()
        };
        let mut conn = store.sql().read().await.expect("reader");
        let at_ms = clock.now_ms();
        let stranger = JudgeInputs::load::<S::Db>(&mut conn, &child, &[host; 32], at_ms).await;
        assert!(
            matches!(stranger, Ok(None)),
            "only the delegate's completion is judged early"
        );
        let inputs = JudgeInputs::load::<S::Db>(&mut conn, &child, &[delegate; 32], at_ms)
            .await
            .expect("inputs")
            .expect("open contract");
        drop(conn);
        let mut before = inputs.judge(&args);
        assert_eq!(
            before.judgment.verdict,
            broker_domain::judge::Verdict::Accepted
        );
        if tamper {
            // Shows which judgment the writer used.
            before.judgment.verdict = broker_domain::judge::Verdict::Rejected;
        }
        args.prejudged = Some(before);
        if observe_first {
            let observation = ObservationIn {
                tool: "shell".into(),
                at_ms: clock.now_ms(),
                ..observation(pb::ObservationKind::Mutation, "etc/passwd", 0)
            };
            let record = Action::Record {
                observations: vec![observation],
            };
            let recorded = receipt(submit(30 + i, host, record).await);
            assert_eq!(recorded.kind, pb::ReceiptKind::Observed as i32);
        }
        let completed = if observe_first {
            // The writer does not judge: it sends the stale judgment
            // back, and the store's front door judges again.
            let complete = Action::Complete(Box::new(args.clone()));
            let answer = submit(40 + i, delegate, complete).await;
            assert!(
                matches!(answer, Err(StoreError::StaleJudgment)),
                "{answer:?}"
            );
            let complete = Action::Complete(Box::new(args));
            acted(&store, delegate, 40 + i, child, complete).await
        } else {
            let complete = Action::Complete(Box::new(args));
            receipt(submit(40 + i, delegate, complete).await)
        };
        let completion = completed.completion.expect("completion");
        verdicts.push((completion.verdict, completion.within_scope));
    }
    assert_eq!(
        verdicts,
        [
            (broker_domain::judge::Verdict::Accepted.as_i32(), true),
            (broker_domain::judge::Verdict::Rejected.as_i32(), false),
            (broker_domain::judge::Verdict::Rejected.as_i32(), true),
        ],
        "a new observation: judged again; unchanged observations: the \
         judgment made before is used (the writer does not judge again)"
    );
}

/// However many completions arrive at once, at most
/// `MAX_CONCURRENT_JUDGMENTS` are judged at a time (each judge is a
/// thread with a deep stack); the rest wait for a permit, and all are
/// answered.
pub async fn at_most_the_judgment_limit_is_judged_at_once<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    // More than the limit, within the test root's fan-out (8).
    const COMPLETIONS: u8 = 7;
    // (open gate, live judges, most live at once)
    type Gate = (Mutex<(bool, usize, usize)>, std::sync::Condvar);
    let gate: Arc<Gate> = Arc::new((Mutex::new((false, 0, 0)), std::sync::Condvar::new()));
    let held = gate.clone();
    let hook = BeforeJudge(Arc::new(move || {
        let (state, changed) = &*held;
        let mut state = state.lock().expect("gate");
        state.1 += 1;
        state.2 = state.2.max(state.1);
        changed.notify_all();
        while !state.0 {
            state = changed.wait(state).expect("gate");
        }
        state.1 -= 1;
    }));
    let (store, _guard) = open(Tuned {
        before_judge: Some(hook),
        ..Tuned::default()
    })
    .await;
    let root = opened(&store, 9, 1).await;
    let mut completions = Vec::new();
    for i in 0..COMPLETIONS {
        // Each from its own delegate: one signer's judgments are capped
        // lower (MAX_JUDGMENTS_PER_SIGNER).
        let delegate = 20 + i;
        let child = issued(
            store
                .delegate(test_child(9, 10 + i, root, delegate, "true"))
                .await,
        );
        acted(&store, delegate, 40 + i, child, accept_hosted_by(30)).await;
        let store = store.clone();
        completions.push(tokio::spawn(async move {
            store.transition(complete_by(delegate, child, 80 + i)).await
        }));
    }
    // Wait until the limit is reached, then a while longer for any
    // judge beyond it to show up.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gate.0.lock().expect("gate").1 < MAX_CONCURRENT_JUDGMENTS
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let most = gate.0.lock().expect("gate").2;
    assert_eq!(
        most, MAX_CONCURRENT_JUDGMENTS,
        "judges at once while {COMPLETIONS} completions wait"
    );
    {
        let (state, changed) = &*gate;
        state.lock().expect("gate").0 = true;
        changed.notify_all();
    }
    for completion in completions {
        let answer = receipt(completion.await.expect("task"));
        assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
    }
    assert_eq!(gate.0.lock().expect("gate").2, MAX_CONCURRENT_JUDGMENTS);
}

/// Opens a store whose judges run `hook` first, with a child of a root
/// accepted by delegate 20 with host 30; returns (store, child id).
async fn judged_store<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
    hook: BeforeJudge,
    judgment_deadline_ms: u64,
    predicate: &str,
) -> (S, G, Id) {
    let (store, guard) = open(Tuned {
        before_judge: Some(hook),
        judgment_deadline_ms: Some(judgment_deadline_ms),
        ..Tuned::default()
    })
    .await;
    let root = opened(&store, 9, 1).await;
    let child = issued(store.delegate(test_child(9, 2, root, 20, predicate)).await);
    acted(&store, 20, 3, child, accept_hosted_by(30)).await;
    (store, guard, child)
}

/// The test completion, of 1 unit and without a report.
fn unreported_completion() -> CompleteArgs {
    CompleteArgs {
        has_report: false,
        ..complete_args(1)
    }
}

/// Delegate 20's completion of `contract_id`.
fn complete(contract_id: Id, nonce: u8) -> LifecycleCommand {
    complete_by(20, contract_id, nonce)
}

/// A judge hook that counts the judgments reaching it and holds those
/// `hold` picks (by number, from 0) until the sender sends, one a
/// judgment.
fn held_judges(
    hold: impl Fn(usize) -> bool + Send + Sync + 'static,
) -> (
    BeforeJudge,
    Arc<std::sync::atomic::AtomicUsize>,
    std::sync::mpsc::Sender<()>,
) {
    let entered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new(gate);
    let count = entered.clone();
    let hook = BeforeJudge(Arc::new(move || {
        if hold(count.fetch_add(1, std::sync::atomic::Ordering::SeqCst)) {
            let _ = gate.lock().expect("gate").recv();
        }
    }));
    (hook, entered, release)
}

/// A host observation recorded while a completion is
/// judged made the writer judge again on its own thread (with an
/// expensive predicate, every tenant's writes froze). Now the writer
/// sends the completion back and it is judged again on a judge thread,
/// on the new observation.
pub async fn the_writer_never_judges_a_completion_made_stale_by_an_observation<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    // The first judgment waits until the test has recorded an
    // observation; later ones go straight on.
    let (hook, judged, release) = held_judges(|n| n == 0);
    let (store, _guard, child) =
        judged_store(&open, hook, JUDGMENT_DEADLINE_MS, "result.within_scope").await;
    let completing = {
        let store = store.clone();
        tokio::spawn(async move { store.transition(complete(child, 4)).await })
    };
    while judged.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let record = Action::Record {
        observations: vec![ObservationIn {
            tool: String::new(),
            at_ms: 0,
            ..observation(pb::ObservationKind::Mutation, "/etc/passwd", 0)
        }],
    };
    acted(&store, 30, 5, child, record).await;
    release.send(()).expect("release");
    let done = receipt(completing.await.expect("task"));
    let completion = done.completion.expect("a completion");
    assert_eq!(
        completion.verdict,
        broker_domain::judge::Verdict::Rejected.as_i32(),
        "judged on the observation recorded during the first judgment"
    );
    assert_eq!(judged.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// An accepted child of `root` for delegate `[delegate; 32]` (host 30).
async fn accepted_child<S: Judged>(store: &S, root: Id, delegate: u8, nonce: u8) -> Id {
    let child = super::delegated(store, 9, nonce, root, delegate).await;
    acted(store, delegate, nonce, child, accept_hosted_by(30)).await;
    child
}

/// `[delegate; 32]`'s completion of `contract_id`.
fn complete_by(delegate: u8, contract_id: Id, nonce: u8) -> LifecycleCommand {
    LifecycleCommand {
        request: Some(meta(delegate, nonce)),
        contract_id,
        action: Action::Complete(Box::new(unreported_completion())),
    }
}

/// A completion never waits for a judge without a
/// deadline. With every judge held, completions are answered
/// UNAVAILABLE (JUDGES_BUSY) at the deadline, nothing is recorded, and
/// other writes go on meanwhile.
pub async fn a_completion_waits_for_a_judge_no_longer_than_its_deadline<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let (hook, _, release) = held_judges(|_| true);
    let (store, _guard, first) = judged_store(&open, hook, 300, "true").await;
    let root = stored(&store, first).await.root_id;
    let mut children = vec![(20u8, first)];
    for i in 1..=MAX_CONCURRENT_JUDGMENTS {
        let delegate = 20 + u8::try_from(i).expect("few");
        children.push((
            delegate,
            accepted_child(&store, root, delegate, 40 + delegate).await,
        ));
    }
    // Fill every judge, each completion from its own delegate; each
    // waits past its deadline, the one beyond the pool too.
    let mut stuck = Vec::new();
    for (delegate, child) in children.clone() {
        let store = store.clone();
        stuck.push(tokio::spawn(async move {
            store
                .transition(complete_by(delegate, child, 100 + delegate))
                .await
        }));
    }
    for task in stuck {
        match task.await.expect("task") {
            Err(StoreError::Unavailable { reason, .. }) => {
                assert_eq!(reason, pb::ErrorReason::JudgesBusy)
            }
            other => panic!("expected JUDGES_BUSY, got {other:?}"),
        }
    }
    // Other writes were never held up.
    let root_again = opened(&store, 9, 50).await;
    assert_ne!(root_again, first);
    for (_, child) in children {
        let status = stored(&store, child).await.status;
        assert_eq!(status, Status::Accepted, "nothing was recorded");
    }
    for _ in 0..MAX_CONCURRENT_JUDGMENTS {
        let _ = release.send(());
    }
}

/// One delegate (with a host it controls) could keep
/// every judge busy. One completion of a contract is judged at a time,
/// and one signer has at most `MAX_JUDGMENTS_PER_SIGNER` judged at once.
pub async fn judgments_are_one_per_contract_and_few_per_signer<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let (hook, entered, release) = held_judges(|_| true);
    let (store, _guard, first) = judged_store(&open, hook, JUDGMENT_DEADLINE_MS, "true").await;
    let root = stored(&store, first).await.root_id;
    let mut mine = vec![first];
    for i in 0..MAX_JUDGMENTS_PER_SIGNER {
        mine.push(accepted_child(&store, root, 20, 60 + u8::try_from(i).expect("few")).await);
    }
    let mut running = Vec::new();
    for (i, child) in mine.iter().take(MAX_JUDGMENTS_PER_SIGNER).enumerate() {
        let (store, child) = (store.clone(), *child);
        running.push(tokio::spawn(async move {
            store
                .transition(complete(child, 90 + u8::try_from(i).expect("few")))
                .await
        }));
    }
    while entered.load(std::sync::atomic::Ordering::SeqCst) < MAX_JUDGMENTS_PER_SIGNER {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A second completion of a contract being judged: not queued.
    match store.transition(complete(first, 99)).await {
        Err(StoreError::Unavailable { reason, .. }) => {
            assert_eq!(reason, pb::ErrorReason::JudgmentInProgress)
        }
        other => panic!("expected JUDGMENT_IN_PROGRESS, got {other:?}"),
    }
    // A stranger's completion of that contract holds nothing: it is
    // refused for what it is, not for the judgment in progress.
    match store.transition(complete_by(77, first, 96)).await {
        Err(StoreError::PermissionDenied { reason, .. }) => {
            assert_eq!(reason, pb::ErrorReason::NotDelegate)
        }
        other => panic!("expected NOT_DELEGATE, got {other:?}"),
    }
    // The same signer's next contract: over its share.
    let last = *mine.last().expect("children");
    match store.transition(complete(last, 98)).await {
        Err(StoreError::Overloaded(limit)) => assert_eq!(limit, "MAX_JUDGMENTS_PER_SIGNER"),
        other => panic!("expected MAX_JUDGMENTS_PER_SIGNER, got {other:?}"),
    }
    for _ in 0..MAX_JUDGMENTS_PER_SIGNER {
        release.send(()).expect("release");
    }
    for task in running {
        let answer = receipt(task.await.expect("task"));
        assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
    }
    // Once answered, the signer's other contract is judged as usual.
    release.send(()).expect("release");
    let answer = receipt(store.transition(complete(last, 97)).await);
    assert_eq!(answer.kind, pb::ReceiptKind::Completed as i32);
}

/// A host recording during every judgment kept each
/// completion stale (OBSERVATIONS_CHANGING), retryable without end, three
/// judgments per call. Each stale judgment is now counted; past
/// `MAX_STALE_JUDGMENTS` the contract takes no more observations
/// (RECORDING_CLOSED) and the next completion's judgment holds.
pub async fn a_host_recording_during_every_judgment_cannot_loop_the_judges<S: Judged, G>(
    open: impl AsyncFn(Tuned) -> (S, G),
) {
    let handle = tokio::runtime::Handle::current();
    let store_cell: Arc<std::sync::OnceLock<(S, Id)>> = Arc::default();
    let judged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let refused = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let hook = {
        let (cell, judged, refused) = (store_cell.clone(), judged.clone(), refused.clone());
        BeforeJudge(Arc::new(move || {
            let n = judged.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let Some((store, child)) = cell.get() else {
                return;
            };
            // The host records on the judge's own thread, so the
            // judgment it is making is stale when it reaches the writer.
            let record = LifecycleCommand {
                request: Some(RequestMeta {
                    nonce: (1_000 + n).to_le_bytes().to_vec(),
                    digest: broker_wire::crypto::sha256(&(1_000 + n).to_le_bytes()),
                    ..meta(30, 0)
                }),
                contract_id: *child,
                action: Action::Record {
                    observations: vec![ObservationIn {
                        tool: "search".into(),
                        at_ms: SystemClock.now_ms(),
                        arguments_sha256: None,
                        outcome: pb::ToolOutcome::Unspecified,
                        ..observation(pb::ObservationKind::ToolCall, "", 0)
                    }],
                },
            };
            if let Err(e) = handle.block_on(store.transition(record)) {
                refused.lock().unwrap().push(reason(&e).to_owned());
            }
        }))
    };
    let (store, _guard, child) = judged_store(&open, hook, 10_000, "true").await;
    let _ = store_cell.set((store.clone(), child));
    let max = usize::try_from(broker_domain::limits::MAX_STALE_JUDGMENTS).unwrap();
    let calls = max / MAX_JUDGMENT_ATTEMPTS;
    for call in 0..calls {
        let err = store
            .transition(complete(child, 50 + u8::try_from(call).unwrap()))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Unavailable { reason, .. } if *reason == pb::ErrorReason::ObservationsChanging),
            "{err:?}"
        );
    }
    assert!(refused.lock().unwrap().is_empty());
    let done = receipt(store.transition(complete(child, 99)).await);
    assert_eq!(done.kind, pb::ReceiptKind::Completed as i32);
    assert_eq!(
        judged.load(std::sync::atomic::Ordering::SeqCst),
        u64::try_from(max + 1).unwrap(),
        "the stale ones and the one that held"
    );
    assert_eq!(*refused.lock().unwrap(), ["RECORDING_CLOSED"]);
}
