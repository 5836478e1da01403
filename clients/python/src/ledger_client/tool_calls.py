"""The executor protocol as one call: :func:`tool_call` (one call) and :func:`tool_calls` (the
calls of one model turn, executed in parallel threads).

claim -> ``replayed``: the recorded result, nothing executed -> ``claimed``: claimed and begun in
one COMMITTED statement before the tool runs -> heartbeats while it runs -> complete ``succeeded``
(its result) or ``failed`` (the tool raised) -> a timeout after sending (``in_doubt_on``)
completes ``unknown`` and raises :class:`InDoubt`; a result outside the encoding rule
(:mod:`ledger_client.encoding`) completes ``unknown`` and raises :class:`ResultNotEncodable`.
Every other outcome (``budget_exhausted`` too) raises its own :class:`ToolCallStopped` subclass,
and nothing is executed.

``repeatable=True`` (a tool safe to repeat: a read, an idempotent API) takes the single-commit
path instead: a lookup that writes nothing (``find_tool_call``: ``replayed`` returns the recorded
result), the tool, then one committing statement (``record_tool_call``) after it returned. Nothing
is leased or begun, so concurrent callers may each run the tool once; the first record wins and
every caller returns what it recorded.

A connection lost at a write is the connection's, not the call's: the claim and the completion
are written again on a fresh connection (a completion is fenced by the attempt; a repeated claim
answers the recorded outcome, or ``busy`` when the lost one committed: that attempt, begun and
never sent, ends in doubt when its lease runs out, as the ledger cannot tell it was not sent).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from ._faults import again
from .client import ScopedLedger
from .encoding import NotEncodable, encode
from .errors import LedgerError
from .types import Approval, Budget, ClaimOutcome, ToolCall, ToolCallClaim, ToolCallTombstone

Execute = Callable[[dict[str, Any]], Any]
"""A tool: called with the call's arguments, returns its JSON result."""


class ToolCallStopped(Exception):
    """The helper has no result for the call; ``outcome`` says why, ``tool_call`` is the record."""

    outcome: ClassVar[ClaimOutcome]

    def __init__(
        self,
        message: str,
        *,
        tool_call: ToolCall | None = None,
        approval: Approval | None = None,
        tombstone: ToolCallTombstone | None = None,
        budget: Budget | None = None,
    ) -> None:
        super().__init__(message)
        self.tool_call = tool_call
        self.approval = approval
        self.tombstone = tombstone
        self.budget = budget

    @classmethod
    def from_claim(cls, claim: ToolCallClaim, tool_ref: str) -> ToolCallStopped:
        stopped = _STOPPED[claim.outcome]
        return stopped(f"tool call {tool_ref}: {claim.outcome}", tool_call=claim.tool_call,
                       approval=claim.approval, tombstone=claim.tombstone, budget=claim.budget)


class InDoubt(ToolCallStopped):
    """The request may have left and no answer was recorded: never executed again; a person
    resolves it (``resolve_tool_call``)."""

    outcome = ClaimOutcome.IN_DOUBT


class ResultNotEncodable(InDoubt):
    """The tool ran and returned ``result``, which the encoding rule cannot turn into JSON (a
    ``type`` the rule does not know). The call is completed ``unknown`` (in doubt, the result's
    repr in its error message): not ``succeeded``, as no result could be recorded to replay, and
    not ``failed``, as ``retry_failed`` would then run the side effect again. A person reads the
    message and resolves the call."""

    def __init__(self, message: str, *, tool_call: ToolCall | None = None, result: Any = None) -> None:
        super().__init__(message, tool_call=tool_call)
        self.result = result


class Busy(ToolCallStopped):
    """Another attempt holds a live lease: claim again later."""

    outcome = ClaimOutcome.BUSY


class WaitingApproval(ToolCallStopped):
    """The call waits for a person's approval (``approval`` is the request)."""

    outcome = ClaimOutcome.WAITING_APPROVAL


class Rejected(ToolCallStopped):
    """The approval was rejected, or expired before anyone decided it (``approval.status``
    ``expired``): the call is never executed."""

    outcome = ClaimOutcome.REJECTED


class Purged(ToolCallStopped):
    """The call's run was purged; ``tombstone`` is what its key left."""

    outcome = ClaimOutcome.PURGED


class BudgetExhausted(ToolCallStopped):
    """A budget that applies to the run is used up (``budget`` says which): the call is not
    executed (``tool_call`` is None for a new call: nothing was created), and the ledger parked the
    run ``paused`` with ``error_code`` ``BUDGET_EXHAUSTED`` until a person raises the budget
    (``set_budget``) or ends the run. :meth:`~ledger_client.RunContext.llm_step` raises it too for
    a refused ``llm`` step."""

    outcome = ClaimOutcome.BUDGET_EXHAUSTED


