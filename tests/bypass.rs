//! Bypass (HBCK2's `bypass`) through the executor, on both stores: a suspended
//! procedure is marked finished without running further or rolling back, its parent
//! goes on, a subtree needs the recursive flag, refusals say why, and the bypass is
//! persisted.

mod common;

use std::sync::Arc;

use common::{Recorder, Scripted, Step};
use proctor::{
    async_trait, Context, Error, Executor, Flow, Lock, ProcError, ProcId, ProcState, Procedure,
    ProcedureStore,
};
use serde::{Deserialize, Serialize};

fn suspended(name: &str) -> Scripted {
    Scripted::new(name, vec![Step::Suspend("never".into()), Step::More])
}

#[actix::test]
async fn a_suspended_child_is_bypassed_and_its_parent_goes_on() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let root = executor
            .submit(Scripted::new(
                "root",
                vec![Step::Children(vec![suspended("child")]), Step::More],
            ))
            .await
            .unwrap();
        let child = common::waiting_children(&executor, root, 1).await[0];
        executor.bypass(child, false).await.unwrap();
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("child-exec"), 1, "{name}: ran no further");
        assert_eq!(rec.count("root-exec"), 2, "{name}: the parent went on");
        assert!(
            rec.calls().iter().all(|c| !c.ends_with("rollback")),
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn a_subtree_needs_the_recursive_flag_and_refusals_say_why() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let root = executor
            .submit(Scripted::new(
                "root",
                vec![
                    Step::Children(vec![suspended("a"), suspended("b")]),
                    Step::More,
                ],
            ))
            .await
            .unwrap();
        while rec.count("a-exec") + rec.count("b-exec") < 2 {
            tokio::task::yield_now().await;
        }
        common::wait_for_state(&executor, root, ProcState::Waiting).await;
        match executor.bypass(root, false).await {
            Err(Error::BypassRefused { id, reason }) => {
                assert_eq!(id, root);
                assert!(reason.contains("unfinished children"), "{name}: {reason}");
            }
            other => panic!("{name}: {other:?}"),
        }
        // Wait until both children are durably suspended, then bypass the tree.
        common::waiting_children(&executor, root, 2).await;
        executor.bypass(root, true).await.unwrap();
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("root-exec"), 1, "{name}: the root ran no further");
        // Finished, and unknown: refused with the reason.
        assert!(matches!(
            executor.bypass(root, true).await,
            Err(Error::Finished { .. })
        ));
        assert!(matches!(
            executor.bypass(ProcId(1 << 40), false).await,
            Err(Error::UnknownProcedure(_))
        ));
        // One in a step cannot be bypassed under it.
        let busy = common::start_gated(&executor, &rec, "busy").await;
        match executor.bypass(busy, false).await {
            Err(Error::BypassRefused { reason, .. }) => {
                assert!(
                    reason.contains("only a waiting or paused procedure"),
                    "{name}: {reason}"
                )
            }
            other => panic!("{name}: {other:?}"),
        }
        rec.gate.notify_waiters();
        assert_eq!(executor.wait(busy).await.unwrap(), Ok(()));
        executor.shutdown_now().await.unwrap();
    }
}

