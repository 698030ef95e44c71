//! What a root stack does beyond its own state, as data. Two kinds of effects leave
//! its shard, by two roads. What it tells the scheduler, the lock actor and the
//! persistence actor goes into the shard's outbox as it decides it
//! ([`TreeCtx::tell`](super::TreeCtx::tell)): a queue per actor, sent as one batch each
//! when the shard flushes it. Everything else that leaves — an answer to a caller, news
//! for the executor, a halted tree's error ([`Leave`]) — is recorded in the order
//! decided ([`TreeCtx::leave`](super::TreeCtx::leave)) and, when the handling returns,
//! carried out by [`carry_out`], the one place that orders the two roads.
//!
//! The rule: **nothing leaves by the second road ahead of what is queued on the
//! first.** So `carry_out` sends the outbox before the first `Leave`: a submitter that
//! hears its answer and submits again finds its first step's request ahead of its
//! second, a caller that hears an abort accepted finds the tree's lock requests
//! withdrawn, and a subscriber told of a pause finds the procedure's `Reset` on its
//! way. (Tells made after a `Leave` in the same handling may go with that batch, ahead
//! of it: no rule forbids a message to the engine's own actors going early.)
//!
//! The procedure actors of the tree are not effects: they live on this thread, and
//! their root stack sends them their messages directly, in the order it decides them.

use tokio::sync::oneshot;

use crate::error::Error;
use crate::procedure::ProcId;

use super::AbortAck;
use crate::actors::protocol::{TreeFinished, TreeNews};

/// What leaves a root stack's shard other than through its outbox.
pub(crate) enum Leave {
    /// A submit's answer: its root's insert is durable (or the tree halted).
    Submitted(
        oneshot::Sender<Result<ProcId, Error>>,
        Result<ProcId, Error>,
    ),
    /// An abort's, a pause's, a bypass's or an operator command's answer.
    Answered(AbortAck, Result<bool, Error>),
    /// A graceful shutdown's question, answered with the procedures still marked
    /// possibly cut off (`None`: the tree halted).
    Quiesced(oneshot::Sender<Option<Vec<ProcId>>>, Option<Vec<ProcId>>),
    /// News for the executor's subscribers.
    News(TreeNews),
    /// A halted tree's error, for the executor (its waiters, its bookkeeping).
    Halted(TreeFinished),
}

/// Where effects go: the shard's outbox and the executor, or a test's record.
pub(crate) trait Sink {
    /// Sends what the shard's outbox holds, one batch per actor.
    fn send_outbox(&mut self);
    /// Sends `leave` on its way.
    fn leave(&mut self, leave: Leave);
}

/// Carries out a handling's `leaves` in order, the outbox sent before the first: what
/// the shard's trees queued before (this tree's, in this handling or an earlier one
/// whose flush has not come yet) goes ahead of them.
pub(crate) fn carry_out(leaves: impl IntoIterator<Item = Leave>, sink: &mut impl Sink) {
    let mut sent = false;
    for leave in leaves {
        if !sent {
            sink.send_outbox();
            sent = true;
        }
        sink.leave(leave);
    }
}

impl Leave {
    /// Sends it: answers its caller, or tells the executor through `news` or
    /// `finished`.
    pub(crate) fn send(
        self,
        news: &actix::Recipient<TreeNews>,
        finished: &actix::Recipient<TreeFinished>,
    ) {
        match self {
            Leave::Submitted(ack, answer) => {
                let _ = ack.send(answer);
            }
            Leave::Answered(ack, answer) => {
                let _ = ack.send(answer);
            }
            Leave::Quiesced(ack, answer) => {
                let _ = ack.send(answer);
            }
            Leave::News(news_item) => news.do_send(news_item),
            Leave::Halted(result) => finished.do_send(result),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what a sink was asked to do, by kind.
    #[derive(Default)]
    struct Record(Vec<&'static str>);

    impl Sink for Record {
        fn send_outbox(&mut self) {
            self.0.push("send outbox");
        }
        fn leave(&mut self, leave: Leave) {
            self.0.push(match leave {
                Leave::Submitted(..) => "submitted",
                Leave::Answered(..) => "answered",
                Leave::Quiesced(..) => "quiesced",
                Leave::News(_) => "news",
                Leave::Halted(_) => "halted",
            });
        }
    }

    fn submitted() -> Leave {
        Leave::Submitted(oneshot::channel().0, Ok(ProcId(1)))
    }

    fn answered() -> Leave {
        Leave::Answered(oneshot::channel().0, Ok(true))
    }

    fn news() -> Leave {
        Leave::News(TreeNews::Submitted(ProcId(1)))
    }

    fn quiesced() -> Leave {
        Leave::Quiesced(oneshot::channel().0, None)
    }

    #[test]
    fn nothing_leaves_ahead_of_what_the_outbox_holds() {
        let cases: Vec<(&str, Vec<Leave>, Vec<&str>)> = vec![
            (
                "nothing leaves: the outbox waits for its flush",
                vec![],
                vec![],
            ),
            (
                "a submit's answer, then its news",
                vec![submitted(), news()],
                vec!["send outbox", "submitted", "news"],
            ),
            (
                "answers in the order decided, after one send",
                vec![answered(), quiesced(), answered()],
                vec!["send outbox", "answered", "quiesced", "answered"],
            ),
        ];
        for (name, leaves, expected) in cases {
            let mut record = Record::default();
            carry_out(leaves, &mut record);
            assert_eq!(record.0, expected, "{name}");
        }
    }
}
