"""A thin client for the ledger PostgreSQL extension: every rule stays in the extension's SQL."""

from .aio import AsyncLedger, AsyncLedgerCalls, AsyncScopedLedger, AsyncTransaction, tool_call_async
from .client import Calls, Ledger, LedgerCalls, ScopedLedger, Transaction
from .errors import (
    ConflictError,
    CorruptedError,
    IdempotencyMismatchError,
    InternalError,
    InvalidArgumentError,
    LedgerError,
    NotFoundError,
    ReadOnlyError,
    ScopeError,
    WrongStateError,
    translate,
    translated,
)
from ._faults import is_transient
from .encoding import NotEncodable, encode
from .feed import Reconnect, afollow, follow
from .outbox import OutboxConsumer
from .tool_calls import (
    BudgetExhausted,
    Busy,
    InDoubt,
    Purged,
    Rejected,
    ResultNotEncodable,
    ToolCallResult,
    ToolCallStopped,
    ToolFailed,
    ToolRequest,
    WaitingApproval,
    tool_call,
    tool_calls,
)
from .types import (
    Approval,
    ApprovalStatus,
    Budget,
    BudgetUsage,
    ChildRun,
    ChildrenWait,
    ClaimedRun,
    ClaimOutcome,
    CostEntry,
    EvidenceItem,
    Inbox,
    InputWait,
    MailboxInput,
    OutboxEvent,
    OutboxStatus,
    PendingApproval,
    ReplayReady,
    ResponseEvent,
    Run,
    RunEvent,
    RunStatus,
    Schedule,
    Step,
    StepStatus,
    ToolCall,
    ToolCallClaim,
    ToolCallInDoubt,
    ToolCallStatus,
    ToolCallTombstone,
    ToolResponse,
    WaitStatus,
)
from .worker import (
    ChildrenTimedOut,
    InputTimedOut,
    ModelReply,
    RunContext,
    WaitingForChildren,
    WaitingForInput,
    WaitingUntil,
    Worker,
)

__all__ = [
    "Approval", "ApprovalStatus", "AsyncLedger", "AsyncLedgerCalls", "AsyncScopedLedger", "AsyncTransaction", "Budget", "BudgetExhausted", "BudgetUsage", "Busy", "Calls", "ChildRun", "ChildrenTimedOut", "ChildrenWait", "ClaimOutcome", "ClaimedRun", "ConflictError", "CorruptedError",
    "CostEntry", "EvidenceItem", "IdempotencyMismatchError", "InDoubt", "Inbox", "InputTimedOut", "InputWait", "InternalError", "InvalidArgumentError",
    "Ledger", "LedgerCalls", "LedgerError", "MailboxInput", "ModelReply", "NotEncodable", "NotFoundError", "OutboxConsumer", "OutboxEvent",
    "OutboxStatus", "PendingApproval", "Purged", "ReadOnlyError", "Reconnect", "Rejected", "ReplayReady", "ResultNotEncodable",
    "ResponseEvent", "Run", "RunContext",
    "RunEvent", "RunStatus", "Schedule", "ScopeError", "ScopedLedger", "Step", "StepStatus", "ToolCall", "ToolCallClaim", "ToolCallInDoubt",
    "ToolCallResult", "ToolCallStatus", "ToolCallStopped", "ToolCallTombstone", "ToolFailed", "ToolRequest",
    "ToolResponse", "Transaction", "WaitStatus", "WaitingApproval", "WaitingForChildren", "WaitingForInput", "WaitingUntil", "Worker", "WrongStateError", "afollow", "encode", "follow", "is_transient", "tool_call",
    "tool_call_async", "tool_calls",
    "translate", "translated",
]
