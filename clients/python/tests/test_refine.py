"""Refining a record's model: ``refine(model)`` on ``Activity`` and
``AsyncActivity``, which is what the body of ``with ledger.activity(...) as
call:`` (and ``async with``) holds. First the request itself, against a
scripted transport (no server); then the rules, against the real server."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import TOKEN
from inflight_ledger import (
    Activity,
    AsyncActivity,
    AsyncLedger,
    ConflictError,
    InvalidRequestError,
    Ledger,
    Lifecycle,
    NotFoundError,
)

ID = "01939b1c-0000-7000-8000-00000000beef"
GHOST = "01939b1c-0000-7000-8000-000000000000"


def record(**fields):
    """A record as the server answers it (without ``refined`` unless given, as an older server)."""
    base = {
        "activityId": ID, "service": "kb", "provider": "ollama", "class": "embedding",
        "operationStage": "unknown", "model": "unknown", "priority": "unknown", "admission": "queued",
        "state": "executing", "disposition": None, "reapReason": None, "ownerId": None,
        "enqueuedAt": "2026-01-01T00:00:00.000Z", "startedAt": "2026-01-01T00:00:00.000Z",
        "completedAt": None, "reapedAt": None, "deadlineMs": 300000,
        "reapableAt": "2026-01-01T00:20:00.000Z", "queueWaitMs": 0, "executionMs": None,
        "success": None, "failureStage": None, "lateSettle": False,
    }
    base.update(fields)
    return base


def server_error(status, code):
    return httpx.Response(status, json={"error": {"code": code, "message": f"said {code}"}})


class Script:
    """Answers each request with the next function of ``answers`` (given the
    request and its JSON body), recording ``(method, path, body)``."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.seen = []

    def __call__(self, request):
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.method, request.url.path, body))
        assert self.answers, f"unscripted request {request.method} {request.url.path}"
        return self.answers.pop(0)(request, body)

    def paths(self):
        return [f"{m} {p.replace(ID, '{id}')}" for m, p, _ in self.seen]


def scripted_ledger(script):
    return Ledger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(script))


def scripted_async_ledger(script):
    return AsyncLedger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(script))


def refined_answer(request, body):
    return httpx.Response(200, json=record(model=body["model"], refined=True))


def drop(request, body):
    raise httpx.ReadError("connection reset", request=request)


# ---- the request, scripted ---------------------------------------------


def test_refine_posts_the_model_and_keeps_the_answer_as_the_record():
    script = Script(refined_answer)
    with scripted_ledger(script) as ledger:
        call = Activity(ledger, record(model="auto"))
        answer = call.refine("llama3.1:8b")
    assert script.seen == [("POST", f"/v1/activities/{ID}/refine", {"model": "llama3.1:8b"})]
    assert answer["model"] == "llama3.1:8b" and answer["refined"] is True
    assert call.record is answer


def test_an_older_servers_record_without_refined_is_taken_as_it_is():
    script = Script(lambda request, body: httpx.Response(200, json=record()))
    with scripted_ledger(script) as ledger:
        got = ledger.get_activity(ID)
    assert "refined" not in got
    assert got.get("refined", False) is False


def test_refine_is_retried_after_no_answer_and_a_proxys_5xx():
    script = Script(
        drop,
        lambda request, body: httpx.Response(502, text="bad gateway"),
        lambda request, body: server_error(500, "internal"),
        refined_answer,
    )
    with scripted_ledger(script) as ledger:
        answer = Activity(ledger, record()).refine("gpt-4o-mini")
    assert answer["model"] == "gpt-4o-mini"
    assert [b for _, _, b in script.seen] == [{"model": "gpt-4o-mini"}] * 4, "the same request each time"


@pytest.mark.parametrize("status,code,error", [
    (409, "conflict", ConflictError),
    (404, "not_found", NotFoundError),
    (400, "invalid_request", InvalidRequestError),
])
def test_a_refusal_is_typed_and_never_retried(status, code, error):
    script = Script(lambda request, body: server_error(status, code))
    with scripted_ledger(script) as ledger:
        with pytest.raises(error) as info:
            Activity(ledger, record()).refine("m")
    assert info.value.code == code and info.value.status == status
    assert str(info.value).startswith("POST /v1/activities/{id}/refine: ")
    assert len(script.seen) == 1


