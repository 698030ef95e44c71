//! [`PgStore`]: the procedure store on PostgreSQL (the `postgres` feature), for engines
//! that must outlive their machine: the database is the replicated state, and a
//! standby engine on another machine loads it.
//!
//! One row per live procedure (`proctor_procs`: the record as MessagePack, with its
//! id, root, parent, type and state beside it for operators' SQL), one row of
//! bookkeeping (`proctor_meta`: the highest id written, the drained-stop mark), the
//! schema's version (`proctor_schema`) and the leader lease (`proctor_lease`), all in
//! one PostgreSQL schema of the store's own (`proctor` by default), created by the
//! store on first use. A group-commit batch is one transaction: its ops folded to the
//! last op per procedure (a batch may update one procedure several times), one upsert
//! of every written record and one delete of every removed one, so PostgreSQL sees
//! batches, not records.
//!
//! **Fencing**: a store given a lease epoch ([`ProcedureStore::fence`]) checks, inside each
//! write transaction, that the lease row still carries that epoch, holding the row
//! (`FOR SHARE`) until the commit: a standby that takes the lease bumps the epoch with
//! an `UPDATE` of that row, which waits for the commit, so every write of a deposed
//! leader either commits before the takeover (and the new leader's load sees it) or
//! fails with [`StoreError::Fenced`], whatever the clocks say.
//!
//! **Connection loss**: a write or load that fails on a broken connection reconnects
//! and tries again, with backoff, for up to [`PgOptions::retry_for`]; a batch is written
//! again whole (its upserts and deletes are idempotent, so a commit whose answer was
//! lost is harmless to repeat). Past that, the error stands and the store refuses
//! appends, as any failed store does.
//!
//! The client is the synchronous `postgres` crate, which runs its own single-thread
//! tokio runtime: it lives on a thread of the store's own, so the store's methods may
//! be called from any thread, an async runtime's included.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::{Client, NoTls, Transaction};

pub(crate) mod cluster;
mod lease;
pub(crate) use lease::{lost_reason, Loss};
pub use lease::{Leadership, LeaseState, PgLease};
#[cfg(feature = "simulation")]
pub(crate) use lease::{LeaseStatements, StopSignal, Taken};

use crate::fast_map::IdMap;
use crate::procedure::ProcId;
use crate::record::{ProcRecord, StoreOp};
use crate::store::{LastStop, ProcedureStore, StoreError, StoreSnapshot};

/// How a [`PgStore`] connects and where it keeps its tables.
#[derive(Clone, Debug)]
pub struct PgOptions {
    schema: String,
    retry_for: Duration,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            schema: "proctor".to_string(),
            retry_for: Duration::from_secs(30),
        }
    }
}

impl PgOptions {
    /// The schema's name.
    pub(crate) fn schema_name(&self) -> &str {
        &self.schema
    }

    /// The PostgreSQL schema (namespace) of the store's tables: `proctor` by default.
    /// Letters, digits and `_`, starting with a letter or `_`, at most 63 bytes.
    #[must_use]
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// How long a write or load keeps reconnecting after the connection broke before it
    /// fails (30 s by default).
    #[must_use]
    pub fn retry_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }
}

/// The procedure store on PostgreSQL (see the module docs).
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use proctor::{Executor, PgStore};
///
/// let store = PgStore::connect("postgresql://proctor@db.internal/control")?;
/// let executor: Executor = Executor::builder().store(store).start().await?;
/// # Ok(()) }
/// ```
pub struct PgStore {
    requests: Option<mpsc::Sender<Request>>,
    /// The cluster partition it is the store of, if any.
    part: Option<u32>,
    thread: Option<thread::JoinHandle<()>>,
    schema: String,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// What the store's thread is asked to do.
enum Request {
    Append(
        Vec<StoreOp>,
        mpsc::Sender<(Result<(), StoreError>, Vec<StoreOp>)>,
    ),
    Load(mpsc::Sender<Result<StoreSnapshot, StoreError>>),
    Mark(Option<Vec<ProcId>>, mpsc::Sender<Result<(), StoreError>>),
    Fence(Option<i64>),
}

impl PgStore {
    /// The version of the store's tables this build creates and reads: a store made by
    /// a newer one is refused ([`StoreError::Schema`]).
    pub const SCHEMA_VERSION: i32 = 2;

