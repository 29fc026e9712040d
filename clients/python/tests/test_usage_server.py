"""Token usage against the real server, sync and asyncio: a settle with
usage ends with the record's ``inputTokens``/``outputTokens``; a block
settles with what it reported, an explicit report winning over one read
from an answer; a tracked function with its result's usage; the
aggregates sum it; a late settle keeps the first late usage; and a bad
usage is refused by the client, with no request sent."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from conftest import ACounting, Counting, TOKEN
from inflight_ledger import AsyncLedger, InvalidRequestError, Ledger, Lifecycle, Usage
from inflight_ledger.wire import TOKENS_MAX, TOKENS_MIN


def service(name):
    """A service of this test alone, so the aggregates it reads are its own."""
    return f"usage-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def tokens(record):
    return record["inputTokens"], record["outputTokens"]


def chat_answer(prompt, completion):
    """An OpenAI chat completion as JSON."""
    return {"choices": [{"message": {"content": "hi"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def test_a_settle_with_usage_ends_with_the_records_counts(ledger):
    name = service("settle")
    call = ledger.begin(service=name, provider="openai", start_now=True)
    assert tokens(call.record) == (None, None), "a record in flight has no usage"
    answer = call.succeed(usage=Usage(input_tokens=12, output_tokens=40))
    assert answer["state"] == "succeeded" and tokens(answer) == (12, 40)
    assert tokens(ledger.get_activity(call.id)) == (12, 40)

    failed = ledger.begin(service=name, provider="openai", start_now=True)
    assert tokens(failed.fail("provider", usage=Usage(input_tokens=7))) == (7, None), "with a failure too"
    bounds = ledger.begin(service=name, provider="openai", start_now=True)
    assert tokens(bounds.succeed(usage=Usage(0, 1_000_000_000))) == (0, 1_000_000_000)
    plain = ledger.begin(service=name, provider="openai", start_now=True)
    assert tokens(plain.succeed()) == (None, None)
    recent = {r["activityId"]: r for r in ledger.snapshot(limit=1000)["recentCompletions"]}
    assert tokens(recent[call.id]) == (12, 40) and tokens(recent[plain.id]) == (None, None)


def test_a_block_settles_with_its_report_and_an_explicit_one_wins(ledger):
    name = service("block")
    with ledger.activity(service=name, provider="openai") as read:
        read.report_usage_of(chat_answer(12, 40))
    assert tokens(ledger.get_activity(read.id)) == (12, 40)
    with ledger.activity(service=name, provider="openai") as explicit:
        explicit.report_usage(input_tokens=5, output_tokens=6)
        explicit.report_usage_of(chat_answer(12, 40))
    assert tokens(ledger.get_activity(explicit.id)) == (5, 6)
    with ledger.observe_unqueued(service=name, provider="openai", usage_extractor=None) as off:
        off.report_usage_of(chat_answer(12, 40))
    assert tokens(ledger.get_activity(off.id)) == (None, None)
    with pytest.raises(RuntimeError, match="provider down"):
        with ledger.activity(service=name, provider="openai") as failing:
            failing.report_usage(input_tokens=3)
            raise RuntimeError("provider down")
    done = ledger.get_activity(failing.id)
    assert done["state"] == "failed" and tokens(done) == (3, None)


def test_a_tracked_function_settles_with_its_results_usage_and_the_aggregates_sum_it(ledger):
    name = service("tracked")
    settled = []

    @ledger.tracked(service=name, provider="ollama", class_="chat", lifecycle=Lifecycle(on_settled=settled.append))
    def chat(prompt):
        return {"message": {"content": "hi"}, "prompt_eval_count": len(prompt), "eval_count": 10}

    chat("four")
    chat("seven..")
    assert [tokens(r) for r in settled] == [(4, 10), (7, 10)]
    assert [tokens(ledger.get_activity(r["activityId"])) for r in settled] == [(4, 10), (7, 10)]
    with ledger.activity(service=name, provider="ollama", class_="chat") as call:
        call.report_usage(output_tokens=5)
    with ledger.activity(service=name, provider="ollama", class_="chat"):
        pass  # no usage: counts nothing
    aggregates = [a for a in ledger.snapshot(limit=1000)["aggregates"] if a["service"] == name]
    assert len(aggregates) == 1 and aggregates[0]["calls"] == 4
    assert (aggregates[0]["inputTokens"], aggregates[0]["outputTokens"]) == (11, 25)


def test_a_late_settle_carries_usage_and_the_first_late_one_is_kept(ledger):
    call = ledger.begin(service=service("late"), provider="openai", start_now=True, deadline_ms=1)
    time.sleep(0.05)
    ledger.reap()
    late = call.succeed(usage=Usage(input_tokens=12, output_tokens=40))
    assert late["state"] == "reaped" and late["lateSettle"] is True
    assert tokens(late) == (12, 40)
    again = call.fail("provider", usage=Usage(input_tokens=1, output_tokens=1))
    assert tokens(again) == (12, 40), "the first late settle's usage is kept"


def test_a_bad_usage_is_refused_by_the_client_with_no_request(server):
    transport = Counting()
    with Ledger(server.url, token=TOKEN, transport=transport) as ledger:
        call = ledger.begin(service=service("refused"), provider="openai", start_now=True)
        sent = list(transport.sent)
        with pytest.raises(ValueError, match="usage: invalid input_tokens: must be from 0 to 1000000000"):
            call.succeed(usage=Usage(input_tokens=1_000_000_001))
        with pytest.raises(TypeError, match="usage: invalid output_tokens: must be a whole number, not a bool"):
            call.report_usage(output_tokens=True)
        with pytest.raises(TypeError, match="usage: invalid input_tokens: must be a whole number \\(int\\), not float"):
            call.fail("provider", usage=Usage(input_tokens=12.0))
        with pytest.raises(TypeError, match="usage must be an inflight_ledger.Usage, not dict"):
            call.succeed(usage={"inputTokens": 12})
        assert transport.sent == sent, "nothing was sent"
        assert call.refresh()["state"] == "executing" and call.usage is None
        assert tokens(call.succeed(usage=Usage(input_tokens=1))) == (1, None)


def test_the_clients_bounds_are_the_servers(ledger):
    """What the client's checks stand in for: the server refuses a count just
    outside the client's bounds, naming it by its wire name, and takes the
    bounds themselves."""
    call = ledger.begin(service=service("bounds"), provider="openai", start_now=True)
    for field in ("inputTokens", "outputTokens"):
        for value in (TOKENS_MAX + 1, TOKENS_MIN - 1):
            with pytest.raises(InvalidRequestError, match=f"usage.{field}"):
                ledger.request("settle", id=call.id, body={"success": True, "usage": {field: value}})
    assert call.refresh()["state"] == "executing"
    done = ledger.request("settle", id=call.id, body={"success": True, "usage": {
        "inputTokens": TOKENS_MIN, "outputTokens": TOKENS_MAX}})
    assert tokens(done) == (TOKENS_MIN, TOKENS_MAX)


# ---- asyncio ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_settles_blocks_and_tracked_coroutines_carry_usage(server):
    name = service("async")
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        call = await ledger.begin(service=name, provider="gemini", start_now=True)
        assert tokens(await call.succeed(usage=Usage(input_tokens=12, output_tokens=40))) == (12, 40)
        async with ledger.activity(service=name, provider="gemini") as read:
            read.report_usage_of({"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4}})
        assert tokens(await ledger.get_activity(read.id)) == (3, 4)
        async with ledger.activity(service=name, provider="gemini") as explicit:
            explicit.report_usage(Usage(input_tokens=1))
            explicit.report_usage_of({"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4}})
        assert tokens(await ledger.get_activity(explicit.id)) == (1, None)
        settled = []

        @ledger.tracked(service=name, provider="gemini", lifecycle=Lifecycle(on_settled=settled.append))
        async def generate():
            return {"usageMetadata": {"promptTokenCount": 8, "candidatesTokenCount": 9}}

        await generate()
        assert tokens(await ledger.get_activity(settled[0]["activityId"])) == (8, 9)
        aggregates = [a for a in (await ledger.snapshot(limit=1000))["aggregates"] if a["service"] == name]
        assert sum(a["inputTokens"] for a in aggregates) == 12 + 3 + 1 + 8
        assert sum(a["outputTokens"] for a in aggregates) == 40 + 4 + 9


@pytest.mark.asyncio
async def test_async_a_bad_usage_is_refused_by_the_client_with_no_request(server):
    transport = ACounting()
    async with AsyncLedger(server.url, token=TOKEN, transport=transport) as ledger:
        call = await ledger.begin(service=service("arefused"), provider="openai", start_now=True)
        sent = list(transport.sent)
        with pytest.raises(ValueError, match="usage: invalid output_tokens: must be from 0 to 1000000000, not -1"):
            await call.succeed(usage=Usage(output_tokens=-1))
        with pytest.raises(TypeError, match="usage must be an inflight_ledger.Usage, not dict"):
            await call.fail("provider", usage={"input_tokens": 1})
        assert transport.sent == sent, "nothing was sent"
        assert (await call.refresh())["state"] == "executing"
        assert tokens(await call.succeed(usage=Usage(output_tokens=2))) == (None, 2)
