/**
 * Typed results: the rows and JSON answers of the ledger's functions, in camelCase, and the
 * parsers that build them from what node-postgres returns.
 *
 * Counters the server keeps as `bigint` (`runToken`, `seq`, `attempt`, `stepNo`) are numbers: they
 * stay far below 2^53. Money stays a decimal string, as the ledger returns it. JSON values the
 * caller gave (inputs, arguments, results, payloads) are plain objects, as stored (redacted).
 */

/** The statuses of runs (and tasks). */
export const RUN_STATUSES = [
  "queued",
  "preparing",
  "running",
  "waiting_input",
  "waiting_approval",
  "paused",
  "retrying",
  "succeeded",
  "failed",
  "canceled",
  "expired",
] as const;
export type RunStatus = (typeof RUN_STATUSES)[number];
/** Steps have the run statuses plus `skipped`. */
export type StepStatus = RunStatus | "skipped";
/** Statuses after which nothing moves the run but a retry. */
export const TERMINAL_STATUSES: readonly StepStatus[] = ["succeeded", "failed", "canceled", "expired", "skipped"];

/**
 * What a tool-call claim answers (returned by the server, never raised); `find_tool_call` and
 * `record_tool_call` (the repeatable path) also answer `unrecorded` and `recorded`.
 */
export const CLAIM_OUTCOMES = [
  "claimed",
  "replayed",
  "in_doubt",
  "busy",
  "waiting_approval",
  "rejected",
  "purged",
  "unrecorded",
  "recorded",
  "budget_exhausted",
] as const;
export type ClaimOutcome = (typeof CLAIM_OUTCOMES)[number];

/** The statuses of a tool-call record. */
export type ToolCallStatus = "waiting_approval" | "claimed" | "running" | "succeeded" | "failed" | "in_doubt" | "rejected";
/** The statuses of an approval request. */
export type ApprovalStatus = "pending" | "approved" | "rejected" | "expired" | "canceled";
/** The statuses of an outbox event. */
export type OutboxStatus = "pending" | "processing" | "done" | "failed";
/** A person's decision on an in-doubt call. */
export type ResolveDecision = "succeeded" | "failed" | "retry";
/** How an executor reports the end of an attempt (`unknown`: sent, no answer). */
export type CompleteOutcome = "succeeded" | "failed" | "unknown";
/** Where a budget applies: every workspace of the tenant, the scope's workspace, or one run. */
export type BudgetLevel = "tenant" | "workspace" | "run";
/** A budget's window: all time, or the calendar day or month (UTC). */
export type BudgetPeriod = "total" | "day" | "month";
/** The statuses of a `run_evidence` item. */
export type EvidenceStatus = "pass" | "warning" | "fail" | "not_applicable";
/** What a schedule's sweep does with missed firings: one run for the most recent, or one each. */
export type CatchUp = "latest" | "all";

type Json = { [key: string]: unknown };

/** A row of `ledger.runs` (without the scope columns). */
export interface Run {
  id: string;
  mode: string;
  kind: string;
  subjectKind: string;
  subjectId: string | null;
  subjectVersionId: string | null;
  userId: string | null;
  traceId: string | null;
  requestId: string | null;
  parentRunId: string | null;
  sourceRunId: string | null;
  rootRunId: string;
  attemptNo: number;
  controlAction: string | null;
  status: RunStatus;
  inputSummary: string | null;
  inputs: unknown;
  outputSummary: string | null;
  errorCode: string | null;
  errorMessage: string | null;
  errorStepId: string | null;
  lastSeq: number;
  queuedAt: Date;
  startedAt: Date | null;
  endedAt: Date | null;
  durationMs: number | null;
  createdAt: Date;
  updatedAt: Date;
  leaseOwner: string | null;
  leaseExpiresAt: Date | null;
  runToken: number;
  /** `claimRun` does not hand the run out before this time; null: at once. */
  notBefore: Date | null;
  /** `claimRun` takes the highest priority first (-1000 to 1000, default 0). */
  priority: number;
  /** The key whose concurrency limit the run counts against (`setConcurrencyLimit`); null: none. */
  concurrencyKey: string | null;
}

