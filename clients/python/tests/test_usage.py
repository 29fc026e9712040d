"""Token usage without a server: ``usage_of(answer)`` on every shape it
recognises (JSON mappings and SDK-like objects) and on junk; ``Usage``'s
checks; and, against a scripted transport, the settles that carry
``usage``: by hand, from a block's ``report_usage``/``report_usage_of``,
from ``tracked``, sync and asyncio. ``test_usage_server.py`` runs the same
against the real server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import pytest_asyncio

from inflight_ledger import (
    Activity,
    AsyncActivity,
    AsyncLedger,
    Ledger,
    Usage,
    usage_of,
)

ID = "01939b1c-0000-7000-8000-0000000000d7"


# ---- usage_of: the shapes ------------------------------------------------


class Model:
    """An SDK's answer object: attributes, no mapping (as pydantic models,
    which the openai and google-genai packages return)."""

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)


class Subscriptable(Model):
    """As the ollama package's answers: attributes, and ``answer["field"]`` too."""

    def __getitem__(self, key):
        return getattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key, default)


def openai_chat_json(prompt, completion):
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": 999,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }


def openai_chat_object(prompt, completion):
    return Model(id="chatcmpl-1", choices=[], usage=Model(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=999,
        prompt_tokens_details=Model(cached_tokens=0), completion_tokens_details=None,
    ))


def openai_responses_json(prompt, completion):
    return {"id": "resp_1", "object": "response", "output": [],
            "usage": {"input_tokens": prompt, "output_tokens": completion, "total_tokens": 999,
                      "input_tokens_details": {"cached_tokens": 0}}}


def openai_responses_object(prompt, completion):
    return Model(id="resp_1", output=[], usage=Model(
        input_tokens=prompt, output_tokens=completion, total_tokens=999,
        input_tokens_details=Model(cached_tokens=0),
    ))


def ollama_json(prompt, completion):
    return {"model": "llama3.1", "message": {"role": "assistant", "content": "hi"}, "done": True,
            "total_duration": 5_000_000, "prompt_eval_count": prompt, "eval_count": completion}


def ollama_object(prompt, completion):
    return Subscriptable(model="llama3.1", done=True, message=Subscriptable(content="hi"),
                         prompt_eval_count=prompt, eval_count=completion)


def gemini_object(prompt, completion):
    return Model(candidates=[], text="hi", usage_metadata=Model(
        prompt_token_count=prompt, candidates_token_count=completion,
        total_token_count=999, thoughts_token_count=None,
    ))


def gemini_json(prompt, completion):
    return {"candidates": [{"content": {"parts": [{"text": "hi"}]}}],
            "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": completion,
                              "totalTokenCount": 999}}


SHAPES = [openai_chat_json, openai_chat_object, openai_responses_json, openai_responses_object,
          ollama_json, ollama_object, gemini_object, gemini_json]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_usage_of_reads_each_shape(shape):
    assert usage_of(shape(12, 40)) == Usage(input_tokens=12, output_tokens=40)
    assert usage_of(shape(0, 1_000_000_000)) == Usage(0, 1_000_000_000), "the bounds are counts"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("junk", [-1, True, False, 12.0, 1.5, "12", None, [12], 1_000_000_001, 10**30])
def test_a_junk_count_is_left_out_and_the_other_kept(shape, junk):
    assert usage_of(shape(7, junk)) == Usage(input_tokens=7, output_tokens=None)
    assert usage_of(shape(junk, 9)) == Usage(input_tokens=None, output_tokens=9)
    assert usage_of(shape(junk, junk)) is None


def test_an_ollama_embedding_has_input_tokens_only():
    answer = {"model": "nomic-embed-text", "embeddings": [[0.1, 0.2]], "prompt_eval_count": 8}
    assert usage_of(answer) == Usage(input_tokens=8)
    assert usage_of(Subscriptable(embeddings=[[0.1]], prompt_eval_count=8)) == Usage(input_tokens=8)


def test_a_chat_usage_is_read_as_chat_when_it_has_both_names():
    both = {"usage": {"prompt_tokens": 1, "completion_tokens": 2, "input_tokens": 3, "output_tokens": 4}}
    assert usage_of(both) == Usage(1, 2)
    # A usage with junk under the chat names falls through to the Responses names.
    assert usage_of({"usage": {"prompt_tokens": "x", "input_tokens": 3, "output_tokens": 4}}) == Usage(3, 4)


