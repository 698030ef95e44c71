//! The member's thread on its own connection to the cluster's tables: every tick it
//! reads ownership (and tells the member's actor), moves partitions while the member
//! coordinates, and, more often, carries forwarded submits both ways. Between those it
//! serves the actor's and the handle's requests, one at a time, in order.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

pub(crate) use crate::actors::pg_store::cluster::ClusterDb;
use crate::actors::pg_store::cluster::{ClusterState, ForwardState, Forwarded, RootRow};
use crate::error::Error;
use crate::procedure::ProcId;
use crate::record::Nonce;
use crate::store::StoreError;

use super::node::{Inbox, NodeActor, Ownership};

/// What the thread is asked.
pub(crate) enum Request {
    /// Write a root for its partition's owner; answered with its id once the owner
    /// submitted it.
    Forward(Forwarded, oneshot::Sender<Result<ProcId, Error>>),
    /// A root's record.
    Root(ProcId, oneshot::Sender<Result<RootRow, StoreError>>),
    /// The operator's view.
    State(oneshot::Sender<Result<ClusterState, StoreError>>),
    /// Unfinished roots and waiting forwarded submits.
    Unfinished(oneshot::Sender<Result<(i64, i64), StoreError>>),
    /// Claim a partition for a new engine.
    Claim {
        partition: u32,
        member: String,
        member_epoch: i64,
        reply: oneshot::Sender<Result<Option<i64>, StoreError>>,
    },
    /// Hand a partition off (or let it go) after its engine stopped.
    HandOff {
        partition: u32,
        member: String,
        epoch: i64,
        leaving: bool,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    /// The owner's answers to forwarded submits.
    Answer(Vec<(Nonce, Option<Result<ProcId, String>>)>),
}

/// What the thread and the member's actor both read.
#[derive(Default)]
pub(crate) struct Shared {
    /// The leader lease the member coordinates under (its name and epoch), if any.
    coordinating: Mutex<Option<(String, i64)>>,
    /// The partitions the member runs: their forwarded submits are its to take.
    local: Mutex<Vec<u32>>,
    /// Forwarded submits the actor is submitting: not handed to it again.
    taking: Mutex<HashSet<Nonce>>,
    /// Set when the member leaves: the thread ends.
    stopped: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(crate) fn coordinating(&self) -> Option<(String, i64)> {
        self.coordinating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_coordinating(&self, lease: Option<(String, i64)>) {
        *self
            .coordinating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = lease;
    }

    pub(crate) fn set_local(&self, local: Vec<u32>) {
        *self
            .local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = local;
    }

    /// The forwarded submit of `nonce` was answered (or failed): it may be handed out
    /// again if it is still waiting.
    fn taken(&self, nonce: Nonce) {
        self.taking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&nonce);
    }

