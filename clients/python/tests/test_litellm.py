"""``inflight_ledger.litellm`` against the real server and the real
``litellm`` package, with no network: LiteLLM's cost map is its local copy
and every call is answered by LiteLLM's ``mock_response`` (``mock_delay``
makes it slow). The SDK wrappers (sync and asyncio) and the proxy's
callback, its hooks called as the proxy calls them. LiteLLM is not
optional here: requirements-dev.txt installs it (Python 3.10 and later),
and its absence fails the module rather than skipping it."""

from __future__ import annotations

import os
import sys

import pytest

if sys.version_info < (3, 10):  # LiteLLM needs 3.10; requirements-dev.txt installs it from there on
    pytest.skip("litellm needs Python 3.10 or later", allow_module_level=True)

# Before litellm is imported: its import would fetch the model cost map.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from datetime import datetime  # noqa: E402
from typing import Any, Dict, Iterator, List  # noqa: E402

import httpx  # noqa: E402
import litellm  # noqa: E402
from litellm.caching.dual_cache import DualCache  # noqa: E402
from litellm.proxy._types import UserAPIKeyAuth  # noqa: E402

from conftest import Server  # noqa: E402
from inflight_ledger import AsyncLedger, InflightError, Ledger, Lifecycle, WaitTimeoutError  # noqa: E402
from inflight_ledger.litellm import (  # noqa: E402
    ACTIVITY_KEY,
    AsyncLiteLLMCalls,
    InflightCallback,
    LiteLLMCalls,
    begin_spec,
    litellm_retry_after_ms,
)

MESSAGES = [{"role": "user", "content": "hello"}]
#: The usage LiteLLM's mock answers report (prompt 10, completion 20).
MOCK_INPUT, MOCK_OUTPUT = 10, 20


@pytest.fixture(scope="module")
def llm_server() -> Iterator[Server]:
    lanes = {
        "svc::openai": 2,
        "llm-fail::openai": 4,  # a lane cools down only with a cap
        "llm-cancel::openai": 1,
        "llm-timeout::openai": 1,
        "llm-proxy::openai": 1,
        "llm-proxy-wait::openai": 1,
    }
    with tempfile.TemporaryDirectory(prefix="inflight-py-") as workdir:
        s = Server(workdir, lanes, None)
        try:
            yield s
        finally:
            s.stop()


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000


def rate_limit(seconds: str) -> litellm.RateLimitError:
    """A provider's 429 as LiteLLM raises it, with its ``Retry-After``."""
    request = httpx.Request("POST", "https://api.openai.com/v1/chat/completions")
    response = httpx.Response(429, headers={"retry-after": seconds}, request=request)
    return litellm.RateLimitError("slow down", "openai", "gpt-4o-mini", response=response)


def in_flight_on(snapshot: Dict[str, Any], lane: str) -> List[Dict[str, Any]]:
    return [r for r in snapshot["inFlight"] if f"{r['service']}::{r['provider']}" == lane]


def test_importing_the_package_does_not_import_litellm():
    code = "import sys, inflight_ledger; assert 'litellm' not in sys.modules, 'litellm was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_begin_spec_from_the_call():
    spec = begin_spec("acompletion", {"model": "openai/gpt-4o-mini", "max_tokens": 64}, service="svc")
    assert spec == {"service": "svc", "provider": "openai", "model": "gpt-4o-mini", "class": "chat", "maxTokens": 64}
    spec = begin_spec("aembedding", {"model": "ollama/nomic-embed-text"}, service="svc", priority="batch")
    assert spec == {"service": "svc", "provider": "ollama", "model": "nomic-embed-text", "class": "embedding",
                    "priority": "batch"}
    meta = {"inflight_service": "kb", "inflight_priority": "interactive", "inflight_class": "rerank"}
    spec = begin_spec("completion", {"model": "gpt-4o-mini", "metadata": meta}, service="svc", priority="batch")
    assert (spec["service"], spec["priority"], spec["class"]) == ("kb", "interactive", "rerank")
    with pytest.raises(ValueError, match="inflight_service"):
        begin_spec("completion", {"model": "gpt-4o-mini"})


def test_retry_after_of_litellm_errors():
    assert litellm_retry_after_ms(rate_limit("2")) == 2000
    # Headers LiteLLM attached rather than a response of its own.
    err = litellm.RateLimitError("slow down", "openai", "gpt-4o-mini")
    err.litellm_response_headers = httpx.Headers({"Retry-After": "3"})
    assert litellm_retry_after_ms(err) == 3000
    assert litellm_retry_after_ms(litellm.RateLimitError("slow down", "openai", "gpt-4o-mini")) is None
    assert litellm_retry_after_ms(ValueError("no")) is None


