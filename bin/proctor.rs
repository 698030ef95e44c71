//! `proctor`: the operator command for a proctor WAL directory. Its reading commands
//! (`wal verify`, `wal dump`, `procs`) change nothing, so they are safe beside a running
//! engine and on a damaged log. `wal verify` holds the engine's lock for its scan if it
//! is free (so no engine starts meanwhile: one that tries is refused, as beside another
//! engine, and can be started again); if a running engine holds it, verify checks
//! a consistent view (listed, scanned, listed again, retried while the engine's rolls
//! and compactions changed it) and says the directory is in use, and what is in flight
//! is not damage. `wal dump` and `procs` take no lock: beside a running engine they read
//! whatever is there as they go. `bypass`, `abort`, `pause`,
//! `continue` and `rollback` write through the store, so they open the log as the engine does (taking its lock: the engine must be
//! stopped).
//!
//! ```sh
//! proctor wal verify DIR [--json]   # checks the log as the engine would open it
//! proctor wal dump DIR [--json]     # one line per record
//! proctor procs DIR [--state S,..] [--type NAME] [--tree ID] [--json | --json-document]
//! proctor procs --pg URL [--pg-schema S] [..]  # a PostgreSQL store: its procedures,
//!                                       # its lease and, of a cluster, the partitions
//! proctor bypass DIR ID [--recursive]   # mark a stuck procedure finished (HBCK2)
//! proctor bypass URL ID [--force]       # the same on a running engine, through its
//!                                       # admin page (token: PROCTOR_ADMIN_TOKEN)
//! proctor abort DIR ID                  # fail it; its tree rolls back at next start
//! proctor pause DIR ID                  # it stays paused at next start
//! proctor resume DIR ID                 # a paused procedure goes on (alias: continue)
//! proctor rollback DIR ID               # a paused procedure's tree rolls back
//! ```
//!
//! Output goes through [`Out`]: a reader that closes the pipe early (`| head`) ends the
//! command quietly with exit 0.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use proctor::ops::recovery::{self, Steer};
use proctor::ops::{scan_wal_dir, scan_wal_dir_with, view_wal_dir, DirView, Repair, WalDirScan};
use proctor::store::{ProcRecord, StoreOp};
use proctor::{ProcId, ProcState, ProcedureStore, StoreError, WalStore};
use serde::de;
use serde::Serialize;
use serde_json::{json, Value};

const EXIT_CODES: &str = "\
Exit codes:
  0  done: the log is sound (verify), or the command did what it was asked
  1  verify, dump, procs: the log is damaged (the engine would refuse to start on it),
     or procs found procedures recovery cannot rebuild;
     bypass, abort: refused (the reason is printed)
  2  usage: bad arguments, a directory that is missing or holds no WAL, a --tree
     procedure that is not in the log, an IO error, or (bypass, abort) the log's lock
     held by a running engine
  3  verify: the log ends in a torn tail (or an interrupted segment roll, or segments
     an interrupted compaction left below the start of the log), what a crash leaves;
     the engine repairs it at next start and loses nothing acknowledged
  4  verify: a running engine changed the directory's segments during each of its 50
     scans, so no consistent view was had: no verdict (not damage); try again";

#[derive(Parser)]
#[command(
    name = "proctor",
    version,
    about = "Inspect, verify and repair proctor WAL directories, and read PostgreSQL stores",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The write-ahead log itself.
    Wal {
        #[command(subcommand)]
        command: WalCommand,
    },
    /// The procedures the log holds, latest record of each: finished roots (kept with
    /// their results) included; narrow with --state, --type or --tree. A DAG's data is
    /// its progress, task by task (`DAG 1/6 done, 2 running; tasks dssrww`: waiting,
    /// ready, started, done, undone).
    #[command(after_help = EXIT_CODES)]
    Procs {
        /// The WAL directory (or `--pg`).
        #[arg(required_unless_present = "pg")]
        dir: Option<PathBuf>,
        /// Read a PostgreSQL store instead (a `postgresql://` URL or libpq key-values):
        /// its procedures and its leader lease, beside a running leader or not. A
        /// cluster's store shows each procedure's partition, and after the summary the
        /// cluster: its coordinator, members, partitions (owner, epoch, pending
        /// hand-off, moves) and newest moves (in JSON, the summary's "cluster").
        #[arg(long, value_name = "URL", conflicts_with = "dir")]
        pg: Option<String>,
        /// The schema of the PostgreSQL store's tables.
        #[arg(
            long,
            value_name = "SCHEMA",
            default_value = "proctor",
            requires = "pg"
        )]
        pg_schema: String,
        /// Only procedures in these states (repeat, or separate with commas; any case):
        /// INITIALIZING, RUNNABLE, WAITING, WAITING_TIMEOUT, PAUSED, ROLLBACK_PAUSED,
        /// FAILED, SUCCESS, ROLLEDBACK.
        #[arg(long = "state", value_name = "STATE", value_delimiter = ',')]
        states: Vec<String>,
        /// Only procedures of this registered type.
        #[arg(long = "type", value_name = "NAME")]
        type_name: Option<String>,
        /// Only the tree of this procedure (its root's whole tree), indented by parent.
        #[arg(long, value_name = "ID")]
        tree: Option<u64>,
        /// JSON Lines: one object per procedure, then one {"summary": {...}} line (so
        /// `| head -1` is a record).
        #[arg(long, conflicts_with = "json_document")]
        json: bool,
        /// One JSON document: {"procedures": [...], "summary": {...}}.
        #[arg(long)]
        json_document: bool,
    },
    /// Mark a stuck procedure finished (SUCCESS) without running further or rolling
    /// back: on a stopped engine's directory (its parent goes on as if it had succeeded
    /// when the engine starts again), or on a running engine through its admin page
    /// (an `http://` URL: the page's actions need its token, from PROCTOR_ADMIN_TOKEN).
    #[command(after_help = EXIT_CODES)]
    Bypass {
        /// The WAL directory (of a stopped engine: its lock is taken), or a running
        /// engine's admin page (`http://HOST:PORT/BASE`): then the bypass is the
        /// engine's, answered once it is durable.
        #[arg(value_name = "DIR|URL")]
        dir: PathBuf,
        /// The procedure.
        id: u64,
        /// Also bypass its unfinished descendants (required if it has any).
        #[arg(long)]
        recursive: bool,
        /// On a running engine (a URL): take a procedure queued or stuck in a step
        /// too, dropping its step (HBCK2's `bypass -o`). What the step did stays done.
        /// (A stopped engine's bypass takes such a procedure without it: nothing runs
        /// then.)
        #[arg(long)]
        force: bool,
    },
    /// Abort an unfinished procedure on a stopped engine's directory: it is recorded as
    /// failed ("aborted by operator") without asking it, and when the engine starts
    /// again its tree rolls back with that failure as its result. Refused for a finished
    /// procedure and for a tree that has already failed.
    #[command(after_help = EXIT_CODES)]
    Abort {
        /// The WAL directory (of a stopped engine: its lock is taken).
        dir: PathBuf,
        /// The procedure.
        id: u64,
    },
    /// Pause a procedure on a stopped engine's directory: a RUNNABLE one, or one
    /// waiting for an event or a timer, is recorded PAUSED and runs nothing when the
    /// engine starts until an operator continues it (or rolls it back). Refused for a
    /// parent waiting for its children (pause them), and in a tree rolling back.
    #[command(after_help = EXIT_CODES)]
    Pause {
        /// The WAL directory (of a stopped engine: its lock is taken).
        dir: PathBuf,
        /// The procedure.
        id: u64,
    },
    /// Resume (continue) a paused procedure on a stopped engine's directory: a PAUSED
    /// one runs the step that paused it again when the engine starts, a ROLLBACK_PAUSED
    /// one retries its rollback. Refused in any other state. (`continue` is the same
    /// command.)
    #[command(after_help = EXIT_CODES, visible_alias = "continue")]
    Resume {
        /// The WAL directory (of a stopped engine: its lock is taken).
        dir: PathBuf,
        /// The procedure.
        id: u64,
    },
    /// Roll back a PAUSED procedure on a stopped engine's directory: it is recorded as
    /// aborted and its tree rolls back when the engine starts, the step that failed
    /// first. Refused past the tree's point of no return (continue instead).
    #[command(after_help = EXIT_CODES)]
    Rollback {
        /// The WAL directory (of a stopped engine: its lock is taken).
        dir: PathBuf,
        /// The procedure.
        id: u64,
    },
}

