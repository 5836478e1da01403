/** The worker loop: a crash mid-call, a takeover, a person's two decisions; run-lease heartbeats; failures. */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import { Ledger, RunContext, ScopeError, WaitingUntilError, work, type ClaimedRun, type RunOutcome } from "../src/index.js";
import { supportAgent } from "./fixtures/support-agent.js";
import { expireLeases, freshDb, waitFor } from "./helpers.js";

const here = dirname(fileURLToPath(import.meta.url));

function count(effects: string, name: string): number {
  try {
    return readFileSync(join(effects, name), "utf8").split("\n").filter(Boolean).length;
  } catch {
    return 0;
  }
}

test("a worker killed mid-call; the takeover parks the run in doubt; a person resolves and approves; the run completes", async (t) => {
  const db = await freshDb(t, "crash");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "support-1", inputs: { order: 7 } });
  const effects = mkdtempSync(join(tmpdir(), "ledger-ts-effects-"));
  const status = async (): Promise<string | undefined> => (await acme.getRun("support-1"))?.status;

  // 1. A worker process, killed (SIGKILL) while the lookup's request is out.
  const child = spawn(process.execPath, [join(here, "fixtures", "crash-worker.js")], {
    env: { ...process.env, LEDGER_DSN: db.dsn, EFFECTS: effects, LOOKUP_SECONDS: "600" },
    stdio: "inherit",
  });
  const exited = new Promise((resolve) => child.once("exit", resolve));
  t.after(() => child.kill("SIGKILL"));
  await waitFor("the lookup's request", () => count(effects, "lookup") === 1);
  child.kill("SIGKILL");
  await exited;
  // Its leases would run out in a minute; the test ends them now instead of waiting.
  await expireLeases(db, "support-1");

  // 2. A second worker takes over, finds the lookup in doubt and parks the run.
  const outcomes: [ClaimedRun, RunOutcome][] = [];
  const stop = new AbortController();
  const loop = work(acme, supportAgent(effects, 0), {
    leaseOwner: "worker-2",
    idleSeconds: 0.05,
    signal: stop.signal,
    stopOn: [],
    onRun: (run, outcome) => outcomes.push([run, outcome]),
  });
  try {
    await waitFor("the run parked in doubt", async () => (await status()) === "paused");
    const doubt = await acme.query("SELECT id, lease_owner FROM ledger.tool_calls_in_doubt");
    assert.deepEqual(
      doubt.map((r) => r["lease_owner"]),
      ["worker-1"],
    );
    // 3. A person checks the CRM and resolves the call; the worker resumes and parks for approval.
    await acme.resolveToolCall(String(doubt[0]?.["id"]), "succeeded", {
      result: { order: 7, paid: "12.50" },
      actor: "ops@acme",
      note: "seen in the CRM",
    });
    await waitFor("the run parked for approval", async () => (await status()) === "waiting_approval");
    // 4. The person approves; the worker executes the refund and finishes the run.
    const [pending] = await acme.query("SELECT id FROM ledger.pending_approvals");
    await acme.resolveApproval(String(pending?.["id"]), "approved", { actor: "lead@acme" });
    await waitFor("the run to finish", async () => ["succeeded", "failed"].includes((await status()) ?? ""));
  } finally {
    stop.abort();
    await loop;
  }

  assert.equal(await status(), "succeeded");
  const executed = Object.fromEntries(["model-plan", "lookup", "refund", "model-answer"].map((n) => [n, count(effects, n)]));
  assert.deepEqual(executed, { "model-plan": 1, lookup: 1, refund: 1, "model-answer": 1 });
  assert.deepEqual(
    outcomes.map(([run, o]) => [run.takeover, o.status]),
    [
      [true, "paused"],
      [false, "waiting_approval"],
      [false, "succeeded"],
    ],
  );
  assert.equal(outcomes[0]?.[0].previousOwner, "worker-1");
  const last = outcomes.at(-1)?.[1];
  assert.deepEqual(last, { status: "succeeded", reply: "Refunded 12.50." });
  const ready = await acme.replayReady("support-1");
  assert.equal(ready["status"], "pass", JSON.stringify(ready));
  const shown = await acme.query("SELECT event_type, payload FROM ledger.response_events WHERE run_id = 'support-1'");
  assert.deepEqual(shown, [{ event_type: "message", payload: { text: "Refunded 12.50." } }]);
  const costs = await acme.query("SELECT amount::text, billed_quantity::int FROM ledger.run_cost_entries ORDER BY created_at");
  assert.deepEqual(costs, [
    { amount: "0.0012", billed_quantity: 120 },
    { amount: null, billed_quantity: 90 },
  ]);
});

