//! The process's resident set size, for the benchmark reports (shared by the workload
//! example, `benches/recovery.rs` and `benches/bare.rs`).

/// A `/proc/self/status` field in KiB (`VmHWM:`, `VmRSS:`); `None` where unavailable.
fn status_kb(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Peak RSS in MiB (`VmHWM`); 0 where that is unavailable.
pub fn peak_rss_mb() -> f64 {
    status_kb("VmHWM:").map_or(0.0, |kb| kb as f64 / 1024.0)
}

/// Resident memory now, in bytes (`VmRSS`); 0 where that is unavailable.
#[allow(dead_code)] // only `benches/bare.rs` measures memory growth
pub fn rss_bytes() -> u64 {
    status_kb("VmRSS:").map_or(0, |kb| kb * 1024)
}