#[derive(Subcommand)]
enum WalCommand {
    /// Check the log as the engine would open it: exit 0 when sound, 3 when it ends in
    /// a torn tail the engine will truncate, 1 when it is damaged. Beside a running
    /// engine (it holds DIR/LOCK) the check is of a consistent view of the log as of
    /// the scan: an append, roll or compaction in flight is the engine's work, not
    /// damage, and what it writes later is not checked; exit 4 if the engine changed
    /// the directory during every attempt.
    #[command(after_help = EXIT_CODES)]
    Verify {
        /// The WAL directory.
        dir: PathBuf,
        /// One JSON object: {"verdict", "segments": [...], "repairs", "damage",
        /// "in_use", "frames"}.
        #[arg(long)]
        json: bool,
    },
    /// Print one line per record.
    #[command(after_help = EXIT_CODES)]
    Dump {
        /// The WAL directory.
        dir: PathBuf,
        /// JSON Lines: one object per op ({"segment", "offset", "lsn", "frame", "op",
        /// "record"} or {"op": "delete", "id"}), then a {"repair"} or {"damage"} line
        /// for each.
        #[arg(long)]
        json: bool,
    },
}

/// How a command ended, as its exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exit {
    /// 0: sound, or done.
    Done = 0,
    /// 1: the log is damaged, or the command was refused.
    Failed = 1,
    /// 3: `wal verify` found a torn tail the engine will truncate.
    TornTail = 3,
    /// 4: `wal verify` had no consistent view of a directory a running engine kept
    /// changing.
    NoView = 4,
}

/// Why a command stopped: exit 2, or a reader that went away (exit 0).
enum Stop {
    /// Usage or IO: printed on stderr.
    Error(String),
    /// Writing to stdout failed: a closed pipe ends the command normally.
    Output(io::Error),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Error(e.to_string())
    }
}

impl From<io::Error> for Stop {
    fn from(e: io::Error) -> Self {
        Stop::Output(e)
    }
}

type Outcome = Result<Exit, Stop>;

