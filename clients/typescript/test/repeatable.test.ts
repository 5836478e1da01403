/**
 * The helper's repeatable path against the real extension: run once then replayed without
 * running, a failure recorded and replayed, concurrent callers each running the tool at most once
 * and all returning the first record, a side-effecting call under the key keeping its protocol,
 * and a connection lost at the record retried safely.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import pg from "pg";

import { BusyError, InDoubtError, NotEncodableError, ToolFailedError, toolCall, type ScopedLedger } from "../src/index.js";
import { freshDb, waitFor } from "./helpers.js";

async function runningRun(ledger: ScopedLedger, runId: string): Promise<void> {
  await ledger.createRun("agent", { runId });
  await ledger.transitionRun(runId, "running");
}

test("a repeatable tool runs once, is recorded in one statement and replayed without running", async (t) => {
  const db = await freshDb(t, "rep_once");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  let runs = 0;
  const weather = async (): Promise<{ temp_c: number }> => {
    runs += 1;
    return { temp_c: 21 };
  };
  for (let i = 0; i < 3; i++) {
    const got = await toolCall(acme, { runId: "r", toolRef: "weather.now", arguments: { city: "Lyon" }, toolCallId: "c1", execute: weather, repeatable: true });
    assert.deepEqual(got, { temp_c: 21 });
  }
  assert.equal(runs, 1);
  assert.deepEqual(await db.sql("SELECT status, attempt::int, lease_owner, outbound_started_at FROM ledger.run_step_tool_calls"), [
    { status: "succeeded", attempt: 1, lease_owner: null, outbound_started_at: null },
  ]);
  assert.deepEqual(
    (await db.sql("SELECT event_type FROM ledger.run_events WHERE seq > 2 ORDER BY seq")).map((r) => r["event_type"]),
    ["step.created", "tool_call.completed"],
  );
  const found = await acme.findToolCall("r", "weather.now", { city: "Lyon" }, { toolCallId: "c1" });
  assert.equal(found.outcome, "replayed");
  assert.deepEqual(found.response?.result, { temp_c: 21 });
  assert.equal((await acme.findToolCall("r", "weather.now", { city: "Paris" }, { toolCallId: "c2" })).outcome, "unrecorded");

  // A failure is recorded and rethrown, replayed as ToolFailedError, run again with retryFailed.
  let failures = 0;
  const flaky = async (): Promise<{ ok: boolean }> => {
    failures += 1;
    if (failures === 1) throw new Error("HTTP 503");
    return { ok: true };
  };
  const flakyCall = { runId: "r", toolRef: "search", arguments: {}, toolCallId: "f1", execute: flaky, repeatable: true };
  await assert.rejects(toolCall(acme, flakyCall), /HTTP 503/);
  await assert.rejects(toolCall(acme, flakyCall), ToolFailedError);
  assert.deepEqual(await toolCall(acme, { ...flakyCall, retryFailed: true }), { ok: true });
  assert.equal(failures, 2);
  // A result the rule cannot encode records nothing; an approval needs the side-effecting protocol.
  await assert.rejects(
    toolCall(acme, { runId: "r", toolRef: "search", arguments: {}, toolCallId: "n1", execute: async () => ({ close: () => undefined }), repeatable: true }),
    NotEncodableError,
  );
  await assert.rejects(
    toolCall(acme, { runId: "r", toolRef: "search", arguments: {}, toolCallId: "a1", execute: flaky, repeatable: true, approval: { title: "ok?" } }),
    /not repeatable/,
  );
  await assert.rejects(
    toolCall(acme, { runId: "r", toolRef: "search", arguments: {}, toolCallId: "s1", execute: flaky, repeatable: true, stepId: "step-x" }),
    /leave out stepId/,
  );
  assert.deepEqual(await db.sql("SELECT tool_call_id, attempt::int FROM ledger.run_step_tool_calls ORDER BY tool_call_id"), [
    { tool_call_id: "c1", attempt: 1 },
    { tool_call_id: "f1", attempt: 2 },
  ]);
});

test("concurrent callers each run a repeatable tool at most once and all return the first record", async (t) => {
  const db = await freshDb(t, "rep_race");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  const ran: string[] = [];
  let release: () => void = () => undefined;
  const bothRunning = new Promise<void>((resolve) => (release = resolve));
  const caller = (name: string): Promise<unknown> =>
    toolCall(acme, {
      runId: "r",
      toolRef: "fx.rate",
      arguments: { pair: "EURUSD" },
      toolCallId: "c1",
      repeatable: true,
      execute: async () => {
        ran.push(name);
        if (ran.length === 2) release();
        await bothRunning; // both looked the call up and found it unrecorded
        return { by: name };
      },
    });
  const answers = await Promise.all([caller("a"), caller("b")]);
  assert.deepEqual([...ran].sort(), ["a", "b"], "each ran the tool once");
  const [record] = await db.sql("SELECT result FROM ledger.run_step_tool_calls");
  assert.deepEqual(answers, [record?.["result"], record?.["result"]], "both return the one record");
  assert.equal((await db.sql("SELECT count(*)::int AS n FROM ledger.audit_events WHERE gateway_type = 'tool_call.record'"))[0]?.["n"], 1);
});

test("a side-effecting call under the key keeps its protocol", async (t) => {
  const db = await freshDb(t, "rep_side");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  let runs = 0;
  const send = { runId: "r", toolRef: "email.send", arguments: { to: "a" }, toolCallId: "c1", repeatable: true, execute: async () => (runs += 1) };
  const claim = await acme.claimToolCall("r", "email.send", { to: "a" }, { toolCallId: "c1" });
  assert.equal(claim.outcome, "claimed");
  await assert.rejects(toolCall(acme, send), BusyError);
  await acme.beginToolCall(claim.toolCall?.id ?? "", 1);
  await acme.completeToolCall(claim.toolCall?.id ?? "", 1, "unknown");
  await assert.rejects(toolCall(acme, send), InDoubtError);
  assert.equal(runs, 0);
});

test("a connection lost at the record is written again once", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "rep_lost");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  const admin = new pg.Client({ host: process.env["LEDGER_TEST_HOST"], port: Number(process.env["LEDGER_TEST_PORT"]), user: "postgres", database: db.dbname });
  admin.on("error", () => undefined);
  await admin.connect();
  t.after(() => admin.end().catch(() => undefined));
  let runs = 0;
  let victim: number | undefined;
  const got = await toolCall(acme, {
    runId: "r",
    toolRef: "fx.rate",
    arguments: { pair: "EURUSD" },
    toolCallId: "c1",
    repeatable: true,
    execute: async () => {
      runs += 1;
      // The record that follows waits for the run this session holds; its backend is terminated.
      await admin.query("BEGIN");
      await admin.query("SELECT 1 FROM ledger.runs WHERE id = 'r' FOR UPDATE");
      void (async () => {
        await waitFor("the record waiting for the run", async () => {
          const waiting = await admin.query<{ pid: number }>(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'",
          );
          victim = waiting.rows[0]?.pid;
          return victim !== undefined;
        });
        await admin.query("SELECT pg_terminate_backend($1, 5000)", [victim]);
        await admin.query("ROLLBACK");
      })();
      return { rate: "1.08" };
    },
  });
  assert.deepEqual(got, { rate: "1.08" });
  assert.equal(runs, 1);
  assert.ok(victim !== undefined, "the record's backend was terminated");
  assert.deepEqual(await db.sql("SELECT status, result FROM ledger.run_step_tool_calls"), [{ status: "succeeded", result: { rate: "1.08" } }]);
  // A record that committed and whose answer was lost is answered again, unchanged.
  const again = await acme.recordToolCall("r", "fx.rate", { pair: "EURUSD" }, "succeeded", { toolCallId: "c1", result: { rate: "9" } });
  assert.equal(again.outcome, "replayed");
  assert.deepEqual(again.response?.result, { rate: "1.08" });
});
