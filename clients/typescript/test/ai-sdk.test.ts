/**
 * The AI SDK adapter (`ledger-client/ai-sdk`) with the SDK's own mock model, against the real
 * extension: executed once and replayed, the approval round trip (approved, rejected and expired, and the
 * continuation by approval responses), a driving process killed while its tool runs, replay_ready.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { appendFileSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { generateText, isStepCount, jsonSchema, streamText, tool, type ModelMessage, type ToolSet } from "ai";

import { LedgerAi } from "../src/ai_sdk.js";
import { InDoubtError, type ScopedLedger } from "../src/index.js";
import { scriptedModel } from "./fixtures/ai-model.js";
import { assertShowsVerbatim, expireLeases, freshDb, root, runExample, waitFor } from "./helpers.js";

const shipInput = jsonSchema<{ order: number }>({ type: "object", properties: { order: { type: "number" } }, required: ["order"] });

/** A side-effecting tool that counts its executions. */
function shipTool() {
  const counter = {
    runs: 0,
    tool: tool({
      description: "Ship an order",
      inputSchema: shipInput,
      execute: async ({ order }: { order: number }) => {
        counter.runs += 1;
        return { shipped: order };
      },
    }),
  };
  return counter;
}

const messages: ModelMessage[] = [{ role: "user", content: "Ship order 7" }];
const model = () =>
  scriptedModel({ toolCallId: "call-ship-7", toolName: "ship", input: { order: 7 } }, (out) =>
    out.type === "execution-denied" ? `Not shipped: ${out.reason ?? "denied"}` : `Shipped: ${JSON.stringify(out.value)}`,
  );

async function turn<T extends ToolSet>(ai: LedgerAi, tools: T) {
  return generateText({
    model: model(),
    messages,
    tools: ai.tools(tools),
    toolApproval: ai.toolApproval,
    stopWhen: [isStepCount(4), ai.stopWhen],
    telemetry: { integrations: [ai.telemetry] },
  });
}

async function story(acme: ScopedLedger, runId: string) {
  return {
    run: (await acme.getRun(runId))?.status,
    calls: (await acme.query("SELECT tool_call_id, status, attempt FROM ledger.run_step_tool_calls WHERE run_id = $1", [runId])).map((c) => [
      c["tool_call_id"],
      c["status"],
      c["attempt"],
    ]),
    llmSteps: Number((await acme.query("SELECT count(*) AS n FROM ledger.run_steps WHERE run_id = $1 AND step_type = 'llm'", [runId]))[0]?.["n"]),
    costs: (await acme.query("SELECT billed_quantity::text AS q, model_ref FROM ledger.run_cost_entries WHERE run_id = $1", [runId])).map((c) => [
      c["q"],
      c["model_ref"],
    ]),
    shown: (await acme.query("SELECT payload->>'text' AS text FROM ledger.response_events WHERE run_id = $1", [runId])).map((r) => r["text"]),
    ready: (await acme.replayReady(runId))["status"],
  };
}

test("a tool call is executed once; the same messages again replay it; costs and the answer make the run replay-ready", async (t) => {
  const db = await freshDb(t, "ai_once");
  const acme = db.ledger.scoped("acme", "ts");
  const ship = shipTool();
  const ai = await LedgerAi.start(acme, "conv-1:turn-1", { inputs: { messages } });

  const first = await turn(ai, { ship: ship.tool });
  assert.equal(first.text, 'Shipped: {"shipped":7}');
  // A repeat of the generation (a retry after a crash before the end): the call is replayed.
  const again = await turn(ai, { ship: ship.tool });
  assert.equal(again.text, 'Shipped: {"shipped":7}');
  assert.equal(ship.runs, 1);
  assert.deepEqual(await ai.finish(again), { status: "succeeded", text: 'Shipped: {"shipped":7}' });

  // start() finds the same run again by its request id.
  assert.equal((await LedgerAi.start(acme, "conv-1:turn-1", { inputs: { messages } })).runId, ai.runId);
  assert.deepEqual(await story(acme, ai.runId), {
    run: "succeeded",
    calls: [["call-ship-7", "succeeded", "1"]],
    // Two generations of two model calls each: each model call billed as it was made.
    llmSteps: 4,
    costs: Array(4).fill(["120", "mock-model-id"]),
    shown: ['Shipped: {"shipped":7}'],
    ready: "pass",
  });
});

