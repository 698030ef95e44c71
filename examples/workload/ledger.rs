//! The ledger: a file in which every step records its side effect and every rollback
//! removes it, so a run (or a crash and a resume) can be checked from outside the
//! engine.
//!
//! Format: one line per call, `+ ROOT PATH STEP TOTAL` or `- ROOT PATH STEP`, appended
//! with one `write` each, before the step returns, then ` @TOKEN` when the step ran
//! under a leader lease (its [`fencing token`](proctor::Context::fencing_token)), or
//! ` @TOKEN/PART` when it ran in partition `PART` of a cluster (tokens are ordered per
//! partition), then ` ^K` when the tree holds resource `res/K`. `TOTAL` is the number of effects
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
//! A change it refuses is kept as `! LINE` ([`Ledger::refusals`] counts them).
//! A ledger opened with [`Ledger::open_unfenced`] stands for the resources that do not check
//! tokens (most do not): it records each change's token but refuses none, so a late
//! effect of a deposed leader lands, and [`Ledger::fence_violations`] counts it. In a
//! cluster the fence file keeps the highest token per partition (8 bytes each, the
//! whole store's first).
//!
//! Locks: the lines of a tree that holds `res/K` (from its first step to its last step
//! or rollback) must not interleave with another such tree's: the file's order is the
//! order of the calls across every process, so [`Ledger::lock_conflicts`] finds two
//! processes' trees inside one resource at once.

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

/// The token a change was made under, and the partition it is ordered within.
pub type Fence = Option<(i64, Option<u32>)>;