/** A row of `ledger.run_steps`. */
export interface Step {
  id: string;
  runId: string;
  stepNo: number;
  stepKey: string | null;
  stepType: string;
  nodeId: string | null;
  status: StepStatus;
  inputSummary: string | null;
  outputSummary: string | null;
  metrics: Json;
  errorCode: string | null;
  errorMessage: string | null;
  errorDetails: unknown;
  startedAt: Date | null;
  endedAt: Date | null;
  createdAt: Date;
  updatedAt: Date;
}

/** A `ledger.claimed_run`: a run handed to a worker, with what it needs to resume it. */
export interface ClaimedRun {
  tenantId: string;
  workspaceId: string;
  runId: string;
  /** The fencing token: pass it to the run's writes. */
  runToken: number;
  leaseOwner: string;
  leaseExpiresAt: Date;
  /** True when the lease of `previousOwner` had expired. */
  takeover: boolean;
  previousOwner: string | null;
  status: RunStatus;
  mode: string;
  kind: string;
  attemptNo: number;
  sourceRunId: string | null;
  inputs: unknown;
  steps: { id: string; stepKey: string | null; stepType: string; status: StepStatus }[];
  toolCalls: { id: string; toolCallId: string; idempotencyKey: string; toolRef: string; status: ToolCallStatus; attempt: number }[];
  approvals: { id: string; toolCallRecordId: string | null; stepId: string | null }[];
  /** The feed's newest event: where a follower starting now begins. */
  lastEventId: string | null;
}

/** A tool-call record as the tool-call functions return it. */
export interface ToolCall {
  /** The ledger's id of the record (`tc_...`): the `tool_call_record_id` of later calls. */
  id: string;
  runId: string;
  stepId: string;
  /** The caller's (the model's) id of the call. */
  toolCallId: string;
  toolRef: string;
  idempotencyKey: string;
  requestHash: string;
  arguments: Json;
  status: ToolCallStatus;
  /** The fencing token of every write after the claim. */
  attempt: number;
  leaseOwner: string | null;
  leaseSeconds: number;
  leaseExpiresAt: Date | null;
  outboundStartedAt: Date | null;
  resultArtifactId: string | null;
  metadata: Json;
  errorCode: string | null;
  errorMessage: string | null;
  approvalId: string | null;
  completedAt: Date | null;
  createdAt: Date;
  updatedAt: Date;
}

/** An approval request (`ledger.approval_requests` without the scope columns). */
export interface Approval {
  id: string;
  runId: string;
  stepId: string | null;
  toolCallRecordId: string | null;
  status: ApprovalStatus;
  title: string | null;
  policyRef: string | null;
  details: Json;
  actor: string | null;
  note: string | null;
  decidedAt: Date | null;
  createdAt: Date;
  /** The deadline: past it no one may decide the approval, and it expires (null: none). */
  expiresAt: Date | null;
}

/** The recorded result a `replayed` claim carries. */
export interface ToolResponse {
  result: unknown;
  success: boolean;
  error: string | null;
  metadata: Json;
}

/**
 * A budget as a refusal names it: the `budget` of a `budget_exhausted` answer, the `errorDetails`
 * of a refused `llm` step, the payload of `budget.exhausted`. Amounts are decimal strings.
 */
export interface Budget {
  level: BudgetLevel;
  runId: string | null;
  /** `tokens`, `tool_calls`, `llm_steps` or a currency code (`USD`). */
  unit: string;
  period: BudgetPeriod;
  maxAmount: string;
  /** Spent in the window of now. */
  spent: string;
  /** `maxAmount - spent`, at least 0. */
  remaining: string;
  /** The window's bounds; null for a `total` budget. */
  windowStart: Date | null;
  windowEnd: Date | null;
}

