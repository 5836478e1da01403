"""The handle: :class:`Ledger` over a connection pool (or a conninfo string), and
:meth:`Ledger.scoped`, whose every call takes a connection, opens a transaction, states the scope
with ``ledger.set_scope(..., is_local => true)`` (safe with pools and transaction pooling) and
commits. Several calls that must commit together go through :meth:`ScopedLedger.transaction`.

The methods are the ledger's functions with their SQL names and arguments, typed; every rule
(status machine, fencing, redaction) stays in the extension. :meth:`LedgerCalls.execute` runs any
other SQL in the same scoped transaction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.abc import QueryNoTemplate as Query
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .errors import translated
from .types import (
    Approval,
    ClaimedRun,
    CostEntry,
    EvidenceItem,
    OutboxEvent,
    ReplayReady,
    ResponseEvent,
    Run,
    RunEvent,
    Step,
    ToolCall,
    ToolCallClaim,
)

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

Row = dict[str, Any]


def _json(value: Any) -> Any:
    """Dicts as jsonb parameters (lists stay arrays: ``text[]``); anything else as it is."""
    return Jsonb(value) if isinstance(value, dict) else value


def _call(function: str, args: Sequence[Any], named: Mapping[str, Any] | None = None) -> tuple[sql.Composed, list[Any]]:
    """``SELECT * FROM ledger.<function>(%s, ..., name => %s, ...)``; named arguments that are None
    are left out, so the SQL default applies."""
    given = {k: v for k, v in (named or {}).items() if v is not None}
    parts = [sql.SQL("%s")] * len(args) + [
        sql.SQL("{} => %s").format(sql.Identifier(name)) for name in given
    ]
    query = sql.SQL("SELECT * FROM ledger.{}({})").format(sql.Identifier(function), sql.SQL(", ").join(parts))
    return query, [_json(a) for a in args] + [_json(v) for v in given.values()]


class LedgerCalls(ABC):
    """The ledger's functions, typed. Subclasses say where each statement runs."""

    @abstractmethod
    def _rows(self, query: Query, params: Sequence[Any] = ()) -> list[Row]:
        """Runs one statement; its rows as dicts."""

    def _fn(self, function: str, *args: Any, **named: Any) -> list[Row]:
        query, params = _call(function, args, named)
        return self._rows(query, params)

    def _value(self, function: str, *args: Any, **named: Any) -> Any:
        """The single value a scalar function returns."""
        return next(iter(self._fn(function, *args, **named)[0].values()))

    def execute(self, query: Query, params: Sequence[Any] = ()) -> list[Row]:
        """Any SQL, in this handle's scoped transaction: the rows as dicts (none for a statement
        without a result). Ledger errors come back as :class:`~ledger_client.LedgerError`."""
        return self._rows(query, params)

    # Runs

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
    ) -> Run:
        """A new ``queued`` run (or the existing one for a repeated ``request_id``/``run_id``)."""
        return Run.from_row(self._fn(
            "create_run", mode, inputs=dict(inputs) if inputs is not None else None, kind=kind,
            subject_kind=subject_kind, subject_id=subject_id, subject_version_id=subject_version_id,
            request_id=request_id, parent_run_id=parent_run_id, source_run_id=source_run_id,
            attempt_no=attempt_no, run_id=run_id, user_id=user_id, trace_id=trace_id,
            input_summary=input_summary,
        )[0])

    def get_run(self, run_id: str) -> Run | None:
        """The run as it is now, or None when the scope has no such run (the scope is stated in the
        query too: row-level security does not bind a superuser)."""
        rows = self._rows("SELECT * FROM ledger.runs WHERE id = %s AND tenant_id = ledger.scope_tenant()"
                          " AND workspace_id = ledger.scope_workspace()", (run_id,))
        return Run.from_row(rows[0]) if rows else None

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
    ) -> Run:
        return Run.from_row(self._fn(
            "transition_run", run_id, str(to_status), expected_status=expected_status,
            output_summary=output_summary, error_code=error_code, error_message=error_message,
            error_step_id=error_step_id, run_token=run_token,
        )[0])

    def retry_run(self, run_id: str, inputs: Mapping[str, Any] | None = None) -> Run:
        """A new attempt of a failed (or canceled, expired) run, queued; its tool calls with the
        same ``tool_call_id`` reuse the results its lineage recorded (nothing sent twice)."""
        return Run.from_row(self._fn("retry_run", run_id, inputs=dict(inputs) if inputs is not None else None)[0])

    def replay_run(self, run_id: str, inputs: Mapping[str, Any] | None = None) -> Run:
        """A new run replaying a finished one (any terminal status)."""
        return Run.from_row(self._fn("replay_run", run_id, inputs=dict(inputs) if inputs is not None else None)[0])

    def claim_run(
        self,
        lease_owner: str,
        *,
        run_id: str | None = None,
        modes: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
        lease_seconds: int = 60,
    ) -> ClaimedRun | None:
        """The claimed run (its ``run_token`` fences every later write), or None: nothing claimable."""
        rows = self._fn(
            "claim_run", lease_owner, run_id=run_id, modes=list(modes) if modes is not None else None,
            kinds=list(kinds) if kinds is not None else None, lease_seconds=lease_seconds,
        )
        return ClaimedRun.from_row(rows[0]) if rows else None

    def heartbeat_run(self, run_id: str, run_token: int, extend_seconds: int | None = None) -> datetime:
        """Extends the owner's lease; returns when it now ends."""
        result: datetime = self._value("heartbeat_run", run_id, run_token, extend_seconds=extend_seconds)
        return result

    def release_run(self, run_id: str, run_token: int) -> None:
        """Gives the run up: claimable at once, and ``run_token`` is over."""
        self._fn("release_run", run_id, run_token)

    # Steps

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
    ) -> Step:
        """A new step, or the run's step with this ``step_key`` as it is now (a resume)."""
        return Step.from_row(self._fn(
            "create_step", run_id, step_type, step_key=step_key, node_id=node_id,
            input_summary=input_summary, status=status, step_id=step_id, run_token=run_token,
        )[0])

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
    ) -> Step:
        return Step.from_row(self._fn(
            "transition_step", step_id, str(to_status), expected_status=expected_status,
            output_summary=output_summary, metrics=dict(metrics) if metrics is not None else None,
            error_code=error_code, error_message=error_message,
            error_details=Jsonb(error_details) if error_details is not None else None, run_token=run_token,
        )[0])

    # Evidence

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
    ) -> CostEntry:
        """A cost entry; pass money as a Decimal (a float is taken as its shortest decimal text)."""
        return CostEntry.from_row(self._fn(
            "record_cost", run_id, billing_basis, Decimal(billed_quantity), amount=amount, currency=currency,
            step_id=step_id, usage=dict(usage) if usage is not None else None,
            pricing_snapshot=dict(pricing_snapshot) if pricing_snapshot is not None else None,
            provider=provider, model_ref=model_ref, tool_ref=tool_ref, source_port=source_port,
            operation=operation, source_ref=source_ref,
        )[0])

    def record_response_event(
        self, run_id: str, event_type: str, payload: Mapping[str, Any] | None = None, *, step_id: str | None = None
    ) -> ResponseEvent:
        """Records what the run showed its user (``message``, ``delta``, ...)."""
        return ResponseEvent.from_row(self._fn(
            "record_response_event", run_id, event_type, payload=dict(payload) if payload is not None else None,
            step_id=step_id,
        )[0])

    def events_since(self, run_id: str, after_event_id: str | None = None, max_events: int = 1000) -> list[RunEvent]:
        """One page of the run's feed after the cursor (from the start when None), in seq order."""
        return [RunEvent.from_row(r) for r in self._fn(
            "events_since", run_id, after_event_id=after_event_id, max_events=max_events)]

    def replay_ready(self, run_id: str) -> ReplayReady:
        answer = self._value("replay_ready", run_id)
        return ReplayReady(status=answer["status"], missing=tuple(answer["missing"]))

    def run_evidence(self, run_id: str) -> list[EvidenceItem]:
        return [EvidenceItem(**item) for item in self._value("run_evidence", run_id)]

    def replay_bundle(self, run_id: str) -> dict[str, Any]:
        """Everything about the run in one read (documented jsonb, returned as a dict)."""
        bundle: dict[str, Any] = self._value("replay_bundle", run_id)
        return bundle

    def otel_trace(self, run_id: str, service_name: str = "ledger") -> dict[str, Any]:
        """The run as an OpenTelemetry trace, OTLP/JSON (send it with :mod:`ledger_client.otel`)."""
        trace: dict[str, Any] = self._value("otel_trace", run_id, service_name=service_name)
        return trace

    # Tool calls

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
    ) -> ToolCallClaim:
        """The claim's answer; its outcome is returned, never raised (see ``ClaimOutcome``)."""
        return ToolCallClaim.from_json(self._value(
            "claim_tool_call", run_id, tool_ref, Jsonb(dict(arguments or {})), tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, step_id=step_id, lease_owner=lease_owner,
            timeout_seconds=timeout_seconds, retry_failed=retry_failed,
            approval=dict(approval) if approval is not None else None, run_token=run_token,
        ))

    def claim_tool_calls(
        self,
        run_id: str,
        calls: Sequence[Mapping[str, Any]],
        *,
        lease_owner: str | None = None,
        begin: bool = False,
        run_token: int | None = None,
    ) -> list[ToolCallClaim]:
        """The answers for one model turn's calls, in input order (``begin``: the claimed ones are
        begun too; commit before any request leaves)."""
        rows = self._fn(
            "claim_tool_calls", run_id, Jsonb([dict(c) for c in calls]), lease_owner=lease_owner,
            begin=begin, run_token=run_token,
        )
        return [ToolCallClaim.from_json(r["claim"]) for r in sorted(rows, key=lambda r: int(r["index"]))]

    def begin_tool_call(self, tool_call_record_id: str, attempt: int) -> ToolCall:
        """Marks the outbound boundary (status ``running``); commit before the request leaves."""
        return self._tool_call("begin_tool_call", tool_call_record_id, attempt)

    def heartbeat_tool_call(self, tool_call_record_id: str, attempt: int, extend_seconds: int | None = None) -> ToolCall:
        return self._tool_call("heartbeat_tool_call", tool_call_record_id, attempt, extend_seconds=extend_seconds)

    def complete_tool_call(
        self,
        tool_call_record_id: str,
        attempt: int,
        outcome: str,
        result: Any = None,
        *,
        error_message: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ToolCall:
        """Records how the attempt ended: ``succeeded``, ``failed`` or ``unknown`` (in doubt)."""
        return self._tool_call(
            "complete_tool_call", tool_call_record_id, attempt, outcome,
            result=Jsonb(result) if result is not None else None, error_message=error_message,
            metadata=dict(metadata) if metadata is not None else None,
        )

    def resolve_tool_call(
        self,
        tool_call_record_id: str,
        decision: str,
        result: Any = None,
        *,
        actor: str | None = None,
        note: str | None = None,
    ) -> ToolCall:
        """A person's decision on an in-doubt call: ``succeeded``, ``failed`` or ``retry``."""
        return self._tool_call(
            "resolve_tool_call", tool_call_record_id, decision,
            result=Jsonb(result) if result is not None else None, actor=actor, note=note,
        )

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
    ) -> ToolCallClaim:
        return ToolCallClaim.from_json(self._value(
            "request_tool_approval", run_id, tool_ref, Jsonb(dict(arguments)), tool_call_id=tool_call_id,
            idempotency_key=idempotency_key, title=title, policy_ref=policy_ref,
            details=dict(details) if details is not None else None, run_token=run_token,
        ))

    def resolve_approval(
        self, approval_id: str, decision: str, *, actor: str | None = None, note: str | None = None
    ) -> Approval:
        """``approved`` (the next claim gets ``claimed``) or ``rejected``."""
        return Approval.from_row(self._value("resolve_approval", approval_id, decision, actor=actor, note=note))

    def sweep_tool_calls(self) -> int:
        """Marks expired leases in doubt (begun) or claimable again (not begun); returns how many."""
        count: int = self._value("sweep_tool_calls")
        return count

    def _tool_call(self, function: str, *args: Any, **named: Any) -> ToolCall:
        record = self._value(function, *args, **named)["tool_call"]
        return ToolCall.from_row(record)

    # Outbox

    def claim_outbox_events(self, lease_owner: str, max_events: int = 50, lease_seconds: int = 60) -> list[OutboxEvent]:
        return [OutboxEvent.from_row(r) for r in self._fn(
            "claim_outbox_events", lease_owner, max_events=max_events, lease_seconds=lease_seconds)]

    def ack_outbox_events(self, lease_owner: str, event_ids: Sequence[str]) -> int:
        """Marks the listed events this owner holds as done; returns how many."""
        rows = self._rows("SELECT ledger.ack_outbox_events(%s, %s::text[]) AS n", (lease_owner, list(event_ids)))
        count: int = rows[0]["n"]
        return count

    def nack_outbox_events(self, lease_owner: str, event_ids: Sequence[str], error_message: str) -> list[OutboxEvent]:
        """Reports a failed delivery: each event is due again after the ledger's backoff."""
        return [OutboxEvent.from_row(r) for r in self._rows(
            "SELECT * FROM ledger.nack_outbox_events(%s, %s::text[], %s)", (lease_owner, list(event_ids), error_message))]

    def replay_outbox_event(self, event_id: str, *, actor: str, note: str | None = None) -> OutboxEvent:
        """Puts a ``failed`` event back to ``pending`` with another 64 attempts, and records who did
        it and why in the same transaction (audit ``outbox.replay``, outcome ``replayed``)."""
        # actor goes by position: a None left out would call the overload that audits nothing.
        return OutboxEvent.from_row(self._fn("replay_outbox_event", event_id, actor, note=note)[0])


