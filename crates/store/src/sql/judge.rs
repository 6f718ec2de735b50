//! The judge pool: completions judged off the writer on a few deep-stack
//! threads, one per contract and a few per signer at a time, each wait
//! bounded; a judgment made stale by new observations is made again.

use super::lifecycle::Loaded;
use super::{Backend, Dialect, QueryExt};
use crate::batch::Command;
use crate::{Answer, StoreError, backend};
use broker_domain::judge;
use broker_domain::lifecycle;
use broker_domain::limits::{MAX_JUDGMENT_ATTEMPTS, MAX_WAITING_PER_TENANT};
use broker_domain::{AgentKey, Id, Scope};
use broker_wire::command::{Action, CompleteArgs, LifecycleCommand, PreJudged};
use broker_wire::pb;

/// What a completion being judged holds (see `prejudge`).
pub(crate) type JudgingSlots = (crate::slots::Slot<Id>, crate::slots::Slot<AgentKey>);

/// A lifecycle command through the writer; a completion is judged first,
/// off the writer (`prejudge`), and again if the writer finds the judgment
/// stale, at most `MAX_JUDGMENT_ATTEMPTS` times.
pub(crate) async fn transition<B: Backend>(
    store: &B,
    command: LifecycleCommand,
) -> Result<Answer, StoreError> {
    let LifecycleCommand {
        request,
        contract_id,
        action,
    } = command;
    let Action::Complete(mut args) = action else {
        return store
            .sql()
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
        match store
            .sql()
            .submit(Command::Lifecycle(Box::new(command)))
            .await
        {
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
async fn prejudge<B: Backend>(
    store: &B,
    contract_id: &Id,
    signer: Option<&AgentKey>,
    mut args: Box<CompleteArgs>,
    slots: &mut Option<JudgingSlots>,
) -> Result<Box<CompleteArgs>, StoreError> {
    let sql = store.sql();
    let received_at_ms = *args.received_at_ms.get_or_insert(sql.clock.now_ms());
    args.prejudged = None;
    let Some(signer) = signer else {
        return Ok(args);
    };
    let mut conn = sql.read().await?;
    let inputs = JudgeInputs::load::<B::Db>(&mut conn, contract_id, signer, received_at_ms).await?;
    drop(conn);
    let Some(inputs) = inputs else {
        return Ok(args);
    };
    // One judgment per contract, and a few per signer, at a time: a
    // delegate (and a host it controls) cannot keep every judge busy.
    // Taken only now that the signer is the contract's delegate, so a
    // stranger's requests never hold them.
    if slots.is_none() {
        let contract = sql.judging_contracts.take(*contract_id).map_err(|_| {
            StoreError::Unavailable {
                reason: pb::ErrorReason::JudgmentInProgress,
                detail: "another completion of this contract is being judged; retry with the same nonce once it is answered".into(),
            }
        })?;
        let signer = sql
            .judging_signers
            .take(*signer)
            .map_err(StoreError::Overloaded)?;
        *slots = Some((contract, signer));
    }
    let hook = sql.before_judge.clone();
    let job_args = args.clone();
    let share = crate::pool::Share {
        tenant: sql.tenants.of(&inputs.opener),
        key: *signer,
    };
    let judged = sql
        .judges
        .run(share, sql.judgment_deadline, move || {
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
                    MAX_WAITING_PER_TENANT
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

/// A contract's row and the delegate key of its tree's root (`opener`;
/// a root's own for a root, which is its own root).
const LOAD_WITH_OPENER: &str = concat!(
    "SELECT ",
    super::rows::contract_columns!(),
    ", (SELECT r.delegate_key FROM contracts r WHERE r.seq = c.root_seq) AS opener \
     FROM contracts_with_envelope c WHERE c.id = $1"
);

/// Everything judging a completion of one contract reads from the store,
/// loaded on a read connection.
pub struct JudgeInputs {
    /// The key that opened the tree's root: its tenant's share of the
    /// judges is what the judgment takes.
    pub opener: AgentKey,
    observations: i64,
    effective_predicate: String,
    write_scope: Scope,
    result_schema_json: String,
    observed: judge::Observed,
}

impl JudgeInputs {
    /// Loads the inputs for judging `signer`'s completion of `id`, received
    /// at `received_at_ms`; `None` unless the contract exists, is accepted, is
    /// not overdue and `signer` is its delegate — anything else the writer
    /// refuses without judging, so nobody else can make the broker judge.
    pub(crate) async fn load<D: Dialect>(
        conn: &mut D::Connection,
        id: &Id,
        signer: &AgentKey,
        received_at_ms: i64,
    ) -> Result<Option<Self>, StoreError> {
        // The contract and its root's opener in one read: each read is a
        // round trip to the connection's thread.
        let Some(row) = sqlx::query::<D>(LOAD_WITH_OPENER)
            .arg(id.as_slice())
            .optional(&mut *conn)
            .await
            .map_err(backend)?
        else {
            return Ok(None);
        };
        let target = super::lifecycle::row_from(&row).map_err(backend)?;
        if !lifecycle::judgment_due(&target.facts(None), signer, received_at_ms) {
            return Ok(None);
        }
        let opener = super::rows::id_column::<D>(&row, "opener")?;
        let observed = observed::<D>(conn, &target, received_at_ms).await?;
        Ok(Some(Self {
            opener,
            observations: target.observations,
            effective_predicate: target.effective_predicate,
            write_scope: target.write_scope,
            result_schema_json: target.contract.result_schema_json,
            observed,
        }))
    }

    /// Judges `args` (CPU only: run it off the async workers).
    pub fn judge(&self, args: &CompleteArgs) -> PreJudged {
        PreJudged {
            observations: self.observations,
            judgment: judge_completion(
                &self.effective_predicate,
                &self.write_scope,
                &self.result_schema_json,
                args,
                &self.observed,
            ),
        }
    }
}

/// The one place a completion is judged, before or on the writer.
fn judge_completion(
    effective_predicate: &str,
    write_scope: &Scope,
    result_schema_json: &str,
    args: &CompleteArgs,
    observed: &judge::Observed,
) -> judge::Judgment {
    // The schema compiled at issuance; one that no longer parses cannot
    // vouch for the output (the judge reports it as not valid).
    let schema: Option<serde_json::Value> = if result_schema_json.is_empty() {
        None
    } else {
        serde_json::from_str(result_schema_json).ok()
    };
    let completion = judge::Completion {
        output: args.output.clone(),
        claim: args.claim.clone(),
        reported_consumed: args.reported_consumed,
        has_report: args.has_report,
        schema: schema.as_ref(),
    };
    judge::judge(effective_predicate, write_scope, &completion, observed)
}

/// What the host recorded for `target`, as the judge reads it.
async fn observed<D: Dialect>(
    conn: &mut D::Connection,
    target: &Loaded,
    now_ms: i64,
) -> Result<judge::Observed, StoreError> {
    let mut tool_calls = 0;
    let mut mutation_paths = Vec::new();
    // The row counts what the host recorded: none recorded, nothing to read.
    let rows = if target.observations == 0 {
        Vec::new()
    } else {
        super::audit::observations_of::<D>(conn, target.seq).await?
    };
    for (kind, path) in rows {
        if kind == pb::ObservationKind::ToolCall as i32 {
            tool_calls += 1;
        } else if kind == pb::ObservationKind::Mutation as i32 {
            mutation_paths.push(path);
        }
    }
    Ok(judge::Observed {
        tool_calls,
        mutation_paths,
        consumed_by_host: target.metered.then_some(target.observed_units),
        elapsed_ms: now_ms.saturating_sub(target.issued_at_ms),
    })
}