/** A row of `ledger.budget_usage`: a budget and what was spent in the window of now. */
export interface BudgetUsage extends Budget {
  tenantId: string;
  /** Null for a tenant's budget. */
  workspaceId: string | null;
  /** `spent >= maxAmount`: decisions to spend are refused. */
  exhausted: boolean;
  /** The share of `maxAmount` that writes `budget.warning`; null: no warning. */
  warnRatio: string | null;
  /** This window's warning was written. */
  warned: boolean;
  updatedBy: string | null;
  updatedAt: Date;
}

/** What every tool-call function answers: `{outcome, tool_call, approval, response}`. */
export interface ToolCallClaim {
  outcome: ClaimOutcome;
  /**
   * The record; null for `purged` (the tombstone is in `raw.tool_call`), `unrecorded` without one
   * and `budget_exhausted` for a new call (nothing was created).
   */
  toolCall: ToolCall | null;
  approval: Approval | null;
  /** For `replayed` only. */
  response: ToolResponse | null;
  /** For `budget_exhausted` only: the budget that is used up. */
  budget: Budget | null;
  /** The answer as the server returned it. */
  raw: Json;
}

/** One event of a run's feed (`events_since`). */
export interface RunEvent {
  eventId: string;
  /** Gapless per run, in commit order. */
  seq: number;
  eventType: string;
  stepId: string | null;
  payload: Json;
  createdAt: Date;
  /** True on the event that moved the run to a terminal status: the stream is over. */
  endsRun: boolean;
}

/** A `ledger.outbox_event`. */
export interface OutboxEvent {
  tenantId: string;
  workspaceId: string;
  id: string;
  eventType: string;
  runId: string | null;
  taskId: string | null;
  subject: string;
  payload: Json;
  status: OutboxStatus;
  attemptCount: number;
  replayCount: number;
  availableAt: Date;
  leaseExpiresAt: Date | null;
  errorMessage: string | null;
  occurredAt: Date;
  processedAt: Date | null;
}

/**
 * A call in doubt, waiting for a person's `resolveToolCall`: a row of `ledger.tool_calls_in_doubt`
 * with the call's `arguments` (redacted as stored) from `ledger.run_step_tool_calls`.
 */
export interface ToolCallInDoubt {
  /** The tool_call_record_id `resolveToolCall` takes. */
  id: string;
  runId: string;
  stepId: string | null;
  toolCallId: string;
  toolRef: string;
  idempotencyKey: string;
  arguments: Json;
  attempt: number;
  /** Who held the attempt when it went in doubt: the worker to look at first. */
  leaseOwner: string | null;
  outboundStartedAt: Date | null;
  errorCode: string | null;
  errorMessage: string | null;
  updatedAt: Date;
}

/**
 * An approval waiting for a person's `resolveApproval`: a row of `ledger.pending_approvals` with
 * the call's `toolCallId` and `arguments` (redacted as stored) from `ledger.run_step_tool_calls`.
 */
export interface PendingApproval {
  /** The approval_id `resolveApproval` takes. */
  id: string;
  runId: string;
  stepId: string | null;
  toolCallRecordId: string | null;
  toolCallId: string | null;
  toolRef: string | null;
  arguments: Json | null;
  title: string | null;
  policyRef: string | null;
  details: Json;
  createdAt: Date;
  /** Decide it before then (null: no deadline). */
  expiresAt: Date | null;
}

/**
 * A row of `ledger.inbox`: what waits for people in a scope, each queue counted with the oldest
 * one's time (null when it is empty): calls in doubt (`resolveToolCall`), pending approvals before
 * their deadline (`resolveApproval`), runs paused by a budget still used up (`setBudget`) and
 * failed outbox events (`replayOutboxEvent`).
 */
export interface Inbox {
  tenantId: string;
  workspaceId: string;
  callsInDoubt: number;
  oldestInDoubtAt: Date | null;
  pendingApprovals: number;
  oldestApprovalAt: Date | null;
  budgetStops: number;
  oldestBudgetStopAt: Date | null;
  failedOutboxEvents: number;
  oldestFailedOutboxEventAt: Date | null;
}

