"""The handle: :class:`Ledger` over a connection pool (or a conninfo string), and
:meth:`Ledger.scoped`, whose every call is one statement on a connection in autocommit that
states the scope for its own implicit transaction (``ledger.set_scope(..., is_local => true)``
inside the statement: one round trip, safe with pools and transaction pooling). Several calls that
must commit together go through :meth:`ScopedLedger.transaction`, which states the scope once.

The methods are the ledger's functions with their SQL names and arguments, typed; every rule
(status machine, fencing, redaction) stays in the extension. :meth:`LedgerCalls.execute` runs any
other SQL in a scoped transaction. Each is declared once in :class:`Calls` as a statement builder;
:mod:`ledger_client.aio` awaits the same declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.abc import Buffer
from psycopg.abc import QueryNoTemplate as Query
from psycopg.rows import dict_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import Jsonb

from .errors import translated
from .feed import follow
from .statement import Row, Scope, Statement, SyncRunner, call, function, scoped, value
from .types import (
    Approval,
    BudgetUsage,
    ChildrenWait,
    ClaimedRun,
    CostEntry,
    EvidenceItem,
    Inbox,
    InputWait,
    MailboxInput,
    OutboxEvent,
    PendingApproval,
    ReplayReady,
    ResponseEvent,
    Run,
    RunEvent,
    Schedule,
    Step,
    ToolCall,
    ToolCallClaim,
    ToolCallInDoubt,
)

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

T = TypeVar("T")

# psycopg's connect() arguments that are not libpq's, left out of a pool's conninfo
_NOT_LIBPQ = frozenset({"autocommit", "prepare_threshold", "context", "row_factory", "cursor_factory"})


def conninfo_of(source: str | Any) -> str:
    """The conninfo string itself, or a pool's conninfo with its libpq keyword arguments."""
    if isinstance(source, str):
        return source
    kwargs = {k: v for k, v in (source.kwargs or {}).items() if k not in _NOT_LIBPQ}
    return psycopg.conninfo.make_conninfo(source.conninfo, **kwargs)


def _run(rows: list[Row]) -> Run:
    return Run.from_row(rows[0])


def _step(rows: list[Row]) -> Step:
    return Step.from_row(rows[0])


def _claimed(rows: list[Row]) -> ClaimedRun | None:
    return ClaimedRun.from_row(rows[0]) if rows else None


def _nothing(rows: list[Row]) -> None:
    return None


def _schedule(rows: list[Row]) -> Schedule:
    return Schedule.from_row(rows[0])


def _replay_ready(rows: list[Row]) -> ReplayReady:
    answer = value(rows)
    return ReplayReady(status=answer["status"], missing=tuple(answer["missing"]))


def _claim(rows: list[Row]) -> ToolCallClaim:
    return ToolCallClaim.from_json(value(rows))


def _claims(rows: list[Row]) -> list[ToolCallClaim]:
    return [ToolCallClaim.from_json(r["claim"]) for r in sorted(rows, key=lambda r: int(r["index"]))]


def _tool_call(rows: list[Row]) -> ToolCall:
    return ToolCall.from_row(value(rows)["tool_call"])


def _outbox_events(rows: list[Row]) -> list[OutboxEvent]:
    return [OutboxEvent.from_row(r) for r in rows]


def _numeric(amount: Decimal | float | None) -> Decimal | None:
    """An amount for a ``numeric`` argument (a float as its shortest decimal text: ``0.1`` is
    ``0.1``); psycopg would send a float as ``float8``, which no ``numeric`` parameter takes."""
    return None if amount is None else Decimal(str(amount))