/// Reading a whole log allocates a record per frame; the command uses mimalloc (the
/// library itself leaves the allocator to the program that uses it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Buffered stdout. A write error (a closed pipe above all) is kept by the caller's `?`
/// and ends the command; see [`main`].
type Out = BufWriter<io::StdoutLock<'static>>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = BufWriter::new(io::stdout().lock());
    let result = match cli.command {
        Command::Wal {
            command: WalCommand::Verify { dir, json },
        } => verify(&mut out, &dir, json),
        Command::Wal {
            command: WalCommand::Dump { dir, json },
        } => dump(&mut out, &dir, json),
        Command::Procs {
            dir,
            pg,
            pg_schema,
            states,
            type_name,
            tree,
            json,
            json_document,
        } => parse_states(&states).and_then(|states| {
            let filter = Filter {
                states,
                type_name,
                tree: tree.map(ProcId),
            };
            let form = match (json, json_document) {
                (true, _) => Form::JsonLines,
                (_, true) => Form::JsonDocument,
                _ => Form::Table,
            };
            let source = match (dir, pg) {
                (_, Some(url)) => Source::Pg {
                    url,
                    schema: pg_schema,
                },
                (Some(dir), None) => Source::Wal(dir),
                (None, None) => return Err(Stop::Error("give a WAL directory or --pg URL".into())),
            };
            procs(&mut out, &source, &filter, form)
        }),
        Command::Bypass {
            dir,
            id,
            recursive,
            force,
        } => match dir.to_str().filter(|d| d.starts_with("http://")) {
            Some(url) => online_bypass(&mut out, url, ProcId(id), recursive, force),
            None if force => Err(Stop::Error(
                "--force is for a running engine (an http:// URL of its admin page): a \
                 stopped engine's bypass takes a RUNNABLE procedure without it"
                    .into(),
            )),
            None => bypass(&mut out, &dir, ProcId(id), recursive),
        },
        Command::Abort { dir, id } => abort(&mut out, &dir, ProcId(id)),
        Command::Pause { dir, id } => steer(&mut out, &dir, ProcId(id), Steer::Pause),
        Command::Resume { dir, id } => steer(&mut out, &dir, ProcId(id), Steer::Continue),
        Command::Rollback { dir, id } => steer(&mut out, &dir, ProcId(id), Steer::Rollback),
    };
    let result = result.and_then(|exit| out.flush().map(|()| exit).map_err(Stop::Output));
    match result {
        Ok(exit) => ExitCode::from(exit as u8),
        Err(Stop::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(Stop::Output(e)) => {
            let _ = writeln!(io::stderr(), "proctor: writing to stdout: {e}");
            ExitCode::from(2)
        }
        Err(Stop::Error(e)) => {
            let _ = writeln!(io::stderr(), "proctor: {e}");
            ExitCode::from(2)
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One line for the damage that refuses a log: the file, the byte, the reason.
fn describe(damage: &StoreError) -> String {
    match damage {
        StoreError::Corrupt {
            file,
            offset,
            reason,
        } => format!("{file}: corrupt at byte {offset}: {reason}"),
        other => other.to_string(),
    }
}

/// One line for a repair the engine makes at its next start.
fn describe_repair(repair: &Repair) -> String {
    match repair {
        Repair::Truncate {
            path,
            offset,
            reason,
        } => format!(
            "torn tail at {}:{offset}, will be truncated at next start (byte {offset}: {reason})",
            path.display()
        ),
        Repair::Remove { path, reason } => format!(
            "interrupted roll at {}:0, will be removed at next start ({reason})",
            path.display()
        ),
        Repair::Leftover { path, start } => format!(
            "leftover of an interrupted compaction at {}, will be removed at next start \
             (the log begins at segment {start})",
            path.display()
        ),
    }
}

/// A directory without a single segment is not a log: the engine would start a new,
/// empty one there, which is never what an operator pointing at it meant.
fn no_wal(dir: &Path, scan: &WalDirScan) -> Option<Stop> {
    let empty = scan.segments.is_empty() && scan.repairs.is_empty() && scan.damage.is_none();
    empty.then(|| {
        let hint = match wal_below(dir) {
            Some(sub) => format!(
                "; {} holds one (a service's data directory keeps its log in a \
                 subdirectory): point the command there",
                sub.display()
            ),
            None => String::new(),
        };
        Stop::Error(format!(
            "{} holds no WAL: no segment file (named like 00000000000000000001.wal){hint}",
            dir.display()
        ))
    })
}

/// A subdirectory of `dir` (the first, by name) that holds a segment file: where the
/// log is when `dir` is a service's data directory.
fn wal_below(dir: &Path) -> Option<std::path::PathBuf> {
    let is_segment = |name: &std::ffi::OsStr| {
        let name = name.to_string_lossy();
        name.strip_suffix(".wal")
            .is_some_and(|seq| seq.len() == 20 && seq.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut subdirs: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    subdirs.sort();
    subdirs.into_iter().find(|sub| {
        std::fs::read_dir(sub)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .any(|e| is_segment(&e.file_name()))
            })
            .unwrap_or(false)
    })
}

fn segment_name(seq: u64) -> String {
    format!("{seq:020}.wal")
}

/// Sound means the engine would start on it and repair nothing; a torn tail is what a
/// crash leaves and holds nothing that was acknowledged, so it has its own exit code.
/// Beside a running engine, what a crash would leave is the engine's work in flight:
/// the view is sound if nothing else is wrong.
fn verify(out: &mut Out, dir: &Path, as_json: bool) -> Outcome {
    let lock = dir.join("LOCK");
    let (scan, in_use) = match view_wal_dir(dir)? {
        DirView::Stable { scan, in_use, .. } => (scan, in_use),
        DirView::Unstable { attempts } => {
            if as_json {
                json_line(out, &json!({ "verdict": "no_view", "attempts": attempts }))?;
            } else {
                writeln!(
                    out,
                    "no consistent view of {} in {attempts} scans: its segments changed \
                     during every one (a running engine rolling or compacting); no \
                     verdict, try again",
                    dir.display()
                )?;
            }
            return Ok(Exit::NoView);
        }
    };
    if let Some(stop) = no_wal(dir, &scan) {
        return Err(stop);
    }
    let frames: u64 = scan.segments.iter().map(|s| s.frames).sum();
    let exit = match (&scan.damage, in_use, scan.repairs.is_empty()) {
        (Some(_), _, _) => Exit::Failed,
        // Beside a running engine, what looks torn is its append in flight.
        (None, true, _) | (None, false, true) => Exit::Done,
        (None, false, false) => Exit::TornTail,
    };
    if as_json {
        let segments: Vec<Value> = scan
            .segments
            .iter()
            .map(|s| {
                json!({
                    "path": s.path.display().to_string(),
                    "frames": s.frames,
                    "next_lsn": s.next_lsn,
                    "sealed": s.sealed,
                })
            })
            .collect();
        let verdict = match exit {
            Exit::Failed => "damaged",
            Exit::TornTail => "torn_tail",
            _ => "sound",
        };
        let repairs: Vec<String> = if in_use {
            Vec::new()
        } else {
            scan.repairs.iter().map(describe_repair).collect()
        };
        json_line(
            out,
            &json!({
                "verdict": verdict,
                "in_use": in_use,
                "segments": segments,
                "frames": frames,
                "repairs": repairs,
                "damage": scan.damage.as_ref().map(describe),
            }),
        )?;
        return Ok(exit);
    }
    let in_use = in_use.then(|| {
        format!(
            "in use by a running engine ({} is held): checked a consistent view of {} \
             segments as of the scan; an append, roll or compaction in flight is the \
             engine's own work, not damage, and what it writes after the scan is not checked",
            lock.display(),
            scan.segments.len()
        )
    });
    for segment in &scan.segments {
        writeln!(
            out,
            "ok {}: {} frames, next LSN {}{}",
            segment.path.display(),
            segment.frames,
            segment.next_lsn,
            if segment.sealed { ", sealed" } else { "" }
        )?;
    }
    if let Some(damage) = &scan.damage {
        writeln!(out, "{}", describe(damage))?;
        if let Some(in_use) = &in_use {
            writeln!(out, "{in_use}")?;
        }
        writeln!(out, "NOT sound: the engine refuses to start on this log")?;
        return Ok(exit);
    }
    let summary = format!("{} segments, {frames} frames", scan.segments.len());
    if let Some(in_use) = &in_use {
        writeln!(out, "{in_use}")?;
        writeln!(out, "sound: {summary}")?;
        return Ok(exit);
    }
    for repair in &scan.repairs {
        writeln!(out, "{}", describe_repair(repair))?;
    }
    if scan.repairs.is_empty() {
        writeln!(out, "sound: {summary}")?;
    } else {
        writeln!(
            out,
            "sound after {} repairs on open: {summary}",
            scan.repairs.len()
        )?;
    }
    Ok(exit)
}

fn dump(out: &mut Out, dir: &Path, as_json: bool) -> Outcome {
    let mut failed: Option<io::Error> = None;
    let scan = scan_wal_dir_with(dir, &mut |seq, frame| {
        if failed.is_some() {
            return;
        }
        let file = segment_name(seq);
        let kind = format!("{:?}", frame.kind).to_lowercase();
        let at = format!("{file}@{} lsn={}", frame.offset, frame.lsn);
        for op in &frame.ops {
            let written = if as_json {
                let (name, body) = match op {
                    StoreOp::Insert(r) => ("insert", json!({ "record": record_json(r) })),
                    StoreOp::Update(r) => ("update", json!({ "record": record_json(r) })),
                    StoreOp::Delete(id) => ("delete", json!({ "id": id.0 })),
                };
                let mut line = json!({
                    "segment": file,
                    "offset": frame.offset,
                    "lsn": frame.lsn,
                    "frame": kind,
                    "op": name,
                });
                if let (Value::Object(line), Value::Object(body)) = (&mut line, body) {
                    line.extend(body);
                }
                json_line(out, &line)
            } else {
                match op {
                    StoreOp::Insert(r) => writeln!(out, "{at} {kind} insert {}", line(r)),
                    StoreOp::Update(r) => writeln!(out, "{at} {kind} update {}", line(r)),
                    StoreOp::Delete(id) => writeln!(out, "{at} {kind} delete id={id}"),
                }
            };
            if let Err(e) = written {
                failed = Some(e);
                return;
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(Stop::Output(e));
    }
    if let Some(stop) = no_wal(dir, &scan) {
        return Err(stop);
    }
    for repair in &scan.repairs {
        if as_json {
            json_line(out, &json!({ "repair": describe_repair(repair) }))?;
        } else {
            writeln!(out, "{}", describe_repair(repair))?;
        }
    }
    match &scan.damage {
        Some(damage) => {
            if as_json {
                json_line(out, &json!({ "damage": describe(damage) }))?;
            } else {
                writeln!(out, "{}", describe(damage))?;
            }
            Ok(Exit::Failed)
        }
        None => Ok(Exit::Done),
    }
}

/// One JSON value on a line of its own (JSON Lines).
fn json_line(out: &mut Out, value: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer(&mut *out, value).map_err(io::Error::from)?;
    writeln!(out)
}

/// A record as `wal dump --json` shows it: its fields, its state decoded.
fn record_json(r: &ProcRecord) -> Value {
    json!({
        "id": r.id.0,
        "root": r.root.0,
        "parent": r.parent.map(|p| p.0),
        "type": &*r.type_name,
        "state": r.state.to_string(),
        "stack": &r.stack_indexes,
        "bytes": r.data.len(),
        "failure": r.failure.as_ref().map(ToString::to_string),
        "bypassed": r.bypassed,
        "data": match decode_state(&r.data) {
            None => Value::Null,
            Some(Ok(value)) => value,
            Some(Err(reason)) => json!({ "undecodable": reason }),
        },
    })
}

fn line(r: &ProcRecord) -> String {
    format!(
        "id={} root={} parent={} type={} state={} stack={:?} bytes={}{}",
        r.id,
        r.root,
        r.parent.map_or("-".to_string(), |p| p.to_string()),
        r.type_name,
        r.state,
        r.stack_indexes,
        r.data.len(),
        r.failure
            .as_ref()
            .map_or(String::new(), |f| format!(" failure=\"{f}\""))
    )
}

/// What `procs` shows.
struct Filter {
    /// Empty: every state.
    states: Vec<ProcState>,
    type_name: Option<String>,
    tree: Option<ProcId>,
}

/// State names as `ProcState` displays them, in any case, `-` for `_`.
fn parse_states(names: &[String]) -> Result<Vec<ProcState>, Stop> {
    names
        .iter()
        .filter(|n| !n.trim().is_empty())
        .map(|name| {
            name.parse::<ProcState>()
                .map_err(|e| Stop::Error(e.to_string()))
        })
        .collect()
}

/// A text table: each column as wide as its widest cell, left-aligned, two spaces
/// apart; the last column is not padded.
struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: Vec<&'static str>) -> Self {
        Table {
            header,
            rows: Vec::new(),
        }
    }

    fn push(&mut self, row: Vec<String>) {
        debug_assert_eq!(row.len(), self.header.len());
        self.rows.push(row);
    }

    fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.header.iter().map(ToString::to_string).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let last = row.len() - 1;
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
                if i == last {
                    line.push_str(cell);
                } else {
                    line.push_str(&format!("{cell:<w$}  "));
                }
            }
            writeln!(out, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// What an unfinished procedure waits for, from its record, its children's and its
/// tree's.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
enum Wait {
    /// Its tree has failed: the next start rolls it back.
    Rollback,
    /// This many unfinished children.
    Children(usize),
    /// The named event.
    Event(String),
    /// Its timer, at this time (ms since the Unix epoch).
    TimerMs(u64),
    /// The locks it holds for its life, not granted yet.
    Locks(Vec<String>),
    /// PAUSED or ROLLBACK_PAUSED: an operator's continue (or rollback); why it paused.
    Operator(String),
}

fn wait_of(r: &ProcRecord, unfinished_children: usize, tree_failed: bool) -> Option<Wait> {
    if r.state.is_finished() {
        return None;
    }
    if let Some(paused) = &r.steering.paused {
        return Some(Wait::Operator(pause_reason(paused)));
    }
    if tree_failed {
        return Some(Wait::Rollback);
    }
    match r.state {
        ProcState::Waiting => Some(match &r.event {
            Some(event) => Wait::Event(event.clone()),
            None => Wait::Children(unfinished_children),
        }),
        ProcState::WaitingTimeout => Some(Wait::TimerMs(r.wake_at_ms.unwrap_or(0))),
        ProcState::Runnable => match &r.locks {
            Some(claim) if claim.for_life && !claim.held => Some(Wait::Locks(
                claim.locks.iter().map(ToString::to_string).collect(),
            )),
            _ => None,
        },
        _ => None,
    }
}

/// Why a procedure is paused: the operator, or the failure, its policy and the retries
/// spent.
fn pause_reason(paused: &proctor::Paused) -> String {
    match (&paused.error, &paused.policy) {
        (None, _) => "paused by an operator".to_string(),
        (Some(error), Some(policy)) => {
            format!("{error} (policy {policy:?}, {} retries)", paused.retries)
        }
        (Some(error), None) => format!("{error} (past its point of no return)"),
    }
}

/// The text table's cell: what it waits for, and its deadline if it has one.
fn waits_for(r: &ProcRecord, wait: Option<Wait>, now: u64) -> String {
    let what = wait.map(|w| match w {
        Wait::Rollback => "rollback (its tree failed)".to_string(),
        Wait::Children(1) => "1 child".to_string(),
        Wait::Children(n) => format!("{n} children"),
        Wait::Event(event) => format!("event {event:?}"),
        Wait::TimerMs(at) => format!("timer, {}", relative(at, now)),
        Wait::Locks(locks) => format!("locks [{}]", locks.join(", ")),
        Wait::Operator(why) => format!("an operator: {why}"),
    });
    let deadline = r
        .deadline_ms
        .filter(|_| !r.state.is_finished())
        .map(|at| format!("deadline {}", relative(at, now)));
    match (what, deadline) {
        (Some(w), Some(d)) => format!("{w}; {d}"),
        (Some(w), None) | (None, Some(w)) => w,
        (None, None) => "-".to_string(),
    }
}

/// `in 5s` or `5s ago`.
fn relative(at_ms: u64, now: u64) -> String {
    if at_ms >= now {
        format!("in {}s", (at_ms - now).div_ceil(1000))
    } else {
        format!("{}s ago", (now - at_ms) / 1000)
    }
}

/// What the record says of its engine locks: a life-long hold is recorded; a per-step
/// lock (or one not yet granted) is only declared.
fn locks_of(r: &ProcRecord) -> Option<String> {
    let claim = r.locks.as_ref().filter(|_| !r.state.is_finished())?;
    let locks: Vec<String> = claim.locks.iter().map(ToString::to_string).collect();
    let what = match (claim.for_life, claim.held) {
        (true, true) => "holds",
        (true, false) => "needs for life",
        (false, _) => "needs per step",
    };
    Some(format!("{what} [{}]", locks.join(", ")))
}

/// The failure a record carries: its own ("aborted by operator"), or, for a finished
/// root, the failure of the procedure its tree failed with.
fn failure_of(r: &ProcRecord) -> Option<String> {
    let f = r.failure.as_ref()?;
    Some(if f.proc == r.id {
        f.error.to_string()
    } else {
        format!("procedure {} ({}) failed: {}", f.proc, f.type_name, f.error)
    })
}

/// A procedure's state (MessagePack, as `rmp_serde` wrote it) as JSON, without the
/// registry (transcoded value by value): maps by field name (`to_vec_named`) or arrays
/// in field order (`to_vec`), binaries as arrays of bytes, extension types as
/// `[type, bytes]`, integer map keys as strings. A state machine's state (the
/// [`proctor::StateMachine`] wrapper: an array of the machine, its next state, its
/// history as `[state, times]` runs and its cycles) gets those four names; a saga's
/// journal (the [`proctor::Saga`] wrapper: `{"saga": .., "journal": [{"name": ..,
/// "value": bytes}, ..]}`) shows each step's value decoded, as the step returned it.
/// `None` for no bytes (a bypassed procedure's record, or a failure recorded for a
/// nonce).
fn decode_state(data: &[u8]) -> Option<Result<Value, String>> {
    if data.is_empty() {
        return None;
    }
    Some(transcode(data).map(|v| decode_saga_journal(name_state_machine(v))))
}

/// MessagePack bytes as JSON, or why they do not decode.
fn transcode(data: &[u8]) -> Result<Value, String> {
    let mut de = rmp_serde::Deserializer::from_read_ref(data);
    serde_transcode::transcode(&mut de, serde_json::value::Serializer)
        .map_err(|e| format!("undecodable ({} bytes): {e}", data.len()))
}

/// `value` with a saga journal's step values decoded, if it has the saga wrapper's
/// shape; a value that does not decode stays as its bytes.
fn decode_saga_journal(mut value: Value) -> Value {
    let Some(fields) = value.as_object_mut() else {
        return value;
    };
    if fields.len() != 2 || !fields.contains_key("saga") {
        return value;
    }
    let Some(Value::Array(journal)) = fields.get_mut("journal") else {
        return value;
    };
    for entry in journal.iter_mut() {
        let Some(entry) = entry.as_object_mut() else {
            continue;
        };
        if !entry.get("name").is_some_and(Value::is_string) {
            continue;
        }
        let bytes: Option<Vec<u8>> = entry.get("value").and_then(Value::as_array).and_then(|a| {
            a.iter()
                .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect()
        });
        if let Some(Ok(decoded)) = bytes.filter(|b| !b.is_empty()).map(|b| transcode(&b)) {
            entry.insert("value".to_string(), decoded);
        }
    }
    value
}

/// `value` with the state machine wrapper's fields named, if it has that wrapper's
/// shape: `[{machine}, next, [[state, times], ...], cycles]`.
fn name_state_machine(value: Value) -> Value {
    match value {
        Value::Array(fields) if is_state_machine(&fields) => {
            let mut fields = fields.into_iter();
            let mut field = || fields.next().unwrap_or(Value::Null);
            json!({ "machine": field(), "next": field(), "history": field(), "cycles": field() })
        }
        other => other,
    }
}

fn is_state_machine(fields: &[Value]) -> bool {
    let is_run = |run: &Value| {
        run.as_array()
            .is_some_and(|r| r.len() == 2 && r[1].is_u64())
    };
    fields.len() == 4
        && fields[0].is_object()
        && fields[2]
            .as_array()
            .is_some_and(|runs| runs.iter().all(is_run))
        && fields[3].is_u64()
}

/// A DAG's progress (see [`proctor::Dag::summary`]), when the state is a [`proctor::Dag`]'s,
/// of whatever task type: the command knows no user types, but a DAG's own fields it
/// does.
fn dag_summary(data: &[u8]) -> Option<String> {
    rmp_serde::from_slice::<proctor::Dag<de::IgnoredAny>>(data)
        .ok()
        .map(|dag| dag.summary())
}

/// The latest record of every procedure, and what the scan found.
struct Loaded {
    latest: BTreeMap<ProcId, ProcRecord>,
    scan: WalDirScan,
}

fn load(dir: &Path) -> Result<Loaded, Stop> {
    let mut latest: BTreeMap<ProcId, ProcRecord> = BTreeMap::new();
    let scan = scan_wal_dir_with(dir, &mut |_, frame| {
        for op in frame.ops {
            op.apply_to(&mut latest);
        }
    })?;
    if let Some(stop) = no_wal(dir, &scan) {
        return Err(stop);
    }
    Ok(Loaded { latest, scan })
}

/// The procedures to show, in order, with their depth below the tree's shown root
/// (0 unless `--tree`).
fn select(
    latest: &BTreeMap<ProcId, ProcRecord>,
    filter: &Filter,
) -> Result<Vec<(ProcId, usize)>, Stop> {
    let keep = |r: &ProcRecord| {
        (filter.states.is_empty() || filter.states.contains(&r.state))
            && filter.type_name.as_ref().is_none_or(|t| *t == r.type_name)
    };
    let Some(id) = filter.tree else {
        return Ok(latest
            .values()
            .filter(|r| keep(r))
            .map(|r| (r.id, 0))
            .collect());
    };
    let root = latest
        .get(&id)
        .map(|r| r.root)
        .ok_or_else(|| Stop::Error(format!("procedure {id} is not in the log")))?;
    let tree: Vec<&ProcRecord> = latest.values().filter(|r| r.root == root).collect();
    let ids: BTreeSet<ProcId> = tree.iter().map(|r| r.id).collect();
    let mut children: BTreeMap<Option<ProcId>, Vec<ProcId>> = BTreeMap::new();
    for r in &tree {
        // A procedure whose parent has no record hangs from the top, beside the root.
        let parent = r.parent.filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(r.id);
    }
    let mut order = Vec::new();
    let mut todo: Vec<(ProcId, usize)> = children.get(&None).map_or(Vec::new(), |top| {
        top.iter().rev().map(|&c| (c, 0)).collect()
    });
    let mut seen = BTreeSet::new();
    while let Some((id, depth)) = todo.pop() {
        if !seen.insert(id) {
            continue;
        }
        if keep(&latest[&id]) {
            order.push((id, depth));
        }
        if let Some(kids) = children.get(&Some(id)) {
            todo.extend(kids.iter().rev().map(|&c| (c, depth + 1)));
        }
    }
    // A parent cycle has no top: show its members too, unindented.
    for r in tree {
        if !seen.contains(&r.id) && keep(r) {
            order.push((r.id, 0));
        }
    }
    Ok(order)
}

/// How `procs` prints.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Table,
    JsonLines,
    JsonDocument,
}

/// Where `procs` reads procedures from.
enum Source {
    Wal(PathBuf),
    Pg { url: String, schema: String },
}

/// What a PostgreSQL store holds besides its procedures.
struct PgFacts {
    lease: LeaseJson,
    /// `None` for a store of one engine (or of its leader and standbys).
    cluster: Option<proctor::ClusterState>,
}

/// A PostgreSQL store's procedures (as a WAL's load gives them, with no scan to
/// report), its lease, described, and its cluster if it is a cluster's. (Two reads:
/// beside running members, a procedure and the partitions are each as they were when
/// read.)
fn load_pg(url: &str, schema: &str) -> Result<(Loaded, PgFacts), Stop> {
    let options = proctor::PgOptions::default().schema(schema);
    let (snapshot, lease) = proctor::PgStore::inspect(url, &options)?;
    let cluster = proctor::PgStore::inspect_cluster(url, &options)?;
    let latest = snapshot.records.into_iter().map(|r| (r.id, r)).collect();
    let lease = LeaseJson {
        holder: lease.holder,
        epoch: lease.epoch,
        remaining_ms: lease
            .remaining
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    };
    Ok((
        Loaded {
            latest,
            scan: WalDirScan::default(),
        },
        PgFacts { lease, cluster },
    ))
}

/// The leader lease of a PostgreSQL store.
#[derive(Serialize)]
struct LeaseJson {
    holder: Option<String>,
    epoch: i64,
    /// `None` once it has expired (or was never taken).
    remaining_ms: Option<u64>,
}

impl std::fmt::Display for LeaseJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.holder, self.remaining_ms) {
            (Some(holder), Some(ms)) => {
                write!(f, "held by {holder} (epoch {}, {ms} ms left)", self.epoch)
            }
            (Some(holder), None) => {
                write!(f, "expired (last held by {holder}, epoch {})", self.epoch)
            }
            (None, _) => write!(f, "never taken"),
        }
    }
}

/// A cluster, as `procs` shows it (the shape of the admin page's `cluster` too).
#[derive(Serialize)]
struct ClusterJson {
    /// The leader lease's holder, if its lease is live.
    coordinator: Option<String>,
    /// Changes of owner from one member to another (`dead`, `hand-off`, `left`), in
    /// all.
    moves: i64,
    /// Every member that ever joined, by name.
    members: Vec<MemberJson>,
    /// Every partition, by number.
    partitions: Vec<PartitionJson>,
    /// The newest changes of owner, newest first (at most 50).
    recent_moves: Vec<MoveJson>,
}

#[derive(Serialize)]
struct MemberJson {
    name: String,
    /// Its membership's epoch (bumped at each join).
    epoch: i64,
    live: bool,
    /// How long its membership has to run (the database's clock); null once expired.
    remaining_ms: Option<u64>,
}

#[derive(Serialize)]
struct PartitionJson {
    partition: u32,
    owner: Option<String>,
    /// Its fencing token, bumped by each change of owner and each engine start.
    epoch: i64,
    /// A hand-off the coordinator asked the owner for: to this member.
    wanted: Option<String>,
    moves: i64,
    /// The procedures of the store in it (finished roots kept included).
    procedures: usize,
}

#[derive(Serialize)]
struct MoveJson {
    /// ms since the Unix epoch, by the database's clock.
    at_ms: i64,
    partition: u32,
    from: Option<String>,
    to: Option<String>,
    epoch: i64,
    /// `assigned`, `dead`, `hand-off` or `left`.
    reason: String,
}

impl ClusterJson {
    fn new(state: &proctor::ClusterState, latest: &BTreeMap<ProcId, ProcRecord>) -> Self {
        let count = partition_count(state);
        let mut procedures: BTreeMap<u32, usize> = BTreeMap::new();
        for id in latest.keys() {
            *procedures
                .entry(proctor::partitions::partition_of_id(*id, count))
                .or_default() += 1;
        }
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        ClusterJson {
            coordinator: state.coordinator.clone(),
            moves: state.moves,
            members: state
                .members
                .iter()
                .map(|m| MemberJson {
                    name: m.name.clone(),
                    epoch: m.epoch,
                    live: m.remaining.is_some(),
                    remaining_ms: m.remaining.map(ms),
                })
                .collect(),
            partitions: state
                .partitions
                .iter()
                .map(|p| PartitionJson {
                    partition: p.partition,
                    owner: p.owner.clone(),
                    epoch: p.epoch,
                    wanted: p.wanted.clone(),
                    moves: p.moves,
                    procedures: procedures.get(&p.partition).copied().unwrap_or(0),
                })
                .collect(),
            recent_moves: state
                .recent_moves
                .iter()
                .map(|m| MoveJson {
                    at_ms: m.at_ms,
                    partition: m.partition,
                    from: m.from.clone(),
                    to: m.to.clone(),
                    epoch: m.epoch,
                    reason: m.reason.clone(),
                })
                .collect(),
        }
    }

    /// The text form, after the procedures' summary: a line for the cluster, then its
    /// members, its partitions and its newest moves (at most [`MOVES_SHOWN`]; JSON has
    /// every one read).
    fn write(&self, out: &mut Out, now: u64) -> io::Result<()> {
        writeln!(out)?;
        writeln!(
            out,
            "cluster: {} partitions, {} members ({} live); coordinator {}; {} moves between members",
            self.partitions.len(),
            self.members.len(),
            self.members.iter().filter(|m| m.live).count(),
            self.coordinator
                .as_deref()
                .unwrap_or("none (no live leader lease)"),
            self.moves,
        )?;
        let mut members = Table::new(vec!["MEMBER", "EPOCH", "MEMBERSHIP"]);
        for m in &self.members {
            members.push(vec![
                m.name.clone(),
                m.epoch.to_string(),
                match m.remaining_ms {
                    Some(ms) => format!("live, {ms} ms left"),
                    None => "expired".to_string(),
                },
            ]);
        }
        members.write(out)?;
        writeln!(out)?;
        let mut partitions = Table::new(vec![
            "PARTITION",
            "OWNER",
            "EPOCH",
            "HAND-OFF TO",
            "MOVES",
            "PROCEDURES",
        ]);
        let live = |name: &str| self.members.iter().any(|m| m.live && m.name == name);
        for p in &self.partitions {
            partitions.push(vec![
                p.partition.to_string(),
                match &p.owner {
                    Some(owner) if live(owner) => owner.clone(),
                    Some(owner) => format!("{owner} (expired)"),
                    None => "-".to_string(),
                },
                p.epoch.to_string(),
                p.wanted.clone().unwrap_or_else(|| "-".to_string()),
                p.moves.to_string(),
                p.procedures.to_string(),
            ]);
        }
        partitions.write(out)?;
        if self.recent_moves.is_empty() {
            return Ok(());
        }
        writeln!(out)?;
        let shown = self.recent_moves.len().min(MOVES_SHOWN);
        writeln!(
            out,
            "newest moves ({shown} of the {} read; --json lists them all):",
            self.recent_moves.len()
        )?;
        let mut moves = Table::new(vec!["AT", "PARTITION", "FROM", "TO", "EPOCH", "REASON"]);
        for m in &self.recent_moves[..shown] {
            let at = u64::try_from(m.at_ms).unwrap_or(0);
            moves.push(vec![
                format!("{} ({})", utc(m.at_ms), relative(at, now)),
                m.partition.to_string(),
                m.from.clone().unwrap_or_else(|| "-".to_string()),
                m.to.clone().unwrap_or_else(|| "-".to_string()),
                m.epoch.to_string(),
                m.reason.clone(),
            ]);
        }
        moves.write(out)
    }
}

/// How many of a cluster's newest moves the text form shows.
const MOVES_SHOWN: usize = 10;

/// The number of a cluster's partitions (numbered from 0).
fn partition_count(state: &proctor::ClusterState) -> u32 {
    u32::try_from(state.partitions.len()).unwrap_or(u32::MAX)
}

/// `at_ms` (ms since the Unix epoch) as UTC: `2026-11-28 21:37:56.123Z`.
fn utc(at_ms: i64) -> String {
    let (secs, ms) = (at_ms.div_euclid(1000), at_ms.rem_euclid(1000));
    let (days, in_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The proleptic Gregorian date of a day number (Howard Hinnant's civil_from_days).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{ms:03}Z",
        in_day / 3600,
        in_day % 3600 / 60,
        in_day % 60
    )
}

fn procs(out: &mut Out, source: &Source, filter: &Filter, form: Form) -> Outcome {
    let (Loaded { latest, scan }, lease, cluster) = match source {
        Source::Wal(dir) => (load(dir)?, None, None),
        Source::Pg { url, schema } => {
            let (loaded, facts) = load_pg(url, schema)?;
            (loaded, Some(facts.lease), facts.cluster)
        }
    };
    // In a cluster's store, each procedure's partition (its id names it).
    let partitions = cluster.as_ref().map(partition_count);
    let partition_of = |id: ProcId| partitions.map(|n| proctor::partitions::partition_of_id(id, n));
    let cluster = cluster.map(|state| ClusterJson::new(&state, &latest));
    let now = now_ms();
    // Any stored name will do here: the command checks histories, not types.
    let names = |name: &str| Some(&*Box::leak(name.to_string().into_boxed_str()));
    let plan = recovery::plan(latest.values().cloned().collect(), names, &|_| true, now);
    let corrupt: BTreeMap<ProcId, String> =
        plan.corrupt.into_iter().map(|c| (c.id, c.reason)).collect();
    // Unfinished trees in which a procedure has failed: they roll back at next start.
    let failed_trees: BTreeSet<ProcId> = latest
        .values()
        .filter(|r| {
            r.failure.is_some()
                && latest
                    .get(&r.root)
                    .is_some_and(|root| !root.state.is_finished())
        })
        .map(|r| r.root)
        .collect();
    let mut unfinished_children: BTreeMap<ProcId, usize> = BTreeMap::new();
    for r in latest.values() {
        if let (Some(parent), false) = (r.parent, r.state.is_finished()) {
            *unfinished_children.entry(parent).or_default() += 1;
        }
    }
    let shown = select(&latest, filter)?;
    let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
    for r in latest.values() {
        *by_state.entry(r.state.to_string()).or_default() += 1;
    }
    let log = match (&scan.damage, scan.repairs.first()) {
        (Some(damage), _) => format!(
            "CORRUPT ({}): the engine refuses to start; shown is what precedes the damage",
            describe(damage)
        ),
        (None, Some(repair)) => describe_repair(repair),
        (None, None) => match (&lease, source, &cluster) {
            (Some(lease), Source::Pg { schema, .. }, Some(cluster)) => format!(
                "PostgreSQL schema {schema}, a cluster of {} partitions; coordinator's \
                 lease {lease}",
                cluster.partitions.len()
            ),
            (Some(lease), Source::Pg { schema, .. }, None) => {
                format!("PostgreSQL schema {schema}; leader lease {lease}")
            }
            _ => "sound".to_string(),
        },
    };
    let exit = if scan.damage.is_none() && corrupt.is_empty() {
        Exit::Done
    } else {
        Exit::Failed
    };

    if form != Form::Table {
        let procedures: Vec<ProcJson> = shown
            .iter()
            .map(|&(id, _)| {
                let r = &latest[&id];
                let children = unfinished_children.get(&id).copied().unwrap_or(0);
                ProcJson {
                    id: r.id.0,
                    parent: r.parent.map(|p| p.0),
                    root: r.root.0,
                    partition: partition_of(r.id),
                    type_name: &r.type_name,
                    state: r.state.to_string(),
                    steps: (!r.state.is_finished()).then_some(r.stack_indexes.len()),
                    submitted_ms: r.submitted_ms,
                    updated_ms: r.updated_ms,
                    waiting_for: wait_of(r, children, failed_trees.contains(&r.root)),
                    deadline_ms: r.deadline_ms,
                    locks: r.locks.as_ref().map(|c| LocksJson {
                        locks: c.locks.iter().map(ToString::to_string).collect(),
                        for_life: c.for_life,
                        held: c.held,
                    }),
                    failure: r.failure.as_ref().map(|f| FailureJson {
                        proc: f.proc.0,
                        type_name: &f.type_name,
                        error: f.error.to_string(),
                        code: f.code(),
                    }),
                    bypassed: r.bypassed,
                    steering: &r.steering,
                    corrupt: corrupt.get(&id).map(String::as_str),
                    dag: dag_summary(&r.data),
                    data: match decode_state(&r.data) {
                        None => Value::Null,
                        Some(Ok(value)) => value,
                        Some(Err(reason)) => json!({ "undecodable": reason }),
                    },
                }
            })
            .collect();
        let summary = SummaryJson {
            procedures: latest.len(),
            shown: shown.len(),
            by_state,
            corrupt: corrupt.len(),
            log,
            repairs: scan.repairs.iter().map(describe_repair).collect(),
            damage: scan.damage.as_ref().map(describe),
            lease,
            cluster,
        };
        if form == Form::JsonLines {
            for procedure in &procedures {
                json_line(out, procedure)?;
            }
            json_line(out, &json!({ "summary": summary }))?;
            return Ok(exit);
        }
        let document = ProcsJson {
            procedures,
            summary,
        };
        serde_json::to_writer_pretty(&mut *out, &document).map_err(io::Error::from)?;
        writeln!(out)?;
        return Ok(exit);
    }

    let mut header = vec!["ID", "PARENT", "ROOT"];
    if partitions.is_some() {
        header.push("PART");
    }
    header.extend([
        "TYPE",
        "STATE",
        "STEPS",
        "AGE",
        "WAITING FOR",
        "LOCKS",
        "FAILURE",
        "DATA",
    ]);
    let mut table = Table::new(header);
    for &(id, depth) in &shown {
        let r = &latest[&id];
        let children = unfinished_children.get(&id).copied().unwrap_or(0);
        let mut failure = failure_of(r).unwrap_or_default();
        if let Some(reason) = corrupt.get(&id) {
            let sep = if failure.is_empty() { "" } else { "; " };
            failure = format!("CORRUPT: {reason}{sep}{failure}");
        }
        let state = if r.bypassed {
            format!("{} (bypassed)", r.state)
        } else {
            r.state.to_string()
        };
        let data = match dag_summary(&r.data) {
            Some(dag) => format!("DAG {dag}"),
            None => match decode_state(&r.data) {
                None => "-".to_string(),
                Some(Ok(value)) => value.to_string(),
                Some(Err(reason)) => reason,
            },
        };
        let mut cells = vec![
            format!("{}{}", "  ".repeat(depth), r.id),
            r.parent.map_or("-".to_string(), |p| p.to_string()),
            r.root.to_string(),
        ];
        cells.extend(partition_of(r.id).map(|p| p.to_string()));
        cells.extend([
            r.type_name.to_string(),
            state,
            // A finished procedure's final record keeps no steps (its stack is undone
            // or done): their number is not known.
            if r.state.is_finished() {
                "-".to_string()
            } else {
                r.stack_indexes.len().to_string()
            },
            // Since it was submitted; a record without a time (written by a tool or a
            // test) has no age.
            if r.submitted_ms == 0 {
                "-".to_string()
            } else {
                format!("{}s", now.saturating_sub(r.submitted_ms) / 1000)
            },
            waits_for(r, wait_of(r, children, failed_trees.contains(&r.root)), now),
            locks_of(r).unwrap_or_else(|| "-".into()),
            if failure.is_empty() {
                "-".into()
            } else {
                failure
            },
            data,
        ]);
        table.push(cells);
    }
    table.write(out)?;
    let counts: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
    let filtered = if shown.len() == latest.len() {
        String::new()
    } else {
        format!(", {} shown", shown.len())
    };
    writeln!(
        out,
        "{} procedures, {} corrupt{filtered} ({}); log: {log}",
        latest.len(),
        corrupt.len(),
        if counts.is_empty() {
            "none".to_string()
        } else {
            counts.join(", ")
        },
    )?;
    if let Some(cluster) = &cluster {
        cluster.write(out, now)?;
    }
    Ok(exit)
}

/// `procs --json`: the shown procedures, and a summary of the whole log.
#[derive(Serialize)]
struct ProcsJson<'a> {
    procedures: Vec<ProcJson<'a>>,
    summary: SummaryJson,
}

/// One procedure, from its latest record.
#[derive(Serialize)]
struct ProcJson<'a> {
    id: u64,
    parent: Option<u64>,
    root: u64,
    /// Its partition, in a cluster's store (its id modulo the number of partitions).
    #[serde(skip_serializing_if = "Option::is_none")]
    partition: Option<u32>,
    #[serde(rename = "type")]
    type_name: &'a str,
    state: String,
    /// Recorded steps not rolled back; `null` for a finished procedure (its final
    /// record keeps none).
    steps: Option<usize>,
    submitted_ms: u64,
    updated_ms: u64,
    /// `{"operator": why}` (PAUSED or ROLLBACK_PAUSED), `"rollback"` (its tree has
    /// failed), `{"children": n}` (unfinished),
    /// `{"event": name}`, `{"timer_ms": at}`, `{"locks": [...]}` (a runnable one whose
    /// life-long locks are not held yet), or null.
    waiting_for: Option<Wait>,
    deadline_ms: Option<u64>,
    locks: Option<LocksJson>,
    failure: Option<FailureJson<'a>>,
    bypassed: bool,
    /// Retries spent, why it is paused, its point of no return (see `Steering`).
    steering: &'a proctor::store::Steering,
    /// Why recovery cannot rebuild its tree, if it cannot.
    corrupt: Option<&'a str>,
    /// A DAG's progress, task by task (`Dag::summary`); null for any other state.
    dag: Option<String>,
    /// Its own state decoded; `{"undecodable": reason}` when it is not MessagePack.
    data: Value,
}

