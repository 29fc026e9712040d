"""Real clients we did not write, through inflight's proxy.

The official `openai` and `ollama` packages (versions pinned in
requirements.txt) talk to a fake provider (fake_upstream.py) through
`inflight serve`'s /proxy/openai and /proxy/ollama routes. Each call must
work as it would against the provider, and leave in the ledger a record
settled with the usage and the model the provider answered; passing
requests (the model list) must leave none; a lane's cap must hold the
upstream to that many calls at once.

`INFLIGHT_BIN` names the server's binary. inflight's own API is read with
urllib, so that nothing but the two clients under test speaks HTTP for
them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import ollama
import openai
import pytest

import fake_upstream
from fake_upstream import REPLY, REPLY_TOKENS, FakeUpstream, embedding_of

OPENAI_CHAT_MODEL = "gpt-4o-mini"
OPENAI_EMBEDDING_MODEL = "text-embedding-3-small"
OLLAMA_CHAT_MODEL = "llama3.2"
OLLAMA_EMBEDDING_MODEL = "nomic-embed-text"
CAP = 2

# The calls made through the proxy so far, by provider: the snapshot's
# totals are checked against them at the end.
calls_made: Counter[str] = Counter()

# inflight's own API never goes through an HTTP proxy from the environment.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Inflight:
    """A running `inflight serve` and a few reads of its API."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> Any:
        with _direct.open(self.url + path, timeout=10) as answer:
            return json.load(answer)

    def record(self, activity_id: str) -> dict[str, Any]:
        record = self.get(f"/v1/activities/{activity_id}")
        assert isinstance(record, dict)
        return record

    def snapshot(self) -> dict[str, Any]:
        snapshot = self.get("/v1/snapshot")
        assert isinstance(snapshot, dict)
        return snapshot


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    server = FakeUpstream().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def inflight(upstream: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inflight]:
    binary = os.environ.get("INFLIGHT_BIN")
    if not binary:
        pytest.fail("INFLIGHT_BIN must name the inflight binary (e.g. target/debug/inflight)")
    # The clients under test (httpx) would honour an HTTP proxy from the
    # environment; these calls are for 127.0.0.1 only.
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.lower().endswith("_proxy")}
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    work = tmp_path_factory.mktemp("inflight")
    port = free_port()
    config = work / "inflight.toml"
    config.write_text(
        f"""listen = "127.0.0.1:{port}"
store = "sqlite://{work / 'inflight.db'}"

[classes.chat]
deadline = "30s"

[classes.embedding]
deadline = "30s"

[lanes."kb::openai"]
cap = {CAP}

[proxy.openai]
upstream = "http://127.0.0.1:{upstream.port}/v1"
provider = "openai"
service = "kb"

[proxy.ollama]
upstream = "http://127.0.0.1:{upstream.port}"
provider = "ollama"
service = "kb"
"""
    )
    log_path = work / "inflight.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, "serve", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = Inflight(port)
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                pytest.fail(f"inflight serve exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if server.get("/healthz").get("status") == "ok":
                    break
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"inflight serve did not answer /healthz within 15 s:\n{log_path.read_text()}")
            time.sleep(0.05)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.environ.pop("NO_PROXY", None)
        os.environ.update(saved)
        # The server's log, for a failing run (pytest shows it with -rA or on error).
        print(f"--- inflight serve's log ({log_path})\n{Path(log_path).read_text()}")


@pytest.fixture(scope="module")
def openai_client(inflight: Inflight) -> Iterator[openai.OpenAI]:
    # No retries: a failed call must fail the test, not be made again (and
    # counted twice).
    client = openai.OpenAI(
        base_url=f"{inflight.url}/proxy/openai", api_key="sk-test", max_retries=0, timeout=20
    )
    yield client
    client.close()


class OllamaClient:
    """The ollama package's client, and the X-Inflight-Activity-Id of each
    answer it got. The package hands its keyword arguments to httpx.Client;
    a response hook is how it shows an answer's headers."""

    def __init__(self, inflight: Inflight) -> None:
        self.activity_ids: list[str | None] = []
        self.client = ollama.Client(
            host=f"{inflight.url}/proxy/ollama",
            timeout=20,
            event_hooks={"response": [self._seen]},
        )

    def _seen(self, response: Any) -> None:  # an httpx.Response
        self.activity_ids.append(response.headers.get("x-inflight-activity-id"))

    def last_activity_id(self) -> str:
        assert self.activity_ids, "no answer seen"
        activity_id = self.activity_ids[-1]
        assert activity_id, "the answer carries no X-Inflight-Activity-Id"
        return activity_id


@pytest.fixture(scope="module")
def ollama_client(inflight: Inflight) -> Iterator[OllamaClient]:
    client = OllamaClient(inflight)
    yield client
    client.client.close()