    pub(crate) fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// This member's forwarded submits still waiting for their owner's answer.
type Forwards = HashMap<Nonce, (u32, oneshot::Sender<Result<ProcId, Error>>)>;

/// The thread's loop (see the module docs).
pub(crate) fn run<E: Send + Sync + 'static>(
    mut db: ClusterDb,
    requests: &Receiver<Request>,
    shared: &Shared,
    node: &Addr<NodeActor<E>>,
    tick: Duration,
) {
    let mut forwards = Forwards::new();
    let mut next_tick = Instant::now();
    let mut next_poll = Instant::now();
    loop {
        if shared.is_stopped() {
            return;
        }
        let now = Instant::now();
        if now >= next_tick {
            next_tick = now + tick;
            self::tick(&mut db, shared, node);
        }
        if now >= next_poll {
            next_poll = now + super::POLL;
            poll(&mut db, shared, node, &mut forwards);
        }
        let wait = next_tick
            .min(next_poll)
            .saturating_duration_since(Instant::now());
        match requests.recv_timeout(wait) {
            Ok(request) => serve(&mut db, shared, request, &mut forwards),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Ownership for the actor; the coordinator's moves.
fn tick<E: Send + Sync + 'static>(db: &mut ClusterDb, shared: &Shared, node: &Addr<NodeActor<E>>) {
    let partitions = match db.partitions() {
        Ok(partitions) => partitions,
        Err(e) => {
            tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot read the partitions; trying again");
            return;
        }
    };
    if let Some((holder, epoch)) = shared.coordinating() {
        match db.live_members() {
            Ok(live) => {
                let owned: Vec<crate::cluster::Owned> = partitions
                    .iter()
                    .map(|p| crate::cluster::Owned {
                        owner: p.owner.clone(),
                        wanted: p.wanted.clone(),
                    })
                    .collect();
                let moves = crate::cluster::plan(&owned, &live);
                if !moves.is_empty() {
                    tracing::info!(target: crate::targets::STORE, moves = ?moves, "cluster: moving partitions");
                    match db.apply(&holder, epoch, &moves) {
                        Ok(true) => {}
                        Ok(false) => shared.set_coordinating(None),
                        Err(e) => {
                            tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot move partitions; trying again");
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot read the members; trying again");
            }
        }
    }
    node.do_send(Ownership(partitions));
}

/// Answers to this member's forwarded submits; submits forwarded to it.
fn poll<E: Send + Sync + 'static>(
    db: &mut ClusterDb,
    shared: &Shared,
    node: &Addr<NodeActor<E>>,
    forwards: &mut Forwards,
) {
    forwards.retain(|_, (_, tx)| !tx.is_closed());
    if !forwards.is_empty() {
        let nonces: Vec<Nonce> = forwards.keys().copied().collect();
        match db.forwarded(&nonces) {
            Ok(states) => {
                for (nonce, state) in states {
                    let answer = match state {
                        ForwardState::Waiting => continue,
                        ForwardState::Submitted(id) => Ok(id),
                        ForwardState::Refused(reason) => Err(Error::Invalid(format!(
                            "the owner of the root's partition refused it: {reason}"
                        ))),
                    };
                    if let Some((_, tx)) = forwards.remove(&nonce) {
                        let _ = tx.send(answer);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot read forwarded submits; trying again");
            }
        }
    }
    let local = shared
        .local
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    if local.is_empty() {
        return;
    }
    match db.inbox(&local) {
        Ok(rows) => {
            let mut taking = shared
                .taking
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let rows: Vec<Forwarded> = rows
                .into_iter()
                .filter(|r| taking.insert(r.nonce))
                .collect();
            if !rows.is_empty() {
                node.do_send(Inbox(rows));
            }
        }
        Err(e) => {
            tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot read the inbox; trying again");
        }
    }
}

fn serve(db: &mut ClusterDb, shared: &Shared, request: Request, forwards: &mut Forwards) {
    match request {
        Request::Forward(row, reply) => match db.forward(&row) {
            Ok(()) => {
                forwards.insert(row.nonce, (row.partition, reply));
            }
            Err(e) => {
                let _ = reply.send(Err(e.into()));
            }
        },
        Request::Root(id, reply) => {
            let _ = reply.send(db.root(id));
        }
        Request::State(reply) => {
            let state = db.state().map(Option::unwrap_or_default);
            let _ = reply.send(state);
        }
        Request::Unfinished(reply) => {
            let _ = reply.send(db.unfinished());
        }
        Request::Claim {
            partition,
            member,
            member_epoch,
            reply,
        } => {
            let _ = reply.send(db.claim(partition, &member, member_epoch));
        }
        Request::HandOff {
            partition,
            member,
            epoch,
            leaving,
            reply,
        } => {
            let _ = reply.send(db.hand_off(partition, &member, epoch, leaving));
        }
        Request::Answer(answers) => {
            if let Err(e) = db.answer(&answers) {
                // The rows stay unanswered: the next poll hands them out again, and the
                // engine's nonces answer the same ids.
                tracing::warn!(target: crate::targets::STORE, error = %e, "cluster: cannot answer forwarded submits");
            }
            for (nonce, _) in &answers {
                shared.taken(*nonce);
            }
        }
    }
}
