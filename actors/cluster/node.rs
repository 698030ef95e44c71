//! [`NodeActor`]: a cluster member. It holds the membership, runs one engine per
//! partition it owns, and keeps the two in step with the partitions' table:
//!
//! - a partition the table gives it and it does not run is claimed (its epoch bumped by
//!   the database, only while the membership is live) and an engine started for it,
//!   fenced with the claimed epoch;
//! - a partition whose epoch moved past its engine's is lost: the engine is told
//!   (it steps down, calling no user code after) and stopped at once;
//! - a partition the coordinator wants elsewhere is handed off: its engine stopped
//!   gracefully first, then the partition given to the wanted member in one statement
//!   that checks the epoch;
//! - when the membership is lost, every engine is lost with it (their calls already
//!   stopped: the membership's term is theirs), and the member joins again.
//!
//! One slot per partition, so at most one engine of a partition runs in a member,
//! and a new one starts only after the last has stopped.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::watch;

use super::db::{self, ClusterDb, Request, Shared};
use super::{EngineFactory, Grant, Routes};
use crate::actors::pg_store::cluster::{Forwarded, PartitionState};
use crate::actors::pg_store::{Leadership, Loss, PgLease, PgOptions, PgStore};
use crate::actors::Executor;
use crate::error::Error;
use crate::record::Nonce;
use crate::registry::Registry;

/// What a member is made of.
pub(crate) struct Setup<E: Send + Sync + 'static> {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) options: PgOptions,
    pub(crate) partitions: u32,
    pub(crate) period: Duration,
    pub(crate) engines: EngineFactory<E>,
    pub(crate) registry: Arc<Registry<E>>,
    pub(crate) routes: Arc<Routes<E>>,
}

/// The membership the member holds.
struct Member {
    leadership: Leadership,
}

/// One partition in the member.
enum Slot<E: Send + Sync + 'static> {
    /// Its claim is on its way.
    Claiming,
    /// Its engine is starting, under `epoch`.
    Starting { epoch: i64 },
    /// Its engine runs, under `epoch`; `lost` tells it the partition is gone.
    Running {
        epoch: i64,
        engine: Executor<E>,
        lost: watch::Sender<Option<Loss>>,
    },
    /// Its engine is stopping.
    Stopping,
}

/// A cluster member (see the module docs).
pub struct NodeActor<E: Send + Sync + 'static> {
    setup: Setup<E>,
    requests: mpsc::Sender<Request>,
    shared: Arc<Shared>,
    member: Option<Member>,
    joining: bool,
    slots: HashMap<u32, Slot<E>>,
    leaving: bool,
    coordinator: Option<SpawnHandle>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The actix system is the member's own: stopped when the member stops.
    owned_system: bool,
}

impl<E: Send + Sync + 'static> std::fmt::Debug for NodeActor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeActor")
            .field("name", &self.setup.name)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> Actor for NodeActor<E> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.join(ctx);
        self.coordinate(ctx);
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.shared.stop();
        self.shared.set_coordinating(None);
        if let Some(thread) = self.thread.take() {
            // It ends within a poll; not joined here (a member's actor stops on its
            // system's thread, which the DB thread's last send may wait on).
            drop(thread);
        }
        if self.owned_system {
            System::current().stop();
        }
    }
}

