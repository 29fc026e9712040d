#!/usr/bin/env python3
"""How stable each `inflight-bench` verdict is: run the benchmark several
times in a row and print one Markdown table of every case.

    python3 tools/bench_runs.py --bin target/release/inflight-bench --runs 10 -- --quick

Everything after `--` goes to each run. Each run's last line is its JSON
summary (`{"cases": [...]}`); the runs are kept in `--out` (one file per
run, `run-N.json`), so the table can be printed again from them with
`--from DIR` without running anything.

For every case the table gives the median of `ours` and of `baseline` over
the runs, the ratio of each run, the target, and in how many runs the
verdict was `ok`. Ratios are the benchmark's own (the median of its
interleaved pairs' ratios).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_once(binary, args, path):
    started = time.monotonic()
    output = subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout
    summary = next(line for line in reversed(output.splitlines()) if line.startswith("{"))
    with open(path, "w") as out:
        out.write(summary + "\n")
    return json.loads(summary), time.monotonic() - started


def fmt(value):
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def table(runs):
    names = []
    for run in runs:
        for case in run["cases"]:
            if case["name"] not in names:
                names.append(case["name"])
    lines = [
        "| case | ours (median) | baseline (median) | unit | ratio per run | target | ok in |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cases = [next((c for c in run["cases"] if c["name"] == name), None) for run in runs]
        present = [c for c in cases if c is not None]
        ours = statistics.median(c["ours"] for c in present)
        baselines = [c["baseline"] for c in present if c.get("baseline") is not None]
        baseline = statistics.median(baselines) if baselines else None
        ratios = ", ".join("-" if c is None or c.get("ratio") is None else f"{c['ratio']:.2f}x" for c in cases)
        ok = sum(1 for c in present if c.get("ok"))
        target = present[0].get("target") or "-"
        unit = present[0].get("unit") or ""
        lines.append(
            f"| `{name}` | {fmt(ours)} | {fmt(baseline)} | {unit} | {ratios} | {target} | {ok} of {len(cases)} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", default="target/release/inflight-bench")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="bench-runs")
    parser.add_argument("--from", dest="source", help="print the table of the runs kept in this directory")
    parser.add_argument("bench_args", nargs="*", help="arguments of each run, after --")
    options = parser.parse_args()

    if options.source:
        files = sorted(
            (f for f in os.listdir(options.source) if f.startswith("run-") and f.endswith(".json")),
            key=lambda f: int(f[4:-5]),
        )
        runs = [json.load(open(os.path.join(options.source, f))) for f in files]
    else:
        os.makedirs(options.out, exist_ok=True)
        runs = []
        for index in range(1, options.runs + 1):
            run, took = run_once(options.bin, options.bench_args, os.path.join(options.out, f"run-{index}.json"))
            failed = [c["name"] for c in run["cases"] if not c.get("ok")]
            load = os.getloadavg()[0]
            print(
                f"run {index}/{options.runs}: {took:.1f} s, load {load:.1f}, not ok: {', '.join(failed) or 'none'}",
                file=sys.stderr,
            )
            runs.append(run)
    if not runs:
        sys.exit("no runs")
    print(table(runs))


if __name__ == "__main__":
    main()
