"""A provider's ``Retry-After`` and the lane's cooldown, without a server:
``retry_after_ms(response)``; which exceptions leaving a block carry one
(and so settle the failure with ``retryAfterMs``); and the waits in line
against a scripted transport: ``lane_cooling`` is waited through like
``lane_full``, the next request not before its ``Retry-After``, never past
``max_wait``. ``test_cooldown.py`` runs the same against the real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from types import SimpleNamespace

import httpx
import pytest

from inflight_ledger import (
    AsyncLedger,
    LaneCoolingError,
    LaneFullError,
    Ledger,
    WaitCancelledError,
    WaitTimeoutError,
    error_for,
    retry_after_ms,
)
from inflight_ledger._common import retry_after_of

ID = "01939b1c-0000-7000-8000-0000000000c1"


# ---- retry_after_ms(response) -------------------------------------------


def answer_with(status, value=None, name="Retry-After"):
    return httpx.Response(status, headers={} if value is None else {name: value})


def http_date(seconds_from_now, form="imf"):
    when = datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)
    if form == "imf":  # Sun, 06 Nov 1994 08:49:37 GMT
        return format_datetime(when, usegmt=True)
    if form == "rfc850":  # Sunday, 06-Nov-94 08:49:37 GMT
        return when.strftime("%A, %d-%b-%y %H:%M:%S GMT")
    return when.strftime("%a %b %d %H:%M:%S %Y")  # asctime: Sun Nov  6 08:49:37 1994


@pytest.mark.parametrize("value, ms", [("2", 2000), (" 7 ", 7000), ("1.5", 1500), ("60", 60000)])
def test_delta_seconds_are_milliseconds(value, ms):
    assert retry_after_ms(answer_with(429, value)) == ms


@pytest.mark.parametrize("form", ["imf", "rfc850", "asctime"])
def test_an_http_date_is_the_milliseconds_until_then(form):
    ms = retry_after_ms(answer_with(429, http_date(120, form)))
    # The date has whole seconds: 119 to 120 s from now, less the time this takes.
    assert ms is not None and 117_000 <= ms <= 120_000, ms


@pytest.mark.parametrize("response", [
    answer_with(429),
    answer_with(503),
    answer_with(429, "3", name="Retry-After-Ms"),
    SimpleNamespace(status_code=429, headers={}),
    SimpleNamespace(status_code=429, headers=None),
    SimpleNamespace(status_code=429),
    SimpleNamespace(headers={"retry-after": "3"}),
    None,
], ids=["429", "503", "other-header", "plain-empty", "headers-none", "no-headers", "no-status", "none"])
def test_no_header_is_none(response):
    assert retry_after_ms(response) is None


@pytest.mark.parametrize("value", ["soon", "", "-1", "1e3", "0x10", "12:00", "NaN", "2 s", "Someday, 99 Foo 2026"])
def test_garbage_is_none(value):
    assert retry_after_ms(answer_with(429, value)) is None


@pytest.mark.parametrize("value, ms", [
    ("0", 1),
    ("0.0001", 1),
    ("3600", 3_600_000),
    ("3601", 3_600_000),
    ("99999999999999999999", 3_600_000),
    (http_date(-3600), 1),  # a date already past
    (http_date(2 * 3600), 3_600_000),
])
def test_clamped_to_1_through_3600000(value, ms):
    assert retry_after_ms(answer_with(429, value)) == ms


@pytest.mark.parametrize("status", [200, 201, 400, 404, 408, 418, 500, 502, 504])
def test_a_status_other_than_429_or_503_is_none(status):
    assert retry_after_ms(answer_with(status, "2")) is None


def test_503_counts_and_any_object_with_status_code_and_headers_does():
    assert retry_after_ms(answer_with(503, "4")) == 4000
    # A plain dict is read without regard to case, as HTTP reads names.
    assert retry_after_ms(SimpleNamespace(status_code=429, headers={"RETRY-AFTER": "3"})) == 3000
    assert retry_after_ms(SimpleNamespace(status_code=503, headers={"retry-after": b"5"})) == 5000
    assert retry_after_ms(SimpleNamespace(status_code="429", headers={"retry-after": "3"})) is None


# ---- which exceptions carry one -----------------------------------------


class APIStatusError(Exception):
    """The shape of the ``openai`` package's ``APIStatusError`` (and its
    ``RateLimitError``): ``.response`` (an ``httpx.Response``), ``.status_code``."""

    def __init__(self, message, *, response):
        super().__init__(message)
        self.response = response
        self.status_code = response.status_code


class ProviderDown(Exception):
    """An application's own exception, raised ``from`` the provider's."""


def provider_answer(status, value):
    request = httpx.Request("POST", "https://api.provider.example/v1/chat/completions")
    return httpx.Response(status, headers={} if value is None else {"retry-after": value}, request=request)


def httpx_error(status=429, value="1"):
    response = provider_answer(status, value)
    return httpx.HTTPStatusError(f"HTTP {status}", request=response.request, response=response)


def openai_error(status=429, value="2"):
    return APIStatusError(f"Error code: {status}", response=provider_answer(status, value))


def chained(cause):
    try:
        raise ProviderDown("the provider refused") from cause
    except ProviderDown as err:
        return err


def implicitly_chained(inner):
    try:
        try:
            raise inner
        except Exception:
            raise ProviderDown("while handling it")  # __context__, not __cause__
    except ProviderDown as err:
        return err


def with_response(response):
    err = RuntimeError("an exception with some other response")
    err.response = response
    return err


class BrokenResponse(Exception):
    @property
    def response(self):
        raise RuntimeError("no response was kept")


SHAPES = [
    ("httpx.HTTPStatusError 429", lambda: httpx_error(429, "1"), 1000),
    ("openai APIStatusError 429", lambda: openai_error(429, "2"), 2000),
    ("openai APIStatusError 503", lambda: openai_error(503, "3"), 3000),
    ("raised from one", lambda: chained(httpx_error(429, "1")), 1000),
    ("a 500 with Retry-After", lambda: httpx_error(500, "1"), None),
    ("a 429 without Retry-After", lambda: openai_error(429, None), None),
    ("response is None", lambda: with_response(None), None),
    ("response not httpx-like", lambda: with_response("429"), None),
    ("a property that raises", lambda: BrokenResponse("x"), None),
    ("only its __context__ has one", lambda: implicitly_chained(httpx_error(429, "1")), None),
    ("a plain exception", lambda: ValueError("provider said 500"), None),
]


@pytest.mark.parametrize("make, ms", [(m, ms) for _, m, ms in SHAPES], ids=[name for name, _, _ in SHAPES])
def test_the_shapes_an_exception_carries_a_retry_after_in(make, ms):
    assert retry_after_of(make()) == ms


def test_a_cause_cycle_ends():
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    found = []
    reader = threading.Thread(target=lambda: found.append(retry_after_of(a)), daemon=True)
    reader.start()
    reader.join(5)
    assert found == [None], "the walk down the causes never ended"


# ---- the requests, scripted ---------------------------------------------


def record(**fields):
    base = {
        "activityId": ID, "service": "kb", "provider": "openai", "class": "chat",
        "operationStage": "unknown", "model": "unknown", "priority": "unknown", "admission": "queued",
        "state": "waiting", "disposition": None, "reapReason": None, "ownerId": None,
        "enqueuedAt": "2026-01-01T00:00:00.000Z", "startedAt": None, "completedAt": None,
        "reapedAt": None, "deadlineMs": 300000, "reapableAt": "2026-01-01T00:20:00.000Z",
        "queueWaitMs": None, "executionMs": None, "success": None, "failureStage": None,
        "lateSettle": False, "refined": False,
    }
    base.update(fields)
    return base


def refusal(code, retry_after=None):
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return lambda: httpx.Response(429, json={"error": {"code": code, "message": f"said {code}"}}, headers=headers)


def admitted():
    return httpx.Response(200, json=record(state="executing", startedAt="2026-01-01T00:00:01.000Z"))


class Lane:
    """A scripted server: a begin answers a waiting record; each start the
    next answer of ``starts``; a settle or a cancel the record ended. Keeps
    ``(monotonic time, route, wait, body)`` of each request."""

    def __init__(self, *starts):
        self.starts = list(starts)
        self.seen = []
        self.lock = threading.Lock()  # a cancel watch thread sends too

    def __call__(self, request):
        body = json.loads(request.content) if request.content else None
        route = request.url.path.replace(ID, "{id}")
        with self.lock:
            self.seen.append((time.monotonic(), route, request.url.params.get("wait"), body))
        if route == "/v1/activities":
            return httpx.Response(201, json=record())
        if route == "/v1/activities/{id}/start":
            assert self.starts, "unscripted start"
            return self.starts.pop(0)()
        if route == "/v1/activities/{id}/settle":
            return httpx.Response(200, json=record(state="succeeded" if body["success"] else "failed"))
        if route == "/v1/activities/{id}/cancel":
            return httpx.Response(200, json=record(state="cancelled", cancelReason=body.get("reason")))
        raise AssertionError(f"unscripted {request.method} {route}")

    def requests(self, route):
        return [r for r in self.seen if r[1] == f"/v1/activities/{{id}}/{route}"]


def ledger_on(lane):
    return Ledger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(lane))


def async_ledger_on(lane):
    return AsyncLedger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(lane))


def test_lane_cooling_is_typed_a_lane_full_with_its_retry_after():
    err = error_for("lane_cooling", "cooling", status=429, retry_after=2.0, from_server=True)
    assert type(err) is LaneCoolingError and isinstance(err, LaneFullError)
    with Ledger("http://127.0.0.1:9", transport=httpx.MockTransport(lambda r: refusal("lane_cooling", "2")())) as l:
        with pytest.raises(LaneCoolingError) as info:
            l.begin(service="kb", provider="openai", start_now=True)
    assert (info.value.code, info.value.status, info.value.retry_after) == ("lane_cooling", 429, 2.0)


def test_after_lane_cooling_the_next_start_waits_for_its_retry_after():
    lane = Lane(refusal("lane_cooling", "1"), admitted)
    with ledger_on(lane) as ledger:
        with ledger.activity(service="kb", provider="openai", max_wait=5) as call:
            assert call.record["state"] == "executing"
    (first, _, _, _), (second, _, _, _) = lane.requests("start")
    assert 0.95 <= second - first < 3.0, second - first


@pytest.mark.parametrize("refused", [refusal("lane_full", "1"), refusal("lane_cooling")],
                         ids=["lane_full", "lane_cooling without Retry-After"])
def test_otherwise_the_next_start_is_sent_at_once(refused):
    lane = Lane(refused, admitted)
    with ledger_on(lane) as ledger:
        ledger.begin(service="kb", provider="openai").admit(max_wait=5)
    (first, _, _, _), (second, _, _, _) = lane.requests("start")
    assert second - first < 0.5, second - first


def test_the_wait_for_retry_after_never_goes_past_max_wait():
    lane = Lane(refusal("lane_cooling", "5"), refusal("lane_cooling", "5"))
    started = time.monotonic()
    with ledger_on(lane) as ledger:
        with pytest.raises(WaitTimeoutError):
            with ledger.activity(service="kb", provider="openai", max_wait=0.4):
                pytest.fail("never admitted")
    assert 0.35 <= time.monotonic() - started < 3
    starts = lane.requests("start")
    assert [wait for _, _, wait, _ in starts][1:] == ["0ms"], "one last ask at max_wait, holding nothing"
    assert [body for _, _, _, body in lane.requests("cancel")] == [{"reason": "wait timeout"}]


def test_a_cancel_event_ends_the_wait_for_retry_after_at_once():
    lane = Lane(refusal("lane_cooling", "5"))
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with ledger_on(lane) as ledger:
        with pytest.raises(WaitCancelledError):
            with ledger.activity(service="kb", provider="openai", cancel=stop):
                pytest.fail("never admitted")
    assert time.monotonic() - started < 3
    assert len(lane.requests("start")) == 1
    assert lane.requests("cancel"), "the record was cancelled"


@pytest.mark.parametrize("make, ms", [(m, ms) for _, m, ms in SHAPES], ids=[name for name, _, _ in SHAPES])
def test_a_block_that_raises_settles_the_failure_with_what_the_exception_carries(make, ms):
    lane = Lane(admitted)
    error = make()
    with ledger_on(lane) as ledger:
        with pytest.raises(type(error)):
            with ledger.activity(service="kb", provider="openai"):
                raise error
    (_, _, _, body), = lane.requests("settle")
    expected = {"success": False, "failureStage": "provider"}
    if ms is not None:
        expected["retryAfterMs"] = ms
    assert body == expected


def test_settle_and_fail_send_retry_after_ms_only_when_given():
    lane = Lane(admitted, admitted, admitted)
    with ledger_on(lane) as ledger:
        ledger.begin(service="kb", provider="openai").fail(retry_after_ms=1500)
        ledger.begin(service="kb", provider="openai").settle(False, failure_stage="queue", retry_after_ms=7)
        ledger.begin(service="kb", provider="openai").fail("queue")
        ledger.begin(service="kb", provider="openai").succeed()
    assert [body for _, _, _, body in lane.requests("settle")] == [
        {"success": False, "failureStage": "provider", "retryAfterMs": 1500},
        {"success": False, "failureStage": "queue", "retryAfterMs": 7},
        {"success": False, "failureStage": "queue"},
        {"success": True},
    ]


def test_a_block_whose_cancel_event_is_set_cancels_even_with_a_retry_after():
    lane = Lane(admitted)
    stop = threading.Event()
    with ledger_on(lane) as ledger:
        with pytest.raises(httpx.HTTPStatusError):
            with ledger.activity(service="kb", provider="openai", cancel=stop):
                stop.set()
                raise httpx_error(429, "1")
    assert lane.requests("settle") == []
    assert [body for _, _, _, body in lane.requests("cancel")][-1] == {"reason": "cancelled"}


# ---- asyncio, scripted --------------------------------------------------


@pytest.mark.asyncio
async def test_async_after_lane_cooling_the_next_start_waits_for_its_retry_after():
    lane = Lane(refusal("lane_cooling", "1"), admitted)
    async with async_ledger_on(lane) as ledger:
        async with ledger.activity(service="kb", provider="openai", max_wait=5) as call:
            assert call.record["state"] == "executing"
    (first, _, _, _), (second, _, _, _) = lane.requests("start")
    assert 0.95 <= second - first < 3.0, second - first


@pytest.mark.asyncio
@pytest.mark.parametrize("refused", [refusal("lane_full", "1"), refusal("lane_cooling")],
                         ids=["lane_full", "lane_cooling without Retry-After"])
async def test_async_otherwise_the_next_start_is_sent_at_once(refused):
    lane = Lane(refused, admitted)
    async with async_ledger_on(lane) as ledger:
        await (await ledger.begin(service="kb", provider="openai")).admit(max_wait=5)
    (first, _, _, _), (second, _, _, _) = lane.requests("start")
    assert second - first < 0.5, second - first


@pytest.mark.asyncio
async def test_async_the_wait_for_retry_after_never_goes_past_max_wait_nor_a_timeout():
    lane = Lane(refusal("lane_cooling", "5"), refusal("lane_cooling", "5"))
    started = time.monotonic()
    async with async_ledger_on(lane) as ledger:
        with pytest.raises(WaitTimeoutError):
            async with ledger.activity(service="kb", provider="openai", max_wait=0.4):
                pytest.fail("never admitted")
        assert 0.35 <= time.monotonic() - started < 3
        assert [wait for _, _, wait, _ in lane.requests("start")][1:] == ["0ms"]
        assert [body for _, _, _, body in lane.requests("cancel")] == [{"reason": "wait timeout"}]
        # The block's timeout cuts the wait for a Retry-After short too.
        lane.starts = [refusal("lane_cooling", "5")]
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with ledger.activity(service="kb", provider="openai", timeout=0.3):
                pytest.fail("never admitted")
        assert time.monotonic() - started < 3
        assert [body for _, _, _, body in lane.requests("cancel")][-1] == {"reason": "timeout"}


@pytest.mark.asyncio
@pytest.mark.parametrize("make, ms", [(m, ms) for _, m, ms in SHAPES], ids=[name for name, _, _ in SHAPES])
async def test_async_a_block_that_raises_settles_the_failure_with_what_the_exception_carries(make, ms):
    lane = Lane(admitted)
    error = make()
    async with async_ledger_on(lane) as ledger:
        with pytest.raises(type(error)):
            async with ledger.activity(service="kb", provider="openai"):
                await asyncio.sleep(0)
                raise error
    (_, _, _, body), = lane.requests("settle")
    expected = {"success": False, "failureStage": "provider"}
    if ms is not None:
        expected["retryAfterMs"] = ms
    assert body == expected


@pytest.mark.asyncio
async def test_async_settle_and_fail_send_retry_after_ms_only_when_given():
    lane = Lane(admitted, admitted)
    async with async_ledger_on(lane) as ledger:
        await (await ledger.begin(service="kb", provider="openai")).fail(retry_after_ms=1500)
        await (await ledger.begin(service="kb", provider="openai")).settle(False, retry_after_ms=7)
        await (await ledger.begin(service="kb", provider="openai")).fail()
    assert [body for _, _, _, body in lane.requests("settle")] == [
        {"success": False, "failureStage": "provider", "retryAfterMs": 1500},
        {"success": False, "retryAfterMs": 7},
        {"success": False, "failureStage": "provider"},
    ]