/** A row of `ledger.run_cost_entries` as far as a worker needs it. */
export interface CostEntry {
  id: string;
  runId: string;
  stepId: string | null;
  billingBasis: string;
  billedQuantity: string;
  amount: string | null;
  currency: string | null;
  usage: Json;
}

/** One of the thirteen governance items of `run_evidence`, in its order. */
export interface EvidenceItem {
  key: string;
  status: EvidenceStatus;
  label: string;
  summary: string;
  evidenceRefs: unknown[];
  missing: unknown[];
}

/**
 * A row of `ledger.run_mailbox` as `send_input` and `wait_for_input` return it: the input of
 * `inputKey` (`payload` as stored, redacted; `receivedAt` null while the run only waits for it) and
 * the run's wait for it (`waitedAt`, `waitDeadline`).
 */
export interface MailboxInput {
  id: string;
  runId: string;
  inputKey: string;
  payload: unknown;
  sender: string | null;
  receivedAt: Date | null;
  waitedAt: Date | null;
  waitDeadline: Date | null;
  createdAt: Date;
}

/**
 * `wait_for_input`'s answer: `received` (the input), `waiting` (the run was parked: its token is
 * over; `input` is the mailbox row of the wait) or `timed_out` (its deadline passed without it).
 */
export type InputWait =
  | { status: "received" | "waiting"; inputKey: string; input: MailboxInput }
  | { status: "timed_out"; inputKey: string; input: null };

/** A child run as `wait_for_children` lists it: how it stands (or ended). */
export interface ChildRun {
  runId: string;
  status: RunStatus;
  outputSummary: string | null;
  errorCode: string | null;
  errorMessage: string | null;
}

/**
 * `wait_for_children`'s answer: `done` (every child ended), `timed_out` (its deadline passed first)
 * or `waiting` (the run was parked: its token is over); the children oldest first.
 */
export interface ChildrenWait {
  status: "done" | "timed_out" | "waiting";
  children: ChildRun[];
}

/** A row of `ledger.schedules` (without the scope columns). */
export interface Schedule {
  id: string;
  cron: string;
  timeZone: string;
  /** What each firing creates: a run of `mode`, `kind`, `inputs`, `priority`, `concurrencyKey`. */
  mode: string;
  kind: string | null;
  inputs: Json | null;
  priority: number;
  concurrencyKey: string | null;
  catchUp: CatchUp;
  paused: boolean;
  /** The next firing still to run; null: the expression names no later time. */
  nextFireAt: Date | null;
  lastFiredAt: Date | null;
  lastRunId: string | null;
  updatedBy: string | null;
  createdAt: Date;
  updatedAt: Date;
}

// Parsers. Columns come from node-postgres (timestamps as Date, bigint and numeric as strings,
// jsonb parsed); members of jsonb answers are JSON (timestamps as ISO strings).

type Row = Record<string, unknown>;

function value(row: Row, key: string): unknown {
  const v = row[key];
  return v === undefined ? null : v;
}

function str(row: Row, key: string): string {
  const v = value(row, key);
  if (typeof v !== "string") throw new TypeError(`ledger: expected text in ${key}, got ${typeof v}`);
  return v;
}

function optStr(row: Row, key: string): string | null {
  const v = value(row, key);
  return v === null ? null : String(v);
}

function num(row: Row, key: string): number {
  const v = value(row, key);
  if (v === null) throw new TypeError(`ledger: expected a number in ${key}`);
  return Number(v);
}

function optNum(row: Row, key: string): number | null {
  const v = value(row, key);
  return v === null ? null : Number(v);
}

/** The latest time a `Date` holds (ECMAScript's 8.64e15 ms, +275760-09-13); its negative the earliest. */
const LATEST_DATE_MS = 8.64e15;