@pytest.mark.parametrize("direct", [False, True])
def test_the_block_holds_the_handle_which_refines_the_record_it_settles(direct):
    script = Script(
        lambda request, body: httpx.Response(
            201, json=record(state="executing" if direct else "waiting", admission=body.get("admission", "queued"))
        ),
        *([] if direct else [lambda request, body: httpx.Response(200, json=record())]),
        refined_answer,
        lambda request, body: httpx.Response(
            200, json=record(model="qwen2.5:7b", refined=True, state="succeeded", success=True)
        ),
    )
    settled = []
    hooks = Lifecycle(on_settled=settled.append)
    with scripted_ledger(script) as ledger:
        block = (ledger.observe_unqueued(service="kb", provider="ollama", lifecycle=hooks) if direct
                 else ledger.activity(service="kb", provider="ollama", lifecycle=hooks))
        with block as call:
            assert call.refine("qwen2.5:7b")["model"] == "qwen2.5:7b"
    assert script.paths() == [
        "POST /v1/activities",
        *([] if direct else ["POST /v1/activities/{id}/start"]),
        "POST /v1/activities/{id}/refine",
        "POST /v1/activities/{id}/settle",
    ]
    assert settled[0]["model"] == "qwen2.5:7b"


@pytest.mark.asyncio
async def test_async_refine_posts_the_model_retries_and_types_a_refusal():
    script = Script(drop, refined_answer, lambda request, body: server_error(409, "conflict"))
    async with scripted_async_ledger(script) as ledger:
        call = AsyncActivity(ledger, record(model="auto"))
        answer = await call.refine("llama3.1:8b")
        assert answer["model"] == "llama3.1:8b" and call.record is answer
        with pytest.raises(ConflictError):
            await call.refine("llama3.1:8b")
    assert script.seen == [("POST", f"/v1/activities/{ID}/refine", {"model": "llama3.1:8b"})] * 3


@pytest.mark.asyncio
async def test_the_async_block_holds_the_handle_which_refines_the_record_it_settles():
    script = Script(
        lambda request, body: httpx.Response(201, json=record(state="waiting")),
        lambda request, body: httpx.Response(200, json=record()),
        refined_answer,
        lambda request, body: httpx.Response(200, json=record(model="m", refined=True, state="succeeded")),
    )
    async with scripted_async_ledger(script) as ledger:
        async with ledger.activity(service="kb", provider="ollama") as call:
            assert (await call.refine("m"))["refined"] is True
        assert call.record["state"] == "succeeded" and call.record["model"] == "m"
    assert script.paths()[2:] == ["POST /v1/activities/{id}/refine", "POST /v1/activities/{id}/settle"]


# ---- the rules, against the real server ----------------------------------


def calls_by_model(snapshot, service):
    """The calls the snapshot's aggregates count for ``service``, by model (none left out but zeros)."""
    calls = {}
    for a in snapshot["aggregates"]:
        if a["service"] == service:
            calls[a["model"]] = calls.get(a["model"], 0) + a["calls"]
    return {model: n for model, n in calls.items() if n}


@pytest.fixture
def ledger(server):
    with Ledger(server.url, token=TOKEN) as l:
        yield l


def test_inside_a_block_a_refinement_replaces_the_model_and_the_call_counts_under_it(ledger):
    with ledger.activity(service="refine-block", provider="ollama", class_="chat", model="auto") as call:
        assert call.record["model"] == "auto"
        assert call.record["refined"] is False, "a record not refined says so"
        answer = call.refine("llama3.1:8b")
        assert answer["model"] == "llama3.1:8b" and answer["refined"] is True
        assert answer["state"] == "executing"
    done = ledger.get_activity(call.id)
    assert done["state"] == "succeeded"
    assert done["model"] == "llama3.1:8b" and done["refined"] is True
    assert calls_by_model(ledger.snapshot(limit=1000), "refine-block") == {"llama3.1:8b": 1}
    # A call with no queue, begun with no model, too.
    with ledger.observe_unqueued(service="refine-direct", provider="openai") as direct:
        direct.refine("gpt-4o-mini")
    assert ledger.get_activity(direct.id)["model"] == "gpt-4o-mini"


def test_the_same_model_again_changes_nothing_and_a_different_one_folds_to_unknown(ledger):
    call = ledger.begin(service="refine-fold", provider="ollama", model="auto")
    assert call.record["state"] == "waiting"
    assert call.refine("llama3.1:8b")["model"] == "llama3.1:8b", "a waiting record can be refined"
    assert call.refine("llama3.1:8b")["model"] == "llama3.1:8b"
    folded = call.refine("llama3.1:70b")
    assert folded["model"] == "unknown" and folded["refined"] is True
    assert call.refine("llama3.1:8b")["model"] == "unknown", "no way back"
    call.start()
    call.succeed()
    with ledger.activity(service="refine-fold", provider="ollama") as block:
        block.refine("a")
        block.refine("b")
    assert ledger.get_activity(block.id)["model"] == "unknown"
    assert calls_by_model(ledger.snapshot(limit=1000), "refine-fold") == {"unknown": 2}


