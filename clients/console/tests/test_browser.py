"""The console end to end: a person in headless Chromium, the console in its own process as a
login role, the ledger on the real server. Each test saves pictures of the pages it visits."""

from __future__ import annotations

import http.server
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import DictRow
from selenium.common.exceptions import NoAlertPresentException, NoSuchElementException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select

from conftest import (OPERATOR, READER, WRITER, Browser, Console, console_command, console_env, in_doubt_call, one,
                      server_dsn)
from ledger_client import ClaimOutcome, Ledger, ScopedLedger, WaitStatus
from ledger_console.sessions import COOKIE


def test_sign_in_find_a_run_and_watch_an_event_arrive_live(browser: Browser, scoped: ScopedLedger) -> None:
    for i in range(3):
        scoped.create_run("chat", run_id=f"run-other-{i}", user_id="someone")
    scoped.create_run("agent", run_id="run-live", request_id="req-live-1", user_id="u-live", subject_kind="agent",
                      subject_id="support-bot", input_summary="where is my order?")
    step = scoped.create_step("run-live", "llm", step_key="plan")
    scoped.transition_run("run-live", "running")
    scoped.transition_step(step.id, "running")

    browser.open("/runs")  # not signed in: sent to sign in
    assert browser.driver.current_url.startswith(browser.console.url + "/login")
    browser.shot("sign-in")
    browser.sign_in(password="wrong password")
    assert "Unknown name or wrong password" in browser.text("#error")
    browser.sign_in()
    assert browser.driver.current_url == browser.console.url + "/inbox"  # the home, once signed in
    assert browser.text("#user") == "ops@acme" and browser.text("#scope") == "acme / support"
    browser.open("/runs")
    assert "run-live" in browser.text("#runs")
    browser.shot("runs")

    browser.driver.find_element(By.ID, "q").send_keys("req-live-1")  # search by request id
    browser.submit(browser.driver.find_element(By.ID, "search"))
    links = browser.driver.find_elements(By.CSS_SELECTOR, "#runs a.run-link")
    assert [a.text for a in links] == ["run-live"]
    browser.submit(links[0])
    browser.wait("the run page", lambda: browser.text("#run-id") == "run-live")
    browser.wait("the live stream", lambda: browser.text("#live") == "live")
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline svg g.bar[data-status=running]")

    # The worker goes on; the page shows it without a reload.
    scoped.record_cost("run-live", "tokens", 1200, Decimal("0.0042"), "USD", step_id=step.id)
    scoped.record_response_event("run-live", "message", {"text": "It ships tomorrow."}, step_id=step.id)
    scoped.transition_step(step.id, "succeeded")
    browser.wait("the response event, live", lambda: "response_event.recorded" in browser.text("#events"))
    browser.wait("the timeline redrawn", lambda: bool(browser.driver.find_elements(
        By.CSS_SELECTOR, "#timeline svg g.bar[data-status=succeeded]")))
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline svg g.mark-costs")
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline svg g.mark-responses")
    scoped.transition_run("run-live", "succeeded", output_summary="answered")
    browser.wait("the run's end, live", lambda: browser.text("#live") == "ended")
    assert "run.status" in browser.text("#events")
    assert len(browser.driver.find_elements(By.CSS_SELECTOR, "#evidence tbody tr")) == 13
    assert browser.text("#replay-ready").startswith("replay_ready:")
    browser.shot("run")


def test_paging_and_filters(browser: Browser, scoped: ScopedLedger) -> None:
    ids = [f"run-{i:03}" for i in range(60)]
    for run_id in ids:
        scoped.create_run("chat", run_id=run_id, user_id="pat" if run_id.endswith("7") else "kim")
    scoped.transition_run("run-013", "failed", error_code="E")
    browser.sign_in()
    browser.open("/runs")
    first = [a.text for a in browser.driver.find_elements(By.CSS_SELECTOR, "#runs a.run-link")]
    browser.submit(browser.driver.find_element(By.ID, "older"))
    second = [a.text for a in browser.driver.find_elements(By.CSS_SELECTOR, "#runs a.run-link")]
    assert len(first) == 50 and len(second) == 10 and sorted(first + second) == ids  # each once
    assert not browser.driver.find_elements(By.ID, "older")
    browser.open("/runs")
    Select(browser.driver.find_element(By.ID, "status")).select_by_value("failed")
    browser.submit(browser.driver.find_element(By.ID, "search"))
    assert [a.text for a in browser.driver.find_elements(By.CSS_SELECTOR, "#runs a.run-link")] == ["run-013"]
    browser.open("/runs?user=pat")
    assert sorted(a.text for a in browser.driver.find_elements(By.CSS_SELECTOR, "#runs a.run-link")) == \
        [i for i in ids if i.endswith("7")]


def line_count(browser: Browser, element: WebElement) -> int:
    """How many lines the element's text takes on screen."""
    return int(browser.driver.execute_script(
        "const r = document.createRange(); r.selectNodeContents(arguments[0]);"
        " return new Set(Array.from(r.getClientRects(), (b) => Math.round(b.top))).size;", element))


