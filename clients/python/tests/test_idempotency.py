"""Idempotent begins: every begin carries a fresh ``Idempotency-Key`` (a
random UUID), is retried with that key after a lost answer or a 5xx, and is
made anew with a new key once its answer is known (lane_full, a record that
ended). First the requests, against a scripted transport (no server); then
against the real server, whose repeat answers the record the first made."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from conftest import TOKEN, lane_counts
from inflight_ledger import (
    AsyncLedger,
    ConflictError,
    IdempotencyConflictError,
    InflightError,
    InvalidRequestError,
    LaneFullError,
    Ledger,
    UnavailableError,
    WaitCancelledError,
    WaitTimeoutError,
)

ID = "01939b1c-0000-7000-8000-0000000000a1"
OTHER = "01939b1c-0000-7000-8000-0000000000a2"
UUID_V4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def record(**fields):
    """A record as the server answers it (``waiting`` unless told)."""
    base = {
        "activityId": ID, "service": "kb", "provider": "ollama", "class": "embedding",
        "operationStage": "unknown", "model": "unknown", "priority": "unknown", "admission": "queued",
        "state": "waiting", "disposition": None, "reapReason": None, "ownerId": None,
        "enqueuedAt": "2026-01-01T00:00:00.000Z", "startedAt": None, "completedAt": None,
        "reapedAt": None, "deadlineMs": 300000, "reapableAt": "2026-01-01T00:20:00.000Z",
        "queueWaitMs": None, "executionMs": None, "success": None, "failureStage": None,
        "lateSettle": False, "refined": False,
    }
    base.update(fields)
    return base


def executing(**fields):
    return record(**{"state": "executing", "startedAt": "2026-01-01T00:00:00.000Z", "queueWaitMs": 0, **fields})


def cancelled(**fields):
    """What a repeat answers when the first begin's record has since been cancelled (it never started)."""
    return record(**{"state": "cancelled", "completedAt": "2026-01-01T00:00:01.000Z", **fields})


def answer(status, body, **headers):
    return lambda request, sent: httpx.Response(status, json=body, headers=headers)


def replay(body):
    return answer(200, body, **{"Idempotent-Replayed": "true"})


def server_error(status, code):
    return answer(status, {"error": {"code": code, "message": f"said {code}"}})


def drop(request, sent):
    raise httpx.ReadError("connection reset", request=request)


def time_out(request, sent):
    raise httpx.ReadTimeout("no answer in time", request=request)


def late_drop(seconds):
    def answer(request, sent):
        time.sleep(seconds)
        drop(request, sent)
    return answer


