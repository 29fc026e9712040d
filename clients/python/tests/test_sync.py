"""The sync client against the real server: every path of a call's life."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from conftest import EMPTY, TOKEN, free_port, lane_counts
from inflight_ledger import (
    ConflictError,
    InflightError,
    InvalidRequestError,
    LaneFullError,
    Ledger,
    Lifecycle,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
    WaitCancelledError,
    WaitTimeoutError,
)


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def counts(ledger, lane):
    return lane_counts(ledger.snapshot(limit=1000), lane)


def hold_slot(ledger, lane):
    service, provider = lane.split("::")
    holder = ledger.begin(service=service, provider=provider)
    holder.admit(max_wait=5)
    assert holder.record["state"] == "executing"
    return holder


def interrupt_main_after(seconds):
    """A real SIGINT to the main thread (it interrupts a blocking read), as Ctrl-C would."""
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def test_full_lifecycle_with_hooks(ledger):
    events = []
    hooks = Lifecycle(
        on_enqueued=lambda r: events.append(("enqueued", r["state"])),
        on_started=lambda r: events.append(("started", r["state"])),
        on_settled=lambda r: events.append(("settled", r["state"])),
    )
    with ledger.activity(service="life", provider="ollama", class_="embedding", model="nomic-embed-text",
                         operation_stage="ingest", lifecycle=hooks) as call:
        assert call.record["state"] == "executing"
    assert events == [("enqueued", "waiting"), ("started", "executing"), ("settled", "succeeded")]
    record = ledger.get_activity(call.id)
    assert record["state"] == "succeeded"
    assert record["success"] is True
    assert record["class"] == "embedding"
    assert record["operationStage"] == "ingest"
    assert counts(ledger, "life::ollama") == EMPTY


def test_failure_settles_failed_and_the_exception_propagates(ledger):
    with pytest.raises(ValueError, match="provider said 500"):
        with ledger.activity(service="fail", provider="ollama") as call:
            raise ValueError("provider said 500")
    record = ledger.get_activity(call.id)
    assert record["state"] == "failed"
    assert record["failureStage"] == "provider"
    assert counts(ledger, "fail::ollama") == EMPTY


def test_a_failure_stage_that_raises_still_settles_and_the_blocks_exception_propagates(ledger):
    with pytest.raises(ValueError, match="no response here"):
        with ledger.activity(service="fail", provider="ollama",
                             failure_stage=lambda e: e.response.status_code) as call:
            raise ValueError("no response here")
    record = ledger.get_activity(call.id)
    assert (record["state"], record["failureStage"]) == ("failed", "unknown")
    assert counts(ledger, "fail::ollama") == EMPTY


def test_a_wait_step_of_zero_is_refused_before_anything_is_recorded(ledger):
    before = ledger.snapshot()["totalActivities"]
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="wait_step must be a number of seconds above 0"):
            with ledger.activity(service="kb", provider="ollama", wait_step=bad):
                pytest.fail("never entered")
    call = ledger.begin(service="kb", provider="ollama")
    with pytest.raises(ValueError, match="wait_step"):
        call.admit(wait_step=0)
    call.cancel("done")
    assert ledger.snapshot()["totalActivities"] == before + 1


def test_keyboard_interrupt_while_waiting_cancels_and_leaves_nothing_in_flight(ledger):
    lane = "wait::capped"
    holder = hold_slot(ledger, lane)
    seen = []
    timers = []

    def enqueued(record):  # Ctrl-C once the record waits in line
        seen.append(record)
        timers.append(interrupt_main_after(0.3))

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ledger.activity(service="wait", provider="capped", lifecycle=Lifecycle(on_enqueued=enqueued)):
            pytest.fail("never admitted")
    timers[0].join()
    assert time.monotonic() - started < 3
    record = ledger.get_activity(seen[0]["activityId"])
    assert record["state"] == "cancelled"
    assert record["startedAt"] is None
    assert record["cancelReason"] == "interrupted"
    holder.succeed()
    assert counts(ledger, lane) == EMPTY


def test_keyboard_interrupt_while_executing_cancels(ledger):
    lane = "exec::capped"
    with pytest.raises(KeyboardInterrupt):
        with ledger.activity(service="exec", provider="capped") as call:
            assert counts(ledger, lane) == {"executing": 1, "waiting": 0, "inFlight": 1}
            timer = interrupt_main_after(0.2)  # Ctrl-C while the call executes
            time.sleep(5)
    timer.join()
    record = ledger.get_activity(call.id)
    assert record["state"] == "cancelled"
    assert record["startedAt"] is not None
    assert counts(ledger, lane) == EMPTY


def test_waiting_past_max_wait_is_wait_timeout_and_cancels(ledger):
    lane = "maxwait::capped"
    holder = hold_slot(ledger, lane)
    seen = []
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError) as info:
        with ledger.activity(service="maxwait", provider="capped", max_wait=0.3,
                             lifecycle=Lifecycle(on_enqueued=seen.append)):
            pytest.fail("never admitted")
    assert info.value.code == "wait_timeout"
    assert time.monotonic() - started < 3
    record = ledger.get_activity(seen[0]["activityId"])
    assert record["state"] == "cancelled"
    assert record["cancelReason"] == "wait timeout"
    holder.succeed()
    assert counts(ledger, lane) == EMPTY


def test_observe_unqueued_records_a_direct_call(ledger):
    with ledger.observe_unqueued(service="direct", provider="openai") as call:
        assert call.record["state"] == "executing"
        assert call.record["admission"] == "direct"
    assert ledger.get_activity(call.id)["state"] == "succeeded"


def test_lane_full_keeps_the_place_in_line(ledger):
    lane = "full::capped"
    holder = hold_slot(ledger, lane)
    second = ledger.begin(service="full", provider="capped")
    with pytest.raises(LaneFullError) as info:
        second.start()
    assert info.value.code == "lane_full"
    assert info.value.status == 429
    assert info.value.retry_after == 1
    assert second.refresh()["state"] == "waiting"
    # A begin already started on a full lane is refused and records nothing.
    with pytest.raises(LaneFullError):
        ledger.begin(service="full", provider="capped", started_at=int(time.time() * 1000))
    assert counts(ledger, lane) == {"executing": 1, "waiting": 1, "inFlight": 2}
    threading.Timer(0.1, holder.succeed).start()
    assert second.start(wait=5)["state"] == "executing"
    second.settle(False, failure_stage="queue")
    second.settle(False, failure_stage="queue")  # the same settle again is harmless
    assert second.record["failureStage"] == "queue"
    assert counts(ledger, lane) == EMPTY


def test_begin_with_start_now_admits_waits_and_cancels_when_the_wait_ends(ledger):
    lane = "now::capped"
    first = ledger.begin(service="now", provider="capped", start_now=True)
    assert first.record["state"] == "executing"
    assert first.record["startedAt"] == first.record["enqueuedAt"]  # the server's clock
    with pytest.raises(LaneFullError):
        ledger.begin(service="now", provider="capped", start_now=True)
    with pytest.raises(LaneFullError) as info:
        ledger.begin(service="now", provider="capped", start_now=True, wait=0.2)
    assert "cancelled" in str(info.value)
    assert counts(ledger, lane) == {"executing": 1, "waiting": 0, "inFlight": 1}
    threading.Timer(0.3, first.succeed).start()
    second = ledger.begin(service="now", provider="capped", start_now=True, wait=10)
    assert second.record["state"] == "executing"
    second.succeed()
    assert counts(ledger, lane) == EMPTY
    with pytest.raises(ValueError):
        ledger.begin(service="now", provider="capped", wait=1)


def test_errors_are_typed_by_code(ledger, server):
    with pytest.raises(InvalidRequestError, match="service") as info:
        ledger.begin(service="bad label!", provider="p")
    assert info.value.code == "invalid_request"
    with pytest.raises(NotFoundError):
        ledger.get_activity("01939b1c-0000-7000-8000-000000000000")
    a = ledger.begin(service="conflict", provider="p")
    a.succeed()
    with pytest.raises(ConflictError):
        a.cancel()
    with Ledger(server.url, token="") as anonymous:
        with pytest.raises(UnauthorizedError) as info:
            anonymous.snapshot()
        assert info.value.status == 401


class Counting(httpx.HTTPTransport):
    def __init__(self, seen, keys=None):
        super().__init__()
        self.seen = seen
        self.keys = keys if keys is not None else set()

    def handle_request(self, request):
        self.seen.append(f"{request.method} {request.url.path}")
        if "idempotency-key" in request.headers:
            self.keys.add(request.headers["idempotency-key"])
        return super().handle_request(request)


def test_server_unreachable_is_unavailable_and_requests_retry_a_begin_too_with_its_key():
    seen = []
    keys = set()
    with Ledger(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.005, transport=Counting(seen, keys)) as down:
        entered = False
        with pytest.raises(UnavailableError) as info:
            with down.activity(service="down", provider="p"):
                entered = True
        assert not entered
        assert info.value.code == "unavailable"
        assert isinstance(info.value, InflightError)
        # The message names the server and why it could not be reached.
        base = down.config.base_url
        assert str(info.value) == f"POST /v1/activities: cannot reach {base}: connection refused (ECONNREFUSED)"
        assert seen == ["POST /v1/activities"] * 3, "a begin is tried 1 + 2 times"
        assert len(keys) == 1, "with one key"
        seen.clear()
        with pytest.raises(UnavailableError, match=f"^GET /v1/snapshot: cannot reach {base}: connection refused"):
            down.snapshot()
        assert len(seen) == 3, "a read is tried 1 + 2 times"
        assert down.healthy() is False
    # A host that does not resolve is named too (no DNS at all on a sandboxed machine says so).
    with Ledger("http://inflight.invalid:7878", retries=0) as nowhere:
        with pytest.raises(UnavailableError) as info:
            nowhere.snapshot()
        assert str(info.value).startswith("GET /v1/snapshot: cannot reach http://inflight.invalid:7878: ")
        assert str(info.value).endswith(("(EAI_NONAME)", "(EAI_AGAIN)"))


def test_ignored_fields_are_logged_once_per_set_per_client(server, caplog):
    caplog.set_level(logging.WARNING, logger="inflight_ledger")

    def told():
        return [r for r in caplog.records if r.name == "inflight_ledger"]

    with Ledger(server.url, token=TOKEN) as ledger:
        a = ledger.begin(service="typo", provider="p", clas="chat", modle="m")
        assert sorted(a.record["ignoredFields"]) == ["clas", "modle"]
        assert len(told()) == 1
        message = told()[0].getMessage()
        assert '"clas", "modle"' in message and "typo::p" in message and a.id in message
        assert sorted(told()[0].inflight_ignored_fields) == ["clas", "modle"]
        # The same set again, in another order or through a block: not logged again.
        ledger.begin({"service": "typo", "provider": "p", "modle": "m", "clas": "chat"}).cancel()
        with ledger.activity(service="typo", provider="p", clas="chat", modle="m"):
            pass
        assert len(told()) == 1
        # Another set is; known fields only (snake case included) are not.
        with ledger.activity(service="typo", provider="p", operation_stag="ingest"):
            pass
        with ledger.activity(service="typo", provider="p", class_="chat", operation_stage="ingest", model="m"):
            pass
        assert len(told()) == 2
        assert '"operation_stag"' in told()[1].getMessage()
        a.cancel()
    with Ledger(server.url, token=TOKEN) as other:  # per client: another tells its own
        other.begin(service="typo", provider="p", clas="chat", modle="m").cancel()
    assert len(told()) == 3


def test_a_cancel_event_aborts_a_call_waiting_in_line(ledger):
    lane = "cancel::capped"
    holder = hold_slot(ledger, lane)
    cancel = threading.Event()
    enqueued = threading.Event()
    seen = []
    outcome = {}

    def waiter():
        hooks = Lifecycle(on_enqueued=lambda r: (seen.append(r), enqueued.set()))
        try:
            # wait_step 10 s: the abort must not wait for the held ?wait= to end.
            with ledger.activity(service="cancel", provider="capped", cancel=cancel, lifecycle=hooks):
                outcome["entered"] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert enqueued.wait(5)
    time.sleep(0.3)  # in its ?wait= request
    assert counts(ledger, lane) == {"executing": 1, "waiting": 1, "inFlight": 2}
    set_at = time.monotonic()
    cancel.set()
    thread.join(5)
    assert not thread.is_alive()
    assert "entered" not in outcome
    error = outcome["error"]
    assert isinstance(error, WaitCancelledError) and error.code == "wait_cancelled"
    assert "cancel event" in str(error) and seen[0]["activityId"] in str(error)
    assert outcome["at"] - set_at < 1.0, "the abort took effect at once, not at the end of the wait step"
    # Cancelled on the server, nothing leaked: the lane holds only the holder.
    snap = ledger.snapshot(limit=1000)
    done = {r["activityId"]: r for r in snap["recentCompletions"]}
    record = done[seen[0]["activityId"]]
    assert record["state"] == "cancelled"
    assert record["startedAt"] is None
    assert record["cancelReason"] == "cancelled"
    assert lane_counts(snap, lane) == {"executing": 1, "waiting": 0, "inFlight": 1}
    holder.succeed()
    assert counts(ledger, lane) == EMPTY
    # An event already set: nothing is begun.
    with pytest.raises(WaitCancelledError, match="nothing was recorded"):
        with ledger.activity(service="cancel", provider="capped", cancel=cancel):
            pytest.fail("not entered")


def test_the_handles_admit_takes_a_cancel_event_and_a_block_aborted_is_cancelled(ledger):
    lane = "hcancel::capped"
    holder = hold_slot(ledger, lane)
    waiting = ledger.begin(service="hcancel", provider="capped")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(WaitCancelledError):
        waiting.admit(wait_step=10, cancel=cancel)
    assert time.monotonic() - started < 1.3
    assert waiting.refresh()["state"] == "cancelled"
    holder.succeed()
    # Admitted, then aborted: an exception leaving the block while the event
    # is set records cancelled, not failed.
    stop = threading.Event()
    with pytest.raises(RuntimeError):
        with ledger.activity(service="hcancel", provider="capped", cancel=stop) as call:
            stop.set()
            raise RuntimeError("the provider call saw the event and gave up")
    assert ledger.get_activity(call.id)["state"] == "cancelled"
    assert counts(ledger, lane) == EMPTY


class Scripted(httpx.HTTPTransport):
    """Answers from `answers` first, then passes requests on to the server."""

    def __init__(self):
        super().__init__()
        self.answers = []
        self.seen = 0
        self.keys = []

    def handle_request(self, request):
        self.seen += 1
        self.keys.append(request.headers.get("idempotency-key"))
        if self.answers:
            status, body = self.answers.pop(0)
            return httpx.Response(status, content=body.encode(), request=request)
        return super().handle_request(request)


def test_a_begin_is_retried_with_its_key_and_a_registration_only_when_the_server_handled_nothing(server):
    scripted = Scripted()
    with Ledger(server.url, token=TOKEN, transport=scripted, backoff=0.005) as ledger:
        body = lambda code: json.dumps({"error": {"code": code, "message": "at a limit"}})
        scripted.answers = [(503, body("unavailable")), (408, body("request_timeout")), (502, "bad gateway")]
        a = ledger.begin(service="retry", provider="p")
        assert a.record["state"] == "waiting"
        assert scripted.seen == 4, "three refusals, then the begin"
        assert len(set(scripted.keys)) == 1, "the same key each time"
        scripted.seen = 0
        scripted.answers = [(502, "bad gateway")]  # a proxy's: the owner may have been registered
        with pytest.raises(UnavailableError) as info:
            ledger.register_owner("retry-owner", ttl=5)
        assert info.value.from_server is False
        assert scripted.seen == 1
        a.cancel()


def test_a_dead_owners_slot_comes_back(server):
    lane = "owner::capped"
    with Ledger(server.url, token=TOKEN) as dying, Ledger(server.url, token=TOKEN) as other:
        lease = dying.join_as_owner("py-dying-worker", ttl=0.3)
        held = dying.begin(service="owner", provider="capped")
        held.admit(max_wait=5)
        assert held.record["ownerId"] == lease.id
        lease.stop()  # the process "dies": no renewals, no settle
        started = time.monotonic()
        with other.activity(service="owner", provider="capped", max_wait=5):
            assert time.monotonic() - started < 3
            dead = other.get_activity(held.id)
            assert dead["state"] == "reaped"
            assert dead["reapReason"] == "owner-lost"
            assert dead["disposition"] == "unsettled"
        late = held.succeed()  # the dead process's late settle is absorbed
        assert late["state"] == "reaped" and late["lateSettle"] is True
        assert counts(other, lane) == EMPTY


def test_a_lease_renews_tags_records_and_release_cancels_them(server):
    with Ledger(server.url, token=TOKEN) as ledger:
        with ledger.join_as_owner("py-worker", ttl=0.3) as lease:
            a = ledger.begin(service="lease", provider="p")
            assert a.record["ownerId"] == lease.id
            time.sleep(0.9)  # three TTLs: alive only if renewed
            assert not lease.lost
            assert a.refresh()["state"] == "waiting"
        owner = lease.release()  # twice is harmless
        assert owner["state"] == "released"
        assert owner["cancelledRecords"] == 1
        assert a.refresh()["state"] == "cancelled"
        assert ledger.owner_id is None


def test_sigterm_releases_the_lease_then_terminates(server, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import json, time
        from inflight_ledger import Ledger
        ledger = Ledger({server.url!r}, token={TOKEN!r})
        lease = ledger.join_as_owner("py-sigterm", ttl=30, release_on_signals=True)
        call = ledger.begin(service="sigterm", provider="p")
        print(json.dumps({{"owner": lease.id, "activity": call.id}}), flush=True)
        time.sleep(30)
    """))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    ids = json.loads(child.stdout.readline())
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM
    with Ledger(server.url, token=TOKEN) as ledger:
        assert ledger.get_activity(ids["activity"])["state"] == "cancelled"
        owners = {o["ownerId"]: o for o in ledger.snapshot()["owners"]}
        assert owners[ids["owner"]]["state"] == "released"


