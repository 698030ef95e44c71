//! The ledger: a file in which every step records its side effect and every rollback
//! removes it, so a run (or a crash and a resume) can be checked from outside the
//! engine.
//!
//! Format: one line per call, `+ ROOT PATH STEP TOTAL` or `- ROOT PATH STEP`, appended
//! with one `write` each, before the step returns. `TOTAL` is the number of effects
//! the root's whole tree leaves when it succeeds, so a root whose result the engine
//! has evicted (`--retention-ms`) can still be checked: its effects in force are none
//! or all of them. (A line without it, from before it was written, checks nothing.) A write reaches the kernel before the
//! engine persists the step, so a process crash (SIGKILL) loses no effect the store
//! knows of. Replaying the lines in order gives the set of effects in force; adding an
//! effect twice (a step re-run after a crash) is harmless.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One side effect: which root's tree, which procedure in it (0 = the root, i = child
/// i), which step.
pub type Effect = (u64, u16, u16);

pub struct Ledger {
    path: PathBuf,
    file: Mutex<File>,
}

impl Ledger {
    pub fn open(path: &Path) -> std::io::Result<Ledger> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Ledger {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        })
    }

    /// Records `effect`, of a tree that leaves `total` effects when it succeeds.
    pub fn add(&self, effect: Effect, total: u32) -> std::io::Result<()> {
        let (root, path, step) = effect;
        self.write(format!("+ {root} {path} {step} {total}\n"))
    }

    pub fn remove(&self, (root, path, step): Effect) -> std::io::Result<()> {
        self.write(format!("- {root} {path} {step}\n"))
    }

    fn write(&self, line: String) -> std::io::Result<()> {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        file.write_all(line.as_bytes())
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
            .map(|(add, effect, _)| (add, effect))
            .collect())
    }

    /// The effects each root's tree leaves when it succeeds, as its lines say.
    pub fn totals(&self) -> std::io::Result<HashMap<u64, usize>> {
        let mut totals = HashMap::new();
        for (_, (root, _, _), total) in self.lines()? {
            if let Some(total) = total.filter(|&t| t > 0) {
                totals.insert(root, total as usize);
            }
        }
        Ok(totals)
    }

    /// Every line in order, with the total an added effect names.
    fn lines(&self) -> std::io::Result<Vec<(bool, Effect, Option<u64>)>> {
        let mut history = Vec::new();
        let reader = BufReader::new(File::open(&self.path)?);
        for (n, line) in reader.lines().enumerate() {
            let line = line?;
            let bad = || {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{}:{}: bad ledger line {line:?}",
                        self.path.display(),
                        n + 1
                    ),
                )
            };
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
            let total = match parts.next() {
                Some(t) if add => Some(t.parse::<u64>().map_err(|_| bad())?),
                Some(_) => return Err(bad()),
                None => None,
            };
            history.push((add, effect, total));
        }
        Ok(history)
    }
}
