/**
 * The scope-aware handle: {@link Ledger} over a `pg.Pool`, {@link ScopedLedger} for one
 * (tenant, workspace), and {@link Transaction}, one transaction of it.
 *
 * Every call of a {@link ScopedLedger} takes a pooled connection, opens a transaction, states the
 * scope with `ledger.set_scope(tenant, workspace, is_local => true)` (transaction-local, so a
 * pooled connection, or a pgbouncer in transaction mode, never carries a scope into someone else's
 * work), makes the call and commits. {@link ScopedLedger.transaction} groups several calls (or any
 * SQL of yours) in one transaction. The typed methods are the same on both: each is one SQL call
 * of the ledger, whose rules the extension enforces.
 */
import pg from "pg";

import { parseConninfo } from "./conninfo.js";
import { toJson } from "./encoding.js";
import { toLedgerError } from "./errors.js";
import { isConnectionError } from "./faults.js";
import {
  parseApproval,
  parseBudgetUsage,
  parseChildrenWait,
  parseClaim,
  parseClaimedRun,
  parseCostEntry,
  parseEvent,
  parseEvidenceItem,
  parseInbox,
  parseInputWait,
  parseMailboxInput,
  parseToolCallInDoubt,
  parseOutboxEvent,
  parsePendingApproval,
  parseRun,
  parseSchedule,
  parseStep,
  type Approval,
  type BudgetLevel,
  type BudgetPeriod,
  type BudgetUsage,
  type CatchUp,
  type ChildrenWait,
  type ClaimedRun,
  type CompleteOutcome,
  type CostEntry,
  type EvidenceItem,
  type Inbox,
  type InputWait,
  type MailboxInput,
  type ToolCallInDoubt,
  type OutboxEvent,
  type PendingApproval,
  type ResolveDecision,
  type Run,
  type RunEvent,
  type RunStatus,
  type Schedule,
  type Step,
  type StepStatus,
  type ToolCallClaim,
} from "./types.js";

/** A row as node-postgres returns it. */
export type Row = Record<string, unknown>;
type Json = { [key: string]: unknown };

/** `snake_case` keys of a caller's options as the SQL's argument names (for JSON batch calls). */
function snakeKeys(options: Json): Json {
  const out: Json = {};
  for (const [key, v] of Object.entries(options)) {
    if (v !== undefined) out[key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)] = v;
  }
  return out;
}

/** A value sent with a cast, so that PostgreSQL picks the right overload and type. */
class Cast {
  constructor(
    readonly value: unknown,
    readonly type: string,
  ) {}
}

/**
 * A JSON argument: serialised by us (node-postgres would send an array as a PostgreSQL array), by
 * the rule of {@link toJson}; a value it cannot encode throws `NotEncodableError` and nothing is sent.
 */
function json(value: unknown): Cast | undefined {
  return value === undefined ? undefined : new Cast(value === null ? null : JSON.stringify(toJson(value)), "jsonb");
}

/**
 * An amount as `numeric`: its decimal text with a cast, read exactly and matching the `numeric`
 * parameter (`record_cost` also has `bigint` and `float8` overloads); null stays null.
 */
function numeric(amount: string | number | null): Cast {
  return new Cast(amount === null ? null : String(amount), "numeric");
}

/**
 * `ledger.<fn>(positional..., name => value...)`: named arguments left `undefined` are not sent,
 * so the function's own default applies.
 */
function call(fn: string, positional: unknown[], named: Record<string, unknown> = {}): { text: string; values: unknown[] } {
  const values: unknown[] = [];
  const placeholder = (v: unknown): string => {
    if (v instanceof Cast) {
      values.push(v.value);
      return `$${values.length}::${v.type}`;
    }
    values.push(v);
    return `$${values.length}`;
  };
  const args = positional.map(placeholder);
  for (const [name, v] of Object.entries(named)) {
    if (v === undefined) continue;
    // Names go into the SQL text: only argument names, never anything a caller slipped in.
    if (!/^[a-z][a-z_]*$/.test(name)) throw new TypeError(`ledger: ${fn} has no argument ${JSON.stringify(name)}`);
    args.push(`${name} => ${placeholder(v)}`);
  }
  return { text: `ledger.${fn}(${args.join(", ")})`, values };
}

/** Options of `create_run` (its named arguments, camelCase). */
export interface CreateRunOptions {
  inputs?: unknown;
  kind?: string;
  subjectKind?: string;
  subjectId?: string;
  subjectVersionId?: string;
  requestId?: string;
  parentRunId?: string;
  sourceRunId?: string;
  attemptNo?: number;
  runId?: string;
  userId?: string;
  traceId?: string;
  inputSummary?: string;
  /** Not claimable (`claimRun`) before this time; absent: at once. */
  notBefore?: Date;
  /** `claimRun` takes the highest priority first: -1000 to 1000, default 0. */
  priority?: number;
  /** The key whose limit (`setConcurrencyLimit`) the run counts against. */
  concurrencyKey?: string;
}

/** Options of `retry_run` and `replay_run`. */
export interface RerunOptions {
  /** The new run is not claimable before this time (a backoff); absent: at once. */
  notBefore?: Date;
}

/** Options of `transition_run`. */
export interface TransitionRunOptions {
  expectedStatus?: RunStatus;
  outputSummary?: string;
  errorCode?: string;
  errorMessage?: string;
  errorStepId?: string;
  runToken?: number;
}

