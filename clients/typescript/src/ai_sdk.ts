/**
 * The ledger under the Vercel AI SDK (`ai` 7): `ledger-client/ai-sdk`. The core client never
 * imports `ai`; only this module does.
 *
 * One {@link LedgerAi} serves one ledger run (one user turn of a conversation: {@link LedgerAi.start}
 * finds it again by its request id). Its parts go into `generateText` / `streamText`:
 * - {@link LedgerAi.tools}: each tool's `execute` goes through the client's {@link toolCall}, keyed
 *   by the SDK's `toolCallId`: claimed → the tool runs between begin and complete; replayed → the
 *   recorded result, nothing runs; in doubt, busy, waiting for approval, rejected → the
 *   {@link ToolCallStopped} error, whose message names the ledger's record (the SDK turns it into a
 *   `tool-error` part; {@link LedgerAi.stopWhen} ends the loop there);
 * - {@link LedgerAi.toolApproval}: the SDK's `toolApproval`, decided by ledger approvals;
 * - {@link LedgerAi.telemetry}: each model call an `llm` step with its token usage as a cost;
 * - {@link LedgerAi.finish}: the final text as the run's response event and its end, or the run
 *   parked when a call waits for a person.
 */
import type { LanguageModelUsage, StopCondition, Telemetry, ToolApprovalResponse, ToolApprovalStatus, ToolSet } from "ai";

import type { ApprovalRequest, CreateRunOptions, ScopedLedger } from "./client.js";
import { InDoubtError, ToolCallStopped, WaitingApprovalError } from "./errors.js";
import { reconnecting } from "./faults.js";
import { succeedWith } from "./reply.js";
import { toolCall } from "./tool_calls.js";
import type { Run, ToolCallClaim } from "./types.js";

type Json = { [key: string]: unknown };

/**
 * Which calls of a tool need a person's approval: `true` (every call), an {@link ApprovalRequest}
 * (every call, with its title, policy and details), or a function of the call's input returning
 * one of these, or `false`/`undefined` for a call that runs without.
 */
export type ApprovalPolicy = boolean | ApprovalRequest | ((input: unknown) => boolean | ApprovalRequest | undefined);

/** Options of {@link LedgerAi}. */
export interface LedgerAiOptions {
  /** The tools whose calls need a person's approval, by tool name. */
  approvals?: Record<string, ApprovalPolicy>;
  /**
   * The key a call is found again by, instead of the run and its `toolCallId`: for a real model,
   * which names its calls anew when a turn is generated again (after a crash before the tool
   * call reached the messages), derive it from the tool and its input, e.g.
   * `({ toolName, input }) => \`${toolName}:${JSON.stringify(input)}\``. Undefined: the default key.
   */
  idempotencyKey?: (call: { toolName: string; toolCallId: string; input: unknown }) => string | undefined;
  /** A tool's time in seconds, after which its signal aborts and the call is in doubt; default 30. */
  timeoutSeconds?: number;
  /** Seconds between a running call's lease heartbeats; default a third of its lease. */
  heartbeatSeconds?: number;
  /** Who holds the calls' leases (shown to a person); default the ledger's. */
  leaseOwner?: string;
  /** The run owner's fencing token, when the run was claimed (`claim_run`). */
  runToken?: number;
  /** What a model call cost, from its usage: `amount` (a decimal string) and `currency`; default none (tokens only). */
  price?: (
    usage: LanguageModelUsage,
    model: { provider: string; modelId: string },
  ) => { amount: string | number; currency: string } | undefined;
}

/** What {@link LedgerAi.finish} did with the run. */
export type FinishOutcome =
  | { status: "succeeded"; text: string }
  /** A call waits for a person: in doubt (`paused`) or for an approval (`waiting_approval`). */
  | { status: "paused" | "waiting_approval"; reason: string }
  /** A call is busy (another executor's live attempt): nothing was changed; call again later. */
  | { status: "busy"; reason: string };

/** The part of a `generateText` result {@link LedgerAi.finish} reads. */
export interface GenerationResult {
  text: string;
  steps: ReadonlyArray<{ content: ReadonlyArray<{ type: string; isAutomatic?: boolean }> }>;
}

/** The parts of `result.responseMessages` that {@link LedgerAi.approvalResponses} reads. */
interface MessagePart {
  type: string;
  approvalId?: string;
  isAutomatic?: boolean;
  toolCallId?: string;
  toolName?: string;
  input?: unknown;
}

/** The tool's input as the call's JSON arguments: an object as it is, anything else as `{input}`. */
function argumentsOf(input: unknown): Json {
  return typeof input === "object" && input !== null && !Array.isArray(input) ? (input as Json) : { input };
}

