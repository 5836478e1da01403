//! A run as an OpenTelemetry trace: an OTLP/JSON `ExportTraceServiceRequest` following the GenAI
//! semantic conventions. The run is the agent invocation span (`invoke_agent`), its `llm` steps
//! chat spans (`chat`) with token usage, its tool calls tool-execution spans (`execute_tool`),
//! its other steps plain internal spans; costs are attributes of the span they were recorded on
//! (and summed on the run's); response events and approvals are span events; every span carries
//! the ledger's ids, so that a trace leads back to `replay_bundle`.
//!
//! Ids are derived, not stored: the same run exports the same trace every time, so a backend
//! receiving it twice keeps one copy. A run whose `trace_id` is a W3C trace id (32 hex digits) or
//! `traceparent` joins that trace (under that parent span).

use crate::hash::hex;
use serde::Deserialize;
use serde_json::{json, Number, Value};
use sha2::{Digest, Sha256};

/// What the export reads about a run (the SPI layer's one query). Times are microseconds since
/// the Unix epoch; money is decimal text.
#[derive(Debug, Default, Deserialize)]
pub struct Facts {
    pub run: RunFact,
    #[serde(default)]
    pub steps: Vec<StepFact>,
    #[serde(default)]
    pub tool_calls: Vec<ToolCallFact>,
    #[serde(default)]
    pub usage: Vec<UsageFact>,
    #[serde(default)]
    pub money: Vec<MoneyFact>,
    #[serde(default)]
    pub responses: Vec<ResponseFact>,
    #[serde(default)]
    pub approvals: Vec<ApprovalFact>,
    /// The run's budget events (`budget.warning`, `budget.exhausted`), in feed order.
    #[serde(default)]
    pub budget_events: Vec<BudgetEventFact>,
    /// The end of spans still open (the statement's time).
    pub now_us: i64,
}

