//! The engine's metrics, recorded through the facade of the `metrics` crate: proctor
//! installs no recorder, so recording costs next to nothing until the application
//! installs one (`metrics-exporter-prometheus`, or any other exporter;
//! `examples/metrics.rs` serves them to Prometheus). Every name is a constant here; each
//! metric gets its help text and unit when an executor starts.
//!
//! | name | kind | labels | meaning |
//! | --- | --- | --- | --- |
//! | `proctor_procedures_submitted_total` | counter | `type` | procedures accepted: a root once its insert is durable (before `Submit` answers), a child once its parent's step that created it is durable; not counted again after a restart |
//! | `proctor_procedures_succeeded_total` | counter | `type` | procedures that finished SUCCESS (a bypassed one too) |
//! | `proctor_procedures_failed_total` | counter | `type` | failures: procedures on which a step's error, a panic, a timeout or an abort was recorded (once durable); not the others their trees' rollbacks undo |
//! | `proctor_procedures_aborted_total` | counter | `type` | the failures that were an operator's abort (or rollback of a paused procedure): counted in `failed_total` too |
//! | `proctor_procedures_rolled_back_total` | counter | `type` | procedures that finished ROLLEDBACK: the one that failed and every one its tree's rollback undid |
//! | `proctor_step_retries_total` | counter | `type` | failed steps retried by their failure policy |
//! | `proctor_rollback_retries_total` | counter | `type` | failed rollbacks retried |
//! | `proctor_procedure_restarts_total` | counter | `type` | procedure actors started again by their root stack after they stopped unasked (a panic in engine code); past the restart limit the step fails, or the tree halts |
//! | `proctor_procedure_duration_seconds` | histogram | `type` | from submit to the durable final record (SUCCESS or ROLLEDBACK), from the persisted submit time: milliseconds apart, and across restarts |
//! | `proctor_step_duration_seconds` | histogram | `type` | one call of `execute` (the user's step only: not the wait for a worker, for locks, or for the step's record) |
//! | `proctor_wal_sync_seconds` | histogram | | one group-commit `append` to the store (for the WAL: the write and its `fdatasync`) |
//! | `proctor_wal_batch_records` | histogram | | records in that append (the procedures that stepped while the previous one was written) |
//! | `proctor_procedures_unfinished` | gauge | | procedures neither SUCCESS nor ROLLEDBACK, as their durable records say |
//! | `proctor_procedures_paused` | gauge | | of those, PAUSED or ROLLBACK_PAUSED (waiting for an operator) |
//! | `proctor_procedures_waiting` | gauge | | of those, WAITING or WAITING_TIMEOUT (for children, an event, a timer or a retry's backoff) |
//! | `proctor_is_leader` | gauge | | 1 while the executor holds the leader lease (PostgreSQL store with a lease), 0 once it lost it or stopped |
//! | `proctor_lease_renew_seconds` | histogram | | one renewal of the leader lease (a round trip to the database) |
//! | `proctor_ready_queue_length` | gauge | | steps queued for a worker (not those running, nor those waiting for locks) |
//! | `proctor_steps_running` | gauge | | steps dispatched and not finished |
//! | `proctor_locks_held` | gauge | | procedures holding engine locks |
//! | `proctor_locks_waiting` | gauge | | procedures waiting for engine locks |
//!
//! The histograms are recorded as plain values: the exporter decides their form. For
//! Prometheus, install buckets ([`BUCKETS`] lists a set for each histogram) so they are
//! exported as histograms, which aggregate across instances, not as summaries, which
//! do not:
//!
//! ```
//! # fn install(mut builder: metrics_exporter_prometheus::PrometheusBuilder)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! use metrics_exporter_prometheus::Matcher;
//!
//! for (name, buckets) in proctor::metrics::BUCKETS {
//!     builder = builder.set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)?;
//! }
//! builder.install()?;
//! # Ok(())
//! # }
//! ```
//!
//! `type` is the name the procedure's type was registered under. The procedure gauges
//! follow the durable records, and each executor adds its own (they sum over the
//! executors of a process, and an executor takes its share back when it is dropped).
//! The queue and step gauges are the schedulers' view, summed over the shards; the lock
//! gauges are the lock actor's, set whenever they change (with more than one executor
//! in a process they overwrite each other). Install the recorder before starting the executor: the
//! gauges and the WAL histograms are registered once, when their actor starts, and each
//! procedure type's counters and histograms once per executor, when it first uses the
//! type; they stay with the recorder they found.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use dashmap::DashMap;
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram, Unit,
};

