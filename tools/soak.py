#!/usr/bin/env python3
"""A soak of `inflight serve`: steady load for a long time, with leaks and
dying owners, recording what grows.

It starts the server on a fresh SQLite file (short deadlines, so leaks are
reaped within seconds; a short retention, so pruning runs), then for
`--duration`:

- runs lifecycles (begin, start, settle) at `--rate` a second from
  `--workers` threads, each on its own keep-alive connection;
- leaks `--leak` of them (begun and started, never settled), which the
  reaper must reap;
- every `--owner-every` seconds registers an owner with a 2 s lease, begins
  work under it and lets it die, which must reap that work as owner-lost.

Every `--sample` seconds it writes one CSV row: the server's resident
memory, the database and WAL file sizes, the rows of each table, the
snapshot's counts, the calls done and failed, and the latency of the calls
in that interval as the client saw it; beside it, the server's own view of
the same interval from its request histogram (requests, the bucket holding
the 99th percentile, requests over a second) and how many `slow request`
warnings it logged, each naming what the store did meanwhile. A call slow
for the client and not for the server lost its time outside the server. At the end it plots the CSV to a PNG (needs matplotlib).

Not run in CI: see docs/reliability.md for the figures of one run.

    python3 tools/soak.py --bin target/release/inflight --duration 1h --out soak-out
"""

import argparse
import csv
import http.client
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import threading
import time

CONFIG = """\
[reap]
factor = 2
interval = "1s"
[retention]
keep = "{retention}"
[classes.embedding]
deadline = "2s"
[lanes."soak::ollama"]
cap = 64
"""

FIELDS = [
    "elapsed_s", "rss_kib", "db_kib", "wal_kib", "rows_activities", "rows_aggregates", "rows_owners",
    "in_flight", "total_activities", "total_succeeded", "total_reaped", "total_reaped_owner_lost",
    "calls_done", "calls_failed", "p50_ms", "p99_ms",
    "server_requests", "server_p99_ms", "server_over_1s", "slow_logged",
]

REQUEST_SERIES = "inflight_http_request_duration_seconds"


def request_buckets(text):
    """The server's request histogram, summed over its series: upper bound
    (seconds) to cumulative count."""
    buckets = {}
    for line in text.splitlines():
        if not line.startswith(REQUEST_SERIES + "_bucket{"):
            continue
        labels, value = line.rsplit(" ", 1)
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0) + int(float(value))
    return buckets


def server_interval(before, after):
    """What the server's own histogram says of the requests between two
    scrapes: how many, the 99th percentile's bucket bound (ms), and how many
    took over a second."""
    delta = {bound: after.get(bound, 0) - before.get(bound, 0) for bound in after}
    total = delta.get(float("inf"), 0)
    if total == 0:
        return 0, 0.0, 0
    p99 = next(bound for bound in sorted(delta) if delta[bound] >= 0.99 * total)
    over = total - delta.get(1.0, 0)
    return total, (p99 * 1000 if p99 != float("inf") else float("inf")), over


