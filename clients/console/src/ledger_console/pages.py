"""The console's pages and actions, and how they are rendered: each handler reads or acts through
`data` in the signed-in person's scope (the checks before it are app.py's) and renders a template,
or redirects after an action to the page that shows its result. Every page a signed-in person
sees counts what waits for people (the inbox) in its top bar."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ledger_client import RunStatus

from . import data
from .console import Console, Refused
from .sessions import Session
from .timeline import timeline_svg

# The run statuses the runs page filters by: the client's enum, which its tests hold to the
# extension's status machine.
STATUSES = tuple(str(s) for s in RunStatus)
# The decisions on a call in doubt: what each says happened, and what the ledger then does (the
# reference's resolve_tool_call).
DECISIONS = {
    "succeeded": "the request was carried out",
    "failed": "the request was not carried out",
    "retry": "it must be executed again",
}
THEN = {
    "succeeded": "the call is finished with the result; a later claim of it gets the result back instead of"
                 " executing it again",
    "failed": "the call is finished as failed (RESOLVED_FAILED, the note as its message); a later claim of it gets"
              " that back",
    "retry": "the next claim executes the call again, with attempt + 1",
}
APPROVALS = ("approved", "rejected")
DONE = {
    "approved": "Approved: the next claim of the call gets claimed.",
    "rejected": "Rejected: the call will not execute.",
    "replayed": "The outbox event is pending again.",
    # The reference's words: set_budget does not resume a run, the next claim does.
    "budget": "The budget is changed; its audit record (budget.set) names you. A run it stopped is handed out"
              " again by claim_run once no budget that applies to it is used up: a worker's next claim resumes it.",
    "answered": "The input is in the run's mailbox. A run that waited for it is claimable at once: a worker's"
                " next claim resumes it, and its wait_for_input answers received.",
}
# The feed's event types (docs/reference.md): the live page listens to each by name.
FEED_TYPES = (
    "run.created", "run.status", "run.claimed", "step.created", "step.status", "tool_call.claimed",
    "tool_call.running", "tool_call.completed", "tool_call.in_doubt", "tool_call.lease_expired",
    "tool_call.rejected", "tool_call.replayed", "tool_call.resolved", "approval.requested",
    "approval.resolved", "artifact.created", "audit.recorded", "cost.recorded", "response_event.recorded",
    "citation.recorded", "feedback.recorded",
)

_env = Environment(loader=PackageLoader("ledger_console"), autoescape=True)
# JSON as text (ensure_ascii=False: "café", not "caf\u00e9"), left to autoescape; Jinja's tojson
# writes \u escapes, made for <script>, that people would read as they are.
_env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
_env.filters["compact"] = lambda value: json.dumps(value, sort_keys=True, ensure_ascii=False)
_env.filters["cost"] = lambda cost: ", ".join(f"{v} {k}" for k, v in (cost or {}).items()) or "-"
_env.filters["ms"] = lambda ms: "-" if ms is None else f"{ms / 1000:.2f} s"
_env.filters["at"] = lambda t: "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _age(since: datetime, now: datetime) -> str:
    """How long something has waited, in words a person reads at a glance ("2 h")."""
    seconds = max(0.0, (now - since).total_seconds())
    if seconds < 60:
        return "under a minute"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 48 * 3600:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} days"


_env.filters["age"] = _age


@dataclass(frozen=True)
class Queue:
    """One of the inbox's queues: its columns in ledger.inbox, the page where a person decides (and
    its name in the top bar), what it counts and how the oldest one's age reads ("in doubt for 2 h")."""

    count: str
    oldest: str
    page: str
    nav: str
    title: str
    waiting: str


QUEUES = (
    Queue("calls_in_doubt", "oldest_in_doubt_at", "/in-doubt", "In doubt", "Calls in doubt", "in doubt for"),
    Queue("pending_approvals", "oldest_approval_at", "/approvals", "Approvals", "Pending approvals", "pending for"),
    Queue("budget_stops", "oldest_budget_stop_at", "/budgets", "Budgets", "Runs stopped by a budget", "stopped for"),
    Queue("failed_outbox_events", "oldest_failed_outbox_event_at", "/outbox", "Failed outbox", "Failed outbox events",
          "failed for"),
)


async def render(console: Console, request: Request, template: str, http_status: int = 200,
                 session: Session | None = None, waiting: data.Inbox | None = None, **context: Any) -> HTMLResponse:
    """The page; for a signed-in person with what waits for people (`waiting`, read here unless
    the handler read it already), counted in the top bar."""
    session = session or console.session_of(request)
    if waiting is None and session is not None and session.user is not None:
        waiting = await run_in_threadpool(data.inbox, console.ledger, console.config.scopes, console.role.operator)
    body = _env.get_template(template).render(
        session=session, role=console.role, can_act=console.role.writer, scopes=console.config.scopes,
        statuses=STATUSES, path=request.url.path, waiting=waiting, queues=QUEUES, **context,
    )
    return HTMLResponse(body, status_code=http_status)


