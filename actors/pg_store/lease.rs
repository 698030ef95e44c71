//! The leader lease on PostgreSQL: one row (`proctor_lease`: holder, epoch, expiry),
//! read and changed only by single statements whose times come from the database's
//! clock (`now()`), never an engine's. Taking the lease bumps the epoch, which fences
//! every write of the previous holder (see the store's module docs).
//!
//! [`PgLease::acquire`] waits as a standby until the lease is free or expired, takes
//! it, and from then on renews it from a thread of its own every third of the period.
//! A renewal that fails (a dropped connection, a restarted database) is tried again at
//! once on a new connection, then with a short backoff (25 ms doubling, at most a
//! tenth of the period), so one dropped connection costs one round trip, not the
//! lease. The holder learns it lost the lease ([`Leadership::lost`]) when a renewal
//! finds another epoch, or when no renewal has succeeded for two thirds of the period
//! (the database is away): it must stop acting then, before the lease can expire and
//! a standby take it. Beside that signal the holder reads the lease's *term* by its
//! own monotonic clock (the last renewal's start plus two thirds of the period) before
//! every call into user code, so a process stopped past its lease acts on nothing when
//! it is continued, even before the lease's thread has woken to notice.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};
use tokio::sync::{oneshot, watch};

use super::{describe, PgOptions};
use crate::actors::shared::{mono_now, Term};
use crate::store::StoreError;

/// The leader lease as the database has it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseState {
    /// Who holds (or last held) it; `None` if no engine ever took it.
    pub holder: Option<String>,
    /// Bumped by every take; a store fenced with an older one is refused.
    pub epoch: i64,
    /// How long it has to run, by the database's clock; `None` once it has expired
    /// (or was never taken).
    pub remaining: Option<Duration>,
}

/// The leader lease of the store in a PostgreSQL schema, for one engine (`holder`).
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use proctor::store::ProcedureStore;
/// use proctor::{PgLease, PgStore};
///
/// let url = "postgresql://proctor@db.internal/control";
/// let lease = PgLease::new(url, "master-a").period(Duration::from_secs(30));
/// // Waits as a standby while another engine holds it.
/// let leadership = lease.acquire().await?;
/// let mut store = PgStore::connect(url)?;
/// store.fence(Some(leadership.epoch()))?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PgLease {
    url: String,
    options: PgOptions,
    holder: String,
    period: Duration,
    /// Which lease: the leader's, or a cluster member's own.
    row: LeaseRow,
    /// Under a simulation: the simulated database the lease is in.
    #[cfg(feature = "simulation")]
    simulated: Option<crate::actors::simulation::SimDb>,
}

impl PgLease {
    /// The lease of the store at `url` (in the `proctor` schema), for the engine named
    /// `holder` (shown to operators and to standbys), with a period of 30 s.
    pub fn new(url: impl Into<String>, holder: impl Into<String>) -> Self {
        PgLease {
            url: url.into(),
            options: PgOptions::default(),
            holder: holder.into(),
            period: Duration::from_secs(30),
            row: LeaseRow::Leader,
            #[cfg(feature = "simulation")]
            simulated: None,
        }
    }

    /// The membership of the executor named `holder` in the cluster whose store is at
    /// `url`: a lease of its own (a row of `proctor_members`), renewed as the leader
    /// lease is; a member that loses it calls no user code for any partition.
    pub(crate) fn member(url: impl Into<String>, holder: impl Into<String>) -> Self {
        PgLease {
            row: LeaseRow::Member,
            ..PgLease::new(url, holder)
        }
    }

