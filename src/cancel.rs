//! The cancellation signal a step sees through its [`Context`](crate::Context): the
//! engine raises it when the procedure is aborted while the step runs, or its tree
//! fails (another procedure of it failed or was aborted), so a long step can stop early
//! (and the abort be answered, and the tree's rollback begin, without waiting for the
//! step's end), and when a graceful shutdown's drain deadline passes ([`CancelReason`]
//! tells which).
//!
//! A plain flag with wakers (no runtime): [`Cancel::cancelled`] is a future that works
//! under any executor, for use in `select!` against the step's own work.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};

#[derive(Debug, Default)]
struct State {
    cancelled: bool,
    wakers: Vec<Waker>,
}

/// A cancellation signal: cheap to clone, raised once, never lowered.
///
/// ```
/// let cancel = proctor::Cancel::new();
/// assert!(!cancel.is_cancelled());
/// cancel.cancel();
/// assert!(cancel.is_cancelled());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    state: Arc<Mutex<State>>,
}

impl Cancel {
    /// A signal that is not raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises the signal and wakes every task waiting in [`cancelled`](Self::cancelled).
    pub fn cancel(&self) {
        let wakers = {
            let mut state = self.lock();
            state.cancelled = true;
            std::mem::take(&mut state.wakers)
        };
        for waker in wakers {
            waker.wake();
        }
    }

    /// Whether the signal is raised.
    pub fn is_cancelled(&self) -> bool {
        self.lock().cancelled
    }

    /// Completes once the signal is raised (at once if it already is).
    pub fn cancelled(&self) -> Cancelled {
        Cancelled {
            cancel: self.clone(),
            also: None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a flag and a list: a panic elsewhere cannot leave it half-made.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Why the engine asks a step to stop early (see
/// [`Context::cancel_reason`](crate::Context::cancel_reason)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelReason {
    /// An operator aborted the procedure while the step ran, or its tree failed (a
    /// procedure of it failed or was aborted): the tree rolls back, this step's work
    /// included, once every running step of it has returned.
    Abort,
    /// The engine is shutting down and its drain deadline has passed.
    Shutdown,
}

/// The future of [`Cancel::cancelled`] (and of
/// [`Context::cancelled`](crate::Context::cancelled), which watches two signals).
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct Cancelled {
    cancel: Cancel,
    also: Option<Cancel>,
}

impl Cancelled {
    /// Completes when either signal is raised.
    pub(crate) fn either(cancel: Cancel, also: Option<Cancel>) -> Self {
        Cancelled { cancel, also }
    }
}

/// Ready if `cancel` is raised, else registers the task's waker with it.
fn poll_one(cancel: &Cancel, cx: &mut TaskContext<'_>) -> bool {
    let mut state = cancel.lock();
    if state.cancelled {
        return true;
    }
    if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
        state.wakers.push(cx.waker().clone());
    }
    false
}

impl Future for Cancelled {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<()> {
        if poll_one(&self.cancel, cx) || self.also.as_ref().is_some_and(|c| poll_one(c, cx)) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_future_is_pending_until_cancel_wakes_it_once() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = TaskContext::from_waker(&waker);
        let cancel = Cancel::new();
        let mut fut = cancel.cancelled();
        for _ in 0..3 {
            assert_eq!(Pin::new(&mut fut).poll(&mut cx), Poll::Pending);
        }
        assert_eq!(cancel.lock().wakers.len(), 1, "one waker per task");
        cancel.clone().cancel();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(Pin::new(&mut fut).poll(&mut cx), Poll::Ready(()));
        // Raised before the first poll: ready at once.
        assert_eq!(
            Pin::new(&mut cancel.cancelled()).poll(&mut cx),
            Poll::Ready(())
        );
    }

    #[test]
    fn either_signal_completes_the_pair() {
        for raise_second in [false, true] {
            let count = Arc::new(Count(AtomicUsize::new(0)));
            let waker = Waker::from(count.clone());
            let mut cx = TaskContext::from_waker(&waker);
            let (first, second) = (Cancel::new(), Cancel::new());
            let mut fut = Cancelled::either(first.clone(), Some(second.clone()));
            assert_eq!(Pin::new(&mut fut).poll(&mut cx), Poll::Pending);
            if raise_second {
                second.cancel();
            } else {
                first.cancel();
            }
            assert_eq!(count.0.load(Ordering::SeqCst), 1, "{raise_second}");
            assert_eq!(Pin::new(&mut fut).poll(&mut cx), Poll::Ready(()));
        }
    }
}