test("run-lease heartbeats keep a slow run; a stop lets the run in hand finish; a failing agent fails its run", async (t) => {
  const db = await freshDb(t, "runlease");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "slow" });
  const stop = new AbortController();
  let thief: ClaimedRun | null = null;
  const outcomes: RunOutcome[] = [];
  const loop = work(
    acme,
    async (ctx) => {
      stop.abort(); // a stop while the run is in hand: it is finished first
      const until = Date.now() + 4000;
      while (Date.now() < until && thief === null) {
        thief = await acme.claimRun("thief");
        await sleep(200);
      }
      return ctx.step("work", "workflow_node", async () => "done");
    },
    { leaseOwner: "worker", leaseSeconds: 2, idleSeconds: 0.05, signal: stop.signal, stopOn: [], onRun: (_run, o) => outcomes.push(o) },
  );
  await loop;
  assert.equal(thief, null, "the 2 s lease was renewed all along: nobody could take the run over");
  assert.deepEqual(outcomes, [{ status: "succeeded", reply: "done" }]);
  assert.equal((await acme.getRun("slow"))?.status, "succeeded");

  await acme.createRun("agent", { runId: "broken" });
  const stop2 = new AbortController();
  const failing = work(
    acme,
    async () => {
      stop2.abort();
      throw new Error("the model refused");
    },
    { idleSeconds: 0.05, signal: stop2.signal, stopOn: [] },
  );
  await failing;
  const broken = await acme.getRun("broken");
  assert.equal(broken?.status, "failed");
  assert.equal(broken?.errorMessage, "the model refused");
});

test("SIGTERM stops a worker process after the run in hand; past the grace period a run is released", async (t) => {
  const db = await freshDb(t, "sigterm");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "support-2", inputs: { order: 8 } });
  const effects = mkdtempSync(join(tmpdir(), "ledger-ts-effects-"));
  const child = spawn(process.execPath, [join(here, "fixtures", "crash-worker.js")], {
    env: { ...process.env, LEDGER_DSN: db.dsn, EFFECTS: effects, LOOKUP_SECONDS: "1" },
    stdio: "inherit",
  });
  const exited = new Promise<number | null>((resolve) => child.once("exit", resolve));
  t.after(() => child.kill("SIGKILL"));
  await waitFor("the lookup's request", () => count(effects, "lookup") === 1);
  child.kill("SIGTERM");
  assert.equal(await exited, 0, "the worker process ended by itself");
  // The run in hand was driven as far as it goes (the lookup answered, the refund waits), not abandoned.
  assert.equal((await acme.getRun("support-2"))?.status, "waiting_approval");
  const calls = await acme.query("SELECT tool_call_id, status FROM ledger.run_step_tool_calls ORDER BY created_at");
  assert.deepEqual(calls, [
    { tool_call_id: "lookup", status: "succeeded" },
    { tool_call_id: "refund", status: "waiting_approval" },
  ]);

  // An agent that does not finish within the grace period: the run is released, its signal aborts.
  await acme.createRun("agent", { runId: "stuck" });
  const stop = new AbortController();
  let aborted = false;
  const outcomes: RunOutcome[] = [];
  const loop = work(
    acme,
    async (ctx) => {
      stop.abort();
      await new Promise((resolve) => ctx.signal.addEventListener("abort", resolve));
      aborted = true;
      return "too late";
    },
    { shutdownGraceSeconds: 0.3, idleSeconds: 0.05, signal: stop.signal, stopOn: [], onRun: (_run, o) => outcomes.push(o) },
  );
  await loop;
  assert.deepEqual(outcomes, [{ status: "released", reason: "the worker stopped before the agent finished" }]);
  await waitFor("the agent's signal", () => aborted);
  const stuck = await acme.getRun("stuck");
  assert.equal(stuck?.status, "running");
  assert.equal(stuck?.leaseOwner, null, "released: claimable at once by another worker");
  assert.equal((await acme.claimRun("next", { runId: "stuck" }))?.runId, "stuck");
});

