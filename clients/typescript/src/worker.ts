/**
 * The worker loop over `claim_run`, and the run context an agent is written against.
 *
 * A worker holds no state of its own: it claims a run, drives it with your agent from what the
 * ledger holds, and lets it go when it needs a person. An agent is written as if it ran from the
 * start every time: its steps are found again by key (a finished one returns its recorded output)
 * and its tool calls by `tool_call_id` (a finished one replays its result), so a worker that takes
 * a run over after a crash redoes nothing.
 *
 * Per run: to `running` if needed; heartbeats of the run's lease while the agent runs; then
 * - the agent returns: its reply is recorded as a `message` response event and the run succeeds,
 *   in one transaction;
 * - a call is in doubt or waits for approval: the run is parked (`paused` or `waiting_approval`)
 *   and released; a person's decision makes it claimable again;
 * - a budget is used up (a tool call or an `llm` step refused: the ledger paused the run with
 *   `error_code` `BUDGET_EXHAUSTED`): the run stays `paused` and is released; it is claimable
 *   again once a person raises the budget;
 * - the agent waits until a time (`ctx.waitUntil`, a {@link WaitingUntilError}): the run is parked
 *   with `wait_run`, which gives the lease up itself (nothing is released after it); a claim from
 *   the wake time on resumes it (`waiting_input` to `running`);
 * - the agent waits for an input or for its children (`ctx.waitForInput`, `ctx.waitForChildren`: a
 *   {@link WaitingForInputError} or {@link WaitingForChildrenError}): the wait parked the run in
 *   the agent's call, its lease given up; nothing more is written; the input, the last child's end
 *   or the deadline makes it claimable again;
 * - a call is busy (another executor's live attempt): the run is released, to be claimed later;
 * - the run was taken over (40001 `LEASE_STALE`): it is dropped, the new owner has it;
 * - a rejected approval: the run fails with `error_code` `TOOL_APPROVAL_REJECTED` (one that expired
 *   before anyone decided it: `TOOL_APPROVAL_EXPIRED`);
 * - a lost database connection: never the agent's failure; the run is released for a retry;
 * - anything else: the run fails with the error's message.
 *
 * The worker's own writes and the context's (steps, tool calls) are repeated on a fresh
 * connection after a lost one (see `reconnecting`): each is fenced by the run token or the call's
 * attempt, or found again by key, so a repeat changes nothing.
 *
 * When nothing is claimable the loop sleeps until the first of: a `ledger_runs` notification (a
 * commit that may have made a run claimable: a new run, a release, an input, a decision, a run's
 * end), `next_wake` (when a wait, a backoff, an approval's deadline or a full rate window ends, by
 * the database's clock), `idleSeconds` (the backstop for what neither tells: a lease that ran out, a
 * budget's new day or month), a stop. It LISTENs on a connection of its own (not the pool's: it
 * holds it while it runs), before its claim, so that no commit between an empty claim and the sleep
 * is missed; after a lost connection it listens again on a new one, and while it cannot it polls
 * every `min(idleSeconds, 1)` seconds. A notification is a hint: the next claim decides.
 *
 * With `fireSchedulesSeconds` the loop also fires the due schedules (`fire_schedules`, of its scope
 * or of every scope) at most that often, before a claim: for a deployment without pg_cron.
 *
 * A stop (the signal, or SIGTERM/SIGINT when `stopOn` names them) ends the claims; the run in
 * hand may finish within `shutdownGraceSeconds`, after which it is released for another worker.
 */
import { hostname } from "node:os";
import { setTimeout as sleep } from "node:timers/promises";

import {
  BudgetExhaustedError,
  BusyError,
  ConflictError,
  EXPIRED_ERROR_CODE,
  InDoubtError,
  REJECTED_ERROR_CODE,
  RejectedError,
  WaitingApprovalError,
} from "./errors.js";
import { isConnectionError, reconnecting } from "./faults.js";
import { Ledger, Transaction, type ApprovalRequest, type ScopedLedger } from "./client.js";
import { Listener } from "./notifier.js";
import { positiveSeconds } from "./options.js";
import { succeedWith } from "./reply.js";
import { toolCall, toolCalls, type ToolCallResult, type ToolFn, type TurnCall } from "./tool_calls.js";
import { parseChildRun, parseClaim, TERMINAL_STATUSES, type ChildRun, type ClaimedRun, type Step } from "./types.js";

