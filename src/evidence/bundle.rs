//! The evidence of a run (replay #1): `replay_bundle`, `run_evidence` and
//! `replay_ready`. Pure reads (read-only SPI): they work for `ledger_reader` and on a hot standby.
//! SQL maps rows to JSON and sums money as numeric; Rust assembles and judges.

use crate::budgets;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::jsonb::Jsonb;
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::required_id;
use ledger_model::evidence::{self, AuditFact, CitationFact, ReusedCall, RunFacts, StepFact};
use ledger_model::json;
use pgrx::prelude::*;

/// The one value of a read-only query over the run (`$1`, `$2` scope, `$3` run id).
fn value<T: FromDatum + IntoDatum>(scope: &Scope, run_id: &str, query: &str) -> Result<T> {
    db::select_one(query, &scope.args([run_id.into()]), |r| db::req::<T>(r, 1))?
        .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))
}

/// One JSON value computed by a read-only query over the run.
fn fragment(scope: &Scope, run_id: &str, query: &str) -> Result<String> {
    Ok(value::<Jsonb>(scope, run_id, query)?.0)
}

/// A JSON array of `item` over `from`, in `order`, complete (never capped). Built as json text
/// (json_agg), not jsonb: the bundle is parsed into jsonb once, at the end, and PostgreSQL's
/// jsonb construction grows faster than the document (jsonb_agg of 10,000 steps took 12.5 times
/// as long as of 1,000; json_agg 10 times).
fn list(scope: &Scope, run_id: &str, item: &str, from: &str, order: &str) -> Result<String> {
    value::<String>(
        scope,
        run_id,
        &format!(
            "SELECT coalesce(json_agg({item} ORDER BY {order}), '[]')::text FROM {from} \
              WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3"
        ),
    )
}

const SCOPED: &str = "to_jsonb(x) - 'tenant_id' - 'workspace_id'";
const COST_ENTRY: &str = "jsonb_build_object(\
        'cost_id', x.id, 'run_id', x.run_id, 'step_id', x.step_id, 'currency', x.currency, \
        'amount', x.amount::text, 'pricing_snapshot', x.pricing_snapshot, \
        'billing_basis', x.billing_basis, 'billed_quantity', x.billed_quantity::text, \
        'provider', x.provider, 'model_ref', x.model_ref, 'tool_ref', x.tool_ref, \
        'source_port', x.source_port, 'operation', x.operation, 'source_ref', x.source_ref, \
        'created_at', x.created_at) || x.usage";

fn trace_spec(scope: &Scope, run_id: &str) -> Result<String> {
    let run = fragment(
        scope,
        run_id,
        include_str!("../../sql/queries/trace_spec_run.sql"),
    )?;
    let steps = list(
        scope,
        run_id,
        "jsonb_build_object(\
             'step_id', x.id, 'node_id', x.node_id, 'step_type', x.step_type, 'status', x.status, \
             'input_summary', x.input_summary, 'output_summary', x.output_summary, \
             'started_at', x.started_at, 'ended_at', x.ended_at, 'metrics', x.metrics, \
             'error', CASE WHEN x.error_code IS NOT NULL OR x.error_message IS NOT NULL \
                                OR x.error_details IS NOT NULL \
                           THEN jsonb_build_object('code', x.error_code, \
                                                   'message', x.error_message, \
                                                   'details', x.error_details) END)",
        "ledger.run_steps x",
        "x.step_no",
    )?;
    let artifacts = list(
        scope,
        run_id,
        "jsonb_build_object(\
             'artifact_id', x.id, 'type', x.artifact_type, 'storage_key', x.storage_key, \
             'step_id', x.step_id, 'mime', x.mime, 'size_bytes', x.size_bytes, 'sha256', x.sha256, \
             'meta', x.meta)",
        "ledger.run_artifacts x",
        "x.created_at, x.id",
    )?;
    let usage = fragment(
        scope,
        run_id,
        include_str!("../../sql/queries/trace_spec_usage.sql"),
    )?;
    // Money: summed as numeric per currency, rendered as decimal strings, never mixed.
    let charges = fragment(
        scope,
        run_id,
        include_str!("../../sql/queries/trace_spec_charges.sql"),
    )?;
    let entries = list(
        scope,
        run_id,
        COST_ENTRY,
        "ledger.run_cost_entries x",
        "x.created_at, x.id",
    )?;
    Ok(format!(
        r#"{{"run":{run},"steps":{steps},"artifacts":{artifacts},"usage_summary":{usage},"charge_summary":{charges},"entries":{entries}}}"#
    ))
}