    /// What the lease is, for messages.
    fn what(&self) -> &'static str {
        match self.row {
            LeaseRow::Leader => "the leader lease",
            LeaseRow::Member => "the cluster membership",
        }
    }

    /// The lease in a simulated database, for `holder`.
    #[cfg(feature = "simulation")]
    pub(crate) fn simulated(
        db: crate::actors::simulation::SimDb,
        holder: impl Into<String>,
        period: Duration,
    ) -> Self {
        PgLease {
            simulated: Some(db),
            ..PgLease::new("simulated", holder).period(period)
        }
    }

    /// The store's options (its schema), as given to [`PgStore`](super::PgStore).
    #[must_use]
    pub fn options(mut self, options: PgOptions) -> Self {
        self.options = options;
        self
    }

    /// How long a take or renewal holds the lease (30 s by default, at least 300 ms):
    /// a standby takes over at most this long after the leader stopped renewing.
    #[must_use]
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period.max(Duration::from_millis(300));
        self
    }

    /// The lease's period.
    pub fn period_of(&self) -> Duration {
        self.period
    }

    /// The engine's name.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Reads the lease (blocking: from a runtime, through `spawn_blocking`).
    ///
    /// # Errors
    /// [`StoreError::Database`] if the database cannot be reached or has no store's
    /// tables in the schema.
    pub fn state(&self) -> Result<LeaseState, StoreError> {
        let mut client = self.connect()?;
        read(&mut client, self.schema())
    }

    /// Waits, as a standby, until the lease is free or has expired, takes it (the
    /// epoch bumped), and renews it from a thread of its own until the returned
    /// [`Leadership`] is dropped or the lease is lost.
    ///
    /// # Errors
    /// [`StoreError::Database`] if the database cannot be reached when it starts (later
    /// failures while it waits are retried).
    pub async fn acquire(self) -> Result<Leadership, StoreError> {
        self.acquire_watching(|_| {}).await
    }

    /// As [`acquire`](Self::acquire), telling `seen` who holds the lease whenever a
    /// standby finds another holder than it last did.
    pub(crate) async fn acquire_watching(
        self,
        seen: impl Fn(Option<String>) + Send + 'static,
    ) -> Result<Leadership, StoreError> {
        let (taken_tx, taken_rx) = oneshot::channel::<Result<(i64, Arc<Term>), StoreError>>();
        let (lost_tx, lost_rx) = watch::channel(None);
        let stop = Arc::new(StopSignal::default());
        #[cfg(feature = "simulation")]
        if let Some(db) = self.simulated.clone() {
            let mut statements = db.lease_statements(&self.holder, stop.clone());
            let lease = self.clone();
            tokio::task::spawn_local(async move {
                lease.run(&mut statements, taken_tx, &lost_tx, &seen).await;
            });
            return Self::taken(taken_rx, lost_rx, stop, None, self.holder).await;
        }
        let lease = self.clone();
        let signal = stop.clone();
        let thread = thread::Builder::new()
            .name("proctor-lease".to_string())
            .spawn(move || {
                let mut statements = PgStatements {
                    lease: lease.clone(),
                    client: None,
                    stop: signal,
                };
                // The statements block this thread (the synchronous client runs a
                // runtime of its own inside each), so the loop's future never waits
                // on anything else: polled here, outside any runtime.
                block_on(lease.run(&mut statements, taken_tx, &lost_tx, &seen));
            })
            .map_err(|e| StoreError::Io {
                context: "starting the lease's thread".to_string(),
                source: e,
            })?;
        Self::taken(taken_rx, lost_rx, stop, Some(thread), self.holder).await
    }

    /// The start's answer, as a [`Leadership`] once taken.
    async fn taken(
        taken_rx: oneshot::Receiver<Result<(i64, Arc<Term>), StoreError>>,
        lost_rx: watch::Receiver<Option<Loss>>,
        stop: Arc<StopSignal>,
        thread: Option<thread::JoinHandle<()>>,
        holder: String,
    ) -> Result<Leadership, StoreError> {
        // A standby stopped while it waits (this future dropped) stops its loop.
        let stop_on_drop = StopOnDrop(Some(stop));
        let answer = taken_rx.await;
        let stop = stop_on_drop.disarm();
        let end = |thread: Option<thread::JoinHandle<()>>| {
            if let Some(thread) = thread {
                let _ = thread.join();
            }
        };
        match answer {
            Ok(Ok((epoch, term))) => Ok(Leadership {
                epoch,
                term,
                holder,
                lost: lost_rx,
                stop: Some(stop),
                thread,
            }),
            Ok(Err(e)) => {
                end(thread);
                Err(e)
            }
            Err(_) => {
                end(thread);
                Err(StoreError::Failed("the lease's thread stopped".to_string()))
            }
        }
    }

    fn schema(&self) -> &str {
        self.options.schema_name()
    }

    /// A new connection for the lease. Unless the URL sets them, connecting gives up
    /// after a third of the period, and a connection whose sent data goes unanswered
    /// that long is closed, so a database that went away is noticed within the
    /// period rather than after the system's TCP timeouts.
    fn connect(&self) -> Result<Client, StoreError> {
        let failed = |reason: String| StoreError::Database {
            context: format!("connecting to PostgreSQL for {}", self.what()),
            reason,
        };
        let mut config: postgres::Config = self
            .url
            .parse()
            .map_err(|e: postgres::Error| failed(describe(&e)))?;
        let bound = (self.period / 3).max(Duration::from_millis(100));
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(bound);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(bound);
        }
        // So operators (and tests) tell the lease's connection from the store's.
        if config.get_application_name().is_none() {
            config.application_name(LEASE_APPLICATION);
        }
        config.connect(NoTls).map_err(|e| failed(describe(&e)))
    }

    /// The lease's loop: wait and take, then renew until stopped or lost. The same
    /// code runs on the lease's thread against PostgreSQL and, under a simulation, as
    /// a task against the simulated database.
    async fn run<S: LeaseStatements>(
        &self,
        db: &mut S,
        taken: oneshot::Sender<Result<(i64, Arc<Term>), StoreError>>,
        lost: &watch::Sender<Option<Loss>>,
        seen: &dyn Fn(Option<String>),
    ) {
        let tick = self.period / 3;
        // The lease's row is the store's: made with its tables if a standby comes first.
        if let Err(e) = db.prepare().await {
            let _ = taken.send(Err(e));
            return;
        }
        let mut waiting_logged = None;
        // The lease runs from when the statement that took it was sent, at the latest.
        let deadline = self.period * 2 / 3;
        let (epoch, mut renewed_at) = loop {
            let started = mono_now();
            match db.try_take(&self.holder, self.period).await {
                Ok(Taken::Yes(epoch)) => break (epoch, started),
                Ok(Taken::No(state)) => {
                    if waiting_logged.as_ref() != Some(&state.holder) {
                        tracing::info!(target: crate::targets::STORE, holder = ?state.holder, epoch = state.epoch, "standby: the lease is held; waiting");
                        seen(state.holder.clone());
                        waiting_logged = Some(state.holder);
                    }
                }
                Err(e) => {
                    tracing::warn!(target: crate::targets::STORE, error = %e, "standby: cannot read the lease; trying again");
                    db.reset();
                }
            }
            // A standby that nobody waits for any more stops.
            if taken.is_closed() || db.wait(tick).await {
                return;
            }
        };
        tracing::info!(target: crate::targets::STORE, holder = %self.holder, epoch, period_ms = self.period.as_millis() as u64, lease = self.what(), "took the lease");
        let term = Arc::new(Term::until(renewed_at + deadline));
        if taken.send(Ok((epoch, term.clone()))).is_err() {
            // Nobody waits for it any more (the standby was stopped): let it go.
            let _ = db.release(&self.holder, epoch).await;
            return;
        }
        // Renew until stopped; give up (lost) when another epoch is found, or when the
        // term is over (no renewal has succeeded for two thirds of the period), which
        // leaves the last third for the holder to stop before the lease can expire.
        // The term decides, as it does for the actors that read it, so the two never
        // disagree. A failed renewal is tried again at once, then after `retry`
        // (doubling, bounded). `renewed_at` only words the loss.
        let lose = |loss: Loss| {
            term.end();
            let _ = lost.send(Some(loss));
        };
        let mut retry: Option<Duration> = None;
        loop {
            let wait = retry.unwrap_or(tick);
            if db.wait(wait.min(term.left())).await {
                // Stopped (the leadership dropped): let the lease go for a standby.
                let _ = db.release(&self.holder, epoch).await;
                return;
            }
            // Woken past the deadline (the process was stopped, or starved): lost
            // without asking the database, which takes a round trip the holder must
            // not spend acting.
            if !term.holds() {
                lose(Loss {
                    reason: not_renewed(renewed_at),
                    taker: None,
                });
                return;
            }
            let started = mono_now();
            match db.renew(&self.holder, epoch, self.period).await {
                Ok(true) => {
                    // The lease runs from when the renewal was sent, at the latest. A
                    // term that ran out is over, even if this renewal then took: the
                    // executor may have stopped calling user code by its clock.
                    if !term.holds() || !term.extend(started + deadline) {
                        lose(Loss {
                            reason: not_renewed(renewed_at),
                            taker: None,
                        });
                        return;
                    }
                    renewed_at = started;
                    if retry.take().is_some() {
                        tracing::info!(target: crate::targets::STORE, lease = self.what(), "renewed the lease after a failure");
                    }
                    ::metrics::histogram!(crate::actors::metrics::LEASE_RENEW)
                        .record(mono_now().saturating_duration_since(started));
                }
                Ok(false) => {
                    let taker =
                        (db.read().await.ok()).and_then(|state| Some((state.holder?, state.epoch)));
                    let by = match &taker {
                        Some((holder, now)) => format!("{holder} took it (epoch {now})"),
                        None => "another engine took it".to_string(),
                    };
                    lose(Loss {
                        reason: format!("{} is no longer at epoch {epoch}: {by}", self.what()),
                        taker: taker.map(|(holder, _)| holder),
                    });
                    return;
                }
                Err(e) => {
                    #[cfg(feature = "simulation")]
                    if crate::mutation::on(crate::mutation::Mutation::LeaseLostOnOneError) {
                        lose(Loss {
                            reason: format!("cannot renew {}: {e}", self.what()),
                            taker: None,
                        });
                        return;
                    }
                    // At once on a new connection the first time (the usual cause is a
                    // dropped connection), then backing off within the period.
                    let next = match retry {
                        None => Duration::ZERO,
                        Some(d) => (d * 2).clamp(RETRY_FIRST, (self.period / 10).max(RETRY_FIRST)),
                    };
                    tracing::warn!(target: crate::targets::STORE, error = %e, retry_in_ms = next.as_millis() as u64, lease = self.what(), "cannot renew the lease; trying again");
                    retry = Some(next);
                    db.reset();
                }
            }
            if !term.holds() {
                lose(Loss {
                    reason: not_renewed(renewed_at),
                    taker: None,
                });
                return;
            }
        }
    }
}