class Raising:
    """An object whose every attribute raises (a lazy property gone wrong)."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name} for you")


class RaisingMapping(dict):
    def get(self, key, default=None):
        raise KeyError(key)


class Everything:
    """Answers every attribute with itself (a Mock-like object)."""

    def __getattr__(self, name):
        return self


@pytest.mark.parametrize("junk", [
    None, 12, "usage", b"usage", [], (), {}, set(), object(), Usage(1, 2),
    {"usage": None}, {"usage": {}}, {"usage": "12"}, {"usage": [12, 40]},
    {"usage": {"prompt_tokens": -1, "completion_tokens": -2}},
    {"usage": {"prompt_tokens": True, "completion_tokens": False}},
    {"usage": {"input_tokens": 1.0, "output_tokens": 2.5}},
    {"usage": {"prompt_tokens": 2_000_000_000}},
    {"prompt_eval_count": "8", "eval_count": None},
    {"usageMetadata": {"promptTokenCount": "12"}},
    {"usage_metadata": None, "usageMetadata": []},
    Model(usage=None), Model(usage=Model(prompt_tokens=None)), Model(prompt_eval_count=-5),
    Model(usage_metadata=Model(prompt_token_count=float("nan"))),
    Raising(), RaisingMapping(usage={"prompt_tokens": 1}), Everything(), Model(usage=Raising()),
], ids=repr)
def test_usage_of_junk_is_none_and_never_raises(junk):
    assert usage_of(junk) is None


def test_a_mapping_is_read_by_its_keys_not_its_attributes():
    class Answer(dict):
        usage = SimpleNamespace(prompt_tokens=1, completion_tokens=2)

    assert usage_of(Answer()) is None
    assert usage_of(Answer(usage={"prompt_tokens": 3})) == Usage(input_tokens=3)


# ---- Usage: checked when made ----------------------------------------------


class Index:
    """A whole number that is not an int (as numpy's integers): ``__index__``."""

    def __init__(self, n):
        self.n = n

    def __index__(self):
        return self.n


def test_usage_takes_whole_numbers_from_0_to_a_billion():
    assert Usage(0, 1_000_000_000) == Usage(input_tokens=0, output_tokens=1_000_000_000)
    assert Usage() == Usage(None, None)
    made = Usage(Index(5), Index(6))
    assert (made.input_tokens, made.output_tokens) == (5, 6) and type(made.input_tokens) is int
    assert Usage(input_tokens=3).wire() == {"inputTokens": 3}
    assert Usage(output_tokens=0).wire() == {"outputTokens": 0}
    assert Usage().wire() == {}


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens"])
@pytest.mark.parametrize("value, error, words", [
    (-1, ValueError, "must be from 0 to 1000000000, not -1"),
    (1_000_000_001, ValueError, "must be from 0 to 1000000000, not 1000000001"),
    (True, TypeError, "not a bool"),
    (False, TypeError, "not a bool"),
    (12.0, TypeError, "not float"),
    ("12", TypeError, "not str"),
    (Index(-3), ValueError, "not -3"),
])
def test_usage_refuses_anything_else_naming_the_field(field, value, error, words):
    with pytest.raises(error, match=f"usage: invalid {field}: ") as info:
        Usage(**{field: value})
    assert words in str(info.value)


# ---- the settles, scripted ---------------------------------------------------


def record(**fields):
    base = {
        "activityId": ID, "service": "kb", "provider": "openai", "class": "chat",
        "operationStage": "unknown", "model": "unknown", "priority": "unknown", "admission": "queued",
        "state": "executing", "disposition": None, "reapReason": None, "ownerId": None,
        "enqueuedAt": "2026-01-01T00:00:00.000Z", "startedAt": "2026-01-01T00:00:00.000Z",
        "completedAt": None, "reapedAt": None, "deadlineMs": 300000,
        "reapableAt": "2026-01-01T00:20:00.000Z", "queueWaitMs": 0, "executionMs": None,
        "success": None, "failureStage": None, "lateSettle": False,
        "inputTokens": None, "outputTokens": None,
    }
    base.update(fields)
    return base


class Server:
    """A scripted server: a begin answers an executing record (a direct one)
    or a waiting one, a start admits it, a settle or a cancel ends it with
    what it was sent; every request is kept as (path, body)."""

    def __init__(self):
        self.seen = []

    def __call__(self, request):
        body = json.loads(request.content) if request.content else None
        path = request.url.path.replace(ID, "{id}")
        self.seen.append((path, body))
        if path == "/v1/activities":
            direct = body.get("admission") == "direct"
            return httpx.Response(201, json=record(state="executing" if direct else "waiting"))
        if path.endswith("/start"):
            return httpx.Response(200, json=record())
        if path.endswith("/settle"):
            usage = body.get("usage") or {}
            return httpx.Response(200, json=record(
                state="succeeded" if body["success"] else "failed", success=body["success"],
                inputTokens=usage.get("inputTokens"), outputTokens=usage.get("outputTokens"),
            ))
        if path.endswith("/cancel"):
            return httpx.Response(200, json=record(state="cancelled"))
        raise AssertionError(f"unscripted {request.method} {path}")

    def settles(self):
        return [body for path, body in self.seen if path.endswith("/settle")]

    def ends(self):
        return [(path.rsplit("/", 1)[1], body) for path, body in self.seen if path.endswith(("/settle", "/cancel"))]


@pytest.fixture
def scripted():
    server = Server()
    with Ledger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(server)) as ledger:
        yield server, ledger


