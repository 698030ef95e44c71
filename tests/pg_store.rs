//! The PostgreSQL store on a private server: records round-trip by batch, a batch that
//! writes one procedure several times leaves its last record, the stop mark and the
//! highest id survive a reopen; a newer schema, a missing database and a closed port
//! are clear errors; a write fenced by a newer lease epoch is refused and never
//! applied. (The scenario tests run on this store too, through `common::stores`.)

mod common;

use std::borrow::Cow;

use proctor::store::{LastStop, ProcRecord, ProcedureStore, StoreError, StoreOp};
use proctor::{PgOptions, PgStore, ProcId, ProcState};

fn record(id: u64, root: u64, data: u8) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: (id != root).then_some(ProcId(root)),
        root: ProcId(root),
        type_name: Cow::Borrowed("t"),
        state: ProcState::Runnable,
        stack_indexes: vec![0],
        failure: None,
        failure_seq: None,
        submitted_ms: 1,
        updated_ms: 2,
        wake_at_ms: None,
        event: None,
        data: vec![data],
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
        nonce_fingerprint: None,
    }
}

/// A plain client of the test server, for what the store does not do.
fn sql() -> postgres::Client {
    postgres::Client::connect(&common::pg::server().url(), postgres::NoTls).unwrap()
}

#[test]
fn batches_round_trip_and_survive_a_reopen() {
    let schema = common::pg::fresh_schema();
    let mut store = common::pg::store_in(&schema);
    assert_eq!(store.load().unwrap().records, vec![]);
    let mut updated = record(1, 1, 7);
    updated.state = ProcState::Waiting;
    store
        .append(&[
            StoreOp::Insert(record(1, 1, 1)),
            StoreOp::Insert(record(2, 1, 2)),
            // One batch, one procedure written twice: its last record stays.
            StoreOp::Update(updated.clone()),
            StoreOp::Insert(record(3, 1, 3)),
            StoreOp::Delete(ProcId(3)),
        ])
        .unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.records, vec![updated.clone(), record(2, 1, 2)]);
    assert_eq!(loaded.max_id, 3);
    assert_eq!(loaded.last_stop, LastStop::Unknown);
    store.mark_drained(&[ProcId(2)]).unwrap();
    drop(store);

    let mut store = common::pg::store_in(&schema);
    let loaded = store.load().unwrap();
    assert_eq!(loaded.records, vec![updated, record(2, 1, 2)]);
    assert_eq!(loaded.max_id, 3, "the highest id outlives its record");
    assert_eq!(
        loaded.last_stop,
        LastStop::Drained {
            cut_off: vec![ProcId(2)]
        }
    );
    // Any write ends the mark.
    store.append(&[StoreOp::Delete(ProcId(2))]).unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.last_stop, LastStop::Unknown);
    assert_eq!(loaded.records.len(), 1);
    // The operator's columns beside each record.
    let row = sql()
        .query_one(
            &format!("SELECT root, parent, type_name, state FROM {schema}.proctor_procs"),
            &[],
        )
        .unwrap();
    let (root, parent, type_name, state): (i64, Option<i64>, String, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        (root, parent, &*type_name, &*state),
        (1, None, "t", "WAITING")
    );
}

#[test]
fn a_newer_schema_is_refused_with_its_version() {
    let schema = common::pg::fresh_schema();
    drop(common::pg::store_in(&schema));
    sql()
        .execute(
            &format!("UPDATE {schema}.proctor_schema SET version = 99"),
            &[],
        )
        .unwrap();
    let options = PgOptions::default().schema(&schema);
    let error = PgStore::connect_with(&common::pg::server().url(), options).unwrap_err();
    assert!(
        matches!(error, StoreError::Schema { found: 99, supported } if supported == PgStore::SCHEMA_VERSION),
        "{error}"
    );
}

#[test]
fn bad_addresses_and_names_are_clear_errors() {
    let server = common::pg::server();
    let missing = format!(
        "host=127.0.0.1 port={} user=postgres dbname=no_such_db",
        server.port
    );
    let error = PgStore::connect(&missing).unwrap_err().to_string();
    assert!(error.contains("no_such_db"), "{error}");
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let closed = format!("host=127.0.0.1 port={port} user=postgres connect_timeout=5");
    let error = PgStore::connect(&closed).unwrap_err().to_string();
    assert!(error.starts_with("connecting to PostgreSQL"), "{error}");
    let error = PgStore::connect_with(&server.url(), PgOptions::default().schema("a; drop"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("not a plain identifier"), "{error}");
}

#[test]
fn wrong_credentials_are_a_clear_error_and_nothing_is_written() {
    let server = common::pg::server();
    let schema = common::pg::fresh_schema();
    let options = PgOptions::default().schema(&schema);
    let wrong = server.password_url("wrong");
    let error = PgStore::connect_with(&wrong, options.clone())
        .unwrap_err()
        .to_string();
    assert!(error.starts_with("connecting to PostgreSQL"), "{error}");
    assert!(error.contains("password authentication failed"), "{error}");
    let lease = proctor::PgLease::new(&wrong, "a").options(options.clone());
    let error = std::thread::spawn(move || lease.state())
        .join()
        .unwrap()
        .unwrap_err();
    assert!(
        error.to_string().contains("password authentication failed"),
        "{error}"
    );
    // Nothing was made: the schema does not exist.
    let made: i64 = sql()
        .query_one(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1",
            &[&schema],
        )
        .unwrap()
        .get(0);
    assert_eq!(made, 0);
    // The right password opens it.
    let right = server.password_url(common::pg::PASSWORD);
    let mut store = PgStore::connect_with(&right, options).expect("the right password");
    assert!(store.load().unwrap().records.is_empty());
}

#[test]
fn a_write_fenced_by_a_newer_epoch_is_refused_and_not_applied() {
    let schema = common::pg::fresh_schema();
    let mut store = common::pg::store_in(&schema);
    let mut client = sql();
    let epoch = |c: &mut postgres::Client| -> i64 {
        c.query_one(
            &format!("SELECT epoch FROM {schema}.proctor_lease WHERE id = 1"),
            &[],
        )
        .unwrap()
        .get(0)
    };
    let granted = epoch(&mut client);
    store.fence(Some(granted)).unwrap();
    store.append(&[StoreOp::Insert(record(1, 1, 1))]).unwrap();
    // A standby takes the lease.
    client
        .execute(
            &format!("UPDATE {schema}.proctor_lease SET epoch = epoch + 1 WHERE id = 1"),
            &[],
        )
        .unwrap();
    let error = store
        .append(&[StoreOp::Insert(record(2, 2, 2))])
        .unwrap_err();
    assert!(
        matches!(error, StoreError::Fenced { granted: g, current } if g == granted && current == granted + 1),
        "{error}"
    );
    // Refused from then on; the fenced write is nowhere.
    let again = store.append(&[StoreOp::Delete(ProcId(1))]).unwrap_err();
    assert!(matches!(again, StoreError::Failed(_)), "{again}");
    let ids: Vec<i64> = client
        .query(&format!("SELECT id FROM {schema}.proctor_procs"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![1]);
}
