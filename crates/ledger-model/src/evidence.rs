//! Governance evidence and replay readiness of one run (docs/evidence.md: `run_evidence`, `replay_ready`):
//! the thirteen items and the replay criteria, computed from facts the SPI layer gathers.
//! No Postgres here.
//!
//! Every `Value` came through `json::parse`, so its depth is bounded and recursion is safe.

pub mod costs;
pub mod otel;

use std::collections::HashSet;

use serde_json::{json, Value};

use crate::json::canonical;
use crate::redaction;

/// What the ledger knows about a run, gathered by the SPI layer.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    pub run_id: String,
    pub tenant_id: String,
    pub workspace_id: String,
    pub user_id: Option<String>,
    pub mode: String,
    pub kind: String,
    pub subject_kind: String,
    pub subject_id: Option<String>,
    pub subject_version_id: Option<String>,
    /// false when the run's exact inputs cannot be recovered (only a summary was given, or the
    /// stored blob is gone or no longer matches its sha256)
    pub inputs_recoverable: bool,
    /// In creation order.
    pub steps: Vec<StepFact>,
    /// This run's own, ordered by created_at, id (a child run's audits are evidence of the
    /// child, not of this run).
    pub audits: Vec<AuditFact>,
    pub cost_ids: Vec<String>,
    /// Tool-call record ids (`tc_...`).
    pub tool_call_ids: Vec<String>,
    /// Finished calls of other runs whose results this run reused (a retry or replay passing
    /// its source's keys), in the order it first reused them.
    pub reused_tool_calls: Vec<ReusedCall>,
    pub citations: Vec<CitationFact>,
    pub response_event_ids: Vec<String>,
    /// Runs whose parent_run_id is this run (recorded lineage, not ids guessed from payloads).
    pub child_run_ids: Vec<String>,
}

#[derive(Clone, Debug, Default)]
pub struct StepFact {
    pub id: String,
    pub step_type: String,
    pub metrics: Value,
}

#[derive(Clone, Debug, Default)]
pub struct ReusedCall {
    pub tool_call_record_id: String,
    pub source_run_id: String,
}

impl ReusedCall {
    /// `<source_run_id>:<tool_call_record_id>`, like an audit's `<run_id>:<step_id>`.
    fn reference(&self) -> String {
        format!("{}:{}", self.source_run_id, self.tool_call_record_id)
    }
}

#[derive(Clone, Debug, Default)]
pub struct AuditFact {
    pub id: String,
    pub step_id: Option<String>,
    pub payload: Value,
}

#[derive(Clone, Debug, Default)]
pub struct CitationFact {
    pub id: String,
    pub citation: Value,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemStatus {
    Pass,
    Warning,
    Fail,
    NotApplicable,
}

impl ItemStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ItemStatus::Pass => "pass",
            ItemStatus::Warning => "warning",
            ItemStatus::Fail => "fail",
            ItemStatus::NotApplicable => "not_applicable",
        }
    }
}

/// One governance evidence item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub key: &'static str,
    pub status: ItemStatus,
    pub label: &'static str,
    pub summary: String,
    /// Deduplicated, first-seen order kept.
    pub evidence_refs: Vec<String>,
    pub missing: Vec<String>,
}

impl Item {
    pub fn to_json(&self) -> Value {
        json!({
            "key": self.key,
            "status": self.status.as_str(),
            "label": self.label,
            "summary": self.summary,
            "evidence_refs": self.evidence_refs,
            "missing": self.missing,
        })
    }
}

const CAPABILITY_KEYS: [&str; 6] = [
    "capability_binding",
    "bindings",
    "tool_refs",
    "workflow_refs",
    "knowledge_refs",
    "model_ref",
];
const PERMISSION_KEYS: [&str; 4] = [
    "permission_scope",
    "rbac",
    "resource_grant",
    "policy_decision",
];
const SECRET_ID_KEYS: [&str; 3] = ["secret_id", "secret_ids", "credential_secret_id"];
const SECRET_KEYS: [&str; 6] = [
    "secret_id",
    "secret_ids",
    "credential_secret_id",
    "secret_ref",
    "secret_refs",
    "credential_ref",
];
// Not the bare key "decision": any policy payload has one, egress or not.
const EGRESS_KEYS: [&str; 3] = ["egress", "egress_policy", "egress_decision"];

/// The applicability guards that depend only on which facts exist.
struct Guards {
    versioned_subject: bool,
    tool_governance: bool,
    cost_attribution: bool,
    knowledge_citation: bool,
    response_timeline: bool,
    /// Own tool-call records or results reused from a source run.
    tool_calls: bool,
    children: bool,
}

impl Guards {
    fn of(facts: &RunFacts) -> Guards {
        let step_types: HashSet<&str> = facts.steps.iter().map(|s| s.step_type.as_str()).collect();
        let has_step = |types: &[&str]| types.iter().any(|t| step_types.contains(t));
        let described_as = |names: &[&str]| {
            [&facts.kind, &facts.mode, &facts.subject_kind]
                .iter()
                .any(|v| names.contains(&v.as_str()))
        };
        Guards {
            versioned_subject: described_as(&["agent", "workflow"]),
            tool_governance: !facts.tool_call_ids.is_empty()
                || !facts.reused_tool_calls.is_empty()
                || !facts.audits.is_empty()
                || has_step(&["tool"]),
            cost_attribution: !facts.cost_ids.is_empty()
                || has_step(&["llm", "retrieval", "rerank"]),
            knowledge_citation: !facts.citations.is_empty() || has_step(&["retrieval", "rerank"]),
            response_timeline: described_as(&["agent", "chat", "response", "thread"]),
            tool_calls: !facts.tool_call_ids.is_empty() || !facts.reused_tool_calls.is_empty(),
            children: !facts.child_run_ids.is_empty(),
        }
    }
}

/// The thirteen items, in their fixed order: actor_scope, subject_version, capability_binding,
/// permission_scope, secret_boundary, egress_policy, audit_record, cost_attribution,
/// trace_timeline, tool_call, knowledge_citation, child_workflow, replay_ready.
pub fn evidence(facts: &RunFacts) -> Vec<Item> {
    let cx = Context::of(facts);
    RULES.iter().map(|rule| rule.item(&cx)).collect()
}

/// One evidence item as data: adding an item is adding a row to `RULES`.
struct Rule {
    key: &'static str,
    label: &'static str,
    applies: Applies,
    /// The verdict of an applicable item.
    check: fn(&Context) -> Verdict,
}

impl Rule {
    fn item(&self, cx: &Context) -> Item {
        let v = match self.applies {
            Applies::When(applies, summary) if !applies(cx) => {
                Verdict::lacking(ItemStatus::NotApplicable, summary, &[])
            }
            _ => (self.check)(cx),
        };
        Item {
            key: self.key,
            status: v.status,
            label: self.label,
            summary: v.summary,
            evidence_refs: dedup(v.refs),
            missing: v.missing.iter().map(|m| (*m).to_owned()).collect(),
        }
    }
}

