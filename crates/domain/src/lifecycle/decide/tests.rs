//! `decide` without a database: every action against every status, who
//! may act, expiry on access, and whole trees driven by random commands.

use proptest::prelude::*;

use super::*;
use crate::judge::Judgment;
use crate::limits::MAX_STALE_JUDGMENTS;

const T0: i64 = 1_000_000;
const PRINCIPAL: AgentKey = [1; 32];
const DELEGATE: AgentKey = [2; 32];
const HOST: AgentKey = [3; 32];
const STRANGER: AgentKey = [9; 32];

/// A delegate key no fixed key above collides with.
fn agent(n: u8) -> AgentKey {
    let mut key = [0xAA; 32];
    key[0] = n;
    key
}

fn facts(id: u8, parent: Option<usize>, delegate: AgentKey, budget: i64) -> Facts {
    Facts {
        id: [id; 32],
        parent,
        status: Status::Open,
        ledger: Ledger::new(budget),
        deadline_ms: T0 + 60_000,
        issued_at_ms: T0 - 1_000,
        delegate_key: delegate,
        host_key: None,
        host_named_at_delegate: false,
        verdict: None,
        observations: 0,
        stale_judgments: 0,
        observed_units: 0,
        metered: false,
        metered_uncharged: 0,
        depth: parent.map_or(0, |_| 1),
        min_retry_cost: 12,
        min_retry_latency_ms: 15_000,
    }
}

/// A parent (held by PRINCIPAL, 25 units) with one child of 13 units held
/// by DELEGATE in `status`, hosted by HOST.
fn pair(status: Status) -> Subtree {
    let mut parent = facts(1, None, PRINCIPAL, 25);
    let mut child = facts(2, Some(0), DELEGATE, 13);
    child.status = status;
    child.host_key = Some(HOST);
    if status.is_open() {
        parent.ledger.reserve(13).unwrap();
    } else {
        parent.ledger.spent = 13;
    }
    if status == Status::Completed {
        child.verdict = Some(Verdict::PendingPrincipal);
    }
    Subtree {
        rows: vec![parent, child],
        target: 1,
        lineage: vec![([1; 32], PRINCIPAL), ([2; 32], DELEGATE)],
        ending: Ending::None,
    }
}

fn judgment(consumed: i64) -> Judgment {
    Judgment {
        verdict: Verdict::Accepted,
        refused: Vec::new(),
        schema_valid: true,
        schema_errors: Vec::new(),
        within_scope: true,
        out_of_scope_paths: Vec::new(),
        out_of_scope_path_count: 0,
        consumed,
        reported_consumed: consumed,
    }
}

fn complete_facts(j: &Judgment, seen: i64) -> CompleteFacts<'_> {
    CompleteFacts {
        judgment: Some((j, seen)),
        received_at_ms: T0,
        claim: "done",
        has_report: true,
        result_digest: [7; 32],
    }
}

/// Each action with the signer entitled to ask it of `pair`'s child.
fn entitled<'a>(j: &'a Judgment) -> Vec<(&'static str, AgentKey, Action<'a>)> {
    vec![
        ("accept", DELEGATE, Action::Accept { host: None }),
        ("decline", DELEGATE, Action::Decline { reason: "no" }),
        ("escalate", DELEGATE, Action::Escalate { reason: "stuck" }),
        ("revoke", PRINCIPAL, Action::Revoke { reason: "stop" }),
        ("record", HOST, Action::Record { count: 1, units: 2 }),
        ("complete", DELEGATE, Action::Complete(complete_facts(j, 0))),
        (
            "adjudicate",
            PRINCIPAL,
            Action::Adjudicate {
                verdict: Verdict::Accepted,
                reason: "fine",
            },
        ),
    ]
}

/// HOST records `count` observations of `units` on `s`'s target.
fn host_records(s: &Subtree, count: usize, units: i64) -> Decision {
    decide(s, Some(&HOST), &Action::Record { count, units }, T0)
}

/// DELEGATE completes `s`'s target with `j`, judged on `seen` observations.
fn delegate_completes(s: &Subtree, j: &Judgment, seen: i64) -> Decision {
    decide(
        s,
        Some(&DELEGATE),
        &Action::Complete(complete_facts(j, seen)),
        T0,
    )
}

