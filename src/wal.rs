//! The write-ahead log's byte format: segment headers, frames, and the scan that tells
//! a torn tail from corruption. Pure: bytes in, values out. The file handling lives in
//! `actors/wal_store.rs`; the `proctor` command reads logs through [`scan_segment`].
//!
//! # Format (version 1)
//!
//! A WAL is a directory of segment files named `{seq:020}.wal`, `seq` counting up from
//! 1. Integers are little-endian.
//!
//! ```text
//! segment  := header frame*
//! header   := magic "PRCTRWAL" (8) | version u16 | reserved u16 (0) | seq u64
//!             | max_id u64 | crc32c u32 of the preceding 28 bytes         = 32 bytes
//! frame    := len u32 | kind u8 | crc u32 | payload (len bytes)
//!             crc = crc32c(len | kind | payload)
//! kind     := 1 batch       (one group-committed append)
//!           | 2 checkpoint  (latest records rewritten forward by compaction)
//! payload  := MessagePack array of ops, each [tag, body]:
//!             Insert(ProcRecord) | Update(ProcRecord) | Delete(ProcId)
//! ```
//!
//! One frame is one `append` of the store, so a frame is the unit of atomicity: a crash
//! leaves either the whole frame (its CRC matches) or a torn one, which recovery drops.
//! A record is a full snapshot of one procedure ([`ProcRecord`]); the latest record per
//! procedure wins and a `Delete` removes it. `max_id` is the highest procedure id
//! written before the segment was created, so ids are never reused even after the
//! segments that held the highest ones are deleted.
//!
//! # Torn tail or corruption
//!
//! A crash can leave the end of the newest segment torn: a frame cut short, a frame whose
//! bytes reach the end of the file but whose CRC fails (pages written out of order), or a
//! zero-filled tail (space allocated, data never written). Those are truncated at the
//! last good frame. Any other bad frame — in an older segment, or followed by more data —
//! is corruption: recovery stops with the file and byte offset rather than silently drop
//! acknowledged steps.

use crate::procedure::ProcId;
use crate::record::{ProcRecord, StoreOp};

/// The first eight bytes of every segment.
pub const MAGIC: [u8; 8] = *b"PRCTRWAL";
/// The format version this code writes and reads.
pub const VERSION: u16 = 1;
/// Bytes in a segment header.
pub const SEGMENT_HEADER_LEN: usize = 32;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 9;
/// The largest payload a frame may carry; a larger `len` is corruption.
pub const MAX_PAYLOAD_LEN: u32 = 1 << 30;

/// What a frame holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// One group-committed append.
    Batch = 1,
    /// Latest records rewritten forward by compaction.
    Checkpoint = 2,
}

impl FrameKind {
    fn from_byte(b: u8) -> Option<FrameKind> {
        match b {
            1 => Some(FrameKind::Batch),
            2 => Some(FrameKind::Checkpoint),
            _ => None,
        }
    }
}

/// Why bytes are not a good frame or header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The bytes end before the frame does.
    #[error("truncated: the frame needs {need} bytes, {have} remain")]
    Truncated {
        /// Bytes the frame claims.
        need: u64,
        /// Bytes left in the file.
        have: u64,
    },
    /// The checksum does not match.
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// The CRC in the frame.
        stored: u32,
        /// The CRC of the bytes.
        computed: u32,
    },
    /// An unknown frame kind.
    #[error("corrupt frame: unknown kind {0}")]
    Kind(u8),
    /// A length no writer produces.
    #[error("corrupt frame: length {0} exceeds the maximum")]
    Length(u32),
    /// The payload passed its CRC but does not decode (or breaks a record invariant).
    #[error("corrupt payload: {0}")]
    Payload(String),
    /// The segment header is bad.
    #[error("corrupt segment header: {0}")]
    Header(String),
}

/// What a segment header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The segment's sequence number.
    pub seq: u64,
    /// The highest procedure id written before the segment was created.
    pub max_id: u64,
}

