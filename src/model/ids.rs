//! Identifiers: `<prefix>_<ULID>`, monotonic within a backend, and validation of ids that
//! callers supply themselves.

use crate::error::{LedgerError, Result};
use std::cell::RefCell;

thread_local! {
    // One generator per backend process: ULIDs from it are strictly increasing, even within a
    // millisecond.
    static GENERATOR: RefCell<ulid::Generator> = const { RefCell::new(ulid::Generator::new()) };
}

pub const MAX_ID_CHARS: usize = 128;

/// A new `<prefix>_<ULID>`.
pub fn new_id(prefix: &str) -> String {
    let ulid = GENERATOR
        .with(|g| g.borrow_mut().generate())
        // The random part overflowed within one millisecond (after 2^80 ids): a fresh ULID is
        // still unique, only no longer ordered after the previous one.
        .unwrap_or_else(|_| ulid::Ulid::new());
    format!("{prefix}_{ulid}")
}

/// A caller-supplied id (or scope name): 1 to 128 characters, printable, no whitespace.
pub fn validate(argument: &str, value: &str) -> Result<()> {
    validate_up_to(argument, value, MAX_ID_CHARS)
}

/// The longest idempotency key (a default key holds a run id and a tool call id).
pub const MAX_KEY_CHARS: usize = 512;

/// Like `validate`, for keys of up to `max` characters.
pub fn validate_up_to(argument: &str, value: &str, max: usize) -> Result<()> {
    let count = value.chars().count();
    let too_long = format!("is longer than {max} characters");
    let reason = if count == 0 {
        Some("is empty")
    } else if count > max {
        Some(too_long.as_str())
    } else if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains whitespace or control characters")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(
            LedgerError::invalid("ID_INVALID", format!("{argument} {reason}"))
                .with("argument", argument)
                .with("length", count),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;

    #[test]
    fn ids_have_prefix_and_ulid() {
        let id = new_id("run");
        let (prefix, ulid) = id.split_once('_').unwrap();
        assert_eq!(prefix, "run");
        assert_eq!(ulid.len(), 26);
        assert!(ulid::Ulid::from_string(ulid).is_ok());
        assert!(ulid
            .chars()
            .all(|c| c.is_ascii_digit() || c.is_ascii_uppercase()));
    }

    #[test]
    fn ids_are_monotonic_within_a_backend() {
        let ids: Vec<String> = (0..10_000).map(|_| new_id("evt")).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn caller_ids_are_validated() {
        assert!(validate("run_id", "r").is_ok());
        assert!(validate("run_id", "run-2026/12/02:α").is_ok());
        assert!(validate("run_id", &"x".repeat(128)).is_ok());
        assert!(validate("run_id", &"é".repeat(128)).is_ok());
        for bad in [
            "", " x", "a b", "a\tb", "a\nb", "a\u{0}b", "a\u{7f}b", "\u{a0}",
        ] {
            let e = validate("run_id", bad).unwrap_err();
            assert_eq!(
                (e.class, e.code),
                (Class::InvalidParameter, "ID_INVALID"),
                "{bad:?}"
            );
        }
        let e = validate("run_id", &"x".repeat(129)).unwrap_err();
        assert_eq!(e.detail["length"], 129);
    }
}
