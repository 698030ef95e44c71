//! Power loss under the WAL store. `SimFs` is a simulated disk behind the store's
//! [`WalFs`] trait: it keeps what was synced (file contents by `sync`, directory entries
//! by `sync_dir`) and, at a power cut, drops or keeps unsynced data in sector-sized
//! pieces, some of them zeros (space allocated, data never written). The test cuts the
//! power at every file system call of a run that rolls, compacts and deletes segments,
//! then checks that the store opens and that every acknowledged append survived.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use proctor::{MemoryStore, ProcId, ProcedureStore, WalOptions, WalStore};

use proctor::store::{ProcRecord, StoreOp};

use proctor::ops::{Entry, WalFs};

const SECTOR: usize = 512;

#[derive(Clone, Default)]
struct SimFile {
    /// What readers see now.
    data: Vec<u8>,
    /// What survives a power cut for sure.
    durable: Vec<u8>,
}

#[derive(Default)]
struct Disk {
    /// The files as they are now.
    files: BTreeMap<PathBuf, SimFile>,
    /// Removed files whose removal is not yet durable.
    removed: BTreeMap<PathBuf, SimFile>,
    /// The names a power cut keeps.
    durable_names: BTreeSet<PathBuf>,
    dirs: BTreeSet<PathBuf>,
    /// Mutating calls so far.
    calls: u64,
    /// Each mutating call, in order: what it did and to which path.
    trace: Vec<(&'static str, PathBuf)>,
    /// The call at which the power goes (it and every later call fail).
    cut_at: Option<u64>,
}

impl Disk {
    /// Counts a mutating call; fails it once the power is cut.
    fn tick(&mut self, what: &'static str, path: &Path) -> io::Result<()> {
        self.calls += 1;
        self.trace.push((what, path.to_path_buf()));
        if self.cut_at.is_some_and(|at| self.calls >= at) {
            return Err(io::Error::other("power cut"));
        }
        Ok(())
    }