class ToolFailed(ToolCallStopped):
    """The call failed before and its failure was replayed (``error`` is the recorded error);
    pass ``retry_failed=True`` to execute it again."""

    outcome = ClaimOutcome.REPLAYED

    def __init__(self, message: str, error: Any, *, tool_call: ToolCall | None = None) -> None:
        super().__init__(message, tool_call=tool_call)
        self.error = error


_STOPPED: dict[ClaimOutcome, type[ToolCallStopped]] = {
    ClaimOutcome.IN_DOUBT: InDoubt,
    ClaimOutcome.BUSY: Busy,
    ClaimOutcome.WAITING_APPROVAL: WaitingApproval,
    ClaimOutcome.REJECTED: Rejected,
    ClaimOutcome.PURGED: Purged,
    ClaimOutcome.BUDGET_EXHAUSTED: BudgetExhausted,
}


class _Heartbeat:
    """Extends the attempt's lease every ``interval`` seconds while the tool runs, so that a
    slow tool is not found expired (and in doubt) by another claim or a sweep. The beats of every
    call of the process come from one thread (:data:`_BEATS`): a thread per call would cost more
    than a quick tool."""

    def __init__(self, ledger: ScopedLedger, record: ToolCall, interval: float) -> None:
        self._ledger = ledger
        self._record = record
        self.interval = interval
        self.over = False

    def __enter__(self) -> None:
        _BEATS.add(self)

    def __exit__(self, *exc: object) -> None:
        self.over = True  # a beat already under way is harmless: the completion decides

    def beat(self) -> bool:
        """One heartbeat; False once the attempt is over."""
        if self.over:
            return False
        try:
            self._ledger.heartbeat_tool_call(self._record.id, self._record.attempt)
        except LedgerError:
            return False  # the attempt is over (released, resolved): its completion will say so
        except psycopg.OperationalError:
            pass  # the server is unreachable now: try again at the next beat
        return not self.over


class _Beats:
    """The process's heartbeat thread: each call's next beat in a queue ordered by time, the
    thread started with the first call."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _Heartbeat]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, heartbeat: _Heartbeat) -> None:
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + heartbeat.interval, next(self._order), heartbeat))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tool-call heartbeats", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, heartbeat = heapq.heappop(self._due)
            if heartbeat.beat():
                with self._wake:
                    heapq.heappush(self._due, (time.monotonic() + heartbeat.interval, next(self._order), heartbeat))


_BEATS = _Beats()


def positive_seconds(name: str, seconds: float | None) -> float | None:
    """``seconds`` when it is None (the default) or a positive finite number; ValueError before
    anything is claimed otherwise (a heartbeat of 0 would beat without pause)."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ledger: {name} must be a positive number of seconds, got {seconds!r}")
    return seconds


def _complete(ledger: ScopedLedger, record: ToolCall, outcome: str, result: Any = None,
              error_message: str | None = None) -> ToolCall:
    """Records how the attempt ended, again across a dropped connection (the tool has run: its
    outcome must not be lost to a reconnect); repeating a completion changes nothing."""
    return again(f"tool call {record.id}: complete",
                 lambda: ledger.complete_tool_call(record.id, record.attempt, outcome, result,
                                                   error_message=error_message))


def _to_execute(claim: ToolCallClaim, tool_ref: str) -> ToolCall | None:
    """The record to execute when the claim says ``claimed``; None when the recorded result
    answers (``replayed`` success); the outcome's exception otherwise. Shared by both faces."""
    if claim.outcome is ClaimOutcome.REPLAYED:
        assert claim.response is not None
        if claim.response.success:
            return None
        raise ToolFailed(f"tool call {tool_ref} failed before: {claim.response.error}", claim.response.error,
                         tool_call=claim.tool_call)
    if claim.outcome is not ClaimOutcome.CLAIMED:
        raise ToolCallStopped.from_claim(claim, tool_ref)
    assert claim.tool_call is not None
    return claim.tool_call


@dataclass(frozen=True)
class _Ending:
    """How an executed attempt is completed, and what is raised once it is (``raised(record)``;
    None: the tool's own exception propagates, or the result is returned)."""

    outcome: str
    result: Any = None
    error_message: str | None = None
    raised: Callable[[ToolCall], ToolCallStopped] | None = None
    cause: BaseException | None = None