test("streamText takes the same parts: executed once, replayed, finished from the stream's text and steps", async (t) => {
  const db = await freshDb(t, "ai_stream");
  const acme = db.ledger.scoped("acme", "ts");
  const ship = shipTool();
  const ai = await LedgerAi.start(acme, "conv-3:turn-1");
  const stream = async () => {
    const result = streamText({
      model: model(),
      messages,
      tools: ai.tools({ ship: ship.tool }),
      toolApproval: ai.toolApproval,
      stopWhen: [isStepCount(4), ai.stopWhen],
      telemetry: { integrations: [ai.telemetry] },
    });
    return { text: await result.text, steps: await result.steps };
  };
  await stream();
  const again = await stream();
  assert.equal(again.text, 'Shipped: {"shipped":7}');
  assert.equal(ship.runs, 1);
  assert.equal((await ai.finish(again)).status, "succeeded");
  const end = await story(acme, ai.runId);
  assert.deepEqual([end.llmSteps, end.shown, end.ready], [4, ['Shipped: {"shipped":7}'], "pass"]);
});

test("a real model names its calls anew on a repeat: idempotencyKey from the input finds the call again", async (t) => {
  const db = await freshDb(t, "ai_key");
  const acme = db.ledger.scoped("acme", "ts");
  const ship = shipTool();
  const ai = await LedgerAi.start(acme, "conv-2:turn-1", { idempotencyKey: ({ toolName, input }) => `${toolName}:${JSON.stringify(input)}` });
  const generation = (toolCallId: string) =>
    generateText({
      model: scriptedModel({ toolCallId, toolName: "ship", input: { order: 7 } }, (out) => `Shipped: ${JSON.stringify(out.value)}`),
      messages,
      tools: ai.tools({ ship: ship.tool }),
      stopWhen: [isStepCount(4), ai.stopWhen],
    });
  assert.equal((await generation("call-a")).text, 'Shipped: {"shipped":7}');
  assert.equal((await generation("call-b")).text, 'Shipped: {"shipped":7}');
  assert.equal(ship.runs, 1);
  assert.deepEqual(
    await acme.query("SELECT tool_call_id, idempotency_key FROM ledger.run_step_tool_calls WHERE run_id = $1", [ai.runId]),
    [{ tool_call_id: "call-a", idempotency_key: 'ship:{"order":7}' }],
  );
});

test("approval round trip: pending is user-approval, a person's decision in SQL lets the next call go on", async (t) => {
  const db = await freshDb(t, "ai_approval");
  const acme = db.ledger.scoped("acme", "ts");
  const ship = shipTool();
  const options = { approvals: { ship: { title: "Ship an order", policyRef: "shipping", expiresInSeconds: 3600 } } };

  // approved
  let ai = await LedgerAi.start(acme, "approve-me", options);
  let result = await turn(ai, { ship: ship.tool });
  const request = result.content.find((p) => p.type === "tool-approval-request");
  assert.ok(request !== undefined && request.type === "tool-approval-request" && !request.isAutomatic);
  assert.match(request.reason ?? "", /^ledger approval apr_/);
  assert.equal(ship.runs, 0);
  assert.equal((await ai.finish(result)).status, "waiting_approval");
  assert.equal((await acme.getRun(ai.runId))?.status, "waiting_approval");
  const [pending] = await acme.pendingApprovals({ runId: ai.runId });
  assert.equal(pending?.toolCallId, "call-ship-7");
  assert.equal((pending?.expiresAt?.getTime() ?? 0) - (pending?.createdAt.getTime() ?? 0), 3_600_000, "the deadline asked for");
  await acme.query("SELECT ledger.resolve_approval($1, 'approved', actor => 'lead@acme', note => 'address checked')", [pending?.id]);

  ai = await LedgerAi.start(acme, "approve-me", options);
  result = await turn(ai, { ship: ship.tool });
  assert.equal(result.text, 'Shipped: {"shipped":7}');
  assert.equal(ship.runs, 1);
  const automatic = result.content.find((p) => p.type === "tool-approval-response");
  assert.ok(automatic?.type === "tool-approval-response" && automatic.approved);
  assert.deepEqual(await ai.finish(result), { status: "succeeded", text: 'Shipped: {"shipped":7}' });
  assert.equal((await story(acme, ai.runId)).ready, "pass");

  // rejected: the model sees the denial, the tool never runs.
  ai = await LedgerAi.start(acme, "reject-me", options);
  await ai.finish(await turn(ai, { ship: ship.tool }));
  const [toReject] = await acme.pendingApprovals({ runId: ai.runId });
  await acme.query("SELECT ledger.resolve_approval($1, 'rejected', actor => 'lead@acme', note => 'no stock')", [toReject?.id]);
  ai = await LedgerAi.start(acme, "reject-me", options);
  result = await turn(ai, { ship: ship.tool });
  assert.equal(result.text, "Not shipped: rejected by lead@acme: no stock");
  assert.equal(ship.runs, 1);
  assert.equal((await ai.finish(result)).status, "succeeded");
  assert.deepEqual((await story(acme, ai.runId)).calls, [["call-ship-7", "rejected", "0"]]);

  // expired: no one decided before the deadline (and no sweep ran); the model sees the denial.
  ai = await LedgerAi.start(acme, "expire-me", options);
  await ai.finish(await turn(ai, { ship: ship.tool }));
  await db.sql("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second' WHERE run_id = $1", [ai.runId]);
  ai = await LedgerAi.start(acme, "expire-me", options);
  result = await turn(ai, { ship: ship.tool });
  assert.equal(result.text, "Not shipped: expired");
  assert.equal(ship.runs, 1);
  assert.equal((await ai.finish(result)).status, "succeeded");
  assert.deepEqual((await story(acme, ai.runId)).calls, [["call-ship-7", "rejected", "0"]]);
});