/** Options of `create_step`. */
export interface CreateStepOptions {
  stepKey?: string;
  nodeId?: string;
  inputSummary?: string;
  status?: StepStatus;
  stepId?: string;
  runToken?: number;
}

/** Options of `transition_step`. */
export interface TransitionStepOptions {
  expectedStatus?: StepStatus;
  outputSummary?: string;
  metrics?: Json;
  errorCode?: string;
  errorMessage?: string;
  errorDetails?: unknown;
  runToken?: number;
}

/** Options of `set_budget` besides the unit and the amount. */
export interface SetBudgetOptions {
  /** `workspace` (the scope's, the default), `tenant` (every workspace of it) or `run` (`runId`). */
  level?: BudgetLevel;
  /** The run of a `run` budget. */
  runId?: string;
  /** `total` (the default), `day` or `month` (calendar, UTC): a new window counts from 0. */
  period?: BudgetPeriod;
  /** The share of the amount whose spending writes `budget.warning` once per window (default 0.8); null: no warning. */
  warnRatio?: string | number | null;
  /** Who set it, for the audit record (`budget.set`). */
  actor?: string;
  /** Why, for the audit record (redacted). */
  note?: string;
}

/** Options of `set_schedule` besides the id, the expression and the mode. */
export interface SetScheduleOptions {
  /** Each firing's run's inputs, a JSON object (redacted when set). */
  inputs?: Json;
  /** A name from `pg_timezone_names` the expression is read in; default `UTC`. */
  timeZone?: string;
  kind?: string;
  /** What a sweep does with missed firings: `latest` (the default: one run) or `all` (one each, at most 100 a sweep). */
  catchUp?: CatchUp;
  /** Each firing's run's priority (-1000 to 1000, default 0). */
  priority?: number;
  /** Each firing's run's concurrency key. */
  concurrencyKey?: string;
  /** Who set it, for the audit record (`schedule.set`). */
  actor?: string;
}

/** Options of the people's queues ({@link LedgerCalls.toolCallsInDoubt} and the others). */
export interface QueueOptions {
  /** Only this run's entries. */
  runId?: string;
  /** At most this many, oldest first. */
  limit?: number;
}

/**
 * The row's scope is the caller's (row-level security does not hide other scopes' rows from a
 * superuser; the views check only that a scope is set).
 */
const SCOPED = (alias: string): string =>
  `${alias}.tenant_id = ledger.scope_tenant() AND ${alias}.workspace_id = ledger.scope_workspace()`;

/** The columns of `ledger.outbox_event`: the outbox row without its lease holder. */
const OUTBOX_EVENT_COLUMNS = [
  "tenant_id", "workspace_id", "id", "event_type", "run_id", "task_id", "subject", "payload", "status",
  "attempt_count", "replay_count", "available_at", "lease_expires_at", "error_message", "occurred_at", "processed_at",
];

/** Options of `claim_run`. */
export interface ClaimRunOptions {
  runId?: string;
  modes?: string[];
  kinds?: string[];
  leaseSeconds?: number;
  /** Across scopes (a member of `ledger_operator`): see {@link Ledger.claimRun}. */
  anyScope?: boolean;
}

/** An approval request attached to a claim: `{title, policy_ref, details, expires_in_seconds}`. */
export interface ApprovalRequest {
  title?: string;
  policyRef?: string;
  details?: Json;
  /** The deadline, 1 s to a year: past it undecided the approval expires and the call is rejected. */
  expiresInSeconds?: number;
}

/** Options of `claim_tool_call` besides the run, the tool and its arguments. */
export interface ClaimToolCallOptions {
  toolCallId?: string;
  idempotencyKey?: string;
  stepId?: string;
  leaseOwner?: string;
  timeoutSeconds?: number;
  retryFailed?: boolean;
  approval?: ApprovalRequest;
  runToken?: number;
}

/** The identity a repeatable call is looked up by (`find_tool_call`). */
export interface FindToolCallOptions {
  toolCallId?: string;
  idempotencyKey?: string;
  retryFailed?: boolean;
}

/** How a repeatable call that ran is recorded (`record_tool_call`). */
export interface RecordToolCallOptions extends FindToolCallOptions {
  result?: unknown;
  errorMessage?: string;
  metadata?: Json;
  runToken?: number;
}

/** How a repeatable call ended. */
export type RecordOutcome = "succeeded" | "failed";

/** One call of a model turn, for `claim_tool_calls`. */
export interface ToolCallSpec {
  toolRef: string;
  arguments?: Json;
  toolCallId?: string;
  idempotencyKey?: string;
  stepId?: string;
  timeoutSeconds?: number;
  retryFailed?: boolean;
  approval?: ApprovalRequest;
}

/** Options of `claim_tool_calls`. */
export interface ClaimToolCallsOptions {
  leaseOwner?: string;
  begin?: boolean;
  runToken?: number;
}

/** Options of `record_cost` besides the run, the basis and the quantity. Money as a decimal string where you can. */
export interface RecordCostOptions {
  amount?: string | number;
  currency?: string;
  stepId?: string;
  usage?: Json;
  pricingSnapshot?: Json;
  provider?: string;
  modelRef?: string;
  toolRef?: string;
  sourcePort?: string;
  operation?: string;
  sourceRef?: string;
}