/// Whether an item applies to a run.
enum Applies {
    Always,
    /// When the test holds; otherwise the item is not applicable, with this summary.
    When(fn(&Context) -> bool, &'static str),
}

/// What a check found.
struct Verdict {
    status: ItemStatus,
    summary: String,
    refs: Vec<String>,
    missing: Vec<&'static str>,
}

impl Verdict {
    fn new(
        status: ItemStatus,
        summary: impl Into<String>,
        refs: Vec<String>,
        missing: &[&'static str],
    ) -> Verdict {
        Verdict {
            status,
            summary: summary.into(),
            refs,
            missing: missing.to_vec(),
        }
    }

    fn pass(summary: impl Into<String>, refs: Vec<String>) -> Verdict {
        Verdict::new(ItemStatus::Pass, summary, refs, &[])
    }

    /// A verdict with no evidence to point at.
    fn lacking(
        status: ItemStatus,
        summary: impl Into<String>,
        missing: &[&'static str],
    ) -> Verdict {
        Verdict::new(status, summary, vec![], missing)
    }
}

/// The facts and what several rules derive from them, computed once per run.
struct Context<'a> {
    facts: &'a RunFacts,
    g: Guards,
    /// Every step's metrics, in step order.
    metrics: Vec<&'a Value>,
    /// `sec_...` ids under a secret id key of the metrics or audits.
    secret_ids: Vec<String>,
    has_secret_key: bool,
    /// A real credential in an audit's string value (redaction missed it), not any "sk-" text,
    /// which words like `task-1` contain.
    leaked_secret: bool,
    /// Values under an egress key, then URLs, of the metrics and audits.
    egress_refs: Vec<String>,
    has_egress_evidence: bool,
}

impl Context<'_> {
    fn of(facts: &RunFacts) -> Context<'_> {
        let metrics: Vec<&Value> = facts.steps.iter().map(|s| &s.metrics).collect();
        let audits: Vec<&Value> = facts.audits.iter().map(|a| &a.payload).collect();
        let everywhere: Vec<&Value> = metrics.iter().chain(&audits).copied().collect();
        let secret_ids = values_under(&everywhere, &SECRET_ID_KEYS)
            .into_iter()
            .flat_map(string_values)
            .filter(|s| s.starts_with("sec_"))
            .map(str::to_owned)
            .collect();
        let mut egress_refs = refs_under(&everywhere, &EGRESS_KEYS);
        egress_refs.extend(
            everywhere
                .iter()
                .flat_map(|v| string_values(v))
                .filter(|s| s.starts_with("http://") || s.starts_with("https://"))
                .map(str::to_owned),
        );
        let has_egress_key = everywhere.iter().any(|v| has_key(v, &EGRESS_KEYS));
        Context {
            facts,
            g: Guards::of(facts),
            secret_ids,
            has_secret_key: everywhere.iter().any(|v| has_key(v, &SECRET_KEYS)),
            leaked_secret: audits
                .iter()
                .any(|v| string_values(v).into_iter().any(redaction::is_credential)),
            has_egress_evidence: has_egress_key || !egress_refs.is_empty(),
            egress_refs,
            metrics,
        }
    }
}

/// The items in their fixed order.
const RULES: [Rule; 13] = [
    Rule {
        key: "actor_scope",
        label: "Actor and scope",
        applies: Applies::Always,
        check: actor_scope,
    },
    Rule {
        key: "subject_version",
        label: "Subject version",
        applies: Applies::When(
            |cx| cx.g.versioned_subject,
            "The run does not execute a versioned agent or workflow.",
        ),
        check: subject_version,
    },
    Rule {
        key: "capability_binding",
        label: "Capability binding",
        applies: Applies::When(
            |cx| cx.g.versioned_subject || cx.g.tool_calls || cx.g.children,
            "The run has no capability surface.",
        ),
        check: |cx| {
            let refs = dedup(refs_under(&cx.metrics, &CAPABILITY_KEYS));
            if refs.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Warning,
                    "No capability binding was recorded in step metrics.",
                    &["capability_binding"],
                );
            }
            let summary = format!(
                "{} capability binding reference(s) were recorded.",
                refs.len()
            );
            Verdict::pass(summary, refs)
        },
    },
    Rule {
        key: "permission_scope",
        label: "Permission scope",
        applies: Applies::When(
            |cx| cx.g.versioned_subject || cx.g.tool_calls,
            "The run has no agent, workflow or tool permission surface.",
        ),
        check: |cx| {
            let refs = dedup(refs_under(&cx.metrics, &PERMISSION_KEYS));
            if refs.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Warning,
                    "No permission or policy decision was recorded in step metrics.",
                    &["permission_scope"],
                );
            }
            let summary = format!(
                "{} permission or policy decision reference(s) were recorded.",
                refs.len()
            );
            Verdict::pass(summary, refs)
        },
    },
    Rule {
        key: "secret_boundary",
        label: "Secret boundary",
        applies: Applies::When(
            |cx| {
                cx.g.tool_governance
                    || !cx.secret_ids.is_empty()
                    || cx.has_secret_key
                    || cx.leaked_secret
            },
            "The run has no governed tool secret surface.",
        ),
        check: |cx| {
            if cx.leaked_secret {
                Verdict::new(
                    ItemStatus::Fail,
                    "An audit payload contains a plaintext credential.",
                    cx.secret_ids.clone(),
                    &["redaction"],
                )
            } else if !cx.secret_ids.is_empty() || cx.has_secret_key {
                Verdict::pass(
                    "Secret references were recorded; no audit payload holds a credential.",
                    cx.secret_ids.clone(),
                )
            } else {
                Verdict::lacking(
                    ItemStatus::Warning,
                    "No secret reference was recorded for the run.",
                    &["secret_id"],
                )
            }
        },
    },
    Rule {
        key: "egress_policy",
        label: "Egress policy",
        applies: Applies::When(
            |cx| cx.g.tool_governance || cx.has_egress_evidence,
            "The run has no governed tool egress surface.",
        ),
        check: |cx| {
            if cx.has_egress_evidence {
                Verdict::pass(
                    "Egress decision evidence was recorded.",
                    cx.egress_refs.clone(),
                )
            } else {
                Verdict::lacking(
                    ItemStatus::Warning,
                    "No egress decision was recorded for the run.",
                    &["egress_decision"],
                )
            }
        },
    },
    Rule {
        key: "audit_record",
        label: "Audit record",
        applies: Applies::When(
            |cx| cx.g.tool_governance,
            "The run has no governed tool activity that needs an audit record.",
        ),
        check: |cx| {
            let audits = &cx.facts.audits;
            if audits.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Fail,
                    "No audit records are attached.",
                    &["audits"],
                );
            }
            let refs = audits
                .iter()
                // An audit without a step is named by its own id, so every ref names one.
                .map(|a| {
                    format!(
                        "{}:{}",
                        cx.facts.run_id,
                        a.step_id.as_ref().unwrap_or(&a.id)
                    )
                })
                .collect();
            Verdict::pass(
                format!("{} audit record(s) are attached.", audits.len()),
                refs,
            )
        },
    },
    Rule {
        key: "cost_attribution",
        label: "Cost attribution",
        applies: Applies::When(
            |cx| cx.g.cost_attribution,
            "The run has no metered model, retrieval or rerank step.",
        ),
        check: |cx| {
            let costs = &cx.facts.cost_ids;
            if costs.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Fail,
                    "No cost records are attached.",
                    &["costs"],
                );
            }
            Verdict::pass(
                format!("{} cost record(s) are attached.", costs.len()),
                costs.clone(),
            )
        },
    },
    Rule {
        key: "trace_timeline",
        label: "Trace timeline",
        applies: Applies::Always,
        check: |cx| {
            let (steps, responses) = (&cx.facts.steps, &cx.facts.response_event_ids);
            if steps.is_empty() && responses.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Fail,
                    "No steps or response events are attached.",
                    &["steps", "response_events"],
                );
            }
            let summary = format!(
                "{} step(s) and {} response event(s) are attached.",
                steps.len(),
                responses.len()
            );
            let refs = steps.iter().map(|s| s.id.clone());
            Verdict::pass(summary, refs.chain(responses.iter().cloned()).collect())
        },
    },
    Rule {
        key: "tool_call",
        label: "Tool call",
        // Tool calls (own or reused) count as tool governance, so they are always checked.
        applies: Applies::When(|cx| cx.g.tool_governance, "The run made no tool calls."),
        check: tool_call,
    },
    Rule {
        key: "knowledge_citation",
        label: "Knowledge citation",
        applies: Applies::When(
            |cx| cx.g.knowledge_citation,
            "The run has no retrieval or rerank step.",
        ),
        check: |cx| {
            let citations = &cx.facts.citations;
            if citations.is_empty() {
                return Verdict::lacking(
                    ItemStatus::Fail,
                    "No citations are attached.",
                    &["citations"],
                );
            }
            let summary = format!("{} citation(s) are attached.", citations.len());
            Verdict::pass(summary, citations.iter().flat_map(citation_refs).collect())
        },
    },
    Rule {
        key: "child_workflow",
        label: "Child workflow",
        applies: Applies::When(|cx| cx.g.children, "The run has no child runs."),
        check: |cx| {
            let children = &cx.facts.child_run_ids;
            let summary = format!("{} child run(s) are attached.", children.len());
            Verdict::pass(summary, children.clone())
        },
    },
    Rule {
        key: "replay_ready",
        label: "Replay ready",
        applies: Applies::Always,
        check: |cx| {
            let refs = vec![cx.facts.run_id.clone()];
            let missing = replay_missing(cx.facts);
            if missing.is_empty() {
                return Verdict::pass("The run has the evidence needed to replay it.", refs);
            }
            let summary = format!(
                "The run is missing replay evidence: {}.",
                missing.join(", ")
            );
            Verdict::new(ItemStatus::Fail, summary, refs, &missing)
        },
    },
];