/// One line: added or removed, the effect, the total an added effect names, the
/// token, the resource its tree holds.
type Line = (bool, Effect, Option<u64>, Fence, Option<u32>);

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
    pub fn add(
        &self,
        effect: Effect,
        total: u32,
        token: Fence,
        lock: Option<u32>,
    ) -> std::io::Result<()> {
        let (root, path, step) = effect;
        self.write(format!("+ {root} {path} {step} {total}"), token, lock)
    }

    pub fn remove(
        &self,
        (root, path, step): Effect,
        token: Fence,
        lock: Option<u32>,
    ) -> std::io::Result<()> {
        self.write(format!("- {root} {path} {step}"), token, lock)
    }

    fn write(&self, mut line: String, token: Fence, lock: Option<u32>) -> std::io::Result<()> {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        let (file, fence) = &*files;
        let lock = lock.map(|k| format!(" ^{k}")).unwrap_or_default();
        let Some((token, partition)) = token else {
            line.push_str(&lock);
            line.push('\n');
            return (&*file).write_all(line.as_bytes());
        };
        match partition {
            Some(p) => line.push_str(&format!(" @{token}/{p}{lock}\n")),
            None => line.push_str(&format!(" @{token}{lock}\n")),
        }
        // The partition's highest token, or the whole store's.
        let at = partition.map_or(0, |p| (u64::from(p) + 1) * 8);
        // Other processes append to the same ledger: check and append under its lock.
        file.lock()?;
        let appended = (|| {
            let mut highest = [0u8; 8];
            let read = fence.read_at(&mut highest, at)?;
            let highest = if read == 8 {
                i64::from_le_bytes(highest)
            } else {
                i64::MIN
            };
            if token < highest && self.fenced {
                // Kept as a refusal (`! LINE`): how many late changes were tried.
                (&*file).write_all(format!("! {line}").as_bytes())?;
                return Err(std::io::Error::other(format!(
                    "fenced: token {token} is older than {highest}, which the ledger has taken"
                )));
            }
            if token > highest {
                fence.write_all_at(&token.to_le_bytes(), at)?;
            }
            (&*file).write_all(line.as_bytes())
        })();
        file.unlock()?;
        appended
    }

    /// Records that root `root` was acknowledged to its submitter (`a ROOT`).
    pub fn acknowledged(&self, root: u64) -> std::io::Result<()> {
        self.write(format!("a {root}"), None, None)
    }

    /// How many changes the ledger refused as late (a token older than one taken).
    pub fn refusals(&self) -> std::io::Result<usize> {
        let reader = BufReader::new(File::open(&self.path)?);
        let mut refused = 0;
        for line in reader.lines() {
            refused += usize::from(line?.starts_with("! "));
        }
        Ok(refused)
    }

    /// Every root acknowledged to a submitter.
    pub fn acknowledgements(&self) -> std::io::Result<Vec<u64>> {
        let mut acked = Vec::new();
        let reader = BufReader::new(File::open(&self.path)?);
        for (n, line) in reader.lines().enumerate() {
            let line = line?;
            if let Some(root) = line.strip_prefix("a ") {
                acked.push(root.parse().map_err(|_| self.bad_line(n, &line))?);
            }
        }
        Ok(acked)
    }

    /// Records that a remote target applied operation `op`, which step `step` of
    /// `root` sent.
    pub fn applied(&self, op: u64, root: u64, step: u16) -> std::io::Result<()> {
        self.write(format!("= {op} {root} {step}"), None, None)
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
        let mut highest: HashMap<Option<u32>, i64> = HashMap::new();
        let mut violations = Vec::new();
        for (n, (_, effect, _, fence, _)) in self.lines()?.into_iter().enumerate() {
            let Some((token, partition)) = fence else {
                continue;
            };
            let highest = highest.entry(partition).or_insert(i64::MIN);
            if token < *highest {
                let within = partition
                    .map(|p| format!(" in partition {p}"))
                    .unwrap_or_default();
                violations.push(format!(
                    "ledger change {}: effect {effect:?} made under token {token}{within} after token {highest}",
                    n + 1
                ));
            }
            *highest = (*highest).max(token);
        }
        Ok(violations)
    }

    /// Trees inside one resource at once: for each resource, the span of each tree's
    /// lines (from its first to its last) must not overlap another tree's.
    pub fn lock_conflicts(&self) -> std::io::Result<Vec<String>> {
        // (resource, root) -> (first line, last line)
        let mut spans: HashMap<(u32, u64), (usize, usize)> = HashMap::new();
        for (n, (_, (root, _, _), _, _, lock)) in self.lines()?.into_iter().enumerate() {
            let Some(k) = lock else { continue };
            spans
                .entry((k, root))
                .and_modify(|span| span.1 = n)
                .or_insert((n, n));
        }
        let mut by_resource: HashMap<u32, Vec<(usize, usize, u64)>> = HashMap::new();
        for ((k, root), (first, last)) in spans {
            by_resource.entry(k).or_default().push((first, last, root));
        }
        let mut conflicts = Vec::new();
        for (k, mut spans) in by_resource {
            spans.sort_unstable();
            for pair in spans.windows(2) {
                let ((_, last, a), (first, _, b)) = (pair[0], pair[1]);
                if first <= last {
                    conflicts.push(format!(
                        "trees {a} and {b} were inside res/{k} at once (ledger lines {} and {})",
                        first + 1,
                        last + 1
                    ));
                }
            }
        }
        Ok(conflicts)
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
            .map(|(add, effect, _, _, _)| (add, effect))
            .collect())
    }

    /// The effects each root's tree leaves when it succeeds, as its lines say.
    pub fn totals(&self) -> std::io::Result<HashMap<u64, usize>> {
        let mut totals = HashMap::new();
        for (_, (root, _, _), total, _, _) in self.lines()? {
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
            // A remote target's application (see `applied`), an acknowledgement or a
            // refused change, not an effect.
            if line.starts_with("= ") || line.starts_with("a ") || line.starts_with("! ") {
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
            let mut lock = None;
            for part in parts {
                if let Some(k) = part.strip_prefix('^') {
                    lock = Some(k.parse::<u32>().map_err(|_| bad())?);
                    continue;
                }
                match part.strip_prefix('@') {
                    Some(t) if token.is_none() => {
                        let (t, partition) = match t.split_once('/') {
                            Some((t, p)) => (t, Some(p.parse::<u32>().map_err(|_| bad())?)),
                            None => (t, None),
                        };
                        token = Some((t.parse::<i64>().map_err(|_| bad())?, partition));
                    }
                    None if add && total.is_none() && token.is_none() => {
                        total = Some(part.parse::<u64>().map_err(|_| bad())?);
                    }
                    _ => return Err(bad()),
                }
            }
            history.push((add, effect, total, token, lock));
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
