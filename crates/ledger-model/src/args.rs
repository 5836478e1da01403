//! Checks of function arguments shared by every entry point.

use crate::error::{LedgerError, Result};
use crate::ids;

/// A NOT NULL, non-empty text argument.
pub fn required<'a>(argument: &str, value: Option<&'a str>) -> Result<&'a str> {
    value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| LedgerError::required(argument))
}

/// A NOT NULL id argument (22023 `ARGUMENT_REQUIRED` when NULL). Empty or malformed, it is
/// 22023 `ID_INVALID`, the same in every function.
pub fn required_id<'a>(argument: &str, value: Option<&'a str>) -> Result<&'a str> {
    let value = value.ok_or_else(|| LedgerError::required(argument))?;
    ids::validate(argument, value)?;
    Ok(value)
}

/// A NOT NULL, non-empty label (a mode, a tool reference, an event type): at most 256 bytes, no
/// control or bidi control characters (22023 `LABEL_INVALID`).
pub fn required_label<'a>(argument: &str, value: Option<&'a str>) -> Result<&'a str> {
    let value = required(argument, value)?;
    ids::validate_label(argument, value)?;
    Ok(value)
}

/// A label, validated when present.
pub fn optional_label<'a>(argument: &str, value: Option<&'a str>) -> Result<Option<&'a str>> {
    if let Some(v) = value {
        ids::validate_label(argument, v)?;
    }
    Ok(value)
}

/// A caller-supplied id, validated when present.
pub fn optional_id<'a>(argument: &str, value: Option<&'a str>) -> Result<Option<&'a str>> {
    if let Some(v) = value {
        ids::validate(argument, v)?;
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn null_and_empty_are_refused() {
        assert_eq!(required("mode", Some("chat")).unwrap(), "chat");
        for v in [None, Some("")] {
            let e = required("mode", v).unwrap_err();
            assert_eq!(e.code, Code::ArgumentRequired);
            assert_eq!(e.detail["argument"], "mode");
        }
        assert_eq!(
            required_id("run_id", None).unwrap_err().code,
            Code::ArgumentRequired
        );
        for bad in ["", "a b", "a\u{200B}"] {
            assert_eq!(
                required_id("run_id", Some(bad)).unwrap_err().code,
                Code::IdInvalid
            );
        }
        assert_eq!(required_id("run_id", Some("r-1")).unwrap(), "r-1");
        assert_eq!(optional_id("run_id", None).unwrap(), None);
        assert!(optional_id("run_id", Some("a b")).is_err());
    }

    #[test]
    fn labels_are_bounded_and_printable() {
        assert_eq!(
            required_label("tool_ref", Some("crm.lookup order")).unwrap(),
            "crm.lookup order"
        );
        assert_eq!(
            required_label("tool_ref", None).unwrap_err().code,
            Code::ArgumentRequired
        );
        assert_eq!(
            required_label("tool_ref", Some("")).unwrap_err().code,
            Code::ArgumentRequired
        );
        for bad in ["a\nb".to_owned(), "a\u{202E}b".to_owned(), "t".repeat(257)] {
            let e = required_label("tool_ref", Some(&bad)).unwrap_err();
            assert_eq!(e.code, Code::LabelInvalid);
            assert_eq!(e.detail["argument"], "tool_ref");
            assert!(optional_label("tool_ref", Some(&bad)).is_err());
        }
        assert_eq!(optional_label("actor", None).unwrap(), None);
        assert!(required_label("tool_ref", Some(&"t".repeat(256))).is_ok());
    }
}
