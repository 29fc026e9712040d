// The wire: every route this client calls and every body it sends or reads,
// as docs/api.md and `GET /openapi.json` describe them.
//
// Each type's field names also exist as a runtime list (`FIELDS`), checked
// against the type at compile time both ways, so that the test suite can
// compare what the client sends and reads with the server's OpenAPI document.

/** A timestamp in a request: epoch milliseconds, an RFC 3339 string, or a Date. */
export type TimestampInput = number | string | Date;

/** The priorities a begin accepts (`unknown` is the default); the test suite compares them with the server's document. */
export const PRIORITIES = ["interactive", "batch", "unknown"] as const;
/** What a label must match, as the server's OpenAPI document says it (checked against it by the tests). */
export const LABEL_PATTERN = "^[A-Za-z0-9._-]{1,64}$";
export type Priority = (typeof PRIORITIES)[number];
/**
 * `queued`: admitted by the ledger (counts in its lane); `direct`: observed
 * only; `external`: admitted by the caller's own limiter, its start reported
 * as a fact (executing, it takes a slot of its lane's cap; waiting, it holds
 * no place in line; it is never refused). Servers before `external` refuse it (400).
 */
export type Admission = "queued" | "direct" | "external";
export type State = "waiting" | "executing" | "succeeded" | "failed" | "cancelled" | "reaped";
export type Disposition = "abandoned" | "unsettled";
export type ReapReason = "deadline" | "owner-lost";
export type FailureStage = "provider" | "queue" | "unknown";
export type OwnerState = "live" | "lost" | "released";

/** The server's stable error codes (`{"error": {"code": ...}}`). */
export const SERVER_ERROR_CODES = [
  "invalid_request",
  "unauthorized",
  "forbidden",
  "not_found",
  "method_not_allowed",
  "request_timeout",
  "conflict",
  "payload_too_large",
  "lane_full",
  "lane_cooling",
  "budget_exhausted",
  "idempotency_conflict",
  "internal",
  "unavailable",
  // The proxy's (`/proxy/NAME/...`); the client does not call it.
  "upstream_unreachable",
  "upstream_timeout",
] as const;
export type ServerErrorCode = (typeof SERVER_ERROR_CODES)[number];

/** `POST /v1/activities`. */
export interface BeginRequest {
  service: string;
  provider: string;
  class?: string;
  operationStage?: string;
  model?: string;
  priority?: Priority;
  admission?: Admission;
  enqueuedAt?: TimestampInput;
  startedAt?: TimestampInput;
  deadlineMs?: number;
  ownerId?: string;
  /**
   * The tokens the call is estimated to spend (prompt and answer), a whole
   * number from 0 to `MAX_USAGE_TOKENS`: executing, it reserves them in its
   * lane's token window (`Lane.tokensReserved`); ended without reported
   * usage after running, it is charged them. Left out (or `null`): the
   * class's configured `tokens`, else none. A server older than estimates
   * ignores it (and names it in `ignoredFields`).
   */
  maxTokens?: number | null;
}

/** `POST /v1/activities/{id}/start`. */
export interface StartRequest {
  startedAt?: TimestampInput;
}

/** `POST /v1/activities/{id}/settle`. */
export interface SettleRequest {
  success: boolean;
  failureStage?: FailureStage;
  completedAt?: TimestampInput;
  /**
   * A failure only: the provider's `Retry-After`, in milliseconds (an
   * integer, 1 to 3600000). The lane grants no new slot until
   * `completedAt` plus this (at most the lane's `max_cooldown`). The server
   * refuses it with a success (`InvalidRequestError`); one older than
   * cooldowns ignores it.
   */
  retryAfterMs?: number;
  /**
   * The tokens the call spent, as the provider reported them, with a
   * success or a failure alike. Each count is a whole number from 0 to
   * `MAX_USAGE_TOKENS`; one left out (or `null`) is not reported, as is a
   * `null` usage. A server older than usage ignores it.
   */
  usage?: Usage | null;
}

/** The most `retryAfterMs` a settle may carry: an hour. */
export const MAX_RETRY_AFTER_MS = 3_600_000;

/** A settle's `usage`: the tokens a call spent (either may be left out, or `null`: not reported). */
export interface Usage {
  /** The tokens of the prompt (the input). */
  inputTokens?: number | null;
  /** The tokens of the answer (the output). */
  outputTokens?: number | null;
}

/** The most tokens a settle's `usage` may report in one count: a billion. */
export const MAX_USAGE_TOKENS = 1_000_000_000;

/** `POST /v1/activities/{id}/cancel`. */
export interface CancelRequest {
  reason?: string;
}