/// A PAUSED procedure (its work finished by hand, say) can be bypassed: it ends
/// SUCCESS, marked bypassed, without running again. (Every state's bypass, the
/// refusals included, is a table in the core's tests.)
#[actix::test]
async fn a_paused_procedure_can_be_bypassed() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let root = executor.submit(suspended("p")).await.unwrap();
        common::wait_for_state(&executor, root, ProcState::Waiting).await;
        executor.pause(root).await.expect("paused at once");
        executor.bypass(root, false).await.unwrap();
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        let info = executor.state(root).await.unwrap();
        assert!(info.steering.paused.is_none(), "{name}: no longer paused");
        assert!(info.bypassed, "{name}: marked bypassed");
        assert_eq!(rec.count("p-exec"), 1, "{name}: ran no further");
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn a_bypass_is_persisted() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = common::start(store.open(), 4).await;
        let root = executor.submit(suspended("root")).await.unwrap();
        common::wait_for_state(&executor, root, ProcState::Waiting).await;
        executor.bypass(root, false).await.unwrap();
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        executor.shutdown_now().await.unwrap();

        let snapshot = store.open().load().unwrap();
        let record = snapshot.records.iter().find(|r| r.id == root).unwrap();
        assert!(record.bypassed, "{name}");
        assert_eq!(record.state, ProcState::Success, "{name}");
        let (executor, rec) = common::start(store.open(), 4).await;
        assert!(executor.recovery().recovered_roots.is_empty(), "{name}");
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("root-exec"), 0, "{name}");
        assert!(
            executor.state(root).await.unwrap().bypassed,
            "{name}: after a restart too"
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// What a bypassed procedure was stays readable: its final record keeps its state as
/// recorded — online or on a stopped engine (`proctor bypass`), waiting, paused, or a
/// child bypassed with its parent — so an operator (or a verifier) can decode it until
/// its result is evicted. The records used to carry no state at all.
#[actix::test]
async fn a_bypassed_procedure_keeps_its_state_in_its_final_record() {
    for name in common::STORES {
        for how in ["online", "paused", "offline", "recursive"] {
            let store = common::Reopen::new(name);
            let (executor, _) = common::start(store.open(), 4).await;
            let root = executor
                .submit(match how {
                    "recursive" => Scripted::new(
                        "root",
                        vec![Step::Children(vec![suspended("child")]), Step::More],
                    ),
                    _ => suspended("root"),
                })
                .await
                .unwrap();
            let child = match how {
                "recursive" => Some(common::waiting_children(&executor, root, 1).await[0]),
                _ => {
                    common::wait_for_state(&executor, root, ProcState::Waiting).await;
                    None
                }
            };
            match how {
                "offline" => {}
                "paused" => {
                    executor.pause(root).await.unwrap();
                    executor.bypass(root, false).await.unwrap();
                }
                _ => executor.bypass(root, true).await.unwrap(),
            }
            executor.shutdown().await.unwrap();
            if how == "offline" {
                let mut s = store.open();
                let records = s.load().unwrap().records;
                let ops = proctor::ops::recovery::bypass(&records, root, false, 0).unwrap();
                s.append(&ops).unwrap();
            }

            let snapshot = store.open().load().unwrap();
            let record = snapshot.records.iter().find(|r| r.id == root).unwrap();
            assert!(record.bypassed, "{name}, {how}");
            assert_eq!(record.state, ProcState::Success, "{name}, {how}");
            let state: Scripted = rmp_serde::from_slice(&record.data)
                .unwrap_or_else(|e| panic!("{name}, {how}: the root's state decodes: {e}"));
            assert_eq!(
                (state.name.as_str(), state.at),
                ("root", 1),
                "{name}, {how}"
            );
            // The bypassed child is deleted with its finished tree; the root's record
            // is what stays.
            if let Some(child) = child {
                assert!(snapshot.records.iter().all(|r| r.id != child), "{name}");
            }
        }
    }
}

/// A step that never ends holds its procedure RUNNABLE: a plain bypass refuses it, a
/// forced one (HBCK2's `bypass -o`) drops the step and ends it SUCCESS; its parent goes
/// on, on the one worker the stuck step held, and nothing rolls back.
#[actix::test]
async fn a_child_stuck_in_a_step_is_force_bypassed_and_its_parent_goes_on() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 1).await;
        let stuck = Scripted::new("stuck", vec![Step::Gate]);
        let root = executor
            .submit(Scripted::new(
                "root",
                vec![Step::Children(vec![stuck]), Step::More],
            ))
            .await
            .unwrap();
        while rec.count("stuck-exec") == 0 {
            tokio::task::yield_now().await;
        }
        let list = proctor::List::new().root(root);
        let list = executor.list(list).await.unwrap();
        let child = list.iter().find(|p| p.parent == Some(root)).unwrap().id;
        match executor.bypass(child, false).await {
            Err(Error::BypassRefused { reason, .. }) => {
                assert!(reason.contains("force the bypass"), "{name}: {reason}")
            }
            other => panic!("{name}: {other:?}"),
        }
        executor.force_bypass(child, false).await.unwrap();
        assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("stuck-exec"), 1, "{name}");
        assert_eq!(rec.count("root-exec"), 2, "{name}: the parent went on");
        assert!(
            rec.calls().iter().all(|c| !c.ends_with("rollback")),
            "{name}: {:?}",
            rec.calls()
        );
        // The gate opens late: the dropped step does not come back to life.
        rec.gate.notify_waiters();
        let (_, after) = common::run(&executor, Scripted::new("after", vec![Step::More])).await;
        assert_eq!(after, Ok(()), "{name}: the worker is free");
        assert_eq!(rec.count("stuck-exec"), 1, "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// A procedure queued behind a stuck one (one worker) is bypassed before its step
/// runs: the step never runs, and the tree's result waits only for the step to come
/// back from the scheduler once the stuck one is bypassed too.
#[actix::test]
async fn a_queued_step_is_dropped_by_a_forced_bypass() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 1).await;
        let busy = common::start_gated(&executor, &rec, "busy").await;
        let queued = executor
            .submit(Scripted::new("queued", vec![Step::More]))
            .await
            .unwrap();
        executor.force_bypass(queued, false).await.unwrap();
        executor.force_bypass(busy, false).await.unwrap();
        assert_eq!(executor.wait(busy).await.unwrap(), Ok(()), "{name}");
        assert_eq!(executor.wait(queued).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("queued-exec"), 0, "{name}: its step never ran");
        assert!(executor.state(queued).await.unwrap().bypassed, "{name}");
        let (_, after) = common::run(&executor, Scripted::new("after", vec![Step::More])).await;
        assert_eq!(after, Ok(()), "{name}: the worker is free");
        executor.shutdown_now().await.unwrap();
    }
}

