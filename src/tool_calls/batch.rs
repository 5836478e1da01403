//! `claim_tool_calls`: the tool calls of one model turn claimed (and begun) in one statement and
//! one commit. Each call goes through `claim_tool_call`'s own checks and rules (`Claim`,
//! `claim`, `start`); the batch adds only its shape, one lock and fence of the run, and one
//! `last_seq` bump for all the events (`feed::collected`).

use super::claim::{claim, claim_owner, Answer, Claim};
use super::execute::start;
use super::{approval_request, parsed_arguments};
use crate::error::{LedgerError, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::rows;
use crate::scope;
use ledger_model::args::required_id;
use ledger_model::json;
use ledger_model::tool_calls::batch::{self, CallSpec};
use pgrx::prelude::*;

/// Claims the tool calls of one model turn in one statement: each element of `calls` (a JSON
/// array of `claim_tool_call`'s per-call arguments) is claimed as `claim_tool_call` claims it,
/// under one lock and fence of the run, and answers one row, in input order. With `begin`, every
/// call claimed is begun too (`begin_tool_call`): the caller COMMITs before any request leaves.
/// Any refusal refuses the whole batch (its DETAIL names the element's `index`): nothing is
/// written.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn claim_tool_calls(
    run_id: Option<&str>,
    calls: Option<Jsonb>,
    lease_owner: default!(Option<&str>, "NULL"),
    begin: default!(Option<bool>, false),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<TableIterator<'static, (name!(index, i32), name!(claim, Jsonb))>, SqlError>
{
    feed::collected(|| {
        let scope = scope::current()?;
        let run_id = required_id("run_id", run_id)?;
        let calls = calls.ok_or_else(|| LedgerError::required("calls"))?;
        let mut specs = batch::calls(json::parse_nested(calls.as_str(), batch::NESTING)?)?;
        let begin = begin.ok_or_else(|| LedgerError::required("begin"))?;
        let owner = claim_owner(lease_owner, run_id)?;
        // Every call is checked before the run is locked: a bad one writes nothing.
        let mut claims = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter_mut().enumerate() {
            let CallSpec {
                tool_ref,
                arguments,
                tool_call_id,
                idempotency_key,
                step_id,
                timeout_seconds,
                retry_failed,
                approval,
            } = spec;
            let call = Claim::new(
                Some(run_id),
                tool_ref.as_deref(),
                || parsed_arguments(arguments.take()),
                tool_call_id.as_deref(),
                idempotency_key.as_deref(),
                step_id.as_deref(),
                *timeout_seconds,
                *retry_failed,
                || approval.as_ref().map(approval_request).transpose(),
            )
            .map_err(|e| e.with("index", i))?;
            claims.push(call);
        }
        batch::distinct(
            claims
                .iter()
                .map(|c| (c.who.idempotency_key.as_str(), c.who.tool_call_id.as_str())),
        )?;
        let run = rows::lock_run(&scope, "run_id", run_id)?;
        run.fence(run_token)?;
        let mut rows = Vec::with_capacity(claims.len());
        for (i, call) in claims.iter().enumerate() {
            let answer = match claim(&scope, &run, call, &owner) {
                Ok(Answer::Claimed(mut held)) if begin => {
                    let (call_run, rec) = &mut *held;
                    start(&scope, call_run, rec).map(|()| Answer::Claimed(held))
                }
                other => other,
            };
            let json = answer
                .and_then(|a| a.json(&scope))
                .map_err(|e| e.with("index", i))?;
            // i < MAX_CALLS: an integer.
            rows.push((i as i32, json));
        }
        Ok(TableIterator::new(rows))
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;
    use serde_json::{json, Value};

    /// A running run with a call in every state a claim can meet: done (succeeded), busy (a live
    /// lease), sent (begun, its lease expired: in doubt at the next claim), asked (waiting for
    /// approval) and denied (its approval rejected).
    fn run_with_calls(run: &str) {
        let call = |c: &str| {
            format!("(SELECT id FROM ledger.run_step_tool_calls WHERE run_id = '{run}' AND tool_call_id = '{c}')")
        };
        Spi::run(&format!(
            "SELECT ledger.create_run('agent', run_id => '{run}'); \
             SELECT ledger.transition_run('{run}', 'running'); \
             SELECT ledger.claim_tool_call('{run}', 'search', '{{\"q\": 1}}', tool_call_id => 'done'); \
             SELECT ledger.complete_tool_call({done}, 1, 'succeeded', '{{\"hits\": 3}}'); \
             SELECT ledger.claim_tool_call('{run}', 'search', '{{\"q\": 2}}', tool_call_id => 'busy'); \
             SELECT ledger.claim_tool_call('{run}', 'pay', '{{\"n\": 1}}', tool_call_id => 'sent'); \
             SELECT ledger.begin_tool_call({sent}, 1); \
             UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second' \
              WHERE run_id = '{run}' AND tool_call_id = 'sent'; \
             SELECT ledger.request_tool_approval('{run}', 'pay', '{{\"n\": 2}}', tool_call_id => 'asked'); \
             SELECT ledger.request_tool_approval('{run}', 'pay', '{{\"n\": 3}}', tool_call_id => 'denied'); \
             SELECT ledger.resolve_approval((SELECT approval_id FROM ledger.run_step_tool_calls \
               WHERE run_id = '{run}' AND tool_call_id = 'denied'), 'rejected')",
            done = call("done"),
            sent = call("sent"),
        ))
        .unwrap();
    }

    /// The calls of a turn meeting every state, as a batch: (tool_call_id, element).
    fn turn(run: &str) -> Vec<(&'static str, Value)> {
        vec![
            (
                "fresh",
                json!({"tool_ref": "search", "arguments": {"q": 9}, "tool_call_id": "fresh", "timeout_seconds": 5}),
            ),
            (
                "done",
                json!({"tool_ref": "search", "arguments": {"q": 1}, "tool_call_id": "done"}),
            ),
            (
                "busy",
                json!({"tool_ref": "search", "arguments": {"q": 2}, "tool_call_id": "busy"}),
            ),
            (
                "sent",
                json!({"tool_ref": "pay", "arguments": {"n": 1}, "tool_call_id": "sent"}),
            ),
            (
                "asked",
                json!({"tool_ref": "pay", "arguments": {"n": 2}, "tool_call_id": "asked"}),
            ),
            (
                "denied",
                json!({"tool_ref": "pay", "arguments": {"n": 3}, "tool_call_id": "denied"}),
            ),
            (
                "gated",
                json!({"tool_ref": "pay", "arguments": {"n": 4}, "tool_call_id": "gated", "approval": {"title": "Pay?"}}),
            ),
            (
                "fresh2",
                json!({"tool_ref": "fetch", "tool_call_id": "fresh2", "idempotency_key": format!("k-fresh2-{run}")}),
            ),
        ]
    }

    /// The same call by `claim_tool_call` (and `begin_tool_call` when claimed and `begin`).
    fn single(run: &str, element: &Value, begin: bool) -> Value {
        let text = |k: &str| {
            element
                .get(k)
                .map_or("NULL".to_owned(), |v| format!("'{}'", v.as_str().unwrap()))
        };
        let json_arg = |k: &str, default: &str| {
            element
                .get(k)
                .map_or(default.to_owned(), |v| format!("'{v}'"))
        };
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('{run}', {}, {}, tool_call_id => {}, idempotency_key => {}, \
             timeout_seconds => {}, approval => {}, lease_owner => 'w1')",
            text("tool_ref"),
            json_arg("arguments", "'{}'"),
            text("tool_call_id"),
            text("idempotency_key"),
            element.get("timeout_seconds").map_or("30".to_owned(), Value::to_string),
            json_arg("approval", "NULL"),
        ))
        .0;
        if !(begin && out["outcome"] == "claimed") {
            return out;
        }
        let id = out["tool_call"]["id"].as_str().unwrap().to_owned();
        let begun = one::<pgrx::JsonB>(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).0;
        // What the batch answers: the claim's outcome, the record as it is once begun.
        json!({"outcome": out["outcome"], "tool_call": begun["tool_call"], "approval": begun["approval"], "response": begun["response"]})
    }

    fn batch(run: &str, calls: &[(&str, Value)], begin: bool) -> Vec<Value> {
        let calls = Value::Array(calls.iter().map(|(_, e)| e.clone()).collect());
        let rows = one::<pgrx::JsonB>(&format!(
            "SELECT jsonb_agg(jsonb_build_object('index', index, 'claim', claim) ORDER BY index) \
               FROM ledger.claim_tool_calls('{run}', '{calls}', lease_owner => 'w1', begin => {begin})"
        ))
        .0;
        rows.as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                assert_eq!(r["index"], i);
                r["claim"].clone()
            })
            .collect()
    }

    /// What must be equal between two runs' answers: everything but ids, times and the run's name.
    fn comparable(v: Value, run: &str) -> Value {
        let mut v: Value = serde_json::from_str(&v.to_string().replace(run, "RUN")).unwrap();
        fn strip(v: &mut Value) {
            match v {
                Value::Object(m) => {
                    m.retain(|k, _| {
                        !(k == "id"
                            || k == "run_id"
                            || k == "step_id"
                            || k == "approval_id"
                            || k == "tool_call_record_id"
                            || k == "idempotency_key"
                            || k.ends_with("_at"))
                    });
                    m.values_mut().for_each(strip);
                }
                Value::Array(a) => a.iter_mut().for_each(strip),
                _ => {}
            }
        }
        strip(&mut v);
        v
    }

    /// A run's feed and audit trail, without ids: `event_type:step kind` and `gateway:outcome:actor`.
    fn trail(run: &str) -> (String, String, i64) {
        let unnamed = |t: String| t.replace(run, "RUN");
        (
            one::<String>(&format!(
                "SELECT string_agg(event_type || coalesce(':' || (payload->>'to'), ''), ' ' ORDER BY seq) \
                   FROM ledger.run_events WHERE run_id = '{run}'"
            )),
            unnamed(one::<String>(&format!(
                "SELECT string_agg(concat_ws(':', gateway_type, outcome, actor, payload->'tool_call'->>'tool_call_id'), ' ' ORDER BY created_at, id) \
                   FROM ledger.audit_events WHERE run_id = '{run}'"
            ))),
            one::<i64>(&format!(
                "SELECT last_seq - (SELECT count(*) FROM ledger.run_events WHERE run_id = '{run}') FROM ledger.runs WHERE id = '{run}'"
            )),
        )
    }

    fn same_as_single_calls(begin: bool, tenant: &str) {
        set_scope(tenant, "w");
        run_with_calls("one-by-one");
        run_with_calls("batched");
        let singles: Vec<Value> = turn("one-by-one")
            .iter()
            .map(|(_, e)| single("one-by-one", e, begin))
            .collect();
        let batched = batch("batched", &turn("batched"), begin);
        let outcomes: Vec<&str> = batched
            .iter()
            .map(|b| b["outcome"].as_str().unwrap())
            .collect();
        let claimed_status = if begin { "running" } else { "claimed" };
        assert_eq!(
            outcomes,
            [
                "claimed",
                "replayed",
                "busy",
                "in_doubt",
                "waiting_approval",
                "rejected",
                "waiting_approval",
                "claimed"
            ]
        );
        assert_eq!(batched[0]["tool_call"]["status"], claimed_status);
        assert_eq!(batched[7]["tool_call"]["status"], claimed_status);
        assert_eq!(batched[3]["tool_call"]["status"], "in_doubt");
        assert_eq!(batched[1]["response"]["result"], json!({"hits": 3}));
        for ((call, _), (s, b)) in turn("batched").iter().zip(singles.into_iter().zip(batched)) {
            assert_eq!(
                comparable(s, "one-by-one"),
                comparable(b, "batched"),
                "{call}"
            );
        }
        // The same events in the same order, the same audit records, no gaps in either feed.
        let (one_by_one, batched) = (trail("one-by-one"), trail("batched"));
        assert_eq!(one_by_one, batched);
        assert_eq!(batched.2, 0);
        assert!(batched.0.contains("tool_call.in_doubt"), "{}", batched.0);
        // begin writes no audit record of its own (the claim's and the completion's are the
        // call's), batched or not.
        assert_eq!(batched.1.matches("tool_call.begin").count(), 0);
    }

    #[pg_test]
    fn a_batch_answers_and_writes_each_call_as_the_single_claims_would() {
        same_as_single_calls(false, "t-batch-same");
    }

    #[pg_test]
    fn a_batch_with_begin_answers_and_writes_as_claim_and_begin_would() {
        same_as_single_calls(true, "t-batch-begin");
    }

    #[pg_test]
    fn a_batch_takes_the_run_lock_once_and_bumps_last_seq_once() {
        set_scope("t-batch-once", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')").unwrap();
        let updates =
            || one::<i64>("SELECT pg_stat_get_xact_tuples_updated('ledger.runs'::regclass)");
        let before = updates();
        let calls = json!([
            {"tool_ref": "a", "tool_call_id": "c1"}, {"tool_ref": "b", "tool_call_id": "c2"},
            {"tool_ref": "c", "tool_call_id": "c3"}, {"tool_ref": "d", "tool_call_id": "c4"}
        ]);
        let n = one::<i64>(&format!(
            "SELECT count(*) FROM ledger.claim_tool_calls('r', '{calls}', begin => true)"
        ));
        assert_eq!(n, 4);
        // One UPDATE of the run row: the last_seq bump that covers every event of the batch.
        assert_eq!(updates() - before, 1);
        assert_eq!(
            one::<String>(
                "SELECT string_agg(DISTINCT status, ',') FROM ledger.run_step_tool_calls"
            ),
            "running"
        );
        assert_eq!(
            one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'"),
            one::<i64>("SELECT count(*) FROM ledger.run_events WHERE run_id = 'r'")
        );
        // Default owner, as claim_tool_call's.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(DISTINCT lease_owner, ',') FROM ledger.run_step_tool_calls"
            ),
            "tool:r"
        );
    }

    /// Rows, events and audit records written so far in the scope.
    fn written() -> i64 {
        one::<i64>(
            "SELECT (SELECT count(*) FROM ledger.run_step_tool_calls) + (SELECT count(*) FROM ledger.run_events) \
                  + (SELECT count(*) FROM ledger.audit_events) + (SELECT count(*) FROM ledger.run_steps) \
                  + (SELECT sum(last_seq) FROM ledger.runs)::bigint",
        )
    }

    #[pg_test]
    fn a_bad_batch_is_refused_whole_naming_the_element_and_writes_nothing() {
        set_scope("t-batch-bad", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running'); \
             SELECT ledger.claim_tool_call('r', 'search', '{\"q\": 1}', tool_call_id => 'known')",
        )
        .unwrap();
        let before = written();
        let ok = r#"{"tool_ref": "search", "tool_call_id": "new"}"#;
        let big = format!("[{}]", vec![r#"{"tool_ref": "t"}"#; 101].join(","));
        for (calls, state, code, index) in [
            ("NULL", "22023", "ARGUMENT_REQUIRED", None),
            ("'{}'", "22023", "CALLS_NOT_ARRAY", None),
            ("'\"[]\"'", "22023", "CALLS_NOT_ARRAY", None),
            (&format!("'{big}'"), "22023", "CALLS_TOO_MANY", None),
            (&format!("'[{ok}, 7]'"), "22023", "CALL_INVALID", Some(1)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"tool\": 1}}]'"), "22023", "CALL_INVALID", Some(1)),
            (&format!("'[{{\"tool_ref\": null}}, {ok}]'"), "22023", "ARGUMENT_REQUIRED", Some(0)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"arguments\": [1]}}]'"), "22023", "ARGUMENTS_NOT_OBJECT", Some(1)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"timeout_seconds\": -1}}]'"), "22023", "TIMEOUT_INVALID", Some(1)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"tool_call_id\": \"a b\"}}]'"), "22023", "ID_INVALID", Some(1)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"approval\": {{\"why\": 1}}}}]'"), "22023", "APPROVAL_INVALID", Some(1)),
            // The same call twice, by key or by tool_call_id.
            (&format!("'[{ok}, {{\"tool_ref\": \"x\"}}, {ok}]'"), "22023", "CALLS_DUPLICATE", Some(2)),
            ("'[{\"tool_ref\": \"x\", \"idempotency_key\": \"k\"}, {\"tool_ref\": \"x\", \"tool_call_id\": \"c\", \"idempotency_key\": \"k\"}]'", "22023", "CALLS_DUPLICATE", Some(1)),
            // Refusals met while claiming: after element 0 was claimed, and rolled back with it.
            (&format!("'[{ok}, {{\"tool_ref\": \"search\", \"arguments\": {{\"q\": 2}}, \"tool_call_id\": \"known\"}}]'"), "23505", "IDEMPOTENCY_MISMATCH", Some(1)),
            (&format!("'[{ok}, {{\"tool_ref\": \"x\", \"step_id\": \"nope\"}}]'"), "P0002", "STEP_NOT_FOUND", Some(1)),
        ] {
            let e = assert_error(
                &format!("SELECT * FROM ledger.claim_tool_calls('r', {calls})"),
                state,
                code,
            );
            assert_eq!(
                e.detail.get("index").and_then(Value::as_i64),
                index,
                "{calls}: {e:?}"
            );
        }
        assert_error(
            "SELECT * FROM ledger.claim_tool_calls('nope', '[]')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT * FROM ledger.claim_tool_calls(NULL, '[]')",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            &format!("SELECT * FROM ledger.claim_tool_calls('r', '[{ok}]', lease_owner => 'a b')"),
            "22023",
            "ID_INVALID",
        );
        assert_error(
            &format!("SELECT * FROM ledger.claim_tool_calls('r', '[{ok}]', begin => NULL)"),
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_eq!(written(), before);
        // An empty turn claims nothing and writes nothing.
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.claim_tool_calls('r', '[]')"),
            0
        );
        assert_eq!(written(), before);
        // A finished run takes no new call, but its known calls still answer.
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
        let e = assert_error(&format!("SELECT * FROM ledger.claim_tool_calls('r', '[{{\"tool_ref\": \"search\", \"arguments\": {{\"q\": 1}}, \"tool_call_id\": \"known\"}}, {ok}]')"), "55000", "RUN_TERMINAL");
        assert_eq!(e.detail["index"], 1);
        assert_eq!(
            one::<String>("SELECT claim->>'outcome' FROM ledger.claim_tool_calls('r', '[{\"tool_ref\": \"search\", \"arguments\": {\"q\": 1}, \"tool_call_id\": \"known\"}]')"),
            "busy"
        );
    }

    #[pg_test]
    fn a_stale_run_token_refuses_the_batch_and_writes_nothing() {
        set_scope("t-batch-fence", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        let token = one::<i64>("SELECT run_token FROM ledger.claim_run('w1', run_id => 'r')");
        Spi::run("UPDATE ledger.runs SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = 'r'").unwrap();
        let newer = one::<i64>("SELECT run_token FROM ledger.claim_run('w2', run_id => 'r')");
        assert!(newer > token);
        let before = written();
        let calls = r#"[{"tool_ref": "search", "tool_call_id": "c1"}]"#;
        let e = assert_error(
            &format!("SELECT * FROM ledger.claim_tool_calls('r', '{calls}', run_token => {token})"),
            "40001",
            "LEASE_STALE",
        );
        assert!(e.detail.get("index").is_none());
        assert_eq!(written(), before);
        assert_eq!(
            one::<String>(&format!("SELECT claim->>'outcome' FROM ledger.claim_tool_calls('r', '{calls}', run_token => {newer})")),
            "claimed"
        );
    }

    #[pg_test]
    fn arguments_nest_in_a_batch_as_deep_as_in_a_single_claim() {
        set_scope("t-batch-deep", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')").unwrap();
        let nested = |n: usize| format!("{}1{}", "[".repeat(n - 1), "]".repeat(n - 1));
        // An object of depth 100 (itself and 99 arrays) is accepted alone and in a batch.
        let ok = format!("{{\"a\": {}}}", nested(100));
        let batch = |args: &str| {
            format!("SELECT claim->>'outcome' FROM ledger.claim_tool_calls('r', '[{{\"tool_ref\": \"t\", \"arguments\": {args}}}]')")
        };
        assert_eq!(one::<String>(&batch(&ok)), "claimed");
        let deep = format!("{{\"a\": {}}}", nested(101));
        assert_error(
            &format!("SELECT ledger.claim_tool_call('r', 't', '{deep}')"),
            "22023",
            "INPUT_TOO_DEEP",
        );
        assert_error(&batch(&deep), "22023", "INPUT_TOO_DEEP");
    }
}