/**
 * `POST /v1/activities/{id}/refine`: the model the call was dispatched to,
 * once it is known (a non-empty string, as a begin's `model`).
 */
export interface RefineRequest {
  model: string;
}

/** `POST /v1/owners`. */
export interface RegisterOwnerRequest {
  name: string;
  ttlMs?: number;
}

/** Every activity route answers with the record. */
export interface ActivityRecord {
  activityId: string;
  service: string;
  provider: string;
  class: string;
  operationStage: string;
  model: string;
  priority: Priority;
  admission: Admission;
  state: State;
  disposition: Disposition | null;
  reapReason: ReapReason | null;
  ownerId: string | null;
  enqueuedAt: string;
  startedAt: string | null;
  completedAt: string | null;
  reapedAt: string | null;
  deadlineMs: number;
  reapableAt: string | null;
  queueWaitMs: number | null;
  executionMs: number | null;
  success: boolean | null;
  failureStage: FailureStage | null;
  lateSettle: boolean;
  /**
   * Settled with success without ever starting (no `startedAt`): not a
   * normal completion. Absent from older servers (read it as false).
   */
  unstartedSuccess?: boolean;
  /**
   * Whether a refinement (`Activity.refine`) landed on the record: its
   * `model` is the refined one, or `unknown` after two different ones.
   * Absent from older servers (read it as false).
   */
  refined?: boolean;
  /**
   * The tokens the settle reported (`usage`), or `null` when none was
   * reported. A late settle (the record already reaped) keeps the first
   * late settle's. Absent from servers older than usage.
   */
  inputTokens?: number | null;
  outputTokens?: number | null;
  /**
   * The estimate in force: the begin's `maxTokens`, else its class's
   * `tokens`; `null` when neither. Absent from servers older than estimates.
   */
  maxTokens?: number | null;
  /** Present only when a cancel gave a reason. */
  cancelReason?: string;
  /** On a begin's answer only: the request's top-level fields this server does not know, and ignored. */
  ignoredFields?: string[];
  /**
   * The W3C `traceparent` its begin carried (`TRACEPARENT_HEADER`), whose
   * span is the parent of the span the server exports when the record ends.
   * Absent when the begin carried none, and from servers older than it.
   */
  traceparent?: string;
}

/** A registered owner and its lease. */
export interface Owner {
  ownerId: string;
  name: string;
  ttlMs: number;
  registeredAt: string;
  renewedAt: string;
  expiresAt: string;
  state: OwnerState;
  endedAt: string | null;
  reapedRecords: number;
  cancelledRecords: number;
}

/** Reaped records by disposition; also `POST /v1/reap`'s answer. */
export interface ReapCounts {
  abandoned: number;
  unsettled: number;
}

/** A lane's records of one priority. */
export interface LanePriorityCounts {
  executing: number;
  waiting: number;
}

/** A lane's records by priority (every priority is present). */
export type LaneByPriority = Record<Priority, LanePriorityCounts>;

/**
 * One lane of native admission, over its `queued` records. The fields of
 * cooldowns and ranked lanes (`coolingUntil`, `effectiveCap`, `cooldowns`,
 * `byPriority`), `tokensLastMinute`, `tokensReserved`, `tokensPerMinute`
 * and `providerTokensPerMinute` are absent from servers older than them.
 */
export interface Lane {
  service: string;
  provider: string;
  cap: number | null;
  executing: number;
  waiting: number;
  reaped: ReapCounts;
  reapedOwnerLost: number;
  lateSettles: number;
  resurrections: number;
  longestWaitMs: number;
  /**
   * While the lane cools down (after a failure settled with `retryAfterMs`):
   * when it grants again. `null` otherwise.
   */
  coolingUntil?: string | null;
  /** The cap admission applies now: `cap`, unless an adaptive lane lowered it; `null` with no cap. */
  effectiveCap?: number | null;
  /** How many cooldowns the lane ever began. */
  cooldowns?: number;
  /** `executing` and `waiting` by priority. */
  byPriority?: LaneByPriority;
  /** The tokens the lane's calls reported in the last minute (by the second of their settle). */
  tokensLastMinute?: number;
  /** The `maxTokens` estimates of the lane's executing calls. */
  tokensReserved?: number;
  /**
   * The lane's own token budget (`tokens_per_minute` in the server's
   * configuration); `null` when it has none. A start that would take the
   * lane past it is refused `budget_exhausted` (`BudgetExhaustedError`).
   */
  tokensPerMinute?: number | null;
  /**
   * Its provider's token budget, shared by every lane of the provider;
   * `null` when it has none. It refuses a start as the lane's own does.
   */
  providerTokensPerMinute?: number | null;
}

