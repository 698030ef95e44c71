//! The `proctor` command against real WAL directories: a sound log verifies, dumps one
//! line per record and lists its procedures; a flipped byte in an older segment fails
//! `wal verify` with the file, the offset and the word "checksum"; a reader that closes
//! the pipe early ends the command quietly; a directory without a WAL is an error;
//! `procs` filters, draws a tree, says what a waiting procedure waits for, decodes the
//! procedure's own state and speaks JSON; `abort` on a stopped engine's log makes the
//! tree roll back at the next start. `procs --pg` reads a PostgreSQL store beside its
//! leader, and a cluster's beside its members (partitions, owners, epochs, moves).

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, PoisonError};

use common::{Scripted, Step};
use proctor::store::{ProcRecord, StoreOp};
use proctor::{
    Failure, Lock, LockClaim, ProcError, ProcId, ProcState, ProcedureStore, StoreError, WalOptions,
    WalStore,
};
use serde::Serialize;

/// The tests here spawn processes while others drop and take a WAL's lock. A child
/// holds a copy of every open descriptor from fork until its exec closes them, the
/// lock's included, so a lock dropped meanwhile stays held. Waiting for `spawn` is not
/// enough: Linux lets the spawning thread go on as the child's exec replaces its memory
/// (`exec_mmap` in `begin_new_exec`), a moment *before* it closes the close-on-exec
/// descriptors, and under load that moment is long enough for another thread to drop
/// and reopen a log and find its lock still held (seen twice in about 55 runs beside
/// busy loops). So a child runs, from spawn to exit, with no open and no other spawn in
/// this process: they all take this mutex.
static FORK: Mutex<()> = Mutex::new(());

fn forking<T>(f: impl FnOnce() -> T) -> T {
    let _serial = FORK.lock().unwrap_or_else(PoisonError::into_inner);
    f()
}

/// `Command::output`, the child's whole life serialized with the opens (see `FORK`).
fn output(command: &mut Command) -> Output {
    forking(|| {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run proctor")
            .wait_with_output()
            .expect("run proctor")
    })
}

fn open_wal(dir: &Path) -> Result<WalStore, StoreError> {
    forking(|| WalStore::open(dir))
}

fn open_wal_with(dir: &Path, options: WalOptions) -> Result<WalStore, StoreError> {
    forking(|| WalStore::open_with(dir, options))
}

fn proctor(args: &[&str], dir: &Path) -> Output {
    output(
        Command::new(env!("CARGO_BIN_EXE_proctor"))
            .args(args)
            .arg(dir),
    )
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
        steering: Default::default(),
        nonce_fingerprint: None,
    }
}

/// 300 procedures, each inserted and updated, over several small segments.
fn write_log(dir: &Path) {
    let options = WalOptions {
        segment_bytes: 8 << 10,
        max_segments: 100,
        sync: false,
    };
    let mut wal = open_wal_with(dir, options).unwrap();
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
    let err = open_wal(dir.path()).expect_err("open refuses");
    assert!(err.to_string().contains(name), "{err}");
}

#[test]
fn version_prints_the_packages_version() {
    let out = output(Command::new(env!("CARGO_BIN_EXE_proctor")).arg("--version"));
    assert!(out.status.success());
    assert_eq!(
        text(&out).trim(),
        format!("proctor {}", env!("CARGO_PKG_VERSION"))
    );
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
    let mut wal = open_wal(dir.path()).unwrap();
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
    let mut wal = open_wal(dir.path()).unwrap();
    let mut root = record(1, ProcState::Waiting);
    root.stack_indexes = vec![0];
    let mut child = record(2, ProcState::Runnable);
    child.parent = Some(ProcId(1));
    child.root = ProcId(1);
    child.stack_indexes = vec![1];
    wal.append(&[StoreOp::Insert(root), StoreOp::Insert(child)])
        .unwrap();
    drop(wal);

    let out = output(
        Command::new(env!("CARGO_BIN_EXE_proctor"))
            .args(["bypass"])
            .arg(dir.path())
            .arg("1"),
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("unfinished children 2: bypass it recursively"),
        "{}",
        text(&out)
    );
    let out = output(
        Command::new(env!("CARGO_BIN_EXE_proctor"))
            .args(["bypass"])
            .arg(dir.path())
            .args(["1", "--recursive"]),
    );
    assert!(out.status.success(), "{}", text(&out));
    let snapshot = open_wal(dir.path()).unwrap().load().unwrap();
    assert_eq!(
        snapshot.records.len(),
        1,
        "the finished tree keeps its root only"
    );
    assert_eq!(snapshot.records[0].state, ProcState::Success);
    assert!(snapshot.records[0].bypassed);
}

/// `n` finished procedures (an insert and an update each) in one WAL, written fast.
fn write_many(dir: &Path, n: u64) {
    let options = WalOptions {
        sync: false,
        ..WalOptions::default()
    };
    let mut wal = open_wal_with(dir, options).unwrap();
    for id in 1..=n {
        wal.append(&[StoreOp::Insert(record(id, ProcState::Runnable))])
            .unwrap();
        wal.append(&[StoreOp::Update(record(id, ProcState::Success))])
            .unwrap();
    }
}

/// `head -1`: the reader takes one line and closes the pipe while the command still has
/// far more than a pipe buffer to write. The command ends with exit 0, not a panic.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    write_many(dir.path(), 3000);
    for args in [&["procs"][..], &["wal", "dump"][..]] {
        let (first, out) = forking(|| {
            let mut child = Command::new(env!("CARGO_BIN_EXE_proctor"))
                .args(args)
                .arg(dir.path())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut first = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut first)
                .unwrap();
            // The reader (and with it the pipe's read end) is dropped here.
            (first, child.wait_with_output().unwrap())
        });
        assert!(!first.is_empty(), "{args:?}: no output");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Every command refuses a directory that holds no WAL, naming it, with exit 2; the
