//! Queues that are empty nearly all the time between calls, and keep no buffer while
//! empty: a root stack's outbox and its transitions waiting for durability. An idle
//! tree would otherwise hold a buffer per queue for as long as it waits.
//!
//! An emptied queue lends its buffer to the thread (one spare per thread and type), and
//! the next push on the thread takes it back, so a busy tree allocates nothing either.
//! The root stacks of one arbiter take the spare in turn: each empties its queues before
//! its handler returns, or holds the buffer until it does.

use std::cell::Cell;
use std::collections::VecDeque;
use std::thread::LocalKey;

/// A thread's spare buffer for queues of `T`.
pub(crate) type Spare<T> = LocalKey<Cell<Option<Box<VecDeque<T>>>>>;

/// An item type of [`Lent`] queues: names its thread's spare buffer (a `thread_local!`
/// of its own, as a thread local cannot be generic).
pub(crate) trait Lendable: Sized + 'static {
    fn spare() -> &'static Spare<Self>;
}

/// A queue that gives its buffer to the thread's spare when emptied
/// ([`Lent::release`]) and takes the spare at its first push. One pointer while it has
/// no buffer (a `VecDeque` would be four): every idle tree's actor holds two.
pub(crate) struct Lent<T: Lendable> {
    // The box is the point: one word inline instead of four.
    #[allow(clippy::box_collection)]
    queue: Option<Box<VecDeque<T>>>,
}

impl<T: Lendable> Default for Lent<T> {
    fn default() -> Self {
        Lent { queue: None }
    }
}

impl<T: Lendable> Lent<T> {
    pub(crate) fn push_back(&mut self, item: T) {
        let queue = self.queue.get_or_insert_with(|| {
            // After the thread's locals are gone (its arbiter stopping), it allocates.
            T::spare()
                .try_with(Cell::take)
                .ok()
                .flatten()
                .unwrap_or_default()
        });
        queue.push_back(item);
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        self.queue.as_mut()?.pop_front()
    }

    pub(crate) fn front(&self) -> Option<&T> {
        self.queue.as_ref()?.front()
    }

    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.queue.as_mut()?.get_mut(index)
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.len())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every item out, in order; the buffer goes with them.
    pub(crate) fn take_all(&mut self) -> VecDeque<T> {
        self.queue.take().map(|q| *q).unwrap_or_default()
    }

    /// Whether it holds a buffer.
    #[cfg(test)]
    fn has_buffer(&self) -> bool {
        self.queue.is_some()
    }

    /// Where its buffer is, to tell one from another.
    #[cfg(test)]
    fn buffer(&self) -> Option<*const VecDeque<T>> {
        self.queue.as_deref().map(std::ptr::from_ref)
    }

    /// Lends the buffer to the thread if the queue is empty.
    pub(crate) fn release(&mut self) {
        if self.is_empty() {
            if let Some(buf) = self.queue.take() {
                let _ = T::spare().try_with(|spare| spare.set(Some(buf)));
            }
        }
    }
}

/// Declares `$t`'s spare buffer.
macro_rules! lendable {
    ($t:ty) => {
        impl $crate::actors::lent::Lendable for $t {
            fn spare() -> &'static $crate::actors::lent::Spare<Self> {
                thread_local! {
                    static SPARE: std::cell::Cell<
                        Option<Box<std::collections::VecDeque<$t>>>,
                    > = const { std::cell::Cell::new(None) };
                }
                &SPARE
            }
        }
    };
}
pub(crate) use lendable;

#[cfg(test)]
mod tests {
    use super::*;

    lendable!(u32);

    #[test]
    fn an_emptied_queue_lends_its_buffer_to_the_next_one() {
        let mut a = Lent::<u32>::default();
        let mut b = Lent::<u32>::default();
        assert_eq!(std::mem::size_of::<Lent<u32>>(), 8);
        a.push_back(1);
        a.push_back(2);
        let buffer = a.buffer();
        a.release(); // not empty: keeps its buffer
        assert_eq!(a.buffer(), buffer);
        assert_eq!((a.pop_front(), a.pop_front()), (Some(1), Some(2)));
        a.release();
        assert!(!a.has_buffer(), "an empty queue holds no buffer");
        b.push_back(3);
        assert_eq!(b.buffer(), buffer, "the next push takes the spare");
        a.push_back(4);
        assert!(a.has_buffer(), "with no spare left it allocates");
        assert_eq!((a.pop_front(), b.pop_front()), (Some(4), Some(3)));
        b.push_back(5);
        assert_eq!(
            (b.len(), b.take_all().into_iter().collect::<Vec<_>>()),
            (1, vec![5])
        );
        assert!(b.is_empty() && !b.has_buffer());
    }
}
