//! The SQL both backends share, as one ordinary module generic over the
//! seam between them:
//! - `Dialect` is what differs in a database: how rows are locked, how
//!   many parameters a statement may bind, how event seqs are reserved.
//!   Its supertraits (`Binds`, `Gets`, `Exec`) state sqlx's per-type
//!   bounds once, so generic code never repeats them: bind with `.arg(v)`,
//!   `.push_arg(v)`, read with `.cell::<T>(column)`, run with `.all(conn)`.
//! - `Backend` is what differs in a store: its writer queue and when a read
//!   may answer (`settle`); the state every store shares (read pool,
//!   writer cache, judges) is `Shared`, built once here.
//!
//! Everything here is compiled once; each backend names its dialect
//! (`sqlx::Sqlite`, `sqlx::Postgres`) and nothing else.

pub(crate) mod audit;
pub(crate) mod drain;
pub(crate) mod judge;
pub(crate) mod lifecycle;
pub(crate) mod plan;
pub(crate) mod reads;
pub(crate) mod requests;
pub(crate) mod rows;
pub(crate) mod source;
pub(crate) mod writes;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sqlx::query::Query;
use sqlx::query_builder::Separated;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, QueryBuilder, Type};

use crate::batch::{Command, KnownMap, SeqSource};
use crate::{Answer, StoreError};
use broker_domain::{AgentKey, Id};
use broker_wire::clock::Clock;

/// sqlx's boxed future and stream, as its executors return them.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
pub(crate) type BoxStream<'a, T> = Pin<Box<dyn tokio_stream::Stream<Item = T> + Send + 'a>>;

/// What differs between the SQL databases the shared code runs on.
pub(crate) trait Dialect:
    Database
    + Exec
    + for<'a> Binds<'a, i64>
    + for<'a> Binds<'a, Option<i64>>
    + for<'a> Binds<'a, Vec<u8>>
    + for<'a> Binds<'a, Option<Vec<u8>>>
    + for<'a> Binds<'a, &'a [u8]>
    + for<'a> Binds<'a, Option<&'a [u8]>>
    + for<'a> Binds<'a, &'a str>
    + Gets<i64>
    + Gets<Option<i64>>
    + Gets<bool>
    + Gets<String>
    + Gets<Vec<u8>>
    + Gets<Option<Vec<u8>>>
{
    /// Appended to a `SELECT` whose rows the transaction must lock
    /// (PostgreSQL's `FOR UPDATE`; SQLite's one writer needs nothing).
    const LOCK_ROWS: &'static str;
    /// Where a transaction takes event seqs from (SQLite: the writer's
    /// counter; PostgreSQL: blocks reserved from a sequence).
    type Seqs: SeqSource + Send;
    /// Makes `seqs` hold at least `count` more seqs.
    fn reserve_seqs(
        conn: &mut Self::Connection,
        seqs: &mut Self::Seqs,
        count: usize,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// `T` binds as a parameter of `Self`'s statements (encoded for `'t`):
/// sqlx's `Encode + Type` bound, stated once (a supertrait of `Dialect`).
pub(crate) trait Binds<'t, T>: Database {
    fn bind_to<'q>(
        query: Query<'q, Self, Self::Arguments>,
        value: T,
    ) -> Query<'q, Self, Self::Arguments>;
    fn push_to(builder: &mut QueryBuilder<Self>, value: T);
    fn push_listed(list: &mut Separated<'_, Self, &'static str>, value: T);
}

impl<'t, D: Database, T> Binds<'t, T> for D
where
    T: Encode<'t, D> + Type<D>,
{
    fn bind_to<'q>(query: Query<'q, D, D::Arguments>, value: T) -> Query<'q, D, D::Arguments> {
        query.bind(value)
    }
    fn push_to(builder: &mut QueryBuilder<D>, value: T) {
        builder.push_bind(value);
    }
    fn push_listed(list: &mut Separated<'_, D, &'static str>, value: T) {
        list.push_bind(value);
    }
}

/// A column of `Self`'s rows decodes as `T`: sqlx's `Decode + Type` bound,
/// stated once.
pub(crate) trait Gets<T>: Database {
    fn get(row: &Self::Row, column: &str) -> Result<T, sqlx::Error>;
}

impl<D: Database, T> Gets<T> for D
where
    T: for<'r> Decode<'r, D> + Type<D>,
    for<'a> &'a str: ColumnIndex<D::Row>,
{
    fn get(row: &D::Row, column: &str) -> Result<T, sqlx::Error> {
        sqlx::Row::try_get(row, column)
    }
}

