/** The JSON rule for arguments and results, a rejected (or expired) approval's default, the people's queues, round trips per call. */
import assert from "node:assert/strict";
import { test } from "node:test";

import pg from "pg";

import { NotEncodableError, ResultNotEncodable, toJson, toolCall, work, type RunOutcome } from "../src/index.js";
import { freshDb } from "./helpers.js";

test("toJson: bigint, Date, bytes, Map, Set, toJSON; functions, symbols, cycles and NaN refused with their place", () => {
  const when = new Date("2026-01-02T03:04:05.000Z");
  assert.deepEqual(
    toJson({ n: 12345678901234567890n, when, bytes: Buffer.from("hi"), raw: new Uint8Array([1, 2]), m: new Map<unknown, unknown>([["a", 1], [2, new Set([3])]]), s: new Set(["x"]), skip: undefined, list: [undefined, 1n] }),
    { n: "12345678901234567890", when: "2026-01-02T03:04:05.000Z", bytes: "aGk=", raw: "AQI=", m: { a: 1, "2": [3] }, s: ["x"], list: [null, "1"] },
  );
  const cyclic: Record<string, unknown> = {};
  cyclic["self"] = cyclic;
  for (const [value, path, type] of [
    [{ a: [1, () => 1] }, "$.a[1]", /a function/],
    [{ s: Symbol("k") }, "$.s", /a symbol/],
    [cyclic, "$.self", /a cycle/],
    [{ x: Number.NaN }, "$.x", /NaN/],
  ] as const) {
    assert.throws(() => toJson(value), (e: unknown) => e instanceof NotEncodableError && e.path === path && type.test(e.type));
  }
});

test("a result that cannot be encoded completes the call unknown (in doubt, with the reason); the worker parks the run", async (t) => {
  const db = await freshDb(t, "encoding");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "e-1" });
  await acme.transitionRun("e-1", "running");
  const when = new Date("2026-01-02T03:04:05.000Z");
  const value = await toolCall(acme, { runId: "e-1", toolRef: "bank.balance", toolCallId: "ok", arguments: { since: when.toISOString() }, execute: async () => ({ cents: 1999n, at: when, pdf: Buffer.from("%PDF") }) });
  assert.equal(value.cents, 1999n, "the caller gets the tool's own value");
  assert.deepEqual((await acme.claimToolCall("e-1", "bank.balance", { since: when.toISOString() }, { toolCallId: "ok" })).response?.result, { cents: "1999", at: "2026-01-02T03:04:05.000Z", pdf: "JVBERg==" });

  let runs = 0;
  const bad = await toolCall(acme, { runId: "e-1", toolRef: "mail.send", toolCallId: "bad", arguments: {}, execute: async () => ((runs += 1), { sent: true, close: () => undefined }) }).catch((e: unknown) => e);
  assert.ok(bad instanceof ResultNotEncodable, String(bad));
  assert.match(bad.message, /mail\.send \(bad\): the tool ran, its result cannot be recorded: cannot encode a function \(close\) at \$\.close/);
  assert.deepEqual([bad.outcome, bad.path], ["in_doubt", "$.close"]);
  const [doubt] = await acme.toolCallsInDoubt({ runId: "e-1" });
  assert.equal(doubt?.toolCallId, "bad");
  assert.match(doubt?.errorMessage ?? "", /the tool ran, its result cannot be recorded/);
  assert.equal(runs, 1);

  // Arguments that cannot be encoded: refused before any claim.
  await assert.rejects(
    toolCall(acme, { runId: "e-1", toolRef: "t", toolCallId: "args", arguments: { f: () => 1 }, execute: async () => 1 }),
    (e: unknown) => e instanceof NotEncodableError && /t \(args\): its arguments: cannot encode a function/.test(e.message),
  );
  assert.equal((await acme.query("SELECT count(*)::int AS n FROM ledger.run_step_tool_calls WHERE tool_call_id = 'args'"))[0]?.["n"], 0);

  // In a worker, the run is parked for a person, not failed.
  await acme.createRun("agent", { runId: "e-2" });
  const stop = new AbortController();
  const outcomes: RunOutcome[] = [];
  await work(
    acme,
    async (ctx) => {
      stop.abort();
      await ctx.toolCall("c", "x.y", {}, async () => ({ f: Symbol("no") }));
      return "never";
    },
    { idleSeconds: 0.05, signal: stop.signal, onRun: (_r, o) => outcomes.push(o) },
  );
  assert.equal(outcomes[0]?.status, "paused");
  assert.equal((await acme.getRun("e-2"))?.status, "paused");
});

