// The live dashboard: reads /v1/snapshot every few seconds and redraws.
//
// Every value from the server is written with textContent or as an SVG
// attribute, never parsed as markup: labels come from callers, and a page
// an operator opens at 3 a.m. must not run what a caller sent. The
// server's Content-Security-Policy forbids inline scripts as well.
"use strict";

const REFRESH_MS = 3000;
const REAP_HOURS = 6;
// Enough to draw the reap chart and the oldest records without making
// every refresh heavy; the page says when a list was cut.
const LIMIT = 200;
const OLDEST_SHOWN = 15;
const SERIES = [
  { key: "abandoned-deadline", label: "abandoned, deadline" },
  { key: "unsettled-deadline", label: "unsettled, deadline" },
  { key: "abandoned-owner-lost", label: "abandoned, owner lost" },
  { key: "unsettled-owner-lost", label: "unsettled, owner lost" },
];

// The token lives in this variable only: never in storage, never in the URL.
let token = null;
let timer = null;

const $ = (id) => document.getElementById(id);

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell instanceof Node) td.appendChild(cell);
    else td.textContent = cell === undefined || cell === null ? "" : String(cell);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows, emptyId) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows);
  $(emptyId).hidden = rows.length > 0;
  $(tableId).hidden = rows.length === 0;
}

