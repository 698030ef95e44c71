//! `proctor`: inspect and verify a proctor WAL directory from outside the engine. Its
//! reading commands take no lock and truncate nothing, so they are safe beside a
//! running engine and on a damaged log; `bypass` writes, so it opens the log as the
//! engine does (taking its lock: the engine must be stopped).
//!
//! ```sh
//! proctor wal verify DIR   # checks the log as the engine would; exit 0 only if it
//!                          # would start (listing the torn tails it would truncate)
//! proctor wal dump DIR     # one line per record
//! proctor procs DIR        # procedures: id, type, state, parent, root, last update
//! proctor bypass DIR ID [--recursive]   # mark a stuck procedure finished (HBCK2)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use proctor::{
    recovery, scan_wal_dir, scan_wal_dir_with, ProcId, ProcRecord, ProcedureStore, StoreError,
    StoreOp, WalStore,
};

#[derive(Parser)]
#[command(name = "proctor", about = "Inspect and verify proctor WAL directories")]
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
    /// The procedures the log holds: latest state of each.
    Procs {
        /// The WAL directory.
        dir: PathBuf,
    },
    /// Mark a stuck procedure finished (SUCCESS) without running further or rolling
    /// back, on a stopped engine's directory; its parent goes on as if it had succeeded
    /// when the engine starts again.
    Bypass {
        /// The WAL directory (of a stopped engine: its lock is taken).
        dir: PathBuf,
        /// The procedure.
        id: u64,
        /// Also bypass its unfinished descendants (required if it has any).
        #[arg(long)]
        recursive: bool,
    },
}

#[derive(Subcommand)]
enum WalCommand {
    /// Check the log as the engine would open it; exit 0 only when it would start.
    Verify {
        /// The WAL directory.
        dir: PathBuf,
    },
    /// Print one line per record.
    Dump {
        /// The WAL directory.
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Wal {
            command: WalCommand::Verify { dir },
        } => verify(&dir),
        Command::Wal {
            command: WalCommand::Dump { dir },
        } => dump(&dir),
        Command::Procs { dir } => procs(&dir),
        Command::Bypass { dir, id, recursive } => bypass(&dir, ProcId(id), recursive),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("proctor: {e}");
            ExitCode::from(2)
        }
    }
}

type Outcome = Result<bool, Box<dyn std::error::Error>>;

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

fn segment_name(seq: u64) -> String {
    format!("{seq:020}.wal")
}

/// Sound means the engine would start on it: torn tails are listed as the repairs it
/// would make, since they hold nothing that was acknowledged.
fn verify(dir: &Path) -> Outcome {
    let scan = scan_wal_dir(dir)?;
    let mut frames = 0;
    for segment in &scan.segments {
        frames += segment.frames;
        println!(
            "ok {}: {} frames, next LSN {}{}",
            segment.path.display(),
            segment.frames,
            segment.next_lsn,
            if segment.sealed { ", sealed" } else { "" }
        );
    }
    for repair in &scan.repairs {
        println!("repair on open: {repair}");
    }
    if let Some(damage) = &scan.damage {
        println!("{}", describe(damage));
        println!("NOT sound");
        return Ok(false);
    }
    println!(
        "sound: {} segments, {frames} frames, {} repairs on open",
        scan.segments.len(),
        scan.repairs.len()
    );
    Ok(true)
}

fn dump(dir: &Path) -> Outcome {
    let scan = scan_wal_dir_with(dir, &mut |seq, frame| {
        let file = segment_name(seq);
        let kind = format!("{:?}", frame.kind).to_lowercase();
        let at = format!("{file}@{} lsn={}", frame.offset, frame.lsn);
        for op in &frame.ops {
            match op {
                StoreOp::Insert(r) => println!("{at} {kind} insert {}", line(r)),
                StoreOp::Update(r) => println!("{at} {kind} update {}", line(r)),
                StoreOp::Delete(id) => println!("{at} {kind} delete id={id}"),
            }
        }
    })?;
    for repair in &scan.repairs {
        println!("repair on open: {repair}");
    }
    match &scan.damage {
        Some(damage) => {
            println!("{}", describe(damage));
            Ok(false)
        }
        None => Ok(true),
    }
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

fn procs(dir: &Path) -> Outcome {
    let mut latest: BTreeMap<ProcId, ProcRecord> = BTreeMap::new();
    let scan = scan_wal_dir_with(dir, &mut |_, frame| {
        for op in frame.ops {
            op.apply_to(&mut latest);
        }
    })?;
    for repair in &scan.repairs {
        eprintln!("repair on open: {repair}");
    }
    let sound = scan.damage.is_none();
    if let Some(damage) = &scan.damage {
        eprintln!("{}", describe(damage));
    }
    let records: Vec<ProcRecord> = latest.values().cloned().collect();
    // Any stored name will do here: the command checks histories, not types.
    let names = |name: &str| Some(&*Box::leak(name.to_string().into_boxed_str()));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let plan = recovery::plan(records, names, now);
    let corrupt: BTreeMap<ProcId, String> =
        plan.corrupt.into_iter().map(|c| (c.id, c.reason)).collect();
    println!(
        "{:>10} {:<24} {:<16} {:>10} {:>10} {:>10}  note",
        "id", "type", "state", "parent", "root", "age_s"
    );
    for r in latest.values() {
        let age_s = now.saturating_sub(r.updated_ms) / 1000;
        let mut note = match (corrupt.get(&r.id), &r.failure) {
            (Some(reason), _) => format!("CORRUPT: {reason}"),
            (None, Some(f)) => format!("failure: {}", f.error),
            (None, None) => String::new(),
        };
        if let (false, Some(claim)) = (r.state.is_finished(), &r.locks) {
            // Offline only what the record says: a life-long hold is recorded; a
            // per-step lock (or one not yet granted) is only declared.
            let locks: Vec<String> = claim.locks.iter().map(ToString::to_string).collect();
            let what = match (claim.for_life, claim.held) {
                (true, true) => "holds",
                (true, false) => "needs for life",
                (false, _) => "needs per step",
            };
            let sep = if note.is_empty() { "" } else { "; " };
            note = format!("{note}{sep}{what} [{}]", locks.join(", "));
        }
        println!(
            "{:>10} {:<24} {:<16} {:>10} {:>10} {:>10}  {note}",
            r.id,
            r.type_name,
            r.state.to_string(),
            r.parent.map_or("-".to_string(), |p| p.to_string()),
            r.root,
            age_s,
        );
    }
    println!("{} procedures, {} corrupt", latest.len(), corrupt.len());
    Ok(sound && corrupt.is_empty())
}

/// Writes a bypass through the store, as the engine would, once the log opens cleanly.
fn bypass(dir: &Path, id: ProcId, recursive: bool) -> Outcome {
    let mut wal = WalStore::open(dir)?;
    let snapshot = wal.load()?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    match recovery::bypass(&snapshot.records, id, recursive, now) {
        Ok(ops) => {
            wal.append(&ops)?;
            println!("bypassed procedure {id}: {} records written", ops.len());
            Ok(true)
        }
        Err(reason) => {
            println!("bypass of procedure {id} refused: {reason}");
            Ok(false)
        }
    }
}