/// The statements the lease's loop makes, and its waits: against PostgreSQL on the
/// lease's thread ([`PgStatements`]), or a simulated database's.
pub(crate) trait LeaseStatements {
    /// Connects and makes the store's tables (the lease's row among them) if missing.
    async fn prepare(&mut self) -> Result<(), StoreError>;
    /// Takes the lease if it is free or expired.
    async fn try_take(&mut self, holder: &str, period: Duration) -> Result<Taken, StoreError>;
    /// Extends the lease held at `epoch`: `false` if it is another's now.
    async fn renew(
        &mut self,
        holder: &str,
        epoch: i64,
        period: Duration,
    ) -> Result<bool, StoreError>;
    /// Reads the lease.
    async fn read(&mut self) -> Result<LeaseState, StoreError>;
    /// Lets the lease go at once, if it is still held at `epoch`.
    async fn release(&mut self, holder: &str, epoch: i64) -> Result<(), StoreError>;
    /// A statement failed: the next one starts on a new connection.
    fn reset(&mut self);
    /// Waits `wait`; `true` if the leadership was dropped (or the standby stopped)
    /// meanwhile.
    async fn wait(&mut self, wait: Duration) -> bool;
}

/// How the holder of a [`Leadership`] stops its lease's loop.
#[derive(Debug, Default)]
pub(crate) struct StopSignal {
    stopped: std::sync::Mutex<bool>,
    thread: std::sync::Condvar,
    task: tokio::sync::Notify,
}