/// writing ones create nothing there.
#[test]
fn a_directory_without_a_wal_is_an_error() {
    let empty = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    fs::write(other.path().join("notes.txt"), "not a log").unwrap();
    for dir in [empty.path(), other.path()] {
        let before = fs::read_dir(dir).unwrap().count();
        let commands: [&[&str]; 5] = [
            &["wal", "verify"],
            &["wal", "dump"],
            &["procs"],
            &["bypass"],
            &["abort"],
        ];
        for args in commands {
            let mut command = Command::new(env!("CARGO_BIN_EXE_proctor"));
            command.args(args).arg(dir);
            if matches!(args, ["bypass"] | ["abort"]) {
                command.arg("1");
            }
            let out = output(&mut command);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(&dir.display().to_string()), "{args:?}: {err}");
            assert!(err.contains("holds no WAL"), "{args:?}: {err}");
            assert!(text(&out).is_empty(), "{args:?}: {}", text(&out));
        }
        assert_eq!(
            fs::read_dir(dir).unwrap().count(),
            before,
            "nothing created"
        );
    }
}

/// Pointed at a service's data directory rather than the log inside it, the command
/// says where the log is.
#[test]
fn a_data_directory_with_its_log_below_names_where_the_log_is() {
    let data = tempfile::tempdir().unwrap();
    let wal = data.path().join("wal");
    fs::create_dir(&wal).unwrap();
    write_log(&wal);
    let out = proctor(&["wal", "verify"], data.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("holds no WAL") && err.contains(&format!("{} holds one", wal.display())),
        "{err}"
    );
}

/// `procs` says in its summary line what state the log is in: sound, a torn tail the
/// engine will truncate (exit 0: nothing acknowledged is lost), or corrupt (exit 1).
#[test]
fn procs_says_in_its_summary_what_state_the_log_is_in() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let summary = |out: &Output| text(out).lines().last().unwrap_or_default().to_string();
    let procs = proctor(&["procs"], dir.path());
    assert!(procs.status.success());
    assert!(
        summary(&procs).ends_with("log: sound"),
        "{}",
        summary(&procs)
    );

    let segments = common::wal::segments(dir.path());
    let newest = segments.last().unwrap();
    let len = fs::metadata(newest).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(newest)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let procs = proctor(&["procs"], dir.path());
    assert!(procs.status.success(), "{}", text(&procs));
    assert!(
        summary(&procs).contains("log: torn tail at"),
        "{}",
        summary(&procs)
    );
    assert!(summary(&procs).contains("will be truncated at next start"));
    let verify = proctor(&["wal", "verify"], dir.path());
    assert_eq!(verify.status.code(), Some(3), "{}", text(&verify));

    let older = &segments[1];
    let mut bytes = fs::read(older).unwrap();
    bytes[500] ^= 0x01;
    fs::write(older, bytes).unwrap();
    let procs = proctor(&["procs"], dir.path());
    assert_eq!(procs.status.code(), Some(1), "{}", text(&procs));
    let line = summary(&procs);
    assert!(line.contains("log: CORRUPT ("), "{line}");
    assert!(
        line.contains(older.file_name().unwrap().to_str().unwrap()),
        "{line}"
    );
    assert!(line.contains("the engine refuses to start"), "{line}");
}

/// A procedure's own state, as the registry would encode it (MessagePack, named
/// fields).
#[derive(Serialize)]
struct TableState {
    table: String,
    regions: Vec<u32>,
    #[serde(with = "serde_bytes")]
    token: Vec<u8>,
}