use crate::fast_map::IdHasher;
use crate::procedure::ProcState;
use crate::root_stack::Count;

/// Counter, by `type`: procedures accepted.
pub const PROCEDURES_SUBMITTED: &str = "proctor_procedures_submitted_total";
/// Counter, by `type`: procedures that finished SUCCESS.
pub const PROCEDURES_SUCCEEDED: &str = "proctor_procedures_succeeded_total";
/// Counter, by `type`: failures recorded on procedures (an abort is one).
pub const PROCEDURES_FAILED: &str = "proctor_procedures_failed_total";
/// Counter, by `type`: failures that were aborts.
pub const PROCEDURES_ABORTED: &str = "proctor_procedures_aborted_total";
/// Counter, by `type`: procedures that finished ROLLEDBACK.
pub const PROCEDURES_ROLLED_BACK: &str = "proctor_procedures_rolled_back_total";
/// Counter, by `type`: failed steps retried.
pub const STEP_RETRIES: &str = "proctor_step_retries_total";
/// Counter, by `type`: failed rollbacks retried.
pub const ROLLBACK_RETRIES: &str = "proctor_rollback_retries_total";
/// Counter, by `type`: procedure actors started again by supervision.
pub const PROCEDURE_RESTARTS: &str = "proctor_procedure_restarts_total";
/// Histogram, by `type`: seconds from submit to the final record.
pub const PROCEDURE_DURATION: &str = "proctor_procedure_duration_seconds";
/// Histogram, by `type`: seconds in one `execute` call.
pub const STEP_DURATION: &str = "proctor_step_duration_seconds";
/// Histogram: seconds in one group-commit append to the store.
pub const WAL_SYNC: &str = "proctor_wal_sync_seconds";
/// Histogram: records in one group-commit append.
pub const WAL_BATCH_RECORDS: &str = "proctor_wal_batch_records";
/// Gauge: procedures not finished.
pub const PROCEDURES_UNFINISHED: &str = "proctor_procedures_unfinished";
/// Gauge: procedures PAUSED or ROLLBACK_PAUSED.
pub const PROCEDURES_PAUSED: &str = "proctor_procedures_paused";
/// Gauge: procedures WAITING or WAITING_TIMEOUT.
pub const PROCEDURES_WAITING: &str = "proctor_procedures_waiting";
/// Gauge: steps queued for a worker.
pub const READY_QUEUE_LENGTH: &str = "proctor_ready_queue_length";
/// Gauge: steps running.
pub const STEPS_RUNNING: &str = "proctor_steps_running";
/// Gauge: procedures holding engine locks.
pub const LOCKS_HELD: &str = "proctor_locks_held";
/// Gauge: procedures waiting for engine locks.
pub const LOCKS_WAITING: &str = "proctor_locks_waiting";

/// Gauge: 1 while this process's executor holds the leader lease, 0 once it lost it or
/// stopped (absent without a lease).
pub const IS_LEADER: &str = "proctor_is_leader";
/// Histogram: seconds one renewal of the leader lease took.
pub const LEASE_RENEW: &str = "proctor_lease_renew_seconds";

/// Gauge, by `target`: remote operations queued for the target.
pub const REMOTE_QUEUED: &str = "proctor_remote_queued";
/// Gauge, by `target`: requests to the target being sent.
pub const REMOTE_IN_FLIGHT: &str = "proctor_remote_in_flight";
/// Histogram, by `target`: operations in one request.
pub const REMOTE_BATCH_OPS: &str = "proctor_remote_batch_ops";
/// Histogram, by `target`: seconds one request's send took.
pub const REMOTE_SEND: &str = "proctor_remote_send_seconds";
/// Counter, by `target`: requests whose send failed (their operations retried).
pub const REMOTE_SEND_FAILURES: &str = "proctor_remote_send_failures_total";
/// Counter, by `target`: operations that ended without a value (failed on the target,
/// sends failed past the deadline, target removed, no report in time, not sent again).
pub const REMOTE_FAILURES: &str = "proctor_remote_failures_total";
/// Counter: reports for operations unknown or already reported, ignored.
pub const REMOTE_REPORTS_IGNORED: &str = "proctor_remote_reports_ignored_total";

/// The label that carries a procedure's registered type name.
pub const TYPE_LABEL: &str = "type";

/// Bucket bounds in seconds, from half a millisecond (a step that only decides) to five
/// minutes (a procedure that waits on others).
const SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];

