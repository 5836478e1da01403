"""The console without a browser: who it refuses to run as, its users file, its sessions, the live
feed's access check."""

from __future__ import annotations

import http.cookiejar
import json
import re
import subprocess
import time
import urllib.parse
import urllib.error
import urllib.request
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import DictRow

from conftest import PASSWORD, SCOPE, WRITER, Console, console_command, console_env, in_doubt_call, one, server_dsn
from ledger_client import ScopedLedger
from ledger_console.data import NotAllowed, check_role
from ledger_console.sessions import Session, Signer
from ledger_console.users import Users


def test_refuses_to_run_as_a_superuser(dbname: str, tmp_path: Path) -> None:
    with pytest.raises(NotAllowed, match="refuses to run as postgres"):
        check_role(server_dsn(dbname))
    done = subprocess.run(console_command("--users-file", str(tmp_path / "u.json"), "serve", "--port", "1"),
                          env={**console_env(), "LEDGER_CONSOLE_DSN": server_dsn(dbname), "LEDGER_CONSOLE_SCOPES": "acme/support"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "refuses to run as postgres" in done.stderr
    assert check_role(server_dsn(dbname, WRITER)).writer


def test_refuses_a_role_without_a_ledger_grant(dbname: str) -> None:
    outsider = "ledger_console_test_outsider"
    with psycopg.connect(server_dsn(dbname), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (outsider,)).fetchone() is None:
            try:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(outsider)))
            except psycopg.errors.DuplicateObject:  # created meanwhile by a test on another database
                pass
    with pytest.raises(NotAllowed, match="neither ledger_writer nor ledger_reader"):
        check_role(server_dsn(dbname, outsider))


