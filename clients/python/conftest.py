"""Starts the real `inflight serve` on a temp SQLite file and a free port.

The binary is INFLIGHT_BIN, else the repository's target/debug/inflight."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

import httpx
import pytest

BIN = os.environ.get("INFLIGHT_BIN") or str(Path(__file__).resolve().parents[2] / "target" / "debug" / "inflight")
TOKEN = "py-client-test-token"
#: Lanes with a cap of 1, one per test that needs a full lane.
CAPPED = [f"{name}::capped" for name in (
    "wait", "exec", "timeout", "owner", "full", "maxwait", "kbint",
    "await", "aexec", "atimeout", "aowner", "amaxwait", "now", "anow",
)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, workdir: str, lanes: Dict[str, int], token: Optional[str]) -> None:
        if not os.path.exists(BIN):
            raise RuntimeError(f"no inflight binary at {BIN}: run `cargo build --bin inflight` or set INFLIGHT_BIN")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        config = os.path.join(workdir, "inflight.toml")
        with open(config, "w") as f:
            for lane, cap in lanes.items():
                f.write(f'[lanes."{lane}"]\ncap = {cap}\n')
        self.log = open(os.path.join(workdir, "server.log"), "w")
        args = [BIN, "serve", "--config", config, "--listen", f"127.0.0.1:{self.port}",
                "--store", f"sqlite://{os.path.join(workdir, 'inflight.db')}"]
        if token:
            args += ["--token", token]
        env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_TOKEN"}
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
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
    l = snapshot["nativeAdmission"].get(lane) or {}
    in_flight = [r for r in snapshot["inFlight"] if f"{r['service']}::{r['provider']}" == lane]
    return {"executing": l.get("executing", 0), "waiting": l.get("waiting", 0), "inFlight": len(in_flight)}


EMPTY = {"executing": 0, "waiting": 0, "inFlight": 0}
