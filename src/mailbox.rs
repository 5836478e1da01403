//! The input mailbox: a person or a system sends a run an input by key (`send_input`), and a
//! run's children report their ends there (`child_ended`); the run's worker waits for them
//! (`waits`). Inputs are kept by key: sending the same key twice is one input. Keys that start
//! with `ledger:` are the ledger's own (a child's end, the wait for children).

use crate::audit;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::guc;
use crate::jsonb::Jsonb;
use crate::notifier;
use crate::redaction::free_text;
use crate::rows::{self, LockedRun};
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required_id, required_label};
use ledger_model::events::{AuditKind, Event, InputReceived};
use ledger_model::ids;
use ledger_model::json;
use ledger_model::redaction;
use pgrx::prelude::*;
use serde_json::{json, Value};

/// The key under which a parent waits for its children.
pub const CHILDREN: &str = "ledger:children";

/// A caller's input key: a label that does not start with `ledger:` (22023 `INPUT_KEY_RESERVED`).
pub fn input_key(key: Option<&str>) -> Result<&str> {
    let key = required_label("input_key", key)?;
    if key.starts_with("ledger:") {
        return Err(LedgerError::new(
            Code::InputKeyReserved,
            "input keys starting with ledger: are the ledger's own",
        )
        .with("input_key", key));
    }
    Ok(key)
}

/// The mailbox row of a run's key, as callers see it.
const ROW_JSON: &str = "SELECT to_jsonb(m) - 'tenant_id' - 'workspace_id' - 'payload_sha256' \
       FROM ledger.run_mailbox m \
      WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND input_key = $4";

/// What the mailbox holds for a key of a run this transaction holds, locked.
pub struct Slot {
    id: String,
    /// The hash of the input as sent (before redaction); None while the run only waits for it.
    pub sha256: Option<String>,
}

pub fn slot(scope: &Scope, run: &LockedRun, key: &str) -> Result<Option<Slot>> {
    db::write_one(
        "SELECT id, payload_sha256 FROM ledger.run_mailbox \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND input_key = $4 FOR UPDATE",
        &scope.args([run.id.as_str().into(), key.into()]),
        |r| {
            Ok(Slot {
                id: db::req(r, 1)?,
                sha256: db::opt(r, 2)?,
            })
        },
    )
}

pub fn row_json(scope: &Scope, run_id: &str, key: &str) -> Result<Value> {
    db::select_one(ROW_JSON, &scope.args([run_id.into(), key.into()]), |r| {
        db::req::<Jsonb>(r, 1)
    })?
    .ok_or_else(|| LedgerError::internal("a mailbox row vanished under its run's lock"))?
    .value()
}

/// Records that the run (held by the caller) waits for `key` until `deadline` (None: no end).
pub fn mark_waiting(
    scope: &Scope,
    run: &LockedRun,
    key: &str,
    deadline: Option<TimestampWithTimeZone>,
) -> Result<()> {
    db::execute(
        "INSERT INTO ledger.run_mailbox (tenant_id, workspace_id, id, run_id, input_key, waited_at, wait_deadline) \
         VALUES ($1, $2, $3, $4, $5, now(), $6) \
         ON CONFLICT (tenant_id, workspace_id, run_id, input_key) DO UPDATE \
            SET waited_at = excluded.waited_at, wait_deadline = excluded.wait_deadline",
        &scope.args([
            ids::new_id("inp").as_str().into(),
            run.id.as_str().into(),
            key.into(),
            deadline.into(),
        ]),
    )
}

/// Sends run `run_id` the input `input_key` (a JSON value, redacted before it is stored). The
/// same key again with the same payload returns the input already there; another payload fails
/// 23505 `IDEMPOTENCY_MISMATCH`. A run waiting for the key becomes claimable at once.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn send_input(
    run_id: Option<&str>,
    input_key: Option<&str>,
    payload: default!(Option<Jsonb>, "'{}'"),
    sender: default!(Option<&str>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| Ok(Jsonb::from(&send(run_id, input_key, payload, sender)?)))
}