def test_resolve_an_in_doubt_call_after_reviewing_it_and_see_the_outcome(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    record_id = in_doubt_call(scoped, "run-doubt")
    status = "SELECT status FROM ledger.run_step_tool_calls WHERE id = %s"
    resolutions = "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'tool_call.resolve'"
    browser.sign_in()
    browser.open("/in-doubt")
    card = browser.driver.find_element(By.ID, f"call-{record_id}")
    assert "email.send" in card.text and "worker-7" in card.text
    assert "[REDACTED]" in card.text and "sk-live" not in card.text  # the arguments as the ledger keeps them
    # Nothing is picked: the form is not complete until the person picks a decision.
    assert not any(radio.is_selected() for radio in card.find_elements(By.NAME, "decision"))
    assert not browser.driver.execute_script("return arguments[0].checkValidity()",
                                             card.find_element(By.TAG_NAME, "form"))
    browser.shot("in-doubt")

    # A result that is not JSON: a clear message, nothing written.
    card.find_element(By.CSS_SELECTOR, "input[value=succeeded]").click()
    card.find_element(By.NAME, "result").send_keys("{message_id: 42")
    browser.submit(card.find_element(By.CSS_SELECTOR, "button.review"))
    assert "the result is not JSON" in browser.text("#error")

    # "No result", reviewed, then not recorded: the review page writes nothing, nor does going back.
    browser.open("/in-doubt")
    card = browser.driver.find_element(By.ID, f"call-{record_id}")
    card.find_element(By.CSS_SELECTOR, "input[value=succeeded]").click()
    card.find_element(By.NAME, "no_result").click()
    browser.submit(card.find_element(By.CSS_SELECTOR, "button.review"))
    assert browser.text("#confirm-decision").startswith("succeeded") and browser.text("#confirm-result") == "no result"
    browser.submit(browser.driver.find_element(By.ID, "back"))
    assert one(person, status, (record_id,)) == "in_doubt" and one(person, resolutions) == 0

    card = browser.driver.find_element(By.ID, f"call-{record_id}")
    card.find_element(By.CSS_SELECTOR, "input[value=succeeded]").click()
    card.find_element(By.NAME, "result").send_keys('{"message_id": "<42@mail>"}')
    card.find_element(By.NAME, "note").send_keys("found in the mail log")
    browser.submit(card.find_element(By.CSS_SELECTOR, "button.review"))
    assert "<42@mail>" in browser.text("#confirm-result") and browser.text("#confirm-note") == "found in the mail log"
    browser.shot("in-doubt-confirm")
    browser.submit(browser.driver.find_element(By.ID, "record"))
    # The outcome on top of the page, where the person looks: the call's status and the record.
    assert browser.driver.current_url == f"{browser.console.url}/in-doubt?resolved={record_id}"
    assert browser.driver.execute_script("return window.scrollY") == 0
    outcome = browser.driver.find_element(By.ID, "outcome")
    assert outcome.rect["y"] + outcome.rect["height"] < browser.driver.execute_script("return window.innerHeight")
    assert browser.text("#outcome-status") == "succeeded" and "gets the result back" in browser.text("#outcome-then")
    [record] = browser.driver.find_elements(By.CSS_SELECTOR, "#outcome-audit tbody tr")
    cells = {c.get_attribute("class"): c.text for c in record.find_elements(By.TAG_NAME, "td")}
    assert (cells["actor"], cells["what"], cells["note"]) == ("ops@acme", "tool_call.resolve: succeeded",
                                                              "found in the mail log")
    assert browser.text("#none") == "No call is in doubt."
    browser.shot("resolved")
    row = person.execute("SELECT actor, outcome, payload->>'note' AS note FROM ledger.audit_events"
                         " WHERE gateway_type = 'tool_call.resolve'").fetchone()
    assert row == {"actor": "ops@acme", "outcome": "succeeded", "note": "found in the mail log"}
    assert person.execute("SELECT status, result FROM ledger.run_step_tool_calls WHERE id = %s", (record_id,)).fetchone() \
        == {"status": "succeeded", "result": {"message_id": "<42@mail>"}}

    # The run's audit reads as a table: who, what and when on one line each, the note in its column.
    browser.submit(browser.driver.find_element(By.ID, "outcome-run"))
    table = browser.driver.find_element(By.ID, "audit-records")
    for cell in table.find_elements(By.CSS_SELECTOR, "td.when, td.actor, td.what"):
        assert line_count(browser, cell) == 1, cell.text
    notes = [c.text for c in table.find_elements(By.CSS_SELECTOR, "td.note")]
    assert notes[-1] == "found in the mail log" and "found in the mail log" not in table.find_elements(
        By.CSS_SELECTOR, "td.details")[-1].text
    browser.driver.execute_script("arguments[0].scrollIntoView()", browser.driver.find_element(By.ID, "audit"))
    browser.shot("audit")


def test_the_inbox_counts_what_waits_in_two_scopes_and_leads_to_each_decision(
    chromium: WebDriver, start_console: Callable[..., Console], dbname: str, scoped: ScopedLedger,
    person: psycopg.Connection[DictRow], screenshots: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    person.execute("SELECT ledger.grant_scope(%s, 'acme', 'billing')", (WRITER,))
    billing = Ledger(server_dsn(dbname, WRITER)).scoped("acme", "billing")
    # acme/support: an approval asked for and an outbox event that used up its attempts.
    scoped.create_run("agent", run_id="run-pay")
    asked = scoped.request_tool_approval("run-pay", "payments.transfer", {"amount": "120.00"}, tool_call_id="call-pay",
                                         title="Pay supplier")
    assert asked.approval is not None
    scoped.create_run("chat", run_id="run-obx")
    # acme/billing: a call in doubt and a run a budget stopped.
    record_id = in_doubt_call(billing, "run-doubt")
    budget_stopped_run(billing, "run-budget")
    # Setup only (the superuser writes the tables): the failed event, and how long each has waited.
    for update, params in (
        ("UPDATE ledger.approval_requests SET created_at = now() - interval '5 minutes' WHERE id = %s",
         (asked.approval.id,)),
        ("UPDATE ledger.outbox SET status = 'failed', attempt_count = 64, processed_at = now() - interval '3 days'"
         " WHERE run_id = 'run-obx'", ()),
        ("UPDATE ledger.run_step_tool_calls SET updated_at = now() - interval '2 hours' WHERE id = %s", (record_id,)),
        ("UPDATE ledger.runs SET updated_at = now() - interval '3 hours' WHERE workspace_id = 'billing'"
         " AND id = 'run-budget'", ()),
    ):
        assert person.execute(update, params).rowcount == 1
    chromium.delete_all_cookies()
    browser = Browser(chromium, start_console(WRITER, "--scopes", "acme/support,acme/billing"), screenshots)

    def cell(scope: str, queue: str) -> WebElement:
        return browser.driver.find_element(By.CSS_SELECTOR, f'#inbox tr[data-scope="{scope}"] td.{queue}')

    browser.sign_in()  # two scopes: none is picked, and the inbox needs none
    assert browser.driver.current_url == browser.console.url + "/inbox" and browser.text("#scope") == "pick a scope"
    assert [cell("acme/support", q).text for q in ("calls_in_doubt", "pending_approvals", "budget_stops",
                                                    "failed_outbox_events")] == ["0", "1 pending for 5 min", "0",
                                                                                 "1 failed for 3 days"]
    assert [cell("acme/billing", q).text for q in ("calls_in_doubt", "pending_approvals", "budget_stops",
                                                    "failed_outbox_events")] == ["1 in doubt for 2 h", "0",
                                                                                 "1 stopped for 3 h", "0"]
    assert browser.text("#waiting") == "4"
    browser.shot("inbox")

    # From "something waits" to "decided", every click counted (typing is not a click).
    clicks = 0

    def click(element: WebElement, loads_a_page: bool = False) -> None:
        nonlocal clicks
        clicks += 1
        browser.submit(element) if loads_a_page else element.click()

    click(cell("acme/billing", "calls_in_doubt").find_element(By.TAG_NAME, "button"), loads_a_page=True)
    assert browser.driver.current_url == browser.console.url + "/in-doubt"
    assert browser.text("#scope") == "acme / billing"  # the count picked its scope
    card = browser.driver.find_element(By.ID, f"call-{record_id}")
    click(card.find_element(By.CSS_SELECTOR, "input[value=succeeded]"))
    card.find_element(By.NAME, "result").send_keys('{"message_id": "<42@mail>"}')
    card.find_element(By.NAME, "note").send_keys("found in the mail log")
    click(card.find_element(By.CSS_SELECTOR, "button.review"), loads_a_page=True)
    click(browser.driver.find_element(By.ID, "record"), loads_a_page=True)
    assert browser.text("#outcome-status") == "succeeded"
    with capsys.disabled():
        print(f"\nconsole: {clicks} clicks from the inbox to a decided in-doubt call (result and note typed)")
    assert clicks == 4
    decided = person.execute("SELECT t.status, a.actor, a.payload->>'note' AS note FROM ledger.run_step_tool_calls t"
                             " JOIN ledger.audit_events a ON a.workspace_id = t.workspace_id AND a.run_id = t.run_id"
                             " AND a.gateway_type = 'tool_call.resolve' WHERE t.id = %s", (record_id,)).fetchall()
    assert decided == [{"status": "succeeded", "actor": "ops@acme", "note": "found in the mail log"}]
    browser.submit(browser.driver.find_element(By.ID, "nav-inbox"))
    assert cell("acme/billing", "calls_in_doubt").text == "0" and browser.text("#waiting") == "3"

    # Each other count leads to its decision, in its scope.
    browser.submit(cell("acme/support", "pending_approvals").find_element(By.TAG_NAME, "button"))
    assert browser.text("#scope") == "acme / support"
    browser.submit(browser.driver.find_element(By.CSS_SELECTOR, f"#approval-{asked.approval.id} button.approve"))
    browser.open("/inbox")
    browser.submit(cell("acme/support", "failed_outbox_events").find_element(By.TAG_NAME, "button"))
    browser.submit(browser.driver.find_element(By.CSS_SELECTOR, "#outbox button.replay"))
    browser.open("/inbox")
    browser.submit(cell("acme/billing", "budget_stops").find_element(By.TAG_NAME, "button"))
    assert browser.text("#scope") == "acme / billing"
    set_maximum(browser, browser.driver.find_element(By.CSS_SELECTOR, "#budgets tr.budget[data-unit=tool_calls]"),
                "3", "two more searches")
    # Raised, the budget leaves the run to a worker's next claim: no person is waited for any more.
    browser.open("/inbox")
    assert browser.text("#all-well") == "All is well: nothing waits for a person in 2 scopes."
    assert not browser.driver.find_elements(By.ID, "waiting")
    browser.shot("inbox-all-well")
    assert person.execute("SELECT status, actor FROM ledger.approval_requests").fetchall() == \
        [{"status": "approved", "actor": "ops@acme"}]
    assert one(person, "SELECT count(*) FROM ledger.outbox WHERE status = 'failed'") == 0


def test_an_operator_console_lists_its_other_scopes_read_only(
    chromium: WebDriver, start_console: Callable[..., Console], dbname: str, person: psycopg.Connection[DictRow],
    screenshots: Path,
) -> None:
    for role in (OPERATOR, WRITER):
        person.execute("SELECT ledger.grant_scope(%s, 'acme', 'billing')", (role,))
    in_doubt_call(Ledger(server_dsn(dbname, OPERATOR)).scoped("acme", "billing"), "run-billing")
    in_doubt_call(Ledger(server_dsn(dbname)).scoped("globex", "ops"), "run-globex")  # not granted to either role
    chromium.delete_all_cookies()
    browser = Browser(chromium, start_console(OPERATOR), screenshots)  # serves acme/support only
    browser.sign_in()
    rows = browser.driver.find_elements(By.CSS_SELECTOR, "#inbox tbody tr")
    assert [r.get_attribute("data-scope") for r in rows] == ["acme/support", "acme/billing"]
    assert "not served by this console" in rows[1].text and "1 in doubt for" in rows[1].text
    assert not rows[1].find_elements(By.TAG_NAME, "form")  # counted, not selectable
    assert browser.text("#waiting") == "1" and "ledger_operator" in browser.text("#operator")
    browser.shot("inbox-operator")
    # The inbox's form made by hand for that scope: refused, the scope stays.
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))
    submit_form(browser, "/scope", {"csrf": token, "scope": "acme/billing", "next": "/in-doubt"})
    assert "not one this console serves" in browser.text("#error")
    browser.open("/in-doubt")
    assert browser.text("#scope") == "acme / support" and browser.text("#none") == "No call is in doubt."

    # A console whose role is no operator lists the scopes it serves, and only them.
    chromium.delete_all_cookies()
    browser = Browser(chromium, start_console(WRITER), screenshots)
    browser.sign_in()
    assert [r.get_attribute("data-scope") for r in browser.driver.find_elements(By.CSS_SELECTOR, "#inbox tbody tr")] \
        == ["acme/support"]
    assert browser.text("#all-well") == "All is well: nothing waits for a person in 1 scope."


