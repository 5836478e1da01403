//! Schedules: a cron expression (five fields, minute to day of week, or a macro such as
//! `@daily`) and the next local minute it names. Time zones are the database's: the SPI layer
//! turns an instant into local fields and back, so this module counts in local minutes only.

use crate::error::{Code, LedgerError, Result};

/// A local wall-clock minute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Minute {
    pub year: i32,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
}

/// A parsed cron expression: the allowed values of each field as bit sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cron {
    minutes: u64,
    hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    /// The day of month or the day of week is `*`: then a day matches when the other field does
    /// (otherwise when either does, as cron has always read them).
    any_day: bool,
    any_weekday: bool,
}

/// What happens to firings missed while no sweep ran (the database was down, no sweeper was
/// scheduled): `latest` runs once for the most recent, `all` runs each (at most
/// `MAX_CATCH_UP` per sweep).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatchUp {
    Latest,
    All,
}

/// The most runs one sweep creates for one schedule's missed firings.
pub const MAX_CATCH_UP: usize = 100;

impl CatchUp {
    pub fn parse(value: &str) -> Result<CatchUp> {
        match value {
            "latest" => Ok(CatchUp::Latest),
            "all" => Ok(CatchUp::All),
            other => Err(
                LedgerError::new(Code::CatchUpUnknown, "catch_up must be latest or all")
                    .with("catch_up", other),
            ),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Latest => "latest",
            CatchUp::All => "all",
        }
    }
}

fn invalid(expr: &str, why: &str) -> LedgerError {
    LedgerError::new(Code::CronInvalid, format!("cron expression: {why}")).with("cron", expr)
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// One field's allowed values as a bit set: lists of `*`, `n`, `a-b`, each with an optional
/// `/step`; `names` (months, weekdays) may stand for their numbers.
fn field(expr: &str, text: &str, min: u32, max: u32, names: &[&str]) -> Result<u64> {
    // A message names at most the start of a bad part.
    let cut = |s: &str| crate::text::truncate_chars(s, 32).to_owned();
    let value = |s: &str| -> Result<u32> {
        let upper = s.to_ascii_uppercase();
        if let Some(i) = names.iter().position(|n| *n == upper) {
            return Ok(min + i as u32);
        }
        s.parse::<u32>()
            .ok()
            .filter(|v| (min..=max).contains(v))
            .ok_or_else(|| invalid(expr, &format!("{} is not in {min}-{max}", cut(s))))
    };
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                s.parse::<u32>()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| invalid(expr, &format!("bad step in {}", cut(part))))?,
            ),
            None => (part, 1),
        };
        let (lo, hi) = match range {
            "*" => (min, max),
            r => match r.split_once('-') {
                Some((a, b)) => (value(a)?, value(b)?),
                // `n/step` runs from n to the end of the field.
                None if part.contains('/') => (value(r)?, max),
                None => {
                    let v = value(r)?;
                    (v, v)
                }
            },
        };
        if lo > hi {
            return Err(invalid(expr, &format!("{} runs backwards", cut(part))));
        }
        for v in (lo..=hi).step_by(step as usize) {
            bits |= 1 << v;
        }
    }
    Ok(bits)
}

impl Cron {
    /// Parses `minute hour day-of-month month day-of-week` (numbers, ranges, lists, steps, month
    /// and weekday names; 7 is Sunday too) or `@yearly`, `@annually`, `@monthly`, `@weekly`,
    /// `@daily`, `@midnight`, `@hourly` (22023 `CRON_INVALID`).
    pub fn parse(expr: &str) -> Result<Cron> {
        let text = match expr.trim() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other => other,
        };
        let fields: Vec<&str> = text.split_whitespace().collect();
        let [minute, hour, day, month, weekday] = fields[..] else {
            return Err(invalid(
                expr,
                "five fields (minute hour day-of-month month day-of-week) or a macro such as @daily",
            ));
        };
        let weekdays = field(expr, weekday, 0, 7, &WEEKDAYS)?;
        Ok(Cron {
            minutes: field(expr, minute, 0, 59, &[])?,
            hours: field(expr, hour, 0, 23, &[])? as u32,
            days: field(expr, day, 1, 31, &[])? as u32,
            months: field(expr, month, 1, 12, &MONTHS)? as u16,
            // Sunday is 0 and 7.
            weekdays: ((weekdays | (weekdays >> 7)) & 0x7f) as u8,
            any_day: day == "*",
            any_weekday: weekday == "*",
        })
    }

    fn day_matches(&self, year: i32, month: u32, day: u32) -> bool {
        if self.months & (1 << month) == 0 {
            return false;
        }
        let by_day = self.days & (1 << day) != 0;
        let by_weekday = self.weekdays & (1 << weekday(year, month, day)) != 0;
        match (self.any_day, self.any_weekday) {
            (true, true) => true,
            (false, true) => by_day,
            (true, false) => by_weekday,
            (false, false) => by_day || by_weekday,
        }
    }

    /// The first minute after `after` (strictly) that the expression names, looking up to eight
    /// years ahead (None: it names none, such as February 30th).
    pub fn next_after(&self, after: Minute) -> Option<Minute> {
        let (mut year, mut month, mut day) = (after.year, after.month, after.day);
        let mut from = Some((after.hour, after.minute + 1));
        for _ in 0..(8 * 366) {
            if self.day_matches(year, month, day) {
                let (h0, m0) = from.unwrap_or((0, 0));
                for hour in h0..24 {
                    if self.hours & (1 << hour) == 0 {
                        continue;
                    }
                    let start = if hour == h0 { m0 } else { 0 };
                    if let Some(minute) = (start..60).find(|m| self.minutes & (1 << m) != 0) {
                        return Some(Minute {
                            year,
                            month,
                            day,
                            hour,
                            minute,
                        });
                    }
                }
            }
            from = None;
            day += 1;
            if day > days_in_month(year, month) {
                day = 1;
                month += 1;
                if month > 12 {
                    month = 1;
                    year += 1;
                }
            }
        }
        None
    }
}