/// The finished calls of other runs whose results the run reused (a retry or replay passing its
/// source's keys): each `tool_call.replayed` event of its feed, the first per record, in seq order.
const REUSED_CALLS: &str = "SELECT DISTINCT ON (payload->>'tool_call_record_id') \
            seq, payload->>'tool_call_record_id' AS record_id, payload->>'source_run_id' AS source_run_id \
       FROM ledger.run_events \
      WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND event_type = 'tool_call.replayed' \
      ORDER BY payload->>'tool_call_record_id', seq";

/// Everything about a run, in one read: `run, steps, artifacts, costs, approvals, feedback, mailbox,
/// tool_calls, reused_tool_calls, budgets, budget_events, trace_spec`. Lists are complete and ordered (steps by
/// creation, reused calls by first reuse, the rest by created_at, id).
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_bundle(run_id: Option<&str>) -> std::result::Result<Jsonb, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    rows::run_exists(&scope, run_id)?;
    let run = fragment(
        &scope,
        run_id,
        &format!(
            "SELECT {SCOPED} FROM ledger.runs x \
              WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.id = $3"
        ),
    )?;
    let steps = list(&scope, run_id, SCOPED, "ledger.run_steps x", "x.step_no")?;
    let artifacts = list(
        &scope,
        run_id,
        SCOPED,
        "ledger.run_artifacts x",
        "x.created_at, x.id",
    )?;
    let costs = list(
        &scope,
        run_id,
        &format!(
            "{SCOPED} || jsonb_build_object(\
                 'amount', x.amount::text, 'billed_quantity', x.billed_quantity::text)"
        ),
        "ledger.run_cost_entries x",
        "x.created_at, x.id",
    )?;
    let approvals = list(
        &scope,
        run_id,
        SCOPED,
        "ledger.approval_requests x",
        "x.created_at, x.id",
    )?;
    let feedback = list(
        &scope,
        run_id,
        SCOPED,
        "ledger.run_feedback x",
        "x.created_at, x.id",
    )?;
    // What people and systems sent the run, and the inputs it waited for (the hash of an input
    // as sent is the ledger's own check, not evidence).
    let mailbox = list(
        &scope,
        run_id,
        &format!("{SCOPED} - 'payload_sha256'"),
        "ledger.run_mailbox x",
        "x.created_at, x.id",
    )?;
    let tool_calls = list(
        &scope,
        run_id,
        SCOPED,
        "ledger.run_step_tool_calls x",
        "x.created_at, x.id",
    )?;
    // Each with the source's record as it is now (null once the source run was purged).
    let reused = value::<String>(
        &scope,
        run_id,
        &format!(
            "SELECT coalesce(json_agg(json_build_object(\
                 'seq', r.seq, 'tool_call_record_id', r.record_id, 'source_run_id', r.source_run_id, \
                 'tool_call', (SELECT {SCOPED} FROM ledger.run_step_tool_calls x \
                                WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.id = r.record_id)) \
                 ORDER BY r.seq), '[]')::text FROM ({REUSED_CALLS}) r"
        ),
    )?;
    let trace = trace_spec(&scope, run_id)?;
    // The budgets that apply to the run as they stand, and what they did to it.
    let budgets = value::<String>(&scope, run_id, &budgets::applying_json())?;
    let budget_events = value::<String>(
        &scope,
        run_id,
        "SELECT coalesce(json_agg(jsonb_build_object('seq', e.seq, 'event_type', e.event_type, \
                 'created_at', e.created_at) || e.payload ORDER BY e.seq), '[]')::text \
           FROM ledger.run_events e WHERE e.tenant_id = $1 AND e.workspace_id = $2 \
            AND e.run_id = $3 AND e.event_type IN ('budget.warning', 'budget.exhausted')",
    )?;
    Ok(Jsonb(format!(
        r#"{{"run":{run},"steps":{steps},"artifacts":{artifacts},"costs":{costs},"approvals":{approvals},"feedback":{feedback},"mailbox":{mailbox},"tool_calls":{tool_calls},"reused_tool_calls":{reused},"budgets":{budgets},"budget_events":{budget_events},"trace_spec":{trace}}}"#
    )))
}

