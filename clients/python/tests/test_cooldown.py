"""Cooldowns against the real server, sync and asyncio: a failure settled
with the provider's ``Retry-After`` makes its lane (capped at 1) refuse new
slots with ``lane_cooling`` until it has passed; a wait in line goes on
through it, within its own ``max_wait``; a block that raises with a
provider's 429 answer cools the lane by itself. Every lane here is its own
(a cooldown outlives the test that started it)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import httpx
import pytest

from conftest import EMPTY, TOKEN, lane_counts
from inflight_ledger import (
    AsyncLedger,
    InvalidRequestError,
    LaneCoolingError,
    LaneFullError,
    Ledger,
    Lifecycle,
    WaitTimeoutError,
)


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def at(timestamp):
    """An RFC 3339 timestamp of the server's as epoch milliseconds."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1000


def lane_of(snapshot, lane):
    lanes = snapshot["nativeAdmission"]
    assert lane in lanes, f"the snapshot shows no lane {lane}: it has {sorted(lanes)}"
    return lanes[lane]


class Counting(httpx.HTTPTransport):
    """The real transport, keeping the (monotonic time, path, wait) of each start sent."""

    def __init__(self):
        super().__init__()
        self.starts = []

    def handle_request(self, request):
        if request.url.path.endswith("/start"):
            self.starts.append((time.monotonic(), request.url.params.get("wait")))
        return super().handle_request(request)


class ACounting(httpx.AsyncHTTPTransport):
    def __init__(self):
        super().__init__()
        self.starts = []

    async def handle_async_request(self, request):
        if request.url.path.endswith("/start"):
            self.starts.append((time.monotonic(), request.url.params.get("wait")))
        return await super().handle_async_request(request)


class APIStatusError(Exception):
    """The shape of the ``openai`` package's ``APIStatusError`` (its
    ``RateLimitError`` on a 429): ``.response`` (an ``httpx.Response``), ``.status_code``."""

    def __init__(self, message, *, response):
        super().__init__(message)
        self.response = response
        self.status_code = response.status_code


def provider_429(retry_after):
    request = httpx.Request("POST", "https://api.provider.example/v1/chat/completions")
    return httpx.Response(429, headers={"retry-after": retry_after}, request=request, json={"error": "rate limited"})


def raise_httpx_429():
    provider_429("1").raise_for_status()


def raise_openai_429():
    raise APIStatusError("Error code: 429", response=provider_429("1"))


def cool(ledger, service, retry_after_ms=2000):
    """Holds the lane's one slot, then settles it failed with the provider's
    ``retry_after_ms``; the settled record."""
    call = ledger.begin(service=service, provider="capped", start_now=True)
    return call.fail(retry_after_ms=retry_after_ms)


# ---- sync ---------------------------------------------------------------


def test_a_failure_settled_with_retry_after_cools_the_lane_until_then(ledger):
    lane = "cool::capped"
    settled = cool(ledger, "cool")
    assert settled["state"] == "failed"
    shown = lane_of(ledger.snapshot(), lane)
    assert shown["coolingUntil"] is not None
    assert abs(at(shown["coolingUntil"]) - at(settled["completedAt"]) - 2000) <= 5
    assert shown["cooldowns"] == 1
    assert shown["effectiveCap"] == 1
    assert shown["byPriority"]["unknown"] == {"executing": 0, "waiting": 0}

    with pytest.raises(LaneCoolingError) as info:
        ledger.begin(service="cool", provider="capped", start_now=True)
    err = info.value
    assert (err.code, err.status) == ("lane_cooling", 429)
    assert isinstance(err, LaneFullError)
    assert err.retry_after is not None and 0 < err.retry_after <= 2
    assert lane_counts(ledger.snapshot(limit=1000), lane) == EMPTY, "a refused start_now holds nothing"

    call = ledger.begin(service="cool", provider="capped", start_now=True, wait=5)
    assert call.record["state"] == "executing"
    assert at(call.record["startedAt"]) >= at(settled["completedAt"]) + 2000, "admitted after the cooldown, not before"
    assert at(call.record["startedAt"]) < at(settled["completedAt"]) + 4000
    call.succeed()
    assert lane_counts(ledger.snapshot(limit=1000), lane) == EMPTY


def test_a_block_waits_through_the_cooldown_and_asks_again_only_after_its_retry_after(server):
    transport = Counting()
    with Ledger(server.url, token=TOKEN, transport=transport) as ledger:
        settled = cool(ledger, "cool-step")
        # Half-second waits: the first ends inside the cooldown (lane_cooling,
        # Retry-After 2); the next start is sent only then, and admitted.
        with ledger.activity(service="cool-step", provider="capped", max_wait=5, wait_step=0.5) as call:
            assert call.record["state"] == "executing"
        assert at(call.record["startedAt"]) >= at(settled["completedAt"]) + 2000
        assert len(transport.starts) == 2, transport.starts
        (first, _), (second, _) = transport.starts
        assert second - first >= 1.4, "not asked again before its Retry-After"
        assert ledger.get_activity(call.id)["state"] == "succeeded"


