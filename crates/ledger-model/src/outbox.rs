//! The outbox consumer's rules: batch and lease bounds, the retry backoff, and when an event
//! fails for good. No Postgres here.

use crate::error::{Code, LedgerError, Result};

/// Delivery attempts an event gets between replays.
pub const MAX_ATTEMPTS: i32 = 64;

/// The longest wait before a nacked event is due again.
pub const MAX_BACKOFF_SECONDS: i32 = 300;

pub const MAX_CLAIM_EVENTS: i32 = 1000;

/// The longest lease a claim takes (one day).
pub const MAX_LEASE_SECONDS: i32 = 86_400;

/// A claim's `max_events`, 1 to 1000.
pub fn claim_events(max_events: i32) -> Result<i32> {
    if !(1..=MAX_CLAIM_EVENTS).contains(&max_events) {
        return Err(
            LedgerError::new(Code::LimitInvalid, "max_events must be between 1 and 1000")
                .with("argument", "max_events")
                .with("value", max_events),
        );
    }
    Ok(max_events)
}

/// A claim's `lease_seconds`, 1 second to one day.
pub fn lease_seconds(lease: i32) -> Result<i32> {
    if !(1..=MAX_LEASE_SECONDS).contains(&lease) {
        return Err(LedgerError::new(
            Code::TimeoutInvalid,
            "lease_seconds must be between 1 and 86400",
        )
        .with("argument", "lease_seconds")
        .with("value", lease));
    }
    Ok(lease)
}

/// Attempts since the last replay. `attempt_count` keeps the whole history, so this is derived:
/// an event fails exactly when its 64th attempt since the last replay ends (a nack, or a lease
/// that expired, since a claim never makes a 65th), and only a failed event is replayed, so the
/// k-th replay happened at attempt_count 64 * k.
pub fn attempts_since_replay(attempt_count: i32, replay_count: i32) -> i32 {
    attempt_count
        .saturating_sub(MAX_ATTEMPTS.saturating_mul(replay_count.max(0)))
        .max(0)
}

/// Whether the event has used its attempts and fails instead of being delivered again.
pub fn exhausted(attempt_count: i32, replay_count: i32) -> bool {
    attempts_since_replay(attempt_count, replay_count) >= MAX_ATTEMPTS
}

/// The wait after the n-th failed attempt: 1, 2, 4, ... seconds, at most 300.
pub fn backoff_seconds(attempts: i32) -> i32 {
    match attempts {
        ..=1 => 1,
        // From attempt 10, 2^(n-1) >= 512 is past the cap (and a large n would overflow the shift).
        n if n >= 10 => MAX_BACKOFF_SECONDS,
        n => 1 << (n - 1),
    }
}

/// What a nack does with the attempt that just failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterNack {
    /// Back to pending, due again in this many seconds.
    Retry { delay_seconds: i32 },
    /// The attempts are used up: failed until someone replays it.
    Fail,
}

pub fn after_nack(attempt_count: i32, replay_count: i32) -> AfterNack {
    if exhausted(attempt_count, replay_count) {
        AfterNack::Fail
    } else {
        AfterNack::Retry {
            delay_seconds: backoff_seconds(attempts_since_replay(attempt_count, replay_count)),
        }
    }
}

/// Only the lease owner holding an event may nack it (55000 `OUTBOX_NOT_LEASED`). An expired
/// lease that nobody has re-taken is still held: the attempt is over either way.
pub fn check_held(id: &str, lease_owner: &str, status: &str, held_by: Option<&str>) -> Result<()> {
    if status == "processing" && held_by == Some(lease_owner) {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::OutboxNotLeased,
        format!("outbox event {id} is not leased to {lease_owner}"),
    )
    .with("id", id)
    .with("lease_owner", lease_owner)
    .with("status", status)
    .with("held_by", held_by))
}

