"""Token budgets against the real server, sync and asyncio: a lane's
``tokens_per_minute`` (and a provider's) refuses a start whose
``max_tokens`` does not fit with ``budget_exhausted`` (429, ``Retry-After``)
and the record keeps its place; an estimate larger than the whole budget is
``invalid_request``; a wait in line goes on through a used-up budget,
asking again at once rather than after the ``Retry-After``, until a settle
reporting less than its estimate makes room. A lane's token window outlives
the test that filled it, so each test has lanes of its own, on a server of
this module's (memory store)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from typing import Iterator, List

import pytest

from conftest import ACounting, Counting, Server
from inflight_ledger import (
    AsyncLedger,
    BudgetExhaustedError,
    InflightError,
    InvalidRequestError,
    LaneCoolingError,
    LaneFullError,
    Ledger,
    Lifecycle,
    Usage,
    WaitTimeoutError,
    error_for,
    field_names,
)
from inflight_ledger.wire import Lane

#: Lanes of 1000 tokens a minute, one per test.
BUDGETED = [f"{name}::budgeted" for name in (
    "refuse", "estimate", "now", "admit", "block", "maxwait", "aadmit", "ablock", "arefuse",
)]


@pytest.fixture(scope="module")
def budget_server() -> Iterator[Server]:
    config = "".join(f'[lanes."{lane}"]\ntokens_per_minute = 1000\n' for lane in BUDGETED)
    # A provider's budget, shared by its lanes (none of their own).
    config += "[providers.metered]\ntokens_per_minute = 1000\n"
    with tempfile.TemporaryDirectory(prefix="inflight-py-") as workdir:
        s = Server(workdir, {}, None, config=config)
        try:
            yield s
        finally:
            s.stop()


@pytest.fixture
def ledger(budget_server):
    with Ledger(budget_server.url) as l:
        yield l


def spec(lane, max_tokens=400):
    """A begin's spec on ``lane`` (wire names, as a mapping takes them)."""
    service, provider = lane.split("::")
    return {"service": service, "provider": provider, "maxTokens": max_tokens}


def lane_of(snapshot, lane):
    lanes = snapshot["nativeAdmission"]
    assert lane in lanes, f"the snapshot shows no lane {lane}: it has {sorted(lanes)}"
    return lanes[lane]


def starts(sent: List[str]) -> int:
    return sum(1 for request in sent if request.endswith("/start"))


def fill_to_800(ledger, lane):
    """Two calls of 400 tokens executing on ``lane``: 800 of its 1000 are taken."""
    calls = [ledger.begin(spec(lane), start_now=True) for _ in range(2)]
    assert [c.record["state"] for c in calls] == ["executing", "executing"]
    assert lane_of(ledger.snapshot(), lane)["tokensReserved"] == 800
    return calls


def assert_budget_exhausted(err):
    assert isinstance(err, BudgetExhaustedError), repr(err)
    assert isinstance(err, LaneFullError), "a used-up budget is 'not now', as a full lane is"
    assert not isinstance(err, LaneCoolingError)
    assert (err.code, err.status, err.from_server) == ("budget_exhausted", 429, True)
    # Nothing was reported in the last minute: only a settle can make room, 60 s.
    assert err.retry_after == 60
    assert "token budget" in err.message


def test_budget_exhausted_maps_to_its_class():
    err = error_for("budget_exhausted", "no room", status=429, retry_after=60.0, from_server=True)
    assert type(err) is BudgetExhaustedError
    assert isinstance(err, LaneFullError) and isinstance(err, InflightError)
    assert err.retry_after == 60.0
    assert {"tokensPerMinute", "providerTokensPerMinute"} <= field_names(Lane)


# ---- sync ---------------------------------------------------------------


