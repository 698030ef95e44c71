//! The simulated disk under the WAL store ([`WalFs`]): it keeps what was synced (file
//! contents by `sync`, directory entries by `sync_dir`), fails a write or a sync with
//! `EIO` or `ENOSPC` and writes short when the seed says so, and at a power cut keeps a random part of
//! each file's unsynced tail, sector by sector (kept, or zeros: space allocated, data
//! never written).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::Rng;
use crate::actors::wal_store::{Entry, WalFs};

const SECTOR: usize = 512;

#[derive(Clone, Default)]
struct SimFile {
    /// What readers see now.
    data: Vec<u8>,
    /// What survives a power cut for sure.
    durable: Vec<u8>,
}

#[derive(Default)]
struct Platter {
    files: BTreeMap<PathBuf, SimFile>,
    /// Removed files whose removal is not yet durable.
    removed: BTreeMap<PathBuf, SimFile>,
    /// The names a power cut keeps.
    durable_names: BTreeSet<PathBuf>,
    dirs: BTreeSet<PathBuf>,
    /// The faults' own generator (a write's fate must not depend on the actors').
    rng: Rng,
    /// Chance in a million that a write or a sync fails.
    error_ppm: u32,
    /// Faults injected so far.
    faults: u32,
}

impl Platter {
    fn fault(&mut self, what: &str) -> io::Result<()> {
        if self.error_ppm == 0 || self.rng.below(1_000_000) >= u64::from(self.error_ppm) {
            return Ok(());
        }
        self.faults += 1;
        Err(if self.rng.below(2) == 0 {
            io::Error::other(format!("simulated EIO in {what}"))
        } else {
            io::Error::new(
                io::ErrorKind::StorageFull,
                format!("simulated ENOSPC in {what}"),
            )
        })
    }

    fn file(&mut self, path: &Path) -> io::Result<&mut SimFile> {
        self.files
            .get_mut(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
}

/// A simulated disk, shared by every incarnation of one seed's engine.
#[derive(Clone)]
pub(super) struct SimDisk(Arc<Mutex<Platter>>);

impl SimDisk {
    pub(super) fn new(seed: u64, error_ppm: u32) -> SimDisk {
        SimDisk(Arc::new(Mutex::new(Platter {
            rng: Rng::new(seed ^ 0xd15c),
            error_ppm,
            ..Platter::default()
        })))
    }

    fn platter(&self) -> MutexGuard<'_, Platter> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Faults injected so far.
    pub(super) fn faults(&self) -> u32 {
        self.platter().faults
    }

    /// Bytes in files now.
    pub(super) fn bytes(&self) -> u64 {
        self.platter()
            .files
            .values()
            .map(|f| f.data.len() as u64)
            .sum()
    }

    /// The power goes: synced names keep their synced data plus a random part of their
    /// unsynced tail, cut at a sector boundary, each sector kept or zeros.
    pub(super) fn power_cut(&self, rng: &mut Rng) {
        let mut p = self.platter();
        let mut files = BTreeMap::new();
        for name in &p.durable_names {
            let Some(file) = p.files.get(name).or_else(|| p.removed.get(name)) else {
                continue;
            };
            let mut data = file.durable.clone();
            let start = data.len();
            let unsynced = file.data.get(start..).unwrap_or(&[]);
            let mut bounds = vec![start];
            let mut b = (start / SECTOR + 1) * SECTOR;
            while b < start + unsynced.len() {
                bounds.push(b);
                b += SECTOR;
            }
            bounds.push(start + unsynced.len());
            let keep_to = bounds[rng.below(bounds.len() as u64) as usize];
            for pair in bounds.windows(2) {
                let (from, to) = (pair[0], pair[1].min(keep_to));
                if from >= to {
                    break;
                }
                if rng.below(4) != 0 {
                    data.extend_from_slice(&file.data[from..to]);
                } else {
                    data.resize(to, 0);
                }
            }
            files.insert(
                name.clone(),
                SimFile {
                    durable: data.clone(),
                    data,
                },
            );
        }
        p.durable_names = files.keys().cloned().collect();
        p.files = files;
        p.removed.clear();
    }
}

pub(super) struct SimAppender {
    disk: SimDisk,
    path: PathBuf,
}

impl Write for SimAppender {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut p = self.disk.platter();
        p.fault("write")?;
        // A short write now and then (the caller writes the rest).
        let len = if p.error_ppm > 0 && buf.len() > 1 && p.rng.below(64) == 0 {
            buf.len() / 2
        } else {
            buf.len()
        };
        p.file(&self.path)?.data.extend_from_slice(&buf[..len]);
        Ok(len)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl WalFs for SimDisk {
    type Appender = SimAppender;
    type Reader = Cursor<Vec<u8>>;

    fn is_dir(&self, path: &Path) -> io::Result<Option<bool>> {
        let p = self.platter();
        Ok(if p.dirs.contains(path) {
            Some(true)
        } else if p.files.contains_key(path) {
            Some(false)
        } else {
            None
        })
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.platter()
            .dirs
            .extend(path.ancestors().map(Path::to_path_buf));
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut p = self.platter();
        let now: Vec<PathBuf> = p.files.keys().cloned().collect();
        p.durable_names.retain(|f| f.parent() != Some(dir));
        p.durable_names
            .extend(now.into_iter().filter(|f| f.parent() == Some(dir)));
        p.removed.retain(|f, _| f.parent() != Some(dir));
        Ok(())
    }

    fn lock(&self, _path: &Path) -> io::Result<Option<Box<dyn Send>>> {
        Ok(Some(Box::new(())))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<Entry>> {
        Ok(self
            .platter()
            .files
            .keys()
            .filter(|f| f.parent() == Some(dir))
            .map(|f| Entry {
                path: f.clone(),
                regular: true,
                kind: "regular file".into(),
            })
            .collect())
    }

    fn open_read(&self, path: &Path) -> io::Result<Self::Reader> {
        Ok(Cursor::new(self.platter().file(path)?.data.clone()))
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        Ok(self.platter().file(path)?.data.len() as u64)
    }

    fn create_new(&self, path: &Path) -> io::Result<SimAppender> {
        let mut p = self.platter();
        if p.files.contains_key(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        p.removed.remove(path);
        p.files.insert(path.to_path_buf(), SimFile::default());
        Ok(SimAppender {
            disk: self.clone(),
            path: path.to_path_buf(),
        })
    }

    fn open_append(&self, path: &Path) -> io::Result<SimAppender> {
        self.platter().file(path)?;
        Ok(SimAppender {
            disk: self.clone(),
            path: path.to_path_buf(),
        })
    }

    fn sync(&self, file: &mut SimAppender) -> io::Result<()> {
        let mut p = self.platter();
        p.fault("sync")?;
        let f = p.file(&file.path)?;
        f.durable = f.data.clone();
        Ok(())
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut p = self.platter();
        let f = p.file(path)?;
        f.data.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        f.durable = f.data.clone();
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut p = self.platter();
        let file = p
            .files
            .remove(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        p.removed.insert(path.to_path_buf(), file);
        Ok(())
    }
}
