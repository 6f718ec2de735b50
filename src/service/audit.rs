//! Audits composed from stored facts by the core's classification
//! (docs/design.md, seed 000): the store hands over what it holds, `core::audit` decides
//! what it means. Reading an audit never changes anything. GetAudit and
//! AggregateAudits run a few at a time, in turn among tenants.

use std::collections::{BTreeMap, HashMap};

use tonic::Request;

use super::BrokerService;
use super::error::ServiceError;
use crate::core::audit::{self, Audit, AuditInput, FactKind, ObservedFact, RunTotals};
use crate::core::{Id, Scope};
use crate::pb;
use crate::store::{AuditFacts, Store};

pub use crate::core::limits::MAX_AGGREGATE_RUNS;

fn classify(facts: &AuditFacts) -> (Audit, audit::NamedPaths) {
    let named = audit::named_paths(&facts.task);
    let scope = Scope::from_trusted(facts.write_scope.clone());
    let observations: Vec<ObservedFact> = facts
        .observations
        .iter()
        .filter_map(|(kind, path)| {
            let kind = match pb::ObservationKind::try_from(*kind).ok()? {
                pb::ObservationKind::ToolCall => FactKind::ToolCall,
                pb::ObservationKind::Read => FactKind::Read,
                pb::ObservationKind::Mutation => FactKind::Mutation,
                pb::ObservationKind::Unspecified => return None,
            };
            Some(ObservedFact {
                kind,
                path: path.clone(),
            })
        })
        .collect();
    let audit = audit::classify(AuditInput {
        depth: facts.depth,
        named: &named,
        write_scope: &scope,
        observations: &observations,
        has_report: facts.has_report,
        downgrades: facts.downgrades,
    });
    (audit, named)
}

/// Mutated paths per contract, for `audit::conflicts`.
fn by_contract(mutations: &[(Id, String)]) -> Vec<(Id, Vec<String>)> {
    let mut grouped: BTreeMap<Id, Vec<String>> = BTreeMap::new();
    for (id, path) in mutations {
        grouped.entry(*id).or_default().push(path.clone());
    }
    grouped.into_iter().collect()
}

pub use crate::core::limits::MAX_AUDIT_PATHS_REPORTED;
pub use crate::core::limits::MAX_CONFLICT_CONTRACTS_REPORTED;

pub fn contract_audit(facts: &AuditFacts, tree_mutations: &[(Id, String)]) -> pb::ContractAudit {
    let (audit, named) = classify(facts);
    let mine: Vec<_> = audit::conflicts(&by_contract(tree_mutations))
        .into_iter()
        .filter(|c| c.contracts.contains(&facts.id))
        .collect();
    let conflict_count = u32::try_from(mine.len()).unwrap_or(u32::MAX);
    let conflicts = mine
        .into_iter()
        .take(MAX_AUDIT_PATHS_REPORTED)
        .map(|c| pb::AuditConflict {
            path: c.path,
            other_contract_ids: c
                .contracts
                .into_iter()
                .filter(|id| *id != facts.id)
                .take(MAX_CONFLICT_CONTRACTS_REPORTED)
                .map(|id| id.to_vec())
                .collect(),
        })
        .collect();
    let mutation_path_count = u32::try_from(audit.mutation_paths.len()).unwrap_or(u32::MAX);
    pb::ContractAudit {
        contract_id: facts.id.to_vec(),
        depth: audit.depth,
        tool_calls: audit.tool_calls,
        mutations: audit.mutations,
        mutation_paths: audit
            .mutation_paths
            .iter()
            .take(MAX_AUDIT_PATHS_REPORTED)
            .cloned()
            .collect(),
        mutation_path_count,
        conflict_count,
        claim_violations: audit.claim_violations,
        completed: facts.completed,
        has_report: audit.has_report.unwrap_or(false),
        downgrades: audit.downgrades,
        parent_scope_hints: audit.parent_scope_hints,
        parent_named_files: audit.parent_named_files,
        evidence_paths: u32::try_from(audit.evidence_paths).unwrap_or(u32::MAX),
        discovered_paths: u32::try_from(audit.discovered_paths).unwrap_or(u32::MAX),
        false_completion: audit.false_completion,
        conflicts,
        verdict: facts.verdict,
        claim: facts.claim.clone(),
        named_scope_hints: named.scope_hints,
        named_files: named.files,
        delegate_identity: facts.delegate_identity.clone(),
    }
}

/// One run's totals from its stored facts.
pub fn run_totals(run: &crate::store::RunFacts, tree_mutations: &[(Id, String)]) -> RunTotals {
    let mut totals = RunTotals {
        labels: run.labels.clone(),
        orchestrator: run.orchestrator.clone(),
        sums: audit::Sums {
            escalations: run.escalations,
            ..audit::Sums::default()
        },
        budget_spent: run.spent,
        budget_granted: run.budget,
    };
    for facts in &run.contracts {
        totals.add_audit(&classify(facts).0);
    }
    totals.sums.conflicts = audit::conflicts(&by_contract(tree_mutations)).len() as u64;
    for code in &run.refusal_codes {
        let name = pb::InvariantCode::try_from(*code)
            .map(|c| {
                c.as_str_name()
                    .trim_start_matches("INVARIANT_CODE_")
                    .to_owned()
            })
            .unwrap_or_else(|_| format!("CODE_{code}"));
        *totals.sums.refusals_by_code.entry(name).or_default() += 1;
    }
    totals
}