type Json = { [key: string]: unknown };

/** A model's token usage, as the OpenAI or Anthropic SDKs return it (or the ledger's own keys). */
export type Usage = { [key: string]: unknown };

/** What a model step returns to {@link RunContext.llmStep}. */
export interface ModelReply {
  /** The reply's text: stored as the step's output, returned again on a resume. */
  text: string;
  usage: Usage;
  /** What the call cost, as a decimal string where you can. */
  amount?: string | number;
  currency?: string;
  provider?: string;
  modelRef?: string;
}

/** Options of one tool call made from a run context. */
export interface RunToolCallOptions {
  timeoutSeconds?: number;
  /** The key to find the call by, instead of `tool:<run_id>:<tool_call_id>` (a re-run passes its source's: replayed). */
  idempotencyKey?: string;
  /** A call that needs a person's approval: asked for on the first run, claimed once approved. */
  approval?: ApprovalRequest;
  retryFailed?: boolean;
  heartbeatSeconds?: number;
  /** The tool is safe to repeat: looked up, run, and recorded once in one commit ({@link toolCall}). */
  repeatable?: boolean;
}

/** When a wait of {@link RunContext} ends at the latest: one of the two, or neither (no deadline). */
export interface WaitOptions {
  /** The deadline. */
  deadline?: Date;
  /** The deadline, this many seconds from the first call. */
  timeoutSeconds?: number;
}

/** What an agent gets: the claimed run and helpers fenced by its token. */
export class RunContext {
  constructor(
    /** The run's scope. */
    readonly ledger: ScopedLedger,
    /** The claimed run: inputs, token, and what the ledger knows of its steps and calls. */
    readonly run: ClaimedRun,
    /** Aborts when the worker loses the run (taken over) or stops hard. */
    readonly signal: AbortSignal,
  ) {}

  get runId(): string {
    return this.run.runId;
  }

  get inputs(): Json {
    const inputs = this.run.inputs;
    return typeof inputs === "object" && inputs !== null ? (inputs as Json) : {};
  }

  /**
   * One step found again by `key`: if it already succeeded its recorded output is returned and
   * `fn` does not run; else the step runs `fn` and records its output (or its failure).
   */
  async step(key: string, stepType: string, fn: () => Promise<string>): Promise<string> {
    const step = await this.openStep(key, stepType);
    if (step.status === "succeeded") return step.outputSummary ?? "";
    const output = await this.guard(step, fn);
    await reconnecting(() => this.ledger.transitionStep(step.id, "succeeded", { outputSummary: output, runToken: this.run.runToken }));
    return output;
  }

  /**
   * One model call as an `llm` step found again by `key`: done once, its reply read back after (a
   * call that a crash interrupted before its success was recorded is made again). Its cost
   * (tokens, and `amount` when given) is recorded with the step's success, in one transaction,
   * keyed on the step so it is never billed twice.
   */
  async llmStep(key: string, callModel: () => Promise<ModelReply>): Promise<string> {
    const step = await this.openStep(key, "llm");
    if (step.status === "succeeded") return step.outputSummary ?? "";
    const reply = await this.guard(step, callModel);
    // Repeated after a lost connection: the cost is keyed on the step, the step's move fenced.
    await reconnecting(() => this.ledger.transaction(async (tx) => {
      await tx.recordCost(this.runId, "tokens", tokens(reply.usage), {
        stepId: step.id,
        usage: reply.usage,
        sourceRef: step.id,
        ...(reply.amount !== undefined ? { amount: reply.amount } : {}),
        ...(reply.currency !== undefined ? { currency: reply.currency } : {}),
        ...(reply.provider !== undefined ? { provider: reply.provider } : {}),
        ...(reply.modelRef !== undefined ? { modelRef: reply.modelRef } : {}),
      });
      await tx.transitionStep(step.id, "succeeded", { outputSummary: reply.text, runToken: this.run.runToken });
    }));
    return reply.text;
  }

  /** One tool call through the executor protocol ({@link toolCall}), keyed by `toolCallId`. */
  async toolCall<A extends Json, R>(
    toolCallId: string,
    toolRef: string,
    args: A,
    execute: ToolFn<A, R>,
    options: RunToolCallOptions = {},
  ): Promise<R> {
    return toolCall(this.ledger, {
      runId: this.runId,
      toolRef,
      arguments: args,
      execute,
      toolCallId,
      leaseOwner: this.run.leaseOwner,
      runToken: this.run.runToken,
      signal: this.signal,
      ...options,
    });
  }