/// Parses stored JSON for the evidence rules; a value the ledger cannot walk (too deep) counts
/// as carrying no evidence rather than failing the whole report.
fn parsed(j: Option<Jsonb>) -> serde_json::Value {
    j.and_then(|j| json::parse(j.as_str()).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The ids of the rows of `table` whose `column` is the run, oldest first.
fn ids_of(scope: &Scope, run_id: &str, table: &str, column: &str) -> Result<Vec<String>> {
    db::select(
        &format!(
            "SELECT id FROM ledger.{table} \
              WHERE tenant_id = $1 AND workspace_id = $2 AND {column} = $3 ORDER BY created_at, id"
        ),
        &scope.args([run_id.into()]),
        |r| db::req(r, 1),
    )
}

/// What the evidence rules look at.
fn facts(scope: &Scope, run_id: &str) -> Result<RunFacts> {
    let args = || scope.args([run_id.into()]);
    let mut facts = db::select_one(
        include_str!("../../sql/queries/run_facts.sql"),
        &args(),
        |r| {
            Ok(RunFacts {
                run_id: db::req(r, 1)?,
                tenant_id: db::req(r, 2)?,
                workspace_id: db::req(r, 3)?,
                user_id: db::opt(r, 4)?,
                mode: db::req(r, 5)?,
                kind: db::req(r, 6)?,
                subject_kind: db::req(r, 7)?,
                subject_id: db::opt(r, 8)?,
                subject_version_id: db::opt(r, 9)?,
                inputs_recoverable: db::req(r, 10)?,
                ..RunFacts::default()
            })
        },
    )?
    .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))?;
    facts.steps = db::select(
        "SELECT id, step_type, metrics FROM ledger.run_steps \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 ORDER BY step_no",
        &args(),
        |r| {
            Ok(StepFact {
                id: db::req(r, 1)?,
                step_type: db::req(r, 2)?,
                metrics: parsed(db::opt(r, 3)?),
            })
        },
    )?;
    facts.audits = db::select(
        "SELECT id, step_id, payload FROM ledger.audit_events \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 ORDER BY created_at, id",
        &args(),
        |r| {
            Ok(AuditFact {
                id: db::req(r, 1)?,
                step_id: db::opt(r, 2)?,
                payload: parsed(db::opt(r, 3)?),
            })
        },
    )?;
    facts.citations = db::select(
        "SELECT id, citation FROM ledger.citations \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 ORDER BY created_at, id",
        &args(),
        |r| {
            Ok(CitationFact {
                id: db::req(r, 1)?,
                citation: parsed(db::opt(r, 2)?),
            })
        },
    )?;
    facts.cost_ids = ids_of(scope, run_id, "run_cost_entries", "run_id")?;
    facts.tool_call_ids = ids_of(scope, run_id, "run_step_tool_calls", "run_id")?;
    facts.reused_tool_calls = db::select(
        &format!("SELECT record_id, source_run_id FROM ({REUSED_CALLS}) r ORDER BY seq"),
        &args(),
        |r| {
            Ok(ReusedCall {
                tool_call_record_id: db::req(r, 1)?,
                source_run_id: db::req(r, 2)?,
            })
        },
    )?;
    facts.response_event_ids = ids_of(scope, run_id, "response_events", "run_id")?;
    facts.child_run_ids = ids_of(scope, run_id, "runs", "parent_run_id")?;
    Ok(facts)
}

/// The thirteen governance evidence items of a run, in order.
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn run_evidence(run_id: Option<&str>) -> std::result::Result<Jsonb, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    rows::run_exists(&scope, run_id)?;
    let items: Vec<serde_json::Value> = evidence::evidence(&facts(&scope, run_id)?)
        .iter()
        .map(|i| i.to_json())
        .collect();
    Ok(Jsonb::from(&serde_json::Value::Array(items)))
}

/// `{"status": "pass"|"fail", "missing": [...]}`: can this run be replayed from the ledger alone?
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_ready(run_id: Option<&str>) -> std::result::Result<Jsonb, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    rows::run_exists(&scope, run_id)?;
    Ok(Jsonb::from(&evidence::replay_ready(&facts(
        &scope, run_id,
    )?)))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
