// The live dashboard: reads /v1/snapshot every few seconds and redraws.
//
// Every value from the server is written with textContent or as an SVG
// attribute, never parsed as markup: labels come from callers, and a page
// an operator opens at 3 a.m. must not run what a caller sent. The
// server's Content-Security-Policy forbids inline scripts as well.
"use strict";

const REFRESH_MS = 3000;
// The history window the page reads: reaps, failures and idleness are
// judged within it.
const WINDOW_HOURS = 6;
// Enough to draw the reap chart and the oldest records without making
// every refresh heavy; the page says when a list was cut.
const LIMIT = 200;
const OLDEST_SHOWN = 15;
const REAPED_SHOWN = 20;
const MINUTE_MS = 60 * 1000;
const HOUR_MS = 60 * MINUTE_MS;
// How long a lane must be quiet to fold away; `?idle=` overrides.
const QUIET_DEFAULT_MS = 15 * MINUTE_MS;
const QUIET_CHOICES_MS = [5 * MINUTE_MS, 15 * MINUTE_MS, HOUR_MS, WINDOW_HOURS * HOUR_MS];
// Past the window the page cannot tell a quiet lane from an unseen one.
const QUIET_MIN_MS = MINUTE_MS;
const QUIET_MAX_MS = WINDOW_HOURS * HOUR_MS;
const SERIES = [
  { key: "abandoned-deadline", label: "abandoned, deadline" },
  { key: "unsettled-deadline", label: "unsettled, deadline" },
  { key: "abandoned-owner-lost", label: "abandoned, owner lost" },
  { key: "unsettled-owner-lost", label: "unsettled, owner lost" },
];
// Trouble, worst first: a lane ranks by its worst marker. COOLING and
// BUDGET FULL sit above SATURATED: each is why a lane grants nothing,
// whatever its slots.
const MARKERS = [
  { key: "over-cap", text: "OVER CAP" },
  { key: "cooling", text: "COOLING" },
  { key: "budget", text: "BUDGET FULL" },
  { key: "saturated", text: "SATURATED" },
  { key: "waiting", text: "WAITING" },
  { key: "failing", text: "FAILING" },
  { key: "reaped", text: "REAPED" },
];
const RANK = Object.fromEntries(MARKERS.map((m, i) => [m.key, i]));
const PRIORITIES = ["interactive", "batch", "unknown"];

// The token lives in this variable only: never in storage, never in the URL.
let token = null;
let timer = null;
let last = null;
let receivedAt = null;
let quietMs = QUIET_DEFAULT_MS;
let idleOpen = false;
// One row per lane, kept across refreshes and updated in place, so that a
// refresh with hundreds of lanes moves only what changed.
const laneRows = new Map();

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

