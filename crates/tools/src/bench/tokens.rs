//! `bench --tokens`: the token endpoint's price. Each worker holds the
//! leaf of a chain `--depth` hops deep. Three phases of `--duration-s`
//! each: the workers mint tokens for their leaf (a freshly signed
//! assertion each time), then introspect one token again and again, then
//! delegate as the default bench does (chains `--depth` deep). Each phase prints its rate, its
//! latency and the process's CPU per call — client and broker together,
//! as they share this process — so a mint's CPU compares with a
//! Delegate's measured the same way in the same sitting. Last, one leaf
//! is revoked by the root's holder and its token introspected: it must be
//! inactive at once, though its answers came from memory until then.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::transport::Channel;

use broker_client::Agent;
use broker_client::token::TokenEndpoint;
use broker_wire::clock::{Clock, SystemClock};
use broker_wire::pb;
use broker_wire::pb::broker_client::BrokerClient;

use super::{BenchArgs, Servers, Tally, bench_root, delegate_body};

/// The resource tokens are minted for (the in-process broker allows it).
pub const RESOURCE: &str = "https://bench.resource";
/// The introspector the in-process broker is configured with.
pub const INTROSPECTOR: (&str, &str) = ("bench", "bench-introspection-secret");

/// Leaves each worker holds, minting for each in turn: a key has at most
/// 1,000 unexpired assertions (60 s each) in the broker's replay memory,
/// and one worker mints faster than 1,000 a minute.
const LEAVES: usize = 16;

/// One worker's chain: its path's agents (root's opener first), then
/// `LEAVES` sibling contracts at depth `depth` with their holders.
struct Chain {
    agents: Vec<Agent>,
    leaves: Vec<([u8; 32], Agent)>,
}

impl Chain {
    fn leaf(&self, n: usize) -> ([u8; 32], &Agent) {
        let (id, holder) = &self.leaves[n % self.leaves.len()];
        (*id, holder)
    }
}

/// Opens a root, delegates `depth - 1` hops from it, and `leaves`
/// siblings from the last.
async fn chain(
    client: &mut BrokerClient<Channel>,
    attestor: &Agent,
    depth: u32,
    leaves: usize,
) -> anyhow::Result<Chain> {
    let mut agents: Vec<Agent> = (0..depth).map(|_| Agent::generate()).collect();
    agents.extend((0..leaves).map(|_| Agent::generate()));
    let intent = "benchmark: tokens for a chain of work".to_owned();
    let lineage = broker_wire::crypto::sha256(intent.as_bytes()).to_vec();
    let root = client
        .open_root(agents[0].open_root(bench_root(&intent, depth, 2 * leaves as u32)))
        .await?
        .into_inner()
        .issued
        .ok_or_else(|| anyhow::anyhow!("the bench root was refused"))?;
    let mut ids = vec![root.contract_id];
    let expires_at_ms = SystemClock.now_ms() + 3_600_000;
    let mut path_budget: i64 = 1 << 39;
    let mut leaf_ids = Vec::with_capacity(leaves);
    for hop in 1..agents.len() {
        // Each leaf takes a small share, so all of them fit the parent.
        let (from, parent, budget) = if hop < depth as usize {
            (hop - 1, ids.last().expect("a root"), path_budget)
        } else {
            (
                depth as usize - 1,
                &ids[depth as usize - 1],
                path_budget / 64,
            )
        };
        let attestation = attestor.attest(agents[hop].public_key(), 0.99, expires_at_ms, "bench");
        let body = delegate_body(
            parent,
            &lineage,
            format!("hop {hop}: handle part of src/"),
            &agents[hop],
            &attestation,
            budget,
        );
        let id = match client
            .delegate(agents[from].delegate(body))
            .await?
            .into_inner()
            .outcome
        {
            Some(pb::delegate_response::Outcome::Issued(issued)) => issued.contract_id,
            other => anyhow::bail!("a bench delegation was not issued: {other:?}"),
        };
        if hop < depth as usize {
            ids.push(id);
            path_budget /= 2;
        } else {
            leaf_ids.push(id.as_slice().try_into()?);
        }
    }
    let holders = agents.split_off(depth as usize);
    let leaves = leaf_ids.into_iter().zip(holders).collect();
    Ok(Chain { agents, leaves })
}

/// The process's CPU time so far (every thread: client and broker).
fn cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// What one phase measured over its window.
struct Measured {
    tally: Tally,
    cpu: Duration,
}

/// One task per worker, each measuring over `window` (`spawn(i, window)`);
/// their tallies together, and the CPU the window took.
async fn phase<F>(args: &BenchArgs, spawn: F) -> anyhow::Result<Measured>
where
    F: Fn(usize, (Instant, Instant)) -> tokio::task::JoinHandle<Tally>,
{
    let measure_from = Instant::now() + Duration::from_secs(args.warmup_s);
    let stop_at = measure_from + Duration::from_secs(args.duration_s);
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|i| spawn(i, (measure_from, stop_at)))
        .collect();
    let cpu_at = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let first = cpu();
        tokio::time::sleep_until(stop_at.into()).await;
        cpu().saturating_sub(first)
    });
    let mut tally = Tally::default();
    for task in tasks {
        let t = task.await?;
        tally.latencies_us.extend(t.latencies_us);
        tally.errors += t.errors;
    }
    Ok(Measured {
        tally,
        cpu: cpu_at.await?,
    })
}