function optDate(row: Row, key: string): Date | null {
  const v = value(row, key);
  if (v === null) return null;
  // node-postgres reads 'infinity' and '-infinity' as the numbers ±Infinity (a run that waits for an
  // input without a deadline has not_before 'infinity'): a Date still, the latest or the earliest.
  if (v === Infinity || v === -Infinity) return new Date(Math.sign(v) * LATEST_DATE_MS);
  return v instanceof Date ? v : new Date(String(v));
}

function date(row: Row, key: string): Date {
  const v = optDate(row, key);
  if (v === null) throw new TypeError(`ledger: expected a timestamp in ${key}`);
  return v;
}

function obj(row: Row, key: string): Json {
  const v = value(row, key);
  return typeof v === "object" && v !== null && !Array.isArray(v) ? (v as Json) : {};
}

function list(row: Row, key: string): Row[] {
  const v = value(row, key);
  return Array.isArray(v) ? (v as Row[]) : [];
}

/** Parses a `ledger.runs` row. */
export function parseRun(row: Row): Run {
  return {
    id: str(row, "id"),
    mode: str(row, "mode"),
    kind: str(row, "kind"),
    subjectKind: str(row, "subject_kind"),
    subjectId: optStr(row, "subject_id"),
    subjectVersionId: optStr(row, "subject_version_id"),
    userId: optStr(row, "user_id"),
    traceId: optStr(row, "trace_id"),
    requestId: optStr(row, "request_id"),
    parentRunId: optStr(row, "parent_run_id"),
    sourceRunId: optStr(row, "source_run_id"),
    rootRunId: str(row, "root_run_id"),
    attemptNo: num(row, "attempt_no"),
    controlAction: optStr(row, "control_action"),
    status: str(row, "status") as RunStatus,
    inputSummary: optStr(row, "input_summary"),
    inputs: value(row, "inputs"),
    outputSummary: optStr(row, "output_summary"),
    errorCode: optStr(row, "error_code"),
    errorMessage: optStr(row, "error_message"),
    errorStepId: optStr(row, "error_step_id"),
    lastSeq: num(row, "last_seq"),
    queuedAt: date(row, "queued_at"),
    startedAt: optDate(row, "started_at"),
    endedAt: optDate(row, "ended_at"),
    durationMs: optNum(row, "duration_ms"),
    createdAt: date(row, "created_at"),
    updatedAt: date(row, "updated_at"),
    leaseOwner: optStr(row, "lease_owner"),
    leaseExpiresAt: optDate(row, "lease_expires_at"),
    runToken: num(row, "run_token"),
    notBefore: optDate(row, "not_before"),
    priority: num(row, "priority"),
    concurrencyKey: optStr(row, "concurrency_key"),
  };
}

/** Parses a `ledger.run_steps` row. */
export function parseStep(row: Row): Step {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepNo: num(row, "step_no"),
    stepKey: optStr(row, "step_key"),
    stepType: str(row, "step_type"),
    nodeId: optStr(row, "node_id"),
    status: str(row, "status") as StepStatus,
    inputSummary: optStr(row, "input_summary"),
    outputSummary: optStr(row, "output_summary"),
    metrics: obj(row, "metrics"),
    errorCode: optStr(row, "error_code"),
    errorMessage: optStr(row, "error_message"),
    errorDetails: value(row, "error_details"),
    startedAt: optDate(row, "started_at"),
    endedAt: optDate(row, "ended_at"),
    createdAt: date(row, "created_at"),
    updatedAt: date(row, "updated_at"),
  };
}