/// Statements run on a connection of `Self`: sqlx's executor bound,
/// stated once. (A pool is used through a connection it lends.)
pub(crate) trait Exec: Database {
    fn fetch_all<'c, 'q: 'c>(
        conn: &'c mut Self::Connection,
        query: Query<'q, Self, Self::Arguments>,
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>>;
    fn fetch_optional<'c, 'q: 'c>(
        conn: &'c mut Self::Connection,
        query: Query<'q, Self, Self::Arguments>,
    ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>>;
    fn execute<'c, 'q: 'c>(
        conn: &'c mut Self::Connection,
        query: Query<'q, Self, Self::Arguments>,
    ) -> BoxFuture<'c, Result<Self::QueryResult, sqlx::Error>>;
    fn fetch<'c, 'q: 'c>(
        conn: &'c mut Self::Connection,
        query: Query<'q, Self, Self::Arguments>,
    ) -> BoxStream<'c, Result<Self::Row, sqlx::Error>>;
    /// Bytes of a row's large columns (`envelope`, `path`) where present,
    /// read in place: what an audit's byte budget charges.
    fn large_columns_len(row: &Self::Row) -> usize;
}

impl<D: Database> Exec for D
where
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'r> &'r [u8]: Decode<'r, D> + Type<D>,
    for<'r> &'r str: Decode<'r, D> + Type<D> + ColumnIndex<D::Row>,
{
    fn fetch_all<'c, 'q: 'c>(
        conn: &'c mut D::Connection,
        query: Query<'q, D, D::Arguments>,
    ) -> BoxFuture<'c, Result<Vec<D::Row>, sqlx::Error>> {
        Executor::fetch_all(conn, query)
    }
    fn fetch_optional<'c, 'q: 'c>(
        conn: &'c mut D::Connection,
        query: Query<'q, D, D::Arguments>,
    ) -> BoxFuture<'c, Result<Option<D::Row>, sqlx::Error>> {
        Executor::fetch_optional(conn, query)
    }
    fn execute<'c, 'q: 'c>(
        conn: &'c mut D::Connection,
        query: Query<'q, D, D::Arguments>,
    ) -> BoxFuture<'c, Result<D::QueryResult, sqlx::Error>> {
        Executor::execute(conn, query)
    }
    fn fetch<'c, 'q: 'c>(
        conn: &'c mut D::Connection,
        query: Query<'q, D, D::Arguments>,
    ) -> BoxStream<'c, Result<D::Row, sqlx::Error>> {
        Executor::fetch(conn, query)
    }
    fn large_columns_len(row: &D::Row) -> usize {
        use sqlx::Row;
        row.try_get::<&[u8], _>("envelope")
            .map_or(0, <[u8]>::len)
            .saturating_add(row.try_get::<&str, _>("path").map_or(0, str::len))
    }
}

/// Binding and running a query of a `Dialect`, written as sqlx's own
/// methods would be (`.arg` for `.bind`: an inherent method would shadow it).
pub(crate) trait QueryExt<'q, D: Exec>: Sized {
    fn arg<'t, T>(self, value: T) -> Self
    where
        D: Binds<'t, T>;
    fn all<'c>(
        self,
        conn: &'c mut D::Connection,
    ) -> BoxFuture<'c, Result<Vec<D::Row>, sqlx::Error>>
    where
        'q: 'c;
    fn optional<'c>(
        self,
        conn: &'c mut D::Connection,
    ) -> BoxFuture<'c, Result<Option<D::Row>, sqlx::Error>>
    where
        'q: 'c;
    fn run<'c>(
        self,
        conn: &'c mut D::Connection,
    ) -> BoxFuture<'c, Result<D::QueryResult, sqlx::Error>>
    where
        'q: 'c;
    fn rows<'c>(self, conn: &'c mut D::Connection) -> BoxStream<'c, Result<D::Row, sqlx::Error>>
    where
        'q: 'c;
}

impl<'q, D: Exec> QueryExt<'q, D> for Query<'q, D, D::Arguments> {
    fn arg<'t, T>(self, value: T) -> Self
    where
        D: Binds<'t, T>,
    {
        D::bind_to(self, value)
    }
    fn all<'c>(self, conn: &'c mut D::Connection) -> BoxFuture<'c, Result<Vec<D::Row>, sqlx::Error>>
    where
        'q: 'c,
    {
        D::fetch_all(conn, self)
    }
    fn optional<'c>(
        self,
        conn: &'c mut D::Connection,
    ) -> BoxFuture<'c, Result<Option<D::Row>, sqlx::Error>>
    where
        'q: 'c,
    {
        D::fetch_optional(conn, self)
    }
    fn run<'c>(
        self,
        conn: &'c mut D::Connection,
    ) -> BoxFuture<'c, Result<D::QueryResult, sqlx::Error>>
    where
        'q: 'c,
    {
        D::execute(conn, self)
    }
    fn rows<'c>(self, conn: &'c mut D::Connection) -> BoxStream<'c, Result<D::Row, sqlx::Error>>
    where
        'q: 'c,
    {
        D::fetch(conn, self)
    }
}