def test_refuses_a_scope_its_role_may_not_use(dbname: str, tmp_path: Path) -> None:
    proc = subprocess.run(console_command("--users-file", str(tmp_path / "u.json"), "serve", "--port", "1"),
                          env={**console_env(), "LEDGER_CONSOLE_DSN": server_dsn(dbname, WRITER),
                               "LEDGER_CONSOLE_SCOPES": "globex/support"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "SCOPE_NOT_GRANTED" in proc.stdout + proc.stderr


def test_users_file_stores_scrypt_hashes_only(tmp_path: Path) -> None:
    users = Users(tmp_path / "users.json")
    users.set("ops@acme", "long enough")
    text = (tmp_path / "users.json").read_text()
    assert "long enough" not in text and "scrypt$" in text
    assert (tmp_path / "users.json").stat().st_mode & 0o777 == 0o600
    assert users.authenticate("ops@acme", "long enough")
    assert not users.authenticate("ops@acme", "long enougH")
    assert not users.authenticate("nobody", "long enough")
    with pytest.raises(ValueError):
        users.set("ops@acme", "short")


def test_sessions_are_signed_and_expire() -> None:
    signer = Signer(b"k" * 32)
    cookie = signer.dump(Session.new().signed_in("ops@acme", "sid-1").with_scope(*SCOPE))
    loaded = signer.load(cookie)
    assert loaded is not None and loaded.user == "ops@acme" and loaded.sid == "sid-1" and loaded.scope == SCOPE
    body, mac = cookie.rsplit(".", 1)
    assert signer.load(body + "." + mac[:-2] + "AA") is None  # forged
    assert Signer(b"x" * 32).load(cookie) is None  # another console's
    old = Session(csrf="t", issued=0, user="ops@acme")
    assert signer.load(signer.dump(old)) is None  # expired
    short = Signer(b"k" * 32, max_age_s=60)  # a console serving with a shorter lifetime
    assert short.load(short.dump(Session(csrf="t", issued=int(time.time()) - 61, user="ops@acme"))) is None
    assert short.load(short.dump(Session(csrf="t", issued=int(time.time()) - 30, user="ops@acme"))) is not None
    assert loaded.csrf_ok(loaded.csrf) and not loaded.csrf_ok("t")


def test_the_live_feed_needs_a_signed_in_person(console: Console) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{console.url}/live/?id=run-x", timeout=10)
    assert refused.value.code == 403
    with urllib.request.urlopen(f"{console.url}/in-doubt", timeout=10) as page:  # sent to sign in
        assert page.url == f"{console.url}/login?next=%2Fin-doubt"


def test_cli_adds_and_lists_people(tmp_path: Path) -> None:
    users = str(tmp_path / "users.json")
    add = subprocess.run(console_command("--users-file", users, "users", "add", "ana", "--password-stdin"),
                         input="a good password\n", text=True, capture_output=True, env=console_env(), timeout=60)
    assert add.returncode == 0
    listed = subprocess.run(console_command("--users-file", users, "users", "list"), text=True,
                            capture_output=True, env=console_env(), timeout=60)
    assert listed.stdout.split() == ["ana"]


def signed_in_opener(console: Console, password: str = PASSWORD,
                     jar: http.cookiejar.CookieJar | None = None) -> urllib.request.OpenerDirector:
    """An HTTP client signed in to the console as a browser would be (cookie, token, Origin)."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(
        http.cookiejar.CookieJar() if jar is None else jar))
    page = opener.open(f"{console.url}/login", timeout=10).read().decode()
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None
    form = urllib.parse.urlencode({"csrf": token[1], "user": console.user, "password": password}).encode()
    with opener.open(urllib.request.Request(f"{console.url}/login", data=form, headers={"Origin": console.url}),
                     timeout=10) as signed_in:
        assert signed_in.url == f"{console.url}/inbox", "not signed in"
    return opener


def page_url(opener: urllib.request.OpenerDirector, url: str) -> str:
    """Where a GET ends up: the page itself, or /login for a session that is not (or no longer) live."""
    with opener.open(url, timeout=10) as page:
        return str(page.url)


def users_cli(console: Console, *args: str, password: str | None = None) -> None:
    subprocess.run(console_command("--users-file", str(console.users), "users", *args), check=True, text=True,
                   input=None if password is None else password + "\n", env=console_env(), capture_output=True,
                   timeout=60)


def test_the_users_file_keeps_each_persons_live_sessions(tmp_path: Path) -> None:
    users = Users(tmp_path / "users.json")
    users.set("ana", "a good password")
    later = int(time.time()) + 3600
    first, second = users.start_session("ana", later), users.start_session("ana", later)
    assert first is not None and second is not None and first != second
    assert users.session_live("ana", first) and users.session_live("ana", second)
    assert not users.session_live("ana", "guessed") and not users.session_live("bob", first)
    assert users.start_session("bob", later) is None  # nobody of that name
    users.end_session("ana", first)  # signing out ends that session, not the other
    assert not users.session_live("ana", first) and users.session_live("ana", second)
    users.set("ana", "another password")  # a new password ends them all
    assert not users.session_live("ana", second)
    third = users.start_session("ana", later)
    assert third is not None
    users.remove("ana")
    users.set("ana", "another password")  # the same name again is someone new
    assert not users.session_live("ana", third)
    expired = users.start_session("ana", int(time.time()) - 1)
    assert expired is not None and not users.session_live("ana", expired)
    users.start_session("ana", later)  # a write drops the expired ones
    assert expired not in (tmp_path / "users.json").read_text()
    assert (tmp_path / "users.json").stat().st_mode & 0o777 == 0o600


def test_a_new_password_or_removing_the_person_ends_their_sessions(console: Console) -> None:
    runs = f"{console.url}/runs"
    opener = signed_in_opener(console)
    assert page_url(opener, runs) == runs
    users_cli(console, "add", console.user, "--password-stdin", password="a new password")
    assert page_url(opener, runs).startswith(f"{console.url}/login")
    opener = signed_in_opener(console, password="a new password")
    assert page_url(opener, runs) == runs
    users_cli(console, "remove", console.user)
    assert page_url(opener, runs).startswith(f"{console.url}/login")
    users_cli(console, "add", console.user, "--password-stdin", password="a new password")  # back again
    assert page_url(opener, runs).startswith(f"{console.url}/login")  # the old cookie stays dead


def test_the_session_lifetime_is_configurable(start_console: Callable[..., Console], tmp_path: Path) -> None:
    jar = http.cookiejar.CookieJar()
    signed_in_opener(start_console(WRITER, "--session-hours", "0.5"), jar=jar)
    [cookie] = list(jar)
    assert cookie.expires is not None and abs(cookie.expires - (time.time() + 1800)) < 60
    refused = subprocess.run(console_command("--users-file", str(tmp_path / "u.json"), "serve", "--session-hours", "0"),
                             env={**console_env(), "LEDGER_CONSOLE_DSN": "dbname=unused", "LEDGER_CONSOLE_SCOPES": "a/b"},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--session-hours takes 0.02 to 720" in refused.stderr


def test_the_live_feed_resumes_after_last_event_id(console: Console, scoped: ScopedLedger) -> None:
    scoped.create_run("agent", run_id="run-resume")
    for key in ("a", "b", "c"):
        scoped.create_step("run-resume", "llm", step_key=key)
    events = scoped.events_since("run-resume")
    opener = signed_in_opener(console)
    request = urllib.request.Request(f"{console.url}/live/?id=run-resume",
                                     headers={"Last-Event-ID": events[1].event_id})
    with opener.open(request, timeout=10) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        first = [stream.readline().decode().rstrip("\n") for _ in range(3)]
    assert first[0] == f"id: {events[2].event_id}" and first[1] == "event: step.created"
    assert json.loads(first[2].removeprefix("data: "))["seq"] == 3


def test_a_runs_lineage_and_its_replay_bundle(console: Console, scoped: ScopedLedger) -> None:
    scoped.create_run("agent", run_id="run-first")
    scoped.transition_run("run-first", "failed", error_code="TOOL_DOWN")
    retry = scoped.retry_run("run-first")
    opener = signed_in_opener(console)
    page = opener.open(f"{console.url}/run?id={retry.id}", timeout=10).read().decode()
    lineage = page[page.index('id="lineage"'):page.index("</ol>", page.index('id="lineage"'))]
    assert '<a href="/run?id=run-first">run-first</a>' in lineage and "attempt 1" in lineage
    assert f"<strong>{retry.id}</strong>" in lineage and "retry of run-first" in lineage
    with opener.open(f"{console.url}/run/bundle.json?id=run-first", timeout=10) as download:
        assert download.headers["content-disposition"] == 'attachment; filename="replay-bundle-run-first.json"'
        bundle = json.loads(download.read())
    assert bundle == scoped.replay_bundle("run-first")


def test_an_open_live_stream_ends_when_its_session_ends(console: Console, scoped: ScopedLedger) -> None:
    scoped.create_run("agent", run_id="run-open")
    jar = http.cookiejar.CookieJar()
    opener = signed_in_opener(console, jar=jar)
    [cookie] = list(jar)
    page = opener.open(f"{console.url}/runs", timeout=10).read().decode()
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None
    live = urllib.request.Request(f"{console.url}/live/?id=run-open", headers={"Cookie": f"{cookie.name}={cookie.value}"})
    # Keep-alives come every 15 s, so a stream left open after sign-out times this read out.
    with urllib.request.urlopen(live, timeout=10) as stream:  # a copy of the cookie, elsewhere
        assert stream.readline().startswith(b"id: ")
        form = urllib.parse.urlencode({"csrf": token[1]}).encode()
        opener.open(urllib.request.Request(f"{console.url}/logout", data=form, headers={"Origin": console.url}),
                    timeout=10)
        stream.read()  # returns once the console ends the response
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(live, timeout=10)
    assert refused.value.code == 403


def post(opener: urllib.request.OpenerDirector, console: Console, path: str, form: dict[str, str]) -> tuple[int, str, str]:
    """A POST from the console's origin: the status, the page it ended on and its text."""
    request = urllib.request.Request(console.url + path, data=urllib.parse.urlencode(form).encode(),
                                     headers={"Origin": console.url})
    try:
        with opener.open(request, timeout=10) as page:
            return page.status, str(page.url), page.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc.url), exc.read().decode()


def csrf_of(opener: urllib.request.OpenerDirector, url: str) -> str:
    token = re.search(r'name="csrf" value="([^"]+)"', opener.open(url, timeout=10).read().decode())
    assert token is not None
    return token[1]


def test_changing_a_budget_keeps_its_warning_and_refuses_what_is_not_a_change(
    console: Console, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.set_budget("usd", Decimal("0.50"), period="day", warn_ratio=None, actor="setup", note="trial")
    opener = signed_in_opener(console)
    page = opener.open(f"{console.url}/budgets", timeout=10).read().decode()
    assert 'data-unit="USD"' in page and "no warning" in page
    token = csrf_of(opener, f"{console.url}/budgets")
    budget = {"csrf": token, "level": "workspace", "run_id": "", "unit": "USD", "period": "day"}
    refused = [
        ({**budget, "max_amount": "ten", "note": "more"}, 400, "is not a number"),
        ({**budget, "max_amount": "", "note": "more"}, 400, "is not a number"),  # never NULL: that would remove it
        ({**budget, "max_amount": "Infinity", "note": "more"}, 400, "is not a number"),
        ({**budget, "max_amount": "2", "note": " "}, 400, "write a note"),
        ({**budget, "max_amount": "-1", "note": "more"}, 400, "AMOUNT_INVALID"),  # the ledger's refusal
        ({**budget, "period": "month", "max_amount": "2", "note": "more"}, 404, "no such budget"),
        ({**budget, "csrf": "wrong", "max_amount": "2", "note": "more"}, 403, "security token"),
    ]
    for form, status, message in refused:
        got = post(opener, console, "/budgets", form)
        assert got[0] == status and message in got[2], (form, got[:2])
    budget_now = "SELECT max_amount, warn_ratio, updated_by FROM ledger.budget_usage WHERE unit = 'USD'"
    assert person.execute(budget_now).fetchone() == {"max_amount": Decimal("0.50"), "warn_ratio": None, "updated_by": "setup"}
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'budget.set'") == 1

    status, url, page = post(opener, console, "/budgets", {**budget, "max_amount": "2.00", "note": "launch day"})
    assert (status, url) == (200, f"{console.url}/budgets?done=budget") and "handed out again by claim_run" in page
    # Only the maximum changed: a budget without warnings still has none (set_budget's default is 0.8).
    assert person.execute(budget_now).fetchone() == {"max_amount": Decimal("2.00"), "warn_ratio": None,
                                                     "updated_by": "ops@acme"}


def test_sending_an_input_refuses_what_is_not_json_and_needs_the_token(
    console: Console, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="run-in")
    opener = signed_in_opener(console)
    token = csrf_of(opener, f"{console.url}/runs")
    for form, status, message in [
        ({"csrf": token, "input_key": "k", "payload": "yes"}, 400, "the payload is not JSON"),
        ({"csrf": token, "input_key": "k", "payload": ""}, 400, "the payload is not JSON"),
        ({"csrf": token, "input_key": "k", "payload": "null"}, 400, "null is not an answer"),
        ({"input_key": "k", "payload": "{}"}, 403, "security token"),
    ]:
        got = post(opener, console, "/run/input?id=run-in", form)
        assert got[0] == status and message in got[2], (form, got[:2])
    assert post(opener, console, "/run/input?id=run-nowhere", {"csrf": token, "input_key": "k", "payload": "{}"})[0] == 404
    assert one(person, "SELECT count(*) FROM ledger.run_mailbox") == 0
    # An input may come before the run waits for it (its wait then answers received at once).
    status, url, _ = post(opener, console, "/run/input?id=run-in", {"csrf": token, "input_key": "k", "payload": "[1, 2]"})
    assert (status, url) == (200, f"{console.url}/run?id=run-in&done=answered")
    assert person.execute("SELECT payload, sender FROM ledger.run_mailbox").fetchone() == {"payload": [1, 2], "sender": "ops@acme"}
    with pytest.raises(urllib.error.HTTPError) as not_a_page:  # an action is a POST, never a GET
        opener.open(f"{console.url}/run/input?id=run-in", timeout=10)
    assert not_a_page.value.code == 405


def test_an_in_doubt_decision_is_confirmed_and_a_success_says_its_result(
    console: Console, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    record_id = in_doubt_call(scoped, "run-confirm")
    opener = signed_in_opener(console)
    token = csrf_of(opener, f"{console.url}/in-doubt")
    call, review = f"/in-doubt/{record_id}", f"/in-doubt/{record_id}/review"
    for path, form, status, message in [
        (call, {"decision": "failed", "note": "checked"}, 400, "confirm it first"),  # one click does not decide
        (call, {"decision": "succeeded", "confirm": "yes"}, 400, "needs its result"),
        (review, {"decision": "succeeded", "result": " "}, 400, "needs its result"),
        (call, {"decision": "succeeded", "result": "{}", "no_result": "yes", "confirm": "yes"}, 400, "not both"),
        (call, {"decision": "retry", "result": "{}", "confirm": "yes"}, 400, "records no result"),
        (call, {"confirm": "yes"}, 400, "pick a decision"),
        (call, {"decision": "succeeded", "result": "[1,", "confirm": "yes"}, 400, "not JSON"),
        (review, {"decision": "succeeded", "no_result": "yes"}, 200, "Nothing is recorded yet"),  # the review page
        (call, {"decision": "failed", "confirm": "yes"}, 403, "security token"),  # no token
    ]:
        got = post(opener, console, path, {"csrf": token, **form} if status != 403 else form)
        assert got[0] == status and message in got[2], (path, form, got[:2])
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE id = %s", (record_id,)) == "in_doubt"
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'tool_call.resolve'") == 0

    # Confirmed, with "no result": recorded, and the page shows the outcome.
    status, url, page = post(opener, console, call, {"csrf": token, "decision": "succeeded", "no_result": "yes",
                                                     "note": "sent, no id kept", "confirm": "yes"})
    assert (status, url) == (200, f"{console.url}/in-doubt?resolved={record_id}") and "Recorded:" in page
    assert person.execute("SELECT status, result FROM ledger.run_step_tool_calls WHERE id = %s",
                          (record_id,)).fetchone() == {"status": "succeeded", "result": None}
    assert person.execute("SELECT actor, outcome, payload->>'note' AS note FROM ledger.audit_events"
                          " WHERE gateway_type = 'tool_call.resolve'").fetchall() == \
        [{"actor": "ops@acme", "outcome": "succeeded", "note": "sent, no id kept"}]
    # Decided: a review of it is refused (nothing to decide), and so is deciding again (the ledger).
    assert post(opener, console, review, {"csrf": token, "decision": "failed"})[:2] == (404, f"{console.url}{review}")
    again = post(opener, console, call, {"csrf": token, "decision": "failed", "confirm": "yes"})
    assert again[0] == 409 and "TOOL_CALL_NOT_IN_DOUBT" in again[2]