fn leap(year: i32) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        2 if leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// 0 for Sunday to 6 for Saturday (Sakamoto's method).
fn weekday(year: i32, month: u32, day: u32) -> u32 {
    const T: [i32; 12] = [0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4];
    let y = if month < 3 { year - 1 } else { year };
    ((y + y / 4 - y / 100 + y / 400 + T[month as usize - 1] + day as i32).rem_euclid(7)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(year: i32, month: u32, day: u32, hour: u32, minute: u32) -> Minute {
        Minute {
            year,
            month,
            day,
            hour,
            minute,
        }
    }

    fn next(expr: &str, after: Minute) -> Option<Minute> {
        Cron::parse(expr).unwrap().next_after(after)
    }

    #[test]
    fn the_next_minute_is_strictly_later_and_the_first_named() {
        let noon = at(2026, 12, 4, 12, 0);
        assert_eq!(next("* * * * *", noon), Some(at(2026, 12, 4, 12, 1)));
        assert_eq!(next("0 12 * * *", noon), Some(at(2026, 12, 5, 12, 0)));
        assert_eq!(
            next("*/15 9-17 * * MON-FRI", noon),
            Some(at(2026, 12, 4, 12, 15))
        );
        // 2026-12-04 is a Friday: after 17:45 the next weekday is Monday the 7th.
        assert_eq!(
            next("*/15 9-17 * * MON-FRI", at(2026, 12, 4, 17, 45)),
            Some(at(2026, 12, 7, 9, 0))
        );
        assert_eq!(next("@daily", noon), Some(at(2026, 12, 5, 0, 0)));
        assert_eq!(
            next("@hourly", at(2026, 12, 31, 23, 30)),
            Some(at(2027, 1, 1, 0, 0))
        );
        assert_eq!(next("@yearly", noon), Some(at(2027, 1, 1, 0, 0)));
        assert_eq!(next("30 2 29 feb *", noon), Some(at(2028, 2, 29, 2, 30)));
        assert_eq!(next("0 0 30 2 *", noon), None);
        assert_eq!(
            next("5,35 * * * *", at(2026, 1, 1, 0, 5)),
            Some(at(2026, 1, 1, 0, 35))
        );
        assert_eq!(
            next("10/20 * * * *", at(2026, 1, 1, 0, 31)),
            Some(at(2026, 1, 1, 0, 50))
        );
    }

    #[test]
    fn day_of_month_and_day_of_week_match_either_when_both_are_given() {
        // The 13th, or any Friday.
        let cron = Cron::parse("0 0 13 * 5").unwrap();
        assert_eq!(
            cron.next_after(at(2026, 12, 4, 12, 0)),
            Some(at(2026, 12, 11, 0, 0))
        );
        assert_eq!(
            cron.next_after(at(2026, 12, 11, 0, 0)),
            Some(at(2026, 12, 13, 0, 0))
        );
        // Sunday is 0 and 7.
        assert_eq!(
            Cron::parse("0 0 * * 7").unwrap(),
            Cron::parse("0 0 * * 0").unwrap()
        );
        assert_eq!(
            next("0 0 * * sun", at(2026, 12, 4, 0, 0)),
            Some(at(2026, 12, 6, 0, 0))
        );
    }

    #[test]
    fn weekdays_are_right_across_centuries() {
        assert_eq!(weekday(2026, 12, 4), 5);
        assert_eq!(weekday(2000, 2, 29), 2);
        assert_eq!(weekday(1900, 1, 1), 1);
        assert_eq!(weekday(2100, 3, 1), 1);
    }

    #[test]
    fn a_bad_expression_is_refused_with_the_reason() {
        for bad in [
            "",
            "* * * *",
            "* * * * * *",
            "60 * * * *",
            "* 24 * * *",
            "* * 0 * *",
            "* * * 13 *",
            "* * * * 8",
            "*/0 * * * *",
            "5-1 * * * *",
            "a * * * *",
            "@every_5m",
        ] {
            let e = Cron::parse(bad).unwrap_err();
            assert_eq!(e.code, Code::CronInvalid, "{bad:?}");
            assert_eq!(e.detail["cron"], bad, "{bad:?}");
        }
        assert_eq!(CatchUp::parse("all"), Ok(CatchUp::All));
        assert_eq!(
            CatchUp::parse("none").unwrap_err().code,
            Code::CatchUpUnknown
        );
    }
}
