//! Queues that are empty nearly all the time between calls, and keep no buffer while
//! empty: a root stack's outbox and its transitions waiting for durability. An idle
//! tree would otherwise hold a buffer per queue for as long as it waits.
//!
//! An emptied queue lends its buffer to the thread (up to [`SPARES`] spares per thread
//! and type), and a push on the thread into a queue without one takes a spare, so busy
//! trees allocate nothing either. The root stacks of one arbiter share the spares: a
//! tree's transitions wait for durability across messages, so under load many trees
//! hold a buffer at once, and one spare per thread was too few.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::thread::LocalKey;

/// A thread's spare buffers for queues of `T`.
pub(crate) type Spare<T> = LocalKey<RefCell<Vec<Box<VecDeque<T>>>>>;

/// The spares a thread keeps per item type, at most: enough for every tree of a busy
/// arbiter that waits for durability, a few hundred kilobytes at most.
pub(crate) const SPARES: usize = 1024;

/// A buffer grown past this many items is dropped rather than kept as a spare.
const SPARE_CAPACITY_MAX: usize = 16;

/// An item type of [`Lent`] queues: names its thread's spare buffer (a `thread_local!`
/// of its own, as a thread local cannot be generic).
pub(crate) trait Lendable: Sized + 'static {
    fn spare() -> &'static Spare<Self>;
}

/// A queue that gives its buffer to the thread's spares when emptied
/// ([`Lent::release`]) and takes a spare at its first push. One pointer while it has
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
                .try_with(|spares| spares.borrow_mut().pop())
                .ok()
                .flatten()
                // Room for two: a tree rarely has more waiting at once, and a
                // `VecDeque`'s first growth would make room for four (some 640 bytes
                // of transitions for every busy tree once the spares run out).
                .unwrap_or_else(|| Box::new(VecDeque::with_capacity(2)))
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

    /// Lends the buffer to the thread if the queue is empty (and drops it if the
    /// thread has spares enough, or it grew large).
    pub(crate) fn release(&mut self) {
        if self.is_empty() {
            if let Some(buf) = self.queue.take() {
                if buf.capacity() <= SPARE_CAPACITY_MAX {
                    let _ = T::spare().try_with(|spares| {
                        let mut spares = spares.borrow_mut();
                        if spares.len() < SPARES {
                            spares.push(buf);
                        }
                    });
                }
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
                    static SPARE: std::cell::RefCell<
                        Vec<Box<std::collections::VecDeque<$t>>>,
                    > = const { std::cell::RefCell::new(Vec::new()) };
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

    #[test]
    fn a_thread_keeps_several_spares_but_not_grown_buffers_or_too_many() {
        let spares = || <u32 as Lendable>::spare().with(|s| s.borrow().len());
        let mut queues: Vec<Lent<u32>> = (0..SPARES + 3).map(|_| Lent::default()).collect();
        for q in &mut queues {
            q.push_back(1);
        }
        let buffers: Vec<_> = queues.iter().map(Lent::buffer).collect();
        for q in &mut queues {
            q.pop_front();
            q.release();
        }
        assert_eq!(spares(), SPARES, "kept up to SPARES");
        // The next pushes take the spares, last lent first.
        let mut again: Vec<Lent<u32>> = (0..3).map(|_| Lent::default()).collect();
        for q in &mut again {
            q.push_back(2);
        }
        assert_eq!(again[0].buffer(), buffers[SPARES - 1]);
        assert_eq!(again[2].buffer(), buffers[SPARES - 3]);
        assert_eq!(spares(), SPARES - 3);
        // A buffer grown large is not kept: the spare it took is gone.
        let mut big = Lent::<u32>::default();
        for i in 0..100 {
            big.push_back(i);
        }
        assert_eq!(spares(), SPARES - 4);
        while big.pop_front().is_some() {}
        big.release();
        assert_eq!(spares(), SPARES - 4);
    }
}
