//! The pages' live feed: the engine's subscription folded into one Server-Sent Event
//! per tick.
//!
//! A busy engine publishes tens of thousands of events a second; a page needs to know
//! that it is live, how much is happening, the newest roots (on the first page of the
//! list) and what became of the rows it shows. So the feed reads every event but
//! writes, once a tick (half a second by default) and only when something happened,
//! one `data:` line: the counts since the last tick, at most [`NEW_PER_TICK`] of the
//! newest roots, and the rows the page watches that finished or paused. The page
//! names the rows it shows (`watch=ID,ID…`, at most [`MAX_WATCH`]); the feed also
//! watches the new roots it sent, while there is room.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use serde_json::{json, Value};

use crate::{ProcEvent, ProcState};

/// The newest roots one tick carries, at most.
pub(super) const NEW_PER_TICK: usize = 20;
/// The rows one page may watch, at most.
pub(super) const MAX_WATCH: usize = 1_000;
/// A comment line after this long without a tick, so proxies keep the stream open.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// What a page asked the feed for.
#[derive(Debug, Default)]
pub(super) struct Interest {
    /// Procedures whose finish or pause the page shows.
    pub(super) watch: HashSet<u64>,
    /// Whether the page adds new roots as rows.
    pub(super) new_roots: bool,
}

impl Interest {
    /// Parses `watch=1,2,3` (ids) and `new=true`; an error names what is wrong.
    pub(super) fn parse(watch: Option<&str>, new_roots: Option<bool>) -> Result<Self, String> {
        let mut ids = HashSet::new();
        for part in watch.unwrap_or("").split(',').filter(|p| !p.is_empty()) {
            let id = part
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("bad id {part:?} in watch: ids are whole numbers"))?;
            ids.insert(id);
        }
        if ids.len() > MAX_WATCH {
            return Err(format!(
                "watch names {} procedures; at most {MAX_WATCH}",
                ids.len()
            ));
        }
        Ok(Interest {
            watch: ids,
            new_roots: new_roots.unwrap_or(false),
        })
    }
}

/// A new root as a tick carries it: its state if it finished within the same tick.
struct NewRoot {
    id: u64,
    type_name: &'static str,
    state: Option<ProcState>,
}

/// The events of one tick, folded.
pub(super) struct Feed {
    interest: Interest,
    submitted: u64,
    succeeded: u64,
    rolled_back: u64,
    paused: u64,
    /// The newest roots since the last tick (oldest first).
    newest: VecDeque<NewRoot>,
    /// Watched procedures that finished or paused since the last tick.
    changed: Vec<(u64, ProcState)>,
    /// Leadership news since the last tick.
    leadership: Option<String>,
    /// The first tick goes out even if empty: the page learns it is live.
    greeted: bool,
    /// Ticks since the last line written.
    quiet: Duration,
}

impl Feed {
    pub(super) fn new(interest: Interest) -> Self {
        Feed {
            interest,
            submitted: 0,
            succeeded: 0,
            rolled_back: 0,
            paused: 0,
            newest: VecDeque::new(),
            changed: Vec::new(),
            leadership: None,
            greeted: false,
            quiet: Duration::ZERO,
        }
    }

    /// Folds one event in.
    pub(super) fn take(&mut self, event: &ProcEvent) {
        match event {
            ProcEvent::Submitted { id, type_name } => {
                self.submitted += 1;
                if self.interest.new_roots {
                    if self.newest.len() == NEW_PER_TICK {
                        self.newest.pop_front();
                    }
                    self.newest.push_back(NewRoot {
                        id: id.0,
                        type_name,
                        state: None,
                    });
                }
            }
            ProcEvent::Finished { id, result, .. } => {
                let state = if result.is_ok() {
                    self.succeeded += 1;
                    ProcState::Success
                } else {
                    self.rolled_back += 1;
                    ProcState::RolledBack
                };
                // A root finishes once: it is watched no more.
                self.note(id.0, state, true);
            }
            ProcEvent::Paused { id, state, .. } => {
                self.paused += 1;
                self.note(id.0, *state, false);
            }
            ProcEvent::Leading { holder, epoch } => {
                self.leadership = Some(format!("{holder} leads (lease epoch {epoch})"));
            }
            ProcEvent::SteppedDown { reason } => {
                self.leadership = Some(format!("stepped down: {reason}"));
            }
        }
    }

    /// `id` is now in `state`: a new root of this tick carries it, a watched row is
    /// changed (and, if `last`, watched no more).
    fn note(&mut self, id: u64, state: ProcState, last: bool) {
        if let Some(new) = self.newest.iter_mut().find(|n| n.id == id) {
            new.state = Some(state);
            return;
        }
        let watched = if last {
            self.interest.watch.remove(&id)
        } else {
            self.interest.watch.contains(&id)
        };
        if watched {
            self.changed.push((id, state));
        }
    }

