//! SQL faces of the pure redaction and canonical-hashing rules, so clients and psql users can
//! check what the ledger stores and hashes.

use crate::error::{Code, LedgerError, SqlError};
use crate::guc;
use crate::jsonb::Jsonb;
use ledger_model::{json, redaction, text};
use pgrx::prelude::*;

fn parse(value: &Jsonb) -> Result<serde_json::Value, LedgerError> {
    json::parse(value.as_str())
}

/// A JSON-object argument, redacted under the current rules; NULL is `{}`. Anything but an
/// object fails 22023 `ARGUMENT_NOT_OBJECT`.
pub fn redacted_object(
    argument: &str,
    value: Option<Jsonb>,
) -> Result<serde_json::Value, LedgerError> {
    match value {
        None => Ok(serde_json::json!({})),
        Some(v) if v.is_object() => Ok(redaction::redact(&guc::redaction_rules(), parse(&v)?)),
        Some(_) => Err(LedgerError::new(
            Code::ArgumentNotObject,
            format!("{argument} must be a JSON object"),
        )
        .with("argument", argument)),
    }
}

/// Any JSON argument (a tool result, run inputs), redacted under the current rules.
pub fn redacted_json(value: &Jsonb) -> Result<serde_json::Value, LedgerError> {
    Ok(redaction::redact(&guc::redaction_rules(), parse(value)?))
}

/// Free text (a summary, an error message, a note, a title, a comment) as the ledger stores it:
/// credentials found by the value patterns replaced, then cut to `text::SUMMARY_CHARS`. Redacted
/// before the final cut, so that the cut never leaves the start of a secret the patterns would
/// no longer see; the first cut, well past it, bounds the work on huge text.
pub fn free_text(value: Option<&str>) -> Option<String> {
    free_text_within(value, text::SUMMARY_CHARS)
}

/// `free_text` cut to `max` characters instead.
pub fn free_text_within(value: Option<&str>, max: usize) -> Option<String> {
    value.map(|v| {
        let head = text::truncate_chars(v, 4 * max);
        text::truncate_chars(&redaction::redact_text(&guc::redaction_rules(), head), max).to_owned()
    })
}

/// The value with every sensitive key's value and every credential-like string replaced by
/// "[REDACTED]", under the current `ledger.redact_keys` and `ledger.redact_values`.
#[pg_extern(stable, strict, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn redact(value: Jsonb) -> Result<Jsonb, SqlError> {
    Ok(Jsonb::from(&redaction::redact(
        &guc::redaction_rules(),
        parse(&value)?,
    )))
}

/// The canonical JSON text of a value: keys sorted by code point, no insignificant whitespace.
#[pg_extern(immutable, strict, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn canonical_json(value: Jsonb) -> Result<String, SqlError> {
    Ok(json::canonical(&parse(&value)?))
}

/// The hex sha256 of the canonical JSON: a tool call's request_hash.
#[pg_extern(immutable, strict, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn request_hash(value: Jsonb) -> Result<String, SqlError> {
    // Unsized like the tool-call arguments it hashes.
    Ok(json::request_hash(&json::parse_unsized(value.as_str())?))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::one;
    use pgrx::prelude::*;

    #[pg_test]
    fn redaction_and_hashing_are_exposed_for_clients() {
        assert_eq!(
            one::<String>(
                r#"SELECT ledger.redact('{"X-API-Key": "a", "token_count": 3, "auth": "Bearer abcdefghijk"}')::text"#
            ),
            r#"{"auth": "[REDACTED]", "X-API-Key": "[REDACTED]", "token_count": 3}"#
        );
        Spi::run("SET LOCAL ledger.redact_keys = 'customerSsn, internal-note'").unwrap();
        Spi::run("SET LOCAL ledger.redact_values = off").unwrap();
        assert_eq!(
            one::<String>(
                r#"SELECT ledger.redact('{"customer_ssn": "1", "InternalNote": "2", "header": "Bearer abcdefghijk"}')::text"#
            ),
            r#"{"header": "Bearer abcdefghijk", "InternalNote": "[REDACTED]", "customer_ssn": "[REDACTED]"}"#
        );
        assert_eq!(
            one::<String>(r#"SELECT ledger.canonical_json('{"b": [1.0, {}], "a": "é"}')"#),
            r#"{"a":"é","b":[1.0,{}]}"#
        );
        assert_eq!(
            one::<String>("SELECT ledger.request_hash('{}')"),
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert!(one::<bool>("SELECT ledger.redact(NULL) IS NULL"));
    }
}