/// Only a failed event is replayed (55000 `OUTBOX_NOT_FAILED`).
pub fn check_failed(id: &str, status: &str) -> Result<()> {
    if status == "failed" {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::OutboxNotFailed,
        format!("outbox event {id} is not in failed state (it is {status})"),
    )
    .with("id", id)
    .with("status", status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;

    #[test]
    fn backoff_doubles_from_one_second_up_to_300() {
        let delays: Vec<i32> = (1..=12).map(backoff_seconds).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(backoff_seconds(0), 1);
        assert_eq!(backoff_seconds(i32::MIN), 1);
        assert_eq!(backoff_seconds(64), 300);
        assert_eq!(backoff_seconds(i32::MAX), 300);
    }

    #[test]
    fn an_event_fails_exactly_at_its_64th_attempt() {
        for attempt in 1..64 {
            assert!(
                matches!(after_nack(attempt, 0), AfterNack::Retry { .. }),
                "{attempt}"
            );
        }
        assert_eq!(after_nack(1, 0), AfterNack::Retry { delay_seconds: 1 });
        assert_eq!(after_nack(63, 0), AfterNack::Retry { delay_seconds: 300 });
        assert_eq!(after_nack(64, 0), AfterNack::Fail);
        assert!(!exhausted(63, 0));
        assert!(exhausted(64, 0));
    }

    #[test]
    fn each_replay_gives_another_64_attempts_and_restarts_the_backoff() {
        // Replayed once at attempt_count 64: attempts 65..=127 retry, 128 fails.
        assert_eq!(attempts_since_replay(64, 1), 0);
        assert!(!exhausted(64, 1), "a replayed event is claimable again");
        assert_eq!(after_nack(65, 1), AfterNack::Retry { delay_seconds: 1 });
        assert_eq!(after_nack(66, 1), AfterNack::Retry { delay_seconds: 2 });
        for attempt in 65..128 {
            assert!(
                matches!(after_nack(attempt, 1), AfterNack::Retry { .. }),
                "{attempt}"
            );
        }
        assert_eq!(after_nack(128, 1), AfterNack::Fail);
        // And again after a second replay.
        assert_eq!(after_nack(129, 2), AfterNack::Retry { delay_seconds: 1 });
        assert_eq!(after_nack(191, 2), AfterNack::Retry { delay_seconds: 300 });
        assert_eq!(after_nack(192, 2), AfterNack::Fail);
    }

    #[test]
    fn odd_counts_do_not_overflow() {
        assert_eq!(attempts_since_replay(5, 100), 0);
        assert_eq!(attempts_since_replay(i32::MAX, i32::MAX), 0);
        assert_eq!(attempts_since_replay(10, -1), 10);
        assert!(exhausted(i32::MAX, 0));
        assert_eq!(after_nack(0, 0), AfterNack::Retry { delay_seconds: 1 });
    }

    #[test]
    fn only_the_holder_nacks_and_only_failed_events_replay() {
        assert!(check_held("obx_1", "c1", "processing", Some("c1")).is_ok());
        for (status, owner) in [
            ("processing", Some("c2")),
            ("pending", None),
            ("done", None),
            ("failed", None),
        ] {
            let e = check_held("obx_1", "c1", status, owner).unwrap_err();
            assert_eq!(
                (e.class(), e.code),
                (Class::WrongState, Code::OutboxNotLeased)
            );
            assert_eq!(e.detail["status"], status);
        }
        assert!(check_failed("obx_1", "failed").is_ok());
        for status in ["pending", "processing", "done"] {
            let e = check_failed("obx_1", status).unwrap_err();
            assert_eq!(
                (e.class(), e.code),
                (Class::WrongState, Code::OutboxNotFailed)
            );
            assert!(e.message.contains("not in failed state"), "{}", e.message);
        }
    }

    #[test]
    fn claim_bounds() {
        assert_eq!(claim_events(1).unwrap(), 1);
        assert_eq!(claim_events(1000).unwrap(), 1000);
        for bad in [0, -1, 1001] {
            let e = claim_events(bad).unwrap_err();
            assert_eq!(e.code, Code::LimitInvalid);
            assert_eq!(e.detail["argument"], "max_events");
        }
        assert_eq!(lease_seconds(1).unwrap(), 1);
        assert_eq!(lease_seconds(86_400).unwrap(), 86_400);
        for bad in [0, -5, 86_401] {
            assert_eq!(lease_seconds(bad).unwrap_err().code, Code::TimeoutInvalid);
        }
    }
}
