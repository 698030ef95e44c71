//! The write-ahead log's byte format: segment headers, frames, and the scan that tells
//! a torn tail from corruption. Pure: bytes (or a reader) in, values out. The file
//! handling lives in `actors/wal_store/`; the `proctor` command reads logs through it.
//!
//! # Format (version 6; versions 2 to 5 are read too)
//!
//! A WAL is a directory of segment files named `{seq:020}.wal` (exactly twenty decimal
//! digits), `seq` counting up from 1 with no gaps: segments are only ever deleted oldest
//! first, and the log says which segment it begins at (see *Where the log begins*), so
//! a missing number is damage. Any other file whose name ends in `.wal`, or a segment
//! name that is not a regular file, is refused. Integers are little-endian.
//!
//! ```text
//! segment  := header frame* seal?
//! header   := magic "PRCTRWAL" (8) | version u16 (4) | reserved u16 (0) | seq u64
//!             | max_id u64 | first_lsn u64 | crc32c u32 of the preceding 36 bytes
//!                                                                      = 40 bytes
//! frame    := len u32 | kind u8 | lsn u64 | header_crc u32 | payload_crc u32
//!             | payload (len bytes)                               = 21 + len bytes
//!             header_crc  = crc32c(len | kind | lsn)
//!             payload_crc = crc32c(payload)
//! kind     := 1 batch       (one group-committed append)
//!           | 2 checkpoint  (latest records rewritten forward by compaction)
//!           | 3 seal        (len 0: the segment is complete; it is always the last frame)
//!           | 4 start       (len 8: the segment the log begins at; format 4 on)
//!           | 5 stop        (how the engine stopped; format 4 on)
//! payload  := ops (batch, checkpoint) | nothing (seal) | first u64 (start)
//!           | 0 u8 (stop: an engine runs) | 1 u8, id u64* (stop: drained, see below)
//! ops      := MessagePack array of ops, each a one-entry map {tag: body}:
//!             "Insert" | "Update" → ProcRecord (an array of its fields, `id` first)
//!           | "Delete" → ProcId
//! ```
//!
//! Version 3 added the fifth field of a record's steering, `wakes_per_child`; a
//! version 2 record's steering has four, and reads as not woken per child. Version 4
//! added the start frame; a start frame in a segment of an older version is corruption.
//! Version 5 added the sixth field of a record's steering, `failed_step` (a step's
//! undo as one byte: 0 completed, 1 failed, 2 interrupted); older records read as 0.
//! Version 6 added a record's twentieth field, `nonce_fingerprint` (nil, or the
//! fingerprint of a root's submission with a nonce); older records have nineteen and
//! read as nil.
//! A log may hold segments of several versions: a store appends only to a segment of
//! its own version, so opening a log whose newest segment is older rolls to a new one
//! first (and an older build refuses that segment by its header).
//!
//! A scan indexes each payload without decoding it ([`index_payload`]: each op's tag,
//! the first field of its record, and its length), so that recovery decodes only the
//! latest record of each procedure and compaction copies records forward as they are.
//! That decoding reads a record in the writer's form directly (serde only for its rare
//! fields: a failure, locks, a nonce, a paused or retried steering) and hands any other
//! form to rmp-serde, which gives the same record. The writer's form is written the
//! same way ([`encode_op`]): byte for byte what rmp-serde writes, without its generic
//! machinery for the fields every record has.
//!
//! One frame is one `append` of the store, so a frame is the unit of atomicity: a crash
//! leaves either the whole frame or a torn one, which recovery drops. A record is a full
//! snapshot of one procedure ([`ProcRecord`]); the latest record per procedure wins and
//! a `Delete` removes it. `max_id` is the highest procedure id written before the
//! segment was created, so ids are never reused even after the segments that held the
//! highest ones are deleted.
//!
//! # Order and completeness
//!
//! Every frame (seals and checkpoints included) carries a log sequence number, `lsn`,
//! consecutive across the whole log: the first frame of a segment has the header's
//! `first_lsn`, each later frame the previous one's plus one, and a segment's
//! `first_lsn` is one more than the LSN of the previous segment's seal. A frame with a
//! good checksum but the wrong LSN (frames swapped, or a stale frame) is corruption.
//!
//! A segment is **sealed** when the writer rolls: it creates segment N+1 first (header
//! synced, directory synced), then appends a seal frame to N and syncs it. So:
//!
//! - every segment but the newest ends with its seal; an unsealed older segment was cut
//!   (even at a frame boundary) and is corruption;
//! - a sealed newest segment means its successor existed and is gone: corruption naming
//!   the missing file;
//! - a newest segment with no frames beside an unsealed predecessor is the trace of a
//!   crash mid-roll: it is deleted and the predecessor is the newest segment again (its
//!   tail may be torn by the unsynced seal).
//!
//! # Where the log begins
//!
//! Compaction deletes segments from the oldest end, so the lowest segment file is not
//! always segment 1, and a lost oldest file would look like a log that begins later.
//! So the log says where it begins: before the store deletes segments it appends (and
//! syncs) a **start** frame holding the number of the first segment it keeps, and only
//! then deletes the segments below it and syncs the directory. The newest start frame
//! (the one with the highest LSN) says where the log begins:
//!
//! - segment files below it are leftovers of a deletion a crash interrupted: no part of
//!   the log (nothing in them counts, damage included), and opening removes them, as a
//!   reported repair, and syncs the directory;
//! - from it on, every number up to the newest segment must be there: a lowest segment
//!   file above it is a missing oldest segment, corruption naming the missing file,
//!   exactly as a missing middle segment is;
//! - a log with no start frame begins at segment 1, unless its oldest segment was
//!   written by a format before 4, which recorded no start: then it begins at its
//!   oldest segment (a loss below that cannot be seen), and the first store of this
//!   format that opens it appends a start frame saying so;
//! - a start frame names a segment no later than its own, and never an earlier one than
//!   a start frame before it; anything else is corruption.
//!
//! # How the engine stopped
//!
//! A graceful shutdown that drained every call appends, as its last write, a **stop**
//! frame saying so (tag 1), with the ids of the procedures an earlier crash may still
//! have cut off ([`LastStop::Drained`]); the next engine appends one with tag 0 before
//! anything runs. The log ended drained when its newest stop frame has tag 1 and no
//! batch frame follows it (checkpoints, start frames and seals say nothing of steps);
//! otherwise, and in a log with no stop frame, any step may have been cut off
//! ([`LastStop::Unknown`]). A torn stop frame is truncated like any torn tail, and a
//! stop frame lost with a segment compaction deleted leaves the safe answer.
//!
//! A start frame is an ordinary frame of the append path (its own LSN, synced before
//! anything relies on it, never after a seal), so a crash can tear it as it tears any
//! last frame, and a torn start frame was followed by no deletion.
//!
//! # Torn tail or corruption
//!
//! Appends are serialised, so at most one frame — the last — can be unsynced at a crash.
//! Only the end of the newest segment can be torn, and a torn tail never has a good frame
//! after it. At the first bad frame of the newest segment, at offset `o`:
//!
//! - fewer than 21 bytes left, or a good header (its CRC matches) whose payload runs past
//!   the end of the file: torn;
//! - a bad header CRC, or a good header with a bad payload CRC: torn only if no **valid
//!   frame** starts anywhere after `o` (a forward scan of the remaining bytes, done only
//!   on this error path); a valid frame has a matching header CRC, a payload that fits
//!   and matches its CRC, and an LSN above the last good one. If one does, the bad frame
//!   is corruption at `o`: acknowledged frames follow it;
//! - a good header and payload that break a rule no writer breaks (unknown kind, length
//!   above [`MAX_PAYLOAD_LEN`], wrong LSN, undecodable payload, an id above [`MAX_ID`],
//!   bytes after a seal): corruption.
//!
//! A torn tail is truncated at `o` and reported; any damage anywhere else (an older
//! segment, a bad header of a segment that is not the interrupted newest one) is
//! corruption: recovery stops with the file and byte offset rather than silently drop
//! acknowledged steps. A segment header is synced before anything relies on the
//! segment, so a short or all-zero header (with no valid frame after it) is a torn
//! creation only where a crash can leave one: the first segment of a new log, or the
//! empty newest segment of an interrupted roll (removed as above); anywhere else it is
//! corruption, and so is a header whose `seq` disagrees with the file name.
//!
//! # Limits
//!
//! Ids and `max_id` above [`MAX_ID`] (`u64::MAX / 2`) are corruption, so the id counter
//! can never wrap. A scan streams a segment frame by frame and allocates only what a
//! frame with a matching header CRC claims, so a huge or sparse file costs no memory.

use std::io::{self, Read, Seek, SeekFrom};
use std::sync::Arc;

use serde::Deserialize;

use crate::procedure::{ProcId, ProcState};
use crate::record::{ProcRecord, Steering, StoreOp};
use crate::store::LastStop;

/// The first eight bytes of every segment.
pub const MAGIC: [u8; 8] = *b"PRCTRWAL";
/// The format version this code writes. It reads this one down to [`OLDEST_READ`]:
/// format 6 added a record's last field (`nonce_fingerprint`), which older records lack
/// and read as `None`; format 5 added a field to a record's steering (`failed_step`), which older records
/// lack and read as [`Undo::Completed`](crate::Undo::Completed); format 4 added the start frame ([`FrameKind::Start`]);
/// format 3 added a field to a record's steering (`wakes_per_child`), which format 2
/// records lack and read as `false`.
pub const VERSION: u16 = 6;
/// The oldest format version this code reads.
pub const OLDEST_READ: u16 = 2;
/// The first format version with start frames: a log whose oldest segment is older
/// recorded no start.
pub const FIRST_WITH_START: u16 = 4;
/// Payload bytes of a start frame: the segment number, a `u64`.
pub const START_PAYLOAD_LEN: u32 = 8;
/// Bytes in a segment header.
pub const SEGMENT_HEADER_LEN: usize = 40;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 21;
/// The largest payload a frame may carry; a larger `len` is corruption.
pub const MAX_PAYLOAD_LEN: u32 = 1 << 30;
/// The highest procedure id (and segment `max_id`) a log may hold. Ids count up from 1,
/// so the engine never gets near it; a larger value is damage, refused so that the id
/// counter can never wrap.
pub const MAX_ID: u64 = u64::MAX / 2;

/// The largest segment sequence number and first LSN a segment header may carry: far
/// beyond what any writer reaches (2^63 appends), and low enough that counting on from
/// them never overflows, whatever a damaged or crafted file says.
pub const MAX_SEQ_OR_LSN: u64 = u64::MAX / 2;

/// What a frame holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// One group-committed append.
    Batch = 1,
    /// Latest records rewritten forward by compaction.
    Checkpoint = 2,
    /// The end of a complete segment: its successor exists.
    Seal = 3,
    /// Where the log begins: the segments below the one it names are being deleted.
    Start = 4,
    /// How the engine stopped (see *How the engine stopped* in the module docs).
    Stop = 5,
}