fn state(table: &str) -> Vec<u8> {
    rmp_serde::to_vec_named(&TableState {
        table: table.into(),
        regions: vec![1, 2],
        token: vec![0xde, 0xad],
    })
    .unwrap()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A log with every kind of row: a tree (1) whose procedures wait for children, an
/// event and a timer; a runnable root of another type (10); a tree (30) that failed in
/// its child 31; a rolled-back root (20) that keeps the failure of its child 21.
fn write_trees(dir: &Path) {
    let now = now_ms();
    let node =
        |id: u64, parent: Option<u64>, root: u64, state_: ProcState, index: u32| ProcRecord {
            parent: parent.map(ProcId),
            root: ProcId(root),
            stack_indexes: vec![index],
            data: state(&format!("t{id}")),
            ..record(id, state_)
        };
    let failure = |proc: u64, error: &str| Failure {
        proc: ProcId(proc),
        type_name: "assign_region".into(),
        error: ProcError::failed(error),
    };
    let records = vec![
        node(1, None, 1, ProcState::Waiting, 0),
        node(2, Some(1), 1, ProcState::Waiting, 1),
        ProcRecord {
            type_name: "assign_region".into(),
            wake_at_ms: Some(now + 30_000),
            submitted_ms: now - 5_000,
            updated_ms: now - 5_000,
            ..node(3, Some(1), 1, ProcState::WaitingTimeout, 2)
        },
        ProcRecord {
            type_name: "assign_region".into(),
            event: Some("region-open".into()),
            deadline_ms: Some(now + 60_000),
            ..node(5, Some(2), 1, ProcState::Waiting, 3)
        },
        ProcRecord {
            type_name: "drop_table".into(),
            stack_indexes: vec![],
            ..node(10, None, 10, ProcState::Runnable, 0)
        },
        ProcRecord {
            stack_indexes: vec![],
            failure: Some(Box::new(Failure {
                error: ProcError::with_code("no_space", "disk full"),
                ..failure(21, "")
            })),
            failure_seq: Some(0),
            ..node(20, None, 20, ProcState::RolledBack, 0)
        },
        node(30, None, 30, ProcState::Waiting, 0),
        ProcRecord {
            type_name: "assign_region".into(),
            failure: Some(Box::new(failure(31, "boom"))),
            failure_seq: Some(0),
            ..node(31, Some(30), 30, ProcState::Failed, 1)
        },
    ];
    let mut wal = open_wal(dir).unwrap();
    let ops: Vec<StoreOp> = records.into_iter().map(StoreOp::Insert).collect();
    wal.append(&ops).unwrap();
}

/// The text table's row for `id`: the line whose first cell (indent trimmed) is it.
fn row(out: &str, id: u64) -> String {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
        .unwrap_or_else(|| panic!("no row {id}:\n{out}"))
        .to_string()
}

fn ids(out: &str) -> Vec<String> {
    let lines: Vec<&str> = out.lines().collect();
    // Between the header and the summary line.
    lines[1..lines.len() - 1]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect()
}

#[test]
fn procs_lines_up_and_says_what_each_procedure_waits_for() {
    let dir = tempfile::tempdir().unwrap();
    write_trees(dir.path());
    let procs = proctor(&["procs"], dir.path());
    let out = text(&procs);
    assert!(procs.status.success(), "{out}");
    // Every column starts where its header does.
    let header = out.lines().next().unwrap();
    for column in ["TYPE", "STATE", "STEPS", "WAITING FOR"] {
        let at = header.find(column).unwrap();
        for line in &out.lines().collect::<Vec<_>>()[1..9] {
            assert!(
                line.as_bytes()[at - 1] == b' ' && line.as_bytes()[at] != b' ',
                "{column} is not aligned:\n{out}"
            );
        }
    }
    assert!(row(&out, 1).contains(" 2 children "), "{out}");
    // AGE: time since the procedure was submitted; a record without a time has none.
    let age = header.find("AGE").unwrap();
    assert_eq!(&row(&out, 1)[age..age + 2], "- ", "{out}");
    let age_of_3: u64 = row(&out, 3)[age..]
        .split_once('s')
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no age for 3:\n{out}"));
    assert!((5..300).contains(&age_of_3), "{out}");
    assert!(row(&out, 2).contains(" 1 child "), "{out}");
    assert!(row(&out, 3).contains(" timer, in 30s "), "{out}");
    // A finished procedure's steps are not known: its final record keeps none.
    let steps = header.find("STEPS").unwrap();
    assert_eq!(&row(&out, 20)[steps..steps + 2], "- ", "{out}");
    assert_eq!(&row(&out, 3)[steps..steps + 2], "1 ", "{out}");
    assert!(
        row(&out, 5).contains(" event \"region-open\"; deadline in 60s "),
        "{out}"
    );
    // The procedure's own state, decoded by field name; its failure beside it.
    assert!(
        row(&out, 10).ends_with(r#"{"regions":[1,2],"table":"t10","token":[222,173]}"#),
        "{out}"
    );
    assert!(row(&out, 31).contains(" boom "), "{out}");
    // A tree that failed waits for its rollback, whatever its procedures waited for.
    for id in [30, 31] {
        assert!(
            row(&out, id).contains(" rollback (its tree failed) "),
            "{out}"
        );
    }
    assert!(
        row(&out, 20).contains(" procedure 21 (assign_region) failed: disk full "),
        "{out}"
    );
    let summary = out.lines().last().unwrap();
    assert_eq!(
        summary,
        "8 procedures, 0 corrupt (1 FAILED, 1 ROLLEDBACK, 1 RUNNABLE, 4 WAITING, \
         1 WAITING_TIMEOUT); log: sound"
    );
}

#[test]
fn procs_filters_by_state_and_type_and_draws_one_tree() {
    let dir = tempfile::tempdir().unwrap();
    write_trees(dir.path());
    let shown = |args: &[&str]| {
        let mut all = vec!["procs"];
        all.extend(args);
        let out = proctor(&all, dir.path());
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        ids(&text(&out))
    };
    assert_eq!(shown(&["--state", "failed,Rolledback"]), ["20", "31"]);
    assert_eq!(
        shown(&["--state", "waiting_timeout", "--state", "RUNNABLE"]),
        ["3", "10"]
    );
    assert_eq!(shown(&["--type", "drop_table"]), ["10"]);
    assert_eq!(
        shown(&["--type", "assign_region", "--state", "waiting"]),
        ["5"]
    );
    // The whole tree of any of its procedures, depth first, indented by parent.
    let tree = proctor(&["procs", "--tree", "5"], dir.path());
    let out = text(&tree);
    let firsts: Vec<&str> = out.lines().skip(1).take(4).map(|l| &l[..6]).collect();
    assert_eq!(firsts, ["1     ", "  2   ", "    5 ", "  3   "], "{out}");
    assert!(out
        .lines()
        .last()
        .unwrap()
        .contains("8 procedures, 0 corrupt, 4 shown"));

    let bad = proctor(&["procs", "--state", "sleeping"], dir.path());
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("unknown state \"sleeping\""), "{err}");
    assert!(err.contains("WAITING_TIMEOUT"), "{err}");
    let missing = proctor(&["procs", "--tree", "99"], dir.path());
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("procedure 99 is not in the log"));
}

/// `procs --json` output (JSON Lines: a procedure per line, then the summary) as the
/// document `--json-document` prints, checking that every line parses alone.
fn json_doc(stdout: &[u8]) -> serde_json::Value {
    let mut procedures = Vec::new();
    let mut summary = None;
    for line in String::from_utf8_lossy(stdout).lines() {
        let value: serde_json::Value = serde_json::from_str(line).expect("one JSON value a line");
        match value.get("summary") {
            Some(s) => summary = Some(s.clone()),
            None => procedures.push(value),
        }
    }
    serde_json::json!({ "procedures": procedures, "summary": summary.expect("a summary line") })
}

