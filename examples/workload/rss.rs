//! The process's resident set size and CPU time, for the benchmark reports (shared by
//! the workload example, `benches/recovery.rs`, `benches/idle.rs` and `benches/bare.rs`).

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

/// CPU time the process has used so far, user and system, every thread's (those that
/// have ended too), in seconds; 0 where `/proc/self/stat` is unavailable. Resolution:
/// the kernel's `USER_HZ` ticks (100 a second on Linux). On a noisy machine the CPU a
/// step costs moves far less than steps per second.
#[allow(dead_code)] // only the throughput benchmarks report it
pub fn cpu_s() -> f64 {
    const USER_HZ: f64 = 100.0;
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces:
    // state is field 3, utime field 14, stime field 15.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks(11) + ticks(12)) as f64 / USER_HZ
}
