//! The lock table: hierarchical shared/exclusive locks on named resources, counted
//! resources, FIFO waiters, and wait-for cycle detection.
//!
//! Resources are names with `/`-separated segments (`ns`, `ns/t1`, `ns/t1/r7`,
//! `server/dn-4`); a name's ancestors are its proper prefixes at segment boundaries. A
//! procedure asks for all its [`Lock`]s at once and is granted all or none. Two locks
//! conflict when:
//!
//! | held \ asked          | shared `r` | exclusive `r` |
//! |-----------------------|------------|---------------|
//! | shared `r`            | no (unless `r` is counted and full) | yes |
//! | exclusive `r`         | yes        | yes           |
//! | any lock below `r`    | no         | yes           |
//! | exclusive above `r`   | yes        | yes           |
//!
//! so a shared `ns` with exclusive `ns/t1` and `ns/t2` run together, and an exclusive
//! `ns/t1` excludes every region of `t1` and an exclusive `ns`. A counted resource
//! (see [`LockTable::set_permits`]) lets at most N shared holders in, counted per line of
//! descent: a child that takes it under its parent's life-long shared lock takes no
//! permit of its own (it runs under its parent's locks, and its parent cannot leave
//! before it); a parent's share held for one step covers nothing, its children's
//! included. The holders a request may ignore (below) do not count against it either:
//! a rollback's own tree's, and a loan's lender. Those run nothing meanwhile, so at
//! most N lines of descent *run* inside at once.
//!
//! Locks a procedure's ancestors hold do not block it (HBase's lock access: a child runs
//! under its parent's locks), nor do, for a rollback, the locks of its own tree (a tree
//! rolls back one step at a time with nothing of it running). A request from a
//! procedure whose ancestor holds locks for its life, or for a rollback, goes before the
//! ordinary waiters (the tree it belongs to must finish for them to run). Ordinary waiters are served first come, first served:
//! a request is granted only if no holder and no earlier waiter conflicts with it, so a
//! waiter is never overtaken by a later conflicting request; each release re-checks, in
//! order, just the waiters that the released locks could have blocked.
//!
//! A wait can close a cycle only through a tree: a holder that keeps its locks for its
//! life cannot finish before its descendants do. When a new wait closes such a cycle the
//! table picks the waiter of the youngest tree in it (the largest root id) as the
//! victim, removes its request and reports the cycle ([`Deadlock`]); the engine fails
//! that procedure.
//!
//! When every wait of the cycle is a rollback there is nothing to fail: two failed trees
//! each need, for a rollback step, locks that the other's not yet rolled back procedures
//! hold for their life. Then the older tree's rollback borrows the younger tree's locks
//! ([`Loan`]): it is granted as if the lender did not hold them, until it releases. This
//! is safe because the younger tree runs nothing meanwhile: it rolls back one step at a
//! time, its own rollback waits in the same cycle, and that wait cannot end before the
//! borrower's step does. Everyone else still sees the lender's locks.
//!
//! Failing a waiter of a tree past its point of no return (see
//! [`LockTable::set_irreversible`]) does not break a cycle for good: the engine pauses
//! it, and continued it asks again and closes the same cycle. So the victim is taken
//! from trees that can roll back; when the cycle has none, a waiter whose blocker's tree
//! rolls back with its rollback waiting in the cycle borrows that holder's locks, on the
//! same grounds as above. Only a cycle with neither pauses its victim (an operator must
//! step in, by a bypass).
//!
//! Both loans rest on every wait of the cycle lasting until its blocker finishes. A
//! shared wait on a full counted resource ends when any of its holders leaves, and then
//! the lender's tree could run while the borrower holds. So such a wait counts only if
//! every holder filling the resource holds for life and is frozen by the cycle: of a
//! tree whose rollback waits in it, or an ancestor of a waiter in it. Otherwise no loan
//! is made.
//!
//! Nor is such a cycle always a deadlock. A holder filling the resource that is free to
//! leave — it holds for one step, or for life with no waiter below it and none rolling
//! back its tree — is held up by no lock wait. When such holders would make room by
//! leaving (more of them than the resource has holders past its permits: a loan or a
//! rollback's own tree can put more in), in every counted resource by which the
//! cycle's blocker blocks the waiter, their leaving ends the cycle: the waiter just
//! waits, and nothing is failed or paused. Should such a holder come to wait on the
//! cycle later, it does so by a request, which is searched in turn. A holder held up by
//! any wait might be frozen through waits the search did not follow, so it is not
//! counted on to leave. A cycle left standing — it may end by itself, or it is of
//! rollbacks only with nothing safe to lend — is searched again, from each of its
//! waiters, when one of its procedures or of the holders filling a counted resource it
//! waits on leaves, when a loan ends (its pins may have kept the cycle from borrowing),
//! and after a new wait that holds one of those up (below it, or rolling back its
//! tree) or closes a cycle of its own (it may freeze a holder through others): the
//! cycle may be a deadlock now with no new wait through it to find it. A knot of
//! cycles through different waiters may show whole only from a waiter they share.
//!
//! One wait can close several cycles at once (a wait on a counted resource has an edge
//! to each holder filling it). The table breaks the first one it finds that can be
//! broken for good — by a victim whose tree can roll back, or by a loan — and pauses a
//! victim, or waits, only when none can; cycles that end by themselves are passed over,
//! unless the search is cut short (then the first cycle found is broken, since one not
//! searched could be a deadlock). Cycles found together may hold where none
//! does alone (each freezes a holder of a counted resource that another's wait needs
//! gone): then their waits together are treated as one cycle, and a loan among them
//! is as safe. A loan rests on the other waits of its cycle lasting, so until its
//! borrower releases, none of those waiters may borrow in turn.
//!
//! Pure: no clock, no IO. The scheduler actor owns one table.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::ops::ControlFlow;

use serde::{Deserialize, Serialize};

use crate::fast_map::{IdMap, IdSet, NameHasher};
use crate::procedure::ProcId;

/// How a resource is locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LockMode {
    /// Many holders at once (at most N on a counted resource).
    Shared,
    /// One holder, and nobody below or (exclusively) above.
    Exclusive,
}

/// One resource a procedure needs, and how.
///
/// ```
/// use proctor::{Lock, LockMode};
/// let l = Lock::exclusive("ns/t1");
/// assert_eq!(l.mode, LockMode::Exclusive);
/// assert_eq!(l.to_string(), "X ns/t1");
/// assert_eq!(Lock::shared("ns").to_string(), "S ns");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Lock {
    /// The resource's name, `/`-separated from the top of its hierarchy.
    pub resource: String,
    /// Shared or exclusive.
    pub mode: LockMode,
}

impl Lock {
    /// A shared lock on `resource`.
    pub fn shared(resource: impl Into<String>) -> Self {
        Lock {
            resource: resource.into(),
            mode: LockMode::Shared,
        }
    }

    /// An exclusive lock on `resource`.
    pub fn exclusive(resource: impl Into<String>) -> Self {
        Lock {
            resource: resource.into(),
            mode: LockMode::Exclusive,
        }
    }

    /// Checks the resource name: non-empty segments separated by single `/`.
    ///
    /// ```
    /// use proctor::Lock;
    /// assert!(Lock::shared("ns/t1").check().is_ok());
    /// assert!(Lock::shared("ns//t1").check().is_err());
    /// assert!(Lock::shared("").check().is_err());
    /// ```
    ///
    /// # Errors
    /// A message naming the resource if it is empty or has an empty segment (a leading,
    /// trailing or doubled `/`).
    pub fn check(&self) -> Result<(), String> {
        if self.resource.split('/').any(str::is_empty) {
            return Err(format!(
                "bad resource name {:?}: segments must be non-empty and separated by one '/'",
                self.resource
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            LockMode::Shared => "S",
            LockMode::Exclusive => "X",
        };
        write!(f, "{mode} {}", self.resource)
    }
}

/// What a procedure declared, as its record keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockClaim {
    /// The resources, all granted together before a step (or the first step).
    pub locks: Vec<Lock>,
    /// Held from the first step until the procedure finishes, rather than per step.
    pub for_life: bool,
    /// For `for_life`: the locks are held now. Persisted before the first step runs, so
    /// recovery grants them back to this procedure before anything else is scheduled.
    pub held: bool,
}

impl LockClaim {
    /// What a procedure declares ([`Procedure::locks`](crate::Procedure::locks) and
    /// [`holds_lock`](crate::Procedure::holds_lock)), checked: `None` for no locks.
    ///
    /// # Errors
    /// [`Lock::check`]'s message for the first lock whose resource name is bad.
    pub fn declare(locks: Vec<Lock>, for_life: bool) -> Result<Option<LockClaim>, String> {
        if locks.is_empty() {
            return Ok(None);
        }
        for lock in &locks {
            lock.check()?;
        }
        Ok(Some(LockClaim {
            locks,
            for_life,
            held: false,
        }))
    }
}

/// A request for locks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Who asks.
    pub owner: ProcId,
    /// The root of its tree.
    pub root: ProcId,
    /// Its ancestors, parent first (empty for a root): their locks do not block it.
    pub ancestors: Vec<ProcId>,
    /// What it needs.
    pub locks: Vec<Lock>,
    /// Kept until released, whatever steps run (informational for the table: it decides
    /// which holders can close a wait-for cycle).
    pub for_life: bool,
    /// For a rollback: goes before ordinary waiters and is never chosen as a deadlock
    /// victim (a rollback cannot be failed).
    pub rollback: bool,
}

/// What a holder holds its locks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// One step.
    Step,
    /// One rollback step.
    RollbackStep,
    /// The procedure's life.
    Life,
}

/// One wait in a deadlock's cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitEdge {
    /// The procedure that waits.
    pub waiter: ProcId,
    /// Its tree.
    pub waiter_root: ProcId,
    /// What it asked for.
    pub wants: Vec<Lock>,
    /// Who it waits for: a holder, or an earlier waiter it queues behind.
    pub blocker: ProcId,
    /// The blocker's tree.
    pub blocker_root: ProcId,
    /// `true` when the blocker holds its locks; `false` when it is an earlier waiter.
    pub held: bool,
}

/// A wait-for cycle the table broke by removing one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deadlock {
    /// The waiter whose request was removed; the engine fails it.
    pub victim: ProcId,
    /// Its tree: the youngest of the cycle that can roll back (the youngest of all if
    /// none can).
    pub victim_root: ProcId,
    /// The waits of the cycle, starting with the victim's. Between them, each blocker is
    /// an ancestor of the next waiter, holding its locks until that descendant finishes.
    pub cycle: Vec<WaitEdge>,
}

impl fmt::Display for Deadlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "deadlock: ")?;
        write_cycle(f, &self.cycle)?;
        let youngest = self
            .cycle
            .iter()
            .map(|e| e.waiter_root.max(e.blocker_root))
            .max();
        if youngest.is_none_or(|y| y == self.victim_root) {
            write!(
                f,
                "; failing procedure {} of the younger tree {}",
                self.victim, self.victim_root
            )
        } else {
            write!(
                f,
                "; failing procedure {} of tree {} (the younger ones are past their point \
                 of no return)",
                self.victim, self.victim_root
            )
        }
    }
}

/// A wait-for cycle in which no waiter can be failed usefully, broken by letting one
/// waiter borrow the locks of a procedure of a tree that rolls back, runs nothing, and
/// whose own rollback waits in the cycle.
///
/// Every waiter of such a cycle is a rollback, or a step of a tree past its point of no
/// return (failing it would pause it, and continued it would close the same cycle
/// again). The lender is a holder of the youngest tree that rolls back in the cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loan {
    /// The waiter granted over the lender's locks.
    pub borrower: ProcId,
    /// Whether every waiter of the cycle is a rollback (otherwise some are steps of
    /// trees past their point of no return).
    pub rollbacks_only: bool,
    /// The holder whose locks no longer block the borrower until it releases.
    pub lender: ProcId,
    /// The lender's tree: the youngest tree that rolls back in the cycle.
    pub lender_root: ProcId,
    /// The waits of the cycle, starting with the borrower's.
    pub cycle: Vec<WaitEdge>,
}

impl fmt::Display for Loan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rollbacks_only {
            write!(f, "deadlock between rollbacks: ")?;
            write_cycle(f, &self.cycle)?;
            write!(
                f,
                "; procedure {} rolls back under the locks of procedure {} of the younger \
                 tree {}, which waits",
                self.borrower, self.lender, self.lender_root
            )
        } else {
            write!(f, "deadlock past a point of no return: ")?;
            write_cycle(f, &self.cycle)?;
            write!(
                f,
                "; procedure {} goes on under the locks of procedure {} of tree {}, which \
                 rolls back and waits",
                self.borrower, self.lender, self.lender_root
            )
        }
    }
}

fn write_cycle(f: &mut fmt::Formatter<'_>, cycle: &[WaitEdge]) -> fmt::Result {
    for (i, e) in cycle.iter().enumerate() {
        if i > 0 {
            f.write_str("; ")?;
        }
        let wants: Vec<String> = e.wants.iter().map(Lock::to_string).collect();
        let how = if e.held { "held by" } else { "queued behind" };
        write!(
            f,
            "procedure {} (tree {}) waits for [{}] {how} procedure {} (tree {})",
            e.waiter,
            e.waiter_root,
            wants.join(", "),
            e.blocker,
            e.blocker_root
        )?;
    }
    Ok(())
}

/// What a call changed: requests granted (in grant order), deadlock victims, and loans.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Procedures whose waiting requests (or the new request) were granted.
    pub granted: Vec<ProcId>,
    /// Requests removed to break a wait-for cycle.
    pub deadlocks: Vec<Deadlock>,
    /// Cycles that no failure breaks, broken by a loan (the borrower is among
    /// `granted` once nothing else blocks it).
    pub loans: Vec<Loan>,
}

/// Per resource name: who holds it, who holds below it, who waits for it.
#[derive(Debug, Default)]
struct ResNode {
    exclusive: Vec<ProcId>,
    shared: Vec<ProcId>,
    /// Holders of locks strictly below this resource, with how many such locks.
    below: IdMap<ProcId, u32>,
    /// Waiting requests with a lock on exactly this resource, by sequence number.
    waiting: BTreeMap<u64, LockMode>,
    /// The exclusive ones among `waiting`.
    waiting_x: BTreeSet<u64>,
    /// Waiting requests with a lock strictly below this resource.
    waiting_below: BTreeSet<u64>,
}

impl ResNode {
    fn is_empty(&self) -> bool {
        self.exclusive.is_empty()
            && self.shared.is_empty()
            && self.below.is_empty()
            && self.waiting.is_empty()
            && self.waiting_below.is_empty()
    }
}

#[derive(Debug)]
struct Waiter {
    req: Request,
    priority: bool,
}

/// Why one procedure waits for another, in the wait-for graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Link {
    /// A waiter for a holder (for life) of a conflicting lock.
    Held,
    /// A waiter for one of a counted resource's shared holders (for life), all of whom
    /// fill it: any one of them leaving ends the wait.
    Counted,
    /// A waiter for an earlier conflicting waiter it queues behind.
    Queued,
    /// A life-long holder for its waiting descendant (it cannot finish first).
    Tree,
}

/// One procedure on the search path, how it was reached, and what is left to visit.
type PathStep = (ProcId, Link, Vec<(ProcId, Link)>);

/// One link of a wait-for cycle: from, to, and how.
type Hop = (ProcId, ProcId, Link);

/// How a wait-for cycle is broken.
enum Break {
    /// A waiter's request is removed (the engine fails it).
    Fail {
        victim: ProcId,
        victim_root: ProcId,
        cycle: Vec<WaitEdge>,
    },
    /// A waiter borrows a holder's locks.
    Lend(Loan),
}

/// At most this many searches for a cycle through a new wait, each without the links
/// that kept the cycles found before from being broken for good; then the first cycle
/// found is taken.
const CYCLE_SEARCHES: usize = 8;

/// Priority requests take sequence numbers below every ordinary one.
const ORDINARY: u64 = 1 << 63;

/// The lock table. See the module docs.
#[derive(Debug)]
pub struct LockTable {
    nodes: HashMap<String, ResNode, NameHasher>,
    permits: HashMap<String, u32, NameHasher>,
    holders: IdMap<ProcId, Request>,
    waiters: BTreeMap<u64, Waiter>,
    waiting_seq: IdMap<ProcId, u64>,
    /// For each procedure, the waiting requests of its descendants.
    desc_waiters: IdMap<ProcId, BTreeSet<u64>>,
    /// For each tree, its waiting rollback requests.
    rollback_waiters: IdMap<ProcId, BTreeSet<u64>>,
    /// Borrowers (waiting or holding) and the holders whose locks they may ignore.
    loans: IdMap<ProcId, Vec<ProcId>>,
    /// Borrowers and the other waiters of the cycle their loan was made over: the loan
    /// is safe while those waits last, so none of them may borrow until the borrower
    /// releases.
    loan_pins: IdMap<ProcId, Vec<ProcId>>,
    /// Waiters whose wait closed a cycle that was left standing, each with the
    /// procedures of its cycle and the holders filling the counted resources it waits
    /// on: searched again when one of those leaves or is held up by a new wait.
    standing: IdMap<ProcId, Vec<ProcId>>,
    /// Cycle searches made, for tests.
    #[cfg(test)]
    searches: std::cell::Cell<usize>,
    /// Trees past their point of no return: a deadlock's victim is taken from the
    /// others if it can be (a failure there would pause the victim, not roll its tree
    /// back, and the cycle would close again when it is continued).
    irreversible: IdSet<ProcId>,
    next_priority: u64,
    next_ordinary: u64,
}