  /** The calls of one model turn, claimed and begun together, run concurrently ({@link toolCalls}). */
  async toolCalls(calls: TurnCall[], options: { heartbeatSeconds?: number } = {}): Promise<ToolCallResult[]> {
    return toolCalls(this.ledger, this.runId, calls, {
      leaseOwner: this.run.leaseOwner,
      runToken: this.run.runToken,
      signal: this.signal,
      ...options,
    });
  }

  /**
   * A durable wait found again by `key`: a `wait` step records the first `wakeAt`. Before that
   * time (by the database's clock) it throws {@link WaitingUntilError}, which ends the agent's
   * turn: the worker parks the run with `wait_run`, and a claim from then on runs the agent again.
   * From that time on the step succeeds and the recorded wake time is returned, so a resume that
   * computes another `wakeAt` (an hour from now, again) does not wait again.
   */
  async waitUntil(key: string, wakeAt: Date): Promise<Date> {
    const runToken = this.run.runToken;
    const step = await reconnecting(() =>
      this.ledger.createStep(this.runId, "wait", { stepKey: key, inputSummary: wakeAt.toISOString(), status: "waiting_input", runToken }),
    );
    const wake = step.inputSummary ? new Date(step.inputSummary) : wakeAt;
    if (step.status === "succeeded") return wake;
    // The database's clock, which claim_run's not_before follows: a worker whose clock is behind
    // must not put a run that woke back to sleep.
    const [due] = await reconnecting(() => this.ledger.query("SELECT now() >= $1::timestamptz AS due", [wake]));
    if (due?.["due"] !== true) throw new WaitingUntilError(key, wake);
    await this.endWait(step, { outputSummary: wake.toISOString() });
    return wake;
  }

  /**
   * A durable wait for the input `inputKey` (`send_input`), found again by `key`: a `wait` step
   * records the first call's deadline (`deadline`, or `timeoutSeconds` from now; neither: none), so
   * a resume does not move it. Resolves to the input's payload (as stored: redacted) once it was
   * sent, on every later resume too. Until then the wait parks the run (`wait_for_input`: its lease
   * given up) and throws {@link WaitingForInputError}, which ends the agent's turn: the input, or
   * the deadline, makes the run claimable and the agent runs again. Past the deadline without it
   * the step expires and {@link InputTimedOutError} is thrown, on every later resume too.
   */
  async waitForInput(key: string, inputKey: string, options: WaitOptions = {}): Promise<unknown> {
    const step = await this.beginWait(key, options);
    const until = deadlineOf(step);
    if (step.status === "expired") throw new InputTimedOutError(key, inputKey, until);
    const answer = await park(() => this.ledger.waitForInput(this.runId, this.run.runToken, inputKey, until ?? undefined));
    if (answer.status === "waiting") throw new WaitingForInputError(key, inputKey, until);
    if (answer.status === "timed_out") {
      await reconnecting(() => this.ledger.transitionStep(step.id, "expired", { runToken: this.run.runToken }));
      throw new InputTimedOutError(key, inputKey, until);
    }
    // A resume reads the payload again from the mailbox.
    if (step.status !== "succeeded") await this.endWait(step, { outputSummary: answer.input.id });
    return answer.input.payload;
  }

  /**
   * A durable wait for the run's children (runs created with `parentRunId` = `ctx.runId`), found
   * again by `key`, its deadline recorded as {@link waitForInput} records it. Resolves to each
   * child's outcome (oldest first) once every one has ended; the step keeps them (its `metrics`),
   * so a resume gets the same ones. Until then the wait parks the run and throws
   * {@link WaitingForChildrenError}: the last child's end, or the deadline, makes the run claimable
   * again. Past the deadline first: {@link ChildrenTimedOutError}, with the children as they stood.
   */
  async waitForChildren(key: string, options: WaitOptions = {}): Promise<ChildRun[]> {
    const step = await this.beginWait(key, options);
    const until = deadlineOf(step);
    if (step.status === "succeeded" || step.status === "expired") {
      const kept = Array.isArray(step.metrics["children"]) ? (step.metrics["children"] as Json[]).map(parseChildRun) : [];
      if (step.status === "expired") throw new ChildrenTimedOutError(key, until, kept);
      return kept;
    }
    const answer = await park(() => this.ledger.waitForChildren(this.runId, this.run.runToken, until ?? undefined));
    if (answer.status === "waiting") throw new WaitingForChildrenError(key, until, answer.children);
    const metrics = {
      children: answer.children.map((c) => ({
        run_id: c.runId,
        status: c.status,
        output_summary: c.outputSummary,
        error_code: c.errorCode,
        error_message: c.errorMessage,
      })),
    };
    if (answer.status === "timed_out") {
      await reconnecting(() => this.ledger.transitionStep(step.id, "expired", { metrics, runToken: this.run.runToken }));
      throw new ChildrenTimedOutError(key, until, answer.children);
    }
    await this.endWait(step, { outputSummary: `${answer.children.length} children ended`, metrics });
    return answer.children;
  }