// Writes only on change: an unchanged cell costs no layout.
function setText(node, text) {
  const value = text === undefined || text === null ? "" : String(text);
  if (node.textContent !== value) node.textContent = value;
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

// 150000 -> "2 min": the coarse span a tired reader takes in at a glance.
function span(ms) {
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h} h`;
  return `${Math.floor(h / 24)} d`;
}

// What is left of a cooldown, by the second: "19 s left", "4m05s left".
function timeLeft(ms) {
  if (ms <= 0) return "ending";
  return ms < MINUTE_MS ? `${Math.ceil(ms / 1000)} s left` : `${duration(ms)} left`;
}

function relative(thenMs, nowMs) {
  const ms = nowMs - thenMs;
  if (ms < 0) return `in ${span(-ms)}`;
  if (ms < 5000) return "just now";
  return `${span(ms)} ago`;
}

// UTC, as the server's logs and records are; the date only when not today.
function clock(thenMs, nowMs) {
  const iso = new Date(thenMs).toISOString();
  const today = new Date(nowMs).toISOString().slice(0, 10);
  return iso.slice(0, 10) === today ? `${iso.slice(11, 19)} UTC` : `${iso.slice(0, 10)} ${iso.slice(11, 16)} UTC`;
}

// A <time> holding "2 min ago" beside "03:12:04 UTC"; `node` is reused.
function when(node, thenMs, nowMs, unknown) {
  if (!node) node = el("time");
  if (!node.firstChild) {
    node.appendChild(el("span", undefined, "rel"));
    node.appendChild(el("span", undefined, "abs"));
  }
  const known = Number.isFinite(thenMs);
  setText(node.firstChild, known ? relative(thenMs, nowMs) : unknown || "");
  setText(node.lastChild, known ? clock(thenMs, nowMs) : "");
  const iso = known ? new Date(thenMs).toISOString() : "";
  if (node.getAttribute("datetime") !== iso) {
    node.setAttribute("datetime", iso);
    node.title = known ? new Date(thenMs).toString() : "";
  }
  return node;
}

// "10m", "90s", "1.5h" -> milliseconds, else null.
function parseQuiet(text) {
  const match = /^(\d+(?:\.\d+)?)(s|m|min|h)$/.exec(String(text || "").trim());
  if (!match) return null;
  const unit = match[2] === "s" ? 1000 : match[2] === "h" ? HOUR_MS : MINUTE_MS;
  return Math.min(QUIET_MAX_MS, Math.max(QUIET_MIN_MS, Math.round(Number(match[1]) * unit)));
}

function quietParam(ms) {
  return ms % HOUR_MS === 0 ? `${ms / HOUR_MS}h` : ms % MINUTE_MS === 0 ? `${ms / MINUTE_MS}m` : `${ms / 1000}s`;
}

function quietLabel(ms) {
  return ms % HOUR_MS === 0 ? `${ms / HOUR_MS} h` : ms % MINUTE_MS === 0 ? `${ms / MINUTE_MS} min` : `${ms / 1000} s`;
}

// The last 8 characters of an id: a UUIDv7's first ones are its timestamp,
// so records begun in the same millisecond share them.
function shortId(id) {
  return String(id).slice(-8);
}

function laneKey(record) {
  return `${record.service}::${record.provider}`;
}

function plural(n, one, many) {
  return `${n} ${n === 1 ? one : many}`;
}

// A bar whose parts and ticks are reused; `bar.update` moves them. With a
// cap, two ticks: the cap in force, and the declared cap, drawn only when
// an adaptive lane lowered the one below the other.
function makeBar(classNames, withCap) {
  const outer = el("div", undefined, "bar");
  const parts = classNames.map((name) => outer.appendChild(el("i", undefined, name)));
  const declared = withCap ? outer.appendChild(el("b", undefined, "declared-cap")) : null;
  const cap = withCap ? outer.appendChild(el("b", undefined, "cap")) : null;
  if (cap) cap.title = "cap";
  if (declared) declared.title = "declared cap";
  const tick = (node, fraction) => {
    node.hidden = fraction === null || fraction === undefined;
    if (!node.hidden) node.style.left = `calc(${(Math.min(1, fraction) * 100).toFixed(2)}% - 1px)`;
  };
  outer.update = (fractions, capFraction, classes, declaredFraction) => {
    let left = 0;
    fractions.forEach((fraction, i) => {
      const width = Math.max(0, Math.min(1 - left, fraction));
      parts[i].style.left = `${(left * 100).toFixed(2)}%`;
      parts[i].style.width = `${(width * 100).toFixed(2)}%`;
      if (classes && classes[i] && parts[i].className !== classes[i]) parts[i].className = classes[i];
      left += width;
    });
    if (cap) tick(cap, capFraction);
    if (declared) tick(declared, declaredFraction);
  };
  return outer;
}

// A lane's declared cap, and the cap in force: lower when an adaptive lane
// was lowered by a provider's refusals. A server older than `effectiveCap`
// sends only `cap`, which is then the cap in force.
function capsOf(lane) {
  const declared = lane && Number.isFinite(lane.cap) ? lane.cap : null;
  const inForce = lane && Number.isFinite(lane.effectiveCap) ? lane.effectiveCap : declared;
  return { declared, inForce, lowered: declared !== null && inForce !== null && inForce !== declared };
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

// Everything the snapshot says about each lane, in one pass over each
// section: its admission counts, failures and reaps in the window and ever,
// and its last call.
function summarizeLanes(s) {
  const nowMs = Date.parse(s.at);
  const lanes = new Map();
  const get = (key) => {
    let lane = lanes.get(key);
    if (!lane) {
      lane = {
        key,
        native: null,
        aggInFlight: 0,
        listedInFlight: 0,
        failedRecent: 0,
        reapedRecent: 0,
        failedEver: null,
        reapedEver: null,
        lastCallMs: null,
        lastReapMs: null,
        coolingUntilMs: null,
        // The smallest estimate of its records waiting, of those listed.
        waitingEstimate: null,
        budget: null,
      };
      lanes.set(key, lane);
    }
    return lane;
  };
  const latest = (current, iso) => {
    const ms = Date.parse(iso);
    return Number.isFinite(ms) && (current === null || ms > current) ? ms : current;
  };
  for (const [key, lane] of Object.entries(s.nativeAdmission || {})) {
    const entry = get(key);
    entry.native = lane;
    entry.reapedEver = lane.reaped.abandoned + lane.reaped.unsettled;
    // Cooling while its end is still ahead of the snapshot (a server older
    // than coolingUntil sends none).
    const until = lane.coolingUntil ? Date.parse(lane.coolingUntil) : NaN;
    entry.coolingUntilMs = until > nowMs ? until : null;
  }
  // Aggregates count both admissions; a lane's own counters only `queued`.
  const aggReaped = new Map();
  for (const aggregate of s.aggregates || []) {
    const key = laneKey(aggregate);
    const entry = get(key);
    entry.aggInFlight += aggregate.inFlight || 0;
    entry.failedEver = (entry.failedEver || 0) + (aggregate.failures || 0);
    aggReaped.set(key, (aggReaped.get(key) || 0) + aggregate.reaped.abandoned + aggregate.reaped.unsettled);
    if (aggregate.lastSeenAt) entry.lastCallMs = latest(entry.lastCallMs, aggregate.lastSeenAt);
  }
  for (const [key, reaped] of aggReaped) {
    const entry = lanes.get(key);
    entry.reapedEver = Math.max(entry.reapedEver || 0, reaped);
  }
  for (const record of s.inFlight || []) {
    const entry = get(laneKey(record));
    entry.listedInFlight += 1;
    if (record.state === "waiting") {
      const estimate = tokensOf(record.maxTokens);
      entry.waitingEstimate = entry.waitingEstimate === null ? estimate : Math.min(entry.waitingEstimate, estimate);
    }
  }
  for (const record of s.recentCompletions || []) {
    const entry = get(laneKey(record));
    if (record.state === "failed") entry.failedRecent += 1;
    if (record.completedAt) entry.lastCallMs = latest(entry.lastCallMs, record.completedAt);
  }
  for (const record of s.reaped || []) {
    const entry = get(laneKey(record));
    entry.reapedRecent += 1;
    entry.lastReapMs = latest(entry.lastReapMs, record.reapedAt);
  }
  const providerUse = providerTokens(s);
  for (const entry of lanes.values()) {
    const queued = entry.native ? entry.native.executing + entry.native.waiting : 0;
    entry.inFlight = Math.max(queued, entry.aggInFlight, entry.listedInFlight);
    entry.direct = Math.max(0, entry.inFlight - queued);
    entry.budget = budgetsOf(entry, providerUse);
    entry.markers = markersOf(entry);
  }
  return lanes;
}

// A token count from the snapshot, 0 when absent (a server older than the
// field, or a record without an estimate).
function tokensOf(value) {
  return Number.isFinite(value) && value > 0 ? value : 0;
}

// A budget from the snapshot: a number, else null (none declared, or a
// server older than budgets).
function budgetOf(value) {
  return Number.isFinite(value) && value >= 0 ? value : null;
}

// What a lane holds of its token window: charged in the last minute, and
// reserved by its calls executing.
function laneTokens(lane) {
  const charged = tokensOf(lane && lane.tokensLastMinute);
  const reserved = tokensOf(lane && lane.tokensReserved);
  return { charged, reserved, used: charged + reserved };
}

function providerOf(key, lane) {
  return lane && typeof lane.provider === "string" ? lane.provider : key.slice(key.lastIndexOf("::") + 2);
}

// Each provider's window, summed over its lanes in the snapshot: the use
// its shared budget is judged by.
function providerTokens(s) {
  const use = new Map();
  for (const [key, lane] of Object.entries(s.nativeAdmission || {})) {
    const provider = providerOf(key, lane);
    use.set(provider, (use.get(provider) || 0) + laneTokens(lane).used);
  }
  return use;
}

// A lane's token budgets, its own and its provider's (null each when none),
// with what each holds. A budget is full when its window holds all of it,
// or when it has no room for the smallest estimate of the lane's records
// waiting: a start is refused (budget_exhausted) then, as the server admits
// a start only while the window, the estimates ahead and its own fit.
function budgetsOf(entry, providerUse) {
  const lane = entry.native;
  if (!lane) return null;
  const own = budgetOf(lane.tokensPerMinute);
  const shared = budgetOf(lane.providerTokensPerMinute);
  if (own === null && shared === null) return null;
  const tokens = laneTokens(lane);
  const provider = providerOf(entry.key, lane);
  const blocked = lane.waiting > 0 && entry.waitingEstimate !== null;
  const full = (limit, used) => used >= limit || (blocked && used + entry.waitingEstimate > limit);
  const budget = { tokens, provider, lane: null, shared: null };
  if (own !== null) budget.lane = { limit: own, used: tokens.used, full: full(own, tokens.used) };
  if (shared !== null) {
    const used = providerUse.get(provider) || 0;
    // A lane with nothing in flight and none of the window is not held by
    // its provider's full budget, and is not marked for it.
    const concerned = entry.inFlight > 0 || tokens.used > 0;
    budget.shared = { limit: shared, used, full: full(shared, used), concerned };
  }
  return budget;
}

// Whether a budget refuses the lane's next start.
function budgetFull(entry) {
  const b = entry.budget;
  return !!b && ((b.lane !== null && b.lane.full) || (b.shared !== null && b.shared.full && b.shared.concerned));
}

function markersOf(entry) {
  const markers = [];
  const lane = entry.native;
  // Over the declared cap only: executing past a cap an adaptive lane just
  // lowered is what lowering does (those calls go on), not a fault. Full is
  // judged against the cap in force, which is what admits.
  const { declared, inForce } = capsOf(lane);
  const over = declared !== null && lane.executing > declared;
  if (over) markers.push("over-cap");
  if (entry.coolingUntilMs !== null) markers.push("cooling");
  const budget = budgetFull(entry);
  if (budget) markers.push("budget");
  if (!over && inForce !== null && lane.executing >= inForce && lane.waiting > 0) markers.push("saturated");
  // A cooling lane's waiters wait for the cooldown, which COOLING says;
  // those of a lane whose budget is full wait for tokens, which BUDGET FULL
  // says.
  else if (!over && entry.coolingUntilMs === null && !budget && lane && lane.waiting > 0) markers.push("waiting");
  if (entry.failedRecent > 0) markers.push("failing");
  if (entry.reapedRecent > 0) markers.push("reaped");
  return markers;
}

function rankOf(entry) {
  return entry.markers.length ? RANK[entry.markers[0]] : MARKERS.length;
}

// Worst first; within a rank, the worse first; ties by name.
function byTrouble(a, b) {
  const ra = rankOf(a);
  const rb = rankOf(b);
  if (ra !== rb) return ra - rb;
  const kind = a.markers[0];
  let diff = 0;
  if (kind === "over-cap") diff = b.native.executing - b.native.cap - (a.native.executing - a.native.cap);
  // The longest cooldown left first.
  if (kind === "cooling") diff = b.coolingUntilMs - a.coolingUntilMs;
  // The fullest budget first.
  if (kind === "budget") diff = fullness(b) - fullness(a);
  if (!diff && (kind === "over-cap" || kind === "cooling" || kind === "budget" || kind === "saturated" || kind === "waiting"))
    diff = b.native.longestWaitMs - a.native.longestWaitMs;
  if (kind === "failing") diff = b.failedRecent - a.failedRecent;
  if (kind === "reaped") diff = b.reapedRecent - a.reapedRecent;
  if (diff) return diff;
  return a.key < b.key ? -1 : a.key > b.key ? 1 : 0;
}

// How much of its fuller budget a lane's window holds, as a fraction.
function fullness(entry) {
  const b = entry.budget;
  if (!b) return 0;
  const of = (x) => (x === null ? 0 : x.limit > 0 ? x.used / x.limit : x.used > 0 ? Infinity : 1);
  return Math.max(of(b.lane), of(b.shared));
}

function isIdle(entry, nowMs) {
  if (entry.inFlight > 0 || entry.markers.length) return false;
  const lastMs = Math.max(entry.lastCallMs ?? -Infinity, entry.lastReapMs ?? -Infinity);
  return !(nowMs - lastMs <= quietMs);
}

function laneRow(key) {
  let r = laneRows.get(key);
  if (r) return r;
  const tr = document.createElement("tr");
  tr.dataset.lane = key;
  const td = (className) => {
    const cell = tr.appendChild(document.createElement("td"));
    if (className) cell.className = className;
    return cell;
  };
  r = {
    tr,
    name: td("lane-name"),
    markers: td("marks"),
    cap: td(),
    executing: td(),
    waiting: td(),
    load: td(),
    longestWait: td(),
    failed: td("num"),
    reaped: td("num"),
    last: td(),
    markerKey: null,
    coolingUntilMs: null,
    coolingAtMs: null,
  };
  r.name.textContent = key;
  r.markerList = r.markers.appendChild(el("span"));
  r.cooling = r.markers.appendChild(el("span", undefined, "cooling-left"));
  r.bar = makeBar(["executing", "waiting"], true);
  r.bar.classList.add("slots");
  r.load.appendChild(r.bar);
  r.priority = r.load.appendChild(el("div", undefined, "by-priority"));
  r.tokens = r.load.appendChild(el("div", undefined, "tokens"));
  // A budgeted lane's window against its budget, then against its
  // provider's: a thin bar each, the tick at the budget, hidden without.
  r.tokenBar = r.load.appendChild(tokenBar(["charged", "reserved"], "the lane's tokens_per_minute"));
  r.shared = r.load.appendChild(el("div", undefined, "shared-tokens"));
  r.sharedBar = r.load.appendChild(tokenBar(["lane-share", "others"], "the provider's tokens_per_minute"));
  r.time = r.last.appendChild(el("time"));
  for (const cell of [r.failed, r.reaped]) {
    cell.appendChild(el("span", undefined, "recent"));
    cell.appendChild(el("span", undefined, "ever"));
  }
  laneRows.set(key, r);
  return r;
}

function updateLaneRow(entry, nowMs) {
  const r = laneRow(entry.key);
  const lane = entry.native;
  const markerKey = entry.markers.join(" ");
  if (r.markerKey !== markerKey) {
    r.markerKey = markerKey;
    r.tr.className = entry.markers.length ? `trouble ${entry.markers[0]}` : "";
    r.tr.dataset.trouble = markerKey;
    r.markerList.replaceChildren(
      ...entry.markers.map((key) => el("span", MARKERS[RANK[key]].text, `marker ${key}`)),
    );
  }
  updateCooling(r, entry, nowMs);
  const budgetMarker = r.markerList.querySelector(".marker.budget");
  if (budgetMarker) {
    const title = budgetMarkerTitle(entry.budget);
    if (budgetMarker.title !== title) budgetMarker.title = title;
  }
  const direct = entry.direct ? ` +${entry.direct} direct` : "";
  if (lane) {
    const caps = capsOf(lane);
    // "2 of 4": the cap in force first, as it is the one that admits.
    setText(r.cap, caps.declared === null ? "none" : caps.lowered ? `${caps.inForce} of ${caps.declared}` : caps.declared);
    const capTitle = caps.lowered
      ? `cap in force ${caps.inForce}, of a declared ${caps.declared}: lowered by a provider's refusals ` +
        `(an adaptive lane); each run of ${caps.declared} successes gives one slot back`
      : "";
    if (r.cap.title !== capTitle) r.cap.title = capTitle;
    r.cap.classList.toggle("lowered", caps.lowered);
    setText(r.executing, `${lane.executing}${direct}`);
    setText(r.waiting, lane.waiting);
    const load = lane.executing + lane.waiting;
    const scale = Math.max(1, load, caps.declared || 0);
    r.bar.update(
      [lane.executing / scale, lane.waiting / scale],
      caps.inForce ? caps.inForce / scale : null,
      null,
      caps.lowered ? caps.declared / scale : null,
    );
    setText(r.longestWait, lane.waiting ? duration(lane.longestWaitMs) : "");
    updatePriority(r.priority, lane.byPriority);
    if (entry.budget && entry.budget.lane) updateLaneBudget(r, entry.budget);
    else {
      updateTokens(r.tokens, lane);
      r.tokenBar.hidden = true;
    }
    updateSharedBudget(r, entry.budget);
  } else {
    // A lane only `direct` calls use: no admission, so no cap or wait.
    setText(r.cap, "direct");
    if (r.cap.title) r.cap.title = "";
    r.cap.classList.remove("lowered");
    setText(r.executing, entry.inFlight ? `${entry.inFlight} direct` : "0");
    setText(r.waiting, "");
    r.bar.update([0, 0], null, null, null);
    updatePriority(r.priority, null);
    updateTokens(r.tokens, null);
    r.tokenBar.hidden = true;
    updateSharedBudget(r, null);
    setText(r.longestWait, "");
  }
  counts(r.failed, entry.failedRecent, entry.failedEver);
  counts(r.reaped, entry.reapedRecent, entry.reapedEver);
  when(r.time, entry.lastCallMs ?? NaN, nowMs, `not in ${WINDOW_HOURS} h`);
  return r.tr;
}