def test_approve_a_call_and_the_next_claim_is_claimed(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="run-pay")
    args = {"supplier": "ACME Parts", "amount": "1200.00"}
    asked = scoped.request_tool_approval("run-pay", "payments.transfer", args, tool_call_id="call-pay",
                                         title="Pay supplier <ACME>", policy_ref="payments/v2")
    assert asked.outcome is ClaimOutcome.WAITING_APPROVAL and asked.approval is not None
    assert scoped.claim_tool_call("run-pay", "payments.transfer", args, tool_call_id="call-pay").outcome \
        is ClaimOutcome.WAITING_APPROVAL
    browser.sign_in()
    browser.open("/approvals")
    card = browser.driver.find_element(By.ID, f"approval-{asked.approval.id}")
    assert "Pay supplier <ACME>" in card.text and "ACME Parts" in card.text
    browser.shot("approvals")
    card.find_element(By.NAME, "note").send_keys("invoice checked")
    browser.submit(card.find_element(By.CSS_SELECTOR, "button.approve"))
    assert "Approved" in browser.text("#notice")
    assert browser.text("#none") == "No approval is pending."
    decided = person.execute("SELECT status, actor, note FROM ledger.approval_requests WHERE id = %s",
                             (asked.approval.id,)).fetchone()
    assert decided == {"status": "approved", "actor": "ops@acme", "note": "invoice checked"}
    assert scoped.claim_tool_call("run-pay", "payments.transfer", args, tool_call_id="call-pay").outcome \
        is ClaimOutcome.CLAIMED


