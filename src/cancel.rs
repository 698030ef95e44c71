//! The cancellation signal a step sees through its [`Context`](crate::Context): the
//! engine raises it when the procedure is aborted while the step runs, so a long step
//! can stop early (and the abort be answered without waiting for the step's end).
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
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a flag and a list: a panic elsewhere cannot leave it half-made.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The future of [`Cancel::cancelled`].
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct Cancelled {
    cancel: Cancel,
}

impl Future for Cancelled {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<()> {
        let mut state = self.cancel.lock();
        if state.cancelled {
            return Poll::Ready(());
        }
        if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
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
}