fn send(
    run_id: Option<&str>,
    input_key: Option<&str>,
    payload: Option<Jsonb>,
    sender: Option<&str>,
) -> Result<Value> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let key = self::input_key(input_key)?;
    let payload = json::parse(
        payload
            .ok_or_else(|| LedgerError::required("payload"))?
            .as_str(),
    )?;
    let sender = free_text(optional_label("sender", sender)?);
    let run = rows::lock_run(&scope, "run_id", run_id)?;
    deliver(&scope, &run, key, payload, sender.as_deref(), true)?;
    row_json(&scope, run_id, key)
}

/// Puts `payload` in the mailbox of `run` (held by the caller) under `key`, unless the same
/// input is there already; a run waiting for the key may be claimed from now on. A person's
/// input (`audited`) is on record with its sender.
fn deliver(
    scope: &Scope,
    run: &LockedRun,
    key: &str,
    payload: Value,
    sender: Option<&str>,
    audited: bool,
) -> Result<()> {
    let sha256 = json::request_hash(&payload);
    let waiting = match slot(scope, run, key)? {
        Some(Slot {
            sha256: Some(sent), ..
        }) => {
            if sent != sha256 {
                return Err(LedgerError::new(
                    Code::IdempotencyMismatch,
                    "this input key was already sent with another payload",
                )
                .with("input_key", key));
            }
            return Ok(());
        }
        Some(waiting) => Some(waiting.id),
        None => None,
    };
    run.ensure_live("inputs")?;
    let stored = redaction::redact(&guc::redaction_rules(), payload);
    let id = waiting.clone().unwrap_or_else(|| ids::new_id("inp"));
    db::execute(
        "INSERT INTO ledger.run_mailbox \
            (tenant_id, workspace_id, id, run_id, input_key, payload, payload_sha256, sender, received_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now()) \
         ON CONFLICT (tenant_id, workspace_id, run_id, input_key) DO UPDATE \
            SET payload = excluded.payload, payload_sha256 = excluded.payload_sha256, \
                sender = excluded.sender, received_at = excluded.received_at",
        &scope.args([
            id.as_str().into(),
            run.id.as_str().into(),
            key.into(),
            Jsonb::from(&stored).into(),
            sha256.as_str().into(),
            sender.into(),
        ]),
    )?;
    // The run waits for this key: it may be claimed from now on (it stays in waiting_input until
    // its next owner moves it on).
    if waiting.is_some() {
        wake(scope, &run.id)?;
    }
    let received = Event::InputReceived(InputReceived {
        input_id: &id,
        input_key: key,
        sender,
        woke_run: waiting.is_some(),
    });
    feed::append(scope, run.held(), None, &received)?;
    if audited {
        audit::write(
            scope,
            Some(&run.id),
            None,
            AuditKind::InputSend,
            "received",
            sender,
            json!({"input_id": id, "input_key": key}),
        )?;
    }
    Ok(())
}

/// Makes a parked run claimable from now on.
fn wake(scope: &Scope, run_id: &str) -> Result<()> {
    notifier::runs_ready();
    db::execute(
        "UPDATE ledger.runs SET not_before = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND not_before > now()",
        &scope.args([run_id.into()]),
    )
}

/// A child run (`child`, just moved to the terminal `status`) reports its end to its parent's
/// mailbox (`ledger:child:<id>`: status, summary, error), and wakes the parent when it waits for
/// its children and none is left running. A parent that has ended or is gone is not told.
pub fn child_ended(scope: &Scope, parent_id: &str, child: &str) -> Result<()> {
    let Some(parent) = rows::lock_run_if_any(scope, parent_id)? else {
        return Ok(());
    };
    if parent.status.is_terminal() {
        return Ok(());
    }
    let outcome = db::select_one(
        "SELECT jsonb_build_object('run_id', id, 'status', status, 'output_summary', output_summary, \
                'error_code', error_code, 'error_message', error_message) \
           FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([child.into()]),
        |r| db::req::<Jsonb>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("a child run vanished under its lock"))?
    .value()?;
    deliver(
        scope,
        &parent,
        &format!("ledger:child:{child}"),
        outcome,
        None,
        false,
    )?;
    let waits = matches!(
        slot(scope, &parent, CHILDREN)?,
        Some(Slot { sha256: None, .. })
    );
    if waits && running_children(scope, parent_id)? == 0 {
        wake(scope, parent_id)?;
    }
    Ok(())
}

