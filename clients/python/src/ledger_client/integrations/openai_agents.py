"""The OpenAI Agents SDK (``openai-agents``) on the ledger.

- :func:`guard` wraps a ``FunctionTool``: the model's ``call_id`` is the ledger's ``tool_call_id``
  and each call goes through :func:`~ledger_client.tool_call_async` (claimed and begun before the
  tool runs, completed after; a repeat replays the recorded result). The same guard sets the
  tool's ``needs_approval`` to a question to the ledger, so a call that waits for a person (its
  approval pending, or in doubt, or held by another attempt) pauses the run as the SDK's own
  ``ToolApprovalItem`` interruption.
- :func:`run_agent` drives one ledger run: it runs the agent with a :class:`LedgerRun` as the
  context, saves a paused ``RunState`` as an artifact of the run, resumes it (in any process)
  with the ledger's decisions applied, and records the final output as the run's response event.
- :class:`LedgerTracingProcessor` records the run's model calls (``llm`` steps with their usage
  as costs), handoffs, guardrails and the function calls the guard did not claim, written by a
  background thread so that the SDK's thread never waits for the database.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    RunConfig,
    RunContextWrapper,
    Runner,
    RunHooks,
    RunState,
    ToolApprovalItem,
    TracingProcessor,
    get_current_span,
)
from agents.tool_context import ToolContext
from agents.tracing import Span, Trace
from agents.tracing.span_data import (
    FunctionSpanData,
    GenerationSpanData,
    GuardrailSpanData,
    HandoffSpanData,
    ResponseSpanData,
)
from psycopg.types.json import Jsonb

from .._faults import again, is_transient
from ..aio import AsyncScopedLedger, tool_call_async
from ..client import Ledger
from ..encoding import encode
from ..errors import LedgerError
from ..tool_calls import BudgetExhausted, Busy, InDoubt, Purged, Rejected, ToolCallStopped, ToolFailed, WaitingApproval
from ..types import RunStatus, StepStatus
from ..worker import ModelReply

__all__ = [
    "STATE_KIND", "AgentOutcome", "Approval", "LedgerRun", "LedgerTracingProcessor", "Waiting", "apply_decisions",
    "flush_processors", "guard", "ledger_run_of", "load_state", "run_agent", "save_state", "stopped_output",
]

log = logging.getLogger("ledger_client.integrations.openai_agents")

STATE_KIND = "openai_agents.run_state"
"""``meta.kind`` of the artifacts that hold a paused run's ``RunState`` (``to_string()``)."""


@dataclass
class LedgerRun:
    """The ledger run an agent run is, passed as the ``context`` of ``Runner.run``
    (:func:`run_agent` does): the guard and the approvals find the run there; ``data`` is the
    application's own context. ``lease_owner`` and ``run_token`` are passed to the ledger's
    writes when a worker claimed the run (``claim_run``); None: not fenced."""

    ledger: AsyncScopedLedger
    run_id: str
    lease_owner: str | None = None
    run_token: int | None = None
    data: Any = None

    def trace_metadata(self) -> dict[str, str]:
        """What :class:`LedgerTracingProcessor` reads from a trace to find its run."""
        return {"ledger_run_id": self.run_id, "ledger_tenant_id": self.ledger.tenant_id,
                "ledger_workspace_id": self.ledger.workspace_id}


def ledger_run_of(ctx: RunContextWrapper[Any]) -> LedgerRun:
    """The :class:`LedgerRun` of an agent run: its context, or the context's ``ledger_run``."""
    context = ctx.context
    run = context if isinstance(context, LedgerRun) else getattr(context, "ledger_run", None)
    if not isinstance(run, LedgerRun):
        raise TypeError("ledger: the agent run's context is no LedgerRun and has no ledger_run attribute;"
                        " pass context=LedgerRun(...) to Runner.run, or use run_agent")
    return run


Approval = Mapping[str, Any] | Callable[[dict[str, Any]], Mapping[str, Any] | None]
"""A call's approval request (``{title, policy_ref, details, expires_in_seconds}``), or a function
of the call's arguments that returns one (None: this call needs no approval)."""

# An approval past its deadline reads expired before a sweep expires it: no one may decide it any more.
_RECORD = """SELECT tc.id, tc.status, tc.lease_expires_at > now() AS live, a.id AS approval_id,
                    CASE WHEN a.status = 'pending' AND a.expires_at <= clock_timestamp() THEN 'expired'
                         ELSE a.status END AS approval, a.note
               FROM ledger.run_step_tool_calls tc LEFT JOIN ledger.approval_requests a ON a.id = tc.approval_id
              WHERE tc.run_id = %s AND tc.tool_call_id = %s"""