def _ending(record: ToolCall, tool_ref: str, error: BaseException | None, result: Any,
            in_doubt_on: tuple[type[BaseException], ...]) -> _Ending:
    """What the tool's end means for the record (see the module's docstring). Shared by both faces."""
    if error is not None and isinstance(error, in_doubt_on):
        message = f"tool call {tool_ref}: no answer after sending ({error!r})"
        return _Ending("unknown", error_message=str(error) or repr(error),
                       raised=lambda done: InDoubt(message, tool_call=done))
    if error is not None:
        return _Ending("failed", error_message=str(error) or repr(error))
    try:
        return _Ending("succeeded", encode(result))
    except NotEncodable as e:
        message = (f"tool call {record.tool_call_id or record.id} ({tool_ref}): the tool ran and its result is not"
                   f" encodable: {e}; recorded unknown (in doubt)")
        return _Ending("unknown", error_message=f"the result is not encodable: {e}",
                       raised=lambda done: ResultNotEncodable(message, tool_call=done, result=result), cause=e)


def _settle(
    ledger: ScopedLedger,
    claim: ToolCallClaim,
    tool_ref: str,
    arguments: dict[str, Any],
    execute: Execute,
    *,
    heartbeat_s: float | None,
    in_doubt_on: tuple[type[BaseException], ...],
) -> Any:
    """What the helper does with one claim's answer (see the module's docstring)."""
    record = _to_execute(claim, tool_ref)
    if record is None:
        assert claim.response is not None
        return claim.response.result
    error: Exception | None = None
    result = None
    try:
        with _Heartbeat(ledger, record, heartbeat_s if heartbeat_s is not None else record.lease_seconds / 3):
            result = execute(arguments)
    except Exception as e:
        error = e
    ending = _ending(record, tool_ref, error, result, in_doubt_on)
    done = _complete(ledger, record, ending.outcome, ending.result, ending.error_message)
    if ending.raised is not None:
        raise ending.raised(done) from ending.cause or error
    if error is not None:
        raise error
    return result


class _Repeat:
    """The arguments of a repeatable call's lookup and record (encoded before anything is
    written; a result the encoding rule cannot encode raises :class:`NotEncodable` and records
    nothing, as the tool may simply run again). Shared by both faces."""

    def __init__(self, request: ToolRequest, run_token: int | None) -> None:
        if request.approval is not None:
            raise ValueError("ledger: a call that waits for an approval is not repeatable: leave out repeatable")
        self.find: dict[str, Any] = {
            "tool_ref": request.tool_ref, "arguments": encode(dict(request.arguments)),
            "tool_call_id": request.tool_call_id, "idempotency_key": request.idempotency_key,
            "retry_failed": request.retry_failed,
        }
        self._record = {**self.find, "run_token": run_token}

    def succeeded(self, result: Any) -> dict[str, Any]:
        return {**self._record, "outcome": "succeeded", "result": encode(result)}

    def failed(self, error: Exception) -> dict[str, Any]:
        return {**self._record, "outcome": "failed", "error_message": str(error) or repr(error)}


def _recorded(answer: ToolCallClaim, tool_ref: str) -> Any:
    """What a repeatable call returns for an answer that is not its own new record: the recorded
    result (``replayed``), or the outcome's exception (a failure replayed, a side-effecting call's
    state). Shared by both faces."""
    _to_execute(answer, tool_ref)
    assert answer.response is not None
    return answer.response.result


