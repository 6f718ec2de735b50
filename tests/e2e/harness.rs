//! Starts a real broker on 127.0.0.1:0 with a fresh data directory and
//! gives tests a gRPC client plus helpers to sign requests.

use std::sync::Arc;

use broker_client::{Agent, Body, Receipted, Sendable, SessionAttacher, SessionClient};
use delegation_broker::clock::{Clock, OffsetClock, SystemClock};
use delegation_broker::config::Config;
use delegation_broker::crypto::{self, payload_type};
use delegation_broker::pb;
use delegation_broker::pb::broker_client::BrokerClient;
use prost::Message;
use tonic::transport::Channel;

pub const HOUR_MS: i64 = 3_600_000;

/// Writes a key file as `keygen` does: the owner's alone (a key file
/// others can read is refused).
pub fn write_key_file(path: &std::path::Path, seed: &[u8; 32]) {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("key file");
    writeln!(file, "{}", hex::encode(seed)).expect("key file written");
}

pub fn now_ms() -> i64 {
    SystemClock.now_ms()
}

pub struct Broker {
    /// A reader key of the broker's configuration: `client` reads as it.
    pub reader: Agent,
    pub client: SessionClient,
    pub addr: String,
    /// Trusted by the broker's configuration.
    pub attestor: Agent,
    /// The broker's clock; tests advance it.
    pub clock: Arc<OffsetClock>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
    /// Where `/metrics` is served (brokers started with metrics).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The console's address and access token (brokers started with it).
    pub console: Option<(std::net::SocketAddr, String)>,
    /// The token endpoint's URL (brokers started with it).
    pub tokens_url: Option<String>,
    /// The PostgreSQL database of this broker (`on_postgres`), dropped
    /// after the broker stops.
    pub database: Option<delegation_broker::store::postgres::testing::TestDatabase>,
    _dir: tempfile::TempDir,
}

/// The variable that runs the end-to-end tests against PostgreSQL
/// (`BROKER_TEST_BACKEND=postgres`, set by the test command's second
/// pass); SQLite otherwise.
pub const BACKEND_VAR: &str = "BROKER_TEST_BACKEND";

/// Whether this run's brokers keep their state in PostgreSQL.
pub fn on_postgres() -> bool {
    match std::env::var(BACKEND_VAR).as_deref() {
        Ok("postgres") => true,
        Ok("sqlite") | Err(_) => false,
        Ok(other) => panic!("{BACKEND_VAR}={other}: expected sqlite or postgres"),
    }
}

/// What a test broker serves besides gRPC.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Listener {
    None,
    Metrics,
    Console,
    Tokens,
}

impl Broker {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// A fresh broker with a default root of a fresh orchestrator open.
    pub async fn start_with_root() -> (Self, Agent, Root) {
        Self::start_with_root_of(RootSpec::default()).await
    }

    /// A fresh broker with `spec`'s root of a fresh orchestrator open.
    pub async fn start_with_root_of(spec: RootSpec) -> (Self, Agent, Root) {
        let mut broker = Self::start().await;
        let orchestrator = Agent::generate();
        let root = broker.open_root(&orchestrator, spec).await;
        (broker, orchestrator, root)
    }

    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> Self {
        Self::start_full(adjust, Listener::None, None).await
    }

    /// A broker that also serves the browser console (`console`); the
    /// configuration must name `console.reader`.
    pub async fn start_with_console(adjust: impl FnOnce(&mut Config)) -> Self {
        Self::start_full(adjust, Listener::Console, None).await
    }

    /// A broker that also serves the token endpoint (`tokens_url`).
    pub async fn start_with_tokens(adjust: impl FnOnce(&mut Config)) -> Self {
        Self::start_full(adjust, Listener::Tokens, None).await
    }

    /// A broker that also serves Prometheus metrics (`metrics_addr`).
    pub async fn start_with_metrics() -> Self {
        Self::start_full(|_| {}, Listener::Metrics, None).await
    }

    /// The first replica of a replicated broker: on a fresh PostgreSQL
    /// database of its own whatever the backend of this run (it owns the
    /// database: stop it last).
    pub async fn start_replicated() -> Self {
        Self::start_replicated_with(|_| {}).await
    }

    /// `start_replicated` with an adjusted configuration.
    pub async fn start_replicated_with(adjust: impl FnOnce(&mut Config)) -> Self {
        let database = delegation_broker::store::postgres::testing::TestDatabase::migrated().await;
        let url = database.url.clone();
        let mut broker = Self::start_full(adjust, Listener::None, Some(&url)).await;
        broker.database = Some(database);
        broker
    }