test("a used-up budget parks the run (a tool call, then an llm step refused) until a person raises it", async (t) => {
  const db = await freshDb(t, "budget_worker");
  const acme = db.ledger.scoped("acme", "ts");
  const done: string[] = [];
  const model = (text: string) => async () => {
    done.push(text);
    return { text, usage: { total_tokens: 40 } };
  };
  const lookup = async (): Promise<{ paid: string }> => {
    done.push("lookup");
    return { paid: "3.00" };
  };
  await acme.createRun("agent", { runId: "r-budget" });
  await acme.setBudget("llm_steps", 1, { level: "run", runId: "r-budget" });
  await acme.setBudget("tool_calls", 1);
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  const loop = work(
    acme,
    async (ctx) => {
      await ctx.llmStep("plan", model("plan"));
      const found = await ctx.toolCall("lookup", "crm.lookup_order", { order: 5 }, lookup);
      return ctx.llmStep("answer", model(`paid ${found.paid}`));
    },
    { leaseOwner: "worker-1", idleSeconds: 0.05, signal: stop.signal, stopOn: [], onRun: (_run, o) => outcomes.push(o) },
  );
  const run = async (): Promise<unknown[]> => {
    const r = await acme.getRun("r-budget");
    return [r?.status, r?.errorCode, r?.leaseOwner];
  };
  try {
    // The plan's step uses up the run's llm_steps: the lookup is refused, and not executed.
    await waitFor("the run parked", () => outcomes.length === 1);
    assert.equal(outcomes[0]?.status, "paused");
    assert.deepEqual(done, ["plan"]);
    assert.deepEqual(await run(), ["paused", "BUDGET_EXHAUSTED", null], "parked and released");
    assert.equal(await acme.claimRun("w-other"), null, "not claimable while the budget is used up");
    await acme.setBudget("llm_steps", 3, { level: "run", runId: "r-budget", actor: "lead@acme", note: "go on" });
    // The lookup uses up the workspace's tool_calls: the answer's llm step is refused, the model not called.
    await waitFor("the run parked again", () => outcomes.length === 2);
    assert.equal(outcomes[1]?.status, "paused");
    assert.deepEqual(done, ["plan", "lookup"]);
    assert.deepEqual(await run(), ["paused", "BUDGET_EXHAUSTED", null]);
    assert.deepEqual(await db.sql("SELECT status, error_code FROM ledger.run_steps WHERE step_key = 'answer'"), [
      { status: "paused", error_code: "BUDGET_EXHAUSTED" },
    ]);
    await acme.setBudget("tool_calls", 5, { actor: "lead@acme" });
    await waitFor("the run to finish", () => outcomes.length === 3);
  } finally {
    stop.abort();
    await loop;
  }
  assert.deepEqual(outcomes[2], { status: "succeeded", reply: "paid 3.00" });
  assert.deepEqual(done, ["plan", "lookup", "paid 3.00"]);
  const refusals = await db.sql(
    "SELECT payload->>'decision' AS decision FROM ledger.run_events WHERE run_id = 'r-budget' AND event_type = 'budget.exhausted' ORDER BY seq",
  );
  assert.deepEqual(refusals.map((r) => r["decision"]), ["tool_call", "llm_step"]);
});

