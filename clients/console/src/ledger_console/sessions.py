"""Signed session cookies and CSRF tokens.

A session is a small JSON object (the person once signed in, the chosen scope, the CSRF token, when
it was issued) signed with HMAC-SHA256 under the console's secret; the cookie is HttpOnly,
SameSite=Strict and lives at most `MAX_AGE_S`. Nothing is kept on the server, so a restart with a
new secret signs everyone out.
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
MAX_AGE_S = 12 * 3600


@dataclass(frozen=True)
class Session:
    csrf: str
    issued: int
    user: str | None = None
    tenant: str | None = None
    workspace: str | None = None

    @staticmethod
    def new() -> Session:
        return Session(csrf=secrets.token_urlsafe(32), issued=int(time.time()))

    def signed_in(self, user: str) -> Session:
        """A new session for `user`: a new CSRF token too, so that a token seen before sign-in is
        worth nothing after."""
        return replace(Session.new(), user=user)

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
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

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
        if time.time() - session.issued > MAX_AGE_S:
            return None
        return session