/// `.push_arg(v)` for a query builder or a separated list of one.
pub(crate) trait PushArg<D: Database> {
    fn push_arg<'t, T>(&mut self, value: T) -> &mut Self
    where
        D: Binds<'t, T>;
}

impl<D: Database> PushArg<D> for QueryBuilder<D> {
    fn push_arg<'t, T>(&mut self, value: T) -> &mut Self
    where
        D: Binds<'t, T>,
    {
        D::push_to(self, value);
        self
    }
}

impl<D: Database> PushArg<D> for Separated<'_, D, &'static str> {
    fn push_arg<'t, T>(&mut self, value: T) -> &mut Self
    where
        D: Binds<'t, T>,
    {
        D::push_listed(self, value);
        self
    }
}

/// `.cell::<T>(column)`: one column of a row of a `Dialect`.
pub(crate) trait Cell {
    type Db: Database;
    fn cell<T>(&self, column: &str) -> Result<T, sqlx::Error>
    where
        Self::Db: Gets<T>;
}

impl<R: sqlx::Row> Cell for R {
    type Db = R::Database;
    fn cell<T>(&self, column: &str) -> Result<T, sqlx::Error>
    where
        R::Database: Gets<T>,
    {
        <R::Database as Gets<T>>::get(self, column)
    }
}

/// What differs between the stores built on the shared SQL.
pub(crate) trait Backend: Send + Sync {
    type Db: Dialect;
    /// The state every SQL store holds (`Shared`).
    fn sql(&self) -> &Shared<Self::Db>;
    /// Waits until everything a read could have seen is durable (SQLite
    /// acknowledges commits before they are synced; PostgreSQL after).
    fn settle(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// Opens a root through the writer(s): stamped here, on the caller's task.
pub(crate) async fn open_root<B: Backend>(
    store: &B,
    root: broker_wire::command::NewRoot,
) -> Result<Answer, StoreError> {
    let sql = store.sql();
    let stamped = sql.stamper.root(&root, sql.clock.now_ms());
    sql.submit(Command::OpenRoot(Box::new(root), Box::new(stamped)))
        .await
}

/// Runs `f` before each judgment (tests: to hold a judge busy or record
/// observations while it runs).
#[derive(Clone)]
pub struct BeforeJudge(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for BeforeJudge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeJudge")
    }
}

/// The parts of a backend's options the shared state is built from.
pub(crate) struct SharedOptions {
    pub(crate) judgment_deadline_ms: u64,
    pub(crate) before_judge: Option<BeforeJudge>,
    pub(crate) max_audit_rows: i64,
    pub(crate) max_audit_bytes: usize,
    pub(crate) tenants: Arc<broker_domain::tenant::Tenants>,
}

/// Contracts' terms (and, on SQLite, status and ledger) as the writer last
/// planned them; readers take an issuing parent's terms from it.
pub(crate) type KnownCache = Arc<Mutex<KnownMap>>;

/// The state every SQL store shares, built in one place (`Shared::new`).
pub(crate) struct Shared<D: Database> {
    /// Queue to the store's writer(s); they stop when every sender is gone.
    pub(crate) commands: tokio::sync::mpsc::Sender<(Command, crate::Reply)>,
    /// Signs what is stamped on callers' tasks (roots, speculative children).
    pub(crate) stamper: Arc<broker_wire::stamp::Stamper>,
    /// Connections for queries (read-only on SQLite).
    pub(crate) reader: sqlx::Pool<D>,
    /// The writer's cache of contracts, shared with readers.
    pub(crate) known: KnownCache,
    pub(crate) clock: Arc<dyn Clock>,
    /// The threads that judge completions, `crate::limits::MAX_CONCURRENT_JUDGMENTS`
    /// of them with deep stacks (CEL recurses); they stop when the store
    /// is dropped.
    pub(crate) judges: crate::pool::WorkPool,
    /// How long a completion may wait for a judge.
    pub(crate) judgment_deadline: Duration,
    /// Completions being judged, one per contract (a second one waits for
    /// the first to be answered).
    pub(crate) judging_contracts: Arc<crate::slots::Slots<Id>>,
    /// Completions being judged per signing key: one delegate cannot take
    /// every judge.
    pub(crate) judging_signers: Arc<crate::slots::Slots<AgentKey>>,
    pub(crate) before_judge: Option<BeforeJudge>,
    /// Rows one audit read may load.
    pub(crate) max_audit_rows: i64,
    /// Bytes of envelopes and paths one audit read may load.
    pub(crate) max_audit_bytes: usize,
    /// A tree's tenant by its opener (`core::tenant`).
    pub(crate) tenants: Arc<broker_domain::tenant::Tenants>,
}

impl<D: Database> Shared<D> {
    /// A read connection; a pool that cannot lend one is a backend error.
    pub(crate) async fn read(&self) -> Result<sqlx::pool::PoolConnection<D>, StoreError> {
        self.reader.acquire().await.map_err(crate::backend)
    }