def test_a_lease_stops_renewing_once_its_client_is_closed_and_a_late_refusal_is_no_loss(server):
    class Counting(httpx.HTTPTransport):
        renewals = 0
        held: "threading.Event | None" = None
        under_way = threading.Event()

        def handle_request(self, request):
            if request.url.path.endswith("/renew"):
                Counting.renewals += 1
                if self.held is not None:
                    self.under_way.set()
                    self.held.wait(5)  # answered after the release below
            return super().handle_request(request)

    transport = Counting()
    lost = []
    ledger = Ledger(server.url, token=TOKEN, transport=transport)
    lease = ledger.join_as_owner("py-renew-closed", ttl=0.15, on_lost=lost.append)
    transport.held = threading.Event()
    assert transport.under_way.wait(5), "a renewal under way"
    lease.release()
    transport.held.set()
    lease._thread.join(5)
    assert not lease._thread.is_alive()
    assert (lease.lost, lost) == (False, []), "released, not lost"

    other = Ledger(server.url, token=TOKEN, transport=Counting())
    kept = other.join_as_owner("py-renew-closed-2", ttl=0.15)
    other.close()
    time.sleep(0.2)
    Counting.renewals = 0
    time.sleep(0.3)
    assert Counting.renewals == 0, "no renewal tried on a closed client"
    assert not kept._thread.is_alive()
    ledger.close()


