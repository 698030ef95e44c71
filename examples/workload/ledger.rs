//! The ledger: a file in which every step records its side effect and every rollback
//! removes it, so a run (or a crash and a resume) can be checked from outside the
//! engine.
//!
//! Format: one line per call, `+ ROOT PATH STEP TOTAL` or `- ROOT PATH STEP`, appended
//! with one `write` each, before the step returns, and ending in ` @TOKEN` when the
//! step ran under a leader lease (its [`fencing token`](proctor::Context::fencing_token)). `TOTAL` is the number of effects
//! the root's whole tree leaves when it succeeds, so a root whose result the engine
//! has evicted (`--retention-ms`) can still be checked: its effects in force are none
//! or all of them. (A line without it, from before it was written, checks nothing.) A write reaches the kernel before the
//! engine persists the step, so a process crash (SIGKILL) loses no effect the store
//! knows of. Replaying the lines in order gives the set of effects in force; adding an
//! effect twice (a step re-run after a crash) is harmless.
//!
//! Remote targets (`--remote T`) write `= OP ROOT STEP` when they apply operation `OP`
//! (sent by step `STEP` of root `ROOT`), once: they deduplicate by op id, with the
//! ledger as their durable memory, so no op id may appear on two such lines. A step
//! sends its operation again, under a new op id, only when the node could not apply
//! it, so no root step may appear on two such lines either. (Lines written before the
//! step was, `= OP ROOT`, are read; they name no step.)
//!
//! Fencing: the ledger is a resource that knows of leases, as the resources a
//! control plane changes must be. It refuses a change whose token is lower than the
//! highest it has taken, so a deposed leader's step that finishes late (the process was
//! stopped past its lease and continued) cannot act after its successor did. The
//! check and the append are one step across processes: both happen under an exclusive
//! lock on the ledger file, with the highest token kept in `<ledger>.fence`. A ledger
//! opened with [`Ledger::open_unfenced`] stands for the resources that do not check
//! tokens (most do not): it records each change's token but refuses none, so a late
//! effect of a deposed leader lands, and [`Ledger::fence_violations`] counts it.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One side effect: which root's tree, which procedure in it (0 = the root, i = child
/// i), which step.
pub type Effect = (u64, u16, u16);

pub struct Ledger {
    path: PathBuf,
    /// Refuse a change whose token is older than one taken (else only record it).
    fenced: bool,
    /// The ledger and its fence (the highest token taken, 8 bytes).
    files: Mutex<(File, File)>,
}

/// One line: added or removed, the effect, the total an added effect names, the token.
type Line = (bool, Effect, Option<u64>, Option<i64>);

impl Ledger {
    pub fn open(path: &Path) -> std::io::Result<Ledger> {
        Self::open_with(path, true)
    }

    /// A ledger that records each change's token and refuses none: a resource that
    /// ignores fencing tokens (the failover test's).
    #[allow(dead_code)]
    pub fn open_unfenced(path: &Path) -> std::io::Result<Ledger> {
        Self::open_with(path, false)
    }