def assert_settled(
    record: dict[str, Any], *, provider: str, klass: str, model: str, input_tokens: int, output_tokens: int | None
) -> None:
    """The record of a call the proxy saw through: succeeded, with the
    route's labels, the model the upstream answered and its usage."""
    got = {
        "state": record["state"],
        "success": record["success"],
        "service": record["service"],
        "provider": record["provider"],
        "class": record["class"],
        "model": record["model"],
        "inputTokens": record["inputTokens"],
        "outputTokens": record["outputTokens"],
    }
    assert got == {
        "state": "succeeded",
        "success": True,
        "service": "kb",
        "provider": provider,
        "class": klass,
        "model": model,
        "inputTokens": input_tokens,
        "outputTokens": output_tokens,
    }, record


# -- openai ---------------------------------------------------------------


def test_openai_chat(openai_client: openai.OpenAI, inflight: Inflight) -> None:
    prompt = "Say hello to the ledger please"
    raw = openai_client.chat.completions.with_raw_response.create(
        model=OPENAI_CHAT_MODEL, messages=[{"role": "user", "content": prompt}]
    )
    calls_made["openai"] += 1
    completion = raw.parse()
    assert completion.choices[0].message.content == REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == OPENAI_CHAT_MODEL + fake_upstream.MODEL_SUFFIX
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt.split()), REPLY_TOKENS)

    activity_id = raw.headers.get("x-inflight-activity-id")
    assert activity_id, f"no X-Inflight-Activity-Id among {dict(raw.headers)}"
    record = inflight.record(activity_id)
    assert_settled(
        record,
        provider="openai",
        klass="chat",
        model=OPENAI_CHAT_MODEL + fake_upstream.MODEL_SUFFIX,
        input_tokens=completion.usage.prompt_tokens,
        output_tokens=completion.usage.completion_tokens,
    )
    assert record["refined"] is True


def test_openai_chat_stream(openai_client: openai.OpenAI, inflight: Inflight) -> None:
    prompt = "Stream a short greeting"
    stream = openai_client.chat.completions.create(
        model=OPENAI_CHAT_MODEL,
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        stream_options={"include_usage": True},
    )
    calls_made["openai"] += 1
    with stream:
        chunks = list(stream)
        activity_id = stream.response.headers.get("x-inflight-activity-id")
    assert len(chunks) == 1 + REPLY_TOKENS + 1 + 1, chunks  # role, words, finish, usage
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == REPLY
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt.split()), REPLY_TOKENS)

    assert activity_id, "the stream's answer carries no X-Inflight-Activity-Id"
    assert_settled(
        inflight.record(activity_id),
        provider="openai",
        klass="chat",
        model=OPENAI_CHAT_MODEL + fake_upstream.MODEL_SUFFIX,
        input_tokens=len(prompt.split()),
        output_tokens=REPLY_TOKENS,
    )


def test_openai_embeddings(openai_client: openai.OpenAI, inflight: Inflight) -> None:
    # A list of inputs, then a single string. The package asks for base64
    # unless told otherwise, and decodes it: both ways are tried.
    texts = ["the first text to embed", "a second one"]
    raw = openai_client.embeddings.with_raw_response.create(model=OPENAI_EMBEDDING_MODEL, input=texts)
    calls_made["openai"] += 1
    many = raw.parse()
    assert [item.index for item in many.data] == [0, 1]
    assert [item.embedding for item in many.data] == [embedding_of(text) for text in texts]
    assert many.usage.prompt_tokens == fake_upstream.count_words(texts)
    activity_id = raw.headers.get("x-inflight-activity-id")
    assert activity_id
    record = inflight.record(activity_id)
    assert_settled(
        record,
        provider="openai",
        klass="embedding",
        model=OPENAI_EMBEDDING_MODEL + fake_upstream.MODEL_SUFFIX,
        input_tokens=many.usage.prompt_tokens,
        output_tokens=record["outputTokens"],
    )
    assert record["outputTokens"] in (None, 0), record

    one = openai_client.embeddings.create(
        model=OPENAI_EMBEDDING_MODEL, input="just one string", encoding_format="float"
    )
    calls_made["openai"] += 1
    assert [item.embedding for item in one.data] == [embedding_of("just one string")]
    assert one.usage.prompt_tokens == 3


def test_openai_models_list_passes_unrecorded(openai_client: openai.OpenAI, inflight: Inflight) -> None:
    before = inflight.snapshot()["totalActivities"]
    models = openai_client.models.list()
    assert [model.id for model in models] == [OPENAI_CHAT_MODEL, OPENAI_EMBEDDING_MODEL]
    raw = openai_client.models.with_raw_response.list()
    assert raw.status_code == 200
    assert "x-inflight-activity-id" not in raw.headers
    assert inflight.snapshot()["totalActivities"] == before


# -- ollama ---------------------------------------------------------------


def test_ollama_chat(ollama_client: OllamaClient, inflight: Inflight) -> None:
    prompt = "Say hello from ollama"
    response = ollama_client.client.chat(
        model=OLLAMA_CHAT_MODEL, messages=[{"role": "user", "content": prompt}], stream=False
    )
    calls_made["ollama"] += 1
    assert response.message.content == REPLY
    assert response.done is True and response.done_reason == "stop"
    assert (response.prompt_eval_count, response.eval_count) == (len(prompt.split()), REPLY_TOKENS)
    record = inflight.record(ollama_client.last_activity_id())
    assert_settled(
        record,
        provider="ollama",
        klass="chat",
        model=OLLAMA_CHAT_MODEL,
        input_tokens=len(prompt.split()),
        output_tokens=REPLY_TOKENS,
    )
    assert record["refined"] is False