/// Holds an exclusive lock on `resource` for its one step, which waits at the gate when
/// `gated`.
#[derive(Serialize, Deserialize)]
struct Locking {
    name: String,
    resource: String,
    gated: bool,
}

/// Records its call when dropped unless defused (`.0 = None`): a step's future dropped
/// before it ended.
struct DropProbe(Option<(Arc<Recorder>, String)>);

impl Drop for DropProbe {
    fn drop(&mut self) {
        if let Some((rec, call)) = self.0.take() {
            rec.record(call);
        }
    }
}

#[async_trait]
impl Procedure<Recorder> for Locking {
    async fn execute(&mut self, ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        let rec = ctx.env_arc().clone();
        rec.record(format!("{}-exec", self.name));
        if self.gated {
            let mut probe = DropProbe(Some((rec.clone(), format!("{}-dropped", self.name))));
            rec.gate.notified().await;
            probe.0 = None;
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        ctx.env().record(format!("{}-rollback", self.name));
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        vec![Lock::exclusive(&self.resource)]
    }
}

/// A forced bypass of the lock's holder, stuck in its step, releases the lock; one of
/// a procedure waiting for it withdraws the wait. Others then take the lock.
#[actix::test]
async fn a_forced_bypass_releases_the_holders_lock_and_withdraws_a_waiters() {
    let locking = |name: &str, gated| Locking {
        name: name.to_string(),
        resource: "table/t1".to_string(),
        gated,
    };
    for (name, store, _dir) in common::stores() {
        let rec = Arc::new(Recorder::default());
        let mut registry = common::registry();
        registry.register::<Locking>("locking");
        let executor = Executor::builder()
            .registry(registry)
            .store(store)
            .workers(4)
            .env(rec.clone())
            .start()
            .await
            .unwrap();
        let holder = executor.submit(locking("holder", true)).await.unwrap();
        while rec.count("holder-exec") == 0 {
            tokio::task::yield_now().await;
        }
        let waiter = executor.submit(locking("waiter", false)).await.unwrap();
        let waits = |report: proctor::LockReport| {
            report
                .resources
                .iter()
                .any(|r| r.waiters.iter().any(|(id, _)| *id == waiter))
        };
        while !waits(executor.locks().await.unwrap()) {
            tokio::task::yield_now().await;
        }
        executor.force_bypass(waiter, false).await.unwrap();
        assert_eq!(executor.wait(waiter).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("waiter-exec"), 0, "{name}: it never ran");
        executor.force_bypass(holder, false).await.unwrap();
        assert_eq!(executor.wait(holder).await.unwrap(), Ok(()), "{name}");
        assert_eq!(
            rec.count("holder-dropped"),
            1,
            "{name}: its step was dropped"
        );
        let next = executor.submit(locking("next", false)).await.unwrap();
        assert_eq!(executor.wait(next).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("next-exec"), 1, "{name}: the lock was released");
        executor.shutdown_now().await.unwrap();
    }
}

/// Forced bypasses at random moments, with the actor layer's perturbation points on: a
/// tree whose one worker a stuck child holds, siblings queued or in short steps, a
/// random procedure of it force-bypassed (recursively) after a random wait, then the
/// root. Whatever the order, the tree ends SUCCESS without a rollback, every worker is
/// free again (a new procedure runs on the one worker), and the scheduler's own check
/// (a tree's end with no step of it out) holds. `PROCTOR_BYPASS_SEEDS` sets how many
/// seeds (default 40 a store).
#[actix::test]
async fn forced_bypasses_at_random_moments_leave_no_step_behind() {
    let seeds: u64 = std::env::var("PROCTOR_BYPASS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    for seed in 1..=seeds {
        for (name, store, _dir) in common::stores() {
            proctor::perturb::set_seed(seed);
            let mut rng = fastrand::Rng::with_seed(seed);
            let (executor, rec) = common::start(store, 1).await;
            let mut children = vec![Scripted::new("stuck", vec![Step::Gate])];
            for c in 0..rng.usize(1..4) {
                let plan = (0..rng.usize(1..4))
                    .map(|_| match rng.u8(0..3) {
                        0 => Step::More,
                        1 => Step::Yield,
                        _ => Step::Sleep(rng.u64(0..3)),
                    })
                    .collect();
                children.push(Scripted::new(&format!("c{c}"), plan));
            }
            rng.shuffle(&mut children);
            let root = executor
                .submit(Scripted::new(
                    "root",
                    vec![Step::Children(children), Step::More],
                ))
                .await
                .unwrap();
            for _ in 0..rng.u32(0..200) {
                tokio::task::yield_now().await;
            }
            let list = executor
                .list(proctor::List::new().root(root))
                .await
                .unwrap();
            let live: Vec<ProcId> = list
                .iter()
                .filter(|p| !p.state.is_finished())
                .map(|p| p.id)
                .collect();
            let context = format!("seed {seed}, {name}");
            if let Some(&pick) = live.get(rng.usize(..live.len().max(1))) {
                // It may finish meanwhile: the executor or its tree says so.
                match executor.force_bypass(pick, true).await {
                    Ok(()) | Err(Error::Finished { .. }) => {}
                    Err(Error::BypassRefused { reason, .. }) if reason.contains("finished") => {}
                    Err(e) => panic!("{context}: bypass of {pick}: {e}"),
                }
            }
            match executor.force_bypass(root, true).await {
                Ok(()) | Err(Error::Finished { .. }) => {}
                Err(e) => panic!("{context}: bypass of the root: {e}"),
            }
            assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{context}");
            assert!(
                rec.calls().iter().all(|c| !c.ends_with("rollback")),
                "{context}: {:?}",
                rec.calls()
            );
            let (_, after) = common::run(&executor, Scripted::new("after", vec![Step::More])).await;
            assert_eq!(after, Ok(()), "{context}: the worker is free");
            executor.shutdown_now().await.unwrap();
        }
    }
    proctor::perturb::set_seed(0);
}