def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    if text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One keep-alive connection."""

    def __init__(self, port):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call_text(self, method, path):
        self.conn.request(method, path)
        response = self.conn.getresponse()
        return response.status, response.read().decode()

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if data else {}
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=data, headers=headers)
                response = self.conn.getresponse()
                payload = response.read()
                return response.status, (json.loads(payload) if payload else None)
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0
        self.failed = 0
        self.latencies = []

    def record(self, ok, seconds):
        with self.lock:
            if ok:
                self.done += 1
            else:
                self.failed += 1
            self.latencies.append(seconds)

    def take_latencies(self):
        with self.lock:
            latencies, self.latencies = self.latencies, []
        return sorted(latencies)


def worker(port, rate, leak, stop, stats):
    client = Client(port)
    interval = 1.0 / rate if rate > 0 else 0
    next_at = time.monotonic()
    spec = {"service": "soak", "provider": "ollama", "class": "embedding", "model": "nomic-embed-text"}
    while not stop.is_set():
        next_at += interval
        started = time.monotonic()
        ok = False
        try:
            status, record = client.call("POST", "/v1/activities", spec)
            if status == 201:
                activity = record["activityId"]
                status, _ = client.call("POST", f"/v1/activities/{activity}/start?wait=5s")
                if status == 200 and random.random() >= leak:
                    status, _ = client.call("POST", f"/v1/activities/{activity}/settle", {"success": True})
                ok = status == 200
        except (OSError, http.client.HTTPException, ValueError):
            ok = False
        stats.record(ok, time.monotonic() - started)
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()


def owners(port, every, stop):
    client = Client(port)
    while not stop.wait(every):
        try:
            status, owner = client.call("POST", "/v1/owners", {"name": "doomed", "ttlMs": 2000})
            if status != 201:
                continue
            for _ in range(5):
                spec = {"service": "soak", "provider": "ollama", "class": "embedding", "ownerId": owner["ownerId"]}
                status, record = client.call("POST", "/v1/activities", spec)
                if status == 201:
                    client.call("POST", f"/v1/activities/{record['activityId']}/start")
            # Never renewed: the owner dies, and its work is reaped owner-lost.
        except (OSError, http.client.HTTPException, ValueError):
            pass


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def size_kib(path):
    try:
        return os.path.getsize(path) // 1024
    except OSError:
        return 0


def rows(db):
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return [conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                for table in ("activities", "aggregates", "owners")]
    finally:
        conn.close()


def percentile(values, q):
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def plot(csv_path, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    with open(csv_path) as f:
        data = list(csv.DictReader(f))
    t = [float(r["elapsed_s"]) / 60 for r in data]
    col = lambda name: [float(r[name]) for r in data]  # noqa: E731
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharex=True)
    panels = [
        (axes[0][0], "memory (MiB)", [("server RSS", [v / 1024 for v in col("rss_kib")])]),
        (axes[0][1], "files (MiB)", [("database", [v / 1024 for v in col("db_kib")]),
                                     ("WAL", [v / 1024 for v in col("wal_kib")])]),
        (axes[1][0], "rows", [("activities", col("rows_activities")), ("aggregates", col("rows_aggregates")),
                              ("owners", col("rows_owners"))]),
        (axes[0][2], "records", [("in flight", col("in_flight")), ("reaped (total)", col("total_reaped"))]),
        (axes[1][1], "latency (ms) per interval", [("p50 call (client)", col("p50_ms")),
                                                   ("p99 call (client)", col("p99_ms")),
                                                   ("p99 request (server, bucket bound)", col("server_p99_ms"))]),
        (axes[1][2], "requests over a second per interval", [("server's histogram", col("server_over_1s")),
                                                            ("slow-request warnings", col("slow_logged"))]),
    ]
    for ax, title, series in panels:
        for label, values in series:
            ax.plot(t, values, label=label)
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    print(f"plot: {png_path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="target/release/inflight")
    parser.add_argument("--duration", default="1h", help="e.g. 90s, 10m, 1h")
    parser.add_argument("--rate", type=float, default=200, help="lifecycles a second, in all")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--leak", type=float, default=0.02, help="share of calls never settled")
    parser.add_argument("--owner-every", type=float, default=30, help="seconds between dying owners")
    parser.add_argument("--retention", default="5m", help="how long settled records are kept")
    parser.add_argument("--sample", type=float, default=10, help="seconds between samples")
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("--plot", metavar="CSV", help="only plot this CSV (to --out/soak.png), running nothing")
    args = parser.parse_args()
    if args.plot:
        os.makedirs(args.out, exist_ok=True)
        plot(args.plot, os.path.join(args.out, "soak.png"))
        return

    os.makedirs(args.out, exist_ok=True)
    db = os.path.join(os.path.abspath(args.out), "soak.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    config = os.path.join(args.out, "soak.toml")
    with open(config, "w") as f:
        f.write(CONFIG.format(retention=args.retention))
    port = free_port()
    log = open(os.path.join(args.out, "server.log"), "w")
    server = subprocess.Popen(
        [args.bin, "serve", "--config", config, "--listen", f"127.0.0.1:{port}",
         "--store", f"sqlite://{db}?synchronous=normal"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                Client(port).call("GET", "/healthz")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start; see server.log")
                time.sleep(0.1)

        stop = threading.Event()
        stats = Stats()
        threads = [threading.Thread(target=worker, args=(port, args.rate / args.workers, args.leak, stop, stats),
                                    daemon=True) for _ in range(args.workers)]
        threads.append(threading.Thread(target=owners, args=(port, args.owner_every, stop), daemon=True))
        for thread in threads:
            thread.start()

        csv_path = os.path.join(args.out, "soak.csv")
        reader = Client(port)
        log_path = os.path.join(args.out, "server.log")
        _, scraped = reader.call_text("GET", "/metrics")
        before, slow_lines = request_buckets(scraped), 0
        began = time.monotonic()
        duration = parse_duration(args.duration)
        with open(csv_path, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=FIELDS)
            out.writeheader()
            while True:
                time.sleep(args.sample)
                elapsed = time.monotonic() - began
                _, snap = reader.call("GET", "/v1/snapshot?limit=1&since=1m")
                latencies = stats.take_latencies()
                _, scraped = reader.call_text("GET", "/metrics")
                after = request_buckets(scraped)
                requests, server_p99, over = server_interval(before, after)
                before = after
                with open(log_path) as server_log:
                    logged = sum(1 for line in server_log if "slow request" in line)
                slow_logged, slow_lines = logged - slow_lines, logged
                activities, aggregates, owner_rows = rows(db)
                row = {
                    "elapsed_s": round(elapsed), "rss_kib": rss_kib(server.pid),
                    "db_kib": size_kib(db), "wal_kib": size_kib(db + "-wal"),
                    "rows_activities": activities, "rows_aggregates": aggregates, "rows_owners": owner_rows,
                    "in_flight": snap["totalInFlight"], "total_activities": snap["totalActivities"],
                    "total_succeeded": snap["totalSucceeded"], "total_reaped": snap["totalReaped"],
                    "total_reaped_owner_lost": snap["totalReapedOwnerLost"],
                    "calls_done": stats.done, "calls_failed": stats.failed,
                    "p50_ms": round(percentile(latencies, 0.5), 2), "p99_ms": round(percentile(latencies, 0.99), 2),
                    "server_requests": requests, "server_p99_ms": server_p99, "server_over_1s": over,
                    "slow_logged": slow_logged,
                }
                out.writerow(row)
                f.flush()
                print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                if elapsed >= duration:
                    break
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        plot(csv_path, os.path.join(args.out, "soak.png"))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
