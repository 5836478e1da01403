//! The part of the extension's error type (src/error.rs) that the included model code uses. The
//! real one also maps errors to SQLSTATEs through pgrx, which this crate does not link.

use serde_json::Value;

#[derive(Debug)]
#[allow(dead_code)] // read through Debug, when a panic reports it
pub struct LedgerError {
    pub code: &'static str,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, LedgerError>;

impl LedgerError {
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        LedgerError {
            code,
            message: message.into(),
        }
    }

    /// DETAIL members do not matter to the benchmark.
    pub fn with(self, _key: &str, _value: impl Into<Value>) -> Self {
        self
    }
}