    fn open_with(path: &Path, fenced: bool) -> std::io::Result<Ledger> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let mut fence_path = path.as_os_str().to_owned();
        fence_path.push(".fence");
        let fence = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(fence_path)?;
        Ok(Ledger {
            path: path.to_path_buf(),
            fenced,
            files: Mutex::new((file, fence)),
        })
    }

    /// Records `effect`, of a tree that leaves `total` effects when it succeeds, made
    /// under fencing token `token` if any.
    pub fn add(&self, effect: Effect, total: u32, token: Option<i64>) -> std::io::Result<()> {
        let (root, path, step) = effect;
        self.write(format!("+ {root} {path} {step} {total}"), token)
    }

    pub fn remove(&self, (root, path, step): Effect, token: Option<i64>) -> std::io::Result<()> {
        self.write(format!("- {root} {path} {step}"), token)
    }

    fn write(&self, mut line: String, token: Option<i64>) -> std::io::Result<()> {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        let (file, fence) = &*files;
        let Some(token) = token else {
            line.push('\n');
            return (&*file).write_all(line.as_bytes());
        };
        line.push_str(&format!(" @{token}\n"));
        // Other processes append to the same ledger: check and append under its lock.
        file.lock()?;
        let appended = (|| {
            let mut highest = [0u8; 8];
            let read = fence.read_at(&mut highest, 0)?;
            let highest = if read == 8 {
                i64::from_le_bytes(highest)
            } else {
                i64::MIN
            };
            if token < highest && self.fenced {
                return Err(std::io::Error::other(format!(
                    "fenced: token {token} is older than {highest}, which the ledger has taken"
                )));
            }
            if token > highest {
                fence.write_all_at(&token.to_le_bytes(), 0)?;
            }
            (&*file).write_all(line.as_bytes())
        })();
        file.unlock()?;
        appended
    }

    /// Records that a remote target applied operation `op`, which step `step` of
    /// `root` sent.
    pub fn applied(&self, op: u64, root: u64, step: u16) -> std::io::Result<()> {
        self.write(format!("= {op} {root} {step}"), None)
    }

    /// How many times each operation was applied by the remote targets.
    pub fn applied_ops(&self) -> std::io::Result<HashMap<u64, usize>> {
        let mut applied = HashMap::new();
        for a in self.applications()? {
            *applied.entry(a.op).or_default() += 1;
        }
        Ok(applied)
    }

    /// The error for the `n`th line (from 0) of the ledger, which does not parse.
    fn bad_line(&self, n: usize, line: &str) -> std::io::Error {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}:{}: bad ledger line {line:?}",
                self.path.display(),
                n + 1
            ),
        )
    }

    /// Every operation the remote targets applied, in order, one per `=` line.
    pub fn applications(&self) -> std::io::Result<Vec<Applied>> {
        let mut applied = Vec::new();
        let reader = BufReader::new(File::open(&self.path)?);
        for (n, line) in reader.lines().enumerate() {
            let line = line?;
            let Some(rest) = line.strip_prefix("= ") else {
                continue;
            };
            applied.push(Applied::parse(rest).ok_or_else(|| self.bad_line(n, &line))?);
        }
        Ok(applied)
    }

    /// Changes that came after a change with a higher token: a deposed leader acting
    /// after its successor. None while the ledger checks tokens as it takes them.
    pub fn fence_violations(&self) -> std::io::Result<Vec<String>> {
        let mut highest = i64::MIN;
        let mut violations = Vec::new();
        for (n, (_, effect, _, token)) in self.lines()?.into_iter().enumerate() {
            let Some(token) = token else { continue };
            if token < highest {
                violations.push(format!(
                    "ledger change {}: effect {effect:?} made under token {token} after token {highest}",
                    n + 1
                ));
            }
            highest = highest.max(token);
        }
        Ok(violations)
    }

    /// The effects in force, counted per root.
    pub fn effects_per_root(&self) -> std::io::Result<HashMap<u64, usize>> {
        let mut live: HashSet<Effect> = HashSet::new();
        for (add, effect) in self.history()? {
            if add {
                live.insert(effect);
            } else {
                live.remove(&effect);
            }
        }
        let mut per_root = HashMap::new();
        for (root, _, _) in live {
            *per_root.entry(root).or_default() += 1;
        }
        Ok(per_root)
    }

    /// Every line in order: `true` for an added effect, `false` for a removed one.
    pub fn history(&self) -> std::io::Result<Vec<(bool, Effect)>> {
        Ok(self
            .lines()?
            .into_iter()
            .map(|(add, effect, _, _)| (add, effect))
            .collect())
    }

    /// The effects each root's tree leaves when it succeeds, as its lines say.
    pub fn totals(&self) -> std::io::Result<HashMap<u64, usize>> {
        let mut totals = HashMap::new();
        for (_, (root, _, _), total, _) in self.lines()? {
            if let Some(total) = total.filter(|&t| t > 0) {
                totals.insert(root, total as usize);
            }
        }
        Ok(totals)
    }

    /// Every line in order, with the total an added effect names and the token.
    fn lines(&self) -> std::io::Result<Vec<Line>> {
        let mut history = Vec::new();
        let reader = BufReader::new(File::open(&self.path)?);
        for (n, line) in reader.lines().enumerate() {
            let line = line?;
            // A remote target's application (see `applied`), not an effect.
            if line.starts_with("= ") {
                continue;
            }
            let bad = || self.bad_line(n, &line);
            let mut parts = line.split(' ');
            let sign = parts.next().ok_or_else(bad)?;
            let mut num = || {
                parts
                    .next()
                    .and_then(|p| p.parse::<u64>().ok())
                    .ok_or_else(bad)
            };
            let effect = (num()?, num()? as u16, num()? as u16);
            let add = match sign {
                "+" => true,
                "-" => false,
                _ => return Err(bad()),
            };
            let mut total = None;
            let mut token = None;
            for part in parts {
                match part.strip_prefix('@') {
                    Some(t) if token.is_none() => {
                        token = Some(t.parse::<i64>().map_err(|_| bad())?);
                    }
                    None if add && total.is_none() && token.is_none() => {
                        total = Some(part.parse::<u64>().map_err(|_| bad())?);
                    }
                    _ => return Err(bad()),
                }
            }
            history.push((add, effect, total, token));
        }
        Ok(history)
    }
}

/// A remote target applied operation `op`, which `step` of `root` sent (`None` in a
/// line written before the step was).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub op: u64,
    pub root: u64,
    pub step: Option<u16>,
}

impl Applied {
    /// Reads what follows a line's `= `: `OP ROOT STEP` or `OP ROOT`.
    pub fn parse(rest: &str) -> Option<Applied> {
        let mut parts = rest.split(' ');
        let op = parts.next()?.parse().ok()?;
        let root = parts.next()?.parse().ok()?;
        let step = match parts.next() {
            Some(step) => Some(step.parse().ok()?),
            None => None,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Applied { op, root, step })
    }
}
