#!/usr/bin/env python3
"""The dashboard at GET /, tested in a real browser (headless Chromium).

Starts `inflight serve` on a fresh SQLite file with a token and a capped
lane, seeds it over HTTP (a saturated lane, a failing one, leaked records,
an owner lost with its record, idle and quiet lanes, an adaptive lane
cooling after a provider's Retry-After, its cap lowered),
writes one label with markup straight into the store (the API refuses
such labels, so only a damaged or hostile store could hold one), then opens
the page and checks:

- it asks for the token, and keeps working once given it;
- the snapshot's warnings are shown (a declared lane one edit from a lane
  with calls);
- lanes are sorted by trouble (a cooling lane first, then a saturated lane
  above idle lanes whose names sort before it), marked in text, with
  failures and reaps per lane;
- a cooling lane says so and for how long, its lowered cap reads "2 of 4"
  with the bar's cap tick at 2, and a lane's records show by priority;
- a lane that spent tokens reads "1,176 tokens/min · 2,000 reserved" under
  its bar, and a lane without shows no such line;
- a snapshot from a server older than those fields still renders;
- the reaped records are listed, and the status badge explains itself;
- idle lanes fold away under a toggle, the quiet time set by `?idle=`;
- the lanes, counts, oldest records, owners and reaps render;
- a refresh updates rows in place, and stays fast with 500 lanes;
- a change made through the API shows up on the next refresh;
- markup in a label is shown as text and never runs;
- on a phone-sized screen nothing overflows the page sideways.

It saves a screenshot (`--screenshot PATH`; the README shows one).

The binary embeds the page's files when built; `--dashboard-dir DIR` has
the browser load index.html, dashboard.js and dashboard.css from DIR
instead (the server's own headers kept, its Content-Security-Policy
among them), to try a change to the page without rebuilding. CI leaves it
unset, and so tests the files the binary serves.

Usage: python3 tests/browser/dashboard.py [--bin target/debug/inflight]
           [--chromium /usr/bin/chromium] [--screenshot PATH]
           [--dashboard-dir crates/inflight-server/src/http/dashboard]
Needs: pip install playwright (no browser download: it drives the system's
Chromium).
"""

import argparse
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from urllib.parse import urlparse

from playwright.sync_api import expect, sync_playwright