#[derive(Serialize)]
struct LocksJson {
    locks: Vec<String>,
    for_life: bool,
    held: bool,
}

#[derive(Serialize)]
struct FailureJson<'a> {
    proc: u64,
    #[serde(rename = "type")]
    type_name: &'a str,
    error: String,
    /// The error's code ([`proctor::ProcError::with_code`]), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'a str>,
}

#[derive(Serialize)]
struct SummaryJson {
    /// In the log, shown or not.
    procedures: usize,
    shown: usize,
    by_state: BTreeMap<String, usize>,
    corrupt: usize,
    /// "sound", the repair the engine makes at next start, or the damage.
    log: String,
    repairs: Vec<String>,
    damage: Option<String>,
    /// A PostgreSQL store's leader lease (in a cluster, its coordinator's).
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<LeaseJson>,
    /// A cluster's store: its partitions, members, coordinator and newest moves.
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<ClusterJson>,
}

/// Opens a stopped engine's log for writing, as the engine would: its lock taken, a
/// torn tail repaired, damage refused. A directory without a log is refused first (the
/// store would create one).
fn open_stopped(dir: &Path) -> Result<(WalStore, Vec<ProcRecord>), Stop> {
    let scan = scan_wal_dir(dir)?;
    if let Some(stop) = no_wal(dir, &scan) {
        return Err(stop);
    }
    let mut wal = WalStore::open(dir)?;
    let snapshot = wal.load()?;
    Ok((wal, snapshot.records))
}