// "interactive 1/0 · batch 0/2": the lane's records executing/waiting by
// priority, leaving out a priority with none. Blank when no record in
// flight gives a priority (all `unknown`), as the counts beside it say all
// of it then; and from a server older than byPriority.
function updatePriority(node, byPriority) {
  const counts = PRIORITIES.map((name) => {
    const c = (byPriority && byPriority[name]) || {};
    return { name, executing: c.executing || 0, waiting: c.waiting || 0 };
  }).filter((c) => c.executing + c.waiting > 0);
  const shown = counts.some((c) => c.name !== "unknown");
  // No-break spaces keep each "batch 0/2" whole when the line wraps.
  setText(node, shown ? counts.map((c) => `${c.name}\u00a0${c.executing}/${c.waiting}`).join(" · ") : "");
  const title = shown
    ? "by priority, executing/waiting: " +
      counts.map((c) => `${c.name} ${c.executing} executing, ${c.waiting} waiting`).join("; ")
    : "";
  if (node.title !== title) node.title = title;
}

// Thousands separated, whatever the reader's locale: "1,176".
const COUNT = new Intl.NumberFormat("en-US");

// "1,176 tokens/min · 2,000 reserved": what the lane's calls charged in the
// last minute, then the estimates of its calls executing now, as the CLI's
// TOKENS/MIN column says it. Blank for a lane with neither (most lanes),
// and from a server older than the two fields.
function updateTokens(node, lane) {
  const charged = (lane && Number.isFinite(lane.tokensLastMinute) && lane.tokensLastMinute) || 0;
  const reserved = (lane && Number.isFinite(lane.tokensReserved) && lane.tokensReserved) || 0;
  const any = charged > 0 || reserved > 0;
  node.classList.remove("budgeted", "full");
  const text = any
    ? `${COUNT.format(charged)}\u00a0tokens/min` + (reserved > 0 ? ` · ${COUNT.format(reserved)}\u00a0reserved` : "")
    : "";
  setText(node, text);
  const title = any
    ? `${COUNT.format(charged)} tokens charged in the last minute by the lane's calls (what each reported at ` +
      `settle, else the estimate of a call that ran)` +
      (reserved > 0 ? `; ${COUNT.format(reserved)} reserved: the maxTokens estimates of its calls executing now` : "")
    : "";
  if (node.title !== title) node.title = title;
}

