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
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// A thread's spare buffer for queues of `T`.
pub(crate) type Spare<T> = LocalKey<Cell<VecDeque<T>>>;

/// An item type of [`Lent`] queues: names its thread's spare buffer (a `thread_local!`
/// of its own, as a thread local cannot be generic).
pub(crate) trait Lendable: Sized + 'static {
    fn spare() -> &'static Spare<Self>;
}

/// A `VecDeque` that gives its buffer to the thread's spare when emptied
/// ([`Lent::release`]) and takes the spare at its first push.
pub(crate) struct Lent<T: Lendable> {
    queue: VecDeque<T>,
}

impl<T: Lendable> Default for Lent<T> {
    fn default() -> Self {
        Lent {
            queue: VecDeque::new(),
        }
    }
}

impl<T: Lendable> Lent<T> {
    pub(crate) fn push_back(&mut self, item: T) {
        if self.queue.capacity() == 0 {
            // After the thread's locals are gone (its arbiter stopping), it allocates.
            if let Ok(buf) = T::spare().try_with(Cell::take) {
                self.queue = buf;
            }
        }
        self.queue.push_back(item);
    }

    /// Lends the buffer to the thread if the queue is empty.
    pub(crate) fn release(&mut self) {
        if self.queue.is_empty() && self.queue.capacity() > 0 {
            let buf = std::mem::take(&mut self.queue);
            let _ = T::spare().try_with(|spare| spare.set(buf));
        }
    }
}

/// Declares `$t`'s spare buffer.
macro_rules! lendable {
    ($t:ty) => {
        impl $crate::actors::lent::Lendable for $t {
            fn spare() -> &'static $crate::actors::lent::Spare<Self> {
                thread_local! {
                    static SPARE: std::cell::Cell<std::collections::VecDeque<$t>> =
                        const { std::cell::Cell::new(std::collections::VecDeque::new()) };
                }
                &SPARE
            }
        }
    };
}
pub(crate) use lendable;

impl<T: Lendable> Deref for Lent<T> {
    type Target = VecDeque<T>;

    fn deref(&self) -> &VecDeque<T> {
        &self.queue
    }
}

impl<T: Lendable> DerefMut for Lent<T> {
    fn deref_mut(&mut self) -> &mut VecDeque<T> {
        &mut self.queue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    lendable!(u32);

    #[test]
    fn an_emptied_queue_lends_its_buffer_to_the_next_one() {
        let mut a = Lent::<u32>::default();
        let mut b = Lent::<u32>::default();
        a.push_back(1);
        a.push_back(2);
        let capacity = a.capacity();
        a.release(); // not empty: keeps its buffer
        assert_eq!(a.capacity(), capacity);
        assert_eq!((a.pop_front(), a.pop_front()), (Some(1), Some(2)));
        a.release();
        assert_eq!(a.capacity(), 0, "an empty queue holds no buffer");
        b.push_back(3);
        assert_eq!(b.capacity(), capacity, "the next push takes the spare");
        a.push_back(4);
        assert!(a.capacity() > 0, "with no spare left it allocates");
        assert_eq!((a.pop_front(), b.pop_front()), (Some(4), Some(3)));
    }
}
