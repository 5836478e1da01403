"""Signed session cookies and CSRF tokens.

A session is a small JSON object (the person once signed in, their session id, the chosen scope,
the CSRF token, when it was issued) signed with HMAC-SHA256 under the console's secret; the cookie
is HttpOnly, SameSite=Strict and lives at most the console's session lifetime. A signed-in session
also needs its id to be live in the users file (`users.Users.session_live`), so that signing out,
removing the person or changing their password ends every copy of the cookie; a restart with a new
secret signs everyone out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass, replace

COOKIE = "ledger_console"
DEFAULT_MAX_AGE_S = 12 * 3600


@dataclass(frozen=True)
class Session:
    csrf: str
    issued: int
    user: str | None = None
    sid: str | None = None
    tenant: str | None = None
    workspace: str | None = None

    @staticmethod
    def new() -> Session:
        return Session(csrf=secrets.token_urlsafe(32), issued=int(time.time()))

    def signed_in(self, user: str, sid: str) -> Session:
        """A new session for `user` (`sid` from `Users.start_session`): a new CSRF token too, so
        that a token seen before sign-in is worth nothing after."""
        return replace(Session.new(), user=user, sid=sid)

    def with_scope(self, tenant: str, workspace: str) -> Session:
        return replace(self, tenant=tenant, workspace=workspace)

    @property
    def scope(self) -> tuple[str, str] | None:
        return (self.tenant, self.workspace) if self.tenant and self.workspace else None

    def csrf_ok(self, token: str) -> bool:
        return hmac.compare_digest(self.csrf.encode(), token.encode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    def __init__(self, secret: bytes, max_age_s: int = DEFAULT_MAX_AGE_S) -> None:
        self._secret = secret
        self.max_age_s = max_age_s

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def dump(self, session: Session) -> str:
        body = _b64(json.dumps(asdict(session), separators=(",", ":")).encode())
        return f"{body}.{self._mac(body)}"

    def load(self, cookie: str | None) -> Session | None:
        """The session of a cookie, or None: absent, forged, malformed or expired."""
        if not cookie or "." not in cookie:
            return None
        body, mac = cookie.rsplit(".", 1)
        if not hmac.compare_digest(self._mac(body).encode(), mac.encode()):
            return None
        try:
            session = Session(**json.loads(_unb64(body)))
        except (ValueError, TypeError):
            return None
        if time.time() - session.issued > self.max_age_s:
            return None
        return session