    /// Another replica on `first`'s database (its own signing key, data
    /// directory and address).
    pub async fn start_replica(first: &Broker) -> Self {
        Self::start_replica_with(first, |_| {}).await
    }

    /// `start_replica` with an adjusted configuration.
    pub async fn start_replica_with(first: &Broker, adjust: impl FnOnce(&mut Config)) -> Self {
        Self::replica(first, adjust, Listener::None).await
    }

    /// `start_replica_with`, serving the token endpoint too (`tokens_url`).
    pub async fn start_replica_with_tokens(
        first: &Broker,
        adjust: impl FnOnce(&mut Config),
    ) -> Self {
        Self::replica(first, adjust, Listener::Tokens).await
    }

    async fn replica(first: &Broker, adjust: impl FnOnce(&mut Config), extra: Listener) -> Self {
        let url = first
            .database
            .as_ref()
            .expect("a replicated broker")
            .url
            .clone();
        Self::start_full(adjust, extra, Some(&url)).await
    }

    async fn start_full(
        adjust: impl FnOnce(&mut Config),
        extra: Listener,
        shared: Option<&str>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let [attestor, reader] = agents();
        let mut config = Config::load(dir.path().to_owned(), None).expect("default config");
        config.readers.insert(reader.public_key());
        // Tests move the broker's clock by hours; the session must outlive it.
        config.limits.session_ttl_ms = 86_400_000;
        config
            .trust
            .attestors
            .push(crypto::public_key(&attestor.public_key()).unwrap());
        adjust(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let mut options = delegation_broker::server::ServeOptions::default();
        let database = match shared {
            Some(_) => None,
            None => database_of_this_run().await,
        };
        if let Some(url) = shared.or(database.as_ref().map(|d| d.url.as_str())) {
            options.database = Some(delegation_broker::server::DatabaseOptions {
                url: url.to_owned(),
                migrate: true,
            });
        }
        let mut metrics_addr = None;
        let mut console = None;
        let mut tokens_url = None;
        let mut listeners = delegation_broker::server::Listeners::from(listener);
        if extra == Listener::Console {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let token = delegation_broker::console::new_token();
            console = Some((listener.local_addr().unwrap(), token.clone()));
            listeners.console =
                Some(delegation_broker::console::ConsoleOptions { listener, token });
        } else if extra == Listener::Tokens {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tokens_url = Some(format!("http://{}", listener.local_addr().unwrap()));
            listeners.tokens = Some(listener);
        } else if extra == Listener::Metrics {
            let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            metrics_addr = Some(metrics_listener.local_addr().unwrap());
            listeners.metrics = Some(metrics_listener);
        }
        let clock = Arc::new(OffsetClock::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server_clock: Arc<dyn Clock> = clock.clone();
        let server = tokio::spawn(async move {
            delegation_broker::server::run_with_options(
                listeners,
                config,
                server_clock,
                options,
                async {
                    let _ = stopped.await;
                },
            )
            .await
            .expect("server runs");
        });
        let client = connect_as(&addr, &reader).await;
        Self {
            reader,
            client,
            addr,
            attestor,
            clock,
            stop: Some(stop),
            server: Some(server),
            metrics_addr,
            console,
            tokens_url,
            database,
            _dir: dir,
        }
    }

    /// The broker's data directory (its key and SQLite database).
    pub fn data_dir(&self) -> &std::path::Path {
        self._dir.path()
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.unwrap();
        }
    }

    /// The effective predicate of contract `id`, derived from its chain
    /// verified offline (types.proto's procedure), and checked to be the
    /// broker's own copy in ContractState.
    pub async fn effective_predicate(&mut self, id: &[u8]) -> String {
        let keys = self.keys().await;
        let chain = self.chain(id).await.chain;
        let sealed: Vec<pb::Sealed> = chain.iter().map(|s| s.contract.clone().unwrap()).collect();
        let hops = delegation_broker::chain::verify_chain(
            &sealed,
            &delegation_broker::chain::BrokerKeys::from_published(&keys),
            Some(&id.try_into().expect("a 32-byte id")),
        )
        .expect("the chain verifies");
        let derived = hops.last().unwrap().effective_predicate.clone();
        assert_eq!(derived, chain.last().unwrap().effective_predicate);
        derived
    }

    /// GetChain of contract `id`.
    pub async fn chain(&mut self, id: &[u8]) -> pb::GetChainResponse {
        self.client
            .get_chain(pb::GetChainRequest {
                contract_id: id.to_vec(),
            })
            .await
            .expect("GetChain")
            .into_inner()
    }

    pub async fn keys(&mut self) -> Vec<pb::BrokerKey> {
        self.client
            .get_broker_keys(pb::GetBrokerKeysRequest {})
            .await
            .unwrap()
            .into_inner()
            .keys
    }

    /// The key id of the broker's current signing key (what OpenSession
    /// requests name).
    pub async fn current_key_id(&mut self) -> String {
        let keys = self.keys().await;
        keys.into_iter()
            .find(|k| k.current)
            .expect("a current key")
            .key_id
    }

    /// Opens a root held by `orchestrator`.
    pub async fn open_root(&mut self, orchestrator: &Agent, spec: RootSpec) -> Root {
        let issued = open_root_on(&mut self.client, orchestrator, &spec).await;
        let contract = decode_contract(issued.contract.as_ref().unwrap());
        Root {
            id: issued.contract_id,
            lineage: contract.intent_lineage_hash.clone(),
            contract,
        }
    }

    /// The set-up most tests start from: a default root opened by
    /// `orchestrator` and one PRINCIPAL child of `budget` for `delegate`;
    /// returns the root and the child's id.
    pub async fn root_and_child(
        &mut self,
        orchestrator: &Agent,
        delegate: &Agent,
        budget: i64,
    ) -> (Root, Vec<u8>) {
        let root = self.open_root(orchestrator, RootSpec::default()).await;
        let child_id = self.issue(orchestrator, root.child(delegate, budget)).await;
        (root, child_id)
    }

    /// `root_and_child`, the child then accepted by `delegate` (naming
    /// `host` at Accept when given).
    pub async fn root_and_accepted_child(
        &mut self,
        orchestrator: &Agent,
        delegate: &Agent,
        budget: i64,
        host: Option<&Agent>,
    ) -> (Root, Vec<u8>) {
        let (root, id) = self.root_and_child(orchestrator, delegate, budget).await;
        self.accept(delegate, &id, host).await.expect("Accept");
        (root, id)
    }

    pub async fn delegate(
        &mut self,
        holder: &Agent,
        body: pb::DelegateBody,
    ) -> Result<Outcome, tonic::Status> {
        let response = self.send_delegate(holder.delegate(body)).await?;
        Ok(Outcome::from(response.outcome.expect("an outcome")))
    }

    /// Sends a Delegate request as it was signed.
    pub async fn send_delegate(
        &mut self,
        request: pb::DelegateRequest,
    ) -> Result<pb::DelegateResponse, tonic::Status> {
        Ok(self.client.delegate(request).await?.into_inner())
    }

    /// Sends an OpenRoot request as it was signed.
    pub async fn send_open_root(
        &mut self,
        request: pb::OpenRootRequest,
    ) -> Result<pb::OpenRootResponse, tonic::Status> {
        Ok(self.client.open_root(request).await?.into_inner())
    }

    /// Delegates `body`, expecting it issued; the child's id.
    pub async fn issue(&mut self, holder: &Agent, body: pb::DelegateBody) -> Vec<u8> {
        self.delegate(holder, body)
            .await
            .expect("Delegate answers")
            .issued()
            .0
    }

    /// Delegates `body`, expecting a signed refusal; its receipt.
    pub async fn refuse(&mut self, holder: &Agent, body: pb::DelegateBody) -> pb::Receipt {
        self.delegate(holder, body)
            .await
            .expect("Delegate answers")
            .refused()
            .2
    }

    /// `refuse`, checking the refusal as `assert_refusal_verifies` does.
    pub async fn refuse_verified(&mut self, holder: &Agent, body: pb::DelegateBody) -> pb::Receipt {
        let (id, envelope, _) = self
            .delegate(holder, body)
            .await
            .expect("Delegate answers")
            .refused();
        assert_refusal_verifies(self, &id, &envelope).await
    }

    /// A Watch of `id`'s tree from its first event.
    pub async fn watch(&mut self, id: &[u8]) -> tonic::Streaming<pb::WatchResponse> {
        self.watch_from(id, 0).await
    }

    /// A Watch of `id`'s tree from the event after `cursor`.
    pub async fn watch_from(
        &mut self,
        id: &[u8],
        cursor: u64,
    ) -> tonic::Streaming<pb::WatchResponse> {
        let request = pb::WatchRequest {
            cursor,
            ..watch_request(id)
        };
        self.client
            .watch(request)
            .await
            .expect("Watch")
            .into_inner()
    }

    pub async fn ledger(&mut self, id: &[u8]) -> pb::Ledger {
        self.state(id).await.ledger.unwrap()
    }

    /// What the contract `id` has spent and has left.
    pub async fn spent_and_residual(&mut self, id: &[u8]) -> (i64, i64) {
        let ledger = self.ledger(id).await;
        (ledger.spent, ledger.residual)
    }

    pub fn attest(&self, agent: &Agent, factor: f64) -> pb::Envelope {
        self.attestor
            .attest(agent.public_key(), factor, now_ms() + HOUR_MS, "test")
    }

    /// Every contract of the tree under `root`, breadth first.
    pub async fn tree(&mut self, root: &[u8]) -> Vec<pb::ContractState> {
        let mut out = Vec::new();
        let mut queue = vec![root.to_vec()];
        while let Some(id) = queue.pop() {
            let (children, _) = all_children(&mut self.client, &id, 7).await;
            queue.extend(children.iter().map(|c| c.contract_id.clone()));
            out.extend(children);
        }
        out.push(self.state(root).await);
        out
    }

    /// The ledger equation for every contract of the tree, and reserved =
    /// the sum of the open children's budgets.
    pub async fn assert_ledgers_balance(&mut self, root: &[u8]) {
        let tree = self.tree(root).await;
        for state in &tree {
            let l = state.ledger.unwrap();
            assert_eq!(
                l.budget,
                l.residual + l.reserved + l.spent,
                "ledger of {}",
                hex::encode(&state.contract_id)
            );
            // The residual may go negative only after a recorded overspend.
            assert!(l.reserved >= 0 && l.spent >= 0);
            // Only open children hold a reservation.
            let open = [
                pb::ContractStatus::Open as i32,
                pb::ContractStatus::Accepted as i32,
            ];
            let children: Vec<_> = tree
                .iter()
                .filter(|c| {
                    decode_contract(c.contract.as_ref().unwrap()).parent_id == state.contract_id
                })
                .filter(|c| open.contains(&c.status))
                .collect();
            let reserved: i64 = children.iter().map(|c| c.ledger.unwrap().budget).sum();
            assert_eq!(
                l.reserved,
                reserved,
                "reserved of {}",
                hex::encode(&state.contract_id)
            );
            assert_eq!(l.open_children as usize, children.len());
        }
    }
}

/// A plain channel to `addr` (for services besides the broker's).
pub async fn channel(addr: &str) -> Channel {
    Channel::from_shared(addr.to_owned())
        .expect("address")
        .connect()
        .await
        .expect("connect")
}

/// A client that reads as `agent` (it opens a session for it).
pub async fn connect_as(addr: &str, agent: &Agent) -> SessionClient {
    let channel = channel(addr).await;
    let attacher = SessionAttacher::default();
    let mut client = attacher
        .client(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024);
    attacher
        .open(&mut client, agent)
        .await
        .expect("OpenSession");
    client
}

pub async fn connect(addr: &str) -> BrokerClient<Channel> {
    BrokerClient::connect(addr.to_owned())
        .await
        .expect("connect")
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024)
}