def test_ollama_chat_stream(ollama_client: OllamaClient, inflight: Inflight) -> None:
    prompt = "Stream it from ollama as well"
    parts = list(
        ollama_client.client.chat(model=OLLAMA_CHAT_MODEL, messages=[{"role": "user", "content": prompt}], stream=True)
    )
    calls_made["ollama"] += 1
    assert len(parts) == REPLY_TOKENS + 1, parts
    assert "".join(part.message.content or "" for part in parts) == REPLY
    assert [part.done for part in parts] == [False] * REPLY_TOKENS + [True]
    last = parts[-1]
    assert (last.prompt_eval_count, last.eval_count) == (len(prompt.split()), REPLY_TOKENS)
    assert_settled(
        inflight.record(ollama_client.last_activity_id()),
        provider="ollama",
        klass="chat",
        model=OLLAMA_CHAT_MODEL,
        input_tokens=len(prompt.split()),
        output_tokens=REPLY_TOKENS,
    )


def test_ollama_embed(ollama_client: OllamaClient, inflight: Inflight) -> None:
    texts = ["embed me with ollama", "and me"]
    response = ollama_client.client.embed(model=OLLAMA_EMBEDDING_MODEL, input=texts)
    calls_made["ollama"] += 1
    assert [list(vector) for vector in response.embeddings] == [embedding_of(text) for text in texts]
    assert response.prompt_eval_count == fake_upstream.count_words(texts)
    record = inflight.record(ollama_client.last_activity_id())
    assert_settled(
        record,
        provider="ollama",
        klass="embedding",
        model=OLLAMA_EMBEDDING_MODEL,
        input_tokens=fake_upstream.count_words(texts),
        output_tokens=record["outputTokens"],
    )
    assert record["outputTokens"] in (None, 0), record


def test_ollama_list_passes_unrecorded(ollama_client: OllamaClient, inflight: Inflight) -> None:
    before = inflight.snapshot()["totalActivities"]
    listed = ollama_client.client.list()
    assert [model.model for model in listed.models] == ["llama3.2:latest"]
    assert ollama_client.activity_ids[-1] is None
    assert inflight.snapshot()["totalActivities"] == before


# -- the lane's cap, what the upstream saw, the ledger's totals -------------


def test_cap_holds_the_upstream_to_two_at_once(openai_client: openai.OpenAI, inflight: Inflight) -> None:
    calls = 10
    fake_upstream.reset_openai_chat_peak()

    def chat(i: int) -> str | None:
        completion = openai_client.chat.completions.create(
            model=OPENAI_CHAT_MODEL, messages=[{"role": "user", "content": f"call number {i}"}]
        )
        return completion.choices[0].message.content

    with ThreadPoolExecutor(max_workers=calls) as pool:
        answers = list(pool.map(chat, range(calls)))
    calls_made["openai"] += calls
    assert answers == [REPLY] * calls
    # At most the cap at once, and the cap reached: the calls did overlap.
    assert fake_upstream.openai_chat_peak() == CAP


def test_what_the_upstream_saw(upstream: FakeUpstream, inflight: Inflight) -> None:
    seen = fake_upstream.requests_seen()
    calls = [(method, path, headers) for method, path, headers in seen if method == "POST"]
    assert len(calls) == sum(calls_made.values())
    for method, path, headers in seen:
        assert not [name for name in headers if name.startswith("x-inflight-")], (method, path, headers)
    for _, path, headers in calls:
        assert headers.get("accept-encoding") == "identity", (path, headers)
        if path.startswith("/v1/"):
            assert headers.get("authorization") == "Bearer sk-test", (path, headers)
    paths = {path for _, path, _ in seen}
    assert paths <= {"/v1/chat/completions", "/v1/embeddings", "/v1/models", "/api/chat", "/api/embed", "/api/tags"}


def test_the_ledger_adds_up(inflight: Inflight) -> None:
    # Last in this file: every call above has been made and settled.
    snapshot = inflight.snapshot()
    totals = {
        name: snapshot[name]
        for name in ("totalActivities", "totalSucceeded", "totalFailed", "totalCancelled", "totalInFlight")
    }
    made = sum(calls_made.values())
    assert totals == {
        "totalActivities": made,
        "totalSucceeded": made,
        "totalFailed": 0,
        "totalCancelled": 0,
        "totalInFlight": 0,
    }, snapshot
    lanes = snapshot["nativeAdmission"]
    for provider, count in calls_made.items():
        if count == 0:
            continue
        lane = lanes[f"kb::{provider}"]
        assert (lane["executing"], lane["waiting"]) == (0, 0), lane
        if provider == "openai":
            assert lane["cap"] == CAP, lane