  /** The `wait` step of `key`, created `waiting_input` with the deadline as its input summary (a resume finds the first call's). */
  private async beginWait(key: string, options: WaitOptions): Promise<Step> {
    const { deadline, timeoutSeconds } = options;
    if (deadline !== undefined && timeoutSeconds !== undefined) throw new TypeError(`wait ${key}: a deadline or a timeout, not both`);
    positiveSeconds("timeoutSeconds", timeoutSeconds);
    const until = timeoutSeconds !== undefined ? new Date(Date.now() + timeoutSeconds * 1000) : deadline;
    const runToken = this.run.runToken;
    return reconnecting(() =>
      this.ledger.createStep(this.runId, "wait", {
        stepKey: key,
        status: "waiting_input",
        runToken,
        ...(until !== undefined ? { inputSummary: until.toISOString() } : {}),
      }),
    );
  }

  /** A wait step's success (`waiting_input` cannot go to `succeeded` directly). */
  private async endWait(step: Step, fields: { outputSummary: string; metrics?: Json }): Promise<void> {
    const runToken = this.run.runToken;
    if (step.status !== "running") await reconnecting(() => this.ledger.transitionStep(step.id, "running", { runToken }));
    await reconnecting(() => this.ledger.transitionStep(step.id, "succeeded", { ...fields, runToken }));
  }

  /** The step of `key`; {@link BudgetExhaustedError} when the ledger refused it (an `llm` step over a budget). */
  private async openStep(key: string, stepType: string): Promise<Step> {
    const step = await reconnecting(() => this.ledger.createStep(this.runId, stepType, { stepKey: key, runToken: this.run.runToken }));
    if (step.errorCode === "BUDGET_EXHAUSTED") {
      // Created (or found) paused: its work must not run. The refusal as a claim would answer it.
      throw new BudgetExhaustedError(parseClaim({ outcome: "budget_exhausted", budget: step.errorDetails }), `step ${key}`);
    }
    return step;
  }

  /** Runs `fn` as the step's work: the step is `running` meanwhile and `failed` if `fn` throws. */
  private async guard<T>(step: Step, fn: () => Promise<T>): Promise<T> {
    const token = this.run.runToken;
    if (step.status !== "running") await reconnecting(() => this.ledger.transitionStep(step.id, "running", { runToken: token }));
    try {
      return await fn();
    } catch (error) {
      // A lost connection is not the step's failure: the step stays running, the run is released.
      if (!isConnectionError(error)) {
        const errorMessage = error instanceof Error ? error.message : String(error);
        await reconnecting(() => this.ledger.transitionStep(step.id, "failed", { errorMessage, runToken: token }));
      }
      throw error;
    }
  }
}

/**
 * Thrown by {@link RunContext.waitUntil} before the wake time: let it escape the agent, and the
 * worker parks the run (`wait_run`) until `wakeAt`.
 */
export class WaitingUntilError extends Error {
  constructor(
    readonly stepKey: string,
    readonly wakeAt: Date,
  ) {
    super(`step ${stepKey}: waiting until ${wakeAt.toISOString()}`);
    this.name = new.target.name;
  }
}

/**
 * A wait's call of the ledger, repeated after a lost connection. A try whose commit was lost with
 * its answer may have parked the run: the repeat is then `LEASE_STALE`, and the worker writes
 * nothing more, as for a parked run.
 */
function park<T>(ask: () => Promise<T>): Promise<T> {
  return reconnecting(ask);
}

