/** The worker loop: a crash mid-call, a takeover, a person's two decisions; run-lease heartbeats; failures. */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import {
  ChildrenTimedOutError,
  ConflictError,
  InputTimedOutError,
  Ledger,
  RunContext,
  ScopeError,
  WaitingForChildrenError,
  WaitingForInputError,
  WaitingUntilError,
  WrongStateError,
  work,
  type ClaimedRun,
  type RunOutcome,
} from "../src/index.js";
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

test("an agent that waits for an input without a deadline: the run parked until 'infinity' is read, and resumed by the input", async (t) => {
  const db = await freshDb(t, "input_forever");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-open" });
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  const loop = work(acme, async (ctx) => `answer ${((await ctx.waitForInput("ask", "answer")) as { n: number }).n}`, {
    leaseOwner: "worker-1",
    idleSeconds: 0.05,
    signal: stop.signal,
    onRun: (_run, o) => outcomes.push(o),
  });
  try {
    await waitFor("the run parked", () => outcomes.length === 1);
    assert.deepEqual(outcomes[0], { status: "waiting_input", wakeAt: null, reason: "step ask: waiting for input answer" });
    assert.deepEqual(await db.sql("SELECT not_before::text AS t FROM ledger.runs"), [{ t: "infinity" }]);
    assert.equal((await acme.getRun("r-open"))?.notBefore?.getTime(), 8.64e15, "the latest Date");
    await acme.sendInput("r-open", "answer", { n: 7 });
    await waitFor("the run to finish", () => outcomes.length === 2);
  } finally {
    stop.abort();
    await loop;
  }
  assert.deepEqual(outcomes[1], { status: "succeeded", reply: "answer 7" });
});

test("an agent that waits for an input: parked until another connection sends it, resumed with the payload, read again on a later resume", async (t) => {
  const db = await freshDb(t, "input_worker");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-ask" });
  const answers: unknown[] = [];
  const asked: number[] = [];
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  const loop = work(
    acme,
    async (ctx) => {
      await ctx.step("ask", "message", async () => "asked the customer");
      asked.push(Date.now()); // the timeout counts from here on every turn
      const answer = (await ctx.waitForInput("refund-ok", "refund-ok", { timeoutSeconds: 3600 })) as { answer: string };
      answers.push(answer);
      await ctx.waitUntil("cool-off", new Date(Date.now() + 500));
      return `refund ${answer.answer}`;
    },
    { leaseOwner: "worker-1", idleSeconds: 0.05, signal: stop.signal, onRun: (_run, o) => outcomes.push(o) },
  );
  const run = async (): Promise<unknown[]> => {
    const [row] = await db.sql("SELECT status, lease_owner, run_token FROM ledger.runs WHERE id = 'r-ask'");
    return [row?.["status"], row?.["lease_owner"], row?.["run_token"]];
  };
  let deadline = new Date(0);
  try {
    await waitFor("the run parked", () => outcomes.length === 1);
    // Parked by the wait itself, its lease given up; the step records the first turn's deadline.
    assert.deepEqual(await run(), ["waiting_input", null, "1"]);
    const [step] = await db.sql("SELECT status, input_summary FROM ledger.run_steps WHERE step_key = 'refund-ok'");
    assert.equal(step?.["status"], "waiting_input");
    deadline = new Date(String(step?.["input_summary"]));
    assert.ok(Math.abs((asked[0] ?? 0) + 3_600_000 - deadline.getTime()) < 1000);
    const [mailbox] = await db.sql("SELECT wait_deadline FROM ledger.run_mailbox WHERE input_key = 'refund-ok'");
    assert.deepEqual(mailbox?.["wait_deadline"], deadline);
    await sleep(300);
    assert.equal(asked.length, 1, "not claimable while it waits");
    // Someone answers through another connection: the run is claimable at once and resumed.
    const other = Ledger.connect(db.dsn);
    t.after(() => other.close());
    await other.scoped("acme", "ts").sendInput("r-ask", "refund-ok", { answer: "yes" }, { sender: "lead@acme" });
    await waitFor("the run to finish", () => outcomes.length === 3);
  } finally {
    stop.abort();
    await loop;
  }
  assert.deepEqual(outcomes[0], {
    status: "waiting_input",
    wakeAt: deadline,
    reason: `step refund-ok: waiting for input refund-ok until ${deadline.toISOString()}`,
  });
  assert.equal(outcomes[1]?.status, "waiting_input"); // the cool-off
  assert.deepEqual(outcomes[2], { status: "succeeded", reply: "refund yes" });
  // The third turn read the same input again without waiting (the step had succeeded).
  assert.deepEqual(answers, [{ answer: "yes" }, { answer: "yes" }]);
  assert.equal(asked.length, 3);
  assert.deepEqual(await db.sql("SELECT status, run_token::int AS t, output_summary FROM ledger.runs WHERE id = 'r-ask'"), [
    { status: "succeeded", t: 3, output_summary: "refund yes" },
  ]);
  const steps = await db.sql("SELECT step_key, status, input_summary FROM ledger.run_steps WHERE step_type = 'wait' ORDER BY step_no");
  assert.deepEqual(
    steps.map((r) => [r["step_key"], r["status"]]),
    [
      ["refund-ok", "succeeded"],
      ["cool-off", "succeeded"],
    ],
  );
  assert.equal(steps[0]?.["input_summary"], deadline.toISOString(), "the later turns' deadlines did not move it");
  const moves = await db.sql(
    "SELECT payload->>'from' AS f, payload->>'to' AS t FROM ledger.run_events WHERE run_id = 'r-ask' AND event_type = 'run.status' ORDER BY seq",
  );
  assert.deepEqual(
    moves.map((m) => `${String(m["f"])}>${String(m["t"])}`),
    ["queued>running", "running>waiting_input", "waiting_input>running", "running>waiting_input", "waiting_input>running", "running>succeeded"],
  );
});

