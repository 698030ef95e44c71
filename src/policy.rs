//! What a failure comes to under a [`FailurePolicy`]: retry after a backoff, pause for
//! an operator, or roll the tree back. A pure rule the root stack asks for each failed
//! step and each failed rollback step; before it, for a failed step, the policy the
//! failure is decided by ([`for_step`]: the procedure's, as the error's [`ErrorKind`]
//! and the step's [`RetryPolicy`] make it). Table-driven tests below.

use crate::procedure::{ErrorKind, FailurePolicy, RetryPolicy};

/// Under the default policy, a failed rollback's first retry backs off from this
/// delay...
const ROLLBACK_RETRY_BASE_MS: u64 = 20;
/// ...doubling up to this one, then at this pace until its limit.
const ROLLBACK_RETRY_MAX_MS: u64 = 10_000;
/// How many times the default policy retries a failed rollback step before its
/// procedure is ROLLBACK_PAUSED for an operator (`ExecutorBuilder::rollback_retries`):
/// the backoffs' ceilings add up to about two minutes, one minute on average with
/// their jitter.
pub(crate) const DEFAULT_ROLLBACK_RETRIES: u32 = 20;

/// What a failure comes to under a [`FailurePolicy`] (see [`decide`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run the step (or rollback step) again after this delay.
    Retry {
        /// Milliseconds to wait.
        delay_ms: u64,
    },
    /// Stop in PAUSED (a rollback: ROLLBACK_PAUSED) for an operator.
    Pause,
    /// Fail the procedure and roll its tree back.
    Rollback,
}

/// The longest a policy's retry waits.
const POLICY_RETRY_MAX_MS: u64 = 600_000;

/// The policy a failed step is decided by, and the longest its retry waits: the
/// procedure's `policy` for the error, as the error's `kind` and the retry policy the
/// step set (`step`) make it.
///
/// An error that does not say its kind is the procedure's policy's alone (`step` is
/// for retryable errors only). A terminal one is never retried: a retrying policy
/// keeps only its end (roll back, or pause). A retryable one is retried before the
/// policy's end: under `step` when the step set one, else under the procedure's own
/// retries when its policy retries, else under [`RetryPolicy::default`].
pub(crate) fn for_step(
    policy: FailurePolicy,
    kind: Option<ErrorKind>,
    step: Option<RetryPolicy>,
) -> (FailurePolicy, u64) {
    let pauses = matches!(
        policy,
        FailurePolicy::Pause | FailurePolicy::RetryThenPause { .. }
    );
    let retrying = |retry: RetryPolicy| {
        let (times, backoff_ms) = (retry.retries, retry.backoff_ms);
        let policy = if pauses {
            FailurePolicy::RetryThenPause { times, backoff_ms }
        } else {
            FailurePolicy::RetryThenRollback { times, backoff_ms }
        };
        (policy, retry.max_delay_ms)
    };
    let retries = policy.retries();
    match (kind, step) {
        (None, _) => (policy, POLICY_RETRY_MAX_MS),
        (Some(ErrorKind::Terminal), _) if pauses => (FailurePolicy::Pause, POLICY_RETRY_MAX_MS),
        (Some(ErrorKind::Terminal), _) => (FailurePolicy::Rollback, POLICY_RETRY_MAX_MS),
        (Some(ErrorKind::Retryable), Some(step)) => retrying(step),
        (Some(ErrorKind::Retryable), None) if retries => (policy, POLICY_RETRY_MAX_MS),
        (Some(ErrorKind::Retryable), None) => retrying(RetryPolicy::default()),
    }
}