class Calls:
    """The ledger's functions, typed, each declared once as a statement builder (:class:`call`):
    :class:`LedgerCalls` runs them, :class:`~ledger_client.aio.AsyncLedgerCalls` awaits them."""

    @call
    def execute(self, query: Query, params: Sequence[Any] = ()) -> Statement[list[Row]]:
        """Any SQL, in this handle's scoped transaction: the rows as dicts (none for a statement
        without a result). Ledger errors come back as :class:`~ledger_client.LedgerError`."""
        return Statement(query, params, list, relation=False)

    # Runs

    @call
    def create_run(
        self,
        mode: str,
        inputs: Mapping[str, Any] | None = None,
        *,
        kind: str | None = None,
        subject_kind: str | None = None,
        subject_id: str | None = None,
        subject_version_id: str | None = None,
        request_id: str | None = None,
        parent_run_id: str | None = None,
        source_run_id: str | None = None,
        attempt_no: int | None = None,
        run_id: str | None = None,
        user_id: str | None = None,
        trace_id: str | None = None,
        input_summary: str | None = None,
        not_before: datetime | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
    ) -> Statement[Run]:
        """A new ``queued`` run (or the existing one for a repeated ``request_id``/``run_id``),
        claimable from ``not_before`` (an aware datetime; None: at once), ``claim_run`` taking the
        highest ``priority`` (-1000 to 1000, default 0) first and no more runs of
        ``concurrency_key`` than its limit (``set_concurrency_limit``)."""
        return function(
            _run, "create_run", mode, inputs=dict(inputs) if inputs is not None else None, kind=kind,
            subject_kind=subject_kind, subject_id=subject_id, subject_version_id=subject_version_id,
            request_id=request_id, parent_run_id=parent_run_id, source_run_id=source_run_id,
            attempt_no=attempt_no, run_id=run_id, user_id=user_id, trace_id=trace_id,
            input_summary=input_summary, not_before=not_before, priority=priority,
            concurrency_key=concurrency_key,
        )

    @call
    def set_concurrency_limit(self, concurrency_key: str, max_in_flight: int | None) -> Statement[int | None]:
        """At most ``max_in_flight`` runs of ``concurrency_key`` in flight (0 pauses the key; None
        removes the limit); returns the limit in force."""
        return function(value, "set_concurrency_limit", concurrency_key, max_in_flight)

    @call
    def set_rate_limit(self, concurrency_key: str, max_claims: int | None, per_seconds: int = 60) -> Statement[int | None]:
        """At most ``max_claims`` claims of ``concurrency_key``'s runs per window of ``per_seconds``
        (0 pauses the key; None removes the rate); returns the rate in force."""
        return function(value, "set_rate_limit", concurrency_key, max_claims, per_seconds=per_seconds)

    @call
    def set_budget(
        self,
        unit: str,
        max_amount: Decimal | float | None,
        *,
        level: str = "workspace",
        run_id: str | None = None,
        period: str = "total",
        warn_ratio: Decimal | float | None = 0.8,
        actor: str | None = None,
        note: str | None = None,
    ) -> Statement[BudgetUsage | None]:
        """At most ``max_amount`` of ``unit`` (``tokens``, ``tool_calls``, ``llm_steps`` or a
        currency code) per ``period`` (``total``, ``day``, ``month``: UTC) for the scope's
        workspace, its ``tenant`` or one ``run`` (``level``, ``run_id``): tool-call claims and
        ``llm`` steps are refused (``budget_exhausted``) while it is used up. ``warn_ratio`` of it
        writes ``budget.warning`` (None: no warning); ``actor`` and ``note`` go to the audit record.
        Returns the budget as :meth:`budgets` shows it, or None once removed (``max_amount`` None)."""
        # By position, all: warn_ratio None means "no warning", which a left-out argument would not.
        return function(lambda rows: BudgetUsage.from_row(rows[0]) if rows else None, "set_budget", unit,
                        _numeric(max_amount), level, run_id, period, _numeric(warn_ratio), actor=actor, note=note)

    @call
    def budgets(self, run_id: str | None = None) -> Statement[list[BudgetUsage]]:
        """``ledger.budget_usage``: the scope's budgets (its tenant's, its workspace's, its runs'),
        or only those that apply to ``run_id`` (its tenant's, its workspace's and its own), each as
        spent in the window of now, the broadest first."""
        # The scope is stated in the query too: row-level security does not bind a superuser.
        query = ("SELECT * FROM ledger.budget_usage WHERE tenant_id = ledger.scope_tenant()"
                 " AND (workspace_id IS NULL OR workspace_id = ledger.scope_workspace())")
        params: list[Any] = []
        if run_id is not None:
            query += " AND (run_id IS NULL OR run_id = %s)"
            params.append(run_id)
        return Statement(query + " ORDER BY workspace_id NULLS FIRST, run_id NULLS FIRST, unit, period", params,
                         lambda rows: [BudgetUsage.from_row(r) for r in rows])

    @call
    def get_run(self, run_id: str) -> Statement[Run | None]:
        """The run as it is now, or None when the scope has no such run (the scope is stated in the
        query too: row-level security does not bind a superuser)."""
        return Statement("SELECT * FROM ledger.runs WHERE id = %s AND tenant_id = ledger.scope_tenant()"
                         " AND workspace_id = ledger.scope_workspace()", (run_id,),
                         lambda rows: Run.from_row(rows[0]) if rows else None)

    @call
    def transition_run(
        self,
        run_id: str,
        to_status: str,
        *,
        expected_status: str | None = None,
        output_summary: str | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
        error_step_id: str | None = None,
        run_token: int | None = None,
    ) -> Statement[Run]:
        return function(
            _run, "transition_run", run_id, str(to_status), expected_status=expected_status,
            output_summary=output_summary, error_code=error_code, error_message=error_message,
            error_step_id=error_step_id, run_token=run_token,
        )

    @call
    def retry_run(
        self, run_id: str, inputs: Mapping[str, Any] | None = None, *, not_before: datetime | None = None
    ) -> Statement[Run]:
        """A new attempt of a failed (or canceled, expired) run, queued, claimable from
        ``not_before`` (a backoff; None: at once); its tool calls with the same ``tool_call_id``
        reuse the results its lineage recorded (nothing sent twice)."""
        return function(
            _run, "retry_run", run_id, inputs=dict(inputs) if inputs is not None else None, not_before=not_before
        )

    @call
    def replay_run(
        self, run_id: str, inputs: Mapping[str, Any] | None = None, *, not_before: datetime | None = None
    ) -> Statement[Run]:
        """A new run replaying a finished one (any terminal status), claimable from ``not_before``."""
        return function(
            _run, "replay_run", run_id, inputs=dict(inputs) if inputs is not None else None, not_before=not_before
        )

    @call
    def claim_run(
        self,
        lease_owner: str,
        *,
        run_id: str | None = None,
        modes: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
        lease_seconds: int = 60,
    ) -> Statement[ClaimedRun | None]:
        """The claimed run (its ``run_token`` fences every later write), or None: nothing claimable."""
        return function(
            _claimed, "claim_run", lease_owner, run_id=run_id, modes=list(modes) if modes is not None else None,
            kinds=list(kinds) if kinds is not None else None, lease_seconds=lease_seconds,
        )

    @call
    def heartbeat_run(self, run_id: str, run_token: int, extend_seconds: int | None = None) -> Statement[datetime]:
        """Extends the owner's lease; returns when it now ends."""
        return function(value, "heartbeat_run", run_id, run_token, extend_seconds=extend_seconds)

    @call
    def release_run(self, run_id: str, run_token: int) -> Statement[None]:
        """Gives the run up: claimable at once, and ``run_token`` is over."""
        return function(_nothing, "release_run", run_id, run_token)

    @call
    def wait_run(self, run_id: str, run_token: int, wake_at: datetime) -> Statement[Run]:
        """A durable wait: the owner's ``preparing`` or ``running`` run moves to ``waiting_input``,
        its lease is given up (``run_token`` is over) and ``claim_run`` hands it out again, with a
        new token, from ``wake_at`` (an aware datetime; one in the past: at once) on."""
        return function(_run, "wait_run", run_id, run_token, wake_at)

    @call
    def next_wake(self) -> Statement[datetime | None]:
        """When a run of the scope next becomes claimable by the clock alone (a wait's or backoff's
        ``not_before``, a pending approval's deadline, a full rate window's end), or None when none
        is ahead. Whatever else makes a run claimable notifies ``ledger_runs`` at commit: an idle
        worker listens there and sleeps until this time at most."""
        return function(value, "next_wake")

    @call
    def wait_for_input(
        self, run_id: str, run_token: int, input_key: str, deadline: datetime | None = None
    ) -> Statement[InputWait]:
        """The owner's run waits for input ``input_key``: ``received`` (the input), ``timed_out``
        (``deadline`` passed without it), or ``waiting``: parked like ``wait_run`` (``run_token``
        is over) until the input arrives or the deadline (None: only the input wakes it). On resume
        ask again with the same key and deadline."""
        return function(lambda rows: InputWait.from_json(value(rows)), "wait_for_input", run_id, run_token,
                        input_key, deadline=deadline)

    @call
    def send_input(
        self, run_id: str, input_key: str, payload: Any = None, *, sender: str | None = None
    ) -> Statement[MailboxInput]:
        """Puts ``payload`` (any JSON value; None: ``{}``) in the run's mailbox under ``input_key``
        and wakes the run if it waits for it; the same key and payload again return the same input,
        another payload is an ``IdempotencyMismatchError``."""
        return function(lambda rows: MailboxInput.from_row(value(rows)), "send_input", run_id, input_key,
                        payload=Jsonb(payload) if payload is not None else None, sender=sender)

    @call
    def wait_for_children(
        self, run_id: str, run_token: int, deadline: datetime | None = None
    ) -> Statement[ChildrenWait]:
        """The owner's run waits for its children (runs created with ``parent_run_id=run_id``):
        ``done``, ``timed_out``, or ``waiting`` (parked as by ``wait_for_input`` until the last child
        ends or the deadline); each answer lists the children with how they stand."""
        return function(lambda rows: ChildrenWait.from_json(value(rows)), "wait_for_children", run_id, run_token,
                        deadline=deadline)

    # Schedules

    @call
    def set_schedule(
        self,
        schedule_id: str,
        cron: str,
        mode: str,
        inputs: Mapping[str, Any] | None = None,
        *,
        time_zone: str = "UTC",
        kind: str | None = None,
        catch_up: str = "latest",
        priority: int = 0,
        concurrency_key: str | None = None,
        actor: str | None = None,
    ) -> Statement[Schedule]:
        """Creates or replaces a schedule: at each time ``cron`` names in ``time_zone``,
        ``fire_schedules`` creates a run of ``mode`` (``kind``, ``inputs``, ``priority``,
        ``concurrency_key``); ``catch_up`` (``latest`` or ``all``) says what a sweep does with missed
        firings."""
        return function(
            _schedule, "set_schedule", schedule_id, cron, mode, inputs=dict(inputs) if inputs is not None else None,
            time_zone=time_zone, kind=kind, catch_up=catch_up, priority=priority, concurrency_key=concurrency_key,
            actor=actor,
        )

    @call
    def pause_schedule(self, schedule_id: str, paused: bool = True, *, actor: str | None = None) -> Statement[Schedule]:
        """Pauses (or, ``paused=False``, resumes) a schedule; resumed, it skips the firings it missed."""
        return function(_schedule, "pause_schedule", schedule_id, paused, actor=actor)

    @call
    def drop_schedule(self, schedule_id: str, *, actor: str | None = None) -> Statement[bool]:
        """Removes a schedule (its runs stay); returns whether it existed."""
        return function(value, "drop_schedule", schedule_id, actor=actor)

    @call
    def fire_schedules(self) -> Statement[int]:
        """Creates the runs of the scope's due firings (one per firing, however many sweepers fire
        it); returns how many firings it ran. Call it every minute, or let pg_cron."""
        return function(value, "fire_schedules")

    # Steps

    @call
    def create_step(
        self,
        run_id: str,
        step_type: str,
        *,
        step_key: str | None = None,
        node_id: str | None = None,
        input_summary: str | None = None,
        status: str | None = None,
        step_id: str | None = None,
        run_token: int | None = None,
    ) -> Statement[Step]:
        """A new step, or the run's step with this ``step_key`` as it is now (a resume)."""
        return function(
            _step, "create_step", run_id, step_type, step_key=step_key, node_id=node_id,
            input_summary=input_summary, status=status, step_id=step_id, run_token=run_token,
        )

    @call
    def transition_step(
        self,
        step_id: str,
        to_status: str,
        *,
        expected_status: str | None = None,
        output_summary: str | None = None,
        metrics: Mapping[str, Any] | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
        error_details: Any = None,
        run_token: int | None = None,
    ) -> Statement[Step]:
        return function(
            _step, "transition_step", step_id, str(to_status), expected_status=expected_status,
            output_summary=output_summary, metrics=dict(metrics) if metrics is not None else None,
            error_code=error_code, error_message=error_message,
            error_details=Jsonb(error_details) if error_details is not None else None, run_token=run_token,
        )

    # Evidence

    @call
    def record_cost(
        self,
        run_id: str,
        billing_basis: str,
        billed_quantity: int | Decimal,
        amount: Decimal | float | None = None,
        currency: str | None = None,
        *,
        step_id: str | None = None,
        usage: Mapping[str, Any] | None = None,
        pricing_snapshot: Mapping[str, Any] | None = None,
        provider: str | None = None,
        model_ref: str | None = None,
        tool_ref: str | None = None,
        source_port: str | None = None,
        operation: str | None = None,
        source_ref: str | None = None,
    ) -> Statement[CostEntry]:
        """A cost entry; pass money as a Decimal (a float is taken as its shortest decimal text)."""
        return function(
            lambda rows: CostEntry.from_row(rows[0]), "record_cost", run_id, billing_basis, Decimal(billed_quantity), amount=amount, currency=currency,
            step_id=step_id, usage=dict(usage) if usage is not None else None,
            pricing_snapshot=dict(pricing_snapshot) if pricing_snapshot is not None else None,
            provider=provider, model_ref=model_ref, tool_ref=tool_ref, source_port=source_port,
            operation=operation, source_ref=source_ref,
        )

    @call
    def record_response_event(
        self, run_id: str, event_type: str, payload: Mapping[str, Any] | None = None, *, step_id: str | None = None
    ) -> Statement[ResponseEvent]:
        """Records what the run showed its user (``message``, ``delta``, ...)."""
        return function(
            lambda rows: ResponseEvent.from_row(rows[0]), "record_response_event", run_id, event_type, payload=dict(payload) if payload is not None else None,
            step_id=step_id,
        )

    @call
    def events_since(self, run_id: str, after_event_id: str | None = None, max_events: int = 1000) -> Statement[list[RunEvent]]:
        """One page of the run's feed after the cursor (from the start when None), in seq order."""
        return function(lambda rows: [RunEvent.from_row(r) for r in rows],
                        "events_since", run_id, after_event_id=after_event_id, max_events=max_events)

    @call
    def replay_ready(self, run_id: str) -> Statement[ReplayReady]:
        return function(_replay_ready, "replay_ready", run_id)

    @call
    def run_evidence(self, run_id: str) -> Statement[list[EvidenceItem]]:
        return function(lambda rows: [EvidenceItem(**item) for item in value(rows)], "run_evidence", run_id)

    @call
    def replay_bundle(self, run_id: str) -> Statement[dict[str, Any]]:
        """Everything about the run in one read (documented jsonb, returned as a dict)."""
        return function(value, "replay_bundle", run_id)

    @call
    def otel_trace(self, run_id: str, service_name: str = "ledger") -> Statement[dict[str, Any]]:
        """The run as an OpenTelemetry trace, OTLP/JSON (send it with :mod:`ledger_client.otel`)."""
        return function(value, "otel_trace", run_id, service_name=service_name)

    # Tool calls

    @call
    def claim_tool_call(
        self,
        run_id: str,
        tool_ref: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        tool_call_id: str | None = None,
        idempotency_key: str | None = None,
        step_id: str | None = None,
        lease_owner: str | None = None,
        timeout_seconds: int | None = None,
        retry_failed: bool | None = None,
        approval: Mapping[str, Any] | None = None,
        run_token: int | None = None,
    ) -> Statement[ToolCallClaim]:
        """The claim's answer; its outcome is returned, never raised (see ``ClaimOutcome``)."""
        return function(
            _claim, "claim_tool_call", run_id, tool_ref, Jsonb(dict(arguments or {})), tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, step_id=step_id, lease_owner=lease_owner,
            timeout_seconds=timeout_seconds, retry_failed=retry_failed,
            approval=dict(approval) if approval is not None else None, run_token=run_token,
        )

    @call
    def claim_tool_calls(
        self,
        run_id: str,
        calls: Sequence[Mapping[str, Any]],
        *,
        lease_owner: str | None = None,
        begin: bool = False,
        run_token: int | None = None,
    ) -> Statement[list[ToolCallClaim]]:
        """The answers for one model turn's calls, in input order (``begin``: the claimed ones are
        begun too; commit before any request leaves)."""
        return function(
            _claims, "claim_tool_calls", run_id, Jsonb([dict(c) for c in calls]), lease_owner=lease_owner,
            begin=begin, run_token=run_token,
        )

    @call
    def find_tool_call(
        self,
        run_id: str,
        tool_ref: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        tool_call_id: str | None = None,
        idempotency_key: str | None = None,
        retry_failed: bool | None = None,
    ) -> Statement[ToolCallClaim]:
        """A repeatable call's lookup before it runs, writing nothing: ``replayed`` (the recorded
        result), ``unrecorded`` (run it, then ``record_tool_call``), or a side-effecting call's
        outcome."""
        return function(
            _claim, "find_tool_call", run_id, tool_ref, Jsonb(dict(arguments or {})), tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, retry_failed=retry_failed,
        )

    @call
    def record_tool_call(
        self,
        run_id: str,
        tool_ref: str,
        arguments: Mapping[str, Any],
        outcome: str,
        result: Any = None,
        *,
        error_message: str | None = None,
        tool_call_id: str | None = None,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        retry_failed: bool | None = None,
        run_token: int | None = None,
    ) -> Statement[ToolCallClaim]:
        """Records a repeatable call that ran (``succeeded`` or ``failed``) in one statement:
        ``recorded``, or the answer of the record that was first (``replayed``, ...)."""
        return function(
            _claim, "record_tool_call", run_id, tool_ref, Jsonb(dict(arguments)), outcome,
            result=Jsonb(result) if result is not None else None, error_message=error_message, tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, metadata=dict(metadata) if metadata is not None else None,
            retry_failed=retry_failed, run_token=run_token,
        )

    @call
    def begin_tool_call(self, tool_call_record_id: str, attempt: int) -> Statement[ToolCall]:
        """Marks the outbound boundary (status ``running``); commit before the request leaves."""
        return function(_tool_call, "begin_tool_call", tool_call_record_id, attempt)

    @call
    def heartbeat_tool_call(self, tool_call_record_id: str, attempt: int, extend_seconds: int | None = None) -> Statement[ToolCall]:
        return function(_tool_call, "heartbeat_tool_call", tool_call_record_id, attempt, extend_seconds=extend_seconds)

    @call
    def complete_tool_call(
        self,
        tool_call_record_id: str,
        attempt: int,
        outcome: str,
        result: Any = None,
        *,
        error_message: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Statement[ToolCall]:
        """Records how the attempt ended: ``succeeded``, ``failed`` or ``unknown`` (in doubt)."""
        return function(
            _tool_call, "complete_tool_call", tool_call_record_id, attempt, outcome,
            result=Jsonb(result) if result is not None else None, error_message=error_message,
            metadata=dict(metadata) if metadata is not None else None,
        )

    @call
    def resolve_tool_call(
        self,
        tool_call_record_id: str,
        decision: str,
        result: Any = None,
        *,
        actor: str | None = None,
        note: str | None = None,
    ) -> Statement[ToolCall]:
        """A person's decision on an in-doubt call: ``succeeded``, ``failed`` or ``retry``."""
        return function(
            _tool_call, "resolve_tool_call", tool_call_record_id, decision,
            result=Jsonb(result) if result is not None else None, actor=actor, note=note,
        )

    @call
    def request_tool_approval(
        self,
        run_id: str,
        tool_ref: str,
        arguments: Mapping[str, Any],
        *,
        tool_call_id: str | None = None,
        idempotency_key: str | None = None,
        title: str | None = None,
        policy_ref: str | None = None,
        details: Mapping[str, Any] | None = None,
        run_token: int | None = None,
        expires_in_seconds: int | None = None,
    ) -> Statement[ToolCallClaim]:
        """A call that waits for a person's decision (``waiting_approval``); with
        ``expires_in_seconds`` (1 to a year) the approval expires unless decided by then, and the
        call is rejected."""
        return function(
            _claim, "request_tool_approval", run_id, tool_ref, Jsonb(dict(arguments)), tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, title=title, policy_ref=policy_ref,
            details=dict(details) if details is not None else None, run_token=run_token,
            expires_in_seconds=expires_in_seconds,
        )

    @call
    def resolve_approval(
        self, approval_id: str, decision: str, *, actor: str | None = None, note: str | None = None
    ) -> Statement[Approval]:
        """``approved`` (the next claim gets ``claimed``) or ``rejected``; past the approval's
        deadline either is a ``WrongStateError`` (55000 ``APPROVAL_EXPIRED``)."""
        return function(lambda rows: Approval.from_row(value(rows)), "resolve_approval", approval_id, decision,
                        actor=actor, note=note)

    @call
    def sweep_tool_calls(self) -> Statement[int]:
        """Marks expired leases in doubt (begun) or claimable again (not begun), and expires the
        approvals past their deadline (their calls rejected); returns how many."""
        return function(value, "sweep_tool_calls")

    # Outbox

    @call
    def claim_outbox_events(self, lease_owner: str, max_events: int = 50, lease_seconds: int = 60) -> Statement[list[OutboxEvent]]:
        return function(_outbox_events, "claim_outbox_events", lease_owner, max_events=max_events,
                        lease_seconds=lease_seconds)

    @call
    def ack_outbox_events(self, lease_owner: str, event_ids: Sequence[str]) -> Statement[int]:
        """Marks the listed events this owner holds as done; returns how many."""
        return Statement("SELECT ledger.ack_outbox_events(%s, %s::text[]) AS n", (lease_owner, list(event_ids)), value)

    @call
    def nack_outbox_events(self, lease_owner: str, event_ids: Sequence[str], error_message: str) -> Statement[list[OutboxEvent]]:
        """Reports a failed delivery: each event is due again after the ledger's backoff."""
        return Statement("SELECT * FROM ledger.nack_outbox_events(%s, %s::text[], %s)",
                         (lease_owner, list(event_ids), error_message), _outbox_events)

    @call
    def replay_outbox_event(self, event_id: str, *, actor: str, note: str | None = None) -> Statement[OutboxEvent]:
        """Puts a ``failed`` event back to ``pending`` with another 64 attempts, and records who did
        it and why in the same transaction (audit ``outbox.replay``, outcome ``replayed``)."""
        # actor goes by position: a None left out would call the overload that audits nothing.
        return function(lambda rows: OutboxEvent.from_row(rows[0]), "replay_outbox_event", event_id, actor, note=note)

    # The people's queues (each needs the scope, as every read)

    @call
    def tool_calls_in_doubt(self, run_id: str | None = None, *, limit: int | None = None) -> Statement[list[ToolCallInDoubt]]:
        """``ledger.tool_calls_in_doubt`` with each call's arguments as stored (redacted), oldest
        first (``run_id``: that run's only; ``limit``: at most so many): decide each with
        ``resolve_tool_call``."""
        # The view has no arguments: they come from the call's row, which the scope may read.
        return _queue(
            "SELECT d.*, t.arguments FROM ledger.tool_calls_in_doubt d JOIN ledger.run_step_tool_calls t"
            f" ON {_SCOPED} AND t.id = d.id", "d", "d.updated_at, d.id", run_id, limit,
            lambda rows: [ToolCallInDoubt.from_row(r) for r in rows])

    @call
    def pending_approvals(self, run_id: str | None = None, *, limit: int | None = None) -> Statement[list[PendingApproval]]:
        """``ledger.pending_approvals`` (with the call's arguments as stored, redacted) and each
        call's ``tool_call_id``, oldest first (``run_id``, ``limit`` as in :meth:`tool_calls_in_doubt`): decide
        each with ``resolve_approval``."""
        return _queue(
            "SELECT p.*, t.tool_call_id FROM ledger.pending_approvals p"
            f" LEFT JOIN ledger.run_step_tool_calls t ON {_SCOPED} AND t.id = p.tool_call_record_id",
            "p", "p.created_at, p.id", run_id, limit, lambda rows: [PendingApproval.from_row(r) for r in rows])

    @call
    def failed_outbox_events(self, run_id: str | None = None, *, limit: int | None = None) -> Statement[list[OutboxEvent]]:
        """The scope's ``failed`` outbox events (out of attempts), oldest first (``run_id``,
        ``limit`` as in :meth:`tool_calls_in_doubt`): put one back with ``replay_outbox_event``
        once its consumer can take it."""
        return _queue(
            "SELECT o.tenant_id, o.workspace_id, o.id, o.event_type, o.run_id, o.task_id, o.subject, o.payload,"
            " o.status, o.attempt_count, o.replay_count, o.available_at, o.lease_expires_at, o.error_message,"
            " o.occurred_at, o.processed_at FROM ledger.outbox o WHERE o.tenant_id = ledger.scope_tenant()"
            " AND o.workspace_id = ledger.scope_workspace() AND o.status = 'failed'",
            "o", "o.occurred_at, o.id", run_id, limit, _outbox_events)

    @call
    def inbox(self) -> Statement[Inbox]:
        """What waits for people in the scope (``ledger.inbox``): the three queues above and the runs
        a budget still used up stopped, counted, with the oldest one's time; zeros when nothing waits."""
        return function(lambda rows: Inbox.from_row(rows[0]), "inbox")


# The joined call row in the caller's scope (row-level security does not bind a superuser).
_SCOPED = "t.tenant_id = ledger.scope_tenant() AND t.workspace_id = ledger.scope_workspace()"


def _queue(select: str, alias: str, order: str, run_id: str | None, limit: int | None,
           decode: Callable[[list[Row]], T]) -> Statement[T]:
    """A people's queue: ``select`` narrowed to one run, ordered, limited."""
    where = " AND " if " WHERE " in select else " WHERE "
    params: list[Any] = []
    if run_id is not None:
        select += f"{where}{alias}.run_id = %s"
        params.append(run_id)
    select += f" ORDER BY {order}"
    if limit is not None:
        select += " LIMIT %s"
        params.append(limit)
    return Statement(select, params, decode)


class LedgerCalls(Calls, SyncRunner):
    """The sync face of :class:`Calls`: each method runs its statement and returns the result."""


class _InfinityLoader(TimestamptzLoader):
    """timestamptz with 'infinity' and '-infinity' as ``datetime.max`` and ``datetime.min`` in UTC:
    a run that waits for an input without a deadline has ``not_before`` 'infinity' (kept after it
    ends), which psycopg's own loader refuses, so the run could not be read."""

    def load(self, data: Buffer) -> datetime:
        if bytes(data) == b"infinity":
            return datetime.max.replace(tzinfo=timezone.utc)
        if bytes(data) == b"-infinity":
            return datetime.min.replace(tzinfo=timezone.utc)
        return super().load(data)


def _fetch(cur: psycopg.Cursor[Row], query: Query, params: Sequence[Any]) -> list[Row]:
    # On the cursor, not the connection: a connection of the caller's pool keeps its own loaders.
    cur.adapters.register_loader("timestamptz", _InfinityLoader)
    cur.execute(query, params)
    return cur.fetchall() if cur.description else []


class Transaction(LedgerCalls):
    """The calls on one connection inside an open transaction (``connection`` is the psycopg
    connection, for anything else); everything commits or rolls back together."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection

    def _run(self, statement: Statement[T]) -> T:
        with translated(), self.connection.cursor(row_factory=dict_row) as cur:
            return statement.decode(_fetch(cur, statement.query, statement.params))


class OperatorCalls:
    """What an operator calls without a scope (``any_scope``: members of ``ledger_operator``)."""

    @call
    def claim_run(
        self,
        lease_owner: str,
        *,
        modes: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
        lease_seconds: int = 60,
    ) -> Statement[ClaimedRun | None]:
        """The oldest claimable run of any scope; the run comes back with its ``tenant_id`` and
        ``workspace_id``."""
        return function(
            _claimed, "claim_run", lease_owner, modes=list(modes) if modes is not None else None,
            kinds=list(kinds) if kinds is not None else None, lease_seconds=lease_seconds, any_scope=True,
        )

    @call
    def next_wake(self) -> Statement[datetime | None]:
        """When a run of any scope next becomes claimable by the clock alone, or None
        (``next_wake(any_scope => true)``): what an idle worker of every scope sleeps until at most."""
        return function(value, "next_wake", any_scope=True)

    @call
    def inbox(self) -> Statement[list[Inbox]]:
        """What waits for people in every scope that has something waiting
        (``inbox(any_scope => true)``), by tenant and workspace."""
        return function(lambda rows: [Inbox.from_row(r) for r in rows], "inbox", any_scope=True)

    @call
    def fire_schedules(self) -> Statement[int]:
        """The due firings of every scope's schedules (``fire_schedules(any_scope => true)``)."""
        return function(value, "fire_schedules", any_scope=True)

    @call
    def claim_outbox_events(
        self, lease_owner: str, max_events: int = 50, lease_seconds: int = 60
    ) -> Statement[list[OutboxEvent]]:
        """The oldest due outbox events of every scope, each with its scope."""
        return function(_outbox_events, "claim_outbox_events", lease_owner, max_events=max_events,
                        lease_seconds=lease_seconds, any_scope=True)


class Ledger(OperatorCalls, SyncRunner):
    """The ledger behind a psycopg_pool ``ConnectionPool`` or a conninfo string (a new connection
    per call: fine for scripts, a pool for services)."""

    def __init__(self, source: str | ConnectionPool[Any]) -> None:
        self._source = source

    @contextmanager
    def connection(self, *, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool (or a new one), given back (closed) at the end."""
        if isinstance(self._source, str):
            with psycopg.connect(self._source, autocommit=autocommit) as conn:
                yield conn
            return
        with self._source.connection() as conn:
            before = conn.autocommit
            conn.autocommit = autocommit
            try:
                yield conn
            finally:
                if not conn.closed and not conn.broken:  # a broken one the pool discards
                    conn.rollback()
                    conn.autocommit = before

    @property
    def conninfo(self) -> str:
        """Where the ledger is: the conninfo string, or the pool's."""
        return conninfo_of(self._source)

    def scoped(self, tenant_id: str, workspace_id: str) -> ScopedLedger:
        """The handle of one scope."""
        return ScopedLedger(self, tenant_id, workspace_id)

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """A transaction without a scope: the operator calls, or ``set_scope`` yourself."""
        with self.connection() as conn, translated(), conn.transaction():
            yield Transaction(conn)

    def _run(self, statement: Statement[T]) -> T:
        with self.connection(autocommit=True) as conn, translated(), conn.cursor(row_factory=dict_row) as cur:
            return statement.decode(_fetch(cur, statement.query, statement.params))


class ScopedLedger(Scope["Ledger"], LedgerCalls):
    """The handle of one scope: each call is one statement, its own implicit transaction, that
    states the scope for itself only."""

    feed = follow
    """The run's events, each once, in order, to the end of the run: :func:`~ledger_client.follow`."""

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Several calls (or any SQL) in one transaction of this scope, committed at the end and
        rolled back on an exception."""
        with self.ledger.connection() as conn, translated(), conn.transaction():
            conn.execute("SELECT ledger.set_scope(%s, %s, is_local => true)", (self.tenant_id, self.workspace_id))
            yield Transaction(conn)

    def _run(self, statement: Statement[T]) -> T:
        if not statement.relation:
            with self.transaction() as tx:
                return tx._run(statement)
        query, params = scoped(statement, self.tenant_id, self.workspace_id)
        with self.ledger.connection(autocommit=True) as conn, translated(), conn.cursor(row_factory=dict_row) as cur:
            return statement.decode(_fetch(cur, query, params))
