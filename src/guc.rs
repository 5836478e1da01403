//! Configuration parameters (GUCs) of the extension.

use crate::error::{report_check_failure, Code, LedgerError};
use ledger_model::ids;
use pgrx::{pg_guard, pg_sys, GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr, CString};

thread_local! {
    /// Set while `ledger.set_scope` (or a function switching to a row's scope) sets the scope
    /// GUCs: the only time the check hooks accept a scope.
    static STATING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (which sets the scope GUCs) with the check hooks accepting a scope. The flag is
/// cleared on the way out, also when `f` fails.
pub fn stating<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            STATING.with(|s| s.set(false));
        }
    }
    STATING.with(|s| s.set(true));
    let _reset = Reset;
    f()
}

pub static TENANT_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static WORKSPACE_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static REDACT_KEYS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static REDACT_VALUES: GucSetting<bool> = GucSetting::<bool>::new(true);
pub static NOTIFY: GucSetting<NotifyMode> = GucSetting::<NotifyMode>::new(NotifyMode::Worker);
pub static NOTIFIER_CAPACITY: GucSetting<i32> =
    GucSetting::<i32>::new(ledger_model::notifier::CAPACITY as i32);

/// `ledger.notify`: who sends the feed's and the outbox's notifications.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum NotifyMode {
    /// The notifier worker of the database, when the library is preloaded; else as `inline`.
    #[name = c"worker"]
    Worker,
    /// Every writing transaction, at its commit.
    #[name = c"inline"]
    Inline,
    #[name = c"off"]
    Off,
    /// 0.4's boolean `on`, kept so that old settings load: the default.
    #[name = c"on"]
    #[hidden = true]
    On,
}

pub fn init() {
    // SAFETY: the check hooks keep PostgreSQL's contract: they only read the proposed value,
    // never raise an ERROR, and report a refusal through GUC_check_* with palloc'd strings.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"ledger.tenant_id",
            c"Tenant of the current ledger scope.",
            c"Set with ledger.set_scope(tenant_id, workspace_id). Every ledger function and row-level security policy uses it.",
            &TENANT_ID,
            GucContext::Userset,
            GucFlags::default(),
            Some(check_tenant_id),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"ledger.workspace_id",
            c"Workspace of the current ledger scope.",
            c"Set with ledger.set_scope(tenant_id, workspace_id). Every ledger function and row-level security policy uses it.",
            &WORKSPACE_ID,
            GucContext::Userset,
            GucFlags::default(),
            Some(check_workspace_id),
            None,
            None,
        );
    }
    GucRegistry::define_string_guc(
        c"ledger.redact_keys",
        c"Extra argument names whose values are redacted before they are stored.",
        c"A comma list, normalised like every key (camelCase, kebab-case and SCREAMING_CASE all match), added to the built-in sensitive names.",
        &REDACT_KEYS,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"ledger.redact_values",
        c"Redact string values that carry a well-known credential, whatever their key (superuser only).",
        c"Bearer and Basic credentials, URLs with a password, JWTs, sk-... and Stripe keys, AWS key ids, GitHub, GitLab and Slack tokens, PEM and PGP private keys; in free text, each one found is replaced in place.",
        &REDACT_VALUES,
        // Superuser-only (or GRANT SET ON PARAMETER), like ledger.notify: the application whose
        // values are redacted must not be able to switch the redaction off.
        GucContext::Suset,
        GucFlags::default(),
    );
    // Superuser-only (or GRANT SET ON PARAMETER): switching it off silences other sessions'
    // followers, an operator's decision, never a writer's.
    GucRegistry::define_enum_guc(
        c"ledger.notify",
        c"Who sends the run feed's and the outbox's notifications: worker, inline or off.",
        c"worker (default): the database's notifier worker, when the library is in shared_preload_libraries (else as inline). inline: every writing transaction at its commit, which PostgreSQL serialises. off: none; followers poll events_since and claim_outbox_events.",
        &NOTIFY,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"ledger.notifier_capacity",
        c"Most channels waiting in the notifier's shared table; beyond it, writers notify by themselves.",
        c"At most 1024, the table's size in shared memory. Read at each commit.",
        &NOTIFIER_CAPACITY,
        1,
        ledger_model::notifier::CAPACITY as i32,
        GucContext::Sighup,
        GucFlags::default(),
    );
}

/// The scope names are checked wherever they come from (`SET`, `set_config`, `ALTER ROLE ... SET`,
/// `PGOPTIONS`, postgresql.conf), not only in `set_scope`: a name with an invisible character or
/// a trailing space would be a tenant that looks like another one.
#[pg_guard]
unsafe extern "C-unwind" fn check_tenant_id(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes a valid pointer to the proposed value (NULL: unset).
    unsafe { check_scope_name("tenant_id", newval) }
}

#[pg_guard]
unsafe extern "C-unwind" fn check_workspace_id(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: as above.
    unsafe { check_scope_name("workspace_id", newval) }
}

/// Unset (NULL) and empty pass; anything else must be a valid id (22023 `ID_INVALID`, reported
/// by PostgreSQL with the ledger's message and DETAIL), stated by `ledger.set_scope` (42501
/// `SCOPE_SET_DIRECTLY` otherwise: `SET`, `set_config`, `ALTER ROLE ... SET` and `PGOPTIONS`
/// would bypass its scope grants) or restored in a parallel worker from its leader. Placeholder
/// values set before the library was loaded are checked when it loads, and a refused one is
/// dropped with a WARNING.
///
/// # Safety
/// `newval` points to a NULL or NUL-terminated string pointer.
unsafe fn check_scope_name(argument: &str, newval: *mut *mut c_char) -> bool {
    // SAFETY: the caller's contract.
    let value = match unsafe { newval.as_ref() } {
        Some(p) if !p.is_null() => unsafe { CStr::from_ptr(*p) },
        _ => return true,
    };
    let checked = match value.to_str() {
        Ok("") => return true,
        Ok(name) => ids::validate(argument, name).and_then(|()| stated_by_set_scope(argument)),
        // Possible only in a SQL_ASCII database.
        Err(_) => Err(
            LedgerError::new(Code::IdInvalid, format!("{argument} is not valid UTF-8"))
                .with("argument", argument),
        ),
    };
    match checked {
        Ok(()) => true,
        Err(e) => {
            report_check_failure(&e);
            false
        }
    }
}

/// Refuses a scope set by any other means than `ledger.set_scope`.
fn stated_by_set_scope(argument: &str) -> Result<(), LedgerError> {
    // SAFETY: a backend-global flag PostgreSQL sets while a parallel worker restores its
    // leader's settings (which set_scope made).
    if STATING.with(Cell::get) || unsafe { pg_sys::InitializingParallelWorker } {
        return Ok(());
    }
    Err(LedgerError::new(
        Code::ScopeSetDirectly,
        format!("ledger.{argument} is set only by ledger.set_scope(tenant_id, workspace_id)"),
    )
    .with("argument", argument))
}

/// A string GUC's value; unset and empty are both `None`.
pub fn string(setting: &GucSetting<Option<CString>>) -> Option<String> {
    setting
        .get()
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.is_empty())
}

/// The redaction rules in force: the built-in names, `ledger.redact_keys` and `ledger.redact_values`.
pub fn redaction_rules() -> ledger_model::redaction::Rules {
    ledger_model::redaction::Rules::new(string(&REDACT_KEYS).as_deref(), REDACT_VALUES.get())
}