/** The counters of one combination of labels. */
export interface Aggregate {
  service: string;
  operationStage: string;
  class: string;
  provider: string;
  model: string;
  priority: Priority;
  admission: Admission;
  calls: number;
  successes: number;
  /** Of `successes`, records that never started (absent from older servers). */
  successesUnstarted?: number;
  failures: number;
  cancelled: number;
  reaped: ReapCounts;
  lateSettles: number;
  inFlight: number;
  avgQueueWaitMs: number | null;
  maxQueueWaitMs: number | null;
  avgExecutionMs: number | null;
  maxExecutionMs: number | null;
  lastSeenAt: string | null;
  /**
   * The sums of the tokens reported by the calls that ended in this
   * aggregate, late settles included (a call that reported none adds
   * nothing). Absent from servers older than usage.
   */
  inputTokens?: number;
  outputTokens?: number;
}

export interface InFlightRecord extends ActivityRecord {
  elapsedMs: number;
}

export interface ReapedRecord extends ActivityRecord {
  ageMs: number;
}

/** `GET /v1/snapshot`. */
export interface Snapshot {
  status: "ok" | "degraded";
  at: string;
  since: string;
  nativeAdmission: Record<string, Lane>;
  totalActivities: number;
  totalSucceeded: number;
  /** Of `totalSucceeded`, records that never started (absent from older servers). */
  totalSucceededUnstarted?: number;
  totalFailed: number;
  totalCancelled: number;
  totalInFlight: number;
  totalRecentCompletions: number;
  totalReaped: number;
  totalReapedOwnerLost: number;
  totalLateSettles: number;
  totalResurrections: number;
  reapedThisRead: ReapCounts;
  inFlight: InFlightRecord[];
  recentCompletions: ActivityRecord[];
  reaped: ReapedRecord[];
  inFlightTruncated: boolean;
  recentCompletionsTruncated: boolean;
  reapedTruncated: boolean;
  aggregates: Aggregate[];
  owners: Owner[];
  /** What the server's configuration and the window's calls do not match (absent from older servers). */
  warnings?: SnapshotWarning[];
}

/** A snapshot's warning: show a `code` this client does not know like any other. */
export interface SnapshotWarning {
  code: string;
  message: string;
}

export interface ErrorBody {
  error: { code: ServerErrorCode; message: string };
}

// Field lists: the same names at run time. `Exact` fails to compile when a
// list and its type disagree either way.
type Exact<T, L extends readonly string[]> = [keyof T] extends [L[number]]
  ? [L[number]] extends [keyof T]
    ? L
    : never
  : never;
function fields<T>() {
  return <const L extends readonly string[]>(list: Exact<T, L>): L => list;
}

const ACTIVITY_RECORD_FIELDS = fields<ActivityRecord>()([
  "activityId", "service", "provider", "class", "operationStage", "model", "priority", "admission",
  "state", "disposition", "reapReason", "ownerId", "enqueuedAt", "startedAt", "completedAt",
  "reapedAt", "deadlineMs", "reapableAt", "queueWaitMs", "executionMs", "success", "failureStage",
  "lateSettle", "unstartedSuccess", "refined", "inputTokens", "outputTokens", "maxTokens", "cancelReason",
  "ignoredFields", "traceparent",
]);
const REAP_COUNTS_FIELDS = fields<ReapCounts>()(["abandoned", "unsettled"]);

/**
 * What the client sends and reads, by the name of the server's type: the
 * test suite compares each list with the OpenAPI document.
 */