/// What a failure comes to: `retries` already spent on this step, whether the tree has
/// passed a point of no return, whether it is a rollback step that failed, and for a
/// rollback step under the default policy how many retries it gets (`limit`; `None`:
/// as many as it takes); `seed` (the procedure's id) spreads retries.
///
/// A step: a retry policy retries while retries remain; then, or for a plain policy, a
/// tree past its point of no return pauses, and otherwise the policy decides. A
/// rollback step is never abandoned, nor counted as done: the default policy retries
/// it with backoff (from 20 ms, doubling up to 10 s) `limit` times, a retry policy
/// `times`, and then, like [`FailurePolicy::Pause`], it is paused (ROLLBACK_PAUSED)
/// for an operator, who continues it (it is tried again) once its cause is dealt with.
///
/// A retry waits with "full jitter" (as the AWS Architecture Blog's "Exponential
/// Backoff and Jitter" describes it): a time drawn evenly from zero to the backoff,
/// which doubles with each retry up to its cap, so that procedures failing together
/// (a node went down under a hundred of them) do not retry together. The draw is a
/// hash of `seed` and `retries`: the same procedure and attempt wait the same, which
/// keeps this rule a pure function.
pub fn decide(
    policy: FailurePolicy,
    retries: u32,
    irreversible: bool,
    rollback: bool,
    limit: Option<u32>,
    seed: u64,
) -> Decision {
    decide_within(
        policy,
        POLICY_RETRY_MAX_MS,
        retries,
        irreversible,
        rollback,
        limit,
        seed,
    )
}

/// As [`decide`], a policy's retries waiting at most `max_delay_ms` (the default
/// policy's rollback retries keep their own cap).
pub fn decide_within(
    policy: FailurePolicy,
    max_delay_ms: u64,
    retries: u32,
    irreversible: bool,
    rollback: bool,
    limit: Option<u32>,
    seed: u64,
) -> Decision {
    let backoff = |base_ms: u64, max_ms: u64| Decision::Retry {
        delay_ms: full_jitter(
            base_ms.saturating_mul(1 << retries.min(30)).min(max_ms),
            seed,
            retries,
        ),
    };
    match policy {
        FailurePolicy::RetryThenRollback { times, backoff_ms }
        | FailurePolicy::RetryThenPause { times, backoff_ms }
            if retries < times =>
        {
            backoff(backoff_ms, max_delay_ms)
        }
        FailurePolicy::Rollback if rollback && limit.is_none_or(|limit| retries < limit) => {
            backoff(ROLLBACK_RETRY_BASE_MS, ROLLBACK_RETRY_MAX_MS)
        }
        _ if rollback || irreversible => Decision::Pause,
        FailurePolicy::Pause | FailurePolicy::RetryThenPause { .. } => Decision::Pause,
        _ => Decision::Rollback,
    }
}