function approvalJson(approval: ApprovalRequest | undefined): Json | undefined {
  return approval === undefined ? undefined : snakeKeys({ ...approval });
}

function one(rows: Row[]): Row {
  const row = rows[0];
  if (row === undefined) throw new Error("ledger: the call returned no row");
  return row;
}

/**
 * The ledger's functions, typed. {@link ScopedLedger} runs each in its own transaction,
 * {@link Transaction} in the current one.
 */
export abstract class LedgerCalls {
  /**
   * Any SQL in the scoped transaction: the escape hatch for what the typed methods do not cover.
   * A ledger error comes back as a {@link LedgerError}.
   */
  abstract query(text: string, values?: unknown[]): Promise<Row[]>;

  /**
   * One function call as one statement: `SELECT <columns> FROM ledger.fn(...)` here, in the
   * current transaction; a {@link ScopedLedger} states the scope in the same statement.
   */
  protected async statement(expr: string, values: unknown[], columns: string | null): Promise<Row[]> {
    return this.query(columns === null ? `SELECT ${expr} AS r` : `SELECT ${columns} FROM ${expr}`, values);
  }

  /** The rows of a function returning rows (a composite or a set). */
  private async select(fn: string, positional: unknown[], named: Record<string, unknown> = {}, columns = "*"): Promise<Row[]> {
    const { text, values } = call(fn, positional, named);
    return this.statement(text, values, columns);
  }

  /** The value of a function returning one value. */
  private async value(fn: string, positional: unknown[], named: Record<string, unknown> = {}): Promise<unknown> {
    const { text, values } = call(fn, positional, named);
    return one(await this.statement(text, values, null))["r"];
  }

  /** `create_run`: a new run (or, with `runId`/`requestId`, the existing one). */
  async createRun(mode: string, options: CreateRunOptions = {}): Promise<Run> {
    const { inputs, ...rest } = options;
    return parseRun(one(await this.select("create_run", [mode], { inputs: json(inputs), ...snakeKeys({ ...rest }) })));
  }

  /**
   * The run's row, or null when it is unknown in this scope. (The scope is in the query too:
   * row-level security does not hide rows from a superuser.)
   */
  async getRun(runId: string): Promise<Run | null> {
    const rows = await this.query(
      "SELECT * FROM ledger.runs WHERE id = $1 AND tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace()",
      [runId],
    );
    const row = rows[0];
    return row === undefined ? null : parseRun(row);
  }

  /** `transition_run`: moves the run through the status machine. */
  async transitionRun(runId: string, toStatus: RunStatus, options: TransitionRunOptions = {}): Promise<Run> {
    return parseRun(one(await this.select("transition_run", [runId, toStatus], snakeKeys({ ...options }))));
  }

  /** `create_step`: a step, found again by `stepKey` (a resumed worker learns which steps are done). */
  async createStep(runId: string, stepType: string, options: CreateStepOptions = {}): Promise<Step> {
    return parseStep(one(await this.select("create_step", [runId, stepType], snakeKeys({ ...options }))));
  }

  /** `transition_step`. */
  async transitionStep(stepId: string, toStatus: StepStatus, options: TransitionStepOptions = {}): Promise<Step> {
    const { metrics, errorDetails, ...rest } = options;
    return parseStep(
      one(
        await this.select("transition_step", [stepId, toStatus], {
          ...snakeKeys({ ...rest }),
          metrics: json(metrics),
          error_details: json(errorDetails),
        }),
      ),
    );
  }

  /**
   * `retry_run`: a new queued attempt of a failed or canceled run (`sourceRunId`, `attemptNo` + 1,
   * `controlAction` `retry`), with the source's inputs unless `inputs` overrides them. Its tool
   * calls with the same `toolCallId` replay the results its lineage recorded.
   */
  async retryRun(runId: string, inputs?: Json, options: RerunOptions = {}): Promise<Run> {
    return parseRun(one(await this.select("retry_run", [runId], { inputs: json(inputs), ...snakeKeys({ ...options }) })));
  }

  /** `replay_run`: like `retryRun`, for a run in any terminal status (`controlAction` `replay`). */
  async replayRun(runId: string, inputs?: Json, options: RerunOptions = {}): Promise<Run> {
    return parseRun(one(await this.select("replay_run", [runId], { inputs: json(inputs), ...snakeKeys({ ...options }) })));
  }

  /** `claim_run`: the oldest claimable run of the scope (or `runId`), or null when there is none. */
  async claimRun(leaseOwner: string, options: ClaimRunOptions = {}): Promise<ClaimedRun | null> {
    const { modes, kinds, ...rest } = options;
    const rows = await this.select("claim_run", [leaseOwner], {
      ...snakeKeys({ ...rest }),
      modes: modes === undefined ? undefined : new Cast(modes, "text[]"),
      kinds: kinds === undefined ? undefined : new Cast(kinds, "text[]"),
    });
    return rows[0] === undefined ? null : parseClaimedRun(rows[0]);
  }

  /** `heartbeat_run`: extends the run's lease; returns when it now ends. */
  async heartbeatRun(runId: string, runToken: number, extendSeconds?: number): Promise<Date> {
    return (await this.value("heartbeat_run", [runId, runToken], { extend_seconds: extendSeconds })) as Date;
  }

  /** `release_run`: gives the run up (claimable at once); the token is over. */
  async releaseRun(runId: string, runToken: number): Promise<void> {
    await this.value("release_run", [runId, runToken]);
  }