def test_the_third_start_is_refused_with_retry_after_60_and_keeps_its_place(ledger):
    lane = "refuse::budgeted"
    first, second = fill_to_800(ledger, lane)
    third = ledger.begin(spec(lane))
    assert third.record["state"] == "waiting"
    with pytest.raises(BudgetExhaustedError) as info:
        third.start()
    assert_budget_exhausted(info.value)
    # A held wait: the server waits for room, then refuses the same way.
    started = time.monotonic()
    with pytest.raises(BudgetExhaustedError) as info:
        third.start(wait=0.3)
    assert_budget_exhausted(info.value)
    assert time.monotonic() - started >= 0.25, "the wait was not held"
    assert ledger.get_activity(third.id)["state"] == "waiting", "the refused record keeps its place in line"

    shown = lane_of(ledger.snapshot(), lane)
    assert set(shown) == field_names(Lane), "exactly the fields the client declares"
    assert (shown["tokensPerMinute"], shown["providerTokensPerMinute"]) == (1000, None)
    assert (shown["executing"], shown["waiting"], shown["tokensReserved"]) == (2, 1, 800)
    third.cancel()
    first.succeed(usage=Usage(input_tokens=400))
    second.succeed(usage=Usage(input_tokens=400))


def test_an_estimate_above_the_whole_budget_is_invalid_request(ledger):
    for start_now in (False, True):
        with pytest.raises(InvalidRequestError) as info:
            ledger.begin(spec("estimate::budgeted", 4000), start_now=start_now)
        assert (info.value.code, info.value.status) == ("invalid_request", 400)
        assert "tokens_per_minute" in info.value.message and "4000" in info.value.message
    shown = ledger.snapshot()["nativeAdmission"].get("estimate::budgeted")
    assert shown is None or (shown["executing"], shown["waiting"]) == (0, 0), "nothing was recorded"


def test_a_start_now_is_refused_with_or_without_a_wait_and_holds_nothing(ledger):
    lane = "now::budgeted"
    first, second = fill_to_800(ledger, lane)
    for wait in (None, 0.2):
        with pytest.raises(BudgetExhaustedError) as info:
            ledger.begin(spec(lane), start_now=True, wait=wait)
        assert_budget_exhausted(info.value)
    shown = lane_of(ledger.snapshot(), lane)
    assert (shown["executing"], shown["waiting"]) == (2, 0)
    first.succeed(usage=Usage(input_tokens=400))
    second.succeed(usage=Usage(input_tokens=400))


def test_admit_waits_through_budget_exhausted_not_for_its_retry_after(budget_server, ledger):
    lane = "admit::budgeted"
    first, _second = fill_to_800(ledger, lane)
    transport = Counting()
    with Ledger(budget_server.url, transport=transport) as counted:
        call = counted.begin(spec(lane))
        # Settling the first with 50 of its 400 tokens frees room: 50 + 400 + 400 <= 1000.
        timer = threading.Timer(0.7, lambda: first.succeed(usage=Usage(input_tokens=50)))
        timer.start()
        try:
            began = time.monotonic()
            # Waits of 0.15 s, so that admit is refused budget_exhausted
            # (Retry-After 60) several times before the settle, and a
            # max_wait below the Retry-After, which must not end it early.
            record = call.admit(max_wait=20, wait_step=0.15)
            took = time.monotonic() - began
        finally:
            timer.join()
    assert record["state"] == "executing"
    assert starts(transport.sent) >= 3, f"{transport.sent}: admit was not refused before the settle"
    assert took < 5, f"admitted after {took:.1f} s: it slept on the Retry-After"
    shown = lane_of(ledger.snapshot(), lane)
    assert (shown["tokensLastMinute"], shown["tokensReserved"], shown["waiting"]) == (50, 800, 0)


def test_a_block_waits_through_a_used_up_budget_then_runs(ledger):
    lane = "block::budgeted"
    first, _second = fill_to_800(ledger, lane)
    timer = threading.Timer(0.5, lambda: first.succeed(usage=Usage(input_tokens=50)))
    timer.start()
    try:
        began = time.monotonic()
        with ledger.activity(spec(lane), max_wait=20, wait_step=0.15) as call:
            assert call.record["state"] == "executing"
            took = time.monotonic() - began
            assert 0.4 <= took < 5, f"admitted after {took:.1f} s: before the settle, or slept on the Retry-After"
            call.report_usage(input_tokens=100)
    finally:
        timer.join()
    assert ledger.get_activity(call.id)["state"] == "succeeded"


def test_past_max_wait_wait_timeout_from_the_budget_refusal(ledger):
    lane = "maxwait::budgeted"
    fill_to_800(ledger, lane)
    seen = []
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError) as info:
        with ledger.activity(spec(lane), max_wait=0.6, wait_step=0.2, lifecycle=Lifecycle(on_enqueued=seen.append)):
            pytest.fail("admitted with no room in the budget")
    took = time.monotonic() - started
    assert 0.55 <= took < 3, f"gave up after {took:.2f} s"
    assert_budget_exhausted(info.value.__cause__)
    record = ledger.get_activity(seen[0]["activityId"])
    assert (record["state"], record["cancelReason"]) == ("cancelled", "wait timeout")
    assert lane_of(ledger.snapshot(), lane)["waiting"] == 0


