"""The W3C trace context a begin carries (the ``traceparent`` header): the
one the caller gives, else the current OpenTelemetry span's, when the
``opentelemetry-api`` package is installed (the ``otel`` extra).

OpenTelemetry is imported on the first begin that looks for a span, once
(whether it is there or not), never by ``import inflight_ledger``. The
header is formatted here from the current span's context rather than by
``opentelemetry.propagate.inject``: the server reads a W3C ``traceparent``
and nothing else, while ``inject`` writes whatever propagators the
application configured (``OTEL_PROPAGATORS`` may name B3 alone, or none).
OpenTelemetry keeps its context in ``contextvars``, so the span is the one
current where the begin runs: across ``await``s, and in an asyncio task,
the one current where the task was created."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

#: ``opentelemetry.trace`` once looked for: the module, or ``None`` when it is not installed.
_NOT_LOOKED_FOR: Any = object()
_otel_trace: Any = _NOT_LOOKED_FOR

#: A version-00 ``traceparent`` as the server takes it (lower-case hex, ids not all zero).
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def _trace_module() -> Any:
    global _otel_trace
    if _otel_trace is _NOT_LOOKED_FOR:
        try:
            import opentelemetry.trace as trace
        except ImportError:
            _otel_trace = None
        else:
            _otel_trace = trace
    return _otel_trace


def current_traceparent() -> Optional[str]:
    """The current OpenTelemetry span's context as a ``traceparent`` (version
    ``00``); ``None`` when OpenTelemetry is not installed or no valid span is
    current (the API's default span is not valid)."""
    trace = _trace_module()
    if trace is None:
        return None
    try:
        span_context = trace.get_current_span().get_span_context()
        if not span_context.is_valid:
            return None
        flags = int(span_context.trace_flags) & 0xFF
        return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"
    except Exception:  # noqa: BLE001 - a broken tracer is not the ledger's concern: no trace context
        return None


def traceparent_for(explicit: Optional[str], propagate: bool, where: str) -> Optional[str]:
    """The ``traceparent`` a begin sends: ``explicit`` when given (any string:
    the server names a malformed one), else with ``propagate`` the current
    span's, else none. A non-string ``explicit`` raises ``TypeError`` naming
    ``where``."""
    if explicit is not None:
        if not isinstance(explicit, str):
            raise TypeError(f"{where}: traceparent must be a string, not {type(explicit).__name__}")
        return explicit
    return current_traceparent() if propagate else None


def valid_traceparent(value: object) -> Optional[str]:
    """``value`` when it is a version-00 ``traceparent`` the server takes,
    else ``None``: for one a caller received from elsewhere (an incoming
    request's header), which W3C says to ignore when malformed."""
    if isinstance(value, str) and _TRACEPARENT.fullmatch(value.strip()):
        return value.strip()
    return None


def header_in(headers: Any, name: str) -> Optional[str]:
    """The header ``name`` in a mapping of headers, by any case; ``None`` when absent."""
    if not isinstance(headers, Mapping):
        return None
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == name and isinstance(value, str):
            return value
    return None
