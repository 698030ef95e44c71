//! Nonces reserved before their procedure is built (HBase's `registerNonce`): the
//! messages the executor takes for a [`NonceReservation`] — reserve, record a failure
//! for a nonce that will never be submitted (`setFailureResultForNonce`), let go — and
//! their handlers. Submitting with a reservation is a [`Submit`] that carries its token.
//!
//! The rule they keep with the submit: a nonce has at most one holder at a time (a
//! submit on its way to the store, or a reservation), and every other request naming
//! it waits for the holder's outcome — the procedure's id once durable, or, if the
//! holder let go, a fresh try as if it had just come.

use std::borrow::Cow;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::procedure::{ProcError, ProcId, ProcState, Procedure};
use crate::record::{Failure, Nonce, ProcRecord, Steering, StoreOp};
use crate::registry::RegistryError;

use crate::actors::protocol::{DurableAck, Persist};
use crate::actors::shared::{now_ms, Entry};

use super::actor::{ExecutorActor, NonceState, Turn};
use super::api::{ProcEvent, Submit};
use super::handle::Executor;
use super::recovered::finished_entry;

/// Reserve a nonce for the sender, unless it is known.
pub(super) struct RegisterNonce(pub(super) Nonce);

/// What [`RegisterNonce`] found.
pub(super) enum Registered {
    Known(ProcId),
    /// Reserved for the sender, under this token.
    Reserved(u64),
}

impl Message for RegisterNonce {
    type Result = Result<Registered, Error>;
}

/// Record `error` as the result of the reserved nonce, under a new root of `type_name`.
pub(super) struct FailNonce {
    nonce: Nonce,
    token: u64,
    type_name: String,
    error: ProcError,
}

impl Message for FailNonce {
    type Result = Result<ProcId, Error>;
}

/// Let go of a reservation (a no-op once it was used).
pub(super) struct ReleaseNonce {
    nonce: Nonce,
    token: u64,
}

impl Message for ReleaseNonce {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<RegisterNonce> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<Registered, Error>>;

    fn handle(&mut self, msg: RegisterNonce, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(refusal) = self.refusal() {
            return Box::pin(std::future::ready(Err(refusal)));
        }
        let nonce = msg.0;
        // A registration carries no procedure: the nonce's procedure is its answer,
        // whatever it was submitted with.
        match self.nonce_turn(nonce, None, None) {
            Turn::Known(id) => Box::pin(std::future::ready(id.map(Registered::Known))),
            Turn::Wait(answer) => {
                let executor = ctx.address();
                Box::pin(async move {
                    match answer.await {
                        Ok(Some(answer)) => answer.map(Registered::Known),
                        Ok(None) => executor.send(msg).await?,
                        Err(_) => Err(Error::Stopped),
                    }
                })
            }
            Turn::Go => {
                self.next_token += 1;
                let token = self.next_token;
                let waiting = Vec::new();
                self.nonces
                    .insert(nonce, NonceState::Reserved { token, waiting });
                tracing::debug!(target: crate::targets::EXECUTOR, group = nonce.group, nonce = nonce.nonce, "nonce reserved");
                Box::pin(std::future::ready(Ok(Registered::Reserved(token))))
            }
        }
    }
}

impl<E: Send + Sync + 'static> Handler<ReleaseNonce> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: ReleaseNonce, _ctx: &mut Context<Self>) {
        let held = matches!(
            self.nonces.get(&msg.nonce),
            Some(NonceState::Reserved { token, .. }) if *token == msg.token
        );
        if !held {
            return;
        }
        if let Some(NonceState::Reserved { waiting, .. }) = self.nonces.remove(&msg.nonce) {
            tracing::debug!(target: crate::targets::EXECUTOR, group = msg.nonce.group, nonce = msg.nonce.nonce, waiting = waiting.len(), "nonce reservation let go");
            for waiter in waiting {
                let _ = waiter.answer.send(None);
            }
        }
    }
}