/// Writes a bypass through the store, as the engine would, once the log opens cleanly.
fn bypass(out: &mut Out, dir: &Path, id: ProcId, recursive: bool) -> Outcome {
    let (mut wal, records) = open_stopped(dir)?;
    match recovery::bypass(&records, id, recursive, now_ms()) {
        Ok(ops) => {
            wal.append(&ops)?;
            writeln!(
                out,
                "bypassed procedure {id}: {} records written",
                ops.len()
            )?;
            Ok(Exit::Done)
        }
        Err(reason) => {
            writeln!(out, "bypass of procedure {id} refused: {reason}")?;
            Ok(Exit::Failed)
        }
    }
}

/// Asks a running engine to bypass `id`, through its admin page's action
/// (`POST {url}/procedures/{id}/bypass` or `force-bypass`, with the bearer token from
/// `PROCTOR_ADMIN_TOKEN`).
fn online_bypass(out: &mut Out, url: &str, id: ProcId, recursive: bool, force: bool) -> Outcome {
    let token = std::env::var("PROCTOR_ADMIN_TOKEN").map_err(|_| {
        Stop::Error("the admin page's actions need its token: set PROCTOR_ADMIN_TOKEN".into())
    })?;
    let action = if force { "force-bypass" } else { "bypass" };
    let query = if recursive { "?recursive=true" } else { "" };
    let path = format!("procedures/{}/{action}{query}", id.0);
    let (status, body) = admin_post(url, &path, &token)?;
    let said = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
        .unwrap_or(body);
    match status {
        200 => {
            writeln!(out, "bypassed procedure {id} on the running engine")?;
            Ok(Exit::Done)
        }
        409 => {
            writeln!(out, "bypass of procedure {id} refused: {said}")?;
            Ok(Exit::Failed)
        }
        _ => Err(Stop::Error(format!("{url}: HTTP {status}: {said}"))),
    }
}

