"""The console's ASGI app (Starlette): pages rendered on the server, forms for every action, and
the live run feed through `ledger_client.sse`.

Security, in one place: a person signs in (users file, scrypt); the session is a signed,
HttpOnly, SameSite=Strict cookie whose id must still be live in the users file (sign-out, `users
remove` and a new password end it); every state-changing request is a POST whose Origin (or
Referer) must be the console's own and whose CSRF token must match the session's (compared in
constant time); a read-only console (a ledger_reader role) shows no action and refuses every
action POST; templates escape everything (Jinja2 autoescape, the SVG escapes its texts); every
response carries a Content-Security-Policy that allows scripts from the console only.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, PackageLoader
from markupsafe import Markup
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger_client import Ledger, LedgerError, ScopedLedger
from ledger_client.sse import EventHub, sse_app

from . import data
from .sessions import COOKIE, DEFAULT_MAX_AGE_S, Session, Signer
from .timeline import timeline_svg
from .users import Users

DECISIONS = ("succeeded", "failed", "retry")
APPROVALS = ("approved", "rejected")
DONE = {
    "resolved": "The in-doubt call is resolved; the audit record below names you.",
    "approved": "Approved: the next claim of the call gets claimed.",
    "rejected": "Rejected: the call will not execute.",
    "replayed": "The outbox event is pending again.",
}
# The feed's event types (docs/reference.md): the live page listens to each by name.
FEED_TYPES = (
    "run.created", "run.status", "run.claimed", "step.created", "step.status", "tool_call.claimed",
    "tool_call.running", "tool_call.completed", "tool_call.in_doubt", "tool_call.lease_expired",
    "tool_call.rejected", "tool_call.replayed", "tool_call.resolved", "approval.requested",
    "approval.resolved", "artifact.created", "audit.recorded", "cost.recorded", "response_event.recorded",
    "citation.recorded", "feedback.recorded",
)
# How soon an open live stream notices that its session ended.
LIVE_CHECK_S = 2.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True)
class ConsoleConfig:
    """What a console serves: the database (a conninfo string of a login role granted
    ledger_writer or ledger_reader), the users file, the scopes people may pick, the secret
    that signs sessions (random per process unless given) and how long a session lives at most."""

    dsn: str
    users: Path
    scopes: list[tuple[str, str]]
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    session_max_age_s: int = DEFAULT_MAX_AGE_S


class Refused(Exception):
    """A request the console refuses: shown as a page with this status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def create_app(config: ConsoleConfig) -> Starlette:
    """The console. Checks the role first (data.NotAllowed for a superuser or a role without a
    ledger grant); the connections open with the app's lifespan."""
    role = data.check_role(config.dsn)
    pool: ConnectionPool[Any] = ConnectionPool(config.dsn, min_size=1, max_size=8, open=False,
                                               check=ConnectionPool.check_connection)
    ledger = Ledger(pool)
    hub = EventHub(config.dsn)
    signer = Signer(config.secret, config.session_max_age_s)
    users = Users(config.users)
    env = Environment(loader=PackageLoader("ledger_console"), autoescape=True)
    # JSON as text (ensure_ascii=False: "café", not "caf\u00e9"), left to autoescape; Jinja's tojson
    # writes \u escapes, made for <script>, that people would read as they are.
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    env.filters["compact"] = lambda value: json.dumps(value, sort_keys=True, ensure_ascii=False)
    env.filters["cost"] = lambda cost: ", ".join(f"{v} {k}" for k, v in (cost or {}).items()) or "-"
    env.filters["ms"] = lambda ms: "-" if ms is None else f"{ms / 1000:.2f} s"
    env.filters["at"] = lambda t: "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(pool.open, True)
        await run_in_threadpool(data.check_scopes, ledger, config.scopes)
        async with hub:
            yield
        await run_in_threadpool(pool.close)

    # --- Sessions and the checks every request goes through ---

    def session_of(request: Request) -> Session | None:
        return live(signer.load(request.cookies.get(COOKIE)))

    def live(session: Session | None) -> Session | None:
        """The session, signed out when it ended since it was issued: the cookie alone proves
        nothing once a copy of it may be elsewhere."""
        if session is not None and session.user is not None \
                and not users.session_live(session.user, session.sid or ""):
            return Session.new()
        return session

    def render(request: Request, template: str, http_status: int = 200, session: Session | None = None,
               **context: Any) -> HTMLResponse:
        session = session or session_of(request)
        body = env.get_template(template).render(
            session=session, role=role, can_act=role.writer, scopes=config.scopes, statuses=data.STATUSES,
            path=request.url.path, **context,
        )
        return HTMLResponse(body, status_code=http_status)

    def with_cookie(response: Response, session: Session) -> Response:
        response.set_cookie(COOKIE, signer.dump(session), max_age=config.session_max_age_s, path="/", httponly=True,
                            samesite="strict")
        return response

    def same_origin(request: Request) -> bool:
        """The request came from a page of the console: Origin (or, without it, Referer) is the
        console's own origin."""
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        if origin is not None:
            return origin == own
        referer = request.headers.get("referer", "")
        return referer == own or referer.startswith(own + "/")

    async def checked_form(request: Request, *, act: bool) -> tuple[Session, dict[str, str]]:
        """The form of a state-changing POST, after the checks: same origin, a session, its CSRF
        token; `act` (an action on the ledger): a signed-in person and a writer console."""
        if not same_origin(request):
            raise Refused(403, "Refused: this request did not come from a page of the console.")
        session = session_of(request)
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        if session is None or not session.csrf_ok(fields.get("csrf", "")):
            raise Refused(403, "Refused: the form's security token is missing or wrong. Reload the page and try again.")
        if act:
            if session.user is None:
                raise Refused(403, "Sign in first.")
            if not role.writer:
                raise Refused(403, "This console is read-only (its database role is a ledger_reader).")
            if session.scope is None:
                raise Refused(403, "Pick a scope first.")
        return session, fields

    def scoped(session: Session) -> ScopedLedger:
        assert session.scope is not None
        return ledger.scoped(*session.scope)

    Handler = Callable[[Request, Session], Awaitable[Response]]

    def page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A page for a signed-in person with a scope; refusals and ledger errors become pages."""

        async def endpoint(request: Request) -> Response:
            session = session_of(request)
            if session is None or session.user is None:
                return RedirectResponse("/login?" + urlencode({"next": request.url.path}), 303)
            if session.scope is None:
                return RedirectResponse("/scope", 303)
            try:
                return await handler(request, session)
            except Refused as exc:
                return render(request, "error.html", exc.status, message=exc.message)
            except LedgerError as exc:
                return render(request, "error.html", _status(exc), message=exc.message, code=exc.code)

        return endpoint

    def action(handler: Callable[[Request, Session, dict[str, str]], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                session, fields = await checked_form(request, act=True)
                return await handler(request, session, fields)
            except Refused as exc:
                return render(request, "error.html", exc.status, message=exc.message)
            except LedgerError as exc:
                return render(request, "error.html", _status(exc), message=exc.message, code=exc.code)

        return endpoint

    # --- Sign-in and scope ---

    async def login_form(request: Request) -> Response:
        session = session_of(request) or Session.new()
        nxt = _local(request.query_params.get("next"))
        return with_cookie(render(request, "login.html", session=session, next=nxt), session)

    async def login(request: Request) -> Response:
        try:
            session, fields = await checked_form(request, act=False)
        except Refused as exc:
            return render(request, "error.html", exc.status, message=exc.message)
        name, password = fields.get("user", ""), fields.get("password", "")
        if not await run_in_threadpool(users.authenticate, name, password):
            return render(request, "login.html", 401, session=session, next=fields.get("next"),
                          error="Unknown name or wrong password.")
        if session.user is not None and session.sid is not None:  # the session this sign-in replaces
            await run_in_threadpool(users.end_session, session.user, session.sid)
        sid = await run_in_threadpool(users.start_session, name, int(time.time()) + config.session_max_age_s)
        if sid is None:  # removed since the password was checked
            return render(request, "login.html", 401, session=session, next=fields.get("next"),
                          error="Unknown name or wrong password.")
        session = session.signed_in(name, sid)
        if len(config.scopes) == 1:
            session = session.with_scope(*config.scopes[0])
        target = _local(fields.get("next")) if session.scope else "/scope"
        return with_cookie(RedirectResponse(target, 303), session)

    async def logout(request: Request) -> Response:
        try:
            session, _ = await checked_form(request, act=False)
        except Refused as exc:
            return render(request, "error.html", exc.status, message=exc.message)
        if session.user is not None and session.sid is not None:
            await run_in_threadpool(users.end_session, session.user, session.sid)
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def scope_form(request: Request) -> Response:
        session = session_of(request)
        if session is None or session.user is None:
            return RedirectResponse("/login", 303)
        return render(request, "scope.html")

    async def pick_scope(request: Request) -> Response:
        try:
            session, fields = await checked_form(request, act=False)
            if session.user is None:
                raise Refused(403, "Sign in first.")
            chosen = tuple(fields.get("scope", "").split("/", 1))
            if chosen not in config.scopes:
                raise Refused(400, "That scope is not one this console serves.")
        except Refused as exc:
            return render(request, "error.html", exc.status, message=exc.message)
        tenant, workspace = chosen
        return with_cookie(RedirectResponse("/runs", 303), session.with_scope(tenant, workspace))

    # --- Pages ---

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", 303)

    async def runs(request: Request, session: Session) -> Response:
        qp = request.query_params
        status = qp.get("status") or None
        if status is not None and status not in data.STATUSES:
            raise Refused(400, "Unknown status.")
        user, q, cursor = (qp.get("user") or "").strip() or None, (qp.get("q") or "").strip() or None, qp.get("after")
        found = await run_in_threadpool(lambda: data.list_runs(scoped(session), status=status, user=user, q=q, cursor=cursor))
        nxt = None
        if found.next_cursor:
            nxt = "/runs?" + urlencode({k: v for k, v in (("status", status), ("user", user), ("q", q),
                                                          ("after", found.next_cursor)) if v})
        return render(request, "runs.html", runs=found.runs, status=status, user=user, q=q, next_url=nxt,
                      first_page=cursor is None)

    async def run(request: Request, session: Session) -> Response:
        run_id = request.query_params.get("id", "")
        view = await run_in_threadpool(data.run_view, scoped(session), run_id)
        if view is None:
            raise Refused(404, f"No run {run_id} in this scope.")
        done = DONE.get(request.query_params.get("done", ""))
        types = sorted(set(FEED_TYPES) | {e["event_type"] for e in view.events})
        return render(request, "run.html", v=view, svg=Markup(timeline_svg(view)), done=done, feed_types=types)

    async def timeline(request: Request, session: Session) -> Response:
        view = await run_in_threadpool(data.run_view, scoped(session), request.query_params.get("id", ""))
        if view is None:
            raise Refused(404, "No such run in this scope.")
        return Response(timeline_svg(view), media_type="image/svg+xml")

    async def bundle(request: Request, session: Session) -> Response:
        run_id = request.query_params.get("id", "")
        body = await run_in_threadpool(data.replay_bundle, scoped(session), run_id)
        return Response(json.dumps(body, indent=2), media_type="application/json", headers={
            "content-disposition": f'attachment; filename="replay-bundle-{_filename(run_id)}.json"'})

    async def in_doubt(request: Request, session: Session) -> Response:
        rows = await run_in_threadpool(data.in_doubt, scoped(session))
        return render(request, "in_doubt.html", calls=rows, done=DONE.get(request.query_params.get("done", "")))

    async def approvals(request: Request, session: Session) -> Response:
        rows = await run_in_threadpool(data.pending_approvals, scoped(session))
        return render(request, "approvals.html", approvals=rows, done=DONE.get(request.query_params.get("done", "")))

    async def outbox(request: Request, session: Session) -> Response:
        rows = await run_in_threadpool(data.failed_outbox, scoped(session))
        return render(request, "outbox.html", events=rows, done=DONE.get(request.query_params.get("done", "")))

    # --- Actions ---

    async def resolve(request: Request, session: Session, fields: dict[str, str]) -> Response:
        decision = fields.get("decision", "")
        if decision not in DECISIONS:
            raise Refused(400, "Pick a decision: succeeded, failed or retry.")
        try:
            result = data.parse_result(fields.get("result", ""))
        except ValueError as exc:
            raise Refused(400, f"Nothing was written: {exc}.") from exc
        note = fields.get("note", "").strip() or None
        assert session.user is not None
        done = await run_in_threadpool(data.resolve_tool_call, scoped(session), request.path_params["id"],
                                       decision, result, session.user, note)
        return RedirectResponse(f"/run?{urlencode({'id': done['run_id'], 'done': 'resolved'})}#audit", 303)

    async def decide(request: Request, session: Session, fields: dict[str, str]) -> Response:
        decision = fields.get("decision", "")
        if decision not in APPROVALS:
            raise Refused(400, "Pick a decision: approved or rejected.")
        assert session.user is not None
        await run_in_threadpool(data.resolve_approval, scoped(session), request.path_params["id"], decision,
                                session.user, fields.get("note", "").strip() or None)
        return RedirectResponse(f"/approvals?done={decision}", 303)

    async def replay(request: Request, session: Session, fields: dict[str, str]) -> Response:
        assert session.user is not None
        await run_in_threadpool(data.replay_outbox_event, scoped(session), request.path_params["id"], session.user)
        return RedirectResponse("/outbox?done=replayed", 303)

    def live_scope(scope: Scope) -> tuple[str, str] | None:
        """The ledger scope of a live-feed request: the signed-in person's, else refused."""
        cookie = SimpleCookie()
        for name, value in scope["headers"]:
            if name == b"cookie":
                cookie.load(value.decode("latin-1"))
        morsel = cookie.get(COOKIE)
        session = live(signer.load(morsel.value if morsel else None))
        return session.scope if session is not None and session.user is not None else None

    static = Path(__file__).parent / "static"
    routes = [
        Route("/", home),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/scope", scope_form, methods=["GET"]),
        Route("/scope", pick_scope, methods=["POST"]),
        Route("/runs", page(runs)),
        # A run id may hold any printable character, "/" included: it travels in the query.
        Route("/run", page(run)),
        Route("/run/timeline.svg", page(timeline)),
        Route("/run/bundle.json", page(bundle)),
        Mount("/live", app=_ends_with_session(sse_app(hub, live_scope, run_id_of=_run_id_of), live_scope)),
        Route("/in-doubt", page(in_doubt)),
        Route("/in-doubt/{id}", action(resolve), methods=["POST"]),
        Route("/approvals", page(approvals)),
        Route("/approvals/{id}", action(decide), methods=["POST"]),
        Route("/outbox", page(outbox)),
        Route("/outbox/{id}/replay", action(replay), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=static), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(SecurityHeaders)
    return app


class SecurityHeaders:
    """Adds the CSP and friends to every response (plain ASGI, so the live stream is untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"content-security-policy", CSP.encode()),
                                      (b"x-content-type-options", b"nosniff"),
                                      (b"referrer-policy", b"same-origin"),
                                      (b"x-frame-options", b"DENY")]
            await send(message)

        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


def _ends_with_session(app: ASGIApp, scope_of: Callable[[Scope], tuple[str, str] | None]) -> ASGIApp:
    """The live feed, ended once the session that opened it ends: an open stream makes no next
    request, so it asks `scope_of` again every LIVE_CHECK_S and then stops as if the browser had
    left (the stream's own cleanup runs); a reconnect is refused (403)."""

    async def ending(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        ended = False

        async def receive_until_ended() -> Message:
            nonlocal ended
            pending = asyncio.ensure_future(receive())
            try:
                while not (await asyncio.wait({pending}, timeout=LIVE_CHECK_S))[0]:
                    if scope_of(scope) is None:
                        ended = True
                        return {"type": "http.disconnect"}
                return pending.result()
            finally:
                pending.cancel()  # nothing when it is done; else it would wait for the connection's end

        await app(scope, receive_until_ended, send)
        if ended:  # the stream was cut short: finish the response for the browser still there
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return ending


def _status(exc: LedgerError) -> int:
    """The HTTP status of a refused ledger call (nothing was written: the ledger rolled back)."""
    return {"P0002": 404, "22023": 400, "42501": 403, "55000": 409, "40001": 409, "23505": 409}.get(exc.sqlstate, 500)


def _local(target: str | None) -> str:
    """A redirect target inside the console (never another site)."""
    return target if target and target.startswith("/") and not target.startswith("//") and "\\" not in target else "/runs"


def _run_id_of(scope: Scope) -> str:
    """The run of a live-feed request: /live/?id=<run id>."""
    return str(parse_qs(scope.get("query_string", b"").decode("latin-1")).get("id", [""])[0])


def _filename(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