/** The deadline a wait step recorded. */
function deadlineOf(step: Step): Date | null {
  return step.inputSummary ? new Date(step.inputSummary) : null;
}

const untilText = (deadline: Date | null): string => (deadline ? ` until ${deadline.toISOString()}` : "");

/**
 * Thrown by {@link RunContext.waitForInput} while the input has not come: the run is parked
 * already (its lease given up); let it escape the agent, and the worker writes nothing more for it.
 */
export class WaitingForInputError extends Error {
  constructor(
    readonly stepKey: string,
    readonly inputKey: string,
    readonly deadline: Date | null,
  ) {
    super(`step ${stepKey}: waiting for input ${inputKey}${untilText(deadline)}`);
    this.name = new.target.name;
  }
}

/**
 * Thrown by {@link RunContext.waitForInput} when its deadline passed without the input: the agent
 * decides (another wait under another key, an answer without it); escaping the agent, it fails the run.
 */
export class InputTimedOutError extends Error {
  constructor(
    readonly stepKey: string,
    readonly inputKey: string,
    readonly deadline: Date | null,
  ) {
    super(`step ${stepKey}: no input ${inputKey} by ${deadline?.toISOString() ?? "?"}`);
    this.name = new.target.name;
  }
}

const running = (children: ChildRun[]): number => children.filter((c) => !TERMINAL_STATUSES.includes(c.status)).length;

/** Thrown by {@link RunContext.waitForChildren} while a child runs: the run is parked already; let it escape the agent. */
export class WaitingForChildrenError extends Error {
  constructor(
    readonly stepKey: string,
    readonly deadline: Date | null,
    /** How they stood. */
    readonly children: ChildRun[],
  ) {
    super(`step ${stepKey}: waiting for ${running(children)} of ${children.length} children${untilText(deadline)}`);
    this.name = new.target.name;
  }
}

/**
 * Thrown by {@link RunContext.waitForChildren} when its deadline passed before every child ended;
 * `children` says how each stood (the agent may cancel the rest, or wait again under another key).
 */
export class ChildrenTimedOutError extends Error {
  constructor(
    readonly stepKey: string,
    readonly deadline: Date | null,
    readonly children: ChildRun[],
  ) {
    super(`step ${stepKey}: ${running(children)} of ${children.length} children still running at the deadline`);
    this.name = new.target.name;
  }
}

/** Billed tokens of a usage object: its total, else input + output (either naming). */
function tokens(usage: Usage): number {
  const n = (key: string): number => (typeof usage[key] === "number" ? (usage[key] as number) : 0);
  if (typeof usage["total_tokens"] === "number") return usage["total_tokens"];
  return n("input_tokens") + n("prompt_tokens") + n("output_tokens") + n("completion_tokens");
}

/** An agent: your code, written as if it ran from the start every time. Returns the reply shown to the user. */
export type Agent = (ctx: RunContext) => Promise<string>;

/** Options of {@link work}. */
export interface WorkerOptions {
  /** Who holds the runs' leases; default `<hostname>:<pid>`. */
  leaseOwner?: string;
  /**
   * The run lease in seconds; default 15. A worker killed while it holds a run costs at most this
   * (plus another worker's `idleSeconds`) before the run is taken over.
   */
  leaseSeconds?: number;
  /** Seconds between the run lease's heartbeats; default a third of `leaseSeconds` (5). */
  heartbeatSeconds?: number;
  /**
   * The longest sleep, in seconds, when nothing is claimable: a `ledger_runs` notification or
   * `next_wake` ends it sooner. Default {@link DEFAULT_IDLE_SECONDS} (30). After a run was only
   * released or an error, the loop claims again after `min(idleSeconds, 1)`.
   */
  idleSeconds?: number;
  /** Only runs of these modes / kinds. */
  modes?: string[];
  kinds?: string[];
  /** Stops the loop: no new claim; the run in hand may finish within `shutdownGraceSeconds`. */
  signal?: AbortSignal;
  /**
   * Process signals that stop the loop the same way (a second one acts as usual), e.g.
   * `["SIGTERM", "SIGINT"]`; default none (as Python's `handle_signals=False`): opt in.
   */
  stopOn?: NodeJS.Signals[];
  /**
   * After a stop, how long the run in hand may take to finish; then it is released for another
   * worker (its token is over) and the agent's signal aborts. Default 30.
   */
  shutdownGraceSeconds?: number;
  /**
   * Fire the due schedules (`fire_schedules`, of the scope, or of every scope for a `Ledger`) at
   * most this often, before a claim; default never (pg_cron's job).
   */
  fireSchedulesSeconds?: number;
  /** Called with what happened to each run (for logs). */
  onRun?: (run: ClaimedRun, outcome: RunOutcome) => void;
  /**
   * Called with an error that is not a run's (the server unreachable, a write that failed after
   * the agent's end, the listening connection lost); the loop goes on after `min(idleSeconds, 1)`.
   * Default: written to stderr.
   */
  onError?: (error: unknown) => void;
}