/** A tool's final output: what `execute` returned, or the last value it streamed. */
async function finalOutput(output: unknown): Promise<unknown> {
  const value = await output;
  if (typeof value !== "object" || value === null || !(Symbol.asyncIterator in value)) return value;
  let last: unknown;
  for await (const chunk of value as AsyncIterable<unknown>) last = chunk;
  return last;
}

/** A stopped call's message names its ledger record and what a person does about it. */
function explain(error: ToolCallStopped): ToolCallStopped {
  const call = error.claim.toolCall;
  const record = call ? `ledger tool call ${call.id} of run ${call.runId}` : "the ledger's tool call";
  const approval = error.claim.approval;
  const todo =
    error instanceof InDoubtError
      ? `: the request may have left; a person decides what it did: ledger.resolve_tool_call('${call?.id ?? ""}', ...)`
      : error instanceof WaitingApprovalError
        ? `: waits for approval ${approval?.id ?? ""} (ledger.resolve_approval)`
        : error.outcome === "busy"
          ? ": another executor holds its lease; try again later"
          : "";
  error.message = `${error.message} (${record})${todo}`;
  return error;
}

/** The ledger's side of one run driven by the AI SDK. */
export class LedgerAi {
  /** Model calls recorded per generation (the SDK's `callId`), for their step keys. */
  private readonly modelCalls = new Map<string, number>();
  /** A cost that could not be recorded (the SDK swallows a telemetry error): thrown by {@link finish}. */
  private telemetryError: unknown;
  /**
   * The calls the ledger stopped for a person (in doubt, waiting for approval) or found busy, by
   * `toolCallId`, until the same call goes through. Kept here because the SDK hands a tool's error
   * to the model as text when it runs an approved call before the first step.
   */
  private readonly interrupted = new Map<string, ToolCallStopped>();

  constructor(
    readonly ledger: ScopedLedger,
    readonly runId: string,
    readonly options: LedgerAiOptions = {},
  ) {}

  /**
   * The run of `requestId` (a conversation turn's stable id: the same on every resume), created
   * on the first call with `options` (`createRun`'s), found again after; moved to `running` from
   * `queued`, `paused` or `waiting_approval`. Returns its {@link LedgerAi}.
   */
  static async start(
    ledger: ScopedLedger,
    requestId: string,
    options: CreateRunOptions & { mode?: string } & LedgerAiOptions = {},
  ): Promise<LedgerAi> {
    const { approvals, idempotencyKey, timeoutSeconds, heartbeatSeconds, leaseOwner, runToken, price, mode, ...create } = options;
    const run: Run = await reconnecting(() => ledger.createRun(mode ?? "agent", { kind: "ai-sdk", ...create, requestId }));
    if (run.status === "queued" || run.status === "paused" || run.status === "waiting_approval") {
      await reconnecting(() => ledger.transitionRun(run.id, "running", { expectedStatus: run.status }));
    }
    const own: LedgerAiOptions = {
      ...(approvals !== undefined ? { approvals } : {}),
      ...(idempotencyKey !== undefined ? { idempotencyKey } : {}),
      ...(timeoutSeconds !== undefined ? { timeoutSeconds } : {}),
      ...(heartbeatSeconds !== undefined ? { heartbeatSeconds } : {}),
      ...(leaseOwner !== undefined ? { leaseOwner } : {}),
      ...(runToken !== undefined ? { runToken } : {}),
      ...(price !== undefined ? { price } : {}),
    };
    return new LedgerAi(ledger, run.id, own);
  }

  /** The approval a call of `toolName` with `input` asks for, or undefined when it needs none. */
  private approvalFor(toolName: string, input: unknown): ApprovalRequest | undefined {
    const policy = this.options.approvals?.[toolName];
    const decided = typeof policy === "function" ? policy(input) : policy;
    if (decided === undefined || decided === false) return undefined;
    return decided === true ? { title: toolName } : decided;
  }

