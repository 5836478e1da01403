"""What the pages read and do, as the ledger's views, tables and functions in the person's scope.

Reads are plain SELECTs (row-level security shows the scope's rows only); every action is one of
the ledger's functions with `actor` = the signed-in person. Nothing here checks a rule the
extension enforces.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from ledger_client import BudgetUsage, Ledger, ScopedLedger

PAGE = 50
Row = dict[str, Any]


class NotAllowed(Exception):
    """The console's database role must not or cannot serve it (a superuser, no ledger role)."""


@dataclass(frozen=True)
class Role:
    name: str
    writer: bool
    operator: bool  # a member of ledger_operator: the inbox also lists the other scopes with work


def check_role(conninfo: str) -> Role:
    """The login role's ledger role; refuses a superuser or BYPASSRLS role (it would see every
    tenant's rows) and a role without ledger_reader or ledger_writer."""
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(
            "SELECT session_user::text, r.rolsuper, r.rolbypassrls,"
            " pg_has_role(session_user, 'ledger_writer', 'USAGE'),"
            " pg_has_role(session_user, 'ledger_reader', 'USAGE'),"
            " pg_has_role(session_user, 'ledger_operator', 'MEMBER')"
            " FROM pg_roles r WHERE r.rolname = session_user"
        ).fetchone()
    assert row is not None
    name, superuser, bypassrls, writer, reader, operator = row
    if superuser or bypassrls:
        raise NotAllowed(
            f"the console refuses to run as {name}: a superuser or BYPASSRLS role sees every tenant's"
            " rows. Connect as a login role granted ledger_writer (or ledger_reader)."
        )
    if not (writer or reader):
        raise NotAllowed(f"role {name} is granted neither ledger_writer nor ledger_reader")
    return Role(name=name, writer=bool(writer), operator=bool(operator))


def check_scopes(ledger: Ledger, scopes: list[tuple[str, str]]) -> None:
    """States each scope once: a scope the role may not use fails here (42501 SCOPE_NOT_GRANTED),
    at start, not when a person picks it."""
    for tenant, workspace in scopes:
        ledger.scoped(tenant, workspace).execute("SELECT 1")


# --- What waits for people ---

# ledger.inbox's counts of what waits.
INBOX_COUNTS = ("calls_in_doubt", "pending_approvals", "budget_stops", "failed_outbox_events")


@dataclass(frozen=True)
class Inbox:
    """ledger.inbox's rows (each with `served`: whether this console serves the scope) and the
    time they were read at."""

    rows: list[Row]
    now: datetime

    @property
    def total(self) -> int:
        return sum(row[count] for row in self.rows for count in INBOX_COUNTS)

    def of(self, scope: tuple[str, str] | None) -> Row | None:
        """The row of a scope the console serves."""
        return next((r for r in self.rows if r["served"] and (r["tenant_id"], r["workspace_id"]) == scope), None)


def inbox(ledger: Ledger, scopes: list[tuple[str, str]], operator: bool) -> Inbox:
    """ledger.inbox() in each scope the console serves (a row each, zeros when nothing waits) in
    one transaction (one connection, one snapshot) and, for an operator role, read just before,
    inbox(any_scope => true)'s other scopes: every scope it may state that has something waiting.
    The time of the transaction comes last, so no row's oldest time is after it."""
    others = [{**asdict(r), "served": False} for r in ledger.inbox() if (r.tenant_id, r.workspace_id) not in scopes] \
        if operator else []
    with ledger.transaction() as tx:
        rows: list[Row] = []
        for tenant, workspace in scopes:
            tx.execute("SELECT ledger.set_scope(%s, %s, is_local => true)", (tenant, workspace))
            rows.append({**asdict(tx.inbox()), "served": True})
        return Inbox(rows + others, tx.execute("SELECT now() AS now")[0]["now"])


# --- Runs ---

