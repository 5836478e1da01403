//! The audit records the ledger writes itself (`ledger_model::events::AuditKind`).

use crate::db;
use crate::error::Result;
use crate::guc;
use crate::jsonb::Jsonb;
use crate::scope::Scope;
use ledger_model::events::AuditKind;
use ledger_model::ids;
use ledger_model::redaction;
use serde_json::Value;

/// Writes one of the ledger's own audit records (tool activity, budget changes), redacted like
/// every audit. One insert: claims, begins and completions are the write hot path.
pub fn write(
    scope: &Scope,
    run_id: Option<&str>,
    step_id: Option<&str>,
    kind: AuditKind,
    outcome: &str,
    actor: Option<&str>,
    payload: Value,
) -> Result<()> {
    let payload = redaction::redact(&guc::redaction_rules(), payload);
    db::execute(
        include_str!("../sql/queries/insert_audit.sql"),
        &scope.args([
            ids::new_id("aud").into(),
            run_id.into(),
            step_id.into(),
            kind.gateway_type().into(),
            outcome.into(),
            actor.into(),
            Jsonb::from(&payload).into(),
        ]),
    )
}