// 1234 ms -> "1.2s", 125000 -> "2m05s", 7200000 -> "2h00m".
function duration(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "";
  const sign = ms < 0 ? "-" : "";
  ms = Math.abs(ms);
  if (ms < 1000) return `${sign}${Math.round(ms)}ms`;
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${sign}${(ms / 1000).toFixed(1)}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${sign}${m}m${String(s % 60).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${sign}${h}h${String(m % 60).padStart(2, "0")}m`;
  return `${sign}${Math.floor(h / 24)}d${String(h % 24).padStart(2, "0")}h`;
}

// The last 8 characters of an id: a UUIDv7's first ones are its timestamp,
// so records begun in the same millisecond share them.
function shortId(id) {
  return String(id).slice(-8);
}

function bar(parts, capFraction) {
  const outer = el("div", undefined, "bar");
  let left = 0;
  for (const [fraction, className] of parts) {
    const width = Math.max(0, Math.min(1 - left, fraction));
    const part = el("i", undefined, className);
    part.style.left = `${(left * 100).toFixed(2)}%`;
    part.style.width = `${(width * 100).toFixed(2)}%`;
    outer.appendChild(part);
    left += width;
  }
  if (capFraction !== null && capFraction !== undefined) {
    const cap = el("b", undefined, "cap");
    cap.style.left = `calc(${(Math.min(1, capFraction) * 100).toFixed(2)}% - 1px)`;
    cap.title = "cap";
    outer.appendChild(cap);
  }
  return outer;
}

function renderTotals(s) {
  const items = [
    [s.totalInFlight, "in flight"],
    [s.totalActivities, "calls"],
    [s.totalSucceeded, "succeeded"],
    [s.totalFailed, "failed"],
    [s.totalCancelled, "cancelled"],
    [s.totalReaped, "reaped"],
    [s.totalReapedOwnerLost, "reaped, owner lost"],
    [s.totalLateSettles, "late settles"],
  ];
  $("totals").replaceChildren(
    ...items.map(([value, label]) => {
      const box = el("div");
      box.appendChild(el("b", value ?? 0));
      box.appendChild(el("span", label));
      return box;
    }),
  );
}

function renderLanes(s) {
  const lanes = Object.entries(s.nativeAdmission || {}).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const rows = lanes.map(([key, lane]) => {
    const load = lane.executing + lane.waiting;
    const scale = Math.max(1, load, lane.cap || 0);
    const reaped = lane.reaped.abandoned + lane.reaped.unsettled;
    const tr = row([
      key,
      lane.cap ?? "none",
      lane.executing,
      lane.waiting,
      bar(
        [
          [lane.executing / scale, "executing"],
          [lane.waiting / scale, "waiting"],
        ],
        lane.cap ? lane.cap / scale : null,
      ),
      duration(lane.longestWaitMs),
      reaped,
    ]);
    tr.dataset.lane = key;
    return tr;
  });
  fill("lanes", rows, "lanes-empty");
}

function seriesOf(record) {
  const reason = record.reapReason === "owner-lost" ? "owner-lost" : "deadline";
  return `${record.disposition || "abandoned"}-${reason}`;
}

function renderReaps(s) {
  const hourMs = 3600 * 1000;
  const now = Date.parse(s.at);
  const start = now - REAP_HOURS * hourMs;
  const buckets = Array.from({ length: REAP_HOURS }, () => Object.fromEntries(SERIES.map((x) => [x.key, 0])));
  for (const record of s.reaped || []) {
    const at = Date.parse(record.reapedAt);
    if (!(at >= start && at <= now)) continue;
    const index = Math.min(REAP_HOURS - 1, Math.floor((at - start) / hourMs));
    const key = seriesOf(record);
    if (key in buckets[index]) buckets[index][key] += 1;
  }
  const totals = buckets.map((b) => SERIES.reduce((sum, x) => sum + b[x.key], 0));
  const max = Math.max(1, ...totals);
  const width = 600;
  const height = 130;
  const plot = height - 18;
  const slot = width / REAP_HOURS;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "reaps per hour" });
  buckets.forEach((bucket, i) => {
    let y = plot;
    for (const series of SERIES) {
      const count = bucket[series.key];
      if (!count) continue;
      const h = (count / max) * (plot - 12);
      y -= h;
      const rect = svg("rect", { x: i * slot + 6, y, width: slot - 12, height: h, class: series.key });
      const title = svg("title");
      title.textContent = `${count} ${series.label}`;
      rect.appendChild(title);
      chart.appendChild(rect);
    }
    const label = svg("text", { x: i * slot + slot / 2, y: height - 4, "text-anchor": "middle" });
    const hoursAgo = REAP_HOURS - i;
    label.textContent = hoursAgo === 1 ? "last hour" : `${hoursAgo}h ago`;
    chart.appendChild(label);
    if (totals[i]) {
      const sum = svg("text", { x: i * slot + slot / 2, y: y - 3, "text-anchor": "middle" });
      sum.textContent = String(totals[i]);
      chart.appendChild(sum);
    }
  });
  chart.appendChild(svg("line", { x1: 0, x2: width, y1: plot, y2: plot, stroke: "currentColor", "stroke-opacity": 0.3 }));
  $("reap-chart").replaceChildren(chart);
  $("reap-chart").dataset.total = String(totals.reduce((a, b) => a + b, 0));
  $("reap-legend").replaceChildren(
    ...SERIES.map((series) => {
      const item = el("li", series.label);
      item.prepend(el("i", undefined, series.key));
      return item;
    }),
  );
  $("reaps-truncated").hidden = !s.reapedTruncated;
}

function renderInFlight(s) {
  const now = Date.parse(s.at);
  const oldest = (s.inFlight || [])
    .slice()
    .sort((a, b) => Date.parse(a.enqueuedAt) - Date.parse(b.enqueuedAt))
    .slice(0, OLDEST_SHOWN);
  // Records in flight carry their fields inline, with `elapsedMs`.
  const rows = oldest.map((record) => {
    const elapsedMs = record.elapsedMs;
    const enqueued = Date.parse(record.enqueuedAt);
    const reapable = record.reapableAt ? Date.parse(record.reapableAt) : null;
    const span = reapable === null ? null : Math.max(1, reapable - enqueued);
    const fraction = span === null ? 0 : elapsedMs / span;
    const tr = row([
      shortId(record.activityId),
      `${record.service}::${record.provider}`,
      record.class,
      record.state,
      duration(elapsedMs),
      bar([[fraction, fraction >= 0.8 ? "age late" : "age"]]),
      reapable === null ? "never" : duration(reapable - now),
    ]);
    tr.title = record.activityId;
    tr.dataset.activity = record.activityId;
    return tr;
  });
  fill("in-flight", rows, "in-flight-empty");
}

function renderOwners(s) {
  const now = Date.parse(s.at);
  const rows = (s.owners || [])
    .filter((owner) => owner.state === "live" || owner.state === "lost")
    .map((owner) =>
      row([
        shortId(owner.ownerId),
        owner.name,
        owner.state,
        owner.state === "live" ? `in ${duration(Date.parse(owner.expiresAt) - now)}` : "",
        owner.reapedRecords,
        owner.cancelledRecords,
      ]),
    );
  fill("owners", rows, "owners-empty");
}

function render(s) {
  $("status").textContent = s.status;
  $("status").dataset.status = s.status;
  $("read-at").textContent = `read at ${s.at}`;
  renderTotals(s);
  renderLanes(s);
  renderReaps(s);
  renderInFlight(s);
  renderOwners(s);
  $("main").hidden = false;
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
}

function showError(message) {
  const error = $("error");
  error.textContent = message;
  error.hidden = !message;
  if (message) {
    $("status").textContent = "unreachable";
    $("status").dataset.status = "error";
  }
}

async function refresh() {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetch(`/v1/snapshot?limit=${LIMIT}&since=${REAP_HOURS}h`, { headers, cache: "no-store" });
    if (response.status === 401) {
      $("token-form").hidden = false;
      showError(token ? "The server refused that token." : "");
      $("status").textContent = "token needed";
      $("status").dataset.status = "error";
      return;
    }
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try {
        const body = await response.json();
        if (body && body.error && body.error.message) message = `${body.error.code}: ${body.error.message}`;
      } catch (_) {
        // Not JSON: keep the status line.
      }
      showError(`The snapshot failed: ${message}`);
      return;
    }
    const snapshot = await response.json();
    $("token-form").hidden = true;
    showError("");
    render(snapshot);
  } catch (err) {
    showError(`The server cannot be reached (${err.message}); retrying every ${REFRESH_MS / 1000} s.`);
  }
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    await refresh();
    schedule();
  }, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("interval").textContent = String(REFRESH_MS / 1000);
  $("reap-hours").textContent = String(REAP_HOURS);
  $("token-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    token = $("token").value.trim() || null;
    $("token").value = "";
    await refresh();
  });
  refresh().then(schedule);
});