pub(crate) mod tests {
    use crate::testing::{assert_error, error_of, one, set_scope};
    use pgrx::prelude::*;
    use serde_json::{json, Value};

    fn bundle(run: &str) -> Value {
        one::<pgrx::JsonB>(&format!("SELECT ledger.replay_bundle('{run}')")).0
    }

    fn ready(run: &str) -> Value {
        one::<pgrx::JsonB>(&format!("SELECT ledger.replay_ready('{run}')")).0
    }

    fn run_sql(sql: &str) {
        Spi::run(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// A chat turn with everything: llm costs in two currencies, a tool call with an offloaded
    /// result and its audit, retrieval with citations, an approval, feedback, response events.
    pub(crate) fn realistic_run() {
        run_sql("SELECT ledger.create_run('chat', '{\"question\": \"Where is order 1042?\"}', run_id => 'turn', user_id => 'u1', subject_id => 'bot-1')");
        run_sql("SELECT ledger.transition_run('turn', 'running')");
        run_sql("SELECT ledger.create_step('turn', 'llm', step_key => 'plan', step_id => 'plan')");
        run_sql("SELECT ledger.transition_step('plan', 'running')");
        run_sql("SELECT ledger.record_cost('turn', 'tokens', 1200, 0.10, 'USD', step_id => 'plan', usage => '{\"prompt_tokens\": 1000, \"completion_tokens\": 200, \"latency_ms\": 800, \"request_count\": 1}', provider => 'openai', model_ref => 'gpt-x')");
        run_sql("SELECT ledger.record_cost('turn', 'tokens', 300, 0.0125, 'USD', step_id => 'plan', usage => '{\"prompt_tokens\": 250, \"completion_tokens\": 50, \"cache_read_tokens\": 100, \"reasoning_tokens\": 20, \"latency_ms\": 300, \"request_count\": 1}')");
        run_sql("SELECT ledger.record_cost('turn', 'requests', 1, 0.5, 'EUR', usage => '{\"request_count\": 1}')");
        run_sql("SELECT ledger.transition_step('plan', 'succeeded', metrics => '{\"model_ref\": \"gpt-x\"}')");
        run_sql("SELECT ledger.create_step('turn', 'retrieval', step_key => 'search', step_id => 'search', status => 'running')");
        run_sql("SELECT ledger.record_citation('turn', '{\"chunk_id\": \"ch-2\", \"document_id\": \"faq\"}', step_id => 'search')");
        run_sql("SELECT ledger.record_citation('turn', '{\"chunk_id\": \"ch-1\", \"document_id\": \"faq\"}', step_id => 'search')");
        run_sql("SELECT ledger.record_cost('turn', 'vectors', 2, usage => '{\"vector_count\": 2, \"embedding_count\": 1}', step_id => 'search')");
        run_sql("SELECT ledger.transition_step('search', 'succeeded')");
        let tc = one::<String>("SELECT ledger.claim_tool_call('turn', 'crm.history', '{\"order\": 1042}', tool_call_id => 'hist')->'tool_call'->>'id'");
        run_sql(&format!("SELECT ledger.begin_tool_call('{tc}', 1)"));
        run_sql(&format!("SELECT ledger.complete_tool_call('{tc}', 1, 'succeeded', jsonb_build_object('log', repeat('x', 9000)))"));
        let step = one::<String>(&format!(
            "SELECT step_id FROM ledger.run_step_tool_calls WHERE id = '{tc}'"
        ));
        run_sql(&format!(
            "SELECT ledger.record_audit('turn', 'gateway.request', 'allowed', '{{\"egress_decision\": \"allow\", \"request\": {{\"url\": \"https://crm.example.com\"}}}}', step_id => '{step}')"
        ));
        run_sql("SELECT ledger.request_tool_approval('turn', 'refund', '{\"amount\": 5}', tool_call_id => 'refund', title => 'Refund 5 EUR')");
        run_sql("SELECT ledger.record_response_event('turn', 'message', '{\"text\": \"It ships tomorrow.\"}')");
        run_sql("SELECT ledger.record_feedback('turn', 1, comment => 'helpful', user_id => 'u1')");
    }

    #[pg_test]
    fn the_bundle_of_a_realistic_run_is_complete_ordered_and_exact() {
        set_scope("t-bundle", "w");
        realistic_run();
        let b = bundle("turn");
        let mut keys: Vec<&str> = b.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "approvals",
                "artifacts",
                "budget_events",
                "budgets",
                "costs",
                "feedback",
                "mailbox",
                "reused_tool_calls",
                "run",
                "steps",
                "tool_calls",
                "trace_spec"
            ]
        );
        let calls: Vec<&str> = b["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["tool_call_id"].as_str().unwrap())
            .collect();
        assert_eq!(calls, ["hist", "refund"]);
        assert_eq!(b["reused_tool_calls"], json!([]));
        assert_eq!(b["run"]["id"], "turn");
        assert_eq!(
            b["run"]["inputs"],
            json!({"question": "Where is order 1042?"})
        );
        let step_keys: Vec<&str> = b["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["step_key"].as_str().unwrap())
            .collect();
        assert_eq!(step_keys, ["plan", "search", "hist", "refund"]);
        assert_eq!(b["artifacts"].as_array().unwrap().len(), 1);
        assert_eq!(b["artifacts"][0]["meta"]["kind"], "tool_result");
        let amounts: Vec<Value> = b["costs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["amount"].clone())
            .collect();
        assert_eq!(
            amounts,
            [json!("0.10"), json!("0.0125"), json!("0.5"), Value::Null]
        );
        assert_eq!(b["costs"][0]["billed_quantity"], "1200");
        assert_eq!(b["approvals"].as_array().unwrap().len(), 1);
        assert_eq!(
            (
                b["approvals"][0]["status"].as_str(),
                b["approvals"][0]["title"].as_str()
            ),
            (Some("pending"), Some("Refund 5 EUR"))
        );
        assert_eq!(b["feedback"][0]["comment"], "helpful");

        let t = &b["trace_spec"];
        assert_eq!(t["run"].as_object().unwrap().len(), 22);
        assert_eq!(t["run"]["run_id"], "turn");
        assert_eq!(t["steps"].as_array().unwrap().len(), 4);
        assert_eq!(t["steps"][0]["metrics"], json!({"model_ref": "gpt-x"}));
        assert_eq!(t["steps"][0]["error"], Value::Null);
        assert_eq!(t["artifacts"][0]["type"], "json");
        assert_eq!(
            t["usage_summary"],
            json!({"tokens_prompt": 1250, "tokens_completion": 250, "embedding_count": 1, "rerank_count": 0,
                   "ms_total": 1100, "storage_bytes": 0, "request_count": 3, "vector_count": 2})
        );
        // Decimal sums per currency, never mixed, never floats.
        assert_eq!(
            t["charge_summary"],
            json!({"entry_count": 3, "amounts": {"EUR": "0.5", "USD": "0.1125"}})
        );
        let entries = t["entries"].as_array().unwrap();
        assert_eq!(entries.len(), 4);
        assert_eq!(
            (
                entries[1]["amount"].as_str(),
                entries[1]["cache_read_tokens"].as_i64()
            ),
            (Some("0.0125"), Some(100))
        );
        assert_eq!(entries[3]["vector_count"], 2);
        assert!(entries
            .iter()
            .all(|e| e["cost_id"].as_str().unwrap().starts_with("cost_")));

        // The run is deficient until it has all its evidence.
        assert_eq!(ready("turn"), json!({"status": "pass", "missing": []}));
        let ev = one::<pgrx::JsonB>("SELECT ledger.run_evidence('turn')").0;
        let statuses: Vec<String> = ev
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                format!(
                    "{}:{}",
                    i["key"].as_str().unwrap(),
                    i["status"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(
            statuses,
            [
                "actor_scope:pass",
                "subject_version:not_applicable",
                "capability_binding:pass",
                "permission_scope:warning",
                "secret_boundary:warning",
                "egress_policy:pass",
                "audit_record:pass",
                "cost_attribution:pass",
                "trace_timeline:pass",
                "tool_call:pass",
                "knowledge_citation:pass",
                "child_workflow:not_applicable",
                "replay_ready:pass"
            ]
        );
    }

    #[pg_test]
    fn the_bundle_lists_every_approval() {
        set_scope("t-bundle-1000", "w");
        run_sql("SELECT ledger.create_run('agent', run_id => 'r')");
        run_sql("SELECT ledger.request_tool_approval('r', 'send', jsonb_build_object('n', i), tool_call_id => 'a' || i) FROM generate_series(1, 1000) i");
        let b = bundle("r");
        let approvals = b["approvals"].as_array().unwrap();
        assert_eq!(approvals.len(), 1000);
        let first_and_last = (
            approvals[0]["details"]["tool_call_id"].as_str(),
            approvals[999]["details"]["tool_call_id"].as_str(),
        );
        assert_eq!(first_and_last, (Some("a1"), Some("a1000")));
        assert_eq!(b["steps"].as_array().unwrap().len(), 1000);
    }

    #[pg_test]
    fn replay_ready_fails_deficient_runs_with_what_is_missing() {
        set_scope("t-ready", "w");
        let cases = [
            // (mode, step type, extra SQL, expected missing)
            ("workflow", None, "", vec!["steps"]),
            ("chat", Some("other"), "", vec!["response_events"]),
            ("workflow", Some("llm"), "", vec!["costs"]),
            ("workflow", Some("retrieval"), "", vec!["costs", "citations"]),
            ("workflow", Some("tool"), "", vec!["tool_calls", "audits"]),
            ("workflow", Some("other"), "", vec![]),
            ("workflow", Some("other"), "SELECT ledger.create_run('workflow', input_summary => 'only a summary', run_id => 'RUN_summary')", vec![]),
        ];
        for (i, (mode, step, extra, missing)) in cases.into_iter().enumerate() {
            let run = format!("r{i}");
            run_sql(&format!(
                "SELECT ledger.create_run('{mode}', run_id => '{run}')"
            ));
            if let Some(t) = step {
                run_sql(&format!("SELECT ledger.create_step('{run}', '{t}')"));
            }
            if !extra.is_empty() {
                run_sql(extra);
            }
            let status = if missing.is_empty() { "pass" } else { "fail" };
            assert_eq!(
                ready(&run),
                json!({"status": status, "missing": missing}),
                "{mode} {step:?}"
            );
        }
        // Inputs known only by their summary cannot be replayed.
        run_sql("SELECT ledger.create_step('RUN_summary', 'other')");
        assert_eq!(
            ready("RUN_summary"),
            json!({"status": "fail", "missing": ["inputs"]})
        );
        // A tool run passes once it has its call, whose claim is its own audit record.
        run_sql("SELECT ledger.transition_run('r4', 'running')");
        run_sql("SELECT ledger.claim_tool_call('r4', 'x', '{}')");
        assert_eq!(ready("r4"), json!({"status": "pass", "missing": []}));
    }

    /// A chat turn as a worker following docs/workers.md runs it, on the queued run `run`: an llm
    /// step with its cost, a tool call through the executor protocol, what the user was shown.
    /// No record_audit.
    fn protocol_run(run: &str) {
        run_sql(&format!("SELECT ledger.transition_run('{run}', 'running')"));
        let llm = one::<String>(&format!(
            "SELECT id FROM ledger.create_step('{run}', 'llm', step_key => 'plan', status => 'running')"
        ));
        run_sql(&format!(
            "SELECT ledger.record_cost('{run}', 'tokens', 120, 0.01, 'USD', step_id => '{llm}')"
        ));
        run_sql(&format!(
            "SELECT ledger.transition_step('{llm}', 'succeeded')"
        ));
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('{run}', 'crm.lookup', '{{\"order\": 1042}}', idempotency_key => 'order-1042:lookup')"
        ))
        .0;
        if out["outcome"] == "claimed" {
            let tc = out["tool_call"]["id"].as_str().unwrap();
            run_sql(&format!("SELECT ledger.begin_tool_call('{tc}', 1)"));
            run_sql(&format!(
                "SELECT ledger.complete_tool_call('{tc}', 1, 'succeeded', '{{\"eta\": 2}}')"
            ));
        } else {
            assert_eq!(out["outcome"], "replayed");
        }
        run_sql(&format!("SELECT ledger.record_response_event('{run}', 'message', '{{\"text\": \"Tomorrow.\"}}')"));
        run_sql(&format!(
            "SELECT ledger.transition_run('{run}', 'succeeded')"
        ));
    }

    const CHAT_TURN: &str = "SELECT ledger.create_run('chat', '{\"q\": \"order 1042?\"}', run_id => 'r', user_id => 'u1')";

    fn item(run: &str, key: &str) -> Value {
        let ev = one::<pgrx::JsonB>(&format!("SELECT ledger.run_evidence('{run}')")).0;
        ev.as_array()
            .unwrap()
            .iter()
            .find(|i| i["key"] == key)
            .unwrap()
            .clone()
    }

    #[pg_test]
    fn a_run_that_followed_the_executor_protocol_is_replay_ready_without_record_audit() {
        set_scope("t-ready-protocol", "w");
        run_sql(CHAT_TURN);
        protocol_run("r");
        assert_eq!(ready("r"), json!({"status": "pass", "missing": []}));
        assert_eq!(item("r", "audit_record")["status"], "pass");
        assert_eq!(
            one::<String>("SELECT string_agg(gateway_type, ',' ORDER BY created_at, id) FROM ledger.audit_events"),
            "tool_call.claim,tool_call.complete"
        );
    }

    #[pg_test]
    fn a_rerun_shows_the_tool_results_it_reused_from_its_source() {
        set_scope("t-ready-rerun", "w");
        run_sql(CHAT_TURN);
        protocol_run("r");
        let source = one::<String>("SELECT id FROM ledger.run_step_tool_calls");
        let again = one::<String>("SELECT id FROM ledger.replay_run('r')");
        protocol_run(&again);
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1,
            "executed once"
        );
        let tool_call = item(&again, "tool_call");
        assert_eq!(tool_call["status"], "pass");
        assert_eq!(tool_call["evidence_refs"], json!([format!("r:{source}")]));
        assert_eq!(
            tool_call["summary"],
            "1 tool call result(s) were reused from the source run."
        );
        assert_eq!(ready(&again), json!({"status": "pass", "missing": []}));
        let b = bundle(&again);
        assert_eq!(b["tool_calls"], json!([]));
        let reused = b["reused_tool_calls"].as_array().unwrap();
        assert_eq!(reused.len(), 1);
        assert_eq!(
            (
                reused[0]["tool_call_record_id"].as_str(),
                reused[0]["source_run_id"].as_str(),
                reused[0]["tool_call"]["status"].as_str(),
                reused[0]["tool_call"]["result"]["eta"].as_i64()
            ),
            (Some(source.as_str()), Some("r"), Some("succeeded"), Some(2))
        );
        // The source's own evidence is unchanged.
        assert_eq!(item("r", "tool_call")["evidence_refs"], json!([source]));
    }

    #[pg_test]
    fn replay_ready_fails_a_run_whose_stored_inputs_no_longer_read_back() {
        set_scope("t-ready-inputs", "w");
        run_sql("SELECT ledger.create_run('workflow', jsonb_build_object('doc', repeat('x', 20000)), run_id => 'r')");
        run_sql("SELECT ledger.create_step('r', 'other')");
        assert_eq!(ready("r"), json!({"status": "pass", "missing": []}));
        // Same size, other bytes: the blob no longer matches its sha256.
        run_sql("UPDATE ledger.blobs SET content = overlay(content PLACING '\\x00'::bytea FROM 10) WHERE tenant_id = 't-ready-inputs'");
        assert_error(
            "SELECT ledger.run_inputs('r')",
            "XX001",
            "BLOB_HASH_MISMATCH",
        );
        assert_eq!(ready("r"), json!({"status": "fail", "missing": ["inputs"]}));
        assert_eq!(item("r", "replay_ready")["missing"], json!(["inputs"]));
    }

    #[pg_test]
    fn another_workspace_cannot_read_the_bundle_and_readers_cannot_write() {
        set_scope("t-bundle-rls", "w");
        run_sql("SELECT ledger.create_run('chat', run_id => 'r')");
        run_sql("SET LOCAL ROLE ledger_reader");
        assert_eq!(bundle("r")["run"]["id"], "r");
        assert_eq!(ready("r")["status"], "fail");
        assert_eq!(
            error_of("SELECT ledger.record_cost('r', 'tokens', 1)").sqlstate,
            "42501"
        );
        assert_eq!(
            error_of("SELECT ledger.record_feedback('r', 1)").sqlstate,
            "42501"
        );
        set_scope("t-bundle-rls", "other");
        for f in ["replay_bundle", "run_evidence", "replay_ready"] {
            assert_error(&format!("SELECT ledger.{f}('r')"), "P0002", "RUN_NOT_FOUND");
        }
    }
}