@pytest.mark.asyncio
async def test_a_cap_of_two_holds_under_ten_concurrent_calls(llm_server):
    settled: List[Dict[str, Any]] = []  # each record as begun
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=settled.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="svc")
        seen: List[int] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                snapshot = await ledger.snapshot()
                lane = snapshot["nativeAdmission"].get("svc::openai")
                if lane is not None:
                    seen.append(lane["executing"])
                await asyncio.sleep(0.02)

        sampler = asyncio.ensure_future(sample())
        answers = await asyncio.gather(*(
            calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response=f"answer {i}",
                              mock_delay=0.3, max_tokens=50)
            for i in range(10)
        ))
        done.set()
        await sampler
        assert [a.choices[0].message.content for a in answers] == [f"answer {i}" for i in range(10)]
        assert seen and max(seen) == 2, f"the lane's executing counts: {seen}"
        assert len(settled) == 10
        for record in settled:
            fresh = await ledger.get_activity(record["activityId"])
            assert fresh["state"] == "succeeded"
            assert (fresh["service"], fresh["provider"], fresh["class"], fresh["model"]) == (
                "svc", "openai", "chat", "gpt-4o-mini")
            assert (fresh["inputTokens"], fresh["outputTokens"], fresh["maxTokens"]) == (MOCK_INPUT, MOCK_OUTPUT, 50)
            assert fresh.get("refined", False) is False, "the answer's model is the begin's"
        snapshot = await ledger.snapshot()
        assert in_flight_on(snapshot, "svc::openai") == []


@pytest.mark.asyncio
async def test_an_error_settles_a_failure_with_the_retry_after(llm_server):
    settled: List[Dict[str, Any]] = []  # each record as begun
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=settled.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="llm-fail")
        with pytest.raises(litellm.InternalServerError):
            await calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response=Exception("boom"))
        record = await ledger.get_activity(settled[-1]["activityId"])
        assert (record["state"], record["failureStage"]) == ("failed", "provider")

        with pytest.raises(litellm.RateLimitError):
            await calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response=rate_limit("2"))
        record = await ledger.get_activity(settled[-1]["activityId"])
        assert (record["state"], record["failureStage"]) == ("failed", "provider")
        lane = (await ledger.snapshot())["nativeAdmission"]["llm-fail::openai"]
        assert lane["coolingUntil"] is not None, "the provider's Retry-After cools the lane"
        assert abs(at(lane["coolingUntil"]) - at(record["completedAt"]) - 2000) <= 5


@pytest.mark.asyncio
async def test_cancelled_tasks_cancel_their_records(llm_server):
    began: List[Dict[str, Any]] = []
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=began.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="llm-cancel")
        running = asyncio.ensure_future(
            calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="slow", mock_delay=30))
        waiting = asyncio.ensure_future(
            calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="slow", mock_delay=30))
        for _ in range(200):
            snapshot = await ledger.snapshot()
            lane = snapshot["nativeAdmission"].get("llm-cancel::openai")
            if lane is not None and (lane["executing"], lane["waiting"]) == (1, 1):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the two calls never were one executing, one waiting")
        waiting.cancel()
        running.cancel()
        for task in (running, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.1)  # the shielded cancels land
        assert len(began) == 2
        for record in began:
            assert (await ledger.get_activity(record["activityId"]))["state"] == "cancelled"
        assert in_flight_on(await ledger.snapshot(), "llm-cancel::openai") == []


@pytest.mark.asyncio
async def test_a_timeout_cancels_the_record(llm_server):
    began: List[Dict[str, Any]] = []
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=began.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="llm-timeout", timeout=0.3)
        with pytest.raises(TimeoutError):
            await calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="slow", mock_delay=30)
        record = await ledger.get_activity(began[-1]["activityId"])
        assert (record["state"], record.get("cancelReason")) == ("cancelled", "timeout")
        assert in_flight_on(await ledger.snapshot(), "llm-timeout::openai") == []


@pytest.mark.asyncio
async def test_aembedding_is_an_embedding(llm_server):
    settled: List[Dict[str, Any]] = []  # each record as begun
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=settled.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="llm-embed", priority="batch")
        await calls.aembedding(model="text-embedding-3-small", input=["hello"], mock_response=[0.1, 0.2])
        record = await ledger.get_activity(settled[-1]["activityId"])
        assert (record["state"], record["class"], record["priority"], record["model"]) == (
            "succeeded", "embedding", "batch", "text-embedding-3-small")
        assert record["inputTokens"] == MOCK_INPUT


