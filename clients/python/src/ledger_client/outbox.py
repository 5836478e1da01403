"""An outbox consumer loop: claim a batch (``claim_outbox_events``), call the handler per event,
ack the delivered ones, nack each failed one with its error (the ledger schedules the retry:
min(300, 2^(n-1)) seconds for the n-th attempt, ``failed`` after the 64th), and when nothing is
due wait for a ``NOTIFY ledger_outbox`` (at most ``wait_s``: backoffs and expired leases come due
without one). Delivery is at least once: the handler deduplicates on ``event.id``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from itertools import groupby
from typing import Any

import psycopg

from ._faults import again
from ._signals import stop_on_signals
from .client import Ledger
from .errors import WrongStateError
from .types import OutboxEvent

log = logging.getLogger("ledger_client.outbox")

CHANNEL = "ledger_outbox"
"""The channel each outbox insert notifies (after commit)."""


class OutboxConsumer:
    """Delivers the outbox of ``scope`` (or of every scope for a member of ``ledger_operator``)
    to ``handler``; an exception from the handler nacks that event."""

    def __init__(
        self,
        ledger: Ledger,
        handler: Callable[[OutboxEvent], None],
        *,
        lease_owner: str,
        scope: tuple[str, str] | None = None,
        max_events: int = 50,
        lease_seconds: int = 15,
        wait_s: float = 5.0,
        stopping: threading.Event | None = None,
    ) -> None:
        self.ledger = ledger
        self.handler = handler
        self.lease_owner = lease_owner
        self.scope = scope
        self.max_events = max_events
        self.lease_seconds = lease_seconds
        self.wait_s = wait_s
        self.stopping = stopping or threading.Event()  # shared with a Worker: one stop for both

    def stop(self) -> None:
        """Stops after the current batch is acked and nacked."""
        self.stopping.set()

    def run(self, *, handle_signals: bool = False) -> None:
        """Consumes until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals``); a dropped
        connection (a server restart) is opened again a second later."""
        with stop_on_signals(self.stopping, handle_signals):
            while not self.stopping.is_set():
                try:
                    self._consume()
                except psycopg.OperationalError as e:
                    log.warning("outbox consumer %s: %s; connecting again in 1 s", self.lease_owner, e)
                    self.stopping.wait(1.0)

    def _consume(self) -> None:
        """LISTENs before the first claim, so that no notification between a claim and the wait
        is lost, then claims and waits in turn."""
        with self.ledger.connection(autocommit=True) as listener:
            listener.execute(f"LISTEN {CHANNEL}")
            try:
                while not self.stopping.is_set():
                    if self.run_once() < self.max_events:
                        self._wait(listener)
            finally:
                if not listener.closed and not listener.broken:
                    listener.execute(f"UNLISTEN {CHANNEL}")

    def run_once(self) -> int:
        """One batch: claims, delivers, acks the delivered events, then nacks the failed ones
        (a refused nack cannot cost the acks); returns how many events were claimed."""
        if self.scope is None:
            events = self.ledger.claim_outbox_events(self.lease_owner, self.max_events, self.lease_seconds)
        else:
            events = self.ledger.scoped(*self.scope).claim_outbox_events(
                self.lease_owner, self.max_events, self.lease_seconds)
        delivered: list[OutboxEvent] = []
        failed: list[tuple[OutboxEvent, Exception]] = []
        for event in events:
            try:
                self.handler(event)
            except Exception as e:
                log.warning("outbox event %s (%s) failed: %r", event.id, event.event_type, e)
                failed.append((event, e))
            else:
                delivered.append(event)
        scope_of: Callable[[OutboxEvent], tuple[str, str]] = lambda e: (e.tenant_id, e.workspace_id)  # noqa: E731
        # Acks and nacks are written again on a fresh connection when it is lost: an ack ignores
        # what is done already, and a repeated nack is refused (below), so a repeat changes nothing.
        for (tenant, workspace), batch in groupby(sorted(delivered, key=scope_of), key=scope_of):
            ids = [e.id for e in batch]
            again("outbox ack", lambda: self.ledger.scoped(tenant, workspace).ack_outbox_events(self.lease_owner, ids))
        for event, error in failed:
            try:
                again("outbox nack", lambda: self.ledger.scoped(event.tenant_id, event.workspace_id).nack_outbox_events(
                    self.lease_owner, [event.id], str(error) or repr(error)))
            except WrongStateError as e:  # OUTBOX_NOT_LEASED: the lease ran out and another consumer has it
                log.warning("outbox event %s: not nacked (%s)", event.id, e)
        return len(events)

    def _wait(self, listener: psycopg.Connection[Any]) -> None:
        """Until a notification, ``wait_s`` or a stop request, whichever comes first."""
        deadline = time.monotonic() + self.wait_s
        while not self.stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for _ in listener.notifies(timeout=min(remaining, 0.2), stop_after=1):
                return
