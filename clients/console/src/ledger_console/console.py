"""What every request of a console shares: its configuration, its database role, the ledger, the
live-feed hub, the users file and the session signer; and the person's session as the cookie and
the users file say it is."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg_pool import ConnectionPool
from starlette.requests import Request

from ledger_client import Ledger, ScopedLedger
from ledger_client.sse import EventHub

from . import data
from .sessions import COOKIE, DEFAULT_MAX_AGE_S, Session, Signer
from .users import Users


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


class Console:
    """One console's state. Checks the role first (data.NotAllowed for a superuser or a role
    without a ledger grant); the pool opens with the app's lifespan."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.role = data.check_role(config.dsn)
        self.pool: ConnectionPool[Any] = ConnectionPool(config.dsn, min_size=1, max_size=8, open=False,
                                                        check=ConnectionPool.check_connection)
        self.ledger = Ledger(self.pool)
        self.hub = EventHub(config.dsn)
        self.signer = Signer(config.secret, config.session_max_age_s)
        self.users = Users(config.users)

    def session_of(self, request: Request) -> Session | None:
        return self.live(self.signer.load(request.cookies.get(COOKIE)))

    def live(self, session: Session | None) -> Session | None:
        """The session, signed out when it ended since it was issued: the cookie alone proves
        nothing once a copy of it may be elsewhere."""
        if session is not None and session.user is not None \
                and not self.users.session_live(session.user, session.sid or ""):
            return Session.new()
        return session

    def scoped(self, session: Session) -> ScopedLedger:
        assert session.scope is not None
        return self.ledger.scoped(*session.scope)