def tool_call(
    ledger: ScopedLedger,
    run_id: str,
    tool_call_id: str,
    tool_ref: str,
    arguments: Mapping[str, Any],
    execute: Execute,
    *,
    idempotency_key: str | None = None,
    lease_owner: str | None = None,
    timeout_seconds: int = 30,
    approval: Mapping[str, Any] | None = None,
    retry_failed: bool = False,
    run_token: int | None = None,
    heartbeat_s: float | None = None,
    in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
    repeatable: bool = False,
) -> Any:
    """Executes the call at most once, whoever asks again, and returns its result.

    ``tool_call_id`` is the call's key within the run (the model's id): asking again with it
    returns the recorded result. ``timeout_seconds`` sets the lease (that plus a tenth of it, at
    least 5 s; never under 10 s); the helper heartbeats every ``heartbeat_s`` (a third of the
    lease) while ``execute`` runs, so a slower tool keeps its lease. ``execute`` raising one of
    ``in_doubt_on`` (your HTTP client's timeout) means the request left and no answer came: the
    call is completed ``unknown`` and :class:`InDoubt` is raised; any other exception completes it
    ``failed`` and propagates.
    ``approval`` (``{title, policy_ref, details, expires_in_seconds}``): the call waits for a
    person first (past ``expires_in_seconds`` undecided, the approval expires: :class:`Rejected`).
    ``repeatable``: the tool is safe to repeat; it runs after a lookup and is recorded once after
    it returns, in one commit (see the module's docstring), with no lease, heartbeat or doubt.
    """
    positive_seconds("heartbeat_s", heartbeat_s)
    request = ToolRequest(tool_call_id, tool_ref, arguments, execute, idempotency_key=idempotency_key,
                          timeout_seconds=timeout_seconds, approval=approval, retry_failed=retry_failed)
    if repeatable:
        repeat = _Repeat(request, run_token)
        found = again(f"tool call {tool_call_id}: find", lambda: ledger.find_tool_call(run_id, **repeat.find))
        if found.outcome is not ClaimOutcome.UNRECORDED:
            return _recorded(found, tool_ref)
        try:
            result = execute(dict(arguments))
        except Exception as e:
            failed = repeat.failed(e)
            answer = again(f"tool call {tool_call_id}: record", lambda: ledger.record_tool_call(run_id, **failed))
            if answer.outcome is ClaimOutcome.RECORDED:
                raise
            return _recorded(answer, tool_ref)
        succeeded = repeat.succeeded(result)
        answer = again(f"tool call {tool_call_id}: record", lambda: ledger.record_tool_call(run_id, **succeeded))
        return result if answer.outcome is ClaimOutcome.RECORDED else _recorded(answer, tool_ref)
    spec = request.spec()  # encoded before anything is written
    [claim] = again(f"tool call {tool_call_id}: claim", lambda: ledger.claim_tool_calls(
        run_id, [spec], lease_owner=lease_owner, begin=True, run_token=run_token))
    return _settle(ledger, claim, tool_ref, dict(arguments), execute, heartbeat_s=heartbeat_s,
                   in_doubt_on=in_doubt_on)


@dataclass(frozen=True)
class ToolRequest:
    """One call of a model turn, for :func:`tool_calls`."""

    tool_call_id: str
    tool_ref: str
    arguments: Mapping[str, Any]
    execute: Execute
    idempotency_key: str | None = None
    timeout_seconds: int | None = None
    approval: Mapping[str, Any] | None = None
    retry_failed: bool | None = None

    def spec(self) -> dict[str, Any]:
        """The element of ``claim_tool_calls``' ``calls`` (absent keys take the SQL defaults)."""
        spec = {"tool_call_id": self.tool_call_id, "tool_ref": self.tool_ref, "arguments": encode(dict(self.arguments)),
                "idempotency_key": self.idempotency_key, "timeout_seconds": self.timeout_seconds,
                "approval": dict(self.approval) if self.approval is not None else None,
                "retry_failed": self.retry_failed}
        return {k: v for k, v in spec.items() if v is not None}


@dataclass(frozen=True)
class ToolCallResult:
    """How one call of a turn ended: ``value`` (its result) or ``error`` (a
    :class:`ToolCallStopped`, or what the tool raised)."""

    request: ToolRequest
    claim: ToolCallClaim
    value: Any = None
    error: Exception | None = None

    def get(self) -> Any:
        """The result, or the error raised."""
        if self.error is not None:
            raise self.error
        return self.value


def tool_calls(
    ledger: ScopedLedger,
    run_id: str,
    requests: Sequence[ToolRequest],
    *,
    lease_owner: str | None = None,
    run_token: int | None = None,
    heartbeat_s: float | None = None,
    in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
    max_workers: int | None = None,
) -> list[ToolCallResult]:
    """The calls of one model turn: claimed and begun in one committed statement
    (``claim_tool_calls(..., begin => true)``), then each claimed call executed in its own thread
    and completed as :func:`tool_call` does. Returns one result per request, in order; it never
    raises for one call's outcome (a refused batch raises the ledger's error, nothing written)."""
    positive_seconds("heartbeat_s", heartbeat_s)
    if not requests:
        return []
    specs = [r.spec() for r in requests]  # encoded before anything is written
    claims = again("tool calls: claim", lambda: ledger.claim_tool_calls(run_id, specs, lease_owner=lease_owner,
                                                                        begin=True, run_token=run_token))
    with ThreadPoolExecutor(max_workers=max_workers or len(requests), thread_name_prefix="tool-call") as pool:
        futures = [
            pool.submit(_settle, ledger, claim, r.tool_ref, dict(r.arguments), r.execute,
                        heartbeat_s=heartbeat_s, in_doubt_on=in_doubt_on)
            for r, claim in zip(requests, claims, strict=True)
        ]
        results = []
        for r, claim, future in zip(requests, claims, futures, strict=True):
            error = future.exception()
            if error is not None and not isinstance(error, Exception):
                raise error
            results.append(ToolCallResult(r, claim, None if error else future.result(), error))
    return results