impl<E: Send + Sync + 'static> Handler<FailNonce> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<ProcId, Error>>;

    fn handle(&mut self, msg: FailNonce, ctx: &mut Context<Self>) -> Self::Result {
        let FailNonce {
            nonce,
            token,
            type_name,
            error,
        } = msg;
        let refused = |e: Error| -> Self::Result { Box::pin(std::future::ready(Err(e))) };
        if let Some(refusal) = self.refusal() {
            return refused(refusal);
        }
        let Some(type_name) = self.shared.registry.static_name(&type_name) else {
            return refused(Error::Registry(RegistryError::UnknownName {
                name: type_name,
            }));
        };
        let waiting = match self.nonces.remove(&nonce) {
            Some(NonceState::Reserved {
                token: held,
                waiting,
            }) if held == token => waiting,
            other => {
                if let Some(state) = other {
                    self.nonces.insert(nonce, state);
                }
                return refused(Error::Invalid(format!(
                    "nonce {}:{} is not reserved by this reservation",
                    nonce.group, nonce.nonce
                )));
            }
        };
        // Later requests wait for the record, as for a submit's insert. A failure has
        // no fingerprint: every submit with the nonce is answered with it.
        let submitting = NonceState::Submitting {
            fingerprint: None,
            waiting,
        };
        self.nonces.insert(nonce, submitting);
        let id = self.shared.next_id();
        let now = now_ms();
        let failure = Failure {
            proc: id,
            type_name: type_name.to_string(),
            error,
        };
        // A root that finished ROLLEDBACK with nothing to undo: it keeps its failure
        // (and its nonce) as a result, evicted as any result is.
        let record = ProcRecord {
            id,
            parent: None,
            root: id,
            type_name: Cow::Borrowed(type_name),
            state: ProcState::RolledBack,
            stack_indexes: Vec::new(),
            failure: Some(Box::new(failure.clone())),
            failure_seq: Some(0),
            submitted_ms: now,
            updated_ms: now,
            wake_at_ms: None,
            event: None,
            data: Vec::new(),
            locks: None,
            deadline_ms: None,
            nonce: Some(nonce),
            result: None,
            bypassed: false,
            steering: Steering::default(),
            nonce_fingerprint: None,
        };
        let entry = finished_entry(&self.shared, record.clone());
        let (ack, durable) = oneshot::channel();
        self.shared.persistence.do_send(Persist {
            ops: vec![StoreOp::Insert(record)],
            ack: DurableAck::Caller(ack),
        });
        // A plain future, as a submit's answer is: the executor hears once it is
        // durable, before the caller does.
        let executor = ctx.address();
        Box::pin(async move {
            let result = durable.await.unwrap_or(Err(Error::Stopped));
            let settled = result.as_ref().map(|()| id).map_err(Error::duplicate);
            let recorded = FailureRecorded {
                nonce,
                entry: Box::new(entry),
                failure,
                result: settled,
            };
            executor.send(recorded).await?;
            result.map(|()| id)
        })
    }
}

/// The record of a [`FailNonce`] is durable (or failed).
struct FailureRecorded {
    nonce: Nonce,
    entry: Box<Entry>,
    failure: Failure,
    result: Result<ProcId, Error>,
}

impl Message for FailureRecorded {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<FailureRecorded> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: FailureRecorded, _ctx: &mut Context<Self>) {
        let FailureRecorded {
            nonce,
            entry,
            failure,
            result,
        } = msg;
        match &result {
            Ok(id) => {
                let (id, type_name) = (*id, entry.type_name);
                self.shared.table.insert(id, *entry);
                self.finished.push_back((now_ms(), id));
                tracing::info!(target: crate::targets::EXECUTOR, id = id.0, r#type = %type_name, %failure, "failure recorded for a reserved nonce");
                if !self.subscribers.is_empty() {
                    self.publish(ProcEvent::Finished {
                        id,
                        type_name,
                        result: Err(failure),
                    });
                }
            }
            Err(e) => self.broke(e.duplicate()),
        }
        self.settle_nonce(nonce, result);
    }
}

/// What [`Executor::register_nonce`] found.
#[derive(Debug)]
#[must_use = "a reservation not used is let go when dropped"]
pub enum NonceRegistration<E: Send + Sync + 'static = ()> {
    /// A procedure was submitted (or a failure recorded) with the nonce: this one.
    Known(ProcId),
    /// The nonce is now reserved for the caller, who submits, records a failure, or
    /// lets go.
    Reserved(NonceReservation<E>),
}

