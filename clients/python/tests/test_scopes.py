"""Scoped tokens (``[[tokens]]`` in the server's config): a read token reads
and is refused every write; a write token bound to services acts only for
them. A refusal is ``ForbiddenError`` (403 ``forbidden``) with the server's
message, and is never retried."""

from __future__ import annotations

import httpx
import pytest

from conftest import Counting, Server
from inflight_ledger import Activity, AsyncLedger, ForbiddenError, InflightError, Ledger

ADMIN = "py-scopes-admin"  # the config's single `token`: write, every service
READ = "py-scopes-read"
KB = "py-scopes-kb-writer"
TOKENS = f"""
[[tokens]]
token = "{READ}"
scope = "read"

[[tokens]]
token = "{KB}"
scope = "write"
services = ["kb"]
"""


@pytest.fixture(scope="module")
def scoped_server(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("scopes")), {}, ADMIN, config=TOKENS)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def admin(scoped_server):
    with Ledger(scoped_server.url, token=ADMIN) as ledger:
        yield ledger


def assert_forbidden(err, *words):
    assert isinstance(err, ForbiddenError) and isinstance(err, InflightError)
    assert (err.code, err.status, err.from_server) == ("forbidden", 403, True)
    for word in words:
        assert word in str(err)


def test_a_read_token_reads_and_every_write_is_forbidden_never_retried(scoped_server, admin):
    done = admin.begin(service="kb", provider="p")
    done.succeed()
    transport = Counting()
    with Ledger(scoped_server.url, token=READ, retries=3, backoff=0.01, transport=transport) as reader:
        assert reader.snapshot()["status"] == "ok"
        assert reader.get_activity(done.id)["state"] == "succeeded"
        scrape = httpx.get(scoped_server.url + "/metrics", headers={"authorization": f"Bearer {READ}"})
        assert scrape.status_code == 200, "a scrape takes a read token"

        transport.sent.clear()
        ran = False
        with pytest.raises(ForbiddenError) as caught:
            with reader.activity(service="kb", provider="p"):
                ran = True
        assert_forbidden(caught.value, "read")
        assert not ran, "a refused begin runs nothing"
        waiting = admin.begin(service="kb", provider="p")
        handle = Activity(reader, reader.get_activity(waiting.id))
        # start and cancel are idempotent, so a 5xx would be retried; a 403 is not.
        with pytest.raises(ForbiddenError) as caught:
            handle.start()
        assert_forbidden(caught.value, "write")
        with pytest.raises(ForbiddenError):
            handle.cancel()
        with pytest.raises(ForbiddenError):
            reader.reap()
    assert transport.sent == [
        "POST /v1/activities",
        f"GET /v1/activities/{waiting.id}",
        f"POST /v1/activities/{waiting.id}/start",
        f"POST /v1/activities/{waiting.id}/cancel",
        "POST /v1/reap",
    ]
    assert admin.get_activity(waiting.id)["state"] == "waiting", "the refused requests changed nothing"
    waiting.cancel()


def test_a_write_token_bound_to_kb_is_refused_other_services_records(scoped_server, admin):
    transport = Counting()
    with Ledger(scoped_server.url, token=KB, retries=3, backoff=0.01, transport=transport) as kb:
        with kb.activity(service="kb", provider="ollama") as call:
            pass
        assert kb.get_activity(call.id)["state"] == "succeeded"

        transport.sent.clear()
        with pytest.raises(ForbiddenError) as caught:
            with kb.activity(service="assistant", provider="openai"):
                pytest.fail("a refused begin runs nothing")
        assert_forbidden(caught.value, "assistant")
        assert transport.sent == ["POST /v1/activities"], "not retried"

        # Another service's record: kb's token reads it, but can neither
        # start, settle nor cancel it.
        theirs = admin.begin(service="assistant", provider="openai")
        handle = Activity(kb, kb.get_activity(theirs.id))
        with pytest.raises(ForbiddenError) as caught:
            handle.start()
        assert_forbidden(caught.value, "assistant")
        with pytest.raises(ForbiddenError):
            handle.succeed()
        with pytest.raises(ForbiddenError):
            handle.cancel()
    assert admin.get_activity(theirs.id)["state"] == "waiting"
    theirs.cancel()


@pytest.mark.asyncio
async def test_the_async_client_is_refused_the_same(scoped_server):
    async with AsyncLedger(scoped_server.url, token=KB) as kb:
        async with kb.activity(service="kb", provider="ollama") as call:
            pass
        assert (await kb.get_activity(call.id))["state"] == "succeeded"
        with pytest.raises(ForbiddenError, match="assistant"):
            await kb.begin(service="assistant", provider="openai")
    async with AsyncLedger(scoped_server.url, token=READ) as reader:
        with pytest.raises(ForbiddenError, match="read"):
            await reader.begin(service="kb", provider="ollama")
