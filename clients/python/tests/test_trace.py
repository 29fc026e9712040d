"""The W3C trace context of a begin against the real server, sync and
asyncio: an explicit ``traceparent``, the current OpenTelemetry span's (an
SDK tracer's), neither, and a malformed one; each read back from the server
(never from the request sent). OpenTelemetry is not optional here:
requirements-dev.txt installs the API and the SDK, and their absence fails
the module rather than skipping it. Without them, in a subprocess, begins
send only explicit ones."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from typing import Any, Dict, List, Optional

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, use_span

from conftest import TOKEN, Counting
from inflight_ledger import AsyncLedger, InvalidRequestError, Ledger, Lifecycle

#: An SDK tracer of its own (the global provider is left alone): its spans are valid and sampled.
tracer = TracerProvider().get_tracer("inflight-ledger-tests")


def a_traceparent(flags: str = "01") -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"


def of_span(span: Any) -> str:
    """The traceparent of an OpenTelemetry span, formatted here from its ids."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def recorded(ledger: Ledger, activity_id: str) -> Optional[str]:
    """The record's traceparent as the server reads it back (``None``: none)."""
    return ledger.get_activity(activity_id).get("traceparent")


def every_way(ledger: Ledger, service: str, traceparent: Optional[str] = None) -> Dict[str, str]:
    """Begins a record each way the sync client has, each with
    ``traceparent`` (left out when ``None``); their ids by the way."""
    given: Dict[str, Any] = {} if traceparent is None else {"traceparent": traceparent}
    spec = {"service": service, "provider": "p"}
    begun = ledger.begin(spec, **given)
    started_now = ledger.begin(spec, start_now=True, wait=1.0, **given)
    with ledger.activity(spec, **given) as in_block:
        pass
    with ledger.observe_unqueued(spec, **given) as observed:
        pass
    tracked: List[str] = []

    @ledger.tracked(spec, lifecycle=Lifecycle(on_enqueued=lambda r: tracked.append(r["activityId"])), **given)
    def decorated() -> str:
        return "done"

    assert decorated() == "done"
    begun.cancel()
    started_now.succeed()
    return {
        "begin": begun.id,
        "start_now": started_now.id,
        "activity": in_block.id,
        "observe_unqueued": observed.id,
        "tracked": tracked[0],
    }


async def aevery_way(ledger: AsyncLedger, service: str, traceparent: Optional[str] = None) -> Dict[str, str]:
    """``every_way`` for the asyncio client."""
    given: Dict[str, Any] = {} if traceparent is None else {"traceparent": traceparent}
    spec = {"service": service, "provider": "p"}
    begun = await ledger.begin(spec, **given)
    started_now = await ledger.begin(spec, start_now=True, wait=1.0, **given)
    async with ledger.activity(spec, **given) as in_block:
        pass
    async with ledger.observe_unqueued(spec, **given) as observed:
        pass
    tracked: List[str] = []

    @ledger.tracked(spec, lifecycle=Lifecycle(on_enqueued=lambda r: tracked.append(r["activityId"])), **given)
    async def decorated() -> str:
        return "done"

    assert await decorated() == "done"
    await begun.cancel()
    await started_now.succeed()
    return {
        "begin": begun.id,
        "start_now": started_now.id,
        "activity": in_block.id,
        "observe_unqueued": observed.id,
        "tracked": tracked[0],
    }


WAYS = ("begin", "start_now", "activity", "observe_unqueued", "tracked")


# ---- explicit --------------------------------------------------------------


def test_an_explicit_traceparent_is_on_the_answer_and_on_the_record_read_back(ledger):
    sent = a_traceparent()
    call = ledger.begin(service="trace", provider="p", traceparent=sent)
    assert call.record["traceparent"] == sent, "the begin's answer"
    assert recorded(ledger, call.id) == sent, "GET /v1/activities/{id}"
    call.cancel()


def test_every_way_of_beginning_sends_an_explicit_traceparent(ledger):
    sent = a_traceparent("00")
    ids = every_way(ledger, "trace-every", sent)
    assert {way: recorded(ledger, i) for way, i in ids.items()} == {way: sent for way in WAYS}