impl Default for LockTable {
    fn default() -> Self {
        LockTable {
            nodes: HashMap::default(),
            permits: HashMap::default(),
            holders: IdMap::default(),
            waiters: BTreeMap::new(),
            waiting_seq: IdMap::default(),
            desc_waiters: IdMap::default(),
            rollback_waiters: IdMap::default(),
            loans: IdMap::default(),
            loan_pins: IdMap::default(),
            standing: IdMap::default(),
            #[cfg(test)]
            searches: std::cell::Cell::new(0),
            irreversible: IdSet::default(),
            next_priority: 0,
            next_ordinary: ORDINARY,
        }
    }
}

/// One resource as an operator sees it ([`Executor::locks`](crate::Executor::locks)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceLocks {
    /// The resource's name.
    pub resource: String,
    /// For a counted resource: how many shared holders it lets in at once.
    pub permits: Option<u32>,
    /// Who holds a lock on exactly this resource, and how.
    pub holders: Vec<(ProcId, LockMode)>,
    /// Who waits for a lock on exactly this resource, first served first (rollbacks
    /// ahead of the others, then in the order they asked).
    pub waiters: Vec<(ProcId, LockMode)>,
}

/// A wait-for cycle the engine found and how it ended it, for operators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockCycle {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    /// The waits of the cycle, starting with the one the engine acted on.
    pub edges: Vec<WaitEdge>,
    /// What the engine did: failed a waiter, or let a waiter borrow the locks of a tree
    /// that rolls back.
    pub resolution: String,
}

impl LockCycle {
    /// A deadlock broken by failing its victim.
    pub fn broken(at_ms: u64, deadlock: &Deadlock) -> Self {
        LockCycle {
            at_ms,
            edges: deadlock.cycle.clone(),
            resolution: format!(
                "failed procedure {} (tree {})",
                deadlock.victim, deadlock.victim_root
            ),
        }
    }

    /// A cycle no failure can break, ended by a loan.
    pub fn lent(at_ms: u64, loan: &Loan) -> Self {
        LockCycle {
            at_ms,
            edges: loan.cycle.clone(),
            resolution: format!(
                "procedure {} borrows the locks of procedure {} (tree {}, rolling back)",
                loan.borrower, loan.lender, loan.lender_root
            ),
        }
    }
}

/// The engine's locks as an operator sees them ([`Executor::locks`](crate::Executor::locks)).
#[derive(Clone, Debug, Default)]
pub struct LockReport {
    /// Every resource held, waited for or counted, by name.
    pub resources: Vec<ResourceLocks>,
    /// Cycles left standing, which may end by themselves: each wait that closed one,
    /// with the procedures of its cycle.
    pub standing: Vec<(ProcId, Vec<ProcId>)>,
    /// The latest cycles the engine broke or lent through, oldest first (at most 32).
    pub cycles: Vec<LockCycle>,
}

/// The proper ancestors of a resource name, nearest last: `a/b/c` gives `a`, `a/b`.
fn ancestors_of(resource: &str) -> impl Iterator<Item = &str> {
    resource
        .match_indices('/')
        .map(move |(i, _)| &resource[..i])
}

fn ancestry(req: &Request, holder: ProcId) -> bool {
    holder == req.owner || req.ancestors.contains(&holder)
}

/// One lock per resource, the strongest asked for.
fn normalize(locks: &mut Vec<Lock>) {
    locks.sort_by(|a, b| a.resource.cmp(&b.resource).then(b.mode.cmp(&a.mode)));
    locks.dedup_by(|later, first| later.resource == first.resource);
}

