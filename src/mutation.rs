//! Deliberately reintroduced bugs, for the simulator's mutation checks (the
//! `simulation` feature): a simulator that never fails proves nothing, so each
//! [`Mutation`] puts back one defect a real engine could have, and a test shows the
//! simulator finds it within a fixed number of seeds. One mutation at most is on, for
//! the current thread only (the simulator runs the whole engine on one thread), and
//! none is on unless a simulation turns it on.

use std::cell::Cell;

/// One deliberately reintroduced bug (`simulate --mutate NAME`; `--mutate list` prints
/// the names).
///
/// ```
/// use proctor::simulation::Mutation;
/// assert_eq!(Mutation::from_name("durable-before-write"), Some(Mutation::DurableBeforeWrite));
/// assert!(Mutation::ALL.iter().all(|m| Mutation::from_name(m.name()) == Some(*m)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mutation {
    /// The persistence actor tells a root stack its records are durable as it hands
    /// them to the writer, before the store has written them.
    DurableBeforeWrite,
    /// A tree that fails rolls its steps back oldest first.
    RollbackOutOfOrder,
    /// The lock table grants every request at once, conflicting or not.
    LocksNotExclusive,
    /// The WAL store never syncs (as if `WalOptions::sync` were off without saying so).
    WalNoSync,
    /// A leader that lost its lease goes on with the calls into user code it has
    /// begun and with its rollbacks (only new steps stop).
    CallsAfterLeaseLoss,
    /// A leader gives up its lease at the first renewal that fails (one dropped
    /// connection deposes it).
    LeaseLostOnOneError,
}

impl Mutation {
    /// Every mutation, in the order `--mutate list` prints them.
    pub const ALL: [Mutation; 6] = [
        Mutation::DurableBeforeWrite,
        Mutation::RollbackOutOfOrder,
        Mutation::LocksNotExclusive,
        Mutation::WalNoSync,
        Mutation::CallsAfterLeaseLoss,
        Mutation::LeaseLostOnOneError,
    ];

    /// Its name on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mutation::DurableBeforeWrite => "durable-before-write",
            Mutation::RollbackOutOfOrder => "rollback-out-of-order",
            Mutation::LocksNotExclusive => "locks-not-exclusive",
            Mutation::WalNoSync => "wal-no-sync",
            Mutation::CallsAfterLeaseLoss => "calls-after-lease-loss",
            Mutation::LeaseLostOnOneError => "lease-lost-on-one-error",
        }
    }

    /// The mutation of that name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }
}

thread_local! {
    static ON: Cell<Option<Mutation>> = const { Cell::new(None) };
}

/// Turns `mutation` on for this thread (`None`: the engine as written).
pub(crate) fn set(mutation: Option<Mutation>) {
    ON.with(|on| on.set(mutation));
}

/// Whether `mutation` is on for this thread.
#[inline]
pub(crate) fn on(mutation: Mutation) -> bool {
    ON.with(|on| on.get() == Some(mutation))
}