/// Bucket bounds for a group commit's records: powers of two up to 4096.
const RECORDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// Each histogram's name with bucket bounds that suit it, for an exporter that exports
/// histograms with fixed buckets (see the module's docs for Prometheus).
pub const BUCKETS: [(&str, &[f64]); 7] = [
    (PROCEDURE_DURATION, SECONDS),
    (STEP_DURATION, SECONDS),
    (WAL_SYNC, SECONDS),
    (WAL_BATCH_RECORDS, RECORDS),
    (LEASE_RENEW, SECONDS),
    (REMOTE_BATCH_OPS, RECORDS),
    (REMOTE_SEND, SECONDS),
];

/// The remote dispatcher's metrics' help texts (when a dispatcher starts).
pub(crate) fn describe_remote() {
    describe_gauge!(
        REMOTE_QUEUED,
        Unit::Count,
        "Remote operations queued for a target."
    );
    describe_gauge!(
        REMOTE_IN_FLIGHT,
        Unit::Count,
        "Requests to a target being sent."
    );
    describe_histogram!(
        REMOTE_BATCH_OPS,
        Unit::Count,
        "Remote operations in one request."
    );
    describe_histogram!(REMOTE_SEND, Unit::Seconds, "Time one request's send took.");
    describe_counter!(
        REMOTE_SEND_FAILURES,
        Unit::Count,
        "Requests whose send failed (their operations are retried)."
    );
    describe_counter!(
        REMOTE_FAILURES,
        Unit::Count,
        "Remote operations that ended without a value."
    );
    describe_counter!(
        REMOTE_REPORTS_IGNORED,
        Unit::Count,
        "Reports for unknown or already reported operations, ignored."
    );
}

/// Gives every metric its help text and unit in the installed recorder (a no-op without
/// one). Called when an executor starts; calling it again is harmless.
pub(crate) fn describe() {
    describe_counter!(
        PROCEDURES_SUBMITTED,
        Unit::Count,
        "Procedures accepted (roots once their insert is durable, children once created)."
    );
    describe_counter!(
        PROCEDURES_SUCCEEDED,
        Unit::Count,
        "Procedures that finished SUCCESS."
    );
    describe_counter!(
        PROCEDURES_FAILED,
        Unit::Count,
        "Failures recorded on procedures: a step's error, a panic, a timeout or an abort."
    );
    describe_counter!(
        PROCEDURES_ABORTED,
        Unit::Count,
        "Failures that were an operator's abort (counted as failures too)."
    );
    describe_counter!(
        PROCEDURES_ROLLED_BACK,
        Unit::Count,
        "Procedures that finished ROLLEDBACK."
    );
    describe_counter!(
        STEP_RETRIES,
        Unit::Count,
        "Failed steps retried by their failure policy."
    );
    describe_counter!(ROLLBACK_RETRIES, Unit::Count, "Failed rollbacks retried.");
    describe_counter!(
        PROCEDURE_RESTARTS,
        Unit::Count,
        "Procedure actors started again after they stopped unasked."
    );
    describe_gauge!(
        PROCEDURES_UNFINISHED,
        Unit::Count,
        "Procedures neither SUCCESS nor ROLLEDBACK."
    );
    describe_gauge!(
        PROCEDURES_PAUSED,
        Unit::Count,
        "Procedures PAUSED or ROLLBACK_PAUSED."
    );
    describe_gauge!(
        PROCEDURES_WAITING,
        Unit::Count,
        "Procedures WAITING or WAITING_TIMEOUT."
    );
    describe_histogram!(
        PROCEDURE_DURATION,
        Unit::Seconds,
        "Time from submit to a procedure's final record (millisecond resolution)."
    );
    describe_histogram!(
        STEP_DURATION,
        Unit::Seconds,
        "Time in one call of a procedure's execute."
    );
    describe_histogram!(
        WAL_SYNC,
        Unit::Seconds,
        "Time of one group-commit append to the store (write and sync)."
    );
    describe_histogram!(
        WAL_BATCH_RECORDS,
        Unit::Count,
        "Records in one group-commit append to the store."
    );
    describe_gauge!(
        READY_QUEUE_LENGTH,
        Unit::Count,
        "Steps queued for a worker."
    );
    describe_gauge!(STEPS_RUNNING, Unit::Count, "Steps running.");
    describe_gauge!(
        IS_LEADER,
        Unit::Count,
        "1 while this executor holds the leader lease."
    );
    describe_histogram!(
        LEASE_RENEW,
        Unit::Seconds,
        "Time of one renewal of the leader lease."
    );
    describe_gauge!(LOCKS_HELD, Unit::Count, "Procedures holding engine locks.");
    describe_gauge!(
        LOCKS_WAITING,
        Unit::Count,
        "Procedures waiting for engine locks."
    );
}