async def _record(run: LedgerRun, call_id: str) -> dict[str, Any] | None:
    """The run's record of the call, with its approval, or None."""
    rows = await run.ledger.execute(_RECORD, (run.run_id, call_id))
    return dict(rows[0]) if rows else None


def _decision(record: Mapping[str, Any]) -> str:
    """What the ledger says of a known call: ``run`` (the guard's claim executes or replays it),
    ``reject``, or ``wait`` (a person acts first: an approval pending, a call in doubt, or an
    attempt that may still be sending it)."""
    status = record["status"]
    if status == "rejected" or record["approval"] in ("rejected", "expired"):
        return "reject"
    if status in ("succeeded", "failed"):
        return "run"
    if status == "waiting_approval":
        return "run" if record["approval"] == "approved" else "wait"
    if status == "claimed":  # never begun: free once its lease is gone (a person's retry releases it)
        return "wait" if record["live"] else "run"
    return "wait"  # running (begun: the request may have left) or in_doubt


def _approval_for(approval: Approval | None, arguments: dict[str, Any]) -> Mapping[str, Any] | None:
    return approval(arguments) if callable(approval) else approval


# The function spans in which the guard claimed its call (the newest ones: a span ends right
# after its call): the tracing processor leaves them to the tool-call record instead of recording
# them twice.
_CLAIMED_SPANS: dict[str, None] = {}
_CLAIMED_SPANS_KEPT = 10_000
_CLAIMED_SPANS_LOCK = threading.Lock()  # agents may run on several event loops, in threads


def _claimed_here() -> None:
    """Marks the current function span as the guard's (its call, or its pause for a person)."""
    span = get_current_span()
    if span is None or not isinstance(span.span_data, FunctionSpanData):
        return
    with _CLAIMED_SPANS_LOCK:
        _CLAIMED_SPANS[span.span_id] = None
        while len(_CLAIMED_SPANS) > _CLAIMED_SPANS_KEPT:
            del _CLAIMED_SPANS[next(iter(_CLAIMED_SPANS))]

_STOPPED_TEXT: dict[type[ToolCallStopped], str] = {
    InDoubt: "the call may have been sent and no answer was recorded: it is not executed again;"
             " a person resolves it (ledger.resolve_tool_call)",
    Busy: "another attempt holds the call: it is not executed now",
    WaitingApproval: "the call waits for a person's approval (ledger.resolve_approval)",
    Rejected: "a person rejected the call: it was not executed",
    Purged: "the run was purged: the call is not executed",
    BudgetExhausted: "a budget that applies to the run is used up: the call is not executed;"
                     " a person raises it (ledger.set_budget)",
    ToolFailed: "the call failed before and is not executed again",
}


def stopped_output(stopped: ToolCallStopped) -> str:
    """The tool output the model sees when the ledger has no result for the call: a JSON object
    naming the outcome and the record (``tool_call_record_id``) a person looks at."""
    record = stopped.tool_call
    text = next(t for kind, t in _STOPPED_TEXT.items() if isinstance(stopped, kind))
    output: dict[str, Any] = {"error": f"ledger: {text}", "outcome": str(stopped.outcome),
                              "tool_call_id": record.tool_call_id if record else None,
                              "tool_call_record_id": record.id if record else None}
    if isinstance(stopped, ToolFailed):
        output["recorded_error"] = stopped.error
    if stopped.approval is not None and stopped.approval.note:
        output["note"] = stopped.approval.note
    return json.dumps(output)