test("a wait for an input that does not come times out at its first deadline; outside a worker the wait parks and throws", async (t) => {
  const db = await freshDb(t, "input_timeout");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-silent" });
  const deadlines: (Date | null)[] = [];
  const outcomes: RunOutcome[] = [];
  const stop = new AbortController();
  const loop = work(
    acme,
    async (ctx) => {
      try {
        await ctx.waitForInput("confirm", "confirmed", { timeoutSeconds: 1 }); // another deadline each turn
      } catch (error) {
        if (!(error instanceof InputTimedOutError)) throw error;
        deadlines.push(error.deadline);
        return "no answer: closed";
      }
      return "confirmed";
    },
    { leaseOwner: "worker-1", idleSeconds: 0.05, signal: stop.signal, onRun: (_run, o) => outcomes.push(o) },
  );
  let notBefore: Date | null | undefined;
  try {
    await waitFor("the run parked", () => outcomes.length === 1);
    notBefore = (await acme.getRun("r-silent"))?.notBefore;
    await waitFor("the run resumed at its deadline", () => outcomes.length === 2);
  } finally {
    stop.abort();
    await loop;
  }
  assert.ok(notBefore instanceof Date);
  assert.deepEqual(deadlines, [notBefore], "the resume asked with the first deadline: timed out");
  assert.deepEqual(outcomes[1], { status: "succeeded", reply: "no answer: closed" });
  assert.deepEqual(await db.sql("SELECT status FROM ledger.run_steps WHERE step_key = 'confirm'"), [{ status: "expired" }]);
  await assert.rejects(
    acme.sendInput("r-silent", "confirmed", { ok: true }),
    (e: unknown) => e instanceof WrongStateError && e.code === "RUN_TERMINAL",
  );

  await acme.createRun("agent", { runId: "r-alone" });
  const claimed = await acme.claimRun("worker-2", { runId: "r-alone" });
  assert.ok(claimed);
  await acme.transitionRun("r-alone", "running", { runToken: claimed.runToken });
  const ctx = new RunContext(acme, claimed, new AbortController().signal);
  const later = new Date(Date.now() + 86_400_000);
  const waiting = await ctx.waitForInput("ask", "form", { deadline: later }).catch((e: unknown) => e);
  assert.ok(waiting instanceof WaitingForInputError);
  assert.deepEqual([waiting.stepKey, waiting.inputKey, waiting.deadline], ["ask", "form", later]);
  await assert.rejects(acme.heartbeatRun("r-alone", claimed.runToken), (e: unknown) => e instanceof ConflictError && e.code === "LEASE_STALE");
  await assert.rejects(ctx.waitForInput("both", "form", { deadline: later, timeoutSeconds: 60 }), TypeError);
  await assert.rejects(ctx.waitForChildren("zero", { timeoutSeconds: 0 }), RangeError);
});