fn actor_scope(cx: &Context) -> Verdict {
    let f = cx.facts;
    let user_id = f.user_id.as_deref().unwrap_or("");
    let missing: Vec<&'static str> = [
        ("tenant_id", f.tenant_id.as_str()),
        ("workspace_id", f.workspace_id.as_str()),
        ("user_id", user_id),
        ("run_id", f.run_id.as_str()),
    ]
    .into_iter()
    .filter(|(_, v)| v.is_empty())
    .map(|(name, _)| name)
    .collect();
    let refs = present(&[
        Some(&f.tenant_id),
        Some(&f.workspace_id),
        f.user_id.as_ref(),
        Some(&f.run_id),
    ]);
    if missing.is_empty() {
        let summary = "The run is bound to its tenant, workspace, user and run ids.";
        return Verdict::pass(summary, refs);
    }
    let summary = format!("The run's scope is missing {}.", missing.join(", "));
    Verdict::new(ItemStatus::Fail, summary, refs, &missing)
}

fn subject_version(cx: &Context) -> Verdict {
    let f = cx.facts;
    let fields = [
        ("subject_kind", Some(&f.subject_kind)),
        ("subject_id", f.subject_id.as_ref()),
        ("subject_version_id", f.subject_version_id.as_ref()),
    ];
    let missing: Vec<&'static str> = fields
        .iter()
        .filter(|(_, v)| v.is_none_or(|s| s.is_empty()))
        .map(|(name, _)| *name)
        .collect();
    let refs = present(&fields.map(|(_, v)| v));
    if missing.is_empty() {
        return Verdict::pass("The run is pinned to a subject version.", refs);
    }
    let summary = format!("The run's subject is missing {}.", missing.join(", "));
    Verdict::new(ItemStatus::Fail, summary, refs, &missing)
}

fn tool_call(cx: &Context) -> Verdict {
    let (own, reused) = (&cx.facts.tool_call_ids, &cx.facts.reused_tool_calls);
    let summary = match (own.len(), reused.len()) {
        (0, 0) => {
            return Verdict::lacking(
                ItemStatus::Fail,
                "Tool activity was recorded but no tool call record is attached.",
                &["tool_calls"],
            )
        }
        (own, 0) => format!("{own} tool call record(s) are attached."),
        (0, n) => format!("{n} tool call result(s) were reused from the source run."),
        (own, n) => format!(
            "{own} tool call record(s) are attached; {n} result(s) were reused from the source run."
        ),
    };
    let refs = own
        .iter()
        .cloned()
        .chain(reused.iter().map(ReusedCall::reference));
    Verdict::pass(summary, refs.collect())
}

/// The six replay_ready criteria in order (steps, response_events, costs, citations,
/// tool_calls, audits), each only where applicable, then "inputs" when !inputs_recoverable.
pub fn replay_missing(facts: &RunFacts) -> Vec<&'static str> {
    let g = Guards::of(facts);
    [
        ("steps", facts.steps.is_empty()),
        (
            "response_events",
            g.response_timeline && facts.response_event_ids.is_empty(),
        ),
        ("costs", g.cost_attribution && facts.cost_ids.is_empty()),
        (
            "citations",
            g.knowledge_citation && facts.citations.is_empty(),
        ),
        (
            "tool_calls",
            g.tool_governance
                && facts.tool_call_ids.is_empty()
                && facts.reused_tool_calls.is_empty(),
        ),
        ("audits", g.tool_governance && facts.audits.is_empty()),
        // And the inputs: a re-run (retry or replay) starts from the exact original inputs.
        ("inputs", !facts.inputs_recoverable),
    ]
    .into_iter()
    .filter(|(_, missing)| *missing)
    .map(|(name, _)| name)
    .collect()
}

/// {"status": "pass"|"fail", "missing": [...]}
pub fn replay_ready(facts: &RunFacts) -> Value {
    let missing = replay_missing(facts);
    let status = if missing.is_empty() {
        ItemStatus::Pass
    } else {
        ItemStatus::Fail
    };
    json!({"status": status.as_str(), "missing": missing})
}

/// The given values that are set and non-empty, in order.
fn present(values: &[Option<&String>]) -> Vec<String> {
    values
        .iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .map(|s| (*s).clone())
        .collect()
}

/// `refs` without repeats, first occurrence kept.
fn dedup(refs: Vec<String>) -> Vec<String> {
    let mut seen = HashSet::new();
    refs.into_iter()
        .filter(|r| seen.insert(r.clone()))
        .collect()
}

