/**
 * The manual's example (clients/typescript/README.md): its block is examples/worker.ts verbatim, and
 * the compiled example, run against a test database, works its run to the end by itself.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { freshDb } from "./helpers.js";

const root = (path: string): string => fileURLToPath(new URL(`../../../../${path}`, import.meta.url));
const example = root("clients/typescript/examples/worker.ts");

test("the client's README shows examples/worker.ts verbatim", () => {
  const manual = readFileSync(root("clients/typescript/README.md"), "utf8");
  const file = readFileSync(example, "utf8");
  const firstLine = file.split("\n")[0] ?? "";
  const block = [...manual.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1] ?? "").find((b) => b.startsWith(firstLine));
  assert.ok(block !== undefined, `no \`\`\`ts block of clients/typescript/README.md starts with ${firstLine}`);
  assert.equal(block, file, "clients/typescript/README.md's block differs from examples/worker.ts");
});

test("the compiled example works its run to the end against a test database", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "example");
  const child = spawn(process.execPath, [root("clients/typescript/dist/examples/worker.js")], {
    env: { ...process.env, LEDGER_DSN: db.dsn },
    stdio: ["ignore", "pipe", "inherit"],
  });
  t.after(() => child.kill("SIGKILL"));
  let out = "";
  child.stdout.on("data", (chunk: Buffer) => (out += chunk.toString()));
  const code = await new Promise((resolve) => child.once("exit", resolve));
  assert.equal(code, 0, out);
  assert.match(out, /person: approved "Refund 12\.50 for order 1042"/);
  assert.match(out, /: succeeded: Sorry about the parcel: 12\.50 is refunded \(rf-1042\)\./);

  const ex = db.ledger.scoped("acme", "examples-ts");
  const runs = await ex.query("SELECT id, status, user_id FROM ledger.runs");
  assert.equal(runs.length, 1);
  assert.equal(runs[0]?.["status"], "succeeded");
  assert.equal(runs[0]?.["user_id"], "customer-7");
  const runId = String(runs[0]?.["id"]);
  const steps = await ex.query("SELECT step_key, step_type, status FROM ledger.run_steps ORDER BY step_no");
  assert.deepEqual(
    steps.map((s) => [s["step_key"], s["step_type"], s["status"]]),
    [
      ["plan", "llm", "succeeded"],
      ["lookup", "tool", "succeeded"],
      ["refund", "tool", "succeeded"],
      ["answer", "llm", "succeeded"],
    ],
  );
  const calls = await ex.query("SELECT tool_call_id, status, attempt FROM ledger.run_step_tool_calls ORDER BY created_at");
  assert.deepEqual(
    calls.map((c) => [c["tool_call_id"], c["status"], c["attempt"]]),
    [
      ["lookup", "succeeded", "1"],
      ["refund", "succeeded", "1"],
    ],
  );
  const approvals = await ex.query("SELECT status, actor, note FROM ledger.approval_requests");
  assert.deepEqual(approvals, [{ status: "approved", actor: "lead@acme", note: "damage photo checked" }]);
  const costs = await ex.query("SELECT amount::text, currency FROM ledger.run_cost_entries");
  assert.deepEqual(costs, [
    { amount: "0.00042", currency: "USD" },
    { amount: "0.00042", currency: "USD" },
  ]);
  assert.equal((await ex.replayReady(runId))["status"], "pass");
  const shown = await ex.query("SELECT payload->>'text' AS text FROM ledger.response_events");
  assert.deepEqual(shown, [{ text: "Sorry about the parcel: 12.50 is refunded (rf-1042)." }]);
  // Nothing in any other workspace: the demo's own runs are not touched.
  assert.deepEqual(await db.sql("SELECT DISTINCT workspace_id FROM ledger.runs"), [{ workspace_id: "examples-ts" }]);
});
