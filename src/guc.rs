//! Configuration parameters (GUCs) of the extension.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

pub static TENANT_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static WORKSPACE_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

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
}

/// A string GUC's value; unset and empty are both `None`.
pub fn string(setting: &GucSetting<Option<CString>>) -> Option<String> {
    setting
        .get()
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.is_empty())
}