  /**
   * The tools with each `execute` under the ledger (a tool without `execute` is left as it is):
   * called once per `toolCallId` whoever asks again; its `abortSignal` aborts at the call's timeout
   * too. The tool's name is the ledger's `tool_ref`.
   */
  tools<T extends ToolSet>(tools: T): T {
    const wrapped: Record<string, unknown> = {};
    for (const [name, tool] of Object.entries(tools)) {
      const execute = tool.execute;
      if (execute === undefined) {
        wrapped[name] = tool;
        continue;
      }
      wrapped[name] = {
        ...tool,
        execute: async (input: unknown, options: Parameters<typeof execute>[1]) => {
          const approval = this.approvalFor(name, input);
          try {
            const output = await toolCall(this.ledger, {
              runId: this.runId,
              toolRef: name,
              arguments: argumentsOf(input),
              toolCallId: options.toolCallId,
              ...this.keyOf(name, options.toolCallId, input),
              execute: (_args, signal) => finalOutput(execute(input, { ...options, abortSignal: signal })),
              ...(approval !== undefined ? { approval } : {}),
              ...(options.abortSignal !== undefined ? { signal: options.abortSignal } : {}),
              ...this.callOptions(),
            });
            this.interrupted.delete(options.toolCallId);
            return output;
          } catch (error) {
            if (!(error instanceof ToolCallStopped)) throw error;
            if (error instanceof InDoubtError || error instanceof WaitingApprovalError || error.outcome === "busy") {
              this.interrupted.set(options.toolCallId, error);
            }
            throw explain(error);
          }
        },
      };
    }
    return wrapped as T;
  }

  /** The call's `idempotencyKey` option, when {@link LedgerAiOptions.idempotencyKey} names one. */
  private keyOf(toolName: string, toolCallId: string, input: unknown): { idempotencyKey?: string } {
    const key = this.options.idempotencyKey?.({ toolName, toolCallId, input });
    return key !== undefined ? { idempotencyKey: key } : {};
  }

  private callOptions(): { timeoutSeconds?: number; heartbeatSeconds?: number; leaseOwner?: string; runToken?: number } {
    const { timeoutSeconds, heartbeatSeconds, leaseOwner, runToken } = this.options;
    return {
      ...(timeoutSeconds !== undefined ? { timeoutSeconds } : {}),
      ...(heartbeatSeconds !== undefined ? { heartbeatSeconds } : {}),
      ...(leaseOwner !== undefined ? { leaseOwner } : {}),
      ...(runToken !== undefined ? { runToken } : {}),
    };
  }

  /** The ledger's answer to an approval for the call: asked for on the first time, its state after. */
  private async requestApproval(toolName: string, toolCallId: string, input: unknown, approval: ApprovalRequest): Promise<ToolCallClaim> {
    const { title, policyRef, details, expiresInSeconds } = approval;
    const runToken = this.options.runToken;
    return reconnecting(() =>
      this.ledger.requestToolApproval(this.runId, toolName, argumentsOf(input), {
        toolCallId,
        ...this.keyOf(toolName, toolCallId, input),
        ...(title !== undefined ? { title } : {}),
        ...(policyRef !== undefined ? { policyRef } : {}),
        ...(details !== undefined ? { details } : {}),
        ...(expiresInSeconds !== undefined ? { expiresInSeconds } : {}),
        ...(runToken !== undefined ? { runToken } : {}),
      }),
    );
  }

  /**
   * The SDK's `toolApproval`: for a call that needs approval ({@link LedgerAiOptions.approvals}),
   * the ledger's approval request is made (or found again): `'user-approval'` while it is pending,
   * `'approved'` / `'denied'` once a person decided (`ledger.resolve_approval`), with the
   * decision's actor and note as the reason. Any other call: `'not-applicable'`.
   */
  readonly toolApproval = async ({
    toolCall: call,
  }: {
    toolCall: { toolName: string; toolCallId: string; input: unknown };
  }): Promise<ToolApprovalStatus> => {
    const approval = this.approvalFor(call.toolName, call.input);
    if (approval === undefined) return "not-applicable";
    const answer = await this.requestApproval(call.toolName, call.toolCallId, call.input, approval);
    return approvalStatus(answer);
  };

  /**
   * For a continuation with a real model (whose next turn would name new tool calls): the
   * `tool-approval-response` parts for the manual approval requests of `responseMessages` (what
   * the SDK returned) that a person has decided in the ledger. Append them to the messages as a
   * `{ role: "tool", content }` message and call `generateText` again: an approved call runs
   * (claimed by the ledger, whatever the message says), a rejected one reaches the model as denied.
   */
  async approvalResponses(responseMessages: ReadonlyArray<{ role: string; content: unknown }>): Promise<ToolApprovalResponse[]> {
    const responses: ToolApprovalResponse[] = [];
    const parts = responseMessages.flatMap((m) => (Array.isArray(m.content) ? (m.content as MessagePart[]) : []));
    for (const part of parts) {
      if (part.type !== "tool-approval-request" || part.isAutomatic || part.approvalId === undefined) continue;
      const call = parts.find((p) => p.type === "tool-call" && p.toolCallId === part.toolCallId);
      if (call?.toolName === undefined || call.toolCallId === undefined) continue;
      const approval = this.approvalFor(call.toolName, call.input) ?? {};
      const answer = await this.requestApproval(call.toolName, call.toolCallId, call.input, approval);
      const status = approvalStatus(answer);
      if (typeof status !== "object" || status.type === "user-approval") continue;
      responses.push({
        type: "tool-approval-response",
        approvalId: part.approvalId,
        approved: status.type === "approved",
        ...(status.reason !== undefined ? { reason: status.reason } : {}),
      });
    }
    return responses;
  }