    /// Connects to the database at `url` (a `postgresql://` URL or a key-value string,
    /// as libpq takes them) and makes sure the store's tables exist, in the `proctor`
    /// schema.
    ///
    /// # Errors
    /// [`StoreError::Database`] if it cannot connect (a wrong address, wrong
    /// credentials) or create the tables; [`StoreError::Schema`] if the tables were
    /// made by a newer version of proctor.
    pub fn connect(url: &str) -> Result<PgStore, StoreError> {
        PgStore::connect_with(url, PgOptions::default())
    }

    /// [`connect`](Self::connect) with options.
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`StoreError::Database`] for a schema name that is
    /// not a plain identifier.
    pub fn connect_with(url: &str, options: PgOptions) -> Result<PgStore, StoreError> {
        Self::open(url, options, Scope::Whole)
    }

    /// The store of one partition of a cluster: it loads and writes that partition's
    /// procedures only, fenced with the partition's epoch.
    pub(crate) fn partition(
        url: &str,
        options: PgOptions,
        part: u32,
    ) -> Result<PgStore, StoreError> {
        let part_i32 = i32::try_from(part).map_err(|_| StoreError::Database {
            context: "opening a partition's store".to_string(),
            reason: format!("partition {part} is out of range"),
        })?;
        Self::open(url, options, Scope::Part(part_i32))
    }

