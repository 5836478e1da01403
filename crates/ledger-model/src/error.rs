//! The one error type of the ledger, without Postgres: the extension raises it as an SQL error
//! (its `src/error.rs` holds the mapping to pgrx).
//!
//! Every failure a caller can see is a `LedgerError`: a class (which fixes the SQLSTATE), a
//! stable machine-readable `code`, a human message (prefixed `ledger: ` on the wire) and
//! extra DETAIL members. The DETAIL sent to the client is a JSON object that always carries
//! `code`.

use serde_json::{Map, Value};

/// The kinds of failure a caller must tell apart; each maps to exactly one SQLSTATE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// 42501: no scope, or a row of another scope on a path that must not hide it.
    Privilege,
    /// P0002: an id unknown in this scope.
    NotFound,
    /// 22023: a bad argument.
    InvalidParameter,
    /// 55000: not allowed in the current state.
    WrongState,
    /// 40001: a concurrent writer got there first; the caller may retry.
    Conflict,
    /// 23505: an idempotency key reused with different input.
    Duplicate,
    /// XX001: stored bytes do not match their recorded hash.
    Corrupted,
    /// 25006: a write in a read-only transaction (a hot standby, or `BEGIN READ ONLY`).
    ReadOnly,
    /// XX000: a defect in the ledger itself.
    Internal,
}

impl Class {
    pub fn sqlstate(self) -> &'static str {
        match self {
            Class::Privilege => "42501",
            Class::NotFound => "P0002",
            Class::InvalidParameter => "22023",
            Class::WrongState => "55000",
            Class::Conflict => "40001",
            Class::Duplicate => "23505",
            Class::Corrupted => "XX001",
            Class::ReadOnly => "25006",
            Class::Internal => "XX000",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LedgerError {
    pub class: Class,
    pub code: &'static str,
    pub message: String,
    pub detail: Map<String, Value>,
}

pub type Result<T> = std::result::Result<T, LedgerError>;

impl LedgerError {
    pub fn new(class: Class, code: &'static str, message: impl Into<String>) -> Self {
        let mut detail = Map::new();
        detail.insert("code".into(), Value::from(code));
        LedgerError {
            class,
            code,
            message: message.into(),
            detail,
        }
    }

    /// Adds a DETAIL member.
    /// Adds a DETAIL field. A string longer than `DETAIL_CHARS` (a refused value echoed back) is
    /// cut and marked with `…`, so an error never carries a huge argument around.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        let value = match value.into() {
            Value::String(s) if s.chars().nth(DETAIL_CHARS).is_some() => Value::String(format!(
                "{}…",
                crate::text::truncate_chars(&s, DETAIL_CHARS)
            )),
            v => v,
        };
        self.detail.insert(key.into(), value);
        self
    }

    pub fn scope_missing() -> Self {
        LedgerError::new(
            Class::Privilege,
            "SCOPE_MISSING",
            "no scope set: call ledger.set_scope(tenant_id, workspace_id) first",
        )
    }

    /// `what` is the kind of object (`run`, `step`, `event`); the code is derived from it.
    pub fn not_found(code: &'static str, what: &str, id: &str) -> Self {
        LedgerError::new(Class::NotFound, code, format!("{what} {id} not found")).with("id", id)
    }

    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        LedgerError::new(Class::InvalidParameter, code, message)
    }

    pub fn required(argument: &str) -> Self {
        LedgerError::invalid("ARGUMENT_REQUIRED", format!("{argument} must not be NULL"))
            .with("argument", argument)
    }

    pub fn read_only() -> Self {
        LedgerError::new(
            Class::ReadOnly,
            "READ_ONLY",
            "this transaction is read-only (a hot standby, or BEGIN READ ONLY): write on the primary in a read-write transaction",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        LedgerError::new(Class::Internal, "INTERNAL", message)
    }

    /// The text sent as the primary message.
    pub fn wire_message(&self) -> String {
        format!("ledger: {}", self.message)
    }

    /// The text sent as DETAIL: a JSON object that carries `code`.
    pub fn wire_detail(&self) -> String {
        Value::Object(self.detail.clone()).to_string()
    }
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.wire_message(), self.wire_detail())
    }
}

/// The longest string a DETAIL field echoes, in characters.
pub const DETAIL_CHARS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_detail_strings_are_cut() {
        let e = LedgerError::invalid("X", "x")
            .with("value", "é".repeat(DETAIL_CHARS))
            .with("long", "v".repeat(50_000_000))
            .with("n", 7);
        assert_eq!(e.detail["value"], "é".repeat(DETAIL_CHARS));
        assert_eq!(e.detail["long"], format!("{}…", "v".repeat(DETAIL_CHARS)));
        assert_eq!(e.detail["n"], 7);
    }

    #[test]
    fn detail_is_json_with_code() {
        let e = LedgerError::new(Class::WrongState, "TRANSITION_INVALID", "no")
            .with("from", "succeeded")
            .with("to", "failed");
        assert_eq!(
            e.wire_detail(),
            r#"{"code":"TRANSITION_INVALID","from":"succeeded","to":"failed"}"#
        );
        assert_eq!(e.wire_message(), "ledger: no");
    }

    #[test]
    fn every_class_has_its_sqlstate() {
        let all = [
            (Class::Privilege, "42501"),
            (Class::NotFound, "P0002"),
            (Class::InvalidParameter, "22023"),
            (Class::WrongState, "55000"),
            (Class::Conflict, "40001"),
            (Class::Duplicate, "23505"),
            (Class::Corrupted, "XX001"),
            (Class::ReadOnly, "25006"),
            (Class::Internal, "XX000"),
        ];
        for (class, state) in all {
            assert_eq!(class.sqlstate(), state);
        }
    }
}