/// DELEGATE accepts `s`'s target naming `host`.
fn delegate_accepts(s: &Subtree, host: AgentKey) -> Decision {
    decide(s, Some(&DELEGATE), &Action::Accept { host: Some(host) }, T0)
}

/// Writes `write` into the target's facts, as a store would.
fn write_target(t: &mut Facts, write: &TargetWrite) {
    match write {
        TargetWrite::None => {}
        TargetWrite::Host(h) => t.host_key = *h,
        TargetWrite::Observations {
            total,
            observed_units,
            metered,
            metered_uncharged,
        } => {
            t.observations = *total;
            t.observed_units = *observed_units;
            t.metered = *metered;
            t.metered_uncharged = *metered_uncharged;
        }
        TargetWrite::Judged { verdict, .. } | TargetWrite::Verdict(verdict) => {
            t.verdict = Some(*verdict)
        }
        TargetWrite::StaleJudgment => t.stale_judgments += 1,
    }
}

fn not_allowed(from: Status, event: Event) -> Refused {
    Refused::Lifecycle(LifecycleError::NotAllowed { from, event })
}

#[test]
fn every_action_against_every_status() {
    use Status::*;
    let j = judgment(4);
    for status in Status::ALL {
        for (name, signer, action) in entitled(&j) {
            let d = decide(&pair(status), Some(&signer), &action, T0);
            let expected: Result<(), Refused> = match (name, status) {
                ("accept" | "decline", Open) => Ok(()),
                ("accept", s) => Err(not_allowed(s, Event::Accept)),
                ("decline", s) => Err(not_allowed(s, Event::Decline)),
                ("escalate", Accepted) => Ok(()),
                ("escalate", s) => Err(not_allowed(s, Event::Escalate)),
                ("revoke", Open | Accepted) => Ok(()),
                ("revoke", s) => Err(not_allowed(s, Event::Revoke)),
                ("record", Open | Accepted) => Ok(()),
                ("record", s) => Err(Refused::Ended(s)),
                ("complete", Accepted) => Ok(()),
                ("complete", s) => Err(not_allowed(s, Event::Complete)),
                ("adjudicate", Completed) => Ok(()),
                ("adjudicate", _) => Err(Refused::NotPending),
                _ => unreachable!(),
            };
            match (&d.answer, expected) {
                (Ok(i), Ok(())) => assert!(d.receipts[*i].answers_request, "{name} {status:?}"),
                (Err(got), Err(want)) => {
                    assert_eq!(got, &want, "{name} {status:?}");
                    assert_eq!(d, Decision::refused(want), "a refusal writes nothing");
                }
                (got, want) => panic!("{name} on {status:?}: {got:?}, expected {want:?}"),
            }
        }
        let d = decide(&pair(status), None, &Action::Expire, T0);
        assert_eq!(d.answer, Err(Refused::NotOverdue), "{status:?}");
    }
}

#[test]
fn only_the_entitled_key_may_act() {
    let j = judgment(4);
    for status in [Status::Open, Status::Accepted, Status::Completed] {
        for (name, signer, action) in entitled(&j) {
            for other in [PRINCIPAL, DELEGATE, HOST, STRANGER] {
                if other == signer || (name == "revoke" && other == PRINCIPAL) {
                    continue;
                }
                let d = decide(&pair(status), Some(&other), &action, T0);
                let want = match name {
                    "accept" => Refused::NotDelegate("accept it"),
                    "decline" | "escalate" => Refused::NotDelegate("do this"),
                    "complete" => Refused::NotDelegate("complete it"),
                    "revoke" => Refused::NotAncestor,
                    "record" => Refused::NotHost,
                    "adjudicate" => Refused::NotPrincipal,
                    _ => unreachable!(),
                };
                assert_eq!(d, Decision::refused(want), "{name} by {other:?}");
            }
            // Without a signer (the broker itself) nobody is entitled.
            assert!(decide(&pair(status), None, &action, T0).answer.is_err());
        }
    }
}