def test_replay_a_failed_outbox_event(browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    scoped.create_run("chat", run_id="run-obx")
    # Setup only (the superuser writes the table): an event that used up its attempts, failed now
    # (processed_at, as the ledger stamps a failure).
    event_id = one(person, "UPDATE ledger.outbox SET status = 'failed', attempt_count = 64, processed_at = now(),"
                           " error_message = 'HTTP 503 from billing' WHERE run_id = 'run-obx' RETURNING id")
    browser.sign_in()
    browser.open("/outbox")
    assert "HTTP 503 from billing" in browser.text("#outbox")
    browser.shot("outbox")
    browser.submit(browser.driver.find_element(By.CSS_SELECTOR, "#outbox button.replay"))
    assert "pending again" in browser.text("#notice")
    row = person.execute("SELECT status, replay_count FROM ledger.outbox WHERE id = %s", (event_id,)).fetchone()
    assert row == {"status": "pending", "replay_count": 1}
    # Who replayed it is in the run's audit, written by the ledger with the replay.
    audit = person.execute(
        "SELECT gateway_type, outcome, actor, payload->>'outbox_event_id' AS event FROM ledger.audit_events"
        " WHERE run_id = 'run-obx' AND outcome = 'replayed'").fetchall()
    assert audit == [{"gateway_type": "outbox.replay", "outcome": "replayed", "actor": "ops@acme", "event": event_id}]


def test_a_reader_sees_everything_and_can_act_on_nothing(
    chromium: WebDriver, start_console: Callable[..., Console], scoped: ScopedLedger,
    person: psycopg.Connection[DictRow], screenshots: Path,
) -> None:
    record_id = in_doubt_call(scoped, "run-read")
    asked = scoped.request_tool_approval("run-read", "payments.transfer", {"amount": "5"}, tool_call_id="call-pay")
    assert asked.approval is not None
    event_id = one(person, "UPDATE ledger.outbox SET status = 'failed', attempt_count = 64, processed_at = now()"
                           " WHERE run_id = 'run-read' AND event_type = 'run.created' RETURNING id")
    chromium.delete_all_cookies()
    browser = Browser(chromium, start_console(READER), screenshots)
    browser.sign_in()
    assert browser.text('#inbox td.calls_in_doubt').startswith("1 in doubt for")  # a reader sees what waits
    browser.open("/runs")
    assert "run-read" in browser.text("#runs") and "(read-only)" in browser.text("#role")
    browser.open("/in-doubt")
    card = browser.driver.find_element(By.ID, f"call-{record_id}")
    assert "email.send" in card.text
    assert not card.find_elements(By.TAG_NAME, "form")  # no action offered
    browser.shot("in-doubt-read-only")
    # POSTs made anyway (with the session's own token, from the console's page, each complete and
    # confirmed) are refused.
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))
    for action, fields in (
        (f"/in-doubt/{record_id}/review", {"decision": "failed", "note": "x"}),
        (f"/in-doubt/{record_id}", {"decision": "failed", "note": "x", "confirm": "yes"}),
        (f"/in-doubt/{record_id}", {"decision": "succeeded", "no_result": "yes", "confirm": "yes"}),
        (f"/approvals/{asked.approval.id}", {"decision": "approved", "note": "x"}),
        (f"/outbox/{event_id}/replay", {}),
    ):
        submit_form(browser, action, {"csrf": token, **fields})
        assert "read-only" in browser.text("#error"), action
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE id = %s", (record_id,)) == "in_doubt"
    assert one(person, "SELECT status FROM ledger.approval_requests WHERE id = %s", (asked.approval.id,)) == "pending"
    assert one(person, "SELECT status FROM ledger.outbox WHERE id = %s", (event_id,)) == "failed"
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE actor = 'ops@acme'") == 0