test("a parent waits for its two children, driven by the same worker, and resumes with their outcomes", async (t) => {
  const db = await freshDb(t, "children_worker");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("parent", { runId: "r-parent", inputs: { orders: [1, 2] } });
  const turns: number[] = [];
  const outcomes: [string, RunOutcome][] = [];
  const stop = new AbortController();
  const loop = work(
    acme,
    async (ctx) => {
      if (ctx.run.mode === "child") {
        if (ctx.inputs["order"] === 2) throw new Error("the carrier is down");
        return `label for order ${String(ctx.inputs["order"])}`;
      }
      turns.push(ctx.run.runToken);
      for (const order of ctx.inputs["orders"] as number[]) {
        // Found again by runId on a resume.
        await ctx.ledger.createRun("child", { runId: `r-child-${order}`, parentRunId: ctx.runId, inputs: { order } });
      }
      const children = await ctx.waitForChildren("labels");
      return children.map((c) => `${c.runId} ${c.status}: ${c.outputSummary ?? c.errorMessage ?? ""}`).join("; ");
    },
    { leaseOwner: "worker-1", idleSeconds: 0.05, signal: stop.signal, onRun: (run, o) => outcomes.push([run.runId, o]) },
  );
  try {
    await waitFor("the parent to finish", () => outcomes.length === 4);
  } finally {
    stop.abort();
    await loop;
  }
  assert.deepEqual(
    outcomes.map(([id, o]) => `${id} ${o.status}`),
    ["r-parent waiting_input", "r-child-1 succeeded", "r-child-2 failed", "r-parent succeeded"],
    "the parent was not handed out before its last child ended",
  );
  assert.deepEqual(turns, [1, 2]);
  assert.deepEqual(outcomes[3]?.[1], {
    status: "succeeded",
    reply: "r-child-1 succeeded: label for order 1; r-child-2 failed: the carrier is down",
  });
  const [step] = await db.sql("SELECT status, metrics FROM ledger.run_steps WHERE step_key = 'labels'");
  assert.equal(step?.["status"], "succeeded");
  const kept = (step?.["metrics"] as { children: Record<string, unknown>[] }).children;
  assert.deepEqual(
    kept.map((c) => [c["run_id"], c["status"], c["error_code"]]),
    [
      ["r-child-1", "succeeded", null],
      ["r-child-2", "failed", "Error"],
    ],
  );

  // A deadline that passes first: the step expires with the children as they stood, and a resume
  // throws again from the step (not asking the ledger, whose answer changed); a wait that ended
  // keeps its children's outcomes the same way.
  await acme.createRun("parent", { runId: "r-late" });
  const claimed = await acme.claimRun("worker-2", { runId: "r-late" });
  assert.ok(claimed);
  await acme.transitionRun("r-late", "running", { runToken: claimed.runToken });
  await acme.createRun("child", { runId: "r-slow", parentRunId: "r-late" });
  const ctx = new RunContext(acme, claimed, new AbortController().signal);
  const past = new Date(Date.now() - 1000);
  const stood = [{ runId: "r-slow", status: "queued", outputSummary: null, errorCode: null, errorMessage: null }];
  const late = await ctx.waitForChildren("slow", { deadline: past }).catch((e: unknown) => e);
  assert.ok(late instanceof ChildrenTimedOutError);
  assert.deepEqual([late.deadline, late.children], [past, stood]);
  await acme.transitionRun("r-slow", "canceled", { errorMessage: "too slow" });
  const again = await ctx.waitForChildren("slow", { deadline: past }).catch((e: unknown) => e);
  assert.ok(again instanceof ChildrenTimedOutError);
  assert.deepEqual(again.children, stood);
  assert.deepEqual(await db.sql("SELECT status FROM ledger.run_steps WHERE step_key = 'slow'"), [{ status: "expired" }]);
  const ended = await ctx.waitForChildren("ended");
  assert.deepEqual(ended, [{ runId: "r-slow", status: "canceled", outputSummary: null, errorCode: null, errorMessage: "too slow" }]);
  await acme.createRun("child", { runId: "r-next", parentRunId: "r-late" });
  assert.deepEqual(await ctx.waitForChildren("ended"), ended, "the recorded outcomes: r-next is another wait's");
  const waiting = await ctx.waitForChildren("next").catch((e: unknown) => e);
  assert.ok(waiting instanceof WaitingForChildrenError);
  assert.deepEqual(
    waiting.children.map((c) => c.runId),
    ["r-slow", "r-next"],
  );
});

test("fireSchedulesSeconds: the worker fires the due schedules (here every scope's) before it claims", async (t) => {
  const db = await freshDb(t, "schedule_worker");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.setSchedule("nightly", "30 1 * * *", "digest", { inputs: { team: "support" } });
  await db.sql("UPDATE ledger.schedules SET next_fire_at = now() - interval '1 minute'"); // the night came
  const agent = async (ctx: RunContext): Promise<string> => `digest for ${String(ctx.inputs["team"])}`;
  const outcomes: RunOutcome[] = [];
  const run = async (source: Ledger | typeof acme, options: { fireSchedulesSeconds?: number }): Promise<void> => {
    const stop = new AbortController();
    const loop = work(source, agent, { idleSeconds: 0.05, signal: stop.signal, onRun: (_run, o) => outcomes.push(o), ...options });
    try {
      if (options.fireSchedulesSeconds === undefined) await sleep(300);
      else await waitFor("the firing's run", () => outcomes.length === 1);
    } finally {
      stop.abort();
      await loop;
    }
  };
  await run(acme, {});
  assert.deepEqual(outcomes, [], "by default a worker fires nothing");
  await assert.rejects(work(acme, agent, { fireSchedulesSeconds: 0 }), RangeError);
  // A worker of every scope fires every scope's schedules (fire_schedules(any_scope => true)).
  await run(db.ledger, { fireSchedulesSeconds: 60 });
  assert.deepEqual(outcomes, [{ status: "succeeded", reply: "digest for support" }]);
  const [fired] = await db.sql("SELECT request_id FROM ledger.runs");
  assert.match(String(fired?.["request_id"]), /^schedule:nightly:/);
});

