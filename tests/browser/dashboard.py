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
- a lane with a token budget reads "800 of 1,000 tokens/min (800 reserved)"
  over a thin bar ticked at the budget, and once a start is refused for
  want of tokens, the line, the bar and the lane are marked full; a lane
  of a provider with a budget reads the provider's use, summed over its
  lanes, against it; a budget's window holding it all, or a provider's,
  marks the lanes of it with calls, and a lane with room loses the mark;
- a snapshot from a server older than those fields, or than budgets,
  still renders;
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
# A token budget of 1,000 a minute: two calls of 400 executing hold 800, and
# a third of 400 is refused (budget_exhausted), waiting.
BUDGETED = "kb::openai"
BUDGET = 1000
# openai's budget, shared by its lanes: this lane has none of its own, and
# reserves 500 of it with one call executing.
SHARING = "translate::openai"
PROVIDER_BUDGET = 3000


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
            f.write(f'[lanes."{BUDGETED}"]\ntokens_per_minute = {BUDGET}\n')
            f.write(f'[providers.openai]\ntokens_per_minute = {PROVIDER_BUDGET}\n')
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
    # A lane's token budget: two calls of 400 fit in its 1,000 a minute, a
    # third does not and waits; another lane of the provider reserves 500
    # of the provider's budget.
    budgeted = []
    for _ in range(3):
        activity = server.begin(service="kb", provider="openai", maxTokens=400, **{"class": "chat"})
        budgeted.append(activity)
    for activity in budgeted[:2]:
        status, body = server.call("POST", f"/v1/activities/{activity}/start")
        assert status == 200, (status, body)
    status, body = server.call("POST", f"/v1/activities/{budgeted[2]}/start")
    assert status == 429 and body["error"]["code"] == "budget_exhausted", (status, body)
    assert f"lane {BUDGETED}" in body["error"]["message"], body
    server.begin("?start=now", service="translate", provider="openai", maxTokens=500, **{"class": "chat"})
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
    return executing, marked, reserving, budgeted


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
    executing, marked, reserving, budgeted = seeded
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
        expect(page.locator("#trouble")).to_contain_text(f"budget full: {BUDGETED}")
        expect(page.locator("#trouble")).to_contain_text(re.compile(f"failing: [^·]*{re.escape(FAILING)}"))
        warning = page.locator('#warnings li[data-code="lane_unused_near_miss"]')
        expect(warning).to_contain_text(MISSPELLED)
        expect(warning).to_contain_text(LANE)

        # Trouble first: the cooling lane tops the table, then the one whose
        # budget is full, then the saturated lane above lanes whose names
        # sort before it, then the waiting, failing and reaped ones.
        kb = lane_row(page, LANE)
        expect(kb).to_have_count(1)
        active = lane_order(page, "lanes-active")
        expected = [COOLED, BUDGETED, LANE, MARKUP + "::ollama", FAILING, LEAKED, ORPHANED, SPENDING, SHARING]
        assert active == expected, f"lanes in the order {active}, not {expected}"
        expect(kb).to_have_attribute("data-trouble", "saturated")
        expect(kb).to_have_class("trouble saturated")
        expect(cell(kb, "trouble")).to_have_text("SATURATED")
        expect(cell(kb, "cap")).to_have_text("2")
        expect(cell(kb, "executing")).to_have_text("2")
        expect(cell(kb, "waiting")).to_have_text("3")
        expect(cell(kb, "longest wait")).to_contain_text("2m3")
        assert kb.locator(".bar.slots b.cap").count() == 1, "the cap is not drawn"
        expect(kb.locator(".bar.slots b.declared-cap")).to_be_hidden()
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
            # The date shows only when the cooldown ends on another day
            # (a run within 30 min of midnight UTC).
            r"^cooling down after a provider's Retry-After until "
            r"(\d\d:\d\d:\d\d|\d{4}-\d\d-\d\d \d\d:\d\d) UTC"))
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

        # A token budget: what the lane's window holds (800 reserved by two
        # calls of 400) against its 1,000, over a thin bar ticked at the
        # budget. A third call of 400 was refused and waits: the budget has
        # no room for it, so the line, the bar and the lane read full, and
        # BUDGET FULL says why the record waits (no WAITING marker).
        budget_row = lane_row(page, BUDGETED)
        expect(budget_row).to_have_attribute("data-trouble", "budget")
        expect(budget_row).to_have_class("trouble budget")
        marker = cell(budget_row, "trouble").locator(".marker.budget")
        expect(marker).to_have_text("BUDGET FULL")
        expect(marker).to_have_attribute("title", re.compile(
            r"^token budget full: the lane's \(800 of 1,000 tokens/min\)\. .*\(budget_exhausted\)"))
        expect(cell(budget_row, "cap")).to_have_text("none")
        expect(cell(budget_row, "executing")).to_have_text("2")
        expect(cell(budget_row, "waiting")).to_have_text("1")
        tokens = cell(budget_row, "load").locator(".tokens")
        expect(tokens).to_have_text("800 of 1,000 tokens/min (800 reserved) · full")
        expect(tokens).to_have_class("tokens budgeted full")
        expect(tokens).to_have_attribute("title", re.compile(
            r"^the lane's token budget: 800 of its 1,000 tokens a minute held, 0 charged in the last minute "
            r"and 800 reserved .*; full: "))
        bars = page.evaluate(TOKEN_BARS, BUDGETED)
        assert bars["lane"]["shown"] and bars["lane"]["full"], bars
        assert close(bars["lane"]["parts"], [0, 0.8]), f"the window's parts are not 0 and 800 of 1,000: {bars}"
        assert close([bars["lane"]["tick"]], [1]), f"the budget's tick is not at 1,000: {bars}"
        # Its provider's budget, shared: the window of openai's lanes summed
        # (800 here, 500 on the other lane), this lane's share first.
        shared = cell(budget_row, "load").locator(".shared-tokens")
        expect(shared).to_have_text("1,300 of 3,000 tokens/min shared by openai's lanes · this lane 800")
        expect(shared).to_have_class("shared-tokens")
        expect(shared).to_have_attribute("title", re.compile(
            r"^openai's token budget, shared by every lane of openai: 1,300 of its 3,000 tokens a minute held "
            r"by its lanes .*, 800 of them by this lane$"))
        assert bars["shared"]["shown"] and not bars["shared"]["full"], bars
        assert close(bars["shared"]["parts"], [800 / 3000, 500 / 3000]), bars
        assert close([bars["shared"]["tick"]], [1]), bars
        # A lane of the provider without a budget of its own: today's line,
        # then the provider's.
        sharing = lane_row(page, SHARING)
        expect(sharing).to_have_attribute("data-trouble", "")
        expect(cell(sharing, "load").locator(".tokens")).to_have_text("0 tokens/min · 500 reserved")
        expect(cell(sharing, "load").locator(".shared-tokens")).to_have_text(
            "1,300 of 3,000 tokens/min shared by openai's lanes · this lane 500")
        bars = page.evaluate(TOKEN_BARS, SHARING)
        assert not bars["lane"]["shown"], bars
        assert close(bars["shared"]["parts"], [500 / 3000, 800 / 3000]), bars
        # No budget, no budget line or bar.
        for lane in (LANE, SPENDING):
            expect(cell(lane_row(page, lane), "load").locator(".shared-tokens")).to_be_hidden()
            bars = page.evaluate(TOKEN_BARS, lane)
            assert not bars["lane"]["shown"] and not bars["shared"]["shown"], (lane, bars)
        expect(page.locator(".key")).to_contain_text("BUDGET FULL")
        expect(page.locator(".key")).to_contain_text("shared by openai's lanes")
        # Full by the window alone: it holds the whole budget (200 charged,
        # 800 reserved), nothing waiting. A provider's budget held whole
        # marks its lanes with calls, not one with none.
        full = page.evaluate(FULL_BUDGETS, [BUDGETED, SHARING, LEAKED])
        assert full[BUDGETED] == {"tokens": "1,000 of 1,000\u00a0tokens/min (800\u00a0reserved) · full",
                                  "trouble": "budget"}, full
        assert full[SHARING]["trouble"] == "budget", full
        assert full[SHARING]["shared"].endswith(" · full"), full
        assert "budget" not in full[LEAKED]["trouble"], full

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
        # "just now" under 5 s; a slow machine may take longer to seed and
        # load the page, so the seconds-ago spelling passes too.
        expect(deadline.first.locator("td time .rel")).to_have_text(re.compile(r"^(just now|\d+ s ago)$"))
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
        expect(page.locator("#in-flight tbody tr")).to_have_count(12)
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
        # A budgeted call settles having spent 100: 500 held, and room for
        # the 400 waiting, so the budget is no longer full, and the record
        # waits for its caller (WAITING); started, it is admitted.
        status, body = server.call("POST", f"/v1/activities/{budgeted[0]}/settle",
                                   {"success": True, "usage": {"inputTokens": 60, "outputTokens": 40}})
        assert status == 200, (status, body)
        tokens = cell(lane_row(page, BUDGETED), "load").locator(".tokens")
        expect(tokens).to_have_text("500 of 1,000 tokens/min (400 reserved)", timeout=10_000)
        expect(tokens).to_have_class("tokens budgeted")
        expect(lane_row(page, BUDGETED)).to_have_attribute("data-trouble", "waiting")
        expect(cell(lane_row(page, BUDGETED), "load").locator(".shared-tokens")).to_have_text(
            "1,000 of 3,000 tokens/min shared by openai's lanes · this lane 500")
        status, body = server.call("POST", f"/v1/activities/{budgeted[2]}/start")
        assert status == 200, (status, body)
        expect(tokens).to_have_text("900 of 1,000 tokens/min (800 reserved)", timeout=10_000)
        expect(lane_row(page, BUDGETED)).to_have_attribute("data-trouble", "")

        # A server older than effectiveCap, coolingUntil, cooldowns,
        # byPriority and the token fields: the cooled lane reads as a plain
        # one, without errors.
        old = page.evaluate(OLDER_SERVER, [COOLED, BEFORE_COOLDOWNS])
        assert old == {"cap": "4", "trouble": "waiting failing", "left": "", "priority": "", "declared": True,
                       "tokens": "", "budgetBar": True, "shared": "", "sharedBar": True}, old
        # Without tokensLastMinute and tokensReserved, no tokens line.
        old = page.evaluate(OLDER_SERVER, [SPENDING, BEFORE_COOLDOWNS])
        assert old["tokens"] == "", old
        # A server older than budgets only: today's token line (the 100 of
        # the settle above, unless it left the minute on a slow machine),
        # no bars.
        old = page.evaluate(OLDER_SERVER, [BUDGETED, BEFORE_BUDGETS])
        assert re.fullmatch(r"(100|0)\u00a0tokens/min · 800\u00a0reserved", old["tokens"]), old
        assert old["budgetBar"] and old["shared"] == "" and old["sharedBar"], old

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
  const bar = document.querySelector(`#lanes tr[data-lane="${lane}"] .bar.slots`).getBoundingClientRect();
  const at = (selector) => {
    const tick = document.querySelector(`#lanes tr[data-lane="${lane}"] .bar.slots ${selector}`).getBoundingClientRect();
    return (tick.left + 1 - bar.left) / bar.width;
  };
  return { cap: at("b.cap"), declared: at("b.declared-cap") };
}"""

# The lane fields a server older than the cooldowns lacks, and one older
# than budgets.
BEFORE_BUDGETS = ["tokensPerMinute", "providerTokensPerMinute"]
BEFORE_COOLDOWNS = ["effectiveCap", "coolingUntil", "cooldowns", "byPriority",
                    "tokensLastMinute", "tokensReserved"] + BEFORE_BUDGETS

# Renders the last snapshot without the given fields of its lanes, reads
# the lane's row, then renders the snapshot again.
OLDER_SERVER = """([lane, fields]) => {
  const older = JSON.parse(JSON.stringify(last));
  for (const entry of Object.values(older.nativeAdmission)) for (const field of fields) delete entry[field];
  render(older);
  const row = document.querySelector(`#lanes tr[data-lane="${lane}"]`);
  const seen = {
    cap: row.cells[2].textContent,
    trouble: row.dataset.trouble,
    left: row.querySelector(".cooling-left").textContent,
    priority: row.querySelector(".by-priority").textContent,
    declared: row.querySelector(".bar.slots b.declared-cap").hidden,
    tokens: row.querySelector(".tokens").textContent,
    budgetBar: row.querySelector(".bar.token-bar").hidden,
    shared: row.querySelector(".shared-tokens").textContent,
    sharedBar: row.querySelectorAll(".bar.token-bar")[1].hidden,
  };
  render(last);
  return seen;
}"""

# A lane's two token bars, its own budget's and its provider's: shown or
# not, full or not, each part's width and the budget tick's place, as
# fractions of the bar.
TOKEN_BARS = """(lane) => {
  const [own, shared] = document.querySelectorAll(`#lanes tr[data-lane="${lane}"] .bar.token-bar`);
  const read = (bar) => {
    const box = bar.getBoundingClientRect();
    const shown = !bar.hidden && box.width > 0;
    const at = (node) => shown ? (node.getBoundingClientRect().left - box.left) / box.width : null;
    return {
      shown, full: bar.classList.contains("full"),
      parts: Array.from(bar.querySelectorAll("i"), (i) => shown ? i.getBoundingClientRect().width / box.width : null),
      tick: shown ? (bar.querySelector("b.cap").getBoundingClientRect().left + 1 - box.left) / box.width : null,
    };
  };
  return { lane: read(own), shared: read(shared) };
}"""

# Renders the last snapshot with the first lane's window holding its whole
# budget (200 charged beside its 800 reserved, nothing waiting) and
# openai's budget lowered to what its lanes hold, reads the lanes' rows,
# then renders the snapshot again.
FULL_BUDGETS = """(lanes) => {
  const full = JSON.parse(JSON.stringify(last));
  const first = full.nativeAdmission[lanes[0]];
  first.tokensLastMinute = 200;
  first.waiting = 0;
  first.byPriority.unknown.waiting = 0;
  let held = 0;
  for (const lane of Object.values(full.nativeAdmission))
    if (lane.provider === "openai") held += (lane.tokensLastMinute || 0) + (lane.tokensReserved || 0);
  for (const lane of Object.values(full.nativeAdmission))
    if (lane.provider === "openai") lane.providerTokensPerMinute = held;
  render(full);
  const seen = {};
  for (const lane of lanes) {
    const row = document.querySelector(`#lanes tr[data-lane="${lane}"]`);
    seen[lane] = lane === lanes[0]
      ? { tokens: row.querySelector(".tokens").textContent, trouble: row.dataset.trouble }
      : { shared: row.querySelector(".shared-tokens").textContent, trouble: row.dataset.trouble };
  }
  render(last);
  return seen;
}"""


def close(seen, wanted, within=0.02):
    return len(seen) == len(wanted) and all(a is not None and abs(a - b) <= within for a, b in zip(seen, wanted))

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