/// POSTs to `base` + `path` over plain HTTP/1.1 (an engine's admin page serves no
/// TLS) with `token` as the bearer token: the status and the body.
fn admin_post(base: &str, path: &str, token: &str) -> Result<(u16, String), Stop> {
    use std::io::Read;
    use std::net::TcpStream;
    let bad = |why: &str| Stop::Error(format!("{base}: {why}"));
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| bad("not an http:// URL (the admin page serves plain HTTP)"))?;
    let (host, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(bad("no host"));
    }
    let prefix = prefix.trim_end_matches('/');
    let target = if prefix.is_empty() {
        format!("/{path}")
    } else {
        format!("/{prefix}/{path}")
    };
    let addr = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let io = |e: io::Error| bad(&e.to_string());
    let mut stream = TcpStream::connect(&addr).map_err(io)?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .map_err(io)?;
    write!(
        stream,
        "POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\
         Accept: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(io)?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no HTTP status in the answer"))?;
    // The page answers with a length, not chunks (small JSON bodies).
    Ok((status, body.trim().to_string()))
}

/// Writes an abort through the store; the engine rolls the tree back when it starts.
fn abort(out: &mut Out, dir: &Path, id: ProcId) -> Outcome {
    let (mut wal, records) = open_stopped(dir)?;
    match recovery::abort(&records, id, now_ms()) {
        Ok(ops) => {
            wal.append(&ops)?;
            writeln!(
                out,
                "aborted procedure {id}: its tree rolls back when the engine starts"
            )?;
            Ok(Exit::Done)
        }
        Err(reason) => {
            writeln!(out, "abort of procedure {id} refused: {reason}")?;
            Ok(Exit::Failed)
        }
    }
}