#[test]
fn procs_speaks_json() {
    let dir = tempfile::tempdir().unwrap();
    write_trees(dir.path());
    let out = proctor(&["procs", "--json", "--tree", "1"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let doc = json_doc(&out.stdout);
    let procs = doc["procedures"].as_array().unwrap();
    let by_id = |id: u64| procs.iter().find(|p| p["id"] == id).unwrap();
    assert_eq!(procs.len(), 4);
    let leaf = by_id(5);
    assert_eq!(leaf["parent"], 2);
    assert_eq!(leaf["root"], 1);
    assert_eq!(leaf["type"], "assign_region");
    assert_eq!(leaf["state"], "WAITING");
    assert_eq!(leaf["steps"], 1);
    assert_eq!(
        leaf["waiting_for"],
        serde_json::json!({"event": "region-open"})
    );
    assert!(leaf["deadline_ms"].is_u64());
    assert_eq!(leaf["failure"], serde_json::Value::Null);
    assert_eq!(
        leaf["data"],
        serde_json::json!({"table": "t5", "regions": [1, 2], "token": [222, 173]})
    );
    assert_eq!(by_id(1)["waiting_for"], serde_json::json!({"children": 2}));
    assert!(by_id(3)["waiting_for"]["timer_ms"].is_u64());
    let summary = &doc["summary"];
    assert_eq!(summary["procedures"], 8);
    assert_eq!(summary["shown"], 4);
    assert_eq!(summary["by_state"]["WAITING"], 4);
    assert_eq!(summary["corrupt"], 0);
    assert_eq!(summary["log"], "sound");

    // The document form says the same.
    let lines = json_doc(&out.stdout);
    let out = proctor(&["procs", "--json-document", "--tree", "1"], dir.path());
    let document: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(document, lines);

    let out = proctor(&["procs", "--json", "--state", "failed"], dir.path());
    let doc = json_doc(&out.stdout);
    assert_eq!(
        doc["procedures"][0]["failure"],
        serde_json::json!({"proc": 31, "type": "assign_region", "error": "boom"})
    );
    assert_eq!(doc["procedures"][0]["waiting_for"], "rollback");
    // A failure's code, when it has one.
    let out = proctor(&["procs", "--json", "--state", "rolledback"], dir.path());
    let doc = json_doc(&out.stdout);
    assert_eq!(
        doc["procedures"][0]["failure"],
        serde_json::json!({"proc": 21, "type": "assign_region", "error": "disk full", "code": "no_space"})
    );
}

/// A DAG's record shows its progress task by task, in the table and in JSON, whatever
/// its task type (the command knows none).
#[test]
fn procs_shows_a_dags_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let mut dag = proctor::DagBuilder::new();
    let (a, b) = (dag.add("create".to_string()), dag.add("fill".to_string()));
    dag.add("index".to_string());
    dag.edge(a, b);
    let mut r = record(1, ProcState::Runnable);
    r.data = rmp_serde::to_vec_named(&dag.build().unwrap()).unwrap();
    let mut wal = open_wal(dir.path()).unwrap();
    wal.append(&[
        StoreOp::Insert(r),
        StoreOp::Insert(record(2, ProcState::Runnable)),
    ])
    .unwrap();
    drop(wal);
    let procs = text(&proctor(&["procs"], dir.path()));
    assert!(
        row(&procs, 1).contains("DAG 0/3 done, 0 running; tasks rwr; edges 0>1"),
        "{procs}"
    );
    assert!(!row(&procs, 2).contains("DAG"), "{procs}");
    let out = proctor(&["procs", "--json"], dir.path());
    let doc = json_doc(&out.stdout);
    let procs = doc["procedures"].as_array().unwrap();
    assert_eq!(procs[0]["dag"], "0/3 done, 0 running; tasks rwr; edges 0>1");
    assert_eq!(
        procs[0]["data"]["tasks"],
        serde_json::json!(["create", "fill", "index"])
    );
    assert_eq!(procs[1]["dag"], serde_json::Value::Null);
}

/// A procedure paused by its failure policy shows the error, the policy and the retries
/// it spent, in the table and in JSON.
#[actix::test]
async fn procs_says_why_a_policy_paused_a_procedure() {
    #[derive(Clone, serde::Deserialize, Serialize)]
    struct Stubborn;
    #[proctor::async_trait]
    impl proctor::Procedure for Stubborn {
        async fn execute(&mut self, _: &mut proctor::Context) -> Result<proctor::Flow, ProcError> {
            Err(ProcError::failed("disk full"))
        }
        async fn rollback(&mut self, _: &mut proctor::Context) -> Result<(), ProcError> {
            Ok(())
        }
        fn failure_policy(&self, _: &ProcError) -> proctor::FailurePolicy {
            proctor::FailurePolicy::RetryThenPause {
                times: 2,
                backoff_ms: 1,
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut registry = proctor::Registry::new();
    registry.register::<Stubborn>("stubborn");
    let executor = proctor::Executor::builder()
        .registry(registry)
        .store(open_wal(dir.path()).unwrap())
        .start()
        .await
        .unwrap();
    let id = executor.submit(Stubborn).await.unwrap();
    common::wait_for_state(&executor, id, ProcState::Paused).await;
    executor.shutdown().await.unwrap();

    let procs = text(&proctor(&["procs"], dir.path()));
    let line = row(&procs, id.0);
    assert!(
        line.contains("disk full (policy RetryThenPause { times: 2, backoff_ms: 1 }, 2 retries)"),
        "{procs}"
    );
    let out = proctor(&["procs", "--json"], dir.path());
    let doc = json_doc(&out.stdout);
    let paused = &doc["procedures"][0]["steering"]["paused"];
    assert_eq!(paused["retries"], 2, "{doc}");
    assert!(paused["error"].to_string().contains("disk full"), "{doc}");
    assert!(
        paused["policy"].to_string().contains("RetryThenPause"),
        "{doc}"
    );
}

/// `proctor abort` on a stopped engine's log: the engine that starts next rolls the
/// tree back (the aborted procedure first gets the rollback of a step it may have been
/// in, then of its recorded steps), and the tree's result is the abort.
#[actix::test]
async fn abort_on_a_stopped_engine_rolls_the_tree_back_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let (executor, _) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    let child = Scripted::new(
        "child",
        vec![Step::More, Step::Suspend("never".into()), Step::More],
    );
    let root = executor
        .submit(Scripted::new(
            "root",
            vec![Step::Children(vec![child]), Step::More],
        ))
        .await
        .unwrap();
    let child = common::waiting_children(&executor, root, 1).await[0];
    executor.shutdown().await.unwrap();

    let abort = |id: ProcId| {
        output(
            Command::new(env!("CARGO_BIN_EXE_proctor"))
                .arg("abort")
                .arg(dir.path())
                .arg(id.0.to_string()),
        )
    };
    let out = abort(child);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text(&out).contains(&format!("aborted procedure {child}")));
    let again = abort(root);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        text(&again).contains(&format!("tree {root} is already rolling back")),
        "{}",
        text(&again)
    );
    let procs = text(&proctor(&["procs"], dir.path()));
    assert!(
        row(&procs, child.0).contains(" aborted by operator "),
        "{procs}"
    );
    assert!(
        row(&procs, root.0).contains(" rollback (its tree failed) "),
        "{procs}"
    );

    let (executor, rec) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    let failure = executor.wait(root).await.unwrap().unwrap_err();
    assert_eq!((failure.proc, failure.error), (child, ProcError::Aborted));
    assert_eq!(rec.count("child-exec") + rec.count("root-exec"), 0);
    // The step it may have been in, then its two recorded steps; the root's one.
    assert_eq!(rec.count("child-rollback"), 3, "{:?}", rec.calls());
    assert_eq!(rec.count("root-rollback"), 1, "{:?}", rec.calls());
    executor.shutdown().await.unwrap();
}

/// The writing commands refuse a log an engine holds, and an id the log does not have.
#[test]
fn abort_and_bypass_refuse_a_running_engine_and_an_unknown_id() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let run = |args: &[&str]| {
        output(
            Command::new(env!("CARGO_BIN_EXE_proctor"))
                .arg(args[0])
                .arg(dir.path())
                .args(&args[1..]),
        )
    };
    let engine = open_wal(dir.path()).unwrap();
    for command in ["abort", "bypass"] {
        let out = run(&[command, "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {err}");
        assert!(err.contains("held by another engine"), "{command}: {err}");
    }
    drop(engine);
    for command in ["abort", "bypass"] {
        let out = run(&[command, "999"]);
        assert_eq!(out.status.code(), Some(1), "{command}: {}", text(&out));
        assert!(
            text(&out).contains("procedure 999 is not in the store"),
            "{command}: {}",
            text(&out)
        );
    }
    let out = run(&["abort", "300"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("procedure 300 has already finished (SUCCESS)"));
}

/// `proctor pause` on a stopped engine's log: a RUNNABLE procedure and one waiting
/// for an event are PAUSED when the engine starts and run nothing until continued; a
/// parent waiting for its children is refused, and so is an unknown id.
#[actix::test]
async fn pause_on_a_stopped_engine_holds_a_procedure_until_continued() {
    let dir = tempfile::tempdir().unwrap();
    let (executor, rec1) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    // In a step when the engine stops: its record stays RUNNABLE.
    let runnable = executor
        .submit(Scripted::new("q", vec![Step::Hold, Step::More]))
        .await
        .unwrap();
    rec1.signal.notified().await;
    let waiting = executor
        .submit(Scripted::new(
            "r",
            vec![Step::Suspend("go".into()), Step::More],
        ))
        .await
        .unwrap();
    let child = Scripted::new("c", vec![Step::Suspend("go".into())]);
    let parent = executor
        .submit(Scripted::new(
            "p",
            vec![Step::Children(vec![child]), Step::More],
        ))
        .await
        .unwrap();
    common::wait_for_state(&executor, waiting, proctor::ProcState::Waiting).await;
    common::waiting_children(&executor, parent, 1).await;
    executor.shutdown_now().await.unwrap();

    let run = |id: u64| {
        output(
            Command::new(env!("CARGO_BIN_EXE_proctor"))
                .arg("pause")
                .arg(dir.path())
                .arg(id.to_string()),
        )
    };
    for id in [runnable, waiting] {
        let out = run(id.0);
        assert!(out.status.success(), "{id}: {}", text(&out));
        assert!(text(&out).contains("stays paused"), "{}", text(&out));
    }
    let refused = run(parent.0);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(
        text(&refused).contains("waits for its children"),
        "{}",
        text(&refused)
    );
    let unknown = run(1 << 40);
    assert_eq!(unknown.status.code(), Some(1), "{}", text(&unknown));
    let procs = text(&proctor(&["procs", "--state", "paused"], dir.path()));
    assert_eq!(
        ids(&procs),
        [runnable.0.to_string(), waiting.0.to_string()],
        "{procs}"
    );

    let (executor, rec) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    for id in [runnable, waiting] {
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, proctor::ProcState::Paused, "{id}");
    }
    // The event does not wake a paused procedure; the parent's child goes on.
    executor.wake_event("go").await.unwrap();
    assert_eq!(executor.wait(parent).await.unwrap(), Ok(()));
    assert_eq!(
        rec.count("q-exec") + rec.count("r-exec"),
        0,
        "{:?}",
        rec.calls()
    );
    for id in [runnable, waiting] {
        executor.resume(id).await.unwrap();
    }
    // `r` runs its next step, as a recovered suspended procedure does by default: the
    // wake it missed while paused is in no log.
    rec.signal.notified().await; // `q` holds in its first step again
    rec.gate.notify_one();
    assert_eq!(executor.wait(runnable).await.unwrap(), Ok(()));
    assert_eq!(executor.wait(waiting).await.unwrap(), Ok(()));
    assert_eq!(rec.count("q-exec"), 2, "{:?}", rec.calls());
    assert_eq!(rec.count("r-exec"), 1, "{:?}", rec.calls());
    executor.shutdown().await.unwrap();
}

/// `proctor continue` and `proctor rollback` on a stopped engine's log: one paused
/// procedure goes on at the next start, the other's tree rolls back.
#[actix::test]
async fn continue_and_rollback_of_paused_procedures_on_a_stopped_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (executor, rec1) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    // Steps to spare after the wake: wherever the pause lands, it lands before the end.
    let plan = || {
        let mut plan = vec![Step::More, Step::Suspend("go".into())];
        plan.extend(std::iter::repeat_n(Step::More, 4));
        plan
    };
    let goes_on = executor.submit(Scripted::new("a", plan())).await.unwrap();
    let undone = executor.submit(Scripted::new("b", plan())).await.unwrap();
    for id in [goes_on, undone] {
        common::wait_for_state(&executor, id, proctor::ProcState::Waiting).await;
    }
    // Each pauses when it would run again.
    let pauses: Vec<_> = [goes_on, undone]
        .into_iter()
        .map(|id| {
            let executor = executor.clone();
            actix::spawn(async move { executor.pause(id).await })
        })
        .collect();
    for id in [goes_on, undone] {
        let _ = executor.state(id).await; // lets the requests go out first
    }
    executor.wake_event("go").await.unwrap();
    for pause in pauses {
        pause.await.unwrap().expect("paused");
    }
    executor.shutdown().await.unwrap();

    let procs = text(&proctor(&["procs", "--state", "paused"], dir.path()));
    assert!(
        row(&procs, goes_on.0).contains("an operator: paused by an operator"),
        "{procs}"
    );
    let run = |command: &str, id: ProcId| {
        output(
            Command::new(env!("CARGO_BIN_EXE_proctor"))
                .arg(command)
                .arg(dir.path())
                .arg(id.0.to_string()),
        )
    };
    let out = run("continue", goes_on);
    assert!(out.status.success(), "{}", text(&out));
    let out = run("rollback", undone);
    assert!(out.status.success(), "{}", text(&out));
    let again = run("continue", undone);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(text(&again).contains("is FAILED"), "{}", text(&again));

    let (executor, rec) = common::start(Box::new(open_wal(dir.path()).unwrap()), 2).await;
    assert_eq!(executor.wait(goes_on).await.unwrap(), Ok(()));
    let failure = executor.wait(undone).await.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::Aborted);
    // `a` ran each of its steps once, across both engines; `b` ran nothing more and
    // rolled back every step it had run.
    let runs = |call: &str| rec1.count(call) + rec.count(call);
    assert_eq!(runs("a-exec"), 6, "{:?} {:?}", rec1.calls(), rec.calls());
    assert_eq!(rec.count("b-exec"), 0, "{:?}", rec.calls());
    assert_eq!(
        rec.count("b-rollback"),
        rec1.count("b-exec"),
        "{:?}",
        rec.calls()
    );
    executor.shutdown().await.unwrap();
}