    fn open(url: &str, options: PgOptions, scope: Scope) -> Result<PgStore, StoreError> {
        check_identifier(&options.schema)?;
        let (ready_tx, ready_rx) = mpsc::channel();
        let (requests, inbox) = mpsc::channel();
        let url = url.to_string();
        let schema = options.schema.clone();
        let thread = thread::Builder::new()
            .name("proctor-pg".to_string())
            .spawn(move || {
                let mut conn = match Conn::open(url, options, scope) {
                    Ok(conn) => {
                        let _ = ready_tx.send(Ok(()));
                        conn
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                conn.serve(&inbox);
            })
            .map_err(|e| StoreError::Io {
                context: "starting the PostgreSQL store's thread".to_string(),
                source: e,
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(PgStore {
                requests: Some(requests),
                part: scope.part().and_then(|p| u32::try_from(p).ok()),
                thread: Some(thread),
                schema,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(gone())
            }
        }
    }

    /// Reads a store without opening it (an operator's view, beside a running leader
    /// or not): its procedures as [`load`](ProcedureStore::load) gives them, and its
    /// lease. Makes no table and takes no lease; blocking (from a runtime, through
    /// `spawn_blocking`).
    ///
    /// # Errors
    /// [`StoreError::Database`] if the database cannot be reached or the schema holds
    /// no store; [`StoreError::Schema`] for a store of a newer proctor.
    pub fn inspect(
        url: &str,
        options: &PgOptions,
    ) -> Result<(StoreSnapshot, LeaseState), StoreError> {
        check_identifier(&options.schema)?;
        let schema = options.schema.as_str();
        let read = || -> Result<(StoreSnapshot, LeaseState), Failure> {
            let mut client =
                Client::connect(url, NoTls).map_err(|e| failure("connecting to PostgreSQL", &e))?;
            let context = "reading the store's version";
            let version: Option<i32> = client
                .query_opt(
                    "SELECT to_regclass($1)::text",
                    &[&format!("{schema}.proctor_schema")],
                )
                .map_err(|e| failure(context, &e))?
                .and_then(|row| row.get::<_, Option<String>>(0))
                .map(|_| {
                    client
                        .query_one(
                            &format!("SELECT version FROM {schema}.proctor_schema WHERE id = 1"),
                            &[],
                        )
                        .map(|row| row.get(0))
                        .map_err(|e| failure(context, &e))
                })
                .transpose()?;
            let Some(version) = version else {
                return Err(not_retried(StoreError::Database {
                    context: "inspecting the store".to_string(),
                    reason: format!("schema {schema:?} holds no proctor store"),
                }));
            };
            check_version(version)?;
            // Beside a leader too: inspection writes nothing.
            let snapshot = load(&mut client, schema, Scope::Everything, false)?;
            let lease = lease::read(&mut client, schema).map_err(not_retried)?;
            Ok((snapshot, lease))
        };
        std::thread::scope(|s| s.spawn(|| read().map_err(|f| f.error)).join()).unwrap_or_else(
            |_| {
                Err(StoreError::Failed(
                    "the inspection's thread panicked".into(),
                ))
            },
        )
    }

    /// Reads the cluster in a store (an operator's view): its partitions with their
    /// owners and epochs, its members, its coordinator and its newest moves; `None` if
    /// the store holds no cluster. Blocking, as [`inspect`](Self::inspect).
    ///
    /// # Errors
    /// [`StoreError::Database`] if the database cannot be reached.
    pub fn inspect_cluster(
        url: &str,
        options: &PgOptions,
    ) -> Result<Option<crate::actors::ClusterState>, StoreError> {
        let mut db = cluster::ClusterDb::new(url, options)?;
        std::thread::scope(|s| s.spawn(move || db.state()).join()).unwrap_or_else(|_| {
            Err(StoreError::Failed(
                "the inspection's thread panicked".into(),
            ))
        })
    }

    /// The PostgreSQL schema its tables are in.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    fn ask<T>(&self, request: impl FnOnce(mpsc::Sender<T>) -> Request) -> Result<T, StoreError> {
        let requests = self.requests.as_ref().ok_or_else(gone)?;
        let (tx, rx) = mpsc::channel();
        requests.send(request(tx)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Closing the channel ends the thread, which closes the connection.
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl ProcedureStore for PgStore {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        let mut ops = ops.to_vec();
        self.append_owned(&mut ops)
    }

    fn append_owned(&mut self, ops: &mut Vec<StoreOp>) -> Result<(), StoreError> {
        let batch = std::mem::take(ops);
        let (result, mut emptied) = self.ask(|tx| Request::Append(batch, tx))?;
        emptied.clear();
        *ops = emptied;
        result
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        self.ask(Request::Load)?
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        let cut_off = cut_off.to_vec();
        self.ask(|tx| Request::Mark(Some(cut_off), tx))?
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.ask(|tx| Request::Mark(None, tx))?
    }

    /// Fences every later write with `epoch` (see the module docs): a write after a
    /// newer leader took the lease fails with [`StoreError::Fenced`], and the store
    /// refuses appends from then on.
    fn fence(&mut self, epoch: Option<i64>) -> Result<(), StoreError> {
        let requests = self.requests.as_ref().ok_or_else(gone)?;
        requests.send(Request::Fence(epoch)).map_err(|_| gone())
    }

    fn status(&self) -> crate::store::StoreStatus {
        let mut facts = vec![("schema", self.schema.clone())];
        if let Some(part) = self.part {
            facts.push(("partition", part.to_string()));
        }
        crate::store::StoreStatus {
            kind: "postgres",
            facts,
        }
    }
}

fn gone() -> StoreError {
    StoreError::Failed("the PostgreSQL store's thread has stopped".to_string())
}

/// A schema name the store may put in its SQL.
fn check_identifier(name: &str) -> Result<(), StoreError> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if first_ok && rest_ok && name.len() <= 63 {
        Ok(())
    } else {
        Err(StoreError::Database {
            context: "PostgreSQL store options".to_string(),
            reason: format!("schema name {name:?} is not a plain identifier"),
        })
    }
}

/// What a store holds: the whole schema (one engine, or a leader and standbys), or one
/// partition of a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    Whole,
    Part(i32),
    /// Every row, of a store or a cluster: an operator's inspection.
    Everything,
}

impl Scope {
    /// The partition, as the statements take it (`NULL` for the whole store's rows).
    fn part(self) -> Option<i32> {
        match self {
            Scope::Whole | Scope::Everything => None,
            Scope::Part(p) => Some(p),
        }
    }
}

/// The store's connection, on its thread.
struct Conn {
    url: String,
    options: PgOptions,
    scope: Scope,
    /// The connection and its prepared write statement.
    client: Option<(Client, postgres::Statement)>,
    /// The lease epoch writes are fenced with.
    fence: Option<i64>,
    /// An append failed: every later one fails with this.
    failed: Option<String>,
}

/// A database call's failure: whether trying again on a new connection may help.
struct Failure {
    error: StoreError,
    retry: bool,
}

impl Conn {
    fn open(url: String, options: PgOptions, scope: Scope) -> Result<Conn, StoreError> {
        let mut conn = Conn {
            url,
            options,
            scope,
            client: None,
            fence: None,
            failed: None,
        };
        // At start, a database that does not answer is an error at once, not a wait;
        // the tables are made before the write statement is prepared against them.
        let mut client = Client::connect(&conn.url, NoTls)
            .map_err(|e| failure("connecting to PostgreSQL", &e).error)?;
        create_schema(&mut client, &conn.options.schema).map_err(|f| f.error)?;
        conn.client = Some(conn.prepared(client).map_err(|f| f.error)?);
        Ok(conn)
    }

    /// A new connection, with the write statement prepared.
    fn connect(&self) -> Result<(Client, postgres::Statement), Failure> {
        let client = Client::connect(&self.url, NoTls)
            .map_err(|e| failure("connecting to PostgreSQL", &e))?;
        self.prepared(client)
    }

    /// `client`, its session named and the write statement prepared on it.
    fn prepared(&self, mut client: Client) -> Result<(Client, postgres::Statement), Failure> {
        // Every statement names the store's schema; a session setting would be lost
        // with the connection.
        client
            .batch_execute("SET application_name = 'proctor'")
            .map_err(|e| failure("configuring the PostgreSQL session", &e))?;
        let write = client
            .prepare(&write_sql(&self.options.schema, self.scope))
            .map_err(|e| failure("preparing the store's write", &e))?;
        Ok((client, write))
    }

    /// The refusal of a store whose append failed.
    fn refusal(&self) -> Result<(), StoreError> {
        match &self.failed {
            Some(reason) => Err(StoreError::Failed(reason.clone())),
            None => Ok(()),
        }
    }

    fn serve(&mut self, inbox: &mpsc::Receiver<Request>) {
        while let Ok(request) = inbox.recv() {
            match request {
                Request::Append(mut ops, tx) => {
                    let result = self.append(&ops);
                    ops.clear();
                    let _ = tx.send((result, ops));
                }
                Request::Load(tx) => {
                    // An engine without the lease does not start beside a leader.
                    let refuse_beside_leader = self.fence.is_none();
                    let scope = self.scope;
                    let _ = tx.send(self.with_retry("loading the store", |s, c, _| {
                        load(c, s, scope, refuse_beside_leader)
                    }));
                }
                Request::Mark(cut_off, tx) => {
                    let fence = self.fence;
                    let scope = self.scope;
                    let result = self.refusal().and_then(|()| {
                        self.with_retry("marking the store's stop", |s, c, _| {
                            mark(c, s, scope, fence, cut_off.as_deref())
                        })
                    });
                    let _ = tx.send(result);
                }
                Request::Fence(epoch) => self.fence = epoch,
            }
        }
    }

    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        self.refusal()?;
        if ops.is_empty() {
            return Ok(());
        }
        let batch = Batch::fold(ops)?;
        let fence = self.fence;
        let scope = self.scope;
        let result = self.with_retry("appending to the store", |s, c, write| {
            write_batch(c, s, scope, fence, &batch, write)
        });
        if let Err(e) = &result {
            self.failed = Some(e.to_string());
        }
        result
    }

    /// Runs `call` on the connection, reconnecting and trying again while the failure
    /// is the connection's, for up to `retry_for`.
    fn with_retry<T>(
        &mut self,
        what: &str,
        mut call: impl FnMut(&str, &mut Client, &postgres::Statement) -> Result<T, Failure>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            match self.attempt(&mut call) {
                Ok(value) => return Ok(value),
                Err(Failure { error, retry }) => {
                    if !retry || started.elapsed() + delay > self.options.retry_for {
                        return Err(error);
                    }
                    tracing::warn!(target: crate::targets::STORE, %error, delay_ms = delay.as_millis() as u64, "{what}: the PostgreSQL connection failed; reconnecting");
                    self.client = None;
                    thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// One try of `call`, on the connection or, after a failed one, a new connection.
    fn attempt<T>(
        &mut self,
        call: &mut impl FnMut(&str, &mut Client, &postgres::Statement) -> Result<T, Failure>,
    ) -> Result<T, Failure> {
        let connected = match self.client.take() {
            Some(connected) => connected,
            None => self.connect()?,
        };
        let (client, write) = self.client.insert(connected);
        call(&self.options.schema, client, write)
    }
}

/// A database error as a store error: a broken connection (or a server shutting down
/// or starting) may be retried on a new connection; anything else may not.
fn failure(context: &str, e: &postgres::Error) -> Failure {
    let retry = e.is_closed()
        || e.code().is_none_or(|code| {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                ]
                .contains(code)
        });
    // An error without a code is the client's (IO, protocol): the connection's.
    Failure {
        error: StoreError::Database {
            context: context.to_string(),
            reason: describe(e),
        },
        retry,
    }
}

/// The server's message (with its detail) or the client's error.
fn describe(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_string(),
        },
        None => e.to_string(),
    }
}

fn not_retried(error: StoreError) -> Failure {
    Failure {
        error,
        retry: false,
    }
}

/// Creates the store's tables if they are missing, under an advisory lock (two engines
/// starting at once), and checks the schema's version.
fn create_schema(client: &mut Client, schema: &str) -> Result<(), Failure> {
    let context = "creating the store's tables";
    let mut tx = client.transaction().map_err(|e| failure(context, &e))?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('proctor schema ' || $1))",
        &[&schema],
    )
    .map_err(|e| failure(context, &e))?;
    let sql = format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {schema}.proctor_schema (
             id integer PRIMARY KEY CHECK (id = 1),
             version integer NOT NULL
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_procs (
             id bigint PRIMARY KEY,
             root bigint NOT NULL,
             parent bigint,
             type_name text NOT NULL,
             state text NOT NULL,
             updated_ms bigint NOT NULL,
             record bytea NOT NULL
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_meta (
             id integer PRIMARY KEY CHECK (id = 1),
             max_id bigint NOT NULL,
             drained boolean NOT NULL,
             cut_off bigint[] NOT NULL
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_lease (
             id integer PRIMARY KEY CHECK (id = 1),
             holder text,
             epoch bigint NOT NULL,
             expires_at timestamptz
         );
         INSERT INTO {schema}.proctor_meta VALUES (1, 0, false, '{{}}') ON CONFLICT DO NOTHING;
         INSERT INTO {schema}.proctor_lease VALUES (1, NULL, 0, NULL) ON CONFLICT DO NOTHING;
         {cluster}",
        cluster = cluster::schema_sql(schema),
    );
    tx.batch_execute(&sql).map_err(|e| failure(context, &e))?;
    let found: Option<i32> = tx
        .query_opt(
            &format!("SELECT version FROM {schema}.proctor_schema WHERE id = 1"),
            &[],
        )
        .map_err(|e| failure(context, &e))?
        .map(|row| row.get(0));
    match found {
        None => {
            tx.execute(
                &format!("INSERT INTO {schema}.proctor_schema VALUES (1, $1)"),
                &[&PgStore::SCHEMA_VERSION],
            )
            .map_err(|e| failure(context, &e))?;
        }
        Some(version) => {
            check_version(version)?;
            if version < PgStore::SCHEMA_VERSION {
                tx.execute(
                    &format!("UPDATE {schema}.proctor_schema SET version = $1 WHERE id = 1"),
                    &[&PgStore::SCHEMA_VERSION],
                )
                .map_err(|e| failure(context, &e))?;
            }
        }
    }
    tx.commit().map_err(|e| failure(context, &e))
}

/// Refuses tables made by a newer proctor.
fn check_version(found: i32) -> Result<(), Failure> {
    if found > PgStore::SCHEMA_VERSION {
        return Err(not_retried(StoreError::Schema {
            found,
            supported: PgStore::SCHEMA_VERSION,
        }));
    }
    Ok(())
}

/// A batch folded to what it leaves: the newest record of each procedure it writes and
/// the procedures it deletes, each procedure once.
struct Batch {
    ids: Vec<i64>,
    roots: Vec<i64>,
    parents: Vec<Option<i64>>,
    types: Vec<String>,
    states: Vec<String>,
    updated: Vec<i64>,
    records: Vec<Vec<u8>>,
    deleted: Vec<i64>,
    max_id: i64,
}

impl Batch {
    fn fold(ops: &[StoreOp]) -> Result<Batch, StoreError> {
        let mut last: IdMap<ProcId, &StoreOp> = IdMap::default();
        last.reserve(ops.len());
        let mut order = Vec::with_capacity(ops.len());
        let mut max_id = 0;
        for op in ops {
            let id = match op {
                StoreOp::Insert(r) | StoreOp::Update(r) => r.id,
                StoreOp::Delete(id) => *id,
            };
            max_id = max_id.max(id.0);
            if last.insert(id, op).is_none() {
                order.push(id);
            }
        }
        let mut batch = Batch {
            ids: Vec::new(),
            roots: Vec::new(),
            parents: Vec::new(),
            types: Vec::new(),
            states: Vec::new(),
            updated: Vec::new(),
            records: Vec::new(),
            deleted: Vec::new(),
            max_id: as_i64(max_id)?,
        };
        for id in order {
            match last[&id] {
                StoreOp::Insert(r) | StoreOp::Update(r) => batch.push(r)?,
                StoreOp::Delete(id) => batch.deleted.push(as_i64(id.0)?),
            }
        }
        Ok(batch)
    }

    fn push(&mut self, r: &ProcRecord) -> Result<(), StoreError> {
        let record = rmp_serde::to_vec(r).map_err(|e| StoreError::Database {
            context: format!("encoding the record of procedure {}", r.id),
            reason: e.to_string(),
        })?;
        self.ids.push(as_i64(r.id.0)?);
        self.roots.push(as_i64(r.root.0)?);
        self.parents
            .push(r.parent.map(|p| as_i64(p.0)).transpose()?);
        self.types.push(r.type_name.to_string());
        self.states.push(r.state.to_string());
        self.updated.push(as_i64(r.updated_ms)?);
        self.records.push(record);
        Ok(())
    }
}

/// PostgreSQL's `bigint` is signed.
fn as_i64(n: u64) -> Result<i64, StoreError> {
    i64::try_from(n).map_err(|_| StoreError::Database {
        context: "encoding a batch".to_string(),
        reason: format!("{n} does not fit a PostgreSQL bigint"),
    })
}

/// Checks, in `tx`, that the lease still carries `epoch`, holding its row until the
/// transaction ends (the stop mark's fence; a batch's is in its statement). A
/// partition's store checks the partition's epoch.
fn check_fence(
    tx: &mut Transaction<'_>,
    schema: &str,
    scope: Scope,
    epoch: Option<i64>,
) -> Result<(), Failure> {
    if let Scope::Part(part) = scope {
        let context = "checking the partition's epoch";
        let row = tx
            .query_one(
                &format!("SELECT epoch FROM {schema}.proctor_partitions WHERE part = $1 FOR SHARE"),
                &[&part],
            )
            .map_err(|e| failure(context, &e))?;
        let current: i64 = row.get(0);
        return match epoch {
            Some(granted) if current == granted => Ok(()),
            granted => Err(not_retried(StoreError::Fenced {
                granted: granted.unwrap_or(0),
                current,
            })),
        };
    }
    let context = "checking the leader lease";
    let row = tx
        .query_one(
            &format!(
                "SELECT holder, epoch, expires_at IS NOT NULL AND expires_at > now()
                 FROM {schema}.proctor_lease WHERE id = 1 FOR SHARE"
            ),
            &[],
        )
        .map_err(|e| failure(context, &e))?;
    let (holder, current, live): (Option<String>, i64, bool) = (row.get(0), row.get(1), row.get(2));
    match epoch {
        Some(granted) if current != granted => {
            Err(not_retried(StoreError::Fenced { granted, current }))
        }
        None if live => Err(not_retried(led_by(holder, current))),
        _ => Ok(()),
    }
}

/// The statement that writes a batch, in one round trip (prepared once per connection):
/// the fence, the upsert, the delete and the bookkeeping as one statement, so one
/// implicit transaction. The fence's `FOR SHARE` holds the lease row to the end, and a
/// takeover's committed bump makes the row fail `epoch = $9` (PostgreSQL re-checks a
/// locked row's newest version), leaving `fence` empty: then nothing is written and no
/// row returns. An unfenced store (`$9` null: an engine without the lease) writes only
/// while no engine holds a live lease, so it never writes beside a leader.
fn write_sql(schema: &str, scope: Scope) -> String {
    // A partition's batch (see `cluster.rs`): fenced with the partition's epoch, its
    // rows marked with the partition (`$11`), its bookkeeping in the partition's row.
    let (fence, part_column, part_value, bookkeeping) = match scope {
        Scope::Part(_) => (
            format!(
                "SELECT epoch FROM {schema}.proctor_partitions
                 WHERE part = $11 AND epoch = $9"
            ),
            ", part",
            ", $11",
            format!(
                "{schema}.proctor_partitions
                 SET max_id = GREATEST(max_id, $10), drained = false, cut_off = '{{}}'
                 WHERE part = $11"
            ),
        ),
        Scope::Whole | Scope::Everything => (
            format!(
                "SELECT epoch FROM {schema}.proctor_lease
                 WHERE id = 1 AND CASE WHEN $9::bigint IS NULL
                                       THEN expires_at IS NULL OR expires_at <= now()
                                       ELSE epoch = $9 END"
            ),
            "",
            "",
            format!(
                "{schema}.proctor_meta
                 SET max_id = GREATEST(max_id, $10), drained = false, cut_off = '{{}}'
                 WHERE id = 1"
            ),
        ),
    };
    format!(
        "WITH fence AS (
             {fence}
             FOR SHARE
         ),
         up AS (
             INSERT INTO {schema}.proctor_procs
                 (id, root, parent, type_name, state, updated_ms, record{part_column})
             SELECT u.*{part_value} FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[],
                                  $4::text[], $5::text[], $6::bigint[], $7::bytea[]) AS u
             WHERE EXISTS (SELECT 1 FROM fence)
             ON CONFLICT (id) DO UPDATE SET
                 root = EXCLUDED.root, parent = EXCLUDED.parent,
                 type_name = EXCLUDED.type_name, state = EXCLUDED.state,
                 updated_ms = EXCLUDED.updated_ms, record = EXCLUDED.record
             RETURNING 1
         ),
         del AS (
             DELETE FROM {schema}.proctor_procs
             WHERE id = ANY($8::bigint[]) AND EXISTS (SELECT 1 FROM fence)
             RETURNING 1
         )
         UPDATE {bookkeeping}
             AND EXISTS (SELECT 1 FROM fence)"
    )
}

