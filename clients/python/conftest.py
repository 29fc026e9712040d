"""Starts the real `inflight serve` on a temp SQLite file and a free port.

The binary is INFLIGHT_BIN, else the repository's target/debug/inflight."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional

import httpx
import pytest

BIN = os.environ.get("INFLIGHT_BIN") or str(Path(__file__).resolve().parents[2] / "target" / "debug" / "inflight")
TOKEN = "py-client-test-token"
#: Lanes with a cap of 1, one per test that needs a full lane.
CAPPED = [f"{name}::capped" for name in (
    "wait", "exec", "timeout", "owner", "full", "maxwait", "kbint",
    "await", "aexec", "atimeout", "aowner", "amaxwait", "now", "anow", "cancel", "hcancel",
    "idem-wait", "idem-full", "apool",
    # test_cooldown.py: a cooldown outlives its test, so each has its own lane.
    "cool", "cool-step", "cool-max", "cool-raise", "cool-openai", "cool-refused",
    "acool", "acool-step", "acool-raise", "acool-openai",
)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Certificates(NamedTuple):
    ca: str
    cert: str
    key: str


def make_certificates(workdir: str) -> Certificates:
    """A certificate authority and a server certificate it signed for
    127.0.0.1 and localhost, made with the openssl program in ``workdir``."""

    def file(name: str) -> str:
        return os.path.join(workdir, name)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    p256 = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *p256, "-keyout", file("ca.key"), "-out", file("ca.pem"), "-days", "2",
            "-subj", "/CN=inflight test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *p256, "-keyout", file("server.key"), "-out", file("server.csr"), "-subj", "/CN=localhost")
    with open(file("server.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", file("server.csr"), "-CA", file("ca.pem"), "-CAkey", file("ca.key"),
            "-set_serial", f"0x{secrets.token_hex(8)}", "-days", "2", "-out", file("server.pem"),
            "-extfile", file("server.ext"))
    return Certificates(file("ca.pem"), file("server.pem"), file("server.key"))


class Server:
    """``config``: more TOML for the config file; ``tls``: serve https with these files."""

    def __init__(
        self,
        workdir: str,
        lanes: Dict[str, int],
        token: Optional[str],
        config: str = "",
        tls: Optional[Certificates] = None,
    ) -> None:
        if not os.path.exists(BIN):
            raise RuntimeError(f"no inflight binary at {BIN}: run `cargo build --bin inflight` or set INFLIGHT_BIN")
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.token = token
        config_file = os.path.join(workdir, "inflight.toml")
        with open(config_file, "w") as f:
            for lane, cap in lanes.items():
                f.write(f'[lanes."{lane}"]\ncap = {cap}\n')
            f.write(config)
        self.log = open(os.path.join(workdir, "server.log"), "w")
        args = [BIN, "serve", "--config", config_file, "--listen", f"127.0.0.1:{self.port}",
                "--store", f"sqlite://{os.path.join(workdir, 'inflight.db')}"]
        if token:
            args += ["--token", token]
        if tls:
            args += ["--tls-cert", tls.cert, "--tls-key", tls.key]
        env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_TOKEN"}
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        verify = ssl.create_default_context(cafile=tls.ca) if tls else True
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1, verify=verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {self.log.name}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="inflight-py-") as workdir:
        s = Server(workdir, {**{lane: 1 for lane in CAPPED}, "knowledge-base::ollama": 2}, TOKEN)
        try:
            yield s
        finally:
            s.stop()


@pytest.fixture(scope="session")
def plain_server() -> Iterator[Server]:
    """A server with no token."""
    with tempfile.TemporaryDirectory(prefix="inflight-py-") as workdir:
        s = Server(workdir, {}, None)
        try:
            yield s
        finally:
            s.stop()


def lane_counts(snapshot: dict, lane: str) -> Dict[str, int]:
    """The lane's counts in the snapshot. A lane the snapshot does not show
    fails the test: every lane a test uses has had a call, so its absence is
    a defect, never a lane with nothing in flight."""
    lanes = snapshot["nativeAdmission"]
    assert lane in lanes, f"the snapshot shows no lane {lane}: it has {sorted(lanes)}"
    l = lanes[lane]
    in_flight = [r for r in snapshot["inFlight"] if f"{r['service']}::{r['provider']}" == lane]
    return {"executing": l["executing"], "waiting": l["waiting"], "inFlight": len(in_flight)}


EMPTY = {"executing": 0, "waiting": 0, "inFlight": 0}


class Counting(httpx.HTTPTransport):
    """The real transport, keeping each request it sends as "METHOD path"
    (``sent``): a test sees what reached the server, and what did not."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: List[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        return super().handle_request(request)


class ACounting(httpx.AsyncHTTPTransport):
    """``Counting`` for the asyncio client."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: List[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        return await super().handle_async_request(request)