  /**
   * `wait_run`: a durable wait. The owner's `preparing` or `running` run moves to `waiting_input`,
   * its lease is given up (`runToken` is over) and `claimRun` hands it out again, with a new token,
   * from `wakeAt` on (one in the past: at once). Returns the run.
   */
  async waitRun(runId: string, runToken: number, wakeAt: Date): Promise<Run> {
    return parseRun(one(await this.select("wait_run", [runId, runToken, wakeAt])));
  }

  /**
   * `next_wake`: when a run of the scope (`anyScope`: of every scope, for a member of
   * `ledger_operator`) next becomes claimable by the clock alone (a wait's or backoff's
   * `notBefore`, a pending approval's deadline, a full rate window's end), or null when none is
   * ahead. Whatever else makes a run claimable notifies `ledger_runs` at commit: an idle worker
   * listens there and sleeps until this time at most.
   */
  async nextWake(options: { anyScope?: boolean } = {}): Promise<Date | null> {
    return (await this.value("next_wake", [], snakeKeys({ ...options }))) as Date | null;
  }

  /**
   * `wait_for_input`: the owner's run waits for input `inputKey`: `received` (the input),
   * `timed_out` (`deadline` passed without it) or `waiting`: parked like `waitRun` (`runToken` is
   * over) until the input arrives or the deadline (none: only the input wakes it). On resume ask
   * again with the same key and deadline.
   */
  async waitForInput(runId: string, runToken: number, inputKey: string, deadline?: Date): Promise<InputWait> {
    return parseInputWait(await this.value("wait_for_input", [runId, runToken, inputKey], { deadline }));
  }

  /**
   * `send_input`: puts `payload` (any JSON value; absent: `{}`) in the run's mailbox under
   * `inputKey` and wakes the run if it waits for it. The same key and payload again return the
   * same input; another payload throws an `IdempotencyMismatchError`.
   */
  async sendInput(runId: string, inputKey: string, payload?: unknown, options: { sender?: string } = {}): Promise<MailboxInput> {
    return parseMailboxInput((await this.value("send_input", [runId, inputKey], { payload: json(payload), ...options })) as Row);
  }

  /**
   * `wait_for_children`: the owner's run waits for its children (runs created with `parentRunId`
   * = `runId`): `done`, `timed_out`, or `waiting` (parked as by `waitForInput` until the last
   * child ends or the deadline); each answer lists the children with how they stand.
   */
  async waitForChildren(runId: string, runToken: number, deadline?: Date): Promise<ChildrenWait> {
    return parseChildrenWait(await this.value("wait_for_children", [runId, runToken], { deadline }));
  }

  /**
   * `set_concurrency_limit`: at most `maxInFlight` runs of `concurrencyKey` in flight (0 pauses
   * the key; null removes the limit). Returns the limit in force.
   */
  async setConcurrencyLimit(concurrencyKey: string, maxInFlight: number | null): Promise<number | null> {
    const limit = await this.value("set_concurrency_limit", [concurrencyKey, maxInFlight]);
    return limit === null ? null : Number(limit);
  }

  /**
   * `set_rate_limit`: at most `maxClaims` claims of `concurrencyKey`'s runs per window of
   * `perSeconds` (default 60; 0 claims pauses the key; null removes the rate). Returns the rate in force.
   */
  async setRateLimit(concurrencyKey: string, maxClaims: number | null, perSeconds?: number): Promise<number | null> {
    const rate = await this.value("set_rate_limit", [concurrencyKey, maxClaims], { per_seconds: perSeconds });
    return rate === null ? null : Number(rate);
  }

  /**
   * `set_budget`: at most `maxAmount` of `unit` (`tokens`, `tool_calls`, `llm_steps` or a currency
   * code) per period; while it is used up, tool-call claims answer `budget_exhausted` and `llm`
   * steps are refused. Amounts are sent as `numeric` (pass decimal strings for money); a null
   * `maxAmount` removes the budget. Returns it as {@link budgets} shows it, or null once removed.
   */
  async setBudget(unit: string, maxAmount: string | number | null, options: SetBudgetOptions = {}): Promise<BudgetUsage | null> {
    const { warnRatio, ...rest } = options;
    const rows = await this.select("set_budget", [unit, numeric(maxAmount)], {
      ...snakeKeys({ ...rest }),
      // Sent when null too (no warning); absent, the SQL default applies.
      warn_ratio: warnRatio === undefined ? undefined : numeric(warnRatio),
    });
    return rows[0] === undefined ? null : parseBudgetUsage(rows[0]);
  }

  /**
   * `ledger.budget_usage`: the scope's budgets (its tenant's, its workspace's, its runs'), or with
   * `runId` those that apply to that run (its tenant's, its workspace's, its own), each as spent in
   * the window of now, the broadest first. A `ledger_reader` may read it.
   */
  async budgets(runId?: string): Promise<BudgetUsage[]> {
    const values: unknown[] = [];
    let text = `SELECT * FROM ledger.budget_usage b
      WHERE b.tenant_id = ledger.scope_tenant() AND (b.workspace_id IS NULL OR b.workspace_id = ledger.scope_workspace())`;
    if (runId !== undefined) {
      values.push(runId);
      text += " AND (b.run_id IS NULL OR b.run_id = $1)";
    }
    return (await this.query(`${text} ORDER BY b.workspace_id NULLS FIRST, b.run_id NULLS FIRST, b.unit, b.period`, values)).map(
      parseBudgetUsage,
    );
  }