impl<E: Send + Sync + 'static> NodeActor<E> {
    /// Starts the member's actor and its thread on `db`.
    pub(crate) fn start_with(
        setup: Setup<E>,
        db: ClusterDb,
        shared: Arc<Shared>,
        owned_system: bool,
    ) -> Result<(Addr<Self>, mpsc::Sender<Request>), Error> {
        let (requests, inbox) = mpsc::channel();
        let tick = (setup.period / 6).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let thread_shared = shared.clone();
        let actor_requests = requests.clone();
        let mut spawn_error = None;
        let addr = NodeActor::create(|ctx| {
            let addr = ctx.address();
            let thread = std::thread::Builder::new()
                .name("proctor-cluster".to_string())
                .spawn(move || db::run(db, &inbox, &thread_shared, &addr, tick));
            let thread = match thread {
                Ok(thread) => Some(thread),
                Err(e) => {
                    spawn_error = Some(e);
                    None
                }
            };
            NodeActor {
                setup,
                requests: actor_requests,
                shared,
                member: None,
                joining: false,
                slots: HashMap::new(),
                leaving: false,
                coordinator: None,
                thread,
                owned_system,
            }
        });
        if let Some(e) = spawn_error {
            addr.do_send(Leave);
            return Err(Error::Config(format!(
                "cannot start the cluster's thread: {e}"
            )));
        }
        Ok((addr, requests))
    }

    /// Takes the membership (waiting while the name is live elsewhere).
    fn join(&mut self, ctx: &mut Context<Self>) {
        if self.joining || self.leaving {
            return;
        }
        self.joining = true;
        let lease = PgLease::member(self.setup.url.clone(), self.setup.name.clone())
            .options(self.setup.options.clone())
            .period(self.setup.period);
        let retry = self.setup.period / 3;
        ctx.spawn(actix::fut::wrap_future(lease.acquire()).map(
            move |taken, act: &mut Self, ctx: &mut Context<Self>| {
                act.joining = false;
                match taken {
                    Ok(leadership) if !act.leaving => act.joined(leadership, ctx),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(target: crate::targets::EXECUTOR, error = %e, "cluster: cannot join; trying again");
                        ctx.run_later(retry, |act, ctx| act.join(ctx));
                    }
                }
            },
        ));
    }

    fn joined(&mut self, leadership: Leadership, ctx: &mut Context<Self>) {
        tracing::info!(target: crate::targets::EXECUTOR, member = %self.setup.name, epoch = leadership.epoch(), "joined the cluster");
        let epoch = leadership.epoch();
        let lost = leadership.signal();
        self.member = Some(Member { leadership });
        ctx.spawn(
            actix::fut::wrap_future(crate::actors::pg_store::lost_reason(lost)).map(
                move |loss: Loss, act: &mut Self, ctx: &mut Context<Self>| {
                    act.member_lost(epoch, loss, ctx);
                },
            ),
        );
    }

    /// The membership at `epoch` is lost: every engine with it; then join again.
    fn member_lost(&mut self, epoch: i64, loss: Loss, ctx: &mut Context<Self>) {
        let current = self.member.as_ref().map(|m| m.leadership.epoch());
        if current != Some(epoch) || self.leaving {
            return;
        }
        tracing::error!(target: crate::targets::EXECUTOR, member = %self.setup.name, reason = %loss.reason, "lost the cluster membership: stopping every partition's engine");
        self.end_membership();
        let partitions: Vec<u32> = self.slots.keys().copied().collect();
        for partition in partitions {
            self.lose(partition, &loss.reason, ctx);
        }
        self.join(ctx);
    }

    /// Coordinates the cluster while it holds the leader lease, and waits for it as a
    /// standby otherwise.
    fn coordinate(&mut self, ctx: &mut Context<Self>) {
        let lease = PgLease::new(self.setup.url.clone(), self.setup.name.clone())
            .options(self.setup.options.clone())
            .period(self.setup.period);
        let shared = self.shared.clone();
        let name = self.setup.name.clone();
        let retry = self.setup.period / 3;
        let coordinate = async move {
            loop {
                let leadership = match lease.clone().acquire().await {
                    Ok(leadership) => leadership,
                    Err(e) => {
                        tracing::warn!(target: crate::targets::EXECUTOR, error = %e, "cluster: cannot take the coordinator's lease; trying again");
                        actix::clock::sleep(retry).await;
                        continue;
                    }
                };
                tracing::info!(target: crate::targets::EXECUTOR, member = %name, epoch = leadership.epoch(), "coordinating the cluster");
                shared.set_coordinating(Some((name.clone(), leadership.epoch())));
                let reason = leadership.lost().await;
                shared.set_coordinating(None);
                tracing::warn!(target: crate::targets::EXECUTOR, member = %name, %reason, "no longer coordinating the cluster");
            }
        };
        self.coordinator = Some(ctx.spawn(actix::fut::wrap_future(coordinate)));
    }

    /// Drops the membership: its thread is stopped and joined (and the membership let
    /// go) on a blocking thread, not this one, which the member's engines share.
    fn end_membership(&mut self) {
        if let Some(member) = self.member.take() {
            tokio::task::spawn_blocking(move || drop(member));
        }
    }

    fn member_epoch(&self) -> Option<i64> {
        self.member.as_ref().map(|m| m.leadership.epoch())
    }

    /// Keeps the member's engines in step with the partitions' table.
    fn reconcile(&mut self, partitions: Vec<PartitionState>, ctx: &mut Context<Self>) {
        if self.leaving || self.member.is_none() {
            return;
        }
        for row in partitions {
            let p = row.partition;
            let mine = row.owner.as_deref() == Some(self.setup.name.as_str());
            match self.slots.get(&p) {
                None if mine => self.claim(p, ctx),
                Some(Slot::Running { epoch, .. }) => {
                    let epoch = *epoch;
                    if row.epoch > epoch {
                        let reason = format!(
                            "partition {p} moved on to epoch {} ({})",
                            row.epoch,
                            row.owner.as_deref().unwrap_or("no owner")
                        );
                        self.lose(p, &reason, ctx);
                    } else if row.epoch == epoch && mine && row.wanted.is_some() {
                        self.hand_off(p, false, ctx);
                    }
                }
                _ => {}
            }
        }
    }

    /// Claims partition `p` for a new engine.
    fn claim(&mut self, p: u32, ctx: &mut Context<Self>) {
        let Some(member_epoch) = self.member_epoch() else {
            return;
        };
        self.slots.insert(p, Slot::Claiming);
        let (reply, answer) = tokio::sync::oneshot::channel();
        let sent = self.requests.send(Request::Claim {
            partition: p,
            member: self.setup.name.clone(),
            member_epoch,
            reply,
        });
        if sent.is_err() {
            self.slots.remove(&p);
            return;
        }
        ctx.spawn(actix::fut::wrap_future(answer).map(
            move |claimed, act: &mut Self, ctx: &mut Context<Self>| {
                let still_member = act.member_epoch() == Some(member_epoch) && !act.leaving;
                match claimed {
                    Ok(Ok(Some(epoch))) if still_member => act.start_engine(p, epoch, ctx),
                    Ok(Err(e)) => {
                        tracing::warn!(target: crate::targets::EXECUTOR, partition = p, error = %e, "cluster: cannot claim a partition; trying again");
                        act.slots.remove(&p);
                    }
                    _ => {
                        act.slots.remove(&p);
                    }
                }
            },
        ));
    }

    /// Starts the engine of partition `p`, claimed at `epoch`.
    fn start_engine(&mut self, p: u32, epoch: i64, ctx: &mut Context<Self>) {
        let Some(member) = &self.member else {
            self.slots.remove(&p);
            return;
        };
        self.slots.insert(p, Slot::Starting { epoch });
        let (lost, lost_rx) = watch::channel(None);
        let leadership = Leadership::owned(
            epoch,
            member.leadership.term(),
            self.setup.name.clone(),
            lost_rx,
        );
        let (url, options) = (self.setup.url.clone(), self.setup.options.clone());
        let engines = self.setup.engines.clone();
        let partitions = self.setup.partitions;
        let start = async move {
            let store = tokio::task::spawn_blocking(move || PgStore::partition(&url, options, p))
                .await
                .map_err(|e| Error::Internal(format!("opening partition {p}'s store: {e}")))??;
            let mut builder = engines();
            builder.grant = Some(Grant {
                partition: p,
                partitions,
                leadership,
            });
            builder.store(store).start().await
        };
        tracing::info!(target: crate::targets::EXECUTOR, member = %self.setup.name, partition = p, epoch, "starting a partition's engine");
        ctx.spawn(actix::fut::wrap_future(start).map(
            move |started, act: &mut Self, ctx: &mut Context<Self>| match started {
                Ok(engine) => {
                    let current = matches!(act.slots.get(&p), Some(Slot::Starting { epoch: e }) if *e == epoch);
                    if current && act.member.is_some() && !act.leaving {
                        act.route(p, Some(engine.clone()));
                        act.slots.insert(
                            p,
                            Slot::Running {
                                epoch,
                                engine,
                                lost,
                            },
                        );
                    } else {
                        // Lost while it started: it steps down, and the slot stays taken
                        // until it has stopped.
                        let _ = lost.send(Some(Loss {
                            reason: format!("partition {p} was lost while its engine started"),
                            taker: None,
                        }));
                        act.slots.insert(p, Slot::Stopping);
                        ctx.spawn(
                            actix::fut::wrap_future(async move {
                                let _ = engine.shutdown_now().await;
                                drop(lost);
                            })
                            .map(move |(), act: &mut Self, _| {
                                act.slots.remove(&p);
                            }),
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(target: crate::targets::EXECUTOR, partition = p, error = %e, "cluster: a partition's engine did not start; trying again");
                    act.slots.remove(&p);
                }
            },
        ));
    }

    /// Submits to partition `p` go to `engine` (or, with none, are forwarded); the
    /// member's thread takes forwarded roots for the partitions with an engine.
    fn route(&mut self, p: u32, engine: Option<Executor<E>>) {
        self.setup.routes.set(p, engine);
        self.shared.set_local(self.setup.routes.local());
    }

    /// Partition `p` is gone: its engine steps down and stops.
    fn lose(&mut self, p: u32, reason: &str, ctx: &mut Context<Self>) {
        let Some(Slot::Running { engine, lost, .. }) = self.slots.remove(&p) else {
            return;
        };
        tracing::warn!(target: crate::targets::EXECUTOR, member = %self.setup.name, partition = p, %reason, "lost a partition: stopping its engine");
        let _ = lost.send(Some(Loss {
            reason: reason.to_string(),
            taker: None,
        }));
        self.route(p, None);
        self.slots.insert(p, Slot::Stopping);
        ctx.spawn(
            actix::fut::wrap_future(async move {
                let _ = engine.shutdown_now().await;
                drop(lost);
            })
            .map(move |(), act: &mut Self, _| {
                act.slots.remove(&p);
            }),
        );
    }

    /// Stops partition `p`'s engine gracefully, then gives the partition to the member
    /// the coordinator wants it with (`leaving`: to none).
    fn hand_off(&mut self, p: u32, leaving: bool, ctx: &mut Context<Self>) -> Option<()> {
        let Some(Slot::Running {
            engine,
            lost,
            epoch,
        }) = self.slots.remove(&p)
        else {
            return None;
        };
        tracing::info!(target: crate::targets::EXECUTOR, member = %self.setup.name, partition = p, epoch, leaving, "handing a partition off");
        self.route(p, None);
        self.slots.insert(p, Slot::Stopping);
        let requests = self.requests.clone();
        let member = self.setup.name.clone();
        ctx.spawn(
            actix::fut::wrap_future(async move {
                let _ = engine.shutdown().await;
                let (reply, answer) = tokio::sync::oneshot::channel();
                let sent = requests.send(Request::HandOff {
                    partition: p,
                    member,
                    epoch,
                    leaving,
                    reply,
                });
                if sent.is_ok() {
                    if let Ok(Err(e)) = answer.await {
                        tracing::warn!(target: crate::targets::EXECUTOR, partition = p, error = %e, "cluster: cannot hand a partition off; its membership's end will");
                    }
                }
                drop(lost);
            })
            .map(move |(), act: &mut Self, _| {
                act.slots.remove(&p);
            }),
        );
        Some(())
    }

    /// Submits the roots other members forwarded to this one's partitions.
    fn take_forwarded(&mut self, rows: Vec<Forwarded>) {
        let registry = self.setup.registry.clone();
        let requests = self.requests.clone();
        let routes = self.setup.routes.clone();
        actix::spawn(async move {
            // Each submit waits for its insert's commit: all of them at once, so they
            // share group commits.
            let submits = rows.into_iter().map(|row| {
                let engine = routes.engine(row.partition);
                let proc = registry.decode(&row.type_name, &row.state);
                async move {
                    let answer = match (engine, proc) {
                        // Not this member's any more: left for the next owner.
                        (None, _) => None,
                        (Some(_), Err(e)) => Some(Err(e.to_string())),
                        (Some(engine), Ok(proc)) => {
                            match engine.submit_boxed(proc).nonce(row.nonce).await {
                                Ok(id) => Some(Ok(id)),
                                // Its engine is going, or full: the next owner (or a
                                // later poll) takes it.
                                Err(
                                    Error::NotLeader { .. }
                                    | Error::Stopped
                                    | Error::Overloaded { .. },
                                ) => None,
                                Err(e) => Some(Err(e.to_string())),
                            }
                        }
                    };
                    (row.nonce, answer)
                }
            });
            let answers: Vec<(Nonce, Option<Result<crate::procedure::ProcId, String>>)> =
                futures_util::future::join_all(submits).await;
            let _ = requests.send(Request::Answer(answers));
        });
    }
}

/// The partitions' table, read by the member's thread.
pub(crate) struct Ownership(pub(crate) Vec<PartitionState>);

impl Message for Ownership {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<Ownership> for NodeActor<E> {
    type Result = ();

    fn handle(&mut self, msg: Ownership, ctx: &mut Context<Self>) {
        self.reconcile(msg.0, ctx);
    }
}

/// Roots forwarded to this member's partitions.
pub(crate) struct Inbox(pub(crate) Vec<Forwarded>);

impl Message for Inbox {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<Inbox> for NodeActor<E> {
    type Result = ();

    fn handle(&mut self, msg: Inbox, _ctx: &mut Context<Self>) {
        self.take_forwarded(msg.0);
    }
}

/// Leave the cluster (see [`Cluster::leave`](super::Cluster::leave)).
pub(crate) struct Leave;

impl Message for Leave {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<Leave> for NodeActor<E> {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Leave, ctx: &mut Context<Self>) -> Self::Result {
        self.leaving = true;
        if let Some(coordinator) = self.coordinator.take() {
            ctx.cancel_future(coordinator);
        }
        self.shared.set_coordinating(None);
        let partitions: Vec<u32> = self.slots.keys().copied().collect();
        for p in partitions {
            self.hand_off(p, true, ctx);
        }
        // The membership ends only once no engine of the member runs or starts: until
        // then its calls hold under the membership's term.
        Box::pin(Self::until_stopped(self).map(
            |(), act: &mut Self, ctx: &mut Context<Self>| {
                tracing::info!(target: crate::targets::EXECUTOR, member = %act.setup.name, "left the cluster");
                act.end_membership();
                act.shared.stop();
                ctx.stop();
            },
        ))
    }
}

impl<E: Send + Sync + 'static> NodeActor<E> {
    /// Resolves once every slot is empty.
    fn until_stopped(&mut self) -> actix::fut::LocalBoxActorFuture<Self, ()> {
        if self.slots.is_empty() {
            return Box::pin(actix::fut::ready(()));
        }
        Box::pin(
            actix::fut::wrap_future(actix::clock::sleep(super::POLL))
                .then(|(), act: &mut Self, _| Self::until_stopped(act)),
        )
    }
}
