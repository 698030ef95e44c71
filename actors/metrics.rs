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
//! | `proctor_procedures_failed_total` | counter | `type` | procedures that finished ROLLEDBACK: the one that failed and every one its tree's rollback undid |
//! | `proctor_procedure_duration_seconds` | histogram | `type` | from submit to the durable final record (SUCCESS or ROLLEDBACK), from the persisted submit time: milliseconds apart, and across restarts |
//! | `proctor_step_duration_seconds` | histogram | `type` | one call of `execute` (the user's step only: not the wait for a worker, for locks, or for the step's record) |
//! | `proctor_wal_sync_seconds` | histogram | | one group-commit `append` to the store (for the WAL: the write and its `fdatasync`) |
//! | `proctor_wal_batch_records` | histogram | | records in that append (the procedures that stepped while the previous one was written) |
//! | `proctor_ready_queue_length` | gauge | | steps queued for a worker (not those running, nor those waiting for locks) |
//! | `proctor_steps_running` | gauge | | steps dispatched and not finished |
//! | `proctor_locks_held` | gauge | | procedures holding engine locks |
//! | `proctor_locks_waiting` | gauge | | procedures waiting for engine locks |
//!
//! `type` is the name the procedure's type was registered under. The gauges are the
//! scheduler's view, set whenever it changes; with more than one executor in a process
//! they overwrite each other. Install the recorder before starting the executor: the
//! gauges, the WAL histograms and each procedure's step histogram are registered once,
//! when their actor starts, and stay with the recorder they found.

use std::time::Duration;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Gauge,
    Histogram, Unit,
};

use crate::procedure::ProcState;

/// Counter, by `type`: procedures accepted.
pub const PROCEDURES_SUBMITTED: &str = "proctor_procedures_submitted_total";
/// Counter, by `type`: procedures that finished SUCCESS.
pub const PROCEDURES_SUCCEEDED: &str = "proctor_procedures_succeeded_total";
/// Counter, by `type`: procedures that finished ROLLEDBACK.
pub const PROCEDURES_FAILED: &str = "proctor_procedures_failed_total";
/// Histogram, by `type`: seconds from submit to the final record.
pub const PROCEDURE_DURATION: &str = "proctor_procedure_duration_seconds";
/// Histogram, by `type`: seconds in one `execute` call.
pub const STEP_DURATION: &str = "proctor_step_duration_seconds";
/// Histogram: seconds in one group-commit append to the store.
pub const WAL_SYNC: &str = "proctor_wal_sync_seconds";
/// Histogram: records in one group-commit append.
pub const WAL_BATCH_RECORDS: &str = "proctor_wal_batch_records";
/// Gauge: steps queued for a worker.
pub const READY_QUEUE_LENGTH: &str = "proctor_ready_queue_length";
/// Gauge: steps running.
pub const STEPS_RUNNING: &str = "proctor_steps_running";
/// Gauge: procedures holding engine locks.
pub const LOCKS_HELD: &str = "proctor_locks_held";
/// Gauge: procedures waiting for engine locks.
pub const LOCKS_WAITING: &str = "proctor_locks_waiting";

/// The label that carries a procedure's registered type name.
pub const TYPE_LABEL: &str = "type";

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
        "Procedures that finished ROLLEDBACK."
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
    describe_gauge!(LOCKS_HELD, Unit::Count, "Procedures holding engine locks.");
    describe_gauge!(
        LOCKS_WAITING,
        Unit::Count,
        "Procedures waiting for engine locks."
    );
}

/// A procedure of type `type_name` was accepted.
pub(crate) fn submitted(type_name: &'static str) {
    counter!(PROCEDURES_SUBMITTED, TYPE_LABEL => type_name).increment(1);
}

/// A procedure of type `type_name` finished in `state` after `duration_ms`.
pub(crate) fn finished(type_name: &'static str, state: ProcState, duration_ms: u64) {
    let name = if state == ProcState::Success {
        PROCEDURES_SUCCEEDED
    } else {
        PROCEDURES_FAILED
    };
    counter!(name, TYPE_LABEL => type_name).increment(1);
    // Exact below 2^53 ms, so the conversion loses nothing that matters.
    #[allow(clippy::cast_precision_loss)]
    let secs = duration_ms as f64 / 1000.0;
    histogram!(PROCEDURE_DURATION, TYPE_LABEL => type_name).record(secs);
}

/// The step-duration histogram of type `type_name`: registered once per procedure cell,
/// so a step records without building a key.
pub(crate) fn step_histogram(type_name: &'static str) -> Histogram {
    histogram!(STEP_DURATION, TYPE_LABEL => type_name)
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

/// The scheduler's gauges, registered once when it starts; each is set only when its
/// value changed.
pub(crate) struct SchedulerGauges {
    gauges: [Gauge; 4],
    last: [usize; 4],
}

impl SchedulerGauges {
    pub(crate) fn new() -> Self {
        SchedulerGauges {
            gauges: [
                gauge!(READY_QUEUE_LENGTH),
                gauge!(STEPS_RUNNING),
                gauge!(LOCKS_HELD),
                gauge!(LOCKS_WAITING),
            ],
            last: [0; 4],
        }
    }

    /// The steps queued and running, and the procedures holding and waiting for locks.
    pub(crate) fn set(&mut self, now: [usize; 4]) {
        for ((gauge, last), value) in self.gauges.iter().zip(&mut self.last).zip(now) {
            if *last != value {
                *last = value;
                #[allow(clippy::cast_precision_loss)]
                gauge.set(value as f64);
            }
        }
    }
}
