/** The scoped handle: typed results, typed errors, the transaction escape hatch, the conninfo reader. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import pg from "pg";

import {
  ConflictError,
  IdempotencyMismatchError,
  InvalidArgumentError,
  Ledger,
  LedgerError,
  NotFoundError,
  parseConninfo,
  ReadOnlyError,
  ScopeError,
  toLedgerError,
  WrongStateError,
} from "../src/index.js";
import { freshDb } from "./helpers.js";

test("typed results: runs, steps, claimed runs, costs, events", async (t) => {
  const db = await freshDb(t, "typed");
  const acme = db.ledger.scoped("acme", "ts");
  const run = await acme.createRun("agent", { inputs: { order: 7 }, runId: "run-typed", userId: "u-1" });
  assert.equal(run.id, "run-typed");
  assert.equal(run.status, "queued");
  assert.deepEqual(run.inputs, { order: 7 });
  assert.ok(run.createdAt instanceof Date);
  assert.equal(run.runToken, 0);

  const claimed = await acme.claimRun("w-1", { leaseSeconds: 30 });
  assert.ok(claimed);
  assert.equal(claimed.runId, "run-typed");
  assert.equal(claimed.runToken, 1);
  assert.equal(claimed.takeover, false);
  assert.equal(claimed.tenantId, "acme");
  assert.ok(claimed.leaseExpiresAt.getTime() > Date.now());
  assert.deepEqual(claimed.inputs, { order: 7 });
  assert.equal(await acme.claimRun("w-2"), null, "nothing else is claimable");

  const running = await acme.transitionRun("run-typed", "running", { runToken: 1 });
  assert.equal(running.status, "running");
  assert.ok(running.startedAt instanceof Date);
  const step = await acme.createStep("run-typed", "llm", { stepKey: "plan", runToken: 1 });
  assert.equal(step.stepNo, 1);
  assert.equal(step.status, "queued");
  assert.equal((await acme.createStep("run-typed", "llm", { stepKey: "plan" })).id, step.id, "found again by key");
  await acme.transitionStep(step.id, "running", { metrics: { model: "small" } });
  const done = await acme.transitionStep(step.id, "succeeded", { outputSummary: "ok", metrics: { tokens: 3 } });
  assert.equal(done.status, "succeeded");
  assert.deepEqual(done.metrics, { model: "small", tokens: 3 });
  const cost = await acme.recordCost("run-typed", "tokens", 120, {
    amount: 0.1,
    currency: "usd",
    usage: { input_tokens: 100, output_tokens: 20 },
  });
  assert.equal(cost.amount, "0.1", "money is sent as numeric, read back as a decimal string");
  assert.equal(cost.currency, "USD");
  assert.deepEqual(cost.usage, { prompt_tokens: 100, completion_tokens: 20 });
  assert.ok((await acme.heartbeatRun("run-typed", 1, 60)) instanceof Date);

  const events = await acme.eventsSince("run-typed");
  assert.deepEqual(
    events.map((e) => [e.seq, e.eventType]),
    [
      [1, "run.created"],
      [2, "run.claimed"],
      [3, "run.status"],
      [4, "step.created"],
      [5, "step.status"],
      [6, "step.status"],
      [7, "cost.recorded"],
    ],
  );
  assert.equal(events[2]?.payload["to"], "running");
  assert.ok(events.every((e) => !e.endsRun));
  const rest = await acme.eventsSince("run-typed", events[3]?.eventId ?? null, 1);
  assert.deepEqual(
    rest.map((e) => e.seq),
    [5],
    "the cursor is exclusive, max_events a page",
  );

  await acme.transitionRun("run-typed", "succeeded", { runToken: 1 });
  const last = (await acme.eventsSince("run-typed")).at(-1);
  assert.equal(last?.endsRun, true);
  assert.equal((await acme.getRun("run-typed"))?.status, "succeeded");
  assert.equal(await db.ledger.scoped("acme", "other").getRun("run-typed"), null, "another workspace sees nothing");
});

test("bad input: a typed error with its SQLSTATE and code, and nothing written", async (t) => {
  const db = await freshDb(t, "errors");
  const acme = db.ledger.scoped("acme", "ts");
  const bad = await acme.createRun("agent", { runId: "has space" }).catch((e: unknown) => e);
  assert.ok(bad instanceof InvalidArgumentError);
  assert.ok(bad instanceof LedgerError);
  assert.equal(bad.sqlstate, "22023");
  assert.equal(bad.code, "ID_INVALID");
  assert.equal(bad.detail["code"], "ID_INVALID");
  assert.match(bad.message, /^ledger: /);
  assert.ok(bad.cause instanceof pg.DatabaseError, "the driver's error is kept as the cause");
  assert.deepEqual(await db.sql("SELECT count(*)::int AS n FROM ledger.runs"), [{ n: 0 }], "nothing written");

  await acme.createRun("agent", { runId: "r" });
  await assert.rejects(acme.transitionRun("missing", "running"), (e: unknown) => e instanceof NotFoundError && e.code === "RUN_NOT_FOUND");
  await assert.rejects(
    db.ledger.scoped("acme", "elsewhere").transitionRun("r", "running"),
    (e: unknown) => e instanceof NotFoundError && e.sqlstate === "P0002",
  );
  await acme.transitionRun("r", "running");
  await acme.transitionRun("r", "succeeded");
  await assert.rejects(
    acme.transitionRun("r", "failed"),
    (e: unknown) => e instanceof WrongStateError && e.code === "TRANSITION_INVALID" && e.detail["from"] === "succeeded",
  );
  await acme.createRun("agent", { runId: "r2" });
  await acme.claimToolCall("r2", "crm.lookup", { order: 1 }, { toolCallId: "c1" });
  await assert.rejects(
    acme.claimToolCall("r2", "crm.lookup", { order: 2 }, { toolCallId: "c1" }),
    (e: unknown) => e instanceof IdempotencyMismatchError && e.sqlstate === "23505" && e.code === "IDEMPOTENCY_MISMATCH",
  );
  await assert.rejects(
    acme.claimToolCalls("r2", [
      { toolRef: "a", toolCallId: "x" },
      { toolRef: "b", toolCallId: "x" },
    ]),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "CALLS_DUPLICATE" && e.detail["index"] === 1,
  );
  assert.deepEqual(
    await db.sql("SELECT count(*)::int AS n FROM ledger.run_step_tool_calls"),
    [{ n: 1 }],
    "the refused batch wrote nothing",
  );

  // No scope at all: the scope error, from SQL of your own through the escape hatch's pool.
  const client = await db.ledger.pool.connect();
  try {
    const err = await client.query("SELECT * FROM ledger.create_run('agent')").catch((e: unknown) => e);
    assert.ok(err instanceof pg.DatabaseError);
    const mapped = toLedgerError(err);
    assert.ok(mapped instanceof ScopeError && mapped.code === "SCOPE_MISSING");
  } finally {
    client.release();
  }
  // A writer in a read-only transaction (as on a hot standby).
  const readOnly = Ledger.connect(db.dsn, { options: "-c default_transaction_read_only=on" });
  t.after(() => readOnly.close());
  await assert.rejects(
    readOnly.scoped("acme", "ts").createRun("agent"),
    (e: unknown) => e instanceof ReadOnlyError && e.sqlstate === "25006" && e.code === "READ_ONLY",
  );
  // An error that is not the ledger's passes through as node-postgres raised it.
  const syntax = await acme.query("SELECT FROM nowhere_at_all").catch((e: unknown) => e);
  assert.ok(syntax instanceof pg.DatabaseError && !(syntax instanceof LedgerError));
  assert.equal(syntax.code, "42P01");
});

test("approval deadlines: a deadline asked and claimed; past it, no decision, the sweep or the claim expires it, the call is rejected", async (t) => {
  const db = await freshDb(t, "deadlines");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r" });
  const asked = await acme.requestToolApproval("r", "payments.wire", { amount: 100 }, { toolCallId: "c-wire", title: "Wire 100?", expiresInSeconds: 3600 });
  assert.equal(asked.outcome, "waiting_approval");
  const approval = asked.approval;
  assert.ok(approval?.expiresAt);
  assert.equal(approval.expiresAt.getTime() - approval.createdAt.getTime(), 3_600_000);
  // The claim's approval takes a deadline too.
  const claimed = await acme.claimToolCall("r", "payments.refund", { amount: 5 }, { toolCallId: "c-refund", approval: { title: "Refund 5?", expiresInSeconds: 60 } });
  assert.equal(claimed.outcome, "waiting_approval");
  assert.ok(claimed.approval?.expiresAt);
  assert.equal(claimed.approval.expiresAt.getTime() - claimed.approval.createdAt.getTime(), 60_000);
  assert.deepEqual(
    (await acme.pendingApprovals({ runId: "r" })).map((p) => [p.id, p.expiresAt?.getTime()]),
    [
      [approval.id, approval.expiresAt.getTime()],
      [claimed.approval.id, claimed.approval.expiresAt.getTime()],
    ],
  );
  await assert.rejects(
    acme.requestToolApproval("r", "payments.wire", { amount: 1 }, { toolCallId: "c-year", expiresInSeconds: 31_622_401 }),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "TIMEOUT_INVALID" && e.detail["expires_in_seconds"] === 31_622_401,
  );
  await assert.rejects(
    acme.claimToolCall("r", "payments.wire", { amount: 1 }, { toolCallId: "c-half", approval: { expiresInSeconds: 1.5 } }),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "APPROVAL_INVALID" && e.detail["key"] === "expires_in_seconds",
  );
  assert.equal(await acme.sweepToolCalls(), 0, "no deadline has passed");

  // No one decided the wire in time.
  await db.sql("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second' WHERE id = $1", [approval.id]);
  assert.deepEqual((await acme.pendingApprovals({ runId: "r" })).map((p) => p.id), [claimed.approval.id]);
  await assert.rejects(
    acme.resolveApproval(approval.id, "approved", { actor: "cfo@acme" }),
    (e: unknown) => e instanceof WrongStateError && e.sqlstate === "55000" && e.code === "APPROVAL_EXPIRED" && e.detail["approval_id"] === approval.id,
  );
  assert.equal(await acme.sweepToolCalls(), 1);
  await assert.rejects(acme.resolveApproval(approval.id, "rejected"), (e: unknown) => e instanceof WrongStateError && e.code === "APPROVAL_EXPIRED");
  const wire = await acme.claimToolCall("r", "payments.wire", { amount: 100 }, { toolCallId: "c-wire" });
  assert.equal(wire.outcome, "rejected");
  assert.deepEqual([wire.toolCall?.status, wire.toolCall?.errorCode], ["rejected", "TOOL_APPROVAL_EXPIRED"]);
  assert.deepEqual([wire.approval?.status, wire.approval?.actor], ["expired", null]);
  assert.ok(wire.approval?.decidedAt);
  const events = (await acme.eventsSince("r")).filter((e) => e.stepId === wire.toolCall?.stepId);
  assert.deepEqual(events.slice(-3).map((e) => e.eventType), ["step.status", "approval.expired", "tool_call.rejected"]);
  assert.deepEqual([events.at(-2)?.payload["approval_id"], events.at(-2)?.payload["tool_call_id"]], [approval.id, "c-wire"]);

  // Nor the refund, and no sweep ran: its next claim expires it and answers rejected.
  await db.sql("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second' WHERE id = $1", [claimed.approval.id]);
  const refund = await acme.claimToolCall("r", "payments.refund", { amount: 5 }, { toolCallId: "c-refund", approval: { title: "Refund 5?", expiresInSeconds: 60 } });
  assert.deepEqual([refund.outcome, refund.approval?.status], ["rejected", "expired"]);
  assert.equal(await acme.sweepToolCalls(), 0);
  assert.deepEqual(await acme.pendingApprovals(), []);
});

test("a stale run_token is the conflict error, and writes nothing", async (t) => {
  const db = await freshDb(t, "stale");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r" });
  const first = await acme.claimRun("w-1", { leaseSeconds: 30 });
  assert.ok(first);
  await acme.releaseRun("r", first.runToken);
  const second = await acme.claimRun("w-2");
  assert.equal(second?.runToken, first.runToken + 1);
  const stale = await acme.createStep("r", "llm", { stepKey: "s", runToken: first.runToken }).catch((e: unknown) => e);
  assert.ok(stale instanceof ConflictError);
  assert.equal(stale.sqlstate, "40001");
  assert.equal(stale.code, "LEASE_STALE");
  assert.equal(stale.detail["run_token"], first.runToken);
  assert.equal(stale.detail["current_run_token"], first.runToken + 1);
  assert.deepEqual(await db.sql("SELECT count(*)::int AS n FROM ledger.run_steps"), [{ n: 0 }]);
  await assert.rejects(acme.heartbeatRun("r", first.runToken), (e: unknown) => e instanceof ConflictError && e.code === "LEASE_STALE");
});

test("waitRun parks the owner's run until its wake time; the claim after it hands it out with a new token", async (t) => {
  const db = await freshDb(t, "wait");
  const acme = db.ledger.scoped("acme", "ts");
  assert.equal(await acme.nextWake(), null, "nothing waits");
  await acme.createRun("agent", { runId: "r-wait" });
  const first = await acme.claimRun("w-1", { runId: "r-wait" });
  assert.equal(first?.runToken, 1);
  await acme.transitionRun("r-wait", "running", { runToken: 1 });
  const wakeAt = new Date(Date.now() + 1000);
  const parked = await acme.waitRun("r-wait", 1, wakeAt);
  assert.equal(parked.status, "waiting_input");
  assert.equal(parked.leaseOwner, null);
  assert.equal(parked.runToken, 1);
  assert.equal(parked.notBefore?.getTime(), wakeAt.getTime());
  assert.equal(await acme.claimRun("w-2"), null, "not before its wake time");
  assert.equal(await acme.claimRun("w-2", { runId: "r-wait" }), null, "not even by its id");
  assert.equal((await acme.nextWake())?.getTime(), wakeAt.getTime(), "what an idle worker sleeps until");
  await assert.rejects(
    acme.heartbeatRun("r-wait", 1),
    (e: unknown) => e instanceof ConflictError && e.code === "LEASE_STALE" && e.detail["lease_released"] === true,
    "the lease was given up with the wait",
  );

  let woken = null;
  const deadline = Date.now() + 30_000; // only stops a hung test: the claim must come once wakeAt passed
  while ((woken = await acme.claimRun("w-2", { runId: "r-wait" })) === null) {
    assert.ok(Date.now() < deadline, "the run was not handed out after its wake time");
    await sleep(50);
  }
  assert.ok(Date.now() >= wakeAt.getTime());
  assert.equal(woken.runToken, 2);
  assert.equal(woken.status, "waiting_input");
  assert.equal(woken.takeover, false);
  // The parking owner's token is over.
  for (const stale of [() => acme.waitRun("r-wait", 1, wakeAt), () => acme.transitionRun("r-wait", "running", { runToken: 1 })]) {
    await assert.rejects(stale(), (e: unknown) => e instanceof ConflictError && e.code === "LEASE_STALE" && e.detail["current_run_token"] === 2);
  }
  assert.equal((await acme.transitionRun("r-wait", "running", { runToken: 2 })).status, "running");

  // In a transaction, and a wake time already past: claimable at once.
  const again = await acme.transaction((tx) => tx.waitRun("r-wait", 2, new Date(Date.now() - 60_000)));
  assert.equal(again.status, "waiting_input");
  const third = await acme.claimRun("w-3");
  assert.equal(third?.runId, "r-wait");
  assert.equal(third?.runToken, 3);

  // Only a preparing or running run waits (a claimed queued run does not); a null argument is
  // refused; neither writes anything.
  await acme.createRun("agent", { runId: "r-queued" });
  const queued = await acme.claimRun("w-4", { runId: "r-queued" });
  assert.equal(queued?.status, "queued");
  const events = await db.sql("SELECT count(*)::int AS n FROM ledger.run_events");
  const invalid = await acme.waitRun("r-queued", queued?.runToken ?? 0, wakeAt).catch((e: unknown) => e);
  assert.ok(invalid instanceof WrongStateError);
  assert.equal(invalid.sqlstate, "55000");
  assert.equal(invalid.code, "TRANSITION_INVALID");
  await assert.rejects(
    acme.waitRun("r-wait", 3, null as unknown as Date),
    (e: unknown) => e instanceof InvalidArgumentError && e.sqlstate === "22023" && e.code === "ARGUMENT_REQUIRED",
  );
  assert.deepEqual(await db.sql("SELECT count(*)::int AS n FROM ledger.run_events"), events);
  assert.equal((await acme.getRun("r-queued"))?.status, "queued");
});

test("the mailbox: sendInput is idempotent by key and payload; waitForInput answers, parks, and is woken; waitForChildren", async (t) => {
  const db = await freshDb(t, "mailbox");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-mail" });
  const form = { iban: "DE89370400440532013000", api_key: "sk-live-0123456789abcdefghij" };
  const sent = await acme.sendInput("r-mail", "form", form, { sender: "ana" });
  assert.deepEqual([sent.runId, sent.inputKey, sent.sender], ["r-mail", "form", "ana"]);
  assert.deepEqual(sent.payload, { iban: "DE89370400440532013000", api_key: "[REDACTED]" }, "as stored");
  assert.ok(sent.receivedAt instanceof Date && sent.waitedAt === null && sent.waitDeadline === null);
  const again = await acme.sendInput("r-mail", "form", { api_key: form.api_key, iban: form.iban }, { sender: "ana" });
  assert.deepEqual(again, sent, "the same input");
  await assert.rejects(
    acme.sendInput("r-mail", "form", { iban: "another" }),
    (e: unknown) => e instanceof IdempotencyMismatchError && e.sqlstate === "23505" && e.code === "IDEMPOTENCY_MISMATCH" && e.detail["input_key"] === "form",
  );
  await assert.rejects(
    acme.sendInput("r-mail", "ledger:child:r-x", {}),
    (e: unknown) => e instanceof InvalidArgumentError && e.sqlstate === "22023" && e.code === "INPUT_KEY_RESERVED",
  );
  assert.deepEqual((await acme.sendInput("r-mail", "ping")).payload, {}, "the SQL default");
  assert.equal((await acme.sendInput("r-mail", "note", "call me back")).payload, "call me back", "any JSON value");

  assert.equal((await acme.claimRun("w-1", { runId: "r-mail" }))?.runToken, 1);
  await acme.transitionRun("r-mail", "running", { runToken: 1 });
  assert.deepEqual(await acme.waitForInput("r-mail", 1, "form"), { status: "received", inputKey: "form", input: sent });
  assert.deepEqual(await acme.waitForInput("r-mail", 1, "missing", new Date(Date.now() - 60_000)), {
    status: "timed_out",
    inputKey: "missing",
    input: null,
  });
  const deadline = new Date(Date.now() + 3_600_000);
  const parked = await acme.waitForInput("r-mail", 1, "answer", deadline);
  assert.equal(parked.status, "waiting");
  assert.deepEqual([parked.input?.payload, parked.input?.receivedAt, parked.input?.waitDeadline], [null, null, deadline]);
  await assert.rejects(
    acme.heartbeatRun("r-mail", 1),
    (e: unknown) => e instanceof ConflictError && e.code === "LEASE_STALE" && e.detail["lease_released"] === true,
  );
  assert.equal(await acme.claimRun("w-2", { runId: "r-mail" }), null, "it waits");
  await acme.sendInput("r-mail", "answer", { refund: true }, { sender: "lead@acme" });
  const woken = await acme.claimRun("w-2", { runId: "r-mail" });
  assert.deepEqual([woken?.runToken, woken?.status], [2, "waiting_input"]);
  await acme.transitionRun("r-mail", "running", { runToken: 2 });
  const answer = await acme.waitForInput("r-mail", 2, "answer", deadline);
  assert.equal(answer.status, "received");
  assert.deepEqual([answer.input?.payload, answer.input?.sender, answer.input?.waitDeadline], [{ refund: true }, "lead@acme", deadline]);

  assert.deepEqual(await acme.waitForChildren("r-mail", 2), { status: "done", children: [] });
  await acme.createRun("agent", { runId: "r-kid", parentRunId: "r-mail" });
  const waiting = await acme.waitForChildren("r-mail", 2);
  assert.deepEqual(waiting, {
    status: "waiting",
    children: [{ runId: "r-kid", status: "queued", outputSummary: null, errorCode: null, errorMessage: null }],
  });
  await acme.transitionRun("r-kid", "running");
  await acme.transitionRun("r-kid", "failed", { errorCode: "CARRIER_DOWN", errorMessage: "no pickup" });
  assert.equal((await acme.claimRun("w-3", { runId: "r-mail" }))?.runToken, 3, "the last child's end woke it");
  await acme.transitionRun("r-mail", "running", { runToken: 3 });
  assert.deepEqual(await acme.waitForChildren("r-mail", 3), {
    status: "done",
    children: [{ runId: "r-kid", status: "failed", outputSummary: null, errorCode: "CARRIER_DOWN", errorMessage: "no pickup" }],
  });

  await acme.transitionRun("r-mail", "succeeded", { runToken: 3 });
  await assert.rejects(
    acme.sendInput("r-mail", "too-late", {}),
    (e: unknown) => e instanceof WrongStateError && e.sqlstate === "55000" && e.code === "RUN_TERMINAL",
  );
});

test("schedules: set, pause, fire (each missed firing once), drop; rate limits set and removed", async (t) => {
  const db = await freshDb(t, "schedules");
  const acme = db.ledger.scoped("acme", "ts");
  const weekday = await acme.setSchedule("weekday", "0 9 * * MON-FRI", "report", {
    inputs: { team: "support" },
    timeZone: "Europe/Berlin",
    actor: "ana",
  });
  assert.deepEqual(
    [weekday.id, weekday.cron, weekday.timeZone, weekday.mode, weekday.inputs, weekday.catchUp, weekday.paused, weekday.updatedBy],
    ["weekday", "0 9 * * MON-FRI", "Europe/Berlin", "report", { team: "support" }, "latest", false, "ana"],
  );
  assert.ok(weekday.nextFireAt !== null && weekday.nextFireAt.getTime() > Date.now());
  const local = new Intl.DateTimeFormat("en-GB", { timeZone: "Europe/Berlin", hour: "2-digit", minute: "2-digit" });
  assert.equal(local.format(weekday.nextFireAt), "09:00");
  assert.equal((await acme.pauseSchedule("weekday", { actor: "ana" })).paused, true);
  assert.equal((await acme.pauseSchedule("weekday", { paused: false })).paused, false);
  await assert.rejects(
    acme.pauseSchedule("no-such"),
    (e: unknown) => e instanceof NotFoundError && e.sqlstate === "P0002" && e.code === "SCHEDULE_NOT_FOUND",
  );
  await assert.rejects(
    acme.setSchedule("bad", "61 * * * *", "report"),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "CRON_INVALID",
  );

  const every = await acme.setSchedule("every-10", "*/10 * * * *", "report", {
    catchUp: "all",
    priority: 5,
    concurrencyKey: "reports",
    kind: "digest",
  });
  assert.deepEqual([every.catchUp, every.priority, every.concurrencyKey, every.kind], ["all", 5, "reports", "digest"]);
  assert.equal(await acme.fireSchedules(), 0, "nothing is due yet");
  // As if no sweeper had run for half an hour: three firings missed, each gets its run.
  await db.sql("UPDATE ledger.schedules SET next_fire_at = next_fire_at - interval '30 minutes' WHERE id = 'every-10'");
  assert.equal(await acme.fireSchedules(), 3);
  assert.equal(await acme.fireSchedules(), 0);
  const runs = await db.sql("SELECT mode, kind, priority, concurrency_key, status FROM ledger.runs WHERE request_id LIKE 'schedule:every-10:%'");
  assert.deepEqual(runs, Array(3).fill({ mode: "report", kind: "digest", priority: 5, concurrency_key: "reports", status: "queued" }));
  // Paused, a due firing is skipped.
  await acme.pauseSchedule("every-10");
  await db.sql("UPDATE ledger.schedules SET next_fire_at = now() - interval '1 minute' WHERE id = 'every-10'");
  assert.equal(await acme.fireSchedules(), 0);
  assert.equal(await acme.dropSchedule("every-10", { actor: "ana" }), true);
  assert.equal(await acme.dropSchedule("every-10"), false);

  assert.equal(await acme.setConcurrencyLimit("supplier-api", 4), 4);
  assert.equal(await acme.setRateLimit("supplier-api", 1, 3600), 1);
  assert.equal(await acme.setRateLimit("plan-free", 10), 10, "per minute, the SQL's default window");
  const limits = "SELECT concurrency_key, max_in_flight, max_per_window, window_seconds FROM ledger.concurrency_limits ORDER BY concurrency_key";
  assert.deepEqual(await db.sql(limits), [
    { concurrency_key: "plan-free", max_in_flight: null, max_per_window: 10, window_seconds: 60 },
    { concurrency_key: "supplier-api", max_in_flight: 4, max_per_window: 1, window_seconds: 3600 },
  ]);
  for (const n of [1, 2]) await acme.createRun("agent", { runId: `r-rate-${n}`, concurrencyKey: "supplier-api" });
  assert.notEqual(await acme.claimRun("w-1", { runId: "r-rate-1" }), null);
  assert.equal(await acme.claimRun("w-1", { runId: "r-rate-2" }), null, "one claim an hour, in flight or not");
  await assert.rejects(
    acme.setRateLimit("supplier-api", -1),
    (e: unknown) => e instanceof InvalidArgumentError && e.code === "LIMIT_INVALID" && e.detail["argument"] === "max_claims",
  );
  assert.equal(await acme.setRateLimit("supplier-api", null), null);
  assert.equal(await acme.setRateLimit("plan-free", null), null);
  // The key's concurrency limit stays; a key with only a rate is gone.
  assert.deepEqual(await db.sql(limits), [{ concurrency_key: "supplier-api", max_in_flight: 4, max_per_window: null, window_seconds: null }]);
});

