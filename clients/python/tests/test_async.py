"""The asyncio client against the real server: every path of a call's life."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from conftest import EMPTY, TOKEN, free_port, lane_counts
from inflight_ledger import (
    AsyncLedger,
    InvalidRequestError,
    LaneFullError,
    Lifecycle,
    UnauthorizedError,
    UnavailableError,
    WaitTimeoutError,
)

pytestmark = pytest.mark.asyncio


async def counts(ledger, lane):
    return lane_counts(await ledger.snapshot(limit=1000), lane)


async def hold_slot(ledger, lane):
    service, provider = lane.split("::")
    holder = await ledger.begin(service=service, provider=provider)
    await holder.admit(max_wait=5)
    assert holder.record["state"] == "executing"
    return holder


async def test_full_lifecycle_with_hooks(server):
    events = []
    hooks = Lifecycle(
        on_enqueued=lambda r: events.append(("enqueued", r["state"])),
        on_started=lambda r: events.append(("started", r["state"])),
        on_settled=lambda r: events.append(("settled", r["state"])),
    )
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        async with ledger.activity({"service": "alife", "provider": "ollama", "class": "embedding"},
                                   lifecycle=hooks) as call:
            assert call.record["state"] == "executing"
        assert events == [("enqueued", "waiting"), ("started", "executing"), ("settled", "succeeded")]
        assert (await ledger.get_activity(call.id))["state"] == "succeeded"
        assert await counts(ledger, "alife::ollama") == EMPTY


async def test_begin_with_start_now_admits_and_waits_in_line(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        first = await ledger.begin(service="anow", provider="capped", start_now=True)
        assert first.record["state"] == "executing"
        with pytest.raises(LaneFullError):
            await ledger.begin(service="anow", provider="capped", start_now=True, wait=0.2)
        held = asyncio.create_task(ledger.begin(service="anow", provider="capped", start_now=True, wait=10))
        await asyncio.sleep(0.3)
        await first.succeed()
        second = await held
        assert second.record["state"] == "executing"
        await second.succeed()
        assert await counts(ledger, "anow::capped") == EMPTY


async def test_failure_settles_failed(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with pytest.raises(RuntimeError):
            async with ledger.activity(service="afail", provider="p", failure_stage=lambda e: "queue") as call:
                raise RuntimeError("boom")
        record = await ledger.get_activity(call.id)
        assert record["state"] == "failed"
        assert record["failureStage"] == "queue"


async def test_a_failure_stage_that_raises_still_settles(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        with pytest.raises(RuntimeError, match="boom"):
            async with ledger.activity(service="afail", provider="p",
                                       failure_stage=lambda e: e.response.status_code) as call:
                raise RuntimeError("boom")
        record = await ledger.get_activity(call.id)
        assert (record["state"], record["failureStage"]) == ("failed", "unknown")


async def test_a_settle_never_queues_behind_calls_waiting_in_line(server):
    lane = "apool::capped"
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        holder = await hold_slot(ledger, lane)
        waiters = [await ledger.begin(service="apool", provider="capped") for _ in range(110)]
        waiting = [asyncio.ensure_future(w.admit(max_wait=30, wait_step=10)) for w in waiters]
        await asyncio.sleep(1.0)  # each holds a ?wait= request open
        started = time.monotonic()
        await holder.succeed()
        assert time.monotonic() - started < 3, "the settle waited for a connection"
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for waiter in waiters:
            await waiter.cancel("done")


async def test_a_release_that_failed_is_tried_again(server):
    class Flaky(httpx.AsyncHTTPTransport):
        refusing = True

        async def handle_async_request(self, request):
            if self.refusing and request.method == "DELETE":
                raise httpx.ConnectError("refused", request=request)
            return await super().handle_async_request(request)

    transport = Flaky()
    async with AsyncLedger(server.url, token=TOKEN, transport=transport, retries=1, backoff=0.001) as ledger:
        lease = await ledger.join_as_owner("py-async-release-again", ttl=5)
        with pytest.raises(UnavailableError):
            await lease.release()
        transport.refusing = False
        assert (await lease.release())["state"] == "released"


async def test_task_cancelled_while_waiting_cancels_and_leaves_nothing_in_flight(server):
    lane = "await::capped"
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        holder = await hold_slot(ledger, lane)
        seen = []

        async def call():
            async with ledger.activity(service="await", provider="capped",
                                       lifecycle=Lifecycle(on_enqueued=seen.append)):
                pytest.fail("never admitted")

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0.3)
        assert await counts(ledger, lane) == {"executing": 1, "waiting": 1, "inFlight": 2}
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 2
        record = await ledger.get_activity(seen[0]["activityId"])
        assert record["state"] == "cancelled"
        assert record["startedAt"] is None
        await holder.succeed()
        assert await counts(ledger, lane) == EMPTY


async def test_task_cancelled_while_executing_cancels(server):
    lane = "aexec::capped"
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        ids = []

        async def call():
            async with ledger.activity(service="aexec", provider="capped") as c:
                ids.append(c.id)
                await asyncio.sleep(10)

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0.3)
        assert await counts(ledger, lane) == {"executing": 1, "waiting": 0, "inFlight": 1}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        record = await ledger.get_activity(ids[0])
        assert record["state"] == "cancelled"
        assert record["startedAt"] is not None
        assert await counts(ledger, lane) == EMPTY


async def test_a_timeout_cancels_the_record_and_raises_timeout_error(server):
    lane = "atimeout::capped"
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with ledger.activity(service="atimeout", provider="capped", timeout=0.3) as call:
                await asyncio.sleep(10)
        assert time.monotonic() - started < 2
        record = await ledger.get_activity(call.id)
        assert record["state"] == "cancelled"
        assert record["cancelReason"] == "timeout"
        assert await counts(ledger, lane) == EMPTY
        # The task is not left cancelled: it goes on awaiting.
        await asyncio.sleep(0.01)


async def test_a_timeout_while_waiting_cancels_too(server):
    lane = "amaxwait::capped"
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        holder = await hold_slot(ledger, lane)
        seen = []
        with pytest.raises(TimeoutError):
            async with ledger.activity(service="amaxwait", provider="capped", timeout=0.3,
                                       lifecycle=Lifecycle(on_enqueued=seen.append)):
                pytest.fail("never admitted")
        assert (await ledger.get_activity(seen[0]["activityId"]))["cancelReason"] == "timeout"
        with pytest.raises(WaitTimeoutError):
            async with ledger.activity(service="amaxwait", provider="capped", max_wait=0.2):
                pytest.fail("never admitted")
        await holder.succeed()
        assert await counts(ledger, lane) == EMPTY


async def test_lane_full_and_typed_errors(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        holder = await hold_slot(ledger, "aowner::capped")
        second = await ledger.begin(service="aowner", provider="capped")
        with pytest.raises(LaneFullError):
            await second.start()
        await second.cancel("gave up")
        assert second.record["cancelReason"] == "gave up"
        await holder.succeed()
        with pytest.raises(InvalidRequestError):
            await ledger.register_owner("bad name!")
    async with AsyncLedger(server.url, token="") as anonymous:
        with pytest.raises(UnauthorizedError):
            await anonymous.reap()


async def test_server_unreachable():
    port = free_port()
    async with AsyncLedger(f"http://127.0.0.1:{port}", retries=1, backoff=0.005) as down:
        with pytest.raises(UnavailableError) as info:
            async with down.activity(service="down", provider="p"):
                pytest.fail("not entered")
        assert str(info.value) == (
            f"POST /v1/activities: cannot reach http://127.0.0.1:{port}: connection refused (ECONNREFUSED)"
        )
        assert await down.healthy() is False


async def test_ignored_fields_are_logged_once_per_set(server, caplog):
    caplog.set_level(logging.WARNING, logger="inflight_ledger")
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        begun = []
        for _ in range(3):
            async with ledger.activity(service="typo", provider="p", clas="chat", modle="m",
                                       lifecycle=Lifecycle(on_enqueued=begun.append)):
                pass
        assert sorted(begun[0]["ignoredFields"]) == ["clas", "modle"]  # the begin's answer
        async with ledger.activity(service="typo", provider="p", class_="chat"):
            pass
    told = [r for r in caplog.records if r.name == "inflight_ledger"]
    assert len(told) == 1
    assert '"clas", "modle"' in told[0].getMessage() and "typo::p" in told[0].getMessage()


async def test_a_dead_owners_slot_comes_back(server):
    lane = "aowner::capped"
    async with AsyncLedger(server.url, token=TOKEN) as dying, AsyncLedger(server.url, token=TOKEN) as other:
        lease = await dying.join_as_owner("py-async-dying", ttl=0.3)
        held = await dying.begin(service="aowner", provider="capped")
        await held.admit(max_wait=5)
        assert held.record["ownerId"] == lease.id
        lease.stop()
        started = time.monotonic()
        async with other.activity(service="aowner", provider="capped", max_wait=5):
            assert time.monotonic() - started < 3
            assert (await other.get_activity(held.id))["reapReason"] == "owner-lost"
        assert await counts(other, lane) == EMPTY


async def test_a_lease_renews_and_release_cancels(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        lost = []
        async with await ledger.join_as_owner("py-async-worker", ttl=0.3, on_lost=lost.append) as lease:
            a = await ledger.begin(service="alease", provider="p")
            assert a.record["ownerId"] == lease.id
            await asyncio.sleep(0.9)
            assert not lease.lost and not lost
        owner = await lease.release()
        assert owner["state"] == "released"
        assert owner["cancelledRecords"] == 1
        assert (await a.refresh())["state"] == "cancelled"


async def test_sigterm_releases_an_async_lease_then_terminates(server, tmp_path):
    import json
    import signal
    import sys
    import textwrap

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, json
        from inflight_ledger import AsyncLedger

        async def main():
            async with AsyncLedger({server.url!r}, token={TOKEN!r}) as ledger:
                lease = await ledger.join_as_owner("py-async-sigterm", ttl=30, release_on_signals=True)
                call = await ledger.begin(service="asigterm", provider="p")
                print(json.dumps({{"owner": lease.id, "activity": call.id}}), flush=True)
                await asyncio.sleep(30)

        asyncio.run(main())
    """))
    child = await asyncio.create_subprocess_exec(sys.executable, str(script), stdout=asyncio.subprocess.PIPE)
    ids = json.loads(await asyncio.wait_for(child.stdout.readline(), 10))
    child.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGTERM
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        assert (await ledger.get_activity(ids["activity"]))["state"] == "cancelled"
        owners = {o["ownerId"]: o for o in (await ledger.snapshot())["owners"]}
        assert owners[ids["owner"]]["state"] == "released"
