//! Cost entries: the usage vocabulary and the money rules, without Postgres.

use crate::error::{Code, LedgerError, Result};
use serde_json::Value;

/// The usage keys a cost entry stores, each a non-negative integer.
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

/// Other names for usage keys: those of the OpenAI (Chat Completions, Responses) and Anthropic
/// (Messages) APIs, so that their usage objects can be passed as they come.
const USAGE_ALIASES: [(&str, &str); 4] = [
    ("input_tokens", "prompt_tokens"),
    ("output_tokens", "completion_tokens"),
    ("cache_read_input_tokens", "cache_read_tokens"),
    ("cache_creation_input_tokens", "cache_creation_tokens"),
];

/// The APIs' breakdown objects and the one count of each that has a usage key. Their other
/// counts (audio tokens, predicted-output tokens) have none: a zero or null one says nothing and
/// is dropped, any other is refused rather than lost.
const USAGE_DETAILS: [(&str, &str, &str); 4] = [
    (
        "prompt_tokens_details",
        "cached_tokens",
        "cache_read_tokens",
    ),
    ("input_tokens_details", "cached_tokens", "cache_read_tokens"),
    (
        "completion_tokens_details",
        "reasoning_tokens",
        "reasoning_tokens",
    ),
    (
        "output_tokens_details",
        "reasoning_tokens",
        "reasoning_tokens",
    ),
];

fn unknown_usage_key(key: &str) -> LedgerError {
    let mut accepted: Vec<&str> = USAGE_KEYS.to_vec();
    accepted.extend(USAGE_ALIASES.iter().map(|(alias, _)| *alias));
    accepted.extend(USAGE_DETAILS.iter().map(|(object, _, _)| *object));
    LedgerError::new(
        Code::UsageKeyUnknown,
        format!(
            "unknown usage key {:?}",
            crate::text::truncate_chars(key, 64)
        ),
    )
    .with("key", key)
    .with("known", accepted)
}

fn usage_count(key: &str, value: &Value) -> Result<u64> {
    value.as_u64().ok_or_else(|| {
        LedgerError::new(
            Code::UsageInvalid,
            format!("usage {key} must be a non-negative integer"),
        )
        .with("key", key)
    })
}

/// A usage object in the stored form: every count under its usage key (aliases and the APIs'
/// breakdowns mapped), null counts left out, each a non-negative integer. Two names of one key
/// must agree (`prompt_tokens` and `input_tokens`), or 22023 `USAGE_INVALID`.
pub fn normalize_usage(usage: &Value) -> Result<Value> {
    let Value::Object(map) = usage else {
        return Err(
            LedgerError::new(Code::ArgumentNotObject, "usage must be a JSON object")
                .with("argument", "usage"),
        );
    };
    let mut out = serde_json::Map::new();
    let mut put = |key: &'static str, given_as: &str, count: u64| -> Result<()> {
        match out.get(key).and_then(Value::as_u64) {
            Some(other) if other != count => Err(LedgerError::new(
                Code::UsageInvalid,
                format!("usage gives {key} twice with different counts ({other} and {count} as {given_as})"),
            )
            .with("key", key)
            .with("given_as", given_as)),
            _ => {
                out.insert(key.to_owned(), Value::from(count));
                Ok(())
            }
        }
    };
    for (key, value) in map {
        if value.is_null() {
            continue;
        }
        if let Some(canonical) = USAGE_KEYS.iter().find(|k| **k == key.as_str()) {
            put(canonical, key, usage_count(key, value)?)?;
        } else if let Some((_, canonical)) = USAGE_ALIASES.iter().find(|(a, _)| *a == key.as_str())
        {
            put(canonical, key, usage_count(key, value)?)?;
        } else if USAGE_DETAILS
            .iter()
            .any(|(object, _, _)| *object == key.as_str())
        {
            let Value::Object(details) = value else {
                return Err(LedgerError::new(
                    Code::UsageInvalid,
                    format!("usage {key} must be a JSON object"),
                )
                .with("key", key.as_str()));
            };
            for (inner, count) in details {
                let path = format!("{key}.{inner}");
                let mapped = USAGE_DETAILS
                    .iter()
                    .find(|(object, name, _)| *object == key.as_str() && *name == inner.as_str());
                match mapped {
                    Some((_, _, canonical)) if !count.is_null() => {
                        put(canonical, &path, usage_count(&path, count)?)?;
                    }
                    Some(_) => {}
                    None if count.is_null() || usage_count(&path, count)? == 0 => {}
                    None => return Err(unknown_usage_key(&path)),
                }
            }
        } else {
            return Err(unknown_usage_key(key));
        }
    }
    Ok(Value::Object(out))
}

/// The shortest decimal text that reads back as `value` (Rust's `Display` for `f64` prints
/// exactly that, and never an exponent): how a client's float becomes a decimal amount.
pub fn float_text(argument: &str, value: f64) -> Result<String> {
    if value.is_finite() {
        Ok(value.to_string())
    } else {
        Err(LedgerError::new(
            Code::AmountInvalid,
            format!("{argument} must be a finite number of at least 0"),
        )
        .with("argument", argument)
        .with("value", value.to_string()))
    }
}

