//! Configuration parameters (GUCs) of the extension.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

pub static TENANT_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static WORKSPACE_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static REDACT_KEYS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static REDACT_VALUES: GucSetting<bool> = GucSetting::<bool>::new(true);
pub static NOTIFY: GucSetting<bool> = GucSetting::<bool>::new(true);

pub fn init() {
    GucRegistry::define_string_guc(
        c"ledger.tenant_id",
        c"Tenant of the current ledger scope.",
        c"Set with ledger.set_scope(tenant_id, workspace_id). Every ledger function and row-level security policy uses it.",
        &TENANT_ID,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"ledger.workspace_id",
        c"Workspace of the current ledger scope.",
        c"Set with ledger.set_scope(tenant_id, workspace_id). Every ledger function and row-level security policy uses it.",
        &WORKSPACE_ID,
        GucContext::Userset,
        GucFlags::default(),
    );
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
    GucRegistry::define_bool_guc(
        c"ledger.notify",
        c"Send the run feed's and the outbox's notifications (NOTIFY) at commit.",
        c"Off: writes send no NOTIFY and followers must poll events_since and claim_outbox_events. PostgreSQL serialises the commits of notifying transactions, so off raises write throughput under concurrency.",
        &NOTIFY,
        GucContext::Suset,
        GucFlags::default(),
    );
}

/// A string GUC's value; unset and empty are both `None`.
pub fn string(setting: &GucSetting<Option<CString>>) -> Option<String> {
    setting
        .get()
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.is_empty())
}

/// The redaction rules in force: the built-in names, `ledger.redact_keys` and `ledger.redact_values`.
pub fn redaction_rules() -> crate::model::redact::Rules {
    crate::model::redact::Rules::new(string(&REDACT_KEYS).as_deref(), REDACT_VALUES.get())
}
