//! The naive baseline store: one file per procedure, rewritten through a temp file,
//! `fsync` and `rename` on every update. This is where procedure frameworks often start;
//! the benchmarks measure the WAL against it. It is not atomic across the procedures of
//! one append (a crash can leave a parent updated and its children missing), which is
//! one more reason the engine's default is a log.

use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;

use proctor::{ProcedureStore, StoreError};

use proctor::store::{ProcRecord, StoreOp, StoreSnapshot};

pub struct FilePerProcStore {
    dir: PathBuf,
}

impl FilePerProcStore {
    pub fn open(dir: PathBuf) -> Result<Self, StoreError> {
        fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(FilePerProcStore { dir })
    }

    fn write(&self, record: &ProcRecord) -> std::io::Result<()> {
        let bytes = rmp_serde::to_vec(record).map_err(std::io::Error::other)?;
        let tmp = self.dir.join(format!("{}.tmp", record.id));
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, self.dir.join(format!("{}.proc", record.id)))
    }
}

impl ProcedureStore for FilePerProcStore {
    // The naive baseline keeps no mark of a graceful stop: `load` reports
    // `LastStop::Unknown`, and a start assumes a crash.
    fn mark_drained(&mut self, _cut_off: &[proctor::ProcId]) -> Result<(), StoreError> {
        Ok(())
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        for op in ops {
            let result = match op {
                StoreOp::Insert(r) | StoreOp::Update(r) => self.write(r),
                StoreOp::Delete(id) => fs::remove_file(self.dir.join(format!("{id}.proc"))),
            };
            result.map_err(|source| StoreError::Io {
                context: format!("procedure {} in {}", op.proc_id(), self.dir.display()),
                source,
            })?;
        }
        Ok(())
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        let io = |source| StoreError::Io {
            context: format!("reading {}", self.dir.display()),
            source,
        };
        let mut records = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "proc") {
                let bytes = fs::read(&path).map_err(io)?;
                let record: ProcRecord =
                    rmp_serde::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                        file: path.display().to_string(),
                        offset: 0,
                        reason: e.to_string(),
                    })?;
                records.push(record);
            }
        }
        records.sort_by_key(|r| r.id);
        let max_id = records.last().map_or(0, |r| r.id.0);
        Ok(StoreSnapshot {
            records,
            max_id,
            repairs: Vec::new(),
            // The baseline keeps no mark: a restart assumes any step may have been cut off.
            last_stop: proctor::store::LastStop::Unknown,
        })
    }
}