def test_a_lease_that_cannot_set_its_signal_handler_leaves_nothing_renewing(server):
    with Ledger(server.url, token=TOKEN) as ledger:
        caught = []
        renewing = {t for t in threading.enumerate() if t.name.startswith("inflight-lease-")}

        def off_the_main_thread():
            try:
                ledger.join_as_owner("py-no-signals", ttl=0.15, release_on_signals=True)
            except ValueError as err:
                caught.append(err)

        worker = threading.Thread(target=off_the_main_thread)
        worker.start()
        worker.join()
        assert len(caught) == 1
        assert {t for t in threading.enumerate() if t.name.startswith("inflight-lease-")} <= renewing


class Partition(httpx.HTTPTransport):
    """Fails every renew while `cut` is set, as a network partition would."""

    cut = False

    def handle_request(self, request):
        if self.cut and request.url.path.endswith("/renew"):
            raise httpx.ConnectError("partitioned", request=request)
        return super().handle_request(request)


def test_a_lease_cut_off_longer_than_its_ttl_is_lost_and_reported_once(server):
    partition = Partition()
    lost = []
    with Ledger(server.url, token=TOKEN, transport=partition, backoff=0.005) as ledger:
        partition.cut = True
        lease = ledger.join_as_owner("py-partitioned", ttl=0.15, on_lost=lost.append)
        time.sleep(0.4)
        assert not lease.lost, "unreachable is not lost: the client keeps trying"
        partition.cut = False
        deadline = time.monotonic() + 2
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.lost
        assert [e.code for e in lost] == ["conflict"]
        assert ledger.owner_id is None, "records are no longer tagged with a lost owner"