test("the escape hatch: any SQL in the scoped transaction, rolled back as a whole on error", async (t) => {
  const db = await freshDb(t, "tx");
  const acme = db.ledger.scoped("acme", "ts");
  const scope = await acme.transaction(async (tx) => {
    await tx.createRun("agent", { runId: "a" });
    return tx.query("SELECT ledger.scope_tenant() AS t, ledger.scope_workspace() AS w, current_setting('ledger.tenant_id') AS g");
  });
  assert.deepEqual(scope, [{ t: "acme", w: "ts", g: "acme" }]);
  const err = await acme
    .transaction(async (tx) => {
      await tx.createRun("agent", { runId: "b" });
      await tx.transitionRun("a", "succeeded");
    })
    .catch((e: unknown) => e);
  assert.ok(err instanceof WrongStateError && err.code === "TRANSITION_INVALID");
  assert.equal(await acme.getRun("b"), null, "the first write was rolled back with the second");
  // The scope was transaction-local: the pooled connection carries none afterwards.
  const client = await db.ledger.pool.connect();
  try {
    const { rows } = await client.query("SELECT current_setting('ledger.tenant_id', true) AS t");
    assert.ok(rows[0].t === null || rows[0].t === "", `no scope left on the connection: ${String(rows[0].t)}`);
  } finally {
    client.release();
  }
});

