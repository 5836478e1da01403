/** Re-runs and a run's records: retryRun, replayRun, runEvidence, otelTrace; concurrency limits and budgets. */
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  InvalidArgumentError,
  LedgerError,
  NotFoundError,
  WrongStateError,
  work,
  type JsonObject,
  type RunContext,
} from "../src/index.js";
import { freshDb } from "./helpers.js";

test("retryRun and replayRun: new runs in the source's lineage, with its inputs or new ones", async (t) => {
  const db = await freshDb(t, "reruns");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-first", inputs: { order: 1042 }, userId: "u-1" });
  await acme.transitionRun("r-first", "failed", { errorCode: "UPSTREAM_TIMEOUT" });

  const retry = await acme.retryRun("r-first");
  assert.notEqual(retry.id, "r-first");
  assert.equal(retry.status, "queued");
  assert.equal(retry.sourceRunId, "r-first");
  assert.equal(retry.rootRunId, "r-first");
  assert.equal(retry.attemptNo, 2);
  assert.equal(retry.controlAction, "retry");
  assert.equal(retry.userId, "u-1");
  assert.deepEqual(retry.inputs, { order: 1042 }, "the source's inputs");
  assert.deepEqual(await acme.getRun(retry.id), retry);

  const replay = await acme.replayRun("r-first", { order: 1043 });
  assert.equal(replay.status, "queued");
  assert.equal(replay.sourceRunId, "r-first");
  assert.equal(replay.rootRunId, "r-first");
  assert.equal(replay.attemptNo, 2);
  assert.equal(replay.controlAction, "replay");
  assert.deepEqual(replay.inputs, { order: 1043 }, "inputs override the source's");

  // The retry, once failed itself, is retried as the third attempt of the same chain.
  await acme.transitionRun(retry.id, "failed");
  const third = await acme.retryRun(retry.id, { order: 1044 });
  assert.equal(third.sourceRunId, retry.id);
  assert.equal(third.rootRunId, "r-first");
  assert.equal(third.attemptNo, 3);
  assert.deepEqual(third.inputs, { order: 1044 });
  const chain = await acme.query("SELECT id FROM ledger.runs WHERE root_run_id = 'r-first' ORDER BY attempt_no, id");
  assert.equal(chain.length, 4);
});

test("retryRun and replayRun: typed errors for an unknown run or one that cannot be re-run", async (t) => {
  const db = await freshDb(t, "reruns_errors");
  const acme = db.ledger.scoped("acme", "ts");
  await assert.rejects(acme.retryRun("missing"), (e: unknown) => e instanceof NotFoundError && e.code === "RUN_NOT_FOUND");
  await assert.rejects(acme.replayRun("missing"), (e: unknown) => e instanceof NotFoundError && e.code === "RUN_NOT_FOUND");
  await acme.createRun("agent", { runId: "r-live" });
  await acme.transitionRun("r-live", "running");
  await assert.rejects(
    acme.replayRun("r-live"),
    (e: unknown) => e instanceof WrongStateError && e.sqlstate === "55000" && e.code === "RUN_NOT_RERUNNABLE",
  );
  await acme.transitionRun("r-live", "succeeded");
  await assert.rejects(
    acme.retryRun("r-live"),
    (e: unknown) => e instanceof WrongStateError && e.code === "RUN_NOT_RERUNNABLE" && e.detail["status"] === "succeeded",
  );
  assert.equal((await acme.replayRun("r-live")).controlAction, "replay", "a succeeded run can be replayed");
  assert.deepEqual(
    await db.sql("SELECT count(*)::int AS n FROM ledger.runs WHERE source_run_id IS NOT NULL"),
    [{ n: 1 }],
    "the refused calls wrote no run",
  );
});

test("runEvidence: the thirteen items in order, typed", async (t) => {
  const db = await freshDb(t, "evidence");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("chat", { runId: "r-ev", inputs: { q: 1 } });
  await acme.transitionRun("r-ev", "running");
  await acme.createStep("r-ev", "llm");
  await acme.recordResponseEvent("r-ev", "message", { text: "hi" });
  await acme.recordCost("r-ev", "tokens", 10, { amount: "0.001", currency: "USD" });
  await acme.transitionRun("r-ev", "succeeded");

  const evidence = await acme.runEvidence("r-ev");
  assert.deepEqual(
    evidence.map((e) => e.key),
    [
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
    ],
  );
  for (const item of evidence) {
    assert.ok(["pass", "warning", "fail", "not_applicable"].includes(item.status), `${item.key}: ${item.status}`);
    assert.equal(typeof item.label, "string");
    assert.equal(typeof item.summary, "string");
    assert.ok(Array.isArray(item.evidenceRefs) && Array.isArray(item.missing));
  }
  const byKey = new Map(evidence.map((e) => [e.key, e]));
  assert.equal(byKey.get("replay_ready")?.status, "pass");
  assert.equal(byKey.get("cost_attribution")?.status, "pass");
  assert.equal(byKey.get("tool_call")?.status, "not_applicable", "no tool activity");

  await assert.rejects(acme.runEvidence("missing"), (e: unknown) => e instanceof LedgerError && e.code === "RUN_NOT_FOUND");
});