pub struct Root {
    pub id: Vec<u8>,
    pub lineage: Vec<u8>,
    pub contract: pb::Contract,
}

impl Root {
    /// `child` of this root.
    pub fn child(&self, delegate: &Agent, budget: i64) -> pb::DelegateBody {
        child(&self.id, &self.lineage, delegate, budget)
    }

    /// `liable_child` of this root.
    pub fn liable_child(&self, delegate: &Agent, budget: i64, predicate: &str) -> pb::DelegateBody {
        liable_child(&self.id, &self.lineage, delegate, budget, predicate)
    }
}

pub struct RootSpec {
    pub labels: std::collections::HashMap<String, String>,
    pub retry_headroom: bool,
    pub require_host: bool,
    pub budget: i64,
    pub max_depth: u32,
    pub min_trust: u32,
    pub max_children: u32,
    pub predicate: String,
    pub deadline_ms: i64,
    pub scope: Vec<String>,
}

impl Default for RootSpec {
    fn default() -> Self {
        Self {
            labels: Default::default(),
            retry_headroom: true,
            require_host: false,
            budget: 100,
            max_depth: 4,
            min_trust: 0,
            max_children: 64,
            predicate: String::new(),
            deadline_ms: now_ms() + HOUR_MS,
            scope: vec!["src".into(), "docs".into()],
        }
    }
}