    fn file(&mut self, path: &Path) -> io::Result<&mut SimFile> {
        self.files
            .get_mut(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    /// The disk after a power cut: synced names with their synced data, plus a random
    /// part of their unsynced tail, sector by sector (kept, or zeros), cut at a sector
    /// boundary.
    fn after_power_cut(&self, rng: &mut fastrand::Rng) -> Disk {
        let mut files = BTreeMap::new();
        for name in &self.durable_names {
            let Some(file) = self.files.get(name).or_else(|| self.removed.get(name)) else {
                continue;
            };
            let mut data = file.durable.clone();
            let unsynced = file.data.get(data.len()..).unwrap_or(&[]);
            let start = data.len();
            let mut boundaries: Vec<usize> = vec![start];
            let mut b = (start / SECTOR + 1) * SECTOR;
            while b < start + unsynced.len() {
                boundaries.push(b);
                b += SECTOR;
            }
            boundaries.push(start + unsynced.len());
            let keep_to = boundaries[rng.usize(..boundaries.len())];
            for pair in boundaries.windows(2) {
                let (from, to) = (pair[0], pair[1].min(keep_to));
                if from >= to {
                    break;
                }
                if rng.bool() {
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
        Disk {
            durable_names: files.keys().cloned().collect(),
            files,
            dirs: self.dirs.clone(),
            ..Disk::default()
        }
    }
}

#[derive(Clone)]
struct SimFs(Arc<Mutex<Disk>>);

impl SimFs {
    fn disk(&self) -> MutexGuard<'_, Disk> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct SimAppender {
    fs: SimFs,
    path: PathBuf,
}

impl Write for SimAppender {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut disk = self.fs.disk();
        disk.tick("write", &self.path)?;
        disk.file(&self.path)?.data.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl WalFs for SimFs {
    type Appender = SimAppender;
    type Reader = Cursor<Vec<u8>>;

    fn is_dir(&self, path: &Path) -> io::Result<Option<bool>> {
        let disk = self.disk();
        Ok(if disk.dirs.contains(path) {
            Some(true)
        } else if disk.files.contains_key(path) {
            Some(false)
        } else {
            None
        })
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        disk.tick("create_dir_all", path)?;
        disk.dirs.extend(path.ancestors().map(Path::to_path_buf));
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        disk.tick("sync_dir", dir)?;
        let now: Vec<PathBuf> = disk.files.keys().cloned().collect();
        disk.durable_names.retain(|p| p.parent() != Some(dir));
        disk.durable_names
            .extend(now.into_iter().filter(|p| p.parent() == Some(dir)));
        disk.removed.retain(|p, _| p.parent() != Some(dir));
        Ok(())
    }

    fn lock(&self, _path: &Path) -> io::Result<Option<Box<dyn Send>>> {
        Ok(Some(Box::new(())))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<Entry>> {
        Ok(self
            .disk()
            .files
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .map(|p| Entry {
                path: p.clone(),
                regular: true,
                kind: "regular file".into(),
            })
            .collect())
    }

    fn open_read(&self, path: &Path) -> io::Result<Self::Reader> {
        Ok(Cursor::new(self.disk().file(path)?.data.clone()))
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        Ok(self.disk().file(path)?.data.len() as u64)
    }

    fn create_new(&self, path: &Path) -> io::Result<SimAppender> {
        let mut disk = self.disk();
        disk.tick("create_new", path)?;
        if disk.files.contains_key(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        disk.removed.remove(path);
        disk.files.insert(path.to_path_buf(), SimFile::default());
        Ok(SimAppender {
            fs: self.clone(),
            path: path.to_path_buf(),
        })
    }

    fn open_append(&self, path: &Path) -> io::Result<SimAppender> {
        self.disk().file(path)?;
        Ok(SimAppender {
            fs: self.clone(),
            path: path.to_path_buf(),
        })
    }

    fn sync(&self, file: &mut SimAppender) -> io::Result<()> {
        let mut disk = self.disk();
        disk.tick("sync", &file.path)?;
        let f = disk.file(&file.path)?;
        f.durable = f.data.clone();
        Ok(())
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut disk = self.disk();
        disk.tick("truncate", path)?;
        let f = disk.file(path)?;
        f.data.truncate(len as usize);
        f.durable = f.data.clone();
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        disk.tick("remove_file", path)?;
        let file = disk
            .files
            .remove(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        disk.removed.insert(path.to_path_buf(), file);
        Ok(())
    }
}

fn record(id: u64, version: u8) -> ProcRecord {
    common::wal::record(id, id, version, 50)
}

fn options() -> WalOptions {
    WalOptions {
        segment_bytes: 2 << 10,
        max_segments: 3,
        sync: true,
    }
}

/// The appends of one run: a few long-lived procedures, then many that are inserted,
/// updated and (half of them) deleted, so the store rolls, rewrites and deletes.
fn script() -> Vec<Vec<StoreOp>> {
    let mut out: Vec<Vec<StoreOp>> = (1..=6)
        .map(|id| vec![StoreOp::Insert(record(id, 0))])
        .collect();
    for id in 100..180 {
        out.push(vec![StoreOp::Insert(record(id, 0))]);
        out.push(vec![StoreOp::Update(record(id, 1))]);
        if id % 2 == 0 {
            out.push(vec![StoreOp::Delete(ProcId(id))]);
        }
    }
    out
}

/// Runs the script on a disk whose power goes at call `cut_at`: what was acknowledged,
/// and the append in flight when the power went.
fn run(fs: &SimFs) -> (MemoryStore, Option<Vec<StoreOp>>) {
    let mut acked = MemoryStore::new();
    let Ok(mut wal) = WalStore::open_on(fs.clone(), "/wal", options()) else {
        return (acked, None);
    };
    for ops in script() {
        match wal.append(&ops) {
            Ok(()) => acked.append(&ops).unwrap(),
            Err(_) => return (acked, Some(ops)),
        }
    }
    (acked, None)
}

#[test]
fn every_acknowledged_append_survives_a_power_cut_anywhere() {
    let whole = SimFs(Arc::new(Mutex::new(Disk::default())));
    let (all, _) = run(&whole);
    let calls = whole.disk().calls;
    let stats_segments = whole.disk().files.len();
    assert!(calls > 400, "the run is too short to test: {calls} calls");
    let mut all = all;
    assert!(all.load().unwrap().records.len() > 40);
    assert!(stats_segments >= 2);

    let mut failures = Vec::new();
    for cut_at in 1..=calls + 1 {
        for seed in 0..2 {
            let fs = SimFs(Arc::new(Mutex::new(Disk {
                cut_at: Some(cut_at),
                ..Disk::default()
            })));
            let (mut acked, in_flight) = run(&fs);
            let mut rng = fastrand::Rng::with_seed(cut_at * 2 + seed);
            let after = SimFs(Arc::new(Mutex::new(fs.disk().after_power_cut(&mut rng))));
            let mut wal = match WalStore::open_on(after.clone(), "/wal", options()) {
                Ok(wal) => wal,
                Err(e) => {
                    failures.push(format!("cut at call {cut_at}, seed {seed}: open: {e}"));
                    continue;
                }
            };
            let got = wal.load().unwrap().records;
            let without = acked.load().unwrap().records;
            let with = in_flight.map(|ops| {
                // A fresh model: clones of a MemoryStore share one map.
                let mut m = MemoryStore::new();
                let inserts: Vec<StoreOp> = without.iter().cloned().map(StoreOp::Insert).collect();
                m.append(&inserts).unwrap();
                m.append(&ops).unwrap();
                m.load().unwrap().records
            });
            if got != without && Some(&got) != with.as_ref() {
                failures.push(format!(
                    "cut at call {cut_at}, seed {seed}: {} records recovered, {} acknowledged",
                    got.len(),
                    without.len()
                ));
                continue;
            }
            // The recovered store goes on and reopens with what it was given.
            wal.append(&[StoreOp::Insert(record(9000, 0))]).unwrap();
            drop(wal);
            let mut again = WalStore::open_on(after, "/wal", options()).unwrap();
            let records = again.load().unwrap().records;
            if !records.iter().any(|r| r.id == ProcId(9000)) || records.len() != got.len() + 1 {
                failures.push(format!(
                    "cut at call {cut_at}, seed {seed}: reopen lost data"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cuts failed:\n{}",
        failures.len(),
        2 * (calls + 1),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The power goes at each deletion of a segment by compaction, after the start marker
/// that precedes it was synced: the segment survives on disk, below where the log now
/// begins. Open removes it as a reported repair, and loses nothing acknowledged.
#[test]
fn a_power_cut_between_the_start_marker_and_a_deletion_recovers() {
    let whole = SimFs(Arc::new(Mutex::new(Disk::default())));
    run(&whole);
    let deletions: Vec<(u64, PathBuf)> = whole
        .disk()
        .trace
        .iter()
        .enumerate()
        .filter(|(_, (what, path))| {
            *what == "remove_file" && path.extension().is_some_and(|e| e == "wal")
        })
        .map(|(i, (_, path))| (i as u64 + 1, path.clone()))
        .collect();
    assert!(deletions.len() > 5, "{} deletions", deletions.len());

    let mut failures = Vec::new();
    for (cut_at, deleted) in deletions {
        let fs = SimFs(Arc::new(Mutex::new(Disk {
            cut_at: Some(cut_at),
            ..Disk::default()
        })));
        let (mut acked, in_flight) = run(&fs);
        let mut rng = fastrand::Rng::with_seed(cut_at);
        let after = SimFs(Arc::new(Mutex::new(fs.disk().after_power_cut(&mut rng))));
        assert!(after.disk().files.contains_key(&deleted), "cut at {cut_at}");
        let mut wal = match WalStore::open_on(after.clone(), "/wal", options()) {
            Ok(wal) => wal,
            Err(e) => {
                failures.push(format!("cut at call {cut_at}: open: {e}"));
                continue;
            }
        };
        let snapshot = wal.load().unwrap();
        let name = deleted.file_name().unwrap().to_string_lossy().into_owned();
        if !snapshot
            .repairs
            .iter()
            .any(|r| r.contains(&name) && r.contains("leftover"))
        {
            failures.push(format!(
                "cut at call {cut_at}: {name} not reported removed: {:?}",
                snapshot.repairs
            ));
        }
        if after.disk().files.contains_key(&deleted) {
            failures.push(format!("cut at call {cut_at}: {name} is still there"));
        }
        // The append whose compaction was cut was written before the marker: it may
        // be there or not.
        let without = acked.load().unwrap().records;
        let mut with = MemoryStore::new();
        let inserts: Vec<StoreOp> = without.iter().cloned().map(StoreOp::Insert).collect();
        with.append(&inserts).unwrap();
        with.append(&in_flight.unwrap_or_default()).unwrap();
        if snapshot.records != without && snapshot.records != with.load().unwrap().records {
            failures.push(format!("cut at call {cut_at}: records differ"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