/// Every value under a key in `keys` at any depth, also looking inside matched values.
fn values_under<'a>(roots: &[&'a Value], keys: &[&str]) -> Vec<&'a Value> {
    fn walk<'a>(v: &'a Value, keys: &[&str], out: &mut Vec<&'a Value>) {
        match v {
            Value::Object(map) => {
                for (k, item) in map {
                    if keys.contains(&k.as_str()) {
                        out.push(item);
                    }
                    walk(item, keys, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|item| walk(item, keys, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    roots.iter().for_each(|v| walk(v, keys, &mut out));
    out
}

/// The values under `keys` in `roots`, as reference strings.
fn refs_under(roots: &[&Value], keys: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    values_under(roots, keys)
        .into_iter()
        .for_each(|v| push_refs(v, &mut out));
    out
}

/// Strings as they are, arrays element by element, other values as their JSON text. Null and
/// empty strings are skipped: an absent value is no evidence.
fn push_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Null => {}
        Value::String(s) if s.is_empty() => {}
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|item| push_refs(item, out)),
        other => out.push(canonical(other)),
    }
}

/// Whether `v` has a key in `keys` at any depth.
fn has_key(v: &Value, keys: &[&str]) -> bool {
    match v {
        Value::Object(map) => map
            .iter()
            .any(|(k, item)| keys.contains(&k.as_str()) || has_key(item, keys)),
        Value::Array(items) => items.iter().any(|item| has_key(item, keys)),
        _ => false,
    }
}

/// Every string value in `v` at any depth. Object keys are not values: taken as values, a key
/// could count as a leak, a secret's name or a URL.
fn string_values(v: &Value) -> Vec<&str> {
    fn walk<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Object(map) => map.values().for_each(|item| walk(item, out)),
            Value::Array(items) => items.iter().for_each(|item| walk(item, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut out);
    out
}

/// The first of the citation's chunk_id, document_id and knowledge_id that gives a reference,
/// else its record id (a position in the list would name nothing).
fn citation_refs(c: &CitationFact) -> Vec<String> {
    ["chunk_id", "document_id", "knowledge_id"]
        .iter()
        .filter_map(|k| c.citation.get(k))
        .map(|v| {
            let mut out = Vec::new();
            push_refs(v, &mut out);
            out
        })
        .find(|refs| !refs.is_empty())
        .unwrap_or_else(|| vec![c.id.clone()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::parse;
    use ItemStatus::*;

    const KEYS: [&str; 13] = [
        "actor_scope",
        "subject_version",
        "capability_binding",
        "permission_scope",
        "secret_boundary",
        "egress_policy",
        "audit_record",
        "cost_attribution",
        "trace_timeline",
        "tool_call",
        "knowledge_citation",
        "child_workflow",
        "replay_ready",
    ];

    fn ids(values: &[&str]) -> Vec<String> {
        values.iter().map(|v| (*v).to_owned()).collect()
    }

    fn step(id: &str, step_type: &str, metrics: Value) -> StepFact {
        StepFact {
            id: id.into(),
            step_type: step_type.into(),
            metrics,
        }
    }

    fn audit(id: &str, step_id: Option<&str>, payload: Value) -> AuditFact {
        AuditFact {
            id: id.into(),
            step_id: step_id.map(Into::into),
            payload,
        }
    }

    fn cite(id: &str, citation: Value) -> CitationFact {
        CitationFact {
            id: id.into(),
            citation,
        }
    }

    /// A run that is neither versioned nor conversational, with nothing attached.
    fn plain() -> RunFacts {
        RunFacts {
            run_id: "run_1".into(),
            tenant_id: "ten_1".into(),
            workspace_id: "ws_1".into(),
            user_id: Some("usr_1".into()),
            mode: "task".into(),
            kind: "task".into(),
            subject_kind: "document".into(),
            inputs_recoverable: true,
            ..RunFacts::default()
        }
    }

    /// `plain` with one step of each given type, empty metrics.
    fn with_steps(types: &[&str]) -> RunFacts {
        RunFacts {
            steps: types
                .iter()
                .enumerate()
                .map(|(i, t)| step(&format!("stp_{i}"), t, json!({})))
                .collect(),
            ..plain()
        }
    }

    /// An agent run with every kind of evidence attached.
    fn full_agent() -> RunFacts {
        RunFacts {
            mode: "agent".into(),
            kind: "agent".into(),
            subject_kind: "agent".into(),
            subject_id: Some("agt_1".into()),
            subject_version_id: Some("agv_1".into()),
            steps: vec![
                step(
                    "stp_1",
                    "llm",
                    json!({"model_ref": "mdl_1", "permission_scope": {"tools": ["search"]}}),
                ),
                step("stp_2", "retrieval", json!({"knowledge_refs": ["kb_1"]})),
                step(
                    "stp_3",
                    "tool",
                    json!({
                        "capability_binding": "cap_search",
                        "policy_decision": "allow",
                        "secret_id": "sec_abc",
                        "egress_decision": "allow",
                        "url": "https://api.example.com/search",
                    }),
                ),
            ],
            audits: vec![audit(
                "aud_1",
                Some("stp_3"),
                json!({
                    "request": {"query": "rust", "api_key": "[REDACTED]"},
                    "response": {"status": 200},
                }),
            )],
            cost_ids: ids(&["cost_1", "cost_2"]),
            tool_call_ids: ids(&["tc_1"]),
            citations: vec![cite("cit_1", json!({"chunk_id": "chk_1"}))],
            response_event_ids: ids(&["rev_1"]),
            child_run_ids: ids(&["run_child"]),
            ..plain()
        }
    }

    fn item(facts: &RunFacts, key: &str) -> Item {
        evidence(facts).into_iter().find(|i| i.key == key).unwrap()
    }

    fn status(facts: &RunFacts, key: &str) -> ItemStatus {
        item(facts, key).status
    }

    #[test]
    fn thirteen_items_in_order_with_their_labels() {
        let items = evidence(&plain());
        let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
        assert_eq!(keys, KEYS);
        let labels: Vec<&str> = items.iter().map(|i| i.label).collect();
        assert_eq!(
            labels,
            [
                "Actor and scope",
                "Subject version",
                "Capability binding",
                "Permission scope",
                "Secret boundary",
                "Egress policy",
                "Audit record",
                "Cost attribution",
                "Trace timeline",
                "Tool call",
                "Knowledge citation",
                "Child workflow",
                "Replay ready",
            ]
        );
    }

    #[test]
    fn status_strings() {
        assert_eq!(Pass.as_str(), "pass");
        assert_eq!(Warning.as_str(), "warning");
        assert_eq!(Fail.as_str(), "fail");
        assert_eq!(NotApplicable.as_str(), "not_applicable");
    }

    #[test]
    fn item_json_shape() {
        let facts = RunFacts {
            audits: vec![audit("aud_1", Some("stp_1"), json!({}))],
            ..plain()
        };
        assert_eq!(
            item(&facts, "audit_record").to_json(),
            json!({
                "key": "audit_record",
                "status": "pass",
                "label": "Audit record",
                "summary": "1 audit record(s) are attached.",
                "evidence_refs": ["run_1:stp_1"],
                "missing": [],
            })
        );
        let tool_call = item(&facts, "tool_call").to_json();
        assert_eq!(tool_call["status"], json!("fail"));
        assert_eq!(tool_call["missing"], json!(["tool_calls"]));
    }

    #[test]
    fn summaries_are_deterministic() {
        assert_eq!(evidence(&full_agent()), evidence(&full_agent()));
        assert_eq!(evidence(&plain()), evidence(&plain()));
    }

    #[test]
    fn actor_scope() {
        let ok = item(&plain(), "actor_scope");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["ten_1", "ws_1", "usr_1", "run_1"]));
        assert!(ok.missing.is_empty());

        let facts = RunFacts {
            tenant_id: String::new(),
            user_id: None,
            ..plain()
        };
        let bad = item(&facts, "actor_scope");
        assert_eq!(bad.status, Fail);
        assert_eq!(bad.missing, ids(&["tenant_id", "user_id"]));
        assert_eq!(bad.evidence_refs, ids(&["ws_1", "run_1"]));
        assert_eq!(
            bad.summary,
            "The run's scope is missing tenant_id, user_id."
        );

        // An empty user id is as missing as none.
        let facts = RunFacts {
            user_id: Some(String::new()),
            ..plain()
        };
        assert_eq!(item(&facts, "actor_scope").missing, ids(&["user_id"]));
    }

    #[test]
    fn subject_version() {
        let na = item(&plain(), "subject_version");
        assert_eq!(na.status, NotApplicable);
        assert!(na.evidence_refs.is_empty() && na.missing.is_empty());

        // Any of kind, mode or subject_kind naming an agent or a workflow makes it applicable.
        for (kind, mode, subject_kind) in [
            ("agent", "task", "document"),
            ("task", "workflow", "document"),
            ("task", "task", "agent"),
        ] {
            let facts = RunFacts {
                kind: kind.into(),
                mode: mode.into(),
                subject_kind: subject_kind.into(),
                subject_id: Some("sub_1".into()),
                ..plain()
            };
            let bad = item(&facts, "subject_version");
            assert_eq!(bad.status, Fail, "{kind} {mode} {subject_kind}");
            assert_eq!(bad.missing, ids(&["subject_version_id"]));
            assert_eq!(bad.evidence_refs, ids(&[subject_kind, "sub_1"]));
        }
        // Chat is not a versioned subject.
        let facts = RunFacts {
            mode: "chat".into(),
            ..plain()
        };
        assert_eq!(status(&facts, "subject_version"), NotApplicable);

        let ok = item(&full_agent(), "subject_version");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["agent", "agt_1", "agv_1"]));
        assert!(ok.missing.is_empty());

        let facts = RunFacts {
            kind: "workflow".into(),
            subject_kind: String::new(),
            ..plain()
        };
        assert_eq!(
            item(&facts, "subject_version").missing,
            ids(&["subject_kind", "subject_id", "subject_version_id"])
        );
    }

    #[test]
    fn capability_binding() {
        assert_eq!(status(&plain(), "capability_binding"), NotApplicable);
        // Tool steps and audits alone do not make it applicable; tool calls and child runs do.
        let facts = RunFacts {
            audits: vec![audit("aud_1", None, json!({"model_ref": "mdl_1"}))],
            ..with_steps(&["tool"])
        };
        assert_eq!(status(&facts, "capability_binding"), NotApplicable);
        for facts in [
            RunFacts {
                tool_call_ids: ids(&["tc_1"]),
                ..plain()
            },
            RunFacts {
                child_run_ids: ids(&["run_2"]),
                ..plain()
            },
            RunFacts {
                kind: "agent".into(),
                ..plain()
            },
        ] {
            let warn = item(&facts, "capability_binding");
            assert_eq!(warn.status, Warning);
            assert_eq!(warn.missing, ids(&["capability_binding"]));
            assert!(warn.evidence_refs.is_empty());
        }
        // Only step metrics count, not audit payloads.
        let facts = RunFacts {
            kind: "agent".into(),
            audits: vec![audit("aud_1", None, json!({"tool_refs": ["t"]}))],
            ..plain()
        };
        assert_eq!(status(&facts, "capability_binding"), Warning);

        let facts = RunFacts {
            kind: "agent".into(),
            steps: vec![
                step("stp_1", "llm", json!({"model_ref": "mdl_1"})),
                step(
                    "stp_2",
                    "tool",
                    json!({"tool_refs": ["tool_a", "tool_b"], "workflow_refs": "wf_1"}),
                ),
                step("stp_3", "plan", json!({"knowledge_refs": ["kb_1"]})),
            ],
            ..plain()
        };
        let ok = item(&facts, "capability_binding");
        assert_eq!(ok.status, Pass);
        assert_eq!(
            ok.evidence_refs,
            ids(&["mdl_1", "tool_a", "tool_b", "wf_1", "kb_1"])
        );
        assert_eq!(
            ok.summary,
            "5 capability binding reference(s) were recorded."
        );
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn reference_values_are_converted_to_strings() {
        let metrics = parse(
            r#"{"bindings": {"model_ref": 1.50, "tool_refs": [true, ["x", 7], {"b": 1, "a": "z"}]},
                "capability_binding": null, "workflow_refs": "", "knowledge_refs": []}"#,
        )
        .unwrap();
        let facts = RunFacts {
            kind: "agent".into(),
            steps: vec![step("stp_1", "llm", metrics)],
            ..plain()
        };
        let refs = item(&facts, "capability_binding").evidence_refs;
        // The matched object first (as its canonical JSON), then the values found inside it.
        // Null, empty strings and empty arrays give nothing.
        assert_eq!(
            refs,
            ids(&[
                r#"{"model_ref":1.50,"tool_refs":[true,["x",7],{"a":"z","b":1}]}"#,
                "1.50",
                "true",
                "x",
                "7",
                r#"{"a":"z","b":1}"#,
            ])
        );

        let facts = RunFacts {
            kind: "agent".into(),
            steps: vec![step(
                "stp_1",
                "llm",
                json!({"model_ref": null, "tool_refs": [], "bindings": ""}),
            )],
            ..plain()
        };
        assert_eq!(status(&facts, "capability_binding"), Warning);
    }

    #[test]
    fn permission_scope() {
        assert_eq!(status(&plain(), "permission_scope"), NotApplicable);
        // Child runs make capability binding applicable, not permission scope.
        let facts = RunFacts {
            child_run_ids: ids(&["run_2"]),
            ..with_steps(&["tool"])
        };
        assert_eq!(status(&facts, "permission_scope"), NotApplicable);

        let facts = RunFacts {
            tool_call_ids: ids(&["tc_1"]),
            audits: vec![audit("aud_1", None, json!({"policy_decision": "allow"}))],
            ..plain()
        };
        let warn = item(&facts, "permission_scope");
        assert_eq!(warn.status, Warning, "audit payloads do not count");
        assert_eq!(warn.missing, ids(&["permission_scope"]));

        let facts = RunFacts {
            mode: "workflow".into(),
            steps: vec![step(
                "stp_1",
                "tool",
                json!({"rbac": "role:reader", "resource_grant": ["g1"], "policy_decision": "allow"}),
            )],
            ..plain()
        };
        let ok = item(&facts, "permission_scope");
        assert_eq!(ok.status, Pass);
        // Keys of one object come in byte order (serde_json maps are sorted).
        assert_eq!(ok.evidence_refs, ids(&["allow", "role:reader", "g1"]));
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn secret_boundary() {
        assert_eq!(status(&plain(), "secret_boundary"), NotApplicable);

        let warn = item(&with_steps(&["tool"]), "secret_boundary");
        assert_eq!(warn.status, Warning);
        assert_eq!(warn.missing, ids(&["secret_id"]));
        assert!(warn.evidence_refs.is_empty());

        // Secret ids in metrics or audits: only `sec_` strings are references.
        let facts = RunFacts {
            steps: vec![step(
                "stp_1",
                "tool",
                json!({"secret_ids": ["sec_a", "other", {"x": "sec_b"}], "credential_secret_id": 5}),
            )],
            audits: vec![audit("aud_1", None, json!({"secret_id": "sec_c"}))],
            ..plain()
        };
        let ok = item(&facts, "secret_boundary");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["sec_a", "sec_b", "sec_c"]));
        assert!(ok.missing.is_empty());

        // A secret reference key alone passes, with no refs.
        let facts = RunFacts {
            audits: vec![audit(
                "aud_1",
                None,
                json!({"args": {"credential_ref": {"name": "x"}}}),
            )],
            ..plain()
        };
        let ok = item(&facts, "secret_boundary");
        assert_eq!(ok.status, Pass);
        assert!(ok.evidence_refs.is_empty());

        // Secret evidence alone makes it applicable.
        let facts = RunFacts {
            steps: vec![step("stp_1", "llm", json!({"secret_ref": "vault"}))],
            ..plain()
        };
        assert_eq!(status(&facts, "secret_boundary"), Pass);
    }

    #[test]
    fn secret_boundary_ignores_words_and_keys_that_merely_contain_sk() {
        let facts = RunFacts {
            steps: vec![step("stp_1", "tool", json!({"secret_id": "sec_a"}))],
            audits: vec![audit(
                "aud_1",
                Some("stp_1"),
                json!({
                    "task": "task-1",
                    "metric": "disk-usage",
                    "sk-thing": "value",
                    "sk-proj-abcdefghijklmnopqrstuvwxyz012345": 1,
                    "note": ["risk-free", "ask-me-abcdefghijklmnopqrstuvwxyz", "sk-short"],
                    "header": "[REDACTED]",
                    "text": "the Bearer of bad news",
                }),
            )],
            ..plain()
        };
        let ok = item(&facts, "secret_boundary");
        assert_eq!(ok.status, Pass);
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn secret_boundary_fails_on_a_surviving_credential() {
        for leak in [
            json!({"request": {"key": "sk-proj-abcdefghijklmnopqrstuvwxyz012345"}}),
            json!({"headers": ["Authorization: Bearer abcdefgh12345678"]}),
            json!({"nested": [[{"v": "AKIAABCDEFGHIJKLMNOP"}]]}),
        ] {
            let facts = RunFacts {
                steps: vec![step("stp_1", "tool", json!({"secret_id": "sec_a"}))],
                audits: vec![audit("aud_1", Some("stp_1"), leak.clone())],
                ..plain()
            };
            let bad = item(&facts, "secret_boundary");
            assert_eq!(bad.status, Fail, "{leak}");
            assert_eq!(bad.missing, ids(&["redaction"]));
            assert_eq!(bad.evidence_refs, ids(&["sec_a"]));
        }
        // Only audit payloads are checked.
        let facts = RunFacts {
            steps: vec![step(
                "stp_1",
                "tool",
                json!({"note": "sk-proj-abcdefghijklmnopqrstuvwxyz012345"}),
            )],
            ..plain()
        };
        assert_eq!(status(&facts, "secret_boundary"), Warning);
    }

    #[test]
    fn egress_policy() {
        assert_eq!(status(&plain(), "egress_policy"), NotApplicable);

        let warn = item(&with_steps(&["tool"]), "egress_policy");
        assert_eq!(warn.status, Warning);
        assert_eq!(warn.missing, ids(&["egress_decision"]));
        assert!(warn.evidence_refs.is_empty());

        // Egress values first, then URLs, from metrics then audits.
        let facts = RunFacts {
            steps: vec![step(
                "stp_1",
                "tool",
                json!({"endpoint": "https://a.example/x", "egress_policy": "allowlist"}),
            )],
            audits: vec![audit(
                "aud_1",
                Some("stp_1"),
                json!({"egress": {"host": "a.example"}, "url": "http://b.example", "path": "/x"}),
            )],
            ..plain()
        };
        let ok = item(&facts, "egress_policy");
        assert_eq!(ok.status, Pass);
        assert_eq!(
            ok.evidence_refs,
            ids(&[
                "allowlist",
                r#"{"host":"a.example"}"#,
                "https://a.example/x",
                "http://b.example",
            ])
        );
        assert!(ok.missing.is_empty());

        // The key alone is evidence, even with a null value.
        let facts = RunFacts {
            audits: vec![audit("aud_1", None, json!({"egress_decision": null}))],
            ..plain()
        };
        let ok = item(&facts, "egress_policy");
        assert_eq!(ok.status, Pass);
        assert!(ok.evidence_refs.is_empty());

        // Egress evidence alone makes it applicable; URL matching is by prefix.
        let facts = RunFacts {
            steps: vec![step(
                "stp_1",
                "llm",
                json!({"source": "https://docs.example"}),
            )],
            ..plain()
        };
        assert_eq!(status(&facts, "egress_policy"), Pass);
        let facts = RunFacts {
            steps: vec![step(
                "stp_1",
                "llm",
                json!({"source": "see https://docs.example"}),
            )],
            ..plain()
        };
        assert_eq!(status(&facts, "egress_policy"), NotApplicable);
    }

    #[test]
    fn the_bare_decision_key_is_not_egress_evidence() {
        let facts = RunFacts {
            steps: vec![step("stp_1", "tool", json!({"decision": "allow"}))],
            audits: vec![audit(
                "aud_1",
                Some("stp_1"),
                json!({"policy": {"decision": "deny"}}),
            )],
            ..plain()
        };
        let warn = item(&facts, "egress_policy");
        assert_eq!(warn.status, Warning);
        assert!(warn.evidence_refs.is_empty());
        assert_eq!(warn.missing, ids(&["egress_decision"]));
        // Nor does it make egress applicable on its own.
        let facts = RunFacts {
            steps: vec![step("stp_1", "llm", json!({"decision": "allow"}))],
            ..plain()
        };
        assert_eq!(status(&facts, "egress_policy"), NotApplicable);
    }

    #[test]
    fn audit_record() {
        let na = item(&with_steps(&["llm"]), "audit_record");
        assert_eq!(na.status, NotApplicable);
        assert!(na.missing.is_empty());

        for facts in [
            with_steps(&["tool"]),
            RunFacts {
                tool_call_ids: ids(&["tc_1"]),
                ..plain()
            },
        ] {
            let bad = item(&facts, "audit_record");
            assert_eq!(bad.status, Fail);
            assert_eq!(bad.missing, ids(&["audits"]));
            assert!(bad.evidence_refs.is_empty());
        }

        let facts = RunFacts {
            audits: vec![
                audit("aud_1", Some("stp_3"), json!({})),
                audit("aud_2", None, json!({})),
                audit("aud_3", Some("stp_3"), json!({})),
            ],
            ..plain()
        };
        let ok = item(&facts, "audit_record");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.summary, "3 audit record(s) are attached.");
        assert_eq!(ok.evidence_refs, ids(&["run_1:stp_3", "run_1:aud_2"]));
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn cost_attribution() {
        for types in [&["tool"][..], &["plan", "tool"], &[]] {
            assert_eq!(
                status(&with_steps(types), "cost_attribution"),
                NotApplicable
            );
        }
        for metered in ["llm", "retrieval", "rerank"] {
            let bad = item(&with_steps(&["tool", metered]), "cost_attribution");
            assert_eq!(bad.status, Fail, "{metered}");
            assert_eq!(bad.missing, ids(&["costs"]));
        }
        let facts = RunFacts {
            cost_ids: ids(&["cost_1", "cost_2"]),
            ..with_steps(&["llm"])
        };
        let ok = item(&facts, "cost_attribution");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["cost_1", "cost_2"]));
        assert_eq!(ok.summary, "2 cost record(s) are attached.");
        // Costs both make the item applicable and satisfy it.
        let facts = RunFacts {
            cost_ids: ids(&["cost_1"]),
            ..plain()
        };
        assert_eq!(status(&facts, "cost_attribution"), Pass);
    }

    #[test]
    fn trace_timeline() {
        let bad = item(&plain(), "trace_timeline");
        assert_eq!(bad.status, Fail);
        assert_eq!(bad.missing, ids(&["steps", "response_events"]));

        let ok = item(&with_steps(&["llm", "tool"]), "trace_timeline");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["stp_0", "stp_1"]));
        assert_eq!(
            ok.summary,
            "2 step(s) and 0 response event(s) are attached."
        );

        let facts = RunFacts {
            response_event_ids: ids(&["rev_1"]),
            ..plain()
        };
        assert_eq!(status(&facts, "trace_timeline"), Pass);

        let facts = RunFacts {
            response_event_ids: ids(&["rev_1", "rev_2"]),
            ..with_steps(&["llm"])
        };
        let ok = item(&facts, "trace_timeline");
        assert_eq!(ok.evidence_refs, ids(&["stp_0", "rev_1", "rev_2"]));
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn tool_call() {
        assert_eq!(status(&with_steps(&["llm"]), "tool_call"), NotApplicable);
        for facts in [
            with_steps(&["tool"]),
            RunFacts {
                audits: vec![audit("aud_1", None, json!({}))],
                ..plain()
            },
        ] {
            let bad = item(&facts, "tool_call");
            assert_eq!(bad.status, Fail);
            assert_eq!(bad.missing, ids(&["tool_calls"]));
        }
        let facts = RunFacts {
            tool_call_ids: ids(&["tc_1", "tc_2"]),
            ..with_steps(&["tool", "tool"])
        };
        let ok = item(&facts, "tool_call");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["tc_1", "tc_2"]));
        assert_eq!(ok.summary, "2 tool call record(s) are attached.");
    }

    #[test]
    fn a_rerun_shows_the_tool_results_it_reused_from_its_source() {
        let reused = |id: &str| ReusedCall {
            tool_call_record_id: id.into(),
            source_run_id: "run_0".into(),
        };
        // Attempt 2 made no call of its own: every result came from attempt 1.
        let facts = RunFacts {
            reused_tool_calls: vec![reused("tc_1"), reused("tc_2")],
            audits: vec![audit("aud_1", None, json!({}))],
            ..with_steps(&["llm"])
        };
        let ok = item(&facts, "tool_call");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["run_0:tc_1", "run_0:tc_2"]));
        assert_eq!(
            ok.summary,
            "2 tool call result(s) were reused from the source run."
        );
        assert_eq!(replay_missing(&facts), ["costs"]);
        let facts = RunFacts {
            tool_call_ids: ids(&["tc_3"]),
            ..facts
        };
        let ok = item(&facts, "tool_call");
        assert_eq!(ok.evidence_refs, ids(&["tc_3", "run_0:tc_1", "run_0:tc_2"]));
        assert_eq!(
            ok.summary,
            "1 tool call record(s) are attached; 2 result(s) were reused from the source run."
        );
        // Reused calls are tool activity: they need their audit record like the run's own.
        let facts = RunFacts {
            reused_tool_calls: vec![reused("tc_1")],
            ..with_steps(&["plan"])
        };
        assert_eq!(status(&facts, "audit_record"), Fail);
        assert_eq!(replay_missing(&facts), ["audits"]);
    }

    #[test]
    fn knowledge_citation() {
        // An llm step is metered but not a retrieval.
        assert_eq!(
            status(&with_steps(&["llm"]), "knowledge_citation"),
            NotApplicable
        );
        for retrieval in ["retrieval", "rerank"] {
            let bad = item(&with_steps(&[retrieval]), "knowledge_citation");
            assert_eq!(bad.status, Fail);
            assert_eq!(bad.missing, ids(&["citations"]));
        }
        let facts = RunFacts {
            citations: vec![
                cite(
                    "cit_1",
                    json!({"chunk_id": "chk_1", "document_id": "doc_1"}),
                ),
                cite("cit_2", json!({"chunk_id": null, "document_id": "doc_2"})),
                cite("cit_3", json!({"chunk_id": "", "knowledge_id": 42})),
                cite("cit_4", json!({"title": "untitled"})),
                cite("cit_5", json!("not an object")),
                cite("cit_6", json!({"chunk_id": "chk_1"})),
            ],
            ..with_steps(&["retrieval"])
        };
        let ok = item(&facts, "knowledge_citation");
        assert_eq!(ok.status, Pass);
        assert_eq!(
            ok.evidence_refs,
            ids(&["chk_1", "doc_2", "42", "cit_4", "cit_5"])
        );
        assert_eq!(ok.summary, "6 citation(s) are attached.");
        // Citations alone make it applicable.
        let facts = RunFacts {
            citations: vec![cite("cit_1", json!({}))],
            ..plain()
        };
        assert_eq!(status(&facts, "knowledge_citation"), Pass);
    }

    #[test]
    fn child_workflow() {
        let na = item(&plain(), "child_workflow");
        assert_eq!(na.status, NotApplicable);
        assert!(na.missing.is_empty());
        let facts = RunFacts {
            child_run_ids: ids(&["run_2", "run_3"]),
            ..plain()
        };
        let ok = item(&facts, "child_workflow");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["run_2", "run_3"]));
        assert_eq!(ok.summary, "2 child run(s) are attached.");
        assert!(ok.missing.is_empty());
    }

    #[test]
    fn replay_ready_item_follows_replay_missing() {
        let ok = item(&with_steps(&["plan"]), "replay_ready");
        assert_eq!(ok.status, Pass);
        assert_eq!(ok.evidence_refs, ids(&["run_1"]));
        assert!(ok.missing.is_empty());

        let facts = RunFacts {
            inputs_recoverable: false,
            ..with_steps(&["llm"])
        };
        let bad = item(&facts, "replay_ready");
        assert_eq!(bad.status, Fail);
        assert_eq!(bad.missing, ids(&["costs", "inputs"]));
        assert_eq!(
            bad.summary,
            "The run is missing replay evidence: costs, inputs."
        );
        assert_eq!(bad.evidence_refs, ids(&["run_1"]));
    }

    #[test]
    fn replay_needs_steps() {
        assert_eq!(replay_missing(&plain()), ["steps"]);
        // Response events do not replace steps.
        let facts = RunFacts {
            response_event_ids: ids(&["rev_1"]),
            ..plain()
        };
        assert_eq!(replay_missing(&facts), ["steps"]);
        assert!(replay_missing(&with_steps(&["plan"])).is_empty());
    }

    #[test]
    fn replay_needs_response_events_for_conversational_runs() {
        for (kind, mode, subject_kind) in [
            ("chat", "task", "document"),
            ("task", "agent", "document"),
            ("task", "task", "response"),
            ("thread", "task", "document"),
        ] {
            let facts = RunFacts {
                kind: kind.into(),
                mode: mode.into(),
                subject_kind: subject_kind.into(),
                ..with_steps(&["plan"])
            };
            assert_eq!(replay_missing(&facts), ["response_events"]);
            let facts = RunFacts {
                response_event_ids: ids(&["rev_1"]),
                ..facts
            };
            assert!(replay_missing(&facts).is_empty());
        }
        // A workflow run is versioned but not conversational.
        let facts = RunFacts {
            mode: "workflow".into(),
            ..with_steps(&["plan"])
        };
        assert!(replay_missing(&facts).is_empty());
    }

    #[test]
    fn replay_needs_costs_for_metered_steps() {
        for metered in ["llm", "retrieval", "rerank"] {
            assert!(replay_missing(&with_steps(&[metered])).contains(&"costs"));
        }
        let facts = RunFacts {
            cost_ids: ids(&["cost_1"]),
            ..with_steps(&["llm"])
        };
        assert!(replay_missing(&facts).is_empty());
        assert!(!replay_missing(&with_steps(&["plan"])).contains(&"costs"));
    }

    #[test]
    fn replay_needs_citations_for_retrieval_steps() {
        for retrieval in ["retrieval", "rerank"] {
            assert_eq!(
                replay_missing(&with_steps(&[retrieval])),
                ["costs", "citations"]
            );
            let facts = RunFacts {
                cost_ids: ids(&["cost_1"]),
                citations: vec![cite("cit_1", json!({}))],
                ..with_steps(&[retrieval])
            };
            assert!(replay_missing(&facts).is_empty());
        }
        assert!(!replay_missing(&with_steps(&["llm"])).contains(&"citations"));
    }

    #[test]
    fn replay_needs_tool_calls_and_audits_for_tool_activity() {
        assert_eq!(
            replay_missing(&with_steps(&["tool"])),
            ["tool_calls", "audits"]
        );
        let facts = RunFacts {
            tool_call_ids: ids(&["tc_1"]),
            ..with_steps(&["plan"])
        };
        assert_eq!(replay_missing(&facts), ["audits"]);
        let facts = RunFacts {
            audits: vec![audit("aud_1", None, json!({}))],
            ..with_steps(&["plan"])
        };
        assert_eq!(replay_missing(&facts), ["tool_calls"]);
        let facts = RunFacts {
            tool_call_ids: ids(&["tc_1"]),
            audits: vec![audit("aud_1", None, json!({}))],
            ..with_steps(&["tool"])
        };
        assert!(replay_missing(&facts).is_empty());
    }

    #[test]
    fn replay_needs_recoverable_inputs_last() {
        let facts = RunFacts {
            mode: "chat".into(),
            inputs_recoverable: false,
            ..with_steps(&["tool", "retrieval"])
        };
        assert_eq!(
            replay_missing(&facts),
            [
                "response_events",
                "costs",
                "citations",
                "tool_calls",
                "audits",
                "inputs"
            ]
        );
        let facts = RunFacts {
            inputs_recoverable: false,
            ..plain()
        };
        assert_eq!(replay_missing(&facts), ["steps", "inputs"]);
        let facts = RunFacts {
            inputs_recoverable: false,
            ..full_agent()
        };
        assert_eq!(replay_missing(&facts), ["inputs"]);
    }

    #[test]
    fn replay_ready_json() {
        assert_eq!(
            replay_ready(&full_agent()),
            json!({"status": "pass", "missing": []})
        );
        let facts = RunFacts {
            inputs_recoverable: false,
            ..plain()
        };
        assert_eq!(
            replay_ready(&facts),
            json!({"status": "fail", "missing": ["steps", "inputs"]})
        );
    }

    #[test]
    fn evidence_refs_are_deduplicated_in_first_seen_order() {
        assert_eq!(
            dedup(ids(&["b", "a", "b", "c", "a"])),
            ids(&["b", "a", "c"])
        );
        let facts = RunFacts {
            cost_ids: ids(&["cost_2", "cost_1", "cost_2"]),
            response_event_ids: ids(&["stp_0", "rev_1"]),
            ..with_steps(&["llm"])
        };
        assert_eq!(
            item(&facts, "cost_attribution").evidence_refs,
            ids(&["cost_2", "cost_1"])
        );
        // The summary counts records, not distinct refs.
        assert_eq!(
            item(&facts, "cost_attribution").summary,
            "3 cost record(s) are attached."
        );
        assert_eq!(
            item(&facts, "trace_timeline").evidence_refs,
            ids(&["stp_0", "rev_1"])
        );
        let facts = RunFacts {
            kind: "agent".into(),
            steps: vec![
                step(
                    "stp_1",
                    "llm",
                    json!({"model_ref": "m2", "tool_refs": ["m1", "m2"]}),
                ),
                step("stp_2", "llm", json!({"model_ref": "m1"})),
            ],
            ..plain()
        };
        let cap = item(&facts, "capability_binding");
        assert_eq!(cap.evidence_refs, ids(&["m2", "m1"]));
        assert_eq!(
            cap.summary,
            "2 capability binding reference(s) were recorded."
        );
    }

    #[test]
    fn a_fully_evidenced_agent_run_passes_everything() {
        let items = evidence(&full_agent());
        for i in &items {
            assert_eq!(i.status, Pass, "{}: {}", i.key, i.summary);
            assert!(i.missing.is_empty(), "{}", i.key);
            assert!(!i.evidence_refs.is_empty(), "{}", i.key);
        }
        assert!(replay_missing(&full_agent()).is_empty());
        let refs = |key: &str| {
            items
                .iter()
                .find(|i| i.key == key)
                .unwrap()
                .evidence_refs
                .clone()
        };
        assert_eq!(
            refs("capability_binding"),
            ids(&["mdl_1", "kb_1", "cap_search"])
        );
        assert_eq!(
            refs("permission_scope"),
            ids(&[r#"{"tools":["search"]}"#, "allow"])
        );
        assert_eq!(refs("secret_boundary"), ids(&["sec_abc"]));
        assert_eq!(
            refs("egress_policy"),
            ids(&["allow", "https://api.example.com/search"])
        );
        assert_eq!(refs("audit_record"), ids(&["run_1:stp_3"]));
        assert_eq!(refs("knowledge_citation"), ids(&["chk_1"]));
        assert_eq!(refs("child_workflow"), ids(&["run_child"]));
    }

    #[test]
    fn a_bare_plain_run_is_mostly_not_applicable() {
        let items = evidence(&with_steps(&["plan"]));
        let statuses: Vec<(&str, ItemStatus)> = items.iter().map(|i| (i.key, i.status)).collect();
        assert_eq!(
            statuses,
            [
                ("actor_scope", Pass),
                ("subject_version", NotApplicable),
                ("capability_binding", NotApplicable),
                ("permission_scope", NotApplicable),
                ("secret_boundary", NotApplicable),
                ("egress_policy", NotApplicable),
                ("audit_record", NotApplicable),
                ("cost_attribution", NotApplicable),
                ("trace_timeline", Pass),
                ("tool_call", NotApplicable),
                ("knowledge_citation", NotApplicable),
                ("child_workflow", NotApplicable),
                ("replay_ready", Pass),
            ]
        );
        for i in &items {
            if i.status == NotApplicable {
                assert!(
                    i.evidence_refs.is_empty() && i.missing.is_empty(),
                    "{}",
                    i.key
                );
            }
        }
    }
}