def _done(request: Request) -> str | None:
    """The message of the action a page was redirected to after, if any."""
    return DONE.get(request.query_params.get("done", ""))


# --- Pages ---


async def inbox(console: Console, request: Request, session: Session) -> Response:
    waiting = await run_in_threadpool(data.inbox, console.ledger, console.config.scopes, console.role.operator)
    return await render(console, request, "inbox.html", waiting=waiting)


async def runs(console: Console, request: Request, session: Session) -> Response:
    qp = request.query_params
    status = qp.get("status") or None
    if status is not None and status not in STATUSES:
        raise Refused(400, "Unknown status.")
    user, q, cursor = (qp.get("user") or "").strip() or None, (qp.get("q") or "").strip() or None, qp.get("after")
    found = await run_in_threadpool(
        lambda: data.list_runs(console.scoped(session), status=status, user=user, q=q, cursor=cursor))
    nxt = None
    if found.next_cursor:
        nxt = "/runs?" + urlencode({k: v for k, v in (("status", status), ("user", user), ("q", q),
                                                      ("after", found.next_cursor)) if v})
    return await render(console, request, "runs.html", runs=found.runs, status=status, user=user, q=q, next_url=nxt,
                  first_page=cursor is None)


async def run(console: Console, request: Request, session: Session) -> Response:
    run_id = request.query_params.get("id", "")
    view = await run_in_threadpool(data.run_view, console.scoped(session), run_id)
    if view is None:
        raise Refused(404, f"No run {run_id} in this scope.")
    types = sorted(set(FEED_TYPES) | {e["event_type"] for e in view.events})
    r = view.run
    return await render(console, request, "run.html", v=view, svg=Markup(timeline_svg(view)), done=_done(request),
                  feed_types=types, ended=RunStatus(r["status"]).terminal,
                  budget_stopped=r["status"] == "paused" and r["error_code"] == "BUDGET_EXHAUSTED")


async def timeline(console: Console, request: Request, session: Session) -> Response:
    view = await run_in_threadpool(data.run_view, console.scoped(session), request.query_params.get("id", ""))
    if view is None:
        raise Refused(404, "No such run in this scope.")
    return Response(timeline_svg(view), media_type="image/svg+xml")


async def bundle(console: Console, request: Request, session: Session) -> Response:
    run_id = request.query_params.get("id", "")
    body = await run_in_threadpool(data.replay_bundle, console.scoped(session), run_id)
    return Response(json.dumps(body, indent=2), media_type="application/json", headers={
        "content-disposition": f'attachment; filename="replay-bundle-{_filename(run_id)}.json"'})


async def in_doubt(console: Console, request: Request, session: Session) -> Response:
    """The calls in doubt; after a decision (`resolved`: the call's record id) its outcome on top,
    read from the ledger: the call's status now and the audit record naming who decided."""
    rows = await run_in_threadpool(data.in_doubt, console.scoped(session))
    record_id = request.query_params.get("resolved")
    outcome = await run_in_threadpool(data.resolved, console.scoped(session), record_id) if record_id else None
    return await render(console, request, "in_doubt.html", calls=rows, outcome=outcome, decisions=DECISIONS,
                        then=THEN)


async def approvals(console: Console, request: Request, session: Session) -> Response:
    rows = await run_in_threadpool(data.pending_approvals, console.scoped(session))
    return await render(console, request, "approvals.html", approvals=rows, done=_done(request))


async def outbox(console: Console, request: Request, session: Session) -> Response:
    rows = await run_in_threadpool(data.failed_outbox, console.scoped(session))
    return await render(console, request, "outbox.html", events=rows, done=_done(request))


async def budgets(console: Console, request: Request, session: Session) -> Response:
    run_id = request.query_params.get("run") or None  # the budgets that apply to this run only
    rows = await run_in_threadpool(data.budgets, console.scoped(session), run_id)
    return await render(console, request, "budgets.html", budgets=rows, run_id=run_id, done=_done(request))


# --- Actions: `session` has a person and a scope, `fields` passed the CSRF check ---


