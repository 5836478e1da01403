"""The ledger under LangGraph and LangChain: an at-most-once guard of a ``ToolNode``'s (or a
``create_agent``'s) tool calls, model calls recorded as ``llm`` steps with their costs, and the
answer as a response event (manual: clients/python/docs/langgraph.md).

A ledger run is one invocation of a graph's thread, named by the caller's request id:
:func:`start_run` creates it (or finds it again, on a resume in another process) and returns the
config to invoke the graph with; :func:`finish_run` records the answer and ends it. The guard
reads the run from ``config["configurable"]["ledger_run_id"]`` and keys each call by the model's
tool-call id. A call that needs a person (in doubt, waiting for an approval) becomes
``interrupt(...)``; the person decides in the ledger, and a ``Command(resume=...)`` claims again:
the ledger's answer, not the resume value, decides what happens next.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from decimal import Decimal
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, ToolCall as ModelToolCall, ToolMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, interrupt

from .._faults import again
from ..aio import AsyncScopedLedger, tool_call_async
from ..client import ScopedLedger
from ..errors import LedgerError
from ..tool_calls import InDoubt, Rejected, ToolCallStopped, ToolFailed, WaitingApproval, tool_call
from ..types import RunStatus, Step, StepStatus
from ..worker import ModelReply, default_lease_owner, record_reply

RUN_ID_KEY = "ledger_run_id"
"""Where the guard finds the ledger run: ``config["configurable"][RUN_ID_KEY]``."""

Approvals = Mapping[str, Mapping[str, Any]] | Callable[[ModelToolCall], Mapping[str, Any] | None]
"""Which calls wait for a person: tool name -> ``{title, policy_ref, details, expires_in_seconds}``,
or a function of the model's tool call returning that (None: no approval)."""

Price = Callable[[str | None, Mapping[str, Any]], Decimal | None]
"""A model call's price from its model name and usage (None: not priced)."""

Outcome = ToolMessage | Command[Any]
Handler = Callable[[ToolCallRequest], Outcome]
AsyncHandler = Callable[[ToolCallRequest], Awaitable[Outcome]]


class _ErrorMessage(Exception):
    """The tool answered with an error message (``status="error"``): the call is completed
    ``failed`` with its text, and the message goes to the model as the framework made it."""

    def __init__(self, message: ToolMessage) -> None:
        super().__init__(message.text)
        self.message = message


def _recorded(outcome: Outcome) -> Any:
    """What the ledger records of the tool's answer: the message's content. A ``Command`` has no
    JSON form: the encoding rule refuses it and the call ends in doubt (see the manual)."""
    if isinstance(outcome, ToolMessage):
        if outcome.status == "error":
            raise _ErrorMessage(outcome)
        return outcome.content
    return outcome


def _message(call: ModelToolCall, content: Any, *, error: bool = False) -> ToolMessage:
    """A message for the model in place of an execution (a replayed result, a refusal)."""
    text = content if isinstance(content, (str, list)) else json.dumps(content, ensure_ascii=False)
    return ToolMessage(content=text, tool_call_id=_call_id(call), name=call["name"],
                       status="error" if error else "success")