/** Parses a `ledger.claimed_run` row. */
export function parseClaimedRun(row: Row): ClaimedRun {
  return {
    tenantId: str(row, "tenant_id"),
    workspaceId: str(row, "workspace_id"),
    runId: str(row, "run_id"),
    runToken: num(row, "run_token"),
    leaseOwner: str(row, "lease_owner"),
    leaseExpiresAt: date(row, "lease_expires_at"),
    takeover: value(row, "takeover") === true,
    previousOwner: optStr(row, "previous_owner"),
    status: str(row, "status") as RunStatus,
    mode: str(row, "mode"),
    kind: str(row, "kind"),
    attemptNo: num(row, "attempt_no"),
    sourceRunId: optStr(row, "source_run_id"),
    inputs: value(row, "inputs"),
    steps: list(row, "steps").map((s) => ({
      id: str(s, "id"),
      stepKey: optStr(s, "step_key"),
      stepType: str(s, "step_type"),
      status: str(s, "status") as StepStatus,
    })),
    toolCalls: list(row, "tool_calls").map((c) => ({
      id: str(c, "id"),
      toolCallId: str(c, "tool_call_id"),
      idempotencyKey: str(c, "idempotency_key"),
      toolRef: str(c, "tool_ref"),
      status: str(c, "status") as ToolCallStatus,
      attempt: num(c, "attempt"),
    })),
    approvals: list(row, "approvals").map((a) => ({
      id: str(a, "id"),
      toolCallRecordId: optStr(a, "tool_call_record_id"),
      stepId: optStr(a, "step_id"),
    })),
    lastEventId: optStr(row, "last_event_id"),
  };
}

/** Parses the `tool_call` member of a tool-call answer. */
export function parseToolCall(row: Row): ToolCall {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepId: str(row, "step_id"),
    toolCallId: str(row, "tool_call_id"),
    toolRef: str(row, "tool_ref"),
    idempotencyKey: str(row, "idempotency_key"),
    requestHash: str(row, "request_hash"),
    arguments: obj(row, "arguments"),
    status: str(row, "status") as ToolCallStatus,
    attempt: num(row, "attempt"),
    leaseOwner: optStr(row, "lease_owner"),
    leaseSeconds: num(row, "lease_seconds"),
    leaseExpiresAt: optDate(row, "lease_expires_at"),
    outboundStartedAt: optDate(row, "outbound_started_at"),
    resultArtifactId: optStr(row, "result_artifact_id"),
    metadata: obj(row, "metadata"),
    errorCode: optStr(row, "error_code"),
    errorMessage: optStr(row, "error_message"),
    approvalId: optStr(row, "approval_id"),
    completedAt: optDate(row, "completed_at"),
    createdAt: date(row, "created_at"),
    updatedAt: date(row, "updated_at"),
  };
}

/** Parses an approval (a `resolve_approval` answer, or the `approval` of a tool-call answer). */
export function parseApproval(row: Row): Approval {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepId: optStr(row, "step_id"),
    toolCallRecordId: optStr(row, "tool_call_record_id"),
    status: str(row, "status") as ApprovalStatus,
    title: optStr(row, "title"),
    policyRef: optStr(row, "policy_ref"),
    details: obj(row, "details"),
    actor: optStr(row, "actor"),
    note: optStr(row, "note"),
    decidedAt: optDate(row, "decided_at"),
    createdAt: date(row, "created_at"),
    expiresAt: optDate(row, "expires_at"),
  };
}

/** Parses a tool-call function's answer. */
export function parseClaim(answer: unknown): ToolCallClaim {
  const raw = typeof answer === "object" && answer !== null ? (answer as Json) : {};
  const outcome = str(raw, "outcome") as ClaimOutcome;
  const call = value(raw, "tool_call");
  const approval = value(raw, "approval");
  const response = value(raw, "response") as Row | null;
  const budget = value(raw, "budget");
  return {
    outcome,
    toolCall: outcome !== "purged" && call !== null ? parseToolCall(call as Row) : null,
    approval: approval !== null ? parseApproval(approval as Row) : null,
    response:
      response !== null
        ? {
            result: value(response, "result"),
            success: value(response, "success") === true,
            error: optStr(response, "error"),
            metadata: obj(response, "metadata"),
          }
        : null,
    budget: budget !== null ? parseBudget(budget as Row) : null,
    raw,
  };
}

