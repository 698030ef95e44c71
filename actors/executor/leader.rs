//! What an executor is to its store ([`Role`]), and the leader lease on PostgreSQL: an
//! executor that loses its lease steps down (its mandate ends, so no call into user
//! code starts or resumes), and one that wins it starts leading.

use actix::prelude::*;

use super::actor::ExecutorActor;
#[cfg(feature = "postgres")]
use super::api::ProcEvent;
// For the docs' links only.
#[cfg(doc)]
use super::handle::Executor;

/// What an executor is to its store ([`Executor::role`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// It runs without a leader lease (one engine on its store).
    Alone,
    /// It holds the leader lease ([`ExecutorBuilder::leadership`](super::ExecutorBuilder)).
    Leader {
        /// Its name in the lease.
        holder: String,
        /// The lease's epoch, which its writes are fenced with.
        epoch: i64,
    },
    /// It waits for the lease as a standby
    /// ([`ExecutorBuilder::start_standby`](super::ExecutorBuilder)): it runs nothing,
    /// and answers every request [`Error::NotLeader`](crate::Error::NotLeader) naming `leader`.
    Standby {
        /// The lease's holder as it last saw it, if any.
        leader: Option<String>,
    },
    /// It owns one partition of a [cluster](crate::Cluster): it runs that partition's
    /// procedures, its writes fenced with the partition's epoch.
    Owner {
        /// The cluster member it runs in.
        holder: String,
        /// The partition.
        partition: u32,
        /// The partition's epoch: its owner's fencing token.
        epoch: i64,
    },
    /// It lost the lease and stepped down: it runs and acknowledges nothing more.
    SteppedDown {
        /// Why.
        reason: String,
    },
}

/// Ask the executor what it is.
pub(super) struct GetRole;

impl Message for GetRole {
    type Result = Role;
}

impl<E: Send + Sync + 'static> Handler<GetRole> for ExecutorActor<E> {
    type Result = MessageResult<GetRole>;

    fn handle(&mut self, _: GetRole, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.role.clone())
    }
}

/// The lease is lost: step down.
#[cfg(feature = "postgres")]
struct LeaseLost(crate::actors::pg_store::Loss);

#[cfg(feature = "postgres")]
impl Message for LeaseLost {
    type Result = ();
}

#[cfg(feature = "postgres")]
impl<E: Send + Sync + 'static> Handler<LeaseLost> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: LeaseLost, _ctx: &mut Context<Self>) {
        if !matches!(self.role, Role::Leader { .. } | Role::Owner { .. }) {
            return;
        }
        let crate::actors::pg_store::Loss { reason, taker } = msg.0;
        if let Role::Owner { partition, .. } = self.role {
            tracing::warn!(target: crate::targets::EXECUTOR, partition, reason = %reason, "lost the partition: stepping down");
        } else {
            tracing::error!(target: crate::targets::EXECUTOR, reason = %reason, "lost the leader lease: stepping down");
            ::metrics::gauge!(crate::actors::metrics::IS_LEADER).set(0.0);
        }
        self.role = Role::SteppedDown {
            reason: reason.clone(),
        };
        if !self.subscribers.is_empty() {
            self.publish(ProcEvent::SteppedDown {
                reason: reason.clone(),
            });
        }
        self.broke(crate::Error::NotLeader {
            reason,
            leader: taker,
        });
    }
}

/// Hands the executor at `addr` the lease it holds: it keeps it, and steps down when
/// the lease is lost.
#[cfg(feature = "postgres")]
pub(super) fn lead<E: Send + Sync + 'static>(
    addr: &Addr<ExecutorActor<E>>,
    leadership: crate::actors::Leadership,
    partition: Option<u32>,
) {
    let lost = leadership.signal();
    let term = leadership.term();
    addr.do_send(Lead(Some(leadership), partition));
    let addr = addr.clone();
    actix::spawn(async move {
        // The lease's thread tells of a loss; a term that ran out by this process's
        // clock is one too, should that thread be held up (a connection that hangs).
        let loss = tokio::select! {
            loss = crate::actors::pg_store::lost_reason(lost) => loss,
            () = async {
                loop {
                    let left = term.left();
                    if left.is_zero() {
                        break;
                    }
                    actix::clock::sleep(left).await;
                }
            } => crate::actors::pg_store::Loss {
                reason: "the leader lease's term ran out: no renewal succeeded within two \
                         thirds of its period"
                    .to_string(),
                taker: None,
            },
        };
        addr.do_send(LeaseLost(loss));
    });
}

/// The lease this executor holds.
#[cfg(feature = "postgres")]
struct Lead(Option<crate::actors::Leadership>, Option<u32>);

#[cfg(feature = "postgres")]
impl Message for Lead {
    type Result = ();
}

#[cfg(feature = "postgres")]
impl<E: Send + Sync + 'static> Handler<Lead> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, mut msg: Lead, _ctx: &mut Context<Self>) {
        if let Some(leadership) = msg.0.take() {
            let holder = leadership.holder().to_string();
            let epoch = leadership.epoch();
            self.role = match msg.1 {
                Some(partition) => {
                    tracing::info!(target: crate::targets::EXECUTOR, %holder, partition, epoch, "owning a partition");
                    Role::Owner {
                        holder,
                        partition,
                        epoch,
                    }
                }
                None => {
                    tracing::info!(target: crate::targets::EXECUTOR, %holder, epoch, "leading");
                    Role::Leader { holder, epoch }
                }
            };
            self.leadership = Some(leadership);
        }
    }
}