impl LockTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `resource` counted: at most `permits` (at least 1) shared holders at once, a
    /// holder under an ancestor that holds it for life not counted.
    /// An exclusive lock on it still excludes everyone.
    pub fn set_permits(&mut self, resource: impl Into<String>, permits: u32) {
        self.permits.insert(resource.into(), permits.max(1));
    }

    /// The locks `owner` holds.
    pub fn held_by(&self, owner: ProcId) -> Option<&[Lock]> {
        self.holders.get(&owner).map(|r| &r.locks[..])
    }

    /// The locks `owner` waits for.
    pub fn waited_by(&self, owner: ProcId) -> Option<&[Lock]> {
        let seq = self.waiting_seq.get(&owner)?;
        self.waiters.get(seq).map(|w| &w.req.locks[..])
    }

    /// Every resource held, waited for or counted, by name: its holders and its queue.
    pub fn resources(&self) -> Vec<ResourceLocks> {
        let mut out: Vec<ResourceLocks> = self
            .nodes
            .iter()
            .filter(|(name, n)| {
                !(n.exclusive.is_empty() && n.shared.is_empty() && n.waiting.is_empty())
                    || self.permits.contains_key(*name)
            })
            .map(|(name, n)| ResourceLocks {
                resource: name.clone(),
                permits: self.permits.get(name).copied(),
                holders: (n.exclusive.iter().map(|&p| (p, LockMode::Exclusive)))
                    .chain(n.shared.iter().map(|&p| (p, LockMode::Shared)))
                    .collect(),
                waiters: n
                    .waiting
                    .iter()
                    .filter_map(|(seq, &mode)| Some((self.waiters.get(seq)?.req.owner, mode)))
                    .collect(),
            })
            .collect();
        for (name, &permits) in &self.permits {
            if !self.nodes.contains_key(name) {
                out.push(ResourceLocks {
                    resource: name.clone(),
                    permits: Some(permits),
                    holders: Vec::new(),
                    waiters: Vec::new(),
                });
            }
        }
        out.sort_by(|a, b| a.resource.cmp(&b.resource));
        out
    }

    /// The waits that closed a cycle the table left standing (it may end by itself,
    /// see the module docs), each with the procedures of its cycle: searched again
    /// when one of them leaves.
    pub fn standing(&self) -> Vec<(ProcId, Vec<ProcId>)> {
        let mut out: Vec<(ProcId, Vec<ProcId>)> = self
            .standing
            .iter()
            .map(|(&waiter, procs)| (waiter, procs.clone()))
            .collect();
        out.sort_by_key(|(waiter, _)| *waiter);
        out
    }

    /// How many procedures hold locks, and how many wait.
    pub fn len(&self) -> (usize, usize) {
        (self.holders.len(), self.waiters.len())
    }

    /// Asks for `req.locks`, all or nothing. Granted at once (the owner is in
    /// [`Changes::granted`]) when no holder outside its ancestry conflicts and, unless it
    /// has priority, no earlier waiter conflicts; otherwise it waits. If the wait closes
    /// a cycle, a victim's request is removed (possibly this one) and reported.
    /// A second request from a holder is granted at once; one from a waiter is ignored.
    pub fn request(&mut self, mut req: Request) -> Changes {
        let mut changes = Changes::default();
        if self.holders.contains_key(&req.owner) {
            changes.granted.push(req.owner);
            return changes;
        }
        if self.waiting_seq.contains_key(&req.owner) {
            return changes;
        }
        normalize(&mut req.locks);
        let ancestor_holds = req
            .ancestors
            .iter()
            .any(|a| self.holders.get(a).is_some_and(|h| h.for_life));
        let priority = req.rollback || ancestor_holds;
        let seq = if priority {
            self.next_priority += 1;
            self.next_priority
        } else {
            self.next_ordinary += 1;
            self.next_ordinary
        };
        if self.grantable(&req, seq, priority) {
            changes.granted.push(req.owner);
            self.grant(req);
            return changes;
        }
        let owner = req.owner;
        self.enqueue(seq, req, priority);
        // A new cycle must pass through the new waiter, and the only edges into it come
        // from its ancestors that hold for life, or (for a priority request) from later
        // ordinary waiters. Without either, there is nothing to search.
        if !ancestor_holds && !priority {
            return changes;
        }
        // A cycle left standing may be a deadlock after this wait: if the wait holds
        // up a procedure the cycle counted on to leave, or if it closed a cycle of its
        // own, which can freeze such a holder through procedures the standing cycle
        // does not name (a rollback of a tree whose waiter holds it up).
        let holds_up = self.holds_up_standing(owner);
        let closed = self.break_cycles(owner, &mut changes);
        if holds_up || closed {
            self.recheck_standing(&mut changes);
        }
        changes
    }

    /// Whether waiter `owner` holds up a procedure of a cycle left standing: one of its
    /// ancestors, or, for a rollback, a holder of its tree.
    fn holds_up_standing(&self, owner: ProcId) -> bool {
        if self.standing.is_empty() {
            return false;
        }
        let w = &self.waiters[&self.waiting_seq[&owner]].req;
        self.standing.values().flatten().any(|&p| {
            w.ancestors.contains(&p)
                || (w.rollback && self.holders.get(&p).is_some_and(|h| h.root == w.root))
        })
    }

    /// Breaks the cycles through waiter `owner` (victims, loans) until none is left or
    /// none can be broken now. A cycle left standing (it may end by itself, or it is of
    /// rollbacks only with nothing safe to lend) is remembered (`note_standing`): when
    /// one of its procedures or counted holders leaves, a loan ends
    /// ([`release`](Self::release)), or a new wait holds one of them up or closes a
    /// cycle of its own ([`request`](Self::request)), each of its waiters is searched
    /// again, for the cycle may have become one that must be broken, with no new wait
    /// to find it. Returns whether a cycle was found.
    fn break_cycles(&mut self, owner: ProcId, changes: &mut Changes) -> bool {
        let mut found = false;
        // Each round removes a waiter or a blocking edge, so this ends.
        while self.waiting_seq.contains_key(&owner) {
            match self.break_cycle(owner) {
                Some(Break::Fail {
                    victim,
                    victim_root,
                    cycle,
                }) => {
                    found = true;
                    // A loan made to it in this call ends with its wait: not reported.
                    changes.loans.retain(|l| l.borrower != victim);
                    self.remove_waiter(victim, changes);
                    changes.deadlocks.push(Deadlock {
                        victim,
                        victim_root,
                        cycle,
                    });
                }
                Some(Break::Lend(loan)) => {
                    found = true;
                    self.loans
                        .entry(loan.borrower)
                        .or_default()
                        .push(loan.lender);
                    let borrower = loan.borrower;
                    let pins = loan
                        .cycle
                        .iter()
                        .map(|e| e.waiter)
                        .filter(|&w| w != borrower);
                    self.loan_pins.entry(borrower).or_default().extend(pins);
                    changes.loans.push(loan);
                    let mut departed = Vec::new();
                    if let Some(&seq) = self.waiting_seq.get(&borrower) {
                        self.try_grant(seq, &mut departed, changes);
                    }
                    self.wake(departed.into(), changes);
                }
                None => {
                    let Some(hops) = self.find_cycle(owner, &[]) else {
                        break;
                    };
                    self.note_standing(&hops);
                    return true;
                }
            }
        }
        self.standing.remove(&owner);
        found
    }

    /// Remembers the cycle `hops` as standing: under every one of its waiters (a knot
    /// whose cycles pass through different waiters may show whole only from one of
    /// them), with its procedures and the holders filling the counted resources its
    /// waiters wait on (whose leaving, or being held up, may make it a deadlock).
    fn note_standing(&mut self, hops: &[Hop]) {
        let mut concerned: Vec<ProcId> = Vec::new();
        for &(waiter, blocker, link) in hops {
            concerned.extend([waiter, blocker]);
            if link == Link::Counted {
                let w = &self.waiters[&self.waiting_seq[&waiter]].req;
                concerned.extend(self.full_counted(w).flat_map(|(_, fillers)| fillers));
            }
        }
        concerned.sort_unstable();
        concerned.dedup();
        // A waiter on several standing cycles keeps what concerns each.
        for &(waiter, _, link) in hops {
            if link != Link::Tree {
                let entry = self.standing.entry(waiter).or_default();
                entry.extend(&concerned);
                entry.sort_unstable();
                entry.dedup();
            }
        }
    }

    /// Searches again through the waiters of cycles left standing (see
    /// [`break_cycles`](Self::break_cycles)).
    fn recheck_standing(&mut self, changes: &mut Changes) {
        let mut ids: Vec<ProcId> = self.standing.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.break_cycles(id, changes);
        }
    }

    /// How to break a wait-for cycle through `start`, if one closes: from the first
    /// cycle found that can be broken for good (a victim whose tree can roll back, or a
    /// loan), else from the first cycle found (a victim past its point of no return,
    /// which only pauses; a cycle of rollbacks only with nothing to lend has none).
    /// A cycle that holders free to leave can end
    /// ([`ends_by_itself`](Self::ends_by_itself)) is no deadlock and is passed over,
    /// unless the search is cut short. Several cycles can close through one wait (a
    /// wait on a counted resource has a link to each holder filling it), and the first
    /// met may be the one without a way out: the search is repeated without the links that made it so (its waits that a
    /// holder outside it could end, or else its first link), up to [`CYCLE_SEARCHES`]
    /// times. Each search visits a procedure at most once.
    fn break_cycle(&self, start: ProcId) -> Option<Break> {
        // The first cycle's way out among those that cannot end by themselves, and
        // among all (taken only if the search is cut short).
        let (mut first, mut fallback) = (None, None);
        let mut without: Vec<(ProcId, ProcId)> = Vec::new();
        // The links of the cycles found so far.
        let mut union: Vec<Hop> = Vec::new();
        let mut searched_all = false;
        for round in 0..CYCLE_SEARCHES {
            let Some(hops) = self.find_cycle(start, &without) else {
                searched_all = true;
                break;
            };
            let loose = self.loose_hops(&hops);
            let (action, for_good) = self.plan_break(self.waits(&hops), loose.is_empty());
            // A wait of the cycle on counted resources that holders held up by no wait
            // fill ends when they leave: no deadlock (yet). Should such a holder come
            // to wait on the cycle later, that wait is searched in turn. Only those
            // waits are left out of the next search (the cycle's other loose waits
            // may be firm in another cycle), and the cycle stays out of the union.
            let ending = self.ends_by_itself(&hops);
            if !ending.is_empty() {
                fallback.get_or_insert(action);
                without.extend(ending);
                continue;
            }
            if for_good {
                return action;
            }
            first.get_or_insert(action);
            // Together, the cycles found may hold where none does alone: each freezes
            // a holder of a counted resource that the others wait on. Then nothing in
            // them moves until one of their waits is granted, and a loan among them is
            // as safe as in one cycle.
            for hop in &hops {
                if !union.contains(hop) {
                    union.push(*hop);
                }
            }
            if round > 0 && self.loose_hops(&union).is_empty() {
                if let (action @ Some(_), true) = self.plan_break(self.waits(&union), true) {
                    return action;
                }
            }
            if loose.is_empty() {
                without.push((hops[0].0, hops[0].1));
            } else {
                without.extend(loose);
            }
        }
        // Cut short, a cycle not searched could be a deadlock: the first one found is
        // broken then, even if it might have ended by itself.
        if searched_all {
            first.flatten()
        } else {
            first.or(fallback).flatten()
        }
    }

    /// The waits among `hops`, as the table reports them.
    fn waits(&self, hops: &[Hop]) -> Vec<WaitEdge> {
        hops.iter()
            .filter_map(|&(waiter, blocker, link)| match link {
                Link::Held | Link::Counted => Some(self.edge(waiter, blocker, true)),
                Link::Queued => Some(self.edge(waiter, blocker, false)),
                Link::Tree => None,
            })
            .collect()
    }

    /// What breaks `cycle` (see the module docs), and whether it breaks it for good.
    fn plan_break(&self, cycle: Vec<WaitEdge>, firm: bool) -> (Option<Break>, bool) {
        let is_rollback = |w: ProcId| {
            self.waiting_seq
                .get(&w)
                .is_some_and(|s| self.waiters[s].req.rollback)
        };
        // The waiters that can be failed (not rollbacks), best victim last: a tree
        // that can roll back, the youngest.
        let victim = cycle
            .iter()
            .filter(|e| !is_rollback(e.waiter))
            .max_by_key(|e| {
                let can_roll_back = !self.irreversible.contains(&e.waiter_root);
                (can_roll_back, e.waiter_root, std::cmp::Reverse(e.waiter))
            })
            .map(|e| (e.waiter, e.waiter_root));
        let useful = victim.is_some_and(|(_, root)| !self.irreversible.contains(&root));
        // Otherwise a wait on the holder of a tree whose rollback waits in this cycle
        // borrows its locks, the youngest such tree's (see the module docs): that tree
        // runs nothing until its rollback is granted, which cannot be before the
        // borrower releases — so long as every wait of the cycle can end only by its
        // blocker finishing.
        let rolling_back: Vec<ProcId> = cycle
            .iter()
            .filter(|e| is_rollback(e.waiter))
            .map(|e| e.waiter_root)
            .collect();
        // A waiter an earlier loan rests on does not borrow: its wait must last until
        // that loan's borrower releases.
        let pinned = |w: ProcId| self.loan_pins.values().any(|pins| pins.contains(&w));
        let lend = cycle
            .iter()
            .filter(|e| firm && e.held && rolling_back.contains(&e.blocker_root))
            .filter(|e| !pinned(e.waiter))
            .max_by_key(|e| (e.blocker_root, std::cmp::Reverse(e.waiter_root)))
            .cloned();
        if let Some((victim, victim_root)) = victim.filter(|_| useful || lend.is_none()) {
            let cycle = rotate(&cycle, victim);
            let fail = Break::Fail {
                victim,
                victim_root,
                cycle,
            };
            return (Some(fail), useful);
        }
        let Some(edge) = lend else {
            return (None, false);
        };
        let loan = Loan {
            borrower: edge.waiter,
            rollbacks_only: cycle.iter().all(|e| is_rollback(e.waiter)),
            lender: edge.blocker,
            lender_root: edge.blocker_root,
            cycle: rotate(&cycle, edge.waiter),
        };
        (Some(Break::Lend(loan)), true)
    }

    /// The tree rooted at `root` has passed its point of no return, or (`false`) has
    /// ended: a deadlock's victim is taken from other trees while one can be.
    pub fn set_irreversible(&mut self, root: ProcId, irreversible: bool) {
        if irreversible {
            self.irreversible.insert(root);
        } else {
            self.irreversible.remove(&root);
        }
    }

    /// Grants `req` whatever holds or waits (recovery re-granting persisted locks, root
    /// first, before anything else runs). Returns `false`, granting nothing, when the
    /// owner already holds or waits.
    pub fn force_grant(&mut self, mut req: Request) -> bool {
        if self.holders.contains_key(&req.owner) || self.waiting_seq.contains_key(&req.owner) {
            return false;
        }
        normalize(&mut req.locks);
        self.grant(req);
        true
    }

    /// Releases everything `owner` holds, or withdraws its waiting request, and grants
    /// the waiters that can now run, in order.
    pub fn release(&mut self, owner: ProcId) -> Changes {
        let mut changes = Changes::default();
        self.loans.remove(&owner);
        // A cycle left standing may be a deadlock once one of its procedures or
        // holders leaves, or once a loan ends (its pins could keep it from borrowing).
        let recheck = self.loan_pins.remove(&owner).is_some()
            || self.standing.values().flatten().any(|&p| p == owner);
        if let Some(req) = self.holders.remove(&owner) {
            let mut touched = VecDeque::new();
            self.ungrant(&req, &mut touched);
            self.wake(touched, &mut changes);
        } else {
            self.remove_waiter(owner, &mut changes);
        }
        if recheck {
            self.recheck_standing(&mut changes);
        }
        changes
    }

    /// `true` if `owner` holds locks, and whether for its life.
    pub fn holds(&self, owner: ProcId) -> Option<bool> {
        self.holders.get(&owner).map(|r| r.for_life)
    }

    /// What `owner` holds its locks for, if it holds any.
    pub fn held_for(&self, owner: ProcId) -> Option<Hold> {
        self.holders
            .get(&owner)
            .map(|r| match (r.for_life, r.rollback) {
                (true, _) => Hold::Life,
                (false, true) => Hold::RollbackStep,
                (false, false) => Hold::Step,
            })
    }

    fn remove_waiter(&mut self, owner: ProcId, changes: &mut Changes) {
        let Some(&seq) = self.waiting_seq.get(&owner) else {
            return;
        };
        self.loans.remove(&owner);
        self.loan_pins.remove(&owner);
        let waiter = self.dequeue(seq);
        let touched = waiter
            .req
            .locks
            .iter()
            .map(|l| (l.resource.clone(), l.mode))
            .collect();
        self.wake(touched, changes);
    }

    /// Whether `holder`'s locks do not count against `req`: its own, its ancestors'
    /// (a child runs under its parent's locks), and, for a rollback, any of its own
    /// tree's — a tree rolls back one step at a time with nothing of it running, so its
    /// locks cannot be in use by another of its procedures, and a lock a sibling holds
    /// for its life must not block a rollback that comes before the sibling's own.
    fn exempt(&self, req: &Request, holder: ProcId) -> bool {
        ancestry(req, holder)
            || (req.rollback
                && self
                    .holders
                    .get(&holder)
                    .is_some_and(|h| h.root == req.root))
            || self
                .loans
                .get(&req.owner)
                .is_some_and(|lenders| lenders.contains(&holder))
    }

    /// Visits every holder outside `req`'s ancestry whose locks conflict with it, and
    /// whether it blocks `req` by itself (`true`), or only as one of a counted
    /// resource's full set of shared holders, any of whom leaving lets `req` in.
    fn each_blocking_holder(
        &self,
        req: &Request,
        f: &mut dyn FnMut(ProcId, bool) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        for lock in &req.locks {
            let r = lock.resource.as_str();
            if let Some(n) = self.nodes.get(r) {
                for &h in &n.exclusive {
                    if !self.exempt(req, h) {
                        f(h, true)?;
                    }
                }
                match lock.mode {
                    LockMode::Exclusive => {
                        for &h in n.shared.iter().chain(n.below.keys()) {
                            if !self.exempt(req, h) {
                                f(h, true)?;
                            }
                        }
                    }
                    LockMode::Shared => {
                        for h in self.fillers(req, r, n) {
                            f(h, false)?;
                        }
                    }
                }
            }
            for a in ancestors_of(r) {
                if let Some(n) = self.nodes.get(a) {
                    for &h in &n.exclusive {
                        if !self.exempt(req, h) {
                            f(h, true)?;
                        }
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// The shared holders that fill counted resource `r` (node `n`) against `req`: none
    /// if `r` is not counted or has room. A permit is taken per line of descent: a
    /// holder under an ancestor's life-long shared lock on `r` takes none of its own (it
    /// runs under that ancestor's locks, which cannot leave before it does), so neither
    /// it nor `req`, if `req` is such a holder, counts. The holders `req` may ignore (a
    /// loan's lender; for a rollback, its own tree's) do not count either: they run
    /// nothing while `req` holds.
    fn fillers(&self, req: &Request, r: &str, n: &ResNode) -> Vec<ProcId> {
        let Some(&permits) = self.permits.get(r) else {
            return Vec::new();
        };
        let covered = |ancestors: &[ProcId]| {
            ancestors.iter().any(|a| {
                n.shared.contains(a) && self.holders.get(a).is_some_and(|held| held.for_life)
            })
        };
        if covered(&req.ancestors) {
            return Vec::new();
        }
        // An ancestor holding it for one step takes a permit like anyone (its locks do
        // not block `req` otherwise); one holding it for life covers `req` (above).
        let line = |h: &ProcId| {
            (req.ancestors.contains(h) || !self.exempt(req, *h))
                && self
                    .holders
                    .get(h)
                    .is_none_or(|held| !covered(&held.ancestors))
        };
        // Counted first: a resource with room allocates nothing.
        if n.shared.iter().filter(|h| line(h)).count() < permits as usize {
            return Vec::new();
        }
        n.shared.iter().copied().filter(|h| line(h)).collect()
    }

    /// Visits every waiter before `seq` whose request conflicts with `req`.
    fn each_earlier_waiter(
        &self,
        req: &Request,
        seq: u64,
        f: &mut dyn FnMut(u64) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        for lock in &req.locks {
            let r = lock.resource.as_str();
            if let Some(n) = self.nodes.get(r) {
                let counted = self.permits.contains_key(r);
                if lock.mode == LockMode::Exclusive || counted {
                    for (&s, _) in n.waiting.range(..seq) {
                        f(s)?;
                    }
                } else {
                    for &s in n.waiting_x.range(..seq) {
                        f(s)?;
                    }
                }
                if lock.mode == LockMode::Exclusive {
                    for &s in n.waiting_below.range(..seq) {
                        f(s)?;
                    }
                }
            }
            for a in ancestors_of(r) {
                if let Some(n) = self.nodes.get(a) {
                    for &s in n.waiting_x.range(..seq) {
                        f(s)?;
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }

    fn grantable(&self, req: &Request, seq: u64, priority: bool) -> bool {
        #[cfg(feature = "simulation")]
        if crate::mutation::on(crate::mutation::Mutation::LocksNotExclusive) {
            return true;
        }
        if self
            .each_blocking_holder(req, &mut |_, _| ControlFlow::Break(()))
            .is_break()
        {
            return false;
        }
        priority
            || self
                .each_earlier_waiter(req, seq, &mut |_| ControlFlow::Break(()))
                .is_continue()
    }

    fn grant(&mut self, req: Request) {
        for lock in &req.locks {
            let node = self.nodes.entry(lock.resource.clone()).or_default();
            match lock.mode {
                LockMode::Exclusive => node.exclusive.push(req.owner),
                LockMode::Shared => node.shared.push(req.owner),
            }
            for a in ancestors_of(&lock.resource) {
                let node = self.nodes.entry(a.to_string()).or_default();
                *node.below.entry(req.owner).or_default() += 1;
            }
        }
        self.holders.insert(req.owner, req);
    }

    fn ungrant(&mut self, req: &Request, touched: &mut VecDeque<(String, LockMode)>) {
        for lock in &req.locks {
            if let Some(node) = self.nodes.get_mut(&lock.resource) {
                let list = match lock.mode {
                    LockMode::Exclusive => &mut node.exclusive,
                    LockMode::Shared => &mut node.shared,
                };
                if let Some(i) = list.iter().position(|&h| h == req.owner) {
                    list.swap_remove(i);
                }
                if node.is_empty() {
                    self.nodes.remove(&lock.resource);
                }
            }
            for a in ancestors_of(&lock.resource) {
                if let Some(node) = self.nodes.get_mut(a) {
                    if let Some(count) = node.below.get_mut(&req.owner) {
                        *count -= 1;
                        if *count == 0 {
                            node.below.remove(&req.owner);
                        }
                    }
                    if node.is_empty() {
                        self.nodes.remove(a);
                    }
                }
            }
            touched.push_back((lock.resource.clone(), lock.mode));
        }
    }

    fn enqueue(&mut self, seq: u64, req: Request, priority: bool) {
        for lock in &req.locks {
            let node = self.nodes.entry(lock.resource.clone()).or_default();
            node.waiting.insert(seq, lock.mode);
            if lock.mode == LockMode::Exclusive {
                node.waiting_x.insert(seq);
            }
            for a in ancestors_of(&lock.resource) {
                let node = self.nodes.entry(a.to_string()).or_default();
                node.waiting_below.insert(seq);
            }
        }
        for &a in &req.ancestors {
            self.desc_waiters.entry(a).or_default().insert(seq);
        }
        if req.rollback {
            self.rollback_waiters
                .entry(req.root)
                .or_default()
                .insert(seq);
        }
        self.waiting_seq.insert(req.owner, seq);
        self.waiters.insert(seq, Waiter { req, priority });
    }

    fn dequeue(&mut self, seq: u64) -> Waiter {
        let waiter = self.waiters.remove(&seq).expect("a queued waiter");
        let req = &waiter.req;
        for lock in &req.locks {
            if let Some(node) = self.nodes.get_mut(&lock.resource) {
                node.waiting.remove(&seq);
                node.waiting_x.remove(&seq);
                if node.is_empty() {
                    self.nodes.remove(&lock.resource);
                }
            }
            for a in ancestors_of(&lock.resource) {
                if let Some(node) = self.nodes.get_mut(a) {
                    node.waiting_below.remove(&seq);
                    if node.is_empty() {
                        self.nodes.remove(a);
                    }
                }
            }
        }
        for a in &req.ancestors {
            if let Some(set) = self.desc_waiters.get_mut(a) {
                set.remove(&seq);
                if set.is_empty() {
                    self.desc_waiters.remove(a);
                }
            }
        }
        if req.rollback {
            if let Some(set) = self.rollback_waiters.get_mut(&req.root) {
                set.remove(&seq);
                if set.is_empty() {
                    self.rollback_waiters.remove(&req.root);
                }
            }
        }
        self.waiting_seq.remove(&req.owner);
        waiter
    }

    /// Re-checks, in order, the waiters that locks leaving `touched` resources (released,
    /// or withdrawn from the queue) could have blocked, and grants those that can run.
    /// Every grant is itself a departure from the queue and is followed the same way.
    fn wake(&mut self, mut touched: VecDeque<(String, LockMode)>, changes: &mut Changes) {
        let mut pending: HashSet<(String, LockMode)> = touched.iter().cloned().collect();
        while let Some((resource, mode)) = touched.pop_front() {
            pending.remove(&(resource.clone(), mode));
            let mut departed = Vec::new();
            self.scan(&resource, &mut departed, changes);
            for a in ancestors_of(&resource) {
                self.scan(a, &mut departed, changes);
            }
            if mode == LockMode::Exclusive {
                self.scan_below(&resource, &mut departed, changes);
            }
            for item in departed {
                if pending.insert(item.clone()) {
                    touched.push_back(item);
                }
            }
        }
    }

    /// The waiters of one resource, oldest first, until one that blocks all later ones.
    fn scan(
        &mut self,
        resource: &str,
        departed: &mut Vec<(String, LockMode)>,
        changes: &mut Changes,
    ) {
        let counted = self.permits.contains_key(resource);
        let mut from = 0;
        loop {
            let next = self
                .nodes
                .get(resource)
                .and_then(|n| n.waiting.range(from..).next())
                .map(|(&s, &m)| (s, m));
            let Some((seq, mode)) = next else {
                return;
            };
            from = seq + 1;
            if self.try_grant(seq, departed, changes) {
                continue;
            }
            // An ordinary waiter that stays conflicts with every later ordinary waiter
            // on this resource if it is exclusive (or the resource is counted): they
            // queue behind it.
            if seq >= ORDINARY && (mode == LockMode::Exclusive || counted) {
                return;
            }
        }
    }

    fn scan_below(
        &mut self,
        resource: &str,
        departed: &mut Vec<(String, LockMode)>,
        changes: &mut Changes,
    ) {
        let mut from = 0;
        loop {
            let next = self
                .nodes
                .get(resource)
                .and_then(|n| n.waiting_below.range(from..).next())
                .copied();
            let Some(seq) = next else {
                return;
            };
            from = seq + 1;
            self.try_grant(seq, departed, changes);
        }
    }

    fn try_grant(
        &mut self,
        seq: u64,
        departed: &mut Vec<(String, LockMode)>,
        changes: &mut Changes,
    ) -> bool {
        let Some(w) = self.waiters.get(&seq) else {
            return false;
        };
        if !self.grantable(&w.req, seq, w.priority) {
            return false;
        }
        let waiter = self.dequeue(seq);
        departed.extend(
            waiter
                .req
                .locks
                .iter()
                .map(|l| (l.resource.clone(), l.mode)),
        );
        changes.granted.push(waiter.req.owner);
        self.grant(waiter.req);
        true
    }

    /// What `p` waits for: as a waiter, the holders that keep their locks for life and
    /// block it, and the earlier waiters it queues behind; as a holder for life, its
    /// descendants that wait (it cannot finish before they do), and its tree's waiting
    /// rollbacks (a tree rolls back one step at a time: a holder releases at the end of
    /// its own rollback, which cannot come before a waiting one). Step holders are left
    /// out: their step ends whatever happens in the table.
    fn successors(&self, p: ProcId) -> Vec<(ProcId, Link)> {
        let mut out = Vec::new();
        if let Some(&seq) = self.waiting_seq.get(&p) {
            let w = &self.waiters[&seq];
            let _ = self.each_blocking_holder(&w.req, &mut |h, alone| {
                if self.holders.get(&h).is_some_and(|r| r.for_life) {
                    out.push((h, if alone { Link::Held } else { Link::Counted }));
                }
                ControlFlow::Continue(())
            });
            if !w.priority {
                let _ = self.each_earlier_waiter(&w.req, seq, &mut |s| {
                    out.push((self.waiters[&s].req.owner, Link::Queued));
                    ControlFlow::Continue(())
                });
            }
        } else if let Some(held) = self.holders.get(&p).filter(|r| r.for_life) {
            if let Some(set) = self.desc_waiters.get(&p) {
                out.extend(set.iter().map(|s| (self.waiters[s].req.owner, Link::Tree)));
            }
            if let Some(set) = self.rollback_waiters.get(&held.root) {
                let rollbacks = set.iter().map(|s| self.waiters[s].req.owner);
                out.extend(rollbacks.filter(|&w| w != p).map(|w| (w, Link::Tree)));
            }
        }
        // One link per procedure, the firmest (`Held` sorts first).
        out.sort_unstable();
        out.dedup_by_key(|(id, _)| *id);
        out
    }

    /// A wait-for cycle through `start`, as its links (from waiter to blocker, and
    /// from a life-long holder to its waiting descendant or its tree's waiting
    /// rollback), none of them in `without`; or `None`.
    fn find_cycle(&self, start: ProcId, without: &[(ProcId, ProcId)]) -> Option<Vec<Hop>> {
        #[cfg(test)]
        self.searches.set(self.searches.get() + 1);
        // Iterative depth-first search keeping the path of (node, edge kind into it).
        let mut visited: IdSet<ProcId> = IdSet::from_iter([start]);
        let mut path: Vec<PathStep> = vec![(start, Link::Tree, self.successors(start))];
        while let Some((node, _, next)) = path.last_mut() {
            let from = *node;
            let Some((succ, kind)) = next.pop() else {
                path.pop();
                continue;
            };
            if without.contains(&(from, succ)) {
                continue;
            }
            if succ == start {
                // Close the cycle: every step along the path, plus this last edge.
                let mut hops: Vec<Hop> =
                    path.windows(2).map(|w| (w[0].0, w[1].0, w[1].1)).collect();
                hops.push((from, succ, kind));
                return Some(hops);
            }
            if visited.insert(succ) {
                let succs = self.successors(succ);
                path.push((succ, kind, succs));
            }
        }
        None
    }

    /// The waits of the cycle `hops` that can end without their blocker finishing:
    /// one queued behind a waiter, or on a counted resource that a holder outside the
    /// cycle fills (see [`counted_wait_lasts`](Self::counted_wait_lasts)). A cycle
    /// without any lasts until one of its waits is granted or removed.
    fn loose_hops(&self, hops: &[Hop]) -> Vec<(ProcId, ProcId)> {
        let waiters: Vec<ProcId> = hops
            .iter()
            .filter(|(_, _, link)| *link != Link::Tree)
            .map(|&(waiter, _, _)| waiter)
            .collect();
        hops.iter()
            .filter(|&&(waiter, blocker, link)| match link {
                Link::Held | Link::Tree => false,
                Link::Counted => !self.counted_wait_lasts(waiter, blocker, &waiters),
                Link::Queued => true,
            })
            .map(|&(waiter, blocker, _)| (waiter, blocker))
            .collect()
    }

    /// Whether `waiter`'s wait for a full counted resource that `holder` fills lasts
    /// until the cycle of `waiters` is broken: every holder filling it holds for life
    /// and is frozen by the cycle — of a tree whose rollback waits in it (a tree rolls
    /// back one step at a time and runs nothing meanwhile), or an ancestor of a waiter in
    /// it (it cannot finish before that descendant does). Any other holder could leave
    /// and end the wait by itself.
    /// The counted resources that `w` asks a share of and that are full against it,
    /// each with the holders filling it ([`fillers`](Self::fillers)).
    fn full_counted<'a>(
        &'a self,
        w: &'a Request,
    ) -> impl Iterator<Item = (&'a str, Vec<ProcId>)> + 'a {
        w.locks
            .iter()
            .filter(|lock| lock.mode == LockMode::Shared)
            .filter_map(move |lock| {
                let r = lock.resource.as_str();
                let fillers = self.fillers(w, r, self.nodes.get(r)?);
                (!fillers.is_empty()).then_some((r, fillers))
            })
    }

    fn counted_wait_lasts(&self, waiter: ProcId, holder: ProcId, waiters: &[ProcId]) -> bool {
        let req = |w: &ProcId| &self.waiters[&self.waiting_seq[w]].req;
        let frozen = |h: ProcId| {
            self.holders.get(&h).is_some_and(|held| {
                held.for_life
                    && waiters
                        .iter()
                        .map(req)
                        .any(|w| (w.rollback && w.root == held.root) || w.ancestors.contains(&h))
            })
        };
        self.full_counted(req(&waiter))
            .any(|(_, fillers)| fillers.contains(&holder) && fillers.into_iter().all(frozen))
    }

    /// The waits of the cycle `hops` that end by themselves: a wait on a holder that
    /// blocks it only by filling counted resources, each beside more holders
    /// [free to leave](Self::free_to_leave) than it has holders past its permits (a
    /// loan or a rollback's own tree can put more holders in than permits), so that
    /// their leaving makes room in every one. A cycle with such a wait is no deadlock
    /// (yet).
    fn ends_by_itself(&self, hops: &[Hop]) -> Vec<(ProcId, ProcId)> {
        let ends = |waiter: ProcId, holder: ProcId| {
            let w = &self.waiters[&self.waiting_seq[&waiter]].req;
            let mut fills = self.full_counted(w).filter_map(|(r, fillers)| {
                fillers.contains(&holder).then(|| {
                    let permits = self.permits.get(r).map_or(0, |&p| p as usize);
                    let free = fillers.iter().filter(|&&h| self.free_to_leave(h)).count();
                    free > fillers.len().saturating_sub(permits)
                })
            });
            // A `Counted` link fills at least one; every one it fills must get room.
            fills
                .next()
                .is_some_and(|room| room && fills.all(|room| room))
        };
        hops.iter()
            .filter(|&&(waiter, holder, link)| link == Link::Counted && ends(waiter, holder))
            .map(|&(waiter, holder, _)| (waiter, holder))
            .collect()
    }

    /// Whether holder `h` is held up by no wait in the table: it holds for one step
    /// (which ends), or for life with no waiter below it and none rolling back its
    /// tree. Whatever else it waits for (its step, its children, an event, an
    /// operator) is not a lock wait, and it comes to wait on one only by a new request,
    /// which is searched for cycles then.
    fn free_to_leave(&self, h: ProcId) -> bool {
        let Some(held) = self.holders.get(&h) else {
            return true;
        };
        let waiting = |index: &IdMap<ProcId, BTreeSet<u64>>, id| {
            index.get(&id).is_some_and(|seqs| !seqs.is_empty())
        };
        !held.for_life
            || !(waiting(&self.desc_waiters, h) || waiting(&self.rollback_waiters, held.root))
    }

    fn edge(&self, waiter: ProcId, blocker: ProcId, held: bool) -> WaitEdge {
        let w = &self.waiters[&self.waiting_seq[&waiter]].req;
        let blocker_root = self
            .holders
            .get(&blocker)
            .map(|r| r.root)
            .or_else(|| {
                let s = self.waiting_seq.get(&blocker)?;
                Some(self.waiters[s].req.root)
            })
            .unwrap_or(blocker);
        WaitEdge {
            waiter,
            waiter_root: w.root,
            wants: w.locks.clone(),
            blocker,
            blocker_root,
            held,
        }
    }
}

/// The cycle's waits, starting with `first`'s.
fn rotate(cycle: &[WaitEdge], first: ProcId) -> Vec<WaitEdge> {
    let start = cycle.iter().position(|e| e.waiter == first).unwrap_or(0);
    let mut ordered = cycle[start..].to_vec();
    ordered.extend_from_slice(&cycle[..start]);
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(owner: u64, ancestors: &[u64], locks: &[&str]) -> Request {
        Request {
            owner: ProcId(owner),
            root: ProcId(ancestors.last().copied().unwrap_or(owner)),
            ancestors: ancestors.iter().map(|&a| ProcId(a)).collect(),
            locks: locks
                .iter()
                .map(|l| {
                    let (mode, r) = l.split_at(2);
                    match mode {
                        "X " => Lock::exclusive(r),
                        "S " => Lock::shared(r),
                        _ => panic!("lock {l:?}"),
                    }
                })
                .collect(),
            for_life: true,
            rollback: false,
        }
    }

    /// A rollback's request: one step, before ordinary waiters.
    fn rollback(owner: u64, ancestors: &[u64], locks: &[&str]) -> Request {
        let mut r = req(owner, ancestors, locks);
        r.rollback = true;
        r.for_life = false;
        r
    }

    fn ids(v: &[u64]) -> Vec<ProcId> {
        v.iter().map(|&i| ProcId(i)).collect()
    }

    #[test]
    fn conflicts_follow_the_hierarchy() {
        // (held, asked, granted at once)
        let cases: &[(&[&str], &[&str], bool)] = &[
            (&["S ns"], &["S ns"], true),
            (&["S ns"], &["X ns"], false),
            (&["X ns"], &["S ns"], false),
            (&["X ns"], &["X ns/t1"], false),
            (&["X ns"], &["S ns/t1/r1"], false),
            (&["S ns"], &["X ns/t1"], true),
            (&["X ns/t1"], &["X ns/t2"], true),
            (&["X ns/t1"], &["S ns"], true),
            (&["X ns/t1"], &["X ns"], false),
            (&["S ns/t1/r1"], &["X ns"], false),
            (&["S ns/t1/r1"], &["X ns/t1"], false),
            (&["S ns/t1/r1"], &["S ns/t1"], true),
            (&["X ns/t1/r1"], &["X ns/t1/r2"], true),
            (&["X ns/t1"], &["X ns/t10"], true),
            (&["X server/dn-4"], &["X ns/t1"], true),
            (&["S ns", "X ns/t1"], &["S ns", "X ns/t2"], true),
            (&["S ns", "X ns/t1"], &["S ns", "X ns/t1/r3"], false),
        ];
        for (held, asked, expect) in cases {
            let mut t = LockTable::new();
            assert_eq!(t.request(req(1, &[], held)).granted, ids(&[1]));
            let got = t.request(req(2, &[], asked)).granted == ids(&[2]);
            assert_eq!(got, *expect, "held {held:?}, asked {asked:?}");
        }
    }

    #[test]
    fn resources_show_holders_and_the_queue_in_the_order_it_is_served() {
        let mut t = LockTable::new();
        t.set_permits("pool", 2);
        t.set_permits("idle", 3);
        t.request(req(1, &[], &["X ns/t1"]));
        t.request(req(2, &[], &["S ns/t1"])); // waits behind 1's exclusive lock below
        t.request(req(3, &[], &["X ns/t1"]));
        t.request(req(4, &[], &["S pool"]));
        t.request(req(5, &[], &["S pool"]));
        t.request(req(6, &[], &["S pool"])); // the pool is full
        t.request(rollback(7, &[], &["X ns/t1"])); // a rollback goes first
        let r = t.resources();
        let names: Vec<&str> = r.iter().map(|r| r.resource.as_str()).collect();
        assert_eq!(names, ["idle", "ns/t1", "pool"]);
        assert_eq!(r[0].permits, Some(3));
        assert!(r[0].holders.is_empty() && r[0].waiters.is_empty());
        let (x, s) = (LockMode::Exclusive, LockMode::Shared);
        assert_eq!(r[1].permits, None);
        assert_eq!(r[1].holders, [(ProcId(1), x)]);
        assert_eq!(
            r[1].waiters,
            [(ProcId(7), x), (ProcId(2), s), (ProcId(3), x)]
        );
        assert_eq!(r[2].permits, Some(2));
        assert_eq!(r[2].holders, [(ProcId(4), s), (ProcId(5), s)]);
        assert_eq!(r[2].waiters, [(ProcId(6), s)]);
        assert!(t.standing().is_empty());
    }

    #[test]
    fn all_or_nothing_and_release_wakes_in_order() {
        let mut t = LockTable::new();
        assert_eq!(t.request(req(1, &[], &["X a"])).granted, ids(&[1]));
        // 2 needs a and b: it holds neither while it waits, so 3 gets b.
        assert!(t.request(req(2, &[], &["X a", "X b"])).granted.is_empty());
        assert_eq!(t.held_by(ProcId(2)), None);
        assert_eq!(t.waited_by(ProcId(2)).map(<[_]>::len), Some(2));
        // 3 does not conflict with 2 on c, but on b it queues behind it (no overtaking).
        assert!(t.request(req(3, &[], &["X b"])).granted.is_empty());
        assert_eq!(t.request(req(4, &[], &["X c"])).granted, ids(&[4]));
        assert_eq!(t.release(ProcId(1)).granted, ids(&[2]));
        assert_eq!(t.release(ProcId(2)).granted, ids(&[3]));
        assert_eq!(t.release(ProcId(3)).granted, ids(&[]));
        t.release(ProcId(4));
        assert_eq!(t.len(), (0, 0));
        assert!(t.nodes.is_empty(), "{:?}", t.nodes);
    }

    #[test]
    fn waiters_are_never_overtaken_by_later_conflicting_requests() {
        // (held by 1, queued in order 2.., expected grants after releasing 1)
        type Case = (
            &'static [&'static str],
            &'static [&'static [&'static str]],
            &'static [u64],
        );
        let cases: &[Case] = &[
            // A shared request behind a waiting exclusive one waits too.
            (&["S r"], &[&["X r"], &["S r"]], &[2]),
            // Readers behind a reader all go together.
            (&["X r"], &[&["S r"], &["S r"], &["X r"]], &[2, 3]),
            // An exclusive parent waiting blocks a later child-resource request.
            (&["S ns/t1/r1"], &[&["X ns/t1"], &["S ns/t1/r2"]], &[2]),
            // Unrelated resources pass.
            (&["X a"], &[&["X a"], &["X b"]], &[3, 2]),
        ];
        for (held, queued, expect) in cases {
            let mut t = LockTable::new();
            t.request(req(1, &[], held));
            let mut early = Vec::new();
            for (i, q) in queued.iter().enumerate() {
                early.extend(t.request(req(i as u64 + 2, &[], q)).granted);
            }
            let mut granted = early;
            granted.extend(t.release(ProcId(1)).granted);
            assert_eq!(granted, ids(expect), "held {held:?}, queued {queued:?}");
        }
    }

    #[test]
    fn counted_resources_let_n_holders_in() {
        let mut t = LockTable::new();
        t.set_permits("ddl/db1", 2);
        assert_eq!(t.request(req(1, &[], &["S ddl/db1"])).granted, ids(&[1]));
        assert_eq!(t.request(req(2, &[], &["S ddl/db1"])).granted, ids(&[2]));
        assert!(t.request(req(3, &[], &["S ddl/db1"])).granted.is_empty());
        assert!(t.request(req(4, &[], &["S ddl/db1"])).granted.is_empty());
        assert_eq!(t.release(ProcId(1)).granted, ids(&[3]));
        assert_eq!(t.release(ProcId(2)).granted, ids(&[4]));
        // Not counted: any number of readers.
        for i in 10..20 {
            assert_eq!(t.request(req(i, &[], &["S ddl/db2"])).granted, ids(&[i]));
        }
    }

    #[test]
    fn children_run_under_their_ancestors_locks() {
        let mut t = LockTable::new();
        assert_eq!(t.request(req(1, &[], &["X ns/t1"])).granted, ids(&[1]));
        // Another tree waits for the table...
        assert!(t.request(req(50, &[], &["S ns/t1"])).granted.is_empty());
        // ...but 1's grandchild takes a region of it (and its own extra resource) at
        // once, ahead of the waiter.
        let child = req(3, &[2, 1], &["X ns/t1/r1", "X server/dn-1"]);
        assert_eq!(t.request(child).granted, ids(&[3]));
        // A sibling subtree conflicts with the grandchild's own lock.
        assert!(t
            .request(req(4, &[1], &["S server/dn-1"]))
            .granted
            .is_empty());
        assert_eq!(t.release(ProcId(3)).granted, ids(&[4]));
        t.release(ProcId(4));
        assert_eq!(t.release(ProcId(1)).granted, ids(&[50]));
    }

    #[test]
    fn a_cycle_between_two_trees_fails_the_younger_one() {
        let mut t = LockTable::new();
        t.request(req(1, &[], &["X res/1"]));
        t.request(req(5, &[], &["X res/2"]));
        // 1's child waits for res/2, held by tree 5: no cycle yet.
        let c = t.request(req(2, &[1], &["X res/2"]));
        assert_eq!(c, Changes::default());
        // 5's child waits for res/1, held by tree 1: 2 → 5 → 6 → 1 → 2.
        let c = t.request(req(6, &[5], &["X res/1"]));
        assert!(c.granted.is_empty());
        assert_eq!(c.deadlocks.len(), 1);
        let d = &c.deadlocks[0];
        assert_eq!((d.victim, d.victim_root), (ProcId(6), ProcId(5)));
        let text = d.to_string();
        for needle in [
            "procedure 6 (tree 5) waits for [X res/1] held by procedure 1 (tree 1)",
            "procedure 2 (tree 1) waits for [X res/2] held by procedure 5 (tree 5)",
            "failing procedure 6 of the younger tree 5",
        ] {
            assert!(text.contains(needle), "{text}");
        }
        assert_eq!(t.waited_by(ProcId(6)), None);
        // The older tree goes on once the younger one releases.
        assert_eq!(t.release(ProcId(5)).granted, ids(&[2]));
    }

    #[test]
    fn the_victim_is_the_youngest_tree_even_when_the_older_closes_the_cycle() {
        let mut t = LockTable::new();
        t.request(req(1, &[], &["X res/1"]));
        t.request(req(5, &[], &["X res/2"]));
        assert_eq!(t.request(req(6, &[5], &["X res/1"])), Changes::default());
        let c = t.request(req(2, &[1], &["X res/2"]));
        assert_eq!(c.deadlocks.len(), 1);
        assert_eq!(c.deadlocks[0].victim, ProcId(6));
        assert!(t.waited_by(ProcId(2)).is_some());
    }

    #[test]
    fn the_victim_is_a_tree_that_can_roll_back_if_there_is_one() {
        // As above, but the youngest tree (5) is past its point of no return: failing
        // its waiter would pause it, and the cycle would close again when continued.
        let mut t = LockTable::new();
        t.set_irreversible(ProcId(5), true);
        t.request(req(1, &[], &["X res/1"]));
        t.request(req(5, &[], &["X res/2"]));
        assert_eq!(t.request(req(6, &[5], &["X res/1"])), Changes::default());
        let c = t.request(req(2, &[1], &["X res/2"]));
        assert_eq!(c.deadlocks.len(), 1);
        assert_eq!(
            (c.deadlocks[0].victim, c.deadlocks[0].victim_root),
            (ProcId(2), ProcId(1))
        );
        assert!(
            c.deadlocks[0].to_string().ends_with(
                "failing procedure 2 of tree 1 (the younger ones are past their point of no \
                 return)"
            ),
            "{}",
            c.deadlocks[0]
        );
        assert!(t.waited_by(ProcId(6)).is_some());
        // Both past it, and no tree rolling back whose locks could be lent: the
        // youngest, as ever (it pauses; an operator must step in).
        let mut t = LockTable::new();
        t.set_irreversible(ProcId(1), true);
        t.set_irreversible(ProcId(5), true);
        t.request(req(1, &[], &["X res/1"]));
        t.request(req(5, &[], &["X res/2"]));
        t.request(req(6, &[5], &["X res/1"]));
        let c = t.request(req(2, &[1], &["X res/2"]));
        assert_eq!((c.deadlocks[0].victim, c.loans.len()), (ProcId(6), 0));
    }

    #[test]
    fn holders_for_one_step_close_no_cycle() {
        let mut t = LockTable::new();
        let mut step = req(1, &[], &["X res/1"]);
        step.for_life = false;
        t.request(step);
        t.request(req(5, &[], &["X res/2"]));
        t.request(req(2, &[1], &["X res/2"]));
        let c = t.request(req(6, &[5], &["X res/1"]));
        assert!(c.deadlocks.is_empty(), "{c:?}");
    }

    #[test]
    fn a_rollback_is_not_blocked_by_its_own_trees_locks() {
        let mut t = LockTable::new();
        // A sibling holds X t/r for its life; another procedure of the tree (not its
        // ancestor) must roll back a step under X t.
        t.request(req(2, &[1], &["X t/r"]));
        let mut step = req(3, &[1], &["X t"]);
        step.for_life = false;
        assert!(t.request(step.clone()).granted.is_empty(), "a step waits");
        t.release(ProcId(3));
        let mut rollback = step;
        rollback.rollback = true;
        assert_eq!(t.request(rollback).granted, ids(&[3]), "a rollback goes");
        t.release(ProcId(3));
        // Another tree's rollback still waits.
        let mut other = req(9, &[8], &["X t"]);
        other.rollback = true;
        other.for_life = false;
        assert!(t.request(other).granted.is_empty());
    }

    /// Tree 6 is rolling back: its procedure 8 must roll back (under S t0/r0) before its
    /// procedure 7 can release X t1. Tree 2's root holds X t0 (its child 10 is to wait
    /// for X t1).
    fn rolling_back_behind_tree_2(tree_2_irreversible: bool) -> LockTable {
        let mut t = LockTable::new();
        t.set_irreversible(ProcId(2), tree_2_irreversible);
        t.request(req(2, &[], &["X t0"]));
        t.request(req(7, &[6], &["X t1"]));
        let mut rollback = req(8, &[6], &["S t0/r0"]);
        rollback.rollback = true;
        rollback.for_life = false;
        assert_eq!(t.request(rollback), Changes::default());
        t
    }

    #[test]
    fn a_waiting_rollback_behind_another_trees_holder_closes_a_cycle() {
        let mut t = rolling_back_behind_tree_2(false);
        let c = t.request(req(10, &[2], &["X t1"]));
        assert_eq!(c.deadlocks.len(), 1, "{c:?}");
        // The rollback cannot be failed: the victim is the step of the other tree.
        assert_eq!(c.deadlocks[0].victim, ProcId(10));
    }

    #[test]
    fn a_cycle_of_rollbacks_lends_the_younger_trees_locks_to_the_older() {
        // Tree 5's procedure 7 holds S t0 and S t0/r1 for its life; tree 9's root holds
        // X t1 for its life. Both trees failed. Tree 9 must first roll back its child 19
        // (X t0: waits for 7), tree 5 its procedure 13 (X t1/r0: waits for 9).
        let mut t = LockTable::new();
        t.request(req(7, &[5], &["S t0", "S t0/r1"]));
        t.request(req(9, &[], &["X t1"]));
        assert_eq!(
            t.request(rollback(19, &[9], &["S t0/r0", "X t0"])),
            Changes::default()
        );
        let c = t.request(rollback(13, &[6, 5], &["X t1/r0", "S t0/r1"]));
        assert!(c.deadlocks.is_empty(), "{c:?}");
        assert_eq!(c.granted, ids(&[13]), "the older tree's rollback goes");
        let loan = &c.loans[..];
        assert_eq!(loan.len(), 1, "{c:?}");
        assert_eq!(
            (loan[0].borrower, loan[0].lender, loan[0].lender_root),
            (ProcId(13), ProcId(9), ProcId(9))
        );
        assert_eq!(
            loan[0].to_string(),
            "deadlock between rollbacks: procedure 13 (tree 5) waits for [S t0/r1, X t1/r0] held \
             by procedure 9 (tree 9); procedure 19 (tree 9) waits for [X t0, S t0/r0] held by \
             procedure 7 (tree 5); procedure 13 rolls back under the locks of procedure 9 of \
             the younger tree 9, which waits"
        );
        check_holders(&t);
        // Only the borrower: a third tree still waits for the lender.
        assert!(t.request(req(30, &[], &["S t1/r0"])).granted.is_empty());
        // The loan ends with the borrower's step; the lender's tree waits on.
        assert!(t.release(ProcId(13)).granted.is_empty());
        assert_eq!(t.release(ProcId(7)).granted, ids(&[19]));
        assert!(t.release(ProcId(19)).granted.is_empty());
        assert_eq!(t.release(ProcId(9)).granted, ids(&[30]));
        t.release(ProcId(30));
        assert_eq!(t.len(), (0, 0));
        assert!(t.loans.is_empty() && t.nodes.is_empty());
    }

    #[test]
    fn a_step_past_the_point_of_no_return_borrows_from_a_tree_rolling_back() {
        // As above, but tree 2 is past its point of no return. Failing 10 would pause
        // it; continued, it would ask again and close the same cycle, for ever. Tree 6
        // runs nothing until its rollback 8 (waiting in the cycle) is granted, which
        // cannot come before 10 ends: 10 goes under 7's locks.
        let mut t = rolling_back_behind_tree_2(true);
        let mut step = req(10, &[2], &["X t1"]);
        step.for_life = false;
        let c = t.request(step);
        assert!(c.deadlocks.is_empty(), "{c:?}");
        assert_eq!(c.granted, ids(&[10]));
        assert_eq!(c.loans.len(), 1, "{c:?}");
        let loan = &c.loans[0];
        assert_eq!(
            (
                loan.borrower,
                loan.lender,
                loan.lender_root,
                loan.rollbacks_only
            ),
            (ProcId(10), ProcId(7), ProcId(6), false)
        );
        assert_eq!(
            loan.to_string(),
            "deadlock past a point of no return: procedure 10 (tree 2) waits for [X t1] held \
             by procedure 7 (tree 6); procedure 8 (tree 6) waits for [S t0/r0] held by \
             procedure 2 (tree 2); procedure 10 goes on under the locks of procedure 7 of \
             tree 6, which rolls back and waits"
        );
        check_holders(&t);
        // Only the borrower: another step of tree 2 closes the cycle again and borrows
        // in turn; it still waits for 10's step.
        let mut again = req(11, &[2], &["S t1"]);
        again.for_life = false;
        let c = t.request(again);
        assert!(c.granted.is_empty() && c.deadlocks.is_empty(), "{c:?}");
        assert_eq!(c.loans.len(), 1, "{c:?}");
        assert!(t.release(ProcId(10)).granted == ids(&[11]));
        // The rollback goes once tree 2 is done; the loan ended with 10's step.
        t.release(ProcId(11));
        assert_eq!(t.release(ProcId(2)).granted, ids(&[8]));
        t.release(ProcId(8));
        t.release(ProcId(7));
        assert_eq!(t.len(), (0, 0));
        assert!(t.loans.is_empty() && t.nodes.is_empty());
        // Without a tree rolling back in the cycle there is nothing to borrow: see
        // `the_victim_is_a_tree_that_can_roll_back_if_there_is_one`.
    }

    #[test]
    fn no_loan_over_a_wait_on_a_counted_resource() {
        // srv is counted (2 permits), full: tree 2 holds S srv for its life, procedure
        // 20 of another tree for one step. Tree 6 rolls back: 7 holds X t1 for its life,
        // and its rollback 8 needs S srv. Only 2 is an edge of 8's wait, but 20 leaving
        // would end it too: tree 6 could then run while a borrower held 7's locks.
        for tree_2_irreversible in [true, false] {
            let mut t = LockTable::new();
            t.set_permits("srv", 2);
            t.set_irreversible(ProcId(2), tree_2_irreversible);
            t.request(req(2, &[], &["S srv"]));
            let mut third = req(20, &[], &["S srv"]);
            third.for_life = false;
            assert_eq!(t.request(third).granted, ids(&[20]));
            t.request(req(7, &[6], &["X t1"]));
            let mut rollback = req(8, &[6], &["S srv"]);
            rollback.rollback = true;
            rollback.for_life = false;
            assert_eq!(t.request(rollback), Changes::default());
            // 10 (tree 2) waits for 7: 10 -> 7 -> 8 -> 2 -> 10, through srv.
            let mut wait = req(10, &[2], &["X t1"]);
            wait.for_life = false;
            // Tree 2 failed instead: 10 is its rollback, and nothing can be failed.
            wait.rollback = !tree_2_irreversible;
            // 20 leaving ends the cycle: no victim either (before, 10 past the point of
            // no return was failed, and paused).
            assert_eq!(t.request(wait), Changes::default());
            assert_eq!(t.release(ProcId(20)).granted, ids(&[8]));
            t.release(ProcId(8));
            assert_eq!(t.release(ProcId(7)).granted, ids(&[10]));
            check_holders(&t);
        }
    }

    #[test]
    fn a_wait_on_a_counted_resource_that_the_cycle_fills_is_loaned_over() {
        // srv is counted and full. Tree 6 rolls back: 7 holds X t1 for its life, its
        // rollback 8 needs S srv. Then 10 (tree 2, a child of 3) needs X t1:
        // 10 -> 7 -> 8 -> srv's holders -> 10. When every holder filling srv is frozen
        // by the cycle — a life-long holder of a tree whose rollback waits in it, or an
        // ancestor of a waiter in it — srv stays full until the cycle is broken, so the
        // cycle holds and 10 borrows 7's locks. A holder that can leave (a step's,
        // another tree's, or a life-long one of a tree past its point of no return that
        // is not an ancestor of a waiter) would end 8's wait by itself: no loan then, and
        // no victim either (before, a step past the point of no return was failed, and
        // paused): 10 waits. The last holder listed leaves, and 8 gets srv; then 7
        // rolls back, and 10 gets X t1.
        type Holder = (u64, &'static [u64], bool);
        struct Case {
            permits: u32,
            holders: &'static [Holder],
            tree_2_rolls_back: bool,
            loan: bool,
        }
        const SIBLINGS: &[Holder] = &[(3, &[2], true), (4, &[2], true)];
        let cases = [
            // Tree 2 rolls back; its 3 and 4 fill srv for life: frozen.
            Case {
                permits: 2,
                holders: SIBLINGS,
                tree_2_rolls_back: true,
                loan: true,
            },
            // Tree 2 is past its point of no return; 3 is an ancestor of the waiter 10.
            Case {
                permits: 1,
                holders: &[(3, &[2], true)],
                tree_2_rolls_back: false,
                loan: true,
            },
            // 4 is not: it can finish (tree 2 runs on).
            Case {
                permits: 2,
                holders: SIBLINGS,
                tree_2_rolls_back: false,
                loan: false,
            },
            // A step's holder leaves when its step ends.
            Case {
                permits: 2,
                holders: &[(3, &[2], true), (20, &[], false)],
                tree_2_rolls_back: true,
                loan: false,
            },
            Case {
                permits: 2,
                holders: &[(3, &[2], true), (20, &[], false)],
                tree_2_rolls_back: false,
                loan: false,
            },
            // A life-long holder of a tree outside the cycle can finish.
            Case {
                permits: 2,
                holders: &[(3, &[2], true), (30, &[], true)],
                tree_2_rolls_back: true,
                loan: false,
            },
        ];
        for (i, case) in cases.iter().enumerate() {
            let mut t = LockTable::new();
            t.set_permits("srv", case.permits);
            t.set_irreversible(ProcId(2), !case.tree_2_rolls_back);
            for &(id, ancestors, for_life) in case.holders {
                let mut holder = req(id, ancestors, &["S srv"]);
                holder.for_life = for_life;
                assert_eq!(t.request(holder).granted, ids(&[id]), "case {i}");
            }
            t.request(req(7, &[6], &["X t1"]));
            let mut rollback = req(8, &[6], &["S srv"]);
            rollback.rollback = true;
            rollback.for_life = false;
            assert_eq!(t.request(rollback), Changes::default(), "case {i}");
            let mut wait = req(10, &[3, 2], &["X t1"]);
            wait.for_life = false;
            wait.rollback = case.tree_2_rolls_back;
            let c = t.request(wait);
            let leaves = ProcId(case.holders[case.holders.len() - 1].0);
            if case.loan {
                let [loan] = &c.loans[..] else {
                    panic!("case {i}: {c:?}");
                };
                assert_eq!(
                    (loan.borrower, loan.lender),
                    (ProcId(10), ProcId(7)),
                    "case {i}"
                );
                assert_eq!(loan.rollbacks_only, case.tree_2_rolls_back, "case {i}");
                assert_eq!(c.granted, ids(&[10]), "case {i}");
                assert!(c.deadlocks.is_empty(), "case {i}: {c:?}");
                check_holders(&t);
                // 10 done, tree 2 goes on: srv has room for 8 once a holder leaves.
                assert!(t.release(ProcId(10)).granted.is_empty(), "case {i}");
            } else {
                assert_eq!(c, Changes::default(), "case {i}");
            }
            assert_eq!(t.release(leaves).granted, ids(&[8]), "case {i}");
            check_holders(&t);
            if !case.loan {
                t.release(ProcId(8));
                assert_eq!(t.release(ProcId(7)).granted, ids(&[10]), "case {i}");
            }
        }
    }

    #[test]
    fn a_cycle_that_can_be_broken_is_found_beside_one_that_cannot() {
        // srv is counted (2 permits), filled for life by 1 (tree 1, runs on) and 3
        // (tree 3, rolls back). 2, 1's child, waits for X p, which 3 holds for life;
        // 4, tree 3's rollback, waits for X q, held for life by 5 (tree 5, rolls back).
        // Then 6, tree 5's rollback, needs S srv: two cycles close through it.
        // 6 -> 3 -> 4 -> 5 -> 6 has rollbacks only and a wait that 1 leaving would end:
        // nothing to fail, nothing to lend. 6 -> 1 -> 2 -> 3 -> 4 -> 5 -> 6 has 2 to
        // fail. The table must find the second, whichever it meets first.
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        t.request(req(1, &[], &["S srv"]));
        t.request(req(3, &[], &["S srv", "X p"]));
        t.request(req(5, &[], &["X q"]));
        let mut step = req(2, &[1], &["X p"]);
        step.for_life = false;
        assert_eq!(t.request(step), Changes::default());
        assert_eq!(t.request(rollback(4, &[3], &["X q"])), Changes::default());
        let c = t.request(rollback(6, &[5], &["S srv"]));
        let [deadlock] = &c.deadlocks[..] else {
            panic!("{c:?}");
        };
        assert_eq!(
            (deadlock.victim, deadlock.victim_root),
            (ProcId(2), ProcId(1))
        );
        assert!(c.loans.is_empty() && c.granted.is_empty(), "{c:?}");
        check_holders(&t);
    }

    #[test]
    fn a_deadlock_beside_a_cycle_left_waiting_is_found_in_one_pass() {
        // A cycle of rollbacks the table leaves waiting (a step holder, 20, can end it
        // by leaving srv): 10 -> 7 -> 8 -> 2 -> 10. Upstream of it, a chain of K
        // stages: root H_i holds X r_i for life, and two children of it wait for
        // X r_{i+1} (the last stage's for X t1): 2^K paths lead into that cycle. Then a
        // plain deadlock between two trees that can roll back closes, through a
        // procedure that also waits on the chain: its victim must be found however
        // many paths the chain has (a search that went down each of them, as one
        // version did, ran out of budget and reported nothing).
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        t.request(req(2, &[], &["S srv"]));
        let mut third = req(20, &[], &["S srv"]);
        third.for_life = false;
        assert_eq!(t.request(third).granted, ids(&[20]));
        t.request(req(7, &[6], &["X t1"]));
        assert_eq!(t.request(rollback(8, &[6], &["S srv"])), Changes::default());
        assert_eq!(t.request(rollback(10, &[2], &["X t1"])), Changes::default());
        const K: u64 = 13;
        let h = |i: u64| 1000 + 10 * i;
        for i in 0..=K {
            let lock = format!("X r{i}");
            assert_eq!(t.request(req(h(i), &[], &[&lock])).granted, ids(&[h(i)]));
        }
        for i in 0..=K {
            let next = if i == K {
                "X t1".to_string()
            } else {
                format!("X r{}", i + 1)
            };
            for j in 1..=2 {
                let mut w = req(h(i) + j, &[h(i)], &[&next]);
                w.for_life = false;
                assert_eq!(t.request(w), Changes::default(), "stage {i}");
            }
        }
        // 100 holds X p; 200 holds X z, its child 201 waits for X p. 100's child 101
        // asks for X z and X r0: 101 -> 200 -> 201 -> 100 -> 101, and (searched
        // first, the larger id) 101 -> 1000 -> the chain.
        t.request(req(100, &[], &["X p"]));
        t.request(req(200, &[], &["X z"]));
        let mut zc = req(201, &[200], &["X p"]);
        zc.for_life = false;
        assert_eq!(t.request(zc), Changes::default());
        let mut s = req(101, &[100], &["X z", "X r0"]);
        s.for_life = false;
        let c = t.request(s);
        let [deadlock] = &c.deadlocks[..] else {
            panic!("{c:?}");
        };
        assert_eq!(deadlock.victim, ProcId(201), "the younger tree's waiter");
    }

    #[test]
    fn a_loan_over_a_counted_resource_lets_the_borrower_in_beside_its_idle_lender() {
        // srv (1 permit) is filled for life by 7 (tree 6). Tree 6 rolls back: its
        // rollback 8 needs X a, held for life by 2 (tree 2, past its point of no
        // return). 10, 2's step, needs S srv: 10 -> 7 (counted, frozen: tree 6 rolls
        // back) -> 8 -> 2 -> 10. 10 borrows 7's share: two holders of a one-permit
        // resource, one of which runs nothing until 10 is done (as a loan of an
        // exclusive lock lets the borrower in beside its lender).
        let mut t = LockTable::new();
        t.set_permits("srv", 1);
        t.set_irreversible(ProcId(2), true);
        assert_eq!(t.request(req(2, &[], &["X a"])).granted, ids(&[2]));
        assert_eq!(t.request(req(7, &[6], &["S srv"])).granted, ids(&[7]));
        assert_eq!(t.request(rollback(8, &[6], &["X a"])), Changes::default());
        let mut step = req(10, &[2], &["S srv"]);
        step.for_life = false;
        let c = t.request(step);
        let [loan] = &c.loans[..] else {
            panic!("{c:?}");
        };
        assert_eq!((loan.borrower, loan.lender), (ProcId(10), ProcId(7)));
        assert_eq!(c.granted, ids(&[10]));
        check_holders(&t);
    }

    #[test]
    fn a_parent_holding_a_counted_resource_for_a_step_takes_a_permit_from_its_child_too() {
        // srv has 2 permits: 6 holds it for one step (a parent woken per child runs
        // steps while its children run), 9 for life. 6's child 7 waits: a share held
        // for a step covers nothing, for the child as for anyone.
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        let mut step = req(6, &[], &["S srv"]);
        step.for_life = false;
        assert_eq!(t.request(step).granted, ids(&[6]));
        assert_eq!(t.request(req(9, &[], &["S srv"])).granted, ids(&[9]));
        let mut child = req(7, &[6], &["S srv"]);
        child.for_life = false;
        assert!(t.request(child).granted.is_empty());
        check_holders(&t);
        assert_eq!(t.release(ProcId(6)).granted, ids(&[7]));
        check_holders(&t);
    }

    #[test]
    fn a_cycle_a_holder_free_to_leave_could_end_is_left_waiting() {
        // srv (2 permits) is filled for life by 3 (tree 2, past its point of no return)
        // and 30 (tree 30). Tree 6 rolls back: 7 holds X t1 for life, its rollback 8
        // needs S srv. Then 10 (3's child) needs X t1: 10 -> 7 -> 8 -> 3 -> 10. 30 is
        // outside the cycle: if nothing holds it up, it leaves in time and ends 8's
        // wait, so 10 waits (before, 10 was failed, and paused: an operator had to
        // continue it). If a wait holds 30 up — one below it, or one rolling its tree
        // back — the table does not look further and breaks the cycle as before.
        struct Case {
            what: &'static str,
            holds_30_up: Option<Request>,
            victim: bool,
        }
        let cases = [
            Case {
                what: "30 is free",
                holds_30_up: None,
                victim: false,
            },
            Case {
                what: "30's child waits",
                holds_30_up: Some(req(31, &[30], &["X z"])),
                victim: true,
            },
            Case {
                what: "30's tree's rollback waits",
                holds_30_up: Some(rollback(32, &[30], &["X z"])),
                victim: true,
            },
        ];
        for case in cases {
            let mut t = LockTable::new();
            t.set_permits("srv", 2);
            t.set_irreversible(ProcId(2), true);
            assert_eq!(t.request(req(40, &[], &["X z"])).granted, ids(&[40]));
            assert_eq!(t.request(req(3, &[2], &["S srv"])).granted, ids(&[3]));
            assert_eq!(t.request(req(30, &[], &["S srv"])).granted, ids(&[30]));
            if let Some(wait) = case.holds_30_up {
                assert_eq!(t.request(wait), Changes::default(), "{}", case.what);
            }
            t.request(req(7, &[6], &["X t1"]));
            assert_eq!(t.request(rollback(8, &[6], &["S srv"])), Changes::default());
            let mut wait = req(10, &[3, 2], &["X t1"]);
            wait.for_life = false;
            let c = t.request(wait);
            assert!(
                c.granted.is_empty() && c.loans.is_empty(),
                "{}: {c:?}",
                case.what
            );
            let victims: Vec<ProcId> = c.deadlocks.iter().map(|d| d.victim).collect();
            let expected: &[u64] = if case.victim { &[10] } else { &[] };
            assert_eq!(victims, ids(expected), "{}", case.what);
            check_holders(&t);
            // 40 leaves, whatever waited on it goes and is done, then 30 leaves: srv
            // has room for 8, tree 6 rolls back, and X t1 is free for 10 if it waits.
            for done in t.release(ProcId(40)).granted {
                t.release(done);
            }
            assert_eq!(t.release(ProcId(30)).granted, ids(&[8]), "{}", case.what);
            t.release(ProcId(8));
            let granted = t.release(ProcId(7)).granted;
            let expected: &[u64] = if case.victim { &[] } else { &[10] };
            assert_eq!(granted, ids(expected), "{}", case.what);
            check_holders(&t);
        }
    }

    #[test]
    fn a_deadlock_behind_cycles_that_end_by_themselves_is_still_broken() {
        // srv (2 permits) is filled for life by 40 (tree 40) and 30 (tree 30); srv2 (2
        // permits) by 50 (tree 50) and 60 (tree 60, free to leave). 100 holds X p for
        // life. 40's children 41 and 30's child 31 wait for X p, and so does 50's
        // child 51; 40's child 42 and 30's child 32 wait for S srv2. Then 100's child
        // 101 asks for S srv: a real deadlock, 101 -> {40, 30} (srv), 40 -> 41 -> 100,
        // 30 -> 31 -> 100, 100 -> 101, whatever 60 does. The search from 101 first
        // meets 101 -> 40 -> 42 -> 50 -> 51 -> 100 -> 101, which 60 could end (srv2),
        // and excludes its loose links, among them 101 -> 40 (30 is not frozen by
        // that cycle); then 101 -> 30 -> 32 -> ..., likewise, excluding 101 -> 30.
        // Nothing is left to search, and no victim is reported.
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        t.set_permits("srv2", 2);
        hold_for_life(
            &mut t,
            &[
                (100, "X p"),
                (40, "S srv"),
                (30, "S srv"),
                (50, "S srv2"),
                (60, "S srv2"),
            ],
        );
        let mut victims = Vec::new();
        for (owner, parent, lock) in [
            (41, 40, "X p"),
            (31, 30, "X p"),
            (42, 40, "S srv2"),
            (32, 30, "S srv2"),
            (51, 50, "X p"),
            (101, 100, "S srv"),
        ] {
            let c = t.request(req(owner, &[parent], &[lock]));
            assert!(c.granted.is_empty(), "{owner}: {c:?}");
            victims.extend(c.deadlocks.iter().map(|d| d.victim));
        }
        check_holders(&t);
        // 60 leaves (free to), 42 and then 32 get srv2 and finish.
        assert_eq!(t.release(ProcId(60)).granted, ids(&[42]));
        assert_eq!(t.release(ProcId(42)).granted, ids(&[32]));
        assert!(t.release(ProcId(32)).granted.is_empty());
        // Left: 101 on srv (40, 30), 41, 31 and 51 on X p (100). Every holder is an
        // ancestor of a waiter, every waiter is blocked: a deadlock nobody broke.
        assert_broken(&t, &victims);
    }

    #[test]
    fn a_knot_whose_cycles_pass_through_another_waiter_is_found_from_it() {
        // srv has 1 permit, srv2 2. Trees 10, 20 and 30 roll back: 10 holds S srv2,
        // 20 X c and S srv, 30 S srv2, all for life. 20's rollback 1001 needs S srv2
        // (10, 30); 30's rollback 1003 needs S srv (20): 1003 -> 20 -> 1001 -> 30 ->
        // 1003, but 10 could leave, so it stands. 10's rollback 1004 then needs X c
        // (20): 1004 -> 20 -> 1001 -> 10 -> 1004, which 30 could leave by itself as
        // far as this cycle shows. Together the two cycles freeze both holders of srv2,
        // but no search from 1003 or 1004 sees both: only one from 1001, the waiter
        // they share, does. Before, all three rollbacks hung.
        let mut t = LockTable::new();
        t.set_permits("srv", 1);
        t.set_permits("srv2", 2);
        hold_for_life(
            &mut t,
            &[(10, "S srv2"), (20, "X c, S srv"), (30, "S srv2")],
        );
        assert_eq!(
            t.request(rollback(1001, &[20], &["S srv2"])),
            Changes::default()
        );
        assert_eq!(
            t.request(rollback(1003, &[30], &["S srv"])),
            Changes::default()
        );
        let c = t.request(rollback(1004, &[10], &["X c"]));
        let [loan] = &c.loans[..] else {
            panic!("{c:?}");
        };
        assert_eq!((loan.borrower, loan.lender), (ProcId(1001), ProcId(30)));
        assert!(loan.rollbacks_only);
        assert_eq!(c.granted, ids(&[1001]), "{c:?}");
        check_holders(&t);
        // 1001 done, tree 20 rolls back and leaves: 1003 and 1004 go.
        assert!(t.release(ProcId(1001)).granted.is_empty());
        assert_eq!(t.release(ProcId(20)).granted, ids(&[1004, 1003]));
        for done in [1003, 1004, 30, 10] {
            t.release(ProcId(done));
        }
        assert_eq!(t.len(), (0, 0));
        assert!(t.standing.is_empty());
    }

    #[test]
    fn a_cycle_left_standing_is_searched_again_only_when_it_may_have_changed() {
        // The standing cycle of `a_cycle_a_holder_free_to_leave_could_end_is_left_waiting`
        // (10 -> 7 -> 8 -> 3 -> 10, which 30 leaving srv ends), beside unrelated
        // holders: their releases search nothing; 30's release searches again (and
        // grants 8, ending the cycle); so does a wait that holds 30 up.
        for hold_30_up in [false, true] {
            let mut t = LockTable::new();
            t.set_permits("srv", 2);
            t.set_irreversible(ProcId(2), true);
            assert_eq!(t.request(req(3, &[2], &["S srv"])).granted, ids(&[3]));
            assert_eq!(t.request(req(30, &[], &["S srv"])).granted, ids(&[30]));
            t.request(req(7, &[6], &["X t1"]));
            assert_eq!(t.request(rollback(8, &[6], &["S srv"])), Changes::default());
            for i in 0..10 {
                let mut step = req(100 + i, &[], &[&format!("X u/{i}")]);
                step.for_life = false;
                assert_eq!(t.request(step).granted, ids(&[100 + i]));
            }
            let mut wait = req(10, &[3, 2], &["X t1"]);
            wait.for_life = false;
            assert_eq!(t.request(wait), Changes::default());
            assert!(t.standing.contains_key(&ProcId(10)), "{:?}", t.standing);
            let searches = t.searches.get();
            for i in 0..10 {
                t.release(ProcId(100 + i));
            }
            assert_eq!(t.searches.get(), searches, "unrelated releases");
            if hold_30_up {
                // 30's child waits for X z (40): 30 is held up, and the standing
                // cycle is searched again; it is broken as a deadlock then (victim 10),
                // as in that test's second case.
                assert_eq!(t.request(req(40, &[], &["X z"])).granted, ids(&[40]));
                let c = t.request(req(31, &[30], &["X z"]));
                assert!(t.searches.get() > searches);
                let victims: Vec<ProcId> = c.deadlocks.iter().map(|d| d.victim).collect();
                assert!(victims.contains(&ProcId(10)), "{c:?}");
            } else {
                assert_eq!(t.release(ProcId(30)).granted, ids(&[8]));
                assert!(t.searches.get() > searches);
                assert!(t.standing.is_empty(), "{:?}", t.standing);
            }
            check_holders(&t);
        }
    }

    #[test]
    fn a_knot_closed_by_a_wait_that_holds_up_no_concerned_procedure_is_found() {
        // srv (2 permits) is filled for life by 10 and 20; 30 holds X b, 40 X z, all
        // for life; trees 10, 20, 30 and 40 roll back. 20's rollback 21 waits for X z
        // (40, free to leave); 10's rollback 11 for X b (30); 30's rollback 31 for
        // S srv: 31 -> 10 -> 11 -> 30 -> 31, of rollbacks only, loose (20 is held up
        // by 21, not frozen by the cycle): left standing, concerned {10, 11, 20, 30, 31}.
        // Then 40's rollback 41 waits for X b (30): 41 -> 30 -> 31 -> 20 -> 21 -> 40
        // -> 41, loose too (10 is not frozen by it). Together the two cycles freeze
        // both holders of srv, and every holder now is frozen: a deadlock that only a
        // search from 31 (the waiter they share) sees whole. 41 holds up 40 only, which
        // is in no concerned list: with rechecks only for held-up concerned procedures
        // nothing searched from 31 again, and all four rollbacks hung. A wait that
        // closes a cycle of its own now rechecks the standing ones (a loan).
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        hold_for_life(
            &mut t,
            &[(10, "S srv"), (20, "S srv"), (30, "X b"), (40, "X z")],
        );
        assert_eq!(t.request(rollback(21, &[20], &["X z"])), Changes::default());
        assert_eq!(t.request(rollback(11, &[10], &["X b"])), Changes::default());
        assert_eq!(
            t.request(rollback(31, &[30], &["S srv"])),
            Changes::default()
        );
        assert!(t.standing.contains_key(&ProcId(31)), "{:?}", t.standing);
        let c = t.request(rollback(41, &[40], &["X b"]));
        check_holders(&t);
        check_loans(&t);
        let frozen = t
            .holders
            .values()
            .all(|h| t.rollback_waiters.contains_key(&h.root));
        assert!(
            !(c.loans.is_empty() && c.granted.is_empty() && c.deadlocks.is_empty()),
            "nothing broken; every holder frozen: {frozen}; waiting {:?}; standing {:?}",
            t.waiters.values().map(|w| w.req.owner).collect::<Vec<_>>(),
            t.standing
        );
    }

    #[test]
    fn a_waiter_failed_after_a_loan_in_the_same_call_is_not_reported_a_borrower() {
        // Trees 50 and 60 are past their point of no return; tree 10 rolls back. 60
        // holds X p, 10 X a, 50 X b, all for life; 10's rollback 11 and 50's child 51
        // wait for X p. 60's child 61 then needs X a and X b: 61 -> 10 -> 11 -> 60 ->
        // 61 lends it 10's locks, but 61 -> 50 -> 51 -> 60 -> 61 has no rollback and
        // nothing to lend, and its victim past a point of no return is 61 itself
        // (pauses). The call reported both the loan and the deadlock, though the loan
        // ended with 61's wait.
        let mut t = LockTable::new();
        t.set_irreversible(ProcId(60), true);
        t.set_irreversible(ProcId(50), true);
        hold_for_life(&mut t, &[(60, "X p"), (10, "X a"), (50, "X b")]);
        assert_eq!(t.request(rollback(11, &[10], &["X p"])), Changes::default());
        assert_eq!(t.request(req(51, &[50], &["X p"])), Changes::default());
        let c = t.request(req(61, &[60], &["X a", "X b"]));
        let victims: Vec<ProcId> = c.deadlocks.iter().map(|d| d.victim).collect();
        assert_eq!(victims, ids(&[61]), "{c:?}");
        assert!(c.loans.is_empty() && c.granted.is_empty(), "{c:?}");
        assert!(t.loans.is_empty() && t.loan_pins.is_empty());
        check_holders(&t);
    }

    /// Grants each `(owner, locks)` — a root, its locks written `"S srv, X b"` — for
    /// life, asserting it is granted at once.
    fn hold_for_life(t: &mut LockTable, holders: &[(u64, &str)]) {
        for &(owner, locks) in holders {
            let locks: Vec<&str> = locks.split(", ").collect();
            assert_eq!(t.request(req(owner, &[], &locks)).granted, ids(&[owner]));
        }
    }

    /// Asserts that a deadlock was broken (some victim), naming the waiters left.
    fn assert_broken(t: &LockTable, victims: &[ProcId]) {
        let stuck: Vec<ProcId> = t.waiters.values().map(|w| w.req.owner).collect();
        assert!(
            !victims.is_empty(),
            "no victim, and waiters {stuck:?} can never be granted"
        );
    }

    /// srv (1 permit) held by 30 and, under a loan, by 20's rollback 21: 20 holds X a,
    /// 30 S srv, 40 X b, all for life; trees 20 and 30 roll back, and 30's rollback
    /// 31 waits for X a and X b (see the two tests below).
    fn overfull_srv() -> LockTable {
        let mut t = LockTable::new();
        t.set_permits("srv", 1);
        hold_for_life(&mut t, &[(20, "X a"), (30, "S srv"), (40, "X b")]);
        let c = t.request(rollback(21, &[20], &["S srv"]));
        assert_eq!(c, Changes::default());
        let c = t.request(rollback(31, &[30], &["X a", "X b"]));
        let [loan] = &c.loans[..] else {
            panic!("{c:?}");
        };
        assert_eq!((loan.borrower, loan.lender), (ProcId(21), ProcId(30)));
        assert_eq!(c.granted, ids(&[21]));
        t
    }

    #[test]
    fn a_holder_leaving_an_overfull_counted_resource_does_not_end_the_wait() {
        // srv has 1 permit. Trees 20 and 30 roll back: 20 holds X a, 30 holds S srv,
        // 40 (runs on) holds X b, all for life. 20's rollback 21 needs S srv (30), 30's
        // rollback 31 needs X a (20) and X b (40): rollbacks only, 21 borrows 30's
        // locks and holds srv beside 30 — two holders on one permit. Then 40's child
        // 41 needs S srv: 41 -> 30 (srv) -> 31 -> 40 (X b) -> 41. 21 fills srv and,
        // a rollback step, is free to leave, so the cycle is taken to end by itself.
        // But 21 leaving leaves 30 alone on srv, still full for 41: a deadlock nobody
        // breaks (before the change, 41 was failed).
        let mut t = overfull_srv();
        let c = t.request(req(41, &[40], &["S srv"]));
        let mut victims: Vec<ProcId> = c.deadlocks.iter().map(|d| d.victim).collect();
        check_holders(&t);
        // 21's rollback step ends; tree 20 has nothing left waiting, so 20 rolls back
        // and leaves.
        let c = t.release(ProcId(21));
        assert!(c.granted.is_empty(), "{c:?}");
        victims.extend(c.deadlocks.iter().map(|d| d.victim));
        let c = t.release(ProcId(20));
        assert!(c.granted.is_empty(), "{c:?}");
        // Left: 41 on srv (30, frozen by 31), 31 on X b (40, frozen by 41).
        assert_broken(&t, &victims);
    }

    #[test]
    fn a_free_holder_of_one_counted_lock_does_not_end_a_wait_on_two() {
        // srv has 2 permits, srv2 1. 40 (tree 40) holds S srv and S srv2 for life, 50
        // (tree 50, free to leave) S srv, 30 (tree 30) X b. Tree 40 rolls back: 41
        // needs X b (30). 30's child 31 needs S srv and S srv2: 31 -> 40 -> 41 -> 30
        // -> 31. 50 fills srv and is free to leave, so the cycle is taken to end by
        // itself; but 50 leaving leaves srv2 full (40 alone): a deadlock nobody breaks
        // (before the change, 31 was failed).
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        t.set_permits("srv2", 1);
        hold_for_life(&mut t, &[(40, "S srv, S srv2"), (50, "S srv"), (30, "X b")]);
        assert_eq!(t.request(rollback(41, &[40], &["X b"])), Changes::default());
        let c = t.request(req(31, &[30], &["S srv", "S srv2"]));
        let mut victims: Vec<ProcId> = c.deadlocks.iter().map(|d| d.victim).collect();
        check_holders(&t);
        let c = t.release(ProcId(50));
        assert!(c.granted.is_empty(), "{c:?}");
        victims.extend(c.deadlocks.iter().map(|d| d.victim));
        // Left: 31 on srv2 (40, frozen by 41), 41 on X b (30, frozen by 31).
        assert_broken(&t, &victims);
    }

    /// Liveness under engine-like random calls (trees running on, past their point of
    /// no return, or rolling back; children for a step or for life under life-long
    /// holders; one rollback step at a time per failed tree; a victim's tree fails and
    /// its forward waiters are withdrawn, a paused victim is continued later), then
    /// every holder free to leave leaves, paused victims ask again, until nothing
    /// moves: nothing may be left waiting. `PROCTOR_LOCK_SEEDS` seeds (3 000) from
    /// `PROCTOR_LOCK_SEED_BASE` (0). It found the holes closed by `standing` (a cycle
    /// left standing that became a deadlock by a release, or by a wait elsewhere that
    /// held up the holder it counted on, or whose knot shows whole only from another of
    /// its waiters); 360 000 seeds pass.
    #[test]
    fn engine_like_calls_drain() {
        const LOCKS: [&str; 6] = ["X a", "X b", "X c", "S srv", "S srv2", "S srv3"];
        let seeds: u64 = std::env::var("PROCTOR_LOCK_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3000);
        let first: u64 = std::env::var("PROCTOR_LOCK_SEED_BASE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut stuck_seeds = Vec::new();
        let mut first_log = None;
        for seed in first..first + seeds {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut t = LockTable::new();
            t.set_permits("srv", rng.u32(1..=2));
            t.set_permits("srv2", rng.u32(1..=2));
            t.set_permits("srv3", 2);
            let some_locks = |rng: &mut fastrand::Rng| random_locks(rng, &LOCKS, 4);
            let trees = rng.u64(3..7);
            let mut course: Vec<Course> = Vec::new();
            let mut procs: Vec<(u64, Vec<u64>)> = Vec::new();
            let mut asked: HashMap<u64, Request> = HashMap::new();
            let mut paused: Vec<u64> = Vec::new();
            let mut log: Vec<String> = Vec::new();
            let tree = |root: ProcId| (root.0 / 10 - 1) as usize;
            // A victim's tree fails (its forward waiters withdrawn) or, past its point
            // of no return, the victim pauses.
            fn on_victims(
                t: &mut LockTable,
                c: &Changes,
                course: &mut [Course],
                paused: &mut Vec<u64>,
                log: &mut Vec<String>,
            ) {
                for d in &c.deadlocks {
                    let k = (d.victim_root.0 / 10 - 1) as usize;
                    match course[k] {
                        Course::PastNoReturn => paused.push(d.victim.0),
                        _ => {
                            course[k] = Course::RollsBack;
                            let waiting: Vec<ProcId> = t
                                .waiters
                                .values()
                                .filter(|w| w.req.root == d.victim_root && !w.req.rollback)
                                .map(|w| w.req.owner)
                                .collect();
                            for w in waiting {
                                let c = t.release(w);
                                log.push(format!("  withdraw {w} -> {c:?}"));
                            }
                        }
                    }
                }
            }
            for k in 1..=trees {
                let root = k * 10;
                let locks = some_locks(&mut rng);
                let c = [
                    Course::RunsOn,
                    Course::RunsOn,
                    Course::PastNoReturn,
                    Course::RollsBack,
                ][rng.usize(..4)];
                t.set_irreversible(ProcId(root), c == Course::PastNoReturn);
                let r = req(root, &[], &locks);
                asked.insert(root, r.clone());
                let ch = t.request(r);
                course.push(c);
                procs.push((root, Vec::new()));
                log.push(format!("{root}: {locks:?}, {c:?} -> {ch:?}"));
            }
            let mut next = 1000;
            // May `h` leave now: a step's holder, or a life-long one with nothing alive
            // below it and, of a failed tree, nothing of its tree waiting or stepping.
            let may_leave = |t: &LockTable,
                             paused: &[u64],
                             procs: &[(u64, Vec<u64>)],
                             course: &[Course],
                             h: &Request| {
                if !h.for_life {
                    return true;
                }
                let alive_below = t.holders.values().any(|o| o.ancestors.contains(&h.owner))
                    || t.waiters
                        .values()
                        .any(|o| o.req.ancestors.contains(&h.owner))
                    || paused
                        .iter()
                        .any(|p| procs.iter().any(|(q, a)| q == p && a.contains(&h.owner.0)));
                !alive_below
                    && (course[tree(h.root)] != Course::RollsBack
                        || !rolling_back_a_step(t, h.root))
            };
            for _ in 0..50 {
                if rng.u8(0..3) != 0 {
                    let locks = some_locks(&mut rng);
                    let Some((r, ancestors)) =
                        random_request(&mut rng, &course, &procs, &t, &mut next, &locks, &mut log)
                    else {
                        continue;
                    };
                    asked.insert(next, r.clone());
                    let c = t.request(r);
                    procs.push((next, ancestors));
                    log.push(format!("  -> {c:?}"));
                    on_victims(&mut t, &c, &mut course, &mut paused, &mut log);
                } else {
                    let may: Vec<ProcId> = t
                        .holders
                        .values()
                        .filter(|h| may_leave(&t, &paused, &procs, &course, h))
                        .map(|h| h.owner)
                        .collect();
                    release_one(&mut rng, &mut t, &may, &mut log);
                }
                check_loans(&t);
            }
            // Drain: holders free to leave leave; paused victims are continued.
            log.push("-- drain".into());
            let mut tries = 0;
            loop {
                let may: Vec<ProcId> = t
                    .holders
                    .values()
                    .filter(|h| may_leave(&t, &paused, &procs, &course, h))
                    .map(|h| h.owner)
                    .collect();
                if let Some(&h) = may.first() {
                    let c = t.release(h);
                    log.push(format!("release {h} -> {c:?}"));
                    check_loans(&t);
                    continue;
                }
                if paused.is_empty() || tries > 20 {
                    break;
                }
                tries += 1;
                for p in std::mem::take(&mut paused) {
                    let mut r = asked[&p].clone();
                    if course[tree(r.root)] == Course::RollsBack {
                        continue;
                    }
                    r.owner = ProcId(p);
                    let c = t.request(r);
                    log.push(format!("continue {p} -> {c:?}"));
                    on_victims(&mut t, &c, &mut course, &mut paused, &mut log);
                }
            }
            if !t.waiters.is_empty() && paused.is_empty() {
                stuck_seeds.push(seed);
                if first_log.is_none() {
                    let w: Vec<String> =
                        t.waiters.values().map(|w| format!("{:?}", w.req)).collect();
                    let h: Vec<String> = t.holders.values().map(|h| format!("{h:?}")).collect();
                    first_log = Some(format!(
                        "seed {seed}:\n{}\nwaiting:\n{}\nholding:\n{}",
                        log.join("\n"),
                        w.join("\n"),
                        h.join("\n")
                    ));
                }
            }
        }
        assert!(
            stuck_seeds.is_empty(),
            "{} stuck seeds {:?}\n{}",
            stuck_seeds.len(),
            &stuck_seeds[..stuck_seeds.len().min(30)],
            first_log.unwrap_or_default()
        );
    }

    #[test]
    fn a_cycle_left_standing_is_searched_again_when_a_holder_leaves() {
        // srv has 1 permit. Trees 20, 30 and 40 roll back: 20 holds X a, 30 S srv, 40
        // X b, all for life. 20's rollback 21 needs S srv (30), 30's rollback 31 needs
        // X a (20) and X b (40): 21 borrows 30's locks, two holders on one permit.
        // 40's rollback 41 then needs S srv: 41 -> 30 -> 31 -> 40 -> 41, of rollbacks
        // only, and 21 outside it could leave: no loan, the cycle is left standing.
        // When 21 leaves, srv is still full (30), and the cycle is a deadlock with no
        // new wait through it: before, nothing searched it again, and 31 and 41 hung
        // once 20 had rolled back. Now the release searches it, and 31 borrows 40's
        // locks.
        let mut t = overfull_srv();
        assert_eq!(
            t.request(rollback(41, &[40], &["S srv"])),
            Changes::default()
        );
        assert!(t.standing.contains_key(&ProcId(41)));
        let c = t.release(ProcId(21));
        let [loan] = &c.loans[..] else {
            panic!("{c:?}");
        };
        assert_eq!((loan.borrower, loan.lender), (ProcId(31), ProcId(40)));
        assert!(c.granted.is_empty() && c.deadlocks.is_empty(), "{c:?}");
        check_holders(&t);
        // 20 rolls back and leaves: 31 goes (under the loan), then tree 30 rolls back,
        // srv is free for 41, and tree 40 rolls back.
        assert_eq!(t.release(ProcId(20)).granted, ids(&[31]));
        check_holders(&t);
        t.release(ProcId(31));
        assert_eq!(t.release(ProcId(30)).granted, ids(&[41]));
        t.release(ProcId(41));
        t.release(ProcId(40));
        assert_eq!(t.len(), (0, 0));
        assert!(t.standing.is_empty());
    }

    #[test]
    fn cycles_that_freeze_a_counted_resource_only_together_are_loaned_over() {
        // srv (2 permits) is filled for life by 1 (tree 1) and 3 (tree 3). 5 holds
        // X q for life; 2 (1's child) and 4 (3's child) wait for it. Tree 5 rolls back:
        // 6 needs S srv. Cycles 6 -> 1 -> 2 -> 5 -> 6 and 6 -> 3 -> 4 -> 5 -> 6: each
        // alone has a holder of srv it does not freeze, but together they freeze both,
        // so nothing in them moves until one wait is granted. When 2 and 4 are steps
        // past their point of no return, failing them would only pause them; when they
        // are their trees' rollbacks, nothing can be failed. Either way, one borrows
        // 5's locks.
        for irreversible in [true, false] {
            let mut t = LockTable::new();
            t.set_permits("srv", 2);
            t.set_irreversible(ProcId(1), irreversible);
            t.set_irreversible(ProcId(3), irreversible);
            assert_eq!(t.request(req(5, &[], &["X q"])).granted, ids(&[5]));
            assert_eq!(t.request(req(1, &[], &["S srv"])).granted, ids(&[1]));
            assert_eq!(t.request(req(3, &[], &["S srv"])).granted, ids(&[3]));
            for (owner, parent) in [(2, 1), (4, 3)] {
                let wait = if irreversible {
                    let mut step = req(owner, &[parent], &["X q"]);
                    step.for_life = false;
                    step
                } else {
                    rollback(owner, &[parent], &["X q"])
                };
                assert_eq!(t.request(wait), Changes::default(), "{irreversible}");
            }
            let c = t.request(rollback(6, &[5], &["S srv"]));
            let [loan] = &c.loans[..] else {
                panic!("{irreversible}: {c:?}");
            };
            assert_eq!(loan.lender, ProcId(5), "{irreversible}");
            assert_eq!(loan.rollbacks_only, !irreversible, "{irreversible}");
            assert_eq!(loan.borrower, ProcId(2), "{irreversible}: the older tree's");
            assert_eq!(c.granted, ids(&[2]), "{irreversible}");
            // The cycle through 3 is left, and 1, no longer above a waiter, can leave
            // once 2 is done: no victim (before, 4 past its point of no return was
            // failed, and paused, though it would have been granted in time).
            assert!(c.deadlocks.is_empty(), "{c:?}");
            check_holders(&t);
            // 2 done, then its tree: srv has room for 6, tree 5 rolls back, and q is
            // free for 4.
            assert!(t.release(ProcId(2)).granted.is_empty());
            assert_eq!(t.release(ProcId(1)).granted, ids(&[6]));
            t.release(ProcId(6));
            assert_eq!(t.release(ProcId(5)).granted, ids(&[4]));
            check_holders(&t);
        }
    }

    #[test]
    fn a_waiter_a_loan_rests_on_does_not_borrow_until_that_loan_ends() {
        // srv (2 permits) is filled for life by 1 and 3; trees 1, 3 and 7 are past
        // their point of no return. Tree 5 rolls back: 5 holds X q, X r, X s for life,
        // its rollback 6 needs S srv. Waiting steps: 11 (1's child) for X q, 10 (1's
        // child) for X p (held by 7), 70 (7's child) for X s, 30 (3's child) for X r.
        // 6's wait closes cycles that together lend to 11 (1 frozen by 11, 3 by 30):
        // that loan rests on 30 waiting. The cycles left (through 30, and through 10
        // and 70) would together lend again; 30 borrowing would let tree 3 finish, srv
        // free a permit, and tree 5 roll back while 11 holds its locks. So 70 borrows.
        let step = |owner: u64, ancestors: &[u64], locks: &[&str]| {
            let mut r = req(owner, ancestors, locks);
            r.for_life = false;
            r
        };
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        for root in [1, 3, 7] {
            t.set_irreversible(ProcId(root), true);
        }
        assert_eq!(
            t.request(req(5, &[], &["X q", "X r", "X s"])).granted,
            ids(&[5])
        );
        assert_eq!(t.request(req(1, &[], &["S srv"])).granted, ids(&[1]));
        assert_eq!(t.request(req(3, &[], &["S srv"])).granted, ids(&[3]));
        assert_eq!(t.request(req(7, &[], &["X p"])).granted, ids(&[7]));
        for (owner, parent, lock) in [
            (11, 1, "X q"),
            (10, 1, "X p"),
            (30, 3, "X r"),
            (70, 7, "X s"),
        ] {
            assert_eq!(
                t.request(step(owner, &[parent], &[lock])),
                Changes::default()
            );
        }
        let c = t.request(rollback(6, &[5], &["S srv"]));
        let borrowers: Vec<ProcId> = c.loans.iter().map(|l| l.borrower).collect();
        assert_eq!(borrowers, ids(&[11, 70]), "{c:?}");
        check_holders(&t);
        // Each step ends, then its procedure and tree go on; tree 5's rollback is
        // granted only once no borrower of its locks holds.
        for done in [70, 7, 10, 11, 1] {
            t.release(ProcId(done));
            check_holders(&t);
        }
        assert_eq!(
            t.held_by(ProcId(6)).map(<[Lock]>::len),
            Some(1),
            "6 holds srv"
        );
    }

    /// How a tree of `loans_stay_safe_under_random_engine_calls` goes.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Course {
        RunsOn,
        PastNoReturn,
        RollsBack,
    }

    /// Random calls as the engine makes them, against the safety of loans: a few trees
    /// (running on, past their point of no return, or rolling back) whose procedures
    /// ask for locks for a step or for life (a rolling-back tree asks for one rollback
    /// at a time, when nothing else of it waits or holds for a step); holders release
    /// when they may (a step's at any time, a life-long one once no descendant of it is
    /// alive, and in a rolling-back tree only between its rollbacks); a deadlock's
    /// victim pauses past a point of no return (alive, asking nothing) or turns its
    /// tree to rolling back (its other waits withdrawn). After every call, no lender's
    /// tree runs while its borrower holds. About 300 loans in the 10 000 seeds (240 000
    /// seeds have run clean; without the loan pins it fails, rarely).
    /// Each of `locks` with a chance of one in `one_in`, and one of them if none came.
    fn random_locks(
        rng: &mut fastrand::Rng,
        locks: &[&'static str],
        one_in: u8,
    ) -> Vec<&'static str> {
        let mut v: Vec<&str> = locks
            .iter()
            .copied()
            .filter(|_| rng.u8(0..one_in) == 0)
            .collect();
        if v.is_empty() {
            v.push(locks[rng.usize(..locks.len())]);
        }
        v
    }

    /// Where the random models put a new procedure: under a life-long holder of a
    /// random tree (`course`'s index, its root, the new procedure's ancestors), or
    /// `None` when that tree has none.
    fn random_parent(
        rng: &mut fastrand::Rng,
        course: &[Course],
        procs: &[(u64, Vec<u64>)],
        t: &LockTable,
    ) -> Option<(usize, ProcId, Vec<u64>)> {
        let k = rng.usize(..course.len());
        let root = ProcId(k as u64 * 10 + 10);
        let parents: Vec<&(u64, Vec<u64>)> = procs
            .iter()
            .filter(|(p, a)| {
                (a.last().copied().unwrap_or(*p) == root.0) && t.holds(ProcId(*p)) == Some(true)
            })
            .collect();
        if parents.is_empty() {
            return None;
        }
        let (parent, above) = parents[rng.usize(..parents.len())];
        let ancestors = [*parent].into_iter().chain(above.iter().copied()).collect();
        Some((k, root, ancestors))
    }

    /// The next request of the random models, and its owner's ancestors: a rollback
    /// step of a random tree rolling back (if it waits for or takes none yet), or a
    /// step of a procedure under one of its life-long holders, for a step or for life;
    /// `None` when there is no place for it. Numbers the owner from `next`, and logs it.
    fn random_request(
        rng: &mut fastrand::Rng,
        course: &[Course],
        procs: &[(u64, Vec<u64>)],
        t: &LockTable,
        next: &mut u64,
        locks: &[&str],
        log: &mut Vec<String>,
    ) -> Option<(Request, Vec<u64>)> {
        let (k, root, ancestors) = random_parent(rng, course, procs, t)?;
        let r = if course[k] == Course::RollsBack {
            if rolling_back_a_step(t, root) {
                return None;
            }
            rollback(*next + 1, &ancestors, locks)
        } else {
            let mut r = req(*next + 1, &ancestors, locks);
            r.for_life = rng.bool();
            r
        };
        *next += 1;
        log.push(format!(
            "{next} under {ancestors:?}: {locks:?}, life {}, rollback {}",
            r.for_life, r.rollback
        ));
        Some((r, ancestors))
    }

    /// Releases one of `may` at random, if there is one, and logs it. Sorted first:
    /// the table's maps iterate in a per-process order, and a seed must replay.
    fn release_one(
        rng: &mut fastrand::Rng,
        t: &mut LockTable,
        may: &[ProcId],
        log: &mut Vec<String>,
    ) {
        if !may.is_empty() {
            let mut may = may.to_vec();
            may.sort_unstable();
            let h = may[rng.usize(..may.len())];
            let c = t.release(h);
            log.push(format!("release {h} -> {c:?}"));
        }
    }

    /// Whether the tree of `root` already waits for or takes a rollback step (a tree
    /// rolls back one step at a time).
    fn rolling_back_a_step(t: &LockTable, root: ProcId) -> bool {
        t.waiters.values().any(|w| w.req.root == root)
            || t.holders.values().any(|h| h.root == root && !h.for_life)
    }

    #[test]
    fn loans_stay_safe_under_random_engine_calls() {
        const LOCKS: [&str; 6] = ["X a", "X b", "X c", "X d", "S srv", "S srv2"];
        for seed in 0..10_000u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut t = LockTable::new();
            t.set_permits("srv", rng.u32(1..=2));
            t.set_permits("srv2", 1);
            let some_locks = |rng: &mut fastrand::Rng| random_locks(rng, &LOCKS, 3);
            let trees = rng.u64(3..6);
            let mut course: Vec<Course> = Vec::new();
            // Every procedure made, with its ancestors; paused victims stay alive.
            let mut procs: Vec<(u64, Vec<u64>)> = Vec::new();
            let mut paused: Vec<u64> = Vec::new();
            let mut log: Vec<String> = Vec::new();
            for k in 1..=trees {
                let root = k * 10;
                let locks = some_locks(&mut rng);
                t.request(req(root, &[], &locks));
                let c = [Course::RunsOn, Course::PastNoReturn, Course::RollsBack][rng.usize(..3)];
                t.set_irreversible(ProcId(root), c == Course::PastNoReturn);
                course.push(c);
                procs.push((root, Vec::new()));
                log.push(format!("{root}: {locks:?}, {c:?}"));
            }
            let tree = |root: ProcId| (root.0 / 10 - 1) as usize;
            let mut next = 1000;
            for _ in 0..60 {
                if rng.bool() {
                    // A new procedure under a life-long holder of a random tree.
                    let locks = some_locks(&mut rng);
                    let Some((r, ancestors)) =
                        random_request(&mut rng, &course, &procs, &t, &mut next, &locks, &mut log)
                    else {
                        continue;
                    };
                    let c = t.request(r);
                    procs.push((next, ancestors));
                    log.push(format!("  -> {c:?}"));
                    for d in &c.deadlocks {
                        match course[tree(d.victim_root)] {
                            Course::PastNoReturn => paused.push(d.victim.0),
                            _ => {
                                course[tree(d.victim_root)] = Course::RollsBack;
                                let waiting: Vec<ProcId> = t
                                    .waiters
                                    .values()
                                    .filter(|w| w.req.root == d.victim_root)
                                    .map(|w| w.req.owner)
                                    .collect();
                                for w in waiting {
                                    t.release(w);
                                }
                            }
                        }
                    }
                } else {
                    // A holder that may release does.
                    let alive_below = |h: ProcId| {
                        t.holders.values().any(|o| o.ancestors.contains(&h))
                            || t.waiters.values().any(|o| o.req.ancestors.contains(&h))
                            || paused
                                .iter()
                                .any(|p| procs.iter().any(|(q, a)| q == p && a.contains(&h.0)))
                    };
                    let may: Vec<ProcId> = t
                        .holders
                        .values()
                        .filter(|h| {
                            !h.for_life
                                || (!alive_below(h.owner)
                                    && (course[tree(h.root)] != Course::RollsBack
                                        || !rolling_back_a_step(&t, h.root)))
                        })
                        .map(|h| h.owner)
                        .collect();
                    release_one(&mut rng, &mut t, &may, &mut log);
                }
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_loans(&t)));
                assert!(ok.is_ok(), "seed {seed}:\n{}", log.join("\n"));
            }
        }
    }

    #[test]
    fn a_holder_under_its_ancestors_share_of_a_counted_resource_takes_no_permit() {
        // srv has 2 permits. 1 (for life) and its child 2 hold it: one line of descent,
        // one permit. 3 gets the second; 4 (another tree) waits; 5, a child of 1, is
        // under 1's share.
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        for (owner, ancestors, granted) in [
            (1, &[][..], true),
            (2, &[1][..], true),
            (3, &[][..], true),
            (4, &[][..], false),
            (5, &[1][..], true),
        ] {
            let c = t.request(req(owner, ancestors, &["S srv"]));
            assert_eq!(
                c.granted,
                if granted { vec![ProcId(owner)] } else { vec![] },
                "{owner}"
            );
            check_holders(&t);
        }
        // 2 and 5 leaving frees no permit; 1 leaving does (its children gone first).
        assert!(t.release(ProcId(2)).granted.is_empty());
        assert!(t.release(ProcId(5)).granted.is_empty());
        assert_eq!(t.release(ProcId(1)).granted, ids(&[4]));
        check_holders(&t);
        // A parent's share held for one step covers nothing: it may leave first.
        let mut t = LockTable::new();
        t.set_permits("srv", 2);
        let mut step = req(6, &[], &["S srv"]);
        step.for_life = false;
        assert_eq!(t.request(step).granted, ids(&[6]));
        assert_eq!(t.request(req(7, &[6], &["S srv"])).granted, ids(&[7]));
        assert!(t.request(req(8, &[], &["S srv"])).granted.is_empty());
        assert_eq!(t.release(ProcId(6)).granted, ids(&[8]));
        check_holders(&t);
    }

    #[test]
    fn a_cycle_of_rollbacks_and_steps_past_the_point_of_no_return_says_so() {
        // 42 (a rollback of tree 4) -> 91 (tree 9) -> 92 (a rollback of tree 9) -> 2
        // (tree 2, past its point of no return) -> 21 (its step) -> 41 (tree 4) -> 42.
        let mut t = LockTable::new();
        t.set_irreversible(ProcId(2), true);
        t.request(req(2, &[], &["X c"]));
        t.request(req(91, &[9], &["X a"]));
        t.request(req(41, &[4], &["X b"]));
        t.request(rollback(42, &[4], &["X a"]));
        t.request(rollback(92, &[9], &["X c"]));
        let mut step = req(21, &[2], &["X b"]);
        step.for_life = false;
        let c = t.request(step);
        let [loan] = &c.loans[..] else {
            panic!("{c:?}");
        };
        assert!(!loan.rollbacks_only, "{loan:?}");
        assert!(
            loan.to_string()
                .starts_with("deadlock past a point of no return: "),
            "{loan}"
        );
        check_holders(&t);
    }

    #[test]
    fn resource_names_are_checked() {
        for (name, ok) in [
            ("ns", true),
            ("ns/t1/r1", true),
            ("", false),
            ("/ns", false),
            ("ns/", false),
            ("ns//t", false),
        ] {
            assert_eq!(Lock::shared(name).check().is_ok(), ok, "{name:?}");
        }
    }

    fn conflicting(a: &Request, b: &Request, table: &LockTable) -> bool {
        if ancestry(a, b.owner) || ancestry(b, a.owner) {
            return false;
        }
        // A rollback goes in beside its own tree's holders, which run nothing meanwhile.
        if (a.rollback || b.rollback) && a.root == b.root {
            return false;
        }
        let lent = |x: &Request, y: &Request| {
            table
                .loans
                .get(&x.owner)
                .is_some_and(|l| l.contains(&y.owner))
        };
        if lent(a, b) || lent(b, a) {
            return false;
        }
        for la in &a.locks {
            for lb in &b.locks {
                let (ra, rb) = (la.resource.as_str(), lb.resource.as_str());
                let a_above_b = rb.starts_with(ra) && rb[ra.len()..].starts_with('/');
                let b_above_a = ra.starts_with(rb) && ra[rb.len()..].starts_with('/');
                let clash = if ra == rb {
                    let both_shared = la.mode == LockMode::Shared && lb.mode == LockMode::Shared;
                    !both_shared
                } else if a_above_b {
                    la.mode == LockMode::Exclusive
                } else if b_above_a {
                    lb.mode == LockMode::Exclusive
                } else {
                    false
                };
                if clash {
                    return true;
                }
            }
        }
        false
    }

    fn check_holders(t: &LockTable) {
        check_loans(t);
        let holders: Vec<&Request> = t.holders.values().collect();
        for (i, a) in holders.iter().enumerate() {
            for b in &holders[i + 1..] {
                assert!(!conflicting(a, b, t), "conflicting holders {a:?} and {b:?}");
            }
        }
        check_permits(t);
    }

    /// A lender's tree runs nothing (no rollback of it holds) while its borrower does.
    fn check_loans(t: &LockTable) {
        for (borrower, lenders) in &t.loans {
            if !t.holders.contains_key(borrower) {
                continue;
            }
            for root in lenders
                .iter()
                .filter_map(|l| t.holders.get(l).map(|r| r.root))
            {
                let running = t.holders.values().find(|h| h.rollback && h.root == root);
                assert!(
                    running.is_none(),
                    "{running:?} of tree {root} holds while {borrower} borrows its locks"
                );
            }
        }
    }

    /// At most a counted resource's permits of lines of descent hold it, among the
    /// holders that may run.
    fn check_permits(t: &LockTable) {
        for (resource, &permits) in &t.permits {
            // One permit per line of descent.
            let shared = t.nodes.get(resource).map_or(&[][..], |n| &n.shared[..]);
            let under_another = |h: &ProcId| {
                let life = |a: &ProcId| shared.contains(a) && t.holders[a].for_life;
                t.holders[h].ancestors.iter().any(life)
            };
            // Idle beside a holder that ignores it: a lender, or a holder of a tree
            // whose rollback holds.
            let idle = |h: &ProcId| {
                let lent = t
                    .loans
                    .iter()
                    .any(|(b, lenders)| lenders.contains(h) && shared.contains(b));
                let root = t.holders[h].root;
                let rolled_over = shared
                    .iter()
                    .any(|o| o != h && t.holders[o].rollback && t.holders[o].root == root);
                lent || rolled_over
            };
            let n = shared
                .iter()
                .filter(|h| !under_another(h) && !idle(h))
                .count();
            assert!(n <= permits as usize, "{n} holders of {resource}");
        }
    }

    const RESOURCES: [&str; 7] = [
        "ns", "ns/t1", "ns/t2", "ns/t1/r1", "ns/t1/r2", "ns/t2/r1", "srv",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random requests and releases from one-node trees never leave two conflicting
        /// holders, and releasing every holder in turn grants every waiter.
        #[test]
        fn no_conflicting_holders_and_every_waiter_is_granted(
            ops in proptest::collection::vec(
                (0u8..4, proptest::collection::vec((0usize..RESOURCES.len(), any::<bool>()), 1..3)),
                1..60,
            ),
        ) {
            let mut t = LockTable::new();
            t.set_permits("srv", 2);
            let mut next = 1u64;
            let mut held: Vec<ProcId> = Vec::new();
            for (op, locks) in ops {
                if op == 0 && !held.is_empty() {
                    let who = held.remove(0);
                    let c = t.release(who);
                    held.extend(c.granted);
                } else {
                    let locks = locks
                        .into_iter()
                        .map(|(r, x)| if x { Lock::exclusive(RESOURCES[r]) } else { Lock::shared(RESOURCES[r]) })
                        .collect();
                    let r = Request {
                        owner: ProcId(next),
                        root: ProcId(next),
                        ancestors: vec![],
                        locks,
                        for_life: true,
                        rollback: false,
                    };
                    next += 1;
                    let c = t.request(r);
                    prop_assert!(c.deadlocks.is_empty());
                    held.extend(c.granted);
                }
                check_holders(&t);
            }
            while !held.is_empty() {
                let who = held.remove(0);
                held.extend(t.release(who).granted);
                check_holders(&t);
            }
            prop_assert_eq!(t.len(), (0, 0));
            prop_assert!(t.nodes.is_empty());
        }

        /// Two-level trees: children ask under their root's life-long locks. Deadlocks
        /// may be found; either way no two conflicting holders, and once roots whose
        /// children are done release, everything drains.
        #[test]
        fn trees_never_hold_conflicting_locks_and_drain(
            ops in proptest::collection::vec(
                (0usize..4, 0usize..RESOURCES.len(), any::<bool>(), any::<bool>()),
                1..50,
            ),
        ) {
            let mut t = LockTable::new();
            let mut next = 100u64;
            let roots: Vec<u64> = (1..=4).collect();
            for (i, &root) in roots.iter().enumerate() {
                let r = RESOURCES[(i * 2) % RESOURCES.len()];
                t.request(Request {
                    owner: ProcId(root), root: ProcId(root), ancestors: vec![],
                    locks: vec![Lock::shared(r)], for_life: true, rollback: false,
                });
            }
            let mut children: Vec<(u64, ProcId)> = Vec::new();
            for (root, r, x, for_life) in ops {
                let root = roots[root];
                let lock = if x { Lock::exclusive(RESOURCES[r]) } else { Lock::shared(RESOURCES[r]) };
                let c = t.request(Request {
                    owner: ProcId(next), root: ProcId(root), ancestors: vec![ProcId(root)],
                    locks: vec![lock], for_life, rollback: false,
                });
                children.push((root, ProcId(next)));
                next += 1;
                for d in &c.deadlocks {
                    prop_assert!(d.to_string().starts_with("deadlock: "));
                    prop_assert!(t.waited_by(d.victim).is_none());
                    children.retain(|(_, c)| *c != d.victim);
                }
                check_holders(&t);
            }
            // Children finish (release as they are granted), then roots.
            loop {
                let granted: Vec<ProcId> = children.iter().map(|c| c.1).filter(|c| t.holds(*c).is_some()).collect();
                if granted.is_empty() { break; }
                for c in granted {
                    t.release(c);
                    children.retain(|(_, x)| *x != c);
                    check_holders(&t);
                }
            }
            // What is left waits on a root: roots whose children are all done release.
            let mut roots_left = roots.clone();
            while !roots_left.is_empty() {
                let Some(i) = roots_left.iter().position(|r| children.iter().all(|c| c.0 != *r)) else {
                    prop_assert!(false, "no root can finish: {:?}", children);
                    unreachable!();
                };
                let root = roots_left.remove(i);
                t.release(ProcId(root));
                loop {
                    let granted: Vec<ProcId> = children.iter().map(|c| c.1).filter(|c| t.holds(*c).is_some()).collect();
                    if granted.is_empty() { break; }
                    for c in granted {
                        t.release(c);
                        children.retain(|(_, x)| *x != c);
                    }
                }
                check_holders(&t);
            }
            prop_assert!(children.is_empty(), "{:?}", children);
            prop_assert_eq!(t.len(), (0, 0));
        }
    }
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// No waiter is ever left grantable (a lost wake-up), with two counted
        /// resources (`srv`, `ns/t1`), roots and children of holders (for life or for
        /// a step), rollbacks, releases of holders whose descendants neither hold nor
        /// wait, and withdrawals. Without rollbacks, no two holders conflict and no
        /// counted resource has more lines of descent in than its permits.
        #[test]
        fn no_waiter_is_left_grantable(
            permits in 1u32..3,
            with_rollbacks in any::<bool>(),
            ops in proptest::collection::vec(
                (
                    0u8..7,
                    0usize..64,
                    proptest::collection::vec((0usize..RESOURCES.len(), any::<bool>()), 1..3),
                    any::<bool>(),
                ),
                1..60,
            ),
        ) {
            let mut t = LockTable::new();
            t.set_permits("srv", permits);
            t.set_permits("ns/t1", 1);
            let mut next = 1u64;
            // Each procedure and its ancestors.
            let mut procs: Vec<(ProcId, Vec<ProcId>)> = Vec::new();
            for (op, pick, locks, life) in ops {
                let locks: Vec<Lock> = locks
                    .into_iter()
                    .map(|(r, x)| {
                        if x {
                            Lock::exclusive(RESOURCES[r])
                        } else {
                            Lock::shared(RESOURCES[r])
                        }
                    })
                    .collect();
                let rollback = with_rollbacks && op >= 5;
                match op {
                    0 | 1 | 5 | 6 => {
                        // A root, or a child of a holder (without rollbacks, of a
                        // life-long one, as the engine makes them).
                        let parents: Vec<&(ProcId, Vec<ProcId>)> = procs
                            .iter()
                            .filter(|(p, _)| match t.holds(*p) {
                                Some(for_life) => for_life || with_rollbacks,
                                None => false,
                            })
                            .collect();
                        let ancestors = match parents.len() {
                            n if op != 0 && n > 0 => {
                                let (p, a) = parents[pick % n];
                                let mut v = vec![*p];
                                v.extend(a.iter().copied());
                                v
                            }
                            _ => Vec::new(),
                        };
                        let owner = ProcId(next);
                        next += 1;
                        let root = *ancestors.last().unwrap_or(&owner);
                        t.request(Request {
                            owner,
                            root,
                            ancestors: ancestors.clone(),
                            locks,
                            for_life: life && !rollback,
                            rollback,
                        });
                        procs.push((owner, ancestors));
                    }
                    _ => {
                        let busy_below = |p: &ProcId| {
                            procs.iter().any(|(q, a)| {
                                a.contains(p)
                                    && (t.holds(*q).is_some() || t.waited_by(*q).is_some())
                            })
                        };
                        let free: Vec<ProcId> = procs
                            .iter()
                            .map(|(p, _)| *p)
                            .filter(|p| t.holds(*p).is_some() && !busy_below(p))
                            .chain(
                                procs
                                    .iter()
                                    .map(|(p, _)| *p)
                                    .filter(|p| op == 4 && t.waited_by(*p).is_some()),
                            )
                            .collect();
                        if !free.is_empty() {
                            t.release(free[pick % free.len()]);
                        }
                    }
                }
                if !with_rollbacks {
                    check_holders(&t);
                }
                for (&seq, w) in &t.waiters {
                    prop_assert!(
                        !t.grantable(&w.req, seq, w.priority),
                        "{:?} left grantable",
                        w.req
                    );
                }
            }
        }
    }
}