impl RootSpec {
    /// The default spec with `adjust` applied.
    pub fn with(adjust: impl FnOnce(&mut Self)) -> Self {
        let mut spec = Self::default();
        adjust(&mut spec);
        spec
    }

    /// Room for a burst of a thousand delegations.
    pub fn for_bursts() -> Self {
        Self::with(|s| (s.budget, s.max_children) = (1_000_000, 1_024))
    }

    /// The intent lineage hash of the root this spec opens.
    pub fn lineage(&self) -> Vec<u8> {
        crypto::sha256(self.body().intent.as_bytes()).to_vec()
    }

    pub fn body(&self) -> pb::OpenRootBody {
        pb::OpenRootBody {
            header: None,
            intent: "Fix the token refresh bug in src/auth/ and document it".into(),
            task: String::new(),
            budget: self.budget,
            deadline_ms: self.deadline_ms,
            policy: Some(pb::Policy {
                max_depth: self.max_depth,
                min_cumulative_trust_ppm: self.min_trust,
                max_children: self.max_children,
                disable_retry_headroom: !self.retry_headroom,
                require_host: self.require_host,
            }),
            predicate: self.predicate.clone(),
            write_scope: self.scope.clone(),
            labels: self.labels.clone(),
        }
    }
}

/// A Delegate body with liability PRINCIPAL and nothing else asked of it.
pub fn child(parent: &[u8], lineage: &[u8], delegate: &Agent, budget: i64) -> pb::DelegateBody {
    pb::DelegateBody {
        header: None,
        parent_id: parent.to_vec(),
        intent_lineage_hash: lineage.to_vec(),
        task: "work on src/auth/token.rs".into(),
        delegate_public_key: delegate.public_key().to_vec(),
        delegate_attestation: None,
        budget,
        deadline_ms: 0,
        liability: pb::Liability::Principal as i32,
        predicate: String::new(),
        escalation_channel: String::new(),
        min_retry_cost: 0,
        min_retry_latency_ms: 0,
        write_scope: vec!["src".into()],
        host_public_key: Vec::new(),
        result_schema_json: String::new(),
    }
}