impl FrameKind {
    fn from_byte(b: u8) -> Option<FrameKind> {
        match b {
            1 => Some(FrameKind::Batch),
            2 => Some(FrameKind::Checkpoint),
            3 => Some(FrameKind::Seal),
            4 => Some(FrameKind::Start),
            5 => Some(FrameKind::Stop),
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
    /// A checksum does not match.
    #[error("{what} checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Which checksum: the segment header's, a frame header's or a payload's.
        what: &'static str,
        /// The CRC in the file.
        stored: u32,
        /// The CRC of the bytes.
        computed: u32,
    },
    /// An unknown frame kind.
    #[error("corrupt frame: unknown kind {0}")]
    Kind(u8),
    /// A length no writer produces.
    #[error("corrupt frame: length {0} exceeds the maximum or does not fit its kind")]
    Length(u32),
    /// A frame out of order: the log is not a consecutive run of LSNs.
    #[error("frame out of order: LSN {found}, expected {expected}")]
    Lsn {
        /// The frame's LSN.
        found: u64,
        /// The LSN that must come here.
        expected: u64,
    },
    /// Bytes after a segment's seal.
    #[error("data after the segment's seal frame")]
    AfterSeal,
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
    /// The LSN of the segment's first frame (the next LSN, while it has none).
    pub first_lsn: u64,
    /// The format version it was written in (a store appends only to a segment of
    /// this build's [`VERSION`]).
    pub version: u16,
}

/// A segment header for segment `seq`.
pub fn segment_header(seq: u64, max_id: u64, first_lsn: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&seq.to_le_bytes());
    h[20..28].copy_from_slice(&max_id.to_le_bytes());
    h[28..36].copy_from_slice(&first_lsn.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..36]);
    h[36..40].copy_from_slice(&crc.to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Parses a segment header.
///
/// # Errors
/// [`FrameError::Truncated`] for fewer than [`SEGMENT_HEADER_LEN`] bytes;
/// [`FrameError::Checksum`] for a bad CRC; [`FrameError::Header`] for a bad magic,
/// another version, a `max_id` above [`MAX_ID`], or a `seq` or `first_lsn` that is zero
/// or above [`MAX_SEQ_OR_LSN`].
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
    let version = u16::from_le_bytes([h[8], h[9]]);
    if !(OLDEST_READ..=VERSION).contains(&version) {
        return Err(FrameError::Header(format!(
            "format version {version}, this build reads {OLDEST_READ} to {VERSION}"
        )));
    }
    let stored = u32_at(h, 36);
    let computed = crc32c::crc32c(&h[0..36]);
    if stored != computed {
        return Err(FrameError::Checksum {
            what: "segment header",
            stored,
            computed,
        });
    }
    let header = SegmentHeader {
        seq: u64_at(h, 12),
        max_id: u64_at(h, 20),
        first_lsn: u64_at(h, 28),
        version,
    };
    if header.max_id > MAX_ID {
        return Err(FrameError::Header(format!(
            "max_id {} is above the limit {MAX_ID}",
            header.max_id
        )));
    }
    if header.seq == 0 || header.first_lsn == 0 {
        return Err(FrameError::Header(
            "sequence number and first LSN start at 1".into(),
        ));
    }
    if header.seq > MAX_SEQ_OR_LSN || header.first_lsn > MAX_SEQ_OR_LSN {
        return Err(FrameError::Header(format!(
            "sequence number {} or first LSN {} is above the limit {MAX_SEQ_OR_LSN}",
            header.seq, header.first_lsn
        )));
    }
    Ok(header)
}

/// What a frame header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload bytes.
    pub len: u32,
    /// What the frame holds.
    pub kind: FrameKind,
    /// Its log sequence number.
    pub lsn: u64,
    /// The CRC its payload must have.
    pub payload_crc: u32,
}

/// Parses a frame header: its own CRC first, so that nothing a damaged header claims
/// (a length, a kind) is believed.
///
/// # Errors
/// [`FrameError::Truncated`] for fewer than [`FRAME_HEADER_LEN`] bytes;
/// [`FrameError::Checksum`] for a bad header CRC; [`FrameError::Kind`] for an unknown
/// kind; [`FrameError::Length`] for a length above [`MAX_PAYLOAD_LEN`], a seal with a
/// payload, or a start frame whose payload is not [`START_PAYLOAD_LEN`] bytes.
pub fn parse_frame_header(h: &[u8]) -> Result<FrameHeader, FrameError> {
    if h.len() < FRAME_HEADER_LEN {
        return Err(FrameError::Truncated {
            need: FRAME_HEADER_LEN as u64,
            have: h.len() as u64,
        });
    }
    let stored = u32_at(h, 13);
    let computed = crc32c::crc32c(&h[0..13]);
    if stored != computed {
        return Err(FrameError::Checksum {
            what: "frame header",
            stored,
            computed,
        });
    }
    let len = u32_at(h, 0);
    let kind = FrameKind::from_byte(h[4]).ok_or(FrameError::Kind(h[4]))?;
    let fits_kind = match kind {
        FrameKind::Seal => len == 0,
        FrameKind::Start => len == START_PAYLOAD_LEN,
        FrameKind::Stop => len % 8 == 1,
        FrameKind::Batch | FrameKind::Checkpoint => true,
    };
    if len > MAX_PAYLOAD_LEN || !fits_kind {
        return Err(FrameError::Length(len));
    }
    Ok(FrameHeader {
        len,
        kind,
        lsn: u64_at(h, 5),
        payload_crc: u32_at(h, 17),
    })
}

fn write_frame_header(out: &mut [u8], len: u32, kind: FrameKind, lsn: u64, payload_crc: u32) {
    out[0..4].copy_from_slice(&len.to_le_bytes());
    out[4] = kind as u8;
    out[5..13].copy_from_slice(&lsn.to_le_bytes());
    let crc = crc32c::crc32c(&out[0..13]);
    out[13..17].copy_from_slice(&crc.to_le_bytes());
    out[17..21].copy_from_slice(&payload_crc.to_le_bytes());
}

/// Gives the encoded frame at the start of `frame` a new LSN (the writer learns whether
/// a roll takes an LSN for a seal only after encoding).
///
/// # Panics
/// If `frame` is shorter than [`FRAME_HEADER_LEN`].
pub fn set_frame_lsn(frame: &mut [u8], lsn: u64) {
    let len = u32_at(frame, 0);
    let payload_crc = u32_at(frame, 17);
    let kind = FrameKind::from_byte(frame[4]).unwrap_or(FrameKind::Batch);
    write_frame_header(frame, len, kind, lsn, payload_crc);
}

/// Checks what every stored record must satisfy. Used before encoding (a failure is a
/// bug in the engine) and after decoding (a failure is corruption).
///
/// # Errors
/// A message naming the procedure: its `parent` and `root` disagree (a record has no
/// parent exactly when it is its own root), its type name is empty, its id is 0, or an
/// id in it is above [`MAX_ID`].
pub fn check_op(op: &StoreOp) -> Result<(), String> {
    match op {
        StoreOp::Insert(r) | StoreOp::Update(r) => check_record(r),
        StoreOp::Delete(id) => check_id(*id),
    }
}

fn check_id(id: ProcId) -> Result<(), String> {
    if id.0 > MAX_ID {
        return Err(format!("procedure id {id} is above the limit {MAX_ID}"));
    }
    Ok(())
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
    check_id(r.id)?;
    check_id(r.root)?;
    r.parent.map_or(Ok(()), check_id)
}

/// Appends one frame holding `ops` with LSN `lsn` to `out`, and returns the encoded
/// size of each op (what the store counts as a record's live bytes). A seal takes no
/// ops.
///
/// # Errors
/// The encoder's error if an op does not serialize, or
/// [`Syntax`](rmp_serde::encode::Error::Syntax) if the payload is above
/// [`MAX_PAYLOAD_LEN`]; `out` then ends with a partial frame.
///
/// # Panics
/// If an op breaks a record invariant ([`check_op`]) or a seal is given ops: the engine
/// made a bad record.
pub fn encode_frame(
    kind: FrameKind,
    lsn: u64,
    ops: &[StoreOp],
    out: &mut Vec<u8>,
) -> Result<Vec<u32>, rmp_serde::encode::Error> {
    for op in ops {
        if let Err(e) = check_op(op) {
            panic!("refusing to write a bad record: {e}");
        }
    }
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    let mut sizes = Vec::with_capacity(ops.len());
    assert!(
        !matches!(kind, FrameKind::Start | FrameKind::Stop),
        "start and stop frames are written by encode_start_frame and encode_stop_frame"
    );
    if kind == FrameKind::Seal {
        assert!(ops.is_empty(), "a seal frame holds no ops");
    } else {
        put_array_len(out, ops.len())?;
        for op in ops {
            let before = out.len();
            encode_op(op, out)?;
            sizes.push(u32::try_from(out.len() - before).unwrap_or(u32::MAX));
        }
    }
    finish_frame(kind, lsn, start, out)?;
    Ok(sizes)
}

/// Appends a start frame with LSN `lsn` to `out`: the log begins at segment `first`
/// (see *Where the log begins* in the module docs).
pub fn encode_start_frame(lsn: u64, first: u64, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    out.extend_from_slice(&first.to_le_bytes());
    // Eight payload bytes are far below the maximum, so finishing cannot fail.
    let _ = finish_frame(FrameKind::Start, lsn, start, out);
}

/// Appends a stop frame with LSN `lsn` to `out`: how the engine stopped (see *How the
/// engine stopped* in the module docs).
///
/// # Errors
/// A drained stop that names more procedures than a frame can hold (`out` is left as
/// it was).
pub fn encode_stop_frame(
    lsn: u64,
    stop: &LastStop,
    out: &mut Vec<u8>,
) -> Result<(), rmp_serde::encode::Error> {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    match stop {
        LastStop::Unknown => out.push(0),
        LastStop::Drained { cut_off } => {
            out.push(1);
            for id in cut_off {
                out.extend_from_slice(&id.0.to_le_bytes());
            }
        }
    }
    finish_frame(FrameKind::Stop, lsn, start, out).inspect_err(|_| out.truncate(start))
}

/// What a stop frame's payload says, if it is one: tag 0, or tag 1 and ids.
pub fn stop_of(payload: &[u8]) -> Option<LastStop> {
    match payload.split_first()? {
        (0, []) => Some(LastStop::Unknown),
        (1, ids) if ids.len() % 8 == 0 => Some(LastStop::Drained {
            cut_off: ids.chunks_exact(8).map(|b| ProcId(u64_at(b, 0))).collect(),
        }),
        _ => None,
    }
}