TOKEN = "dashboard-test-token"
LANE = "kb::ollama"  # capped at 2: saturated, 2 executing (interactive) and 3 waiting (batch)
# Adaptive, capped at 4: a refusal with a Retry-After cools it for half an
# hour and lowers its cap to 2; one record waits behind the cooldown.
COOLED = "search::cohere"
FAILING = "chat-api::anthropic"
LEAKED = "chat-api::openai"  # direct calls reaped past their deadline
ORPHANED = "jobs::ollama"  # a record reaped when its owner was lost
QUIET = "archive::ollama"  # its last call an hour ago
# Declared, never used, and named to sort before the saturated lane.
IDLE = ["aaa::idle", "batch::ollama"]
# Declared, never called, one edit from the saturated lane: a snapshot warning.
MISSPELLED = "kb::olama"
MARKUP = '<img src=x onerror="window.__pwned=1">'
# Spends tokens: a call settled with 1,000 + 176 tokens of usage, and one
# executing with 2,000 reserved (its maxTokens).
SPENDING = "summarize::anthropic"


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
            f.write(f'[lanes."{COOLED}"]\ncap = 4\nadaptive = true\nmax_cooldown = "1h"\n')
            for lane in IDLE + [MISSPELLED]:
                f.write(f'[lanes."{lane}"]\ncap = 4\n')
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

    def begin(self, query="", **fields):
        body = {"service": "kb", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text"}
        body.update(fields)
        status, record = self.call("POST", "/v1/activities" + query, body)
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
    now = datetime.now(timezone.utc)
    executing = []
    for _ in range(2):
        activity = server.begin(priority="interactive")
        status, _ = server.call("POST", f"/v1/activities/{activity}/start")
        assert status == 200, status
        executing.append(activity)
    # Three waiting behind them, the oldest for two and a half minutes.
    waiting = [server.begin(enqueuedAt=rfc3339(now - timedelta(seconds=150 - i)), priority="batch")
               for i in range(3)]
    status, _ = server.call("POST", f"/v1/activities/{waiting[0]}/start")
    assert status == 429, f"a third start on a cap-2 lane answered {status}"
    # A provider refuses with a Retry-After of half an hour: the adaptive
    # lane cools down, its cap halved to 2, and a record begun after waits.
    refused = server.begin(service="search", provider="cohere")
    assert server.call("POST", f"/v1/activities/{refused}/start")[0] == 200
    status, body = server.call("POST", f"/v1/activities/{refused}/settle",
                               {"success": False, "retryAfterMs": 1_800_000})
    assert status == 200, (status, body)
    server.begin(service="search", provider="cohere", priority="interactive")
    # A failing provider: three failures and a success.
    for success in (False, False, False, True):
        activity = server.begin(service="chat-api", provider="anthropic", **{"class": "chat"})
        assert server.call("POST", f"/v1/activities/{activity}/start")[0] == 200
        assert server.call("POST", f"/v1/activities/{activity}/settle",
                           {"success": success, "failureStage": "provider"} if not success
                           else {"success": True})[0] == 200
    # Tokens: 1,176 charged in the last minute (a settle's usage), and
    # 2,000 reserved by a call executing with that estimate.
    spent = server.begin("?start=now", service="summarize", provider="anthropic", **{"class": "chat"})
    status, body = server.call("POST", f"/v1/activities/{spent}/settle",
                               {"success": True, "usage": {"inputTokens": 1000, "outputTokens": 176}})
    assert status == 200, (status, body)
    reserving = server.begin("?start=now", service="summarize", provider="anthropic", maxTokens=2000,
                             **{"class": "chat"})
    # Leaked calls: started two hours ago with a one-second deadline, so the
    # next read reaps them (unsettled, deadline).
    two_hours_ago = rfc3339(now - timedelta(hours=2))
    for _ in range(3):
        server.begin(service="chat-api", provider="openai", **{"class": "chat"},
                     enqueuedAt=two_hours_ago, startedAt=two_hours_ago, deadlineMs=1000,
                     admission="direct")
    status, owner = server.call("POST", "/v1/owners", {"name": "worker-a", "ttlMs": 60000})
    assert status == 201, (status, owner)
    # An owner whose lease runs out at once: its record is reaped
    # (abandoned, owner-lost) by the next read.
    status, lost = server.call("POST", "/v1/owners", {"name": "worker-b", "ttlMs": 100})
    assert status == 201, (status, lost)
    server.begin(service="jobs", provider="ollama", ownerId=lost["ownerId"])
    # A lane whose last call settled an hour ago: idle by default.
    hour_ago = now - timedelta(hours=1)
    quiet = server.begin(service="archive", provider="ollama", enqueuedAt=rfc3339(hour_ago),
                         startedAt=rfc3339(hour_ago), deadlineMs=7_200_000)
    assert server.call("POST", f"/v1/activities/{quiet}/settle",
                       {"success": True, "completedAt": rfc3339(hour_ago + timedelta(seconds=2))})[0] == 200
    # A record in flight on its own lane, whose service is markup: written
    # straight into the store, as a damaged store could hold it.
    # Waiting for half an hour: inside a chat's 40-minute queue bound.
    marked = server.begin(service="tagged", provider="ollama", enqueuedAt=rfc3339(now - timedelta(minutes=30)),
                          **{"class": "chat"})
    conn = sqlite3.connect(server.db, timeout=10)
    with conn:
        changed = conn.execute("UPDATE activities SET service = ? WHERE activity_id = ?", (MARKUP, marked)).rowcount
        counted = conn.execute("UPDATE aggregates SET service = ? WHERE service = 'tagged'", (MARKUP,)).rowcount
    conn.close()
    assert changed == 1, "the markup record was not found in the store"
    assert counted == 1, "the markup record's counters were not found in the store"
    time.sleep(0.2)  # past worker-b's lease
    return executing, marked, reserving


def lane_row(page, lane):
    return page.locator(f'#lanes tbody tr[data-lane="{lane}"]')


def lane_order(page, body):
    return page.evaluate(f"() => Array.from(document.querySelectorAll('#{body} tr'), tr => tr.dataset.lane)")


def cell(row, name):
    columns = ["lane", "trouble", "cap", "executing", "waiting", "load", "longest wait",
               "failed", "reaped", "last call"]
    return row.locator("td").nth(columns.index(name))


def open_page(page, url):
    page.goto(url)
    # The token: asked for, never stored.
    expect(page.locator("#token-form")).to_be_visible(timeout=10_000)
    page.fill("#token", TOKEN)
    page.click("#token-form button")
    expect(page.locator("#main")).to_be_visible(timeout=10_000)
    expect(page.locator("#token-form")).to_be_hidden()


# The page's files, by their path on the server.
PAGE_FILES = {"/": "index.html", "/dashboard.js": "dashboard.js", "/dashboard.css": "dashboard.css"}


def serve_from(page, server, folder):
    """Answers the page's files from `folder`, with the server's headers."""
    def local(route):
        response = route.fetch()
        name = PAGE_FILES[urlparse(route.request.url).path]
        with open(os.path.join(folder, name), "rb") as f:
            body = f.read()
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "etag")}
        route.fulfill(status=response.status, headers=headers, body=body)

    page.route(lambda url: url.startswith(server.base) and urlparse(url).path in PAGE_FILES, local)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default=os.environ.get("INFLIGHT_BIN", "target/debug/inflight"))
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--screenshot", default=None)
    parser.add_argument("--dashboard-dir", default=None,
                        help="serve the page's files from this folder rather than from the binary")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="inflight-dashboard-") as workdir:
        server = Server(os.path.abspath(args.bin), workdir)
        try:
            run(server, seed(server), args)
        finally:
            server.stop()
    print("dashboard: ok")


