"""The examples of the manual's "Following a run" and "Server-Sent Events (ASGI)"
(clients/python/README.md), run as written: the
follower block as a script against a test database, the SSE block as the module a real uvicorn
serves, read over HTTP."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_feed import feed, start_run, write_steps
from test_feed import watchdog  # noqa: F401 - the autouse fixture, for this module too
from test_sse import Stream

ROOT = Path(__file__).parent.parent
SRC = str(ROOT / "src")


def examples() -> list[str]:
    """The python block of each of the manual's two sections."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = []
    for heading in ("## Following a run", "## Server-Sent Events (ASGI)"):
        section = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^##|\Z)", text, re.S | re.M)
        assert section, f"no {heading!r}"
        [block] = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
        blocks.append(block)
    return blocks


def env(dsn: str) -> dict[str, str]:
    return {**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": SRC}


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_the_follower_example_follows_its_run_to_the_end_and_resumes(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", examples()[0]], env=env(dsn), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "1 run.created ",
        "2 run.status running",
        "3 step.created ",
        "4 step.created ",
        "5 run.status succeeded",
        "again: 3 step.created",
        "again: 4 step.created",
        "again: 5 run.status",
    ]


def serve_the_sse_example(dsn: str, tmp_path: Path) -> tuple["subprocess.Popen[str]", int]:
    """The manual's SSE block as the module a real uvicorn serves, once it listens: (server, port)."""
    (tmp_path / "streaming_app.py").write_text(examples()[1], encoding="utf-8")
    with socket.socket() as probe:  # a free port (uvicorn binds it a moment later)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(tmp_path), f"--port={port}", "streaming_app:app"],
        env=env(dsn),
        stderr=subprocess.PIPE,
        text=True,
    )
    while not listening(port):
        assert server.poll() is None, server.communicate()[1]
        time.sleep(0.05)
    return server, port


def test_the_sse_example_serves_a_signed_in_browser_only(dsn: str, tmp_path: Path) -> None:
    server, port = serve_the_sse_example(dsn, tmp_path)
    try:
        scope = ("acme", "streaming")
        start_run(dsn, "example", scope=scope)
        write_steps(dsn, "example", range(2), finish=True, scope=scope)
        alice = Stream(port, "example", scope=None, headers={"cookie": "session=session-of-alice"})
        assert alice.response.status == 200
        assert [e["id"] for e in alice.events()] == feed(dsn, "example", scope=scope)
        alice.close()
        stranger = Stream(port, "example", scope=None)
        assert stranger.response.status == 403
        stranger.close()
    finally:
        server.send_signal(signal.SIGINT)
        _, log = server.communicate(timeout=30)
        assert server.returncode == 0 and "Traceback" not in log, log


def test_sigterm_ends_the_open_streams_and_the_server(dsn: str, tmp_path: Path) -> None:
    """uvicorn waits for open responses before it shuts down, and a stream of a running run never
    ends by itself: SIGTERM must end the streams (cleanly, so that EventSource reconnects to
    another server with its Last-Event-ID) and the server with them."""
    server, port = serve_the_sse_example(dsn, tmp_path)
    try:
        scope = ("acme", "streaming")
        start_run(dsn, "running", scope=scope)
        write_steps(dsn, "running", range(2), scope=scope)
        alice = Stream(port, "running", scope=None, headers={"cookie": "session=session-of-alice"})
        assert alice.response.status == 200
        assert [e["id"] for e in alice.events(limit=4)] == feed(dsn, "running", scope=scope)
        server.send_signal(signal.SIGTERM)
        assert alice.frame() is None  # the response ended cleanly (a broken one raises IncompleteRead)
        alice.close()
        _, log = server.communicate(timeout=10)  # a stream that kept it open held it for good
        # After its clean shutdown uvicorn raises the signal it handled again: the exit is SIGTERM's.
        assert server.returncode == -signal.SIGTERM and "Traceback" not in log, log
        assert "Application shutdown complete" in log, log
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