/// Checks a decimal's text (as PostgreSQL prints a numeric): finite and not negative.
pub fn check_non_negative(argument: &str, code: Code, text: &str) -> Result<()> {
    let finite = !matches!(text, "NaN" | "Infinity" | "-Infinity");
    let negative = text.starts_with('-') && text.bytes().any(|b| matches!(b, b'1'..=b'9'));
    if finite && !negative {
        return Ok(());
    }
    Err(LedgerError::new(
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
        Err(LedgerError::new(
            Code::CurrencyInvalid,
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
        let all = Value::Object(all);
        assert_eq!(normalize_usage(&all).unwrap(), all);
        assert_eq!(normalize_usage(&json!({})).unwrap(), json!({}));
        assert_eq!(
            normalize_usage(&json!({"tokens": 1})).unwrap_err().code,
            Code::UsageKeyUnknown
        );
        for bad in [json!(-1), json!(1.5), json!("3"), json!(true)] {
            for key in ["prompt_tokens", "input_tokens"] {
                assert_eq!(
                    normalize_usage(&json!({ key: bad })).unwrap_err().code,
                    Code::UsageInvalid
                );
            }
        }
        assert_eq!(
            normalize_usage(&json!([1])).unwrap_err().code,
            Code::ArgumentNotObject
        );
    }

    /// The usage objects of the two biggest model APIs, as their SDKs serialize them, are
    /// stored under the ledger's keys; nothing with a count is dropped.
    #[test]
    fn usage_of_the_openai_and_anthropic_apis_maps_to_one_form() {
        let chat_completions = json!({
            "prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500,
            "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 192, "audio_tokens": 0,
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        });
        let responses = json!({
            "input_tokens": 1200, "output_tokens": 300, "total_tokens": 1500,
            "input_tokens_details": {"cached_tokens": 1024},
            "output_tokens_details": {"reasoning_tokens": 192}
        });
        let expected = json!({"prompt_tokens": 1200, "completion_tokens": 300,
            "total_tokens": 1500, "cache_read_tokens": 1024, "reasoning_tokens": 192});
        assert_eq!(normalize_usage(&chat_completions).unwrap(), expected);
        assert_eq!(normalize_usage(&responses).unwrap(), expected);
        let messages = json!({
            "input_tokens": 50, "output_tokens": 20,
            "cache_creation_input_tokens": 300, "cache_read_input_tokens": null
        });
        assert_eq!(
            normalize_usage(&messages).unwrap(),
            json!({"prompt_tokens": 50, "completion_tokens": 20, "cache_creation_tokens": 300})
        );
        // Two names for one count must agree.
        assert!(normalize_usage(&json!({"prompt_tokens": 5, "input_tokens": 5})).is_ok());
        let e = normalize_usage(&json!({"prompt_tokens": 5, "input_tokens": 6})).unwrap_err();
        assert_eq!(
            (e.code, e.detail["key"].clone()),
            (Code::UsageInvalid, json!("prompt_tokens"))
        );
        // A breakdown's count without a usage key is refused unless it is zero.
        let e =
            normalize_usage(&json!({"prompt_tokens_details": {"audio_tokens": 7}})).unwrap_err();
        assert_eq!(
            (e.code, e.detail["key"].clone()),
            (
                Code::UsageKeyUnknown,
                json!("prompt_tokens_details.audio_tokens")
            )
        );
        assert_eq!(
            normalize_usage(&json!({"output_tokens_details": 3}))
                .unwrap_err()
                .code,
            Code::UsageInvalid
        );
        assert_eq!(
            normalize_usage(&json!({"output_tokens_details": {"reasoning_tokens": -1}}))
                .unwrap_err()
                .code,
            Code::UsageInvalid
        );
    }

    #[test]
    fn a_float_amount_is_its_shortest_decimal_text() {
        for (value, text) in [
            (0.1, "0.1"),
            (2.0, "2"),
            (0.000_001_5, "0.0000015"),
            (1e21, "1000000000000000000000"),
            (123.456_789_012_345_68, "123.45678901234568"),
            (-0.0, "-0"),
        ] {
            assert_eq!(float_text("amount", value).unwrap(), text);
        }
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                float_text("amount", bad).unwrap_err().code,
                Code::AmountInvalid
            );
        }
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
                check_non_negative("amount", Code::AmountInvalid, ok).is_ok(),
                "{ok}"
            );
        }
        for bad in ["-1", "-0.01", "NaN", "Infinity", "-Infinity"] {
            assert_eq!(
                check_non_negative("amount", Code::AmountInvalid, bad)
                    .unwrap_err()
                    .code,
                Code::AmountInvalid,
                "{bad}"
            );
        }
    }

    #[test]
    fn currencies_are_codes() {
        assert_eq!(currency("usd").unwrap(), "USD");
        assert_eq!(currency("CREDITS").unwrap(), "CREDITS");
        for bad in ["", "U", "1USD", "US D", "€", "A_VERY_LONG_CURRENCY_CODE"] {
            assert_eq!(
                currency(bad).unwrap_err().code,
                Code::CurrencyInvalid,
                "{bad}"
            );
        }
    }
}