/** The `{key, value: {stringValue | intValue | doubleValue | boolValue}}` list of OTLP/JSON, as a map. */
function attributes(holder: JsonObject): Map<string, unknown> {
  const list = (holder["attributes"] ?? []) as { key: string; value: Record<string, unknown> }[];
  return new Map(list.map((kv) => [kv.key, Object.values(kv.value)[0]]));
}

test("otelTrace: the run's spans as OTLP/JSON, the same every time", async (t) => {
  const db = await freshDb(t, "otel");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-otel", subjectId: "support-bot" });
  await acme.transitionRun("r-otel", "running");
  const step = await acme.createStep("r-otel", "llm", { stepId: "otel-llm", status: "running" });
  await acme.recordCost("r-otel", "tokens", 120, {
    amount: "0.0021",
    currency: "USD",
    stepId: step.id,
    usage: { input_tokens: 100, output_tokens: 20 },
    provider: "anthropic",
    modelRef: "claude-sonnet",
  });
  await acme.transitionStep(step.id, "succeeded");
  await acme.transitionRun("r-otel", "succeeded");

  const trace = await acme.otelTrace("r-otel", "support-agent");
  const resourceSpans = trace["resourceSpans"] as JsonObject[];
  assert.equal(resourceSpans.length, 1);
  const resource = resourceSpans[0]?.["resource"] as JsonObject;
  assert.equal(attributes(resource).get("service.name"), "support-agent");
  assert.equal(attributes(resource).get("ledger.tenant_id"), "acme");
  const scopeSpans = resourceSpans[0]?.["scopeSpans"] as JsonObject[];
  const spans = scopeSpans[0]?.["spans"] as JsonObject[];
  assert.deepEqual(
    spans.map((s) => s["name"]),
    ["invoke_agent support-bot", "chat claude-sonnet"],
  );
  const [run, chat] = spans as [JsonObject, JsonObject];
  assert.equal(attributes(run).get("ledger.run_id"), "r-otel");
  assert.equal(chat["parentSpanId"], run["spanId"]);
  assert.equal(chat["traceId"], run["traceId"]);
  assert.equal(attributes(chat).get("gen_ai.provider.name"), "anthropic");

  assert.deepEqual(await acme.otelTrace("r-otel", "support-agent"), trace, "a finished run exports the same trace");
  const byDefault = (await acme.otelTrace("r-otel"))["resourceSpans"] as JsonObject[];
  assert.equal(attributes(byDefault[0]?.["resource"] as JsonObject).get("service.name"), "ledger");
  await assert.rejects(acme.otelTrace("missing"), (e: unknown) => e instanceof NotFoundError && e.code === "RUN_NOT_FOUND");
});

test("three retryRuns and a replayRun make each side effect once: the same toolCallId, no key", async (t) => {
  const db = await freshDb(t, "reruns_lineage");
  const acme = db.ledger.scoped("acme", "ts");
  const sent = { lookup: 0, refund: 0 };
  const agent = async (ctx: RunContext): Promise<string> => {
    const found = await ctx.toolCall("lookup", "crm.lookupOrder", { order: 7 }, async () => {
      sent.lookup += 1;
      return { paid: "12.50" };
    });
    if (ctx.run.attemptNo >= 2) {
      await ctx.toolCall("refund", "payments.refund", { amount: found.paid }, async () => {
        sent.refund += 1;
        return { refunded: found.paid };
      });
    }
    if (ctx.run.attemptNo < 4) throw new Error("the model timed out");
    return `refunded ${found.paid}`;
  };
  const workOne = async (): Promise<void> => {
    const stop = new AbortController();
    await work(acme, agent, { idleSeconds: 0.05, signal: stop.signal, stopOn: [], onRun: () => stop.abort() });
  };
  await acme.createRun("agent", { runId: "r-first" });
  await workOne();
  const runs = ["r-first"];
  for (let i = 0; i < 3; i += 1) {
    runs.push((await acme.retryRun(runs[runs.length - 1]!)).id);
    await workOne();
  }
  const replay = await acme.replayRun(runs[runs.length - 1]!);
  await workOne();
  const statuses = await Promise.all([...runs, replay.id].map(async (id) => (await acme.getRun(id))?.status));
  assert.deepEqual(statuses, ["failed", "failed", "failed", "succeeded", "succeeded"]);
  assert.deepEqual(sent, { lookup: 1, refund: 1 }, "once across five runs");
  const reused = (await acme.replayBundle(replay.id))["reused_tool_calls"] as JsonObject[];
  assert.deepEqual(reused.map((r) => r["source_run_id"]).sort(), ["r-first", runs[1]!].sort());
});

