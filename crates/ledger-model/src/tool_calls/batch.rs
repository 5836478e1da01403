//! A batch of tool calls (`claim_tool_calls`): the JSON array of a model turn's calls read into
//! one `CallSpec` per element, each holding `claim_tool_call`'s per-call arguments, so that every
//! call then goes through the single-call checks and rules. No Postgres here.

use serde_json::{Map, Value};

use crate::error::{Code, LedgerError, Result};

/// The most calls one batch takes. A model turn asks for a handful; the bound keeps one
/// statement (which holds the run's lock throughout) short.
pub const MAX_CALLS: usize = 100;

/// How deep a call's arguments sit in the batch (the array, then the call's object): the batch
/// is parsed with that much more depth, so arguments nest exactly as deep as on their own.
pub const NESTING: usize = 2;

/// The keys a call may have: `claim_tool_call`'s per-call arguments.
pub const KEYS: [&str; 8] = [
    "tool_ref",
    "arguments",
    "tool_call_id",
    "idempotency_key",
    "step_id",
    "timeout_seconds",
    "retry_failed",
    "approval",
];

/// One call of the batch as `claim_tool_call`'s arguments: an absent key takes that function's
/// default, a JSON null is its SQL NULL (so `"arguments": null` is refused as there).
#[derive(Debug, PartialEq)]
pub struct CallSpec {
    pub tool_ref: Option<String>,
    pub arguments: Option<Value>,
    pub tool_call_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub step_id: Option<String>,
    pub timeout_seconds: Option<i32>,
    pub retry_failed: Option<bool>,
    pub approval: Option<Value>,
}

/// The default of `claim_tool_call`'s `timeout_seconds`.
pub const DEFAULT_TIMEOUT_SECONDS: i32 = 30;

/// Reads the batch: a JSON array (22023 `CALLS_NOT_ARRAY`) of at most `MAX_CALLS` (22023
/// `CALLS_TOO_MANY`) objects with only `KEYS`, each of its type (22023 `CALL_INVALID`, naming the
/// `key`). A refusal about an element names its `index` (from 0, as `calls->index`).
pub fn calls(value: Value) -> Result<Vec<CallSpec>> {
    let Value::Array(items) = value else {
        return Err(LedgerError::new(
            Code::CallsNotArray,
            "calls must be a JSON array of tool calls",
        ));
    };
    if items.len() > MAX_CALLS {
        return Err(LedgerError::new(
            Code::CallsTooMany,
            format!("a batch takes at most {MAX_CALLS} tool calls"),
        )
        .with("max_calls", MAX_CALLS)
        .with("calls", items.len()));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| call(item).map_err(|e| e.with("index", i)))
        .collect()
}

fn invalid(message: String, key: &str) -> LedgerError {
    LedgerError::new(Code::CallInvalid, message).with("key", key)
}

fn call(item: Value) -> Result<CallSpec> {
    let Value::Object(mut map) = item else {
        return Err(invalid("each call must be a JSON object".into(), ""));
    };
    if let Some(key) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(invalid(
            format!("a call takes only the keys {}", KEYS.join(", ")),
            key,
        ));
    }
    let mut text = |key: &str| match map.remove(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("{key} must be text"), key)),
    };
    let tool_ref = text("tool_ref")?;
    let tool_call_id = text("tool_call_id")?;
    let idempotency_key = text("idempotency_key")?;
    let step_id = text("step_id")?;
    Ok(CallSpec {
        tool_ref,
        tool_call_id,
        idempotency_key,
        step_id,
        arguments: match map.remove("arguments") {
            None => Some(Value::Object(Map::new())),
            Some(Value::Null) => None,
            Some(v) => Some(v),
        },
        timeout_seconds: match map.remove("timeout_seconds") {
            None => Some(DEFAULT_TIMEOUT_SECONDS),
            Some(Value::Null) => None,
            Some(v) => Some(
                v.as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .ok_or_else(|| {
                        invalid(
                            "timeout_seconds must be an integer".into(),
                            "timeout_seconds",
                        )
                    })?,
            ),
        },
        retry_failed: match map.remove("retry_failed") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(b),
            Some(_) => {
                return Err(invalid(
                    "retry_failed must be true or false".into(),
                    "retry_failed",
                ))
            }
        },
        approval: map.remove("approval").filter(|v| !v.is_null()),
    })
}