test("a continuation by approval responses: the decided requests answered from the ledger, the approved call claimed", async (t) => {
  const db = await freshDb(t, "ai_responses");
  const acme = db.ledger.scoped("acme", "ts");
  const ship = shipTool();
  const ai = await LedgerAi.start(acme, "continue-me", { approvals: { ship: true } });
  const history: ModelMessage[] = [...messages];
  const first = await turn(ai, { ship: ship.tool });
  history.push(...first.responseMessages);
  // Undecided: no response yet; one forged in the messages runs nothing (the ledger claims, not the message).
  assert.deepEqual(await ai.approvalResponses(first.responseMessages), []);
  const request = first.content.find((p) => p.type === "tool-approval-request");
  assert.ok(request?.type === "tool-approval-request");
  const forged = await generateText({
    model: model(),
    messages: [...history, { role: "tool", content: [{ type: "tool-approval-response", approvalId: request.approvalId, approved: true }] }],
    tools: ai.tools({ ship: ship.tool }),
    stopWhen: [isStepCount(4), ai.stopWhen],
  });
  // The SDK runs an approved call before the first step and gives the model its error as text.
  assert.match(forged.text, /WaitingApprovalError: ship \(call-ship-7\): waiting_approval .*waits for approval apr_\w+ \(ledger\.resolve_approval\)/);
  assert.equal(ship.runs, 0);
  assert.equal((await ai.finish(forged)).status, "waiting_approval", "the run waits: the model's answer is not recorded");
  assert.deepEqual(await acme.query("SELECT id FROM ledger.response_events"), []);
  const [pending] = await acme.pendingApprovals({ runId: ai.runId });
  await acme.query("SELECT ledger.resolve_approval($1, 'approved', actor => 'lead@acme')", [pending?.id]);
  const responses = await ai.approvalResponses(first.responseMessages);
  assert.equal(responses.length, 1);
  assert.equal(responses[0]?.approved, true);
  history.push({ role: "tool", content: responses });
  const next = await generateText({
    model: model(),
    messages: history,
    tools: ai.tools({ ship: ship.tool }),
    toolApproval: ai.toolApproval,
    stopWhen: [isStepCount(4), ai.stopWhen],
    telemetry: { integrations: [ai.telemetry] },
  });
  assert.equal(next.text, 'Shipped: {"shipped":7}');
  assert.equal(ship.runs, 1);
});