class Transaction(LedgerCalls):
    """The calls on one connection inside an open transaction (``connection`` is the psycopg
    connection, for anything else); everything commits or rolls back together."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection

    def _rows(self, query: Query, params: Sequence[Any] = ()) -> list[Row]:
        with translated(), self.connection.cursor(row_factory=dict_row) as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []


class Ledger:
    """The ledger behind a psycopg_pool ``ConnectionPool`` or a conninfo string (a new connection
    per transaction: fine for scripts, a pool for services)."""

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

    def scoped(self, tenant_id: str, workspace_id: str) -> ScopedLedger:
        """The handle of one scope."""
        return ScopedLedger(self, tenant_id, workspace_id)

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """A transaction without a scope: the operator calls below, or ``set_scope`` yourself."""
        with self.connection() as conn, translated(), conn.transaction():
            yield Transaction(conn)

    def claim_run(
        self,
        lease_owner: str,
        *,
        modes: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
        lease_seconds: int = 60,
    ) -> ClaimedRun | None:
        """The oldest claimable run of any scope (``any_scope``: members of ``ledger_operator``);
        the run comes back with its ``tenant_id`` and ``workspace_id``."""
        with self.transaction() as tx:
            rows = tx._fn(
                "claim_run", lease_owner, modes=list(modes) if modes is not None else None,
                kinds=list(kinds) if kinds is not None else None, lease_seconds=lease_seconds, any_scope=True,
            )
        return ClaimedRun.from_row(rows[0]) if rows else None

    def claim_outbox_events(self, lease_owner: str, max_events: int = 50, lease_seconds: int = 60) -> list[OutboxEvent]:
        """The oldest due outbox events of every scope (``any_scope``), each with its scope."""
        with self.transaction() as tx:
            rows = tx._fn("claim_outbox_events", lease_owner, max_events=max_events,
                          lease_seconds=lease_seconds, any_scope=True)
        return [OutboxEvent.from_row(r) for r in rows]


class ScopedLedger(LedgerCalls):
    """The handle of one scope: each call is its own committed transaction, whose first statement
    states the scope for that transaction only."""

    def __init__(self, ledger: Ledger, tenant_id: str, workspace_id: str) -> None:
        self.ledger = ledger
        self.tenant_id = tenant_id
        self.workspace_id = workspace_id

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Several calls (or any SQL) in one transaction of this scope, committed at the end and
        rolled back on an exception."""
        with self.ledger.connection() as conn, translated(), conn.transaction():
            conn.execute("SELECT ledger.set_scope(%s, %s, is_local => true)", (self.tenant_id, self.workspace_id))
            yield Transaction(conn)

    def _rows(self, query: Query, params: Sequence[Any] = ()) -> list[Row]:
        with self.transaction() as tx:
            return tx._rows(query, params)