test("when a run may start and which first: createRun's notBefore and priority, retryRun's backoff", async (t) => {
  const db = await freshDb(t, "schedule");
  const acme = db.ledger.scoped("acme", "ts");
  const later = new Date(Date.now() + 3_600_000);
  const low = await acme.createRun("agent", { runId: "r-low", priority: -1 });
  assert.equal(low.priority, -1);
  assert.equal(low.notBefore, null);
  const waiting = await acme.createRun("agent", { runId: "r-later", priority: 9, notBefore: later });
  assert.equal(waiting.notBefore?.getTime(), later.getTime());
  await acme.createRun("agent", { runId: "r-urgent", priority: 5 });
  assert.equal((await acme.claimRun("w-1"))?.runId, "r-urgent", "the highest priority that is due");
  assert.equal((await acme.claimRun("w-2"))?.runId, "r-low");
  assert.equal(await acme.claimRun("w-3"), null, "r-later is not due");

  await acme.transitionRun("r-low", "failed");
  const retry = await acme.retryRun("r-low", undefined, { notBefore: later });
  assert.equal(retry.priority, -1, "a retry keeps its source's priority");
  assert.equal(retry.notBefore?.getTime(), later.getTime());
  assert.equal(await acme.claimRun("w-4"), null, "nor is the retry, before its backoff");

  await assert.rejects(
    acme.createRun("agent", { runId: "r-bad", priority: 1001 }),
    (e: unknown) => e instanceof LedgerError && e.code === "PRIORITY_INVALID" && e.sqlstate === "22023",
  );
  assert.equal(await acme.getRun("r-bad"), null, "nothing written");
});

test("a concurrency limit: setConcurrencyLimit lets so many runs of a key be claimed at once", async (t) => {
  const db = await freshDb(t, "limits");
  const acme = db.ledger.scoped("acme", "ts");
  assert.equal(await acme.setConcurrencyLimit("customer-7", 1), 1);
  const first = await acme.createRun("agent", { runId: "k-1", concurrencyKey: "customer-7" });
  assert.equal(first.concurrencyKey, "customer-7");
  await acme.createRun("agent", { runId: "k-2", concurrencyKey: "customer-7" });
  await acme.createRun("agent", { runId: "other" });
  const claims = [await acme.claimRun("w-0"), await acme.claimRun("w-1"), await acme.claimRun("w-2")];
  assert.deepEqual(claims.map((c) => c?.runId ?? null), ["k-1", "other", null], "k-2 waits for k-1");
  assert.equal(await acme.setConcurrencyLimit("customer-7", null), null);
  assert.equal((await acme.claimRun("w-3"))?.runId, "k-2");
  await assert.rejects(
    acme.setConcurrencyLimit("customer-7", -1),
    (e: unknown) => e instanceof LedgerError && e.code === "LIMIT_INVALID",
  );
});