  /**
   * `set_schedule`: creates or replaces a schedule; at each time `cron` names (five fields, or
   * `@daily` and the like) in its time zone, `fireSchedules` creates a run of `mode`.
   */
  async setSchedule(scheduleId: string, cron: string, mode: string, options: SetScheduleOptions = {}): Promise<Schedule> {
    const { inputs, ...rest } = options;
    return parseSchedule(one(await this.select("set_schedule", [scheduleId, cron, mode], { inputs: json(inputs), ...snakeKeys({ ...rest }) })));
  }

  /** `pause_schedule`: pauses (or, `paused: false`, resumes) a schedule; resumed, it skips the firings it missed. */
  async pauseSchedule(scheduleId: string, options: { paused?: boolean; actor?: string } = {}): Promise<Schedule> {
    return parseSchedule(one(await this.select("pause_schedule", [scheduleId], snakeKeys({ ...options }))));
  }

  /** `drop_schedule`: removes a schedule (its runs stay); whether it existed. */
  async dropSchedule(scheduleId: string, options: { actor?: string } = {}): Promise<boolean> {
    return (await this.value("drop_schedule", [scheduleId], snakeKeys({ ...options }))) === true;
  }

  /**
   * `fire_schedules`: creates the runs of the scope's due firings (one per firing, however many
   * sweepers fire it); returns how many firings it ran. Every minute, or let pg_cron.
   */
  async fireSchedules(): Promise<number> {
    return Number(await this.value("fire_schedules", []));
  }

  /** `claim_tool_call`: the executor protocol's first step; the outcome is returned, not raised. */
  async claimToolCall(runId: string, toolRef: string, args: Json = {}, options: ClaimToolCallOptions = {}): Promise<ToolCallClaim> {
    const { approval, ...rest } = options;
    return this.answer("claim_tool_call", [runId, toolRef, json(args)], {
      ...snakeKeys({ ...rest }),
      approval: json(approvalJson(approval)),
    });
  }

  /** `claim_tool_calls`: one model turn's calls in one statement; one answer per call, in order. */
  async claimToolCalls(runId: string, calls: ToolCallSpec[], options: ClaimToolCallsOptions = {}): Promise<ToolCallClaim[]> {
    const batch = calls.map(({ approval, ...rest }) => ({
      ...snakeKeys({ ...rest }),
      ...(approval ? { approval: approvalJson(approval) } : {}),
    }));
    const rows = await this.select("claim_tool_calls", [runId, json(batch)], snakeKeys({ ...options }), "index, claim");
    return rows.sort((a, b) => Number(a["index"]) - Number(b["index"])).map((r) => parseClaim(r["claim"]));
  }

  /**
   * `find_tool_call`: a repeatable call's lookup before it runs, writing nothing: `replayed` (the
   * recorded result), `unrecorded` (run it, then {@link recordToolCall}), or a side-effecting call's outcome.
   */
  async findToolCall(runId: string, toolRef: string, args: Json = {}, options: FindToolCallOptions = {}): Promise<ToolCallClaim> {
    return this.answer("find_tool_call", [runId, toolRef, json(args)], snakeKeys({ ...options }));
  }

  /**
   * `record_tool_call`: records a repeatable call that ran (`succeeded` or `failed`) in one
   * statement: `recorded`, or the answer of the record that was first (`replayed`, ...).
   */
  async recordToolCall(
    runId: string,
    toolRef: string,
    args: Json,
    outcome: RecordOutcome,
    options: RecordToolCallOptions = {},
  ): Promise<ToolCallClaim> {
    const { result, metadata, ...rest } = options;
    return this.answer("record_tool_call", [runId, toolRef, json(args), outcome], {
      ...snakeKeys({ ...rest }),
      result: json(result),
      metadata: json(metadata),
    });
  }

  /** `begin_tool_call`: the outbound boundary; commit it before the request leaves. */
  async beginToolCall(toolCallRecordId: string, attempt: number): Promise<ToolCallClaim> {
    return this.answer("begin_tool_call", [toolCallRecordId, attempt]);
  }

  /** `heartbeat_tool_call`: extends the attempt's lease. */
  async heartbeatToolCall(toolCallRecordId: string, attempt: number, extendSeconds?: number): Promise<ToolCallClaim> {
    return this.answer("heartbeat_tool_call", [toolCallRecordId, attempt], { extend_seconds: extendSeconds });
  }

  /** `complete_tool_call`: `succeeded` (result), `failed` (errorMessage) or `unknown` (sent, no answer). */
  async completeToolCall(
    toolCallRecordId: string,
    attempt: number,
    outcome: CompleteOutcome,
    options: { result?: unknown; errorMessage?: string; metadata?: Json } = {},
  ): Promise<ToolCallClaim> {
    return this.answer("complete_tool_call", [toolCallRecordId, attempt, outcome], {
      result: json(options.result),
      error_message: options.errorMessage,
      metadata: json(options.metadata),
    });
  }

  /** `resolve_tool_call`: a person's decision on an in-doubt call. */
  async resolveToolCall(
    toolCallRecordId: string,
    decision: ResolveDecision,
    options: { result?: unknown; actor?: string; note?: string } = {},
  ): Promise<ToolCallClaim> {
    return this.answer("resolve_tool_call", [toolCallRecordId, decision], {
      result: json(options.result),
      actor: options.actor,
      note: options.note,
    });
  }