/// A segment header for segment `seq`.
pub fn segment_header(seq: u64, max_id: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&seq.to_le_bytes());
    h[20..28].copy_from_slice(&max_id.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Parses a segment header.
pub fn parse_segment_header(bytes: &[u8]) -> Result<SegmentHeader, FrameError> {
    if bytes.len() < SEGMENT_HEADER_LEN {
        return Err(FrameError::Truncated {
            need: SEGMENT_HEADER_LEN as u64,
            have: bytes.len() as u64,
        });
    }
    let h = &bytes[..SEGMENT_HEADER_LEN];
    if h[0..8] != MAGIC {
        return Err(FrameError::Header(
            "bad magic: not a proctor WAL segment".into(),
        ));
    }
    let stored = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
    let computed = crc32c::crc32c(&h[0..28]);
    if stored != computed {
        return Err(FrameError::Checksum { stored, computed });
    }
    let version = u16::from_le_bytes([h[8], h[9]]);
    if version != VERSION {
        return Err(FrameError::Header(format!(
            "format version {version}, this build reads {VERSION}"
        )));
    }
    Ok(SegmentHeader {
        seq: u64_at(h, 12),
        max_id: u64_at(h, 20),
    })
}

/// Checks what every stored record must satisfy. Used before encoding (a failure is a
/// bug in the engine) and after decoding (a failure is corruption).
pub fn check_op(op: &StoreOp) -> Result<(), String> {
    match op {
        StoreOp::Insert(r) | StoreOp::Update(r) => check_record(r),
        StoreOp::Delete(_) => Ok(()),
    }
}

fn check_record(r: &ProcRecord) -> Result<(), String> {
    if (r.parent.is_none()) != (r.root == r.id) {
        return Err(format!(
            "procedure {} has parent {:?} but root {}",
            r.id, r.parent, r.root
        ));
    }
    if r.type_name.is_empty() {
        return Err(format!("procedure {} has no type name", r.id));
    }
    if r.id == ProcId(0) {
        return Err("procedure id 0 is never assigned".into());
    }
    Ok(())
}

/// Appends one frame holding `ops` to `out`.
///
/// # Panics
/// If an op breaks a record invariant ([`check_op`]): the engine made a bad record.
pub fn encode_frame(
    kind: FrameKind,
    ops: &[StoreOp],
    out: &mut Vec<u8>,
) -> Result<(), rmp_serde::encode::Error> {
    for op in ops {
        if let Err(e) = check_op(op) {
            panic!("refusing to write a bad record: {e}");
        }
    }
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    rmp_serde::encode::write(out, ops)?;
    let payload_len = out.len() - start - FRAME_HEADER_LEN;
    let len = u32::try_from(payload_len)
        .ok()
        .filter(|&l| l <= MAX_PAYLOAD_LEN)
        .ok_or_else(|| {
            rmp_serde::encode::Error::Syntax(format!("frame of {payload_len} bytes is too large"))
        })?;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4] = kind as u8;
    let crc = frame_crc(&out[start..start + 5], &out[start + FRAME_HEADER_LEN..]);
    out[start + 5..start + 9].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

fn frame_crc(len_and_kind: &[u8], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(len_and_kind), payload)
}

/// Decodes the frame at the start of `bytes`: its kind, its ops, and its total length.
pub fn decode_frame(bytes: &[u8]) -> Result<(FrameKind, Vec<StoreOp>, usize), FrameError> {
    if bytes.len() < FRAME_HEADER_LEN {
        return Err(FrameError::Truncated {
            need: FRAME_HEADER_LEN as u64,
            have: bytes.len() as u64,
        });
    }
    let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let kind_byte = bytes[4];
    let stored = u32::from_le_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
    let kind = FrameKind::from_byte(kind_byte).ok_or(FrameError::Kind(kind_byte))?;
    if len > MAX_PAYLOAD_LEN {
        return Err(FrameError::Length(len));
    }
    let total = FRAME_HEADER_LEN + len as usize;
    if bytes.len() < total {
        return Err(FrameError::Truncated {
            need: total as u64,
            have: bytes.len() as u64,
        });
    }
    let payload = &bytes[FRAME_HEADER_LEN..total];
    let computed = frame_crc(&bytes[0..5], payload);
    if stored != computed {
        return Err(FrameError::Checksum { stored, computed });
    }
    let ops: Vec<StoreOp> =
        rmp_serde::from_slice(payload).map_err(|e| FrameError::Payload(e.to_string()))?;
    for op in &ops {
        check_op(op).map_err(FrameError::Payload)?;
    }
    Ok((kind, ops, total))
}

/// A good frame found by a scan.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// Its byte offset in the segment file.
    pub offset: u64,
    /// Its total length in bytes, header included.
    pub len: u64,
    /// What it holds.
    pub kind: FrameKind,
    /// Its ops, in order.
    pub ops: Vec<StoreOp>,
}

/// How a segment scan ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanEnd {
    /// Every byte belongs to a good frame.
    Clean,
    /// The newest segment ends in a torn frame at `offset`: truncate there and go on.
    TornTail {
        /// Where the good data ends.
        offset: u64,
        /// What was found there.
        reason: FrameError,
    },
    /// A bad frame at `offset` that a crash cannot explain.
    Corrupt {
        /// Where the bad frame starts.
        offset: u64,
        /// What is wrong with it.
        reason: FrameError,
    },
}