def run(server, seeded, args):
    executing, marked, reserving = seeded
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        if args.dashboard_dir:
            serve_from(page, server, args.dashboard_dir)
        outside = []
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(server.base) else None)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # Console errors, but the expected 401 (before the token) and the
        # favicon's 404.
        page.on("console", lambda m: errors.append(f"console: {m.text}")
                if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
        page.on("dialog", lambda d: (errors.append(f"dialog: {d.message}"), d.dismiss()))

        open_page(page, server.base + "/")
        stored = page.evaluate("() => [localStorage.length, sessionStorage.length, document.cookie]")
        assert stored == [0, 0, ""], f"the token was stored: {stored}"

        # The badge says what is wrong, on hover and in plain sight.
        expect(page.locator("#status")).to_have_text("degraded")
        expect(page.locator("#status-text")).to_contain_text("4 records reaped in the last 6 h")
        expect(page.locator("#status-text")).to_contain_text("settle never came")
        assert page.get_attribute("#status", "title") == page.text_content("#status-text")
        expect(page.locator("#trouble")).to_contain_text(f"saturated: {LANE}")
        expect(page.locator("#trouble")).to_contain_text(f"cooling: {COOLED}")
        expect(page.locator("#trouble")).to_contain_text(re.compile(f"failing: [^·]*{re.escape(FAILING)}"))
        warning = page.locator('#warnings li[data-code="lane_unused_near_miss"]')
        expect(warning).to_contain_text(MISSPELLED)
        expect(warning).to_contain_text(LANE)

        # Trouble first: the cooling lane tops the table, then the saturated
        # lane above lanes whose names sort before it, then the waiting,
        # failing and reaped ones.
        kb = lane_row(page, LANE)
        expect(kb).to_have_count(1)
        active = lane_order(page, "lanes-active")
        expected = [COOLED, LANE, MARKUP + "::ollama", FAILING, LEAKED, ORPHANED, SPENDING]
        assert active == expected, f"lanes in the order {active}, not {expected}"
        expect(kb).to_have_attribute("data-trouble", "saturated")
        expect(kb).to_have_class("trouble saturated")
        expect(cell(kb, "trouble")).to_have_text("SATURATED")
        expect(cell(kb, "cap")).to_have_text("2")
        expect(cell(kb, "executing")).to_have_text("2")
        expect(cell(kb, "waiting")).to_have_text("3")
        expect(cell(kb, "longest wait")).to_contain_text("2m3")
        assert kb.locator(".bar b.cap").count() == 1, "the cap is not drawn"
        expect(kb.locator(".bar b.declared-cap")).to_be_hidden()
        expect(cell(kb, "load").locator(".by-priority")).to_have_text("interactive 2/0 · batch 0/3")
        expect(page.locator(".key")).to_contain_text("SATURATED")
        expect(page.locator(".key")).to_contain_text("cap")

        # The cooling lane: marked, with the time left and until when; its
        # cap in force beside the declared one, and the bar's tick at it. Its
        # waiting record waits for the cooldown, so no WAITING marker.
        cooled = lane_row(page, COOLED)
        expect(cooled).to_have_attribute("data-trouble", "cooling failing")
        expect(cooled).to_have_class("trouble cooling")
        marker = cell(cooled, "trouble").locator(".marker.cooling")
        expect(marker).to_have_text("COOLING")
        expect(marker).to_have_attribute("title", re.compile(
            r"^cooling down after a provider's Retry-After until \d\d:\d\d:\d\d UTC"))
        expect(cell(cooled, "trouble").locator(".cooling-left")).to_have_text(re.compile(r"^(29|30)m\d\ds left$"))
        expect(cell(cooled, "cap")).to_have_text("2 of 4")
        expect(cell(cooled, "cap")).to_have_attribute("title", re.compile("declared 4"))
        expect(cell(cooled, "waiting")).to_have_text("1")
        expect(cell(cooled, "load").locator(".by-priority")).to_have_text("interactive 0/1")
        ticks = page.evaluate(TICKS, COOLED)
        assert abs(ticks["cap"] - 0.5) < 0.02, f"the cap tick is not at the cap in force (2 of 4): {ticks}"
        assert abs(ticks["declared"] - 1) < 0.02, f"the declared cap's tick is not at 4 of 4: {ticks}"
        expect(page.locator(".key")).to_contain_text("COOLING")
        expect(page.locator(".key")).to_contain_text("2 of 4")

        # Tokens, under the bar: charged in the last minute, then reserved;
        # nothing for the lanes that spent none.
        spending = lane_row(page, SPENDING)
        expect(cell(spending, "load").locator(".tokens")).to_have_text("1,176 tokens/min · 2,000 reserved")
        expect(cell(spending, "load").locator(".tokens")).to_be_visible()
        expect(cell(spending, "load").locator(".tokens")).to_have_attribute("title", re.compile(
            r"^1,176 tokens charged in the last minute .*; 2,000 reserved: "))
        for lane in (LANE, COOLED, FAILING, LEAKED):
            expect(cell(lane_row(page, lane), "load").locator(".tokens")).to_have_text("")
            expect(cell(lane_row(page, lane), "load").locator(".tokens")).to_be_hidden()
        expect(page.locator(".key")).to_contain_text("tokens/min")

        # Failures and reaps per lane.
        failing = lane_row(page, FAILING)
        expect(cell(failing, "trouble")).to_have_text("FAILING")
        expect(cell(failing, "failed").locator(".recent")).to_have_text("3")
        expect(cell(failing, "failed").locator(".ever")).to_have_text(" · 3 ever")
        expect(cell(failing, "last call")).to_contain_text("UTC")
        leaked = lane_row(page, LEAKED)
        expect(cell(leaked, "trouble")).to_have_text("REAPED")
        expect(cell(leaked, "reaped").locator(".recent")).to_have_text("3")
        expect(cell(leaked, "reaped").locator(".ever")).to_have_text(" · 3 ever")
        expect(cell(leaked, "executing")).to_have_text("0")

        # The reaped records themselves, newest first: lane, class,
        # disposition, reason, and when, relative and absolute.
        reaped = page.locator("#reaped-list tbody tr")
        expect(reaped).to_have_count(4)
        orphan = page.locator(f'#reaped-list tbody tr[data-lane="{ORPHANED}"]')
        expect(orphan).to_have_count(1)
        expect(orphan.locator("td").nth(3)).to_have_text("abandoned")
        expect(orphan.locator("td").nth(4)).to_have_text("owner-lost")
        deadline = page.locator(f'#reaped-list tbody tr[data-lane="{LEAKED}"]')
        expect(deadline).to_have_count(3)
        expect(deadline.first.locator("td").nth(2)).to_have_text("chat")
        expect(deadline.first.locator("td").nth(3)).to_have_text("unsettled")
        expect(deadline.first.locator("td").nth(4)).to_have_text("deadline")
        expect(deadline.first.locator("td time .rel")).to_have_text("just now")
        expect(deadline.first.locator("td time .abs")).to_contain_text("UTC")

        # Idle lanes are folded away under a toggle.
        toggle = page.locator("#idle-toggle")
        expect(toggle).to_contain_text("4 idle lanes")  # IDLE, MISSPELLED, QUIET
        expect(toggle).to_contain_text("15 min")
        expect(page.locator("#lanes-idle")).to_be_hidden()
        assert sorted(lane_order(page, "lanes-idle")) == sorted(IDLE + [MISSPELLED, QUIET])
        toggle.click()
        expect(page.locator("#lanes-idle")).to_be_visible()
        expect(lane_row(page, IDLE[0])).to_be_visible()
        expect(toggle).to_have_attribute("aria-expanded", "true")
        toggle.click()
        expect(page.locator("#lanes-idle")).to_be_hidden()

        # Reaps per hour, in the chart: the three leaked chat calls and the orphan.
        expect(page.locator("#reap-chart")).to_have_attribute("data-total", "4")
        assert page.locator("#reap-chart svg rect.unsettled-deadline").count() >= 1
        # The oldest in flight, with their ages and bounds; the owners.
        expect(page.locator("#in-flight tbody tr")).to_have_count(8)
        expect(page.locator("#owners tbody tr")).to_have_count(2)
        live = page.locator('#owners tbody tr[data-state="live"]')
        expect(live.locator("td").nth(1)).to_have_text("worker-a")
        expect(live.locator("td").nth(3)).to_contain_text("in ")
        lost = page.locator('#owners tbody tr[data-state="lost"]')
        expect(lost.locator("td").nth(1)).to_have_text("worker-b")
        expect(lost.locator("td").nth(4)).to_have_text("1")
        expect(page.locator("#read-at")).to_contain_text("UTC")

        # Markup in a label is text, and never runs.
        tagged = page.locator("#lanes tbody tr").filter(has_text=MARKUP)
        expect(tagged).to_have_count(1)
        expect(tagged.locator("td").first).to_have_text(MARKUP + "::ollama")
        assert page.locator("main img").count() == 0, "a label became an element"
        assert page.evaluate("() => window.__pwned") is None, "a label's script ran"

        # The screenshot (the README's) shows a saturated lane without the
        # markup label: that record settles as of 20 minutes ago, so its lane
        # is idle.
        twenty_ago = rfc3339(datetime.now(timezone.utc) - timedelta(minutes=20))
        status, body = server.call("POST", f"/v1/activities/{marked}/settle", {"success": True, "completedAt": twenty_ago})
        assert status == 200, (status, body)
        expect(page.locator("#lanes-active tr").filter(has_text=MARKUP)).to_have_count(0, timeout=10_000)
        if args.screenshot:
            bottom = page.evaluate("() => { const r = document.querySelector('#reaped-list').getBoundingClientRect();"
                                   " return Math.ceil(r.bottom + window.scrollY + 16); }")
            page.screenshot(path=args.screenshot, full_page=True,
                            clip={"x": 0, "y": 0, "width": 1200, "height": bottom})
            print(f"screenshot: {args.screenshot}")

        # A change through the API shows on the next refresh, in the rows
        # already drawn (a refresh updates rows in place).
        page.evaluate(f"() => {{ document.querySelector('#lanes tr[data-lane=\"{LANE}\"]').__kept = true; }}")
        refreshes = int(page.evaluate("() => document.body.dataset.refreshes"))
        status, _ = server.call("POST", f"/v1/activities/{executing[0]}/settle", {"success": True})
        assert status == 200, status
        server.begin(service="chat-api", provider="openai", **{"class": "chat"},
                     enqueuedAt=rfc3339(datetime.now(timezone.utc) - timedelta(hours=1)),
                     deadlineMs=1000)
        expect(cell(kb, "executing")).to_have_text("1", timeout=10_000)
        expect(cell(kb, "load").locator(".by-priority")).to_have_text("interactive 1/0 · batch 0/3")
        # One slot free, three still waiting for their callers to start them.
        expect(kb).to_have_attribute("data-trouble", "waiting")
        expect(page.locator("#reap-chart")).to_have_attribute("data-total", "5", timeout=10_000)
        expect(page.locator("#status-text")).to_contain_text("5 records reaped")
        assert int(page.evaluate("() => document.body.dataset.refreshes")) > refreshes
        # The reserving call ends without usage: its estimate is charged, and
        # nothing is reserved any more (2,000 alone if the seeded 1,176 has
        # left the minute on a slow machine).
        status, body = server.call("POST", f"/v1/activities/{reserving}/settle", {"success": True})
        assert status == 200, (status, body)
        expect(cell(spending, "load").locator(".tokens")).to_have_text(
            re.compile(r"^(3,176|2,000)\stokens/min$"), timeout=10_000)
        assert page.evaluate(f"() => document.querySelector('#lanes tr[data-lane=\"{LANE}\"]').__kept") is True, \
            "the lane's row was rebuilt"

        # A server older than effectiveCap, coolingUntil, cooldowns,
        # byPriority and the token fields: the cooled lane reads as a plain
        # one, without errors.
        old = page.evaluate(OLDER_SERVER, COOLED)
        assert old == {"cap": "4", "trouble": "waiting failing", "left": "", "priority": "", "declared": True,
                       "tokens": ""}, old
        # Without tokensLastMinute and tokensReserved, no tokens line.
        old = page.evaluate(OLDER_SERVER, SPENDING)
        assert old["tokens"] == "", old

        # Hundreds of lanes: a refresh stays fast, and rows are reused.
        timing = page.evaluate(MANY_LANES)
        assert timing["rows"] >= 500, timing
        assert timing["kept"], f"rows were rebuilt on the second render: {timing}"
        assert timing["second"] < 250, f"a refresh of 500 lanes took {timing['second']:.0f} ms"
        print(f"500 lanes: first render {timing['first']:.0f} ms, next {timing['second']:.0f} ms")

        # A phone: the page fits its width; wide tables scroll in their box.
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(200)
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone's screen"

        # The quiet time from the address: the hour-old lane is no longer idle.
        page.set_viewport_size({"width": 1200, "height": 900})
        open_page(page, server.base + "/?idle=2h")
        expect(page.locator("#idle-toggle")).to_contain_text("3 idle lanes")
        expect(page.locator("#idle-toggle")).to_contain_text("2 h")
        assert QUIET in lane_order(page, "lanes-active")
        assert page.input_value("#idle-quiet") == str(2 * 3600 * 1000)
        # And from the page's control, kept in the address.
        page.select_option("#idle-quiet", str(5 * 60 * 1000))
        expect(page.locator("#idle-toggle")).to_contain_text("5 idle lanes")
        assert page.url.endswith("?idle=5m"), page.url

        assert not outside, f"requests left the machine: {outside}"
        assert not errors, f"the page raised: {errors}"
        browser.close()


# Where the cap ticks of a lane's bar sit, as fractions of the bar.
TICKS = """(lane) => {
  const bar = document.querySelector(`#lanes tr[data-lane="${lane}"] .bar`).getBoundingClientRect();
  const at = (selector) => {
    const tick = document.querySelector(`#lanes tr[data-lane="${lane}"] .bar ${selector}`).getBoundingClientRect();
    return (tick.left + 1 - bar.left) / bar.width;
  };
  return { cap: at("b.cap"), declared: at("b.declared-cap") };
}"""

# Renders the last snapshot without the fields a server older than the
# cooldowns lacks, reads the lane's row, then renders the snapshot again.
OLDER_SERVER = """(lane) => {
  const older = JSON.parse(JSON.stringify(last));
  for (const entry of Object.values(older.nativeAdmission)) {
    delete entry.effectiveCap; delete entry.coolingUntil; delete entry.cooldowns; delete entry.byPriority;
    delete entry.tokensLastMinute; delete entry.tokensReserved;
  }
  render(older);
  const row = document.querySelector(`#lanes tr[data-lane="${lane}"]`);
  const seen = {
    cap: row.cells[2].textContent,
    trouble: row.dataset.trouble,
    left: row.querySelector(".cooling-left").textContent,
    priority: row.querySelector(".by-priority").textContent,
    declared: row.querySelector(".bar b.declared-cap").hidden,
    tokens: row.querySelector(".tokens").textContent,
  };
  render(last);
  return seen;
}"""

# Renders the last snapshot with 500 more lanes, twice, in the page itself
# (its functions are the page's globals), and times each render.
MANY_LANES = """() => {
  const base = last;
  const fake = JSON.parse(JSON.stringify(base));
  for (let i = 0; i < 500; i++) {
    fake.nativeAdmission[`svc${i}::p${i % 7}`] = {
      service: `svc${i}`, provider: `p${i % 7}`, cap: 4, executing: i % 5, waiting: i % 3,
      reaped: {abandoned: 0, unsettled: i % 2}, reapedOwnerLost: 0, lateSettles: 0,
      resurrections: 0, longestWaitMs: (i % 3) * 1000,
    };
  }
  let t = performance.now();
  render(fake);
  const first = performance.now() - t;
  const row = document.querySelector('#lanes tr[data-lane="svc7::p0"]');
  fake.nativeAdmission["svc7::p0"].executing = 4;
  t = performance.now();
  render(fake);
  const second = performance.now() - t;
  return {
    first, second,
    rows: document.querySelectorAll("#lanes tbody tr").length,
    kept: document.querySelector('#lanes tr[data-lane="svc7::p0"]') === row,
  };
}"""


if __name__ == "__main__":
    sys.exit(main())