class LedgerToolGuard:
    """Executes each tool call at most once, whoever asks again (see the module's docstring).

    ``ToolNode(tools, wrap_tool_call=guard, awrap_tool_call=guard.awrap_tool_call)``, or
    ``create_agent(..., middleware=[guard.middleware()])``. ``ledger`` serves the sync face,
    ``aledger`` the async one (give the one your graph runs with, or both). Parameters: the manual.
    """

    def __init__(
        self,
        ledger: ScopedLedger | None = None,
        *,
        aledger: AsyncScopedLedger | None = None,
        approvals: Approvals | None = None,
        tools: Collection[str] | None = None,
        run_id: Callable[[ToolCallRequest], str] | None = None,
        timeout_seconds: int = 30,
        retry_failed: bool = False,
        lease_owner: str | None = None,
        in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
    ) -> None:
        if ledger is None and aledger is None:
            raise TypeError("LedgerToolGuard needs a ledger (sync graphs) or an aledger (async graphs)")
        self.ledger = ledger
        self.aledger = aledger
        self.approvals = approvals
        self.tools = tools
        self.run_id = run_id or _configured_run_id
        self.timeout_seconds = timeout_seconds
        self.retry_failed = retry_failed
        self.lease_owner = lease_owner or default_lease_owner()
        self.in_doubt_on = in_doubt_on

    def __call__(self, request: ToolCallRequest, handler: Handler) -> Outcome:
        return self.wrap_tool_call(request, handler)

    def _guarded(self, request: ToolCallRequest) -> bool:
        return self.tools is None or request.tool_call["name"] in self.tools

    def _approval(self, call: ModelToolCall) -> Mapping[str, Any] | None:
        if self.approvals is None:
            return None
        if callable(self.approvals):
            return self.approvals(call)
        return self.approvals.get(call["name"])

    def _options(self, call: ModelToolCall) -> dict[str, Any]:
        """What both faces pass to the client's tool-call helper."""
        return {"lease_owner": self.lease_owner, "timeout_seconds": self.timeout_seconds,
                "approval": self._approval(call), "retry_failed": self.retry_failed, "in_doubt_on": self.in_doubt_on}

    def wrap_tool_call(self, request: ToolCallRequest, handler: Handler) -> Outcome:
        """The sync wrapper (``ToolNode(wrap_tool_call=...)``)."""
        if not self._guarded(request):
            return handler(request)
        if self.ledger is None:
            raise TypeError("LedgerToolGuard: a sync graph needs the guard's ledger (a ScopedLedger)")
        ledger, call, run_id = self.ledger, request.tool_call, self.run_id(request)
        while True:
            executed: list[Outcome] = []

            def execute(_: dict[str, Any]) -> Any:
                executed.append(handler(request))
                return _recorded(executed[0])

            try:
                result = tool_call(ledger, run_id, _call_id(call), call["name"], call["args"], execute,
                                   **self._options(call))
            except (_ErrorMessage, ToolCallStopped) as stopped:
                waiting = _answer(call, stopped)
                if isinstance(waiting, ToolMessage):
                    return waiting
                _park(ledger, run_id, waiting)
                interrupt(_payload(run_id, call, waiting))
                continue  # resumed: the ledger's answer now decides
            return executed[0] if executed else _message(call, result)

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncHandler) -> Outcome:
        """The async wrapper (``ToolNode(awrap_tool_call=...)``)."""
        if not self._guarded(request):
            return await handler(request)
        if self.aledger is None:
            raise TypeError("LedgerToolGuard: an async graph needs the guard's aledger (an AsyncScopedLedger)")
        ledger, call, run_id = self.aledger, request.tool_call, self.run_id(request)
        while True:
            executed: list[Outcome] = []

            async def execute(_: dict[str, Any]) -> Any:
                executed.append(await handler(request))
                return _recorded(executed[0])

            try:
                result = await tool_call_async(ledger, run_id, _call_id(call), call["name"], call["args"], execute,
                                               **self._options(call))
            except (_ErrorMessage, ToolCallStopped) as stopped:
                waiting = _answer(call, stopped)
                if isinstance(waiting, ToolMessage):
                    return waiting
                await _apark(ledger, run_id, waiting)
                interrupt(_payload(run_id, call, waiting))
                continue
            return executed[0] if executed else _message(call, result)

    def middleware(self) -> Any:
        """The guard as LangChain's ``AgentMiddleware`` (``create_agent(middleware=[...])``);
        needs the ``langchain`` package."""
        from langchain.agents.middleware import AgentMiddleware

        guard = self

        class LedgerToolMiddleware(AgentMiddleware):
            def wrap_tool_call(self, request: ToolCallRequest, handler: Handler) -> Outcome:
                return guard.wrap_tool_call(request, handler)

            async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncHandler) -> Outcome:
                return await guard.awrap_tool_call(request, handler)

        return LedgerToolMiddleware()


def _call_id(call: ModelToolCall) -> str:
    if not call["id"]:
        raise ValueError(f"LedgerToolGuard: the model's call of {call['name']} has no id (the ledger keys a call by it)")
    return call["id"]