/// A delay drawn evenly from `0..=ceiling_ms` by a hash of `seed` and `attempt`
/// (SplitMix64's finalizer).
fn full_jitter(ceiling_ms: u64, seed: u64, attempt: u32) -> u64 {
    let mut z =
        seed ^ (u64::from(attempt) << 32 | u64::from(attempt)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    match ceiling_ms.checked_add(1) {
        Some(span) => z % span,
        None => z,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_a_jittered_time_under_their_backoff() {
        for (ceiling, attempt) in [(0, 0), (1, 3), (100, 0), (10_000, 7), (u64::MAX, 1)] {
            let draws: Vec<u64> = (0..1000)
                .map(|seed| full_jitter(ceiling, seed, attempt))
                .collect();
            assert!(draws.iter().all(|&d| d <= ceiling), "{ceiling}");
            if ceiling >= 100 {
                // Spread over the range: both halves are drawn, and many values.
                let low = draws.iter().filter(|&&d| d <= ceiling / 2).count();
                assert!(
                    (350..650).contains(&low),
                    "{ceiling}: {low} of 1000 in the lower half"
                );
                let distinct: std::collections::BTreeSet<_> = draws.iter().collect();
                assert!(distinct.len() > 60, "{ceiling}: {}", distinct.len());
            }
        }
        // The same procedure and attempt wait the same; the next attempt differs.
        assert_eq!(full_jitter(1000, 7, 2), full_jitter(1000, 7, 2));
        let next: Vec<u64> = (0..8).map(|a| full_jitter(1_000_000, 7, a)).collect();
        assert!(next.windows(2).all(|w| w[0] != w[1]), "{next:?}");
    }

    #[test]
    fn failure_policies_decide() {
        use FailurePolicy::*;
        let retry_rb = RetryThenRollback {
            times: 2,
            backoff_ms: 100,
        };
        let retry_pause = RetryThenPause {
            times: 2,
            backoff_ms: 100,
        };
        // The backoff a retry's jitter draws under.
        let retry = |ceiling_ms| Decision::Retry {
            delay_ms: ceiling_ms,
        };
        // (policy, retries spent, irreversible, rollback step, decision); a rollback's
        // limit under the default policy is 5 retries (see the next test).
        let cases = [
            (Rollback, 0, false, false, Decision::Rollback),
            (Pause, 0, false, false, Decision::Pause),
            (retry_rb, 0, false, false, retry(100)),
            (retry_rb, 1, false, false, retry(200)),
            (retry_rb, 2, false, false, Decision::Rollback),
            (retry_pause, 1, false, false, retry(200)),
            (retry_pause, 2, false, false, Decision::Pause),
            // Past the point of no return nothing rolls back; retries still come first.
            (Rollback, 0, true, false, Decision::Pause),
            (retry_rb, 0, true, false, retry(100)),
            (retry_rb, 2, true, false, Decision::Pause),
            // A rollback is never abandoned: retried, then paused.
            (Rollback, 0, false, true, retry(20)),
            (Rollback, 4, false, true, retry(320)),
            (Rollback, 5, false, true, Decision::Pause),
            (Pause, 0, false, true, Decision::Pause),
            (retry_rb, 1, false, true, retry(200)),
            (retry_rb, 2, false, true, Decision::Pause),
            (retry_pause, 2, false, true, Decision::Pause),
            // Backoff is capped.
            (
                RetryThenPause {
                    times: 100,
                    backoff_ms: 1000,
                },
                40,
                false,
                false,
                retry(POLICY_RETRY_MAX_MS),
            ),
        ];
        for (policy, retries, irreversible, rollback, expected) in cases {
            let decided = decide(policy, retries, irreversible, rollback, Some(5), 42);
            let expected = match expected {
                Decision::Retry { delay_ms } => Decision::Retry {
                    delay_ms: full_jitter(delay_ms, 42, retries),
                },
                other => other,
            };
            assert_eq!(
                decided, expected,
                "{policy:?} retries={retries} irreversible={irreversible} rollback={rollback}"
            );
        }
    }

    #[test]
    fn an_errors_kind_and_its_steps_retry_policy_make_the_policy_it_is_decided_by() {
        use ErrorKind::{Retryable, Terminal};
        use FailurePolicy::*;
        let retry_rb = RetryThenRollback {
            times: 2,
            backoff_ms: 100,
        };
        let retry_pause = RetryThenPause {
            times: 2,
            backoff_ms: 100,
        };
        let step = RetryPolicy::new(3).backoff_ms(10).max_delay_ms(50);
        let default = RetryPolicy::default();
        let (d_times, d_backoff, d_max) =
            (default.retries, default.backoff_ms, default.max_delay_ms);
        let cap = POLICY_RETRY_MAX_MS;
        // (the procedure's policy, the error's kind, the step's retry policy) → (the
        // policy decided by, its longest backoff).
        let cases = [
            // Not marked: the procedure's policy alone, the step's retry policy unused.
            (Rollback, None, None, (Rollback, cap)),
            (Rollback, None, Some(step), (Rollback, cap)),
            (Pause, None, Some(step), (Pause, cap)),
            (retry_rb, None, None, (retry_rb, cap)),
            (retry_pause, None, Some(step), (retry_pause, cap)),
            // Terminal: never retried, the policy's end.
            (Rollback, Some(Terminal), Some(step), (Rollback, cap)),
            (Pause, Some(Terminal), None, (Pause, cap)),
            (retry_rb, Some(Terminal), None, (Rollback, cap)),
            (retry_pause, Some(Terminal), Some(step), (Pause, cap)),
            // Retryable: retried, then the policy's end; the step's retry policy
            // first, then the procedure's retries, then the default.
            (
                Rollback,
                Some(Retryable),
                Some(step),
                (
                    RetryThenRollback {
                        times: 3,
                        backoff_ms: 10,
                    },
                    50,
                ),
            ),
            (
                Pause,
                Some(Retryable),
                Some(step),
                (
                    RetryThenPause {
                        times: 3,
                        backoff_ms: 10,
                    },
                    50,
                ),
            ),
            (
                retry_pause,
                Some(Retryable),
                Some(step),
                (
                    RetryThenPause {
                        times: 3,
                        backoff_ms: 10,
                    },
                    50,
                ),
            ),
            (retry_rb, Some(Retryable), None, (retry_rb, cap)),
            (retry_pause, Some(Retryable), None, (retry_pause, cap)),
            (
                Rollback,
                Some(Retryable),
                None,
                (
                    RetryThenRollback {
                        times: d_times,
                        backoff_ms: d_backoff,
                    },
                    d_max,
                ),
            ),
            (
                Pause,
                Some(Retryable),
                None,
                (
                    RetryThenPause {
                        times: d_times,
                        backoff_ms: d_backoff,
                    },
                    d_max,
                ),
            ),
        ];
        for (policy, kind, retry, expected) in cases {
            assert_eq!(
                for_step(policy, kind, retry),
                expected,
                "{policy:?} {kind:?} {retry:?}"
            );
        }
    }

    #[test]
    fn a_retry_waits_at_most_its_policys_longest_backoff() {
        let policy = FailurePolicy::RetryThenRollback {
            times: 40,
            backoff_ms: 10,
        };
        // (retries spent, longest backoff, the backoff the jitter draws under)
        let cases = [
            (0, 50, 10),
            (2, 50, 40),
            (3, 50, 50),
            (39, 50, 50),
            (3, 1_000, 80),
            (0, 0, 0),
        ];
        for (retries, max_delay_ms, ceiling) in cases {
            for seed in 0..50 {
                let decided =
                    decide_within(policy, max_delay_ms, retries, false, false, None, seed);
                let expected = Decision::Retry {
                    delay_ms: full_jitter(ceiling, seed, retries),
                };
                assert_eq!(decided, expected, "retries={retries} max={max_delay_ms}");
            }
        }
        // Past its retries, as any policy.
        assert_eq!(
            decide_within(policy, 50, 40, false, false, None, 1),
            Decision::Rollback
        );
        assert_eq!(
            decide_within(policy, 50, 40, true, false, None, 1),
            Decision::Pause
        );
    }

    #[test]
    fn a_rollback_under_the_default_policy_pauses_past_its_limit() {
        let rollback = FailurePolicy::Rollback;
        // (retries spent, limit, decision); backoffs from 20 ms, doubling, up to 10 s.
        let cases = [
            (0, Some(0), None),
            (0, Some(1), Some(20)),
            (1, Some(1), None),
            (2, Some(3), Some(80)),
            (3, Some(3), None),
            (9, Some(20), Some(ROLLBACK_RETRY_MAX_MS)),
            (19, Some(20), Some(ROLLBACK_RETRY_MAX_MS)),
            (20, Some(20), None),
            (21, Some(20), None),
            // No limit: retried for ever (the engine's own trouble, not the procedure's).
            (0, None, Some(20)),
            (1_000, None, Some(ROLLBACK_RETRY_MAX_MS)),
            (u32::MAX, None, Some(ROLLBACK_RETRY_MAX_MS)),
        ];
        for (retries, limit, ceiling) in cases {
            let expected = match ceiling {
                Some(ceiling) => Decision::Retry {
                    delay_ms: full_jitter(ceiling, 42, retries),
                },
                None => Decision::Pause,
            };
            let decided = decide(rollback, retries, false, true, limit, 42);
            assert_eq!(decided, expected, "retries={retries} limit={limit:?}");
            // A step's failure knows no such limit: the tree rolls back.
            let step = decide(rollback, retries, false, false, limit, 42);
            assert_eq!(
                step,
                Decision::Rollback,
                "retries={retries} limit={limit:?}"
            );
        }
        // The default limit spends a minute or two before an operator is called: the
        // backoffs' ceilings add up to about two minutes (full jitter waits half that
        // on average).
        let ceilings: u64 = (0..DEFAULT_ROLLBACK_RETRIES)
            .map(
                |retries| match decide(rollback, retries, false, true, None, 0) {
                    Decision::Retry { .. } => {
                        (ROLLBACK_RETRY_BASE_MS << retries.min(30)).min(ROLLBACK_RETRY_MAX_MS)
                    }
                    other => panic!("{other:?}"),
                },
            )
            .sum();
        assert!((60_000..=180_000).contains(&ceilings), "{ceilings} ms");
    }
}