test("an idle worker is woken by a new run's notification and by next_wake, not by its idle bound; a stop ends its sleep", async (t) => {
  const db = await freshDb(t, "idle_worker");
  const acme = db.ledger.scoped("acme", "ts");
  // Parked for 2 s before any worker starts, so that no notification can tell one: only next_wake does.
  await acme.createRun("agent", { runId: "r-later" });
  const parking = await acme.claimRun("someone", { runId: "r-later" });
  assert.ok(parking);
  await acme.transitionRun("r-later", "running", { runToken: parking.runToken });
  const wakeAt = new Date(Date.now() + 2000);
  await acme.waitRun("r-later", parking.runToken, wakeAt);
  const claimed = new Map<string, number>();
  const agent = async (ctx: RunContext): Promise<string> => {
    claimed.set(ctx.runId, Date.now());
    return "done";
  };
  const idle = { idleSeconds: 60, stopOn: [], onError: (e: unknown) => assert.fail(String(e)) };

  // A worker of every scope (next_wake(any_scope => true)) claims it at its wake time.
  const everyScope = new AbortController();
  const first = work(db.ledger, agent, { ...idle, leaseOwner: "worker-1", signal: everyScope.signal });
  try {
    await waitFor("the claim at the wake time", () => claimed.has("r-later"));
  } finally {
    everyScope.abort();
    await first;
  }
  const at = claimed.get("r-later") ?? assert.fail("not claimed");
  assert.ok(at >= wakeAt.getTime() && at < wakeAt.getTime() + 5000, `claimed ${at - wakeAt.getTime()} ms after its wake time`);

  // A worker of the scope, asleep, claims a run another connection creates at once.
  const scoped = new AbortController();
  const second = work(acme, agent, { ...idle, leaseOwner: "worker-2", signal: scoped.signal });
  let stopped = 0;
  try {
    await sleep(500); // its first claim found nothing: it sleeps
    const created = Date.now();
    await acme.createRun("agent", { runId: "r-new" });
    await waitFor("the new run's claim", () => claimed.has("r-new"));
    assert.ok((claimed.get("r-new") ?? Infinity) - created < 5000, "woken, not polled after 60 s");
    await sleep(500); // asleep again
  } finally {
    const asked = Date.now();
    scoped.abort();
    await second;
    stopped = Date.now() - asked;
  }
  assert.ok(stopped < 5000, `a stop ended the sleep ${stopped} ms after it was asked`);
});

test("an idle worker listens again after its connection is lost", async (t) => {
  const db = await freshDb(t, "idle_relisten");
  const acme = db.ledger.scoped("acme", "ts");
  const claimed: string[] = [];
  const listening = async (): Promise<number[]> =>
    (
      await db.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE '%ledger.next_wake(any_scope%' AND pid <> pg_backend_pid()",
      )
    ).map((r) => Number(r["pid"]));
  const stop = new AbortController();
  const errors: unknown[] = [];
  const loop = work(
    acme,
    async (ctx) => {
      claimed.push(ctx.runId);
      return "done";
    },
    { leaseOwner: "worker-1", idleSeconds: 60, signal: stop.signal, stopOn: [], onError: (e) => errors.push(e) },
  );
  try {
    await waitFor("the worker's listening connection", async () => (await listening()).length === 1);
    const [lost] = await listening();
    await db.sql("SELECT pg_terminate_backend($1)", [lost]);
    await waitFor("a new listening connection", async () => {
      const now = await listening();
      return now.length === 1 && now[0] !== lost;
    });
    const created = Date.now();
    await acme.createRun("agent", { runId: "r-after" });
    await waitFor("the run's claim", () => claimed.length === 1);
    assert.ok(Date.now() - created < 5000);
  } finally {
    stop.abort();
    await loop;
  }
  assert.deepEqual(claimed, ["r-after"]);
  assert.ok(errors.length >= 1, "the lost connection was reported");
});