#[derive(Debug, Default, Deserialize)]
pub struct RunFact {
    pub run_id: String,
    pub tenant_id: String,
    pub workspace_id: String,
    pub trace_id: Option<String>,
    pub request_id: Option<String>,
    pub parent_run_id: Option<String>,
    pub parent_trace_id: Option<String>,
    pub source_run_id: Option<String>,
    pub source_trace_id: Option<String>,
    pub root_run_id: Option<String>,
    pub attempt_no: i64,
    pub mode: String,
    pub kind: String,
    pub subject_kind: String,
    pub subject_id: Option<String>,
    pub subject_version_id: Option<String>,
    pub user_id: Option<String>,
    pub status: String,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub queued_us: i64,
    pub started_us: Option<i64>,
    pub ended_us: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StepFact {
    pub step_id: String,
    pub step_no: i64,
    pub step_key: Option<String>,
    pub step_type: String,
    pub status: String,
    /// `metrics.model` or `metrics.model_ref`, when the step names its model there.
    pub model: Option<String>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub created_us: i64,
    pub started_us: Option<i64>,
    pub ended_us: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ToolCallFact {
    pub tool_call_record_id: String,
    pub step_id: String,
    pub tool_call_id: String,
    pub tool_ref: String,
    pub status: String,
    pub attempt: i64,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub created_us: i64,
    pub begun_us: Option<i64>,
    pub completed_us: Option<i64>,
}

/// Usage counters summed over the cost entries of one step (`step_id`), of the run itself
/// (`step_id` null), or of all of them (`total`).
#[derive(Debug, Default, Deserialize)]
pub struct UsageFact {
    pub step_id: Option<String>,
    #[serde(default)]
    pub total: bool,
    pub entries: i64,
    // Sums of counts that each fit a u64 (what record_cost accepts), summed in numeric: a run's
    // total can pass i64::MAX (`Number` keeps an integer exact, a larger one as a float).
    pub prompt_tokens: Option<Number>,
    pub completion_tokens: Option<Number>,
    pub cache_read_tokens: Option<Number>,
    pub cache_creation_tokens: Option<Number>,
    pub reasoning_tokens: Option<Number>,
    #[serde(default)]
    pub providers: Vec<String>,
    #[serde(default)]
    pub models: Vec<String>,
}

/// Money summed per currency, grouped like `UsageFact`.
#[derive(Debug, Default, Deserialize)]
pub struct MoneyFact {
    pub step_id: Option<String>,
    #[serde(default)]
    pub total: bool,
    pub currency: String,
    pub amount: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct ResponseFact {
    pub response_event_id: String,
    pub step_id: Option<String>,
    pub event_type: String,
    pub created_us: i64,
}

#[derive(Debug, Default, Deserialize)]
pub struct ApprovalFact {
    pub approval_id: String,
    pub tool_call_record_id: Option<String>,
    pub step_id: Option<String>,
    pub status: String,
    pub actor: Option<String>,
    pub created_us: i64,
    pub decided_us: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct BudgetEventFact {
    pub event_type: String,
    pub decision: Option<String>,
    pub subject: Option<String>,
    pub level: Option<String>,
    pub unit: Option<String>,
    pub period: Option<String>,
    pub max_amount: Option<String>,
    pub spent: Option<String>,
    pub created_us: i64,
}

/// OTLP's span kinds and status codes (opentelemetry/proto/trace/v1/trace.proto).
const KIND_INTERNAL: i64 = 1;
const KIND_CLIENT: i64 = 3;
const STATUS_OK: i64 = 1;
const STATUS_ERROR: i64 = 2;

/// Statuses that end a span in error, for runs, steps and tool calls alike. A call in doubt is
/// one: its answer never came back.
const ERROR_STATUSES: [&str; 4] = ["failed", "expired", "in_doubt", "rejected"];

/// The export of `facts`, with `service_name` as the resource's `service.name` and
/// `version` as the instrumentation scope's version.
pub fn trace(facts: &Facts, service_name: &str, version: &str) -> Value {
    let run = &facts.run;
    let ids = Ids::new(&run.tenant_id, &run.workspace_id);
    let (trace_id, remote_parent) = ids.trace_of(&run.run_id, run.trace_id.as_deref());
    let run_span = ids.span("run", &run.run_id);
    let mut spans = vec![run_span_of(facts, &ids, &trace_id, remote_parent)];
    for step in &facts.steps {
        let call = facts.tool_calls.iter().find(|c| c.step_id == step.step_id);
        let mut span = match call {
            Some(call) => tool_span(facts, call, step),
            None => step_span(facts, step),
        };
        // On every span, not only the run's: a trace backend finds any span by its run.
        span.attributes =
            std::mem::take(&mut span.attributes).str("ledger.run_id", Some(&run.run_id));
        spans.push(span.finish(&trace_id, Some(&run_span)));
    }
    json!({
        "resourceSpans": [{
            "resource": {"attributes": Attributes::default()
                .str("service.name", Some(service_name))
                .str("ledger.tenant_id", Some(&run.tenant_id))
                .str("ledger.workspace_id", Some(&run.workspace_id))
                .0},
            "scopeSpans": [{
                "scope": {"name": "ledger", "version": version},
                "spans": spans,
            }],
        }],
    })
}

/// A span being built: everything but its place in the trace.
struct Span {
    id: String,
    name: String,
    kind: i64,
    start_us: i64,
    end_us: i64,
    attributes: Attributes,
    events: Vec<Value>,
    status: Value,
}

impl Span {
    fn finish(self, trace_id: &str, parent: Option<&str>) -> Value {
        let mut span = json!({
            "traceId": trace_id,
            "spanId": self.id,
            "name": self.name,
            "kind": self.kind,
            "startTimeUnixNano": nanos(self.start_us),
            "endTimeUnixNano": nanos(self.end_us.max(self.start_us)),
            "attributes": self.attributes.0,
            "events": self.events,
            "status": self.status,
        });
        if let Some(parent) = parent {
            span["parentSpanId"] = json!(parent);
        }
        span
    }
}

fn run_span_of(facts: &Facts, ids: &Ids, trace_id: &str, parent: Option<String>) -> Value {
    let run = &facts.run;
    let total = facts.usage.iter().find(|u| u.total);
    let start_us = run.started_us.unwrap_or(run.queued_us);
    let name = match &run.subject_id {
        Some(agent) => format!("invoke_agent {agent}"),
        None => "invoke_agent".to_string(),
    };
    let attributes = Attributes::default()
        .str("gen_ai.operation.name", Some("invoke_agent"))
        .str("gen_ai.agent.id", run.subject_id.as_deref())
        .str("gen_ai.agent.name", run.subject_id.as_deref())
        .str("gen_ai.agent.version", run.subject_version_id.as_deref())
        .str(
            "gen_ai.provider.name",
            total.and_then(|u| single(&u.providers)).as_deref(),
        )
        .usage(total)
        .str("user.id", run.user_id.as_deref())
        .str("ledger.run_id", Some(&run.run_id))
        .str("ledger.status", Some(&run.status))
        .str("ledger.mode", Some(&run.mode))
        .str("ledger.kind", Some(&run.kind))
        .str("ledger.subject_kind", Some(&run.subject_kind))
        .int("ledger.attempt_no", Some(run.attempt_no))
        .str("ledger.request_id", run.request_id.as_deref())
        .str("ledger.parent_run_id", run.parent_run_id.as_deref())
        .str("ledger.source_run_id", run.source_run_id.as_deref())
        .str("ledger.root_run_id", run.root_run_id.as_deref())
        .error_type(&run.status, run.error_code.as_deref())
        .money(facts.money.iter().filter(|m| m.total));
    let mut events: Vec<Value> = Vec::new();
    for r in facts.responses.iter().filter(|r| r.step_id.is_none()) {
        events.push(response_event(r));
    }
    for a in facts
        .approvals
        .iter()
        .filter(|a| a.tool_call_record_id.is_none() && a.step_id.is_none())
    {
        events.extend(approval_events(a));
    }
    events.extend(facts.budget_events.iter().map(budget_event));
    let span = Span {
        id: ids.span("run", &run.run_id),
        name,
        kind: KIND_INTERNAL,
        start_us,
        end_us: run.ended_us.unwrap_or(facts.now_us),
        attributes,
        events,
        status: status(&run.status, run.error_message.as_deref()),
    };
    let mut value = span.finish(trace_id, parent.as_deref());
    let links: Vec<Value> = [
        ("parent_run", &run.parent_run_id, &run.parent_trace_id),
        ("source_run", &run.source_run_id, &run.source_trace_id),
    ]
    .into_iter()
    .filter_map(|(relation, run_id, their_trace)| {
        let run_id = run_id.as_deref()?;
        Some(json!({
            "traceId": ids.trace_of(run_id, their_trace.as_deref()).0,
            "spanId": ids.span("run", run_id),
            "attributes": Attributes::default()
                .str("ledger.link", Some(relation))
                .str("ledger.run_id", Some(run_id))
                .0,
        }))
    })
    .collect();
    if !links.is_empty() {
        value["links"] = Value::Array(links);
    }
    value
}

/// A step without a tool call: a chat span for `llm` steps, a plain internal span otherwise.
fn step_span(facts: &Facts, step: &StepFact) -> Span {
    let usage = facts
        .usage
        .iter()
        .find(|u| !u.total && u.step_id.as_deref() == Some(&step.step_id));
    let mut attributes = Attributes::default();
    let (name, kind) = if step.step_type == "llm" {
        let model = step
            .model
            .clone()
            .or_else(|| usage.and_then(|u| single(&u.models)));
        attributes = attributes
            .str("gen_ai.operation.name", Some("chat"))
            .str(
                "gen_ai.provider.name",
                usage.and_then(|u| single(&u.providers)).as_deref(),
            )
            .str("gen_ai.request.model", model.as_deref());
        let name = match model {
            Some(model) => format!("chat {model}"),
            None => "chat".to_string(),
        };
        (name, KIND_CLIENT)
    } else {
        (step.step_type.clone(), KIND_INTERNAL)
    };
    let start_us = step.started_us.unwrap_or(step.created_us);
    Span {
        name,
        kind,
        start_us,
        end_us: step.ended_us.or(facts.run.ended_us).unwrap_or(facts.now_us),
        attributes: attributes
            .usage(usage)
            .step(step)
            .error_type(&step.status, step.error_code.as_deref())
            .money(
                facts
                    .money
                    .iter()
                    .filter(|m| !m.total && m.step_id.as_deref() == Some(&step.step_id)),
            ),
        events: step_events(facts, &step.step_id, None),
        status: status(&step.status, step.error_message.as_deref()),
        id: Ids::new(&facts.run.tenant_id, &facts.run.workspace_id).span("step", &step.step_id),
    }
}

/// A tool call (with its step): from the claim to the completion, begin marked as an event.
fn tool_span(facts: &Facts, call: &ToolCallFact, step: &StepFact) -> Span {
    let mut events = Vec::new();
    if let Some(begun) = call.begun_us {
        events.push(json!({
            "timeUnixNano": nanos(begun),
            "name": "ledger.tool_call.begin",
            "attributes": Attributes::default().int("ledger.attempt", Some(call.attempt)).0,
        }));
    }
    events.extend(step_events(
        facts,
        &step.step_id,
        Some(&call.tool_call_record_id),
    ));
    let message = match call.status.as_str() {
        "in_doubt" => Some("in doubt: the request may have left and no answer was recorded"),
        _ => call.error_message.as_deref(),
    };
    Span {
        id: Ids::new(&facts.run.tenant_id, &facts.run.workspace_id)
            .span("tool_call", &call.tool_call_record_id),
        name: format!("execute_tool {}", call.tool_ref),
        kind: KIND_INTERNAL,
        start_us: call.created_us,
        end_us: call
            .completed_us
            .or(step.ended_us)
            .or(facts.run.ended_us)
            .unwrap_or(facts.now_us),
        attributes: Attributes::default()
            .str("gen_ai.operation.name", Some("execute_tool"))
            .str("gen_ai.tool.name", Some(&call.tool_ref))
            .str("gen_ai.tool.call.id", Some(&call.tool_call_id))
            .str("gen_ai.tool.type", Some("function"))
            .str(
                "ledger.tool_call_record_id",
                Some(&call.tool_call_record_id),
            )
            .str("ledger.tool_call.status", Some(&call.status))
            .int("ledger.tool_call.attempt", Some(call.attempt))
            .step(step)
            .str("ledger.error_code", call.error_code.as_deref())
            // In doubt, however it got there (a sweep, or completed `unknown` with its
            // OUTCOME_UNKNOWN code): the state a person acts on, as the call's status says.
            .error_type(
                &call.status,
                call.error_code
                    .as_deref()
                    .filter(|_| call.status != "in_doubt"),
            )
            .money(
                facts
                    .money
                    .iter()
                    .filter(|m| !m.total && m.step_id.as_deref() == Some(&step.step_id)),
            ),
        events,
        status: status(&call.status, message),
    }
}

/// The response events and approvals recorded on a step (or its tool call).
fn step_events(facts: &Facts, step_id: &str, call: Option<&str>) -> Vec<Value> {
    let mut events: Vec<Value> = facts
        .responses
        .iter()
        .filter(|r| r.step_id.as_deref() == Some(step_id))
        .map(response_event)
        .collect();
    for a in facts.approvals.iter().filter(|a| {
        a.step_id.as_deref() == Some(step_id)
            || (call.is_some() && a.tool_call_record_id.as_deref() == call)
    }) {
        events.extend(approval_events(a));
    }
    events
}

fn response_event(r: &ResponseFact) -> Value {
    json!({
        "timeUnixNano": nanos(r.created_us),
        "name": "ledger.response_event",
        "attributes": Attributes::default()
            .str("ledger.response_event_id", Some(&r.response_event_id))
            .str("ledger.event_type", Some(&r.event_type))
            .0,
    })
}

/// A budget's warning, or its refusal of a decision (the run's stop), on the run's span.
fn budget_event(b: &BudgetEventFact) -> Value {
    json!({
        "timeUnixNano": nanos(b.created_us),
        "name": format!("ledger.{}", b.event_type),
        "attributes": Attributes::default()
            .str("ledger.budget.level", b.level.as_deref())
            .str("ledger.budget.unit", b.unit.as_deref())
            .str("ledger.budget.period", b.period.as_deref())
            .str("ledger.budget.max_amount", b.max_amount.as_deref())
            .str("ledger.budget.spent", b.spent.as_deref())
            .str("ledger.budget.decision", b.decision.as_deref())
            .str("ledger.budget.subject", b.subject.as_deref())
            .0,
    })
}

/// The request, and the decision once there is one.
fn approval_events(a: &ApprovalFact) -> Vec<Value> {
    let ids = || {
        Attributes::default()
            .str("ledger.approval_id", Some(&a.approval_id))
            .str(
                "ledger.tool_call_record_id",
                a.tool_call_record_id.as_deref(),
            )
    };
    let mut events = vec![json!({
        "timeUnixNano": nanos(a.created_us),
        "name": "ledger.approval.requested",
        "attributes": ids().0,
    })];
    if let Some(decided) = a.decided_us {
        events.push(json!({
            "timeUnixNano": nanos(decided),
            "name": format!("ledger.approval.{}", a.status),
            "attributes": ids().str("ledger.actor", a.actor.as_deref()).0,
        }));
    }
    events
}

/// ERROR for a failed, expired, rejected or in-doubt outcome; OK once succeeded; unset while
/// running, and for canceled and skipped work.
fn status(status: &str, message: Option<&str>) -> Value {
    if ERROR_STATUSES.contains(&status) {
        json!({"code": STATUS_ERROR, "message": message.unwrap_or(status)})
    } else if status == "succeeded" {
        json!({"code": STATUS_OK})
    } else {
        json!({})
    }
}

/// The one value of a list, if it has exactly one.
fn single(values: &[String]) -> Option<String> {
    match values {
        [one] => Some(one.clone()),
        _ => None,
    }
}

/// Microseconds to OTLP's nanoseconds, a decimal string (JSON's form of a fixed64).
fn nanos(us: i64) -> String {
    (i128::from(us) * 1000).max(0).to_string()
}

/// OTLP key-value attributes, in the order they were added; absent values are left out.
#[derive(Default)]
struct Attributes(Vec<Value>);

impl Attributes {
    fn str(mut self, key: &str, value: Option<&str>) -> Self {
        if let Some(v) = value {
            self.0
                .push(json!({"key": key, "value": {"stringValue": v}}));
        }
        self
    }

    /// JSON's form of an int64 is a decimal string.
    fn int(mut self, key: &str, value: Option<i64>) -> Self {
        if let Some(v) = value {
            self.0
                .push(json!({"key": key, "value": {"intValue": v.to_string()}}));
        }
        self
    }

    /// A token count: an OTLP int64 when it fits one, else a double (a sum past i64::MAX).
    fn count(mut self, key: &str, value: Option<&Number>) -> Self {
        match value.map(|n| (n.as_i64(), n.as_f64())) {
            Some((Some(v), _)) => return self.int(key, Some(v)),
            Some((None, Some(v))) => self
                .0
                .push(json!({"key": key, "value": {"doubleValue": v}})),
            _ => {}
        }
        self
    }

    /// The GenAI token counts, and the ledger's count of cost entries.
    fn usage(self, usage: Option<&UsageFact>) -> Self {
        let Some(u) = usage else { return self };
        self.count("gen_ai.usage.input_tokens", u.prompt_tokens.as_ref())
            .count("gen_ai.usage.output_tokens", u.completion_tokens.as_ref())
            .count(
                "gen_ai.usage.cache_read.input_tokens",
                u.cache_read_tokens.as_ref(),
            )
            .count(
                "gen_ai.usage.cache_creation.input_tokens",
                u.cache_creation_tokens.as_ref(),
            )
            .count("ledger.usage.reasoning_tokens", u.reasoning_tokens.as_ref())
            .int("ledger.cost.entries", Some(u.entries))
    }

    /// `ledger.cost.<currency>`: the amount in that currency, a double (exact decimal text).
    fn money<'a>(mut self, money: impl Iterator<Item = &'a MoneyFact>) -> Self {
        for m in money {
            let amount = serde_json::from_str::<Number>(&m.amount).ok();
            if let Some(amount) = amount {
                self.0.push(json!({
                    "key": format!("ledger.cost.{}", m.currency.to_ascii_lowercase()),
                    "value": {"doubleValue": amount},
                }));
            }
        }
        self
    }

    /// `error.type` of a span ending in error: the recorded error code, else the status itself
    /// (`in_doubt`, `expired`, ...).
    fn error_type(self, status: &str, code: Option<&str>) -> Self {
        if ERROR_STATUSES.contains(&status) {
            self.str("error.type", Some(code.unwrap_or(status)))
        } else {
            self
        }
    }

    fn step(self, step: &StepFact) -> Self {
        self.str("ledger.step_id", Some(&step.step_id))
            .str("ledger.step_type", Some(&step.step_type))
            .int("ledger.step_no", Some(step.step_no))
            .str("ledger.step_key", step.step_key.as_deref())
            .str("ledger.status", Some(&step.status))
    }
}

/// Trace and span ids derived from the scope and the ledger's ids.
struct Ids<'a> {
    tenant: &'a str,
    workspace: &'a str,
}

impl<'a> Ids<'a> {
    fn new(tenant: &'a str, workspace: &'a str) -> Self {
        Ids { tenant, workspace }
    }

    fn digest(&self, what: &str, id: &str) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in ["ledger-otel", what, self.tenant, self.workspace, id] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        h.finalize().into()
    }

    /// A span's 8 bytes in hex (never all zero, which OTLP reads as "no span").
    fn span(&self, what: &str, id: &str) -> String {
        let mut d = self.digest(what, id);
        d[7] |= 1;
        hex(&d[..8])
    }

    /// The trace of a run, and the remote parent span when the run's `trace_id` is a
    /// `traceparent`: the caller's trace when `trace_id` names one, else one derived from the run.
    fn trace_of(&self, run_id: &str, trace_id: Option<&str>) -> (String, Option<String>) {
        if let Some((trace, parent)) = trace_id.and_then(w3c_trace) {
            return (trace, parent);
        }
        let mut d = self.digest("trace", run_id);
        d[15] |= 1;
        (hex(&d[..16]), None)
    }
}

/// A W3C trace id (32 hex digits, not all zero) or `traceparent` (`00-<trace>-<span>-<flags>`),
/// lowercased: the trace and, for a traceparent, the parent span.
fn w3c_trace(text: &str) -> Option<(String, Option<String>)> {
    let is_hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit()) && s.bytes().any(|b| b != b'0')
    };
    let text = text.to_ascii_lowercase();
    if is_hex(&text, 32) {
        return Some((text, None));
    }
    let parts: Vec<&str> = text.split('-').collect();
    match parts.as_slice() {
        [version, trace, span, flags]
            if version.len() == 2
                && *version != "ff"
                && is_hex(trace, 32)
                && is_hex(span, 16)
                && flags.len() == 2 =>
        {
            Some((trace.to_string(), Some(span.to_string())))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        serde_json::from_value(json!({
            "run": {
                "run_id": "run-1", "tenant_id": "acme", "workspace_id": "support",
                "trace_id": null, "request_id": "req-9", "parent_run_id": null,
                "parent_trace_id": null, "source_run_id": "run-0", "source_trace_id": null,
                "root_run_id": "run-0", "attempt_no": 2, "mode": "agent", "kind": "agent",
                "subject_kind": "agent", "subject_id": "support-bot", "subject_version_id": "v3",
                "user_id": "u-7", "status": "succeeded", "error_code": null, "error_message": null,
                "queued_us": 1_000_000, "started_us": 2_000_000, "ended_us": 9_000_000
            },
            "steps": [
                {"step_id": "step_a", "step_no": 1, "step_key": "plan", "step_type": "llm",
                 "status": "succeeded", "model": null, "error_code": null, "error_message": null,
                 "created_us": 2_100_000, "started_us": 2_200_000, "ended_us": 3_000_000},
                {"step_id": "step_b", "step_no": 2, "step_key": null, "step_type": "tool",
                 "status": "paused", "model": null, "error_code": null, "error_message": null,
                 "created_us": 3_100_000, "started_us": 3_100_000, "ended_us": null},
                {"step_id": "step_c", "step_no": 3, "step_key": null, "step_type": "retrieval",
                 "status": "failed", "model": null, "error_code": "E_SEARCH", "error_message": "index down",
                 "created_us": 4_000_000, "started_us": null, "ended_us": 4_500_000}
            ],
            "tool_calls": [
                {"tool_call_record_id": "tc_1", "step_id": "step_b", "tool_call_id": "call-1",
                 "tool_ref": "email.send", "status": "in_doubt", "attempt": 1, "error_code": null,
                 "error_message": null, "created_us": 3_100_000, "begun_us": 3_200_000,
                 "completed_us": null}
            ],
            "usage": [
                {"step_id": "step_a", "total": false, "entries": 1, "prompt_tokens": 100,
                 "completion_tokens": 20, "cache_read_tokens": null, "cache_creation_tokens": null,
                 "reasoning_tokens": null, "providers": ["anthropic"], "models": ["claude-x"]},
                {"step_id": null, "total": true, "entries": 2, "prompt_tokens": 100,
                 "completion_tokens": 20, "cache_read_tokens": 5, "cache_creation_tokens": null,
                 "reasoning_tokens": null, "providers": ["anthropic", "openai"], "models": ["claude-x"]}
            ],
            "money": [
                {"step_id": "step_a", "total": false, "currency": "USD", "amount": "0.0042"},
                {"step_id": null, "total": true, "currency": "USD", "amount": "0.0142"}
            ],
            "responses": [
                {"response_event_id": "rsp_1", "step_id": null, "event_type": "message", "created_us": 8_900_000}
            ],
            "approvals": [
                {"approval_id": "apr_1", "tool_call_record_id": "tc_1", "step_id": "step_b",
                 "status": "approved", "actor": "ops@acme", "created_us": 3_150_000, "decided_us": 3_180_000}
            ],
            "budget_events": [
                {"event_type": "budget.exhausted", "decision": "tool_call", "subject": "call-2",
                 "level": "run", "unit": "tool_calls", "period": "total", "max_amount": "1",
                 "spent": "1", "created_us": 8_950_000}
            ],
            "now_us": 10_000_000
        }))
        .expect("facts parse")
    }

    fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
        span["attributes"]
            .as_array()?
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| &a["value"])
    }

    fn spans(t: &Value) -> &Vec<Value> {
        t["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .expect("spans")
    }

    #[test]
    fn the_run_is_the_agent_span_and_steps_its_children() {
        let t = trace(&facts(), "ledger", "0.5.0");
        let s = spans(&t);
        assert_eq!(s.len(), 4);
        let run = &s[0];
        assert_eq!(run["name"], "invoke_agent support-bot");
        assert_eq!(run["kind"], KIND_INTERNAL);
        assert!(run.get("parentSpanId").is_none());
        assert_eq!(run["startTimeUnixNano"], "2000000000");
        assert_eq!(run["endTimeUnixNano"], "9000000000");
        assert_eq!(run["status"]["code"], STATUS_OK);
        assert_eq!(
            attr(run, "gen_ai.operation.name").unwrap()["stringValue"],
            "invoke_agent"
        );
        assert_eq!(
            attr(run, "gen_ai.usage.input_tokens").unwrap()["intValue"],
            "100"
        );
        assert_eq!(
            attr(run, "gen_ai.usage.cache_read.input_tokens").unwrap()["intValue"],
            "5"
        );
        assert_eq!(
            attr(run, "ledger.cost.usd").unwrap()["doubleValue"].to_string(),
            "0.0142"
        );
        assert_eq!(attr(run, "ledger.attempt_no").unwrap()["intValue"], "2");
        // Two providers on the run: none named.
        assert!(attr(run, "gen_ai.provider.name").is_none());
        assert_eq!(run["events"][0]["name"], "ledger.response_event");
        // A budget's stop is an event of the run's span, with the budget.
        let stop = &run["events"][1];
        assert_eq!(stop["name"], "ledger.budget.exhausted");
        assert_eq!(stop["timeUnixNano"], "8950000000");
        assert_eq!(
            attr(stop, "ledger.budget.unit").unwrap()["stringValue"],
            "tool_calls"
        );
        assert_eq!(
            attr(stop, "ledger.budget.subject").unwrap()["stringValue"],
            "call-2"
        );
        for child in &s[1..] {
            assert_eq!(child["traceId"], run["traceId"]);
            assert_eq!(child["parentSpanId"], run["spanId"]);
        }
        // Every span names its run, so a backend finds any of them by run id.
        for span in s {
            assert_eq!(
                attr(span, "ledger.run_id").map(|v| &v["stringValue"]),
                Some(&json!(facts().run.run_id)),
                "{}",
                span["name"]
            );
        }
        // The source run is linked, in its own (derived) trace.
        assert_eq!(
            run["links"][0]["spanId"],
            Ids::new("acme", "support").span("run", "run-0")
        );
        assert_ne!(run["links"][0]["traceId"], run["traceId"]);
    }

    #[test]
    fn llm_steps_are_chat_spans_with_usage_and_cost() {
        let t = trace(&facts(), "ledger", "0.5.0");
        let chat = &spans(&t)[1];
        assert_eq!(chat["name"], "chat claude-x");
        assert_eq!(chat["kind"], KIND_CLIENT);
        assert_eq!(
            attr(chat, "gen_ai.provider.name").unwrap()["stringValue"],
            "anthropic"
        );
        assert_eq!(
            attr(chat, "gen_ai.request.model").unwrap()["stringValue"],
            "claude-x"
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.output_tokens").unwrap()["intValue"],
            "20"
        );
        assert_eq!(
            attr(chat, "ledger.cost.usd").unwrap()["doubleValue"].to_string(),
            "0.0042"
        );
        assert_eq!(
            attr(chat, "ledger.step_key").unwrap()["stringValue"],
            "plan"
        );
    }

    #[test]
    fn a_call_in_doubt_is_an_open_tool_span_in_error() {
        let t = trace(&facts(), "ledger", "0.5.0");
        let tool = &spans(&t)[2];
        assert_eq!(tool["name"], "execute_tool email.send");
        assert_eq!(
            attr(tool, "gen_ai.tool.call.id").unwrap()["stringValue"],
            "call-1"
        );
        assert_eq!(
            attr(tool, "ledger.tool_call_record_id").unwrap()["stringValue"],
            "tc_1"
        );
        assert_eq!(tool["status"]["code"], STATUS_ERROR);
        assert_eq!(attr(tool, "error.type").unwrap()["stringValue"], "in_doubt");
        // Completed `unknown`: the recorded code beside it, the span still says in_doubt.
        let mut unknown = facts();
        unknown.tool_calls[0].error_code = Some("OUTCOME_UNKNOWN".into());
        let t2 = trace(&unknown, "ledger", "0.5.0");
        let tool2 = &spans(&t2)[2];
        assert_eq!(
            attr(tool2, "error.type").unwrap()["stringValue"],
            "in_doubt"
        );
        assert_eq!(
            attr(tool2, "ledger.error_code").unwrap()["stringValue"],
            "OUTCOME_UNKNOWN"
        );
        assert_eq!(tool2["status"]["code"], STATUS_ERROR);
        // Not completed, its run ended: the span ends with the run.
        assert_eq!(tool["endTimeUnixNano"], "9000000000");
        let names: Vec<&str> = tool["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "ledger.tool_call.begin",
                "ledger.approval.requested",
                "ledger.approval.approved"
            ]
        );
        let other = &spans(&t)[3];
        assert_eq!(other["name"], "retrieval");
        assert_eq!(other["status"]["message"], "index down");
        assert_eq!(
            attr(other, "error.type").unwrap()["stringValue"],
            "E_SEARCH"
        );
        assert!(attr(&spans(&t)[0], "error.type").is_none());
        assert_eq!(other["startTimeUnixNano"], "4000000000");
    }

    #[test]
    fn ids_are_stable_and_a_w3c_trace_id_is_joined() {
        let a = trace(&facts(), "ledger", "0.5.0");
        assert_eq!(a, trace(&facts(), "ledger", "0.5.0"));
        let run = &spans(&a)[0];
        assert_eq!(run["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(run["spanId"].as_str().unwrap().len(), 16);
        let mut f = facts();
        f.run.trace_id = Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01".into());
        let t = trace(&f, "ledger", "0.5.0");
        assert_eq!(spans(&t)[0]["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(spans(&t)[0]["parentSpanId"], "00f067aa0ba902b7");
        f.run.trace_id = Some("4bf92f3577b34da6a3ce929d0e0e4736".into());
        let t = trace(&f, "ledger", "0.5.0");
        assert_eq!(spans(&t)[0]["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(spans(&t)[0].get("parentSpanId").is_none());
        for not_w3c in [
            "",
            "req-123",
            &"0".repeat(32),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        ] {
            assert!(w3c_trace(not_w3c).is_none(), "{not_w3c}");
        }
    }
}