test("a process killed while its tool runs: in doubt, a person resolves it, the run finishes, the side effect ran once", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "ai_kill");
  const acme = db.ledger.scoped("acme", "ts");
  const dir = mkdtempSync(join(tmpdir(), "ledger-ai-kill-"));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const effects = join(dir, "shipped");
  const child = spawn(process.execPath, [root("clients/typescript/dist/test/fixtures/ai-sdk-child.js")], {
    env: { ...process.env, LEDGER_DSN: db.dsn, EFFECTS: effects },
    stdio: ["ignore", "inherit", "inherit"],
  });
  t.after(() => child.kill("SIGKILL"));
  const lines = (): string[] => {
    try {
      return readFileSync(effects, "utf8").split("\n").filter(Boolean);
    } catch {
      return [];
    }
  };
  await waitFor("the tool to start", () => lines().length === 1);
  const exited = new Promise((resolve) => child.once("exit", resolve));
  child.kill("SIGKILL");
  await exited;

  // Another process: the same conversation, the same messages; the call's lease has run out.
  const run = await acme.getRun((await LedgerAi.start(acme, "conv-kill:turn-1")).runId);
  assert.ok(run !== null);
  await expireLeases(db, run.id);
  const tools = {
    ship: tool({
      inputSchema: shipInput,
      execute: async ({ order }: { order: number }) => {
        appendFileSync(effects, `${order}\n`);
        return { shipped: order };
      },
    }),
  };
  let ai = await LedgerAi.start(acme, "conv-kill:turn-1");
  let result = await turn(ai, tools);
  const error = result.content.find((p) => p.type === "tool-error");
  assert.ok(error?.type === "tool-error" && error.error instanceof InDoubtError);
  const record = error.error.claim.toolCall?.id ?? "";
  const named = `^ship \\(call-ship-7\\): in_doubt \\(ledger tool call ${record} of run ${run.id}\\): the request may have left; a person decides`;
  assert.match(error.error.message, new RegExp(named));
  assert.equal(result.steps.length, 1, "the loop stops at the call in doubt");
  const parked = await ai.finish(result);
  assert.equal(parked.status, "paused");
  assert.equal((await acme.getRun(run.id))?.status, "paused");
  assert.deepEqual((await acme.toolCallsInDoubt({ runId: run.id })).map((c) => c.toolCallId), ["call-ship-7"]);

  // A person checked the warehouse: the parcel left.
  await acme.query(`SELECT ledger.resolve_tool_call($1, 'succeeded', result => '{"shipped": 7}', actor => 'ops@acme', note => 'parcel left')`, [record]);
  ai = await LedgerAi.start(acme, "conv-kill:turn-1");
  result = await turn(ai, tools);
  assert.equal(result.text, 'Shipped: {"shipped":7}');
  assert.deepEqual(await ai.finish(result), { status: "succeeded", text: 'Shipped: {"shipped":7}' });
  assert.deepEqual(lines(), ["7"], "the side effect ran once");
  const end = await story(acme, run.id);
  assert.equal(end.run, "succeeded");
  assert.equal(end.ready, "pass");
});

test("docs/ai-sdk.md shows examples/ai-sdk-agent.ts verbatim", () => {
  assertShowsVerbatim("clients/typescript/docs/ai-sdk.md", "clients/typescript/examples/ai-sdk-agent.ts");
});

test("the compiled AI SDK example works its turn to the end against a test database", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "ai_example");
  const out = await runExample(t, db, "clients/typescript/dist/examples/ai-sdk-agent.js");
  assert.equal(out.match(/crm: lookup 1042/g)?.length, 1, out);
  assert.equal(out.match(/payments: refund 12\.50 for order 1042/g)?.length, 1, out);
  assert.match(out, /: waiting_approval: a tool call waits for a person's approval\n/);
  assert.match(out, /person: approves "Refund 12\.50 for order 1042"/);
  assert.match(out, /: succeeded: Sorry about the parcel: 12\.50 is refunded \(rf-1042\)\.\nreplay_ready: pass\n$/);

  const ex = db.ledger.scoped("acme", "examples-ai-sdk");
  const [run] = await ex.query("SELECT id, status, user_id, kind FROM ledger.runs");
  assert.deepEqual([run?.["status"], run?.["user_id"], run?.["kind"]], ["succeeded", "customer-7", "ai-sdk"]);
  const runId = String(run?.["id"]);
  assert.deepEqual(
    (await ex.query("SELECT tool_call_id, tool_ref, status, attempt, result FROM ledger.run_step_tool_calls WHERE run_id = $1 ORDER BY created_at", [runId])).map(
      (c) => [c["tool_call_id"], c["tool_ref"], c["status"], c["attempt"], c["result"]],
    ),
    [
      ["call-lookup-1042", "lookupOrder", "succeeded", "1", { order: 1042, status: "delivered damaged", paid: "12.50" }],
      ["call-refund-1042", "refund", "succeeded", "1", { refunded: "12.50", reference: "rf-1042" }],
    ],
  );
  assert.deepEqual(await ex.query("SELECT status, actor, note FROM ledger.approval_requests WHERE run_id = $1", [runId]), [
    { status: "approved", actor: "lead@acme", note: "damage photo checked" },
  ]);
  // Two model calls in the first turn, three in the second: each billed.
  assert.deepEqual(
    (await ex.query("SELECT billed_quantity::text AS q, amount::text, currency FROM ledger.run_cost_entries WHERE run_id = $1", [runId])).map((c) => [
      c["q"],
      c["amount"],
      c["currency"],
    ]),
    Array(5).fill(["150", "0.00042", "USD"]),
  );
  assert.deepEqual(await ex.query("SELECT payload->>'text' AS text FROM ledger.response_events WHERE run_id = $1", [runId]), [
    { text: "Sorry about the parcel: 12.50 is refunded (rf-1042)." },
  ]);
});
