/**
 * The tool-call helper: the executor protocol in one call.
 *
 * claim (committed) → `replayed`: the recorded result, nothing executed → `claimed`: begin and
 * COMMIT before the request leaves → execute, heartbeating the attempt's lease on a timer →
 * complete `succeeded` (the result) or `failed` (the error's message) → a timeout after sending
 * (the tool throws a `TimeoutError` or `AbortError`) completes `unknown`: the call is in doubt and
 * {@link InDoubtError} is thrown. Any other outcome (`in_doubt`, `busy`, `waiting_approval`,
 * `rejected`, `purged`, `budget_exhausted`) is thrown as its {@link ToolCallStopped} subclass, and nothing runs; a
 * replayed failure as {@link ToolFailedError}.
 *
 * Every step is a transaction of its own, so each is committed before the next begins: the rules
 * (statuses, fencing by attempt, in-doubt marking) are the extension's.
 *
 * `repeatable: true` (a tool safe to repeat: a read, an idempotent API) takes the single-commit
 * path instead: a lookup that writes nothing (`find_tool_call`: `replayed` returns the recorded
 * result), the tool, then one committing statement after it returned (`record_tool_call`).
 * Nothing is leased or begun, so concurrent callers may each run the tool once; the first record
 * wins and every caller returns what it recorded.
 */
import { NotEncodableError, toJson } from "./encoding.js";
import { ConflictError, InDoubtError, ResultNotEncodable, stopped, ToolFailedError } from "./errors.js";
import { reconnecting } from "./faults.js";
import { positiveSeconds } from "./options.js";
import type { ClaimToolCallOptions, FindToolCallOptions, ScopedLedger, ToolCallSpec } from "./client.js";
import type { CompleteOutcome, ToolCall, ToolCallClaim } from "./types.js";

type Json = { [key: string]: unknown };

/**
 * The tool itself: called with the arguments and a signal that aborts when the call's
 * `timeoutSeconds` is over, when the caller's signal aborts, or when the attempt's lease is lost.
 * Throw a `TimeoutError` or `AbortError` (what `fetch(..., { signal })` throws) when the request
 * may have left and no answer came: the call is then in doubt, never retried.
 */
export type ToolFn<A extends Json = Json, R = unknown> = (args: A, signal: AbortSignal) => Promise<R>;

/** How the helper runs a claimed call. */
export interface ExecuteOptions {
  /** Aborts the tool's signal too (a worker stopping, a run taken over). */
  signal?: AbortSignal;
  /** Seconds between lease heartbeats while the tool runs; default a third of the lease. */
  heartbeatSeconds?: number;
}

/** One tool call through the helper. */
export interface ToolCallRequest<A extends Json = Json, R = unknown> extends ClaimToolCallOptions, ExecuteOptions {
  /** The call's id in the run (the model's): asking again with it answers the recorded result. */
  toolCallId: string;
  runId: string;
  toolRef: string;
  arguments: A;
  execute: ToolFn<A, R>;
  /**
   * The tool is safe to repeat: looked up, run, and recorded once after it returns in one commit,
   * with no lease, heartbeat or doubt (a timeout is recorded `failed`). Not with `approval`.
   */
  repeatable?: boolean;
}

/** `claim_tool_call`'s default `timeout_seconds`: the tool's signal aborts after it. */
const DEFAULT_TIMEOUT_SECONDS = 30;

/** A `TimeoutError` or `AbortError` (an `Error` or a `DOMException`, as `fetch` and timers throw). */
function isTimeout(error: unknown): boolean {
  const name = typeof error === "object" && error !== null && "name" in error ? error.name : undefined;
  return name === "TimeoutError" || name === "AbortError";
}

/** The recorded result of a `replayed` claim, or the exception of a claim that runs nothing. */
function settled(claim: ToolCallClaim): unknown {
  if (claim.outcome === "replayed" && claim.response !== null) {
    if (!claim.response.success) throw new ToolFailedError(claim);
    return claim.response.result;
  }
  throw stopped(claim);
}

/**
 * Records how the attempt ended, again across a dropped connection (the tool has run: its outcome
 * must not be lost to a reconnect). Fenced by the attempt; repeating a completion changes nothing.
 */
async function complete(
  ledger: ScopedLedger,
  call: ToolCall,
  outcome: CompleteOutcome,
  options: { result?: unknown; errorMessage?: string },
): Promise<ToolCallClaim> {
  return reconnecting(() => ledger.completeToolCall(call.id, call.attempt, outcome, options));
}

/**
 * Records the tool's result: `succeeded` with it encoded by the client's rule (`toJson`), or, when
 * it cannot be encoded, `unknown` with the reason (the tool ran: a person decides what it did),
 * then {@link ResultNotEncodable}.
 */
