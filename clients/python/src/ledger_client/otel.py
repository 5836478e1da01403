"""A run sent to an OpenTelemetry collector: `ledger.otel_trace` builds the trace (OTLP/JSON,
GenAI semantic conventions) in the database; this module only carries it over OTLP/HTTP.

JSON is sent as the extension made it. Protobuf (`protobuf=True`) needs the `opentelemetry-proto`
package (`pip install ./clients/python[otel]`) and converts that JSON with the official
definitions.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from .client import LedgerCalls

__all__ = ["OTLPExportError", "export_trace", "send_trace", "to_protobuf", "traces_endpoint"]

DEFAULT_ENDPOINT = "http://localhost:4318"


class OTLPExportError(Exception):
    """The collector refused the export (its HTTP status and body), or could not be reached."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def traces_endpoint(endpoint: str | None = None) -> str:
    """Where traces go, as the OpenTelemetry exporters decide it: `endpoint` (a base URL) or
    OTEL_EXPORTER_OTLP_ENDPOINT with `/v1/traces` appended, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    as it is, or the local collector's default."""
    if endpoint is None:
        signal = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if signal:
            return signal
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", DEFAULT_ENDPOINT)
    return endpoint.rstrip("/") + "/v1/traces"


def _env_headers() -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_HEADERS: `key=value` pairs separated by commas."""
    headers: dict[str, str] = {}
    for pair in os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[key.strip()] = urllib.parse.unquote(value.strip())
    return headers


def to_protobuf(trace: Mapping[str, Any]) -> bytes:
    """The OTLP/JSON trace as a serialized `ExportTraceServiceRequest`. OTLP/JSON writes trace and
    span ids in hex where protobuf's JSON mapping expects base64; everything else maps as is."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    message = ExportTraceServiceRequest()
    json_format.ParseDict(hex_ids_to_base64(trace), message)
    serialized: bytes = message.SerializeToString()
    return serialized


def hex_ids_to_base64(trace: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an OTLP/JSON request with its span and trace ids in protobuf JSON's base64."""
    copy: dict[str, Any] = json.loads(json.dumps(trace))
    for resource in copy.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for item in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if item.get(key):
                            item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    return copy


def send_trace(
    trace: Mapping[str, Any],
    endpoint: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    protobuf: bool = False,
    timeout: float = 10.0,
) -> bytes:
    """POSTs the trace to an OTLP/HTTP collector; returns the collector's response body. Raises
    OTLPExportError unless the collector answers 2xx."""
    if protobuf:
        body, content_type = to_protobuf(trace), "application/x-protobuf"
    else:
        body, content_type = json.dumps(trace).encode(), "application/json"
    request = urllib.request.Request(
        traces_endpoint(endpoint),
        data=body,
        method="POST",
        headers={**_env_headers(), **(headers or {}), "Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: bytes = response.read()
            return answer
    except urllib.error.HTTPError as e:
        raise OTLPExportError(f"the collector answered {e.code}", e.code, e.read()) from e
    except urllib.error.URLError as e:
        raise OTLPExportError(f"the collector could not be reached: {e.reason}") from e


def export_trace(
    ledger: LedgerCalls,
    run_id: str,
    endpoint: str | None = None,
    *,
    service_name: str = "ledger",
    headers: Mapping[str, str] | None = None,
    protobuf: bool = False,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Reads the run's trace (``ledger.scoped(...)``, or a transaction of it) and sends it;
    returns what was sent. Exporting a finished run again sends the same trace and span ids."""
    trace = ledger.otel_trace(run_id, service_name)
    send_trace(trace, endpoint, headers=headers, protobuf=protobuf, timeout=timeout)
    return trace
