"""``with ledger.context(...)`` against the real server, sync and asyncio:
what a begin inside a context records, read back from the server (never
from the request sent)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from conftest import TOKEN
from inflight_ledger import ActivityContext, AsyncLedger, InvalidRequestError, Ledger

UNKNOWN = {"operationStage": "unknown", "priority": "unknown"}


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def attribution(record):
    return {"service": record["service"], "operationStage": record["operationStage"], "priority": record["priority"]}


def recorded(ledger, call):
    """The attribution of the record ``call`` began, as the server has it; the record is then cancelled."""
    record = ledger.get_activity(call.id)
    if record["state"] in ("waiting", "executing"):
        call.cancel()
    return attribution(record)


async def arecorded(ledger, call):
    record = await ledger.get_activity(call.id)
    if record["state"] in ("waiting", "executing"):
        await call.cancel()
    return attribution(record)


# ---- sync ----------------------------------------------------------------


def test_sync_every_way_of_beginning_inside_a_context_takes_its_fields(ledger):
    expected = {"service": "pctx-svc", "operationStage": "pctx-ingest", "priority": "batch"}
    with ledger.context(service="pctx-svc", operation_stage="pctx-ingest", priority="batch") as context:
        assert context == ActivityContext("pctx-svc", "pctx-ingest", "batch")
        begun = ledger.begin(provider="p")
        started_now = ledger.begin(provider="p", start_now=True)
        with ledger.activity(provider="p") as in_block:
            pass
        with ledger.observe_unqueued(provider="p") as observed:
            pass
        from_mapping = ledger.begin({"provider": "p"})
    for call in (begun, started_now, in_block, observed, from_mapping):
        assert recorded(ledger, call) == expected, call.record


def test_sync_the_begins_own_fields_win(ledger):
    with ledger.context(service="pctx-outer", operation_stage="pctx-stage", priority="batch"):
        own = ledger.begin(service="pctx-own", provider="p", operation_stage="own-stage", priority="interactive")
        wire_names = ledger.begin({"service": "pctx-own", "provider": "p", "operationStage": "own-stage"})
        # None is "left out": the context fills it.
        partly = ledger.begin(provider="p", service=None, operation_stage="own-stage")
    assert recorded(ledger, own) == {"service": "pctx-own", "operationStage": "own-stage", "priority": "interactive"}
    assert recorded(ledger, wire_names) == {"service": "pctx-own", "operationStage": "own-stage", "priority": "batch"}
    assert recorded(ledger, partly) == {"service": "pctx-outer", "operationStage": "own-stage", "priority": "batch"}


def test_sync_nested_contexts_override_and_inherit(ledger):
    outer = {"service": "pctx-nest", "operationStage": "outer-stage", "priority": "batch"}
    calls = []
    with ledger.context(service="pctx-nest", operation_stage="outer-stage", priority="batch"):
        calls.append(ledger.begin(provider="p"))
        with ledger.context(operation_stage="inner-stage"):
            calls.append(ledger.begin(provider="p"))
        with ledger.context(service="pctx-nest-inner", priority="interactive"):
            with ledger.context(operation_stage="deepest-stage") as deepest:
                assert deepest == ActivityContext("pctx-nest-inner", "deepest-stage", "interactive")
                calls.append(ledger.begin(provider="p"))
        # A block left by an exception restores its parent too.
        with pytest.raises(KeyError):
            with ledger.context(service="pctx-raised"):
                raise KeyError("x")
        calls.append(ledger.begin(provider="p"))
    assert [recorded(ledger, c) for c in calls] == [
        outer,
        {"service": "pctx-nest", "operationStage": "inner-stage", "priority": "batch"},
        {"service": "pctx-nest-inner", "operationStage": "deepest-stage", "priority": "interactive"},
        outer,
    ]


def test_sync_two_threads_each_in_its_own_context_do_not_leak(ledger):
    results = {}
    barrier = threading.Barrier(2)

    def work(service, stage, priority):
        with ledger.context(service=service, operation_stage=stage, priority=priority):
            barrier.wait(5)  # both blocks entered before either begins
            results[service] = [ledger.begin(provider="p") for _ in range(3)]

    threads = [
        threading.Thread(target=work, args=("pctx-left", "left-stage", "batch")),
        threading.Thread(target=work, args=("pctx-right", "right-stage", "interactive")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for call in results["pctx-left"]:
        assert recorded(ledger, call) == {"service": "pctx-left", "operationStage": "left-stage", "priority": "batch"}
    for call in results["pctx-right"]:
        assert recorded(ledger, call) == {
            "service": "pctx-right", "operationStage": "right-stage", "priority": "interactive"}
    # A thread gets the block's context when run in a copy of it.
    got = []
    with ledger.context(service="pctx-copied"):
        t = threading.Thread(target=contextvars.copy_context().run, args=(lambda: got.append(ledger.begin(provider="p")),))
        t.start()
        t.join(10)
    assert recorded(ledger, got[0]) == {"service": "pctx-copied", **UNKNOWN}


def test_sync_outside_any_context_nothing_is_filled_in(ledger, server):
    assert recorded(ledger, ledger.begin(service="pctx-none", provider="p")) == {"service": "pctx-none", **UNKNOWN}
    with ledger.context(service="pctx-ended", operation_stage="s", priority="batch"):
        pass
    assert recorded(ledger, ledger.begin(service="pctx-none", provider="p")) == {"service": "pctx-none", **UNKNOWN}
    # No service from anywhere: the server refuses the begin, naming the field.
    with pytest.raises(InvalidRequestError, match="service"):
        ledger.begin(provider="p")
    # The context is the client's: another client's begins inside it take nothing.
    with Ledger(server.url, token=TOKEN) as other:
        with ledger.context(service="pctx-mine", operation_stage="mine", priority="batch"):
            foreign = other.begin(service="pctx-other", provider="p")
        assert recorded(ledger, foreign) == {"service": "pctx-other", **UNKNOWN}


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"service": "bad service!"}, ValueError, "context: invalid service: character ' ' is not allowed"),
        ({"service": ""}, ValueError, "context: invalid service: must not be empty"),
        ({"operation_stage": "x" * 65}, ValueError, "context: invalid operation_stage: must be at most 64 characters"),
        ({"operation_stage": 7}, TypeError, "context: invalid operation_stage: must be a string, not int"),
        ({"priority": "urgent"}, ValueError,
         "context: invalid priority: 'urgent' is not one of 'interactive', 'batch', 'unknown'"),
        ({"servce": "kb"}, TypeError, "servce"),
    ],
)
def test_bad_context_values_raise_naming_the_field_when_entering(server, values, error, message):
    sync_client, async_client = Ledger(server.url, token=TOKEN), AsyncLedger(server.url, token=TOKEN)
    try:
        for client in (sync_client, async_client):
            ran = False
            with pytest.raises(error) as raised:
                with client.context(**values):
                    ran = True
            assert message in str(raised.value)
            assert not ran
    finally:
        sync_client.close()
        asyncio.run(async_client.aclose())


# ---- asyncio -------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_every_way_of_beginning_inside_a_context_takes_its_fields_across_awaits(server):
    expected = {"service": "pactx-svc", "operationStage": "pactx-ingest", "priority": "interactive"}
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with ledger.context(service="pactx-svc", operation_stage="pactx-ingest", priority="interactive"):
            await asyncio.sleep(0.01)
            begun = await ledger.begin(provider="p")
            await asyncio.sleep(0.01)
            started_now = await ledger.begin(provider="p", start_now=True)
            async with ledger.activity(provider="p") as in_block:
                await asyncio.sleep(0.01)
            async with ledger.observe_unqueued(provider="p") as observed:
                pass
            loop = asyncio.get_running_loop()
            later = loop.create_future()
            # A callback scheduled inside runs in a copy of the context, as a task does.
            loop.call_later(0.02, lambda: later.set_result(asyncio.ensure_future(ledger.begin(provider="p"))))
            from_callback = await (await later)
            own = await ledger.begin(service="pactx-own", provider="p", priority="batch")
        for call in (begun, started_now, in_block, observed, from_callback):
            assert await arecorded(ledger, call) == expected, call.record
        assert await arecorded(ledger, own) == {"service": "pactx-own", "operationStage": "pactx-ingest",
                                                "priority": "batch"}


@pytest.mark.asyncio
async def test_async_nested_contexts_override_and_inherit(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with ledger.context(service="pactx-nest", operation_stage="outer-stage", priority="batch"):
            before = await ledger.begin(provider="p")
            with ledger.context(operation_stage="inner-stage"):
                await asyncio.sleep(0.01)
                inner = await ledger.begin(provider="p")
            with ledger.context(service="pactx-nest-inner", priority="interactive"):
                deepest = await ledger.begin(provider="p")
            after = await ledger.begin(provider="p")
        outer = {"service": "pactx-nest", "operationStage": "outer-stage", "priority": "batch"}
        assert [await arecorded(ledger, c) for c in (before, inner, deepest, after)] == [
            outer,
            {"service": "pactx-nest", "operationStage": "inner-stage", "priority": "batch"},
            {"service": "pactx-nest-inner", "operationStage": "outer-stage", "priority": "interactive"},
            outer,
        ]


@pytest.mark.asyncio
async def test_async_gather_of_two_tasks_each_in_its_own_context_do_not_leak(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:

        async def work(service, stage, priority, pause):
            with ledger.context(service=service, operation_stage=stage, priority=priority):
                calls = []
                for _ in range(4):
                    await asyncio.sleep(pause)
                    calls.append(await ledger.begin(provider="p"))
                return calls

        left, right = await asyncio.gather(
            work("pactx-left", "left-stage", "batch", 0.007),
            work("pactx-right", "right-stage", "interactive", 0.011),
        )
        for call in left:
            assert await arecorded(ledger, call) == {
                "service": "pactx-left", "operationStage": "left-stage", "priority": "batch"}
        for call in right:
            assert await arecorded(ledger, call) == {
                "service": "pactx-right", "operationStage": "right-stage", "priority": "interactive"}


@pytest.mark.asyncio
async def test_async_a_task_created_inside_a_block_inherits_it(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:

        async def begin_later(release):
            await release.wait()
            return await ledger.begin(provider="p")

        release = asyncio.Event()
        with ledger.context(service="pactx-task", operation_stage="task-stage", priority="batch"):
            task = asyncio.create_task(begin_later(release))
        # The block has ended before the task begins: the task kept its copy.
        release.set()
        inherited = await task
        assert await arecorded(ledger, inherited) == {
            "service": "pactx-task", "operationStage": "task-stage", "priority": "batch"}
        # A task created after the block has nothing.
        after = await asyncio.create_task(ledger.begin(service="pactx-none", provider="p"))
        assert await arecorded(ledger, after) == {"service": "pactx-none", **UNKNOWN}


@pytest.mark.asyncio
async def test_async_outside_any_context_nothing_is_filled_in(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger, AsyncLedger(server.url, token=TOKEN) as other:
        with ledger.context(service="pactx-ended", operation_stage="s", priority="batch"):
            await asyncio.sleep(0)
        plain = await ledger.begin(service="pactx-none", provider="p")
        assert await arecorded(ledger, plain) == {"service": "pactx-none", **UNKNOWN}
        with pytest.raises(InvalidRequestError, match="service"):
            await ledger.begin(provider="p")
        with ledger.context(service="pactx-mine", operation_stage="mine", priority="batch"):
            foreign = await other.begin(service="pactx-other", provider="p")
        assert await arecorded(ledger, foreign) == {"service": "pactx-other", **UNKNOWN}