_RUN_COLUMNS = """r.id, r.status, r.mode, r.kind, r.subject_kind, r.subject_id, r.user_id, r.request_id,
    r.attempt_no, r.control_action, r.created_at, r.duration_ms,
    (SELECT coalesce(jsonb_object_agg(c.currency, c.total::text ORDER BY c.currency), '{}')
       FROM (SELECT currency, sum(amount) AS total FROM ledger.run_cost_entries e
              WHERE e.tenant_id = r.tenant_id AND e.workspace_id = r.workspace_id AND e.run_id = r.id
                AND e.amount IS NOT NULL GROUP BY currency) c) AS cost"""


@dataclass(frozen=True)
class RunPage:
    runs: list[Row]
    next_cursor: str | None  # "<created_at iso>|<id>" of the last run shown, when more follow


def list_runs(
    ledger: ScopedLedger, *, status: str | None, user: str | None, q: str | None, cursor: str | None
) -> RunPage:
    """A page of runs newest first, keyset-paged on (created_at, id) (the indexes
    runs_created_idx, runs_status_created_idx, runs_user_created_idx keep each page one short
    index scan). `q` is an exact run id or request id."""
    where = [sql.SQL("r.tenant_id = ledger.scope_tenant() AND r.workspace_id = ledger.scope_workspace()")]
    params: list[Any] = []
    if status:
        where.append(sql.SQL("r.status = %s"))
        params.append(status)
    if user:
        where.append(sql.SQL("r.user_id = %s"))
        params.append(user)
    if q:
        where.append(sql.SQL("(r.id = %s OR r.request_id = %s)"))
        params += [q, q]
    if cursor:
        at, _, run_id = cursor.partition("|")
        where.append(sql.SQL("(r.created_at, r.id) < (%s::timestamptz, %s)"))
        params += [at, run_id]
    query = sql.SQL("SELECT {} FROM ledger.runs r WHERE {} ORDER BY r.created_at DESC, r.id DESC LIMIT {}").format(
        sql.SQL(_RUN_COLUMNS), sql.SQL(" AND ").join(where), sql.Literal(PAGE + 1)
    )
    rows = ledger.execute(query, params)
    more = len(rows) > PAGE
    rows = rows[:PAGE]
    last = rows[-1] if more else None
    return RunPage(rows, f"{last['created_at'].isoformat()}|{last['id']}" if last else None)


@dataclass(frozen=True)
class RunView:
    run: Row
    lineage: list[Row]
    steps: list[Row]
    tool_calls: list[Row]
    costs: list[Row]
    responses: list[Row]
    approvals: list[Row]
    audit: list[Row]
    events: list[Row]
    evidence: list[Row]
    replay_ready: Row
    inputs: list[Row]
    budgets: list[BudgetUsage]
    now: datetime


def _scoped(table: str, order: LiteralString) -> sql.Composed:
    """The run's rows of a table in the scope, in `order` (the scope is in the query too: row-level
    security does not bind a superuser, and the console must show the same to any role)."""
    return sql.SQL(
        "SELECT * FROM ledger.{} WHERE tenant_id = ledger.scope_tenant()"
        " AND workspace_id = ledger.scope_workspace() AND run_id = %s ORDER BY {}"
    ).format(sql.Identifier(table), sql.SQL(order))


