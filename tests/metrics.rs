//! The engine's metrics as Prometheus scrapes them, and its INFO log: the procedures and setup of
//! `examples/metrics.rs` (the `metrics-exporter-prometheus` HTTP listener, a `tracing`
//! fmt subscriber at INFO, here writing to a buffer), procedures of two types, some
//! failing, then a second executor's remote operations (the dispatcher's series), and a
//! plain HTTP/1.0 GET of the endpoint. One test: a process has one global
//! recorder and one global subscriber.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proctor::{Executor, WalStore};

// The example's procedures (its `main` goes unused here).
#[allow(dead_code)]
#[path = "../examples/metrics.rs"]
mod example;
use example::{exporter, registry, transfers, Ledger};

/// What the fmt subscriber wrote.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A port nobody listens on now.
fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// The body of `GET /metrics`, retried while the listener is starting.
fn scrape(addr: SocketAddr) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let attempt = (|| -> std::io::Result<String> {
            let mut stream = TcpStream::connect(addr)?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        })();
        match attempt {
            Ok(response) if response.starts_with("HTTP/1.") && response.contains(" 200 ") => {
                let (_, body) = response.split_once("\r\n\r\n").expect("a body");
                return body.to_string();
            }
            other => {
                assert!(Instant::now() < deadline, "no scrape: {other:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The value of the sample `series` (name and labels exactly as exported).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
}

#[test]
fn prometheus_scrape_and_info_log_show_each_procedure_by_type() {
    let log = Capture::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    let addr = free_addr();
    // Outside any runtime: the exporter serves from a thread of its own.
    exporter(addr).unwrap().install().unwrap();

    actix::System::new().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::default());
        let executor = Executor::builder()
            .registry(registry())
            .env(ledger.clone())
            .store(WalStore::open(dir.path()).unwrap())
            .start()
            .await
            .unwrap();
        let outcomes = transfers(&executor, &ledger).await.unwrap();
        let rolled_back = outcomes.iter().filter(|(_, ok)| !ok).count();
        assert_eq!(rolled_back, 3, "{outcomes:?}");
        // The last steps' workers are freed by messages of their own: wait until the
        // scheduler has seen them (it sets its gauges in the same handler).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = executor.scheduler_stats().await.unwrap();
            if stats.running == 0 && stats.queued == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{stats:?}");
            actix::clock::sleep(Duration::from_millis(10)).await;
        }
        // Still running: its share of the procedure gauges is not taken back yet.
        let text = scrape(addr);
        assert_eq!(sample(&text, "proctor_procedures_unfinished"), Some(0.0));
        executor.shutdown().await.unwrap();
    });

    let text = scrape(addr);
    let value =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
    let t = r#"{type="transfer"}"#;
    let b = r#"{type="batch"}"#;
    // Eight transfers and three of the batch's children; one batch.
    assert_eq!(
        value(&format!("proctor_procedures_submitted_total{t}")),
        11.0
    );
    assert_eq!(
        value(&format!("proctor_procedures_submitted_total{b}")),
        1.0
    );
    // Four, the retried one and the batch's three.
    assert_eq!(
        value(&format!("proctor_procedures_succeeded_total{t}")),
        8.0
    );
    assert_eq!(
        value(&format!("proctor_procedures_succeeded_total{b}")),
        1.0
    );
    // Two failed steps and one abort, each rolled back.
    assert_eq!(value(&format!("proctor_procedures_failed_total{t}")), 3.0);
    assert_eq!(value(&format!("proctor_procedures_aborted_total{t}")), 1.0);
    assert_eq!(
        value(&format!("proctor_procedures_rolled_back_total{t}")),
        3.0
    );
    assert_eq!(value(&format!("proctor_step_retries_total{t}")), 1.0);
    for never in [
        format!("proctor_procedures_failed_total{b}"),
        format!("proctor_procedures_rolled_back_total{b}"),
        format!("proctor_rollback_retries_total{t}"),
    ] {
        assert_eq!(sample(&text, &never), None, "{never}");
    }
    assert_eq!(
        value(&format!("proctor_procedure_duration_seconds_count{t}")),
        11.0
    );
    // Histograms with buckets (not summaries): every duration is under 300 s.
    assert_eq!(
        value(r#"proctor_procedure_duration_seconds_bucket{type="transfer",le="300"}"#),
        11.0
    );
    assert!(text.contains("# TYPE proctor_step_duration_seconds histogram"));
    assert!(text.contains("# TYPE proctor_wal_batch_records histogram"));
    // Every call of execute: 3 for each of the 4 + 3 that succeeded at once, 1 failed
    // and 3 successful for the retried one, 2 for each failed transfer, and 1 for the
    // aborted one (it was aborted once its first step had asked for the approval).
    assert_eq!(
        value(&format!("proctor_step_duration_seconds_count{t}")),
        30.0
    );
    assert_eq!(
        value(&format!("proctor_step_duration_seconds_count{b}")),
        2.0
    );
    // Group commit: at least one append, at most one per record.
    let appends = value("proctor_wal_sync_seconds_count");
    let records = value("proctor_wal_batch_records_sum");
    assert!(appends >= 1.0 && appends <= records, "{appends} {records}");
    // All done, and the executor gone: nothing queued, running, holding or waiting.
    for gauge in [
        "proctor_procedures_unfinished",
        "proctor_procedures_paused",
        "proctor_procedures_waiting",
        "proctor_ready_queue_length",
        "proctor_steps_running",
        "proctor_locks_held",
        "proctor_locks_waiting",
    ] {
        assert_eq!(value(gauge), 0.0, "{gauge}");
    }
    // Described once at start: help text and type lines.
    assert!(text.contains("# TYPE proctor_procedures_submitted_total counter"));
    assert!(text.contains("# HELP proctor_wal_sync_seconds"));

    let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    // One INFO line per finished root, with its id and type and how many procedures
    // below it finished (their own lines are DEBUG).
    assert_eq!(lines("procedure finished"), 9, "{log}");
    assert_eq!(lines("outcome=ROLLEDBACK"), 3, "{log}");
    assert!(
        log.contains("procedure finished id=1 type=transfer outcome=SUCCESS"),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains("procedure finished id=9 ")
            && l.contains("children=3 children_rolled_back=0")),
        "{log}"
    );
    assert_eq!(lines("procedure submitted"), 9, "{log}");
    // The start names the engine's version and its store, with where it is.
    let started = log
        .lines()
        .find(|l| l.contains("executor started"))
        .unwrap_or_else(|| panic!("no start line in {log}"));
    assert!(
        started.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION")))
            && started.contains("store=\"wal\"")
            && started.contains("store_at="),
        "{started}"
    );
    // The user's line inside a step carries the procedure's and the step's spans.
    assert!(
        log.contains("procedure{id=1 root=1 type=transfer}:step{step=2}: metrics::example: transfer step step=2"),
        "{log}"
    );
    // Every call that got past the ledger: all but the one that found it busy.
    assert_eq!(lines("transfer step"), 29, "{log}");
    assert_eq!(lines("parent=9 type=transfer}:step{step=3}"), 3, "{log}");

    remote_series(addr);
}

