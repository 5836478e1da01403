//! Cost entries: the usage vocabulary and the money rules, without Postgres.

use crate::error::{LedgerError, Result};
use serde_json::Value;

/// The usage keys a cost entry may carry, each a non-negative integer.
pub const USAGE_KEYS: [&str; 12] = [
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cache_read_tokens",
    "cache_creation_tokens",
    "reasoning_tokens",
    "latency_ms",
    "request_count",
    "embedding_count",
    "rerank_count",
    "vector_count",
    "storage_bytes",
];

/// Checks a usage object: known keys only, each a non-negative integer.
pub fn validate_usage(usage: &Value) -> Result<()> {
    let Value::Object(map) = usage else {
        return Err(
            LedgerError::invalid("ARGUMENT_NOT_OBJECT", "usage must be a JSON object")
                .with("argument", "usage"),
        );
    };
    for (key, value) in map {
        if !USAGE_KEYS.contains(&key.as_str()) {
            return Err(LedgerError::invalid(
                "USAGE_KEY_UNKNOWN",
                format!(
                    "unknown usage key {:?}",
                    crate::text::truncate_chars(key, 64)
                ),
            )
            .with("key", key.as_str())
            .with("known", USAGE_KEYS.to_vec()));
        }
        if value.as_u64().is_none() {
            return Err(LedgerError::invalid(
                "USAGE_INVALID",
                format!("usage {key} must be a non-negative integer"),
            )
            .with("key", key.as_str()));
        }
    }
    Ok(())
}

/// Checks a decimal's text (as PostgreSQL prints a numeric): finite and not negative.
pub fn check_non_negative(argument: &str, code: &'static str, text: &str) -> Result<()> {
    let finite = !matches!(text, "NaN" | "Infinity" | "-Infinity");
    let negative = text.starts_with('-') && text.bytes().any(|b| matches!(b, b'1'..=b'9'));
    if finite && !negative {
        return Ok(());
    }
    Err(LedgerError::invalid(
        code,
        format!("{argument} must be a finite number of at least 0"),
    )
    .with("argument", argument)
    .with("value", text))
}

/// A currency code, upper-cased: 2 to 16 of `[A-Z0-9_]`, starting with a letter (ISO 4217 codes,
/// and units such as CREDITS).
pub fn currency(code: &str) -> Result<String> {
    let upper = if code.len() <= 16 {
        code.to_ascii_uppercase()
    } else {
        String::new()
    };
    let ok = (2..=16).contains(&upper.len())
        && upper.starts_with(|c: char| c.is_ascii_uppercase())
        && upper
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(upper)
    } else {
        Err(LedgerError::invalid(
            "CURRENCY_INVALID",
            "currency must be a code such as USD or EUR",
        )
        .with("currency", crate::text::truncate_chars(code, 64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_takes_the_known_keys_as_non_negative_integers() {
        let all: serde_json::Map<String, Value> = USAGE_KEYS
            .iter()
            .map(|k| (k.to_string(), json!(1)))
            .collect();
        assert!(validate_usage(&Value::Object(all)).is_ok());
        assert!(validate_usage(&json!({})).is_ok());
        assert_eq!(
            validate_usage(&json!({"tokens": 1})).unwrap_err().code,
            "USAGE_KEY_UNKNOWN"
        );
        for bad in [json!(-1), json!(1.5), json!("3"), json!(null)] {
            assert_eq!(
                validate_usage(&json!({"prompt_tokens": bad}))
                    .unwrap_err()
                    .code,
                "USAGE_INVALID"
            );
        }
        assert_eq!(
            validate_usage(&json!([1])).unwrap_err().code,
            "ARGUMENT_NOT_OBJECT"
        );
    }

    #[test]
    fn money_is_finite_and_not_negative() {
        for ok in [
            "0",
            "0.00",
            "-0",
            "-0.000",
            "1.25",
            "123456789012345678901234567890.5",
        ] {
            assert!(
                check_non_negative("amount", "AMOUNT_INVALID", ok).is_ok(),
                "{ok}"
            );
        }
        for bad in ["-1", "-0.01", "NaN", "Infinity", "-Infinity"] {
            assert_eq!(
                check_non_negative("amount", "AMOUNT_INVALID", bad)
                    .unwrap_err()
                    .code,
                "AMOUNT_INVALID",
                "{bad}"
            );
        }
    }

    #[test]
    fn currencies_are_codes() {
        assert_eq!(currency("usd").unwrap(), "USD");
        assert_eq!(currency("CREDITS").unwrap(), "CREDITS");
        for bad in ["", "U", "1USD", "US D", "€", "A_VERY_LONG_CURRENCY_CODE"] {
            assert_eq!(currency(bad).unwrap_err().code, "CURRENCY_INVALID", "{bad}");
        }
    }
}