impl StopSignal {
    fn stop(&self) {
        *self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.thread.notify_all();
        self.task.notify_one();
    }

    #[cfg(feature = "simulation")]
    fn is_stopped(&self) -> bool {
        *self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Blocks the lease's thread for `wait`, or until stopped: `true` if stopped.
    fn block(&self, wait: Duration) -> bool {
        let stopped = self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (stopped, _) = self
            .thread
            .wait_timeout_while(stopped, wait, |s| !*s)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *stopped
    }

    /// Waits on a runtime for `wait`, or until stopped: `true` if stopped.
    #[cfg(feature = "simulation")]
    pub(crate) async fn sleep(&self, wait: Duration) -> bool {
        if self.is_stopped() {
            return true;
        }
        tokio::select! {
            biased;
            () = self.task.notified() => true,
            () = tokio::time::sleep(wait) => self.is_stopped(),
        }
    }
}

/// Runs `future` to its end on this thread, outside any runtime (the lease's thread).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        thread::park();
    }
}

/// Stops the lease's loop when dropped armed.
struct StopOnDrop(Option<Arc<StopSignal>>);

impl StopOnDrop {
    fn disarm(mut self) -> Arc<StopSignal> {
        self.0.take().unwrap_or_default()
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(stop) = self.0.take() {
            stop.stop();
        }
    }
}