  /**
   * `request_tool_approval`: a call that waits for a person's decision; with `expiresInSeconds`
   * (1 s to a year) the approval expires unless decided by then, and the call is rejected.
   */
  async requestToolApproval(
    runId: string,
    toolRef: string,
    args: Json,
    options: {
      toolCallId?: string;
      idempotencyKey?: string;
      title?: string;
      policyRef?: string;
      details?: Json;
      runToken?: number;
      expiresInSeconds?: number;
    } = {},
  ): Promise<ToolCallClaim> {
    const { details, ...rest } = options;
    return this.answer("request_tool_approval", [runId, toolRef, json(args)], { ...snakeKeys({ ...rest }), details: json(details) });
  }

  /**
   * `resolve_approval`: `approved` or `rejected`, by whom and why. Past the approval's deadline
   * either throws a `WrongStateError` with `code` `APPROVAL_EXPIRED`.
   */
  async resolveApproval(
    approvalId: string,
    decision: "approved" | "rejected",
    options: { actor?: string; note?: string } = {},
  ): Promise<Approval> {
    return parseApproval((await this.value("resolve_approval", [approvalId, decision], snakeKeys({ ...options }))) as Row);
  }

  /** `record_cost`. Quantities and amounts are sent as `numeric`: exact, whatever their JS type. */
  async recordCost(
    runId: string,
    billingBasis: string,
    billedQuantity: string | number,
    options: RecordCostOptions = {},
  ): Promise<CostEntry> {
    const { amount, usage, pricingSnapshot, ...rest } = options;
    return parseCostEntry(
      one(
        await this.select("record_cost", [runId, billingBasis, numeric(billedQuantity)], {
          amount: amount === undefined ? undefined : numeric(amount),
          usage: json(usage),
          pricing_snapshot: json(pricingSnapshot),
          ...snakeKeys({ ...rest }),
        }),
      ),
    );
  }

  /** `record_response_event`: what the run showed its user. Returns the response event's id. */
  async recordResponseEvent(runId: string, eventType: string, payload: Json = {}, stepId?: string): Promise<string> {
    const row = one(await this.select("record_response_event", [runId, eventType, json(payload)], { step_id: stepId }, "id"));
    return String(row["id"]);
  }

  /** `events_since`: the run's events after the cursor (exclusive), in seq order. */
  async eventsSince(runId: string, afterEventId: string | null = null, maxEvents?: number): Promise<RunEvent[]> {
    return (await this.select("events_since", [runId, afterEventId], { max_events: maxEvents })).map(parseEvent);
  }

  /** `run_channel`: the run's LISTEN/NOTIFY channel. */
  async runChannel(runId: string): Promise<string> {
    return String(await this.value("run_channel", [runId]));
  }

  /** `claim_outbox_events`: due events of the scope under a lease. Delivery is at least once. */
  async claimOutboxEvents(leaseOwner: string, options: { maxEvents?: number; leaseSeconds?: number } = {}): Promise<OutboxEvent[]> {
    return (await this.select("claim_outbox_events", [leaseOwner], snakeKeys({ ...options }))).map(parseOutboxEvent);
  }

  /** `ack_outbox_events`: the held events become done; returns how many. */
  async ackOutboxEvents(leaseOwner: string, eventIds: string[]): Promise<number> {
    return Number(await this.value("ack_outbox_events", [leaseOwner, new Cast(eventIds, "text[]")]));
  }

  /** `nack_outbox_events`: a failed delivery; each event is due again after its backoff. */
  async nackOutboxEvents(leaseOwner: string, eventIds: string[], errorMessage: string): Promise<OutboxEvent[]> {
    return (await this.select("nack_outbox_events", [leaseOwner, new Cast(eventIds, "text[]"), errorMessage])).map(parseOutboxEvent);
  }

  /**
   * `replay_outbox_event(event_id, actor, note)`: a failed event pending again with another 64
   * attempts, and in the same transaction the audit record (`outbox.replay`, `replayed`) naming
   * `actor` (required: empty is 22023 `ARGUMENT_REQUIRED`) and `note`.
   */
  async replayOutboxEvent(eventId: string, options: { actor: string; note?: string }): Promise<OutboxEvent> {
    return parseOutboxEvent(one(await this.select("replay_outbox_event", [eventId, options.actor], { note: options.note })));
  }

  /**
   * The people's queue of calls in doubt (`ledger.tool_calls_in_doubt`), oldest first, with each
   * call's arguments as stored (redacted) from `ledger.run_step_tool_calls`, which the view does
   * not show; `runId` narrows it to one run. A `ledger_reader` may read it.
   */
  async toolCallsInDoubt(options: QueueOptions = {}): Promise<ToolCallInDoubt[]> {
    return (
      await this.queue(
        `SELECT d.*, t.arguments FROM ledger.tool_calls_in_doubt d
           JOIN ledger.run_step_tool_calls t ON t.id = d.id AND ${SCOPED("t")}`,
        "d",
        "d.updated_at, d.id",
        options,
      )
    ).map(parseToolCallInDoubt);
  }