#[test]
fn a_root_is_revoked_by_its_opener_and_has_nobody_to_return_it_to() {
    let root = Subtree {
        rows: vec![facts(1, None, PRINCIPAL, 10)],
        target: 0,
        lineage: vec![([1; 32], PRINCIPAL)],
        ending: Ending::None,
    };
    let d = decide(
        &root,
        Some(&PRINCIPAL),
        &Action::Decline { reason: "x" },
        T0,
    );
    assert_eq!(d.answer, Err(Refused::Root));
    let d = decide(&root, Some(&PRINCIPAL), &Action::Revoke { reason: "x" }, T0);
    assert_eq!(d.answer, Ok(0));
    assert_eq!(d.updates[0].status, Status::Revoked);
}

#[test]
fn the_host_is_never_the_delegate_and_never_changes() {
    let mut s = pair(Status::Open);
    s.rows[1].host_key = None;
    let d = delegate_accepts(&s, DELEGATE);
    assert!(matches!(d.answer, Err(Refused::Invalid(ref e)) if e.field == "body.host_public_key"));
    assert_eq!(
        delegate_accepts(&s, HOST).write,
        TargetWrite::Host(Some(HOST))
    );
    let s = pair(Status::Open);
    assert_eq!(
        delegate_accepts(&s, STRANGER).answer,
        Err(Refused::HostMismatch)
    );
    assert_eq!(
        delegate_accepts(&s, HOST).write,
        TargetWrite::Host(Some(HOST))
    );
    assert!(check_host(&DELEGATE, &DELEGATE).is_err());
    assert!(check_host(&DELEGATE, &HOST).is_ok());
}

#[test]
fn an_overdue_contract_expires_on_access_except_for_revocation() {
    let late = T0 + 60_000;
    let j = judgment(1);
    for (name, signer, action) in entitled(&j) {
        let d = decide(&pair(Status::Accepted), Some(&signer), &action, late);
        if name == "revoke" {
            assert_eq!(d.answer, Ok(0));
            continue;
        }
        assert_eq!(
            d.answer,
            Err(Refused::Expired { deadline_ms: late }),
            "{name}"
        );
        // The expiry is written and receipted, unbound to the request.
        assert_eq!(d.receipts.len(), 1);
        assert!(!d.receipts[0].answers_request);
        assert_eq!(d.receipts[0].body.ends(), Some(Status::Expired));
        assert_eq!(d.updates.len(), 2, "the child and its parent's ledger");
    }
    let d = decide(&pair(Status::Open), None, &Action::Expire, late);
    assert_eq!(d.answer, Ok(0));
}

#[test]
fn a_stale_judgment_goes_back_to_be_judged_again() {
    let j = judgment(3);
    let mut s = pair(Status::Accepted);
    s.rows[1].observations = 2;
    let d = delegate_completes(&s, &j, 1);
    assert_eq!(d.answer, Err(Refused::StaleJudgment));
    assert_eq!(d.write, TargetWrite::StaleJudgment, "counted");
    assert!(d.updates.is_empty() && d.receipts.is_empty());
    let mut unjudged = complete_facts(&j, 2);
    unjudged.judgment = None;
    let d = decide(&s, Some(&DELEGATE), &Action::Complete(unjudged), T0);
    assert_eq!(d.answer, Err(Refused::StaleJudgment));
    let d = delegate_completes(&s, &j, 2);
    let Some(ReceiptBody::Completed(c)) = d.receipts.last().map(|r| &r.body) else {
        panic!("{d:?}");
    };
    assert_eq!((c.consumed, c.returned, c.elapsed_ms), (3, 10, 1_000));
    assert_eq!(c.chain, vec![[1; 32], [2; 32]]);
    assert!(judgment_due(&s.rows[1], &DELEGATE, T0));
    assert!(!judgment_due(&s.rows[1], &HOST, T0));
    assert!(!judgment_due(&s.rows[1], &DELEGATE, T0 + 60_000));
    assert!(
        !judgment_due(&pair(Status::Open).rows[1], &DELEGATE, T0),
        "a Complete before Accept is refused without taking a judge"
    );
}

