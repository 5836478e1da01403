"""Typed results of the ledger's functions: str-enums for statuses and outcomes, frozen dataclasses
for rows and the tool-call answers, each built from a row (or a JSON object) by ``from_row``.
Columns the ledger adds later are ignored, so a newer extension does not break an older client."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, Self, TypeVar


class RunStatus(StrEnum):
    """A run's (and a task's) status; ``ledger.status_transitions()`` says which moves are allowed."""

    QUEUED = "queued"
    PREPARING = "preparing"
    RUNNING = "running"
    WAITING_INPUT = "waiting_input"
    WAITING_APPROVAL = "waiting_approval"
    PAUSED = "paused"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {"succeeded", "failed", "canceled", "expired", "skipped"}


class StepStatus(StrEnum):
    """A step's status: the run's, plus ``skipped``."""

    QUEUED = "queued"
    PREPARING = "preparing"
    RUNNING = "running"
    WAITING_INPUT = "waiting_input"
    WAITING_APPROVAL = "waiting_approval"
    PAUSED = "paused"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"
    SKIPPED = "skipped"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


class ClaimOutcome(StrEnum):
    """What ``claim_tool_call`` (and each row of ``claim_tool_calls``) answers; ``find_tool_call``
    and ``record_tool_call`` (the repeatable path) also answer ``unrecorded`` and ``recorded``."""

    CLAIMED = "claimed"
    UNRECORDED = "unrecorded"
    RECORDED = "recorded"
    REPLAYED = "replayed"
    IN_DOUBT = "in_doubt"
    BUSY = "busy"
    WAITING_APPROVAL = "waiting_approval"
    REJECTED = "rejected"
    PURGED = "purged"
    BUDGET_EXHAUSTED = "budget_exhausted"


class ToolCallStatus(StrEnum):
    """A tool-call record's status."""

    WAITING_APPROVAL = "waiting_approval"
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"
    REJECTED = "rejected"