/// The same with liability DELEGATE, an escalation channel and `predicate`.
pub fn liable_child(
    parent: &[u8],
    lineage: &[u8],
    delegate: &Agent,
    budget: i64,
    predicate: &str,
) -> pb::DelegateBody {
    pb::DelegateBody {
        liability: pb::Liability::Delegate as i32,
        predicate: predicate.into(),
        escalation_channel: "broker://escalate".into(),
        ..child(parent, lineage, delegate, budget)
    }
}

#[derive(Debug)]
pub enum Outcome {
    Issued { id: Vec<u8>, envelope: pb::Sealed },
    Refused { id: Vec<u8>, envelope: pb::Sealed },
}

impl From<pb::delegate_response::Outcome> for Outcome {
    fn from(o: pb::delegate_response::Outcome) -> Self {
        match o {
            pb::delegate_response::Outcome::Issued(i) => Outcome::Issued {
                id: i.contract_id,
                envelope: i.contract.unwrap(),
            },
            pb::delegate_response::Outcome::Refused(r) => Outcome::Refused {
                id: r.receipt_id,
                envelope: r.receipt.unwrap(),
            },
        }
    }
}

impl Outcome {
    #[track_caller]
    pub fn issued(self) -> (Vec<u8>, pb::Contract) {
        match self {
            Outcome::Issued { id, envelope } => (id, decode_contract(&envelope)),
            Outcome::Refused { envelope, .. } => panic!(
                "expected issued, got refusal {:?}",
                decode_receipt(&envelope)
            ),
        }
    }

    #[track_caller]
    pub fn refused(self) -> (Vec<u8>, pb::Sealed, pb::Receipt) {
        match self {
            Outcome::Refused { id, envelope } => {
                let receipt = decode_receipt(&envelope);
                (id, envelope, receipt)
            }
            Outcome::Issued { .. } => panic!("expected a refusal, the child was issued"),
        }
    }
}

pub fn decode_contract(envelope: &pb::Sealed) -> pb::Contract {
    pb::Contract::decode(envelope.payload.as_slice()).unwrap()
}

pub fn decode_receipt(envelope: &pb::Sealed) -> pb::Receipt {
    pb::Receipt::decode(envelope.payload.as_slice()).unwrap()
}

pub fn codes(receipt: &pb::Receipt) -> Vec<pb::InvariantCode> {
    receipt
        .violations
        .iter()
        .map(|v| pb::InvariantCode::try_from(v.code).unwrap())
        .collect()
}

/// Verifies a broker-signed payload against the published keys (by the
/// key id the payload names).
pub fn verify_with_keys(
    envelope: &pb::Sealed,
    expected_type: &'static str,
    keys: &[pb::BrokerKey],
    key_id: &str,
) {
    let key = keys
        .iter()
        .find(|k| k.key_id == key_id)
        .expect("payload names a published key");
    let vk = crypto::public_key(&key.public_key).unwrap();
    crypto::verify_sealed(envelope, expected_type, &vk).expect("the signature verifies");
}

