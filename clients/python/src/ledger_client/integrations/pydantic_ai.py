"""pydantic-ai under the ledger: :class:`LedgerCapability`, a capability whose
``wrap_tool_execute`` runs every function tool through :func:`~ledger_client.tool_call_async`.

The model's ``tool_call_id`` is the ledger's; the ledger answers, and the answer becomes
pydantic-ai's own construct:

- ``claimed``: the tool runs (claimed and begun in one committed statement first, completed after);
- ``replayed``: ``SkipToolExecution(result)``, the recorded result, nothing runs; a recorded
  failure is pydantic-ai's ``ToolFailed`` (the model sees it);
- ``waiting_approval``: ``ApprovalRequired``, so the run ends with ``DeferredToolRequests``;
- ``rejected``: ``ToolDenied`` (the model sees a denied call, with the approver's note, or that
  its approval expired undecided);
- ``in_doubt``, ``busy``: ``CallDeferred`` with the ledger's record in its metadata.

A person decides in the ledger (``resolve_approval``, ``resolve_tool_call``); the agent resumes
with the stored message history and :meth:`LedgerCapability.deferred_results`.

Each agent run's turn is one ledger run (``mode`` ``agent``), created on first use with a
``request_id`` derived from the conversation and the agent run that carried the turn's user
prompt, both kept in the message history: a resume in another process finds the same run. Each
model response is an ``llm`` step with its token usage as a cost; the final output is a
``message`` response event and the run ``succeeded``; a run ending on deferred calls is parked
``waiting_approval`` or ``paused``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability, WrapToolExecuteHandler
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, SkipToolExecution
from pydantic_ai.exceptions import ToolFailed as ModelToolFailed
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, UserPromptPart
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.run import AgentRunResult
from pydantic_ai.usage import RequestUsage
from pydantic_ai.tools import DeferredToolRequests, DeferredToolResults, ToolApproved, ToolDefinition, ToolDenied

from ..aio import AsyncScopedLedger, tool_call_async
from ..encoding import encode
from ..tool_calls import Busy, InDoubt, Rejected, ToolCallStopped, ToolFailed, WaitingApproval
from ..types import ApprovalStatus, ClaimOutcome, Run, RunStatus, StepStatus

Approval = Callable[[ToolCallPart], Mapping[str, Any] | None]
"""Which calls wait for a person: the call's ``approval`` (``{title, policy_ref, details,
expires_in_seconds}``), or None."""

RunKey = Callable[[RunContext[Any]], str]
"""The ledger run of an agent run, from its context (its deps, say)."""

_RESUMABLE = (RunStatus.QUEUED, RunStatus.PAUSED, RunStatus.WAITING_APPROVAL)


def _turn(ctx: RunContext[Any]) -> tuple[str | None, Any]:
    """The agent run that carried the turn's user prompt (found in the message history, so a
    resumed run finds it too), and the prompt."""
    for message in reversed(ctx.messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart):
                    content = part.content
                    prompt = content if isinstance(content, str) else [c if isinstance(c, str) else repr(c) for c in content]
                    return message.run_id, prompt
    return ctx.run_id, None


def turn_request_id(ctx: RunContext[Any]) -> str:
    """The default ledger ``request_id`` of an agent run: ``pydantic-ai:<conversation>:<agent run
    of the turn's user prompt>``. Both are stamped on the message history, so a run resumed from
    that history (no new prompt, in any process) names the same ledger run, and a new prompt of
    the conversation a new one."""
    return f"pydantic-ai:{ctx.conversation_id}:{_turn(ctx)[0] or ctx.run_id}"


@dataclasses.dataclass
class LedgerCapability(AbstractCapability[Any]):
    """Puts the agent's function tools, costs and answers in the ledger (see the module's docstring).

    ``ledger`` is the scoped async handle. ``run_id`` picks the ledger run of an agent run (by
    default :func:`turn_request_id` as its ``request_id``); ``approval`` which calls wait for a
    person. ``lease_owner``, ``timeout_seconds``, ``heartbeat_s`` and ``in_doubt_on`` are
    :func:`~ledger_client.tool_call_async`'s."""

    ledger: AsyncScopedLedger
    run_id: RunKey | None = None
    approval: Approval | None = None
    lease_owner: str | None = None
    timeout_seconds: int = 30
    heartbeat_s: float | None = None
    in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,)
    _run: Run | None = dataclasses.field(default=None, repr=False, compare=False)
    _first_use: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False, compare=False)

    async def for_run(self, ctx: RunContext[Any]) -> LedgerCapability:
        return dataclasses.replace(self, _run=None, _first_use=asyncio.Lock())  # the agent run's own ledger run

    async def ledger_run(self, ctx: RunContext[Any]) -> Run:
        """This agent run's ledger run: created (or found again) on first use and moved to
        ``running`` (a resume finds it parked). The calls of one model response run concurrently:
        the first of them finds the run (one ``create_run``), the others wait for it."""
        async with self._first_use:
            if self._run is None:
                self._run = await self._find_run(ctx)
        return self._run

    async def _find_run(self, ctx: RunContext[Any]) -> Run:
        inputs = {"prompt": _turn(ctx)[1], "conversation_id": ctx.conversation_id}
        if self.run_id is not None:
            run = await self.ledger.create_run("agent", inputs, run_id=self.run_id(ctx))
        else:
            run = await self.ledger.create_run("agent", inputs, request_id=turn_request_id(ctx))
        if run.status in _RESUMABLE:
            run = await self.ledger.transition_run(run.id, RunStatus.RUNNING)
        return run

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        """The response as an ``llm`` step (found again by the agent run and its step) with its
        token usage as a cost, with pydantic-ai's price of it when it has one."""
        run = await self.ledger_run(ctx)
        if run.status.terminal:
            return response  # a finished turn run again from its history: its run takes no more
        step = await self.ledger.create_step(run.id, "llm", step_key=f"llm:{ctx.run_id}:{ctx.run_step}")
        if step.status is StepStatus.SUCCEEDED:
            return response
        await self.ledger.transition_step(step.id, StepStatus.RUNNING)
        usage = response.usage
        amount = usage.cost  # pydantic-ai's price in USD (or its gateway's), None for a model it cannot price
        summary = response.text or ", ".join(f"{c.tool_name}({c.tool_call_id})" for c in response.tool_calls)
        async with self.ledger.transaction() as tx:
            await tx.record_cost(run.id, "tokens", usage.total_tokens, amount, "USD" if amount is not None else None,
                                 step_id=step.id, usage=_usage(usage),
                                 provider=response.provider_name, model_ref=response.model_name, source_ref=step.id)
            await tx.transition_step(step.id, StepStatus.SUCCEEDED, output_summary=summary,
                                     metrics={"model_ref": response.model_name} if response.model_name else None)
        return response

    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: Any,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        """The call through the ledger; its answer as pydantic-ai's construct (module docstring)."""
        run = await self.ledger_run(ctx)
        ran = False

        async def execute(_: dict[str, Any]) -> Any:
            nonlocal ran
            ran = True
            return await handler(args)

        approval = self.approval(call) if self.approval is not None else None
        try:
            result = await tool_call_async(
                self.ledger, run.id, call.tool_call_id, call.tool_name, call.args_as_dict(), execute,
                lease_owner=self.lease_owner, timeout_seconds=self.timeout_seconds, approval=approval,
                heartbeat_s=self.heartbeat_s, in_doubt_on=self.in_doubt_on)
        except ToolFailed as e:
            raise ModelToolFailed(f"the call failed before: {e.error}") from e
        except WaitingApproval as e:
            raise ApprovalRequired(metadata=_metadata(run, e)) from e
        except Rejected as e:
            if e.approval is not None and e.approval.status is ApprovalStatus.EXPIRED:
                return ToolDenied("No one approved the call before its approval expired.")
            note = e.approval.note if e.approval is not None else None
            return ToolDenied("A person rejected the call" + (f": {note}" if note else "."))
        except (InDoubt, Busy) as e:  # InDoubt too when this attempt's request got no answer
            raise CallDeferred(metadata=_metadata(run, e)) from e
        if not ran:
            raise SkipToolExecution(result)
        return result

    async def after_run(self, ctx: RunContext[Any], *, result: AgentRunResult[Any]) -> AgentRunResult[Any]:
        """The output as a ``message`` response event and the run ``succeeded``, in one
        transaction; deferred calls park it (``waiting_approval`` for an approval, else ``paused``)."""
        run = await self.ledger_run(ctx)
        if run.status.terminal:
            return result  # a finished turn run again from its history: recorded already
        output = result.output
        async with self.ledger.transaction() as tx:
            if isinstance(output, DeferredToolRequests):
                parked = RunStatus.WAITING_APPROVAL if output.approvals else RunStatus.PAUSED
                await tx.transition_run(run.id, parked)
            else:
                text = output if isinstance(output, str) else json.dumps(encode(output))
                await tx.record_response_event(run.id, "message", {"text": text})
                await tx.transition_run(run.id, RunStatus.SUCCEEDED, output_summary=text)
        return result

    async def deferred_results(self, requests: DeferredToolRequests) -> DeferredToolResults:
        """What to resume a run ended on ``requests`` with, as the ledger has it now: each approval
        ``ToolApproved`` (the call then asks the ledger again: it runs once approved, is denied
        once rejected, and waits again while pending); each call deferred in doubt or busy its
        resolution (a person's ``resolve_tool_call``: the result, or ``ToolFailed``). Raises
        :class:`~ledger_client.InDoubt` (or ``Busy``) for a call nobody has resolved yet."""
        results = DeferredToolResults(approvals={c.tool_call_id: ToolApproved() for c in requests.approvals})
        mine = [c for c in requests.calls if "ledger" in requests.metadata.get(c.tool_call_id, {})]
        for call in mine:
            run_id = requests.metadata[call.tool_call_id]["ledger"]["run_id"]
            spec = {"tool_call_id": call.tool_call_id, "tool_ref": call.tool_name,
                    "arguments": encode(call.args_as_dict())}
            [claim] = await self.ledger.claim_tool_calls(run_id, [spec], lease_owner=self.lease_owner)
            if claim.outcome is not ClaimOutcome.REPLAYED:
                raise ToolCallStopped.from_claim(claim, call.tool_name)
            assert claim.response is not None
            results.calls[call.tool_call_id] = (claim.response.result if claim.response.success else
                                                ModelToolFailed(f"the call failed: {claim.response.error}"))
        return results


def _usage(usage: RequestUsage) -> dict[str, int]:
    """pydantic-ai's token counts under the ledger's usage keys (its audio counts have none)."""
    counts = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
              "cache_read_tokens": usage.cache_read_tokens, "cache_creation_tokens": usage.cache_write_tokens,
              "reasoning_tokens": usage.output_reasoning_tokens}
    return {key: count for key, count in counts.items() if count}


def _metadata(run: Run, stopped: ToolCallStopped) -> dict[str, Any]:
    """The deferred call's metadata: the ledger's run, record and answer, for whoever resolves it."""
    record = stopped.tool_call
    ledger: dict[str, Any] = {"run_id": run.id, "outcome": str(stopped.outcome),
                              "tool_call_record_id": record.id if record is not None else None}
    if stopped.approval is not None:
        ledger["approval_id"] = stopped.approval.id
    return {"ledger": ledger}