/// The result of scanning one segment file.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentScan {
    /// The header (`None` if the header itself is bad).
    pub header: Option<SegmentHeader>,
    /// The good frames, in order.
    pub frames: Vec<Frame>,
    /// How the scan ended.
    pub end: ScanEnd,
}

/// Scans a segment's bytes. `newest` says whether it is the last segment of the log,
/// the only one whose tail a crash can tear.
pub fn scan_segment(bytes: &[u8], newest: bool) -> SegmentScan {
    let header = match parse_segment_header(bytes) {
        Ok(header) => header,
        Err(reason) => {
            // A crash while creating the segment leaves a short or zero header.
            let torn =
                newest && (bytes.len() < SEGMENT_HEADER_LEN || bytes.iter().all(|&b| b == 0));
            let end = if torn {
                ScanEnd::TornTail { offset: 0, reason }
            } else {
                ScanEnd::Corrupt { offset: 0, reason }
            };
            return SegmentScan {
                header: None,
                frames: Vec::new(),
                end,
            };
        }
    };
    let mut frames = Vec::new();
    let mut offset = SEGMENT_HEADER_LEN;
    let end = loop {
        if offset == bytes.len() {
            break ScanEnd::Clean;
        }
        let rest = &bytes[offset..];
        match decode_frame(rest) {
            Ok((kind, ops, len)) => {
                frames.push(Frame {
                    offset: offset as u64,
                    len: len as u64,
                    kind,
                    ops,
                });
                offset += len;
            }
            Err(reason) => {
                let offset = offset as u64;
                break if newest && is_torn(rest, &reason) {
                    ScanEnd::TornTail { offset, reason }
                } else {
                    ScanEnd::Corrupt { offset, reason }
                };
            }
        }
    };
    SegmentScan {
        header: Some(header),
        frames,
        end,
    }
}

