//! Records and directory listings shared by the WAL tests (`wal_store`, `wal_damage`,
//! `wal_powerloss`): what they write is only ever compared with itself.

use std::fs;
use std::path::{Path, PathBuf};

use proctor::{ProcId, ProcState};

use proctor::store::ProcRecord;

/// A RUNNABLE record of procedure `id` in root `root`'s tree, at `version`, with
/// `data_len` bytes of state (the tests size their segments by it).
pub fn record(id: u64, root: u64, version: u8, data_len: usize) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: (id != root).then_some(ProcId(root)),
        root: ProcId(root),
        type_name: "t".into(),
        state: ProcState::Runnable,
        stack_indexes: vec![u32::from(version)],
        failure: None,
        failure_seq: None,
        submitted_ms: 1,
        updated_ms: u64::from(version),
        wake_at_ms: None,
        event: None,
        data: vec![version; data_len],
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
        nonce_fingerprint: None,
    }
}

/// The segment files of a WAL directory, in name order.
pub fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    files.sort();
    files
}