test("a budget: setBudget, budget_exhausted with the budget, the run paused until a person raises it; budgets", async (t) => {
  const db = await freshDb(t, "budgets");
  const acme = db.ledger.scoped("acme", "ts");
  const budget = await acme.setBudget("tool_calls", 1, { actor: "ops@acme", note: "one call" });
  assert.ok(budget !== null);
  assert.deepEqual(
    [budget.level, budget.unit, budget.period, budget.tenantId, budget.workspaceId, budget.runId],
    ["workspace", "tool_calls", "total", "acme", "ts", null],
  );
  assert.deepEqual([budget.maxAmount, budget.spent, budget.remaining, budget.warnRatio], ["1", "0", "1", "0.8"]);
  assert.equal(budget.exhausted, false);
  assert.equal(budget.updatedBy, "ops@acme");
  await acme.createRun("agent", { runId: "r-budget" });
  const claimed = await acme.claimRun("w-1", { runId: "r-budget" });
  assert.ok(claimed !== null);
  const runToken = claimed.runToken;
  await acme.transitionRun("r-budget", "running", { runToken });

  const first = await acme.claimToolCall("r-budget", "crm.lookup", { order: 1 }, { toolCallId: "c-1", runToken });
  assert.equal(first.outcome, "claimed");
  assert.equal(first.budget, null);
  const refused = await acme.claimToolCall("r-budget", "crm.lookup", { order: 2 }, { toolCallId: "c-2", runToken });
  assert.equal(refused.outcome, "budget_exhausted");
  assert.equal(refused.toolCall, null, "nothing created");
  assert.deepEqual(refused.budget, {
    level: "workspace",
    runId: null,
    unit: "tool_calls",
    period: "total",
    maxAmount: "1",
    spent: "1",
    remaining: "0",
    windowStart: null,
    windowEnd: null,
  });
  const parked = await acme.getRun("r-budget");
  assert.deepEqual([parked?.status, parked?.errorCode], ["paused", "BUDGET_EXHAUSTED"]);
  assert.deepEqual(await db.sql("SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c-2'"), []);

  const [usedUp, ...others] = await acme.budgets();
  assert.deepEqual(others, []);
  assert.deepEqual([usedUp?.exhausted, usedUp?.spent, usedUp?.remaining], [true, "1", "0"]);
  assert.deepEqual(await acme.budgets("r-budget"), [usedUp], "the workspace's budgets apply to each of its runs");
  const raised = await acme.setBudget("tool_calls", "2", { actor: "lead@acme", note: "one more" });
  assert.deepEqual([raised?.exhausted, raised?.updatedBy], [false, "lead@acme"]);
  const again = await acme.claimToolCall("r-budget", "crm.lookup", { order: 2 }, { toolCallId: "c-2" });
  assert.equal(again.outcome, "claimed");
  assert.equal(again.toolCall?.toolCallId, "c-2");
});

test("budgets of each level, unit and period; removed; a bad unit is UNIT_INVALID", async (t) => {
  const db = await freshDb(t, "budget_levels");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-1" });
  await acme.createRun("agent", { runId: "r-2" });
  const daily = await acme.setBudget("usd", 0.1, { level: "tenant", period: "day", warnRatio: null });
  assert.deepEqual([daily?.unit, daily?.level, daily?.workspaceId, daily?.maxAmount, daily?.warnRatio], ["USD", "tenant", null, "0.1", null]);
  assert.ok(daily?.windowStart instanceof Date && daily.windowEnd instanceof Date && daily.windowStart < daily.windowEnd);
  await acme.setBudget("tokens", "5000", { level: "run", runId: "r-1" });
  await acme.setBudget("llm_steps", 10);
  assert.deepEqual(
    (await acme.budgets()).map((b) => [b.level, b.unit]),
    [["tenant", "USD"], ["workspace", "llm_steps"], ["run", "tokens"]],
  );
  assert.deepEqual((await acme.budgets("r-2")).map((b) => b.unit), ["USD", "llm_steps"], "r-1's is not r-2's");
  await acme.recordCost("r-1", "tokens", 1200, { amount: "0.04", currency: "USD", usage: { total_tokens: 1200 } });
  assert.deepEqual(Object.fromEntries((await acme.budgets("r-1")).map((b) => [b.unit, b.spent])), {
    USD: "0.04",
    llm_steps: "0",
    tokens: "1200",
  });
  assert.equal(await acme.setBudget("usd", null, { level: "tenant", period: "day" }), null, "removed");
  assert.deepEqual((await acme.budgets()).map((b) => b.unit), ["llm_steps", "tokens"]);

  await assert.rejects(
    acme.setBudget("dollars!", 10),
    (e: unknown) => e instanceof InvalidArgumentError && e.sqlstate === "22023" && e.code === "UNIT_INVALID",
  );
  await assert.rejects(
    acme.setBudget("tokens", 10, { level: "run" }),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "ARGUMENT_REQUIRED",
  );
  await assert.rejects(
    acme.setBudget("tokens", 10, { level: "run", runId: "r-none" }),
    (e: unknown) => e instanceof NotFoundError && e.code === "RUN_NOT_FOUND",
  );
  assert.equal((await acme.budgets()).length, 2, "nothing written by the refused calls");
});
