//! What an [`Executor`](super::Executor) handle sends its requests to: the running
//! executor actor, or — for a standby ([`ExecutorBuilder::start_standby`]) — nothing
//! yet. While a standby waits for the leader lease every request is answered
//! [`Error::NotLeader`] naming the holder it last saw, so a service can hold one handle
//! from its start and route each request by that answer.
//!
//! The rules it keeps: no request reaches the actor before the actor holds the lease
//! (the handle learns the actor's address only after the actor was handed its
//! leadership, so the actor has handled `Lead` before any request); a subscriber made
//! on a standby hears [`ProcEvent::Leading`] first and then every event the actor
//! publishes (its channel is handed to the actor before any request can be); a
//! standby stopped while it waits never leads, or, if it had already taken the lease
//! and was loading the store, shuts down as soon as it has started.
//!
//! [`ExecutorBuilder::start_standby`]: super::ExecutorBuilder

use std::sync::{Arc, Mutex, OnceLock};

use actix::Addr;
use tokio::sync::{mpsc::UnboundedSender, watch};

use super::actor::ExecutorActor;
use super::api::{ProcEvent, Shutdown, SubscribeChannel};
use super::leader::Role;
use super::recovered::Recovery;
use crate::cancel::Cancel;
use crate::error::Error;

/// The running executor: its actor and what recovery found.
pub(super) struct Running<E: Send + Sync + 'static> {
    pub(super) addr: Addr<ExecutorActor<E>>,
    pub(super) report: Arc<Recovery>,
}

/// A handle's front: the running executor, once there is one.
pub(super) struct Front<E: Send + Sync + 'static> {
    running: OnceLock<Running<E>>,
    /// Set for a standby: its wait for the lease.
    standby: Option<Standby>,
}

/// A standby's wait for the lease.
struct Standby {
    phase: watch::Sender<Phase>,
    gate: Mutex<Gate>,
    /// Raised by a stop while it waits: the wait for the lease ends.
    cancel: Cancel,
}

/// Where a standby is, for the requests that find no running executor.
enum Phase {
    Waiting { leader: Option<String> },
    Leading,
    Failed(Error),
    Stopped,
}

/// What must happen exactly once, when the standby starts leading or fails.
enum Gate {
    Waiting {
        /// Subscribers made while it waits, handed to the actor when it leads.
        subscribers: Vec<UnboundedSender<ProcEvent>>,
        stop_asked: bool,
    },
    Decided,
}

/// The recovery report a standby shows until it leads: nothing recovered yet.
fn nothing_recovered() -> &'static Recovery {
    static NOTHING: OnceLock<Recovery> = OnceLock::new();
    NOTHING.get_or_init(Recovery::default)
}