def test_a_block_gives_up_at_its_max_wait_not_at_the_end_of_the_cooldown(ledger):
    cool(ledger, "cool-max", retry_after_ms=3000)
    seen = []
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError):
        with ledger.activity(service="cool-max", provider="capped", max_wait=0.5, wait_step=0.2,
                             lifecycle=Lifecycle(on_enqueued=seen.append)):
            pytest.fail("admitted during the cooldown")
    assert 0.45 <= time.monotonic() - started < 2.5
    record = ledger.get_activity(seen[0]["activityId"])
    assert (record["state"], record["cancelReason"]) == ("cancelled", "wait timeout")
    assert lane_counts(ledger.snapshot(limit=1000), "cool-max::capped") == EMPTY


@pytest.mark.parametrize("service, raise_it", [("cool-raise", raise_httpx_429), ("cool-openai", raise_openai_429)],
                         ids=["httpx.HTTPStatusError", "openai-shaped APIStatusError"])
def test_a_block_that_raises_with_a_providers_429_cools_the_lane(ledger, service, raise_it):
    with pytest.raises(Exception) as info:
        with ledger.activity(service=service, provider="capped") as call:
            raise_it()
    assert info.value.response.status_code == 429, "the block's own exception propagates"
    record = ledger.get_activity(call.id)
    assert (record["state"], record["failureStage"]) == ("failed", "provider")
    shown = lane_of(ledger.snapshot(), f"{service}::capped")
    assert shown["coolingUntil"] is not None, "settled with retryAfterMs: the lane cools down"
    assert abs(at(shown["coolingUntil"]) - at(record["completedAt"]) - 1000) <= 5
    assert shown["cooldowns"] == 1
    with pytest.raises(LaneCoolingError):
        ledger.begin(service=service, provider="capped", start_now=True)


def test_the_server_refuses_retry_after_ms_with_a_success_or_out_of_range(ledger):
    for settle in (
        lambda call: call.settle(True, retry_after_ms=1000),
        lambda call: call.fail(retry_after_ms=0),
        lambda call: call.fail(retry_after_ms=3_600_001),
    ):
        call = ledger.begin(service="cool-refused", provider="capped", start_now=True)
        with pytest.raises(InvalidRequestError, match="retryAfterMs"):
            settle(call)
        call.cancel()
    assert lane_of(ledger.snapshot(), "cool-refused::capped")["coolingUntil"] is None


# ---- asyncio ------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_a_failure_settled_with_retry_after_cools_the_lane_until_then(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        first = await ledger.begin(service="acool", provider="capped", start_now=True)
        settled = await first.fail(retry_after_ms=2000)
        assert lane_of(await ledger.snapshot(), "acool::capped")["coolingUntil"] is not None
        with pytest.raises(LaneCoolingError) as info:
            await ledger.begin(service="acool", provider="capped", start_now=True)
        assert info.value.retry_after is not None and 0 < info.value.retry_after <= 2
        call = await ledger.begin(service="acool", provider="capped", start_now=True, wait=5)
        assert at(call.record["startedAt"]) >= at(settled["completedAt"]) + 2000
        await call.succeed()
        assert lane_counts(await ledger.snapshot(limit=1000), "acool::capped") == EMPTY


@pytest.mark.asyncio
async def test_async_a_block_waits_through_the_cooldown_and_asks_again_only_after_its_retry_after(server):
    transport = ACounting()
    async with AsyncLedger(server.url, token=TOKEN, transport=transport) as ledger:
        first = await ledger.begin(service="acool-step", provider="capped", start_now=True)
        settled = await first.fail(retry_after_ms=2000)
        async with ledger.activity(service="acool-step", provider="capped", max_wait=5, wait_step=0.5) as call:
            assert call.record["state"] == "executing"
        assert at(call.record["startedAt"]) >= at(settled["completedAt"]) + 2000
        assert len(transport.starts) == 2, transport.starts
        (first_sent, _), (second_sent, _) = transport.starts
        assert second_sent - first_sent >= 1.4
        # Within max_wait: the same cooldown again, and a block that may wait half a second.
        await (await ledger.begin(service="acool-step", provider="capped", start_now=True)).fail(retry_after_ms=3000)
        started = time.monotonic()
        with pytest.raises(WaitTimeoutError):
            async with ledger.activity(service="acool-step", provider="capped", max_wait=0.5, wait_step=0.2):
                pytest.fail("admitted during the cooldown")
        assert time.monotonic() - started < 2.5


@pytest.mark.asyncio
@pytest.mark.parametrize("service, raise_it", [("acool-raise", raise_httpx_429), ("acool-openai", raise_openai_429)],
                         ids=["httpx.HTTPStatusError", "openai-shaped APIStatusError"])
async def test_async_a_block_that_raises_with_a_providers_429_cools_the_lane(server, service, raise_it):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with pytest.raises(Exception) as info:
            async with ledger.activity(service=service, provider="capped") as call:
                await asyncio.sleep(0)
                raise_it()
        assert info.value.response.status_code == 429
        record = await ledger.get_activity(call.id)
        assert record["state"] == "failed"
        shown = lane_of(await ledger.snapshot(), f"{service}::capped")
        assert shown["coolingUntil"] is not None
        assert abs(at(shown["coolingUntil"]) - at(record["completedAt"]) - 1000) <= 5
        with pytest.raises(LaneCoolingError):
            await ledger.begin(service=service, provider="capped", start_now=True)
