"""A worker loop over ``claim_run``: it claims a run, drives it with your agent and lets it go.

The agent is written as if it ran from the start every time: on a resume its steps are found
again by ``step_key`` (finished ones return their recorded output) and its tool calls by
``tool_call_id`` (finished ones return their recorded result). The loop:

- moves a claimed run to ``running`` (a resume may find it queued, paused, waiting, retrying);
- heartbeats the run's lease while the agent runs (the agent runs in its own thread);
- on the agent's answer: records it as a ``message`` response event and moves the run to
  ``succeeded``, in one transaction;
- on :class:`InDoubt`: parks the run ``paused``; on :class:`WaitingApproval`: ``waiting_approval``;
  on :class:`BudgetExhausted` (a tool call or an ``llm`` step refused: the ledger paused the run
  with ``error_code`` ``BUDGET_EXHAUSTED``): ``paused``, as the ledger left it; then releases it (a
  person's decision, or a budget raised, makes it claimable again);
- on :class:`WaitingUntil` (the agent called :meth:`RunContext.wait_until` before its wake time):
  parks the run with ``wait_run`` until then, which gives the lease up itself (nothing is released
  after it); a claim from the wake time on resumes it (``waiting_input`` to ``running``);
- on :class:`WaitingForInput` and :class:`WaitingForChildren` (the agent's
  :meth:`RunContext.wait_for_input` or :meth:`RunContext.wait_for_children` parked the run itself,
  its lease given up): writes nothing more; the input, the last child's end or the deadline makes
  the run claimable again;
- on :class:`Busy` (another attempt, such as a previous owner's, holds a call): keeps the run and
  runs the agent again after ``min(idle_s, 1)`` seconds (parked ``paused`` if the worker is stopping);
- on :class:`Rejected` (a person rejected a call's approval and the agent did not catch it):
  moves the run to ``failed`` with ``error_code`` ``TOOL_APPROVAL_REJECTED``, the call and the
  approver's note in the message (``TOOL_APPROVAL_EXPIRED`` when no one decided before the
  approval's deadline);
- on a lost connection (:func:`is_transient`; never the agent's failure): releases the run, to be
  claimed again at once and resumed where its records say; if the release is lost too, the
  lease runs out (``lease_seconds``);
- on any other exception: moves the run to ``failed`` with the error;
- on ``LEASE_STALE`` (another worker took the run over): writes nothing more.

The run's writes (``running``, the answer, parking, releasing) and the agent's writes through
:class:`RunContext` (steps, costs, tool calls) are written again on a fresh connection when the
connection is lost: each is idempotent (a step by ``step_key``, a cost by its ``source_ref``, a
transition to the status it has) and fenced by ``run_token``, so a repeat changes nothing.

When nothing is claimable the loop sleeps until the first of: a ``ledger_runs`` notification (a
commit that may have made a run claimable: a new run, a release, an input, a decision, a run's
end), ``next_wake`` (when a wait, a backoff, an approval's deadline or a full rate window ends, by
the database's clock), ``idle_s`` (the backstop for what neither tells: a lease that ran out, a
budget's new day or month), a stop. It LISTENs on a connection of its own (not the pool's: it holds
it while it runs), before its claim, so that no commit between an empty claim and the sleep is
missed; after a lost connection it listens again on a new one, and while it cannot it polls every
``min(idle_s, 1)`` seconds. A notification is a hint: the next claim decides.

With ``fire_schedules_s`` the loop also fires the due schedules (``fire_schedules``, of its scope
or of every scope) at most that often, before a claim: for a deployment without pg_cron.

Shutdown: :meth:`Worker.stop` (or SIGTERM/SIGINT with ``handle_signals``) stops claiming; the
current run may finish within ``shutdown_grace_s``, after which it is released for another worker
(its token is over: the abandoned agent's writes fail ``LEASE_STALE``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, TypeVar

import psycopg

from ._faults import again, is_transient
from ._signals import stop_on_signals
from .client import Ledger, ScopedLedger, Transaction
from .errors import ConflictError, LedgerError, translated
from .tool_calls import (
    BudgetExhausted,
    Busy,
    Execute,
    InDoubt,
    Rejected,
    ToolCallResult,
    ToolRequest,
    WaitingApproval,
    positive_seconds,
    tool_call,
    tool_calls,
)
from .types import ApprovalStatus, Budget, ChildRun, ClaimedRun, RunStatus, Step, StepStatus, WaitStatus

log = logging.getLogger("ledger_client.worker")

T = TypeVar("T")

CHANNEL = "ledger_runs"
"""The channel a commit that may have made a run claimable notifies (after commit, no payload)."""

IDLE_S = 30.0
"""The default longest sleep of an idle worker. Notifications and ``next_wake`` wake it for nearly
everything; this bounds how late it sees what they do not tell: a lease that ran out (a dead
worker's run is taken over within ``lease_seconds`` + ``idle_s``) and a budget's new window."""

# Seconds until next_wake by the database's clock, the one claim_run's not_before follows: a
# worker whose clock is ahead would otherwise wake early, find nothing and ask again in a loop.
_NEXT_WAKE_IN = "SELECT extract(epoch FROM ledger.next_wake(any_scope => %s) - now())"


def default_lease_owner() -> str:
    """``<host>:<pid>``: whom ``ledger.runs.lease_owner`` and ``tool_calls_in_doubt`` name."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class ModelReply:
    """What a model call returns to :meth:`RunContext.llm_step`: the reply, its usage as the
    model's SDK reports it (the ledger maps OpenAI's and Anthropic's names), optionally its price."""

    text: str
    usage: Mapping[str, Any] = field(default_factory=dict)
    model_ref: str | None = None
    provider: str | None = None
    amount: Decimal | None = None
    currency: str | None = None

    @property
    def tokens(self) -> int:
        """The billed quantity: ``total_tokens``, else the sum of input and output tokens."""
        if self.usage.get("total_tokens") is not None:
            return int(self.usage["total_tokens"])
        names = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
        return sum(int(self.usage.get(name) or 0) for name in names)


def record_reply(ledger: ScopedLedger, run_id: str, step: Step, reply: ModelReply, *,
                 run_token: int | None = None) -> None:
    """A model call's cost (idempotent on the ``llm`` step) and the step's success, together, again
    on a fresh connection when the connection is lost: the reply is paid for."""

    def record() -> None:
        with ledger.transaction() as tx:
            tx.record_cost(run_id, "tokens", reply.tokens, reply.amount, reply.currency, step_id=step.id,
                           usage=reply.usage, provider=reply.provider, model_ref=reply.model_ref, source_ref=step.id)
            tx.transition_step(step.id, StepStatus.SUCCEEDED, output_summary=reply.text,
                               metrics={"model_ref": reply.model_ref} if reply.model_ref else None, run_token=run_token)

    again(f"step {step.step_key or step.id}: the model's reply", record)


class RunContext:
    """What the agent gets: the claimed run, its scoped handle, and helpers that carry the run's
    ``run_token`` and the worker's ``lease_owner`` for it."""

    def __init__(self, ledger: ScopedLedger, run: ClaimedRun) -> None:
        self.ledger = ledger
        self.run = run

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def run_token(self) -> int:
        return self.run.run_token

    @property
    def lease_owner(self) -> str:
        return self.run.lease_owner

    @property
    def inputs(self) -> Any:
        return self.run.inputs

    def step(self, step_key: str, step_type: str, work: Callable[[], str]) -> str:
        """A step found again by ``step_key``: done once (``work`` returns its output summary),
        its recorded output returned on a resume."""
        step = self._begin_step(step_key, step_type)
        if step.status is StepStatus.SUCCEEDED:
            return step.output_summary or ""
        try:
            summary = work()
        except Exception as e:
            self._move_step(step.id, StepStatus.FAILED, error_message=str(e) or repr(e))
            raise
        self._move_step(step.id, StepStatus.SUCCEEDED, output_summary=summary)
        return summary

    def _begin_step(self, step_key: str, step_type: str) -> Step:
        """The step of ``step_key``, moved to ``running`` unless it succeeded before;
        :class:`BudgetExhausted` when the ledger refused it (an ``llm`` step over a budget)."""
        step = again(f"step {step_key}", lambda: self.ledger.create_step(
            self.run_id, step_type, step_key=step_key, run_token=self.run_token))
        if step.error_code == "BUDGET_EXHAUSTED":  # created (or found) paused: the work must not run
            raise BudgetExhausted(f"step {step_key}: {step.error_message}", budget=Budget.from_row(step.error_details))
        if step.status is not StepStatus.SUCCEEDED:
            self._move_step(step.id, StepStatus.RUNNING)
        return step

    def _move_step(self, step_id: str, status: StepStatus, **fields: Any) -> None:
        again(f"step {step_id}: {status}", lambda: self.ledger.transition_step(
            step_id, status, run_token=self.run_token, **fields))

    def llm_step(self, step_key: str, call_model: Callable[[], ModelReply]) -> str:
        """A model call as an ``llm`` step found again by ``step_key``: its cost and its success
        are recorded together (the cost idempotent on the step). On a resume the reply is read
        back from the step's ``output_summary`` (as stored: redacted, at most 8192 characters)."""
        step = self._begin_step(step_key, "llm")
        if step.status is StepStatus.SUCCEEDED:
            return step.output_summary or ""
        reply = call_model()
        record_reply(self.ledger, self.run_id, step, reply, run_token=self.run_token)
        return reply.text

    def tool_call(
        self,
        tool_call_id: str,
        tool_ref: str,
        arguments: Mapping[str, Any],
        execute: Execute,
        *,
        approval: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        timeout_seconds: int = 30,
        retry_failed: bool = False,
        heartbeat_s: float | None = None,
        in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
        repeatable: bool = False,
    ) -> Any:
        """:func:`~ledger_client.tool_call` for this run. A re-run calls its tools with the same
        ``tool_call_id``: the ledger answers from the record its lineage holds (``replayed``,
        ``in_doubt``), so nothing its source runs sent is sent again."""
        return tool_call(self.ledger, self.run_id, tool_call_id, tool_ref, arguments, execute,
                         idempotency_key=idempotency_key, lease_owner=self.lease_owner,
                         timeout_seconds=timeout_seconds, approval=approval,
                         retry_failed=retry_failed, run_token=self.run_token, heartbeat_s=heartbeat_s,
                         in_doubt_on=in_doubt_on, repeatable=repeatable)

    def tool_calls(self, requests: Sequence[ToolRequest], *, heartbeat_s: float | None = None) -> list[ToolCallResult]:
        """:func:`~ledger_client.tool_calls` (one model turn, in parallel) for this run."""
        return tool_calls(self.ledger, self.run_id, requests, lease_owner=self.lease_owner,
                          run_token=self.run_token, heartbeat_s=heartbeat_s)


    def wait_until(self, step_key: str, wake_at: datetime) -> datetime:
        """A durable wait found again by ``step_key``: a ``wait`` step records the first ``wake_at``
        (an aware datetime). Before that time (by the database's clock) it raises
        :class:`WaitingUntil`, which ends the agent's turn: a :class:`Worker` parks the run with
        ``wait_run`` and a claim from then on runs the agent again. From that time on the step
        succeeds and the recorded wake time is returned, so a resume that computes another
        ``wake_at`` (``now() + 1h`` again) does not wait again."""
        if wake_at.tzinfo is None:
            raise ValueError(f"wait_until {step_key}: wake_at must be an aware datetime")
        step = again(f"step {step_key}", lambda: self.ledger.create_step(
            self.run_id, "wait", step_key=step_key, input_summary=wake_at.isoformat(),
            status="waiting_input", run_token=self.run_token))
        wake = datetime.fromisoformat(step.input_summary) if step.input_summary else wake_at
        if step.status is StepStatus.SUCCEEDED:
            return wake
        # The database's clock, which claim_run's not_before follows: a worker whose clock is
        # behind must not put a run that woke back to sleep.
        [due] = again(f"step {step_key}: due", lambda: self.ledger.execute("SELECT now() >= %s AS due", (wake,)))
        if not due["due"]:
            raise WaitingUntil(step_key, wake)
        self._end_wait(step, output_summary=wake.isoformat())
        return wake

    def wait_for_input(self, step_key: str, input_key: str, *, deadline: datetime | None = None,
                       timeout: timedelta | None = None) -> Any:
        """A durable wait for the input ``input_key`` (``send_input``), found again by ``step_key``:
        a ``wait`` step records the first call's deadline (``deadline``, an aware datetime, or
        ``timeout`` from now; neither: none), so a resume does not move it. Returns the input's
        payload (as stored: redacted) once it was sent, on every later resume too. Until then the
        wait parks the run (``wait_for_input``: its lease given up) and raises
        :class:`WaitingForInput`, which ends the agent's turn: the input, or the deadline, makes the
        run claimable and the agent runs again. Past the deadline without it the step expires and
        :class:`InputTimedOut` is raised, on every later resume too."""
        step = self._begin_wait(step_key, deadline, timeout)
        until = _deadline(step)
        if step.status is StepStatus.EXPIRED:
            raise InputTimedOut(step_key, input_key, until)
        answer = self._park(step_key, lambda: self.ledger.wait_for_input(self.run_id, self.run_token, input_key, until))
        if answer.status is WaitStatus.WAITING:
            raise WaitingForInput(step_key, input_key, until)
        if answer.status is WaitStatus.TIMED_OUT:
            self._move_step(step.id, StepStatus.EXPIRED)
            raise InputTimedOut(step_key, input_key, until)
        assert answer.input is not None
        if step.status is not StepStatus.SUCCEEDED:  # a resume reads the payload again from the mailbox
            self._end_wait(step, output_summary=answer.input.id)
        return answer.input.payload

    def wait_for_children(self, step_key: str, *, deadline: datetime | None = None,
                          timeout: timedelta | None = None) -> tuple[ChildRun, ...]:
        """A durable wait for the run's children (runs created with ``parent_run_id=ctx.run_id``),
        found again by ``step_key``, its deadline recorded as :meth:`wait_for_input` records it.
        Returns each child's outcome (oldest first) once every one has ended; the step keeps them
        (its ``metrics``), so a resume returns the same ones. Until then the wait parks the run and
        raises :class:`WaitingForChildren`: the last child's end, or the deadline, makes the run
        claimable again. Past the deadline first: :class:`ChildrenTimedOut`, with the children as
        they stood."""
        step = self._begin_wait(step_key, deadline, timeout)
        until = _deadline(step)
        if step.status in (StepStatus.SUCCEEDED, StepStatus.EXPIRED):
            kept = tuple(ChildRun.from_row(c) for c in step.metrics.get("children", ()))
            if step.status is StepStatus.EXPIRED:
                raise ChildrenTimedOut(step_key, until, kept)
            return kept
        answer = self._park(step_key, lambda: self.ledger.wait_for_children(self.run_id, self.run_token, until))
        if answer.status is WaitStatus.WAITING:
            raise WaitingForChildren(step_key, until, answer.children)
        metrics = {"children": [asdict(c) for c in answer.children]}
        if answer.status is WaitStatus.TIMED_OUT:
            self._move_step(step.id, StepStatus.EXPIRED, metrics=metrics)
            raise ChildrenTimedOut(step_key, until, answer.children)
        self._end_wait(step, output_summary=f"{len(answer.children)} children ended", metrics=metrics)
        return answer.children

    def _begin_wait(self, step_key: str, deadline: datetime | None, timeout: timedelta | None) -> Step:
        """The ``wait`` step of ``step_key``, created ``waiting_input`` with the deadline as its
        input summary (a resume finds the first call's)."""
        if deadline is not None and timeout is not None:
            raise ValueError(f"wait {step_key}: a deadline or a timeout, not both")
        if deadline is not None and deadline.tzinfo is None:
            raise ValueError(f"wait {step_key}: deadline must be an aware datetime")
        if timeout is not None:
            positive_seconds("timeout", timeout.total_seconds())
        until = datetime.now(timezone.utc) + timeout if timeout is not None else deadline
        return again(f"step {step_key}", lambda: self.ledger.create_step(
            self.run_id, "wait", step_key=step_key, input_summary=until.isoformat() if until else None,
            status="waiting_input", run_token=self.run_token))

    def _park(self, step_key: str, ask: Callable[[], T]) -> T:
        # A try whose commit was lost with its answer may have parked the run: the repeat is then
        # LEASE_STALE, and the worker writes nothing more, as for a parked run.
        return again(f"step {step_key}: wait", ask)

    def _end_wait(self, step: Step, **fields: Any) -> None:
        if step.status is not StepStatus.RUNNING:
            self._move_step(step.id, StepStatus.RUNNING)  # waiting_input cannot go to succeeded directly
        self._move_step(step.id, StepStatus.SUCCEEDED, **fields)


def _deadline(step: Step) -> datetime | None:
    """The deadline a wait step recorded."""
    return datetime.fromisoformat(step.input_summary) if step.input_summary else None


class WaitingUntil(Exception):
    """Raised by :meth:`RunContext.wait_until` before the wake time: let it escape the agent, and a
    :class:`Worker` parks the run (``wait_run``) until ``wake_at``."""

    def __init__(self, step_key: str, wake_at: datetime) -> None:
        super().__init__(f"step {step_key}: waiting until {wake_at.isoformat()}")
        self.step_key = step_key
        self.wake_at = wake_at


class WaitingForInput(Exception):
    """Raised by :meth:`RunContext.wait_for_input` while the input has not come: the run is parked
    already (its lease given up); let it escape the agent, and a :class:`Worker` writes nothing
    more for it."""

    def __init__(self, step_key: str, input_key: str, deadline: datetime | None) -> None:
        until = f" until {deadline.isoformat()}" if deadline else ""
        super().__init__(f"step {step_key}: waiting for input {input_key}{until}")
        self.step_key = step_key
        self.input_key = input_key
        self.deadline = deadline


class InputTimedOut(Exception):
    """Raised by :meth:`RunContext.wait_for_input` when its deadline passed without the input: the
    agent decides (another wait under another ``step_key``, an answer without it); escaping the
    agent, it fails the run."""

    def __init__(self, step_key: str, input_key: str, deadline: datetime | None) -> None:
        super().__init__(f"step {step_key}: no input {input_key} by {deadline.isoformat() if deadline else '?'}")
        self.step_key = step_key
        self.input_key = input_key
        self.deadline = deadline


class WaitingForChildren(Exception):
    """Raised by :meth:`RunContext.wait_for_children` while a child runs: the run is parked already;
    let it escape the agent. ``children``: how they stood."""

    def __init__(self, step_key: str, deadline: datetime | None, children: tuple[ChildRun, ...]) -> None:
        running = sum(not c.status.terminal for c in children)
        super().__init__(f"step {step_key}: waiting for {running} of {len(children)} children")
        self.step_key = step_key
        self.deadline = deadline
        self.children = children


class ChildrenTimedOut(Exception):
    """Raised by :meth:`RunContext.wait_for_children` when its deadline passed before every child
    ended; ``children`` says how each stood (the agent may cancel the rest, or wait again under
    another ``step_key``)."""

    def __init__(self, step_key: str, deadline: datetime | None, children: tuple[ChildRun, ...]) -> None:
        running = sum(not c.status.terminal for c in children)
        super().__init__(f"step {step_key}: {running} of {len(children)} children still running at the deadline")
        self.step_key = step_key
        self.deadline = deadline
        self.children = children


Agent = Callable[[RunContext], str]
"""Your agent: drives one run through its context and returns the answer shown to the user."""


class Worker:
    """Claims runs (of ``scope``, or of every scope for a member of ``ledger_operator``) and drives
    each with ``agent``; see the module's docstring for what happens to a run."""

    def __init__(
        self,
        ledger: Ledger,
        agent: Agent,
        *,
        scope: tuple[str, str] | None = None,
        lease_owner: str | None = None,
        modes: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
        lease_seconds: int = 15,
        heartbeat_s: float | None = None,
        idle_s: float = IDLE_S,
        shutdown_grace_s: float = 30.0,
        stopping: threading.Event | None = None,
        fire_schedules_s: float | None = None,
    ) -> None:
        self.ledger = ledger
        self.agent = agent
        self.scope = scope
        self.lease_owner = lease_owner or default_lease_owner()
        self.modes = modes
        self.kinds = kinds
        self.lease_seconds = lease_seconds
        # Three beats may be lost before a takeover.
        self.heartbeat_s = positive_seconds("heartbeat_s", heartbeat_s) or lease_seconds / 3
        self.idle_s = idle_s
        # After Busy or a lost connection the run or the server comes back within seconds, and no
        # notification tells: try again soon, whatever the idle bound.
        self._retry_s = min(idle_s, 1.0)
        self.shutdown_grace_s = shutdown_grace_s
        self.stopping = stopping or threading.Event()  # shared with an OutboxConsumer: one stop for both
        self.fire_schedules_s = positive_seconds("fire_schedules_s", fire_schedules_s)
        self._next_fire = 0.0

    def stop(self) -> None:
        """Stops claiming; the current run finishes (or is released at the grace deadline)."""
        self.stopping.set()

    def run(self, *, handle_signals: bool = False) -> None:
        """Claims and drives runs until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals``);
        when nothing is claimable, sleeps until a run may be (see the module's docstring)."""
        with stop_on_signals(self.stopping, handle_signals), _Alarm(self) as alarm:
            while not self.stopping.is_set():
                alarm.listen()
                try:
                    claimed = self.run_once()
                except psycopg.OperationalError as e:  # the server restarts, the network drops
                    log.warning("worker %s: %s; claiming again in %s s", self.lease_owner, e, self._retry_s)
                    self.stopping.wait(self._retry_s)
                    continue
                if not claimed:
                    alarm.wait()

    def run_once(self) -> bool:
        """Claims one run and drives it (first firing the due schedules, with ``fire_schedules_s``);
        False when nothing was claimable."""
        if self.fire_schedules_s is not None and time.monotonic() >= self._next_fire:
            self._next_fire = time.monotonic() + self.fire_schedules_s
            fired = self.ledger.fire_schedules() if self.scope is None else self.ledger.scoped(*self.scope).fire_schedules()
            if fired:
                log.info("worker %s: fired %s schedule firings", self.lease_owner, fired)
        if self.scope is None:
            run = self.ledger.claim_run(self.lease_owner, modes=self.modes, kinds=self.kinds,
                                        lease_seconds=self.lease_seconds)
        else:
            run = self.ledger.scoped(*self.scope).claim_run(self.lease_owner, modes=self.modes, kinds=self.kinds,
                                                            lease_seconds=self.lease_seconds)
        if run is None:
            return False
        try:
            self._drive(run)
        except LedgerError as e:  # LEASE_STALE: taken over; else changed by someone (canceled, ...)
            log.warning("run %s: %s; it stays as the ledger has it", run.run_id, e)
        return True

    def _drive(self, run: ClaimedRun) -> None:
        ledger = self.ledger.scoped(run.tenant_id, run.workspace_id)
        if run.status is not RunStatus.RUNNING:
            try:
                again(f"run {run.run_id}: running",
                      lambda: ledger.transition_run(run.run_id, RunStatus.RUNNING, run_token=run.run_token))
            except psycopg.OperationalError as e:
                if not is_transient(e):
                    raise
                _release(ledger, run)
                return
        lease = _Lease(self, ledger, run)
        while True:
            answer: list[str] = []
            failure: list[BaseException] = []
            done = threading.Event()

            def agent() -> None:
                try:
                    answer.append(self.agent(RunContext(ledger, run)))
                except BaseException as e:  # handed to the driving thread, which decides
                    failure.append(e)
                finally:
                    done.set()

            threading.Thread(target=agent, name=f"agent {run.run_id}", daemon=True).start()
            if not lease.hold(done):
                return
            if not (failure and isinstance(failure[0], Busy)) or self.stopping.is_set():
                break
            # Another attempt holds a call (a previous owner still at work): keep the run and ask
            # again shortly; parking it would hand it straight back to the claim queue.
            if not lease.hold(threading.Event(), timeout=self._retry_s):
                return
        if answer:
            def finish(tx: Transaction) -> None:  # what the user is shown, and the end, at once
                tx.record_response_event(run.run_id, "message", {"text": answer[0]})
                tx.transition_run(run.run_id, RunStatus.SUCCEEDED, output_summary=answer[0], run_token=run.run_token)
            _end(ledger, run, RunStatus.SUCCEEDED, finish)
            return
        error = failure[0]
        if is_transient(error):
            log.warning("run %s: connection lost (%s); released to be resumed", run.run_id, error)
            _release(ledger, run)
        elif isinstance(error, Rejected):
            call = error.tool_call.tool_call_id if error.tool_call is not None else None
            note = error.approval.note if error.approval is not None else None
            expired = error.approval is not None and error.approval.status is ApprovalStatus.EXPIRED
            message = f"tool call {call or '?'}: approval {'expired' if expired else 'rejected'}" + (
                f": {note}" if note else "")
            code = "TOOL_APPROVAL_EXPIRED" if expired else "TOOL_APPROVAL_REJECTED"
            _end(ledger, run, RunStatus.FAILED, lambda tx: tx.transition_run(
                run.run_id, RunStatus.FAILED, error_code=code, error_message=message, run_token=run.run_token))
            log.info("run %s failed: %s", run.run_id, message)
        elif isinstance(error, (InDoubt, Busy, WaitingApproval, BudgetExhausted)):
            # A refusal by a budget paused the run already (BUDGET_EXHAUSTED): paused again keeps that.
            parked = RunStatus.WAITING_APPROVAL if isinstance(error, WaitingApproval) else RunStatus.PAUSED

            def park(tx: Transaction) -> None:  # parked and let go at once
                tx.transition_run(run.run_id, parked, run_token=run.run_token)
                tx.release_run(run.run_id, run.run_token)
            _end(ledger, run, parked, park)
            log.info("run %s parked %s: %s", run.run_id, parked, error)
        elif isinstance(error, WaitingUntil):
            wake_at = error.wake_at
            # wait_run gives the lease up itself: nothing is released after it (its token is over).
            _end(ledger, run, RunStatus.WAITING_INPUT, lambda tx: tx.wait_run(run.run_id, run.run_token, wake_at))
            log.info("run %s waits until %s", run.run_id, wake_at.isoformat())
        elif isinstance(error, (WaitingForInput, WaitingForChildren)):
            # The agent's wait parked the run and gave its lease up: nothing is written after it.
            log.info("run %s parked: %s", run.run_id, error)
        elif isinstance(error, ConflictError) and error.code == "LEASE_STALE":
            raise error
        elif isinstance(error, Exception):
            _end(ledger, run, RunStatus.FAILED, lambda tx: tx.transition_run(
                run.run_id, RunStatus.FAILED, error_code=type(error).__name__,
                error_message=str(error) or repr(error), run_token=run.run_token))
            log.info("run %s failed: %r", run.run_id, error)
        else:
            _release(ledger, run)
            raise error


def _end(ledger: ScopedLedger, run: ClaimedRun, status: RunStatus, write: Callable[[Transaction], object]) -> None:
    """The run's last write, again on a fresh connection when the connection is lost; a try whose
    commit was lost with its answer left the run in ``status``, and then nothing is repeated (the
    answer's event is written once). When every try is lost the run is released (or its lease
    runs out): never failed for a connection."""

    tries = 0

    def once() -> None:
        nonlocal tries
        tries += 1
        if tries > 1:  # only a repeat asks: the first try costs no extra round trip
            current = ledger.get_run(run.run_id)
            if current is not None and current.status == status:
                return
        with ledger.transaction() as tx:
            write(tx)

    try:
        again(f"run {run.run_id}: {status}", once)
    except psycopg.OperationalError as e:
        if not is_transient(e):
            raise
        log.warning("run %s: not moved to %s (%s); released", run.run_id, status, e)
        _release(ledger, run)


def _release(ledger: ScopedLedger, run: ClaimedRun) -> None:
    """Lets the run go (claimable at once); when the connection stays lost, its lease runs out."""
    try:
        again(f"run {run.run_id}: release", lambda: ledger.release_run(run.run_id, run.run_token))
    except psycopg.OperationalError as e:
        if not is_transient(e):
            raise
        log.warning("run %s: not released (%s); its lease runs out", run.run_id, e)


class _Lease:
    """The claimed run's lease while the worker drives it: heartbeats, and the grace deadline
    once a stop was requested."""

    def __init__(self, worker: Worker, ledger: ScopedLedger, run: ClaimedRun) -> None:
        self._worker = worker
        self._ledger = ledger
        self._run = run
        self._next_beat = time.monotonic() + worker.heartbeat_s
        self._deadline: float | None = None

    def hold(self, done: threading.Event, timeout: float | None = None) -> bool:
        """Heartbeats until ``done`` is set or ``timeout`` passed (True), or releases the run when
        the grace period of a stop request runs out first (False)."""
        until = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.1):
            now = time.monotonic()
            if until is not None and now >= until:
                return True
            if self._deadline is None and self._worker.stopping.is_set():
                self._deadline = now + self._worker.shutdown_grace_s
            if self._deadline is not None and now >= self._deadline:
                _release(self._ledger, self._run)
                log.warning("run %s released at shutdown, its agent unfinished", self._run.run_id)
                return False
            if now >= self._next_beat:
                try:
                    self._ledger.heartbeat_run(self._run.run_id, self._run.run_token)
                except (LedgerError, psycopg.OperationalError) as e:
                    log.warning("run %s: heartbeat failed (%s); its next write will say more", self._run.run_id, e)
                self._next_beat = now + self._worker.heartbeat_s
        return True