/// A log with a middle segment missing: `procs` refuses it (exit 1) and shows what the
/// segments before the gap hold, as its summary says.
#[test]
fn procs_shows_what_precedes_a_missing_middle_segment() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let segments = common::wal::segments(dir.path());
    assert!(segments.len() >= 4, "{segments:?}");
    let mut expected = std::collections::BTreeMap::new();
    for file in &segments[..2] {
        let bytes = fs::read(file).unwrap();
        for frame in proctor::ops::wal::scan_segment(&bytes, false).frames {
            for op in frame.ops {
                op.apply_to(&mut expected);
            }
        }
    }
    assert!(!expected.is_empty());
    let gone = &segments[2];
    fs::remove_file(gone).unwrap();
    let procs = proctor(&["procs"], dir.path());
    assert_eq!(procs.status.code(), Some(1), "{}", text(&procs));
    let summary = text(&procs).lines().last().unwrap_or_default().to_string();
    assert!(
        summary.starts_with(&format!("{} procedures, 0 corrupt", expected.len())),
        "{summary}"
    );
    assert!(
        summary.contains("shown is what precedes the damage"),
        "{summary}"
    );
    assert!(
        summary.contains(gone.file_name().unwrap().to_str().unwrap()),
        "{summary}"
    );
    for id in expected.keys() {
        assert!(
            !row(&text(&procs), id.0).is_empty(),
            "procedure {id} not shown"
        );
    }
}
/// `proctor wal verify` beside an engine that appends, rolls and compacts all the
/// while: it never reports damage the engine's own work made up, and says the
/// directory is in use and what its answer covers.
#[test]
fn verify_beside_a_running_engine_reports_no_false_damage() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4 << 10,
        max_segments: 2,
        sync: true,
    };
    let mut wal = open_wal_with(dir.path(), options).unwrap();
    wal.append(&[StoreOp::Insert(record(1, ProcState::Waiting))])
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // Segments the engine has deleted so far: the verifies go on until compaction has
    // run under them often enough, however slow the machine.
    let deleted = Arc::new(AtomicU64::new(0));
    let engine = std::thread::spawn({
        let stop = Arc::clone(&stop);
        let deleted = Arc::clone(&deleted);
        move || {
            let mut id = 2;
            while !stop.load(Ordering::Relaxed) {
                wal.append(&[StoreOp::Insert(record(id, ProcState::Runnable))])
                    .unwrap();
                wal.append(&[StoreOp::Update(record(id, ProcState::Success))])
                    .unwrap();
                if id > 20 {
                    wal.append(&[StoreOp::Delete(ProcId(id - 20))]).unwrap();
                }
                id += 1;
                deleted.store(wal.stats().segments_deleted, Ordering::Relaxed);
            }
            wal.stats()
        }
    });
    let mut outcomes = std::collections::BTreeMap::<Option<i32>, usize>::new();
    let mut wrong = Vec::new();
    let mut in_use = None;
    let mut runs = 0;
    while runs < 150 || (deleted.load(Ordering::Relaxed) <= 10 && runs < 5_000) {
        runs += 1;
        let verify = proctor(&["wal", "verify"], dir.path());
        let code = verify.status.code();
        *outcomes.entry(code).or_default() += 1;
        let out = format!(
            "{}{}",
            text(&verify),
            String::from_utf8_lossy(&verify.stderr)
        );
        match code {
            Some(0) => {
                if out.contains("in use by a running engine") {
                    in_use = Some(out);
                }
            }
            // No stable view within the bound: no verdict, and it says so.
            Some(4) => assert!(out.contains("no consistent view"), "{out}"),
            _ => wrong.push(out),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let stats = engine.join().unwrap();
    println!("exit codes: {outcomes:?}; {stats:?}");
    assert!(stats.segments_deleted > 10, "{stats:?}");
    assert!(
        wrong.is_empty(),
        "{outcomes:?}; {} wrong verdicts, the first: {}",
        wrong.len(),
        wrong[0]
    );
    let out = in_use.unwrap_or_else(|| panic!("no sound verdict: {outcomes:?}"));
    assert!(
        out.contains("checked a consistent view of") && out.contains("segments as of the scan"),
        "{out}"
    );
}

/// `wal dump --json` and `wal verify --json`: one JSON value a line, the records with
/// their states decoded, the verdict as a word.
#[test]
fn wal_dump_and_verify_speak_json() {
    let dir = tempfile::tempdir().unwrap();
    write_trees(dir.path());
    let out = proctor(&["wal", "dump", "--json"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let ops: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON value a line"))
        .collect();
    let leaf = ops
        .iter()
        .find(|op| op["record"]["id"] == 5)
        .expect("procedure 5's record");
    assert_eq!(leaf["op"], "insert");
    assert_eq!(leaf["frame"], "batch");
    assert!(leaf["lsn"].is_u64() && leaf["offset"].is_u64());
    assert_eq!(leaf["record"]["type"], "assign_region");
    assert_eq!(
        leaf["record"]["data"],
        serde_json::json!({"table": "t5", "regions": [1, 2], "token": [222, 173]})
    );

    let out = proctor(&["wal", "verify", "--json"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["verdict"], "sound");
    assert_eq!(verdict["in_use"], false);
    assert!(
        verdict["segments"][0]["frames"].as_u64().unwrap() > 0,
        "{verdict}"
    );
    assert_eq!(verdict["damage"], serde_json::Value::Null);
}

/// `procs --pg` reads a PostgreSQL store beside its running leader: its procedures,
/// and the lease in the summary.
#[actix::test]
async fn procs_reads_a_postgresql_store_and_its_lease_beside_the_leader() {
    let schema = common::pg::fresh_schema();
    let url = common::pg::server().url();
    let lease = proctor::PgLease::new(url.clone(), "master-a")
        .options(proctor::PgOptions::default().schema(&schema))
        .period(std::time::Duration::from_secs(30));
    let rec = std::sync::Arc::new(common::Recorder::default());
    let executor = proctor::Executor::builder()
        .registry(common::registry())
        .store(common::pg::store_in(&schema))
        .leadership(lease)
        .env(rec)
        .start()
        .await
        .unwrap();
    let id = executor
        .submit(Scripted::new(
            "waits",
            vec![Step::Suspend("never".into()), Step::More],
        ))
        .await
        .unwrap();
    common::wait_for_state(&executor, id, ProcState::Waiting).await;

    let args = ["procs", "--pg", &url, "--pg-schema", &schema, "--json"].map(String::from);
    let out = tokio::task::spawn_blocking(move || {
        output(Command::new(env!("CARGO_BIN_EXE_proctor")).args(&args))
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = text(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["id"], id.0);
    assert_eq!(lines[0]["state"], "WAITING");
    let lease = &lines[1]["summary"]["lease"];
    assert_eq!(lease["holder"], "master-a");
    assert_eq!(lease["epoch"], 1);
    assert!(
        lease["remaining_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{lease}"
    );
    let log = lines[1]["summary"]["log"].as_str().unwrap();
    assert!(log.contains("leader lease held by master-a"), "{log}");
    executor.shutdown().await.unwrap();

    // A schema without a store is a clear error.
    let out = tokio::task::spawn_blocking(move || {
        output(Command::new(env!("CARGO_BIN_EXE_proctor")).args([
            "procs",
            "--pg",
            &common::pg::server().url(),
            "--pg-schema",
            "nothing_here",
        ]))
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("holds no proctor store"), "{err}");
}

/// A saga's journal shows each step's value as the step returned it, not as the
/// MessagePack bytes it is kept in.
#[actix::test]
async fn procs_shows_a_sagas_step_values_decoded() {
    #[derive(serde::Deserialize, Serialize)]
    struct AddNode;
    #[derive(serde::Deserialize, Serialize)]
    struct Slot {
        node: String,
        slot: u32,
    }
    #[proctor::async_trait]
    impl proctor::SagaProcedure for AddNode {
        type Output = u32;
        async fn run(&self, ctx: &mut proctor::SagaContext<'_>) -> Result<u32, ProcError> {
            let slot: Slot = ctx
                .step(
                    "reserve a slot",
                    || async {
                        Ok(Slot {
                            node: "n1".into(),
                            slot: 7,
                        })
                    },
                    |_: proctor::Undoing<Slot>| async { Ok(()) },
                )
                .await?;
            ctx.step(
                "nothing",
                || async { Ok(()) },
                |_: proctor::Undoing<()>| async { Ok(()) },
            )
            .await?;
            Ok(slot.slot)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut registry = proctor::Registry::new();
    registry.register_saga::<AddNode>("add_node");
    let executor = proctor::Executor::builder()
        .registry(registry)
        .store(open_wal(dir.path()).unwrap())
        .start()
        .await
        .unwrap();
    let id = executor.submit(proctor::Saga::new(AddNode)).await.unwrap();
    assert_eq!(executor.wait_value::<u32>(id).await.unwrap(), 7);
    executor.shutdown().await.unwrap();

    let out = proctor(&["procs", "--json"], dir.path());
    let doc = json_doc(&out.stdout);
    let journal = &doc["procedures"][0]["data"]["journal"];
    assert_eq!(
        journal[0],
        serde_json::json!({"name": "reserve a slot", "value": {"node": "n1", "slot": 7}}),
        "{doc}"
    );
    assert_eq!(
        journal[1],
        serde_json::json!({"name": "nothing", "value": null}),
        "{doc}"
    );
}

/// `procs --pg` on a cluster's store, beside its two running members: each procedure
/// with its partition, and after the summary the cluster — both members, every
/// partition with the owner and the epoch its engine runs under, the coordinator and
/// the moves that assigned the partitions.
#[actix::test]
async fn procs_shows_a_clusters_members_partitions_and_moves() {
    use std::time::{Duration, Instant};
    let schema = common::pg::fresh_schema();
    let url = common::pg::server().url();
    let rec = std::sync::Arc::new(common::Recorder::default());
    let member = |name: &'static str| {
        let rec = rec.clone();
        proctor::Cluster::builder(url.clone(), name)
            .options(proctor::PgOptions::default().schema(&schema))
            .partitions(8)
            .period(Duration::from_millis(900))
            .engines(move || {
                proctor::Executor::builder()
                    .registry(common::registry())
                    .env(rec.clone())
                    .workers(2)
            })
            .start()
    };
    let a = member("a").await.expect("a joins");
    let b = member("b").await.expect("b joins");
    let started = Instant::now();
    while a.owned().len() != 4 || b.owned().len() != 4 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the partitions never spread: a {:?}, b {:?}",
            a.owned(),
            b.owned()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut ids = Vec::new();
    for i in 0..4 {
        let via = if i % 2 == 0 { &a } else { &b };
        let waits = Scripted::new("waits", vec![Step::Suspend("never".into()), Step::More]);
        ids.push(via.submit(waits).await.expect("submitted"));
    }
    // The epoch each partition's engine runs under, as its role says.
    let mut epochs = std::collections::BTreeMap::new();
    for (name, member) in [("a", &a), ("b", &b)] {
        for partition in member.owned() {
            let engine = member
                .engine(partition)
                .expect("an engine per owned partition");
            match engine.role().await.expect("role") {
                proctor::Role::Owner {
                    holder,
                    partition: p,
                    epoch,
                } => {
                    assert_eq!((holder.as_str(), p), (name, partition));
                    epochs.insert(partition, (name, epoch));
                }
                other => panic!("partition {partition}'s engine is {other:?}"),
            }
        }
    }
    assert_eq!(epochs.len(), 8);

    let run = |extra: Option<&str>| {
        let mut args: Vec<String> = ["procs", "--pg", &url, "--pg-schema", &schema]
            .map(String::from)
            .to_vec();
        args.extend(extra.map(String::from));
        tokio::task::spawn_blocking(move || {
            output(Command::new(env!("CARGO_BIN_EXE_proctor")).args(&args))
        })
    };
    let out = run(None).await.unwrap();
    let table = text(&out);
    assert!(
        out.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.lines().next().unwrap().contains("ROOT  PART  TYPE"),
        "{table}"
    );
    for id in &ids {
        let cells: Vec<String> = row(&table, id.0)
            .split_whitespace()
            .map(String::from)
            .collect();
        assert_eq!(cells[3], (id.0 % 8).to_string(), "{table}");
    }
    assert!(
        table.contains("a cluster of 8 partitions; coordinator's lease held by"),
        "{table}"
    );
    assert!(
        table.contains("cluster: 8 partitions, 2 members (2 live)"),
        "{table}"
    );
    for name in ["a", "b"] {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no member {name}:\n{table}"));
        assert!(line.contains("live,") && line.contains("ms left"), "{line}");
    }
    let header = table
        .lines()
        .position(|l| l.starts_with("PARTITION"))
        .unwrap_or_else(|| panic!("no partitions:\n{table}"));
    for (partition, (owner, epoch)) in &epochs {
        let line = table.lines().nth(header + 1 + *partition as usize).unwrap();
        let cells: Vec<&str> = line.split_whitespace().collect();
        let expected = [partition.to_string(), owner.to_string(), epoch.to_string()];
        assert_eq!(
            cells[..3],
            expected.each_ref().map(String::as_str),
            "{table}"
        );
    }
    assert!(table.contains("newest moves"), "{table}");
    assert!(table.contains("assigned"), "{table}");

    let out = run(Some("--json")).await.unwrap();
    let lines: Vec<serde_json::Value> = text(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), ids.len() + 1, "{lines:?}");
    for line in &lines[..ids.len()] {
        assert_eq!(
            line["partition"],
            line["id"].as_u64().unwrap() % 8,
            "{line}"
        );
    }
    let cluster = &lines[ids.len()]["summary"]["cluster"];
    let members: Vec<&str> = cluster["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(members, ["a", "b"], "{cluster}");
    assert!(
        cluster["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["live"] == true && m["remaining_ms"].as_u64().is_some()),
        "{cluster}"
    );
    let partitions = cluster["partitions"].as_array().unwrap();
    assert_eq!(partitions.len(), 8, "{cluster}");
    for p in partitions {
        let (owner, epoch) = epochs[&(p["partition"].as_u64().unwrap() as u32)];
        assert_eq!(
            (p["owner"].as_str(), p["epoch"].as_i64()),
            (Some(owner), Some(epoch))
        );
    }
    let counted: u64 = partitions
        .iter()
        .map(|p| p["procedures"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, ids.len() as u64, "{cluster}");
    assert!(
        ["a", "b"].contains(&cluster["coordinator"].as_str().unwrap()),
        "{cluster}"
    );
    let moves = cluster["recent_moves"].as_array().unwrap();
    assert!(
        moves.iter().filter(|m| m["reason"] == "assigned").count() >= 8,
        "{cluster}"
    );

    a.leave().await.expect("a leaves");
    b.leave().await.expect("b leaves");
}