// Which budget is full, and by how much: the BUDGET FULL marker's title.
function budgetMarkerTitle(budget) {
  const full = [];
  if (budget.lane && budget.lane.full)
    full.push(`the lane's (${COUNT.format(budget.lane.used)} of ${COUNT.format(budget.lane.limit)} tokens/min)`);
  if (budget.shared && budget.shared.full && budget.shared.concerned)
    full.push(
      `${budget.provider}'s, shared by its lanes (${COUNT.format(budget.shared.used)} of ` +
        `${COUNT.format(budget.shared.limit)} tokens/min)`,
    );
  return (
    `token budget full: ${full.join(" and ")}. A start whose estimate does not fit is refused ` +
    `(budget_exhausted); records waiting keep their places until charges leave the minute or calls settle`
  );
}

// A thin bar of a token window: its parts, and one tick at the budget.
function tokenBar(classNames, budgetName) {
  const bar = makeBar(classNames, true);
  bar.classList.add("token-bar");
  bar.querySelector("b.cap").title = `budget: ${budgetName}`;
  bar.hidden = true;
  return bar;
}

// Draws `parts` (tokens) against `limit` on a token bar, scaled to hold the
// budget or the window, whichever is more; warning-styled when full.
function updateTokenBar(bar, parts, limit, full) {
  const scale = Math.max(1, limit, parts.reduce((a, b) => a + b, 0));
  bar.update(parts.map((part) => part / scale), limit / scale, null, null);
  bar.classList.toggle("full", full);
  bar.hidden = false;
}