/// The lease's statements on PostgreSQL, from its thread, connecting again after a
/// failure.
struct PgStatements {
    lease: PgLease,
    client: Option<Client>,
    stop: Arc<StopSignal>,
}

impl PgStatements {
    /// Runs `call` on the connection, connecting first if there is none (a failure
    /// dropped it).
    fn on<T>(
        &mut self,
        call: impl FnOnce(&mut Client, &str) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let connected = match self.client.take() {
            Some(connected) => connected,
            None => self.lease.connect()?,
        };
        call(self.client.insert(connected), self.lease.schema())
    }
}

impl LeaseStatements for PgStatements {
    async fn prepare(&mut self) -> Result<(), StoreError> {
        self.on(|c, schema| super::create_schema(c, schema).map_err(|f| f.error))
    }

    async fn try_take(&mut self, holder: &str, period: Duration) -> Result<Taken, StoreError> {
        let row = self.lease.row;
        self.on(|c, schema| try_take(c, schema, row, holder, period))
    }

    async fn renew(
        &mut self,
        holder: &str,
        epoch: i64,
        period: Duration,
    ) -> Result<bool, StoreError> {
        let row = self.lease.row;
        self.on(|c, schema| renew(c, schema, row, holder, epoch, period))
    }

    async fn read(&mut self) -> Result<LeaseState, StoreError> {
        // After a renewal the lease lost: on the connection that has it, if any.
        match self.client.as_mut() {
            Some(c) => read_row(c, self.lease.schema(), self.lease.row, &self.lease.holder),
            None => Err(StoreError::Failed("no connection".to_string())),
        }
    }

    async fn release(&mut self, holder: &str, epoch: i64) -> Result<(), StoreError> {
        match self.client.as_mut() {
            Some(c) => release(c, self.lease.schema(), self.lease.row, holder, epoch),
            None => Ok(()),
        }
    }

    fn reset(&mut self) {
        self.client = None;
    }

    async fn wait(&mut self, wait: Duration) -> bool {
        self.stop.block(wait)
    }
}