def run_view(ledger: ScopedLedger, run_id: str) -> RunView | None:
    """Everything the run page shows, read in one transaction (one snapshot)."""
    with ledger.transaction() as tx:
        runs = tx.execute(
            "SELECT * FROM ledger.runs WHERE tenant_id = ledger.scope_tenant()"
            " AND workspace_id = ledger.scope_workspace() AND id = %s", (run_id,))
        if not runs:
            return None
        run = runs[0]
        lineage = tx.execute(
            "SELECT id, attempt_no, control_action, source_run_id, status, created_at FROM ledger.runs"
            " WHERE tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace()"
            " AND root_run_id = %s ORDER BY attempt_no, created_at, id", (run["root_run_id"],))
        steps = tx.execute(_scoped("run_steps", "step_no"), (run_id,))
        calls = tx.execute(_scoped("run_step_tool_calls", "created_at, id"), (run_id,))
        costs = tx.execute(_scoped("run_cost_entries", "created_at, id"), (run_id,))
        responses = tx.execute(_scoped("response_events", "created_at, id"), (run_id,))
        approvals = tx.execute(_scoped("approval_requests", "created_at, id"), (run_id,))
        audit = readable_audit(tx.execute(_scoped("audit_events", "created_at, id"), (run_id,)))
        events = tx.execute("SELECT * FROM ledger.events_since(%s, NULL, 1000)", (run_id,))
        evidence = tx.execute("SELECT e->>'key' AS key, e->>'status' AS status, e->>'label' AS label,"
                              " e->>'summary' AS summary, e->'missing' AS missing"
                              " FROM jsonb_array_elements(ledger.run_evidence(%s)) e", (run_id,))
        ready = tx.execute("SELECT ledger.replay_ready(%s) AS r", (run_id,))[0]["r"]
        inputs = tx.execute(_scoped("run_mailbox", "created_at, id"), (run_id,))
        budgets = tx.budgets(run_id)
        now = tx.execute("SELECT now() AS now")[0]["now"]
    return RunView(run, lineage, steps, calls, costs, responses, approvals, audit, events, evidence, ready, inputs,
                   budgets, now)


def replay_bundle(ledger: ScopedLedger, run_id: str) -> dict[str, Any]:
    return ledger.replay_bundle(run_id)


# --- Decisions ---


def in_doubt(ledger: ScopedLedger, record_id: str | None = None) -> list[Row]:
    """The calls in doubt with their arguments; with `record_id`, that call if it still is."""
    return ledger.execute(
        "SELECT d.id, d.run_id, d.tool_call_id, d.tool_ref, d.attempt, d.lease_owner,"
        " d.outbound_started_at, d.error_message, t.arguments FROM ledger.tool_calls_in_doubt d"
        " JOIN ledger.run_step_tool_calls t ON t.tenant_id = ledger.scope_tenant()"
        " AND t.workspace_id = ledger.scope_workspace() AND t.id = d.id"
        " WHERE %s::text IS NULL OR d.id = %s ORDER BY d.outbound_started_at, d.id", (record_id, record_id))


@dataclass(frozen=True)
class Resolved:
    call: Row  # its ids and its status now
    audit: list[Row]  # the audit record of its last resolution, readable


def resolved(ledger: ScopedLedger, record_id: str) -> Resolved | None:
    """A call resolved in the scope, as the page after the decision shows it; None when the scope
    has no such call or nobody resolved it."""
    with ledger.transaction() as tx:
        calls = tx.execute(
            "SELECT id, run_id, tool_call_id, tool_ref, status FROM ledger.run_step_tool_calls"
            " WHERE tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace() AND id = %s",
            (record_id,))
        if not calls:
            return None
        audit = tx.execute(
            "SELECT * FROM ledger.audit_events WHERE tenant_id = ledger.scope_tenant()"
            " AND workspace_id = ledger.scope_workspace() AND run_id = %s AND gateway_type = 'tool_call.resolve'"
            " AND payload->'tool_call'->>'tool_call_record_id' = %s ORDER BY created_at DESC, id DESC LIMIT 1",
            (calls[0]["run_id"], record_id))
    return Resolved(calls[0], readable_audit(audit)) if audit else None


def readable_audit(records: list[Row]) -> list[Row]:
    """Audit records with the note out of the payload (an object: the ledger refuses any other) as
    `note`, and the rest as `details`, so that a person reads who noted what without reading JSON."""
    readable = []
    for record in records:
        details = dict(record["payload"])
        note = details.pop("note", None)
        if note is not None and not isinstance(note, str):  # a record_audit caller's own shape: left as it is
            details["note"], note = note, None
        readable.append({**record, "note": note, "details": details})
    return readable