/// The completion receipt's facts of `pair(Accepted)`'s child completed
/// with `judgment`, after the host metered `metered` units.
fn completed_after_metering(
    metered: i64,
    host_named_at_delegate: bool,
    j: &Judgment,
) -> CompletedFacts {
    let mut s = pair(Status::Accepted);
    s.rows[1].host_named_at_delegate = host_named_at_delegate;
    let mut observations = 0;
    if metered > 0 {
        let d = host_records(&s, 1, metered);
        assert_eq!(d.answer, Ok(0), "{d:?}");
        assert!(matches!(d.write, TargetWrite::Observations { .. }), "{d:?}");
        for u in &d.updates {
            s.rows[u.row].ledger = u.ledger;
        }
        write_target(&mut s.rows[1], &d.write);
        observations = s.rows[1].observations;
    }
    let d = delegate_completes(&s, j, observations);
    let Some(ReceiptBody::Completed(c)) = d.receipts.last().map(|r| r.body.clone()) else {
        panic!("{d:?}");
    };
    *c
}

#[test]
fn seed_000_a_claim_nobody_observed_stays_visible() {
    // The host metered 4, the delegate reported 11: 4 charged, 7 claimed
    // beyond the charge, whoever named the host.
    for named_at_delegate in [true, false] {
        let mut j = judgment(4);
        j.reported_consumed = 11;
        let c = completed_after_metering(4, named_at_delegate, &j);
        assert_eq!(
            (c.consumed, c.claimed_excess),
            (4, 7),
            "named at delegate: {named_at_delegate}"
        );
    }
    // Reported no more than metered: nothing claimed beyond the charge.
    let mut j = judgment(4);
    j.reported_consumed = 3;
    let c = completed_after_metering(4, true, &j);
    assert_eq!((c.consumed, c.claimed_excess), (4, 0));
    // A host the delegate chose metered 20 of a 13-unit contract: 13
    // charged, 7 beyond; the delegate's smaller report changes nothing.
    let mut j = judgment(20);
    j.reported_consumed = 5;
    let c = completed_after_metering(20, false, &j);
    assert_eq!((c.consumed, c.claimed_excess), (13, 7));
    // ... and a larger report is the claim: 30 - 13.
    j.reported_consumed = 30;
    let c = completed_after_metering(20, false, &j);
    assert_eq!((c.consumed, c.claimed_excess), (13, 17));
    // Unmetered: the report is charged up to the residual, the rest shown.
    let c = completed_after_metering(0, false, &judgment(20));
    assert_eq!((c.consumed, c.claimed_excess), (13, 7));
}

#[test]
fn seed_001_escalation_tells_the_principal_whether_a_retry_fits() {
    let mut s = pair(Status::Accepted);
    s.rows[0].deadline_ms = T0 + 60_000;
    s.rows[1].ledger.charge(2).unwrap();
    let d = decide(
        &s,
        Some(&DELEGATE),
        &Action::Escalate {
            reason: "ambiguous",
        },
        T0,
    );
    let Some(ReceiptBody::Escalated { notice, ended, .. }) = d.receipts.last().map(|r| &r.body)
    else {
        panic!("{d:?}");
    };
    assert_eq!((notice.residual, notice.retry_feasible), (23, true));
    assert_eq!(ended, &vec![[2; 32]]);
}

#[test]
fn metering_is_capped_and_charged_at_once() {
    let mut s = pair(Status::Accepted);
    s.rows[1].observations = MAX_OBSERVATIONS_PER_CONTRACT;
    assert_eq!(
        host_records(&s, 1, 0).answer,
        Err(Refused::TooManyObservations)
    );
    let mut s = pair(Status::Accepted);
    s.rows[1].observed_units = MAX_BUDGET_UNITS;
    assert_eq!(host_records(&s, 1, 1).answer, Err(Refused::MeteredLimit));
    // A delegate-named host is charged only up to the residual (13).
    let d = host_records(&pair(Status::Accepted), 2, 20);
    assert_eq!(d.updates[0].ledger.spent, 13);
    assert_eq!(
        d.write,
        TargetWrite::Observations {
            total: 2,
            observed_units: 20,
            metered: true,
            metered_uncharged: 7,
        }
    );
    let mut s = pair(Status::Accepted);
    s.rows[1].host_named_at_delegate = true;
    assert_eq!(host_records(&s, 2, 20).updates[0].ledger.spent, 20);
}

