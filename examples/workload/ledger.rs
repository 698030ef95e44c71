//! The ledger: a file in which every step records its side effect and every rollback
//! removes it, so a run (or a crash and a resume) can be checked from outside the
//! engine.
//!
//! Format: one line per call, `+ ROOT PATH STEP` or `- ROOT PATH STEP`, appended with
//! one `write` each, before the step returns. A write reaches the kernel before the
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

    pub fn add(&self, effect: Effect) -> std::io::Result<()> {
        self.write('+', effect)
    }

    pub fn remove(&self, effect: Effect) -> std::io::Result<()> {
        self.write('-', effect)
    }

    fn write(&self, sign: char, (root, path, step): Effect) -> std::io::Result<()> {
        let line = format!("{sign} {root} {path} {step}\n");
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
            history.push((add, effect));
        }
        Ok(history)
    }
}