@pytest_asyncio.fixture
async def ascripted():
    server = Server()
    async with AsyncLedger("http://127.0.0.1:9", backoff=0.001, transport=httpx.MockTransport(server)) as ledger:
        yield server, ledger


def test_succeed_and_fail_send_usage_with_the_settle(scripted):
    server, ledger = scripted
    answer = Activity(ledger, record()).succeed(usage=Usage(input_tokens=12, output_tokens=40))
    assert answer["inputTokens"] == 12 and answer["outputTokens"] == 40
    Activity(ledger, record()).fail("provider", retry_after_ms=1000, usage=Usage(input_tokens=7))
    Activity(ledger, record()).settle(True, usage=Usage(output_tokens=0))
    Activity(ledger, record()).settle(True, usage=Usage())
    Activity(ledger, record()).succeed()
    assert server.settles() == [
        {"success": True, "usage": {"inputTokens": 12, "outputTokens": 40}},
        {"success": False, "failureStage": "provider", "retryAfterMs": 1000, "usage": {"inputTokens": 7}},
        {"success": True, "usage": {"outputTokens": 0}},
        {"success": True},  # a usage with neither count is not sent
        {"success": True},
    ]


@pytest.mark.parametrize("bad", [{"input_tokens": 12}, {"inputTokens": 12}, (12, 40), 12])
def test_a_settle_refuses_a_usage_that_is_not_a_usage_without_a_request(scripted, bad):
    server, ledger = scripted
    call = Activity(ledger, record())
    with pytest.raises(TypeError, match="usage must be an inflight_ledger.Usage, not "):
        call.succeed(usage=bad)
    with pytest.raises(TypeError, match="usage must be an inflight_ledger.Usage"):
        call.report_usage(bad)
    assert server.seen == [], "nothing was sent"
    assert call.record["state"] == "executing" and call.usage is None


def test_the_block_settles_with_the_reported_usage(scripted):
    server, ledger = scripted
    with ledger.activity(service="kb", provider="openai") as call:
        assert call.report_usage(input_tokens=12, output_tokens=40) == Usage(12, 40)
        assert call.usage == Usage(12, 40)
    assert call.record["state"] == "succeeded" and call.record["inputTokens"] == 12
    with ledger.observe_unqueued(service="kb", provider="openai") as direct:
        direct.report_usage(Usage(output_tokens=5))
    with pytest.raises(ValueError):
        with ledger.activity(service="kb", provider="openai") as failing:
            failing.report_usage(input_tokens=3)
            raise ValueError("the provider said no")
    with pytest.raises(KeyboardInterrupt):
        with ledger.activity(service="kb", provider="openai") as aborted:
            aborted.report_usage(input_tokens=3)
            raise KeyboardInterrupt
    assert server.ends() == [
        ("settle", {"success": True, "usage": {"inputTokens": 12, "outputTokens": 40}}),
        ("settle", {"success": True, "usage": {"outputTokens": 5}}),
        ("settle", {"success": False, "failureStage": "provider", "usage": {"inputTokens": 3}}),
        ("cancel", {"reason": "interrupted"}),  # a cancel takes no usage
    ]


def test_reporting_nothing_reports_nothing_and_a_second_report_replaces_the_first(scripted):
    server, ledger = scripted
    with ledger.activity(service="kb", provider="openai") as call:
        assert call.report_usage(usage_of({"no": "usage"})) is None
        assert call.report_usage() is None
        call.report_usage(input_tokens=1, output_tokens=2)
        assert call.report_usage(None) == Usage(1, 2), "None leaves the report as it was"
        call.report_usage(input_tokens=3)
    assert server.settles() == [{"success": True, "usage": {"inputTokens": 3}}]


