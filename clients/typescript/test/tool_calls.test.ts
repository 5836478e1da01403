/** The tool-call helper and its batch form: every outcome, timeouts, heartbeats, concurrent executors. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import {
  BudgetExhaustedError,
  BusyError,
  InDoubtError,
  PurgedError,
  RejectedError,
  ToolCallStopped,
  ToolFailedError,
  toolCall,
  toolCalls,
  WaitingApprovalError,
  work,
  type ScopedLedger,
} from "../src/index.js";
import { freshDb } from "./helpers.js";

/** A tool that counts its executions. */
function counted<R>(result: R): { runs: number; execute: () => Promise<R> } {
  const tool = {
    runs: 0,
    execute: async (): Promise<R> => {
      tool.runs += 1;
      return result;
    },
  };
  return tool;
}

async function runningRun(ledger: ScopedLedger, runId: string): Promise<void> {
  await ledger.createRun("agent", { runId });
  await ledger.transitionRun(runId, "running");
}

test("every claim outcome: claimed, replayed, busy, in_doubt, waiting_approval, rejected, purged", async (t) => {
  const db = await freshDb(t, "outcomes");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  const call = (toolCallId: string, tool: { execute: () => Promise<unknown> }, extra = {}): Promise<unknown> =>
    toolCall(acme, { runId: "r", toolRef: "crm.lookup", arguments: { id: toolCallId }, toolCallId, execute: tool.execute, ...extra });

  // claimed: executed once, recorded; replayed: the recorded result, nothing executed.
  const lookup = counted({ status: "shipped" });
  assert.deepEqual(await call("c-ok", lookup), { status: "shipped" });
  assert.deepEqual(await call("c-ok", lookup), { status: "shipped" });
  assert.equal(lookup.runs, 1);
  const claim = await acme.claimToolCall("r", "crm.lookup", { id: "c-ok" }, { toolCallId: "c-ok" });
  assert.equal(claim.outcome, "replayed");
  assert.equal(claim.toolCall?.status, "succeeded");
  assert.equal(claim.toolCall?.attempt, 1);
  assert.deepEqual(claim.response, { result: { status: "shipped" }, success: true, error: null, metadata: { idempotent_replay: true } });

  // A failure is recorded and rethrown; its replay is a ToolFailedError, nothing executed.
  let failures = 0;
  const failing = {
    execute: async (): Promise<never> => {
      failures += 1;
      throw new Error("CRM said 500");
    },
  };
  await assert.rejects(call("c-fail", failing), /CRM said 500/);
  const replayedFailure = await call("c-fail", failing).catch((e: unknown) => e);
  assert.ok(replayedFailure instanceof ToolFailedError);
  assert.equal(replayedFailure.error, "CRM said 500");
  assert.equal(replayedFailure.outcome, "replayed");
  assert.equal(failures, 1);

  // busy: another executor holds a live lease.
  const held = await acme.claimToolCall("r", "crm.lookup", { id: "c-busy" }, { toolCallId: "c-busy", leaseOwner: "other" });
  assert.equal(held.outcome, "claimed");
  const never = counted(null);
  const busy = await call("c-busy", never).catch((e: unknown) => e);
  assert.ok(busy instanceof BusyError && busy instanceof ToolCallStopped);
  assert.equal(busy.outcome, "busy");
  assert.equal(busy.claim.toolCall?.leaseOwner, "other");

  // in_doubt: sent, no answer.
  const sent = await acme.claimToolCall("r", "crm.lookup", { id: "c-doubt" }, { toolCallId: "c-doubt" });
  assert.ok(sent.toolCall);
  await acme.beginToolCall(sent.toolCall.id, sent.toolCall.attempt);
  await acme.completeToolCall(sent.toolCall.id, sent.toolCall.attempt, "unknown");
  const doubt = await call("c-doubt", never).catch((e: unknown) => e);
  assert.ok(doubt instanceof InDoubtError && doubt.outcome === "in_doubt");

  // waiting_approval, then rejected; another approved is executed.
  const approval = { approval: { title: "Refund", policyRef: "payments/v1" } };
  const refund = counted({ refunded: true });
  const waiting = await call("c-refund", refund, approval).catch((e: unknown) => e);
  assert.ok(waiting instanceof WaitingApprovalError);
  assert.equal(waiting.claim.approval?.status, "pending");
  assert.equal(waiting.claim.approval?.title, "Refund");
  const wire = await call("c-wire", refund, approval).catch((e: unknown) => e);
  assert.ok(wire instanceof WaitingApprovalError);
  assert.ok(waiting.claim.approval && wire.claim.approval);
  const decided = await acme.resolveApproval(waiting.claim.approval.id, "rejected", { actor: "lead@acme", note: "no" });
  assert.equal(decided.status, "rejected");
  assert.equal(decided.actor, "lead@acme");
  const rejected = await call("c-refund", refund, approval).catch((e: unknown) => e);
  assert.ok(rejected instanceof RejectedError && rejected.outcome === "rejected");
  await acme.resolveApproval(wire.claim.approval.id, "approved", { actor: "lead@acme" });
  assert.deepEqual(await call("c-wire", refund, approval), { refunded: true });
  assert.equal(refund.runs, 1, "only the approved call ran");

  // purged: the run is gone; a late duplicate of its key (a re-run passing it) gets the tombstone.
  await runningRun(acme, "old");
  const old = counted("done");
  await toolCall(acme, { runId: "old", toolRef: "t", arguments: {}, toolCallId: "k", execute: old.execute });
  await acme.transitionRun("old", "succeeded");
  await sleep(10);
  assert.equal(Number((await acme.query("SELECT ledger.purge_runs('0 seconds') AS n"))[0]?.["n"]), 1);
  const purged = await toolCall(acme, {
    runId: "r",
    toolRef: "t",
    arguments: {},
    toolCallId: "k",
    idempotencyKey: "tool:old:k",
    execute: old.execute,
  }).catch((e: unknown) => e);
  assert.ok(purged instanceof PurgedError && purged.outcome === "purged", String(purged));
  assert.equal(purged.claim.toolCall, null);
  assert.equal((purged.claim.raw["tool_call"] as Record<string, unknown>)["idempotency_key"], "tool:old:k");
  assert.equal(old.runs, 1);
  assert.equal(never.runs, 0);
});