  /**
   * The people's queue of approvals (`ledger.pending_approvals`, with the call's arguments as
   * stored, redacted), oldest first, with the call's `tool_call_id` from
   * `ledger.run_step_tool_calls`. A `ledger_reader` may read it.
   */
  async pendingApprovals(options: QueueOptions = {}): Promise<PendingApproval[]> {
    return (
      await this.queue(
        `SELECT p.*, t.tool_call_id FROM ledger.pending_approvals p
           JOIN ledger.approval_requests a ON a.id = p.id AND ${SCOPED("a")}
           LEFT JOIN ledger.run_step_tool_calls t ON t.id = p.tool_call_record_id AND ${SCOPED("t")}`,
        "p",
        "p.created_at, p.id",
        options,
      )
    ).map(parsePendingApproval);
  }

  /**
   * The outbox events that failed their attempts (status `failed`), oldest first: each waits for a
   * person's {@link replayOutboxEvent} once its cause is fixed. A `ledger_reader` may read it.
   */
  async failedOutboxEvents(options: QueueOptions = {}): Promise<OutboxEvent[]> {
    const columns = OUTBOX_EVENT_COLUMNS.map((c) => `o.${c}`).join(", ");
    return (
      await this.queue(`SELECT ${columns} FROM ledger.outbox o WHERE o.status = 'failed' AND ${SCOPED("o")}`, "o", "o.occurred_at, o.id", options, true)
    ).map(parseOutboxEvent);
  }

  /**
   * `ledger.inbox`: what waits for people in the scope, one row (zeros when nothing waits): the
   * queues above and the runs a budget still used up stopped, counted, with the oldest one's time.
   * `anyScope`: a row for every scope the session may state that has something waiting (a member
   * of `ledger_operator`, else 42501 `OPERATOR_REQUIRED`), as `ledger.inbox()`. A reader may call it.
   */
  async inbox(): Promise<Inbox>;
  async inbox(options: { anyScope: true }): Promise<Inbox[]>;
  async inbox(options: { anyScope?: boolean } = {}): Promise<Inbox | Inbox[]> {
    const rows = await this.select("inbox", [], snakeKeys({ ...options }));
    return options.anyScope === true ? rows.map(parseInbox) : parseInbox(one(rows));
  }

  private async queue(select: string, alias: string, order: string, options: QueueOptions, hasWhere = false): Promise<Row[]> {
    const values: unknown[] = [];
    let text = select;
    if (options.runId !== undefined) {
      values.push(options.runId);
      text += ` ${hasWhere ? "AND" : "WHERE"} ${alias}.run_id = $${values.length}`;
    }
    text += ` ORDER BY ${order}`;
    if (options.limit !== undefined) {
      values.push(options.limit);
      text += ` LIMIT $${values.length}`;
    }
    return this.query(text, values);
  }

  /**
   * `sweep_tool_calls`: expired leases to in_doubt (or claimable), and approvals past their
   * deadline expired (their calls rejected); returns how many.
   */
  async sweepToolCalls(): Promise<number> {
    return Number(await this.value("sweep_tool_calls", []));
  }

  /** `replay_bundle`: everything about a run, as documented jsonb. */
  async replayBundle(runId: string): Promise<Json> {
    return (await this.value("replay_bundle", [runId])) as Json;
  }

  /** `run_evidence`: the run's thirteen governance items, in order. */
  async runEvidence(runId: string): Promise<EvidenceItem[]> {
    const items = await this.value("run_evidence", [runId]);
    return Array.isArray(items) ? items.map(parseEvidenceItem) : [];
  }

  /** `otel_trace`: the run as an OpenTelemetry trace, OTLP/JSON (for a collector's `/v1/traces`). */
  async otelTrace(runId: string, serviceName = "ledger"): Promise<Json> {
    return (await this.value("otel_trace", [runId], { service_name: serviceName })) as Json;
  }

  /** `replay_ready`: whether the run can be replayed (`status` pass, or what is missing). */
  async replayReady(runId: string): Promise<Json> {
    return (await this.value("replay_ready", [runId])) as Json;
  }

  private async answer(fn: string, positional: unknown[], named: Record<string, unknown> = {}): Promise<ToolCallClaim> {
    return parseClaim(await this.value(fn, positional, named));
  }
}

/**
 * One transaction of a {@link ScopedLedger}: every call runs in it. (Over a dedicated client, its
 * session; over a pool, each call on its own, as the cross-scope calls of {@link Ledger} do.)
 */
export class Transaction extends LedgerCalls {
  constructor(private readonly client: pg.PoolClient | pg.Client | pg.Pool) {
    super();
  }

  override async query(text: string, values: unknown[] = []): Promise<Row[]> {
    try {
      return (await this.client.query<Row>(text, values)).rows;
    } catch (error) {
      throw toLedgerError(error);
    }
  }
}

/**
 * A pooled connection for `fn`, given back after it; one that broke (a lost connection, found by
 * `isConnectionError` or by the driver's `error` event) is discarded, so a retry gets a fresh one.
 */
async function withClient<T>(pool: pg.Pool, fn: (client: pg.PoolClient) => Promise<T>): Promise<T> {
  const client = await pool.connect();
  // A connection that breaks between our statements must not crash the process (pg emits
  // 'error' on a checked-out client that has no query running); the next query fails instead.
  let broken: Error | undefined;
  const onError = (error: Error): void => {
    broken = error;
  };
  client.on("error", onError);
  try {
    return await fn(client);
  } catch (error) {
    if (isConnectionError(error)) broken ??= error as Error;
    throw error;
  } finally {
    client.removeListener("error", onError);
    client.release(broken ?? false);
  }
}

