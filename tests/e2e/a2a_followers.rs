//! The A2A gateway's followers learn their contracts' changes from one
//! WatchContracts stream: a thousand followed, idle tasks cost the broker
//! no request at all while the agent is still polled for them, and one
//! revocation of their root still cancels every one of the agent's
//! tasks. Real processes on 127.0.0.1:0; the agent is a stand-in that
//! keeps every task WORKING until it is canceled.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::a2a_authz::{chain_bytes, fake_agent, post_json, send_message, spawn_gateway};
use crate::harness::*;
use crate::operability::scrape;

/// Tasks followed at once.
const TASKS: usize = 1_000;
/// Times a starter sends a message the broker was too busy for.
const MAX_TRIES: usize = 20;
/// Admissions in flight while the tasks are started.
const STARTERS: usize = 8;
/// The gateway's tick: how often each follower looks at its task (and
/// polls the stand-in agent, which does not stream).
const POLL_MS: u64 = 1_000;
/// How long the idle tasks are watched for requests: a few ticks.
const IDLE: Duration = Duration::from_secs(3);
/// Longest wait for the followers to have their contracts' states.
const SETTLE_BOUND: Duration = Duration::from_secs(30);
/// Longest wait for every task to be canceled after the revocation (its
/// measured time is printed).
const CANCEL_BOUND: Duration = Duration::from_secs(30);

/// The gRPC calls the broker started so far, by method
/// (`grpc_server_started_total`).
async fn broker_calls(broker: &Broker) -> std::collections::BTreeMap<String, u64> {
    let text = scrape(broker.metrics_addr.expect("a metrics listener")).await;
    text.lines()
        .filter(|l| l.starts_with("grpc_server_started_total"))
        .filter_map(|l| {
            let (series, count) = l.rsplit_once(' ')?;
            Some((series.to_owned(), count.parse::<f64>().ok()? as u64))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_followed_tasks_cost_the_broker_nothing_and_a_revoke_cancels_them_all() {
    let mut broker = Broker::start_with_metrics().await;
    let [orchestrator, worker] = agents();
    let root = broker
        .open_root(
            &orchestrator,
            RootSpec::with(|s| {
                s.budget = 10_000;
                s.max_children = TASKS as u32;
                s.retry_headroom = false;
            }),
        )
        .await;
    let began = Instant::now();
    let mut chains = Vec::with_capacity(TASKS);
    for _ in 0..TASKS {
        let child = broker.issue(&orchestrator, root.child(&worker, 1)).await;
        chains.push(chain_bytes(&mut broker, &child).await);
    }
    println!("{TASKS} contracts issued and read in {:?}", began.elapsed());
    let agent = fake_agent().await;
    let (_gateway, addrs) = spawn_gateway(
        &broker.addr,
        &worker,
        &format!(
            "upstream = \"{}\"\nlisten = \"127.0.0.1:0\"\npoll_ms = {POLL_MS}\n\
             max_tasks = {TASKS}\nmax_tasks_per_tenant = {TASKS}\ncall_timeout_ms = 30000\n\
             upstream_keep_alive = true\n",
            agent.url
        ),
        &["a2a ingress"],
    );
    let ingress = format!("{}/", addrs["a2a ingress"]);
    let chains = std::sync::Arc::new(chains);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut starters = tokio::task::JoinSet::new();
    for _ in 0..STARTERS {
        let (chains, next, ingress) = (chains.clone(), next.clone(), ingress.clone());
        starters.spawn(async move {
            let http = crate::a2a_authz::http_client();
            let mut started = 0;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chain) = chains.get(i) else {
                    return started;
                };
                let mut body = send_message(Some(chain));
                body["params"]["configuration"] = json!({"returnImmediately": true});
                // A busy broker refuses OVERLOADED before anything moved:
                // a client backs off and sends again.
                let mut tries = 0;
                let answer = loop {
                    let answer = post_json(&http, ingress.clone(), &body).await;
                    let busy = answer["error"]["data"][0]["reason"] == "OVERLOADED";
                    if !busy || tries == MAX_TRIES {
                        break answer;
                    }
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                assert!(
                    answer["result"]["task"]["id"].is_string(),
                    "task {i} admitted: {answer}"
                );
                started += 1;
            }
        });
    }
    let started: usize = starters.join_all().await.into_iter().sum();
    assert_eq!(started, TASKS);
    println!("{TASKS} tasks admitted after {:?}", began.elapsed());

    // Settle: every follower has its contract's state from the stream
    // (until then it reads its contract at each tick): a tick with no
    // broker request, within a bound.
    let settle_from = Instant::now();
    let mut calls_before = broker_calls(&broker).await;
    loop {
        tokio::time::sleep(Duration::from_millis(POLL_MS + POLL_MS / 2)).await;
        let now = broker_calls(&broker).await;
        if now == calls_before || settle_from.elapsed() > SETTLE_BOUND {
            break;
        }
        calls_before = now;
    }
    println!(
        "settled {:?} after the last admission",
        settle_from.elapsed()
    );
    let polls_before = agent.calls().iter().filter(|m| *m == "GetTask").count();
    tokio::time::sleep(IDLE).await;
    let calls_after = broker_calls(&broker).await;
    let polls_after = agent.calls().iter().filter(|m| *m == "GetTask").count();
    // The followers ticked (the stand-in agent does not stream, so it is
    // polled), yet the broker was asked nothing.
    assert!(
        polls_after - polls_before >= TASKS,
        "the followers looked at their tasks: {} GetTask in {IDLE:?}",
        polls_after - polls_before
    );
    let asked: Vec<_> = calls_after
        .iter()
        .filter(|(series, count)| calls_before.get(*series) != Some(count))
        .collect();
    assert!(
        asked.is_empty(),
        "broker requests while {TASKS} followed tasks were idle: {asked:?} (before: {calls_before:?})"
    );

    // One revocation of the root ends every task's contract.
    let revoked_at = Instant::now();
    broker.revoke(&orchestrator, &root.id).await.unwrap();
    let canceled = loop {
        let canceled = agent.calls().iter().filter(|m| *m == "CancelTask").count();
        if canceled >= TASKS || revoked_at.elapsed() > CANCEL_BOUND {
            break canceled;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "{canceled} of {TASKS} tasks canceled {:?} after the revocation",
        revoked_at.elapsed()
    );
    assert_eq!(canceled, TASKS, "every task canceled after the revocation");
    broker.stop().await;
}
