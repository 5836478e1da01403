"""SIGTERM and SIGINT as a stop request, for the loops' graceful shutdown."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def stop_on_signals(stop: threading.Event, enabled: bool) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT set ``stop`` instead of ending the process (only
    in the main thread, where Python delivers signals); the previous handlers come back after."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