/// Asserts the refusal verifies with the broker's published key and can be
/// fetched again by id.
pub async fn assert_refusal_verifies(
    broker: &mut Broker,
    id: &[u8],
    envelope: &pb::Sealed,
) -> pb::Receipt {
    let keys = broker.keys().await;
    let receipt = decode_receipt(envelope);
    verify_with_keys(
        envelope,
        payload_type::RECEIPT,
        &keys,
        &receipt.broker_key_id,
    );
    assert_eq!(crypto::sha256(&envelope.payload).to_vec(), id);
    let again = broker
        .client
        .get_receipt(receipt_request(id))
        .await
        .unwrap()
        .into_inner()
        .receipt
        .unwrap();
    assert_eq!(&again, envelope);
    receipt
}

/// A header signed "at" `timestamp_ms` (for a broker whose clock was moved).
pub fn header_at(agent: &Agent, timestamp_ms: i64) -> pb::RequestHeader {
    pb::RequestHeader {
        timestamp_ms,
        ..agent.header()
    }
}

/// Signs a lifecycle body (filling in a header if it has none).
pub fn signed<T: prost::Message>(
    agent: &Agent,
    payload_type: &str,
    body: &T,
) -> Option<pb::Envelope> {
    Some(agent.sign(payload_type, body))
}

/// Signs `body` as `signer` (with a fresh header unless it has one) and
/// sends it on `client`, once; the answer's receipt envelope.
pub async fn send_lifecycle<B: Body>(
    client: &mut SessionClient,
    signer: &Agent,
    mut body: B,
) -> Result<pb::Sealed, tonic::Status>
where
    <B::Request as Sendable>::Response: Receipted,
{
    if body.header().is_none() {
        *body.header() = Some(signer.header());
    }
    let request = B::request(signed(signer, B::PAYLOAD_TYPE, &body));
    let answer = B::call(client.clone(), tonic::Request::new(request)).await?;
    Ok(answer
        .into_inner()
        .receipt()
        .expect("a lifecycle answer carries its receipt"))
}

impl Broker {
    /// `send_lifecycle` on this broker's client, returning the receipt
    /// after checking its signature with the broker's published keys.
    pub async fn act<B: Body>(
        &mut self,
        signer: &Agent,
        body: B,
    ) -> Result<pb::Receipt, tonic::Status>
    where
        <B::Request as Sendable>::Response: Receipted,
    {
        let envelope = send_lifecycle(&mut self.client, signer, body).await?;
        let receipt = decode_receipt(&envelope);
        let keys = self.keys().await;
        verify_with_keys(
            &envelope,
            payload_type::RECEIPT,
            &keys,
            &receipt.broker_key_id,
        );
        Ok(receipt)
    }

    pub async fn accept(
        &mut self,
        delegate: &Agent,
        contract: &[u8],
        host: Option<&Agent>,
    ) -> Result<pb::Receipt, tonic::Status> {
        self.act(delegate, accept_body(contract, host)).await
    }

    pub async fn record(
        &mut self,
        host: &Agent,
        contract: &[u8],
        observations: Vec<pb::Observation>,
    ) -> Result<pb::Receipt, tonic::Status> {
        let body = pb::RecordReceiptsBody {
            header: None,
            contract_id: contract.to_vec(),
            observations,
        };
        self.act(host, body).await
    }

    /// `host` records one observation on `contract`, which must be taken.
    pub async fn observe(
        &mut self,
        host: &Agent,
        contract: &[u8],
        observation: pb::Observation,
    ) -> pb::Receipt {
        self.record(host, contract, vec![observation])
            .await
            .expect("RecordReceipts")
    }

    pub async fn complete(
        &mut self,
        delegate: &Agent,
        body: pb::CompleteBody,
    ) -> Result<pb::Receipt, tonic::Status> {
        self.act(delegate, body).await
    }

    /// Completes, expecting a completion receipt; its judgment.
    pub async fn completion(&mut self, delegate: &Agent, body: pb::CompleteBody) -> pb::Completion {
        self.complete(delegate, body)
            .await
            .expect("Complete")
            .completion
            .expect("a completion")
    }

    pub async fn escalate(
        &mut self,
        delegate: &Agent,
        contract: &[u8],
        reason: &str,
    ) -> Result<pb::Receipt, tonic::Status> {
        let body = pb::EscalateBody {
            header: None,
            contract_id: contract.to_vec(),
            reason: reason.into(),
        };
        self.act(delegate, body).await
    }

    pub async fn revoke(
        &mut self,
        signer: &Agent,
        contract: &[u8],
    ) -> Result<pb::Receipt, tonic::Status> {
        let body = pb::RevokeBody {
            header: None,
            contract_id: contract.to_vec(),
            reason: "no longer needed".into(),
        };
        self.act(signer, body).await
    }