/// A whole tree in memory, as a store would hold it: `decide` sees only
/// the subtree a store would load.
#[derive(Clone, Debug)]
struct World {
    rows: Vec<Facts>,
    endings: Vec<u32>,
    consumed: i64,
}

impl World {
    fn delegate(&mut self, parent: usize, budget: i64, deadline_ms: i64, now_ms: i64) {
        let p = &self.rows[parent];
        let mut after = p.ledger;
        if !p.status.is_open() || now_ms >= p.deadline_ms || after.reserve(budget).is_err() {
            return;
        }
        let id = u8::try_from(self.rows.len()).unwrap_or(u8::MAX);
        let mut child = facts(id, Some(parent), agent(id), budget);
        child.deadline_ms = deadline_ms.min(p.deadline_ms);
        child.depth = p.depth + 1;
        child.host_key = Some(HOST);
        child.host_named_at_delegate = id % 2 == 0;
        self.rows[parent].ledger.reserve(budget).unwrap();
        self.rows.push(child);
        self.endings.push(0);
    }

    /// What a store loads for `target`: its parent, itself, its open
    /// descendants when the action needs them; lineage root first.
    fn load(&self, target: usize, descendants: bool) -> (Subtree, Vec<usize>) {
        let mut map = Vec::new();
        if let Some(p) = self.rows[target].parent {
            map.push(p);
        }
        map.push(target);
        let mut i = map.len() - 1;
        while descendants && i < map.len() {
            let at = map[i];
            for (c, row) in self.rows.iter().enumerate() {
                if row.parent == Some(at) && row.status.is_open() {
                    map.push(c);
                }
            }
            i += 1;
        }
        let rows = map
            .iter()
            .map(|&w| {
                let mut f = self.rows[w].clone();
                f.parent = f.parent.and_then(|p| map.iter().position(|&m| m == p));
                f
            })
            .collect();
        let mut lineage = Vec::new();
        let mut at = Some(target);
        while let Some(w) = at {
            lineage.push((self.rows[w].id, self.rows[w].delegate_key));
            at = self.rows[w].parent;
        }
        lineage.reverse();
        let index = map.iter().position(|&m| m == target).unwrap_or(0);
        (
            Subtree {
                rows,
                target: index,
                lineage,
                ending: Ending::None,
            },
            map,
        )
    }