/** What the worker did with a claimed run. */
export type RunOutcome =
  | { status: "succeeded"; reply: string }
  | { status: "paused" | "waiting_approval"; reason: string }
  | { status: "waiting_input"; wakeAt: Date | null; reason: string }
  | { status: "released"; reason: string }
  | { status: "lost"; reason: string }
  | { status: "failed"; error: string };

/**
 * The worker loop: claims runs one at a time, of one scope (a {@link ScopedLedger}) or of every
 * scope (a {@link Ledger}: `any_scope`, for a member of `ledger_operator`; each run is driven in its
 * own scope), and drives each with `agent` until the signal (or a process signal) stops it.
 * Resolves once the loop has stopped.
 */
export async function work(source: Ledger | ScopedLedger, agent: Agent, options: WorkerOptions = {}): Promise<void> {
  positiveSeconds("heartbeatSeconds", options.heartbeatSeconds);
  const fireEvery = positiveSeconds("fireSchedulesSeconds", options.fireSchedulesSeconds);
  let nextFire = 0;
  const leaseOwner = options.leaseOwner ?? `${hostname()}:${process.pid}`;
  const idleMs = (options.idleSeconds ?? DEFAULT_IDLE_SECONDS) * 1000;
  // After a release (a BusyError, a lost connection) or an error, what was in the way is usually
  // gone within seconds and nothing notifies it (a release's own notification would only hand the
  // run straight back): claim again soon, whatever the idle bound.
  const retryMs = Math.min(idleMs, 1000);
  const onError = options.onError ?? ((e: unknown) => console.error("ledger worker:", e));
  const alarm = new Alarm(source, onError);
  const stop = new AbortController();
  const stopOn = options.stopOn ?? [];
  const onSignal = (): void => {
    for (const s of stopOn) process.removeListener(s, onSignal);
    stop.abort();
  };
  const onAbort = (): void => stop.abort();
  options.signal?.addEventListener("abort", onAbort, { once: true });
  if (options.signal?.aborted) stop.abort();
  for (const s of stopOn) process.on(s, onSignal);
  try {
    while (!stop.signal.aborted) {
      let next: "claim" | "idle" | "retry" = "retry";
      await alarm.listen();
      try {
        if (fireEvery !== undefined && Date.now() >= nextFire) {
          nextFire = Date.now() + fireEvery * 1000;
          await source.fireSchedules();
        }
        const run = await source.claimRun(leaseOwner, {
          leaseSeconds: options.leaseSeconds ?? DEFAULT_LEASE_SECONDS,
          ...(options.modes !== undefined ? { modes: options.modes } : {}),
          ...(options.kinds !== undefined ? { kinds: options.kinds } : {}),
        });
        if (run === null) {
          next = "idle";
        } else {
          const ledger = source instanceof Ledger ? source.scoped(run.tenantId, run.workspaceId) : source;
          next = (await drive(ledger, run, agent, options, stop.signal)) ? "claim" : "retry";
        }
      } catch (error) {
        onError(error);
      }
      if (next === "idle") {
        await alarm.wait(fireEvery === undefined ? idleMs : Math.min(idleMs, nextFire - Date.now()), retryMs, stop.signal);
      } else if (next === "retry") {
        await sleep(retryMs, undefined, { signal: stop.signal }).catch(() => undefined);
      }
    }
  } finally {
    await alarm.close();
    options.signal?.removeEventListener("abort", onAbort);
    for (const s of stopOn) process.removeListener(s, onSignal);
  }
}

function isLeaseStale(error: unknown): boolean {
  return error instanceof ConflictError && error.code === "LEASE_STALE";
}