/// A node that refuses the first request, then fails one of the two operations.
struct Flaky(std::sync::atomic::AtomicBool);

#[proctor::async_trait]
impl proctor::Transport for Flaky {
    type Op = u32;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(proctor::OpId, u32)>,
    ) -> Result<Vec<proctor::Report>, proctor::TransportError> {
        if !self.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(proctor::TransportError(format!("{target} is starting")));
        }
        Ok(ops
            .into_iter()
            .map(|(id, op)| match op {
                0 => proctor::Report::failed(id, "no such region"),
                _ => proctor::Report::ok(id, &op).unwrap(),
            })
            .collect())
    }
}

/// Dispatches two operations to `dn-a` and reads them.
#[derive(serde::Serialize, serde::Deserialize)]
struct Open(bool);

#[proctor::async_trait]
impl proctor::Procedure for Open {
    async fn execute(
        &mut self,
        ctx: &mut proctor::Context,
    ) -> Result<proctor::Flow, proctor::ProcError> {
        if self.0 {
            return Ok(proctor::Flow::Done);
        }
        self.0 = true;
        ctx.dispatch::<Flaky>("dn-a", &0u32)?;
        ctx.dispatch::<Flaky>("dn-a", &1u32)?;
        Ok(ctx.await_remote())
    }

    async fn rollback(&mut self, _ctx: &mut proctor::Context) -> Result<(), proctor::ProcError> {
        Ok(())
    }
}

/// The remote dispatcher's series, from a second executor in the same process: one
/// failed send, one request of two operations, one failed on the node, one report
/// ignored.
fn remote_series(addr: SocketAddr) {
    actix::System::new().block_on(async {
        let mut registry = proctor::Registry::new();
        registry.register::<Open>("open");
        // Both operations go in one request (two of them, never by age).
        let options = proctor::RemoteOptions::default()
            .max_ops(2)
            .max_age(Duration::from_secs(60))
            .retry_backoff(Duration::from_millis(1), Duration::from_millis(5));
        let executor = Executor::builder()
            .registry(registry)
            .store(proctor::MemoryStore::new())
            .remote(Flaky(Default::default()), options)
            .start()
            .await
            .unwrap();
        let id = executor.submit(Open(false)).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        let unknown = proctor::Report::failed(proctor::OpId(1 << 40), "late");
        assert!(!executor.report(unknown).await.unwrap());
        executor.shutdown().await.unwrap();
    });
    let text = scrape(addr);
    let value =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
    let a = r#"{target="dn-a"}"#;
    assert_eq!(
        value(&format!("proctor_remote_send_failures_total{a}")),
        1.0
    );
    assert_eq!(value(&format!("proctor_remote_send_seconds_count{a}")), 2.0);
    assert_eq!(value(&format!("proctor_remote_batch_ops_sum{a}")), 4.0);
    assert_eq!(value(&format!("proctor_remote_failures_total{a}")), 1.0);
    assert_eq!(value("proctor_remote_reports_ignored_total"), 1.0);
    assert_eq!(value(&format!("proctor_remote_queued{a}")), 0.0);
    assert_eq!(value(&format!("proctor_remote_in_flight{a}")), 0.0);
    assert!(text.contains("# TYPE proctor_remote_send_seconds histogram"));
}
