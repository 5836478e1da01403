//! Finding the record a claim or an approval request names, and the tombstone of a purged one.

use super::{identity_reused_by, Arguments, Identity};
use crate::db;
use crate::error::Result;
use crate::jsonb::Jsonb;
use crate::rows::{self, By, LockedRun, RunHead, ToolCall};
use crate::scope::Scope;
use ledger_model::tool_calls::answers_descendant;

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

/// The record an identity names, not locked: by idempotency key first, then by run and
/// tool_call_id, then, for a re-run's call under its default key, through its lineage (see
/// `ancestor_record`; the flag says so).
fn locate(scope: &Scope, run: &RunHead, who: &Identity) -> Result<Option<(ToolCall, bool)>> {
    if let Some(r) = rows::find_tool_call(scope, By::Key(&who.idempotency_key))? {
        return Ok(Some((r, false)));
    }
    if let Some(r) = rows::find_tool_call(scope, By::RunCall(who.run_id, &who.tool_call_id))? {
        return Ok(Some((r, false)));
    }
    Ok(ancestor_record(scope, run, who)?.map(|r| (r, true)))
}

/// Whether a located record answers the identity: an inherited one only where an ancestor's
/// record answers a descendant. Other input under the identity is 23505 `IDEMPOTENCY_MISMATCH`,
/// and so is a record found by (run_id, tool_call_id) under another key.
fn answers(rec: &ToolCall, inherited: bool, who: &Identity, args: &Arguments) -> Result<bool> {
    if inherited {
        if rec.tool_ref != who.tool_ref || rec.request_hash != args.hash {
            return Err(rec.reused(who, &args.hash));
        }
        return Ok(answers_descendant(&rec.existing()));
    }
    if rec.idempotency_key != who.idempotency_key {
        return Err(rec.reused(who, &args.hash));
    }
    Ok(true)
}

/// The record an identity names (see `locate`), read without a lock: what a lookup that writes
/// nothing answers from.
pub(super) fn find(
    scope: &Scope,
    run: &RunHead,
    who: &Identity,
    args: &Arguments,
) -> Result<Option<ToolCall>> {
    let Some((rec, inherited)) = locate(scope, run, who)? else {
        return Ok(None);
    };
    Ok(answers(&rec, inherited, who, args)?.then_some(rec))
}

/// Finds the record an identity names (see `locate`). A record of `run`, the calling run
/// (already locked), is read under its lock; one of another run only once its run is locked too,
/// which is tried only if no one else holds that run, never waited for.
pub(super) fn find_locked(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    args: &Arguments,
) -> Result<Option<Found>> {
    let Some((found, inherited)) = locate(scope, run, who)? else {
        return Ok(None);
    };
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
    match found.as_ref().map(Found::record) {
        Some(rec) if answers(rec, inherited, who, args)? => Ok(found),
        _ => Ok(None),
    }
}

/// The record of the same tool_call_id that the nearest ancestor of a re-run (following
/// `source_run_id`) holds under that ancestor's default key, for a call under the re-run's own
/// default key: a re-run calls its tools with the same tool_call_ids, and a call its lineage
/// already made is never made again. An explicit key names its record itself.
fn ancestor_record(scope: &Scope, run: &RunHead, who: &Identity) -> Result<Option<ToolCall>> {
    if run.root_run_id == run.id || !who.default_key() {
        return Ok(None);
    }
    let Some(id) = db::select_one(
        include_str!("../../sql/queries/lineage_tool_call.sql"),
        &scope.args([run.id.as_str().into(), who.tool_call_id.as_str().into()]),
        |r| db::req::<String>(r, 1),
    )?
    else {
        return Ok(None);
    };
    rows::find_tool_call(scope, By::Id(&id))
}