impl<E: Send + Sync + 'static> Front<E> {
    /// The front of an executor that started (alone, or holding the lease).
    pub(super) fn running(addr: Addr<ExecutorActor<E>>, report: Arc<Recovery>) -> Self {
        Front {
            running: OnceLock::from(Running { addr, report }),
            standby: None,
        }
    }

    /// The front of a standby that has not taken the lease yet.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn standby() -> Self {
        Front {
            running: OnceLock::new(),
            standby: Some(Standby {
                phase: watch::Sender::new(Phase::Waiting { leader: None }),
                gate: Mutex::new(Gate::Waiting {
                    subscribers: Vec::new(),
                    stop_asked: false,
                }),
                cancel: Cancel::new(),
            }),
        }
    }

    /// The executor actor, or why there is none to send a request to.
    pub(super) fn actor(&self) -> Result<&Addr<ExecutorActor<E>>, Error> {
        match self.running.get() {
            Some(running) => Ok(&running.addr),
            None => Err(self.not_running()),
        }
    }

    /// What recovery found; nothing before a standby leads.
    pub(super) fn report(&self) -> &Recovery {
        match self.running.get() {
            Some(running) => &running.report,
            None => nothing_recovered(),
        }
    }

    /// The role of a standby that does not lead (yet); `None` once an actor runs.
    pub(super) fn standby_role(&self) -> Option<Result<Role, Error>> {
        if self.running.get().is_some() {
            return None;
        }
        Some(match &*self.standby.as_ref()?.phase.borrow() {
            Phase::Waiting { leader } => Ok(Role::Standby {
                leader: leader.clone(),
            }),
            _ => Err(self.not_running()),
        })
    }

    /// Why no actor takes requests.
    fn not_running(&self) -> Error {
        let Some(standby) = &self.standby else {
            return Error::Stopped;
        };
        match &*standby.phase.borrow() {
            Phase::Waiting { leader } => Error::NotLeader {
                reason: "a standby, waiting for the leader lease".to_string(),
                leader: leader.clone(),
            },
            Phase::Failed(e) => e.duplicate(),
            Phase::Leading | Phase::Stopped => Error::Stopped,
        }
    }

    /// Waits until the executor leads: at once for a running one.
    pub(super) async fn leading(&self) -> Result<(), Error> {
        let Some(standby) = &self.standby else {
            return Ok(());
        };
        let mut phase = standby.phase.subscribe();
        let decided = phase
            .wait_for(|p| !matches!(p, Phase::Waiting { .. }))
            .await
            .map(|p| matches!(*p, Phase::Leading));
        match decided {
            Ok(true) => Ok(()),
            _ => Err(self.not_running()),
        }
    }

    /// Keeps `events` for the actor if the standby does not lead yet; else gives it
    /// back, for the caller to hand to the actor.
    pub(super) fn hold_subscriber(
        &self,
        events: UnboundedSender<ProcEvent>,
    ) -> Option<UnboundedSender<ProcEvent>> {
        let Some(standby) = &self.standby else {
            return Some(events);
        };
        match &mut *lock(&standby.gate) {
            Gate::Waiting { subscribers, .. } => {
                subscribers.push(events);
                None
            }
            Gate::Decided => Some(events),
        }
    }

    /// The standby's actor started (running behind `started`) and was handed the
    /// lease (`holder`, `epoch`): its subscribers go to it, then requests do; a stop
    /// asked meanwhile shuts it down.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn started(&self, started: &Front<E>, holder: &str, epoch: i64) {
        let (Some(standby), Some(running)) = (&self.standby, started.running.get()) else {
            return;
        };
        let addr = &running.addr;
        let mut gate = lock(&standby.gate);
        let Gate::Waiting {
            subscribers,
            stop_asked,
        } = std::mem::replace(&mut *gate, Gate::Decided)
        else {
            return;
        };
        for events in subscribers {
            let leading = ProcEvent::Leading {
                holder: holder.to_string(),
                epoch,
            };
            if events.send(leading).is_ok() {
                addr.do_send(SubscribeChannel(events));
            }
        }
        let _ = self.running.set(Running {
            addr: addr.clone(),
            report: running.report.clone(),
        });
        standby.phase.send_replace(Phase::Leading);
        if stop_asked {
            addr.do_send(Shutdown::graceful());
        }
    }

    /// The standby's start failed (or it was stopped while it waited): requests get
    /// `error` from now on, and its subscriptions end.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn failed(&self, error: Error) {
        let Some(standby) = &self.standby else { return };
        let mut gate = lock(&standby.gate);
        let stop_asked = matches!(
            &*gate,
            Gate::Waiting {
                stop_asked: true,
                ..
            }
        );
        *gate = Gate::Decided;
        standby.phase.send_replace(if stop_asked {
            Phase::Stopped
        } else {
            Phase::Failed(error)
        });
    }

    /// Asks the executor to stop: the running actor's address to send the shutdown to,
    /// or `None` for a standby that now stops waiting (or will shut down as soon as it
    /// has started).
    pub(super) fn stop(&self) -> Option<Addr<ExecutorActor<E>>> {
        if let Some(standby) = &self.standby {
            if let Gate::Waiting { stop_asked, .. } = &mut *lock(&standby.gate) {
                *stop_asked = true;
                standby.cancel.cancel();
                return None;
            }
        }
        self.running.get().map(|running| running.addr.clone())
    }
}

#[cfg(feature = "postgres")]
impl<E: Send + Sync + 'static> super::builder::StandbyWait for Front<E> {
    fn seen(&self, holder: Option<String>) {
        if let Some(standby) = &self.standby {
            standby.phase.send_if_modified(|phase| match phase {
                Phase::Waiting { leader } if *leader != holder => {
                    *leader = holder;
                    true
                }
                _ => false,
            });
        }
    }

    fn stopped(&self) -> Cancel {
        self.standby
            .as_ref()
            .map(|s| s.cancel.clone())
            .unwrap_or_default()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
