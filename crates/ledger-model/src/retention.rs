//! Retention's argument rule, without Postgres: how far back a purge may reach.

use crate::error::{Code, LedgerError, Result};

/// The longest `older_than`, in years. Every part of the interval stays within it, so that
/// `now() - older_than` is always a timestamp (PostgreSQL's reach back is 4713 BC), whatever the
/// signs of the parts.
pub const MAX_OLDER_THAN_YEARS: i64 = 1000;

const USECS_PER_DAY: i128 = 86_400_000_000;

/// Checks a purge's `older_than`, given as an interval's months, days and microseconds: not
/// negative and at most 1000 years as PostgreSQL compares intervals (a month is 30 days, a day
/// 24 hours), and no part longer than that on its own (22023 `INTERVAL_INVALID`).
pub fn check_older_than(months: i32, days: i32, micros: i64) -> Result<()> {
    let total = (i128::from(months) * 30 + i128::from(days)) * USECS_PER_DAY + i128::from(micros);
    if total < 0 {
        return Err(LedgerError::new(
            Code::IntervalInvalid,
            "older_than must not be negative",
        ));
    }
    // At most `interval '1000 years'` as PostgreSQL compares intervals, and so is each part on
    // its own (a part's days or microseconds bounded by 366 days a year), whatever the others.
    let years = i128::from(MAX_OLDER_THAN_YEARS);
    let max_days = years * 366;
    let in_range = total <= years * 12 * 30 * USECS_PER_DAY
        && i128::from(months).abs() <= years * 12
        && i128::from(days).abs() <= max_days
        && i128::from(micros).abs() <= max_days * USECS_PER_DAY;
    if in_range {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::IntervalInvalid,
        format!("older_than is out of range (at most {MAX_OLDER_THAN_YEARS} years)"),
    )
    .with("max_years", MAX_OLDER_THAN_YEARS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_than_is_neither_negative_nor_beyond_reach() {
        let day = 86_400_000_000_i64;
        for ok in [
            (0, 0, 0),
            (0, 30, 0),
            (12_000, 0, 0),
            (0, 1, -3_600_000_000),
            (-1, 31, 0),
        ] {
            assert!(check_older_than(ok.0, ok.1, ok.2).is_ok(), "{ok:?}");
        }
        for negative in [(0, -1, 0), (0, 0, -1), (1, -31, 0), (i32::MIN, 0, 0)] {
            let e = check_older_than(negative.0, negative.1, negative.2).unwrap_err();
            assert_eq!(e.message, "older_than must not be negative", "{negative:?}");
        }
        for far in [
            (120_000, 0, 0),
            (12_001, 0, 0),
            (12_000, 1, 0),
            (0, 365_000, 0),
            (0, i32::MAX, 0),
            (0, 0, i64::MAX),
            // Positive overall, with each part far out on its own.
            (i32::MAX, i32::MIN, 0),
            (2_136_000_000, -2_000_000_000, 0),
            (0, 400_000, -400_000 * day + 1),
        ] {
            let e = check_older_than(far.0, far.1, far.2).unwrap_err();
            assert_eq!(
                (e.code, e.detail["max_years"].as_i64()),
                (Code::IntervalInvalid, Some(1000)),
                "{far:?}"
            );
        }
    }
}