/// The segment a start frame's payload names, if the payload is one: exactly
/// [`START_PAYLOAD_LEN`] bytes.
pub fn start_of(payload: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = payload.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// Fills in the header of the frame that starts at `out[start]` and runs to the end.
fn finish_frame(
    kind: FrameKind,
    lsn: u64,
    start: usize,
    out: &mut [u8],
) -> Result<(), rmp_serde::encode::Error> {
    let payload_len = out.len() - start - FRAME_HEADER_LEN;
    let len = u32::try_from(payload_len)
        .ok()
        .filter(|&l| l <= MAX_PAYLOAD_LEN)
        .ok_or_else(|| {
            rmp_serde::encode::Error::Syntax(format!("frame of {payload_len} bytes is too large"))
        })?;
    let payload_crc = crc32c::crc32c(&out[start + FRAME_HEADER_LEN..]);
    write_frame_header(
        &mut out[start..start + FRAME_HEADER_LEN],
        len,
        kind,
        lsn,
        payload_crc,
    );
    Ok(())
}

/// Appends one frame to `out` whose ops are already encoded (each as [`encode_frame`]
/// would encode it): what compaction writes when it copies records forward.
///
/// # Errors
/// [`Syntax`](rmp_serde::encode::Error::Syntax) if the payload is above
/// [`MAX_PAYLOAD_LEN`]; `out` then ends with a partial frame.
pub fn encode_raw_frame<'a>(
    kind: FrameKind,
    lsn: u64,
    ops: impl ExactSizeIterator<Item = &'a [u8]>,
    out: &mut Vec<u8>,
) -> Result<(), rmp_serde::encode::Error> {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    let count = ops.len();
    match u16::try_from(count) {
        Ok(n) if n < 16 => out.push(0x90 | n as u8),
        Ok(n) => {
            out.push(0xdc);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Err(_) => {
            let n = u32::try_from(count).map_err(|_| {
                rmp_serde::encode::Error::Syntax(format!("{count} ops in one frame"))
            })?;
            out.push(0xdd);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
    for op in ops {
        out.extend_from_slice(op);
    }
    finish_frame(kind, lsn, start, out)
}

/// Decodes a payload that passed its CRC: its ops and the encoded size of each. The
/// scan's path ([`index_payload`], then [`RawOp::decode`] of each op), on a copy.
///
/// # Errors
/// [`FrameError::Payload`] if it is not a MessagePack array of ops, claims more ops than
/// its bytes can hold, has an op that does not decode or fails [`check_op`], or has
/// bytes after the last op.
pub fn decode_payload(
    kind: FrameKind,
    payload: &[u8],
) -> Result<(Vec<StoreOp>, Vec<u32>), FrameError> {
    let raw = index_payload(kind, Arc::new(payload.to_vec()))?;
    let ops = raw.iter().map(RawOp::decode).collect::<Result<_, _>>()?;
    Ok((ops, raw.iter().map(RawOp::size).collect()))
}

/// Decodes the frame at the start of `bytes`: its header, its ops, and its total length.
///
/// # Errors
/// [`parse_frame_header`]'s; [`FrameError::Truncated`] if `bytes` end before the
/// payload does; [`FrameError::Checksum`] for a bad payload CRC; [`decode_payload`]'s.
pub fn decode_frame(bytes: &[u8]) -> Result<(FrameHeader, Vec<StoreOp>, usize), FrameError> {
    let header = parse_frame_header(bytes)?;
    let total = FRAME_HEADER_LEN + header.len as usize;
    if bytes.len() < total {
        return Err(FrameError::Truncated {
            need: total as u64,
            have: bytes.len() as u64,
        });
    }
    let payload = &bytes[FRAME_HEADER_LEN..total];
    let computed = crc32c::crc32c(payload);
    if header.payload_crc != computed {
        return Err(FrameError::Checksum {
            what: "payload",
            stored: header.payload_crc,
            computed,
        });
    }
    let (ops, _) = decode_payload(header.kind, payload)?;
    Ok((header, ops, total))
}

/// What an op does, read from its tag without decoding its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// [`StoreOp::Insert`].
    Insert,
    /// [`StoreOp::Update`].
    Update,
    /// [`StoreOp::Delete`].
    Delete,
}

impl OpKind {
    /// The kind of `op`.
    pub fn of(op: &StoreOp) -> OpKind {
        match op {
            StoreOp::Insert(_) => OpKind::Insert,
            StoreOp::Update(_) => OpKind::Update,
            StoreOp::Delete(_) => OpKind::Delete,
        }
    }
}

/// One op of a frame as a scan indexes it: its kind, its procedure and its bytes, not
/// decoded. Recovery keeps the latest op of each procedure this way and decodes only
/// those: a record that a later one supersedes is never decoded.
#[derive(Clone, Debug)]
pub struct RawOp {
    /// What it does.
    pub kind: OpKind,
    /// The procedure it is about.
    pub id: ProcId,
    /// The root its record names, as the index read it: for a delete (which names no
    /// root), or a record too short or in another form for the index to read its root,
    /// its own id. Only the decoded record is sure.
    pub root: ProcId,
    payload: Arc<Vec<u8>>,
    start: u32,
    len: u32,
}

impl RawOp {
    /// Its encoding.
    pub fn bytes(&self) -> &[u8] {
        &self.payload[self.start as usize..(self.start + self.len) as usize]
    }

    /// Its encoded size in bytes (what the store counts as a record's live bytes).
    pub fn size(&self) -> u32 {
        self.len
    }

    /// Decodes it.
    ///
    /// # Errors
    /// [`FrameError::Payload`] if it does not decode, fails [`check_op`], or decodes to
    /// another kind or procedure than its index said.
    pub fn decode(&self) -> Result<StoreOp, FrameError> {
        let bad = |what: String| FrameError::Payload(what);
        let op = decode_op(self.bytes())?;
        check_op(&op).map_err(bad)?;
        let kind = OpKind::of(&op);
        if (kind, op.proc_id()) != (self.kind, self.id) {
            return Err(bad(format!(
                "an op indexed as {:?} of procedure {} decodes as {kind:?} of {}",
                self.kind,
                self.id,
                op.proc_id()
            )));
        }
        Ok(op)
    }
}

/// Decodes one op encoded as a frame holds it (`rmp_serde`'s positional form): the
/// direct decoder, serde for any other form.
///
/// # Errors
/// [`FrameError::Payload`] if it does not decode.
pub fn decode_op(bytes: &[u8]) -> Result<StoreOp, FrameError> {
    match decode_op_fast(bytes) {
        Some(op) => Ok(op),
        None => rmp_serde::from_slice(bytes).map_err(|e| FrameError::Payload(e.to_string())),
    }
}

/// A good frame as a scan reads it: checked (header, LSN, payload CRC, the payload an
/// array of well-formed ops), its ops indexed but not decoded.
#[derive(Clone, Debug)]
pub struct RawFrame {
    /// Its byte offset in the segment file.
    pub offset: u64,
    /// Its total length in bytes, header included.
    pub len: u64,
    /// Its log sequence number.
    pub lsn: u64,
    /// What it holds.
    pub kind: FrameKind,
    /// Its ops, in order.
    pub ops: Vec<RawOp>,
}

impl RawFrame {
    /// Decodes every op.
    ///
    /// # Errors
    /// The first op's [`RawOp::decode`] error.
    pub fn decode(&self) -> Result<Frame, FrameError> {
        Ok(Frame {
            offset: self.offset,
            len: self.len,
            lsn: self.lsn,
            kind: self.kind,
            ops: self
                .ops
                .iter()
                .map(RawOp::decode)
                .collect::<Result<_, _>>()?,
            op_sizes: self.ops.iter().map(RawOp::size).collect(),
        })
    }
}

/// Indexes a payload that passed its CRC: each op's kind, procedure and byte range,
/// without decoding the records. The ops are in the form [`encode_frame`] writes (a
/// one-entry map from the tag to the body, a record a positional array whose first
/// element is its id); an op in another form that still decodes is indexed by decoding
/// it.
///
/// # Errors
/// [`FrameError::Payload`] if it is not a MessagePack array of ops, claims more ops than
/// its bytes can hold, has an op that is not well-formed MessagePack or not an op, has
/// an id above [`MAX_ID`], or has bytes after the last op.
pub fn index_payload(kind: FrameKind, payload: Arc<Vec<u8>>) -> Result<Vec<RawOp>, FrameError> {
    let whole = 0..payload.len();
    index_payload_in(kind, payload, whole)
}

/// [`index_payload`] of the payload at `range` of `buf`; the ops point into `buf`.
fn index_payload_in(
    kind: FrameKind,
    buf: Arc<Vec<u8>>,
    range: std::ops::Range<usize>,
) -> Result<Vec<RawOp>, FrameError> {
    if matches!(kind, FrameKind::Seal | FrameKind::Start | FrameKind::Stop) {
        return Ok(Vec::new());
    }
    if u32::try_from(range.end).is_err() {
        return Err(FrameError::Payload("a payload above 4 GiB".into()));
    }
    let base = range.start;
    let bytes = &buf[range];
    let (count, mut at) = array_header(bytes)?;
    // An op takes at least 9 bytes (`{"Delete": id}`): reserve no more than that allows,
    // whatever the header says (each op indexed takes 40 bytes).
    let mut ops = Vec::with_capacity(count.min(bytes.len() / 9));
    for i in 0..count {
        let (kind, id, root, end) = index_op(bytes, at)
            .map_err(|why| FrameError::Payload(format!("op {i} at payload byte {at}: {why}")))?;
        check_id(id).map_err(FrameError::Payload)?;
        ops.push(RawOp {
            kind,
            id,
            root,
            payload: Arc::clone(&buf),
            start: (base + at) as u32,
            len: (end - at) as u32,
        });
        at = end;
    }
    if at != bytes.len() {
        return Err(FrameError::Payload("bytes after the last op".into()));
    }
    Ok(ops)
}

/// The op count of a payload's array marker and where its first op starts.
fn array_header(payload: &[u8]) -> Result<(usize, usize), FrameError> {
    let bad = |what: String| FrameError::Payload(what);
    // The array marker: fixarray, array16 or array32.
    let (count, skip) = match payload.first() {
        Some(&m) if (0x90..=0x9f).contains(&m) => (usize::from(m & 0x0f), 1),
        Some(0xdc) if payload.len() >= 3 => {
            (usize::from(u16::from_be_bytes([payload[1], payload[2]])), 3)
        }
        Some(0xdd) if payload.len() >= 5 => (
            u32::from_be_bytes([payload[1], payload[2], payload[3], payload[4]]) as usize,
            5,
        ),
        _ => return Err(bad("not an array of ops".into())),
    };
    // Each op takes at least two bytes, so a count larger than that is damage, not a
    // reason to reserve memory.
    if count > payload.len() / 2 {
        return Err(bad(format!(
            "{count} ops cannot fit in {} bytes",
            payload.len()
        )));
    }
    Ok((count, skip))
}

/// The kind, procedure and end of the op at `at`: read from the tag and the record's
/// first field when the op has the form [`encode_frame`] writes, else decoded.
fn index_op(bytes: &[u8], at: usize) -> Result<(OpKind, ProcId, ProcId, usize), String> {
    if let Some(found) = index_op_fast(bytes, at) {
        return Ok(found);
    }
    let mut de = rmp_serde::Deserializer::new(io::Cursor::new(&bytes[at..]));
    let op = StoreOp::deserialize(&mut de).map_err(|e| e.to_string())?;
    let root = match &op {
        StoreOp::Insert(r) | StoreOp::Update(r) => r.root,
        StoreOp::Delete(id) => *id,
    };
    Ok((
        OpKind::of(&op),
        op.proc_id(),
        root,
        at + de.position() as usize,
    ))
}

fn index_op_fast(bytes: &[u8], at: usize) -> Option<(OpKind, ProcId, ProcId, usize)> {
    let mut r = MsgReader { bytes, at };
    if r.byte()? != 0x81 {
        return None;
    }
    let kind = match r.fixstr()? {
        b"Insert" => OpKind::Insert,
        b"Update" => OpKind::Update,
        b"Delete" => OpKind::Delete,
        _ => return None,
    };
    let (id, root) = if kind == OpKind::Delete {
        let id = r.uint()?;
        (id, id)
    } else {
        // The record's first fields: its id, its parent (nil or an id), its root. A
        // record too short or in another form to say its root is indexed as its own
        // root: decoding it tells (see `RawOp::root`).
        let fields = r.array_len()?;
        if fields == 0 {
            return None;
        }
        let id = r.uint()?;
        let after_id = r.at;
        let root = if fields >= 3 {
            r.nil_or(MsgReader::uint).and_then(|_| r.uint())
        } else {
            None
        };
        match root {
            Some(root) => {
                r.skip(fields - 3)?;
                (id, root)
            }
            None => {
                r.at = after_id;
                r.skip(fields - 1)?;
                (id, id)
            }
        }
    };
    Some((kind, ProcId(id), ProcId(root), r.at))
}

/// How many fields a record has in the form the writer uses (the positional array of
/// [`ProcRecord`]'s fields).
const RECORD_FIELDS: u64 = 20;
/// How many fields a record of formats 2 to 5 has: all but `nonce_fingerprint`.
const RECORD_FIELDS_5: u64 = 19;

/// A [`Steering`] with nothing in it, as serde writes it: retries 0, not paused, not
/// irreversible, not dirty, not woken per child, no failed step.
const DEFAULT_STEERING: [u8; 7] = [0x96, 0x00, 0xc0, 0xc2, 0xc2, 0xc2, 0x00];
/// The same in formats 3 and 4, before `failed_step`.
const DEFAULT_STEERING_3: [u8; 6] = [0x95, 0x00, 0xc0, 0xc2, 0xc2, 0xc2];
/// The same in format 2, before `wakes_per_child`.
const DEFAULT_STEERING_2: [u8; 5] = [0x94, 0x00, 0xc0, 0xc2, 0xc2];

/// Appends `op` to `out` in the writer's form: byte for byte what
/// `rmp_serde::to_vec(op)` writes (MessagePack, a record as the positional array of its
/// fields), which a property test holds it to. The fields every record has are written
/// directly; the rare ones (a failure, locks, a nonce, a steering that is not the
/// default) through serde. The WAL's frames and the memory store's records are encoded
/// with it: for a small record it costs a fraction of serde's generic path.
///
/// # Errors
/// [`Syntax`](rmp_serde::encode::Error::Syntax) for a string or byte field above 4 GiB;
/// serde's error for a rare field that does not serialize.
pub fn encode_op(op: &StoreOp, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
    out.push(0x81);
    match op {
        StoreOp::Insert(r) => {
            put_str(out, "Insert")?;
            put_record(out, r)
        }
        StoreOp::Update(r) => {
            put_str(out, "Update")?;
            put_record(out, r)
        }
        StoreOp::Delete(id) => {
            put_str(out, "Delete")?;
            put_uint(out, id.0);
            Ok(())
        }
    }
}

/// A record's 20 fields (see [`encode_op`]).
fn put_record(out: &mut Vec<u8>, r: &ProcRecord) -> Result<(), rmp_serde::encode::Error> {
    use rmp_serde::encode::write as serde;
    put_array_len(out, RECORD_FIELDS as usize)?;
    put_uint(out, r.id.0);
    put_opt_uint(out, r.parent.map(|p| p.0));
    put_uint(out, r.root.0);
    put_str(out, &r.type_name)?;
    match state_encodings().iter().find(|(_, s)| *s == r.state) {
        Some((encoding, _)) => out.extend_from_slice(encoding),
        None => serde(out, &r.state)?,
    }
    put_stack_runs(out, &r.stack_indexes)?;
    match &r.failure {
        Some(failure) => serde(out, failure)?,
        None => out.push(0xc0),
    }
    put_opt_uint(out, r.failure_seq);
    put_uint(out, r.submitted_ms);
    put_uint(out, r.updated_ms);
    put_opt_uint(out, r.wake_at_ms);
    match &r.event {
        Some(event) => put_str(out, event)?,
        None => out.push(0xc0),
    }
    put_bin(out, &r.data)?;
    match &r.locks {
        Some(locks) => serde(out, locks)?,
        None => out.push(0xc0),
    }
    put_opt_uint(out, r.deadline_ms);
    match &r.nonce {
        Some(nonce) => serde(out, nonce)?,
        None => out.push(0xc0),
    }
    match &r.result {
        Some(result) => put_bin(out, result)?,
        None => out.push(0xc0),
    }
    out.push(if r.bypassed { 0xc3 } else { 0xc2 });
    if r.steering == Steering::default() {
        out.extend_from_slice(&DEFAULT_STEERING);
    } else {
        serde(out, &r.steering)?;
    }
    put_opt_uint(out, r.nonce_fingerprint.map(|f| u64::from(f.get())));
    Ok(())
}

/// An unsigned integer in its shortest form, as rmp writes any integer serde gives it.
fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if let Ok(v) = u8::try_from(v) {
        out.extend_from_slice(&[0xcc, v]);
    } else if let Ok(v) = u16::try_from(v) {
        out.push(0xcd);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(v) {
        out.push(0xce);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn put_opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => put_uint(out, v),
        None => out.push(0xc0),
    }
}

/// A length above what MessagePack can say.
fn too_long(len: usize) -> rmp_serde::encode::Error {
    rmp_serde::encode::Error::Syntax(format!("a length of {len} does not fit MessagePack"))
}

/// A marker and a length: `small` (the fix form, which holds the length in the marker's
/// low bits) below `fix_max`, else the 8- (if `m8` is given), 16- or 32-bit form.
fn put_len(
    out: &mut Vec<u8>,
    len: usize,
    (small, fix_max): (u8, usize),
    m8: Option<u8>,
    (m16, m32): (u8, u8),
) -> Result<(), rmp_serde::encode::Error> {
    if len < fix_max {
        out.push(small | len as u8);
    } else if let (Some(m8), Ok(l)) = (m8, u8::try_from(len)) {
        out.extend_from_slice(&[m8, l]);
    } else if let Ok(l) = u16::try_from(len) {
        out.push(m16);
        out.extend_from_slice(&l.to_be_bytes());
    } else {
        let l = u32::try_from(len).map_err(|_| too_long(len))?;
        out.push(m32);
        out.extend_from_slice(&l.to_be_bytes());
    }
    Ok(())
}

fn put_array_len(out: &mut Vec<u8>, len: usize) -> Result<(), rmp_serde::encode::Error> {
    put_len(out, len, (0x90, 16), None, (0xdc, 0xdd))
}

fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), rmp_serde::encode::Error> {
    put_len(out, s.len(), (0xa0, 32), Some(0xd9), (0xda, 0xdb))?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_bin(out: &mut Vec<u8>, b: &[u8]) -> Result<(), rmp_serde::encode::Error> {
    // No fix form for bytes: every length takes the 8-, 16- or 32-bit form.
    put_len(out, b.len(), (0, 0), Some(0xc4), (0xc5, 0xc6))?;
    out.extend_from_slice(b);
    Ok(())
}

/// The stack indexes as `(first, count)` runs, as the record's serializer writes them.
fn put_stack_runs(out: &mut Vec<u8>, indexes: &[u32]) -> Result<(), rmp_serde::encode::Error> {
    let continues = |w: &[u32]| w[0].checked_add(1) == Some(w[1]);
    let runs =
        usize::from(!indexes.is_empty()) + indexes.windows(2).filter(|w| !continues(w)).count();
    put_array_len(out, runs)?;
    let mut rest = indexes;
    while let Some(&first) = rest.first() {
        let count = 1 + rest.windows(2).take_while(|w| continues(w)).count();
        out.push(0x92);
        put_uint(out, u64::from(first));
        put_uint(out, count as u64);
        rest = &rest[count..];
    }
    Ok(())
}

/// Decodes an op in the form the writer uses without serde's generic machinery: the
/// fields every record has are read directly, the rare ones (a failure, locks, a nonce,
/// a steering that is not the default) through serde from their own bytes. `None` for
/// any other form or anything unexpected: the caller then decodes the op through serde,
/// which gives the same op or the error. What this accepts, it decodes exactly as serde
/// does (a property test holds it to that).
fn decode_op_fast(bytes: &[u8]) -> Option<StoreOp> {
    let mut r = MsgReader { bytes, at: 0 };
    if r.byte()? != 0x81 {
        return None;
    }
    let op = match r.fixstr()? {
        b"Insert" => StoreOp::Insert(r.record()?),
        b"Update" => StoreOp::Update(r.record()?),
        b"Delete" => StoreOp::Delete(ProcId(r.uint()?)),
        _ => return None,
    };
    (r.at == bytes.len()).then_some(op)
}

/// The encoding of each [`ProcState`], as serde writes it, to compare a record's state
/// field against.
fn state_encodings() -> &'static [(Vec<u8>, ProcState)] {
    static STATES: std::sync::OnceLock<Vec<(Vec<u8>, ProcState)>> = std::sync::OnceLock::new();
    STATES.get_or_init(|| {
        [
            ProcState::Initializing,
            ProcState::Runnable,
            ProcState::Waiting,
            ProcState::WaitingTimeout,
            ProcState::RolledBack,
            ProcState::Success,
            ProcState::Failed,
            ProcState::Paused,
            ProcState::RollbackPaused,
        ]
        .into_iter()
        .filter_map(|s| Some((rmp_serde::to_vec(&s).ok()?, s)))
        .collect()
    })
}

impl MsgReader<'_> {
    /// A record in the writer's form (see [`decode_op_fast`]).
    fn record(&mut self) -> Option<ProcRecord> {
        let fields = self.array_len()?;
        if fields != RECORD_FIELDS && fields != RECORD_FIELDS_5 {
            return None;
        }
        Some(ProcRecord {
            id: ProcId(self.uint()?),
            parent: self.nil_or(Self::uint)?.map(ProcId),
            root: ProcId(self.uint()?),
            type_name: self.string()?.into(),
            state: self.state()?,
            stack_indexes: self.stack_runs()?,
            failure: self.nil_or(Self::serde)?,
            failure_seq: self.nil_or(Self::uint)?,
            submitted_ms: self.uint()?,
            updated_ms: self.uint()?,
            wake_at_ms: self.nil_or(Self::uint)?,
            event: self.nil_or(Self::string)?,
            data: self.bin()?,
            locks: self.nil_or(Self::serde)?,
            deadline_ms: self.nil_or(Self::uint)?,
            nonce: self.nil_or(Self::serde)?,
            result: self.nil_or(Self::bin)?,
            bypassed: self.bool()?,
            steering: self.steering()?,
            nonce_fingerprint: if fields == RECORD_FIELDS {
                self.nil_or(Self::non_zero_u32)?
            } else {
                None
            },
        })
    }

    /// `Some(None)` for nil, else the value `read` reads.
    fn nil_or<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.bytes.get(self.at) == Some(&0xc0) {
            self.at += 1;
            return Some(None);
        }
        read(self).map(Some)
    }

    /// The next value, decoded through serde from its own bytes.
    fn serde<T: serde::de::DeserializeOwned>(&mut self) -> Option<T> {
        let start = self.at;
        self.skip(1)?;
        rmp_serde::from_slice(&self.bytes[start..self.at]).ok()
    }

    fn string(&mut self) -> Option<String> {
        let len = match self.byte()? {
            m @ 0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => return None,
        };
        let bytes = self.take(usize::try_from(len).ok()?)?;
        String::from_utf8(bytes.to_vec()).ok()
    }

    fn bin(&mut self) -> Option<Vec<u8>> {
        let len = match self.byte()? {
            0xc4 => self.be(1)?,
            0xc5 => self.be(2)?,
            0xc6 => self.be(4)?,
            _ => return None,
        };
        Some(self.take(usize::try_from(len).ok()?)?.to_vec())
    }

    fn bool(&mut self) -> Option<bool> {
        match self.byte()? {
            0xc2 => Some(false),
            0xc3 => Some(true),
            _ => None,
        }
    }

    fn state(&mut self) -> Option<ProcState> {
        let rest = &self.bytes[self.at..];
        let (encoding, state) = state_encodings()
            .iter()
            .find(|(encoding, _)| rest.starts_with(encoding))?;
        self.at += encoding.len();
        Some(*state)
    }

    /// The stack indexes, stored as `(first, count)` runs, with the checks of the
    /// record's own decoder: `None` where it would refuse them.
    fn stack_runs(&mut self) -> Option<Vec<u32>> {
        let runs = self.array_len()?;
        // Read as they are expanded (no list of runs of its own: every recovered record
        // goes through here); the first run that does not read stops both.
        let mut unread = false;
        let pairs = (0..runs).map_while(|_| {
            let pair = self.stack_run();
            unread |= pair.is_none();
            pair
        });
        let indexes = crate::record::expand_stack_runs(pairs).ok()?;
        (!unread).then_some(indexes)
    }

    /// A `u32` that is not zero.
    fn non_zero_u32(&mut self) -> Option<std::num::NonZeroU32> {
        std::num::NonZeroU32::new(u32::try_from(self.uint()?).ok()?)
    }

    /// One `(first, count)` run of [`stack_runs`](Self::stack_runs).
    fn stack_run(&mut self) -> Option<(u32, u32)> {
        if self.array_len()? != 2 {
            return None;
        }
        let first = u32::try_from(self.uint()?).ok()?;
        let count = u32::try_from(self.uint()?).ok()?;
        Some((first, count))
    }

    fn steering(&mut self) -> Option<Steering> {
        // retries 0, not paused, not irreversible, not dirty, ...
        for default in [
            &DEFAULT_STEERING[..],
            &DEFAULT_STEERING_3[..],
            &DEFAULT_STEERING_2[..],
        ] {
            if self.bytes[self.at..].starts_with(default) {
                self.at += default.len();
                return Some(Steering::default());
            }
        }
        self.serde()
    }
}

