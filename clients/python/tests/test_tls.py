"""The clients over https: a CA made at test time, the real server serving
TLS (``--tls-cert``, ``--tls-key``), the CA trusted by ``ca_file``, ``ca``
or ``INFLIGHT_CA_FILE``; without it, a ``TLSError`` at once, never retried."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from conftest import Server, make_certificates
from inflight_ledger import AsyncLedger, Ledger, TLSError, UnavailableError


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("tls"))
    certs = make_certificates(workdir)
    s = Server(workdir, {}, None, tls=certs)
    try:
        yield s, certs
    finally:
        s.stop()


def test_a_lifecycle_over_https_with_the_ca_file(tls):
    server, certs = tls
    assert server.url.startswith("https://")
    with Ledger(server.url, ca_file=certs.ca) as ledger:
        call = ledger.begin(service="tls", provider="p")
        assert call.start()["state"] == "executing"
        assert call.succeed()["state"] == "succeeded"
        assert ledger.get_activity(call.id)["state"] == "succeeded"


@pytest.mark.asyncio
async def test_the_async_client_over_https(tls):
    server, certs = tls
    async with AsyncLedger(server.url, ca_file=certs.ca) as ledger:
        async with ledger.activity(service="tls", provider="async") as call:
            assert call.record["state"] == "executing"
        assert (await ledger.get_activity(call.id))["state"] == "succeeded"


def test_the_ca_as_pem_text_or_from_the_environment(tls, monkeypatch):
    server, certs = tls
    with open(certs.ca) as f:
        pem = f.read()
    with Ledger(server.url, ca=pem) as ledger:
        assert ledger.healthy()
    monkeypatch.setenv("INFLIGHT_CA_FILE", certs.ca)
    with Ledger(server.url) as ledger:
        with ledger.activity(service="tls", provider="env"):
            pass


def test_without_the_ca_a_tls_error_at_once_never_retried(tls, monkeypatch):
    server, _ = tls
    monkeypatch.delenv("INFLIGHT_CA_FILE", raising=False)
    calls = []

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request):
            calls.append(request.url.path)
            return super().handle_request(request)

    started = time.monotonic()
    with Ledger(server.url, retries=3, backoff=0.5, transport=Counting()) as ledger:
        # A read is idempotent: a mere network error would be retried.
        with pytest.raises(TLSError) as caught:
            ledger.snapshot()
    err = caught.value
    assert isinstance(err, UnavailableError) and err.code == "unavailable"
    assert "certificate" in str(err)
    assert "ca_file" in str(err) and "INFLIGHT_CA_FILE" in str(err)
    assert calls == ["/v1/snapshot"]
    assert time.monotonic() - started < 2


@pytest.mark.asyncio
async def test_without_the_ca_the_async_client_fails_the_same(tls, monkeypatch):
    server, _ = tls
    monkeypatch.delenv("INFLIGHT_CA_FILE", raising=False)
    async with AsyncLedger(server.url, backoff=0.5) as ledger:
        with pytest.raises(TLSError, match="certificate"):
            await ledger.snapshot()


def test_a_plain_url_to_the_tls_server_says_to_use_https(tls):
    server, _ = tls
    with Ledger(server.url.replace("https://", "http://"), retries=0) as ledger:
        with pytest.raises(UnavailableError, match="https://"):
            ledger.snapshot()


def test_a_ca_that_did_not_sign_the_certificate_is_refused(tls, tmp_path):
    server, _ = tls
    other = make_certificates(str(tmp_path))
    with Ledger(server.url, ca_file=other.ca) as ledger:
        with pytest.raises(TLSError):
            ledger.begin(service="tls", provider="p")


def test_an_unreadable_ca_file_fails_at_construction_naming_it(tls, tmp_path):
    server, certs = tls
    missing = os.path.join(str(tmp_path), "missing.pem")
    with pytest.raises(ValueError, match="missing.pem"):
        Ledger(server.url, ca_file=missing)
    with pytest.raises(ValueError, match="not both"):
        AsyncLedger(server.url, ca_file=certs.ca, ca="x")
