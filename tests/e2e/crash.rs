//! Crash safety: the broker binary is SIGKILLed in the middle of a burst of
//! concurrent delegations and restarted on the same data directory. Every
//! contract a client got an answer for must be there, and every ledger must
//! balance.

use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_client::Agent;
use delegation_broker::pb;

use crate::harness::*;

/// A broker process, killed when dropped: also when a test panics, so a
/// failed test leaves no broker behind (one left running reconnects to its
/// dropped database and steals CPU from whatever runs next).
pub struct Killed(pub Child);

impl Killed {
    /// Spawns `command` with its stdout piped and reads it until it has
    /// printed `{what} on ADDR` for each of `whats`; the process and each
    /// ADDR by its `what`.
    pub fn announcing_all(
        command: &mut std::process::Command,
        whats: &[&str],
    ) -> (Killed, std::collections::HashMap<String, String>) {
        use std::io::BufRead as _;
        let mut child = command
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = std::collections::HashMap::new();
        while whats.iter().any(|w| !seen.contains_key(*w)) {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("the process printed only {seen:?} of {whats:?}"))
                .unwrap();
            if let Some(w) = whats.iter().find(|w| line.starts_with(&format!("{w} on "))) {
                seen.insert((*w).to_owned(), line[w.len() + 4..].trim().to_owned());
            }
        }
        (Killed(child), seen)
    }

    /// `announcing_all` of one `what`; the process and `http://ADDR`.
    pub fn announcing(command: &mut std::process::Command, what: &str) -> (Killed, String) {
        let (process, seen) = Self::announcing_all(command, &[what]);
        (process, format!("http://{}", seen[what]))
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `delegation-broker serve` on port 0 (on `database` when given:
/// a PostgreSQL URL) and returns it with its address.
pub fn spawn_broker(data_dir: &std::path::Path, database: Option<&str>) -> (Killed, String) {
    match database {
        Some(url) => crate::operations::spawn_serve(data_dir, &["--database-url", url]),
        None => crate::operations::spawn_serve(data_dir, &[]),
    }
}

/// What a killed broker restarts on: a fresh data directory and, when
/// the run is on PostgreSQL, a fresh database (dropped last).
struct BrokerData {
    dir: tempfile::TempDir,
    database: Option<delegation_broker::store::postgres::testing::TestDatabase>,
}

impl BrokerData {
    async fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            database: database_of_this_run().await,
        }
    }

    /// A broker process on this data.
    fn spawn(&self) -> (Killed, String) {
        spawn_broker(
            self.dir.path(),
            self.database.as_ref().map(|d| d.url.as_str()),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_burst_loses_no_answered_contract() {
    let data = BrokerData::new().await;
    let (mut process, addr) = data.spawn();
    let mut client = connect(&addr).await;
    let orchestrator = Arc::new(Agent::generate());
    let spec = RootSpec::for_bursts();
    let root_id = open_root_on(&mut client, &orchestrator, &spec)
        .await
        .contract_id;
    let lineage = spec.lineage();

    let answered: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    // The first answered request and its contract id, to retry after restart.
    type Answered = Option<(pb::DelegateRequest, Vec<u8>)>;
    let first_request: Arc<Mutex<Answered>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let mut client = connect(&addr).await;
        let (orchestrator, answered, first) = (
            orchestrator.clone(),
            answered.clone(),
            first_request.clone(),
        );
        let (root_id, lineage) = (root_id.clone(), lineage.clone());
        tasks.push(tokio::spawn(async move {
            let worker = Agent::generate();
            loop {
                let request = orchestrator.delegate(child(&root_id, &lineage, &worker, 100));
                let Ok(response) = client.delegate(request.clone()).await else {
                    return;
                };
                let Some(pb::delegate_response::Outcome::Issued(issued)) =
                    response.into_inner().outcome
                else {
                    return;
                };
                answered.lock().unwrap().push(issued.contract_id.clone());
                first
                    .lock()
                    .unwrap()
                    .get_or_insert((request, issued.contract_id.clone()));
                let grandchild =
                    worker.delegate(child(&issued.contract_id, &lineage, &Agent::generate(), 10));
                let Ok(response) = client.delegate(grandchild).await else {
                    return;
                };
                if let Some(pb::delegate_response::Outcome::Issued(issued)) =
                    response.into_inner().outcome
                {
                    answered.lock().unwrap().push(issued.contract_id);
                }
            }
        }));
    }
    // Kill mid-burst, once a good number of answers are out.
    while answered.lock().unwrap().len() < 300 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    process.0.kill().unwrap(); // SIGKILL
    process.0.wait().unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    let answered = answered.lock().unwrap().clone();
    assert!(answered.len() >= 300);

    let (mut process, addr) = data.spawn();
    let mut broker_client = connect_as(&addr, &orchestrator).await;
    assert_stored(&mut broker_client, &answered).await;
    // A retry of an answered request after the restart gets the same answer.
    let (request, id) = first_request.lock().unwrap().clone().unwrap();
    let replay = broker_client.delegate(request).await;
    match replay {
        Ok(r) => {
            let r = r.into_inner();
            assert!(r.replayed);
            assert!(
                matches!(r.outcome, Some(pb::delegate_response::Outcome::Issued(i)) if i.contract_id == id)
            );
        }
        // Signed before the restart: fine to be stale only if the window passed.
        Err(e) => panic!("replay after restart failed: {e}"),
    }
    let mut checker = LedgerCheck {
        client: broker_client,
    };
    assert!(checker.assert_balanced(&root_id).await > 300);
    process.0.kill().unwrap();
    process.0.wait().unwrap();
}

pub struct LedgerCheck {
    pub client: broker_client::SessionClient,
}

impl LedgerCheck {
    /// budget = residual + reserved + spent everywhere; reserved = the sum
    /// of the children's budgets. Returns how many contracts the tree has.
    pub async fn assert_balanced(&mut self, root: &[u8]) -> usize {
        let mut queue = vec![root.to_vec()];
        let mut seen = 0;
        while let Some(id) = queue.pop() {
            let state = state_via(&mut self.client, &id).await;
            let ledger = state.ledger.unwrap();
            assert_eq!(
                ledger.budget,
                ledger.residual + ledger.reserved + ledger.spent
            );
            let mut token = Vec::new();
            let mut children_budget = 0;
            let mut children = 0;
            loop {
                let page = self
                    .client
                    .list_children(pb::ListChildrenRequest {
                        contract_id: id.clone(),
                        page_size: 1_000,
                        page_token: token,
                    })
                    .await
                    .unwrap()
                    .into_inner();
                for c in &page.children {
                    children_budget += c.ledger.unwrap().budget;
                    children += 1;
                    queue.push(c.contract_id.clone());
                }
                token = page.next_page_token;
                if token.is_empty() {
                    break;
                }
            }
            assert_eq!(ledger.reserved, children_budget);
            assert_eq!(ledger.open_children, children);
            seen += 1;
        }
        seen
    }
}

/// A revoke of a root with more open
/// descendants than one writer step is answered DESCENDANTS_ENDING, the
/// broker is SIGKILLed at once (its drain begun or not), and restarted on
/// the same data: the drain resumes and ends, every descendant revoked by
/// exactly one receipt, and the retried revoke (the same signed bytes)
/// then ends the root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_drain_finishes_it_once() {
    let data = BrokerData::new().await;
    let (mut process, addr) = data.spawn();
    let mut client = connect(&addr).await;
    let orchestrator = Agent::generate();
    let spec = RootSpec::for_bursts();
    let root = open_root_on(&mut client, &orchestrator, &spec)
        .await
        .contract_id;
    let lineage = spec.lineage();
    // 2 children of the root, 520 children each: 1,042 descendants, past
    // the default step of 1,024.
    let middle = Agent::generate();
    let mut descendants = Vec::new();
    for _ in 0..2 {
        let request = orchestrator.delegate(child(&root, &lineage, &middle, 1_000));
        let answer = delegate_retrying(&mut client, request).await;
        let (id, _) = Outcome::from(answer.outcome.unwrap()).issued();
        let mut calls = Vec::new();
        for _ in 0..520 {
            let (mut client, middle, id, lineage) = (
                client.clone(),
                Agent::from_seed(middle.seed()),
                id.clone(),
                lineage.clone(),
            );
            calls.push(tokio::spawn(async move {
                let leaf = Agent::generate();
                let request = middle.delegate(child(&id, &lineage, &leaf, 1));
                let answer = delegate_retrying(&mut client, request).await;
                Outcome::from(answer.outcome.unwrap()).issued().0
            }));
        }
        descendants.push(id);
        for call in calls {
            descendants.push(call.await.unwrap());
        }
    }
    let body = pb::RevokeBody {
        header: Some(orchestrator.header()),
        contract_id: root.clone(),
        reason: "stop".into(),
    };
    let revoke = pb::RevokeRequest {
        signed: signed(
            &orchestrator,
            <pb::RevokeBody as broker_client::Body>::PAYLOAD_TYPE,
            &body,
        ),
    };
    let mut session = connect_as(&addr, &orchestrator).await;
    let err = session.revoke(revoke.clone()).await.unwrap_err();
    assert_eq!(reason(&err), "DESCENDANTS_ENDING", "{err:?}");
    process.0.kill().unwrap(); // SIGKILL
    process.0.wait().unwrap();
    drop(process);

    let (_restarted, addr) = data.spawn();
    let mut session = connect_as(&addr, &orchestrator).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let open = state_via(&mut session, &root)
            .await
            .ledger
            .unwrap()
            .open_children;
        if open == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the drain did not resume"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every descendant revoked, by exactly one receipt.
    let mut stream = session
        .watch(watch_request(&root))
        .await
        .unwrap()
        .into_inner();
    let mut receipts: std::collections::HashMap<Vec<u8>, usize> = Default::default();
    while let Ok(Ok(Some(event))) =
        tokio::time::timeout(Duration::from_secs(3), stream.message()).await
    {
        if let Some(pb::watch_response::Event::Receipt(sealed)) = event.event {
            let receipt = decode_receipt(&sealed);
            assert_eq!(receipt.kind, pb::ReceiptKind::Revoked as i32);
            *receipts.entry(receipt.contract_id).or_default() += 1;
        }
    }
    assert_eq!(receipts.len(), descendants.len(), "a receipt for each");
    for id in &descendants {
        assert_eq!(receipts.get(id), Some(&1), "{}", hex::encode(id));
        let state = state_via(&mut session, id).await;
        assert_eq!(
            state.status,
            pb::ContractStatus::Revoked as i32,
            "{}",
            hex::encode(id)
        );
    }
    // The retried revoke goes through now and ends the root alone.
    let receipt = session.revoke(revoke).await.unwrap().into_inner();
    let receipt = decode_receipt(&receipt.receipt.unwrap());
    assert_eq!(receipt.revoked_ids, vec![root.clone()]);
    drop(data);
}

/// Sends `request` until it is answered: 1,040 Delegates at once may find
/// the PostgreSQL pool or the write queue full (UNAVAILABLE, RESOURCE_
/// EXHAUSTED, ABORTED for contention), which the API says to retry with
/// the same nonce — the same signed request is sent again.
async fn delegate_retrying(
    client: &mut pb::broker_client::BrokerClient<tonic::transport::Channel>,
    request: pb::DelegateRequest,
) -> pb::DelegateResponse {
    /// Far more than a loaded CI machine needs; a broker that never
    /// answers fails the test.
    const MAX_ATTEMPTS: u32 = 200;
    for _ in 1..MAX_ATTEMPTS {
        match client.delegate(request.clone()).await {
            Ok(answer) => return answer.into_inner(),
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::ResourceExhausted
                        | tonic::Code::Aborted
                ) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("Delegate failed: {status:?}"),
        }
    }
    client
        .delegate(request)
        .await
        .expect("answered after retries")
        .into_inner()
}