class Script:
    """Answers each request with the next function of ``answers``, recording
    ``{method, path, start, wait, body, key}`` for each."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.seen = []

    def __call__(self, request):
        sent = json.loads(request.content) if request.content else None
        self.seen.append({
            "method": request.method,
            "path": request.url.path.replace(ID, "{id}").replace(OTHER, "{other}"),
            "start": request.url.params.get("start"),
            "wait": request.url.params.get("wait"),
            "body": sent,
            "key": request.headers.get("idempotency-key"),
        })
        assert self.answers, f"unscripted request {request.method} {request.url.path}"
        return self.answers.pop(0)(request, sent)

    def begins(self):
        return [r for r in self.seen if r["method"] == "POST" and r["path"] == "/v1/activities"]


def scripted_ledger(script, **options):
    return Ledger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(script), **options)


def scripted_async_ledger(script, **options):
    return AsyncLedger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(script), **options)


# ---- the requests, scripted ---------------------------------------------


def test_every_begin_carries_a_fresh_uuid4_key_and_nothing_else_carries_one():
    script = Script(
        answer(201, record()),  # begin
        answer(201, executing()),  # begin ?start=now
        answer(201, executing()),  # begin ?start=now&wait=
        answer(201, record()),  # activity: begin
        answer(200, executing()),  #           start
        answer(200, executing(state="succeeded", success=True)),  # settle
        answer(201, executing(admission="direct")),  # observe_unqueued: begin
        answer(200, executing(admission="direct", state="succeeded", success=True)),  # settle
    )
    with scripted_ledger(script) as ledger:
        ledger.begin(service="kb", provider="ollama")
        ledger.begin(service="kb", provider="ollama", start_now=True)
        ledger.begin(service="kb", provider="ollama", start_now=True, wait=0.5)
        with ledger.activity(service="kb", provider="ollama"):
            pass
        with ledger.observe_unqueued(service="kb", provider="ollama"):
            pass
    keys = [r["key"] for r in script.begins()]
    assert len(keys) == 5
    assert all(UUID_V4.match(k) for k in keys), keys
    assert len(set(keys)) == 5, "a new key for each begin"
    assert all(r["key"] is None for r in script.seen if r["path"] != "/v1/activities")


@pytest.mark.parametrize("options", [{}, {"start_now": True}, {"start_now": True, "wait": 0.04}])
def test_a_begin_whose_answer_was_lost_is_sent_again_with_the_same_key_body_and_query(options):
    script = Script(drop, time_out, replay(executing()))
    with scripted_ledger(script) as ledger:
        call = ledger.begin(service="kb", provider="ollama", model="m", **options)
    assert call.id == ID
    first, *again = script.seen
    assert len(again) == 2
    assert UUID_V4.match(first["key"])
    assert all(r == first for r in again), "the same request: key, body, query"
    assert first["start"] == ("now" if options else None)
    assert first["wait"] == ("40ms" if "wait" in options else None)


def test_a_5xx_is_retried_with_the_same_key():
    script = Script(
        lambda request, sent: httpx.Response(502, text="bad gateway"),
        server_error(500, "internal"),
        server_error(503, "unavailable"),
        answer(201, record()),
    )
    with scripted_ledger(script) as ledger:
        assert ledger.begin(service="kb", provider="ollama").record["state"] == "waiting"
    assert len(script.seen) == 4
    assert all(r == script.seen[0] for r in script.seen), "the same request each time"


def test_after_lane_full_the_next_begin_has_a_new_key():
    full = answer(429, {"error": {"code": "lane_full", "message": "full"}}, **{"Retry-After": "1"})
    script = Script(full, full, answer(201, executing()))
    with scripted_ledger(script) as ledger:
        with pytest.raises(LaneFullError):
            ledger.begin(service="kb", provider="ollama", start_now=True)
        assert len(script.seen) == 1, "a 429 is an answer: not retried"
        with pytest.raises(LaneFullError):
            ledger.begin(service="kb", provider="ollama", start_now=True, wait=0.02)
        assert ledger.begin(service="kb", provider="ollama", start_now=True, wait=0.02).record["state"] == "executing"
    assert len({r["key"] for r in script.seen}) == 3, "each begin after a lane_full has its own key"


def test_idempotency_conflict_is_typed_and_never_retried_and_the_block_does_not_run():
    script = Script(server_error(409, "idempotency_conflict"), server_error(409, "idempotency_conflict"))
    with scripted_ledger(script) as ledger:
        with pytest.raises(IdempotencyConflictError) as info:
            ledger.begin(service="kb", provider="ollama")
        err = info.value
        assert isinstance(err, InflightError) and not isinstance(err, ConflictError)
        assert err.code == "idempotency_conflict" and err.status == 409 and err.from_server
        assert str(err) == "POST /v1/activities: said idempotency_conflict"
        assert len(script.seen) == 1
        entered = False
        with pytest.raises(IdempotencyConflictError):
            with ledger.activity(service="kb", provider="ollama"):
                entered = True
        assert not entered
    assert len(script.seen) == 2


def test_a_200_replay_is_taken_like_a_201():
    script = Script(
        replay(record()),
        drop,
        replay(record()),
        answer(200, executing()),
        answer(200, executing(state="succeeded", success=True)),
        replay(executing(admission="direct")),
        answer(200, executing(admission="direct", state="succeeded", success=True)),
    )
    with scripted_ledger(script) as ledger:
        assert ledger.begin(service="kb", provider="ollama").record["state"] == "waiting"
        with ledger.activity(service="kb", provider="ollama") as call:
            assert call.id == ID
        with ledger.observe_unqueued(service="kb", provider="ollama") as direct:
            assert direct.id == ID
    assert [f"{r['method']} {r['path']}" for r in script.seen] == [
        "POST /v1/activities",
        "POST /v1/activities",
        "POST /v1/activities",
        "POST /v1/activities/{id}/start",
        "POST /v1/activities/{id}/settle",
        "POST /v1/activities",
        "POST /v1/activities/{id}/settle",
    ]


def test_a_repeat_finding_its_record_ended_begins_anew_and_the_block_never_runs_with_it():
    script = Script(
        drop,
        replay(cancelled(cancelReason="owner released")),
        answer(201, record(activityId=OTHER)),
        answer(200, executing(activityId=OTHER)),
        answer(200, executing(activityId=OTHER, state="succeeded", success=True)),
    )
    ids = []
    with scripted_ledger(script) as ledger:
        with ledger.activity(service="kb", provider="ollama") as call:
            ids.append(call.id)
            assert call.record["state"] == "executing"
    assert ids == [OTHER], "the block ran once, with the record begun anew"
    first, repeat, anew = script.begins()
    assert repeat["key"] == first["key"]
    assert anew["key"] != first["key"] and UUID_V4.match(anew["key"])
    assert anew["body"] == first["body"], "the same begin, under a new key"
    assert [r["path"] for r in script.seen[3:]] == ["/v1/activities/{other}/start", "/v1/activities/{other}/settle"]
    # The handle's begin and a direct block do the same.
    again = Script(drop, replay(cancelled()), answer(201, record(activityId=OTHER)))
    with scripted_ledger(again) as ledger:
        assert ledger.begin(service="kb", provider="ollama").id == OTHER
    direct = Script(
        drop,
        replay(cancelled(admission="direct", startedAt="2026-01-01T00:00:00.000Z")),
        answer(201, executing(activityId=OTHER, admission="direct")),
        answer(200, executing(activityId=OTHER, admission="direct", state="succeeded", success=True)),
    )
    with scripted_ledger(direct) as ledger:
        with ledger.observe_unqueued(service="kb", provider="openai") as call:
            assert call.id == OTHER
    first, repeat, anew = direct.begins()
    assert repeat["key"] == first["key"] != anew["key"]
    assert anew["body"]["admission"] == "direct"


def test_start_now_with_wait_an_ended_record_past_the_wait_is_lane_full_within_it_begun_anew():
    late = Script(late_drop(0.06), replay(cancelled(cancelReason="wait ended")))
    with scripted_ledger(late) as ledger:
        with pytest.raises(LaneFullError) as info:
            ledger.begin(service="kb", provider="ollama", start_now=True, wait=0.05)
    assert info.value.code == "lane_full"
    assert f"did not admit activity {ID} within 0.05 s; it is recorded cancelled" in str(info.value)
    assert len(late.seen) == 2 and late.seen[1]["key"] == late.seen[0]["key"], "no begin anew past the wait"

    early = Script(drop, replay(cancelled()), answer(201, executing(activityId=OTHER)))
    with scripted_ledger(early) as ledger:
        assert ledger.begin(service="kb", provider="ollama", start_now=True, wait=5).id == OTHER
    first, repeat, anew = early.seen
    assert repeat["key"] == first["key"] and repeat["wait"] == "5000ms", "a repeat is the same request"
    assert anew["key"] != first["key"] and anew["start"] == "now"
    assert 0 < int(anew["wait"].removesuffix("ms")) <= 5000, f"the wait that is left: {anew['wait']}"


def test_a_block_past_max_wait_is_wait_timeout_and_with_its_cancel_event_set_wait_cancelled():
    script = Script(late_drop(0.04), replay(cancelled()))
    entered = False
    with scripted_ledger(script) as ledger:
        with pytest.raises(WaitTimeoutError, match=f"activity {ID} was not admitted"):
            with ledger.activity(service="kb", provider="ollama", max_wait=0.03):
                entered = True
    assert not entered
    assert [r["path"] for r in script.seen] == ["/v1/activities"] * 2, "nothing to cancel: the record ended"

    stop = threading.Event()

    def drop_and_set(request, sent):
        stop.set()  # set while the begin is out
        drop(request, sent)

    script = Script(drop_and_set, replay(cancelled()))
    with scripted_ledger(script) as ledger:
        with pytest.raises(WaitCancelledError):
            with ledger.activity(service="kb", provider="ollama", cancel=stop):
                entered = True
    assert not entered
    assert len(script.seen) == 2


def test_begins_made_anew_are_bounded_by_retries():
    script = Script(replay(cancelled()), replay(cancelled()))
    with scripted_ledger(script, retries=1) as ledger:
        with pytest.raises(UnavailableError, match="the record of each of 2 begins ended before its answer arrived"):
            ledger.begin(service="kb", provider="ollama")
    assert len({r["key"] for r in script.seen}) == 2


def test_request_sends_a_given_key_makes_one_when_none_is_given_and_refuses_one_elsewhere():
    script = Script(answer(201, record()), answer(201, record()))
    with scripted_ledger(script) as ledger:
        ledger.request("begin", body={"service": "kb", "provider": "p"}, idempotency_key="my-key-1")
        ledger.request("begin", body={"service": "kb", "provider": "p"})
        with pytest.raises(ValueError, match="takes no Idempotency-Key"):
            ledger.request("get", id=ID, idempotency_key="k")
    assert script.seen[0]["key"] == "my-key-1"
    assert UUID_V4.match(script.seen[1]["key"])


@pytest.mark.asyncio
async def test_async_begins_carry_keys_retry_with_them_and_begin_anew_after_an_ended_record():
    script = Script(
        drop,  # begin: lost
        server_error(500, "internal"),  # the repeat: a 5xx
        replay(cancelled()),  # the repeat again: its record ended meanwhile
        answer(201, record(activityId=OTHER)),  # begun anew
        answer(200, executing(activityId=OTHER)),
        answer(200, executing(activityId=OTHER, state="succeeded", success=True)),
        server_error(409, "idempotency_conflict"),
    )
    async with scripted_async_ledger(script) as ledger:
        async with ledger.activity(service="kb", provider="ollama") as call:
            assert call.id == OTHER
        with pytest.raises(IdempotencyConflictError):
            await ledger.begin(service="kb", provider="ollama")
    keys = [r["key"] for r in script.begins()]
    assert all(UUID_V4.match(k) for k in keys)
    assert keys[0] == keys[1] == keys[2], "the same key after a drop and a 5xx"
    assert len({keys[0], keys[3], keys[4]}) == 3, "a new key begun anew, and for the next begin"

    late = Script(late_drop(0.06), replay(cancelled()))
    async with scripted_async_ledger(late) as ledger:
        with pytest.raises(LaneFullError):
            await ledger.begin(service="kb", provider="ollama", start_now=True, wait=0.05)
    past = Script(late_drop(0.04), replay(cancelled()))
    async with scripted_async_ledger(past) as ledger:
        with pytest.raises(WaitTimeoutError):
            async with ledger.activity(service="kb", provider="ollama", max_wait=0.03):
                pytest.fail("the block ran with an ended record")


# ---- against the real server ----------------------------------------------


def total(ledger):
    return ledger.snapshot(limit=1000)["totalActivities"]


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


class DropFirstBeginAnswer(httpx.HTTPTransport):
    """Passes every request on; the first begin reaches the server, but its
    answer is lost (read, then "connection reset"), after ``on_dropped(answer)``.
    Records each begin's key, status, query and ``Idempotent-Replayed``."""

    def __init__(self, on_dropped=None):
        super().__init__()
        self.on_dropped = on_dropped
        self.begins = []

    def handle_request(self, request):
        response = super().handle_request(request)
        if request.method == "POST" and request.url.path == "/v1/activities":
            response.read()
            response.close()
            self.begins.append({
                "key": request.headers.get("idempotency-key"),
                "status": response.status_code,
                "query": request.url.query,
                "replayed": response.headers.get("idempotent-replayed"),
            })
            if len(self.begins) == 1:
                if self.on_dropped is not None:
                    self.on_dropped(response.json())
                raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response


