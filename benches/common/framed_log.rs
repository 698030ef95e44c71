//! The log file both bare benchmarks write (`benches/bare.rs`, `benches/shape.rs`): each
//! record framed as its length, its CRC-32C and its bytes, a batch in one write and one
//! `fdatasync` — the least a durable group commit can do.

use std::fs::File;
use std::io::Write;

/// Appends `records` to `file` as one batch, framed, and syncs it; `buf` is reused
/// from batch to batch.
///
/// # Errors
/// The write's or the sync's.
pub fn append_batch<'a>(
    file: &mut File,
    buf: &mut Vec<u8>,
    records: impl Iterator<Item = &'a [u8]>,
) -> std::io::Result<()> {
    buf.clear();
    for record in records {
        let len = u32::try_from(record.len()).unwrap_or(u32::MAX);
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&crc32c::crc32c(record).to_le_bytes());
        buf.extend_from_slice(record);
    }
    file.write_all(buf)?;
    file.sync_data()
}
