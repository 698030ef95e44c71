//! Panic guards for user code. actix does not restart an actor whose handler panicked;
//! it closes the mailbox (here a whole shard's, every tree on that arbiter), and every
//! message after that is lost. So every call into a
//! user's procedure goes through [`guard`] or [`CatchUnwind`], and a panic becomes a
//! [`ProcError::Panicked`](crate::ProcError::Panicked) that names the message.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::erased::DynProc;
use crate::procedure::ProcError;
use crate::registry::Types;

/// Runs a synchronous hook; a panic becomes an error naming `hook`.
pub(crate) fn guard<R>(hook: &str, f: impl FnOnce() -> R) -> Result<R, ProcError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panicked(hook, payload))
}

/// Decodes a procedure's recorded state, the user's `Deserialize` guarded: a panic in
/// it is an error like one it returns, saying which.
pub(crate) fn decode_guarded(types: &Types, name: &str, bytes: &[u8]) -> Result<DynProc, String> {
    match guard("decoding the state", || types.decode(name, bytes)) {
        Ok(decoded) => decoded.map_err(|e| e.to_string()),
        Err(panic) => Err(panic.to_string()),
    }
}

/// A future whose panics become errors naming `hook`.
pub(crate) struct CatchUnwind<F> {
    pub(crate) hook: &'static str,
    pub(crate) future: F,
}

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, ProcError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let hook = self.hook;
        match catch_unwind(AssertUnwindSafe(|| Pin::new(&mut self.future).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(payload) => Poll::Ready(Err(panicked(hook, payload))),
        }
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic payload is not a string".to_string()
    }
}

fn panicked(hook: &str, payload: Box<dyn Any + Send>) -> ProcError {
    let message = panic_message(&*payload);
    tracing::error!(target: crate::targets::PROCEDURE, hook, %message, "procedure panicked");
    ProcError::Panicked {
        hook: hook.to_string(),
        message,
    }
}