def test_sync_completion_and_embedding(llm_server):
    settled: List[Dict[str, Any]] = []  # each record as begun
    with Ledger(llm_server.url, lifecycle=Lifecycle(on_enqueued=settled.append)) as ledger:
        calls = LiteLLMCalls(ledger, service="llm-sync")
        answer = calls.completion(model="openai/gpt-4o-mini", messages=MESSAGES, mock_response="hi",
                                  metadata={"inflight_priority": "interactive"})
        assert answer.choices[0].message.content == "hi"
        record = ledger.get_activity(settled[-1]["activityId"])
        assert (record["state"], record["provider"], record["model"], record["priority"]) == (
            "succeeded", "openai", "gpt-4o-mini", "interactive")
        assert (record["inputTokens"], record["outputTokens"]) == (MOCK_INPUT, MOCK_OUTPUT)

        calls.embedding(model="text-embedding-3-small", input=["hello"], mock_response=[0.1])
        assert ledger.get_activity(settled[-1]["activityId"])["class"] == "embedding"

        with pytest.raises(litellm.RateLimitError):
            calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response="litellm.RateLimitError")
        record = ledger.get_activity(settled[-1]["activityId"])
        assert (record["state"], record["failureStage"]) == ("failed", "provider")

        with pytest.raises(ValueError, match="stream"):
            calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi", stream=True)


def test_the_answers_model_refines_the_record(llm_server):
    settled: List[Dict[str, Any]] = []  # each record as begun
    with Ledger(llm_server.url, lifecycle=Lifecycle(on_enqueued=settled.append)) as ledger:
        calls = LiteLLMCalls(ledger, service="llm-refine")
        answer = {
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
        calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response=answer)
        record = ledger.get_activity(settled[-1]["activityId"])
        assert (record["model"], record["refined"]) == ("gpt-4o-mini-2024-07-18", True)
        assert (record["inputTokens"], record["outputTokens"]) == (3, 4)


# -- the proxy's callback, its hooks called with the shapes the proxy passes


def proxy_request(**metadata: Any) -> Dict[str, Any]:
    """A chat completion request as the proxy hands it to the pre-call hook."""
    return {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 40, "metadata": dict(metadata)}


async def pre_call(callback: InflightCallback, data: Dict[str, Any]) -> Dict[str, Any]:
    out = await callback.async_pre_call_hook(UserAPIKeyAuth(), DualCache(), data, "acompletion")
    assert out is data
    return out


@pytest.mark.asyncio
async def test_proxy_callback_begins_holds_and_settles(llm_server):
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger, service="llm-proxy")
        first = await pre_call(callback, proxy_request(inflight_priority="interactive"))
        first_id = first["metadata"][ACTIVITY_KEY]
        record = await ledger.get_activity(first_id)
        assert (record["state"], record["class"], record["maxTokens"], record["priority"]) == (
            "executing", "chat", 40, "interactive")

        # The lane's cap is 1: the next request is held in the hook.
        second_data = proxy_request()
        second = asyncio.ensure_future(pre_call(callback, second_data))
        await asyncio.sleep(0.3)
        assert not second.done(), "the second request was not held"
        lane = (await ledger.snapshot())["nativeAdmission"]["llm-proxy::openai"]
        assert (lane["executing"], lane["waiting"]) == (1, 1)

        response = await litellm.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        await callback.async_post_call_success_hook(data=first, user_api_key_dict=UserAPIKeyAuth(), response=response)
        record = await ledger.get_activity(first_id)
        assert (record["state"], record["inputTokens"], record["outputTokens"]) == (
            "succeeded", MOCK_INPUT, MOCK_OUTPUT)

        await asyncio.wait_for(second, 5)
        second_id = second_data["metadata"][ACTIVITY_KEY]
        assert (await ledger.get_activity(second_id))["state"] == "executing"
        await callback.async_post_call_failure_hook(
            request_data=second_data, original_exception=rate_limit("1"), user_api_key_dict=UserAPIKeyAuth())
        record = await ledger.get_activity(second_id)
        assert (record["state"], record["failureStage"]) == ("failed", "provider")
        assert callback.open == {}


