//! Concurrent siblings can never overspend their parent.

use delegation_broker::client::Agent;
use delegation_broker::pb::InvariantCode as Code;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_siblings_of_ten_from_three_hundred_issue_exactly_thirty() {
    let mut broker = Broker::start().await;
    let orchestrator = std::sync::Arc::new(Agent::generate());
    let root = broker
        .open_root(
            &orchestrator,
            RootSpec {
                budget: 300,
                max_children: 64,
                ..RootSpec::default()
            },
        )
        .await;
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let mut client = connect(&broker.addr).await;
        let orchestrator = orchestrator.clone();
        let body = child(&root.id, &root.lineage, &Agent::generate(), 10);
        tasks.push(tokio::spawn(async move {
            let response = client
                .delegate(orchestrator.delegate(body))
                .await
                .unwrap()
                .into_inner();
            Outcome::from(response.outcome.unwrap())
        }));
    }
    let (mut issued, mut refused) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Outcome::Issued { .. } => issued += 1,
            outcome @ Outcome::Refused { .. } => {
                let (_, _, receipt) = outcome.refused();
                assert_eq!(codes(&receipt), vec![Code::BudgetExceedsParent]);
                refused += 1;
            }
        }
    }
    assert_eq!((issued, refused), (30, 34));
    let ledger = broker.ledger(&root.id).await;
    assert_eq!(
        (ledger.reserved, ledger.residual, ledger.open_children),
        (300, 0, 30)
    );
    broker.assert_ledgers_balance(&root.id).await;
    broker.stop().await;
}