/** Parses a budget: a refusal's JSON, or (with its usage) a `ledger.budget_usage` row. */
export function parseBudget(row: Row): Budget {
  return {
    level: str(row, "level") as BudgetLevel,
    runId: optStr(row, "run_id"),
    unit: str(row, "unit"),
    period: str(row, "period") as BudgetPeriod,
    maxAmount: str(row, "max_amount"),
    spent: str(row, "spent"),
    remaining: str(row, "remaining"),
    windowStart: optDate(row, "window_start"),
    windowEnd: optDate(row, "window_end"),
  };
}

/** Parses a `ledger.budget_usage` row. */
export function parseBudgetUsage(row: Row): BudgetUsage {
  return {
    ...parseBudget(row),
    tenantId: str(row, "tenant_id"),
    workspaceId: optStr(row, "workspace_id"),
    exhausted: value(row, "exhausted") === true,
    warnRatio: optStr(row, "warn_ratio"),
    warned: value(row, "warned") === true,
    updatedBy: optStr(row, "updated_by"),
    updatedAt: date(row, "updated_at"),
  };
}

/** Parses an `events_since` row. */
export function parseEvent(row: Row): RunEvent {
  return {
    eventId: str(row, "event_id"),
    seq: num(row, "seq"),
    eventType: str(row, "event_type"),
    stepId: optStr(row, "step_id"),
    payload: obj(row, "payload"),
    createdAt: date(row, "created_at"),
    endsRun: value(row, "ends_run") === true,
  };
}

/** Parses a `ledger.outbox_event` row. */
export function parseOutboxEvent(row: Row): OutboxEvent {
  return {
    tenantId: str(row, "tenant_id"),
    workspaceId: str(row, "workspace_id"),
    id: str(row, "id"),
    eventType: str(row, "event_type"),
    runId: optStr(row, "run_id"),
    taskId: optStr(row, "task_id"),
    subject: str(row, "subject"),
    payload: obj(row, "payload"),
    status: str(row, "status") as OutboxStatus,
    attemptCount: num(row, "attempt_count"),
    replayCount: num(row, "replay_count"),
    availableAt: date(row, "available_at"),
    leaseExpiresAt: optDate(row, "lease_expires_at"),
    errorMessage: optStr(row, "error_message"),
    occurredAt: date(row, "occurred_at"),
    processedAt: optDate(row, "processed_at"),
  };
}

/** Parses a row of {@link LedgerCalls.toolCallsInDoubt}'s query. */
export function parseToolCallInDoubt(row: Row): ToolCallInDoubt {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepId: optStr(row, "step_id"),
    toolCallId: str(row, "tool_call_id"),
    toolRef: str(row, "tool_ref"),
    idempotencyKey: str(row, "idempotency_key"),
    arguments: obj(row, "arguments"),
    attempt: num(row, "attempt"),
    leaseOwner: optStr(row, "lease_owner"),
    outboundStartedAt: optDate(row, "outbound_started_at"),
    errorCode: optStr(row, "error_code"),
    errorMessage: optStr(row, "error_message"),
    updatedAt: date(row, "updated_at"),
  };
}

/** Parses a row of {@link LedgerCalls.pendingApprovals}'s query. */
export function parsePendingApproval(row: Row): PendingApproval {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepId: optStr(row, "step_id"),
    toolCallRecordId: optStr(row, "tool_call_record_id"),
    toolCallId: optStr(row, "tool_call_id"),
    toolRef: optStr(row, "tool_ref"),
    arguments: value(row, "arguments") === null ? null : obj(row, "arguments"),
    title: optStr(row, "title"),
    policyRef: optStr(row, "policy_ref"),
    details: obj(row, "details"),
    createdAt: date(row, "created_at"),
    expiresAt: optDate(row, "expires_at"),
  };
}