def test_a_bad_report_raises_in_the_block_naming_the_field_and_sends_nothing(scripted):
    server, ledger = scripted
    call = Activity(ledger, record())
    with pytest.raises(ValueError, match="usage: invalid output_tokens: must be from 0 to 1000000000, not -1"):
        call.report_usage(input_tokens=1, output_tokens=-1)
    with pytest.raises(TypeError, match="usage: invalid input_tokens: must be a whole number, not a bool"):
        call.report_usage(input_tokens=True)
    with pytest.raises(TypeError, match="not both"):
        call.report_usage(Usage(1), input_tokens=2)
    assert call.usage is None and server.seen == []


def test_usage_given_to_the_settle_wins_over_the_reported(scripted):
    server, ledger = scripted
    call = Activity(ledger, record())
    call.report_usage(input_tokens=1, output_tokens=1)
    call.succeed(usage=Usage(input_tokens=2))
    assert server.settles() == [{"success": True, "usage": {"inputTokens": 2}}]


def test_report_usage_of_reads_the_answer_and_an_explicit_report_wins_either_way(scripted):
    server, ledger = scripted
    with ledger.activity(service="kb", provider="openai") as read:
        assert read.report_usage_of(openai_chat_object(12, 40)) == Usage(12, 40)
        assert read.report_usage_of({"no": "usage"}) == Usage(12, 40), "an answer with none changes nothing"
    with ledger.activity(service="kb", provider="openai") as before:
        before.report_usage(input_tokens=1)
        assert before.report_usage_of(openai_chat_json(12, 40)) == Usage(input_tokens=1)
    with ledger.activity(service="kb", provider="openai") as after:
        after.report_usage_of(ollama_json(12, 40))
        after.report_usage(output_tokens=2)
        assert after.report_usage_of(gemini_json(5, 5)) == Usage(output_tokens=2)
    assert [s.get("usage") for s in server.settles()] == [
        {"inputTokens": 12, "outputTokens": 40}, {"inputTokens": 1}, {"outputTokens": 2},
    ]


def test_a_blocks_extractor_replaces_usage_of_and_none_reads_nothing(scripted):
    server, ledger = scripted
    seen = []

    def tokens_header(answer):
        seen.append(answer)
        return Usage(input_tokens=int(answer.headers["x-input-tokens"]))

    answer = httpx.Response(200, headers={"x-input-tokens": "9"}, json={"usage": {"prompt_tokens": 1}})
    with ledger.activity(service="kb", provider="openai", usage_extractor=tokens_header) as custom:
        assert custom.report_usage_of(answer) == Usage(input_tokens=9)
    with ledger.observe_unqueued(service="kb", provider="openai", usage_extractor=tokens_header) as direct:
        direct.report_usage_of(answer)
    with ledger.activity(service="kb", provider="openai", usage_extractor=None) as off:
        assert off.report_usage_of(openai_chat_json(12, 40)) is None
        assert off.usage_extractor is None
    assert seen == [answer, answer]
    assert [s.get("usage") for s in server.settles()] == [{"inputTokens": 9}, {"inputTokens": 9}, None]


@pytest.mark.parametrize("extractor, words", [
    (lambda answer: 1 / 0, "division by zero"),
    (lambda answer: {"input_tokens": 3}, "it returned dict, not a Usage or None"),
    (lambda answer: Usage(input_tokens=-1), "usage: invalid input_tokens"),
])
def test_an_extractor_that_fails_is_warned_about_and_the_call_succeeds_without_usage(scripted, extractor, words):
    server, ledger = scripted
    with pytest.warns(RuntimeWarning, match="the usage extractor") as caught:
        with ledger.activity(service="kb", provider="openai", usage_extractor=extractor) as call:
            assert call.report_usage_of({"any": "answer"}) is None
    assert words in str(caught[0].message) and ID in str(caught[0].message)
    assert server.settles() == [{"success": True}]


def test_reporting_once_the_record_has_ended_raises(scripted):
    server, ledger = scripted
    with ledger.activity(service="kb", provider="openai") as call:
        call.succeed()
    with pytest.raises(RuntimeError, match=f"report_usage: activity {ID} has already ended \\(succeeded\\)"):
        call.report_usage(input_tokens=1)
    with pytest.raises(RuntimeError, match="report_usage_of: activity"):
        call.report_usage_of(openai_chat_json(1, 2))
    assert call.report_usage_of({"no": "usage"}) is None, "an answer with no usage reports nothing"
    assert server.settles() == [{"success": True}]


