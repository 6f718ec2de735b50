//! The judge pool: completions judged off the writer on a few deep-stack
//! threads, one per contract and a few per signer at a time, each wait
//! bounded; a judgment made stale by new observations is made again.

use super::*;

/// Completions judged at once off the writer: judging is CPU-bound, so
/// more than a few only queue for the same cores; the rest wait for a
/// permit (each request still has its deadline).
pub(super) const MAX_CONCURRENT_JUDGMENTS: usize = 4;

/// What a completion being judged holds (see `prejudge`).
pub(super) type JudgingSlots = (crate::slots::Slot<Id>, crate::slots::Slot<AgentKey>);

/// Completions one signing key may have judged at once.
pub(super) const MAX_JUDGMENTS_PER_SIGNER: usize = 2;

/// Judgments of one completion before giving up when host observations
/// keep arriving while it is judged (each makes the last one stale).
pub(super) const MAX_JUDGMENT_ATTEMPTS: usize = 3;

/// A lifecycle command through the writer; a completion is judged first,
/// off the writer (`prejudge`), and again if the writer finds the judgment
/// stale, at most `MAX_JUDGMENT_ATTEMPTS` times.
pub(super) async fn transition(
    store: &BackendStore,
    command: LifecycleCommand,
) -> Result<Answer, StoreError> {
    let LifecycleCommand {
        request,
        contract_id,
        action,
    } = command;
    let Action::Complete(mut args) = action else {
        return store
            .submit(Command::Lifecycle(Box::new(LifecycleCommand {
                request,
                contract_id,
                action,
            })))
            .await;
    };
    // The writer sends a completion back when host observations
    // arrived after its judgment; it is judged again here, off the
    // writer, a bounded number of times.
    let signer = request.as_ref().map(|r| r.agent);
    // Slots held while this completion is judged (taken in `prejudge`,
    // once the signer is known to be the delegate of an accepted contract).
    let mut slots = None;
    for _ in 0..MAX_JUDGMENT_ATTEMPTS {
        let judged = prejudge(store, &contract_id, signer.as_ref(), args, &mut slots).await?;
        args = judged.clone();
        let command = LifecycleCommand {
            request: request.clone(),
            contract_id,
            action: Action::Complete(judged),
        };
        match store.submit(Command::Lifecycle(Box::new(command))).await {
            Err(StoreError::StaleJudgment) => continue,
            answer => return answer,
        }
    }
    Err(StoreError::Unavailable {
        reason: pb::ErrorReason::ObservationsChanging,
        detail: format!(
            "the host recorded observations during each of {MAX_JUDGMENT_ATTEMPTS} judgments of this completion; nothing was recorded: retry with the same nonce"
        ),
    })
}
/// Judges a completion before it reaches the writer, on one of the
/// judge threads, at most `MAX_CONCURRENT_JUDGMENTS` at a time (the
/// pool's permit stays with the job, so a caller that goes away does
/// not free it early). The writer never judges: it takes this judgment
/// if the contract's observations are what it saw, and sends the
/// completion back otherwise. Only the contract's delegate gets a
/// judgment (see `JudgeInputs::load`); anyone else is refused by the
/// writer before a judgment is needed. Waiting is bounded: past
/// `judgment_deadline` the caller is answered UNAVAILABLE (nothing was
/// written, so a retry with the same nonce is safe).
pub(super) async fn prejudge(
    store: &BackendStore,
    contract_id: &Id,
    signer: Option<&AgentKey>,
    mut args: Box<CompleteArgs>,
    slots: &mut Option<JudgingSlots>,
) -> Result<Box<CompleteArgs>, StoreError> {
    let received_at_ms = *args.received_at_ms.get_or_insert(store.clock.now_ms());
    args.prejudged = None;
    let Some(signer) = signer else {
        return Ok(args);
    };
    let mut conn = store.reader.acquire().await.map_err(backend)?;
    let inputs = JudgeInputs::load(&mut conn, contract_id, signer, received_at_ms).await?;
    drop(conn);
    let Some(inputs) = inputs else {
        return Ok(args);
    };
    // One judgment per contract, and a few per signer, at a time: a
    // delegate (and a host it controls) cannot keep every judge busy.
    // Taken only now that the signer is the contract's delegate, so a
    // stranger's requests never hold them.
    if slots.is_none() {
        let contract = store.judging_contracts.take(*contract_id).map_err(|_| {
            StoreError::Unavailable {
                reason: pb::ErrorReason::JudgmentInProgress,
                detail: "another completion of this contract is being judged; retry with the same nonce once it is answered".into(),
            }
        })?;
        let signer = store
            .judging_signers
            .take(*signer)
            .map_err(StoreError::Overloaded)?;
        *slots = Some((contract, signer));
    }
    let hook = store.before_judge.clone();
    let job_args = args.clone();
    let share = crate::pool::Share {
        tenant: inputs.tenant,
        key: *signer,
    };
    let judged = store
        .judges
        .run(share, store.judgment_deadline, move || {
            if let Some(hook) = hook {
                (hook.0)();
            }
            inputs.judge(&job_args)
        })
        .await
        .map_err(|e| match e {
            crate::pool::PoolError::TimedOut(ms) => StoreError::Unavailable {
                reason: pb::ErrorReason::JudgesBusy,
                detail: format!(
                    "the completion could not be judged within {ms} ms (every judge is busy); nothing was recorded: retry with the same nonce"
                ),
            },
            crate::pool::PoolError::Full => StoreError::Unavailable {
                reason: pb::ErrorReason::JudgesBusy,
                detail: format!(
                    "this tree's tenant already has {} completions waiting for a judge; nothing was recorded: retry with the same nonce",
                    crate::pool::MAX_WAITING_PER_TENANT
                ),
            },
            crate::pool::PoolError::Panicked => {
                StoreError::Corrupt("a judgment panicked".into())
            }
            crate::pool::PoolError::Stopped => StoreError::Closed,
        })?;
    args.prejudged = Some(judged);
    Ok(args)
}