    pub async fn state(&mut self, id: &[u8]) -> pb::ContractState {
        state_via(&mut self.client, id).await
    }
}

/// An Accept body with no header, naming `host` when given.
pub fn accept_body(contract: &[u8], host: Option<&Agent>) -> pb::AcceptBody {
    pb::AcceptBody {
        header: None,
        contract_id: contract.to_vec(),
        host_public_key: host.map(|h| h.public_key().to_vec()).unwrap_or_default(),
    }
}

/// A Complete body with no header and no report.
pub fn complete_body(
    contract: &[u8],
    output_json: &str,
    claim: &str,
    consumed: i64,
) -> pb::CompleteBody {
    pb::CompleteBody {
        header: None,
        contract_id: contract.to_vec(),
        output_json: output_json.into(),
        report: None,
        claim: claim.into(),
        consumed,
    }
}

pub fn mutation(path: &str, units: i64) -> pb::Observation {
    pb::Observation {
        kind: pb::ObservationKind::Mutation as i32,
        path: path.into(),
        tool: String::new(),
        units,
        at_ms: now_ms(),
        ..Default::default()
    }
}

/// The contract's audit, as GetAudit returns it.
pub async fn audit(broker: &mut Broker, id: &[u8]) -> pb::ContractAudit {
    broker
        .client
        .get_audit(pb::GetAuditRequest {
            contract_id: id.to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .audit
        .unwrap()
}

pub fn tool_call(tool: &str, units: i64) -> pb::Observation {
    pb::Observation {
        kind: pb::ObservationKind::ToolCall as i32,
        path: String::new(),
        tool: tool.into(),
        units,
        at_ms: now_ms(),
        ..Default::default()
    }
}

/// The `ErrorInfo.reason` of an error status (empty without one).
pub fn reason(status: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    status
        .get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// Fresh agents, as many as the pattern binds.
pub fn agents<const N: usize>() -> [Agent; N] {
    std::array::from_fn(|_| Agent::generate())
}

/// Asserts an error status's code and `ErrorInfo.reason`.
#[track_caller]
pub fn assert_status(status: &tonic::Status, code: tonic::Code, expected: &str) {
    assert_eq!(
        (status.code(), reason(status).as_str()),
        (code, expected),
        "{status:?}"
    );
}

pub fn contract_request(id: &[u8]) -> pb::GetContractRequest {
    pb::GetContractRequest {
        contract_id: id.to_vec(),
    }
}

/// Contract `id`'s state, read through `client`.
pub async fn state_via(client: &mut SessionClient, id: &[u8]) -> pb::ContractState {
    client
        .get_contract(contract_request(id))
        .await
        .expect("GetContract")
        .into_inner()
        .contract
        .expect("a contract")
}

pub fn receipt_request(id: &[u8]) -> pb::GetReceiptRequest {
    pb::GetReceiptRequest {
        receipt_id: id.to_vec(),
    }
}

/// A Watch of `id`'s tree from its first event.
pub fn watch_request(id: &[u8]) -> pb::WatchRequest {
    pb::WatchRequest {
        contract_id: id.to_vec(),
        cursor: 0,
    }
}

/// Every child of `id`, following `next_page_token` with pages of
/// `page_size`; and how many pages that took.
pub async fn all_children(
    client: &mut SessionClient,
    id: &[u8],
    page_size: u32,
) -> (Vec<pb::ContractState>, usize) {
    let (mut children, mut pages, mut token) = (Vec::new(), 0, Vec::new());
    loop {
        let page = client
            .list_children(pb::ListChildrenRequest {
                contract_id: id.to_vec(),
                page_size,
                page_token: token,
            })
            .await
            .expect("ListChildren")
            .into_inner();
        pages += 1;
        children.extend(page.children);
        token = page.next_page_token;
        if token.is_empty() {
            return (children, pages);
        }
    }
}

/// A fresh PostgreSQL database when this run is on PostgreSQL (for a
/// broker process started by hand); none on SQLite.
pub async fn database_of_this_run()
-> Option<delegation_broker::store::postgres::testing::TestDatabase> {
    if on_postgres() {
        Some(delegation_broker::store::postgres::testing::TestDatabase::migrated().await)
    } else {
        None
    }
}

/// Opens `spec`'s root on any client (a session's or a bare channel's).
pub async fn open_root_on<T>(
    client: &mut BrokerClient<T>,
    orchestrator: &Agent,
    spec: &RootSpec,
) -> pb::IssuedContract
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    client
        .open_root(orchestrator.open_root(spec.body()))
        .await
        .expect("OpenRoot succeeds")
        .into_inner()
        .issued
        .expect("an issued root")
}

/// The broker keys `addr` publishes (asked without a session).
pub async fn published_keys(addr: &str) -> Vec<pb::BrokerKey> {
    connect(addr)
        .await
        .get_broker_keys(pb::GetBrokerKeysRequest {})
        .await
        .expect("GetBrokerKeys")
        .into_inner()
        .keys
}

/// A fake OTLP/gRPC trace collector on port 0 that forwards every export
/// request to `sent`; its endpoint.
pub async fn serve_otlp(
    sent: tokio::sync::mpsc::UnboundedSender<
        opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
    >,
) -> String {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    struct Receiver(tokio::sync::mpsc::UnboundedSender<ExportTraceServiceRequest>);
    #[tonic::async_trait]
    impl TraceService for Receiver {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let _ = self.0.send(request.into_inner());
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(sent)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    endpoint
}

/// Seed 001's delegations under `root`: a liable planner (25, 12 to
/// retry, `predicate`), whose executor of 20 is refused (no retry
/// headroom) and of 13 issued; the planner's and the executor's ids.
pub async fn seed_001_delegations(
    broker: &mut Broker,
    root: &Root,
    [orchestrator, planner, executor]: [&Agent; 3],
    predicate: &str,
) -> (Vec<u8>, Vec<u8>) {
    let mut to_planner = root.liable_child(planner, 25, predicate);
    to_planner.min_retry_cost = 12;
    let planner_id = broker.issue(orchestrator, to_planner).await;
    let mut to_executor = liable_child(&planner_id, &root.lineage, executor, 20, "");
    to_executor.min_retry_cost = 12;
    broker.refuse(planner, to_executor.clone()).await;
    to_executor.budget = 13;
    let executor_id = broker.issue(planner, to_executor).await;
    (planner_id, executor_id)
}

/// Asserts every contract of `ids` is stored, read through `client`.
pub async fn assert_stored(client: &mut SessionClient, ids: &[Vec<u8>]) {
    for id in ids {
        let state = client
            .get_contract(contract_request(id))
            .await
            .unwrap_or_else(|e| panic!("answered contract {} lost: {e}", hex::encode(id)));
        assert!(state.into_inner().contract.is_some());
    }
}

/// `count` siblings of `budget` under `root` at once, each on a client of
/// its own connected to `addrs` in turn; every answer, in the order sent.
pub async fn race_siblings(
    addrs: &[String],
    orchestrator: &Arc<Agent>,
    root: &Root,
    count: usize,
    budget: i64,
) -> Vec<Result<Outcome, tonic::Status>> {
    let mut tasks = Vec::new();
    for i in 0..count {
        let mut client = connect(&addrs[i % addrs.len()]).await;
        let orchestrator = orchestrator.clone();
        let body = root.child(&Agent::generate(), budget);
        tasks.push(tokio::spawn(async move {
            client
                .delegate(orchestrator.delegate(body))
                .await
                .map(|r| Outcome::from(r.into_inner().outcome.expect("an outcome")))
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    outcomes
}

/// 64 siblings of 10 at once from a root of 300, sent through `addrs`
/// (`broker` among them): exactly 30 issued and 34 signed
/// BUDGET_EXCEEDS_PARENT refusals, no other answer, and every ledger of
/// the tree balances.
pub async fn assert_siblings_never_overspend(broker: &mut Broker, addrs: &[String]) {
    let orchestrator = Arc::new(Agent::generate());
    let spec = RootSpec::with(|s| (s.budget, s.max_children) = (300, 64));
    let root = broker.open_root(&orchestrator, spec).await;
    let outcomes = race_siblings(addrs, &orchestrator, &root, 64, 10).await;
    let (mut issued, mut refused) = (0, 0);
    let keys = broker.keys().await;
    for outcome in outcomes {
        match outcome.unwrap_or_else(|e| panic!("every answer is issued or refused: {e:?}")) {
            Outcome::Issued { .. } => issued += 1,
            outcome @ Outcome::Refused { .. } => {
                let (_, envelope, receipt) = outcome.refused();
                assert_eq!(
                    codes(&receipt),
                    vec![pb::InvariantCode::BudgetExceedsParent]
                );
                // Signed by whichever broker answered; every key is
                // published by each.
                verify_with_keys(
                    &envelope,
                    payload_type::RECEIPT,
                    &keys,
                    &receipt.broker_key_id,
                );
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
}

/// The `field` an INVALID_ARGUMENT status names (empty without one).
pub fn field(status: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    status
        .get_details_error_info()
        .and_then(|i| i.metadata.get("field").cloned())
        .unwrap_or_default()
}

/// Runs `command` to its end, which must succeed; its stdout.
pub fn stdout_of(command: &mut std::process::Command) -> String {
    let out = command.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