def test_refining_an_ended_record_is_a_conflict_and_an_empty_model_is_refused(ledger):
    settled = ledger.begin(service="refine-ended", provider="p", model="m")
    settled.start()
    settled.succeed()
    with pytest.raises(ConflictError) as info:
        settled.refine("other")
    assert info.value.status == 409
    cancelled = ledger.begin(service="refine-ended", provider="p")
    cancelled.cancel("gave up")
    with pytest.raises(ConflictError):
        cancelled.refine("m")
    assert settled.refresh()["model"] == "m", "a refused refinement changed nothing"
    with ledger.activity(service="refine-ended", provider="p") as call:
        pass
    with pytest.raises(ConflictError):
        call.refine("late")  # the block settled it on its way out
    with pytest.raises(NotFoundError):
        Activity(ledger, dict(settled.record, activityId=GHOST)).refine("m")
    live = ledger.begin(service="refine-ended", provider="p")
    with pytest.raises(InvalidRequestError, match="model"):
        live.refine("  ")  # a refinement must name a model
    # Kept like a begin's model: an endpoint (or a key) where the model belongs is not.
    assert live.refine("http://10.0.0.1:11434")["model"] == "redacted"
    live.cancel()


class DropFirstRefineAnswer(httpx.HTTPTransport):
    """Passes every request on; the first refine reaches the server, but its answer is lost."""

    def __init__(self):
        super().__init__()
        self.refines = []

    def handle_request(self, request):
        response = super().handle_request(request)
        if request.url.path.endswith("/refine"):
            self.refines.append(json.loads(request.content)["model"])
            if len(self.refines) == 1:
                response.read()
                response.close()
                raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response


def test_a_refinement_whose_answer_was_lost_is_sent_again_harmlessly(server, ledger):
    transport = DropFirstRefineAnswer()
    with Ledger(server.url, token=TOKEN, transport=transport, backoff=0.005) as lossy:
        with lossy.activity(service="refine-lossy", provider="ollama", model="auto") as call:
            answer = call.refine("mistral:7b")
            assert answer["model"] == "mistral:7b", "the retry found it refined, not folded"
    assert transport.refines == ["mistral:7b", "mistral:7b"], "sent twice: the first answer was lost"
    done = ledger.get_activity(call.id)
    assert done["state"] == "succeeded" and done["model"] == "mistral:7b" and done["refined"] is True
    assert calls_by_model(ledger.snapshot(limit=1000), "refine-lossy") == {"mistral:7b": 1}


class AsyncDropFirstRefineAnswer(httpx.AsyncHTTPTransport):
    def __init__(self):
        super().__init__()
        self.refines = []

    async def handle_async_request(self, request):
        response = await super().handle_async_request(request)
        if request.url.path.endswith("/refine"):
            self.refines.append(json.loads(request.content)["model"])
            if len(self.refines) == 1:
                await response.aread()
                await response.aclose()
                raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response


@pytest.mark.asyncio
async def test_async_refinement_in_a_block_folds_conflicts_and_survives_a_lost_answer(server):
    transport = AsyncDropFirstRefineAnswer()
    async with AsyncLedger(server.url, token=TOKEN, transport=transport, backoff=0.005) as ledger:
        async with ledger.activity(service="arefine", provider="ollama", model="auto") as call:
            answer = await call.refine("qwen2.5:7b")
            assert answer["model"] == "qwen2.5:7b" and answer["refined"] is True
            assert transport.refines == ["qwen2.5:7b", "qwen2.5:7b"], "sent twice: the first answer was lost"
            assert (await call.refine("qwen2.5:7b"))["model"] == "qwen2.5:7b"
            assert (await call.refine("qwen2.5:14b"))["model"] == "unknown"
        done = await ledger.get_activity(call.id)
        assert done["state"] == "succeeded" and done["model"] == "unknown"
        with pytest.raises(ConflictError):
            await call.refine("qwen2.5:7b")
        assert calls_by_model(await ledger.snapshot(limit=1000), "arefine") == {"unknown": 1}