def lossy(server, transport):
    return Ledger(server.url, token=TOKEN, transport=transport, backoff=0.005)


def begin_then_settle(l):
    call = l.begin(service="idem-lost-begin", provider="p")
    assert call.record["state"] == "waiting"
    call.start()
    call.succeed()
    return call.id


def begin_started(l):
    call = l.begin(service="idem-lost-now", provider="p", start_now=True, wait=1)
    assert call.record["state"] == "executing"
    call.succeed()
    return call.id


def in_a_block(l):
    with l.activity(service="idem-lost-block", provider="p") as call:
        pass
    return call.id


def in_a_direct_block(l):
    with l.observe_unqueued(service="idem-lost-direct", provider="p") as call:
        pass
    return call.id


@pytest.mark.parametrize("way", [begin_then_settle, begin_started, in_a_block, in_a_direct_block])
def test_a_begin_whose_answer_was_lost_is_retried_and_makes_exactly_one_record(server, ledger, way):
    before = total(ledger)
    transport = DropFirstBeginAnswer()
    with lossy(server, transport) as l:
        activity_id = way(l)
    assert total(ledger) == before + 1, "exactly one record"
    first, repeat = transport.begins
    assert repeat["key"] == first["key"] and repeat["query"] == first["query"]
    assert (first["status"], repeat["status"]) == (201, 200), "the repeat is answered 200"
    assert repeat["replayed"] == "true"
    assert ledger.get_activity(activity_id)["state"] == "succeeded"