@pytest.mark.asyncio
async def test_proxy_callback_forgets_a_record_no_hook_settled_once_the_server_reaped_it(llm_server, monkeypatch):
    import inflight_ledger.litellm as module

    now = module._wall_clock()
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger, service="llm-forget")
        lost = (await pre_call(callback, proxy_request()))["metadata"][ACTIVITY_KEY]
        reapable = datetime.fromisoformat(callback.open[lost].record["reapableAt"].replace("Z", "+00:00")).timestamp()
        # Looked over again only after 10 s: before its bound, it is kept.
        monkeypatch.setattr(module, "_wall_clock", lambda: now + 11)
        kept = (await pre_call(callback, proxy_request()))["metadata"][ACTIVITY_KEY]
        assert set(callback.open) == {lost, kept}
        # Ten minutes past its bound (the server reaps it at its next read)
        # and a little more, no hook having settled it: forgotten at the
        # next request, with the one begun just after it.
        monkeypatch.setattr(module, "_wall_clock", lambda: reapable + 600 + 30)
        newest = (await pre_call(callback, proxy_request()))["metadata"][ACTIVITY_KEY]
        assert set(callback.open) == {newest}
        # A hook that comes now settles nothing; the server reaps the record.
        response = await litellm.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        await callback.async_post_call_success_hook(
            data={"metadata": {ACTIVITY_KEY: lost}}, user_api_key_dict=UserAPIKeyAuth(), response=response)
        assert (await ledger.get_activity(lost))["state"] == "executing"
        for bad in (-1, float("nan"), float("inf"), "600", True):
            with pytest.raises(ValueError, match="forget_after must be a number of seconds"):
                InflightCallback(ledger, forget_after=bad)


@pytest.mark.asyncio
async def test_proxy_callback_refuses_past_max_wait_and_cancels(llm_server):
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger, service="llm-proxy-wait", max_wait=0.3)
        holder = await pre_call(callback, proxy_request())
        refused = proxy_request()
        with pytest.raises(Exception) as caught:
            await pre_call(callback, refused)
        try:
            from fastapi import HTTPException
        except ImportError:  # the SDK install: the ledger's own error
            assert isinstance(caught.value, WaitTimeoutError)
        else:
            assert isinstance(caught.value, HTTPException) and caught.value.status_code == 429
            assert isinstance(caught.value.__cause__, WaitTimeoutError)
        assert ACTIVITY_KEY not in refused["metadata"]
        snapshot = await ledger.snapshot()
        assert [r["activityId"] for r in in_flight_on(snapshot, "llm-proxy-wait::openai")] == [
            holder["metadata"][ACTIVITY_KEY]], "the refused request's record is cancelled"

        # A client that went away (the proxy's 499) cancels the record.
        class ClientGone(Exception):
            status_code = 499

        await callback.async_post_call_failure_hook(holder, ClientGone(), UserAPIKeyAuth())
        record = await ledger.get_activity(holder["metadata"][ACTIVITY_KEY])
        assert record["state"] == "cancelled"


@pytest.mark.asyncio
async def test_proxy_callback_settles_a_stream_from_its_logged_success(llm_server):
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger)  # the service from the request's metadata
        data = await pre_call(callback, proxy_request(inflight_service="llm-stream"))
        activity_id = data["metadata"][ACTIVITY_KEY]
        assert (await ledger.get_activity(activity_id))["service"] == "llm-stream"
        # The success event of a stream, as LiteLLM's logging passes it: the
        # request's metadata under litellm_params, the whole answer.
        response = await litellm.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        kwargs = {"model": "gpt-4o-mini", "litellm_params": {"metadata": data["metadata"]}, "stream": True}
        await callback.async_log_success_event(kwargs, response, None, None)
        record = await ledger.get_activity(activity_id)
        assert (record["state"], record["outputTokens"]) == ("succeeded", MOCK_OUTPUT)
        # A second success (the proxy's own hook) finds nothing open: one settle.
        await callback.async_post_call_success_hook(data, UserAPIKeyAuth(), response)
        assert callback.open == {}


@pytest.mark.asyncio
async def test_proxy_callback_with_a_refused_begin(llm_server):
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger, service="not a label")
        with pytest.raises(Exception) as caught:
            await pre_call(callback, proxy_request())
        cause = caught.value if isinstance(caught.value, InflightError) else caught.value.__cause__
        assert isinstance(cause, InflightError) and cause.code == "invalid_request"


# -- trace context


def a_traceparent() -> str:
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