/// Whether a bad frame at the start of `rest` (which runs to the end of the file) is
/// what a crash mid-append leaves.
fn is_torn(rest: &[u8], reason: &FrameError) -> bool {
    if rest.iter().all(|&b| b == 0) {
        return true;
    }
    match reason {
        FrameError::Truncated { .. } => true,
        // A complete frame that fails its CRC is torn only if nothing follows it.
        FrameError::Checksum { .. } => {
            let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            FRAME_HEADER_LEN + len == rest.len()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::{ProcError, ProcState};
    use crate::record::Failure;
    use proptest::prelude::*;

    fn record(id: u64, parent: Option<u64>, data: Vec<u8>) -> ProcRecord {
        ProcRecord {
            id: ProcId(id),
            parent: parent.map(ProcId),
            root: ProcId(parent.map_or(id, |_| 1)),
            type_name: "t".into(),
            state: ProcState::Runnable,
            stack_indexes: vec![0, 3],
            failure: Some(Failure {
                proc: ProcId(id),
                type_name: "t".into(),
                error: ProcError::Aborted,
            }),
            failure_seq: Some(0),
            submitted_ms: 1,
            updated_ms: 2,
            wake_at_ms: Some(3),
            event: Some("e".into()),
            data,
        }
    }

    fn segment(frames: &[Vec<StoreOp>]) -> Vec<u8> {
        let mut bytes = segment_header(7, 99).to_vec();
        for ops in frames {
            encode_frame(FrameKind::Batch, ops, &mut bytes).unwrap();
        }
        bytes
    }

    fn sample() -> Vec<Vec<StoreOp>> {
        vec![
            vec![StoreOp::Insert(record(1, None, vec![1, 2, 3]))],
            vec![
                StoreOp::Update(record(1, None, vec![4])),
                StoreOp::Insert(record(2, Some(1), vec![])),
            ],
            vec![StoreOp::Delete(ProcId(2))],
        ]
    }

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let h = segment_header(42, 7);
        assert_eq!(
            parse_segment_header(&h),
            Ok(SegmentHeader { seq: 42, max_id: 7 })
        );
        let cases: [(usize, &str); 3] = [
            (0, "bad magic"),
            (12, "checksum mismatch"),
            (29, "checksum mismatch"),
        ];
        for (byte, text) in cases {
            let mut bad = h;
            bad[byte] ^= 0x40;
            let err = parse_segment_header(&bad).unwrap_err().to_string();
            assert!(err.contains(text), "byte {byte}: {err}");
        }
    }

    #[test]
    fn clean_segment_scans_every_frame() {
        let bytes = segment(&sample());
        let scan = scan_segment(&bytes, true);
        assert_eq!(scan.header, Some(SegmentHeader { seq: 7, max_id: 99 }));
        assert_eq!(scan.end, ScanEnd::Clean);
        let ops: Vec<Vec<StoreOp>> = scan.frames.iter().map(|f| f.ops.clone()).collect();
        assert_eq!(ops, sample());
        assert_eq!(scan.frames[0].offset, SEGMENT_HEADER_LEN as u64);
    }

    /// What a scan says about damage at each kind of place.
    #[test]
    fn torn_tails_versus_corruption() {
        let good = segment(&sample());
        let last_frame = scan_segment(&good, true).frames[2].offset as usize;
        let mid_frame = scan_segment(&good, true).frames[1].offset as usize;
        type Damage = fn(&mut Vec<u8>, usize, usize);
        let cases: [(&str, Damage, bool, &str); 7] = [
            (
                "cut in the last frame",
                |b, last, _| b.truncate(last + 5),
                true,
                "torn",
            ),
            (
                "zero-filled tail",
                |b, _, _| b.extend([0u8; 4096]),
                true,
                "torn",
            ),
            (
                "last frame's payload flipped",
                |b, _, _| {
                    let n = b.len() - 1;
                    b[n] ^= 1
                },
                true,
                "torn",
            ),
            (
                "middle frame flipped",
                |b, _, mid| b[mid + FRAME_HEADER_LEN + 2] ^= 1,
                true,
                "corrupt",
            ),
            (
                "last frame cut, older segment",
                |b, last, _| b.truncate(last + 3),
                false,
                "corrupt",
            ),
            (
                "garbage after good frames",
                |b, _, _| b.extend([9u8; 20]),
                true,
                "corrupt",
            ),
            (
                "header zeroed, newest",
                |b, _, _| b.iter_mut().for_each(|x| *x = 0),
                true,
                "torn",
            ),
        ];
        for (name, damage, newest, expect) in cases {
            let mut bytes = good.clone();
            damage(&mut bytes, last_frame, mid_frame);
            let scan = scan_segment(&bytes, newest);
            let got = match &scan.end {
                ScanEnd::Clean => "clean",
                ScanEnd::TornTail { .. } => "torn",
                ScanEnd::Corrupt { .. } => "corrupt",
            };
            assert_eq!(got, expect, "{name}: {:?}", scan.end);
        }
    }

    #[test]
    fn decoded_records_are_checked() {
        let bad = StoreOp::Insert(ProcRecord {
            root: ProcId(9),
            ..record(1, None, vec![])
        });
        assert!(check_op(&bad)
            .unwrap_err()
            .contains("parent None but root 9"));
        // Write it behind the encoder's back: the decoder reports corruption.
        let payload = rmp_serde::to_vec(&vec![bad]).unwrap();
        let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
        frame.push(1);
        let crc = frame_crc(&frame, &payload);
        frame.extend(crc.to_le_bytes());
        frame.extend(payload);
        assert!(matches!(decode_frame(&frame), Err(FrameError::Payload(_))));
    }

    fn arb_op() -> impl Strategy<Value = StoreOp> {
        (
            1u64..1000,
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..64),
            0u8..3,
        )
            .prop_map(|(id, child, data, tag)| {
                let r = record(id + 1, child.then_some(1), data);
                match tag {
                    0 => StoreOp::Insert(r),
                    1 => StoreOp::Update(r),
                    _ => StoreOp::Delete(ProcId(id)),
                }
            })
    }

    proptest! {
        /// Random frames, then a random cut or flipped byte: decoding never panics, and
        /// a damaged frame is never returned as good with different contents.
        #[test]
        fn damaged_frames_never_decode_wrong(
            frames in prop::collection::vec(prop::collection::vec(arb_op(), 1..5), 1..6),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
            truncate in any::<bool>(),
        ) {
            let good = segment(&frames);
            let mut bytes = good.clone();
            if truncate {
                bytes.truncate(cut.index(bytes.len()));
            } else {
                let i = flip.index(bytes.len());
                bytes[i] ^= 1 << bit;
            }
            for newest in [true, false] {
                let scan = scan_segment(&bytes, newest);
                // Every frame the scan calls good is one that was written, in order.
                for (i, frame) in scan.frames.iter().enumerate() {
                    prop_assert_eq!(&frame.ops, &frames[i]);
                }
                if bytes == good {
                    prop_assert_eq!(scan.end, ScanEnd::Clean);
                } else if scan.header.is_some() {
                    prop_assert!(scan.end != ScanEnd::Clean || scan.frames.len() < frames.len());
                }
            }
        }
    }
}