/** Parses a `ledger.inbox` row. */
export function parseInbox(row: Row): Inbox {
  return {
    tenantId: str(row, "tenant_id"),
    workspaceId: str(row, "workspace_id"),
    callsInDoubt: num(row, "calls_in_doubt"),
    oldestInDoubtAt: optDate(row, "oldest_in_doubt_at"),
    pendingApprovals: num(row, "pending_approvals"),
    oldestApprovalAt: optDate(row, "oldest_approval_at"),
    budgetStops: num(row, "budget_stops"),
    oldestBudgetStopAt: optDate(row, "oldest_budget_stop_at"),
    failedOutboxEvents: num(row, "failed_outbox_events"),
    oldestFailedOutboxEventAt: optDate(row, "oldest_failed_outbox_event_at"),
  };
}

/** Parses an item of `run_evidence`'s array (its refs and missing entries as the server wrote them). */
export function parseEvidenceItem(item: unknown): EvidenceItem {
  const row = typeof item === "object" && item !== null ? (item as Row) : {};
  return {
    key: str(row, "key"),
    status: str(row, "status") as EvidenceStatus,
    label: str(row, "label"),
    summary: str(row, "summary"),
    evidenceRefs: list(row, "evidence_refs"),
    missing: list(row, "missing"),
  };
}

/** Parses a `ledger.run_cost_entries` row. */
export function parseCostEntry(row: Row): CostEntry {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    stepId: optStr(row, "step_id"),
    billingBasis: str(row, "billing_basis"),
    billedQuantity: str(row, "billed_quantity"),
    amount: optStr(row, "amount"),
    currency: optStr(row, "currency"),
    usage: obj(row, "usage"),
  };
}

/** Parses a mailbox row: `send_input`'s answer, the `input` of `wait_for_input`'s. */
export function parseMailboxInput(row: Row): MailboxInput {
  return {
    id: str(row, "id"),
    runId: str(row, "run_id"),
    inputKey: str(row, "input_key"),
    payload: value(row, "payload"),
    sender: optStr(row, "sender"),
    receivedAt: optDate(row, "received_at"),
    waitedAt: optDate(row, "waited_at"),
    waitDeadline: optDate(row, "wait_deadline"),
    createdAt: date(row, "created_at"),
  };
}

/** Parses `wait_for_input`'s answer. */
export function parseInputWait(answer: unknown): InputWait {
  const raw = typeof answer === "object" && answer !== null ? (answer as Row) : {};
  const input = value(raw, "input") as Row | null;
  if (input === null) return { status: "timed_out", inputKey: str(raw, "input_key"), input: null };
  return { status: str(raw, "status") as "received" | "waiting", inputKey: str(input, "input_key"), input: parseMailboxInput(input) };
}

/** Parses a child of `wait_for_children`'s answer. */
export function parseChildRun(row: Row): ChildRun {
  return {
    runId: str(row, "run_id"),
    status: str(row, "status") as RunStatus,
    outputSummary: optStr(row, "output_summary"),
    errorCode: optStr(row, "error_code"),
    errorMessage: optStr(row, "error_message"),
  };
}

/** Parses `wait_for_children`'s answer. */
export function parseChildrenWait(answer: unknown): ChildrenWait {
  const raw = typeof answer === "object" && answer !== null ? (answer as Row) : {};
  return { status: str(raw, "status") as ChildrenWait["status"], children: list(raw, "children").map(parseChildRun) };
}

/** Parses a `ledger.schedules` row. */
export function parseSchedule(row: Row): Schedule {
  return {
    id: str(row, "id"),
    cron: str(row, "cron"),
    timeZone: str(row, "time_zone"),
    mode: str(row, "mode"),
    kind: optStr(row, "kind"),
    inputs: value(row, "inputs") === null ? null : obj(row, "inputs"),
    priority: num(row, "priority"),
    concurrencyKey: optStr(row, "concurrency_key"),
    catchUp: str(row, "catch_up") as CatchUp,
    paused: value(row, "paused") === true,
    nextFireAt: optDate(row, "next_fire_at"),
    lastFiredAt: optDate(row, "last_fired_at"),
    lastRunId: optStr(row, "last_run_id"),
    updatedBy: optStr(row, "updated_by"),
    createdAt: date(row, "created_at"),
    updatedAt: date(row, "updated_at"),
  };
}