def test_a_start_now_wait_begin_whose_answer_was_lost_after_it_waited_is_the_same_record(server, ledger):
    lane = "idem-wait::capped"
    holder = ledger.begin(service="idem-wait", provider="capped")
    holder.admit(max_wait=5)
    before = total(ledger)
    transport = DropFirstBeginAnswer()
    result = {}
    with lossy(server, transport) as l:

        def held():
            result["call"] = l.begin(service="idem-wait", provider="capped", start_now=True, wait=10)

        thread = threading.Thread(target=held)
        thread.start()
        deadline = time.monotonic() + 10
        while lane_counts(ledger.snapshot(limit=1000), lane)["waiting"] != 1:
            assert time.monotonic() < deadline, "never waited in line"
            time.sleep(0.01)
        holder.succeed()
        thread.join(15)
        call = result["call"]
        assert call.record["state"] == "executing"
        assert total(ledger) == before + 1, "one record: the repeat did not wait in line again"
        assert [b["status"] for b in transport.begins] == [201, 200]
        assert transport.begins[1]["key"] == transport.begins[0]["key"]
        call.succeed()
    assert lane_counts(ledger.snapshot(limit=1000), lane) == {"executing": 0, "waiting": 0, "inFlight": 0}


def test_a_repeat_after_a_wait_that_ran_out_finds_the_record_cancelled_lane_full(server, ledger):
    lane = "idem-wait::capped"
    holder = ledger.begin(service="idem-wait", provider="capped")
    holder.admit(max_wait=5)
    before = total(ledger)
    transport = DropFirstBeginAnswer()
    with lossy(server, transport) as l:
        with pytest.raises(LaneFullError, match="it is recorded cancelled and holds no place in line"):
            l.begin(service="idem-wait", provider="capped", start_now=True, wait=0.2)
    assert [b["status"] for b in transport.begins] == [429, 200], "the 429 was lost; its repeat answered the record"
    assert transport.begins[1]["key"] == transport.begins[0]["key"]
    assert total(ledger) == before + 1
    assert lane_counts(ledger.snapshot(limit=1000), lane) == {"executing": 1, "waiting": 0, "inFlight": 1}
    holder.succeed()


