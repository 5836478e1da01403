//! A run exported as an OpenTelemetry trace (OTLP/JSON): one read-only query gathers the facts,
//! the pure core (`ledger_model::evidence::otel`) shapes the spans.

use crate::db;
use crate::error::{Code, LedgerError, SqlError};
use crate::jsonb::Jsonb;
use crate::rows;
use crate::scope;
use ledger_model::args::{required_id, required_label};
use ledger_model::evidence::otel::{self, Facts};
use pgrx::prelude::*;

/// The run as an OTLP/JSON `ExportTraceServiceRequest` (GenAI semantic conventions), ready to
/// POST to an OTLP/HTTP collector's `/v1/traces`.
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn otel_trace(
    run_id: Option<&str>,
    service_name: default!(Option<&str>, "'ledger'"),
) -> std::result::Result<Jsonb, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let service_name = required_label("service_name", service_name)?;
    rows::run_exists(&scope, run_id)?;
    let text: String = db::select_one(
        include_str!("../../sql/queries/otel_facts.sql"),
        &scope.args([run_id.into()]),
        |r| db::req(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))?;
    let facts: Facts = serde_json::from_str(&text)
        .map_err(|e| LedgerError::internal(format!("otel_trace read its facts wrong: {e}")))?;
    Ok(Jsonb::from(&otel::trace(
        &facts,
        service_name,
        env!("CARGO_PKG_VERSION"),
    )))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::evidence::bundle::tests::realistic_run;
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;
    use serde_json::Value;

    fn trace(run: &str) -> Value {
        one::<pgrx::JsonB>(&format!("SELECT ledger.otel_trace('{run}')")).0
    }

    fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
        span["attributes"]
            .as_array()
            .and_then(|a| a.iter().find(|a| a["key"] == key))
            .map(|a| &a["value"])
            .unwrap_or(&Value::Null)
    }

    #[pg_test]
    fn a_realistic_run_exports_as_a_genai_trace() {
        set_scope("t-otel", "w");
        realistic_run();
        let t = trace("turn");
        let resource = &t["resourceSpans"][0];
        assert_eq!(
            attr(&resource["resource"], "ledger.tenant_id")["stringValue"],
            "t-otel"
        );
        assert_eq!(
            attr(&resource["resource"], "service.name")["stringValue"],
            "ledger"
        );
        let spans = resource["scopeSpans"][0]["spans"].as_array().unwrap();
        let names: Vec<&str> = spans.iter().map(|s| s["name"].as_str().unwrap()).collect();
        // The run, then its steps in order; the approval's call has a step of its own.
        assert_eq!(
            names,
            [
                "invoke_agent bot-1",
                "chat gpt-x",
                "retrieval",
                "execute_tool crm.history",
                "execute_tool refund"
            ]
        );
        let run = &spans[0];
        assert_eq!(attr(run, "ledger.run_id")["stringValue"], "turn");
        assert_eq!(attr(run, "gen_ai.usage.input_tokens")["intValue"], "1250");
        assert_eq!(attr(run, "gen_ai.usage.output_tokens")["intValue"], "250");
        assert_eq!(
            attr(run, "ledger.cost.usd")["doubleValue"].to_string(),
            "0.1125"
        );
        assert_eq!(
            attr(run, "ledger.cost.eur")["doubleValue"].to_string(),
            "0.5"
        );
        assert_eq!(run["events"][0]["name"], "ledger.response_event");
        let chat = &spans[1];
        assert_eq!(chat["kind"], 3);
        assert_eq!(attr(chat, "gen_ai.request.model")["stringValue"], "gpt-x");
        assert_eq!(attr(chat, "gen_ai.provider.name")["stringValue"], "openai");
        assert_eq!(
            attr(chat, "gen_ai.usage.cache_read.input_tokens")["intValue"],
            "100"
        );
        assert_eq!(
            attr(chat, "ledger.cost.usd")["doubleValue"].to_string(),
            "0.1125"
        );
        let tool = &spans[3];
        assert_eq!(attr(tool, "gen_ai.tool.call.id")["stringValue"], "hist");
        assert_eq!(tool["status"]["code"], 1);
        assert_eq!(tool["events"][0]["name"], "ledger.tool_call.begin");
        let refund = &spans[4];
        assert_eq!(
            attr(refund, "ledger.tool_call.status")["stringValue"],
            "waiting_approval"
        );
        assert_eq!(refund["events"][0]["name"], "ledger.approval.requested");
        for span in &spans[1..] {
            assert_eq!(span["traceId"], run["traceId"]);
            assert_eq!(span["parentSpanId"], run["spanId"]);
            let record = attr(span, "ledger.tool_call_record_id")["stringValue"].as_str();
            if let Some(record) = record {
                // The ids lead back to the bundle.
                assert!(one::<bool>(&format!(
                    "SELECT ledger.replay_bundle('turn')->'tool_calls' @> '[{{\"id\": \"{record}\"}}]'"
                )));
            }
        }
        // A finished run exports the same trace every time.
        Spi::run("SELECT ledger.transition_run('turn', 'succeeded')").unwrap();
        assert_eq!(trace("turn"), trace("turn"));
    }

    /// Token counts that sum past i64::MAX (each one fits record_cost's u64) still export: the
    /// sum stays exact while it fits an int64, and becomes a double past it.
    #[pg_test]
    fn token_sums_past_i64_export() {
        set_scope("t-otel-big", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'big')").unwrap();
        Spi::run(
            "SELECT ledger.record_cost('big', 'tokens', 1, usage => '{\"prompt_tokens\": 9223372036854775807, \"completion_tokens\": 9223372036854775806}'); \
             SELECT ledger.record_cost('big', 'tokens', 1, usage => '{\"prompt_tokens\": 9223372036854775807, \"completion_tokens\": 1}')",
        )
        .unwrap();
        let t = trace("big");
        let run = &t["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(
            attr(run, "gen_ai.usage.output_tokens")["intValue"],
            "9223372036854775807"
        );
        assert_eq!(
            attr(run, "gen_ai.usage.input_tokens")["doubleValue"].as_f64(),
            Some(2.0 * 9223372036854775807.0)
        );
        assert_eq!(trace("big"), trace("big"));
    }

    #[pg_test]
    fn otel_trace_refuses_what_it_cannot_export() {
        set_scope("t-otel-bad", "w");
        assert_error("SELECT ledger.otel_trace('nope')", "P0002", "RUN_NOT_FOUND");
        assert_error(
            "SELECT ledger.otel_trace(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error("SELECT ledger.otel_trace('bad id')", "22023", "ID_INVALID");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        assert_error(
            "SELECT ledger.otel_trace('r', service_name => NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.otel_trace('r', service_name => E'a\\nb')",
            "22023",
            "LABEL_INVALID",
        );
        // Another scope's run is not found.
        set_scope("t-otel-other", "w");
        assert_error("SELECT ledger.otel_trace('r')", "P0002", "RUN_NOT_FOUND");
    }

    #[pg_test]
    fn a_call_completed_unknown_is_in_doubt_and_every_span_names_the_run() {
        set_scope("t-otel-unknown", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r'), ledger.transition_run('r', 'running'); \
             SELECT ledger.create_step('r', 'llm', step_key => 'plan')",
        )
        .unwrap();
        let id = one::<String>(
            "SELECT ledger.claim_tool_call('r', 'email.send', '{}', tool_call_id => 'c1')->'tool_call'->>'id'",
        );
        Spi::run(&format!(
            "SELECT ledger.begin_tool_call('{id}', 1); \
             SELECT ledger.complete_tool_call('{id}', 1, 'unknown', error_message => 'timeout after send')"
        ))
        .unwrap();
        let t = trace("r");
        let spans = t["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        assert_eq!(spans.len(), 3);
        for span in spans {
            assert_eq!(
                attr(span, "ledger.run_id")["stringValue"],
                "r",
                "{}",
                span["name"]
            );
        }
        let tool = spans
            .iter()
            .find(|s| s["name"] == "execute_tool email.send")
            .unwrap();
        assert_eq!(tool["status"]["code"], 2);
        assert_eq!(attr(tool, "error.type")["stringValue"], "in_doubt");
        assert_eq!(
            attr(tool, "ledger.tool_call.status")["stringValue"],
            "in_doubt"
        );
        assert_eq!(
            attr(tool, "ledger.error_code")["stringValue"],
            "OUTCOME_UNKNOWN"
        );
    }
}
