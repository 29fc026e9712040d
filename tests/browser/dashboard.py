#!/usr/bin/env python3
"""The dashboard at GET /, tested in a real browser (headless Chromium).

Starts `inflight serve` on a fresh SQLite file with a token and a capped
lane, seeds it over HTTP (executing, waiting and leaked records, an owner),
writes one label with markup straight into the store (the API refuses
such labels, so only a damaged or hostile store could hold one), then opens
the page and checks:

- it asks for the token, and keeps working once given it;
- the lanes, counts, oldest records, owners and reaps render;
- a change made through the API shows up on the next refresh;
- markup in a label is shown as text and never runs;
- on a phone-sized screen nothing overflows the page sideways.

It saves a screenshot (`--screenshot PATH`; the README shows one).

Usage: python3 tests/browser/dashboard.py [--bin target/debug/inflight]
           [--chromium /usr/bin/chromium] [--screenshot PATH]
Needs: pip install playwright (no browser download: it drives the system's
Chromium).
"""

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

from playwright.sync_api import expect, sync_playwright

TOKEN = "dashboard-test-token"
LANE = "kb::ollama"
MARKUP = '<img src=x onerror="window.__pwned=1">'


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, workdir):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.db = os.path.join(workdir, "inflight.db")
        config = os.path.join(workdir, "inflight.toml")
        with open(config, "w") as f:
            f.write(f'[lanes."{LANE}"]\ncap = 2\n')
        self.log = open(os.path.join(workdir, "server.log"), "w")
        self.process = subprocess.Popen(
            [binary, "serve", "--config", config, "--listen", f"127.0.0.1:{self.port}",
             "--store", f"sqlite://{self.db}", "--token", TOKEN],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.base + "/healthz", timeout=1).read()
                return
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {self.log.name}")
                time.sleep(0.1)

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {TOKEN}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def begin(self, **fields):
        body = {"service": "kb", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text"}
        body.update(fields)
        status, record = self.call("POST", "/v1/activities", body)
        assert status == 201, (status, record)
        return record["activityId"]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def rfc3339(at):
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def seed(server):
    executing = []
    for _ in range(2):
        activity = server.begin()
        status, _ = server.call("POST", f"/v1/activities/{activity}/start")
        assert status == 200, status
        executing.append(activity)
    waiting = server.begin()
    status, _ = server.call("POST", f"/v1/activities/{waiting}/start")
    assert status == 429, f"the third start on a cap-2 lane answered {status}"
    # Leaked calls: started two hours ago with a one-second deadline, so the
    # next read reaps them (unsettled), and one that never started.
    two_hours_ago = rfc3339(datetime.now(timezone.utc) - timedelta(hours=2))
    for _ in range(3):
        server.begin(service="chat-api", provider="openai", **{"class": "chat"},
                     enqueuedAt=two_hours_ago, startedAt=two_hours_ago, deadlineMs=1000,
                     admission="direct")
    status, owner = server.call("POST", "/v1/owners", {"name": "worker-a", "ttlMs": 60000})
    assert status == 201, (status, owner)
    # A record in flight on its own lane, whose service is markup: written
    # straight into the store, as a damaged store could hold it.
    marked = server.begin(service="tagged", provider="ollama")
    conn = sqlite3.connect(server.db, timeout=10)
    with conn:
        changed = conn.execute("UPDATE activities SET service = ? WHERE activity_id = ?", (MARKUP, marked)).rowcount
    conn.close()
    assert changed == 1, "the markup record was not found in the store"
    return executing, waiting


def lane_row(page, lane):
    return page.locator(f'#lanes tbody tr[data-lane="{lane}"]')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default=os.environ.get("INFLIGHT_BIN", "target/debug/inflight"))
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--screenshot", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="inflight-dashboard-") as workdir:
        server = Server(os.path.abspath(args.bin), workdir)
        try:
            executing, _ = seed(server)
            run(server, executing, args)
        finally:
            server.stop()
    print("dashboard: ok")


def run(server, executing, args):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        outside = []
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(server.base) else None)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: (errors.append(f"dialog: {d.message}"), d.dismiss()))

        page.goto(server.base + "/")
        # The token: asked for, never stored.
        expect(page.locator("#token-form")).to_be_visible(timeout=10_000)
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        expect(page.locator("#main")).to_be_visible(timeout=10_000)
        expect(page.locator("#token-form")).to_be_hidden()
        stored = page.evaluate("() => [localStorage.length, sessionStorage.length, document.cookie]")
        assert stored == [0, 0, ""], f"the token was stored: {stored}"

        # Lanes with cap, executing, waiting.
        kb = lane_row(page, LANE)
        expect(kb).to_have_count(1)
        expect(kb.locator("td").nth(1)).to_have_text("2")
        expect(kb.locator("td").nth(2)).to_have_text("2")
        expect(kb.locator("td").nth(3)).to_have_text("1")
        assert kb.locator(".bar b.cap").count() == 1, "the cap is not drawn"

        # Reaps: the three leaked chat calls, in the last hour.
        expect(page.locator("#reap-chart")).to_have_attribute("data-total", "3")
        assert page.locator("#reap-chart svg rect.unsettled-deadline").count() >= 1
        # The oldest in flight, with their ages and bounds; the owner.
        expect(page.locator("#in-flight tbody tr")).to_have_count(4)
        expect(page.locator("#owners tbody tr")).to_have_count(1)
        expect(page.locator("#owners tbody tr td").nth(1)).to_have_text("worker-a")
        expect(page.locator("#owners tbody tr td").nth(2)).to_have_text("live")

        # Markup in a label is text, and never runs.
        tagged = page.locator("#lanes tbody tr").filter(has_text=MARKUP)
        expect(tagged).to_have_count(1)
        expect(tagged.locator("td").first).to_have_text(MARKUP + "::ollama")
        assert page.locator("main img").count() == 0, "a label became an element"
        assert page.evaluate("() => window.__pwned") is None, "a label's script ran"

        # A change through the API shows on the next refresh.
        refreshes = int(page.evaluate("() => document.body.dataset.refreshes"))
        status, _ = server.call("POST", f"/v1/activities/{executing[0]}/settle", {"success": True})
        assert status == 200, status
        server.begin(service="chat-api", provider="openai", **{"class": "chat"},
                     enqueuedAt=rfc3339(datetime.now(timezone.utc) - timedelta(hours=1)),
                     deadlineMs=1000)
        expect(kb.locator("td").nth(2)).to_have_text("1", timeout=10_000)
        expect(page.locator("#reap-chart")).to_have_attribute("data-total", "4", timeout=10_000)
        assert int(page.evaluate("() => document.body.dataset.refreshes")) > refreshes

        if args.screenshot:
            page.screenshot(path=args.screenshot, full_page=True)
            print(f"screenshot: {args.screenshot}")

        # A phone: the page fits its width; wide tables scroll in their box.
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(200)
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone's screen"

        assert not outside, f"requests left the machine: {outside}"
        assert not errors, f"the page raised: {errors}"
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