// "800 of 1,000 tokens/min (800 reserved)": the lane's window, charged in
// the last minute and reserved by its calls executing, against its own
// budget; " · full" when a start would be refused.
function updateLaneBudget(r, budget) {
  const { tokens } = budget;
  const { limit, used, full } = budget.lane;
  setText(
    r.tokens,
    `${COUNT.format(used)} of ${COUNT.format(limit)}\u00a0tokens/min` +
      (tokens.reserved > 0 ? ` (${COUNT.format(tokens.reserved)}\u00a0reserved)` : "") +
      (full ? " · full" : ""),
  );
  const title =
    `the lane's token budget: ${COUNT.format(used)} of its ${COUNT.format(limit)} tokens a minute held, ` +
    `${COUNT.format(tokens.charged)} charged in the last minute and ${COUNT.format(tokens.reserved)} reserved ` +
    `by its calls executing` +
    (full
      ? `; full: a start whose estimate does not fit is refused (budget_exhausted) until charges leave ` +
        `the minute or calls settle`
      : "");
  if (r.tokens.title !== title) r.tokens.title = title;
  r.tokens.classList.add("budgeted");
  r.tokens.classList.toggle("full", full);
  updateTokenBar(r.tokenBar, [tokens.charged, tokens.reserved], limit, full);
}

