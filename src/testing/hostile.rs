//! Hostile input at the SQL level: payloads near PostgreSQL's limits, deep nesting,
//! invalid surrogates, huge objects, megabyte text arguments and odd Unicode in ids and keys.
//! Every case ends in a documented error (SQLSTATE, and the DETAIL code when the error is the
//! ledger's) or a correct result, and a refused call leaves the row counts as they were.

use pgrx::prelude::*;

#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, running_run, set_scope};
    use pgrx::prelude::*;

    /// 1 MiB of text (1,048,576 characters) that pglz cannot compress, so nothing is saved on
    /// the way to a table or an index.
    const MB: &str = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 32768) i)";
    const MB_CHARS: i32 = 1_048_576;

    /// Rows of every table a call could write, in the current scope.
    fn rows() -> String {
        let counts: Vec<String> = [
            "runs",
            "run_steps",
            "run_events",
            "outbox",
            "run_step_tool_calls",
            "audit_events",
            "run_cost_entries",
            "run_artifacts",
            "blobs",
        ]
        .iter()
        .map(|t| {
            format!("'{t}=' || (SELECT count(*) FROM ledger.{t} WHERE tenant_id = ledger.scope_tenant())")
        })
        .collect();
        one::<String>(&format!("SELECT concat_ws(' ', {})", counts.join(", ")))
    }

    /// `levels` of nesting: an object around arrays, built by PostgreSQL's own parser.
    fn deep(levels: usize) -> String {
        let n = levels - 1;
        format!("('{{\"a\": ' || repeat('[', {n}) || repeat(']', {n}) || '}}')::jsonb")
    }

    #[pg_test]
    fn hostile_payloads_near_one_gigabyte_are_refused_by_postgres_not_crashed() {
        running_run("t-hostile-gb");
        let before = rows();
        // No text value reaches 1 GB, so no jsonb over PostgreSQL's limit can even be built.
        let e = error_of("SELECT jsonb_build_object('a', repeat('x', 1073741824))");
        assert_eq!(
            (e.sqlstate.as_str(), e.message.as_str()),
            ("54000", "requested length too large")
        );
        // A jsonb string stops at 2^28 - 1 bytes: refused while the argument is built, before
        // the ledger runs.
        let e = error_of(
            "SELECT ledger.claim_tool_call('r', 'search', jsonb_build_object('a', repeat('x', 268435456)))",
        );
        assert_eq!(e.sqlstate, "54000", "{e:?}");
        assert_eq!(e.message, "string too long to represent as jsonb string");
        assert_eq!(rows(), before);

        // 100 MB arguments are claimed, hashed in full and stored as their truncated summary.
        let args = "jsonb_build_object('blob', repeat('x', 100000000))";
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'search', {args}, tool_call_id => 'big')"
        ))
        .0;
        assert_eq!(out["outcome"], "claimed");
        let hash = one::<String>(
            "SELECT encode(sha256(convert_to('{\"blob\":\"' || repeat('x', 100000000) || '\"}', 'UTF8')), 'hex')",
        );
        assert_eq!(out["tool_call"]["request_hash"], hash.as_str());
        assert_eq!(
            out["tool_call"]["arguments"],
            serde_json::json!({
                "truncated": true,
                "size_bytes": 100_000_011,
                "request_hash": hash,
                "argument_names": ["blob"],
            })
        );
        // The backend is alive and the claim is whole: one record, its step, its events.
        assert_eq!(
            one::<String>("SELECT string_agg(status, ',') FROM ledger.run_step_tool_calls WHERE tool_call_id = 'big'"),
            "claimed"
        );
        assert!(one::<bool>(
            "SELECT max(seq) = count(*) FROM ledger.run_events WHERE run_id = 'r'"
        ));
    }

    #[pg_test]
    fn hostile_deep_nesting_is_refused_by_postgres_or_the_ledger() {
        running_run("t-hostile-deep");
        let id = one::<String>(
            "SELECT ledger.claim_tool_call('r', 'search', '{}', tool_call_id => 'c')->'tool_call'->>'id'",
        );
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's')").unwrap();
        let before = rows();
        let calls = |doc: &str| {
            [
                format!("SELECT ledger.claim_tool_call('r', 'search', {doc}, tool_call_id => 'd')"),
                format!("SELECT ledger.record_audit('r', 'gw', 'allowed', {doc})"),
                format!("SELECT ledger.record_cost('r', 'tokens', 1, usage => {doc})"),
                format!("SELECT ledger.record_cost('r', 'tokens', 1, pricing_snapshot => {doc})"),
                format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', {doc})"),
                format!(
                    "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', metadata => {doc})"
                ),
                format!("SELECT ledger.transition_step('s', 'running', metrics => {doc})"),
                format!("SELECT ledger.redact({doc})"),
                format!("SELECT ledger.canonical_json({doc})"),
                format!("SELECT ledger.request_hash({doc})"),
            ]
        };
        // 100,000 levels: PostgreSQL's parser runs out of stack (54001) before any call.
        let objects =
            "('{\"a\": ' || repeat('{\"a\": ', 99999) || '1' || repeat('}', 99999) || '}')::jsonb";
        for doc in [deep(100_000), objects.to_owned()] {
            for call in calls(&doc) {
                let e = error_of(&call);
                assert!(
                    e.sqlstate == "54001"
                        || (e.sqlstate == "22023" && e.detail["code"] == "INPUT_TOO_DEEP"),
                    "{call}: {e:?}"
                );
            }
        }
        // 10,000 and 101 levels are valid jsonb; the ledger refuses them before walking them.
        for levels in [10_000, 101] {
            for call in calls(&deep(levels)) {
                let e = assert_error(&call, "22023", "INPUT_TOO_DEEP");
                assert_eq!(e.detail["max_depth"], 100);
            }
        }
        assert_eq!(rows(), before);
        assert_eq!(
            one::<String>("SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c'"),
            "claimed"
        );
        // 100 levels are accepted.
        assert_eq!(
            one::<String>(&format!(
                "SELECT ledger.claim_tool_call('r', 'search', {}, tool_call_id => 'd')->>'outcome'",
                deep(100)
            )),
            "claimed"
        );
    }

    #[pg_test]
    fn hostile_surrogate_and_nul_escapes_never_reach_the_ledger() {
        running_run("t-hostile-surrogate");
        let before = rows();
        // jsonb decodes escapes and refuses lone or reversed surrogates (22P02) and \u0000
        // (22P05), in a cast or as a ledger argument alike: the ledger is never called.
        for (json, sqlstate) in [
            (r#""\ud800""#, "22P02"),
            (r#""\udc00""#, "22P02"),
            (r#""\udc00\ud800""#, "22P02"),
            (r#""\ud800\u0041""#, "22P02"),
            (r#"{"\ud800": 1}"#, "22P02"),
            (r#""\u0000""#, "22P05"),
        ] {
            for query in [
                format!("SELECT '{json}'::jsonb"),
                format!("SELECT ledger.claim_tool_call('r', 'search', '{{\"q\": {json}}}')"),
                format!("SELECT ledger.canonical_json('{json}')"),
                // json (unlike jsonb) keeps the text, so the refusal moves to the cast.
                format!("SELECT ledger.request_hash('{json}'::json::jsonb)"),
            ] {
                let e = error_of(&query);
                assert_eq!(e.sqlstate, sqlstate, "{query}: {e:?}");
                assert!(!e.message.starts_with("ledger: "), "{query}: {e:?}");
            }
        }
        assert_eq!(rows(), before);
        // A valid pair is a character: canonical JSON keeps it raw, and escaped or raw text is
        // the same request.
        assert_eq!(
            one::<String>(r#"SELECT ledger.canonical_json('{"q": "\ud83d\ude00\u00e9"}')"#),
            r#"{"q":"😀é"}"#
        );
        assert_eq!(
            one::<String>(r#"SELECT ledger.request_hash('{"q": "\ud83d\ude00\u00e9"}')"#),
            one::<String>(r#"SELECT encode(sha256(convert_to('{"q":"😀é"}', 'UTF8')), 'hex')"#)
        );
        let claim = |args: &str| {
            one::<String>(&format!(
                "SELECT ledger.claim_tool_call('r', 'search', '{args}', tool_call_id => 'c')->>'outcome'"
            ))
        };
        assert_eq!(claim(r#"{"q": "\ud83d\ude00\u00e9"}"#), "claimed");
        assert_eq!(claim(r#"{"q": "😀é"}"#), "busy");
    }

    #[pg_test]
    fn hostile_object_of_100000_keys_is_hashed_and_summarised_as_truncated() {
        running_run("t-hostile-keys");
        let args = "(SELECT jsonb_object_agg('k' || i, i) FROM generate_series(1, 100000) i)";
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'search', {args}, tool_call_id => 'wide')"
        ))
        .0;
        assert_eq!(out["outcome"], "claimed");
        let stored = &out["tool_call"]["arguments"];
        assert_eq!(stored["truncated"], true);
        assert_eq!(
            stored["size_bytes"],
            one::<i32>(&format!(
                "SELECT octet_length(ledger.canonical_json({args}))"
            ))
        );
        let hash = one::<String>(&format!("SELECT ledger.request_hash({args})"));
        assert_eq!(stored["request_hash"], hash.as_str());
        assert_eq!(out["tool_call"]["request_hash"], hash.as_str());
        // Every top-level name, by code point (jsonb itself orders keys by length first).
        let names = one::<pgrx::JsonB>(
            "SELECT jsonb_agg('k' || i ORDER BY ('k' || i) COLLATE \"C\") FROM generate_series(1, 100000) i",
        )
        .0;
        assert_eq!(stored["argument_names"], names);
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.run_step_tool_calls WHERE tool_call_id = 'wide'"
            ),
            1
        );
    }

    /// A tool call record, claimed with attempt 1, and a pending approval (see `megabyte_fixture`).
    const REC: &str = "(SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c0')";
    const APR: &str = "(SELECT id FROM ledger.approval_requests WHERE status = 'pending' LIMIT 1)";
    /// The labels `hostile_indexed_labels_are_bounded_with_a_clear_error` covers.
    const INDEXED_LABELS: [&str; 5] = [
        "create_run.mode",
        "create_run.kind",
        "create_run.subject_kind",
        "create_run.subject_id",
        "create_run.subject_version_id",
    ];

    /// A running run `r` with a step `s`, a claimed call, two pending approvals (whose two
    /// outbox events `w` holds) and a queued task `t`.
    fn megabyte_fixture() {
        running_run("t-hostile-mb");
        Spi::run(
            "SELECT ledger.create_step('r', 'tool', step_id => 's'); \
             SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'c0'); \
             SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => 'a0'); \
             SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => 'a1'); \
             SELECT count(*) FROM ledger.claim_outbox_events('w', 2); \
             SELECT ledger.create_task('k', task_id => 't')",
        )
        .unwrap();
    }

    /// `function.argument` of a call in these lists.
    fn named(call: &str, argument: &str) -> String {
        let name = call
            .split("ledger.")
            .nth(1)
            .and_then(|rest| rest.split('(').next())
            .unwrap_or_else(|| panic!("no ledger function in {call}"));
        format!("{name}.{argument}")
    }

    #[pg_test]
    fn hostile_one_megabyte_text_arguments_are_refused_or_cut_by_what_they_are() {
        megabyte_fixture();
        let sql = |template: &str| {
            template
                .replace("$MB", MB)
                .replace("$REC", REC)
                .replace("$APR", APR)
        };
        let mut covered: Vec<String> = INDEXED_LABELS.iter().map(|s| s.to_string()).collect();

        // Ids and keys are refused, naming the argument, and write nothing.
        for (argument, call) in [
            (
                "lease_owner",
                "SELECT ledger.ack_outbox_events($MB, 'evt_1')",
            ),
            ("event_id", "SELECT ledger.ack_outbox_events('w', $MB)"),
            (
                "lease_owner",
                "SELECT ledger.ack_outbox_events($MB, ARRAY['evt_1'])",
            ),
            (
                "event_ids",
                "SELECT ledger.ack_outbox_events('w', ARRAY[$MB])",
            ),
            ("task_id", "SELECT ledger.add_task_checkpoint($MB, '{}')"),
            (
                "tool_call_record_id",
                "SELECT ledger.begin_tool_call($MB, 1)",
            ),
            (
                "lease_owner",
                "SELECT count(*) FROM ledger.claim_outbox_events($MB)",
            ),
            ("run_id", "SELECT ledger.claim_tool_call($MB, 'search')"),
            (
                "run_id",
                "SELECT ledger.find_tool_call($MB, 'search', tool_call_id => 'x')",
            ),
            (
                "tool_call_id",
                "SELECT ledger.find_tool_call('r', 'search', tool_call_id => $MB)",
            ),
            (
                "idempotency_key",
                "SELECT ledger.find_tool_call('r', 'search', idempotency_key => $MB)",
            ),
            (
                "run_id",
                "SELECT ledger.record_tool_call($MB, 'search', '{}', 'succeeded')",
            ),
            (
                "tool_call_id",
                "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => $MB)",
            ),
            (
                "idempotency_key",
                "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', idempotency_key => $MB)",
            ),
            (
                "tool_call_id",
                "SELECT ledger.claim_tool_call('r', 'search', tool_call_id => $MB)",
            ),
            (
                "idempotency_key",
                "SELECT ledger.claim_tool_call('r', 'search', idempotency_key => $MB)",
            ),
            (
                "step_id",
                "SELECT ledger.claim_tool_call('r', 'search', step_id => $MB)",
            ),
            (
                "lease_owner",
                "SELECT ledger.claim_tool_call('r', 'search', lease_owner => $MB)",
            ),
            (
                "run_id",
                "SELECT count(*) FROM ledger.claim_tool_calls($MB, '[]')",
            ),
            (
                "lease_owner",
                "SELECT count(*) FROM ledger.claim_tool_calls('r', '[]', lease_owner => $MB)",
            ),
            (
                "tool_call_record_id",
                "SELECT ledger.complete_tool_call($MB, 1, 'succeeded')",
            ),
            (
                "request_id",
                "SELECT ledger.create_run('chat', request_id => $MB)",
            ),
            (
                "parent_run_id",
                "SELECT ledger.create_run('chat', parent_run_id => $MB)",
            ),
            (
                "source_run_id",
                "SELECT ledger.create_run('chat', source_run_id => $MB)",
            ),
            ("run_id", "SELECT ledger.create_run('chat', run_id => $MB)"),
            ("run_id", "SELECT ledger.create_step($MB, 'llm')"),
            (
                "step_id",
                "SELECT ledger.create_step('r', 'llm', step_id => $MB)",
            ),
            ("run_id", "SELECT ledger.create_task('k', run_id => $MB)"),
            ("task_id", "SELECT ledger.create_task('k', task_id => $MB)"),
            ("run_id", "SELECT count(*) FROM ledger.events_since($MB)"),
            (
                "after_event_id",
                "SELECT count(*) FROM ledger.events_since('r', $MB)",
            ),
            ("artifact_id", "SELECT ledger.get_artifact($MB)"),
            (
                "tool_call_record_id",
                "SELECT ledger.heartbeat_tool_call($MB, 1)",
            ),
            (
                "lease_owner",
                "SELECT count(*) FROM ledger.nack_outbox_events($MB, 'evt_1', 'e')",
            ),
            (
                "event_id",
                "SELECT count(*) FROM ledger.nack_outbox_events('w', $MB, 'e')",
            ),
            (
                "lease_owner",
                "SELECT count(*) FROM ledger.nack_outbox_events($MB, ARRAY['evt_1'], 'e')",
            ),
            (
                "event_ids",
                "SELECT count(*) FROM ledger.nack_outbox_events('w', ARRAY[$MB], 'e')",
            ),
            ("run_id", "SELECT ledger.put_artifact($MB, '\\x00')"),
            (
                "step_id",
                "SELECT ledger.put_artifact('r', '\\x00', step_id => $MB)",
            ),
            ("run_id", "SELECT ledger.record_audit($MB, 'gw', 'allowed')"),
            (
                "step_id",
                "SELECT ledger.record_audit('r', 'gw', 'allowed', step_id => $MB)",
            ),
            ("run_id", "SELECT ledger.record_citation($MB, '{}')"),
            (
                "step_id",
                "SELECT ledger.record_citation('r', '{}', step_id => $MB)",
            ),
            ("run_id", "SELECT ledger.record_cost($MB, 'tokens', 1)"),
            (
                "step_id",
                "SELECT ledger.record_cost('r', 'tokens', 1, step_id => $MB)",
            ),
            (
                "source_ref",
                "SELECT ledger.record_cost('r', 'tokens', 1, source_ref => $MB)",
            ),
            ("run_id", "SELECT ledger.record_feedback($MB, 1)"),
            (
                "run_id",
                "SELECT ledger.record_response_event($MB, 'message')",
            ),
            (
                "step_id",
                "SELECT ledger.record_response_event('r', 'message', step_id => $MB)",
            ),
            ("task_id", "SELECT ledger.record_task_event($MB, 'note')"),
            (
                "run_id",
                "SELECT ledger.register_artifact($MB, 'k', 1, repeat('a', 64))",
            ),
            (
                "step_id",
                "SELECT ledger.register_artifact('r', 'k', 1, repeat('a', 64), step_id => $MB)",
            ),
            ("run_id", "SELECT ledger.replay_bundle($MB)"),
            ("event_id", "SELECT ledger.replay_outbox_event($MB)"),
            ("event_id", "SELECT ledger.replay_outbox_event($MB, 'ops')"),
            ("run_id", "SELECT ledger.replay_ready($MB)"),
            ("run_id", "SELECT ledger.otel_trace($MB)"),
            ("run_id", "SELECT ledger.replay_run($MB)"),
            ("task_id", "SELECT ledger.replay_task($MB)"),
            (
                "run_id",
                "SELECT ledger.request_tool_approval($MB, 'pay', '{}')",
            ),
            (
                "tool_call_id",
                "SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => $MB)",
            ),
            (
                "idempotency_key",
                "SELECT ledger.request_tool_approval('r', 'pay', '{}', idempotency_key => $MB)",
            ),
            (
                "approval_id",
                "SELECT ledger.resolve_approval($MB, 'approved')",
            ),
            (
                "tool_call_record_id",
                "SELECT ledger.resolve_tool_call($MB, 'retry')",
            ),
            ("run_id", "SELECT ledger.retry_run($MB)"),
            ("task_id", "SELECT ledger.retry_task($MB)"),
            ("run_id", "SELECT ledger.run_channel($MB)"),
            ("run_id", "SELECT ledger.run_evidence($MB)"),
            ("run_id", "SELECT ledger.run_inputs($MB)"),
            ("lease_owner", "SELECT * FROM ledger.claim_run($MB)"),
            ("run_id", "SELECT * FROM ledger.claim_run('w', $MB)"),
            ("run_id", "SELECT ledger.heartbeat_run($MB, 1)"),
            ("run_id", "SELECT ledger.release_run($MB, 1)"),
            ("run_id", "SELECT ledger.wait_run($MB, 1, now())"),
            ("run_id", "SELECT ledger.send_input($MB, 'k')"),
            ("run_id", "SELECT ledger.wait_for_input($MB, 1, 'k')"),
            ("run_id", "SELECT ledger.wait_for_children($MB, 1)"),
            (
                "schedule_id",
                "SELECT ledger.set_schedule($MB, '@daily', 'a')",
            ),
            ("schedule_id", "SELECT ledger.pause_schedule($MB)"),
            ("schedule_id", "SELECT ledger.drop_schedule($MB)"),
            (
                "tenant_id",
                "SELECT ledger.grant_scope('ledger_reader', $MB)",
            ),
            (
                "workspace_id",
                "SELECT ledger.grant_scope('ledger_reader', 't', $MB)",
            ),
            (
                "tenant_id",
                "SELECT ledger.revoke_scope('ledger_reader', $MB)",
            ),
            (
                "workspace_id",
                "SELECT ledger.revoke_scope('ledger_reader', 't', $MB)",
            ),
            ("tenant_id", "SELECT ledger.set_scope($MB, 'w')"),
            (
                "workspace_id",
                "SELECT ledger.set_scope('t-hostile-mb', $MB)",
            ),
            ("task_id", "SELECT ledger.set_task_snapshot($MB, '{}')"),
            ("run_id", "SELECT ledger.transition_run($MB, 'paused')"),
            (
                "error_step_id",
                "SELECT ledger.transition_run('r', 'paused', error_step_id => $MB)",
            ),
            ("step_id", "SELECT ledger.transition_step($MB, 'running')"),
            ("task_id", "SELECT ledger.transition_task($MB, 'running')"),
            (
                "run_id",
                "SELECT ledger.put_graph_checkpoint($MB, 't', '', 'c', '{}')",
            ),
            (
                "run_id",
                "SELECT ledger.set_budget('USD', 1, 'run', run_id => $MB)",
            ),
        ] {
            let before = rows();
            let e = assert_error(&sql(call), "22023", "ID_INVALID");
            assert_eq!(e.detail["argument"], argument, "{call}");
            assert_eq!(e.detail["length"], MB_CHARS, "{call}");
            assert_eq!(rows(), before, "{call}");
            covered.push(named(call, argument));
        }
        // Labels: at most 256 bytes, refused past it.
        for (argument, call) in [
            ("tool_ref", "SELECT ledger.claim_tool_call('r', $MB)"),
            (
                "tool_ref",
                "SELECT ledger.find_tool_call('r', $MB, tool_call_id => 'x')",
            ),
            (
                "tool_ref",
                "SELECT ledger.record_tool_call('r', $MB, '{}', 'succeeded')",
            ),
            (
                "service_name",
                "SELECT ledger.otel_trace('r', service_name => $MB)",
            ),
            (
                "modes",
                "SELECT * FROM ledger.claim_run('w', modes => ARRAY[$MB])",
            ),
            (
                "kinds",
                "SELECT * FROM ledger.claim_run('w', kinds => ARRAY[$MB])",
            ),
            ("role_name", "SELECT ledger.grant_scope($MB, 't')"),
            ("role_name", "SELECT ledger.revoke_scope($MB, 't')"),
            ("role_name", "SELECT ledger.unbind_scope($MB)"),
            (
                "user_id",
                "SELECT ledger.create_run('chat', user_id => $MB)",
            ),
            (
                "trace_id",
                "SELECT ledger.create_run('chat', trace_id => $MB)",
            ),
            ("step_type", "SELECT ledger.create_step('r', $MB)"),
            (
                "step_key",
                "SELECT ledger.create_step('r', 'llm', step_key => $MB)",
            ),
            (
                "node_id",
                "SELECT ledger.create_step('r', 'llm', node_id => $MB)",
            ),
            ("task_type", "SELECT ledger.create_task($MB)"),
            (
                "storage_key",
                "SELECT ledger.register_artifact('r', $MB, 1, repeat('a', 64))",
            ),
            (
                "mime",
                "SELECT ledger.put_artifact('r', '\\x00', mime => $MB)",
            ),
            (
                "gateway_type",
                "SELECT ledger.record_audit('r', $MB, 'allowed')",
            ),
            ("outcome", "SELECT ledger.record_audit('r', 'gw', $MB)"),
            (
                "actor",
                "SELECT ledger.record_audit('r', 'gw', 'allowed', actor => $MB)",
            ),
            ("billing_basis", "SELECT ledger.record_cost('r', $MB, 1)"),
            (
                "provider",
                "SELECT ledger.record_cost('r', 'tokens', 1, provider => $MB)",
            ),
            (
                "model_ref",
                "SELECT ledger.record_cost('r', 'tokens', 1, model_ref => $MB)",
            ),
            (
                "tool_ref",
                "SELECT ledger.record_cost('r', 'tokens', 1, tool_ref => $MB)",
            ),
            (
                "source_port",
                "SELECT ledger.record_cost('r', 'tokens', 1, source_port => $MB)",
            ),
            (
                "operation",
                "SELECT ledger.record_cost('r', 'tokens', 1, operation => $MB)",
            ),
            ("category", "SELECT ledger.record_feedback('r', 1, $MB)"),
            (
                "user_id",
                "SELECT ledger.record_feedback('r', 1, user_id => $MB)",
            ),
            (
                "event_type",
                "SELECT ledger.record_response_event('r', $MB)",
            ),
            ("event_type", "SELECT ledger.record_task_event('t', $MB)"),
            (
                "mime",
                "SELECT ledger.register_artifact('r', 'k', 1, repeat('a', 64), mime => $MB)",
            ),
            (
                "tool_ref",
                "SELECT ledger.request_tool_approval('r', $MB, '{}')",
            ),
            (
                "policy_ref",
                "SELECT ledger.request_tool_approval('r', 'pay', '{}', policy_ref => $MB)",
            ),
            (
                "actor",
                "SELECT ledger.resolve_approval($APR, 'approved', actor => $MB)",
            ),
            (
                "actor",
                "SELECT ledger.replay_outbox_event('obx_x', actor => $MB)",
            ),
            (
                "actor",
                "SELECT ledger.resolve_tool_call($REC, 'retry', actor => $MB)",
            ),
            (
                "error_code",
                "SELECT ledger.transition_run('r', 'failed', error_code => $MB)",
            ),
            (
                "error_code",
                "SELECT ledger.transition_step('s', 'running', error_code => $MB)",
            ),
            (
                "error_code",
                "SELECT ledger.transition_task('t', 'running', error_code => $MB)",
            ),
            (
                "thread_id",
                "SELECT ledger.put_graph_checkpoint('r', $MB, '', 'c', '{}')",
            ),
            (
                "checkpoint_ns",
                "SELECT ledger.put_graph_checkpoint('r', 't', $MB, 'c', '{}')",
            ),
            (
                "checkpoint_id",
                "SELECT ledger.put_graph_checkpoint('r', 't', '', $MB, '{}')",
            ),
            (
                "parent_checkpoint_id",
                "SELECT ledger.put_graph_checkpoint('r', 't', '', 'c', '{}', parent_checkpoint_id => $MB)",
            ),
            (
                "channels",
                "SELECT ledger.put_graph_checkpoint('r', 't', '', 'c', '{}', channels => ARRAY[$MB], versions => '{1}', blob_types => '{b}', blobs => ARRAY[NULL::bytea])",
            ),
            (
                "versions",
                "SELECT ledger.put_graph_checkpoint('r', 't', '', 'c', '{}', channels => '{a}', versions => ARRAY[$MB], blob_types => '{b}', blobs => ARRAY[NULL::bytea])",
            ),
            (
                "blob_types",
                "SELECT ledger.put_graph_checkpoint('r', 't', '', 'c', '{}', channels => '{a}', versions => '{1}', blob_types => ARRAY[$MB], blobs => ARRAY[NULL::bytea])",
            ),
            (
                "thread_id",
                "SELECT ledger.put_graph_checkpoint_writes($MB, '', 'c', 'k', '{0}', '{a}', '{b}', ARRAY[NULL::bytea])",
            ),
            (
                "checkpoint_ns",
                "SELECT ledger.put_graph_checkpoint_writes('t', $MB, 'c', 'k', '{0}', '{a}', '{b}', ARRAY[NULL::bytea])",
            ),
            (
                "checkpoint_id",
                "SELECT ledger.put_graph_checkpoint_writes('t', '', $MB, 'k', '{0}', '{a}', '{b}', ARRAY[NULL::bytea])",
            ),
            (
                "task_id",
                "SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', $MB, '{0}', '{a}', '{b}', ARRAY[NULL::bytea])",
            ),
            (
                "task_path",
                "SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', 'k', '{0}', '{a}', '{b}', ARRAY[NULL::bytea], task_path => $MB)",
            ),
            (
                "channels",
                "SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', 'k', '{0}', ARRAY[$MB], '{b}', ARRAY[NULL::bytea])",
            ),
            (
                "blob_types",
                "SELECT ledger.put_graph_checkpoint_writes('t', '', 'c', 'k', '{0}', '{a}', ARRAY[$MB], ARRAY[NULL::bytea])",
            ),
            (
                "thread_id",
                "SELECT count(*) FROM ledger.graph_checkpoint_tuples($MB)",
            ),
            (
                "checkpoint_ns",
                "SELECT count(*) FROM ledger.graph_checkpoint_tuples(checkpoint_ns => $MB)",
            ),
            (
                "checkpoint_id",
                "SELECT count(*) FROM ledger.graph_checkpoint_tuples(checkpoint_id => $MB)",
            ),
            (
                "before",
                "SELECT count(*) FROM ledger.graph_checkpoint_tuples(before => $MB)",
            ),
            (
                "source_thread_id",
                "SELECT ledger.copy_graph_thread($MB, 't')",
            ),
            (
                "target_thread_id",
                "SELECT ledger.copy_graph_thread('t', $MB)",
            ),
            (
                "thread_id",
                "SELECT ledger.delete_graph_thread($MB)",
            ),
            (
                "thread_ids",
                "SELECT ledger.prune_graph_threads(ARRAY[$MB])",
            ),
            (
                "run_ids",
                "SELECT ledger.delete_graph_checkpoints_for_runs(ARRAY[$MB])",
            ),
            (
                "concurrency_key",
                "SELECT ledger.create_run('chat', concurrency_key => $MB)",
            ),
            (
                "concurrency_key",
                "SELECT ledger.set_concurrency_limit($MB, 1)",
            ),
            (
                "concurrency_key",
                "SELECT ledger.set_rate_limit($MB, 1)",
            ),
            ("actor", "SELECT ledger.set_budget('USD', 1, actor => $MB)"),
            ("input_key", "SELECT ledger.send_input('r', $MB)"),
            ("sender", "SELECT ledger.send_input('r', 'k', sender => $MB)"),
            ("input_key", "SELECT ledger.wait_for_input('r', 1, $MB)"),
            ("mode", "SELECT ledger.set_schedule('s', '@daily', $MB)"),
            (
                "kind",
                "SELECT ledger.set_schedule('s', '@daily', 'a', kind => $MB)",
            ),
            (
                "time_zone",
                "SELECT ledger.set_schedule('s', '@daily', 'a', time_zone => $MB)",
            ),
            (
                "concurrency_key",
                "SELECT ledger.set_schedule('s', '@daily', 'a', concurrency_key => $MB)",
            ),
            (
                "actor",
                "SELECT ledger.set_schedule('s', '@daily', 'a', actor => $MB)",
            ),
            ("actor", "SELECT ledger.pause_schedule('s', actor => $MB)"),
            ("actor", "SELECT ledger.drop_schedule('s', actor => $MB)"),
        ] {
            let before = rows();
            let e = assert_error(&sql(call), "22023", "LABEL_INVALID");
            assert_eq!(e.detail["argument"], argument, "{call}");
            assert_eq!(e.detail["bytes"], MB_CHARS, "{call}");
            assert_eq!(rows(), before, "{call}");
            covered.push(named(call, argument));
        }
        // Closed vocabularies are refused with their own codes, echoing at most 256 characters.
        for (argument, code, call) in [
            (
                "outcome",
                "OUTCOME_UNKNOWN",
                "SELECT ledger.complete_tool_call($REC, 1, $MB)",
            ),
            (
                "outcome",
                "OUTCOME_UNKNOWN",
                "SELECT ledger.record_tool_call('r', 'search', '{}', $MB)",
            ),
            (
                "status",
                "STATUS_UNKNOWN",
                "SELECT ledger.create_step('r', 'llm', status => $MB)",
            ),
            (
                "artifact_type",
                "ARTIFACT_TYPE_UNKNOWN",
                "SELECT ledger.put_artifact('r', '\\x00', $MB)",
            ),
            (
                "currency",
                "CURRENCY_INVALID",
                "SELECT ledger.record_cost('r', 'tokens', 1, 1, $MB)",
            ),
            (
                "artifact_type",
                "ARTIFACT_TYPE_UNKNOWN",
                "SELECT ledger.register_artifact('r', 'k', 1, repeat('a', 64), $MB)",
            ),
            (
                "sha256",
                "SHA256_INVALID",
                "SELECT ledger.register_artifact('r', 'k', 1, $MB)",
            ),
            (
                "decision",
                "DECISION_UNKNOWN",
                "SELECT ledger.resolve_approval($APR, $MB)",
            ),
            (
                "decision",
                "DECISION_UNKNOWN",
                "SELECT ledger.resolve_tool_call($REC, $MB)",
            ),
            (
                "to_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_run('r', $MB)",
            ),
            (
                "expected_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_run('r', 'paused', expected_status => $MB)",
            ),
            (
                "to_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_step('s', $MB)",
            ),
            (
                "expected_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_step('s', 'running', expected_status => $MB)",
            ),
            (
                "to_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_task('t', $MB)",
            ),
            (
                "expected_status",
                "STATUS_UNKNOWN",
                "SELECT ledger.transition_task('t', 'running', expected_status => $MB)",
            ),
            (
                "strategy",
                "STRATEGY_UNKNOWN",
                "SELECT ledger.prune_graph_threads('{t}', $MB)",
            ),
            (
                "resource",
                "STATUS_UNKNOWN",
                "SELECT ledger.is_status($MB, 'queued')",
            ),
            ("unit", "UNIT_INVALID", "SELECT ledger.set_budget($MB, 1)"),
            (
                "level",
                "LEVEL_UNKNOWN",
                "SELECT ledger.set_budget('USD', 1, $MB)",
            ),
            (
                "period",
                "PERIOD_UNKNOWN",
                "SELECT ledger.set_budget('USD', 1, period => $MB)",
            ),
            (
                "cron",
                "CRON_INVALID",
                "SELECT ledger.set_schedule('s', $MB, 'a')",
            ),
            (
                "catch_up",
                "CATCH_UP_UNKNOWN",
                "SELECT ledger.set_schedule('s', '@daily', 'a', catch_up => $MB)",
            ),
        ] {
            let before = rows();
            let e = assert_error(&sql(call), "22023", code);
            assert!(e.detail.to_string().len() < 1024, "{call}: {}", e.detail);
            assert_eq!(rows(), before, "{call}");
            covered.push(named(call, argument));
        }

        // Free text is cut at 8192 characters: `call` writes it, `read` reads it back.
        let fresh = "(SELECT id FROM ledger.create_run('chat'))";
        for (argument, call, read) in [
            ("input_summary", "SELECT ledger.create_run('chat', run_id => 'f1', input_summary => $MB)", "SELECT input_summary FROM ledger.runs WHERE id = 'f1'"),
            ("input_summary", "SELECT ledger.create_step('r', 'llm', step_id => 'f2', input_summary => $MB)", "SELECT input_summary FROM ledger.run_steps WHERE id = 'f2'"),
            ("output_summary", "SELECT ledger.transition_run($FRESH, 'failed', output_summary => $MB)", "SELECT output_summary FROM ledger.runs WHERE status = 'failed' ORDER BY id DESC LIMIT 1"),
            // Failing without a message copies the (cut) summary.
            ("output_summary", "SELECT ledger.transition_run($FRESH, 'failed', output_summary => $MB)", "SELECT error_message FROM ledger.runs WHERE status = 'failed' ORDER BY id DESC LIMIT 1"),
            ("error_message", "SELECT ledger.transition_run($FRESH, 'failed', error_message => $MB)", "SELECT error_message FROM ledger.runs WHERE status = 'failed' ORDER BY id DESC LIMIT 1"),
            ("output_summary", "SELECT ledger.transition_step('s', 'running', output_summary => $MB)", "SELECT output_summary FROM ledger.run_steps WHERE id = 's'"),
            ("error_message", "SELECT ledger.transition_step('s', 'failed', error_message => $MB)", "SELECT error_message FROM ledger.run_steps WHERE id = 's'"),
            ("error_message", "SELECT ledger.transition_task('t', 'running'); SELECT ledger.transition_task('t', 'failed', error_message => $MB)", "SELECT error_message FROM ledger.tasks WHERE id = 't'"),
            ("error_message", "SELECT ledger.complete_tool_call($REC, 1, 'failed', error_message => $MB)", "SELECT error_message FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c0'"),
            ("error_message", "SELECT ledger.record_tool_call('r', 'search', '{}', 'failed', error_message => $MB, tool_call_id => 'f5')", "SELECT error_message FROM ledger.run_step_tool_calls WHERE tool_call_id = 'f5'"),
            ("error_message", "SELECT count(*) FROM ledger.nack_outbox_events('w', (SELECT min(id) FROM ledger.outbox WHERE status = 'processing'), $MB)", "SELECT error_message FROM ledger.outbox WHERE error_message IS NOT NULL ORDER BY id LIMIT 1"),
            ("error_message", "SELECT count(*) FROM ledger.nack_outbox_events('w', ARRAY(SELECT id FROM ledger.outbox WHERE status = 'processing'), $MB)", "SELECT error_message FROM ledger.outbox WHERE error_message IS NOT NULL ORDER BY id DESC LIMIT 1"),
            ("comment", "SELECT ledger.record_feedback('r', 1, comment => $MB)", "SELECT comment FROM ledger.run_feedback"),
            ("title", "SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => 'f3', title => $MB)", "SELECT title FROM ledger.approval_requests WHERE details->>'tool_call_id' = 'f3'"),
            ("note", "SELECT ledger.resolve_approval($APR, 'approved', note => $MB)", "SELECT note FROM ledger.approval_requests WHERE status = 'approved'"),
            ("note", "SELECT ledger.set_budget('USD', 1, note => $MB)", "SELECT payload->>'note' FROM ledger.audit_events WHERE gateway_type = 'budget.set'"),
        ] {
            Spi::run(&sql(call).replace("$FRESH", fresh)).unwrap_or_else(|e| panic!("{call}: {e}"));
            assert_eq!(one::<i32>(&format!("SELECT char_length(({read}))")), 8192, "{call}");
            covered.push(named(call, argument));
        }
        // resolve_tool_call's note: an in-doubt call, resolved.
        Spi::run(&sql(
            "SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'f4'); \
             SELECT ledger.complete_tool_call((SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'f4'), 1, 'unknown'); \
             SELECT ledger.resolve_tool_call((SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'f4'), 'failed', note => $MB)",
        ))
        .unwrap();
        assert_eq!(
            one::<i32>("SELECT char_length(metadata->>'note') FROM ledger.run_step_tool_calls WHERE tool_call_id = 'f4'"),
            8192
        );
        covered.push("resolve_tool_call.note".into());
        // replay_outbox_event's note: a failed event, replayed by a person.
        Spi::run(&sql(
            "UPDATE ledger.outbox SET status = 'failed' \
              WHERE id = (SELECT min(id) FROM ledger.outbox WHERE tenant_id = ledger.scope_tenant()); \
             SELECT ledger.replay_outbox_event( \
               (SELECT min(id) FROM ledger.outbox WHERE tenant_id = ledger.scope_tenant()), 'ops', note => $MB)",
        ))
        .unwrap();
        assert_eq!(
            one::<i32>(
                "SELECT char_length(payload->>'note') FROM ledger.audit_events \
                  WHERE tenant_id = ledger.scope_tenant() AND gateway_type = 'outbox.replay'"
            ),
            8192
        );
        covered.push("replay_outbox_event.note".into());

        // The budget helpers answer a question: a megabyte is no period, so it has no window.
        assert!(one::<bool>(&sql(
            "SELECT ledger.budget_window($MB, now()) = '-infinity' \
                AND ledger.budget_spent($MB, 5, '-infinity', now()) = 5"
        )));
        covered.push("budget_window.period".into());
        covered.push("budget_spent.period".into());

        // is_status answers a question: a megabyte is no status of anything.
        assert!(!one::<bool>(&sql("SELECT ledger.is_status('run', $MB)")));
        covered.push("is_status.status".into());

        // Every text argument of every function is in one of the lists above.
        covered.sort();
        covered.dedup();
        let catalog = one::<String>(
            "SELECT string_agg(DISTINCT (p.proname || '.' || u.n) COLLATE \"C\", ' ') \
               FROM pg_proc p \
              CROSS JOIN LATERAL unnest(p.proargnames[1:p.pronargs], p.proargtypes::oid[]) AS u(n, t) \
              WHERE p.pronamespace = 'ledger'::regnamespace AND u.t IN ('text'::regtype, 'text[]'::regtype)",
        );
        assert_eq!(covered.join(" "), catalog);
        // Every run's feed is still gapless.
        assert!(one::<bool>(
            "SELECT bool_and(n = m) FROM (SELECT count(*) AS n, max(seq) AS m FROM ledger.run_events \
              WHERE tenant_id = ledger.scope_tenant() GROUP BY run_id) f"
        ));
    }

    #[pg_test]
    fn hostile_indexed_labels_are_bounded_with_a_clear_error() {
        // mode, kind and the subject are indexed: past 256 bytes they are refused by the ledger
        // (not by the btree's 2704-byte row limit), and nothing is written.
        set_scope("t-hostile-mb-indexed", "w");
        for (argument, call) in [
            ("mode", "SELECT ledger.create_run($V)"),
            ("kind", "SELECT ledger.create_run('chat', kind => $V)"),
            (
                "subject_kind",
                "SELECT ledger.create_run('chat', subject_kind => $V)",
            ),
            (
                "subject_id",
                "SELECT ledger.create_run('chat', subject_id => $V)",
            ),
            (
                "subject_version_id",
                "SELECT ledger.create_run('chat', subject_version_id => $V)",
            ),
        ] {
            let e = assert_error(&call.replace("$V", MB), "22023", "LABEL_INVALID");
            assert_eq!(e.detail["argument"], argument);
            let fits = "repeat('é', 128)"; // 256 bytes
            let created = call.replacen("SELECT ", "", 1).replace("$V", fits);
            assert!(one::<bool>(&format!("SELECT ({created}).id IS NOT NULL")));
        }
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.runs WHERE tenant_id = 't-hostile-mb-indexed'"),
            5
        );
    }

    #[pg_test]
    fn hostile_printable_ids_are_kept_exactly_and_invisible_ones_refused() {
        set_scope("t-hostile-odd", "w");
        // A combining accent, emoji, other scripts: printable, so accepted as they are.
        for id in [
            "e\u{301}",
            "\u{1f600}".repeat(128).as_str(),
            "注文-42",
            "\u{1f469}\u{1f3fd}",
        ] {
            let created = one::<String>(&format!(
                "SELECT id FROM ledger.create_run('chat', run_id => '{id}')"
            ));
            assert_eq!(created, id);
            let out = one::<pgrx::JsonB>(&format!(
                "SELECT ledger.claim_tool_call('{id}', 'search', tool_call_id => '{id}')"
            ))
            .0;
            assert_eq!(out["outcome"], "claimed", "{id:?}");
            assert_eq!(
                out["tool_call"]["idempotency_key"],
                format!("tool:{id}:{id}")
            );
            assert!(
                one::<bool>(&format!(
                    "SELECT count(*) > 2 AND max(seq) = count(*) FROM ledger.run_events WHERE run_id = '{id}'"
                )),
                "{id:?}: a gapless feed"
            );
        }
        // Whitespace of any script, controls and invisible format characters (a right-to-left
        // mark and override, a zero-width joiner sequence, a byte order mark, a zero-width space)
        // are refused: characters are counted, not bytes.
        let before = rows();
        for id in [
            "run\u{200f}rtl",
            "run\u{202e}lave",
            "\u{1f469}\u{200d}\u{1f469}\u{200d}\u{1f467}",
            "\u{feff}bom",
            "zero\u{200b}width",
            "nb\u{a0}sp",
            "line\u{2028}sep",
            "ideo\u{3000}space",
            "ogham\u{1680}space",
            "next\u{85}line",
            "del\u{7f}",
            "\u{1f600}".repeat(129).as_str(),
        ] {
            let e = assert_error(
                &format!("SELECT ledger.create_run('chat', run_id => '{id}')"),
                "22023",
                "ID_INVALID",
            );
            assert_eq!(e.detail["length"], id.chars().count(), "{id:?}");
        }
        assert_eq!(rows(), before);
    }

    #[pg_test]
    fn hostile_longest_keys_of_four_byte_characters_fit_or_are_refused_cleanly() {
        // Distinct CJK Extension B characters (4 bytes each in UTF-8), in an order pglz cannot
        // compress.
        let wide = |n: usize, salt: usize| -> String {
            (0..n)
                .map(|i| char::from_u32(0x20000 + ((i + salt) * 7919 % 40000) as u32).unwrap())
                .collect()
        };
        set_scope(&wide(128, 1), &wide(128, 2));
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        // Keys are bounded in bytes too: 1024 bytes (256 such characters) fit one index row
        // after the widest scope; 257 are refused by the ledger, not by the btree.
        let key = wide(256, 3);
        assert_eq!(
            one::<String>(&format!(
                "SELECT ledger.claim_tool_call('r', 'search', idempotency_key => '{key}')->>'outcome'"
            )),
            "claimed"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT source_ref FROM ledger.record_cost('r', 'tokens', 1, source_ref => '{key}')"
            )),
            key
        );
        let long = wide(257, 4);
        assert_error(
            &format!("SELECT ledger.claim_tool_call('r', 'search', idempotency_key => '{long}')"),
            "22023",
            "ID_INVALID",
        );
        assert_error(
            &format!("SELECT ledger.record_cost('r', 'tokens', 1, source_ref => '{long}')"),
            "22023",
            "ID_INVALID",
        );
    }

    #[pg_test]
    fn hostile_odd_keys_are_kept_exactly_and_redacted_by_their_words() {
        running_run("t-hostile-odd-keys");
        let args = r#"{"\u200fpassword": "a", "api\u202ekey": "b", "🔑token": "c", "\u200bX-API-Key": "d",
                       "pass\u200dword": "e", "ｐａｓｓｗｏｒｄ": "f", "mot_de_passé": "g", "e\u0301": "h"}"#;
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'search', '{args}', tool_call_id => 'c')"
        ))
        .0;
        // Invisible characters vanish and full-width letters fold to ASCII, so every spelling of
        // a secret's name is one ("pass\u200dword" and "ｐａｓｓｗｏｒｄ" are "password");
        // "mot_de_passé" ends in a word of "pass" after another word.
        let want = serde_json::json!({
            "\u{200f}password": "[REDACTED]",
            "api\u{202e}key": "[REDACTED]",
            "🔑token": "[REDACTED]",
            "\u{200b}X-API-Key": "[REDACTED]",
            "pass\u{200d}word": "[REDACTED]",
            "ｐａｓｓｗｏｒｄ": "[REDACTED]",
            "mot_de_passé": "[REDACTED]",
            "e\u{301}": "h",
        });
        assert_eq!(out["tool_call"]["arguments"], want);
        assert_eq!(
            one::<pgrx::JsonB>(&format!("SELECT ledger.redact('{args}')")).0,
            want
        );
        assert_eq!(
            out["tool_call"]["request_hash"],
            one::<String>(&format!("SELECT ledger.request_hash('{args}')")).as_str()
        );
    }
}