def pending_approvals(ledger: ScopedLedger) -> list[Row]:
    """The pending approvals with their call's arguments; `details` keeps only what the requester
    added (the ledger also copies the call's identity and arguments into it)."""
    rows = ledger.execute(
        "SELECT a.id, a.run_id, a.tool_ref, a.title, a.policy_ref, a.details, a.created_at,"
        " t.arguments, t.tool_call_id FROM ledger.pending_approvals a"
        " LEFT JOIN ledger.run_step_tool_calls t ON t.tenant_id = ledger.scope_tenant()"
        " AND t.workspace_id = ledger.scope_workspace() AND t.id = a.tool_call_record_id"
        " ORDER BY a.created_at, a.id")
    for row in rows:
        row["details"] = {k: v for k, v in row["details"].items() if k not in ("arguments", "tool_call_id", "tool_ref")}
    return rows


def failed_outbox(ledger: ScopedLedger) -> list[Row]:
    return ledger.execute(
        "SELECT id, event_type, run_id, subject, attempt_count, replay_count, error_message, occurred_at"
        " FROM ledger.outbox WHERE tenant_id = ledger.scope_tenant()"
        " AND workspace_id = ledger.scope_workspace() AND status = 'failed'"
        " ORDER BY occurred_at DESC, id LIMIT 200")


def parse_result(text: str) -> Any:
    """The result a person typed, as JSON; None for an empty box. Raises ValueError with a message
    a person can act on."""
    return parse_json(text, "result") if text.strip() else None


def parse_json(text: str, what: str) -> Any:
    """`what` a person typed, as JSON. Raises ValueError with a message a person can act on."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the {what} is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from exc


def resolve_tool_call(ledger: ScopedLedger, record_id: str, decision: str, result: Any, actor: str, note: str | None) -> None:
    ledger.resolve_tool_call(record_id, decision, result, actor=actor, note=note)


def resolve_approval(ledger: ScopedLedger, approval_id: str, decision: str, actor: str, note: str | None) -> str:
    return ledger.resolve_approval(approval_id, decision, actor=actor, note=note).run_id


def replay_outbox_event(ledger: ScopedLedger, event_id: str, actor: str) -> None:
    """Replays the event; the ledger records who did in the same transaction (audit
    ``outbox.replay``, for the event's run)."""
    ledger.replay_outbox_event(event_id, actor=actor)


def budgets(ledger: ScopedLedger, run_id: str | None) -> list[BudgetUsage]:
    """The scope's budgets, or those that apply to `run_id`, as spent in the window of now."""
    return ledger.budgets(run_id)


def change_budget(ledger: ScopedLedger, level: str, run_id: str | None, unit: str, period: str, max_amount: Decimal,
                  actor: str, note: str) -> BudgetUsage | None:
    """Sets an existing budget's max_amount (the ledger audits it as budget.set with actor and
    note); None when the scope has no such budget (nothing written). set_budget replaces
    warn_ratio too, so the budget's own is read and passed back in the same transaction."""
    with ledger.transaction() as tx:
        found = [b for b in tx.budgets(run_id) if (b.level, b.run_id, b.unit, b.period) == (level, run_id, unit, period)]
        if not found:
            return None
        return tx.set_budget(unit, max_amount, level=level, run_id=run_id, period=period,
                             warn_ratio=found[0].warn_ratio, actor=actor, note=note)


def send_input(ledger: ScopedLedger, run_id: str, input_key: str, payload: Any, sender: str) -> None:
    """Puts the input in the run's mailbox (redacted by the ledger, audited as input.send with the
    sender); a run parked waiting for the key is claimable at once."""
    ledger.send_input(run_id, input_key, payload, sender=sender)