/// Just enough of a MessagePack reader to index ops: every read is bounds-checked and
/// gives `None` on anything unexpected.
struct MsgReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl MsgReader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len())?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Some(taken)
    }

    fn be(&mut self, n: usize) -> Option<u64> {
        Some(self.take(n)?.iter().fold(0, |v, &b| v << 8 | u64::from(b)))
    }

    fn fixstr(&mut self) -> Option<&[u8]> {
        match self.byte()? {
            m @ 0xa0..=0xbf => self.take(usize::from(m & 0x1f)),
            _ => None,
        }
    }

    fn uint(&mut self) -> Option<u64> {
        match self.byte()? {
            m @ 0x00..=0x7f => Some(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => None,
        }
    }

    fn array_len(&mut self) -> Option<u64> {
        match self.byte()? {
            m @ 0x90..=0x9f => Some(u64::from(m & 0x0f)),
            0xdc => self.be(2),
            0xdd => self.be(4),
            _ => None,
        }
    }

    /// Skips `values` whole values (nested arrays and maps included).
    fn skip(&mut self, mut values: u64) -> Option<()> {
        while values > 0 {
            // Every value takes a byte at least: more pending values than bytes left is
            // damage (and keeps the count from overflowing).
            if values > (self.bytes.len() - self.at) as u64 {
                return None;
            }
            values -= 1;
            let m = self.byte()?;
            let (fixed, len_bytes, nested) = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0, 0),
                0x80..=0x8f => (0, 0, 2 * u64::from(m & 0x0f)),
                0x90..=0x9f => (0, 0, u64::from(m & 0x0f)),
                0xa0..=0xbf => (usize::from(m & 0x1f), 0, 0),
                0xc4 | 0xd9 => (0, 1, 0),
                0xc5 | 0xda => (0, 2, 0),
                0xc6 | 0xdb => (0, 4, 0),
                0xc7 => (1, 1, 0),
                0xc8 => (1, 2, 0),
                0xc9 => (1, 4, 0),
                0xca | 0xce | 0xd2 => (4, 0, 0),
                0xcb | 0xcf | 0xd3 => (8, 0, 0),
                0xcc | 0xd0 => (1, 0, 0),
                0xcd | 0xd1 => (2, 0, 0),
                0xd4 => (2, 0, 0),
                0xd5 => (3, 0, 0),
                0xd6 => (5, 0, 0),
                0xd7 => (9, 0, 0),
                0xd8 => (17, 0, 0),
                0xdc => (0, 0, self.be(2)?),
                0xdd => (0, 0, self.be(4)?),
                0xde => (0, 0, 2 * self.be(2)?),
                0xdf => (0, 0, 2 * self.be(4)?),
                0xc1 => return None,
            };
            if len_bytes > 0 {
                let n = usize::try_from(self.be(len_bytes)?).ok()?;
                self.take(n.checked_add(fixed)?)?;
            } else {
                self.take(fixed)?;
            }
            values = values.checked_add(nested)?;
        }
        Some(())
    }
}