def guard(
    tool: FunctionTool,
    *,
    tool_ref: str | None = None,
    approval: Approval | None = None,
    timeout_seconds: int = 30,
    in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
) -> FunctionTool:
    """A copy of ``tool`` whose calls go through the ledger (see the module's docstring).

    ``tool_ref`` names the tool in the ledger (the tool's name by default); ``approval`` makes a
    call wait for a person's approval in the ledger (a tool made with ``needs_approval=True``
    asks one titled with its name); ``timeout_seconds`` sets the call's lease;
    ``in_doubt_on``: exceptions of the tool that mean the request left without an answer (they
    reach the guard only from a tool made with ``failure_error_function=None``).
    """
    if callable(tool.needs_approval):
        raise ValueError(f"ledger: tool {tool.name}: its needs_approval is a function; give guard(approval=...)"
                         " instead, so that the ledger asks and a person decides there")
    if approval is None and tool.needs_approval is True:
        approval = {"title": tool.name}
    ref = tool_ref or tool.name
    invoke = tool.on_invoke_tool

    async def needs_approval(ctx: RunContextWrapper[Any], arguments: dict[str, Any], call_id: str) -> bool:
        run = ledger_run_of(ctx)
        _claimed_here()
        record = await _record(run, call_id)
        if record is not None:
            return _decision(record) != "run"
        wanted = _approval_for(approval, arguments)
        if wanted is None:
            return False
        await run.ledger.request_tool_approval(run.run_id, ref, arguments, tool_call_id=call_id,
                                               title=wanted.get("title"), policy_ref=wanted.get("policy_ref"),
                                               details=wanted.get("details"), run_token=run.run_token,
                                               expires_in_seconds=wanted.get("expires_in_seconds"))
        return True

    async def on_invoke_tool(ctx: ToolContext[Any], input: str) -> Any:
        try:
            arguments = json.loads(input) if input.strip() else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return await invoke(ctx, input)  # the SDK refuses the input: the tool's body never runs
        run = ledger_run_of(ctx)
        _claimed_here()
        try:
            return await tool_call_async(run.ledger, run.run_id, ctx.tool_call_id, ref, arguments,
                                         lambda _: invoke(ctx, input), lease_owner=run.lease_owner,
                                         timeout_seconds=timeout_seconds, approval=_approval_for(approval, arguments),
                                         run_token=run.run_token, in_doubt_on=in_doubt_on)
        except ToolCallStopped as stopped:
            return stopped_output(stopped)

    guarded = copy.copy(tool)
    guarded.on_invoke_tool = on_invoke_tool
    guarded.needs_approval = needs_approval
    return guarded


@dataclass(frozen=True)
class Waiting:
    """An interruption of a paused run that waits for a person: the SDK's ``item``, and the
    ledger's record of the call (``status`` ``waiting_approval``, ``in_doubt``, ``running`` or
    ``claimed``; all None when the ledger has no record: an interruption of an unguarded tool)."""

    item: ToolApprovalItem
    tool_call_record_id: str | None
    status: str | None
    approval_id: str | None


@dataclass(frozen=True)
class AgentOutcome:
    """How :func:`run_agent` left the run: ``succeeded`` with its ``final_output``, or parked
    (``waiting_approval``, ``paused``) on ``waiting``."""

    status: RunStatus
    final_output: Any = None
    waiting: tuple[Waiting, ...] = ()


async def apply_decisions(state: RunState[Any], run: LedgerRun) -> list[Waiting]:
    """Approves (``state.approve``) the interruptions the ledger lets run (approved, resolved,
    finished, released for a retry), rejects (``state.reject``) those a person rejected or whose
    approval expired, and returns the others."""
    waiting = []
    for item in state.get_interruptions():
        call_id = item.call_id
        record = await _record(run, call_id) if call_id else None
        decision = _decision(record) if record is not None else "wait"
        if decision == "run":
            state.approve(item)
        elif decision == "reject":
            assert record is not None
            note = f": {record['note']}" if record["note"] else ""
            if record["approval"] == "expired":
                told = f"the approval of tool call {call_id} ({record['id']}) expired before anyone decided it"
            else:
                told = f"a person rejected tool call {call_id} ({record['id']}){note}"
            state.reject(item, rejection_message=f"ledger: {told}; it was not executed")
        else:
            known = record or {}
            waiting.append(Waiting(item, known.get("id"), known.get("status"), known.get("approval_id")))
    return waiting


async def save_state(state: RunState[Any], run: LedgerRun) -> str:
    """Stores the paused run's ``RunState`` as a ``json`` artifact of the run; returns its id."""
    text = state.to_string(context_serializer=lambda context: {"ledger_run_id": ledger_run_of(
        RunContextWrapper(context)).run_id})
    rows = await run.ledger.execute(
        "SELECT id FROM ledger.put_artifact(%s, %s, 'json', 'application/json', meta => %s)",
        (run.run_id, text.encode(), Jsonb({"kind": STATE_KIND})))
    return str(rows[0]["id"])


async def load_state(agent: Agent[Any], run: LedgerRun) -> RunState[Any] | None:
    """The run's last saved ``RunState``, its context the given ``run``; None if none was saved."""
    rows = await run.ledger.execute(
        "SELECT ledger.get_artifact(id) AS content FROM ledger.run_artifacts"
        " WHERE run_id = %s AND meta->>'kind' = %s ORDER BY created_at DESC, id DESC LIMIT 1",
        (run.run_id, STATE_KIND))
    if not rows:
        return None
    return await RunState.from_string(agent, bytes(rows[0]["content"]).decode(), context_override=RunContextWrapper(run))


def _text(final_output: Any) -> str:
    return final_output if isinstance(final_output, str) else json.dumps(encode(final_output))