    /// Queues `command` for the writer(s) and waits for its answer.
    pub(crate) async fn submit(&self, command: Command) -> Result<Answer, StoreError> {
        crate::submit(&self.commands, command).await
    }

    /// Commands waiting for the writer(s) now.
    pub(crate) fn queue_depth(&self) -> usize {
        self.commands.max_capacity() - self.commands.capacity()
    }

    pub(crate) fn new(
        commands: tokio::sync::mpsc::Sender<(Command, crate::Reply)>,
        stamper: Arc<broker_wire::stamp::Stamper>,
        reader: sqlx::Pool<D>,
        known: KnownCache,
        clock: Arc<dyn Clock>,
        options: SharedOptions,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            commands,
            stamper,
            reader,
            known,
            clock,
            judges: crate::pool::WorkPool::start(
                "store-judge",
                crate::limits::MAX_CONCURRENT_JUDGMENTS,
                crate::limits::JUDGE_STACK_BYTES,
            )
            .map_err(|e| StoreError::Backend(format!("judge threads: {e}")))?,
            judgment_deadline: Duration::from_millis(options.judgment_deadline_ms.max(1)),
            judging_contracts: crate::slots::Slots::new(
                usize::MAX,
                "judgments",
                1,
                "JUDGMENT_IN_PROGRESS",
            ),
            judging_signers: crate::slots::Slots::new(
                usize::MAX,
                "judgments",
                crate::limits::MAX_JUDGMENTS_PER_SIGNER,
                "MAX_JUDGMENTS_PER_SIGNER",
            ),
            before_judge: options.before_judge,
            max_audit_rows: options.max_audit_rows.max(1),
            max_audit_bytes: options.max_audit_bytes.max(1),
            tenants: options.tenants,
        })
    }
}

/// Locks the writer's cache; a poisoned one is cleared, once (readers
/// take it only as a hint, and the writer reloads what it misses).
pub(crate) fn lock(known: &KnownCache) -> MutexGuard<'_, KnownMap> {
    known.lock().unwrap_or_else(|poisoned| {
        let mut guard = poisoned.into_inner();
        guard.clear();
        known.clear_poison();
        guard
    })
}

/// A database error the store makes itself — SQLite's answer to one of
/// the writer's own statements, a PostgreSQL SQLSTATE in tests — reported
/// as sqlx reports the driver's, so callers match both the same way.
#[derive(Debug)]
pub(crate) struct CodedError {
    code: String,
    message: String,
    kind: sqlx::error::ErrorKind,
}

impl CodedError {
    pub(crate) fn error(
        code: String,
        message: String,
        kind: sqlx::error::ErrorKind,
    ) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Self {
            code,
            message,
            kind,
        }))
    }
}

impl std::fmt::Display for CodedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // sqlx's wording, so logs read the same either way.
        write!(f, "(code: {}) {}", self.code, self.message)
    }
}

impl std::error::Error for CodedError {}

impl sqlx::error::DatabaseError for CodedError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(self.code.as_str().into())
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        match self.kind {
            sqlx::error::ErrorKind::UniqueViolation => sqlx::error::ErrorKind::UniqueViolation,
            sqlx::error::ErrorKind::ForeignKeyViolation => {
                sqlx::error::ErrorKind::ForeignKeyViolation
            }
            sqlx::error::ErrorKind::NotNullViolation => sqlx::error::ErrorKind::NotNullViolation,
            sqlx::error::ErrorKind::CheckViolation => sqlx::error::ErrorKind::CheckViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}
