/**
 * The manual's example (clients/typescript/README.md): its block is examples/worker.ts verbatim, and
 * the compiled example, run against a test database, works its run to the end by itself.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import { assertShowsVerbatim, freshDb, runExample } from "./helpers.js";

test("the client's README shows examples/worker.ts verbatim", () => {
  assertShowsVerbatim("clients/typescript/README.md", "clients/typescript/examples/worker.ts");
});

test("the compiled example works its run to the end against a test database", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "example");
  const out = await runExample(t, db, "clients/typescript/dist/examples/worker.js");
  assert.match(out, /person: approved "Refund 12\.50 for order 1042"/);
  assert.match(out, /person: rejected "Refund 480\.00 for order 1043"/);
  assert.match(out, /: succeeded: Sorry about the parcel: 12\.50 is refunded \(rf-1042\)\./);
  assert.match(out, /: succeeded: A colleague will call you about a return\./);

  const ex = db.ledger.scoped("acme", "examples-ts");
  const runs = await ex.query("SELECT id, status, user_id, inputs->>'order' AS ord FROM ledger.runs ORDER BY inputs->>'order'");
  assert.deepEqual(
    runs.map((r) => [r["ord"], r["status"], r["user_id"]]),
    [
      ["1042", "succeeded", "customer-7"],
      ["1043", "succeeded", "customer-7"],
    ],
  );
  const story = async (runId: string) => ({
    steps: (await ex.query("SELECT step_key, step_type, status FROM ledger.run_steps WHERE run_id = $1 ORDER BY step_no", [runId])).map(
      (s) => [s["step_key"], s["step_type"], s["status"]],
    ),
    calls: (await ex.query("SELECT tool_call_id, status, attempt, result FROM ledger.run_step_tool_calls WHERE run_id = $1 ORDER BY created_at", [runId])).map(
      (c) => [c["tool_call_id"], c["status"], c["attempt"], c["result"]],
    ),
    approvals: await ex.query("SELECT status, actor, note FROM ledger.approval_requests WHERE run_id = $1", [runId]),
    costs: await ex.query("SELECT amount::text, currency FROM ledger.run_cost_entries WHERE run_id = $1", [runId]),
    shown: await ex.query("SELECT payload->>'text' AS text FROM ledger.response_events WHERE run_id = $1", [runId]),
    ready: (await ex.replayReady(runId))["status"],
  });
  const twoCosts = [
    { amount: "0.00042", currency: "USD" },
    { amount: "0.00042", currency: "USD" },
  ];
  const lookup = (order: number, paid: string) => ["lookup", "succeeded", "1", { order, status: "delivered damaged", paid }];
  assert.deepEqual(await story(String(runs[0]?.["id"])), {
    steps: [
      ["plan", "llm", "succeeded"],
      ["lookup", "tool", "succeeded"],
      ["refund", "tool", "succeeded"],
      ["answer", "llm", "succeeded"],
    ],
    calls: [lookup(1042, "12.50"), ["refund", "succeeded", "1", { refunded: "12.50", reference: "rf-1042" }]],
    approvals: [{ status: "approved", actor: "lead@acme", note: "damage photo checked" }],
    costs: twoCosts,
    shown: [{ text: "Sorry about the parcel: 12.50 is refunded (rf-1042)." }],
    ready: "pass",
  });
  // The rejected refund was never executed: its call is rejected with no result, its step canceled.
  assert.deepEqual(await story(String(runs[1]?.["id"])), {
    steps: [
      ["plan", "llm", "succeeded"],
      ["lookup", "tool", "succeeded"],
      ["refund", "tool", "canceled"],
      ["apology", "llm", "succeeded"],
    ],
    calls: [lookup(1043, "480.00"), ["refund", "rejected", "0", null]],
    approvals: [{ status: "rejected", actor: "lead@acme", note: "over 50.00: needs a return" }],
    costs: twoCosts,
    shown: [{ text: "A colleague will call you about a return." }],
    ready: "pass",
  });
  // Nothing in any other workspace: the demo's own runs are not touched.
  assert.deepEqual(await db.sql("SELECT DISTINCT workspace_id FROM ledger.runs"), [{ workspace_id: "examples-ts" }]);
});