test("a rejected approval escaping the agent fails the run with TOOL_APPROVAL_REJECTED, naming the call and the note; the queues", async (t) => {
  const db = await freshDb(t, "rejected");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "a-1" });
  const agent = async (ctx: Parameters<Parameters<typeof work>[1]>[0]): Promise<string> =>
    String(await ctx.toolCall("refund", "payments.refund", { amount: "120.00", api_key: "sk-live-0123456789abcdefghij" }, async () => "done", { approval: { title: "Refund" } }));
  const stop = new AbortController();
  await work(acme, async (ctx) => (stop.abort(), agent(ctx)), { idleSeconds: 0.05, signal: stop.signal });
  const [pending] = await acme.pendingApprovals();
  assert.deepEqual([pending?.runId, pending?.toolCallId, pending?.toolRef, pending?.title], ["a-1", "refund", "payments.refund", "Refund"]);
  assert.deepEqual(pending?.arguments, { amount: "120.00", api_key: "[REDACTED]" }, "as stored: redacted");
  await acme.resolveApproval(pending?.id ?? "", "rejected", { actor: "lead@acme", note: "over the limit" });
  assert.deepEqual(await acme.pendingApprovals(), []);

  const outcomes: RunOutcome[] = [];
  const stop2 = new AbortController();
  await work(acme, async (ctx) => (stop2.abort(), agent(ctx)), { idleSeconds: 0.05, signal: stop2.signal, onRun: (_r, o) => outcomes.push(o) });
  const run = await acme.getRun("a-1");
  assert.equal(run?.status, "failed");
  assert.equal(run?.errorCode, "TOOL_APPROVAL_REJECTED");
  assert.equal(run?.errorMessage, "payments.refund (refund): approval rejected by lead@acme: over the limit");
  assert.deepEqual(outcomes, [{ status: "failed", error: run?.errorMessage }]);

  // Failed outbox events, as 64 failed deliveries leave them.
  await db.sql("UPDATE ledger.outbox SET status = 'failed', attempt_count = 64 WHERE event_type = 'run.created'");
  const failed = await acme.failedOutboxEvents({ limit: 5 });
  assert.deepEqual(failed.map((e) => [e.eventType, e.runId, e.status]), [["run.created", "a-1", "failed"]]);
  assert.deepEqual(await db.ledger.scoped("acme", "other").failedOutboxEvents(), [], "another scope sees none");
});

test("an approval no one decided in time, escaping the agent, fails the run with TOOL_APPROVAL_EXPIRED", async (t) => {
  const db = await freshDb(t, "expired");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "a-1" });
  let refunds = 0;
  const agent = async (ctx: Parameters<Parameters<typeof work>[1]>[0]): Promise<string> =>
    String(await ctx.toolCall("refund", "payments.refund", { amount: "9.00" }, async () => (refunds += 1), { approval: { title: "Refund", expiresInSeconds: 3600 } }));
  const stop = new AbortController();
  await work(acme, async (ctx) => (stop.abort(), agent(ctx)), { idleSeconds: 0.05, signal: stop.signal });
  assert.equal((await acme.getRun("a-1"))?.status, "waiting_approval");
  // The deadline passes with no decision and no sweep: the run is claimable again, and the
  // worker's claim of the call expires the approval.
  await db.sql("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'");

  const outcomes: RunOutcome[] = [];
  const stop2 = new AbortController();
  await work(acme, async (ctx) => (stop2.abort(), agent(ctx)), { idleSeconds: 0.05, signal: stop2.signal, onRun: (_r, o) => outcomes.push(o) });
  const run = await acme.getRun("a-1");
  assert.equal(run?.status, "failed");
  assert.equal(run?.errorCode, "TOOL_APPROVAL_EXPIRED");
  assert.equal(run?.errorMessage, "payments.refund (refund): approval expired");
  assert.deepEqual(outcomes, [{ status: "failed", error: run?.errorMessage }]);
  assert.equal(refunds, 0);
  assert.deepEqual(await db.sql("SELECT status FROM ledger.approval_requests"), [{ status: "expired" }]);
});

test("round trips: one statement per scoped call, two per tool call (claim and begin, complete)", async (t) => {
  const db = await freshDb(t, "roundtrips");
  let statements = 0;
  db.ledger.pool.on("connect", (client: pg.PoolClient) => {
    const query = client.query.bind(client) as (...args: unknown[]) => unknown;
    (client as unknown as { query: (...args: unknown[]) => unknown }).query = (...args: unknown[]) => {
      statements += 1;
      return query(...args);
    };
  });
  const acme = db.ledger.scoped("acme", "ts");
  const count = async (fn: () => Promise<unknown>): Promise<number> => {
    statements = 0;
    await fn();
    return statements;
  };
  assert.equal(await count(() => acme.createRun("agent", { runId: "rt" })), 1);
  assert.equal(await count(() => acme.transitionRun("rt", "running")), 1);
  assert.equal(await count(() => toolCall(acme, { runId: "rt", toolRef: "t", toolCallId: "c", arguments: {}, execute: async () => 1 })), 2);
  assert.equal(await count(() => toolCall(acme, { runId: "rt", toolRef: "t", toolCallId: "c", arguments: {}, execute: async () => 1 })), 1, "a replay: the claim only");
  assert.equal(await count(() => acme.transaction(async (tx) => tx.getRun("rt"))), 3, "BEGIN with the scope, the call, COMMIT");
});
