/**
 * Dropped connections: a real `pg_terminate_backend` on the worker's backend while a statement of
 * it waits (a superuser holds the rows it needs), at each point of a run and at the outbox's ack.
 * The run still succeeds and every side effect ran once.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import pg from "pg";

import { isConnectionError, OutboxConsumer, work, type ClaimedRun, type RunOutcome } from "../src/index.js";
import { freshDb, waitFor, type TestDb } from "./helpers.js";

/**
 * Takes the lock `lockSql` names in a superuser transaction and returns once it holds it; then, in
 * the background, waits until another backend waits for a lock (nothing else runs: heartbeats
 * are off), terminates that backend, and lets the lock go. `terminated` resolves with its pid.
 */
async function terminateWhenBlocked(db: TestDb, lockSql: string, values: unknown[]): Promise<{ terminated: Promise<number> }> {
  const admin = new pg.Client({ host: process.env["LEDGER_TEST_HOST"], port: Number(process.env["LEDGER_TEST_PORT"]), user: "postgres", database: db.dbname });
  admin.on("error", () => undefined);
  await admin.connect();
  await admin.query("BEGIN");
  await admin.query(lockSql, values);
  const terminated = (async () => {
    try {
      let victim: number | undefined;
      await waitFor("a statement waiting for the lock", async () => {
        const waiting = await admin.query<{ pid: number }>(
          "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'",
        );
        victim = waiting.rows[0]?.pid;
        return victim !== undefined;
      });
      await admin.query("SELECT pg_terminate_backend($1, 5000)", [victim]);
      return victim ?? 0;
    } finally {
      await admin.query("ROLLBACK").catch(() => undefined);
      await admin.end().catch(() => undefined);
    }
  })();
  return { terminated };
}

const lockRun = (db: TestDb, runId: string): Promise<{ terminated: Promise<number> }> =>
  terminateWhenBlocked(db, "SELECT 1 FROM ledger.runs WHERE id = $1 FOR UPDATE", [runId]);

test("a connection terminated at the agent's write, the claim and begin, the completion and the final transition: the run succeeds, each effect once", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "faults_run");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "f-1", inputs: { order: 3 } });
  const effects = { plan: 0, lookup: 0 };
  const killed: Promise<number>[] = [];
  const outcomes: [ClaimedRun, RunOutcome][] = [];
  const stop = new AbortController();
  await work(
    acme,
    async (ctx) => {
      // The agent's next write (its step's start) while it runs.
      killed.push((await lockRun(db, "f-1")).terminated);
      await ctx.llmStep("plan", async () => {
        effects.plan += 1;
        return { text: "look it up", usage: { input_tokens: 10, output_tokens: 2 } };
      });
      // The claim and begin of the tool call.
      killed.push((await lockRun(db, "f-1")).terminated);
      const found = await ctx.toolCall(
        "lookup",
        "crm.lookup_order",
        { order: 3 },
        async (args) => {
          effects.lookup += 1;
          // Its completion.
          killed.push((await lockRun(db, "f-1")).terminated);
          return { order: args.order, paid: "9.90" };
        },
        { heartbeatSeconds: 600 },
      );
      // The worker's final transition.
      killed.push((await lockRun(db, "f-1")).terminated);
      stop.abort();
      return `paid ${found.paid}`;
    },
    // No heartbeats in the way: one waiting on the held row would hold the worker up instead.
    { leaseOwner: "w", heartbeatSeconds: 600, idleSeconds: 0.05, signal: stop.signal, onRun: (run, o) => outcomes.push([run, o]) },
  );
  const victims = await Promise.all(killed);
  assert.equal(new Set(victims).size, 4, "four backends terminated");
  assert.deepEqual(
    outcomes.map(([, o]) => o),
    [{ status: "succeeded", reply: "paid 9.90" }],
  );
  assert.deepEqual(effects, { plan: 1, lookup: 1 });
  const run = await acme.getRun("f-1");
  assert.deepEqual([run?.status, run?.errorCode, run?.outputSummary], ["succeeded", null, "paid 9.90"]);
  assert.deepEqual(await acme.query("SELECT tool_call_id, status, attempt::int FROM ledger.run_step_tool_calls"), [
    { tool_call_id: "lookup", status: "succeeded", attempt: 1 },
  ]);
  assert.deepEqual(await acme.query("SELECT payload->>'text' AS text FROM ledger.response_events"), [{ text: "paid 9.90" }]);
  assert.equal((await acme.replayReady("f-1"))["status"], "pass");
});

test("a connection error that outlasts the repeats releases the run instead of failing it", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "faults_release");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "f-2" });
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  await work(
    acme,
    async () => {
      stop.abort();
      // The agent's own query, on a connection the server ended.
      throw new Error("Connection terminated unexpectedly");
    },
    { idleSeconds: 0.05, signal: stop.signal, onRun: (_r, o) => outcomes.push(o) },
  );
  assert.equal(outcomes[0]?.status, "released");
  const run = await acme.getRun("f-2");
  assert.deepEqual([run?.status, run?.leaseOwner, run?.errorCode], ["running", null, null]);
  assert.ok(isConnectionError(new pg.DatabaseError("terminating connection due to administrator command", 0, "error")) === false, "no code: not a lost connection");
  const fatal = Object.assign(new pg.DatabaseError("terminating connection due to administrator command", 0, "error"), { code: "57P01" });
  assert.ok(isConnectionError(fatal));
  assert.ok(isConnectionError(Object.assign(new pg.DatabaseError("x", 0, "error"), { code: "08006" })));
  assert.ok(!isConnectionError(Object.assign(new pg.DatabaseError("x", 0, "error"), { code: "40001" })));
  assert.ok(isConnectionError(new Error("timeout exceeded when trying to connect")));
  assert.ok(!isConnectionError(new Error("the model refused")));
});

test("an idle pooled connection the server terminated: the next write goes through on a fresh one", async (t) => {
  const db = await freshDb(t, "faults_idle");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "f-3" });
  await db.sql("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()");
  assert.equal((await acme.transitionRun("f-3", "running")).status, "running");
});

test("the outbox consumer's ack on a terminated connection is repeated on a fresh one: delivered once, done", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "faults_outbox");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "o-1" });
  let deliveries = 0;
  let killed: Promise<number> | undefined;
  const consumer = new OutboxConsumer(
    acme,
    async (event) => {
      deliveries += 1;
      killed = (await terminateWhenBlocked(db, "SELECT 1 FROM ledger.outbox WHERE id = $1 FOR UPDATE", [event.id])).terminated;
    },
    { leaseOwner: "billing-sync" },
  );
  assert.equal(await consumer.runOnce(), 1);
  assert.ok(((await killed) ?? 0) > 0, "the ack's backend was terminated");
  assert.equal(deliveries, 1);
  assert.deepEqual(await db.sql("SELECT status, attempt_count FROM ledger.outbox"), [{ status: "done", attempt_count: 1 }]);
  assert.equal(await consumer.runOnce(), 0);
});
