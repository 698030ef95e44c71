//! The WAL damage table: a real log written by `WalStore` over several small segments,
//! damaged one way per row, and the verdict of both `WalStore::open` and
//! `proctor wal verify` on it. A torn tail (what a crash during the one unacknowledged
//! append can leave) is truncated and reported, and nothing acknowledged is lost
//! (`wal verify` exits 3 and names the segment and offset); every other kind of damage
//! refuses the start, naming the file and, where there is one, the byte offset
//! (`wal verify` exits 1).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use proctor::ops::wal::{scan_segment, Frame, FRAME_HEADER_LEN, SEGMENT_HEADER_LEN};
use proctor::store::{ProcRecord, StoreOp};
use proctor::{MemoryStore, ProcedureStore, StoreError, WalOptions, WalStore};

fn record(id: u64, version: u8) -> ProcRecord {
    common::wal::record(id, id, version, 60)
}

fn options() -> WalOptions {
    WalOptions {
        segment_bytes: 4 << 10,
        max_segments: 100,
        sync: false,
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    common::wal::segments(dir)
}

fn name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

fn frames(path: &Path, newest: bool) -> Vec<Frame> {
    scan_segment(&fs::read(path).unwrap(), newest).frames
}

/// The log every row starts from: acknowledged appends over at least four segments,
/// then one more append (procedure 999) that plays the part of the unacknowledged one a
/// crash can tear. Returns the model of the acknowledged appends.
fn write_log(dir: &Path) -> MemoryStore {
    let mut model = MemoryStore::new();
    let mut wal = WalStore::open_with(dir, options()).unwrap();
    let mut id = 1;
    while segments(dir).len() < 4 || frames(segments(dir).last().unwrap(), true).len() < 4 {
        for ops in [
            vec![StoreOp::Insert(record(id, 0))],
            vec![StoreOp::Update(record(id, 1))],
        ] {
            wal.append(&ops).unwrap();
            model.append(&ops).unwrap();
        }
        id += 1;
    }
    wal.append(&[StoreOp::Insert(record(999, 0))]).unwrap();
    model
}

/// What a row expects.
enum Verdict {
    /// A torn tail in the newest segment, cut back to this offset.
    Torn { at: u64 },
    /// Refused: the error names this file (by name) and, if given, this offset.
    Refused { file: String, offset: Option<u64> },
}

/// The facts a damage function gets: the segment files, and where the newest segment's
/// last frame (the unacknowledged append) starts and ends.
struct Log {
    dir: PathBuf,
    segments: Vec<PathBuf>,
    last_frame: u64,
    end: u64,
}

impl Log {
    fn newest(&self) -> &PathBuf {
        self.segments.last().unwrap()
    }

    fn edit(&self, path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
        let mut bytes = fs::read(path).unwrap();
        f(&mut bytes);
        fs::write(path, bytes).unwrap();
    }
}

type Damage = fn(&Log) -> Option<Verdict>;

fn proctor_verify(dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proctor"))
        .args(["wal", "verify"])
        .arg(dir)
        .output()
        .expect("run proctor")
}

#[test]
fn every_kind_of_damage_gets_the_right_verdict() {
    let rows: Vec<(&str, Damage)> = vec![
        ("cut mid-frame", |log| {
            let at = log.end - 3;
            log.edit(log.newest(), |b| b.truncate(at as usize));
            Some(Verdict::Torn { at: log.last_frame })
        }),
        ("cut mid-header", |log| {
            let at = log.last_frame + 5;
            log.edit(log.newest(), |b| b.truncate(at as usize));
            Some(Verdict::Torn { at: log.last_frame })
        }),
        ("zero-filled tail", |log| {
            let at = log.last_frame as usize;
            log.edit(log.newest(), |b| {
                b.truncate(at);
                b.extend([0u8; 8192]);
            });
            Some(Verdict::Torn { at: log.last_frame })
        }),
        (
            "zeros then data: the header's sector never written",
            |log| {
                let at = log.last_frame as usize;
                log.edit(log.newest(), |b| {
                    b[at..at + FRAME_HEADER_LEN + 2].fill(0);
                });
                Some(Verdict::Torn { at: log.last_frame })
            },
        ),
        ("a flipped byte in the last frame's payload", |log| {
            log.edit(log.newest(), |b| {
                let n = b.len() - 2;
                b[n] ^= 0x20;
            });
            Some(Verdict::Torn { at: log.last_frame })
        }),
        ("a flipped length bit with frames after it", |log| {
            let fs = frames(log.newest(), true);
            let victim = fs[fs.len() - 3].offset;
            log.edit(log.newest(), |b| b[victim as usize + 2] ^= 0x01);
            Some(Verdict::Refused {
                file: name(log.newest()),
                offset: Some(victim),
            })
        }),
        ("a swapped pair of frames", |log| {
            let fs = frames(log.newest(), true);
            let (a, b) = (&fs[fs.len() - 3], &fs[fs.len() - 2]);
            let (start, mid, end) = (
                a.offset as usize,
                b.offset as usize,
                (b.offset + b.len) as usize,
            );
            log.edit(log.newest(), |bytes| {
                let first = bytes[start..mid].to_vec();
                let second = bytes[mid..end].to_vec();
                let swapped: Vec<u8> = second.into_iter().chain(first).collect();
                bytes[start..end].copy_from_slice(&swapped);
            });
            Some(Verdict::Refused {
                file: name(log.newest()),
                offset: Some(a.offset),
            })
        }),
        ("a missing middle segment", |log| {
            let gone = &log.segments[1];
            fs::remove_file(gone).unwrap();
            Some(Verdict::Refused {
                file: name(gone),
                offset: None,
            })
        }),
        (
            "a missing oldest segment of a log that never compacted",
            |log| {
                // No start marker: the log begins at segment 1.
                let gone = &log.segments[0];
                fs::remove_file(gone).unwrap();
                Some(Verdict::Refused {
                    file: name(gone),
                    offset: None,
                })
            },
        ),
        ("a missing newest segment", |log| {
            fs::remove_file(log.newest()).unwrap();
            Some(Verdict::Refused {
                file: name(log.newest()),
                offset: None,
            })
        }),
        ("an older segment cut at a frame boundary", |log| {
            let older = &log.segments[1];
            let cut = frames(older, false).last().unwrap().offset;
            log.edit(older, |b| b.truncate(cut as usize));
            Some(Verdict::Refused {
                file: name(older),
                offset: Some(cut),
            })
        }),
        ("a stray non-canonical segment name", |log| {
            let newest = log.newest();
            let seq: u64 = name(newest).trim_end_matches(".wal").parse().unwrap();
            let stray = log.dir.join(format!("{seq}.wal"));
            fs::copy(newest, &stray).unwrap();
            Some(Verdict::Refused {
                file: name(&stray),
                offset: None,
            })
        }),
        ("a huge max_id in a segment header", |log| {
            let oldest = &log.segments[0];
            log.edit(oldest, |b| {
                b[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
                let crc_at = SEGMENT_HEADER_LEN - 4;
                let crc = crc32c::crc32c(&b[..crc_at]);
                b[crc_at..SEGMENT_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
            });
            Some(Verdict::Refused {
                file: name(oldest),
                offset: Some(0),
            })
        }),
        (
            "a record id above the limit, in a frame with good checksums",
            |log| {
                let newest = log.newest();
                let lsn = frames(newest, true).last().unwrap().lsn + 1;
                // Built by hand (the encoder refuses such a record), in format 2's layout.
                assert_eq!(FRAME_HEADER_LEN, 21);
                let op = StoreOp::Insert(record(u64::MAX - 1, 0));
                let payload = rmp_serde::to_vec(&vec![op]).unwrap();
                let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
                frame.push(1);
                frame.extend(lsn.to_le_bytes());
                frame.extend(crc32c::crc32c(&frame).to_le_bytes());
                frame.extend(crc32c::crc32c(&payload).to_le_bytes());
                frame.extend(payload);
                log.edit(newest, |b| b.extend(frame));
                Some(Verdict::Refused {
                    file: name(newest),
                    offset: Some(log.end),
                })
            },
        ),
        ("a FIFO named like the next segment", |log| {
            let newest = log.newest();
            let seq: u64 = name(newest).trim_end_matches(".wal").parse().unwrap();
            let fifo = log.dir.join(format!("{:020}.wal", seq + 1));
            match Command::new("mkfifo").arg(&fifo).status() {
                Ok(status) if status.success() => Some(Verdict::Refused {
                    file: name(&fifo),
                    offset: None,
                }),
                _ => {
                    println!("skipping the FIFO row: mkfifo is not available");
                    None
                }
            }
        }),
    ];

    let mut failures = Vec::new();
    for (row, damage) in rows {
        let dir = tempfile::tempdir().unwrap();
        let mut model = write_log(dir.path());
        let segs = segments(dir.path());
        let newest = segs.last().unwrap().clone();
        let last = frames(&newest, true).pop().unwrap();
        let log = Log {
            dir: dir.path().to_path_buf(),
            segments: segs,
            last_frame: last.offset,
            end: last.offset + last.len,
        };
        let Some(verdict) = damage(&log) else {
            continue;
        };
        if let Err(e) = check_row(dir.path(), &verdict, &mut model, &newest) {
            failures.push(format!("{row}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Checks one damaged log against its verdict: `proctor wal verify` first (it changes
/// nothing), then `WalStore::open` (which repairs a torn tail).
fn check_row(
    dir: &Path,
    verdict: &Verdict,
    model: &mut MemoryStore,
    newest: &Path,
) -> Result<(), String> {
    let verify = proctor_verify(dir);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    match verdict {
        Verdict::Torn { at } => {
            if verify.status.code() != Some(3) {
                return Err(format!(
                    "verify exit {:?} for a torn tail, not 3: {out}",
                    verify.status.code()
                ));
            }
            let expected = format!(
                "torn tail at {}:{at}, will be truncated at next start",
                newest.display()
            );
            if !out.contains(&expected) {
                return Err(format!("verify does not say {expected:?}: {out}"));
            }
            let mut wal = WalStore::open_with(dir, options())
                .map_err(|e| format!("open refused a torn tail: {e}"))?;
            let snapshot = wal.load().map_err(|e| e.to_string())?;
            let expected = model.load().unwrap();
            if snapshot.records != expected.records {
                return Err("open lost acknowledged records or kept the torn one".into());
            }
            let reported = snapshot
                .repairs
                .iter()
                .any(|r| r.contains(&name(newest)) && r.contains(&format!("byte {at}")));
            if !reported {
                return Err(format!(
                    "the repair is not reported: {:?}",
                    snapshot.repairs
                ));
            }
            if fs::metadata(newest).map_err(|e| e.to_string())?.len() != *at {
                return Err(format!("not truncated to byte {at}"));
            }
            // The store carries on from the last good frame, and says nothing more.
            wal.append(&[StoreOp::Insert(record(5000, 0))])
                .map_err(|e| e.to_string())?;
            model.append(&[StoreOp::Insert(record(5000, 0))]).unwrap();
            drop(wal);
            let mut again = WalStore::open_with(dir, options()).map_err(|e| e.to_string())?;
            let snapshot = again.load().map_err(|e| e.to_string())?;
            if snapshot.records != model.load().unwrap().records || !snapshot.repairs.is_empty() {
                return Err(format!("reopen after the repair: {:?}", snapshot.repairs));
            }
        }
        Verdict::Refused { file, offset } => {
            if verify.status.code() != Some(1) {
                return Err(format!("verify exit {:?}: {out}", verify.status.code()));
            }
            if !out.contains(file.as_str()) || !out.contains("NOT sound") {
                return Err(format!("verify does not name {file}: {out}"));
            }
            if let Some(offset) = offset {
                if !out.contains(&format!("byte {offset}")) {
                    return Err(format!("verify does not name byte {offset}: {out}"));
                }
            }
            match WalStore::open_with(dir, options()) {
                Ok(_) => return Err("open accepted it".into()),
                Err(StoreError::Corrupt {
                    file: got,
                    offset: got_offset,
                    reason,
                }) => {
                    if !got.ends_with(file.as_str()) {
                        return Err(format!("open names {got}, not {file}: {reason}"));
                    }
                    if offset.is_some_and(|o| o != got_offset) {
                        return Err(format!(
                            "open says byte {got_offset}, not {offset:?}: {reason}"
                        ));
                    }
                }
                Err(other) => return Err(format!("open: not a corruption error: {other}")),
            }
        }
    }
    Ok(())
}

/// A log that compaction has shortened from below: its oldest segment files are gone
/// by design, and its start marker says where it begins. Removing the lowest file that
/// is left is refused by open and by `proctor wal verify`, naming the file.
#[test]
fn a_missing_oldest_segment_after_compaction_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4 << 10,
        max_segments: 3,
        sync: false,
    };
    {
        let mut wal = WalStore::open_with(dir.path(), options.clone()).unwrap();
        // Procedure 1 lives for the whole run; the others finish and are deleted.
        wal.append(&[StoreOp::Insert(record(1, 0))]).unwrap();
        for id in 2..400 {
            wal.append(&[StoreOp::Insert(record(id, 0))]).unwrap();
            wal.append(&[StoreOp::Delete(proctor::ProcId(id))]).unwrap();
        }
        assert!(wal.stats().segments_deleted > 5, "{:?}", wal.stats());
    }
    let before = segments(dir.path());
    assert!(!name(&before[0]).ends_with("00001.wal"), "{before:?}");
    let gone = &before[0];
    fs::remove_file(gone).unwrap();
    let verify = proctor_verify(dir.path());
    let out = String::from_utf8_lossy(&verify.stdout).into_owned();
    assert_eq!(verify.status.code(), Some(1), "{out}");
    assert!(out.contains("NOT sound"), "{out}");
    assert!(out.contains(&name(gone)), "{out}");
    match WalStore::open_with(dir.path(), options) {
        Err(StoreError::Corrupt { file, .. }) => assert!(file.ends_with(&name(gone)), "{file}"),
        Err(other) => panic!("not a corruption error: {other}"),
        Ok(_) => panic!("open accepted a log without its oldest segment"),
    }
}