def test_a_providers_budget_is_shared_by_its_lanes(ledger):
    one = ledger.begin(service="a", provider="metered", max_tokens=400, start_now=True)
    two = ledger.begin(service="b", provider="metered", max_tokens=400, start_now=True)
    three = ledger.begin(service="a", provider="metered", max_tokens=400)
    with pytest.raises(BudgetExhaustedError) as info:
        three.start()
    assert_budget_exhausted(info.value)
    snapshot = ledger.snapshot()
    for lane in ("a::metered", "b::metered"):
        shown = lane_of(snapshot, lane)
        assert (shown["tokensPerMinute"], shown["providerTokensPerMinute"]) == (None, 1000)
    # The settle on the other lane makes room.
    timer = threading.Timer(0.4, lambda: two.succeed(usage=Usage(input_tokens=50)))
    timer.start()
    try:
        began = time.monotonic()
        assert three.admit(max_wait=20, wait_step=0.15)["state"] == "executing"
        assert time.monotonic() - began < 5, "it slept on the Retry-After"
    finally:
        timer.join()
    one.succeed(usage=Usage(input_tokens=400))
    three.succeed(usage=Usage(input_tokens=400))


# ---- asyncio ------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_the_third_start_is_refused_and_a_bad_estimate_is_invalid(budget_server):
    lane = "arefuse::budgeted"
    async with AsyncLedger(budget_server.url) as ledger:
        calls = [await ledger.begin(spec(lane), start_now=True) for _ in range(2)]
        third = await ledger.begin(spec(lane))
        with pytest.raises(BudgetExhaustedError) as info:
            await third.start()
        assert_budget_exhausted(info.value)
        assert (await ledger.get_activity(third.id))["state"] == "waiting"
        with pytest.raises(BudgetExhaustedError):
            await ledger.begin(spec(lane), start_now=True)
        with pytest.raises(InvalidRequestError, match="tokens_per_minute"):
            await ledger.begin(spec(lane, 4000))
        await third.cancel()
        for call in calls:
            await call.succeed(usage=Usage(input_tokens=400))


@pytest.mark.asyncio
async def test_async_admit_waits_through_budget_exhausted_not_for_its_retry_after(budget_server):
    lane = "aadmit::budgeted"
    transport = ACounting()
    async with AsyncLedger(budget_server.url) as ledger, AsyncLedger(budget_server.url, transport=transport) as counted:
        first, _second = [await ledger.begin(spec(lane), start_now=True) for _ in range(2)]
        call = await counted.begin(spec(lane))

        async def settle_later():
            await asyncio.sleep(0.7)
            await first.succeed(usage=Usage(input_tokens=50))

        settling = asyncio.ensure_future(settle_later())
        began = time.monotonic()
        record = await call.admit(max_wait=20, wait_step=0.15)
        took = time.monotonic() - began
        await settling
        assert record["state"] == "executing"
        assert starts(transport.sent) >= 3, f"{transport.sent}: admit was not refused before the settle"
        assert took < 5, f"admitted after {took:.1f} s: it slept on the Retry-After"


@pytest.mark.asyncio
async def test_async_a_block_waits_through_a_used_up_budget_then_runs(budget_server):
    lane = "ablock::budgeted"
    async with AsyncLedger(budget_server.url) as ledger:
        first, _second = [await ledger.begin(spec(lane), start_now=True) for _ in range(2)]

        async def settle_later():
            await asyncio.sleep(0.5)
            await first.succeed(usage=Usage(input_tokens=50))

        settling = asyncio.ensure_future(settle_later())
        began = time.monotonic()
        async with ledger.activity(spec(lane), max_wait=20, wait_step=0.15) as call:
            assert call.record["state"] == "executing"
            took = time.monotonic() - began
            assert 0.4 <= took < 5, f"admitted after {took:.1f} s: before the settle, or slept on the Retry-After"
        await settling
        assert (await ledger.get_activity(call.id))["state"] == "succeeded"
