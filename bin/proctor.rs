//! `proctor`: inspect and verify a proctor WAL directory from outside the engine. It
//! only reads: it takes no lock and truncates nothing, so it is safe beside a running
//! engine and on a damaged log.
//!
//! ```sh
//! proctor wal verify DIR   # checks every frame; exit 0 only if all are sound
//! proctor wal dump DIR     # one line per record
//! proctor procs DIR        # procedures: id, type, state, parent, root, last update
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use proctor::wal::ScanEnd;
use proctor::{recovery, scan_wal_dir, ProcId, ProcRecord, StoreOp};

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
}

#[derive(Subcommand)]
enum WalCommand {
    /// Check every frame of every segment; exit 0 only when all are sound.
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

fn describe(end: &ScanEnd) -> Option<String> {
    match end {
        ScanEnd::Clean => None,
        ScanEnd::TornTail { offset, reason } => Some(format!(
            "torn tail at byte {offset}: {reason} (recovery truncates it)"
        )),
        ScanEnd::Corrupt { offset, reason } => Some(format!("corrupt at byte {offset}: {reason}")),
    }
}

fn verify(dir: &Path) -> Outcome {
    let scans = scan_wal_dir(dir)?;
    let mut sound = true;
    let mut frames = 0;
    for (path, scan) in &scans {
        frames += scan.frames.len();
        match describe(&scan.end) {
            None => println!("ok {}: {} frames", path.display(), scan.frames.len()),
            Some(problem) => {
                sound = false;
                println!("{}: {problem}", path.display());
            }
        }
    }
    if sound {
        println!("sound: {} segments, {frames} frames", scans.len());
    } else {
        println!("NOT sound");
    }
    Ok(sound)
}

fn dump(dir: &Path) -> Outcome {
    let mut sound = true;
    for (path, scan) in scan_wal_dir(dir)? {
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("?")
            .to_string();
        for frame in &scan.frames {
            for op in &frame.ops {
                let kind = format!("{:?}", frame.kind).to_lowercase();
                match op {
                    StoreOp::Insert(r) => {
                        println!("{file}@{} {kind} insert {}", frame.offset, line(r))
                    }
                    StoreOp::Update(r) => {
                        println!("{file}@{} {kind} update {}", frame.offset, line(r))
                    }
                    StoreOp::Delete(id) => {
                        println!("{file}@{} {kind} delete id={id}", frame.offset)
                    }
                }
            }
        }
        if let Some(problem) = describe(&scan.end) {
            sound = false;
            println!("{file}: {problem}");
        }
    }
    Ok(sound)
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
    let mut sound = true;
    for (path, scan) in scan_wal_dir(dir)? {
        for op in scan.frames.into_iter().flat_map(|f| f.ops) {
            op.apply_to(&mut latest);
        }
        if let Some(problem) = describe(&scan.end) {
            sound &= matches!(scan.end, ScanEnd::TornTail { .. });
            eprintln!("{}: {problem}", path.display());
        }
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
        let note = match (corrupt.get(&r.id), &r.failure) {
            (Some(reason), _) => format!("CORRUPT: {reason}"),
            (None, Some(f)) => format!("failure: {}", f.error),
            (None, None) => String::new(),
        };
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