    fn apply(&mut self, d: &Decision, map: &[usize], target: usize) {
        for u in &d.updates {
            let row = &mut self.rows[map[u.row]];
            row.status = u.status;
            row.ledger = u.ledger;
        }
        write_target(&mut self.rows[target], &d.write);
        for r in &d.receipts {
            if r.body.ends().is_some() {
                self.endings[map[r.row]] += 1;
            }
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let mut unsettled = 0;
        for (i, row) in self.rows.iter().enumerate() {
            let l = row.ledger;
            prop_assert_eq!(l.budget, l.residual() + l.reserved + l.spent, "row {}", i);
            let open: Vec<&Facts> = self
                .rows
                .iter()
                .filter(|c| c.parent == Some(i) && c.status.is_open())
                .collect();
            prop_assert_eq!(
                l.reserved,
                open.iter().map(|c| c.ledger.budget).sum::<i64>()
            );
            prop_assert_eq!(l.open_children as usize, open.len());
            // Ended exactly once, by exactly one receipt.
            let ends = u32::from(row.status.is_ended());
            prop_assert_eq!(self.endings[i], ends, "row {} ({:?})", i, row.status);
            if row.status.is_ended() {
                prop_assert_eq!(l.reserved, 0);
            }
            if row.parent.is_none() || row.status.is_open() {
                unsettled += l.spent;
            }
        }
        prop_assert_eq!(unsettled, self.consumed, "spent is not what was consumed");
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    Delegate(usize, i64, i64),
    Act(usize, u8, u8, i64),
    Tick(i64),
}

/// Each stale judgment is counted; past `MAX_STALE_JUDGMENTS` an
/// accepted contract takes no more observations, so the next judgment
/// holds and the re-judgment loop ends.
#[test]
fn a_host_that_keeps_judgments_stale_loses_its_pen() {
    let j = judgment(1);
    let mut subtree = pair(Status::Accepted);
    for n in 0..MAX_STALE_JUDGMENTS {
        subtree.rows[1].stale_judgments = n;
        let d = delegate_completes(&subtree, &j, subtree.rows[1].observations + 1);
        assert_eq!(d.answer, Err(Refused::StaleJudgment));
        assert_eq!(d.write, TargetWrite::StaleJudgment);
        assert_eq!(host_records(&subtree, 1, 0).answer, Ok(0));
    }
    subtree.rows[1].stale_judgments = MAX_STALE_JUDGMENTS;
    assert_eq!(
        host_records(&subtree, 1, 0).answer,
        Err(Refused::RecordingClosed)
    );
    let d = delegate_completes(&subtree, &j, subtree.rows[1].observations);
    assert_eq!(d.answer, Ok(0));
}

/// A drain step ends the contracts it is given children first, each
/// settling into its parent with the ledger's rules and getting the
/// `Cascaded` receipt that names the draining contract; the draining
/// contract itself only takes back what they held.
#[test]
fn a_drain_step_settles_children_first() {
    // Target (100) → a (40, spent 5) → b (10, spent 3): b is a leaf.
    let mut target = facts(1, None, PRINCIPAL, 100);
    let mut a = facts(2, Some(0), DELEGATE, 40);
    let mut b = facts(3, Some(1), agent(4), 10);
    target.ledger.reserve(40).unwrap();
    a.ledger.reserve(10).unwrap();
    a.ledger.charge(5).unwrap();
    b.ledger.charge(3).unwrap();
    b.status = Status::Accepted;
    let rows = vec![target, a, b];
    let d = drain_step(&rows, &[2, 1], [1; 32], Status::Revoked);
    assert_eq!(d.answer, Ok(0));
    let ended: Vec<_> = d.receipts.iter().map(|r| (r.row, r.body.clone())).collect();
    assert_eq!(
        ended,
        [
            (
                2,
                ReceiptBody::Cascaded {
                    id: [3; 32],
                    status: Status::Revoked,
                    cause: [1; 32]
                }
            ),
            (
                1,
                ReceiptBody::Cascaded {
                    id: [2; 32],
                    status: Status::Revoked,
                    cause: [1; 32]
                }
            ),
        ]
    );
    let update = |row: usize| *d.updates.iter().find(|u| u.row == row).unwrap();
    assert_eq!(update(1).status, Status::Revoked);
    assert_eq!(update(2).status, Status::Revoked);
    // The target: nothing reserved, a's 5 and b's 3 spent.
    let target = update(0).ledger;
    assert_eq!(
        (target.reserved, target.spent, target.open_children),
        (0, 8, 0)
    );
    assert_eq!(target.residual(), 92);
    // A parent before its open child, or the draining contract itself, is
    // not a step: nothing is decided.
    let bad = drain_step(&rows, &[1, 2], [1; 32], Status::Revoked);
    assert!(matches!(bad.answer, Err(Refused::Corrupt(_))), "{bad:?}");
    let bad = drain_step(&rows, &[0], [1; 32], Status::Revoked);
    assert!(matches!(bad.answer, Err(Refused::Corrupt(_))), "{bad:?}");
}

/// Under a draining ancestor every request is refused as ending (but the
/// broker's own expiry); a draining contract's own ending waits for its
/// descendants, and neither reads a descendant.
#[test]
fn a_drain_freezes_what_is_below_it() {
    let j = judgment(1);
    let mut frozen = pair(Status::Accepted);
    frozen.ending = Ending::Frozen {
        cause: [1; 32],
        status: Status::Revoked,
    };
    for (name, signer, action) in entitled(&j) {
        let d = decide(&frozen, Some(&signer), &action, T0);
        assert_eq!(
            d.answer,
            Err(Refused::AncestorEnding { cause: [1; 32] }),
            "{name}"
        );
        assert!(d.updates.is_empty() && d.receipts.is_empty(), "{name}");
        assert!(
            !needs_descendants(&frozen, Some(&signer), &action, T0),
            "{name}"
        );
    }
    // The broker's expiry of a frozen, overdue contract goes through.
    let late = T0 + 60_000;
    let d = decide(&frozen, None, &Action::Expire, late);
    assert_eq!(d.answer, Ok(0));
    assert!(needs_descendants(&frozen, None, &Action::Expire, late));
    let mut draining = pair(Status::Accepted);
    draining.ending = Ending::Draining;
    for (name, signer, action) in entitled(&j) {
        let d = decide(&draining, Some(&signer), &action, T0);
        assert_eq!(d.answer, Err(Refused::DescendantsEnding), "{name}");
        assert!(d.updates.is_empty() && d.receipts.is_empty(), "{name}");
        assert!(
            !needs_descendants(&draining, Some(&signer), &action, T0),
            "{name}"
        );
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..64, 1i64..60, 1i64..4_000).prop_map(|(p, b, d)| Op::Delegate(p, b, d)),
        6 => (0usize..64, 0u8..8, 0u8..8, 0i64..40).prop_map(|(t, a, s, u)| Op::Act(t, a, s, u)),
        1 => (1i64..400).prop_map(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Random command sequences keep
    /// budget = residual + reserved + spent on every node, every reserved
    /// unit backed by an open child, every unit consumed charged once, and
    /// never end a contract twice.
    #[test]
    fn random_commands_keep_the_ledger_and_end_each_contract_once(
        root_budget in 1i64..400,
        ops in proptest::collection::vec(op(), 0..100),
    ) {
        let mut now = T0;
        let mut root = facts(0, None, agent(0), root_budget);
        root.deadline_ms = T0 + 3_000;
        let mut w = World { rows: vec![root], endings: vec![0], consumed: 0 };
        for op in ops {
            match op {
                Op::Delegate(p, b, d) => {
                    let p = p % w.rows.len();
                    w.delegate(p, b, now + d, now);
                }
                Op::Tick(dt) => now += dt,
                Op::Act(t, a, s, units) => {
                    let target = t % w.rows.len();
                    let row = &w.rows[target];
                    let principal = row.parent.map_or(row.delegate_key, |p| w.rows[p].delegate_key);
                    // Mostly the entitled signer, sometimes anyone.
                    let signer = match s {
                        0..=4 => match a {
                            3 | 6 => principal,
                            4 => HOST,
                            _ => row.delegate_key,
                        },
                        5 => HOST,
                        6 => principal,
                        _ => STRANGER,
                    };
                    let j = judgment(units);
                    let action = match a {
                        0 => Action::Accept { host: None },
                        1 => Action::Decline { reason: "" },
                        2 => Action::Escalate { reason: "" },
                        3 => Action::Revoke { reason: "" },
                        4 => Action::Record { count: 1, units },
                        5 => Action::Complete(complete_facts(&j, row.observations)),
                        6 => Action::Adjudicate { verdict: Verdict::Rejected, reason: "" },
                        _ => Action::Expire,
                    };
                    let before = w.clone();
                    // As a store loads: without the descendants unless
                    // `needs_descendants` says the decision reads them —
                    // and then deciding without them must change nothing.
                    let (partial, _) = w.load(target, false);
                    let needs = needs_descendants(&partial, Some(&signer), &action, now);
                    let (subtree, map) = w.load(target, true);
                    let d = decide(&subtree, Some(&signer), &action, now);
                    if !needs {
                        prop_assert_eq!(
                            &decide(&partial, Some(&signer), &action, now),
                            &d,
                            "decided without the descendants it reads"
                        );
                    }
                    w.apply(&d, &map, target);
                    // Consumption charged: the target's own spent growth
                    // (metering, or its report at completion).
                    let own_before = before.rows[target].ledger.spent;
                    let own_after = w.rows[target].ledger.spent;
                    if let Ok(i) = d.answer {
                        if let ReceiptBody::Completed(c) = &d.receipts[i].body {
                            w.consumed += if w.rows[target].metered { 0 } else { c.consumed };
                        } else if matches!(d.receipts[i].body, ReceiptBody::Observed { .. }) {
                            w.consumed += own_after - own_before;
                        }
                    }
                    match &d.answer {
                        Ok(_) | Err(Refused::Expired { .. }) => {}
                        Err(why) => prop_assert_eq!(&d, &Decision::refused(why.clone()), "a refusal wrote something"),
                    }
                }
            }
            w.check()?;
        }
    }
}