fn write_batch(
    client: &mut Client,
    schema: &str,
    scope: Scope,
    fence: Option<i64>,
    batch: &Batch,
    statement: &postgres::Statement,
) -> Result<(), Failure> {
    let context = "writing a batch";
    let part = scope.part();
    let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> = vec![
        &batch.ids,
        &batch.roots,
        &batch.parents,
        &batch.types,
        &batch.states,
        &batch.updated,
        &batch.records,
        &batch.deleted,
        &fence,
        &batch.max_id,
    ];
    if scope != Scope::Whole {
        params.push(&part);
    }
    // Any append ends a drained stop's mark, as the WAL's does.
    let written = client
        .execute(statement, &params)
        .map_err(|e| failure(context, &e))?;
    if written == 1 {
        return Ok(());
    }
    // Fenced: nothing was written.
    Err(fenced(client, schema, scope, fence, context))
}

/// Why a write found no lease row to hold: a newer epoch than this store's, or, for an
/// unfenced store, a live leader.
fn fenced(
    client: &mut Client,
    schema: &str,
    scope: Scope,
    fence: Option<i64>,
    context: &str,
) -> Failure {
    if let Scope::Part(part) = scope {
        let row = client.query_one(
            &format!("SELECT epoch FROM {schema}.proctor_partitions WHERE part = $1"),
            &[&part],
        );
        return match row {
            Ok(row) => not_retried(StoreError::Fenced {
                granted: fence.unwrap_or(0),
                current: row.get(0),
            }),
            Err(e) => failure(context, &e),
        };
    }
    let row = client.query_one(
        &format!("SELECT holder, epoch FROM {schema}.proctor_lease WHERE id = 1"),
        &[],
    );
    let (holder, current): (Option<String>, i64) = match row {
        Ok(row) => (row.get(0), row.get(1)),
        Err(e) => return failure(context, &e),
    };
    not_retried(match fence {
        Some(granted) => StoreError::Fenced { granted, current },
        None => led_by(holder, current),
    })
}