def submit_form(browser: Browser, action: str, fields: dict[str, str]) -> None:
    """Builds and submits a form on the current page, as a forger's script would (WebDriver's
    scripts are not bound by the page's CSP)."""
    browser.navigating(lambda: browser.driver.execute_script(
        "const f = document.createElement('form'); f.method = 'post'; f.action = arguments[0];"
        "for (const [k, v] of Object.entries(arguments[1])) {"
        "  const i = document.createElement('input'); i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i); }"
        "document.body.appendChild(f); f.submit();", action, fields))


@pytest.fixture
def evil_site(console: Console) -> Iterator[str]:
    """A page on another origin that posts a decision to the console as soon as it loads."""
    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            target = self.path.removeprefix("/?target=")
            page = (f'<!doctype html><form id="f" method="post" action="{console.url}{target}">'
                    '<input name="decision" value="approved"><input name="note" value="forged"></form>'
                    '<script>document.getElementById("f").submit()</script>').encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Same host, another port: another origin but the same site, so the browser even sends the
    # console's SameSite=Strict cookie; the Origin check and the token must refuse it.
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_forged_posts_are_refused_and_write_nothing(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow], evil_site: str
) -> None:
    scoped.create_run("agent", run_id="run-forged")
    asked = scoped.request_tool_approval("run-forged", "payments.transfer", {"amount": "9999"}, tool_call_id="call-x")
    assert asked.approval is not None
    target = f"/approvals/{asked.approval.id}"
    browser.sign_in()
    assert browser.driver.current_url == browser.console.url + "/inbox"

    # A page on another origin posts to the console while the person is signed in.
    browser.driver.get(f"{evil_site}/?target={target}")
    browser.wait("the console's refusal", lambda: browser.driver.current_url.startswith(browser.console.url)
                 and "Refused" in browser.text("#error"))
    browser.shot("forged-post-refused")
    # From the console's own origin, without the token and with a wrong one.
    browser.open("/approvals")
    submit_form(browser, target, {"decision": "approved"})
    assert "security token" in browser.text("#error")
    browser.open("/approvals")
    submit_form(browser, target, {"decision": "approved", "csrf": "not-the-token"})
    assert "security token" in browser.text("#error")
    row = person.execute("SELECT status, actor FROM ledger.approval_requests WHERE id = %s", (asked.approval.id,)).fetchone()
    assert row == {"status": "pending", "actor": None}
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'approval.decision'") == 0


def test_malformed_input_is_refused_with_nothing_written(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    record_id = in_doubt_call(scoped, "run-bad")
    browser.sign_in()
    browser.open("/in-doubt")
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))
    submit_form(browser, f"/in-doubt/{record_id}", {"csrf": token, "decision": "maybe", "confirm": "yes"})
    assert "pick a decision" in browser.text("#error")
    browser.open("/in-doubt")
    submit_form(browser, "/in-doubt/tc_unknown", {"csrf": token, "decision": "failed", "confirm": "yes"})
    assert "TOOL_CALL_NOT_FOUND" in browser.text("#error")  # the ledger's refusal, shown
    browser.open("/in-doubt")
    submit_form(browser, f"/in-doubt/{record_id}", {"csrf": token, "decision": "succeeded", "result": "[1, 2",
                                                    "confirm": "yes"})
    assert "not JSON" in browser.text("#error")
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE id = %s", (record_id,)) == "in_doubt"
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'tool_call.resolve'") == 0


