"""The ledger's operator console: a small ASGI app on the Python client, for the decisions the
ledger asks people to take (in-doubt calls, approvals, failed outbox events) and for reading a run
at a glance. Every rule stays in the extension: the console calls its functions."""

from .app import create_app
from .console import ConsoleConfig

__all__ = ["ConsoleConfig", "create_app"]