// "1,300 of 3,000 tokens/min shared by openai's lanes · this lane 800": the
// provider's window, summed over its lanes in the snapshot, against its
// budget, and the lane's share of it. Blank for a lane whose provider has
// no budget.
function updateSharedBudget(r, budget) {
  const shared = budget && budget.shared;
  if (!shared) {
    setText(r.shared, "");
    if (r.shared.title) r.shared.title = "";
    r.shared.classList.remove("full");
    r.sharedBar.hidden = true;
    return;
  }
  const { limit, used, full } = shared;
  const share = budget.tokens.used;
  const provider = budget.provider;
  setText(
    r.shared,
    `${COUNT.format(used)} of ${COUNT.format(limit)}\u00a0tokens/min shared by ${provider}'s lanes · ` +
      `this lane ${COUNT.format(share)}` +
      (full ? " · full" : ""),
  );
  const title =
    `${provider}'s token budget, shared by every lane of ${provider}: ${COUNT.format(used)} of its ` +
    `${COUNT.format(limit)} tokens a minute held by its lanes (charged in the last minute and reserved), ` +
    `${COUNT.format(share)} of them by this lane` +
    (full
      ? `; full: a start of this lane whose estimate does not fit is refused (budget_exhausted) until ` +
        `charges leave the minute or calls settle`
      : "");
  if (r.shared.title !== title) r.shared.title = title;
  r.shared.classList.toggle("full", full);
  updateTokenBar(r.sharedBar, [share, Math.max(0, used - share)], limit, full);
}

// A cooling lane's time left, and the marker's title saying until when.
function updateCooling(r, entry, nowMs) {
  r.coolingUntilMs = entry.coolingUntilMs;
  r.coolingAtMs = nowMs;
  let title = "";
  if (entry.coolingUntilMs !== null) {
    const ever = entry.native.cooldowns;
    title =
      `cooling down after a provider's Retry-After until ${clock(entry.coolingUntilMs, nowMs)}: ` +
      `the lane grants no new slot until then` +
      (Number.isFinite(ever) ? ` (${plural(ever, "cooldown", "cooldowns")} ever)` : "");
  }
  const marker = r.markerList.querySelector(".marker.cooling");
  if (marker && marker.title !== title) marker.title = title;
  if (r.cooling.title !== title) r.cooling.title = title;
  tickCooling(r);
}

// Counts a cooldown down between refreshes, by the page's clock since the
// snapshot was read; the next refresh corrects it.
function tickCooling(r) {
  if (r.coolingUntilMs === null) {
    setText(r.cooling, "");
    return;
  }
  const since = receivedAt === null ? 0 : Math.max(0, Date.now() - receivedAt);
  setText(r.cooling, timeLeft(r.coolingUntilMs - r.coolingAtMs - since));
}

// "3 · 29 ever": the window's count, then the lane's counter; blank when
// both are nothing, so that trouble stands out.
function counts(cell, recent, ever) {
  const any = recent > 0 || ever > 0;
  setText(cell.firstChild, any ? recent : "");
  setText(cell.lastChild, ever > 0 ? ` · ${ever} ever` : "");
}

// Puts `rows` into `body` in order, moving only rows out of place: linear
// in the rows, where replacing the body would rebuild every one.
function arrange(body, rows) {
  let cursor = body.firstChild;
  for (const tr of rows) {
    if (tr === cursor) cursor = cursor.nextSibling;
    else body.insertBefore(tr, cursor);
  }
}