def test_markup_in_a_run_is_shown_as_text(browser: Browser, scoped: ScopedLedger) -> None:
    evil = "<script>alert('xss')</script>"
    scoped.create_run("chat", run_id="run-<img/src=x/onerror=alert(1)>", user_id=evil, input_summary=evil,
                      subject_kind="chat", subject_id=evil)
    browser.sign_in()
    browser.open("/runs")
    assert evil in browser.text("#runs")
    browser.submit(browser.driver.find_element(By.CSS_SELECTOR, "#runs a.run-link"))
    browser.wait("the run page", lambda: browser.text("#run-id") == "run-<img/src=x/onerror=alert(1)>")
    assert browser.text("#input-summary") == evil
    assert evil in browser.text("#subject")
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main script, main img")
    with pytest.raises(NoAlertPresentException):
        browser.driver.switch_to.alert.text  # noqa: B018 (no script ran)
    browser.shot("escaping")


def test_unknown_run_is_not_found_and_a_removed_person_is_signed_out(browser: Browser) -> None:
    browser.sign_in()
    browser.open("/run?id=run-nowhere")
    assert "No run run-nowhere" in browser.text("#error")
    with pytest.raises(NoSuchElementException):
        browser.driver.find_element(By.ID, "timeline")
    subprocess.run(console_command("--users-file", str(browser.console.users), "users", "remove", "ops@acme"),
                   check=True, env=console_env(), capture_output=True, timeout=60)
    browser.open("/runs")
    assert browser.driver.current_url.startswith(browser.console.url + "/login")


def with_copied_cookie(console: Console, cookie: str, path: str, form: dict[str, str] | None = None) -> tuple[int, str]:
    """A request from elsewhere (an HTTP client, not the browser) carrying a copy of the browser's
    session cookie and the console's own Origin: the status and where it ended up."""
    request = urllib.request.Request(console.url + path, headers={"Cookie": f"{COOKIE}={cookie}", "Origin": console.url},
                                     data=None if form is None else urllib.parse.urlencode(form).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, str(response.url)
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc.url)


def test_a_copied_cookie_is_refused_after_sign_out(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="run-copied")
    before, after = (scoped.request_tool_approval("run-copied", "payments.transfer", {"amount": amount},
                                                  tool_call_id=f"call-{amount}").approval for amount in ("10", "20"))
    assert before is not None and after is not None
    record_id = in_doubt_call(scoped, "run-copied-doubt")
    browser.sign_in()
    browser.open("/approvals")
    copied = browser.driver.get_cookie(COOKIE)
    assert copied is not None
    cookie = str(copied["value"])
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))

    # While the person is signed in, the copy acts as them: that is what sign-out must end.
    assert with_copied_cookie(browser.console, cookie, f"/approvals/{before.id}",
                              {"csrf": token, "decision": "approved"}) == (200, f"{browser.console.url}/approvals?done=approved")
    browser.submit(browser.driver.find_element(By.ID, "logout"))
    assert browser.driver.current_url == browser.console.url + "/login"

    assert with_copied_cookie(browser.console, cookie, f"/approvals/{after.id}",
                              {"csrf": token, "decision": "approved", "note": "after sign-out"})[0] == 403
    assert with_copied_cookie(browser.console, cookie, f"/in-doubt/{record_id}",
                              {"csrf": token, "decision": "failed", "note": "after sign-out"})[0] == 403
    assert with_copied_cookie(browser.console, cookie, "/approvals") == \
        (200, f"{browser.console.url}/login?next=%2Fapprovals")  # sent to sign in
    decided = "SELECT status, actor FROM ledger.approval_requests WHERE id = %s"
    assert person.execute(decided, (before.id,)).fetchone() == {"status": "approved", "actor": "ops@acme"}
    assert person.execute(decided, (after.id,)).fetchone() == {"status": "pending", "actor": None}
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE id = %s", (record_id,)) == "in_doubt"
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'tool_call.resolve'") == 0


def test_a_runs_json_shows_its_text(browser: Browser, scoped: ScopedLedger) -> None:
    text = "café <b>bold</b> & co"
    scoped.create_run("agent", run_id="run-text", subject_kind="agent", subject_id=text)  # in run.created's payload
    claim = scoped.claim_tool_call("run-text", "notes.write", {"note": text}, tool_call_id="call-text")
    assert claim.tool_call is not None
    scoped.begin_tool_call(claim.tool_call.id, claim.tool_call.attempt)
    scoped.complete_tool_call(claim.tool_call.id, claim.tool_call.attempt, "unknown")
    scoped.resolve_tool_call(claim.tool_call.id, "failed", actor="ops@acme", note=text)  # in the audit's payload
    browser.sign_in()
    browser.open("/run?id=run-text")
    for table in ("#tool-calls", "#events", "#audit-records"):
        shown = browser.text(table)
        assert text in shown and "\\u" not in shown, shown  # text, not JSON escapes
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main b")  # and not markup


