"""The console's ASGI app (Starlette): the factory (routes, lifespan, headers), the sessions and
the checks every request goes through, sign-in and the scope; the pages are pages.py's, rendered
on the server, with forms for every action and the live run feed through `ledger_client.sse`.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger_client import LedgerError
from ledger_client.sse import sse_app

from . import data, pages
from .console import Console, ConsoleConfig, Refused
from .pages import render
from .sessions import COOKIE, Session

# How soon an open live stream notices that its session ended.
LIVE_CHECK_S = 2.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)

Page = Callable[[Console, Request, Session], Awaitable[Response]]
Action = Callable[[Console, Request, Session, dict[str, str]], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(config: ConsoleConfig) -> Starlette:
    """The console. Checks the role first (data.NotAllowed for a superuser or a role without a
    ledger grant); the connections open with the app's lifespan."""
    console = Console(config)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(console.pool.open, True)
        await run_in_threadpool(data.check_scopes, console.ledger, config.scopes)
        async with console.hub:
            yield
        await run_in_threadpool(console.pool.close)

    def live_scope(scope: Scope) -> tuple[str, str] | None:
        """The ledger scope of a live-feed request: the signed-in person's, else refused."""
        cookie = SimpleCookie()
        for name, value in scope["headers"]:
            if name == b"cookie":
                cookie.load(value.decode("latin-1"))
        morsel = cookie.get(COOKIE)
        session = console.live(console.signer.load(morsel.value if morsel else None))
        return session.scope if session is not None and session.user is not None else None

    static = Path(__file__).parent / "static"
    routes = [
        Route("/", _home),
        # The home: what waits for people in every scope, so it needs no scope picked.
        Route("/inbox", _page(console, pages.inbox, needs_scope=False)),
        Route("/login", _signing(console, _login_form), methods=["GET"]),
        Route("/login", _signing(console, _login), methods=["POST"]),
        Route("/logout", _signing(console, _logout), methods=["POST"]),
        Route("/scope", _signing(console, _scope_form), methods=["GET"]),
        Route("/scope", _signing(console, _pick_scope), methods=["POST"]),
        Route("/runs", _page(console, pages.runs)),
        # A run id may hold any printable character, "/" included: it travels in the query.
        Route("/run", _page(console, pages.run)),
        Route("/run/timeline.svg", _page(console, pages.timeline)),
        Route("/run/bundle.json", _page(console, pages.bundle)),
        Route("/run/input", _action(console, pages.send_input), methods=["POST"]),
        Mount("/live", app=_ends_with_session(sse_app(console.hub, live_scope, run_id_of=_run_id_of), live_scope)),
        Route("/in-doubt", _page(console, pages.in_doubt)),
        Route("/in-doubt/{id}/review", _action(console, pages.review), methods=["POST"]),
        Route("/in-doubt/{id}", _action(console, pages.resolve), methods=["POST"]),
        Route("/approvals", _page(console, pages.approvals)),
        Route("/approvals/{id}", _action(console, pages.decide), methods=["POST"]),
        Route("/outbox", _page(console, pages.outbox)),
        Route("/outbox/{id}/replay", _action(console, pages.replay), methods=["POST"]),
        Route("/budgets", _page(console, pages.budgets), methods=["GET"]),
        Route("/budgets", _action(console, pages.change_budget), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=static), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(SecurityHeaders)
    return app


# --- Sessions and the checks every request goes through ---


def _with_cookie(console: Console, response: Response, session: Session) -> Response:
    response.set_cookie(COOKIE, console.signer.dump(session), max_age=console.config.session_max_age_s, path="/",
                        httponly=True, samesite="strict")
    return response


def _same_origin(request: Request) -> bool:
    """The request came from a page of the console: Origin (or, without it, Referer) is the
    console's own origin."""
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin == own
    referer = request.headers.get("referer", "")
    return referer == own or referer.startswith(own + "/")


async def _checked_form(console: Console, request: Request, *, act: bool) -> tuple[Session, dict[str, str]]:
    """The form of a state-changing POST, after the checks: same origin, a session, its CSRF
    token; `act` (an action on the ledger): a signed-in person and a writer console."""
    if not _same_origin(request):
        raise Refused(403, "Refused: this request did not come from a page of the console.")
    session = console.session_of(request)
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    if session is None or not session.csrf_ok(fields.get("csrf", "")):
        raise Refused(403, "Refused: the form's security token is missing or wrong. Reload the page and try again.")
    if act:
        if session.user is None:
            raise Refused(403, "Sign in first.")
        if not console.role.writer:
            raise Refused(403, "This console is read-only (its database role is a ledger_reader).")
        if session.scope is None:
            raise Refused(403, "Pick a scope first.")
    return session, fields


async def _refusal(console: Console, request: Request, exc: Refused | LedgerError) -> Response:
    """A refused request or ledger call as an error page (nothing was written)."""
    if isinstance(exc, Refused):
        return await render(console, request, "error.html", exc.status, message=exc.message)
    return await render(console, request, "error.html", _status(exc), message=exc.message, code=exc.code)


def _page(console: Console, handler: Page, needs_scope: bool = True) -> Endpoint:
    """A page for a signed-in person (with a scope unless not `needs_scope`); refusals and ledger
    errors become pages."""

    async def endpoint(request: Request) -> Response:
        session = console.session_of(request)
        if session is None or session.user is None:
            return RedirectResponse("/login?" + urlencode({"next": request.url.path}), 303)
        if needs_scope and session.scope is None:
            return RedirectResponse("/scope?" + urlencode({"next": request.url.path}), 303)
        try:
            return await handler(console, request, session)
        except (Refused, LedgerError) as exc:
            return await _refusal(console, request, exc)

    return endpoint


def _action(console: Console, handler: Action) -> Endpoint:
    """An action's POST, after `_checked_form`; refusals and ledger errors become pages."""

    async def endpoint(request: Request) -> Response:
        try:
            session, fields = await _checked_form(console, request, act=True)
            return await handler(console, request, session, fields)
        except (Refused, LedgerError) as exc:
            return await _refusal(console, request, exc)

    return endpoint


def _signing(console: Console, handler: Callable[[Console, Request], Awaitable[Response]]) -> Endpoint:
    """Sign-in, sign-out and the scope: for anyone, with the checks of their own."""

    async def endpoint(request: Request) -> Response:
        return await handler(console, request)

    return endpoint


# --- Sign-in and scope ---


async def _home(request: Request) -> Response:
    return RedirectResponse("/inbox", 303)


async def _login_form(console: Console, request: Request) -> Response:
    session = console.session_of(request) or Session.new()
    nxt = _local(request.query_params.get("next"))
    return _with_cookie(console, await render(console, request, "login.html", session=session, next=nxt), session)


async def _login(console: Console, request: Request) -> Response:
    try:
        session, fields = await _checked_form(console, request, act=False)
    except Refused as exc:
        return await _refusal(console, request, exc)
    users, max_age_s = console.users, console.config.session_max_age_s
    name, password = fields.get("user", ""), fields.get("password", "")
    if not await run_in_threadpool(users.authenticate, name, password):
        return await render(console, request, "login.html", 401, session=session, next=fields.get("next"),
                            error="Unknown name or wrong password.")
    if session.user is not None and session.sid is not None:  # the session this sign-in replaces
        await run_in_threadpool(users.end_session, session.user, session.sid)
    sid = await run_in_threadpool(users.start_session, name, int(time.time()) + max_age_s)
    if sid is None:  # removed since the password was checked
        return await render(console, request, "login.html", 401, session=session, next=fields.get("next"),
                            error="Unknown name or wrong password.")
    session = session.signed_in(name, sid)
    if len(console.config.scopes) == 1:
        session = session.with_scope(*console.config.scopes[0])
    # The inbox by default, which needs no scope; a page that does asks for one first.
    return _with_cookie(console, RedirectResponse(_local(fields.get("next")), 303), session)


async def _logout(console: Console, request: Request) -> Response:
    try:
        session, _ = await _checked_form(console, request, act=False)
    except Refused as exc:
        return await _refusal(console, request, exc)
    if session.user is not None and session.sid is not None:
        await run_in_threadpool(console.users.end_session, session.user, session.sid)
    response = RedirectResponse("/login", 303)
    response.delete_cookie(COOKIE, path="/")
    return response


async def _scope_form(console: Console, request: Request) -> Response:
    session = console.session_of(request)
    if session is None or session.user is None:
        return RedirectResponse("/login", 303)
    return await render(console, request, "scope.html", next=_local(request.query_params.get("next")))


async def _pick_scope(console: Console, request: Request) -> Response:
    """Sets the session's scope: from the scope page, or from the inbox, whose counts are forms
    that pick their scope and go on (`next`) to the page where that is decided."""
    try:
        session, fields = await _checked_form(console, request, act=False)
        if session.user is None:
            raise Refused(403, "Sign in first.")
        chosen = tuple(fields.get("scope", "").split("/", 1))
        if chosen not in console.config.scopes:
            raise Refused(400, "That scope is not one this console serves.")
    except Refused as exc:
        return await _refusal(console, request, exc)
    tenant, workspace = chosen
    return _with_cookie(console, RedirectResponse(_local(fields.get("next")), 303), session.with_scope(tenant, workspace))


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
    return target if target and target.startswith("/") and not target.startswith("//") and "\\" not in target else "/inbox"


def _run_id_of(scope: Scope) -> str:
    """The run of a live-feed request: /live/?id=<run id>."""
    return str(parse_qs(scope.get("query_string", b"").decode("latin-1")).get("id", [""])[0])
