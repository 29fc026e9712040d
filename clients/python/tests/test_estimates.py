"""A call's token estimate (``max_tokens``, ``maxTokens`` on the wire)
against the real server, sync and asyncio: the record carries it; its
lane's ``tokensReserved`` counts it while it executes, not before nor
after; a call that ran and reported no usage counts it in
``tokensLastMinute``; and a bad estimate is refused by the client, with no
request sent."""

from __future__ import annotations

import uuid

import httpx
import pytest

from conftest import ACounting, Counting, TOKEN
from inflight_ledger import AsyncLedger, InvalidRequestError, Ledger, Lifecycle, Usage
from inflight_ledger.wire import TOKENS_MAX, TOKENS_MIN


def service(name):
    """A service of this test alone, so the lane it reads is its own."""
    return f"estimate-{name}-{uuid.uuid4().hex[:8]}"


def lane(snapshot, name, provider="openai"):
    return snapshot["nativeAdmission"][f"{name}::{provider}"]


#: Each bad estimate, the exception and the words it raises with.
BAD = [
    (-1, ValueError, "begin: invalid max_tokens: must be from 0 to 1000000000, not -1"),
    (TOKENS_MAX + 1, ValueError, "begin: invalid max_tokens: must be from 0 to 1000000000, not 1000000001"),
    (True, TypeError, "begin: invalid max_tokens: must be a whole number, not a bool"),
    (1.5, TypeError, "begin: invalid max_tokens: must be a whole number \\(int\\), not float"),
    ("100", TypeError, "begin: invalid max_tokens: must be a whole number \\(int\\), not str"),
]


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def test_an_estimate_is_reserved_while_the_call_executes(ledger):
    name = service("reserve")
    call = ledger.begin(service=name, provider="openai", max_tokens=1500)
    assert call.record["state"] == "waiting" and call.record["maxTokens"] == 1500
    assert lane(ledger.snapshot(), name)["tokensReserved"] == 0, "a call waiting reserves nothing"
    call.start()
    assert lane(ledger.snapshot(), name)["tokensReserved"] == 1500
    other = ledger.begin(service=name, provider="openai", start_now=True, max_tokens=TOKENS_MIN)
    plain = ledger.begin(service=name, provider="openai", start_now=True)
    assert other.record["maxTokens"] == 0 and plain.record["maxTokens"] is None
    assert lane(ledger.snapshot(), name)["tokensReserved"] == 1500
    assert call.succeed()["maxTokens"] == 1500
    other.succeed()
    plain.succeed()
    after = lane(ledger.snapshot(), name)
    assert after["tokensReserved"] == 0
    assert after["tokensLastMinute"] == 1500, "a call that ran and reported no usage counts its estimate"
    assert ledger.get_activity(call.id)["maxTokens"] == 1500


def test_blocks_and_tracked_functions_carry_the_estimate(ledger):
    name = service("blocks")
    with ledger.activity(service=name, provider="openai", max_tokens=300) as call:
        assert call.record["maxTokens"] == 300
        assert lane(ledger.snapshot(), name)["tokensReserved"] == 300
        call.report_usage(input_tokens=20, output_tokens=30)
    assert lane(ledger.snapshot(), name)["tokensReserved"] == 0
    with ledger.activity({"service": name, "provider": "openai", "maxTokens": 40}) as mapped:
        pass
    settled = []

    @ledger.tracked(service=name, provider="openai", max_tokens=700, lifecycle=Lifecycle(on_settled=settled.append))
    def chat():
        return {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}

    chat()
    assert [r["maxTokens"] for r in settled] == [700]
    with ledger.observe_unqueued(service=name, provider="openai", max_tokens=9) as direct:
        pass
    assert ledger.get_activity(mapped.id)["maxTokens"] == 40
    assert ledger.get_activity(direct.id)["maxTokens"] == 9
    # Reported usage counts instead of the estimate (50, 3); the calls that
    # reported none count theirs (40, and 9: a direct call's too).
    assert lane(ledger.snapshot(), name)["tokensLastMinute"] == 50 + 3 + 40 + 9


def test_a_bad_estimate_is_refused_by_the_client_with_no_request(server):
    transport = Counting()
    with Ledger(server.url, token=TOKEN, transport=transport) as ledger:
        name = service("refused")
        for value, error, words in BAD:
            with pytest.raises(error, match=words):
                ledger.begin(service=name, provider="openai", start_now=True, max_tokens=value)
            with pytest.raises(error, match=words):
                ledger.activity(service=name, provider="openai", max_tokens=value)
            with pytest.raises(error, match=words):
                ledger.observe_unqueued({"service": name, "provider": "openai", "maxTokens": value})

        @ledger.tracked(service=name, provider="openai", max_tokens=-5)
        def chat():
            raise AssertionError("never called")

        with pytest.raises(ValueError, match="begin: invalid max_tokens"):
            chat()
        assert transport.sent == [], "nothing was sent"


def test_the_clients_bounds_are_the_servers(ledger):
    """What the client's check stands in for: the server refuses an estimate
    just outside the client's bounds, naming ``maxTokens``, and takes the
    bounds themselves."""
    name = service("bounds")
    for value in (TOKENS_MAX + 1, TOKENS_MIN - 1):
        with pytest.raises(InvalidRequestError, match="maxTokens"):
            ledger.request("begin", body={"service": name, "provider": "openai", "maxTokens": value})
    for value in (TOKENS_MIN, TOKENS_MAX):
        record = ledger.request("begin", body={"service": name, "provider": "openai", "maxTokens": value})
        assert record["maxTokens"] == value
        ledger.request("cancel", id=record["activityId"], body={})


# ---- asyncio ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_an_estimate_is_reserved_while_the_call_executes(server):
    name = service("async")
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        call = await ledger.begin(service=name, provider="openai", start_now=True, max_tokens=2500)
        assert call.record["maxTokens"] == 2500
        assert lane(await ledger.snapshot(), name)["tokensReserved"] == 2500
        assert (await call.succeed(usage=Usage(input_tokens=10)))["maxTokens"] == 2500
        assert lane(await ledger.snapshot(), name)["tokensReserved"] == 0
        async with ledger.activity(service=name, provider="openai", max_tokens=60) as block:
            assert block.record["maxTokens"] == 60
            assert lane(await ledger.snapshot(), name)["tokensReserved"] == 60
        settled = []

        @ledger.tracked(service=name, provider="openai", max_tokens=80, lifecycle=Lifecycle(on_settled=settled.append))
        async def generate():
            return None

        await generate()
        assert [r["maxTokens"] for r in settled] == [80]
        after = lane(await ledger.snapshot(), name)
        assert after["tokensReserved"] == 0 and after["tokensLastMinute"] == 10 + 60 + 80


@pytest.mark.asyncio
async def test_async_a_bad_estimate_is_refused_by_the_client_with_no_request(server):
    transport = ACounting()
    async with AsyncLedger(server.url, token=TOKEN, transport=transport) as ledger:
        name = service("arefused")
        for value, error, words in BAD:
            with pytest.raises(error, match=words):
                await ledger.begin(service=name, provider="openai", max_tokens=value)
            with pytest.raises(error, match=words):
                ledger.activity({"service": name, "provider": "openai", "maxTokens": value})
            with pytest.raises(error, match=words):
                ledger.observe_unqueued(service=name, provider="openai", max_tokens=value)

        @ledger.tracked(service=name, provider="openai", max_tokens=TOKENS_MAX + 1)
        async def generate():
            raise AssertionError("never called")

        with pytest.raises(ValueError, match="begin: invalid max_tokens"):
            await generate()
        assert transport.sent == [], "nothing was sent"