def test_sync_wrappers_send_a_traceparent_given_or_the_current_spans(llm_server):
    from opentelemetry.sdk.trace import TracerProvider

    began: List[Dict[str, Any]] = []
    with Ledger(llm_server.url, lifecycle=Lifecycle(on_enqueued=began.append)) as ledger:
        calls = LiteLLMCalls(ledger, service="llm-trace")
        sent = a_traceparent()
        calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi", traceparent=sent)
        calls.embedding(model="text-embedding-3-small", input=["hello"], mock_response=[0.1], traceparent=sent)
        with TracerProvider().get_tracer("test").start_as_current_span("caller") as span:
            calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        calls.completion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        ctx = span.get_span_context()
        current = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        seen = [ledger.get_activity(r["activityId"]).get("traceparent") for r in began]
        assert seen == [sent, sent, current, None]


@pytest.mark.asyncio
async def test_async_wrappers_send_a_traceparent_given(llm_server):
    began: List[Dict[str, Any]] = []
    async with AsyncLedger(llm_server.url, lifecycle=Lifecycle(on_enqueued=began.append)) as ledger:
        calls = AsyncLiteLLMCalls(ledger, service="llm-trace")
        sent = a_traceparent()
        await calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi", traceparent=sent)
        await calls.aembedding(model="text-embedding-3-small", input=["x"], mock_response=[0.1], traceparent=sent)
        await calls.acompletion(model="gpt-4o-mini", messages=MESSAGES, mock_response="hi")
        seen = [(await ledger.get_activity(r["activityId"])).get("traceparent") for r in began]
        assert seen == [sent, sent, None]


@pytest.mark.asyncio
async def test_proxy_callback_sends_the_served_requests_traceparent_unless_a_span_is_current(llm_server):
    from opentelemetry.sdk.trace import TracerProvider

    def served(traceparent: str) -> Dict[str, Any]:
        data = proxy_request()
        data["proxy_server_request"] = {"url": "http://proxy/v1/chat/completions", "method": "POST",
                                        "headers": {"content-type": "application/json", "Traceparent": traceparent}}
        return data

    async def recorded(ledger: AsyncLedger, callback: InflightCallback, data: Dict[str, Any]) -> Any:
        activity_id = data["metadata"][ACTIVITY_KEY]
        await callback.open.pop(activity_id).cancel("done")
        return (await ledger.get_activity(activity_id)).get("traceparent")

    sent = a_traceparent()
    async with AsyncLedger(llm_server.url) as ledger:
        callback = InflightCallback(ledger, service="llm-trace")
        assert await recorded(ledger, callback, await pre_call(callback, served(sent))) == sent
        # A malformed header is ignored (W3C), not a refused request.
        assert await recorded(ledger, callback, await pre_call(callback, served("00-bogus"))) is None
        assert await recorded(ledger, callback, await pre_call(callback, proxy_request())) is None
        # The proxy's own current span is the parent rather than the caller's.
        with TracerProvider().get_tracer("test").start_as_current_span("proxy") as span:
            data = await pre_call(callback, served(sent))
        ctx = span.get_span_context()
        assert await recorded(ledger, callback, data) == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    async with AsyncLedger(llm_server.url, propagate_trace=False) as quiet:
        callback = InflightCallback(quiet, service="llm-trace")
        assert await recorded(quiet, callback, await pre_call(callback, served(sent))) is None


def test_the_proxy_config_finds_the_callbacks(tmp_path, monkeypatch):
    """``litellm_settings: callbacks:`` names an instance as the proxy
    loads it (``get_instance_fn``): the ready-made one, and one made in a
    module beside config.yaml."""
    from litellm.proxy.types_utils.utils import get_instance_fn

    monkeypatch.setenv("INFLIGHT_LITELLM_SERVICE", "from-env")
    ready = get_instance_fn("inflight_ledger.litellm.proxy_callback")
    assert isinstance(ready, InflightCallback) and ready.service == "from-env"
    assert get_instance_fn("inflight_ledger.litellm.proxy_callback") is ready

    (tmp_path / "inflight_callbacks.py").write_text(
        "from inflight_ledger import AsyncLedger\n"
        "from inflight_ledger.litellm import InflightCallback\n"
        "handler = InflightCallback(AsyncLedger('http://127.0.0.1:7878'), service='assistant', max_wait=30)\n"
    )
    config = tmp_path / "config.yaml"
    config.write_text("litellm_settings:\n  callbacks: inflight_callbacks.handler\n")
    own = get_instance_fn("inflight_callbacks.handler", config_file_path=str(config))
    assert isinstance(own, InflightCallback) and (own.service, own.max_wait) == ("assistant", 30)
