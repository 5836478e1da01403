//! Evidence records written against a run: audits (among them a person's replay of an outbox
//! event), response events, citations and feedback. Every payload is redacted before it is stored.

use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::guc;
use crate::jsonb::Jsonb;
use crate::outbox;
use crate::redaction::{free_text, redacted_object};
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required_id, required_label};
use ledger_model::events::{AuditKind, Event, Recorded};
use ledger_model::ids;
use ledger_model::redaction::redact;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use serde_json::{json, Value};

/// The kinds of record.
#[derive(Clone, Copy)]
enum Kind {
    Audit,
    ResponseEvent,
    Citation,
    Feedback,
}

impl Kind {
    /// Its table, the prefix of its ids, and what a missing row of it is called (P0002 code,
    /// noun).
    fn names(self) -> (&'static str, &'static str, Code, &'static str) {
        match self {
            Kind::Audit => ("audit_events", "aud", Code::AuditNotFound, "audit event"),
            Kind::ResponseEvent => (
                "response_events",
                "rev",
                Code::ResponseEventNotFound,
                "response event",
            ),
            Kind::Citation => ("citations", "cit", Code::CitationNotFound, "citation"),
            Kind::Feedback => ("run_feedback", "fbk", Code::FeedbackNotFound, "feedback"),
        }
    }

    /// Its event in the run's feed.
    fn event(self, recorded: Recorded) -> Event {
        match self {
            Kind::Audit => Event::AuditRecorded(recorded),
            Kind::ResponseEvent => Event::ResponseEventRecorded(recorded),
            Kind::Citation => Event::CitationRecorded(recorded),
            Kind::Feedback => Event::FeedbackRecorded(recorded),
        }
    }
}

/// Inserts one record (`values` of `columns`, after tenant, workspace, id and run_id) and returns
/// its row. For a run, it locks the run (checking the step, if any, is one of its own) and
/// announces the record in the run's feed; only an audit may have no run (an outbox event's).
fn record<T: FromDatum + IntoDatum>(
    scope: &Scope,
    kind: Kind,
    run_id: Option<&str>,
    step_id: Option<&str>,
    columns: &[&str],
    values: Vec<DatumWithOid>,
) -> Result<T> {
    let run = run_id
        .map(|run_id| rows::lock_owner(scope, run_id, step_id))
        .transpose()?;
    let (table, prefix, code, what) = kind.names();
    let id = ids::new_id(prefix);
    let placeholders: Vec<String> = (5..5 + columns.len()).map(|i| format!("${i}")).collect();
    let query = format!(
        "INSERT INTO ledger.{table} (tenant_id, workspace_id, id, run_id, {}) \
         VALUES ($1, $2, $3, $4, {})",
        columns.join(", "),
        placeholders.join(", ")
    );
    let mut args: Vec<DatumWithOid> = scope.args([id.as_str().into(), run_id.into()]);
    args.extend(values);
    db::execute(&query, &args)?;
    if let Some(run) = &run {
        let recorded = kind.event(Recorded { id: &id, table });
        feed::append(scope, run.held(), step_id, &recorded)?;
    }
    rows::scoped_row(scope, &format!("ledger.{table}"), &id, code, what)
}

type AuditRow = pgrx::composite_type!('static, "ledger.audit_events");

/// Writes an audit record whose arguments are checked and whose payload is redacted: for a run
/// (see `record`), or with `run_id` None for the scope alone.
pub(crate) fn audit(
    scope: &Scope,
    run_id: Option<&str>,
    step_id: Option<&str>,
    gateway_type: &str,
    outcome: &str,
    actor: Option<&str>,
    payload: &Value,
) -> Result<AuditRow> {
    record(
        scope,
        Kind::Audit,
        run_id,
        step_id,
        &["step_id", "gateway_type", "outcome", "actor", "payload"],
        vec![
            step_id.into(),
            gateway_type.into(),
            outcome.into(),
            actor.into(),
            Jsonb::from(payload).into(),
        ],
    )
}

/// `replay_outbox_event` done by a person, who is named: the outbox's replay and, in the same
/// transaction, its audit record (`outbox.replay`, outcome `replayed`) for the event's run, or
/// for the scope alone when the event has none. (Here, not in the outbox module, which the
/// evidence writers call: the outbox does not depend on them.)
#[pg_extern(name = "replay_outbox_event", volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_outbox_event_by(
    event_id: Option<&str>,
    actor: Option<&str>,
    note: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.outbox_event"), SqlError> {
    let scope = scope::current()?;
    let id = outbox::event_id_arg(event_id)?;
    let actor = free_text(Some(required_label("actor", actor)?));
    let note = free_text(note);
    let run_id = outbox::run_of(&scope, &id)?;
    if let Some(run_id) = &run_id {
        rows::lock_run(&scope, "run_id", run_id)?;
    }
    let replayed = outbox::replay(&scope, &id)?;
    let payload = json!({
        "outbox_event_id": id,
        "event_type": replayed.event_type,
        "replay_count": replayed.replay_count,
        "note": note,
    });
    audit(
        &scope,
        run_id.as_deref(),
        None,
        AuditKind::OutboxReplay.gateway_type(),
        "replayed",
        actor.as_deref(),
        &redact(&guc::redaction_rules(), payload),
    )?;
    Ok(replayed.event)
}