/// The tombstone of a purged call with this key: `{"outcome": "purged", ...}`, never a new
/// execution (a different tool or request under the key is still a conflict).
pub(super) fn tombstone(scope: &Scope, who: &Identity, args: &Arguments) -> Result<Option<Jsonb>> {
    let Some((tool_ref, hash, run_id, record)) = db::select_one(
        "SELECT tool_ref, request_hash, run_id, to_jsonb(t) - 'tenant_id' - 'workspace_id' \
           FROM ledger.tool_call_tombstones t \
          WHERE tenant_id = $1 AND workspace_id = $2 AND idempotency_key = $3",
        &scope.args([who.idempotency_key.as_str().into()]),
        |r| {
            Ok((
                db::req::<String>(r, 1)?,
                db::req::<String>(r, 2)?,
                db::req::<String>(r, 3)?,
                db::req::<Jsonb>(r, 4)?,
            ))
        },
    )?
    else {
        return Ok(None);
    };
    if tool_ref != who.tool_ref || hash != args.hash {
        return Err(identity_reused_by(who)
            .with("run_id", run_id)
            .with("purged", true));
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
    use crate::tool_calls::tests::{claim, expire, field, outcome};
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

    /// Claims `id` in `run` under its default key: the outcome and the record's run.
    fn send(run: &str, id: &str, to: &str) -> (String, String) {
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('{run}', 'email', '{{\"to\": \"{to}\"}}', tool_call_id => '{id}')"
        ))
        .0;
        let outcome = out["outcome"].as_str().unwrap_or_default().to_owned();
        (
            outcome,
            out["tool_call"]["run_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        )
    }

    /// Begins and completes the record of `id` in `run` with `status`.
    fn made(run: &str, id: &str, status: &str) {
        let rec = one::<String>(&format!(
            "SELECT id FROM ledger.run_step_tool_calls WHERE run_id = '{run}' AND tool_call_id = '{id}'"
        ));
        Spi::run(&format!("SELECT ledger.begin_tool_call('{rec}', attempt) FROM ledger.run_step_tool_calls WHERE id = '{rec}'")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{rec}', attempt, '{status}', '{{}}') FROM ledger.run_step_tool_calls WHERE id = '{rec}'"
        ))
        .unwrap();
    }

    /// Ends `run` (running or queued) with `status`, then re-runs it with `how` (retry or replay).
    fn rerun(run: &str, status: &str, how: &str) -> String {
        Spi::run(&format!(
            "SELECT ledger.transition_run('{run}', 'running') WHERE (SELECT status FROM ledger.runs WHERE id = '{run}') <> 'running'"
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT ledger.transition_run('{run}', '{status}')"
        ))
        .unwrap();
        one::<String>(&format!("SELECT id FROM ledger.{how}_run('{run}')"))
    }

    #[pg_test]
    fn a_rerun_at_any_depth_makes_each_call_its_lineage_made_once() {
        running_run("t-tc-lineage");
        assert_eq!(send("r", "c1", "a").0, "claimed");
        made("r", "c1", "succeeded");
        let g1 = rerun("r", "failed", "retry");
        assert_eq!(send(&g1, "c1", "a"), ("replayed".into(), "r".into()));
        assert_eq!(send(&g1, "c2", "b").0, "claimed");
        made(&g1, "c2", "succeeded");
        let g2 = rerun(&g1, "failed", "retry");
        assert_eq!(send(&g2, "c1", "a"), ("replayed".into(), "r".into()));
        assert_eq!(send(&g2, "c2", "b"), ("replayed".into(), g1.clone()));
        assert_eq!(send(&g2, "c3", "c").0, "claimed");
        made(&g2, "c3", "succeeded");
        let g3 = rerun(&g2, "failed", "retry");
        for (id, to) in [("c1", "a"), ("c2", "b"), ("c3", "c")] {
            assert_eq!(send(&g3, id, to).0, "replayed");
        }
        let g4 = rerun(&g3, "succeeded", "replay");
        for (id, to) in [("c1", "a"), ("c2", "b"), ("c3", "c")] {
            assert_eq!(send(&g4, id, to).0, "replayed", "{id} in the replay");
        }
        assert_eq!(
            one::<String>(
                "SELECT string_agg(tool_call_id || ':' || attempt, ',' ORDER BY tool_call_id) FROM ledger.run_step_tool_calls"
            ),
            "c1:1,c2:1,c3:1",
            "one record and one attempt per call across five runs"
        );
        // Each reuse is audited in the run that reused, as a cross-run replay.
        assert_eq!(
            one::<i64>(&format!(
                "SELECT count(*) FROM ledger.audit_events WHERE run_id = '{g4}' AND gateway_type = 'tool_call.replay'"
            )),
            3
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT jsonb_array_length(ledger.replay_bundle('{g4}')->'reused_tool_calls')"
            )),
            3,
            "the evidence sees the reuse"
        );
        // An explicit key of the old recipe still names its record.
        assert_eq!(
            one::<String>(&format!(
                "SELECT ledger.claim_tool_call('{g4}', 'email', '{{\"to\": \"a\"}}', tool_call_id => 'c1', idempotency_key => 'tool:r:c1')->>'outcome'"
            )),
            "replayed"
        );
        // Other input under the same tool_call_id along the lineage is a conflict naming the call.
        let e = assert_error(
            &format!("SELECT ledger.claim_tool_call('{g4}', 'email', '{{\"to\": \"z\"}}', tool_call_id => 'c2')"),
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["tool_call_id"], "c2");
        assert_eq!(e.detail["idempotency_key"], format!("tool:{g4}:c2"));
        assert_eq!(e.detail["run_id"], g1);
        assert_eq!(e.detail["request_hash_matches"], false);
    }

    #[pg_test]
    fn a_call_in_doubt_in_an_ancestor_is_in_doubt_in_its_reruns() {
        running_run("t-tc-lineage-doubt");
        send("r", "c1", "a");
        let rec =
            one::<String>("SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c1'");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{rec}', 1)")).unwrap();
        let g1 = rerun("r", "failed", "retry");
        // The ancestor's attempt still holds its lease: busy, and nothing handed out.
        assert_eq!(send(&g1, "c1", "a"), ("busy".into(), "r".into()));
        expire("c1");
        assert_eq!(send(&g1, "c1", "a"), ("in_doubt".into(), "r".into()));
        let g2 = rerun(&g1, "failed", "retry");
        assert_eq!(send(&g2, "c1", "a"), ("in_doubt".into(), "r".into()));
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1,
            "never executed again"
        );
        // Once a person resolves it succeeded, the re-runs replay its result.
        Spi::run(&format!(
            "SELECT ledger.resolve_tool_call('{rec}', 'succeeded', result => '{{}}', note => 'checked')"
        ))
        .unwrap();
        assert_eq!(send(&g2, "c1", "a").0, "replayed");
    }

    #[pg_test]
    fn a_call_that_failed_or_never_began_in_an_ancestor_is_made_by_the_rerun_itself() {
        running_run("t-tc-lineage-failed");
        send("r", "c1", "a");
        made("r", "c1", "failed");
        send("r", "c2", "b");
        expire("c2");
        let g1 = rerun("r", "failed", "retry");
        assert_eq!(send(&g1, "c1", "a"), ("claimed".into(), g1.clone()));
        assert_eq!(send(&g1, "c2", "b"), ("claimed".into(), g1.clone()));
        made(&g1, "c1", "succeeded");
        assert_eq!(
            one::<String>("SELECT string_agg(run_id || ':' || tool_call_id || ':' || status, ',' ORDER BY run_id <> 'r', tool_call_id) FROM ledger.run_step_tool_calls"),
            format!("r:c1:failed,r:c2:claimed,{g1}:c1:succeeded,{g1}:c2:claimed"),
            "the ancestor's records unchanged, the re-run's own made"
        );
        let g2 = rerun(&g1, "failed", "retry");
        assert_eq!(send(&g2, "c1", "a"), ("replayed".into(), g1.clone()));
    }

    #[pg_test]
    fn an_ancestor_is_kept_while_a_rerun_may_reuse_its_calls() {
        running_run("t-tc-lineage-purge");
        send("r", "c1", "a");
        made("r", "c1", "succeeded");
        let g1 = rerun("r", "failed", "retry");
        let g2 = rerun(&g1, "failed", "retry");
        Spi::run(&format!(
            "UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE id <> '{g2}'"
        ))
        .unwrap();
        // The ancestors ended long ago, but a re-run names them: purges take a lineage leaf first.
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '30 days')"),
            0
        );
        let g3 = rerun(&g2, "failed", "retry");
        assert_eq!(send(&g3, "c1", "a"), ("replayed".into(), "r".into()));
    }
}