/// Calls `call` until the window ends, timing the calls that began in it.
async fn timed<F, Fut>(mut call: F, (measure_from, stop_at): (Instant, Instant)) -> Tally
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut tally = Tally::default();
    while Instant::now() < stop_at {
        let began = Instant::now();
        let ok = call().await;
        if began >= measure_from && Instant::now() <= stop_at {
            if ok {
                tally
                    .latencies_us
                    .push(u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX));
            } else {
                tally.errors += 1;
            }
        }
    }
    tally
}

fn report(what: &str, args: &BenchArgs, measured: &mut Measured) {
    let lat = &mut measured.tally.latencies_us;
    lat.sort_unstable();
    let pct = |p: f64| super::percentile_ms(lat, p);
    let calls = lat.len() as f64;
    println!(
        "{what}: {} in {}s = {:.0}/s (failed {}); latency ms p50 {:.2} p99 {:.2}; CPU per call {:.0} µs (client and broker)",
        lat.len(),
        args.duration_s,
        calls / args.duration_s as f64,
        measured.tally.errors,
        pct(0.50),
        pct(0.99),
        if calls > 0.0 {
            measured.cpu.as_secs_f64() * 1e6 / calls
        } else {
            0.0
        },
    );
}

/// The three phases against an in-process broker serving `--tokens`.
pub async fn drive(args: BenchArgs, servers: &dyn Servers) -> anyhow::Result<()> {
    let attestor = Arc::new(Agent::generate());
    let (addr, tokens_url, in_process) = super::start_in_process(&args, &attestor, servers).await?;
    let tokens_url = tokens_url.ok_or_else(|| anyhow::anyhow!("no token endpoint started"))?;
    let channel = tonic::transport::Endpoint::from_shared(addr)?
        .connect()
        .await?;
    let mut client = BrokerClient::new(channel.clone());
    let mut chains = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        chains.push(chain(&mut client, &attestor, args.depth, LEAVES).await?);
    }
    let chains = Arc::new(chains);
    let endpoint = TokenEndpoint::new(&tokens_url)?;
    println!(
        "concurrency={} depth={} duration={}s: tokens at {tokens_url}",
        args.concurrency, args.depth, args.duration_s
    );

    let mint = |i: usize, window| {
        let (chains, endpoint) = (chains.clone(), endpoint.clone());
        tokio::spawn(async move {
            let mut n = 0;
            let mint = || {
                n += 1;
                let (leaf, holder) = chains[i].leaf(n);
                let endpoint = &endpoint;
                async move { endpoint.mint(holder, &leaf, RESOURCE).await.is_ok() }
            };
            timed(mint, window).await
        })
    };
    report("mint", &args, &mut phase(&args, mint).await?);

    let mut tokens = Vec::with_capacity(chains.len());
    for chain in chains.iter() {
        let (leaf, holder) = chain.leaf(0);
        tokens.push(endpoint.mint(holder, &leaf, RESOURCE).await?.access_token);
    }
    let tokens = Arc::new(tokens);
    let introspect = |i: usize, window| {
        let (tokens, endpoint) = (tokens.clone(), endpoint.clone());
        tokio::spawn(async move {
            let active = || async {
                endpoint
                    .introspect(INTROSPECTOR, &tokens[i])
                    .await
                    .is_ok_and(|answer| answer["active"] == true)
            };
            timed(active, window).await
        })
    };
    report(
        "introspect (active)",
        &args,
        &mut phase(&args, introspect).await?,
    );

    // The default bench's workers: chains `--depth` deep, roots included.
    let delegate = |_: usize, (measure_from, stop_at)| {
        let client = BrokerClient::new(channel.clone());
        tokio::spawn(super::worker(
            client,
            attestor.clone(),
            args.depth,
            None,
            measure_from,
            stop_at,
        ))
    };
    report("delegate", &args, &mut phase(&args, delegate).await?);

    // Exact on revocation: worker 0's first leaf, revoked by the root's
    // holder.
    let first = &chains[0];
    let link = broker_client::Link::new(Agent::from_seed(first.agents[0].seed()), channel);
    link.call(
        pb::RevokeBody {
            header: None,
            contract_id: first.leaves[0].0.to_vec(),
            reason: "bench: introspection must see it".into(),
        },
        None,
    )
    .await
    .map_err(|e| anyhow::anyhow!("revoking: {e}"))?;
    let answer = endpoint.introspect(INTROSPECTOR, &tokens[0]).await?;
    println!(
        "after revoking the leaf: the next introspection answers active={}",
        answer["active"]
    );
    anyhow::ensure!(
        answer["active"] == false,
        "introspection still answered active after the revocation"
    );
    super::stop_in_process(in_process).await
}