test("a call its budget refuses is never executed: toolCall and toolCalls throw BudgetExhaustedError", async (t) => {
  const db = await freshDb(t, "budget_calls");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  await acme.setBudget("tool_calls", 2, { level: "run", runId: "r" });
  const tool = counted({ status: "shipped" });
  const turn = [0, 1, 2].map((n) => ({ toolCallId: `call-${n}`, toolRef: "crm.lookup", arguments: { n }, execute: tool.execute }));
  const results = await toolCalls(acme, "r", turn);
  assert.deepEqual(
    results.map((r) => r.claim.outcome),
    ["claimed", "claimed", "budget_exhausted"],
  );
  const refused = results[2]?.error;
  assert.ok(refused instanceof BudgetExhaustedError && refused instanceof ToolCallStopped);
  assert.equal(refused.outcome, "budget_exhausted");
  assert.equal(refused.claim.toolCall, null);
  assert.deepEqual([refused.budget?.level, refused.budget?.runId, refused.budget?.unit, refused.budget?.spent], ["run", "r", "tool_calls", "2"]);
  assert.match(refused.message, /the run's tool_calls budget is used up \(2 of 2\)/);
  const call = (n: number): Promise<unknown> =>
    toolCall(acme, { runId: "r", toolRef: "crm.lookup", arguments: { n }, toolCallId: `call-${n}`, execute: tool.execute });
  const alone = await call(3).catch((e: unknown) => e);
  assert.ok(alone instanceof BudgetExhaustedError);
  assert.deepEqual(alone.budget, refused.budget);
  assert.equal(tool.runs, 2);
  assert.deepEqual(await db.sql("SELECT count(*)::int AS n FROM ledger.run_step_tool_calls"), [{ n: 2 }]);
  assert.equal((await acme.getRun("r"))?.errorCode, "BUDGET_EXHAUSTED");
  // A replay is no decision: the recorded result comes back while the budget is used up.
  assert.deepEqual(await call(0), { status: "shipped" });
  await acme.setBudget("tool_calls", 3, { level: "run", runId: "r", actor: "lead@acme" });
  assert.deepEqual(await call(2), { status: "shipped" });
  assert.equal(tool.runs, 3);
});

test("a timeout after sending leaves the call in doubt, and a second worker never executes it", async (t) => {
  const db = await freshDb(t, "timeout");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  let sent = 0;
  // The request leaves, then no answer: the tool gives up when its signal says the timeout is over.
  const slow = async (_args: { to: string }, signal: AbortSignal): Promise<string> => {
    sent += 1;
    await sleep(60_000, undefined, { signal });
    return "never";
  };
  const request = {
    runId: "r",
    toolRef: "email.send",
    arguments: { to: "c@example.com" },
    toolCallId: "mail",
    execute: slow,
    timeoutSeconds: 1,
  };
  const first = await toolCall(acme, { ...request, leaseOwner: "worker-1" }).catch((e: unknown) => e);
  assert.ok(first instanceof InDoubtError, String(first));
  assert.equal(first.claim.toolCall?.status, "in_doubt");
  const inDoubt = await acme.query("SELECT tool_call_id, lease_owner FROM ledger.tool_calls_in_doubt");
  assert.deepEqual(inDoubt, [{ tool_call_id: "mail", lease_owner: "worker-1" }]);

  const second = await toolCall(acme, { ...request, leaseOwner: "worker-2", retryFailed: true }).catch((e: unknown) => e);
  assert.ok(second instanceof InDoubtError);
  assert.equal(sent, 1, "the second worker executed nothing");
  const [row] = await db.sql("SELECT status, attempt, error_code FROM ledger.run_step_tool_calls");
  assert.deepEqual(row, { status: "in_doubt", attempt: "1", error_code: "OUTCOME_UNKNOWN" });

  // A person resolves it; from then on the call replays the person's evidence.
  await acme.resolveToolCall(first.claim.toolCall.id, "succeeded", { result: { id: "<42@mail>" }, actor: "ops@acme" });
  assert.deepEqual(await toolCall(acme, request), { id: "<42@mail>" });
  assert.equal(sent, 1);
});

test("heartbeats keep a slow tool's lease alive", async (t) => {
  const db = await freshDb(t, "heartbeat");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  let rival = "";
  const slow = async (): Promise<string> => {
    // As if most of the lease had gone by: it ends in a second unless the helper heartbeats.
    await db.sql("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() + interval '2 seconds'");
    await sleep(3500);
    rival = (await acme.claimToolCall("r", "report.build", {}, { toolCallId: "slow", leaseOwner: "rival" })).outcome;
    return "built";
  };
  const result = await toolCall(acme, {
    runId: "r",
    toolRef: "report.build",
    arguments: {},
    toolCallId: "slow",
    execute: slow,
    heartbeatSeconds: 0.2,
  });
  assert.equal(result, "built");
  assert.equal(rival, "busy", "the lease was still alive: not in doubt, not claimable");
  const [row] = await db.sql("SELECT status, attempt FROM ledger.run_step_tool_calls");
  assert.deepEqual(row, { status: "succeeded", attempt: "1" });
});

test("a heartbeat that is not a positive number is refused before anything is claimed", async (t) => {
  const db = await freshDb(t, "heartbeat_refused");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  const never = counted("never");
  for (const heartbeatSeconds of [0, -1, Number.NaN, Number.POSITIVE_INFINITY]) {
    const refused = /^ledger: heartbeatSeconds must be a positive number of seconds, got /;
    const call = { runId: "r", toolRef: "t", arguments: {}, toolCallId: "c", execute: never.execute, heartbeatSeconds };
    await assert.rejects(toolCall(acme, call), (e: unknown) => e instanceof RangeError && refused.test(e.message));
    const turn = [{ toolRef: "t", arguments: {}, toolCallId: "c", execute: never.execute }];
    await assert.rejects(toolCalls(acme, "r", turn, { heartbeatSeconds }), RangeError);
    await assert.rejects(work(acme, async () => "", { heartbeatSeconds }), RangeError);
  }
  assert.equal(never.runs, 0);
  assert.deepEqual(await db.sql("SELECT count(*)::int AS n FROM ledger.run_step_tool_calls"), [{ n: 0 }]);
});

test("the batch helper: two overlapping workers execute each call of a turn once", async (t) => {
  const db = await freshDb(t, "batch");
  const acme = db.ledger.scoped("acme", "ts");
  await runningRun(acme, "r");
  const runs = new Map<string, number>();
  const turn = (worker: string) =>
    ["weather", "fx", "news"].map((id) => ({
      toolRef: `${id}.get`,
      arguments: { q: id },
      toolCallId: id,
      execute: async (args: { [key: string]: unknown }): Promise<string> => {
        runs.set(id, (runs.get(id) ?? 0) + 1);
        await sleep(300);
        return `${String(args["q"])} by ${worker}`;
      },
    }));
  const [a, b] = await Promise.all([
    toolCalls(acme, "r", turn("a"), { leaseOwner: "worker-a" }),
    toolCalls(acme, "r", turn("b"), { leaseOwner: "worker-b" }),
  ]);
  assert.deepEqual(Object.fromEntries(runs), { weather: 1, fx: 1, news: 1 }, "each call executed once");
  // Per call, one worker executed it and the other found it busy (or replayed it, if it came late).
  for (let i = 0; i < 3; i += 1) {
    const pair = [a[i], b[i]].map((r) =>
      r?.error === undefined ? `value:${r?.claim.outcome}` : r.error instanceof BusyError ? "busy" : String(r.error),
    );
    assert.ok(pair.includes("value:claimed"), pair.join());
    assert.ok(pair.includes("busy") || pair.includes("value:replayed"), pair.join());
  }

  // The turn again: every call replays its recorded result, in input order; nothing runs.
  const again = await toolCalls(acme, "r", turn("c"), { leaseOwner: "worker-c" });
  assert.deepEqual(
    again.map((r) => r.claim.outcome),
    ["replayed", "replayed", "replayed"],
  );
  assert.deepEqual(
    again.map((r) => String(r.get()).split(" by ")[0]),
    ["weather", "fx", "news"],
  );
  assert.deepEqual(Object.fromEntries(runs), { weather: 1, fx: 1, news: 1 });
  const rows = await db.sql("SELECT tool_call_id, status, attempt FROM ledger.run_step_tool_calls ORDER BY tool_call_id");
  assert.deepEqual(
    rows.map((r) => [r["tool_call_id"], r["status"], r["attempt"]]),
    [
      ["fx", "succeeded", "1"],
      ["news", "succeeded", "1"],
      ["weather", "succeeded", "1"],
    ],
  );
});
