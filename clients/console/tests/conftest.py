"""Fixtures: a fresh database with the extension per test (on the server of LEDGER_TEST_HOST /
LEDGER_TEST_PORT, user postgres), login roles for the console (a writer and a reader, bound to the
tests' scope), consoles served by `python -m ledger_console serve` in subprocesses, and headless
Chromium from Debian's packages driven over WebDriver (nothing is downloaded)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import DictRow, dict_row
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from ledger_client import ClaimOutcome, Ledger, ScopedLedger

SCOPE = ("acme", "support")
WRITER, READER = "ledger_console_test_writer", "ledger_console_test_reader"
OPERATOR = "ledger_console_test_operator"  # a ledger_operator: its inbox lists every scope granted to it
PASSWORD = "correct horse battery"
CONSOLE_DIR = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def server_dsn(dbname: str, user: str = "postgres") -> str:
    return f"host={os.environ['LEDGER_TEST_HOST']} port={os.environ['LEDGER_TEST_PORT']} user={user} dbname={dbname}"


@pytest.fixture
def dbname(request: pytest.FixtureRequest) -> Iterator[str]:
    """A new database with the extension, the console's login roles (a writer, a reader, an
    operator) bound to the tests' scope; dropped after."""
    name = "ledger_console_" + re.sub(r"\W", "_", request.node.name).lower()[:40]
    with psycopg.connect(server_dsn("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(server_dsn(name), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION ledger")
        for role, grant in ((WRITER, "ledger_writer"), (READER, "ledger_reader"), (OPERATOR, "ledger_operator")):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
                try:
                    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
                except psycopg.errors.DuplicateObject:  # created meanwhile by a test on another database
                    pass
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(grant), sql.Identifier(role)))
            conn.execute("SELECT ledger.grant_scope(%s, %s, %s)", (role, *SCOPE))
    yield name
    with psycopg.connect(server_dsn("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def scoped(dbname: str) -> ScopedLedger:
    """The application side (a writer) in the tests' scope."""
    return Ledger(server_dsn(dbname, WRITER)).scoped(*SCOPE)


@pytest.fixture
def person(dbname: str) -> Iterator[psycopg.Connection[DictRow]]:
    """Someone at a psql prompt in the tests' scope, to check what the console wrote."""
    with psycopg.connect(server_dsn(dbname), autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        yield conn


def in_doubt_call(scoped: ScopedLedger, run_id: str) -> str:
    """A call whose request left and whose answer never came (completed `unknown`): in doubt."""
    scoped.create_run("agent", {"ticket": 42}, run_id=run_id, user_id="u-17", input_summary="refund order 1042")
    claim = scoped.claim_tool_call(run_id, "email.send", {"to": "c@example.com", "api_key": "sk-live-0123456789abcdefghij"},
                                   tool_call_id="call-email", lease_owner="worker-7")
    assert claim.outcome is ClaimOutcome.CLAIMED and claim.tool_call is not None
    call = claim.tool_call
    scoped.begin_tool_call(call.id, call.attempt)
    scoped.complete_tool_call(call.id, call.attempt, "unknown", error_message="timeout after send")
    return call.id


def one(conn: psycopg.Connection[DictRow], query: Any, params: Any = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return next(iter(row.values()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def console_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{CONSOLE_DIR.parent / 'python' / 'src'}:{CONSOLE_DIR / 'src'}"}


def console_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ledger_console", *args]


@dataclass
class Console:
    url: str
    user: str
    users: Path
    process: subprocess.Popen[str]


@pytest.fixture
def start_console(dbname: str, tmp_path: Path) -> Iterator[Callable[..., Console]]:
    """Starts a console as the given login role, with more `serve` options if given (one person,
    `ops@acme`, may sign in); each is stopped after the test."""
    users = tmp_path / "users.json"
    subprocess.run(console_command("--users-file", str(users), "users", "add", "ops@acme", "--password-stdin"),
                   input=PASSWORD + "\n", text=True, check=True, env=console_env(), capture_output=True)
    started: list[Console] = []

    def start(role: str, *options: str) -> Console:
        port = _free_port()
        proc = subprocess.Popen(
            console_command("--users-file", str(users), "serve", "--port", str(port), *options),
            env={**console_env(), "LEDGER_CONSOLE_DSN": server_dsn(dbname, role), "LEDGER_CONSOLE_SCOPES": "/".join(SCOPE)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the URL, once it serves (or why it did not start)
        assert line.startswith("ledger console: http://127.0.0.1:"), line + proc.stdout.read()
        console = Console(url=line.split()[2].rstrip("/"), user="ops@acme", users=users, process=proc)
        started.append(console)
        return console

    yield start
    for console in started:
        console.process.terminate()
        console.process.wait(timeout=10)


@pytest.fixture
def console(start_console: Callable[..., Console]) -> Console:
    return start_console(WRITER)


@pytest.fixture(scope="session")
def screenshots() -> Iterator[Path]:
    """Where the tests save a picture of each page: LEDGER_CONSOLE_SCREENSHOTS (the README's
    docs/console), else a temporary directory."""
    wanted = os.environ.get("LEDGER_CONSOLE_SCREENSHOTS")
    if wanted:
        path = Path(wanted).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="ledger-console-shots-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def chromium() -> Iterator[WebDriver]:
    """One headless Chromium for the whole run (Debian's, through Debian's chromedriver)."""
    profile = tempfile.mkdtemp(prefix="ledger-console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900"):
        options.add_argument(arg)
    os.environ["SE_OFFLINE"] = "true"  # Selenium must never look for a driver or a browser online
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Browser:
    """The browser as a person uses it, on one console."""

    def __init__(self, driver: WebDriver, console: Console, shots: Path) -> None:
        self.driver = driver
        self.console = console
        self.shots = shots

    def open(self, path: str) -> None:
        self.driver.get(self.console.url + path)

    def sign_in(self, password: str = PASSWORD) -> None:
        self.open("/login")
        self.driver.find_element(By.ID, "name").send_keys(self.console.user)
        self.driver.find_element(By.ID, "password").send_keys(password)
        self.submit(self.driver.find_element(By.ID, "signin"))

    def submit(self, element: WebElement) -> None:
        """Clicks something that loads a new page, and waits for it."""
        self.navigating(element.click)

    def navigating(self, action: Callable[[], object]) -> None:
        """Runs `action`, which loads a new page, and waits until the new page has loaded (the old
        page's window carries a mark the new one lacks)."""
        self.driver.execute_script("window.__leaving = true")
        action()
        self.wait("the next page", lambda: bool(self.driver.execute_script(
            "return !window.__leaving && document.readyState === 'complete'")))

    def text(self, css: str) -> str:
        return str(self.driver.find_element(By.CSS_SELECTOR, css).text)

    def wait(self, what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
        """Waits until `check` holds, asking again after an element or the page went away under
        it (a navigation); the timeout only stops a hung test."""
        WebDriverWait(self.driver, timeout_s, poll_frequency=0.1, ignored_exceptions=(WebDriverException,)).until(
            lambda _: check(), what)

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))


@pytest.fixture
def browser(chromium: WebDriver, console: Console, screenshots: Path) -> Browser:
    chromium.delete_all_cookies()
    return Browser(chromium, console, screenshots)


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
