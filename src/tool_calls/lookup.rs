//! Finding the record a claim or an approval request names, and the tombstone of a purged one.

use super::{Arguments, Identity};
use crate::db;
use crate::error::Result;
use crate::jsonb::Jsonb;
use crate::rows::{self, By, LockedRun, ToolCall};
use crate::scope::Scope;
use ledger_model::tool_calls::identity_reused;

/// The record an identity names, and how far this transaction holds it.
pub(super) enum Found {
    /// Its run is locked by this transaction, the record read under that lock.
    Held(LockedRun, ToolCall),
    /// Another run's record while a concurrent transaction holds that run: read, not locked.
    /// Waiting for that run while holding the calling run could close a cycle (40P01), so the
    /// claim answers from what it read and writes nothing to that run.
    Unheld(ToolCall),
    /// Another run's record while a purge is deleting its run: the tombstone answers once the
    /// purge commits.
    Purging(ToolCall),
}

impl Found {
    fn record(&self) -> &ToolCall {
        match self {
            Found::Held(_, rec) | Found::Unheld(rec) | Found::Purging(rec) => rec,
        }
    }
}

/// Finds the record an identity names (by idempotency key first, then by run and tool_call_id).
/// A record of `run`, the calling run (already locked), is read under its lock; one of another run
/// only once its run is locked too, which is tried only if no one else holds that run, never
/// waited for.
pub(super) fn find_locked(scope: &Scope, run: &LockedRun, who: &Identity) -> Result<Option<Found>> {
    let found = match rows::find_tool_call(scope, By::Key(&who.idempotency_key))? {
        Some(r) => Some(r),
        None => rows::find_tool_call(scope, By::RunCall(who.run_id, &who.tool_call_id))?,
    };
    let Some(found) = found else { return Ok(None) };
    let record_run = if found.run_id == run.id {
        Some(run.clone())
    } else {
        rows::try_lock_run(scope, &found.run_id)?
    };
    // A purge may have removed it meanwhile: then its tombstone answers.
    let found = match record_run {
        Some(record_run) => rows::held_tool_call(scope, &record_run, &found.id)?
            .map(|rec| Found::Held(record_run, rec)),
        None => {
            let stays = rows::try_key_share_run(scope, &found.run_id)?;
            rows::find_tool_call(scope, By::Id(&found.id))?.map(|rec| {
                if stays {
                    Found::Unheld(rec)
                } else {
                    Found::Purging(rec)
                }
            })
        }
    };
    if let Some(rec) = found.as_ref().map(Found::record) {
        if rec.idempotency_key != who.idempotency_key {
            // Found by (run_id, tool_call_id) under another key.
            return Err(identity_reused().with("tool_call_id", who.tool_call_id.as_str()));
        }
    }
    Ok(found)
}

/// The tombstone of a purged call with this key: `{"outcome": "purged", ...}`, never a new
/// execution (a different tool or request under the key is still a conflict).
pub(super) fn tombstone(scope: &Scope, who: &Identity, args: &Arguments) -> Result<Option<Jsonb>> {
    let Some((tool_ref, hash, record)) = db::select_one(
        "SELECT tool_ref, request_hash, to_jsonb(t) - 'tenant_id' - 'workspace_id' \
           FROM ledger.tool_call_tombstones t \
          WHERE tenant_id = $1 AND workspace_id = $2 AND idempotency_key = $3",
        &scope.args([who.idempotency_key.as_str().into()]),
        |r| {
            Ok((
                db::req::<String>(r, 1)?,
                db::req::<String>(r, 2)?,
                db::req::<Jsonb>(r, 3)?,
            ))
        },
    )?
    else {
        return Ok(None);
    };
    if tool_ref != who.tool_ref || hash != args.hash {
        return Err(identity_reused().with("purged", true));
    }
    Ok(Some(Jsonb(format!(
        r#"{{"outcome":"purged","tool_call":{},"approval":null,"response":null}}"#,
        record.0
    ))))
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run};
    use crate::tool_calls::tests::{claim, field, outcome};
    use pgrx::prelude::*;

    #[pg_test]
    fn a_reused_identity_with_other_input_is_a_conflict() {
        running_run("t-tc-identity");
        outcome(r#"{"q": 1}"#, "c1");
        let e = assert_error(&claim(r#"{"q": 2}"#, "c1"), "23505", "IDEMPOTENCY_MISMATCH");
        assert_eq!(
            e.message,
            "ledger: Tool call identity was reused with different input"
        );
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'fetch', '{\"q\": 1}', tool_call_id => 'c1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        // The same tool_call_id under another key is a conflict too.
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'search', '{\"q\": 1}', tool_call_id => 'c1', idempotency_key => 'k2')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1
        );
        assert_eq!(field("c1", "attempt"), "1");
    }

    #[pg_test]
    fn a_replayed_run_gets_its_tool_results_from_the_ledger() {
        running_run("t-tc-replay-run");
        let key = "SELECT ledger.claim_tool_call('{run}', 'lookup', '{\"order\": 7}', idempotency_key => 'order-7:lookup')";
        let id = one::<String>(&format!(
            "{}->'tool_call'->>'id'",
            key.replace("{run}", "r")
        ));
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"eta\": 2}}')"
        ))
        .unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
        let again = one::<String>("SELECT id FROM ledger.replay_run('r')");
        let out = one::<pgrx::JsonB>(&key.replace("{run}", &again)).0;
        assert_eq!(out["outcome"], "replayed");
        assert_eq!(out["response"]["result"], serde_json::json!({"eta": 2}));
        assert_eq!(out["tool_call"]["attempt"], 1);
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1,
            "nothing claimed twice"
        );
        // Resuming the re-run reuses it again, and records the reuse once.
        let out = one::<pgrx::JsonB>(&key.replace("{run}", &again)).0;
        assert_eq!(out["outcome"], "replayed");
        assert_eq!(
            one::<i64>(&format!("SELECT count(*) FROM ledger.events_since('{again}') WHERE event_type = 'tool_call.replayed'")),
            1
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(gateway_type || ':' || (payload->>'source_run_id'), ',')                    FROM ledger.audit_events WHERE run_id = '{again}'"
            )),
            "tool_call.replay:r"
        );
    }
}
