//! Bypass (HBCK2's `bypass`) through the executor, on both stores: a suspended
//! procedure is marked finished without running further or rolling back, its parent
//! goes on, a subtree needs the recursive flag, refusals say why, and the bypass is
//! persisted.

mod common;

use common::{Scripted, Step};
use proctor::{Error, ProcId, ProcState, ProcedureStore};

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