def _resolution(fields: dict[str, str]) -> tuple[str, Any]:
    """The decision and result of an in-doubt form, or Refused (nothing written): a decision picked,
    a result that is JSON, for `succeeded` a result or the explicit "no result", and none for
    `retry` (the ledger would drop it)."""
    decision = fields.get("decision", "")
    if decision not in DECISIONS:
        raise Refused(400, "Nothing was written: pick a decision: succeeded, failed or retry.")
    text, no_result = fields.get("result", "").strip(), fields.get("no_result") == "yes"
    if text and no_result:
        raise Refused(400, 'Nothing was written: give a result or tick "no result", not both.')
    if decision == "succeeded" and not text and not no_result:
        raise Refused(400, 'Nothing was written: a call that succeeded needs its result (JSON), or tick "no result"'
                           " if it has none.")
    if decision == "retry" and text:
        raise Refused(400, "Nothing was written: a retry records no result (the next claim executes the call again);"
                           " empty the result box.")
    try:
        return decision, data.parse_result(text)
    except ValueError as exc:
        raise Refused(400, f"Nothing was written: {exc}.") from exc


async def review(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    """The decision on a call in doubt as it would be recorded, to confirm: it writes nothing."""
    decision, result = _resolution(fields)
    record_id = request.path_params["id"]
    calls = await run_in_threadpool(data.in_doubt, console.scoped(session), record_id)
    if not calls:
        raise Refused(404, "Nothing was written: this scope has no such call in doubt (decided meanwhile?).")
    return await render(console, request, "confirm.html", call=calls[0], decision=decision, decisions=DECISIONS,
                        then=THEN, result=result, result_text=fields.get("result", "").strip(), no_result=fields.get("no_result"),
                        note=fields.get("note", "").strip())


async def resolve(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    # One click must not decide: the decision is recorded from its review page's form only.
    if fields.get("confirm") != "yes":
        raise Refused(400, "Nothing was written: review the decision and confirm it first.")
    decision, result = _resolution(fields)
    note = fields.get("note", "").strip() or None
    record_id = request.path_params["id"]
    assert session.user is not None
    await run_in_threadpool(data.resolve_tool_call, console.scoped(session), record_id, decision, result, session.user,
                            note)
    # The outcome on top of the page the person came from: no anchor, nothing to scroll to.
    return RedirectResponse(f"/in-doubt?{urlencode({'resolved': record_id})}", 303)


async def decide(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    decision = fields.get("decision", "")
    if decision not in APPROVALS:
        raise Refused(400, "Pick a decision: approved or rejected.")
    assert session.user is not None
    await run_in_threadpool(data.resolve_approval, console.scoped(session), request.path_params["id"], decision,
                            session.user, fields.get("note", "").strip() or None)
    return RedirectResponse(f"/approvals?done={decision}", 303)


async def replay(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    assert session.user is not None
    await run_in_threadpool(data.replay_outbox_event, console.scoped(session), request.path_params["id"], session.user)
    return RedirectResponse("/outbox?done=replayed", 303)


async def change_budget(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    text = fields.get("max_amount", "").strip()
    try:
        max_amount = Decimal(text)
    except InvalidOperation:
        max_amount = Decimal("NaN")
    if not max_amount.is_finite():  # NaN, "sNaN" (which psycopg cannot send) or an infinity
        raise Refused(400, f"Nothing was written: the new maximum {text!r} is not a number.")
    note = fields.get("note", "").strip()
    if not note:
        raise Refused(400, "Nothing was written: write a note, why the budget changes (it goes to the audit record).")
    run_id = fields.get("run_id") or None
    assert session.user is not None
    changed = await run_in_threadpool(data.change_budget, console.scoped(session), fields.get("level", ""), run_id,
                                      fields.get("unit", ""), fields.get("period", ""), max_amount, session.user, note)
    if changed is None:
        raise Refused(404, "Nothing was written: this scope has no such budget (removed meanwhile?).")
    # Back to the page the person came from, where the notice is at the top.
    back = fields.get("back_run")
    return RedirectResponse(f"/run?{urlencode({'id': back, 'done': 'budget'})}" if back else "/budgets?done=budget", 303)


async def send_input(console: Console, request: Request, session: Session, fields: dict[str, str]) -> Response:
    run_id = request.query_params.get("id", "")
    try:
        payload = data.parse_json(fields.get("payload", ""), "payload")
    except ValueError as exc:
        raise Refused(400, f"Nothing was sent: {exc}.") from exc
    if payload is None:  # the Python client sends {} for None: say so rather than send what nobody wrote
        raise Refused(400, "Nothing was sent: null is not an answer the console sends; write {} or a value.")
    assert session.user is not None
    await run_in_threadpool(data.send_input, console.scoped(session), run_id, fields.get("input_key", ""), payload,
                            session.user)
    return RedirectResponse(f"/run?{urlencode({'id': run_id, 'done': 'answered'})}", 303)


def _filename(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
