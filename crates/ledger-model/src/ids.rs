//! Identifiers: `<prefix>_<ULID>`, monotonic within a backend, and validation of ids that
//! callers supply themselves.

use crate::error::{Code, LedgerError, Result};
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

/// A caller-supplied id (or scope name): 1 to 128 characters, printable, no whitespace. (128
/// characters are at most 512 bytes, so a scope and an id always fit one index row.) Invisible
/// format characters count as unprintable: an id with a zero-width space or a bidi override
/// would look like another id in every log and psql screen.
pub fn validate(argument: &str, value: &str) -> Result<()> {
    check(argument, value, MAX_ID_CHARS, MAX_ID_CHARS * 4)
}

/// The longest idempotency key (a default key holds a run id and a tool call id).
pub const MAX_KEY_CHARS: usize = 512;
/// Keys are indexed after a scope of up to 2 x 512 bytes; a btree row holds at most 2704.
pub const MAX_KEY_BYTES: usize = 1024;

/// Like `validate`, for keys (idempotency keys, cost source references): up to 512 characters
/// and 1024 bytes.
pub fn validate_key(argument: &str, value: &str) -> Result<()> {
    check(argument, value, MAX_KEY_CHARS, MAX_KEY_BYTES)
}

fn check(argument: &str, value: &str, max_chars: usize, max_bytes: usize) -> Result<()> {
    let count = value.chars().count();
    let too_long = format!("is longer than {max_chars} characters");
    let too_big = format!("is longer than {max_bytes} bytes");
    let reason = if count == 0 {
        Some("is empty")
    } else if count > max_chars {
        Some(too_long.as_str())
    } else if value.len() > max_bytes {
        Some(too_big.as_str())
    } else if value
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || is_format(c))
    {
        Some("contains whitespace, control or invisible format characters")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(
            LedgerError::new(Code::IdInvalid, format!("{argument} {reason}"))
                .with("argument", argument)
                .with("length", count),
        ),
    }
}

/// Unicode's format characters (general category Cf, Unicode 15.1): zero-width, bidi, tags.
pub fn is_format(c: char) -> bool {
    matches!(c,
        '\u{AD}' | '\u{600}'..='\u{605}' | '\u{61C}' | '\u{6DD}' | '\u{70F}' | '\u{890}'..='\u{891}'
        | '\u{8E2}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206F}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}'
        | '\u{110BD}' | '\u{110CD}' | '\u{13430}'..='\u{1343F}' | '\u{1BCA0}'..='\u{1BCA3}'
        | '\u{1D173}'..='\u{1D17A}' | '\u{E0001}' | '\u{E0020}'..='\u{E007F}')
}

/// The bidi embeddings, overrides and isolates: text after them displays reordered.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// The longest label (mode, kind, subject): they are indexed, and a btree row holds 2704 bytes.
pub const MAX_LABEL_BYTES: usize = 256;

/// A label such as a run's mode or subject: free text (spaces allowed, emoji joiners too), no
/// control characters or bidi controls, at most 256 bytes (22023 `LABEL_INVALID`).
pub fn validate_label(argument: &str, value: &str) -> Result<()> {
    check_label(argument, value, MAX_LABEL_BYTES)
}

/// The longest storage key of an external store (S3's own limit).
pub const MAX_STORAGE_KEY_BYTES: usize = 1024;

/// An external store's key (a path, an object key): a label of up to 1024 bytes.
pub fn validate_storage_key(argument: &str, value: &str) -> Result<()> {
    check_label(argument, value, MAX_STORAGE_KEY_BYTES)
}

fn check_label(argument: &str, value: &str, max_bytes: usize) -> Result<()> {
    let too_long = format!("is longer than {max_bytes} bytes");
    let reason = if value.len() > max_bytes {
        too_long.as_str()
    } else if value.chars().any(|c| c.is_control() || is_bidi_control(c)) {
        "contains control or bidi control characters"
    } else {
        return Ok(());
    };
    Err(
        LedgerError::new(Code::LabelInvalid, format!("{argument} {reason}"))
            .with("argument", argument)
            .with("bytes", value.len()),
    )
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
            "",
            " x",
            "a b",
            "a\tb",
            "a\nb",
            "a\u{0}b",
            "a\u{7f}b",
            "\u{a0}",
            // Invisible: zero-width space and joiner, BOM, a bidi override, a tag character.
            "ab\u{200b}",
            "a\u{200d}b",
            "\u{feff}ab",
            "run\u{202e}1",
            "r\u{e0041}",
        ] {
            let e = validate("run_id", bad).unwrap_err();
            assert_eq!(
                (e.class(), e.code),
                (Class::InvalidParameter, Code::IdInvalid),
                "{bad:?}"
            );
        }
        let e = validate("run_id", &"x".repeat(129)).unwrap_err();
        assert_eq!(e.detail["length"], 129);
    }

    #[test]
    fn keys_and_labels_are_bounded_in_bytes_too() {
        let wide = "\u{20000}"; // 4 bytes
        assert!(validate_key("k", &wide.repeat(256)).is_ok());
        let e = validate_key("k", &wide.repeat(257)).unwrap_err();
        assert_eq!(e.code, Code::IdInvalid);
        assert!(e.message.contains("1024 bytes"));
        assert!(validate_key("k", &"k".repeat(512)).is_ok());
        assert!(validate_key("k", &"k".repeat(513)).is_err());
        assert!(validate("id", &wide.repeat(128)).is_ok());
        assert!(validate_label("mode", "Support Bot v2").is_ok());
        assert!(validate_storage_key("storage_key", &"k ".repeat(512)).is_ok());
        let e = validate_storage_key("storage_key", &"k".repeat(1025)).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::LabelInvalid, "storage_key is longer than 1024 bytes")
        );
        assert!(validate_label("mode", &"m".repeat(256)).is_ok());
        assert_eq!(
            validate_label("mode", &"m".repeat(257)).unwrap_err().code,
            Code::LabelInvalid
        );
        assert_eq!(
            validate_label("mode", "a\nb").unwrap_err().code,
            Code::LabelInvalid
        );
        assert_eq!(
            validate_label("subject", "invoice \u{202e}fdp.exe")
                .unwrap_err()
                .code,
            Code::LabelInvalid
        );
        assert!(validate_label("mode", "team \u{1F469}\u{200D}\u{1F4BB}").is_ok());
    }
}
