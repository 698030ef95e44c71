//! The process's peak resident set size, for the benchmark reports (shared by the
//! workload example and `benches/recovery.rs`).

/// Peak RSS in MiB from `/proc/self/status` (`VmHWM`); 0 where that is unavailable.
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