/** Drives one claimed run; returns false when it was only released (nothing was done). */
async function drive(ledger: ScopedLedger, run: ClaimedRun, agent: Agent, options: WorkerOptions, stopping: AbortSignal): Promise<boolean> {
  const token = run.runToken;
  const lost = new AbortController();
  let beating = Promise.resolve();
  const heartbeat = setInterval(
    () => {
      beating = beating.then(async () => {
        try {
          await ledger.heartbeatRun(run.runId, token);
        } catch (error) {
          // Taken over: stop the agent. A dropped connection is retried at the next beat.
          if (error instanceof ConflictError) lost.abort(error);
        }
      });
    },
    (options.heartbeatSeconds ?? (options.leaseSeconds ?? DEFAULT_LEASE_SECONDS) / 3) * 1000,
  );
  let grace: NodeJS.Timeout | undefined;
  let arm = (): void => undefined;
  const settle = async (): Promise<void> => {
    clearInterval(heartbeat);
    clearTimeout(grace);
    stopping.removeEventListener("abort", arm);
    await beating;
  };
  const report = (outcome: RunOutcome): boolean => {
    options.onRun?.(run, outcome);
    return outcome.status !== "released";
  };
  try {
    if (run.status !== "running") await reconnecting(() => ledger.transitionRun(run.runId, "running", { runToken: token }));
    const finished = agent(new RunContext(ledger, run, lost.signal)).then(
      (reply) => ({ reply }),
      (error: unknown) => ({ error }),
    );
    const deadline = new Promise<"deadline">((resolve) => {
      arm = () => {
        grace = setTimeout(() => resolve("deadline"), (options.shutdownGraceSeconds ?? 30) * 1000);
      };
      if (stopping.aborted) arm();
      else stopping.addEventListener("abort", arm, { once: true });
    });
    const ended = await Promise.race([finished, deadline]);
    await settle();
    if (ended === "deadline") {
      // The agent goes on alone: its run writes now fail LEASE_STALE, its tools see the abort.
      await release(ledger, run);
      lost.abort(new Error("the worker stopped"));
      return report({ status: "released", reason: "the worker stopped before the agent finished" });
    }
    if ("reply" in ended) {
      await succeedWith(ledger, run.runId, ended.reply, token);
      return report({ status: "succeeded", reply: ended.reply });
    }
    return report(await conclude(ledger, run, ended.error));
  } catch (error) {
    await settle();
    const reason = error instanceof Error ? error.message : String(error);
    if (isLeaseStale(error)) return report({ status: "lost", reason });
    if (isConnectionError(error)) return report(await releaseLost(ledger, run, reason));
    throw error;
  }
}

/** The run lease's default: a killed worker's run is taken over within seconds. */
export const DEFAULT_LEASE_SECONDS = 15;

/**
 * An idle worker's longest sleep by default. Notifications and `next_wake` wake it for nearly
 * everything; this bounds how late it sees what they do not tell: a lease that ran out (a dead
 * worker's run is taken over within `leaseSeconds` + `idleSeconds`) and a budget's new window.
 */
export const DEFAULT_IDLE_SECONDS = 30;

/** The channel a commit that may have made a run claimable notifies (after commit, no payload). */
const CHANNEL = "ledger_runs";

// Seconds until next_wake by the database's clock, the one claim_run's not_before follows: a worker
// whose clock is ahead would otherwise wake early, find nothing and ask again in a loop.
const NEXT_WAKE_IN = "SELECT extract(epoch FROM ledger.next_wake(any_scope => $1) - now()) AS s";

/**
 * What wakes an idle worker: a connection of its own that LISTENs on `ledger_runs` and asks
 * `next_wake` (of the worker's scope, or of every scope for a {@link Ledger}).
 */
class Alarm {
  private listener: Listener | null = null;

  constructor(
    private readonly source: Ledger | ScopedLedger,
    private readonly onError: (error: unknown) => void,
  ) {}

  /**
   * Before a claim: forgets what was notified so far (the claim sees those commits), or LISTENs on
   * a new connection when there is none (or it was lost); one that cannot leaves the worker polling.
   */
  async listen(): Promise<void> {
    if (this.listener?.lost) await this.close();
    if (this.listener === null) {
      const source = this.source;
      try {
        this.listener = await Listener.open(source instanceof Ledger ? source.pool : source.ledger.pool);
        if (!(source instanceof Ledger)) {
          // next_wake's scope: the session's.
          await new Transaction(this.listener.client).query("SELECT ledger.set_scope($1, $2)", [source.tenant, source.workspace]);
        }
        await this.listener.listen(CHANNEL);
      } catch (error) {
        this.onError(error);
        await this.close();
        return;
      }
    }
    this.listener.reset();
  }

