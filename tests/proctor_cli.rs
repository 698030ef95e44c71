//! The `proctor` command against real WAL directories: a sound log verifies, dumps one
//! line per record and lists its procedures; a flipped byte in an older segment fails
//! `wal verify` with the file, the offset and the word "checksum".

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use proctor::{
    Lock, LockClaim, ProcId, ProcRecord, ProcState, ProcedureStore, StoreOp, WalOptions, WalStore,
};

fn proctor(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proctor"))
        .args(args)
        .arg(dir)
        .output()
        .expect("run proctor")
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn record(id: u64, state: ProcState) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: None,
        root: ProcId(id),
        type_name: "create_table".into(),
        state,
        stack_indexes: vec![0],
        failure: None,
        failure_seq: None,
        submitted_ms: 0,
        updated_ms: 0,
        wake_at_ms: None,
        event: None,
        data: vec![7; 32],
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
    }
}

/// 300 procedures, each inserted and updated, over several small segments.
fn write_log(dir: &Path) {
    let options = WalOptions {
        segment_bytes: 8 << 10,
        max_segments: 100,
        sync: false,
    };
    let mut wal = WalStore::open_with(dir, options).unwrap();
    for id in 1..=300 {
        wal.append(&[StoreOp::Insert(record(id, ProcState::Runnable))])
            .unwrap();
        wal.append(&[StoreOp::Update(record(id, ProcState::Success))])
            .unwrap();
    }
}

#[test]
fn a_sound_log_verifies_dumps_and_lists() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());

    let verify = proctor(&["wal", "verify"], dir.path());
    assert!(verify.status.success(), "{}", text(&verify));
    assert!(text(&verify).contains("sound:"));

    let dump = proctor(&["wal", "dump"], dir.path());
    assert!(dump.status.success());
    assert_eq!(text(&dump).lines().count(), 600, "one line per record");
    assert!(text(&dump).contains("update id=300 root=300 parent=- type=create_table state=SUCCESS"));

    let procs = proctor(&["procs"], dir.path());
    assert!(procs.status.success(), "{}", text(&procs));
    assert!(text(&procs).contains("300 procedures, 0 corrupt"));
}

#[test]
fn verify_finds_a_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let mut segments: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    segments.sort();
    assert!(segments.len() > 2);
    let older = &segments[1];
    let mut bytes = fs::read(older).unwrap();
    bytes[500] ^= 0x01;
    fs::write(older, bytes).unwrap();

    let verify = proctor(&["wal", "verify"], dir.path());
    assert_eq!(verify.status.code(), Some(1));
    let out = text(&verify);
    let name = older.file_name().unwrap().to_str().unwrap();
    let line = out
        .lines()
        .find(|l| l.contains(name))
        .expect("names the file");
    assert!(line.contains("corrupt at byte"), "{line}");
    assert!(line.contains("checksum"), "{line}");
    assert!(out.contains("NOT sound"));

    // The engine refuses to start on it, naming the same file.
    let err = WalStore::open(dir.path()).err().expect("open refuses");
    assert!(err.to_string().contains(name), "{err}");
}

#[test]
fn a_missing_directory_is_a_clear_error() {
    let out = proctor(&["wal", "verify"], Path::new("/nonexistent/proctor-wal"));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/proctor-wal"), "{err}");
}

/// `procs` shows what each unfinished procedure's record says of its engine locks.
#[test]
fn procs_shows_the_locks_a_record_holds_or_needs() {
    let dir = tempfile::tempdir().unwrap();
    let mut wal = WalStore::open(dir.path()).unwrap();
    let mut holder = record(1, ProcState::Waiting);
    holder.locks = Some(LockClaim {
        locks: vec![Lock::exclusive("ns/t1")],
        for_life: true,
        held: true,
    });
    let mut stepper = record(2, ProcState::Runnable);
    stepper.stack_indexes = vec![];
    stepper.locks = Some(LockClaim {
        locks: vec![Lock::shared("ns"), Lock::exclusive("ns/t2")],
        for_life: false,
        held: false,
    });
    wal.append(&[StoreOp::Insert(holder), StoreOp::Insert(stepper)])
        .unwrap();
    drop(wal);
    let procs = proctor(&["procs"], dir.path());
    let out = text(&procs);
    assert!(out.contains("holds [X ns/t1]"), "{out}");
    assert!(out.contains("needs per step [S ns, X ns/t2]"), "{out}");
}

/// `proctor bypass` on a stopped engine's directory: a procedure that was running
/// (RUNNABLE in the log) is marked finished; the engine that starts next finds its
/// tree finished and runs nothing of it.
#[test]
fn bypass_marks_a_stuck_procedure_finished_offline() {
    let dir = tempfile::tempdir().unwrap();
    let mut wal = WalStore::open(dir.path()).unwrap();
    let mut root = record(1, ProcState::Waiting);
    root.stack_indexes = vec![0];
    let mut child = record(2, ProcState::Runnable);
    child.parent = Some(ProcId(1));
    child.root = ProcId(1);
    child.stack_indexes = vec![1];
    wal.append(&[StoreOp::Insert(root), StoreOp::Insert(child)])
        .unwrap();
    drop(wal);

    let out = Command::new(env!("CARGO_BIN_EXE_proctor"))
        .args(["bypass"])
        .arg(dir.path())
        .arg("1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("unfinished children [ProcId(2)]"),
        "{}",
        text(&out)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_proctor"))
        .args(["bypass"])
        .arg(dir.path())
        .args(["1", "--recursive"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let snapshot = WalStore::open(dir.path()).unwrap().load().unwrap();
    assert_eq!(
        snapshot.records.len(),
        1,
        "the finished tree keeps its root only"
    );
    assert_eq!(snapshot.records[0].state, ProcState::Success);
    assert!(snapshot.records[0].bypassed);
}
