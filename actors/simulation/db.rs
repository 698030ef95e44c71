//! The simulated PostgreSQL: the lease's row and the store's records, with the real
//! store's fencing (a write under an epoch older than the lease's is refused), and the
//! database's misbehaviour: a connection that drops, a process cut off from it for a
//! while (a partition, or a process stopped), a commit whose outcome the client never
//! learns. Its clock is the simulation's.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::Rng;
use crate::actors::pg_store::{LeaseState, LeaseStatements, StopSignal, Taken};
use crate::procedure::ProcId;
use crate::record::StoreOp;
use crate::store::{MemoryStore, ProcedureStore, StoreError, StoreSnapshot, StoreStatus};

struct Db {
    holder: Option<String>,
    epoch: i64,
    /// When the lease expires, in simulated µs.
    expires_us: Option<u64>,
    /// Two thirds of a period after the last take or renewal that succeeded: the
    /// latest its holder's term can end (the holder counts from before it sent the
    /// statement).
    term_end_us: u64,
    store: MemoryStore,
    /// Processes cut off from the database, until when (simulated µs).
    cut: BTreeMap<String, u64>,
    /// Processes whose lease connection alone is cut off, until when.
    lease_cut: BTreeMap<String, u64>,
    rng: Rng,
    /// Chance in a million that a store statement's connection drops.
    drop_ppm: u32,
    /// Chance in a million that a lease statement's connection drops.
    lease_drop_ppm: u32,
    faults: u32,
}

impl Db {
    /// Whether `process` reaches the database for this statement (`lease`: on the
    /// lease's connection).
    fn reach(&mut self, process: &str, what: &str, lease: bool) -> Result<(), StoreError> {
        let now = super::now_us();
        let cut = |map: &BTreeMap<String, u64>| map.get(process).is_some_and(|&u| u > now);
        if cut(&self.cut) || (lease && cut(&self.lease_cut)) {
            return Err(StoreError::Database {
                context: what.to_string(),
                reason: "connection refused (simulated partition)".to_string(),
            });
        }
        let ppm = if lease {
            self.lease_drop_ppm
        } else {
            self.drop_ppm
        };
        if ppm > 0 && self.rng.below(1_000_000) < u64::from(ppm) {
            self.faults += 1;
            return Err(StoreError::Database {
                context: what.to_string(),
                reason: "connection dropped (simulated)".to_string(),
            });
        }
        Ok(())
    }

    fn state(&self) -> LeaseState {
        let now = super::now_us();
        LeaseState {
            holder: self.holder.clone(),
            epoch: self.epoch,
            remaining: self
                .expires_us
                .filter(|&e| e > now)
                .map(|e| Duration::from_micros(e - now)),
        }
    }
}

/// A simulated database, shared by every process of one seed.
#[derive(Clone)]
pub(crate) struct SimDb(Arc<Mutex<Db>>);

impl std::fmt::Debug for SimDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDb")
    }
}

impl SimDb {
    pub(super) fn new(seed: u64, drop_ppm: u32, lease_drop_ppm: u32) -> SimDb {
        SimDb(Arc::new(Mutex::new(Db {
            holder: None,
            epoch: 0,
            expires_us: None,
            term_end_us: 0,
            store: MemoryStore::new(),
            cut: BTreeMap::new(),
            lease_cut: BTreeMap::new(),
            rng: Rng::new(seed ^ 0xdb),
            drop_ppm,
            lease_drop_ppm,
            faults: 0,
        })))
    }

    fn db(&self) -> MutexGuard<'_, Db> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lease's statements for the process `holder`.
    pub(crate) fn lease_statements(&self, holder: &str, stop: Arc<StopSignal>) -> SimLease {
        SimLease {
            db: self.clone(),
            process: holder.to_string(),
            stop,
        }
    }

    /// A store on this database for the process `process`.
    pub(super) fn store(&self, process: &str) -> SimPgStore {
        SimPgStore {
            db: self.clone(),
            process: process.to_string(),
            fence: None,
        }
    }

    /// Cuts `process` off the database until `until_us` (simulated µs): `lease`, its
    /// lease's connection only.
    pub(super) fn cut(&self, process: &str, until_us: u64, lease: bool) {
        let mut db = self.db();
        let map = if lease {
            &mut db.lease_cut
        } else {
            &mut db.cut
        };
        map.insert(process.to_string(), until_us);
    }