function renderLanes(s) {
  const nowMs = Date.parse(s.at);
  const lanes = summarizeLanes(s);
  for (const [key, r] of laneRows) {
    if (!lanes.has(key)) {
      r.tr.remove();
      laneRows.delete(key);
    }
  }
  const sorted = Array.from(lanes.values()).sort(byTrouble);
  const active = [];
  const idle = [];
  for (const entry of sorted) (isIdle(entry, nowMs) ? idle : active).push(updateLaneRow(entry, nowMs));
  // Active rows first: rows leaving for the idle body are moved by the second.
  arrange($("lanes-active"), active);
  arrange($("lanes-idle"), idle);

  $("lanes-empty").hidden = lanes.size > 0;
  $("lanes").hidden = lanes.size === 0;
  $("lanes-idle").hidden = !idleOpen || idle.length === 0;
  const toggle = $("idle-toggle");
  toggle.hidden = idle.length === 0;
  toggle.setAttribute("aria-expanded", String(idleOpen));
  setText(
    toggle,
    idleOpen
      ? `▾ Hide ${plural(idle.length, "idle lane", "idle lanes")}`
      : `▸ ${plural(idle.length, "idle lane", "idle lanes")} (no call for ${quietLabel(quietMs)}): show`,
  );
  toggle.dataset.count = String(idle.length);

  const note = $("completions-truncated");
  note.hidden = !s.recentCompletionsTruncated;
  if (s.recentCompletionsTruncated) {
    setText(
      note,
      `The failures per lane count the latest ${(s.recentCompletions || []).length} of ` +
        `${s.totalRecentCompletions} completions in the window; older ones are not listed.`,
    );
  }
  renderTrouble(sorted);
}

// One line under the header naming the lanes in trouble, worst first.
function renderTrouble(sorted) {
  const groups = MARKERS.map((m) => ({ marker: m, names: [] }));
  for (const entry of sorted) for (const key of entry.markers) groups[RANK[key]].names.push(entry.key);
  const parts = groups
    .filter((g) => g.names.length)
    .map((g) => {
      const shown = g.names.slice(0, 3).join(", ");
      const more = g.names.length > 3 ? ` and ${g.names.length - 3} more` : "";
      return `${g.marker.text.toLowerCase()}: ${shown}${more}`;
    });
  const line = $("trouble");
  line.hidden = parts.length === 0;
  setText(line, parts.length ? `Lanes in trouble — ${parts.join(" · ")}` : "");
}

// The snapshot's warnings (a misspelled lane, an unknown class): mistakes
// that pass silently otherwise and surface later as wrong numbers.
function renderWarnings(s) {
  const items = (s.warnings || []).map((warning) => {
    const li = document.createElement("li");
    li.dataset.code = warning.code;
    setText(li, warning.message);
    return li;
  });
  const list = $("warnings");
  list.replaceChildren(...items);
  list.hidden = items.length === 0;
}

function renderStatus(s) {
  const reaped = (s.reaped || []).length;
  const count = s.reapedTruncated ? `more than ${reaped}` : String(reaped);
  const thisRead = s.reapedThisRead ? s.reapedThisRead.abandoned + s.reapedThisRead.unsettled : 0;
  let text;
  if (s.status === "degraded") {
    text =
      reaped > 0
        ? `degraded: ${count} ${reaped === 1 && !s.reapedTruncated ? "record" : "records"} reaped in the last ` +
          `${WINDOW_HOURS} h — calls whose settle never came (deadline passed or owner lost); see “Reaped records” below.`
        : `degraded: records were reaped in the last ${WINDOW_HOURS} h — calls whose settle never came.`;
    if (thisRead) text += ` ${thisRead} reaped by this read.`;
  } else if (s.status === "ok") {
    text = `ok: nothing reaped in the last ${WINDOW_HOURS} h.`;
  } else {
    text = String(s.status);
  }
  setStatus(s.status, s.status, text);
}

function setStatus(kind, label, explanation) {
  const badge = $("status");
  setText(badge, label);
  badge.dataset.status = kind;
  badge.title = explanation;
  setText($("status-text"), explanation);
}

function seriesOf(record) {
  const reason = record.reapReason === "owner-lost" ? "owner-lost" : "deadline";
  return `${record.disposition || "abandoned"}-${reason}`;
}

function renderReapedList(s) {
  const nowMs = Date.parse(s.at);
  const all = s.reaped || [];
  const rows = all.slice(0, REAPED_SHOWN).map((record) => {
    const series = seriesOf(record);
    const reason = el("span", record.reapReason || "");
    reason.prepend(el("i", undefined, `swatch ${series}`));
    const tr = row([
      when(null, Date.parse(record.reapedAt), nowMs),
      laneKey(record),
      record.class,
      record.disposition || "",
      reason,
      shortId(record.activityId),
      record.lateSettle ? "yes" : "",
    ]);
    tr.dataset.series = series;
    tr.title = record.activityId;
    tr.dataset.activity = record.activityId;
    tr.dataset.lane = laneKey(record);
    return tr;
  });
  fill("reaped-list", rows, "reaped-list-empty");
  const more = all.length - rows.length;
  const note = $("reaped-list-more");
  const parts = [];
  if (more > 0) parts.push(`${plural(more, "older reaped record is", "older reaped records are")} not listed here; the chart below counts them per hour.`);
  if (s.reapedTruncated) parts.push(`The snapshot lists only the latest ${all.length} reaped records of the window.`);
  note.hidden = parts.length === 0;
  setText(note, parts.join(" "));
}

