//! What a failure comes to under a [`FailurePolicy`]: retry after a backoff, pause for
//! an operator, or roll the tree back. A pure rule the root stack asks for each failed
//! step and each failed rollback step; table-driven tests below.

use crate::procedure::FailurePolicy;

/// Rollback retries back off from this delay...
const ROLLBACK_RETRY_BASE_MS: u64 = 10;
/// ...doubling up to this one, and then retry at this pace for ever.
const ROLLBACK_RETRY_MAX_MS: u64 = 10_000;

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

/// What a failure comes to: `retries` already spent on this step, whether the tree has
/// passed a point of no return, and whether it is a rollback step that failed.
///
/// A step: a retry policy retries while retries remain; then, or for a plain policy, a
/// tree past its point of no return pauses, and otherwise the policy decides. A
/// rollback step is never abandoned: the default policy retries it for ever, a retry
/// policy retries `times` and then, like [`FailurePolicy::Pause`], pauses it
/// (ROLLBACK_PAUSED).
pub fn decide(policy: FailurePolicy, retries: u32, irreversible: bool, rollback: bool) -> Decision {
    let backoff = |base_ms: u64, max_ms: u64| Decision::Retry {
        delay_ms: base_ms.saturating_mul(1 << retries.min(30)).min(max_ms),
    };
    match policy {
        FailurePolicy::RetryThenRollback { times, backoff_ms }
        | FailurePolicy::RetryThenPause { times, backoff_ms }
            if retries < times =>
        {
            backoff(backoff_ms, POLICY_RETRY_MAX_MS)
        }
        FailurePolicy::Rollback if rollback => {
            backoff(ROLLBACK_RETRY_BASE_MS, ROLLBACK_RETRY_MAX_MS)
        }
        _ if rollback || irreversible => Decision::Pause,
        FailurePolicy::Pause | FailurePolicy::RetryThenPause { .. } => Decision::Pause,
        _ => Decision::Rollback,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let retry = |delay_ms| Decision::Retry { delay_ms };
        // (policy, retries spent, irreversible, rollback step, decision)
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
            // A rollback is never abandoned: retried for ever, or paused.
            (Rollback, 1, false, true, retry(20)),
            (Rollback, 30, false, true, retry(ROLLBACK_RETRY_MAX_MS)),
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
            assert_eq!(
                decide(policy, retries, irreversible, rollback),
                expected,
                "{policy:?} retries={retries} irreversible={irreversible} rollback={rollback}"
            );
        }
    }
}