def test_an_explicit_traceparent_wins_over_the_current_span(ledger):
    sent = a_traceparent()
    with tracer.start_as_current_span("caller"):
        call = ledger.begin(service="trace", provider="p", traceparent=sent)
    assert recorded(ledger, call.id) == sent
    call.cancel()


def test_a_malformed_traceparent_is_refused_naming_it_and_nothing_is_recorded(ledger):
    upper = f"00-{secrets.token_hex(16).upper()}-{secrets.token_hex(8)}-01"
    for bad in ("bogus", upper, ""):
        with pytest.raises(InvalidRequestError) as caught:
            ledger.begin(service="trace-bad", provider="p", traceparent=bad)
        assert caught.value.code == "invalid_request"
        assert "traceparent: " in str(caught.value), str(caught.value)
    ran = False
    with pytest.raises(InvalidRequestError, match="traceparent: "):
        with ledger.activity(service="trace-bad", provider="p", traceparent="00-nope"):
            ran = True
    assert not ran, "the block ran"
    snapshot = ledger.snapshot(limit=1000)
    assert [r for r in snapshot["inFlight"] + snapshot["recentCompletions"] if r["service"] == "trace-bad"] == []


def test_a_traceparent_that_is_not_a_string_is_a_type_error_and_nothing_is_sent(server):
    transport = Counting()
    with Ledger(server.url, token=TOKEN, transport=transport) as ledger:
        with pytest.raises(TypeError, match="begin: traceparent must be a string, not int"):
            ledger.begin(service="trace", provider="p", traceparent=42)  # type: ignore[arg-type]
    assert transport.sent == []


def test_a_begin_sent_again_carries_the_same_traceparent():
    """After a 5xx the begin is sent again with its key and its traceparent,
    though the span current by then may be another."""
    seen: List[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "busy"}})
        record = {"activityId": "a1", "service": "s", "provider": "p", "state": "waiting",
                  "traceparent": request.headers.get("traceparent")}
        return httpx.Response(201, json=record)

    with Ledger("http://inflight.test", transport=httpx.MockTransport(answer), backoff=0.001) as ledger:
        with tracer.start_as_current_span("caller") as span:
            ledger.begin(service="s", provider="p")
    assert len(seen) == 2
    assert [r.headers.get("traceparent") for r in seen] == [of_span(span)] * 2
    assert seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]


# ---- the current OpenTelemetry span ---------------------------------------


def test_the_current_span_is_the_traceparent_of_a_begin_given_none(ledger):
    with tracer.start_as_current_span("caller") as span:
        call = ledger.begin(service="trace-otel", provider="p")
    ctx = span.get_span_context()
    # The flags as the span has them, as OpenTelemetry's own propagator sends
    # them: sampled, and (SDKs that follow Trace Context level 2) a random trace id.
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert ctx.trace_flags.sampled
    assert call.record["traceparent"] == expected
    assert recorded(ledger, call.id) == expected
    call.cancel()
    # A span not sampled: its flags are sent as they are.
    unsampled = SpanContext(int(secrets.token_hex(16), 16), int(secrets.token_hex(8), 16), False, TraceFlags(0))
    with use_span(NonRecordingSpan(unsampled)):
        other = ledger.begin(service="trace-otel", provider="p")
    assert recorded(ledger, other.id) == f"00-{unsampled.trace_id:032x}-{unsampled.span_id:016x}-00"
    other.cancel()


def test_every_way_of_beginning_sends_the_current_span(ledger):
    with tracer.start_as_current_span("caller") as span:
        ids = every_way(ledger, "trace-otel-every")
    assert {way: recorded(ledger, i) for way, i in ids.items()} == {way: of_span(span) for way in WAYS}


def test_a_nested_span_is_the_parent_and_the_outer_one_after_it(ledger):
    with tracer.start_as_current_span("outer") as outer:
        with tracer.start_as_current_span("inner") as inner:
            a = ledger.begin(service="trace-otel", provider="p")
        b = ledger.begin(service="trace-otel", provider="p")
    assert recorded(ledger, a.id) == of_span(inner)
    assert recorded(ledger, b.id) == of_span(outer)
    assert of_span(inner).split("-")[1] == of_span(outer).split("-")[1], "one trace"
    a.cancel()
    b.cancel()