async def run_agent(
    agent: Agent[Any],
    input: str,
    run: LedgerRun,
    *,
    max_turns: int = 10,
    run_config: RunConfig | None = None,
    hooks: RunHooks[Any] | None = None,
) -> AgentOutcome:
    """Drives the ledger run ``run`` with ``agent``: resumed from the run's last saved
    ``RunState`` (the ledger's decisions applied) or started on ``input``; a pause saves the
    state and parks the run (``waiting_approval``, or ``paused`` for a call in doubt or held);
    the final output is recorded as a ``message`` response event and ends the run ``succeeded``;
    an exception out of ``Runner.run`` ends it ``failed`` (a lost connection leaves it as it is)
    and propagates. Call it again, in any process, once a person decided; on a run that succeeded it runs nothing
    and returns the recorded answer (``output_summary``)."""
    current = await run.ledger.get_run(run.run_id)
    if current is not None and current.status is RunStatus.SUCCEEDED:
        return AgentOutcome(RunStatus.SUCCEEDED, current.output_summary)
    state = await load_state(agent, run)
    unsaved = False
    config = dataclasses.replace(run_config or RunConfig(),
                                 trace_metadata={**((run_config and run_config.trace_metadata) or {}),
                                                 **run.trace_metadata()})
    await run.ledger.transition_run(run.run_id, RunStatus.RUNNING, run_token=run.run_token)
    while True:
        if state is not None:
            waiting = await apply_decisions(state, run)
            if waiting:
                if unsaved:
                    await save_state(state, run)
                return await _park(run, waiting)
        try:
            result = await Runner.run(agent, state if state is not None else input,
                                      context=None if state is not None else run,
                                      max_turns=max_turns, run_config=config, hooks=hooks)
        except Exception as e:
            await flush_processors()  # the ledger takes no step for an ended run
            if not is_transient(e):  # a lost connection is not the agent's failure: resumed later
                await _fail(run, e)
            raise
        await flush_processors()
        if not result.interruptions:
            break
        state, unsaved = result.to_state(), True
    text = _text(result.final_output)
    async with run.ledger.transaction() as tx:  # what the user is shown, and the end, at once
        await tx.record_response_event(run.run_id, "message", {"text": text})
        await tx.transition_run(run.run_id, RunStatus.SUCCEEDED, output_summary=text, run_token=run.run_token)
    return AgentOutcome(RunStatus.SUCCEEDED, result.final_output)


async def _fail(run: LedgerRun, error: Exception) -> None:
    try:
        await run.ledger.transition_run(run.run_id, RunStatus.FAILED, error_code=type(error).__name__,
                                        error_message=str(error) or repr(error), run_token=run.run_token)
    except LedgerError as e:  # taken over (LEASE_STALE) or moved by someone: the ledger keeps its status
        log.warning("run %s: not moved to failed (%s) after %r", run.run_id, e, error)


async def _park(run: LedgerRun, waiting: Sequence[Waiting]) -> AgentOutcome:
    status = (RunStatus.WAITING_APPROVAL if any(w.status in (None, "waiting_approval") for w in waiting)
              else RunStatus.PAUSED)
    async with run.ledger.transaction() as tx:
        await tx.transition_run(run.run_id, status, run_token=run.run_token)
        if run.run_token is not None:
            await tx.release_run(run.run_id, run.run_token)
    return AgentOutcome(status, waiting=tuple(waiting))


# Every live processor, so that run_agent can wait for what they have to write of its run.
_PROCESSORS: weakref.WeakSet[LedgerTracingProcessor] = weakref.WeakSet()


async def flush_processors() -> None:
    """Waits (off the event loop) until every :class:`LedgerTracingProcessor` wrote what it was given."""
    await asyncio.gather(*(asyncio.to_thread(p.force_flush) for p in list(_PROCESSORS)))


@dataclass(frozen=True)
class _Write:
    """One span, as a step (and a cost) of a run."""

    scope: tuple[str, str]
    run_id: str
    step_type: str
    step_key: str
    input_summary: str | None
    output_summary: str | None
    error: str | None = None
    reply: ModelReply | None = None