/// A good frame found by a scan.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// Its byte offset in the segment file.
    pub offset: u64,
    /// Its total length in bytes, header included.
    pub len: u64,
    /// Its log sequence number.
    pub lsn: u64,
    /// What it holds.
    pub kind: FrameKind,
    /// Its ops, in order.
    pub ops: Vec<StoreOp>,
    /// The encoded size of each op, in order.
    pub op_sizes: Vec<u32>,
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

/// What a streamed scan of one segment found (its frames went to the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    /// The header (`None` if the header itself is bad).
    pub header: Option<SegmentHeader>,
    /// Good frames, seal included.
    pub frames: u64,
    /// The LSN of the last good frame.
    pub last_lsn: Option<u64>,
    /// Whether the last good frame is a seal.
    pub sealed: bool,
    /// Where the good frames end.
    pub good_len: u64,
    /// The last good start frame, if the segment has one.
    pub start: Option<StartFrame>,
    /// The last good stop frame, if the segment has one: its LSN and what it says.
    pub stop: Option<(u64, LastStop)>,
    /// The LSN of the last good batch frame, if the segment has one.
    pub last_batch_lsn: Option<u64>,
    /// How the scan ended.
    pub end: ScanEnd,
}

/// A start frame as a scan found it: where the log begins (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartFrame {
    /// The first segment of the log.
    pub first: u64,
    /// The frame's byte offset in its segment.
    pub offset: u64,
}

impl SegmentSummary {
    /// How the engine had stopped as of the end of this segment, given how it had as of
    /// the end of the segment before: a stop frame after the last batch frame says so;
    /// a batch frame after the last stop frame means steps ran since (see *How the
    /// engine stopped* in the module docs).
    pub fn last_stop_after(&self, before: LastStop) -> LastStop {
        match (&self.stop, self.last_batch_lsn) {
            (Some((lsn, stop)), batch) if batch.is_none_or(|b| b < *lsn) => stop.clone(),
            (None, None) => before,
            _ => LastStop::Unknown,
        }
    }

    /// The LSN the next frame after this segment's good frames must have.
    pub fn next_lsn(&self) -> Option<u64> {
        self.last_lsn
            .map(|l| l + 1)
            .or(self.header.map(|h| h.first_lsn))
    }
}

/// The result of scanning one segment's bytes, frames collected.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentScan {
    /// The header (`None` if the header itself is bad).
    pub header: Option<SegmentHeader>,
    /// The good frames, in order.
    pub frames: Vec<Frame>,
    /// Whether the last good frame is a seal.
    pub sealed: bool,
    /// How the scan ended.
    pub end: ScanEnd,
}

/// Scans a segment's bytes, collecting its frames. `newest` says whether it is the last
/// segment of the log, the only one whose tail a crash can tear.
pub fn scan_segment(bytes: &[u8], newest: bool) -> SegmentScan {
    let mut frames = Vec::new();
    let summary = match scan_stream(&mut io::Cursor::new(bytes), newest, None, &mut |f| {
        frames.push(f.decode()?);
        Ok(())
    }) {
        Ok(summary) => summary,
        // Reading from memory cannot fail.
        Err(e) => unreachable!("reading a byte slice failed: {e}"),
    };
    SegmentScan {
        header: summary.header,
        frames,
        sealed: summary.sealed,
        end: summary.end,
    }
}

/// Whether a segment (read from its start) has a valid first frame after a good header:
/// what tells a newest segment that holds frames from the empty one an interrupted roll
/// leaves. Reads one frame at most.
///
/// # Errors
/// The reader's error. A bad header or frame is `Ok(false)`.
pub fn first_frame_is_valid(r: &mut impl Read) -> io::Result<bool> {
    let mut buf = Vec::new();
    read_up_to(r, SEGMENT_HEADER_LEN, &mut buf)?;
    if parse_segment_header(&buf).is_err() {
        return Ok(false);
    }
    read_up_to(r, FRAME_HEADER_LEN, &mut buf)?;
    let Ok(fh) = parse_frame_header(&buf) else {
        return Ok(false);
    };
    read_up_to(r, fh.len as usize, &mut buf)?;
    Ok(buf.len() == fh.len as usize && crc32c::crc32c(&buf) == fh.payload_crc)
}

/// Whether `tail`, the last [`FRAME_HEADER_LEN`] bytes of a segment, is a seal frame.
pub fn is_seal(tail: &[u8]) -> bool {
    tail.len() == FRAME_HEADER_LEN
        && parse_frame_header(tail)
            .is_ok_and(|fh| fh.kind == FrameKind::Seal && fh.payload_crc == crc32c::crc32c(&[]))
}

/// How a segment whose header says it starts at another LSN than `expected` (the LSN
/// after the previous segment's last frame, when known) ends: corrupt at byte 0.
pub fn first_lsn_mismatch(header: &SegmentHeader, expected: Option<u64>) -> Option<ScanEnd> {
    let expected = expected.filter(|&e| e != header.first_lsn)?;
    Some(ScanEnd::Corrupt {
        offset: 0,
        reason: FrameError::Header(format!(
            "first LSN {}, but the previous segment ends before LSN {expected}",
            header.first_lsn
        )),
    })
}

/// Reads up to `n` bytes (fewer only at the end of the input).
fn read_up_to(r: &mut impl Read, n: usize, buf: &mut Vec<u8>) -> io::Result<()> {
    /// Room reserved ahead at most: `n` comes from a frame header, and a damaged one
    /// must not make a scan allocate gigabytes before the read comes up short.
    const RESERVE_AT_MOST: usize = 16 << 20;
    buf.clear();
    // One allocation for a large payload, not a doubling series of copies.
    buf.reserve(n.min(RESERVE_AT_MOST));
    r.by_ref().take(n as u64).read_to_end(buf)?;
    Ok(())
}

/// Where a scan stopped, before `newest` decides between torn and corrupt.
struct Bad {
    offset: u64,
    reason: FrameError,
    /// Whether a crash during the last append can explain it.
    torn_shape: bool,
}

/// Scans one segment from `r` (positioned at its start), frame by frame, handing each
/// good frame to `on_frame`, indexed (see [`index_payload`]), not decoded. An error
/// from `on_frame` (say, a frame that does not decode) makes that frame corrupt: the
/// scan ends there. `expect_first_lsn`, when known, is the LSN the previous
/// segment says this one starts at. Memory: one frame at a time.
///
/// # Errors
/// The reader's error (a read or a seek). Damage is not an error: it is the summary's
/// [`end`](SegmentSummary::end).
pub fn scan_stream<R: Read + Seek>(
    r: &mut R,
    newest: bool,
    expect_first_lsn: Option<u64>,
    on_frame: &mut dyn FnMut(RawFrame) -> Result<(), FrameError>,
) -> io::Result<SegmentSummary> {
    // Each payload in its own buffer: the ops recovery keeps point into it.
    let copied = |r: &mut R, n: usize| {
        let mut payload = Vec::new();
        read_up_to(r, n, &mut payload)?;
        let len = payload.len();
        Ok((Arc::new(payload), 0..len))
    };
    scan_with(r, newest, expect_first_lsn, copied, on_frame)
}

/// [`scan_stream`] of a segment already in memory, whole: the ops handed out point into
/// `bytes` itself, so no payload is copied (and `bytes` lives as long as one of them).
///
/// # Errors
/// [`io::ErrorKind::InvalidInput`] for a segment above 4 GiB, which ops cannot point
/// into. Damage is not an error: it is the summary's [`end`](SegmentSummary::end).
pub fn scan_shared(
    bytes: Arc<Vec<u8>>,
    newest: bool,
    on_frame: &mut dyn FnMut(RawFrame) -> Result<(), FrameError>,
) -> io::Result<SegmentSummary> {
    if u32::try_from(bytes.len()).is_err() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a segment above 4 GiB cannot be scanned in place",
        ));
    }
    let mut cursor = io::Cursor::new(Shared(bytes));
    let in_place = |c: &mut io::Cursor<Shared>, n: usize| {
        let buf = &c.get_ref().0;
        let start = usize::try_from(c.position()).map_or(buf.len(), |p| p.min(buf.len()));
        let end = start.saturating_add(n).min(buf.len());
        let buf = Arc::clone(buf);
        c.set_position(end as u64);
        Ok((buf, start..end))
    };
    scan_with(&mut cursor, newest, None, in_place, on_frame)
}