/**
 * The ledger of one (tenant, workspace). Each typed method is one statement in its own (implicit)
 * transaction that states the scope transaction-locally and calls the function: one round trip.
 */
export class ScopedLedger extends LedgerCalls {
  constructor(
    readonly ledger: Ledger,
    readonly tenant: string,
    readonly workspace: string,
  ) {
    super();
  }

  /**
   * Runs `fn` in one transaction with the scope set transaction-locally, commits, and returns what
   * it returned; rolls back if it throws. Do not wait for anything slow inside (a tool, a model):
   * the transaction holds a pooled connection and the rows it wrote stay locked.
   */
  async transaction<T>(fn: (tx: Transaction) => Promise<T>): Promise<T> {
    return withClient(this.ledger.pool, async (client) => {
      try {
        // BEGIN and the scope in one round trip (a simple query takes no parameters: literals).
        await client.query(
          `BEGIN; SELECT ledger.set_scope(${client.escapeLiteral(this.tenant)}, ${client.escapeLiteral(this.workspace)}, is_local => true)`,
        );
        const out = await fn(new Transaction(client));
        await client.query("COMMIT");
        return out;
      } catch (error) {
        await client.query("ROLLBACK").catch(() => undefined);
        throw toLedgerError(error);
      }
    });
  }

  /** One statement of yours in its own scoped transaction. */
  override async query(text: string, values: unknown[] = []): Promise<Row[]> {
    return this.transaction((tx) => tx.query(text, values));
  }

  /**
   * The call and the scope in one statement. The scope is stated in the FROM clause and the call
   * made in the select list, so that it runs after the scope is set (an order PostgreSQL keeps for
   * a select list, not among FROM items); `OFFSET 0` keeps a row-returning call from being run
   * once per output column.
   */
  protected override async statement(expr: string, values: unknown[], columns: string | null): Promise<Row[]> {
    const n = values.length;
    const scope = `ledger.set_scope($${n + 1}, $${n + 2}, is_local => true)`;
    const text =
      columns === null
        ? `SELECT ${expr} AS r FROM ${scope}`
        : `SELECT ${columns} FROM (SELECT (call.c).* FROM (SELECT ${expr} AS c FROM ${scope} OFFSET 0) AS call) AS q`;
    try {
      return await withClient(this.ledger.pool, async (client) => (await client.query<Row>(text, [...values, this.tenant, this.workspace])).rows);
    } catch (error) {
      throw toLedgerError(error);
    }
  }
}

/** The ledger over a node-postgres pool. */
export class Ledger {
  /**
   * @param pool the pool the handles take their connections from (yours: size and close it as you
   *   like, and listen to its `error` event).
   */
  constructor(readonly pool: pg.Pool) {}

  /**
   * A ledger over a new pool for `dsn`: a URL (`postgresql://...`) or a libpq conninfo
   * (`host=/run/postgresql port=5432 user=app dbname=app`). Idle connections the server drops
   * (a restart) are discarded silently; {@link close} ends the pool.
   */
  static connect(dsn: string, options: pg.PoolConfig = {}): Ledger {
    const pool = new pg.Pool({ ...parseConninfo(dsn), ...options });
    pool.on("error", () => {
      // An idle client died (server restart, pg_terminate_backend): the pool already dropped it.
    });
    return new Ledger(pool);
  }

  /**
   * `claim_run(..., any_scope => true)`: the oldest claimable run of every scope, for a worker pool
   * serving many tenants (a member of `ledger_operator`, else 42501 `OPERATOR_REQUIRED`). The run
   * comes back with its scope: drive it through `scoped(run.tenantId, run.workspaceId)`.
   */
  async claimRun(leaseOwner: string, options: Omit<ClaimRunOptions, "runId" | "anyScope"> = {}): Promise<ClaimedRun | null> {
    return new Transaction(this.pool).claimRun(leaseOwner, { ...options, anyScope: true });
  }

  /**
   * `next_wake(any_scope => true)`: when a run of any scope next becomes claimable by the clock
   * alone, or null (a member of `ledger_operator`, else 42501 `OPERATOR_REQUIRED`).
   */
  async nextWake(): Promise<Date | null> {
    return new Transaction(this.pool).nextWake({ anyScope: true });
  }

  /**
   * `inbox(any_scope => true)`: what waits for people in every scope that has something waiting,
   * by tenant and workspace (a member of `ledger_operator`, else 42501 `OPERATOR_REQUIRED`).
   */
  async inbox(): Promise<Inbox[]> {
    return new Transaction(this.pool).inbox({ anyScope: true });
  }

  /**
   * `fire_schedules(any_scope => true)`: the due firings of every scope's schedules (a member of
   * `ledger_operator`); returns how many it ran.
   */
  async fireSchedules(): Promise<number> {
    const [row] = await new Transaction(this.pool).query("SELECT ledger.fire_schedules(any_scope => true) AS n");
    return Number(row?.["n"]);
  }

  /** The handle of one (tenant, workspace). */
  scoped(tenant: string, workspace: string): ScopedLedger {
    return new ScopedLedger(this, tenant, workspace);
  }

  /** Ends the pool. */
  async close(): Promise<void> {
    await this.pool.end();
  }
}
