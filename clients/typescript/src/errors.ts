/**
 * The ledger's errors as typed exceptions.
 *
 * Every error the extension raises has a standard SQLSTATE, a message starting with `ledger: ` and
 * a DETAIL that is a JSON object with a stable `code`. {@link toLedgerError} turns such a server
 * error into the {@link LedgerError} subclass of its SQLSTATE class; any other error (a syntax
 * error in your own SQL, a dropped connection) is returned unchanged, so it passes through as
 * node-postgres raised it.
 *
 * The tool-call outcomes that mean "not executed" (`in_doubt`, `busy`, `waiting_approval`,
 * `rejected`, `purged`, `budget_exhausted`) are not server errors: the extension returns them. The tool-call helper
 * raises them as {@link ToolCallStopped} subclasses so that a caller cannot mistake one for a
 * result; so is a replayed failure ({@link ToolFailedError}).
 */
import pg from "pg";

import type { Budget, ClaimOutcome, ToolCallClaim } from "./types.js";

/** A JSON object as the ledger returns it. */
export type JsonObject = { [key: string]: unknown };

/** An error the ledger raised: its SQLSTATE, the DETAIL's `code`, the parsed DETAIL, the message. */
export class LedgerError extends Error {
  /** The five-character SQLSTATE (`22023`, `P0002`, ...). */
  readonly sqlstate: string;
  /** The stable error code of the DETAIL (`ID_INVALID`, `LEASE_STALE`, ...). */
  readonly code: string;
  /** The whole DETAIL object: `code` plus what was wrong (`argument`, `from`, `to`, ...). */
  readonly detail: JsonObject;

  constructor(message: string, sqlstate: string, detail: JsonObject, options?: { cause: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.sqlstate = sqlstate;
    this.detail = detail;
    this.code = typeof detail["code"] === "string" ? detail["code"] : "";
  }
}

/** 42501: no scope, a scope not granted, `any_scope` without `ledger_operator`. */
export class ScopeError extends LedgerError {}
/** P0002: an id unknown in this scope. */
export class NotFoundError extends LedgerError {}
/** 22023: a bad argument. */
export class InvalidArgumentError extends LedgerError {}
/** 55000: not allowed in the current state (an invalid transition, a terminal run, ...). */
export class WrongStateError extends LedgerError {}
/** 40001: a concurrent writer got there first, or a stale attempt or run token wrote (`LEASE_STALE`). */
export class ConflictError extends LedgerError {}
/** 23505: a key reused with different input (`IDEMPOTENCY_MISMATCH`, `STEP_HAS_TOOL_CALL`). */
export class IdempotencyMismatchError extends LedgerError {}
/** XX001: stored bytes do not match their sha256. */
export class CorruptedError extends LedgerError {}
/** 25006: a writer called in a read-only transaction (a hot standby). */
export class ReadOnlyError extends LedgerError {}
/** XX000: a defect in the ledger. */
export class InternalError extends LedgerError {}

const BY_SQLSTATE: Record<string, typeof LedgerError> = {
  "42501": ScopeError,
  P0002: NotFoundError,
  "22023": InvalidArgumentError,
  "55000": WrongStateError,
  "40001": ConflictError,
  "23505": IdempotencyMismatchError,
  XX001: CorruptedError,
  "25006": ReadOnlyError,
  XX000: InternalError,
};

function parseDetail(detail: string | undefined): JsonObject {
  if (detail === undefined) return {};
  try {
    const parsed: unknown = JSON.parse(detail);
    return typeof parsed === "object" && parsed !== null && !Array.isArray(parsed) ? (parsed as JsonObject) : {};
  } catch {
    return {};
  }
}

/**
 * The {@link LedgerError} for a server error the ledger raised (its message starts with
 * `ledger:`), else `error` itself.
 */
export function toLedgerError(error: unknown): unknown {
  if (!(error instanceof pg.DatabaseError) || !error.message.startsWith("ledger:") || error.code === undefined) {
    return error;
  }
  const Class = BY_SQLSTATE[error.code] ?? LedgerError;
  return new Class(error.message, error.code, parseDetail(error.detail), { cause: error });
}

/** How a message names the call: `tool_ref (tool_call_id)`. */
function callName(claim: ToolCallClaim): string {
  return claim.toolCall ? `${claim.toolCall.toolRef} (${claim.toolCall.toolCallId})` : "the tool call";
}

/**
 * The helper has no result for the call: it ran nothing (or, for {@link InDoubtError}, nobody
 * knows what the request did). `outcome` says why; `claim` is the whole answer (the record, the
 * approval, the tombstone).
 */
export class ToolCallStopped extends Error {
  readonly outcome: ClaimOutcome;
  readonly claim: ToolCallClaim;