test("a worker over every scope (any_scope) drives each run in its own scope; a non-operator is refused", async (t) => {
  const db = await freshDb(t, "anyscope");
  await db.ledger.scoped("acme", "support").createRun("agent", { runId: "a-1" });
  await db.ledger.scoped("globex", "billing").createRun("agent", { runId: "g-1" });
  const stop = new AbortController();
  const done: string[] = [];
  await work(db.ledger, async (ctx) => `${ctx.ledger.tenant}/${ctx.ledger.workspace}`, {
    idleSeconds: 0.05,
    signal: stop.signal,
    stopOn: [],
    onRun: (run) => {
      done.push(`${run.tenantId}/${run.workspaceId}/${run.runId}`);
      if (done.length === 2) stop.abort();
    },
  });
  assert.deepEqual(done.sort(), ["acme/support/a-1", "globex/billing/g-1"]);
  for (const [tenant, workspace, runId] of [
    ["acme", "support", "a-1"],
    ["globex", "billing", "g-1"],
  ] as const) {
    const run = await db.ledger.scoped(tenant, workspace).getRun(runId);
    assert.equal(run?.status, "succeeded");
    assert.equal(run?.outputSummary, `${tenant}/${workspace}`);
  }

  // A login role with ledger_writer only may not claim across scopes.
  await db.sql("DO $$ BEGIN CREATE ROLE ledger_ts_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$");
  await db.sql("GRANT ledger_writer TO ledger_ts_app");
  const app = Ledger.connect(`${db.dsn} user=ledger_ts_app`);
  try {
    await assert.rejects(app.claimRun("w"), (e: unknown) => e instanceof ScopeError && e.code === "OPERATOR_REQUIRED");
  } finally {
    await app.close();
    await db.sql("DROP ROLE ledger_ts_app");
  }
});

test("an agent that waits until a time: parked by waitRun, resumed by a claim after the wake time", async (t) => {
  const db = await freshDb(t, "wait_worker");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-wait", inputs: { order: 4 } });
  const turns: Date[] = [];
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  const loop = work(
    acme,
    async (ctx) => {
      const asked = new Date(Date.now() + 1000); // another time on every turn
      turns.push(asked);
      const woke = await ctx.waitUntil("follow-up", asked);
      return `followed up on order ${String(ctx.inputs["order"])} at ${woke.toISOString()}`;
    },
    { leaseOwner: "worker-1", idleSeconds: 0.05, signal: stop.signal, stopOn: [], onRun: (_run, o) => outcomes.push(o) },
  );
  let parked: unknown[] = [];
  try {
    await waitFor("the run parked", () => outcomes.length === 1);
    const run = await acme.getRun("r-wait");
    parked = [run?.status, run?.leaseOwner, run?.runToken, run?.notBefore?.getTime()];
    await waitFor("the run resumed after its wake time", () => outcomes.length === 2);
  } finally {
    stop.abort();
    await loop;
  }
  const first = turns[0] ?? assert.fail("no turn");
  // Parked by wait_run, its lease given up (nothing released or moved after it), until the step's time.
  assert.deepEqual(parked, ["waiting_input", null, 1, first.getTime()]);
  assert.deepEqual(outcomes[0], { status: "waiting_input", wakeAt: first, reason: `step follow-up: waiting until ${first.toISOString()}` });
  assert.equal(turns.length, 2);
  assert.ok(Date.now() >= first.getTime());
  const reply = `followed up on order 4 at ${first.toISOString()}`; // the first wake time, not the resume's
  assert.deepEqual(outcomes[1], { status: "succeeded", reply });
  const ended = await acme.getRun("r-wait");
  assert.deepEqual([ended?.status, ended?.runToken, ended?.outputSummary], ["succeeded", 2, reply]);
  const moves = await db.sql(
    "SELECT payload->>'from' AS f, payload->>'to' AS t FROM ledger.run_events WHERE run_id = 'r-wait' AND event_type = 'run.status' ORDER BY seq",
  );
  assert.deepEqual(
    moves.map((m) => `${String(m["f"])}>${String(m["t"])}`),
    ["queued>running", "running>waiting_input", "waiting_input>running", "running>succeeded"],
  );
  assert.deepEqual(await db.sql("SELECT step_type, status, input_summary FROM ledger.run_steps WHERE run_id = 'r-wait'"), [
    { step_type: "wait", status: "succeeded", input_summary: first.toISOString() },
  ]);

  // Outside a worker the agent's turn ends with the error.
  await acme.createRun("agent", { runId: "r-alone" });
  const claimed = await acme.claimRun("worker-2", { runId: "r-alone" });
  assert.ok(claimed);
  const later = new Date(Date.now() + 3_600_000);
  const waiting = await new RunContext(acme, claimed, new AbortController().signal).waitUntil("tomorrow", later).catch((e: unknown) => e);
  assert.ok(waiting instanceof WaitingUntilError);
  assert.equal(waiting.stepKey, "tomorrow");
  assert.equal(waiting.wakeAt.getTime(), later.getTime());
});