  /**
   * The SDK's `stopWhen` condition that ends the loop at a step with a call the ledger stopped (in
   * doubt, busy, waiting for approval): no model call on an error a person must settle first.
   * Combine it with your own: `stopWhen: [isStepCount(5), ledger.stopWhen]`.
   */
  readonly stopWhen: StopCondition<ToolSet> = () => this.interrupted.size > 0;

  /**
   * A telemetry integration (`telemetry: { integrations: [ledger.telemetry] }`): each model call
   * an `llm` step, succeeded, with its token usage recorded as a cost (basis `tokens`, the usage,
   * the provider and model; `amount` from {@link LedgerAiOptions.price}), in one transaction. A
   * repeated generation is billed again: its model calls were made again.
   */
  readonly telemetry: Telemetry = {
    onLanguageModelCallEnd: async (event) => {
      const n = (this.modelCalls.get(event.callId) ?? 0) + 1;
      this.modelCalls.set(event.callId, n);
      const usage = event.usage;
      const input = usage.inputTokens ?? 0;
      const output = usage.outputTokens ?? 0;
      const price = this.options.price?.(usage, { provider: event.provider, modelId: event.modelId });
      try {
        await reconnecting(() =>
          this.ledger.transaction(async (tx) => {
            const step = await tx.createStep(this.runId, "llm", { stepKey: `ai-sdk:${event.callId}:${n}`, status: "succeeded" });
            // A repeat after a lost connection finds the step: its cost is keyed on it.
            await tx.recordCost(this.runId, "tokens", usage.totalTokens ?? input + output, {
              stepId: step.id,
              sourceRef: step.id,
              usage: { input_tokens: input, output_tokens: output, total_tokens: usage.totalTokens ?? input + output },
              provider: event.provider,
              modelRef: event.modelId,
              ...(price !== undefined ? { amount: price.amount, currency: price.currency } : {}),
            });
          }),
        );
      } catch (error) {
        this.telemetryError ??= error;
      }
    },
  };

  /**
   * Ends the turn: when no call waits for a person, the final `text` is recorded as the run's
   * `message` response event and the run succeeds (in one transaction); a call in doubt parks the
   * run `paused`, a pending approval `waiting_approval` (a person decides in the console or SQL;
   * the next {@link start} resumes it); a busy call changes nothing. Throws what
   * {@link telemetry} could not record.
   */
  async finish(result: GenerationResult): Promise<FinishOutcome> {
    if (this.telemetryError !== undefined) throw this.telemetryError;
    const runToken = this.options.runToken;
    const fenced = runToken !== undefined ? { runToken } : {};
    const stops = [...this.interrupted.values()];
    const stopped = stops.find((e) => e instanceof InDoubtError) ?? stops.find((e) => e instanceof WaitingApprovalError);
    const pending = result.steps.some((s) => s.content.some((p) => p.type === "tool-approval-request" && !p.isAutomatic));
    const busy = stops.find((e) => e.outcome === "busy");
    if (stopped === undefined && busy !== undefined) return { status: "busy", reason: busy.message };
    if (stopped !== undefined || pending) {
      const parked = stopped instanceof InDoubtError ? "paused" : "waiting_approval";
      await reconnecting(() => this.ledger.transitionRun(this.runId, parked, fenced));
      return { status: parked, reason: stopped?.message ?? "a tool call waits for a person's approval" };
    }
    await succeedWith(this.ledger, this.runId, result.text, runToken);
    return { status: "succeeded", text: result.text };
  }
}

/** The SDK's approval status for the ledger's answer to an approval request. */
function approvalStatus(answer: ToolCallClaim): Exclude<ToolApprovalStatus, undefined> {
  const approval = answer.approval;
  const by = approval?.actor ? ` by ${approval.actor}` : "";
  const note = approval?.note ? `: ${approval.note}` : "";
  if (answer.outcome === "rejected") return { type: "denied", reason: `${approval?.status ?? "rejected"}${by}${note}` };
  if (approval?.status === "pending") {
    return { type: "user-approval", reason: `ledger approval ${approval.id} (ledger.resolve_approval)` };
  }
  if (approval?.status === "approved") return { type: "approved", reason: `approved${by}${note}` };
  // Replayed, in doubt or busy: the call's execute answers that.
  return "not-applicable";
}
