//! The one error type of the ledger, without Postgres: the extension raises it as an SQL error
//! (its `src/error.rs` holds the mapping to pgrx).
//!
//! Every failure a caller can see is a `LedgerError`: a stable machine-readable `Code` (whose
//! class fixes the SQLSTATE), a human message (prefixed `ledger: ` on the wire) and extra DETAIL
//! members. The DETAIL sent to the client is a JSON object that always carries
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

/// Declares `Code` from its codes grouped by class: each code's wire name and class are written
/// once, here.
macro_rules! codes {
    ($($class:ident { $($code:ident = $wire:literal,)+ })+) => {
        /// Every error code the ledger raises. Its class, and so its SQLSTATE, follows from it;
        /// docs/reference.md lists each under "Error codes" (`tests/reference.rs` compares them).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Code {
            $($($code,)+)+
        }

        impl Code {
            /// Every code, grouped by class.
            pub const ALL: &'static [Code] = &[$($(Code::$code,)+)+];

            /// The code as the DETAIL's `code` carries it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($(Code::$code => $wire,)+)+
                }
            }

            pub fn class(self) -> Class {
                match self {
                    $($(Code::$code => Class::$class,)+)+
                }
            }
        }
    };
}

codes! {
    Privilege {
        ArtifactScopeMismatch = "ARTIFACT_SCOPE_MISMATCH",
        OperatorRequired = "OPERATOR_REQUIRED",
        ScopeMissing = "SCOPE_MISSING",
        ScopeNotGranted = "SCOPE_NOT_GRANTED",
        ScopeSetDirectly = "SCOPE_SET_DIRECTLY",
        TenantNotGranted = "TENANT_NOT_GRANTED",
    }
    NotFound {
        ApprovalNotFound = "APPROVAL_NOT_FOUND",
        ArtifactNotFound = "ARTIFACT_NOT_FOUND",
        AuditNotFound = "AUDIT_NOT_FOUND",
        BlobNotFound = "BLOB_NOT_FOUND",
        CitationNotFound = "CITATION_NOT_FOUND",
        CostNotFound = "COST_NOT_FOUND",
        EventNotFound = "EVENT_NOT_FOUND",
        FeedbackNotFound = "FEEDBACK_NOT_FOUND",
        OutboxEventNotFound = "OUTBOX_EVENT_NOT_FOUND",
        ResponseEventNotFound = "RESPONSE_EVENT_NOT_FOUND",
        RoleNotFound = "ROLE_NOT_FOUND",
        RunNotFound = "RUN_NOT_FOUND",
        ScheduleNotFound = "SCHEDULE_NOT_FOUND",
        StepNotFound = "STEP_NOT_FOUND",
        TaskNotFound = "TASK_NOT_FOUND",
        ToolCallNotFound = "TOOL_CALL_NOT_FOUND",
    }
    InvalidParameter {
        AmountInvalid = "AMOUNT_INVALID",
        ApprovalInvalid = "APPROVAL_INVALID",
        ArgumentConflict = "ARGUMENT_CONFLICT",
        ArgumentNotObject = "ARGUMENT_NOT_OBJECT",
        ArgumentRequired = "ARGUMENT_REQUIRED",
        ArgumentsNotObject = "ARGUMENTS_NOT_OBJECT",
        ArtifactTypeUnknown = "ARTIFACT_TYPE_UNKNOWN",
        AttemptInvalid = "ATTEMPT_INVALID",
        CallInvalid = "CALL_INVALID",
        CallsDuplicate = "CALLS_DUPLICATE",
        CallsNotArray = "CALLS_NOT_ARRAY",
        CallsTooMany = "CALLS_TOO_MANY",
        CatchUpUnknown = "CATCH_UP_UNKNOWN",
        CronInvalid = "CRON_INVALID",
        CurrencyInvalid = "CURRENCY_INVALID",
        CurrencyRequired = "CURRENCY_REQUIRED",
        DecisionUnknown = "DECISION_UNKNOWN",
        EventTypeReserved = "EVENT_TYPE_RESERVED",
        GraphBlobsInvalid = "GRAPH_BLOBS_INVALID",
        IdInvalid = "ID_INVALID",
        InputKeyReserved = "INPUT_KEY_RESERVED",
        InputTooDeep = "INPUT_TOO_DEEP",
        InputTooLarge = "INPUT_TOO_LARGE",
        InputsNotObject = "INPUTS_NOT_OBJECT",
        IntervalInvalid = "INTERVAL_INVALID",
        JsonInvalid = "JSON_INVALID",
        LabelInvalid = "LABEL_INVALID",
        LevelUnknown = "LEVEL_UNKNOWN",
        LimitInvalid = "LIMIT_INVALID",
        MetricsNotObject = "METRICS_NOT_OBJECT",
        OutcomeUnknown = "OUTCOME_UNKNOWN",
        PeriodUnknown = "PERIOD_UNKNOWN",
        PriorityInvalid = "PRIORITY_INVALID",
        QuantityInvalid = "QUANTITY_INVALID",
        RatioInvalid = "RATIO_INVALID",
        Sha256Invalid = "SHA256_INVALID",
        SizeInvalid = "SIZE_INVALID",
        StatusUnknown = "STATUS_UNKNOWN",
        StepNotTool = "STEP_NOT_TOOL",
        StorageKeyReserved = "STORAGE_KEY_RESERVED",
        StrategyUnknown = "STRATEGY_UNKNOWN",
        TimeZoneUnknown = "TIME_ZONE_UNKNOWN",
        TimeoutInvalid = "TIMEOUT_INVALID",
        UnitInvalid = "UNIT_INVALID",
        UsageInvalid = "USAGE_INVALID",
        UsageKeyUnknown = "USAGE_KEY_UNKNOWN",
    }
    WrongState {
        ApprovalExpired = "APPROVAL_EXPIRED",
        ApprovalResolved = "APPROVAL_RESOLVED",
        ArtifactExternal = "ARTIFACT_EXTERNAL",
        OutboxNotFailed = "OUTBOX_NOT_FAILED",
        OutboxNotLeased = "OUTBOX_NOT_LEASED",
        RunNotRerunnable = "RUN_NOT_RERUNNABLE",
        RunTerminal = "RUN_TERMINAL",
        TaskReplayed = "TASK_REPLAYED",
        TaskRetrySnapshotMissing = "TASK_RETRY_SNAPSHOT_MISSING",
        TaskTerminal = "TASK_TERMINAL",
        ToolCallNotInDoubt = "TOOL_CALL_NOT_IN_DOUBT",
        ToolCallPurged = "TOOL_CALL_PURGED",
        ToolCallState = "TOOL_CALL_STATE",
        TransitionInvalid = "TRANSITION_INVALID",
    }
    Conflict {
        LeaseStale = "LEASE_STALE",
        TransitionConflict = "TRANSITION_CONFLICT",
    }
    Duplicate {
        IdempotencyMismatch = "IDEMPOTENCY_MISMATCH",
        StepHasToolCall = "STEP_HAS_TOOL_CALL",
    }
    Corrupted {
        ArtifactHashMismatch = "ARTIFACT_HASH_MISMATCH",
        BlobHashMismatch = "BLOB_HASH_MISMATCH",
        BlobNotUtf8 = "BLOB_NOT_UTF8",
    }
    ReadOnly {
        ReadOnly = "READ_ONLY",
    }
    Internal {
        Internal = "INTERNAL",
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LedgerError {
    pub code: Code,
    pub message: String,
    pub detail: Map<String, Value>,
}

pub type Result<T> = std::result::Result<T, LedgerError>;

impl LedgerError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        let mut detail = Map::new();
        detail.insert("code".into(), Value::from(code.as_str()));
        LedgerError {
            code,
            message: message.into(),
            detail,
        }
    }

    /// The class of its code, which fixes the SQLSTATE.
    pub fn class(&self) -> Class {
        self.code.class()
    }

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
            Code::ScopeMissing,
            "no scope set: call ledger.set_scope(tenant_id, workspace_id) first",
        )
    }

    /// `code` is the not-found code of the kind of object `what` (`run`, `step`, `event`).
    pub fn not_found(code: Code, what: &str, id: &str) -> Self {
        LedgerError::new(code, format!("{what} {id} not found")).with("id", id)
    }

    pub fn required(argument: &str) -> Self {
        LedgerError::new(
            Code::ArgumentRequired,
            format!("{argument} must not be NULL"),
        )
        .with("argument", argument)
    }

    pub fn read_only() -> Self {
        LedgerError::new(
            Code::ReadOnly,
            "this transaction is read-only (a hot standby, or BEGIN READ ONLY): write on the primary in a read-write transaction",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        LedgerError::new(Code::Internal, message)
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
        let e = LedgerError::new(Code::JsonInvalid, "x")
            .with("value", "é".repeat(DETAIL_CHARS))
            .with("long", "v".repeat(50_000_000))
            .with("n", 7);
        assert_eq!(e.detail["value"], "é".repeat(DETAIL_CHARS));
        assert_eq!(e.detail["long"], format!("{}…", "v".repeat(DETAIL_CHARS)));
        assert_eq!(e.detail["n"], 7);
    }

    #[test]
    fn detail_is_json_with_code() {
        let e = LedgerError::new(Code::TransitionInvalid, "no")
            .with("from", "succeeded")
            .with("to", "failed");
        assert_eq!(
            e.wire_detail(),
            r#"{"code":"TRANSITION_INVALID","from":"succeeded","to":"failed"}"#
        );
        assert_eq!(e.wire_message(), "ledger: no");
        assert_eq!(e.class(), Class::WrongState);
    }

    #[test]
    fn every_code_has_one_wire_name() {
        let mut names: Vec<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
        assert!(names.iter().all(|n| n
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')));
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
    }

    /// Every declared code is raised by the non-test code of the core or the extension, so the
    /// declaration (and the reference's table) lists no code the ledger cannot raise.
    #[test]
    fn every_code_is_raised_somewhere() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut sources = String::new();
        for dir in [root.join("src"), root.join("../../src")] {
            read_sources(&dir, &mut sources);
        }
        let unused: Vec<&Code> = Code::ALL
            .iter()
            .filter(|c| !sources.contains(&format!("Code::{c:?}")))
            .collect();
        assert!(unused.is_empty(), "declared but never raised: {unused:?}");
    }

    /// Appends the non-test part of every `.rs` file under `dir` (the text before its `mod
    /// tests`), skipping test-only files (`testing/`, `tests.rs`).
    fn read_sources(dir: &std::path::Path, out: &mut String) {
        for entry in std::fs::read_dir(dir).expect("a source directory") {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if name != "testing" && name != "tests" {
                    read_sources(&path, out);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" {
                let text = std::fs::read_to_string(&path).expect("a readable source file");
                out.push_str(text.split("mod tests {").next().unwrap_or(""));
            }
        }
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