class _Alarm:
    """What wakes an idle worker: a connection of its own (autocommit) that LISTENs on
    ``ledger_runs`` and asks ``next_wake`` (of the worker's scope, or of every scope)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> _Alarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self._drop()

    def listen(self) -> None:
        """Before a claim: forgets what was notified so far (the claim sees those commits), or
        LISTENs on a new connection when there is none (or it was lost)."""
        if self._conn is not None:
            try:
                for _ in self._conn.notifies(timeout=0):
                    pass
                return
            except psycopg.OperationalError:
                self._drop()
        worker = self._worker
        try:
            self._conn = psycopg.connect(worker.ledger.conninfo, autocommit=True)
            with translated():
                if worker.scope is not None:  # for next_wake: the session's scope
                    self._conn.execute("SELECT ledger.set_scope(%s, %s)", worker.scope)
                self._conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.OperationalError as e:
            log.warning("worker %s: cannot listen on %s (%s); polling every %s s", worker.lease_owner, CHANNEL, e,
                        worker._retry_s)
            self._drop()

    def wait(self) -> None:
        """Until a notification, the next wake, the next schedule firing, ``idle_s`` or a stop,
        whichever comes first; without a listening connection, ``min(idle_s, 1)`` seconds."""
        worker = self._worker
        timeout = worker.idle_s
        if worker.fire_schedules_s is not None:
            timeout = min(timeout, worker._next_fire - time.monotonic())
        if self._conn is None:
            worker.stopping.wait(min(timeout, worker._retry_s))
            return
        try:
            with translated():
                row = self._conn.execute(_NEXT_WAKE_IN, (worker.scope is None,)).fetchone()
            if row is not None and row[0] is not None:
                timeout = min(timeout, float(row[0]))
            deadline = time.monotonic() + timeout
            # In short slices, so that stop() is seen promptly.
            while not worker.stopping.is_set() and (remaining := deadline - time.monotonic()) > 0:
                for _ in self._conn.notifies(timeout=min(remaining, 0.2), stop_after=1):
                    return
        except psycopg.OperationalError as e:
            log.warning("worker %s: %s lost (%s); listening again", worker.lease_owner, CHANNEL, e)
            self._drop()
            worker.stopping.wait(worker._retry_s)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