test("connection strings: libpq conninfo and URLs", () => {
  assert.deepEqual(parseConninfo("host=/tmp/x port=28915 user=postgres dbname=ledger_demo"), {
    host: "/tmp/x",
    port: 28915,
    user: "postgres",
    database: "ledger_demo",
  });
  assert.deepEqual(parseConninfo("host='/tmp/a b' password='it\\'s' connect_timeout=3"), {
    host: "/tmp/a b",
    password: "it's",
    connectionTimeoutMillis: 3000,
  });
  assert.deepEqual(parseConninfo("postgresql://u@h:5/db"), { connectionString: "postgresql://u@h:5/db" });
  assert.throws(() => parseConninfo("sslmode=require"), /sslmode/);
  assert.throws(() => parseConninfo("host=x 'oops"), /cannot read/);
});

test("nextWake across scopes is an operator's: another scope's backoff; a non-operator is refused", async (t) => {
  const db = await freshDb(t, "next_wake");
  const later = new Date(Date.now() + 3_600_000);
  await db.ledger.scoped("globex", "billing").createRun("agent", { runId: "r-later", notBefore: later });
  assert.equal(await db.ledger.scoped("acme", "ts").nextWake(), null, "none in this scope");
  assert.equal((await db.ledger.nextWake())?.getTime(), later.getTime());
  assert.equal((await db.ledger.scoped("acme", "ts").nextWake({ anyScope: true }))?.getTime(), later.getTime());
  await db.sql("DO $$ BEGIN CREATE ROLE ledger_ts_waker LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$");
  await db.sql("GRANT ledger_writer TO ledger_ts_waker");
  const app = Ledger.connect(`${db.dsn} user=ledger_ts_waker`);
  try {
    await assert.rejects(app.nextWake(), (e: unknown) => e instanceof ScopeError && e.sqlstate === "42501" && e.code === "OPERATOR_REQUIRED");
  } finally {
    await app.close();
    await db.sql("DROP ROLE ledger_ts_waker");
  }
});