def _configured_run_id(request: ToolCallRequest) -> str:
    run_id = (request.runtime.config.get("configurable") or {}).get(RUN_ID_KEY)
    if not run_id:
        raise LookupError(f"LedgerToolGuard: the graph's config has no configurable[{RUN_ID_KEY!r}]"
                          " (invoke it with start_run's config)")
    return str(run_id)


def _answer(call: ModelToolCall, stopped: _ErrorMessage | ToolCallStopped) -> ToolMessage | ToolCallStopped:
    """The message the model gets for a call that ran with an error or will not run, or the stop
    that a person must decide first (in doubt, waiting for approval: interrupt). ``Busy`` and
    ``Purged`` are raised: nothing to tell the model yet."""
    if isinstance(stopped, _ErrorMessage):
        return stopped.message
    if isinstance(stopped, Rejected):
        approval = stopped.approval
        who = f" by {approval.actor}" if approval is not None and approval.actor else ""
        note = f": {approval.note}" if approval is not None and approval.note else ""
        return _message(call, f"The call was rejected{who}{note}. It was not executed.", error=True)
    if isinstance(stopped, ToolFailed):
        return _message(call, f"The call failed: {stopped.error}", error=True)
    if isinstance(stopped, (InDoubt, WaitingApproval)):
        return stopped
    raise stopped


def _payload(run_id: str, call: ModelToolCall, stopped: ToolCallStopped) -> dict[str, Any]:
    """The interrupt's value: what a person (or a UI) needs to decide, the call as the ledger stored it."""
    record = stopped.tool_call
    payload: dict[str, Any] = {
        "ledger": stopped.outcome.value, "run_id": run_id, "tool_call_id": call["id"], "tool": call["name"],
        "tool_call_record_id": record.id if record is not None else None,
        "arguments": record.arguments if record is not None else None, "message": str(stopped),
    }
    if isinstance(stopped, WaitingApproval) and stopped.approval is not None:
        approval = stopped.approval
        payload |= {"approval_id": approval.id, "title": approval.title, "policy_ref": approval.policy_ref,
                    "details": approval.details,
                    "decide": f"SELECT ledger.resolve_approval('{approval.id}', 'approved' | 'rejected', actor => ..., note => ...)"}
    elif record is not None:
        payload["decide"] = (f"SELECT ledger.resolve_tool_call('{record.id}', 'succeeded' | 'failed' | 'retry',"
                             " result => ..., actor => ..., note => ...)")
    return payload


def _parked(stopped: ToolCallStopped) -> RunStatus:
    return RunStatus.WAITING_APPROVAL if isinstance(stopped, WaitingApproval) else RunStatus.PAUSED


def _park(ledger: ScopedLedger, run_id: str, stopped: ToolCallStopped) -> None:
    """Shows the run waiting for a person (the console's runs); a parallel call may have parked it first."""
    run = ledger.get_run(run_id)
    if run is not None and run.status is RunStatus.RUNNING:
        try:
            ledger.transition_run(run_id, _parked(stopped), expected_status=RunStatus.RUNNING)
        except LedgerError:
            pass  # moved meanwhile (another call of the turn parked it): it waits either way


async def _apark(ledger: AsyncScopedLedger, run_id: str, stopped: ToolCallStopped) -> None:
    run = await ledger.get_run(run_id)
    if run is not None and run.status is RunStatus.RUNNING:
        try:
            await ledger.transition_run(run_id, _parked(stopped), expected_status=RunStatus.RUNNING)
        except LedgerError:
            pass  # as in _park