/// The metric handles of each procedure type, registered the first time the executor
/// uses the type: building a labelled key and looking it up in the recorder costs
/// several times what recording with a handle does, and a procedure recorded three or
/// four times. (Keyed by registered type names, which the program picks, so with the
/// engine's fast hasher.)
#[derive(Default)]
pub(crate) struct TypeMetrics(DashMap<&'static str, TypeHandles, IdHasher>);

/// One type's handles. Each is registered when first used, so a series appears once
/// it has something to count (a type that never failed has no failed series), as when
/// every record built its key.
struct TypeHandles {
    name: &'static str,
    submitted: OnceLock<Counter>,
    succeeded: OnceLock<Counter>,
    failed: OnceLock<Counter>,
    aborted: OnceLock<Counter>,
    rolled_back: OnceLock<Counter>,
    step_retries: OnceLock<Counter>,
    rollback_retries: OnceLock<Counter>,
    duration: OnceLock<Histogram>,
    step: OnceLock<Histogram>,
}

impl TypeHandles {
    fn new(name: &'static str) -> Self {
        TypeHandles {
            name,
            submitted: OnceLock::new(),
            succeeded: OnceLock::new(),
            failed: OnceLock::new(),
            aborted: OnceLock::new(),
            rolled_back: OnceLock::new(),
            step_retries: OnceLock::new(),
            rollback_retries: OnceLock::new(),
            duration: OnceLock::new(),
            step: OnceLock::new(),
        }
    }

    fn counter<'a>(&self, cell: &'a OnceLock<Counter>, metric: &'static str) -> &'a Counter {
        cell.get_or_init(|| counter!(metric, TYPE_LABEL => self.name))
    }

    fn histogram<'a>(&self, cell: &'a OnceLock<Histogram>, metric: &'static str) -> &'a Histogram {
        cell.get_or_init(|| histogram!(metric, TYPE_LABEL => self.name))
    }
}

impl TypeMetrics {
    fn with<R>(&self, type_name: &'static str, f: impl FnOnce(&TypeHandles) -> R) -> R {
        if let Some(handles) = self.0.get(type_name) {
            return f(&handles);
        }
        let handles = self
            .0
            .entry(type_name)
            .or_insert_with(|| TypeHandles::new(type_name));
        f(&handles)
    }

    /// A procedure of type `type_name` was accepted.
    pub(crate) fn submitted(&self, type_name: &'static str) {
        self.with(type_name, |h| {
            h.counter(&h.submitted, PROCEDURES_SUBMITTED).increment(1);
        });
    }

    /// A procedure of type `type_name` finished in `state` after `duration_ms`.
    pub(crate) fn finished(&self, type_name: &'static str, state: ProcState, duration_ms: u64) {
        // Exact below 2^53 ms, so the conversion loses nothing that matters.
        #[allow(clippy::cast_precision_loss)]
        let secs = duration_ms as f64 / 1000.0;
        self.with(type_name, |h| {
            if state == ProcState::Success {
                h.counter(&h.succeeded, PROCEDURES_SUCCEEDED).increment(1);
            } else {
                h.counter(&h.rolled_back, PROCEDURES_ROLLED_BACK)
                    .increment(1);
            }
            h.histogram(&h.duration, PROCEDURE_DURATION).record(secs);
        });
    }

    /// A failure, an abort or a retry of a procedure of type `type_name` is durable.
    pub(crate) fn count(&self, type_name: &'static str, count: Count) {
        self.with(type_name, |h| match count {
            Count::Failed { aborted, .. } => {
                h.counter(&h.failed, PROCEDURES_FAILED).increment(1);
                if aborted {
                    h.counter(&h.aborted, PROCEDURES_ABORTED).increment(1);
                }
            }
            Count::StepRetry(_) => h.counter(&h.step_retries, STEP_RETRIES).increment(1),
            Count::RollbackRetry(_) => h
                .counter(&h.rollback_retries, ROLLBACK_RETRIES)
                .increment(1),
        });
    }

    /// The step-duration histogram of type `type_name`, for a procedure cell.
    pub(crate) fn step_histogram(&self, type_name: &'static str) -> Histogram {
        self.with(type_name, |h| h.histogram(&h.step, STEP_DURATION).clone())
    }
}

/// The store writer's histograms, registered once when the writer starts.
pub(crate) struct WalMetrics {
    sync: Histogram,
    batch: Histogram,
}

impl WalMetrics {
    pub(crate) fn new() -> Self {
        WalMetrics {
            sync: histogram!(WAL_SYNC),
            batch: histogram!(WAL_BATCH_RECORDS),
        }
    }

    /// One group-commit append of `records` records took `took`.
    pub(crate) fn append(&self, took: Duration, records: usize) {
        self.sync.record(took);
        #[allow(clippy::cast_precision_loss)]
        self.batch.record(records as f64);
    }
}

/// Two gauges, registered once when their actor starts, changed only when a value
/// changed. A scheduler's (steps queued and running) are shared by every shard's
/// scheduler, each adding its changes (an increment or a decrement), so they show the
/// sum over the shards; the lock actor's (procedures holding and waiting for locks)
/// are set.
pub(crate) struct Gauges {
    gauges: [Gauge; 2],
    last: [usize; 2],
    /// Add changes rather than set values.
    summed: bool,
}

impl Gauges {
    /// A shard's scheduler's: steps queued and running.
    pub(crate) fn scheduler() -> Self {
        Gauges {
            gauges: [gauge!(READY_QUEUE_LENGTH), gauge!(STEPS_RUNNING)],
            last: [0; 2],
            summed: true,
        }
    }

    /// The lock actor's: procedures holding and waiting for locks.
    pub(crate) fn locks() -> Self {
        Gauges {
            gauges: [gauge!(LOCKS_HELD), gauge!(LOCKS_WAITING)],
            last: [0; 2],
            summed: false,
        }
    }

    pub(crate) fn set(&mut self, now: [usize; 2]) {
        for ((gauge, last), value) in self.gauges.iter().zip(&mut self.last).zip(now) {
            if *last == value {
                continue;
            }
            #[allow(clippy::cast_precision_loss)]
            match (self.summed, value > *last) {
                (false, _) => gauge.set(value as f64),
                (true, true) => gauge.increment((value - *last) as f64),
                (true, false) => gauge.decrement((*last - value) as f64),
            }
            *last = value;
        }
    }
}

/// The gauges of unfinished, paused and waiting procedures, moved by the procedure table
/// as durable records change procedures' states. Each executor adds its changes to the
/// process's gauges and counts its own share, which it takes back when dropped.
pub(crate) struct ProcGauges {
    gauges: [Gauge; 3],
    mine: [AtomicI64; 3],
}

impl ProcGauges {
    pub(crate) fn new() -> Self {
        ProcGauges {
            gauges: [
                gauge!(PROCEDURES_UNFINISHED),
                gauge!(PROCEDURES_PAUSED),
                gauge!(PROCEDURES_WAITING),
            ],
            mine: Default::default(),
        }
    }

    /// Which gauges a procedure in `state` counts in.
    fn counted(state: Option<ProcState>) -> [bool; 3] {
        let Some(state) = state else {
            return [false; 3];
        };
        [
            !state.is_finished(),
            matches!(state, ProcState::Paused | ProcState::RollbackPaused),
            matches!(state, ProcState::Waiting | ProcState::WaitingTimeout),
        ]
    }

    /// A procedure went from state `from` to `to` (`None`: not in the table).
    pub(crate) fn moved(&self, from: Option<ProcState>, to: Option<ProcState>) {
        if from == to {
            return;
        }
        let (was, is) = (Self::counted(from), Self::counted(to));
        for i in 0..3 {
            match (was[i], is[i]) {
                (false, true) => {
                    self.gauges[i].increment(1.0);
                    self.mine[i].fetch_add(1, Ordering::Relaxed);
                }
                (true, false) => {
                    self.gauges[i].decrement(1.0);
                    self.mine[i].fetch_sub(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    }
}

impl Drop for ProcGauges {
    fn drop(&mut self) {
        for (gauge, mine) in self.gauges.iter().zip(&self.mine) {
            #[allow(clippy::cast_precision_loss)]
            gauge.decrement(mine.load(Ordering::Relaxed) as f64);
        }
    }
}

/// Supervision started a procedure actor of type `type_name` again (rare: not through
/// the per-type handles).
pub(crate) fn procedure_restarted(type_name: &'static str) {
    counter!(PROCEDURE_RESTARTS, TYPE_LABEL => type_name).increment(1);
}