/// A segment's bytes shared with the ops that point into them.
struct Shared(Arc<Vec<u8>>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// The scan of [`scan_stream`] and [`scan_shared`]: `payload(r, n)` reads up to `n`
/// payload bytes (fewer only at the end of the input) and says which buffer holds them
/// and where.
fn scan_with<R: Read + Seek>(
    r: &mut R,
    newest: bool,
    expect_first_lsn: Option<u64>,
    mut payload: impl FnMut(&mut R, usize) -> io::Result<(Arc<Vec<u8>>, std::ops::Range<usize>)>,
    on_frame: &mut dyn FnMut(RawFrame) -> Result<(), FrameError>,
) -> io::Result<SegmentSummary> {
    let mut summary = SegmentSummary {
        header: None,
        frames: 0,
        last_lsn: None,
        sealed: false,
        good_len: 0,
        start: None,
        stop: None,
        last_batch_lsn: None,
        end: ScanEnd::Clean,
    };
    let mut buf = Vec::new();
    read_up_to(r, SEGMENT_HEADER_LEN, &mut buf)?;
    let header = match parse_segment_header(&buf) {
        Ok(h) => h,
        Err(reason) => {
            // A crash while creating the segment leaves a short or zero header, and
            // nothing after it.
            let blank = buf.len() < SEGMENT_HEADER_LEN || buf.iter().all(|&b| b == 0);
            let torn_shape = blank && !valid_frame_follows(r, buf.len() as u64, None)?;
            summary.end = classify(
                Bad {
                    offset: 0,
                    reason,
                    torn_shape,
                },
                newest,
            );
            return Ok(summary);
        }
    };
    summary.header = Some(header);
    summary.good_len = SEGMENT_HEADER_LEN as u64;
    if let Some(end) = first_lsn_mismatch(&header, expect_first_lsn) {
        summary.end = end;
        return Ok(summary);
    }
    let mut next = header.first_lsn;
    let mut offset = SEGMENT_HEADER_LEN as u64;
    let bad = loop {
        read_up_to(r, FRAME_HEADER_LEN, &mut buf)?;
        if buf.is_empty() {
            break None;
        }
        if summary.sealed {
            break Some(Bad {
                offset,
                reason: FrameError::AfterSeal,
                torn_shape: false,
            });
        }
        if buf.len() < FRAME_HEADER_LEN {
            break Some(Bad {
                offset,
                reason: FrameError::Truncated {
                    need: FRAME_HEADER_LEN as u64,
                    have: buf.len() as u64,
                },
                torn_shape: true,
            });
        }
        let fh = match parse_frame_header(&buf) {
            Ok(fh) => fh,
            Err(reason) => {
                let torn_shape = matches!(reason, FrameError::Checksum { .. })
                    && !valid_frame_follows(r, offset + 1, summary.last_lsn)?;
                break Some(Bad {
                    offset,
                    reason,
                    torn_shape,
                });
            }
        };
        if fh.lsn != next {
            break Some(Bad {
                offset,
                reason: FrameError::Lsn {
                    found: fh.lsn,
                    expected: next,
                },
                torn_shape: false,
            });
        }
        let (buf, range) = payload(r, fh.len as usize)?;
        if range.len() < fh.len as usize {
            // A good header whose payload runs past the end: the last append, cut.
            break Some(Bad {
                offset,
                reason: FrameError::Truncated {
                    need: FRAME_HEADER_LEN as u64 + u64::from(fh.len),
                    have: (FRAME_HEADER_LEN + range.len()) as u64,
                },
                torn_shape: true,
            });
        }
        let computed = crc32c::crc32c(&buf[range.clone()]);
        if computed != fh.payload_crc {
            let torn_shape = !valid_frame_follows(r, offset + 1, summary.last_lsn)?;
            break Some(Bad {
                offset,
                reason: FrameError::Checksum {
                    what: "payload",
                    stored: fh.payload_crc,
                    computed,
                },
                torn_shape,
            });
        }
        let len = (FRAME_HEADER_LEN + range.len()) as u64;
        if fh.kind == FrameKind::Start {
            match check_start(&header, summary.start, &buf[range.clone()]) {
                Ok(first) => summary.start = Some(StartFrame { first, offset }),
                Err(reason) => {
                    break Some(Bad {
                        offset,
                        reason,
                        torn_shape: false,
                    })
                }
            }
        }
        if fh.kind == FrameKind::Stop {
            let stop = (header.version >= FIRST_WITH_START)
                .then(|| stop_of(&buf[range.clone()]))
                .flatten();
            match stop {
                Some(stop) => summary.stop = Some((fh.lsn, stop)),
                None => {
                    break Some(Bad {
                        offset,
                        reason: FrameError::Payload(
                            "a stop frame that no writer of its segment's format writes".into(),
                        ),
                        torn_shape: false,
                    })
                }
            }
        }
        if fh.kind == FrameKind::Batch {
            summary.last_batch_lsn = Some(fh.lsn);
        }
        let handed = index_payload_in(fh.kind, buf, range).and_then(|ops| {
            on_frame(RawFrame {
                offset,
                len,
                lsn: fh.lsn,
                kind: fh.kind,
                ops,
            })
        });
        if let Err(reason) = handed {
            break Some(Bad {
                offset,
                reason,
                torn_shape: false,
            });
        }
        summary.frames += 1;
        summary.last_lsn = Some(fh.lsn);
        summary.sealed = fh.kind == FrameKind::Seal;
        offset += len;
        summary.good_len = offset;
        next = fh.lsn + 1;
    };
    if let Some(bad) = bad {
        summary.end = classify(bad, newest);
    }
    Ok(summary)
}

/// The segment a start frame with good checksums names, if a writer could have written
/// it: in a segment of format 4 or later, naming a segment no later than its own and
/// no earlier than the segment's previous start frame did.
fn check_start(
    header: &SegmentHeader,
    previous: Option<StartFrame>,
    payload: &[u8],
) -> Result<u64, FrameError> {
    if header.version < FIRST_WITH_START {
        return Err(FrameError::Kind(FrameKind::Start as u8));
    }
    let first = start_of(payload).ok_or(FrameError::Length(payload.len() as u32))?;
    if first == 0 || first > header.seq {
        return Err(FrameError::Payload(format!(
            "a start frame in segment {} names segment {first}: the log cannot begin \
             after the segment that says where it begins",
            header.seq
        )));
    }
    if let Some(previous) = previous.filter(|p| p.first > first) {
        return Err(FrameError::Payload(format!(
            "a start frame names segment {first}, after one that named {}: the start \
             of the log never moves back",
            previous.first
        )));
    }
    Ok(first)
}

fn classify(bad: Bad, newest: bool) -> ScanEnd {
    if newest && bad.torn_shape {
        ScanEnd::TornTail {
            offset: bad.offset,
            reason: bad.reason,
        }
    } else {
        ScanEnd::Corrupt {
            offset: bad.offset,
            reason: bad.reason,
        }
    }
}

/// Whether a valid frame (header CRC, payload CRC, and an LSN above `after`) starts
/// anywhere at or after byte `from`. Streams the rest of the input in chunks and checks
/// only positions whose kind byte is plausible, so a long zero tail is cheap.
fn valid_frame_follows<R: Read + Seek>(
    r: &mut R,
    from: u64,
    after: Option<u64>,
) -> io::Result<bool> {
    const CHUNK: usize = 64 << 10;
    let mut window: Vec<u8> = Vec::with_capacity(CHUNK + FRAME_HEADER_LEN);
    let mut window_start = from;
    r.seek(SeekFrom::Start(from))?;
    let mut eof = false;
    loop {
        if !eof {
            let before = window.len();
            r.by_ref().take(CHUNK as u64).read_to_end(&mut window)?;
            eof = window.len() - before < CHUNK;
        }
        // Every position with a whole header in the window (or every one at EOF).
        let last = if eof {
            window.len()
        } else {
            window.len() + 1 - FRAME_HEADER_LEN
        };
        let mut p = 0;
        while p + FRAME_HEADER_LEN <= window.len() && p < last {
            let kind = window[p + 4];
            if (1..=4).contains(&kind) {
                if let Ok(fh) = parse_frame_header(&window[p..p + FRAME_HEADER_LEN]) {
                    if after.is_none_or(|a| fh.lsn > a) {
                        let at = window_start + p as u64;
                        let resume = window_start + window.len() as u64;
                        let good = payload_matches(r, at, &fh)?;
                        r.seek(SeekFrom::Start(resume))?;
                        if good {
                            return Ok(true);
                        }
                    }
                }
            }
            p += 1;
        }
        if eof {
            return Ok(false);
        }
        window.drain(..p);
        window_start += p as u64;
    }
}

/// Whether the payload of the frame whose header is at `at` is all there and matches its
/// CRC. Reads it in pieces, never allocating what the header claims.
fn payload_matches<R: Read + Seek>(r: &mut R, at: u64, fh: &FrameHeader) -> io::Result<bool> {
    r.seek(SeekFrom::Start(at + FRAME_HEADER_LEN as u64))?;
    let mut left = u64::from(fh.len);
    let mut crc = 0u32;
    let mut piece = [0u8; 8192];
    while left > 0 {
        let want = piece.len().min(left as usize);
        let got = r.read(&mut piece[..want])?;
        if got == 0 {
            return Ok(false);
        }
        crc = crc32c::crc32c_append(crc, &piece[..got]);
        left -= got as u64;
    }
    Ok(crc == fh.payload_crc)
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
            failure: Some(Box::new(Failure {
                proc: ProcId(id),
                type_name: "t".into(),
                error: ProcError::Aborted,
            })),
            failure_seq: Some(0),
            submitted_ms: 1,
            updated_ms: 2,
            wake_at_ms: Some(3),
            event: Some("e".into()),
            data,
            locks: None,
            deadline_ms: None,
            nonce: None,
            result: None,
            bypassed: false,
            steering: Default::default(),
            nonce_fingerprint: None,
        }
    }

    /// Segment 7, whose first frame has LSN 10.
    fn segment(frames: &[Vec<StoreOp>]) -> Vec<u8> {
        let mut bytes = segment_header(7, 99, 10).to_vec();
        for (i, ops) in frames.iter().enumerate() {
            encode_frame(FrameKind::Batch, 10 + i as u64, ops, &mut bytes).unwrap();
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
            vec![StoreOp::Update(record(1, None, vec![5; 30]))],
        ]
    }

    #[test]
    fn a_header_near_the_end_of_the_number_space_is_refused() {
        // Counting on from such a header (the next LSN, the next segment) would
        // overflow: refused as damage instead.
        for (seq, first_lsn) in [(u64::MAX, 1), (1, u64::MAX), (MAX_SEQ_OR_LSN + 1, 1)] {
            let mut h = segment_header(seq, 0, first_lsn);
            let crc = crc32c::crc32c(&h[..SEGMENT_HEADER_LEN - 4]);
            h[SEGMENT_HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
            match parse_segment_header(&h) {
                Err(FrameError::Header(why)) => assert!(why.contains("above the limit"), "{why}"),
                other => panic!("{seq} {first_lsn}: {other:?}"),
            }
        }
        assert!(parse_segment_header(&segment_header(MAX_SEQ_OR_LSN, 0, MAX_SEQ_OR_LSN)).is_ok());
    }

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let h = segment_header(42, 7, 1000);
        assert_eq!(
            parse_segment_header(&h),
            Ok(SegmentHeader {
                seq: 42,
                max_id: 7,
                first_lsn: 1000,
                version: VERSION,
            })
        );
        let cases: [(usize, &str); 4] = [
            (0, "bad magic"),
            (12, "checksum mismatch"),
            (30, "checksum mismatch"),
            (37, "checksum mismatch"),
        ];
        for (byte, text) in cases {
            let mut bad = h;
            bad[byte] ^= 0x40;
            let err = parse_segment_header(&bad).unwrap_err().to_string();
            assert!(err.contains(text), "byte {byte}: {err}");
        }
        let huge = segment_header(1, u64::MAX, 1);
        let err = parse_segment_header(&huge).unwrap_err().to_string();
        assert!(err.contains("above the limit"), "{err}");
    }

    #[test]
    fn clean_segment_scans_every_frame() {
        let bytes = segment(&sample());
        let scan = scan_segment(&bytes, true);
        assert_eq!(
            scan.header,
            Some(SegmentHeader {
                seq: 7,
                max_id: 99,
                first_lsn: 10,
                version: VERSION,
            })
        );
        assert_eq!(scan.end, ScanEnd::Clean);
        let ops: Vec<Vec<StoreOp>> = scan.frames.iter().map(|f| f.ops.clone()).collect();
        assert_eq!(ops, sample());
        let lsns: Vec<u64> = scan.frames.iter().map(|f| f.lsn).collect();
        assert_eq!(lsns, vec![10, 11, 12, 13]);
        assert_eq!(scan.frames[0].offset, SEGMENT_HEADER_LEN as u64);
        assert!(!scan.sealed);
    }

    #[test]
    fn op_sizes_are_each_ops_encoding() {
        let ops = sample().concat();
        let mut out = Vec::new();
        let sizes = encode_frame(FrameKind::Batch, 1, &ops, &mut out).unwrap();
        let expected: Vec<u32> = ops
            .iter()
            .map(|op| rmp_serde::to_vec(op).unwrap().len() as u32)
            .collect();
        assert_eq!(sizes, expected);
        let (header, decoded, total) = decode_frame(&out).unwrap();
        assert_eq!((header.lsn, decoded, total), (1, ops.clone(), out.len()));
        let (_, decoded_sizes) =
            decode_payload(FrameKind::Batch, &out[FRAME_HEADER_LEN..]).unwrap();
        assert_eq!(decoded_sizes, expected);
        // The payload is exactly what rmp-serde makes of the whole list.
        assert_eq!(
            &out[FRAME_HEADER_LEN..],
            &rmp_serde::to_vec(&ops).unwrap()[..]
        );
    }

    /// What a scan says about damage at each kind of place.
    #[test]
    fn torn_tails_versus_corruption() {
        let good = segment(&sample());
        let frames = scan_segment(&good, true).frames;
        let offsets: Vec<usize> = frames.iter().map(|f| f.offset as usize).collect();
        type Damage = fn(&mut Vec<u8>, &[usize]);
        let cases: [(&str, Damage, bool, &str); 17] = [
            (
                "cut in the last frame",
                |b, f| b.truncate(f[3] + 25),
                true,
                "torn",
            ),
            (
                "cut in the last header",
                |b, f| b.truncate(f[3] + 7),
                true,
                "torn",
            ),
            (
                "zero-filled tail",
                |b, _| b.extend([0u8; 4096]),
                true,
                "torn",
            ),
            (
                "last frame's payload flipped",
                |b, _| {
                    let n = b.len() - 1;
                    b[n] ^= 1
                },
                true,
                "torn",
            ),
            (
                "last frame's length flipped, running past the end",
                |b, f| b[f[3] + 1] ^= 1,
                true,
                "torn",
            ),
            (
                "zeros then data: the last header never written",
                |b, f| b[f[3]..f[3] + FRAME_HEADER_LEN + 3].fill(0),
                true,
                "torn",
            ),
            (
                "garbage after good frames",
                |b, _| b.extend([9u8; 60]),
                true,
                "torn",
            ),
            (
                "middle frame's payload flipped",
                |b, f| b[f[1] + FRAME_HEADER_LEN + 2] ^= 1,
                true,
                "corrupt",
            ),
            (
                "middle frame's length flipped, frames after it",
                |b, f| b[f[1] + 2] ^= 1,
                true,
                "corrupt",
            ),
            (
                "two frames swapped",
                |b, f| {
                    let (first, second) = (b[f[1]..f[2]].to_vec(), b[f[2]..f[3]].to_vec());
                    let swapped: Vec<u8> = second.into_iter().chain(first).collect();
                    b[f[1]..f[3]].copy_from_slice(&swapped);
                },
                true,
                "corrupt",
            ),
            (
                "a valid frame after garbage",
                |b, _| {
                    b.extend([9u8; 30]);
                    encode_frame(FrameKind::Batch, 20, &[StoreOp::Delete(ProcId(1))], b).unwrap();
                },
                true,
                "corrupt",
            ),
            (
                "a valid frame after 100 KiB of garbage (the scan crosses its window)",
                |b, _| {
                    b.extend(vec![1u8; 100 << 10]);
                    encode_frame(FrameKind::Batch, 20, &[StoreOp::Delete(ProcId(1))], b).unwrap();
                },
                true,
                "corrupt",
            ),
            (
                "100 KiB of garbage that only looks like frame kinds",
                |b, _| b.extend((0..100 << 10).map(|i| (i % 3 + 1) as u8)),
                true,
                "torn",
            ),
            (
                "data after a seal",
                |b, _| {
                    encode_frame(FrameKind::Seal, 14, &[], b).unwrap();
                    encode_frame(FrameKind::Batch, 15, &[StoreOp::Delete(ProcId(1))], b).unwrap();
                },
                true,
                "corrupt",
            ),
            (
                "last frame cut, older segment",
                |b, f| b.truncate(f[3] + 3),
                false,
                "corrupt",
            ),
            (
                "header zeroed, newest",
                |b, _| b.iter_mut().for_each(|x| *x = 0),
                true,
                "torn",
            ),
            (
                "header cut, newest",
                |b, _| b.truncate(SEGMENT_HEADER_LEN - 1),
                true,
                "torn",
            ),
        ];
        for (name, damage, newest, expect) in cases {
            let mut bytes = good.clone();
            damage(&mut bytes, &offsets);
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
    fn a_seal_ends_a_segment() {
        let mut bytes = segment(&sample());
        encode_frame(FrameKind::Seal, 14, &[], &mut bytes).unwrap();
        let scan = scan_segment(&bytes, false);
        assert_eq!(scan.end, ScanEnd::Clean);
        assert!(scan.sealed);
        assert_eq!(
            scan.frames.last().map(|f| (f.lsn, f.kind)),
            Some((14, FrameKind::Seal))
        );
    }

    /// A stop frame says how the engine stopped until a batch frame follows it; a
    /// checkpoint or start frame after it says nothing of steps; a stop frame in a
    /// segment of a format before stop frames is corruption.
    #[test]
    fn a_stop_frame_holds_until_a_batch_frame_follows() {
        let drained = LastStop::Drained {
            cut_off: vec![ProcId(4), ProcId(9)],
        };
        // (frames after the sample's four batches, how the segment ends up)
        type Frames = fn(&mut Vec<u8>, &LastStop);
        let cases: [(&str, Frames, LastStop); 5] = [
            ("nothing", |_, _| {}, LastStop::Unknown),
            (
                "drained",
                |b, d| encode_stop_frame(14, d, b).unwrap(),
                drained.clone(),
            ),
            (
                "drained, then a start frame",
                |b, d| {
                    encode_stop_frame(14, d, b).unwrap();
                    encode_start_frame(15, 7, b);
                },
                drained.clone(),
            ),
            (
                "drained, then a batch",
                |b, d| {
                    encode_stop_frame(14, d, b).unwrap();
                    let ops = [StoreOp::Delete(ProcId(1))];
                    encode_frame(FrameKind::Batch, 15, &ops, b).unwrap();
                },
                LastStop::Unknown,
            ),
            (
                "drained, then running",
                |b, d| {
                    encode_stop_frame(14, d, b).unwrap();
                    encode_stop_frame(15, &LastStop::Unknown, b).unwrap();
                },
                LastStop::Unknown,
            ),
        ];
        for (what, frames, expected) in cases {
            let mut bytes = segment(&sample());
            frames(&mut bytes, &drained);
            let scan =
                scan_stream(&mut io::Cursor::new(&bytes), true, None, &mut |_| Ok(())).unwrap();
            assert_eq!(scan.end, ScanEnd::Clean, "{what}");
            // A segment with no frame of its own keeps what the one before said.
            assert_eq!(scan.last_stop_after(drained.clone()), expected, "{what}");
        }
        let empty = segment(&[]);
        let scan = scan_stream(&mut io::Cursor::new(&empty), true, None, &mut |_| Ok(())).unwrap();
        assert_eq!(scan.last_stop_after(drained.clone()), drained);

        let mut old = segment(&sample());
        old[8..10].copy_from_slice(&3u16.to_le_bytes());
        let crc = crc32c::crc32c(&old[0..36]);
        old[36..40].copy_from_slice(&crc.to_le_bytes());
        let at = old.len() as u64;
        encode_stop_frame(14, &drained, &mut old).unwrap();
        assert!(
            matches!(scan_segment(&old, true).end, ScanEnd::Corrupt { offset, .. } if offset == at)
        );
        assert_eq!(stop_of(&[1, 0, 0]), None, "ids of eight bytes");
        assert_eq!(stop_of(&[2]), None, "an unknown tag");
        assert_eq!(stop_of(&[0]), Some(LastStop::Unknown));
    }

    /// A start frame is read into the summary, the last one winning; one that names a
    /// later segment than its own, moves the start back, or sits in a segment of a
    /// format before start frames is corruption.
    #[test]
    fn a_start_frame_says_where_the_log_begins() {
        let mut bytes = segment(&sample());
        encode_start_frame(14, 3, &mut bytes);
        let at = bytes.len() as u64;
        encode_start_frame(15, 7, &mut bytes);
        let scan = scan_stream(&mut io::Cursor::new(&bytes), true, None, &mut |_| Ok(())).unwrap();
        assert_eq!(scan.end, ScanEnd::Clean);
        assert_eq!(
            scan.start,
            Some(StartFrame {
                first: 7,
                offset: at
            })
        );
        assert_eq!(scan.frames, 6);
        assert_eq!(
            parse_frame_header(&bytes[at as usize..]).map(|h| h.len),
            Ok(8)
        );

        let bad = |first: u64, version: u16| {
            let mut bytes = segment(&sample());
            bytes[8..10].copy_from_slice(&version.to_le_bytes());
            let crc = crc32c::crc32c(&bytes[0..36]);
            bytes[36..40].copy_from_slice(&crc.to_le_bytes());
            encode_start_frame(14, 5, &mut bytes);
            let at = bytes.len() as u64;
            encode_start_frame(15, first, &mut bytes);
            let scan = scan_segment(&bytes, true);
            match scan.end {
                ScanEnd::Corrupt { offset, reason } if offset == at => reason.to_string(),
                ScanEnd::Corrupt { offset, .. } if offset == at - 29 => "at the first".into(),
                other => panic!("start {first}, format {version}: {other:?}"),
            }
        };
        assert!(bad(8, VERSION).contains("cannot begin after"));
        assert!(bad(4, VERSION).contains("never moves back"));
        assert_eq!(bad(6, 3), "at the first");
    }

    #[test]
    fn decoded_records_are_checked() {
        let bad_root = StoreOp::Insert(ProcRecord {
            root: ProcId(9),
            ..record(1, None, vec![])
        });
        assert!(check_op(&bad_root)
            .unwrap_err()
            .contains("parent None but root 9"));
        let huge = StoreOp::Delete(ProcId(MAX_ID + 1));
        assert!(check_op(&huge).unwrap_err().contains("above the limit"));
        for bad in [bad_root, huge] {
            // Write it behind the encoder's back: the decoder reports corruption.
            let payload = rmp_serde::to_vec(&vec![bad]).unwrap();
            let mut frame = vec![0u8; FRAME_HEADER_LEN];
            write_frame_header(
                &mut frame,
                payload.len() as u32,
                FrameKind::Batch,
                1,
                crc32c::crc32c(&payload),
            );
            frame.extend(payload);
            assert!(matches!(decode_frame(&frame), Err(FrameError::Payload(_))));
        }
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

    /// A record with every field drawn, so its encoding takes many MessagePack forms
    /// (ints of every width, nil, bools, strings and bins of every length class, nested
    /// arrays and maps).
    fn arb_rich_op() -> impl Strategy<Value = StoreOp> {
        let ids = prop_oneof![2u64..128, 128u64..70_000, 70_000u64..=MAX_ID];
        (
            (
                ids,
                any::<bool>(),
                0u8..3,
                prop::collection::vec(0u32..100_000, 0..6),
            ),
            (
                prop::option::of("[a-z]{0,40}"),
                prop::collection::vec(any::<u8>(), 0..300),
                prop::option::of(any::<u64>()),
                prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
            ),
            (any::<bool>(), 0u32..70_000, any::<bool>()),
        )
            .prop_map(
                |((id, child, tag, stack), (event, data, when, result), (fail, retries, lock))| {
                    let mut r = record(id, child.then_some(1), data);
                    // Positions only grow, as the engine pushes them.
                    let mut stack = stack;
                    stack.sort_unstable();
                    stack.dedup();
                    r.stack_indexes = stack;
                    r.event = event;
                    r.wake_at_ms = when;
                    r.deadline_ms = when.map(|w| w / 2);
                    r.result = result;
                    r.failure = fail.then(|| {
                        Box::new(Failure {
                            proc: ProcId(id),
                            type_name: "t".repeat(retries as usize % 50 + 1),
                            error: {
                                // Plain, or marked: retryable, terminal, with a code.
                                let e = ProcError::Failed("é".repeat(retries as usize % 20));
                                match retries % 4 {
                                    0 => e,
                                    1 => ProcError::retryable(e),
                                    2 => ProcError::terminal(e).coded("already_exists"),
                                    _ => e.coded("é"),
                                }
                            },
                        })
                    });
                    r.nonce = fail.then_some(crate::Nonce {
                        group: id,
                        nonce: u64::from(retries),
                    });
                    // Nil, small and large fingerprints.
                    r.nonce_fingerprint = std::num::NonZeroU32::new(match when {
                        Some(when) if fail => when as u32,
                        _ => retries,
                    });
                    r.locks = lock.then(|| crate::locks::LockClaim {
                        locks: vec![crate::Lock::exclusive("t/1"), crate::Lock::shared("t")],
                        for_life: fail,
                        held: false,
                    });
                    r.steering.retries = retries;
                    match tag {
                        0 => StoreOp::Insert(r),
                        1 => StoreOp::Update(r),
                        _ => StoreOp::Delete(ProcId(id)),
                    }
                },
            )
    }

    proptest! {
        /// Indexing an encoded frame finds each op's kind, procedure and exact bytes;
        /// each op decodes from its bytes alone; and copying the bytes into a new frame
        /// gives the same payload.
        #[test]
        fn indexing_agrees_with_decoding(ops in prop::collection::vec(arb_rich_op(), 0..40)) {
            let mut out = Vec::new();
            let sizes = encode_frame(FrameKind::Batch, 7, &ops, &mut out).unwrap();
            let payload = Arc::new(out[FRAME_HEADER_LEN..].to_vec());
            let raw = index_payload(FrameKind::Batch, Arc::clone(&payload)).unwrap();
            prop_assert_eq!(raw.len(), ops.len());
            for ((raw, op), size) in raw.iter().zip(&ops).zip(&sizes) {
                prop_assert_eq!(raw.id, op.proc_id());
                let root = match op {
                    StoreOp::Insert(r) | StoreOp::Update(r) => r.root,
                    StoreOp::Delete(id) => *id,
                };
                prop_assert_eq!(raw.root, root);
                prop_assert_eq!(raw.size(), *size);
                prop_assert_eq!(&raw.decode().unwrap(), op);
                // The fast path read it: decoding agrees.
                let at = raw.bytes().as_ptr() as usize - payload.as_ptr() as usize;
                prop_assert!(index_op_fast(&payload, at).is_some());
            }
            let mut copied = Vec::new();
            encode_raw_frame(FrameKind::Batch, 7, raw.iter().map(RawOp::bytes), &mut copied)
                .unwrap();
            prop_assert_eq!(copied, out);
        }
    }

    proptest! {
        /// A record of format 2 (a steering of four fields), of formats 3 and 4 (five)
        /// or of format 5 (six, and no nonce fingerprint) reads as it was, not woken
        /// per child, with no failed step and no fingerprint, through both decoders; so
        /// does a format 2 segment header.
        #[test]
        fn format_2_to_5_records_and_headers_still_read(
            op in arb_rich_op(),
            retries in 0u32..3,
            dropped in 0usize..=2,
        ) {
            let mut op = op;
            let (StoreOp::Insert(r) | StoreOp::Update(r)) = &mut op else {
                return Ok(());
            };
            r.steering = Steering::default();
            r.steering.retries = retries;
            r.nonce_fingerprint = None;
            let mut bytes = rmp_serde::to_vec(&op).unwrap();
            // Without format 6's last field (nil): a record of 19 fields, as formats
            // 2 to 5 wrote it (the op's map and tag, then the record's array16).
            prop_assert_eq!(bytes.pop(), Some(0xc0));
            prop_assert_eq!(&bytes[8..11], &[0xdc, 0, 20]);
            bytes[10] = 19;
            // The steering is then the record's last field: format 5's [0x96, retries,
            // nil, false, false, false, 0] becomes format 3's [0x95, retries, nil, false, false,
            // false] and format 2's [0x94, retries, nil, false, false].
            let at = bytes.len() - 7;
            prop_assert_eq!(bytes[at], 0x96);
            bytes[at] = 0x96 - dropped as u8;
            bytes.truncate(bytes.len() - dropped);
            prop_assert_eq!(decode_op_fast(&bytes), Some(op.clone()));
            prop_assert_eq!(rmp_serde::from_slice::<StoreOp>(&bytes).ok(), Some(op));

            let mut h = segment_header(1, 2, 3);
            h[8..10].copy_from_slice(&2u16.to_le_bytes());
            let crc = crc32c::crc32c(&h[0..36]);
            h[36..40].copy_from_slice(&crc.to_le_bytes());
            prop_assert_eq!(parse_segment_header(&h).map(|h| h.seq), Ok(1));
            h[8..10].copy_from_slice(&(VERSION + 1).to_le_bytes());
            let crc = crc32c::crc32c(&h[0..36]);
            h[36..40].copy_from_slice(&crc.to_le_bytes());
            let e = parse_segment_header(&h).unwrap_err().to_string();
            prop_assert!(e.contains("format version 7, this build reads 2 to 6"), "{}", e);
        }

        /// The direct decoder reads every op the writer writes, exactly as serde does;
        /// on damaged bytes it either gives up or agrees with serde.
        #[test]
        fn the_direct_decoder_agrees_with_serde(
            op in arb_rich_op(),
            state in 0usize..9,
            flags in (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let mut op = op;
            if let StoreOp::Insert(r) | StoreOp::Update(r) = &mut op {
                let (irreversible, dirty, paused, per_child, failed) = flags;
                let failed = if failed { crate::Undo::Failed } else { crate::Undo::Interrupted };
                r.state = state_encodings()[state].1;
                r.steering.irreversible = irreversible;
                r.steering.dirty = dirty;
                r.steering.wakes_per_child = per_child;
                r.steering.failed_step = failed;
                r.steering.paused = paused.then(|| {
                    Box::new(crate::record::Paused {
                        error: Some(ProcError::retryable(ProcError::Aborted).coded("c")),
                        policy: None,
                        retries: r.steering.retries,
                    })
                });
            }
            let bytes = rmp_serde::to_vec(&op).unwrap();
            prop_assert_eq!(decode_op_fast(&bytes), Some(op));
            let mut damaged = bytes;
            let i = flip.index(damaged.len());
            damaged[i] ^= 1 << bit;
            if let Some(fast) = decode_op_fast(&damaged) {
                let slow = rmp_serde::from_slice::<StoreOp>(&damaged).ok();
                prop_assert_eq!(slow, Some(fast));
            }
        }
    }

    proptest! {
        /// The direct encoder writes exactly what serde writes, for ops of every kind
        /// and state, with strings, byte fields and stacks past each length form.
        #[test]
        fn the_direct_encoder_agrees_with_serde(
            op in arb_rich_op(),
            state in 0usize..9,
            flags in (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
            type_len in prop_oneof![1usize..32, 32usize..300, 65_530usize..65_540],
            stack in prop::collection::vec((0u32..5, 1u32..4), 0..40),
            big in prop_oneof![Just(0usize), 250usize..260, 65_530usize..65_540],
        ) {
            let mut op = op;
            if let StoreOp::Insert(r) | StoreOp::Update(r) = &mut op {
                let (irreversible, dirty, bypassed, per_child, failed) = flags;
                let failed = if failed { crate::Undo::Failed } else { crate::Undo::Completed };
                r.state = state_encodings()[state].1;
                r.steering.irreversible = irreversible;
                r.steering.dirty = dirty;
                r.steering.wakes_per_child = per_child;
                r.steering.failed_step = failed;
                r.bypassed = bypassed;
                r.type_name = "t".repeat(type_len).into();
                // Runs of consecutive positions with gaps between them, some past a
                // byte, some past 16 bits.
                let mut at = if dirty { 70_000 } else { 0 };
                r.stack_indexes = stack
                    .iter()
                    .flat_map(|&(gap, len)| {
                        at += gap + 1;
                        let run = at..at + len;
                        at += len;
                        run
                    })
                    .collect();
                if big > 0 {
                    r.data = vec![7; big];
                    r.event = Some("e".repeat(big));
                }
            }
            let mut direct = Vec::new();
            encode_op(&op, &mut direct).unwrap();
            prop_assert_eq!(direct, rmp_serde::to_vec(&op).unwrap());
        }
    }

    #[test]
    fn an_op_in_another_form_is_indexed_by_decoding() {
        // Named fields (a map record) and a plain array are not the form the writer
        // uses, but they decode: the index falls back to decoding them.
        let op = StoreOp::Update(record(9, None, vec![1, 2]));
        let named = rmp_serde::to_vec_named(&op).unwrap();
        let plain = rmp_serde::to_vec(&op).unwrap();
        let mut payload = vec![0x92];
        payload.extend(&named);
        payload.extend(&plain);
        let raw = index_payload(FrameKind::Batch, Arc::new(payload)).unwrap();
        assert_eq!(raw.len(), 2);
        assert_eq!(raw[0].size() as usize, named.len());
        assert!(index_op_fast(&named, 0).is_none());
        for r in &raw {
            assert_eq!((r.kind, r.id), (OpKind::Update, ProcId(9)));
            assert_eq!(r.decode().unwrap(), op);
        }
    }

    #[test]
    fn malformed_ops_are_refused_by_the_index() {
        let insert = |body: &[u8]| {
            let mut p = vec![0x91, 0x81, 0xa6];
            p.extend(b"Insert");
            p.extend(body);
            p
        };
        let cases: &[(&str, Vec<u8>)] = &[
            ("no array", vec![0x81]),
            ("more ops than bytes", vec![0x9f, 0x00]),
            ("19 fields, one present", insert(&[0xdc, 0x00, 0x13, 0x07])),
            (
                "a string past the end",
                insert(&[0x92, 0x07, 0xd9, 0xff, b'a']),
            ),
            ("the never-used marker", insert(&[0x92, 0x07, 0xc1])),
            (
                "an id above the limit",
                insert(&[0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            ),
            ("bytes after the last op", {
                let mut p = insert(&[0x91, 0x07]);
                p.push(0xc0);
                p
            }),
            ("an unknown tag", {
                let mut p = vec![0x91, 0x81, 0xa6];
                p.extend(b"Upsert");
                p.extend([0x91, 0x07]);
                p
            }),
        ];
        for (what, payload) in cases {
            let got = index_payload(FrameKind::Batch, Arc::new(payload.clone()));
            assert!(
                matches!(got, Err(FrameError::Payload(_))),
                "{what}: {got:?}"
            );
        }
        // An op the index accepts but whose record is not a record fails at decode,
        // naming why.
        let raw = index_payload(FrameKind::Batch, Arc::new(insert(&[0x91, 0x07]))).unwrap();
        assert!(matches!(raw[0].decode(), Err(FrameError::Payload(_))));
    }

    /// Every MessagePack form the skipper knows, each one whole value: skipped exactly,
    /// and refused when cut short.
    #[test]
    fn the_skipper_walks_every_messagepack_form() {
        let forms: &[(&str, &[u8])] = &[
            ("positive fixint", &[0x7f]),
            ("negative fixint", &[0xe0]),
            ("nil, false, true", &[0x93, 0xc0, 0xc2, 0xc3]),
            ("fixmap", &[0x81, 0xa1, b'k', 0x01]),
            ("fixstr", &[0xa3, b'a', b'b', b'c']),
            (
                "bin8, bin16, bin32",
                &[0x93, 0xc4, 1, 9, 0xc5, 0, 1, 9, 0xc6, 0, 0, 0, 1, 9],
            ),
            (
                "str8, str16, str32",
                &[
                    0x93, 0xd9, 1, b'a', 0xda, 0, 1, b'a', 0xdb, 0, 0, 0, 1, b'a',
                ],
            ),
            (
                "ext8, ext16, ext32",
                &[
                    0x93, 0xc7, 1, 5, 9, 0xc8, 0, 1, 5, 9, 0xc9, 0, 0, 0, 1, 5, 9,
                ],
            ),
            (
                "floats",
                &[0x92, 0xca, 0, 0, 0, 0, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
            (
                "uints",
                &[
                    0x94, 0xcc, 1, 0xcd, 0, 1, 0xce, 0, 0, 0, 1, 0xcf, 0, 0, 0, 0, 0, 0, 0, 1,
                ],
            ),
            (
                "ints",
                &[
                    0x94, 0xd0, 1, 0xd1, 0, 1, 0xd2, 0, 0, 0, 1, 0xd3, 0, 0, 0, 0, 0, 0, 0, 1,
                ],
            ),
            (
                "fixext 1 2 4",
                &[0x93, 0xd4, 5, 1, 0xd5, 5, 1, 2, 0xd6, 5, 1, 2, 3, 4],
            ),
            ("fixext 8", &[0xd7, 5, 1, 2, 3, 4, 5, 6, 7, 8]),
            (
                "fixext 16",
                &[
                    0xd8, 5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                ],
            ),
            (
                "array16, array32",
                &[0x92, 0xdc, 0, 1, 0x01, 0xdd, 0, 0, 0, 1, 0x01],
            ),
            (
                "map16, map32",
                &[0x92, 0xde, 0, 1, 1, 2, 0xdf, 0, 0, 0, 1, 1, 2],
            ),
            ("nested", &[0x91, 0x91, 0x81, 0x91, 0x01, 0x80]),
        ];
        for (what, bytes) in forms {
            let mut r = MsgReader { bytes, at: 0 };
            assert_eq!(r.skip(1), Some(()), "{what}");
            assert_eq!(r.at, bytes.len(), "{what}");
            let mut cut = MsgReader {
                bytes: &bytes[..bytes.len() - 1],
                at: 0,
            };
            assert_eq!(cut.skip(1), None, "{what} cut short");
        }
        // A count no bytes can hold is refused before it is walked.
        let mut huge = MsgReader {
            bytes: &[0xdd, 0xff, 0xff, 0xff, 0xff],
            at: 0,
        };
        assert_eq!(huge.skip(1), None);
    }

    /// A segment's summary and its frames' op bytes, scanned as a stream and in place.
    #[allow(clippy::type_complexity)]
    fn streamed_and_shared(
        bytes: &[u8],
        newest: bool,
    ) -> Result<
        (
            (SegmentSummary, Vec<Vec<Vec<u8>>>),
            (SegmentSummary, Vec<Vec<Vec<u8>>>),
        ),
        TestCaseError,
    > {
        let ops = |f: RawFrame| {
            f.ops
                .iter()
                .map(|op| op.bytes().to_vec())
                .collect::<Vec<_>>()
        };
        let mut streamed = Vec::new();
        let summary = scan_stream(&mut io::Cursor::new(bytes), newest, None, &mut |f| {
            streamed.push(ops(f));
            Ok(())
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut shared = Vec::new();
        let in_place = scan_shared(Arc::new(bytes.to_vec()), newest, &mut |f| {
            shared.push(ops(f));
            Ok(())
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        Ok(((summary, streamed), (in_place, shared)))
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
                    prop_assert_eq!(&scan.end, &ScanEnd::Clean);
                } else if scan.header.is_some() {
                    prop_assert!(scan.end != ScanEnd::Clean || scan.frames.len() < frames.len());
                }
                // A cut anywhere in the newest segment is a torn tail, never corruption.
                if truncate && newest {
                    let corrupt = matches!(scan.end, ScanEnd::Corrupt { .. });
                    prop_assert!(!corrupt, "{:?}", scan.end);
                }
                // A flipped bit before the last frame, with that frame intact, is never
                // taken for a torn tail.
                if !truncate && newest {
                    let last = scan_segment(&good, true).frames.last().map_or(0, |f| f.offset);
                    if (flip.index(good.len()) as u64) < last {
                        let torn = matches!(scan.end, ScanEnd::TornTail { .. });
                        prop_assert!(!torn, "{:?}", scan.end);
                    }
                }
                // Scanning the bytes in place finds what streaming them finds.
                let (streamed, in_place) = streamed_and_shared(&bytes, newest)?;
                prop_assert_eq!(streamed, in_place);
            }
        }
    }
}