def budget_stopped_run(scoped: ScopedLedger, run_id: str) -> None:
    """A run with a budget of one tool call (warnings at half of it): its second claim was refused,
    which parked the run (paused, BUDGET_EXHAUSTED), and its worker released it; no claim hands it
    out."""
    scoped.create_run("agent", run_id=run_id)
    scoped.set_budget("tool_calls", 1, level="run", run_id=run_id, warn_ratio=Decimal("0.5"), actor="setup",
                      note="one search")
    claimed = scoped.claim_run("worker-1", run_id=run_id)
    assert claimed is not None
    scoped.transition_run(run_id, "running", run_token=claimed.run_token)
    for call_id, outcome in (("call-1", ClaimOutcome.CLAIMED), ("call-2", ClaimOutcome.BUDGET_EXHAUSTED)):
        assert scoped.claim_tool_call(run_id, "search.web", {"q": call_id}, tool_call_id=call_id,
                                      run_token=claimed.run_token).outcome is outcome
    scoped.release_run(run_id, claimed.run_token)
    assert scoped.claim_run("worker-2", run_id=run_id) is None


def waiting_run(scoped: ScopedLedger, run_id: str, input_key: str, deadline: datetime | None = None) -> None:
    """A run parked by its worker until the input `input_key` arrives: no claim hands it out."""
    scoped.create_run("agent", run_id=run_id)
    claimed = scoped.claim_run("worker-1", run_id=run_id)
    assert claimed is not None
    scoped.transition_run(run_id, "running", run_token=claimed.run_token)
    assert scoped.wait_for_input(run_id, claimed.run_token, input_key, deadline).status is WaitStatus.WAITING
    assert scoped.claim_run("worker-2", run_id=run_id) is None


def set_maximum(browser: Browser, row: WebElement, amount: str, note: str) -> None:
    box = row.find_element(By.NAME, "max_amount")
    box.clear()
    box.send_keys(amount)
    row.find_element(By.NAME, "note").send_keys(note)
    browser.submit(row.find_element(By.CSS_SELECTOR, "button[type=submit]"))


def answer_input(browser: Browser, payload: str) -> None:
    card = browser.driver.find_element(By.CSS_SELECTOR, "section.awaited")
    card.find_element(By.NAME, "payload").send_keys(payload)
    browser.submit(card.find_element(By.CSS_SELECTOR, "button[type=submit]"))


def test_raise_the_budget_that_stopped_a_run_and_the_run_is_claimable(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    budget_stopped_run(scoped, "run-budget")
    usage = "SELECT max_amount, warn_ratio, exhausted FROM ledger.budget_usage WHERE run_id = 'run-budget'"
    audit = ("SELECT actor, payload->'before'->>'max_amount' AS before, payload->'after'->>'max_amount' AS after,"
             " payload->>'note' AS note FROM ledger.audit_events WHERE gateway_type = 'budget.set' AND actor = 'ops@acme'")
    browser.sign_in()
    browser.open("/run?id=run-budget")
    assert "used up" in browser.text("#budget-stop")
    browser.submit(browser.driver.find_element(By.ID, "raise-budget"))
    row = browser.driver.find_element(By.CSS_SELECTOR, "#budgets tr.budget[data-unit=tool_calls]")
    assert "used up" in row.text and "0.5" in row.text
    browser.shot("budgets")

    # A note of blanks (the browser's `required` lets it through): refused, nothing written.
    set_maximum(browser, row, "3", "   ")
    assert "write a note" in browser.text("#error")
    assert person.execute(usage).fetchone() == {"max_amount": 1, "warn_ratio": Decimal("0.5"), "exhausted": True}
    assert person.execute(audit).fetchall() == []

    browser.open("/budgets?run=run-budget")
    note = "two more searches <script>alert('x')</script>"
    set_maximum(browser, browser.driver.find_element(By.CSS_SELECTOR, "#budgets tr.budget[data-unit=tool_calls]"),
                "3", note)
    # Back on the run page, the outcome at the top: what happens next, and no budget used up.
    assert browser.driver.current_url == browser.console.url + "/run?id=run-budget&done=budget"
    assert "handed out again by claim_run" in browser.text("#notice")
    assert "No budget that applies to this run is used up now" in browser.text("#budget-free")
    assert note in browser.text("#audit-records")  # the run's budget.set record, as text
    with pytest.raises(NoAlertPresentException):
        browser.driver.switch_to.alert.text  # noqa: B018 (no script ran)
    browser.shot("budget-raised")
    # The maximum changed, the warning ratio kept; the audit record names the person and the note.
    assert person.execute(usage).fetchone() == {"max_amount": 3, "warn_ratio": Decimal("0.5"), "exhausted": False}
    assert person.execute(audit).fetchall() == [{"actor": "ops@acme", "before": "1", "after": "3", "note": note}]
    claimed = scoped.claim_run("worker-2", run_id="run-budget")
    assert claimed is not None and claimed.status == "paused"


def test_answer_an_input_a_run_waits_for_and_the_run_is_claimable(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    key = 'refund "ok" <b>1042</b>'  # quotes and markup: shown as text, sent back as they are
    deadline = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=1)
    waiting_run(scoped, "run-ask", key, deadline)
    mailbox = ("SELECT input_key, payload, sender, received_at IS NOT NULL AS received FROM ledger.run_mailbox"
               " WHERE run_id = 'run-ask'")
    browser.sign_in()
    browser.open("/run?id=run-ask")
    assert browser.text("section.awaited code.key") == key
    assert deadline.strftime("%Y-%m-%d %H:%M:%S") in browser.text("section.awaited .deadline")

    # Not JSON: a clear message, nothing sent.
    answer_input(browser, "{answer: yes}")
    assert "the payload is not JSON" in browser.text("#error")
    assert person.execute(mailbox).fetchall() == [{"input_key": key, "payload": None, "sender": None, "received": False}]

    browser.open("/run?id=run-ask")
    card = browser.driver.find_element(By.CSS_SELECTOR, "section.awaited")
    card.find_element(By.NAME, "payload").send_keys(
        '{"answer": "yes", "comment": "café <b>ok</b>", "api_key": "sk-live-0123456789abcdefghij"}')
    browser.shot("input")
    browser.submit(card.find_element(By.CSS_SELECTOR, "button[type=submit]"))
    assert browser.driver.current_url == browser.console.url + "/run?id=run-ask&done=answered"
    assert "claimable at once" in browser.text("#notice")
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "section.awaited")  # answered
    received = browser.text("#received-inputs")
    assert key in received and "ops@acme" in received and "café <b>ok</b>" in received
    assert "[REDACTED]" in received and "sk-live" not in received  # the payload as the ledger keeps it
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main b")
    browser.shot("input-received")
    [row] = person.execute(mailbox).fetchall()
    assert row["sender"] == "ops@acme" and row["received"] and row["input_key"] == key
    assert row["payload"] == {"answer": "yes", "comment": "café <b>ok</b>", "api_key": "[REDACTED]"}
    assert one(person, "SELECT actor FROM ledger.audit_events WHERE gateway_type = 'input.send'") == "ops@acme"
    # The run is claimable again, and its worker's wait answers with the input.
    claimed = scoped.claim_run("worker-2", run_id="run-ask")
    assert claimed is not None
    answer = scoped.wait_for_input("run-ask", claimed.run_token, key, deadline)
    assert answer.status is WaitStatus.RECEIVED and answer.input is not None and answer.input.sender == "ops@acme"