class LedgerCallbackHandler(BaseCallbackHandler):
    """Records each chat-model call of a run as an ``llm`` step (``step_key`` ``llm:<LangChain
    run id>``) with its token usage as a cost, priced by ``price`` when given. Put it in the
    graph's ``config["callbacks"]`` (:func:`start_run` does); its writes are sync (LangChain runs
    a sync handler in a thread under an async graph)."""

    raise_error = True  # a cost that could not be recorded fails the call, never silently lost

    def __init__(self, ledger: ScopedLedger, run_id: str, *, price: Price | None = None,
                 currency: str = "USD") -> None:
        self.ledger = ledger
        self.ledger_run_id = run_id
        self.price = price
        self.currency = currency
        self._steps: dict[UUID, Step] = {}

    def _step(self, run_id: UUID, node_id: str | None = None) -> Step:
        """The model call's step: created at its start, found again by key after a reconnect."""
        return self._steps.pop(run_id, None) or again(f"step llm:{run_id}", lambda: self.ledger.create_step(
            self.ledger_run_id, "llm", step_key=f"llm:{run_id}", node_id=node_id, status=StepStatus.RUNNING))

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *,
                            run_id: UUID, **kwargs: Any) -> None:
        self._steps[run_id] = self._step(run_id, (serialized or {}).get("name"))

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        step = self._step(run_id)
        reply = _reply(response)
        if self.price is not None:
            amount = self.price(reply.model_ref, reply.usage)
            if amount is not None:
                reply = ModelReply(reply.text, reply.usage, reply.model_ref, reply.provider, amount, self.currency)
        record_reply(self.ledger, self.ledger_run_id, step, reply)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        step = self._step(run_id)
        self.ledger.transition_step(step.id, StepStatus.FAILED, error_message=str(error) or repr(error))


def _reply(response: LLMResult) -> ModelReply:
    """The reply as the ledger records it: the text (or the tools asked for), usage, model."""
    generation = response.generations[0][0] if response.generations and response.generations[0] else None
    message = generation.message if isinstance(generation, ChatGeneration) else None
    if not isinstance(message, AIMessage):
        return ModelReply(generation.text if generation is not None else "")
    text = message.text or ", ".join(f"{c['name']}({json.dumps(c['args'], ensure_ascii=False)})"
                                     for c in message.tool_calls)
    meta = message.response_metadata
    model = meta.get("model_name") or meta.get("model") or (response.llm_output or {}).get("model_name")
    return ModelReply(text, dict(message.usage_metadata or {}), model_ref=model, provider=meta.get("model_provider"))


def start_run(
    ledger: ScopedLedger,
    thread_id: str,
    request_id: str,
    *,
    inputs: Mapping[str, Any] | None = None,
    mode: str = "agent",
    price: Price | None = None,
    callbacks: Sequence[BaseCallbackHandler] = (),
    **run: Any,
) -> RunnableConfig:
    """The ledger run of one invocation of ``thread_id`` (created, or found again by
    ``request_id`` on a resume, in any process), moved to ``running``; returns the config to
    invoke (or resume) the graph with: the thread, the run's id for the guard, and a
    :class:`LedgerCallbackHandler` before ``callbacks``. ``run``: more of ``create_run``'s
    arguments (``user_id``, ``subject_id``, ...)."""

    def begin() -> str:
        with ledger.transaction() as tx:
            found = tx.create_run(mode, inputs, request_id=request_id, **run)
            if found.status in (RunStatus.QUEUED, RunStatus.PAUSED, RunStatus.WAITING_APPROVAL, RunStatus.WAITING_INPUT):
                tx.transition_run(found.id, RunStatus.RUNNING)
            return found.id

    run_id = again(f"run of request {request_id}", begin)
    return {"configurable": {"thread_id": thread_id, RUN_ID_KEY: run_id},
            "callbacks": [LedgerCallbackHandler(ledger, run_id, price=price), *callbacks]}


def finish_run(ledger: ScopedLedger, config: RunnableConfig, answer: str) -> None:
    """Records ``answer`` as what the user was shown (a ``message`` response event) and moves the
    run to ``succeeded``, in one transaction; a repeat after a lost commit changes nothing."""
    run_id = str((config.get("configurable") or {})[RUN_ID_KEY])

    def finish() -> None:
        with ledger.transaction() as tx:
            run = tx.get_run(run_id)
            if run is None:
                raise LookupError(f"finish_run: no run {run_id} in this scope")
            if run.status is RunStatus.SUCCEEDED:
                return  # a repeat whose first try committed
            if run.status is not RunStatus.RUNNING:  # parked by the guard and resumed since
                tx.transition_run(run_id, RunStatus.RUNNING)
            tx.record_response_event(run_id, "message", {"text": answer})
            tx.transition_run(run_id, RunStatus.SUCCEEDED, output_summary=answer)

    again(f"run {run_id}: succeeded", finish)