export const FIELDS = {
  BeginRequest: fields<BeginRequest>()([
    "service", "provider", "class", "operationStage", "model", "priority", "admission", "enqueuedAt",
    "startedAt", "deadlineMs", "ownerId", "maxTokens",
  ]),
  StartRequest: fields<StartRequest>()(["startedAt"]),
  SettleRequest: fields<SettleRequest>()(["success", "failureStage", "completedAt", "retryAfterMs", "usage"]),
  Usage: fields<Usage>()(["inputTokens", "outputTokens"]),
  CancelRequest: fields<CancelRequest>()(["reason"]),
  RefineRequest: fields<RefineRequest>()(["model"]),
  RegisterOwnerRequest: fields<RegisterOwnerRequest>()(["name", "ttlMs"]),
  ActivityRecord: ACTIVITY_RECORD_FIELDS,
  Owner: fields<Owner>()([
    "ownerId", "name", "ttlMs", "registeredAt", "renewedAt", "expiresAt", "state", "endedAt",
    "reapedRecords", "cancelledRecords",
  ]),
  ReapCounts: REAP_COUNTS_FIELDS,
  Lane: fields<Lane>()([
    "service", "provider", "cap", "executing", "waiting", "reaped", "reapedOwnerLost", "lateSettles",
    "resurrections", "longestWaitMs", "coolingUntil", "effectiveCap", "cooldowns", "byPriority",
    "tokensLastMinute", "tokensReserved", "tokensPerMinute", "providerTokensPerMinute",
  ]),
  LaneByPriority: fields<LaneByPriority>()(PRIORITIES),
  LanePriorityCounts: fields<LanePriorityCounts>()(["executing", "waiting"]),
  Aggregate: fields<Aggregate>()([
    "service", "operationStage", "class", "provider", "model", "priority", "admission", "calls",
    "successes", "successesUnstarted", "failures", "cancelled", "reaped", "lateSettles", "inFlight", "avgQueueWaitMs",
    "maxQueueWaitMs", "avgExecutionMs", "maxExecutionMs", "lastSeenAt", "inputTokens", "outputTokens",
  ]),
  InFlightRecord: fields<InFlightRecord>()([...ACTIVITY_RECORD_FIELDS, "elapsedMs"]),
  ReapedRecord: fields<ReapedRecord>()([...ACTIVITY_RECORD_FIELDS, "ageMs"]),
  Snapshot: fields<Snapshot>()([
    "status", "at", "since", "nativeAdmission", "totalActivities", "totalSucceeded",
    "totalSucceededUnstarted", "totalFailed",
    "totalCancelled", "totalInFlight", "totalRecentCompletions", "totalReaped", "totalReapedOwnerLost",
    "totalLateSettles", "totalResurrections", "reapedThisRead", "inFlight", "recentCompletions",
    "reaped", "inFlightTruncated", "recentCompletionsTruncated", "reapedTruncated", "aggregates",
    "owners", "warnings",
  ]),
  SnapshotWarning: fields<SnapshotWarning>()(["code", "message"]),
  ErrorBody: fields<ErrorBody>()(["error"]),
  ErrorDetail: fields<ErrorBody["error"]>()(["code", "message"]),
} as const;

/**
 * The header that makes a begin idempotent: the client sends a fresh random
 * UUID (v4) with each begin, and the same one when it sends that begin again
 * after a lost answer or a 5xx.
 */
export const IDEMPOTENCY_KEY_HEADER = "Idempotency-Key";

/**
 * The header of a begin's W3C trace context (Trace Context level 1,
 * `00-<trace id>-<span id>-<flags>`): the record keeps it, and the span the
 * server exports when the record ends is a child of that span. A malformed
 * one is refused (`InvalidRequestError`, its message starting
 * `traceparent: `). It is not part of an idempotent begin's request: a
 * retry sent from another span is the same begin.
 */
export const TRACEPARENT_HEADER = "traceparent";

/** Every route the client calls: method, path template, query parameters, header parameters. */
export const ROUTES = {
  begin: { method: "POST", path: "/v1/activities", query: ["start", "wait"], headers: [IDEMPOTENCY_KEY_HEADER, TRACEPARENT_HEADER] },
  get: { method: "GET", path: "/v1/activities/{id}", query: [], headers: [] },
  start: { method: "POST", path: "/v1/activities/{id}/start", query: ["wait"], headers: [] },
  settle: { method: "POST", path: "/v1/activities/{id}/settle", query: [], headers: [] },
  cancel: { method: "POST", path: "/v1/activities/{id}/cancel", query: [], headers: [] },
  refine: { method: "POST", path: "/v1/activities/{id}/refine", query: [], headers: [] },
  snapshot: { method: "GET", path: "/v1/snapshot", query: ["limit", "since"], headers: [] },
  reap: { method: "POST", path: "/v1/reap", query: [], headers: [] },
  registerOwner: { method: "POST", path: "/v1/owners", query: [], headers: [] },
  renewOwner: { method: "POST", path: "/v1/owners/{id}/renew", query: [], headers: [] },
  releaseOwner: { method: "DELETE", path: "/v1/owners/{id}", query: [], headers: [] },
  healthz: { method: "GET", path: "/healthz", query: [], headers: [] },
} as const satisfies Record<string, { method: string; path: string; query: readonly string[]; headers: readonly string[] }>;
export type RouteName = keyof typeof ROUTES;

/**
 * Routes the server has that this client deliberately does not call (they
 * are for people and scrapers). A route in the document that is in neither
 * list fails the check, so a new route is a decision, not an accident.
 */
export const ROUTES_NOT_CALLED = [
  "GET /",
  "GET /dashboard.js",
  "GET /dashboard.css",
  "GET /metrics",
  "GET /openapi.json",
] as const;