def _usage(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The SDK's span usage in the names ``record_cost`` takes (``requests`` is ``request_count``;
    of the breakdowns, the counts the ledger has a key for)."""
    if not raw:
        return {}
    usage: dict[str, Any] = {k: raw[k] for k in ("input_tokens", "output_tokens", "total_tokens")
                             if isinstance(raw.get(k), int)}
    if isinstance(raw.get("requests"), int):
        usage["request_count"] = raw["requests"]
    for details, key in (("input_tokens_details", "cached_tokens"), ("output_tokens_details", "reasoning_tokens")):
        counts = raw.get(details)
        if isinstance(counts, Mapping) and isinstance(counts.get(key), int):
            usage[details] = {key: counts[key]}
    return usage


def _summary(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:2000]


class LedgerTracingProcessor(TracingProcessor):
    """Records the spans of traces whose metadata names a ledger run (:meth:`LedgerRun.trace_metadata`,
    which :func:`run_agent` sets) into that run, each span once (its step is keyed by the span id):

    - a generation or response span: an ``llm`` step with its usage as a ``tokens`` cost
      (``provider`` and the span's model);
    - a handoff: a ``handoff`` step (``from -> to``); a guardrail: a ``guardrail`` step (triggered
      or passed);
    - a function call the guard did not claim: a ``function`` step (a guarded call is the
      tool-call record already).

    The SDK calls a processor on the thread that ends the span (the agent's event loop): this one
    only queues the span; one background thread writes it, a transaction per span. Register it
    with ``add_trace_processor`` (or ``set_trace_processors([...])`` to send traces nowhere else).
    """

    def __init__(self, ledger: Ledger, *, provider: str | None = "openai") -> None:
        self._ledger = ledger
        self._provider = provider
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        _PROCESSORS.add(self)

    def on_trace_start(self, trace: Trace) -> None:
        pass

    def on_trace_end(self, trace: Trace) -> None:
        pass

    def on_span_start(self, span: Span[Any]) -> None:
        pass

    def on_span_end(self, span: Span[Any]) -> None:
        write = self._write_of(span)
        if write is None:
            return
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ledger tracing", daemon=True)
                self._thread.start()
        self._queue.put(write)

    def force_flush(self) -> None:
        """Returns once every span queued so far is written (or failed and logged)."""
        self._queue.join()

    def shutdown(self) -> None:
        with self._start:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _write_of(self, span: Span[Any]) -> _Write | None:
        meta = span.trace_metadata or {}
        run_id, tenant_id, workspace_id = (meta.get(k) for k in ("ledger_run_id", "ledger_tenant_id", "ledger_workspace_id"))
        data = span.span_data
        if not (run_id and tenant_id and workspace_id):
            return None
        if isinstance(data, FunctionSpanData) and span.span_id in _CLAIMED_SPANS:
            return None
        error = span.error["message"] if span.error else None
        key = f"openai-agents:{span.span_id}"
        scope = (str(tenant_id), str(workspace_id))
        if isinstance(data, (GenerationSpanData, ResponseSpanData)):
            output: Any
            if isinstance(data, GenerationSpanData):
                model, output = data.model, data.output
            else:
                model = data.response.model if data.response is not None else None
                output = data.response.output_text if data.response is not None else None
            reply = ModelReply(_summary(output) or "", _usage(data.usage), model_ref=model, provider=self._provider)
            return _Write(scope, run_id, "llm", key, model, reply.text or None, error, reply)
        if isinstance(data, HandoffSpanData):
            return _Write(scope, run_id, "handoff", key, f"{data.from_agent} -> {data.to_agent}", data.to_agent, error)
        if isinstance(data, GuardrailSpanData):
            return _Write(scope, run_id, "guardrail", key, data.name, "triggered" if data.triggered else "passed", error)
        if isinstance(data, FunctionSpanData):
            return _Write(scope, run_id, "function", key, f"tool={data.name}", _summary(data.output), error)
        return None

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                if write is None:
                    return
                again(f"run {write.run_id}: span {write.step_key}", lambda: self._record(write))
            except Exception as e:  # a span is evidence, never the agent's failure: logged, not raised
                log.warning("run %s: span %s not recorded: %s", write and write.run_id, write and write.step_key, e)
            finally:
                self._queue.task_done()

    def _record(self, w: _Write) -> None:
        with self._ledger.scoped(*w.scope).transaction() as tx:
            step = tx.create_step(w.run_id, w.step_type, step_key=w.step_key, input_summary=w.input_summary,
                                  status=StepStatus.RUNNING)
            if step.status.terminal:
                return  # written before (a repeat after a lost commit)
            if w.reply is not None:
                tx.record_cost(w.run_id, "tokens", w.reply.tokens, step_id=step.id, usage=w.reply.usage,
                               provider=w.reply.provider, model_ref=w.reply.model_ref, source_ref=step.id)
            tx.transition_step(step.id, StepStatus.FAILED if w.error else StepStatus.SUCCEEDED,
                               output_summary=w.output_summary, error_message=w.error,
                               metrics={"model_ref": w.reply.model_ref} if w.reply and w.reply.model_ref else None)
