//! The seeds a perturbation test runs: `PROCTOR_SEED` alone if set; otherwise
//! `PROCTOR_SEEDS` of them (the test's default) from `PROCTOR_SEED_BASE` (1), and then,
//! while `PROCTOR_PERTURB_SECS` lasts, the seeds after those.

use std::time::{Duration, Instant};

/// The seeds, in order (an iterator).
pub struct Seeds {
    listed: std::vec::IntoIter<u64>,
    next: u64,
    budget: Option<Duration>,
    started: Instant,
}

fn var<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

impl Seeds {
    /// From the environment, with `default` seeds when `PROCTOR_SEEDS` is not set.
    pub fn from_env(default: u64) -> Self {
        let listed: Vec<u64> = match std::env::var("PROCTOR_SEED") {
            Ok(seed) => vec![seed.parse().expect("PROCTOR_SEED is a number")],
            Err(_) => {
                let n = var("PROCTOR_SEEDS").unwrap_or(default);
                let base = var("PROCTOR_SEED_BASE").unwrap_or(1);
                (base..base + n).collect()
            }
        };
        Seeds {
            next: listed.iter().max().copied().unwrap_or(0),
            listed: listed.into_iter(),
            budget: var("PROCTOR_PERTURB_SECS").map(Duration::from_secs),
            started: Instant::now(),
        }
    }

    /// How long since the seeds were first asked for.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Iterator for Seeds {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if let Some(seed) = self.listed.next() {
            return Some(seed);
        }
        let budget = self.budget?;
        (self.started.elapsed() < budget).then(|| {
            self.next += 1;
            self.next
        })
    }
}