/// How many children of the run have not ended.
pub fn running_children(scope: &Scope, run_id: &str) -> Result<i64> {
    Ok(db::select_one(
        "SELECT count(*) FROM ledger.runs \
          WHERE tenant_id = $1 AND workspace_id = $2 AND parent_run_id = $3 \
            AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired')",
        &scope.args([run_id.into()]),
        |r| db::req::<i64>(r, 1),
    )?
    .unwrap_or(0))
}

/// The run's children, oldest first, each with how it ended so far.
pub fn children(scope: &Scope, run_id: &str) -> Result<Value> {
    db::select_one(
        "SELECT coalesce(jsonb_agg(jsonb_build_object('run_id', id, 'status', status, \
                  'output_summary', output_summary, 'error_code', error_code, \
                  'error_message', error_message) ORDER BY created_at, id), '[]') \
           FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND parent_run_id = $3",
        &scope.args([run_id.into()]),
        |r| db::req::<Jsonb>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("no answer"))?
    .value()
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn claimed() -> String {
        one::<String>(
            "SELECT coalesce((SELECT run_id || ':' || run_token FROM ledger.claim_run('w')), 'none')",
        )
    }

    fn text(query: &str) -> String {
        one::<String>(query)
    }

    /// A run (`r`) claimed with token 1 and running.
    fn running() {
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r'); \
             SELECT ledger.claim_run('w'); \
             SELECT ledger.transition_run('r', 'running', run_token => 1)",
        )
        .unwrap();
    }

    /// A run waiting for an input is nobody's and not claimable until the input arrives; the
    /// input (redacted, audited, in the feed) wakes it, and its next owner reads it.
    #[pg_test]
    fn an_input_wakes_the_run_that_waits_for_it() {
        set_scope("t-mailbox", "w");
        running();
        assert_eq!(
            text("SELECT ledger.wait_for_input('r', 1, 'answer')->>'status'"),
            "waiting"
        );
        assert_eq!(
            text(
                "SELECT concat_ws(':', status, lease_owner IS NULL, not_before = 'infinity') \
                   FROM ledger.runs WHERE id = 'r'"
            ),
            "waiting_input:t:t"
        );
        assert_eq!(claimed(), "none");
        assert_error(
            "SELECT ledger.heartbeat_run('r', 1)",
            "40001",
            "LEASE_STALE",
        );
        let sent = one::<pgrx::JsonB>(
            "SELECT ledger.send_input('r', 'answer', \
                 '{\"text\": \"yes, refund it\", \"api_key\": \"sk-live-0123456789abcdefghij\"}', sender => 'ana')",
        )
        .0;
        assert_eq!(sent["payload"]["text"], "yes, refund it");
        assert_eq!(sent["payload"]["api_key"], "[REDACTED]");
        assert_eq!(sent["sender"], "ana");
        assert!(sent.get("payload_sha256").is_none());
        assert_eq!(claimed(), "r:2");
        let got = one::<pgrx::JsonB>("SELECT ledger.wait_for_input('r', 2, 'answer')").0;
        assert_eq!(
            (got["status"].as_str(), got["input"]["id"].as_str()),
            (Some("received"), sent["id"].as_str())
        );
        assert_eq!(got["input"]["payload"]["text"], "yes, refund it");
        // Received: the owner keeps the run.
        Spi::run("SELECT ledger.heartbeat_run('r', 2)").unwrap();
        // The same input again is the same input; another payload under the key is refused.
        assert_eq!(
            text(
                "SELECT ledger.send_input('r', 'answer', \
                   '{\"api_key\": \"sk-live-0123456789abcdefghij\", \"text\": \"yes, refund it\"}', sender => 'ana')->>'id'"
            ),
            sent["id"].as_str().unwrap()
        );
        assert_error(
            "SELECT ledger.send_input('r', 'answer', '{\"text\": \"no\"}')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(
            text(
                "SELECT string_agg(payload->>'input_key' || ':' || (payload->>'woke_run'), ' ' ORDER BY seq) \
                   FROM ledger.run_events WHERE event_type = 'input.received'"
            ),
            "answer:true"
        );
        assert_eq!(
            text(
                "SELECT actor || ':' || outcome || ':' || (payload->>'input_key') FROM ledger.audit_events \
                  WHERE gateway_type = 'input.send'"
            ),
            "ana:received:answer"
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_mailbox"), 1);
    }

    /// An input sent before the wait is there when the run asks; a wait with a deadline hands
    /// the run out again at the deadline, and asked again past it, it has timed out.
    #[pg_test]
    fn an_early_input_is_kept_and_a_deadline_ends_the_wait() {
        set_scope("t-mailbox-deadline", "w");
        running();
        assert_eq!(
            text("SELECT (ledger.send_input('r', 'early', '\"ok\"'))->>'payload'"),
            "ok"
        );
        assert_eq!(
            text("SELECT ledger.wait_for_input('r', 1, 'early')->'input'->>'payload'"),
            "ok"
        );
        Spi::run("SELECT ledger.heartbeat_run('r', 1)").unwrap();
        let wait = "SELECT ledger.wait_for_input('r', {token}, 'late', \
                      deadline => '2030-01-01T00:00:00Z')->>'status'";
        assert_eq!(text(&wait.replace("{token}", "1")), "waiting");
        assert_eq!(
            text("SELECT wait_deadline::text FROM ledger.run_mailbox WHERE input_key = 'late'"),
            text("SELECT '2030-01-01T00:00:00Z'::timestamptz::text")
        );
        assert_eq!(claimed(), "none");
        // The deadline comes.
        Spi::run("UPDATE ledger.runs SET not_before = clock_timestamp() - interval '1 second'")
            .unwrap();
        assert_eq!(claimed(), "r:2");
        assert_eq!(
            text(
                "SELECT ledger.wait_for_input('r', 2, 'late', \
                   deadline => clock_timestamp() - interval '1 second')->>'status'"
            ),
            "timed_out"
        );
        // Timed out, the run is still its owner's.
        Spi::run("SELECT ledger.transition_run('r', 'running', run_token => 2)").unwrap();
    }

    /// Bad calls are refused with their code and write nothing.
    #[pg_test]
    fn a_bad_send_or_wait_is_refused_and_writes_nothing() {
        set_scope("t-mailbox-refused", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'q'); SELECT ledger.claim_run('w'); \
             SELECT ledger.create_run('agent', run_id => 'done'); \
             SELECT ledger.transition_run('done', 'canceled')",
        )
        .unwrap();
        for (query, state, code) in [
            (
                "SELECT ledger.send_input('done', 'k')",
                "55000",
                "RUN_TERMINAL",
            ),
            (
                "SELECT ledger.send_input('missing', 'k')",
                "P0002",
                "RUN_NOT_FOUND",
            ),
            (
                "SELECT ledger.send_input('q', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.send_input('q', 'k', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.send_input('q', E'a\\nb')",
                "22023",
                "LABEL_INVALID",
            ),
            (
                "SELECT ledger.wait_for_input('q', 1, 'k')",
                "55000",
                "TRANSITION_INVALID",
            ),
            (
                "SELECT ledger.wait_for_input('q', 7, 'k')",
                "40001",
                "LEASE_STALE",
            ),
            (
                "SELECT ledger.wait_for_input('q', NULL, 'k')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.wait_for_input('q', 1, '')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
        ] {
            assert_error(query, state, code);
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_mailbox"), 0);
        assert_eq!(
            text("SELECT status || ':' || lease_owner FROM ledger.runs WHERE id = 'q'"),
            "queued:w"
        );
    }
}