/// Records an audit event (a gateway decision, a human intervention, ...) for a run.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_audit(
    run_id: Option<&str>,
    gateway_type: Option<&str>,
    outcome: Option<&str>,
    payload: default!(Option<Jsonb>, "'{}'"),
    step_id: default!(Option<&str>, "NULL"),
    actor: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.audit_events"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let gateway_type = required_label("gateway_type", gateway_type)?;
    let outcome = required_label("outcome", outcome)?;
    let actor = free_text(optional_label("actor", actor)?);
    let payload = redacted_object("payload", payload)?;
    Ok(audit(
        &scope,
        Some(run_id),
        step_id,
        gateway_type,
        outcome,
        actor.as_deref(),
        &payload,
    )?)
}

/// Records what a run showed its user (a message, a delta, a tool output, ...).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_response_event(
    run_id: Option<&str>,
    event_type: Option<&str>,
    payload: default!(Option<Jsonb>, "'{}'"),
    step_id: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.response_events"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let event_type = required_label("event_type", event_type)?;
    let payload = Jsonb::from(&redacted_object("payload", payload)?);
    Ok(record(
        &scope,
        Kind::ResponseEvent,
        Some(run_id),
        step_id,
        &["step_id", "event_type", "payload"],
        vec![step_id.into(), event_type.into(), payload.into()],
    )?)
}

/// Records a knowledge citation (an object: chunk_id, document_id, knowledge_id, ...).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_citation(
    run_id: Option<&str>,
    citation: Option<Jsonb>,
    step_id: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.citations"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let citation = Jsonb::from(&redacted_object(
        "citation",
        Some(citation.ok_or_else(|| LedgerError::required("citation"))?),
    )?);
    Ok(record(
        &scope,
        Kind::Citation,
        Some(run_id),
        step_id,
        &["step_id", "citation"],
        vec![step_id.into(), citation.into()],
    )?)
}

/// Records a person's rating of a run (any integer scale: thumbs as -1/1, stars as 1..5).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_feedback(
    run_id: Option<&str>,
    rating: Option<i32>,
    category: default!(Option<&str>, "'general'"),
    comment: default!(Option<&str>, "NULL"),
    user_id: default!(Option<&str>, "NULL"),
    metadata: default!(Option<Jsonb>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_feedback"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let rating = rating.ok_or_else(|| LedgerError::required("rating"))?;
    let category = required_label("category", category)?;
    let user_id = optional_label("user_id", user_id)?;
    let metadata = Jsonb::from(&redacted_object("metadata", metadata)?);
    Ok(record(
        &scope,
        Kind::Feedback,
        Some(run_id),
        None,
        &["rating", "category", "comment", "user_id", "metadata"],
        vec![
            rating.into(),
            category.into(),
            free_text(comment).into(),
            user_id.into(),
            metadata.into(),
        ],
    )?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    #[pg_test]
    fn records_are_redacted_and_announced() {
        set_scope("t-records", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r'), ledger.create_step('r', 'tool', step_id => 's')").unwrap();
        Spi::run("SELECT ledger.record_audit('r', 'gateway.request', 'allowed', '{\"headers\": {\"Authorization\": \"Bearer abcdefghijkl\"}}', step_id => 's', actor => 'gw')").unwrap();
        Spi::run("SELECT ledger.record_response_event('r', 'message', '{\"text\": \"key sk-abcdefghijklmnopqrstuvwx\"}')").unwrap();
        Spi::run(
            "SELECT ledger.record_citation('r', '{\"chunk_id\": \"c1\", \"password\": \"x\"}')",
        )
        .unwrap();
        Spi::run("SELECT ledger.record_feedback('r', -1, 'accuracy', 'wrong order', 'u1', '{\"token\": \"t\"}')").unwrap();
        let all = one::<String>(
            "SELECT concat_ws('|', (SELECT payload::text FROM ledger.audit_events), (SELECT payload::text FROM ledger.response_events), \
                    (SELECT citation::text FROM ledger.citations), (SELECT metadata::text FROM ledger.run_feedback))",
        );
        assert_eq!(
            all,
            r#"{"headers": {"Authorization": "[REDACTED]"}}|{"text": "[REDACTED]"}|{"chunk_id": "c1", "password": "[REDACTED]"}|{"token": "[REDACTED]"}"#
        );
        assert_eq!(
            one::<String>(
                "SELECT string_agg(event_type, ',' ORDER BY seq) FROM ledger.run_events WHERE seq > 2"
            ),
            "audit.recorded,response_event.recorded,citation.recorded,feedback.recorded"
        );
        assert!(one::<bool>(
            "SELECT bool_and(id LIKE 'aud\\_%') FROM ledger.audit_events"
        ));
    }

    #[pg_test]
    fn bad_records_are_refused() {
        set_scope("t-records-bad", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        for (sql, state, code) in [
            (
                "SELECT ledger.record_audit('r', NULL, 'x')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_audit('r', 'g', 'x', '[1]')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.record_response_event('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_citation('r', '\"text\"')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.record_citation('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_feedback('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_feedback('nope', 1)",
                "P0002",
                "RUN_NOT_FOUND",
            ),
            (
                "SELECT ledger.record_audit('r', 'g', 'x', step_id => 'nope')",
                "P0002",
                "STEP_NOT_FOUND",
            ),
        ] {
            assert_error(sql, state, code);
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_events"), 1);
    }
}