async function completeWith(ledger: ScopedLedger, call: ToolCall, result: unknown): Promise<void> {
  let encoded: unknown;
  try {
    encoded = toJson(result === undefined ? null : result);
  } catch (error) {
    if (!(error instanceof NotEncodableError)) throw error;
    const reason = `the tool ran, its result cannot be recorded: cannot encode ${error.type} at ${error.path} as JSON`;
    const answer = await complete(ledger, call, "unknown", { errorMessage: reason });
    throw new ResultNotEncodable(answer, error.path, error.type);
  }
  await complete(ledger, call, "succeeded", { result: encoded });
}

/**
 * Executes a claimed and begun call: heartbeats while `execute` runs, then completes it. Returns
 * the tool's result; rethrows the tool's error after completing `failed`; throws
 * {@link InDoubtError} after completing `unknown` on a timeout.
 */
async function executeBegun<A extends Json, R>(
  ledger: ScopedLedger,
  claim: ToolCallClaim,
  args: A,
  execute: ToolFn<A, R>,
  timeoutSeconds: number,
  options: ExecuteOptions,
): Promise<R> {
  const call = claim.toolCall;
  if (call === null) throw new Error("ledger: a claimed answer without its tool_call");
  const lost = new AbortController();
  const signals = [lost.signal];
  if (timeoutSeconds > 0) signals.push(AbortSignal.timeout(timeoutSeconds * 1000));
  if (options.signal) signals.push(options.signal);
  const heartbeatMs = (options.heartbeatSeconds ?? call.leaseSeconds / 3) * 1000;
  let beating = Promise.resolve();
  const timer = setInterval(() => {
    beating = beating.then(async () => {
      try {
        await ledger.heartbeatToolCall(call.id, call.attempt);
      } catch (error) {
        // The attempt is over (a sweep released it, a person resolved it): stop the tool. Any
        // other failure (a dropped connection) is retried at the next beat.
        if (error instanceof ConflictError) lost.abort(error);
      }
    });
  }, heartbeatMs);
  let result: R;
  try {
    result = await execute(args, AbortSignal.any(signals));
  } catch (error) {
    clearInterval(timer);
    await beating;
    if (isTimeout(error)) {
      const answer = await complete(ledger, call, "unknown", {
        errorMessage: error instanceof Error ? error.message : String(error),
      });
      throw new InDoubtError(answer, `${call.toolRef} (${call.toolCallId}): sent, no answer: in doubt`);
    }
    await complete(ledger, call, "failed", {
      errorMessage: error instanceof Error ? error.message : String(error),
    });
    throw error;
  }
  clearInterval(timer);
  await beating;
  await completeWith(ledger, call, result);
  return result;
}

/**
 * One tool call, executed at most once whoever asks again: returns the tool's result, or the
 * recorded one on a replay. Throws {@link ToolCallStopped} subclasses for the outcomes that run
 * nothing, {@link InDoubtError} after a timeout past the begin, {@link ToolFailedError} for a
 * replayed failure, and the tool's own error after recording it as `failed`.
 */
export async function toolCall<A extends Json, R>(ledger: ScopedLedger, request: ToolCallRequest<A, R>): Promise<R> {
  const { runId, toolRef, arguments: args, execute, signal, heartbeatSeconds, leaseOwner, runToken, repeatable, ...spec } =
    request;
  positiveSeconds("heartbeatSeconds", heartbeatSeconds);
  const encoded = encodeArguments(toolRef, spec.toolCallId, args);
  if (repeatable) return repeatCall(ledger, request, encoded);
  // Claimed and begun in one statement, committed before the request leaves: from here a crash
  // leaves the call in doubt, never resent. Repeated after a lost connection: a claim that did
  // commit answers `busy` (never a second execution).
  const [claim] = await reconnecting(() =>
    ledger.claimToolCalls(runId, [{ toolRef, arguments: encoded, ...spec }], {
      begin: true,
      ...(leaseOwner !== undefined ? { leaseOwner } : {}),
      ...(runToken !== undefined ? { runToken } : {}),
    }),
  );
  if (claim === undefined) throw new Error("ledger: claim_tool_calls answered no row");
  if (claim.outcome !== "claimed" || claim.toolCall === null) return settled(claim) as R;
  return executeBegun(ledger, claim, args, execute, spec.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS, {
    ...(signal ? { signal } : {}),
    ...(heartbeatSeconds !== undefined ? { heartbeatSeconds } : {}),
  });
}

/**
 * A repeatable call (see the module's comment): its recorded result, or the tool run and its
 * outcome recorded; another caller's record that came first answers instead of this one. A result
 * the encoding rule cannot encode throws {@link NotEncodableError} and records nothing: the tool
 * may simply run again.
 */