def test_the_block_never_runs_with_a_record_that_ended_before_its_answer_came(server, ledger):
    first = {}

    def cancel_it(answer):
        first["id"] = answer["activityId"]
        ledger.request("cancel", id=first["id"], body={"reason": "gone"})  # ended by someone else meanwhile

    transport = DropFirstBeginAnswer(cancel_it)
    before = total(ledger)
    ran = []
    with lossy(server, transport) as l:
        with l.activity(service="idem-ended-block", provider="p") as call:
            ran.append(call.id)
            assert call.record["state"] == "executing"
    assert ran == [call.id] and call.id != first["id"], "the block ran with the record begun anew"
    assert [b["status"] for b in transport.begins] == [201, 200, 201]
    keys = [b["key"] for b in transport.begins]
    assert keys[0] == keys[1] != keys[2]
    assert total(ledger) == before + 2, "the cancelled record and the new one"
    assert ledger.get_activity(first["id"])["state"] == "cancelled"
    assert ledger.get_activity(call.id)["state"] == "succeeded"


class Keys(httpx.HTTPTransport):
    def __init__(self):
        super().__init__()
        self.keys = []
        self.sent = 0

    def handle_request(self, request):
        self.sent += 1
        if request.url.path == "/v1/activities":
            self.keys.append(request.headers.get("idempotency-key"))
        return super().handle_request(request)


