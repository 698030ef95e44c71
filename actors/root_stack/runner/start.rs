//! A tree's start: a submitted root's runner (`submit`), a recovered tree's
//! (`recover`), whether a recovered tree starts without an actor (`starts_idle`), and
//! the start itself (`started`): the initial transition applied, the recovered
//! procedures that rerun fed to the core.

use super::*;

impl TreeRunner {
    /// A newly submitted root: `started` persists its insert and queues it.
    pub(crate) fn submit(
        shared: Arc<Shared>,
        me: TreeAddr,
        root: NewChild,
        proc: DynProc,
        ack: oneshot::Sender<Result<ProcId, Error>>,
    ) -> Self {
        let (id, data) = (root.id, root.data.clone());
        let (core, t) = RootStack::submit(root, now_ms());
        let mut unspawned = Objects::default();
        unspawned.insert(id, (proc, data));
        let mut runner = Self::new(shared, me, core, t, unspawned);
        if let Some(start) = &mut runner.start {
            start.submit_ack = Some(ack);
        }
        runner
    }

    /// A tree rebuilt by recovery: `core` and `t` from [`RootStack::recover`], the
    /// decoded objects of its unfinished procedures, and the suspended ones that run
    /// their next step at once instead of waiting for their event again.
    pub(crate) fn recover(
        shared: Arc<Shared>,
        me: TreeAddr,
        core: RootStack,
        mut t: Transition,
        objects: Objects,
        rerun: Vec<ProcId>,
    ) -> Self {
        t.actions
            .retain(|a| !matches!(a, Action::SuspendOn { id, .. } if rerun.contains(id)));
        let mut runner = Self::new(shared, me, core, t, objects);
        runner.recovered = true;
        if !rerun.is_empty() {
            runner.rare().rerun = rerun;
        }
        runner
    }

    /// Whether this recovered tree starts without an actor: its first transition writes
    /// nothing and only places its procedures (none with a deadline to arm), queues
    /// their steps and suspends them on their events, and nothing reruns — all of it
    /// messages to the shard's peers. Its shard then starts it on its own thread and
    /// keeps it passivated, as a tree that went quiet, until its first message (most
    /// often its first step's): a restart's cost follows the log, not an actor per tree.
    pub(crate) fn starts_idle(&self) -> bool {
        if !self.recovered || self.rare.as_ref().is_some_and(|r| !r.rerun.is_empty()) {
            return false;
        }
        let Some(t) = self.start.as_ref().and_then(|s| s.initial.as_ref()) else {
            return false;
        };
        t.persist.is_empty()
            && t.actions.iter().all(|action| match action {
                Action::Spawn(id) => self.core.deadline_of(*id).is_none(),
                Action::Enqueue { .. }
                | Action::Resume(_)
                | Action::SuspendOn { .. }
                | Action::Count(_) => true,
                _ => false,
            })
    }

    pub(super) fn new(
        shared: Arc<Shared>,
        me: TreeAddr,
        core: RootStack,
        t: Transition,
        unspawned: Objects,
    ) -> Self {
        let status = Arc::new(TreeStatus::new(shared.mandate.clone()));
        if core.is_failed() {
            status.set_failed();
        }
        TreeRunner {
            core,
            shared,
            procs: SortedMap::default(),
            leaving: None,
            live: 0,
            generation: 0,
            me,
            rare: None,
            unspawned: (!unspawned.is_empty()).then(|| Box::new(unspawned)),
            status,
            pending: Lent::default(),
            start: Some(Box::new(Start {
                initial: Some(t),
                submit_ack: None,
            })),
            performed: 0,
            recovered: false,
            dispatched: 0,
            result: None,
            halted: None,
            published: false,
            ended_queued: false,
        }
    }

    /// The tree joins its shard: its first transition is applied.
    pub(crate) fn started(&mut self, ctx: &mut TreeCtx<'_>) {
        if self.recovered && !self.core.is_failed() && self.core.is_irreversible() {
            // Before its steps ask for locks: a deadlock's victim is taken elsewhere.
            self.tell_irreversible(ctx);
        }
        if let Some(t) = self.start.as_mut().and_then(|s| s.initial.take()) {
            self.apply(t, None, ctx);
        }
        let rerun = self.rare.as_mut().map(|r| std::mem::take(&mut r.rerun));
        for id in rerun.unwrap_or_default() {
            self.feed(
                "rerun after recovery",
                |core| core.on_recovered_rerun(id),
                ctx,
            );
        }
    }
}