    /// The tick's line, if there is anything to say: `every` has passed since the
    /// last call. `stopped` marks the last line (the engine stopped).
    pub(super) fn flush(&mut self, every: Duration, stopped: bool) -> Option<String> {
        let happened = self.submitted + self.succeeded + self.rolled_back + self.paused > 0
            || self.leadership.is_some();
        if !happened && self.greeted && !stopped {
            self.quiet += every;
            if self.quiet >= KEEPALIVE {
                self.quiet = Duration::ZERO;
                return Some(": keepalive\n\n".to_string());
            }
            return None;
        }
        self.greeted = true;
        self.quiet = Duration::ZERO;
        let new: Vec<Value> = self
            .newest
            .drain(..)
            .map(|n| {
                if n.state.is_none() && self.interest.watch.len() < MAX_WATCH {
                    self.interest.watch.insert(n.id);
                }
                json!({
                    "id": n.id,
                    "type": n.type_name,
                    "state": n.state.map(|s| s.to_string()),
                })
            })
            .collect();
        let changed: Vec<Value> = self
            .changed
            .drain(..)
            .map(|(id, state)| json!({ "id": id, "state": state.to_string() }))
            .collect();
        let mut tick = json!({
            "event": "tick",
            "submitted": std::mem::take(&mut self.submitted),
            "succeeded": std::mem::take(&mut self.succeeded),
            "rolled_back": std::mem::take(&mut self.rolled_back),
            "paused": std::mem::take(&mut self.paused),
            "new": new,
            "changed": changed,
        });
        if let Some(news) = self.leadership.take() {
            tick["leadership"] = news.into();
        }
        if stopped {
            tick["stopped"] = true.into();
        }
        Some(format!("data: {tick}\n\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Failure, ProcError, ProcId};

    const TICK: Duration = Duration::from_millis(500);

    fn submitted(id: u64) -> ProcEvent {
        ProcEvent::Submitted {
            id: ProcId(id),
            type_name: "deploy",
        }
    }

    fn finished(id: u64, ok: bool) -> ProcEvent {
        ProcEvent::Finished {
            id: ProcId(id),
            type_name: "deploy",
            result: if ok {
                Ok(())
            } else {
                Err(Failure {
                    proc: ProcId(id),
                    type_name: "deploy".into(),
                    error: ProcError::failed("failed"),
                })
            },
        }
    }

    fn line(feed: &mut Feed) -> Value {
        let text = feed.flush(TICK, false).expect("a line");
        let json = text
            .strip_prefix("data: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .expect("one data line");
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn interest_parses_ids_and_refuses_what_is_not_one() {
        let cases: &[(Option<&str>, Result<usize, &str>)] = &[
            (None, Ok(0)),
            (Some(""), Ok(0)),
            (Some("1,2,2,3"), Ok(3)),
            (Some("7,"), Ok(1)),
            (Some("1,x"), Err("bad id \"x\"")),
            (Some("-1"), Err("bad id \"-1\"")),
        ];
        for (watch, want) in cases {
            match (Interest::parse(*watch, None), want) {
                (Ok(i), Ok(n)) => assert_eq!(i.watch.len(), *n, "{watch:?}"),
                (Err(e), Err(part)) => assert!(e.contains(part), "{watch:?}: {e}"),
                (got, want) => panic!("{watch:?}: {got:?}, wanted {want:?}"),
            }
        }
        let many = (0..=MAX_WATCH).map(|i| i.to_string()).collect::<Vec<_>>();
        let e = Interest::parse(Some(&many.join(",")), None).unwrap_err();
        assert!(e.contains("at most"), "{e}");
    }

    #[test]
    fn a_tick_counts_everything_and_carries_the_newest_and_the_watched() {
        let mut feed = Feed::new(Interest {
            watch: [1, 2].into_iter().collect(),
            new_roots: true,
        });
        // The first tick greets even when nothing happened.
        assert_eq!(line(&mut feed)["submitted"], 0);
        assert_eq!(feed.flush(TICK, false), None, "nothing happened since");
        for id in 100..100 + NEW_PER_TICK as u64 + 5 {
            feed.take(&submitted(id));
        }
        feed.take(&finished(1, false)); // watched
        feed.take(&finished(3, true)); // not watched: counted only
        feed.take(&finished(124, true)); // new in this tick: its state rides along
        let tick = line(&mut feed);
        assert_eq!(tick["submitted"], 25);
        assert_eq!(tick["succeeded"], 2);
        assert_eq!(tick["rolled_back"], 1);
        let new = tick["new"].as_array().unwrap();
        assert_eq!(new.len(), NEW_PER_TICK, "only the newest");
        assert_eq!(new[0]["id"], 105);
        assert_eq!(new[NEW_PER_TICK - 1]["id"], 124);
        assert_eq!(new[NEW_PER_TICK - 1]["state"], "SUCCESS");
        assert_eq!(tick["changed"], json!([{ "id": 1, "state": "ROLLEDBACK" }]));
        // The new roots it sent are watched now; a root finishes once.
        feed.take(&finished(105, true));
        feed.take(&finished(1, true));
        let tick = line(&mut feed);
        assert_eq!(tick["changed"], json!([{ "id": 105, "state": "SUCCESS" }]));
    }

    #[test]
    fn a_page_without_new_rows_gets_none_and_a_quiet_feed_keeps_alive() {
        let mut feed = Feed::new(Interest::default());
        line(&mut feed);
        feed.take(&submitted(5));
        assert_eq!(line(&mut feed)["new"], json!([]));
        let mut quiet = Duration::ZERO;
        let keepalive = loop {
            quiet += TICK;
            if let Some(text) = feed.flush(TICK, false) {
                break text;
            }
        };
        assert_eq!(keepalive, ": keepalive\n\n");
        assert_eq!(quiet, KEEPALIVE);
        let last = feed.flush(TICK, true).unwrap();
        assert!(last.contains("\"stopped\":true"), "{last}");
    }
}