pub fn groups(runs: &[RunTotals], group_by: &[String]) -> Vec<pb::AuditGroup> {
    let narrow = |v: i128| i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX });
    audit::aggregate(runs, group_by)
        .into_iter()
        .map(|g| pb::AuditGroup {
            key: g.key.into_iter().collect::<HashMap<_, _>>(),
            runs: g.runs,
            contracts: g.sums.contracts,
            discovered_paths: g.sums.discovered,
            evidence_paths: g.sums.evidence,
            discovery_rate: g.discovery_rate,
            with_report: g.sums.contracts_with_report,
            false_completions: g.sums.false_completions,
            false_completion_rate: g.false_completion_rate,
            claim_violations: g.sums.claim_violations,
            mutations: g.sums.mutations,
            claim_violations_per_mutation: g.claim_violations_per_mutation,
            conflicts: g.sums.conflicts,
            escalations: g.sums.escalations,
            refusals_by_code: g.sums.refusals_by_code.into_iter().collect(),
            budget_spent: narrow(g.budget_spent),
            budget_granted: narrow(g.budget_granted),
            spent_over_granted: g.spent_over_granted,
        })
        .collect()
}

/// Validates the request and returns (selector, group-by keys).
pub fn parse_request(
    request: &pb::AggregateAuditsRequest,
) -> Result<(BTreeMap<String, String>, Vec<String>), ServiceError> {
    let selector = crate::core::labels(&request.selector, "selector")?;
    let group_by = audit::check_group_by(&request.group_by, "group_by")?;
    Ok((selector, group_by))
}

impl<S: Store> BrokerService<S> {
    /// A place among the audits running at once, in turn among tenants
    /// (then keys), waiting at most `limits.audit_wait_ms`.
    pub(super) async fn audit_turn(
        &self,
        tenant: crate::core::AgentKey,
        caller: crate::core::AgentKey,
    ) -> Result<crate::pool::Turn, ServiceError> {
        let wait = std::time::Duration::from_millis(self.config.limits.audit_wait_ms);
        let share = crate::pool::Share {
            tenant,
            key: caller,
        };
        self.audit_turns
            .acquire(share, wait)
            .await
            .map_err(|e| match e {
                crate::pool::PoolError::TimedOut(_) => {
                    ServiceError::Overloaded(crate::config::keys::audit_wait_ms)
                }
                crate::pool::PoolError::Full => {
                    ServiceError::Overloaded(crate::config::keys::max_concurrent_audits)
                }
                other => ServiceError::Internal(format!("an audit's turn: {other}")),
            })
    }

    pub(super) async fn get_audit(
        &self,
        request: Request<pb::GetAuditRequest>,
    ) -> Result<pb::GetAuditResponse, ServiceError> {
        let caller = self.caller(&request)?;
        // Audits take their own turns (`audit_turn`): admission's place is
        // handed back once the caller is authorized.
        let (id, _) = self
            .authorize_read(&request, &request.get_ref().contract_id, "contract_id")
            .await?;
        let _slot = self.audits.take(caller).map_err(ServiceError::Overloaded)?;
        let tenant = self.tenant_of(id).await?;
        let _turn = self.audit_turn(tenant, caller).await?;
        let (facts, mutations) = self
            .store
            .audit_facts(id)
            .await?
            .ok_or_else(|| ServiceError::not_found(crate::store::Entity::Contract, id))?;
        // Classifying a tree's mutations is CPU work: off the async workers.
        let audit = tokio::task::spawn_blocking(move || contract_audit(&facts, &mutations))
            .await
            .map_err(|e| ServiceError::Internal(format!("an audit failed: {e}")))?;
        Ok(pb::GetAuditResponse { audit: Some(audit) })
    }

    pub(super) async fn aggregate_audits(
        &self,
        request: Request<pb::AggregateAuditsRequest>,
    ) -> Result<pb::AggregateAuditsResponse, ServiceError> {
        let caller = self.caller(&request)?;
        // A configured reader sees every run; anyone else the runs whose
        // root it opened.
        let orchestrator = (!self.reads_everything(&caller).await?).then_some(caller);
        let (selector, group_by) = parse_request(&request.into_inner())?;
        let _slot = self.audits.take(caller).map_err(ServiceError::Overloaded)?;
        // The runs it reads are the caller's own (or, for a reader, all);
        // its turn is its tenant's, so free keys share the open one.
        let _turn = self
            .audit_turn(self.config.tenants.of(&caller), caller)
            .await?;
        let runs = self
            .store
            .runs(orchestrator, &selector, MAX_AGGREGATE_RUNS)
            .await?;
        // Classifying thousands of contracts is CPU work (1.9 s for a
        // 4,000-contract tree): off the async workers.
        let groups = tokio::task::spawn_blocking(move || {
            let totals: Vec<_> = runs
                .iter()
                .map(|(run, mutations)| run_totals(run, mutations))
                .collect();
            groups(&totals, &group_by)
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("an aggregate failed: {e}")))?;
        Ok(pb::AggregateAuditsResponse { groups })
    }
}