/// The error of an engine without the lease on a store a leader holds.
fn led_by(holder: Option<String>, epoch: i64) -> StoreError {
    StoreError::Database {
        context: "using the store without the leader lease".to_string(),
        reason: format!(
            "{} holds the store's leader lease (epoch {epoch}): start this engine with \
             ExecutorBuilder::leadership, as a standby, or wait until the lease expires",
            holder.as_deref().unwrap_or("another engine")
        ),
    }
}

/// Sets (`Some`: drained, with the procedures an earlier crash may have cut off) or
/// clears (`None`) the stop mark.
fn mark(
    client: &mut Client,
    schema: &str,
    scope: Scope,
    fence: Option<i64>,
    cut_off: Option<&[ProcId]>,
) -> Result<(), Failure> {
    let context = "marking the store's stop";
    let mut tx = client.transaction().map_err(|e| failure(context, &e))?;
    check_fence(&mut tx, schema, scope, fence)?;
    let ids: Vec<i64> = cut_off
        .unwrap_or_default()
        .iter()
        .map(|id| as_i64(id.0))
        .collect::<Result<_, _>>()
        .map_err(not_retried)?;
    match scope {
        Scope::Whole | Scope::Everything => tx.execute(
            &format!("UPDATE {schema}.proctor_meta SET drained = $1, cut_off = $2 WHERE id = 1"),
            &[&cut_off.is_some(), &ids],
        ),
        Scope::Part(part) => tx.execute(
            &format!(
                "UPDATE {schema}.proctor_partitions SET drained = $1, cut_off = $2 WHERE part = $3"
            ),
            &[&cut_off.is_some(), &ids, &part],
        ),
    }
    .map_err(|e| failure(context, &e))?;
    tx.commit().map_err(|e| failure(context, &e))
}

