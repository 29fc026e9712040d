"""The example against the real server and a stub provider (a tiny local
HTTP server speaking Ollama's /api/embed and OpenAI's /v1/chat/completions),
so it runs with no network. While the calls run, the snapshot the dashboard
reads and /metrics show the lane busy; afterwards, empty."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from conftest import EMPTY, TOKEN, lane_counts
from inflight_ledger import AsyncLedger, Ledger
from ollama_embed import chat, embed

LANE = "knowledge-base::ollama"


class Stub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.concurrent = 0
        self.max_concurrent = 0
        self.fail_next = False
        #: While set, the stub holds every call: the test decides when they finish.
        self.gate = None


@pytest.fixture(scope="module")
def provider():
    stub = Stub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with stub.lock:
                stub.concurrent += 1
                stub.max_concurrent = max(stub.max_concurrent, stub.concurrent)
                fail, stub.fail_next = stub.fail_next, False
            try:
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                gate = stub.gate
                if gate is not None:
                    gate.wait(10)
                time.sleep(5 if body["model"] == "slow" else 0.05)
                if self.path == "/api/embed":
                    answer = {"model": body["model"], "embeddings": [[0.1, 0.2, 0.3, len(body["input"])]]}
                else:
                    answer = {"choices": [{"message": {"role": "assistant", "content": "stub answer"}}]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with stub.lock:
                    stub.concurrent -= 1

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    stub.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield stub
    httpd.shutdown()


async def until(check, timeout=10.0):
    """Polls `check` until it returns something other than None."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value is not None:
            return value
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def metric(server, name, lane):
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text
    service, prov = lane.split("::")
    for line in text.splitlines():
        if line.startswith(f'{name}{{service="{service}",provider="{prov}"}}'):
            return float(line.split()[-1])
    return None


@pytest.mark.asyncio
async def test_embeddings_wait_for_the_lanes_slots_and_the_counts_move(server, provider):
    assert httpx.get(server.url + "/").status_code == 200, "the dashboard is served at /"
    async with AsyncLedger(server.url, token=TOKEN) as ledger, httpx.AsyncClient(timeout=30) as http:
        texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
        provider.gate = threading.Event()
        calls = asyncio.gather(*(embed(ledger, http, t, ollama_url=provider.url) for t in texts))

        async def full():
            c = lane_counts(await ledger.snapshot(), LANE)
            return c if c["executing"] + c["waiting"] == 6 and provider.concurrent == 2 else None

        busy = await until(full)
        assert (busy["executing"], busy["waiting"]) == (2, 4)
        assert await asyncio.to_thread(metric, server, "inflight_lane_executing", LANE) == 2
        assert await asyncio.to_thread(metric, server, "inflight_lane_waiting", LANE) == 4
        provider.gate.set()
        provider.gate = None
        vectors = await calls
        assert [v[3] for v in vectors] == [1, 2, 3, 4, 5, 6]
        assert provider.max_concurrent == 2, "the provider never saw more than the cap"
        assert lane_counts(await ledger.snapshot(), LANE) == EMPTY
        assert await asyncio.to_thread(metric, server, "inflight_lane_executing", LANE) == 0

        # A provider error is recorded `failed`; a cancelled task `cancelled`.
        provider.fail_next = True
        with pytest.raises(httpx.HTTPStatusError):
            await embed(ledger, http, "x", ollama_url=provider.url)
        task = asyncio.ensure_future(embed(ledger, http, "y", ollama_url=provider.url, model="slow"))

        async def working():
            return True if provider.concurrent == 1 else None

        await until(working)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        recent = [r for r in (await ledger.snapshot())["recentCompletions"] if r["service"] == "knowledge-base"]
        assert [r["state"] for r in recent[:2]] == ["cancelled", "failed"]
        assert lane_counts(await ledger.snapshot(), LANE) == EMPTY


def test_an_openai_compatible_chat_call(server, provider):
    with Ledger(server.url, token=TOKEN) as ledger:
        assert chat(ledger, [{"role": "user", "content": "hi"}], base_url=provider.url) == "stub answer"
        done = [r for r in ledger.snapshot()["recentCompletions"] if r["service"] == "assistant"]
        assert done[0]["state"] == "succeeded"
        assert done[0]["priority"] == "interactive"