test("inbox: the scope's counts and oldest times; across scopes an operator's list; a non-operator is refused", async (t) => {
  const db = await freshDb(t, "inbox");
  const acme = db.ledger.scoped("acme", "ts");
  const at = (hours: number): Date => new Date(Date.UTC(2026, 0, 1, hours));
  assert.deepEqual(await db.ledger.scoped("acme", "quiet").inbox(), {
    tenantId: "acme", workspaceId: "quiet", callsInDoubt: 0, oldestInDoubtAt: null, pendingApprovals: 0,
    oldestApprovalAt: null, budgetStops: 0, oldestBudgetStopAt: null, failedOutboxEvents: 0, oldestFailedOutboxEventAt: null,
  });
  // In acme/ts two calls in doubt, an approval and a run stopped by a budget used up; in globex/billing a failed event.
  await acme.createRun("agent", { runId: "r-1" });
  for (const [hours, call] of [[1, "c-1"], [2, "c-2"]] as const) {
    await acme.claimToolCall("r-1", "crm.lookup", { n: hours }, { toolCallId: call });
    await db.sql("UPDATE ledger.run_step_tool_calls SET status = 'in_doubt', updated_at = $1 WHERE tool_call_id = $2", [at(hours), call]);
  }
  await acme.requestToolApproval("r-1", "payments.wire", {}, { toolCallId: "pay" });
  await db.sql("UPDATE ledger.approval_requests SET created_at = $1", [at(3)]);
  await acme.createRun("agent", { runId: "r-2" });
  await acme.setBudget("tool_calls", 0, { level: "run", runId: "r-2" });
  await db.sql("UPDATE ledger.runs SET status = 'paused', error_code = 'BUDGET_EXHAUSTED', updated_at = $1 WHERE id = 'r-2'", [at(4)]);
  await db.ledger.scoped("globex", "billing").createRun("agent", { runId: "r-3" });
  await db.sql("UPDATE ledger.outbox SET status = 'failed', processed_at = $1 WHERE run_id = 'r-3'", [at(0)]);
  const here = {
    tenantId: "acme", workspaceId: "ts", callsInDoubt: 2, oldestInDoubtAt: at(1), pendingApprovals: 1,
    oldestApprovalAt: at(3), budgetStops: 1, oldestBudgetStopAt: at(4), failedOutboxEvents: 0, oldestFailedOutboxEventAt: null,
  };
  const there = {
    tenantId: "globex", workspaceId: "billing", callsInDoubt: 0, oldestInDoubtAt: null, pendingApprovals: 0,
    oldestApprovalAt: null, budgetStops: 0, oldestBudgetStopAt: null, failedOutboxEvents: 1, oldestFailedOutboxEventAt: at(0),
  };
  assert.deepEqual(await acme.inbox(), here);
  assert.deepEqual(await acme.transaction((tx) => tx.inbox()), here);
  assert.deepEqual(await db.ledger.inbox(), [here, there], "only the scopes with something waiting");
  assert.deepEqual(await acme.inbox({ anyScope: true }), [here, there]);
  await db.sql("DO $$ BEGIN CREATE ROLE ledger_ts_inbox LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$");
  await db.sql("GRANT ledger_writer TO ledger_ts_inbox");
  const app = Ledger.connect(`${db.dsn} user=ledger_ts_inbox`);
  try {
    await assert.rejects(app.inbox(), (e: unknown) => e instanceof ScopeError && e.sqlstate === "42501" && e.code === "OPERATOR_REQUIRED");
  } finally {
    await app.close();
    await db.sql("DROP ROLE ledger_ts_inbox");
  }
});

test("a run waiting for an input without a deadline: its notBefore 'infinity' is the latest Date, also after it ended", async (t) => {
  const db = await freshDb(t, "infinity");
  const acme = db.ledger.scoped("acme", "ts");
  const latest = new Date(8.64e15);
  await acme.createRun("agent", { runId: "r-open" });
  await acme.claimRun("w-1", { runId: "r-open" });
  await acme.transitionRun("r-open", "running", { runToken: 1 });
  assert.equal((await acme.waitForInput("r-open", 1, "answer")).status, "waiting");
  assert.deepEqual(await db.sql("SELECT not_before::text AS t FROM ledger.runs"), [{ t: "infinity" }]);
  const waiting = await acme.getRun("r-open");
  assert.equal(waiting?.status, "waiting_input");
  assert.ok(waiting?.notBefore instanceof Date);
  assert.equal(waiting.notBefore.getTime(), latest.getTime());
  assert.ok(waiting.notBefore > new Date(), "it compares as later than any time");
  assert.deepEqual((await acme.transitionRun("r-open", "canceled")).notBefore, latest);
  await db.sql("UPDATE ledger.runs SET not_before = '-infinity'");
  assert.equal((await acme.getRun("r-open"))?.notBefore?.getTime(), -8.64e15);
});