/// The store's procedures and marks, in one snapshot; refused while a live leader holds
/// the lease if `refuse_beside_leader`.
fn load(
    client: &mut Client,
    schema: &str,
    scope: Scope,
    refuse_beside_leader: bool,
) -> Result<StoreSnapshot, Failure> {
    let context = "loading the store";
    // One snapshot of both tables.
    let mut tx = client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .map_err(|e| failure(context, &e))?;
    if refuse_beside_leader {
        let lease = tx
            .query_opt(
                &format!(
                    "SELECT holder, epoch FROM {schema}.proctor_lease
                     WHERE id = 1 AND expires_at > now()"
                ),
                &[],
            )
            .map_err(|e| failure(context, &e))?;
        if let Some(row) = lease {
            return Err(not_retried(led_by(row.get(0), row.get(1))));
        }
    }
    if scope == Scope::Whole {
        let partitions: i64 = tx
            .query_one(
                &format!("SELECT count(*) FROM {schema}.proctor_partitions"),
                &[],
            )
            .map_err(|e| failure(context, &e))?
            .get(0);
        if partitions > 0 {
            return Err(not_retried(StoreError::Database {
                context: context.to_string(),
                reason: format!(
                    "schema {schema:?} holds a cluster of {partitions} partitions: join it with \
                     Cluster::builder, or give this engine a schema of its own"
                ),
            }));
        }
    }
    let part = scope.part();
    let meta = match scope {
        Scope::Whole | Scope::Everything => tx.query_one(
            &format!("SELECT max_id, drained, cut_off FROM {schema}.proctor_meta WHERE id = 1"),
            &[],
        ),
        Scope::Part(_) => tx.query_one(
            &format!(
                "SELECT max_id, drained, cut_off FROM {schema}.proctor_partitions WHERE part = $1"
            ),
            &[&part],
        ),
    }
    .map_err(|e| failure(context, &e))?;
    let max_id: i64 = meta.get(0);
    let drained: bool = meta.get(1);
    let cut_off: Vec<i64> = meta.get(2);
    // The whole store's rows have no partition.
    let rows = match scope {
        Scope::Whole => tx.query(
            &format!(
                "SELECT id, record FROM {schema}.proctor_procs WHERE part IS NULL ORDER BY id"
            ),
            &[],
        ),
        Scope::Everything => tx.query(
            &format!("SELECT id, record FROM {schema}.proctor_procs ORDER BY id"),
            &[],
        ),
        Scope::Part(_) => tx.query(
            &format!("SELECT id, record FROM {schema}.proctor_procs WHERE part = $1 ORDER BY id"),
            &[&part],
        ),
    }
    .map_err(|e| failure(context, &e))?;
    let mut records = Vec::with_capacity(rows.len());
    for row in rows {
        let id: i64 = row.get(0);
        let bytes: &[u8] = row.get(1);
        let record: ProcRecord = rmp_serde::from_slice(bytes).map_err(|e| {
            not_retried(StoreError::Database {
                context: format!("loading procedure {id} from {schema}.proctor_procs"),
                reason: format!("its record does not decode: {e}"),
            })
        })?;
        records.push(record);
    }
    tx.commit().map_err(|e| failure(context, &e))?;
    let to_id = |id: i64| ProcId(u64::try_from(id).unwrap_or_default());
    Ok(StoreSnapshot {
        max_id: u64::try_from(max_id).unwrap_or_default(),
        records,
        repairs: Vec::new(),
        last_stop: if drained {
            LastStop::Drained {
                cut_off: cut_off.into_iter().map(to_id).collect(),
            }
        } else {
            LastStop::Unknown
        },
    })
}