/// A nonce reserved for its holder (HBase's `registerNonce`): every other request
/// naming the nonce — a submit, a registration — waits until the holder submits
/// ([`submit`](Self::submit): they get its id), records a failure
/// ([`fail`](Self::fail): they get the failure's id, whose result is that failure), or
/// lets go ([`release`](Self::release), or dropping it: they try again as if they had
/// just come). For a request whose checks run before its procedure can be built, so
/// that a retry of a request that failed its checks gets the same failure.
///
/// A reservation lives in the executor's memory only: a restart forgets it (a retry
/// then reserves again), as it forgets a submit whose insert was not durable.
///
/// ```
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct CreateTable { name: String }
/// # #[async_trait]
/// # impl Procedure for CreateTable {
/// #     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// # }
/// use proctor::{Executor, Nonce, NonceRegistration, ProcId};
///
/// /// A client's create-table request, retried with the same key until it hears.
/// async fn create_table(
///     executor: &Executor,
///     key: &str,
///     name: &str,
/// ) -> Result<ProcId, proctor::Error> {
///     let reservation = match executor.register_nonce(Nonce::from_key(key)).await? {
///         // Submitted (or refused) before: that answer again.
///         NonceRegistration::Known(id) => return Ok(id),
///         NonceRegistration::Reserved(reservation) => reservation,
///     };
///     if name.is_empty() {
///         // Refused before a procedure exists: recorded, so a retry gets the same.
///         return reservation
///             .fail("create_table", ProcError::failed("a table needs a name"))
///             .await;
///     }
///     reservation.submit(CreateTable { name: name.to_string() }).await
/// }
/// ```
pub struct NonceReservation<E: Send + Sync + 'static = ()> {
    nonce: Nonce,
    token: u64,
    executor: Executor<E>,
}

impl<E: Send + Sync + 'static> std::fmt::Debug for NonceReservation<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NonceReservation")
            .field("nonce", &self.nonce)
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> NonceReservation<E> {
    pub(super) fn new(nonce: Nonce, token: u64, executor: Executor<E>) -> Self {
        NonceReservation {
            nonce,
            token,
            executor,
        }
    }

    /// The nonce reserved.
    pub fn nonce(&self) -> Nonce {
        self.nonce
    }

    /// Submits `proc` with the nonce, as [`Executor::submit_with_nonce`]; the requests
    /// waiting on the reservation get its id (a submit among them that carries another
    /// procedure or other arguments gets [`Error::NonceConflict`]).
    ///
    /// # Errors
    ///
    /// As [`Executor::submit`]. A submit refused before its insert (a type not
    /// registered, too many unfinished roots) lets the reservation go.
    pub async fn submit(self, proc: impl Procedure<E>) -> Result<ProcId, Error> {
        let mut submit = Submit::new(proc).with_nonce(self.nonce);
        submit.reservation = Some(self.token);
        self.executor.addr()?.send(submit).await?
    }

    /// Records `error` as the result of the nonce, without submitting anything
    /// (HBase's `setFailureResultForNonce`): a new root of the registered type
    /// `type_name` that finished ROLLEDBACK with that failure, durably, and kept (with
    /// its nonce) as any result is. Its id is the answer to every request with the
    /// nonce from now on, whatever procedure a submit with it carries (the failure has
    /// no procedure to compare with); [`Executor::wait`] on it gives the failure.
    ///
    /// # Errors
    ///
    /// [`Error::Registry`] if no type is registered as `type_name` (the reservation is
    /// let go); [`Error::Store`] if the record cannot be written; [`Error::Stopped`]
    /// after shutdown.
    pub async fn fail(self, type_name: &str, error: ProcError) -> Result<ProcId, Error> {
        let fail = FailNonce {
            nonce: self.nonce,
            token: self.token,
            type_name: type_name.to_string(),
            error,
        };
        self.executor.addr()?.send(fail).await?
    }

    /// Lets the nonce go unused: the requests waiting on it try again. Dropping the
    /// reservation does the same.
    pub fn release(self) {}
}

impl<E: Send + Sync + 'static> Drop for NonceReservation<E> {
    fn drop(&mut self) {
        // A no-op once the nonce was submitted or failed with this token.
        if let Ok(addr) = self.executor.addr() {
            addr.do_send(ReleaseNonce {
                nonce: self.nonce,
                token: self.token,
            });
        }
    }
}