    /// Whether the term of the lease taken at `epoch` may still hold now: it is the
    /// lease's epoch, and no more than two thirds of a period have passed since its
    /// last take or renewal succeeded. A call into user code under `epoch` (its
    /// fencing token) after that is a call by a leader that lost its lease.
    pub(super) fn lease_holds(&self, epoch: i64) -> bool {
        let db = self.db();
        db.epoch == epoch && super::now_us() <= db.term_end_us
    }

    /// Faults injected so far (dropped connections, unknown commits).
    pub(super) fn faults(&self) -> u32 {
        self.db().faults
    }
}

/// The lease's statements against the simulated database, each after a network round
/// trip of the simulation's.
pub(crate) struct SimLease {
    db: SimDb,
    process: String,
    stop: Arc<StopSignal>,
}

impl SimLease {
    async fn round_trip(&self) {
        tokio::time::sleep(super::net_latency()).await;
    }
}

impl LeaseStatements for SimLease {
    async fn prepare(&mut self) -> Result<(), StoreError> {
        self.round_trip().await;
        self.db
            .db()
            .reach(&self.process, "connecting for the leader lease", true)
    }

    async fn try_take(&mut self, holder: &str, period: Duration) -> Result<Taken, StoreError> {
        self.round_trip().await;
        let mut db = self.db.db();
        db.reach(&self.process, "taking the leader lease", true)?;
        let now = super::now_us();
        if db.expires_us.is_none_or(|e| e <= now) {
            db.holder = Some(holder.to_string());
            db.epoch += 1;
            db.expires_us = Some(now + micros(period));
            db.term_end_us = now + micros(period * 2 / 3);
            Ok(Taken::Yes(db.epoch))
        } else {
            Ok(Taken::No(db.state()))
        }
    }

    async fn renew(
        &mut self,
        holder: &str,
        epoch: i64,
        period: Duration,
    ) -> Result<bool, StoreError> {
        self.round_trip().await;
        let mut db = self.db.db();
        db.reach(&self.process, "renewing the leader lease", true)?;
        if db.holder.as_deref() == Some(holder) && db.epoch == epoch {
            let now = super::now_us();
            db.expires_us = Some(now + micros(period));
            db.term_end_us = now + micros(period * 2 / 3);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    async fn read(&mut self) -> Result<LeaseState, StoreError> {
        self.round_trip().await;
        let mut db = self.db.db();
        db.reach(&self.process, "reading the leader lease", true)?;
        Ok(db.state())
    }

    async fn release(&mut self, holder: &str, epoch: i64) -> Result<(), StoreError> {
        self.round_trip().await;
        let mut db = self.db.db();
        db.reach(&self.process, "releasing the leader lease", true)?;
        if db.holder.as_deref() == Some(holder) && db.epoch == epoch {
            db.expires_us = Some(super::now_us());
        }
        Ok(())
    }

    fn reset(&mut self) {}

    async fn wait(&mut self, wait: Duration) -> bool {
        self.stop.sleep(wait).await
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The PostgreSQL store's semantics on the simulated database: appends are atomic,
/// refused under an older epoch than the lease's, and may fail before the commit (a
/// dropped connection: nothing written) or after it (the outcome unknown to the
/// engine: written).
pub(super) struct SimPgStore {
    db: SimDb,
    process: String,
    fence: Option<i64>,
}

impl ProcedureStore for SimPgStore {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        let mut db = self.db.db();
        db.reach(&self.process, "appending records", false)?;
        if let Some(granted) = self.fence {
            if granted != db.epoch {
                return Err(StoreError::Fenced {
                    granted,
                    current: db.epoch,
                });
            }
        }
        db.store.append(ops)?;
        if db.drop_ppm > 0 && db.rng.below(1_000_000) < u64::from(db.drop_ppm) {
            db.faults += 1;
            return Err(StoreError::Database {
                context: "committing an append".to_string(),
                reason: "connection dropped after the commit was sent (simulated)".to_string(),
            });
        }
        Ok(())
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        let mut db = self.db.db();
        db.reach(&self.process, "loading the store", false)?;
        db.store.load()
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        let mut db = self.db.db();
        db.reach(&self.process, "marking the store drained", false)?;
        db.store.mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        let mut db = self.db.db();
        db.reach(&self.process, "marking the store running", false)?;
        db.store.mark_running()
    }

    fn fence(&mut self, epoch: Option<i64>) -> Result<(), StoreError> {
        self.fence = epoch;
        Ok(())
    }

    fn status(&self) -> StoreStatus {
        self.db.db().store.status()
    }
}