function renderReaps(s) {
  const now = Date.parse(s.at);
  const start = now - WINDOW_HOURS * HOUR_MS;
  const buckets = Array.from({ length: WINDOW_HOURS }, () => Object.fromEntries(SERIES.map((x) => [x.key, 0])));
  for (const record of s.reaped || []) {
    const at = Date.parse(record.reapedAt);
    if (!(at >= start && at <= now)) continue;
    const index = Math.min(WINDOW_HOURS - 1, Math.floor((at - start) / HOUR_MS));
    const key = seriesOf(record);
    if (key in buckets[index]) buckets[index][key] += 1;
  }
  const totals = buckets.map((b) => SERIES.reduce((sum, x) => sum + b[x.key], 0));
  const max = Math.max(1, ...totals);
  const width = 600;
  const height = 130;
  const plot = height - 18;
  const slot = width / WINDOW_HOURS;
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
    const hoursAgo = WINDOW_HOURS - i;
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
    const bound = reapable === null ? null : Math.max(1, reapable - enqueued);
    const fraction = bound === null ? 0 : elapsedMs / bound;
    const bar = makeBar(["age"], false);
    bar.update([fraction], null, [fraction >= 0.8 ? "age late" : "age"]);
    const tr = row([
      shortId(record.activityId),
      laneKey(record),
      record.class,
      record.state,
      clock(enqueued, now),
      duration(elapsedMs),
      bar,
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
    .map((owner) => {
      const expires = Date.parse(owner.expiresAt);
      const ended = owner.endedAt ? Date.parse(owner.endedAt) : NaN;
      const tr = row([
        shortId(owner.ownerId),
        owner.name,
        owner.state,
        owner.state === "live" ? when(null, expires, now) : Number.isFinite(ended) ? when(null, ended, now) : "",
        owner.reapedRecords,
        owner.cancelledRecords,
      ]);
      tr.title = owner.ownerId;
      tr.dataset.state = owner.state;
      return tr;
    });
  fill("owners", rows, "owners-empty");
}

function render(s) {
  renderStatus(s);
  renderWarnings(s);
  renderTotals(s);
  renderLanes(s);
  renderReapedList(s);
  renderReaps(s);
  renderInFlight(s);
  renderOwners(s);
  renderReadAt();
  $("main").hidden = false;
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
}

// "read 4 s ago · 03:12:04 UTC", ticking between refreshes, so that a page
// that stopped updating says so.
function renderReadAt() {
  if (!last) return;
  const age = Date.now() - receivedAt;
  const at = Date.parse(last.at);
  const node = $("read-at");
  setText(node, `read ${age < 5000 ? "just now" : `${span(age)} ago`} · ${clock(at, at)}`);
  node.classList.toggle("stale", age > 3 * REFRESH_MS);
}

function showError(message) {
  const error = $("error");
  error.textContent = message;
  error.hidden = !message;
  if (message) setStatus("error", "unreachable", message);
}

async function refresh() {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetch(`/v1/snapshot?limit=${LIMIT}&since=${WINDOW_HOURS}h`, { headers, cache: "no-store" });
    if (response.status === 401) {
      $("token-form").hidden = false;
      showError(token ? "The server refused that token." : "");
      setStatus("error", "token needed", "This server asks for a bearer token: enter it below.");
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
    last = snapshot;
    receivedAt = Date.now();
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

function setQuiet(ms) {
  quietMs = ms;
  for (const node of document.querySelectorAll(".quiet-label")) setText(node, quietLabel(ms));
  $("idle-quiet").value = String(ms);
}

// The usual choices, and the address's own value when it is another.
function quietChoices(initial) {
  const choices = QUIET_CHOICES_MS.includes(initial) ? QUIET_CHOICES_MS : [...QUIET_CHOICES_MS, initial];
  $("idle-quiet").replaceChildren(
    ...[...choices]
      .sort((a, b) => a - b)
      .map((choice) => {
        const option = el("option", quietLabel(choice));
        option.value = String(choice);
        return option;
      }),
  );
}

document.addEventListener("DOMContentLoaded", () => {
  $("interval").textContent = String(REFRESH_MS / 1000);
  for (const node of document.querySelectorAll(".window-hours")) node.textContent = String(WINDOW_HOURS);
  for (const node of document.querySelectorAll(".limit")) node.textContent = String(LIMIT);
  const params = new URLSearchParams(window.location.search);
  const initial = parseQuiet(params.get("idle")) ?? QUIET_DEFAULT_MS;
  quietChoices(initial);
  setQuiet(initial);
  $("idle-quiet").addEventListener("change", (event) => {
    setQuiet(Number(event.target.value));
    // Kept in the address so that a reload or a shared link keeps it.
    const url = new URL(window.location.href);
    url.searchParams.set("idle", quietParam(quietMs));
    history.replaceState(null, "", url);
    if (last) renderLanes(last);
  });
  $("idle-toggle").addEventListener("click", () => {
    idleOpen = !idleOpen;
    if (last) renderLanes(last);
  });
  $("token-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    token = $("token").value.trim() || null;
    $("token").value = "";
    await refresh();
  });
  setInterval(() => {
    renderReadAt();
    for (const r of laneRows.values()) if (r.coolingUntilMs !== null) tickCooling(r);
  }, 1000);
  refresh().then(schedule);
});