def test_a_refused_input_shows_the_ledgers_code_and_writes_nothing(
    browser: Browser, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    waiting_run(scoped, "run-taken", "approve")
    waiting_run(scoped, "run-ended", "approve")
    browser.sign_in()
    browser.open("/run?id=run-taken")
    scoped.send_input("run-taken", "approve", {"answer": "no"}, sender="kim")  # someone answered first
    answer_input(browser, '{"answer": "yes"}')
    assert "IDEMPOTENCY_MISMATCH" in browser.text("#error")
    browser.open("/run?id=run-ended")
    # The run ended while the page was open (its not_before stays 'infinity': the client reads it).
    assert scoped.transition_run("run-ended", "canceled").status == "canceled"
    answer_input(browser, '{"answer": "yes"}')
    assert "RUN_TERMINAL" in browser.text("#error")
    browser.open("/run?id=run-ended")
    assert "ended without it" in browser.text("section.awaited")
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main form")
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))
    submit_form(browser, "/run/input?id=run-taken", {"csrf": token, "input_key": "ledger:child:x", "payload": "{}"})
    assert "INPUT_KEY_RESERVED" in browser.text("#error")
    rows = person.execute("SELECT run_id, input_key, sender FROM ledger.run_mailbox WHERE received_at IS NOT NULL").fetchall()
    assert rows == [{"run_id": "run-taken", "input_key": "approve", "sender": "kim"}]
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE actor = 'ops@acme'") == 0


def test_a_reader_can_neither_raise_a_budget_nor_answer_an_input(
    chromium: WebDriver, start_console: Callable[..., Console], scoped: ScopedLedger,
    person: psycopg.Connection[DictRow], screenshots: Path,
) -> None:
    budget_stopped_run(scoped, "run-r-budget")
    waiting_run(scoped, "run-r-ask", "approve")
    chromium.delete_all_cookies()
    browser = Browser(chromium, start_console(READER), screenshots)
    browser.sign_in()
    browser.open("/budgets")
    assert "used up" in browser.text("#budgets")
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main form")
    browser.open("/run?id=run-r-ask")
    assert "approve" in browser.text("section.awaited")
    assert not browser.driver.find_elements(By.CSS_SELECTOR, "main form")
    # POSTs made anyway (with the session's own token, from the console's page) are refused.
    token = str(browser.driver.find_element(By.CSS_SELECTOR, "header input[name=csrf]").get_attribute("value"))
    submit_form(browser, "/run/input?id=run-r-ask", {"csrf": token, "input_key": "approve", "payload": "{}"})
    assert "read-only" in browser.text("#error")
    submit_form(browser, "/budgets", {"csrf": token, "level": "run", "run_id": "run-r-budget", "unit": "tool_calls",
                                      "period": "total", "max_amount": "9", "note": "more"})
    assert "read-only" in browser.text("#error")
    assert one(person, "SELECT max_amount FROM ledger.budget_usage WHERE run_id = 'run-r-budget'") == 1
    assert one(person, "SELECT count(*) FROM ledger.run_mailbox WHERE received_at IS NOT NULL") == 0