  /**
   * Until a notification, the next wake, `ms` or the stop, whichever comes first; without a
   * listening connection, `pollMs` at most.
   */
  async wait(ms: number, pollMs: number, signal: AbortSignal): Promise<void> {
    if (this.listener !== null) {
      try {
        const [row] = await new Transaction(this.listener.client).query(NEXT_WAKE_IN, [this.source instanceof Ledger]);
        const wakeIn = row?.["s"];
        await this.listener.wait(wakeIn === null || wakeIn === undefined ? ms : Math.min(ms, Number(wakeIn) * 1000), signal);
        return;
      } catch (error) {
        this.onError(error);
        await this.close();
      }
    }
    await sleep(Math.min(ms, pollMs), undefined, { signal }).catch(() => undefined);
  }

  async close(): Promise<void> {
    await this.listener?.close();
    this.listener = null;
  }
}

/**
 * Gives the run up, repeated after a lost connection; a repeat that finds the token already over
 * by a release (the first try committed) is done.
 */
async function release(ledger: ScopedLedger, run: ClaimedRun): Promise<void> {
  await endLease(run, () => ledger.releaseRun(run.runId, run.runToken));
}

/**
 * A write that gives the run's lease up (`release_run`, `wait_run`), repeated after a lost
 * connection; a repeat refused because the lease of this very token was given up already (the
 * first try committed) is done.
 */
async function endLease(run: ClaimedRun, write: () => Promise<unknown>): Promise<void> {
  await reconnecting(async (tryNo) => {
    try {
      await write();
    } catch (error) {
      const released = error instanceof ConflictError && error.detail["lease_released"] === true;
      if (!(tryNo > 1 && released && error.detail["current_run_token"] === run.runToken)) throw error;
    }
  });
}

/** A lost connection: the run is released (or, if the database stays away, its lease runs out). */
async function releaseLost(ledger: ScopedLedger, run: ClaimedRun, reason: string): Promise<RunOutcome> {
  try {
    await release(ledger, run);
    return { status: "released", reason: `the database connection was lost: ${reason}` };
  } catch {
    return { status: "released", reason: `the database connection was lost (${reason}); the run's lease will run out` };
  }
}

/** What a run becomes when its agent threw `error`. */
async function conclude(ledger: ScopedLedger, run: ClaimedRun, error: unknown): Promise<RunOutcome> {
  const reason = error instanceof Error ? error.message : String(error);
  const token = run.runToken;
  if (isLeaseStale(error)) return { status: "lost", reason };
  if (isConnectionError(error)) return releaseLost(ledger, run, reason);
  if (error instanceof InDoubtError || error instanceof WaitingApprovalError || error instanceof BudgetExhaustedError) {
    // A refusal by a budget paused the run already (BUDGET_EXHAUSTED): paused again keeps that.
    const parked = error instanceof WaitingApprovalError ? "waiting_approval" : "paused";
    await reconnecting(() => ledger.transitionRun(run.runId, parked, { runToken: token }));
    await release(ledger, run);
    return { status: parked, reason };
  }
  if (error instanceof WaitingUntilError) {
    // wait_run gives the lease up itself: nothing is released after it (its token is over).
    await endLease(run, () => ledger.waitRun(run.runId, token, error.wakeAt));
    return { status: "waiting_input", wakeAt: error.wakeAt, reason };
  }
  if (error instanceof WaitingForInputError || error instanceof WaitingForChildrenError) {
    // The agent's wait parked the run and gave its lease up: nothing is written after it.
    return { status: "waiting_input", wakeAt: error.deadline, reason };
  }
  if (error instanceof BusyError) {
    await release(ledger, run);
    return { status: "released", reason };
  }
  const errorCode =
    error instanceof RejectedError
      ? error.claim.approval?.status === "expired"
        ? EXPIRED_ERROR_CODE
        : REJECTED_ERROR_CODE
      : error instanceof Error
        ? error.name
        : "Error";
  await reconnecting(() => ledger.transitionRun(run.runId, "failed", { errorCode, errorMessage: reason, runToken: token }));
  return { status: "failed", error: reason };
}