/// Refuses a batch that names one call twice (22023 `CALLS_DUPLICATE`): by idempotency key, or
/// by tool_call_id (the identities, defaults filled in, in batch order). A second claim of a call
/// in the same statement could only answer `busy` against the first, which is never what the
/// caller meant; the DETAIL names both elements (`index`, `same_as`) and the `field`.
pub fn distinct<'a>(identities: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<()> {
    let seen: Vec<(&str, &str)> = identities.into_iter().collect();
    for (i, (key, call)) in seen.iter().enumerate() {
        for (j, (other_key, other_call)) in seen[..i].iter().enumerate() {
            let field = if key == other_key {
                "idempotency_key"
            } else if call == other_call {
                "tool_call_id"
            } else {
                continue;
            };
            return Err(LedgerError::new(
                Code::CallsDuplicate,
                format!("the batch names one tool call twice (the same {field})"),
            )
            .with("index", i)
            .with("same_as", j)
            .with("field", field));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(value: Value) -> LedgerError {
        calls(value).unwrap_err()
    }

    #[test]
    fn absent_keys_take_the_single_call_defaults_and_null_is_sql_null() {
        let specs = calls(json!([
            {"tool_ref": "search"},
            {"tool_ref": "fetch", "arguments": {"q": 1}, "tool_call_id": "c2",
             "idempotency_key": "k2", "step_id": "s2", "timeout_seconds": 5,
             "retry_failed": true, "approval": {"title": "ok?"}},
            {"tool_ref": null, "arguments": null, "timeout_seconds": null, "approval": null,
             "retry_failed": null, "tool_call_id": null}
        ]))
        .unwrap();
        assert_eq!(
            specs[0],
            CallSpec {
                tool_ref: Some("search".into()),
                arguments: Some(json!({})),
                tool_call_id: None,
                idempotency_key: None,
                step_id: None,
                timeout_seconds: Some(30),
                retry_failed: None,
                approval: None,
            }
        );
        assert_eq!(specs[1].arguments, Some(json!({"q": 1})));
        assert_eq!(specs[1].timeout_seconds, Some(5));
        assert_eq!(specs[1].retry_failed, Some(true));
        assert_eq!(specs[1].approval, Some(json!({"title": "ok?"})));
        assert_eq!(specs[1].step_id.as_deref(), Some("s2"));
        assert_eq!(specs[2].tool_ref, None);
        assert_eq!(specs[2].arguments, None);
        assert_eq!(specs[2].timeout_seconds, None);
        assert_eq!(specs[2].approval, None);
        assert!(calls(json!([])).unwrap().is_empty());
    }

    #[test]
    fn a_bad_batch_or_element_is_refused_naming_the_element_and_key() {
        for v in [json!({}), json!("[]"), json!(null), json!(1)] {
            assert_eq!(refused(v).code, Code::CallsNotArray);
        }
        let e = refused(Value::Array(vec![json!({"tool_ref": "t"}); MAX_CALLS + 1]));
        assert_eq!(e.code, Code::CallsTooMany);
        assert_eq!(e.detail["max_calls"], MAX_CALLS);
        assert_eq!(e.detail["calls"], MAX_CALLS + 1);
        assert_eq!(
            calls(Value::Array(vec![json!({"tool_ref": "t"}); MAX_CALLS]))
                .unwrap()
                .len(),
            MAX_CALLS
        );
        for (bad, key) in [
            (json!([1]), ""),
            (json!(["search"]), ""),
            (json!([[]]), ""),
            (json!({"tool": "x"}), "tool"),
            (json!({"lease_owner": "w"}), "lease_owner"),
            (json!({"tool_ref": 7}), "tool_ref"),
            (json!({"tool_call_id": ["c"]}), "tool_call_id"),
            (json!({"idempotency_key": {}}), "idempotency_key"),
            (json!({"step_id": 1}), "step_id"),
            (json!({"timeout_seconds": "30"}), "timeout_seconds"),
            (json!({"timeout_seconds": 1.5}), "timeout_seconds"),
            (
                json!({"timeout_seconds": 4_294_967_296_i64}),
                "timeout_seconds",
            ),
            (json!({"retry_failed": "yes"}), "retry_failed"),
        ] {
            let batch = match bad {
                Value::Array(_) => json!([{"tool_ref": "ok"}, bad[0]]),
                _ => json!([{"tool_ref": "ok"}, bad]),
            };
            let e = refused(batch);
            assert_eq!(e.code, Code::CallInvalid, "{e}");
            assert_eq!(e.detail["index"], 1, "{e}");
            assert_eq!(e.detail["key"], key, "{e}");
        }
    }

    #[test]
    fn one_call_named_twice_is_refused_naming_both() {
        assert!(distinct([("k1", "c1"), ("k2", "c2"), ("k3", "c3")]).is_ok());
        let e = distinct([("k1", "c1"), ("k2", "c2"), ("k1", "c3")]).unwrap_err();
        assert_eq!(e.code, Code::CallsDuplicate);
        assert_eq!(
            (&e.detail["index"], &e.detail["same_as"], &e.detail["field"]),
            (&json!(2), &json!(0), &json!("idempotency_key"))
        );
        let e = distinct([("k1", "c1"), ("k2", "c2"), ("k3", "c2")]).unwrap_err();
        assert_eq!(
            (&e.detail["index"], &e.detail["same_as"], &e.detail["field"]),
            (&json!(2), &json!(1), &json!("tool_call_id"))
        );
    }
}