def test_a_tracked_function_settles_with_the_usage_of_what_it_returns(scripted):
    server, ledger = scripted

    @ledger.tracked(service="kb", provider="openai", class_="chat", model="gpt-4o-mini")
    def chat(prompt, *, tokens):
        """Asks the provider."""
        return openai_chat_json(len(prompt), tokens)

    @ledger.tracked(service="kb", provider="openai", usage_extractor=None)
    def unread():
        return openai_chat_json(1, 1)

    @ledger.tracked({"service": "kb", "provider": "gemini"}, usage_extractor=lambda answer: Usage(output_tokens=answer))
    def custom():
        return 77

    @ledger.tracked(service="kb", provider="openai", failure_stage="queue")
    def failing():
        raise LookupError("no")

    assert chat("hello", tokens=40)["usage"]["completion_tokens"] == 40, "the result is returned as it is"
    assert chat.__name__ == "chat" and chat.__doc__ == "Asks the provider."
    assert unread()["usage"]["prompt_tokens"] == 1
    assert custom() == 77
    with pytest.raises(LookupError):
        failing()
    begins = [body for path, body in server.seen if path == "/v1/activities"]
    assert begins[0] == {"service": "kb", "provider": "openai", "class": "chat", "model": "gpt-4o-mini"}
    assert begins[2]["provider"] == "gemini"
    assert server.settles() == [
        {"success": True, "usage": {"inputTokens": 5, "outputTokens": 40}},
        {"success": True},
        {"success": True, "usage": {"outputTokens": 77}},
        {"success": False, "failureStage": "queue"},
    ]


# ---- asyncio, scripted -------------------------------------------------------


@pytest.mark.asyncio
async def test_async_settles_carry_usage_given_or_reported(ascripted):
    server, ledger = ascripted
    answer = await AsyncActivity(ledger, record()).succeed(usage=Usage(input_tokens=12, output_tokens=40))
    assert answer["inputTokens"] == 12
    await AsyncActivity(ledger, record()).fail("queue", usage=Usage(output_tokens=1))
    async with ledger.activity(service="kb", provider="ollama") as call:
        assert call.report_usage_of(ollama_object(8, 16)) == Usage(8, 16)
    async with ledger.observe_unqueued(service="kb", provider="ollama", usage_extractor=None) as off:
        off.report_usage_of(ollama_object(8, 16))
    async with ledger.activity(service="kb", provider="ollama") as explicit:
        explicit.report_usage(input_tokens=3)
        explicit.report_usage_of(ollama_object(8, 16))
    with pytest.raises(ValueError):
        async with ledger.activity(service="kb", provider="ollama") as failing:
            failing.report_usage(Usage(input_tokens=4))
            raise ValueError("no")
    assert server.settles() == [
        {"success": True, "usage": {"inputTokens": 12, "outputTokens": 40}},
        {"success": False, "failureStage": "queue", "usage": {"outputTokens": 1}},
        {"success": True, "usage": {"inputTokens": 8, "outputTokens": 16}},
        {"success": True},
        {"success": True, "usage": {"inputTokens": 3}},
        {"success": False, "failureStage": "provider", "usage": {"inputTokens": 4}},
    ]


@pytest.mark.asyncio
async def test_async_a_bad_usage_is_refused_without_a_request(ascripted):
    server, ledger = ascripted
    call = AsyncActivity(ledger, record())
    with pytest.raises(TypeError, match="usage must be an inflight_ledger.Usage"):
        await call.settle(True, usage={"input_tokens": 1})
    with pytest.raises(ValueError, match="usage: invalid input_tokens"):
        call.report_usage(input_tokens=1_000_000_001)
    assert server.seen == [] and call.usage is None


@pytest.mark.asyncio
async def test_async_a_tracked_coroutine_settles_with_the_usage_of_what_it_returns(ascripted):
    server, ledger = ascripted

    @ledger.tracked(service="kb", provider="gemini", timeout=5)
    async def generate(prompt):
        """Asks Gemini."""
        return gemini_object(len(prompt), 3)

    @ledger.tracked(service="kb", provider="gemini", usage_extractor=None)
    async def unread():
        return gemini_object(1, 1)

    answer = await generate("four")
    assert answer.usage_metadata.prompt_token_count == 4
    assert generate.__name__ == "generate" and generate.__doc__ == "Asks Gemini."
    await unread()
    assert server.settles() == [{"success": True, "usage": {"inputTokens": 4, "outputTokens": 3}}, {"success": True}]

