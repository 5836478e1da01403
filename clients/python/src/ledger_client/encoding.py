"""The one encoding rule for tool-call arguments and results (:func:`tool_call` and
:func:`tool_calls` alike): what JSON cannot say is turned into what it can, exactly and the same
way every time, so that a replayed result equals the recorded one.

============================  =====================================================
``Decimal``                   its string, exact (``Decimal("12.30")`` -> ``"12.30"``)
``datetime``, ``date``,       ISO 8601 (``isoformat()``; an aware datetime keeps its
``time``                      offset)
``bytes``, ``bytearray``      base64 (standard alphabet, padded)
``UUID``                      its string
``Enum``                      its value, encoded by this rule
dataclass instance            a dict of its fields, encoded by this rule
pydantic model                ``model_dump(mode="json")`` (any object with that method)
``tuple``, ``set``,           a list (a set sorted when its items allow it)
``frozenset``
mapping                       a dict, keys as strings
============================  =====================================================

``str``, ``int``, ``float`` (finite: JSON has no NaN), ``bool`` and ``None`` stay as they are. Anything else is not
encodable: arguments raise ``TypeError`` before anything is claimed; a result raises
:class:`~ledger_client.ResultNotEncodable` after the call is recorded ``unknown`` (see there).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import enum
import math
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any


class NotEncodable(TypeError):
    """A value outside the rule; ``path`` says where it is (``$.items[2].price``)."""

    def __init__(self, value: Any, path: str) -> None:
        super().__init__(f"{path}: {type(value).__module__}.{type(value).__qualname__} is not encodable as JSON"
                         f" ({_short_repr(value)})")
        self.value = value
        self.path = path


def _short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def encode(value: Any, path: str = "$") -> Any:
    """``value`` under the module's rule, as plain JSON values; :class:`NotEncodable` otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        raise NotEncodable(value, path)  # JSON has no NaN or infinity
    if value is None or isinstance(value, (str, bool, int, float)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum):
        return encode(value.value, path)
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): encode(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        try:
            return sorted(items)
        except TypeError:  # mixed types: their order is the set's
            return items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name), f"{path}.{f.name}") for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return encode(dump(mode="json"), path)
    raise NotEncodable(value, path)