async function repeatCall<A extends Json, R>(ledger: ScopedLedger, request: ToolCallRequest<A, R>, encoded: Json): Promise<R> {
  const { runId, toolRef, toolCallId, idempotencyKey, retryFailed, runToken, approval, stepId, signal } = request;
  if (approval !== undefined) {
    throw new TypeError("ledger: a call that waits for an approval is not repeatable: leave out repeatable");
  }
  if (stepId !== undefined) {
    throw new TypeError("ledger: a repeatable call is recorded under a tool step of its own: leave out stepId");
  }
  const identity: FindToolCallOptions = {
    toolCallId,
    ...(idempotencyKey !== undefined ? { idempotencyKey } : {}),
    ...(retryFailed !== undefined ? { retryFailed } : {}),
  };
  const found = await reconnecting(() => ledger.findToolCall(runId, toolRef, encoded, identity));
  if (found.outcome !== "unrecorded") return settled(found) as R;
  const record = { ...identity, ...(runToken !== undefined ? { runToken } : {}) };
  const timeoutSeconds = request.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS;
  const signals = timeoutSeconds > 0 ? [AbortSignal.timeout(timeoutSeconds * 1000)] : [];
  if (signal) signals.push(signal);
  let result: R;
  try {
    result = await request.execute(request.arguments, AbortSignal.any(signals));
  } catch (error) {
    const errorMessage = error instanceof Error ? error.message : String(error);
    const answer = await reconnecting(() => ledger.recordToolCall(runId, toolRef, encoded, "failed", { ...record, errorMessage }));
    if (answer.outcome === "recorded") throw error;
    return settled(answer) as R;
  }
  const value = toJson(result === undefined ? null : result);
  const answer = await reconnecting(() => ledger.recordToolCall(runId, toolRef, encoded, "succeeded", { ...record, result: value }));
  return answer.outcome === "recorded" ? result : (settled(answer) as R);
}

/** The call's arguments as JSON by the client's rule; one that cannot be encoded is refused before any claim. */
function encodeArguments(toolRef: string, toolCallId: string | undefined, args: Json): Json {
  try {
    return toJson(args) as Json;
  } catch (error) {
    if (!(error instanceof NotEncodableError)) throw error;
    throw new NotEncodableError(error.path, error.type, `${toolRef}${toolCallId ? ` (${toolCallId})` : ""}: its arguments`);
  }
}

/** One call of a model turn for {@link toolCalls}. */
export interface TurnCall<A extends Json = Json, R = unknown> extends ToolCallSpec {
  /** The call's id in the run (the model's): asking again with it answers the recorded result. */
  toolCallId: string;
  arguments: A;
  execute: ToolFn<A, R>;
}

/** Options of {@link toolCalls}: the batch's lease owner and run token, and how calls run. */
export interface TurnOptions extends ExecuteOptions {
  leaseOwner?: string;
  runToken?: number;
}

/** How one call of a turn ended: its result (`value`) or what stopped it (`error`). */
export interface ToolCallResult {
  /** The call's answer from `claim_tool_calls`. */
  claim: ToolCallClaim;
  value?: unknown;
  /** A {@link ToolCallStopped}, or what the tool threw. */
  error?: unknown;
  /** The result, or the error thrown. */
  get(): unknown;
}

/**
 * The calls of one model turn: claimed and begun together (`claim_tool_calls(..., begin => true)`,
 * one commit before any request leaves), the claimed ones executed concurrently, each heartbeated
 * and completed as it ends. Returns one {@link ToolCallResult} per call, in input order, once every
 * call has settled and been recorded; it never throws for one call's outcome (a refused batch
 * throws the ledger's error, and nothing was written).
 */
export async function toolCalls(
  ledger: ScopedLedger,
  runId: string,
  calls: TurnCall[],
  options: TurnOptions = {},
): Promise<ToolCallResult[]> {
  const { leaseOwner, runToken, ...execute } = options;
  positiveSeconds("heartbeatSeconds", execute.heartbeatSeconds);
  const specs = calls.map(({ execute: _execute, ...spec }) => ({ ...spec, arguments: encodeArguments(spec.toolRef, spec.toolCallId, spec.arguments) }));
  const claims = await reconnecting(() =>
    ledger.claimToolCalls(runId, specs, {
      begin: true,
      ...(leaseOwner !== undefined ? { leaseOwner } : {}),
      ...(runToken !== undefined ? { runToken } : {}),
    }),
  );
  const outcomes = await Promise.allSettled(
    claims.map(async (claim, i) => {
      const spec = calls[i];
      if (spec === undefined) throw new Error("ledger: claim_tool_calls answered more rows than calls");
      if (claim.outcome !== "claimed") return settled(claim);
      return executeBegun(ledger, claim, spec.arguments, spec.execute, spec.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS, execute);
    }),
  );
  return outcomes.map((o, i) => {
    const claim = claims[i] as ToolCallClaim;
    if (o.status === "fulfilled") return { claim, value: o.value, get: () => o.value };
    return {
      claim,
      error: o.reason,
      get: () => {
        throw o.reason;
      },
    };
  });
}
