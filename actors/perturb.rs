//! Seeded perturbation of the actor protocol, for tests (FoundationDB's BUGGIFY in
//! spirit). Compiled only with the `perturb` feature; without it every point is an empty
//! inline function.
//!
//! A `point` sits where a message is about to cross actors or a worker is handed on
//! (names follow `module::function::what`). When a seed is set, each point draws from a
//! per-thread stream derived from the seed and, now and then, yields the thread or
//! stalls it for a few microseconds to a millisecond. Stalling the sending thread never
//! breaks actix's per-mailbox FIFO order, so every interleaving it produces is one a
//! loaded machine could produce; it only makes the rare ones common. Threads are
//! scheduled by the OS, so a seed makes a run likely, not certain, to repeat.

#[cfg(feature = "perturb")]
mod enabled {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    static SEED: AtomicU64 = AtomicU64::new(0);
    static EPOCH: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// (epoch the stream was seeded in, state)
        static STREAM: Cell<(u64, u64)> = const { Cell::new((u64::MAX, 0)) };
    }

    /// Turns perturbation on with `seed`, or off with 0. Every thread reseeds its stream
    /// from the new seed at its next point.
    pub fn set_seed(seed: u64) {
        SEED.store(seed, Ordering::SeqCst);
        EPOCH.fetch_add(1, Ordering::SeqCst);
    }

    /// The seed in force, 0 when off.
    pub fn seed() -> u64 {
        SEED.load(Ordering::Relaxed)
    }

    fn splitmix(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn name_hash(name: &str) -> u64 {
        name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    /// A perturbation point named `name`: one load and a branch while no seed is set
    /// (the benchmarks are built with the feature, as the crate's tests turn it on).
    #[inline]
    pub(crate) fn point(name: &'static str) {
        let seed = SEED.load(Ordering::Relaxed);
        if seed != 0 {
            perturb(seed, name);
        }
    }

    #[cold]
    #[inline(never)]
    fn perturb(seed: u64, name: &'static str) {
        let epoch = EPOCH.load(Ordering::Relaxed);
        let draw = STREAM.with(|s| {
            let (seen, mut state) = s.get();
            if seen != epoch {
                // Threads are told apart by their names (actix names its arbiters).
                let thread = std::thread::current();
                state = seed ^ name_hash(thread.name().unwrap_or("?"));
            }
            let draw = splitmix(&mut state) ^ name_hash(name);
            s.set((epoch, state));
            draw
        });
        match draw % 64 {
            0..=43 => {}
            44..=53 => std::thread::yield_now(),
            54..=61 => std::thread::sleep(Duration::from_micros(20 + draw % 200)),
            _ => std::thread::sleep(Duration::from_micros(500 + draw % 1500)),
        }
    }
}

#[cfg(feature = "perturb")]
pub use enabled::{seed, set_seed};

#[cfg(feature = "perturb")]
pub(crate) use enabled::point;

/// A perturbation point: nothing without the `perturb` feature.
#[cfg(not(feature = "perturb"))]
#[inline(always)]
pub(crate) fn point(_name: &'static str) {}

/// Whether the engine checks its own bookkeeping where the check costs time: in debug
/// builds (the tests), and while a perturbation seed is set (the perturbation test,
/// built for release). Never in a user's release build.
pub(crate) fn checking() -> bool {
    #[cfg(feature = "perturb")]
    let seeded = enabled::seed() != 0;
    #[cfg(not(feature = "perturb"))]
    let seeded = false;
    cfg!(debug_assertions) || seeded
}