/// Writes an operator's pause, or continue or rollback of a paused procedure, through
/// the store.
fn steer(out: &mut Out, dir: &Path, id: ProcId, command: Steer) -> Outcome {
    let (mut wal, records) = open_stopped(dir)?;
    let (name, effect) = match command {
        Steer::Pause => (
            "pause",
            "it stays paused when the engine starts, until continued",
        ),
        Steer::Continue => ("continue", "it goes on when the engine starts"),
        Steer::Rollback => ("rollback", "its tree rolls back when the engine starts"),
    };
    match recovery::steer(&records, id, command, now_ms()) {
        Ok(ops) => {
            wal.append(&ops)?;
            writeln!(out, "{name} of procedure {id} recorded: {effect}")?;
            Ok(Exit::Done)
        }
        Err(reason) => {
            writeln!(out, "{name} of procedure {id} refused: {reason}")?;
            Ok(Exit::Failed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A move's time as UTC, leap days and the epoch's edges included.
    #[test]
    fn times_show_as_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000Z");
        assert_eq!(utc(-1), "1969-12-31 23:59:59.999Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00.000Z");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14 22:13:20.123Z");
        assert_eq!(utc(4_107_542_399_000), "2100-02-28 23:59:59.000Z");
        assert_eq!(utc(4_107_542_400_000), "2100-03-01 00:00:00.000Z");
    }

    /// MessagePack as `rmp_serde` and other writers produce it, read into JSON.
    #[test]
    fn states_decode_to_json_without_a_registry() {
        #[derive(Serialize)]
        struct State {
            name: String,
            ids: BTreeMap<u32, bool>,
            #[serde(with = "serde_bytes")]
            raw: Vec<u8>,
            ratio: f64,
            none: Option<u8>,
            unit: (),
            tuple: (i8, String),
        }
        let named = rmp_serde::to_vec_named(&State {
            name: "t1".into(),
            ids: BTreeMap::from([(7, true)]),
            raw: vec![1, 255],
            ratio: 0.5,
            none: None,
            unit: (),
            tuple: (-3, "x".into()),
        })
        .unwrap();
        let expected = json!({
            "name": "t1", "ids": {"7": true}, "raw": [1, 255], "ratio": 0.5,
            "none": null, "unit": null, "tuple": [-3, "x"],
        });
        assert_eq!(decode_state(&named), Some(Ok(expected)));
        // Without field names (rmp_serde::to_vec): an array, in field order.
        let positional = rmp_serde::to_vec(&("t1", 2u8)).unwrap();
        assert_eq!(decode_state(&positional), Some(Ok(json!(["t1", 2]))));
        // An extension type (fixext1, type 5): a [type, bytes] pair. A cut value is a
        // reason, never a panic.
        let ext = decode_state(&[0xd4, 0x05, 0x01]);
        assert_eq!(ext, Some(Ok(json!([5, [1]]))));
        let cut = decode_state(&named[..named.len() - 1]);
        assert!(
            matches!(cut, Some(Err(ref r)) if r.starts_with("undecodable")),
            "{cut:?}"
        );
        assert_eq!(decode_state(&[]), None);
    }

    /// A saga's journal shows each step's value decoded; a value that does not decode
    /// stays as its bytes, and a state of another shape is left alone.
    #[test]
    fn a_saga_journal_shows_its_step_values_decoded() {
        #[derive(Serialize)]
        struct Entry {
            name: &'static str,
            #[serde(with = "serde_bytes")]
            value: Vec<u8>,
        }
        #[derive(Serialize)]
        struct Wrapper {
            saga: BTreeMap<String, u8>,
            journal: Vec<Entry>,
        }
        let journal = vec![
            Entry {
                name: "reserve",
                value: rmp_serde::to_vec_named(&BTreeMap::from([("slot", 7)])).unwrap(),
            },
            Entry {
                name: "cut",
                value: vec![0x92, 0x01],
            },
        ];
        let data = rmp_serde::to_vec_named(&Wrapper {
            saga: BTreeMap::from([("n".into(), 1)]),
            journal,
        })
        .unwrap();
        let expected = json!({
            "saga": {"n": 1},
            "journal": [{"name": "reserve", "value": {"slot": 7}}, {"name": "cut", "value": [146, 1]}],
        });
        assert_eq!(decode_state(&data), Some(Ok(expected)));
        let other = rmp_serde::to_vec_named(&BTreeMap::from([("journal", vec![1u8])])).unwrap();
        assert_eq!(decode_state(&other), Some(Ok(json!({"journal": [1]}))));
    }

    /// A state machine's stored wrapper shows its fields by name, the machine inside
    /// with its own.
    #[test]
    fn a_state_machine_state_shows_named_fields() {
        use serde::Deserialize;
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
        enum Step {
            Prepare,
            Assign,
        }
        #[derive(Serialize, Deserialize)]
        struct Create {
            table: String,
        }
        #[proctor::async_trait]
        impl proctor::StateMachineProcedure for Create {
            type State = Step;
            fn initial_state(&self) -> Step {
                Step::Prepare
            }
            async fn execute_from_state(
                &mut self,
                _: &mut proctor::StateContext<'_, Step>,
                _: Step,
            ) -> Result<proctor::Flow, proctor::ProcError> {
                Ok(proctor::Flow::Done)
            }
            async fn rollback_state(
                &mut self,
                _: &mut proctor::Context,
                _: Step,
            ) -> Result<(), proctor::ProcError> {
                Ok(())
            }
        }
        let machine = proctor::StateMachine::new(Create {
            table: "users".into(),
        });
        // As the engine writes it.
        let data = rmp_serde::to_vec_named(&machine).unwrap();
        let value = decode_state(&data).unwrap().unwrap();
        assert_eq!(
            value,
            json!({ "machine": { "table": "users" }, "next": null, "history": [], "cycles": 0 })
        );
        // Another array of four is left as it is.
        let other = rmp_serde::to_vec(&(1u8, 2u8, 3u8, 4u8)).unwrap();
        assert_eq!(decode_state(&other), Some(Ok(json!([1, 2, 3, 4]))));
    }
}