# ---- none ------------------------------------------------------------------


def test_outside_any_span_no_way_of_beginning_sends_one(ledger):
    ids = every_way(ledger, "trace-none")
    assert {way: recorded(ledger, i) for way, i in ids.items()} == {way: None for way in WAYS}
    assert "traceparent" not in ledger.get_activity(ids["begin"]), "left out of the JSON"


def test_propagate_trace_false_sends_none_inside_a_span_but_still_an_explicit_one(server):
    with Ledger(server.url, token=TOKEN, propagate_trace=False) as quiet:
        assert quiet.propagate_trace is False
        with tracer.start_as_current_span("caller"):
            ids = every_way(quiet, "trace-off")
            sent = a_traceparent()
            explicit = quiet.begin(service="trace-off", provider="p", traceparent=sent)
        assert {way: recorded(quiet, i) for way, i in ids.items()} == {way: None for way in WAYS}
        assert recorded(quiet, explicit.id) == sent
        explicit.cancel()


# ---- asyncio ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_an_explicit_traceparent_on_every_way_of_beginning(server):
    sent = a_traceparent()
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        ids = await aevery_way(ledger, "atrace-every", sent)
        assert {way: (await ledger.get_activity(i)).get("traceparent") for way, i in ids.items()} == {
            way: sent for way in WAYS}
        with pytest.raises(InvalidRequestError, match="traceparent: "):
            await ledger.begin(service="atrace-bad", provider="p", traceparent="bogus")


@pytest.mark.asyncio
async def test_async_the_current_span_across_awaits_and_into_the_blocks_task(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with tracer.start_as_current_span("caller") as span:
            await ledger.healthy()  # an await inside the span before the begins
            ids = await aevery_way(ledger, "atrace-otel")
        assert {way: (await ledger.get_activity(i)).get("traceparent") for way, i in ids.items()} == {
            way: of_span(span) for way in WAYS}
        none = await aevery_way(ledger, "atrace-none")
        assert {way: (await ledger.get_activity(i)).get("traceparent") for way, i in none.items()} == {
            way: None for way in WAYS}


@pytest.mark.asyncio
async def test_async_propagate_trace_false(server):
    async with AsyncLedger(server.url, token=TOKEN, propagate_trace=False) as ledger:
        with tracer.start_as_current_span("caller"):
            call = await ledger.begin(service="atrace-off", provider="p")
        assert "traceparent" not in await ledger.get_activity(call.id)
        await call.cancel()


# ---- without OpenTelemetry -------------------------------------------------

WITHOUT_OTEL = """
import json, sys
sys.modules["opentelemetry"] = None  # as if not installed: importing it raises ImportError
import inflight_ledger
from inflight_ledger import Ledger, _trace
imported_with_the_package = any(m.startswith("opentelemetry.") for m in sys.modules)
with Ledger(sys.argv[1], token=sys.argv[2]) as ledger:
    plain = ledger.begin(service="trace-without", provider="p")
    given = ledger.begin(service="trace-without", provider="p", traceparent=sys.argv[3])
    print(json.dumps({
        "plain": ledger.get_activity(plain.id).get("traceparent"),
        "given": ledger.get_activity(given.id).get("traceparent"),
        "looked_for": _trace._otel_trace is None,
        "imported_with_the_package": imported_with_the_package,
    }))
"""

LAZY = """
import sys
import inflight_ledger, inflight_ledger.aio, inflight_ledger.sync
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
"""


def test_without_opentelemetry_begins_send_only_explicit_ones(server):
    sent = a_traceparent()
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL, server.url, TOKEN, sent],
        check=True, capture_output=True, text=True, env={**os.environ, "INFLIGHT_TOKEN": ""},
    )
    assert json.loads(out.stdout) == {
        "plain": None, "given": sent, "looked_for": True, "imported_with_the_package": False}


def test_importing_the_package_does_not_import_opentelemetry():
    out = subprocess.run([sys.executable, "-c", LAZY], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