class ApprovalStatus(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELED = "canceled"


class OutboxStatus(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    DONE = "done"
    FAILED = "failed"


class WaitStatus(StrEnum):
    """What ``wait_for_input`` (``received``, ``timed_out``, ``waiting``) and
    ``wait_for_children`` (``done``, ``timed_out``, ``waiting``) answer; on ``waiting`` the run was
    parked and its ``run_token`` is over."""

    RECEIVED = "received"
    DONE = "done"
    TIMED_OUT = "timed_out"
    WAITING = "waiting"


T = TypeVar("T")


def _build(cls: type[T], row: Mapping[str, Any], **converted: Any) -> T:
    """``cls`` from the row's members named like its fields (absent ones None), ``converted``
    replacing the members that need a type of their own."""
    values = {f.name: row.get(f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values.update(converted)
    return cls(**values)


def _ts(value: Any) -> datetime | None:
    """A timestamp from a row (already a datetime) or from the ledger's JSON (ISO 8601 text)."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


@dataclass(frozen=True)
class Run:
    """A row of ``ledger.runs`` (without the scope columns). ``not_before`` 'infinity' (a run that
    waits for an input without a deadline, kept after it ends) is ``datetime.max`` in UTC."""

    id: str
    status: RunStatus
    mode: str
    kind: str
    subject_kind: str
    subject_id: str | None
    subject_version_id: str | None
    user_id: str | None
    trace_id: str | None
    request_id: str | None
    parent_run_id: str | None
    source_run_id: str | None
    root_run_id: str
    attempt_no: int
    control_action: str | None
    input_summary: str | None
    inputs: Any
    output_summary: str | None
    error_code: str | None
    error_message: str | None
    error_step_id: str | None
    last_seq: int
    queued_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: int | None
    created_at: datetime
    updated_at: datetime
    lease_owner: str | None
    lease_expires_at: datetime | None
    run_token: int
    not_before: datetime | None
    priority: int
    concurrency_key: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Run:
        return _build(cls, row, status=RunStatus(row["status"]))


@dataclass(frozen=True)
class Step:
    """A row of ``ledger.run_steps``."""

    id: str
    run_id: str
    step_no: int
    step_key: str | None
    step_type: str
    node_id: str | None
    status: StepStatus
    input_summary: str | None
    output_summary: str | None
    metrics: dict[str, Any]
    error_code: str | None
    error_message: str | None
    error_details: Any
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: int | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Step:
        return _build(cls, row, status=StepStatus(row["status"]))


@dataclass(frozen=True)
class StepRef:
    """A step as ``claim_run`` lists it."""

    id: str
    step_key: str | None
    step_type: str
    status: StepStatus


@dataclass(frozen=True)
class ToolCallRef:
    """A tool call as ``claim_run`` lists it."""

    id: str
    tool_call_id: str
    idempotency_key: str
    tool_ref: str
    status: ToolCallStatus
    attempt: int


@dataclass(frozen=True)
class ApprovalRef:
    """A pending approval as ``claim_run`` lists it."""

    id: str
    tool_call_record_id: str | None
    step_id: str | None


@dataclass(frozen=True)
class ClaimedRun:
    """A ``ledger.claimed_run``: the run a worker now owns, its fencing token and where it stands."""

    tenant_id: str
    workspace_id: str
    run_id: str
    run_token: int
    lease_owner: str
    lease_expires_at: datetime
    takeover: bool
    previous_owner: str | None
    status: RunStatus
    mode: str
    kind: str
    attempt_no: int
    source_run_id: str | None
    inputs: Any
    steps: tuple[StepRef, ...]
    tool_calls: tuple[ToolCallRef, ...]
    approvals: tuple[ApprovalRef, ...]
    last_event_id: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ClaimedRun:
        return _build(
            cls,
            row,
            status=RunStatus(row["status"]),
            steps=tuple(_build(StepRef, s, status=StepStatus(s["status"])) for s in row["steps"] or ()),
            tool_calls=tuple(
                _build(ToolCallRef, c, status=ToolCallStatus(c["status"])) for c in row["tool_calls"] or ()
            ),
            approvals=tuple(_build(ApprovalRef, a) for a in row["approvals"] or ()),
        )


@dataclass(frozen=True)
class ToolCall:
    """A tool-call record as the tool-call functions return it (``tool_call``): ``id`` is the
    ``tool_call_record_id``, ``attempt`` the fencing token of its current attempt."""

    id: str
    run_id: str
    step_id: str
    tool_call_id: str
    tool_ref: str
    idempotency_key: str
    request_hash: str
    arguments: Any
    status: ToolCallStatus
    attempt: int
    lease_owner: str | None
    lease_seconds: int
    lease_expires_at: datetime | None
    outbound_started_at: datetime | None
    result_artifact_id: str | None
    result_size_bytes: int | None
    result_sha256: str | None
    metadata: dict[str, Any]
    error_code: str | None
    error_message: str | None
    approval_id: str | None
    completed_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ToolCall:
        return _build(
            cls,
            row,
            status=ToolCallStatus(row["status"]),
            lease_expires_at=_ts(row.get("lease_expires_at")),
            outbound_started_at=_ts(row.get("outbound_started_at")),
            completed_at=_ts(row.get("completed_at")),
            created_at=_ts(row["created_at"]),
            updated_at=_ts(row["updated_at"]),
        )


@dataclass(frozen=True)
class ToolCallTombstone:
    """What a purged run's tool call left (``tool_call`` of a ``purged`` answer)."""

    tool_call_record_id: str
    run_id: str
    tool_call_id: str
    tool_ref: str
    idempotency_key: str
    request_hash: str
    status: ToolCallStatus
    completed_at: datetime | None
    purged_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ToolCallTombstone:
        return _build(
            cls,
            row,
            status=ToolCallStatus(row["status"]),
            completed_at=_ts(row.get("completed_at")),
            purged_at=_ts(row["purged_at"]),
        )


@dataclass(frozen=True)
class Approval:
    """An approval request (``ledger.approval_requests`` without the scope columns)."""

    id: str
    run_id: str
    step_id: str | None
    tool_call_record_id: str | None
    status: ApprovalStatus
    title: str | None
    policy_ref: str | None
    details: dict[str, Any]
    actor: str | None
    note: str | None
    decided_at: datetime | None
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Approval:
        return _build(
            cls,
            row,
            status=ApprovalStatus(row["status"]),
            decided_at=_ts(row.get("decided_at")),
            created_at=_ts(row["created_at"]),
            updated_at=_ts(row["updated_at"]),
            expires_at=_ts(row.get("expires_at")),
        )


@dataclass(frozen=True)
class ToolResponse:
    """The recorded result a ``replayed`` answer carries."""

    result: Any
    success: bool
    error: Any
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Budget:
    """A budget as a refusal names it (the ``budget`` of a ``budget_exhausted`` answer, the
    ``error_details`` of a refused ``llm`` step, the payload of ``budget.exhausted``): money and
    counts are Decimals; the window is None for a ``total`` budget."""

    level: str
    run_id: str | None
    unit: str
    period: str
    max_amount: Decimal
    spent: Decimal
    remaining: Decimal
    window_start: datetime | None
    window_end: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        # The JSON answers carry the amounts as decimal strings, the view's rows as Decimals.
        return _build(
            cls,
            row,
            max_amount=Decimal(row["max_amount"]),
            spent=Decimal(row["spent"]),
            remaining=Decimal(row["remaining"]),
            window_start=_ts(row.get("window_start")),
            window_end=_ts(row.get("window_end")),
        )


@dataclass(frozen=True)
class BudgetUsage(Budget):
    """A row of ``ledger.budget_usage``: the budget, spent in the window of now; ``workspace_id`` is
    None for a tenant's budget; ``warn_ratio`` None: no warning."""

    tenant_id: str
    workspace_id: str | None
    exhausted: bool
    warn_ratio: Decimal | None
    warned: bool
    updated_by: str | None
    updated_at: datetime


@dataclass(frozen=True)
class ToolCallClaim:
    """``{outcome, tool_call, approval, response}``: ``tool_call`` is None only for ``purged``,
    whose ``tombstone`` is the key's record instead, for ``unrecorded`` without a record, and for
    ``budget_exhausted`` on a new call (nothing was created); ``response`` is set only for
    ``replayed``, ``budget`` only for ``budget_exhausted`` (the budget that is used up)."""

    outcome: ClaimOutcome
    tool_call: ToolCall | None
    approval: Approval | None
    response: ToolResponse | None
    tombstone: ToolCallTombstone | None
    budget: Budget | None

    @classmethod
    def from_json(cls, answer: Mapping[str, Any]) -> ToolCallClaim:
        outcome = ClaimOutcome(answer["outcome"])
        record = answer.get("tool_call")
        purged = outcome is ClaimOutcome.PURGED
        return cls(
            outcome=outcome,
            tool_call=ToolCall.from_row(record) if record and not purged else None,
            approval=Approval.from_row(answer["approval"]) if answer.get("approval") else None,
            response=_build(ToolResponse, answer["response"]) if answer.get("response") else None,
            tombstone=ToolCallTombstone.from_row(record) if record and purged else None,
            budget=Budget.from_row(answer["budget"]) if answer.get("budget") else None,
        )


@dataclass(frozen=True)
class RunEvent:
    """A row of ``ledger.events_since``: ``event_id`` is the next call's cursor; ``ends_run`` marks
    the move to a terminal status."""

    event_id: str
    seq: int
    event_type: str
    step_id: str | None
    payload: dict[str, Any]
    created_at: datetime
    ends_run: bool

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RunEvent:
        return _build(cls, row)


@dataclass(frozen=True)
class CostEntry:
    """A row of ``ledger.run_cost_entries``; money is a Decimal."""

    id: str
    run_id: str
    step_id: str | None
    billing_basis: str
    billed_quantity: Decimal
    amount: Decimal | None
    currency: str | None
    usage: dict[str, int]
    pricing_snapshot: dict[str, Any]
    provider: str | None
    model_ref: str | None
    tool_ref: str | None
    source_port: str | None
    operation: str | None
    source_ref: str | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> CostEntry:
        return _build(cls, row)


@dataclass(frozen=True)
class ResponseEvent:
    """A row of ``ledger.response_events``: what a run showed its user."""

    id: str
    run_id: str
    step_id: str | None
    event_type: str
    payload: dict[str, Any]
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ResponseEvent:
        return _build(cls, row)


@dataclass(frozen=True)
class OutboxEvent:
    """A ``ledger.outbox_event``; deliveries are at least once: deduplicate on ``id``."""

    tenant_id: str
    workspace_id: str
    id: str
    event_type: str
    run_id: str | None
    task_id: str | None
    subject: str
    payload: dict[str, Any]
    status: OutboxStatus
    attempt_count: int
    replay_count: int
    available_at: datetime
    lease_expires_at: datetime | None
    error_message: str | None
    occurred_at: datetime
    processed_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> OutboxEvent:
        return _build(cls, row, status=OutboxStatus(row["status"]))


@dataclass(frozen=True)
class ReplayReady:
    """``ledger.replay_ready``: ``status`` is ``pass`` or ``fail``, ``missing`` what is absent."""

    status: str
    missing: tuple[str, ...]

    @property
    def ready(self) -> bool:
        return self.status == "pass"


@dataclass(frozen=True)
class EvidenceItem:
    """One of the thirteen items of ``ledger.run_evidence``."""

    key: str
    status: str
    label: str
    summary: str
    evidence_refs: list[Any]
    missing: list[Any]


class _FromRow:
    """``from_row`` for a type whose fields are the row's columns as they come."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _build(cls, row)


@dataclass(frozen=True)
class ToolCallInDoubt(_FromRow):
    """A row of ``ledger.tool_calls_in_doubt`` with the call's ``arguments`` as stored (redacted): a
    call whose request may have left without an answer, waiting for ``resolve_tool_call``;
    ``lease_owner`` held the attempt when it went in doubt."""

    id: str
    run_id: str
    step_id: str
    tool_call_id: str
    tool_ref: str
    idempotency_key: str
    arguments: Any
    attempt: int
    lease_owner: str | None
    outbound_started_at: datetime | None
    error_code: str | None
    error_message: str | None
    updated_at: datetime


@dataclass(frozen=True)
class PendingApproval(_FromRow):
    """A row of ``ledger.pending_approvals`` with the call's ``tool_call_id`` and ``arguments`` as
    stored (redacted), or None for an approval without a tool call; decide it with
    ``resolve_approval`` (before ``expires_at``, when it has one)."""

    id: str
    run_id: str
    step_id: str | None
    tool_call_record_id: str | None
    tool_call_id: str | None
    tool_ref: str | None
    arguments: dict[str, Any] | None
    title: str | None
    policy_ref: str | None
    details: dict[str, Any]
    created_at: datetime
    expires_at: datetime | None


@dataclass(frozen=True)
class Inbox(_FromRow):
    """A row of ``ledger.inbox``: what waits for people in a scope, each queue counted with the
    oldest one's time (None when it is empty): calls in doubt (``resolve_tool_call``), pending
    approvals before their deadline (``resolve_approval``), runs paused by a budget still used up
    (``set_budget``) and failed outbox events (``replay_outbox_event``)."""

    tenant_id: str
    workspace_id: str
    calls_in_doubt: int
    oldest_in_doubt_at: datetime | None
    pending_approvals: int
    oldest_approval_at: datetime | None
    budget_stops: int
    oldest_budget_stop_at: datetime | None
    failed_outbox_events: int
    oldest_failed_outbox_event_at: datetime | None


@dataclass(frozen=True)
class MailboxInput:
    """A row of ``ledger.run_mailbox`` as ``send_input`` and ``wait_for_input`` return it: the input
    of ``input_key`` (``payload`` as stored, redacted; ``received_at`` None while the run only waits
    for it) and the run's wait for it (``waited_at``, ``wait_deadline``)."""

    id: str
    run_id: str
    input_key: str
    payload: Any
    sender: str | None
    received_at: datetime | None
    waited_at: datetime | None
    wait_deadline: datetime | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> MailboxInput:
        return _build(cls, row, received_at=_ts(row.get("received_at")), waited_at=_ts(row.get("waited_at")),
                      wait_deadline=_ts(row.get("wait_deadline")), created_at=_ts(row["created_at"]))


@dataclass(frozen=True)
class InputWait:
    """``wait_for_input``'s answer: ``input`` is the mailbox row (None when ``timed_out``)."""

    status: WaitStatus
    input_key: str
    input: MailboxInput | None

    @classmethod
    def from_json(cls, answer: Mapping[str, Any]) -> InputWait:
        row = answer.get("input")
        return cls(status=WaitStatus(answer["status"]), input_key=row["input_key"] if row else answer["input_key"],
                   input=MailboxInput.from_row(row) if row else None)


@dataclass(frozen=True)
class ChildRun:
    """A child run as ``wait_for_children`` lists it: how it stands (or ended)."""

    run_id: str
    status: RunStatus
    output_summary: str | None
    error_code: str | None
    error_message: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ChildRun:
        return _build(cls, row, status=RunStatus(row["status"]))


@dataclass(frozen=True)
class ChildrenWait:
    """``wait_for_children``'s answer: the run's children, oldest first."""

    status: WaitStatus
    children: tuple[ChildRun, ...]

    @classmethod
    def from_json(cls, answer: Mapping[str, Any]) -> ChildrenWait:
        return cls(status=WaitStatus(answer["status"]),
                   children=tuple(ChildRun.from_row(c) for c in answer["children"]))


@dataclass(frozen=True)
class Schedule(_FromRow):
    """A row of ``ledger.schedules`` (without the scope columns): what each firing of ``cron`` in
    ``time_zone`` creates, and ``next_fire_at`` (None: the expression names no later time)."""

    id: str
    cron: str
    time_zone: str
    mode: str
    kind: str | None
    inputs: dict[str, Any] | None
    priority: int
    concurrency_key: str | None
    catch_up: str
    paused: bool
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    last_run_id: str | None
    updated_by: str | None
    created_at: datetime
    updated_at: datetime