def test_after_lane_full_the_next_begin_has_a_new_key_and_makes_a_new_record(server, ledger):
    holder = ledger.begin(service="idem-full", provider="capped")
    holder.admit(max_wait=5)
    transport = Keys()
    with Ledger(server.url, token=TOKEN, transport=transport) as l:
        with pytest.raises(LaneFullError):
            l.begin(service="idem-full", provider="capped", start_now=True, wait=0.1)
        holder.succeed()
        call = l.begin(service="idem-full", provider="capped", start_now=True, wait=0.1)
        assert call.record["state"] == "executing", "a new record, admitted (not the first one's, cancelled)"
        call.succeed()
    assert len(transport.keys) == 2 and transport.keys[0] != transport.keys[1]


def test_the_same_key_for_another_request_is_an_idempotency_conflict_never_retried(server, ledger):
    transport = Keys()
    key = f"py-idem-{time.time_ns()}"
    body = {"service": "idem-conflict", "provider": "p", "model": "m"}
    before = total(ledger)
    with Ledger(server.url, token=TOKEN, transport=transport, backoff=0.005) as l:
        first = l.request("begin", body=body, idempotency_key=key)
        again = l.request("begin", body=body, idempotency_key=key)
        assert again["activityId"] == first["activityId"]
        assert total(ledger) == before + 1
        transport.sent = 0
        for changed, query in (({**body, "model": "other"}, None), (body, {"start": "now"})):
            with pytest.raises(IdempotencyConflictError) as info:
                l.request("begin", body=changed, query=query, idempotency_key=key)
            assert info.value.code == "idempotency_conflict" and info.value.status == 409
        assert transport.sent == 2, "each refused once, never retried"
        assert total(ledger) == before + 1, "a refused repeat records nothing"
        # A malformed key is the server's 400, naming the header.
        with pytest.raises(InvalidRequestError, match="(?i)idempotency-key"):
            l.request("begin", body=body, idempotency_key="k" * 256)
    ledger.request("cancel", id=first["activityId"], body={})


class AsyncDropFirstBeginAnswer(httpx.AsyncHTTPTransport):
    def __init__(self):
        super().__init__()
        self.begins = []

    async def handle_async_request(self, request):
        response = await super().handle_async_request(request)
        if request.method == "POST" and request.url.path == "/v1/activities":
            await response.aread()
            await response.aclose()
            self.begins.append((request.headers.get("idempotency-key"), response.status_code))
            if len(self.begins) == 1:
                raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response


@pytest.mark.asyncio
async def test_async_a_begin_whose_answer_was_lost_makes_exactly_one_record(server):
    async with AsyncLedger(server.url, token=TOKEN) as ledger:
        before = (await ledger.snapshot(limit=1000))["totalActivities"]
        for n, start_now in enumerate((False, True), start=1):
            transport = AsyncDropFirstBeginAnswer()
            async with AsyncLedger(server.url, token=TOKEN, transport=transport, backoff=0.005) as lossy_ledger:
                if start_now:
                    call = await lossy_ledger.begin(service="aidem-lost", provider="p", start_now=True, wait=1)
                    await call.succeed()
                else:
                    async with lossy_ledger.activity(service="aidem-lost", provider="p") as call:
                        pass
            (k1, s1), (k2, s2) = transport.begins
            assert k1 == k2 and (s1, s2) == (201, 200)
            assert (await ledger.snapshot(limit=1000))["totalActivities"] == before + n, "exactly one record each"
            assert (await ledger.get_activity(call.id))["state"] == "succeeded"
