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

    #[test]
    fn null_and_empty_are_refused() {
        assert_eq!(required("mode", Some("chat")).unwrap(), "chat");
        for v in [None, Some("")] {
            let e = required("mode", v).unwrap_err();
            assert_eq!(e.code, "ARGUMENT_REQUIRED");
            assert_eq!(e.detail["argument"], "mode");
        }
        assert_eq!(
            required_id("run_id", None).unwrap_err().code,
            "ARGUMENT_REQUIRED"
        );
        for bad in ["", "a b", "a\u{200B}"] {
            assert_eq!(
                required_id("run_id", Some(bad)).unwrap_err().code,
                "ID_INVALID"
            );
        }
        assert_eq!(required_id("run_id", Some("r-1")).unwrap(), "r-1");
        assert_eq!(optional_id("run_id", None).unwrap(), None);
        assert!(optional_id("run_id", Some("a b")).is_err());
    }
}