/// Leadership through a taken lease: its epoch (fence the store with it), and whether
/// it was lost. Dropping it stops the renewals and releases the lease.
#[derive(Debug)]
pub struct Leadership {
    epoch: i64,
    term: Arc<Term>,
    holder: String,
    lost: watch::Receiver<Option<Loss>>,
    stop: Option<Arc<StopSignal>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Leadership {
    /// A partition's ownership held under a cluster membership: fenced with the
    /// partition's `epoch`, holding while the membership's `term` does, and lost when
    /// `lost` tells (the member lost the partition or its membership).
    pub(crate) fn owned(
        epoch: i64,
        term: Arc<Term>,
        holder: String,
        lost: watch::Receiver<Option<Loss>>,
    ) -> Leadership {
        Leadership {
            epoch,
            term,
            holder,
            lost,
            stop: None,
            thread: None,
        }
    }

    /// The lease's epoch, which this engine's writes are fenced with.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// The engine's name in the lease.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Resolves, with the reason, once the lease is lost: the holder must stop acting
    /// at once (the lease may expire within the third of its period left).
    pub async fn lost(&self) -> String {
        lost_reason(self.lost.clone()).await.reason
    }

    /// What tells of the loss, for a task that outlives no leadership.
    pub(crate) fn signal(&self) -> watch::Receiver<Option<Loss>> {
        self.lost.clone()
    }

    /// Whether the lease was lost.
    pub fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// How long the lease surely holds, by this process's clock: the executor reads
    /// it before every call into user code.
    pub(crate) fn term(&self) -> Arc<Term> {
        self.term.clone()
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The lease connection's `application_name`, unless the URL gives one.
pub const LEASE_APPLICATION: &str = "proctor lease";

/// The wait before the second retry of a failed renewal (the first is at once).
const RETRY_FIRST: Duration = Duration::from_millis(25);

/// Why a holder whose last renewal succeeded at `renewed_at` gave up the lease.
fn not_renewed(renewed_at: Instant) -> String {
    format!(
        "the leader lease was not renewed for {} ms (two thirds of its period)",
        mono_now().saturating_duration_since(renewed_at).as_millis()
    )
}

/// How a holder lost the lease.
#[derive(Clone, Debug)]
pub(crate) struct Loss {
    /// Who took it, or how long no renewal succeeded.
    pub(crate) reason: String,
    /// The new holder, if the lease names one.
    pub(crate) taker: Option<String>,
}

/// Waits on `lost` until the lease is lost.
pub(crate) async fn lost_reason(mut lost: watch::Receiver<Option<Loss>>) -> Loss {
    match lost.wait_for(Option::is_some).await {
        Ok(loss) => loss.clone().unwrap_or_else(|| Loss {
            reason: String::new(),
            taker: None,
        }),
        Err(_) => Loss {
            reason: "the lease's thread stopped".to_string(),
            taker: None,
        },
    }
}

/// What an attempt to take the lease found.
pub(crate) enum Taken {
    /// Taken, at this epoch.
    Yes(i64),
    /// Held by another.
    No(LeaseState),
}

fn db_error(context: &str, e: &postgres::Error) -> StoreError {
    StoreError::Database {
        context: context.to_string(),
        reason: describe(e),
    }
}

/// Which row a lease is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseRow {
    /// `proctor_lease`: the one leader (a cluster's coordinator).
    Leader,
    /// `proctor_members`: the holder's own row, its membership of a cluster.
    Member,
}

/// Reads the lease of `row` (for a member, `holder`'s).
fn read_row(
    client: &mut Client,
    schema: &str,
    row: LeaseRow,
    holder: &str,
) -> Result<LeaseState, StoreError> {
    if row == LeaseRow::Leader {
        return read(client, schema);
    }
    let found = client
        .query_opt(
            &format!(
                "SELECT name, epoch,
                        CASE WHEN expires_at > now()
                             THEN (EXTRACT(EPOCH FROM expires_at - now()) * 1000)::bigint
                        END
                 FROM {schema}.proctor_members WHERE name = $1"
            ),
            &[&holder],
        )
        .map_err(|e| db_error("reading the cluster membership", &e))?;
    Ok(match found {
        Some(row) => {
            let remaining: Option<i64> = row.get(2);
            LeaseState {
                holder: row.get(0),
                epoch: row.get(1),
                remaining: remaining
                    .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
            }
        }
        None => LeaseState {
            holder: None,
            epoch: 0,
            remaining: None,
        },
    })
}

pub(super) fn read(client: &mut Client, schema: &str) -> Result<LeaseState, StoreError> {
    let context = "reading the leader lease";
    let row = client
        .query_one(
            &format!(
                "SELECT holder, epoch,
                        CASE WHEN expires_at > now()
                             THEN (EXTRACT(EPOCH FROM expires_at - now()) * 1000)::bigint
                        END
                 FROM {schema}.proctor_lease WHERE id = 1"
            ),
            &[],
        )
        .map_err(|e| db_error(context, &e))?;
    let remaining: Option<i64> = row.get(2);
    Ok(LeaseState {
        holder: row.get(0),
        epoch: row.get(1),
        remaining: remaining.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    })
}

/// Takes the lease if it is free or expired: one statement, the database's clock.
fn try_take(
    client: &mut Client,
    schema: &str,
    row: LeaseRow,
    holder: &str,
    period: Duration,
) -> Result<Taken, StoreError> {
    let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
    if row == LeaseRow::Member {
        // A member's row is made at its first join; a name whose membership is live
        // (the same executor still running elsewhere) is not taken over.
        let taken = client
            .query_opt(
                &format!(
                    "INSERT INTO {schema}.proctor_members AS m (name, epoch, expires_at, joined_at)
                     VALUES ($1, 1, now() + $2::float8 * interval '1 millisecond', now())
                     ON CONFLICT (name) DO UPDATE
                     SET epoch = m.epoch + 1, expires_at = EXCLUDED.expires_at, joined_at = now()
                     WHERE m.expires_at IS NULL OR m.expires_at <= now()
                     RETURNING epoch"
                ),
                &[&holder, &(period_ms as f64)],
            )
            .map_err(|e| db_error("joining the cluster", &e))?;
        return match taken {
            Some(found) => Ok(Taken::Yes(found.get(0))),
            None => read_row(client, schema, row, holder).map(Taken::No),
        };
    }
    let context = "taking the leader lease";
    let taken = client
        .query_opt(
            &format!(
                "UPDATE {schema}.proctor_lease
                 SET holder = $1, epoch = epoch + 1,
                     expires_at = now() + $2::float8 * interval '1 millisecond'
                 WHERE id = 1 AND (expires_at IS NULL OR expires_at <= now())
                 RETURNING epoch"
            ),
            &[&holder, &(period_ms as f64)],
        )
        .map_err(|e| db_error(context, &e))?;
    match taken {
        Some(row) => Ok(Taken::Yes(row.get(0))),
        None => read(client, schema).map(Taken::No),
    }
}

/// Extends the lease held at `epoch`: `false` if it is another's now.
fn renew(
    client: &mut Client,
    schema: &str,
    row: LeaseRow,
    holder: &str,
    epoch: i64,
    period: Duration,
) -> Result<bool, StoreError> {
    let context = "renewing the lease";
    let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
    let sql = match row {
        LeaseRow::Leader => format!(
            "UPDATE {schema}.proctor_lease
             SET expires_at = now() + $3::float8 * interval '1 millisecond'
             WHERE id = 1 AND holder = $1 AND epoch = $2"
        ),
        // A membership that expired is over even if nobody took its name since: the
        // coordinator may have moved its partitions.
        LeaseRow::Member => format!(
            "UPDATE {schema}.proctor_members
             SET expires_at = now() + $3::float8 * interval '1 millisecond'
             WHERE name = $1 AND epoch = $2 AND expires_at > now()"
        ),
    };
    let renewed = client
        .execute(&sql, &[&holder, &epoch, &(period_ms as f64)])
        .map_err(|e| db_error(context, &e))?;
    Ok(renewed == 1)
}

/// Lets the lease go at once (it expires now), if it is still held at `epoch`.
fn release(
    client: &mut Client,
    schema: &str,
    row: LeaseRow,
    holder: &str,
    epoch: i64,
) -> Result<(), StoreError> {
    let sql = match row {
        LeaseRow::Leader => format!(
            "UPDATE {schema}.proctor_lease SET expires_at = now()
             WHERE id = 1 AND holder = $1 AND epoch = $2"
        ),
        LeaseRow::Member => format!(
            "UPDATE {schema}.proctor_members SET expires_at = now()
             WHERE name = $1 AND epoch = $2"
        ),
    };
    client
        .execute(&sql, &[&holder, &epoch])
        .map(|_| ())
        .map_err(|e| db_error("releasing the lease", &e))
}