  constructor(claim: ToolCallClaim, message?: string) {
    super(message ?? `${callName(claim)}: ${claim.outcome}`);
    this.name = new.target.name;
    this.outcome = claim.outcome;
    this.claim = claim;
  }
}

/** The request may have left and no answer was recorded: a person resolves it; never retried. */
export class InDoubtError extends ToolCallStopped {}
/** A live lease exists (another executor holds the call): claim again later. */
export class BusyError extends ToolCallStopped {}
/** The call waits for a person's approval (`claim.approval` is the request). */
export class WaitingApprovalError extends ToolCallStopped {}
/**
 * The approval was rejected, or expired before anyone decided it (`claim.approval.status`
 * `expired`): the call is never executed. The message names the call, who rejected it and their
 * note. Escaping an agent, it fails the run with `error_code` `TOOL_APPROVAL_REJECTED`
 * ({@link REJECTED_ERROR_CODE}), or `TOOL_APPROVAL_EXPIRED` ({@link EXPIRED_ERROR_CODE}).
 */
export class RejectedError extends ToolCallStopped {
  constructor(claim: ToolCallClaim) {
    const approval = claim.approval;
    const by = approval?.actor ? ` by ${approval.actor}` : "";
    const note = approval?.note ? `: ${approval.note}` : "";
    super(claim, `${callName(claim)}: approval ${approval?.status ?? "rejected"}${by}${note}`);
  }
}

/** The run's `error_code` when a {@link RejectedError} escapes the agent. */
export const REJECTED_ERROR_CODE = "TOOL_APPROVAL_REJECTED";
/** The run's `error_code` when a {@link RejectedError} of an approval that expired undecided escapes the agent. */
export const EXPIRED_ERROR_CODE = "TOOL_APPROVAL_EXPIRED";

/**
 * The tool ran, and its result cannot be encoded as JSON (a function, a symbol, a cycle, see
 * `toJson`): the call was completed `unknown`, so it is in doubt for a person to resolve, with
 * this message as its `error_message`; it is never run again. `path` and `type` say what could
 * not be encoded. A subclass of {@link InDoubtError}: a worker parks the run.
 */
export class ResultNotEncodable extends InDoubtError {
  constructor(
    claim: ToolCallClaim,
    readonly path: string,
    readonly type: string,
  ) {
    super(claim, `${callName(claim)}: the tool ran, its result cannot be recorded: cannot encode ${type} at ${path} as JSON`);
  }
}
/** The run was purged; the key's tombstone answered (`claim.raw.tool_call`). */
export class PurgedError extends ToolCallStopped {}
/**
 * A budget that applies to the run is used up (`budget` says which): the call is not executed
 * (`claim.toolCall` is null for a new call: nothing was created), and the ledger paused the run
 * with `error_code` `BUDGET_EXHAUSTED` until a person raises the budget (`setBudget`) or ends the
 * run. `RunContext.llmStep` throws it too for a refused `llm` step. A worker parks the run.
 */
export class BudgetExhaustedError extends ToolCallStopped {
  readonly budget: Budget | null;

  constructor(claim: ToolCallClaim, subject = callName(claim)) {
    const budget = claim.budget;
    const which = budget ? `the ${budget.level}'s ${budget.unit} budget is used up (${budget.spent} of ${budget.maxAmount})` : "a budget is used up";
    super(claim, `${subject}: ${which}`);
    this.budget = budget;
  }
}
/**
 * The call failed when it ran before, and its failure was replayed (outcome `replayed`): it is
 * not run again. `error` is the recorded error; claim with `retryFailed` to execute it again.
 */
export class ToolFailedError extends ToolCallStopped {
  readonly error: string | null;

  constructor(claim: ToolCallClaim) {
    super(claim, `${callName(claim)} failed before: ${claim.response?.error ?? "no error recorded"}`);
    this.error = claim.response?.error ?? null;
  }
}

const STOPPED: Partial<Record<ClaimOutcome, typeof ToolCallStopped>> = {
  in_doubt: InDoubtError,
  busy: BusyError,
  waiting_approval: WaitingApprovalError,
  rejected: RejectedError,
  purged: PurgedError,
  budget_exhausted: BudgetExhaustedError,
};

/** The exception for a claim that hands out no execution and has no result to replay. */
export function stopped(claim: ToolCallClaim): ToolCallStopped {
  const Class = STOPPED[claim.outcome] ?? ToolCallStopped;
  return new Class(claim);
}
