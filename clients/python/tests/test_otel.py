"""ledger.otel_trace read and sent by the client to a local OTLP/HTTP receiver, which decodes
what it gets with the official OpenTelemetry protobuf definitions (opentelemetry-proto)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from psycopg.types.json import Jsonb

from ledger_client import Ledger, NotFoundError
from ledger_client.otel import OTLPExportError, export_trace, send_trace


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: decodes each POST to /v1/traces into an
    ExportTraceServiceRequest (strictly: an unknown field or a malformed id is a 400)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.received: list[tuple[str, ExportTraceServiceRequest]] = []
        self.refuse_with: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def otlp_json_to_message(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON differs from protobuf's JSON mapping in one way: trace and span ids are hex."""
    doc = json.loads(body)
    for resource in doc["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for item in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            raw = bytes.fromhex(item[key])
                            assert len(raw) == (16 if key == "traceId" else 8), item[key]
                            item[key] = base64.b64encode(raw).decode()
    message = ExportTraceServiceRequest()
    json_format.ParseDict(doc, message, ignore_unknown_fields=False)
    return message


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        if self.server.refuse_with is not None:
            self.send_error(self.server.refuse_with)
            return
        content_type = self.headers["Content-Type"]
        try:
            if content_type == "application/json":
                message = otlp_json_to_message(body)
            elif content_type == "application/x-protobuf":
                message = ExportTraceServiceRequest.FromString(body)
            else:
                self.send_error(415)
                return
        except (ValueError, AssertionError, json_format.ParseError) as e:
            self.send_error(400, str(e))
            return
        self.server.received.append((content_type, message))
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def a_run_with_everything(conn: psycopg.Connection[Any], workspace: str = "otel", run_id: str = "run-otel") -> None:
    """A support run: a model step with its cost, a lookup that succeeded, an e-mail left in
    doubt, a refund approved by a person, and the answer shown to the user."""
    conn.execute("SELECT ledger.set_scope('acme', %s)", (workspace,))
    conn.execute(
        "SELECT ledger.create_run('agent', '{\"order\": 1042}', run_id => %s, subject_id => 'support-bot',"
        " subject_version_id => 'v3', user_id => 'u-7')",
        (run_id,),
    )
    conn.execute("SELECT ledger.transition_run(%s, 'running')", (run_id,))
    conn.execute("SELECT ledger.create_step(%s, 'llm', step_key => 'plan', status => 'running')", (run_id,))
    conn.execute(
        "SELECT ledger.record_cost(run_id, 'tokens', 1300, 0.0125, 'USD', step_id => id, usage => %s,"
        " provider => 'anthropic', model_ref => 'claude-sonnet') FROM ledger.run_steps WHERE run_id = %s",
        (Jsonb({"input_tokens": 1200, "output_tokens": 100, "cache_read_input_tokens": 1000}), run_id),
    )
    conn.execute("SELECT ledger.transition_step(id, 'succeeded') FROM ledger.run_steps WHERE run_id = %s", (run_id,))
    for call_id, tool, outcome in [("lookup", "crm.lookup_order", "succeeded"), ("email", "email.send", "unknown")]:
        claim = conn.execute(
            "SELECT ledger.claim_tool_call(%s, %s, %s, tool_call_id => %s)",
            (run_id, tool, Jsonb({"order": 1042}), call_id),
        ).fetchone()
        assert claim is not None
        record = claim[0]["tool_call"]["id"]
        conn.execute("SELECT ledger.begin_tool_call(%s, 1)", (record,))
        conn.execute(
            "SELECT ledger.complete_tool_call(%s, 1, %s, %s)", (record, outcome, Jsonb({"status": "shipped"}))
        )
    conn.execute(
        "SELECT ledger.request_tool_approval(%s, 'payments.refund', '{\"amount\": 5}', tool_call_id => 'refund')",
        (run_id,),
    )
    conn.execute(
        "SELECT ledger.resolve_approval(id, 'approved', actor => 'ops@acme') FROM ledger.pending_approvals"
        " WHERE run_id = %s",
        (run_id,),
    )
    conn.execute("SELECT ledger.record_response_event(%s, 'message', '{\"text\": \"Refunded.\"}')", (run_id,))
    conn.execute("SELECT ledger.transition_run(%s, 'succeeded')", (run_id,))


def attributes(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        assert which is not None
        out[kv.key] = getattr(kv.value, which)
    return out


def test_a_run_reaches_an_otlp_receiver_as_genai_spans(dsn: str, receiver: Receiver) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        a_run_with_everything(conn)
    scoped = Ledger(dsn).scoped("acme", "otel")
    sent = export_trace(scoped, "run-otel", receiver.url, service_name="support-agent")
    export_trace(scoped, "run-otel", receiver.url, service_name="support-agent", protobuf=True)
    assert [content_type for content_type, _ in receiver.received] == ["application/json", "application/x-protobuf"]
    as_json, as_protobuf = (message for _, message in receiver.received)
    # Both encodings carry the same request.
    assert as_json == as_protobuf

    (resource_spans,) = as_json.resource_spans
    resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert resource == {"service.name": "support-agent", "ledger.tenant_id": "acme", "ledger.workspace_id": "otel"}
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "ledger"
    spans = list(scope_spans.spans)
    assert [s.name for s in spans] == [
        "invoke_agent support-bot",
        "chat claude-sonnet",
        "execute_tool crm.lookup_order",
        "execute_tool email.send",
        "execute_tool payments.refund",
    ]
    run, chat, lookup, email, refund = spans
    assert all(len(s.trace_id) == 16 and s.trace_id == run.trace_id for s in spans)
    assert len({s.span_id for s in spans}) == 5
    assert run.parent_span_id == b"" and all(s.parent_span_id == run.span_id for s in spans[1:])
    assert all(s.end_time_unix_nano >= s.start_time_unix_nano > 0 for s in spans)

    assert run.kind == Span.SPAN_KIND_INTERNAL and run.status.code == Status.STATUS_CODE_OK
    run_attributes = attributes(run)
    assert run_attributes["gen_ai.operation.name"] == "invoke_agent"
    assert run_attributes["gen_ai.agent.version"] == "v3"
    assert run_attributes["gen_ai.usage.input_tokens"] == 1200
    assert run_attributes["ledger.cost.usd"] == pytest.approx(0.0125)
    assert run_attributes["ledger.run_id"] == "run-otel"
    assert [e.name for e in run.events] == ["ledger.response_event"]

    assert chat.kind == Span.SPAN_KIND_CLIENT
    chat_attributes = attributes(chat)
    assert chat_attributes["gen_ai.operation.name"] == "chat"
    assert chat_attributes["gen_ai.provider.name"] == "anthropic"
    assert chat_attributes["gen_ai.usage.output_tokens"] == 100
    assert chat_attributes["gen_ai.usage.cache_read.input_tokens"] == 1000

    lookup_attributes = attributes(lookup)
    assert lookup_attributes["gen_ai.tool.name"] == "crm.lookup_order"
    assert lookup_attributes["gen_ai.tool.call.id"] == "lookup"
    assert lookup.status.code == Status.STATUS_CODE_OK
    # The in-doubt call is an error with its reason; the refund carries the person's decision.
    assert email.status.code == Status.STATUS_CODE_ERROR
    # In doubt however it got there; the code the ledger recorded beside it.
    assert (attributes(email)["error.type"], attributes(email)["ledger.error_code"]) == ("in_doubt", "OUTCOME_UNKNOWN")
    assert all(attributes(s)["ledger.run_id"] == "run-otel" for s in spans)
    assert attributes(email)["ledger.tool_call.status"] == "in_doubt"
    assert [e.name for e in refund.events] == ["ledger.approval.requested", "ledger.approval.approved"]
    assert {kv.key: kv.value.string_value for kv in refund.events[1].attributes}["ledger.actor"] == "ops@acme"

    # The ids lead back to the ledger: the call's record is in the run's bundle.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'otel')")
        record = attributes(email)["ledger.tool_call_record_id"]
        found = conn.execute(
            "SELECT count(*) FROM jsonb_array_elements(ledger.replay_bundle('run-otel')->'tool_calls') c"
            " WHERE c->>'id' = %s AND c->>'status' = 'in_doubt'",
            (record,),
        ).fetchone()
        assert found == (1,)
    # A finished run exports the same trace again.
    assert scoped.otel_trace("run-otel", "support-agent") == sent


def test_a_refusing_or_absent_collector_is_an_error(dsn: str, receiver: Receiver) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        a_run_with_everything(conn)
    trace = Ledger(dsn).scoped("acme", "otel").otel_trace("run-otel")
    receiver.refuse_with = 503
    with pytest.raises(OTLPExportError) as refused:
        send_trace(trace, receiver.url)
    assert refused.value.status == 503
    assert receiver.received == []
    with pytest.raises(OTLPExportError) as absent:
        send_trace(trace, "http://127.0.0.1:9", timeout=2)
    assert absent.value.status is None


def test_a_run_of_another_scope_is_not_exported(dsn: str, receiver: Receiver) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        a_run_with_everything(conn)
    with pytest.raises(NotFoundError) as missing:
        export_trace(Ledger(dsn).scoped("acme", "elsewhere"), "run-otel", receiver.url)
    assert (missing.value.sqlstate, missing.value.code) == ("P0002", "RUN_NOT_FOUND")
    assert receiver.received == []


def test_the_evidence_manual_example_sends_the_demo_run(dsn: str, receiver: Receiver) -> None:
    """docs/evidence.md, "A run in OpenTelemetry": its Python block, run as written, with
    LEDGER_DSN and OTEL_EXPORTER_OTLP_ENDPOINT, against a run named like the demo's."""
    manual = (Path(__file__).parents[3] / "docs" / "evidence.md").read_text(encoding="utf-8")
    section = re.search(r"^## A run in OpenTelemetry\n(.*?)(?=^## |\Z)", manual, re.S | re.M)
    assert section, "docs/evidence.md has no section \"A run in OpenTelemetry\""
    (block,) = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    with psycopg.connect(dsn, autocommit=True) as conn:
        a_run_with_everything(conn, workspace="support", run_id="run-demo-1")
    env = {
        **os.environ,
        "LEDGER_DSN": dsn,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }
    out = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "5 spans sent\n"
    ((content_type, message),) = receiver.received
    assert content_type == "application/json"
    spans = message.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans][0] == "invoke_agent support-bot"
    assert {kv.key: kv.value.string_value for kv in message.resource_spans[0].resource.attributes}["service.name"] == "support-agent"
